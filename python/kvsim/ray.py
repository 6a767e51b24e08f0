"""kvsim.ray: `kvsim sweep` over a dataset as tasks on a Ray cluster (docs/cluster.md).

    kvsim-ray sweep --config exp.textproto --manifest data.csv --out results/ [--address HEAD:6379]
    python -m kvsim.ray sweep ...                      # the same
    runs = kvsim.ray.sweep("exp.textproto", manifest="data.csv", out="results/")

One Ray task per sample runs every run of the experiment on that sample's trace in-process (kvsim._core): the
shared per-trace work (read, full-attention reference, prompt scores) is done once per task. The driver plans
the sweep with the C++ code of `kvsim sweep` (every check it makes, before any work), writes each finished
unit atomically into OUT/units/, and assembles the outputs with the code a resumed `kvsim sweep` ends in, so
results.json, runs.csv, layers.csv, aggregates.csv and summary.md are byte-identical to `kvsim sweep`'s.

Traces are read from shared storage (the same path on every node) or shipped through Ray's object store to a
task that cannot see them (--ship-traces). A task whose worker or node dies is retried (--max-retries); a unit
whose trace is bad is a failed unit (no retry), the rest completes and the exit code is 4, as `kvsim sweep`.
"""
import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._native import check, core
from .errors import KvsimError

PathLike = Union[str, "os.PathLike[str]"]
PREFIX = "kvsim-ray"
EXIT_INPUT, EXIT_USAGE, EXIT_PARTIAL = 1, 2, 4
SHIP_MODES = ("auto", "always", "never")
# Testing aid (docs/cluster.md): trace paths under this prefix are treated as not visible in tasks, so the
# shipped-trace path can be exercised on one machine.
UNSEEN_ENV = "KVSIM_RAY_UNSEEN_PREFIX"


def _ray():
    try:
        import ray  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError as e:
        raise KvsimError(f"Ray is not installed in this Python ({sys.executable}): run scripts/setup_python.sh "
                         f"(it installs the pinned ray of python/requirements.lock) [{e}]") from None
    return ray


_GCS_PROBE = """
import sys, ray._raylet as r
try:
    r.GcsClient(address=sys.argv[1]).internal_kv_get(b"kvsim-ray-probe", None, timeout=float(sys.argv[2]))
except Exception as e:
    print(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, end="")
    sys.exit(1)
"""


def check_address(address: str, timeout: float = 3.0) -> None:
    """Fails fast (seconds, not Ray's long wait) when no Ray head answers at HOST:PORT or ray://HOST:PORT: a TCP
    connect with a timeout, then (HOST:PORT) one call to the cluster's GCS in a subprocess with a deadline (a
    proxy or firewall may accept any connection). "auto" (Ray's own lookup) is not checked."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise KvsimError(f"--address '{address}': expected HOST:PORT (the head node's GCS port, 6379 by "
                         "default) or ray://HOST:PORT (Ray client, 10001)")
    fix = (f"start one with `ray start --head --port {port}` on {host}, or leave out --address to start a local "
           "cluster")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        reason = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        raise KvsimError(f"--address {address}: no Ray cluster answers there ({reason} after at most "
                         f"{timeout:g} s); {fix}") from None
    if "://" in address:
        return
    import subprocess  # noqa: PLC0415

    try:
        res = subprocess.run([sys.executable, "-c", _GCS_PROBE, address, str(timeout)], capture_output=True,
                             text=True, timeout=5 * timeout + 10)
        reason = res.stdout.strip() if res.returncode else ""
    except subprocess.TimeoutExpired:
        reason = f"its GCS did not answer within {5 * timeout + 10:g} s"
    if reason:
        raise KvsimError(f"--address {address}: no Ray cluster answers there ({reason}); {fix}")


def _progress(quiet: bool, done: int, total: int, what: str) -> None:
    """The sweep's progress: one plain line per finished unit on stderr (KVSIM_PROGRESS=off silences it)."""
    if not quiet and os.environ.get("KVSIM_PROGRESS", "") not in ("off", "0"):
        print(f"{PREFIX}: sweep: unit {done}/{total} {what}", file=sys.stderr, flush=True)


# ---- The task ---------------------------------------------------------------------------------------------

_PLANS: Dict[Tuple, Any] = {}


def _task_plan(experiment: bytes, base_dir: str, clock: Tuple[str, str, str, int]):
    """The driver's plan rebuilt in a worker (no trace opened), cached for the worker's next tasks."""
    key = (experiment, base_dir, clock)
    if key not in _PLANS:
        _PLANS.clear()
        _PLANS[key] = core().SweepPlan.from_bytes(experiment, base_dir, *clock)
    return _PLANS[key]


