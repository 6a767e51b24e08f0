# kvsim — two entry points (README quick start runs them through ./run, which installs packages first):
#   make demo   install packages, build; capture the REAL SmolLM2-135M passkey trace (cached) and sweep every
#               text-applicable policy into demo-out/real/; re-run those decisions in the model (closed loop,
#               demo-out/closed_loop/); synthesize the LLaVA-1.5-7B-shaped demo trace, sweep the baselines,
#               MEDA (paper + official code) and LOOK-M over budgets 5/10/20/50%, write
#               demo-out/results/{summary.md,results.json,runs.csv,layers.csv,plots/}; then synthesize the streaming video
#               trace (300 frames, 10 questions) and sweep ReKV, MuKV and the streaming baselines into
#               demo-out/streaming/{summary.md,results.json,runs.csv,questions.csv,memory.csv,plots/}; every
#               results folder gets its plots (kvsim plot) and the demo sweeps a Chrome trace (*.trace.json)
#   make test   install packages, build, run every test (CTest + Catch2)
# Both are idempotent. Other targets: build, asan-test (AddressSanitizer + UBSan stage of CI), fuzz-ci (libFuzzer
# targets, FUZZ_CI_SECONDS each: CI stage 3), fuzz (the same, FUZZ_SECONDS each), bench, format.

BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
JOBS       ?= $(shell nproc)
KVSIM      := $(BUILD)/kvsim
DEMO_DIR   ?= demo-out
DEMO_TRACE := $(DEMO_DIR)/llava15_7b_multi_image.h5
DEMO_CFG   := configs/synth/llava15_7b_multi_image.textproto
STREAM_TRACE := $(DEMO_DIR)/streaming_video.h5
STREAM_CFG   := configs/synth/streaming_demo.textproto
REAL_TRACE   := $(DEMO_DIR)/smollm2_passkey.h5
REAL_EXP     := configs/experiments/real_smollm2_passkey.textproto
# The demo sweeps' simulated clock: MODELLED decode latency on this GPU (docs/latency.md).
DEMO_DEVICE  ?= a100-sxm

.PHONY: setup build cli test asan-test fuzz-build fuzz-corpus fuzz fuzz-ci demo real-demo bench format clean

setup:
	@bash scripts/setup.sh
	@bash scripts/setup_python.sh

$(BUILD)/Makefile: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: setup $(BUILD)/Makefile
	cmake --build $(BUILD) -j $(JOBS)

# Only the kvsim binary and the Python package's extension (what the demo needs).
cli: setup $(BUILD)/Makefile
	cmake --build $(BUILD) -j $(JOBS) --target kvsim_package

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

asan-test: setup
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVSIM_SANITIZE=ON
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target kvsim_tests kvsim kvsim_latency_bench kvsim_bench
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -E '$(PY_ONLY_TESTS)'

# libFuzzer targets (tests/fuzz/, docs/hardening.md "Fuzzing"): clang, ASan + UBSan, in $(FUZZ_BUILD)/. The seed
# corpus is generated with the Release kvsim (tests/fuzz/make_corpus.sh). fuzz-ci: each target at most
# FUZZ_CI_SECONDS (CI stage 3); fuzz: FUZZ_SECONDS each, inputs found kept in $(FUZZ_BUILD)/work/ across runs.
# Either fails on any crash, leak, timeout (FUZZ_TIMEOUT s per input) or memory above FUZZ_RSS_MB.
FUZZ_SECONDS    ?= 600
FUZZ_CI_SECONDS ?= 60
FUZZ_TARGETS    ?= trace_reader textproto_config plan_reader

fuzz-build: setup
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVSIM_FUZZ=ON -DKVSIM_BUILD_TESTS=OFF -DKVSIM_WITH_CUDA=OFF \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target kvsim_fuzz

fuzz-corpus: cli
	bash tests/fuzz/make_corpus.sh $(KVSIM) $(FUZZ_BUILD)/corpus

fuzz-ci: fuzz-build fuzz-corpus
	bash tests/fuzz/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_CI_SECONDS) $(FUZZ_TARGETS)

fuzz: fuzz-build fuzz-corpus
	bash tests/fuzz/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# Python tests whose own code is not sanitized (they run in stage 1 of CI; capture_py, which also drives the
# kvsim binary on captured traces, runs in both stages).
PY_ONLY_TESTS := ^(capture_smollm2_py|capture_multimodal_py|closed_loop_py|sdpa_bench_py)$$

