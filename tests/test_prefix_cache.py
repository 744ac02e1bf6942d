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
    assert len(cache.free_q) == len(cached) <= blocks and set(cache.free_q) == set(cached)
    done = np.isfinite(rec.finished)
    assert (done | rec.rejected).all()
    assert cache.hit_tokens <= cache.query_tokens
