#pragma once
// Host execution layer: the CUDA subset gpu_replay's kernels use, for the host compiler, so that the SAME
// kernel source (gpu_replay/*.cuh, through gpu_replay/device_common.cuh) runs on the CPU and can be checked
// against the CPU reference. Not a CUDA emulator in general: no timing, no memory coalescing, no real warp
// scheduling (docs/gpu-replay.md, "CPU verification (host execution layer)").
//
// Execution model. A launch runs its blocks one after another; a block runs one fiber (Boost.Context) per
// CUDA thread on the calling OS thread, cooperatively: a fiber runs until it waits (__syncthreads, a warp
// collective), exits, or has made `yield_every` shared-memory / atomic accesses (so spin loops progress).
// The scheduler resumes the ready fibers round-robin; when none is ready and some are not done, the block is
// deadlocked and the launch fails with a description of where every thread waits. A wall-clock timeout per
// launch turns livelocks into errors.
//
// Checks (each makes the launch return an error Status naming the block, threads and source line):
//   * __syncthreads: every thread of the block must reach the same call site; a thread that exits while
//     others wait at a barrier (or before they reach one) is a divergent barrier;
//   * warp collectives (__shfl*_sync, __ballot_sync, __any_sync, __all_sync, __syncwarp): the calling lane
//     must be in the mask, the mask may only name existing, non-exited lanes, all lanes of the mask must
//     meet at the same call site and intrinsic, and a shuffle's source lane must be in the mask;
//   * shared memory (declared with KVSIM_SHARED): per byte, the accesses since the last __syncthreads;
//     two threads touching a byte, at least one writing, with no barrier between (atomics among themselves
//     excepted; a full-warp __syncwarp orders the lanes of one warp) is a race; reading a byte never
//     written in this block is an uninitialised read; indices are bounds-checked;
//   * tensor cores (nvcuda::wmma, at the end of this file): load/store_matrix_sync and mma_sync are
//     collectives of the full warp with warp-uniform arguments and fragments; tiles must be 32-byte aligned
//     and inside their shared array; their shared-memory reads and writes go through the checks above.
// Global memory is plain host memory: AddressSanitizer (make asan-test) checks its bounds.

#if defined(__CUDACC__)
#error "gpu_replay/host_exec.h is for the host compiler; nvcc uses the CUDA headers"
#endif

// <cmath> first: glibc declares __expf / __logf, which are macros below.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "gpu_replay/dtype.h"
#include "sim/status.h"

