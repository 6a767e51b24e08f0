"""kvsim.ray (python/kvsim/ray.py; docs/cluster.md): `kvsim sweep` as Ray tasks on a local cluster. Outputs
byte-identical to `kvsim sweep` with a worker SIGKILLed mid-sweep, --resume, shipped traces (a task that cannot
see its trace reads the shipped copy), a trace bad mid-sweep (failed unit, exit 4), bad input and an unreachable
--address (one line, fast, nothing written). Ray is pinned in the project environment: a missing ray fails
these tests, it does not skip them."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SYNTH, cli

OUTPUTS = ["results.json", "runs.csv", "layers.csv", "aggregates.csv", "summary.md"]
N = 6
EXPERIMENT = """traces: "unused.h5"
policies { name: "snapkv" }
policies { name: "h2o" }
policies { name: "pyramidkv" }
policies { name: "oracle" }
budgets: 0.25
budgets: 0.5
budgets: 0.75
seed: 7
"""
# tiny.textproto with more layers and decode steps: a unit takes long enough to kill its worker mid-task.
SLOWER = ("num_layers: 3", "num_layers: 12"), ("decode_steps: 8", "decode_steps: 48")
MB = 1024 * 1024


def kvsim_ray(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kvsim.ray", "sweep", *map(str, args)], capture_output=True,
                          text=True, **kw)


def same_outputs(a, b):
    for f in OUTPUTS:
        assert (Path(a) / f).read_bytes() == (Path(b) / f).read_bytes(), f


def units(out):
    return sorted(p.name for p in (Path(out) / "units").glob("*.json"))


@pytest.fixture(scope="module")
def dataset(kvsim_bin, tmp_path_factory):
    """N traces in traces/ (absolute paths everywhere) and the reference outputs of `kvsim sweep`."""
    d = tmp_path_factory.mktemp("ray_dataset")
    text = (SYNTH / "tiny.textproto").read_text()
    for a, b in SLOWER:
        assert a in text
        text = text.replace(a, b)
    (d / "slower.textproto").write_text(text)
    (d / "traces").mkdir()
    for i in range(N):
        cli(kvsim_bin, "synth", "--config", d / "slower.textproto", "--out", d / "traces" / f"s{i}.h5", "--seed",
            100 + i, "--threads", "1")
    (d / "exp.textproto").write_text(EXPERIMENT)
    cli(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--trace", d / "traces", "--out", d / "ref", "-q",
        "--threads", "1")
    return d


@pytest.fixture(scope="module")
def cluster(dataset):
    """A local cluster (2 CPUs, 100 MB object store, its own temp folder) in this process; tasks see paths under
    dataset/unseen as missing (kvsim.ray.UNSEEN_ENV), to ship traces on one machine. Yields its address."""
    import ray  # pinned in python/requirements.lock: an ImportError fails the test

    from kvsim.ray import UNSEEN_ENV

    tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    os.environ[UNSEEN_ENV] = str(dataset / "unseen")  # inherited by the workers
    try:
        ray.init(num_cpus=2, object_store_memory=100 * MB, _temp_dir=tmp, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        os.environ.pop(UNSEEN_ENV, None)
        shutil.rmtree(tmp, ignore_errors=True)


def task_workers(temp_dir):
    """Pids of the Ray workers of the cluster under temp_dir that are running a kvsim unit right now."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if not cmd.startswith("ray::run_unit"):
                continue
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in parent:
            out.append(int(pid))
    return out


