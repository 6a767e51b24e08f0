#pragma once
// Deterministic fork-join parallelism: work items are independent and write to disjoint outputs, so
// results never depend on the thread count or on scheduling.

#include <atomic>
#include <functional>
#include <mutex>

namespace kvsim {

// Runs fn(i) for i in [0, n) on up to `threads` threads (<= 0: hardware concurrency). Items are handed out
// dynamically; fn must only write state owned by item i. Blocks until all items finish.
void ParallelFor(int n, int threads, const std::function<void(int)>& fn);

// ParallelFor that also tells fn which worker runs the item: fn(i, w) with w in [0, min(threads, n)),
// stable for the duration of the call, so callers can keep per-worker scratch buffers across calls.
void ParallelForWorkers(int n, int threads, const std::function<void(int item, int worker)>& fn);

// Work shared by the threads that need its result, built once in `parts` pieces that write disjoint
// outputs: the first caller runs `setup` (say, sizing the output), then every caller that arrives before
// the pieces are all done claims the next unclaimed piece until none is left, and waits only for the pieces
// others are still building. A caller that finds the work under way helps instead of waiting for all of
// it (what a std::call_once around the whole work would do). The result does not depend on which caller
// built which piece. A piece that throws: the exception reaches its caller; the work is then never done,
// and the other callers would wait for ever, so pieces must not throw (setup may: it is retried, as with
// std::call_once).
class SharedBuild {
 public:
  template <typename Setup, typename Piece>
  void Run(int parts, Setup&& setup, Piece&& piece) {
    std::call_once(setup_, setup);
    if (done_.load(std::memory_order_acquire) >= parts) return;  // built (and published) already
    for (int i = next_.fetch_add(1, std::memory_order_relaxed); i < parts;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      piece(i);
      // Every piece's fetch_add is a release on done_; they form one release sequence, so the acquire load
      // that sees `parts` sees every piece's writes.
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == parts) done_.notify_all();
    }
    for (int d = done_.load(std::memory_order_acquire); d < parts; d = done_.load(std::memory_order_acquire))
      done_.wait(d, std::memory_order_acquire);
  }

 private:
  std::once_flag setup_;
  std::atomic<int> next_{0}, done_{0};
};

// Hardware concurrency (>= 1).
int DefaultThreads();

}  // namespace kvsim
