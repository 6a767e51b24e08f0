"""Capture of the tiny multimodal model end to end: outputs unchanged, trace validates and replays in kvsim,
recorded tensors and aggregates match recomputation, options (layers, heads, dtype, queries), errors, and
the complete-or-absent guarantee."""
import glob
import json
import os
import re
import tempfile
import unittest

from capture_util import GRIDS, kvsim, model, reference_probs, run, tm  # noqa: I100 (skips without torch)
import h5py
import numpy as np
import torch

from kvsim_capture import (CaptureError, CaptureOptions, CaptureOutOfMemoryError, Recorder, UnsupportedModelError, capture_attention)
from kvsim_capture.writer import attr_str

F32_ALL = dict(storage_dtype="float32", all_queries=True)


class CaptureTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name="t.h5"):
        return os.path.join(self.dir, name)

    def test_capture_does_not_change_generated_tokens_or_logits(self):
        m = model()
        ids, patches, _ = tm.make_prompt(m.config, grids=GRIDS)
        gen0, logits0 = m.generate(ids, patches, 6)
        gen1, logits1, _ = run(m, self.path(), CaptureOptions(decode_rows=True))
        self.assertTrue(torch.equal(gen0, gen1))
        self.assertTrue(torch.equal(logits0, logits1))  # bit-identical: the wrapped call is the same call

    def test_trace_validates_and_runs_in_kvsim(self):
        run(model(), self.path(), CaptureOptions(**F32_ALL))
        v = kvsim("validate", self.path())
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        dev = float(re.search(r"max abs deviation ([0-9.e+-]+)", v.stdout).group(1))
        self.assertLess(dev, 1e-3, v.stdout)
        r = kvsim("run", "--trace", self.path(), "--policy", "snapkv", "--budget", "0.2", "--out", self.path("r.json"))
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.path("r.json")) as f:
            self.assertEqual(json.load(f)["policy"], "snapkv")

    def test_kvsim_validate_checks_recorded_decode_rows(self):
        # Window-only traces cannot have their prefill column sums rechecked; decode rows can.
        run(model(), self.path(), CaptureOptions(query_window=8, decode_rows=True), max_new_tokens=5)
        v = kvsim("validate", self.path())
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        m = re.search(r"decode attention rows \((\d+) layers\) vs recomputed from the decode queries: "
                      r"max abs deviation ([0-9.e+-]+)", v.stdout)
        self.assertIsNotNone(m, v.stdout)
        self.assertLess(float(m.group(2)), 5e-3, v.stdout)
        with h5py.File(self.path(), "r+") as f:  # a recorded row that disagrees with Q/K
            rows = f["capture/decode_attention/layer_001"]
            bad = rows[...]
            bad[0, 0, 0] += 0.5
            rows[...] = bad
        v = kvsim("validate", self.path())
        self.assertEqual(v.returncode, 3, v.stdout + v.stderr)
        self.assertIn("MISMATCH", v.stdout)
        self.assertIn("layer 1, head 0, step 0, key 0", v.stdout)

    def test_float16_window_trace_validates(self):
        gen, _, _ = run(model(), self.path(), CaptureOptions(query_window=8), max_new_tokens=5)
        v = kvsim("validate", self.path())
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("not checkable", v.stdout)
        with h5py.File(self.path()) as f:
            n = int(f.attrs["prefill_length"])
            self.assertEqual(attr_str(f.attrs["query_mode"]), "window_and_decode")
            self.assertEqual(attr_str(f.attrs["storage_dtype"]), "float16")
            self.assertEqual(f["layers/layer_000/keys"].dtype, np.dtype("<f2"))
            np.testing.assert_array_equal(f["queries/positions"][:], np.arange(n - 8, n + 4))
            self.assertEqual(f.attrs["num_decode_steps"], 4)  # 5 new tokens: 1 prefill + 4 decode calls
            np.testing.assert_array_equal(f["tokens/token_id"][n:], gen[:4].numpy())

    def test_recorded_tensors_and_aggregates_match_recomputation(self):
        m = model(sliding_window=10, softcap=4.0)
        keys = {}
        run(m, self.path(), CaptureOptions(decode_rows=True, **F32_ALL))

        # Independent K/V: re-run the model with a probing attention function keeping the final cache.
        def keep(module, q, k, v, mask, scaling, dropout=0.0, **kw):
            keys[module.layer_idx] = (k[0].numpy(), v[0].numpy())
            return tm.eager_attention_forward(module, q, k, v, mask, scaling, dropout, **kw)
        tm.ATTENTION_FUNCTIONS["keep"] = keep
        m.config.attn_implementation = "keep"
        ids, patches, _ = tm.make_prompt(m.config, grids=GRIDS)
        m.generate(ids, patches, 6)
        m.config.attn_implementation = "eager"
        with h5py.File(self.path()) as f:
            self.assertEqual(f.attrs["sliding_window"], 10)
            self.assertAlmostEqual(f.attrs["logit_softcap"], 4.0)
            self.assertAlmostEqual(f.attrs["softmax_scale"], 16 ** -0.5)
            n, t = int(f.attrs["prefill_length"]), int(f.attrs["prefill_length"] + f.attrs["num_decode_steps"])
            for l in range(3):
                k, v = f["layers/layer_%03d/keys" % l][:], f["layers/layer_%03d/values" % l][:]
                np.testing.assert_array_equal(k, keys[l][0])
                np.testing.assert_array_equal(v, keys[l][1])
                q = f["layers/layer_%03d/queries" % l][:]
                sums = f["aggregates/layer_%03d/prefill_column_sums" % l][:]
                rows = f["capture/decode_attention/layer_%03d" % l][:]
                for h in range(4):
                    kh = k[h // 2]
                    p = reference_probs(q[h, :n], kh[:n], 16 ** -0.5, 10, 4.0, np.arange(n))
                    np.testing.assert_allclose(sums[h], p.sum(0), atol=1e-4)
                    self.assertAlmostEqual(float(sums[h].sum()), n, places=3)
                    pd = reference_probs(q[h, n:], kh, 16 ** -0.5, 10, 4.0, np.arange(n, t))
                    np.testing.assert_allclose(rows[h], pd, atol=1e-5)
        v = kvsim("validate", self.path())
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def test_layer_and_head_subsets(self):
        m = model()
        run(m, self.path("full.h5"), CaptureOptions(**F32_ALL))
        run(m, self.path("sub.h5"), CaptureOptions(layers=[0, 2], kv_heads=[1], **F32_ALL))
        with h5py.File(self.path("full.h5")) as full, h5py.File(self.path("sub.h5")) as sub:
            self.assertEqual((sub.attrs["num_layers"], sub.attrs["num_heads"], sub.attrs["num_kv_heads"]), (2, 2, 1))
            np.testing.assert_array_equal(sub["capture"].attrs["layer_indices"], [0, 2])
            np.testing.assert_array_equal(sub["capture"].attrs["kv_head_indices"], [1])
            np.testing.assert_array_equal(sub["layers/layer_001/keys"][0], full["layers/layer_002/keys"][1])
            np.testing.assert_array_equal(sub["layers/layer_001/queries"][:], full["layers/layer_002/queries"][2:4])
            np.testing.assert_allclose(sub["aggregates/layer_001/prefill_column_sums"][:],
                                       full["aggregates/layer_002/prefill_column_sums"][2:4], atol=1e-6)
        self.assertEqual(kvsim("validate", self.path("sub.h5")).returncode, 0)

    def test_float16_is_float32_rounded(self):
        m = model()
        run(m, self.path("a.h5"), CaptureOptions(storage_dtype="float32"))
        run(m, self.path("b.h5"), CaptureOptions(storage_dtype="float16"))
        with h5py.File(self.path("a.h5")) as a, h5py.File(self.path("b.h5")) as b:
            for name in ("keys", "values", "queries"):
                np.testing.assert_array_equal(b["layers/layer_001/" + name][:],
                                              a["layers/layer_001/" + name][:].astype(np.float16))

    def test_multi_axis_position_ids_are_recorded(self):
        m = model(mrope_section=(2, 3, 3))
        ids, _, _ = tm.make_prompt(m.config, grids=GRIDS)
        pos = tm.mrope_positions(ids, m.config, GRIDS)
        run(m, self.path(), CaptureOptions(), max_new_tokens=4, position_ids=pos)
        with h5py.File(self.path()) as f:
            n = int(f.attrs["prefill_length"])
            multi = f["capture/position_ids"][:]
            self.assertEqual(multi.shape, (3, n + 3))
            np.testing.assert_array_equal(multi[:, :n], pos.numpy())
            nxt = int(pos.max()) + 1
            np.testing.assert_array_equal(multi[:, n:], np.tile(np.arange(nxt, nxt + 3), (3, 1)))
            np.testing.assert_array_equal(f["tokens/position_id"][:], multi[0])
        self.assertEqual(kvsim("validate", self.path()).returncode, 0)

    def test_failure_leaves_no_file(self):
        def boom(rec):
            def write(w):
                raise RuntimeError("disk vanished")
            return write
        with self.assertRaises(RuntimeError):
            run(model(), self.path(), CaptureOptions(), extra=boom)
        self.assertEqual(os.listdir(self.dir), [])  # neither the trace nor its temporary file

    def test_failure_during_run_leaves_no_file_and_no_scratch(self):
        scratch = os.path.join(self.dir, "scratch")
        os.mkdir(scratch)
        m = model()
        m.config.attn_implementation = "kvsim_capture"
        ids, patches, _ = tm.make_prompt(m.config, grids=GRIDS)
        with self.assertRaisesRegex(CaptureError, "max_new_tokens"):
            with Recorder(CaptureOptions(scratch_dir=scratch), 3, 2) as rec:
                with rec.recording(tm.eager_attention_forward):
                    m.generate(ids, patches, 5)  # more decode calls than the recorder was told
        self.assertEqual(os.listdir(scratch), [])
        self.assertFalse(glob.glob(os.path.join(self.dir, "*.h5*")))


class ErrorTest(unittest.TestCase):
    def tensors(self, q_len=4):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, q_len, 8, generator=g)
        k = torch.randn(1, 2, q_len, 8, generator=g)
        return q, k, k.clone()

    def call(self, module, mask=None, options=None, q_len=4, **kw):
        q, k, v = self.tensors(q_len)
        with Recorder(options or CaptureOptions(), 2, 4) as rec:
            with rec.recording(tm.eager_attention_forward):
                return capture_attention(module, q, k, v, mask, scaling=0.3, **kw)

    def module(self, layer_idx=0):
        mod = torch.nn.Module()
        mod.num_key_value_groups = 2
        if layer_idx is not None:
            mod.layer_idx = layer_idx
        return mod

    def test_module_without_layer_index(self):
        with self.assertRaisesRegex(UnsupportedModelError, "layer_idx"):
            self.call(self.module(None))

    def test_outside_recording(self):
        q, k, v = self.tensors()
        with self.assertRaisesRegex(CaptureError, "outside Recorder.recording"):
            capture_attention(self.module(), q, k, v, None, scaling=0.3)

    def test_non_causal_mask(self):
        bidirectional = torch.zeros(1, 1, 4, 4)
        with self.assertRaisesRegex(UnsupportedModelError, "not plain causal"):
            self.call(self.module(), mask=bidirectional)

    def test_float16_overflow_suggests_float32(self):
        q, k, v = self.tensors()
        with Recorder(CaptureOptions(), 2, 4) as rec, rec.recording(tm.eager_attention_forward):
            with self.assertRaisesRegex(CaptureError, "--dtype float32"):
                capture_attention(self.module(), q, k * 1e5, v, None, scaling=0.3)

    def test_layer_out_of_range_and_bad_options(self):
        with self.assertRaisesRegex(CaptureError, "model has 2 layers"):
            Recorder(CaptureOptions(layers=[5]), 2, 4)
        with self.assertRaisesRegex(CaptureError, "float16 or float32"):
            Recorder(CaptureOptions(storage_dtype="bfloat16"), 2, 4)
        with self.assertRaisesRegex(CaptureError, "KV head 3"):
            self.call(self.module(), options=CaptureOptions(kv_heads=[3]))

    def test_out_of_memory_suggests_subsets(self):
        def oom(*a, **kw):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        q, k, v = self.tensors()
        with self.assertRaisesRegex(CaptureOutOfMemoryError, "--layers"):
            with Recorder(CaptureOptions(), 2, 4) as rec, rec.recording(oom):
                capture_attention(self.module(), q, k, v, None, scaling=0.3)

    def test_nothing_recorded(self):
        with Recorder(CaptureOptions(), 2, 4) as rec:
            with self.assertRaisesRegex(CaptureError, "nothing was recorded"):
                rec.write_trace("/nonexistent/x.h5", None, "m")


if __name__ == "__main__":
    unittest.main()
