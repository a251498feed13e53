/* Native crc32c checks for the shard reader (deepspec/cache/checks.py says when it is used).

Python helper threads cost the reading thread 15-35 us per hand-off on a 2-vCPU VM (a wake-up and
two GIL hand-overs, whatever the check does), so at one sample per read they ate most of what the
second core saved. Here a check is handed to a native thread that never takes the GIL: `submit`
appends a task under a mutex, and only `wait` releases the GIL, to help with what is still queued
and then sleep until the rest is done.

    Checker(threads=1)            a pool of native threads; they end when the checker is collected
    Checker.batch() -> Batch
    Batch.submit(stored, chunk_bytes, *buffers) -> index
                                  the buffers laid end to end are len(stored) // 4 chunks of
                                  `chunk_bytes`; chunk j's crc32c must equal the j-th little-endian
                                  uint32 of `stored`. All are held (buffer protocol) until wait()
    Batch.wait() -> list[(index, chunk)]
                                  per task with a mismatch, in submission order: its first bad chunk
    crc32c(buffer, crc=0) -> int  the same CRC as the crc32c package
    HARDWARE                      True when the CPU's crc32 instruction is used (x86-64 SSE4.2)

The CRC is CRC-32C (Castagnoli, reflected, inverted in and out). With the crc32 instruction it
runs three independent streams over consecutive 4 KB blocks and joins them with a table that
multiplies by x^(8 * 4096) mod P, the technique of Mark Adler's crc32c.c; elsewhere it is a
slice-by-8 table loop.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#define POLY 0x82F63B78u
/* How long an idle thread polls before it sleeps. Waking a sleeping thread cost the waker ~60 us
   on a 2-vCPU VM (an inter-processor interrupt through the hypervisor): more than a 2 MB check.
   A read hands off a run every ~0.2 ms, so within a read nobody sleeps; between reads (a training
   step) the threads sleep after this long. Polling yields the CPU (sched_yield) on every try. */
#define SPIN_NS 2000000L
#define BLOCK 4096

static uint32_t table[8][256];     /* table[k][b]: register after byte b then k zero bytes */
static uint32_t shift_block[4][256]; /* register after BLOCK zero bytes, per byte of the register */
static int hardware;

static uint32_t raw_soft(uint32_t r, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        r = table[0][(r ^ *p++) & 0xff] ^ (r >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= r;
        r = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        r = table[0][(r ^ *p++) & 0xff] ^ (r >> 8);
    return r;
}

static inline uint32_t shift(uint32_t r)
{
    return shift_block[0][r & 0xff] ^ shift_block[1][(r >> 8) & 0xff] ^ shift_block[2][(r >> 16) & 0xff] ^
           shift_block[3][r >> 24];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t raw_hard(uint32_t r, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        r = _mm_crc32_u8(r, *p++);
        n--;
    }
    uint64_t r0 = r;
    while (n >= 3 * BLOCK) {
        /* three dependency chains keep the crc32 unit busy (latency 3, one per cycle) */
        uint64_t r1 = 0, r2 = 0, a, b, c;
        const uint8_t *end = p + BLOCK;
        for (; p < end; p += 8) {
            memcpy(&a, p, 8);
            memcpy(&b, p + BLOCK, 8);
            memcpy(&c, p + 2 * BLOCK, 8);
            r0 = _mm_crc32_u64(r0, a);
            r1 = _mm_crc32_u64(r1, b);
            r2 = _mm_crc32_u64(r2, c);
        }
        r0 = shift(shift((uint32_t)r0) ^ (uint32_t)r1) ^ (uint32_t)r2;
        p += 2 * BLOCK;
        n -= 3 * BLOCK;
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        r0 = _mm_crc32_u64(r0, a);
    }
    r = (uint32_t)r0;
    while (n--)
        r = _mm_crc32_u8(r, *p++);
    return r;
}
#endif

static uint32_t raw(uint32_t r, const uint8_t *p, size_t n)
{
#if defined(__x86_64__)
    if (hardware)
        return raw_hard(r, p, n);
#endif
    return raw_soft(r, p, n);
}

static void init_tables(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xff];
    /* the zero-byte shift is linear in the register: build each table from its 8 unit vectors */
    static uint8_t zeros[BLOCK];
    uint32_t cols[32];
    for (int i = 0; i < 32; i++)
        cols[i] = raw_soft(1u << i, zeros, BLOCK);
    for (int k = 0; k < 4; k++) {
        shift_block[k][0] = 0;
        for (int v = 1; v < 256; v++) {
            int low = v & -v;
            shift_block[k][v] = shift_block[k][v ^ low] ^ cols[8 * k + __builtin_ctz(low)];
        }
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2");
#endif
}

/* ---- tasks, shared by a checker's threads and the thread that waits ---------------------------- */

typedef struct Batch Batch;

typedef struct {
    Batch *batch;
    int nseg;
    const uint8_t **ptr;
    size_t *len;
    const uint8_t *stored;  /* n little-endian crc32c */
    size_t n, chunk;
    Py_ssize_t bad;         /* first chunk that differs, or -1 */
} Task;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;   /* a task was queued, or stop */
    pthread_cond_t done;   /* a task finished */
    Task **queue;          /* ring of queued tasks */
    size_t cap, head, count;
    int stop, nthreads;
    int sleepers, waiters;  /* threads in cond_wait on work / done */
    pthread_t *threads;
    pid_t pid;
} Checker;

