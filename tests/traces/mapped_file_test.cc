#include "traces/mapped_file.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>

#include "sim/sanitizers.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

// Sums the bytes of [p, p + n) (a plain loop, as ReadGuarded requires).
struct SumBytes {
  const volatile uint8_t* p;
  size_t n;
  uint64_t sum = 0;
  void operator()() {
    for (size_t i = 0; i < n; ++i) sum += p[i];
  }
};

TEST_CASE("ReadGuarded: reading a mapping past a file truncated after mmap fails instead of crashing",
          "[trace][mapped]") {
  const std::string path = testing::ScratchDir("mapped_file") + "/f.bin";
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t bytes = 4 * static_cast<size_t>(page);
  std::ofstream(path, std::ios::binary) << std::string(bytes, '\x01');
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  auto m = MappedFile::Map(fd, 0, bytes, path);
  REQUIRE(m.ok());
  SumBytes all{m->data(), bytes};
  CHECK(ReadGuarded(m->data(), bytes, all));
  CHECK(all.sum == bytes);

  std::filesystem::resize_file(path, page + 10);  // pages 2 and 3 are now beyond the end
  SumBytes head{m->data(), static_cast<size_t>(page)};
  CHECK(ReadGuarded(m->data(), page, head));
  CHECK(head.sum == static_cast<uint64_t>(page));
  for (int again = 0; again < 3; ++again) {  // the signal mask is restored: a second fault is caught too
    SumBytes tail{m->data() + 2 * page, static_cast<size_t>(page)};
    CHECK_FALSE(ReadGuarded(m->data() + 2 * page, page, tail));
  }
  // Nested: the inner guard covers the bad page, the outer one goes on.
  bool inner_ok = true;
  auto outer = [&] {
    SumBytes tail{m->data() + 3 * page, static_cast<size_t>(page)};
    inner_ok = ReadGuarded(m->data() + 3 * page, page, tail);
  };
  CHECK(ReadGuarded(m->data(), bytes, outer));
  CHECK_FALSE(inner_ok);

  SECTION("a fault outside any guarded range still ends the process (the previous SIGBUS disposition)") {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      SumBytes tail{m->data() + 2 * page, static_cast<size_t>(page)};
      // Guarded range elsewhere: the handler must pass the signal on.
      auto wrong = [&] { tail(); };
      ReadGuarded(m->data(), page, wrong);
      ::_exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    // The fault goes to the disposition before ours: the default action (SIGBUS), or, under AddressSanitizer,
    // its own SIGBUS report, which ends the process with exit code 1 or SIGABRT (ASAN_OPTIONS
    // abort_on_error). Either way the process must not go on past the fault.
    CHECK_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 0));  // it did not go on to _exit(0)
    if (!kAddressSanitizer) {
      CHECK(WIFSIGNALED(status));
      if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == SIGBUS);
    }
  }
  ::close(fd);
}

}  // namespace
}  // namespace kvsim
