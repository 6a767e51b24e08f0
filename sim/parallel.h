#pragma once
// Deterministic fork-join parallelism: work items are independent and write to disjoint outputs, so
// results never depend on the thread count or on scheduling.

#include <functional>

namespace kvsim {

// Runs fn(i) for i in [0, n) on up to `threads` threads (<= 0: hardware concurrency). Items are handed out
// dynamically; fn must only write state owned by item i. Blocks until all items finish.
void ParallelFor(int n, int threads, const std::function<void(int)>& fn);

// ParallelFor that also tells fn which worker runs the item: fn(i, w) with w in [0, min(threads, n)),
// stable for the duration of the call, so callers can keep per-worker scratch buffers across calls.
void ParallelForWorkers(int n, int threads, const std::function<void(int item, int worker)>& fn);

// Hardware concurrency (>= 1).
int DefaultThreads();

}  // namespace kvsim