def _visible(path: str, size: int) -> bool:
    unseen = os.environ.get(UNSEEN_ENV)
    if unseen and os.path.abspath(path).startswith(unseen):
        return False
    try:
        return os.path.isfile(path) and os.path.getsize(path) == size
    except OSError:
        return False


def run_unit(spec: Dict[str, Any], trace: Optional[bytes] = None) -> Dict[str, Any]:
    """One unit (a sample, all runs), in a Ray task: returns {"json": unit file text} or {"error": reason}
    (a bad trace: not retried), or {"need_trace": True} when the trace is not visible here and was not
    shipped (the driver then ships it)."""
    t0 = time.perf_counter()
    info = {"node": socket.gethostname(), "pid": os.getpid(), "shipped": trace is not None}
    try:
        if spec.get("cwd") and os.path.isdir(spec["cwd"]):
            os.chdir(spec["cwd"])  # relative paths of the experiment (latency model file) as in the driver
        plan = _task_plan(spec["experiment"], spec["base_dir"], tuple(spec["clock"]))
        if trace is None:
            if not _visible(spec["read_path"], spec["size"]):
                if spec["ship"] == "never":
                    return dict(info, error=f"trace {spec['read_path']} is not visible on node {info['node']} "
                                            "(--ship-traces never: traces must be on shared storage; use "
                                            "--ship-traces auto)")
                return dict(info, need_trace=True)
            # The sample's own path when it names the same file here (messages then match kvsim sweep's).
            same = os.path.abspath(spec["path"]) == spec["read_path"]
            text = plan.compute(spec["index"], spec["threads"], "" if same else spec["read_path"])
        else:
            with tempfile.TemporaryDirectory(prefix="kvsim-ray-") as d:
                local = os.path.join(d, os.path.basename(spec["read_path"]) or "trace.h5")
                with open(local, "wb") as f:
                    f.write(trace)
                try:
                    text = plan.compute(spec["index"], spec["threads"], local)
                except KvsimError as e:
                    raise KvsimError(str(e).replace(local, spec["path"])) from None
        return dict(info, json=text, seconds=time.perf_counter() - t0)
    except KvsimError as e:
        return dict(info, error=str(e))


# ---- The driver -------------------------------------------------------------------------------------------

def _start(ray, address: Optional[str], num_cpus: Optional[int], object_store_mb: Optional[int],
           temp_dir: Optional[str]) -> bool:
    """Connects to `address` or starts a local cluster; returns whether this call started the connection
    (and so shuts it down). A connection already made in this process (ray.init by the caller) is used."""
    if ray.is_initialized():
        return False
    quiet_env = {"RAY_USAGE_STATS_ENABLED": "0"}
    for k, v in quiet_env.items():
        os.environ.setdefault(k, v)
    kwargs: Dict[str, Any] = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                                  configure_logging=True)
    if address:
        check_address(address)
        ray.init(address=address, **{k: v for k, v in kwargs.items() if k != "include_dashboard"})
    else:
        if object_store_mb:
            kwargs["object_store_memory"] = object_store_mb * 1024 * 1024
        if temp_dir:
            kwargs["_temp_dir"] = os.path.abspath(temp_dir)
        ray.init(num_cpus=num_cpus, **kwargs)
    return True


