// Host execution layer (gpu_replay/host_exec.h): CUDA thread blocks as Boost.Context fibers, with barrier,
// warp-collective and shared-memory checks.

#include "gpu_replay/host_exec.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KVSIM_HX_ASAN 1
#endif

namespace kvsim::gpu_replay::hx {

thread_local const ThreadInfo* g_current_thread = nullptr;

LaunchOptions& CurrentOptions() {
  thread_local LaunchOptions o;
  return o;
}
Stats& CurrentStats() {
  thread_local Stats s;
  return s;
}

namespace {

namespace bc = boost::context;
using Clock = std::chrono::steady_clock;

struct Abort {};  // unwinds the fibers of a failed launch

#ifdef KVSIM_HX_ASAN
constexpr size_t kStackBytes = 512 << 10;  // ASan frames are larger; pages are touched lazily
#else
constexpr size_t kStackBytes = 128 << 10;
#endif
constexpr int kMaxThreads = 1024;

// Fiber stacks, reused by every block of every launch of this OS thread: mmap'ed, a guard page below each.
class StackPool {
 public:
  ~StackPool() {
    for (const Stack& s : stacks_) munmap(s.map, s.bytes);
  }
  void* Get(size_t i) {
    while (stacks_.size() <= i) {
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE)), bytes = kStackBytes + page;
      void* m =
          mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      KVSIM_CHECK_MSG(m != MAP_FAILED, "host execution layer: cannot map a fiber stack");
      KVSIM_CHECK(mprotect(m, page, PROT_NONE) == 0);
      stacks_.push_back({m, bytes, static_cast<char*>(m) + page});
    }
    return stacks_[i].base;
  }
  void Unpoison() {
#ifdef KVSIM_HX_ASAN
    for (const Stack& s : stacks_) ASAN_UNPOISON_MEMORY_REGION(s.base, kStackBytes);
#endif
  }

 private:
  struct Stack {
    void* map;
    size_t bytes;
    void* base;
  };
  std::vector<Stack> stacks_;
};

struct PoolStackAlloc {
  void* base;
  bc::stack_context allocate() {
    bc::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = static_cast<char*>(base) + kStackBytes;
    return sc;
  }
  void deallocate(bc::stack_context&) noexcept {}
};

enum class St : uint8_t { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  ThreadInfo info{};
  int tid = 0, warp = 0, lane = 0;
  St state = St::kReady;
  const char* what = nullptr;  // where it waits
  const char* file = nullptr;
  int line = 0;
  unsigned mask = 0;
  bc::fiber fib;   // resumes the fiber (while suspended)
  bc::fiber sink;  // resumes the scheduler (while running)
  void* stack = nullptr;
  void* asan_fake = nullptr;
  int accesses = 0;  // since the last yield
};

// One warp collective in progress (per warp and mask); payloads double-buffered by generation parity: a
// lane can be at most one generation ahead of a lane still reading the previous one.
struct WarpColl {
  unsigned mask = 0, arrived = 0;
  uint64_t gen = 0;
  WarpOp op = WarpOp::kShuffle;
  const char* what = nullptr;
  const char* file = nullptr;
  int line = 0;
  uint64_t payload[2][32] = {};
};

// Accesses to one shared byte in the current epoch (the interval between two __syncthreads) of one kind.
struct Acc {
  uint32_t epoch = 0;
  int16_t tid = -1;    // -2: several threads
  int16_t warp = -1;   // -1: several warps
  uint32_t wsync = 0;  // the warp's full __syncwarp count at the (latest) access
};
struct Shadow {
  Acc w, r, a;  // plain writes, plain reads, atomics
  bool init = false;
};

}  // namespace

struct SharedVar {
  const void* key = nullptr;
  const char* name = nullptr;
  size_t bytes = 0, elem = 1;
  // 64-byte aligned (CUDA aligns the kernels' shared arrays to 32 bytes for WMMA tiles, KVSIM_SHARED).
  std::unique_ptr<std::byte, decltype(&std::free)> data{nullptr, &std::free};
  std::vector<Shadow> shadow;
  std::byte* begin() const { return data.get(); }
};

