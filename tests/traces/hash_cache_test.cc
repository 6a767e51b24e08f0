#include "traces/hash_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "analysis/dataset.h"
#include "analysis/sweep.h"
#include "sim/stream_results.pb.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"

namespace kvsim {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// Longer than the coarse clock tick of file timestamps (1 jiffy, at most 10 ms): a write after the pause
// gets a later ctime than one before it.
void Tick() { std::this_thread::sleep_for(milliseconds(30)); }

std::string MakeFile(const std::string& path, char seed) {
  std::string data(4096 + 13, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(seed + i * 131 % 251);
  std::ofstream(path, std::ios::binary) << data;
  return path;
}

// The entry files of a cache folder (no temporary files left behind).
std::vector<fs::path> Entries(const std::string& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path());
  return out;
}

// Rewrites the hash line (the 4th) of the one entry in `dir`: proves a later answer came from the entry.
void ForgeEntryHash(const std::string& dir, const std::string& hash) {
  const auto entries = Entries(dir);
  REQUIRE(entries.size() == 1);
  std::string text = testing::ReadFile(entries[0].string());
  const size_t third = text.find('\n', text.find('\n', text.find('\n') + 1) + 1);
  REQUIRE(third != std::string::npos);
  text = text.substr(0, third + 1) + hash + "\n";
  testing::WriteFile(entries[0].string(), text);
}

struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  const char* name_;
  std::optional<std::string> old_;
};

constexpr char kForged[] = "0123456789abcdef";

// A file in a fresh scratch folder `name`, its entry remembered in `cache` (min age 0), then forged to
// kForged: a command that takes the remembered hash answers kForged, one that reads the file does not.
struct Remembered {
  HashCacheOptions cache;
  std::string path;
};
Remembered RememberForgedHash(const std::string& name, char fill) {
  const std::string dir = testing::ScratchDir(name);
  Remembered r{{dir + "/cache", milliseconds(0)}, MakeFile(dir + "/t.h5", fill)};
  Tick();
  REQUIRE(HashFileAndRemember(r.path, r.cache).ok());
  ForgeEntryHash(r.cache.dir, kForged);
  return r;
}

}  // namespace

TEST_CASE("hash cache: an entry is written, then answers without reading the file", "[hdf5][hash_cache]") {
  const std::string dir = testing::ScratchDir("hash_cache_hit");
  const HashCacheOptions cache{dir + "/cache", milliseconds(0)};
  const std::string path = MakeFile(dir + "/t.h5", 1);
  Tick();
  CHECK_FALSE(LookupFileHash(path, cache));
  auto h = CachedHashFile(path, cache);
  REQUIRE(h.ok());
  CHECK(*h == *HashFile(path));
  REQUIRE(Entries(cache.dir).size() == 1);
  CHECK(LookupFileHash(path, cache) == *h);
  // Answered from the entry: a forged hash comes back (the file is not read again).
  ForgeEntryHash(cache.dir, kForged);
  CHECK(*CachedHashFile(path, cache) == kForged);
  // HashFileAndRemember always reads, and puts the true hash back.
  CHECK(*HashFileAndRemember(path, cache) == *h);
  CHECK(LookupFileHash(path, cache) == *h);
  // Through another path to the same file (a symbolic link: the same canonical path), the same entry.
  fs::create_symlink(path, dir + "/link.h5");
  CHECK(LookupFileHash(dir + "/link.h5", cache) == *h);
}

TEST_CASE("hash cache: any change to the file invalidates its entry", "[hdf5][hash_cache]") {
  const std::string dir = testing::ScratchDir("hash_cache_change");
  const HashCacheOptions cache{dir + "/cache", milliseconds(0)};
  const std::string path = MakeFile(dir + "/t.h5", 2);
  Tick();
  const std::string before = *CachedHashFile(path, cache);
  REQUIRE(LookupFileHash(path, cache) == before);
  struct stat old_stat;
  REQUIRE(::stat(path.c_str(), &old_stat) == 0);
  Tick();

  SECTION("one byte rewritten in place, the modification time set back") {
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(100);
      f.put('\x7f');
    }
    const struct timespec times[2] = {old_stat.st_atim, old_stat.st_mtim};
    REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
    struct stat now;
    REQUIRE(::stat(path.c_str(), &now) == 0);
    REQUIRE(now.st_size == old_stat.st_size);  // only ctime tells the change
    REQUIRE(now.st_mtim.tv_nsec == old_stat.st_mtim.tv_nsec);
    CHECK_FALSE(LookupFileHash(path, cache));
    const std::string after = *CachedHashFile(path, cache);
    CHECK(after == *HashFile(path));
    CHECK(after != before);
  }
  SECTION("replaced by a new file renamed into place (a new inode)") {
    MakeFile(dir + "/new.h5", 3);
    fs::rename(dir + "/new.h5", path);
    CHECK_FALSE(LookupFileHash(path, cache));
    CHECK(*CachedHashFile(path, cache) == *HashFile(path));
  }
  SECTION("moved: the same inode under another name") {
    fs::rename(path, dir + "/moved.h5");
    CHECK_FALSE(LookupFileHash(dir + "/moved.h5", cache));
    CHECK(*CachedHashFile(dir + "/moved.h5", cache) == before);
  }
  SECTION("a damaged or foreign entry is ignored and replaced") {
    for (const std::string& text : {std::string("garbage"), std::string(""),
                                    testing::ReadFile(Entries(cache.dir)[0].string()) + "extra\n"}) {
      testing::WriteFile(Entries(cache.dir)[0].string(), text);
      CHECK_FALSE(LookupFileHash(path, cache));
      CHECK(*CachedHashFile(path, cache) == before);
      CHECK(LookupFileHash(path, cache) == before);
    }
    ForgeEntryHash(cache.dir, "not-a-hash");
    CHECK_FALSE(LookupFileHash(path, cache));
  }
}

