"""Records post-RoPE Q/K/V and attention aggregates from inside a model's attention calls.

`capture_attention` has the signature of a transformers AttentionInterface function
(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs); it forwards the call unchanged
to the wrapped ("inner") implementation and returns exactly what that returns, and records on the side:

  query [1, H, q_len, d] (post-RoPE), key/value [1, Hkv, kv_len, d] (post-RoPE, the whole cache after this
  step's update, not yet repeated for GQA), as transformers' eager/SDPA functions receive them.

Per recorded layer, tensors are spilled to numpy memmaps in a scratch folder as they arrive (prefill, then
one row per decode step), so host memory stays bounded; `Recorder.write_trace` then streams the finished
layers into the trace one at a time. Aggregates (prefill column sums, optional decode attention rows) are
computed on the model's device in float32 from the unrounded Q/K, in query chunks, never materialising
a full [H, n, n] attention matrix.
"""
import contextlib
import dataclasses
import math
import os
import resource
import shutil
import tempfile
import threading
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

from .errors import CaptureError, CaptureOutOfMemoryError, UnsupportedModelError
from .writer import FLOAT16_MAX, STORAGE_DTYPES, TraceWriter, create_dataset

GENERATOR = "kvsim_capture"
VERSION = "0.1.0"

_ACTIVE = None  # the Recorder that capture_attention feeds, set by Recorder.recording()
_ACTIVE_LOCK = threading.RLock()


