#pragma once
// The policies' own GPU work, device code for nvcc (policy_kernels.cu) and the host execution layer
// (host_kernels.cc); gpu_replay/kernels.h has the CPU reference of each:
//   window scores  per (key tile, KV head) block: the tile's K in shared memory, every window row of the
//                  group scored against it: partial log-sum-exps, combined per row; then per key tile the
//                  sum of exp(logit - lse) over the group's window rows (K read twice in all);
//   top-k          one block per head: 4-pass 8-bit radix select of the k-th largest score, ties to the
//                  lowest slot by a block scan (BlockExclusiveSum, device_common.cuh), then a warp-per-row
//                  gather of K/V into the new ragged layout;
//   merge          cosine of every evicted key against every kept slot of its head as a tensor-core GEMM
//                  (WMMA, 16 evicted x 16 kept tiles, fp32 accumulation) + per-row argmax (first max
//                  wins), fp32 atomics into per-slot sums, then (k_a + Σ k_e) / (1 + m).

#include <string>

#include "gpu_replay/device_common.cuh"
#include "gpu_replay/dtype.h"

namespace kvsim::gpu_replay {

// Device pointers of one window-scoring call (q [num_q_heads][window][d], k [num_kv_heads][num_keys][d]).
struct WindowArgs {
  Dtype dtype = Dtype::kF16;
  int head_dim = 0, num_q_heads = 0, num_kv_heads = 0, num_keys = 0, window = 0;
  float scale = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  float* lse = nullptr;       // [num_q_heads][window]
  float* lse_part = nullptr;  // [num_kv_heads][ceil(num_keys / 64)][group * window][2] (WindowLsePartSize)
  float* scores = nullptr;    // [num_kv_heads][num_keys]
};

inline size_t WindowLsePartSize(int num_q_heads, int num_keys, int window) {
  return static_cast<size_t>(num_q_heads) * window * ((num_keys + 63) / 64) * 2;
}

// One top-k + compaction call over ragged layouts (src: candidates, dst: kept rows).
struct TopKArgs {
  Dtype dtype = Dtype::kF16;
  int head_dim = 0, num_heads = 0;
  int max_len = 0;                // the longest dst length (gather grid)
  const float* scores = nullptr;  // [src total slots]
  const int64_t* src_offset = nullptr;
  const int32_t* src_len = nullptr;
  const int64_t* dst_offset = nullptr;
  const int32_t* dst_len = nullptr;
  int32_t* selected = nullptr;  // [dst total slots]
  const void* k = nullptr;
  const void* v = nullptr;
  void* ko = nullptr;
  void* vo = nullptr;
};

// One nearest-slot merge batch; count / ksum / vsum must be zero before the call.
struct MergeArgs {
  Dtype dtype = Dtype::kF16;
  int head_dim = 0, num_e = 0;
  int64_t slots = 0;
  void* k = nullptr;  // [slots][d], merged in place
  void* v = nullptr;
  int num_heads = 0, max_e = 0;  // max_e: the most evicted keys of one head
  const void* ek = nullptr;      // [num_e][d], head h's are [e_first[h], e_first[h + 1])
  const void* ev = nullptr;
  const int32_t* e_first = nullptr;  // [num_heads + 1]
  const int64_t* offset = nullptr;
  const int32_t* len = nullptr;
  float* knorm = nullptr;      // [slots]
  int32_t* nearest = nullptr;  // [num_e]
  float* sim = nullptr;        // [num_e]
  int32_t* count = nullptr;    // [slots]
  float* ksum = nullptr;       // [slots][d]
  float* vsum = nullptr;
};

namespace KVSIM_KERNELS_NS {

// ---- Window scores ----
// Pass 1, per (key tile, KV head): the tile's K is loaded into shared memory once and every window row of
// the group is scored against it; each row's partial (max, sum of exp) over the tile's causal keys goes to
// part[h][tile][row]. K is read once here and once by WindowScoreKernel, not once per window row.
template <typename T, int D>
__global__ void WindowLsePartialKernel(const T* __restrict__ q, const T* __restrict__ k, int group, int n,
                                       int window, float scale, float* __restrict__ part) {
  constexpr int TILE = 64, QC = 8, NW = TILE / 32;
  const int h = blockIdx.y, tile = blockIdx.x, tiles = gridDim.x, j0 = tile * TILE, t = threadIdx.x,
            j = j0 + t;
  const int warp = t / 32, lane = t % 32;
  KVSIM_SHARED(T, ks, [TILE][D + 2]);  // +2: rows start in different banks
  KVSIM_SHARED(float, qs, [QC][D]);
  KVSIM_SHARED(float, red, [NW][QC][2]);
  const T* kb = k + static_cast<int64_t>(h) * n * D;
  for (int idx = t; idx < TILE * D; idx += TILE) {
    const int r = idx / D, c = idx % D;
    ks[r][c] = j0 + r < n ? kb[static_cast<int64_t>(j0 + r) * D + c] : FromF<T>(0.0f);
  }
  const int rows = group * window;
  for (int r0 = 0; r0 < rows; r0 += QC) {
    __syncthreads();
    for (int idx = t; idx < QC * D; idx += TILE) {
      const int r = r0 + idx / D;
      const int qh = h * group + r / window, w = r % window;
      qs[idx / D][idx % D] =
          r < rows ? ToF(q[(static_cast<int64_t>(qh) * window + w) * D + idx % D]) * scale : 0.0f;
    }
    __syncthreads();
    for (int i = 0; i < QC; ++i) {  // every lane takes part (the warp reductions need them all)
      const int r = r0 + i, pos = n - window + r % window;
      float dot = -INFINITY;
      if (r < rows && j < n && j <= pos) {
        dot = 0;
#pragma unroll 16
        for (int c = 0; c < D; ++c) dot += qs[i][c] * ToF(ks[t][c]);
      }
      const float m = WarpMax(dot);
      const float sum = WarpSum(m == -INFINITY ? 0.0f : __expf(dot - m));
      if (lane == 0) {
        red[warp][i][0] = m;
        red[warp][i][1] = sum;
      }
    }
    __syncthreads();
    if (t < QC && r0 + t < rows) {
      float M = -INFINITY, S = 0;
      for (int w = 0; w < NW; ++w) M = fmaxf(M, red[w][t][0]);
      for (int w = 0; w < NW; ++w) {
        const float mw = red[w][t][0];
        if (mw != -INFINITY) S += red[w][t][1] * __expf(mw - M);
      }
      float* o = part + ((static_cast<int64_t>(h) * tiles + tile) * rows + r0 + t) * 2;
      o[0] = M;
      o[1] = S;
    }
  }
}

// Pass 2: lse[qh][w] = log-sum-exp of the row's tile partials (a row of KV head h is g * window + w, and
// qh * window + w = h * rows + row). Thread per row. (A template: the header is included by several files.)
template <int kUnused = 0>
__global__ void WindowLseCombineKernel(const float* __restrict__ part, int rows, int tiles, int hkv,
                                       float* __restrict__ lse) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= hkv * rows) return;
  const int h = idx / rows, r = idx % rows;
  const float* p = part + (static_cast<int64_t>(h) * tiles * rows + r) * 2;
  float M = -INFINITY, S = 0;
  for (int tile = 0; tile < tiles; ++tile) M = fmaxf(M, p[static_cast<int64_t>(tile) * rows * 2]);
  for (int tile = 0; tile < tiles; ++tile) {
    const float m = p[static_cast<int64_t>(tile) * rows * 2];
    if (m != -INFINITY) S += p[static_cast<int64_t>(tile) * rows * 2 + 1] * __expf(m - M);
  }
  lse[idx] = M + __logf(S);
}

