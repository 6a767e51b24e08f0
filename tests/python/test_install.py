"""`cmake --install` (docs/cli.md "Install") into a temporary prefix gives a working kvsim: the binary on
prefix/bin runs from anywhere, with the example configs in prefix/share/kvsim/configs."""
import json
import os
import subprocess
from pathlib import Path

import pytest


def test_cmake_install_gives_a_working_kvsim(tmp_path):
    build = os.environ.get("KVSIM_BUILD_DIR")
    if not build:
        pytest.fail("KVSIM_BUILD_DIR is not set (run through ctest -R install_py)")
    prefix = tmp_path / "prefix"
    res = subprocess.run(["cmake", "--install", build, "--prefix", str(prefix)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    exe = prefix / "bin" / "kvsim"
    assert exe.is_file() and os.access(exe, os.X_OK)
    assert (prefix / "bin" / "kvsim_replay_gpu").is_file()
    configs = prefix / "share" / "kvsim" / "configs"
    assert (configs / "synth" / "tiny.textproto").is_file()
    assert (prefix / "share" / "doc" / "kvsim" / "cli.md").is_file()

    # Run from an unrelated folder with PATH pointing at the prefix only (plus the system's).
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=f"{prefix / 'bin'}:/usr/bin:/bin")

    def kvsim(*args):
        r = subprocess.run(["kvsim", *map(str, args)], capture_output=True, text=True, cwd=work, env=env)
        assert r.returncode == 0, r.stderr
        return r

    assert kvsim("version").stdout.startswith("kvsim ")
    assert "snapkv" in kvsim("list-policies").stdout
    kvsim("synth", "--config", configs / "synth" / "tiny.textproto", "--out", "t.h5")
    kvsim("run", "--trace", "t.h5", "--policy", "snapkv", "--budget", "0.2", "--out", "r.json")
    result = json.loads((work / "r.json").read_text())
    assert result["policy"] == "snapkv" and 0 < result["metrics"]["retained_mass_mean"] <= 1
    # The installed binary does not load anything from the build folder (no build-tree RPATH).
    dyn = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert str(Path(build).resolve()) not in dyn and build not in dyn
