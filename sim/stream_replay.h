#pragma once
// The streaming engine (docs/streaming.md). For every run:
//   1. the policy plans its bank and encoding jobs (StreamPolicy::Plan; may read a few layers);
//   2. the timeline runs on a discrete-event queue in video microseconds: frame arrivals, encoding jobs on
//      one GPU server (FIFO; durations from the latency model), question arrivals (a question waits until
//      every frame before it is encoded), the question's prefill and its answer steps; CPU bank and GPU
//      context bytes are sampled at every event;
//   3. one streamed pass over the layers: per question, the full-history reference (init + every frame
//      before the question + question + answer) is computed once and shared by all runs; each run's
//      retrieved context (SelectAtLayer) is assembled and attended by the answer queries; retained mass,
//      output error, recall against evidence frames and the full-attention oracle are accumulated.

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/latency_model.h"
#include "sim/progress.h"
#include "sim/stream_policy.h"
#include "sim/stream_results.pb.h"
#include "sim/trace.h"

namespace kvsim {

struct StreamRunSpec {
  std::shared_ptr<const StreamPolicy> policy;
  std::string label;      // default: policy name
  int budget_tokens = 0;  // retrieved visual tokens per layer and KV head; 0 = the policy's default
};

struct StreamReplayOptions {
  int threads = 0;
  const LatencyModel* latency = nullptr;  // null: token steps
  Progress* progress = nullptr;           // optional: told after every layer (sim/progress.h)
  std::string trace_hash;
  std::string trace_path;
};

// Checks the runs against the trace (streaming trace, encodings or the queries to derive them) before any
// work; the message names the run and the fix.
Status CheckStreamRuns(const TraceMeta& meta, std::span<const StreamRunSpec> runs);

StatusOr<std::vector<StreamRunResult>> ReplayStream(TraceSource& trace, std::span<const StreamRunSpec> runs,
                                                    const StreamReplayOptions& options);

// A policy statistic by name from a result's list (NaN when absent).
double FindStreamStat(const google::protobuf::RepeatedPtrField<StreamStat>& stats, const std::string& name);

// ---- Pieces exposed for tests ----

// Blocks of `granularity` tokens cut from the video token stream (the tail shorter than G is dropped):
// block b covers trace positions [video_begin + b*G, video_begin + (b+1)*G). Its ready frame is the frame of
// its last token.
struct VideoBlock {
  int32_t first_token = 0;
  int32_t ready_frame = 0;
};
std::vector<VideoBlock> CutVideoBlocks(const StreamInfo& stream, int granularity);

// The retained mass of `rows` reference rows over the covered columns: out[r] = Σ_{c ∈ cols}
// p[r * stride + c], each row added in double in the order of `cols` from 0. Eight rows at a time, so eight
// independent chains of additions are in flight (one row at a time waited on the adder's latency at every
// column: 11% of the streaming demo sweep; issue 14, round 24); each row's additions and their order are a
// plain loop's.
void RetainedMass(const float* p, int rows, int stride, std::span<const int> cols, std::vector<double>* out);

// The timeline of one run, independent of layers.
struct StreamTimeline {
  std::vector<double> job_end_s;                     // per encoding job
  std::vector<double> answer_start_s;                // per question: its prefill starts
  std::vector<double> first_token_s;                 // per question: the first answer step ends
  std::vector<double> answer_end_s;                  // per question
  std::vector<double> cpu_at_answer, gpu_at_answer;  // per question: tier bytes while it is answered
  std::vector<MemoryPoint> memory;
  double encode_busy_s = 0, encode_lag_max_s = 0;
};

// Simulates frames, jobs and questions of one plan. `context_tokens[q]` is the mean number of retrieved
// tokens of question q (over layers), used for its step durations and GPU memory.
StreamTimeline SimulateStreamTimeline(const TraceMeta& meta, const StreamPlan& plan,
                                      std::span<const double> context_tokens, const LatencyModel& latency);

}  // namespace kvsim
