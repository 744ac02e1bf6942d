"""WAIT and Nested WAIT (fluid-wait-nested-wait.txt Algorithms 1 and 2) and their closed forms."""
import math

import numpy as np
import pytest

from kvsched.errors import KvschedError
from kvsched.policies import make_policy
from kvsched.hardware import get_gpu
from kvsched.run import Scenario, simulate
from kvsched.theory import wait as theory
from kvsched.theory.fluid import FluidType
from kvsched.workload import Workload
from kvsched.workload.presets import get_preset

GPU = get_gpu("a100-80gb")
LINEAR = {"d0": 0.01, "d1": 2e-7}


def workload(name: str, requests: int, seed: int = 0) -> Workload:
    spec = get_preset(name).make()
    from dataclasses import replace
    return replace(spec, phases=(replace(spec.phases[0], requests=requests),), seed=seed).build()


class Recorder:
    """Forwards to a policy and records, per call, the queue state it saw and the plan."""

    def __init__(self, inner, check) -> None:
        self.inner, self.name, self.check = inner, inner.name, check
        self.calls = 0

    def schedule(self, v):
        if getattr(self.inner, "pause_excluded", True) and hasattr(self.inner, "_where"):
            self.inner._settle(v)                   # idempotent: the policy settles first thing
            for i in v.decoding:                    # the policy's inventories agree with the replica
                assert self.inner._where[i][1] == v.generated(i)
        plan = self.inner.schedule(v)
        self.check(self.inner, v, plan)
        self.calls += 1
        return plan

    def on_finish(self, i, v):
        self.inner.on_finish(i, v)

    def on_preempt(self, i, v):
        self.inner.on_preempt(i, v)

    def report(self):
        return self.inner.report() if hasattr(self.inner, "report") else {}


def scenario(w, kv=None, **kw):
    return Scenario(w, cost="linear", cost_params=LINEAR, block_size=1, kv_capacity=kv, **kw)


def run(w, policy, params=None, kv=None, check=None, cost=LINEAR):
    pol = make_policy(policy, params or {}, GPU)
    rec = Recorder(pol, check or (lambda *a: None))
    sc = scenario(w, kv)
    sc.cost_params = cost
    return simulate(sc, rec), pol, rec


def decoders_selected(v, plan) -> list[int]:
    if plan.decode is True:
        return list(v.decoding)
    return [] if plan.decode is False else list(plan.decode)


# ----- WAIT ----------------------------------------------------------------------------

def wait_types(pol):
    return [tuple(t) for t in pol.report()["types"]]


def check_wait_rule(pol, v, plan):
    types = {t: j for j, t in enumerate(wait_types(pol))}
    n = pol.report()["thresholds"]
    kind = lambda i: types[(v.prompt_len(i), v.output_len(i))]
    if not v.arrivals_pending:
        return
    queue = [0] * len(n)
    for i in v.waiting:
        queue[kind(i)] += 1
    admitted = [0] * len(n)
    for i in plan.admit:
        admitted[kind(i)] += 1
    if all(q < nj for q, nj in zip(queue, n)):
        assert not plan.admit and not decoders_selected(v, plan), "launched below every threshold"
        return
    # every included type takes exactly n_j prompts: the batch prefills a subset-sum of thresholds
    assert all(a in (0, nj) for a, nj in zip(admitted, n)), (admitted, n)
    assert all((a == nj) == (q >= nj) for a, q, nj in zip(admitted, queue, n))
    per_stage: dict = {}
    for i in decoders_selected(v, plan):
        j = kind(i)
        assert admitted[j], "a type that is not included decoded"
        per_stage[(j, v.generated(i))] = per_stage.get((j, v.generated(i)), 0) + 1
    assert all(c <= n[j] for (j, _), c in per_stage.items())


def test_wait_rule_subset_sums_and_inventories():
    w = workload("wait-low-demand", 3000)
    res, pol, rec = run(w, "wait", check=check_wait_rule)
    assert rec.calls > 100 and res.summary["completed"] == 3000
    rep = res.summary["policy_report"]
    assert rep["thresholds"] == [12, 12] and rep["satisfied"] and rep["source"].startswith("fluid")


