"""Exclusive batching policies: the mechanics of eb, eb-adaptive and eb-plus."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import run
from kvsched.cost import BatchShape
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
    sizes = theory.batch_sizes(300_000, max(e["p0"], 1 / e["mu_o"]), e["mu_l"], pol.theta_now, 0.01)   # eq. (6) at >= CFR p0
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
    # the authors' measured RTX PRO 6000 calibration, as published
    assert r == dict(alpha_p=4.69e-3, beta_p=5.01e-5, alpha_d=1.038e-2, beta_d=1.039e-4, alpha_mb=0.0,
                     c0=6.29e-5, c1=1.969e-4, c2=9.90e-6)
    assert interference_index(r["c0"], r["c1"], r["c2"]) == pytest.approx(0.0734, abs=1e-3)
    assert interference_index(h["c0"], h["c1"], h["c2"]) == pytest.approx(2 * 1.478e-5 / (2.494e-5 + 5.193e-5 + 1.478e-5))


@pytest.mark.parametrize("preset", ["eb-h200-qwen3-8b", "eb-rtx-pro-6000-qwen3-8b"])
def test_mixed_cost_follows_its_derivation(preset):
    """beta_MB(r) is whole-run seconds per token (overheads included), so alpha_MB = 0: at
    r -> 0 a mixed batch costs what prefill tokens do per token, and at r = 1 a batch of n
    decodes costs a decode-only batch at the effective batch n = alpha_d / (beta_MB(1) - beta_d)."""
    from kvsched.cost.phase import PhaseCost, effective_decode_batch
    c = PHASE_PRESETS[preset]
    cost = PhaseCost(**c)
    assert c["alpha_mb"] == 0
    big = 1_000_000
    mixed = cost.time(BatchShape(prefill_tokens=big, prefill_seqs=1, decode_seqs=1))
    assert mixed / (big + 1) == pytest.approx(c["c0"], rel=1e-4)
    assert c["c0"] == pytest.approx(c["beta_p"], rel=0.3)      # H200 within 0.2%, RTX within 26%
    n = effective_decode_batch(c)                 # the documented reading of beta_MB(1)
    assert 50 < n < 400 and c["c0"] + c["c1"] + c["c2"] > c["beta_d"]


def test_switch_cost_is_added_only_on_a_change_of_batch_kind():
    from kvsched.cost.phase import PhaseCost
    cost = PhaseCost(switch_s=0.05)
    plain = PhaseCost()
    for shape in (BatchShape(prefill_tokens=100, prefill_seqs=1), BatchShape(decode_seqs=7),
                  BatchShape(prefill_tokens=10, prefill_seqs=1, decode_seqs=3)):
        assert cost.time(shape) == plain.time(shape)
        shape.phase_switch = True
        assert cost.time(shape) == pytest.approx(plain.time(shape) + 0.05)
    # in a run: a prefill after decodes pays it, the next prefill does not
    from kvsched.workload import Workload
    w = Workload.build([0.0, 0.02], [8, 8], [6, 3])
    server, rec, _ = run(w, "vllm-v0", {"max_num_batched_tokens": 8, "max_num_seqs": 8}, cost="phase",
                         cost_params={"switch_s": 0.05})
    base = run(w, "vllm-v0", {"max_num_batched_tokens": 8, "max_num_seqs": 8}, cost="phase")[0]
    kinds = [(b[2] > 0) + 2 * (b[4] > 0) for b in base.batches]
    switches = sum(1 for a, b in zip(kinds, kinds[1:]) if a != b)
    assert switches >= 2
    extra = sum(b[1] for b in server.batches) - sum(b[1] for b in base.batches)
    assert extra == pytest.approx(0.05 * switches)


def test_eb_plus_occupancy_ema_per_step():
    """N_obs starts at max_num_seqs and moves after every batch: weight 0.3 when the running
    count is above it, 0.03 when below (hand-worked)."""
    pol = make_policy("eb-plus", {"max_num_seqs": 100, "max_num_batched_tokens": 8192}, get_gpu("a100-80gb"))

    class V:
        def __init__(self, running, waiting=0):
            self.running, self.waiting = list(range(running)), list(range(waiting))
    seen = []
    for running in (10, 10, 200, 90):
        pol.on_batch_end(V(running, waiting=500))          # the queue is not counted by default
        seen.append(pol.n_obs)
    # by hand: 0.03*10 + 0.97*100; 0.03*10 + 0.97*97.3; 0.3*200 + 0.7*94.681; 0.03*90 + 0.97*126.2767
    assert seen == pytest.approx([97.3, 94.681, 126.2767, 125.188399])
    counting = make_policy("eb-plus", {"max_num_seqs": 100, "max_num_batched_tokens": 8192, "count_waiting": "true"},
                           get_gpu("a100-80gb"))
    counting.on_batch_end(V(10, waiting=500))
    assert counting.n_obs == pytest.approx(0.3 * 510 + 0.7 * 100)


def _closed_geometric(mu_l, output, n=4000, c=2048, seed=1):
    return WorkloadSpec((Phase(n, (RequestType(mu_l, output),), arrivals=Closed(c)),), seed=seed).build()


def _adaptive(w, **params):
    from kvsched.run import Scenario, simulate
    return simulate(Scenario(w, model="qwen3-8b", gpu="h200", cost="eb-h200-qwen3-8b"), "eb-adaptive",
                    {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, **params}).policy_state


def test_eb_adaptive_never_collapses_on_a_biased_window():
    """Geometric outputs (mean 1024) in a closed loop: the paper's defaults drove N* to 1
    (the window holds the short outputs that finished first, p0 fits of 1e-4); the guard
    keeps the server."""
    from kvsched.workload import Geometric
    pol = _adaptive(_closed_geometric(Jitter(128), Geometric(1024)))
    assert min(x["n_star"] for x in pol.history) > 100
    assert min(x["p0_fit"] for x in pol.history) < 2e-4 < min(x["p0"] for x in pol.history)
    assert pol.held_updates["mean_mismatch"] + pol.held_updates["cfr_prior"] > 0
    cls = type(pol)
    assert cls.implausible({"p0": 1e-4, "eta": 0.0, "mu_o": 1024.0}) == "mean_mismatch"
    assert cls.implausible({"p0": 4e-4, "eta": 2e-6, "mu_o": 1024.0}) == "cfr_prior"
    assert cls.implausible({"p0": 1 / 1024, "eta": 0.0, "mu_o": 1024.0}) == ""


def test_eb_adaptive_holds_n_star_when_eq6_is_ill_conditioned():
    """mu_L = 1, mu_O = 1024: eq. (6)'s safety term v ln(1/eps) = ln(100) / (p0^2 mu_L) takes
    most of the KV, so N* is held (capped at N_static), never shrunk to a handful of slots."""
    from kvsched.workload import Geometric
    pol = _adaptive(_closed_geometric(Uniform(1, 1), Geometric(1024)))
    assert pol.held_updates["infeasible"] > 0
    assert min(x["n_star"] for x in pol.history) > 100


def test_eb_adaptive_theta_rises_under_ifr():
    """Figure 12's direction: gamma shape 2 (IFR) raises EB(k*)'s theta over shape 1 (CFR)
    with the same mean, although the CFR prior replaces the IFR fit's low p0."""
    from kvsched.workload import Gamma
    th = [_adaptive(_closed_geometric(Jitter(512), Gamma(a, 256), seed=7)).theta_now for a in (1.0, 2.0)]
    assert th[1] > 1.3 * th[0]


def test_switch_cost_enters_the_prefill_phase_overhead_and_inverts_eq3():
    from kvsched.cost.fit import coefficients
    from kvsched.cost.phase import PhaseCost
    c = coefficients(PhaseCost(alpha_p=0.01, switch_s=0.02), 512, 256)
    assert c.alpha_p == pytest.approx(0.01 + 2 * 0.02)         # two switches per prefill phase
    th = theory.theta0(1 / 256, 0.05, 0.009)
    assert theory.implied_prefill_overhead(th, 1 / 256, 0.009) == pytest.approx(0.05, rel=1e-9)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            PhaseCost(switch_s=bad)
