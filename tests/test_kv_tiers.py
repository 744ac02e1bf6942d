"""The prefix cache's tiers below the GPU (sim/kv_tiers.py, docs/kv-tiers.md): hand-worked load
times, FIFO links, a remote store shared by replicas, the invariants with tiers on for every
policy, bad input, and nothing changed when off."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import get_model
from kvsched.layout import Layout
from kvsched.run import Scenario, simulate
from kvsched.sim.host_swap import parse_kv_tier
from kvsched.sim.kv_tiers import Offload, TierStore, parse_tiers
from kvsched.workload.request import Ragged, Segments, Workload

KV = get_model("llama-3-8b").kv_bytes_per_token          # 131,072 bytes a token
BB = 16 * KV                                             # 2,097,152 bytes a block of 16 tokens


def workload(arrivals, prompts, outputs, segments, known: bool = False) -> Workload:
    """Requests with the given segments: one list of (content id, tokens) per request."""
    off = np.concatenate(([0], np.cumsum([len(s) for s in segments]))).astype(np.int64)
    ids = Ragged(np.array([x for s in segments for x, _ in s], np.int64), off)
    lengths = Ragged(np.array([n for s in segments for _, n in s], np.int64), off)
    return Workload.build(np.array(arrivals, float), np.array(prompts), np.array(outputs),
                          segments=Segments(ids, lengths), output_known=known)


def scenario(w: Workload, tiers=(), capacity=96, **kw) -> Scenario:
    return Scenario(w, model="llama-3-8b", cost="constant", cost_params={"b": 0.05}, kv_capacity=capacity,
                    block_size=16, prefix_caching=True, client=None, kv_tiers=tiers, **kw)


def evicted_then_hit() -> Workload:
    """A (t=0) caches a 48-token prefix (3 blocks); C (t=5, 90 tokens, no prefix) needs all 6
    blocks of the GPU and evicts A's; B (t=10) begins with A's prefix."""
    return workload([0.0, 5.0, 10.0], [68, 90, 68], [4, 2, 4], [[(7, 48)], [], [(7, 48)]])


def test_a_host_hit_delays_the_prefill_by_the_load_time(monkeypatch):
    """B's 3 blocks come back from host over a 16 GB/s link with 1 ms latency: its prefill (20
    tokens, its prefix hit) starts 3 x 2,097,152 / 16e9 + 0.001 s after it arrives, where
    GPU-only it prefills all 68 tokens at once."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    gpu_only = simulate(scenario(evicted_then_hit()), "vllm-v1", record_batches=True)
    r = simulate(scenario(evicted_then_hit(), ("host:1:16:0.001",)), "vllm-v1", record_batches=True)
    load = 3 * BB / 16e9 + 0.001
    assert gpu_only.records.first_token[2] == 10.05
    assert r.records.first_token[2] == pytest.approx(10.0 + load + 0.05, rel=1e-12)
    assert [b[2] for b in gpu_only.batches if b[2]] == [68, 90, 68]
    assert [b[2] for b in r.batches if b[2]] == [68, 90, 20]         # B computes its own 20 tokens only
    s = r.summary
    host = s["tier_breakdown"][0]
    assert host["name"] == "host" and host["loads"] == 1
    assert host["bytes_in"] == 3 * BB and host["bytes_out"] == 3 * BB     # A's keyed blocks down, B's back
    assert host["hit_rate"] == pytest.approx(48 / (68 + 90 + 68))
    assert s["mean_load_wait_ms"] == pytest.approx(1000 * load, rel=1e-12)
    split = s["ttft_split_ms"]
    assert split["loading"]["mean"] == pytest.approx(1000 * load / 3, rel=1e-9)
    assert split["prefill"]["mean"] == pytest.approx(50.0, rel=1e-9)
    total = sum(split[k]["mean"] for k in ("queueing", "loading", "prefill"))
    assert total == pytest.approx(s["mean_ttft_ms"], rel=1e-9)


