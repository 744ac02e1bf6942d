"""Prefix caching (sim/prefix_cache.py): hand-worked cases, vLLM's eviction order, and
invariants over random workloads."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched.errors import KvschedError
from kvsched.policies.base import Plan
from kvsched.run import Scenario, simulate
from kvsched.workload.request import Ragged, Segments, Workload

BS = 16


def workload(arrivals, prompts, outputs, segments) -> Workload:
    """Requests with the given segments: one list of (content id, tokens) per request."""
    off = np.concatenate(([0], np.cumsum([len(s) for s in segments]))).astype(np.int64)
    ids = Ragged(np.array([x for s in segments for x, _ in s], np.int64), off)
    lengths = Ragged(np.array([n for s in segments for _, n in s], np.int64), off)
    return Workload.build(arrivals, prompts, outputs, segments=Segments(ids, lengths))


def run(w: Workload, policy="vllm-v1", caching=True, capacity=1600, **kw):
    sc = Scenario(w, cost="constant", kv_capacity=capacity, block_size=BS, prefix_caching=caching)
    return simulate(sc, policy, record_batches=True, **kw)


def prefill_tokens(result) -> list[int]:
    """Prefill tokens of each batch that computed any."""
    return [b[2] for b in result.batches if b[2]]


def test_shared_prefix_computes_only_the_suffix():
    # two requests share a 3-block prefix (48 tokens); the second arrives after the first finished
    w = workload([0.0, 10.0], [68, 68], [4, 4], [[(7, 48)], [(7, 48)]])
    assert prefill_tokens(run(w, caching=False)) == [68, 68]
    r = run(w)
    assert prefill_tokens(r) == [68, 20]
    assert r.summary["prefill_tokens_saved"] == 48
    assert r.summary["prefix_block_hit_rate"] == pytest.approx(3 / 8)   # (68 - 1) // 16 = 4 blocks looked up each


def test_full_prompt_hit_computes_one_token():
    # prompt 49 = a 48-token shared prefix + 1 own token: the whole cacheable prompt hits
    w = workload([0.0, 10.0], [49, 49], [2, 2], [[(7, 48)], [(7, 48)]])
    assert prefill_tokens(run(w)) == [49, 1]


def test_block_aligned_prompt_recomputes_its_last_block():
    # vLLM caps a hit at prompt - 1 tokens, whole blocks: a 48-token prompt that is fully
    # cached still computes its last block (kv_cache_manager.get_computed_blocks)
    w = workload([0.0, 10.0], [48, 48], [2, 2], [[(7, 48)], [(7, 48)]])
    assert prefill_tokens(run(w)) == [48, 16]


def test_concurrent_requests_share_blocks_and_count_them_once():
    # both arrive together: vLLM caches the first one's blocks as it schedules them, so the
    # second, admitted in the same step, computes only its own tokens
    w = workload([0.0, 0.0], [80, 80], [3, 3], [[(7, 64)], [(7, 64)]])
    r = run(w)
    assert prefill_tokens(r) == [80 + 16]
    assert r.batches[0][5] == (5 + 1) * BS        # 4 shared blocks + one own block each


def test_cached_block_evicted_in_vllm_order():
    # A = 64 shared + 16 own tokens, output 1: it finishes at its prefill, freeing 5 full
    # blocks tail first. B (5 own blocks) then needs 2 blocks beyond the 3 never used: it
    # evicts A's own block and A's last shared block, so C hits only 3 blocks of the prefix.
    w = workload([0.0, 10.0, 20.0], [80, 80, 80], [1, 1, 1], [[(7, 64)], [], [(7, 64)]])
    r = run(w, capacity=8 * BS)
    assert prefill_tokens(r) == [80, 80, 32]
    assert r.summary["prefix_evictions"] == 2 + 2     # B evicts 2; C's 2 new blocks evict 2 more
    # with room for everything, nothing is evicted and C hits the whole prefix
    assert prefill_tokens(run(w, capacity=16 * BS)) == [80, 80, 16]


class Scripted:
    """Runs request 0's prefill and one decode step, preempts it while admitting request 1,
    then readmits it with the chunk its cached prefix leaves."""
    name = "scripted"

    def __init__(self) -> None:
        self.step = 0
        self.seen: list[int] = []

    def schedule(self, v) -> Plan:
        self.step += 1
        if self.step == 1:
            return Plan([0], [(0, v.prefill_target(0))])
        if self.step == 2:
            return Plan(decode=True)
        if self.step == 3:
            return Plan([1], [(1, v.prefill_target(1))], preempt=[0])
        if 0 in v.waiting:
            cached = v.cached_tokens(0)
            self.seen.append(cached)
            return Plan([0], [(0, v.prefill_target(0) - cached)], decode=True)
        return Plan(decode=True)


def test_preempted_request_reuses_its_blocks():
    w = workload([0.0, 0.0], [100, 30], [20, 5], [[], []])
    pol = Scripted()
    r = run(w, pol)
    # preempted with KV = 101 tokens (6 full blocks stay cached); its target is now 102
    assert pol.seen == [96]
    assert prefill_tokens(r)[:3] == [100, 30, 6]
    assert r.summary["completed"] == 2
    assert r.summary["prefill_tokens_saved"] == 96


def test_a_chunk_planned_without_the_cache_takes_the_hit_it_leaves_room_for():
    class Blind:
        """Chunks of 32 tokens from prefill_done, never asking the cache."""
        name = "blind"

        def schedule(self, v) -> Plan:
            chunks = [(i, min(32, v.prefill_target(i) - v.prefill_done(i))) for i in v.prefilling]
            admit = list(v.waiting)[:1] if not v.running else []
            chunks += [(i, min(32, v.prefill_target(i))) for i in admit]
            return Plan(admit, chunks, bool(v.num_decoding))
    w = workload([0.0, 10.0], [68, 68], [4, 4], [[(7, 48)], [(7, 48)]])
    # the second request's first chunk of 32 leaves room for (68 - 32) // 16 = 2 cached blocks
    assert prefill_tokens(run(w, Blind())) == [32, 32, 4, 32, 4]


def test_caching_off_ignores_segments():
    rng = np.random.default_rng(3)
    n = 60
    segs = [[(int(rng.integers(3)), 32)] for _ in range(n)]
    arr, pr, out = np.sort(rng.uniform(0, 5, n)), rng.integers(40, 200, n), rng.integers(1, 40, n)
    with_segs = workload(arr, pr, out, segs)
    plain = Workload.build(arr, pr, out)
    for policy in ("vllm-v1", "sarathi"):
        a = run(with_segs, policy, caching=False, capacity=40 * BS).summary
        b = run(plain, policy, caching=False, capacity=40 * BS).summary
        a.pop("wall_seconds"), b.pop("wall_seconds")
        assert a == b


def test_prefix_caching_flag_errors():
    from kvsched.cli.common import HardwareOptions
    hw = HardwareOptions("llama-3-8b", "a100-80gb", None, 16, 0.9, None, "constant", [], "maybe")
    with pytest.raises(KvschedError, match="--prefix-caching must be on or off"):
        hw.scenario(Workload.build([0.0], [10], [2]))


@st.composite
def shared_workloads(draw):
    n = draw(st.integers(2, 30))
    rows = []
    t = 0.0
    for _ in range(n):
        t += draw(st.floats(0, 0.5))
        k = draw(st.integers(0, 2))                       # 0..2 shared segments, chained
        segs = [(draw(st.integers(0, 3)), draw(st.integers(1, 70))) for _ in range(k)]
        prompt = sum(x for _, x in segs) + draw(st.integers(1, 60))
        rows.append((t, prompt, draw(st.integers(1, 30)), segs))
    return workload([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=shared_workloads(), blocks=st.integers(12, 40),
       policy=st.sampled_from(["vllm-v1", "sarathi", "orca", "vllm-v0", "request-level"]))
def test_kv_within_capacity_and_references_return_to_zero(w, blocks, policy):
    from kvsched.sim.cluster import Cluster
    from kvsched.cost import make_cost_model
    from kvsched.kvcache import PagedKV
    from kvsched.policies import make_policy
    from kvsched.hardware import get_gpu
    kv = PagedKV(blocks * BS, BS)
    params = {"request-level": {}, "sarathi": {"chunk_size": 64, "max_num_seqs": 8}}.get(
        policy, {"max_num_seqs": 8, "max_num_batched_tokens": 64} if policy != "orca" else {"max_num_seqs": 8})
    pol = make_policy(policy, params, get_gpu("a100-80gb"))
    cl = Cluster(w, [pol], make_cost_model("constant", {}, None, None), kv, prefix_caching=True, record_timeline=True)
    rec = cl.run()
    rep = cl.replicas[0]
    assert max(row[3] for row in rep.timeline) <= blocks * BS          # shared blocks counted once
    cache = rep.cache
    assert kv.used == 0 and not cache.held
    cached = [b for k in cache.map for b in cache.candidates(k)]
    assert all(b.ref == 0 for b in cached)
    from kvsched.sim.prefix_cache import Run
    runs = sum(b.n for b in cache.free_q if isinstance(b, Run))
    assert {b for b in cache.free_q if not isinstance(b, Run)} == set(cached)
    assert cache.queued == len(cached) + runs <= blocks
    done = np.isfinite(rec.finished)
    assert (done | rec.rejected).all()
    assert cache.hit_tokens <= cache.query_tokens


def cache_of(w: Workload, blocks: int = 40):
    from kvsched.kvcache import PagedKV
    from kvsched.sim.prefix_cache import PrefixCache
    from kvsched.sim.requests import RequestTable
    kv = PagedKV(blocks * BS, BS)
    return PrefixCache(kv, RequestTable(w, BS, kv.capacity_blocks)), kv


def test_freed_blocks_queue_tail_first_decode_filled_ones_included():
    # request 0 computed a 32-token prompt (2 cached blocks) and decoded to 71 tokens of KV:
    # blocks 2 and 3 were filled by decode steps; freeing queues 3, 2, 1, 0 (the partial 5th is uncached)
    cache, kv = cache_of(workload([0.0], [32], [50], [[]]))
    cache.register(0, 0, 32)
    kv.used = 5
    cache.free(0, 71, False)
    assert [b.key for b in cache.free_q] == list(reversed(cache.keys(0, 4)))
    assert kv.used == 0


def test_a_duplicate_key_hits_its_oldest_copy():
    # request 1 computes the shared 48 tokens itself (no hit): vLLM keeps both copies and a
    # later hit takes the first one cached
    cache, kv = cache_of(workload([0.0, 0.0, 1.0], [49, 49, 49], [1, 1, 1], [[(7, 48)]] * 3))
    cache.register(0, 0, 48)
    first = list(cache.held[0])
    cache.register(1, 0, 48)
    assert [b for b in cache.walk(2)] == first
    assert all(len(cache.candidates(b.key)) == 2 for b in first)


class PreemptAndReadmit:
    """Preempts decoding request 0 and readmits it in the same plan, sized by the planner."""
    name = "preempt-readmit"

    def __init__(self) -> None:
        self.k = 0
        self.planned: list[int] = []

    def schedule(self, v) -> Plan:
        self.k += 1
        if self.k == 1:
            return Plan([0], [(0, v.prefill_target(0))])
        if self.k in (2, 3):
            return Plan(decode=True)
        if self.k == 4:
            hits = v.prefix_planner()
            hits.preempt(0)
            hit, _ = hits.lookup(0)
            c = v.prompt_len(0) + v.generated(0) - hit
            self.planned.append(hits.chunk(0, c))
            return Plan([0], [(0, c)], preempt=[0])
        return Plan(decode=bool(v.num_decoding))


def test_planner_knows_a_request_preempted_and_readmitted_in_one_plan():
    pol = PreemptAndReadmit()
    r = run(workload([0.0], [80], [30], [[(7, 64)]]), pol)
    # KV 82 tokens when preempted: 5 full blocks cached; the new target is 83, so the hit is 80
    assert pol.planned == [80] and prefill_tokens(r)[:2] == [80, 3]


def test_requests_with_equal_ids_share_nothing():
    # caller ids may repeat (Workload.build(ids=...)): a request's own tokens are its row's
    for ids in ([5, 5], [-1, -2]):
        w = Workload.build([0.0, 10.0], [160, 160], [2, 2], ids=ids)
        assert prefill_tokens(run(w)) == [160, 160]


def test_prefix_affinity_routes_to_the_replica_holding_the_prefix():
    from kvsched.sim.routers import PrefixAffinity, ReplicaSummary
    r = PrefixAffinity()
    idle = [ReplicaSummary(k, 2, 10, 100, 0, 0) for k in range(3)]
    hot = idle[:1] + [ReplicaSummary(1, 2, 10, 100, 0, 640)] + idle[2:]
    assert r.route(0, 0.0, hot, prompt=800) == 1
    # the load guard: a much busier replica loses its affinity
    busy = [ReplicaSummary(0, 0, 10, 100, 0, 0), ReplicaSummary(1, 40, 95, 100, 0, 640), ReplicaSummary(2, 1, 10, 100, 0, 0)]
    assert r.route(0, 0.0, busy, prompt=800) == 0
    with pytest.raises(KvschedError, match="w_kv"):
        PrefixAffinity(w_kv=-1)
    # end to end: requests sharing a prompt follow it with caching on
    segs = [[(k % 3, 512)] for k in range(40)]          # 3 prompts over 2 replicas
    w = workload([0.1 * k for k in range(40)], [600] * 40, [5] * 40, segs)
    res = {}
    for router in ("least-outstanding", "prefix-affinity"):
        sc = Scenario(w, cost="constant", kv_capacity=400 * BS, block_size=BS, prefix_caching=True, replicas=2,
                      router=router)
        res[router] = simulate(sc, "vllm-v1").summary["prefix_hit_rate"]
    assert res["prefix-affinity"] > res["least-outstanding"]
