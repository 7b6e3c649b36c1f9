/* The codecs' loops (mpiopt.codecs: int8, int4, fp4, sign, none, bf16, topk), fused (optional).
 *
 * encode: per chunk, in cache, error feedback's fold (e = e * beta + x), the chunk's scale, the codes and
 * the residual's update (e = e - decoded) in one visit instead of numpy's dozen passes over d; topk's
 * selection is a radix select on the float bits.  decode: the sum of P payloads' decoded rows in row
 * order (and the division of the mean) in one pass over the output.  Every product, quotient and sum is
 * the float32 (or float64) operation numpy does, in its order: the same bits.  The details that carry
 * it: np.rint's round-half-to-even is (|t| + 2**23) - 2**23 for |t| <= 127 (no SSE4.1 needed); numpy's
 * pairwise float64 sums (its blocks of 8 accumulators and 128 entries; for sign's float32 input, chunks
 * of at most 8192, numpy's buffer); a + b keeps a's NaN when both are NaN (add, _codecs_shared.h).
 * Chunks go to threads whole (_parallel.h), so the bits do not depend on the split.
 *
 * This file is the module mpiopt.kernels._codecsc: its method table and PyInit.  The loops live in files along
 * their jobs, declared in _codecs_shared.h and compiled into this one module (setup.py):
 *
 *   _codecs_args.c          the argument checks and the threaded run the Python functions share
 *   _codecs_dense_encode.c  encode: the dense codecs' fold, scale, codes and feedback; bf16's rounding
 *   _codecs_dense_decode.c  decode: the dense codecs' decode-sum of P payloads, sign's table
 *   _codecs_topk.c          topk_encode, topk_decode: topk's selection, levels, bit fields and decode-sum
 */
#include "_codecs_shared.h"

static PyMethodDef methods[] = {
    {"encode", mpiopt_codecs_encode, METH_VARARGS,
     "encode(kind, e, x, beta, payload, chunk, feedback, threads) -> None\n\n"
     "kind 0 int8, 1 int4, 2 fp4, 3 sign, 5 bf16 (float32 in).  Unless x is None, first e = e * beta + x\n"
     "(beta 1: e + x) in place; then e's payload into payload; with feedback, e = e - decode(payload)."},
    {"decode", mpiopt_codecs_decode, METH_VARARGS,
     "decode(kind, payloads, rows, out, chunk, add, divisor, threads) -> None\n\n"
     "out (float32) = the sum of the rows' decoded vectors in row order (add: out + that sum), divided\n"
     "by divisor unless it is 1; kind as encode's, 4 none."},
    {"topk_encode", mpiopt_codecs_topk_encode, METH_VARARGS,
     "topk_encode(e, x, beta, payload, chunk, k, bits, index_bits, low, spacing, table, feedback, threads) -> None\n\n"
     "encode's fold and feedback around mpiopt.codecs.TopkCodec's payload: the k largest |e| of every chunk\n"
     "(ties to the lowest index, NaN last), levels low + i * spacing of the mean |value|, table the decoded\n"
     "values in units of the scale."},
    {"topk_decode", mpiopt_codecs_topk_decode, METH_VARARGS,
     "topk_decode(payloads, rows, out, chunk, k, bits, index_bits, table, add, divisor, counts, threads) -> None\n\n"
     "decode's sum of rows in order for TopkCodec payloads (a zero vector plus each row's entries); counts\n"
     "(None, or d int32): each entry's senders, at least 1, and out their mean (float64 quotients)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_codecsc", "Fused CPU loops of mpiopt.codecs' dense codecs.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that mpiopt.codecs can refuse a stale build. */
PyMODINIT_FUNC PyInit__codecsc(void) {
    mpiopt_codecs_fill_tables();
#ifdef GATHER512
    __builtin_cpu_init();
    mpiopt_codecs_use_gather512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 2) < 0) Py_CLEAR(m);
    return m;
}
