/* kvmesh.index._native: compiled core of the prefix index and of the block hasher.
 *
 * Index. A block hash (uint64, chained: it identifies its whole prefix) maps to the set of workers holding
 * the block, in an open-addressing table with linear probing and backward-shift deletion (no tombstones):
 *
 *   slot = { uint64 key; uint16 w[4] }                                   16 bytes
 *   home(key) = (key * 0x9E3779B97F4A7C15 mod 2^64) >> (64 - log2 cap)   (Fibonacci hashing)
 *   w[0] == 0xFFFF           -> empty slot (a live entry always has >= 1 holder)
 *   w[0] == 0xFFFE (SPILL)   -> w[1] = holder count, w[2] | w[3] << 16 = record index in the spill pool,
 *                               a bitmask of `nwords` uint64 words (nwords = ceil(worker slots / 64))
 *   otherwise                -> 1..4 inline worker ids w[0..n-1], the rest 0xFFFF
 *
 * An entry spills when a 5th worker joins and goes back inline when its count drops to 3 (hysteresis), so
 * memory per distinct block is 16 B / load (load in (5/16, 5/8]: <= 51.2 B) plus 8 * nwords B only for
 * blocks held by >= 4 workers. Tables >= 4 MiB are mmap'ed with MADV_HUGEPAGE. Per-worker block counts are
 * kept; clear(worker) scans the table (O(capacity), stops early once the worker's count reaches 0): no
 * per-worker block lists, which would cost >= 8 B per pair.
 *
 * find_matches(h_0..h_{n-1}): match(w) = max{m : w holds h_0..h_{m-1}}. Walk the query, intersecting the
 * alive worker set (bitmask + count; a single survivor is tracked by id) with each block's holders; a worker
 * leaving the set at block i gets i; stop when no worker is alive. Home slots are prefetched PREFETCH blocks
 * ahead, so the table's cache misses overlap (the walk is bound by those random DRAM accesses: ~1 line/block).
 *
 * Hashing: c_i = sum_k t[i,k] K_k; s_i = P s_{i-1} + c_i; h_i = F(s_i) with F(s) = y ^ (y >> 29),
 * y = M (s ^ (s >> 32)) (all mod 2^64). The caller passes K (per block size) and base = P * s_{-1}; this
 * is the sequential form of kvmesh.index.hashing's closed form (same outputs, asserted by the tests).
 *
 * The GIL is held throughout (no callbacks into Python code except dict/list operations on str/int).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define KVMESH_SHM 1
#endif

#define W_EMPTY 0xFFFFu
#define W_SPILL 0xFFFEu
#define MAX_WORKERS 0xFFFE /* ids 0 .. 0xFFFD */
#define MAX_WORDS ((MAX_WORKERS + 63) / 64)
#define GOLD 0x9E3779B97F4A7C15ull
#define HASH_P 0x9E3779B97F4A7C15ull
#define HASH_M 0xBF58476D1CE4E5B9ull
#ifndef LOAD_NUM
#define LOAD_NUM 5 /* max load LOAD_NUM / LOAD_DEN */
#define LOAD_DEN 8
#endif
#ifndef PREFETCH
#define PREFETCH 16
#endif
#define CHUNK 256
#define INLINE 4
#define UNSPILL_AT 3

typedef struct {
    uint64_t key;
    uint16_t w[4];
} Slot;

/* Shared mode (Linux): the table and the spill pool live in files under /dev/shm that other processes map
 * read-only (IndexView); this header names them. One writer; readers use the seqlock `seq` (odd while the
 * writer changes anything) and retry a walk that overlapped a change. A grown array is a new file
 * <path>.<kind><gen>; the old one is unlinked (a reader still mapping it keeps reading it until it sees the
 * new generation). `words` belong to the owner (Python: names version, completeness, heartbeat, ...). */
#define SHM_MAGIC 0x5849687365bd766bull
#define SHM_WORDS 8
#define SHM_HEADER_BYTES 4096
typedef struct {
    uint64_t magic;
    uint64_t seq;
    uint64_t next_gen;
    uint64_t slots_gen, cap;
    uint64_t spill_gen, spill_cap, nwords;
    uint64_t live, pairs;
    uint64_t words[SHM_WORDS];
} ShmHeader;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    uint64_t cap, mask, live, pairs;
    int shift;
    uint64_t *spill;     /* spill_cap records of nwords words */
    uint32_t spill_cap, spill_top, nwords;
    uint32_t *spill_free;
    uint32_t nfree, free_cap;
    uint64_t *wcount;    /* per worker id: number of blocks held */
    uint32_t wcap;
    PyObject *names;     /* list: worker id -> name (str) or None; owned by the Python wrapper */
    ShmHeader *hdr;      /* shared mode only (else NULL) */
    char *shm_path;      /* shared mode: the header's path; arrays are <path>.s<gen> / <path>.p<gen> */
    uint64_t slots_gen, spill_gen;
} Index;

/* ------------------------------------------------------------------ small helpers */
static inline uint64_t home_of(const Index *ix, uint64_t key) { return (key * GOLD) >> ix->shift; }

/* prefetch the cache line of key's home slot (prefetching the next line as well measured slower) */
static inline void prefetch_home(const Index *ix, uint64_t key) { __builtin_prefetch(&ix->slots[home_of(ix, key)]); }

static inline uint32_t spill_idx(const Slot *s) { return (uint32_t)s->w[2] | ((uint32_t)s->w[3] << 16); }

static inline uint64_t *spill_rec(const Index *ix, const Slot *s) {
    return ix->spill + (size_t)spill_idx(s) * ix->nwords;
}

static inline int inline_count(const Slot *s) {
    int n = 0;
    while (n < INLINE && s->w[n] != W_EMPTY) n++;
    return n;
}

static inline int ctz64(uint64_t x) { return __builtin_ctzll(x); }

/* Tables of >= HUGE_MIN bytes are mmap'ed with MADV_HUGEPAGE (transparent huge pages where the kernel allows):
 * a query touches one random slot per block, and 2 MiB pages keep those accesses off the page-walk path. */
#define HUGE_MIN ((uint64_t)4 << 20)

/* ------------------------------------------------------------------ shared mode: segments and the seqlock */
#ifdef KVMESH_SHM
static int shm_path_of(const char *base, char kind, uint64_t gen, char *out, size_t n) {
    int r = snprintf(out, n, "%s.%c%llu", base, kind, (unsigned long long)gen);
    return (r < 0 || (size_t)r >= n) ? -1 : 0;
}

/* a new segment of `bytes`, reserved with posix_fallocate (a full /dev/shm is an OSError here, not a SIGBUS
 * at the first write) */
static void *shm_new(Index *ix, char kind, uint64_t bytes, uint64_t *gen) {
    char path[4096];
    uint64_t g = ix->hdr->next_gen + 1;
    if (shm_path_of(ix->shm_path, kind, g, path, sizeof path) < 0) {
        PyErr_SetString(PyExc_ValueError, "shared index path too long");
        return NULL;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path), NULL;
    int err = posix_fallocate(fd, 0, (off_t)bytes);
    void *p = MAP_FAILED;
    if (!err && (p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) err = errno;
    close(fd);
    if (err) {
        unlink(path);
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path), NULL;
    }
    ix->hdr->next_gen = g;
    *gen = g;
    return p;
}

