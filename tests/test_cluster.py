"""Clusters: the loop interleaves replicas exactly, routers route as named, random routing
behaves as independent replicas, and closed loops count the whole cluster."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost import ConstantCost
from kvsched.hardware import get_gpu
from kvsched.kvcache import PagedKV
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.sim.cluster import Cluster
from kvsched.sim.routers import ROUTERS, ReplicaSummary, make_router
from kvsched.sim.server import Server
from kvsched.workload import Uniform, synthetic
from kvsched.workload.source import WorkloadOptions, load

from test_properties import DISAGG_ONLY, params, scenarios

W = synthetic(Uniform(1, 400), Uniform(1, 200), rate=40, n=1500, seed=7)


def same_records(a, b) -> None:
    for f in ("arrival", "admitted", "first_token", "finished", "preemptions", "recomputed", "itl_max",
              "tbt_violations"):
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f
    assert a.itl.counts == b.itl.counts and a.itl.total == b.itl.total and a.iterations == b.iterations


def test_one_replica_is_bit_identical_through_every_path():
    sc = Scenario(W, kv_capacity=12_000, cost="linear")
    base = simulate(sc, "vllm-v1")
    for router in ROUTERS:
        r = simulate(Scenario(W, kv_capacity=12_000, cost="linear", replicas=1, router=router), "vllm-v1")
        same_records(base.records, r.records)
        assert {k: v for k, v in r.summary.items() if k != "wall_seconds"} == \
               {k: v for k, v in base.summary.items() if k != "wall_seconds"}
    assert base.summary["preemptions"] > 0          # a KV-tight case


class AllToZero:
    name, uses_state = "all-to-0", False

    def route(self, i, t, replicas):
        return 0


def test_idle_second_replica_changes_nothing():
    """The cluster loop interleaving an idle replica gives the single replica's exact run."""
    def pol():
        return make_policy("sarathi", {"chunk_size": 256}, get_gpu("a30"))
    single = Server(W, pol(), ConstantCost(0.02), PagedKV(9000, 16)).run()
    two = Cluster(W, [pol(), pol()], ConstantCost(0.02), PagedKV(9000, 16), router=AllToZero()).run()
    same_records(single, two)
    assert two.replica_stats[1]["iterations"] == 0 and (two.replica == 0).all()


def test_round_robin_and_least_routers():
    r = simulate(Scenario(W, replicas=3, router="round-robin"), "vllm-v1")
    assert r.records.replica.tolist() == [i % 3 for i in range(len(W))]
    lo = make_router("least-outstanding")
    s = [ReplicaSummary(0, 5, 0, 10, 0), ReplicaSummary(1, 2, 9, 10, 0), ReplicaSummary(2, 2, 1, 10, 7)]
    assert lo.route(0, 0.0, s) == 1                 # ties go round-robin: first scan starts at 0
    assert lo.route(1, 0.0, s) == 1                 # starts at 1
    assert lo.route(2, 0.0, s) == 2                 # starts at 2: 2 ties with 1 and comes first
    assert make_router("least-kv").route(0, 0.0, s) == 0
    assert make_router("least-prefill").route(0, 0.0, s) in (0, 1)
    r1, r2 = make_router("random", 5), make_router("random", 5)
    a = [r1.route(i, 0.0, 4) for i in range(50)]
    assert a == [r2.route(i, 0.0, 4) for i in range(50)] and len(set(a)) == 4


@pytest.mark.parametrize("router", ["least-outstanding", "least-kv", "least-prefill"])
def test_state_routers_balance_and_beat_random(router):
    sc = dict(kv_capacity=40_000, cost="linear", cost_params={"d0": 0.01, "d1": 4e-6})
    w = synthetic(Uniform(1, 2000), Uniform(1, 400), rate=3.2, n=3000, seed=3)   # ~80% load
    smart = simulate(Scenario(w, replicas=4, router=router, **sc), "vllm-v1")
    rand = simulate(Scenario(w, replicas=4, router="random", **sc), "vllm-v1")
    counts = np.bincount(smart.records.replica, minlength=4)
    assert counts.min() > 0.2 * len(w)
    assert smart.summary["mean_ttft_ms"] < rand.summary["mean_ttft_ms"]


@pytest.mark.slow
def test_random_routing_is_r_independent_replicas():
    """r replicas at r x lambda behave as one at lambda: throughput r times, median TTFT alike."""
    r, lam, n = 4, 6.0, 6000
    common = dict(model="qwen2-7b", gpu="a30")
    length = "uniform:50:700"

    def wl(rate, count):
        return load(WorkloadOptions(rate=rate, num_requests=count, prompt_len=length, output_len="uniform:20:400",
                                    seed=11))
    one = simulate(Scenario(wl(lam, n), **common), "vllm-v1").summary
    many = simulate(Scenario(wl(r * lam, r * n), replicas=r, router="random", router_seed=3, **common),
                    "vllm-v1").summary
    assert many["request_throughput"] == pytest.approx(r * one["request_throughput"], rel=0.02)
    assert many["median_ttft_ms"] == pytest.approx(one["median_ttft_ms"], rel=0.10)


def test_closed_loop_counts_the_whole_cluster():
    seen = []

    class Probe:
        def __init__(self):
            self.inner = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
            self.name = "probe"

        def schedule(self, v):
            seen.append((v.issued, v.in_flight))
            return self.inner.schedule(v)

    c, n = 12, 300
    w = load(WorkloadOptions(arrivals=f"closed:{c}", num_requests=n, seed=2))
    rec = Cluster(w, [Probe(), Probe(), Probe()], ConstantCost(0.01), PagedKV(200_000, 16)).run()
    assert np.isfinite(rec.finished).all()
    assert all(inflight <= c for _, inflight in seen)
    # request c + k is issued at the k-th finish (over all replicas), never earlier
    fin = np.sort(rec.finished)
    assert np.allclose(rec.arrival[c:], fin[:n - c], atol=1e-12)
    assert set(rec.replica.tolist()) == {0, 1, 2}


