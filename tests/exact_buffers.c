/*
 * exact_buffers.c -- an exact live-buffer counter for MLX's CPU allocator.
 *
 * Test-only shim, built with gcc by tests/exact_buffers.py and loaded with ctypes.
 *
 * In MLX's Linux (no-GPU) build, mlx::core::allocator::allocator() returns the singleton
 * CommonAllocator, and every buffer MLX makes goes through its vtable (no direct or
 * speculatively devirtualized calls exist in libmlx.so 0.32.x).  The Itanium ABI vtable that
 * the object's first word points at holds (mlx/allocator.h declaration order):
 *     [-2] offset-to-top  [-1] typeinfo
 *     [0] malloc(size_t) -> Buffer   [1] free(Buffer)   [2] size(Buffer) const
 *     [3] make_buffer   [4] release   [5] ~D1   [6] ~D0
 * Buffer is a single trivially-copyable pointer, so it travels in a register:
 *     malloc: void *(*)(void *self, size_t)    free: void (*)(void *self, void *buf)
 *
 * install() makes the vtable page writable and swaps slots 0 and 1 for wrappers that call the
 * originals and keep a hash set {buffer pointer -> bytes} under a mutex (MLX allocates and frees
 * from its worker threads as well).  Buffers allocated before install() are unknown: freeing
 * one just calls the original free and is counted in untracked_frees().
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef void *(*malloc_fn)(void *self, size_t size);
typedef void (*free_fn)(void *self, void *buf);
typedef size_t (*size_fn)(void *self, void *buf);

enum { SLOT_MALLOC = 0, SLOT_FREE = 1, SLOT_SIZE = 2 };
static const char EXPECTED_TYPE[] = "N3mlx4core9allocator15CommonAllocatorE";

static void **g_vtable;     /* the allocator's vtable (slot 0 address) */
static malloc_fn g_malloc;  /* original slots */
static free_fn g_free;
static size_fn g_size;
static volatile int g_installed;

/* Open-addressing hash set, linear probing, backward-shift deletion.  key 0 = empty slot. */
typedef struct {
    uintptr_t key;
    size_t bytes;      /* what MLX accounts for this buffer (the allocator's size(), may
                          exceed the request when a cached buffer is reused) */
    size_t requested;  /* the size passed to malloc; 0 = an "empty" buffer */
} entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static entry *g_tab;
static size_t g_cap;  /* power of two */
static long g_count, g_nonempty, g_untracked_frees, g_mallocs, g_frees;
static size_t g_bytes;

static inline size_t slot_of(uintptr_t k, size_t mask) {
    return (size_t)((k >> 4) * 0x9E3779B97F4A7C15ull >> 17) & mask;
}

static void put(entry e) { /* caller holds lock; table has room */
    size_t mask = g_cap - 1, i = slot_of(e.key, mask);
    while (g_tab[i].key && g_tab[i].key != e.key) i = (i + 1) & mask;
    if (g_tab[i].key == e.key) { /* should not happen: a live pointer handed out twice */
        g_bytes -= g_tab[i].bytes;
        g_count--;
        if (g_tab[i].requested) g_nonempty--;
    }
    g_tab[i] = e;
}

static int grow(void) { /* caller holds lock */
    size_t old_cap = g_cap, i;
    entry *old = g_tab, *tab = calloc(old_cap ? old_cap * 2 : 4096, sizeof(entry));
    if (!tab) return -1;
    g_tab = tab;
    g_cap = old_cap ? old_cap * 2 : 4096;
    for (i = 0; i < old_cap; i++)
        if (old[i].key) put(old[i]);
    free(old);
    return 0;
}

/* Remove key; returns 1 and fills *out if it was present. Caller holds lock. */
static int take(uintptr_t k, entry *out) {
    size_t mask, i, j, h;
    if (!g_cap) return 0;
    mask = g_cap - 1;
    i = slot_of(k, mask);
    while (g_tab[i].key != k) {
        if (!g_tab[i].key) return 0;
        i = (i + 1) & mask;
    }
    *out = g_tab[i];
    /* backward-shift: pull later members of the probe run into the hole */
    for (j = (i + 1) & mask; g_tab[j].key; j = (j + 1) & mask) {
        h = slot_of(g_tab[j].key, mask);
        if (((j - h) & mask) >= ((j - i) & mask)) { /* home not in (i, j] */
            g_tab[i] = g_tab[j];
            i = j;
        }
    }
    g_tab[i].key = 0;
    return 1;
}

