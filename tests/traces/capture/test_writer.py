"""TraceWriter: complete-or-absent files and ordering checks."""
import os
import subprocess
import tempfile
import unittest

import capture_util  # noqa: F401 (skips without torch)
import h5py
import numpy as np

from kvsim_capture import CaptureError, TraceWriter

ATTRS = dict(model_name="m", model_family="llama", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
             softmax_scale=0.5, causal=1, sliding_window=0, logit_softcap=0.0, rope_theta=1e4,
             model_dtype="float32", storage_dtype="float32", prefill_length=3, num_decode_steps=1,
             source="captured", generator="test", generator_version="0")
TOKENS = dict(modality=[0] * 4, segment_id=[0] * 4, patch_row=[-1] * 4, patch_col=[-1] * 4,
              position_id=range(4), role=[1, 1, 1, 3], token_id=[5] * 4)


def legacy_copy(src, dst):
    """`src` as kvsim wrote traces before checksums: earliest file format, variable-length strings, no filters."""
    with h5py.File(src, "r") as s, h5py.File(dst, "w", libver="earliest") as d:
        def copy_attrs(a, b):
            for k, v in a.attrs.items():
                b.attrs[k] = v.decode("utf-8") if isinstance(v, bytes) else v  # str: variable-length

        def visit(name, obj):
            copy_attrs(obj, d.require_group(name) if isinstance(obj, h5py.Group) else d.create_dataset(name, data=obj[...]))
        copy_attrs(s, d)
        s.visititems(visit)


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

    def test_trace_is_checksummed_and_damage_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.h5")
            kv = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
            q = np.ones((2, 4, 4), np.float32)
            with TraceWriter(path) as w:
                w.begin(ATTRS, dict(TOKENS, text=["a", "bé", "", "xyz"]), range(4))
                w.write_layer(0, kv, kv, q)
                w.write_layer(1, kv, kv, q)
                w.finish()
            with h5py.File(path, "r") as f:
                self.assertGreaterEqual(f.id.get_create_plist().get_version()[0], 2)  # checksummed superblock
                self.assertEqual(f["tokens/text"].dtype.kind, "S")  # fixed-length, no global heap
                self.assertEqual(f["tokens/text"][1].decode("utf-8"), "bé")
                for name in ("tokens/role", "layers/layer_001/keys", "queries/positions"):
                    self.assertTrue(f[name].fletcher32, name)
                self.assertFalse(h5py.check_string_dtype(f.attrs.get_id("model_name").dtype).length is None)
                offset = f["layers/layer_001/values"].id.get_chunk_info(0).byte_offset
            r = capture_util.kvsim("validate", path)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("integrity: checksummed", r.stdout)
            data = bytearray(open(path, "rb").read())
            data[offset + 5] ^= 0x10
            bad = os.path.join(d, "bad.h5")
            open(bad, "wb").write(data)
            r = capture_util.kvsim("validate", bad)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("/layers/layer_001/values' fails its checksum", r.stderr)
            self.assertEqual(r.stderr.count("\n"), 1, r.stderr)

    def test_legacy_trace_without_checksums_still_opens(self):
        # A trace as kvsim wrote them before checksums: earliest file format, variable-length strings, no
        # filters. It must still replay; validate says it is not protected.
        with tempfile.TemporaryDirectory() as d:
            path, legacy = os.path.join(d, "t.h5"), os.path.join(d, "legacy.h5")
            kv, q = np.ones((1, 4, 4), np.float32), np.ones((2, 4, 4), np.float32)
            with TraceWriter(path) as w:
                w.begin(ATTRS, TOKENS, range(4))
                w.write_layer(0, kv, kv, q)
                w.write_layer(1, kv, kv, q)
                w.finish()
            legacy_copy(path, legacy)
            r = capture_util.kvsim("validate", legacy)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("integrity: NOT fully checksummed (HDF5 superblock v0, Fletcher32 on 0 of", r.stdout)
            out = os.path.join(d, "r.json")
            r = capture_util.kvsim("run", "--trace", legacy, "--policy", "streaming_llm", "--budget", "0.5",
                                   "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)

    def test_guarded_open_turns_a_library_crash_into_one_line(self):
        # A legacy trace (variable-length strings in HDF5's unchecksummed global heap) whose heap object for
        # model_name claims a length of ~10^14 bytes: HDF5 1.10 crashes reading it. kvsim reads every file's
        # metadata first in a guarded child process, so this is a one-line error, not a crash.
        with tempfile.TemporaryDirectory() as d:
            path, legacy = os.path.join(d, "t.h5"), os.path.join(d, "legacy.h5")
            kv, q = np.ones((1, 4, 4), np.float32), np.ones((2, 4, 4), np.float32)
            with TraceWriter(path) as w:
                w.begin(dict(ATTRS, model_name="guarded-open-model"), TOKENS, range(4))
                w.write_layer(0, kv, kv, q)
                w.write_layer(1, kv, kv, q)
                w.finish()
            legacy_copy(path, legacy)
            data = bytearray(open(legacy, "rb").read())
            at = data.find(b"guarded-open-model")
            self.assertGreater(at, 0)
            self.assertEqual(data[at - 8], len("guarded-open-model"))  # the heap object's 8-byte length
            data[at - 3] = 0x58
            open(legacy, "wb").write(data)
            env = dict(os.environ, KVSIM_TRACE_GUARD="0")
            unguarded = subprocess.run([capture_util.KVSIM, "validate", legacy], capture_output=True, env=env)
            r = capture_util.kvsim("validate", legacy)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertEqual(r.stderr.count("\n"), 1, r.stderr)
            if unguarded.returncode < 0:  # this HDF5 does crash: the guard is what turned it into an error
                # (Segmentation fault; Aborted under AddressSanitizer, which reports the crash and aborts)
                self.assertRegex(r.stderr, r"the HDF5 library crashed \((Segmentation fault|Aborted)\) reading the "
                                           r"file's metadata in a guarded process")


if __name__ == "__main__":
    unittest.main()