namespace {

struct Block {
  dim3 grid, dim;
  uint3 idx{};
  int nthreads = 0;
  std::vector<Fiber> fibers;
  int at_barrier = 0;  // threads waiting at the current __syncthreads
  const char* bar_file = nullptr;
  int bar_line = 0, bar_tid = 0;
  uint32_t epoch = 1;
  std::vector<uint32_t> warp_sync;
  std::vector<unsigned> exited_lanes;
  std::vector<std::vector<std::unique_ptr<WarpColl>>> colls;
  int exited = 0, first_exited = -1;
  std::vector<std::unique_ptr<SharedVar>> shared;
  bool abort = false;
};

struct Runtime {
  Block block;
  Fiber* cur = nullptr;
  bool in_launch = false;
  std::string error;
  LaunchOptions opts;
  Clock::time_point deadline;
  const std::function<void()>* body = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
  StackPool stacks;
};

Runtime& Rt() {
  thread_local Runtime rt;
  return rt;
}

// ---- A watchdog for kernels that never yield (a loop without shared-memory or atomic accesses): the
// cooperative scheduler cannot preempt them, so the process is aborted with a message instead of hanging.
class Watchdog {
 public:
  static Watchdog& Get() {
    static Watchdog* w = new Watchdog;  // never destroyed: its thread runs until exit
    return *w;
  }
  void Arm(Clock::time_point limit) {
    std::lock_guard<std::mutex> l(mu_);
    limits_.push_back(limit);
    cv_.notify_all();
  }
  void Disarm(Clock::time_point limit) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = std::find(limits_.begin(), limits_.end(), limit);
    if (it != limits_.end()) limits_.erase(it);
  }

