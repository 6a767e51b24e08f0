#pragma once
// Memory and disk that kvsim may use, checked before large allocations and writes so that an impossible
// request (a damaged trace's header, a config asking for terabytes) is a one-line error, not an exhausted
// machine or a half-written file.

#include <cstdint>
#include <string>

#include "sim/status.h"
#include "sim/trace.h"

namespace kvsim {

// Bytes of memory kvsim may allocate: the environment variable KVSIM_MAX_MEMORY (a byte count, with an
// optional K/M/G/T suffix, powers of 1024) when set, else the kernel's MemAvailable (/proc/meminfo). An
// unparsable KVSIM_MAX_MEMORY is an error.
StatusOr<uint64_t> AvailableMemoryBytes();

// Free bytes (for an unprivileged user) on the file system holding `path`'s folder.
StatusOr<uint64_t> FreeDiskBytes(const std::string& path);

// "1.5 GiB" (or "12.0 MiB", "300 bytes").
std::string FormatBytes(double bytes);

// Ok when `bytes` fit in AvailableMemoryBytes(); otherwise a ResourceExhausted-style InvalidArgument naming
// `what` (e.g. "trace.h5: one layer of keys, values and queries as float32 (x2: the engine prefetches)").
Status CheckMemory(double bytes, const std::string& what);

// Ok when `bytes` fit in the free space of `path`'s file system.
Status CheckDisk(double bytes, const std::string& path, const std::string& what);

// Sizes implied by a trace's metadata (docs/trace-format.md): the float32 values of one layer as read or
// generated (keys, values, queries, aggregates, block encodings), and the bytes a writer stores for the
// whole trace without compression (tensors in the storage dtype, aggregates, token table).
double LayerFloatBytes(const TraceMeta& meta);
double TraceStoredBytes(const TraceMeta& meta);

}  // namespace kvsim
