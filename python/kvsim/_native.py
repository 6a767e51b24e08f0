"""Loads the extension kvsim._core on first use, with an error that says how to build it."""
import importlib

from .errors import KvsimError

_core = None


def core():
    global _core
    if _core is None:
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
