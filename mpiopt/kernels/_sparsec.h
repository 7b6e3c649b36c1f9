/* What the source files of mpiopt.kernels._sparsec share (private: compiled into that one module,
 * never installed as a header): the Python functions each file defines for the method table in
 * _sparsec.c, and the constants more than one file uses.  _cloops.h brings Python.h, the IEEE build
 * checks and the parallel for (_parallel.h).
 */
#ifndef MPIOPT_SPARSEC_H
#define MPIOPT_SPARSEC_H

#include "_cloops.h"

/* Random accesses: a part of 2**15 of them takes far longer than a thread start (indexed, settle,
 * regtopk_ratio). */
#define INDEXED_MIN_PART (1 << 15)

/* The most rows merge_rows takes (its per-row cursors live on the stack); the module exports it. */
#define MERGE_MAX_ROWS 8

/* The functions below link the module's files together; hidden, so that the shared object exports
 * PyInit__sparsec alone and the names cannot clash with another library's. */
#if defined(__GNUC__)
#define MPIOPT_SPARSE_PRIVATE __attribute__((visibility("hidden")))
#else
#define MPIOPT_SPARSE_PRIVATE
#endif

/* _sparse_select.c: the top-k selection and error feedback's element operations */
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_scan(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_compress_marked(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_indexed(PyObject *self, PyObject *args);

/* _sparse_wire.c: the payload's and the union's bitmaps */
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_bitmap_set(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_bitmap_mark(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_bitmap_indices(PyObject *self, PyObject *args);

/* _sparse_aggregate.c: the aggregation of the workers' sorted payloads */
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_merge_rows(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_settle(PyObject *self, PyObject *args);

/* _sparse_regtopk.c: RegTop-k's scores */
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_regtopk_ratio(PyObject *self, PyObject *args);
MPIOPT_SPARSE_PRIVATE PyObject *mpiopt_sparse_scale_sampled(PyObject *self, PyObject *args);

#endif
