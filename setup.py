"""Build hook for the optional C extensions (metadata lives in pyproject.toml).

``mpiopt.kernels._signsc`` fuses sign packing, the bit-sliced majority vote and
Signum's update, ``mpiopt.kernels._sparsec`` Top-k's selection, payload bitmaps
and aggregation, ``mpiopt.kernels._updatec`` the SGD update (weight decay,
momentum, Nesterov, the step), and ``mpiopt.kernels._codecsc`` the codecs' error-feedback
encode and decode-sum (mpiopt.codecs) into one pass each; without a C compiler the build
skips them (``optional=True``) and mpiopt uses its numpy code, with identical
results.  ``-ffp-contract=off`` keeps each product and sum rounded on its own, as
numpy rounds them (a fused multiply-add would change the last bit).  Long vectors
are split across threads (``mpiopt/kernels/_parallel.h``, :mod:`mpiopt.kernels.threads`).
"""

from setuptools import Extension, setup

# All include _cloops.h and _parallel.h (POSIX threads, hence -pthread for older C libraries).
_COMMON = dict(
    optional=True,
    depends=["mpiopt/kernels/_cloops.h", "mpiopt/kernels/_parallel.h"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(
    ext_modules=[
        Extension("mpiopt.kernels._signsc", ["mpiopt/kernels/_signsc.c"], **_COMMON),
        # One module from several files along the loops' jobs; _sparsec.h declares what they share.
        Extension(
            "mpiopt.kernels._sparsec",
            [
                "mpiopt/kernels/_sparsec.c",
                "mpiopt/kernels/_sparse_select.c",
                "mpiopt/kernels/_sparse_wire.c",
                "mpiopt/kernels/_sparse_aggregate.c",
                "mpiopt/kernels/_sparse_regtopk.c",
            ],
            **{**_COMMON, "depends": _COMMON["depends"] + ["mpiopt/kernels/_sparsec.h"]},
        ),
        Extension("mpiopt.kernels._updatec", ["mpiopt/kernels/_updatec.c"], **_COMMON),
        # The same for the codecs' loops; _codecs_shared.h declares what the files share.
        Extension(
            "mpiopt.kernels._codecsc",
            [
                "mpiopt/kernels/_codecsc.c",
                "mpiopt/kernels/_codecs_args.c",
                "mpiopt/kernels/_codecs_dense_encode.c",
                "mpiopt/kernels/_codecs_dense_decode.c",
                "mpiopt/kernels/_codecs_topk.c",
            ],
            **{**_COMMON, "depends": _COMMON["depends"] + ["mpiopt/kernels/_codecs_shared.h"]},
        ),
    ]
)