def test_a_block_evicted_with_its_write_still_queued_is_absent():
    """At 0.002097152 GB/s each block's write holds the link 1 s: A's blocks, evicted at 5.0,
    reach host at 6, 7 and 8 s (+ latency). B at 5.5 finds them neither on the GPU nor readable
    below: it computes them, and the run is the GPU-only run bit for bit (vLLM finishes a store
    before it reuses the block, so it never waits on such a block: `Offload.delay`)."""
    w = workload([0.0, 5.0, 5.5], [68, 90, 68], [4, 2, 4], [[(7, 48)], [], [(7, 48)]])
    gpu_only = simulate(scenario(w), "vllm-v1").records
    r = simulate(scenario(w, ("host:1:0.002097152:0.001",)), "vllm-v1")
    assert r.records.first_token.tobytes() == gpu_only.first_token.tobytes()
    assert r.summary["tier_breakdown"][0]["loads"] == 0


def test_two_loads_on_one_link_queue_fifo():
    """Two loads of 3 blocks started at once on one 16 GB/s link: the first lands after its own
    bytes, the second after both (FIFO), each + latency; the link is busy for the sum."""
    store = TierStore(parse_kv_tier("host:1:16:0.001"), BB)
    off = Offload([store], 16, False)
    off.write(list(range(6)))               # six blocks written at t = 0 (each holds the write link)
    assert list(store.keys.values()) == pytest.approx([(k + 1) * BB / 16e9 + 0.001 for k in range(6)])
    off.clock.now = 1.0
    off.start(0, [0, 1, 2], 0, [0, 0, 0], True)
    off.start(1, [3, 4, 5], 0, [0, 0, 0], True)
    hold = 3 * BB / 16e9
    assert off.loading[0][0] == pytest.approx(1.0 + hold + 0.001, rel=1e-15)
    assert off.loading[1][0] == pytest.approx(1.0 + 2 * hold + 0.001, rel=1e-15)
    assert off.ports[0].read.busy == pytest.approx(2 * hold)
    assert [i for i, _, _ in off.landed(1.0 + hold + 0.001)] == [0]
    assert [i for i, _, _ in off.landed(2.0)] == [1]
    assert off.load_s == pytest.approx({0: hold + 0.001, 1: 2 * hold + 0.001})


def test_two_concurrent_loads_in_a_run_take_the_fifo_times(monkeypatch):
    """B1 and B2 arrive together, their prefixes (3 blocks each) in host: their loads start at
    10 s on one link; the second lands one transfer later than the first."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 1.0, 5.0, 10.0, 10.0], [68, 68, 190, 68, 68], [4, 4, 2, 4, 4],
                 [[(7, 48)], [(8, 48)], [], [(7, 48)], [(8, 48)]])
    r = simulate(scenario(w, ("host:1:16:0.001",), capacity=192), "vllm-v1")
    hold = 3 * BB / 16e9
    assert r.summary["tier_breakdown"][0]["loads"] == 2
    assert r.summary["mean_load_wait_ms"] == pytest.approx(1000 * (1.5 * hold + 0.001), rel=1e-12)   # (hold + lat + 2 hold + lat) / 2
    assert r.records.first_token[3] == pytest.approx(10.0 + hold + 0.001 + 0.05, rel=1e-12)
    assert r.records.first_token[4] >= 10.0 + 2 * hold + 0.001 + 0.05


def test_disk_and_host_tiers_read_from_the_fastest_holder():
    """With host and disk both holding B's prefix (inclusive writes), B reads from host."""
    r = simulate(scenario(evicted_then_hit(), ("disk:10:2:0.0001", "host:1:16:0.001")), "vllm-v1")
    rows = {t["name"]: t for t in r.summary["tier_breakdown"]}
    assert list(rows) == ["host", "disk"]
    assert rows["host"]["loads"] == 1 and rows["disk"]["loads"] == 0
    assert rows["disk"]["bytes_in"] == 3 * BB and rows["disk"]["bytes_out"] == 0