def test_wait_memory_at_most_m_pi_without_preemption():
    w = workload("wait-low-demand", 4000, seed=3)
    types = [FluidType(1000, 10, 9), FluidType(1000, 10, 19)]
    n = theory.solve_wait(types, **LINEAR)
    m_pi = int(theory.wait_memory(types, n))
    res, pol, _ = run(w, "wait", kv=m_pi)
    s = res.summary
    assert s["completed"] == 4000 and s["preemptions"] == 0
    assert s["peak_kv_usage"] * s["kv_capacity_tokens"] <= m_pi
    # the fluid bound (Proposition 2): output throughput cannot exceed sum lambda (l' + 1)
    assert s["output_throughput"] <= 1.02 * 30_000


def ttft_by_type(res, w):
    r = res.records
    ttft = r.first_token - r.arrival
    return {o: ttft[w.output == o] for o in np.unique(w.output)}


def test_thresholds_violating_eq9_starve_a_type():
    """Negative control: n_2 = 2 is far below the ~11 type-2 arrivals per batch, so type 2's
    queue and TTFT grow through the run; the solved thresholds keep both flat."""
    w = workload("wait-low-demand", 6000, seed=1)
    bad, _, _ = run(w, "wait", {"thresholds": "12,2"})
    good, _, _ = run(w, "wait")
    starved = ttft_by_type(bad, w)[20]
    fine = ttft_by_type(good, w)[20]
    half = len(starved) // 2
    assert starved[half:].mean() > 2 * starved[:half].mean() > 0      # grows linearly
    assert starved.mean() > 10 * fine.mean()
    assert bad.summary["peak_queue_length"] > 5 * good.summary["peak_queue_length"]
    assert not theory.check_wait([FluidType(1000, 10, 9), FluidType(1000, 10, 19)], [12, 2], **LINEAR)["satisfied"]


def test_wait_pause_excluded_false_decodes_everyone():
    w = workload("wait-low-demand", 2000)
    seen = []

    def check(pol, v, plan):
        if v.num_decoding and (plan.admit or plan.decode):
            seen.append(plan.decode is True)
    res, _, _ = run(w, "wait", {"pause_excluded": "false"}, check=check)
    assert res.summary["completed"] == 2000 and seen and all(seen)


def test_wait_practical_rule_and_online_rates():
    w = workload("wait-high-demand", 3000)
    light = {"d0": 0.01, "d1": 2e-9}        # d1 x load = 0.48: stable (2e-7 would be 48)
    res, _, _ = run(w, "wait", {"rule": "practical", "batch_size": "2048"}, cost=light)
    # n_j = B rho_j / (l'_j + 1): 2048 x (1/2, 1/3, 1/6) / (100, 200, 300)
    assert res.summary["policy_report"]["thresholds"] == [10, 3, 1]
    undeclared = Workload.build(w.arrival, w.prompt, w.output, output_known=True)
    res, pol, _ = run(undeclared, "wait", {"resolve_every": "300"}, cost=light)
    rep = res.summary["policy_report"]
    assert rep["source"] == "fluid (online rates)" and res.summary["completed"] == 3000
    solved = theory.solve_wait([FluidType(r, 20, o - 1) for (p, o), r in
                                zip([(20, 100), (20, 200), (20, 300)], (6000, 4000, 2000))], **light)
    assert all(abs(a - b) <= max(2, 0.25 * b) for a, b in zip(rep["thresholds"], solved)), (rep, solved)


def test_wait_type_bins_group_online_types():
    rng = np.random.default_rng(0)
    out = rng.integers(90, 110, 400)
    w = Workload.build(np.arange(400) * 0.001, np.full(400, 20), out, output_known=True)
    res, pol, _ = run(w, "wait", {"type_bins": "2"})
    assert res.summary["completed"] == 400
    assert len(pol.report()["types"]) <= 3            # 90..110 spans at most 3 half-doubling bins
    assert all(o >= 90 for _, o in pol.report()["types"])     # bins round up (memory-safe)


