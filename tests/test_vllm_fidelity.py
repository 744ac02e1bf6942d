"""vllm-v1 as vLLM 0.32's scheduler: whole-prompt admission, the lone-request rule, the null
block; Orca without a token budget (issue "Hardening", part D)."""
import pytest

from kvsched.hardware import get_gpu, get_model, kv_capacity_tokens
from kvsched.run import Scenario, simulate
from kvsched.workload import Request, Workload

from conftest import run


def test_whole_prompt_admission_by_hand():
    """Capacity 10 tokens (block 1), budget 4 tokens, constant b = 1. A and B (prompt 6) at 0.
    reserve on:  [A4] [A2 -> A's 1st token] [A decodes] [A decodes, done] then B alone:
                 B waits while 6 blocks are not free (4, then 3 free), admitted at t=4.
    reserve off: B is admitted at t=1 with its first 2 tokens (they fit), and at t=2 it
                 cannot continue beside A's decode: it is preempted (recompute)."""
    w = Workload.from_requests([Request(0.0, 6, 3), Request(0.0, 6, 2)])
    limits = {"max_num_batched_tokens": 4, "max_num_seqs": 4}
    server, rec, _ = run(w, "vllm-v1", limits, kv_tokens=10, cost_params={"b": 1.0})
    assert [(b[2], b[4]) for b in server.batches] == [(4, 0), (2, 0), (0, 1), (0, 1), (4, 0), (2, 0), (0, 1)]
    assert rec.admitted.tolist() == [0.0, 4.0] and rec.preemptions.sum() == 0
    assert rec.finished.tolist() == pytest.approx([4.0, 7.0])
    server, rec, _ = run(w, "vllm-v1", {**limits, "reserve_full_prompt": False}, kv_tokens=10,
                         cost_params={"b": 1.0})
    assert rec.admitted.tolist() == [0.0, 1.0] and rec.preemptions.tolist() == [0, 1]


def test_lone_request_is_not_capped():
    """long_prefill_token_threshold 4: a lone 10-token prompt prefills in one batch (vLLM does
    not cap the only request); beside a second request the cap holds."""
    lone = Workload.from_requests([Request(0.0, 10, 2)])
    server, rec, _ = run(lone, "vllm-v1", {"long_prefill_token_threshold": 4}, cost_params={"b": 1.0})
    assert server.batches[0][2] == 10 and rec.first_token[0] == pytest.approx(1.0)
    pair = Workload.from_requests([Request(0.0, 10, 2), Request(0.0, 10, 2)])
    server, _, _ = run(pair, "vllm-v1", {"long_prefill_token_threshold": 4}, cost_params={"b": 1.0})
    assert server.batches[0][2] == 8 and server.batches[0][3] == 2      # 4 + 4


def test_orca_has_no_token_budget_by_default():
    """A 5,000-token prompt behind running decodes joins at once (no budget), where a budget of
    2048 would hold it until the decodes finish."""
    w = Workload.from_requests([Request(0.0, 100, 50), Request(0.5, 5000, 5)])
    _, rec, _ = run(w, "orca", {}, cost_params={"b": 0.1}, gpu="a30")
    assert rec.admitted[1] == pytest.approx(0.5)
    _, rec, _ = run(w, "orca", {"max_num_batched_tokens": 2048}, cost_params={"b": 0.1}, gpu="a30")
    assert rec.admitted[1] == pytest.approx(rec.finished[0])


def test_null_block_is_subtracted_from_derived_capacity():
    model, gpu = get_model("qwen2-7b"), get_gpu("a30")
    w = Workload.from_requests([Request(0.0, 10, 2)])
    for bs in (16, 1):
        g = kv_capacity_tokens(model, gpu, 0.9) // bs
        s = simulate(Scenario(w, model="qwen2-7b", gpu="a30", block_size=bs)).summary
        assert s["kv_capacity_tokens"] == (g - 1) * bs
    s = simulate(Scenario(w, kv_capacity=1000, block_size=16)).summary
    assert s["kv_capacity_tokens"] == 992                 # --kv-capacity is the usable capacity, in whole blocks
