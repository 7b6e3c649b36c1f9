"""Build hook for the one optional C extension (metadata lives in pyproject.toml).

``mpiopt.kernels._votec`` fuses the bit-sliced majority vote into one loop;
without a C compiler the build skips it (``optional=True``) and
``mpiopt.kernels.majority_vote`` uses its numpy code, with identical results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mpiopt.kernels._votec", ["mpiopt/kernels/_votec.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
