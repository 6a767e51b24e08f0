"""Hugging Face transformers adapter: registers capture_attention as an attention implementation, runs a
vision-language model once (prefill + greedy decode) with the capture selected for the language model's
attention, and writes the trace.

Needs transformers >= 4.48 (models whose attention goes through ALL_ATTENTION_FUNCTIONS /
AttentionInterface); imported lazily so the rest of kvsim_capture works without it. NOT YET RUN on real
transformers or a GPU (docs/capture.md, "Status").
"""
import contextlib
import dataclasses
import os
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from .blocks import StreamBlockRecorder
from .errors import CaptureError, MissingDependencyError, UnsupportedModelError
from .metadata import build_token_metadata
from .recorder import CaptureOptions, Recorder, capture_attention

ATTN_NAME = "kvsim_capture"
MIN_TRANSFORMERS = (4, 48)


def import_transformers():
    try:
        import transformers  # noqa: PLC0415
    except ImportError as e:
        raise MissingDependencyError(
            "the Hugging Face 'transformers' package is not installed (need >= %d.%d); install it in the "
            "environment that runs your model, e.g. pip install 'transformers>=4.48'" % MIN_TRANSFORMERS) from e
    ver = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if ver < MIN_TRANSFORMERS:
        raise MissingDependencyError("transformers %s is too old: capture needs >= %d.%d (AttentionInterface)"
                                     % ((transformers.__version__,) + MIN_TRANSFORMERS))
    return transformers


def attention_registry():
    """transformers' table of attention functions (AttentionInterface in >= 4.50, a dict before)."""
    tf = import_transformers()
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415
    except ImportError as e:
        raise UnsupportedModelError("this transformers has no ALL_ATTENTION_FUNCTIONS; need >= 4.48") from e
    if hasattr(tf, "AttentionInterface"):
        tf.AttentionInterface.register(ATTN_NAME, capture_attention)
    else:
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = capture_attention
    return ALL_ATTENTION_FUNCTIONS


