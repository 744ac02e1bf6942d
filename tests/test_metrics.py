"""Histogram percentiles, goodput and steady-state trimming."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.hardware import MODELS, get_gpu, get_model, kv_capacity_tokens
from kvsched.metrics import GapHistogram, Goodput, percentiles, summarize
from kvsched.workload import Fixed, Request, Workload, synthetic

from conftest import run


def test_histogram_percentiles_exact_to_the_bin():
    rng = np.random.default_rng(1)
    gaps = rng.lognormal(-3, 1, 300_000)
    h = GapHistogram()
    for g in gaps[:1000]:
        h.add(float(g))
    values, counts = np.unique(np.round(gaps[1000:], 4), return_counts=True)
    for v, c in zip(values, counts):
        h.add(float(v), int(c))
    exact = np.concatenate([gaps[:1000], np.repeat(values, counts)])
    assert h.n == len(exact) and h.mean() == pytest.approx(exact.mean(), rel=1e-9)
    assert h.std() == pytest.approx(exact.std(), rel=1e-6)
    for q in (0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(np.quantile(exact, q), rel=1.5e-3)


def test_goodput_counts_requests_meeting_every_slo():
    w = Workload.from_requests([Request(0.0, 10, 3), Request(0.15, 20, 2)])
    _, rec, _ = run(w, "vllm-v1", cost="linear", cost_params={"d0": 0.1, "d1": 0.01})
    # TTFTs 200 and 460 ms, TPOTs 420 and 430 ms, duration 1.04 s (see test_exact)
    s = summarize(rec, Goodput(ttft=300))
    assert s["request_goodput"] == pytest.approx(1 / 1.04)
    assert summarize(rec, Goodput(ttft=500, tpot=425))["request_goodput"] == pytest.approx(1 / 1.04)
    assert summarize(rec, Goodput(e2el=2000))["request_goodput"] == pytest.approx(2 / 1.04)


def test_trim_measures_the_steady_window():
    w = synthetic(Fixed(8), Fixed(8), rate=50, n=3000, seed=0)
    _, rec, _ = run(w, "vllm-v1", cost_params={"b": 0.001}, checked=False)
    s = summarize(rec, trim=500)
    window = w.arrival[-501] - w.arrival[500]
    inside = ((rec.finished >= w.arrival[500]) & (rec.finished <= w.arrival[-501])).sum()
    assert s["duration"] == pytest.approx(window) and s["request_throughput"] == pytest.approx(inside / window)
    assert abs(s["request_throughput"] / 50 - 1) < 0.05


def test_kv_bytes_and_capacity():
    assert get_model("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert get_model("qwen2-7b").kv_bytes_per_token == 57344
    m = get_model("qwen2-7b")
    assert m.params == 7_615_616_512             # from its config.json (Qwen2-7B: 7.62 billion)
    tokens = kv_capacity_tokens(m, get_gpu("a30"), 0.9)
    # vLLM's memory profile (memory_profile.py): the A30's defaults 2,048 tokens and 256 sequences, so
    # the sampler's 256 x vocab x 16 bytes is the larger peak; 1.35 GiB of CUDA graphs and non-torch memory
    assert tokens == math.floor((0.9 * 24 * 2**30 - m.params * 2 - 256 * 152064 * 16 - int(1.35 * 2**30)) / 57344)
    assert len(MODELS) >= 25


FLOATS = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(FLOATS, st.sampled_from([0.0, -0.0, 1.0, 5e-324, 1e308, -1e308])), min_size=1, max_size=40),
       st.lists(st.one_of(st.sampled_from([0, 50, 90, 99, 100]), st.floats(0, 100)), min_size=1, max_size=4))
def test_percentiles_are_numpys_bit_for_bit(values, qs):
    """metrics.percentiles is np.percentile's default (linear) method to the last bit, -0.0
    and overflow (1e308 - -1e308) included: the summary's p50/p90/p99 did not change."""
    with np.errstate(all="ignore"):         # numpy's overflow warnings (1e308 - -1e308)
        got = np.array(percentiles(np.array(values), tuple(qs)))
        want = np.percentile(np.array(values), qs)
    assert got.tobytes() == np.asarray(want, np.float64).tobytes(), (values, qs, got, want)


