"""kvsim.run, kvsim.sweep, kvsim.policies: the CLI's `run`, `sweep` and `list-policies` in-process.

Both return the results `kvsim run` / `kvsim sweep` write (results.proto's JSON mapping, parsed): the engine
builds the same protobuf result and serialises it with the same function, so Python and the CLI cannot
disagree on a number. Arguments are checked before any work, with KvsimError naming the argument and the fix.
"""
import json
import numbers
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from ._native import check, core
from .errors import KvsimError

PathLike = Union[str, "os.PathLike[str]"]
PolicySpec = Union[str, Mapping[str, Any], Sequence[Any]]

_QUESTION_MODES = {"aware": "QUERY_AWARE", "query_aware": "QUERY_AWARE",
                   "agnostic": "QUERY_AGNOSTIC", "query_agnostic": "QUERY_AGNOSTIC"}


def _value_text(key: str, value: Any) -> str:
    """A policy parameter as the CLI's --set value: booleans true/false, lists comma-separated."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_value_text(key, v) for v in value)
    if isinstance(value, (str, numbers.Number)):
        return str(value) if not isinstance(value, float) else repr(value)
    raise KvsimError(f"policy parameter {key}={value!r}: expected a number, string, bool or list of those")


def set_args(params: Optional[Mapping[str, Any]]) -> List[str]:
    """{"window": 16, "pooling": "MAX_POOL"} -> ["window=16", "pooling=MAX_POOL"] (the CLI's --set k=v)."""
    out = []
    for key, value in (params or {}).items():
        check(isinstance(key, str) and key, f"policy parameter name {key!r}: expected a non-empty string")
        out.append(f"{key}={_value_text(key, value)}")
    return out


def _path(value: Any, what: str) -> str:
    try:
        return os.fspath(value)
    except TypeError:
        raise KvsimError(f"{what}={value!r}: expected a path (str or os.PathLike)") from None


def _int(value: Any, what: str, minimum: int, hint: str) -> int:
    check(isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum,
          f"{what}={value!r}: must be an integer >= {minimum}{hint}")
    return int(value)


def _options(threads, prefill_chunk, device, model, latency_model):
    threads = _int(threads, "threads", 0, " (0 = all cores)")
    if prefill_chunk is not None:
        prefill_chunk = _int(prefill_chunk, "prefill_chunk", 0, " (0 = whole prompt)")
    for name, v in (("device", device), ("model", model), ("latency_model", latency_model)):
        check(v is None or isinstance(v, (str, os.PathLike)), f"{name}={v!r}: expected a name or a path")
    return (threads, -1 if prefill_chunk is None else prefill_chunk, os.fspath(device or ""),
            os.fspath(model or ""), os.fspath(latency_model or ""))


def run(trace: PathLike, policy: str, budget: Optional[float] = None, *, budget_tokens: Optional[int] = None,
        question_mode: str = "aware", device: Optional[str] = None, model: Optional[str] = None,
        latency_model: Optional[PathLike] = None, prefill_chunk: int = 0, threads: int = 0,
        progress: bool = False, params: Optional[Mapping[str, Any]] = None, **policy_params: Any) -> Dict:
    """One policy at one budget on one trace: `kvsim run` in-process; returns its result.json as a dict.

    budget: fraction of the compressible prompt kept per layer and KV head, in (0, 1] (kvpress's
    compression_ratio r is budget = 1 - r); or budget_tokens: tokens kept per layer and KV head. Streaming
    traces take budget_tokens (retrieved visual tokens) or neither (the policy's default).
    Policy parameters as keywords (window=16) or params={"window": 16} (for dotted names); they are the CLI's
    --set key=value. device / model / latency_model / prefill_chunk / question_mode are the CLI's options of
    the same names; threads=0 uses every core (results do not depend on it); progress=True draws the CLI's
    progress bar on stderr.
    """
    trace = _path(trace, "trace")
    check(isinstance(policy, str) and policy, f"policy={policy!r}: expected a policy name (kvsim.policies())")
    check(question_mode in _QUESTION_MODES, f"question_mode={question_mode!r}: expected 'aware' or 'agnostic'")
    check(budget is None or budget_tokens is None, "give one of budget= (a fraction of the prompt in (0, 1]) "
          "or budget_tokens= (tokens per layer per KV head), not both")
    fraction = 0.0
    if budget is not None:
        check(isinstance(budget, numbers.Real) and not isinstance(budget, bool) and 0 < budget <= 1,
              f"budget={budget!r}: must be a fraction in (0, 1]; use budget_tokens= for token counts")
        fraction = float(budget)
    tokens = 0
    if budget_tokens is not None:
        tokens = _int(budget_tokens, "budget_tokens", 1, "")
    threads, chunk, device, model, latency_model = _options(threads, prefill_chunk, device, model,
                                                             latency_model)
    sets = set_args(params) + set_args(policy_params)
    _, text = core().run(trace, policy, sets, fraction, tokens, question_mode, threads, latency_model, device,
                         model, max(chunk, 0), bool(progress))
    return json.loads(text)


def _policy_entry(spec: PolicySpec) -> Dict[str, Any]:
    """A policy of a sweep: "snapkv", "snapkv window=16" (name and --set overrides, as in run labels),
    ("snapkv", {"window": 16}) or {"name": "snapkv", "params": {...} | "set": [...], "label": "..."}."""
    if isinstance(spec, str):
        name, *sets = spec.split()
        check(bool(name), "policies: an empty policy name")
        return {"name": name, "set": sets}
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"name", "params", "set", "label"}
        check(not unknown, f"policies: {dict(spec)!r} has unknown keys {sorted(unknown)} "
              "(expected name, params or set, label)")
        check(isinstance(spec.get("name"), str) and spec["name"], f"policies: {dict(spec)!r} needs a 'name'")
        entry = {"name": spec["name"], "set": list(spec.get("set", [])) + set_args(spec.get("params"))}
        if spec.get("label") is not None:
            entry["label"] = str(spec["label"])
        return entry
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and isinstance(spec[0], str):
        return {"name": spec[0], "set": set_args(spec[1])}
    raise KvsimError(f"policies: {spec!r}: expected a name, 'name key=value ...', (name, params) or a dict")