def test_wait_needs_known_lengths_and_checks_its_parameters():
    w = workload("nested-wait-4type", 50)
    with pytest.raises(KvschedError, match="known output lengths"):
        run(w, "wait")
    with pytest.raises(KvschedError, match="thresholds= gives 1 values for 2 types"):
        run(workload("wait-low-demand", 50), "wait", {"thresholds": "5"})
    for bad in ("5,x", "0,3", "2.5"):
        with pytest.raises(KvschedError, match="thresholds"):
            make_policy("wait", {"thresholds": bad}, GPU)
    with pytest.raises(KvschedError, match="batch_size"):
        make_policy("wait", {"rule": "practical"}, GPU)
    with pytest.raises(KvschedError, match="rule"):
        make_policy("wait", {"rule": "greedy"}, GPU)


def test_wait_refuses_disaggregated_roles():
    w = workload("wait-low-demand", 50)
    with pytest.raises(KvschedError, match="prefill replica"):
        simulate(scenario(w, prefill_replicas=1, decode_replicas=1), "wait")


# ----- Nested WAIT -----------------------------------------------------------------------

ENDS = [19, 39, 79, 159]


def check_nested_rule(pol, v, plan):
    n, ends = pol.report()["thresholds"], pol.report()["segment_ends"]
    seg = lambda k: min(np.searchsorted(ends, k), len(ends) - 1)
    counts: dict = {}
    for i in v.decoding:
        counts[v.generated(i)] = counts.get(v.generated(i), 0) + 1
    if not v.arrivals_pending:
        return
    entries = [len(v.waiting)] + [counts.get(e + 1, 0) for e in ends[:-1]]
    last = 0
    while last < len(n) and entries[last] >= n[last]:
        last += 1
    chosen: dict = {}
    for i in decoders_selected(v, plan):
        chosen[v.generated(i)] = chosen.get(v.generated(i), 0) + 1
    if last == 0:
        assert not plan.admit and not chosen
        return
    assert len(plan.admit) == n[0]                          # exactly n_1 new prompts
    assert list(plan.admit) == list(v.waiting)[:n[0]]       # FCFS
    for k, c in counts.items():                             # the nested launch rule
        want = min(n[seg(k)], c) if seg(k) < last else 0
        assert chosen.get(k, 0) == want, (k, c, chosen.get(k), last)


class NoLengths:
    """A view whose output_len raises: Nested WAIT must never read output lengths."""

    def __init__(self, v):
        object.__setattr__(self, "_v", v)

    def __getattr__(self, name):
        return getattr(self._v, name)

    def output_len(self, i):
        raise AssertionError("nested-wait read an output length")


class Blind(Recorder):
    def schedule(self, v):
        return super().schedule(NoLengths(v))

    def on_finish(self, i, v):
        self.inner.on_finish(i, NoLengths(v))


def test_nested_rule_exact_n1_and_no_output_lengths():
    w = workload("nested-wait-4type", 3000)
    pol = make_policy("nested-wait", {}, GPU)
    res = simulate(scenario(w), Blind(pol, check_nested_rule))
    rep = res.summary["policy_report"]
    assert res.summary["completed"] == 3000
    assert rep["segment_ends"] == ENDS and rep["thresholds"] == [8, 8, 7, 5]


def test_nested_memory_within_eq12_bound_in_a_long_run():
    w = workload("nested-wait-4type", 20_000, seed=5)
    res, pol, _ = run(w, "nested-wait")
    rep = res.summary["policy_report"]
    bound = theory.memory_bound(10, ENDS, [20, 40, 80, 160], rep["thresholds"], rep["batches"], 0.01)
    peak = res.summary["peak_kv_usage"] * res.summary["kv_capacity_tokens"]
    assert res.summary["completed"] == 20_000 and res.summary["preemptions"] == 0
    assert bound["M_pi"] < peak <= bound["memory_bound"]


