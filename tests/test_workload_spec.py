"""Phases, tiers, presets, workload files, capping and export."""
from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.workload import Fixed, Phase, RequestType, Tier, TierShare, WorkloadSpec, load_trace
from kvsched.workload.config import load_workload_file
from kvsched.workload.presets import PRESETS, SHAREGPT_FILE
from kvsched.workload.source import WorkloadOptions, load
from kvsched.workload.stats import describe

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def within(sample: np.ndarray, mean: float, sd: float, k: float = 4.0) -> bool:
    return abs(sample.mean() - mean) <= k * sd / math.sqrt(len(sample))


def jitter_sd(mean: int) -> float:        # uniform on [mean/2, 3 mean/2]
    return mean / math.sqrt(12)


def test_distribution_shift_phases():
    w = load(WorkloadOptions(workload="eb-distribution-shift"))
    assert w.closed_loop and set(w.concurrency.tolist()) == {2048}
    for k, (p, o) in enumerate([(1024, 128), (512, 512), (128, 1024)]):
        m = w.phase == k
        assert m.sum() == 2000
        assert within(w.prompt[m], p, jitter_sd(p)) and within(w.output[m], o, jitter_sd(o))
        assert w.prompt[m].min() >= p // 2 and w.prompt[m].max() <= 3 * p // 2
    assert np.all(np.diff(w.phase) >= 0)                        # phases in issue order


def test_concurrency_shift_phases():
    w = load(WorkloadOptions(workload="eb-concurrency-shift"))
    cs = [int(w.concurrency[w.phase == k][0]) for k in range(5)]
    assert cs == [32, 512, 1024, 256, 2048]
    assert within(w.prompt, 512, jitter_sd(512)) and within(w.output, 256, jitter_sd(256))
    assert describe(w)["closed_loop_concurrency"] == cs


@pytest.mark.parametrize("preset,paying", [("slai-paying-5", 0.05), ("slai-paying-50", 0.5), ("slai-paying-95", 0.95)])
def test_tier_presets_shares_and_slos(preset, paying):
    w = load(WorkloadOptions(workload=preset, num_requests=20_000))
    names = [t.name for t in w.tiers]
    share = (w.tier_index == names.index("paying")).mean()
    assert abs(share - paying) <= 4 * math.sqrt(paying * (1 - paying) / len(w))
    tiers = {t.name: t for t in w.tiers}
    assert tiers["paying"].tbt_slo == 0.1 and tiers["free"].tbt_slo == 0.5
    assert tiers["paying"].priority < tiers["free"].priority
    assert (w.prompt + w.output).max() <= 8192


def test_stability_presets():
    for name, (hp, ho) in {"stability-pd-1-1": (1600, 1600), "stability-pd-2-1": (2133, 1066),
                           "stability-pd-1-2": (1066, 2133)}.items():
        w = load(WorkloadOptions(workload=name))
        assert w.prompt.min() >= 10 and w.prompt.max() <= hp and w.output.max() <= ho
        assert within(w.prompt, (10 + hp) / 2, (hp - 10) / math.sqrt(12))
        assert abs(describe(w)["mean_rate"] - 5.0) < 0.3
    w = load(WorkloadOptions(workload="stability-pd-switch"))
    first, second = w.phase == 0, w.phase == 1
    assert first.sum() == second.sum() == 5000
    assert w.arrival[first].max() <= w.arrival[second].min()        # the switch is mid-trace
    assert w.output[first].mean() < 600 < w.output[second].mean()


def test_wait_presets_type_mix():
    w = load(WorkloadOptions(workload="wait-high-demand"))
    assert w.output_known.all() and set(w.prompt.tolist()) == {20}
    for out, share in ((100, 0.5), (200, 1 / 3), (300, 1 / 6)):
        assert abs((w.output == out).mean() - share) < 0.015
    assert abs(describe(w)["mean_rate"] - 12_000) < 300
    w = load(WorkloadOptions(workload="nested-wait-4type"))
    assert not w.output_known.any()
    for out, share in zip((20, 40, 80, 160), np.array([20, 40, 80, 160]) / 300):
        assert abs((w.output == out).mean() - share) < 0.02


