"""Length distributions, arrivals, mixtures and trace readers."""
import numpy as np
import pytest

from kvsched.errors import KvschedError
from kvsched.workload import (Closed, Empirical, Fixed, Gamma, Geometric, Jitter, Quantiles, RequestType, Tier,
                              Uniform, Workload, empirical, load_trace, mixture, parse_length, synthetic)

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


# ----- Workload.build and the distributions refuse what they would cast --------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt=[NAN, 5]), r"Workload.build: prompt\[0\] must be a whole number, got nan"),
    (dict(prompt=[5.7, 5]), r"prompt\[0\] must be a whole number, got 5.7"),       # was truncated to 5
    (dict(prompt=[5, INF]), r"prompt\[1\] must be a whole number, got inf"),
    (dict(prompt=[True, 5]), "prompt must hold numbers, not True/False"),
    (dict(prompt=[0, 5]), r"prompt\[0\] must be in 1\.\."),
    (dict(prompt=[2 ** 70, 5]), "prompt must hold numbers within 64 bits"),
    (dict(prompt=[1e19, 5]), r"prompt\[0\] must be in 1\.\.9,223,372,036,854,775,807"),
    (dict(prompt=["7", 5]), "prompt must hold numbers"),
    (dict(prompt=[5, 6, 7]), "prompt has 3 entries, arrival has 2"),                # extras were dropped
    (dict(output=[[1], [2]]), "output must be a 1-D list of numbers"),
    (dict(arrival=[NAN, 0]), r"arrival\[0\] must be a finite number of seconds >= 0, got nan"),
    (dict(arrival=[True, 0]), "arrival must hold numbers, not True/False"),
    (dict(output_known=[2, 0]), "output_known must be True/False"),                 # 2 was read as True
    (dict(tier_index=[70_000, 0], tiers=[Tier("a")]), r"tier_index\[0\] must be in -1\.\.0, got 70,000"),
    (dict(phase=[0.5, 0]), r"phase\[0\] must be a whole number"),
    (dict(concurrency=[2 ** 50] * 2), r"concurrency\[0\] must be in 0\.\.1,099,511,627,776"),
    (dict(think=[0, NAN]), r"think\[1\] must be a finite number of seconds"),
    (dict(ids=[1.5, 2]), r"ids\[0\] must be a whole number"),
    (dict(declared_types=((5.5, 1, 1.0),)), r"declared_types\[0\] prompt must be an integer"),
    (dict(declared_types=((5, 1, NAN),)), r"declared_types\[0\] rate must be a finite number > 0"),
])
def test_build_refuses_values_it_would_cast(kwargs, needle):
    args = dict(arrival=[0, 1], prompt=[5, 5], output=[1, 1]) | kwargs
    with pytest.raises(KvschedError, match=needle):
        Workload.build(args.pop("arrival"), args.pop("prompt"), args.pop("output"), **args)


def test_build_takes_integral_floats_and_scalars():
    w = Workload.build([1.0, 0], [5.0, 6], np.array([2.0, 3.0]), output_known=True, phase=0, ids=[7, 3])
    assert w.prompt.tolist() == [6, 5] and w.output.tolist() == [3, 2] and w.prompt.dtype == np.int64
    assert w.output_known.tolist() == [True, True] and w.ids.tolist() == [3, 7]


@pytest.mark.parametrize("make,needle", [
    (lambda: Fixed(True), "fixed: length must be an integer"),
    (lambda: Fixed(NAN), "fixed: length must be an integer"),
    (lambda: Uniform(1.5, 3), "uniform: need 1 <= low <= high"),                    # was sampled as 1..3
    (lambda: Empirical((5.7,)), r"empirical: lengths\[0\] must be a whole number"),  # was sampled as 5
    (lambda: empirical([5, 5.7]), r"empirical: lengths\[1\] must be a whole number"),
    (lambda: Empirical((NAN,)), r"empirical: lengths\[0\] must be a whole number"),
    (lambda: Empirical((2 ** 70,)), "empirical: lengths must hold numbers within 64 bits"),
    (lambda: Quantiles(((0, 1), (1, NAN))), "quantiles: probabilities and lengths must be finite"),
    (lambda: Quantiles(((0, 1), (NAN, 4), (1, 8))), "quantiles: probabilities and lengths must be finite"),
    (lambda: Gamma(True, 5), "gamma: shape must be a number"),
    (lambda: Geometric(True), "geometric: mean must be in 1.."),
    (lambda: Closed(NAN), "closed-loop concurrency must be an integer"),
    (lambda: Closed(True), "closed-loop concurrency must be an integer"),
    (lambda: Tier("a", priority=NAN), "tier a: priority must be an integer"),
    (lambda: Tier("a", priority=2.5), "tier a: priority must be an integer"),
])
def test_distributions_refuse_non_integral_and_bool_values(make, needle):
    with pytest.raises(KvschedError, match=needle):
        make()


def test_integral_values_are_kept_as_ints():
    assert Fixed(5.0).value == 5 and type(Fixed(np.int64(5)).value) is int
    assert Uniform(2.0, 4).low == 2 and str(Closed(3.0)) == "closed:3"
    assert empirical(np.array([4, 8])).values == (4, 8) and Tier("a", priority=1.0).priority == 1
