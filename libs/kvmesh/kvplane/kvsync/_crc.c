/* CRC32C (Castagnoli) for kv-sync: three interleaved hardware streams, and a copy that checks as it copies.
 *
 * One SSE4.2 crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so a single
 * stream (what the `crc32c` package runs) reaches a third of what the unit can do. Here a buffer is cut into
 * three equal lanes whose CRCs run in lockstep, then joined with the GF(2) shift of zlib's crc32_combine
 * (crc(A||B) = crc(A) * x^(8|B|) mod P  xor  crc(B), on the finished CRCs). `copy_crc32c` stores each
 * 8-byte word it has just loaded for the CRC, so a verified copy reads the source once: checking costs the
 * CRC instructions, not a second pass over memory. Both take the CRC `value` of the bytes before (a block
 * arriving in pieces: crc(A||B) from crc(A) and B, by the same combine). Both release the GIL. x86-64 with SSE4.2 only; elsewhere
 * the module exports `available = False` and Python uses the `crc32c` package.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u /* CRC32C, reflected */
#define MIN_LANE_BYTES 256

static uint32_t x2n_table[32];

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P */
static uint32_t x2nmodp(uint64_t n, unsigned k) {
    uint32_t p = (uint32_t)1 << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static uint32_t combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

static void init_tables(void) {
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    for (int k = 0; k < 32; k++) {
        x2n_table[k] = p;
        p = multmodp(p, p);
    }
}

#if defined(__x86_64__)
#include <nmmintrin.h>
#define HAVE_KERNEL 1

__attribute__((target("sse4.2"))) static uint32_t tail(uint32_t s, const uint8_t *p, size_t n, uint8_t *d) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        if (d) { memcpy(d, &w, 8); d += 8; }
        s = (uint32_t)_mm_crc32_u64(s, w);
        p += 8;
        n -= 8;
    }
    while (n--) {
        if (d) *d++ = *p;
        s = _mm_crc32_u8(s, *p++);
    }
    return s;
}

/* CRC32C of src (finished form); copies src to dst too when dst is not NULL. */
__attribute__((target("sse4.2"))) static uint32_t crc_copy(const uint8_t *src, uint8_t *dst, size_t n) {
    if (n < 3 * MIN_LANE_BYTES) return ~tail(~0u, src, n, dst);
    size_t lane = (n / 24) * 8;
    const uint8_t *a = src, *b = src + lane, *c = src + 2 * lane;
    uint32_t sa = ~0u, sb = ~0u, sc = ~0u;
    size_t words = lane / 8;
    if (dst) {
        uint8_t *da = dst, *db = dst + lane, *dc = dst + 2 * lane;
        for (size_t i = 0; i < words; i++) {
            uint64_t wa, wb, wc;
            memcpy(&wa, a + 8 * i, 8);
            memcpy(&wb, b + 8 * i, 8);
            memcpy(&wc, c + 8 * i, 8);
            sa = (uint32_t)_mm_crc32_u64(sa, wa);
            sb = (uint32_t)_mm_crc32_u64(sb, wb);
            sc = (uint32_t)_mm_crc32_u64(sc, wc);
            memcpy(da + 8 * i, &wa, 8);
            memcpy(db + 8 * i, &wb, 8);
            memcpy(dc + 8 * i, &wc, 8);
        }
        sc = tail(sc, c + lane, n - 3 * lane, dst + 3 * lane);
    } else {
        for (size_t i = 0; i < words; i++) {
            uint64_t wa, wb, wc;
            memcpy(&wa, a + 8 * i, 8);
            memcpy(&wb, b + 8 * i, 8);
            memcpy(&wc, c + 8 * i, 8);
            sa = (uint32_t)_mm_crc32_u64(sa, wa);
            sb = (uint32_t)_mm_crc32_u64(sb, wb);
            sc = (uint32_t)_mm_crc32_u64(sc, wc);
        }
        sc = tail(sc, c + lane, n - 3 * lane, NULL);
    }
    uint32_t crc = combine(~sa, ~sb, lane);
    return combine(crc, ~sc, n - 2 * lane);
}
#else
#define HAVE_KERNEL 0
#endif

#if HAVE_KERNEL
static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32c(data, value=0)");
        return NULL;
    }
    unsigned long value = 0;
    if (nargs == 2) {
        value = PyLong_AsUnsignedLong(args[1]);
        if (PyErr_Occurred()) return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc_copy((const uint8_t *)src.buf, NULL, (size_t)src.len);
    if (nargs == 2) crc = combine((uint32_t)value, crc, (uint64_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_copy_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "copy_crc32c(dst, src, value=0)");
        return NULL;
    }
    unsigned long value = 0;
    if (nargs == 3) {
        value = PyLong_AsUnsignedLong(args[2]);
        if (PyErr_Occurred()) return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes, src %zd", dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc_copy((const uint8_t *)src.buf, (uint8_t *)dst.buf, (size_t)src.len);
    if (nargs == 3) crc = combine((uint32_t)value, crc, (uint64_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(crc);
}
#endif

static PyMethodDef methods[] = {
#if HAVE_KERNEL
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL,
     "crc32c(data, value=0) -> CRC32C of data, continuing the CRC `value` of what came before"},
    {"copy_crc32c", (PyCFunction)(void (*)(void))py_copy_crc32c, METH_FASTCALL,
     "copy_crc32c(dst, src, value=0) -> copies src into dst (equal lengths) and returns src's CRC32C, "
     "continuing the CRC `value` of what came before, in one pass"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvmesh.kvplane.kvsync._crc", "Interleaved hardware CRC32C and a checked copy.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crc(void) {
    init_tables();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    int available = HAVE_KERNEL;
#if HAVE_KERNEL
    __builtin_cpu_init();
    available = __builtin_cpu_supports("sse4.2");
#endif
    if (PyModule_AddObject(m, "available", PyBool_FromLong(available)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