static void shm_drop(const Index *ix, char kind, uint64_t gen, void *p, uint64_t bytes) {
    char path[4096];
    munmap(p, bytes);
    if (shm_path_of(ix->shm_path, kind, gen, path, sizeof path) == 0) unlink(path);
}

/* map (creating if needed) the header at `path`; a header left by a writer that died inside a change is
 * taken over (its seq made even again) */
static int shm_open_header(Index *ix, const char *path) {
    size_t n = strlen(path) + 1;
    if (!(ix->shm_path = PyMem_Malloc(n))) return PyErr_NoMemory(), -1;
    memcpy(ix->shm_path, path, n);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path), -1;
    int err = posix_fallocate(fd, 0, SHM_HEADER_BYTES);
    void *p = MAP_FAILED;
    if (!err && (p = mmap(NULL, SHM_HEADER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        err = errno;
    close(fd);
    if (err) {
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path), -1;
    }
    ShmHeader *h = p;
    if (h->magic != SHM_MAGIC) {
        memset(h, 0, sizeof *h);
        h->magic = SHM_MAGIC;
    }
    if (h->seq & 1) h->seq++;
    /* word 0 counts on across writers (a version readers compare); the others are this writer's */
    memset(&h->words[1], 0, (SHM_WORDS - 1) * sizeof(uint64_t));
    ix->hdr = h;
    return 0;
}
#endif

/* every change of a shared index happens between these: readers retry a walk that overlapped one */
static inline void write_begin(Index *ix) {
    if (!ix->hdr) return;
    __atomic_store_n(&ix->hdr->seq, ix->hdr->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void write_end(Index *ix) {
    ShmHeader *h = ix->hdr;
    if (!h) return;
    h->slots_gen = ix->slots_gen;
    h->cap = ix->cap;
    h->spill_gen = ix->spill_gen;
    h->spill_cap = ix->spill_cap;
    h->nwords = ix->nwords;
    h->live = ix->live;
    h->pairs = ix->pairs;
    __atomic_store_n(&h->seq, h->seq + 1, __ATOMIC_RELEASE);
}

/* a table of `cap` empty slots (sets the Python error on failure) */
static Slot *alloc_slots(Index *ix, uint64_t cap, uint64_t *gen) {
    uint64_t bytes = cap * sizeof(Slot);
    Slot *s;
    *gen = 0;
#ifdef KVMESH_SHM
    if (ix->hdr) {
        if ((s = shm_new(ix, 's', bytes, gen))) memset(s, 0xFF, bytes);
        return s;
    }
#endif
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_MIN) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return PyErr_NoMemory(), NULL;
        madvise(p, bytes, MADV_HUGEPAGE); /* advisory: failure only costs speed */
        s = p;
    } else
#endif
        s = PyMem_Malloc(bytes);
    if (!s) return PyErr_NoMemory(), NULL;
    memset(s, 0xFF, bytes);
    return s;
}

static void free_slots(const Index *ix, Slot *s, uint64_t cap, uint64_t gen) {
    if (!s) return;
#ifdef KVMESH_SHM
    if (ix->hdr) {
        shm_drop(ix, 's', gen, s, cap * sizeof(Slot));
        return;
    }
#endif
    (void)gen;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (cap * sizeof(Slot) >= HUGE_MIN) {
        munmap(s, cap * sizeof(Slot));
        return;
    }
#endif
    PyMem_Free(s);
}

/* find the slot of key, or NULL */
static inline Slot *find(const Index *ix, uint64_t key) {
    uint64_t i = home_of(ix, key);
    for (;;) {
        Slot *s = &ix->slots[i];
        if (s->w[0] == W_EMPTY) return NULL;
        if (s->key == key) return s;
        i = (i + 1) & ix->mask;
    }
}

/* place an entry known to be absent (no growth check) */
static Slot *place(Index *ix, uint64_t key) {
    uint64_t i = home_of(ix, key);
    while (ix->slots[i].w[0] != W_EMPTY) i = (i + 1) & ix->mask;
    ix->slots[i].key = key;
    return &ix->slots[i];
}

static int set_capacity(Index *ix, uint64_t cap) {
    Slot *old = ix->slots;
    uint64_t oldcap = ix->cap, oldgen = ix->slots_gen, gen;
    Slot *s = alloc_slots(ix, cap, &gen);
    if (!s) return -1;
    ix->slots = s;
    ix->slots_gen = gen;
    ix->cap = cap;
    ix->mask = cap - 1;
    ix->shift = 64 - __builtin_ctzll(cap);
    for (uint64_t i = 0; i < oldcap; i++) {
        if (old[i].w[0] != W_EMPTY) {
            Slot *d = place(ix, old[i].key);
            memcpy(d->w, old[i].w, sizeof d->w);
        }
    }
    free_slots(ix, old, oldcap, oldgen);
    return 0;
}

/* room for `extra` more entries at load <= LOAD_NUM / LOAD_DEN (5/8: short probe runs) */
static int reserve(Index *ix, uint64_t extra) {
    uint64_t need = ix->live + extra;
    if (need * LOAD_DEN <= ix->cap * LOAD_NUM) return 0;
    uint64_t cap = ix->cap;
    while (need * LOAD_DEN > cap * LOAD_NUM) cap <<= 1;
    return set_capacity(ix, cap);
}

/* backward-shift deletion of the entry in slot index i */
static void delete_at(Index *ix, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & ix->mask;
        Slot *sj = &ix->slots[j];
        if (sj->w[0] == W_EMPTY) break;
        uint64_t k = home_of(ix, sj->key);
        /* move sj into the hole i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            ix->slots[i] = *sj;
            i = j;
        }
    }
    memset(&ix->slots[i], 0xFF, sizeof(Slot));
    ix->live--;
}

/* ------------------------------------------------------------------ spill pool */
static void spill_release(Index *ix) {
    if (!ix->spill) return;
#ifdef KVMESH_SHM
    if (ix->hdr) shm_drop(ix, 'p', ix->spill_gen, ix->spill, (uint64_t)ix->spill_cap * ix->nwords * 8);
    else
#endif
        PyMem_Free(ix->spill);
    ix->spill = NULL;
}

/* the spill pool with room for `cap` records of `nwords` (>= the current) words; records kept */
static int spill_resize(Index *ix, uint32_t cap, uint32_t nwords) {
    uint64_t words = (uint64_t)cap * nwords, gen = 0;
    uint64_t *ns;
#ifdef KVMESH_SHM
    if (ix->hdr) {
        if (!(ns = shm_new(ix, 'p', words * 8, &gen))) return -1;
        memset(ns, 0, words * 8);
    } else
#endif
        if (!(ns = PyMem_Calloc((size_t)words, sizeof(uint64_t)))) return PyErr_NoMemory(), -1;
    for (uint32_t r = 0; r < ix->spill_top; r++)
        memcpy(ns + (size_t)r * nwords, ix->spill + (size_t)r * ix->nwords, ix->nwords * sizeof(uint64_t));
    spill_release(ix);
    ix->spill = ns;
    ix->spill_cap = cap;
    ix->spill_gen = gen;
    ix->nwords = nwords;
    return 0;
}

static int set_nwords(Index *ix, uint32_t nwords) {
    if (nwords <= ix->nwords) return 0;
    if (ix->spill_cap) return spill_resize(ix, ix->spill_cap, nwords);
    ix->nwords = nwords;
    return 0;
}

static int64_t spill_alloc(Index *ix) {
    uint32_t r;
    if (ix->nfree) {
        r = ix->spill_free[--ix->nfree];
    } else {
        if (ix->spill_top == ix->spill_cap) {
            uint32_t nc = ix->spill_cap ? ix->spill_cap + ix->spill_cap / 2 : 64;
            if (spill_resize(ix, nc, ix->nwords) < 0) return -1;
        }
        r = ix->spill_top++;
    }
    memset(ix->spill + (size_t)r * ix->nwords, 0, ix->nwords * sizeof(uint64_t));
    return r;
}

static int spill_free(Index *ix, uint32_t r) {
    if (ix->nfree == ix->free_cap) {
        uint32_t nc = ix->free_cap ? ix->free_cap * 2 : 64;
        uint32_t *nf = PyMem_Realloc(ix->spill_free, (size_t)nc * sizeof(uint32_t));
        if (!nf) { PyErr_NoMemory(); return -1; }
        ix->spill_free = nf;
        ix->free_cap = nc;
    }
    ix->spill_free[ix->nfree++] = r;
    return 0;
}

static int ensure_worker(Index *ix, long w) {
    if (w < 0 || w >= MAX_WORKERS) {
        PyErr_Format(PyExc_ValueError, "worker id %ld out of range [0, %d)", w, MAX_WORKERS);
        return -1;
    }
    if ((uint32_t)w >= ix->wcap) {
        uint32_t nc = ix->wcap ? ix->wcap : 64;
        while (nc <= (uint32_t)w) nc *= 2;
        uint64_t *nw = PyMem_Realloc(ix->wcount, (size_t)nc * sizeof(uint64_t));
        if (!nw) { PyErr_NoMemory(); return -1; }
        memset(nw + ix->wcap, 0, (size_t)(nc - ix->wcap) * sizeof(uint64_t));
        ix->wcount = nw;
        ix->wcap = nc;
    }
    return set_nwords(ix, (uint32_t)(w / 64 + 1));
}

/* ------------------------------------------------------------------ per-entry holder ops */
/* add worker w to the entry (returns 1 if added, 0 if already present, -1 on error) */
static int entry_add(Index *ix, Slot *s, uint16_t w) {
    if (s->w[0] == W_SPILL) {
        uint64_t *m = spill_rec(ix, s);
        uint64_t bit = 1ull << (w & 63);
        if (m[w >> 6] & bit) return 0;
        m[w >> 6] |= bit;
        s->w[1]++;
        return 1;
    }
    int n = 0;
    for (; n < INLINE && s->w[n] != W_EMPTY; n++)
        if (s->w[n] == w) return 0;
    if (n < INLINE) {
        s->w[n] = w;
        return 1;
    }
    int64_t r = spill_alloc(ix);
    if (r < 0) return -1;
    uint64_t *m = ix->spill + (size_t)r * ix->nwords;
    for (int k = 0; k < INLINE; k++) m[s->w[k] >> 6] |= 1ull << (s->w[k] & 63);
    m[w >> 6] |= 1ull << (w & 63);
    s->w[0] = W_SPILL;
    s->w[1] = INLINE + 1;
    s->w[2] = (uint16_t)(r & 0xFFFF);
    s->w[3] = (uint16_t)(r >> 16);
    return 1;
}

/* remove worker w from the entry in slot index i; deletes the entry when it becomes empty.
 * returns 1 if removed, 0 if w did not hold it, -1 on error */
static int entry_remove(Index *ix, uint64_t i, uint16_t w) {
    Slot *s = &ix->slots[i];
    if (s->w[0] == W_SPILL) {
        uint64_t *m = spill_rec(ix, s);
        uint64_t bit = 1ull << (w & 63);
        if ((w >> 6) >= ix->nwords || !(m[w >> 6] & bit)) return 0;
        m[w >> 6] &= ~bit;
        if (--s->w[1] <= UNSPILL_AT) {
            uint32_t r = spill_idx(s);
            uint16_t ids[INLINE] = {W_EMPTY, W_EMPTY, W_EMPTY, W_EMPTY};
            int n = 0;
            for (uint32_t wd = 0; wd < ix->nwords && n < INLINE; wd++) {
                uint64_t x = m[wd];
                while (x && n < INLINE) {
                    ids[n++] = (uint16_t)(wd * 64 + ctz64(x));
                    x &= x - 1;
                }
            }
            if (spill_free(ix, r) < 0) return -1;
            memcpy(s->w, ids, sizeof ids);
        }
        return 1;
    }
    int n = inline_count(s), at = -1;
    for (int k = 0; k < n; k++)
        if (s->w[k] == w) at = k;
    if (at < 0) return 0;
    s->w[at] = s->w[n - 1];
    s->w[n - 1] = W_EMPTY;
    if (n == 1) delete_at(ix, i);
    return 1;
}

static inline int entry_has(const Index *ix, const Slot *s, uint16_t w) {
    if (s->w[0] == W_SPILL) {
        if ((uint32_t)(w >> 6) >= ix->nwords) return 0;
        return (spill_rec(ix, s)[w >> 6] >> (w & 63)) & 1;
    }
    return s->w[0] == w || s->w[1] == w || s->w[2] == w || s->w[3] == w;
}

/* copy key's slot into *out: 1 found, 0 absent. `checked` (a reader of a shared table the writer may be
 * changing): probes are bounded and a spill record out of range is refused, -2 (torn: retry) */
static inline int lookup_slot(const Index *ix, uint64_t key, Slot *out, int checked) {
    uint64_t i = home_of(ix, key);
    for (uint64_t n = 0;; n++) {
        *out = ix->slots[i];
        if (out->w[0] == W_EMPTY) return 0;
        if (out->key == key) return (checked && out->w[0] == W_SPILL && spill_idx(out) >= ix->spill_cap) ? -2 : 1;
        i = (i + 1) & ix->mask;
        if (checked && n >= ix->mask) return -2;
    }
}

/* ------------------------------------------------------------------ input: uint64 hashes */
typedef struct {
    Py_buffer view;
    int has_view;
    PyObject *seq; /* PySequence_Fast result */
    const uint64_t *ptr;
    Py_ssize_t n;
} U64Input;

static int u64_open(PyObject *obj, U64Input *in) {
    memset(in, 0, sizeof *in);
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        in->seq = obj;
        Py_INCREF(obj);
        in->n = PySequence_Fast_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_GetBuffer(obj, &in->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        in->has_view = 1;
        const char *f = in->view.format ? in->view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (in->view.ndim != 1 || in->view.itemsize != 8 || !strchr("QqLlNn", *f) || f[1]) {
            PyBuffer_Release(&in->view);
            in->has_view = 0;
            PyErr_SetString(PyExc_TypeError, "hashes must be a 1-d uint64/int64 buffer or a list of ints");
            return -1;
        }
        in->ptr = (const uint64_t *)in->view.buf;
        in->n = in->view.shape ? in->view.shape[0] : in->view.len / 8;
        return 0;
    }
    PyErr_Clear();
    in->seq = PySequence_Fast(obj, "hashes must be a sequence of ints or a uint64 buffer");
    if (!in->seq) return -1;
    in->n = PySequence_Fast_GET_SIZE(in->seq);
    return 0;
}

static void u64_close(U64Input *in) {
    if (in->has_view) PyBuffer_Release(&in->view);
    Py_XDECREF(in->seq);
}

static inline int py_u64(PyObject *o, uint64_t *out) {
    if (PyLong_CheckExact(o)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *out = v;
        return 0;
    }
    PyObject *ix = PyNumber_Index(o);
    if (!ix) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(ix);
    Py_DECREF(ix);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* pointer to hashes [start, start + len): the buffer itself, or `buf` filled from the sequence */
static const uint64_t *u64_chunk(U64Input *in, Py_ssize_t start, Py_ssize_t len, uint64_t *buf) {
    if (in->ptr) return in->ptr + start;
    PyObject **items = PySequence_Fast_ITEMS(in->seq);
    for (Py_ssize_t k = 0; k < len; k++)
        if (py_u64(items[start + k], &buf[k]) < 0) return NULL;
    return buf;
}

/* ------------------------------------------------------------------ Index type */
static int Index_init(Index *ix, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"names", "capacity", "shared", NULL};
    PyObject *names;
    Py_ssize_t capacity = 1024;
    const char *shared = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|nz", kwlist, &PyList_Type, &names, &capacity, &shared))
        return -1;
    uint64_t cap = 16;
    while ((uint64_t)capacity * LOAD_DEN > cap * LOAD_NUM) cap <<= 1;
    if (ix->slots || ix->hdr) return 0; /* already initialised */
    if (shared && *shared) {
#ifdef KVMESH_SHM
        if (shm_open_header(ix, shared) < 0) return -1;
#else
        PyErr_SetString(PyExc_OSError, "a shared index needs Linux");
        return -1;
#endif
    }
    write_begin(ix);
    ix->nwords = 1;
    ix->slots = alloc_slots(ix, cap, &ix->slots_gen);
    if (ix->slots) {
        ix->cap = cap;
        ix->mask = cap - 1;
        ix->shift = 64 - __builtin_ctzll(cap);
    }
    write_end(ix);
    if (!ix->slots) return -1;
    Py_INCREF(names);
    ix->names = names;
    return 0;
}

static void Index_dealloc(Index *ix) {
    free_slots(ix, ix->slots, ix->cap, ix->slots_gen);
    spill_release(ix);
    PyMem_Free(ix->spill_free);
    PyMem_Free(ix->wcount);
#ifdef KVMESH_SHM
    if (ix->hdr) munmap(ix->hdr, SHM_HEADER_BYTES);
#endif
    PyMem_Free(ix->shm_path);
    Py_XDECREF(ix->names);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static int parse_worker(Index *ix, PyObject *o, long *w) {
    *w = PyLong_AsLong(o);
    if (*w == -1 && PyErr_Occurred()) return -1;
    return ensure_worker(ix, *w);
}

/* store(worker_id, hashes) -> number of (worker, block) pairs added */
static PyObject *store_impl(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    long w;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "store(worker_id, hashes)"); return NULL; }
    if (parse_worker(ix, args[0], &w) < 0) return NULL;
    U64Input in;
    if (u64_open(args[1], &in) < 0) return NULL;
    uint64_t buf[CHUNK], added = 0;
    int err = 0;
    for (Py_ssize_t start = 0; start < in.n && !err; start += CHUNK) {
        Py_ssize_t len = in.n - start < CHUNK ? in.n - start : CHUNK;
        const uint64_t *hs = u64_chunk(&in, start, len, buf);
        if (!hs || reserve(ix, (uint64_t)len) < 0) { err = 1; break; }
        for (Py_ssize_t k = 0; k < len && k < PREFETCH; k++) prefetch_home(ix, hs[k]);
        for (Py_ssize_t k = 0; k < len; k++) {
            if (k + PREFETCH < len) prefetch_home(ix, hs[k + PREFETCH]);
            Slot *s = find(ix, hs[k]);
            if (!s) {
                s = place(ix, hs[k]);
                s->w[0] = (uint16_t)w;
                ix->live++;
                added++;
                continue;
            }
            int r = entry_add(ix, s, (uint16_t)w);
            if (r < 0) { err = 1; break; }
            added += (uint64_t)r;
        }
    }
    ix->pairs += added;
    ix->wcount[w] += added;
    u64_close(&in);
    if (err) return NULL;
    return PyLong_FromUnsignedLongLong(added);
}

/* remove(worker_id, hashes) -> number of pairs removed (unknown blocks ignored) */
static PyObject *remove_impl(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    long w;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "remove(worker_id, hashes)"); return NULL; }
    if (parse_worker(ix, args[0], &w) < 0) return NULL;
    U64Input in;
    if (u64_open(args[1], &in) < 0) return NULL;
    uint64_t buf[CHUNK], removed = 0;
    int err = 0;
    for (Py_ssize_t start = 0; start < in.n && !err && ix->wcount[w] > removed; start += CHUNK) {
        Py_ssize_t len = in.n - start < CHUNK ? in.n - start : CHUNK;
        const uint64_t *hs = u64_chunk(&in, start, len, buf);
        if (!hs) { err = 1; break; }
        for (Py_ssize_t k = 0; k < len && k < PREFETCH; k++) prefetch_home(ix, hs[k]);
        for (Py_ssize_t k = 0; k < len; k++) {
            if (k + PREFETCH < len) prefetch_home(ix, hs[k + PREFETCH]);
            Slot *s = find(ix, hs[k]);
            if (!s) continue;
            int r = entry_remove(ix, (uint64_t)(s - ix->slots), (uint16_t)w);
            if (r < 0) { err = 1; break; }
            removed += (uint64_t)r;
        }
    }
    ix->pairs -= removed;
    ix->wcount[w] -= removed;
    u64_close(&in);
    if (err) return NULL;
    return PyLong_FromUnsignedLongLong(removed);
}

