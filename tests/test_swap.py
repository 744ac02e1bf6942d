"""Swap preemption to a host tier (sim/host_swap.py, docs/kv-tiers.md): hand-worked times, the
invariants with swap on for every baseline policy, bad input, and nothing changed when off."""
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import get_model
from kvsched.run import Scenario, simulate
from kvsched.sim.host_swap import parse_kv_tier
from kvsched.workload.request import Workload

KV = get_model("llama-3-8b").kv_bytes_per_token          # 131,072 bytes a token


def two_requests(preemption: str = "recompute", tiers: tuple = (), caching: bool = False) -> Scenario:
    """Two requests of 24 + 20 tokens at t = 0 in 4 KV blocks of 16 tokens, every batch 50 ms:
    at 0.45 both hold 32 tokens and need a block, so vllm-v1 preempts B, the newest."""
    w = Workload.build(np.array([0.0, 0.0]), np.array([24, 24]), np.array([20, 20]))
    return Scenario(w, model="llama-3-8b", cost="constant", cost_params={"b": 0.05}, kv_capacity=64, block_size=16,
                    prefix_caching=caching, client=None, preemption=preemption, kv_tiers=tiers)


@pytest.mark.parametrize("caching", [False, True])
def test_a_swapped_request_resumes_with_its_tokens_and_no_recomputation(caching, monkeypatch):
    """B's 32 tokens (2 blocks, 4,194,304 bytes) go to host at 0.45 and come back when A has
    finished at t_A: the copy holds the 16 GB/s link 0.000262144 s and lands 1 ms later, then
    B decodes its 11 remaining tokens, 50 ms each. Recompute instead prefills 33 tokens again."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    base = simulate(two_requests(caching=caching), "vllm-v1").records
    r = simulate(two_requests("swap", ("host:1:16:0.001",), caching), "vllm-v1")
    rec, s = r.records, r.summary
    t_a = base.finished[0]
    assert rec.finished[0] == t_a and base.recomputed[1] > 0
    t_in = t_a + 2 * 16 * KV / 16e9 + 0.001
    finish = t_in
    for _ in range(11):
        finish = finish + 0.05
    assert rec.finished[1] == pytest.approx(finish, rel=1e-12)
    assert list(rec.recomputed) == [0, 0] and list(rec.preemptions) == [0, 1] and rec.first_token[1] == 0.05
    assert rec.itl_max[1] == pytest.approx(t_in + 0.05 - 0.45, rel=1e-12)      # its last token before: 0.45
    assert s["tier_breakdown"] == [{"name": "host", "hit_rate": None, "bytes_in": 4194304, "bytes_out": 4194304,
                                    "capacity_bytes": int(1e9 // (16 * KV)) * 16 * KV,
                                    "link_busy_fraction": pytest.approx(2 * 0.000262144 / (2 * rec_end(r)))}]
    assert (s["swap_outs"], s["swap_ins"], s["swap_fallbacks"]) == (1, 1, 0)
    assert s["mean_swap_wait_ms"] == pytest.approx((t_in - 0.45) * 1000, rel=1e-12)


def rec_end(result) -> float:
    return float(np.max(result.records.finished))


def test_a_slow_link_makes_the_copy_in_wait_for_the_copy_out():
    """At 0.004194304 GB/s each copy holds the link 1 s: the copy-out lands at 1.45 + latency,
    after A finished, so the copy-in starts then and lands 1 s later."""
    r = simulate(two_requests("swap", ("host:1:0.004194304:0.001",)), "vllm-v1").records
    t_in = (0.45 + 1.0 + 0.001) + 1.0 + 0.001
    assert r.finished[1] == pytest.approx(t_in + 11 * 0.05, rel=1e-9)
    assert r.recomputed[1] == 0


def test_a_full_host_tier_falls_back_to_recompute():
    """A host tier smaller than B's 2 blocks: B recomputes, as without swap, and it is counted."""
    base = simulate(two_requests(), "vllm-v1")
    r = simulate(two_requests("swap", ("host:0.004:16",)), "vllm-v1")
    assert np.array_equal(r.records.finished, base.records.finished)
    assert np.array_equal(r.records.recomputed, base.records.recomputed)
    assert (r.summary["swap_outs"], r.summary["swap_fallbacks"]) == (0, 1)


def test_a_run_that_never_preempts_is_the_same_with_swap_on():
    """Swap on and nothing preempted: the recompute run, bit for bit (the hooks change nothing)."""
    w = Workload.build(np.linspace(0, 2, 60), np.full(60, 300), np.full(60, 200))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=80_000, client=None)
    off = simulate(sc, "vllm-v1")
    on = simulate(dataclasses.replace(sc, preemption="swap", kv_tiers=("host:1:16",)), "vllm-v1")
    assert on.summary["swap_outs"] == 0 and off.summary["preemptions"] == 0
    for f in ("finished", "first_token", "recomputed", "itl_max", "admitted"):
        assert np.asarray(getattr(on.records, f)).tobytes() == np.asarray(getattr(off.records, f)).tobytes()
    assert "tier_breakdown" not in off.summary