template <typename T, int D>
__global__ void WindowScoreKernel(const T* __restrict__ q, const T* __restrict__ k, int group, int n,
                                  int window, float scale, const float* __restrict__ lse,
                                  float* __restrict__ scores) {
  constexpr int TILE = 64, QC = 8;
  const int h = blockIdx.y, j0 = blockIdx.x * TILE, t = threadIdx.x, j = j0 + t;
  KVSIM_SHARED(T, ks, [TILE][D + 2]);  // +2: rows start in different banks
  KVSIM_SHARED(float, qs, [QC][D]);
  const T* kb = k + static_cast<int64_t>(h) * n * D;
  for (int idx = t; idx < TILE * D; idx += TILE) {
    const int r = idx / D, c = idx % D;
    ks[r][c] = j0 + r < n ? kb[static_cast<int64_t>(j0 + r) * D + c] : FromF<T>(0.0f);
  }
  float acc = 0;
  const int rows = group * window;
  for (int r0 = 0; r0 < rows; r0 += QC) {
    __syncthreads();
    for (int idx = t; idx < QC * D; idx += TILE) {
      const int r = r0 + idx / D;
      const int qh = h * group + r / window, w = r % window;
      qs[idx / D][idx % D] =
          r < rows ? ToF(q[(static_cast<int64_t>(qh) * window + w) * D + idx % D]) * scale : 0.0f;
    }
    __syncthreads();
    if (j >= n) continue;
    for (int i = 0; i < QC && r0 + i < rows; ++i) {
      const int r = r0 + i, w = r % window, pos = n - window + w;
      if (j > pos) continue;
      float dot = 0;
#pragma unroll 16
      for (int c = 0; c < D; ++c) dot += qs[i][c] * ToF(ks[t][c]);
      acc += __expf(dot - lse[(h * group + r / window) * window + w]);
    }
  }
  if (j < n) scores[static_cast<int64_t>(h) * n + j] = acc;
}

