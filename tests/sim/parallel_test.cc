#include "sim/parallel.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <new>
#include <set>
#include <stdexcept>
#include <vector>

namespace kvsim {

TEST_CASE("ParallelFor runs every item once", "[parallel]") {
  for (int threads : {1, 2, 5}) {
    std::vector<int> hits(37, 0);
    ParallelFor(37, threads, [&](int i) { hits[i] += 1; });
    for (int h : hits) CHECK(h == 1);
  }
}

TEST_CASE("ParallelForWorkers: every item once, worker ids in range and owned by one thread", "[parallel]") {
  for (int threads : {1, 3}) {
    std::vector<int> hits(50, 0), worker(50, -1);
    ParallelForWorkers(50, threads, [&](int i, int w) {
      hits[i] += 1;
      worker[i] = w;
    });
    std::set<int> used;
    for (int i = 0; i < 50; ++i) {
      CHECK(hits[i] == 1);
      CHECK(worker[i] >= 0);
      CHECK(worker[i] < threads);
      used.insert(worker[i]);
    }
    if (threads == 1) CHECK(used == std::set<int>{0});
  }
  // Fewer items than threads: worker ids stay below the item count.
  std::vector<int> w(2, -1);
  ParallelForWorkers(2, 8, [&](int i, int wk) { w[i] = wk; });
  CHECK(w[0] < 2);
  CHECK(w[1] < 2);
}

}  // namespace kvsim

namespace kvsim {

TEST_CASE("ParallelFor: an item's exception reaches the caller after every thread joined", "[parallel]") {
  for (int threads : {1, 2, 4}) {
    std::atomic<int> ran{0};
    try {
      ParallelFor(100, threads, [&](int i) {
        ++ran;
        if (i == 7 || i == 50) throw std::runtime_error("item " + std::to_string(i));
      });
      FAIL("no exception");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "item 7");  // the lowest failing item among those that ran
    }
    CHECK(ran.load() >= 8);
    CHECK(ran.load() <= 100);
  }
  CHECK_THROWS_AS(ParallelForWorkers(10, 2, [](int, int) { throw std::bad_alloc(); }), std::bad_alloc);
}

TEST_CASE("SharedBuild: setup once, every piece once, and each caller returns only once all are built",
          "[parallel]") {
  for (int parts : {0, 1, 7, 64}) {
    for (int round = 0; round < 20; ++round) {
      SharedBuild build;
      std::atomic<int> setups{0};
      std::vector<int> out;
      std::vector<std::atomic<int>> runs(static_cast<size_t>(parts));
      std::atomic<int> incomplete{0}, helpers{0};
      // Five callers at once, as a unit's runs on several workers; each checks the whole output on return.
      ParallelFor(5, 5, [&](int) {
        bool helped = false;
        build.Run(
            parts,
            [&] {
              setups.fetch_add(1);
              out.assign(static_cast<size_t>(parts), -1);
            },
            [&](int i) {
              helped = true;
              runs[static_cast<size_t>(i)].fetch_add(1);
              volatile int spin = 0;  // a piece that takes a while, so callers overlap
              for (int k = 0; k < 2000; ++k) spin = spin + k;
              out[static_cast<size_t>(i)] = i * 3;
            });
        for (int i = 0; i < parts; ++i)
          if (out[static_cast<size_t>(i)] != i * 3) incomplete.fetch_add(1);
        if (helped) helpers.fetch_add(1);
      });
      CHECK(setups.load() == 1);
      for (auto& r : runs) CHECK(r.load() == 1);
      CHECK(incomplete.load() == 0);
      CHECK(helpers.load() <= std::max(1, parts));
      // Built: later callers return at once, without running setup or a piece.
      build.Run(
          parts, [&] { setups.fetch_add(1); }, [&](int) { incomplete.fetch_add(1); });
      CHECK(setups.load() == 1);
      CHECK(incomplete.load() == 0);
    }
  }
}

}  // namespace kvsim