/* clear(worker_id) -> pairs removed. Scans the table; stops once the worker's count is 0. */
static PyObject *clear_impl(Index *ix, PyObject *arg) {
    long w;
    if (parse_worker(ix, arg, &w) < 0) return NULL;
    uint64_t left = ix->wcount[w], removed = 0;
    for (uint64_t i = 0; i < ix->cap && removed < left;) {
        Slot *s = &ix->slots[i];
        if (s->w[0] != W_EMPTY && entry_has(ix, s, (uint16_t)w)) {
            uint64_t before = ix->live;
            if (entry_remove(ix, i, (uint16_t)w) < 0) return NULL;
            removed++;
            if (ix->live != before) continue; /* entry deleted: slot i now holds a shifted entry */
        }
        i++;
    }
    ix->pairs -= removed;
    ix->wcount[w] -= removed;
    return PyLong_FromUnsignedLongLong(removed);
}

/* the mutations, each one change of a shared index (see write_begin) */
static PyObject *Index_store(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    write_begin(ix);
    PyObject *r = store_impl(ix, args, nargs);
    write_end(ix);
    return r;
}

static PyObject *Index_remove(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    write_begin(ix);
    PyObject *r = remove_impl(ix, args, nargs);
    write_end(ix);
    return r;
}

static PyObject *Index_clear(Index *ix, PyObject *arg) {
    write_begin(ix);
    PyObject *r = clear_impl(ix, arg);
    write_end(ix);
    return r;
}