// ---- Top-k with compaction ----
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline constexpr int kTopKThreads = 512;

template <int NT>  // kTopKThreads (a template: the header is included by several files)
__global__ void TopKSelectKernel(const float* __restrict__ scores, const int64_t* __restrict__ src_offset,
                                 const int32_t* __restrict__ src_len, const int64_t* __restrict__ dst_offset,
                                 const int32_t* __restrict__ dst_len, int32_t* __restrict__ selected) {
  const int h = blockIdx.x, n = src_len[h], keep = dst_len[h], t = threadIdx.x;
  const float* sc = scores + src_offset[h];
  KVSIM_SHARED(uint32_t, hist, [256]);
  KVSIM_SHARED(uint32_t, prefix_s, );
  KVSIM_SHARED(uint32_t, remaining_s, );
  if (t == 0) prefix_s = 0, remaining_s = keep;
  // Radix select: the key of the keep-th largest score.
  for (int pass = 0; pass < 4 && keep > 0; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = t; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    const uint32_t mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = t; i < n; i += blockDim.x) {
      const uint32_t key = OrderedKey(sc[i]);
      if ((key & mask) == (prefix & mask)) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
    }
    __syncthreads();
    if (t == 0) {
      uint32_t rem = remaining_s;
      int b = 255;
      for (; b > 0 && hist[b] < rem; --b) rem -= hist[b];
      prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
      remaining_s = rem;  // how many keys equal to the threshold (within this bucket chain) to take
    }
    __syncthreads();
  }
  if (keep == 0) return;
  const uint32_t thr = prefix_s;
  const uint32_t take_equal = remaining_s;
  // Ordered compaction: slot i is kept if key > thr, or key == thr and among the first take_equal such slots.
  KVSIM_SHARED(int, scan_tmp, [NT / 32]);
  KVSIM_SHARED(int, base_sel, );
  KVSIM_SHARED(int, base_eq, );
  if (t == 0) base_sel = 0, base_eq = 0;
  __syncthreads();
  for (int c = 0; c < n; c += blockDim.x) {
    const int i = c + t;
    const uint32_t key = i < n ? OrderedKey(sc[i]) : 0u;
    const int eq = i < n && key == thr;
    int eq_total;
    const int eq_before = BlockExclusiveSum<NT>(eq, &eq_total, scan_tmp);
    __syncthreads();
    const int sel = i < n && (key > thr || (eq && base_eq + eq_before < static_cast<int>(take_equal)));
    int sel_total;
    const int sel_before = BlockExclusiveSum<NT>(sel, &sel_total, scan_tmp);
    if (sel) selected[dst_offset[h] + base_sel + sel_before] = i;
    __syncthreads();
    if (t == 0) base_sel += sel_total, base_eq += eq_total;
    __syncthreads();
  }
}

