#!/usr/bin/env python3
"""Checks that two `kvsim sweep` output folders hold bit-identical results (issue 14's rule for every
performance change): runs.csv, layers.csv, aggregates.csv and results.json must be equal field by field,
except `git_commit`. Prints the first differences and exits 1 if any.

Usage: bench/compare_sweeps.py OLD_DIR NEW_DIR [OLD_DIR2 NEW_DIR2 ...]
"""
import csv
import json
import os
import sys

IGNORED = {"git_commit"}


def compare_csv(a, b, name, out):
    with open(a, newline="") as fa, open(b, newline="") as fb:
        ra, rb = list(csv.DictReader(fa)), list(csv.DictReader(fb))
    if len(ra) != len(rb):
        out.append(f"{name}: {len(ra)} rows vs {len(rb)}")
        return
    for i, (x, y) in enumerate(zip(ra, rb)):
        if set(x) != set(y):
            out.append(f"{name}: row {i}: columns differ: {sorted(set(x) ^ set(y))}")
            continue
        for k in x:
            if k not in IGNORED and x[k] != y[k]:
                out.append(f"{name}: row {i} ({x.get('label', '')} {x.get('budget_fraction', '')}) {k}: "
                           f"{x[k]!r} vs {y[k]!r}")


def compare_json(x, y, path, out):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k in IGNORED:
                continue
            if k not in x or k not in y:
                out.append(f"results.json{path}.{k}: only in {'new' if k not in x else 'old'}")
            else:
                compare_json(x[k], y[k], f"{path}.{k}", out)
    elif isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            out.append(f"results.json{path}: length {len(x)} vs {len(y)}")
        for i, (u, v) in enumerate(zip(x, y)):
            compare_json(u, v, f"{path}[{i}]", out)
    elif x != y or type(x) is not type(y):
        out.append(f"results.json{path}: {x!r} vs {y!r}")


def main(argv):
    if len(argv) < 3 or len(argv) % 2 == 0:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    bad = 0
    for old, new in zip(argv[1::2], argv[2::2]):
        diffs = []
        for name in ("runs.csv", "layers.csv", "aggregates.csv", "results.json"):
            a, b = os.path.join(old, name), os.path.join(new, name)
            if not os.path.exists(a) or not os.path.exists(b):
                if os.path.exists(a) != os.path.exists(b):
                    diffs.append(f"{name}: present in only one folder")
                continue
            if name.endswith(".csv"):
                compare_csv(a, b, name, diffs)
            else:
                with open(a) as fa, open(b) as fb:
                    compare_json(json.load(fa), json.load(fb), "", diffs)
        if diffs:
            bad = 1
            print(f"{old} vs {new}: {len(diffs)} differences")
            for d in diffs[:20]:
                print("  " + d)
        else:
            print(f"{old} vs {new}: identical (every field but {', '.join(sorted(IGNORED))})")
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv))