// ---- CUDA's built-in types (global namespace, as in CUDA) ----
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct KvsimHostStream;
using cudaStream_t = KvsimHostStream*;
inline constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace kvsim::gpu_replay::hx {

// 16-bit storage types (bits as in CUDA's __half / __nv_bfloat16; converted with gpu_replay/dtype.h).
struct Half {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};

struct LaunchOptions {
  double timeout_s = 60;   // wall clock per launch; exceeded = error (livelock / hang)
  int yield_every = 4096;  // shared / atomic accesses after which a running fiber yields
  bool check_shared = true;
};
// The options of launches from this OS thread; Scoped* sets them for a scope.
LaunchOptions& CurrentOptions();
class ScopedLaunchOptions {
 public:
  explicit ScopedLaunchOptions(const LaunchOptions& o) : saved_(CurrentOptions()) { CurrentOptions() = o; }
  ~ScopedLaunchOptions() { CurrentOptions() = saved_; }

 private:
  LaunchOptions saved_;
};

// Counters of what the checks saw (this OS thread; tests reset and read them).
struct Stats {
  int64_t launches = 0, blocks = 0, threads = 0;
  int64_t shared_accesses = 0, barriers = 0, warp_collectives = 0, atomics = 0;
};
Stats& CurrentStats();

struct ThreadInfo {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
// The CUDA thread running on this OS thread (only valid inside a kernel).
extern thread_local const ThreadInfo* g_current_thread;
inline const ThreadInfo& Current() { return *g_current_thread; }

// Runs body() as every thread of every block; the first error ends the launch.
Status RunGrid(dim3 grid, dim3 block, const std::function<void()>& body);

template <typename... P, typename... A>
Status LaunchKernel(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  return RunGrid(grid, block, [&] { std::apply(kernel, params); });  // each thread copies the params
}

// ---- Synchronisation and warp collectives (fiber side) ----
void SyncThreads(const char* file, int line);
// kUniform: every lane of the mask must pass the same payload (a warp-uniform argument), else an error.
enum class WarpOp : uint8_t { kShuffle, kVote, kSyncWarp, kUniform };
// All lanes of `mask` exchange `payload`; returns lane `src`'s payload (kShuffle) or the ballot (kVote).
uint64_t WarpCollective(WarpOp op, const char* what, unsigned mask, uint64_t payload, int src,
                        const char* file, int line);

template <typename T>
T ShflFrom(unsigned mask, T v, int src, const char* what, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of a type > 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = WarpCollective(WarpOp::kShuffle, what, mask, bits, src, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
int Lane();  // lane of the running thread (linear thread index % 32, as CUDA numbers warps)
template <typename T>
T ShflSync(unsigned mask, T v, int src_lane, int width, const char* file, int line) {
  const int lane = Lane(), base = lane / width * width;
  return ShflFrom(mask, v, base + src_lane % width, "__shfl_sync", file, line);
}
template <typename T>
T ShflXorSync(unsigned mask, T v, int lane_mask, int width, const char* file, int line) {
  const int lane = Lane(), base = lane / width * width;
  int src = lane ^ lane_mask;
  if (src >= base + width) src = lane;  // CUDA: a later group's lane gives the caller's own value
  return ShflFrom(mask, v, src, "__shfl_xor_sync", file, line);
}
template <typename T>
T ShflDownSync(unsigned mask, T v, unsigned delta, int width, const char* file, int line) {
  const int lane = Lane(), base = lane / width * width;
  int src = lane + static_cast<int>(delta);
  if (src >= base + width) src = lane;
  return ShflFrom(mask, v, src, "__shfl_down_sync", file, line);
}
template <typename T>
T ShflUpSync(unsigned mask, T v, unsigned delta, int width, const char* file, int line) {
  const int lane = Lane(), base = lane / width * width;
  int src = lane - static_cast<int>(delta);
  if (src < base) src = lane;
  return ShflFrom(mask, v, src, "__shfl_up_sync", file, line);
}
inline unsigned BallotSync(unsigned mask, int pred, const char* what, const char* file, int line) {
  return static_cast<unsigned>(WarpCollective(WarpOp::kVote, what, mask, pred != 0, -1, file, line));
}
inline void SyncWarp(unsigned mask, const char* file, int line) {
  WarpCollective(WarpOp::kSyncWarp, "__syncwarp", mask, 0, -1, file, line);
}

// ---- Shared memory ----
struct SharedVar;
enum class AccessKind : uint8_t { kRead, kWrite, kAtomic };
SharedVar* GetShared(const void* key, size_t bytes, size_t elem_bytes, const char* name);
void* SharedData(SharedVar* v);
void SharedAccess(SharedVar* v, const void* p, size_t bytes, AccessKind kind);
[[noreturn]] void SharedOutOfBounds(SharedVar* v, long long index, size_t extent);
// An atomic on `p`: recorded when p is in the block's shared memory (global atomics need no record).
void AtomicAccess(const void* p, size_t bytes);

// One element of a shared array: reads and writes go through the access checks.
template <typename T>
class SharedRef {
 public:
  SharedRef(SharedVar* v, T* p) : v_(v), p_(p) {}
  SharedRef(const SharedRef&) = default;
  operator T() const {
    SharedAccess(v_, p_, sizeof(T), AccessKind::kRead);
    return *p_;
  }
  const SharedRef& operator=(const T& x) const {
    SharedAccess(v_, p_, sizeof(T), AccessKind::kWrite);
    *p_ = x;
    return *this;
  }
  const SharedRef& operator=(const SharedRef& o) const { return *this = static_cast<T>(o); }
  template <typename U>
  const SharedRef& operator+=(const U& x) const {
    return *this = static_cast<T>(static_cast<T>(*this) + x);
  }
  template <typename U>
  const SharedRef& operator-=(const U& x) const {
    return *this = static_cast<T>(static_cast<T>(*this) - x);
  }
  template <typename U>
  const SharedRef& operator*=(const U& x) const {
    return *this = static_cast<T>(static_cast<T>(*this) * x);
  }
  template <typename U>
  const SharedRef& operator|=(const U& x) const {
    return *this = static_cast<T>(static_cast<T>(*this) | x);
  }
  const SharedRef& operator++() const { return *this += 1; }
  T operator++(int) const {
    const T old = *this;
    *this = static_cast<T>(old + 1);
    return old;
  }
  // The raw address (for atomics, which look it up and record an atomic access).
  T* operator&() const { return p_; }

 private:
  SharedVar* v_;
  T* p_;
};

// A shared array (or a sub-array of one): operator[] is bounds-checked and yields SharedRef elements.
template <typename A>
class SharedView {
  using E = std::remove_extent_t<A>;
  static constexpr size_t kExtent = std::extent_v<A>;

 public:
  SharedView(SharedVar* v, A* p) : v_(v), p_(p) {}
  template <typename I>
  auto operator[](I i) const {
    static_assert(std::is_integral_v<I>, "shared array index");
    bool bad = static_cast<unsigned long long>(i) >= kExtent;
    if constexpr (std::is_signed_v<I>) bad = bad || i < 0;
    if (bad) SharedOutOfBounds(v_, static_cast<long long>(i), kExtent);
    if constexpr (std::is_array_v<E>) {
      return SharedView<E>(v_, &(*p_)[i]);
    } else {
      return SharedRef<E>(v_, &(*p_)[i]);
    }
  }

 private:
  SharedVar* v_;
  A* p_;
};

// KVSIM_SHARED(type, name, dims) on the host: the block's instance of the declaration `key`.
template <typename A>
auto DeclareShared(const void* key, const char* name) {
  static_assert(std::is_trivially_copyable_v<std::remove_all_extents_t<A>>, "shared type");
  SharedVar* v = GetShared(key, sizeof(A), sizeof(std::remove_all_extents_t<A>), name);
  A* p = static_cast<A*>(SharedData(v));
  if constexpr (std::is_array_v<A>) {
    return SharedView<A>(v, p);
  } else {
    return SharedRef<A>(v, p);
  }
}

// A vector load of `bytes` (16 = uint4 / float4 / int4) from global memory: fails the launch when p is not
// aligned to `bytes`, as the GPU would fault (misaligned address).
void VectorLoad(void* dst, const void* p, size_t bytes);

// ---- Tensor-core matrix operations (nvcuda::wmma, below) ----
// The rendezvous of a WMMA call: a collective of the full warp (every lane must call it, at the same site)
// whose lanes must all pass the same `uniform` value (a hash of the pointer, ldm, layout and the fragments'
// contents). It does not order shared-memory accesses (no __syncwarp).
void WmmaRendezvous(const char* what, uint64_t uniform, const std::source_location& loc);
// A tile's base pointer and leading dimension: fails unless p is 32-byte aligned and ldm * elem_bytes is a
// multiple of 16 bytes (CUDA's requirements for load/store_matrix_sync), and unless a tile starting in a
// shared array ends in it.
void WmmaCheckTile(const char* what, const void* p, unsigned ldm, size_t elem_bytes);
// `bytes` at p read or written by the running lane: in the block's shared memory the access goes through
// the race / initialisation checks; global memory is not recorded (AddressSanitizer checks its bounds).
void WmmaAccess(const void* p, size_t bytes, AccessKind kind);
inline uint64_t HashBytes(uint64_t h, const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;  // FNV-1a
  return h;
}
inline float WmmaToF(float x) { return x; }
inline float WmmaToF(Half x) { return HalfToFloat(x.bits); }
inline float WmmaToF(Bf16 x) { return Bf16ToFloat(x.bits); }

// ---- Math intrinsics ----
inline float Expf(float x) { return std::exp(x); }
inline float Logf(float x) { return std::log(x); }
inline float Rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline uint32_t FloatAsUint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float UintAsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- Atomics (the fibers of a block run on one OS thread, one at a time: a plain read-modify-write is
// atomic here) ----
template <typename T, typename F>
T AtomicRmw(T* p, F f) {
  AtomicAccess(p, sizeof(T));
  const T old = *p;
  *p = f(old);
  return old;
}

}  // namespace kvsim::gpu_replay::hx

#define threadIdx (::kvsim::gpu_replay::hx::Current().thread_idx)
#define blockIdx (::kvsim::gpu_replay::hx::Current().block_idx)
#define blockDim (::kvsim::gpu_replay::hx::Current().block_dim)
#define gridDim (::kvsim::gpu_replay::hx::Current().grid_dim)

#define __syncthreads() ::kvsim::gpu_replay::hx::SyncThreads(__FILE__, __LINE__)
#define __syncwarp(...) ::kvsim::gpu_replay::hx::SyncWarp(KVSIM_HX_MASK(__VA_ARGS__), __FILE__, __LINE__)
#define KVSIM_HX_MASK(...) KVSIM_HX_MASK_I(__VA_ARGS__ __VA_OPT__(, ) 0xffffffffu, )
#define KVSIM_HX_MASK_I(m, ...) (m)
#define KVSIM_HX_W(a, b, c, w, ...) (w)
#define __shfl_sync(m, v, s, ...) \
  ::kvsim::gpu_replay::hx::ShflSync(m, v, s, KVSIM_HX_W(m, v, s, ##__VA_ARGS__, 32), __FILE__, __LINE__)
#define __shfl_xor_sync(m, v, s, ...) \
  ::kvsim::gpu_replay::hx::ShflXorSync(m, v, s, KVSIM_HX_W(m, v, s, ##__VA_ARGS__, 32), __FILE__, __LINE__)
#define __shfl_down_sync(m, v, s, ...) \
  ::kvsim::gpu_replay::hx::ShflDownSync(m, v, s, KVSIM_HX_W(m, v, s, ##__VA_ARGS__, 32), __FILE__, __LINE__)
#define __shfl_up_sync(m, v, s, ...) \
  ::kvsim::gpu_replay::hx::ShflUpSync(m, v, s, KVSIM_HX_W(m, v, s, ##__VA_ARGS__, 32), __FILE__, __LINE__)
#define __ballot_sync(m, p) ::kvsim::gpu_replay::hx::BallotSync(m, p, "__ballot_sync", __FILE__, __LINE__)
#define __any_sync(m, p) (::kvsim::gpu_replay::hx::BallotSync(m, p, "__any_sync", __FILE__, __LINE__) != 0u)
#define __all_sync(m, p) \
  (::kvsim::gpu_replay::hx::BallotSync(m, p, "__all_sync", __FILE__, __LINE__) == static_cast<unsigned>(m))

#define __expf(x) ::kvsim::gpu_replay::hx::Expf(x)
#define __logf(x) ::kvsim::gpu_replay::hx::Logf(x)
#define rsqrtf(x) ::kvsim::gpu_replay::hx::Rsqrtf(x)
#define __float_as_uint(x) ::kvsim::gpu_replay::hx::FloatAsUint(x)
#define __uint_as_float(x) ::kvsim::gpu_replay::hx::UintAsFloat(x)

template <typename T>
inline T atomicAdd(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return static_cast<T>(old + v); });
}
template <typename T>
inline T atomicMax(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return old < v ? v : old; });
}
template <typename T>
inline T atomicMin(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return v < old ? v : old; });
}
template <typename T>
inline T atomicExch(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T) { return v; });
}
template <typename T>
inline T atomicXor(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return static_cast<T>(old ^ v); });
}
template <typename T>
inline T atomicOr(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return static_cast<T>(old | v); });
}
template <typename T>
inline T atomicAnd(T* p, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [v](T old) { return static_cast<T>(old & v); });
}
template <typename T>
inline T atomicCAS(T* p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  return ::kvsim::gpu_replay::hx::AtomicRmw(p, [=](T old) { return old == compare ? v : old; });
}

