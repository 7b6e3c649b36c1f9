"""One-process twins of the MPI code (N workers, no MPI, timing replaced by a rule), for experiments and tests.

Each module has one ``simulate(..., steps, ...)``; which twin reuses the MPI path's code: docs/internals-sim.md.
"""
