#!/usr/bin/env bash
# Regenerates every number of docs/performance.md's issue 14 section (run on a quiet machine for the
# record; on a shared one, read the ratios within one table only):
#   1. kvsim vs the NumPy baseline (bench/numpy_replay.py), full + streaming_llm + snapkv x 5/10/20/50% on
#      the demo trace, side by side in one run, alternating, agreement checked to 1e-5;
#   2. kvsim_bench --suite issue14: fixed per-trace cost and per-run cost vs their floors, CPU use, all
#      12 text policies x 4 budgets (wall, CPU-s, peak RSS), then each text policy x 4 budgets in its own
#      process beside `full` alone (its cost = the difference; wall, CPU-s, peak RSS);
#   3. the cost-growth study: synthetic traces (2 layers, 8/2 heads, d 64, window-only queries, no recorded
#      aggregates) with prompts of 1K/4K/16K/64K tokens x 32/128/512 decode steps; full + streaming_llm +
#      snapkv x 4 budgets, wall and peak RSS per trace;
#   4. kvsim_bench --suite policies: each text policy x 4 budgets beside `full` alone at the same time (one
#      core each, one thread, both core orders): its cost and cost / floor without the machine's drift
#      between processes (part 2's per-policy rows include it; round 28), per core order and from both
#      orders at once, where the two cores' speeds cancel (round 33); then each policy against the
#      products its own runs need (output over its own cache, window logits, a merging run's search; round
#      29). About 17 minutes.
# Usage: bench/issue14.sh [BUILD_DIR] [OUT_DIR]   (defaults: build, /tmp/kvsim-issue14)
# GROWTH_PROMPTS / GROWTH_STEPS override the study's sizes; REPEATS the side-by-side repeats (3); PARTS which
# parts to run (default "1 2 3 4").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-/tmp/kvsim-issue14}
TRACE=${TRACE:-demo-out/llava15_7b_multi_image.h5}
PY=${PY:-.venv/bin/python}
REPEATS=${REPEATS:-3}
GROWTH_PROMPTS=${GROWTH_PROMPTS:-"1024 4096 16384 65536"}
GROWTH_STEPS=${GROWTH_STEPS:-"32 128 512"}
PARTS=${PARTS:-"1 2 3 4"}
mkdir -p "$OUT"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "date: $(date -u +%FT%TZ); commit: $(git rev-parse --short HEAD)"
# Which kernels can run (the merge screen is bf16 with AVX512-BF16, int16 with AVX2 only; round 10).
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo yes || echo no; }
echo "cpu: family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model' /proc/cpuinfo | cut -d: -f2 | xargs); avx2 $(has avx2), avx512f $(has avx512f), avx512_bf16 $(has avx512_bf16)"
if [[ " $PARTS " == *" 1 "* ]]; then
  echo
  echo "## 1. kvsim vs NumPy (same run)"
  "$PY" bench/numpy_replay.py "$TRACE" --kvsim "$BUILD/kvsim" --repeats "$REPEATS" --threads "$(nproc)"
fi
if [[ " $PARTS " == *" 2 "* ]]; then
  echo
  echo "## 2. floors, fixed and per-run cost, all text policies"
  "$BUILD/kvsim_bench" --trace "$TRACE" --suite issue14
fi
if [[ " $PARTS " == *" 4 "* ]]; then
  echo
  echo "## 4. each text policy's cost beside full alone, at the same time"
  "$BUILD/kvsim_bench" --trace "$TRACE" --suite policies
fi
[[ " $PARTS " == *" 3 "* ]] || exit 0
echo
echo "## 3. cost growth (synthetic: 2 layers, 8/2 heads, d 64; full + streaming_llm + snapkv x 4 budgets)"
cat > "$OUT/growth_exp.textproto" <<EXP
description: "issue 14 growth study"
traces: "growth.h5"
policies { name: "full" }
policies { name: "streaming_llm" }
policies { name: "snapkv" }
budgets: 0.05
budgets: 0.10
budgets: 0.20
budgets: 0.50
question_mode: QUERY_AWARE
EXP
echo
echo "| prompt | decode steps | trace MB | synth s | sweep wall s | sweep CPU % | peak RSS MB |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
for n in $GROWTH_PROMPTS; do
  for s in $GROWTH_STEPS; do
    ctx=$((n - 64))
    cat > "$OUT/growth.textproto" <<CFG
model { name: "growth" family: "llama" num_layers: 2 num_heads: 8 num_kv_heads: 2 head_dim: 64 rope_theta: 10000000 }
layout {
  segments { kind: TEXT role: SYSTEM tokens: 32 }
  segments { kind: TEXT role: CONTEXT tokens: $ctx }
  segments { kind: TEXT role: QUESTION tokens: 32 }
  decode_steps: $s
}
storage { query_storage: WINDOW query_window: 64 dtype: "float16" record_prefill_column_sums: false }
seed: 3
CFG
    t0=$(date +%s.%N)
    "$BUILD/kvsim" synth --config "$OUT/growth.textproto" --out "$OUT/growth.h5" >/dev/null 2>&1
    t1=$(date +%s.%N)
    rm -rf "$OUT/growth_out"
    /usr/bin/time -f "%e %P %M" -o "$OUT/time.txt" "$BUILD/kvsim" sweep --config "$OUT/growth_exp.textproto" \
      --out "$OUT/growth_out" >/dev/null 2>&1
    read -r wall cpu rss < "$OUT/time.txt"
    mb=$(du -m "$OUT/growth.h5" | cut -f1)
    printf '| %d | %d | %d | %.1f | %s | %s | %d |\n' "$n" "$s" "$mb" "$(echo "$t1 - $t0" | bc)" "$wall" "${cpu%\%}" $((rss / 1024))
    rm -f "$OUT/growth.h5"
  done
done