TEST_CASE("hash cache: nothing is remembered for recent files, pipes, or without a folder",
          "[hdf5][hash_cache]") {
  const std::string dir = testing::ScratchDir("hash_cache_none");
  const std::string path = MakeFile(dir + "/t.h5", 4);
  // Changed within the last hour: a write in the same timestamp tick could go unseen, so no entry.
  const HashCacheOptions recent{dir + "/cache", std::chrono::hours(1)};
  CHECK(*CachedHashFile(path, recent) == *HashFile(path));
  CHECK(Entries(recent.dir).empty());
  CHECK_FALSE(LookupFileHash(path, recent));
  // No folder: always hashed.
  const HashCacheOptions none{"", milliseconds(0)};
  Tick();
  CHECK(*CachedHashFile(path, none) == *HashFile(path));
  // A pipe is hashed through a buffer and never remembered.
  const std::string fifo = dir + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::thread writer([&] { std::ofstream(fifo, std::ios::binary) << testing::ReadFile(path); });
  const HashCacheOptions cache{dir + "/cache2", milliseconds(0)};
  auto piped = CachedHashFile(fifo, cache);
  writer.join();
  REQUIRE(piped.ok());
  CHECK(*piped == *HashFile(path));
  CHECK(Entries(cache.dir).empty());
  // A missing file: HashFile's error, nothing written.
  CHECK(CachedHashFile(dir + "/missing", cache).status().code() == StatusCode::kNotFound);
  // A cache folder that cannot be made (a file is in the way): the hash all the same.
  testing::WriteFile(dir + "/blocked", "x");
  CHECK(*CachedHashFile(path, HashCacheOptions{dir + "/blocked/cache", milliseconds(0)}) == *HashFile(path));
}

TEST_CASE("hash cache: the folder comes from KVSIM_HASH_CACHE, XDG_CACHE_HOME or HOME",
          "[hdf5][hash_cache]") {
  ScopedEnv xdg("XDG_CACHE_HOME", "/x/cache"), home("HOME", "/home/u");
  {
    ScopedEnv v("KVSIM_HASH_CACHE", nullptr);
    CHECK(HashCacheFromEnv().dir == "/x/cache/kvsim/trace-hashes");
    CHECK(HashCacheFromEnv().min_age == std::chrono::seconds(2));
    ScopedEnv no_xdg("XDG_CACHE_HOME", "");
    CHECK(HashCacheFromEnv().dir == "/home/u/.cache/kvsim/trace-hashes");
    ScopedEnv no_home("HOME", nullptr);
    CHECK(HashCacheFromEnv().dir.empty());
  }
  {
    ScopedEnv v("KVSIM_HASH_CACHE", "off");
    CHECK(HashCacheFromEnv().dir.empty());
  }
  {
    ScopedEnv v("KVSIM_HASH_CACHE", "/elsewhere");
    CHECK(HashCacheFromEnv().dir == "/elsewhere");
  }
}

