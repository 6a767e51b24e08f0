"""Catalogue of bad inputs (issue 18 §5; docs/hardening.md "Catalogue of bad inputs").

Runs the kvsim binary ($KVSIM_BIN) on generated bad inputs, one per failure class: missing or wrong files,
damaged traces (crafted with h5py from traces kvsim synth writes), impossible flag values, outputs that name
an input, bad configs, policies that cannot run. For each it asserts: a non-zero exit (1 = bad input unless
the case says otherwise), exactly one line on stderr that names the problem (a distinctive substring per
case), nothing on stdout, no output file and no leftover temporary file, and the inputs unchanged.

PENDING lists the classes whose fix is not in this tree yet; they run as expected failures (xfail, strict:
a pending case that starts passing fails the test, so it is moved to CASES with its fix).
"""

import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

import h5py
import numpy as np
import pytest

KVSIM = os.environ.get("KVSIM_BIN", "kvsim")
SRC = Path(__file__).resolve().parents[2]
SYNTH = SRC / "configs" / "synth"
SANITIZED = "ASAN_OPTIONS" in os.environ  # make asan-test: no ulimit -v (ASan reserves terabytes)

# ---- inputs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def traces(tmp_path_factory):
    """Pristine traces written once by kvsim synth: plain (every query, column sums), streaming, and one that
    stores only the last prompt queries."""
    d = tmp_path_factory.mktemp("catalogue_traces")
    window_cfg = d / "window.textproto"
    window_cfg.write_text((SYNTH / "tiny.textproto").read_text().replace(
        "query_storage: ALL", "query_storage: WINDOW query_window: 8"))
    out = {}
    for name, cfg in [("tiny", SYNTH / "tiny.textproto"), ("stream", SYNTH / "streaming_tiny.textproto"),
                      ("window", window_cfg)]:
        out[name] = d / f"{name}.h5"
        subprocess.run([KVSIM, "synth", "--config", str(cfg), "--out", str(out[name]), "--threads", "1"],
                       check=True, capture_output=True)
    return out


class Ctx:
    """One case's folders: inputs in in/, outputs go to out/ (must stay empty)."""

    def __init__(self, root: Path, traces):
        self.inp = root / "in"
        self.out = root / "out"
        self.inp.mkdir(parents=True)
        self.out.mkdir()
        self.traces = traces

    def copy(self, name="tiny", as_name=None) -> str:
        dst = self.inp / (as_name or f"{name}.h5")
        shutil.copy(self.traces[name], dst)
        return str(dst)

    def damaged(self, fn: Callable[[h5py.File], None], name="tiny") -> str:
        """A copy of a pristine trace changed by fn(h5py.File opened r+)."""
        path = self.copy(name, f"damaged_{name}.h5")
        with h5py.File(path, "r+") as f:
            fn(f)
        return path

    def text(self, name: str, content: str) -> str:
        p = self.inp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return str(p)

    def truncated(self, nbytes: int, name="tiny") -> str:
        p = self.inp / f"cut_{name}.h5"
        p.write_bytes(Path(self.traces[name]).read_bytes()[:nbytes])
        return str(p)

    def o(self, name="r.json") -> str:
        return str(self.out / name)


def set_attr(name, value):
    def fn(f):
        del f.attrs[name]
        f.attrs[name] = value
    return fn


def del_attr(name):
    def fn(f):
        del f.attrs[name]
    return fn


def del_link(name):
    def fn(f):
        del f[name]
    return fn


def replace_dataset(name, transform):
    def fn(f):
        data = transform(f[name][...])
        del f[name]
        f.create_dataset(name, data=data)
    return fn


