"""Decode selection (Plan.decode as a set of ids): exact times, paused KV, cohorts."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvsched.cost import ConstantCost
from kvsched.kvcache import PagedKV
from kvsched.metrics import summarize
from kvsched.policies import Plan
from kvsched.sim.server import Server
from kvsched.workload import Workload

from conftest import run
from test_properties import params, scenarios


class OddEven:
    """Admits everything at once, then decodes odd ids and even ids in alternate batches."""
    name = "odd-even"

    def __init__(self) -> None:
        self.batch = 0

    def schedule(self, v):
        if v.waiting:
            admit = list(v.waiting)
            return Plan(admit, [(i, v.prefill_target(i)) for i in admit])
        self.batch += 1
        parity = self.batch % 2            # batch 1 after the prefill decodes the odd ids
        return Plan(decode={i for i in v.decoding if i % 2 == parity})


def test_alternating_halves_tpot_exact():
    b, s, o, n = 0.25, 10, 9, 40
    w = Workload.build(np.zeros(n), [s] * n, [o] * n)
    server, rec, _ = run(w, OddEven(), cost_params={"b": b}, kv_tokens=n * (s + o))
    tpot = (rec.finished - rec.first_token) / (o - 1)
    odd, even = np.arange(1, n, 2), np.arange(0, n, 2)
    assert np.all(np.abs(tpot[odd] - (b + 2 * b * (o - 2)) / (o - 1)) < 1e-9)
    assert np.all(np.abs(tpot[even] - 2 * b) < 1e-9)
    assert np.all(np.abs(rec.first_token - b) < 1e-9)
    assert np.all(np.abs(rec.itl_max - 2 * b) < 1e-9)
    assert rec.itl.n == n * (o - 1)
    assert rec.itl.total == pytest.approx(sum(rec.finished - rec.first_token), abs=1e-9)
    # every batch after the prefill decodes exactly one half, and paused KV stays held
    assert [row[4] for row in server.batches[1:]] == [n // 2] * (2 * (o - 1))
    assert server.batches[1][5] == n * s + n // 2            # block size 1: 40 prompts + 20 new tokens
    assert summarize(rec)["mean_tpot_ms"] == pytest.approx(1000 * (tpot.mean()), abs=1e-6)


def test_paused_request_can_be_preempted_and_resumes():
    """Request 1 is paused for two batches, then preempted; it recomputes prompt + generated."""
    class PauseThenPreempt:
        name = "pause-preempt"

        def __init__(self):
            self.k = 0

        def schedule(self, v):
            self.k += 1
            if self.k == 1:
                return Plan([0, 1], [(0, 5), (1, 5)])
            if self.k in (2, 3):
                return Plan(decode={0})
            if self.k == 4:
                assert v.is_decoding(1) and v.generated(1) == 1 and v.kv_tokens(1) == 5
                assert v.last_token_time(1) == pytest.approx(1.0)
                return Plan(decode={0}, preempt=[1])
            if 1 in v.waiting:
                return Plan([1], [(1, v.prefill_target(1))], decode=bool(v.num_decoding))
            return Plan(decode=True)

    w = Workload.build(np.zeros(2), [5, 5], [4, 4])
    server, rec, _ = run(w, PauseThenPreempt(), cost_params={"b": 1.0})
    assert rec.preemptions.tolist() == [0, 1]
    assert rec.recomputed.tolist() == [0, 6]          # its new prefill target: prompt 5 + 1 generated
    # batches: 1 prefill both [0,1]; 2-3 decode 0 [1,3]; 4 decode 0 (done at 4), preempt 1;
    # 5 re-prefill 1 (6 tokens) -> its 2nd token at 5; 6-7 decode it -> done at 7
    assert rec.finished.tolist() == pytest.approx([4.0, 7.0], abs=1e-9)
    assert rec.itl_max[1] == pytest.approx(4.0, abs=1e-9)   # first token at 1, second at 5
    assert server.kv.used == 0


def test_selection_errors_name_policy_and_request():
    from kvsched.errors import PlanError

    class Picky:
        name = "picky"

        def __init__(self, pick):
            self.pick = pick

        def schedule(self, v):
            if v.waiting:
                admit = list(v.waiting)
                return Plan(admit, [(i, v.prefill_target(i)) for i in admit])
            return Plan(decode=self.pick)

    w = Workload.build(np.zeros(3), [4, 4, 4], [5, 5, 5])
    for pick, needle in [({7}, "request 7, which does not exist"), ({0, -1}, "request -1"),
                         ("all", "decode='all'"), (5, "decode=5")]:
        with pytest.raises(PlanError, match=f"policy picky.*{needle}"):
            run(w, Picky(pick), checked=False)


class RandomPause:
    """Wraps a policy: whenever it decodes every decoder, decode a random non-empty subset."""

    def __init__(self, inner, seed: int) -> None:
        self.inner, self.name = inner, inner.name
        self.rng = np.random.default_rng(seed)

    def schedule(self, v):
        plan = self.inner.schedule(v)
        if plan.decode is True:
            gone = set(plan.preempt)
            live = sorted(i for i in v.decoding if i not in gone)
            if len(live) > 1:
                keep = self.rng.random(len(live)) < 0.5
                keep[self.rng.integers(len(live))] = True
                plan.decode = {i for i, k in zip(live, keep) if k}
        return plan

    def on_finish(self, i, v) -> None:
        self.inner.on_finish(i, v)

    def on_preempt(self, i, v) -> None:
        hook = getattr(self.inner, "on_preempt", None)
        if hook is not None:
            hook(i, v)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**31))
def test_invariants_with_paused_decoders(sc, seed):
    """Every policy, its decodes thinned to random subsets: KV within capacity (checked each
    step), tokens conserved, every request finishes with its output."""
    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy
    w, policy, block, kv, cost, cap = sc
    pol = RandomPause(make_policy(policy, params(policy, cap), get_gpu("a100-80gb")), seed)
    server, rec, checked = run(w, pol, cost=cost, kv_tokens=kv, block_size=block)
    assert all(b[5] <= server.kv.capacity_blocks * block for b in server.batches)
    assert np.isfinite(rec.finished).all() and sorted(checked.finished) == list(range(len(w)))
    assert sum(b[2] for b in server.batches) == int(w.prompt.sum() + rec.recomputed.sum())
    # every output token is counted once: as an inter-token gap after each request's first
    assert rec.itl.n == int((w.output - 1).sum())
    assert sum(b[4] for b in server.batches) <= int((w.output - 1).sum())
    assert server.kv.used == 0


def test_cohorts_stay_few_under_random_selection():
    """After any selection there are at most two cohorts (selected, paused); results match
    the same run with decode selection expressed through one cohort per request."""
    seen = []

    class Spy(RandomPause):
        def schedule(self, v):
            plan = super().schedule(v)
            seen.append(len(server.replica._decoders.cohorts))
            return plan

    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy
    w = Workload.build(np.zeros(60), [20] * 60, [80] * 60)
    server = Server(w, Spy(make_policy("vllm-v1", {}, get_gpu("a100-80gb")), 1), ConstantCost(0.01),
                    PagedKV(100_000, 1))
    server.run()
    assert max(seen) <= 3 and max(seen) >= 2      # 2 after a selection, + 1 while new decoders wait


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 30), st.integers(2, 25), st.integers(0, 2**31), st.floats(0.05, 0.95))
def test_random_selection_matches_brute_force(n, max_out, seed, p):
    """Every request prefills in batch 1 (constant b), then each batch decodes a random
    subset: a direct per-request model of token times gives the same finish times, maximum
    gaps and ITL sums as the cohort engine."""
    rng = np.random.default_rng(seed)
    out = rng.integers(1, max_out + 1, n)
    b = 0.1
    picks: list[set[int]] = []

    class Random:
        name = "random-subsets"

        def schedule(self, v):
            if v.waiting:
                admit = list(v.waiting)
                return Plan(admit, [(i, v.prefill_target(i)) for i in admit])
            live = sorted(v.decoding)
            pick = {i for i in live if rng.random() < p} or {live[int(rng.integers(len(live)))]}
            picks.append(pick)
            return Plan(decode=pick)

    w = Workload.build(np.zeros(n), [8] * n, out.tolist())
    _, rec, _ = run(w, Random(), cost_params={"b": b}, kv_tokens=n * (8 + max_out), checked=True)
    times = {i: [b] for i in range(n)}                   # first token at the end of batch 1
    for k, pick in enumerate(picks):
        for i in pick:
            times[i].append((k + 2) * b)
    for i in range(n):
        t = np.array(times[i])
        assert len(t) == out[i]
        assert rec.finished[i] == pytest.approx(t[-1], abs=1e-9)
        assert rec.itl_max[i] == pytest.approx(np.diff(t).max() if len(t) > 1 else 0.0, abs=1e-9)
    assert rec.itl.n == int((out - 1).sum())
    assert rec.itl.total == pytest.approx(sum(times[i][-1] - b for i in range(n)), abs=1e-6)


@settings(deadline=None, max_examples=200)
@given(gaps=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40), data=st.data())
def test_gap_max_is_the_windows_maximum(gaps, data):
    """Cohort.gap_max (compiled: four running maxima, then the rest one by one) is numpy's
    maximum of the window, for every window length (the unrolled loop's remainders) and
    ties; out-of-range windows are refused."""
    from kvsched.sim.decode_set import Cohort
    c = Cohort(16)
    c._gaps[:len(gaps)] = gaps
    lo = data.draw(st.integers(0, len(gaps) - 1))
    hi = data.draw(st.integers(lo + 1, len(gaps)))
    assert c.gap_max(lo, hi) == float(np.max(np.array(gaps[lo:hi])))
    with pytest.raises(IndexError):
        c.gap_max(hi, hi)
