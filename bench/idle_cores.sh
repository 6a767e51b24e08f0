#!/bin/bash
# Wall, CPU and idle cores of one sweep: bench/idle_cores.sh KVSIM CONFIG OUT_DIR [kvsim sweep options]
# prints "wall_s cpu_s idle_core_s peak_rss_MB": /usr/bin/time's elapsed, user + sys and maximum RSS, and
# /proc/stat's idle ticks of all cores (field 5 of the `cpu` line, USER_HZ) from before to after the run.
# The idle ticks count every process's idle time: on a shared machine they read low (others fill the cores).
set -u
bin=$1 cfg=$2 out=$3
shift 3
rm -rf "$out"
i0=$(awk '/^cpu /{print $5}' /proc/stat)
/usr/bin/time -f "%e %U %S %M" -o "$out.time" "$bin" sweep --config "$cfg" --out "$out" -q "$@" >/dev/null 2>"$out.err" ||
  { echo "FAILED: $(cat "$out.err")"; exit 1; }
i1=$(awk '/^cpu /{print $5}' /proc/stat)
read -r e u s m <"$out.time"
awk -v e="$e" -v u="$u" -v s="$s" -v m="$m" -v di=$((i1 - i0)) -v hz="$(getconf CLK_TCK)" \
  'BEGIN { printf "%.2f %.2f %.2f %.0f\n", e, u + s, di / hz, m / 1024 }'