// ---- nvcuda::wmma on the host: warp-level 16x16x16 matrix multiply-accumulate ----
// The API of CUDA's <mma.h> for the 16x16x16 shape, fp16 / bf16 inputs and fp32 accumulators. Every call of
// load_matrix_sync, store_matrix_sync and mma_sync is a warp collective (hx::WmmaRendezvous: all 32 lanes,
// same call site, same arguments; missing or exited lanes, partial warps and divergent calls are errors).
// Element layout (own, not the GPU's, which CUDA leaves unspecified): every lane holds the whole tile,
// x[r * 16 + c] (num_elements = 256), computed redundantly; element-wise code must treat all elements alike
// (a lane-dependent change makes the lanes' fragments differ, an error at the next mma/store). A store
// writes, per lane, its own 8 elements x[8 * lane .. 8 * lane + 7]: reading them in another lane needs a
// __syncwarp, as on the GPU. mma_sync multiplies in fp32 (products of fp16 / bf16 values are exact) and
// adds in k order, one rounding per add.
namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "host WMMA: only the 16x16x16 shape");
  static constexpr bool k16 =
      std::is_same_v<T, ::kvsim::gpu_replay::hx::Half> || std::is_same_v<T, ::kvsim::gpu_replay::hx::Bf16>;
  static constexpr bool kMajor = std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>;
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> && std::is_void_v<Layout>
                                                 : k16 && kMajor,
                "host WMMA: fp16 / bf16 matrix_a / matrix_b with row_major / col_major, fp32 accumulator");

 public:
  using element_type = T;
  static constexpr int num_elements = 256;
  T x[num_elements];
};

