"""Streaming-video block encodings for MuKV / ReKV-style studies (docs/capture.md, POLICY_NOTES §5).

MuKV cuts the flattened video token stream into contiguous g-token blocks (g in {49, 196, 784}, leftovers
dropped) and encodes each block on its own after the initial (system) prompt only: no context between
blocks, positions restart at init_len. A normal model run cannot produce these K/V, so this module re-runs
the language model once per block and records, per recorded layer, the block tokens' post-RoPE keys and
values and the attention each block key receives from the block's own queries (summed over the block's
queries, per head; the softmax runs over init + block keys). They are stored beside the trace as the
optional group /streaming_blocks (docs/trace-format.md, "Extensions"); kvsim itself ignores them.
"""
import os

import numpy as np
import torch

from .errors import CaptureError
from .recorder import _ACTIVE_LOCK, Recorder, set_active
from .writer import STORAGE_DTYPES, create_dataset


class StreamBlockRecorder:
    """Plugs into capture_attention like a Recorder while blocks are encoded (one block per forward call,
    no cache). Shares the main Recorder's layer/head selection and scratch folder."""

    def __init__(self, main: Recorder, init_len, stream_positions, granularities):
        if main.n is None:
            raise CaptureError("encode the stream blocks after the main capture (the Recorder sets the model shape)")
        self.main = main
        self.init_len = int(init_len)
        self.stream_positions = np.asarray(stream_positions, dtype=np.int64)
        self.granularities = [int(g) for g in granularities]
        if any(g <= 0 for g in self.granularities):
            raise CaptureError("block granularities must be > 0, got %s" % self.granularities)
        self.inner = main.inner
        self._g = self._b = None
        self._seen = set()
        self.store = {}
        dt = STORAGE_DTYPES[main.options.storage_dtype]
        hkv, h, d = len(main.kv_sel), len(main.q_sel), main.head_dim
        for g in self.granularities:
            nb = len(self.stream_positions) // g
            for layer in main.layers:
                def mm(name, shape, dtype):
                    return np.lib.format.open_memmap(
                        os.path.join(main._scratch, "blk%d_l%03d_%s.npy" % (g, layer, name)), mode="w+",
                        dtype=dtype, shape=shape)
                self.store[g, layer] = (mm("k", (hkv, max(nb * g, 1), d), dt), mm("v", (hkv, max(nb * g, 1), d), dt),
                                        mm("a", (h, max(nb * g, 1)), np.float32))

    def num_blocks(self, g):
        return len(self.stream_positions) // g

    @torch.no_grad()
    def record(self, module, query, key, value, attention_mask, scaling, kwargs):
        main = self.main
        layer = main._layer_of(module)
        if layer is None or layer not in main._layer_set:
            return
        g, b, i0 = self._g, self._b, self.init_len
        if g is None:
            raise CaptureError("stream block attention call outside StreamBlockRecorder.block()")
        if query.shape[2] != i0 + g or key.shape[2] != i0 + g:
            raise CaptureError("block forward must run init (%d) + block (%d) tokens without a cache; got %d "
                               "queries and %d keys" % (i0, g, query.shape[2], key.shape[2]))
        kv_idx = torch.tensor(main.kv_sel, device=key.device)
        q_idx = torch.tensor(main.q_sel, device=query.device)
        k = key[0].index_select(0, kv_idx)
        v = value[0].index_select(0, kv_idx)
        q = query[0].index_select(0, q_idx).to(torch.float32)
        ks, vs, a = self.store[g, layer]
        ks[:, b * g:(b + 1) * g] = main._to_storage(k[:, i0:], "block keys", layer)
        vs[:, b * g:(b + 1) * g] = main._to_storage(v[:, i0:], "block values", layer)
        kf = k.to(torch.float32).repeat_interleave(main.num_heads // main.num_kv_heads, dim=0)
        probs = main._probs(q[:, i0:], kf, i0)              # block queries over init + block keys
        a[:, b * g:(b + 1) * g] = probs[:, :, i0:].sum(dim=1).cpu().numpy()
        self._seen.add((g, b, layer))

    def encode(self, lm_forward, inputs_embeds, position_fn=None):
        """inputs_embeds [1, n, hidden]: the prompt embeddings the language model saw (visual features
        merged). For each granularity and block, calls lm_forward(x, position_ids) with x = init + block
        embeddings and position_ids = 0..init_len+g-1 (or position_fn(init_len, g)); no cache."""
        init = inputs_embeds[:, : self.init_len]
        for g in self.granularities:
            pos = position_fn(self.init_len, g) if position_fn else torch.arange(self.init_len + g)
            for b in range(self.num_blocks(g)):
                idx = torch.as_tensor(self.stream_positions[b * g:(b + 1) * g], device=inputs_embeds.device)
                x = torch.cat([init, inputs_embeds[:, idx]], dim=1)
                self._g, self._b = g, b
                with _ACTIVE_LOCK:
                    prev = set_active(self)
                    try:
                        lm_forward(x, pos)
                    finally:
                        set_active(prev)
                self._g = self._b = None
        missing = [(g, b, l) for g in self.granularities for b in range(self.num_blocks(g))
                   for l in self.main.layers if (g, b, l) not in self._seen]
        if missing:
            raise CaptureError("stream blocks not recorded for (granularity, block, layer) %s" % missing[:3])

    def write(self, writer):
        """Writes /streaming_blocks/g{g}/... (see docs/trace-format.md, Extensions)."""
        root = writer.extra_group("streaming_blocks")
        root.attrs["init_len"] = np.int64(self.init_len)
        root.attrs["granularities"] = np.asarray(self.granularities, dtype=np.int64)
        for g in self.granularities:
            nb = self.num_blocks(g)
            grp = root.create_group("g%d" % g)
            grp.attrs["granularity"] = np.int64(g)
            grp.attrs["num_blocks"] = np.int64(nb)
            create_dataset(grp, "token_positions", data=self.stream_positions[: nb * g].astype("<i4"))
            for out_layer, layer in enumerate(self.main.layers):
                ks, vs, a = self.store[g, layer]
                lg = grp.create_group("layer_%03d" % out_layer)
                create_dataset(lg, "keys", data=ks[:, : nb * g])
                create_dataset(lg, "values", data=vs[:, : nb * g])
                create_dataset(lg, "attention_received", data=a[:, : nb * g])
