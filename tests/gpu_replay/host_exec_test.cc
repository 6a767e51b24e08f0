// gpu_replay/host_exec.h: the host execution layer's CUDA semantics (thread / block indices, barriers, warp
// shuffles and votes, atomics, shared memory) and its detectors, proved on toy kernels that are deliberately
// racy, divergent or deadlocked: each must make the launch fail with a message saying what went wrong.

#include <catch2/catch.hpp>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_replay/device_common.cuh"

namespace kvsim::gpu_replay::host {
namespace {

using hx::LaunchOptions;
using hx::ScopedLaunchOptions;

// Expects the launch to fail with a message containing `what`.
void ExpectError(const Status& st, const std::string& what) {
  INFO(st.message());
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == StatusCode::kInternal);
  CHECK(st.message().find(what) != std::string::npos);
}

// ---- Clean kernels ----
__global__ void IndexKernel(int* out) {
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int nt = blockDim.x * blockDim.y * blockDim.z;
  out[b * nt + t] = b * 1000 + t;
}

// Block sum through shared memory: a tree with a barrier per level.
__global__ void BlockSumKernel(const float* in, float* out) {
  KVSIM_SHARED(float, buf, [256]);
  const int t = threadIdx.x;
  buf[t] = in[blockIdx.x * 256 + t];
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (t < s) buf[t] = buf[t] + buf[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

__global__ void ShuffleKernel(int* out) {
  const int lane = threadIdx.x % 32, t = threadIdx.x;
  int* o = out + t * 10;
  o[0] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  o[1] = __shfl_sync(0xffffffffu, lane * 10, 7);
  o[2] = __shfl_down_sync(0xffffffffu, lane * 10, 3);
  o[3] = __shfl_up_sync(0xffffffffu, lane * 10, 3);
  o[4] = __shfl_sync(0xffffffffu, lane * 10, 3, 8);  // width 8: lane 3 of each group of 8
  o[5] = __shfl_xor_sync(0xffffffffu, lane * 10, 4, 8);
  o[6] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[7] = __any_sync(0xffffffffu, lane == 17);
  o[8] = __all_sync(0xffffffffu, lane < 31);
  o[9] = static_cast<int>(WarpSum(static_cast<float>(lane)));
  if (lane < 16) o[4] += 1000 * __shfl_sync(0x0000ffffu, lane, 15);  // a sub-warp mask
}

__global__ void SharedAtomicKernel(int* out) {
  KVSIM_SHARED(int, counter, );
  KVSIM_SHARED(unsigned, hist, [4]);
  if (threadIdx.x == 0) counter = 0;
  if (threadIdx.x < 4) hist[threadIdx.x] = 0;
  __syncthreads();
  atomicAdd(&counter, 1);
  atomicAdd(&hist[threadIdx.x % 4], 2u);
  atomicMax(&out[1], static_cast<int>(threadIdx.x));
  __syncthreads();
  if (threadIdx.x == 0) out[0] = counter + static_cast<int>(hist[0] + hist[1] + hist[2] + hist[3]);
}

__global__ void ScanKernel(const int* in, int* out, int* totals) {
  KVSIM_SHARED(int, warp_sums, [512 / 32]);
  int total;
  out[threadIdx.x] = BlockExclusiveSum<512>(in[threadIdx.x], &total, warp_sums);
  if (threadIdx.x == 0) totals[0] = total;
  __syncthreads();  // warp_sums is reused: a barrier first
  const int again = BlockExclusiveSum<512>(1, &total, warp_sums);
  if (threadIdx.x == 511) totals[1] = again + total;
}

// Warp-level communication through shared memory ordered by a full-warp __syncwarp: no race.
__global__ void SyncWarpKernel(int* out) {
  KVSIM_SHARED(int, s, [32]);
  const int lane = threadIdx.x;
  s[lane] = lane;
  __syncwarp();
  out[lane] = s[(lane + 1) % 32];
}

// ---- Broken kernels ----
__global__ void WriteWriteRaceKernel(int* out) {
  KVSIM_SHARED(int, s, [1]);
  s[0] = threadIdx.x;  // every thread writes the same word
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s[0];
}

__global__ void ReadWriteRaceKernel(int* out) {
  KVSIM_SHARED(int, s, [64]);
  const int t = threadIdx.x;
  s[t] = 0;
  __syncthreads();
  s[t] = t;
  out[t] = s[(t + 1) % 64];  // the neighbour's write is not ordered by a barrier
}

__global__ void MissingSecondBarrierKernel(const float* in,
                                           float* out) {  // the classic: reuse without barrier
  KVSIM_SHARED(float, buf, [64]);
  const int t = threadIdx.x;
  buf[t] = in[t];
  __syncthreads();
  const float x = buf[63 - t];
  buf[t] = x * 2;  // thread 63 - t may not have read buf[t] yet
  __syncthreads();
  out[t] = buf[t];
}

__global__ void SyncWarpAcrossWarpsKernel(int* out) {  // __syncwarp does not order different warps
  KVSIM_SHARED(int, s, [64]);
  const int t = threadIdx.x;
  s[t] = 0;
  __syncthreads();
  s[t] = t;
  __syncwarp();
  out[t] = s[(t + 32) % 64];
}

__global__ void AtomicPlainMixKernel(int* out) {
  KVSIM_SHARED(int, s, );
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  atomicAdd(&s, 1);
  out[threadIdx.x] = s;  // a plain read while other threads still add
}

__global__ void UninitialisedReadKernel(float* out) {
  KVSIM_SHARED(float, s, [32]);
  if (threadIdx.x < 16) s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

__global__ void OutOfBoundsKernel(float* out) {
  KVSIM_SHARED(float, s, [32]);
  s[threadIdx.x] = 1.0f;  // 64 threads
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

__global__ void DivergentBarrierKernel(int* out) {
  if (threadIdx.x < 16) __syncthreads();  // threads 16.. never arrive: they exit
  out[threadIdx.x] = 1;
}

__global__ void BarrierSitesKernel(int* out) {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void EarlyExitBarrierKernel(int* out) {
  if (threadIdx.x == 40) return;  // exits before the others reach the barrier
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void ShuffleDeadlockKernel(int* out) {
  const int lane = threadIdx.x % 32;
  int v = lane;
  if (lane == 0) {
    __syncthreads();  // lane 0 waits for the block, the block waits for lane 0's shuffle
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

__global__ void ExitedLaneShuffleKernel(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = WarpSum(1.0f);  // lane 5 is in the full mask but has exited
}

__global__ void LaneNotInMaskKernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 0);  // lanes 16.. are not in it
}

__global__ void PartialWarpMaskKernel(float* out) { out[threadIdx.x] = WarpSum(1.0f); }  // 48 threads

__global__ void SourceNotInMaskKernel(int* out) {
  if (threadIdx.x < 8) out[threadIdx.x] = __shfl_sync(0x000000ffu, static_cast<int>(threadIdx.x), 9);
}

__global__ void SpinKernel(int* out) {
  KVSIM_SHARED(int, flag, );
  if (threadIdx.x == 1) flag = 0;
  __syncthreads();
  if (threadIdx.x == 0)
    while (flag == 0) {  // nobody ever sets it: a livelock, not a deadlock (the thread never blocks)
    }
  out[threadIdx.x] = 1;
}

__global__ void MisalignedLoadKernel(const int* p, int* out) {
  int4 v;
  hx::VectorLoad(&v, p + threadIdx.x, 16);  // a 16-byte load from a 4-byte aligned address
  out[threadIdx.x] = v.x;
}

// ---- Tensor-core (WMMA) kernels ----
namespace wmma = nvcuda::wmma;

// C[M][N] = A[M][K] B[K][N] + C0 (A row-major; B row- or column-major; C0 column-major, loaded as an
// accumulator): one warp per 16 x 16 tile of C, the tiles of A and B staged in shared memory (zero padded
// beyond ldm), C stored to global memory.
template <typename T, typename LB>
__global__ void WmmaGemmKernel(const T* a, const T* b, const float* c0, float* c, int m, int n, int kdim) {
  constexpr int LD = 24;  // 16 + 8: ldm a multiple of 8 elements
  KVSIM_SHARED(T, as, [16][LD]);
  KVSIM_SHARED(T, bs, [16][LD]);
  const int ti = blockIdx.y, tj = blockIdx.x, lane = threadIdx.x;
  const bool b_row = std::is_same_v<LB, wmma::row_major>;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(acc, c0 + tj * 16 * m + ti * 16, m, wmma::mem_col_major);
  for (int k0 = 0; k0 < kdim; k0 += 16) {
    __syncwarp();  // the previous tiles are consumed
    for (int idx = lane; idx < 256; idx += 32) {
      const int r = idx / 16, q = idx % 16;
      as[r][q] = a[(ti * 16 + r) * kdim + k0 + q];
      // b_row: bs[k][j] = B[k0 + k][16 tj + j]; else bs[j][k] = B[k0 + k][16 tj + j] (B given as [n][k]).
      bs[r][q] = b_row ? b[(k0 + r) * n + tj * 16 + q] : b[(tj * 16 + r) * kdim + k0 + q];
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
    wmma::load_matrix_sync(fa, &as[0][0], LD);
    wmma::load_matrix_sync(fb, &bs[0][0], LD);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(c + ti * 16 * n + tj * 16, acc, n, wmma::mem_row_major);
}

// Element-wise access to a fragment (the same operation on every element) and a store to shared memory
// read back by other lanes after a __syncwarp.
__global__ void WmmaElementwiseKernel(float* out) {
  KVSIM_SHARED(float, cs, [16][16]);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.5f);
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.0f;
  wmma::store_matrix_sync(&cs[0][0], acc, 16, wmma::mem_row_major);
  __syncwarp();
  out[threadIdx.x] = cs[(threadIdx.x + 5) % 16][threadIdx.x % 16];
}

// Only lanes 0-15 call mma_sync: lanes 16-31 exit while the others wait.
__global__ void WmmaHalfWarpKernel(float* out) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, F16, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, F16, wmma::col_major> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(a, FromF<F16>(1.0f));
  wmma::fill_fragment(b, FromF<F16>(1.0f));
  wmma::fill_fragment(acc, 0.0f);
  if (threadIdx.x < 16) wmma::mma_sync(acc, a, b, acc);
  out[threadIdx.x] = acc.x[0];
}

// A block of 16 threads: the warp is partial.
__global__ void WmmaPartialWarpKernel(float* out) {
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  KVSIM_SHARED(float, cs, [16][16]);
  wmma::store_matrix_sync(&cs[0][0], acc, 16, wmma::mem_row_major);
  out[threadIdx.x] = 0;
}

// Lanes pass different pointers to load_matrix_sync.
__global__ void WmmaNonUniformKernel(const F16* p, float* out) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, F16, wmma::row_major> a;
  wmma::load_matrix_sync(a, p + (threadIdx.x % 2) * 16, 32);
  out[threadIdx.x] = ToF(a.x[0]);
}

// A lane-dependent change of fragment elements: the lanes' fragments differ at the next mma_sync.
__global__ void WmmaLaneDependentKernel(float* out) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, F16, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, F16, wmma::col_major> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(a, FromF<F16>(1.0f));
  wmma::fill_fragment(b, FromF<F16>(1.0f));
  wmma::fill_fragment(acc, 0.0f);
  if (threadIdx.x == 3) acc.x[0] = 7.0f;
  wmma::mma_sync(acc, a, b, acc);
  out[threadIdx.x] = acc.x[0];
}

// A store_matrix_sync to shared memory read by other lanes without a __syncwarp.
__global__ void WmmaStoreRaceKernel(float* out) {
  KVSIM_SHARED(float, cs, [16][16]);
  for (int i = threadIdx.x; i < 256; i += 32) cs[i / 16][i % 16] = 0;
  __syncthreads();
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  wmma::store_matrix_sync(&cs[0][0], acc, 16, wmma::mem_row_major);
  out[threadIdx.x] = cs[15 - threadIdx.x / 2][threadIdx.x % 16];
}

// A tile past the end of a shared array, and a misaligned tile.
__global__ void WmmaOutOfBoundsKernel(float* out) {
  KVSIM_SHARED(float, cs, [8][16]);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  wmma::store_matrix_sync(&cs[0][0], acc, 16, wmma::mem_row_major);
  out[threadIdx.x] = 0;
}
__global__ void WmmaMisalignedKernel(const F16* p, float* out) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, F16, wmma::row_major> a;
  wmma::load_matrix_sync(a, p + 1, 32);
  out[threadIdx.x] = ToF(a.x[0]);
}

}  // namespace

TEST_CASE("host exec: thread and block indices of 1-D and 3-D launches", "[gpu_replay][host_exec]") {
  std::vector<int> out(2 * 3 * 2 * 4 * 3 * 2, -1);
  REQUIRE(Launch(IndexKernel, dim3(2, 3, 2), dim3(4, 3, 2), nullptr, out.data()).ok());
  for (int b = 0; b < 12; ++b)
    for (int t = 0; t < 24; ++t) CHECK(out[b * 24 + t] == b * 1000 + t);
  std::vector<int> one(100, -1);
  REQUIRE(Launch(IndexKernel, dim3(1), dim3(100), nullptr, one.data()).ok());
  for (int t = 0; t < 100; ++t) CHECK(one[t] == t);
}

TEST_CASE("host exec: shared-memory tree reduction with barriers runs clean", "[gpu_replay][host_exec]") {
  std::vector<float> in(3 * 256), out(3);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 17);
  hx::CurrentStats() = {};
  REQUIRE(
      Launch(BlockSumKernel, dim3(3), dim3(256), nullptr, static_cast<const float*>(in.data()), out.data())
          .ok());
  for (int b = 0; b < 3; ++b)
    CHECK(out[b] == std::accumulate(in.begin() + b * 256, in.begin() + (b + 1) * 256, 0.0f));
  const hx::Stats st = hx::CurrentStats();
  CHECK(st.launches == 1);
  CHECK(st.blocks == 3);
  CHECK(st.threads == 768);
  CHECK(st.barriers == 3 * 256 * 9);
  CHECK(st.shared_accesses > 3 * 256);
}

TEST_CASE("host exec: warp shuffles and votes follow CUDA's lane semantics", "[gpu_replay][host_exec]") {
  std::vector<int> out(64 * 10, -1);
  REQUIRE(Launch(ShuffleKernel, dim3(1), dim3(64), nullptr, out.data()).ok());
  unsigned ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    const int* o = &out[t * 10];
    INFO("thread " << t);
    CHECK(o[0] == (lane ^ 5) * 10);
    CHECK(o[1] == 70);
    CHECK(o[2] == (lane + 3 < 32 ? lane + 3 : lane) * 10);
    CHECK(o[3] == (lane >= 3 ? lane - 3 : lane) * 10);
    CHECK(o[4] == (lane / 8 * 8 + 3) * 10 + (lane < 16 ? 15000 : 0));
    CHECK(o[5] == (lane ^ 4) * 10);
    CHECK(static_cast<unsigned>(o[6]) == ballot);
    CHECK(o[7] == 1);
    CHECK(o[8] == 0);
    CHECK(o[9] == 496);
  }
}

TEST_CASE("host exec: atomics on shared and global memory, block scan", "[gpu_replay][host_exec]") {
  std::vector<int> out(2, 0);
  REQUIRE(Launch(SharedAtomicKernel, dim3(1), dim3(96), nullptr, out.data()).ok());
  CHECK(out[0] == 96 + 2 * 96);
  CHECK(out[1] == 95);

  std::vector<int> in(512), scan(512), totals(2);
  for (int i = 0; i < 512; ++i) in[i] = (i * 7) % 5;
  REQUIRE(Launch(ScanKernel, dim3(1), dim3(512), nullptr, static_cast<const int*>(in.data()), scan.data(),
                 totals.data())
              .ok());
  int run = 0;
  for (int i = 0; i < 512; ++i) {
    CHECK(scan[i] == run);
    run += in[i];
  }
  CHECK(totals[0] == run);
  CHECK(totals[1] == 511 + 512);

  std::vector<int> w(32);
  REQUIRE(Launch(SyncWarpKernel, dim3(1), dim3(32), nullptr, w.data()).ok());
  for (int l = 0; l < 32; ++l) CHECK(w[l] == (l + 1) % 32);
}

TEST_CASE("host exec: shared-memory races are detected", "[gpu_replay][host_exec]") {
  std::vector<int> out(64);
  std::vector<float> f(64, 1.0f), g(64);
  ExpectError(Launch(WriteWriteRaceKernel, dim3(1), dim3(64), nullptr, out.data()),
              "shared-memory race on `s` element 0");
  ExpectError(Launch(ReadWriteRaceKernel, dim3(1), dim3(64), nullptr, out.data()),
              "shared-memory race on `s`");
  ExpectError(Launch(MissingSecondBarrierKernel, dim3(1), dim3(64), nullptr,
                     static_cast<const float*>(f.data()), g.data()),
              "shared-memory race on `buf`");
  ExpectError(Launch(SyncWarpAcrossWarpsKernel, dim3(1), dim3(64), nullptr, out.data()),
              "shared-memory race on `s`");
  ExpectError(Launch(AtomicPlainMixKernel, dim3(1), dim3(64), nullptr, out.data()),
              "shared-memory race on `s`");
  ExpectError(Launch(UninitialisedReadKernel, dim3(1), dim3(32), nullptr, g.data()),
              "read of uninitialised shared memory");
  ExpectError(Launch(OutOfBoundsKernel, dim3(1), dim3(64), nullptr, g.data()), "index out of bounds");
  // The layer is usable again after a failed launch.
  REQUIRE(Launch(SyncWarpKernel, dim3(1), dim3(32), nullptr, out.data()).ok());
}

TEST_CASE("host exec: divergent barriers and warp collectives are detected", "[gpu_replay][host_exec]") {
  std::vector<int> out(64);
  std::vector<float> f(64);
  ExpectError(Launch(DivergentBarrierKernel, dim3(1), dim3(64), nullptr, out.data()),
              "divergent __syncthreads");
  ExpectError(Launch(BarrierSitesKernel, dim3(1), dim3(64), nullptr, out.data()), "divergent __syncthreads");
  ExpectError(Launch(EarlyExitBarrierKernel, dim3(1), dim3(64), nullptr, out.data()), "exited");
  ExpectError(Launch(ExitedLaneShuffleKernel, dim3(1), dim3(32), nullptr, f.data()), "exited");
  ExpectError(Launch(LaneNotInMaskKernel, dim3(1), dim3(32), nullptr, out.data()), "not in the mask");
  ExpectError(Launch(PartialWarpMaskKernel, dim3(1), dim3(48), nullptr, f.data()), "do not exist");
  ExpectError(Launch(SourceNotInMaskKernel, dim3(1), dim3(32), nullptr, out.data()), "reads lane 9");
}

TEST_CASE("host exec: deadlocks and livelocks are errors, not hangs", "[gpu_replay][host_exec]") {
  std::vector<int> out(64);
  ExpectError(Launch(ShuffleDeadlockKernel, dim3(1), dim3(64), nullptr, out.data()), "deadlock");
  LaunchOptions o;
  o.timeout_s = 0.3;
  o.yield_every = 64;
  ScopedLaunchOptions scoped(o);
  ExpectError(Launch(SpinKernel, dim3(1), dim3(32), nullptr, out.data()), "timeout");
}

TEST_CASE("host exec: invalid launches and misaligned vector loads are rejected", "[gpu_replay][host_exec]") {
  std::vector<int> out(2048);
  CHECK(Launch(IndexKernel, dim3(0), dim3(32), nullptr, out.data()).code() == StatusCode::kInvalidArgument);
  CHECK(Launch(IndexKernel, dim3(1), dim3(2048), nullptr, out.data()).code() == StatusCode::kInvalidArgument);
  std::vector<int4> in(4, int4{1, 2, 3, 4});  // 16-byte aligned
  const int* base = &in[0].x;
  ExpectError(Launch(MisalignedLoadKernel, dim3(1), dim3(2), nullptr, base, out.data()),
              "misaligned 16-byte");
}

namespace {
// A host vector whose data() is 32-byte aligned (WMMA tiles in global memory).
template <typename T>
struct Aligned32 {
  std::vector<T> buf;
  size_t off = 0;
  explicit Aligned32(size_t n) : buf(n + 32) {
    while (reinterpret_cast<uintptr_t>(buf.data() + off) % 32 != 0) ++off;
  }
  T* data() { return buf.data() + off; }
  T& operator[](size_t i) { return buf[off + i]; }
};

// C = A B + C0 on the host layer's WMMA vs a scalar loop (fp32, k in order: the emulation's order, so equal).
template <typename T, typename LB>
void CheckWmmaGemm(int m, int n, int k) {
  INFO("M " << m << " N " << n << " K " << k << (std::is_same_v<T, F16> ? " fp16" : " bf16")
            << (std::is_same_v<LB, wmma::row_major> ? " B row-major" : " B col-major"));
  const bool b_row = std::is_same_v<LB, wmma::row_major>;
  std::vector<T> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n);
  Aligned32<float> c0(static_cast<size_t>(m) * n), c(static_cast<size_t>(m) * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = FromF<T>(HashUniform(1, i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = FromF<T>(HashUniform(2, i));
  for (int i = 0; i < m * n; ++i) c0[i] = HashUniform(3, i);
  REQUIRE(Launch(WmmaGemmKernel<T, LB>, dim3(n / 16, m / 16), dim3(32), nullptr,
                 static_cast<const T*>(a.data()), static_cast<const T*>(b.data()),
                 static_cast<const float*>(c0.data()), c.data(), m, n, k)
              .ok());
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float want = c0[static_cast<size_t>(j) * m + i];  // column-major C0
      for (int q = 0; q < k; ++q)
        want += ToF(a[static_cast<size_t>(i) * k + q]) *
                ToF(b_row ? b[static_cast<size_t>(q) * n + j] : b[static_cast<size_t>(j) * k + q]);
      REQUIRE(c[static_cast<size_t>(i) * n + j] == want);
    }
}
}  // namespace

TEST_CASE("host exec: WMMA 16x16x16 and 32x48x32 GEMMs match a scalar loop", "[gpu_replay][host_exec]") {
  hx::CurrentStats() = {};
  CheckWmmaGemm<F16, wmma::row_major>(16, 16, 16);
  CheckWmmaGemm<BF16, wmma::col_major>(16, 16, 16);
  CheckWmmaGemm<F16, wmma::col_major>(32, 48, 32);
  CheckWmmaGemm<BF16, wmma::row_major>(32, 48, 32);
  CHECK(hx::CurrentStats().warp_collectives > 0);
  CHECK(hx::CurrentStats().shared_accesses > 0);
  std::vector<float> out(32);
  REQUIRE(Launch(WmmaElementwiseKernel, dim3(1), dim3(32), nullptr, out.data()).ok());
  for (float x : out) CHECK(x == 3.0f);
}

TEST_CASE("host exec: WMMA misuse is detected", "[gpu_replay][host_exec]") {
  std::vector<float> out(32);
  Aligned32<F16> src(32 * 16);
  for (int i = 0; i < 32 * 16; ++i) src[i] = FromF<F16>(1.0f);
  const F16* p = src.data();
  ExpectError(Launch(WmmaHalfWarpKernel, dim3(1), dim3(32), nullptr, out.data()),
              "exited while lanes 0x0000ffff wait in wmma::mma_sync");
  ExpectError(Launch(WmmaPartialWarpKernel, dim3(1), dim3(16), nullptr, out.data()), "do not exist");
  ExpectError(Launch(WmmaNonUniformKernel, dim3(1), dim3(32), nullptr, p, out.data()),
              "pass different arguments or fragments");
  ExpectError(Launch(WmmaLaneDependentKernel, dim3(1), dim3(32), nullptr, out.data()),
              "pass different arguments or fragments");
  ExpectError(Launch(WmmaStoreRaceKernel, dim3(1), dim3(32), nullptr, out.data()),
              "shared-memory race on `cs`");
  ExpectError(Launch(WmmaOutOfBoundsKernel, dim3(1), dim3(32), nullptr, out.data()), "out of bounds");
  ExpectError(Launch(WmmaMisalignedKernel, dim3(1), dim3(32), nullptr, p, out.data()), "32-byte aligned");
}

}  // namespace kvsim::gpu_replay::host
