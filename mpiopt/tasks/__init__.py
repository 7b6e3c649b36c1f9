"""Workloads for tests, benchmarks and the papers' claims (numpy, small, generated on the fly).

Workloads only: nothing here imports above :mod:`mpiopt.kernels`; the
simulators that run algorithms on them are in :mod:`mpiopt.sim`.

- :mod:`~mpiopt.tasks.symmetric`: a non-convex objective with symmetric minima (LSGD vs EASGD).
- :mod:`~mpiopt.tasks.logistic`: logistic regression with per-rank data (DaSGD vs SGD).
- :mod:`~mpiopt.tasks.linreg`: distributed linear regression with heterogeneous workers (RegTop-k vs Top-k).
- :mod:`~mpiopt.tasks.pca`: streaming PCA (Async-MSGD's asynchrony-momentum trade-off).
"""