def inner_attention(model_module, name):
    """The function the capture wraps: transformers' registered `name` ('sdpa', 'flash_attention_2', ...)
    or the model's own eager_attention_forward for 'eager'."""
    registry = attention_registry()
    if name == "eager":
        import sys  # noqa: PLC0415
        fn = getattr(sys.modules[type(model_module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedModelError("%s has no eager_attention_forward; use --attn sdpa"
                                        % type(model_module).__name__)
        return fn
    if name not in registry:
        raise CaptureError("unknown attention implementation '%s' (have %s)" % (name, sorted(registry)))
    return registry[name]


def load(model_dir, dtype="auto", device=None):
    """Loads processor and model from a local folder. Returns (model, processor)."""
    tf = import_transformers()
    if not os.path.isdir(model_dir):
        raise CaptureError("--model %s: no such folder (download the model first; capture never downloads)"
                           % model_dir)
    try:
        processor = tf.AutoProcessor.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise CaptureError("%s: cannot load a processor (%s); the folder needs preprocessor_config.json and "
                           "tokenizer files" % (model_dir, str(e).split("\n")[0])) from e
    torch_dtype = {"auto": "auto", "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "float32": torch.float32}[dtype]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    errors = []
    for cls_name in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM"):
        cls = getattr(tf, cls_name, None)
        if cls is None:
            continue
        try:
            model = cls.from_pretrained(model_dir, torch_dtype=torch_dtype, attn_implementation="sdpa")
            return model.to(device).eval(), processor
        except torch.cuda.OutOfMemoryError as e:
            raise CaptureError("out of GPU memory loading the model; use --model-dtype bfloat16/float16 or a "
                               "larger GPU") from e
        except (ValueError, KeyError, OSError) as e:
            errors.append("%s: %s" % (cls_name, str(e).split("\n")[0]))
    raise UnsupportedModelError("%s: no transformers auto class loads this model (%s)" % (model_dir, "; ".join(errors)))


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else getattr(cfg, "text_config", cfg)


def language_attention_modules(model):
    """id(attention module) -> layer index for the language model's decoder layers (vision towers excluded:
    only modules holding the text config and a layer_idx)."""
    tcfg = text_config(model)
    found = {}
    for _, m in model.named_modules():
        if hasattr(m, "layer_idx") and getattr(m, "config", None) is tcfg and type(m).__name__.endswith("Attention"):
            found[id(m)] = int(m.layer_idx)
    n = getattr(tcfg, "num_hidden_layers", None)
    if not found or (n is not None and len(set(found.values())) != n):
        raise UnsupportedModelError(
            "%s: found %d attention modules with layer_idx for %s decoder layers; this model does not route "
            "attention through transformers' AttentionInterface (needs a model ported to it, transformers >= "
            "4.48)" % (type(model).__name__, len(found), n))
    return found


@contextlib.contextmanager
def capture_selected(model):
    """Selects the capture for the language model's attention only (the text config's
    _attn_implementation), restoring the previous choice afterwards. Yields the previous name."""
    tcfg = text_config(model)
    prev = tcfg._attn_implementation
    attention_registry()
    tcfg._attn_implementation = ATTN_NAME
    try:
        yield prev
    finally:
        tcfg._attn_implementation = prev


def load_images(paths):
    try:
        from PIL import Image  # noqa: PLC0415
    except ImportError as e:
        raise MissingDependencyError("reading images needs Pillow (Debian: python3-pil)") from e
    out = []
    for p in paths:
        try:
            out.append(Image.open(p).convert("RGB"))
        except OSError as e:
            raise CaptureError("--image %s: cannot read (%s)" % (p, e)) from e
    return out


def load_video(path, fps, max_frames=0):
    """Frames of `path` sampled at `fps` as uint8 RGB arrays [frames, H, W, 3] (OpenCV)."""
    try:
        import cv2  # noqa: PLC0415
    except ImportError as e:
        raise MissingDependencyError("reading videos needs OpenCV (Debian: python3-opencv)") from e
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise CaptureError("--video %s: cannot open" % path)
    src_fps = cap.get(cv2.CAP_PROP_FPS) or fps
    step = max(src_fps / fps, 1.0)
    frames, i, nxt = [], 0, 0.0
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        if i >= nxt:
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            nxt += step
            if max_frames and len(frames) >= max_frames:
                break
        i += 1
    cap.release()
    if not frames:
        raise CaptureError("--video %s: no frames decoded" % path)
    return np.stack(frames)


def _find_last(hay, needle):
    hay, needle = list(hay), list(needle)
    for s in range(len(hay) - len(needle), -1, -1):
        if needle and hay[s:s + len(needle)] == needle:
            return s
    return -1


def _question_span(tokenizer, prompt_ids, question):
    for variant in (question, " " + question, "\n" + question):
        ids = tokenizer(variant, add_special_tokens=False)["input_ids"]
        for trim in (0, 1):  # the first piece may merge with the template text before it
            s = _find_last(prompt_ids, ids[trim:])
            if s >= 0 and len(ids) > trim:
                return s, len(prompt_ids)  # the question plus the assistant header after it
    return None


def _grids(model, inputs, image_token_id, video_token_id, n_frames):
    """Per image (rows, cols) / per video (frames, rows, cols) LLM-token grids from the processor outputs."""
    vcfg = getattr(model.config, "vision_config", None)
    merge = int(getattr(vcfg, "spatial_merge_size", 1) or 1)
    image_grids = video_grids = None
    if "image_grid_thw" in inputs:      # Qwen2-VL / Qwen2.5-VL
        image_grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in inputs["image_grid_thw"].tolist()]
    if "video_grid_thw" in inputs:
        video_grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in inputs["video_grid_thw"].tolist()]
    elif video_token_id is not None and n_frames:
        count = int((inputs["input_ids"][0] == video_token_id).sum())
        side = int(round((count // n_frames) ** 0.5))
        if side * side * n_frames == count:  # e.g. LLaVA-OneVision: 196 = 14 x 14 tokens per frame
            video_grids = [(n_frames, side, side)]
    return image_grids, video_grids


@dataclasses.dataclass
class CaptureResult:
    path: str
    prompt_tokens: int
    decode_steps: int
    generated_text: str
    generated_ids: list


def capture(model, processor, out, prompt, images: Sequence[str] = (), video: Optional[str] = None, fps=1.0,
            max_new_tokens=32, options: Optional[CaptureOptions] = None, system_prompt=None, inner="sdpa",
            stream_granularities: Sequence[int] = (), max_frames=0, model_name=None) -> CaptureResult:
    """Runs `model` once on (images | video) + prompt with greedy decoding and writes the trace to `out`."""
    options = options or CaptureOptions()
    tcfg = text_config(model)
    content = [{"type": "image"} for _ in images]
    frames = None
    if video:
        frames = load_video(video, fps, max_frames)
        content.append({"type": "video"})
    content.append({"type": "text", "text": prompt})
    messages = ([{"role": "system", "content": [{"type": "text", "text": system_prompt}]}] if system_prompt else [])
    messages.append({"role": "user", "content": content})
    try:
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001
        raise CaptureError("the processor has no usable chat template (%s)" % str(e).split("\n")[0]) from e
    kw = {}
    if images:
        kw["images"] = load_images(images)
    if frames is not None:
        kw["videos"] = [frames]
    inputs = processor(text=[text], return_tensors="pt", **kw).to(model.device)
    prompt_ids = inputs["input_ids"][0].tolist()
    n = len(prompt_ids)
    modules = language_attention_modules(model)
    first_attn = next(m for m in model.modules() if id(m) in modules)
    inner_fn = inner_attention(first_attn, inner)
    image_token_id = getattr(model.config, "image_token_index", getattr(model.config, "image_token_id", None))
    video_token_id = getattr(model.config, "video_token_index", getattr(model.config, "video_token_id", None))

    with Recorder(options, tcfg.num_hidden_layers, max_new_tokens, module_layers=modules) as rec:
        captured = {}
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None

        def keep_embeds(_mod, args, kwargs):
            if "embeds" not in captured and kwargs.get("inputs_embeds") is not None:
                captured["embeds"] = kwargs["inputs_embeds"].detach()
        hook = decoder.register_forward_pre_hook(keep_embeds, with_kwargs=True) if (
            decoder is not None and stream_granularities) else None
        try:
            with capture_selected(model), rec.recording(inner_fn):
                out_ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        finally:
            if hook is not None:
                hook.remove()
        if rec.n is None:
            raise UnsupportedModelError("%s never called the capture attention: it does not select attention "
                                        "through AttentionInterface" % type(model).__name__)
        if rec.n != n:
            raise CaptureError("the model's prefill had %d tokens but the processor produced %d" % (rec.n, n))
        gen = out_ids[0, n:].tolist()
        t = rec.total_tokens
        decode_ids = gen[: t - n]
        pos = rec.position_ids[:, :t] if rec.position_ids is not None and (rec.position_ids[:, :t] >= 0).all() else None
        image_grids, video_grids = _grids(model, inputs, image_token_id, video_token_id,
                                          0 if frames is None else len(frames))
        tok = processor.tokenizer
        meta = build_token_metadata(
            prompt_ids, decode_ids, image_token_id=image_token_id, video_token_id=video_token_id,
            image_grids=image_grids, video_grids=video_grids,
            question_span=_question_span(tok, prompt_ids, prompt), position_ids=pos,
            text=[tok.decode([i]) for i in prompt_ids + decode_ids])
        blocks = None
        if stream_granularities:
            if video_token_id is None or "embeds" not in captured:
                raise UnsupportedModelError("stream block encodings need a video model whose decoder takes "
                                            "inputs_embeds (get_decoder())")
            stream = np.flatnonzero(meta.modality[:n] == 2)
            init_len = int(np.flatnonzero(meta.role[:n] != 0)[0]) if (meta.role[:n] != 0).any() else n
            blocks = StreamBlockRecorder(rec, init_len, stream, stream_granularities)
            with capture_selected(model), torch.no_grad():
                blocks.encode(lambda x, p: decoder(inputs_embeds=x, position_ids=p[None].to(x.device),
                                                   use_cache=False), captured["embeds"])
        name = model_name or os.path.basename(os.path.normpath(getattr(model, "name_or_path", "") or "model"))
        rec.write_trace(out, meta, name, getattr(tcfg, "model_type", "unknown"),
                        float(getattr(tcfg, "rope_theta", 0.0) or 0.0),
                        config_text="prompt: %r\nimages: %r\nvideo: %r fps %s\nmax_new_tokens: %d"
                        % (prompt, list(images), video, fps, max_new_tokens),
                        extra=blocks.write if blocks else None)
    return CaptureResult(out, n, t - n, tok.decode(gen, skip_special_tokens=True), gen)


def capture_dataset(model_dir, items: Iterable[dict], out_dir, model_dtype="auto", device=None, **kwargs):
    """Batch capture: loads the model once, then captures each item (a dict with 'id', 'prompt' and optional
    'images', 'video', 'fps', 'max_new_tokens', 'system_prompt') to out_dir/<id>.h5. Yields CaptureResult;
    an item that fails raises (earlier traces stay complete)."""
    model, processor = load(model_dir, model_dtype, device)
    os.makedirs(out_dir, exist_ok=True)
    for item in items:
        kw = dict(kwargs)
        for k in ("images", "video", "fps", "max_new_tokens", "system_prompt"):
            if k in item:
                kw[k] = item[k]
        yield capture(model, processor, os.path.join(out_dir, "%s.h5" % item["id"]), item["prompt"], **kw)
