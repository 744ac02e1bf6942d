"""Per-tier figures in the summary: TTFT, TPOT and ITL per tier, SLO attainment, the
first-token-zero TBT option, per-tier gap histograms kept by the replicas and merged by clusters."""
from __future__ import annotations

import gc
import json
import math

import numpy as np
import pytest
from rich.console import Console

from conftest import Forwarding
from kvsched.hardware import get_gpu
from kvsched.metrics import GapHistogram, summarize
from kvsched.policies import make_policy
from kvsched.sim.records import merged_tiers
from kvsched.report.table import comparison_table, summary_table
from kvsched.run import Scenario, simulate
from kvsched.workload.request import Tier, Workload

GOLD = Tier("gold", ttft_slo=0.5, tbt_slo=0.03, priority=0)
FREE = Tier("free", tbt_slo=0.2, priority=1)
TOP = ("completed", "rejected", "total_input", "total_output", "duration", "request_throughput",
       "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
       "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p90_tpot_ms",
       "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p90_itl_ms", "p99_itl_ms",
       "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "mean_kv_usage", "peak_kv_usage", "preemptions",
       "iterations", "simulated_seconds")


def two_tiers(n: int = 400, seed: int = 0, tiered: bool = True, untiered: float = 0.1, rate: float = 12.0):
    """Poisson arrivals, prompts 20..600, outputs 1..80; gold 30%, free 60%, no tier 10%."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompt = rng.integers(20, 601, n)
    output = rng.integers(1, 81, n)
    tier = rng.choice([0, 1, -1], size=n, p=[0.3, 0.7 - untiered, untiered])
    if not tiered:
        return Workload.build(arrival, prompt, output)
    return Workload.build(arrival, prompt, output, tier_index=tier, tiers=[GOLD, FREE])


def _replica_behind(v):
    """The replica behind a view (test-only access, through the interpreter's introspection:
    nothing of the view leads to it)."""
    from kvsched.sim.replica import Replica
    return next(o for o in gc.get_referents(v) if isinstance(o, Replica))


class TokenTimes(Forwarding):
    """Wraps a policy and writes down when each request's every output token came out."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.times: dict[int, list[float]] = {}
        self.replica = None
        self.batches = self.checks = 0

    def schedule(self, v):
        return self.inner.schedule(v)

    def _seen(self, i: int, v) -> None:
        t = self.times.setdefault(i, [])
        g = v.generated(i)
        assert g - len(t) in (0, 1)
        if g > len(t):
            t.append(v.now)

    def on_batch_end(self, v) -> None:
        for i in list(v.running):
            self._seen(i, v)
        self._pass("on_batch_end", v)
        self.replica = _replica_behind(v)
        self.batches += 1
        if self.replica.tier_itl is not None and self.batches % 40 == 0:
            # gaps so far, with those of requests still decoding: every tiered gap is in a tier
            hs = merged_tiers([self.replica])
            untiered = sum(len(np.diff(t)) for i, t in self.times.items() if self.replica.reqs.tier[i] < 0)
            assert sum(h.n for h in hs) + untiered == self.replica.itl.n
            self.checks += 1

    def on_finish(self, i, v) -> None:
        self._seen(i, v)
        super().on_finish(i, v)


def rank_quantile(gaps: np.ndarray, q: float, zeros: int = 0) -> float:
    """The histogram's rank rule on the exact gaps: the ceil(q n)-th smallest."""
    x = np.sort(np.concatenate([np.zeros(zeros), gaps]))
    return float(x[max(1, math.ceil(q * len(x))) - 1])


def scenario(w, **kw) -> Scenario:
    return Scenario(w, model="llama-3-8b", gpu="a100-80gb", cost="roofline", client=None, **kw)   # engine times


