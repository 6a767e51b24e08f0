#include "policies/memory_graph.h"

#include <algorithm>
#include <boost/graph/connected_components.hpp>
#include <boost/graph/filtered_graph.hpp>
#include <boost/graph/undirected_graph.hpp>
#include <map>

namespace kvsim {

MemoryGraph::MemoryGraph(std::span<const BankBlock> bank) : g_(bank.size()) {
  // Blocks by granularity, in temporal order.
  std::map<int, std::vector<int>> by_g;
  for (size_t i = 0; i < bank.size(); ++i) {
    const BankBlock& b = bank[i];
    g_[i] =
        MemoryVertex{static_cast<int32_t>(i), b.granularity, b.first_token, b.first_token + b.granularity};
    by_g[b.granularity].push_back(static_cast<int>(i));
  }
  for (auto& [gran, blocks] : by_g) {
    std::stable_sort(blocks.begin(), blocks.end(),
                     [&](int a, int b) { return g_[a].first_token < g_[b].first_token; });
    for (size_t i = 1; i < blocks.size(); ++i)
      if (g_[blocks[i - 1]].end_token <= g_[blocks[i]].first_token)
        boost::add_edge(blocks[i - 1], blocks[i], MemoryEdge::kNext, g_);
  }
  // Containment: each block's parent is the block of the next coarser granularity covering its range.
  for (auto it = by_g.begin(); it != by_g.end(); ++it) {
    auto coarser = std::next(it);
    if (coarser == by_g.end()) break;
    const std::vector<int>& parents = coarser->second;  // sorted by first_token
    for (int child : it->second) {
      const MemoryVertex& c = g_[child];
      auto p = std::upper_bound(parents.begin(), parents.end(), c.first_token,
                                [&](int32_t tok, int v) { return tok < g_[v].first_token; });
      if (p == parents.begin()) continue;
      const int parent = *std::prev(p);
      if (g_[parent].first_token <= c.first_token && c.end_token <= g_[parent].end_token)
        boost::add_edge(parent, child, MemoryEdge::kContains, g_);
    }
  }
}

int MemoryGraph::Parent(int block) const {
  for (auto [e, end] = boost::in_edges(block, g_); e != end; ++e)
    if (g_[*e] == MemoryEdge::kContains) return static_cast<int>(boost::source(*e, g_));
  return -1;
}

int MemoryGraph::Root(int block) const {
  int b = block;
  for (int p = Parent(b); p >= 0; p = Parent(b)) b = p;
  return b;
}

std::vector<int> MemoryGraph::Children(int block) const {
  std::vector<int> out;
  for (auto [e, end] = boost::out_edges(block, g_); e != end; ++e)
    if (g_[*e] == MemoryEdge::kContains) out.push_back(static_cast<int>(boost::target(*e, g_)));
  std::sort(out.begin(), out.end());
  return out;
}

int MemoryGraph::Previous(int block) const {
  for (auto [e, end] = boost::in_edges(block, g_); e != end; ++e)
    if (g_[*e] == MemoryEdge::kNext) return static_cast<int>(boost::source(*e, g_));
  return -1;
}

int MemoryGraph::Next(int block) const {
  for (auto [e, end] = boost::out_edges(block, g_); e != end; ++e)
    if (g_[*e] == MemoryEdge::kNext) return static_cast<int>(boost::target(*e, g_));
  return -1;
}

MemoryGraph::SetStats MemoryGraph::Analyze(std::span<const int32_t> retrieved) const {
  SetStats st;
  if (retrieved.empty()) return st;
  std::vector<uint8_t> in(num_blocks(), 0);
  for (int32_t b : retrieved) in[b] = 1;
  int fine = 0, coherent = 0;
  for (int32_t b : retrieved) {
    const int root = Root(b);
    if (root == b) continue;
    ++fine;
    coherent += in[root];
  }
  st.coherence = fine > 0 ? static_cast<double>(coherent) / fine : 1.0;
  // Undirected copy of the induced subgraph, then connected components.
  using U = boost::adjacency_list<boost::vecS, boost::vecS, boost::undirectedS>;
  std::vector<int> local(num_blocks(), -1);
  int n = 0;
  for (int32_t b : retrieved)
    if (local[b] < 0) local[b] = n++;
  U u(n);
  for (auto [e, end] = boost::edges(g_); e != end; ++e) {
    const int s = static_cast<int>(boost::source(*e, g_)), t = static_cast<int>(boost::target(*e, g_));
    if (in[s] && in[t]) boost::add_edge(local[s], local[t], u);
  }
  std::vector<int> comp(n);
  st.clusters = n > 0 ? boost::connected_components(u, comp.data()) : 0;
  return st;
}

}  // namespace kvsim
