#!/usr/bin/env python3
"""Checks that two `kvsim sweep` output folders hold the same results: runs.csv, layers.csv, aggregates.csv
and results.json are compared field by field, except `git_commit`.

Without --rtol the results must be bit-identical (issue 14's rule for every performance change): prints
the first differences and exits 1 if any.

With --rtol R, numbers may differ by a relative difference |a - b| / max(|a|, |b|) of at most R (a change
that sums in another order); every other field must still be equal. Prints, per field that differs, the
largest relative difference and where it is, and which runs (label and budget) differ at all; exits 1
if any difference exceeds R or is not numeric.

Usage: bench/compare_sweeps.py [--rtol R] OLD_DIR NEW_DIR [OLD_DIR2 NEW_DIR2 ...]
"""
import argparse
import csv
import json
import math
import os
import re
import sys

IGNORED = {"git_commit"}


def as_number(x):
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def rel_diff(x, y):
    """Relative difference of two values, or None if either is not a number."""
    a, b = as_number(x), as_number(y)
    if a is None or b is None:
        return None
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 and math.isfinite(scale) else math.inf


class Diffs:
    """Exact differences (messages) and, with a tolerance, the numeric ones per field."""

    def __init__(self, rtol):
        self.rtol = rtol
        self.messages = []    # differences that fail
        self.worst = {}       # field -> (max relative difference, where)
        self.runs = set()     # runs (label budget) with any difference

    def add(self, field, where, x, y, run=None):
        if run is not None:
            self.runs.add(run)
        r = rel_diff(x, y) if self.rtol is not None else None
        if r is None:
            self.messages.append(f"{where}: {x!r} vs {y!r}")
            return
        if field not in self.worst or r > self.worst[field][0]:
            self.worst[field] = (r, f"{where}: {x!r} vs {y!r}")
        if r > self.rtol:
            self.messages.append(f"{where}: {x!r} vs {y!r} (relative {r:.3g} > {self.rtol:g})")


def compare_csv(a, b, name, out):
    with open(a, newline="") as fa, open(b, newline="") as fb:
        ra, rb = list(csv.DictReader(fa)), list(csv.DictReader(fb))
    if len(ra) != len(rb):
        out.messages.append(f"{name}: {len(ra)} rows vs {len(rb)}")
        return
    for i, (x, y) in enumerate(zip(ra, rb)):
        if set(x) != set(y):
            out.messages.append(f"{name}: row {i}: columns differ: {sorted(set(x) ^ set(y))}")
            continue
        run = f"{x.get('label', '')} {x.get('budget_fraction', '')}".strip()
        for k in x:
            if k not in IGNORED and x[k] != y[k]:
                out.add(f"{name}:{k}", f"{name}: row {i} ({run}) {k}", x[k], y[k], run)


def compare_json(x, y, path, out, run=None):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k in IGNORED:
                continue
            if k not in x or k not in y:
                out.messages.append(f"results.json{path}.{k}: only in {'new' if k not in x else 'old'}")
            else:
                compare_json(x[k], y[k], f"{path}.{k}", out, run)
    elif isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            out.messages.append(f"results.json{path}: length {len(x)} vs {len(y)}")
        for i, (u, v) in enumerate(zip(x, y)):
            if path == ".runs" and isinstance(u, dict):  # a run: name it as runs.csv does
                run = f"{u.get('label', '')} {u.get('budget_fraction', '')}".strip()
            compare_json(u, v, f"{path}[{i}]", out, run)
    elif x != y or type(x) is not type(y):
        if type(x) is not type(y) and out.rtol is None:
            out.messages.append(f"results.json{path}: {x!r} vs {y!r}")
        else:
            out.add("results.json:" + re.sub(r"\[\d+\]", "[]", path), f"results.json{path}", x, y, run)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     usage="%(prog)s [--rtol R] OLD_DIR NEW_DIR [OLD_DIR2 NEW_DIR2 ...]")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest relative difference allowed for numbers (default: bit-identical)")
    parser.add_argument("dirs", nargs="+")
    args = parser.parse_args(argv[1:])
    if len(args.dirs) % 2 or (args.rtol is not None and not args.rtol >= 0):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    bad = 0
    for old, new in zip(args.dirs[0::2], args.dirs[1::2]):
        diffs = Diffs(args.rtol)
        for name in ("runs.csv", "layers.csv", "aggregates.csv", "results.json"):
            a, b = os.path.join(old, name), os.path.join(new, name)
            if not os.path.exists(a) or not os.path.exists(b):
                if os.path.exists(a) != os.path.exists(b):
                    diffs.messages.append(f"{name}: present in only one folder")
                continue
            if name.endswith(".csv"):
                compare_csv(a, b, name, diffs)
            else:
                with open(a) as fa, open(b) as fb:
                    compare_json(json.load(fa), json.load(fb), "", diffs)
        if diffs.messages:
            bad = 1
            print(f"{old} vs {new}: {len(diffs.messages)} differences"
                  + ("" if args.rtol is None else f" beyond relative {args.rtol:g}"))
            for d in diffs.messages[:20]:
                print("  " + d)
        elif not diffs.worst:
            print(f"{old} vs {new}: identical (every field but {', '.join(sorted(IGNORED))})")
        else:
            print(f"{old} vs {new}: equal within relative {args.rtol:g} "
                  f"(max {max(r for r, _ in diffs.worst.values()):.3g})")
        if diffs.worst:
            print(f"  max relative difference per field ({len(diffs.worst)} fields differ):")
            for field, (r, where) in sorted(diffs.worst.items(), key=lambda kv: -kv[1][0]):
                print(f"    {r:.3g}  {field}  ({where})")
            if diffs.runs:
                print(f"  runs that differ (label, budget): {', '.join(sorted(diffs.runs))}")
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv))
