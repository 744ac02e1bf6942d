"""The one plan check (kvsched/sim/plan_check.py), as the simulator and the vLLM adapter use it:
plans refused or accepted as before, ids and tokens normalized, the policy's own lists left
alone (tests for the review of issue 30's first part)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvsched.cost import make_cost_model
from kvsched.errors import PlanError
from kvsched.hardware import get_gpu, get_model
from kvsched.kvcache import PagedKV
from kvsched.policies import Plan
from kvsched.sim.server import Server
from kvsched.workload import Workload

COST = make_cost_model("constant", {}, get_model("llama-3-8b"), get_gpu("a100-80gb"))


def _run(policy, prompts=(10,), outputs=(20,)):
    w = Workload.build(np.zeros(len(prompts)), np.array(prompts), np.array(outputs))
    s = Server(w, policy, COST, PagedKV(4096, 16))
    s.run()
    return s


class Restart:
    """Prefills request 0, lets it decode a few steps, then preempts it and admits it again in
    one plan with a chunk of its whole restart target (prompt + tokens generated so far)."""
    name = "restart"

    def __init__(self) -> None:
        self.k, self.done = 0, False

    def schedule(self, v):
        self.k += 1
        if v.waiting and not list(v.running):
            i = v.waiting[0]
            return Plan([i], [(i, v.prefill_target(i))], False, [])
        if v.decoding and self.k == 6 and not self.done:
            i = next(iter(v.decoding))
            self.done = True
            return Plan([i], [(i, v.prompt_len(i) + v.generated(i))], False, [i])
        if v.prefilling:
            i = next(iter(v.prefilling))
            return Plan([], [(i, v.prefill_target(i) - v.prefill_done(i))], bool(v.decoding), [])
        return Plan([], [], True, [])


def test_a_decoder_preempted_and_admitted_in_one_plan_takes_its_whole_restart_target():
    s = _run(Restart())
    assert s.reqs.preempts[0] == 1 and s.reqs.finished[0] < np.inf


class Scripted:
    """Plans from a script: plan k is script[k](view), then everyone decodes or prefills."""
    name = "scripted"

    def __init__(self, *script) -> None:
        self.script, self.k = list(script), 0

    def schedule(self, v):
        self.k += 1
        if self.k <= len(self.script):
            return self.script[self.k - 1](v)
        pre = [(i, v.prefill_target(i) - v.prefill_done(i)) for i in v.prefilling]
        return Plan(list(v.waiting)[:1], pre + [(i, v.prefill_target(i)) for i in list(v.waiting)[:1]], True, [])


def test_numpy_arrays_as_plan_fields_are_read():
    s = _run(Scripted(lambda v: Plan(np.array([0]), np.array([[0, 10]]), True, np.array([], int))))
    assert s.reqs.finished[0] < np.inf


@pytest.mark.parametrize("decode,needle", [
    ({0.0}, "selected for decoding request 0.0, which does not exist"),
    ({True}, "selected for decoding request True, which does not exist"),
    ([[0]], "selected for decoding request [0], which does not exist"),
])
def test_decode_ids_must_be_ints(decode, needle):
    first = lambda v: Plan([0], [(0, 10)], False, [])             # noqa: E731
    with pytest.raises(PlanError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _run(Scripted(first, lambda v: Plan([], [], decode, [])))


def test_numpy_decode_ids_are_taken_as_ints():
    first = lambda v: Plan([0], [(0, 10)], False, [])             # noqa: E731
    s = _run(Scripted(first, lambda v: Plan([], [], {np.int64(0)}, [])))
    assert s.reqs.finished[0] < np.inf


def test_a_request_admitted_twice_is_named_without_where_it_waits():
    with pytest.raises(PlanError, match=r"admitted request 0, which is not waiting$"):
        _run(Scripted(lambda v: Plan([0, 0], [(0, 10)], False, [])))


def test_hooks_that_edit_the_plan_s_lists_cannot_slip_unchecked_chunks_in():
    class Hooky:
        name = "hooky"

        def __init__(self) -> None:
            self.k, self.chunks = 0, None

        def schedule(self, v):
            self.k += 1
            if self.k == 1:
                return Plan([0, 1], [(0, 10), (1, 50)], False, [])
            if self.k == 2:
                self.chunks = [(0, 5)]
                return Plan([], self.chunks, False, [1])
            pre = [(i, v.prefill_target(i) - v.prefill_done(i)) for i in v.prefilling]
            return Plan(list(v.waiting), pre + [(i, v.prefill_target(i)) for i in v.waiting], True, [])

        def on_preempt(self, i, v):
            self.chunks.append((0, 500))            # after the check: ignored, the checked copy runs

    s = _run(Hooky(), prompts=(100, 50), outputs=(5, 5))
    assert s.reqs.finished.max() < np.inf and s.reqs.computed[0] == 0        # 0 finished normally


ADAPTER = textwrap.dedent('''
    import sys, types
    for name in ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.async_scheduler",
                 "vllm.v1.core.sched.scheduler"]:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = type("AsyncScheduler", (), {})
    sys.modules["vllm.v1.core.sched.scheduler"].Scheduler = type("Scheduler", (), {})
    from kvsched.engines import vllm_scheduler as vs
    from kvsched.errors import PlanError
    from kvsched.policies import Plan
    import numpy as np

    class R:
        def __init__(s, prompt, computed, out):
            s.num_prompt_tokens, s.num_computed_tokens, s.num_output_tokens = prompt, computed, out
            s.num_output_placeholders, s.num_tokens = 0, prompt + out
    S = types.SimpleNamespace(_count=5, _by_id={0: R(100, 0, 0), 1: R(100, 40, 0), 2: R(50, 50, 1), 3: R(30, 30, 3),
                                                4: R(70, 0, 0)})
    v = object.__new__(vs.VllmView)
    v._s, v.waiting, v.running, v.prefilling, v.decoding, v._decoding_set = S, [0, 4], [1, 2, 3], [1], [2, 3], {2, 3}
    v.block_size, v.kv_capacity_blocks, v.kv_used_blocks = 16, 20, 9
    for plan in [Plan([0], [(0, 100), (1, 60)], True, []), Plan(np.array([0]), np.array([[0, 100]]), {np.int64(2)}),
                 Plan([], [(1, 60)], {2.0}), Plan([0, 0], [(0, 100)]), Plan([2], [(2, 51)], False, [2]),
                 Plan([0, 4], [(0, 100), (4, 70)], True), Plan([4], [], True)]:
        try:
            p = vs._check_plan(plan, v, "p")
            print("ok", p.admit, p.chunks, sorted(p.decode) if not isinstance(p.decode, bool) else p.decode, p.preempt,
                  all(type(i) is int for i in [*p.admit, *p.preempt, *[x for c in p.chunks for x in c]]))
        except PlanError as e:
            print("err", e)
''')


def test_the_vllm_adapter_checks_plans_with_the_same_function():
    """The adapter's check (vLLM stubbed: only its base classes are imported) is the
    simulator's, plus the engine's own rules (every admission computes, KV room)."""
    out = subprocess.run([sys.executable, "-c", ADAPTER], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "ok [0] [(0, 100), (1, 60)] True [] True",
        "ok [0] [(0, 100)] [2] [] True",
        "err policy p selected for decoding request 2.0, which does not exist (requests are 0..4)",
        "err policy p admitted request 0, which is not waiting",
        "ok [2] [(2, 51)] False [2] True",
        "err policy p planned a batch needing 21 KV blocks; only 20 exist (320 tokens)",
        "err policy p admitted request 4 without a chunk: inside vLLM a request is admitted only when it computes "
        "tokens (the adapter cannot hold it admitted and idle)"]


def test_a_hook_editing_the_plan_s_decode_set_mid_plan_changes_nothing():
    """The check copies the selection where hooks run mid-plan: a request added to the set by
    `on_preempt` does not decode."""
    class EditsItsSet:
        name = "edits"

        def __init__(self) -> None:
            self.k, self.sel, self.log = 0, None, []

        def on_preempt(self, i, v):
            if self.sel is not None:
                self.sel.add(i)

        def schedule(self, v):
            self.k += 1
            if self.k == 1:
                return Plan([0, 1], [(0, 10), (1, 10)], False, [])
            if self.k == 2:
                return Plan([2], [(2, 5)], True, [])
            if self.k == 3:
                self.log.append((v.generated(0), v.generated(1)))
                self.sel = {0}
                return Plan([], [], self.sel, [2])      # preempt 2, decode only 0
            if self.k == 4:
                self.log.append((v.generated(0), v.generated(1)))
                self.sel = None
            if v.waiting:
                i = v.waiting[0]
                return Plan([i], [(i, v.prefill_target(i))], True, [])
            return Plan([], [], True, [])

    p = EditsItsSet()
    _run(p, prompts=(10, 10, 100), outputs=(20, 20, 5))
    (g0, g1), (h0, h1) = p.log
    assert (h0, h1) == (g0 + 1, g1)             # request 1 was not selected: it did not decode
