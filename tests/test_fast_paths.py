"""The engine's fast paths give the results of the general path, bit for bit: decode-only
batches that skip the policy (`decodes_when_idle`, inlined in `decode_run.plain_decodes`), and
several of them in one `step` (docs/architecture.md, "Speed")."""
from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.sim.routers import RandomRouter, RoundRobin
from kvsched.workload.request import Tier, Workload

STEADY = ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level")


def workload(n: int, rate: float, seed: int, tiers: bool = False) -> Workload:
    g = np.random.default_rng(seed)
    arrivals = np.cumsum(g.exponential(1 / rate, n))
    prompts = g.integers(1, 700, n)
    outputs = g.integers(1, 300, n)
    if not tiers:
        return Workload.build(arrivals, prompts, outputs)
    return Workload.build(arrivals, prompts, outputs, tier_index=g.integers(0, 2, n),
                          tiers=(Tier("paying", tbt_slo=0.03), Tier("free", tbt_slo=0.08)))


class Counting:
    """A built-in policy whose `schedule` calls are counted, planning every batch (the general
    path); `Fast` declares `decodes_when_idle` (the fast path). No `on_finish` hook, so the
    runs take the branch without hooks; `Hooked` adds hooks."""

    def __init__(self, name: str) -> None:
        self.inner = make_policy(name, {}, get_gpu("a100-80gb"))
        self.name = name
        self.calls = 0

    def schedule(self, v):
        self.calls += 1
        return self.inner.schedule(v)


class Fast(Counting):
    decodes_when_idle = True


class Hooked(Fast):
    def on_finish(self, i, v):
        self.inner.on_finish(i, v)

    def on_batch_end(self, v):
        pass


def fingerprint(w: Workload, name: str, steady: bool, hook: bool = False, **kw) -> tuple[str, int, int]:
    """(hash of everything a run reports, schedule calls, iterations)."""
    p = (Hooked if hook else Fast if steady else Counting)(name)
    digest, iterations = policy_fingerprint(w, p, **kw)
    return digest, p.calls, iterations


def policy_fingerprint(w: Workload, p, **kw) -> tuple[str, int]:
    """(hash of everything a run of policy object `p` reports, iterations)."""
    kw.setdefault("model", "llama-2-7b")
    r = simulate(Scenario(w, gpu="a100-80gb", **kw), p, record_timeline=True, record_batches=True)
    summary = {k: v for k, v in r.summary.items() if k != "wall_seconds"}
    rec = r.records
    per_request = [getattr(rec, k).tolist() for k in
                   ("first_token", "finished", "admitted", "itl_max", "tbt_violations", "preemptions", "recomputed")]
    blob = pickle.dumps((sorted(summary.items(), key=str), per_request, list(r.timeline), list(r.batches)))
    return hashlib.sha256(blob).hexdigest(), r.summary["iterations"]


@pytest.mark.parametrize("name", STEADY)
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("kv_capacity", [None, 12_000])
def test_fast_path_is_the_general_path(name, caching, kv_capacity):
    w = workload(400, 20.0, 1)
    kw = dict(prefix_caching=caching, kv_capacity=kv_capacity)
    fast, fast_calls, iters = fingerprint(w, name, True, **kw)
    slow, slow_calls, _ = fingerprint(w, name, False, **kw)
    assert fast == slow
    assert slow_calls == iters                  # the general path plans every batch
    assert fast_calls < slow_calls              # the fast path skipped some


@pytest.mark.parametrize("name", ["vllm-v1", "sarathi", "vllm-v0", "orca"])   # request-level decodes with a queue
def test_a_light_load_skips_most_plans(name):
    _, calls, iters = fingerprint(workload(200, 2.0, 6), name, True)
    assert calls < iters / 3


class LocalFast(Fast):
    replica_local = True        # a user's policy may promise it (policies/base.py): it then runs ahead


class LocalHooked(Hooked):
    replica_local = True


class UserRoundRobin(RoundRobin):
    """round-robin, as a user's router: routed at each arrival, not ahead of the run."""


class UserRandom(RandomRouter):
    """random, as a user's router."""


@pytest.mark.parametrize("router,replicas", [("round-robin", 3), ("round-robin", 10), ("random", 4),
                                             ("least-outstanding", 3), ("least-kv", 3)])