@pytest.mark.parametrize("values", [[1.0, math.nan, 2.0], [math.inf, 1.0], [-math.inf, math.inf], [3.0, -math.inf],
                                    [-0.0, 0.0, 0.0, 0.0, 0.0, -0.0, -0.0], np.array([1.5, 2.25, 7.0], np.float32),
                                    np.array([-2 ** 63, 2 ** 63 - 1])])
def test_percentiles_numpy_computes_are_numpys(values):
    """Values numpy handles by rules of its own go to numpy: NaN, infinities, zeros (the sign
    of a zero result depends on its partition), other dtypes (float32 arithmetic, wrapping ints)."""
    with np.errstate(invalid="ignore", over="ignore"):     # numpy's inf - inf, int64 overflow
        got = np.array(percentiles(np.asarray(values), (0, 50, 99)))
        want = np.percentile(np.asarray(values), [0, 50, 99])
    assert got.tobytes() == np.asarray(want, np.float64).tobytes()


def test_summary_percentiles_do_not_import_numpy_ma():
    """numpy's own percentile imports numpy.ma on first use (about 10 ms of every run's
    start-up); the summary's percentiles do not."""
    import subprocess
    import sys
    code = ("import sys, numpy as np; from kvsched.metrics import percentiles; "
            "p = percentiles(np.arange(1.0, 1001.0), (50, 90, 99)); print('numpy.ma' in sys.modules, p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(None, 1)
    assert out[0] == "False", out
    assert out[1].strip() == str(np.percentile(np.arange(1.0, 1001.0), [50, 90, 99]).tolist()), out


def test_an_idle_server_s_ttft_is_front_end_prefill_and_output_path():
    """Issue "Timing fidelity", Done-when: one request on an idle A100 (llama-3.1-8b, roofline):
    the client's TTFT = the front end (5 ms) + the prefill step + the output-path term (fitted:
    one of the request's mean inter-token gaps, its two decode steps'; kvsched/client.py); E2E
    grows by the same; the engine's own figures are beside them; ITL and throughput are the
    engine's, bit for bit."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.cost.shape import BatchShape
    from kvsched.run import Scenario, simulate
    from kvsched.workload.synthetic import synthetic
    w = synthetic(Fixed(512), Fixed(3), rate=1.0, n=1, seed=0)
    cost = RooflineCost(get_model("llama-3.1-8b"), get_gpu("a100-80gb"))
    prefill = cost.time(BatchShape(512, 1, 512 * 256.5, 512, 0, 0, ((0, 512),), False))
    decodes = [cost.time(BatchShape(0, 0, 0, 0, 1, ctx, (), True if ctx == 513 else False)) for ctx in (513, 514)]
    gap = sum(decodes) / 2
    s = simulate(Scenario(w, model="llama-3.1-8b", gpu="a100-80gb")).summary
    assert s["engine_mean_ttft_ms"] == pytest.approx(prefill * 1000, rel=1e-9)
    assert s["mean_ttft_ms"] == pytest.approx((0.005 + prefill + gap) * 1000, rel=1e-9)
    assert s["mean_e2el_ms"] - s["engine_mean_e2el_ms"] == pytest.approx((0.005 + gap) * 1000, rel=1e-9)
    assert s["mean_itl_ms"] == pytest.approx(gap * 1000, rel=1e-9)
    assert (s["client_front_s"], s["client_output_steps"]) == (0.005, 1.0)
    off = simulate(Scenario(w, model="llama-3.1-8b", gpu="a100-80gb", client=None)).summary
    assert off["mean_ttft_ms"] == s["engine_mean_ttft_ms"] and "engine_mean_ttft_ms" not in off
    for key in ("mean_itl_ms", "mean_tpot_ms", "request_throughput", "duration", "simulated_seconds"):
        assert s[key] == off[key], key
