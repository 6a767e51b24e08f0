#include "sim/event_queue.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

namespace kvsim {

TEST_CASE("EventQueue orders by time, FIFO at equal times", "[event_queue]") {
  EventQueue q;
  std::vector<std::string> log;
  q.Schedule(SimTime{5}, [&] { log.push_back("t5a"); });
  q.Schedule(SimTime{1}, [&] { log.push_back("t1"); });
  q.Schedule(SimTime{5}, [&] { log.push_back("t5b"); });
  q.Schedule(SimTime{3}, [&] { log.push_back("t3"); });
  q.Schedule(SimTime{5}, [&] { log.push_back("t5c"); });
  CHECK(q.pending() == 5);
  CHECK(q.Run() == 5);
  CHECK(log == std::vector<std::string>{"t1", "t3", "t5a", "t5b", "t5c"});
  CHECK(q.now() == SimTime{5});
  CHECK(q.empty());
}

TEST_CASE("EventQueue: events scheduled from handlers, including at the current time", "[event_queue]") {
  EventQueue q;
  std::vector<int64_t> times;
  q.Schedule(SimTime{2}, [&] {
    times.push_back(q.now().ticks);
    q.ScheduleAfter(0, [&] { times.push_back(100 + q.now().ticks); });  // same time, after this one
    q.ScheduleAfter(3, [&] { times.push_back(q.now().ticks); });
  });
  q.Schedule(SimTime{2}, [&] { times.push_back(200 + q.now().ticks); });
  q.Run();
  CHECK(times == std::vector<int64_t>{2, 202, 102, 5});
}

TEST_CASE("EventQueue: cancel is a tombstone; cancelled events never run", "[event_queue]") {
  EventQueue q;
  int ran = 0;
  auto a = q.Schedule(SimTime{1}, [&] { ran += 1; });
  q.Schedule(SimTime{2}, [&] { ran += 10; });
  auto c = q.Schedule(SimTime{3}, [&] { ran += 100; });
  q.Cancel(a);
  q.Cancel(a);      // twice: ignored
  q.Cancel(12345);  // unknown: ignored
  CHECK(q.pending() == 2);
  CHECK(q.RunNext());
  CHECK(ran == 10);
  q.Cancel(c);
  CHECK(q.empty());
  CHECK_FALSE(q.RunNext());
  CHECK(ran == 10);
  CHECK(q.now() == SimTime{2});  // time did not advance to the cancelled event
}

TEST_CASE("EventQueue: independent queues do not interfere", "[event_queue]") {
  EventQueue a, b;
  int na = 0, nb = 0;
  for (int i = 0; i < 10; ++i) a.Schedule(SimTime{i}, [&] { ++na; });
  b.Schedule(SimTime{100}, [&] { ++nb; });
  a.Run();
  CHECK(na == 10);
  CHECK(nb == 0);
  CHECK(b.pending() == 1);
}

}  // namespace kvsim
