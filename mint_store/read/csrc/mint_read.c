/* A verified row read in one pass: pread in chunks, xxh3-128 over each chunk while it is in
 * cache, several threads reading for a large row (mint_store/read/native.py builds and loads
 * this module; mint_store/read/verified.py is the one caller).
 *
 *   read_row(fd, offset, length, dest, layout_id, content_id) -> 0 | 1 | 2
 *   (dest: any writable C-contiguous buffer of at least length bytes; content_id None: no hash)
 *
 * semantics (the reference is verified.py's Python path, which the tests compare against):
 *
 *   h = xxh3_128(layout_id)                          # content_id None: no hash
 *   for c in chunks(length):                         # c = [c0, c1), chunk_for() bytes, the last shorter
 *       pread(fd, dest[c0:c1], offset + c0)          # any thread: workers claim chunks in order
 *       h.update(dest[c0:c1])                        # the caller, in order, the chunk still in cache
 *   return 0 if hex(h) == content_id else 1          # 2: the file ended before offset + length
 *
 *   copy_row(src, offset, length, dest, layout_id, content_id) -> 0 | 1 | 2
 *   (src: a readable buffer, a shard's read-only mapping; 2: it ends before offset + length)
 *
 *   row = src[offset : offset + length]
 *   h = xxh3_128(layout_id + row); dest[0:length] = row   # one pass: xxh3_copy (xxh3_copy.h)
 *   return 0 if hex(h) == content_id else 1
 *
 *   (one pass where the build has AVX2, len(layout_id) < 64 and len(layout_id) + length > 240;
 *   else in PIECE-byte pieces, each hashed by python-xxhash and then copied while in L1)
 *
 * copy_row is for rows that fit in cache, from page-cache pages the process has mapped: no
 * system call, and one user-space copy whose stores take any alignment. The kernel's copy
 * (rep movsb) slows to a third when the destination and the file offset differ mod 64, as
 * most rows of a shard do; a row's bytes are read from memory once, and the hash and the copy
 * both take them from registers. tools/bench_store.py has the verified read against a raw
 * os.pread of the same rows (BENCHMARKS.md: about 0.9-1.1x at 9 KB to 576 KB, where the
 * preadv path gave 0.6-0.7x).
 * Past L2 the kernel's copy into an aligned destination and the workers win: read_row.
 *
 * The caller hashes chunk k as soon as it is read and reads chunks itself while it waits, so a
 * row costs max(read, hash) instead of read + hash. The pool serves one row at a time: a
 * caller that finds it busy reads alone (no queue, no deadlock). Workers spin a short while
 * after a row (back-to-back reads wake nobody) and then sleep on a condition variable. A
 * caller pinned to fewer CPUs than there are threads (vLLM's CPU worker pins itself to one)
 * uses as many threads as it has CPUs: threads sharing one CPU only take turns.
 *
 * xxh3 is python-xxhash's own build (bind() takes its function addresses), so the digest is
 * the one the store writes, from the same code.
 *
 * A mapped file cut short by another program (MinT never truncates a shard in place) makes the
 * first touch of a page past its new end raise SIGBUS, which would end the process: copy_row
 * touches the mapping only under a guard (bus_jump), and the handler jumps out of the faulting
 * thread's copy, which answers 2 as pread does when the file ends first. A SIGBUS anywhere else
 * goes to the handler that was there before the first copy_row (Python's faulthandler, or the
 * default: the process ends).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint64_t low64, high64;
} h128_t;

#ifdef __AVX2__
#include "xxh3_copy.h"
#define XXH3_COPY 1
#else
#define XXH3_COPY 0
#endif
static int one_pass = XXH3_COPY; /* copy_row's xxh3_copy; native.py turns it off if it disagrees */
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef h128_t (*digest_fn)(const void *);

static create_fn x_create;
static free_fn x_free;
static reset_fn x_reset;
static update_fn x_update;
static digest_fn x_digest;
static pthread_key_t state_key; /* each calling thread's xxh3 state, freed when it exits */

#define MAX_WORKERS 63
#define MIN_CHUNK (32 * 1024)
#define MAX_CHUNK (512 * 1024)
#define SPIN_NS 200000 /* a worker's wait for the next row before it sleeps */
/* Rows below this are read by the caller alone: one pread, then the hash over bytes still in
 * its own L2. Measured on a 2-core EPYC: for rows of 144-576 KiB, workers made the unhashed
 * read 1.2x faster but the verified read 1.3x slower (the caller hashes chunks another core
 * wrote, pulling them across caches); from about 1 MiB the split wins (4 MiB: 1.6x). */
