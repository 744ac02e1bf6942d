"""A kvsched policy inside vLLM: `--scheduler-cls kvsched.engines.vllm_scheduler.KvschedScheduler`
(or `LLM(..., scheduler_cls=...)`). Importing this module imports vLLM.

The policy and its parameters come from the environment, which vLLM's engine-core process
inherits: `KVSCHED_POLICY` (a name from `kvsched policies`, default vllm-v1) and
`KVSCHED_POLICY_PARAMS` (a JSON object of parameters). Policies whose thresholds need a
batch-time model (EB(k*), EB+, WAIT, Nested WAIT) read it from `KVSCHED_COST`: a cost file from
`kvsched calibrate`, or a cost model name, with `KVSCHED_COST_PARAMS` (JSON). The view's
`recent_batch_times` and `mean_batch_time` are the measured step times. `KVSCHED_STEP_LOG`, when set, names a
CSV file that gets one row per step (`STEP_LOG_HEADER`, cost/calibrate.py): the shape of each batch as
`BatchShape` counts it, and `seconds`, the step's measured duration. That is the engine's
cycle, from this step's `schedule()` to the next one's, when requests remain after the step
(the engine steps again at once, so the cycle holds scheduling, the forward pass, sampling,
output processing and request intake: what a simulated batch time stands for); when none
remain, from `schedule()` to the end of `update_from_output()`. `kvsched calibrate` fits cost
models to it (docs/calibration.md).

Which class: vLLM 0.32 turns async scheduling on by default on GPUs, whatever
`--scheduler-cls` says, and off on CPUs (`platforms/cpu.py`). Under async scheduling the engine
schedules step n + 1 while step n runs, and only `AsyncScheduler` counts the tokens in flight
(`num_output_placeholders`); a plain `Scheduler` subclass sees no work for a decode until its
token is back, so it loses the overlap (vLLM logs a warning saying so). Use
`KvschedAsyncScheduler` where async scheduling is on (GPUs), `KvschedScheduler` where it is
off (CPUs, `--no-async-scheduling`); the wrong one is refused at start.

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
simulation: such steps are counted (`departures`, with a warning at the first).
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
import warnings
from collections import deque

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvsched.cost import make_cost_model
from kvsched.cost.calibrate import STEP_LOG_HEADER
from kvsched.errors import KvschedError, PlanError
from kvsched.engines.vllm_replay import engine_policy
from kvsched.policies.base import Plan
from kvsched.sim.plan_check import check as check_plan, kv_error, short as _short

class VllmView:
    """vLLM's scheduler state as kvsched's ServerView (policies/base.py). Request ids are the
    integers kvsched policies expect, assigned in arrival order. A request's tokens include
    those in flight under async scheduling (`num_output_placeholders`, 0 otherwise)."""
    index = 0
    role = "mixed"
    declared_types = None
    prefix_caching = False          # the adapter refuses vLLM's prefix caching (docs/prefix-caching.md)
    prefix_hit_rate = None
    swapped = 0                     # vLLM v1 preempts by recompute only
    tier_free_blocks = ()           # no tiers below the GPU in the adapter
    spec_method = None              # the adapter refuses vLLM's speculative decoding (KvschedScheduler)
    spec_k = 0

    @staticmethod
    def spec_pad(computed: int) -> int:
        return 0

    @staticmethod
    def spec_tokens(i: int) -> int:
        return 0

    @staticmethod
    def spec_acceptance(i: int) -> None:
        return None

    def spec_step_blocks(self, i: int, drafts: int) -> int:
        return self.needs_block(i)

    @property
    def decode_tokens(self) -> int:
        return self.num_decoding

    @staticmethod
    def prefix_blocks(i: int) -> tuple[int, ...]:
        return ()

    @staticmethod
    def prefix_planner() -> None:
        return None

    @staticmethod
    def cached_tokens(i: int) -> int:
        return 0

    def __init__(self, sched: "KvschedScheduler") -> None:
        self._s = sched
        self.now = sched._clock() - sched._t0
        # a live engine cannot know its future arrivals: pending, time unknown (as a closed loop)
        self.arrivals_pending, self.next_arrival = sched._arrivals() if sched._arrivals else (True, None)
        reqs = sched._by_id
        self.waiting = [sched._num[r.request_id] for r in sched.waiting]
        self.running = [sched._num[r.request_id] for r in sched.running]
        self.prefilling = [i for i in self.running if not _decoding(reqs[i])]
        running = set(self.running)     # decoding: in the order they entered decode, as the simulator's;
        self.decoding = [i for i in sched._decode_order if i in running and _decoding(reqs[i])]
        known = set(self.decoding)      # under async scheduling a prefill's last chunk may still be in flight
        self.decoding += [i for i in self.running if i not in known and _decoding(reqs[i])]
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

    @property
    def cost_model(self):
        """The batch-time model of KVSCHED_COST, for policies whose thresholds need one."""
        if self._s._cost is None:
            raise KvschedError(f"policy {self._s.policy.name} needs a batch-time model inside vLLM: set KVSCHED_COST "
                               "to a cost file from `kvsched calibrate` (or a cost model name)")
        return self._s._cost

    def _r(self, i: int):
        return self._s._by_id[i]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def arrival(self, i: int) -> float:
        return self._r(i).arrival_time - self._s._t0_wall

    def prompt_len(self, i: int) -> int:
        return self._r(i).num_prompt_tokens

    def output_len(self, i: int):
        """max_tokens when the request ignores EOS (then it is the output length), else None."""
        sp = self._r(i).sampling_params
        return sp.max_tokens if sp is not None and sp.ignore_eos else None

    def prefill_target(self, i: int) -> int:
        r = self._r(i)
        return _tokens(r) - 1 if _decoding(r) else _tokens(r)

    def prefill_done(self, i: int) -> int:
        return self._r(i).num_computed_tokens

    def generated(self, i: int) -> int:
        r = self._r(i)
        return r.num_output_tokens + r.num_output_placeholders

    def kv_tokens(self, i: int) -> int:
        return self._r(i).num_computed_tokens

    def kv_blocks(self, i: int) -> int:
        return self.blocks_for(self._r(i).num_computed_tokens)

    def is_decoding(self, i: int) -> bool:
        return i in self._decoding_set

    def needs_block(self, i: int) -> bool:
        return i in self._decoding_set and self._r(i).num_computed_tokens % self.block_size == 0

    def tier_priority(self, i: int) -> int:
        return self._r(i).priority

    def tbt_slo(self, i: int) -> float:
        return math.inf

    def last_token_time(self, i: int):
        return self._s._last_token.get(i)


def _tokens(r) -> int:
    """Prompt and output tokens, those in flight under async scheduling included."""
    return r.num_tokens + r.num_output_placeholders


def _decoding(r) -> bool:
    return r.num_computed_tokens >= _tokens(r) - 1 and r.num_output_tokens + r.num_output_placeholders > 0


class KvschedScheduler(Scheduler):
    """vLLM's v1 Scheduler with a kvsched policy choosing each step (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _check_class(self)
        if self.vllm_config.speculative_config is not None:
            raise KvschedError("the kvsched adapter does not steer speculative decoding yet (its plans count one "
                               "token per decoder): run vLLM without --speculative-config, or simulate it with --spec")
        if self.cache_config.enable_prefix_caching:
            raise KvschedError("the kvsched adapter needs prefix caching off (--no-enable-prefix-caching): kvsched's "
                               "KV model has no shared blocks yet, so plans would not match vLLM's KV")
        name = os.environ.get("KVSCHED_POLICY", "vllm-v1")
        params = _json_env("KVSCHED_POLICY_PARAMS")
        self.policy = engine_policy(name, params, self.max_num_scheduled_tokens, self.max_num_running_reqs,
                                    self.scheduler_config.long_prefill_token_threshold)
        self._cost = _cost_from_env()
        self._count = 0                                     # requests seen: ids are 0.._count-1
        self._num: dict[str, int] = {}                      # live requests: vLLM id -> kvsched id
        self._by_id: dict[int, object] = {}
        self._clock = time.monotonic                       # what policies see as time (set_clock)
        self._arrivals = None
        self._t0, self._t0_wall = time.monotonic(), time.time()
        self._steps, self._busy = 0, 0.0
        self.departures = 0                                 # steps vLLM ran otherwise than planned
        self._pending: dict[int, tuple[list, set]] = {}     # id(output) -> (chunk order, planned preemptions)
        self._open: tuple[float, list] | None = None        # the last step scheduled, until it ends
        self._recent_times: deque[float] = deque(maxlen=64)
        self._recent_finished: deque[tuple[int, int]] = deque(maxlen=1024)    # as the simulator keeps
        self._last_token: dict[int, float] = {}
        self._decode_order: dict[int, None] = {}          # decoding requests, by decode-phase entry
        self._hooks = {h: getattr(self.policy, h, None) for h in ("on_finish", "on_preempt", "on_batch_end")}
        self._log = None
        path = os.environ.get("KVSCHED_STEP_LOG")
        if path:                                            # line-buffered: a row is on disk once written
            try:
                self._log_file = open(path, "w", newline="", buffering=1)
            except OSError as exc:
                raise KvschedError(f"KVSCHED_STEP_LOG={path}: cannot write it: {exc.strerror or exc}") from None
            self._log = csv.writer(self._log_file)
            self._log.writerow(STEP_LOG_HEADER)

    def set_clock(self, clock, arrivals=None, arrival_origin: float = 0.0) -> None:
        """Run on another clock (seconds): a replay's simulated time instead of the wall's, so
        that time-driven policies (SLAI's deadlines, measured batch times) see the steps the
        replay makes. `arrivals() -> (pending, next arrival time)` tells policies what a replay
        knows of future arrivals, as the simulator does. Request arrival times are then read from
        `arrival_origin`."""
        self._clock, self._t0, self._t0_wall = clock, clock(), arrival_origin
        self._arrivals = arrivals

    def add_request(self, request) -> None:
        self._num[request.request_id] = k = self._count
        self._count += 1
        self._by_id[k] = request
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        start = self._clock()
        self._close_step(start)
        if not self.running and not self.waiting:           # nothing to plan for
            return super().schedule(*args, **kwargs)
        view = VllmView(self)
        plan = _check_plan(self._call("schedule", self.policy.schedule, view), view, self.policy.name)
        chunks = dict(plan.chunks)
        decode = set(view.decoding) - set(plan.preempt) if plan.decode is True else set(plan.decode or ())
        self._check_limits(view, plan, sum(chunks.values()) + len(decode))
        for i in plan.preempt:                              # 2. preemptions, vLLM's own way
            r = self._by_id[i]
            self.running.remove(r)
            self._preempt_request(r, time.monotonic())
            self._left_decode(i)
            self._hook("on_preempt", i)
        out = self._steered(plan, chunks, decode)
        if out.num_scheduled_tokens:
            self._open = (start, self._shape_row(out, view, sum(chunks.values()) + len(decode)))
            self._pending[id(out)] = (list(chunks), set(plan.preempt))
        self._check_departure(out, chunks, decode)
        return out

    def _check_limits(self, view: VllmView, plan: Plan, planned: int) -> None:
        """The engine's own limits, which simulation does not have: vLLM sizes its buffers to them."""
        if planned > self.max_num_scheduled_tokens:
            raise PlanError(f"policy {self.policy.name} planned a batch of {planned} tokens; this engine's "
                            f"max_num_batched_tokens is {self.max_num_scheduled_tokens}: raise it, or lower the "
                            "policy's budget")
        seats = len(view.running) - len(plan.preempt) + len(plan.admit)
        if seats > self.max_num_running_reqs:
            raise PlanError(f"policy {self.policy.name} planned {seats} running requests; this engine's max_num_seqs "
                            f"is {self.max_num_running_reqs}: raise it, or lower the policy's limit")

    def _steered(self, plan: Plan, chunks: dict[int, int], decode: set[int]):
        """vLLM's schedule() over only what the plan runs, in the plan's order (decodes, then the
        chunks; admissions in plan order), with the plan's token count as the budget and vLLM's
        own admission rules (whole-prompt reservation, long-prefill cap) off: the plan decided."""
        order = {i: k for k, i in enumerate([*decode, *chunks])}
        num = self._num
        original_running = list(self.running)
        hidden_running = [r for r in original_running if num[r.request_id] not in order]
        original = list(self.waiting)
        before = {r.request_id for r in original}
        rank = {i: k for k, i in enumerate(plan.admit)}
        hidden_waiting = [r for r in original if num[r.request_id] not in rank]
        saved = (self.max_num_scheduled_tokens, self.scheduler_reserve_full_isl,
                 self.scheduler_config.long_prefill_token_threshold)
        self.running = sorted((r for r in original_running if num[r.request_id] in order),
                              key=lambda r: order[num[r.request_id]])
        self.waiting.remove_requests(original)
        for r in sorted((r for r in original if num[r.request_id] in rank), key=lambda r: rank[num[r.request_id]]):
            self.waiting.add_request(r)
        self.max_num_scheduled_tokens = max(sum(chunks.values()) + len(decode), 1)
        self.scheduler_reserve_full_isl = False
        self.scheduler_config.long_prefill_token_threshold = 0
        try:
            return super().schedule()
        finally:                                            # 3. the hidden requests come back, in order
            (self.max_num_scheduled_tokens, self.scheduler_reserve_full_isl,
             self.scheduler_config.long_prefill_token_threshold) = saved
            # running order is admission order (vLLM preempts from its end, policies read it)
            now_running = {id(r) for r in self.running} | {id(r) for r in hidden_running}
            before_running = {id(r) for r in original_running}
            self.running = ([r for r in original_running if id(r) in now_running]
                            + [r for r in self.running if id(r) not in before_running])
            still = list(self.waiting)
            fresh = [r for r in still if r.request_id not in before]      # vLLM's own preemptions
            known = {id(r) for r in still} | {id(r) for r in hidden_waiting}
            self.waiting.remove_requests(still)
            for r in fresh + [r for r in original if id(r) in known]:
                self.waiting.add_request(r)

    def _call(self, where: str, fn, *args):
        """A policy call; what it raises stops the engine with one error naming the policy."""
        try:
            return fn(*args)
        except KvschedError:
            raise
        except Exception as exc:
            raise PlanError(f"policy {self.policy.name} raised {type(exc).__name__} in {where}: "
                            f"{_short(exc, 300)}") from exc

    def _hook(self, name: str, *args) -> None:
        if self._hooks[name]:
            self._call(name, self._hooks[name], *args, VllmView(self))

    def update_from_output(self, scheduler_output, model_runner_output):
        result = super().update_from_output(scheduler_output, model_runner_output)
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is None:
            return result
        if not self.has_unfinished_requests():  # idle until the next request: the step ends here
            self._close_step(self._clock())
        self._after_batch(scheduler_output, model_runner_output, *pending, self._clock() - self._t0)
        return result

    def _after_batch(self, out, model_output, order: list[int], planned_preempt: set[int], now: float) -> None:
        """Token times, finishes and the policy's hooks, as the simulator calls them. Requests
        whose prefill completed enter the decode phase in the plan's chunk order, as there."""
        for rid in out.preempted_req_ids or ():
            i = self._num.get(rid)
            if i is not None and i not in planned_preempt:     # vLLM's own preemption
                self._left_decode(i)
                self._hook("on_preempt", i)
        sampled = {self._num[rid] for rid, tokens in zip(model_output.req_ids, model_output.sampled_token_ids)
                   if len(tokens) and rid in self._num}
        for i in [*(i for i in order if i in sampled), *sorted(sampled)]:
            self._last_token[i] = now
            self._decode_order.setdefault(i)
        finished = [self._num[rid] for rid in out.num_scheduled_tokens
                    if rid in self._num and self._by_id[self._num[rid]].is_finished()]
        for i in finished:
            self._finished(i)
        self._hook("on_batch_end")

    def finish_requests(self, request_ids, finished_status):
        """Aborts and stops from outside the step: the policy hears of them as finishes."""
        result = super().finish_requests(request_ids, finished_status)
        for r in result or ():
            i = self._num.get(r.request_id)
            if i is not None:
                self._finished(i)
        return result

    def _finished(self, i: int) -> None:
        r = self._by_id[i]
        self._recent_finished.append((r.num_prompt_tokens, r.num_output_tokens))
        self._hook("on_finish", i)
        del self._by_id[i], self._num[r.request_id]
        self._left_decode(i)
        self._last_token.pop(i, None)

    def _check_departure(self, out, chunks: dict[int, int], decode: set[int]) -> None:
        """Count (and warn once about) steps whose tokens per request are not the plan's (vLLM
        may still run a plan otherwise, e.g. a chunk it cannot allocate)."""
        done = {self._num[rid]: n for rid, n in out.num_scheduled_tokens.items()}
        if done == {**chunks, **dict.fromkeys(decode, 1)}:
            return
        self.departures += 1
        if self.departures == 1:
            warnings.warn(f"policy {self.policy.name}: vLLM scheduled other tokens per request than the plan "
                          f"(step {self._steps + 1}); such steps are counted in KvschedScheduler.departures",
                          stacklevel=2)

    def _left_decode(self, i: int) -> None:
        self._decode_order.pop(i, None)

    def _close_step(self, now: float) -> None:
        """The last step scheduled ends here: at the next schedule() (the engine stepped again at
        once; under async scheduling that is while the step still runs, so each row is one
        cycle) or, when no request remains, at its update."""
        if self._open is not None:
            start, row = self._open
            self._open = None
            self._record(row, now - start)

    def _record(self, row: list, seconds: float) -> None:
        self._steps += 1
        self._busy += seconds
        self._recent_times.append(seconds)
        if self._log is not None:
            self._log.writerow([self._steps, *row, f"{seconds:.6f}"])

    def shutdown(self) -> None:
        if self._log is not None:
            self._log_file.close()
            self._log = None
        super().shutdown()

    def _shape_row(self, out, view: VllmView, planned: int) -> list:
        """The batch as BatchShape counts it (cost/shape.py), in STEP_LOG_HEADER order."""
        pt = pchunks = pattn = pctx = decodes = dctx = 0
        chunks = []
        for rid, c in out.num_scheduled_tokens.items():
            r = self._by_id[self._num[rid]]
            p = r.num_computed_tokens - c                   # vLLM advanced it already
            if self._num[rid] in view._decoding_set:
                decodes += 1
                dctx += p + 1
            else:
                pt += c
                pchunks += 1
                pattn += c * p + c * (c + 1) // 2          # c (p + (c + 1) / 2), exactly
                pctx += p + c
                chunks.append(f"{p}:{c}")
        return [pt, pchunks, int(pattn), pctx, decodes, dctx, " ".join(chunks), view.kv_used_blocks, planned,
                out.total_num_scheduled_tokens]


