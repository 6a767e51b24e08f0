"""kvsim_bench --suite policies (issue 14, rounds 28-29): each text policy x 4 budgets beside `full` alone at the
same time, pinned to two cores. On a small synthetic trace with --window 0 (one run per side): a row per
policy with both core orders, one-line errors for a bad window and for a process that may use one CPU, and
(round 29) each policy's own products, checked against `kvsim sweep`'s results of the same runs."""

import csv
import math
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(ROOT, "build", "kvsim"))
BENCH = os.environ.get("KVSIM_BENCH_BIN", os.path.join(ROOT, "build", "kvsim_bench"))
POLICIES = ["streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "oracle", "meda",
            "meda variant=OFFICIAL_CODE", "look_m", "madakv", "hae mode=BUDGET"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    cfg = tmp / "tiny.textproto"
    cfg.write_text(
        'model { name: "tiny" family: "llama" num_layers: 2 num_heads: 4 num_kv_heads: 2 head_dim: 32 '
        "rope_theta: 10000 }\n"
        "layout {\n  segments { kind: TEXT role: SYSTEM tokens: 10 }\n"
        "  segments { kind: IMAGE rows: 8 cols: 8 repeat: 2 text_between: 6 }\n"
        "  segments { kind: TEXT role: QUESTION tokens: 12 }\n  decode_steps: 8\n}\n"
        'storage { query_storage: ALL dtype: "float16" record_prefill_column_sums: true }\n'
        "profile { dense_layers: 1 }\nseed: 3\n"
    )
    out = tmp / "tiny.h5"
    subprocess.run([KVSIM, "synth", "--config", str(cfg), "--out", str(out)], check=True, capture_output=True)
    return out


def two_cpus():
    return len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(scope="module")
def suite(trace):
    """`--suite policies --window 0` on the fixture's trace, run once for the tests that read its tables."""
    if not two_cpus():
        pytest.skip("--suite policies pins two runs to two CPUs")
    r = subprocess.run([BENCH, "--trace", str(trace), "--suite", "policies", "--window", "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def table_rows(stdout, first_cell):
    """The 6-cell table rows whose second cell matches `first_cell`, by their first cell."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.match(first_cell, cells[1]):
            rows[cells[0]] = cells
    return rows


def test_every_policy_gets_a_paired_row(suite):
    rows = table_rows(suite, r"^[\d.]+ \(\d+\) / [\d.]+ \(\d+\)$")
    assert sorted(rows) == sorted(POLICIES + ["floor: 4 runs' own output products (BLAS)"]), suite
    floor = rows.pop("floor: 4 runs' own output products (BLAS)")
    # The ratios need `full`'s CPU time, which a run of this tiny trace may finish within a clock tick: then
    # "-", never a division by zero.
    timed = floor[4] != "-"
    if timed:
        # Each order's floor / full, and both orders' (their geometric mean: the cores' speeds cancel).
        f0, f1 = (float(x) for x in re.match(r"^floor / full ([\d.]+) / ([\d.]+)$", floor[4]).groups())
        both = float(re.match(r"^floor / full ([\d.]+)$", floor[5]).group(1))
        assert both == pytest.approx(math.sqrt(f0 * f1), abs=0.0011), floor
    else:
        assert floor[5] == "-", floor
    for label, cells in rows.items():
        # Both core orders: the policy's CPU s, full's beside it, their difference, and cost / floor.
        a = [float(x) for x in re.findall(r"([\d.]+) \(\d+\)", cells[1])]
        b = [float(x) for x in re.findall(r"([\d.]+) \(\d+\)", cells[2])]
        cost = [float(x) for x in cells[3].split(" / ")]
        assert len(a) == len(b) == len(cost) == 2, label
        for i in range(2):
            assert a[i] >= 0 and b[i] >= 0, label
            assert cost[i] == pytest.approx(a[i] - b[i], abs=0.011), label
        ratio = r"(-?[\d.]+x|-)"
        orders = re.match(rf"^{ratio} / {ratio}$", cells[4])
        assert orders, label
        assert re.match(rf"^{ratio}$", cells[5]), label
        assert "nan" not in cells[4] + cells[5] and "inf" not in cells[4] + cells[5], label
        if not timed:
            assert cells[4] == "- / -" and cells[5] == "-", label
        elif "-" not in orders.groups() and cells[5] != "-":
            # Both orders share the floor here: (geometric mean of the orders' X / full - 1) / floor lies
            # between the orders' own values.
            lo, hi = sorted(float(x[:-1]) for x in orders.groups())
            assert lo - 0.011 <= float(cells[5][:-1]) <= hi + 0.011, (label, cells)


def test_a_negative_window_is_refused(trace):
    r = subprocess.run([BENCH, "--trace", str(trace), "--suite", "policies", "--window", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "kvsim_bench: --window -1: must be 0 or more seconds"
    assert r.stdout == ""


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_one_cpu_is_refused_in_one_line(trace):
    r = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), BENCH, "--trace", str(trace),
                        "--suite", "policies", "--window", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "kvsim_bench: --suite policies needs two CPUs this process may use (see taskset -p)")


WINDOWED = {"snapkv", "pyramidkv", "adakv", "madakv"}  # an observation window of 32 prompt queries (default)
MERGING = {"meda", "meda variant=OFFICIAL_CODE", "look_m"}


def test_own_products_follow_each_runs_results(suite, trace, tmp_path):
    """The second table's products (round 29), recomputed here from `kvsim sweep`'s own results of the same
    runs: each run's output product over its mean cache and its merged slots' logits, the window's logits
    once, a merging run's search."""
    number = r"([\d.e+-]+)"
    printed = {label: ([float(x) for x in re.match(rf"^{number} \+ {number} \+ {number}$", cells[1]).groups()],
                       cells)
               for label, cells in table_rows(suite, r"^[\d.e+-]+ \+ [\d.e+-]+ \+ [\d.e+-]+$").items()}
    assert sorted(printed) == sorted(POLICIES), suite
    for label, (_, cells) in printed.items():
        assert re.match(r"^[\d.]+ \(\d+\) / [\d.]+ \(\d+\)$", cells[2]), label
        assert re.match(r"^(-?[\d.]+x|-) / (-?[\d.]+x|-)$", cells[4]), label
        assert re.match(r"^(-?[\d.]+x|-)$", cells[5]), label
        assert "nan" not in cells[4] + cells[5] and "inf" not in cells[4] + cells[5], label

    # The same runs through `kvsim sweep`: their kept slots per run and prompt slots kept per layer.
    cfg = tmp_path / "sweep.textproto"
    lines = [f'traces: "{trace}"']
    for label in POLICIES:
        name, *sets = label.split()
        lines.append("policies { name: \"%s\" %s label: \"%s\" }"
                     % (name, " ".join(f'set: "{s}"' for s in sets), label))
    lines += [f"budgets: {b}" for b in (0.05, 0.10, 0.20, 0.50)] + ["question_mode: QUERY_AWARE"]
    cfg.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    subprocess.run([KVSIM, "sweep", "--config", str(cfg), "--out", str(out)], check=True, capture_output=True)
    runs = list(csv.DictReader(open(out / "runs.csv")))
    layers = list(csv.DictReader(open(out / "layers.csv")))
    L, H, HKV, D, S = 2, 4, 2, 32, 8  # the fixture's model and decode steps

    def lround(x):  # C's lround (halves away from zero), as the bench rounds; Python's round() halves to even
        return int(math.floor(float(x) + 0.5))

    for label, (flops, _) in printed.items():
        mine = [row for row in runs if row["label"] == label]
        assert len(mine) == 4, label
        n = int(mine[0]["compressed_prompt_tokens"])
        # each run's output product over its mean cache, and its merged slots' logits
        output = sum(2 * (H // HKV) * S * (lround(row["kept_tokens_mean"]) + lround(row["merged_slots_mean"]))
                     * D * L * HKV for row in mine)
        window = 2 * min(32, n) * n * D * H * L if label.split()[0] in WINDOWED else 0
        search = 0
        if label in MERGING:
            for row in mine:
                for lr in layers:
                    if lr["run"] == row["run"]:
                        k = lround(lr["prompt_kept_tokens_mean"])
                        search += 2 * max(0, n - k) * k * D * HKV
            assert search > 0, label
        for got, want in zip(flops, (output, window, search)):
            assert got == pytest.approx(want / 1e9, rel=1e-3, abs=1e-12), (label, flops, output, window, search)