#define PARALLEL_MIN (1 << 20)
#define ALONE_CHUNK (256 * 1024) /* alone, a row past L2 is hashed chunk by chunk while in cache */

enum { PENDING = 0, READ = 1, SHORT = 2 }; /* a chunk's state; < 0: -errno */

typedef struct {
    int fd;
    int64_t offset, length, chunk, nchunks;
    uint8_t *dest;
    atomic_int *done;
    atomic_long next;       /* the next chunk to claim */
    atomic_ulong open_gen;  /* the generation of the row being read; 0 between rows */
    atomic_int active;      /* workers inside this row */
    atomic_int joined;      /* workers that came to help with this row */
    int helpers;            /* how many may: the row's threads less the caller */
} job_t;

static job_t job;
static atomic_ulong generation;
static pthread_mutex_t owner = PTHREAD_MUTEX_INITIALIZER; /* who may use the workers */
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static int sleepers, n_workers;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* pread all of [off, off + n) into p: READ, SHORT (end of file first) or -errno */
static int read_full(int fd, uint8_t *p, int64_t n, int64_t off) {
    while (n > 0) {
        ssize_t got = pread(fd, p, (size_t)n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return SHORT;
        p += got, off += got, n -= got;
    }
    return READ;
}

/* claim the next chunk of j and read it; 0 when none is left */
static int claim_one(job_t *j) {
    long c = atomic_fetch_add(&j->next, 1);
    if (c >= j->nchunks) return 0;
    int64_t c0 = c * j->chunk, n = j->length - c0 < j->chunk ? j->length - c0 : j->chunk;
    atomic_store_explicit(&j->done[c], read_full(j->fd, j->dest + c0, n, j->offset + c0), memory_order_release);
    return 1;
}

static void *worker(void *arg) {
    (void)arg;
    unsigned long seen = atomic_load(&generation);
    for (;;) {
        int64_t t0 = now_ns();
        unsigned long g;
        while ((g = atomic_load(&generation)) == seen) { /* spin, then sleep */
            if (now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&sleep_mu);
                sleepers++;
                while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&sleep_cv, &sleep_mu);
                sleepers--;
                pthread_mutex_unlock(&sleep_mu);
                break;
            }
            for (int i = 0; i < 64; i++) relax();
        }
        seen = g;
        atomic_fetch_add(&job.active, 1);
        /* (else the row ended before this worker came, or enough others help with it) */
        if (atomic_load(&job.open_gen) == g && atomic_fetch_add(&job.joined, 1) < job.helpers)
            while (claim_one(&job)) {
            }
        atomic_fetch_sub(&job.active, 1);
    }
    return NULL;
}

static int start_workers(int n) {
    for (; n_workers < n && n_workers < MAX_WORKERS; n_workers++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 64 * 1024);
        int rc = pthread_create(&t, &a, worker, NULL);
        pthread_attr_destroy(&a);
        if (rc != 0) return -rc;
    }
    return 0;
}

static int64_t chunk_for(int64_t length, int threads) {
    if (threads <= 1 || length < PARALLEL_MIN) return length <= PARALLEL_MIN ? (length ? length : 1) : ALONE_CHUNK;
    /* a few chunks per thread, so the caller's hashing overlaps the others' reads */
    int64_t c = length / (4 * (int64_t)threads);
    c = c < MIN_CHUNK ? MIN_CHUNK : c > MAX_CHUNK ? MAX_CHUNK : c;
    return (c + 4095) & ~(int64_t)4095;
}

static _Thread_local int last_threads; /* threads that read this thread's last row (threads_used()) */

/* at most the number of CPUs the calling thread may run on */
static int usable_threads(int threads) {
#ifdef __linux__
    cpu_set_t s;
    if (threads > 1 && sched_getaffinity(0, sizeof s, &s) == 0) {
        int k = CPU_COUNT(&s);
        if (k >= 1 && k < threads) return k;
    }
#endif
    return threads;
}

