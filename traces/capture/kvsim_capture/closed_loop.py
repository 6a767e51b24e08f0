"""Closed loop: re-runs the real model with each layer's KV cache restricted to a kvsim policy decision (a GPU
replay plan written by `kvsim gpu-plan`, gpu_replay/plan.proto) and measures what the compression does to the
model itself (docs/closed-loop.md).

kvsim's replay is open-loop: every layer's Q/K/V come from the full-cache run. Here compression at layer l
perturbs layer l's output, hence the hidden states, queries, keys and values of every later layer, and the
next-token distribution. Two modes per plan:

- teacher-forced: the prefill runs in full (as the policies assume); decode step s feeds the recorded token
  n + s and attends, per layer and KV head, only over the plan's slots at that step (evicted slots masked,
  merged slots replaced by the plan's merged key/value). Measured per step: KL(full || compressed) of the
  next-token distribution, top-1 agreement, NLL of the recorded next token; per layer: the attention
  output's relative error against the full-cache run (layer 0's inputs are unperturbed, so its error is
  kvsim's replay error for the same plan);
- free-running greedy from the compressed prefill, for plans whose cache after compression only grows (no
  decode-time evictions or merges): the first step whose token differs from the full-cache run, and task
  success on passkey traces. Plans that evict during decode (h2o, HAE's DDES, ...) are not re-run online:
  their decisions depend on the scores of the run itself; free-running results are reported as
  "not supported" for them.

The reference ("full") is the same code path with every slot kept, so a plan that keeps everything gives
KL 0 and identical tokens exactly.
"""
import copy
import dataclasses
import importlib
import math
import os
import subprocess
import sys
import tempfile
import types
from typing import Dict, List, Optional

import h5py
import numpy as np
import torch

from .errors import CaptureError
from .writer import attr_str

ATTN_NAME = "kvsim_closed_loop"
_PLAN_PROTO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "gpu_replay", "plan.proto"))
_plan_pb2 = None
_ACTIVE = None  # the _StepAttention that closed_loop_attention feeds


# ------------------------------------------------------------------------------------------------ plans
def plan_module():
    """gpu_replay/plan.proto compiled with protoc (Debian's protobuf-compiler) into a temporary folder once per
    process; kvsim's C++ and this reader share that one definition."""
    global _plan_pb2
    if _plan_pb2 is None:
        out = tempfile.mkdtemp(prefix="kvsim_plan_pb2_")
        src = os.path.dirname(_PLAN_PROTO)
        try:
            subprocess.run(["protoc", "-I", src, "--python_out", out, _PLAN_PROTO], check=True, capture_output=True,
                           text=True)
        except FileNotFoundError as e:
            raise CaptureError("protoc not found: install Debian's protobuf-compiler (scripts/setup.sh)") from e
        except subprocess.CalledProcessError as e:
            raise CaptureError("protoc failed on %s: %s" % (_PLAN_PROTO, e.stderr.strip().splitlines()[-1])) from e
        sys.path.insert(0, out)
        try:
            _plan_pb2 = importlib.import_module("plan_pb2")
        finally:
            sys.path.remove(out)
    return _plan_pb2


def read_plan(path):
    pb = plan_module()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CaptureError("--plan %s: cannot read (%s)" % (path, e.strerror)) from e
    plan = pb.GpuPlan()
    try:
        plan.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise CaptureError("--plan %s: not a kvsim GPU plan (%s); write one with kvsim gpu-plan" % (path, e)) from e
    if plan.format_version != 1:
        raise CaptureError("--plan %s: format_version %d, expected 1 (a file written by kvsim gpu-plan)"
                           % (path, plan.format_version))
    return plan


def trace_hash(trace_path, kvsim_bin):
    """The trace's content hash as kvsim computes it (`kvsim hash`), to check a plan belongs to the trace."""
    try:
        r = subprocess.run([kvsim_bin, "hash", trace_path], capture_output=True, text=True)
    except OSError as e:
        raise CaptureError("cannot run kvsim (%s): build it (make build) or pass --kvsim" % e) from e
    if r.returncode != 0:
        raise CaptureError((r.stderr.strip().splitlines() or ["kvsim hash failed"])[-1])
    return r.stdout.strip()


@dataclasses.dataclass
class TraceInfo:
    path: str
    n: int
    steps: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    token_ids: np.ndarray                  # [n + steps]
    passkey: Optional[str] = None
    needle_tokens: Optional[tuple] = None


