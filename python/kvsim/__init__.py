"""kvsim: replay recorded LLM attention traces against KV-cache compression policies, from Python.

    import kvsim
    r = kvsim.run("trace.h5", "snapkv", budget=0.2, window=16)   # the numbers `kvsim run` writes
    runs = kvsim.sweep(traces=["trace.h5"], policies=["snapkv", "h2o"], budgets=[0.1, 0.2])
    df = kvsim.load_results("results/")                            # tidy pandas DataFrame
    t = kvsim.Trace("trace.h5"); t.layer(0).keys                   # NumPy arrays

The engine runs in-process (the extension kvsim._core, the same C++ code as the `kvsim` CLI) and releases
the GIL while it replays; bad input raises kvsim.KvsimError with the CLI's one-line message. Reference:
docs/python.md. Submodules are imported on first use, so `import kvsim` (and `python -m kvsim.plot`) does not
load the extension.
"""
import importlib
import pkgutil

from .errors import KvsimError

# A source checkout's build puts the extension in build/python/kvsim/ (docs/python.md, "Installing"): every
# kvsim/ folder on sys.path is part of the package.
__path__ = pkgutil.extend_path(__path__, __name__)

_LAZY = {
    "run": "api", "sweep": "api", "policies": "api",
    "load_results": "results", "to_frame": "results",
    "Trace": "trace", "Layer": "trace",
}
_SUBMODULES = ("api", "results", "trace", "capture", "cli", "plot", "ray")

__all__ = ["KvsimError", "Layer", "Trace", "capture", "load_results", "policies", "ray", "run", "sweep",
           "to_frame"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module("." + _LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    if name in ("__version__", "git_commit"):
        from ._native import core
        return core().__version__ if name == "__version__" else core().git_commit
    raise AttributeError(f"module 'kvsim' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | {"__version__", "git_commit"})
