#include "sim/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kvsim {

int DefaultThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

namespace {

// Runs items on `threads` threads; an exception thrown by an item (std::bad_alloc, say) stops the handing
// out of further items and is rethrown in the caller once every thread has joined -- the one of the lowest
// item index, so which exception surfaces does not depend on scheduling among the items that ran.
void Run(int n, int threads, const std::function<void(int, int)>& fn) {
  if (threads <= 0) threads = DefaultThreads();
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int> next{0};
  std::mutex mu;
  std::exception_ptr error;
  int error_item = n;
  auto worker = [&](int w) {
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        fn(i, w);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (i < error_item) {
          error_item = i;
          error = std::current_exception();
        }
        next.store(n);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

void ParallelFor(int n, int threads, const std::function<void(int)>& fn) {
  Run(n, threads, [&fn](int i, int) { fn(i); });
}

void ParallelForWorkers(int n, int threads, const std::function<void(int, int)>& fn) { Run(n, threads, fn); }

}  // namespace kvsim