@pytest.mark.parametrize("policy,kv", [("sarathi", None), ("vllm-v1", 4000)])
def test_tier_itl_matches_brute_force_token_times(policy, kv):
    """A policy wrapper records every token time: each tier's gap count, p50/p90/p99, mean and
    share of gaps within its TBT SLO match the histograms (vllm-v1 on a small KV pool
    preempts, so resumed requests' long gaps are in it too)."""
    w = two_tiers()
    pol = TokenTimes(make_policy(policy, {}, get_gpu("a100-80gb")))
    r = simulate(scenario(w, kv_capacity=kv, tbt_first_zero=True), pol)
    s, rec = r.summary, r.records
    assert s["completed"] == len(w)
    if kv is not None:
        assert s["preemptions"] > 0
    gaps = {i: np.diff(np.array(t)) for i, t in pol.times.items()}
    assert all(len(pol.times[i]) == w.output[i] for i in range(len(w)))
    every = np.concatenate(list(gaps.values()))
    assert rec.itl.n == len(every)
    assert sum(h.n for h in rec.tier_itl) == int(sum(len(gaps[i]) for i in range(len(w)) if w.tier_index[i] >= 0))
    for t, (tier, row) in enumerate(zip(w.tiers, s["tiers"])):
        mine = np.flatnonzero(w.tier_index == t)
        g = np.concatenate([gaps[i] for i in mine])
        h = rec.tier_itl[t]
        assert row["name"] == tier.name and row["requests"] == len(mine) == row["completed"]
        assert h.n == len(g) and h.total == pytest.approx(g.sum(), rel=1e-9)
        assert row["mean_itl_ms"] == pytest.approx(g.mean() * 1000, rel=1e-9)
        for q, key in ((0.5, "median_itl_ms"), (0.9, "p90_itl_ms"), (0.99, "p99_itl_ms")):
            assert row[key] == pytest.approx(rank_quantile(g, q) * 1000, rel=6e-4)
        assert row["p99_tbt_first_zero_ms"] == pytest.approx(rank_quantile(g, 0.99, len(mine)) * 1000, rel=6e-4)
        assert row["itl_slo_attainment"] == pytest.approx((g <= tier.tbt_slo).mean(), abs=1e-12)
        viol = np.array([int((gaps[i] > tier.tbt_slo).sum()) for i in mine])
        assert np.array_equal(rec.tbt_violations[mine], viol)
        assert row["tbt_slo_attainment"] == pytest.approx((viol == 0).mean())
        ttft = rec.first_token[mine] - rec.arrival[mine]
        assert row["median_ttft_ms"] == pytest.approx(np.percentile(ttft, 50) * 1000)
        assert row["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99) * 1000)
    assert s["p99_tbt_first_zero_ms"] == pytest.approx(rank_quantile(every, 0.99, len(w)) * 1000, rel=6e-4)
    assert pol.checks > 0                     # the pending-window invariant ran at batch ends


def test_tier_counts_attainment_and_slos():
    w = two_tiers(seed=1)
    r = simulate(scenario(w), "sarathi")
    s, rec = r.summary, r.records
    rows = s["tiers"]
    assert [row["name"] for row in rows] == ["gold", "free"]
    assert sum(row["requests"] for row in rows) + int((w.tier_index < 0).sum()) == len(w)
    assert sum(row["completed"] for row in rows) <= s["completed"]
    for t, row in enumerate(rows):
        mine = w.tier_index == t
        for key in ("ttft_slo_attainment", "tbt_slo_attainment", "itl_slo_attainment"):
            v = row[key]
            assert v is None or 0 <= v <= 1
        assert row["tbt_slo_attainment"] == pytest.approx((rec.tbt_violations[mine] == 0).mean())
        assert row["itl_slo_attainment"] == pytest.approx(1 - rec.tbt_violations[mine].sum() / rec.tier_itl[t].n)
    gold, free = rows
    ttft = (rec.first_token - rec.arrival)[w.tier_index == 0]
    assert gold["ttft_slo_attainment"] == pytest.approx((ttft <= 0.5).mean())
    assert free["ttft_slo_attainment"] is None            # free sets no TTFT SLO
    assert (gold["ttft_slo_s"], gold["tbt_slo_s"], gold["priority"]) == (0.5, 0.03, 0)
    assert "p99_tbt_first_zero_ms" not in s and "p99_tbt_first_zero_ms" not in gold


def test_cluster_merges_tier_histograms():
    w = two_tiers(n=600, seed=2, untiered=0.0, rate=25.0)
    r = simulate(scenario(w, replicas=2, router="round-robin"), "sarathi")
    s, rec = r.summary, r.records
    assert len(s["tiers"]) == 2 and len(s["replica_breakdown"]) == 2
    assert sum(h.n for h in rec.tier_itl) == rec.itl.n       # every request has a tier
    merged = GapHistogram.merged(rec.tier_itl)
    assert merged.counts == rec.itl.counts and merged.max == rec.itl.max
    assert merged.total == pytest.approx(rec.itl.total, rel=1e-12)
    assert all(row["requests"] == row["completed"] > 0 for row in s["tiers"])
    assert all(math.isfinite(row["p99_itl_ms"]) for row in s["tiers"])


def test_disaggregated_pools_keep_tier_gaps():
    w = two_tiers(n=300, seed=3, untiered=0.0)
    r = simulate(scenario(w, prefill_replicas=1, decode_replicas=1), "sarathi")
    rec = r.records
    assert sum(h.n for h in rec.tier_itl) == rec.itl.n == int((w.output - 1).sum())


@pytest.mark.parametrize("replicas", [1, 2])
def test_top_level_identical_with_and_without_tiers(replicas):
    """Sarathi ignores tiers: every top-level figure is the same bit for bit."""
    plain = simulate(scenario(two_tiers(tiered=False), replicas=replicas), "sarathi")
    tiered = simulate(scenario(two_tiers(), replicas=replicas), "sarathi")
    assert "tiers" not in plain.summary and "tiers" in tiered.summary
    for key in TOP:
        a, b = plain.summary[key], tiered.summary[key]
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), key
    assert plain.records.itl.counts == tiered.records.itl.counts
    assert plain.records.itl.total == tiered.records.itl.total
    assert plain.records.tier_itl is None