def test_a_remote_store_serves_another_replicas_prefix(monkeypatch):
    """Two replicas, round-robin: replica 0 writes A's prefix to the shared remote store; B
    (t=10) lands on replica 1, whose GPU never held it, and loads it from remote. With host
    tiers only (each replica's own), replica 1 has nothing to load."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 5.0, 10.0, 10.0], [68, 90, 20, 68], [4, 2, 2, 4], [[(7, 48)], [], [], [(7, 48)]])
    base = dict(replicas=2, router="round-robin")
    # round-robin: A -> 0, C -> 1, a filler -> 0, B -> 1; A's blocks go down as computed (write-through)
    remote = simulate(scenario(w, ("remote:10:5:0.002",), kv_write="through", **base), "vllm-v1")
    host = simulate(scenario(w, ("host:10:5:0.002",), kv_write="through", **base), "vllm-v1")
    row = remote.summary["tier_breakdown"][0]
    assert row["name"] == "remote" and row["loads"] == 1 and row["bytes_out"] == 3 * BB
    assert host.summary["tier_breakdown"][0]["loads"] == 0
    load = 3 * BB / 5e9 + 0.002
    assert remote.records.first_token[3] == pytest.approx(10.0 + load + 0.05, rel=1e-12)


def test_remote_traffic_and_disaggregated_transfers_share_the_network_link(monkeypatch):
    """One prefill and one decode replica. A (one output token, so no transfer) computes its
    68-token prompt by 0.05; with write-through its 4 full blocks go to the remote store at the
    batch's end over a 0.05 GB/s path that queues on the prefill replica's KV link, holding it
    4 x 2,097,152 / 5e7 s; B's one full block follows at the end of its batch (0.10), before
    the cluster sends B's KV. B's KV transfer to the decode replica, ready at 0.10, waits for
    them: B finishes exactly 0.05 + that - 0.10 s later than without the tier."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 0.05], [68, 20], [1, 4], [[(7, 48)], []])
    disagg = dict(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=5.0)
    base = simulate(scenario(w, capacity=1600, **disagg), "vllm-v1").records
    r = simulate(scenario(w, ("remote:10:0.05:0.002",), capacity=1600, kv_write="through", **disagg), "vllm-v1")
    writes = 5 * BB / 5e7
    assert r.records.finished[0] == base.finished[0] == 0.05
    assert r.records.finished[1] == pytest.approx(base.finished[1] + (0.05 + writes - 0.10), rel=1e-12)
    row = r.summary["tier_breakdown"][0]
    assert row["bytes_in"] == 5 * BB
    assert row["link_busy_fraction"] == pytest.approx(writes / r.records.finished[1], rel=1e-9)


def test_write_through_writes_blocks_as_they_are_computed():
    """--kv-write through: A's 4 full prompt blocks (3 of its shared prefix, 1 of its own) go
    down at its prefill, as vLLM stores every full prompt block, so the host holds them even
    though nothing is evicted; its decode-filled blocks do not (prompt only)."""
    w = workload([0.0], [68], [40], [[(7, 48)]])
    r = simulate(scenario(w, ("host:1:16",), capacity=1600, kv_write="through"), "vllm-v1")
    assert r.summary["tier_breakdown"][0]["bytes_in"] == 4 * BB
    e = simulate(scenario(w, ("host:1:16",), capacity=1600), "vllm-v1")
    assert e.summary["tier_breakdown"][0]["bytes_in"] == 0       # evict mode: nothing evicted, nothing written


def test_nothing_changes_without_a_hit_below():
    """Tiers on, but nothing to load (no shared content, no preemption): the GPU-only run bit
    for bit."""
    rng = np.random.default_rng(1)
    n = 50
    w = Workload.build(np.sort(rng.uniform(0, 2, n)), rng.integers(20, 300, n), rng.integers(5, 100, n))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=80_000, prefix_caching=True, client=None)
    off = simulate(sc, "vllm-v1").records
    on = simulate(dataclasses.replace(sc, kv_tiers=("host:1:16",)), "vllm-v1")
    assert on.summary["tier_loads"] == 0
    for f in ("finished", "first_token", "admitted", "recomputed"):
        assert np.asarray(getattr(on.records, f)).tobytes() == np.asarray(getattr(off, f)).tobytes()


