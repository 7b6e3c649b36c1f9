/* The codecs' Python functions' shared helpers (mpiopt.kernels._codecsc, _codecsc.c): their buffers' and kinds'
 * checks, the payload's layout, and the threaded run of a loop without the GIL. */
#include "_codecs_shared.h"

/* fn over [0, d) in parts of whole `align` entries, on up to `threads` threads, without the GIL; returns None. */
PyObject *mpiopt_codecs_run_parts(int threads, Py_ssize_t d, Py_ssize_t align, mpiopt_part_fn fn, void *job) {
    Py_BEGIN_ALLOW_THREADS
    mpiopt_parallel_for(threads, d, align, fn, job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A C-contiguous float32 buffer (writable if asked) of d entries; -1 with an exception set. */
int mpiopt_codecs_get_floats(PyObject *o, Py_buffer *view, int writable, Py_ssize_t d, const char *what) {
    if (PyObject_GetBuffer(o, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) ++f;
    if (strcmp(f, "f") != 0 || view->itemsize != 4 || (d >= 0 && view->len != 4 * d)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous float32 of the vector's length", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Bytes a (P rows of) payload(s) of d entries take, and where its values start. */
Py_ssize_t mpiopt_codecs_payload_layout(int kind, Py_ssize_t d, Py_ssize_t chunk, Py_ssize_t *values_at) {
    *values_at = kind < NONE ? 4 * ((d + chunk - 1) / chunk) : 0;
    const Py_ssize_t values[] = {d, (d + 1) / 2, (d + 1) / 2, (d + 7) / 8, 4 * d, 2 * d};
    return *values_at + values[kind];
}

/* Parts own whole chunks: chunk even for nibbles and a multiple of 8 for signs (checked by the caller). */
int mpiopt_codecs_check_kind(int kind, Py_ssize_t chunk) {
    if (kind < INT8 || kind > BF16 || chunk < 1 || ((kind == INT4 || kind == FP4) && chunk % 2) ||
        (kind == SIGN && (chunk % 8 || chunk > 8192))) {
        PyErr_SetString(PyExc_ValueError, "codecs: unknown kind, or a chunk the C loops do not take");
        return -1;
    }
    return 0;
}
