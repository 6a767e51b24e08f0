"""A tiny randomly initialised Llama-style multimodal model in plain PyTorch, for the capture tests.

It mirrors how Hugging Face transformers (>= 4.48) routes attention: every decoder layer's attention module
looks up `ATTENTION_FUNCTIONS[config.attn_implementation]` and calls it as
`fn(module, query, key, value, attention_mask, scaling=..., dropout=0.0, position_ids=..., sliding_window=...,
softcap=...)` with post-RoPE query [1, H, q, d] and the whole updated cache key/value [1, Hkv, kv, d], and uses
the first element of the result. A fake vision projector turns image/video "patches" into embeddings placed
at the image/video token ids; GQA; RoPE, optionally Qwen2-VL-style multi-axis (M-RoPE) with sections.
"""
import dataclasses
import math

import torch
from torch import nn


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    patch_dim: int = 12
    rope_theta: float = 10000.0
    image_token_id: int = 60
    video_token_id: int = 61
    mrope_section: tuple = ()      # e.g. (2, 3, 3): halves of head_dim per (t, h, w) axis; () = 1-D RoPE
    sliding_window: int = 0
    softcap: float = 0.0
    attn_implementation: str = "eager"


def repeat_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap") or 0.0
    if softcap:
        w = softcap * torch.tanh(w / softcap)
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, : key.shape[-2]]
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).transpose(1, 2).contiguous()
    return out, w


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward}


def rope_cos_sin(cfg, position_ids, dtype):
    """position_ids: [T] or [3, T] (M-RoPE). Returns cos, sin [T, d]."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    if cfg.mrope_section:
        freqs = position_ids.to(torch.float32)[..., None] * inv  # [3, T, d/2]
        parts, k0 = [], 0
        for a, size in enumerate(cfg.mrope_section):
            parts.append(freqs[a, :, k0:k0 + size])
            k0 += size
        freqs = torch.cat(parts, dim=-1)
    else:
        freqs = position_ids.to(torch.float32)[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class TinyAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.config, self.layer_idx = cfg, layer_idx
        self.num_key_value_groups = cfg.num_heads // cfg.num_kv_heads
        self.scaling = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache, position_ids):
        b, q_len, _ = x.shape
        d = self.config.head_dim
        q = self.q_proj(x).view(b, q_len, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, -1, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:  # a DynamicCache-like list of (k, v) per layer
            if len(cache) > self.layer_idx:
                pk, pv = cache[self.layer_idx]
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
                cache[self.layer_idx] = (k, v)
            else:
                cache.append((k, v))
        fn = ATTENTION_FUNCTIONS[self.config.attn_implementation]
        out, _ = fn(self, q, k, v, mask, scaling=self.scaling, dropout=0.0, position_ids=position_ids,
                    sliding_window=self.config.sliding_window or None, softcap=self.config.softcap or None)
        return self.o_proj(out.reshape(b, q_len, -1))


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = TinyAttention(cfg, i)
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, x, cos, sin, mask, cache, position_ids):
        x = x + self.self_attn(self.norm1(x), cos, sin, mask, cache, position_ids)
        return x + self.mlp(self.norm2(x))


class TinyLanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(TinyLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, inputs_embeds, position_ids, cache=None):
        """inputs_embeds [1, q, hidden]; position_ids [q] or [3, q] (M-RoPE); cache: list or None."""
        q_len = inputs_embeds.shape[1]
        past = cache[0][0].shape[2] if cache else 0
        kv = past + q_len
        i = torch.arange(past, kv)[:, None]
        j = torch.arange(kv)[None, :]
        visible = j <= i
        if self.config.sliding_window:
            visible &= (i - j) < self.config.sliding_window
        mask = torch.zeros(q_len, kv, dtype=inputs_embeds.dtype)
        mask = mask.masked_fill(~visible, torch.finfo(inputs_embeds.dtype).min)[None, None]
        cos, sin = rope_cos_sin(self.config, position_ids, inputs_embeds.dtype)
        pos_kw = position_ids[:, None] if position_ids.dim() == 2 else position_ids[None]  # [3,1,q] / [1,q]
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, pos_kw)
        return self.lm_head(self.norm(x))


class TinyVLM(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.projector = nn.Sequential(nn.Linear(cfg.patch_dim, cfg.hidden_size), nn.GELU(),
                                       nn.Linear(cfg.hidden_size, cfg.hidden_size))
        self.language_model = TinyLanguageModel(cfg)
        self.eval()

    def embed_prompt(self, input_ids, pixel_patches=None):
        """input_ids [n]; pixel_patches [num_visual_tokens, patch_dim] in prompt order."""
        x = self.embed(input_ids)
        visual = (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id)
        if int(visual.sum()):
            if pixel_patches is None or pixel_patches.shape[0] != int(visual.sum()):
                raise ValueError("need one patch per image/video token")
            x = x.clone()
            x[visual] = self.projector(pixel_patches)
        return x[None]

    @torch.no_grad()
    def generate(self, input_ids, pixel_patches=None, max_new_tokens=8, position_ids=None):
        """Greedy decode. Returns (generated ids [max_new_tokens], logits [max_new_tokens, vocab]). Makes one
        prefill call and max_new_tokens - 1 decode calls, like transformers' generate()."""
        n = input_ids.shape[0]
        if position_ids is None:
            position_ids = torch.arange(n) if not self.config.mrope_section else torch.arange(n).expand(3, n)
        cache = []
        logits = self.language_model(self.embed_prompt(input_ids, pixel_patches), position_ids, cache)[0, -1]
        next_pos = int(position_ids.max()) + 1
        out_ids, out_logits = [], []
        for step in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            out_ids.append(tok)
            out_logits.append(logits)
            if step == max_new_tokens - 1:
                break
            p = torch.tensor([next_pos + step])
            p = p.expand(3, 1) if self.config.mrope_section else p
            logits = self.language_model(self.embed(torch.tensor([[tok]])), p, cache)[0, -1]
        return torch.tensor(out_ids), torch.stack(out_logits)


