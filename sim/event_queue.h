#pragma once
// The discrete-event kernel: events ordered by (integer time, sequence number). Equal-time events run in
// the order they were scheduled (FIFO); time never runs backwards. No global state: a simulation owns its
// queue, so tests can run many side by side.

#include <cstdint>
#include <functional>
#include <queue>
#include <unordered_set>
#include <vector>

namespace kvsim {

// Simulated time in integer ticks; the unit (token steps, microseconds) belongs to the clock that schedules.
struct SimTime {
  int64_t ticks = 0;
  friend auto operator<=>(const SimTime&, const SimTime&) = default;
  SimTime operator+(int64_t d) const { return SimTime{ticks + d}; }
};

class EventQueue {
 public:
  using EventId = uint64_t;
  using Callback = std::function<void()>;

  // REQUIRES: at >= now(). Returns an id usable with Cancel().
  EventId Schedule(SimTime at, Callback fn);
  EventId ScheduleAfter(int64_t delay, Callback fn) { return Schedule(now_ + delay, std::move(fn)); }
  // Cancels a pending event (tombstone; skipped when reached). Unknown or already-run ids are ignored.
  void Cancel(EventId id);
  // Runs the next live event; returns false when none is left.
  bool RunNext();
  // Runs events until none is left; returns how many ran.
  int64_t Run();
  bool empty() const { return heap_.size() == cancelled_.size(); }
  SimTime now() const { return now_; }
  size_t pending() const { return heap_.size() - cancelled_.size(); }

 private:
  struct Entry {
    SimTime at;
    EventId seq;
    Callback fn;
  };
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.at != b.at ? a.at > b.at : a.seq > b.seq;
    }
  };
  std::priority_queue<Entry, std::vector<Entry>, Later> heap_;
  std::unordered_set<EventId> cancelled_;
  std::unordered_set<EventId> live_;
  SimTime now_{};
  EventId next_seq_ = 0;
};

}  // namespace kvsim