/* the row, read and hashed: READ (all of it), SHORT or -errno */
static int read_hashed(int fd, int64_t offset, int64_t length, uint8_t *dest, void *state, int threads) {
    if (length >= PARALLEL_MIN) threads = usable_threads(threads);
    int64_t chunk = chunk_for(length, threads);
    int64_t n = (length + chunk - 1) / chunk;
    if (n <= 1 || threads <= 1 || pthread_mutex_trylock(&owner) != 0) {
        /* alone: chunk by chunk, each hashed while in cache */
        last_threads = 1;
        for (int64_t c0 = 0; c0 < length; c0 += chunk) {
            int64_t k = length - c0 < chunk ? length - c0 : chunk;
            int rc = read_full(fd, dest + c0, k, offset + c0);
            if (rc != READ) return rc;
            if (state) x_update(state, dest + c0, (size_t)k);
        }
        return READ;
    }
    atomic_int small[64];
    atomic_int *done = n <= 64 ? small : calloc((size_t)n, sizeof(atomic_int));
    if (!done) {
        pthread_mutex_unlock(&owner);
        return -ENOMEM;
    }
    for (int64_t i = 0; i < n; i++) atomic_init(&done[i], PENDING);
    last_threads = threads < n_workers + 1 ? threads : n_workers + 1;
    job.helpers = last_threads - 1;
    atomic_store(&job.joined, 0);
    job.fd = fd, job.offset = offset, job.length = length, job.chunk = chunk, job.nchunks = n, job.dest = dest;
    job.done = done;
    atomic_store(&job.next, 0);
    unsigned long g = atomic_load(&generation) + 1;
    if (g == 0) g = 1;
    atomic_store(&job.open_gen, g);
    atomic_store(&generation, g);
    pthread_mutex_lock(&sleep_mu);
    if (sleepers) pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mu);

    int rc = READ;
    for (int64_t h = 0; h < n; h++) {
        int s, idle = 0;
        while ((s = atomic_load_explicit(&done[h], memory_order_acquire)) == PENDING) {
            if (claim_one(&job)) continue;
            relax();
            if (++idle % 256 == 0) sched_yield(); /* the worker on chunk h may be waiting for this CPU */
        }
        if (s != READ) {
            rc = s;
            atomic_store(&job.next, n); /* nothing more is claimed */
            break;
        }
        if (state) {
            int64_t c0 = h * chunk;
            x_update(state, dest + c0, (size_t)(length - c0 < chunk ? length - c0 : chunk));
        }
    }
    atomic_store(&job.open_gen, 0);
    while (atomic_load(&job.active) > 0) relax(); /* no worker still writes dest or done */
    if (done != small) free(done);
    pthread_mutex_unlock(&owner);
    return rc;
}

#define PIECE (16 * 1024) /* copy_row's piece: hashed, then copied while in L1 */

static void copy_any(uint8_t *d, const uint8_t *s, size_t n) {
#ifdef __AVX2__
    /* glibc's memcpy uses rep movsb at these sizes, slow when d and s differ mod 64; vector
     * loads at any address and stores at d's 32-byte boundaries are not */
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (n < head + 128) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 128; d += 128, s += 128, n -= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s), b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64)), e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_store_si256((__m256i *)d, a), _mm256_store_si256((__m256i *)(d + 32), b);
        _mm256_store_si256((__m256i *)(d + 64), c), _mm256_store_si256((__m256i *)(d + 96), e);
    }
#endif
    memcpy(d, s, n);
}

static void copy_hashed(uint8_t *dest, const uint8_t *src, int64_t length, void *state) {
    for (int64_t p0 = 0; p0 < length; p0 += PIECE) {
        size_t k = (size_t)(length - p0 < PIECE ? length - p0 : PIECE);
        if (state) x_update(state, src + p0, k);
        copy_any(dest + p0, src + p0, k);
    }
}

static int hexval(int ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
}

/* a content id (32 lowercase hex digits, xxh3-128's canonical big-endian form) */
static int parse_id(const char *s, Py_ssize_t n, h128_t *out) {
    if (n != 32) return -1;
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        int d = hexval(s[i]);
        if (d < 0) return -1;
        v[i / 16] = (v[i / 16] << 4) | (uint64_t)d;
    }
    out->high64 = v[0], out->low64 = v[1];
    return 0;
}

static int threads_wanted = 1;

typedef struct {
    long long offset, length;
    Py_buffer dest;
    const char *lid;
    Py_ssize_t lid_n;
    int verify;
    void *state; /* the streaming hash (start_state), or NULL */
    h128_t want, got; /* got: a one-pass hash (state NULL) */
} call_t;

