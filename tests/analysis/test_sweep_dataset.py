"""`kvsim sweep` over datasets (analysis/sweep.cc, analysis/dataset.cc; docs/cli.md "Datasets", "Resume"):
folders and manifests, aggregates, a real SIGKILL in the middle then --resume (byte-identical outputs), a
changed trace recomputed alone, a trace that turns bad mid-sweep (failed unit, exit 4), and the one-line errors
before any work; samples of one shape with different prompt lengths (one cell per fractional budget); the
manifest's declared groups; streaming datasets (analysis/stream_sweep.cc: rows, aggregates, units, --resume,
failed units) and streaming + plain traces refused."""
import json
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


# ---- prompt lengths, declared groups, streaming datasets ------------------------------------------------------

STREAM_EXPERIMENT = """traces: "unused.h5"
policies { name: "stream_full" }
policies { name: "rekv" }
policies { name: "stream_recent" }
budget_tokens: 16
budget_tokens: 64
seed: 5
"""
STREAM_OUTPUTS = ["results.json", "runs.csv", "questions.csv", "memory.csv", "aggregates.csv", "summary.md"]
NS = 4


def csv_rows(path):
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def one_line_error(res, *needles):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("kvsim: error:"), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_prompt_lengths_in_one_group_one_cell_per_fractional_budget(kvsim_bin, tmp_path):
    # Three samples of one model shape (tiny-mha) with prompts of different lengths: a fractional budget is one
    # aggregate cell per (policy, budget) whatever it makes in tokens; n and the mean are the per-sample rows'.
    tiny = (SYNTH / "tiny.textproto").read_text()
    assert "role: QUESTION tokens: 10 }" in tiny
    paths = []
    for i, q in enumerate([10, 40, 90]):
        cfg = tmp_path / f"len{q}.textproto"
        cfg.write_text(tiny.replace("role: QUESTION tokens: 10 }", f"role: QUESTION tokens: {q} }}"))
        paths.append(tmp_path / f"len{q}.h5")
        assert run(kvsim_bin, "synth", "--config", cfg, "--out", paths[-1], "--threads", "1").returncode == 0
    (tmp_path / "exp.textproto").write_text('traces: "unused.h5"\npolicies { name: "snapkv" }\n'
                                            'policies { name: "full" }\nbudgets: 0.2\nbudgets: 0.5\nseed: 3\n')
    out = tmp_path / "out"
    args = [a for p in paths for a in ("--trace", p)]
    res = run(kvsim_bin, "sweep", "--config", tmp_path / "exp.textproto", *args, "--out", out, "-q")
    assert res.returncode == 0, res.stderr
    runs = csv_rows(out / "runs.csv")
    assert {r["group"] for r in runs} == {"tiny-mha L=3 H=4 KV=4 D=32"}
    aggs = csv_rows(out / "aggregates.csv")
    for budget in ("0.2", "0.5"):
        mine = [r for r in runs if r["policy"] == "snapkv" and r["budget_fraction"] == budget]
        assert [r["sample_id"] for r in mine] == ["len10", "len40", "len90"]
        tokens = [int(r["budget_tokens"]) for r in mine]
        assert len(set(tokens)) == 3 and tokens == sorted(tokens)  # longer prompts, more tokens
        cells = [a for a in aggs if a["policy"] == "snapkv" and a["budget_fraction"] == budget]
        assert sorted(a["metric"] for a in cells) == sorted(
            ["retained_mass_mean", "output_rel_error_mean", "regret_vs_oracle_mean", "kv_memory_ratio"])
        for a in cells:
            assert int(a["n"]) == 3
            assert int(a["budget_tokens"]) == tokens[0]  # the first sample's (docs/cli.md)
            by_hand = sum(float(r[a["metric"]]) for r in mine) / 3
            assert float(a["mean"]) == pytest.approx(by_hand, rel=1e-12, abs=1e-15)
            assert float(a["ci95_low"]) <= float(a["mean"]) <= float(a["ci95_high"])
    # full runs once per sample: one cell of n = 3.
    assert len({(a["policy"], a["budget_fraction"]) for a in aggs}) == 3