def test_a_preempted_request_reloads_its_own_blocks(monkeypatch):
    """Preemption by recompute keys a victim's blocks; evicted, they go down, and its
    recomputation loads them back instead of computing them: fewer tokens recomputed."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(1)
    n = 50
    w = Workload.build(np.sort(rng.uniform(0, 2, n)), rng.integers(20, 300, n), rng.integers(5, 100, n))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=4096, prefix_caching=True, client=None)
    off = simulate(sc, "vllm-v1")
    on = simulate(dataclasses.replace(sc, kv_tiers=("host:1:16",)), "vllm-v1")
    assert off.summary["preemptions"] > 0 and on.summary["tier_loads"] > 0
    assert on.records.recomputed.sum() < off.records.recomputed.sum()


def shared_workload(seed: int, n: int = 40) -> Workload:
    """KV-tight random requests, most beginning with one of 4 shared prefixes of 1-6 blocks."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(40, 300, n)
    segs = []
    for p in prompts:
        k = int(rng.integers(0, 5))
        segs.append([] if k == 4 else [(k, int(min(p, 16 * (k + 1) + 5)))])
    return workload(np.sort(rng.uniform(0, 3, n)), prompts, rng.integers(2, 120, n), segs, known=True)


# every policy: the eb policies, wait, nested-wait, rad and slai plan prompts from token 0, so their
# tiers are written and never read; distserve runs on disaggregated pools (its own test below)
POLICY_NAMES = ["vllm-v1", "vllm-v0", "sarathi", "orca", "request-level", "eb", "eb-adaptive", "eb-plus", "wait",
                "nested-wait", "rad", "slai"]
READERS = {"vllm-v1", "vllm-v0", "sarathi", "orca", "request-level"}     # plans_prefix_hits: tiers are read
PARAMS = {"nested-wait": {"segments": "60,240,1000"}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(POLICY_NAMES), write=st.sampled_from(["evict", "through"]),
       tiers=st.sampled_from([("host:0.01:16:0.0001",), ("host:0.007:4", "disk:0.05:2:0.001"),
                              ("host:0.004:16", "remote:0.02:1:0.002")]), replicas=st.sampled_from([1, 3]),
       node=st.sampled_from([0, 2]))
def test_invariants_hold_with_tiers_on(seed, policy, write, tiers, replicas, node, monkeypatch):
    """Blocks conserved on the GPU (loading requests' included), no tier over its capacity,
    every request finished or counted rejected (KVSCHED_CHECK=1: sim/invariants.py), for every
    policy, on KV-tight workloads with shared prefixes, with and without node-shared tiers;
    loads happened on some."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = shared_workload(seed)
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True, client=None,
                  kv_tiers=tiers, kv_write=write, replicas=replicas, gpus_per_node=node)
    s = simulate(sc, policy, PARAMS.get(policy)).summary
    assert s["completed"] + s.get("rejected", 0) == len(w)
    assert s["tier_reads"] == (policy in READERS) and (s["tier_loads"] == 0 or policy in READERS)
    for row in s["tier_breakdown"]:
        assert row["bytes_out"] <= row["loads"] * 1024 * KV * 16 or row["loads"] == 0


def test_tiers_are_deterministic():
    w = shared_workload(5, 80)
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True, client=None,
                  kv_tiers=("host:0.004:16", "remote:0.02:1:0.002"), replicas=2)
    a, b = simulate(sc, "vllm-v1"), simulate(sc, "vllm-v1")
    assert a.records.finished.tobytes() == b.records.finished.tobytes()
    assert a.summary["tier_breakdown"] == b.summary["tier_breakdown"]
    assert a.summary["tier_loads"] > 0


@pytest.mark.parametrize("kw, msg", [
    ({"kv_tiers": ("host:1:16",), "kv_write": "later"}, "--kv-write must be one of evict, through"),
    ({"kv_write": "through"}, "--kv-write sets how"),
    ({"kv_tiers": ("host:1:16", "host:2:16")}, "host given twice"),
    ({"kv_tiers": ("host:1:16", "disk:1:2"), "preemption": "swap"}, "exactly one tier"),
    ({"kv_tiers": ("ssd:1:16",)}, "KIND one of host, disk, remote"),
    ({"kv_tiers": ("host:1:16",), "preemption": "swap", "prefill_replicas": 1, "decode_replicas": 1},
     "no disaggregation yet"),
    ({"kv_tiers": ("remote:1:16",), "pool": ("a=h100-sxm:1",)}, "not modelled with --pool"),
])
def test_bad_tier_settings_are_one_line_errors(kw, msg):
    w = workload([0.0], [68], [4], [[(7, 48)]])
    with pytest.raises(KvschedError, match=msg):
        simulate(scenario(w, kw.pop("kv_tiers", ()), **kw), "vllm-v1")


@pytest.mark.parametrize("policy", ["eb", "eb-adaptive", "eb-plus", "wait", "nested-wait", "rad", "slai"])
def test_policies_that_plan_from_token_zero_write_the_tiers_and_never_read_them(policy):
    """A policy without `plans_prefix_hits` computes each prompt from token 0, so a loaded prefix
    would be computed again (review: eb wasted every load; wait's own queue admitted a loading
    request): its tiers are written (evictions go down) and nothing loads. The same run with the
    tiers gives the same requests' times as without them."""
    sc = Scenario(shared_workload(0, 120), model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True,
                  client=None, kv_tiers=("host:1:16",))
    r = simulate(sc, policy, PARAMS.get(policy))
    s = r.summary
    assert s["tier_reads"] is False and s["tier_loads"] == 0
    assert s["tier_breakdown"][0]["bytes_out"] == 0 and s["tier_breakdown"][0]["bytes_in"] > 0
    plain = simulate(dataclasses.replace(sc, kv_tiers=()), policy, PARAMS.get(policy))
    for f in ("admitted", "first_token", "finished", "preemptions", "recomputed", "itl_max", "replica"):
        assert np.asarray(getattr(r.records, f)).tobytes() == np.asarray(getattr(plain.records, f)).tobytes(), f


