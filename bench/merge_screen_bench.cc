// Micro-benchmark of NearestByCosine (policies/merge.cc) with and without the bf16 screen (issue 14,
// round 7): for each shape e x k (evicted queries x kept targets, d = 128, one thread), the CPU time of
// the exact search (screen off; round 10: the fmaf-chain kernel, sgemm before), of the screened path, of the
// bare bf16 kernel (merge_screen::ApproxDots) and of one cblas_sgemm of the whole e x k (for reference); the
// mean number of exact re-checks per query; and whether both paths gave the same slots and values bit for
// bit. Keys are synthetic (measured: times; modelled: the keys): Gaussian, optionally plus a shared direction
// (--mean, as real keys have) so that cosines are not centred on 0. Then (round 8) one unit's merge-once
// compressions at nested budgets 5/10/20/50% of --tokens keys (half random "important" tokens, half a recent
// window, as the policies keep), without and with the similarity memo (merge_memo): CPU time, screened
// products and whether the merged slots are the same bits. On AVX2 CPUs also (round 16; round 26: with
// AVX512-BF16 too) the int16 kernel alone with and without its int8 first stage, and its int8 products
// alone; where the CPU has AVX-512 VNNI (round 26) the same with the AVX2 int8 kernel beside it. Usage:
// kvsim_merge_screen_bench [--shapes 3078x162,2600x640,1640x1600] [--reps 5] [--mean 0.0]
//        [--tokens 3280] [--keys FILE] [--ghz 2.445]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "policies/merge.h"
#include "policies/merge_screen.h"
#include "policies/merge_screen_int16.h"
#include "sim/attention.h"
#include "sim/blas.h"
#include "sim/policy.h"

namespace {

double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

template <typename F>
double Best(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = CpuSeconds();
    f();
    best = std::min(best, CpuSeconds() - t0);
  }
  return best;
}

// One unit's merge-once compressions at nested budgets, without and with the memo (see the header).
void NestedBudgets(int n, int reps, double mean) {
  using namespace kvsim;
  constexpr int d = 128;
  if (n < 40) return;
  std::mt19937 rng(11);
  std::normal_distribution<float> g;
  std::vector<float> dir(d), keys(static_cast<size_t>(n) * d);
  for (float& x : dir) x = g(rng);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = g(rng) + static_cast<float>(mean) * dir[i % d];
  TraceMeta meta;
  meta.model.head_dim = d;
  meta.prefill_length = n;
  meta.tokens.Resize(n);
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.compress_end = n;
  ctx.keys = keys.data();
  ctx.values = keys.data();
  std::vector<int32_t> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<int32_t>> kept, evicted;
  for (double f : {0.05, 0.10, 0.20, 0.50}) {
    const int k = static_cast<int>(f * n);
    std::vector<int32_t> s(order.begin(), order.begin() + k / 2);
    for (int j = n - (k - k / 2); j < n; ++j) s.push_back(j);
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    std::vector<char> in(n, 0);
    for (int32_t j : s) in[j] = 1;
    std::vector<int32_t> e;
    for (int32_t j = 0; j < n; ++j)
      if (!in[j]) e.push_back(j);
    kept.push_back(std::move(s));
    evicted.push_back(std::move(e));
  }
  std::vector<HeadCache> out_off, out_on;
  auto sweep = [&](bool memo, std::vector<HeadCache>* out) {
    UnitShared shared;  // a fresh unit per repetition
    HeadContext c = ctx;
    c.shared = memo ? &shared : nullptr;
    out->assign(kept.size(), HeadCache(d));
    for (size_t b = 0; b < kept.size(); ++b) {
      Merger m(policy::WEIGHTED, policy::MERGE_ALL);
      m.KeepAndMergeOnce(c, kept[b], evicted[b], &(*out)[b]);
    }
  };
  merge_memo::SetEnabledForTesting(true);
  const merge_screen::Stats before = merge_screen::ThreadStats();
  const double off_s = Best(reps, [&] { sweep(false, &out_off); });
  const double on_s = Best(reps, [&] { sweep(true, &out_on); });
  const merge_screen::Stats& st = merge_screen::ThreadStats();
  const long calls = st.memo_calls - before.memo_calls;
  const double ratio = st.memo_products_without > before.memo_products_without
                           ? double(st.memo_products - before.memo_products) /
                                 double(st.memo_products_without - before.memo_products_without)
                           : 1.0;
  bool same = true;
  for (size_t b = 0; b < kept.size(); ++b) {
    const HeadCache &x = out_off[b], &y = out_on[b];
    same &= x.size() == y.size();
    for (int s = 0; same && s < x.size(); ++s) {
      same &= x.is_merged(s) == y.is_merged(s);
      if (same && x.is_merged(s))
        same &= x.merged(s).members == y.merged(s).members &&
                std::memcmp(x.merged(s).key.data(), y.merged(s).key.data(), d * sizeof(float)) == 0;
    }
  }
  std::printf("\nnested budgets 5/10/20/50%% of %d keys (merge-once, one unit), CPU s (best of %d):\n", n,
              reps);
  std::printf("%12s %12s %7s %22s %6s %9s\n", "memo off", "memo on", "ratio", "screened products", "calls",
              "identical");
  std::printf("%12.4f %12.4f %6.2fx %21.2fx %6ld %9s\n", off_s, on_s, off_s / on_s, ratio, calls,
              same ? "yes" : "NO");
}

