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


def workload(n=60, rate=50.0, prompt="uniform:10:300", output="uniform:1:60", seed=2, shared=None):
    return load(WorkloadOptions(num_requests=n, rate=rate, prompt_len=prompt, output_len=output, seed=seed,
                                shared_prefix=shared))


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


def shared_prefix_workload(n=80, rate=40.0, seed=0):
    """Requests starting with 0-2 shared segments (4 contents, several lengths), then own tokens."""
    import numpy as np

    from kvsched.workload.request import Ragged, Segments, Workload
    rng = np.random.default_rng(seed)
    segs = [[(int(rng.integers(0, 4)), int(rng.choice([16, 40, 100, 200, 300]))) for _ in range(rng.integers(0, 3))]
            for _ in range(n)]
    off = np.concatenate(([0], np.cumsum([len(s) for s in segs]))).astype(np.int64)
    seg = Segments(Ragged(np.array([a for s in segs for a, _ in s], np.int64), off),
                   Ragged(np.array([b for s in segs for _, b in s], np.int64), off))
    prompt = [sum(x for _, x in s) + int(rng.integers(1, 150)) for s in segs]
    return Workload.build(np.cumsum(rng.exponential(1 / rate, n)), prompt, rng.integers(1, 80, n), segments=seg)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("limits", [
    Limits(256, 16, num_gpu_blocks=60, prefix_caching=True),                       # KV-tight: evictions, preemptions
    Limits(512, 32, num_gpu_blocks=120, long_prefill_token_threshold=100, prefix_caching=True),
    Limits(2048, 64, num_gpu_blocks=300, prefix_caching=True),
])
def test_vllm_v1_agrees_with_vllm_with_prefix_caching(seed, limits):
    a = replay(shared_prefix_workload(seed=seed), "vllm-v1", v1(limits), limits, 0.01)
    assert a.steps > 100 and a.steps_differing == 0, a.first_difference
    assert a.first_token_step_diff["max"] == 0 and a.finish_step_diff["max"] == 0


def test_prefix_hits_are_compared_and_found():
    from kvsched.engines.vllm_replay import kvsched_steps, vllm_steps
    limits = Limits(256, 16, num_gpu_blocks=60, prefix_caching=True)
    w = shared_prefix_workload()
    a, b = vllm_steps(w, limits, 0.01), kvsched_steps(w, "vllm-v1", v1(limits), limits, 0.01)
    hits = sum(sum(s.hits.values()) for s in a)
    assert hits > 2000 and hits == sum(sum(s.hits.values()) for s in b)
    assert sum(len(s.preempted) for s in a) > 0
    # with caching off on vLLM's side only, the steps differ
    off = Limits(256, 16, num_gpu_blocks=60, prefix_caching=False)
    from kvsched.engines.vllm_replay import compare
    assert compare(vllm_steps(w, off, 0.01), b, w.prompt).steps_differing > 0


def offloading_workload(n: int):
    return load(WorkloadOptions(num_requests=n, rate=20.0, prompt_len="uniform:100:400", output_len="uniform:10:60",
                                shared_prefix="192:0.3,160:0.3,128:0.3"))


def test_replay_with_vllms_offloading_connector():
    """vLLM's OffloadingConnector (its scheduler half, a stand-in worker) beside kvsched's host
    tier written through (docs/kv-tiers.md): on this 40-request KV-tight workload every step
    agrees, the prefix hits loaded from the CPU tier included; the schedule is not the one
    without offloading (the loads change it)."""
    from kvsched.engines.vllm_replay import compare, kvsched_steps, vllm_steps
    w = offloading_workload(40)
    runs = {}
    for gib in (0.0, 0.01):
        limits = Limits(2048, 256, num_gpu_blocks=129, block_size=16, prefix_caching=True, kv_offloading_gib=gib)
        a, b = vllm_steps(w, limits, 0.01), kvsched_steps(w, "vllm-v1", v1(limits), limits, 0.01)
        agreement = compare(a, b, w.prompt)
        assert agreement.steps > 250 and agreement.steps_differing == 0, agreement.first_difference
        runs[gib] = [(s.time, s.tokens, s.hits) for s in a]
    assert runs[0.01] != runs[0.0]


@pytest.mark.parametrize("n, seed, gib, cap", [(150, 0, 0.01, 0), (500, 0, 0.01, 0), (300, 2, 0.005, 0),
                                              (40, 0, 0.01, 64), (150, 0, 0.001, 0)])
def test_replay_with_offloading_agrees_on_a_longer_run(n, seed, gib, cap):
    """Longer runs, smaller CPU tiers and a long-prefill cap (preemptions; loads of prefixes the
    batch's own allocations evicted; a load that does not fit ending the admissions; loads
    sparing the prefixes of admissions ahead; a finished request's blocks refreshed in the
    tier) agree on every step."""
    from kvsched.engines.vllm_replay import compare, kvsched_steps, vllm_steps
    w = load(WorkloadOptions(num_requests=n, rate=20.0, prompt_len="uniform:100:400", output_len="uniform:10:60",
                             shared_prefix="192:0.3,160:0.3,128:0.3", seed=seed))
    limits = Limits(2048, 256, long_prefill_token_threshold=cap, num_gpu_blocks=129, block_size=16,
                    prefix_caching=True, kv_offloading_gib=gib)
    agreement = compare(vllm_steps(w, limits, 0.01), kvsched_steps(w, "vllm-v1", v1(limits), limits, 0.01), w.prompt)
    assert agreement.steps > 250 and agreement.steps_differing == 0, agreement.first_difference