struct Batch {
    PyObject_HEAD
    Checker *checker;      /* strong reference */
    Task **tasks;
    Py_buffer *views;
    Py_ssize_t n, cap, nviews, vcap;
    size_t finished;       /* written under checker->mu */
};

static void run_task(Task *t)
{
    int seg = 0;
    size_t at = 0;  /* bytes of segment `seg` already used */
    t->bad = -1;
    for (size_t j = 0; j < t->n; j++) {
        uint32_t r = 0xFFFFFFFFu, want;
        for (size_t left = t->chunk; left;) {
            size_t take = t->len[seg] - at < left ? t->len[seg] - at : left;
            r = raw(r, t->ptr[seg] + at, take);
            left -= take, at += take;
            if (at == t->len[seg])
                seg++, at = 0;
        }
        memcpy(&want, t->stored + 4 * j, 4);  /* x86-64 only uses this module: little-endian */
        if (~r != want && t->bad < 0)
            t->bad = (Py_ssize_t)j;
    }
}

/* with mu held: take the next queued task, or NULL */
static Task *pop(Checker *c)
{
    if (!c->count)
        return NULL;
    Task *t = c->queue[c->head];
    c->head = (c->head + 1) % c->cap;
    __atomic_store_n(&c->count, c->count - 1, __ATOMIC_RELAXED);
    return t;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* without mu: poll until *word differs from `value` or SPIN_NS pass; nonzero if it changed */
static int spin_while(const size_t *word, size_t value, const int *stop)
{
    long long until = now_ns() + SPIN_NS;
    for (unsigned i = 0;; i++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value || __atomic_load_n(stop, __ATOMIC_RELAXED))
            return 1;
        if ((i & 15) == 15 && now_ns() > until)
            return 0;
        sched_yield();
    }
}

/* with mu held: run a popped task without it, then count it finished */
static void run_unlocked(Checker *c, Task *t)
{
    pthread_mutex_unlock(&c->mu);
    run_task(t);
    pthread_mutex_lock(&c->mu);
    __atomic_store_n(&t->batch->finished, t->batch->finished + 1, __ATOMIC_RELEASE);
    if (c->waiters)
        pthread_cond_broadcast(&c->done);
}

static void *serve(void *arg)
{
    Checker *c = arg;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "crc32c");  /* as /proc/<pid>/task/<tid>/comm shows it */
