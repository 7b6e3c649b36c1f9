"""Build hook for the optional C extensions (metadata lives in pyproject.toml).

``mpiopt.kernels._votec`` fuses the bit-sliced majority vote into one loop and
``mpiopt.kernels._updatec`` the SGD update (weight decay, momentum, Nesterov,
the step) into one pass; without a C compiler the build skips them
(``optional=True``) and mpiopt uses its numpy code, with identical results.
``-ffp-contract=off`` keeps each product and sum rounded on its own, as numpy
rounds them (a fused multiply-add would change the last bit).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mpiopt.kernels._votec", ["mpiopt/kernels/_votec.c"], optional=True, extra_compile_args=["-O3"]),
        Extension(
            "mpiopt.kernels._updatec",
            ["mpiopt/kernels/_updatec.c"],
            optional=True,
            extra_compile_args=["-O3", "-ffp-contract=off"],
        ),
    ]
)