def _list(value: Any, what: str) -> list:
    check(isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)),
          f"{what}={value!r}: expected a list")
    return list(value)


def sweep(config: Union[PathLike, Mapping[str, Any], None] = None, *, traces: Optional[Sequence[PathLike]] = None,
          policies: Optional[Sequence[PolicySpec]] = None, budgets: Optional[Sequence[float]] = None,
          budget_tokens: Optional[Sequence[int]] = None, question_mode: Optional[str] = None,
          device: Optional[str] = None, model: Optional[str] = None, latency_model: Optional[PathLike] = None,
          prefill_chunk: Optional[int] = None, threads: int = 0, progress: bool = False,
          out: Optional[PathLike] = None, resume: bool = False) -> List[Dict]:
    """Traces x policies x budgets: `kvsim sweep` in-process; returns the list of run results (results.json's
    "runs"), and with out=DIR also writes the CLI's output folder (results.json, runs.csv, layers.csv, summary.md, ...).

    config: an experiment file (configs/experiments/*.textproto; its relative paths resolve against its
    folder), a dict in the experiment's JSON form ({"traces": [...], "policies": [{"name": "snapkv"}],
    "budgets": [0.1]}), or None (then traces and policies are required). traces / policies / budgets /
    budget_tokens / question_mode replace the experiment's fields of the same name; device / model /
    latency_model / prefill_chunk override its clock, as the CLI's options do. Every trace and policy is
    checked before any replay starts; each trace is read once for all its runs.
    resume=True (with out=): reuse the finished units in out/units whose trace and experiment are unchanged,
    as `kvsim sweep --resume` (docs/cli.md "Resume"); the outputs are byte-identical to a sweep from scratch.
    The same sweep on a Ray cluster: kvsim.ray.sweep (docs/cluster.md).
    """
    threads, chunk, device, model, latency_model = _options(threads, prefill_chunk, device, model,
                                                             latency_model)
    overrides: Dict[str, Any] = {}
    if traces is not None:
        overrides["traces"] = [_path(t, "traces") for t in _list(traces, "traces")]
    if policies is not None:
        overrides["policies"] = [_policy_entry(p) for p in _list(policies, "policies")]
    if budgets is not None:
        overrides["budgets"] = _list(budgets, "budgets")
        for b in overrides["budgets"]:
            check(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 < b <= 1,
                  f"budgets: {b!r} is not a fraction in (0, 1]; use budget_tokens= for token counts")
        overrides["budgets"] = [float(b) for b in overrides["budgets"]]
    if budget_tokens is not None:
        overrides["budget_tokens"] = [_int(b, "budget_tokens", 1, "")
                                      for b in _list(budget_tokens, "budget_tokens")]
    if question_mode is not None:
        check(question_mode in _QUESTION_MODES,
              f"question_mode={question_mode!r}: expected 'aware' or 'agnostic'")
        overrides["question_mode"] = _QUESTION_MODES[question_mode]
    config_path = ""
    if config is None:
        check("traces" in overrides and "policies" in overrides,
              "kvsim.sweep: give an experiment (config=) or both traces= and policies=")
        experiment = overrides
    elif isinstance(config, Mapping):
        experiment = dict(config)
        if "policies" in experiment:
            experiment["policies"] = [_policy_entry(p) for p in _list(experiment["policies"], "policies")]
        if experiment.get("question_mode") in _QUESTION_MODES:
            experiment["question_mode"] = _QUESTION_MODES[experiment["question_mode"]]
        experiment.update(overrides)
    else:
        config_path = _path(config, "config")
        experiment = overrides
    if out is not None:
        out = _path(out, "out")
    check(isinstance(resume, bool), f"resume={resume!r}: expected True or False")
    check(not resume or out is not None, "resume=True reuses the finished units of an output folder: give out=")
    _, text = core().sweep(config_path, json.dumps(experiment), list(overrides), threads, latency_model, device,
                           model, chunk, bool(progress), out or "", resume)
    return json.loads(text)["runs"]


def policies() -> List[Dict[str, Any]]:
    """The registered policies (`kvsim list-policies`): name, summary, params_type, defaults (text format),
    uses_budget, streaming."""
    return core().policies()