static int record(PyObject *out, PyObject *names, uint32_t w, Py_ssize_t depth) {
    if (depth <= 0 || (Py_ssize_t)w >= PyList_GET_SIZE(names)) return 0;
    PyObject *name = PyList_GET_ITEM(names, w);
    if (name == Py_None) return 0;
    PyObject *d = PyLong_FromSsize_t(depth);
    if (!d) return -1;
    int r = PyDict_SetItem(out, name, d);
    Py_DECREF(d);
    return r;
}

/* record every worker of word `wd` of a bitmask (bits x) at `depth` */
static int record_word(PyObject *out, PyObject *names, uint32_t wd, uint64_t x, Py_ssize_t depth) {
    while (x) {
        if (record(out, names, wd * 64 + (uint32_t)ctz64(x), depth) < 0) return -1;
        x &= x - 1;
    }
    return 0;
}

/* record every worker of bitmask `bits` (nwords words) at `depth` */
static int record_bits(PyObject *out, PyObject *names, const uint64_t *bits, uint32_t nwords, Py_ssize_t depth) {
    for (uint32_t wd = 0; wd < nwords; wd++)
        if (record_word(out, names, wd, bits[wd], depth) < 0) return -1;
    return 0;
}

/* the match walk into `out` ({name: leading blocks held}): 0, -1 (Python error) or -2 (`checked` only: the
 * table changed under the walk, retry) */
