#!/usr/bin/env bash
# Writes the fuzz targets' seed corpus and dictionaries (docs/hardening.md "Fuzzing"); nothing here is
# committed as a binary. usage: make_corpus.sh KVSIM OUT_DIR
#   OUT_DIR/trace_reader/      tiny traces from `kvsim synth` (tests/fuzz/seeds/trace_*.textproto: plain
#                              float16 with column sums, float32 + gzip + query window, streaming with blocks)
#   OUT_DIR/textproto_config/  every shipped config under configs/, and seeds of each kind, behind the
#                              target's kind byte ('0' synth, '1' experiment, '2' device, '3' model shape,
#                              '4' latency model, '5' policy + --set lines)
#   OUT_DIR/plan_reader/       plans from `kvsim gpu-plan` on the plain seed trace (evictions, merges, decode)
#   OUT_DIR/*.dict             libFuzzer dictionaries (trace, plan: committed tests/fuzz/*.dict; textproto:
#                              every field and enum value name of the .proto files, and the policy names)
# Idempotent; OUT_DIR is replaced as a whole.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 KVSIM OUT_DIR" >&2
  exit 2
fi
kvsim=$(realpath "$1")
out=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
fuzz=$src/tests/fuzz
tmp=$(mktemp -d "${out%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/trace_reader" "$tmp/textproto_config" "$tmp/plan_reader"

# Traces.
for cfg in "$fuzz"/seeds/trace_*.textproto; do
  name=$(basename "$cfg" .textproto)
  "$kvsim" synth --config "$cfg" --out "$tmp/trace_reader/$name.h5" --threads 1 2>/dev/null
done

# Plans: eviction at prefill (snapkv), merges (snapkv+average), decode-time eviction (h2o), ragged heads.
plain=$tmp/trace_reader/trace_plain.h5
i=0
for policy in "snapkv --budget 0.5" "snapkv+average --budget-tokens 4" "h2o --budget-tokens 5" \
  "adakv --budget 0.4" "full --budget 1"; do
  # shellcheck disable=SC2086
  "$kvsim" gpu-plan --trace "$plain" --policy $policy --threads 1 --out "$tmp/plan_reader/plan_$i.pb" \
    2>/dev/null
  i=$((i + 1))
done

# Text configs: the kind byte, then the text.
seed() {  # kind name file-or-text...
  local kind=$1 name=$2
  shift 2
  { printf '%s' "$kind"; cat "$@"; } >"$tmp/textproto_config/$kind-$name"
}
for f in "$src"/configs/synth/*.textproto "$fuzz"/seeds/*.textproto; do seed 0 "$(basename "$f")" "$f"; done
for f in "$src"/configs/experiments/*.textproto; do seed 1 "$(basename "$f")" "$f"; done
for f in "$src"/configs/devices/*.textproto; do seed 2 "$(basename "$f")" "$f"; done
for f in "$src"/configs/models/*.textproto; do seed 3 "$(basename "$f")" "$f"; done
printf '4decode_base_us: 6500 decode_us_per_kv_token: 0.9 prefill_base_us: 20000 prefill_us_per_token: 35\n' \
  >"$tmp/textproto_config/4-linear"
printf '5snapkv\nwindow=16\npooling=MAX_POOL\n' >"$tmp/textproto_config/5-snapkv"
printf '5meda\nvariant=OFFICIAL_CODE\n' >"$tmp/textproto_config/5-meda"
printf '5h2o+average\none_shot=true\n' >"$tmp/textproto_config/5-h2o-average"
printf '5mukv\ngranularities=4,16,64\nkeep_ratios=0.5,0.25,0.8\n' >"$tmp/textproto_config/5-mukv"

# Dictionaries.
cp "$fuzz/trace.dict" "$tmp/trace_reader.dict"
cp "$fuzz/plan.dict" "$tmp/plan_reader.dict"
{
  for tok in '{' '}' ':' '[' ']' ',' '=' '#' '"' 'nan' 'inf' '-inf' '-1' '0' '1e308' '2147483647' \
    '4294967296' '-2147483648' 'true' 'false'; do
    printf '"%s"\n' "${tok//\"/\\\"}"
  done
  # Field names and enum values of every schema a text config or --set can name.
  cat "$src"/traces/synth_config.proto "$src"/analysis/experiment.proto "$src"/sim/device.proto \
    "$src"/sim/latency_model.proto "$src"/policies/policy_params.proto |
    grep -v '^\s*//' | grep -oE '\b[A-Za-z_][A-Za-z0-9_]*\s*=\s*[0-9]+' | sed -E 's/\s*=.*//' | sort -u |
    sed 's/.*/"&"/'
  # Policy names (plain and streaming), as kvsim list-policies prints them.
  "$kvsim" list-policies | grep -E '^[a-z_0-9]+$' | sed 's/.*/"&"/'
} >"$tmp/textproto_config.dict"

rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "fuzz corpus -> $out: $(ls "$out/trace_reader" | wc -l) traces ($(du -sk "$out/trace_reader" | cut -f1) KB)," \
  "$(ls "$out/textproto_config" | wc -l) configs, $(ls "$out/plan_reader" | wc -l) plans"