# The trace is regenerated only when its config changes.
$(DEMO_TRACE): $(DEMO_CFG) | cli
	@mkdir -p $(DEMO_DIR)
	$(KVSIM) synth --config $(DEMO_CFG) --out $@

$(STREAM_TRACE): $(STREAM_CFG) | cli
	@mkdir -p $(DEMO_DIR)
	$(KVSIM) synth --config $(STREAM_CFG) --out $@

# The real-model section: capture (cached by its inputs' hash), validate, sweep every text-applicable policy.
real-demo: cli
	bash scripts/real_trace.sh $(REAL_TRACE)
	$(KVSIM) validate $(REAL_TRACE)
	$(KVSIM) sweep --config $(REAL_EXP) --trace $(REAL_TRACE) --device $(DEMO_DEVICE) --out $(DEMO_DIR)/real
	$(KVSIM) plot $(DEMO_DIR)/real
	rm -rf $(DEMO_DIR)/closed_loop/plans
	$(KVSIM) gpu-plan --trace $(REAL_TRACE) --config $(REAL_EXP) --out-dir $(DEMO_DIR)/closed_loop/plans
	scripts/kvsim-capture closed-loop --model smollm2 --trace $(REAL_TRACE) --plans-dir $(DEMO_DIR)/closed_loop/plans \
	  --kvsim $(KVSIM) --out $(DEMO_DIR)/closed_loop

demo: cli real-demo $(DEMO_TRACE) $(STREAM_TRACE)
	$(KVSIM) sweep --config configs/experiments/demo.textproto --trace $(DEMO_TRACE) --device $(DEMO_DEVICE) \
	  --out $(DEMO_DIR)/results --chrome-trace $(DEMO_DIR)/results.trace.json
	$(KVSIM) plot $(DEMO_DIR)/results
	$(KVSIM) sweep --config configs/experiments/streaming_demo.textproto --trace $(STREAM_TRACE) \
	  --out $(DEMO_DIR)/streaming --chrome-trace $(DEMO_DIR)/streaming.trace.json
	$(KVSIM) plot $(DEMO_DIR)/streaming
	@echo
	@echo "==== REAL model: SmolLM2-135M-Instruct, captured on a 2K-token passkey prompt ===================="
	@cat $(DEMO_DIR)/real/summary.md
	@echo
	@echo "==== REAL model, closed loop: the same decisions re-run in SmolLM2 (measured) ===================="
	@cat $(DEMO_DIR)/closed_loop/summary.md
	@echo
	@echo "==== SYNTHETIC: LLaVA-1.5-7B-shaped multi-image trace from kvsim synth (not a real model) ========"
	@cat $(DEMO_DIR)/results/summary.md
	@echo
	@echo "==== SYNTHETIC: streaming video trace from kvsim synth (not a real model) ======================="
	@cat $(DEMO_DIR)/streaming/summary.md
	@echo
	@echo "Real model:  $(DEMO_DIR)/real/{summary.md,results.json,runs.csv,layers.csv,plots/} (trace $(REAL_TRACE))"
	@echo "Closed loop: $(DEMO_DIR)/closed_loop/{summary.md,closed_loop.json,closed_loop.csv,closed_loop.png}"
	@echo "Results: $(DEMO_DIR)/results/{summary.md,results.json,runs.csv,layers.csv,plots/}"
	@echo "Streaming: $(DEMO_DIR)/streaming/{summary.md,results.json,runs.csv,questions.csv,memory.csv,plots/}"
	@echo "Timelines (open in ui.perfetto.dev): $(DEMO_DIR)/{results,streaming}.trace.json"

bench: cli $(DEMO_TRACE) $(STREAM_TRACE)
	cmake --build $(BUILD) -j $(JOBS) --target kvsim_bench kvsim_latency_bench
	$(BUILD)/kvsim_latency_bench
	$(BUILD)/kvsim_bench --trace $(DEMO_TRACE)
	.venv/bin/python bench/numpy_replay.py $(DEMO_TRACE) --kvsim $(KVSIM) --repeats 3
	$(BUILD)/kvsim_bench --trace $(DEMO_TRACE) --suite issue14
	$(BUILD)/kvsim_bench --trace $(DEMO_TRACE) --suite policies
	$(BUILD)/kvsim_bench --trace $(STREAM_TRACE)
	.venv/bin/python bench/capture_bench.py

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cuh' '*.cu')

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
