#pragma once
// Read-only memory mappings of trace files whose reads survive the file shrinking underneath them.
//
// Reading a mapped page that lies beyond the end of a file truncated after mmap raises SIGBUS. Every read of
// a MappedFile's bytes therefore goes through ReadGuarded(), which catches that signal in the reading thread
// and returns false instead of letting the process die (docs/trace-format.md, "Content hash"): a process-wide
// SIGBUS handler, installed once, jumps back to the guarded call when the faulting address lies inside a
// range the faulting thread is reading; any other SIGBUS goes to the handler that was installed before
// (the default one: the process dies as it would have).

#include <cstddef>
#include <cstdint>
#include <string>

#include "sim/status.h"

namespace kvsim {

class MappedFile {
 public:
  // Maps bytes [offset, offset + bytes) of regular file `fd` read-only (bytes > 0; any offset); the
  // descriptor stays the caller's. Map a window at a time, not a whole large file: the mapped pages a
  // process has touched count in its resident set until they are unmapped.
  static StatusOr<MappedFile> Map(int fd, uint64_t offset, uint64_t bytes, const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept { *this = static_cast<MappedFile&&>(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const uint8_t* data() const { return data_; }  // the byte at `offset`
  uint64_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  void* base_ = nullptr;  // the mapping (page-aligned, at or before data_)
  uint64_t length_ = 0;
};

// Runs fn(arg), which reads bytes in [lo, lo + n) of a mapping, and returns true; returns false if one of
// those bytes could not be read (SIGBUS: the file shrank, or an I/O error behind the page). fn is left by a
// jump at the faulting load: it must own no objects with destructors, hold no locks and allocate nothing
// (plain loops over the bytes). Nests; any thread.
bool ReadGuarded(const void* lo, size_t n, void (*fn)(void*), void* arg);

// The same for a callable (held by reference; the same restrictions apply to its body).
template <class F>
bool ReadGuarded(const void* lo, size_t n, F& f) {
  return ReadGuarded(
      lo, n, [](void* p) { (*static_cast<F*>(p))(); }, &f);
}

}  // namespace kvsim