def read_trace_info(path):
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CaptureError("--trace %s: cannot open as HDF5 (%s)" % (path, str(e).split("\n")[0])) from e
    with f:
        a = f.attrs
        source = attr_str(a["source"]) if "source" in a else None
        if source != "captured":
            raise CaptureError("--trace %s: a closed loop needs a trace captured from the model (source = "
                               "'captured'), this one is '%s'" % (path, source))
        info = TraceInfo(path, int(a["prefill_length"]), int(a["num_decode_steps"]), int(a["num_layers"]),
                         int(a["num_heads"]), int(a["num_kv_heads"]), int(a["head_dim"]),
                         f["tokens/token_id"][...].astype(np.int64))
        cap = f["capture"].attrs if "capture" in f else {}
        if "model_num_layers" in cap:
            if (int(cap["model_num_layers"]) != info.num_layers or int(cap["model_num_kv_heads"]) != info.num_kv_heads):
                raise CaptureError("--trace %s records %d of %d layers / %d of %d KV heads; a closed loop needs every "
                                   "layer and KV head (capture without --layers / --kv-heads)"
                                   % (path, info.num_layers, int(cap["model_num_layers"]), info.num_kv_heads,
                                      int(cap["model_num_kv_heads"])))
        if "task" in cap and attr_str(cap["task"]) == "passkey":
            info.passkey = attr_str(cap["passkey"])
            info.needle_tokens = tuple(int(x) for x in cap["needle_tokens"])
    if info.steps < 1:
        raise CaptureError("--trace %s has no decode steps" % path)
    return info


def check_plan(plan, info: TraceInfo, want_hash, name):
    """One-line refusal of a plan that does not belong to this trace or is inconsistent."""
    if plan.trace_hash != want_hash:
        raise CaptureError("--plan %s was made from another trace (hash %s, %s has %s); re-run kvsim gpu-plan on it"
                           % (name, plan.trace_hash, info.path, want_hash))
    m = plan.model
    got = (m.num_layers, m.num_kv_heads, m.head_dim, plan.prefill_length, plan.num_decode_steps)
    want = (info.num_layers, info.num_kv_heads, info.head_dim, info.n, info.steps)
    if got != want:
        raise CaptureError("--plan %s: (layers, KV heads, head_dim, prefill, decode steps) = %s but the trace has %s"
                           % (name, got, want))
    if len(plan.heads) != info.num_layers * info.num_kv_heads:
        raise CaptureError("--plan %s: %d head plans, expected layers x KV heads = %d"
                           % (name, len(plan.heads), info.num_layers * info.num_kv_heads))
    d = info.head_dim
    for i, h in enumerate(plan.heads):
        if (h.layer, h.kv_head) != divmod(i, info.num_kv_heads):
            raise CaptureError("--plan %s: head plan %d is (layer %d, KV head %d), expected %s"
                               % (name, i, h.layer, h.kv_head, divmod(i, info.num_kv_heads)))
        if len(h.steps) != info.steps:
            raise CaptureError("--plan %s: layer %d KV head %d has %d decode steps, the trace %d"
                               % (name, h.layer, h.kv_head, len(h.steps), info.steps))

        def check_slots(anchors, limit, where):
            for a in anchors:
                if not 0 <= a < limit:
                    raise CaptureError("--plan %s: layer %d KV head %d %s: slot %d out of range [0, %d)"
                                       % (name, h.layer, h.kv_head, where, a, limit))

        def check_merges(merges, where):
            for mg in merges:
                if len(mg.key) != d or len(mg.value) != d:
                    raise CaptureError("--plan %s: layer %d KV head %d %s: merged slot %d has %d/%d key/value "
                                       "values, head_dim is %d" % (name, h.layer, h.kv_head, where, mg.anchor,
                                                                   len(mg.key), len(mg.value), d))
        check_slots(h.slots, info.n, "after prefill")
        check_merges(h.merges, "after prefill")
        for s, st in enumerate(h.steps):
            for delta, what in ((st.before_attention, "step %d before attention" % s),
                                (st.after_step, "step %d after" % s)):
                check_slots(list(delta.added) + list(delta.removed) + list(delta.unmerged), info.n + s + 1, what)
                check_merges(delta.merges, what)


