"""Stability sanity under constant batch time: service rate mu = seats / (b * o) here.

vLLM v1 with 8 seats, prompt 32 (one prefill step) and output 64: a seat serves one request
every 64 steps, so mu = 8 / (64 * 0.01) = 12.5 requests/s with ample memory."""
import numpy as np

from kvsched.metrics import summarize
from kvsched.workload import Fixed, synthetic

from conftest import run

B, SEATS, OUT = 0.01, 8, 64
MU = SEATS / (OUT * B)
PARAMS = {"max_num_batched_tokens": 512, "max_num_seqs": SEATS}


def test_stable_throughput_equals_arrival_rate():
    rate = 0.5 * MU
    w = synthetic(Fixed(32), Fixed(OUT), rate, 20_000, seed=3)
    server, rec, _ = run(w, "vllm-v1", PARAMS, cost_params={"b": B}, checked=False)
    s = summarize(rec, trim=1000)
    empirical_rate = (len(w) - 1) / (w.arrival[-1] - w.arrival[0])
    assert abs(s["request_throughput"] / empirical_rate - 1) < 0.02
    assert abs(s["request_throughput"] / rate - 1) < 0.02
    queue = np.array([row[1] for row in server.timeline])
    assert queue.max() < 60
    half = len(queue) // 2
    assert abs(queue[:half].mean() - queue[half:].mean()) < 2     # no drift


def test_overload_queue_grows_linearly():
    rate = 2 * MU
    w = synthetic(Fixed(32), Fixed(OUT), rate, 8_000, seed=4)
    server, rec, _ = run(w, "vllm-v1", PARAMS, cost_params={"b": B}, checked=False)
    t = np.array([row[0] for row in server.timeline])
    q = np.array([row[1] for row in server.timeline])
    arriving = t <= w.arrival[-1]
    slope, intercept = np.polyfit(t[arriving], q[arriving], 1)
    assert abs(slope / (rate - MU) - 1) < 0.05                # grows at lambda - mu
    fit = slope * t[arriving] + intercept
    r2 = 1 - ((q[arriving] - fit) ** 2).sum() / ((q[arriving] - q[arriving].mean()) ** 2).sum()
    assert r2 > 0.99
    s = summarize(rec, trim=1000)
    assert abs(s["request_throughput"] / MU - 1) < 0.02
