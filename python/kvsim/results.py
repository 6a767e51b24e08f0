"""kvsim.load_results / kvsim.to_frame: results as tidy pandas DataFrames.

The source is always the JSON the engine writes (results.json of `kvsim sweep`, result.json of `kvsim run`,
or the dicts kvsim.run / kvsim.sweep return): every field of results.proto, one row per observation, one
column per variable. Column names are results.proto's field names; nested messages are flattened (a run's
`metrics` without a prefix, `latency.X` as `latency_X`, `kept_tokens_by_modality.text` as
`kept_tokens_by_modality_text`, a policy statistic as `stat_<name>`). Definitions: docs/metrics.md; streaming
results: docs/streaming.md.
"""
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Union

from .errors import KvsimError

# Levels of a plain (prefill + decode) result and of a streaming one; a sweep's results (plain or streaming)
# also have the level "aggregate" (its aggregates across samples: one row per group, policy, budget, metric).
PLAIN_LEVELS = ("run", "layer", "head", "timeline")
STREAM_LEVELS = ("run", "question", "memory")
AGGREGATE_LEVEL = "aggregate"
# Columns that identify a run in the finer levels' rows.
_KEYS = ("trace_path", "trace_hash", "trace_model", "policy", "label", "parameters", "question_mode",
         "budget_fraction", "budget_tokens")
_UNSIGNED = ("trace_seed",)  # uint64 fields: protobuf's JSON writes them as strings


def _flatten(d: Mapping[str, Any], prefix: str = "", out: Dict[str, Any] = None) -> Dict[str, Any]:
    """Scalars kept, sub-messages flattened with '_', [{name, value}] statistics as stat_<name>; other
    lists (per-level rows) are left to their own level."""
    out = {} if out is None else out
    for k, v in d.items():
        if isinstance(v, Mapping):
            _flatten(v, f"{prefix}{k}_", out)
        elif k in ("policy_stats",) and isinstance(v, list):
            for s in v:
                out[f"stat_{s['name']}"] = s["value"]
        elif isinstance(v, list):
            continue
        elif k in _UNSIGNED and isinstance(v, str):
            out[prefix + k] = int(v)
        else:
            out[prefix + k] = v
    return out


def _is_streaming(run: Mapping[str, Any]) -> bool:
    return "questions" in run or "mean" in run


def _run_row(run: Mapping[str, Any]) -> Dict[str, Any]:
    row = {k: v for k, v in run.items() if not isinstance(v, (Mapping, list))}
    for k in _UNSIGNED:
        if isinstance(row.get(k), str):
            row[k] = int(row[k])
    if "sample_tags" in run:  # a dataset sample's tags: "k=v;k=v" (as runs.csv) and one column tag_<k> each
        tags = list(run["sample_tags"])
        row["sample_tags"] = ";".join(tags)
        for t in tags:
            k, _, v = t.partition("=")
            row[f"tag_{k}"] = v
    if _is_streaming(run):
        _flatten(run.get("mean", {}), "", row)  # means over questions, unprefixed (as in runs.csv)
    else:
        _flatten(run.get("metrics", {}), "", row)
        if "latency" in run:
            _flatten(run["latency"], "latency_", row)
    return row


def _keys(run: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: run[k] for k in _KEYS if k in run}