 private:
  Watchdog() {
    std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait_for(l, std::chrono::milliseconds(200));
      const Clock::time_point now = Clock::now();
      for (const Clock::time_point t : limits_)
        if (now > t) {
          std::fprintf(stderr,
                       "kvsim host execution layer: a kernel launch ran past its timeout without yielding "
                       "(a loop with no shared-memory access, atomic, barrier or warp collective?); "
                       "aborting instead of hanging\n");
          std::fflush(stderr);
          std::abort();
        }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Clock::time_point> limits_;
};

void AsanStart(void** fake, const void* bottom, size_t size) {
#ifdef KVSIM_HX_ASAN
  __sanitizer_start_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}
void AsanFinish(void* fake, const void** bottom, size_t* size) {
#ifdef KVSIM_HX_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}

std::string Hex(unsigned m) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", m);
  return b;
}
std::string Site(const char* file, int line) {
  return std::string(file ? file : "?") + ":" + std::to_string(line);
}
std::string Dim(const uint3& d) {
  char b[48];
  std::snprintf(b, sizeof b, "(%u,%u,%u)", d.x, d.y, d.z);
  return b;
}
std::string Dim(const dim3& d) { return Dim(uint3{d.x, d.y, d.z}); }
bool SameSite(const char* f1, int l1, const char* f2, int l2) {
  return l1 == l2 && (f1 == f2 || std::strcmp(f1, f2) == 0);
}

// Records the first error of the launch and makes every unfinished fiber ready: when resumed, each throws
// Abort (or, not started yet, returns at once).
void SetError(Runtime& rt, const std::string& msg) {
  Block& b = rt.block;
  if (rt.error.empty())
    rt.error = "host execution layer: " + msg + " [block " + Dim(b.idx) + " of grid " + Dim(b.grid) +
               ", block dim " + Dim(b.dim) + "]";
  b.abort = true;
  for (Fiber& o : b.fibers)
    if (o.state != St::kDone) o.state = St::kReady;
}
[[noreturn]] void Fail(const std::string& msg) {
  SetError(Rt(), msg);
  throw Abort{};
}

Fiber& Cur(const char* what) {
  Runtime& rt = Rt();
  KVSIM_CHECK_MSG(rt.cur != nullptr,
                  std::string(what) + " called outside a kernel launched on the host layer");
  return *rt.cur;
}

// Fiber side: back to the scheduler until resumed; throws Abort if the launch failed meanwhile.
void Suspend(Runtime& rt, Fiber& f) {
  AsanStart(&f.asan_fake, rt.main_bottom, rt.main_size);
  f.sink = std::move(f.sink).resume();
  AsanFinish(f.asan_fake, nullptr, nullptr);
  if (rt.block.abort) throw Abort{};
}

void CountAccess(Runtime& rt, Fiber& f) {
  if (++f.accesses >= rt.opts.yield_every) {
    f.accesses = 0;
    Suspend(rt, f);  // stays ready: lets spin loops on shared memory / atomics make progress
  }
}

void FiberExit(Runtime& rt, Fiber& f) {
  Block& b = rt.block;
  f.state = St::kDone;
  ++b.exited;
  b.exited_lanes[f.warp] |= 1u << f.lane;
  if (b.first_exited < 0) b.first_exited = f.tid;
  if (b.abort) return;
  if (b.at_barrier > 0) {
    SetError(rt, "divergent __syncthreads: thread " + std::to_string(f.tid) + " exited while " +
                     std::to_string(b.at_barrier) + " thread(s) wait at __syncthreads (" +
                     Site(b.bar_file, b.bar_line) + ")");
    return;
  }
  for (const auto& c : b.colls[f.warp])
    if (c->arrived != 0 && (c->mask >> f.lane & 1u)) {
      SetError(rt, "lane " + std::to_string(f.lane) + " of warp " + std::to_string(f.warp) + " (thread " +
                       std::to_string(f.tid) + ") exited while lanes " + Hex(c->arrived) + " wait in " +
                       c->what + " with mask " + Hex(c->mask) + " (" + Site(c->file, c->line) + ")");
      return;
    }
}

void Resume(Runtime& rt, Fiber& f) {
  rt.cur = &f;
  g_current_thread = &f.info;
  void* fake = nullptr;
  AsanStart(&fake, f.stack, kStackBytes);
  f.fib = std::move(f.fib).resume();
  AsanFinish(fake, nullptr, nullptr);
  rt.cur = nullptr;
  g_current_thread = nullptr;
}

std::string Describe(const Fiber& f) {
  switch (f.state) {
    case St::kDone:
      return "exited";
    case St::kReady:
      return "running";
    case St::kBarrier:
      return std::string("wait at __syncthreads (") + Site(f.file, f.line) + ")";
    case St::kWarp:
      return std::string("wait in ") + f.what + " with mask " + Hex(f.mask) + " (" + Site(f.file, f.line) +
             ")";
  }
  return "?";
}

std::string DescribeDeadlock(const Block& b) {
  std::string out = "deadlock: no thread of the block can proceed; ";
  for (int i = 0; i < b.nthreads;) {
    const std::string d = Describe(b.fibers[i]);
    int j = i + 1;
    while (j < b.nthreads && Describe(b.fibers[j]) == d) ++j;
    if (i > 0) out += "; ";
    out += (j - i == 1 ? "thread " + std::to_string(i)
                       : "threads " + std::to_string(i) + "-" + std::to_string(j - 1)) +
           ": " + d;
    i = j;
  }
  return out;
}

void RunBlock(Runtime& rt) {
  Block& b = rt.block;
  const int n = b.nthreads;
  b.fibers.resize(n);
  const int nwarps = (n + 31) / 32;
  b.at_barrier = 0;
  b.epoch = 1;
  b.warp_sync.assign(nwarps, 0);
  b.exited_lanes.assign(nwarps, 0);
  b.colls.clear();
  b.colls.resize(nwarps);
  b.exited = 0;
  b.first_exited = -1;
  b.shared.clear();
  b.abort = false;
  for (int t = 0; t < n; ++t) {
    Fiber& f = b.fibers[t];
    f.info.thread_idx = uint3{t % b.dim.x, t / b.dim.x % b.dim.y, t / (b.dim.x * b.dim.y)};
    f.info.block_idx = b.idx;
    f.info.block_dim = b.dim;
    f.info.grid_dim = b.grid;
    f.tid = t;
    f.warp = t / 32;
    f.lane = t % 32;
    f.state = St::kReady;
    f.what = f.file = nullptr;
    f.line = 0;
    f.accesses = 0;
    f.asan_fake = nullptr;
    f.stack = rt.stacks.Get(t);
    Fiber* fp = &f;
    f.fib = bc::fiber(std::allocator_arg, PoolStackAlloc{f.stack}, [&rt, fp](bc::fiber&& sink) -> bc::fiber {
      AsanFinish(nullptr, &rt.main_bottom, &rt.main_size);
      fp->sink = std::move(sink);
      if (!rt.block.abort) {
        try {
          (*rt.body)();
        } catch (const Abort&) {
        }
      }
      FiberExit(rt, *fp);
      AsanStart(nullptr, rt.main_bottom, rt.main_size);  // this fiber ends
      return std::move(fp->sink);
    });
  }
  CurrentStats().blocks++;
  CurrentStats().threads += n;
  for (;;) {
    bool progressed = false, alive = false;
    for (Fiber& f : b.fibers) {
      if (f.state == St::kReady) {
        Resume(rt, f);
        progressed = true;
      }
      alive = alive || f.state != St::kDone;
    }
    if (!alive) break;
    if (!progressed) {
      SetError(rt, DescribeDeadlock(b));
    } else if (!b.abort && Clock::now() > rt.deadline) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.3g", rt.opts.timeout_s);
      SetError(rt,
               std::string("timeout: the launch ran longer than ") + buf + " s (livelock?); " +
                   DescribeDeadlock(b).substr(std::strlen("deadlock: no thread of the block can proceed; ")));
    }
  }
  b.shared.clear();
}