def test_fast_path_in_a_cluster(router, replicas):
    """Behind a built-in router that reads no state the routes are made before the run, and a
    `replica_local` policy's replica runs its idle decode batches to its own next arrival
    (`sim/routed_ahead.py`), past other replicas' arrivals; 10 replicas take the loop's heap.
    The runs are those of a policy planning every batch, routed at each arrival (the same
    router as a user's), bit for bit."""
    w = workload(600, 60.0, 2)
    kw = dict(replicas=replicas, kv_capacity=15_000, router_seed=4)
    user = {"round-robin": UserRoundRobin, "random": UserRandom}.get(router)
    base = fingerprint(w, "vllm-v1", False, router=user(4) if user else router, **kw)[0]
    for policy in (LocalFast, LocalHooked, Fast, Hooked):
        digest, _ = policy_fingerprint(w, policy("vllm-v1"), router=router, **kw)
        assert digest == base, policy.__name__


def test_routed_ahead_routes_as_the_loop_and_chains_each_replica_s_arrivals():
    from kvsched.kvcache import PagedKV
    from kvsched.cost.constant import ConstantCost
    from kvsched.sim.cluster import Cluster
    from kvsched.sim.routed_ahead import routed_ahead
    g = np.random.default_rng(9)
    n = 40
    w = Workload.build(np.sort(g.uniform(0, 5, n)), g.integers(1, 200, n), g.integers(1, 50, n))

    def cluster(policies, cost=ConstantCost(0.01), **kw):
        return Cluster(w, policies, cost, PagedKV(50_000, 16), **kw)

    c = cluster([LocalHooked("vllm-v1"), Fast("vllm-v1"), LocalFast("vllm-v1")], router="random", router_seed=5)
    for r in c.replicas:
        r.runs_ahead = True
    route, next_same, upcoming, alone = routed_ahead(c, True)
    twin = cluster([Fast("vllm-v1")] * 3, router="random", router_seed=5).router
    assert route == [twin.route(i, float(w.arrival[i]), 3) for i in range(n)]     # the same calls, in order
    for k in range(3):
        mine = [i for i in range(n) if route[i] == k] + [n]
        assert upcoming[k] == mine[0]
        assert [next_same[i] for i in mine[:-1]] == mine[1:]
    assert alone == [True, False, True]                 # only a replica_local policy runs to its own arrival
    assert routed_ahead(c, False) is None               # a closed loop or sessions
    assert routed_ahead(cluster([Fast("vllm-v1")] * 3, router="least-outstanding"), True) is None
    assert routed_ahead(cluster([Fast("vllm-v1")] * 3, prefill_replicas=1), True) is None
    assert routed_ahead(cluster([Fast("vllm-v1")] * 3, router=UserRandom(5)), True) is None    # a user's router

    class UserCost(ConstantCost):                       # one object for every replica: it may keep state
        pass
    assert routed_ahead(cluster([Fast("vllm-v1")] * 3, cost=UserCost(0.01)), True) is None


def test_fast_path_with_tiers_and_a_batch_hook():
    w = workload(300, 15.0, 3, tiers=True)
    base = fingerprint(w, "sarathi", False)[0]
    assert fingerprint(w, "sarathi", True)[0] == base
    assert fingerprint(w, "sarathi", True, hook=True)[0] == base


def test_fast_path_in_a_closed_loop_and_disaggregated():
    g = np.random.default_rng(4)
    closed = Workload.build(np.zeros(200), g.integers(1, 600, 200), g.integers(1, 200, 200),
                            concurrency=np.full(200, 8))
    assert fingerprint(closed, "vllm-v1", True)[0] == fingerprint(closed, "vllm-v1", False)[0]
    w = workload(300, 10.0, 5)
    kw = dict(prefill_replicas=1, decode_replicas=2)
    assert fingerprint(w, "vllm-v1", True, **kw)[0] == fingerprint(w, "vllm-v1", False, **kw)[0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), rate=st.floats(0.5, 80.0), caching=st.booleans(),
       name=st.sampled_from(STEADY), kv=st.sampled_from([None, 3_000, 8_000]), bs=st.sampled_from([1, 16]))
def test_fast_path_is_exact_on_random_workloads(seed, rate, caching, name, kv, bs):
    w = workload(120, rate, seed)
    kw = dict(prefix_caching=caching, kv_capacity=kv, block_size=bs)
    assert fingerprint(w, name, True, **kw)[0] == fingerprint(w, name, False, **kw)[0]


def test_the_flag_is_the_class_s_and_goes_with_its_schedule():
    from kvsched.engines.vllm_replay import _Recorder
    from kvsched.policies.base import decodes_when_idle
    from kvsched.policies.baselines import VllmV1
    v1 = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
    assert decodes_when_idle(v1) and decodes_when_idle(Fast("vllm-v1"))
    assert not decodes_when_idle(Counting("vllm-v1"))
    assert not decodes_when_idle(_Recorder(v1))            # it forwards attributes, not the flag

    class Pausing(VllmV1):                                  # a new schedule: the promise is not inherited
        def schedule(self, v):
            return super().schedule(v)

    class Declared(Pausing):
        decodes_when_idle = True
    limits = dict(max_num_batched_tokens=2048, max_num_seqs=256)
    assert not decodes_when_idle(Pausing(**limits)) and decodes_when_idle(Declared(**limits))
    instance = Counting("vllm-v1")
    instance.decodes_when_idle = True                       # an instance attribute is not a declaration
    assert not decodes_when_idle(instance)


