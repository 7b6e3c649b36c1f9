/* Majority vote of P packed sign vectors, fused into one C loop (optional).
 *
 * Computes what mpiopt.kernels.signs.majority_vote's numpy code computes:
 * bit j of out[w] is set where at least `threshold` of the P rows have bit j
 * of word w set.  numpy needs one pass over memory per bitwise operation
 * (about 23 for P = 8); here each word of each row is read once and the
 * bit-sliced arithmetic stays in registers:
 *
 *   - rows are taken 8 at a time; a carry-save adder tree (full adders on
 *     whole 64-bit words) turns 8 words into the 4 bit planes of their count;
 *   - that 4-bit count is added into running bit-sliced counters;
 *   - the counters are compared with the threshold, bit-sliced, from the top.
 *
 * Missing rows of the last group count as zero words.  Buffers come through
 * the buffer protocol, so building needs no numpy headers.  The build is
 * optional (setup.py): without a C compiler mpiopt uses the numpy code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_LEVELS 48
#define BLOCK 128 /* words per block: the counters (levels x BLOCK words) stay in L1 */

/* sum and carry of three bit planes */
#define FULL_ADD(a, b, c, s, k) \
    do { uint64_t x_ = (a) ^ (b); s = x_ ^ (c); k = ((a) & (b)) | (x_ & (c)); } while (0)

static int bit_length(Py_ssize_t n) {
    int b = 0;
    while (n) { ++b; n >>= 1; }
    return b;
}

/* The 4 bit planes of the number of set bits among 8 words. */
static inline void count8(const uint64_t x[8], uint64_t plane[4]) {
    uint64_t s1, c1, s2, c2, s3, c3, t, f;
    FULL_ADD(x[0], x[1], x[2], s1, c1);
    FULL_ADD(x[3], x[4], x[5], s2, c2);
    FULL_ADD(s1, s2, x[6], s3, c3);
    plane[0] = s3 ^ x[7];
    uint64_t c4 = s3 & x[7];           /* weight 2: c1, c2, c3, c4 */
    FULL_ADD(c1, c2, c3, t, f);         /* weight 4: f, and t & c4 below */
    plane[1] = t ^ c4;
    uint64_t f2 = t & c4;
    plane[2] = f ^ f2;
    plane[3] = f & f2;
}

/* A 64-bit word at any byte address (rows of ceil(d/8) bytes need not be word-aligned). */
static inline uint64_t load64(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

static void vote(const unsigned char *rows, Py_ssize_t voters, Py_ssize_t stride, Py_ssize_t nwords,
                 Py_ssize_t threshold, uint64_t *out) {
    const int levels = bit_length(voters);
    uint64_t count[MAX_LEVELS < 4 ? 4 : MAX_LEVELS][BLOCK];
    static const unsigned char zeros[8 * BLOCK]; /* the missing rows of the last group */
    for (Py_ssize_t start = 0; start < nwords; start += BLOCK) {
        const Py_ssize_t n = nwords - start < BLOCK ? nwords - start : BLOCK;
        for (int b = 4; b < levels; ++b)  /* levels 0-3 are set by the first group */
            for (Py_ssize_t w = 0; w < n; ++w) count[b][w] = 0;
        for (Py_ssize_t first = 0; first < voters; first += 8) {
            const unsigned char *row[8];
            for (int i = 0; i < 8; ++i) row[i] = first + i < voters ? rows + (first + i) * stride + 8 * start : zeros;
            if (first == 0) {  /* the counters are zero: the first group's planes are the count */
                for (Py_ssize_t w = 0; w < n; ++w) {
                    uint64_t x[8], plane[4];
                    for (int i = 0; i < 8; ++i) x[i] = load64(row[i] + 8 * w);
                    count8(x, plane);
                    for (int b = 0; b < 4; ++b) count[b][w] = plane[b];
                }
                continue;
            }
            /* after this group the count needs at most `used` bits */
            const int used = bit_length(first + 8 < voters ? first + 8 : voters);
            for (Py_ssize_t w = 0; w < n; ++w) {
                uint64_t x[8], plane[4], carry = 0;
                for (int i = 0; i < 8; ++i) x[i] = load64(row[i] + 8 * w);
                count8(x, plane);
                for (int b = 0; b < used; ++b) {  /* count += plane, ripple carry */
                    uint64_t add = b < 4 ? plane[b] : 0, s, k;
                    FULL_ADD(count[b][w], add, carry, s, k);
                    count[b][w] = s;
                    carry = k;
                }
            }
        }
        for (Py_ssize_t w = 0; w < n; ++w) {  /* count >= threshold: greater so far, or equal in every bit */
            uint64_t greater = 0, equal = ~(uint64_t)0;
            for (int b = levels - 1; b >= 0; --b) {
                if ((threshold >> b) & 1) equal &= count[b][w];
                else greater |= equal & count[b][w];
            }
            out[start + w] = greater | equal;
        }
    }
}

static PyObject *py_vote(PyObject *self, PyObject *args) {
    Py_buffer rows, out;
    Py_ssize_t voters, stride, nwords, threshold;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnnw*", &rows, &voters, &stride, &nwords, &threshold, &out)) return NULL;
    PyObject *result = NULL;
    if (voters < 1 || bit_length(voters) > MAX_LEVELS || nwords < 0 || stride < 8 * nwords || threshold < 0) {
        PyErr_Format(PyExc_ValueError, "vote: bad shape voters=%zd stride=%zd nwords=%zd threshold=%zd",
                     voters, stride, nwords, threshold);
    } else if (rows.len < (voters - 1) * stride + nwords * 8 || out.len < nwords * 8) {
        PyErr_SetString(PyExc_ValueError, "vote: buffers too small for the given shape");
    } else if ((uintptr_t)out.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "vote: out must be 8-byte aligned");
    } else {
        Py_BEGIN_ALLOW_THREADS
        vote((const unsigned char *)rows.buf, voters, stride, nwords, threshold, (uint64_t *)out.buf);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"vote", py_vote, METH_VARARGS,
     "vote(rows, voters, stride_bytes, nwords, threshold, out)\n\n"
     "Bit j of out word w is set where at least threshold of the voters rows (row r: the nwords\n"
     "64-bit words from byte r * stride_bytes, any alignment) have bit j of word w set."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_votec", "Fused CPU majority vote over packed words.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__votec(void) { return PyModule_Create(&module); }
