"""Recorded prompt attention entropies in captured traces (docs/capture.md "Prompt entropies",
docs/trace-format.md "Recorded prompt attention entropies"), on the tiny multimodal model: the regions follow
`kvsim synth`'s rule, the values equal what kvsim recomputes from the trace's stored Q/K in every bit, MEDA gives
bit-identical results with and without them, a window-only capture replays query-aware MEDA, bad values are
refused with no file left."""
import os
import re
import subprocess
import sys
import tempfile
import unittest

from capture_util import NO_EXTENSION, REPO, kvsim, model, run  # noqa: I100 (skips without torch)

if NO_EXTENSION:
    raise unittest.SkipTest("this build has no kvsim extension (sanitizer stage); the regular build runs these tests")
import h5py
import numpy as np

from kvsim_capture import CaptureError, CaptureOptions, MissingDependencyError, TraceWriter
from kvsim_capture import entropies
from kvsim_capture.metadata import CONTEXT, QUESTION, SYSTEM

import kvsim as kv  # the Python API over the same engine (python/kvsim)

MEDA = [{"name": "meda"}, {"name": "meda", "params": {"variant": "OFFICIAL_CODE"}},
        {"name": "meda", "params": {"entropy": "FULL_SELF"}}]
BUDGETS = [0.2, 0.5]


def strip_trace(x):
    """A run result without the fields naming the trace file (path, content hash, sample id = file name)."""
    if isinstance(x, dict):
        return {k: strip_trace(v) for k, v in x.items() if k not in ("trace_path", "trace_hash", "sample_id")}
    if isinstance(x, list):
        return [strip_trace(v) for v in x]
    return x


class EntropyCaptureTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.m = model()
        cls.with_path, cls.without_path = os.path.join(d, "with.h5"), os.path.join(d, "without.h5")
        cls.window_path = os.path.join(d, "window.h5")
        _, _, cls.meta = run(cls.m, cls.with_path, CaptureOptions(all_queries=True))  # float16, entropies on
        run(cls.m, cls.without_path, CaptureOptions(all_queries=True, prompt_entropies=False))
        run(cls.m, cls.window_path, CaptureOptions(query_window=4))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def test_regions_are_synths_context_and_whole_prompt(self):
        n = int(np.sum(self.meta.role != 3))
        q0 = int(np.flatnonzero(self.meta.role[:n] == QUESTION)[0])
        self.assertTrue(0 < q0 < n)
        with h5py.File(self.with_path) as f:
            self.assertEqual(f["aggregates/prompt_entropy_regions"].dtype, np.dtype("<i4"))
            self.assertEqual(list(f["aggregates/prompt_entropy_regions"][...]), [q0, n])
            h = int(f.attrs["num_heads"])
            for l in range(int(f.attrs["num_layers"])):
                e = f["aggregates/layer_%03d/prompt_entropies" % l]
                self.assertEqual((e.shape, e.dtype), ((2, 3, h), np.dtype("<f8")))
                self.assertTrue((e[...] > 0).all())  # multimodal prompt: every kind is a real entropy
        with h5py.File(self.without_path) as f:
            self.assertNotIn("prompt_entropy_regions", f["aggregates"])
            self.assertNotIn("prompt_entropies", f["aggregates/layer_000"])
        # The rule on hand-made role lists: no question, or a question from the first token: one region.
        self.assertEqual(list(entropies.regions([SYSTEM, CONTEXT, CONTEXT])), [3])
        self.assertEqual(list(entropies.regions([QUESTION, QUESTION])), [2])
        self.assertEqual(list(entropies.regions([SYSTEM, QUESTION, CONTEXT, QUESTION])), [1, 4])
        with self.assertRaises(CaptureError):
            entropies.regions([0, 7])

    def test_recorded_values_equal_kvsims_recomputation_in_every_bit(self):
        v = kvsim("validate", self.with_path)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        line = re.search(r"prompt_entropies vs recomputed.*", v.stdout)
        self.assertIsNotNone(line, v.stdout)
        self.assertRegex(line.group(0), r": 0 of [1-9][0-9]* values differ, max abs deviation 0 nats")
        # And through the Python reader: the stored (float16) Q/K as kvsim reads them, the same function.
        t = kv.Trace(self.with_path)
        regions = t.meta["prompt_entropy_regions"]
        n = t.meta["prefill_length"]
        modality = t.tokens["modality"].cat.codes.to_numpy()[:n]
        for l in range(t.meta["model"]["num_layers"]):
            layer = t.layer(l)
            q = layer.queries[:, :n]  # query_mode all: positions 0..
            again = entropies.layer_entropies(q, layer.keys[:, :n], modality, regions,
                                              t.meta["model"]["softmax_scale"], threads=1)
            self.assertTrue(np.array_equal(layer.prompt_entropies, again), l)
            with h5py.File(self.with_path) as f:
                self.assertTrue(np.array_equal(f["aggregates/layer_%03d/prompt_entropies" % l][...], again))

    def test_thread_count_does_not_change_values(self):
        t = kv.Trace(self.with_path)
        layer, n = t.layer(0), t.meta["prefill_length"]
        args = (layer.queries[:, :n], layer.keys[:, :n], t.tokens["modality"].cat.codes.to_numpy()[:n],
                t.meta["prompt_entropy_regions"], t.meta["model"]["softmax_scale"])
        self.assertTrue(np.array_equal(entropies.layer_entropies(*args, threads=1),
                                       entropies.layer_entropies(*args, threads=3)))

    def sweep(self, trace, question_mode="aware"):
        return strip_trace(kv.sweep(traces=[trace], policies=MEDA, budgets=BUDGETS, question_mode=question_mode,
                                    threads=2))

    def test_meda_is_bit_identical_with_and_without_recorded_entropies(self):
        for mode in ("aware", "agnostic"):
            a, b = self.sweep(self.with_path, mode), self.sweep(self.without_path, mode)
            self.assertEqual(len(a), len(MEDA) * len(BUDGETS))
            self.assertEqual(a, b, mode)

    def test_window_capture_replays_query_aware_meda(self):
        with h5py.File(self.window_path) as f:
            self.assertEqual(f["queries/positions"][0], int(f.attrs["prefill_length"]) - 4)
            self.assertIn("prompt_entropy_regions", f["aggregates"])
        v = kvsim("validate", self.window_path)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("prompt_entropies recorded but not checkable", v.stdout)
        # Same model run, same K/V and column sums: the window trace's MEDA equals the all-queries trace's.
        self.assertEqual(self.sweep(self.window_path), self.sweep(self.with_path))
        with h5py.File(self.window_path) as f, h5py.File(self.with_path) as g:
            for l in range(int(f.attrs["num_layers"])):
                name = "aggregates/layer_%03d/prompt_entropies" % l
                self.assertTrue(np.array_equal(f[name][...], g[name][...]))
        # Without the entropies the same window trace is refused by query-aware MEDA (the record is what helps).
        path = self.path("window_without.h5")
        run(self.m, path, CaptureOptions(query_window=4, prompt_entropies=False))
        r = kvsim("run", "--trace", path, "--policy", "meda", "--budget", "0.2", "--out", self.path("x.json"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("record prompt entropies", r.stderr)

    # --------------------------------------------------------------------------------------------- bad values
    def write(self, name, regions, values_of_layer):
        """A 2-layer float32 trace of random tensors with the given regions and per-layer entropies."""
        n, steps, h, hkv, d = 6, 2, 2, 1, 4
        t = n + steps
        rng = np.random.default_rng(0)
        attrs = dict(model_name="x", model_family="llama", num_layers=2, num_heads=h, num_kv_heads=hkv,
                     head_dim=d, softmax_scale=0.5, causal=1, sliding_window=0, logit_softcap=0.0, rope_theta=1e4,
                     model_dtype="float32", storage_dtype="float32", prefill_length=n, num_decode_steps=steps,
                     source="captured", generator="test", generator_version="0")
        tokens = dict(modality=np.zeros(t), segment_id=np.zeros(t), patch_row=-np.ones(t), patch_col=-np.ones(t),
                      position_id=np.arange(t), role=np.r_[np.ones(n - 2), [2, 2], [3] * steps],
                      token_id=np.arange(t))
        path = self.path(name)
        with TraceWriter(path) as w:
            w.begin(attrs, tokens, np.arange(t), prompt_entropy_regions=regions)
            for l in range(2):
                kv_ = rng.standard_normal((hkv, t, d))
                w.write_layer(l, kv_, kv_, rng.standard_normal((h, t, d)), prompt_entropies=values_of_layer(l))
            w.finish()
        return path

    def assert_refused(self, regions, values_of_layer, *words):
        with self.assertRaises(CaptureError) as cm:
            self.write("bad.h5", regions, values_of_layer)
        msg = str(cm.exception)
        self.assertNotIn("\n", msg)
        for w in words:
            self.assertIn(w, msg)
        self.assertEqual([f for f in os.listdir(self.tmp.name) if f.startswith("bad.h5")], [])

    def test_bad_values_and_regions_are_refused_with_no_file(self):
        ok = lambda l: np.full((2, 3, 2), 0.5)  # noqa: E731
        path = self.write("good.h5", [4, 6], ok)
        t = kv.Trace(path)  # the reader accepts what the writer accepted
        self.assertEqual(list(t.meta["prompt_entropy_regions"]), [4, 6])
        self.assertTrue((t.layer(1).prompt_entropies == 0.5).all())
        # In range but not what the tensors give: kvsim validate recomputes them and says so.
        v = kvsim("validate", path)
        self.assertNotEqual(v.returncode, 0)
        self.assertIn("prompt_entropies vs recomputed from Q/K (HeadPromptEntropies): 24 of 24 values differ", v.stdout)
        for bad, where in ((np.nan, "nan"), (-0.01, "-0.01"), (np.log(4) * 1.001, "log(compress_end)")):
            def values(l, bad=bad):
                v = np.full((2, 3, 2), 0.5)
                v[0, 1, 1] = bad if l == 1 else 0.5
                return v
            self.assert_refused([4, 6], values, "layer 1", "prompt_entropies", where)
        # log(6) is fine for the whole prompt, not for the region ce = 4.
        self.write("edge.h5", [4, 6], lambda l: np.concatenate([np.full((1, 3, 2), np.log(4)),
                                                                np.full((1, 3, 2), np.log(6))]))
        self.assert_refused([4, 6], lambda l: np.full((2, 3, 3), 0.5), "shape", "num_heads=2")
        self.assert_refused([4, 6], lambda l: None if l == 1 else ok(l), "layer 1 lacks prompt_entropies")
        self.assert_refused(None, ok, "has prompt_entropies")
        self.assert_refused([6, 4], ok, "ascending")
        self.assert_refused([0, 6], ok, "[1, prefill_length = 6]")
        self.assert_refused([4, 7], ok, "[1, prefill_length = 6]")

    def test_missing_extension_fails_before_the_run_naming_the_flag(self):
        # A .pth file of scripts/setup_python.sh may put kvsim on the path: hide it as a missing package is hidden.
        code = ("import sys\nsys.modules['kvsim'] = None\nimport kvsim_capture as c\n"
                "c.CaptureOptions(prompt_entropies=False).validate()\n"
                "try:\n    c.CaptureOptions().validate()\n"
                "except c.MissingDependencyError as e:\n    print('REFUSED', e)\n")
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "traces", "capture"))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("REFUSED", r.stdout)
        self.assertIn("--no-prompt-entropies", r.stdout)
        self.assertIn("kvsim_python", r.stdout)
        self.assertTrue(issubclass(MissingDependencyError, CaptureError))

    def test_command_line_flag(self):
        from kvsim_capture.cli import build_dataset_parser, build_parser
        for p, extra in ((build_parser(), ["--prompt", "x"]), (build_dataset_parser(), ["--items", "i"])):
            a = p.parse_args(["--model", "m", "--out", "o"] + extra)
            self.assertFalse(a.no_prompt_entropies)
            self.assertTrue(p.parse_args(["--model", "m", "--out", "o", "--no-prompt-entropies"] + extra)
                            .no_prompt_entropies)


if __name__ == "__main__":
    unittest.main()