def test_offloading_needs_the_prefix_cache():
    with pytest.raises(Exception, match="needs --prefix-caching on"):
        replay(offloading_workload(5), "vllm-v1", {}, Limits(2048, 256, num_gpu_blocks=129, kv_offloading_gib=0.01),
               0.01)


@pytest.mark.parametrize("name,limits,w", [
    ("KV-tight, overloaded", Limits(256, 16, num_gpu_blocks=60, block_size=16, spec="ngram:3",
                                    spec_acceptance="0.7"), dict(n=200, seed=1)),
    ("n-gram misses, per-position rates", Limits(256, 16, num_gpu_blocks=60, block_size=16, spec="ngram:3",
                                                 spec_acceptance="0.9,0.5,0.3", spec_proposal_rate=0.6,
                                                 spec_seed=4), dict(n=120, seed=2)),
    ("budget cuts the drafts", Limits(24, 16, num_gpu_blocks=400, spec="ngram:3", spec_acceptance="0.7"),
     dict(n=80, prompt="uniform:2:40")),
    ("prefix caching on", Limits(256, 16, num_gpu_blocks=60, prefix_caching=True, spec="ngram:3",
                                 spec_acceptance="0.8"), dict(n=120, seed=3)),
    ("long-prefill cap, cut drafts, KV-tight", Limits(16, 16, long_prefill_token_threshold=8, num_gpu_blocks=40,
                                                      block_size=4, spec="ngram:5", spec_acceptance="0.7",
                                                      spec_seed=1), dict(prompt="uniform:2:17", output="uniform:20:80")),
    ("max_model_len caps the drafts", Limits(512, 16, num_gpu_blocks=1250, max_model_len=310, spec="ngram:5",
                                             spec_acceptance="0.9"),
     dict(n=20, prompt="uniform:250:250", output="uniform:60:60")),
    ("padded admissions evict cached blocks", Limits(24, 4, 48, 4, 20, 8192, True, 0.0, "ngram:6", "0.5", 0.8, 672),
     dict(prompt="uniform:2:17", output="uniform:1:40", seed=672)),
    ("no padding past max_model_len", Limits(64, 8, num_gpu_blocks=60, max_model_len=20, prefix_caching=True,
                                             spec="ngram:4", spec_acceptance="0.5"),
     dict(n=40, rate=20.0, prompt="fixed:1", output="fixed:3", seed=1, shared="16:1.0")),
    ("max_model_len spares the last step's slots", Limits(256, 4, num_gpu_blocks=9, max_model_len=129, spec="ngram:3",
                                                          spec_acceptance="0.7"),
     dict(n=4, rate=30.0, prompt="fixed:100", output="fixed:29")),
])
def test_speculative_vllm_v1_agrees_with_vllm_on_every_step(name, limits, w):
    """n-gram speculation (vLLM's speculative_config), k = 3: both sides get the same drafts and
    acceptances (kvsched's keyed draws, fed through vLLM's update_draft_token_ids and sampled
    tokens); the drafts count in the budget, rejected slots stay held, and the steps agree."""
    a = replay(workload(**w), "vllm-v1", v1(limits), limits, 0.01)
    assert a.steps > 30 and a.steps_differing == 0, a.first_difference
    assert a.preemptions["vllm"] == a.preemptions["kvsched"]
    if name.startswith("KV") or name.startswith("padded"):
        assert a.preemptions["vllm"] > 0
    multi = [r for r in a.rows if r["tokens_vllm"] > r["requests_vllm"] and r["requests_vllm"] > 1]
    if w.get("n", 60) >= 60:                                # (the max_model_len cases are short: a few)
        assert len(multi) > a.steps // 3                    # verify steps: more tokens than requests
    assert a.first_token_step_diff["max"] == 0 and a.finish_step_diff["max"] == 0


def test_speculation_outside_the_budget_is_reported():
    """kvsched's vllm-v1 leaving the drafts out of the budget it admits with must differ."""
    from kvsched.policies.baselines import VllmV1
    limits = Limits(24, 16, num_gpu_blocks=400, spec="ngram:3", spec_acceptance="0.7")
    real = VllmV1._running_spec

    def lax(self, v, *args):
        victims, chunks, decode, free, budget, cut = real(self, v, *args)
        stepped = [i for i in v.decoding if i not in victims] if decode is True else list(decode or ())
        return victims, chunks, decode, free, budget + sum(v.spec_tokens(i) for i in stepped), cut
    try:
        VllmV1._running_spec = lax
        a = replay(workload(n=80, prompt="uniform:2:40"), "vllm-v1", v1(limits), limits, 0.01)
    finally:
        VllmV1._running_spec = real
    assert a.steps_differing > 0 and a.first_difference["differs_in"] == ["tokens"]


def test_replay_cli_spec():
    args = ["replay", "--engine", "vllm", "--num-requests", "30", "--rate", "40", "--prompt-len", "uniform:10:200",
            "--output-len", "uniform:1:30", "--kv-capacity", "944", "--max-num-batched-tokens", "128",
            "--max-num-seqs", "8", "--prefix-caching", "off"]
    r = CliRunner().invoke(app, [*args, "--spec", "ngram:3", "--spec-acceptance", "0.7", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["steps_differing"] == 0 and out["spec"] == "ngram:3"
    for extra, msg in ((["--spec", "eagle:3", "--spec-acceptance", "0.7"], "n-gram speculation only"),
                       (["--spec-acceptance", "0.7"], "need --spec ngram:k")):
        r = CliRunner().invoke(app, [*args, *extra])
        assert r.exit_code == 2 and msg in r.output, r.output
