// The multi-granularity memory graph (policies/memory_graph.h) on a hand-made bank: granularities 2, 4 and
// 8 over 8 video tokens (4 + 2 + 1 blocks), containment and temporal edges, and the coherence / cluster
// statistics of retrieved sets checked by hand.

#include "policies/memory_graph.h"

#include <catch2/catch.hpp>
#include <vector>

namespace kvsim {

namespace {

BankBlock Block(int g, int index, int32_t first, int32_t ready) {
  BankBlock b;
  b.source = BlockSource::kEncoded;
  b.granularity = g;
  b.index = index;
  b.first_token = first;
  b.ready_frame = ready;
  return b;
}

// init_len 4, 2 tokens per frame, video tokens 4..11. Bank order as MuKV builds it (ready frame, then fine
// to coarse):
//   0: g2 [4,6)  frame 0      3: g2 [8,10)  frame 2      6: g8 [4,12) frame 3
//   1: g2 [6,8)  frame 1      4: g2 [10,12) frame 3
//   2: g4 [4,8)  frame 1      5: g4 [8,12)  frame 3
// Containment: 0,1 ⊂ 2; 3,4 ⊂ 5; 2,5 ⊂ 6. Next: 0→1→3→4 (g2), 2→5 (g4).
std::vector<BankBlock> Bank248() {
  return {Block(2, 0, 4, 0), Block(2, 1, 6, 1), Block(4, 0, 4, 1), Block(2, 2, 8, 2),
          Block(2, 3, 10, 3), Block(4, 1, 8, 3), Block(8, 0, 4, 3)};
}

MemoryGraph::SetStats Analyze(const MemoryGraph& g, std::vector<int32_t> set) { return g.Analyze(set); }

}  // namespace

TEST_CASE("memory_graph: structure of a 2/4/8 bank is a Boost.Graph", "[memory_graph]") {
  const auto bank = Bank248();
  const MemoryGraph mg(bank);
  CHECK(mg.num_blocks() == 7);
  CHECK(boost::num_vertices(mg.graph()) == 7);
  // 4 containment edges g2 -> g4, 2 containment edges g4 -> g8, 3 next edges among g2, 1 among g4.
  CHECK(boost::num_edges(mg.graph()) == 10);
  int contains = 0, next = 0;
  for (auto [e, end] = boost::edges(mg.graph()); e != end; ++e)
    (mg.graph()[*e] == MemoryEdge::kContains ? contains : next) += 1;
  CHECK(contains == 6);
  CHECK(next == 4);
  // Vertex properties mirror the bank.
  CHECK(mg.graph()[5].granularity == 4);
  CHECK(mg.graph()[5].first_token == 8);
  CHECK(mg.graph()[5].end_token == 12);
  CHECK(mg.graph()[6].bank_index == 6);
}

TEST_CASE("memory_graph: Parent, Root, Children, Previous, Next", "[memory_graph]") {
  const auto bank = Bank248();
  const MemoryGraph mg(bank);
  CHECK(mg.Parent(0) == 2);
  CHECK(mg.Parent(1) == 2);
  CHECK(mg.Parent(3) == 5);
  CHECK(mg.Parent(4) == 5);
  CHECK(mg.Parent(2) == 6);
  CHECK(mg.Parent(5) == 6);
  CHECK(mg.Parent(6) == -1);
  for (int b = 0; b < 7; ++b) CHECK(mg.Root(b) == 6);
  CHECK(mg.Children(6) == std::vector<int>{2, 5});  // only the next finer granularity, not the g2 blocks
  CHECK(mg.Children(2) == std::vector<int>{0, 1});
  CHECK(mg.Children(5) == std::vector<int>{3, 4});
  CHECK(mg.Children(0).empty());
  CHECK(mg.Previous(0) == -1);
  CHECK(mg.Next(0) == 1);
  CHECK(mg.Next(1) == 3);  // temporal order, not bank order (bank 2 is the g4 block between them)
  CHECK(mg.Previous(3) == 1);
  CHECK(mg.Next(4) == -1);
  CHECK(mg.Next(2) == 5);
  CHECK(mg.Previous(5) == 2);
  CHECK(mg.Previous(6) == -1);
  CHECK(mg.Next(6) == -1);
}

TEST_CASE("memory_graph: Analyze coherence and clusters", "[memory_graph]") {
  const auto bank = Bank248();
  const MemoryGraph mg(bank);
  SECTION("{0, 1, 2}: nested and contiguous, but the root (6) is not retrieved") {
    // Non-coarsest: 0, 1, 2 (root 6 each), none coherent -> 0. Edges 0-1 (next), 2-0, 2-1 -> 1 cluster.
    const auto st = Analyze(mg, {0, 1, 2});
    CHECK(st.coherence == 0);
    CHECK(st.clusters == 1);
  }
  SECTION("{0, 4, 6}: coherent but scattered") {
    // 0 and 4 have root 6, retrieved -> 1. No edge among 0, 4, 6 (6 contains only 2 and 5) -> 3 clusters.
    const auto st = Analyze(mg, {0, 4, 6});
    CHECK(st.coherence == 1);
    CHECK(st.clusters == 3);
  }
  SECTION("{1, 3, 5, 6}: one nested region") {
    // 1-3 next, 5-3 contains, 6-5 contains -> 1 cluster; 1, 3, 5 all have root 6 -> 1.
    const auto st = Analyze(mg, {1, 3, 5, 6});
    CHECK(st.coherence == 1);
    CHECK(st.clusters == 1);
  }
  SECTION("{0, 2, 4, 6}: 4 is cut off (its parent 5 and neighbour 3 are missing)") {
    const auto st = Analyze(mg, {0, 2, 4, 6});
    CHECK(st.coherence == 1);
    CHECK(st.clusters == 2);
  }
  SECTION("{0, 3}: two non-adjacent fine blocks") {
    const auto st = Analyze(mg, {0, 3});
    CHECK(st.coherence == 0);
    CHECK(st.clusters == 2);
  }
  SECTION("only the coarsest block, and the empty set") {
    const auto st = Analyze(mg, {6});
    CHECK(st.coherence == 1);  // no non-coarsest block
    CHECK(st.clusters == 1);
    const auto empty = Analyze(mg, {});
    CHECK(empty.coherence == 1);
    CHECK(empty.clusters == 0);
  }
}

TEST_CASE("memory_graph: partial coherence with two roots (granularities 2 and 4 only)", "[memory_graph]") {
  // 0: g2 [4,6), 1: g2 [6,8), 2: g4 [4,8), 3: g2 [8,10), 4: g2 [10,12), 5: g4 [8,12). Roots: 2 and 5.
  std::vector<BankBlock> bank{Block(2, 0, 4, 0), Block(2, 1, 6, 1), Block(4, 0, 4, 1),
                              Block(2, 2, 8, 2), Block(2, 3, 10, 3), Block(4, 1, 8, 3)};
  const MemoryGraph mg(bank);
  CHECK(boost::num_edges(mg.graph()) == 8);  // 4 contains + 3 next (g2) + 1 next (g4)
  CHECK(mg.Root(0) == 2);
  CHECK(mg.Root(4) == 5);
  CHECK(mg.Root(5) == 5);
  // {0, 1, 3, 2}: non-coarsest 0, 1 (root 2, retrieved) and 3 (root 5, not retrieved) -> 2/3.
  // Edges 0-1, 1-3 (next), 2-0, 2-1 (contains) -> 1 cluster.
  const auto st = mg.Analyze(std::vector<int32_t>{0, 1, 3, 2});
  CHECK(st.coherence == Approx(2.0 / 3.0));
  CHECK(st.clusters == 1);
  // {0, 4, 5}: 0 (root 2 missing), 4 (root 5 present) -> 1/2; 4-5 contains, 0 alone -> 2 clusters.
  const auto st2 = mg.Analyze(std::vector<int32_t>{0, 4, 5});
  CHECK(st2.coherence == Approx(0.5));
  CHECK(st2.clusters == 2);
}

}  // namespace kvsim
