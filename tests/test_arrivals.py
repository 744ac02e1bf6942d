"""Arrival processes and the closed loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import Checked, run
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.errors import KvschedError
from kvsched.workload import Uniform
from kvsched.workload.arrivals import (Closed, GammaArrivals, Piecewise, Poisson, Replay, Sinusoid,
                                       parse_arrivals)
from kvsched.workload.spec import Phase, RequestType, WorkloadSpec

RNG = np.random.default_rng


def gaps_cv(t):
    g = np.diff(np.concatenate(([0.0], t)))
    return g.std() / g.mean()


def test_poisson_and_gamma_rates_and_burstiness():
    n = 200_000
    t = Poisson(4.0).times(RNG(1), n)
    assert abs(n / t[-1] - 4.0) < 0.05 and abs(gaps_cv(t) - 1) < 0.01
    t = GammaArrivals(4.0, 3.0).times(RNG(2), n)
    assert abs(n / t[-1] - 4.0) < 0.15 and abs(gaps_cv(t) - 3.0) < 0.1


def test_piecewise_rate_counts_per_segment():
    p = Piecewise(((2.0, 10.0), (8.0, 5.0)))                 # cyclic, period 15 s, mean 4
    assert p.mean_rate == pytest.approx(4.0)
    t = p.times(RNG(3), 60_000)
    phase = np.mod(t, 15.0)
    low, high = (phase < 10).sum(), (phase >= 10).sum()
    assert abs(high / low - 2.0) < 0.05                         # 8 x 5 s versus 2 x 10 s
    assert abs(len(t) / t[-1] - 4.0) < 0.1


def test_sinusoid_follows_its_rate():
    s = Sinusoid(10.0, 0.8, 60.0)
    t = s.times(RNG(4), 100_000)
    high = (np.mod(t, 60.0) < 30).mean()                        # sin > 0 in the first half period
    expect = (1 + 2 * 0.8 / math.pi) / 2
    assert abs(high - expect) < 0.01 and abs(len(t) / t[-1] - 10) < 0.2


def test_replay_scaling_and_spread():
    stamps = np.array([0.0, 0.0, 3.0, 3.0, 6.0])
    assert np.allclose(Replay(speedup=2).apply(stamps, RNG(0)), stamps / 2)
    t = Replay(rate=2.0).apply(stamps, RNG(0))
    assert (len(t) - 1) / (t.max() - t.min()) == pytest.approx(2.0)
    spread = Replay(spread=3.0).apply(stamps, RNG(5))
    assert np.all(spread >= stamps) and np.all(spread < stamps + 3.0)
    assert np.array_equal(spread, Replay(spread=3.0).apply(stamps, RNG(5)))


def test_same_seed_same_times_for_every_process():
    for proc in (Poisson(3), GammaArrivals(3, 2), Piecewise(((1, 2), (5, 1))), Sinusoid(3, 0.5, 10)):
        assert np.array_equal(proc.times(RNG(9), 500), proc.times(RNG(9), 500))
        assert np.all(np.diff(proc.times(RNG(9), 500)) >= 0)


@pytest.mark.parametrize("spec,expect", [
    ("poisson:5", Poisson(5.0)), ("gamma:5:2", GammaArrivals(5.0, 2.0)), ("closed:64", Closed(64)),
    ("piecewise:2:10,8:5", Piecewise(((2.0, 10.0), (8.0, 5.0)))), ("sine:10:0.5:60", Sinusoid(10, 0.5, 60)),
    ("replay", Replay()), ("replay:7", Replay(rate=7.0)), ("replay:x2", Replay(speedup=2.0)),
])
def test_parse_arrivals(spec, expect):
    assert parse_arrivals(spec) == expect


@pytest.mark.parametrize("spec,needle", [
    ("poisson:-1", "rate must be a positive"), ("poisson", "unknown arrival process"),
    ("closed:0", "concurrency must be an integer >= 1"), ("closed:2.5", "values must be numbers"),
    ("gamma:5", "unknown arrival process"), ("sine:5:2:10", "amplitude must be in [0, 1]"),
    ("piecewise:0:5", "a segment with a rate > 0"), ("piecewise:3", "RATE:SECONDS"),
    ("replay:x0", "speed-up must be > 0"), ("bursty:9", "unknown arrival process"),
])
def test_bad_arrival_specs(spec, needle):
    with pytest.raises(KvschedError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_arrivals(spec)


class InFlight(Checked):
    """Records (issued, in flight) at every batch boundary."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.seen: list[tuple[int, int]] = []

    def schedule(self, v):
        assert v.in_flight == len(v.waiting) + len(v.running)
        self.seen.append((v.issued, v.in_flight))
        return super().schedule(v)


def closed_workload(c: int, n: int, seed: int, phases=None) -> WorkloadSpec:
    phases = phases or [(n, c)]
    return WorkloadSpec(tuple(Phase(k, (RequestType(Uniform(1, 60), Uniform(1, 40)),), arrivals=Closed(cc))
                              for k, cc in phases), seed=seed)


@given(c=st.integers(1, 40), n=st.integers(1, 150), seed=st.integers(0, 10**6),
       policy=st.sampled_from(["vllm-v1", "sarathi", "vllm-v0", "orca", "request-level"]))
def test_closed_loop_keeps_exactly_c_in_flight(c, n, seed, policy):
    w = closed_workload(c, n, seed).build()
    probe = InFlight(make_policy(policy, {}, get_gpu("a100-80gb")))
    server, rec, _ = run(w, probe, kv_tokens=50_000, checked=False)
    assert np.isfinite(rec.finished).all()
    for issued, in_flight in probe.seen:
        assert in_flight <= c
        if issued < n:
            assert in_flight == c                   # every free seat is refilled at once
    # request i is issued exactly when request i - c finishes (FIFO seats)
    arr = rec.arrival
    assert np.all(arr[:min(c, n)] == 0)
    if n > c:
        first_free = np.sort(rec.finished)[: n - c]
        assert np.allclose(arr[c:], first_free)


def test_concurrency_shift_respects_each_phase_limit():
    phases = [(60, 4), (60, 16), (60, 2)]
    w = closed_workload(0, 0, 7, phases).build()
    _, rec, _ = run(w, "vllm-v1", kv_tokens=50_000)
    conc = w.concurrency
    for i in range(len(w)):
        still_running = np.sum(rec.finished[:i] > rec.arrival[i])
        assert still_running + 1 <= conc[i]
    assert np.isfinite(rec.finished).all()


def test_closed_loop_deadlock_is_reported():
    from kvsched.errors import PlanError
    from test_policies import Idle
    w = closed_workload(2, 5, 0).build()
    with pytest.raises(PlanError, match="closed loop"):
        run(w, Idle(), checked=False)