static int walk_matches(const Index *ix, U64Input *in, PyObject *out, int checked) {
    const uint32_t nw = ix->nwords;
    uint64_t alive[MAX_WORDS];
    uint64_t cnt = 0;     /* alive workers */
    uint32_t single = 0;  /* the alive worker when cnt == 1 */
    uint64_t buf[CHUNK];
    Py_ssize_t pos = 0;
    int err = 0;
    Slot cs;
    for (Py_ssize_t start = 0; start < in->n; start += CHUNK) {
        Py_ssize_t len = in->n - start < CHUNK ? in->n - start : CHUNK;
        const uint64_t *hs = u64_chunk(in, start, len, buf);
        if (!hs) { err = 1; goto done; }
        for (Py_ssize_t k = 0; k < len && k < PREFETCH; k++) prefetch_home(ix, hs[k]);
        for (Py_ssize_t k = 0; k < len; k++) {
            if (k + PREFETCH < len) prefetch_home(ix, hs[k + PREFETCH]);
            pos = start + k;
            int found = lookup_slot(ix, hs[k], &cs, checked);
            if (found < 0) { err = 2; goto done; }
            const Slot *s = found ? &cs : NULL;
            if (pos == 0) {
                if (!s) goto done;
                memset(alive, 0, nw * sizeof(uint64_t));
                if (s->w[0] == W_SPILL) {
                    memcpy(alive, spill_rec(ix, s), nw * sizeof(uint64_t));
                    cnt = s->w[1];
                } else {
                    cnt = (uint64_t)inline_count(s);
                    for (uint64_t j = 0; j < cnt; j++) alive[s->w[j] >> 6] |= 1ull << (s->w[j] & 63);
                    single = s->w[0];
                }
                continue;
            }
            if (!s) {  /* every alive worker stops here */
                if (record_bits(out, ix->names, alive, nw, pos) < 0) err = 1;
                cnt = 0;
                goto done;
            }
            if (cnt == 1) {
                if (!entry_has(ix, s, (uint16_t)single)) {
                    if (record(out, ix->names, single, pos) < 0) err = 1;
                    cnt = 0;
                    goto done;
                }
                continue;
            }
            if (s->w[0] == W_SPILL) {
                const uint64_t *m = spill_rec(ix, s);
                for (uint32_t wd = 0; wd < nw; wd++) {
                    uint64_t gone = alive[wd] & ~m[wd];
                    if (!gone) continue;
                    alive[wd] &= m[wd];
                    cnt -= (uint64_t)__builtin_popcountll(gone);
                    if (record_word(out, ix->names, wd, gone, pos) < 0) { err = 1; goto done; }
                }
            } else {
                uint64_t keep[INLINE];
                int nk = 0;
                for (int j = 0; j < INLINE && s->w[j] != W_EMPTY; j++) {
                    uint16_t id = s->w[j];
                    if ((alive[id >> 6] >> (id & 63)) & 1) keep[nk++] = id;
                }
                if ((uint64_t)nk == cnt) continue;
                /* drop every alive worker not kept */
                for (int j = 0; j < nk; j++) alive[keep[j] >> 6] &= ~(1ull << (keep[j] & 63));
                if (record_bits(out, ix->names, alive, nw, pos) < 0) { err = 1; goto done; }
                memset(alive, 0, nw * sizeof(uint64_t));
                for (int j = 0; j < nk; j++) alive[keep[j] >> 6] |= 1ull << (keep[j] & 63);
                cnt = (uint64_t)nk;
            }
            if (cnt == 0) goto done;
            if (cnt == 1) {
                for (uint32_t wd = 0; wd < nw; wd++)
                    if (alive[wd]) { single = wd * 64 + (uint32_t)ctz64(alive[wd]); break; }
            }
        }
    }
    /* survivors matched the whole query */
    if (cnt == 1) {
        if (record(out, ix->names, single, in->n) < 0) err = 1;
    } else if (cnt > 1) {
        if (record_bits(out, ix->names, alive, nw, in->n) < 0) err = 1;
    }
done:
    return err == 1 ? -1 : err == 2 ? -2 : 0;
}

/* find_matches(hashes) -> {name: leading blocks held} */
static PyObject *Index_find_matches(Index *ix, PyObject *arg) {
    U64Input in;
    if (u64_open(arg, &in) < 0) return NULL;
    PyObject *out = PyDict_New();
    if (out && walk_matches(ix, &in, out, 0) < 0) Py_CLEAR(out);
    u64_close(&in);
    return out;
}

/* first position whose block worker w holds (in.n if none); -1 on a Python error, -2 torn (`checked`) */
static Py_ssize_t first_held_in(const Index *ix, U64Input *in, uint16_t w, int checked) {
    uint64_t buf[CHUNK];
    for (Py_ssize_t start = 0; start < in->n; start += CHUNK) {
        Py_ssize_t len = in->n - start < CHUNK ? in->n - start : CHUNK;
        const uint64_t *hs = u64_chunk(in, start, len, buf);
        if (!hs) return -1;
        for (Py_ssize_t k = 0; k < len; k++) {
            Slot cs;
            int found = lookup_slot(ix, hs[k], &cs, checked);
            if (found < 0) return -2;
            if (found && entry_has(ix, &cs, w)) return start + k;
        }
    }
    return in->n;
}

