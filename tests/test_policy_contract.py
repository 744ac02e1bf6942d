"""The policy contract: policy objects in simulate(), the read-only view, hooks, the batch
shape's chunks, and one error naming the policy for every way a policy can go wrong."""
import math
import subprocess
import sys

import numpy as np
import pytest

from kvsched.cost import BatchShape, ConstantCost
from kvsched.errors import KvschedError, PlanError
from kvsched.policies import Plan
from kvsched.run import Scenario, simulate
from kvsched.workload import Workload

W = Workload.build(np.arange(6) * 0.01, [30] * 6, [8] * 6)


def sim(policy, **kw):
    return simulate(Scenario(W, cost="constant", cost_params={"b": 0.01}, kv_capacity=10_000, block_size=1, **kw),
                    policy)


class Fcfs:
    """A small custom policy: whole prompts in arrival order, every decoder each batch."""
    name = "fcfs"

    def schedule(self, v):
        admit = list(v.waiting)[:4 - len(v.running)] if len(v.running) < 4 else []
        return Plan(admit, [(i, v.prefill_target(i)) for i in admit], decode=True)


def test_policy_object_runs_and_copies_per_replica():
    r = sim(Fcfs())
    assert r.summary["completed"] == 6 and r.policy == "fcfs"
    r2 = sim(Fcfs(), replicas=2)
    assert r2.summary["completed"] == 6 and r2.policies[0] is not r2.policies[1]
    with pytest.raises(KvschedError, match="is not a policy"):
        sim(object())


class Hooks(Fcfs):
    name = "hooks"

    def __init__(self):
        self.batches, self.finished, self.preempted, self.seen = 0, [], [], []

    def schedule(self, v):
        self.seen.append((v.iterations, v.mean_batch_time, v.arrivals_pending, v.next_arrival,
                          sorted(v.decoding), v.num_decoding))
        for i in v.decoding:
            assert v.tbt_slo(i) == math.inf and v.last_token_time(i) <= v.now
        return super().schedule(v)

    def on_batch_end(self, v):
        self.batches += 1
        assert v.iterations == self.batches

    def on_finish(self, i, v):
        self.finished.append(i)
        assert v.last_token_time(i) == v.now


def test_hooks_and_view_fields():
    h = Hooks()
    r = sim(h)
    assert h.batches == r.summary["iterations"] and sorted(h.finished) == list(range(6))
    it, mean, pending, nxt, decoding, nd = h.seen[0]
    assert it == 0 and mean is None and pending and nxt == pytest.approx(0.01)
    assert h.seen[1][1] == pytest.approx(0.01)
    assert not h.seen[-1][2] and h.seen[-1][3] is None
    assert all(len(d) == n for *_, d, n in h.seen)


def test_on_preempt_hook():
    class Preempter(Fcfs):
        name = "preempter"

        def __init__(self):
            self.k, self.preempted = 0, []

        def schedule(self, v):
            self.k += 1
            if self.k == 3 and v.decoding:
                return Plan(preempt=[max(v.decoding)], decode=True)
            return super().schedule(v)

        def on_preempt(self, i, v):
            self.preempted.append((i, i in v.waiting))

    p = Preempter()
    r = sim(p)
    assert p.preempted and all(back for _, back in p.preempted) and r.summary["preemptions"] == 1


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


class Bad(Fcfs):
    def __init__(self, name, mode):
        self.name, self.mode, self.k = name, mode, 0

    def schedule(self, v):
        self.k += 1
        m = self.mode
        if m == "raise" and self.k == 3:
            raise ZeroDivisionError("division by zero")
        if m == "none":
            return None
        if m == "dict":
            return {"admit": [0]}
        if m == "generator" and self.k == 2:
            return Plan(admit=(1 / 0 for _ in [1]))
        if m == "array-id" and self.k == 2:
            return Plan(admit=[np.array([[1, 2], [3, 4]])])
        if m == "kvsched-error" and self.k == 2:
            raise KvschedError("my own check failed")
        if m == "chunks-none" and self.k == 2:
            return Plan(chunks=None, decode=True)
        if m == "unknown" and self.k == 2:
            return Plan([99], [(99, 5)])
        if m == "unknown-chunk" and self.k == 2:
            return Plan([], [(1.5, 5)], decode=True)
        if m == "bad-chunk" and self.k == 1:
            return Plan([0], [(0, "5")])
        if m == "assign-now":
            v.now = 5.0
        if m == "assign-kv":
            v.kv_used_blocks = -880
        if m == "kv-object":
            v.kv.used = -880
        if m == "spin":             # prefill one token, preempt it, again: never any output
            if v.prefilling:
                i = next(iter(v.prefilling))
                return Plan([i], [(i, 1)], preempt=[i])
            return Plan([v.waiting[0]], [(v.waiting[0], 1)])
        if m == "preempt-waiting" and self.k == 2 and v.waiting:
            return Plan(preempt=[v.waiting[-1]], decode=True)
        return super().schedule(v)

    def on_finish(self, i, v):
        if self.mode == "finish-raise":
            raise KeyError(i)