template <typename T, int D>
__global__ void GatherKernel(const T* __restrict__ k, const T* __restrict__ v,
                             const int64_t* __restrict__ src_offset, const int64_t* __restrict__ dst_offset,
                             const int32_t* __restrict__ dst_len, const int32_t* __restrict__ selected,
                             int num_heads, T* __restrict__ ko, T* __restrict__ vo) {
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + warp;
  if (row >= dst_len[h]) return;
  const int64_t src = (src_offset[h] + selected[dst_offset[h] + row]) * D, dst = (dst_offset[h] + row) * D;
  for (int c = lane; c < D; c += 32) {
    ko[dst + c] = k[src + c];
    vo[dst + c] = v[src + c];
  }
}

// ---- Merge ----
template <typename T, int D>
__global__ void KeyNormKernel(const T* __restrict__ k, int64_t slots, float* __restrict__ norm) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (s >= slots) return;
  float ss = 0;
  for (int c = lane; c < D; c += 32) {
    const float x = ToF(k[s * D + c]);
    ss += x * x;
  }
  ss = WarpSum(ss);
  if (lane == 0) norm[s] = sqrtf(ss);
}

inline constexpr int kMergeWarps = 4;      // warps per block, each a tile of 16 evicted keys of one head
inline constexpr int kMergeKeyChunk = 32;  // kept keys per shared-memory chunk (two 16-column tiles)

// Nearest kept slot of every evicted key by cosine, as a tensor-core GEMM + argmax. Block (x, h): evicted
// keys [64 x, 64 x + 64) of head h, 16 per warp; the warp holds its 16 x D keys as WMMA matrix_a fragments
// and the block streams the head's kept keys through shared memory, 32 at a time (rows past the head's
// length and past its evicted keys are zeros: nothing is read out of bounds). The fp32 dot products
// (16-bit inputs, fp32 accumulation) go through shared memory to lanes 0-15, one row each, which divide by
// the norms (KeyNormKernel's for kept keys, the evicted key's own, fp32 in element order) and keep the
// first maximum in slot order (strict >, as RefMergeNearest). Then each row's key and value are added to
// its slot's fp32 sums with atomics.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
    NearestKernel(const T* __restrict__ k, const float* __restrict__ knorm, const T* __restrict__ ek,
                  const T* __restrict__ ev, const int32_t* __restrict__ e_first,
                  const int64_t* __restrict__ offset, const int32_t* __restrict__ len,
                  int32_t* __restrict__ nearest, float* __restrict__ sim, int32_t* __restrict__ count,
                  float* __restrict__ ksum, float* __restrict__ vsum) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "NearestKernel needs sm_80 or newer (bf16 WMMA)"