#endif
    pthread_mutex_lock(&c->mu);
    for (;;) {
        Task *t = pop(c);
        if (!t) {
            if (c->stop)
                break;
            pthread_mutex_unlock(&c->mu);
            int busy = spin_while(&c->count, 0, &c->stop);
            pthread_mutex_lock(&c->mu);
            if (!busy && !c->count && !c->stop) {
                c->sleepers++;
                pthread_cond_wait(&c->work, &c->mu);
                c->sleepers--;
            }
            continue;
        }
        run_unlocked(c, t);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* GIL released: run queued tasks (any batch's) until none is left, then wait until all of b's
   are finished (polling first, as the checker's threads do) */
static void settle(Batch *b)
{
    Checker *c = b->checker;
    pthread_mutex_lock(&c->mu);
    while (b->finished < (size_t)b->n) {
        Task *t = pop(c);
        if (t) {
            run_unlocked(c, t);
            continue;
        }
        size_t seen = b->finished;
        pthread_mutex_unlock(&c->mu);
        int moved = spin_while(&b->finished, seen, &c->stop);
        pthread_mutex_lock(&c->mu);
        if (!moved && b->finished == seen && !c->count) {
            c->waiters++;
            pthread_cond_wait(&c->done, &c->mu);
            c->waiters--;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static void release(Batch *b)
{
    for (Py_ssize_t i = 0; i < b->nviews; i++)
        PyBuffer_Release(&b->views[i]);
    for (Py_ssize_t i = 0; i < b->n; i++)
        PyMem_RawFree(b->tasks[i]);
    b->n = b->nviews = 0;
    b->finished = 0;
}

static PyTypeObject BatchType;

static PyObject *batch_submit(Batch *self, PyObject *args)
{
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError, "submit(stored, chunk_bytes, *buffers)");
        return NULL;
    }
    Py_ssize_t chunk = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 1));
    if (chunk == -1 && PyErr_Occurred())
        return NULL;
    if (chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk_bytes must be >= 1");
        return NULL;
    }
    Checker *c = self->checker;
    if (c->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "a Checker cannot be used in a forked child (its threads are gone)");
        return NULL;
    }
    int nseg = (int)(nargs - 2);
    if (self->nviews + nseg + 1 > self->vcap) {
        Py_ssize_t cap = (self->nviews + nseg + 1) * 2;
        Py_buffer *v = PyMem_Realloc(self->views, cap * sizeof(Py_buffer));
        if (!v)
            return PyErr_NoMemory();
        self->views = v, self->vcap = cap;
    }
    if (self->n + 1 > self->cap) {
        Py_ssize_t cap = (self->n + 1) * 2;
        Task **t = PyMem_Realloc(self->tasks, cap * sizeof(Task *));
        if (!t)
            return PyErr_NoMemory();
        self->tasks = t, self->cap = cap;
    }
    /* one allocation: the task, then its segment pointers and lengths */
    Task *t = PyMem_RawMalloc(sizeof(Task) + nseg * (sizeof(uint8_t *) + sizeof(size_t)));
    if (!t)
        return PyErr_NoMemory();
    t->ptr = (const uint8_t **)(t + 1);
    t->len = (size_t *)(t->ptr + nseg);
    t->nseg = nseg, t->chunk = (size_t)chunk, t->bad = -1, t->batch = self;
    Py_ssize_t first = self->nviews, total = 0;
    for (int i = -1; i < nseg; i++) {  /* -1: the stored crc32cs */
        Py_buffer *v = &self->views[self->nviews];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, i < 0 ? 0 : i + 2), v, PyBUF_SIMPLE) < 0)
            goto fail;
        self->nviews++;
        if (i < 0) {
            t->stored = v->buf, t->n = (size_t)v->len / 4;
            continue;
        }
        t->ptr[i] = v->buf, t->len[i] = (size_t)v->len;
        total += v->len;
    }
    if (self->views[first].len % 4 || (size_t)total != t->n * t->chunk) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of buffers are not %zd chunks of %zd bytes (%zd bytes of stored crc32c)",
                     total, (Py_ssize_t)t->n, chunk, self->views[first].len);
        goto fail;
    }
    self->tasks[self->n++] = t;
    pthread_mutex_lock(&c->mu);
    if (c->count == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 64;
        Task **q = PyMem_RawMalloc(cap * sizeof(Task *));
        if (!q) {
            pthread_mutex_unlock(&c->mu);
            self->n--;  /* not queued: forget it (its views stay until release) */
            PyMem_RawFree(t);
            return PyErr_NoMemory();
        }
        for (size_t i = 0; i < c->count; i++)
            q[i] = c->queue[(c->head + i) % c->cap];
        PyMem_RawFree(c->queue);
        c->queue = q, c->cap = cap, c->head = 0;
    }
    c->queue[(c->head + c->count) % c->cap] = t;
    __atomic_store_n(&c->count, c->count + 1, __ATOMIC_RELEASE);
    if (c->sleepers)
        pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    return PyLong_FromSsize_t(self->n - 1);
fail:
    while (self->nviews > first)
        PyBuffer_Release(&self->views[--self->nviews]);
    PyMem_RawFree(t);
    return NULL;
}

