"""Command line: usage errors exit 2, capture errors exit 1 with one line, index lists parse."""
import os
import subprocess
import sys
import unittest

import capture_util  # noqa: F401 (skips without torch)

from kvsim_capture.cli import parse_indices

ENV = dict(os.environ, PYTHONPATH=capture_util.CAPTURE_PYTHONPATH)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "kvsim_capture", *args, *capture_util.CLI_EXTRA], capture_output=True,
                          text=True, env=ENV)


class CliTest(unittest.TestCase):
    def test_parse_indices(self):
        self.assertEqual(parse_indices("0-3,8, 2"), [0, 1, 2, 3, 8])

    def test_usage_error(self):
        r = cli("--prompt", "x")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--model", r.stderr)

    def test_capture_error_is_one_line_and_no_output(self):
        out = os.path.join(capture_util.REPO, "build", "never.h5")
        r = cli("--model", "/nonexistent", "--prompt", "hi", "--out", out, "--dtype", "float32")
        self.assertEqual(r.returncode, 1)
        self.assertTrue(r.stderr.startswith("kvsim_capture: error: "), r.stderr)
        self.assertEqual(r.stderr.count("\n"), 1, r.stderr)
        self.assertFalse(os.path.exists(out))
        r = cli("--model", "/nonexistent", "--prompt", "hi", "--out", out, "--max-new-tokens", "0")
        self.assertIn("--max-new-tokens", r.stderr)


if __name__ == "__main__":
    unittest.main()