def _rows(run: Mapping[str, Any], level: str) -> List[Dict[str, Any]]:
    streaming = _is_streaming(run)
    levels = STREAM_LEVELS if streaming else PLAIN_LEVELS
    if level not in levels:
        kind = "a streaming" if streaming else "a plain"
        raise KvsimError(f"level={level!r}: {kind} result has levels {', '.join(levels)}")
    if level == "run":
        return [_run_row(run)]
    keys = _keys(run)
    if level == "layer":
        rows = []
        for lay in run.get("layers", []):
            row = dict(keys, layer=int(lay["layer"]), budget_tokens_mean=lay.get("budget_tokens_mean", 0.0))
            _flatten(lay.get("metrics", {}), "", row)
            for s in lay.get("policy_stats", []):
                row[f"stat_{s['name']}"] = s["value"]
            rows.append(row)
        return rows
    if level == "head":
        rows = []
        for lay in run.get("layers", []):
            means = lay.get("kv_head_tokens_mean", [])
            peaks = lay.get("kv_head_tokens_peak", [])
            budgets = lay.get("kv_head_budgets", [])
            stats = {s["name"]: s.get("values", []) for s in lay.get("policy_head_stats", [])}
            for h in range(max(len(means), len(peaks), len(budgets))):
                row = dict(keys, layer=int(lay["layer"]), kv_head=h)
                row["kv_head_budget"] = budgets[h] if h < len(budgets) else None
                row["kv_head_tokens_mean"] = means[h] if h < len(means) else None
                row["kv_head_tokens_peak"] = peaks[h] if h < len(peaks) else None
                for name, values in stats.items():
                    row[f"stat_{name}"] = values[h] if h < len(values) else None
                rows.append(row)
        return rows
    if level == "timeline":
        return [dict(keys, time_unit=run.get("time_unit"), **p) for p in run.get("timeline", [])]
    if level == "question":
        return [_flatten(q, "", dict(keys)) for q in run.get("questions", [])]
    # memory
    return [dict(keys, **p) for p in run.get("memory", [])]


def to_frame(results: Union[Mapping[str, Any], Iterable[Mapping[str, Any]]], level: str = "run"):
    """Results (a run's dict, a list of them, or a sweep's {"runs": [...]}) as a tidy pandas DataFrame.

    level: "run" (one row per run), "layer" (per run and layer), "head" (per run, layer and KV head: the
    ragged caches), "timeline" (per run and timeline event); streaming results: "run", "question" (per run
    and question), "memory" (per run and memory event); a sweep's results (plain or streaming) also
    "aggregate": its aggregates across samples, one row per (group, policy, label, budget, metric) with n,
    mean, sd, ci95_low, ci95_high, resamples (as aggregates.csv; docs/metrics.md).
    """
    import pandas as pd

    if level == AGGREGATE_LEVEL:
        if not isinstance(results, Mapping) or "runs" not in results:
            raise KvsimError('level="aggregate": give a sweep\'s results (results.json of kvsim sweep, or the '
                             "dict kvsim.sweep returns); a single run has no aggregates")
        columns = ["group", "policy", "label", "budget_fraction", "budget_tokens", "metric", "n", "mean", "sd",
                   "ci95_low", "ci95_high", "resamples"]
        frame = pd.DataFrame([{c: a.get(c) for c in columns} for a in results.get("aggregates", [])],
                             columns=columns)
        if len(frame):
            for col in ("budget_tokens", "n", "resamples"):
                frame[col] = frame[col].astype("int64")
        return frame
    if isinstance(results, Mapping):
        results = results["runs"] if "runs" in results else [results]
    rows: List[Dict[str, Any]] = []
    for run in results:
        rows.extend(_rows(run, level))
    frame = pd.DataFrame(rows)
    for col in ("layer", "kv_head", "step"):
        if col in frame.columns and len(frame):
            frame[col] = frame[col].astype("int64")
    return frame


def load_results(path: Union[str, "os.PathLike[str]"], level: str = "run"):
    """A tidy DataFrame (see to_frame) from the output folder of `kvsim sweep` / kvsim.sweep(out=...) (its
    results.json), or from a results.json / result.json file."""
    p = Path(os.fspath(path))
    f = p / "results.json" if p.is_dir() else p
    if not f.exists():
        what = f"{p}: folder has no results.json" if p.is_dir() else f"{p}: no such file or folder"
        raise KvsimError(f"{what} (give the --out folder of kvsim sweep, or a results.json / result.json)",
                         "not_found")
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvsimError(f"{f}: not a kvsim results file ({e})") from None
    if not isinstance(data, Mapping) or not ("runs" in data or "policy" in data):
        raise KvsimError(f"{f}: not a kvsim results file (expected kvsim sweep's results.json or kvsim run's "
                         "result.json)")
    return to_frame(data, level)
