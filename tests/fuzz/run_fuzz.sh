#!/usr/bin/env bash
# Runs every libFuzzer target of a KVSIM_FUZZ build for a bounded time each (docs/hardening.md "Fuzzing").
# usage: run_fuzz.sh FUZZ_BUILD SECONDS [TARGET...]   (default: all targets)
# Needs FUZZ_BUILD/corpus (make_corpus.sh). New inputs go to FUZZ_BUILD/work/<target> (kept between runs),
# crashes / leaks / timeouts / out-of-memory inputs to FUZZ_BUILD/artifacts/<target>/, logs to
# FUZZ_BUILD/logs/<target>.log. Exits non-zero if any target found anything.
# Environment: FUZZ_RSS_MB (2048; also the largest single allocation), FUZZ_TIMEOUT (per input, s; 10),
# FUZZ_ARGS (extra libFuzzer flags, e.g. -runs=1000000), FUZZ_FAST (below).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 FUZZ_BUILD SECONDS [TARGET...]" >&2
  exit 2
fi
build=$(realpath "$1")
seconds=$2
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(trace_reader textproto_config plan_reader)
rss=${FUZZ_RSS_MB:-2048}
timeout=${FUZZ_TIMEOUT:-10}
# Seed traces are 30-60 KB (mostly HDF5 metadata); mutated ones may grow to about twice that.
declare -A max_len=([trace_reader]=131072 [textproto_config]=16384 [plan_reader]=65536)
# Leaks inside libhdf5 that kvsim cannot free are suppressed (tests/fuzz/lsan.supp: by function, which needs
# full stacks through libhdf5). FUZZ_FAST=1: fast unwinding and every libhdf5-allocated leak suppressed
# (lsan-hdf5.supp), 3-4x more executions per second for long runs.
# Only the trace reader calls libhdf5; the other targets always unwind fast.
src=$(cd "$(dirname "$0")" && pwd)
sanitizer_options() {  # target
  if [ "$1" != trace_reader ] || [ "${FUZZ_FAST:-0}" = 1 ]; then
    echo "detect_leaks=1:abort_on_error=1" "suppressions=$src/lsan-hdf5.supp:print_suppressions=0"
  else
    echo "detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0" \
      "suppressions=$src/lsan.supp:print_suppressions=0"
  fi
}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=()
for t in "${targets[@]}"; do
  bin=$build/fuzz_$t
  corpus=$build/corpus/$t
  [ -x "$bin" ] || { echo "$bin: not built (make fuzz-build)" >&2; exit 2; }
  [ -d "$corpus" ] || { echo "$corpus: no seed corpus (tests/fuzz/make_corpus.sh)" >&2; exit 2; }
  mkdir -p "$build/work/$t" "$build/artifacts/$t" "$build/logs"
  log=$build/logs/$t.log
  dict=$build/corpus/$t.dict
  [ -f "$dict" ] || dict=
  echo "== fuzz_$t: ${seconds}s, -rss_limit_mb=$rss -timeout=$timeout -max_len=${max_len[$t]}"
  read -r asan lsan <<<"$(sanitizer_options "$t")"
  rc=0
  # shellcheck disable=SC2086
  ASAN_OPTIONS=${ASAN_OPTIONS:-$asan} LSAN_OPTIONS=${LSAN_OPTIONS:-$lsan} nice "$bin" -max_total_time="$seconds" -rss_limit_mb="$rss" -timeout="$timeout" -max_len="${max_len[$t]}" \
    ${dict:+-dict="$dict"} -artifact_prefix="$build/artifacts/$t/" -print_final_stats=1 \
    ${FUZZ_ARGS:-} "$build/work/$t" "$corpus" >"$log" 2>&1 || rc=$?
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  speed=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  if [ $rc -ne 0 ] || grep -qE '^==[0-9]+==ERROR|runtime error:|SUMMARY: libFuzzer' "$log"; then
    echo "fuzz_$t: FAILED (exit $rc) after $execs executions; log $log, input(s) in $build/artifacts/$t/"
    grep -E '==ERROR|runtime error:|SUMMARY|Test unit written' "$log" | head -5
    failed+=("$t")
  else
    echo "fuzz_$t: ok, $execs executions ($speed exec/s), no crash, leak, timeout or OOM"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing failed: ${failed[*]} (reproduce: $build/fuzz_<target> <artifact>; minimise with" \
    "-minimize_crash=1 -runs=10000, save it under tests/fuzz/regressions/<target>/)"
  exit 1
fi
echo "fuzzing passed: ${targets[*]}"
