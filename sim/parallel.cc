#include "sim/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace kvsim {

int DefaultThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

void ParallelFor(int n, int threads, const std::function<void(int)>& fn) {
  if (threads <= 0) threads = DefaultThreads();
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

void ParallelForWorkers(int n, int threads, const std::function<void(int, int)>& fn) {
  if (threads <= 0) threads = DefaultThreads();
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int> next{0};
  auto worker = [&](int w) {
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, w);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
}

}  // namespace kvsim
