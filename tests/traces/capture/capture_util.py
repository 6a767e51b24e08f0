"""Shared helpers for the capture tests: skip cleanly without torch, run a tiny-model capture, find kvsim."""
import os
import subprocess
import unittest

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the machine
    raise unittest.SkipTest("torch is not installed: run the tests with .venv/bin/python (scripts/setup_python.sh makes it)") from e

import numpy as np  # noqa: E402

import tiny_model as tm  # noqa: E402
from kvsim_capture import CaptureOptions, Recorder, build_token_metadata, capture_attention  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(REPO, "build", "kvsim"))
# What a capture subprocess needs on PYTHONPATH (as scripts/kvsim-capture sets it): the capture package, the
# kvsim package and its extension from the build folder holding KVSIM (prompt entropies, docs/capture.md).
CAPTURE_PYTHONPATH = os.pathsep.join([os.path.join(REPO, "traces", "capture"), os.path.join(REPO, "python"),
                                      os.path.join(os.path.dirname(os.path.abspath(KVSIM)), "python")])
GRIDS = ((3, 3), (2, 4))

# Builds without kvsim's extension (the sanitizer stage: CMake sets this variable) cannot record prompt entropies,
# which the capture does by default: there the tests capture without them (CaptureOptions' default turned off,
# the command line given --no-prompt-entropies) and test_entropies.py is skipped. Every other build runs it all.
NO_EXTENSION = os.environ.get("KVSIM_CAPTURE_TESTS_NO_EXTENSION") == "1"
CLI_EXTRA = ["--no-prompt-entropies"] if NO_EXTENSION else []
if NO_EXTENSION:
    import dataclasses  # noqa: E402

    _names = [f.name for f in dataclasses.fields(CaptureOptions) if f.default is not dataclasses.MISSING]
    _defaults = list(CaptureOptions.__init__.__defaults__)
    _defaults[_names.index("prompt_entropies")] = False
    CaptureOptions.__init__.__defaults__ = tuple(_defaults)

tm.ATTENTION_FUNCTIONS["kvsim_capture"] = capture_attention


def kvsim(*args):
    if not os.path.exists(KVSIM):
        raise unittest.SkipTest("kvsim binary not found at %s (build it, or set KVSIM_BIN)" % KVSIM)
    return subprocess.run([KVSIM, *args], capture_output=True, text=True)


def model(**cfg_kw):
    return tm.TinyVLM(tm.TinyConfig(**cfg_kw))


def run(m, path, options=None, max_new_tokens=6, grids=GRIDS, position_ids=None, extra=None):
    """Generates with the capture selected and writes `path`. Returns (ids, logits, token metadata)."""
    cfg = m.config
    ids, patches, spans = tm.make_prompt(cfg, grids=grids)
    prev, cfg.attn_implementation = cfg.attn_implementation, "kvsim_capture"
    try:
        with Recorder(options or CaptureOptions(), cfg.num_layers, max_new_tokens) as rec:
            with rec.recording(tm.eager_attention_forward):
                gen, logits = m.generate(ids, patches, max_new_tokens, position_ids=position_ids)
            t = rec.total_tokens
            pos = rec.position_ids[:, :t] if rec.position_ids is not None else None
            meta = build_token_metadata(ids, gen[: t - len(ids)], image_token_id=cfg.image_token_id,
                                        image_grids=[list(g) for g in grids], position_ids=pos, **spans)
            rec.write_trace(path, meta, "tiny-vlm", "llama", cfg.rope_theta,
                            extra=extra(rec) if extra else None)
    finally:
        cfg.attn_implementation = prev
    return gen, logits, meta


def reference_probs(q, k, scale, window=0, softcap=0.0, q_pos=None):
    """Float64 softmax rows: q [c, d] at positions q_pos over k [t, d] (causal, window, soft-cap)."""
    logits = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    i = np.asarray(q_pos)[:, None]
    j = np.arange(k.shape[0])[None, :]
    vis = j <= i
    if window:
        vis &= (i - j) < window
    logits = np.where(vis, logits, -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)
