// kvsim verify hae: the decay fit and the DDES-vs-greedy simulation on hand-computed cases, and the
// verdicts on traces built so the answer is known: exact exponential decay (the bound holds) and decode
// queries that turn to the evicted tokens (a reported violation).

#include "analysis/verify_hae.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "tests/test_util.h"

namespace kvsim {

TEST_CASE("verify hae: the decay fit recovers an exact exponential", "[verify_hae]") {
  DecayFitter f;
  std::vector<double> a, b;
  for (int t = 0; t < 6; ++t) {
    a.push_back(0.5 * std::pow(0.8, t));
    b.push_back(0.01 * std::pow(0.8, t));
  }
  f.Add(a);
  f.Add(b);
  const DecayFit fit = f.Fit(-1);
  CHECK(fit.lambda() == Approx(0.2));
  CHECK(fit.r_squared() == Approx(1.0));
  CHECK(fit.tokens() == 2);
  DecayFitter g;  // growth: negative λ
  g.Add(std::vector<double>{1, 2, 4});
  CHECK(g.Fit(0).lambda() == Approx(-1.0));
}

TEST_CASE("verify hae: DDES vs greedy eviction, hand-computed", "[verify_hae]") {
  // n = 2, d = 2, keys 0..3; step rows: (.5, .1, .4, 0) and (.2, .3, .1, .4).
  const std::vector<float> rows{0.5f, 0.1f, 0.4f, 0.0f, 0.2f, 0.3f, 0.1f, 0.4f};
  const auto flushes = SimulateDdesVsGreedy(rows, 2, 4, 2, 2);
  // Greedy keeps 2: evicts token 1 (β .1) at step 0, token 3 (β .4) at step 1: loss .5.
  // DDES grows to 4 and flushes the two lowest at step 1: β (.7, .4, .5, .4) -> tokens 1 and 3: loss .8.
  REQUIRE(flushes.size() == 1);
  CHECK(flushes[0].step == 1);
  CHECK(flushes[0].greedy == Approx(0.5));
  CHECK(flushes[0].ddes == Approx(0.8));
  CHECK(flushes[0].d_lowest == Approx(0.8));
  // What they lose afterwards: greedy's token 1 still gets .3 at step 1; DDES evicts after the last step.
  CHECK(flushes[0].greedy_future == Approx(0.3));
  CHECK(flushes[0].ddes_future == Approx(0.0));
}

namespace {

// One layer, one head, d 8 (component 0 only), softmax scale 1. Prompt: text 0-2 (keys 2), image 3-7
// (keys -8), text 8 (key 2); every prompt query is 1. Decode queries are all `q`; the decode tokens' keys
// are chosen so that the softmax normaliser grows by 1/ρ per step, so every prompt token's attention
// decays exactly as ρ^t.
MemoryTrace DecayTrace(float q, double rho) {
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 1;
  spec.num_kv_heads = 1;
  spec.prefill_length = 9;
  spec.decode_steps = 6;
  spec.image_begin = 3;
  spec.image_end = 8;
  spec.question_tokens = 1;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  tr.mutable_meta().model.softmax_scale = 1.0;
  LayerData& l = tr.layers()[0];
  std::fill(l.queries.begin(), l.queries.end(), 0.0f);
  std::fill(l.keys.begin(), l.keys.end(), 0.0f);
  const int n = 9, d = 8;
  double z = 0;
  for (int j = 0; j < n; ++j) {
    l.keys[j * d] = j >= 3 && j < 8 ? -8.0f : 2.0f;
    z += std::exp(q * l.keys[j * d]);
  }
  for (int i = 0; i < n; ++i) l.queries[i * d] = 1.0f;
  for (int t = 0; t < 6; ++t) {
    l.queries[(n + t) * d] = q;
    const double e = z * (1 / rho - 1);  // exp(q k) of the new token
    l.keys[(n + t) * d] = static_cast<float>(std::log(e) / q);
    z += e;
  }
  return tr;
}

}  // namespace

TEST_CASE("verify hae: exact exponential decay => the bound holds", "[verify_hae]") {
  MemoryTrace tr = DecayTrace(1.0f, 0.8);
  VerifyHaeOptions o;
  o.r = 0.25;  // the 5 image tokens share the visual attention equally: each gets 0.2 of it
  o.alpha = 0.001;
  o.rc_size = 2;
  auto rep = VerifyHae(tr, o);
  REQUIRE(rep.ok());
  const Theorem21& th = rep->theorem();
  CHECK(th.evicted() == 5);
  CHECK(th.fit().lambda() == Approx(0.2).epsilon(1e-3));
  CHECK(th.fit().r_squared() == Approx(1.0).epsilon(1e-4));
  CHECK(th.verdict() == "holds");
  CHECK(th.steps_violated() == 0);
  REQUIRE(th.measured_per_step_size() == 6);
  CHECK(th.measured_per_step(1) == Approx(0.8 * th.measured_per_step(0)).epsilon(1e-3));
  CHECK(th.total_below_epsilon());
  CHECK(rep->corollary().flushes() == 3);  // 6 steps, bins of 2
  REQUIRE(rep->sparsity_size() == 1);
}

TEST_CASE("verify hae: out-of-range layers and non-finite parameters are refused, not clamped",
          "[verify_hae]") {
  MemoryTrace tr = DecayTrace(1.0f, 0.8);
  auto refused = [&](VerifyHaeOptions o, const std::string& needle) {
    auto rep = VerifyHae(tr, o);
    REQUIRE_FALSE(rep.ok());
    CHECK(rep.status().message().find(needle) == 0);
  };
  VerifyHaeOptions ok;
  ok.r = 0.25;
  ok.alpha = 0.001;
  ok.rc_size = 2;
  REQUIRE(VerifyHae(tr, ok).ok());
  VerifyHaeOptions o = ok;
  o.dap_layer = 99;
  refused(o, "--dap-layer 99: the trace has layers 0..");
  o = ok;
  o.dap_layer = -1;
  refused(o, "--dap-layer -1");
  o = ok;
  o.epsilon = std::nan("");
  refused(o, "--epsilon");
  o = ok;
  o.r = -0.1;
  refused(o, "--r ");
  o = ok;
  o.alpha = std::numeric_limits<double>::infinity();
  refused(o, "--alpha");
  o = ok;
  o.min_r_squared = 2;
  refused(o, "--min-r2");
  o = ok;
  o.sparsity_epsilon = std::nan("");
  refused(o, "--sparsity-epsilon");
}

TEST_CASE("verify hae: decode queries that turn to the evicted tokens => a reported violation",
          "[verify_hae]") {
  MemoryTrace tr = DecayTrace(-1.0f, 0.8);  // decode attention now favours the image keys (logit +8)
  VerifyHaeOptions o;
  o.r = 0.25;
  o.alpha = 0.001;
  o.rc_size = 2;
  auto rep = VerifyHae(tr, o);
  REQUIRE(rep.ok());
  const Theorem21& th = rep->theorem();
  CHECK(th.evicted() == 5);
  CHECK(th.fit().lambda() ==
        Approx(0.2).epsilon(1e-3));  // still exponential: the model's form is not the issue
  CHECK(th.verdict() == "violated");
  CHECK(th.steps_violated() == 6);
  CHECK_FALSE(th.total_below_epsilon());
  const std::string md = HaeVerifyMarkdown(*rep);
  CHECK(md.find("**violated**") != std::string::npos);
}

TEST_CASE("verify hae: the command writes the report and its summary; bad input fails cleanly",
          "[verify_hae][cli]") {
  const std::string dir = testing::ScratchDir("verify_hae_cli");
  std::string out;
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + dir + "/t.h5",
                              &out) == 0);
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " verify hae --trace " + dir +
                                  "/t.h5 --rc-size 3 --out " + dir + "/report.json",
                              &out) == 0);
  CHECK(std::filesystem::exists(dir + "/report.json"));
  std::ifstream md(dir + "/report.md");
  std::string first;
  std::getline(md, first);
  CHECK(first.find("# HAE theory") == 0);
  CHECK(testing::RunCommand(
            testing::KvsimBinary() + " verify nope --trace " + dir + "/t.h5 --out " + dir + "/x.json",
            &out) == 2);
  CHECK(testing::RunCommand(
            testing::KvsimBinary() + " verify hae --trace " + dir + "/missing.h5 --out " + dir + "/y.json",
            &out) == 1);
  CHECK_FALSE(std::filesystem::exists(dir + "/y.json"));
}

}  // namespace kvsim