def test_distserve_with_tiers_writes_them_on_the_prefill_pool(monkeypatch):
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = shared_workload(3, 80)
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True, client=None,
                  kv_tiers=("host:0.004:16", "remote:0.02:1:0.002"), prefill_replicas=1, decode_replicas=1)
    s = simulate(sc, "distserve").summary
    assert s["completed"] + s.get("rejected", 0) == len(w)
    assert s["tier_reads"] is False and s["tier_loads"] == 0
    assert all(row["bytes_in"] > 0 for row in s["tier_breakdown"])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["vllm-v1", "sarathi", "distserve"]),
       write=st.sampled_from(["evict", "through"]), node=st.sampled_from([0, 2]))
def test_invariants_hold_with_tiers_on_disaggregated_pools(seed, policy, write, node, monkeypatch):
    """The invariants with tiers on the prefill pool (2 prefill, 1 decode replica), a remote
    store sharing each prefill replica's network link, and with --gpus-per-node 2 a host tier
    the two prefill replicas share."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = shared_workload(seed)
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True, client=None,
                  kv_tiers=("host:0.004:16", "remote:0.02:1:0.002"), kv_write=write, prefill_replicas=2,
                  decode_replicas=1, gpus_per_node=node)
    s = simulate(sc, policy).summary
    assert s["completed"] + s.get("rejected", 0) == len(w)
    assert s["tier_reads"] == (policy != "distserve")


def test_an_arrival_while_a_replica_waits_on_a_load_is_served_at_its_time(monkeypatch):
    """Review finding: a replica with nothing to run but a load in flight moved its clock to the
    landing within one step, so D (t=10.2, no prefix, room for it) waited for B's load (lands
    at 10 + 3 x 2,097,152 / 1e7 + 0.001 = 10.63). vLLM schedules D at the next step while B
    waits for its KV: D's first token is at 10.25."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 5.0, 10.0, 10.2], [68, 90, 68, 20], [4, 2, 4, 2], [[(7, 48)], [], [(7, 48)], []])
    r = simulate(scenario(w, ("host:1:0.01:0.001",)), "vllm-v1")
    assert r.summary["tier_loads"] == 1
    assert r.records.first_token[3] == pytest.approx(10.25, rel=1e-12)
    assert r.records.first_token[2] == pytest.approx(10.0 + 3 * BB / 1e7 + 0.001 + 0.05, rel=1e-12)


