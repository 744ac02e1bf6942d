"""Invariants over random workloads, policies, block sizes and capacities (hypothesis)."""
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from kvsched.policies import POLICIES
from kvsched.workload import Workload

from conftest import run

POLICY_PARAMS = {
    "vllm-v1": {"max_num_batched_tokens": 64, "max_num_seqs": 8},
    "sarathi": {"chunk_size": 32, "max_num_seqs": 8},
    "vllm-v0": {"max_num_batched_tokens": 64, "max_num_seqs": 8},
    "orca": {"max_num_batched_tokens": 64, "max_num_seqs": 8},
    "request-level": {"b": 4},
    "eb": {"max_num_batched_tokens": 64, "max_num_seqs": 8, "k": 3, "kv_gate": True},
    "eb-adaptive": {"max_num_batched_tokens": 64, "max_num_seqs": 8, "window": 20, "update_every": 3,
                    "min_samples": 3},
    "eb-plus": {"max_num_batched_tokens": 64, "max_num_seqs": 8, "window": 20, "update_every": 3,
                "min_samples": 3, "evaluate_every": 2, "min_occupancy": 0, "cooldown": 0},
    "wait": {"resolve_every": 5},
    "nested-wait": {"segments": "3,10,30", "resolve_every": 3},
    "rad": {"t_col": 4, "t_lcm": 16, "n": 6},
    "slai": {"token_budget": 32, "max_num_seqs": 8, "max_decodes": 6},
    "distserve": {},
}
NOT_FCFS = {"wait", "slai"}         # WAIT admits by type, SLAI shortest prompt first
DISAGG_ONLY = {"distserve"}         # runs on prefill/decode pools only


@st.composite
def scenarios(draw, disagg_ok: bool = False):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.floats(0, 2.0), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 120), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    block = draw(st.sampled_from([1, 2, 4, 16]))
    need = max(p + o - 1 for p, o in zip(prompt, output))
    min_blocks = -(-need // block)
    kv = block * draw(st.integers(min_blocks, min_blocks * 6))
    policy = draw(st.sampled_from(sorted(set(POLICIES) - (set() if disagg_ok else DISAGG_ONLY))))
    cost = draw(st.sampled_from(["constant", "linear"]))
    w = Workload.build(np.cumsum(gaps), prompt, output, output_known=policy == "wait")
    return w, policy, block, kv, cost, draw(st.sampled_from([0, 16]))


def params(policy: str, cap: int) -> dict:
    """The policy's small limits; vllm-v1 sometimes with a per-request chunk cap."""
    extra = {"long_prefill_token_threshold": cap} if policy == "vllm-v1" and cap else {}
    return {**POLICY_PARAMS[policy], **extra}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants(sc):
    w, policy, block, kv, cost, cap = sc
    server, rec, checked = run(w, policy, params(policy, cap), cost=cost, kv_tokens=kv, block_size=block)
    cap = server.kv.capacity_blocks * block
    # KV use never exceeds capacity (checked per step by Checked, and per batch here)
    assert all(b[5] <= cap for b in server.batches)
    # every request finishes, each with exactly its output tokens (Checked.on_finish)
    assert np.isfinite(rec.finished).all() and sorted(checked.finished) == list(range(len(w)))
    assert (rec.first_token <= rec.finished).all() and (rec.arrival <= rec.admitted).all()
    # prefill tokens computed = prompt tokens + tokens recomputed after preemption
    assert sum(b[2] for b in server.batches) == int(w.prompt.sum() + rec.recomputed.sum())
    # every decode step is one output token; prefill completions give the rest
    decode_tokens = sum(b[4] for b in server.batches)
    assert decode_tokens <= int((w.output - 1).sum())
    assert server.kv.used == 0


@settings(deadline=None)
@given(scenarios())
def test_fcfs_start_order_with_ample_memory(sc):
    w, policy, block, _, cost, cap = sc
    kv = int((w.prompt + w.output).sum()) + 16 * len(w) + 16
    _, rec, checked = run(w, policy, params(policy, cap), cost=cost, kv_tokens=kv, block_size=block)
    assert rec.preemptions.sum() == 0
    if policy not in NOT_FCFS:
        assert checked.admission_order == list(range(len(w)))


@settings(deadline=None, max_examples=30)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_deterministic(sc, seed):
    w, policy, block, kv, cost, cap = sc
    a = run(w, policy, params(policy, cap), cost=cost, kv_tokens=kv, block_size=block)[1]
    b = run(w, policy, params(policy, cap), cost=cost, kv_tokens=kv, block_size=block)[1]
    assert a.finished.tobytes() == b.finished.tobytes()
    assert a.first_token.tobytes() == b.first_token.tobytes()
