"""Recorded prompt attention entropies (docs/trace-format.md, "Recorded prompt attention entropies"): the
per-(layer, region, kind, query head) values MEDA's first pass needs, so a trace can be replayed by MEDA without
its prompt queries.

Nothing is computed here: every value comes from kvsim's own C++ code through its extension kvsim._core
(python/bindings.cc): the regions from the replay's CompressEnd as `kvsim synth` chooses them, the entropies
from HeadPromptEntropies (sim/attention.cc, the function MEDA calls) on the stored-precision queries and keys,
and the checks from the reader's ValidatePromptEntropies. A recorded value is therefore bit-identical to the
one a replay would compute from the same trace's stored Q/K.
"""
import numpy as np

from .errors import CaptureError, MissingDependencyError

_HINT = ("build it (`cmake --build build --target kvsim_python`; scripts/kvsim-capture puts this checkout's "
         "python/ and build/python/ on the path) or capture with --no-prompt-entropies")


def native():
    """kvsim's extension module, or MissingDependencyError naming the fix."""
    try:
        from kvsim._native import core  # noqa: PLC0415
        return core()
    except ImportError as e:
        raise MissingDependencyError("recording prompt entropies (on by default) needs kvsim's extension "
                                     "kvsim._core: %s [%s]" % (_HINT, str(e).split("\n")[0])) from None


def _call(fn, *args):
    from kvsim.errors import KvsimError  # noqa: PLC0415 - importable whenever native() succeeded
    try:
        return fn(*args)
    except KvsimError as e:
        raise CaptureError(str(e)) from None


def regions(prompt_roles):
    """The compressible-region ends `kvsim synth` records, from the prompt's role codes (metadata.SYSTEM ..):
    the context before the first question token (query-agnostic replays) and the whole prompt n (query-aware
    replays); only [n] when the prompt has no question token (or starts with one)."""
    role = np.ascontiguousarray(prompt_roles, dtype=np.uint8)
    return _call(native().prompt_entropy_regions, role)


def layer_entropies(queries, keys, modality, region_ends, softmax_scale, sliding_window=0, logit_softcap=0.0,
                    causal=True, threads=0):
    """One layer's [regions, 3, H] float64 entropies. queries: [H, >= ce, d] of prompt positions 0..; keys:
    [Hkv, >= ce, d]; both as stored in the trace (float16 values are widened to float32 exactly, as kvsim's
    reader does); modality: codes of positions 0.. . threads <= 0: every core (results do not depend on it)."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    k = np.ascontiguousarray(keys, dtype=np.float32)
    mod = np.ascontiguousarray(modality, dtype=np.uint8)
    r = np.ascontiguousarray(region_ends, dtype=np.int32)
    return _call(native().prompt_entropies, q, k, mod, r, float(softmax_scale), int(sliding_window),
                 float(logit_softcap), bool(causal), int(threads))


def check(values, region_ends, num_heads, prefill_length, where):
    """Refuses what kvsim's reader refuses: shape other than [regions, 3, num_heads], a value outside
    [0, log ce] (NaN included), a bad region list. Raises CaptureError with the reader's message."""
    v = np.ascontiguousarray(values, dtype=np.float64)
    r = np.ascontiguousarray(region_ends, dtype=np.int32)
    _call(native().check_prompt_entropies, v, r, int(num_heads), int(prefill_length), where)
    return v
