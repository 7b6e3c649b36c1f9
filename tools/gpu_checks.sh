#!/bin/bash
# The GPU checks of docs/gpu.md ("Measured"), as one script for a machine with an NVIDIA GPU.
#
#   bash tools/gpu_checks.sh            # from the repository root; within 8 minutes on one H200
#   PARTS='train|MPI' bash tools/gpu_checks.sh   # only the parts whose names match
#
# First the checks, side by side (none is timed, and one GPU and 16 cores hold them all): the GPU unit tests;
# mpiopt info and the GPU MPI tests at 2 ranks; mpiopt train --device cuda on the text task at 2 ranks (bf16
# and fp16, several algorithms), checkpointed and resumed, the resumed run's last checkpoint compared bitwise
# with the uninterrupted one's; the ddp baseline on NCCL.  Their logs follow in order once all have ended.
# Then the measurements, one at a time on an otherwise idle machine: bench update --device cuda at d = 100M,
# with each variant's kernels, launches and host waits a step (--profile), and bench staging.  Each part has
# its own time limit; a failed part is named at the end and the exit code is 1.
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
    # CMA (process_vm_readv) can be refused in a VM or container; copies through shared memory always work
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
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
        echo "$name" >>"$WORK/failed"   # a file: a part in the background is a subshell
    fi
}
LOGS=() PIDS=()
beside() {  # beside NAME SECONDS COMMAND...: part in the background, its output held in a log of its own
    [[ -n ${PARTS:-} && ! $1 =~ $PARTS ]] && return 0
    local log=$WORK/part-${#LOGS[@]}.log
    echo "started: $1"
    # some 20 processes share the cores: the work is the GPU's
    (export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}; part "$@") >"$log" 2>&1 &
    LOGS+=("$log") PIDS+=($!)
}
gather() {  # waits for the parts started beside, then shows their logs in the order they were started
    local started=$SECONDS log
    [[ ${#PIDS[@]} -gt 0 ]] && wait "${PIDS[@]}"
    echo "== ${#LOGS[@]} parts side by side ended in $((SECONDS - started)) s"
    for log in "${LOGS[@]}"; do cat "$log"; done
    LOGS=() PIDS=()
}
mpi() { limited "$MPIEXEC" -n "$1" "${@:2}"; }
if [[ -z $MPIEXEC ]]; then
    echo "no mpiexec: the MPI parts fail (put the mpich, mpi4py and pytest-mpi wheels in .whl/)"
    mpi() { return 127; }
fi

# ---- The checks, side by side: correctness only, so that sharing the GPU and the cores changes no result ---
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
mpi_gpu() {  # the MPI library's own GPU path (CUDA-aware where it is, detected, not forced); the tests run either way
    mpi 2 "$PY" -m mpiopt info --elements 1048576
    local info=$?
    mpi 2 "$PY" tools/run_mpi_pytest.py -q tests/mpi/test_comm_gpu.py tests/mpi/test_algorithms_gpu.py tests/mpi/test_staging.py &&
        return $info
}
# NCCL takes one GPU per rank: 2 ranks where there are 2 GPUs, else 1 (ddp takes no checkpoints).
DDP=(-m mpiopt train --device cuda --precision bf16 --dataset text --model gpt --n-layer 4 --n-embd 256 --n-head 4
     --block-size 128 --batch-size 16 --steps 20 --eval-every 20 --progress lines --algorithm ddp "${SHARE[@]}")
echo
echo "== the checks side by side ($(date +%T)); their logs follow when all have ended"
UNIT=tests/unit
beside "unit GPU tests: kernels" 240 "$PY" -m pytest -q -p no:cacheprovider $UNIT/test_cuda_kernels.py \
    $UNIT/test_sparse_device.py $UNIT/test_sparse.py
beside "unit GPU tests: codecs, signs, buffers, outer step" 240 "$PY" -m pytest -q -p no:cacheprovider \
    $UNIT/test_codecs.py $UNIT/test_signs.py $UNIT/test_buffers.py $UNIT/test_outer_step.py
beside "mpiopt info and MPI GPU tests, 2 ranks" 200 mpi_gpu
beside "train topk, 2 ranks, resume" 200 train_and_resume topk --algorithm topk
beside "train regtopk, 2 ranks, resume" 200 train_and_resume regtopk --algorithm regtopk
beside "train bf16 sparseloco+adamw, 2 ranks, resume" 200 train_and_resume bf16-sparseloco --precision bf16 \
    --algorithm sparseloco --optimizer adamw --hp period=8
beside "train bf16 sgd+adamw, 2 ranks, resume" 200 train_and_resume bf16-sgd --precision bf16 --algorithm sgd \
    --optimizer adamw --clip-grad-norm 1.0
beside "train bf16 diloco+adamw, 2 ranks, resume" 200 train_and_resume bf16-diloco --precision bf16 --algorithm diloco \
    --optimizer adamw --hp period=8
beside "train fp16 sgd, 2 ranks, resume" 200 train_and_resume fp16-sgd --precision fp16 --algorithm sgd
beside "ddp baseline on NCCL" 120 mpi $((GPUS >= 2 ? 2 : 1)) "$PY" "${DDP[@]}" --out "$WORK/ddp"
gather

# ---- The measurements, one at a time on the otherwise idle machine ----------------------------
part "bench update --device cuda --d 100M" 200 "$PY" -m mpiopt bench update --device cuda --d 100M \
    --json "$OUT_DIR/bench-update-cuda.json"
# Where each variant's step goes (torch.profiler), into the log too: a run of its own, so that the ratios stand alone.
profiled() { limited "$PY" -m mpiopt bench update --device cuda --d 100M --rounds 1 --profile "$1" && cat "$1"; }
part "bench update --device cuda --d 100M --profile" 200 profiled "$OUT_DIR/profile-update-cuda.md"
part "bench staging, 2 ranks on one GPU" 60 mpi 2 "$PY" -m mpiopt bench staging --json "$OUT_DIR/bench-staging.json"

echo
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/GPU: /'
echo "date: $(date -u +%FT%TZ); log: $LOG"
failed=$(cat "$WORK/failed" 2>/dev/null)
rm -rf "$WORK"
if [[ -n $failed ]]; then
    echo "$failed" | sed 's/^/FAILED: /'
    exit 1
fi
echo "all GPU checks passed"
