/*
 * process_count.c -- the live MLX buffers of the whole process, counted at MLX's allocator.
 *
 * Built with the system C compiler by process_count.py at first use and loaded with ctypes.
 *
 * mlx::core::allocator::allocator() returns the process's one allocator object; every buffer
 * MLX makes and frees goes through its vtable (allocator::malloc and Data's destructor call it
 * through an Allocator&). The Itanium C++ ABI vtable the object's first word points at holds
 * (mlx/allocator.h's declaration order):
 *     [-2] offset-to-top  [-1] typeinfo
 *     [0] malloc(size_t) -> Buffer   [1] free(Buffer)   [2] size(Buffer) const   ...
 * Buffer is one trivially-copyable pointer, passed and returned in a register:
 *     malloc: void *(*)(void *self, size_t)    free: void (*)(void *self, void *buf)
 *
 * install() swaps slots 0 and 1 for wrappers that call the originals and move one atomic counter:
 * +1 for each non-empty buffer made, -1 for each freed. No set of live pointers: a buffer made
 * before install() and freed after counts -1, so the count is the growth since install (what the
 * watchdog reads), not an absolute figure. Buffers MLX keeps in its own cache are freed as far as
 * the vtable is concerned: the count is of live buffers.
 *
 * The low-water mark (the lowest count since low_reset()) lets a reading span an interval: the
 * watchdog resets it when a walk starts and reads it once the walk has looked at the caches, so
 * temporaries of a step still computing when the walk began, freed meanwhile, are not in it.
 *
 * The self-check's probe: allocations of exactly probe_size bytes are counted apart (the last one's
 * pointer is remembered, and its free), so the check sees its own allocation go through both
 * wrappers whatever other threads allocate meanwhile.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef void *(*malloc_fn)(void *self, size_t size);
typedef void (*free_fn)(void *self, void *buf);
typedef size_t (*size_fn)(void *self, void *buf);

enum { SLOT_MALLOC = 0, SLOT_FREE = 1, SLOT_SIZE = 2 };

static void **g_vtable;
static malloc_fn g_malloc;
static free_fn g_free;
static size_fn g_size;
static int g_installed;

static long g_live;          /* non-empty buffers made minus those freed, since install */
static long g_low;           /* the lowest g_live since low_reset() */
static size_t g_probe_size;  /* 0: no probe */
static void *g_probe_ptr;
static long g_probe_mallocs, g_probe_frees;

static void *wrap_malloc(void *self, size_t size) {
    void *p = g_malloc(self, size);
    if (p && size) {
        __atomic_add_fetch(&g_live, 1, __ATOMIC_RELAXED);
        if (__builtin_expect(size == __atomic_load_n(&g_probe_size, __ATOMIC_RELAXED), 0)) {
            __atomic_store_n(&g_probe_ptr, p, __ATOMIC_RELAXED);
            __atomic_add_fetch(&g_probe_mallocs, 1, __ATOMIC_RELAXED);
        }
    }
    return p;
}

static void wrap_free(void *self, void *p) {
    /* counted before the original free: once freed, the pointer may be handed out again */
    if (p) {
        if (__builtin_expect(p == __atomic_load_n(&g_probe_ptr, __ATOMIC_RELAXED), 0)) {
            __atomic_store_n(&g_probe_ptr, (void *)0, __ATOMIC_RELAXED);
            __atomic_add_fetch(&g_probe_frees, 1, __ATOMIC_RELAXED);
        }
        if (g_size(self, p)) {
            long now = __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED);
            long low = __atomic_load_n(&g_low, __ATOMIC_RELAXED);
            while (now < low && !__atomic_compare_exchange_n(&g_low, &low, now, 1, __ATOMIC_RELAXED,
                                                              __ATOMIC_RELAXED)) {
            }
        }
    }
    g_free(self, p);
}