def test_a_wrapped_noop_hook_is_called():
    import functools
    calls = []

    class Traced(Fast):
        pass
    p = Traced("vllm-v1")
    inner_hook = p.inner.on_finish

    @functools.wraps(inner_hook)
    def traced(i, v):
        calls.append(i)
        return inner_hook(i, v)
    p.on_finish = traced
    simulate(Scenario(workload(50, 5.0, 7), model="llama-2-7b", gpu="a100-80gb"), p)
    assert len(calls) == 50


def test_decode_time_of_a_subclass_that_redefines_time():
    from kvsched.cost.roofline import RooflineCost
    from kvsched.hardware import get_model
    from kvsched.sim.decode_run import decode_clock as _decode_time

    class Doubled(RooflineCost):
        def time(self, shape):
            return 2 * super().time(shape)
    c = Doubled(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    plain = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    assert _decode_time(c)(8, 4000, False) == 2 * plain.decode_time(8, 4000)

    class Field:
        decode_time = 0.5                                   # not a method: ignored
        def time(self, shape):
            return 0.01
    assert _decode_time(Field())(8, 4000, False) == 0.01


class FinishHook(Fast):
    def on_finish(self, i, v):
        self.inner.on_finish(i, v)


def test_fast_path_with_a_finish_hook():
    w = workload(300, 20.0, 8)
    for caching in (False, True):
        p, q = FinishHook("vllm-v1"), Counting("vllm-v1")
        runs = [simulate(Scenario(w, model="llama-2-7b", gpu="a100-80gb", prefix_caching=caching, kv_capacity=9000),
                         x, record_timeline=True) for x in (p, q)]
        assert [r.summary["mean_itl_ms"] for r in runs][0] == runs[1].summary["mean_itl_ms"]
        assert list(runs[0].timeline) == list(runs[1].timeline)
        assert p.calls < q.calls


def test_replay_records_every_batch():
    """`kvsched replay` wraps the policy to record its plans: every batch must be planned."""
    from kvsched.engines.vllm_replay import Limits, kvsched_steps
    g = np.random.default_rng(9)
    w = Workload.build(np.cumsum(g.exponential(0.2, 50)), g.integers(2, 700, 50), g.integers(1, 300, 50))
    steps = kvsched_steps(w, "vllm-v1", {}, Limits(2048, 64, num_gpu_blocks=2000), 0.01)
    decode_tokens = sum(sum(1 for c in s.tokens.values() if c == 1) for s in steps)
    assert decode_tokens == int(w.output.sum()) - len(w.output)    # o - 1 decode steps each (chunks >= 2)


# ----- an inert prefix cache (nothing keyed: a workload without shared content) ----------
# answers plans through `LazyPlanner` and frees finished requests through `free_private`;
# with `inert` forced False every batch takes the general cache path instead.
PLANNERS = ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level", "slai")     # slai: sarathi's admission


def _general_cache(monkeypatch) -> None:
    from kvsched.sim import prefix_cache
    monkeypatch.setattr(prefix_cache, "SHORTCUTS", False)


def _cache_fingerprint(w: Workload, name: str, **kw) -> tuple[str, dict]:
    p = make_policy(name, {}, get_gpu("a100-80gb"))
    r = simulate(Scenario(w, gpu="a100-80gb", model="llama-2-7b", prefix_caching=True, **kw), p,
                 record_timeline=True, record_batches=True)
    summary = {k: v for k, v in r.summary.items() if k != "wall_seconds"}
    rec = r.records
    per_request = [getattr(rec, k).tolist() for k in
                   ("first_token", "finished", "admitted", "itl_max", "preemptions", "recomputed")]
    blob = pickle.dumps((sorted(summary.items(), key=str), per_request, list(r.timeline), list(r.batches)))
    return hashlib.sha256(blob).hexdigest(), summary


@pytest.mark.parametrize("name", PLANNERS)
@pytest.mark.parametrize("kv_capacity", [None, 6_000])
def test_inert_cache_shortcuts_are_the_general_cache_path(name, kv_capacity, monkeypatch):
    w = workload(300, 25.0, 7)
    fast, summary = _cache_fingerprint(w, name, kv_capacity=kv_capacity)
    if kv_capacity is not None:
        assert summary["preemptions"] > 0       # preemptions key blocks: the cache leaves the inert state
    _general_cache(monkeypatch)
    assert _cache_fingerprint(w, name, kv_capacity=kv_capacity)[0] == fast


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rate=st.floats(1.0, 80.0), name=st.sampled_from(PLANNERS),
       kv=st.sampled_from([2_000, 5_000, None]), bs=st.sampled_from([1, 16]))
