"""The transformers adapter fails with one clear line when transformers is missing (these machines have no
transformers; the adapter itself is untested here, see docs/capture.md)."""
import unittest

import capture_util  # noqa: F401 (skips without torch)

from kvsim_capture import MissingDependencyError, hf


class HfTest(unittest.TestCase):
    def test_missing_transformers_is_one_clear_line(self):
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass
        else:
            self.skipTest("transformers is installed")
        with self.assertRaises(MissingDependencyError) as cm:
            hf.import_transformers()
        self.assertIn("transformers", str(cm.exception))
        self.assertNotIn("\n", str(cm.exception))

    def test_find_last_and_question_span(self):
        self.assertEqual(hf._find_last([1, 2, 3, 1, 2], [1, 2]), 3)
        self.assertEqual(hf._find_last([1, 2], [3]), -1)

        class Tok:
            def __call__(self, text, add_special_tokens=False):
                return {"input_ids": [ord(c) for c in text]}
        prompt = [0, 0] + [ord(c) for c in "hi you"] + [9, 9]
        self.assertEqual(hf._question_span(Tok(), prompt, "hi you"), (2, 10))


if __name__ == "__main__":
    unittest.main()
