"""bench/numpy_replay.py (the NumPy baseline of issue 14) agrees with kvsim to 1e-5 on small synthetic traces:
MHA, GQA with a sliding window and a logit soft-cap, float16 storage; and it refuses bad input in one line."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "numpy_replay.py")
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(ROOT, "build", "kvsim"))

MODELS = {
    "mha": 'num_layers: 2 num_heads: 4 num_kv_heads: 4 head_dim: 32 rope_theta: 10000',
    "gqa_window_softcap": 'num_layers: 2 num_heads: 6 num_kv_heads: 2 head_dim: 16 rope_theta: 10000 '
    "sliding_window: 96 logit_softcap: 30",
}


def synth(tmp_path, name, dtype="float16"):
    cfg = tmp_path / f"{name}.textproto"
    cfg.write_text(
        f'model {{ name: "{name}" family: "llama" {MODELS[name]} }}\n'
        "layout {\n  segments { kind: TEXT role: SYSTEM tokens: 10 }\n"
        "  segments { kind: IMAGE rows: 8 cols: 8 repeat: 2 text_between: 6 }\n"
        "  segments { kind: TEXT role: QUESTION tokens: 12 }\n  decode_steps: 12\n}\n"
        f'storage {{ query_storage: ALL dtype: "{dtype}" record_prefill_column_sums: true }}\n'
        "profile { dense_layers: 1 }\nseed: 5\n"
    )
    trace = tmp_path / f"{name}.h5"
    subprocess.run([KVSIM, "synth", "--config", str(cfg), "--out", str(trace)], check=True, capture_output=True)
    return trace


@pytest.mark.parametrize("name", sorted(MODELS))
def test_agrees_with_kvsim(tmp_path, name):
    trace = synth(tmp_path, name)
    r = subprocess.run(
        [sys.executable, SCRIPT, str(trace), "--kvsim", KVSIM, "--threads", "2", "--tolerance", "1e-5"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "agreement: largest |kvsim - numpy|" in r.stdout
    assert "| best |" in r.stdout


def test_a_wrong_selection_is_caught(tmp_path):
    """The check can fail: a baseline with the sinks off by one disagrees with kvsim."""
    trace = synth(tmp_path, "mha")
    env = dict(os.environ, KVSIM_NUMPY_REPLAY_SINKS="3")
    r = subprocess.run(
        [sys.executable, SCRIPT, str(trace), "--kvsim", KVSIM, "--threads", "1"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DISAGREEMENT" in r.stderr and "streaming_llm" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budgets", "0.5,2"], "--budgets '0.5,2': expected comma-separated fractions in (0, 1]"),
        (["--budgets", "x"], "--budgets 'x': expected comma-separated fractions in (0, 1]"),
    ],
)
def test_bad_input(tmp_path, args, message):
    trace = synth(tmp_path, "mha")
    r = subprocess.run([sys.executable, SCRIPT, str(trace)] + args, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"numpy_replay: error: {message}"


def test_missing_trace(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none.h5")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("numpy_replay: error: trace ") and r.stderr.count("\n") == 1
