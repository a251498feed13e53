/* copy_crc32c(dst, src, crc) -> int: copies the bytes of `src` into `dst` and returns crc32c of them
   continued from `crc`, in one pass over the bytes, without the GIL (deepspec/cache/read/copycrc.py).
   `dst` is a writable buffer of src's size, or a 2-D one whose rows are each contiguous
   ([rows, row bytes], the rows any distance apart: a layer's rows in a collated batch). x86-64 with
   SSE4.2 only (the crc32 instruction); `available` says whether this machine has it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define HAVE_KERNEL 1

__attribute__((target("sse4.2")))
static uint64_t copy_crc(uint8_t *dst, const uint8_t *src, Py_ssize_t n, uint64_t c) {
    /* four words at a time: the loads, stores and crc32 instructions of a word pipeline with the next */
    while (n >= 32) {
        uint64_t a, b, d, e;
        memcpy(&a, src, 8); memcpy(&b, src + 8, 8); memcpy(&d, src + 16, 8); memcpy(&e, src + 24, 8);
        memcpy(dst, &a, 8); memcpy(dst + 8, &b, 8); memcpy(dst + 16, &d, 8); memcpy(dst + 24, &e, 8);
        c = _mm_crc32_u64(c, a); c = _mm_crc32_u64(c, b); c = _mm_crc32_u64(c, d); c = _mm_crc32_u64(c, e);
        src += 32; dst += 32; n -= 32;
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, src, 8); memcpy(dst, &a, 8);
        c = _mm_crc32_u64(c, a);
        src += 8; dst += 8; n -= 8;
    }
    while (n-- > 0) {
        *dst++ = *src;
        c = _mm_crc32_u8((uint32_t)c, *src++);
    }
    return c;
}

static int has_sse42(void) { return __builtin_cpu_supports("sse4.2"); }
#else
#define HAVE_KERNEL 0
static int has_sse42(void) { return 0; }
#endif

static PyObject *py_copy_crc32c(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    unsigned long crc;
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "OOk", &dst_obj, &src_obj, &crc))
        return NULL;
    if (!has_sse42()) {
        PyErr_SetString(PyExc_RuntimeError, "copy_crc32c needs an x86-64 CPU with SSE4.2");
        return NULL;
    }
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    /* one run of bytes, or rows of `row` bytes `stride` apart */
    Py_ssize_t rows = 1, row = dst.len, stride = 0;
    int ok = dst.len == src.len;
    if (ok && !PyBuffer_IsContiguous(&dst, 'C')) {
        ok = dst.ndim == 2 && dst.itemsize == 1 && dst.strides[1] == 1 && dst.shape[0] * dst.shape[1] == src.len;
        if (ok) {
            rows = dst.shape[0];
            row = dst.shape[1];
            stride = dst.strides[0];
        }
    }
    if (!ok) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: dst must be a contiguous buffer of src's size, or 2-D uint8 "
                                          "[rows, row bytes] with contiguous rows");
        return NULL;
    }
    uint64_t c = (uint32_t)~(uint32_t)crc;
#if HAVE_KERNEL
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *s = (const uint8_t *)src.buf;
    uint8_t *d = (uint8_t *)dst.buf;
    for (Py_ssize_t r = 0; r < rows; r++, s += row, d += stride)
        c = copy_crc(d, s, row, c);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLong((uint32_t)~(uint32_t)c);
}

static PyMethodDef methods[] = {
    {"copy_crc32c", py_copy_crc32c, METH_VARARGS,
     "copy_crc32c(dst, src, crc=0) -> crc32c of src continued from crc, src copied into dst in the same pass"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copycrc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copycrc(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "available", has_sse42() != 0) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