[[noreturn]] void RaceError(const SharedVar& v, size_t byte, const Fiber& f, const char* doing,
                            const Acc& other, const char* did) {
  const std::string who =
      other.tid >= 0 ? "thread " + std::to_string(other.tid) : std::string("other threads");
  Fail("shared-memory race on `" + std::string(v.name) + "` element " + std::to_string(byte / v.elem) +
       " (byte " + std::to_string(byte) + " of " + std::to_string(v.bytes) + "): thread " +
       std::to_string(f.tid) + " " + doing + " it, " + who + " " + did +
       " it since the last __syncthreads, with no barrier between");
}

}  // namespace

int Lane() { return Cur("a warp intrinsic").lane; }

Status RunGrid(dim3 grid, dim3 block, const std::function<void()>& body) {
  Runtime& rt = Rt();
  if (rt.in_launch) return Status::FailedPrecondition("host execution layer: kernel launch from a kernel");
  const int64_t threads = static_cast<int64_t>(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads <= 0 || threads > kMaxThreads || block.z > 64 ||
      grid.y > 65535 || grid.z > 65535)
    return Status::InvalidArgument("host execution layer: invalid launch configuration (grid " + Dim(grid) +
                                   ", block " + Dim(block) + ")");
  rt.in_launch = true;
  rt.opts = CurrentOptions();
  rt.error.clear();
  rt.body = &body;
  const Clock::time_point start = Clock::now();
  rt.deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(rt.opts.timeout_s));
  const Clock::time_point hard =
      rt.deadline + std::chrono::seconds(5) +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(rt.opts.timeout_s));
  Watchdog::Get().Arm(hard);
  CurrentStats().launches++;
  rt.block.grid = grid;
  rt.block.dim = block;
  rt.block.nthreads = static_cast<int>(threads);
  for (unsigned z = 0; z < grid.z && rt.error.empty(); ++z)
    for (unsigned y = 0; y < grid.y && rt.error.empty(); ++y)
      for (unsigned x = 0; x < grid.x && rt.error.empty(); ++x) {
        rt.block.idx = uint3{x, y, z};
        RunBlock(rt);
      }
  Watchdog::Get().Disarm(hard);
  rt.in_launch = false;
  rt.body = nullptr;
  if (!rt.error.empty()) {
    rt.stacks.Unpoison();  // unwound frames
    return Status::Internal(rt.error);
  }
  return Status::Ok();
}