static int parse_first_held(PyObject *const *args, Py_ssize_t nargs, long *w, U64Input *in) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "first_held(worker_id, hashes)"), -1;
    *w = PyLong_AsLong(args[0]);
    if (*w == -1 && PyErr_Occurred()) return -1;
    if (*w < 0 || *w >= MAX_WORKERS) return PyErr_Format(PyExc_ValueError, "worker id %ld out of range", *w), -1;
    return u64_open(args[1], in);
}

/* first_held(worker_id, hashes) -> the first position whose block the worker holds (len(hashes) if none) */
static PyObject *Index_first_held(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    long w;
    U64Input in;
    if (parse_first_held(args, nargs, &w, &in) < 0) return NULL;
    Py_ssize_t at = first_held_in(ix, &in, (uint16_t)w, 0);
    u64_close(&in);
    return at < 0 ? NULL : PyLong_FromSsize_t(at);
}

static PyObject *Index_num_blocks(Index *ix, PyObject *arg) {
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred()) return NULL;
    if (w < 0 || (uint32_t)w >= ix->wcap) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(ix->wcount[w]);
}

/* blocks_of(worker_id) -> bytearray of the worker's block hashes (native-endian uint64, table order) */
static PyObject *Index_blocks_of(Index *ix, PyObject *arg) {
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred()) return NULL;
    uint64_t n = (w >= 0 && (uint32_t)w < ix->wcap) ? ix->wcount[w] : 0;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (!out || n == 0) return out;
    uint64_t *dst = (uint64_t *)PyByteArray_AS_STRING(out), k = 0;
    for (uint64_t i = 0; i < ix->cap && k < n; i++) {
        const Slot *s = &ix->slots[i];
        if (s->w[0] != W_EMPTY && entry_has(ix, s, (uint16_t)w)) dst[k++] = s->key;
    }
    return out;
}

/* export(nwords) -> (keys bytes, masks bytes): every entry's key and its holders as nwords-word bitmasks */
static PyObject *Index_export(Index *ix, PyObject *arg) {
    long nw = PyLong_AsLong(arg);
    if (nw == -1 && PyErr_Occurred()) return NULL;
    if (nw < (long)ix->nwords) {
        PyErr_Format(PyExc_ValueError, "export needs nwords >= %u", ix->nwords);
        return NULL;
    }
    PyObject *keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(ix->live * 8));
    PyObject *masks = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(ix->live * 8 * (uint64_t)nw));
    if (!keys || !masks) { Py_XDECREF(keys); Py_XDECREF(masks); return NULL; }
    uint64_t *kd = (uint64_t *)PyBytes_AS_STRING(keys), *md = (uint64_t *)PyBytes_AS_STRING(masks);
    memset(md, 0, ix->live * 8 * (uint64_t)nw);
    uint64_t e = 0;
    for (uint64_t i = 0; i < ix->cap; i++) {
        const Slot *s = &ix->slots[i];
        if (s->w[0] == W_EMPTY) continue;
        kd[e] = s->key;
        uint64_t *m = md + e * (uint64_t)nw;
        if (s->w[0] == W_SPILL) {
            memcpy(m, spill_rec(ix, s), ix->nwords * sizeof(uint64_t));
        } else {
            for (int j = 0; j < INLINE && s->w[j] != W_EMPTY; j++) m[s->w[j] >> 6] |= 1ull << (s->w[j] & 63);
        }
        e++;
    }
    return Py_BuildValue("(NN)", keys, masks);
}

/* load(keys, masks, nwords): add every (worker, key) pair of an export (into this index) */
static PyObject *load_impl(Index *ix, PyObject *args) {
    Py_buffer kb, mb;
    long nw;
    if (!PyArg_ParseTuple(args, "y*y*l", &kb, &mb, &nw)) return NULL;
    PyObject *ret = NULL;
    uint64_t n = (uint64_t)kb.len / 8;
    if (nw <= 0 || (uint64_t)mb.len != n * 8 * (uint64_t)nw) {
        PyErr_SetString(PyExc_ValueError, "masks size does not match keys * nwords");
        goto out;
    }
    if (reserve(ix, n) < 0) goto out;
    const uint64_t *kd = kb.buf, *md = mb.buf;
    uint64_t added = 0;
    for (uint64_t e = 0; e < n; e++) {
        for (long wd = 0; wd < nw; wd++) {
            uint64_t x = md[e * (uint64_t)nw + wd];
            while (x) {
                long w = wd * 64 + ctz64(x);
                x &= x - 1;
                if (ensure_worker(ix, w) < 0) goto out;
                Slot *s = find(ix, kd[e]);
                int r;
                if (!s) {
                    s = place(ix, kd[e]);
                    s->w[0] = (uint16_t)w;
                    ix->live++;
                    r = 1;
                } else if ((r = entry_add(ix, s, (uint16_t)w)) < 0) {
                    goto out;
                }
                added += (uint64_t)r;
                ix->wcount[w] += (uint64_t)r;
            }
        }
    }
    ix->pairs += added;
    ret = PyLong_FromUnsignedLongLong(added);
out:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&mb);
    return ret;
}

static PyObject *Index_load(Index *ix, PyObject *args) {
    write_begin(ix);
    PyObject *r = load_impl(ix, args);
    write_end(ix);
    return r;
}

static int word_index(PyObject *arg, long *i) {
    *i = PyLong_AsLong(arg);
    if (*i == -1 && PyErr_Occurred()) return -1;
    if (*i < 0 || *i >= SHM_WORDS) return PyErr_Format(PyExc_IndexError, "word %ld not in [0, %d)", *i, SHM_WORDS), -1;
    return 0;
}

/* word(i) / set_word(i, value): the shared header's owner words (ValueError on a private index) */
static PyObject *Index_word(Index *ix, PyObject *arg) {
    long i;
    if (word_index(arg, &i) < 0) return NULL;
    if (!ix->hdr) return PyErr_Format(PyExc_ValueError, "not a shared index"), NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&ix->hdr->words[i], __ATOMIC_ACQUIRE));
}

