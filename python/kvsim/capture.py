"""kvsim.capture: the capture tool (kvsim_capture, docs/capture.md) under the kvsim package.

`kvsim.capture` IS the kvsim_capture module (same objects, no second copy), and `kvsim.capture.hf`,
`from kvsim.capture import recorder`, ... are kvsim_capture's submodules. `python -m kvsim.capture ...` is
`python -m kvsim_capture ...`. It needs the capture extras (torch, transformers, h5py; python/requirements.lock).
"""
import importlib
import importlib.abc
import importlib.util
import sys

_PREFIX = __name__ + "."  # "kvsim.capture."


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports kvsim.capture.X as the module kvsim_capture.X itself (not a re-executed copy)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        real = "kvsim_capture." + fullname[len(_PREFIX):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module("kvsim_capture." + spec.name[len(_PREFIX):])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system set the alias's spec on the real module; give it back its own.
        module.__spec__ = self.specs.get(module.__spec__.name, module.__spec__)

    def __init__(self):
        self.specs = {}


if __name__ == "__main__":
    from kvsim_capture.cli import main

    sys.exit(main())

import kvsim_capture as _impl  # noqa: E402

if not any(isinstance(f, _SubmoduleAlias) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleAlias())  # before the path finder, which would load a copy
sys.modules[__name__] = _impl