// The --shapes list "ExK,ExK,...": each entry's text and its e (queries) and k (targets).
std::vector<std::tuple<std::string, int, int>> ParseShapes(const std::string& shapes) {
  std::vector<std::tuple<std::string, int, int>> out;
  size_t pos = 0;
  while (pos < shapes.size()) {
    const size_t comma = std::min(shapes.find(',', pos), shapes.size());
    const std::string shape = shapes.substr(pos, comma - pos);
    pos = comma + 1;
    out.emplace_back(shape, std::atoi(shape.c_str()), std::atoi(shape.c_str() + shape.find('x') + 1));
  }
  return out;
}

// The int16 screen's times for queries q (e x d) against targets t (k x d), rows normalised here: the int16
// kernel and candidate scan alone (int16::Candidates without the int8 stage), with the int8 first stage
// (round 16), and the int8 products alone (int8::Dots over all e rows). Round 21: also products per second
// and int8 multiply-adds per cycle at --ghz (modelled: the clock is taken as given, not measured).
double g_ghz = 2.445;
double Int16Screen(const std::string& label, const std::vector<float>& q, int e, const std::vector<float>& t,
                   int k, int reps, int d) {
  namespace i16 = kvsim::merge_screen::int16;
  namespace i8 = kvsim::merge_screen::int8;
  std::vector<float> qn(q), tn(t);
  for (std::vector<float>* m : {&qn, &tn})
    for (size_t r = 0; r < m->size() / d; ++r) {
      double s2 = 0;
      for (int k2 = 0; k2 < d; ++k2) s2 += static_cast<double>((*m)[r * d + k2]) * (*m)[r * d + k2];
      const float f = static_cast<float>(1.0 / std::sqrt(s2));
      for (int k2 = 0; k2 < d; ++k2) (*m)[r * d + k2] *= f;
    }
  std::vector<int16_t> qp(static_cast<size_t>(e) * d), tp(i16::PackedTargetsSize(k, d));
  std::vector<double> rq(e);
  i16::PackQueries(qn.data(), e, d, qp.data(), rq.data());
  const double rt = i16::PackTargets(tn.data(), k, d, tp.data());
  std::vector<int64_t> slack(e);
  for (int r = 0; r < e; ++r) slack[r] = i16::Slack(d, rq[r], rt);
  std::vector<int> rows, idx;
  i16::SetInt8ForTesting(false);
  const double s16 = Best(reps, [&] {
    rows.clear(), idx.clear();
    i16::Candidates(qp.data(), e, tp.data(), k, d, slack.data(), &rows, &idx);
  });
  i16::SetInt8ForTesting(true);
  if (!i8::Applies(d)) return s16;
  // The same with the int8 first stage (the same candidates, checked).
  std::vector<int8_t> t8(i8::PackedTargetsSize(k, d));
  i16::Narrowed nw;
  nw.norms = i8::NarrowTargets(tp.data(), k, d, t8.data());
  nw.words = t8.data();
  std::vector<int> rows8, idx8;
  const double s8 = Best(reps, [&] {
    rows8.clear(), idx8.clear();
    i16::Candidates(qp.data(), e, tp.data(), k, d, slack.data(), &rows8, &idx8, nullptr, &nw);
  });
  std::vector<uint8_t> q8(static_cast<size_t>(e) * d);
  std::vector<double> qn2(e), qe2(e);
  std::vector<int32_t> qsc(e);
  const long ld8 = i16::PaddedTargets(k);
  std::vector<int32_t> p8(static_cast<size_t>(e) * ld8);
  i8::NarrowQueries(qp.data(), e, d, nw.norms, q8.data(), qsc.data(), qn2.data(), qe2.data());
  const double d8 = Best(reps, [&] { i8::Dots(q8.data(), e, t8.data(), k, d, p8.data(), ld8); });
  const double products = static_cast<double>(e) * k;
  std::printf(
      "%-11s int16 only %.5f s; int8 stage %.5f s (%.2fx, %.2f G products/s, %.1f MAC/cycle*); int8::Dots "
      "alone %.5f s (%.2f G products/s, %.1f MAC/cycle*); candidates/q %.2f; same candidates: %s\n",
      label.c_str(), s16, s8, s8 / s16, products / s8 * 1e-9, products * d / s8 / (g_ghz * 1e9), d8,
      products / d8 * 1e-9, products * d / d8 / (g_ghz * 1e9), static_cast<double>(rows8.size()) / e,
      rows8 == rows && idx8 == idx ? "yes" : "NO");
  if (i8::ChosenKernel() == i8::Kernel::kVnni) {
    // Round 26: the AVX2 kernel beside the VNNI one, the same products checked where they are defined
    // (usable targets, rows with a scale; the others may differ: int8::Dots).
    std::vector<int32_t> pa(p8.size());
    i8::SetKernelForTesting(i8::Kernel::kAvx2);
    const double a8 = Best(reps, [&] { i8::Dots(q8.data(), e, t8.data(), k, d, pa.data(), ld8); });
    const uint8_t* unusable = i8::Unusable(t8.data(), k, d);
    bool same = true;
    for (int r = 0; r < e; ++r)
      for (int j = 0; j < k && qsc[r] > 0; ++j)
        same = same && ((unusable[j / 8] >> (j % 8) & 1) != 0 || pa[r * ld8 + j] == p8[r * ld8 + j]);
    const double sa = Best(reps, [&] {
      rows8.clear(), idx8.clear();
      i16::Candidates(qp.data(), e, tp.data(), k, d, slack.data(), &rows8, &idx8, nullptr, &nw);
    });
    i8::SetKernelForTesting(i8::Kernel::kVnni);
    std::printf(
        "%-11s   the same with the AVX2 int8 kernel: int8 stage %.5f s (VNNI %.2fx of it); int8::Dots "
        "alone %.5f s (VNNI %.2fx of it); same products: %s\n",
        "", sa, s8 / sa, a8, d8 / a8, same ? "yes" : "NO");
  }
  return s16;
}