static void *wrap_malloc(void *self, size_t size) {
    void *p = g_malloc(self, size);
    if (p) {
        entry e = {(uintptr_t)p, g_size(self, p), size};
        pthread_mutex_lock(&g_lock);
        g_mallocs++;
        if ((size_t)(g_count + 1) * 2 <= g_cap || grow() == 0) {
            put(e);
            g_count++;
            g_bytes += e.bytes;
            if (size) g_nonempty++;
        }
        pthread_mutex_unlock(&g_lock);
    }
    return p;
}

static void wrap_free(void *self, void *p) {
    entry e;
    /* drop the pointer BEFORE the original free: once freed, a concurrent malloc may be handed
       the same pointer back (buffer cache / libc) and records it anew */
    pthread_mutex_lock(&g_lock);
    g_frees++;
    if (p && take((uintptr_t)p, &e)) {
        g_count--;
        g_bytes -= e.bytes;
        if (e.requested) g_nonempty--;
    } else if (p) {
        g_untracked_frees++;
    }
    pthread_mutex_unlock(&g_lock);
    g_free(self, p);
}

static int set_slots(void **vt, void *m, void *f) {
    long pg = sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)&vt[SLOT_MALLOC] & ~(uintptr_t)(pg - 1);
    uintptr_t hi = ((uintptr_t)&vt[SLOT_FREE] + sizeof(void *) + pg - 1) & ~(uintptr_t)(pg - 1);
    if (mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE)) return -1;
    /* aligned 8-byte stores are atomic on x86-64/arm64: callers see old or new pointers.
       Order matters: free first on install (a wrapped malloc never meets the raw free), and
       malloc first on uninstall. */
    if (f == (void *)wrap_free) {
        __atomic_store_n(&vt[SLOT_FREE], f, __ATOMIC_SEQ_CST);
        __atomic_store_n(&vt[SLOT_MALLOC], m, __ATOMIC_SEQ_CST);
    } else {
        __atomic_store_n(&vt[SLOT_MALLOC], m, __ATOMIC_SEQ_CST);
        __atomic_store_n(&vt[SLOT_FREE], f, __ATOMIC_SEQ_CST);
    }
    mprotect((void *)lo, hi - lo, PROT_READ); /* back to RELRO-style read-only */
    return 0;
}

/* Install on the allocator object `self` (the address allocator() returns).
   0 = ok (or already installed), -1 = not a CommonAllocator, -2 = mprotect failed,
   -3 = out of memory. */
int install(void *self) {
    void **vt;
    const char *const *ti;
    if (g_installed) return 0;
    vt = *(void ***)self;
    ti = (const char *const *)vt[-1];        /* std::type_info: {vptr, const char *name} */
    if (!ti || strcmp(ti[1], EXPECTED_TYPE) != 0) return -1;
    pthread_mutex_lock(&g_lock);
    if (!g_tab && grow()) { pthread_mutex_unlock(&g_lock); return -3; }
    pthread_mutex_unlock(&g_lock);
    g_vtable = vt;
    g_malloc = (malloc_fn)vt[SLOT_MALLOC];
    g_free = (free_fn)vt[SLOT_FREE];
    g_size = (size_fn)vt[SLOT_SIZE];
    if (set_slots(vt, (void *)wrap_malloc, (void *)wrap_free)) return -2;
    g_installed = 1;
    return 0;
}

/* Restore the original slots and forget every tracked pointer (frees that arrive later go to
   the original free directly).  A call already inside a wrapper finishes normally. */
int uninstall(void) {
    if (!g_installed) return 0;
    if (set_slots(g_vtable, (void *)g_malloc, (void *)g_free)) return -2;
    g_installed = 0;
    pthread_mutex_lock(&g_lock);
    memset(g_tab, 0, g_cap * sizeof(entry));
    g_count = g_nonempty = g_untracked_frees = g_mallocs = g_frees = 0;
    g_bytes = 0;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

int installed(void) { return g_installed; }
const char *expected_type(void) { return EXPECTED_TYPE; }

#define READER(name, expr, type)         \
    type name(void) {                    \
        type v;                          \
        pthread_mutex_lock(&g_lock);     \
        v = (expr);                      \
        pthread_mutex_unlock(&g_lock);   \
        return v;                        \
    }
READER(live_count, g_count, long)          /* tracked live buffers, empty ones included */
READER(live_nonempty_count, g_nonempty, long) /* tracked live buffers with requested size > 0 */
READER(live_bytes, g_bytes, size_t)        /* sum of MLX's accounted size of tracked buffers */
READER(untracked_frees, g_untracked_frees, long) /* frees of pointers allocated before install */
READER(malloc_calls, g_mallocs, long)
READER(free_calls, g_frees, long)
