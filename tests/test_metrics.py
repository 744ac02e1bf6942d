"""Histogram percentiles, goodput and steady-state trimming."""
import math

import numpy as np
import pytest

from kvsched.hardware import MODELS, get_gpu, get_model, kv_capacity_tokens
from kvsched.metrics import GapHistogram, Goodput, summarize
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
    tokens = kv_capacity_tokens(get_model("qwen2-7b"), get_gpu("a30"), 0.9)
    assert tokens == math.floor((0.9 * 24 * 2**30 - 7.62e9 * 2) / 57344)
    assert len(MODELS) == 10