void SyncThreads(const char* file, int line) {
  Runtime& rt = Rt();
  Fiber& f = Cur("__syncthreads");
  Block& b = rt.block;
  CurrentStats().barriers++;
  if (b.exited > 0)
    Fail("divergent __syncthreads (" + Site(file, line) + "): thread " + std::to_string(f.tid) +
         " arrives after thread " + std::to_string(b.first_exited) + " exited");
  if (b.at_barrier == 0) {
    b.bar_file = file;
    b.bar_line = line;
    b.bar_tid = f.tid;
  } else if (!SameSite(b.bar_file, b.bar_line, file, line)) {
    Fail("divergent __syncthreads: thread " + std::to_string(b.bar_tid) + " waits at " +
         Site(b.bar_file, b.bar_line) + ", thread " + std::to_string(f.tid) + " arrives at " +
         Site(file, line));
  }
  f.state = St::kBarrier;
  f.file = file;
  f.line = line;
  if (++b.at_barrier == b.nthreads) {
    b.at_barrier = 0;
    ++b.epoch;
    for (Fiber& o : b.fibers)
      if (o.state == St::kBarrier) o.state = St::kReady;
    return;
  }
  while (f.state == St::kBarrier) Suspend(rt, f);
}

uint64_t WarpCollective(WarpOp op, const char* what, unsigned mask, uint64_t payload, int src,
                        const char* file, int line) {
  Runtime& rt = Rt();
  Fiber& f = Cur(what);
  Block& b = rt.block;
  CurrentStats().warp_collectives++;
  const unsigned bit = 1u << f.lane;
  const int lanes = std::min(32, b.nthreads - f.warp * 32);
  const unsigned existing = lanes == 32 ? ~0u : (1u << lanes) - 1;
  const std::string at = std::string(what) + " (" + Site(file, line) + ") with mask " + Hex(mask) + ": ";
  if (!(mask & bit))
    Fail(at + "the calling lane " + std::to_string(f.lane) + " (thread " + std::to_string(f.tid) +
         ") is not in the mask");
  if (mask & ~existing)
    Fail(at + "the mask names lanes " + Hex(mask & ~existing) + " that do not exist (warp " +
         std::to_string(f.warp) + " has " + std::to_string(lanes) + " lanes)");
  if (mask & b.exited_lanes[f.warp])
    Fail(at + "the mask names exited lanes " + Hex(mask & b.exited_lanes[f.warp]) + " of warp " +
         std::to_string(f.warp));
  if (op == WarpOp::kShuffle && (src < 0 || src >= 32 || !(mask >> src & 1u)))
    Fail(at + "lane " + std::to_string(f.lane) + " reads lane " + std::to_string(src) +
         ", which is not in the mask");
  WarpColl* c = nullptr;
  for (const auto& p : b.colls[f.warp])
    if (p->mask == mask) c = p.get();
  if (!c) {
    b.colls[f.warp].push_back(std::make_unique<WarpColl>());
    c = b.colls[f.warp].back().get();
    c->mask = mask;
  }
  if (c->arrived == 0) {
    c->op = op;
    c->what = what;
    c->file = file;
    c->line = line;
  } else if (c->op != op || std::strcmp(c->what, what) != 0 || !SameSite(c->file, c->line, file, line)) {
    Fail("divergent warp collective in warp " + std::to_string(f.warp) + ": lanes " + Hex(c->arrived) +
         " wait in " + c->what + " (" + Site(c->file, c->line) + "), lane " + std::to_string(f.lane) +
         " calls " + what + " (" + Site(file, line) + ") with the same mask " + Hex(mask));
  }
  const uint64_t gen = c->gen;
  const int parity = static_cast<int>(gen & 1);
  c->payload[parity][f.lane] = payload;
  c->arrived |= bit;
  if (c->arrived == mask) {
    if (op == WarpOp::kUniform)  // every lane must have passed the same value
      for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && c->payload[parity][l] != payload)
          Fail(std::string(what) + " (" + Site(file, line) + "): lanes " + std::to_string(l) + " and " +
               std::to_string(f.lane) + " of warp " + std::to_string(f.warp) +
               " pass different arguments or fragments (they must be warp-uniform; a fragment's element "
               "layout is unspecified, so element-wise code must treat every element alike)");
    c->arrived = 0;
    ++c->gen;
    if (op == WarpOp::kSyncWarp && mask == existing) ++b.warp_sync[f.warp];
    for (int l = 0; l < 32; ++l)
      if ((mask >> l & 1u) && l != f.lane) {
        Fiber& o = b.fibers[f.warp * 32 + l];
        if (o.state == St::kWarp) o.state = St::kReady;
      }
  } else {
    f.state = St::kWarp;
    f.what = what;
    f.file = file;
    f.line = line;
    f.mask = mask;
    while (c->gen == gen) Suspend(rt, f);
  }
  if (op == WarpOp::kShuffle) return c->payload[parity][src];
  if (op == WarpOp::kVote) {
    uint64_t ballot = 0;
    for (int l = 0; l < 32; ++l)
      if ((mask >> l & 1u) && c->payload[parity][l]) ballot |= 1ull << l;
    return ballot;
  }
  return 0;
}

