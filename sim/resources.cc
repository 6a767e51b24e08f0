#include "sim/resources.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kvsim {

StatusOr<uint64_t> AvailableMemoryBytes() {
  if (const char* env = std::getenv("KVSIM_MAX_MEMORY"); env && *env) {
    const std::string s = env;
    uint64_t v = 0;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    const std::string suffix(ptr, s.data() + s.size());
    int shift = -1;
    if (suffix.empty())
      shift = 0;
    else if (suffix == "K" || suffix == "k")
      shift = 10;
    else if (suffix == "M")
      shift = 20;
    else if (suffix == "G")
      shift = 30;
    else if (suffix == "T")
      shift = 40;
    if (ec != std::errc() || ptr == s.data() || shift < 0 || (shift > 0 && v > (UINT64_MAX >> shift)))
      return Status::InvalidArgument("environment variable KVSIM_MAX_MEMORY='" + s +
                                     "' is not a byte count (e.g. 8G, 512M or 1000000); unset it to use "
                                     "the available memory");
    return v << shift;
  }
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kb) == 1) return uint64_t{kb} * 1024;
  }
  const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  return UINT64_MAX;  // unknown: do not refuse
}

StatusOr<uint64_t> FreeDiskBytes(const std::string& path) {
  std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (folder.empty()) folder = ".";
  struct statvfs st {};
  if (::statvfs(folder.c_str(), &st) != 0)
    return Status::InvalidArgument(path + ": cannot query free space of folder '" + folder.string() +
                                   "': " + std::strerror(errno) + "; check that the folder exists");
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

std::string FormatBytes(double bytes) {
  char buf[64];
  if (bytes >= 1024.0 * 1024 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f TiB", bytes / (1024.0 * 1024 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.0f bytes", bytes);
  return buf;
}

Status CheckMemory(double bytes, const std::string& what) {
  KVSIM_ASSIGN_OR_RETURN(const uint64_t avail, AvailableMemoryBytes());
  if (bytes <= static_cast<double>(avail)) return Status::Ok();
  return Status::InvalidArgument(what + " needs " + FormatBytes(bytes) + " of memory but only " +
                                 FormatBytes(static_cast<double>(avail)) +
                                 " is available (MemAvailable, or KVSIM_MAX_MEMORY); use a smaller "
                                 "configuration or a machine with more memory");
}

Status CheckDisk(double bytes, const std::string& path, const std::string& what) {
  KVSIM_ASSIGN_OR_RETURN(const uint64_t free, FreeDiskBytes(path));
  if (bytes <= static_cast<double>(free)) return Status::Ok();
  return Status::InvalidArgument(what + " needs " + FormatBytes(bytes) + " of disk but only " +
                                 FormatBytes(static_cast<double>(free)) + " is free where '" + path +
                                 "' goes; free space, write elsewhere or use a smaller configuration");
}

double LayerFloatBytes(const TraceMeta& meta) {
  const ModelInfo& mi = meta.model;
  const double t = meta.total_tokens(), tq = static_cast<double>(meta.query_positions.size()),
               d = mi.head_dim;
  double floats = 2.0 * mi.num_kv_heads * t * d + static_cast<double>(mi.num_heads) * tq * d;
  if (meta.has_prefill_column_sums) floats += static_cast<double>(mi.num_heads) * meta.prefill_length;
  if (meta.stream)
    for (const BlockEncodingInfo& b : meta.stream->block_encodings) {
      const double bg = static_cast<double>(b.num_blocks) * b.granularity;
      floats += 2.0 * mi.num_kv_heads * bg * d + static_cast<double>(mi.num_heads) * bg;
    }
  return 4.0 * floats;
}

double TraceStoredBytes(const TraceMeta& meta) {
  const ModelInfo& mi = meta.model;
  const double t = meta.total_tokens(), tq = static_cast<double>(meta.query_positions.size()),
               d = mi.head_dim, elem = meta.storage_dtype == StorageDtype::kFloat16 ? 2.0 : 4.0;
  double per_layer = elem * (2.0 * mi.num_kv_heads * t * d + static_cast<double>(mi.num_heads) * tq * d);
  if (meta.has_prefill_column_sums)
    per_layer += 4.0 * mi.num_heads * static_cast<double>(meta.prefill_length);
  double blocks = 0;
  if (meta.stream)
    for (const BlockEncodingInfo& b : meta.stream->block_encodings) {
      const double bg = static_cast<double>(b.num_blocks) * b.granularity;
      per_layer += elem * 2.0 * mi.num_kv_heads * bg * d;
      blocks += 4.0 * mi.num_heads * bg * static_cast<double>(b.attention_layers.size());
    }
  double text = 0;
  for (const std::string& s : meta.tokens.text) text = std::max(text, static_cast<double>(s.size()));
  const double tokens = t * (1 + 4 + 4 + 4 + 8 + 1 + 1 + 8 + text) + 4.0 * tq;
  return per_layer * mi.num_layers + blocks + tokens;
}

}  // namespace kvsim