# ------------------------------------------------------------------------------------------ cache state
class _HeadState:
    """One (layer, KV head) cache: ordered anchors and merged slots' key/value. `tensors()` gives the gather
    index and the merged rows, rebuilt only when the set changed other than by appending."""

    def __init__(self, anchors=(), merges=()):
        self.anchors = dict.fromkeys(int(a) for a in anchors)
        self.merged = {}
        self._merge(merges)
        self._idx = None        # cached gather index (torch.long)
        self._mrows = None      # (positions in idx, keys [m, d], values [m, d]) or None
        self._appended = []     # anchors appended since the cache was built

    def _merge(self, merges):
        for mg in merges:
            self.merged[int(mg.anchor)] = (torch.tensor(list(mg.key), dtype=torch.float32),
                                           torch.tensor(list(mg.value), dtype=torch.float32))
            self._idx = None

    def append(self, anchor):
        if anchor not in self.anchors:
            self.anchors[anchor] = None
            self._appended.append(anchor)

    def apply(self, delta):
        if delta.removed or delta.unmerged:
            self._idx = None
        for a in delta.removed:
            self.anchors.pop(int(a), None)
            self.merged.pop(int(a), None)
        for a in delta.added:
            self.append(int(a))
        self._merge(delta.merges)
        for a in delta.unmerged:
            self.merged.pop(int(a), None)

    def tensors(self):
        if self._idx is None:
            self._idx = torch.tensor(list(self.anchors), dtype=torch.long)
            if self.merged:
                pos = {a: i for i, a in enumerate(self.anchors)}
                keep = [a for a in self.merged if a in pos]
                self._mrows = (torch.tensor([pos[a] for a in keep], dtype=torch.long),
                               torch.stack([self.merged[a][0] for a in keep]),
                               torch.stack([self.merged[a][1] for a in keep])) if keep else None
            else:
                self._mrows = None
        elif self._appended:
            self._idx = torch.cat([self._idx, torch.tensor(self._appended, dtype=torch.long)])
        self._appended = []
        return self._idx, self._mrows


def full_head(n):
    """Every slot kept: the reference run goes through the same code as the plans."""
    return _HeadState(range(n))


def plan_grows_only(plan, compression_step):
    """True when, after its compression event, the plan only appends the new tokens (no decode-time
    evictions or merges): such a decision can be replayed in free running."""
    for h in plan.heads:
        for s, st in enumerate(h.steps):
            b, a = st.before_attention, st.after_step
            if b.removed or b.merges or b.unmerged:
                return False
            if (a.removed or a.merges or a.unmerged or a.added) and not (compression_step == 0 and s == 0):
                return False
    return True


# ------------------------------------------------------------------------------------------ attention
class _StepAttention:
    """The attention function's state for one batched decode forward call: row b of the batch attends, per
    (layer, KV head), over rows[b]'s slot set; per-layer outputs are recorded for the error measurement."""

    def __init__(self, rows, num_kv_heads):
        self.rows = rows            # per batch row: [layer][kv_head] -> _HeadState
        self.hkv = num_kv_heads
        self.outputs = [dict() for _ in rows]   # per row: layer -> [H, d] float32

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = int(module.layer_idx)
        b, h, q_len, d = query.shape
        if b != len(self.rows) or q_len != 1:
            raise CaptureError("closed loop: decode calls must have one token per row (got query %s)"
                               % (tuple(query.shape),))
        g = h // self.hkv
        scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(d)
        out = torch.empty(b, h, d, dtype=torch.float32)
        q_all = query[:, :, 0, :].to(torch.float32)
        for r, heads in enumerate(self.rows):
            for kv in range(self.hkv):
                idx, mrows = heads[layer][kv].tensors()
                k = key[r, kv].index_select(0, idx).to(torch.float32)
                v = value[r, kv].index_select(0, idx).to(torch.float32)
                if mrows is not None:
                    k.index_copy_(0, mrows[0], mrows[1])
                    v.index_copy_(0, mrows[0], mrows[2])
                p = torch.softmax((q_all[r, kv * g:(kv + 1) * g] @ k.T) * scale, dim=-1)
                out[r, kv * g:(kv + 1) * g] = p @ v
            self.outputs[r][layer] = out[r].clone()
        return out.to(query.dtype)[:, None], None