TEST_CASE("hash cache: the folder is pruned beyond max_entries, stale entries and old temporaries first",
          "[hdf5][hash_cache]") {
  const std::string dir = testing::ScratchDir("hash_cache_prune");
  HashCacheOptions cache{dir + "/cache", milliseconds(0)};
  cache.max_entries = 8;
  // Eight files remembered (the most the folder may hold without pruning), written one after the other.
  std::vector<std::string> files;
  for (int i = 0; i < 8; ++i) {
    files.push_back(MakeFile(dir + "/t" + std::to_string(i) + ".h5", static_cast<char>(i)));
    Tick();
    REQUIRE(HashFileAndRemember(files.back(), cache).ok());
  }
  REQUIRE(Entries(cache.dir).size() == 8);
  // Three entries go stale (two files moved away, one rewritten: moved, not deleted, so that no new file
  // takes a freed inode and with it a stale entry's name), one entry is garbage, and two temporaries are left
  // behind by crashed writers: one old, one fresh (its writer may still be renaming it).
  fs::rename(files[2], dir + "/moved2.h5");
  fs::rename(files[3], dir + "/moved3.h5");
  Tick();
  MakeFile(files[5], 99);
  testing::WriteFile(cache.dir + "/garbage", "not an entry\n");
  testing::WriteFile(cache.dir + "/1-2.tmp.1.0", "half");
  testing::WriteFile(cache.dir + "/1-3.tmp.1.1", "half");
  fs::last_write_time(cache.dir + "/1-2.tmp.1.0", fs::file_time_type::clock::now() - std::chrono::hours(2));
  // The next entry makes 12 files > 8: the stale entries, the garbage and the old temporary go; 6 valid
  // entries and the fresh temporary remain (6 <= 8 * 3 / 4: nothing valid is removed).
  Tick();
  files.push_back(MakeFile(dir + "/t8.h5", 8));
  Tick();
  REQUIRE(HashFileAndRemember(files.back(), cache).ok());
  CHECK(Entries(cache.dir).size() == 7);
  CHECK(fs::exists(cache.dir + "/1-3.tmp.1.1"));
  CHECK_FALSE(fs::exists(cache.dir + "/1-2.tmp.1.0"));
  CHECK_FALSE(fs::exists(cache.dir + "/garbage"));
  for (int i : {0, 1, 4, 6, 7, 8}) CHECK(LookupFileHash(files[i], cache));
  // Three more: the second makes 9 files > 8 with none stale, so the two least recently written entries
  // (files 0 and 1) go, down to 6 entries; the third makes 8 files again (no pruning).
  for (int i = 9; i < 12; ++i) {
    files.push_back(MakeFile(dir + "/t" + std::to_string(i) + ".h5", static_cast<char>(i)));
    Tick();
    REQUIRE(HashFileAndRemember(files.back(), cache).ok());
  }
  CHECK(Entries(cache.dir).size() == 8);  // 7 entries and the fresh temporary
  for (int i : {0, 1}) CHECK_FALSE(LookupFileHash(files[i], cache));
  for (int i : {4, 6, 7, 8, 9, 10, 11}) CHECK(LookupFileHash(files[i], cache));
}

TEST_CASE("HashBesideReplay takes a remembered hash and reads nothing beside the replay",
          "[hdf5][hash_cache]") {
  const auto [cache, path] = RememberForgedHash("hash_cache_beside", 5);
  ScopedEnv env("KVSIM_HASH_CACHE", cache.dir.c_str());
  for (bool concurrent : {false, true}) {
    std::string given = "unset";
    auto h = HashBesideReplay(path, concurrent ? 2 : 1, [&](const std::string& g) {
      given = g;
      return Status::Ok();
    });
    REQUIRE(h.ok());
    CHECK(*h == kForged);
    CHECK(given == kForged);  // known before the replay: handed to it, as a serial hash is
  }
  // With the cache off, the file is read (the true hash).
  ScopedEnv off("KVSIM_HASH_CACHE", "off");
  CHECK(*HashBesideReplay(path, 1, [](const std::string&) { return Status::Ok(); }) == *HashFile(path));
}

TEST_CASE("RunUnits (the streaming sweep's unit loop) takes a remembered hash", "[hdf5][hash_cache]") {
  const auto [cache, path] = RememberForgedHash("hash_cache_units", 6);
  ScopedEnv env("KVSIM_HASH_CACHE", cache.dir.c_str());
  std::vector<config::Sample> samples(1);
  samples[0].set_id("s");
  samples[0].set_path(path);
  auto units = [&] {
    Progress progress("test", ProgressStyle::kOff);
    std::vector<std::string> given;
    std::vector<StreamSweepUnit> done;
    google::protobuf::RepeatedPtrField<FailedUnit> failed;
    auto replay = [&](size_t, const std::string& hash) -> StatusOr<std::vector<StreamRunResult>> {
      given.push_back(hash);
      return std::vector<StreamRunResult>{};
    };
    REQUIRE(RunUnits(samples, "def", 0, nullptr, progress, replay, &done, &failed).ok());
    REQUIRE(done.size() == 1);
    CHECK(done[0].trace_hash() == given.at(0));
    return done[0].trace_hash();
  };
  CHECK(units() == kForged);  // answered from the entry: the file is not read
  // With the cache off, the file is read (the true hash).
  ScopedEnv off("KVSIM_HASH_CACHE", "off");
  CHECK(units() == *HashFile(path));
}

}  // namespace kvsim