def test_a_load_leaves_free_what_the_loads_in_flight_still_need(monkeypatch):
    """Review finding: A (t=10, a 30-block prompt whose 3-block prefix loads slowly from remote)
    is in flight; B (t=10.1) would load 6 blocks into the room A still needs (vLLM reserves an
    in-flight load's remaining blocks: `_inflight_prefill_reserved_blocks`). B's load waits, so
    A's first token comes as without B."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    arrivals, prompts, outputs = [0.0, 0.0, 0.0, 10.0, 10.0, 10.1], [68, 16, 116, 480, 16, 160], [2, 300, 2, 2, 2, 2]
    segs = [[(7, 48)], [], [(8, 96)], [(7, 48)], [], [(8, 96)]]
    kw = dict(capacity=48 * 16, kv_write="through", replicas=2, router="round-robin")
    both = simulate(scenario(workload(arrivals, prompts, outputs, segs), ("remote:1:0.01:0",), **kw), "vllm-v1")
    keep = [0, 1, 2, 3, 4]
    alone = simulate(scenario(workload([arrivals[k] for k in keep], [prompts[k] for k in keep],
                                       [outputs[k] for k in keep], [segs[k] for k in keep]),
                              ("remote:1:0.01:0",), **kw), "vllm-v1")
    assert both.summary["tier_loads"] == 2
    assert both.records.first_token[3] == alone.records.first_token[3]


def test_tiers_need_the_prefix_cache():
    w = workload([0.0], [68], [4], [[(7, 48)]])
    with pytest.raises(KvschedError, match="turn it on with --prefix-caching"):
        simulate(dataclasses.replace(scenario(w, ("host:1:16",)), prefix_caching=False), "vllm-v1")


def test_a_tier_smaller_than_a_block_is_refused():
    with pytest.raises(KvschedError, match="holds no KV block"):
        parse_tiers(("host:0.000001:16",), "evict", BB, 1)


def test_the_cli_takes_tiers_and_reports_them(tmp_path):
    res = CliRunner().invoke(app, ["simulate", "-w", "mooncake-conversation", "--num-requests", "60", "--rate", "2",
                                   "--model", "qwen3-8b", "--gpu", "h100-sxm", "--kv-capacity", "60000",
                                   "--kv-tier", "host:50:25:0.00001", "--kv-tier", "remote:500:5:0.0005",
                                   "--json"])
    assert res.exit_code == 0, res.output
    import json
    s = json.loads(res.output.splitlines()[0])
    assert [t["name"] for t in s["tier_breakdown"]] == ["host", "remote"]
    assert set(s["ttft_split_ms"]) == {"queueing", "loading", "prefill"}
    bad = CliRunner().invoke(app, ["simulate", "-w", "mooncake-conversation", "--num-requests", "5",
                                   "--kv-tier", "host:50:25", "--kv-write", "sometimes"])
    assert bad.exit_code == 2 and "--kv-write must be one of" in bad.output


def test_the_view_shows_each_tier_and_a_requests_blocks_per_tier():
    """B arrives while C runs and takes the only seat (max_num_seqs 1), so B cannot load yet:
    the view shows its prefix as (0 on the GPU, 3 in host) and the host's free blocks as its
    capacity less A's 3; once loaded, (3, 0) (view: prefix_blocks, tier_free_blocks)."""
    from kvsched.policies.baselines import VllmV1
    seen = []

    class Spy:
        name = "spy"
        max_num_seqs = 1
        plans_prefix_hits = True

        def __init__(self):
            self.inner = VllmV1(max_num_batched_tokens=2048, max_num_seqs=1)

        def schedule(self, v):
            if 2 in v.waiting:
                seen.append((v.prefix_blocks(2), dict(v.tier_free_blocks)))
            return self.inner.schedule(v)

    w = workload([0.0, 5.0, 5.01], [68, 90, 68], [4, 2, 4], [[(7, 48)], [], [(7, 48)]])
    host = int(1e9 // BB)
    simulate(scenario(w, ("host:1:16:0.001",)), Spy())
    assert seen[0] == ((0, 3), {"host": host - 3})
    assert seen[-1] == ((3, 0), {"host": host - 3})


@pytest.mark.parametrize("queue_len", [5, 200])
def test_lpm_orders_by_the_prefix_on_the_gpu_and_falls_back_to_fcfs(queue_len):
    """Sarathi's order=lpm: the longest GPU-cached prefix first, stable; FCFS past 128 waiting
    (SGLang's limit)."""
    from types import SimpleNamespace

    from kvsched.policies.baselines import prefill_order
    gpu = {i: (i % 3) for i in range(queue_len)}
    v = SimpleNamespace(waiting=list(range(queue_len)), prefix_blocks=lambda i: (gpu[i], 5),
                        tier_priority=lambda i: 0, now=0.0)
    order = prefill_order(v, "lpm")
    if queue_len <= 128:
        assert order == sorted(range(queue_len), key=lambda i: -gpu[i])
    else:
        assert order == list(range(queue_len))


def test_no_load_takes_the_room_of_a_request_ahead_of_it():
    """Review finding: 60 requests whose prefixes went down to host arrive every 30 ms; H, a
    305-token request with nothing below, arrives among them. Loads behind H must not take the
    room H waits for: no request that arrived after H is admitted before it, as GPU-only."""
    n = 60
    arr, pr, out, seg = [], [], [], []
    for k in range(n):                  # request k caches prefix k; later ones evict it (written down)
        arr.append(0.1 * k); pr.append(68); out.append(2); seg.append([(100 + k, 48)])
    arr.append(n * 0.1); pr.append(300); out.append(2); seg.append([])
    t0 = n * 0.1 + 1
    for k in range(n):
        arr.append(t0 + 0.03 * k); pr.append(68); out.append(8); seg.append([(100 + k, 48)])
        if k == 2:
            arr.append(t0 + 0.03 * k + 0.001); pr.append(305); out.append(2); seg.append([])
    w = workload(arr, pr, out, seg)
    h = pr.index(305)
    gpu_only = simulate(scenario(w, capacity=320), "vllm-v1").records
    r = simulate(scenario(w, ("host:1:16:0.001",), capacity=320), "vllm-v1")
    rec = r.records
    assert r.summary["tier_loads"] > 0
    assert not any(rec.admitted[i] < rec.admitted[h] for i in range(h + 1, len(arr)))
    assert rec.admitted[h] <= gpu_only.admitted[h] + 0.1         # within a load and a batch


def test_a_prefix_being_loaded_is_loaded_once(monkeypatch):
    """Review finding: B1 and B2 (t=10) share A's prefix; C left its first block on the GPU (7
    blocks) and sent blocks 1-2 to host. B1 loads them; B2 neither loads them again nor
    computes them: it waits for B1's load, holding nothing (vLLM delays it), then both take
    48 tokens as their hit and compute 20 each."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 5.0, 10.0, 10.0], [68, 90, 68, 68], [4, 2, 4, 4], [[(7, 48)], [], [(7, 48)], [(7, 48)]])
    r = simulate(scenario(w, ("host:1:16:0.001",), capacity=112), "vllm-v1", record_batches=True)
    row = r.summary["tier_breakdown"][0]
    assert row["loads"] == 1 and row["bytes_out"] == 2 * BB
    assert [b[2] for b in r.batches if b[2]] == [68, 90, 40]
    assert row["hit_rate"] == pytest.approx(32 / (68 + 90 + 68 + 68))     # B1's loaded blocks (B2's hit is B1's)


def test_the_ttft_split_never_goes_negative_with_preemptions(monkeypatch):
    """Review finding: reloads after a preemption belong to the prefill part, not to queueing."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(4)
    n = 80
    w = Workload.build(np.sort(rng.uniform(0, 2, n)), rng.integers(20, 300, n), rng.integers(50, 300, n))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=2048, prefix_caching=True, client=None,
                  kv_tiers=("host:1:16",))
    r = simulate(sc, "vllm-v1")
    assert r.summary["preemptions"] > 0 and r.summary["tier_loads"] > 0
    split = r.summary["ttft_split_ms"]
    assert min(split[k]["p50"] for k in split) >= 0 and split["queueing"]["mean"] >= 0
    total = sum(split[k]["mean"] for k in split)
    assert total == pytest.approx(r.summary["mean_ttft_ms"], rel=1e-9)


