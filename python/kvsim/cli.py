"""The `kvsim` command of the Python package: runs the kvsim binary installed with it (kvsim/bin/kvsim in
the wheel; build/python/kvsim/bin/kvsim in a source checkout), and `kvsim plot ...` in this interpreter
(kvsim.plot). $KVSIM_BIN names another binary."""
import os
import runpy
import sys
from pathlib import Path
from typing import List, Optional


def binary() -> str:
    """Path of the kvsim binary this package runs."""
    env = os.environ.get("KVSIM_BIN")
    if env:
        return env
    import kvsim

    for d in kvsim.__path__:
        p = Path(d) / "bin" / "kvsim"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    raise FileNotFoundError(
        "kvsim: error: the kvsim binary is not installed with this package (looked for bin/kvsim in "
        + ", ".join(kvsim.__path__) + "): `pip install .` in the kvsim checkout, or `make build` there")


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "plot":
        sys.argv = ["kvsim plot"] + args[1:]
        runpy.run_module("kvsim.plot", run_name="__main__", alter_sys=True)
        return 0
    try:
        exe = binary()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe] + args)
    return 1  # not reached