def huge_unallocated_layers(f):
    """Root attributes claiming 1M tokens x 4096 heads, with chunked datasets of exactly that shape whose
    chunks are never written (all fill value): a 30 KB file whose layer would need terabytes."""
    heads, d = 4096, 32
    n = 1 << 20
    for k in list(f.attrs):
        if k in ("num_heads", "num_kv_heads"):
            del f.attrs[k]
            f.attrs[k] = np.int64(heads)
        if k == "prefill_length":
            del f.attrs[k]
            f.attrs[k] = np.int64(n - 8)
    del f["layers"], f["tokens"], f["queries"]
    if "aggregates" in f:
        del f["aggregates"]
    del f.attrs["has_prefill_column_sums"], f.attrs["query_mode"]
    f.attrs["has_prefill_column_sums"] = np.int64(0)
    f.attrs["query_mode"] = "window_and_decode"
    for name, dt in [("modality", "u1"), ("phase", "u1"), ("role", "u1"), ("segment_id", "i4"),
                     ("patch_row", "i4"), ("patch_col", "i4"), ("position_id", "i8"), ("token_id", "i8")]:
        f.create_dataset(f"tokens/{name}", shape=(n,), dtype=dt, chunks=(4096,))
    f["tokens/phase"][n - 8:] = 1  # the decode steps: phase decode, role generated (one chunk written)
    f["tokens/role"][n - 8:] = 3
    f["tokens/position_id"][n - 4096:] = np.arange(n - 4096, n)
    f["tokens/segment_id"][n - 4096:] = -1
    f["tokens/patch_row"][n - 4096:] = -1
    f["tokens/patch_col"][n - 4096:] = -1
    f.create_dataset("queries/positions", data=np.arange(n - 8, n, dtype=np.int32))
    for layer in range(f.attrs["num_layers"]):
        g = f"layers/layer_{layer:03d}"
        for ds, h, t in [("keys", heads, n), ("values", heads, n), ("queries", heads, 8)]:
            f.create_dataset(f"{g}/{ds}", shape=(h, t, d), dtype="f4", chunks=(1, min(t, 1024), d))


# ---- the catalogue ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    args: Callable[[Ctx], list]  # kvsim arguments, built in the case's folders
    expect: str  # distinctive substring of the one stderr line
    exit_code: int = 1
    env: dict = dataclasses.field(default_factory=dict)  # extra environment of the kvsim process
    # The HDF5 library crashes in kvsim's guarded child (the error comes from the parent): under ASan the
    # child's report, which goes to the inherited stderr, is sent to a file instead.
    child_crashes: bool = False
    note: str = ""


TINY_CFG = str(SYNTH / "tiny.textproto")
EXP_DEMO = str(SRC / "configs" / "experiments" / "demo.textproto")