static int set_slots(void **vt, void *m, void *f, int installing) {
    long pg = sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)&vt[SLOT_MALLOC] & ~(uintptr_t)(pg - 1);
    uintptr_t hi = ((uintptr_t)&vt[SLOT_FREE] + sizeof(void *) + pg - 1) & ~(uintptr_t)(pg - 1);
    if (mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE)) return -2;
    /* Aligned pointer stores are atomic: a caller sees the old slot or the new one. Installing,
       free goes first (no wrapped malloc meets the original free); uninstalling, malloc first. */
    if (installing) {
        __atomic_store_n(&vt[SLOT_FREE], f, __ATOMIC_SEQ_CST);
        __atomic_store_n(&vt[SLOT_MALLOC], m, __ATOMIC_SEQ_CST);
    } else {
        __atomic_store_n(&vt[SLOT_MALLOC], m, __ATOMIC_SEQ_CST);
        __atomic_store_n(&vt[SLOT_FREE], f, __ATOMIC_SEQ_CST);
    }
    mprotect((void *)lo, hi - lo, PROT_READ); /* back to read-only, as the loader left it */
    return 0;
}

/* The mangled class name of the allocator object `self` (its vtable's typeinfo), or NULL. */
const char *type_name(void *self) {
    void **vt;
    const char *const *ti;
    uintptr_t name;
    if (!self) return (const char *)0;
    vt = *(void ***)self;
    if (!vt) return (const char *)0;
    ti = (const char *const *)vt[-1]; /* std::type_info: {vptr, const char *name} */
    if (!ti) return (const char *)0;
    name = (uintptr_t)ti[1];
#if defined(__APPLE__) && defined(__aarch64__)
    name &= ~((uintptr_t)1 << 63); /* libc++'s non-unique RTTI bit on Apple arm64 */
#endif
    return (const char *)name;
}

/* 0 = installed (or already), -2 = mprotect failed. */
int install(void *self) {
    void **vt;
    if (g_installed) return 0;
    vt = *(void ***)self;
    g_vtable = vt;
    g_malloc = (malloc_fn)vt[SLOT_MALLOC];
    g_free = (free_fn)vt[SLOT_FREE];
    g_size = (size_fn)vt[SLOT_SIZE];
    __atomic_store_n(&g_live, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_low, 0, __ATOMIC_SEQ_CST);
    if (set_slots(vt, (void *)wrap_malloc, (void *)wrap_free, 1)) return -2;
    g_installed = 1;
    return 0;
}

/* Put the original slots back: 0 = done (or not installed), -1 = the slots no longer hold this
   shim's wrappers (another hook went in on top of it: leaving it is the only safe choice),
   -2 = mprotect failed. A call already inside a wrapper finishes normally. */
int uninstall(void) {
    if (!g_installed) return 0;
    if (__atomic_load_n(&g_vtable[SLOT_MALLOC], __ATOMIC_SEQ_CST) != (void *)wrap_malloc ||
        __atomic_load_n(&g_vtable[SLOT_FREE], __ATOMIC_SEQ_CST) != (void *)wrap_free)
        return -1;
    if (set_slots(g_vtable, (void *)g_malloc, (void *)g_free, 0)) return -2;
    g_installed = 0;
    return 0;
}

int installed(void) { return g_installed; }
long live(void) { return __atomic_load_n(&g_live, __ATOMIC_RELAXED); }
/* The low-water mark: a reading over an interval (from low_reset() to low()) rather than at an
   instant, so that temporaries of a computation in flight, freed before the interval ends, are
   not in it. */
void low_reset(void) { __atomic_store_n(&g_low, __atomic_load_n(&g_live, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
long low(void) {
    long now = __atomic_load_n(&g_live, __ATOMIC_RELAXED), low = __atomic_load_n(&g_low, __ATOMIC_RELAXED);
    return low < now ? low : now;
}
void set_probe(size_t size) {
    __atomic_store_n(&g_probe_ptr, (void *)0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_probe_mallocs, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_probe_frees, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_probe_size, size, __ATOMIC_SEQ_CST);
}
long probe_mallocs(void) { return __atomic_load_n(&g_probe_mallocs, __ATOMIC_SEQ_CST); }
long probe_frees(void) { return __atomic_load_n(&g_probe_frees, __ATOMIC_SEQ_CST); }
