#include "traces/mapped_file.h"

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

namespace kvsim {

namespace {

struct GuardFrame {
  sigjmp_buf env;
  const uint8_t* lo;
  const uint8_t* hi;
  GuardFrame* outer;
};

thread_local GuardFrame* t_frame = nullptr;
struct sigaction g_previous;  // the SIGBUS disposition before ours

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uint8_t* at = static_cast<const uint8_t*>(info->si_addr);
  for (GuardFrame* f = t_frame; f; f = f->outer)
    if (at >= f->lo && at < f->hi) {
      t_frame = f->outer;
      siglongjmp(f->env, 1);  // restores the signal mask saved by sigsetjmp (SIGBUS unblocked again)
    }
  // Not a guarded read: hand the signal to whoever had it before.
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != SIG_DFL) {
    g_previous.sa_handler(sig);
  } else {
    // Default (or ignored, which a fault cannot honour): restore it; the faulting load runs again on return
    // and the signal's default action ends the process as it would have without us.
    sigaction(SIGBUS, &g_previous, nullptr);
  }
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

}  // namespace

StatusOr<MappedFile> MappedFile::Map(int fd, uint64_t offset, uint64_t bytes, const std::string& path) {
  if (bytes == 0) return Status::InvalidArgument(path + ": cannot map an empty range");
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const uint64_t length = offset - start + bytes;
  void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
  if (p == MAP_FAILED) return Status::Internal(path + ": cannot map the file: " + std::strerror(errno));
  InstallOnce();
  MappedFile m;
  m.base_ = p;
  m.length_ = length;
  m.data_ = static_cast<const uint8_t*>(p) + (offset - start);
  m.size_ = bytes;
  return m;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, length_);
    base_ = std::exchange(o.base_, nullptr);
    length_ = std::exchange(o.length_, 0);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (base_) ::munmap(base_, length_);
}

bool ReadGuarded(const void* lo, size_t n, void (*fn)(void*), void* arg) {
  InstallOnce();
  GuardFrame frame;
  frame.lo = static_cast<const uint8_t*>(lo);
  frame.hi = frame.lo + n;
  frame.outer = t_frame;
  if (sigsetjmp(frame.env, 1) != 0) return false;  // the handler already popped the frame
  t_frame = &frame;
  fn(arg);
  t_frame = frame.outer;
  return true;
}

}  // namespace kvsim
