"""A cluster whose replicas may run one after another, each on a table of its own requests
(sim/routed_ahead.py: an open loop, a router that reads no state, built-in `replica_local`
policies and cost model): every figure it reports is the time-ordered loop's, bit for bit."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched.cost.constant import ConstantCost
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu
from kvsched.kvcache import PagedKV
from kvsched.policies import make_policy
from kvsched.policies.base import replica_local
from kvsched.policies.baselines import VllmV1
from kvsched.run import Scenario, simulate
from kvsched.sim.cluster import Cluster
from kvsched.workload.request import Ragged, Segments, Tier, Workload

from test_fast_paths import policy_fingerprint

LOCAL = ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level", "eb", "eb-adaptive", "eb-plus", "rad", "slai")


class Together:
    """Built-in policy `name` in the time-ordered loop: this wrapper's class promises neither
    `replica_local` nor `decodes_when_idle`, so every batch is planned as the replicas take
    turns; hooks and attributes are the inner policy's."""

    def __init__(self, name: str) -> None:
        self.inner = make_policy(name, {}, get_gpu("a100-80gb"))

    def schedule(self, v):
        return self.inner.schedule(v)

    def __getattr__(self, key: str):
        if key == "inner" or key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.inner, key)


def mixed(n: int, rate: float, seed: int, tiers: bool, shared: bool) -> Workload:
    """Poisson arrivals, random lengths; optionally two tiers and shared prompt prefixes."""
    g = np.random.default_rng(seed)
    prompts, outputs = g.integers(1, 900, n), g.integers(1, 300, n)
    kw: dict = {}
    if tiers:
        kw.update(tier_index=g.integers(-1, 2, n), tiers=(Tier("paying", tbt_slo=0.03), Tier("free", tbt_slo=0.08)))
    if shared:                          # each prompt begins with one of three shared prefixes
        off = np.arange(n + 1, dtype=np.int64)
        kw["segments"] = Segments(Ragged(g.integers(0, 3, n).astype(np.int64), off),
                                  Ragged(np.minimum(prompts, 64).astype(np.int64), off))
    return Workload.build(np.cumsum(g.exponential(1 / rate, n)), prompts, outputs, **kw)


@pytest.fixture
def apart_runs(monkeypatch) -> list:
    """One entry per cluster run apart (`run_apart` as the cluster module calls it)."""
    import kvsched.sim.cluster as cluster_module
    calls: list = []
    real = cluster_module.run_apart
    monkeypatch.setattr(cluster_module, "run_apart", lambda *a: calls.append(a) or real(*a))
    return calls


def both(w: Workload, name: str, apart_runs: list | None, **kw) -> tuple[str, str]:
    """(fingerprint run apart, fingerprint run in the time-ordered loop); with `apart_runs`
    (the fixture's), checks which ran how."""
    runs = apart_runs if apart_runs is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # requests beyond --max-model-len are rejected, with a warning
        before = len(runs)
        apart = policy_fingerprint(w, name, **kw)[0]
        assert apart_runs is None or len(runs) == before + 1, "the built-in policy did not run apart"
        together = policy_fingerprint(w, Together(name), **kw)[0]
        assert apart_runs is None or len(runs) == before + 1, "the wrapped policy ran apart"
        return apart, together


def test_the_built_in_policies_that_read_only_their_replica_say_so():
    gpu = get_gpu("a100-80gb")
    assert all(replica_local(make_policy(name, {}, gpu)) for name in LOCAL)
    assert not replica_local(make_policy("wait", {}, gpu))          # it reads arrivals_pending
    assert not replica_local(Together("vllm-v1"))
    sub = make_policy("vllm-v1", {}, gpu)
    sub.__class__ = type("Sub", (VllmV1,), {})                      # not inherited: a subclass may read more
    assert not replica_local(sub)


def _cluster(policies, w=None, cost=None, **kw) -> Cluster:
    w = w if w is not None else mixed(60, 20.0, 1, False, False)
    return Cluster(w, policies, cost or ConstantCost(0.01), PagedKV(50_000, 16), **kw)