@pytest.mark.parametrize("mode,needle", [
    ("raise", r"policy bad raised ZeroDivisionError in schedule at t=.*: division by zero"),
    ("none", r"policy bad returned None \(NoneType\), not a Plan"),
    ("dict", r"policy bad returned \{'admit': \[0\]\} \(dict\), not a Plan"),
    ("generator", r"policy bad gave a plan that cannot be read: ZeroDivisionError: division by zero"),
    ("array-id", r"policy bad admitted request array\(\[\[1, 2\], \[3, 4\]\]\), which does not exist"),
    ("kvsched-error", r"policy bad: my own check failed"),
    ("chunks-none", r"policy bad gave Plan.chunks=None; it must be a list"),
    ("unknown", r"policy bad admitted request 99, which does not exist \(requests are 0..5\)"),
    ("unknown-chunk", r"policy bad gave a chunk to request 1.5, which does not exist"),
    ("bad-chunk", r"policy bad gave request 0 a chunk of '5' tokens; tokens must be an integer"),
    ("assign-now", r"policy bad assigned view.now: the view is read-only"),
    ("assign-kv", r"policy bad assigned view.kv_used_blocks: the view is read-only"),
    ("kv-object", r"policy bad raised AttributeError in schedule .*'kv'"),
    ("spin", r"policy bad made no progress: no output token in 50 batches that preempted"),
    ("preempt-waiting", r"policy bad preempted request \d, which is not running"),
    ("finish-raise", r"policy bad raised KeyError in on_finish \(request \d\)"),
])
def test_bad_policy_gives_one_line_naming_it(mode, needle):
    with pytest.raises(PlanError) as exc:
        sim(Bad("bad", mode), stall_batches=50)
    assert __import__("re").search(needle, one_line(exc)), one_line(exc)


def test_plan_subclass_is_a_plan():
    class MyPlan(Plan):
        __slots__ = ()

    class Sub(Fcfs):
        name = "sub"

        def schedule(self, v):
            p = super().schedule(v)
            return MyPlan(p.admit, p.chunks, p.decode, p.preempt)

    assert sim(Sub()).summary["completed"] == 6


def test_stall_limit_is_configurable_and_checked():
    with pytest.raises(PlanError, match="no output token in 7 batches that preempted"):
        sim(Bad("bad", "spin"), stall_batches=7)
    with pytest.raises(KvschedError, match="stall.batches must be >= 1"):
        sim(Fcfs(), stall_batches=0)


def test_cli_stall_flag_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvsched", "simulate", "--num-requests", "5", "--stall-batches", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--stall-batches" in r.stderr


def test_batch_shape_lists_each_chunk():
    shapes = []

    class Recording(ConstantCost):
        def time(self, shape: BatchShape):
            shapes.append((list(shape.chunks), shape.prefill_tokens, shape.decode_seqs, shape.decode_ctx))
            return super().time(shape)

    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server
    w = Workload.build(np.zeros(2), [70, 20], [3, 2])
    pol = __import__("kvsched.policies", fromlist=["make_policy"]).make_policy(
        "sarathi", {"chunk_size": 32, "max_num_seqs": 4}, __import__("kvsched.hardware", fromlist=["x"]).get_gpu("a30"))
    Server(w, pol, Recording(0.1), PagedKV(1000, 1)).run()
    assert shapes[0][:2] == ([(0, 32)], 32)
    assert shapes[1][:2] == ([(32, 32)], 32)
    assert shapes[2][:2] == ([(64, 6), (0, 20)], 26)
    assert shapes[3] == ([], 0, 2, 71 + 21)     # both decode: contexts 70 + 1 and 20 + 1


def test_shape_counts_only_decoding_requests():
    """A prefill-only batch while requests decode elsewhere in time carries no decode context
    (the engine before Engine v2 passed the idle decoders' context)."""
    shapes = []

    class Recording(ConstantCost):
        def time(self, shape: BatchShape):
            shapes.append((shape.prefill_tokens, shape.decode_seqs, shape.decode_ctx))
            return super().time(shape)

    from kvsched.kvcache import PagedKV
    from kvsched.policies import make_policy
    from kvsched.hardware import get_gpu
    from kvsched.sim.server import Server
    w = Workload.build(np.array([0.0, 0.05, 0.3]), [40, 30, 20], [10, 10, 10])
    Server(w, make_policy("vllm-v0", {}, get_gpu("a30")), Recording(0.1), PagedKV(1000, 1)).run()
    prefill_only = [s for s in shapes if s[0] and not s[1]]
    assert len(prefill_only) >= 2 and all(ctx == 0 for _, _, ctx in prefill_only)