namespace detail {
template <typename F>
uint64_t Contents(uint64_t h, const F& f) {
  return ::kvsim::gpu_replay::hx::HashBytes(h, f.x, sizeof f.x);
}
// Element (i, j) of a 16x16 tile at p: row-major p[i * ldm + j], column-major p[j * ldm + i]; every lane
// reads all of it (16 contiguous runs of 16 elements).
template <typename T>
void LoadTile(const char* what, T (&x)[256], const T* p, unsigned ldm, bool row_major_mem,
              const std::source_location& loc) {
  namespace hx = ::kvsim::gpu_replay::hx;
  uint64_t u = hx::HashBytes(0xcbf29ce484222325ull, &p, sizeof p);
  u = hx::HashBytes(u, &ldm, sizeof ldm);
  u = hx::HashBytes(u, &row_major_mem, sizeof row_major_mem);
  hx::WmmaRendezvous(what, u, loc);
  hx::WmmaCheckTile(what, p, ldm, sizeof(T));
  for (int line = 0; line < 16; ++line) {
    const T* q = p + static_cast<size_t>(line) * ldm;
    hx::WmmaAccess(q, 16 * sizeof(T), hx::AccessKind::kRead);
    for (int i = 0; i < 16; ++i) x[row_major_mem ? line * 16 + i : i * 16 + line] = q[i];
  }
}
}  // namespace detail

