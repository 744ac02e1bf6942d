"""Each baseline does what its engine does, and the server refuses illegal plans."""
import numpy as np
import pytest

from kvsched.cost import ConstantCost
from kvsched.errors import PlanError
from kvsched.kvcache import PagedKV
from kvsched.policies import Plan
from kvsched.sim.server import Server
from kvsched.workload import Uniform, Workload, synthetic

from conftest import run

W = synthetic(Uniform(1, 300), Uniform(1, 80), rate=20, n=400, seed=11)


def test_budgets_hold_every_batch():
    for policy, params, budget in [("sarathi", {"chunk_size": 128, "max_num_seqs": 16}, 128),
                                   ("vllm-v1", {"max_num_batched_tokens": 256, "max_num_seqs": 16}, 256)]:
        server, _, _ = run(W, policy, params, kv_tokens=6000, block_size=16)
        assert max(b[2] + b[4] for b in server.batches) <= budget
        assert max(b[3] + b[4] for b in server.batches) <= 16
        assert any(b[2] and b[4] for b in server.batches)            # mixed batches happen


def test_vllm_v0_batches_are_exclusive():
    server, rec, _ = run(W, "vllm-v0", {"max_num_batched_tokens": 512, "max_num_seqs": 16},
                         kv_tokens=6000, block_size=16)
    assert all(b[2] == 0 or b[4] == 0 for b in server.batches)


def test_request_level_admits_only_when_all_done():
    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy
    spy = Spy(make_policy("request-level", {"b": 8}, get_gpu("a30")))
    server = Server(W, spy, ConstantCost(0.01), PagedKV(100_000, 1), record_batches=True)
    server.run()
    cycles = [(admitted, running) for admitted, running in spy.admissions if admitted]
    assert cycles and all(running == 0 and admitted <= 8 for admitted, running in cycles)
    assert all(b[2] == 0 or b[4] == 0 for b in server.batches)


class Spy:
    def __init__(self, inner):
        self.inner, self.name, self.plans, self.admissions = inner, inner.name, [], []

    def schedule(self, v):
        plan = self.inner.schedule(v)
        self.admissions.append((len(plan.admit), len(v.running)))
        self.plans.append([(i, c, v.prefill_target(i), v.prefill_done(i)) for i, c in plan.chunks])
        return plan

    def on_finish(self, i, v):
        pass


def test_orca_never_chunks():
    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy
    spy = Spy(make_policy("orca", {"max_num_batched_tokens": 512, "max_num_seqs": 16}, get_gpu("a30")))
    Server(W, spy, ConstantCost(0.01), PagedKV(6000, 16)).run()
    chunks = [c for plan in spy.plans for c in plan]
    assert chunks and all(c == target and done == 0 for _, c, target, done in chunks)


class Greedy:
    """Admits everything at once with whole prompts: ignores KV."""
    name = "greedy"

    def schedule(self, v):
        admit = list(v.waiting)
        return Plan(admit, [(i, v.prefill_target(i)) for i in admit], v.num_decoding > 0)

    def on_finish(self, i, v):
        pass


class Idle:
    name = "idle"

    def schedule(self, v):
        return Plan()

    def on_finish(self, i, v):
        pass


class Rechunk:
    name = "rechunk"

    def schedule(self, v):
        if v.num_decoding:
            return Plan(chunks=[(next(iter(v.running)), 1)])
        admit = list(v.waiting)[:1]
        return Plan(admit, [(i, v.prefill_target(i)) for i in admit])

    def on_finish(self, i, v):
        pass


@pytest.mark.parametrize("policy,needle", [
    (Greedy(), "policy greedy planned a batch needing"),
    (Idle(), "policy idle returned an empty plan"),
    (Rechunk(), "not in its prefill phase"),
])
def test_illegal_plans_name_the_policy(policy, needle):
    w = Workload.build(np.zeros(6), [50] * 6, [20] * 6)
    with pytest.raises(PlanError, match=needle):
        Server(w, policy, ConstantCost(0.1), PagedKV(200, 1)).run()


def test_budgets_above_the_whole_number_limit_are_refused_through_the_api_too():
    """The command line caps whole numbers at MAX_TOKENS; a policy built in Python is held to
    the same (its counts are C integers in the compiled build)."""
    from kvsched.policies.baselines import Orca, RequestLevel, Sarathi, VllmV1
    from kvsched.policies.slai import Slai
    from kvsched.workload.lengths import MAX_TOKENS
    for make in (lambda: VllmV1(max_num_batched_tokens=MAX_TOKENS + 1, max_num_seqs=4),
                 lambda: Sarathi(chunk_size=512, max_num_seqs=MAX_TOKENS + 1),
                 lambda: Orca(max_num_seqs=MAX_TOKENS + 1), lambda: RequestLevel(b=2 ** 63)):
        with pytest.raises(ValueError, match=r"must be in \[1, "):
            make()
    # fractional counts (found by the independent review: the compiled build truncated them)
    for make in (lambda: VllmV1(2048, 256, long_prefill_token_threshold=100.5), lambda: Sarathi(chunk_size=300.7),
                 lambda: Sarathi(max_num_seqs=3.5), lambda: Orca(max_num_seqs=4.5), lambda: Slai(token_budget=300.5),
                 lambda: Slai(max_decodes=2.5)):
        with pytest.raises(ValueError, match="must be a whole number"):
            make()
    for tbt in (None, 0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="default_tbt must be a positive finite number"):
            Slai(default_tbt=tbt)
    assert Slai(default_tbt=np.float64(0.1)).default_tbt == 0.1 and VllmV1(2048, 256, np.int64(64))
    assert VllmV1(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=4).max_num_batched_tokens == MAX_TOKENS