def closed_loop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if _ACTIVE is None:
        raise CaptureError("closed_loop_attention called outside a closed-loop run")
    return _ACTIVE(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _register():
    import transformers  # noqa: PLC0415
    transformers.AttentionInterface.register(ATTN_NAME, closed_loop_attention)


# ------------------------------------------------------------------------------------------ runner
@dataclasses.dataclass
class Reference:
    """The full-cache run through the closed-loop code: per-step log-probabilities and per-layer outputs."""
    logprobs: torch.Tensor                  # [steps, vocab] float64
    outputs: List[Dict[int, torch.Tensor]]  # per step: layer -> [H, d]
    greedy: List[int]                       # free-running greedy tokens (generated token 0 from the prefill, ...)
    prefill_logprobs: torch.Tensor          # [vocab]


def _preallocate(cache, batch, total):
    """Turns a batch-1 prefill DynamicCache into a batch-`batch` cache whose layers write new tokens into
    preallocated buffers (transformers' DynamicLayer concatenates, copying the whole cache every step)."""
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        n = k.shape[-2]
        bk = k.new_empty((batch, k.shape[1], total, k.shape[3]))
        bv = v.new_empty((batch, v.shape[1], total, v.shape[3]))
        bk[:, :, :n] = k
        bv[:, :, :n] = v

        def update(self, key_states, value_states, *args, _bk=bk, _bv=bv, **kwargs):
            t0, q = self.keys.shape[-2], key_states.shape[-2]
            _bk[:, :, t0:t0 + q] = key_states
            _bv[:, :, t0:t0 + q] = value_states
            self.keys, self.values = _bk[:, :, :t0 + q], _bv[:, :, :t0 + q]
            return self.keys, self.values
        layer.keys, layer.values = bk[:, :, :n], bv[:, :, :n]
        layer.update = types.MethodType(update, layer)
    return cache


class _Row:
    """One sequence of a batched run: a plan (None = every slot kept) in teacher-forced or free-running mode."""

    def __init__(self, plan, mode, info):
        self.plan, self.mode, self.info = plan, mode, info
        hkv = info.num_kv_heads
        if plan is None:
            self.heads = [[full_head(info.n) for _ in range(hkv)] for _ in range(info.num_layers)]
        else:
            self.heads = [[_HeadState(plan.heads[l * hkv + kv].slots, plan.heads[l * hkv + kv].merges)
                           for kv in range(hkv)] for l in range(info.num_layers)]
        self.logprobs = []
        self.outputs = []
        self.tokens = []

    def _apply(self, s, which):
        hkv = self.info.num_kv_heads
        for l, row in enumerate(self.heads):
            for kv, hs in enumerate(row):
                hs.apply(getattr(self.plan.heads[l * hkv + kv].steps[s], which))

    def before(self, s):
        if self.plan is None or self.mode == "fr":
            for row in self.heads:
                for hs in row:
                    hs.append(self.info.n + s)  # the new token; nothing else changes after compression
        else:
            self._apply(s, "before_attention")

    def after(self, s):
        if self.plan is None:
            return
        if self.mode == "tf" or (self.plan.compression_step == 0 and s == 0):
            self._apply(s, "after_step")


class ClosedLoop:
    """Runs plans against one trace with one model. The prefill is computed once; plans then run in batches
    (teacher-forced and free-running rows side by side), so each decode step reads the weights once for
    many plans."""

    def __init__(self, model, tokenizer, info: TraceInfo, suppress_eos=True, batch=16):
        _register()
        self.model, self.tok, self.info, self.batch = model, tokenizer, info, max(1, int(batch))
        self.tcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if self.tcfg.num_hidden_layers != info.num_layers or self.tcfg.num_key_value_heads != info.num_kv_heads:
            raise CaptureError("the model has %d layers / %d KV heads but the trace %d / %d: not the model the "
                               "trace was captured from" % (self.tcfg.num_hidden_layers, self.tcfg.num_key_value_heads,
                                                            info.num_layers, info.num_kv_heads))
        self.suppress = [tokenizer.eos_token_id] if suppress_eos and tokenizer.eos_token_id is not None else []
        ids = torch.tensor(info.token_ids[: info.n])[None]
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        self.prefill_cache = out.past_key_values
        self.prefill_logprobs = torch.log_softmax(out.logits[0, -1].to(torch.float64), -1)
        self.reference = None

    def _greedy(self, logprobs):
        lp = logprobs.clone()
        if self.suppress:
            lp[self.suppress] = -math.inf
        return int(torch.argmax(lp))

    def _run_rows(self, rows):
        """Decodes every row for all trace steps in one batch."""
        global _ACTIVE
        info = self.info
        cache = _preallocate(self.prefill_cache, len(rows), info.n + info.steps)
        first = self._greedy(self.prefill_logprobs)
        for r in rows:
            r.tokens = [first] if r.mode == "fr" else []
        prev = self.tcfg._attn_implementation
        self.tcfg._attn_implementation = ATTN_NAME
        try:
            for s in range(info.steps):
                for r in rows:
                    r.before(s)
                feed = [int(info.token_ids[info.n + s]) if r.mode == "tf" else r.tokens[-1] for r in rows]
                att = _StepAttention([r.heads for r in rows], info.num_kv_heads)
                _ACTIVE = att
                with torch.no_grad():
                    out = self.model(input_ids=torch.tensor(feed)[:, None], past_key_values=cache, use_cache=True,
                                     position_ids=torch.full((len(rows), 1), info.n + s))
                lps = torch.log_softmax(out.logits[:, -1].to(torch.float64), -1)
                for i, r in enumerate(rows):
                    r.after(s)
                    r.logprobs.append(lps[i])
                    r.outputs.append(att.outputs[i])
                    if r.mode == "fr":
                        r.tokens.append(self._greedy(lps[i]))
        finally:
            _ACTIVE = None
            self.tcfg._attn_implementation = prev

    def full_reference(self):
        if self.reference is None:
            tf, fr = _Row(None, "tf", self.info), _Row(None, "fr", self.info)
            self._run_rows([tf, fr])
            self.reference = Reference(torch.stack(tf.logprobs), tf.outputs, fr.tokens, self.prefill_logprobs)
        return self.reference

    def run_plan(self, plan, free_running=True):
        return self.run_plans([plan], free_running)[0]

    def run_plans(self, plans, free_running=True, progress=None):
        """Results (as run_plan) for every plan, in order."""
        ref = self.full_reference()
        rows = []
        for i, plan in enumerate(plans):
            rows.append((i, _Row(plan, "tf", self.info)))
            if free_running and plan_grows_only(plan, plan.compression_step):
                rows.append((i, _Row(plan, "fr", self.info)))
        results = [None] * len(plans)
        for c in range(0, len(rows), self.batch):
            chunk = rows[c:c + self.batch]
            self._run_rows([r for _, r in chunk])
            for i, r in chunk:
                if r.mode == "tf":
                    results[i] = self._teacher_forced_metrics(r, ref)
                    if progress:
                        progress(plans[i], results[i])
            for i, r in chunk:
                if r.mode == "fr":
                    results[i]["free_running"] = self._free_running_metrics(r, ref)
        for i, plan in enumerate(plans):
            if "free_running" not in results[i]:
                results[i]["free_running"] = {"supported": False, "reason": "not requested"} if not free_running \
                    else {"supported": False,
                          "reason": "the plan evicts or merges during decode; those decisions depend on the run's own "
                                    "scores, and the policy is not re-run online (teacher-forced results only)"}
        return results

    def _teacher_forced_metrics(self, r, ref):
        info = self.info
        kl, top1, nll, nll_full = [], [], [], []
        layer_err = np.zeros((info.num_layers, info.steps))
        for s in range(info.steps):
            lp, lpf = r.logprobs[s], ref.logprobs[s]
            kl.append(float(torch.sum(torch.exp(lpf) * (lpf - lp)).clamp_min(0.0)))
            top1.append(int(torch.argmax(lp)) == int(torch.argmax(lpf)))
            if s + 1 < info.steps:  # the recorded continuation: token n + s + 1 (the last one is not stored)
                nxt = int(info.token_ids[info.n + s + 1])
                nll.append(-float(lp[nxt]))
                nll_full.append(-float(lpf[nxt]))
            for l in range(info.num_layers):
                o, of = r.outputs[s][l], ref.outputs[s][l]
                err = torch.linalg.vector_norm(o - of, dim=-1) / torch.linalg.vector_norm(of, dim=-1).clamp_min(1e-30)
                layer_err[l, s] = float(err.mean())
        return {"teacher_forced": {
            "kl_per_step": kl, "kl_mean": float(np.mean(kl)), "top1_agreement": float(np.mean(top1)),
            "nll_per_step": nll, "nll_mean": float(np.mean(nll)) if nll else None,
            "nll_full_mean": float(np.mean(nll_full)) if nll_full else None,
            "nll_increase": float(np.mean(nll) - np.mean(nll_full)) if nll else None,
            "layer_output_rel_error": layer_err.mean(axis=1).tolist()}}

    def _free_running_metrics(self, r, ref):
        tokens = r.tokens
        diverge = next((i for i, (a, b) in enumerate(zip(tokens, ref.greedy)) if a != b), None)
        text = self.tok.decode(tokens, skip_special_tokens=True)
        fr = {"supported": True, "tokens": tokens, "text": text, "first_divergence": diverge,
              "identical": diverge is None}
        if self.info.passkey is not None:
            fr["passkey_found"] = self.info.passkey in text.replace(" ", "").replace(",", "")
        return fr


# ------------------------------------------------------------------------------------------ driver
def result_path(plan_path):
    """Where `kvsim gpu-plan --result` put the plan's replay result: P.pb -> P.result.json."""
    base = plan_path[:-3] if plan_path.endswith(".pb") else plan_path
    return base + ".result.json"


def load_inputs(trace_path, plan_paths, kvsim_bin):
    """Reads and checks everything before any model work: the trace, every plan, every replay result."""
    import json  # noqa: PLC0415
    if not plan_paths:
        raise CaptureError("no --plan given")
    info = read_trace_info(trace_path)
    want = trace_hash(trace_path, kvsim_bin)
    items = []
    for p in plan_paths:
        plan = read_plan(p)
        check_plan(plan, info, want, p)
        rp = result_path(p)
        try:
            with open(rp) as f:
                result = json.load(f)
        except OSError as e:
            raise CaptureError("%s: the plan's replay result is missing (%s); write it with kvsim gpu-plan ... --out %s "
                               "--result %s" % (rp, e.strerror, p, rp)) from e
        except ValueError as e:
            raise CaptureError("%s: not JSON (%s)" % (rp, e)) from e
        if result.get("trace_hash") != want:
            raise CaptureError("%s: replay result of another trace (hash %s, expected %s)"
                               % (rp, result.get("trace_hash"), want))
        items.append((p, plan, result))
    return info, want, items


def run_closed_loop(model, tokenizer, trace_path, plan_paths, out_dir, kvsim_bin, model_name="model",
                    free_running=True, progress=None):
    """Runs every plan in both modes and writes the report (closed_loop_report.py). Returns the report."""
    import time  # noqa: PLC0415

    from . import closed_loop_report as rep  # noqa: PLC0415
    info, want, items = load_inputs(trace_path, plan_paths, kvsim_bin)
    t0 = time.monotonic()
    loop = ClosedLoop(model, tokenizer, info)
    loop.full_reference()
    ref_s = time.monotonic() - t0
    replay = {id(plan): rep.replay_metrics(result) for _, plan, result in items}

    def said(plan, cl):
        if progress:
            progress("closed loop: %s @ %d tokens: KL %.4g, layer-0 err %.4g (replay %.4g)"
                     % (plan.label, plan.budget_tokens, cl["teacher_forced"]["kl_mean"],
                        cl["teacher_forced"]["layer_output_rel_error"][0],
                        replay[id(plan)]["layer_output_rel_error"][0] or float("nan")))
    t1 = time.monotonic()
    results = loop.run_plans([plan for _, plan, _ in items], free_running=free_running, progress=said)
    runs_s = time.monotonic() - t1
    runs = []
    for (p, plan, _), cl in zip(items, results):
        runs.append({"plan": os.path.abspath(p), "policy": plan.policy, "label": plan.label,
                     "budget_fraction": plan.budget_fraction, "budget_tokens": plan.budget_tokens,
                     "compression_step": plan.compression_step, "replay": replay[id(plan)], "closed_loop": cl})
    ref = loop.reference
    report = {
        "what": "measured: the real model re-run with its KV cache restricted to each plan (docs/closed-loop.md)",
        "model": model_name,
        "trace": {"path": os.path.abspath(trace_path), "hash": want, "prefill_length": info.n,
                  "decode_steps": info.steps, "passkey": info.passkey,
                  "needle_tokens": list(info.needle_tokens) if info.needle_tokens else None},
        "reference": {
            "greedy_tokens": ref.greedy, "greedy_text": tokenizer.decode(ref.greedy, skip_special_tokens=True),
            "recorded_tokens_agree": [int(a) == int(b) for a, b in
                                      zip(ref.greedy, info.token_ids[info.n:info.n + info.steps])].count(True),
            "seconds": round(ref_s, 3)},
        "seconds": {"prefill_and_reference": round(ref_s, 3), "plans": round(runs_s, 3)},
        "runs": runs,
    }
    rep.write_report(report, out_dir)
    return report
