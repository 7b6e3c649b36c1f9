#!/bin/bash
# The GPU checks of docs/gpu.md ("Measured"), as one script for a machine with an NVIDIA GPU.
#
#   bash tools/gpu_checks.sh            # from the repository root; about 6 to 9 minutes on one H100
#   PARTS='train|MPI' bash tools/gpu_checks.sh   # only the parts whose names match
#
# Runs: the GPU unit tests; the GPU MPI tests at 2 ranks; mpiopt train --device cuda on the text task at
# 2 ranks (bf16 and fp16, two algorithms), checkpointed and resumed, the resumed run's last checkpoint
# compared bitwise with the uninterrupted one's; the ddp baseline on NCCL; bench update --device cuda at
# d = 100M, with each variant's kernels, launches and host waits a step (--profile).  Each part has its own time limit; a failed part is named at the end and the exit code is 1.
# The log goes to $OUT/gpu_checks.log where OUT is set (else runs/gpu-checks/), with the benchmark's JSON.
#
# Where MPI is missing (an image with torch and cupy but no MPI library), wheels in .whl/ are installed
# first into /tmp/site: the mpich wheel (libmpi and mpiexec), mpi4py and pytest-mpi, e.g. fetched with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#       -d .whl mpich mpi4py pytest-mpi
# GPU_CHECKS_MPI=system takes the machine's own MPI instead (its mpiexec and the mpi4py that loads it; with
# Open MPI, run as root and oversubscribed), and installs only pytest-mpi from .whl/: the CUDA-aware path
# where that MPI is CUDA-aware, detected by mpiopt as a user's run would.  GPU_CHECKS_MPI=cuda-openmpi takes
# the CUDA-aware Open MPI 4.1 that tools/build_cuda_mpi.sh builds on any Linux machine into .cuda-mpi (carry
# it: about 9 MiB), with the machine's mpi4py (or .whl/'s) loading its libmpi: the CUDA-aware path for real.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-runs/gpu-checks}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_checks.log
WORK=$(mktemp -d /tmp/gpu-checks.XXXXXX)   # run folders and checkpoints (large: kept out of OUT)
exec > >(tee "$LOG") 2>&1
PY=$(command -v "${PYTHON:-python3}")   # a path: an mpiexec may start ranks with another PATH
export PYTHONUNBUFFERED=1 MPIOPT_WAIT_POLICY=${MPIOPT_WAIT_POLICY:-passive}

# ---- Environment ------------------------------------------------------------------------------
MPI_FROM=${GPU_CHECKS_MPI:-wheel}
if [[ $MPI_FROM == cuda-openmpi ]]; then
    P=$(realpath -e "${CUDA_MPI_PREFIX:-.cuda-mpi}") || { echo "no ${CUDA_MPI_PREFIX:-.cuda-mpi}: run tools/build_cuda_mpi.sh and carry it"; exit 1; }
    echo "== the CUDA-aware Open MPI in $P"
    export OPAL_PREFIX=$P PATH=$P/bin:$PATH LD_LIBRARY_PATH=$P/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export MPI4PY_MPIABI=openmpi MPI4PY_LIBMPI=$P/lib/libmpi.so.40   # mpi4py's PyPI wheel; a build for Open MPI takes LD_LIBRARY_PATH
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    "$PY" -c 'import mpi4py' 2>/dev/null || PYTHON_WHEELS=.whl/mpi4py-*.whl
    if compgen -G ".whl/pytest_mpi-*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-cuda-mpi \
            .whl/pytest_mpi-*.whl ${PYTHON_WHEELS:-} || exit 1
        export PYTHONPATH=/tmp/site-cuda-mpi${PYTHONPATH:+:$PYTHONPATH}
    fi
    # libcuda must load: without it this Open MPI runs as a plain one (and says so), yet still answers 1 to
    # MPIX_Query_cuda_support, which is compiled in.
    "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].rstrip("\0"))' || exit 1
    ompi_info --parsable --all | grep -aE '^mca:mpi:base:param:mpi_built_with_cuda_support:value|btl_smcuda_use_cuda_ipc:value'