@pytest.mark.parametrize("policy", ["vllm-v1", "vllm-v0", "sarathi"])
def test_swapped_requests_come_back_within_max_num_seqs(policy, monkeypatch):
    """Swap-ins take seats as vLLM v0's _schedule_swapped does (its budget's can_schedule):
    never more running requests than max_num_seqs (review finding)."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(3)
    w = Workload.build(np.sort(rng.uniform(0, 0.3, 60)), rng.integers(20, 100, 60), rng.integers(50, 300, 60))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=512, client=None, preemption="swap",
                  kv_tiers=("host:1:16:0.0001",))
    r = simulate(sc, policy, {"max_num_seqs": 4}, record_timeline=True)
    assert r.summary["swap_outs"] > 0
    assert max(row[2] for row in r.timeline) <= 4          # timeline rows: time, queue, running, KV used


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["vllm-v1", "vllm-v0", "sarathi", "orca", "request-level"]),
       caching=st.booleans(), host_gb=st.sampled_from([0.01, 0.05, 50.0]))
def test_invariants_hold_with_swap_on(seed, policy, caching, host_gb, monkeypatch):
    """Blocks conserved on the GPU and the host tier, neither over capacity, every request
    finished (KVSCHED_CHECK=1: sim/invariants.py), for every baseline policy, on a KV-tight
    workload; swap-ins equal swap-outs at the end; a swapped decoder never recomputes."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(seed)
    n = 40
    w = Workload.build(np.sort(rng.uniform(0, 1, n)), rng.integers(20, 400, n), rng.integers(5, 300, n))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=2048, client=None,
                  prefix_caching=caching, preemption="swap", kv_tiers=(f"host:{host_gb}:16:0.0001",))
    r = simulate(sc, policy)
    s = r.summary
    assert s["completed"] + s.get("rejected", 0) == n
    assert s["swap_ins"] == s["swap_outs"]
    tier = s["tier_breakdown"][0]
    assert tier["bytes_in"] == tier["bytes_out"]
    assert (s["preemptions"] > 0) >= (s["swap_outs"] > 0)
    if host_gb == 50.0:
        assert s["swap_fallbacks"] == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), replicas=st.sampled_from([2, 3, 5, 12]),
       router=st.sampled_from(["round-robin", "least-kv", "least-outstanding"]), caching=st.booleans())