def test_manifest_group_declared_and_checked_before_any_work(kvsim_bin, dataset, tmp_path):
    d = shutil.copytree(dataset, tmp_path / "ds")
    assert run(kvsim_bin, "synth", "--config", SYNTH / "tiny_gqa.textproto", "--out", d / "gqa.h5",
               "--threads", "1").returncode == 0
    good = "tiny-mha L=3 H=4 KV=4 D=32"
    m = d / "m.csv"
    m.write_text(f"id,path,tags,group\na,traces/s0.h5,task=qa,{good}\nb,traces/s1.h5,,tiny-mha L=3\n"
                 "c,traces/s2.h5,,tiny-mha\n")
    out = tmp_path / "out"
    res = run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--manifest", m, "--out", out, "-q")
    assert res.returncode == 0, res.stderr
    assert {r["group"] for r in csv_rows(out / "runs.csv")} == {good}
    # The columns may come in any order after id,path; the group column alone is fine too.
    m.write_text("id,path,group,tags\na,traces/s0.h5,tiny-mha,k=v\n")
    assert run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--manifest", m, "--out", tmp_path / "o1",
               "-q").returncode == 0
    for text, needles in [
        # Another model in the dataset: refused naming manifest:line, the field, what differs and the fix.
        ("id,path,group\na,traces/s0.h5,tiny-mha\nb,gqa.h5,tiny-mha\n",
         ["m.csv:3: field 'group'", "model 'tiny-gqa', not 'tiny-mha'", "fix the sample's group"]),
        # Same model name, another shape.
        ("id,path,group\na,traces/s0.h5,tiny-mha L=3 KV=2\n", ["m.csv:2: field 'group'", "KV=4, not 2"]),
        ("id,path,group\na,traces/s0.h5,tiny-mha L=x\n", ["m.csv:2: field 'group'", "L='x' is not a positive"]),
        ("id,path,group\na,traces/s0.h5,tiny-mha Q=3\n", ["m.csv:2: field 'group'", "'Q=3' is not L=, H=, KV= or D="]),
        ("id,path,group\na,traces/s0.h5,L=3\n", ["m.csv:2: field 'group'", "does not start with a model name"]),
        ("id,path,group,group\n", ["m.csv:1: the first line must be the header"]),
    ]:
        m.write_text(text)
        res = run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--manifest", m, "--out", tmp_path / "o2", "-q")
        one_line_error(res, *needles)
        assert not (tmp_path / "o2").exists()  # nothing written, not even units/


@pytest.fixture(scope="module")
def stream_dataset(kvsim_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_dataset")
    (d / "traces").mkdir()
    for i in range(NS):
        res = run(kvsim_bin, "synth", "--config", SYNTH / "streaming_tiny.textproto", "--out",
                  d / "traces" / f"v{i}.h5", "--seed", 40 + i, "--threads", "1")
        assert res.returncode == 0, res.stderr
    (d / "exp.textproto").write_text(STREAM_EXPERIMENT)
    (d / "m.csv").write_text("id,path,tags\n" + "".join(
        f"clip{i},traces/v{i}.h5,scene={'a' if i % 2 else 'b'}\n" for i in range(NS)))
    return d


def stream_sweep(kvsim_bin, d, out, *extra):
    return run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--manifest", d / "m.csv", "--out", out, "-q",
               "--threads", "1", *extra)


