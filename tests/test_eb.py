"""Exclusive batching policies: the mechanics of eb, eb-adaptive and eb-plus."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import run
from kvsched.cost.phase import PHASE_PRESETS, interference_index
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.policies.eb import eb_plus_mode
from kvsched.theory import eb as theory
from kvsched.workload import Jitter, RequestType, Uniform
from kvsched.workload.lengths import LinearHazard
from kvsched.workload.spec import Phase, WorkloadSpec
from kvsched.workload.arrivals import Closed

GPU = get_gpu("h200")


def closed(n: int, c: int, prompt, output, seed: int = 0):
    return WorkloadSpec((Phase(n, (RequestType(prompt, output),), arrivals=Closed(c)),), seed=seed).build()


def policy(name: str, **params):
    return make_policy(name, {k: str(v) for k, v in params.items()}, GPU)


@pytest.mark.parametrize("name,params", [("eb", {"k": 8}), ("eb", {"theta": 0.3, "kv_gate": True}),
                                         ("eb-adaptive", {})])
def test_eb_never_mixes_prefill_and_decode(name, params):
    w = closed(1500, 64, Uniform(16, 400), Uniform(1, 200), seed=1)
    server, rec, _ = run(w, policy(name, max_num_seqs=64, max_num_batched_tokens=2048, **params),
                         cost="eb-h200-qwen3-8b", kv_tokens=60_000, block_size=16)
    b = np.array(server.batches)
    assert np.isfinite(rec.finished).all()
    assert not np.any((b[:, 2] > 0) & (b[:, 4] > 0))          # prefill tokens and decodes never together
    assert (b[:, 2] > 0).any() and (b[:, 4] > 0).any()


def test_eb_k_triggers_on_idle_slots():
    """A decode phase ends once k slots are idle: every prefill batch after a decode batch
    finds at least k idle slots (or no decoder left, or the queue ended)."""
    class Probe:
        def __init__(self, inner):
            self.inner, self.name, self.starts = inner, inner.name, []

        def schedule(self, v):
            was = self.inner._prefill
            plan = self.inner.schedule(v)
            if plan.chunks and not was and v.num_decoding:
                self.starts.append(self.inner.slots(v) - len(v.running))
            return plan

        def on_finish(self, i, v):
            self.inner.on_finish(i, v)
    probe = Probe(policy("eb", max_num_seqs=64, max_num_batched_tokens=4096, k=16))
    run(closed(2000, 256, Uniform(16, 200), Uniform(1, 300)), probe, cost="eb-h200-qwen3-8b",
        kv_tokens=10**6, checked=False)
    assert len(probe.starts) > 20 and min(probe.starts) >= 16


def test_kv_gate_defers_when_kv_is_short():
    class Probe:
        def __init__(self, inner):
            self.inner, self.name, self.free_at_switch = inner, inner.name, []

        def schedule(self, v):
            was, free = self.inner._prefill, v.kv_free_blocks
            plan = self.inner.schedule(v)
            if plan.chunks and not was and v.num_decoding:
                self.free_at_switch.append(free / v.kv_capacity_blocks - self.inner.gate_fraction(v))
            return plan

        def on_finish(self, i, v):
            self.inner.on_finish(i, v)
    w = closed(1500, 128, Uniform(200, 600), Uniform(50, 400), seed=2)
    gated = Probe(policy("eb", max_num_seqs=128, max_num_batched_tokens=4096, k=8, kv_gate=True,
                         gate_safety=2.0))
    run(w, gated, cost="eb-h200-qwen3-8b", kv_tokens=40_000, block_size=16, checked=False)
    assert gated.inner.gate_deferrals > 0
    assert min(x for x in gated.free_at_switch) >= -1e-12       # switched only with the reserve free
    open_ = policy("eb", max_num_seqs=128, max_num_batched_tokens=4096, k=8)
    run(w, open_, cost="eb-h200-qwen3-8b", kv_tokens=40_000, block_size=16, checked=False)
    assert open_.gate_deferrals == 0


def test_eb1_at_saturation_behaves_as_vllm_v0():
    w = closed(3000, 2048, Jitter(512), Jitter(256), seed=3)
    v0 = run(w, policy("vllm-v0"), cost="eb-h200-qwen3-8b", kv_tokens=400_000, block_size=16, checked=False)
    e1 = run(w, policy("eb", k=1), cost="eb-h200-qwen3-8b", kv_tokens=400_000, block_size=16, checked=False)
    t0, t1 = v0[1].finished.max(), e1[1].finished.max()
    assert abs(t1 / t0 - 1) < 0.01
    assert abs(int(e1[1].preemptions.sum()) - int(v0[1].preemptions.sum())) <= 0.05 * max(1, v0[1].preemptions.sum())


def test_adaptive_estimates_and_thresholds_equal_the_theory():
    w = closed(12_000, 512, Jitter(256), LinearHazard(0.004, 1.5e-5), seed=4)
    pol = policy("eb-adaptive", window=4000, update_every=500)
    server, _, _ = run(w, pol, cost="eb-h200-qwen3-8b", kv_tokens=300_000, block_size=16, checked=False)
    e = pol.estimates
    assert e["p0"] == pytest.approx(0.004, rel=0.15) and e["eta"] == pytest.approx(1.5e-5, rel=0.3)
    last = pol.history[-1]
    assert last["theta0"] == pytest.approx(theory.theta0(e["p0"], e["alpha_p"], e["alpha_d"]), rel=1e-12)
    assert e["alpha_p"] == PHASE_PRESETS["eb-h200-qwen3-8b"]["alpha_p"]
    assert pol.theta_now == pytest.approx(min(0.8, max(0.01, last["theta0"] + last["delta_theta"])))
    sizes = theory.batch_sizes(300_000, e["p0"], e["mu_l"], pol.theta_now, 0.01)
    assert pol.n_star == sizes["n_star"] and last["k"] == math.floor(pol.theta_now * min(sizes["n_star"], 1024))
    assert len(pol.history) >= 10


def test_practice_options_change_the_update():
    w = closed(4000, 256, Jitter(256), Uniform(1, 600), seed=5)
    paper = policy("eb-adaptive", update_every=200)
    practice = policy("eb-adaptive", update_every=200, theta_ema=0.3, delta_theta_cap=5, clamp_eta=True,
                      floor_p0=True, fit_lower_quantile=0.05)
    for p in (paper, practice):
        run(w, p, cost="eb-h200-qwen3-8b", kv_tokens=300_000, block_size=16, checked=False)
    assert practice.history[0]["theta"] == pytest.approx(0.3 * min(0.8, max(0.01, practice.history[0]["theta0"]
                                                          + practice.history[0]["delta_theta"])) + 0.7 * 0.7)
    assert all(h["delta_theta"] <= 5 * h["theta0"] + 1e-15 and h["eta"] >= 0 for h in practice.history)
    assert paper.history[0]["theta"] != practice.history[0]["theta"]


def test_eb_plus_rule_hysteresis_and_occupancy():
    d = 1e-5
    assert eb_plus_mode("MB", 2e-5, 0.5e-5, 100, d, 3, 16) == "EB"            # LHS > RHS + delta
    assert eb_plus_mode("MB", 1.4e-5, 0.5e-5, 100, d, 3, 16) == "MB"
    assert eb_plus_mode("EB", 0.5e-5, 1e-5, 100, d, 3, 16) == "EB"            # inside the band: stay
    assert eb_plus_mode("EB", -2.1e-5, 1e-5, 100, d, 3, 16) == "MB"           # LHS < RHS - 3 delta
    assert eb_plus_mode("MB", 1.0, 0.0, 15.9, d, 3, 16) == "MB"               # never below N_obs = 16
    assert eb_plus_mode("EB", -1.0, 0.0, 15.9, d, 3, 16) == "EB"
    assert eb_plus_mode("EB", 1.5e-5, 0.0, 100, d, -1, 16) == "EB"            # eq. 8 as printed
    assert eb_plus_mode("EB", 0.9e-5, 0.0, 100, d, -1, 16) == "MB"


def test_eb_plus_in_simulation_switches_with_cooldown():
    w = WorkloadSpec(tuple(Phase(n, (RequestType(Jitter(512), Jitter(256)),), arrivals=Closed(c))
                           for n, c in ((1500, 8), (6000, 1024), (1500, 8))), seed=6).build()
    pol = policy("eb-plus", evaluate_every=50, update_every=50)
    server, rec, _ = run(w, pol, cost="eb-rtx-pro-6000-qwen3-8b", kv_tokens=400_000, block_size=16, checked=False)
    assert np.isfinite(rec.finished).all()
    modes = [x["mode"] for x in pol.decisions]
    assert "EB" in modes                                       # high concurrency on the constrained GPU
    prev, switched_at = "MB", []
    for j, x in enumerate(pol.decisions):
        if x["n_obs"] < 16 or x["cooling"]:
            assert x["mode"] == prev
        if x["mode"] != prev:
            switched_at.append(j)
            margin = pol.delta if prev == "MB" else -3 * pol.delta
            assert (x["lhs"] > x["rhs"] + margin) if prev == "MB" else (x["lhs"] < x["rhs"] + margin)
        prev = x["mode"]
    for j in switched_at:                                      # three evaluations of cooldown follow
        assert all(x["cooling"] for x in pol.decisions[j + 1:j + 4])
    b = np.array(server.batches)
    assert np.any((b[:, 2] > 0) & (b[:, 4] > 0)) and np.any((b[:, 2] == 0) & (b[:, 4] > 0))


def test_cost_presets():
    h, r = PHASE_PRESETS["eb-h200-qwen3-8b"], PHASE_PRESETS["eb-rtx-pro-6000-qwen3-8b"]
    assert interference_index(r["c0"], r["c1"], r["c2"]) == pytest.approx(-11.6)
    assert interference_index(h["c0"], h["c1"], h["c2"]) == pytest.approx(2 * 1.478e-5 / (2.494e-5 + 5.193e-5 + 1.478e-5))
    assert r["alpha_d"] / h["alpha_d"] == pytest.approx(4.8 / 1.792) and r["beta_p"] / h["beta_p"] == pytest.approx(989 / 504)