def test_cli_replicas_breakdown_and_csv(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    res = runner.invoke(app, ["simulate", "--num-requests", "80", "--rate", "20", "--replicas", "3", "--router",
                              "least-outstanding", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["replicas"] == 3 and s["router"] == "least-outstanding"
    assert [row["replica"] for row in s["replica_breakdown"]] == [0, 1, 2]
    assert sum(row["completed"] for row in s["replica_breakdown"]) == s["completed"] == 80
    batches = (out / "batches.csv").read_text().splitlines() if (out / "batches.csv").exists() else None
    assert batches is None
    timeline = (out / "timeline.csv").read_text().splitlines()
    assert timeline[0].endswith(",replica") and len(timeline) - 1 == s["iterations"]
    assert {row.split(",")[-1] for row in timeline[1:]} == {"0", "1", "2"}
    header, *rows = (out / "requests.csv").read_text().splitlines()
    assert header.split(",")[-1] == "replica" and {r.split(",")[-1] for r in rows} == {"0", "1", "2"}
    one = runner.invoke(app, ["simulate", "--num-requests", "80", "--rate", "20", "--json"])
    one_r = runner.invoke(app, ["simulate", "--num-requests", "80", "--rate", "20", "--replicas", "1", "--json"])
    drop = (lambda d: {k: v for k, v in d.items() if k != "wall_seconds"})
    assert drop(json.loads(one.stdout)) == drop(json.loads(one_r.stdout))
    for args, needle in [(["--replicas", "0"], "--replicas must be >= 1"),
                         (["--router", "nearest"], "unknown router 'nearest'"),
                         (["--prefill-replicas", "2"], "needs --prefill-replicas >= 1 and --decode-replicas >= 1"),
                         (["--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "not both"),
                         (["--decode-policy", "sarathi"], "need --prefill-replicas"),
                         (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-bandwidth", "0"],
                          "--kv-transfer-bandwidth must be > 0"),
                         (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-latency", "-1"],
                          "--kv-transfer-latency must be >= 0")]:
        bad = runner.invoke(app, ["simulate", "--num-requests", "5", *args])
        assert bad.exit_code == 2 and needle in bad.output, (args, bad.output)


def test_routers_see_replicas_mid_batch():
    """Constant batch time 1 s. Request 0 (500-token prompt) starts a batch on replica 0 at 0;
    at 0.1 and 0.2 replica 0 is mid-batch holding 500 KV tokens, so least-kv sends both
    newcomers to replica 1 (a stale or empty view would tie and alternate)."""
    from kvsched.workload import Request, Workload
    w = Workload.from_requests([Request(0.0, 500, 5), Request(0.1, 10, 5), Request(0.2, 10, 5)])
    rec = simulate(Scenario(w, cost="constant", cost_params={"b": 1.0}, kv_capacity=5000, block_size=1,
                            replicas=2, router="least-kv"), "vllm-v1").records
    assert rec.replica.tolist() == [0, 1, 1]
    w4 = Workload.from_requests([Request(0.0, 50, 5), Request(0.1, 50, 5), Request(0.2, 50, 5), Request(0.3, 50, 5)])
    rec = simulate(Scenario(w4, cost="constant", cost_params={"b": 1.0}, kv_capacity=5000, block_size=1,
                            replicas=3, router="least-outstanding"), "vllm-v1").records
    assert rec.replica.tolist() == [0, 1, 2, 0]



MIXED_ONLY = {"wait", "nested-wait", "rad"}    # single-GPU schedulers: refuse disaggregated roles


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=120)
@given(scenarios(disagg_ok=True), st.booleans(), st.integers(1, 4), st.sampled_from(sorted(ROUTERS)),
       st.sampled_from([1.0, 0.001]))
def test_cluster_invariants(sc, disagg, size, router, bandwidth):
    """Any policy on a cluster or disaggregated pools: every request finishes with its tokens,
    no replica exceeds its KV, every replica ends empty, prefill work = prompts + recomputation."""
    w, policy, block, kv, _, cap = sc
    disagg = (disagg or policy in DISAGG_ONLY) and policy not in MIXED_ONLY
    p, r = ((size + 1) // 2, size // 2 + 1) if disagg else (0, size)
    pols = [make_policy(policy, params(policy, cap), get_gpu("a100-80gb")) for _ in range(p + r)]
    c = Cluster(w, pols, ConstantCost(0.01), PagedKV(kv, block), router=router, router_seed=1,
                prefill_replicas=p, kv_bytes_per_token=1e5, bandwidth_gbps=bandwidth, latency_s=0.001,
                record_batches=True)
    rec = c.run()
    assert np.isfinite(rec.finished).all() and (rec.first_token <= rec.finished).all()
    assert rec.itl.n == int((w.output - 1).sum())
    for rep in c.replicas:
        assert all(b[5] <= rep.kv.capacity_blocks * block for b in rep.batches)
        assert rep.kv.used == 0 and not rep._running and not rep._queue and not rep.pulls
    prefill = sum(b[2] for rep in c.replicas for b in rep.batches)
    assert prefill == int(w.prompt.sum() + rec.recomputed.sum())
    if p:
        handed = w.output > 1
        assert np.isfinite(rec.transfer[handed]).all() and (rec.transfer[handed] > 0).all()
