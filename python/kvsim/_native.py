"""Loads the extension kvsim._core on first use, with an error that says how to build it."""
import importlib
import os
import subprocess
import sys

from .errors import KvsimError

_core = None


def core():
    global _core
    if _core is None:
        _request_blas_kernels()
        try:
            _core = importlib.import_module("kvsim._core")
        except ImportError as e:
            raise ImportError(
                "kvsim's engine (the extension kvsim._core) is not built or not on the path: `pip install .` in "
                "the kvsim checkout, or build it with `cmake --build build --target kvsim_python` and put "
                f"build/python on PYTHONPATH (docs/python.md) [{e}]") from e
    return _core


def check(cond, message):
    if not cond:
        raise KvsimError(message)


def _request_blas_kernels():
    """OpenBLAS's vector kernels on a CPU it does not know, as the kvsim binary gets them (sim/blas.h).

    OpenBLAS picks its kernels from the CPU's model when it is loaded, and falls back to its generic ones (several
    times slower) on a CPU newer than the library; only OPENBLAS_CORETYPE, read at load time, changes that. So before
    this process loads the extension (and with it OpenBLAS), a child process loads it and says which kernel set
    kvsim's rule asks for; an empty answer (or any failure) leaves OpenBLAS's own choice. A user's
    OPENBLAS_CORETYPE stands.
    """
    if os.environ.get("OPENBLAS_CORETYPE"):
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        res = subprocess.run([sys.executable, "-c", "import kvsim._core as c; print(c.blas_core_to_request())"],
                             capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError):
        return
    want = res.stdout.strip()
    if res.returncode == 0 and want.isalnum():
        os.environ["OPENBLAS_CORETYPE"] = want
