"""Streaming-video block encodings (MuKV/ReKV recipe): each g-token block of the video stream encoded after
the init prompt only, stored under /streaming_blocks."""
import os
import tempfile
import unittest

from capture_util import kvsim, model, reference_probs, tm  # noqa: F401 (skips without torch)
import h5py
import numpy as np
import torch

from kvsim_capture import CaptureError, CaptureOptions, Recorder, build_token_metadata
from kvsim_capture.blocks import StreamBlockRecorder

INIT, FRAMES, ROWS, COLS = 3, 4, 2, 3


class BlocksTest(unittest.TestCase):
    def test_block_encodings(self):
        m = model(num_kv_heads=4)
        cfg = m.config
        g = torch.Generator().manual_seed(3)
        stream = FRAMES * ROWS * COLS
        ids = torch.cat([torch.randint(1, 50, (INIT,), generator=g), torch.full((stream,), cfg.video_token_id),
                         torch.randint(1, 50, (4,), generator=g)])
        patches = torch.randn(stream, cfg.patch_dim, generator=g)
        cfg.attn_implementation = "kvsim_capture"
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.h5")
            with Recorder(CaptureOptions(storage_dtype="float32", layers=[0, 2]), 3, 3) as rec:
                with rec.recording(tm.eager_attention_forward):
                    gen, _ = m.generate(ids, patches, 3)
                with self.assertRaisesRegex(CaptureError, "granularities"):
                    StreamBlockRecorder(rec, INIT, [], [0])
                positions = np.arange(INIT, INIT + stream)
                blocks = StreamBlockRecorder(rec, INIT, positions, (6, 12, 10))
                with torch.no_grad():
                    blocks.encode(lambda x, p: m.language_model(x, p), m.embed_prompt(ids, patches))
                meta = build_token_metadata(ids, gen[:2], video_token_id=cfg.video_token_id,
                                            video_grids=[(FRAMES, ROWS, COLS)])
                rec.write_trace(path, meta, "tiny", extra=blocks.write)
            self.assertEqual(kvsim("validate", path).returncode, 0)
            with h5py.File(path) as f:
                sb = f["streaming_blocks"]
                self.assertEqual(sb.attrs["init_len"], INIT)
                self.assertEqual(sb["g10"].attrs["num_blocks"], 2)               # 24 // 10, leftovers dropped
                np.testing.assert_array_equal(sb["g10/token_positions"][:], positions[:20])
                for gran in (6, 12):
                    k = sb["g%d/layer_001/keys" % gran][:]                       # model layer 2
                    self.assertEqual(k.shape, (4, stream, 16))
                    main = f["layers/layer_001/keys"][:, INIT:INIT + gran]
                    # Block 0 directly follows the init prompt, as in the continuous run: same keys.
                    np.testing.assert_allclose(k[:, :gran], main, atol=1e-5)
                    # Later blocks see no earlier video and restart positions at init_len: different keys.
                    self.assertGreater(np.abs(k[:, gran:2 * gran] - f["layers/layer_001/keys"][:, INIT + gran:
                                                                                          INIT + 2 * gran]).max(), 1e-3)
                    a = sb["g%d/layer_001/attention_received" % gran][:]
                    self.assertEqual(a.shape, (4, stream))
                    # Each block query's row sums to 1 over init + block keys: block keys get at most g.
                    self.assertTrue(((a.reshape(4, -1, gran).sum(-1) <= gran + 1e-4)).all())
        cfg.attn_implementation = "eager"

    def test_needs_main_capture_first(self):
        with Recorder(CaptureOptions(), 3, 2) as rec:
            with self.assertRaisesRegex(CaptureError, "after the main capture"):
                StreamBlockRecorder(rec, 3, [3, 4], [1])


if __name__ == "__main__":
    unittest.main()
