"""Workloads for training runs, tests, benchmarks and the papers' claims (numpy data; torch only in the models).

Nothing here imports above :mod:`mpiopt.kernels`; the simulators are in :mod:`mpiopt.sim`.
Each workload and why it is built so: docs/internals-tasks.md.
"""
