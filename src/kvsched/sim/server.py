"""One serving replica, simulated iteration by iteration (ARCHITECTURE.md, "The flow").

Semantics (vLLM's): the last prefill chunk of a request yields its first output token, so a
request with o output tokens then needs o - 1 decode steps; KV holds every token computed so
far (prompt, then one more per decode step: at most prompt + o - 1); preemption is by
recompute: KV freed, the request goes to the front of the queue and later prefills its prompt
plus the tokens it had generated. A request whose KV footprint can never fit, or that is
longer than the model allows, is rejected when it arrives. Closed-loop workloads issue
request i when fewer than concurrency[i] requests are in flight (waiting or running).
"""
from __future__ import annotations

import time as _time
import warnings
from collections import deque
from typing import Callable, Sequence

import numpy as np

from kvsched.cost.shape import BatchShape
from kvsched.errors import KvschedError, PlanError
from kvsched.kvcache import PagedKV
from kvsched.metrics import GapHistogram, RunRecords
from kvsched.policies.base import Plan, Policy
from kvsched.sim.decode_set import DecodeSet
from kvsched.workload.request import Workload

ARRIVING, WAITING, PREFILL, DECODE, DONE, REJECTED = range(6)
INF = float("inf")


class _Queue(Sequence[int]):
    """Read-only face of the waiting deque for policies."""
    __slots__ = ("_q",)

    def __init__(self, q: deque) -> None:
        self._q = q

    def __len__(self) -> int:
        return len(self._q)

    def __getitem__(self, k):
        return self._q[k]

    def __iter__(self):
        return iter(self._q)