def test_orca_without_a_token_budget_loads():
    """Review finding: orca's budget 0 means none, not an exhausted one."""
    sc = Scenario(shared_workload(3, 80), model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, prefix_caching=True,
                  client=None, kv_tiers=("host:0.05:16",))
    assert simulate(sc, "orca").summary["tier_loads"] > 0


def test_a_load_takes_none_of_the_policys_seats():
    """Second review: with max_num_seqs 1, B1 (prefix 7) starts loading and takes no seat, so
    the scan goes on to B2 (prefix 8), which loads too instead of being admitted to compute
    its prefix (vLLM's loop goes on past a loading request)."""
    from kvsched.policies.baselines import VllmV1
    w = workload([0.0, 1.0, 5.0, 10.0, 10.0], [68, 68, 318, 68, 68], [2, 2, 2, 20, 20],
                 [[(7, 48)], [(8, 48)], [], [(7, 48)], [(8, 48)]])
    for seqs in (1, 2):
        r = simulate(scenario(w, ("host:1:16:0.001",), capacity=320), VllmV1(max_num_batched_tokens=2048,
                                                                              max_num_seqs=seqs))
        assert r.summary["tier_loads"] == 2


def test_a_request_that_waited_for_a_load_loads_the_rest_of_its_prefix(monkeypatch):
    """Second review: B1 = P and B2 = P+Q (t=10), both in host. B2 waits for B1's load of P,
    then is looked up afresh and loads Q, as it would alone: both compute 20 tokens."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 1.0, 5.0, 10.0, 10.0], [68, 116, 250, 68, 116], [2, 2, 2, 4, 4],
                 [[(7, 48)], [(7, 48), (8, 48)], [], [(7, 48)], [(7, 48), (8, 48)]])
    r = simulate(scenario(w, ("host:1:16:0.001",), capacity=256), "vllm-v1", record_batches=True)
    assert r.summary["tier_loads"] == 2
    assert r.summary["tier_breakdown"][0]["bytes_out"] == 6 * BB        # P once, then Q
    assert sum(b[2] for b in r.batches if b[2] and b[0] >= 10) == 40


def test_a_store_shared_by_replicas_serves_a_later_hit_on_the_earlier_replica(monkeypatch):
    """Replica 1 writes a prefix at t=0 (write-through); replica 0, which never held it, hits it
    at t=10. Run one replica after the other (replica 0 first), replica 0 would never see it:
    replicas sharing a store step together in time order."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    # round-robin: a filler -> 0, A -> 1 (computes the prefix), B -> 0 (begins with it)
    w = workload([0.0, 0.0, 10.0], [20, 68, 68], [2, 4, 4], [[], [(7, 48)], [(7, 48)]])
    r = simulate(scenario(w, ("remote:10:5:0.002",), kv_write="through", replicas=2, router="round-robin"), "vllm-v1")
    assert r.summary["tier_breakdown"][0]["loads"] == 1
    assert r.records.first_token[2] == pytest.approx(10.0 + 3 * BB / 5e9 + 0.002 + 0.05, rel=1e-12)


