"""Speculative decoding on the replica (sim/spec_decode.py, docs/speculative-decoding.md): verify
steps, KV lookahead slots, the budget, the cost, the metrics, per-tier acceptance, adaptive k,
composition with every policy (EB and SLAI included), and bad input."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost.shape import BatchShape
from kvsched.cost.spec_cost import SpecCost, capacity_with_drafter, head_model
from kvsched.errors import KvschedError, PlanError
from kvsched.hardware import get_gpu, get_model
from kvsched.policies import make_policy
from kvsched.policies.base import Plan
from kvsched.run import Scenario, simulate
from kvsched.sim.batch import verify_shape
from kvsched.sim.spec_acceptance import geometric_tokens
from kvsched.sim.spec_decode import keyed_uniforms, parse_schedule, spec_config
from kvsched.workload import Tier, Workload

GPU = get_gpu("a100-80gb")


def one(prompt=32, output=10) -> Workload:
    return Workload.build([0.0], [prompt], [output])


def scenario(w, spec="ngram:3", acc="1.0", kv=4096, block=16, **kw) -> Scenario:
    return Scenario(w, model="llama-3-8b", gpu="a100-80gb", cost="constant", kv_capacity=kv, block_size=block,
                    client=None, prefix_caching=False, spec=spec, spec_acceptance=acc if spec else "", **kw)


# ----- hand-worked steps ---------------------------------------------------------------------------
def test_all_accepted_emits_k_plus_one_tokens_a_step_cut_at_the_output_length():
    """Prompt 32, output 10, ngram:3 with every draft accepted: the prefill gives token 1, then
    steps of 4 tokens (5, 9) and a last one cut to 1 (10): 4 batches; TPOT = 3 steps / 9 tokens."""
    r = simulate(scenario(one()), "vllm-v1", record_batches=True)
    assert r.summary["iterations"] == 4
    dt = r.batches[0][1]
    assert r.records.finished[0] == pytest.approx(4 * dt)
    assert r.summary["mean_tpot_ms"] == pytest.approx(3 * dt / 9 * 1e3)
    assert r.summary["spec_verify_steps"] == 3 and r.summary["spec_draft_tokens"] == 9
    assert r.summary["spec_accepted_tokens"] == 9 and r.summary["spec_tokens_per_step"] == 4
    assert r.summary["spec_acceptance_rate"] == 1.0


def test_none_accepted_decodes_one_token_a_step_and_holds_the_lookahead_slots():
    """alpha 0: one token a step, as without speculation, but each step allocates slots for
    kv + 1 + 3 (vLLM's allocate_slots for 1 + s tokens) and keeps them: at KV 32 the request
    holds 3 blocks of 16 where its tokens fill 2 and a bit."""
    plain = simulate(scenario(one(), spec=""), "vllm-v1", record_batches=True)
    r = simulate(scenario(one(), acc="0"), "vllm-v1", record_batches=True)
    assert r.summary["iterations"] == plain.summary["iterations"] == 10
    assert r.records.finished.tobytes() == plain.records.finished.tobytes()
    held = [b[5] for b in r.batches]        # KV tokens held (blocks x 16) after each batch's allocation
    assert held[:2] == [32, 48] and max(held) == 48
    assert [b[5] for b in plain.batches][:2] == [32, 48]    # plain: 33 tokens need the 3rd block too
    assert r.summary["spec_acceptance_rate"] == 0.0 and r.summary["spec_tokens_per_step"] == 1.0


def test_held_blocks_run_ahead_of_the_kv_and_are_freed_with_the_request():
    """Prompt 16: after the prefill 16 KV tokens; a step of 3 drafts reserves slots to 20 (2
    blocks) where plain decoding stays in block 2 from token 17; with EAGLE's lookahead of 3, to
    23. Everything is freed at the end (the server's KV back to 0)."""
    for spec, want in (("ngram:3", 32), ("eagle:3", 32)):
        r = simulate(scenario(one(prompt=16, output=3), spec=spec, acc="0"), "vllm-v1", record_batches=True)
        assert r.batches[1][5] == want
    r = simulate(scenario(one(prompt=28, output=3), spec="eagle:3", acc="0"), "vllm-v1", record_batches=True)
    assert r.batches[1][5] == 48                # 28 + 1 + 3 + 3 = 35 slots: 3 blocks
    r = simulate(scenario(one(prompt=28, output=3), spec="ngram:3", acc="0"), "vllm-v1", record_batches=True)
    assert r.batches[1][5] == 32                # 28 + 1 + 3 = 32 slots: 2 blocks


def wrapped(edit, params: dict | None = None):
    """vllm-v1 (with `params`) whose plans pass through edit(view, plan) -> plan."""
    class Wrapped:
        name = "wrapped"

        def __init__(self) -> None:
            self.inner = make_policy("vllm-v1", params or {}, GPU)

        def schedule(self, v):
            return edit(v, self.inner.schedule(v))
    return Wrapped()


def test_plan_spec_zero_verifies_no_drafts():
    """A policy that caps every step at 0 drafts (Plan.spec = 0) decodes a token a step; an
    adaptive schedule of k = 0 at every batch size runs what plain vllm-v1 runs, bit for bit
    (n-gram: no drafter cost, no lookahead)."""
    no_drafts = wrapped(lambda v, p: Plan(p.admit, p.chunks, p.decode, p.preempt, None, 0),
                        {"max_num_batched_tokens": 256, "max_num_seqs": 8})
    rng = np.random.default_rng(3)
    w = Workload.build(np.sort(rng.uniform(0, 2, 40)), rng.integers(10, 200, 40), rng.integers(1, 80, 40))
    s = simulate(scenario(w, kv=1024, acc="0.8"), no_drafts).summary
    assert s["completed"] == 40 and s["spec_draft_tokens"] == 0 and s["spec_verify_steps"] == 0
    params = {"max_num_batched_tokens": 256, "max_num_seqs": 8}
    a = simulate(scenario(w, kv=1024, acc="0.8", spec_adaptive="1-10000:0"), "vllm-v1", params).records
    b = simulate(scenario(w, kv=1024, spec=""), "vllm-v1", params).records
    assert a.finished.tobytes() == b.finished.tobytes() and a.preemptions.tobytes() == b.preemptions.tobytes()


@pytest.mark.parametrize("bad, msg", [
    (-1, "must be >= 0"), (True, "whole number or a mapping"), ("3", "whole number or a mapping"),
    ({0: -2}, "whole number >= 0"), ({99: 1}, "neither decodes nor is admitted"),
])
def test_bad_plan_spec_is_the_policys_error(bad, msg):
    policy = wrapped(lambda v, p: Plan(p.admit, p.chunks, p.decode, p.preempt, None, bad if v.num_decoding else None))
    with pytest.raises(PlanError, match=msg):
        simulate(scenario(one(output=5)), policy)


def watching(read):
    """vllm-v1 recording read(view, i) of every decoder i at every schedule: (policy, records)."""
    seen: list = []

    def edit(v, plan):
        seen.extend(read(v, i) for i in v.decoding)
        return plan
    return wrapped(edit), seen


def test_view_shows_method_k_drafts_and_acceptance():
    look, seen = watching(lambda v, i: (v.spec_method, v.spec_k, v.spec_tokens(i), v.spec_acceptance(i),
                                        v.decode_tokens, v.needs_block(i), v.kv_blocks(i)))
    simulate(scenario(one(prompt=28, output=6), spec="eagle:3", acc="0"), look)
    assert seen[0][:5] == ("eagle", 3, 3, None, 4)
    assert seen[0][5] == 1 and seen[0][6] == 2          # 29 tokens in 2 blocks; 28+1+3+3 needs a 3rd
    assert seen[1][3] == 0.0 and seen[1][5] == 0 and seen[1][6] == 3     # holds 3 now, needs none


# ----- the acceptance model through the simulator ---------------------------------------------------
@pytest.mark.parametrize("alpha, k", [(0.6, 2), (0.6, 4), (0.8, 2), (0.8, 4)])
def test_simulated_tokens_per_verify_step_match_the_closed_form(alpha, k):
    """Over >= 100,000 verify steps of a run, the mean tokens per step (1 + accepted / drafts) is
    within 1% of (1 - alpha^(k+1)) / (1 - alpha)."""
    n = 60
    w = Workload.build(np.zeros(n), [16] * n, [6000] * n)
    s = simulate(scenario(w, spec=f"ngram:{k}", acc=str(alpha), kv=1 << 20, spec_seed=11), "vllm-v1").summary
    assert s["spec_verify_steps"] >= 100_000
    assert s["spec_tokens_per_step"] == pytest.approx(geometric_tokens(alpha, k), rel=0.01)
    assert s["spec_acceptance_rate"] == pytest.approx((geometric_tokens(alpha, k) - 1) / k, rel=0.015)


def test_per_tier_acceptance():
    """Tier `code` accepts every draft, tier `chat` none: code requests finish in a quarter of
    the steps (ngram:3), chat ones decode a token a step."""
    tiers = (Tier("code"), Tier("chat"))
    w = Workload.build(np.zeros(4), [16] * 4, [41] * 4, tiers=tiers, tier_index=[0, 1, 0, 1])
    r = simulate(scenario(w, acc="0.5;code=1;chat=0"), "vllm-v1")
    f = r.records.finished
    assert f[0] == f[2] < f[1] == f[3]
    assert r.summary["spec_accepted_tokens"] == 2 * 30     # code: 10 steps of 3 drafts and the bonus token
    with pytest.raises(KvschedError, match="no tier 'math'"):
        simulate(scenario(w, acc="0.5;math=1"), "vllm-v1")
    with pytest.raises(KvschedError, match="no rate for chat"):
        simulate(scenario(w, acc="code=1"), "vllm-v1")
    untiered = Workload.build(np.zeros(3), [16] * 3, [41] * 3, tiers=tiers, tier_index=[0, 1, -1])
    with pytest.raises(KvschedError, match="no rate for requests of no tier"):
        simulate(scenario(untiered, acc="code=1;chat=0"), "vllm-v1")


def test_proposal_rate_and_keyed_draws():
    """A share of n-gram lookups find drafts; the draws are a function of (seed, request, step):
    the same for a request whatever else runs, different with another seed."""
    w = Workload.build(np.zeros(30), [16] * 30, [400] * 30)
    s = simulate(scenario(w, acc="0.7", spec_proposal_rate=0.3), "vllm-v1").summary
    steps_with_drafts = s["spec_verify_steps"]
    total_decode_steps = s["spec_verify_steps"] + (30 * 399 - s["spec_verify_steps"] - s["spec_accepted_tokens"])
    assert steps_with_drafts / total_decode_steps == pytest.approx(0.3, abs=0.02)
    u = keyed_uniforms(7, [1, 2, 3], [5, 5, 5], 4)
    assert np.array_equal(u[1], keyed_uniforms(7, [2], [5], 4)[0])
    assert not np.array_equal(u, keyed_uniforms(8, [1, 2, 3], [5, 5, 5], 4))
    assert ((0 <= u) & (u < 1)).all()


def test_deterministic_and_seeded():
    rng = np.random.default_rng(1)
    w = Workload.build(np.sort(rng.uniform(0, 2, 50)), rng.integers(10, 300, 50), rng.integers(1, 100, 50))
    a, b = (simulate(scenario(w, spec="eagle:3", acc="0.7", kv=2048), "vllm-v1").records for _ in range(2))
    assert a.finished.tobytes() == b.finished.tobytes()
    c = simulate(scenario(w, spec="eagle:3", acc="0.7", kv=2048, spec_seed=1), "vllm-v1").records
    assert a.finished.tobytes() != c.finished.tobytes()


# ----- the budget --------------------------------------------------------------------------------
def test_drafts_count_in_the_token_budget():
    """Budget 10, four decoders (prompts of 2, all admitted at once) with 3 drafts each (ngram:3): the first two take 4 + 4, the third
    the 2 left (1 token and 1 draft), the fourth none: vLLM's running loop (scheduler.py)."""
    seen = []

    def record(v, p):
        if v.num_decoding == 4 and not seen:
            seen.append((sorted(p.decode) if p.decode is not True else True, p.spec))
        return p
    w = Workload.build(np.zeros(4), [2] * 4, [30] * 4)
    simulate(scenario(w, acc="0.5"), wrapped(record, {"max_num_batched_tokens": 10, "max_num_seqs": 8}))
    assert seen == [([0, 1, 2], {2: 1})]


# ----- cost ---------------------------------------------------------------------------------------
def test_verify_chunks_and_the_drafter_cost():
    shape = BatchShape(10, 1, 55.0, 10, 3, 303)
    v = verify_shape(shape, [(100, 4), (200, 2)])
    assert (v.prefill_tokens, v.prefill_seqs, v.decode_seqs) == (16, 3, 1)
    assert v.prefill_attn == 55 + 4 * (100 + 2.5) + 2 * (200 + 1.5)
    assert v.prefill_ctx == 10 + 104 + 202 and v.decode_ctx == 303 - 300 - 2
    assert v.tokens == shape.tokens + 4 and v.chunks == [(100, 4), (200, 2)]

    class Flat:
        def time(self, s):
            return 1.0 + s.tokens

    class K:
        k_now = 3
    assert SpecCost(Flat(), Flat(), K()).time(shape) == (1 + 13) + (1 + 13) + 2 * (1 + 4)
    assert SpecCost(Flat(), None, K()).time(shape) == 14
    m = get_model("llama-3.1-8b")
    h = head_model(m)
    assert h.layers == 1 and h.embedding_params == m.vocab * m.hidden
    assert h.params == pytest.approx(m.vocab * m.hidden + (m.params - m.embedding_params) / m.layers)
    assert h.kv_bytes_per_token * m.layers == m.kv_bytes_per_token
    assert capacity_with_drafter(1000, 16, m, None) == 1000
    assert capacity_with_drafter(100_000, 16, m, h) < 100_000 * m.layers / (m.layers + 1)


def test_eagle_pays_at_low_load_and_stops_paying_at_high_load():
    """The roofline: eagle:3 at alpha 0.7 lowers the median TPOT of a lightly loaded replica and
    raises it where the batch is large (its verify tokens make the step compute-bound)."""
    def tpot(rate, spec):
        rng = np.random.default_rng(0)
        n = 300
        w = Workload.build(np.cumsum(rng.exponential(1 / rate, n)), rng.integers(100, 400, n),
                           rng.integers(50, 300, n))
        sc = Scenario(w, model="llama-3.1-8b", gpu="a100-80gb", client=None, spec=spec,
                      spec_acceptance="0.7" if spec else "")
        return simulate(sc, "vllm-v1").summary["median_tpot_ms"]
    assert tpot(1, "eagle:3") < 0.7 * tpot(1, "")
    assert tpot(40, "eagle:3") > tpot(40, "")


# ----- adaptive k ---------------------------------------------------------------------------------
def test_adaptive_k_follows_the_batch_size():
    cfg = spec_config("eagle:4", "0.7", adaptive="1-2:4,3-8:2,20-30:1")
    assert [cfg.k_for(b) for b in (1, 2, 3, 8, 9, 19, 20, 30, 31, 500)] == [4, 4, 2, 2, 2, 2, 1, 1, 1, 1]
    assert parse_schedule("1-4:9")[0] == (1, 4, 9) and spec_config("eagle:4", "0.7", adaptive="1-4:9").k_for(2) == 4
    w = Workload.build(np.zeros(40), [16] * 40, np.arange(40) * 10 + 10)
    on = simulate(scenario(w, acc="0.7", kv=1 << 16, spec_adaptive="1-8:3,9-1000:0"), "vllm-v1").summary
    off = simulate(scenario(w, acc="0.7", kv=1 << 16), "vllm-v1").summary
    assert 0 < on["spec_draft_tokens"] < off["spec_draft_tokens"]    # drafts only once <= 8 run
    assert on["spec_adaptive"] == [[1, 8, 3], [9, 1000, 0]]


# ----- composition: every policy, invariants on ---------------------------------------------------
POLICIES = ["vllm-v1", "vllm-v0", "sarathi", "orca", "request-level", "eb", "eb-adaptive", "eb-plus", "wait",
            "nested-wait", "rad", "slai"]
PARAMS = {"nested-wait": {"segments": "60,240,1000"}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(POLICIES),
       spec=st.sampled_from(["ngram:3", "eagle:3", "mtp:1", "draft:2"]), block=st.sampled_from([4, 16]),
       cache=st.booleans(), adaptive=st.sampled_from(["", "1-3:2,4-64:0"]))
def test_invariants_hold_with_speculation(seed, policy, spec, block, cache, adaptive, monkeypatch):
    """Blocks conserved (held lookahead slots included), KV within capacity, every request
    finished with its output length or counted rejected (KVSCHED_CHECK=1, sim/invariants.py),
    for every single-pool policy, EB's decode-only phases and SLAI's deferrals among them, on
    KV-tight workloads."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    rng = np.random.default_rng(seed)
    n = 30
    w = Workload.build(np.sort(rng.uniform(0, 3, n)), rng.integers(2, 300, n), rng.integers(1, 120, n),
                       output_known=True)
    sc = Scenario(w, model="llama-3-8b", gpu="a100-80gb", kv_capacity=1024, block_size=block, client=None,
                  prefix_caching=cache if policy in ("vllm-v1", "sarathi", "vllm-v0") else None, spec=spec,
                  spec_acceptance="0.7", spec_adaptive=adaptive, spec_seed=seed,
                  spec_draft_model="qwen3-0.6b" if spec.startswith("draft") else None,
                  spec_proposal_rate=0.6 if spec.startswith("ngram") else 1.0)
    r = simulate(sc, policy, PARAMS.get(policy), record_batches=True)
    s = r.summary
    assert s["completed"] + s.get("rejected", 0) == n
    assert all(b[5] <= 1024 for b in r.batches)
    done = np.isfinite(r.records.finished)
    assert s["spec_draft_tokens"] >= s["spec_accepted_tokens"] >= 0 and done.sum() == s["completed"]


def test_disaggregated_decode_pool_speculates():
    rng = np.random.default_rng(2)
    w = Workload.build(np.sort(rng.uniform(0, 2, 40)), rng.integers(10, 300, 40), rng.integers(2, 100, 40))
    sc = dataclasses.replace(scenario(w, spec="eagle:2", acc="0.8", kv=2048), prefill_replicas=1, decode_replicas=2)
    s = simulate(sc, "vllm-v1").summary
    assert s["completed"] == 40 and s["spec_verify_steps"] > 0


# ----- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({"spec": "medusa:3"}, "unknown method 'medusa'"),
    ({"spec": "eagle"}, "must be METHOD:k"),
    ({"spec": "eagle:0"}, "k must be a whole number from 1 to 64"),
    ({"spec": "eagle:x"}, "k must be a whole number"),
    ({"spec": "ngram:\u00b3"}, "k must be a whole number"),
    ({"spec": "ngram:\u0663"}, "k must be a whole number"),
    ({"spec": "eagle:3", "spec_acceptance": ""}, "needs --spec-acceptance"),
    ({"spec": "eagle:3", "spec_acceptance": "1.5"}, "each rate must be in \\[0, 1\\]"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5,0.5"}, "one rate or one per speculative token"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5;0.6"}, "the default given twice"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_proposal_rate": 0.5}, "needs --spec ngram:k"),
    ({"spec": "ngram:3", "spec_acceptance": "0.5", "spec_proposal_rate": 1.5}, "must be in \\[0, 1\\]"),
    ({"spec": "draft:3", "spec_acceptance": "0.5"}, "needs --spec-draft-model"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_draft_model": "qwen3-0.6b"}, "only it takes one"),
    ({"spec": "draft:3", "spec_acceptance": "0.5", "spec_draft_model": "nope"}, "nope"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_adaptive": "2-4:1"}, "must start at 1"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_adaptive": "1-4:1,3-9:0"}, "overlap"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_adaptive": "1-4"}, "FIRST-LAST:K"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_adaptive": "4-1:1"}, "1 <= FIRST <= LAST"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "spec_seed": -1}, "--spec-seed"),
    ({"spec_acceptance": "0.5"}, "--spec-acceptance sets speculative decoding: it needs --spec"),
    ({"spec_adaptive": "1-4:1"}, "--spec-adaptive sets speculative decoding"),
    ({"spec": "eagle:3", "spec_acceptance": "0.5", "pool": ("a=h100-sxm:1",)}, "not modelled with --pool"),
])
def test_bad_spec_input(kw, msg):
    sc = Scenario(one(), model="llama-3-8b", gpu="a100-80gb", client=None, **kw)
    with pytest.raises(KvschedError, match=msg):
        sc.check()


def test_cli_flags_json_and_one_line_errors():
    base = ["simulate", "--num-requests", "40", "--rate", "5", "--prompt-len", "uniform:50:200",
            "--output-len", "uniform:20:100", "--model", "llama-3.1-8b", "--json"]
    r = CliRunner().invoke(app, [*base, "--spec", "eagle:3", "--spec-acceptance", "0.7"])
    assert r.exit_code == 0, r.output
    import json
    out = json.loads(r.output.strip().splitlines()[-1])
    s = out if "spec_method" in out else next(iter(out.values()))
    assert s["spec_method"] == "eagle" and s["spec_k"] == 3 and 0 < s["spec_acceptance_rate"] <= 1
    assert 1 < s["spec_tokens_per_step"] <= 4
    for args, msg in ((["--spec", "eagle:3"], "needs --spec-acceptance"),
                      (["--spec-acceptance", "0.7"], "needs --spec METHOD:k"),
                      (["--spec", "medusa:2", "--spec-acceptance", "0.7"], "unknown method")):
        r = CliRunner().invoke(app, [*base, *args])
        assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output


# ----- calibrate: step logs with speculative steps ------------------------------------------------
def spec_step_log(path, target, e0: float, e1: float, steps: int):
    """A step log of `target`'s times plus a drafter's (k passes of e0 + e1 per token: the first
    over the step's tokens, the others over one per request) on random verify-heavy steps."""
    import csv

    from kvsched.cost.calibrate import STEP_LOG_HEADER
    rng = np.random.default_rng(0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(STEP_LOG_HEADER + ["draft_passes"])
        for step in range(steps):
            chunks = [(int(rng.integers(10, 3000)), int(rng.integers(1, 5))) for _ in range(rng.integers(1, 60))]
            n = int(rng.integers(0, 30))
            ctx = int(rng.integers(n, 40 * n + 1)) if n else 0
            s = BatchShape(sum(c for _, c in chunks), len(chunks), sum(c * (p + (c + 1) / 2) for p, c in chunks),
                           sum(p + c for p, c in chunks), n, ctx, chunks)
            k = int(rng.integers(0, 4))
            t = float(target.time(s)) + (k * e0 + e1 * (s.tokens + (k - 1) * s.seqs) if k else 0.0)
            w.writerow([step, s.prefill_tokens, s.prefill_seqs, s.prefill_attn, s.prefill_ctx, n, ctx,
                        " ".join(f"{p}:{c}" for p, c in chunks), 0, s.tokens, s.tokens, repr(t), k])
    return path


def test_calibrate_fits_the_drafter_and_simulate_uses_it(tmp_path):
    """A step log of a linear target plus a drafter of k passes (e0 + e1 per token a pass runs):
    calibrate recovers e0 and e1 and the target's d0, d1 exactly, and --spec then uses the fitted
    drafter (its time in every batch)."""
    import json

    from kvsched.cost import LinearCost, cost_file_drafter
    from kvsched.cost.calibrate import calibrate, read_step_log
    from kvsched.cost.spec_cost import DrafterLine
    target, e0, e1 = LinearCost(d0=0.004, d1=3e-6), 4e-4, 2e-6
    path = spec_step_log(tmp_path / "steps.csv", target, e0, e1, 200)
    cal = calibrate(read_step_log(path), ["linear"])
    assert cal.fits["linear"].drafter == pytest.approx((e0, e1), rel=1e-6)
    assert cal.fits["linear"].params == pytest.approx({"d0": 0.004, "d1": 3e-6}, rel=1e-6)
    assert cal.fits["linear"].errors["all"]["median"] < 1e-6
    out = tmp_path / "cost.json"
    r = CliRunner().invoke(app, ["calibrate", str(path), "--models", "linear", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["drafter"] == pytest.approx({"e0": e0, "e1": e1}, rel=1e-6)
    d = cost_file_drafter(str(out))
    assert isinstance(d, DrafterLine) and d.e0 == pytest.approx(e0)
    w = Workload.build(np.zeros(8), [64] * 8, [40] * 8)
    base = dict(model="llama-3-8b", gpu="a100-80gb", kv_capacity=4096, client=None, prefix_caching=False,
                spec="eagle:3", spec_acceptance="0")
    fitted = simulate(Scenario(w, cost=str(out), **base), "vllm-v1", record_batches=True)
    plain = simulate(Scenario(w, cost=str(out), **{**base, "spec": "ngram:3"}), "vllm-v1", record_batches=True)
    b = [x for x in fitted.batches if x[2] == 0][0]         # a decode-only batch: 8 decoders, 3 drafts each
    q = [x for x in plain.batches if x[2] == 0][0]
    assert b[1] - q[1] == pytest.approx(3 * e0 + e1 * (8 * 4 + 2 * 8), rel=1e-9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(out.read_text()), "drafter": {"e0": -1, "e1": 0}}))
    with pytest.raises(KvschedError, match="drafter"):
        simulate(Scenario(w, cost=str(bad), **base), "vllm-v1")


def test_a_request_without_room_for_its_last_verify_step_is_rejected():
    """Prompt 50 + output 14 fits 64 KV tokens, but its last step's 3 draft slots do not: vLLM
    would preempt it for ever; it is rejected on arrival, counted, with a warning."""
    w = Workload.build([0.0, 0.0], [50, 20], [14, 10])
    with pytest.warns(UserWarning, match="needs 66 KV tokens with its drafts' slots"):
        s = simulate(scenario(w, kv=64, acc="0"), "vllm-v1").summary
    assert s["rejected"] == 1 and s["completed"] == 1
    assert simulate(scenario(w, kv=64, spec=""), "vllm-v1").summary["completed"] == 2
    # vLLM caps a step's tokens at max_model_len - computed - 1: 100 + 29 in 128 tokens of KV fits
    near = dataclasses.replace(scenario(Workload.build([0.0], [100], [29]), kv=128, acc="0.7"), max_model_len=129)
    assert simulate(near, "vllm-v1").summary["completed"] == 1


def test_drafts_stop_at_max_model_len():
    """vLLM caps a running request's tokens at max_model_len - num_computed - 1: near the end a
    request verifies fewer drafts (the view's spec_tokens), never reaching past the model."""
    look, seen = watching(lambda v, i: (v.kv_tokens(i), v.spec_tokens(i)))
    w = Workload.build([0.0], [250], [60])
    simulate(dataclasses.replace(scenario(w, spec="ngram:5", acc="0.9"), max_model_len=310), look)
    assert all(kv + 1 + s <= 310 - 1 for kv, s in seen)
    assert any(s < 5 for _, s in seen) and seen[0][1] == 5


def test_sarathi_and_slai_count_drafts_in_their_token_budgets():
    """A batch's tokens (chunks, and 1 + the drafts each decoder verifies) stay within sarathi's
    chunk size and SLAI's token budget; the drafts that do not fit are cut (Plan.spec)."""
    for policy, params, budget in (("sarathi", {"chunk_size": 24, "max_num_seqs": 16}, 24),
                                   ("slai", {"token_budget": 24, "max_num_seqs": 16, "max_decodes": 16}, 24)):
        worst = []

        class Count:
            name = policy

            def __init__(self) -> None:
                self.inner = make_policy(policy, params, GPU)

            def schedule(self, v):
                p = self.inner.schedule(v)
                cap = p.spec if isinstance(p.spec, dict) else {}
                decoders = [i for i in v.decoding if i not in p.preempt] if p.decode is True else list(p.decode or ())
                worst.append(sum(c for _, c in p.chunks)
                             + sum(1 + min(v.spec_tokens(i), cap.get(i, 99)) for i in decoders))
                return p

            def on_finish(self, i, v):
                getattr(self.inner, "on_finish", lambda *a: None)(i, v)

            def on_preempt(self, i, v):
                getattr(self.inner, "on_preempt", lambda *a: None)(i, v)
        rng = np.random.default_rng(5)
        w = Workload.build(np.sort(rng.uniform(0, 1, 40)), rng.integers(2, 40, 40), rng.integers(10, 60, 40),
                           output_known=True)
        s = simulate(scenario(w, spec="eagle:3", acc="0.7", kv=4096), Count()).summary
        assert s["completed"] == 40 and max(worst) <= budget and max(worst) > budget - 4


def test_calibrate_recovers_a_roofline_target_and_its_drafter(tmp_path):
    """Alternating least squares: a roofline target (llama-3-8b, a100) plus a drafter of e0 = 0.4 ms
    and e1 = 2 us per token: both come back (the roofline's efficiencies and overhead too)."""
    from kvsched.cost import RooflineCost
    from kvsched.cost.calibrate import calibrate, read_step_log
    m, g = get_model("llama-3-8b"), GPU
    target, e0, e1 = RooflineCost(model=m, gpu=g), 4e-4, 2e-6
    path = spec_step_log(tmp_path / "steps.csv", target, e0, e1, 300)
    fit = calibrate(read_step_log(path), ["roofline"], m, g).fits["roofline"]
    assert fit.drafter == pytest.approx((e0, e1), rel=1e-4)
    assert fit.params["overhead"] == pytest.approx(target.overhead, rel=1e-4)
    assert fit.errors["all"]["median"] < 1e-6