class Server:
    """Runs `policy` over `workload` with a KV pool and a batch-time model.

    Implements the policies' read-only `ServerView`. `record_timeline` keeps (time, queue,
    running, KV used) per batch and `record_batches` one row per batch; both are off by
    default so memory stays flat in the number of requests served.
    """

    def __init__(self, workload: Workload, policy: Policy, cost, kv: PagedKV, *,
                 max_model_len: int | None = None, record_timeline: bool = False,
                 record_batches: bool = False, strict: bool = False) -> None:
        if not workload.timed:
            raise KvschedError(f"{workload.source} has no arrival times: give --rate or --arrivals")
        self.workload, self.policy, self.cost, self.kv = workload, policy, cost, kv
        self.cost_model = cost          # part of the view: policies may read batch-time coefficients
        n = len(workload)
        self._arrival = workload.arrival.tolist()
        self._prompt = workload.prompt.tolist()
        self._output = workload.output.tolist()
        self._known = workload.output_known.tolist()
        self._tbt = self._tier_tbt(workload)
        self._priority = [0 if t < 0 else workload.tiers[t].priority for t in workload.tier_index.tolist()]
        self._target = list(self._prompt)
        self._computed = [0] * n
        self._gen = [0] * n
        self._status = [ARRIVING] * n
        # records live in preallocated arrays, so memory does not grow as requests finish
        self._admitted = np.full(n, INF)
        self._first = np.full(n, INF)
        self._finished = np.full(n, INF)
        self._itl_max = np.zeros(n)
        self._viol = np.zeros(n, np.int64)
        self._preempts = np.zeros(n, np.int64)
        self._recomputed = np.zeros(n, np.int64)
        self._last_tok = [0.0] * n
        self._rejected = self._find_rejected(max_model_len, strict)
        self._queue: deque[int] = deque()
        self.waiting = _Queue(self._queue)
        self._running: dict[int, None] = {}
        self._prefilling: dict[int, None] = {}
        self.running = self._running.keys()
        self.prefilling = self._prefilling.keys()
        self._decoders = DecodeSet(kv.block_size)
        self.itl = GapHistogram()
        self.now = 0.0
        self.block_size = kv.block_size
        self.kv_capacity_blocks = kv.capacity_blocks
        self.recent_batch_times: deque[float] = deque(maxlen=64)
        self.recent_finished: deque[tuple[int, int]] = deque(maxlen=1024)
        self.timeline: list[tuple[float, int, int, int]] | None = [] if record_timeline else None
        self.batches: list[tuple] | None = [] if record_batches else None
        self.iterations = 0
        self.issued = 0         # requests that have arrived so far (index order)
        self.in_flight = 0      # arrived, not rejected and not finished

    # ----- the view policies read ------------------------------------------------------
    @property
    def num_decoding(self) -> int:
        return self._decoders.n

    @property
    def kv_used_blocks(self) -> int:
        return self.kv.used

    @property
    def kv_free_blocks(self) -> int:
        return self.kv.capacity_blocks - self.kv.used

    @property
    def decode_new_blocks(self) -> int:
        return self._decoders.new_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def arrival(self, i: int) -> float:
        return self._arrival[i]

    def prompt_len(self, i: int) -> int:
        return self._prompt[i]

    def output_len(self, i: int) -> int | None:
        return self._output[i] if self._known[i] else None

    def prefill_target(self, i: int) -> int:
        return self._target[i]

    def prefill_done(self, i: int) -> int:
        return self._computed[i]

    def generated(self, i: int) -> int:
        return self._decoders.gen(i) if self._status[i] == DECODE else self._gen[i]

    def kv_tokens(self, i: int) -> int:
        return self._decoders.kv(i) if self._status[i] == DECODE else self._computed[i]

    def kv_blocks(self, i: int) -> int:
        return -(-self.kv_tokens(i) // self.block_size)

    def is_decoding(self, i: int) -> bool:
        return self._status[i] == DECODE

    def needs_block(self, i: int) -> bool:
        return self._status[i] == DECODE and self._decoders.kv(i) % self.block_size == 0

    def tier_priority(self, i: int) -> int:
        return self._priority[i]

    # ----- set-up ------------------------------------------------------------------------
    @staticmethod
    def _tier_tbt(w: Workload) -> list[float]:
        slo = [INF if t.tbt_slo is None else t.tbt_slo for t in w.tiers]
        return [INF if t < 0 else slo[t] for t in w.tier_index.tolist()]

    def _find_rejected(self, max_model_len: int | None, strict: bool) -> np.ndarray:
        w, kv = self.workload, self.kv
        footprint = w.prompt + w.output - 1
        too_big = -(-footprint // kv.block_size) > kv.capacity_blocks
        too_long = (w.prompt + w.output > max_model_len) if max_model_len else np.zeros(len(w), bool)
        bad = too_big | too_long
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            why = (f"needs {int(footprint[k])} KV tokens, capacity is {kv.capacity_tokens}"
                   if too_big[k] else f"is {int(w.prompt[k] + w.output[k])} tokens, model max is {max_model_len}")
            msg = (f"{int(bad.sum())} request(s) can never be served; first: request "
                   f"{int(w.ids[k])} (prompt {int(w.prompt[k])}, output {int(w.output[k])}) {why}")
            if strict:
                raise KvschedError(msg)
            warnings.warn(msg + "; they are counted as rejected", stacklevel=3)
        return bad

    # ----- the loop ----------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None = None) -> RunRecords:
        wall0 = _time.perf_counter()
        arrival, status, queue = self._arrival, self._status, self._queue
        rejected = self._rejected.tolist()
        n = len(arrival)
        remaining = n - int(self._rejected.sum())
        for i in np.flatnonzero(self._rejected).tolist():
            status[i] = REJECTED
        nxt = 0
        kv_integral = busy = 0.0
        peak_kv = peak_queue = 0
        self._done = 0
        policy = self.policy
        closed = self.workload.concurrency.tolist() if self.workload.closed_loop else None
        while self._done < remaining:
            now = self.now
            if closed is None:
                while nxt < n and arrival[nxt] <= now:
                    if not rejected[nxt]:
                        status[nxt] = WAITING
                        queue.append(nxt)
                        self.in_flight += 1
                    nxt += 1
            else:                               # closed loop: issue while seats are free
                while nxt < n and self.in_flight < closed[nxt]:
                    arrival[nxt] = now
                    if not rejected[nxt]:
                        status[nxt] = WAITING
                        queue.append(nxt)
                        self.in_flight += 1
                    nxt += 1
            self.issued = nxt
            if len(queue) > peak_queue:
                peak_queue = len(queue)
            if not queue and not self._running:
                while nxt < n and rejected[nxt]:
                    nxt += 1
                if nxt < n:
                    self.now = arrival[nxt]
                continue
            plan = policy.schedule(self)
            dt, held = self._execute(plan)
            if dt is None:                      # empty plan: wait for the next arrival
                while nxt < n and rejected[nxt]:
                    nxt += 1
                if nxt >= n or closed is not None:
                    raise PlanError(
                        f"policy {policy.name} returned an empty plan with {len(queue)} waiting and "
                        f"{len(self._running)} running requests and no arrivals left (deadlock"
                        f"{'; in a closed loop requests arrive only when others finish' if closed else ''})")
                self.now = max(now, arrival[nxt])
                continue
            kv_integral += held * dt
            busy += dt
            if held > peak_kv:
                peak_kv = held
            self.iterations += 1
            if progress is not None and self.iterations % 4096 == 0:
                progress(self._done, remaining)
        bs = self.block_size
        return RunRecords(
            ids=self.workload.ids, arrival=np.array(arrival, np.float64), prompt=self.workload.prompt, output=self.workload.output,
            admitted=self._admitted, first_token=self._first, finished=self._finished,
            preemptions=self._preempts, recomputed=self._recomputed, itl_max=self._itl_max,
            tbt_violations=self._viol, rejected=self._rejected, itl=self.itl,
            iterations=self.iterations, kv_capacity_tokens=self.kv.capacity_tokens,
            kv_time_integral=kv_integral * bs, kv_peak_tokens=peak_kv * bs, peak_queue=peak_queue,
            busy_time=busy, wall_seconds=_time.perf_counter() - wall0)

    def _execute(self, plan: Plan) -> tuple[float | None, int]:
        """Check and run one plan; returns (batch seconds or None if empty, blocks held)."""
        for i in plan.preempt:
            self._preempt(i)
        for i in plan.admit:
            self._admit(i)
        chunks = plan.chunks
        computed, target, status = self._computed, self._target, self._status
        bs = self.block_size
        new_blocks = pt = pattn = pctx = 0
        for i, c in chunks:
            p = computed[i]
            if status[i] != PREFILL or not 0 < c <= target[i] - p or c != int(c):
                self._bad_chunk(i, c)
            new_blocks += -(-(p + c) // bs) - -(-p // bs)
            pt += c
            pattn += c * (p + (c + 1) / 2)
            pctx += p + c
        if len(chunks) > 1 and len({i for i, _ in chunks}) != len(chunks):
            raise PlanError(f"policy {self.policy.name} gave one request two chunks in a batch")
        ds = self._decoders
        nd = ds.n if plan.decode else 0
        if nd:
            new_blocks += ds.new_blocks
        if pt == 0 and nd == 0:
            return None, 0
        kv = self.kv
        held = kv.used + new_blocks
        if held > kv.capacity_blocks:
            raise PlanError(
                f"policy {self.policy.name} planned a batch needing {held} KV blocks; only "
                f"{kv.capacity_blocks} exist ({kv.capacity_blocks * bs} tokens)")
        dt = self.cost.time(BatchShape(pt, len(chunks), pattn, pctx, nd, ds.ctx + nd))
        if not 0 < dt < INF:
            raise KvschedError(f"cost model gave batch time {dt!r}; it must be positive and finite")
        start = self.now
        end = start + dt
        kv.used = held
        if nd:
            self._decode_step(end)
        for i, c in chunks:
            computed[i] += c
            if computed[i] == target[i]:
                self._prefill_complete(i, end)
        self.now = end
        self.recent_batch_times.append(dt)
        if self.timeline is not None:
            self.timeline.append((end, len(self._queue), len(self._running), kv.used * bs))
        if self.batches is not None:
            self.batches.append((start, dt, pt, len(chunks), nd, held * bs))
        return dt, held

    def _bad_chunk(self, i: int, c) -> None:
        state = ("not in its prefill phase" if self._status[i] != PREFILL
                 else f"{self._target[i] - self._computed[i]} prefill tokens left")
        raise PlanError(f"policy {self.policy.name} gave request {i} a chunk of {c} tokens; it is {state}")

    def _admit(self, i: int) -> None:
        if self._status[i] != WAITING:
            raise PlanError(f"policy {self.policy.name} admitted request {i}, which is not waiting")
        q = self._queue
        if q[0] == i:
            q.popleft()
        else:
            q.remove(i)
        self._status[i] = PREFILL
        self._running[i] = None
        self._prefilling[i] = None
        if self._admitted[i] == INF:
            self._admitted[i] = self.now

    def _decode_step(self, end: float) -> None:
        ds = self._decoders
        fresh = ds.fresh
        gap = ds.step(end)
        self.itl.add(gap, ds.n - len(fresh))
        if fresh:
            itl_max, viol, tbt, last, add = self._itl_max, self._viol, self._tbt, self._last_tok, self.itl.add
            for i in fresh:
                g = end - last[i]
                add(g)
                if g > itl_max[i]:
                    itl_max[i] = g
                if g > tbt[i]:
                    viol[i] += 1
            fresh.clear()
        for i in ds.due():
            kv_tokens = self._leave_decode(i)
            self._finish(i, end, kv_tokens)

    def _leave_decode(self, i: int) -> int:
        kv_tokens, gen, last, window = self._decoders.leave(i)
        self._gen[i] = gen
        self._last_tok[i] = last
        if len(window):
            m = float(window.max())
            if m > self._itl_max[i]:
                self._itl_max[i] = m
            if m > self._tbt[i]:
                self._viol[i] += int(np.count_nonzero(window > self._tbt[i]))
        return kv_tokens

    def _prefill_complete(self, i: int, t: float) -> None:
        del self._prefilling[i]
        g = self._gen[i] + 1
        self._gen[i] = g
        if g == 1:
            self._first[i] = t
        else:                                   # resumed after preemption: one long gap
            gap = t - self._last_tok[i]
            self.itl.add(gap)
            if gap > self._itl_max[i]:
                self._itl_max[i] = gap
            if gap > self._tbt[i]:
                self._viol[i] += 1
        self._last_tok[i] = t
        if g >= self._output[i]:
            self._finish(i, t, self._computed[i])
        else:
            self._status[i] = DECODE
            self._decoders.join(i, self._computed[i], g, self._output[i], t)

    def _finish(self, i: int, t: float, kv_tokens: int) -> None:
        self._status[i] = DONE
        self._finished[i] = t
        del self._running[i]
        self.kv.used -= -(-kv_tokens // self.block_size)
        self._done += 1
        self.in_flight -= 1
        self.recent_finished.append((self._prompt[i], self._output[i]))
        self.policy.on_finish(i, self)
        # drop this request's own int/float objects: later reads see shared ones
        self._gen[i] = self._output[i]
        self._computed[i] = 0
        self._last_tok[i] = 0.0

    def _preempt(self, i: int) -> None:
        st = self._status[i]
        if st == DECODE:
            kv_tokens = self._leave_decode(i)
            self._target[i] = self._prompt[i] + self._gen[i]
            self._recomputed[i] += kv_tokens + 1
        elif st == PREFILL:
            kv_tokens = self._computed[i]
            del self._prefilling[i]
            self._recomputed[i] += kv_tokens
        else:
            raise PlanError(f"policy {self.policy.name} preempted request {i}, which is not running")
        self.kv.used -= -(-kv_tokens // self.block_size)
        self._computed[i] = 0
        self._status[i] = WAITING
        del self._running[i]
        self._queue.appendleft(i)
        self._preempts[i] += 1
