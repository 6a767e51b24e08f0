"""Shared fixtures of the Python package's tests: the kvsim binary ($KVSIM_BIN, set by CTest) and small traces
written once per session by `kvsim synth` from configs/synth/."""
import os
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2]
SYNTH = SRC / "configs" / "synth"


@pytest.fixture(scope="session")
def kvsim_bin():
    exe = os.environ.get("KVSIM_BIN")
    if not exe:
        pytest.fail("KVSIM_BIN is not set (run through ctest -R python_api_py)")
    return exe


def cli(kvsim_bin, *args, check=True):
    """Runs the kvsim binary; returns the CompletedProcess (text)."""
    res = subprocess.run([kvsim_bin, *map(str, args)], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise AssertionError(f"kvsim {' '.join(map(str, args))} failed: {res.stderr}")
    return res


@pytest.fixture(scope="session")
def traces(kvsim_bin, tmp_path_factory):
    """tiny (MHA, fp32, every query, column sums), gqa (fp16, query window), stream (streaming video)."""
    d = tmp_path_factory.mktemp("py_traces")
    out = {}
    for name, cfg in (("tiny", "tiny"), ("gqa", "tiny_gqa"), ("stream", "streaming_tiny")):
        out[name] = str(d / f"{name}.h5")
        cli(kvsim_bin, "synth", "--config", SYNTH / f"{cfg}.textproto", "--out", out[name], "--threads", "1")
    return out