CASES = [
    # -- files that are not traces
    Case("missing_trace", lambda c: ["validate", str(c.inp / "missing.h5")], "missing.h5"),
    Case("folder_as_trace", lambda c: ["run", "--trace", str(c.inp), "--policy", "snapkv", "--budget", "0.2",
                                       "--out", c.o()], "in"),
    Case("text_file_as_trace", lambda c: ["inspect", c.text("notes.h5", "just some text\n" * 40)],
         "notes.h5"),
    Case("empty_file_as_trace", lambda c: ["validate", c.text("empty.h5", "")], "empty.h5"),
    Case("truncated_trace", lambda c: ["validate", c.truncated(30000)], "cut_tiny.h5"),
    Case("hash_missing", lambda c: ["hash", str(c.inp / "gone.h5")], "gone.h5"),
    # -- damaged traces: root attributes
    Case("wrong_format_attribute", lambda c: ["validate", c.damaged(set_attr("format", "not-kvsim"))],
         "format"),
    Case("wrong_format_version", lambda c: ["validate", c.damaged(set_attr("format_version", np.int64(99)))],
         "format_version"),
    Case("missing_num_heads", lambda c: ["validate", c.damaged(del_attr("num_heads"))], "num_heads"),
    Case("num_heads_corrupted",
         lambda c: ["run", "--trace", c.damaged(set_attr("num_heads", np.int64(1 << 20))), "--policy", "h2o",
                    "--budget", "0.2", "--out", c.o()], "num_heads"),
    Case("num_kv_heads_not_dividing", lambda c: ["validate", c.damaged(set_attr("num_kv_heads", np.int64(3)))],
         "num_kv_heads"),
    Case("head_dim_zero", lambda c: ["validate", c.damaged(set_attr("head_dim", np.int64(0)))], "head_dim"),
    Case("num_layers_smaller_than_stored",
         lambda c: ["run", "--trace", c.damaged(set_attr("num_layers", np.int64(2))), "--policy", "snapkv",
                    "--budget", "0.2", "--out", c.o()], "num_layers"),
    Case("num_layers_larger_than_stored",
         lambda c: ["validate", c.damaged(set_attr("num_layers", np.int64(5)))], "layer_003"),
    Case("prefill_length_beyond_tokens",
         lambda c: ["validate", c.damaged(set_attr("prefill_length", np.int64(10_000)))], "prefill_length"),
    Case("negative_decode_steps",
         lambda c: ["validate", c.damaged(set_attr("num_decode_steps", np.int64(-3)))], "num_decode_steps"),
    Case("storage_dtype_unknown",
         lambda c: ["validate", c.damaged(set_attr("storage_dtype", "bfloat8"))], "storage_dtype"),
    # -- damaged traces: datasets
    Case("missing_keys_dataset",
         lambda c: ["validate", c.damaged(del_link("layers/layer_001/keys"))], "layer_001/keys"),
    Case("keys_wrong_shape",
         lambda c: ["validate", c.damaged(replace_dataset("layers/layer_000/keys", lambda a: a[:, :-1, :]))],
         "layer_000/keys"),
    Case("keys_nan",
         lambda c: ["validate", c.damaged(replace_dataset("layers/layer_002/keys",
                                                          lambda a: np.where(a == a, np.nan, a)))],
         "finite"),
    Case("token_table_short",
         lambda c: ["validate", c.damaged(replace_dataset("tokens/modality", lambda a: a[:-2]))], "modality"),
    Case("modality_out_of_range",
         lambda c: ["validate", c.damaged(replace_dataset("tokens/modality", lambda a: a + 7))], "modality"),
    Case("query_positions_unsorted",
         lambda c: ["validate", c.damaged(replace_dataset("queries/positions", lambda a: a[::-1].copy()))],
         "positions"),
    Case("missing_token_table",
         lambda c: ["validate", c.damaged(del_link("tokens/role"))], "role"),
    Case("prefill_column_sums_negative",
         lambda c: ["run", "--trace", c.damaged(replace_dataset("aggregates/layer_001/prefill_column_sums",
                                                                lambda a: -a - 1)),
                    "--policy", "h2o", "--budget", "0.2", "--out", c.o()], "prefill_column_sums"),
    Case("prefill_column_sums_huge",
         lambda c: ["run", "--trace", c.damaged(replace_dataset("aggregates/layer_000/prefill_column_sums",
                                                                lambda a: a * 0 + 1e30)),
                    "--policy", "h2o", "--budget", "0.2", "--out", c.o()], "prefill_column_sums"),
    Case("streaming_trace_damaged",
         lambda c: ["run", "--trace", c.damaged(del_link("streaming/frame_time_s"), "stream"), "--policy",
                    "rekv", "--budget-tokens", "16", "--out", c.o()], "frame_time_s",
         note="issue 18 §3: was \"'rekv' is a streaming policy ... and this trace is not one\""),
    Case("streaming_trace_damaged_default_budget",
         lambda c: ["run", "--trace", c.damaged(del_link("streaming/frame_time_s"), "stream"), "--policy",
                    "rekv", "--out", c.o()], "frame_time_s",
         note="issue 18 §3: was the usage error 'give exactly one of --budget or --budget-tokens' (exit 2)"),
    # -- flag values
    Case("threads_negative", lambda c: ["inspect", c.copy(), "--threads", "-1"], "--threads"),
    Case("tolerance_nan", lambda c: ["validate", c.copy(), "--tolerance", "nan"], "--tolerance"),
    Case("tolerance_negative", lambda c: ["validate", c.copy(), "--tolerance", "-0.5"], "--tolerance"),
    Case("seed_negative",
         lambda c: ["synth", "--config", TINY_CFG, "--out", c.o("t.h5"), "--seed", "-1"], "--seed"),
    Case("budget_above_one",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "2", "--out", c.o()],
         "--budget"),
    Case("budget_not_a_number",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "abc", "--out", c.o()],
         "abc"),
    Case("budget_tokens_zero",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget-tokens", "0", "--out", c.o()],
         "--budget-tokens"),
    Case("streaming_budget_tokens_zero",
         lambda c: ["run", "--trace", c.copy("stream"), "--policy", "rekv", "--budget-tokens", "0", "--out",
                    c.o()], "--budget-tokens"),
    Case("streaming_budget_fraction",
         lambda c: ["run", "--trace", c.copy("stream"), "--policy", "rekv", "--budget", "0.5", "--out",
                    c.o()], "streaming trace"),
    Case("prefill_chunk_negative",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--prefill-chunk",
                    "-4", "--out", c.o()], "--prefill-chunk"),
    Case("question_mode_unknown",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--question-mode",
                    "sideways", "--out", c.o()], "sideways"),
    Case("verify_dap_layer_outside",
         lambda c: ["verify", "hae", "--trace", c.copy(), "--dap-layer", "99", "--out", c.o()], "--dap-layer"),
    Case("verify_epsilon_nan",
         lambda c: ["verify", "hae", "--trace", c.copy(), "--epsilon", "nan", "--out", c.o()], "--epsilon"),
    Case("verify_min_r2_above_one",
         lambda c: ["verify", "hae", "--trace", c.copy(), "--min-r2", "1.5", "--out", c.o()], "--min-r2"),
    Case("verify_without_prompt_queries",
         lambda c: ["verify", "hae", "--trace", c.copy("window"), "--out", c.o()], "quer"),
    Case("latency_kv_length_negative",
         lambda c: ["latency", "--device", "a100-sxm", "--model", "llava-1.5-7b", "--kv-length", "-5"],
         "kv-length"),
    # -- outputs that name an input
    Case("run_out_is_trace",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--out",
                    str(c.inp / "tiny.h5")], "overwrite"),
    Case("synth_out_is_config",
         lambda c: ["synth", "--config", c.text("cfg.textproto", Path(TINY_CFG).read_text()), "--out",
                    str(c.inp / "cfg.textproto")], "overwrite"),
    Case("gpu_plan_out_is_trace",
         lambda c: ["gpu-plan", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--out",
                    str(c.inp / "tiny.h5")], "overwrite"),
    Case("verify_out_is_trace",
         lambda c: ["verify", "hae", "--trace", c.copy(), "--out", str(c.inp / "tiny.h5")], "overwrite"),
    # -- configs
    Case("folder_as_synth_config", lambda c: ["synth", "--config", str(c.inp), "--out", c.o("t.h5")],
         "folder"),
    Case("folder_as_experiment", lambda c: ["sweep", "--config", str(c.inp), "--out", c.o("sweep")],
         "folder"),
    Case("synth_config_syntax_error",
         lambda c: ["synth", "--config", c.text("bad.textproto", "model { num_layers: }\n"), "--out",
                    c.o("t.h5")], "bad.textproto"),
    Case("synth_config_bad_field",
         lambda c: ["synth", "--config", c.text("bad.textproto",
                                                Path(TINY_CFG).read_text().replace("head_dim: 32",
                                                                                   "head_dim: 15")),
                    "--out", c.o("t.h5")], "head_dim"),
    Case("synth_config_unknown_field",
         lambda c: ["synth", "--config", c.text("bad.textproto", "model { heads: 4 }\n"), "--out",
                    c.o("t.h5")], "heads"),
    Case("experiment_no_policies",
         lambda c: ["sweep", "--config", c.text("e.textproto", 'traces: "x.h5" budgets: 0.1\n'), "--out",
                    c.o("sweep")], "policies"),
    Case("experiment_budget_above_one",
         lambda c: ["sweep", "--config",
                    c.text("e.textproto", 'traces: "x.h5" policies { name: "snapkv" } budgets: 3\n'),
                    "--out", c.o("sweep")], "budgets"),
    Case("experiment_missing_trace",
         lambda c: ["sweep", "--config",
                    c.text("e.textproto", 'traces: "nowhere.h5" policies { name: "snapkv" } budgets: 0.1\n'),
                    "--out", c.o("sweep")], "nowhere.h5"),
    Case("latency_model_negative",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--latency-model",
                    c.text("lat.textproto", "decode_base_us: -1\n"), "--out", c.o()], "lat.textproto"),
    Case("device_unknown",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--device", "tpu-v9",
                    "--out", c.o()], "tpu-v9"),
    Case("device_profile_bad",
         lambda c: ["latency", "--device", c.text("dev.textproto", "name: \"x\" hbm_bandwidth_gbps: -3\n"),
                    "--model", "llava-1.5-7b", "--kv-length", "100"], "dev.textproto"),
    Case("model_shape_mismatch",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--budget", "0.2", "--device",
                    "a100-sxm", "--model", "llava-1.5-7b", "--out", c.o()], "llava-1.5-7b"),
    # -- policies
    Case("unknown_policy",
         lambda c: ["run", "--trace", c.copy(), "--policy", "nope", "--budget", "0.2", "--out", c.o()],
         "unknown policy 'nope'"),
    Case("unknown_param",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--set", "bogus=1", "--budget", "0.2",
                    "--out", c.o()], "bogus"),
    Case("param_wrong_type",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv", "--set", "window=many", "--budget",
                    "0.2", "--out", c.o()], "window"),
    Case("unknown_merge",
         lambda c: ["run", "--trace", c.copy(), "--policy", "snapkv+median", "--budget", "0.2", "--out",
                    c.o()], "median"),
    Case("unwrappable_merge",
         lambda c: ["run", "--trace", c.copy(), "--policy", "meda+average", "--budget", "0.2", "--out",
                    c.o()], "meda"),
    Case("streaming_policy_on_plain_trace",
         lambda c: ["run", "--trace", c.copy(), "--policy", "rekv", "--budget", "0.2", "--out", c.o()],
         "rekv"),
    Case("plain_policy_on_streaming_trace",
         lambda c: ["run", "--trace", c.copy("stream"), "--policy", "snapkv", "--budget-tokens", "16",
                    "--out", c.o()], "snapkv"),
    Case("gpu_plan_on_streaming_trace",
         lambda c: ["gpu-plan", "--trace", c.copy("stream"), "--policy", "snapkv", "--budget", "0.2", "--out",
                    c.o("p.pb")], "streaming trace"),
    # -- memory (issue 18 §2)
    Case("synth_config_asks_for_terabytes",
         lambda c: ["synth", "--config", c.text("big.textproto", Path(TINY_CFG).read_text()
                                                .replace("num_layers: 3", "num_layers: 1000")
                                                .replace("num_heads: 4", "num_heads: 64")
                                                .replace("num_kv_heads: 4", "num_kv_heads: 64")
                                                .replace("head_dim: 32", "head_dim: 1024")
                                                .replace("rope_theta: 10000", "rope_theta: 1e9")
                                                .replace("tokens: 8 }", "tokens: 1000000 }")),
                    "--out", c.o("t.h5")], "memory",
         note="issue 18 §2"),
    Case("huge_declared_shape_unallocated_chunks",
         lambda c: ["validate", c.damaged(huge_unallocated_layers)], "stores 0 bytes",
         note="issue 18 §2: stored sizes checked against shapes"),
    Case("damaged_global_heap_string_attribute",
         lambda c: ["validate", shutil.copy(SRC / "tests/fuzz/regressions/trace_reader/"
                                            "vlen_string_global_heap.h5", c.inp / "heap.h5")], "heap.h5",
         child_crashes=True,
         note="issue 18 §1: found by fuzz_trace_reader; was SIGSEGV in H5Aread -> H5HG_read"),
    Case("bad_alloc_is_one_line",
         lambda c: ["synth", "--config", str(SYNTH / "streaming_demo.textproto"), "--out", c.o("t.h5"),
                    "--threads", "1"],
         "memory", note="issue 18 §3: was a bare std::bad_alloc (ulimit -v; skipped under ASan)"),
    Case("layer_above_memory_limit", lambda c: ["validate", c.copy()], "memory",
         env={"KVSIM_MAX_MEMORY": "4K"}, note="issue 18 §2: two layers checked against available memory"),
    # -- outputs
    Case("sweep_out_holds_other_files",
         lambda c: ["sweep", "--config", EXP_DEMO, "--trace", c.copy(), "--out",
                    str(Path(c.text("keep/precious.txt", "x")).parent)], "precious.txt"),
]

