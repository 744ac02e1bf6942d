"""The engine against the reference replica (kvsched/sim/reference.py) on random workloads and
policies: the same per-request times and counts, bit for bit."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvsched.cost import make_cost_model
from kvsched.errors import PlanError
from kvsched.hardware import get_gpu, get_model
from kvsched.kvcache import PagedKV
from kvsched.policies import Plan, make_policy
from kvsched.sim.reference import ReferenceReplica
from kvsched.sim.server import Server
from kvsched.workload import Tier, Workload

GPU, MODEL = get_gpu("a100-80gb"), get_model("llama-3-8b")
POLICIES = ["vllm-v1", "sarathi", "orca", "vllm-v0", "request-level", "eb", "eb-adaptive", "eb-plus", "rad", "slai",
            "wait", "nested-wait"]
PARAMS = {"vllm-v1": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
          "vllm-v0": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
          "nested-wait": {"segments": "60,240,1000"}}
COSTS = [("constant", {}), ("roofline", {}), ("phase", {"switch_s": 0.003})]


class Perturbed:
    """A base policy's plan, randomly changed: an extra preemption now and then, some decoders
    paused (the decode set cut) -- the paths the baselines never take."""
    name = "perturbed"

    def __init__(self, base, seed: int) -> None:
        self.base, self.rng = base, random.Random(seed)
        for hook in ("on_finish", "on_preempt", "on_batch_end"):     # the base learns what happened
            if hasattr(base, hook):
                setattr(self, hook, getattr(base, hook))

    def schedule(self, v):
        plan, rng = self.base.schedule(v), self.rng
        dec = (sorted(v.decoding) if plan.decode is True else [] if plan.decode is False else sorted(plan.decode))
        dec = [i for i in dec if i not in plan.preempt]
        extra = []
        if rng.random() < 0.08:
            cands = sorted(i for i in v.running if i not in plan.preempt)
            extra = [rng.choice(cands)] if cands else []
            if not [i for i in dec if i not in extra] and not [i for i, _ in plan.chunks if i not in extra]:
                extra = []                      # a plan must still compute something
        dec = [i for i in dec if i not in extra]
        admit, chunks = list(plan.admit), [(i, c) for i, c in plan.chunks if i not in extra]
        if extra and v.kv_blocks(extra[0]) and rng.random() < 0.5:   # preempted and admitted again
            admit.append(extra[0])                                  # in one plan: a restart (its 1-token
            chunks.append((extra[0], 1))                            # chunk fits in the blocks it freed)
        if len(dec) > 1 and rng.random() < 0.3:
            dec = [i for i in dec if rng.random() < 0.6] or dec[:1]
        return Plan(admit, chunks, set(dec) if dec else False, [*plan.preempt, *extra])


def _workload(seed: int, n: int, max_prompt: int, max_output: int, rate: float, known: bool = False) -> Workload:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    tiers = (Tier("paying", tbt_slo=0.03, priority=0), Tier("free", tbt_slo=0.08, priority=1))
    return Workload.build(t, rng.integers(1, max_prompt + 1, n), rng.integers(1, max_output + 1, n),
                          tier_index=rng.integers(-1, 2, n), tiers=tiers, output_known=known)


def _same(engine, ref, what):
    reqs = engine.reqs
    for field, a, b in [("admitted", reqs.admitted, ref.admitted), ("first", reqs.first, ref.first),
                        ("finished", reqs.finished, ref.finished), ("preempts", reqs.preempts, ref.preempts),
                        ("recomputed", reqs.recomputed, ref.recomputed), ("itl_max", reqs.itl_max, ref.itl_max),
                        ("viol", reqs.viol, ref.viol)]:
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (what, field, a, b)
    rep = engine.replica
    assert engine.reqs.viol.sum() == ref.viol.sum()
    assert (rep.iterations, rep.busy, rep.peak_kv, rep.kv_integral, rep.preemptions) == \
        (ref.iterations, ref.busy, ref.peak_kv, ref.kv_integral, int(ref.preempts.sum())), what


def _both(w, make, cost, cap_tokens, bs):
    """Both runs; (None, None) where both stopped the policy (a perturbed plan a base policy
    cannot continue from), which must happen in both or neither."""
    errors = []
    engine = Server(w, make(), cost, PagedKV(cap_tokens, bs))
    ref = ReferenceReplica(w, make(), cost, cap_tokens // bs, bs)
    for run in (engine.run, ref.run):
        try:
            run()
            errors.append(None)
        except Exception as exc:            # the engine names a policy's error (PlanError); the reference lets it through
            errors.append(exc)
    assert (errors[0] is None) == (errors[1] is None), errors
    if errors[0] is not None:
        assert isinstance(errors[0], PlanError), errors
        assert isinstance(errors[1], PlanError) or (f"raised {type(errors[1]).__name__} " in str(errors[0])
                                                    and str(errors[0]).endswith(f": {errors[1]}")), errors
    return (engine, ref) if errors[0] is None else (None, None)


@pytest.mark.filterwarnings("ignore:.*can never be served")
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 40), policy=st.sampled_from(POLICIES),
       cost=st.sampled_from(COSTS), bs=st.sampled_from([1, 4, 16]), cap=st.integers(600, 6000),
       perturb=st.booleans(), rate=st.sampled_from([2.0, 20.0, 200.0]))
def test_the_engine_is_the_reference(seed, n, policy, cost, bs, cap, perturb, rate):
    w = _workload(seed, n, 500, 120, rate, known=policy == "wait")
    cm = make_cost_model(cost[0], cost[1], MODEL, GPU)

    def make():
        base = make_policy(policy, PARAMS.get(policy, {}), GPU)
        return Perturbed(base, seed) if perturb else base
    engine, ref = _both(w, make, cm, cap, bs)
    if engine is not None:
        _same(engine, ref, (policy, cost, perturb))


def test_the_engine_is_checked_against_the_reference_on_every_policy():
    """The engine as loaded (compiled where built, as in CI; KVSCHED_PURE_PYTHON=1 runs the
    .py files) against the reference, on a roofline cost and each policy."""
    for seed, policy in enumerate(POLICIES):
        w = _workload(seed, 60, 800, 200, 20.0, known=policy == "wait")
        cm = make_cost_model("roofline", {}, MODEL, GPU)
        engine, ref = _both(w, lambda: make_policy(policy, PARAMS.get(policy, {}), GPU), cm, 5000, 16)
        _same(engine, ref, policy)


def test_the_reference_preempts_and_recomputes():
    """A hand-checkable case: KV for one request at a time makes vLLM v1 preempt."""
    w = _workload(1, 12, 300, 300, 100.0)
    cm = make_cost_model("constant", {}, MODEL, GPU)
    engine, ref = _both(w, lambda: make_policy("vllm-v1", {}, GPU), cm, 700, 16)
    assert ref.preempts.sum() > 0 and (ref.recomputed > 0).any()
    _same(engine, ref, "preempting")
