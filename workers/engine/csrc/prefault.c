/* Faulting in the CPU KV pool ahead of use.

   The pool is fresh anonymous memory: the OS fills a page in on its first write. On a VM
   that first write costs 1-2 us per 4 KiB page (the host backs the page too), and it lands
   inside the step that first stores k/v there: about 5% of a fresh server's first busy
   minute here. This walks the pool once in the background instead, at the lowest CPU
   priority so that it only takes time no step wants. */
#define _GNU_SOURCE
#include <stdint.h>

#ifdef __linux__
#include <errno.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#endif

/* Populates `n` regions of `bytes` each, `chunk` bytes of every region at a time in rising
   offset (the order the block manager first hands out blocks, every layer's k and v being one
   region each), until done or *stop is set. Returns the bytes done per region, or -1 where
   the kernel cannot populate (Linux before 5.14, other systems). Runs on the calling thread,
   after lowering its priority: call it on a thread of its own. */
int64_t tm_prefault(char *const *regions, int64_t n, int64_t bytes, int64_t chunk, const volatile int32_t *stop) {
#ifndef __linux__
    (void)regions, (void)n, (void)bytes, (void)chunk, (void)stop;
    return -1;
#else
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int64_t off = 0; off < bytes; off += chunk) {
        const int64_t len = bytes - off < chunk ? bytes - off : chunk;
        for (int64_t i = 0; i < n; i++) {
            if (*stop) return off;
            /* madvise wants a page-aligned start; the page below is the pool's too. */
            const uintptr_t lo = (uintptr_t)(regions[i] + off) & ~(page - 1);
            const uintptr_t hi = (uintptr_t)(regions[i] + off + len);
            if (madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) return -1;
        }
    }
    return bytes;
#endif
}
