#pragma once
// The trace content hash (HashFile) remembered per file, so that replaying the same trace again does not read
// all of it once more just for the hash (0.4–0.6 CPU-s per GB-sized trace; docs/performance.md, "Round 12:
// the trace hash remembered").
//
// An entry is written only for a regular file that did not change while it was hashed (the same device,
// inode, size, modification and status-change times before and after) and whose modification and
// status-change times lie at least `min_age` before the hash began. It is used only while all of these, and
// the file's canonical path, are still the same. Any write to the file sets its status-change time (ctime) to
// the current time, which no user-level call can set back (utimes sets the modification time but moves ctime
// to now); with `min_age` above the file system's timestamp granularity, a write after the entry was made
// therefore always shows. The same rule as git's index ("racily clean" entries are not trusted). A trace
// written by kvsim is renamed into place, so it also gets a new inode.
//
// Entries are small text files, one per (device, inode), written to a temporary file and renamed into place
// (concurrent workers never see half an entry). Nothing here can fail a run: an unreadable, unparsable or
// stale entry is ignored and the file hashed, and an entry that cannot be written is not written.
//
// The folder stays bounded: when writing an entry finds more than `max_entries` in it, the entries that no
// longer hold (their file gone, changed or replaced), unreadable ones and temporary files left for more than
// an hour are removed, and then, if still more than max_entries * 3 / 4 remain, the least recently written
// ones. Removing an entry only costs a later hash.

#include <chrono>
#include <optional>
#include <string>

#include "sim/status.h"

namespace kvsim {

struct HashCacheOptions {
  std::string dir;                          // where entries live; empty: no cache (always hash)
  std::chrono::milliseconds min_age{2000};  // tests use 0
  int max_entries = 1024;                   // see above
};

// From the environment: KVSIM_HASH_CACHE unset or empty: $XDG_CACHE_HOME/kvsim/trace-hashes, else
// $HOME/.cache/kvsim/trace-hashes (no cache when neither is set); `off`: no cache; anything else: that
// folder.
HashCacheOptions HashCacheFromEnv();

// The remembered hash of `path`, if an entry for it exists and is still valid; nothing otherwise.
std::optional<std::string> LookupFileHash(const std::string& path, const HashCacheOptions& options);

// HashFile(path), and an entry for it when the rules above allow one.
StatusOr<std::string> HashFileAndRemember(const std::string& path, const HashCacheOptions& options);

// LookupFileHash, else HashFileAndRemember.
StatusOr<std::string> CachedHashFile(const std::string& path, const HashCacheOptions& options);
// The same with HashCacheFromEnv().
StatusOr<std::string> CachedHashFile(const std::string& path);

}  // namespace kvsim
