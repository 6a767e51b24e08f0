// kvsim_gemm_bench: the reference's two products (sim/attention.cc ComputeDecodeReference) on the demo
// trace's shapes, OpenBLAS's cblas_sgemm exactly as the reference called it vs sim/gemm.h, one thread,
// alternating, thread CPU time per call. Usage: kvsim_gemm_bench [steps=128] [prompt=3280] [d=128] [rounds=5]
// [calls=40]
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "sim/gemm.h"

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 128;
  const int prompt = argc > 2 ? std::atoi(argv[2]) : 3280;
  const int d = argc > 3 ? std::atoi(argv[3]) : 128;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 5;
  const int calls = argc > 5 ? std::atoi(argv[5]) : 40;
  openblas_set_num_threads(1);
  const int t_all = prompt + steps;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(steps) * d), k(static_cast<size_t>(t_all) * d),
      v(static_cast<size_t>(t_all) * d), logits(static_cast<size_t>(steps) * t_all),
      probs(static_cast<size_t>(steps) * t_all), out(static_cast<size_t>(steps) * d);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<int32_t> lo(steps, 0), hi(steps);
  for (int t = 0; t < steps; ++t) hi[t] = prompt + t + 1;
  // Softmax rows over each step's visible keys, zeros after them (as the reference's P).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, steps, t_all, d, scale, q.data(), d, k.data(), d, 0.0f,
              probs.data(), t_all);
  for (int t = 0; t < steps; ++t) {
    float* row = probs.data() + static_cast<size_t>(t) * t_all;
    const float mx = *std::max_element(row, row + hi[t]);
    double sum = 0;
    for (int j = 0; j < hi[t]; ++j) sum += row[j] = std::exp(row[j] - mx);
    for (int j = 0; j < hi[t]; ++j) row[j] = static_cast<float>(row[j] / sum);
    std::fill(row + hi[t], row + t_all, 0.0f);
  }
  // Thread CPU time (the machine is shared: time spent descheduled is not the kernel's).
  auto cpu_ns = [] {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
  };
  auto time_ns = [&](auto&& f) {
    const double t0 = cpu_ns();
    for (int c = 0; c < calls; ++c) f();
    return (cpu_ns() - t0) / calls;
  };
  const double flops = 2.0 * steps * t_all * d;  // each product
  std::printf("shapes: S %d, T %d, d %d; %d calls per timing; GFLOP/s at %.1f MFLOP per product\n", steps,
              t_all, d, calls, flops / 1e6);
  std::printf("%-6s %14s %14s %14s %14s\n", "round", "blas_logits", "ours_logits", "blas_output",
              "ours_output");
  for (int r = 0; r < rounds; ++r) {
    const double bl = time_ns([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, steps, t_all, d, scale, q.data(), d, k.data(), d,
                  0.0f, logits.data(), t_all);
    });
    const double ol = time_ns(
        [&] { kvsim::GemmDotRows(steps, t_all, d, scale, q.data(), d, k.data(), d, logits.data(), t_all); });
    const double bo = time_ns([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, steps, d, t_all, 1.0f, probs.data(), t_all,
                  v.data(), d, 0.0f, out.data(), d);
    });
    const double oo = time_ns([&] {
      kvsim::GemmRowRanges(steps, d, t_all, probs.data(), t_all, v.data(), d, lo.data(), hi.data(),
                           out.data(), d);
    });
    std::printf("%-6d %8.0f us %4.1f %8.0f us %4.1f %8.0f us %4.1f %8.0f us %4.1f  pair %.3f\n", r, bl / 1e3,
                flops / bl, ol / 1e3, flops / ol, bo / 1e3, flops / bo, oo / 1e3, flops / oo,
                (ol + oo) / (bl + bo));
  }
  return 0;
}
