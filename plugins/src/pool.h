// pool.h: a small persistent thread pool for libpnmix_core (workers are created once and reused,
// so a decode step spawns no thread and allocates nothing).
#ifndef PNMIX_SRC_POOL_H
#define PNMIX_SRC_POOL_H

#include <stdint.h>

namespace pnmix {

// Run fn(ctx, item) for item in [0, n_items) on up to `threads` threads (the caller is one of
// them). Calls from different caller threads are serialized.
void parallel_for(int threads, int64_t n_items, void (*fn)(void* ctx, int64_t item), void* ctx);

// Threads to use for a request: <= 0 means every core the calling thread may run on (its affinity
// mask); capped at 256.
int resolve_threads(int requested);

}  // namespace pnmix

#endif  // PNMIX_SRC_POOL_H