SharedVar* GetShared(const void* key, size_t bytes, size_t elem_bytes, const char* name) {
  Runtime& rt = Rt();
  Cur("KVSIM_SHARED");
  for (const auto& v : rt.block.shared)
    if (v->key == key) return v.get();
  auto v = std::make_unique<SharedVar>();
  v->key = key;
  v->name = name;
  v->bytes = bytes;
  v->elem = elem_bytes;
  const size_t alloc = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  v->data.reset(static_cast<std::byte*>(std::aligned_alloc(64, alloc)));
  KVSIM_CHECK_MSG(v->data != nullptr, "host execution layer: cannot allocate shared memory");
  std::memset(v->data.get(), 0xa5, alloc);  // garbage
  v->shadow.assign(rt.opts.check_shared ? bytes : 0, Shadow{});
  rt.block.shared.push_back(std::move(v));
  return rt.block.shared.back().get();
}

void* SharedData(SharedVar* v) { return v->data.get(); }

void SharedOutOfBounds(SharedVar* v, long long index, size_t extent) {
  Fiber& f = Cur("shared access");
  Fail("shared-memory index out of bounds: thread " + std::to_string(f.tid) + " indexes `" + v->name +
       "` with " + std::to_string(index) + ", extent " + std::to_string(extent));
}

void SharedAccess(SharedVar* v, const void* p, size_t bytes, AccessKind kind) {
  Runtime& rt = Rt();
  Fiber& f = Cur("shared access");
  Block& b = rt.block;
  CurrentStats().shared_accesses++;
  if (rt.opts.check_shared) {
    const size_t off = static_cast<size_t>(static_cast<const std::byte*>(p) - v->begin());
    KVSIM_CHECK(off + bytes <= v->bytes);
    const uint32_t epoch = b.epoch, wsync = b.warp_sync[f.warp];
    const int16_t tid = static_cast<int16_t>(f.tid), warp = static_cast<int16_t>(f.warp);
    auto conflict = [&](const Acc& a) {
      return a.epoch == epoch && a.tid != tid && !(a.warp == warp && wsync > a.wsync);
    };
    auto update = [&](Acc& a) {
      if (a.epoch != epoch) {
        a = Acc{epoch, tid, warp, wsync};
      } else {
        if (a.tid != tid) a.tid = -2;
        if (a.warp != warp) a.warp = -1;
        a.wsync = std::max(a.wsync, wsync);
      }
    };
    for (size_t i = off; i < off + bytes; ++i) {
      Shadow& s = v->shadow[i];
      switch (kind) {
        case AccessKind::kRead:
          if (!s.init)
            Fail("read of uninitialised shared memory: thread " + std::to_string(f.tid) + " reads `" +
                 v->name + "` element " + std::to_string(i / v->elem) + ", never written in this block");
          if (conflict(s.w)) RaceError(*v, i, f, "reads", s.w, "wrote");
          if (conflict(s.a)) RaceError(*v, i, f, "reads", s.a, "atomically updated");
          update(s.r);
          break;
        case AccessKind::kWrite:
          if (conflict(s.w)) RaceError(*v, i, f, "writes", s.w, "wrote");
          if (conflict(s.r)) RaceError(*v, i, f, "writes", s.r, "read");
          if (conflict(s.a)) RaceError(*v, i, f, "writes", s.a, "atomically updated");
          update(s.w);
          s.init = true;
          break;
        case AccessKind::kAtomic:
          if (!s.init)
            Fail("atomic on uninitialised shared memory: thread " + std::to_string(f.tid) + ", `" + v->name +
                 "` element " + std::to_string(i / v->elem));
          if (conflict(s.w)) RaceError(*v, i, f, "atomically updates", s.w, "wrote");
          if (conflict(s.r)) RaceError(*v, i, f, "atomically updates", s.r, "read");
          update(s.a);
          break;
      }
    }
  }
  CountAccess(rt, f);
}

