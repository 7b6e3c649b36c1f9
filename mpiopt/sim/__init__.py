"""One-process twins of the MPI code: every simulator of mpiopt, for experiments and tests.

A simulator runs N workers in one process, without MPI, through the MPI
path's own update code, with whatever depends on timing replaced by a rule;
the same inputs give the same bits.  Each module has one function,
``simulate(..., steps, ...)``, that updates the parameters through the same
code an MPI run uses and returns what the run would record:

==========================================  ======================================  ===========================
module                                      twin of                                 what it adds
==========================================  ======================================  ===========================
:mod:`~mpiopt.asyncrt.simulated`           :func:`mpiopt.asyncrt.run_async`        a fixed or random delay
(beside the runtime it twins)               (Async-MSGD)                            (``FixedDelay``,
                                                                                    ``RandomDelay``)
:mod:`~mpiopt.sim.topk`                     :class:`~mpiopt.algorithms.topk.TopK`   N workers' payloads in
                                            (Top-k, RegTop-k)                       rank order: bitwise the
                                                                                    MPI run's parameters
:mod:`~mpiopt.sim.streaming_diloco`         :class:`~mpiopt.algorithms.             fragments merged tau steps
                                            streaming_diloco.StreamingDiLoCo`       late, in float64: an
                                                                                    independent re-computation
                                                                                    (to float32 rounding)
==========================================  ======================================  ===========================

The workloads they run (linear regression, streaming PCA) are in
:mod:`mpiopt.tasks`, which depends on nothing above :mod:`mpiopt.kernels`.
"""
