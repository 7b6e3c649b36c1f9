#!/bin/bash
# Builds a CUDA-aware Open MPI 4.1 on a machine without a GPU, CUDA toolkit or driver, to carry to a GPU
# machine for tools/gpu_checks.sh (GPU_CHECKS_MPI=cuda-openmpi): the CUDA-aware path that a non-CUDA-aware image MPI
# cannot test.  Open MPI 4.1's CUDA support (common_cuda, the smcuda BTL, coll/cuda) needs only cuda.h to
# build, taken here from the nvidia-cuda-runtime-cu12 wheel, and dlopens libcuda.so.1 at run time: without a
# driver it runs as a plain MPI (with a warning; OMPI_MCA_opal_warn_on_missing_libcuda=0 silences it).
# The source is Debian's openmpi 4.1.x source package, its upstream tarball without Debian's patches.
#
#   bash tools/build_cuda_mpi.sh [PREFIX]   # PREFIX defaults to .cuda-mpi at the repository root
#
# About 5 minutes on 2 cores (configure 1.5, make and install 3.5); about 9 MiB installed, needing only
# libc (glibc >= 2.36), libm and libz.  Does nothing when PREFIX's ompi_info already reports CUDA support.
# Needs: a C compiler, make, tar/xz, python3 with pip (PyPI), apt-get with Debian's sources (root, to add a
# deb-src entry when none is set), or OMPI_TARBALL=an Open MPI 4.1 tarball instead.  JOBS sets make -j (2).
# The prefix is relocatable; wherever it lies (e.g. copied to the GPU machine), use it with
#   export OPAL_PREFIX=$P PATH=$P/bin:$PATH LD_LIBRARY_PATH=$P/lib   # P: the prefix, an absolute path
# so that an mpi4py built for Open MPI (libmpi.so.40) loads this libmpi (mpi4py's PyPI wheel: also
# MPI4PY_MPIABI=openmpi).  Without OPAL_PREFIX a moved prefix looks for its components at the old path.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${1:-$ROOT/.cuda-mpi}
mkdir -p "$(dirname "$PREFIX")" && PREFIX=$(cd "$(dirname "$PREFIX")" && pwd)/$(basename "$PREFIX")
BUILD=${BUILD_DIR:-${TMPDIR:-/tmp}/mpiopt-cuda-mpi-build}
die() { echo "build_cuda_mpi.sh: $*" >&2; exit 1; }

cuda_ok() {   # ompi_info of PREFIX, run from PREFIX wherever it lies, says the library was built with CUDA support
    [[ -x $PREFIX/bin/ompi_info ]] && OPAL_PREFIX=$PREFIX LD_LIBRARY_PATH=$PREFIX/lib "$PREFIX/bin/ompi_info" \
        --parsable --all 2>/dev/null | grep -x 'mca:mpi:base:param:mpi_built_with_cuda_support:value:true' >/dev/null
}   # (not grep -q: with pipefail, ompi_info's SIGPIPE would fail the test)
if cuda_ok; then echo "$PREFIX already holds a CUDA-aware Open MPI: nothing to do"; exit 0; fi
if [[ -e $PREFIX ]]; then   # a failed earlier build is replaced; anything else is left alone
    [[ -e $PREFIX/bin/ompi_info || -z $(ls -A "$PREFIX") ]] || die "$PREFIX exists and is not an Open MPI prefix: remove it or name another"
    rm -rf "$PREFIX"
fi
for tool in cc make tar xz python3 strip; do
    command -v "$tool" >/dev/null || die "missing '$tool' (Debian: apt-get install build-essential xz-utils python3-pip)"
done
python3 -m pip --version >/dev/null 2>&1 || die "missing pip for python3 (needed to fetch cuda.h from PyPI)"
rm -rf "$BUILD" && mkdir -p "$BUILD" && cd "$BUILD"
SECONDS=0

# 1. cuda.h: the CUDA 12 runtime wheel holds the driver API header; CUDA 13 drivers still serve its (versioned) symbols.
python3 -m pip download -q --no-deps --only-binary=:all: -d nv "${CUDA_HEADERS_PKG:-nvidia-cuda-runtime-cu12}" \
    || die "could not download ${CUDA_HEADERS_PKG:-nvidia-cuda-runtime-cu12} from PyPI (for cuda.h)"
