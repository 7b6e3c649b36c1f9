/* mpiopt.kernels._sparsec's payload wire format: bitmap_set, bitmap_mark, bitmap_indices write and
 * read the payload's and the union's bitmaps (bit order of the packed signs), without numpy's
 * d-sized mask and unpacking.
 */
#include "_sparsec.h"

/* Mark the k int32 indices in a bitmap of d bits (no clearing): 0, or 1 + the position of a bad index. */
static Py_ssize_t mark_bits(const int32_t *idx, Py_ssize_t k, Py_ssize_t d, unsigned char *bits) {
    for (Py_ssize_t i = 0; i < k; ++i) {
        int32_t j = idx[i];
        if (j < 0 || j >= d) return i + 1;
        bits[j >> 3] |= (unsigned char)(1u << (j & 7));
    }
    return 0;
}

static PyObject *bitmap_fill(PyObject *args, int clear, const char *name) {
    Py_buffer indices, out;
    Py_ssize_t k, d;
    if (!PyArg_ParseTuple(args, "y*nnw*", &indices, &k, &d, &out)) return NULL;
    PyObject *result = NULL;
    if (k < 0 || d < 0 || indices.len < 4 * k || out.len < (d + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "%s: bad k=%zd d=%zd or buffers too small", name, k, d);
    } else {
        const int32_t *idx = (const int32_t *)indices.buf;
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        if (clear) memset(out.buf, 0, (size_t)((d + 7) / 8));
        bad = mark_bits(idx, k, d, (unsigned char *)out.buf);
        Py_END_ALLOW_THREADS
        if (bad) {
            PyErr_Format(PyExc_ValueError, "%s: index %zd is out of [0, %zd)", name, (Py_ssize_t)idx[bad - 1], d);
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&indices);
    PyBuffer_Release(&out);
    return result;
}

PyObject *mpiopt_sparse_bitmap_set(PyObject *self, PyObject *args) {
    (void)self;
    return bitmap_fill(args, 1, "bitmap_set");
}

PyObject *mpiopt_sparse_bitmap_mark(PyObject *self, PyObject *args) {
    (void)self;
    return bitmap_fill(args, 0, "bitmap_mark");
}

PyObject *mpiopt_sparse_bitmap_indices(PyObject *self, PyObject *args) {
    Py_buffer bitmap, out;
    Py_ssize_t d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nw*", &bitmap, &d, &out)) return NULL;
    PyObject *result = NULL;
    if (d < 0 || bitmap.len < (d + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "bitmap_indices: bad d=%zd or bitmap too small", d);
    } else {
        const unsigned char *bits = (const unsigned char *)bitmap.buf;
        int32_t *idx = (int32_t *)out.buf;
        const Py_ssize_t capacity = out.len / 4;
        Py_ssize_t count = 0;
        Py_BEGIN_ALLOW_THREADS
        const Py_ssize_t nbytes = (d + 7) / 8;
        /* 8 bytes at a time (little-endian words hold bit i of the bitmap as their bit i), then the rest */
        Py_ssize_t b = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        for (; b + 8 <= nbytes; b += 8) {
            uint64_t word = load64(bits + b);
            if (b + 8 == nbytes && d % 8) word &= ~(uint64_t)0 >> (8 - d % 8);  /* pad bits are ignored */
            while (word) {
                const int j = __builtin_ctzll(word);
                if (count < capacity) idx[count] = (int32_t)(8 * b + j);
                ++count;
                word &= word - 1;
            }
        }
#endif
        for (; b < nbytes; ++b) {
            unsigned byte = bits[b];
            if (b == nbytes - 1 && d % 8) byte &= (1u << (d % 8)) - 1;  /* pad bits are ignored */
            while (byte) {
                const int j = __builtin_ctz(byte);
                if (count < capacity) idx[count] = (int32_t)(8 * b + j);
                ++count;
                byte &= byte - 1;
            }
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(count);
    }
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&out);
    return result;
}
