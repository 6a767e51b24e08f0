#!/usr/bin/env python3
"""Vectorised NumPy replay of kvsim's text metrics: the baseline of issue 14 (docs/performance.md).

What a competent researcher would write in about a day to get the same numbers as kvsim without kvsim:
h5py reads one layer at a time (float16 -> float32), one batched BLAS product per KV group for the decode
logits, the full output and each run's output; masks (streaming_llm's sliding window) and gathers
(snapkv's kept prompt tokens) for the kept sets; the decode tokens' contribution, kept by every
prefill-compressing run, computed once per layer.

It computes, for `full` + `streaming_llm` + `snapkv` (kvsim's default parameters) x budgets, the
per-sample retained attention mass and attention-output relative error exactly as docs/metrics.md defines
them (samples = layers x query heads x decode steps) and their aggregates: retained_mass_mean / _p5 and
output_rel_error_mean / _p95.

  numpy_replay.py TRACE [--budgets 0.05,0.1,0.2,0.5] [--json OUT]
      the NumPy replay alone; prints a table, writes the metrics as JSON.
  numpy_replay.py TRACE --kvsim build/kvsim [--repeats N] [--threads N] [--tolerance 1e-5]
      side by side in one run: `kvsim sweep` over the same runs and this replay, alternating, each in its
      own process (wall time, CPU time, peak RSS); checks every aggregate agrees to the tolerance and
      prints the markdown table with the ratio. Exit 1 on a disagreement.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

METRICS = ("retained_mass_mean", "retained_mass_p5", "output_rel_error_mean", "output_rel_error_p95")
# streaming_llm default (policies/baselines.proto); the environment variable exists only so the test can show
# that a wrong selection is caught by the agreement check.
NUM_SINKS = int(os.environ.get("KVSIM_NUMPY_REPLAY_SINKS", "4"))
SNAP_WINDOW, SNAP_KERNEL = 32, 5  # snapkv defaults: window 32, kernel 5, AVG pooling, MEAN over the group


def die(msg):
    print(f"numpy_replay: error: {msg}", file=sys.stderr)
    sys.exit(2)


def blas_info():
    """The BLAS NumPy calls and its thread count (NumPy's wheel bundles scipy-openblas)."""
    cfg = np.show_config(mode="dicts")
    blas = cfg.get("Build Dependencies", {}).get("blas", {})
    desc = f"{blas.get('name', '?')} {blas.get('version', '?')}"
    threads = None
    try:  # scipy-openblas exports openblas_get_num_threads with a 64_ suffix
        import ctypes
        import glob

        libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*.so*"))
        for lib in libs:
            h = ctypes.CDLL(lib)
            for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
                if hasattr(h, sym):
                    threads = int(getattr(h, sym)())
                    break
    except OSError:
        pass
    return desc, threads


def budget_tokens(fraction, ce):
    """B = clamp(round(R * ce), 1, ce), round half away from zero (docs/metrics.md)."""
    return int(min(max(int(np.floor(fraction * ce + 0.5)), 1), ce))


def quantile(x, q):
    """Nearest rank on the sorted samples, index round(q * (N - 1)) (docs/metrics.md)."""
    x = np.sort(x, axis=None)
    return float(x[min(x.size - 1, int(np.floor(q * (x.size - 1) + 0.5)))])


def softmax_rows(z):
    """Softmax over the last axis in place (masked entries are -inf)."""
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    return z


class Trace:
    def __init__(self, path):
        try:
            self.f = h5py.File(path, "r")
        except OSError as e:
            die(f"cannot open trace '{path}': {e}")
        a = self.f.attrs
        self.L, self.H, self.Hkv, self.d = (int(a[k]) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim"))
        self.n, self.S = int(a["prefill_length"]), int(a["num_decode_steps"])
        self.T = self.n + self.S
        self.G = self.H // self.Hkv
        self.scale = np.float32(a["softmax_scale"])
        self.softcap = float(a["logit_softcap"])
        self.window = int(a["sliding_window"])
        if not int(a["causal"]):
            die(f"'{path}': non-causal traces are not supported by this baseline")
        if "stream_" in " ".join(self.f.keys()):
            die(f"'{path}' is a streaming trace; this baseline replays text traces")
        pos = self.f["queries/positions"][...]
        self.qpos = pos

        def qindex(p):
            i = int(np.searchsorted(pos, p))
            if i >= pos.size or pos[i] != p:
                die(f"'{path}': the trace stores no query for token {p} (capture the decode and window queries)")
            return i

        self.q_dec0 = qindex(self.n)
        w = min(SNAP_WINDOW, self.n)
        self.q_win0 = qindex(self.n - w)
        if self.q_dec0 - self.q_win0 != w:
            die(f"'{path}': the observation window's queries are not stored contiguously")

    def layer(self, l):
        g = self.f[f"layers/layer_{l:03d}"]
        k = g["keys"][...].astype(np.float32)
        v = g["values"][...].astype(np.float32)
        q = g["queries"][:, self.q_win0 : self.q_dec0 + self.S, :].astype(np.float32)
        return k, v, q


def logits(tr, q, k, pos0, key_limit):
    """Scaled (soft-capped) logits of queries at positions pos0.. over keys [0, key_limit), causal and
    windowed masks as -inf. q: [Hkv, G, R, d] -> [Hkv, G*R, key_limit] (one batched GEMM per KV head)."""
    hkv, g, r, d = q.shape
    z = np.matmul(q.reshape(hkv, g * r, d), k[:, :key_limit, :].transpose(0, 2, 1))
    z *= tr.scale
    if tr.softcap > 0:
        z = np.float32(tr.softcap) * np.tanh(z / np.float32(tr.softcap))
    z = z.reshape(hkv, g, r, key_limit)
    pos = pos0 + np.arange(r)
    j = np.arange(key_limit)
    mask = j[None, :] > pos[:, None]
    if tr.window > 0:
        mask |= j[None, :] < (pos - tr.window + 1)[:, None]
    z[:, :, mask] = -np.inf
    return z


def replay(path, budgets):
    tr = Trace(path)
    n, S, H, G, Hkv, d, T = tr.n, tr.S, tr.H, tr.G, tr.Hkv, tr.d, tr.T
    runs = [("full", 1.0, n)]
    for name in ("streaming_llm", "snapkv"):
        for b in budgets:
            runs.append((name, b, budget_tokens(b, n)))
    for name, b, B in runs:
        if name == "streaming_llm" and B <= NUM_SINKS:
            die(f"streaming_llm budget {b} gives {B} tokens <= {NUM_SINKS} sinks; use a larger budget")
    retained = {i: np.empty((tr.L, H, S), np.float32) for i in range(len(runs))}
    err = {i: np.empty((tr.L, H, S), np.float32) for i in range(len(runs))}
    t_read = 0.0
    steps = np.arange(S)
    for l in range(tr.L):
        t0 = time.perf_counter()
        k, v, q = tr.layer(l)
        t_read += time.perf_counter() - t0
        qs = q.reshape(Hkv, G, -1, d)
        w = tr.q_dec0 - tr.q_win0
        # Full attention of every decode step: P [Hkv, G*S, T], output O [Hkv, G*S, d].
        p = softmax_rows(logits(tr, qs[:, :, w:, :], k, n, T)).reshape(Hkv, G * S, T)
        o = np.matmul(p, v)
        o_norm = np.linalg.norm(o, axis=-1)
        # The decode tokens (kept by every prefill-compressing run): their mass and output, once.
        dec_out = np.matmul(p[:, :, n:], v[:, n:, :])
        dec_mass = p[:, :, n:].sum(axis=-1)

        def record(i, out, mass):
            o_hat = out / mass[..., None]
            e = np.linalg.norm(o_hat - o, axis=-1) / o_norm
            retained[i][l] = mass.reshape(H, S)
            err[i][l] = e.reshape(H, S)

        # snapkv's scores: the observation window's column sums over the prompt keys, mean over the group.
        win_scores = None
        for i, (name, b, B) in enumerate(runs):
            if name == "full":
                record(i, o, p.sum(axis=-1))
            elif name == "streaming_llm":
                W = B - NUM_SINKS
                lo = max(NUM_SINKS, n - W + 1)  # first column any step's window reaches
                cols = np.arange(lo, T)
                first = np.maximum(NUM_SINKS, n + steps - W + 1)
                m = (cols[None, :] >= first[:, None]) & (cols[None, :] <= (n + steps)[:, None])  # [S, T-lo]
                pm = p[:, :, lo:].reshape(Hkv, G, S, -1) * m
                pm = pm.reshape(Hkv, G * S, -1)
                out = np.matmul(pm, v[:, lo:, :]) + np.matmul(p[:, :, :NUM_SINKS], v[:, :NUM_SINKS, :])
                mass = pm.sum(axis=-1) + p[:, :, :NUM_SINKS].sum(axis=-1)
                record(i, out, mass)
            elif name == "snapkv":
                obs = min(SNAP_WINDOW, n)
                tail = min(obs, B)
                if B <= tail:
                    idx = np.broadcast_to(np.arange(n - tail, n), (Hkv, tail))
                else:
                    if win_scores is None:
                        pw = softmax_rows(logits(tr, qs[:, :, :w, :], k, n - obs, n))  # [Hkv, G, obs, n]
                        s = pw.sum(axis=2).mean(axis=1)  # [Hkv, n]
                        s = s[:, : n - obs].astype(np.float64)
                        c = np.cumsum(np.pad(s, ((0, 0), (SNAP_KERNEL // 2 + 1, SNAP_KERNEL // 2))), axis=1)
                        win_scores = ((c[:, SNAP_KERNEL:] - c[:, :-SNAP_KERNEL]) / SNAP_KERNEL).astype(np.float32)
                    top = np.argsort(-win_scores, axis=1, kind="stable")[:, : B - tail]  # ties: the lower index
                    idx = np.concatenate([np.sort(top, axis=1), np.broadcast_to(np.arange(n - tail, n), (Hkv, tail))], 1)
                pk = np.take_along_axis(p, idx[:, None, :], axis=2)  # [Hkv, G*S, B]
                vk = np.take_along_axis(v, idx[:, :, None], axis=1)  # [Hkv, B, d]
                record(i, np.matmul(pk, vk) + dec_out, pk.sum(axis=-1) + dec_mass)
    results = []
    for i, (name, b, B) in enumerate(runs):
        r = retained[i].astype(np.float64)
        e = err[i].astype(np.float64)
        results.append(
            {
                "policy": name,
                "budget_fraction": b,
                "budget_tokens": B,
                "samples": int(r.size),
                "retained_mass_mean": float(r.mean()),
                "retained_mass_p5": quantile(retained[i], 0.05),
                "output_rel_error_mean": float(e.mean()),
                "output_rel_error_p95": quantile(err[i], 0.95),
            }
        )
    return results, t_read


def experiment_text(trace, budgets):
    lines = ['description: "issue 14: full + streaming_llm + snapkv (NumPy baseline comparison)"']
    lines.append(f"traces: {json.dumps(trace)}")
    lines += ['policies { name: "full" }', 'policies { name: "streaming_llm" }', 'policies { name: "snapkv" }']
    lines += [f"budgets: {b}" for b in budgets]
    lines.append("question_mode: QUERY_AWARE")
    return "\n".join(lines) + "\n"


def timed(cmd, env=None):
    """Runs cmd in its own process: (wall s, user+sys CPU s, peak RSS MB, stdout)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            sys.stderr.write(err.read().decode())
            die(f"{cmd[0]} exited with {code}")
        return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024.0, out.read().decode()


def kvsim_metrics(path):
    with open(path) as f:
        sweep = json.load(f)
    out = []
    for r in sweep["runs"]:
        m = r["metrics"]
        out.append(
            {
                "policy": r["policy"],
                "budget_fraction": float(r.get("budget_fraction", 0)),
                "budget_tokens": int(r.get("budget_tokens", 0)),
                **{k: float(m.get(k, 0.0)) for k in METRICS},
            }
        )
    return out


def compare(kv, npr, tol):
    """Every aggregate of every run equal to tol; returns (largest difference, problems)."""
    key = lambda r: (r["policy"], r["budget_tokens"])
    kvd = {key(r): r for r in kv}
    worst, bad = 0.0, []
    for r in npr:
        k = kvd.get(key(r))
        if k is None:
            bad.append(f"kvsim has no run {key(r)}")
            continue
        for m in METRICS:
            diff = abs(k[m] - r[m])
            worst = max(worst, diff)
            if not diff <= tol:
                bad.append(f"{r['policy']} B={r['budget_tokens']} {m}: kvsim {k[m]:.8g} numpy {r[m]:.8g}")
    if len(kvd) != len(npr):
        bad.append(f"kvsim has {len(kvd)} runs, numpy {len(npr)}")
    return worst, bad


def side_by_side(args, budgets):
    trace = os.path.abspath(args.trace)
    tmp = tempfile.mkdtemp(prefix="kvsim-numpy-")
    try:
        exp = os.path.join(tmp, "exp.textproto")
        with open(exp, "w") as f:
            f.write(experiment_text(trace, budgets))
        kv_cmd = [args.kvsim, "sweep", "--config", exp, "--out", os.path.join(tmp, "kv")]
        if args.threads:
            kv_cmd += ["--threads", str(args.threads)]
        np_json = os.path.join(tmp, "numpy.json")
        np_cmd = [sys.executable, os.path.abspath(__file__), trace, "--json", np_json, "--budgets", args.budgets]
        env = dict(os.environ)
        if args.threads:
            env["OPENBLAS_NUM_THREADS"] = str(args.threads)
        rows = {"kvsim": [], "numpy": []}
        for rep in range(args.repeats):
            shutil.rmtree(os.path.join(tmp, "kv"), ignore_errors=True)
            rows["kvsim"].append(timed(kv_cmd))
            rows["numpy"].append(timed(np_cmd, env))
        kv = kvsim_metrics(os.path.join(tmp, "kv", "results.json"))
        with open(np_json) as f:
            npj = json.load(f)
        worst, bad = compare(kv, npj["runs"], args.tolerance)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    blas, threads = blas_info()
    print(f"trace: {args.trace}; {len(npj['runs'])} runs (full + streaming_llm + snapkv x budgets {args.budgets})")
    print(f"NumPy {np.__version__}, BLAS {blas}, {threads} threads; load average before: {os.getloadavg()[0]:.2f}")
    cache = os.environ.get("KVSIM_HASH_CACHE", "")
    print("kvsim's trace content hash: " + ("read in every run (KVSIM_HASH_CACHE=off)" if cache == "off" else
          "read once, then remembered while the file is unchanged (docs/cli.md, KVSIM_HASH_CACHE)"))
    print(f"agreement: largest |kvsim - numpy| over {len(METRICS)} aggregates x {len(kv)} runs = {worst:.2e} "
          f"(tolerance {args.tolerance:g})")
    print()
    print("| repeat | kvsim wall s | kvsim CPU % | kvsim peak RSS MB | NumPy wall s | NumPy CPU % | NumPy peak RSS MB | NumPy / kvsim |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(rows["kvsim"], rows["numpy"])):
        print(f"| {i + 1} | {a[0]:.2f} | {100 * a[1] / a[0]:.0f} | {a[2]:.0f} | {b[0]:.2f} | {100 * b[1] / b[0]:.0f} | "
              f"{b[2]:.0f} | {b[0] / a[0]:.2f}x |")
    best_kv, best_np = min(r[0] for r in rows["kvsim"]), min(r[0] for r in rows["numpy"])
    print(f"| best | {best_kv:.2f} | | | {best_np:.2f} | | | {best_np / best_kv:.2f}x |")
    print(f"\nNumPy replay: {npj['seconds']:.2f} s inside the script, of which reading + fp16->fp32 "
          f"{npj['read_seconds']:.2f} s (last repeat)")
    if bad:
        print("DISAGREEMENT:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--budgets", default="0.05,0.1,0.2,0.5")
    ap.add_argument("--json", help="write the metrics here")
    ap.add_argument("--kvsim", help="kvsim binary: run it side by side and check agreement")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="kvsim --threads and OPENBLAS_NUM_THREADS (0: all)")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args()
    try:
        budgets = [float(x) for x in args.budgets.split(",")]
    except ValueError:
        die(f"--budgets '{args.budgets}': expected comma-separated fractions in (0, 1]")
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        die(f"--budgets '{args.budgets}': expected comma-separated fractions in (0, 1]")
    if not os.path.exists(args.trace):
        die(f"trace '{args.trace}' does not exist")
    if args.kvsim:
        sys.exit(side_by_side(args, budgets))
    t0 = time.perf_counter()
    runs, t_read = replay(args.trace, budgets)
    seconds = time.perf_counter() - t0
    for r in runs:
        print(f"{r['policy']:>14} B={r['budget_tokens']:>5}  retained {r['retained_mass_mean']:.6f} "
              f"(p5 {r['retained_mass_p5']:.6f})  error {r['output_rel_error_mean']:.6f} (p95 {r['output_rel_error_p95']:.6f})")
    print(f"{seconds:.2f} s (reading + fp16->fp32 {t_read:.2f} s), peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"runs": runs, "seconds": seconds, "read_seconds": t_read}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
