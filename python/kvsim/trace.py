"""kvsim.Trace: a trace file's metadata, token table and tensors, read by kvsim's own C++ reader.

Opening validates the file exactly as `kvsim validate` / `kvsim run` do (same one-line errors, as
KvsimError); a layer's tensors come back as float32 NumPy arrays (fp16 files are widened, as the engine does).
Format: docs/trace-format.md.
"""
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import numpy as np

from ._native import core

MODALITIES = ("text", "image", "video", "other")  # sim/trace.h Modality codes
PHASES = ("prefill", "decode")
ROLES = ("system", "context", "question", "generated")


@dataclass(frozen=True)
class Layer:
    """One layer's tensors (float32, row-major):
    keys, values [num_kv_heads, total_tokens, head_dim]; queries [num_heads, len(query_positions), head_dim]
    (query i is the token at trace.query_positions[i]); prefill_column_sums [num_heads, prefill_length] or
    None (Σ over prompt queries of the attention each prompt key receives); prompt_entropies
    [len(meta["prompt_entropy_regions"]), 3, num_heads] float64 or None (the recorded mean prompt attention
    entropies in nats per compressible region, kind — 0 causal self, 1 text→visual, 2 visual→text — and
    query head; docs/trace-format.md)."""
    layer: int
    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    prefill_column_sums: Optional[np.ndarray]
    prompt_entropies: Optional[np.ndarray] = None


class Trace:
    """A kvsim trace file (HDF5), opened and checked by the C++ reader.

        t = kvsim.Trace("trace.h5")
        t.model["num_layers"], t.prefill_length, t.tokens.head()
        k = t.layer(0).keys          # [kv_heads, T, head_dim] float32
    """

    def __init__(self, path):
        self._path = os.fspath(path)
        self._t = core().Trace(self._path)
        self._meta: Dict[str, Any] = self._t.meta()
        self._tokens = None

    # ---- metadata -----------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @property
    def meta(self) -> Dict[str, Any]:
        """Every root field (docs/trace-format.md) as a dict: model, prefill_length, num_decode_steps,
        source, generator, seed, storage_dtype, query_positions, has_prefill_column_sums,
        prompt_entropy_regions (int32, empty when the trace records no prompt entropies), stream, integrity,
        ..."""
        return self._meta

    @property
    def model(self) -> Dict[str, Any]:
        """name, family, num_layers, num_heads, num_kv_heads, head_dim, softmax_scale, causal,
        sliding_window, logit_softcap, rope_theta, model_dtype."""
        return self._meta["model"]

    @property
    def num_layers(self) -> int:
        return self._meta["model"]["num_layers"]

    @property
    def prefill_length(self) -> int:
        return self._meta["prefill_length"]

    @property
    def num_decode_steps(self) -> int:
        return self._meta["num_decode_steps"]

    @property
    def total_tokens(self) -> int:
        return self._meta["total_tokens"]

    @property
    def source(self) -> str:
        """"captured" (a real model run, kvsim_capture) or "synthetic" (kvsim synth)."""
        return self._meta["source"]

    @property
    def query_positions(self) -> np.ndarray:
        return self._meta["query_positions"]

    @property
    def is_streaming(self) -> bool:
        return self._meta["stream"] is not None

    @property
    def stream(self) -> Optional[Dict[str, Any]]:
        """Streaming traces: fps, init_len, tokens_per_frame, num_frames, frame_time_s, questions,
        block_encodings; None otherwise."""
        return self._meta["stream"]

    @property
    def tokens(self):
        """The token table as a pandas DataFrame, one row per token (prefill then decode): position,
        modality, segment_id, patch_row, patch_col, position_id, phase, role (names as categoricals), and
        token_id / text when the trace stores them."""
        if self._tokens is None:
            import pandas as pd

            cols = self._t.tokens()
            n = len(cols["modality"])
            data = {"position": np.arange(n, dtype=np.int64)}
            for name, codes, names in (("modality", cols["modality"], MODALITIES),
                                       ("phase", cols["phase"], PHASES), ("role", cols["role"], ROLES)):
                data[name] = pd.Categorical.from_codes(codes.astype(np.int16), categories=list(names))
            for name in ("segment_id", "patch_row", "patch_col", "position_id", "token_id", "text"):
                if name in cols:
                    data[name] = cols[name]
            self._tokens = pd.DataFrame(data)
        return self._tokens

    # ---- tensors --------------------------------------------------------------------------------------------
    def layer(self, layer: int) -> Layer:
        """Layer `layer`'s tensors (read and validated by the C++ reader, the GIL released meanwhile)."""
        d = self._t.layer(int(layer))
        return Layer(d["layer"], d["keys"], d["values"], d["queries"], d["prefill_column_sums"],
                     d["prompt_entropies"])

    def layers(self) -> Iterator[Layer]:
        """Every layer in order, one resident at a time."""
        for i in range(self.num_layers):
            yield self.layer(i)

    # ---- derived --------------------------------------------------------------------------------------------
    def stats(self, threads: int = 0) -> Dict[str, Any]:
        """`kvsim inspect --json`: measured decode-attention statistics per layer (plain traces) or the
        stream summary (streaming traces)."""
        return json.loads(self._t.stats_json(int(threads)))

    def hash(self) -> str:
        """The content hash results record as trace_hash (`kvsim hash`)."""
        return self._t.hash()

    def __repr__(self) -> str:
        m = self.model
        kind = "streaming " if self.is_streaming else ""
        return (f"<kvsim.Trace {self._path!r}: {self.source} {kind}{m['name']}, {m['num_layers']} layers, "
                f"{m['num_heads']}/{m['num_kv_heads']} heads x {m['head_dim']}, prompt {self.prefill_length} "
                f"+ {self.num_decode_steps} decode tokens>")