def test_streaming_dataset_rows_aggregates_units_resume(kvsim_bin, stream_dataset, tmp_path):
    d = stream_dataset
    ref = tmp_path / "ref"
    res = stream_sweep(kvsim_bin, d, ref)
    assert res.returncode == 0, res.stderr
    assert f"({NS} units computed, 0 reused)" in res.stderr
    runs = csv_rows(ref / "runs.csv")
    assert list(runs[0])[-3:] == ["sample_id", "tags", "group"]
    # stream_full once, rekv and stream_recent at two budgets: 5 runs per sample.
    assert len(runs) == 5 * NS
    assert [r["sample_id"] for r in runs[::5]] == [f"clip{i}" for i in range(NS)]
    assert runs[5]["tags"] == "scene=a" and {r["group"] for r in runs} == {"tiny-stream L=4 H=4 KV=2 D=16"}
    doc = json.loads((ref / "results.json").read_text())
    assert doc["runs"][0]["sample_id"] == "clip0" and doc["runs"][0]["sample_tags"] == ["scene=b"]
    aggs = csv_rows(ref / "aggregates.csv")
    metrics = ["retained_mass_mean", "output_rel_error_mean", "evidence_frame_recall", "oracle_frame_recall",
               "oracle_mass_recall", "gpu_bytes_peak"]
    assert [a["metric"] for a in aggs[:6]] == metrics
    assert len(aggs) == 5 * len(metrics)  # 5 cells (policy, budget)
    for a in aggs:
        mine = [r for r in runs if r["label"] == a["label"] and r["budget_tokens"] == a["budget_tokens"]]
        assert int(a["n"]) == NS == len(mine)
        assert float(a["mean"]) == pytest.approx(sum(float(r[a["metric"]]) for r in mine) / NS, rel=1e-12, abs=1e-15)
        assert float(a["ci95_low"]) <= float(a["mean"]) <= float(a["ci95_high"])
    rekv = [a for a in aggs if a["label"] == "rekv" and a["budget_tokens"] == "16" and a["metric"] == "evidence_frame_recall"]
    assert len(rekv) == 1 and float(rekv[0]["sd"]) > 0 and float(rekv[0]["ci95_low"]) < float(rekv[0]["ci95_high"])
    summary = (ref / "summary.md").read_text()
    assert "## Sample `clip3`" in summary and "## Across samples" in summary
    assert "| rekv | 16 tok | 4 |" in summary
    assert units(ref) == sorted(p.name for p in (ref / "units").glob("clip*.json")) and len(units(ref)) == NS
    # --resume after losing two units (a sweep killed before writing them): those two are recomputed and
    # every output is byte-identical; at another thread count too.
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    for name in units(out)[1:3]:
        (out / "units" / name).unlink()
    res = stream_sweep(kvsim_bin, d, out, "--resume")
    assert res.returncode == 0, res.stderr
    assert f"(2 units computed, {NS - 2} reused)" in res.stderr
    for f in STREAM_OUTPUTS:
        assert (ref / f).read_bytes() == (out / f).read_bytes(), f
    res = run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--manifest", d / "m.csv", "--out",
              tmp_path / "t2", "-q", "--threads", "2")
    assert res.returncode == 0, res.stderr
    for f in STREAM_OUTPUTS:
        assert (ref / f).read_bytes() == (tmp_path / "t2" / f).read_bytes(), f
    # A changed experiment reuses nothing.
    exp2 = tmp_path / "exp2.textproto"
    exp2.write_text(STREAM_EXPERIMENT.replace("budget_tokens: 64", "budget_tokens: 48"))
    res = run(kvsim_bin, "sweep", "--config", exp2, "--manifest", d / "m.csv", "--out", out, "-q", "--resume")
    assert res.returncode == 0 and f"({NS} units computed, 0 reused)" in res.stderr, res.stderr
    assert len(units(out)) == NS


def corrupt_a_chunk(path):
    """Flips bytes inside a chunk of the trace's largest dataset: the file still opens and passes the
    up-front checks, and its Fletcher32 checksum fails when the replay reads that chunk."""
    import h5py

    with h5py.File(path) as f:
        found = []
        f.visititems(lambda n, o: found.append(o) if isinstance(o, h5py.Dataset) and o.chunks else None)
        d = max(found, key=lambda o: o.nbytes)
        assert d.fletcher32
        info = d.id.get_chunk_info(d.id.get_num_chunks() // 2)
        offset = info.byte_offset + info.size // 2
    data = bytearray(Path(path).read_bytes())
    for k in range(16):
        data[offset + k] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def test_streaming_failed_unit_and_mixed_kinds(kvsim_bin, stream_dataset, dataset, tmp_path):
    d = shutil.copytree(stream_dataset, tmp_path / "ds")
    corrupt_a_chunk(d / "traces" / "v1.h5")
    out = tmp_path / "out"
    res = stream_sweep(kvsim_bin, d, out)
    assert res.returncode == 4, res.stderr
    assert "sample 'clip1' failed" in res.stderr and "checksum" in res.stderr
    assert "clip1" not in {r["sample_id"] for r in csv_rows(out / "runs.csv")}
    assert {int(a["n"]) for a in csv_rows(out / "aggregates.csv")} == {NS - 1}
    assert "## Failed units" in (out / "summary.md").read_text()
    failed = json.loads((out / "results.json").read_text())["failed_units"]
    assert [f["sample_id"] for f in failed] == ["clip1"]
    assert len(units(out)) == NS - 1
    # Streaming and plain traces in one sweep: refused before any work, naming a sample of each kind.
    (d / "m.csv").write_text(f"id,path\nclip0,traces/v0.h5\nplain,{dataset / 'traces' / 's0.h5'}\n")
    res = stream_sweep(kvsim_bin, d, tmp_path / "o2")
    one_line_error(res, "mixes streaming and non-streaming", "sample 'clip0'", "sample 'plain'", "split")
    assert not (tmp_path / "o2").exists()
    shutil.copy(dataset / "traces" / "s0.h5", d / "traces" / "plain.h5")
    res = run(kvsim_bin, "sweep", "--config", d / "exp.textproto", "--trace", d / "traces", "--out", tmp_path / "o2",
              "-q")
    one_line_error(res, "mixes streaming and non-streaming")
    assert not (tmp_path / "o2").exists()