def test_inert_cache_shortcuts_are_exact_on_random_workloads(seed, rate, name, kv, bs, monkeypatch):
    w = workload(100, rate, seed)
    fast = _cache_fingerprint(w, name, kv_capacity=kv, block_size=bs)[0]
    with monkeypatch.context() as m:
        _general_cache(m)
        assert _cache_fingerprint(w, name, kv_capacity=kv, block_size=bs)[0] == fast


class Probing:
    """vllm-v1's plans, and before each a planner probed as a custom policy might use it:
    chunks, lookups, then a preemption and what the preempted request would hit (its own
    blocks, just keyed) and the others; the answers are kept."""
    name = "probing"

    def __init__(self) -> None:
        self.inner = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
        self.answers: list = []

    def schedule(self, v):
        p = v.prefix_planner()
        out = self.answers
        waiting = list(v.waiting)[:2]
        for i in v.prefilling:
            out.append(p.chunk(i, 1))
        for i in waiting:
            out += [p.lookup(i), p.chunk(i, min(16, v.prefill_target(i)))]
        if v.running:
            j = list(v.running)[-1]
            out.append(p.preempt(j))
            out += [p.lookup(j), p.lookup(j, 1), p.chunk(j, 1)]
        return self.inner.schedule(v)


def test_lazy_planner_answers_as_the_planner_after_a_preemption(monkeypatch):
    w = workload(200, 30.0, 11)
    kw = dict(gpu="a100-80gb", model="llama-2-7b", prefix_caching=True, kv_capacity=4_000, block_size=4)
    fast = Probing()
    simulate(Scenario(w, **kw), fast)
    _general_cache(monkeypatch)
    general = Probing()
    simulate(Scenario(w, **kw), general)
    assert any(isinstance(a, tuple) and a[0] > 0 for a in general.answers)     # hits were found
    assert fast.answers == general.answers



def test_a_batch_s_finished_requests_free_in_admission_order():
    """Off the inert path, the requests a batch finishes free their blocks in vLLM's order
    (by admission; landed ones, never admitted here, first), which decides which cached
    blocks are evicted first."""
    from types import SimpleNamespace

    from kvsched.cost import ConstantCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.replica import Replica
    from kvsched.sim.requests import RequestTable
    freed: list[int] = []
    kv = PagedKV(4096, 16)
    rep = Replica(RequestTable(workload(10, 1.0, 0), 16, kv.capacity_blocks), make_policy("vllm-v1", {}, get_gpu("a100-80gb")),
                  ConstantCost(0.01), kv)
    rep.cache = SimpleNamespace(inert=False, free=lambda i, kv_tokens, done: freed.append(i))
    rep._finishing[:] = [(3, 40), (5, 10), (8, 16)]
    rep._order.update({3: 7, 5: 2})
    from kvsched.sim.kv_blocks import free_finished
    free_finished(rep)
    assert freed == [8, 5, 3]
    assert rep._finishing == [] and rep._order == {}


def test_a_roofline_subclass_is_timed_with_its_own_terms_and_errors():
    """The replica's C batch times (DenseTime) are made from the cost's terms when the replica
    starts, so a subclass that changes them in its __post_init__ (FP8 KV here) is timed with
    its own terms, as its Python `time` would; a GPU with a zero rate leaves `time` to raise,
    and the error names the cost model (found by the independent review)."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.errors import KvschedError
    from kvsched.hardware import GPU, get_model
    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server

    class Fp8Kv(RooflineCost):
        def __post_init__(self):
            super().__post_init__()
            object.__setattr__(self, "_kv_bytes", self._kv_bytes // 2)

    class Fp8KvPython(Fp8Kv):
        def time(self, shape):                  # its own time: the engine calls the Python formula
            return super().time(shape)

    def run(cost):
        w = workload(120, 8.0, 3)
        rec = Server(w, make_policy("sarathi", {}, get_gpu("a100-80gb")), cost, PagedKV(60_000, 16)).run()
        return rec.first_token.tolist(), rec.finished.tolist()

    model, gpu = get_model("llama-2-7b"), get_gpu("a100-80gb")
    fp8 = run(Fp8Kv(model, gpu))
    assert fp8 == run(Fp8KvPython(model, gpu)) and fp8 != run(RooflineCost(model, gpu))
    with pytest.raises(KvschedError, match="cost model RooflineCost raised ZeroDivisionError"):
        run(RooflineCost(model, GPU("no-flops", 80.0, 2e12, 0.0)))