def test_which_clusters_run_apart():
    gpu = get_gpu("a100-80gb")
    local = [make_policy("vllm-v1", {}, gpu) for _ in range(3)]
    c = _cluster(local, router="random", router_seed=2)
    assert c._tables is not None and [t.n for t in c._tables] == [len(t.rows) for t in c._tables]
    assert sorted(np.concatenate([t.rows for t in c._tables]).tolist()) == list(range(60))
    assert _cluster(local, router="least-outstanding")._tables is None          # reads the replicas' state
    assert _cluster(local, prefill_replicas=1)._tables is None                   # disaggregated
    assert _cluster([make_policy("wait", {}, gpu) for _ in range(3)])._tables is None
    assert _cluster([Together("vllm-v1") for _ in range(3)])._tables is None      # a user's policy
    assert _cluster(local[:1])._tables is None                                   # one replica

    class MyCost(ConstantCost):
        pass
    assert _cluster(local, cost=MyCost(0.01))._tables is None                    # a user's cost model
    closed = Workload.build(np.zeros(30), np.full(30, 50), np.full(30, 20), concurrency=np.full(30, 4))
    assert _cluster(local, w=closed)._tables is None


@pytest.mark.parametrize("name", LOCAL)
def test_apart_is_the_time_ordered_loop(name, apart_runs):
    w = mixed(400, 40.0, 3, tiers=True, shared=True)
    a, b = both(w, name, apart_runs, replicas=3, router="round-robin", kv_capacity=12_000, prefix_caching=True)
    assert a == b


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), rate=st.floats(2.0, 80.0), replicas=st.integers(2, 4),
       router=st.sampled_from(["round-robin", "random"]), name=st.sampled_from(LOCAL),
       kv=st.sampled_from([None, 3_000, 8_000]), tiers=st.booleans(), shared=st.booleans(),
       caching=st.booleans(), cap=st.sampled_from([None, 700]))
def test_apart_is_the_time_ordered_loop_on_random_workloads(seed, rate, replicas, router, name, kv, tiers, shared,
                                                             caching, cap):
    w = mixed(150, rate, seed, tiers, shared)
    a, b = both(w, name, None, replicas=replicas, router=router, router_seed=seed, kv_capacity=kv,
                prefix_caching=caching, max_model_len=cap)
    assert a == b


def test_apart_with_the_checks_on(monkeypatch, apart_runs):
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = mixed(200, 30.0, 5, tiers=False, shared=True)
    a, b = both(w, "sarathi", apart_runs, replicas=2, router="round-robin", kv_capacity=6_000, prefix_caching=True)
    assert a == b


@pytest.mark.parametrize("what", ["in_flight", "issued", "arrivals_pending", "next_arrival"])
def test_a_replica_local_policy_that_reads_the_cluster_s_figures_is_stopped(what):
    """Run apart, the cluster-wide figures are not those of the replica's time: reading one
    is an error naming the figure and the policy's promise."""
    def schedule(self, v):
        getattr(v, what)
        return VllmV1.schedule(self, v)
    probe = type("Probe", (VllmV1,), {"__module__": "kvsched.policies.probe", "replica_local": True,
                                      "schedule": schedule})
    policy = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
    policy.__class__ = probe
    w = mixed(40, 20.0, 4, False, False)
    with pytest.raises(KvschedError, match=rf"view\.{what} is the cluster's.*replica_local"):
        simulate(Scenario(w, model="llama-2-7b", gpu="a100-80gb", replicas=2), policy)
    del probe.replica_local                             # without the promise it runs in the loop
    simulate(Scenario(w, model="llama-2-7b", gpu="a100-80gb", replicas=2), policy)


