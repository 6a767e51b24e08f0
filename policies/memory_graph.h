#pragma once
// The multi-granularity memory of a streaming policy as a graph (Boost.Graph): one vertex per bank block,
// "contains" edges from each block to the blocks of the next finer granularity inside it (segment -> frame
// -> patch for MuKV's 784/196/49) and "next" edges between temporally adjacent blocks of one granularity.
// MuKV's ANCESTOR rerank walks the containment edges; the coherence and cluster statistics of every
// retrieval come from it (docs/policies/mukv.md).

#include <boost/graph/adjacency_list.hpp>
#include <cstdint>
#include <span>
#include <vector>

#include "sim/stream_policy.h"

namespace kvsim {

enum class MemoryEdge : uint8_t { kContains = 0, kNext = 1 };

struct MemoryVertex {
  int32_t bank_index = 0;
  int32_t granularity = 0;
  int32_t first_token = 0;
  int32_t end_token = 0;  // exclusive
};

class MemoryGraph {
 public:
  using Graph =
      boost::adjacency_list<boost::vecS, boost::vecS, boost::bidirectionalS, MemoryVertex, MemoryEdge>;
  // Vertices are the bank blocks, in bank order (vertex i = bank block i).
  explicit MemoryGraph(std::span<const BankBlock> bank);

  const Graph& graph() const { return g_; }
  int num_blocks() const { return static_cast<int>(boost::num_vertices(g_)); }
  // The block of the next coarser granularity that contains `block`, or -1.
  int Parent(int block) const;
  // The coarsest block containing `block` (itself if none).
  int Root(int block) const;
  // Blocks directly contained in `block` (next finer granularity), ascending.
  std::vector<int> Children(int block) const;
  // Temporal neighbours of the same granularity (previous, next), -1 if none.
  int Previous(int block) const;
  int Next(int block) const;

  // Statistics of a retrieved set (bank indices):
  //   coherence: share of retrieved non-coarsest blocks whose root is also retrieved (1 if none);
  //   clusters: connected components of the subgraph induced by the retrieved blocks (both edge kinds,
  //   undirected) — 1 means one contiguous, nested region of the video.
  struct SetStats {
    double coherence = 1;
    int clusters = 0;
  };
  SetStats Analyze(std::span<const int32_t> retrieved) const;

 private:
  Graph g_;
};

}  // namespace kvsim