@pytest.mark.parametrize("gpus_per_node, loads", [(0, 0), (1, 0), (2, 1)])
def test_replicas_on_one_node_share_its_host_tier(gpus_per_node, loads, monkeypatch):
    """--gpus-per-node 2 with one-GPU replicas: both replicas sit on one node and share one host
    store (each over its own link), so replica 0 loads the prefix replica 1 wrote; with a node
    per replica (1) or without the flag (0), each has its own store and nothing to load."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    w = workload([0.0, 0.0, 10.0], [20, 68, 68], [2, 4, 4], [[], [(7, 48)], [(7, 48)]])
    sc = scenario(w, ("host:10:5:0.002",), kv_write="through", replicas=2, router="round-robin",
                  gpus_per_node=gpus_per_node)
    s = simulate(sc, "vllm-v1").summary
    row = s["tier_breakdown"][0]
    assert row["loads"] == loads
    assert row["capacity_bytes"] == (1 if gpus_per_node == 2 else 2) * int(10e9 // BB) * BB


@pytest.mark.parametrize("kw, msg", [
    ({"gpus_per_node": 3, "layout": Layout(tp=2), "cost": "roofline", "cost_params": {}}, "--gpus-per-node 3 is not a whole number of replicas of 2 GPUs"),
    ({"gpus_per_node": -1}, "--gpus-per-node must be a whole number >= 0"),
    ({"gpus_per_node": 2.0}, "--gpus-per-node must be a whole number >= 0"),
    ({"gpus_per_node": 8, "tiers": ()}, "--gpus-per-node shares a node's"),
])
def test_bad_gpus_per_node_is_a_one_line_error(kw, msg):
    w = workload([0.0], [68], [4], [[(7, 48)]])
    tiers = kw.pop("tiers", ("host:1:16",))
    with pytest.raises(KvschedError, match=msg):
        simulate(dataclasses.replace(scenario(w, tiers, replicas=2), **kw), "vllm-v1")
