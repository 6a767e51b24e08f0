"""The closed-loop report (docs/closed-loop.md): per plan, kvsim's replay metrics next to what the real model
did, and Spearman rank correlations across all runs between the two. Writes closed_loop.json, a tidy
closed_loop.csv, summary.md and closed_loop.png into one folder, each file written to a temporary name and
renamed, so a folder never holds a half-written report."""
import csv
import io
import json
import math
import os

import numpy as np

REPLAY_METRICS = (("retained_mass", "retained mass"), ("output_rel_error", "output error"),
                  ("regret", "regret vs oracle"))
REAL_METRICS = (("kl_mean", "mean KL(full‖compressed)"), ("nll_increase", "NLL increase"),
                ("success", "passkey success (free running)"))


def replay_metrics(result):
    """The replay's numbers from a kvsim RunResult JSON (kvsim gpu-plan --result / kvsim run --out)."""
    m = result.get("metrics", {})
    layers = result.get("layers", [])
    return {
        "retained_mass": m.get("retained_mass_mean"),
        "output_rel_error": m.get("output_rel_error_mean"),
        "regret": m.get("regret_vs_oracle_mean"),
        "layer_output_rel_error": [lr.get("metrics", {}).get("output_rel_error_mean") for lr in layers],
    }


def _ranks(x):
    """Average ranks (ties share the mean rank)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(x, y):
    """Spearman's rank correlation (Pearson correlation of average ranks); None when fewer than 3 pairs or a
    side is constant."""
    pairs = [(a, b) for a, b in zip(x, y) if a is not None and b is not None
             and not (isinstance(a, float) and math.isnan(a)) and not (isinstance(b, float) and math.isnan(b))]
    if len(pairs) < 3:
        return None
    rx, ry = _ranks([p[0] for p in pairs]), _ranks([p[1] for p in pairs])
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _real_value(run, key):
    if key == "success":
        fr = run["closed_loop"]["free_running"]
        if not fr.get("supported") or "passkey_found" not in fr:
            return None
        return 1.0 if fr["passkey_found"] else 0.0
    return run["closed_loop"]["teacher_forced"].get(key)


def correlations(runs):
    out = []
    for rk, rname in REPLAY_METRICS:
        for ck, cname in REAL_METRICS:
            xs = [r["replay"][rk] for r in runs]
            ys = [_real_value(r, ck) for r in runs]
            n = sum(1 for a, b in zip(xs, ys) if a is not None and b is not None)
            out.append({"replay_metric": rk, "real_metric": ck, "label": "%s vs %s" % (rname, cname),
                        "spearman": spearman(xs, ys), "runs": n})
    return out


def _atomic_write(path, data, mode="w"):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, mode) as f:
        f.write(data)
    os.replace(tmp, path)


def _fmt(v, digits=3):
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return ("%%.%dg" % digits) % v if abs(v) < 1e-3 and v != 0 else ("%%.%df" % digits) % v


def tidy_rows(runs):
    rows = []
    for r in runs:
        base = [r["label"], r["policy"], r["budget_fraction"], r["budget_tokens"]]
        for k in ("retained_mass", "output_rel_error", "regret"):
            rows.append(base + ["replay", k, "", r["replay"][k]])
        for layer, v in enumerate(r["replay"]["layer_output_rel_error"]):
            rows.append(base + ["replay", "layer_output_rel_error", layer, v])
        tf = r["closed_loop"]["teacher_forced"]
        for k in ("kl_mean", "top1_agreement", "nll_mean", "nll_full_mean", "nll_increase"):
            rows.append(base + ["closed_loop", k, "", tf[k]])
        for layer, v in enumerate(tf["layer_output_rel_error"]):
            rows.append(base + ["closed_loop", "layer_output_rel_error", layer, v])
        fr = r["closed_loop"]["free_running"]
        if fr.get("supported"):
            rows.append(base + ["closed_loop", "first_divergence", "",
                                "" if fr["first_divergence"] is None else fr["first_divergence"]])
            if "passkey_found" in fr:
                rows.append(base + ["closed_loop", "passkey_found", "", int(fr["passkey_found"])])
    return rows


def summary_markdown(report):
    runs = report["runs"]
    t = report["trace"]
    lines = ["# kvsim closed loop: replay metrics vs the real model", "",
             "**Real model run, measured**: `%s` re-run by transformers with each layer's KV cache restricted to "
             "the policy's decisions (teacher-forced on the trace's %d recorded decode tokens after a full "
             "prefill of %d tokens; free-running greedy where the plan allows). The replay columns are kvsim's "
             "open-loop metrics for the same decisions." % (report["model"], t["decode_steps"], t["prefill_length"]),
             "", "Trace `%s` (hash %s)%s." % (t["path"], t["hash"],
                                               ", passkey %s" % t["passkey"] if t.get("passkey") else ""), "",
             "| policy | budget | replay: retained mass | replay: out err | replay: regret | layer-0 err "
             "(closed loop) | last-layer err | mean KL | top-1 agree | NLL increase | free running: first diff "
             "| passkey |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["budget_tokens"], r["label"])):
        tf, fr = r["closed_loop"]["teacher_forced"], r["closed_loop"]["free_running"]
        if fr.get("supported"):
            first = "none" if fr["first_divergence"] is None else "step %d" % fr["first_divergence"]
            found = _fmt(fr.get("passkey_found")) if "passkey_found" in fr else "-"
        else:
            first, found = "not supported", "-"
        budget = "%g%% (%d)" % (100 * r["budget_fraction"], r["budget_tokens"]) if r["budget_fraction"] else str(
            r["budget_tokens"])
        lerr = tf["layer_output_rel_error"]
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["label"], budget, _fmt(r["replay"]["retained_mass"]), _fmt(r["replay"]["output_rel_error"]),
            _fmt(r["replay"]["regret"]), _fmt(lerr[0]), _fmt(lerr[-1]), _fmt(tf["kl_mean"]),
            _fmt(tf["top1_agreement"], 2), _fmt(tf["nll_increase"]), first, found))
    lines += ["", "## Does the replay predict the real model? (Spearman rank correlation over %d runs)" % len(runs),
              "", "| replay metric | real metric | Spearman ρ | runs |", "|---|---|---:|---:|"]
    for c in report["correlations"]:
        lines.append("| %s | %s | %s | %d |" % (c["replay_metric"], c["real_metric"], _fmt(c["spearman"], 2),
                                               c["runs"]))
    lines += ["",
              "Reading it: a replay metric predicts the model well when |ρ| is near 1 (retained mass should be "
              "negatively correlated with KL and NLL increase, output error and regret positively). The "
              "layer-0 error is kvsim's replay error for layer 0 (its inputs are unperturbed); the growth to the "
              "last layer is what the open-loop replay cannot see. Free running is \"not supported\" for plans "
              "that evict or merge during decode (their decisions depend on the run's own scores; the policy is "
              "not re-run online). Definitions: docs/closed-loop.md.", ""]
    return "\n".join(lines)


def plot(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    runs = report["runs"]
    labels = sorted({r["label"] for r in runs})
    cmap = plt.get_cmap("tab20")
    color = {lab: cmap(i % 20) for i, lab in enumerate(labels)}
    budgets = sorted({r["budget_tokens"] for r in runs})
    size = {bt: 12 + 40 * i / max(1, len(budgets) - 1) for i, bt in enumerate(budgets)}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    seen = set()
    for r in runs:
        x, y = r["replay"]["output_rel_error"], r["closed_loop"]["teacher_forced"]["kl_mean"]
        if x is not None:
            a.scatter(x, y, s=size[r["budget_tokens"]], color=color[r["label"]],
                      label=None if r["label"] in seen else r["label"])
            seen.add(r["label"])
    a.legend(fontsize=7, ncol=2, title="policy (marker size = budget)", title_fontsize=7)
    a.set_xlabel("replay: attention output rel. error (open loop)")
    a.set_ylabel("closed loop: mean KL(full || compressed), nats")
    a.set_title("Replay metric vs real model (measured)")
    pick = budgets[len(budgets) // 2] if budgets else None
    for r in runs:
        if r["budget_tokens"] == pick and r["policy"] != "full":
            b.plot(r["closed_loop"]["teacher_forced"]["layer_output_rel_error"], label=r["label"], lw=1.2,
                   color=color[r["label"]])
    b.set_xlabel("layer")
    b.set_ylabel("attention output rel. error (closed loop)")
    b.set_title("Error growth with depth at %s tokens/head" % pick)
    if pick is not None:
        b.legend(fontsize=7, ncol=2)
    fig.suptitle("kvsim closed loop on %s (real model, measured)" % report["model"], fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    _atomic_write(path, buf.getvalue(), "wb")


def write_report(report, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    report["correlations"] = correlations(report["runs"])
    _atomic_write(os.path.join(out_dir, "closed_loop.json"), json.dumps(report, indent=1) + "\n")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["label", "policy", "budget_fraction", "budget_tokens", "source", "metric", "layer", "value"])
    w.writerows(tidy_rows(report["runs"]))
    _atomic_write(os.path.join(out_dir, "closed_loop.csv"), buf.getvalue())
    _atomic_write(os.path.join(out_dir, "summary.md"), summary_markdown(report))
    plot(report, os.path.join(out_dir, "closed_loop.png"))
