"""Hugging Face transformers adapter: registers capture_attention as an attention implementation, runs a
vision-language model once (prefill + greedy decode) with the capture selected for the language model's
attention, and writes the trace.

Needs transformers >= 4.48 (models whose attention goes through ALL_ATTENTION_FUNCTIONS /
AttentionInterface); imported lazily so the rest of kvsim_capture works without it. NOT YET RUN on real
transformers or a GPU (docs/capture.md, "Status").
"""
import contextlib
import dataclasses
import inspect
import math
import os
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from . import models, passkey
from .blocks import StreamBlockRecorder
from .errors import CaptureError, MissingDependencyError, UnsupportedModelError
from .metadata import build_token_metadata
from .recorder import CaptureOptions, Recorder, bound_heap_growth, capture_attention
from .writer import set_attr

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


@contextlib.contextmanager
def _no_gguf_progress_bar():
    """transformers' GGUF de-quantization draws a tqdm bar that ignores its logging switches."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: PLC0415
    except ImportError:
        yield
        return
    orig = getattr(gguf_utils, "tqdm", None)
    gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = orig


def load(model, dtype="auto", device=None, progress=True):
    """Loads (model, processor) from `model`: a local transformers folder, a .gguf checkpoint (transformers
    dequantizes it to float32; the tokenizer comes from the same file), a folder holding one .gguf, or a
    bundled name (`smollm2`, models.py). For a text-only model the processor is its tokenizer.
    progress=False: no progress bars on stderr (the command line's stderr is for results and errors)."""
    tf = import_transformers()
    bound_heap_growth()
    folder, gguf_file = models.resolve(model)
    if gguf_file is not None:
        models.check_gguf(os.path.join(folder, gguf_file))
    torch_dtype = {"auto": "auto", "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "float32": torch.float32}[dtype]
    if gguf_file is not None and dtype == "auto":
        torch_dtype = torch.float32  # GGUF weights are dequantized to float32
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    extra = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tf.logging.set_verbosity_error()
    if not progress:
        tf.utils.logging.disable_progress_bar()
    if gguf_file is None:
        try:
            processor = tf.AutoProcessor.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - transformers raises many types here
            raise CaptureError("%s: cannot load a processor or tokenizer (%s); the folder needs tokenizer files "
                               "(and preprocessor_config.json for images)" % (folder, str(e).split("\n")[0])) from e
    else:
        try:
            processor = tf.AutoTokenizer.from_pretrained(folder, **extra)
        except Exception as e:  # noqa: BLE001
            raise CaptureError("%s: cannot read a tokenizer from the GGUF file (%s)"
                               % (os.path.join(folder, gguf_file), str(e).split("\n")[0][:200])) from e
    errors = []
    classes = ("AutoModelForCausalLM",) if gguf_file else (
        "AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM")
    for cls_name in classes:
        cls = getattr(tf, cls_name, None)
        if cls is None:
            continue
        try:
            with contextlib.nullcontext() if progress else _no_gguf_progress_bar():
                m = cls.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa", **extra)
            m.kvsim_model_name = os.path.splitext(gguf_file or os.path.basename(os.path.normpath(folder)))[0]
            return m.to(device).eval(), processor
        except torch.cuda.OutOfMemoryError as e:
            raise CaptureError("out of GPU memory loading the model; use --model-dtype bfloat16/float16 or a "
                               "larger GPU") from e
        except (ValueError, KeyError, OSError, RuntimeError, TypeError) as e:
            errors.append("%s: %s" % (cls_name, str(e).split("\n")[0][:200]))
    raise UnsupportedModelError("%s: no transformers auto class loads this model (%s)"
                                % (os.path.join(folder, gguf_file or ""), "; ".join(errors)))


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


def _video_metadata_kwargs(processor, frames, fps):
    """Tells a processor with a video processor that the frames are already sampled, at `fps` frames per second
    (its video_metadata): Qwen2.5-VL spaces its temporal M-RoPE positions by the frames' time
    (second_per_grid_ts), which without this assumes 24 frames per second."""
    if getattr(processor, "video_processor", None) is None or not fps or fps <= 0:
        return {}
    return {"video_metadata": [{"fps": float(fps), "total_num_frames": len(frames),
                                "frames_indices": list(range(len(frames)))}], "do_sample_frames": False}


def _image_token_counts(processor, pil_images, inputs, image_token_id):
    """Per image, the number of image tokens the processor expands it to, for processors whose outputs do not
    say it (no image_grid_thw): LLaVA-1.5 (fixed), LLaVA-OneVision / LLaVA-NeXT (any-res: depends on the
    image's size). Adjacent images make one run of image tokens, so the run cannot be split otherwise. Each
    image goes through the processor alone; None when that fails or does not add up to the prompt's count."""
    marker = getattr(processor, "image_token", None)
    if image_token_id is None or len(pil_images) < 2 or "image_grid_thw" in inputs or not isinstance(marker, str):
        return None
    counts = []
    try:
        for img in pil_images:
            ids = processor(text=[marker], images=[img], return_tensors="pt")["input_ids"][0]
            counts.append(int((ids == image_token_id).sum()))
    except Exception:  # noqa: BLE001 - a processor that cannot take one image alone: fall back to runs
        return None
    total = int((inputs["input_ids"][0] == image_token_id).sum())
    return counts if sum(counts) == total and all(counts) else None


def _grids(model, inputs, image_token_id, video_token_id, n_frames, n_images=0, image_counts=None):
    """Per image (rows, cols) or token count / per video (frames, rows, cols) LLM-token grids from the processor
    outputs. image_counts: per image token counts (_image_token_counts) when the outputs have no grids."""
    vcfg = getattr(model.config, "vision_config", None)
    merge = int(getattr(vcfg, "spatial_merge_size", 1) or 1)
    image_grids = video_grids = None
    if "image_grid_thw" in inputs:      # Qwen2-VL / Qwen2.5-VL
        image_grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in inputs["image_grid_thw"].tolist()]
    elif image_token_id is not None and n_images:
        count = int((inputs["input_ids"][0] == image_token_id).sum())
        counts = list(image_counts) if image_counts else None
        if counts is None and (n_images == 1 or ("image_sizes" not in inputs and count % n_images == 0)):
            counts = [count // n_images] * n_images  # fixed-size images (LLaVA-1.5: 24 x 24 each)
        if counts is not None and len(counts) == n_images and sum(counts) == count:
            # A square share is a grid unless the processor lays images out any-res (image_sizes: LLaVA-NeXT,
            # LLaVA-OneVision: base grid, then the unpadded crops with a newline token per row): a count then.
            anyres = "image_sizes" in inputs
            image_grids = [(math.isqrt(c), math.isqrt(c)) if not anyres and math.isqrt(c) ** 2 == c else c
                           for c in counts]
    if "video_grid_thw" in inputs:
        video_grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in inputs["video_grid_thw"].tolist()]
    elif video_token_id is not None and n_frames:
        count = int((inputs["input_ids"][0] == video_token_id).sum())
        # LLaVA-OneVision: side x side pooled tokens per frame (196 = 14 x 14 at full size), then one newline
        # token after the last frame (metadata puts it in the last frame's segment, without a patch position).
        for frame_tokens in (count, count - 1):
            side = int(round((frame_tokens // n_frames) ** 0.5))
            if side and side * side * n_frames == frame_tokens:
                video_grids = [(n_frames, side, side)]
                break
    return image_grids, video_grids


def _rope_positions(model, inputs, token_ids, pos):
    """The multi-axis RoPE positions [3, t] of a model with get_rope_index (Qwen2-VL, Qwen2.5-VL: M-RoPE) for
    the prompt and decode tokens `token_ids`, from the model's own get_rope_index and the processor's grids.
    transformers >= 5 passes only the 1-D text positions to attention (`pos`, what the recorder saw), not the
    ones the rotary embedding used. Returns `pos` unchanged for other models or when it is multi-axis already."""
    fn = getattr(getattr(model, "model", None), "get_rope_index", None)
    if fn is None or (pos is not None and pos.shape[0] > 1) or not (
            "image_grid_thw" in inputs or "video_grid_thw" in inputs):
        return pos
    params = inspect.signature(fn).parameters
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=inputs["input_ids"].device)
    n = inputs["input_ids"].shape[1]
    kw = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
          if k in params and inputs.get(k) is not None}
    if "attention_mask" in params:
        kw["attention_mask"] = torch.ones_like(ids)
    if "mm_token_type_ids" in params:
        mm = inputs.get("mm_token_type_ids")
        if mm is None:
            return pos
        kw["mm_token_type_ids"] = torch.cat([mm, mm.new_zeros(1, ids.shape[1] - n)], dim=1)  # decode: text
    try:
        with torch.no_grad():
            p = fn(ids, **kw)[0]
    except Exception as e:  # noqa: BLE001
        raise CaptureError("%s.get_rope_index failed (%s); cannot record its M-RoPE positions"
                           % (type(model.model).__name__, str(e).split("\n")[0][:200])) from e
    return p[:, 0].detach().to("cpu", torch.int64).numpy()


@dataclasses.dataclass
class CaptureResult:
    path: str
    prompt_tokens: int
    decode_steps: int
    generated_text: str
    generated_ids: list


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def is_text_only(processor):
    """A bare tokenizer (text models, GGUF checkpoints) rather than a multimodal processor."""
    return getattr(processor, "tokenizer", None) is None


def _token_at_char(offsets, char):
    """Index of the first token whose text ends after character `char` (offset_mapping of a fast tokenizer)."""
    for i, (_, end) in enumerate(offsets):
        if end > char:
            return i
    return len(offsets)


def text_prompt(processor, prompt, system_prompt=None, question=None):
    """Chat-templated text-only prompt (a TextPrompt): the question role starts at `question`'s last occurrence
    in the prompt (default: the whole user message), the system role ends where the user's message starts."""
    tok = tokenizer_of(processor)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    if getattr(tok, "chat_template", None):
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001
            raise CaptureError("the tokenizer's chat template failed (%s)" % str(e).split("\n")[0]) from e
    else:
        text = ((system_prompt + "\n\n") if system_prompt else "") + prompt
    enc = tok(text, return_tensors="pt", add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc.pop("offset_mapping")[0].tolist()
    user_char = text.rfind(prompt)
    q_char = text.rfind(question) if question else user_char
    if user_char < 0 or q_char < 0:
        raise CaptureError("the chat template changed the prompt text; cannot find the question in it")
    n = enc["input_ids"].shape[1]
    return TextPrompt(enc, (_token_at_char(offsets, q_char), n), _token_at_char(offsets, user_char), text, offsets)


@dataclasses.dataclass
class TextPrompt:
    inputs: object               # tokenizer output (input_ids, attention_mask), batch 1
    question_span: tuple         # [start, end) tokens of the question role
    system_end: int              # tokens before the user's message
    text: str                    # the templated prompt
    offsets: list                # per token (char start, char end) in `text`

    def token_span(self, substring):
        """[start, end) tokens covering the last occurrence of `substring` in the prompt."""
        c = self.text.rfind(substring)
        if c < 0:
            raise CaptureError("internal: %r is not in the prompt" % substring[:40])
        return _token_at_char(self.offsets, c), _token_at_char(self.offsets, c + len(substring) - 1) + 1


def context_length(model):
    tcfg = text_config(model)
    return int(getattr(tcfg, "max_position_embeddings", 0) or 0)


def generate(model, processor, inputs, max_new_tokens, min_new_tokens=0):
    """Greedy decode exactly as capture runs it, without capture (to compare token for token).
    min_new_tokens: end-of-sequence is suppressed until this many tokens (transformers' min_new_tokens)."""
    tok = tokenizer_of(processor)
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              do_sample=False, num_beams=1,
                              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


def capture(model, processor, out, prompt, images: Sequence[str] = (), video: Optional[str] = None, fps=1.0,
            max_new_tokens=32, options: Optional[CaptureOptions] = None, system_prompt=None, inner="sdpa",
            stream_granularities: Sequence[int] = (), max_frames=0, model_name=None, question=None,
            config_text=None, extra_attrs=None, min_new_tokens=0, on_generated=None,
            extra_writer=None, video_frames=None) -> CaptureResult:
    """Runs `model` once on (images | video) + prompt with greedy decoding and writes the trace to `out`.

    question: the part of `prompt` where kvsim's `question` role starts (default: the whole prompt; text-only
    models). config_text / extra_attrs: provenance stored in the trace (`config_text`, `/capture` attributes).
    min_new_tokens: end-of-sequence is suppressed until this many tokens are generated (0: plain greedy).
    video_frames: a video as decoded frames (uint8 [frames, H, W, 3], `fps` frames per second) instead of a
    file (`video`, sampled at `fps`)."""
    options = options or CaptureOptions()
    options.validate()
    if max_new_tokens < 1:
        raise CaptureError("max_new_tokens must be >= 1, got %d" % max_new_tokens)
    tcfg = text_config(model)
    frames = image_counts = None
    system_end = None
    if is_text_only(processor):
        if images or video or video_frames is not None:
            raise UnsupportedModelError("%s is a text-only model (its processor is a tokenizer): no --image or "
                                        "--video" % type(model).__name__)
        tp = text_prompt(processor, prompt, system_prompt, question)
        inputs, question_span, system_end = tp.inputs.to(model.device), tp.question_span, tp.system_end
    else:
        content = [{"type": "image"} for _ in images]
        if video_frames is not None:
            frames = np.asarray(video_frames, dtype=np.uint8)
            if frames.ndim != 4 or frames.shape[-1] != 3:
                raise CaptureError("video_frames must be uint8 [frames, height, width, 3], got shape %s"
                                   % (frames.shape,))
            content.append({"type": "video"})
        elif video:
            frames = load_video(video, fps, max_frames)
            content.append({"type": "video"})
        content.append({"type": "text", "text": prompt})
        messages = ([{"role": "system", "content": [{"type": "text", "text": system_prompt}]}]
                    if system_prompt else [])
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
            kw.update(_video_metadata_kwargs(processor, frames, fps))
        inputs = processor(text=[text], return_tensors="pt", **kw).to(model.device)
        image_counts = _image_token_counts(processor, kw.get("images", []), inputs, getattr(
            model.config, "image_token_index", getattr(model.config, "image_token_id", None)))
        question_span = None
    prompt_ids = inputs["input_ids"][0].tolist()
    n = len(prompt_ids)
    ctx = context_length(model)
    if ctx and n + max_new_tokens - 1 > ctx:
        raise CaptureError("the prompt has %d tokens and %d new tokens are asked, beyond the model's context of "
                           "%d tokens (max_position_embeddings); shorten the prompt" % (n, max_new_tokens, ctx))
    modules = language_attention_modules(model)
    first_attn = next(m for m in model.modules() if id(m) in modules)
    inner_fn = inner_attention(first_attn, inner)
    image_token_id = getattr(model.config, "image_token_index", getattr(model.config, "image_token_id", None))
    video_token_id = getattr(model.config, "video_token_index", getattr(model.config, "video_token_id", None))
    tok = tokenizer_of(processor)

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
                out_ids = generate(model, processor, inputs, max_new_tokens, min_new_tokens)
        finally:
            if hook is not None:
                hook.remove()
        if rec.n is None:
            raise UnsupportedModelError("%s never called the capture attention: it does not select attention "
                                        "through AttentionInterface" % type(model).__name__)
        if rec.n != n:
            raise CaptureError("the model's prefill had %d tokens but the processor produced %d" % (rec.n, n))
        gen = out_ids[0, n:].tolist()
        if on_generated is not None:
            on_generated(gen)
        t = rec.total_tokens
        decode_ids = gen[: t - n]
        pos = rec.position_ids[:, :t] if rec.position_ids is not None and (rec.position_ids[:, :t] >= 0).all() else None
        pos = _rope_positions(model, inputs, prompt_ids + decode_ids, pos)
        image_grids, video_grids = _grids(model, inputs, image_token_id, video_token_id,
                                          0 if frames is None else len(frames), len(images), image_counts)
        if question_span is None:
            question_span = _question_span(tok, prompt_ids, question or prompt)
        meta = build_token_metadata(
            prompt_ids, decode_ids, image_token_id=image_token_id, video_token_id=video_token_id,
            image_grids=image_grids, video_grids=video_grids, question_span=question_span,
            system_end=system_end, position_ids=pos, text=[tok.decode([i]) for i in prompt_ids + decode_ids])
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
        name = model_name or getattr(model, "kvsim_model_name", None) or os.path.basename(
            os.path.normpath(getattr(model, "name_or_path", "") or "model"))
        if config_text is None:
            config_text = ("prompt: %r\nimages: %r\nvideo: %r fps %s\nmax_new_tokens: %d"
                           % (prompt, list(images), video, fps, max_new_tokens))

        def write_extra(w):
            if extra_attrs:
                cap = w.extra_group("capture")
                for k, v in extra_attrs.items():
                    set_attr(cap, k, v)
            if extra_writer is not None:
                extra_writer(w)
            if blocks:
                blocks.write(w)
        rec.write_trace(out, meta, name, getattr(tcfg, "model_type", "unknown"),
                        float(getattr(tcfg, "rope_theta", 0.0) or _rope_theta(tcfg)),
                        config_text=config_text, extra=write_extra)
    return CaptureResult(out, n, t - n, tok.decode(gen, skip_special_tokens=True), gen)


def _rope_theta(tcfg):
    """rope_theta from transformers >= 5's rope_parameters when the attribute is gone."""
    params = getattr(tcfg, "rope_parameters", None) or {}
    if isinstance(params, dict):
        return float(params.get("rope_theta", 0.0) or 0.0)
    return 0.0


def capture_dataset(model_dir, items: Iterable[dict], out_dir, model_dtype="auto", device=None, **kwargs):
    """Batch capture (the capture tool's dataset mode): checks every item first (ids, tags; dataset.py), loads
    the model once, then captures each item (a dict with 'id', 'prompt' and optional 'images', 'video', 'fps',
    'max_new_tokens', 'system_prompt', 'tags' ({"k": "v"} or ["k=v"])) to out_dir/<id>.h5, and after each
    trace rewrites out_dir/manifest.csv (id,path,tags,group) for `kvsim sweep --manifest`. Yields
    CaptureResult; an item that fails raises (earlier traces and their manifest lines stay complete)."""
    from . import dataset  # noqa: PLC0415

    items = list(items)
    dataset.check_items(items)
    model, processor = load(model_dir, model_dtype, device)
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for item in items:
        kw = dict(kwargs)
        for k in ("images", "video", "fps", "max_new_tokens", "system_prompt"):
            if k in item:
                kw[k] = item[k]
        res = capture(model, processor, os.path.join(out_dir, "%s.h5" % item["id"]), item["prompt"], **kw)
        rows.append((item["id"], res.path, dataset.item_tags(item), dataset.trace_group(res.path)))
        dataset.write_manifest(out_dir, rows)
        yield res


def capture_passkey(model, processor, out, prompt_tokens=2048, depth=0.5, seed=0, max_new_tokens=33,
                    options: Optional[CaptureOptions] = None, haystack_files=passkey.DEFAULT_HAYSTACK,
                    license_dir=passkey.LICENSE_DIR, model_name=None):
    """Captures a passkey-retrieval run (passkey.py) of a text model: about `prompt_tokens` prompt tokens with
    the needle at `depth`, greedy decode of exactly `max_new_tokens` tokens (end-of-sequence suppressed until
    then, so the trace has max_new_tokens - 1 decode steps however short the answer). Returns
    (CaptureResult, PasskeyTask, answered); `answered` looks at the text up to the first end-of-sequence.
    The trace records the task under /capture: task, passkey, passkey_depth, passkey_seed, needle_tokens
    ([start, end) prompt positions of the needle), answered."""
    if not is_text_only(processor):
        raise UnsupportedModelError("the passkey task is for text models; %s has a multimodal processor"
                                    % type(model).__name__)
    ctx = context_length(model)
    if ctx and prompt_tokens + max_new_tokens - 1 > ctx:
        raise CaptureError("passkey prompt of %d tokens + %d new tokens is beyond the model's context of %d "
                           "tokens; ask for fewer" % (prompt_tokens, max_new_tokens, ctx))
    task = passkey.build_passkey_task(
        lambda msg: text_prompt(processor, msg).inputs["input_ids"].shape[1], prompt_tokens, depth, seed,
        haystack_files, license_dir)
    tp = text_prompt(processor, task.user_message, question=task.question)
    needle = tp.token_span(task.needle)
    attrs = {"task": "passkey", "passkey": task.passkey, "passkey_depth": float(depth),
             "passkey_seed": int(seed), "needle_tokens": np.asarray(needle, dtype=np.int64)}
    tok = tokenizer_of(processor)
    answers = {}

    def answered_attr(w):  # written with the trace, so a trace says whether its model solved the task
        w.extra_group("capture").attrs["answered"] = np.int64(answers["ok"])

    res = capture(model, processor, out, task.user_message, max_new_tokens=max_new_tokens, options=options,
                  question=task.question, model_name=model_name, extra_attrs=attrs, min_new_tokens=max_new_tokens,
                  config_text="task: passkey\n%s\nneedle_tokens: [%d, %d)\nmax_new_tokens: %d (end-of-sequence "
                  "suppressed)" % (task.config_text(), needle[0], needle[1], max_new_tokens),
                  on_generated=lambda ids: answers.setdefault("ok", task.answered(answer_text(tok, ids))),
                  extra_writer=answered_attr)
    return res, task, bool(answers["ok"])


def answer_text(tokenizer, ids):
    """The generated text up to the first end-of-sequence token (what a chat client shows)."""
    eos = tokenizer.eos_token_id
    ids = list(ids)
    if eos is not None and eos in ids:
        ids = ids[:ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)