static PyObject *Index_set_word(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    long i;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "set_word(i, value)"), NULL;
    if (word_index(args[0], &i) < 0) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!ix->hdr) return PyErr_Format(PyExc_ValueError, "not a shared index"), NULL;
    __atomic_store_n(&ix->hdr->words[i], (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Index_nbytes(Index *ix, PyObject *Py_UNUSED(ignored)) {
    uint64_t b = ix->cap * sizeof(Slot) + (uint64_t)ix->spill_cap * ix->nwords * 8 + (uint64_t)ix->free_cap * 4 +
                 (uint64_t)ix->wcap * 8;
    return PyLong_FromUnsignedLongLong(b);
}

/* stats() -> (capacity, entries, pairs, spilled entries, nwords) */
static PyObject *Index_stats(Index *ix, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(KKKKI)", (unsigned long long)ix->cap, (unsigned long long)ix->live,
                         (unsigned long long)ix->pairs, (unsigned long long)(ix->spill_top - ix->nfree), ix->nwords);
}

static PyMethodDef Index_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Index_store, METH_FASTCALL, "store(worker_id, hashes) -> pairs added"},
    {"remove", (PyCFunction)(void (*)(void))Index_remove, METH_FASTCALL, "remove(worker_id, hashes) -> pairs removed"},
    {"clear", (PyCFunction)Index_clear, METH_O, "clear(worker_id) -> pairs removed"},
    {"find_matches", (PyCFunction)Index_find_matches, METH_O, "find_matches(hashes) -> {name: matched blocks}"},
    {"num_blocks", (PyCFunction)Index_num_blocks, METH_O, "num_blocks(worker_id) -> int"},
    {"blocks_of", (PyCFunction)Index_blocks_of, METH_O, "blocks_of(worker_id) -> bytearray of uint64"},
    {"export", (PyCFunction)Index_export, METH_O, "export(nwords) -> (keys bytes, masks bytes)"},
    {"load", (PyCFunction)Index_load, METH_VARARGS, "load(keys, masks, nwords) -> pairs added"},
    {"nbytes", (PyCFunction)Index_nbytes, METH_NOARGS, "allocated bytes of the index's arrays"},
    {"stats", (PyCFunction)Index_stats, METH_NOARGS, "(capacity, entries, pairs, spilled, nwords)"},
    {"first_held", (PyCFunction)(void (*)(void))Index_first_held, METH_FASTCALL,
     "first_held(worker_id, hashes) -> first position the worker holds (len if none)"},
    {"word", (PyCFunction)Index_word, METH_O, "word(i) -> the shared header's owner word i"},
    {"set_word", (PyCFunction)(void (*)(void))Index_set_word, METH_FASTCALL, "set_word(i, value)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvmesh.index._native.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Index(names: list, capacity: int = 1024, shared: str | None = None): block hash -> worker ids "
              "(see the module source); `shared`: the header path of a shared index (this process writes it).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

/* ------------------------------------------------------------------ IndexView: a reader of a shared index */
#ifdef KVMESH_SHM
#define VIEW_TRIES 64 /* reads that overlapped a change before a query answers None */

typedef struct {
    PyObject_HEAD
    ShmHeader *hdr;
    char *path;
    PyObject *names; /* list: worker id -> name or None, kept by the Python wrapper */
    Slot *slots;
    uint64_t slots_gen, slots_bytes;
    uint64_t *spill;
    uint64_t spill_gen, spill_bytes;
    unsigned long long retries, failures;
} View;

/* map the writer's segment `kind` of generation `gen` (0: none) in place of the one mapped: 0, or -2 (gone
 * already: the writer replaced it; retry from the header) */
static int view_map(View *v, char kind, uint64_t gen, void **p, uint64_t *bytes, uint64_t *have) {
    if (gen == *have) return 0;
    if (*p) munmap(*p, *bytes);
    *p = NULL, *bytes = 0, *have = 0;
    if (gen == 0) return 0;
    char path[4096];
    int r = snprintf(path, sizeof path, "%s.%c%llu", v->path, kind, (unsigned long long)gen);
    if (r < 0 || (size_t)r >= sizeof path) return -2;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -2;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size > 0) m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return -2;
    *p = m, *bytes = (uint64_t)st.st_size, *have = gen;
    return 0;
}

/* start a read: an Index describing the mapped table (sizes checked against the mappings) and the seq to
 * compare at the end; -2 while the writer is inside a change */
static int view_begin(View *v, Index *t, uint64_t *seq) {
    const ShmHeader *h = v->hdr;
    uint64_t s = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
    if (s & 1) return -2;
    uint64_t sg = h->slots_gen, cap = h->cap, pg = h->spill_gen, pc = h->spill_cap, nw = h->nwords;
    if (view_map(v, 's', sg, (void **)&v->slots, &v->slots_bytes, &v->slots_gen) < 0) return -2;
    if (view_map(v, 'p', pg, (void **)&v->spill, &v->spill_bytes, &v->spill_gen) < 0) return -2;
    if (cap < 2 || (cap & (cap - 1)) || cap * sizeof(Slot) > v->slots_bytes) return -2;
    if (nw == 0 || nw > MAX_WORDS || pc * nw * 8 > v->spill_bytes || pc > UINT32_MAX) return -2;
    memset(t, 0, sizeof *t);
    t->slots = v->slots, t->cap = cap, t->mask = cap - 1, t->shift = 64 - __builtin_ctzll(cap);
    t->spill = v->spill, t->spill_cap = (uint32_t)pc, t->nwords = (uint32_t)nw, t->names = v->names;
    *seq = s;
    return 0;
}

/* did the read that began at `seq` see one state of the table? */
static inline int view_end(const View *v, uint64_t seq) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&v->hdr->seq, __ATOMIC_RELAXED) == seq;
}

static int View_init(View *v, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "names", NULL};
    const char *path;
    PyObject *names;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO!", kwlist, &path, &PyList_Type, &names)) return -1;
    if (v->hdr) return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path), -1;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size >= SHM_HEADER_BYTES)
        m = mmap(NULL, SHM_HEADER_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED || ((ShmHeader *)m)->magic != SHM_MAGIC) {
        if (m != MAP_FAILED) munmap(m, SHM_HEADER_BYTES);
        return PyErr_Format(PyExc_ValueError, "%s is not a kvmesh shared index", path), -1;
    }
    size_t n = strlen(path) + 1;
    if (!(v->path = PyMem_Malloc(n))) return munmap(m, SHM_HEADER_BYTES), PyErr_NoMemory(), -1;
    memcpy(v->path, path, n);
    v->hdr = m;
    Py_INCREF(names);
    v->names = names;
    return 0;
}

static void View_dealloc(View *v) {
    if (v->slots) munmap(v->slots, v->slots_bytes);
    if (v->spill) munmap(v->spill, v->spill_bytes);
    if (v->hdr) munmap(v->hdr, SHM_HEADER_BYTES);
    PyMem_Free(v->path);
    Py_XDECREF(v->names);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

/* find_matches(hashes) -> {name: leading blocks held}, or None when every try overlapped a change */
static PyObject *View_find_matches(View *v, PyObject *arg) {
    U64Input in;
    if (u64_open(arg, &in) < 0) return NULL;
    PyObject *result = NULL;
    for (int t = 0; t < VIEW_TRIES; t++) {
        Index ix;
        uint64_t seq;
        if (view_begin(v, &ix, &seq) == 0) {
            PyObject *out = PyDict_New();
            if (!out) goto done;
            int r = walk_matches(&ix, &in, out, 1);
            if (r == -1) { Py_DECREF(out); goto done; }
            if (r == 0 && view_end(v, seq)) { result = out; goto done; }
            Py_DECREF(out);
        }
        v->retries++;
        sched_yield(); /* let the writer finish its change */
    }
    v->failures++;
    result = Py_NewRef(Py_None);
done:
    u64_close(&in);
    return result;
}

/* first_held(worker_id, hashes) -> the first position whose block the worker holds (len(hashes) if none), or
 * None when every try overlapped a change */
static PyObject *View_first_held(View *v, PyObject *const *args, Py_ssize_t nargs) {
    long w;
    U64Input in;
    if (parse_first_held(args, nargs, &w, &in) < 0) return NULL;
    PyObject *result = NULL;
    for (int t = 0; t < VIEW_TRIES; t++) {
        Index ix;
        uint64_t seq;
        if (view_begin(v, &ix, &seq) == 0) {
            Py_ssize_t at = first_held_in(&ix, &in, (uint16_t)w, 1);
            if (at == -1) goto done;
            if (at >= 0 && view_end(v, seq)) { result = PyLong_FromSsize_t(at); goto done; }
        }
        v->retries++;
        sched_yield();
    }
    v->failures++;
    result = Py_NewRef(Py_None);
done:
    u64_close(&in);
    return result;
}

static PyObject *View_word(View *v, PyObject *arg) {
    long i;
    if (word_index(arg, &i) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&v->hdr->words[i], __ATOMIC_ACQUIRE));
}