void WmmaRendezvous(const char* what, uint64_t uniform, const std::source_location& loc) {
  WarpCollective(WarpOp::kUniform, what, 0xffffffffu, uniform, -1, loc.file_name(),
                 static_cast<int>(loc.line()));
}

void WmmaCheckTile(const char* what, const void* p, unsigned ldm, size_t elem_bytes) {
  Runtime& rt = Rt();
  Fiber& f = Cur(what);
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * elem_bytes) % 16 != 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    Fail(std::string(what) + " by thread " + std::to_string(f.tid) + ": pointer " + buf + " with ldm " +
         std::to_string(ldm) + " (the pointer must be 32-byte aligned, ldm a multiple of 16 bytes)");
  }
  // A tile starting in a shared array must end in it (16 lines of 16 elements, ldm apart).
  const std::byte* q = static_cast<const std::byte*>(p);
  const size_t span = (15 * static_cast<size_t>(ldm) + 16) * elem_bytes;
  for (const auto& v : rt.block.shared)
    if (q >= v->begin() && q < v->begin() + v->bytes && q + span > v->begin() + v->bytes)
      Fail(std::string(what) + " by thread " + std::to_string(f.tid) + ": the 16x16 tile at byte " +
           std::to_string(q - v->begin()) + " of shared `" + v->name + "` with ldm " + std::to_string(ldm) +
           " ends at byte " + std::to_string(q - v->begin() + span) + ", past its " +
           std::to_string(v->bytes) + " bytes (out of bounds)");
}

void WmmaAccess(const void* p, size_t bytes, AccessKind kind) {
  Runtime& rt = Rt();
  const std::byte* q = static_cast<const std::byte*>(p);
  for (const auto& v : rt.block.shared)
    if (q >= v->begin() && q + bytes <= v->begin() + v->bytes) {
      SharedAccess(v.get(), p, bytes, kind);
      return;
    }
}

void VectorLoad(void* dst, const void* p, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    Fiber& f = Cur("a vector load");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    Fail("misaligned " + std::to_string(bytes) + "-byte vector load by thread " + std::to_string(f.tid) +
         " from address " + buf);
  }
  std::memcpy(dst, p, bytes);
}

void AtomicAccess(const void* p, size_t bytes) {
  Runtime& rt = Rt();
  if (!rt.cur) return;  // a host-side call outside kernels
  CurrentStats().atomics++;
  const std::byte* q = static_cast<const std::byte*>(p);
  for (const auto& v : rt.block.shared)
    if (q >= v->begin() && q + bytes <= v->begin() + v->bytes) {
      SharedAccess(v.get(), p, bytes, AccessKind::kAtomic);
      return;
    }
  CountAccess(rt, *rt.cur);
}

}  // namespace kvsim::gpu_replay::hx
