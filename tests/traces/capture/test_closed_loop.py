"""Closed loop on the real SmolLM2-135M-Instruct: the replay's plans re-run in the model (docs/closed-loop.md).

A float32 passkey trace (~512 prompt tokens, 16 generated) is captured once; plans come from `kvsim gpu-plan`
(and hand-edited copies of them). Checked: layer 0's closed-loop error equals kvsim's replay error for the same
plan; the `full` plan gives KL 0 and the same tokens; evicting the needle fails the passkey task while keeping
it succeeds; a merged plan changes layer 0's output exactly as substituting its K/V by hand; bad plans are
refused with one line and no output.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np
import torch

from kvsim_capture import CaptureOptions, closed_loop as cl, hf

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVSIM = os.environ.get("KVSIM_BIN", os.path.join(REPO, "build", "kvsim"))
# The capture package, the kvsim package and its extension (prompt entropies), as scripts/kvsim-capture sets them.
CAPTURE_PYTHONPATH = os.pathsep.join([os.path.join(REPO, "traces", "capture"), os.path.join(REPO, "python"),
                                      os.path.join(os.path.dirname(os.path.abspath(KVSIM)), "python")])
NEW_TOKENS = 16


def kvsim(*args):
    r = subprocess.run([KVSIM, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError("kvsim %s failed: %s" % (" ".join(args), r.stderr))
    return r


def cli(*args):
    env = dict(os.environ, PYTHONPATH=CAPTURE_PYTHONPATH, HF_HUB_OFFLINE="1",
               KVSIM_BIN=KVSIM)
    return subprocess.run([sys.executable, "-m", "kvsim_capture", *args], capture_output=True, text=True, env=env,
                          timeout=600)


class ClosedLoopSmolLM2(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(KVSIM):
            raise unittest.SkipTest("kvsim binary not found at %s (build it, or set KVSIM_BIN)" % KVSIM)
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvsim_closed_loop_")
        cls.model, cls.tok = hf.load("smollm2", progress=False)
        cls.trace = os.path.join(cls.tmp, "pk.h5")
        _, cls.task, answered = hf.capture_passkey(cls.model, cls.tok, cls.trace, 512, 0.5, 0, NEW_TOKENS,
                                                   CaptureOptions(all_queries=True, storage_dtype="float32"))
        assert answered, "the full-cache model must answer the passkey at 512 tokens"
        cls.plans = {}
        for name, policy, extra in (("full", "full", ()), ("snapkv", "snapkv", ()), ("merged", "snapkv+average", ()),
                                    ("h2o", "h2o", ())):
            pb = os.path.join(cls.tmp, name + ".pb")
            kvsim("gpu-plan", "--trace", cls.trace, "--policy", policy, "--budget", "0.2", "--out", pb,
                  "--result", cl.result_path(pb), *extra)
            cls.plans[name] = pb
        cls.info = cl.read_trace_info(cls.trace)
        cls.loop = cl.ClosedLoop(cls.model, cls.tok, cls.info)
        cls.results = {}
        names = list(cls.plans)
        for name, res in zip(names, cls.loop.run_plans([cl.read_plan(cls.plans[n]) for n in names])):
            cls.results[name] = res

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(getattr(cls, "tmp", "/nonexistent"), ignore_errors=True)

    def replay(self, name):
        with open(cl.result_path(self.plans[name])) as f:
            return json.load(f)

    def test_layer0_error_equals_the_replay_error(self):
        for name in ("snapkv", "merged", "h2o"):
            ours = self.results[name]["teacher_forced"]["layer_output_rel_error"][0]
            theirs = self.replay(name)["layers"][0]["metrics"]["output_rel_error_mean"]
            self.assertGreater(theirs, 1e-3, name)  # the plan really compresses
            self.assertAlmostEqual(ours, theirs, delta=1e-5 * max(1.0, theirs), msg=name)

    def test_error_grows_past_layer0_and_the_model_notices(self):
        tf = self.results["snapkv"]["teacher_forced"]
        self.assertGreater(tf["kl_mean"], 1e-3)
        self.assertLess(tf["top1_agreement"], 1.0 + 1e-12)
        self.assertEqual(len(tf["layer_output_rel_error"]), 30)

    def test_full_plan_gives_kl_zero_and_identical_tokens(self):
        r = self.results["full"]
        self.assertLess(r["teacher_forced"]["kl_mean"], 1e-9)
        self.assertEqual(r["teacher_forced"]["top1_agreement"], 1.0)
        # Not bit-zero: the plans run batched, and a batch of another size takes other GEMM kernels (~1e-6).
        self.assertLess(max(r["teacher_forced"]["layer_output_rel_error"]), 1e-5)
        self.assertTrue(r["free_running"]["identical"])
        self.assertTrue(r["free_running"]["passkey_found"])
        self.assertEqual(r["free_running"]["tokens"], self.loop.reference.greedy)

    def test_decode_evicting_plans_are_teacher_forced_only(self):
        fr = self.results["h2o"]["free_running"]
        self.assertFalse(fr["supported"])
        self.assertIn("not re-run online", fr["reason"])

    def _edited_full_plan(self, drop):
        plan = cl.read_plan(self.plans["full"])
        for h in plan.heads:
            keep = [a for a in h.slots if a not in drop]
            del h.slots[:]
            h.slots.extend(keep)
        return plan

    def test_evicting_the_needle_fails_the_task_keeping_it_succeeds(self):
        a, b = self.info.needle_tokens
        needle = set(range(a, b))
        # The same number of other context tokens evicted, far from the needle: the task still succeeds.
        others = set(range(a - 3 * len(needle), a - 2 * len(needle)))
        evicted, kept = self.loop.run_plans([self._edited_full_plan(needle), self._edited_full_plan(others)])
        self.assertTrue(evicted["free_running"]["supported"])
        self.assertFalse(evicted["free_running"]["passkey_found"], evicted["free_running"]["text"])
        self.assertTrue(kept["free_running"]["passkey_found"], kept["free_running"]["text"])

    def test_merged_plan_changes_outputs_exactly_as_substituting_by_hand(self):
        plan = cl.read_plan(self.plans["merged"])
        self.assertGreater(sum(len(h.merges) for h in plan.heads), 0)
        row = cl._Row(plan, "tf", self.info)
        self.loop._run_rows([row])
        got = row.outputs[0][0]  # step 0, layer 0: [H, d]
        n, g = self.info.n, self.info.num_heads // self.info.num_kv_heads
        with h5py.File(self.trace, "r") as f:
            keys = torch.from_numpy(f["layers/layer_000/keys"][...])
            values = torch.from_numpy(f["layers/layer_000/values"][...])
            queries = torch.from_numpy(f["layers/layer_000/queries"][...])
            scale = float(f.attrs["softmax_scale"])
            positions = f["queries/positions"][...]
        qi = int(np.flatnonzero(positions == n)[0])
        for kv in range(self.info.num_kv_heads):
            hp = plan.heads[kv]  # layer 0
            anchors = list(hp.slots) + [a for a in hp.steps[0].before_attention.added]
            k = keys[kv, anchors].clone()
            v = values[kv, anchors].clone()
            for mg in hp.merges:  # the plan's merged key/value replace the anchor's, by hand
                i = anchors.index(mg.anchor)
                k[i] = torch.tensor(list(mg.key))
                v[i] = torch.tensor(list(mg.value))
            for j in range(g):
                q = queries[kv * g + j, qi]
                want = torch.softmax((k @ q) * scale, 0) @ v
                torch.testing.assert_close(got[kv * g + j], want, rtol=1e-5, atol=1e-6)

    # ------------------------------------------------------------------------------------- bad plans
    def refused(self, plan_path, *words):
        out = os.path.join(self.tmp, "out_" + os.path.basename(plan_path))
        r = cli("closed-loop", "--model", "smollm2", "--trace", self.trace, "--plan", plan_path, "--out", out)
        self.assertEqual(r.returncode, 1, r.stderr)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        for w in words:
            self.assertIn(w, lines[0])
        self.assertFalse(os.path.exists(out))

    def _write_edited(self, name, edit):
        plan = cl.read_plan(self.plans["snapkv"])
        edit(plan)
        path = os.path.join(self.tmp, name + ".pb")
        with open(path, "wb") as f:
            f.write(plan.SerializeToString())
        shutil.copy(cl.result_path(self.plans["snapkv"]), cl.result_path(path))
        return path

    def test_bad_plans_are_refused_with_one_line(self):
        def wrong_hash(p):
            p.trace_hash = "0123456789abcdef"
        self.refused(self._write_edited("hash", wrong_hash), "another trace")

        def wrong_layers(p):
            p.model.num_layers = 29
        self.refused(self._write_edited("layers", wrong_layers), "layers")

        def out_of_range(p):
            p.heads[5].slots.append(99999)
        self.refused(self._write_edited("range", out_of_range), "out of range")

        junk = os.path.join(self.tmp, "junk.pb")
        with open(junk, "wb") as f:
            f.write(b"\xff\xfe not a plan")
        self.refused(junk, "not a kvsim GPU plan")

        missing_result = os.path.join(self.tmp, "noresult.pb")
        shutil.copy(self.plans["snapkv"], missing_result)
        self.refused(missing_result, "replay result is missing")

    def test_report_files(self):
        out = os.path.join(self.tmp, "report")
        rep = cl.run_closed_loop(self.model, self.tok, self.trace, [self.plans["full"], self.plans["snapkv"],
                                                                     self.plans["h2o"]], out, KVSIM,
                                 model_name="SmolLM2")
        for f in ("closed_loop.json", "closed_loop.csv", "summary.md", "closed_loop.png"):
            self.assertTrue(os.path.getsize(os.path.join(out, f)) > 0, f)
        self.assertEqual(len(rep["runs"]), 3)
        with open(os.path.join(out, "summary.md")) as f:
            md = f.read()
        self.assertIn("Real model run, measured", md)
        self.assertIn("Spearman", md)
        with open(os.path.join(out, "closed_loop.csv")) as f:
            header = f.readline().strip().split(",")
        self.assertEqual(header, ["label", "policy", "budget_fraction", "budget_tokens", "source", "metric", "layer",
                                  "value"])


class Spearman(unittest.TestCase):
    def test_hand_cases(self):
        from kvsim_capture import closed_loop_report as rep
        self.assertAlmostEqual(rep.spearman([1, 2, 3, 4], [10, 20, 30, 40]), 1.0)
        self.assertAlmostEqual(rep.spearman([1, 2, 3, 4], [4, 3, 2, 1]), -1.0)
        # ties share ranks: x ranks 0.5 0.5 2 3; y ranks 0 1 2 3 -> Pearson of those
        x, y = np.array([0.5, 0.5, 2, 3]), np.array([0, 1, 2, 3.0])
        want = np.corrcoef(x, y)[0, 1]
        self.assertAlmostEqual(rep.spearman([1, 1, 2, 3], [5, 6, 7, 8]), want)
        self.assertIsNone(rep.spearman([1, 2], [3, 4]))
        self.assertIsNone(rep.spearman([1, 1, 1], [1, 2, 3]))
        self.assertAlmostEqual(rep.spearman([1, None, 2, 3], [1, 5, 2, 3]), 1.0)


if __name__ == "__main__":
    unittest.main()
