#include "traces/hash_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "traces/hdf5_trace.h"

namespace kvsim {
namespace {

// The first line of an entry; a new HashFile (other values for the same bytes) needs a new one.
constexpr char kHeader[] = "kvsim trace hash v1";

// What identifies one version of a file: an entry is valid while all of it is the same.
struct FileId {
  std::string path;  // canonical
  unsigned long long dev = 0, ino = 0, size = 0;
  long long mtime_s = 0, mtime_ns = 0, ctime_s = 0, ctime_ns = 0;

  bool operator==(const FileId&) const = default;
  std::string Line() const {
    std::ostringstream os;
    os << dev << ' ' << ino << ' ' << size << ' ' << mtime_s << ' ' << mtime_ns << ' ' << ctime_s << ' '
       << ctime_ns;
    return os.str();
  }
};

// The file's identity, when it is a regular file with a canonical path an entry can hold.
std::optional<FileId> Identify(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path canonical = std::filesystem::canonical(path, ec);
  if (ec) return std::nullopt;
  struct stat sb;
  if (::stat(canonical.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) return std::nullopt;
  FileId id;
  id.path = canonical.string();
  if (id.path.find('\n') != std::string::npos) return std::nullopt;
  id.dev = static_cast<unsigned long long>(sb.st_dev);
  id.ino = static_cast<unsigned long long>(sb.st_ino);
  id.size = static_cast<unsigned long long>(sb.st_size);
  id.mtime_s = sb.st_mtim.tv_sec;
  id.mtime_ns = sb.st_mtim.tv_nsec;
  id.ctime_s = sb.st_ctim.tv_sec;
  id.ctime_ns = sb.st_ctim.tv_nsec;
  return id;
}

std::string EntryName(const FileId& id) {
  char name[64];
  std::snprintf(name, sizeof name, "%llx-%llx", id.dev, id.ino);
  return name;
}

std::filesystem::path EntryPath(const HashCacheOptions& options, const FileId& id) {
  return std::filesystem::path(options.dir) / EntryName(id);
}

bool IsHash(const std::string& s) {
  if (s.size() != 16) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// Whole seconds and nanoseconds since the epoch, compared as a pair.
bool OlderThan(long long s, long long ns, std::chrono::system_clock::time_point limit) {
  const auto t =
      std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::seconds(s) + std::chrono::nanoseconds(ns)));
  return t < limit;
}

// The entry's hash if it still holds for the file it names (the same checks as LookupFileHash).
std::optional<std::string> ReadEntry(const std::filesystem::path& entry, const std::string* want_path,
                                     const FileId* want_id) {
  std::ifstream in(entry);
  std::string header, stored_path, line, hash, extra;
  if (!std::getline(in, header) || !std::getline(in, stored_path) || !std::getline(in, line) ||
      !std::getline(in, hash))
    return std::nullopt;
  if (header != kHeader || !IsHash(hash) || std::getline(in, extra)) return std::nullopt;
  std::optional<FileId> now;
  if (want_id == nullptr) {  // pruning: whatever file the entry names, as it is now
    now = Identify(stored_path);
    if (!now || EntryName(*now) != entry.filename().string()) return std::nullopt;
    want_id = &*now;
    want_path = &now->path;
  }
  if (stored_path != *want_path || line != want_id->Line()) return std::nullopt;
  return hash;
}

// See hash_cache.h: called after an entry was written.
void Prune(const HashCacheOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::pair<fs::file_time_type, fs::path>> entries;
  for (const fs::directory_entry& e : fs::directory_iterator(options.dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    entries.emplace_back(e.last_write_time(ec), e.path());
  }
  if (ec || entries.size() <= static_cast<size_t>(std::max(0, options.max_entries))) return;
  const auto hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  std::vector<std::pair<fs::file_time_type, fs::path>> kept;
  for (auto& [written, path] : entries) {
    const bool tmp = path.filename().string().find(".tmp.") != std::string::npos;
    if (tmp ? written < hour_ago : !ReadEntry(path, nullptr, nullptr)) {
      fs::remove(path, ec);
    } else if (!tmp) {
      kept.emplace_back(written, path);
    }
  }
  const size_t target = static_cast<size_t>(std::max(0, options.max_entries)) * 3 / 4;
  if (kept.size() <= target) return;
  std::sort(kept.begin(), kept.end());  // oldest first
  for (size_t i = 0; i + target < kept.size(); ++i) fs::remove(kept[i].second, ec);
}

}  // namespace

HashCacheOptions HashCacheFromEnv() {
  HashCacheOptions options;
  const char* v = std::getenv("KVSIM_HASH_CACHE");
  if (v && *v) {
    if (std::string(v) != "off") options.dir = v;
    return options;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    options.dir = (std::filesystem::path(xdg) / "kvsim" / "trace-hashes").string();
  else if (const char* home = std::getenv("HOME"); home && *home)
    options.dir = (std::filesystem::path(home) / ".cache" / "kvsim" / "trace-hashes").string();
  return options;
}

std::optional<std::string> LookupFileHash(const std::string& path, const HashCacheOptions& options) {
  if (options.dir.empty()) return std::nullopt;
  const std::optional<FileId> id = Identify(path);
  if (!id) return std::nullopt;
  return ReadEntry(EntryPath(options, *id), &id->path, &*id);
}

StatusOr<std::string> HashFileAndRemember(const std::string& path, const HashCacheOptions& options) {
  const auto began = std::chrono::system_clock::now();
  const std::optional<FileId> before = options.dir.empty() ? std::nullopt : Identify(path);
  KVSIM_ASSIGN_OR_RETURN(std::string hash, HashFile(path));
  if (!before) return hash;
  const std::optional<FileId> after = Identify(path);
  // Changed while hashed, or changed so recently that a write within the same timestamp tick could go unseen.
  const auto limit = began - options.min_age;
  if (!after || *after != *before || !OlderThan(before->mtime_s, before->mtime_ns, limit) ||
      !OlderThan(before->ctime_s, before->ctime_ns, limit))
    return hash;
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return hash;
  const std::filesystem::path entry = EntryPath(options, *before);
  static std::atomic<unsigned> serial{0};  // two threads of one process writing the same entry
  const std::string tmp =
      entry.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial.fetch_add(1));
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kHeader << '\n' << before->path << '\n' << before->Line() << '\n' << hash << '\n';
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return hash;
    }
  }
  std::filesystem::rename(tmp, entry, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return hash;
  }
  Prune(options);
  return hash;
}

StatusOr<std::string> CachedHashFile(const std::string& path, const HashCacheOptions& options) {
  if (std::optional<std::string> h = LookupFileHash(path, options)) return *h;
  return HashFileAndRemember(path, options);
}

StatusOr<std::string> CachedHashFile(const std::string& path) {
  return CachedHashFile(path, HashCacheFromEnv());
}

}  // namespace kvsim