static PyObject *batch_wait(Batch *self, PyObject *Py_UNUSED(ignored))
{
    Py_BEGIN_ALLOW_THREADS
    settle(self);
    Py_END_ALLOW_THREADS
    PyObject *failed = PyList_New(0);
    if (!failed)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (self->tasks[i]->bad < 0)
            continue;
        PyObject *k = Py_BuildValue("(nn)", i, self->tasks[i]->bad);
        if (!k || PyList_Append(failed, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(failed);
            release(self);
            return NULL;
        }
        Py_DECREF(k);
    }
    release(self);
    return failed;
}

static PyObject *batch_pending(Batch *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t(self->n);
}

static void batch_dealloc(Batch *self)
{
    if (self->n && self->checker->pid == getpid()) {  /* given up: its queued tasks point at buffers only it holds */
        Py_BEGIN_ALLOW_THREADS
        settle(self);
        Py_END_ALLOW_THREADS
        release(self);
    }
    PyMem_Free(self->tasks);
    PyMem_Free(self->views);
    Py_XDECREF(self->checker);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef batch_methods[] = {
    {"submit", (PyCFunction)batch_submit, METH_VARARGS,
     "submit(stored, chunk_bytes, *buffers) -> index: check each chunk of the buffers end to end against `stored`"},
    {"wait", (PyCFunction)batch_wait, METH_NOARGS,
     "wait() -> [(task index, first bad chunk)] in submission order; the batch is then empty"},
    {"pending", (PyCFunction)batch_pending, METH_NOARGS, "tasks submitted since the last wait()"},
    {NULL}};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deepspec.cache._checker.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "crc32c checks that one thread waits for together",
    .tp_methods = batch_methods,
};

static int checker_init(Checker *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"threads", NULL};
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", kwlist, &threads))
        return -1;
    if (threads < 1 || threads > 64) {
        PyErr_Format(PyExc_ValueError, "a checker needs 1 to 64 threads (got %d)", threads);
        return -1;
    }
    if (self->threads) {
        PyErr_SetString(PyExc_RuntimeError, "Checker already initialised");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->done, NULL);
    self->pid = getpid();
    self->threads = PyMem_RawCalloc(threads, sizeof(pthread_t));
    if (!self->threads) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < threads; i++) {
        int err = pthread_create(&self->threads[i], NULL, serve, self);
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;  /* dealloc stops the threads already started */
        }
        self->nthreads++;
    }
    return 0;
}

static void checker_dealloc(Checker *self)
{
    if (self->threads) {
        if (self->pid == getpid()) {
            pthread_mutex_lock(&self->mu);
            self->stop = 1;
            pthread_cond_broadcast(&self->work);
            pthread_mutex_unlock(&self->mu);
            Py_BEGIN_ALLOW_THREADS
            for (int i = 0; i < self->nthreads; i++)
                pthread_join(self->threads[i], NULL);
            Py_END_ALLOW_THREADS
            pthread_mutex_destroy(&self->mu);
            pthread_cond_destroy(&self->work);
            pthread_cond_destroy(&self->done);
        }
        PyMem_RawFree(self->threads);
    }
    PyMem_RawFree(self->queue);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *checker_batch(Checker *self, PyObject *Py_UNUSED(ignored))
{
    Batch *b = PyObject_New(Batch, &BatchType);
    if (!b)
        return NULL;
    Py_INCREF(self);
    b->checker = self;
    b->tasks = NULL, b->views = NULL;
    b->n = b->cap = b->nviews = b->vcap = b->finished = 0;
    return (PyObject *)b;
}

static PyMethodDef checker_methods[] = {
    {"batch", (PyCFunction)checker_batch, METH_NOARGS, "a new Batch of checks run by this checker's threads"},
    {NULL}};

static PyTypeObject CheckerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deepspec.cache._checker.Checker",
    .tp_basicsize = sizeof(Checker),
    .tp_dealloc = (destructor)checker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Checker(threads=1): native threads that check crc32c without the GIL",
    .tp_methods = checker_methods,
    .tp_init = (initproc)checker_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *py_crc32c(PyObject *module, PyObject *args)
{
    Py_buffer v;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k", &v, &crc))
        return NULL;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = ~raw(~(uint32_t)crc, v.buf, (size_t)v.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(r);
}

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(buffer, crc=0) -> int, continuing from `crc`"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_checker", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__checker(void)
{
    init_tables();
    if (PyType_Ready(&CheckerType) < 0 || PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&CheckerType);
    if (PyModule_AddObject(m, "Checker", (PyObject *)&CheckerType) < 0 ||
        PyModule_AddObject(m, "HARDWARE", PyBool_FromLong(hardware)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