def mrope_positions(input_ids, cfg, grids):
    """Qwen2-VL-style 3-axis position ids [3, n]: text tokens advance all axes together; each image (rows,
    cols) in `grids` gets t = start, h = start + row, w = start + col, and the next text starts after the
    largest id."""
    n = len(input_ids)
    pos = torch.zeros(3, n, dtype=torch.int64)
    nxt, i, img = 0, 0, 0
    while i < n:
        if int(input_ids[i]) in (cfg.image_token_id, cfg.video_token_id):
            r, c = grids[img]
            img += 1
            k = torch.arange(r * c)
            pos[0, i:i + r * c] = nxt
            pos[1, i:i + r * c] = nxt + k // c
            pos[2, i:i + r * c] = nxt + k % c
            nxt += max(r, c)
            i += r * c
        else:
            pos[:, i] = nxt
            nxt += 1
            i += 1
    return pos


def make_prompt(cfg, system=3, grids=((3, 3), (2, 4)), between=2, question=5, seed=1):
    """Token ids: system text, images (each rows*cols image tokens, `between` text tokens between them),
    question text. Returns (input_ids [n], pixel patches, spans dict)."""
    g = torch.Generator().manual_seed(seed)
    text = lambda k: torch.randint(1, 50, (k,), generator=g)  # noqa: E731
    parts, spans = [text(system)], {"system_end": system}
    for i, (r, c) in enumerate(grids):
        if i:
            parts.append(text(between))
        parts.append(torch.full((r * c,), cfg.image_token_id))
    q0 = sum(len(p) for p in parts)
    parts.append(text(question))
    ids = torch.cat(parts)
    spans["question_span"] = (q0, len(ids))
    patches = torch.randn(sum(r * c for r, c in grids), cfg.patch_dim, generator=g)
    return ids, patches, spans