# Classes whose fix is not in this tree yet (issue 18 §1-3, the lead's changes). Each states the behaviour the
# issue asks for; it runs as a strict expected failure until the fix lands, then moves to CASES.
PENDING = [
    # (none: every class found so far is fixed)
]

ULIMIT_CASES = {"bad_alloc_is_one_line": 400_000}  # KB of address space for these cases


def digest_tree(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def check(case: Case, tmp_path, traces):
    c = Ctx(tmp_path / case.id, traces)
    args = [str(a) for a in case.args(c)]
    before = digest_tree(c.inp)
    cmd = [KVSIM] + args
    preexec = None
    if case.id in ULIMIT_CASES:
        if SANITIZED:
            pytest.skip("ulimit -v does not work under AddressSanitizer")
        import resource
        kb = ULIMIT_CASES[case.id]
        preexec = lambda: resource.setrlimit(resource.RLIMIT_AS, (kb * 1024, kb * 1024))  # noqa: E731
    env = dict(os.environ, **case.env)
    if SANITIZED and case.child_crashes:
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"] + ":log_path=" + str(tmp_path / "child_sanitizer")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=c.inp, preexec_fn=preexec, env=env)
    shown = f"$ kvsim {' '.join(args)}\nexit {p.returncode}\nstderr: {p.stderr!r}\nstdout: {p.stdout!r}"
    assert p.returncode == case.exit_code, shown
    lines = p.stderr.splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith("kvsim: error: "), shown
    assert case.expect in lines[0], shown
    assert p.stdout == "", shown
    assert sorted(os.listdir(c.out)) == [], shown  # no output, no temporary file
    assert digest_tree(c.inp) == before, shown  # inputs untouched, nothing written beside them


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, traces):
    check(case, tmp_path, traces)


@pytest.mark.parametrize("case", PENDING, ids=[c.id for c in PENDING])
@pytest.mark.xfail(strict=True, reason="issue 18 fix not in this tree yet (see PENDING)")
def test_pending(case, tmp_path, traces):
    check(case, tmp_path, traces)


def test_catalogue_size():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES + PENDING}) == len(CASES) + len(PENDING)
