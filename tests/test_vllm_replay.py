"""`kvsched replay --engine vllm`: vLLM's own v1 scheduler beside kvsched's vllm-v1, step by
step. Skipped when vLLM is not installed (.ci/run installs the CPU build)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from typer.testing import CliRunner  # noqa: E402

from kvsched.cli import app  # noqa: E402
from kvsched.engines.vllm_replay import Limits, replay  # noqa: E402
from kvsched.workload.source import WorkloadOptions, load  # noqa: E402


def workload(n=60, rate=50.0, prompt="uniform:10:300", output="uniform:1:60", seed=2):
    return load(WorkloadOptions(num_requests=n, rate=rate, prompt_len=prompt, output_len=output, seed=seed))


def v1(limits: Limits, **extra) -> dict:
    return {"max_num_batched_tokens": limits.max_num_batched_tokens, "max_num_seqs": limits.max_num_seqs,
            "long_prefill_token_threshold": limits.long_prefill_token_threshold, **extra}


@pytest.mark.parametrize("name,limits", [
    ("KV-tight, overloaded", Limits(256, 16, num_gpu_blocks=60, block_size=16)),
    ("chunked prefill", Limits(64, 32, long_prefill_token_threshold=48, num_gpu_blocks=2000)),
    ("max_num_seqs-bound", Limits(2048, 4, num_gpu_blocks=2000)),
])
def test_vllm_v1_agrees_with_vllm_on_every_step(name, limits):
    a = replay(workload(), "vllm-v1", v1(limits), limits, 0.01)
    assert a.steps > 100 and a.steps_differing == 0, a.first_difference
    assert a.preemptions["vllm"] == a.preemptions["kvsched"]
    if name.startswith("KV"):
        assert a.preemptions["vllm"] > 0                    # the KV-tight case does preempt
    assert a.first_token_step_diff["max"] == 0 and a.finish_step_diff["max"] == 0


def test_a_different_scheduler_is_reported():
    """Without the whole-prompt reservation kvsched's vllm-v1 is an older vLLM: it must differ."""
    limits = Limits(256, 16, num_gpu_blocks=60, block_size=16)
    a = replay(workload(), "vllm-v1", v1(limits, reserve_full_prompt=False), limits, 0.01)
    assert a.steps_differing > 0 and a.first_difference["differs_in"] == ["tokens"]
    assert a.preemptions["kvsched"] > a.preemptions["vllm"]


def test_replay_cli_json_and_out(tmp_path):
    args = ["replay", "--engine", "vllm", "--num-requests", "30", "--rate", "40", "--prompt-len", "uniform:10:200",
            "--output-len", "uniform:1:30", "--kv-capacity", "944", "--max-num-batched-tokens", "128",
            "--max-num-seqs", "8"]
    r = CliRunner().invoke(app, [*args, "--json", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["steps_differing"] == 0 and out["engine"].startswith("vllm 0.32")
    assert (tmp_path / "r" / "steps.csv").read_text().count("\n") == out["steps"] + 1
    r = CliRunner().invoke(app, [*args, "--engine", "sglang"])
    assert r.exit_code == 2 and "only vllm" in r.output


@pytest.mark.parametrize("policy,params", [
    ("vllm-v1", {}), ("eb", {}), ("eb-adaptive", {}), ("eb-plus", {}), ("sarathi", {"chunk_size": 128}),
    ("vllm-v0", {}), ("orca", {}), ("rad", {}), ("slai", {}), ("wait", {}), ("nested-wait", {"bin_width": 20, "bins": 3}),
])
def test_kvsched_policy_inside_vllms_scheduler(policy, params, monkeypatch):
    """The adapter (engines/vllm_scheduler.py) inside vLLM's own scheduler, on the replay's
    clock: vllm-v1 passes through to vLLM's batches, and every other policy makes the batches
    it makes in simulation (KV-tight: EB and RAD preempt). The cost-driven ones (EB(k*), EB+,
    WAIT) read the batch-time model from KVSCHED_COST."""
    from kvsched.engines.vllm_replay import compare, kvsched_steps, vllm_steps
    from kvsched.engines.vllm_scheduler import KvschedScheduler
    limits = Limits(1024, 64, num_gpu_blocks=200, block_size=16)
    monkeypatch.setenv("KVSCHED_POLICY", policy)
    monkeypatch.setenv("KVSCHED_POLICY_PARAMS", json.dumps(params))
    monkeypatch.setenv("KVSCHED_COST", "constant")
    monkeypatch.setenv("KVSCHED_COST_PARAMS", '{"b": 0.01}')
    w = load(WorkloadOptions(num_requests=80, rate=50.0, prompt_len="uniform:10:300", output_len="uniform:1:60", seed=2,
                             output_known=policy == "wait"))
    inside = vllm_steps(w, limits, 0.01, scheduler_cls=KvschedScheduler)
    reference = vllm_steps(w, limits, 0.01) if policy == "vllm-v1" else kvsched_steps(w, policy, params, limits, 0.01)
    a = compare(inside, reference, w.prompt)
    assert a.steps > 100 and a.steps_differing == 0, a.first_difference
    if policy in ("eb", "rad"):
        assert a.preemptions["vllm"] > 0


def test_a_policy_needing_a_cost_model_says_so(monkeypatch):
    from kvsched.engines.vllm_replay import vllm_steps
    from kvsched.engines.vllm_scheduler import KvschedScheduler
    from kvsched.errors import KvschedError
    monkeypatch.setenv("KVSCHED_POLICY", "eb-adaptive")
    monkeypatch.setenv("KVSCHED_POLICY_PARAMS", '{"min_samples": 2, "update_every": 1}')
    monkeypatch.delenv("KVSCHED_COST", raising=False)
    with pytest.raises(KvschedError, match="KVSCHED_COST"):
        vllm_steps(workload(), Limits(256, 16, num_gpu_blocks=2000), 0.01, scheduler_cls=KvschedScheduler)
