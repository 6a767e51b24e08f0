"""Plots (python/kvsim/plot.py, `kvsim plot`) and Chrome traces (`--chrome-trace`) from small real sweeps.

Runs the kvsim binary (KVSIM_BIN) on tiny synthetic traces: a plain sweep over two traces with a
layer-allocating policy, a streaming sweep, and a single `kvsim run`; renders their plots and checks the images
(size, not blank), the summary embedding, the one-line errors, and the Chrome trace's events.
"""

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

KVSIM = os.environ["KVSIM_BIN"]
SRC = os.environ.get("KVSIM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
PYDIR = os.path.join(SRC, "python")

sys.path.insert(0, PYDIR)
from kvsim import plot  # noqa: E402  (pure Python: no C++ extension)


def run(args, env=None, check=True):
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}): {p.stderr}")
    return p


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def assert_not_blank(path):
    from PIL import Image

    img = Image.open(path).convert("L")
    lo, hi = img.getextrema()
    assert hi - lo > 100, f"{path} looks blank"
    # More than a frame: a good share of non-white pixels.
    hist = img.histogram()
    assert sum(hist[:200]) > 0.01 * img.size[0] * img.size[1], f"{path} has almost nothing drawn"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    tiny = os.path.join(SRC, "configs", "synth", "tiny.textproto")
    run([KVSIM, "synth", "--config", tiny, "--out", str(d / "a.h5")])
    with open(tiny) as f:
        cfg = f.read()
    lines = [ln for ln in cfg.splitlines() if not ln.startswith("seed:")] + ["seed: 99"]
    (d / "b.textproto").write_text("\n".join(lines) + "\n")
    run([KVSIM, "synth", "--config", str(d / "b.textproto"), "--out", str(d / "b.h5")])
    (d / "exp.textproto").write_text(
        'traces: "a.h5"\ntraces: "b.h5"\npolicies { name: "full" }\npolicies { name: "h2o" }\n'
        'policies { name: "snapkv" }\npolicies { name: "pyramidkv" }\npolicies { name: "oracle" }\n'
        "budgets: 0.1\nbudgets: 0.25\nbudgets: 0.5\n"
    )
    run([KVSIM, "sweep", "--config", str(d / "exp.textproto"), "--out", str(d / "sweep"),
         "--chrome-trace", str(d / "sweep_trace.json")])
    # Streaming.
    run([KVSIM, "synth", "--config", os.path.join(SRC, "configs", "synth", "streaming_tiny.textproto"), "--out",
         str(d / "s.h5")])
    (d / "sexp.textproto").write_text(
        'traces: "s.h5"\npolicies { name: "stream_full" }\npolicies { name: "stream_recent" }\n'
        'policies { name: "rekv" }\nbudget_tokens: 16\nbudget_tokens: 64\n'
    )
    run([KVSIM, "sweep", "--config", str(d / "sexp.textproto"), "--out", str(d / "ssweep"),
         "--chrome-trace", str(d / "ssweep_trace.json")])
    return d


EXPECTED_SIZE = {  # figsize x DPI (constrained layout: the size never depends on the content)
    "quality_vs_budget": (1540, 528),
    "memory_vs_quality": (1320, 528),
    "streaming_memory_over_time": (1375, 484),
}


def check_plots(folder, names):
    files = sorted(os.listdir(os.path.join(folder, "plots")))
    assert files == sorted(f"{n}.{e}" for n in names for e in ("png", "svg"))
    for n in names:
        png = os.path.join(folder, "plots", n + ".png")
        w, h = png_size(png)
        if n in EXPECTED_SIZE:
            assert (w, h) == EXPECTED_SIZE[n], n
        else:
            assert w >= 500 and h >= 300, (n, w, h)
        assert_not_blank(png)
        svg = os.path.join(folder, "plots", n + ".svg")
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg")
        assert os.path.getsize(svg) > 5000
    summary = open(os.path.join(folder, "summary.md")).read()
    for n in names:
        assert f"(plots/{n}.png)" in summary
    return summary