elif [[ $MPI_FROM == system ]]; then
    echo "== the machine's own MPI"
    if compgen -G ".whl/pytest_mpi-*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-system .whl/pytest_mpi-*.whl || exit 1
        export PYTHONPATH=/tmp/site-system${PYTHONPATH:+:$PYTHONPATH}
    fi
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' || exit 1
    command -v ompi_info >/dev/null && ompi_info --parsable --all | grep -E 'mpi_built_with_cuda_support|accelerator' | head -5
elif compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing .whl/*.whl into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH   # the mpich wheel's mpiexec
    # mpi4py's wheel loads whichever libmpi it finds first; an image's own Open MPI would not match MPICH's mpiexec.
    # pip --target leaves the wheel's lib/ out, so libmpi is taken from the wheel itself.
    "$PY" -m zipfile -e .whl/mpich-*.whl /tmp/mpich-wheel
    LIBMPI=$(find /tmp/site /tmp/mpich-wheel -name 'libmpi.so.12' | head -1)
    echo "mpich's libmpi: ${LIBMPI:-not found}"
    export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI=$LIBMPI LD_LIBRARY_PATH=$(dirname "$LIBMPI")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIEXEC=$(command -v mpiexec || true)
# The C kernels are built for this Python here (a copy of the tree may carry another Python's).
"$PY" setup.py -q build_ext --inplace >"$WORK/build.log" 2>&1 || { echo "(C kernels not built: the array code runs instead)"; tail -5 "$WORK/build.log"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
SHARE=()
if [[ $GPUS -lt 2 ]]; then SHARE=(--share-gpus); fi   # 2 ranks on one GPU: sharing asked for
echo "mpiexec: ${MPIEXEC:-none}; GPUs: $GPUS; ${SHARE[*]:-one GPU per rank}"

failed=()
LIMIT=60
limited() { timeout --kill-after=10 "$LIMIT" "$@"; }
part() {  # part NAME SECONDS COMMAND...: a program under that time limit, or a function whose programs each take it
    local name=$1
    [[ -n ${PARTS:-} && ! $name =~ $PARTS ]] && return 0   # PARTS: a regular expression of the parts to run
    LIMIT=$2
    shift 2
    echo
    echo "== $name ($(date +%T), limit ${LIMIT} s each): $*"
    local started=$SECONDS runner=limited
    [[ $(type -t "$1") == function ]] && runner=
    if $runner "$@"; then
        echo "== $name: passed in $((SECONDS - started)) s"
    else
        echo "== $name: FAILED (exit $?) after $((SECONDS - started)) s"
        failed+=("$name")
    fi
}
mpi() { limited "$MPIEXEC" -n "$1" "${@:2}"; }
if [[ -z $MPIEXEC ]]; then
    echo "no mpiexec: the MPI parts fail (put the mpich, mpi4py and pytest-mpi wheels in .whl/)"
    mpi() { return 127; }
fi

# ---- The suite's GPU tests, then the benchmarks: most wanted first, should the run be cut short ----
part "unit GPU tests" 150 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_kernels.py tests/unit/test_buffers.py tests/unit/test_outer_step.py \
    tests/unit/test_codecs.py tests/unit/test_signs.py tests/unit/test_sparse.py tests/unit/test_sparse_device.py
bench_and_profile() {  # the per-algorithm ratios, then where each variant's step goes (torch.profiler), into the log too
    limited "$PY" -m mpiopt bench update --device cuda --d 100M --json "$OUT_DIR/bench-update-cuda.json" --profile "$OUT_DIR/profile-update-cuda.md" &&
        cat "$OUT_DIR/profile-update-cuda.md"
}
part "bench update --device cuda --d 100M, profiled" 200 bench_and_profile
# The MPI library's own GPU path (CUDA-aware where it is, detected): before the trainings, which take longest.
part "mpiopt info, 2 ranks" 40 mpi 2 "$PY" -m mpiopt info --elements 1048576
part "MPI GPU tests, 2 ranks" 150 mpi 2 "$PY" tools/run_mpi_pytest.py -q tests/mpi/test_comm_gpu.py tests/mpi/test_algorithms_gpu.py tests/mpi/test_staging.py

# ---- Training on the GPU, checkpointed and resumed bitwise ------------------------------------
TEXT=(-m mpiopt train --device cuda --dataset text --model gpt --n-layer 4 --n-embd 256 --n-head 4 --block-size 128
      --batch-size 16 --dropout 0.1 --steps 40 --eval-every 20 --checkpoint-every 20 --progress lines "${SHARE[@]}")
same_checkpoints() {  # same_checkpoints A B: the two files' model and every rank's state bitwise equal
    limited "$PY" - "$1" "$2" <<'EOF'
import sys, h5py
from mpiopt.checkpoint import first_difference
from mpiopt.checkpoint.layout import read_group
def read(path):
    with h5py.File(path, "r") as f:
        return {"model": read_group(f["model"]), "ranks": read_group(f["ranks"]), "precision": f.attrs["precision"]}
a, b = read(sys.argv[1]), read(sys.argv[2])
difference = first_difference(a, b)
print(f"precision {a['precision']}: " + ("bitwise equal" if difference is None else f"DIFFERENT at {difference}"))
sys.exit(difference is not None)
EOF
}
train_and_resume() {  # train_and_resume NAME FLAGS...: 40 steps whole, and from the checkpoint after step 20
    local name=$1 dir=$WORK/$1
    shift
    mpi 2 "$PY" "${TEXT[@]}" "$@" --out "$dir/whole" || return 1
    mpi 2 "$PY" "${TEXT[@]}" "$@" --out "$dir/resumed" --resume "$dir/whole/checkpoints/ckpt-000000020.h5" || return 1
    grep -h '"device"' "$dir/whole/metrics.jsonl" | head -1 | "$PY" -c 'import json, sys; print("trained on", json.loads(sys.stdin.read())["device"])'
    same_checkpoints "$dir/whole/checkpoints/ckpt-000000040.h5" "$dir/resumed/checkpoints/ckpt-000000040.h5"
}
part "train bf16 sparseloco+adamw, 2 ranks, resume" 120 train_and_resume bf16-sparseloco --precision bf16 --algorithm sparseloco --optimizer adamw --hp period=8
part "train topk, 2 ranks, resume" 120 train_and_resume topk --algorithm topk
part "train regtopk, 2 ranks, resume" 120 train_and_resume regtopk --algorithm regtopk
part "train bf16 sgd+adamw, 2 ranks, resume" 120 train_and_resume bf16-sgd --precision bf16 --algorithm sgd --optimizer adamw --clip-grad-norm 1.0
part "bench staging, 2 ranks on one GPU" 60 mpi 2 "$PY" -m mpiopt bench staging --json "$OUT_DIR/bench-staging.json"
part "train bf16 diloco+adamw, 2 ranks, resume" 120 train_and_resume bf16-diloco --precision bf16 --algorithm diloco --optimizer adamw --hp period=8
part "train fp16 sgd, 2 ranks, resume" 120 train_and_resume fp16-sgd --precision fp16 --algorithm sgd
# NCCL takes one GPU per rank: 2 ranks where there are 2 GPUs, else 1 (ddp takes no checkpoints).
DDP=(-m mpiopt train --device cuda --precision bf16 --dataset text --model gpt --n-layer 4 --n-embd 256 --n-head 4
     --block-size 128 --batch-size 16 --steps 20 --eval-every 20 --progress lines --algorithm ddp "${SHARE[@]}")
part "ddp baseline on NCCL" 90 mpi $((GPUS >= 2 ? 2 : 1)) "$PY" "${DDP[@]}" --out "$WORK/ddp"

echo
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/GPU: /'
echo "date: $(date -u +%FT%TZ); log: $LOG"
rm -rf "$WORK"
if [[ ${#failed[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all GPU checks passed"