def test_no_tiers_keeps_the_plain_hot_path():
    from kvsched.kvcache import PagedKV
    from kvsched.cost import ConstantCost
    from kvsched.sim.server import Server
    w = two_tiers(n=20, tiered=False)
    server = Server(w, make_policy("sarathi", {}, get_gpu("a100-80gb")), ConstantCost(0.01), PagedKV(100_000, 16))
    rep = server.replica
    assert rep.tier_itl is None
    server = Server(two_tiers(n=20), make_policy("sarathi", {}, get_gpu("a100-80gb")), ConstantCost(0.01),
                    PagedKV(100_000, 16))
    assert len(server.replica.tier_itl) == 2


def test_tbt_first_zero_top_level_and_quantile_rule():
    h = GapHistogram()
    for g in (1.0, 2.0, 3.0):
        h.add(g)
    assert h.quantile(0.99, zeros=97) == pytest.approx(2.0, rel=1e-3)   # rank 99 of 100: the 2nd gap
    assert h.quantile(0.5, zeros=97) == 0.0
    assert h.quantile(0.99) == h.quantile(0.99, zeros=0)
    w = Workload.build(np.arange(200) * 0.5, [100] * 200, [2] * 200)       # one gap per request
    r = simulate(scenario(w, tbt_first_zero=True), "sarathi")
    s = r.summary
    firsts = int(np.isfinite(r.records.first_token).sum())
    assert s["p99_tbt_first_zero_ms"] == r.records.itl.quantile(0.99, zeros=firsts) * 1000
    assert s["p99_itl_ms"] == simulate(scenario(w), "sarathi").summary["p99_itl_ms"]


def test_add_many_bins_exactly_as_add():
    rng = np.random.default_rng(11)
    h = GapHistogram()
    edges = np.exp(h._log_low + np.arange(0, h._top + 3, 13) / h._scale)
    gaps = np.concatenate([rng.lognormal(-4, 3, 50_000), edges, np.nextafter(edges, 0), np.nextafter(edges, 1),
                           [0.0, 1e-9, h.low, 1e6, 1e9]])
    one, many = GapHistogram(), GapHistogram()
    for g in gaps.tolist():
        one.add(g)
    many.add_many(gaps[:7])
    many.add_many(gaps[7:])
    many.add_many(np.zeros(0))
    assert one.counts == many.counts and one.n == many.n and one.max == many.max
    assert one.total == pytest.approx(many.total, rel=1e-12)
    assert one.total_sq == pytest.approx(many.total_sq, rel=1e-12)


def test_tiers_in_summary_json_and_tables(tmp_path):
    w = two_tiers(n=150)
    a = simulate(scenario(w, tbt_first_zero=True), "sarathi")
    b = simulate(scenario(w, tbt_first_zero=True), "vllm-v1")
    a.write(tmp_path / "out")
    data = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [row["name"] for row in data["tiers"]] == ["gold", "free"]
    assert data["tiers"][1]["ttft_slo_attainment"] is None
    assert data["tiers"][0]["p99_itl_ms"] == a.summary["tiers"][0]["p99_itl_ms"]
    console = Console(width=200, record=True)
    console.print(summary_table(a.summary))
    console.print(comparison_table([a.summary, b.summary]))
    text = console.export_text()
    assert "per tier" in text and "gold" in text and "p99 TBT0 ms" in text
    assert "tier gold: p99 ITL ms" in text and "tier free: requests meeting TBT SLO" in text


def test_summarize_without_tier_histograms_gives_nan_itl():
    """RunRecords built by hand with tiers but no histograms: ITL figures are NaN, not an error."""
    w = two_tiers(n=50)
    rec = simulate(scenario(w), "sarathi").records
    rec.tier_itl = None
    rows = summarize(rec)["tiers"]
    assert math.isnan(rows[0]["p99_itl_ms"]) and math.isnan(rows[0]["itl_slo_attainment"])