#endif
  namespace wmma = nvcuda::wmma;
  constexpr int NW = kMergeWarps, RT = 16, KC = kMergeKeyChunk, LD = D + 8, KT = D / 16, LDC = KC + 4;
  static_assert(D % 16 == 0 && KC % 16 == 0, "WMMA tiles");
  const int h = blockIdx.y, t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int e0 = e_first[h], ne = e_first[h + 1] - e0, n = len[h], row0 = blockIdx.x * NW * RT;
  if (row0 >= ne) return;  // the head has fewer evicted keys (block-uniform)
  if (n == 0) {            // no kept slot: nothing to merge into
    for (int r = row0 + t; r < ne && r < row0 + NW * RT; r += blockDim.x)
      nearest[e0 + r] = -1, sim[e0 + r] = 0;
    return;
  }
  KVSIM_SHARED(T, as, [NW][RT][LD]);  // +8: rows start in different banks (ldm a multiple of 8)
  KVSIM_SHARED(T, ks, [KC][LD]);
  KVSIM_SHARED(float, cs, [NW][RT][LDC]);
  const int wrow = row0 + warp * RT;                                       // the warp's first row in the head
  const int rows = ne - wrow < 0 ? 0 : (ne - wrow < RT ? ne - wrow : RT);  // warp-uniform
  const int64_t ebase = static_cast<int64_t>(e0 + wrow) * D;
  for (int idx = lane; idx < RT * D; idx += 32) {
    const int r = idx / D, c = idx % D;
    as[warp][r][c] = r < rows ? ek[ebase + static_cast<int64_t>(r) * D + c] : FromF<T>(0.0f);
  }
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[KT];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) wmma::load_matrix_sync(a[kt], &as[warp][0][kt * 16], LD);
  float en = 0;  // lane r < rows: the norm of row r
  if (lane < rows)
    for (int c = 0; c < D; ++c) {
      const float x = ToF(ek[ebase + static_cast<int64_t>(lane) * D + c]);
      en += x * x;
    }
  en = sqrtf(en);
  const T* kb = k + offset[h] * D;
  const float* kn = knorm + offset[h];
  float best = -INFINITY;
  int best_s = 0;
  for (int s0 = 0; s0 < n; s0 += KC) {
    __syncthreads();  // the previous chunk's ks and cs are consumed
    for (int idx = t; idx < KC * D; idx += blockDim.x) {
      const int r = idx / D, c = idx % D;
      ks[r][c] = s0 + r < n ? kb[static_cast<int64_t>(s0 + r) * D + c] : FromF<T>(0.0f);
    }
    __syncthreads();
    if (rows == 0) continue;  // warp-uniform
#pragma unroll
    for (int nt = 0; nt < KC / 16; ++nt) {
      if (s0 + nt * 16 >= n) break;  // warp-uniform: no kept key in this column tile
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>
            b;  // b(c, j) = ks[16 nt + j][16 kt + c]
        wmma::load_matrix_sync(b, &ks[nt * 16][kt * 16], LD);
        wmma::mma_sync(acc, a[kt], b, acc);
      }
      wmma::store_matrix_sync(&cs[warp][0][nt * 16], acc, LDC, wmma::mem_row_major);
    }
    __syncwarp();
    if (lane < rows)
      for (int j = 0; j < KC && s0 + j < n; ++j) {
        const float kj = kn[s0 + j];
        const float c = (en > 0 && kj > 0) ? cs[warp][lane][j] / (en * kj) : 0.0f;
        if (c > best) best = c, best_s = s0 + j;
      }
  }
  if (lane < rows) {
    nearest[e0 + wrow + lane] = best_s;
    sim[e0 + wrow + lane] = best;
    atomicAdd(&count[offset[h] + best_s], 1);
  }
  for (int r = 0; r < rows; ++r) {  // every lane: a row's key and value into its slot's sums
    const int64_t slot = offset[h] + __shfl_sync(0xffffffffu, best_s, r),
                  e = ebase + static_cast<int64_t>(r) * D;
    for (int c = lane; c < D; c += 32) {
      atomicAdd(&ksum[slot * D + c], ToF(ek[e + c]));
      atomicAdd(&vsum[slot * D + c], ToF(ev[e + c]));
    }
  }
}

template <typename T, int D>
__global__ void MergeFinalizeKernel(T* __restrict__ k, T* __restrict__ v, const int32_t* __restrict__ count,
                                    const float* __restrict__ ksum, const float* __restrict__ vsum,
                                    int64_t slots) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= slots * D) return;
  const int c = count[i / D];
  if (c == 0) return;
  const float inv = 1.0f / (1.0f + c);
  k[i] = FromF<T>((ToF(k[i]) + ksum[i]) * inv);
  v[i] = FromF<T>((ToF(v[i]) + vsum[i]) * inv);
}

// ---- Launch sequences ----
template <template <typename, int> class F, typename A>
Status DispatchPolicy(const A& a, cudaStream_t s) {
  if (a.head_dim != 64 && a.head_dim != 128)
    return Status::InvalidArgument("head_dim " + std::to_string(a.head_dim) + " not compiled (64, 128)");
  if (a.dtype == Dtype::kF16) return a.head_dim == 64 ? F<F16, 64>::Run(a, s) : F<F16, 128>::Run(a, s);
  return a.head_dim == 64 ? F<BF16, 64>::Run(a, s) : F<BF16, 128>::Run(a, s);
}

