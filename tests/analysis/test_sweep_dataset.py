"""`kvsim sweep` over datasets (analysis/sweep.cc; docs/cli.md "Datasets", "Resume"): folders and manifests,
aggregates, a real SIGKILL in the middle then --resume (byte-identical outputs), a changed trace recomputed
alone, a trace that turns bad mid-sweep (failed unit, exit 4), and the one-line errors before any work."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2]
SYNTH = SRC / "configs" / "synth"
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


@pytest.fixture(scope="module")
def kvsim_bin():
    exe = os.environ.get("KVSIM_BIN")
    if not exe:
        pytest.fail("KVSIM_BIN is not set (run through ctest -R sweep_dataset_py)")
    return exe


def run(kvsim_bin, *args):
    return subprocess.run([kvsim_bin, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def dataset(kvsim_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("dataset")
    (d / "traces").mkdir()
    for i in range(N):
        res = run(kvsim_bin, "synth", "--config", SYNTH / "tiny.textproto", "--out", d / "traces" / f"s{i}.h5",
                  "--seed", 100 + i, "--threads", "1")
        assert res.returncode == 0, res.stderr
    (d / "exp.textproto").write_text(EXPERIMENT)
    return d


def sweep(kvsim_bin, d, out, *extra):
    return run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--trace", d / "traces", "--out", out, "-q",
               "--threads", "1", *extra)


def units(out):
    u = Path(out) / "units"
    return sorted(p.name for p in u.glob("*.json")) if u.exists() else []


def same_outputs(a, b):
    for f in OUTPUTS:
        assert (Path(a) / f).read_bytes() == (Path(b) / f).read_bytes(), f


def test_folder_sweep_rows_and_aggregates(kvsim_bin, dataset, tmp_path):
    out = tmp_path / "out"
    res = sweep(kvsim_bin, dataset, out)
    assert res.returncode == 0, res.stderr
    rows = (out / "runs.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert header[-3:] == ["sample_id", "tags", "group"]
    assert len(rows) == 1 + N * 12  # 4 policies x 3 budgets per sample
    ids = {r.split(",")[header.index("sample_id")] for r in rows[1:]}
    assert ids == {f"s{i}" for i in range(N)}
    agg = (out / "aggregates.csv").read_text().splitlines()
    assert agg[0] == "group,policy,label,budget_fraction,budget_tokens,metric,n,mean,sd,ci95_low,ci95_high,resamples"
    snap = [r.split(",") for r in agg[1:] if ",snapkv,snapkv,0.25," in r and "retained_mass_mean" in r]
    assert len(snap) == 1
    n, mean, sd, lo, hi = int(snap[0][6]), *map(float, snap[0][7:11])
    assert n == N and lo <= mean <= hi and sd > 0 and lo < hi
    # The mean and sd are those of the per-sample rows.
    col = header.index("retained_mass_mean")
    vals = [float(r.split(",")[col]) for r in rows[1:]
            if r.split(",")[header.index("label")] == "snapkv" and r.split(",")[header.index("budget_fraction")] == "0.25"]
    assert len(vals) == N
    assert mean == pytest.approx(sum(vals) / N, rel=1e-12)
    assert "## Across samples" in (out / "summary.md").read_text()
    # Reproducible at another thread count (bootstrap seeded by the experiment's seed).
    out2 = tmp_path / "out2"
    assert run(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace", dataset / "traces", "--out",
               out2, "-q", "--threads", "2").returncode == 0
    same_outputs(out, out2)


def test_sigkill_then_resume_is_byte_identical(kvsim_bin, dataset, tmp_path):
    dataset = shutil.copytree(dataset, tmp_path / "ds")  # this test changes a trace in place
    ref = tmp_path / "ref"
    assert sweep(kvsim_bin, dataset, ref).returncode == 0
    out = tmp_path / "out"
    for attempt in range(5):
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.Popen([kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace",
                              dataset / "traces", "--out", out, "-q", "--threads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while p.poll() is None and len(units(out)) < 2:
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL)
        p.wait()
        done = units(out)
        if p.returncode == -signal.SIGKILL and 1 <= len(done) < N:
            break
    else:
        pytest.fail("could not kill the sweep in the middle")
    assert not (out / "results.json").exists()
    res = sweep(kvsim_bin, dataset, out, "--resume")
    assert res.returncode == 0, res.stderr
    assert f"{N - len(done)} units computed, {len(done)} reused" in res.stderr
    same_outputs(ref, out)
    # A changed trace: only its unit is recomputed, and the outputs match a fresh sweep of the new dataset.
    changed = dataset
    assert run(kvsim_bin, "synth", "--config", SYNTH / "tiny.textproto", "--out", changed / "traces" / "s3.h5",
               "--seed", 999, "--threads", "1").returncode == 0
    shutil.copytree(out, tmp_path / "resumed")
    res = sweep(kvsim_bin, changed, tmp_path / "resumed", "--resume")
    assert res.returncode == 0, res.stderr
    assert f"1 units computed, {N - 1} reused" in res.stderr
    fresh = tmp_path / "fresh"
    assert sweep(kvsim_bin, changed, fresh).returncode == 0
    same_outputs(fresh, tmp_path / "resumed")
    # Without --resume every unit is recomputed; a changed experiment definition is never reused.
    res = sweep(kvsim_bin, changed, tmp_path / "resumed")
    assert f"{N} units computed, 0 reused" in res.stderr
    (changed / "exp.textproto").write_text(EXPERIMENT.replace("budgets: 0.75", "budgets: 0.7"))
    res = sweep(kvsim_bin, changed, tmp_path / "resumed", "--resume")
    assert f"{N} units computed, 0 reused" in res.stderr
    assert len(units(tmp_path / "resumed")) == N  # the old definition's units are gone


def test_manifest_ids_tags_and_relative_paths(kvsim_bin, dataset, tmp_path):
    m = dataset / "manifest.csv"
    m.write_text("# a dataset\nid,path,tags\n" + "".join(
        f"q{i},traces/s{i}.h5,task=qa;len={'short' if i < 3 else 'long'}\n" for i in range(N)))
    out = tmp_path / "out"
    res = run(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--manifest", m, "--out", out, "-q")
    assert res.returncode == 0, res.stderr
    rows = (out / "runs.csv").read_text().splitlines()
    assert rows[1].endswith(",q0,task=qa;len=short,tiny-mha L=3 H=4 KV=4 D=32")


@pytest.mark.parametrize("manifest,message", [
    ("id,path\na,traces/s0.h5\na,traces/s1.h5\n", "duplicate sample id 'a'"),
    ("id,path\na,traces/s0.h5\nb,traces/missing.h5\n", "manifest.csv:3: trace 'traces/missing.h5' not found"),
    ("id,path,tags\na,traces/s0.h5\nb\n", "manifest.csv:3: 1 fields"),
    ("id,path\na,traces/s0.h5,x=1\n", "manifest.csv:2: 3 fields"),
    ("id,path,tags\na,traces/s0.h5,novalue\n", "manifest.csv:2: tag 'novalue' must be key=value"),
    ("path,id\n", "manifest.csv:1: the first line must be the header"),
    ("id,path\nbad id,traces/s0.h5\n", "manifest.csv:2: sample id 'bad id'"),
])
def test_bad_manifest_one_line_error_no_output(kvsim_bin, dataset, tmp_path, manifest, message):
    m = dataset / "manifest.csv"
    m.write_text(manifest)
    out = tmp_path / "out"
    res = run(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--manifest", m, "--out", out, "-q")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error:") and message in lines[0], res.stderr
    assert not out.exists()


def test_empty_folder_and_unreadable_trace(kvsim_bin, dataset, tmp_path):
    (tmp_path / "empty").mkdir()
    res = run(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace", tmp_path / "empty", "--out",
              tmp_path / "out", "-q")
    assert res.returncode == 1 and "holds no traces" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    shutil.copytree(dataset / "traces", bad)
    (bad / "s2.h5").write_bytes(b"not a trace")
    res = run(kvsim_bin, "sweep", "--config", dataset / "exp.textproto", "--trace", bad, "--out", tmp_path / "out",
              "-q")
    assert res.returncode == 1 and "s2.h5" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_trace_turning_bad_mid_sweep_is_a_failed_unit(kvsim_bin, dataset, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(dataset, d)
    out = tmp_path / "out"
    p = subprocess.Popen([kvsim_bin, "sweep", "--config", d / "exp.textproto", "--trace", d / "traces", "--out", out,
                          "-q", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while p.poll() is None and len(units(out)) < 1:
        time.sleep(0.001)
    p.send_signal(signal.SIGSTOP)
    stopped_at = len(units(out))
    (d / "traces" / f"s{N - 1}.h5").write_bytes(b"truncated")  # the last unit has not started (asserted)
    p.send_signal(signal.SIGCONT)
    _, err = p.communicate()
    assert 1 <= stopped_at <= N - 3, "the sweep ran too fast to stop before its last unit"
    assert p.returncode == 4, err
    assert f"sample 's{N - 1}' failed" in err
    summary = (out / "summary.md").read_text()
    assert "## Failed units" in summary and f"s{N - 1}" in summary
    assert f"s{N - 1}" not in {r.split(",")[-3] for r in (out / "runs.csv").read_text().splitlines()[1:]}
    assert '"failed_units": [' in (out / "results.json").read_text()
