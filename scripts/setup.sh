#!/usr/bin/env bash
# Installs every Debian package kvsim needs. Idempotent: a no-op (no apt-get at all) when all are present.
# Python packages are not Debian's: scripts/setup_python.sh puts pinned versions into .venv/ (run calls both).
set -euo pipefail
PACKAGES=(
  build-essential cmake make pkg-config git time
  libboost-program-options-dev libboost-graph-dev
  libboost-context-dev  # fibers of gpu_replay's host execution layer (CUDA kernels run on the CPU)
  libhdf5-dev
  protobuf-compiler libprotobuf-dev
  catch2
  libopenblas-pthread-dev libopenblas0-pthread
  python3 python3-venv python3-dev  # python3-dev: headers of the extension kvsim._core (docs/python.md); the project's Python environment (.venv/, scripts/setup_python.sh) is built on these
  clang libclang-rt-14-dev llvm  # libFuzzer targets (make fuzz, fuzz-ci): clang-14, its fuzzer/sanitizer runtimes, llvm-symbolizer
)
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
