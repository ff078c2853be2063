/*
 * alloc_cost.c -- time MLX's allocator as libmlx calls it: through the allocator object's vtable
 * (slot 0 malloc, slot 1 free), whatever hook sits in the slots now. Built and loaded by
 * benchmarks/process_count_cost.py.
 */
#include <stddef.h>
#include <time.h>

typedef void *(*malloc_fn)(void *self, size_t size);
typedef void (*free_fn)(void *self, void *buf);

/* This thread's CPU time: on a shared machine, the time it was scheduled out is not counted. */
static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* `rounds` times: `batch` buffers of `size` bytes made, then all freed. CPU nanoseconds per
   buffer (one malloc and one free). The slots are read at every call, as a virtual call does. */
double alloc_free_ns(void *self, size_t size, int batch, long rounds) {
    void *volatile *vt = *(void *volatile **)self;
    void *held[1024];
    double start;
    long r;
    int i;
    if (batch > 1024) batch = 1024;
    start = now_ns();
    for (r = 0; r < rounds; r++) {
        for (i = 0; i < batch; i++) held[i] = ((malloc_fn)vt[0])(self, size);
        for (i = 0; i < batch; i++) ((free_fn)vt[1])(self, held[i]);
    }
    return (now_ns() - start) / ((double)rounds * batch);
}
