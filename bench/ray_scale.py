#!/usr/bin/env python3
"""Ray scaling of a dataset sweep on this machine (docs/performance.md "Ray", docs/cluster.md), side by side in one
run: `kvsim sweep` in one process, kvsim.ray on a local cluster of 1 and of 2 CPUs (one task per sample, one
engine thread per task), and the per-task overhead (tiny units: Ray task vs the same unit in-process). Records
the machine's load average before and after (other processes share the cores: say so when quoting numbers).

    PYTHONPATH=python:build/python .venv/bin/python bench/ray_scale.py --kvsim build/kvsim --out /tmp/ray_scale.json

One engine thread and one BLAS thread (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS=1) in every row.

Every number printed is MEASURED here; the projection in docs/cluster.md is modelled from them.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1]
# One BLAS thread everywhere (set before the engine loads): Ray gives a 1-CPU task OMP_NUM_THREADS=1, and the
# in-process rows must not run OpenBLAS with more threads than the task does.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
EXPERIMENT = """traces: "unused.h5"
policies { name: "snapkv" }
policies { name: "h2o" }
policies { name: "pyramidkv" }
policies { name: "adakv" }
policies { name: "streaming_llm" }
policies { name: "oracle" }
budgets: 0.1
budgets: 0.2
budgets: 0.5
seed: 7
"""
TINY = """traces: "unused.h5"
policies { name: "snapkv" }
budgets: 0.5
seed: 7
"""


def synth(kvsim, config, out, seed):
    subprocess.run([kvsim, "synth", "--config", config, "--out", out, "--seed", str(seed), "--threads", "1"],
                   check=True, capture_output=True)


REPEATS = 3


def timed(fn, repeats=None):
    """The fastest of `repeats` runs (the machine is shared: the minimum is the least disturbed)."""
    best = float("inf")
    for _ in range(repeats or REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvsim", default=str(SRC / "build" / "kvsim"))
    ap.add_argument("--samples", type=int, default=8, help="traces in the dataset (default 8)")
    ap.add_argument("--layers", type=int, default=32, help="layers of each synthetic trace (default 32)")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="each measurement's best of this many runs")
    ap.add_argument("--tiny-units", type=int, default=24, help="units of the overhead measurement")
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()
    global REPEATS
    REPEATS = args.repeats
    import ray

    import kvsim
    import kvsim.ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    work = Path(tempfile.mkdtemp(prefix="kvsim-ray-bench-"))
    ray_tmp = tempfile.mkdtemp(prefix="kvrb", dir="/tmp")
    load_before = os.getloadavg()
    try:
        cfg = (SRC / "configs" / "synth" / "tiny.textproto").read_text()
        cfg = cfg.replace("num_layers: 3", f"num_layers: {args.layers}").replace(
            "decode_steps: 8", f"decode_steps: {args.decode_steps}")
        (work / "synth.textproto").write_text(cfg)
        (work / "data").mkdir()
        (work / "tiny").mkdir()
        for i in range(args.samples):
            synth(args.kvsim, work / "synth.textproto", work / "data" / f"s{i}.h5", 100 + i)
        for i in range(args.tiny_units):
            synth(args.kvsim, SRC / "configs" / "synth" / "tiny.textproto", work / "tiny" / f"t{i}.h5", 200 + i)
        (work / "exp.textproto").write_text(EXPERIMENT)
        (work / "tiny.textproto").write_text(TINY)
        size_mb = sum(p.stat().st_size for p in (work / "data").iterdir()) / args.samples / 1e6

        # 1. kvsim sweep in one process, 1 thread (the baseline of a 1-CPU worker).
        single = timed(lambda: subprocess.run(
            [args.kvsim, "sweep", "--config", work / "exp.textproto", "--trace", work / "data", "--out",
             work / "single", "-q", "--threads", "1"], check=True, capture_output=True))
        # The same sweeps in-process (kvsim.sweep: plan, units one after the other, outputs), 1 thread.
        data = sorted(str(p) for p in (work / "data").iterdir())
        tinies = sorted(str(p) for p in (work / "tiny").iterdir())
        runs_per_unit = len(kvsim.sweep(work / "exp.textproto", traces=data[:1], threads=1))

        rows = {}
        for cpus in (1, 2):
            t0 = time.perf_counter()
            ray.init(num_cpus=cpus, object_store_memory=100 * 1024 * 1024, _temp_dir=ray_tmp,
                     include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            start = time.perf_counter() - t0
            try:
                # Warm the workers (imports, the engine) so the rows compare steady-state tasks.
                kvsim.ray.sweep(work / "tiny.textproto", traces=[work / "tiny"], out=work / f"warm{cpus}")
                # Interleaved with the in-process runs (the load of a shared machine drifts).
                sweep_s = tiny_s = in_s = tiny_in_s = float("inf")
                for _ in range(REPEATS):
                    in_s = min(in_s, timed(lambda: kvsim.sweep(work / "exp.textproto", traces=data,
                                                               out=work / "inproc", threads=1), 1))
                    sweep_s = min(sweep_s, timed(lambda: kvsim.ray.sweep(work / "exp.textproto", traces=data,
                                                                         out=work / f"ray{cpus}"), 1))
                    tiny_in_s = min(tiny_in_s, timed(lambda: kvsim.sweep(
                        work / "tiny.textproto", traces=tinies, out=work / "tiny_inproc", threads=1), 1))
                    tiny_s = min(tiny_s, timed(lambda: kvsim.ray.sweep(work / "tiny.textproto", traces=tinies,
                                                                       out=work / f"tiny{cpus}"), 1))
                # Ray's own per-task cost: empty tasks, one at a time (latency) and all at once (throughput).
                noop = ray.remote(num_cpus=1)(lambda: None)
                ray.get(noop.remote())
                empty_latency = timed(lambda: [ray.get(noop.remote()) for _ in range(50)]) / 50
                empty_batch = timed(lambda: ray.get([noop.remote() for _ in range(200)])) / 200
            finally:
                ray.shutdown()
            for f in ("results.json", "runs.csv", "aggregates.csv"):
                assert (work / "inproc" / f).read_bytes() == (work / f"ray{cpus}" / f).read_bytes(), f
            rows[cpus] = {"cluster_start_s": start, "sweep_s": sweep_s, "tiny_sweep_s": tiny_s,
                          "tiny_per_unit_s": tiny_s / args.tiny_units, "in_process_s": in_s,
                          "tiny_in_process_s": tiny_in_s,
                          "empty_task_latency_s": empty_latency, "empty_task_batch_s": empty_batch}
        load_after = os.getloadavg()
        in_process, tiny_in_process = rows[1]["in_process_s"], rows[1]["tiny_in_process_s"]
        out = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                        "ray": ray.__version__, "kvsim": kvsim.__version__,
                        "loadavg_before": load_before, "loadavg_after": load_after},
            "dataset": {"samples": args.samples, "runs_per_unit": runs_per_unit, "trace_mb": size_mb,
                        "layers": args.layers, "decode_steps": args.decode_steps},
            "kvsim_sweep_1_thread_s": single, "repeats": REPEATS,
            "kvsim_sweep_in_process_s": in_process,
            "tiny_sweep_in_process_s": tiny_in_process,
            "ray": rows,
            "speedup_2_over_1": rows[1]["sweep_s"] / rows[2]["sweep_s"],
            "ray1_over_in_process": rows[1]["sweep_s"] / in_process,
            # Per-task overhead on a 1-CPU cluster (tasks run one after the other): Ray's time per tiny unit
            # minus the same unit in-process (kvsim.sweep).
            "task_overhead_s": (rows[1]["tiny_sweep_s"] - tiny_in_process) / args.tiny_units,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    d = out["dataset"]
    print(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"machine: {out['machine']['cpus']} CPUs, load average before {load_before[0]:.2f} / after "
          f"{load_after[0]:.2f} (1 min); ray {ray.__version__}")
    print(f"dataset: {d['samples']} synthetic traces of {d['trace_mb']:.1f} MB ({d['layers']} layers, "
          f"{d['decode_steps']} decode steps), {d['runs_per_unit']} runs per unit, 1 engine thread per task")
    print("| | wall (s) | speed vs in-process |\n|---|---:|---:|")
    print(f"| kvsim sweep (CLI), 1 process, --threads 1 | {single:.2f} | {in_process / single:.2f} |")
    print(f"| kvsim.sweep (in-process), threads=1 | {in_process:.2f} | 1.00 |")
    for cpus in (1, 2):
        r = rows[cpus]
        print(f"| kvsim.ray.sweep, local cluster of {cpus} CPU{'s' if cpus > 1 else ''}, 1 thread per task | "
              f"{r['sweep_s']:.2f} | {in_process / r['sweep_s']:.2f} |")
    print(f"speed-up of 2 Ray workers over 1: {out['speedup_2_over_1']:.2f}x "
          f"(cluster start, not included: {rows[1]['cluster_start_s']:.1f} s / {rows[2]['cluster_start_s']:.1f} s)")
    print(f"per-task overhead: {args.tiny_units} tiny units (1 run each) in-process {tiny_in_process:.2f} s, on a "
          f"1-CPU Ray cluster {rows[1]['tiny_sweep_s']:.2f} s -> {out['task_overhead_s'] * 1e3:.1f} ms per task "
          f"(2 CPUs: {rows[2]['tiny_sweep_s']:.2f} s)")
    print("empty Ray task: " + ", ".join(
        f"{c} CPU{'s' if c > 1 else ''}: {rows[c]['empty_task_latency_s'] * 1e3:.1f} ms one at a time, "
        f"{rows[c]['empty_task_batch_s'] * 1e3:.2f} ms each in a batch of 200" for c in (1, 2)))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