/* the arguments (offset, length, dest, layout_id, content_id) of args[1:6], checked. 0, or -1
 * with an exception set (dest released) */
static int prepare(PyObject *const *args, call_t *c) {
    c->offset = PyLong_AsLongLong(args[1]), c->length = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return -1;
    if (c->offset < 0 || c->length < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and length must be >= 0");
        return -1;
    }
    Py_ssize_t cid_n = 0;
    c->lid = PyUnicode_AsUTF8AndSize(args[4], &c->lid_n);
    if (!c->lid) return -1;
    c->state = NULL;
    c->verify = args[5] != Py_None;
    if (c->verify) {
        const char *cid = PyUnicode_AsUTF8AndSize(args[5], &cid_n);
        if (!cid) return -1;
        if (parse_id(cid, cid_n, &c->want) != 0) {
            PyErr_Format(PyExc_ValueError, "%R is not a content id (32 lowercase hex digits)", args[5]);
            return -1;
        }
        if (!x_create) {
            PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
            return -1;
        }
    }
    if (PyObject_GetBuffer(args[3], &c->dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) { /* read-only, or not one C-contiguous block */
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "the destination buffer is read-only or not C-contiguous");
        }
        return -1;
    }
    if (c->dest.len < c->length) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is smaller than the row (%lld)", c->dest.len,
                     c->length);
        PyBuffer_Release(&c->dest);
        return -1;
    }
    return 0;
}

/* a verifying call's streaming hash, started with layout_id. 0, or -1 with MemoryError (dest released) */
static int start_state(call_t *c) {
    if (!c->verify) return 0;
    void *state = pthread_getspecific(state_key);
    if (!state) {
        state = x_create();
        if (!state || pthread_setspecific(state_key, state) != 0) {
            PyBuffer_Release(&c->dest);
            PyErr_NoMemory();
            return -1;
        }
    }
    x_reset(state);
    x_update(state, c->lid, (size_t)c->lid_n);
    c->state = state;
    return 0;
}

/* 0 match (or no hash), 1 mismatch, 2 short; dest released */
static PyObject *finish(call_t *c, int rc) {
    PyBuffer_Release(&c->dest);
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (rc == SHORT) return PyLong_FromLong(2);
    if (!c->verify) return PyLong_FromLong(0);
    h128_t got = c->state ? x_digest(c->state) : c->got;
    return PyLong_FromLong(got.low64 == c->want.low64 && got.high64 == c->want.high64 ? 0 : 1);
}

static PyObject *py_read_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "read_row(fd, offset, length, dest, layout_id, content_id)");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[0]);
    if (PyErr_Occurred()) return NULL;
    call_t c;
    if (prepare(args, &c) != 0 || start_state(&c) != 0) return NULL;
    int rc, threads = threads_wanted;
    Py_BEGIN_ALLOW_THREADS
    rc = read_hashed(fd, c.offset, c.length, (uint8_t *)c.dest.buf, c.state, threads);
    Py_END_ALLOW_THREADS
    return finish(&c, rc);
}

/* -- the SIGBUS guard of copy_row (see the top) -- */
/* set while this thread copies from a mapping. Initial-exec: in the static TLS block every thread
 * has from its start, so the handler's read of it allocates nothing (a first touch of a lazily
 * allocated block could call malloc, in a signal handler, in a thread that faulted elsewhere) */
static _Thread_local sigjmp_buf *bus_jump __attribute__((tls_model("initial-exec")));
static struct sigaction bus_before;        /* the handler before ours: every SIGBUS not ours */
static int bus_installed;                  /* (set under the GIL) */

static void on_bus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jump = bus_jump;
    if (jump != NULL) { /* a page of the mapping this thread copies from is past the file's end */
        bus_jump = NULL;
        siglongjmp(*jump, 1); /* (SA_NODEFER: SIGBUS is not left blocked in this thread) */
    }
    if (bus_before.sa_flags & SA_SIGINFO) {
        if (bus_before.sa_sigaction != NULL) {
            bus_before.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
        bus_before.sa_handler(sig);
        return;
    }
    /* the default: on return the faulting access runs again and the signal ends the process */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
}

static int install_bus_guard(void) {
    if (bus_installed) return 0;
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_bus;
    act.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGBUS, &act, &bus_before) != 0) return -1;
    bus_installed = 1;
    return 0;
}