def bound_heap_growth():
    """Caps glibc's dynamic mmap threshold at 1 MiB. By default every freed large block raises the threshold
    (up to 32 MiB), after which the per-layer aggregate temporaries come from the heap and fragment it: the
    SmolLM2 passkey capture peaked at 2.9 GB instead of 1.6 GB. No effect outside glibc."""
    try:
        import ctypes  # noqa: PLC0415
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it also disables the dynamic adjustment)
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def set_active(recorder):
    """Makes `recorder` (anything with .inner and .record) the target of capture_attention; returns the
    previous one."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, recorder
    return prev


@dataclasses.dataclass
class CaptureOptions:
    """What to record. Defaults: every layer and head, float16, last 64 prompt queries + decode queries,
    prefill column sums, prompt entropies, no decode rows."""
    layers: Optional[Sequence[int]] = None     # model layer indices to record (ascending); None = all
    kv_heads: Optional[Sequence[int]] = None   # KV head indices; their query heads come along; None = all
    storage_dtype: str = "float16"             # float16 | float32
    query_window: int = 64                     # W: queries of the last W prompt tokens are stored
    all_queries: bool = False                  # store every prompt query (query_mode 'all')
    column_sums: bool = True                   # /aggregates/layer_XXX/prefill_column_sums
    prompt_entropies: bool = True              # /aggregates/layer_XXX/prompt_entropies (needs kvsim._core)
    decode_rows: bool = False                  # /capture/decode_attention/layer_XXX (extension)
    scratch_dir: Optional[str] = None          # where spill files go (default: beside the output / TMPDIR)
    aggregate_chunk_elems: int = 1 << 25       # float32 logits per aggregate chunk (128 MiB)

    def validate(self):
        if self.storage_dtype not in STORAGE_DTYPES:
            raise CaptureError("--dtype must be float16 or float32, got '%s'" % self.storage_dtype)
        if self.query_window < 0:
            raise CaptureError("query window must be >= 0, got %d" % self.query_window)
        for name in ("layers", "kv_heads"):
            v = getattr(self, name)
            if v is not None:
                v = list(v)
                if not v or v != sorted(set(v)) or v[0] < 0:
                    raise CaptureError("%s must be a non-empty ascending list of distinct indices >= 0, got %s"
                                       % (name, v))
        if self.prompt_entropies:
            from . import entropies  # noqa: PLC0415
            entropies.native()  # fails here, before a model is loaded or run, when kvsim's extension is missing


class _LayerSpill:
    """Scratch storage of one recorded layer."""

    def __init__(self, folder, layer, hkv, h, d, t_cap, q_cap, q_first, steps_cap, dtype, decode_rows):
        def mm(name, shape, dt):
            path = os.path.join(folder, "l%03d_%s.npy" % (layer, name))
            try:
                m = np.lib.format.open_memmap(path, mode="w+", dtype=dt, shape=shape)
                # Reserve the blocks now: a write into a sparse memmap on a full disk is a SIGBUS, not an error.
                with open(path, "r+b") as f:
                    os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
            except OSError as e:
                raise CaptureError("cannot reserve %.1f MB of scratch space in %s (%s); free disk space or pass "
                                   "--scratch-dir" % (np.prod(shape) * np.dtype(dt).itemsize / 1e6, folder,
                                                      e.strerror or e)) from e
            return m
        self.keys = mm("k", (hkv, t_cap, d), dtype)
        self.values = mm("v", (hkv, t_cap, d), dtype)
        self.queries = mm("q", (h, q_cap, d), dtype)
        self.q_first = q_first                 # first prompt position whose query is spilled
        self.column_sums = None                # [H, n] float32
        self.decode_rows = mm("rows", (h, max(steps_cap, 1), t_cap), np.float32) if decode_rows else None
        self.count = 0                         # tokens recorded so far


class Recorder:
    """Accumulates one capture (batch size 1: one prompt, greedy or sampled decode).

    num_layers: the model's layer count; max_new_tokens: upper bound on decode forward calls (a generate()
    of N new tokens makes 1 prefill + N-1 decode calls). Use `with rec.recording(inner):` around the model
    run, then `rec.write_trace(...)`, then `rec.close()` (or use the Recorder as a context manager)."""

    def __init__(self, options: CaptureOptions, num_layers: int, max_new_tokens: int,
                 module_layers: Optional[Dict[int, int]] = None):
        options.validate()
        self.options = options
        self.num_layers = num_layers
        self.max_new_tokens = max_new_tokens
        self.module_layers = module_layers  # id(attention module) -> layer index; None: use module.layer_idx
        layers = list(range(num_layers)) if options.layers is None else list(options.layers)
        if layers[-1] >= num_layers:
            raise CaptureError("layer %d requested but the model has %d layers (0..%d)"
                               % (layers[-1], num_layers, num_layers - 1))
        self.layers = layers
        self._layer_set = set(layers)
        self.inner: Optional[Callable] = None
        self._scratch = None
        self._spill: Dict[int, _LayerSpill] = {}
        self.n = None                # prefill length
        self.q_store_first = None    # first prompt position whose query the trace stores
        self.num_heads = self.num_kv_heads = self.head_dim = None  # of the model (before head subsetting)
        self.kv_sel = self.q_sel = None
        self.scaling = None
        self.softcap = 0.0
        self.sliding_window = 0
        self.model_dtype = None
        self.position_ids = None     # np.int64 [A, t_cap] (A = 1, or 3 for multi-axis RoPE); -1 = not seen
        self._pos_seen = 0

    # ------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Deletes the scratch files."""
        self._spill.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    @contextlib.contextmanager
    def recording(self, inner: Callable):
        """Routes capture_attention to this recorder, which forwards every call to `inner` (the model's
        normal attention function, e.g. transformers' sdpa or eager implementation)."""
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            raise CaptureError("another capture is already recording in this process; captures run one at a time")
        self.inner = inner
        bound_heap_growth()
        _ACTIVE = self
        try:
            yield self
        except torch.cuda.OutOfMemoryError as e:
            raise CaptureOutOfMemoryError(
                "out of GPU memory while capturing (%s); record fewer layers (--layers 0-7), fewer heads "
                "(--kv-heads 0,1), without --decode-rows, or use a shorter prompt" % str(e).split("\n")[0]) from e
        finally:
            _ACTIVE = None

    @property
    def total_tokens(self):
        if not self._spill:
            return 0
        counts = {s.count for s in self._spill.values()}
        if len(counts) != 1:
            raise CaptureError("recorded layers saw different numbers of tokens %s; the run was interrupted"
                               % sorted(counts))
        return counts.pop()

    # ------------------------------------------------------------------------------------------ recording
    def _layer_of(self, module):
        if self.module_layers is not None:
            return self.module_layers.get(id(module))
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise UnsupportedModelError(
                "attention module %s has no 'layer_idx' attribute; pass module_layers={id(module): layer} to "
                "the Recorder" % type(module).__name__)
        return int(idx)

    def _setup(self, query, key, scaling, kwargs):
        _, h, n, d = query.shape
        hkv = key.shape[1]
        if h % hkv:
            raise UnsupportedModelError("query heads (%d) are not a multiple of KV heads (%d)" % (h, hkv))
        self.n, self.num_heads, self.num_kv_heads, self.head_dim = n, h, hkv, d
        o = self.options
        self.q_store_first = 0 if o.all_queries else max(n - o.query_window, 0)
        if d > 1024:
            raise UnsupportedModelError("head_dim %d > 1024 is not supported by kvsim trace v1" % d)
        kv_sel = list(range(hkv)) if self.options.kv_heads is None else list(self.options.kv_heads)
        if kv_sel[-1] >= hkv:
            raise CaptureError("KV head %d requested but the model has %d KV heads" % (kv_sel[-1], hkv))
        g = h // hkv
        self.kv_sel = kv_sel
        self.q_sel = [kv * g + i for kv in kv_sel for i in range(g)]
        self.scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(d)
        self.softcap = float(kwargs.get("softcap") or 0.0)
        self.sliding_window = int(kwargs.get("sliding_window") or 0)
        self.model_dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                            torch.float32: "float32"}.get(query.dtype)
        if self.model_dtype is None:
            raise UnsupportedModelError("attention runs in %s; only float16, bfloat16 and float32 are supported"
                                        % query.dtype)
        folder = self.options.scratch_dir
        try:
            self._scratch = tempfile.mkdtemp(prefix="kvsim_capture_", dir=folder)
        except OSError as e:
            raise CaptureError("cannot create a scratch folder in '%s' (%s)" % (folder or tempfile.gettempdir(), e))
        self.position_ids = None

    def _check_consistent(self, layer, query, key, scaling, kwargs):
        got = (query.shape[1], key.shape[1], query.shape[3],
               float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[3]),
               float(kwargs.get("softcap") or 0.0), int(kwargs.get("sliding_window") or 0))
        want = (self.num_heads, self.num_kv_heads, self.head_dim, self.scaling, self.softcap, self.sliding_window)
        if got != want:
            raise UnsupportedModelError(
                "layer %d has (heads, kv_heads, head_dim, scale, softcap, sliding_window) = %s but an earlier "
                "layer has %s; kvsim trace v1 needs one value for all layers: capture a --layers subset whose "
                "layers agree" % (layer, got, want))

    def _check_mask(self, layer, mask, q_len, kv_len):
        """The model's own mask must be plain causal (+ sliding window): anything else (bidirectional image
        attention, padding) cannot be replayed from a v1 trace."""
        if mask is None or not torch.is_tensor(mask) or mask.dim() != 4:
            return
        m = mask[0, 0, :, :kv_len]
        allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        i = torch.arange(kv_len - q_len, kv_len, device=m.device)[:, None]
        j = torch.arange(kv_len, device=m.device)[None, :]
        want = j <= i
        if self.sliding_window:
            want &= (i - j) < self.sliding_window
        if allowed.shape != want.shape or not torch.equal(allowed, want):
            raise UnsupportedModelError(
                "layer %d's attention mask is not plain causal%s (e.g. bidirectional image attention or "
                "padding); kvsim trace v1 supports causal attention only"
                % (layer, " + sliding window" if self.sliding_window else ""))

    def _probs(self, q, k, i0):
        """Softmax rows for queries at positions i0.. over keys [0, k_len): q [H, c, d], k [H, k_len, d]
        (float32, GQA already expanded). Applies scale, soft-cap, causal and sliding-window rules."""
        logits = torch.matmul(q, k.transpose(1, 2)) * self.scaling
        if self.softcap > 0:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        i = torch.arange(i0, i0 + q.shape[1], device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        visible = j <= i
        if self.sliding_window:
            visible &= (i - j) < self.sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def _to_storage(self, x, what, layer):
        a = x.detach().to(torch.float32).cpu().numpy()
        if not np.isfinite(a).all():
            raise CaptureError("layer %d %s holds NaN/Inf; the model run itself is numerically broken" % (layer, what))
        if self.options.storage_dtype == "float16" and a.size and np.abs(a).max() > FLOAT16_MAX:
            raise CaptureError("layer %d %s holds %.4g, beyond the float16 range (+-65504); capture with "
                               "--dtype float32" % (layer, what, float(np.abs(a).max())))
        return a.astype(STORAGE_DTYPES[self.options.storage_dtype])

    @torch.no_grad()
    def record(self, module, query, key, value, attention_mask, scaling, kwargs):
        layer = self._layer_of(module)
        if layer is None or layer not in self._layer_set:
            return
        if query.dim() != 4 or key.dim() != 4 or query.shape[0] != 1:
            raise UnsupportedModelError("capture supports batch size 1 with [batch, heads, tokens, head_dim] "
                                        "tensors; got query %s" % tuple(query.shape))
        q_len, kv_len = query.shape[2], key.shape[2]
        if self.n is None:
            if kv_len != q_len:
                raise CaptureError("the first recorded call must be the prefill of an empty cache (got %d new "
                                   "tokens with %d cached)" % (q_len, kv_len))
            self._setup(query, key, scaling, kwargs)
        else:
            self._check_consistent(layer, query, key, scaling, kwargs)
        n, o = self.n, self.options
        spill = self._spill.get(layer)
        if spill is None:
            if kv_len != q_len or q_len != n:
                raise CaptureError("layer %d: first call has %d tokens, expected the %d-token prefill"
                                   % (layer, q_len, n))
            t_cap = n + max(self.max_new_tokens - 1, 0)
            # Prompt entropies need every prompt query (as stored), so they are spilled; the trace keeps
            # only those from q_store_first on.
            q_first = 0 if o.prompt_entropies else self.q_store_first
            spill = _LayerSpill(self._scratch, layer, len(self.kv_sel), len(self.q_sel), self.head_dim, t_cap,
                                (n - q_first) + (t_cap - n), q_first, t_cap - n,
                                STORAGE_DTYPES[o.storage_dtype], o.decode_rows)
            self._spill[layer] = spill
        start = spill.count
        if kv_len != start + q_len:
            raise UnsupportedModelError(
                "layer %d: attention saw %d keys after %d recorded tokens + %d new; the KV cache is not a plain "
                "growing cache (static, sliding or quantised cache?); use the default DynamicCache"
                % (layer, kv_len, start, q_len))
        if start > 0 and q_len != 1:
            raise UnsupportedModelError("layer %d: a decode call with %d tokens; chunked prefill, assisted or "
                                        "speculative decoding are not supported" % (layer, q_len))
        if start + q_len > spill.keys.shape[1]:
            raise CaptureError("more forward calls than max_new_tokens=%d allows; pass the same max_new_tokens "
                               "to the Recorder and to generate()" % self.max_new_tokens)
        if start == 0:
            self._check_mask(layer, attention_mask, q_len, kv_len)
        self._record_positions(kwargs.get("position_ids"), start, q_len)

        kv_idx = torch.tensor(self.kv_sel, device=key.device)
        q_idx = torch.tensor(self.q_sel, device=query.device)
        k_sel = key[0].index_select(0, kv_idx)            # [Hkv', kv_len, d]
        v_sel = value[0].index_select(0, kv_idx)
        q_sel = query[0].index_select(0, q_idx)           # [H', q_len, d]
        spill.keys[:, start:start + q_len] = self._to_storage(k_sel[:, start:], "keys", layer)
        spill.values[:, start:start + q_len] = self._to_storage(v_sel[:, start:], "values", layer)
        if start == 0:
            spill.queries[:, :n - spill.q_first] = self._to_storage(q_sel[:, spill.q_first:], "queries", layer)
        else:
            spill.queries[:, n - spill.q_first + (start - n)] = self._to_storage(q_sel[:, 0], "queries", layer)

        group = self.num_heads // self.num_kv_heads
        kf = k_sel.to(torch.float32).repeat_interleave(group, dim=0)  # [H', kv_len, d]
        qf = q_sel.to(torch.float32)
        if start == 0 and o.column_sums:
            sums = torch.zeros(qf.shape[0], n, dtype=torch.float32, device=qf.device)
            chunk = max(1, o.aggregate_chunk_elems // max(1, qf.shape[0] * n))
            for c0 in range(0, n, chunk):
                sums += self._probs(qf[:, c0:c0 + chunk], kf, c0).sum(dim=1)
            spill.column_sums = sums.cpu().numpy()
        if start > 0 and spill.decode_rows is not None:
            spill.decode_rows[:, start - n, :kv_len] = self._probs(qf, kf, start)[:, 0].cpu().numpy()
        spill.count = start + q_len

    def _record_positions(self, pos, start, q_len):
        """Keeps the RoPE position ids the model passed (1-D, or multi-axis such as Qwen2-VL's M-RoPE
        [3, batch, tokens]) the first time any recorded layer sees tokens [start, start + q_len)."""
        if start < self._pos_seen or pos is None or not torch.is_tensor(pos):
            return
        p = pos.detach().to("cpu", torch.int64)
        if p.dim() == 3:      # [axes, batch, tokens]
            p = p[:, 0]
        elif p.dim() == 2:    # [batch, tokens]
            p = p[:1]
        elif p.dim() == 1:
            p = p[None]
        else:
            return
        if p.shape[-1] != q_len:
            return
        t_cap = self.n + max(self.max_new_tokens - 1, 0)
        if self.position_ids is None:
            self.position_ids = np.full((p.shape[0], t_cap), -1, dtype=np.int64)
        if self.position_ids.shape[0] == p.shape[0]:
            self.position_ids[:, start:start + q_len] = p.numpy()
        self._pos_seen = start + q_len

    # ------------------------------------------------------------------------------------------ output
    def query_positions(self):
        return np.arange(self.q_store_first, self.total_tokens, dtype=np.int32)

    def write_trace(self, path, tokens, model_name, model_family="unknown", rope_theta=0.0,
                    config_text="", extra=None):
        """Writes the trace. `tokens`: a metadata.TokenMetadata of length n + decode steps recorded.
        `extra(writer)`: optional callback that writes extension datasets before the file is closed."""
        if self.n is None or not self._spill:
            raise CaptureError("nothing was recorded: the model's attention never called capture_attention; "
                               "check that attn_implementation selects the capture function")
        missing = [l for l in self.layers if l not in self._spill]
        if missing:
            raise CaptureError("layers %s were never recorded (does every decoder layer route through "
                               "capture_attention?)" % missing)
        t = self.total_tokens
        n = self.n
        if len(tokens.modality) != t:
            raise CaptureError("token metadata has %d entries but %d tokens were recorded (prompt %d + %d decode "
                               "steps)" % (len(tokens.modality), t, n, t - n))
        qpos = self.query_positions()
        o = self.options
        self._check_space(path, t, len(qpos))
        attrs = dict(model_name=model_name, model_family=model_family, num_layers=len(self.layers),
                     num_heads=len(self.q_sel), num_kv_heads=len(self.kv_sel), head_dim=self.head_dim,
                     softmax_scale=self.scaling, causal=1, sliding_window=self.sliding_window,
                     logit_softcap=self.softcap, rope_theta=rope_theta, model_dtype=self.model_dtype,
                     storage_dtype=o.storage_dtype, prefill_length=n, num_decode_steps=t - n, source="captured",
                     generator=GENERATOR, generator_version=VERSION, seed=0,
                     has_prefill_column_sums=o.column_sums, config_text=config_text)
        regions = None
        if o.prompt_entropies:
            from . import entropies  # noqa: PLC0415
            regions = entropies.regions(np.asarray(tokens.role)[:n])
        try:
            with TraceWriter(path) as w:
                w.begin(attrs, tokens.as_dict(), qpos, prompt_entropy_regions=regions)
                for out_layer, layer in enumerate(self.layers):
                    s = self._spill[layer]
                    nq, skip = len(qpos), self.q_store_first - s.q_first
                    ent = None
                    if regions is not None:
                        # From the stored-precision prompt queries and keys, before the window drops queries.
                        ent = entropies.layer_entropies(
                            s.queries[:, :n], s.keys[:, :n], np.asarray(tokens.modality)[:n], regions,
                            self.scaling, self.sliding_window, self.softcap)
                    w.write_layer(out_layer, s.keys[:, :t], s.values[:, :t], s.queries[:, skip:skip + nq],
                                  s.column_sums, prompt_entropies=ent)
                cap = w.extra_group("capture")
                cap.attrs["layer_indices"] = np.asarray(self.layers, dtype=np.int64)
                cap.attrs["kv_head_indices"] = np.asarray(self.kv_sel, dtype=np.int64)
                cap.attrs["model_num_layers"] = np.int64(self.num_layers)
                cap.attrs["model_num_heads"] = np.int64(self.num_heads)
                cap.attrs["model_num_kv_heads"] = np.int64(self.num_kv_heads)
                if tokens.position_ids_multi is not None:
                    w.write_extra("capture/position_ids", np.asarray(tokens.position_ids_multi, dtype="<i8"),
                                  attrs={"axes": "temporal,height,width" if tokens.position_ids_multi.shape[0] == 3
                                         else ",".join("axis%d" % a for a in range(tokens.position_ids_multi.shape[0]))})
                if o.decode_rows and t > n:
                    rows = cap.create_group("decode_attention")
                    for out_layer, layer in enumerate(self.layers):
                        s = self._spill[layer]
                        ds = create_dataset(rows, "layer_%03d" % out_layer, shape=(len(self.q_sel), t - n, t),
                                            dtype="<f4", chunks=(1, min(t - n, 64), t))
                        for h in range(len(self.q_sel)):
                            ds[h] = s.decode_rows[h, :t - n, :t]
                if extra is not None:
                    extra(w)
                w.finish()
        except OSError as e:  # full disk, quota, file size limit: TraceWriter has removed the partial file
            why = os.strerror(e.errno) if e.errno else str(e).split("\n")[0]
            raise CaptureError("%s: cannot write the trace (%s); is the disk full?" % (path, why)) from e


    def trace_bytes(self, t, nq):
        """Upper estimate of the trace file's size: tensors, aggregates, token metadata, 5% + 1 MiB of HDF5
        overhead."""
        o, d = self.options, self.head_dim
        s = STORAGE_DTYPES[o.storage_dtype].itemsize
        per_layer = (2 * len(self.kv_sel) * t + len(self.q_sel) * nq) * d * s
        if o.column_sums:
            per_layer += 4 * len(self.q_sel) * self.n
        if o.decode_rows:
            per_layer += 4 * len(self.q_sel) * (t - self.n) * t
        return int(1.05 * (per_layer * len(self.layers) + 96 * t) + (1 << 20))

    def _check_space(self, path, t, nq):
        """Refuses, before writing, a trace that cannot fit: HDF5 does not recover cleanly from a write that
        fails half-way (it can crash while closing the damaged file)."""
        need = self.trace_bytes(t, nq)
        folder = os.path.dirname(os.path.abspath(path)) or "."
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return  # the writer reports a missing folder itself
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and need > limit:
            raise CaptureError("%s: the trace needs about %.1f MB but files are limited to %.1f MB (ulimit -f); "
                               "raise the limit or record fewer layers (--layers)" % (path, need / 1e6, limit / 1e6))
        if need > free:
            raise CaptureError("%s: the trace needs about %.1f MB but %s has %.1f MB free; free disk space or "
                               "record fewer layers (--layers)" % (path, need / 1e6, folder, free / 1e6))


def active_recorder():
    return _ACTIVE


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface-compatible function: calls the active Recorder's inner attention with the same
    arguments, records the call, and returns the inner result unchanged."""
    rec = _ACTIVE
    if rec is None or rec.inner is None:
        raise CaptureError("capture_attention was called outside Recorder.recording(); select it only while "
                           "capturing")
    out = rec.inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    rec.record(module, query, key, value, attention_mask, scaling, kwargs)
    return out
