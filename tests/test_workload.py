"""Length distributions, arrivals, mixtures and trace readers."""
import numpy as np
import pytest

from kvsched.errors import KvschedError
from kvsched.workload import (Fixed, Gamma, Geometric, Jitter, RequestType, Tier, Uniform, empirical,
                              load_trace, mixture, parse_length, synthetic)

RNG = lambda: np.random.default_rng(0)  # noqa: E731


@pytest.mark.parametrize("dist,lo,hi", [
    (Fixed(7), 7, 7), (Uniform(3, 9), 3, 9), (Jitter(100), 50, 150), (Geometric(20), 1, None),
    (Gamma(2, 300), 1, None), (empirical([4, 8, 15]), 4, 15),
])
def test_lengths_are_integers_in_range_with_the_right_mean(dist, lo, hi):
    x = dist.sample(RNG(), 200_000)
    assert x.dtype == np.int64 and x.min() >= lo and (hi is None or x.max() <= hi)
    assert abs(x.mean() / dist.mean - 1) < 0.01


def test_jitter_is_half_to_one_and_a_half_times_the_mean():
    assert Jitter(512) == Uniform(256, 768)


@pytest.mark.parametrize("spec,expected", [
    ("fixed:5", Fixed(5)), ("uniform:2:9", Uniform(2, 9)), ("jitter:100", Uniform(50, 150)),
    ("geometric:30", Geometric(30.0)), ("gamma:2:100", Gamma(2.0, 100.0)),
])
def test_parse_length(spec, expected):
    assert parse_length(spec) == expected


@pytest.mark.parametrize("spec", ["fixed", "uniform:5", "uniform:9:2", "fixed:0", "gamma:a:b", "pareto:2"])
def test_parse_length_rejects(spec):
    with pytest.raises(KvschedError):
        parse_length(spec)


def test_poisson_rate_and_seed():
    a = synthetic(Fixed(10), Fixed(10), rate=4.0, n=50_000, seed=1)
    b = synthetic(Fixed(10), Fixed(10), rate=4.0, n=50_000, seed=1)
    assert np.array_equal(a.arrival, b.arrival)
    assert abs((len(a) - 1) / (a.arrival[-1] - a.arrival[0]) / 4.0 - 1) < 0.02
    gaps = np.diff(a.arrival)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.02          # exponential gaps: CV 1


def test_mixture_types_follow_their_rates():
    gold = Tier("gold", ttft_slo=0.5, tbt_slo=0.1, priority=0)
    w = mixture([RequestType(Fixed(100), Fixed(10), 1.0, gold), RequestType(Fixed(20), Fixed(50), 3.0)],
                n=40_000, seed=2, output_known=True)
    short = w.prompt == 20
    assert abs(short.mean() - 0.75) < 0.01
    assert np.all(w.output[short] == 50) and np.all(w.output[~short] == 10)
    assert w.tiers == (gold,) and np.all(w.tier_index[~short] == 0) and np.all(w.tier_index[short] == -1)
    assert w.output_known.all()


def test_timed_trace_first_n_and_resampling(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n0.0,10,5\n1.0,20,6\n3.0,30,7\n")
    w = load_trace(f)
    assert w.arrival.tolist() == [0, 1, 3] and w.prompt.tolist() == [10, 20, 30]
    assert load_trace(f, num_requests=2).prompt.tolist() == [10, 20]
    big = load_trace(f, num_requests=1000, seed=5)
    assert len(big) == 1000 and set(big.prompt.tolist()) <= {10, 20, 30}
    assert set(np.round(np.diff(big.arrival), 9).tolist()) <= {1.0, 2.0}
    assert np.array_equal(big.prompt, load_trace(f, num_requests=1000, seed=5).prompt)
    scaled = load_trace(f, rate=2.0)                # the trace's own times, rescaled to 2 req/s
    assert scaled.prompt.tolist() == [10, 20, 30] and np.allclose(scaled.arrival, [0, 1 / 3, 1])


def test_shared_length_traces(traces_dir):
    w = load_trace(traces_dir / "sharegpt-vidur-10k-lengths.csv", rate=10)
    assert len(w) == 10_000
    assert round(w.prompt.mean()) == 246 and round(w.output.mean()) == 326    # the README's figures
    w = load_trace(traces_dir / "sharegpt-lengths.csv", rate=1, num_requests=50_000, seed=0)
    assert len(w) == 50_000 and w.prompt.max() <= 8141