def test_nested_segment_designs():
    w = workload("nested-wait-10type", 800)
    for params, ends in (({"groups": "3"}, [149, 299, 499]), ({"bin_width": "50"}, list(range(50, 501, 50))),
                         ({"segments": "99,499"}, [99, 499])):
        res, pol, _ = run(w, "nested-wait", params)
        assert res.summary["completed"] == 800 and pol.report()["segment_ends"] == ends, params
    res, pol, _ = run(w, "nested-wait", {"bin_width": "100", "bins": "3"})
    assert pol.report()["segment_ends"] == [100, 200, 499]   # the last segment ends at the longest type
    assert res.summary["completed"] == 800


def test_nested_online_rates_from_finishes():
    w = workload("nested-wait-4type", 4000)
    undeclared = Workload.build(w.arrival, w.prompt, w.output)
    res, pol, _ = run(undeclared, "nested-wait", {"segments": "19,39,79,159", "resolve_every": "500"})
    rep = res.summary["policy_report"]
    assert rep["source"] == "solved (online rates)" and res.summary["completed"] == 4000
    assert all(abs(a - b) <= max(2, 0.25 * b) for a, b in zip(rep["thresholds"], [8, 8, 7, 5])), rep


def test_nested_bad_parameters():
    for params, msg in (({"segments": "40,20"}, "increasing"), ({"segments": "19", "groups": "2"}, "one of"),
                        ({"bins": "3"}, "bin_width"), ({"thresholds": "-1"}, "thresholds")):
        with pytest.raises(KvschedError, match=msg):
            make_policy("nested-wait", params, GPU)
    w = Workload.build(np.arange(10) * 0.1, [10] * 10, [5] * 10)
    with pytest.raises(KvschedError, match="needs segments"):
        run(w, "nested-wait")
    with pytest.raises(KvschedError, match="hold no declared type"):
        run(workload("nested-wait-4type", 50), "nested-wait", {"segments": "5,19,39,79,159"})


# ----- drain and max_wait ------------------------------------------------------------------

@pytest.mark.parametrize("policy,params", [("wait", {"thresholds": "50,50"}),
                                           ("nested-wait", {"thresholds": "50,50,50,50"})])
def test_drain_finishes_every_request(policy, params):
    """Thresholds far above what ever arrives: nothing launches until arrivals stop, then the
    drain runs everything (without it the run would end in a deadlock error)."""
    name = "wait-low-demand" if policy == "wait" else "nested-wait-4type"
    w = workload(name, 40)
    res, _, _ = run(w, policy, params)
    r = res.records
    assert res.summary["completed"] == 40
    assert r.admitted.min() >= w.arrival.max()          # nothing started before the drain


def test_max_wait_flushes_partial_batches():
    w = workload("wait-low-demand", 40)
    res, _, _ = run(w, "wait", {"thresholds": "50,50", "max_wait": "0.002"})
    assert res.summary["completed"] == 40
    assert res.records.admitted.min() < w.arrival.max()


# ----- declared types and closed forms -----------------------------------------------------

def test_declared_types_and_replica_share():
    w = workload("nested-wait-4type", 100)
    assert w.declared_types == ((10, 20, 20.0), (10, 40, 40.0), (10, 80, 80.0), (10, 160, 160.0))
    from kvsched.workload.source import WorkloadOptions, resolve
    spec = resolve(WorkloadOptions(workload="nested-wait-4type", rate=30.0))
    assert [r for *_, r in spec.build().declared_types] == pytest.approx([2.0, 4.0, 8.0, 16.0])
    assert resolve(WorkloadOptions(workload="sharegpt", num_requests=5)).build().declared_types is None
    seen = []

    class Peek(Recorder):
        def schedule(self, v):
            seen.append(v.declared_types)
            return super().schedule(v)
    simulate(scenario(w, replicas=2), Peek(make_policy("vllm-v1", {}, GPU), lambda *a: None))
    assert seen[0][0] == (10, 20, 10.0)