def test_local_cluster_worker_killed_identical_then_resume(dataset, cluster, tmp_path):
    """Its own local cluster (no --address): a worker SIGKILLed while it runs a unit; the task is retried and the
    outputs are byte-identical to kvsim sweep. Then --resume skips every finished unit (no cluster needed), and
    recomputes only the removed ones (on the cluster fixture)."""
    out = tmp_path / "out"
    ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    try:
        p = subprocess.Popen([sys.executable, "-m", "kvsim.ray", "sweep", "--config", dataset / "exp.textproto",
                              "--trace", dataset / "traces", "--out", out, "--num-cpus", "2",
                              "--object-store-mb", "100", "--temp-dir", ray_tmp, "--max-retries", "3"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed = None
        deadline = time.time() + 90
        while p.poll() is None and time.time() < deadline and killed is None:
            pids = task_workers(ray_tmp)
            if pids and len(units(out)) < N - 1:
                killed = pids[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
        _, err = p.communicate(timeout=120)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert killed is not None, "no worker was seen running a unit"
    assert p.returncode == 0, err
    assert f"{N * 12} runs ({N} units computed, 0 reused)" in err, err
    assert len([l for l in err.splitlines() if l.startswith("kvsim-ray: sweep: unit ")]) == N, err
    same_outputs(dataset / "ref", out)
    assert len(units(out)) == N
    assert not subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True).stdout, "Ray left running"

    # --resume: every unit reused, Ray not even started.
    res = kvsim_ray("--config", dataset / "exp.textproto", "--trace", dataset / "traces", "--out", out,
                    "--resume", "--address", "127.0.0.1:1")
    assert res.returncode == 0, res.stderr
    assert f"0 units computed, {N} reused" in res.stderr
    same_outputs(dataset / "ref", out)
    # Two units removed: only they run (on the cluster at --address).
    for name in units(out)[:2]:
        (out / "units" / name).unlink()
    res = kvsim_ray("--config", dataset / "exp.textproto", "--trace", dataset / "traces", "--out", out,
                    "--resume", "--address", cluster, "-q")
    assert res.returncode == 0, res.stderr
    assert f"2 units computed, {N - 2} reused" in res.stderr
    same_outputs(dataset / "ref", out)


def damage_layer_data(path):
    """Overwrites bytes in the middle of a trace's layer data: the trace still opens (header and metadata are
    intact), a layer read fails mid-sweep."""
    data = bytearray(Path(path).read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = os.urandom(4096)
    Path(path).write_bytes(bytes(data))


def test_bad_trace_is_a_failed_unit_exit_4(kvsim_bin, dataset, cluster, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(dataset / "traces", d)
    damage_layer_data(d / "s2.h5")
    ref = tmp_path / "ref"
    single = cli(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace", d, "--out", ref, "-q",
                 "--threads", "1", check=False)
    assert single.returncode == 4, single.stderr
    out = tmp_path / "out"
    res = kvsim_ray("--config", dataset / "exp.textproto", "--trace", d, "--out", out, "--address", cluster,
                    "--max-retries", "2")
    assert res.returncode == 4, res.stderr
    assert "kvsim-ray: sweep: unit " in res.stderr and "s2 failed: " in res.stderr
    assert "kvsim-ray: error: sample 's2' failed, no results for it: " in res.stderr
    same_outputs(ref, out)  # the failure's reason included (results.json, summary.md)
    assert len(units(out)) == N - 1


def test_shipped_traces(kvsim_bin, dataset, cluster, tmp_path, capfd):
    """Tasks that cannot see the traces (under dataset/unseen) get them through the object store."""
    import kvsim.ray

    unseen = dataset / "unseen"
    if not unseen.exists():
        shutil.copytree(dataset / "traces", unseen)
    ref = tmp_path / "ref"
    cli(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace", unseen, "--out", ref, "-q",
        "--threads", "1")
    # never: shared storage only -> every unit fails, saying why.
    result = {}
    runs = kvsim.ray.sweep(dataset / "exp.textproto", traces=[unseen], out=tmp_path / "never",
                           ship_traces="never", result=result)
    assert runs == [] and len(result["failed_units"]) == N
    assert "is not visible on node" in result["failed_units"][0]["error"]
    capfd.readouterr()
    # auto: the tasks ask for the bytes and read the shipped copy.
    runs = kvsim.ray.sweep(dataset / "exp.textproto", traces=[unseen], out=tmp_path / "auto", progress=True)
    err = capfd.readouterr().err
    assert len(runs) == N * 12
    assert err.count("(trace shipped)") == N, err
    same_outputs(ref, tmp_path / "auto")
    # always: shipped even though the tasks could read the path.
    runs = kvsim.ray.sweep(dataset / "exp.textproto", traces=[dataset / "traces"], out=tmp_path / "always",
                           ship_traces="always", progress=True)
    err = capfd.readouterr().err
    assert err.count("(trace shipped)") == N, err
    same_outputs(dataset / "ref", tmp_path / "always")
    # Shared storage: not shipped.
    kvsim.ray.sweep(dataset / "exp.textproto", traces=[dataset / "traces"], out=tmp_path / "shared",
                    progress=True)
    err = capfd.readouterr().err
    assert err.count("kvsim-ray: sweep: unit ") == N and "(trace shipped)" not in err, err
    same_outputs(dataset / "ref", tmp_path / "shared")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "10.255.255.1:6379"])
def test_unreachable_address_fails_fast(dataset, tmp_path, address):
    out = tmp_path / "out"
    t0 = time.time()
    res = kvsim_ray("--config", dataset / "exp.textproto", "--trace", dataset / "traces", "--out", out,
                    "--address", address.format(port=free_port()), timeout=60)
    assert time.time() - t0 < 15
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim-ray: error: --address "), res.stderr
    assert "ray start --head" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--trace", "missing.h5"], "missing.h5"),
    (["--manifest", "m.csv", "--trace", "x.h5"], "give --manifest or --trace, not both"),
    (["--threads", "0"], "--threads 0: engine threads per task, must be >= 1"),
    (["--ship-traces", "sometimes"], None),
    (["--prefill-chunk", "-2"], "--prefill-chunk must be >= 0"),
    (["--out", "."], "--out '.': give a new folder's name"),
])
def test_bad_input_one_line_nothing_written(dataset, tmp_path, args, message):
    out = tmp_path / "out"
    base = ["--config", dataset / "exp.textproto", "--out", out]
    if "--trace" not in args and "--manifest" not in args:
        base += ["--trace", dataset / "traces"]
    if "--out" in args:
        base = base[:2] + ["--trace", dataset / "traces"]
    res = kvsim_ray(*base, *args, cwd=tmp_path)
    assert res.returncode in (1, 2), res.stderr
    if message is None:  # an argparse usage error
        assert res.returncode == 2 and "invalid choice" in res.stderr
    else:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvsim-ray: error: "), res.stderr
        assert message in lines[0], lines[0]
    assert not out.exists()


def test_ray_missing_names_the_fix(dataset, tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from kvsim.ray import main; "
            f"sys.exit(main(['sweep', '--config', {str(dataset / 'exp.textproto')!r}, '--trace', "
            f"{str(dataset / 'traces')!r}, '--out', {str(tmp_path / 'out')!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Ray is not installed" in lines[0] and "scripts/setup_python.sh" in lines[0]
    assert not (tmp_path / "out").exists()
