"""Hand-checked scenarios: the simulator's times must match to 1e-9."""
import pytest

from kvsched.metrics import summarize
from kvsched.workload import Request, Workload

from conftest import run


@pytest.mark.parametrize("policy,params", [
    ("sarathi", {"chunk_size": 32, "max_num_seqs": 4}),
    ("vllm-v1", {"max_num_batched_tokens": 32, "max_num_seqs": 4}),
])
def test_single_request_constant_cost(policy, params):
    b, s, o = 0.5, 100, 5
    w = Workload.from_requests([Request(0.0, s, o)])
    server, rec, _ = run(w, policy, params, cost_params={"b": b})
    chunks = -(-s // 32)                              # 32 + 32 + 32 + 4
    ttft = rec.first_token[0] - rec.arrival[0]
    e2e = rec.finished[0] - rec.arrival[0]
    assert ttft == pytest.approx(b * chunks, abs=1e-9)
    assert e2e == pytest.approx(ttft + (o - 1) * b, abs=1e-9)
    summary = summarize(rec)
    assert summary["mean_tpot_ms"] == pytest.approx(b * 1000, abs=1e-6)
    assert summary["mean_itl_ms"] == pytest.approx(b * 1000, abs=1e-6)
    assert rec.iterations == chunks + o - 1
    assert [row[2] for row in server.batches[:chunks]] == [32, 32, 32, 4]


def test_two_requests_linear_cost_by_hand():
    """d0 = 0.1, d1 = 0.01; A (s=10, o=3) at t=0, B (s=20, o=2) at t=0.15, vLLM v1.
    batch 1: prefill A (10 tokens)                  0.1 + 0.01 * 10        = 0.20 -> t 0.20
    batch 2: decode A (context 11) + prefill B (20) 0.1 + 0.01 * (11 + 20) = 0.41 -> t 0.61
    batch 3: decode A (context 12) + decode B (21)  0.1 + 0.01 * (12 + 21) = 0.43 -> t 1.04
    """
    w = Workload.from_requests([Request(0.0, 10, 3), Request(0.15, 20, 2)])
    server, rec, _ = run(w, "vllm-v1", cost="linear", cost_params={"d0": 0.1, "d1": 0.01})
    assert [round(b[1], 12) for b in server.batches] == [0.2, 0.41, 0.43]
    assert rec.first_token.tolist() == pytest.approx([0.2, 0.61], abs=1e-9)
    assert rec.finished.tolist() == pytest.approx([1.04, 1.04], abs=1e-9)
    s = summarize(rec)
    assert s["mean_ttft_ms"] == pytest.approx((200 + 460) / 2, abs=1e-6)
    assert s["mean_e2el_ms"] == pytest.approx((1040 + 890) / 2, abs=1e-6)
    assert s["mean_tpot_ms"] == pytest.approx((420 + 430) / 2, abs=1e-6)
    assert s["mean_itl_ms"] == pytest.approx((410 + 430 + 430) / 3, abs=1e-6)
    assert rec.itl_max.tolist() == pytest.approx([0.43, 0.43], abs=1e-9)


def test_preemption_by_recompute_by_hand():
    """Capacity 12 tokens, block 1, constant b = 1, vLLM v1.
    A (s=4, o=6) at 0 and B (s=4, o=6) at 0: both prefill in batch 1 (KV 8), decode from
    there; at KV 12 (after batch 3, A and B hold 6 each) the next decode step needs 2 more
    blocks, so B (newest) is preempted: it has 3 tokens, holds 6 KV, and must recompute 4 + 3.
    """
    w = Workload.from_requests([Request(0.0, 4, 6), Request(0.0, 4, 6)])
    server, rec, _ = run(w, "vllm-v1", kv_tokens=12, cost_params={"b": 1.0})
    assert rec.preemptions.tolist() == [0, 1]
    assert rec.recomputed.tolist() == [0, 7]
    assert rec.finished[0] == pytest.approx(6.0)       # 1 prefill + 5 decodes, never stalled
    prefill_tokens = sum(b[2] for b in server.batches)
    assert prefill_tokens == 4 + 4 + 7
    assert max(b[5] for b in server.batches) <= 12
