"""The reference replica: what the engine computes, written to be read (start here).

One replica, plain Python, one loop, no fast paths: every batch asks the policy for a plan
(`policies/base.py`: preempt, admit, prefill chunks, decode), checks it, prices it with the
cost model and applies it. It follows the engine's semantics (sim/replica.py's docstring,
vLLM's): the last prefill chunk yields the first output token; KV holds every computed token
(prompt + generated - 1 while decoding), counted in blocks; preemption is by recompute.
The engine (sim/replica.py, sim/cluster.py) gives the same per-request times bit for bit:
tests/test_reference.py compares them on random workloads and policies.

Left out, on purpose: prefix caching, clusters and disaggregation, tier histograms, closed
loops and sessions, the progress guard (`stall_batches`), and the engine's shortcuts (decode
runs that skip `schedule` for `decodes_when_idle` policies, cohorts, the compiled paths).
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np

from kvsched.cost.shape import BatchShape
from kvsched.errors import PlanError
from kvsched.policies.base import Plan

INF = float("inf")


class ReferenceReplica:
    """Runs `policy` on `workload` (arrival order) with `capacity_blocks` KV blocks of
    `block_size` tokens and `cost.time(BatchShape) -> seconds`."""

    def __init__(self, workload, policy, cost, capacity_blocks: int, block_size: int) -> None:
        self.w, self.policy, self.cost = workload, policy, cost
        self.cap, self.bs = capacity_blocks, block_size
        n = len(workload)
        self.prompt, self.output = workload.prompt.tolist(), workload.output.tolist()
        self.arrival = workload.arrival.tolist()
        self.target = list(self.prompt)          # prefill target: prompt (+ generated, after a preemption)
        self.computed = [0] * n                  # prefill tokens computed (KV tokens while prefilling)
        self.gen = [0] * n                       # output tokens generated
        self.last = [0.0] * n                    # time of the last output token
        self.admitted, self.first, self.finished = np.full(n, INF), np.full(n, INF), np.full(n, INF)
        self.preempts, self.recomputed = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.itl_max, self.viol = np.zeros(n), np.zeros(n, np.int64)
        tiers = workload.tier_index.tolist()
        self.tbt = [INF if t < 0 or workload.tiers[t].tbt_slo is None else workload.tiers[t].tbt_slo for t in tiers]
        self.rejected = [p + o - 1 > capacity_blocks * block_size for p, o in zip(self.prompt, self.output)]
        self.waiting: deque[int] = deque()       # front first; preempted requests go to the front
        self.running: dict[int, None] = {}       # admission order
        self.prefilling: dict[int, None] = {}
        self.decoding: dict[int, None] = {}      # order of entering the decode phase
        self.used = 0                            # KV blocks held
        self.now, self.last_kind, self.iterations, self.busy = 0.0, 0, 0, 0.0
        self.kv_integral, self.peak_kv = 0.0, 0
        self.recent_times: deque[float] = deque(maxlen=64)
        self.recent_finished: deque[tuple[int, int]] = deque(maxlen=1024)

    # ----- the loop ----------------------------------------------------------------------
    def run(self) -> ReferenceReplica:
        self.upcoming = deque(i for i in range(len(self.arrival)) if not self.rejected[i])
        blocked = False
        while self.upcoming or self.waiting or self.running:
            if self.upcoming and (self.arrival[self.upcoming[0]] <= self.now or blocked
                                  or not (self.waiting or self.running)):
                i = self.upcoming.popleft()                   # a request arrives
                self.now = max(self.now, self.arrival[i])
                self.waiting.append(i)
                blocked = False
                continue
            if blocked:
                raise PlanError(f"policy {self.policy.name} returned an empty plan with no arrivals left")
            blocked = not self.execute(self.policy.schedule(self.view()))
            if not blocked and hasattr(self.policy, "on_batch_end"):
                self.policy.on_batch_end(self.view())
        return self

    # ----- one batch: check the plan, price it, apply it ---------------------------------
    def execute(self, plan: Plan) -> bool:
        """Run one batch; False if the plan computes nothing (wait for an arrival)."""
        for i in plan.preempt:
            self.preempt(i)
        for i in plan.admit:
            if i not in self.waiting:
                raise PlanError(f"policy {self.policy.name} admitted request {i}, which is not waiting")
            self.waiting.remove(i)
            self.running[i] = self.prefilling[i] = None
            if self.admitted[i] == INF:
                self.admitted[i] = self.now
        d = plan.decode
        decoders = list(self.decoding) if d is True else [] if d is False else list(set(d))
        if any(i not in self.decoding for i in decoders):
            raise PlanError(f"policy {self.policy.name} selected a request for decoding that is not decoding")
        chunks = [(i, int(c)) for i, c in plan.chunks]
        if len({i for i, _ in chunks}) != len(chunks):
            raise PlanError(f"policy {self.policy.name} gave one request two chunks in a batch")
        new = sum(self.kv_tokens(i) % self.bs == 0 for i in decoders)      # decoders opening a block
        pt = pattn = pctx = 0
        for i, c in chunks:
            p = self.computed[i]
            if i not in self.prefilling or not 0 < c <= self.target[i] - p:
                raise PlanError(f"policy {self.policy.name} gave request {i} a chunk of {c} tokens it cannot take")
            new += self.blocks(p + c) - self.blocks(p)
            pt, pattn, pctx = pt + c, pattn + c * (p + (c + 1) / 2), pctx + p + c
        if pt == 0 and not decoders:
            return False
        held = self.used + new
        if held > self.cap:
            raise PlanError(f"policy {self.policy.name} planned a batch needing {held} KV blocks; "
                            f"only {self.cap} exist")
        nd, dctx = len(decoders), sum(self.kv_tokens(i) for i in decoders)
        kind = (pt > 0) + 2 * (nd > 0)
        switch = kind != self.last_kind and self.last_kind != 0
        dt = float(self.cost.time(BatchShape(pt, len(chunks), pattn, pctx, nd, dctx + nd,
                                             [(self.computed[i], c) for i, c in chunks], switch)))
        end = self.now + dt
        self.used, self.now, self.last_kind = held, end, kind
        for i in sorted(decoders):                        # one decode token each
            self.token(i, end)
        for i, c in chunks:                               # prefill chunks; the last yields a token
            self.computed[i] += c
            if self.computed[i] == self.target[i]:
                del self.prefilling[i]
                self.token(i, end)
                if i in self.running:
                    self.decoding[i] = None
        self.recent_times.append(dt)
        self.kv_integral += held * dt
        self.busy, self.peak_kv, self.iterations = self.busy + dt, max(self.peak_kv, held), self.iterations + 1
        return True

    def token(self, i: int, t: float) -> None:
        """Request i outputs a token at t (its gap since the last one recorded); done at its length."""
        self.gen[i] += 1
        if self.gen[i] == 1:
            self.first[i] = t
        else:
            gap = t - self.last[i]
            self.itl_max[i] = max(self.itl_max[i], gap)
            self.viol[i] += gap > self.tbt[i]
        self.last[i] = t
        if self.gen[i] == self.output[i]:
            self.finished[i] = t
            self.used -= self.blocks(self.kv_tokens(i))
            del self.running[i]
            self.decoding.pop(i, None)
            self.recent_finished.append((self.prompt[i], self.output[i]))
            if hasattr(self.policy, "on_finish"):
                self.policy.on_finish(i, self.view())

    def preempt(self, i: int) -> None:
        """Free request i's KV; it waits at the queue's front to recompute what it had."""
        if i not in self.running:
            raise PlanError(f"policy {self.policy.name} preempted request {i}, which is not running")
        kv = self.kv_tokens(i)
        self.used -= self.blocks(kv)
        self.recomputed[i] += kv + (i in self.decoding)   # a decoder recomputes its last token too
        self.target[i] = self.prompt[i] + self.gen[i]
        self.computed[i] = 0
        del self.running[i]
        self.prefilling.pop(i, None)
        self.decoding.pop(i, None)
        self.waiting.appendleft(i)
        self.preempts[i] += 1
        if hasattr(self.policy, "on_preempt"):
            self.policy.on_preempt(i, self.view())

    # ----- what the policy reads -----------------------------------------------------------
    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def kv_tokens(self, i: int) -> int:
        return self.prompt[i] + self.gen[i] - 1 if i in self.decoding else self.computed[i]

    def view(self) -> SimpleNamespace:
        """The policy's view (policies/base.py, ServerView), built afresh: slow, and obvious."""
        new = sum(self.kv_tokens(i) % self.bs == 0 for i in self.decoding)
        return SimpleNamespace(
            index=0, role="mixed", now=self.now, waiting=tuple(self.waiting), running=tuple(self.running),
            prefilling=tuple(self.prefilling), decoding=dict.fromkeys(self.decoding).keys(),
            num_decoding=len(self.decoding),
            num_waiting=len(self.waiting), block_size=self.bs, kv_capacity_blocks=self.cap, kv_used_blocks=self.used,
            kv_free_blocks=self.cap - self.used, decode_new_blocks=new, recent_batch_times=tuple(self.recent_times),
            recent_finished=tuple(self.recent_finished), iterations=self.iterations,
            mean_batch_time=self.busy / self.iterations if self.iterations else None,
            arrivals_pending=bool(self.upcoming),
            next_arrival=self.arrival[self.upcoming[0]] if self.upcoming else None,
            cost_model=self.cost, declared_types=self.w.declared_types, prefix_caching=False, prefix_hit_rate=None,
            swapped=0, tier_free_blocks=(), prefix_blocks=lambda i: (),
            blocks_for=self.blocks, arrival=self.arrival.__getitem__, prompt_len=self.prompt.__getitem__,
            output_len=lambda i: self.output[i] if self.w.output_known[i] else None,
            prefill_target=self.target.__getitem__, prefill_done=self.computed.__getitem__,
            generated=self.gen.__getitem__, kv_tokens=self.kv_tokens,
            kv_blocks=lambda i: self.blocks(self.kv_tokens(i)),
            is_decoding=self.decoding.__contains__,
            needs_block=lambda i: i in self.decoding and self.kv_tokens(i) % self.bs == 0,
            tier_priority=lambda i: 0 if self.w.tier_index[i] < 0 else self.w.tiers[self.w.tier_index[i]].priority,
            tbt_slo=self.tbt.__getitem__, last_token_time=lambda i: self.last[i] if self.gen[i] else None,
            cached_tokens=lambda i: 0, prefix_planner=lambda: None, spec_method=None, spec_k=0, spec_pad=lambda computed: 0,
            decode_tokens=len(self.decoding), spec_tokens=lambda i: 0, spec_acceptance=lambda i: None,
            spec_step_blocks=lambda i, s: i in self.decoding and self.kv_tokens(i) % self.bs == 0)