def sweep(config: PathLike, *, traces: Optional[Sequence[PathLike]] = None, manifest: Optional[PathLike] = None,
          out: PathLike, resume: bool = False, device: Optional[str] = None, model: Optional[str] = None,
          latency_model: Optional[PathLike] = None, prefill_chunk: Optional[int] = None, threads: int = 1,
          address: Optional[str] = None, num_cpus: Optional[int] = None, max_retries: int = 3,
          ship_traces: str = "auto", object_store_mb: Optional[int] = None, temp_dir: Optional[PathLike] = None,
          progress: bool = False, result: Optional[Dict[str, Any]] = None) -> List[Dict]:
    """`kvsim sweep` on Ray; returns the run results as kvsim.sweep does (results.json's "runs") and writes the
    same output folder `out` (byte-identical to kvsim sweep's). config, traces (files or folders), manifest,
    resume, device, model, latency_model and prefill_chunk are kvsim sweep's --config, --trace, --manifest,
    --resume, ...; threads: engine threads per task (each task reserves that many Ray CPUs). address: an
    existing cluster (HOST:PORT or ray://HOST:PORT; checked within seconds), else a local cluster of num_cpus
    CPUs (object_store_mb, temp_dir: its object store size and Ray's folder). A connection already made in this
    process with ray.init is used as it is. max_retries: retries of a task whose worker or node died.
    ship_traces: "auto" (a task that cannot see its trace gets it through the object store), "always",
    "never" (shared storage only). Failed units (bad traces) do not raise: they are in results.json's
    "failed_units" (pass result={} to receive the whole results.json as a dict).
    """
    check(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
          f"--threads {threads!r}: engine threads per task, must be >= 1 (each task reserves that many CPUs)")
    check(isinstance(max_retries, int) and max_retries >= 0, f"--max-retries {max_retries!r}: must be >= 0")
    check(ship_traces in SHIP_MODES, f"--ship-traces '{ship_traces}': expected auto, always or never")
    check(num_cpus is None or (isinstance(num_cpus, int) and num_cpus >= 1),
          f"--num-cpus {num_cpus!r}: must be >= 1")
    check(not (address and num_cpus), "--num-cpus sizes the local cluster; with --address the cluster has "
          "its own CPUs (leave out --num-cpus)")
    check(prefill_chunk is None or (isinstance(prefill_chunk, int) and prefill_chunk >= 0),
          "--prefill-chunk must be >= 0 (0 = whole prompt)")
    clock = (os.fspath(latency_model or ""), device or "", model or "",
             -1 if prefill_chunk is None else prefill_chunk)
    # kvsim sweep's checks (the C++ it runs): output folder, experiment, manifest, every trace and policy.
    plan = core().SweepPlan.from_args(os.fspath(config), [os.fspath(t) for t in (traces or [])],
                                      os.fspath(manifest or ""), clock[0], clock[1], clock[2], clock[3],
                                      os.fspath(out))
    ray = _ray()
    samples = plan.samples()
    total = len(samples)
    entries: List[Optional[Tuple[bool, str]]] = [None] * total
    todo = []
    for i in range(total):
        old = plan.reusable(i) if resume else None
        if old is not None:
            entries[i] = (False, old)
        else:
            todo.append(i)
    reused = total - len(todo)
    started = _start(ray, address, num_cpus, object_store_mb, os.fspath(temp_dir) if temp_dir else None) \
        if todo else False
    t0 = time.perf_counter()
    try:
        if todo:
            _run_tasks(ray, plan, todo, entries, threads, max_retries, ship_traces, clock, progress, reused)
        text = plan.finish(entries)
    finally:
        if started:
            ray.shutdown()
    res = json.loads(text)
    if result is not None:
        result.clear()
        result.update(res)
        result["_kvsim_ray"] = {"computed": len(todo), "reused": reused,
                                "seconds": time.perf_counter() - t0}
    return res["runs"]


