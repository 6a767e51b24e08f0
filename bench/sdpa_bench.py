#!/usr/bin/env python3
# Run with the project environment: .venv/bin/python bench/sdpa_bench.py (scripts/setup_python.sh).
"""PyTorch baseline for kvsim's ragged decode-attention kernel (issue 6, docs/gpu-replay.md).

Times one decode step of one layer's attention in PyTorch the way a common engine must run a ragged
per-(KV head) cache: every head padded to the longest one, a boolean mask hiding the padding, one query
per head, torch.nn.functional.scaled_dot_product_attention (torch >= 2.0; GQA KV heads expanded to the
query heads). Same shapes as `kvsim_replay_gpu --attention-lengths`; divide the two medians for the ratio
the issue asks for (kvsim kernel time / SDPA time at 1K tokens per head).

Timing: --warmup untimed calls, then --repeats samples, each after an L2 flush (a memset of 256 MiB), with
CUDA events on a GPU (time.perf_counter on CPU); prints JSON with median / p10 / p90 in ms.

On torch < 2.0 (e.g. Debian 12's python3-torch 1.13; the project environment pins 2.15) SDPA does not exist:
the script falls back to the same math written out (masked softmax(q k^T / sqrt(d)) v) and says so in "impl";
such numbers are not an SDPA baseline.
"""
import argparse
import json
import math
import random
import statistics
import sys
import time


def ragged_lengths(kv_heads, length, cv, seed):
    """Per-KV-head lengths with mean `length` and coefficient of variation `cv` (deterministic)."""
    rng = random.Random(seed)
    if cv <= 0:
        return [length] * kv_heads
    out = [max(1, int(round(rng.lognormvariate(0.0, math.sqrt(math.log(1 + cv * cv)))
                            * length / math.sqrt(1 + cv * cv)))) for _ in range(kv_heads)]
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--lengths", type=str, default="",
                    help="comma-separated tokens per KV head (overrides --length/--ragged-cv)")
    ap.add_argument("--length", type=int, default=1024, help="mean tokens per KV head")
    ap.add_argument("--ragged-cv", type=float, default=0.5, help="0 = uniform lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    ap.add_argument("--device", default="cuda", help="cuda | cpu")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=str, default="", help="write the JSON here too")
    ap.add_argument("--check", action="store_true",
                    help="also compare the padded result with per-head attention over the unpadded keys")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("sdpa_bench: no torch: run it with .venv/bin/python (scripts/setup_python.sh)", file=sys.stderr)
        return 3
    if args.heads <= 0 or args.kv_heads <= 0 or args.heads % args.kv_heads:
        print("sdpa_bench: --heads must be a positive multiple of --kv-heads", file=sys.stderr)
        return 1
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("sdpa_bench: no CUDA device: torch.cuda.is_available() is false (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 4
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        if len(lengths) != args.kv_heads or min(lengths) < 1:
            print("sdpa_bench: --lengths needs one positive length per KV head (%d)" % args.kv_heads,
                  file=sys.stderr)
            return 1
    else:
        lengths = ragged_lengths(args.kv_heads, args.length, args.ragged_cv, args.seed)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.device == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPU half matmul is not a meaningful baseline
    dev = torch.device(args.device)
    g = args.heads // args.kv_heads
    lmax, d = max(lengths), args.head_dim
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    q = torch.randn(1, args.heads, 1, d, generator=gen).to(dev, dtype)
    k = torch.randn(1, args.kv_heads, lmax, d, generator=gen).to(dev, dtype)
    v = torch.randn(1, args.kv_heads, lmax, d, generator=gen).to(dev, dtype)
    mask = torch.zeros(1, args.kv_heads, 1, lmax, dtype=torch.bool)
    for h, n in enumerate(lengths):
        mask[0, h, 0, :n] = True
    mask = mask.to(dev)
    # GQA: the padded cache is expanded to the query heads (what an engine without GQA support does).
    k_full = k.repeat_interleave(g, dim=1)
    v_full = v.repeat_interleave(g, dim=1)
    mask_full = mask.repeat_interleave(g, dim=1)
    F = torch.nn.functional
    if hasattr(F, "scaled_dot_product_attention"):
        impl = "torch.nn.functional.scaled_dot_product_attention"

        def step():
            return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask_full)
    else:
        impl = "manual masked softmax (torch %s has no scaled_dot_product_attention)" % torch.__version__
        scale = 1.0 / math.sqrt(d)

        def step():
            s = torch.matmul(q, k_full.transpose(-1, -2)) * scale
            s = s.masked_fill(~mask_full, float("-inf"))
            return torch.matmul(torch.softmax(s.float(), dim=-1).to(dtype), v_full)

    max_rel_err = None
    if args.check:
        with torch.no_grad():
            got = step().float()
            worst = 0.0
            for qh in range(args.heads):
                kh, n = qh // g, lengths[qh // g]
                s_ = (q[0, qh, 0].float() @ k[0, kh, :n].float().T) / math.sqrt(d)
                ref = torch.softmax(s_, dim=-1) @ v[0, kh, :n].float()
                worst = max(worst, float((got[0, qh, 0] - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
            max_rel_err = worst
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        if worst > tol:
            print("sdpa_bench: padded attention differs from the unpadded reference: max rel. error %.3g > %g"
                  % (worst, tol), file=sys.stderr)
            return 5

    cuda = dev.type == "cuda"
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev) if cuda else None
    with torch.no_grad():
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.repeats):
            if cuda:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    pick = lambda p: times[min(len(times) - 1, int(round(p * (len(times) - 1))))]
    kv_bytes = 2 * sum(lengths) * d * torch.tensor([], dtype=dtype).element_size()
    res = {
        "impl": impl,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": d,
        "lengths": lengths, "padded_length": lmax,
        "median_ms": statistics.median(times), "p10_ms": pick(0.1), "p90_ms": pick(0.9),
        "kept_kv_bytes": kv_bytes,
        "effective_gb_per_s": kv_bytes / (statistics.median(times) * 1e-3) / 1e9,
        "repeats": args.repeats,
        "max_rel_err_vs_unpadded": max_rel_err,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        import os
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
