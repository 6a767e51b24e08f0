#!/usr/bin/env python3
"""Checks that two `kvsim sweep` output folders hold the same results, field by field.

Compares runs.csv, layers.csv, aggregates.csv (when present) and results.json exactly (every field as
text / JSON value); only `git_commit` may differ. Used for the
engine's bit-identity rule (issue 14): old and new binaries sweep the same experiment, then

    bench/compare_sweeps.py OLD_DIR NEW_DIR

prints what differs (file, row, field, old, new) and exits 1, or prints "identical" and exits 0.
"""
import csv
import json
import sys
from pathlib import Path

IGNORED = {"git_commit"}


def compare_csv(a: Path, b: Path, diffs: list) -> None:
    with a.open(newline="") as fa, b.open(newline="") as fb:
        ra, rb = list(csv.DictReader(fa)), list(csv.DictReader(fb))
    if len(ra) != len(rb):
        diffs.append(f"{a.name}: {len(ra)} rows vs {len(rb)}")
        return
    for i, (x, y) in enumerate(zip(ra, rb)):
        if x.keys() != y.keys():
            diffs.append(f"{a.name}: row {i + 1}: columns differ")
            continue
        for k in x:
            if k not in IGNORED and x[k] != y[k]:
                diffs.append(f"{a.name}: row {i + 1} ({x.get('label', '')}): {k}: {x[k]} vs {y[k]}")


def compare_json(x, y, where: str, diffs: list) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if k in IGNORED:
                continue
            if k not in x or k not in y:
                diffs.append(f"{where}.{k}: present in one only")
            else:
                compare_json(x[k], y[k], f"{where}.{k}", diffs)
    elif isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            diffs.append(f"{where}: {len(x)} items vs {len(y)}")
        for i, (u, v) in enumerate(zip(x, y)):
            compare_json(u, v, f"{where}[{i}]", diffs)
    elif x != y or type(x) is not type(y):
        diffs.append(f"{where}: {x!r} vs {y!r}")


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: compare_sweeps.py OLD_DIR NEW_DIR", file=sys.stderr)
        return 2
    old, new = Path(sys.argv[1]), Path(sys.argv[2])
    diffs: list = []
    for name in ("runs.csv", "layers.csv", "aggregates.csv"):
        if (old / name).exists() or (new / name).exists():
            if not ((old / name).exists() and (new / name).exists()):
                diffs.append(f"{name}: present in one folder only")
            else:
                compare_csv(old / name, new / name, diffs)
    compare_json(json.loads((old / "results.json").read_text()), json.loads((new / "results.json").read_text()),
                 "results.json", diffs)
    for d in diffs[:50]:
        print(d)
    if diffs:
        print(f"{len(diffs)} differences")
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