def test_invariants_hold_with_swap_on_replicas_behind_a_router(seed, replicas, router, caching, monkeypatch):
    """Each replica its own host tier: the invariants hold, every request finishes, and the
    summary adds the replicas' swaps (sim/cluster.py wakes each for its landings)."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(seed)
    n = 80
    w = Workload.build(np.sort(rng.uniform(0, 1, n)), rng.integers(20, 400, n), rng.integers(5, 300, n))
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, client=None, prefix_caching=caching,
                  replicas=replicas, router=router, preemption="swap", kv_tiers=("host:0.05:4:0.0001",))
    s = simulate(sc, "vllm-v1").summary
    assert s["completed"] + s.get("rejected", 0) == n and s["swap_ins"] == s["swap_outs"] > 0
    assert s["tier_breakdown"][0]["capacity_bytes"] == replicas * int(0.05e9 // (16 * KV)) * 16 * KV


@pytest.mark.parametrize("kwargs,needle", [
    ({"preemption": "swap"}, "--preemption swap needs exactly one tier, the host tier"),
    ({"kv_tiers": ("host:1:16",), "prefix_caching": False}, "turn it on with --prefix-caching"),
    ({"preemption": "spill", "kv_tiers": ("host:1:16",)}, "--preemption must be recompute or swap"),
    ({"preemption": "swap", "kv_tiers": ("disk:100:3",)}, "needs exactly one tier"),
    ({"preemption": "swap", "kv_tiers": ("host:1:16", "host:2:16")}, "host given twice"),
    ({"preemption": "swap", "kv_tiers": ("host:1:16",), "prefill_replicas": 1, "decode_replicas": 1},
     "no disaggregation yet"),
])
def test_bad_scenarios_are_one_line_errors(kwargs, needle):
    w = Workload.build(np.array([0.0]), np.array([10]), np.array([5]))
    with pytest.raises(KvschedError, match=needle):
        simulate(Scenario(w, model="llama-3-8b", client=None, **kwargs), "vllm-v1")


@pytest.mark.parametrize("text,needle", [
    ("host", "write KIND:GB:GBps"), ("gpu:1:2", "write KIND:GB:GBps"), ("host:x:2", "GB must be a number"),
    ("host:1:0", "GBps must be a finite number >= 1e-06"), ("host:1:2:-1", "latency_s must be a finite number >= 0"),
    ("host:nan:2", "GB must be a finite"), ("host:1:2:3:4", "write KIND:GB:GBps"),
])
def test_bad_kv_tier_texts(text, needle):
    with pytest.raises(KvschedError, match=needle):
        parse_kv_tier(text)


def test_a_policy_with_its_own_preemption_state_is_refused():
    w = Workload.build(np.array([0.0]), np.array([10]), np.array([5]))
    with pytest.raises(KvschedError, match="keeps its own request state"):
        simulate(Scenario(w, model="llama-3-8b", client=None, preemption="swap", kv_tiers=("host:1:16",)), "wait")


def test_the_cli_takes_the_flags():
    base = ["simulate", "--model", "llama-3-8b", "--num-requests", "200", "--rate", "40", "--prompt-len", "fixed:2000",
            "--output-len", "fixed:300", "--kv-capacity", "30000", "--json", "--client-path", "off"]
    r = CliRunner().invoke(app, base + ["--preemption", "swap", "--kv-tier", "host:64:25:0.00001"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["swap_outs"] > 0 and s["swap_ins"] == s["swap_outs"] and s["tier_breakdown"][0]["name"] == "host"
    r = CliRunner().invoke(app, base + ["--preemption", "swap"])
    assert r.exit_code == 2 and "needs exactly one tier, the host tier" in r.output


@pytest.mark.parametrize("policy", ["vllm-v0", "vllm-v1"])
def test_vllm_v0_admits_no_prompt_while_a_request_is_swapped_out(policy):
    """v0's _schedule_default schedules prefills only when its swapped queue is empty: C (10
    tokens, 1 block) arrives at 0.5 s while B is swapped out and would fit beside A. vllm-v0
    admits it only once B is running again; vllm-v1 (no such rule) admits it at once. The
    view's `swapped` counts B meanwhile."""
    w = Workload.build(np.array([0.0, 0.0, 0.5]), np.array([24, 24, 10]), np.array([20, 20, 5]))
    sc = Scenario(w, model="llama-3-8b", cost="constant", cost_params={"b": 0.05}, kv_capacity=64, block_size=16,
                  prefix_caching=False, client=None, preemption="swap", kv_tiers=("host:1:16:0.001",))
    rec = simulate(sc, policy).records
    assert rec.recomputed[1] == 0 and rec.preemptions[1] == 1
    if policy == "vllm-v0":
        assert rec.admitted[2] > 1.0                     # after B's copy-in (A finished near 1.0 s)
    else:
        assert rec.admitted[2] < 0.6


class Choosing:
    """vllm-v1 whose plans name the victims to swap (Plan.swap)."""
    name = "choosing"

    def __init__(self, swap):
        from kvsched.policies.baselines import VllmV1
        self.inner, self.swap = VllmV1(max_num_batched_tokens=2048, max_num_seqs=256), swap

    def schedule(self, v):
        p = self.inner.schedule(v)
        p.swap = self.swap(p.preempt) if callable(self.swap) else self.swap
        return p


def test_a_policy_chooses_per_victim_through_the_plan(monkeypatch):
    """Plan.swap = []: every victim recomputes, as without swap; None: every decoding victim
    swaps, as by default; the victim itself: it swaps."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    base = simulate(two_requests(), "vllm-v1").records
    swapped = simulate(two_requests("swap", ("host:1:16:0.001",)), "vllm-v1").records
    none = simulate(two_requests("swap", ("host:1:16:0.001",)), Choosing([]))
    assert none.summary["swap_outs"] == 0 and none.summary["preemptions"] == 1
    assert none.records.finished.tobytes() == base.finished.tobytes()
    assert none.records.recomputed.tobytes() == base.recomputed.tobytes()
    plain = simulate(dataclasses.replace(two_requests(), prefix_caching=False), Choosing([]))     # empty: no swap asked
    assert plain.records.finished.tobytes() == simulate(dataclasses.replace(two_requests(), prefix_caching=False),
                                                        "vllm-v1").records.finished.tobytes()
    for choice in (None, list):
        r = simulate(two_requests("swap", ("host:1:16:0.001",)), Choosing(choice))
        assert r.summary["swap_outs"] == 1
        assert r.records.finished.tobytes() == swapped.finished.tobytes()


@pytest.mark.parametrize("preemption, choice, needle", [
    ("recompute", [1], "without --preemption swap"),
    ("swap", [True], "not a request id"),
    ("swap", [1.0], "not a request id"),
    ("swap", [0, 1], "which its plan does not preempt"),
    ("swap", 7, "must be a collection of request ids"),
])
def test_a_bad_swap_choice_is_the_policys_error(preemption, choice, needle):
    tiers = ("host:1:16:0.001",) if preemption == "swap" else ()
    with pytest.raises(KvschedError, match=needle):
        simulate(dataclasses.replace(two_requests(preemption, tiers), prefix_caching=False), Choosing(choice))