def _cost_from_env():
    """KVSCHED_COST (a cost file or a cost model name) with KVSCHED_COST_PARAMS (JSON), or None."""
    name = os.environ.get("KVSCHED_COST")
    params = _json_env("KVSCHED_COST_PARAMS")
    if not name:
        if params:
            raise KvschedError("KVSCHED_COST_PARAMS is set but KVSCHED_COST is not: name the cost model or file")
        return None
    return make_cost_model(name, params, None, None)


def _json_env(var: str) -> dict:
    try:
        params = json.loads(os.environ.get(var) or "{}")
    except json.JSONDecodeError as exc:
        raise KvschedError(f"{var} is not a JSON object: {exc}") from None
    if not isinstance(params, dict):
        raise KvschedError(f"{var} must be a JSON object of parameters")
    return params


class KvschedAsyncScheduler(KvschedScheduler, AsyncScheduler):
    """KvschedScheduler for engines with async scheduling on (vLLM's GPU default)."""


def _check_class(s: Scheduler) -> None:
    on = bool(s.vllm_config.scheduler_config.async_scheduling)
    if on != isinstance(s, AsyncScheduler):
        want = "KvschedAsyncScheduler" if on else "KvschedScheduler"
        raise KvschedError(f"async scheduling is {'on' if on else 'off'} in this engine: use "
                           f"--scheduler-cls kvsched.engines.vllm_scheduler.{want}")


