"""Workloads for training runs, tests, benchmarks and the papers' claims.

Workloads only: nothing here imports above :mod:`mpiopt.kernels`; the
simulators that run algorithms on them are in :mod:`mpiopt.sim`.

- :mod:`~mpiopt.tasks.symmetric`: a non-convex objective with symmetric minima (LSGD vs EASGD).
- :mod:`~mpiopt.tasks.logistic`: logistic regression with per-rank data (DaSGD vs SGD).
- :mod:`~mpiopt.tasks.linreg`: distributed linear regression with heterogeneous workers (RegTop-k vs Top-k).
- :mod:`~mpiopt.tasks.pca`: streaming PCA (Async-MSGD's asynchrony-momentum trade-off).
- :mod:`~mpiopt.tasks.images`: image classification data (numpy only): the 8x8 digits that
  ship inside scikit-learn, CIFAR-10's binary batches, synthetic clusters; the per-rank
  shard sampler and the CIFAR augmentation (``mpiopt train``'s data).
- :mod:`~mpiopt.tasks.models`: the classifiers (MLP, small CNN, ResNet-20); needs torch,
  so it is imported only by whoever builds a model.
"""
