"""The kvsim Python package (python/kvsim, docs/python.md) against the CLI on the same runs: identical
results, identical sweep folders, tidy frames that agree with runs.csv / layers.csv, Trace against h5py, errors with the
CLI's one-line messages, the GIL released while replaying, the capture tool as kvsim.capture, the `kvsim`
command of the package."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import kvsim
from conftest import SRC, SYNTH, cli


# A model shape of the tiny trace's size for the device latency model (configs/models/ format).
TINY_SHAPE = """name: "tiny-mha" num_layers: 3 num_heads: 4 num_kv_heads: 4 head_dim: 32 hidden_size: 128
intermediate_size: 344 vocab_size: 1000 dtype_bytes: 2 kv_dtype_bytes: 2 source: "kvsim tests"
"""


@pytest.fixture(scope="session")
def tiny_shape(tmp_path_factory):
    p = tmp_path_factory.mktemp("shape") / "tiny_mha.textproto"
    p.write_text(TINY_SHAPE)
    return str(p)


def cli_run(kvsim_bin, tmp_path, *args):
    out = tmp_path / f"cli_{abs(hash(args))}.json"
    cli(kvsim_bin, "run", *args, "--out", out)
    return json.loads(out.read_text())


# ---- run: the same numbers as `kvsim run` -----------------------------------------------------------------

RUN_CASES = [
    # (CLI arguments after --trace T, kvsim.run keyword arguments)
    (["--policy", "snapkv", "--budget", "0.25"], dict(policy="snapkv", budget=0.25)),
    (["--policy", "h2o", "--budget-tokens", "12", "--set", "heavy_fraction=0.25"],
     dict(policy="h2o", budget_tokens=12, heavy_fraction=0.25)),
    (["--policy", "pyramidkv", "--budget", "0.3", "--set", "window=4", "--question-mode", "agnostic"],
     dict(policy="pyramidkv", budget=0.3, window=4, question_mode="agnostic")),
    (["--policy", "full", "--budget", "1"], dict(policy="full", budget=1.0)),
    (["--policy", "snapkv", "--budget", "0.2", "--device", "a100-sxm", "--model", "{shape}",
      "--prefill-chunk", "32"],
     dict(policy="snapkv", budget=0.2, device="a100-sxm", model="{shape}", prefill_chunk=32)),
    (["--policy", "snapkv+average", "--budget", "0.3"], dict(policy="snapkv+average", budget=0.3)),
]


@pytest.mark.parametrize("cli_args,kwargs", RUN_CASES, ids=lambda c: str(c)[:40])
def test_run_matches_cli(kvsim_bin, traces, tmp_path, tiny_shape, cli_args, kwargs):
    cli_args = [a.replace("{shape}", tiny_shape) for a in cli_args]
    kwargs = {k: v.replace("{shape}", tiny_shape) if isinstance(v, str) else v for k, v in kwargs.items()}
    expected = cli_run(kvsim_bin, tmp_path, "--trace", traces["tiny"], *cli_args, "--threads", "1")
    got = kvsim.run(traces["tiny"], threads=2, **kwargs)
    assert got == expected  # every field, every number (threads never change results)
    assert got["metrics"]["retained_mass_mean"] > 0


def test_run_gqa_and_params_dict(kvsim_bin, traces, tmp_path):
    expected = cli_run(kvsim_bin, tmp_path, "--trace", traces["gqa"], "--policy", "adakv", "--budget", "0.2",
                       "--set", "window=8")
    assert kvsim.run(traces["gqa"], "adakv", 0.2, params={"window": 8}) == expected
    assert kvsim.run(Path(traces["gqa"]), "adakv", 0.2, window=8) == expected  # os.PathLike


def test_run_streaming_matches_cli(kvsim_bin, traces, tmp_path):
    expected = cli_run(kvsim_bin, tmp_path, "--trace", traces["stream"], "--policy", "rekv", "--budget-tokens",
                       "16")
    got = kvsim.run(traces["stream"], "rekv", budget_tokens=16)
    assert got == expected
    assert got["questions"] and "mean" in got


# ---- sweep: the same folder as `kvsim sweep` -------------------------------------------------------------

EXPERIMENT = """
traces: "{trace}"
policies {{ name: "snapkv" }}
policies {{ name: "h2o" set: "heavy_fraction=0.5" label: "h2o half" }}
policies {{ name: "full" }}
budgets: 0.2
budgets: 0.5
budget_tokens: 10
"""


def test_sweep_matches_cli(kvsim_bin, traces, tmp_path):
    exp = tmp_path / "exp.textproto"
    exp.write_text(EXPERIMENT.format(trace=traces["tiny"]))
    cli(kvsim_bin, "sweep", "--config", exp, "--out", tmp_path / "cli_out")
    runs = kvsim.sweep(exp, out=tmp_path / "py_out", threads=1)
    cli_files = sorted(p.name for p in (tmp_path / "cli_out").iterdir())
    assert cli_files == sorted(p.name for p in (tmp_path / "py_out").iterdir())
    for name in cli_files:  # byte-identical outputs (and unit files)
        if name == "units":
            assert sorted(p.name for p in (tmp_path / "cli_out" / "units").iterdir()) == sorted(
                p.name for p in (tmp_path / "py_out" / "units").iterdir())
            continue
        assert (tmp_path / "cli_out" / name).read_bytes() == (tmp_path / "py_out" / name).read_bytes(), name
    assert runs == json.loads((tmp_path / "cli_out" / "results.json").read_text())["runs"]
    assert len(runs) == 2 * 3 + 1  # full runs once

    # The same experiment from lists instead of a file: the same runs.
    listed = kvsim.sweep(traces=[traces["tiny"]],
                         policies=["snapkv", {"name": "h2o", "params": {"heavy_fraction": 0.5}, "label": "h2o half"},
                                   "full"],
                         budgets=[0.2, 0.5], budget_tokens=[10])
    assert listed == runs
    # Overriding a file's fields: only these budgets, only snapkv.
    some = kvsim.sweep(exp, policies=[("snapkv", {"window": 4})], budgets=[0.5], budget_tokens=[])
    assert [(r["label"], r["budget_fraction"]) for r in some] == [("snapkv window=4", 0.5)]
    # A sweep's runs also name their sample and group (dataset sweeps); a single run has none.
    assert (some[0]["sample_id"], some[0]["group"]) == ("tiny", "tiny-mha L=3 H=4 KV=4 D=32")
    assert {k: v for k, v in some[0].items() if k not in ("sample_id", "sample_tags", "group")} == {
        k: v for k, v in kvsim.run(traces["tiny"], "snapkv", 0.5, window=4).items()
        if k not in ("sample_id", "sample_tags", "group")}


def test_sweep_resume_reuses_units_byte_identical(kvsim_bin, traces, tmp_path):
    """kvsim.sweep(resume=True) is `kvsim sweep --resume`: finished units are read back, not replayed, and the
    outputs are byte-identical; a changed trace is recomputed."""
    t = tmp_path / "t"
    t.mkdir()
    shutil.copy(traces["tiny"], t / "a.h5")
    shutil.copy(traces["gqa"], t / "b.h5")
    exp = tmp_path / "exp.textproto"
    exp.write_text(EXPERIMENT.format(trace=t / "a.h5") + f'traces: "{t / "b.h5"}"\n')
    out = tmp_path / "out"
    first = kvsim.sweep(exp, out=out, threads=1)
    files = {f: (out / f).read_bytes() for f in ("results.json", "runs.csv", "aggregates.csv", "summary.md")}
    unit_files = sorted((out / "units").iterdir())
    assert len(unit_files) == 2
    stamps = [u.stat().st_mtime_ns for u in unit_files]
    time.sleep(0.01)
    again = kvsim.sweep(exp, out=out, threads=1, resume=True)
    assert again == first
    assert [u.stat().st_mtime_ns for u in unit_files] == stamps  # read back, not rewritten
    assert {f: (out / f).read_bytes() for f in files} == files
    # A changed trace: its unit alone is recomputed (b's unit file untouched).
    shutil.copy(traces["tiny"], t / "b.h5")
    changed = kvsim.sweep(exp, out=out, threads=1, resume=True)
    assert unit_files[0].stat().st_mtime_ns == stamps[0] and unit_files[1].stat().st_mtime_ns != stamps[1]
    assert changed == kvsim.sweep(exp, threads=1)
    # Without --resume every unit is replayed; resume needs an output folder.
    kvsim.sweep(exp, out=out, threads=1)
    assert unit_files[0].stat().st_mtime_ns != stamps[0]
    with pytest.raises(kvsim.KvsimError, match="resume=True reuses the finished units of an output folder"):
        kvsim.sweep(exp, resume=True)


def test_degenerate_run_warnings_are_saved_like_the_cli(kvsim_bin, traces, tmp_path):
    # tiny's prompt is 94 tokens: budget 0.2 = 19 tokens, at or below snapkv's 32-token window.
    got = kvsim.run(traces["tiny"], "snapkv", 0.2)
    assert got == cli_run(kvsim_bin, tmp_path, "--trace", traces["tiny"], "--policy", "snapkv", "--budget", "0.2")
    assert len(got["warnings"]) == 1 and "observation window of 32 tokens" in got["warnings"][0]
    assert kvsim.run(traces["tiny"], "snapkv", 0.5)["warnings"] == []  # 47 tokens: nothing off
    exp = tmp_path / "exp.textproto"
    exp.write_text(EXPERIMENT.format(trace=traces["tiny"]))
    warned = {(r["label"], r["budget_tokens"]): r["warnings"] for r in kvsim.sweep(exp)}
    assert "ignores the budget" in warned[("full", 94)][0]
    assert "at or below snapkv's observation window" in warned[("snapkv", 19)][0]
    assert warned[("snapkv", 47)] == [] and warned[("h2o half", 19)] == []


def test_sweep_streaming_matches_cli(kvsim_bin, traces, tmp_path):
    exp = tmp_path / "stream.textproto"
    exp.write_text(f'traces: "{traces["stream"]}"\npolicies {{ name: "rekv" }}\npolicies {{ name: "stream_recent" }}\n'
                   "budget_tokens: 16\n")
    cli(kvsim_bin, "sweep", "--config", exp, "--out", tmp_path / "cli_out")
    runs = kvsim.sweep(exp, out=tmp_path / "py_out")
    for p in (tmp_path / "cli_out").iterdir():
        if p.name == "units":  # both keep the streaming sweep's units, the same files
            for u in p.iterdir():
                assert u.read_bytes() == (tmp_path / "py_out" / "units" / u.name).read_bytes(), u.name
            assert len(list((tmp_path / "py_out" / "units").iterdir())) == len(list(p.iterdir()))
            continue
        assert p.read_bytes() == (tmp_path / "py_out" / p.name).read_bytes(), p.name
    assert runs == json.loads((tmp_path / "cli_out" / "results.json").read_text())["runs"]


# ---- load_results: tidy frames -----------------------------------------------------------------------------

def test_load_results_agrees_with_the_tables(kvsim_bin, traces, tmp_path, tiny_shape):
    exp = tmp_path / "exp.textproto"
    exp.write_text(EXPERIMENT.format(trace=traces["tiny"]))
    cli(kvsim_bin, "sweep", "--config", exp, "--out", tmp_path / "out", "--device", "h100-sxm", "--model",
        tiny_shape)
    runs = kvsim.load_results(tmp_path / "out")
    assert len(runs) == 7 and runs["label"].is_unique is False
    with open(tmp_path / "out" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(runs)
    for (_, run), row in zip(runs.iterrows(), rows):
        assert run["label"] == row["label"] and run["budget_tokens"] == int(row["budget_tokens"])
        for col in ("retained_mass_mean", "output_rel_error_mean", "kv_memory_ratio", "kv_bytes_peak"):
            assert math.isclose(run[col], float(row[col]), rel_tol=1e-8, abs_tol=1e-12), col
        assert math.isclose(run["latency_ms_per_output_token"], float(row["ms_per_output_token"]), rel_tol=1e-8)
        assert math.isclose(run["kept_tokens_by_modality_image"], float(row["kept_image"]), rel_tol=1e-8)
    assert runs["trace_seed"].dtype.kind in "iu"

    layers = kvsim.load_results(tmp_path / "out" / "results.json", level="layer")
    with open(tmp_path / "out" / "layers.csv") as f:
        per_layer = list(csv.DictReader(f))
    assert len(layers) == len(per_layer) == 7 * 3
    assert layers["layer"].dtype == np.int64 and sorted(layers["layer"].unique()) == [0, 1, 2]
    for (_, lay), row in zip(layers.iterrows(), per_layer):
        assert lay["layer"] == int(row["layer"])
        assert math.isclose(lay["retained_mass_mean"], float(row["retained_mass_mean"]), rel_tol=1e-8,
                            abs_tol=1e-12)
    heads = kvsim.load_results(tmp_path / "out", level="head")
    assert len(heads) == 7 * 3 * 4 and set(heads["kv_head"]) == {0, 1, 2, 3}
    timeline = kvsim.load_results(tmp_path / "out", level="timeline")
    assert set(timeline["event"]) == {"prefill", "decode"}
    # A single run's result.json, and the dicts kvsim.run returns.
    one = kvsim.run(traces["tiny"], "snapkv", 0.2)
    assert kvsim.to_frame(one).loc[0, "retained_mass_mean"] == one["metrics"]["retained_mass_mean"]


def test_load_results_streaming_levels(traces, tmp_path):
    kvsim.sweep(traces=[traces["stream"]], policies=["rekv"], budget_tokens=[8, 16], out=tmp_path / "s")
    runs = kvsim.load_results(tmp_path / "s")
    assert list(runs["budget_tokens"]) == [8, 16] and "evidence_frame_recall" in runs
    questions = kvsim.load_results(tmp_path / "s", level="question")
    assert len(questions) == 2 * len(kvsim.Trace(traces["stream"]).stream["questions"])
    assert len(kvsim.load_results(tmp_path / "s", level="memory")) > 0
    with pytest.raises(kvsim.KvsimError, match="level='layer': a streaming result has levels run, question"):
        kvsim.load_results(tmp_path / "s", level="layer")


def test_load_results_errors(tmp_path):
    with pytest.raises(kvsim.KvsimError, match="no such file or folder") as e:
        kvsim.load_results(tmp_path / "nope")
    assert e.value.code == "not_found"
    (tmp_path / "empty").mkdir()
    with pytest.raises(kvsim.KvsimError, match="folder has no results.json"):
        kvsim.load_results(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(kvsim.KvsimError, match="not a kvsim results file"):
        kvsim.load_results(tmp_path / "bad.json")


# ---- Trace: the C++ reader against h5py ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "gqa", "stream"])
def test_trace_matches_h5py(traces, name):
    t = kvsim.Trace(traces[name])
    with h5py.File(traces[name], "r") as f:
        a = f.attrs
        for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            assert t.model[key] == int(a[key])
        assert t.prefill_length == int(a["prefill_length"])
        assert t.num_decode_steps == int(a["num_decode_steps"])
        assert t.num_layers == int(a["num_layers"]) and t.is_streaming == (name == "stream")
        np.testing.assert_array_equal(t.query_positions, f["queries/positions"][:])
        tok = t.tokens
        assert len(tok) == t.total_tokens
        names = f["tokens/modality"].attrs["names"]
        names = (names.decode() if isinstance(names, bytes) else str(names)).split(",")
        assert list(tok["modality"].astype(str)) == [names[c] for c in f["tokens/modality"][:]]
        for col in ("segment_id", "patch_row", "patch_col", "position_id", "token_id"):
            np.testing.assert_array_equal(tok[col].to_numpy(), f[f"tokens/{col}"][:])
        assert list(tok["role"].astype(str).unique()) and set(tok.loc[tok["phase"] == "decode", "role"]) <= {
            "generated", "question"}
        for layer in range(t.num_layers):
            got = t.layer(layer)
            g = f[f"layers/layer_{layer:03d}"]
            for key in ("keys", "values", "queries"):
                arr = getattr(got, key)
                assert arr.dtype == np.float32 and arr.flags.c_contiguous
                np.testing.assert_array_equal(arr, g[key][:].astype(np.float32))
            if t.meta["has_prefill_column_sums"]:
                np.testing.assert_array_equal(got.prefill_column_sums,
                                              f[f"aggregates/layer_{layer:03d}/prefill_column_sums"][:])
            else:
                assert got.prefill_column_sums is None
            assert got.prompt_entropies is None  # none of these fixtures records them
    assert t.meta["prompt_entropy_regions"].shape == (0,)
    assert len(list(t.layers())) == t.num_layers
    assert t.hash() == kvsim.run(traces["tiny"], "full", 1.0)["trace_hash"] if name == "tiny" else True
    assert "layers" in t.stats() if name != "stream" else t.stats()
    assert repr(t).startswith("<kvsim.Trace")


def test_trace_recorded_prompt_entropies_match_h5py(kvsim_bin, tmp_path):
    cfg = (SYNTH / "tiny.textproto").read_text().replace("storage {", "storage {\n  record_prompt_entropies: true", 1)
    assert "record_prompt_entropies" in cfg
    (tmp_path / "tiny_ent.textproto").write_text(cfg)
    path = tmp_path / "tiny_ent.h5"
    cli(kvsim_bin, "synth", "--config", tmp_path / "tiny_ent.textproto", "--out", path, "--threads", "1")
    t = kvsim.Trace(path)
    with h5py.File(path, "r") as f:
        regions = f["aggregates/prompt_entropy_regions"][:]
        assert regions.size >= 1
        np.testing.assert_array_equal(t.meta["prompt_entropy_regions"], regions)
        assert t.meta["prompt_entropy_regions"].dtype == np.int32
        for layer in range(t.num_layers):
            got = t.layer(layer).prompt_entropies
            assert got.dtype == np.float64 and got.shape == (regions.size, 3, t.model["num_heads"])
            np.testing.assert_array_equal(got, f[f"aggregates/layer_{layer:03d}/prompt_entropies"][:])


def test_trace_arrays_outlive_the_trace(traces):
    keys = kvsim.Trace(traces["tiny"]).layer(1).keys  # the trace object is gone; the array owns its data
    import gc
    gc.collect()
    with h5py.File(traces["tiny"], "r") as f:
        np.testing.assert_array_equal(keys, f["layers/layer_001/keys"][:])


# ---- errors: KvsimError with the CLI's message -------------------------------------------------------------

def cli_error(kvsim_bin, *args):
    res = cli(kvsim_bin, *args, check=False)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error: "), res.stderr
    return lines[0][len("kvsim: error: "):]


def test_errors_carry_the_cli_message(kvsim_bin, traces, tmp_path):
    missing = str(tmp_path / "missing.h5")
    cut = tmp_path / "cut.h5"
    cut.write_bytes(Path(traces["tiny"]).read_bytes()[:5000])
    out = str(tmp_path / "o.json")
    cases = [
        (["--trace", missing, "--policy", "snapkv", "--budget", "0.2"], dict(trace=missing, policy="snapkv", budget=0.2)),
        (["--trace", traces["tiny"], "--policy", "nosuch", "--budget", "0.2"],
         dict(trace=traces["tiny"], policy="nosuch", budget=0.2)),
        (["--trace", traces["tiny"], "--policy", "snapkv", "--budget", "0.2", "--set", "windw=3"],
         dict(trace=traces["tiny"], policy="snapkv", budget=0.2, windw=3)),
        (["--trace", traces["gqa"], "--policy", "snapkv", "--budget", "0.25", "--set", "window=48"],
         dict(trace=traces["gqa"], policy="snapkv", budget=0.25, window=48)),
        (["--trace", str(cut), "--policy", "snapkv", "--budget", "0.2"], dict(trace=str(cut), policy="snapkv", budget=0.2)),
        (["--trace", traces["tiny"], "--policy", "rekv", "--budget", "0.2"], dict(trace=traces["tiny"], policy="rekv", budget=0.2)),
        (["--trace", traces["tiny"], "--policy", "snapkv", "--budget", "0.2", "--device", "tpu"],
         dict(trace=traces["tiny"], policy="snapkv", budget=0.2, device="tpu")),
    ]
    for cli_args, kwargs in cases:
        expected = cli_error(kvsim_bin, "run", *cli_args, "--out", out)
        with pytest.raises(kvsim.KvsimError) as e:
            kvsim.run(**kwargs)
        assert str(e.value) == expected
        assert isinstance(e.value, ValueError)
    assert not os.path.exists(out)
    # Opening a damaged trace: the message of `kvsim validate`.
    expected = cli_error(kvsim_bin, "validate", str(cut))
    with pytest.raises(kvsim.KvsimError) as e:
        kvsim.Trace(cut)
    assert str(e.value) == expected
    with pytest.raises(kvsim.KvsimError) as e:
        kvsim.Trace(missing)
    assert str(e.value) == cli_error(kvsim_bin, "validate", missing) and e.value.code == "not_found"
    # A bad experiment file: the message of `kvsim sweep`.
    bad = tmp_path / "bad.textproto"
    bad.write_text(f'traces: "{traces["tiny"]}"\npolicies {{ name: "snapkv" }}\nbudgets: 1.5\n')
    expected = cli_error(kvsim_bin, "sweep", "--config", bad, "--out", tmp_path / "o")
    with pytest.raises(kvsim.KvsimError) as e:
        kvsim.sweep(bad)
    assert str(e.value) == expected


def test_argument_errors(traces):
    t = traces["tiny"]
    for kwargs, message in [
        (dict(budget=1.5), r"budget=1.5: must be a fraction in \(0, 1\]; use budget_tokens= for token counts"),
        (dict(budget=0.2, budget_tokens=3), "not both"),
        (dict(budget_tokens=0), "budget_tokens=0: must be an integer >= 1"),
        (dict(), "give budget="),
        (dict(budget=0.2, threads=-1), "threads=-1"),
        (dict(budget=0.2, question_mode="maybe"), "question_mode='maybe'"),
        (dict(budget=0.2, prefill_chunk=-3), "prefill_chunk=-3"),
        (dict(budget=0.2, window=object()), "policy parameter window="),
    ]:
        with pytest.raises(kvsim.KvsimError, match=message):
            kvsim.run(t, "snapkv", **kwargs)
    with pytest.raises(kvsim.KvsimError, match="give an experiment"):
        kvsim.sweep(policies=["snapkv"])
    with pytest.raises(kvsim.KvsimError, match="budgets: 2 is not a fraction"):
        kvsim.sweep(traces=[t], policies=["snapkv"], budgets=[2])
    with pytest.raises(kvsim.KvsimError, match="kvsim.sweep experiment: .*no budgets|no budgets"):
        kvsim.sweep(traces=[t], policies=["snapkv"])
    with pytest.raises(kvsim.KvsimError, match="unknown keys"):
        kvsim.sweep(traces=[t], policies=[{"name": "snapkv", "window": 3}], budgets=[0.2])
    with pytest.raises(kvsim.KvsimError, match="layer 3 out of range"):
        kvsim.Trace(t).layer(3)


def test_sweep_out_refuses_a_foreign_folder(traces, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(kvsim.KvsimError, match="not a kvsim sweep output"):
        kvsim.sweep(traces=[traces["tiny"]], policies=["snapkv"], budgets=[0.2], out=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---- the GIL is released while the engine works ---------------------------------------------------------------

def test_gil_released_during_replay(traces):
    window = {}

    def work():
        window["start"] = time.perf_counter()
        kvsim.sweep(traces=[traces["tiny"]] * 4, policies=["snapkv", "h2o", "pyramidkv", "adakv", "oracle"],
                    budgets=[0.1, 0.2, 0.3, 0.5], threads=1)
        window["end"] = time.perf_counter()

    ticks = []
    th = threading.Thread(target=work)
    th.start()
    while th.is_alive():
        ticks.append(time.perf_counter())
    th.join()
    inside = [t for t in ticks if window["start"] < t < window["end"]]
    duration = window["end"] - window["start"]
    assert duration > 0.05, duration  # long enough to tell
    # Held GIL: the loop would stop for the whole call (at most a switch interval of ticks at its edges).
    # Released: it ticks throughout.
    assert len(inside) > 1000, (len(inside), duration)
    assert inside[-1] - inside[0] > 0.8 * duration
    gaps = np.diff(inside)
    assert gaps.max() < 0.5 * duration


def test_concurrent_runs_in_threads_match_serial(traces):
    serial = [kvsim.run(traces["gqa"], p, 0.25, window=8) for p in ("snapkv", "adakv", "pyramidkv")]
    results = [None] * 3

    def go(i, p):
        results[i] = kvsim.run(traces["gqa"], p, 0.25, threads=1, window=8)

    ths = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(("snapkv", "adakv", "pyramidkv"))]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert results == serial


def test_opening_while_other_threads_read(traces, monkeypatch):
    # Opening forks a guard process; a fork while another thread is inside HDF5 used to leave the child
    # waiting on HDF5's lock until the guard's timeout ("did not finish within ... s": a false "damaged").
    monkeypatch.setenv("KVSIM_TRACE_GUARD_TIMEOUT", "5")
    start = time.perf_counter()
    for _ in range(20):
        kvsim.Trace(traces["gqa"])
    alone = time.perf_counter() - start  # the same opens with no other thread reading
    stop = threading.Event()
    reads = [0]

    def reader():
        t = kvsim.Trace(traces["tiny"])
        while not stop.is_set():
            t.layer(reads[0] % 3)
            reads[0] += 1

    th = [threading.Thread(target=reader) for _ in range(2)]
    for x in th:
        x.start()
    try:
        start = time.perf_counter()
        for _ in range(20):
            assert kvsim.Trace(traces["gqa"]).num_layers == 3
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        for x in th:
            x.join()
    # Readers must not starve the opens (a reader-preferring lock made them ~10x slower).
    assert reads[0] > 0 and elapsed < 3 * alone + 1, (elapsed, alone)


# ---- the rest of the package -------------------------------------------------------------------------------------

def test_policies_list_the_registry(kvsim_bin):
    names = {p["name"] for p in kvsim.policies()}
    listed = cli(kvsim_bin, "list-policies").stdout
    assert {"snapkv", "h2o", "full", "rekv"} <= names
    assert all(f"\n{n}\n" in "\n" + listed for n in names)


def test_capture_is_the_capture_tool():
    import kvsim_capture
    import kvsim_capture.metadata

    import kvsim.capture
    import kvsim.capture.metadata
    from kvsim.capture import writer

    assert kvsim.capture is kvsim_capture
    assert kvsim.capture.metadata is kvsim_capture.metadata
    assert kvsim_capture.metadata.__spec__.name == "kvsim_capture.metadata"
    import kvsim_capture.writer
    assert writer is kvsim_capture.writer
    assert kvsim.capture.CaptureOptions is kvsim_capture.CaptureOptions
    res = subprocess.run([sys.executable, "-m", "kvsim.capture", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("usage: kvsim-capture"), res.stderr


def test_import_is_lazy():
    # `import kvsim` (and python -m kvsim.plot) must not need the extension or pandas.
    code = "import sys, kvsim; assert 'kvsim._core' not in sys.modules and 'pandas' not in sys.modules; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "ok", res.stderr


def test_kvsim_command_runs_the_binary(kvsim_bin):
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_BIN"}
    res = subprocess.run([sys.executable, "-m", "kvsim", "version"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == cli(kvsim_bin, "version").stdout
    assert res.stdout.startswith(f"kvsim {kvsim.__version__} ({kvsim.git_commit})")
    res = subprocess.run([sys.executable, "-m", "kvsim", "run", "--budget", "2"], capture_output=True, text=True,
                         env=env)
    assert res.returncode == 2 and "usage" in res.stderr  # the binary's own exit codes and messages


def _cpu_flags():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("coretype", [None, "Prescott"])
def test_extension_runs_openblas_vector_kernels(coretype):
    # As the binary does (sim/blas.h): OpenBLAS's vector kernels on a CPU with AVX2 + FMA, even one OpenBLAS does not
    # know; the user's OPENBLAS_CORETYPE stands.
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    code = "from kvsim._native import core; print(core().blas_core())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    core_name = res.stdout.strip()
    if coretype:
        assert core_name == coretype
    elif {"avx2", "fma"} <= _cpu_flags():
        assert core_name and core_name != "Prescott"
