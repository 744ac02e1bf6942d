"""`kvsched workload export`: a workload read back from its exported file is the same workload
(times, lengths, tiers, shared prompt segments, Mooncake hash_ids), so a prefix-cached simulation
of the file gives the same summary; a CSV that would lose content is refused."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.workload.source import WorkloadOptions, load

runner = CliRunner()
SHARED = dict(num_requests=200, shared_prefix="1000:0.3,400:0.4", rate=4.0, seed=3, tiers=["gold:0.5", "free:0.5"])


def invoke(*args: str):
    return runner.invoke(app, list(args))


def export_args(opts: dict) -> list[str]:
    """The workload flags for `opts` (the WorkloadOptions fields used here)."""
    flags = {"num_requests": "--num-requests", "shared_prefix": "--shared-prefix", "rate": "--rate",
             "seed": "--seed", "trace": "--trace", "cap_len": "--cap-len"}
    args = [a for key, flag in flags.items() if key in opts for a in (flag, str(opts[key]))]
    return args + [a for t in opts.get("tiers", []) for a in ("--tier", t)]


def assert_same(back, w) -> None:
    assert len(back) == len(w)
    for name in ("arrival", "prompt", "output"):
        assert np.array_equal(getattr(back, name), getattr(w, name)), name
    assert [back.tiers[k].name if k >= 0 else None for k in back.tier_index.tolist()] == \
           [w.tiers[k].name if k >= 0 else None for k in w.tier_index.tolist()]
    for part in ("ids", "lengths"):
        a, b = getattr(back.segments, part), getattr(w.segments, part)
        assert np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets), part
    assert (back.prefix is None) == (w.prefix is None)
    if w.prefix is not None:
        assert np.array_equal(back.prefix.values, w.prefix.values)
        assert np.array_equal(back.prefix.offsets, w.prefix.offsets)


@pytest.mark.parametrize("opts", [
    SHARED,                                                                 # system prompts
    dict(trace="mooncake-conversation", num_requests=300),                  # hash_ids -> 512-token blocks
    dict(trace="mooncake-conversation", num_requests=100, cap_len=4000),    # blocks clipped to the cap
], ids=["shared-prefix", "mooncake", "mooncake-capped"])
def test_jsonl_export_reads_back_the_same_requests(tmp_path, opts):
    out = tmp_path / "w.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # the cap's count of shortened requests
        r = invoke("workload", "export", *export_args(opts), "--out", str(out))
        assert r.exit_code == 0, r.output
        w = load(WorkloadOptions(**opts, keep_hashes=True))
    back = load(WorkloadOptions(trace=str(out), keep_hashes=True))
    assert w.segments is not None and len(w.segments.ids.values)
    assert_same(back, w)


def test_prefix_cached_simulation_of_the_export_gives_the_same_summary(tmp_path):
    out = tmp_path / "w.jsonl"
    assert invoke("workload", "export", *export_args(SHARED), "--out", str(out)).exit_code == 0
    run = ["simulate", "--prefix-caching", "on", "--json"]
    a = invoke(*run, *export_args(SHARED))
    b = invoke(*run, "--trace", str(out))
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    sa, sb = json.loads(a.stdout), json.loads(b.stdout)
    for s in (sa, sb):
        s.pop("wall_seconds")
        s["tiers"].sort(key=lambda t: t["name"])      # a trace's tiers come back in name order
    assert sa["prefix_hit_rate"] > 0.1 and sa == sb


@pytest.mark.parametrize("opts,lost", [
    (SHARED, "shared prompt segments"),
    (dict(trace="mooncake-conversation", num_requests=20), "shared prompt segments (the content prefix caching "
                                                           "shares) and Mooncake hash_ids"),
])
def test_csv_export_refuses_what_it_would_lose(tmp_path, opts, lost):
    out = tmp_path / "w.csv"
    r = invoke("workload", "export", *export_args(opts), "--out", str(out))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and lost in r.stderr, r.output
    assert "write w.jsonl (JSONL) to keep them" in r.stderr and not out.exists()


def test_plain_workloads_still_export_csv_and_compressed_names_are_refused(tmp_path):
    out = tmp_path / "w.csv"
    assert invoke("workload", "export", "--num-requests", "5", "--out", str(out)).exit_code == 0
    assert out.read_text().startswith("arrival_time,prompt_tokens,output_tokens\n")
    r = invoke("workload", "export", "--num-requests", "5", "--out", str(tmp_path / "w.csv.gz"))
    assert r.exit_code == 2 and "a .gz file is read back as compressed" in r.stderr
    assert not (tmp_path / "w.csv.gz").exists()