def _run_tasks(ray, plan, todo: List[int], entries, threads: int, max_retries: int, ship: str, clock,
               progress: bool, reused: int) -> None:
    samples = plan.samples()
    total = len(samples)
    task = ray.remote(run_unit).options(num_cpus=threads, max_retries=max_retries, retry_exceptions=False)
    experiment = plan.experiment_bytes()
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    window = max(2, 2 * cpus // threads)  # tasks in flight: keeps shipped traces out of the store until needed
    queue = list(todo)
    pending: Dict[Any, Tuple[int, Any]] = {}
    done = reused

    def spec(i: int) -> Dict[str, Any]:
        path = os.path.abspath(samples[i][1])
        return {"experiment": experiment, "base_dir": plan.base_dir, "clock": clock, "index": i,
                "path": samples[i][1], "read_path": path, "size": os.path.getsize(path), "threads": threads, "ship": ship,
                "cwd": os.getcwd()}

    def submit(i: int, shipped: bool) -> None:
        trace_ref = ray.put(open(spec(i)["read_path"], "rb").read()) if shipped else None
        pending[task.remote(spec(i), trace_ref)] = (i, trace_ref)

    while queue or pending:
        while queue and len(pending) < window:
            submit(queue.pop(0), ship == "always")
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i, _trace_ref = pending.pop(ref)
            sid = samples[i][0]
            try:
                r = ray.get(ref)
            except ray.exceptions.RayError as e:  # the worker or node died max_retries + 1 times
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                r = {"error": f"the task failed {max_retries + 1} times ({type(e).__name__}: {first})"}
            if r.get("need_trace"):
                submit(i, True)
                continue
            done += 1
            if "json" in r:
                plan.write_unit(i, r["json"])
                entries[i] = (False, r["json"])
                where = f"on {r['node']} pid {r['pid']}" + (" (trace shipped)" if r["shipped"] else "")
                _progress(not progress, done, total, f"{sid} done in {r['seconds']:.1f} s {where}")
            else:
                entries[i] = (True, r["error"])
                _progress(not progress, done, total, f"{sid} failed: {r['error']}")


# ---- Command line -----------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsim-ray", description="kvsim sweep as tasks on a Ray cluster "
                                "(docs/cluster.md)")
    sub = p.add_subparsers(dest="command", metavar="sweep")
    s = sub.add_parser("sweep", help="replay a dataset x policies x budgets on Ray, write kvsim sweep's outputs",
                       description="kvsim sweep's arguments, its outputs, byte-identical; plus the cluster's.")
    s.add_argument("--config", required=True, help="Experiment text proto (configs/experiments/)")
    s.add_argument("--trace", action="append", default=[],
                   help="trace file(s) or folder(s) of *.h5 traces replacing the config's traces (repeatable)")
    s.add_argument("--manifest", help="dataset manifest replacing the config's traces: CSV 'id,path[,tags]'")
    s.add_argument("--out", required=True, help="output folder (as kvsim sweep's; units in OUT/units)")
    s.add_argument("--resume", action="store_true",
                   help="skip the finished units in OUT/units whose trace and experiment are unchanged")
    s.add_argument("--latency-model", help="latency model file (overrides the config's)")
    s.add_argument("--device", help="modelled decode latency on this GPU as the clock (docs/latency.md)")
    s.add_argument("--model", help="model shape for --device (overrides the config's model_shape)")
    s.add_argument("--prefill-chunk", type=int, help="prefill chunk size in tokens (overrides the config's)")
    s.add_argument("--threads", type=int, default=1,
                   help="engine threads per task; each task reserves that many Ray CPUs (default 1)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    s.add_argument("--address", help="an existing Ray cluster: HOST:PORT of its head (GCS, default port 6379) "
                   "or ray://HOST:PORT; without it a local cluster is started")
    s.add_argument("--num-cpus", type=int, help="CPUs of the local cluster (default: all cores)")
    s.add_argument("--object-store-mb", type=int, help="object store size of the local cluster in MB")
    s.add_argument("--temp-dir", help="Ray's folder for the local cluster (default /tmp/ray)")
    s.add_argument("--max-retries", type=int, default=3,
                   help="retries of a task whose worker or node died (default 3; bad traces are not retried)")
    s.add_argument("--ship-traces", default="auto", choices=SHIP_MODES,
                   help="auto: a task that cannot see its trace gets it through the object store; always; "
                        "never: shared storage only (default auto)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else EXIT_USAGE
    if args.command != "sweep":
        parser.print_usage(sys.stderr)
        print(f"{PREFIX}: usage error: give a command (sweep)", file=sys.stderr)
        return EXIT_USAGE
    result: Dict[str, Any] = {}
    try:
        runs = sweep(args.config, traces=args.trace, manifest=args.manifest, out=args.out, resume=args.resume,
                     device=args.device, model=args.model, latency_model=args.latency_model,
                     prefill_chunk=args.prefill_chunk, threads=args.threads, address=args.address,
                     num_cpus=args.num_cpus, max_retries=args.max_retries, ship_traces=args.ship_traces,
                     object_store_mb=args.object_store_mb, temp_dir=args.temp_dir, progress=not args.quiet,
                     result=result)
    except KvsimError as e:
        print(f"{PREFIX}: error: {str(e).splitlines()[0] if str(e) else e}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"{PREFIX}: interrupted; finished units are kept in OUT/units (rerun with --resume)",
              file=sys.stderr)
        return 130
    stats = result["_kvsim_ray"]
    out = os.path.normpath(args.out)
    print(f"{PREFIX}: {len(runs)} runs ({stats['computed']} units computed, {stats['reused']} reused) -> "
          f"{out}/{{results.json,runs.csv,layers.csv,aggregates.csv,summary.md}}", file=sys.stderr)
    for f in result.get("failed_units", []):
        print(f"{PREFIX}: error: sample '{f['sample_id']}' failed, no results for it: {f['error']}",
              file=sys.stderr)
    return EXIT_PARTIAL if result.get("failed_units") else 0


if __name__ == "__main__":
    from kvsim.ray import main as _main  # tasks must name kvsim.ray, not __main__

    sys.exit(_main())