/* stats() -> (capacity, entries, pairs, retries, failures): the header's last published sizes and this
 * view's reads retried / given up */
static PyObject *View_stats(View *v, PyObject *Py_UNUSED(ignored)) {
    const ShmHeader *h = v->hdr;
    return Py_BuildValue("(KKKKK)", (unsigned long long)h->cap, (unsigned long long)h->live,
                         (unsigned long long)h->pairs, v->retries, v->failures);
}

static PyMethodDef View_methods[] = {
    {"find_matches", (PyCFunction)View_find_matches, METH_O, "find_matches(hashes) -> {name: blocks} or None"},
    {"first_held", (PyCFunction)(void (*)(void))View_first_held, METH_FASTCALL,
     "first_held(worker_id, hashes) -> first position the worker holds (len if none), or None"},
    {"word", (PyCFunction)View_word, METH_O, "word(i) -> the header's owner word i"},
    {"stats", (PyCFunction)View_stats, METH_NOARGS, "(capacity, entries, pairs, retries, failures)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvmesh.index._native.IndexView",
    .tp_basicsize = sizeof(View),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IndexView(path: str, names: list): read-only view of a shared Index written by another process.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)View_init,
    .tp_dealloc = (destructor)View_dealloc,
    .tp_methods = View_methods,
};
#endif

/* ------------------------------------------------------------------ hashing */
static inline uint64_t finalize64(uint64_t s) {
    uint64_t y = (s ^ (s >> 32)) * HASH_M;
    return y ^ (y >> 29);
}

static inline int list_token(PyObject *o, uint64_t *out) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(o)) {
        Py_ssize_t sz = Py_SIZE(o);
        if (sz == 0) { *out = 0; return 0; }
        if (sz == 1) { *out = ((PyLongObject *)o)->ob_digit[0]; return 0; }
    }
#else
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
        *out = (uint64_t)(int64_t)v;
        return 0;
    }
#endif
    PyObject *ix = PyNumber_Index(o);
    if (!ix) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(ix, &overflow);
    Py_DECREF(ix);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "token id out of int64 range");
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v; /* negatives wrap, as numpy's int64 -> uint64 view */
    return 0;
}

#define DOT_LOOP(T, CONV)                                                     \
    for (Py_ssize_t i = 0; i < n; i++) {                                      \
        const char *row = base + i * bs * stride;                             \
        uint64_t c = 0;                                                       \
        for (Py_ssize_t k = 0; k < bs; k++) c += (uint64_t)(CONV)(*(const T *)(row + k * stride)) * K[k]; \
        uint64_t s = acc + c;                                                 \
        out[i] = finalize64(s);                                               \
        acc = HASH_P * s;                                                     \
    }

/* hash_blocks(tokens, K, base, out) -> None: out[i] = h_i for the n = len(out) full blocks (see the top). */
static PyObject *hash_blocks(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "hash_blocks(tokens, K, base, out)"); return NULL; }
    uint64_t acc = PyLong_AsUnsignedLongLong(args[2]);
    if (acc == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    Py_buffer kv, ov, tv;
    if (PyObject_GetBuffer(args[1], &kv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    PyObject *ret = NULL;
    const uint64_t *K = kv.buf;
    uint64_t *out = ov.buf;
    Py_ssize_t bs = kv.len / 8, n = ov.len / 8;
    if (bs <= 0) { PyErr_SetString(PyExc_ValueError, "empty K"); goto release; }
    PyObject *tok = args[0];
    if (PyList_Check(tok) || PyTuple_Check(tok)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(tok);
        PyObject **items = PySequence_Fast_ITEMS(tok);
        if (len / bs != n) { PyErr_SetString(PyExc_ValueError, "out has the wrong length"); goto release; }
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t c = 0;
            PyObject **row = items + i * bs;
            for (Py_ssize_t k = 0; k < bs; k++) {
                uint64_t t;
                if (list_token(row[k], &t) < 0) goto release;
                c += t * K[k];
            }
            uint64_t s = acc + c;
            out[i] = finalize64(s);
            acc = HASH_P * s;
        }
        Py_INCREF(Py_None);
        ret = Py_None;
        goto release;
    }
    if (PyObject_GetBuffer(tok, &tv, PyBUF_STRIDES | PyBUF_FORMAT) < 0) goto release;
    const char *f = tv.format ? tv.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (tv.ndim != 1 || f[0] == 0 || f[1] != 0 || !strchr("bBhHiIlLqQ", *f)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a 1-d integer buffer or a list of ints");
        PyBuffer_Release(&tv);
        goto release;
    }
    if (tv.shape[0] / bs != n) {
        PyErr_SetString(PyExc_ValueError, "out has the wrong length");
        PyBuffer_Release(&tv);
        goto release;
    }
    const char *base = tv.buf;
    Py_ssize_t stride = tv.strides[0];
    switch (tv.itemsize) {
    case 8: DOT_LOOP(uint64_t, uint64_t) break;
    case 4: DOT_LOOP(uint32_t, uint32_t) break;
    case 2:
        if (*f == 'h') { DOT_LOOP(int16_t, int64_t) } else { DOT_LOOP(uint16_t, uint16_t) }
        break;
    case 1:
        if (*f == 'b') { DOT_LOOP(int8_t, int64_t) } else { DOT_LOOP(uint8_t, uint8_t) }
        break;
    default:
        PyErr_SetString(PyExc_TypeError, "unsupported token item size");
        PyBuffer_Release(&tv);
        goto release;
    }
    PyBuffer_Release(&tv);
    Py_INCREF(Py_None);
    ret = Py_None;
release:
    PyBuffer_Release(&kv);
    PyBuffer_Release(&ov);
    return ret;
}

static PyMethodDef module_methods[] = {
    {"hash_blocks", (PyCFunction)(void (*)(void))hash_blocks, METH_FASTCALL,
     "hash_blocks(tokens, K, base, out): chained block hashes into out (uint64, one per full block)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvmesh.index._native", "Compiled core of kvmesh's prefix index and block hasher.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef KVMESH_SHM
    if (PyType_Ready(&ViewType) < 0 || PyModule_AddObjectRef(m, "IndexView", (PyObject *)&ViewType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    if (PyModule_AddIntConstant(m, "SHARED_WORDS", SHM_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORKERS", MAX_WORKERS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