class _EngineState:
    """What the plan check (sim/plan_check.py, its `PlanState`) reads of this engine's state."""

    def __init__(self, view: VllmView) -> None:
        self.count, self.index, self._v = view._s._count, 0, view
        self.running, self.prefilling, self.decoders = set(view.running), set(view.prefilling), view._decoding_set
        self._waiting = set(view.waiting)

    def waiting_here(self, i: int) -> bool:
        return i in self._waiting

    is_waiting = waiting_here

    def prefill_left(self, i: int) -> int:
        return self._v.prefill_target(i) - self._v.prefill_done(i)

    def restart_target(self, i: int) -> int:
        return self._v.prompt_len(i) + self._v.generated(i)


def _check_plan(plan, view: VllmView, name: str) -> Plan:
    """The simulator's plan check (sim/plan_check.py, the same messages: a bad plan fails the
    same way inside vLLM as in simulation), then what only this engine needs: every admitted
    request computes tokens, and the plan's KV fits the engine's free blocks (counted as the
    simulator's pool counts them, without prefix caching, which the adapter refuses)."""
    preempt, admit, chunks, decode = check_plan(plan, _EngineState(view), name)
    plan = Plan(admit, chunks, decode, preempt)
    chunked = {i for i, _ in plan.chunks}
    idle = [i for i in plan.admit if i not in chunked]
    if idle:                                                # vLLM admits a request only with tokens
        raise PlanError(f"policy {name} admitted request {idle[0]} without a chunk: inside vLLM a request is "
                        "admitted only when it computes tokens (the adapter cannot hold it admitted and idle)")
    gone = set(plan.preempt)
    new_blocks = 0
    for i, c in plan.chunks:
        p = 0 if i in gone else view.prefill_done(i)
        new_blocks += view.blocks_for(p + c) - view.blocks_for(p)
    selected = [i for i in view.decoding if i not in gone] if plan.decode is True else plan.decode or ()
    new_blocks += sum(view.needs_block(i) for i in selected)
    held = view.kv_used_blocks - sum(view.kv_blocks(i) for i in plan.preempt) + new_blocks
    if held > view.kv_capacity_blocks:
        raise kv_error(name, held, view.kv_capacity_blocks, view.block_size)
    return plan