template <typename T, int D>
struct WindowRun {
  static Status Run(const WindowArgs& a, cudaStream_t s) {
    const int group = a.num_q_heads / a.num_kv_heads;
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const int tiles = (a.num_keys + 63) / 64, rows = group * a.window;
    KVSIM_RETURN_IF_ERROR(Launch(WindowLsePartialKernel<T, D>, dim3(tiles, a.num_kv_heads), dim3(64), s, q, k,
                                 group, a.num_keys, a.window, a.scale, a.lse_part));
    KVSIM_RETURN_IF_ERROR(Launch(WindowLseCombineKernel<>, dim3((a.num_kv_heads * rows + 127) / 128),
                                 dim3(128), s, static_cast<const float*>(a.lse_part), rows, tiles,
                                 a.num_kv_heads, a.lse));
    return Launch(WindowScoreKernel<T, D>, dim3((a.num_keys + 63) / 64, a.num_kv_heads), dim3(64), s, q, k,
                  group, a.num_keys, a.window, a.scale, static_cast<const float*>(a.lse), a.scores);
  }
};

template <typename T, int D>
struct TopKRun {
  static Status Run(const TopKArgs& a, cudaStream_t s) {
    KVSIM_RETURN_IF_ERROR(Launch(TopKSelectKernel<kTopKThreads>, dim3(a.num_heads), dim3(kTopKThreads), s,
                                 a.scores, a.src_offset, a.src_len, a.dst_offset, a.dst_len, a.selected));
    if (a.max_len == 0) return Status::Ok();
    return Launch(GatherKernel<T, D>, dim3((a.max_len + 7) / 8, a.num_heads), dim3(256), s,
                  static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.src_offset, a.dst_offset,
                  a.dst_len, static_cast<const int32_t*>(a.selected), a.num_heads, static_cast<T*>(a.ko),
                  static_cast<T*>(a.vo));
  }
};

template <typename T, int D>
struct MergeRun {
  static Status Run(const MergeArgs& a, cudaStream_t s) {
    T* k = static_cast<T*>(a.k);
    T* v = static_cast<T*>(a.v);
    if (a.slots > 0)
      KVSIM_RETURN_IF_ERROR(Launch(KeyNormKernel<T, D>, dim3((a.slots + 7) / 8), dim3(256), s,
                                   static_cast<const T*>(k), a.slots, a.knorm));
    if (a.num_e > 0 && a.max_e > 0)
      KVSIM_RETURN_IF_ERROR(Launch(
          NearestKernel<T, D>, dim3((a.max_e + kMergeWarps * 16 - 1) / (kMergeWarps * 16), a.num_heads),
          dim3(kMergeWarps * 32), s, static_cast<const T*>(k), static_cast<const float*>(a.knorm),
          static_cast<const T*>(a.ek), static_cast<const T*>(a.ev), a.e_first, a.offset, a.len, a.nearest,
          a.sim, a.count, a.ksum, a.vsum));
    const int64_t total = a.slots * D;
    if (total == 0) return Status::Ok();
    return Launch(MergeFinalizeKernel<T, D>, dim3((total + 255) / 256), dim3(256), s, k, v,
                  static_cast<const int32_t*>(a.count), static_cast<const float*>(a.ksum),
                  static_cast<const float*>(a.vsum), a.slots);
  }
};

inline Status LaunchWindowScores(const WindowArgs& a, cudaStream_t s) {
  return DispatchPolicy<WindowRun>(a, s);
}
inline Status LaunchTopKCompact(const TopKArgs& a, cudaStream_t s) { return DispatchPolicy<TopKRun>(a, s); }
inline Status LaunchMergeNearest(const MergeArgs& a, cudaStream_t s) {
  return DispatchPolicy<MergeRun>(a, s);
}

}  // namespace KVSIM_KERNELS_NS
}  // namespace kvsim::gpu_replay