// Round 21: the int16 screen on real keys (--keys FILE: raw float32, heads x --tokens x 128, e.g. a few
// heads of demo.h5 dumped with h5py): for each shape e x k and each head, k targets drawn at random (kept
// tokens, in token order) and e other tokens as queries.
void RealKeys(const std::string& file, const std::string& shapes, int tokens, int reps) {
  constexpr int d = 128;
  FILE* f = std::fopen(file.c_str(), "rb");
  if (f == nullptr) {
    std::fprintf(stderr, "kvsim: error: cannot open %s\n", file.c_str());
    std::exit(2);
  }
  std::vector<float> all;
  std::vector<float> buf(static_cast<size_t>(tokens) * d);
  while (std::fread(buf.data(), sizeof(float), buf.size(), f) == buf.size())
    all.insert(all.end(), buf.begin(), buf.end());
  std::fclose(f);
  const int heads = static_cast<int>(all.size() / buf.size());
  if (heads == 0) {
    std::fprintf(stderr,
                 "kvsim: error: --keys %s holds less than one head of --tokens %d x %d float32 values; dump "
                 "whole heads (heads x tokens x %d, raw little-endian float32) or set --tokens\n",
                 file.c_str(), tokens, d, d);
    std::exit(2);
  }
  std::printf("real keys: %d heads x %d tokens from %s\n", heads, tokens, file.c_str());
  for (const auto& [shape, e, k] : ParseShapes(shapes)) {
    if (e + k > tokens) continue;
    for (int h = 0; h < heads; ++h) {
      std::mt19937 rng(h);
      std::vector<int> order(tokens);
      for (int i = 0; i < tokens; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      std::sort(order.begin(), order.begin() + k);
      std::vector<float> q(static_cast<size_t>(e) * d), t(static_cast<size_t>(k) * d);
      const float* head = all.data() + static_cast<size_t>(h) * tokens * d;
      for (int j = 0; j < k; ++j) std::copy_n(head + static_cast<size_t>(order[j]) * d, d, t.data() + j * d);
      for (int r = 0; r < e; ++r)
        std::copy_n(head + static_cast<size_t>(order[k + r]) * d, d, q.data() + r * d);
      Int16Screen(shape + " h" + std::to_string(h), q, e, t, k, reps, d);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  kvsim::RestartForBlasKernels(argv);  // its sgemm reference on the kernels kvsim runs (sim/blas.h)
  std::string shapes = "3078x162,2600x640,1640x1600";
  int reps = 5;
  double mean = 0.0;
  int tokens = 3280;
  std::string keys;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--shapes"))
      shapes = argv[i + 1];
    else if (!std::strcmp(argv[i], "--reps"))
      reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--mean"))
      mean = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tokens"))
      tokens = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--keys"))
      keys = argv[i + 1];
    else if (!std::strcmp(argv[i], "--ghz"))
      g_ghz = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "kvsim: error: unknown argument %s (use --shapes ExK,..., --reps N, --mean M, --tokens N, "
                   "--keys F, --ghz G)\n",
                   argv[i]);
      return 2;
    }
  }
  using kvsim::merge_screen::SetEnabledForTesting;
  // This bench measures the bf16 screen where the CPU runs it; kvsim's default there is the int16 screen
  // since round 25 (policies/merge_screen.h), which the end-to-end sweeps measure.
  if (kvsim::merge_screen::Supported()) {
    kvsim::merge_screen::SetScreenForTesting(kvsim::merge_screen::Screen::kBf16);
    std::printf("note: the screen measured here is the bf16 one (kvsim's default on this CPU: int16)\n");
  } else {
    std::printf(
        kvsim::merge_screen::int16::Supported()
            ? "note: no AVX512-BF16 on this CPU: the screen is the int16 one (AVX2); \"kernel only\" is "
              "int16::Candidates\n"
            : "note: no AVX512-BF16 or AVX2 on this CPU: both paths are the exact search\n");
  }
  kvsim::EnsureSingleThreadedBlas();
  std::printf("* MAC/cycle is modelled: measured products/s x d over an assumed clock of %.3f GHz (--ghz)\n",
              g_ghz);
  if (!keys.empty()) {
    RealKeys(keys, shapes, tokens, reps);
    return 0;
  }
  constexpr int d = 128;
  std::printf("d = %d, one thread, CPU s (best of %d), keys Gaussian + %.2f x shared direction\n", d, reps,
              mean);
  std::printf("%-11s %10s %10s %7s %10s %10s %8s %9s\n", "e x k", "exact path", "screened", "ratio",
              "kernel only", "one sgemm", "cand/q", "identical");
  for (const auto& [shape, e, k] : ParseShapes(shapes)) {
    std::mt19937 rng(7);
    std::normal_distribution<float> g;
    std::vector<float> dir(d), q(static_cast<size_t>(e) * d), t(static_cast<size_t>(k) * d);
    for (float& x : dir) x = g(rng);
    for (size_t i = 0; i < q.size(); ++i) q[i] = g(rng) + static_cast<float>(mean) * dir[i % d];
    for (size_t i = 0; i < t.size(); ++i) t[i] = g(rng) + static_cast<float>(mean) * dir[i % d];
    std::vector<int> n_old, n_new;
    std::vector<float> s_old, s_new;
    SetEnabledForTesting(false);
    const double old_s =
        Best(reps, [&] { kvsim::NearestByCosine(q.data(), e, t.data(), k, d, &n_old, &s_old); });
    SetEnabledForTesting(true);
    kvsim::merge_screen::Stats& st = kvsim::merge_screen::ThreadStats();
    const long q0 = st.screened_queries, c0 = st.candidates;
    const double new_s =
        Best(reps, [&] { kvsim::NearestByCosine(q.data(), e, t.data(), k, d, &n_new, &s_new); });
    const double cand =
        st.screened_queries > q0 ? double(st.candidates - c0) / (st.screened_queries - q0) : 0;
    const bool same = n_old == n_new && std::memcmp(s_old.data(), s_new.data(), s_old.size() * 4) == 0;
    double bf16_s = 0;
    if (kvsim::merge_screen::Supported()) {
      std::vector<uint32_t> qp(static_cast<size_t>(e) * d / 2),
          tp(kvsim::merge_screen::PackedTargetsSize(k, d));
      std::vector<float> out(static_cast<size_t>(e) * kvsim::merge_screen::PaddedTargets(k));
      std::vector<double> rq(e);
      kvsim::merge_screen::PackQueries(q.data(), e, d, qp.data(), rq.data());
      kvsim::merge_screen::PackTargets(t.data(), k, d, tp.data());
      bf16_s = Best(reps, [&] {
        kvsim::merge_screen::ApproxDots(qp.data(), e, tp.data(), k, d, out.data(),
                                        kvsim::merge_screen::PaddedTargets(k));
      });
    }
    // The int16 screen's own line wherever the CPU runs it (kvsim's default screen there since round 25).
    if (kvsim::merge_screen::int16::Supported()) {
      const double int16_s = Int16Screen(shape, q, e, t, k, reps, d);
      if (!kvsim::merge_screen::Supported()) bf16_s = int16_s;
    }
    std::vector<float> c(static_cast<size_t>(e) * k);
    const double gemm_s = Best(reps, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, e, k, d, 1.0f, q.data(), d, t.data(), d, 0.0f,
                  c.data(), k);
    });
    std::printf("%-11s %10.4f %10.4f %6.2fx %10.4f %10.4f %8.2f %9s\n", shape.c_str(), old_s, new_s,
                old_s / new_s, bf16_s, gemm_s, cand, same ? "yes" : "NO");
  }
  NestedBudgets(tokens, reps, mean);
  return 0;
}
