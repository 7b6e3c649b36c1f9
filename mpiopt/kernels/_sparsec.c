/* Fused CPU loops for Top-k and RegTop-k (optional): selection, payload bitmaps, aggregation.
 *
 * This file is the module mpiopt.kernels._sparsec: its method table and PyInit.  The loops live in
 * files along their jobs, declared in _sparsec.h and compiled into this one module (setup.py):
 *
 *   _sparse_select.c     scan, compress_marked, indexed: the top-k selection and error feedback
 *   _sparse_wire.c       bitmap_set, bitmap_mark, bitmap_indices: the payload's bitmaps
 *   _sparse_aggregate.c  merge_rows, settle: the aggregation of the workers' sorted payloads
 *   _sparse_regtopk.c    regtopk_ratio, scale_sampled: RegTop-k's regularizer
 *
 * The float loops (indexed, settle, regtopk_ratio) round every product and sum on their own, as
 * numpy does (_cloops.h).  Without a C compiler mpiopt uses the numpy code, which gives the same
 * bits.
 */
#include "_sparsec.h"

static PyMethodDef methods[] = {
    {"bitmap_set", mpiopt_sparse_bitmap_set, METH_VARARGS,
     "bitmap_set(indices, k, d, out)\n\n"
     "Zero the ceil(d / 8) bytes of out, then set bit j % 8 of out[j // 8] for the k int32 indices j."},
    {"bitmap_mark", mpiopt_sparse_bitmap_mark, METH_VARARGS,
     "bitmap_mark(indices, k, d, out)\n\n"
     "Set bit j % 8 of out[j // 8] for the k int32 indices j (other bits unchanged)."},
    {"bitmap_indices", mpiopt_sparse_bitmap_indices, METH_VARARGS,
     "bitmap_indices(bitmap, d, out) -> int\n\n"
     "Write the positions (< d, ascending) of the set bits as int32 into out, as many as it holds;\n"
     "return how many bits are set."},
    {"scan", mpiopt_sparse_scan, METH_VARARGS,
     "scan(x, g, n, itemsize, threshold, absolute, over, over_factors, idx_out, scores_out, threads) -> (int, bool)\n\n"
     "Top-k's candidates: with g (else None), x[i] += g[i] first; the score of i is |x[i]| (absolute) or x[i],\n"
     "or over_factors[p] times that where over[p] == i (int32 positions, ascending; both None for none).\n"
     "The positions (ascending) and scores of the scores >= threshold go to idx_out / scores_out; returns\n"
     "their number, which exceeds the outputs' capacity when they did not all fit (then the outputs are\n"
     "partial), and whether every element of g is finite (True without g)."},
    {"compress_marked", mpiopt_sparse_compress_marked, METH_VARARGS,
     "compress_marked(src, mask, n, out) -> int\n\n"
     "The int32 src[i] with mask[i] (bool bytes) set, i < n, in order into out; return how many."},
    {"indexed", mpiopt_sparse_indexed, METH_VARARGS,
     "indexed(op, x, indices, k, itemsize, other, scalar, threads)\n\n"
     "For the k int32 indices j of x (float32/float64): op 0 other[i] = x[j], x[j] = 0; 1 x[j] += other[i];\n"
     "2 x[j] = 0; 3 x[j] /= scalar; 4 x[j] -= scalar * other[j] (scalar in x's dtype); 5 other[i] = x[j];\n"
     "6 x[j] = other[i]."},
    {"merge_rows", mpiopt_sparse_merge_rows, METH_VARARGS,
     "merge_rows(index_rows, value_rows, d, itemsize, union_out, sums_out) -> int\n\n"
     "The sorted union of up to 8 rows of int32 indices (each unique, ascending, in [0, d)) into union_out,\n"
     "and per union entry the sum of the rows' values there, added in row order from 0, into sums_out;\n"
     "returns the union's size."},
    {"settle", mpiopt_sparse_settle, METH_VARARGS,
     "settle(g, x, stale, union, sums, u, itemsize, divisor, lr, threads)\n\n"
     "G_j = sums[j] / divisor (no division when it is 1) for j < u, written back into sums[j]; unless g is\n"
     "None, g[union[j]] = G_j and g[i] = 0 for the stale indices not in the union (both sorted); unless x\n"
     "is None, x[union[j]] -= lr * G_j."},
    {"regtopk_ratio", mpiopt_sparse_regtopk_ratio, METH_VARARGS,
     "regtopk_ratio(prev, idx, sent, out, k, itemsize, w, q, mu, threads, support=None)\n\n"
     "RegTop-k's |1 + delta| / mu before its tanh: out[p] = |(G - own) / own + 1| / mu with G = prev[idx[p]]\n"
     "and own = sent[p] * w, or |q + 1| / mu where own is 0; each operation rounded to the dtype.  With\n"
     "support (int32, ascending), prev holds G's values there only (0 elsewhere) and idx ascends."},
    {"scale_sampled", mpiopt_sparse_scale_sampled, METH_VARARGS,
     "scale_sampled(sample, idx, factors, k, itemsize, stride)\n\n"
     "sample[i // stride] = factors[p] * sample[i // stride] for each i = idx[p] with i % stride == 0 (and\n"
     "i // stride < len(sample)): the RegTop-k scores of a strided sample's sent entries."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sparsec", "Fused CPU loops for Top-k and RegTop-k: selection, payload bitmaps, aggregation.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that a stale build is refused (mpiopt.kernels._backend). */
PyMODINIT_FUNC PyInit__sparsec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "VERSION", 1) < 0 || PyModule_AddIntConstant(m, "MERGE_MAX_ROWS", MERGE_MAX_ROWS) < 0))
        Py_CLEAR(m);
    return m;
}