def test_every_preset_builds_and_overrides_apply():
    for name in PRESETS:
        w = load(WorkloadOptions(workload=name, num_requests=50, seed=1))
        assert len(w) == 50 * len(w.phases)
    w = load(WorkloadOptions(workload="eb-balanced", arrivals="closed:64", num_requests=300))
    assert set(w.concurrency.tolist()) == {64}
    w = load(WorkloadOptions(workload="wait-low-demand", rate=100.0))
    assert abs(describe(w)["mean_rate"] - 100) < 5 and set(w.output.tolist()) == {10, 20}
    with pytest.raises(KvschedError, match="closed-loop"):
        load(WorkloadOptions(workload="eb-balanced", rate=5.0))


def test_sharegpt_preset_reads_the_trace_whatever_kvsched_traces_holds(tmp_path, monkeypatch):
    """Never a stand-in: KVSCHED_TRACES is searched first, then the bundled copy."""
    bundled = load(WorkloadOptions(workload="sharegpt", num_requests=300))
    assert np.median(bundled.prompt) > 1000         # ShareGPT's lengths (median prompt 1730)
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))                 # lacks the file: the bundled one
    r = invoke("workload", "stats", "sharegpt", "--json")
    assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout)["requests"] == 2000
    assert np.array_equal(load(WorkloadOptions(workload="sharegpt", num_requests=300)).prompt, bundled.prompt)
    (tmp_path / SHAREGPT_FILE).write_text("num_prefill_tokens,num_decode_tokens\n7,9\n")   # the user's own
    w = load(WorkloadOptions(workload="sharegpt", num_requests=30))
    assert set(w.prompt.tolist()) == {7} and set(w.output.tolist()) == {9}
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path / "missing"))
    r = invoke("simulate", "-w", "sharegpt")
    assert r.exit_code == 2 and "KVSCHED_TRACES" in r.stderr and "is not a folder" in r.stderr


def test_tiers_from_flags_and_generic_trace_tier_column(tmp_path):
    w = load(WorkloadOptions(num_requests=4000, tiers=["gold:0.25:tbt=0.1:priority=0", "free:0.75:ttft=2"]))
    assert abs((w.tier_index == 0).mean() - 0.25) < 0.03
    assert w.tiers[0].tbt_slo == 0.1 and w.tiers[1].ttft_slo == 2.0
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens,tier\n0,5,5,gold\n1,5,5,\n2,5,5,free\n")
    spec = tmp_path / "w.toml"
    spec.write_text(f'trace = "{f.name}"\n[[tiers]]\nname = "gold"\ntbt_slo = 0.05\n')
    w = load(WorkloadOptions(workload=str(spec)))
    tiers = {t.name: t for t in w.tiers}
    assert tiers["gold"].tbt_slo == 0.05 and tiers["free"].tbt_slo is None
    assert [w.tiers[k].name if k >= 0 else None for k in w.tier_index.tolist()] == ["gold", None, "free"]
    with pytest.raises(KvschedError, match="sum to 1"):
        load(WorkloadOptions(tiers=["a:0.5", "b:0.4"]))


TOML = """
name = "demo"
seed = 4
[[tiers]]
name = "paying"
share = 0.1
tbt_slo = 0.1
[[tiers]]
name = "free"
share = 0.9
tbt_slo = 0.5
priority = 1
[[phases]]
name = "warm"
requests = 300
prompt = "jitter:1024"
output = "jitter:128"
arrivals = "poisson:4"
[[phases]]
name = "mix"
requests = 600
arrivals = "gamma:8:2"
[[phases.types]]
prompt = "fixed:10"
output = "fixed:20"
rate = 1
[[phases.types]]
prompt = "fixed:10"
output = "fixed:40"
rate = 3
"""