def test_equal_thresholds_and_infinite_theta():
    rates = [20, 40, 80, 160]
    assert theory.check_nested(10, ENDS, rates, [8, 8, 7, 5], **LINEAR)["satisfied"]
    assert theory.theta(8, 8, 0.9) == math.inf and theory.theta(5, 7, 0.5) == math.inf
    assert 0 < theory.theta(8, 7, 0.8) < math.inf
    with pytest.raises(KvschedError):
        theory.theta(8, 4, 0.6)             # n_k <= n_(k-1) p_k: unstable
    b = theory.memory_bound(10, ENDS, rates, [8, 8, 7, 5], 10_000, 0.01)
    assert b["theta"][0] == math.inf and b["tail_term"] > 0


def test_nested_solution_halves_the_old_memory():
    rates = [20, 40, 80, 160]
    n = theory.solve_nested(10, ENDS, rates, **LINEAR)
    old = theory.nested_memory(10, ENDS, [16, 15, 13, 9])
    assert old == 147_470
    new = theory.nested_memory(10, ENDS, n)
    assert new < 0.6 * old and theory.check_nested(10, ENDS, rates, n, **LINEAR)["satisfied"]
    # n_1 is the least feasible value: one less fails (10)
    smaller = [n[0] - 1] + [math.floor((n[0] - 1) * p) + 1 for p in []]
    chain = [n[0] - 1]
    for p in theory.continuation(rates):
        chain.append(math.floor(chain[-1] * p) + 1)
    assert not theory.check_nested(10, ENDS, rates, chain, **LINEAR)["satisfied"]


def test_merge_types_when_l_does_not_divide_m():
    ends, rates = theory.merge_types(list(range(1, 11)), [1.0] * 10, 3)
    assert ends == [3.0, 6.0, 10.0] and rates == [3.0, 3.0, 4.0]       # last group: 7..10
    ends, rates = theory.merge_types(list(range(1, 11)), [1.0] * 10, 6)
    assert ends == [1.0, 2.0, 3.0, 4.0, 5.0, 10.0] and rates[-1] == 5.0
    with pytest.raises(KvschedError):
        theory.merge_types([1, 2, 3], [1, 1, 1], 4)


def test_fluid_capacity_fit_involves_d0():
    types = [FluidType(20, 10, 19), FluidType(40, 10, 39)]
    load = sum(t.work for t in types)
    from kvsched.theory.fluid import capacity_fit, equilibrium_memory
    cap = 1000.0
    assert capacity_fit(types, 0.01, 2e-7, cap)["fits"] == (equilibrium_memory(types, 0.01, 2e-7) <= cap)
    # same d1, larger d0: M* grows past C although the load is unchanged
    assert capacity_fit(types, 0.01, 2e-7, cap)["fits"] and not capacity_fit(types, 0.05, 2e-7, cap)["fits"]
    assert capacity_fit(types, 0.01, 2e-7, cap)["max_load"] == pytest.approx(cap / (0.01 + 2e-7 * cap))
    assert load < cap / (0.01 + 2e-7 * cap)


# ----- review fixes ------------------------------------------------------------------------

@pytest.mark.parametrize("policy,preset,params", [("wait", "wait-low-demand", {}),
                                                  ("nested-wait", "nested-wait-4type", {"segments": "19,39,79,159"})])
def test_closed_loops_flush_instead_of_deadlocking(policy, preset, params):
    from kvsched.workload.source import WorkloadOptions, resolve
    w = resolve(WorkloadOptions(workload=preset, arrivals="closed:8", num_requests=300)).build()
    assert w.declared_types is None             # a closed loop has no arrival rate to declare
    res, _, _ = run(w, policy, params)
    assert res.summary["completed"] == 300


def test_segments_shorter_than_the_longest_type_end_at_it():
    w = workload("nested-wait-4type", 2000)
    res, pol, _ = run(w, "nested-wait", {"segments": "19,39"})
    rep = pol.report()
    assert rep["segment_ends"] == [19, 159] and rep["satisfied"]
    assert rep["memory"] == theory.nested_memory(10, [19, 159], rep["thresholds"])


