"""kvsim_bench --suite policies (issue 14, round 28): each text policy x 4 budgets beside `full` alone at the
same time, pinned to two cores. On a small synthetic trace with --window 0 (one run per side): a row per
policy with both core orders, and one-line errors for a bad window and for a process that may use one CPU."""

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


@pytest.mark.skipif(not two_cpus(), reason="--suite policies pins two runs to two CPUs")
def test_every_policy_gets_a_paired_row(trace):
    r = subprocess.run([BENCH, "--trace", str(trace), "--suite", "policies", "--window", "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.match(r"^[\d.]+ \(\d+\) / [\d.]+ \(\d+\)$", cells[1]):
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(POLICIES + ["floor: 4 runs' own output products (BLAS)"]), r.stdout
    floor = rows.pop("floor: 4 runs' own output products (BLAS)")
    # The ratios need `full`'s CPU time, which a run of this tiny trace may finish within a clock tick: then
    # "-", never a division by zero.
    timed = floor[4] != "-"
    if timed:
        assert float(floor[4].split()[-1]) > 0
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
        assert re.match(rf"^{ratio} / {ratio}$", cells[4]), label
        assert "nan" not in cells[4] and "inf" not in cells[4], label
        if not timed:
            assert cells[4] == "- / -", label


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
