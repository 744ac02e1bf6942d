"""The cluster's control plane (issue 35): autoscaling with cold starts and drains, admission
control, shedding and abandonment, LoRA adapters and several models, cost and energy, and
diurnal arrivals (docs/control-plane.md)."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu
from kvsched.prices import read_prices
from kvsched.run import Scenario, simulate
from kvsched.sim.admission import Admission, Limit, ShedRule, parse_abandon, parse_admit, parse_shed
from kvsched.sim.autoscale import HpaScaler, PoolSignals, SloScaler, parse_autoscale
from kvsched.sim.lora import LoraConfig, Residency, adapter_params
from kvsched.sim.routers import RoundRobin
from kvsched.workload.arrivals import Diurnal, parse_arrivals
from kvsched.workload.request import Tier, Workload
from kvsched.workload.tags import parse_adapters, tag

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def run(w: Workload, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate(Scenario(w, **{"model": "llama-3-8b", "gpu": "h100-sxm", **kw}))


class Step:
    """A scripted scaler: `before` replicas until t = at, then `after`."""
    name = "step"

    def __init__(self, at: float, before: int, after: int) -> None:
        self.at, self.before, self.after = at, before, after
        self.seen = []

    def decide(self, t, pools):
        self.seen.append((t, pools[0]))
        return [self.after if t >= self.at else self.before for _ in pools]


class Counting(RoundRobin):
    """Round-robin that records how many replicas each arrival was offered."""
    name = "counting"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.offered: dict[float, int] = {}

    def route(self, i, t, replicas):
        self.offered[t] = replicas
        return super().route(i, t, replicas)


# ----- autoscaling ---------------------------------------------------------------------------
def test_a_replica_added_at_100s_with_a_60s_cold_start_takes_traffic_at_160s_and_is_paid_from_100s():
    """Hand-worked: the scaler decides 2 replicas at t = 100 (its tick every 10 s); the cold
    start is 60 s, so the router is offered the second replica from t = 160 exactly (an arrival
    at 160 s included), and its GPU-hours count from 100 s: (end + end - 100) / 3600."""
    router = Counting()
    w = Workload.build(np.arange(1, 300, 0.5), 200, 20)
    scaler = Step(100, 1, 2)
    r = run(w, replicas=2, router=router, autoscale=scaler, autoscale_params={"interval_s": 10, "cold_start_s": 60})
    before = [t for t in router.offered if t < 160]
    assert router.offered.get(160.0) == 2, "the arrival at 160 s is offered the new replica"
    assert not before or max(before) < 160
    assert all(n == 1 for t, n in router.offered.items() if t < 160) and 2 in router.offered.values()
    arrival, replica = r.records.arrival, r.records.replica
    assert (replica[arrival < 160] == 0).all() and (replica[arrival >= 160] == 1).any()
    end = max(float(r.records.finished.max()), float(arrival.max()))
    assert r.summary["gpu_hours"] == pytest.approx((end + (end - 100)) / 3600, rel=1e-12)
    assert r.summary["autoscale"]["replicas_over_time"] == [[0.0, 1], [160.0, 2]]
    t, sig = scaler.seen[-1]                # the signals at the last decision: arrivals every 0.5 s
    assert sig.arrival_rate == pytest.approx(2.0, abs=0.05) and sig.up == 2 and sig.starting == 0
    assert sig.ttft_p99_s > 0 and sig.tpot_mean_s > 0 and 0 <= sig.kv_use <= 2
    assert [x[0] for x in sig.replicas] == [0, 1] and sum(x[3] for x in sig.replicas) == sig.kv_use


def test_a_drained_replica_takes_no_new_request_and_is_paid_until_its_last_one_leaves():
    w = Workload.build(np.arange(1, 200, 0.25), 400, 60)
    r = run(w, replicas=2, router="round-robin", autoscale=Step(50, 2, 1),
            autoscale_params={"interval_s": 10, "initial": 2})
    rec = r.records
    late = rec.arrival >= 50
    kept = set(rec.replica[late].tolist())
    assert len(kept) == 1                                           # nothing routed to the drained one after 50 s
    gone = rec.replica == 1 - kept.pop()
    assert gone.any() and rec.arrival[gone].max() < 50
    drained = max(50.0, float(rec.finished[gone].max()))           # off at the decision if already empty
    end = max(float(rec.finished.max()), float(rec.arrival.max()))
    assert r.summary["gpu_hours"] == pytest.approx((end + drained) / 3600, rel=1e-12)
    assert r.summary["autoscale"]["replicas_over_time"][-1] == [pytest.approx(drained), 1]


def test_the_hpa_reads_kv_use_during_batches_behind_a_round_robin_router():
    """The signals are the replicas' state at the decision, mid-batch included (a router that
    reads no state keeps no batch-start snapshot of its own)."""
    rng = np.random.default_rng(6)
    w = Workload.build(np.sort(rng.uniform(0, 120, 2400)), rng.integers(500, 2000, 2400), rng.integers(100, 400, 2400))
    r = run(w, gpu="l4", replicas=4, router="round-robin", autoscale="hpa",
            autoscale_params={"metric": "kv", "target": "0.5", "interval_s": "5", "cold_start_s": "5"})
    assert max(up for _, up in r.summary["autoscale"]["replicas_over_time"]) == 4


def test_a_request_waiting_for_an_adapter_slot_goes_in_when_one_frees():
    """max_loras 2: A (adapter 0) and C (adapter 1, a long output) hold both slots; B (adapter 2)
    waits, and goes in when A finishes, not when the long C does."""
    w = dataclasses.replace(Workload.build([0.0, 0.01, 0.5], 100, [200, 2000, 10]),
                            adapter=np.array([0, 1, 2], np.int32))
    r = run(w, lora_params={"max_loras": "2"})
    a_done, c_done, b_first = r.records.finished[0], r.records.finished[1], r.records.first_token[2]
    assert a_done < b_first < a_done + 0.2 < c_done
    assert r.summary["lora"]["adapters_waited"] == 1 and r.summary["lora"]["adapter_loads"] == 3


def test_a_replica_started_again_is_cold_its_adapters_and_prefix_cache_gone():
    class Phases:
        name = "phases"

        def decide(self, t, pools):
            return [2 if t < 50 or t >= 100 else 1]
    n = 300
    w = dataclasses.replace(Workload.build(np.linspace(1, 199, n), 600, 20), adapter=np.zeros(n, np.int32))
    r = run(w, replicas=2, router="round-robin", autoscale=Phases(),
            autoscale_params={"interval_s": 10, "cold_start_s": 10, "initial": 2})
    assert r.summary["autoscale"]["replicas_over_time"] == [[0.0, 2], [50.0, 1], [110.0, 2]]
    assert r.summary["lora"]["adapter_loads"] == 3                   # adapter 0 loads again on the restarted one


def test_replicas_drained_during_their_last_batch_are_paid_to_its_end_and_free_their_adapters():
    """Scale-downs every 0.3 s land inside batches; with adapters, a replica goes off only once
    its last batch has ended and its adapters are unpinned (no request left behind)."""
    r = invoke("simulate", "--gpu", "l4", "--replicas", "4", "--router", "least-outstanding", "--autoscale", "hpa",
               "--autoscale-set", "metric=queue", "--autoscale-set", "target=1", "--autoscale-set", "cold_start_s=0",
               "--autoscale-set", "interval_s=0.3", "--autoscale-set", "down_stabilization_s=0", "--rate", "3",
               "--prompt-len", "uniform:2000:6000", "--output-len", "fixed:1", "--num-requests", "400",
               "--adapters", "4", "--seed", "1", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["completed"] == 400 and len(s["autoscale"]["replicas_over_time"]) > 4


def test_shed_arrivals_count_in_the_demand_the_scaler_sees():
    scaler = Step(1e9, 1, 1)
    w = Workload.build(np.arange(0.0, 60, 0.1), 100, 5, tier_index=0, tiers=(Tier("free"),))
    r = run(w, replicas=2, autoscale=scaler, admit=("free:rate=1",), autoscale_params={"interval_s": 10})
    assert r.summary["shed"] > 400
    assert scaler.seen[-1][1].arrival_rate == pytest.approx(10.0, rel=0.05)     # offered, not admitted (1/s)


def signals(up=2, starting=0, total_kv=1.0, waiting=0, outstanding=0, rate=0.0, p99=None, lo=1, hi=10):
    return PoolSignals("p", up, starting, 0, lo, hi, waiting, outstanding, total_kv, rate, p99, 30.0)


def test_hpa_is_kubernetes_formula_with_tolerance_and_scale_down_stabilization():
    hpa = HpaScaler(metric="kv", target=0.5, tolerance=0.1, down_stabilization_s=300)
    assert hpa.decide(0, [signals(up=2, total_kv=1.5)]) == [3]        # ceil(1.5 / 0.5)
    assert hpa.decide(15, [signals(up=3, total_kv=1.6)]) == [3]       # 1.6 / 1.5 within 10%: kept
    assert hpa.decide(30, [signals(up=3, starting=1, total_kv=2.6)]) == [6]   # ceil(2.6 / 0.5): not-ready count 0
    assert hpa.decide(45, [signals(up=6, total_kv=0.5)]) == [6]       # scale-down: the window's highest (6)
    assert hpa.decide(400, [signals(up=6, total_kv=0.5)]) == [1]      # the window has passed
    assert HpaScaler(metric="queue", target=10).recommend(20, 4, 8) == 2     # down: the ready replicas' ratio
    q = HpaScaler(metric="queue", target=4)
    assert q.decide(0, [signals(up=2, waiting=17)]) == [5]
    fresh = HpaScaler(metric="kv", target=0.5)      # not-ready replicas at 0 reverse the direction: kept
    assert fresh.decide(0, [signals(up=2, starting=2, total_kv=1.3)]) == [4]
    held = HpaScaler(metric="kv", target=0.5)       # the window's highest never raises the count
    held.decide(0, [signals(up=6, total_kv=3.0)])
    assert held.decide(15, [signals(up=3, total_kv=0.5)]) == [3]
    burst = HpaScaler(metric="kv", target=0.5)      # +100% or +4 a decision, the larger
    assert burst.decide(0, [signals(up=1, total_kv=10.0, hi=100)]) == [5]
    assert HpaScaler(metric="kv", target=1e-320).decide(0, [signals(up=1, total_kv=1.0)]) == [5]


def test_slo_scaler_forecasts_over_the_cold_start_and_adds_a_replica_when_the_slo_breaks():
    s = SloScaler(rate_per_replica=2.0, headroom=1.0, ttft_slo_s=1.0, down_stabilization_s=0)
    assert s.decide(0, [signals(rate=5.0)]) == [3]                    # ceil(5 / 2)
    # rate rose 5 -> 6 in 15 s; lead = 30 s cold start + 15 s: forecast 6 + 45/15 = 9
    assert s.decide(15, [signals(rate=6.0)]) == [5]
    assert s.decide(30, [signals(up=5, rate=6.0, p99=2.0)]) == [6]     # breach: one more than 5
    with pytest.raises(KvschedError, match="capacity is 0"):
        SloScaler(rate_per_replica=0.0).decide(0, [signals(rate=1.0)])


def test_autoscale_settings_are_checked():
    for name, kw, msg in [("nope", {}, "one of hpa, slo"), ("hpa", {"bogus": "1"}, "no key 'bogus'"),
                          ("hpa", {"metric": "gpu"}, "metric must be one of"), ("hpa", {"min": "0"}, ">= 1"),
                          ("slo", {"headroom": "2"}, "headroom"), ("hpa", {"interval_s": "nan"}, "not a valid"),
                          ("hpa", {"interval_s": "inf"}, "finite"), ("hpa", {"min": "1.5"}, "not a valid int"),
                          ("hpa", {"cold_start_s": "-1"}, ">= 0")]:
        with pytest.raises(KvschedError, match=msg):
            parse_autoscale(name, kw)
    w = Workload.build(np.arange(1, 20.0), 100, 10)
    with pytest.raises(KvschedError, match="needs --autoscale"):
        run(w, autoscale_params={"min": 1})
    with pytest.raises(KvschedError, match="above pool replicas"):
        run(w, replicas=2, autoscale="hpa", autoscale_params={"min": 3})
    with pytest.raises(KvschedError, match="ttft_slo_s"):
        run(w, replicas=2, autoscale="slo")
    with pytest.raises(KvschedError, match="prefill/decode"):
        run(w, prefill_replicas=1, decode_replicas=1, autoscale="hpa")
    with pytest.raises(KvschedError, match="initial=3 is above"):
        run(w, replicas=2, autoscale="hpa", autoscale_params={"initial": 3})
    bad = invoke("capacity", "--autoscale", "hpa", "--slo", "ttft:p99:1000", "--num-requests", "20")
    assert bad.exit_code == 2 and "drop --autoscale" in bad.output


def test_the_slo_scaler_measures_each_pool_on_its_own_model_requests():
    rng = np.random.default_rng(9)
    w = tag(Workload.build(np.sort(rng.uniform(0, 300, 1500)), rng.integers(300, 1500, 1500),
                           rng.integers(50, 300, 1500)), 0, None, "llama-3-8b:0.6,qwen2.5-7b:0.4")
    r = run(w, gpu="l4", pool=("a=l4:3", "b=l4:3:model=qwen2.5-7b"), router="least-outstanding", autoscale="slo",
            autoscale_params={"ttft_slo_s": 2.0, "cold_start_s": 10})
    assert len(r.summary["autoscale"]["rate_per_replica"]) == 2 and min(r.summary["autoscale"]["rate_per_replica"]) > 0
    qwen = np.array(w.models)[w.model_index] == "qwen2.5-7b"
    assert (r.records.replica[qwen] >= 3).all() and (r.records.replica[~qwen] < 3).all()


def test_the_slo_scaler_measures_its_capacity_per_replica_and_runs_deterministically():
    w = Workload.build(Diurnal(8.0, 0.6, 0.1, 600.0).times(np.random.default_rng(1), 3000),
                       np.random.default_rng(2).integers(500, 2000, 3000), np.random.default_rng(3).integers(50, 300, 3000))
    kw = dict(gpu="l4", replicas=6, router="least-outstanding", autoscale="slo", report_bucket_s=120,
              autoscale_params={"ttft_slo_s": 2.0, "interval_s": 15, "cold_start_s": 20, "initial": 2})
    a, b = run(w, **kw), run(w, **kw)
    auto = a.summary["autoscale"]
    assert auto["rate_per_replica"][0] > 0 and max(up for _, up in auto["replicas_over_time"]) > 2
    assert {k: v for k, v in a.summary.items() if k != "wall_seconds"} == \
        {k: v for k, v in b.summary.items() if k != "wall_seconds"}
    rows = a.summary["over_time"]
    assert sum(r["requests"] for r in rows) == 3000 and all(r["mean_replicas"] is None or 1 <= r["mean_replicas"] <= 6
                                                            for r in rows)
    assert a.summary["gpu_hours"] < 6 * max(a.records.finished) / 3600          # fewer than a fixed fleet of 6


# ----- admission, shedding, abandonment ------------------------------------------------------------
def test_token_bucket_and_concurrency_limits():
    tiers = (Tier("paid", 1.0), Tier("free", 5.0))
    adm = Admission(tiers, [parse_admit("free:rate=2:burst=3", ["paid", "free"]),
                            parse_admit("paid:concurrency=1", ["paid", "free"])], [], [])
    assert [adm.admit(1, 0.0) for _ in range(4)] == [True, True, True, False]     # the burst, then empty
    assert adm.admit(1, 0.5) and not adm.admit(1, 0.5)                           # one token back in 0.5 s
    assert adm.admit(0, 0.0) and not adm.admit(0, 0.1)                           # one in the cluster
    adm.in_cluster[0] -= 1
    assert adm.admit(0, 0.2)
    for text, msg in [("paid", "write TIER"), ("gold:rate=1", "unknown tier"), ("paid:rate=0", "> 0"),
                      ("paid:concurrency=1.5", "whole number"), ("paid:burst=2", "write TIER"),
                      ("paid:rate=1:burst=0.5", ">= 1"), ("paid:rate=inf", "finite")]:
        with pytest.raises(KvschedError, match=msg):
            parse_admit(text, ["paid", "free"])
    slow = Admission(tiers, [parse_admit("free:rate=0.5", ["paid", "free"])], [], [])     # burst max(R, 1)
    assert slow.admit(1, 0.0) and not slow.admit(1, 1.0) and slow.admit(1, 2.0)
    assert parse_admit("free:rate=0.5:burst=1", ["free"]).burst == 1.0
    with pytest.raises(KvschedError, match="given twice"):
        Admission(tiers, [parse_admit("free:rate=1", ["free"]), parse_admit("free:rate=2", ["free"])], [], [])
    both = Admission(tiers, [], [], [parse_abandon("free=5", ["paid", "free"]), parse_abandon("9", ["paid", "free"])])
    assert both.patience == [9.0, 5.0, 9.0]          # a named tier's own rule over all's, in any order
    assert parse_shed("free:kv=0.8", ["free"], {"free": None}) == ShedRule("free", None, 0.8)
    with pytest.raises(KvschedError, match="share of the KV"):
        parse_shed("free:kv=2", ["free"], {"free": None})
    with pytest.raises(KvschedError, match="no TTFT SLO"):
        parse_shed("free", ["free"], {"free": None})
    assert parse_shed("free:ttft=0.5", ["free"], {"free": None}) == ShedRule("free", 0.5)
    assert parse_shed("free", ["free"], {"free": 10.0}) == ShedRule("free", 10.0)
    assert parse_abandon("30", []) == ("all", 30.0) and parse_abandon("free=5", ["free"]) == ("free", 5.0)
    assert Limit("all", "rate", 1.0).burst == 0.0


def spike(n: int = 580, seed: int = 0) -> Workload:
    """Two tiers (30% paid, TTFT SLO 2 s; 70% free, 10 s): 1 req/s, a 3x spike for 60 s, then
    1 req/s, for 2 replicas of L4."""
    rng = np.random.default_rng(seed)
    t = parse_arrivals("piecewise:1:200,3:60,1:200").times(rng, n)
    tiers = (Tier("paid", ttft_slo=2.0), Tier("free", ttft_slo=10.0))
    return Workload.build(t, rng.integers(200, 1500, n), rng.integers(50, 300, n),
                          tier_index=(rng.random(n) < 0.7).astype(int), tiers=tiers)


def test_a_3x_spike_keeps_the_paying_tier_within_its_slo_by_shedding_the_free_tier():
    w = spike()
    kw = dict(gpu="l4", replicas=2, router="least-outstanding")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = simulate(Scenario(w, model="llama-3-8b", **kw)).summary
        shed = simulate(Scenario(w, model="llama-3-8b", shed=("free:ttft=0.5",), **kw)).summary
    paid = {s: next(t for t in x["tiers"] if t["name"] == "paid") for s, x in (("plain", plain), ("shed", shed))}
    assert paid["plain"]["p99_ttft_ms"] > 2000 >= paid["shed"]["p99_ttft_ms"]
    rows = {r["tier"]: r for r in shed["admission"]}
    assert rows["paid"]["shed"] == 0 < rows["free"]["shed"] == shed["shed"]
    assert {t["name"]: t["shed"] for t in shed["tiers"]} == {"paid": 0, "free": shed["shed"]}
    assert shed["completed"] + shed["shed"] == len(w)


def test_abandoned_requests_leave_the_queue_and_are_reported(tmp_path):
    rng = np.random.default_rng(4)
    w = Workload.build(np.sort(rng.uniform(0, 20, 600)), rng.integers(500, 2000, 600), rng.integers(100, 400, 600))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = simulate(Scenario(w, model="llama-3-8b", gpu="l4", abandon_after=("3",)))
    s = r.summary
    assert s["abandoned"] > 0 and s["completed"] + s["abandoned"] == len(w)
    assert (r.records.arrival == w.arrival).all()                   # an abandoned request keeps its arrival
    ttft = r.records.first_token - r.records.arrival
    assert np.nanmax(np.where(np.isfinite(ttft), ttft, np.nan)) > 0
    r.write(tmp_path / "out")
    status = [line.split(",")[4] for line in (tmp_path / "out" / "requests.csv").read_text().splitlines()[1:]]
    assert status.count("abandoned") == s["abandoned"] and status.count("finished") == s["completed"]
    with pytest.raises(KvschedError, match="closed loop"):
        run(Workload.build(np.zeros(5), 100, 10, concurrency=2), abandon_after=("3",))
    with pytest.raises(KvschedError, match="on_preempt"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            simulate(Scenario(w, model="llama-3-8b", gpu="l4", abandon_after=("3",)), "slai")


# ----- LoRA and several models -------------------------------------------------------------------------
def test_residency_pins_evicts_the_least_recently_used_idle_adapter_and_refuses_when_all_are_pinned():
    res = Residency(2)
    assert res.pin(1) is True and res.pin(2) is True and res.pin(1) is False
    assert res.state(3) == 0 and res.pin(3) is None                  # both pinned
    res.unpin(2)
    assert res.state(3) == 1 and res.pin(3) is True and 2 not in res.pins   # 2 was the idle one
    res.unpin(1)
    res.unpin(1)
    assert res.pin(4) is True and 1 not in res.pins and res.loads == 4


def test_an_adapter_load_stalls_the_replica_for_its_bytes_over_the_load_bandwidth():
    from kvsched.hardware import get_model
    w = Workload.build([1.0], 512, 2)
    base = run(w).records
    lora = run(tag(w, 0, "1", None), lora_params={"load_gbps": "1"})
    size = adapter_params(get_model("llama-3-8b"), 16) * 2
    assert size == 16 * 32 * 2 * (4096 * 4 + 1024 * 2 + 4096 * 2 + 14336 * 3 + 4096 * 3)
    stall = (lora.records.first_token - base.first_token)[0]
    assert stall >= size / 1e9 and stall < size / 1e9 * 1.05          # the load, plus the adapter's compute
    assert lora.summary["lora"]["adapter_loads"] == 1


def test_adapters_never_exceed_the_slots_and_adapter_aware_routing_loads_fewer():
    rng = np.random.default_rng(5)
    w = tag(Workload.build(np.sort(rng.uniform(0, 100, 3000)), rng.integers(100, 600, 3000),
                           rng.integers(20, 200, 3000)), 0, "50", None)
    summaries = {}
    for router in ("least-outstanding", "lora-affinity"):
        r = run(w, replicas=4, router=router, lora_params={"max_loras": "8"})
        summaries[router] = r.summary
        assert r.summary["completed"] == len(w)
    assert summaries["lora-affinity"]["lora"]["adapter_loads"] < summaries["least-outstanding"]["lora"]["adapter_loads"]
    assert summaries["lora-affinity"]["mean_ttft_ms"] < summaries["least-outstanding"]["mean_ttft_ms"]


def test_adapters_follow_a_zipf_law_and_models_go_to_their_pools():
    n, s, none = parse_adapters("10:zipf=1.2:none=0.25")
    assert (n, s, none) == (10, 1.2, 0.25)
    w = tag(Workload.build(np.arange(20000.0), 10, 10), 7, "10:zipf=1.2:none=0.25", "llama-3-8b:0.5,qwen2.5-7b:0.5")
    a = w.adapter
    assert abs((a < 0).mean() - 0.25) < 0.02
    counts = np.bincount(a[a >= 0], minlength=10)
    p = np.arange(1, 11) ** -1.2
    assert np.allclose(counts / counts.sum(), p / p.sum(), atol=0.015)
    assert (tag(Workload.build(np.arange(20000.0), 10, 10), 7, "10:zipf=1.2:none=0.25", None).adapter == a).all()
    from kvsched.workload.tags import parse_model_mix
    assert parse_model_mix("a:1e308,b:1e308")[1].tolist() == [0.5, 0.5]
    small = w.take(np.arange(300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = simulate(Scenario(small, model="llama-3-8b", pool=("a=h100-sxm:2", "b=h100-sxm:1:model=qwen2.5-7b"),
                              router="least-outstanding"))
    qwen = np.array(small.models)[small.model_index] == "qwen2.5-7b"
    assert (r.records.replica[qwen] == 2).all() and (r.records.replica[~qwen] < 2).all()
    for text in ("0", "5:zipf=-1", "5:none=1", "5:foo=1", "x"):
        with pytest.raises(KvschedError, match="--adapters"):
            parse_adapters(text)
    with pytest.raises(KvschedError, match="no --pool serves"):
        run(tag(Workload.build(np.arange(5.0), 10, 10), 0, None, "mistral-7b:1"))


# ----- cost and energy ---------------------------------------------------------------------------------
def test_a_fixed_fleet_pays_every_gpu_from_zero_to_the_end_at_its_price_and_power():
    w = Workload.build(np.arange(0.5, 30, 0.5), 300, 50)
    r = run(w, replicas=3, router="round-robin")
    s, rec = r.summary, r.records
    end = max(float(rec.finished.max()), float(rec.arrival.max()))
    gpu = get_gpu("h100-sxm")
    assert s["gpu_hours"] == pytest.approx(3 * end / 3600, rel=1e-12)
    assert s["usd"] == pytest.approx(s["gpu_hours"] * read_prices()["per_gpu_hour"]["h100-sxm"], rel=1e-12)
    busy = sum(st["busy_time"] for st in rec.replica_stats)
    assert s["joules"] == pytest.approx(gpu.idle_power * 3 * end + (gpu.power - gpu.idle_power) * busy, rel=1e-12)
    tokens = int(rec.output.sum())
    assert s["usd_per_mtok"] == pytest.approx(s["usd"] / tokens * 1e6) and s["joules_per_mtok"] == \
        pytest.approx(s["joules"] / tokens * 1e6)


def test_simulate_json_has_the_cost_keys_and_a_gpu_without_a_price_reports_none(tmp_path):
    r = invoke("simulate", "--num-requests", "30", "--json")
    s = json.loads(r.stdout)
    assert r.exit_code == 0 and all(s[k] > 0 for k in ("usd_per_mtok", "joules_per_mtok", "gpu_hours"))
    r = invoke("simulate", "--num-requests", "30", "--gpu", "h20", "--json")
    s = json.loads(r.stdout)
    assert s["usd"] is None and s["usd_per_mtok"] is None and s["prices"]["missing"] == ["h20"]
    prices = tmp_path / "p.toml"
    prices.write_text('[per_gpu_hour]\nh20 = 1.5\n')
    s = json.loads(invoke("simulate", "--num-requests", "30", "--gpu", "h20", "--prices", prices, "--json").stdout)
    assert s["usd"] == pytest.approx(s["gpu_hours"] * 1.5)


def test_gpu_files_give_power_and_idle_power_together(tmp_path):
    from kvsched.hardware import read_gpu
    base = 'memory_gib = 10\nbandwidth = 1e12\n[flops]\nbf16 = 1e14\n'
    for extra, msg in [("power = 300\n", "together"), ("power = 300\nidle_power = 400\n", "idle_power <= power"),
                       ("power = -1\nidle_power = 0\n", "positive")]:
        p = tmp_path / "g.toml"
        p.write_text(extra + base)
        with pytest.raises(KvschedError, match=msg):
            read_gpu(p)


# ----- arrivals, CLI -------------------------------------------------------------------------------------
def test_a_diurnal_day_peaks_in_the_afternoon_and_time_scales():
    t = Diurnal(5.0, 0.6, 0.1).times(np.random.default_rng(0), 450_000)
    hours = np.bincount((t[t < 86400] // 3600).astype(int), minlength=24)
    assert hours.argmin() in (3, 4, 5) and hours.argmax() in (14, 15, 16, 17)
    assert hours.max() / hours.min() > 3
    fast = parse_arrivals("diurnal:10:0.6:0.1:864").times(np.random.default_rng(0), 4000)
    assert fast[-1] < 864 * 1.3
    for text in ("diurnal:10:1.5", "diurnal:-1", "diurnal:10:0.5:3", "diurnal:10:0.5:0.1:0", "diurnal:1:2:3:4:5"):
        with pytest.raises(KvschedError):
            parse_arrivals(text)


@pytest.mark.parametrize("args,message", [
    (["--autoscale", "magic"], "--autoscale must be one of"),
    (["--autoscale", "hpa", "--autoscale-set", "metric=gpu"], "metric must be one of"),
    (["--admit", "gold:rate=1"], "unknown tier"),
    (["--shed", "all"], "no TTFT SLO"),
    (["--abandon-after", "-3"], "> 0"),
    (["--adapters", "0"], "--adapters"),
    (["--lora-set", "max_loras=4"], "names none"),
    (["--adapters", "5", "--lora-set", "max_loras=0"], "max_loras"),
    (["--model-mix", "llama-3-8b:x"], "--model-mix"),
    (["--arrivals", "diurnal:5:1.2"], "amplitude"),
    (["--report-bucket", "0"], "--report-bucket"),
    (["--prices", "/nonexistent/p.toml"], "cannot read"),
    (["--autoscale", "hpa", "--autoscale-set", "interval_s=1e-300"], "at least 0.001"),
    (["--autoscale", "hpa", "--autoscale-set", "min=2", "--autoscale-set", "initial=1", "--replicas", "3"],
     "below min"),
    (["--autoscale", "slo", "--autoscale-set", "ttft_slo_s=0"], "ttft_slo_s must be a positive"),
    (["--report-bucket", "1e-6"], "more than 1,000,000"),
    (["--report-bucket", "1e-320"], "more than 1,000,000"),
    (["--arrivals", "diurnal:10:0.5:0.1:0.5"], "at least 1 second"),
    (["--shed", "all:kv=1.5"], "share of the KV"),
    (["--admit", "all:rate=1", "--admit", "all:rate=2"], "given twice"),
])
def test_bad_control_plane_flags_are_one_line_errors_with_exit_code_2(args, message):
    r = invoke("simulate", "--num-requests", "20", *args)
    assert r.exit_code == 2 and message in r.output, r.output
    assert r.output.count("\n") <= 2


def test_capacity_minimise_cost_picks_the_cheapest_candidate_and_gpus_the_fewest(tmp_path):
    common = ["--model", "llama-3.1-8b", "--rate", "6", "--slo", "ttft:p99:2000", "--num-requests", "200", "--seeds",
              "1", "--tolerance", "0.2", "--json"]
    cands = ["--candidate", "h100=h100-sxm:tp=2", "--candidate", "l40s=l40s", "--candidate", "a100=a100-80gb"]
    cost = json.loads(invoke("capacity", *cands, "--minimise", "cost", *common).stdout)
    rows = {c["name"]: c for c in cost["candidates"]}
    assert cost["minimise"] == "cost" and cost["cheapest"] == min(rows, key=lambda k: rows[k]["usd_per_hour"])
    gpus = json.loads(invoke("capacity", *cands, "--minimise", "gpus", *common).stdout)
    assert rows[gpus["cheapest"]]["gpus"] == min(c["gpus"] for c in rows.values())
    bad = invoke("capacity", *cands, "--minimise", "watts", *common)
    assert bad.exit_code == 2 and "--minimise must be one of" in bad.output
    bad = invoke("capacity", "--minimise", "cost", "--rate", "1", "--num-requests", "20")
    assert bad.exit_code == 2 and "give --candidate too" in bad.output


def test_sweep_minimise_names_the_cheapest_point_meeting_the_slo(tmp_path):
    r = invoke("sweep", "--rates", "2,40", "--set", "max_num_seqs=8,256", "--num-requests", "150", "--jobs", "1",
               "--minimise", "cost", "--slo", "ttft:p99:1000", "--out", tmp_path / "s", "--json")
    assert r.exit_code == 0, r.output
    best = json.loads(r.stdout)["best"]
    rows = [json.loads(p.read_text()) for p in (tmp_path / "s" / "points").glob("*.json")]
    ok = [x for x in rows if x["figures"]["p99_ttft_ms"] <= 1000]
    assert best["usd_per_mtok"] == min(x["figures"]["usd_per_mtok"] for x in ok)
    bad = invoke("sweep", "--rates", "2", "--slo", "ttft:p99:1000", "--out", tmp_path / "t")
    assert bad.exit_code == 2 and "give --minimise too" in bad.output


def test_lora_config_is_checked():
    with pytest.raises(KvschedError, match="max_loras"):
        LoraConfig(max_loras=0)
    with pytest.raises(KvschedError, match="load_gbps"):
        LoraConfig(load_gbps=math.inf)