def test_plain_sweep_plots_through_the_cli(work):
    env = dict(os.environ, KVSIM_PYTHON=sys.executable)
    p = run([KVSIM, "plot", str(work / "sweep")], env=env)
    assert "4 plot" not in p.stderr  # 8 files: PNG + SVG of each
    assert "8 plot files" in p.stderr
    summary = check_plots(work / "sweep", ["quality_vs_budget", "memory_vs_quality", "layer_budgets",
                                           "kv_memory_over_time"])
    # Re-plotting replaces the section instead of appending a second one.
    run([sys.executable, "-m", "kvsim.plot", str(work / "sweep")], env=dict(os.environ, PYTHONPATH=PYDIR))
    again = open(work / "sweep" / "summary.md").read()
    assert again == summary
    assert again.count(plot.SUMMARY_MARKER) == 1
    # The sweep can be re-run into the folder: plots/ is an earlier output, replaced with the rest.
    run([KVSIM, "sweep", "--config", str(work / "exp.textproto"), "--out", str(work / "sweep")])
    assert not os.path.exists(work / "sweep" / "plots")
    # A sweep that cannot write its folder leaves no Chrome trace either.
    (work / "sweep" / "notes.txt").write_text("mine")
    p = run([KVSIM, "sweep", "--config", str(work / "exp.textproto"), "--out", str(work / "sweep"),
             "--chrome-trace", str(work / "failed_trace.json")], check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "notes.txt" in p.stderr
    assert not os.path.exists(work / "failed_trace.json")
    os.remove(work / "sweep" / "notes.txt")


def test_streaming_sweep_plots(work):
    written = plot.make_plots(str(work / "ssweep"))
    assert sorted(written) == sorted(
        f"{n}.{e}" for n in ("streaming_recall_vs_budget", "streaming_memory_over_time") for e in ("png", "svg"))
    check_plots(work / "ssweep", ["streaming_recall_vs_budget", "streaming_memory_over_time"])


def test_run_outputs_plot(work):
    d = work / "single"
    d.mkdir()
    run([KVSIM, "run", "--trace", str(work / "a.h5"), "--policy", "pyramidkv", "--budget", "0.25", "--out",
         str(d / "p.json"), "--chrome-trace", str(d / "p.trace.json")])
    assert sorted(os.listdir(d)) == ["p.json", "p.layers.csv", "p.runs.csv", "p.trace.json"]
    written = plot.make_plots(str(d))
    assert "layer_budgets.png" in written and "kv_memory_over_time.png" in written


def test_bad_folders_give_one_line_errors(work):
    env = dict(os.environ, KVSIM_PYTHON=sys.executable)
    for bad in [work / "missing", work / "a.h5"]:
        p = run([KVSIM, "plot", str(bad)], env=env, check=False)
        assert p.returncode == 1
        assert p.stderr.startswith("kvsim: error: ") and p.stderr.count("\n") == 1, p.stderr
    empty = work / "empty"
    empty.mkdir()
    (empty / "results.csv").write_text("trace,policy\n")
    p = run([KVSIM, "plot", str(empty)], env=env, check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert "re-run the sweep" in p.stderr
    assert not os.path.exists(empty / "plots")
    # No interpreter: one line naming it and the fix.
    p = run([KVSIM, "plot", str(work / "sweep")], env=dict(os.environ, KVSIM_PYTHON=str(work / "nope" / "python")),
            check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert "KVSIM_PYTHON" in p.stderr and "nope" in p.stderr


def load_trace(path):
    with open(path) as f:
        doc = json.load(f)
    assert doc["displayTimeUnit"] == "ms"
    return doc, doc["traceEvents"]


def test_chrome_trace_of_a_plain_sweep(work):
    doc, events = load_trace(work / "sweep_trace.json")
    with open(work / "sweep" / "results.json") as f:
        runs = json.load(f)["runs"]
    assert {e["pid"] for e in events} == set(range(1, len(runs) + 1))
    assert "token steps" in doc["metadata"]["clock"]
    for pid, r in enumerate(runs, start=1):
        mine = [e for e in events if e["pid"] == pid]
        names = [e["args"]["name"] for e in mine if e["ph"] == "M" and e["name"] == "process_name"]
        assert names and r["label"] in names[0]
        slices = [e for e in mine if e["ph"] == "X"]
        prefill = [e for e in slices if e["cat"] == "prefill"]
        decode = [e for e in slices if e["cat"] == "decode"]
        assert len(prefill) == r["prefill_chunks"]
        assert len(decode) == len(r["timeline"]) - r["prefill_chunks"]
        # Slices tile the request on the simulated clock and end where the timeline ends.
        t = 0
        for e in slices:
            assert e["ts"] == pytest.approx(t)
            assert "token steps" in e["args"]["clock"]
            t = e["ts"] + e["dur"]
        assert t == pytest.approx(r["timeline"][-1]["time"])
        compression = [e for e in mine if e["ph"] == "i" and e["cat"] == "compression"]
        assert len(compression) == (0 if r["policy"] == "full" else 1)
        counters = [e for e in mine if e["ph"] == "C"]
        assert len(counters) == len(r["timeline"]) + 1
        assert [c["args"]["gpu_hbm_bytes"] for c in counters[:-1]] == [p["kv_bytes"] for p in r["timeline"]]


def test_chrome_trace_of_a_streaming_sweep_and_modelled_clock(work):
    _, events = load_trace(work / "ssweep_trace.json")
    answers = [e for e in events if e["ph"] == "X" and e["cat"] == "answer"]
    arrivals = [e for e in events if e["ph"] == "i" and e["cat"] == "question"]
    assert answers and len(answers) == len(arrivals)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all({"gpu_hbm_bytes", "cpu_bank_bytes"} <= set(e["args"]) for e in counters)
    # With --device the clock is modelled, and the trace says so.
    d = work / "modelled"
    d.mkdir()
    (d / "shape.textproto").write_text(
        'name: "tiny-mha" num_layers: 3 num_heads: 4 num_kv_heads: 4 head_dim: 32 hidden_size: 128 '
        "intermediate_size: 256 vocab_size: 1000\n"
    )
    run([KVSIM, "run", "--trace", str(work / "a.h5"), "--policy", "snapkv", "--budget", "0.25", "--device",
         "a100-sxm", "--model", str(d / "shape.textproto"), "--prefill-chunk", "32", "--out", str(d / "r.json"),
         "--chrome-trace", str(d / "t.json")])
    doc, events = load_trace(d / "t.json")
    assert "MODELLED".lower() in doc["metadata"]["clock"].lower()
    # The trace may not overwrite the result (nor the trace file): one line, exit 1, nothing written.
    p = run([KVSIM, "run", "--trace", str(work / "a.h5"), "--policy", "snapkv", "--budget", "0.25", "--out",
             str(d / "same.json"), "--chrome-trace", str(d / "same.json")], check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "--chrome-trace" in p.stderr
    assert not os.path.exists(d / "same.json")
    prefill = [e for e in events if e.get("cat") == "prefill"]
    assert len(prefill) > 1 and all("A100" in e["args"]["clock"] for e in prefill)
    compression = [e for e in events if e.get("cat") == "compression"]
    assert len(compression) == 1 and compression[0]["args"]["policy_work_ms"] >= 0


# ---- dataset sweeps: means with bootstrap CI bands from aggregates.csv, one figure per group ------------------


def read_csv(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def dataset(work):
    """A plain dataset of two groups (3 tiny-mha samples, 2 tiny-gqa samples), a streaming dataset of 3
    samples, and a one-trace sweep."""
    d = work / "dataset"
    (d / "plain").mkdir(parents=True)
    (d / "stream").mkdir()
    for i in range(3):
        run([KVSIM, "synth", "--config", os.path.join(SRC, "configs", "synth", "tiny.textproto"), "--out",
             str(d / "plain" / f"mha{i}.h5"), "--seed", str(200 + i), "--threads", "1"])
        run([KVSIM, "synth", "--config", os.path.join(SRC, "configs", "synth", "streaming_tiny.textproto"), "--out",
             str(d / "stream" / f"clip{i}.h5"), "--seed", str(300 + i), "--threads", "1"])
    for i in range(2):
        run([KVSIM, "synth", "--config", os.path.join(SRC, "configs", "synth", "tiny_gqa.textproto"), "--out",
             str(d / "plain" / f"gqa{i}.h5"), "--seed", str(400 + i), "--threads", "1"])
    (d / "exp.textproto").write_text(
        'traces: "unused.h5"\npolicies { name: "full" }\npolicies { name: "snapkv" }\npolicies { name: "h2o" }\n'
        "budgets: 0.2\nbudgets: 0.4\nbudgets: 0.7\nseed: 11\n")
    (d / "sexp.textproto").write_text(
        'traces: "unused.h5"\npolicies { name: "stream_full" }\npolicies { name: "rekv" }\n'
        "budget_tokens: 16\nbudget_tokens: 48\nseed: 11\n")
    run([KVSIM, "sweep", "--config", str(d / "exp.textproto"), "--trace", str(d / "plain"), "--out", str(d / "pout"),
         "-q"])
    run([KVSIM, "sweep", "--config", str(d / "sexp.textproto"), "--trace", str(d / "stream"), "--out",
         str(d / "sout"), "-q"])
    run([KVSIM, "sweep", "--config", str(d / "exp.textproto"), "--trace", str(d / "plain" / "mha0.h5"), "--out",
         str(d / "one"), "-q"])
    return d


def draw(folder, monkeypatch):
    """make_plots, keeping each figure (name -> Figure) as it is saved."""
    figures = {}
    save = plot._save

    def keep(fig, plt, out_dir, name, written):
        figures[name] = fig
        save(fig, plt, out_dir, name, written)

    monkeypatch.setattr(plot, "_save", keep)
    plot.make_plots(str(folder))
    return figures


def bands(ax):
    """The CI bands by label: fill_between polygons, and axhspan rectangles for budget-independent labels."""
    return {c.get_gid()[len("ci95 "):]: c for c in list(ax.collections) + list(ax.patches)
            if (c.get_gid() or "").startswith("ci95 ")}


def check_band(band, xs, lows, highs):
    """The band's polygon: at each budget x, exactly the CSV's interval ends (no other y)."""
    verts = band.get_paths()[0].vertices
    assert sorted({float(x) for x in verts[:, 0]}) == pytest.approx(sorted(xs))
    for x, lo, hi in zip(xs, lows, highs):
        ys = sorted({float(y) for vx, y in verts if abs(vx - x) < 1e-9})
        assert ys == pytest.approx(sorted({lo, hi}), rel=1e-12, abs=1e-15), (x, ys, lo, hi)


def test_dataset_quality_bands_are_the_csv_intervals_one_figure_per_group(dataset, monkeypatch):
    out = dataset / "pout"
    figures = draw(out, monkeypatch)
    aggs = read_csv(out / "aggregates.csv")
    groups = {"tiny-mha L=3 H=4 KV=4 D=32": ("tiny-mha_L_3_H_4_KV_4_D_32", 3),
              "tiny-gqa L=3 H=4 KV=2 D=32": ("tiny-gqa_L_3_H_4_KV_2_D_32", 2)}
    assert sorted(figures) == sorted([f"{k}_{slug}" for slug, _ in groups.values()
                                      for k in ("quality_vs_budget", "memory_vs_quality")] + ["kv_memory_over_time"])
    metrics = ["retained_mass_mean", "output_rel_error_mean", "regret_vs_oracle_mean"]
    for group, (slug, n) in groups.items():
        fig = figures[f"quality_vs_budget_{slug}"]
        title = fig._suptitle.get_text()
        assert f"group {group}" in title
        assert f"mean over {n} samples, 95% bootstrap CI (seeded" in title
        other = [g for g in groups if g != group][0]
        assert other not in title
        for ax, metric in zip(fig.axes, metrics):
            b = bands(ax)
            assert sorted(b) == ["full", "h2o", "snapkv"]
            for label in ("snapkv", "h2o"):
                cells = sorted((a for a in aggs if a["group"] == group and a["label"] == label
                                and a["metric"] == metric), key=lambda a: float(a["budget_fraction"]))
                assert [int(a["n"]) for a in cells] == [n] * 3
                xs = [100 * float(a["budget_fraction"]) for a in cells]
                check_band(b[label], xs, [float(a["ci95_low"]) for a in cells], [float(a["ci95_high"]) for a in cells])
                # The line is the group's means, and only this group's: no other group's values are drawn.
                (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
                assert list(line.get_xdata()) == pytest.approx(xs)
                assert list(line.get_ydata()) == pytest.approx([float(a["mean"]) for a in cells], rel=1e-12)
                theirs = [float(a["mean"]) for a in aggs if a["group"] == other and a["label"] == label
                          and a["metric"] == metric]
                assert not set(line.get_ydata()) & set(theirs)
            # full (no budget): a level with its interval as a horizontal band.
            (full,) = [a for a in aggs if a["group"] == group and a["label"] == "full" and a["metric"] == metric]
            ys = sorted({float(y) for _, y in b["full"].get_corners()})
            assert ys == pytest.approx(sorted({float(full["ci95_low"]), float(full["ci95_high"])}), abs=1e-15)
        # memory_vs_quality of a group holds that group's runs only.
        runs = [r for r in read_csv(out / "runs.csv") if r["group"] == group]
        points = sum(len(c.get_offsets()) for ax in figures[f"memory_vs_quality_{slug}"].axes[:1]
                     for c in ax.collections)
        assert points == len(runs)
    check_plots(out, sorted(figures))


def test_streaming_dataset_recall_bands(dataset, monkeypatch):
    out = dataset / "sout"
    figures = draw(out, monkeypatch)
    assert sorted(figures) == ["streaming_memory_over_time", "streaming_recall_vs_budget"]
    fig = figures["streaming_recall_vs_budget"]
    assert "mean over 3 samples, 95% bootstrap CI (seeded" in fig._suptitle.get_text()
    aggs = read_csv(out / "aggregates.csv")
    panels = ["evidence_frame_recall", "oracle_frame_recall", "retained_mass_mean"]
    for ax, metric in zip(fig.axes, panels):
        cells = sorted((a for a in aggs if a["label"] == "rekv" and a["metric"] == metric),
                       key=lambda a: int(a["budget_tokens"]))
        assert [int(a["budget_tokens"]) for a in cells] == [16, 48] and {a["n"] for a in cells} == {"3"}
        check_band(bands(ax)["rekv"], [16, 48], [float(a["ci95_low"]) for a in cells],
                   [float(a["ci95_high"]) for a in cells])
    # The memory figure draws one sample's runs (never a mix of traces), and says which.
    assert "sample clip0" in figures["streaming_memory_over_time"]._suptitle.get_text()


def test_single_sample_sweep_keeps_per_run_figures(dataset, monkeypatch):
    figures = draw(dataset / "one", monkeypatch)
    fig = figures["quality_vs_budget"]
    assert "bootstrap" not in fig._suptitle.get_text() and "group" not in fig._suptitle.get_text()
    for ax in fig.axes:
        assert not bands(ax) and not ax.collections  # one trace: no CI band, no min-max band either


def test_load_results_aggregate_level(dataset):
    import kvsim.results as results

    frame = results.load_results(str(dataset / "pout"), level="aggregate")
    csv_rows = read_csv(dataset / "pout" / "aggregates.csv")
    assert len(frame) == len(csv_rows)
    assert list(frame.columns) == list(csv_rows[0])
    assert list(frame["mean"]) == [float(r["mean"]) for r in csv_rows]  # exact: the JSON round-trips doubles
    assert list(frame["ci95_low"]) == [float(r["ci95_low"]) for r in csv_rows]
    assert frame["n"].dtype.kind == "i" and set(frame["group"]) == {r["group"] for r in csv_rows}
    runs = results.load_results(str(dataset / "sout"))
    assert set(runs["sample_id"]) == {"clip0", "clip1", "clip2"}
    assert set(runs["group"]) == {"tiny-stream L=4 H=4 KV=2 D=16"}
    sagg = results.load_results(str(dataset / "sout"), level="aggregate")
    assert set(sagg["metric"]) == {"retained_mass_mean", "output_rel_error_mean", "evidence_frame_recall",
                                   "oracle_frame_recall", "oracle_mass_recall", "gpu_bytes_peak"}
    from kvsim.errors import KvsimError

    with pytest.raises(KvsimError, match="a single run has no aggregates"):
        results.to_frame({"policy": "x", "metrics": {}}, level="aggregate")