def test_workload_file(tmp_path):
    f = tmp_path / "demo.toml"
    f.write_text(TOML)
    w = load_workload_file(f).build()
    assert w.phases == ("warm", "mix") and len(w) == 900
    mix = w.phase == 1
    assert abs((w.output[mix] == 40).mean() - 0.75) < 0.06
    assert w.arrival[w.phase == 0].max() <= w.arrival[mix].min()
    s = describe(w)
    assert [p["name"] for p in s["phases"]] == ["warm", "mix"]
    assert np.array_equal(w.prompt, load_workload_file(f).build().prompt)        # seeded
    r = invoke("simulate", "--workload", str(f), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["completed"] == 900


@pytest.mark.parametrize("text,needle", [
    ("requests = 5\nprompt = 'fixed:1'\noutput = 'fixed:1'\narrivals = 'poisson:1'\nbogus = 1\n", "unknown key 'bogus'"),
    ("[[phases]]\nrequests = 'many'\nprompt = 'fixed:1'\noutput = 'fixed:1'\n", "requests must be an integer"),
    ("[[phases]]\nrequests = 5\nprompt = 'fixed:1'\n", "give prompt and output together"),
    ("[[phases]]\nrequests = 5\n", "give either request lengths"),
    ("requests = [\n", "not a valid TOML workload file"),
    ("[[phases]]\nrequests = 5\nprompt = 'fixed:1'\noutput = 'fixed:1'\narrivals = 'replay'\n", "replay needs a timed trace"),
    ("[[phases]]\nrequests = 5\nprompt = 'fixed:1'\noutput = 'fixed:1'\narrivals = 'closed:3'\n"
     "[[phases]]\nrequests = 5\nprompt = 'fixed:1'\noutput = 'fixed:1'\narrivals = 'poisson:3'\n",
     "mix closed-loop and open-loop"),
])
def test_bad_workload_files(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    r = invoke("workload", "stats", str(f))
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_phase_flags():
    w = load(WorkloadOptions(phases=["requests=100 prompt=fixed:8 output=fixed:4 arrivals=closed:4",
                                     "requests=50 prompt=fixed:16 output=fixed:2 arrivals=closed:8"]))
    assert len(w) == 150 and w.concurrency[w.phase == 1].tolist() == [8] * 50
    with pytest.raises(KvschedError, match="one workload source"):
        load(WorkloadOptions(workload="eb-balanced", phases=["requests=1 prompt=fixed:1 output=fixed:1"]))


def test_cap_len_reports_counts(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n0,100,10\n1,30,80\n2,10,10\n")
    with pytest.warns(UserWarning, match=r"capped 2 of 3 requests at 64 tokens .*: 1 prompts and 2 outputs"):
        w = load(WorkloadOptions(trace=f, cap_len=64))
    assert w.prompt.tolist() == [63, 30, 10] and w.output.tolist() == [1, 34, 10]
    r = invoke("workload", "stats", str(f), "--cap-len", "64", "--json")
    assert r.exit_code == 0 and "capped 2 of 3" in r.stderr


def test_export_round_trip(tmp_path):
    out = tmp_path / "w.csv"
    r = invoke("workload", "export", "slai-paying-5", "--num-requests", "300", "--out", str(out))
    assert r.exit_code == 0, r.output
    w = load(WorkloadOptions(workload="slai-paying-5", num_requests=300))
    back = load_trace(out)
    assert np.array_equal(back.arrival, w.arrival) and np.array_equal(back.prompt, w.prompt)
    assert np.array_equal(back.output, w.output)
    def names(x):
        return [x.tiers[k].name for k in x.tier_index.tolist()]
    assert names(back) == names(w)
    r = invoke("workload", "export", "eb-balanced", "--out", str(tmp_path / "c.csv"))
    assert r.exit_code == 2 and "closed-loop" in r.stderr and not (tmp_path / "c.csv").exists()


def test_mooncake_spread_and_hashes_kept(traces_dir):
    path = traces_dir / "mooncake-conversation.jsonl"
    raw = load(WorkloadOptions(trace=path, num_requests=500))
    w = load(WorkloadOptions(trace=path, num_requests=500, spread=3.0, seed=2, keep_hashes=True))
    assert np.all(np.diff(w.arrival) >= 0) and len(w.prefix) == 500
    assert describe(w)["cv_interarrival"] < describe(raw)["cv_interarrival"]
    order = np.argsort(w.ids)
    assert np.all(w.arrival[order] >= raw.arrival) and np.all(w.arrival[order] < raw.arrival + 3.0)
    assert np.array_equal(w.prompt[order], raw.prompt)


def test_unknown_source_and_misplaced_flags():
    with warnings.catch_warnings():
        for opts, needle in ((WorkloadOptions(workload="nope"), "unknown workload 'nope'"),
                             (WorkloadOptions(workload="sharegpt", prompt_len="fixed:3"), "--prompt-len"),
                             (WorkloadOptions(window="0:10"), "--window and --format apply to trace files"),
                             (WorkloadOptions(spread=3.0), "spread applies to replayed trace times")):
            warnings.simplefilter("ignore")
            with pytest.raises(KvschedError, match=needle):
                load(opts)


NAN, INF = float("nan"), float("inf")
ONE = (RequestType(Fixed(1), Fixed(1)),)


@pytest.mark.parametrize("spec,needle", [
    (lambda: WorkloadSpec((Phase(NAN, ONE),)), "phase 1: requests must be an integer >= 1, got nan"),
    (lambda: WorkloadSpec((Phase(INF, ONE),)), "phase 1: requests must be an integer >= 1, got inf"),
    (lambda: WorkloadSpec((Phase(True, ONE),)), "phase 1: requests must be an integer >= 1, got True"),
    (lambda: WorkloadSpec((Phase(5, ONE),), cap_len=NAN), "--cap-len must be an integer >= 2 tokens, got nan"),
    (lambda: WorkloadSpec((Phase(5, ONE),), cap_len=2 ** 70), "--cap-len must be at most 2,199,023,255,552 tokens"),
    (lambda: WorkloadSpec((Phase(5, ONE),), tiers=(TierShare(Tier("a"), NAN),)), "tier shares must be >= 0 and sum to 1"),
    (lambda: WorkloadSpec((Phase(5, ONE),), tiers=(TierShare(Tier("a"), True),)), "tier shares must hold numbers"),
    (lambda: WorkloadSpec((Phase(5, (RequestType(Fixed(1), Fixed(1), rate=True),)),)), "request type rates must hold numbers"),
    (lambda: WorkloadSpec((Phase(5, ONE + (RequestType(Fixed(1), Fixed(1), rate=INF),)),)), "needs a finite rate"),
    (lambda: WorkloadSpec((Phase(5, trace="mooncake-conversation", window=(True, 5)),)), "window needs 0 <= start < end"),
])
def test_spec_numbers_are_checked_not_cast(spec, needle):
    with pytest.raises(KvschedError, match=re.escape(needle)):
        spec().build()


@pytest.mark.parametrize("args,needle", [
    (["--cap-len", "99999999999999999999999"], "--cap-len must be at most 2,199,023,255,552 tokens"),   # was an OverflowError
    (["--tier", "a:1:priority=99999999999999999999"], "tier a: priority must be an integer in"),
])
def test_workload_flags_out_of_range_are_one_line_errors(tmp_path, args, needle):
    r = invoke("workload", "export", "--num-requests", "3", *args, "--out", str(tmp_path / "w.csv"))
    assert r.exit_code == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.output