def test_small_kv_preempts_and_every_request_finishes():
    w = workload("nested-wait-4type", 1500)
    tight, _, _ = run(w, "nested-wait", kv=20_000)
    assert tight.summary["completed"] == 1500 and tight.summary["preemptions"] > 0
    w = workload("wait-low-demand", 1500)
    tight, _, _ = run(w, "wait", kv=1_000)
    assert tight.summary["completed"] == 1500


def test_contradictory_or_huge_parameters_are_refused():
    for params, msg in (({"rule": "practical", "batch_size": "8", "thresholds": "5,5"}, "not both"),
                        ({"batch_size": "8"}, "rule=practical"), ({"thresholds": "1e30,5"}, "whole numbers"),
                        ({"thresholds": str(2 ** 41)}, "1..")):
        with pytest.raises(KvschedError, match=msg):
            make_policy("wait", params, GPU)


def test_theory_rejects_non_finite_thresholds():
    with pytest.raises(KvschedError):
        theory.check_nested(10, ENDS, [20, 40, 80, 160], [float("nan"), 8, 7, 5], **LINEAR)
    with pytest.raises(KvschedError):
        theory.wait_memory([FluidType(1, 1, 1)], [math.inf])


def test_solve_nested_jumps_to_the_least_n1_on_many_types():
    decodes = list(range(1, 501))
    rates = [0.99 ** k for k in range(500)]
    load = sum(FluidType(r, 62, e).work for r, e in zip(rates, decodes))
    d1 = 0.95 / load
    n = theory.solve_nested(62, decodes, rates, 0.01, d1)
    assert theory.check_nested(62, decodes, rates, n, 0.01, d1)["satisfied"]
    chain = [n[0] - 1]
    for p in theory.continuation(rates):
        chain.append(math.floor(chain[-1] * p) + 1)
    assert not theory.check_nested(62, decodes, rates, chain, 0.01, d1)["satisfied"]


@pytest.mark.parametrize("policy,params", [("wait", {"type_bins": "2"}),
                                           ("nested-wait", {"bin_width": "64", "bins": "8"})])
def test_closed_loop_with_tiny_kv_never_plans_only_preemptions(policy, params):
    from kvsched.workload.source import WorkloadOptions, resolve
    w = resolve(WorkloadOptions(arrivals="closed:4", num_requests=300, output_known=True)).build()
    res, _, _ = run(w, policy, params, kv=3000)
    assert res.summary["completed"] == 300


class DropAdmission(Recorder):
    """Changes the plan on its way: every third batch, the last admission does not happen."""

    def schedule(self, v):
        plan = self.inner.schedule(v)
        self.calls += 1
        if self.calls % 3 == 0 and plan.admit:
            i = plan.admit.pop()
            plan.chunks = [c for c in plan.chunks if c[0] != i]
        return plan


@pytest.mark.parametrize("policy,params", [("wait", {}), ("wait", {"pause_excluded": "false"}),
                                           ("nested-wait", {})])
def test_inventories_survive_a_changed_plan(policy, params):
    name = "wait-low-demand" if policy == "wait" else "nested-wait-4type"
    w = workload(name, 1500)
    pol = make_policy(policy, params, GPU)
    res = simulate(scenario(w), DropAdmission(pol, lambda *a: None))
    assert res.summary["completed"] == 1500


def test_given_nested_thresholds_are_checked_and_underscores_refused():
    res, pol, _ = run(workload("nested-wait-4type", 200), "nested-wait", {"thresholds": "1,1,1,1"})
    rep = res.summary["policy_report"]
    assert rep["source"] == "given" and rep["satisfied"] is False and rep["fits_kv"] is True
    with pytest.raises(KvschedError, match="whole numbers"):
        make_policy("nested-wait", {"thresholds": "1_0"}, GPU)