python3 -m zipfile -e nv/*.whl nv/whl
mkdir -p cuda && ln -s "$BUILD/nv/whl/nvidia/cuda_runtime/include" cuda/include   # the DIR/include/cuda.h layout --with-cuda wants
[[ -f cuda/include/cuda.h ]] || die "no nvidia/cuda_runtime/include/cuda.h in $(ls nv/*.whl)"

# 2. The source: Debian's upstream tarball (apt-get source needs a deb-src entry; one is derived from the deb ones).
if [[ -n ${OMPI_TARBALL:-} ]]; then
    TARBALL=$(realpath -e "$OMPI_TARBALL") || die "OMPI_TARBALL=$OMPI_TARBALL not found"
else
    command -v apt-get >/dev/null || die "no apt-get to fetch Debian's openmpi source: set OMPI_TARBALL=openmpi-4.1.x.tar.*"
    if ! grep -rqsE '^[[:space:]]*(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        [[ $(id -u) == 0 ]] || die "apt has no deb-src entry and adding one needs root (or set OMPI_TARBALL)"
        # Debian's own entries only: a third-party repository without sources would make apt-get update fail.
        for f in /etc/apt/sources.list.d/*.sources; do [[ ! -f $f ]] || { cat "$f"; echo; }; done | awk -v RS= '/debian/ && /Types:[ \t]*deb[ \t]*\n/ {
            sub(/Types:[ \t]*deb[ \t]*\n/, "Types: deb-src\n"); print $0 "\n" }' > /etc/apt/sources.list.d/mpiopt-deb-src.sources
        { grep -sE '^deb .*debian' /etc/apt/sources.list || true; } | sed 's/^deb /deb-src /' > /etc/apt/sources.list.d/mpiopt-deb-src.list
        [[ -s /etc/apt/sources.list.d/mpiopt-deb-src.sources || -s /etc/apt/sources.list.d/mpiopt-deb-src.list ]] \
            || die "no Debian apt entry to derive a deb-src entry from (or set OMPI_TARBALL)"
        find /etc/apt/sources.list.d -name 'mpiopt-deb-src.*' -empty -delete
        apt-get update -qq || die "apt-get update failed after adding a deb-src entry"
    fi
    apt-get source -qq --download-only openmpi >apt-source.log 2>&1 || { cat apt-source.log; die "apt-get source openmpi failed"; }
    TARBALL=$(ls "$BUILD"/openmpi_4.1.*.orig.tar.* 2>/dev/null | head -1)
    [[ -n $TARBALL ]] || die "Debian's openmpi source is not 4.1.x ($(ls openmpi_*.dsc)): set OMPI_TARBALL to an Open MPI 4.1 tarball"
fi
tar -xf "$TARBALL" && SRC=$(ls -d "$BUILD"/openmpi-4.1.*/ | head -1) && [[ -x $SRC/configure ]] \
    || die "no openmpi-4.1.x/configure in $TARBALL"
echo "== Open MPI $(basename "$SRC"), cuda.h of $(basename nv/*.whl)"

# 3. Configure, build, install.  ob1 with smcuda/vader/tcp/self: no UCX, verbs, OFI; hwloc, libevent and PMIx
# are the bundled ones so that the prefix carries no dependency beyond libc/libm/libz.  ROMIO is left out:
# ompio serves MPI-IO, and the build is half as long.
mkdir -p build && cd build
run() { local log=$1; shift; "$@" >"$BUILD/$log" 2>&1 || { tail -30 "$BUILD/$log"; die "'$*' failed: see $BUILD/$log"; }; }
run configure.log nice -n 19 "$SRC/configure" --prefix="$PREFIX" --with-cuda="$BUILD/cuda" \
    --disable-mpi-fortran --disable-oshmem --without-ucx --enable-shared --disable-static \
    --disable-io-romio --disable-libompitrace --with-hwloc=internal --with-libevent=internal --with-pmix=internal \
    --without-verbs --without-ofi --without-psm --without-psm2 --without-knem --without-xpmem --without-hcoll \
    --without-tm --without-lustre --without-gpfs
grep -q '^CUDA support: yes' "$BUILD/configure.log" || die "configure did not enable CUDA support: see $BUILD/configure.log"
echo "== configured ($SECONDS s); building"
run make.log nice -n 19 make -j"${JOBS:-2}"
run install.log make install
echo "== built and installed ($SECONDS s)"

# Only what runs: no headers or compiler wrappers (no use without them), man pages, libtool files; stripped.
cd "$PREFIX"
rm -rf include share/man share/doc lib/pkgconfig share/openmpi/*-wrapper-data.txt
rm -f bin/{mpicc,mpiCC,mpic++,mpicxx,mpif77,mpif90,mpifort,opal_wrapper,ortecc,aggregate_profile.pl,profile2mat.pl}
find lib -name '*.la' -delete
find bin lib -type f \( -name '*.so*' -o -perm -u+x \) -exec strip --strip-unneeded {} +
cuda_ok || die "the installed ompi_info does not report CUDA support"
rm -rf "$BUILD"
echo "== $PREFIX: Open MPI $("$PREFIX/bin/ompi_info" --version 2>/dev/null | head -1 | awk '{print $NF}'), CUDA-aware," \
     "$(du -sh "$PREFIX" | cut -f1) in $SECONDS s"