def _holding(local: bool):
    """vllm-v1 that holds its queue (an empty plan) while fewer than 3 wait and none runs,
    until it is asked again with nothing new: woken when the arrivals end anywhere."""
    from kvsched.policies import Plan

    def schedule(self, v):
        waiting = tuple(v.waiting)
        if not v.running and 0 < len(waiting) < 3 and waiting != self.__dict__.get("held"):
            self.held = waiting
            return Plan([], [], False, [])
        return VllmV1.schedule(self, v)
    ns = {"__module__": "kvsched.policies.probe", "schedule": schedule, **({"replica_local": True} if local else {})}
    policy = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
    policy.__class__ = type("Holding", (VllmV1,), ns)
    return policy


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_held_queue_is_released_when_the_arrivals_end_anywhere(replicas):
    """A replica whose policy waits is woken at the last arrival anywhere (the loop's
    `_pending`), not at its own last one: run apart as in the loop."""
    w = mixed(61, 5.0, 8, False, False)
    apart, _ = policy_fingerprint(w, _holding(True), replicas=replicas, router="round-robin")
    together, _ = policy_fingerprint(w, _holding(False), replicas=replicas, router="round-robin")
    assert apart == together


def test_more_replicas_than_requests(apart_runs):
    w = mixed(3, 5.0, 2, False, False)
    a, b = both(w, "vllm-v1", apart_runs, replicas=6, router="round-robin")
    assert a == b


def test_one_policy_object_on_every_replica_runs_in_the_loop():
    """Its state is shared: run apart, one replica's run would come before another's."""
    shared = make_policy("rad", {}, get_gpu("a100-80gb"))
    assert _cluster([shared] * 3)._tables is None


def test_a_cluster_table_after_a_run_apart_is_the_loop_s(apart_runs):
    """Records, statuses, tokens and counters of the cluster's table end as the loop leaves
    them; the view reads the cluster's figures again; a second run adds nothing."""
    gpu = get_gpu("a100-80gb")
    w = mixed(60, 20.0, 6, False, False)
    runs = []
    for make in (lambda: make_policy("vllm-v1", {}, gpu), lambda: Together("vllm-v1")):
        c = _cluster([make() for _ in range(3)], w=w)
        c.run()
        runs.append(c)
        c.run()
    apart, loop = runs
    assert apart._tables is not None and loop._tables is None and len(apart_runs) == 2
    for name in ("status", "gen", "done", "in_flight", "remaining"):
        assert getattr(apart.reqs, name) == getattr(loop.reqs, name), name
    for name in ("admitted", "first", "finished", "itl_max", "viol", "preempts", "recomputed", "replica"):
        assert np.array_equal(getattr(apart.reqs, name), getattr(loop.reqs, name)), name
    assert apart.replicas[0].view.arrivals_pending is False and apart.replicas[0].view.in_flight == 0


def test_workload_take_keeps_each_request_s_fields():
    g = np.random.default_rng(3)
    n = 12
    off = np.arange(0, 2 * n + 1, 2, dtype=np.int64)
    prefix = Ragged(g.integers(0, 99, 2 * n).astype(np.int64), off)
    w = Workload.build(np.sort(g.uniform(0, 9, n)), g.integers(1, 90, n), g.integers(1, 40, n),
                       tier_index=g.integers(-1, 1, n), tiers=(Tier("a", tbt_slo=0.05),), ids=np.arange(100, 100 + n),
                       output_known=True, prefix=prefix, declared_types=((10, 5, 1.0),))
    rows = np.array([1, 4, 5, 11])
    part = w.take(rows)
    for name in ("arrival", "prompt", "output", "output_known", "tier_index", "ids", "phase", "concurrency"):
        assert np.array_equal(getattr(part, name), getattr(w, name)[rows]), name
    assert [part.prefix[k].tolist() for k in range(4)] == [w.prefix[r].tolist() for r in rows]
    assert (part.tiers, part.declared_types, part.source) == (w.tiers, w.declared_types, w.source)
    turns = Workload.build(np.zeros(2), [5, 5], [3, 3], ids=[1, 2], session_prev=[-1, 1])
    with pytest.raises(KvschedError, match="sessions"):
        turns.take(np.array([0]))