static PyObject *py_copy_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_row(src, offset, length, dest, layout_id, content_id)");
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_SIMPLE) != 0) return NULL; /* (held: the mapping stays) */
    call_t c;
    if (prepare(args, &c) != 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    volatile int rc = SHORT; /* (volatile: read after a jump out of the copy) */
    int fused = one_pass && c.verify && c.lid_n < 64 && c.lid_n + c.length > 240;
    if (install_bus_guard() != 0) {
        PyBuffer_Release(&src);
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if (!fused && start_state(&c) != 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (c.length <= src.len && c.offset <= src.len - c.length) { /* (no overflow) */
        uint8_t *dest = (uint8_t *)c.dest.buf;
        const uint8_t *row = (const uint8_t *)src.buf + c.offset;
        Py_BEGIN_ALLOW_THREADS
        sigjmp_buf jump;
        if (sigsetjmp(jump, 0) == 0) {
            bus_jump = &jump;
#if XXH3_COPY
            if (fused)
                c.got = xxh3_copy((const uint8_t *)c.lid, (size_t)c.lid_n, row, dest, (size_t)c.length);
            else
#endif
                copy_hashed(dest, row, c.length, c.state);
            rc = READ;
        } /* else: SIGBUS, the file ends inside the row (rc stays SHORT) */
        bus_jump = NULL;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    return finish(&c, rc);
}

/* a forked child has none of its parent's workers, and a lock a parent's thread held stays held */
static void after_fork_child(void) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    owner = m, sleep_mu = m, sleep_cv = c;
    n_workers = 0, sleepers = 0, threads_wanted = 1;
    atomic_store(&job.active, 0);
    atomic_store(&job.open_gen, 0);
}

static void free_state(void *s) {
    if (s && x_free) x_free(s);
}

static PyObject *py_bind(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long a[5];
    if (!PyArg_ParseTuple(args, "KKKKK", &a[0], &a[1], &a[2], &a[3], &a[4])) return NULL;
    for (int i = 0; i < 5; i++)
        if (!a[i]) {
            PyErr_SetString(PyExc_ValueError, "bind() needs five non-null xxh3 function addresses");
            return NULL;
        }
    x_create = (create_fn)(uintptr_t)a[0], x_free = (free_fn)(uintptr_t)a[1], x_reset = (reset_fn)(uintptr_t)a[2];
    x_update = (update_fn)(uintptr_t)a[3], x_digest = (digest_fn)(uintptr_t)a[4];
    Py_RETURN_NONE;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > MAX_WORKERS + 1) {
        PyErr_Format(PyExc_ValueError, "threads must be 1 to %d, got %ld", MAX_WORKERS + 1, n);
        return NULL;
    }
    pthread_mutex_lock(&owner); /* (no row is being read) */
    int rc = start_workers((int)n - 1);
    if (rc == 0) threads_wanted = (int)n;
    pthread_mutex_unlock(&owner);
    if (rc != 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *py_set_one_pass(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    int was = one_pass;
    one_pass = on && XXH3_COPY;
    return PyBool_FromLong(was);
}

static PyObject *py_threads_used(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(last_threads);
}

static PyMethodDef methods[] = {
    {"read_row", (PyCFunction)(void (*)(void))py_read_row, METH_FASTCALL,
     "read_row(fd, offset, length, dest, layout_id, content_id) -> 0 match, 1 mismatch, 2 short"},
    {"copy_row", (PyCFunction)(void (*)(void))py_copy_row, METH_FASTCALL,
     "copy_row(src, offset, length, dest, layout_id, content_id) -> 0 match, 1 mismatch, 2 short"},
    {"bind", py_bind, METH_VARARGS, "bind(create, free, reset, update, digest): xxh3-128 function addresses"},
    {"set_threads", py_set_threads, METH_O, "set_threads(n): the caller and n - 1 workers read a large row"},
    {"set_one_pass", py_set_one_pass, METH_O,
     "set_one_pass(on) -> was: copy_row hashes while it copies (AVX2 builds; else it stays off)"},
    {"threads_used", py_threads_used, METH_NOARGS, "threads_used() -> threads that read this thread's last row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mint_read", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mint_read(void) {
    if (pthread_key_create(&state_key, free_state) != 0 || pthread_atfork(NULL, NULL, after_fork_child) != 0)
        return PyErr_NoMemory();
    return PyModule_Create(&module);
}
