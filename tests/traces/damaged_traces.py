#!/usr/bin/env python3
"""Mutation campaign against the trace reader through the kvsim CLI (issue 18; docs/hardening.md).

Writes a small trace with `kvsim synth` (checksummed, as kvsim writes them) and a legacy copy of it (HDF5
superblock v0, variable-length strings, no Fletcher32: what kvsim wrote before), then runs
`kvsim validate` on COUNT randomly damaged copies of each (1-8 random bytes overwritten, in the metadata
region or anywhere; seeded) and classifies every outcome. A crash (signal), a hang (timeout) or an error that
is not exactly one line fails the campaign.

Usage: damaged_traces.py KVSIM [--count N] [--seed S] [--unguarded] [--keep DIR]
  --unguarded  run with KVSIM_TRACE_GUARD=0 (shows what the guarded open protects against; not a test)
"""
import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile

import h5py

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def legacy_copy(src, dst):
    """The same trace as kvsim wrote it before checksums: earliest format, variable-length strings."""
    with h5py.File(src, "r") as s, h5py.File(dst, "w", libver="earliest") as d:
        def attrs(a, b):
            for k, v in a.attrs.items():
                b.attrs[k] = v.decode("utf-8") if isinstance(v, bytes) else v

        def visit(name, obj):
            attrs(obj, d.require_group(name) if isinstance(obj, h5py.Group) else d.create_dataset(name, data=obj[...]))
        attrs(s, d)
        s.visititems(visit)


def campaign(kvsim, trace, count, rng, env, keep, tag):
    data = open(trace, "rb").read()
    outcomes = collections.Counter()
    failures = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.h5")
        for i in range(count):
            m = bytearray(data)
            region = len(m) if i % 2 else min(len(m), 16384)  # half the copies: the metadata-dense start
            for _ in range(rng.randint(1, 8)):
                m[rng.randrange(region)] = rng.randrange(256)
            open(path, "wb").write(m)
            try:
                p = subprocess.run([kvsim, "validate", path], capture_output=True, timeout=60, env=env)
                rc = p.returncode
                lines = len(p.stderr.splitlines())
                try:
                    msg = p.stderr.decode("utf-8")
                    if any(not (c.isprintable() or c == "\n") for c in msg):
                        rc = "unprintable"
                except UnicodeDecodeError:
                    rc, msg = "non-UTF-8", p.stderr.decode("utf-8", "backslashreplace")
            except subprocess.TimeoutExpired:
                rc, lines = "hang", 0
            kind = ("ok" if rc == 0 else "mismatch (exit 3)" if rc == 3 else "one-line error" if rc == 1 and lines == 1
                    else "signal %d" % -rc if isinstance(rc, int) and rc < 0 else rc if isinstance(rc, str)
                    else "exit %s, %d lines" % (rc, lines))
            outcomes[kind] += 1
            if kind not in ("ok", "mismatch (exit 3)", "one-line error"):
                failures.append((i, kind + ("" if kind in ("hang",) or kind.startswith("signal") else ": " + msg.strip()[:300])))
                if keep:
                    open(os.path.join(keep, "%s_%d.h5" % (tag, i)), "wb").write(m)
    return outcomes, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kvsim")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--unguarded", action="store_true")
    ap.add_argument("--keep", help="folder for the copies that failed")
    a = ap.parse_args()
    env = dict(os.environ, KVSIM_TRACE_GUARD="0" if a.unguarded else "1", KVSIM_TRACE_GUARD_TIMEOUT="10")
    rng = random.Random(a.seed)
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        trace, legacy = os.path.join(d, "t.h5"), os.path.join(d, "legacy.h5")
        subprocess.run([a.kvsim, "synth", "--config", os.path.join(SRC, "configs/synth/tiny.textproto"), "--out", trace],
                       check=True, capture_output=True)
        legacy_copy(trace, legacy)
        for tag, path in (("checksummed", trace), ("legacy", legacy)):
            outcomes, failures = campaign(a.kvsim, path, a.count, rng, env, a.keep, tag)
            print("%-11s %d damaged copies (%d bytes): %s" % (tag, a.count, os.path.getsize(path),
                  ", ".join("%s %d" % kv for kv in sorted(outcomes.items()))))
            for i, kind in failures[:10]:
                print("  copy %d: %s" % (i, kind))
            bad += len(failures)
    print("guard %s: %s" % ("off" if a.unguarded else "on", "FAILED: %d crashes, hangs or messy errors" % bad if bad else "no crash, hang or multi-line error"))
    return 1 if bad and not a.unguarded else 0


if __name__ == "__main__":
    sys.exit(main())
