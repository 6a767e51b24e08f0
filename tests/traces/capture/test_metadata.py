"""Token metadata: modality from special ids, segments per image/frame/text span, patch positions from grids,
roles from spans, position ids."""
import unittest

from capture_util import GRIDS, model, tm  # noqa: F401 (skips without torch)
import numpy as np

from kvsim_capture import CaptureError, build_token_metadata
from kvsim_capture.metadata import CONTEXT, GENERATED, IMAGE, QUESTION, SYSTEM, TEXT, VIDEO

IMG, VID = 60, 61


class MetadataTest(unittest.TestCase):
    def test_images_with_grids(self):
        cfg = tm.TinyConfig()
        ids, _, spans = tm.make_prompt(cfg, system=3, grids=GRIDS, between=2, question=5)
        m = build_token_metadata(ids, [7, 8], image_token_id=IMG, image_grids=GRIDS, **spans)
        n = len(ids)  # 3 sys + 9 img + 2 text + 8 img + 5 question = 27
        self.assertEqual(n, 27)
        np.testing.assert_array_equal(m.modality, [TEXT] * 3 + [IMAGE] * 9 + [TEXT] * 2 + [IMAGE] * 8 + [TEXT] * 7)
        np.testing.assert_array_equal(m.role, [SYSTEM] * 3 + [CONTEXT] * 19 + [QUESTION] * 5 + [GENERATED] * 2)
        np.testing.assert_array_equal(m.segment_id, [0] * 3 + [1] * 9 + [2] * 2 + [3] * 8 + [4] * 5 + [5] * 2)
        np.testing.assert_array_equal(m.patch_row[3:12], np.arange(9) // 3)
        np.testing.assert_array_equal(m.patch_col[14:22], np.arange(8) % 4)
        np.testing.assert_array_equal(m.patch_row[14:22], np.arange(8) // 4)
        self.assertTrue((m.patch_row[:3] == -1).all() and (m.patch_col[22:] == -1).all())
        np.testing.assert_array_equal(m.token_id[n:], [7, 8])
        np.testing.assert_array_equal(m.position_id, np.arange(n + 2))
        self.assertIsNone(m.position_ids_multi)

    def test_defaults_without_grids_or_spans(self):
        ids = [1, 2] + [IMG] * 16 + [3] + [IMG] * 6 + [4, 5]
        m = build_token_metadata(ids, image_token_id=IMG)
        np.testing.assert_array_equal(m.patch_row[2:18], np.arange(16) // 4)  # a square run: 4 x 4
        self.assertTrue((m.patch_row[19:25] == -1).all())                    # 6 tokens: not square, unknown
        self.assertEqual(len(set(m.segment_id[2:18])), 1)
        self.assertNotEqual(m.segment_id[2], m.segment_id[19])
        np.testing.assert_array_equal(m.role[:2], [SYSTEM] * 2)               # before the first image
        np.testing.assert_array_equal(m.role[25:], [QUESTION] * 2)            # text after the last image

    def test_video_frames_are_segments(self):
        ids = [1] + [VID] * 12 + [2, 3]
        m = build_token_metadata(ids, video_token_id=VID, video_grids=[(3, 2, 2)])
        self.assertTrue((m.modality[1:13] == VIDEO).all())
        self.assertEqual(list(np.unique(m.segment_id[1:13], return_counts=True)[1]), [4, 4, 4])
        np.testing.assert_array_equal(m.patch_col[1:13], np.tile([0, 1, 0, 1], 3))
        # Token count not matching the grids (e.g. a newline token per frame): one segment, no patch ids.
        m = build_token_metadata(ids, video_token_id=VID, video_grids=[(2, 2, 2)])
        self.assertEqual(len(set(m.segment_id[1:13])), 1)
        self.assertTrue((m.patch_row[1:13] == -1).all())

    def test_video_newline_after_the_frames_joins_the_last_frame(self):
        # LLaVA-OneVision: 3 frames x (2 x 2) pooled tokens, then one newline token (same id) after the video.
        ids = [1] + [VID] * 13 + [2]
        m = build_token_metadata(ids, video_token_id=VID, video_grids=[(3, 2, 2)])
        self.assertEqual(list(np.unique(m.segment_id[1:14], return_counts=True)[1]), [4, 4, 5])
        self.assertEqual((m.patch_row[13], m.patch_col[13]), (-1, -1))
        self.assertEqual(m.patch_row[12], 1)

    def test_multi_axis_position_ids(self):
        pos = np.stack([np.arange(5), np.arange(5) + 1, np.arange(5) + 2])
        m = build_token_metadata([1, 2, 3, 4], [9], position_ids=pos)
        np.testing.assert_array_equal(m.position_id, pos[0])
        np.testing.assert_array_equal(m.position_ids_multi, pos)

    def test_errors(self):
        with self.assertRaisesRegex(CaptureError, "empty"):
            build_token_metadata([])
        with self.assertRaisesRegex(CaptureError, "question span"):
            build_token_metadata([1, 2], question_span=(1, 5))
        with self.assertRaisesRegex(CaptureError, "position ids cover"):
            build_token_metadata([1, 2], position_ids=[0, 1, 2])


if __name__ == "__main__":
    unittest.main()
