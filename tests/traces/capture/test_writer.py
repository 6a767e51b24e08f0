"""TraceWriter: complete-or-absent files and ordering checks."""
import os
import tempfile
import unittest

import capture_util  # noqa: F401 (skips without torch)
import numpy as np

from kvsim_capture import CaptureError, TraceWriter

ATTRS = dict(model_name="m", model_family="llama", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
             softmax_scale=0.5, causal=1, sliding_window=0, logit_softcap=0.0, rope_theta=1e4,
             model_dtype="float32", storage_dtype="float32", prefill_length=3, num_decode_steps=1,
             source="captured", generator="test", generator_version="0")
TOKENS = dict(modality=[0] * 4, segment_id=[0] * 4, patch_row=[-1] * 4, patch_col=[-1] * 4,
              position_id=range(4), role=[1, 1, 1, 3], token_id=[5] * 4)


class WriterTest(unittest.TestCase):
    def test_abort_mid_layers_leaves_nothing_and_finish_renames(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.h5")
            kv, q = np.zeros((1, 4, 4), np.float32), np.zeros((2, 4, 4), np.float32)
            with self.assertRaises(CaptureError):
                with TraceWriter(path) as w:
                    w.begin(ATTRS, TOKENS, range(4))
                    w.write_layer(0, kv, kv, q)
                    self.assertTrue(os.path.exists(w.tmp_path) and not os.path.exists(path))
                    w.write_layer(0, kv, kv, q)  # out of order
            self.assertEqual(os.listdir(d), [])
            with TraceWriter(path) as w:
                w.begin(ATTRS, TOKENS, range(4))
                w.write_layer(0, kv, kv, q)
                with self.assertRaisesRegex(CaptureError, "1 of 2 layers"):
                    w.finish()
                w.write_layer(1, kv, kv, q)
                w.finish()
            self.assertEqual(os.listdir(d), ["t.h5"])
            r = capture_util.kvsim("validate", path)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
