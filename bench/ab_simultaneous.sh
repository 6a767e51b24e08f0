#!/usr/bin/env bash
# A/B of two kvsim binaries on a noisy machine (issue 14, round 27): both sweeps run AT THE SAME TIME, each
# pinned to its own core with --threads 1 under `perf record -e cpu-clock`, then again with the cores
# swapped. Drift in the machine's speed hits both runs alike, so the ratio of their CPU samples (B / A)
# resolves differences of about 1% where one-after-the-other pairs on the project's VM spread by 15%.
# Prints, per core order, the total samples of each run and their ratio, and the same for the functions
# whose names match REGEX (optional), then whether the two runs' outputs are identical
# (bench/compare_sweeps.py, every field but the git commit).
# Usage: bench/ab_simultaneous.sh CONFIG BINARY_A BINARY_B [REGEX] [OUT_DIR]
# Needs perf, taskset and two idle cores; OUT_DIR (default /tmp/kvsim-ab) holds the profiles and outputs.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: bench/ab_simultaneous.sh CONFIG BINARY_A BINARY_B [REGEX] [OUT_DIR]" >&2
  exit 2
fi
CONFIG=$1 A=$2 B=$3 REGEX=${4:-} OUT=${5:-/tmp/kvsim-ab}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
for tool in perf taskset; do
  command -v "$tool" > /dev/null || { echo "ab_simultaneous.sh: error: $tool not found; install it (linux-perf, util-linux)" >&2; exit 2; }
done
for f in "$CONFIG" "$A" "$B"; do
  [[ -e $f ]] || { echo "ab_simultaneous.sh: error: $f does not exist" >&2; exit 2; }
done
[[ $(nproc) -ge 2 ]] || { echo "ab_simultaneous.sh: error: needs two cores, this machine has $(nproc)" >&2; exit 2; }
mkdir -p "$OUT"

# Samples per function of one profile: "count<TAB>symbol".
samples() {
  perf report -i "$1" --stdio --no-children --sort symbol -F sample,symbol 2> /dev/null |
    awk '!/^#/ && NF > 2 { n = $1; $1 = ""; sub(/^ +\[[.k]\] /, ""); sub(/ +- +- *$/, ""); print n "\t" $0 }'
}
sum() { awk -F'\t' -v rx="$2" 'rx == "" || $2 ~ rx { s += $1 } END { print s + 0 }' "$1"; }

for order in "0 1" "1 0"; do
  read -r ca cb <<< "$order"
  rm -rf "$OUT/a" "$OUT/b"
  taskset -c "$ca" perf record -q -e cpu-clock -F 999 -o "$OUT/a.data" "$A" sweep --config "$CONFIG" --threads 1 \
    --out "$OUT/a" > "$OUT/a.log" 2>&1 &
  pa=$!
  taskset -c "$cb" perf record -q -e cpu-clock -F 999 -o "$OUT/b.data" "$B" sweep --config "$CONFIG" --threads 1 \
    --out "$OUT/b" > "$OUT/b.log" 2>&1 &
  pb=$!
  wait "$pa" || { echo "ab_simultaneous.sh: error: $A failed, see $OUT/a.log" >&2; exit 1; }
  wait "$pb" || { echo "ab_simultaneous.sh: error: $B failed, see $OUT/b.log" >&2; exit 1; }
  samples "$OUT/a.data" > "$OUT/a.samples"
  samples "$OUT/b.data" > "$OUT/b.samples"
  ta=$(sum "$OUT/a.samples" "") tb=$(sum "$OUT/b.samples" "")
  line="A on cpu$ca, B on cpu$cb: samples A $ta, B $tb, B/A $(awk -v a="$ta" -v b="$tb" 'BEGIN { printf "%.3f", b / a }')"
  if [[ -n $REGEX ]]; then
    ma=$(sum "$OUT/a.samples" "$REGEX") mb=$(sum "$OUT/b.samples" "$REGEX")
    line+="; /$REGEX/ A $ma, B $mb, B/A $(awk -v a="$ma" -v b="$mb" 'BEGIN { printf "%.3f", (a > 0 ? b / a : 0) }')"
  fi
  echo "$line"
done
"$PY" "$ROOT/bench/compare_sweeps.py" "$OUT/a" "$OUT/b" | tail -1