template <typename Use, typename T, typename L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm,
                      std::source_location loc = std::source_location::current()) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
  detail::LoadTile("wmma::load_matrix_sync", f.x, p, ldm, std::is_same_v<L, row_major>, loc);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm,
                             layout_t layout, std::source_location loc = std::source_location::current()) {
  detail::LoadTile("wmma::load_matrix_sync", f.x, p, ldm, layout == mem_row_major, loc);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout, std::source_location loc = std::source_location::current()) {
  namespace hx = ::kvsim::gpu_replay::hx;
  const char* what = "wmma::store_matrix_sync";
  uint64_t u = hx::HashBytes(0xcbf29ce484222325ull, &p, sizeof p);
  u = hx::HashBytes(u, &ldm, sizeof ldm);
  u = hx::HashBytes(u, &layout, sizeof layout);
  hx::WmmaRendezvous(what, detail::Contents(u, f), loc);
  hx::WmmaCheckTile(what, p, ldm, sizeof(float));
  const int lane = hx::Lane();
  for (int e = 8 * lane; e < 8 * lane + 8; ++e) {  // this lane's 8 elements
    const int i = e / 16, j = e % 16;
    float* q =
        p + (layout == mem_row_major ? static_cast<size_t>(i) * ldm + j : static_cast<size_t>(j) * ldm + i);
    hx::WmmaAccess(q, sizeof(float), hx::AccessKind::kWrite);
    *q = f.x[e];
  }
}

// v converted to the fragment's element type (float for accumulators; the 16-bit type itself otherwise).
template <typename Use, typename T, typename L, typename V>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const V& v) {
  for (T& e : f.x) {
    if constexpr (std::is_same_v<T, float>) {
      e = static_cast<float>(v);
    } else {
      e = v;
    }
  }
}

// d = a b + c (d may be c).
template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c,
              std::source_location loc = std::source_location::current()) {
  namespace hx = ::kvsim::gpu_replay::hx;
  hx::WmmaRendezvous("wmma::mma_sync", detail::Contents(detail::Contents(detail::Contents(0, a), b), c), loc);
  float out[256];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float acc = c.x[i * 16 + j];
      for (int k = 0; k < 16; ++k) acc += hx::WmmaToF(a.x[i * 16 + k]) * hx::WmmaToF(b.x[k * 16 + j]);
      out[i * 16 + j] = acc;
    }
  std::memcpy(d.x, out, sizeof out);
}
}  // namespace nvcuda::wmma
