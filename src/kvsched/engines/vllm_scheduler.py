"""A kvsched policy inside vLLM: `--scheduler-cls kvsched.engines.vllm_scheduler.KvschedScheduler`
(or `LLM(..., scheduler_cls=...)`). Importing this module imports vLLM.

The policy and its parameters come from the environment, which vLLM's engine-core process
inherits: `KVSCHED_POLICY` (a name from `kvsched policies`, default vllm-v1) and
`KVSCHED_POLICY_PARAMS` (a JSON object of parameters). `KVSCHED_STEP_LOG`, when set, names a
CSV file that gets one row per step (prefill tokens and chunks, decodes and their total
context, KV blocks used, and the measured time since the previous step's schedule).

How a Plan is applied: vLLM's `schedule()` is kept (about 1,000 lines of KV allocation and
output building) and steered. Before it runs, each step:
1. the policy sees vLLM's state as a `ServerView` and returns a Plan;
2. the Plan's preemptions are made with vLLM's own `_preempt_request` (recompute);
3. running requests the Plan neither decodes nor chunks are hidden from `self.running`, and
   waiting requests it does not admit are hidden from `self.waiting`, for this step only;
4. the token budget is the Plan's token count.
vLLM then schedules what is left, in its own order (running first, then waiting FCFS, the last
one chunked to the budget). vllm-v1 therefore passes through unchanged. Policies that only
choose which requests run (EB's exclusive batches, decode selection) are exact; a Plan whose
chunk sizes differ from vLLM's budget rule gets vLLM's chunk sizes. That departs from
simulation and is counted in the step log (`planned_tokens` against `tokens`).
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from collections import deque

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.policies.base import Plan

STEP_LOG_FIELDS = ["step", "prefill_tokens", "prefill_chunks", "decodes", "decode_context", "kv_used_blocks",
                   "planned_tokens", "tokens", "seconds_since_last"]


class VllmView:
    """vLLM's scheduler state as kvsched's ServerView (policies/base.py). Request ids are the
    integers kvsched policies expect, assigned in arrival order."""
    index = 0
    role = "mixed"
    arrivals_pending = True
    next_arrival = None
    cost_model = None
    declared_types = None

    def __init__(self, sched: "KvschedScheduler") -> None:
        self._s = sched
        self.now = time.monotonic() - sched._t0
        reqs = sched._by_id
        self.waiting = [sched._num[r.request_id] for r in sched.waiting]
        self.running = [sched._num[r.request_id] for r in sched.running]
        self.prefilling = [i for i in self.running if not self._decoding(reqs[i])]
        self.decoding = [i for i in self.running if self._decoding(reqs[i])]
        self.num_decoding = len(self.decoding)
        self._decoding_set = set(self.decoding)
        pool = sched.kv_cache_manager.block_pool
        self.block_size = sched.block_size
        self.kv_capacity_blocks = pool.num_gpu_blocks - 1          # one is vLLM's null block
        self.kv_free_blocks = pool.get_num_free_blocks()
        self.kv_used_blocks = self.kv_capacity_blocks - self.kv_free_blocks
        self.decode_new_blocks = sum(self.needs_block(i) for i in self.decoding)
        self.recent_batch_times = list(sched._recent_times)
        self.recent_finished = list(sched._recent_finished)
        self.iterations = sched._steps
        self.mean_batch_time = sched._busy / sched._steps if sched._steps else None

    @staticmethod
    def _decoding(r) -> bool:
        return r.num_computed_tokens >= r.num_tokens - 1 and r.num_output_tokens > 0

    def _r(self, i: int):
        return self._s._by_id[i]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def arrival(self, i: int) -> float:
        return self._r(i).arrival_time - self._s._t0_wall

    def prompt_len(self, i: int) -> int:
        return self._r(i).num_prompt_tokens

    def output_len(self, i: int):
        return None

    def prefill_target(self, i: int) -> int:
        r = self._r(i)
        return r.num_tokens if r.num_computed_tokens < r.num_tokens - 1 or not r.num_output_tokens else r.num_tokens - 1

    def prefill_done(self, i: int) -> int:
        return self._r(i).num_computed_tokens

    def generated(self, i: int) -> int:
        return self._r(i).num_output_tokens

    def kv_tokens(self, i: int) -> int:
        return self._r(i).num_computed_tokens

    def kv_blocks(self, i: int) -> int:
        return self.blocks_for(self._r(i).num_computed_tokens)

    def is_decoding(self, i: int) -> bool:
        return i in self._decoding_set

    def needs_block(self, i: int) -> bool:
        return self._r(i).num_computed_tokens % self.block_size == 0

    def tier_priority(self, i: int) -> int:
        return self._r(i).priority

    def tbt_slo(self, i: int) -> float:
        return math.inf

    def last_token_time(self, i: int):
        return None


class KvschedScheduler(Scheduler):
    """vLLM's v1 Scheduler with a kvsched policy choosing each step (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        name = os.environ.get("KVSCHED_POLICY", "vllm-v1")
        try:
            params = json.loads(os.environ.get("KVSCHED_POLICY_PARAMS", "{}"))
        except json.JSONDecodeError as exc:
            raise KvschedError(f"KVSCHED_POLICY_PARAMS is not a JSON object: {exc}") from None
        if not isinstance(params, dict):
            raise KvschedError("KVSCHED_POLICY_PARAMS must be a JSON object of parameters")
        limits = {"max_num_batched_tokens": self.max_num_scheduled_tokens, "max_num_seqs": self.max_num_running_reqs}
        try:
            self.policy = make_policy(name, {**limits, **params}, get_gpu("a100-80gb"))
        except KvschedError as exc:
            if "has no parameter" not in str(exc):
                raise
            self.policy = make_policy(name, params, get_gpu("a100-80gb"))
        self._num: dict[str, int] = {}
        self._by_id: dict[int, object] = {}
        self._t0, self._t0_wall = time.monotonic(), time.time()
        self._steps, self._busy, self._last = 0, 0.0, None
        self._recent_times: deque[float] = deque(maxlen=64)
        self._recent_finished: deque[tuple[int, int]] = deque(maxlen=256)
        self._log_path = os.environ.get("KVSCHED_STEP_LOG")
        if self._log_path:
            with open(self._log_path, "w", newline="") as f:
                csv.writer(f).writerow(STEP_LOG_FIELDS)

    def add_request(self, request) -> None:
        self._num[request.request_id] = k = len(self._num)
        self._by_id[k] = request
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        view = VllmView(self)
        plan = self.policy.schedule(view)
        if not isinstance(plan, Plan):
            raise KvschedError(f"policy {self.policy.name} returned {type(plan).__name__}, not a Plan")
        now = time.monotonic()
        for i in plan.preempt:                              # 2. preemptions, vLLM's own way
            r = self._by_id[i]
            if r.status != RequestStatus.RUNNING:
                raise KvschedError(f"policy {self.policy.name} preempted request {i}, which is not running")
            self.running.remove(r)
            self._preempt_request(r, now)
        chunks = dict(plan.chunks)
        decode = set(view.decoding) if plan.decode is True else set(plan.decode or ())
        keep = decode | set(chunks)
        hidden_running = [r for r in self.running if self._num[r.request_id] not in keep]
        admitted = set(plan.admit)
        original = list(self.waiting)
        before = {r.request_id for r in original}
        hidden_waiting = [r for r in original if self._num[r.request_id] not in admitted]
        budget = self.max_num_scheduled_tokens
        planned = sum(chunks.values()) + len(decode)
        self.running = [r for r in self.running if self._num[r.request_id] in keep]
        self.waiting.remove_requests(hidden_waiting)
        self.max_num_scheduled_tokens = max(planned, 1)
        try:
            out = super().schedule(*args, **kwargs)
        finally:                                            # 3. the hidden requests come back, in order
            self.max_num_scheduled_tokens = budget
            self.running = self.running + hidden_running
            hidden = set(id(r) for r in hidden_waiting)
            still = [r for r in self.waiting]
            fresh = [r for r in still if r.request_id not in before]      # vLLM's own preemptions
            known = {id(r) for r in still} | hidden
            self.waiting.remove_requests(still)
            for r in fresh + [r for r in original if id(r) in known]:
                self.waiting.add_request(r)
        self._log(view, out, planned, now)
        return out

    def _log(self, view: VllmView, out, planned: int, now: float) -> None:
        since = now - self._last if self._last is not None else 0.0
        self._last = now
        if not out.num_scheduled_tokens:
            return
        self._steps += 1
        self._busy += since
        self._recent_times.append(since)
        if not self._log_path:
            return
        prefill = decodes = chunks = ctx = 0
        for rid, n in out.num_scheduled_tokens.items():
            r = self._by_id[self._num[rid]]
            if r.num_output_tokens and r.num_computed_tokens >= r.num_tokens - 1:
                decodes += 1
                ctx += r.num_computed_tokens
            else:
                prefill += n
                chunks += 1
        with open(self._log_path, "a", newline="") as f:
            csv.writer(f).writerow([self._steps, prefill, chunks, decodes, ctx, view.kv_used_blocks, planned,
                                    out.total_num_scheduled_tokens, f"{since:.6f}"])
