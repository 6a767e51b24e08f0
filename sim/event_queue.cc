#include "sim/event_queue.h"

#include <string>

#include "sim/status.h"

namespace kvsim {

EventQueue::EventId EventQueue::Schedule(SimTime at, Callback fn) {
  KVSIM_CHECK_MSG(at >= now_, "event scheduled in the past: " + std::to_string(at.ticks) + " < now " +
                                  std::to_string(now_.ticks));
  const EventId id = next_seq_++;
  heap_.push(Entry{at, id, std::move(fn)});
  live_.insert(id);
  return id;
}

void EventQueue::Cancel(EventId id) {
  if (live_.erase(id)) cancelled_.insert(id);
}

bool EventQueue::RunNext() {
  while (!heap_.empty()) {
    // priority_queue::top is const; the entry is popped right away, so moving the callback out is safe.
    Entry e = std::move(const_cast<Entry&>(heap_.top()));
    heap_.pop();
    if (cancelled_.erase(e.seq)) continue;
    live_.erase(e.seq);
    KVSIM_CHECK(e.at >= now_);
    now_ = e.at;
    e.fn();
    return true;
  }
  return false;
}

int64_t EventQueue::Run() {
  int64_t n = 0;
  while (RunNext()) ++n;
  return n;
}

}  // namespace kvsim
