"""Plots of kvsim results: ``python -m kvsim.plot RESULTS_DIR`` (or ``kvsim plot RESULTS_DIR``).

Reads the tables kvsim writes (docs/metrics.md "Tables"): ``runs.csv`` and ``layers.csv`` of ``kvsim sweep``
(or the ``NAME.runs.csv`` / ``NAME.layers.csv`` of ``kvsim run --out NAME.json``), the timeline in
``results.json`` (``NAME.json``), and for streaming sweeps ``runs.csv`` and ``memory.csv``. Writes
``RESULTS_DIR/plots/*.png`` and ``*.svg`` and appends a "Plots" section that embeds them to
``RESULTS_DIR/summary.md`` (when there is one). Pure Python (matplotlib, csv, json): it does not load kvsim's
C++ extension.

Plots (each only when the results hold what it needs):
  quality_vs_budget       retained mass, output error, regret vs oracle over the budget, one line per policy.
                          A dataset sweep (a group with two or more samples; aggregates.csv): the mean over the
                          group's samples with its seeded bootstrap 95% CI as a band. Otherwise the per-run
                          values (mean over traces, a min-max band when there are several traces)
  memory_vs_quality       KV memory (time-weighted, relative to the full cache) against output error and
                          retained mass, with the Pareto front of the causal policies
  layer_budgets           per-layer budget allocation of the layer-allocating policies (pyramidkv, meda,
                          madakv, hae, ...) as heatmaps
  kv_memory_over_time     KV bytes held over the simulated clock (modelled with --device, else token steps)
  streaming_recall_vs_budget, streaming_memory_over_time   for streaming sweeps (recall: from aggregates.csv
                          with CI bands on a dataset, like quality_vs_budget)

Samples of different groups (model and shape) are never drawn into one line, band or front: with several
groups, quality_vs_budget, memory_vs_quality and streaming_recall_vs_budget are drawn once per group
(NAME_<group>.png, the group in the title).

Every figure says what its data is: a synthetic trace (mechanics, not model behaviour) or a captured one, and
whether time is modelled (--device) or simulated token steps.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import shutil
import sys
from collections import OrderedDict, defaultdict

DPI = 110
LAYER_ALLOCATING = ("pyramidkv", "meda", "madakv", "hae")
SUMMARY_MARKER = "<!-- kvsim plot: generated section, replaced by the next `kvsim plot` -->"


class PlotError(Exception):
    """A problem with the results folder: reported as one line."""


# ---- reading ---------------------------------------------------------------------------------------------


def _read_csv(path):
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise PlotError(f"{path}: cannot read ({e.strerror})") from None
    except csv.Error as e:
        raise PlotError(f"{path}: not a CSV table ({e})") from None


def _num(row, key, default=float("nan")):
    v = row.get(key, "")
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        return default


class Results:
    """The runs of one results folder (a sweep's folder, or kvsim run outputs collected in one folder)."""

    def __init__(self, directory):
        self.dir = directory
        self.streaming = False
        self.runs = []  # dicts (runs.csv rows) with "_key" unique over the folder
        self.layers = []
        self.memory = []  # streaming memory.csv rows
        self.timelines = {}  # run key -> list of timeline points (results.json)
        self.aggregates = []  # aggregates.csv rows of a dataset sweep (numbers as floats)
        self.group = ""  # set on a per-group view (by_group)
        self.several_groups = False

    @property
    def groups(self):
        """The groups (model and shape) of the runs, in first-seen order ([""] for results without groups)."""
        return list(OrderedDict.fromkeys(r.get("group") or "" for r in self.runs))

    def samples_in(self, group):
        return len({r.get("sample_id") or r.get("trace_hash") for r in self.runs if (r.get("group") or "") == group})

    def view(self, group):
        """The results of one group only (its runs, layers, memory points, timelines and aggregates)."""
        sub = Results(self.dir)
        sub.streaming = self.streaming
        sub.group = group
        sub.runs = [r for r in self.runs if (r.get("group") or "") == group]
        keys = {r["_key"] for r in sub.runs}
        sub.layers = [r for r in self.layers if r["_key"] in keys]
        sub.memory = [r for r in self.memory if r["_key"] in keys]
        sub.timelines = {k: v for k, v in self.timelines.items() if k in keys}
        sub.aggregates = [a for a in self.aggregates if a["group"] == group]
        return sub

    @property
    def trace_sources(self):
        return sorted({r.get("trace_source") or "unknown" for r in self.runs})

    @property
    def time_units(self):
        return sorted({r.get("time_unit") or "" for r in self.runs})


def load_results(directory):
    if not os.path.isdir(directory):
        raise PlotError(f"{directory}: not a folder; give the --out folder of kvsim sweep (or of kvsim run outputs)")
    res = Results(directory)
    stems = []  # (runs csv, layers csv, json, memory csv)
    if os.path.exists(os.path.join(directory, "runs.csv")):
        stems.append(("runs.csv", "layers.csv", "results.json", "memory.csv"))
    else:
        for name in sorted(os.listdir(directory)):
            if name.endswith(".runs.csv"):
                stem = name[: -len(".runs.csv")]
                stems.append((name, stem + ".layers.csv", stem + ".json", stem + ".memory.csv"))
    if not stems:
        hint = (
            " (it holds results.csv from an older kvsim: re-run the sweep to write runs.csv)"
            if os.path.exists(os.path.join(directory, "results.csv"))
            else ""
        )
        raise PlotError(
            f"{directory}: no runs.csv{hint}; give the --out folder of kvsim sweep, or a folder holding the "
            "NAME.runs.csv of kvsim run --out NAME.json"
        )
    for i, (runs_csv, layers_csv, json_name, memory_csv) in enumerate(stems):
        rows = _read_csv(os.path.join(directory, runs_csv))
        if rows and ("run" not in rows[0] or "policy" not in rows[0]):
            raise PlotError(f"{os.path.join(directory, runs_csv)}: not a kvsim runs.csv (no 'run'/'policy' columns)")
        streaming = os.path.exists(os.path.join(directory, memory_csv)) or (
            bool(rows) and "evidence_frame_recall" in rows[0]
        )
        res.streaming = res.streaming or streaming
        for r in rows:
            r["_key"] = (i, r["run"])
            res.runs.append(r)
        lp = os.path.join(directory, layers_csv)
        if os.path.exists(lp):
            for r in _read_csv(lp):
                r["_key"] = (i, r["run"])
                res.layers.append(r)
        mp = os.path.join(directory, memory_csv)
        if os.path.exists(mp):
            for r in _read_csv(mp):
                r["_key"] = (i, r["run"])
                res.memory.append(r)
        jp = os.path.join(directory, json_name)
        if not streaming and os.path.exists(jp):
            try:
                with open(jp, encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise PlotError(f"{jp}: not readable JSON ({e})") from None
            runs = doc.get("runs", [doc])  # a sweep's SweepResult, or one RunResult of kvsim run
            for j, run in enumerate(runs):
                res.timelines[(i, str(j))] = run.get("timeline", [])
    if not res.runs:
        raise PlotError(f"{directory}: runs.csv has no runs")
    ap = os.path.join(directory, "aggregates.csv")
    if len(stems) == 1 and stems[0][0] == "runs.csv" and os.path.exists(ap):
        for a in _read_csv(ap):
            if "metric" not in a or "ci95_low" not in a:
                raise PlotError(f"{ap}: not a kvsim aggregates.csv (no 'metric'/'ci95_low' columns)")
            for k in ("budget_fraction", "budget_tokens", "n", "mean", "sd", "ci95_low", "ci95_high", "resamples"):
                a[k] = _num(a, k)
            res.aggregates.append(a)
    return res


# ---- helpers -------------------------------------------------------------------------------------------------


def _mpl():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "matplotlib is not installed in this Python; run ./run setup (the project's .venv has it) or "
            "set KVSIM_PYTHON to a Python with matplotlib"
        ) from None
    plt.rcParams.update(
        {
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.labelsize": 9,
            "legend.fontsize": 8,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "svg.hashsalt": "kvsim",  # deterministic SVG ids
        }
    )
    return plt


def _provenance(res, clock=False):
    """The subtitle: what the data is (synthetic / captured) and, for time axes, what the clock is."""
    sources = res.trace_sources
    n = len({r.get("trace_hash") or r.get("trace") for r in res.runs})
    if sources == ["captured"]:
        what = f"captured trace{'s' if n != 1 else ''} (real model attention, replayed)"
    elif "captured" in sources:
        what = "captured and synthetic traces"
    else:
        what = f"synthetic trace{'s' if n != 1 else ''} (kvsim synth): mechanics, not model behaviour"
    text = f"{what}; {n} trace{'s' if n != 1 else ''}"
    if clock:
        text += "; " + _clock_label(res)
    return text


def _clock_label(res):
    units = res.time_units
    if res.streaming:
        if units == ["us"]:
            return "video time; encoding and answering take MODELLED GPU time (--device), not measured"
        return "video time; processing is instantaneous on the token-step clock (no --device)"
    if units == ["us"]:
        devices = sorted({r.get("latency_device") for r in res.runs if r.get("latency_device")})
        if devices:
            return "time MODELLED on " + ", ".join(devices) + " (--device), not measured"
        return "time from a fitted latency model, not measured"
    return "time in simulated token steps (no --device)"


def _save(fig, plt, out_dir, name, written):
    for ext in ("png", "svg"):
        path = os.path.join(out_dir, f"{name}.{ext}")
        fig.savefig(path, dpi=DPI, metadata={"Date": None} if ext == "svg" else {"Software": None})
        written.append(f"{name}.{ext}")
    plt.close(fig)


def _budget_axis(runs):
    """(x value of a run, axis label): the budget as % of the prompt when every budgeted run has a fraction."""
    budgeted = [r for r in runs if r["policy"] not in ("full",)]
    if budgeted and all(_num(r, "budget_fraction", 0) > 0 for r in budgeted):
        return (lambda r: 100 * _num(r, "budget_fraction")), "budget (% of the prompt kept per layer and KV head)"
    return (lambda r: _num(r, "budget_tokens")), "budget (prompt tokens kept per layer and KV head)"


def _style(i, n=10):
    """Line style of the i-th of n labels: distinct colour (tab10, or tab20 beyond 10) and marker."""
    import matplotlib

    markers = "osD^v<>pXh*P"
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return {"marker": markers[i % len(markers)], "markersize": 4, "linewidth": 1.4, "color": cmap(i % cmap.N)}


def _group_slug(group):
    return re.sub(r"[^A-Za-z0-9.-]+", "_", group).strip("_") or "group"


def _by_group(res):
    """[(file-name suffix, per-group view)]: one entry without a suffix when the runs form one group."""
    groups = res.groups
    if len(groups) == 1:
        return [("", res.view(groups[0]) if groups[0] else res)]
    views = [("_" + _group_slug(g), res.view(g)) for g in groups]
    for _, v in views:
        v.several_groups = True
    return views


def _group_title(res):
    """" (group NAME)" in the title of a dataset's or of one of several groups' figure; "" otherwise (a
    single-sample sweep keeps its figures)."""
    return f" (group {res.group})" if res.group and (res.several_groups or _dataset(res)) else ""


def _dataset(res):
    """Whether the figures of this (per-group) view come from aggregates.csv: it has aggregates and the group
    has two or more samples."""
    return bool(res.aggregates) and res.samples_in(res.group) > 1


def _band_label(res):
    n = int(max(a["n"] for a in res.aggregates))
    resamples = int(res.aggregates[0]["resamples"])
    return f"mean over {n} samples, 95% bootstrap CI (seeded, {resamples} resamples)"


def _plot_aggregates(ax, res, metric, xof, labels, unit=" tok"):
    """Draws one metric from aggregates.csv: per label a mean line over the budget with its CI band (a
    budget-independent label: a horizontal line with a horizontal band). Each band's gid is "ci95 LABEL"."""
    for i, label in enumerate(labels):
        cells = sorted((a for a in res.aggregates if a["label"] == label and a["metric"] == metric), key=xof)
        if not cells:
            continue
        st = _style(i, len(labels))
        if len({xof(a) for a in cells}) == 1:  # no budget (or one): a reference level
            a = cells[0]
            colour = "0.4" if a["policy"] == "full" else st["color"]
            what = "no compression" if a["policy"] == "full" else "no budget" if xof(a) == 0 else f"{xof(a):g}{unit}"
            ax.axhline(a["mean"], color=colour, linestyle=":", linewidth=1.1, label=f"{label} ({what})")
            band = ax.axhspan(a["ci95_low"], a["ci95_high"], color=colour, alpha=0.12, linewidth=0)
            band.set_gid(f"ci95 {label}")
            continue
        xs = [xof(a) for a in cells]
        ls = "--" if cells[0]["policy"] == "oracle" else "-"
        (line,) = ax.plot(xs, [a["mean"] for a in cells], linestyle=ls, label=label, **st)
        band = ax.fill_between(xs, [a["ci95_low"] for a in cells], [a["ci95_high"] for a in cells],
                               color=line.get_color(), alpha=0.18, linewidth=0)
        band.set_gid(f"ci95 {label}")


# ---- plain sweeps ---------------------------------------------------------------------------------------------


def plot_quality_vs_budget(res, plt, out_dir, written, name="quality_vs_budget"):
    xof, xlabel = _budget_axis(res.runs)
    metrics = [
        ("retained_mass_mean", "retained attention mass (mean, 0-1; higher is better)"),
        ("output_rel_error_mean", "attention output rel. error ‖ô−o‖/‖o‖ (mean; lower is better)"),
        ("regret_vs_oracle_mean", "regret vs oracle (mass; lower is better)"),
    ]
    labels = list(OrderedDict.fromkeys(r["label"] for r in res.runs))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8), layout="constrained")
    several = len({r.get("trace_hash") for r in res.runs}) > 1
    dataset = _dataset(res)
    fractions = xlabel.startswith("budget (%")

    def agg_x(a):
        return 100 * a["budget_fraction"] if fractions else a["budget_tokens"]

    for ax, (col, ylabel) in zip(axes, metrics):
        if dataset:
            _plot_aggregates(ax, res, col, agg_x, labels, "%" if fractions else " tok")
        for i, label in enumerate(labels if not dataset else []):
            rows = [r for r in res.runs if r["label"] == label]
            by_x = defaultdict(list)
            for r in rows:
                by_x[xof(r)].append(_num(r, col))
            xs = sorted(by_x)
            if rows[0]["policy"] == "full":  # no budget: the reference level
                mean = statistics.fmean(by_x[xs[0]])
                ax.axhline(mean, color="0.4", linestyle=":", linewidth=1, label=f"{label} (no compression)")
                continue
            mean = [statistics.fmean(by_x[x]) for x in xs]
            ls = "--" if rows[0]["policy"] == "oracle" else "-"
            (line,) = ax.plot(xs, mean, linestyle=ls, label=label, **_style(i, len(labels)))
            if several:
                lo = [min(by_x[x]) for x in xs]
                hi = [max(by_x[x]) for x in xs]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xlabel.startswith("budget (%"):
            ax.set_xscale("log")
            ticks = sorted({xof(r) for r in res.runs if r["policy"] != "full"})
            if ticks:
                ax.set_xticks(ticks)
                ax.set_xticklabels([f"{t:g}%" for t in ticks])
                ax.minorticks_off()
    handles, lbls = axes[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside right center", frameon=False)
    if dataset:
        band = "; lines and bands: " + _band_label(res)
    else:
        band = "; lines: mean over traces, bands: min-max" if several else ""
    group = _group_title(res)
    fig.suptitle(f"Quality vs KV budget per policy{group}\n{_provenance(res)}{band}", fontsize=10)
    _save(fig, plt, out_dir, name, written)


def _pareto(points):
    """Indices of the points not dominated in (x lower, y lower)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_memory_vs_quality(res, plt, out_dir, written, name="memory_vs_quality"):
    labels = list(OrderedDict.fromkeys(r["label"] for r in res.runs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    panels = [
        ("output_rel_error_mean", "attention output rel. error (mean; lower is better)", False),
        ("retained_mass_mean", "retained attention mass (mean; higher is better)", True),
    ]
    for ax, (col, ylabel, higher) in zip(axes, panels):
        causal = []
        for i, label in enumerate(labels):
            rows = [r for r in res.runs if r["label"] == label]
            xs = [_num(r, "kv_memory_ratio") for r in rows]
            ys = [_num(r, col) for r in rows]
            st = _style(i, len(labels))
            if rows[0]["policy"] == "full":
                st.update(marker="*", color="0.3")
            ax.scatter(xs, ys, s=24, marker=st["marker"], color=st["color"], label=label, alpha=0.85)
            if rows[0]["policy"] not in ("oracle",):
                causal += [(x, -y if higher else y) for x, y in zip(xs, ys)]
        front = _pareto(causal)
        if front:
            fx = [causal[i][0] for i in front]
            fy = [-causal[i][1] if higher else causal[i][1] for i in front]
            ax.step(fx, fy, where="post", color="k", linewidth=1, alpha=0.6, label="Pareto front (causal policies)")
        ax.set_xlabel("KV memory, time-weighted mean (fraction of the full cache)")
        ax.set_ylabel(ylabel)
    handles, lbls = axes[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside right center", frameon=False)
    group = _group_title(res)
    fig.suptitle(f"KV memory vs quality (each point one run){group}\n{_provenance(res)}", fontsize=10)
    _save(fig, plt, out_dir, name, written)


def plot_layer_budgets(res, plt, out_dir, written):
    import numpy as np

    by_run = defaultdict(list)
    for row in res.layers:
        by_run[row["_key"]].append(row)
    runs = [r for r in res.runs if r["policy"].split("+")[0] in LAYER_ALLOCATING and r["_key"] in by_run]
    if not runs:
        return
    first_trace = runs[0].get("trace_hash")
    runs = [r for r in runs if r.get("trace_hash") == first_trace]
    labels = list(OrderedDict.fromkeys(r["label"] for r in runs))
    n = len(labels)
    cols = min(n, 3)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols + 0.6, 2.9 * rows_n + 1.0), layout="constrained",
                             squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, labels):
        lruns = sorted((r for r in runs if r["label"] == label), key=lambda r: _num(r, "budget_tokens"))
        layers = sorted({int(x["layer"]) for r in lruns for x in by_run[r["_key"]]})
        grid = np.full((len(lruns), len(layers)), np.nan)
        for i, r in enumerate(lruns):
            b = _num(r, "budget_tokens")
            for x in by_run[r["_key"]]:
                grid[i, layers.index(int(x["layer"]))] = _num(x, "layer_budget_tokens") / b if b > 0 else np.nan
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", origin="lower")
        uniform = np.nanmax(grid) - np.nanmin(grid) < 1e-9 if np.isfinite(grid).any() else False
        ax.set_title(label + (" (uniform: every layer gets B)" if uniform else ""))
        ax.set_xlabel("layer")
        ax.set_yticks(range(len(lruns)))
        ax.set_yticklabels([f"{int(_num(r, 'budget_tokens'))} tok" for r in lruns])
        ax.set_ylabel("uniform budget B")
        step = max(1, len(layers) // 8)
        ax.set_xticks(range(0, len(layers), step))
        ax.set_xticklabels([str(layers[i]) for i in range(0, len(layers), step)])
        ax.grid(False)
        fig.colorbar(im, ax=ax, label="layer budget / B")
    fig.suptitle(
        "Per-layer prompt budget of layer-allocating policies (mean over KV heads, relative to the uniform B)\n"
        + _provenance(res).split(";")[0]
        + f"; trace {first_trace[:12] if first_trace else ''}",
        fontsize=10,
    )
    _save(fig, plt, out_dir, "layer_budgets", written)


def plot_memory_over_time(res, plt, out_dir, written):
    if not res.timelines:
        return
    runs = [r for r in res.runs if res.timelines.get(r["_key"])]
    if not runs:
        return
    first_trace = runs[0].get("trace_hash")
    runs = [r for r in runs if r.get("trace_hash") == first_trace]
    full = [r for r in runs if r["policy"] == "full"]
    budgets = sorted({int(_num(r, "budget_tokens")) for r in runs if r["policy"] != "full"})
    if not budgets:
        budgets = [0]
    # At most 4 panels: the smallest, largest and evenly spread budgets in between.
    if len(budgets) > 4:
        idx = sorted({round(i * (len(budgets) - 1) / 3) for i in range(4)})
        budgets = [budgets[i] for i in idx]
    us = res.time_units == ["us"]
    ncols = min(2, len(budgets))
    nrows = math.ceil(len(budgets) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols + 2.6, 3.4 * nrows + 1.0), layout="constrained",
                             squeeze=False, sharey=True)
    for ax in axes.flat[len(budgets):]:
        ax.set_visible(False)
    labels = list(OrderedDict.fromkeys(r["label"] for r in runs))
    for ax, b in zip(axes.flat, budgets):
        for i, label in enumerate(labels):
            for r in runs:
                if r["label"] != label or (r["policy"] != "full" and int(_num(r, "budget_tokens")) != b):
                    continue
                tl = res.timelines[r["_key"]]
                t, y = [0.0], []
                for p in tl:
                    y += [p.get("kv_bytes", 0) / 2**20] * 2
                    t += [p.get("time", 0)] * 2
                t = t[:-1]
                if us:
                    t = [v / 1e3 for v in t]
                dashes = [(None, None), (6, 2), (2, 2), (8, 2, 2, 2), (4, 4), (1, 3)][i % 6]
                style = (
                    {"color": "0.3", "linestyle": ":"}
                    if r["policy"] == "full"
                    else {"dashes": dashes, "color": _style(i, len(labels))["color"]}
                )
                ax.plot(t, y, label=label, linewidth=2.2 - 0.25 * (i % 5), alpha=0.9, **style)
        ax.set_title(f"budget {b} tokens per layer and KV head" if b else "")
        ax.set_xlabel("simulated time (ms, modelled)" if us else "simulated time (token steps)")
    for row in axes:
        row[0].set_ylabel("KV cache (MiB, all layers and KV heads)")
    handles, lbls = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside right center", frameon=False)
    fig.suptitle(
        "KV memory over the simulated request (prefill chunks, then decode steps; policies holding the same "
        f"number of slots overlap)\n{_provenance(res, clock=True)}",
        fontsize=10,
    )
    _save(fig, plt, out_dir, "kv_memory_over_time", written)


# ---- streaming sweeps -----------------------------------------------------------------------------------------


def plot_streaming_recall(res, plt, out_dir, written, name="streaming_recall_vs_budget"):
    panels = [
        ("evidence_frame_recall", "evidence frame recall (0-1; synthetic ground truth)"),
        ("oracle_frame_recall", "oracle frame recall (0-1)"),
        ("retained_mass_mean", "retained attention mass (mean, 0-1)"),
    ]
    if all(_num(r, "evidence_frame_recall", -1) < 0 for r in res.runs):
        panels = panels[1:]
    labels = list(OrderedDict.fromkeys(r["label"] for r in res.runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.4, 4.6), layout="constrained",
                             squeeze=False)
    dataset = _dataset(res)
    for ax, (col, ylabel) in zip(axes[0], panels):
        if dataset:
            _plot_aggregates(ax, res, col, lambda a: a["budget_tokens"], labels)
        for i, label in enumerate(labels if not dataset else []):
            rows = sorted((r for r in res.runs if r["label"] == label), key=lambda r: _num(r, "budget_tokens"))
            xs = [_num(r, "budget_tokens") for r in rows]
            ys = [_num(r, col) for r in rows]
            if len({x for x in xs}) == 1:  # one budget (or a policy that keeps everything): a reference line
                ax.axhline(ys[0], linestyle=":", linewidth=1.1, color=_style(i, len(labels))["color"],
                           label=f"{label} ({int(xs[0])} tok)" if xs[0] else f"{label} (no budget)")
                continue
            ax.plot(xs, ys, label=label, **_style(i, len(labels)))
        ax.set_xlabel("budget (retrieved visual tokens per layer and KV head)")
        ax.set_ylabel(ylabel)
    handles, lbls = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside right center", frameon=False)
    group = _group_title(res)
    band = "; lines and bands: " + _band_label(res) if dataset else ""
    fig.suptitle(f"Streaming: recall vs retrieval budget (means over questions){group}\n{_provenance(res)}{band}",
                 fontsize=10)
    _save(fig, plt, out_dir, name, written)


def plot_streaming_memory(res, plt, out_dir, written):
    if not res.memory:
        return
    by_run = defaultdict(list)
    for m in res.memory:
        by_run[m["_key"]].append(m)
    runs = [r for r in res.runs if r["_key"] in by_run]
    if not runs:
        return
    first_trace = (runs[0].get("sample_id"), runs[0].get("trace_hash"))
    runs = [r for r in runs if (r.get("sample_id"), r.get("trace_hash")) == first_trace]
    # One run per label: its largest budget (of the first trace).
    pick = OrderedDict()
    for r in runs:
        if r["label"] not in pick or _num(r, "budget_tokens") > _num(pick[r["label"]], "budget_tokens"):
            pick[r["label"]] = r
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.4), layout="constrained", sharex=True)
    for i, (label, r) in enumerate(pick.items()):
        pts = by_run[r["_key"]]
        t = [_num(p, "time_s") for p in pts]
        budget = int(_num(r, "budget_tokens"))
        name = f"{label} @ {budget} tok" if budget else label
        style = {"dashes": [(None, None), (6, 2), (2, 2), (8, 2, 2, 2), (4, 4), (1, 3)][i % 6],
                 "linewidth": 2.2 - 0.25 * (i % 5), "alpha": 0.9}
        axes[0].step(t, [_num(p, "gpu_bytes") / 2**20 for p in pts], where="post", label=name, **style)
        axes[1].step(t, [_num(p, "cpu_bank_bytes") / 2**20 for p in pts], where="post", label=name, **style)
    axes[0].set_ylabel("GPU KV bytes (MiB)")
    axes[1].set_ylabel("CPU bank bytes (MiB)")
    for ax in axes:
        ax.set_xlabel("video time (s)")
    handles, lbls = axes[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside right center", frameon=False)
    fig.suptitle(
        "Streaming: KV memory per tier over time (each policy at its largest budget; lines overlap where equal)\n"
        + _provenance(res, clock=True)
        + (f"; sample {first_trace[0]}" if len(res.groups) > 1 or res.samples_in(res.groups[0]) > 1 else ""),
        fontsize=10,
    )
    _save(fig, plt, out_dir, "streaming_memory_over_time", written)


# ---- entry point ---------------------------------------------------------------------------------------------


def _update_summary(directory, written):
    path = os.path.join(directory, "summary.md")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if SUMMARY_MARKER in text:
        text = text[: text.index(SUMMARY_MARKER)].rstrip("\n") + "\n"
    pngs = [w for w in written if w.endswith(".png")]
    lines = ["", SUMMARY_MARKER, "## Plots", "", "Drawn by `kvsim plot` (SVG versions next to the PNGs in plots/).", ""]
    for png in pngs:
        lines += [f"![{png[:-4].replace('_', ' ')}](plots/{png})", ""]
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n".join(lines))
    os.replace(tmp, path)
    return True


def make_plots(directory):
    """Draws every plot the results support into DIRECTORY/plots; returns the file names written."""
    res = load_results(directory)
    plt = _mpl()
    final = os.path.join(directory, "plots")
    tmp = f"{final}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    written = []
    try:
        groups = _by_group(res)
        if res.streaming:
            for suffix, g in groups:
                plot_streaming_recall(g, plt, tmp, written, "streaming_recall_vs_budget" + suffix)
            plot_streaming_memory(res, plt, tmp, written)
        else:
            for suffix, g in groups:
                plot_quality_vs_budget(g, plt, tmp, written, "quality_vs_budget" + suffix)
            for suffix, g in groups:
                plot_memory_vs_quality(g, plt, tmp, written, "memory_vs_quality" + suffix)
            plot_layer_budgets(res, plt, tmp, written)
            plot_memory_over_time(res, plt, tmp, written)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _update_summary(directory, written)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="kvsim plot",
        description="Draw a kvsim results folder into RESULTS_DIR/plots/*.png and *.svg (docs/cli.md).",
    )
    parser.add_argument("results_dir", metavar="RESULTS_DIR", help="the --out folder of kvsim sweep")
    args = parser.parse_args(argv)
    try:
        written = make_plots(args.results_dir.rstrip("/") or "/")
    except PlotError as e:
        print(f"kvsim: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvsim: error: {e.filename or args.results_dir}: {e.strerror}", file=sys.stderr)
        return 1
    out = os.path.join(args.results_dir.rstrip("/"), "plots")
    print(f"kvsim: {len(written)} plot files -> {out}/ ({', '.join(sorted({w.rsplit('.', 1)[0] for w in written}))})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
