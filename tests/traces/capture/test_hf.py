"""The transformers adapter fails with one clear line when transformers is missing; question spans. (The
adapter itself runs on real models in test_smollm2.py and test_hf_multimodal.py.)"""
import sys
import unittest

import capture_util  # noqa: F401 (skips without torch)

from kvsim_capture import MissingDependencyError, hf


class HfTest(unittest.TestCase):
    def test_missing_transformers_is_one_clear_line(self):
        # The project environment has transformers: hide it (an import of a None module raises ImportError).
        saved = {k: v for k, v in sys.modules.items() if k == "transformers" or k.startswith("transformers.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["transformers"] = None
        try:
            with self.assertRaises(MissingDependencyError) as cm:
                hf.import_transformers()
        finally:
            del sys.modules["transformers"]
            sys.modules.update(saved)
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
