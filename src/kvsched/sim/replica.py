"""One serving replica, simulated iteration by iteration, behind a step API
(docs/architecture.md, "Replica").

Semantics (vLLM's): the last prefill chunk of a request yields its first output token, so a
request with o output tokens then needs o - 1 decode steps; KV holds every token computed so
far (prompt, then one more per decode step: at most prompt + o - 1); preemption is by
recompute: KV freed, the request goes to the front of the queue and later prefills its prompt
plus the tokens it had generated. A policy may decode a subset of the decoders; the others
are paused with their KV held.

Step API: `next_event_time()` is when the replica next decides (its clock, or infinity while
it is idle or its policy waits for an event); `accept(i, t)` takes a routed request;
`land(i, t)` takes a request whose KV arrived from a prefill replica; `step()` asks the
policy for a plan and runs that batch at once: its effects land at the batch's end, where the
replica's clock moves. Between the start and the end of a batch, routers see the replica as
it was at the start (`outstanding`, `kv_used_blocks` and `prefill_backlog` of the router
summary), plus the requests routed to it since.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

import numpy as np
from numbers import Real
from math import log as _log

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.cost.shape import BatchShape
from kvsched.errors import PASS_THROUGH, KvschedError, PlanError
from kvsched.kvcache import PagedKV
from kvsched.metrics import GapHistogram
from kvsched.policies.base import NOOP_HOOKS, Plan, decodes_when_idle, defined_in
from kvsched.sim.decode_set import Cohort, DecodeSet
from kvsched.sim.plan_check import check as check_plan, kv_error, short as _short
from kvsched.sim.prefix_cache import HitPlanner, LazyPlanner, PrefixCache
from kvsched.sim.requests import DECODE, DONE, INF, PREFILL, TRANSFER, WAITING, RequestTable
from kvsched.sim.rowlog import BATCHES, CHUNK, TIMELINE, RowLog
from kvsched.sim.view import ReadOnlyKeys, ReadOnlySeq, ReplicaView


DEFAULT_STALL_BATCHES = 100_000
IDLE_PLAN = Plan([], [], True, [])      # what a `decodes_when_idle` policy plans when idle (read only)


class PlanFace:
    """What the plan check (sim/plan_check.py, its `PlanState`) reads of a replica: live
    references to its containers and the request table's lists."""
    __slots__ = ("count", "index", "running", "prefilling", "decoders", "_queue", "_status", "_target",
                 "_computed", "_prompt", "_gen")

    def __init__(self, rep: "Replica") -> None:
        r = rep.reqs
        self.count, self.index = r.n, rep.index
        self.running, self.prefilling, self.decoders = rep._running, rep._prefilling, rep._decoders.where
        self._queue, self._status, self._target, self._computed = rep._queue, r.status, r.target, r.computed
        self._prompt, self._gen = r.prompt, r.gen

    def waiting_here(self, i: int) -> bool:
        q = self._queue                         # the front at once; elsewhere a scan, as the admission's
        return self._status[i] == WAITING and bool(q) and (q[0] == i or i in q)

    def is_waiting(self, i: int) -> bool:
        return self._status[i] == WAITING

    def prefill_left(self, i: int) -> int:
        return self._target[i] - self._computed[i]

    def restart_target(self, i: int) -> int:
        c = self.decoders.get(i)                # a decoder's tokens are its cohort's (the table's lag)
        return self._prompt[i] + (self._gen[i] if c is None else c.progress(i)[1])


class Arrivals:
    """What replicas may know of future arrivals (set by the loop that feeds them)."""
    __slots__ = ("pending", "next_time")

    def __init__(self) -> None:
        self.pending = True
        self.next_time: float | None = None


class Replica:
    """A replica running `policy` with a KV pool and a batch-time model over requests of
    `reqs`. `role` is "mixed", "prefill" (a request's first token hands it off through
    `handoff(i, t)` instead of decoding here) or "decode" (requests arrive by `land`)."""

    def __init__(self, reqs: RequestTable, policy, cost, kv: PagedKV, *, index: int = 0,
                 role: str = "mixed", arrivals: Arrivals | None = None, record_timeline: bool = False,
                 record_batches: bool = False, stall_batches: int = DEFAULT_STALL_BATCHES,
                 handoff: Callable[[int, float], None] | None = None, share: float = 1.0,
                 prefix_caching: bool = False, on_done: Callable[[int, float], None] | None = None,
                 itl_bins: list[int] | None = None, tier_bins: list[list[int]] | None = None) -> None:
        if stall_batches < 1:
            raise KvschedError(f"stall_batches must be >= 1, got {stall_batches}")
        self.reqs, self.policy, self.cost, self.kv = reqs, policy, cost, kv
        self.index, self.role = index, role
        self.name = getattr(policy, "name", type(policy).__name__)
        self.block_size = bs = kv.block_size
        self.kv_capacity_blocks = kv.capacity_blocks
        self._arrivals = arrivals or Arrivals()
        self._handoff = handoff
        self._on_done = on_done             # on_done(i, t): request i finished at t (sessions' next turns)
        self._stall_limit = stall_batches
        self._stall = 0
        self._queue: deque[int] = deque()
        self._running: dict[int, None] = {}
        self._prefilling: dict[int, None] = {}
        self._landing: deque[int] = deque()
        self.pulls: deque[int] = deque()        # decode role: handed-off requests waiting for KV room
        self._decoders = DecodeSet(bs, self._move)
        # prefix caching (sim/prefix_cache.py): admitted requests whose hit is taken at their first chunk
        self.cache = PrefixCache(kv, reqs) if prefix_caching else None
        self._fresh: set[int] = set()
        self._order: dict[int, int] = {}        # cached: admission sequence (vLLM's running order)
        self._admissions = 0
        self._finishing: list[tuple[int, int]] = []     # cached: the batch's finished requests, freed at its end
        self._where = self._decoders.where
        # the table's per-request lists, aliased for the view's hot reads (mutated in place only)
        self._arrival, self._prompt, self._output, self._known = reqs.arrival, reqs.prompt, reqs.output, reqs.known
        self._target, self._computed, self._status = reqs.target, reqs.computed, reqs.status
        # inter-token gaps; a cluster's replicas share the bins (`itl_bins`, `tier_bins`: only
        # their sum is reported, and bins cost ~120 KB a histogram), each keeps its own count,
        # sums and maximum: in a cluster a replica's histogram alone is not its gaps, only
        # `GapHistogram.merged` over all of them (or `merged_tiers`) is a histogram
        self.itl = GapHistogram(counts=itl_bins)
        # per-tier inter-token gaps, kept only when the workload has tiers (`_decode_step` and
        # `_fold` add to them then)
        self.tier_itl: list[GapHistogram] | None = None
        if reqs.workload.tiers:
            self.tier_itl = [GapHistogram(counts=None if tier_bins is None else tier_bins[t])
                             for t in range(len(reqs.workload.tiers))]
        self.now = 0.0
        self.iterations = 0
        self._last_kind = 0             # kind of the previous batch (BatchShape.phase_switch)
        self.busy = 0.0
        self.kv_integral = 0.0
        self.peak_kv = 0
        self.peak_queue = 0
        self.preemptions = 0
        self.outstanding = 0            # waiting + running here
        self.prefill_backlog = 0        # prefill tokens still to compute for waiting + prefilling
        self._blocked = False           # the policy returned an empty plan: wait for an event
        self._snap = (0, 0, 0)          # router summary at the current batch's start
        self.track_start = False        # keep _snap (the cluster sets it for state-based routers)
        self.recent_batch_times: deque[float] = deque(maxlen=64)
        self.recent_finished: deque[tuple[int, int]] = deque(maxlen=1024)
        # (end, queue, running, KV tokens) and (start, duration, prefill tokens, prefill requests,
        # decode requests, KV tokens) per batch, spilled to disk in chunks (memory stays flat)
        self.timeline: RowLog | None = RowLog(TIMELINE.kinds) if record_timeline else None
        self.batches: RowLog | None = RowLog(BATCHES.kinds) if record_batches else None
        self._schedule = policy.schedule
        self._on_finish = self._hook("on_finish")
        self._on_preempt = self._hook("on_preempt")
        self._on_batch_end = self._hook("on_batch_end")
        # user code that runs while a plan is applied (hooks, a cost model not kvsched's), and could
        # edit the policy's lists: the check copies them then
        self._plan_hooks = (self._on_finish is not None or self._on_preempt is not None
                            or not type(cost).__module__.startswith("kvsched."))
        # the policy promises Plan([], [], True, []) while nothing waits or prefills and the
        # decoders fit (policies/base.py, `decodes_when_idle`): such batches skip `schedule`
        self._steady = decodes_when_idle(policy)
        self.runs_ahead = False                 # the cluster loop lets steady batches run to its next event
        self._decode_time = _decode_time(cost)
        self._face = PlanFace(self)
        self.view = ReplicaView(self, {
            "index": index, "role": role, "block_size": bs, "kv_capacity_blocks": kv.capacity_blocks,
            "waiting": ReadOnlySeq(self._queue), "running": self._running.keys(),
            "prefilling": self._prefilling.keys(), "decoding": ReadOnlyKeys(self._decoders.where),
            "recent_batch_times": ReadOnlySeq(self.recent_batch_times),
            "recent_finished": ReadOnlySeq(self.recent_finished),
            "_output": reqs.output_ro, "_admitted": ReadOnlySeq(reqs.admitted),
            "declared_types": _declared(reqs.workload.declared_types, share),
            "prefix_caching": prefix_caching})

    def _hook(self, name: str):
        """The policy's hook, or None (absent, or marked `noop_hook`: nothing to call)."""
        fn = getattr(self.policy, name, None)
        return fn if callable(fn) and getattr(fn, "__func__", fn) not in NOOP_HOOKS else None

    # ----- what the view reads (sim/view.py holds the per-request reads) ---------------
    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def mean_batch_time(self) -> float | None:
        return self.busy / self.iterations if self.iterations else None

    def prefix_planner(self) -> HitPlanner | None:
        """What a plan being built finds in the cache (None without prefix caching)."""
        c = self.cache
        if c is None:
            return None
        return LazyPlanner(c, self) if c.inert else HitPlanner(c, self)

    def awaits_hit(self, i: int) -> bool:
        """Request i takes its cache hit at its next chunk (waiting, or admitted without a chunk yet)."""
        return self._status[i] == WAITING or i in self._fresh

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens taken from the cache so far (None: none looked up)."""
        c = self.cache
        return c.hit_tokens / c.query_tokens if c is not None and c.query_tokens else None

    # ----- router summary --------------------------------------------------------------
    def summary_at(self, t: float) -> tuple[int, int, int]:
        """(outstanding, KV blocks in use, queued prefill tokens) as a router sees them at t:
        during a batch, its state at the batch's start plus the requests routed since.
        Outstanding counts requests waiting for their KV to be pulled here."""
        if t >= self.now:
            return self.outstanding + len(self.pulls), self.kv.used, self.prefill_backlog
        out, kv, backlog = self._snap
        return out + len(self.pulls), kv, backlog

    # ----- step API ----------------------------------------------------------------------
    def next_event_time(self) -> float:
        if self._blocked or not (self._queue or self._running or self._landing):
            return INF
        return self.now

    @cython.locals(r="RequestTable")
    def accept(self, i: int, t: float) -> None:
        """A request routed here arrives at t."""
        r = self.reqs
        r.status[i] = WAITING
        self._queue.append(i)
        r.in_flight += 1
        self._arrived(t, r.target[i])

    def _arrived(self, t: float, prefill_tokens: int) -> None:
        """One more request here at t (waiting, or landed to decode), with its prefill tokens."""
        self.outstanding += 1
        self.prefill_backlog += prefill_tokens
        if t > self.now:
            self.now = t
        self._blocked = False
        if self.now > t and self.track_start:     # mid-batch: routers see it from now on
            out, kv, pre = self._snap
            self._snap = (out + 1, kv, pre + prefill_tokens)

    def reserve(self, i: int, t: float) -> bool:
        """Reserve KV for request i's transfer at t if it fits beside the decoders here (and one
        decode step of them all); during a batch, judged by the KV held at the batch's start."""
        tokens = self.reqs.computed[i]
        bs = self.block_size
        need = -(-tokens // bs)
        mid = t < self.now and self.track_start
        used = self._snap[1] if mid else self.kv.used
        if used + need + self._decoders.new_blocks + (tokens % bs == 0) > self.kv.capacity_blocks:
            return False
        if self.cache is None:
            self.kv.used += need
        else:
            self.cache.allocate(need)
        if mid:
            out, kv, pre = self._snap
            self._snap = (out, kv + need, pre)
        return True

    def land(self, i: int, t: float) -> None:
        """The KV of a prefilled request (reserved here) arrives at t; it decodes from the next
        batch on."""
        self._landing.append(i)
        self._arrived(t, 0)

    def release(self, i: int, t: float) -> None:
        """The KV of request i (handed off) has left this replica at t."""
        self._free(i, self.reqs.computed[i], True)
        self._order.pop(i, None)        # its admission rank: kept only while it runs here
        self.wake(t)

    def wake(self, t: float) -> None:
        """Something this replica may wait for happened at t (a blocked policy plans again)."""
        if self._blocked:
            self._blocked = False
            if t > self.now:
                self.now = t

    def step(self, until: float = 0.0) -> bool:
        """Plan and run one batch at the replica's clock. Returns False if the policy planned
        nothing (the replica then waits for the next event routed to it). With a policy that
        `decodes_when_idle`, decode-only batches run back to back while the clock is before
        `until` (the caller's next event: nothing else may happen before it)."""
        if self._landing:
            self._land_ready()
        if self._steady and not self._queue and self._idle_fits():
            try:
                self._decode_run(until)
            except KvschedError:
                raise
            except PASS_THROUGH:
                raise
            except BaseException as exc:        # the only user code here that is not wrapped: the cost model
                raise self._cost_failed(exc) from exc
            return True
        q = len(self._queue)
        if q > self.peak_queue:
            self.peak_queue = q
        try:
            plan = self._schedule(self.view)
        except KvschedError as exc:
            raise self._named(exc) from exc
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise self._policy_failed("schedule", exc) from exc
        try:
            ran = self._execute(plan)
        except KvschedError:
            raise
        except PASS_THROUGH:
            raise
        except BaseException as exc:            # e.g. a generator in the plan that raises
            raise PlanError(f"policy {self.name} gave a plan that cannot be read: {type(exc).__name__}: "
                            f"{_short(exc, 120)}") from exc
        if not ran:
            self._blocked = True
            return False
        if self._on_batch_end is not None:
            self._call(self._on_batch_end, "on_batch_end", None)
        return True

    # ----- decode-only batches without the policy -----------------------------------
    @cython.locals(ds="DecodeSet", c="Cohort", kv="PagedKV")
    def _idle_fits(self) -> bool:
        """Nothing waits or prefills here, the decoders are one cohort and one decode step of
        them all fits in free KV: the state where a steady policy decodes everyone."""
        ds = self._decoders
        if self._queue or self._prefilling or not ds.n or len(ds.cohorts) != 1:
            return False
        c = ds.cohorts[0]
        kv = self.kv
        return kv.used + c.residue[-c.clock % self.block_size] <= kv.capacity_blocks

    def _decode_run(self, until: float) -> None:
        """The batches `_execute` runs for Plan([], [], True, []), bit for bit, while the
        state stays idle (`_idle_fits`) and the clock is before `until`; at least one.
        Without tiers or an `on_batch_end` hook they take the inlined `_plain_decodes`."""
        if self.pulls:                          # the cluster pulls KV here after every batch
            until = 0.0
        if self._on_batch_end is None and self.tier_itl is None:
            c = self._decoders.cohorts[0]
            self._plain_decodes(c, until)
            return
        while True:                             # tiers or a batch hook: the general batch
            self._execute(IDLE_PLAN)
            if self._on_batch_end is not None:
                self._call(self._on_batch_end, "on_batch_end", None)
            if not (self.now < until and self._idle_fits()):
                return

    @cython.locals(bs=cython.longlong, cap=cython.longlong, n=cython.longlong, clock=cython.longlong,
                   ctx=cython.longlong, used=cython.longlong, f=cython.longlong, switch=cython.bint,
                   now=cython.double, last=cython.double, counts=list, log_low=cython.double,
                   scale=cython.double, low=cython.double, top=cython.longlong, total=cython.double,
                   total_sq=cython.double, gmax=cython.double, hn=cython.longlong, kv_integral=cython.double,
                   busy=cython.double, peak=cython.longlong, k=cython.longlong, k0=cython.longlong,
                   running=cython.Py_ssize_t, base=cython.longlong, gaps=cython.double[:], glen=cython.Py_ssize_t,
                   allocated=cython.longlong, track=cython.bint, hooks=cython.bint, nf=cython.Py_ssize_t,
                   dnew=cython.longlong, held=cython.longlong, nb=cython.longlong, m=cython.longlong,
                   b=cython.longlong, x=cython.double, dt=cython.double, start=cython.double, gap=cython.double,
                   residue=list, heap=list, kv="PagedKV", itl="GapHistogram")
    def _plain_decodes(self, c: Cohort, until: float) -> None:
        """`_decode_run`'s batches inlined (the bulk of a run): what `_decode_step` and
        `_execute` do, in the same order of float operations. The batch's figures are kept in
        locals (C's, when compiled: counts bounded by the KV capacity, kvcache.py's
        `TOKEN_LIMIT`) and written back before anything outside can look (a finish's hooks,
        the end)."""
        bs, kv, cap = self.block_size, self.kv, self.kv.capacity_blocks
        residue, fresh, heap = c.residue, c.fresh, c._heap
        n, clock, ctx, used = c.n, c.clock, c.ctx, kv.used
        f = heap[0][0] if heap else 1 << 62    # the next finish (maybe stale: due() sorts it out)
        decode_time = self._decode_time
        last_kind = self._last_kind
        switch = last_kind != 2 and last_kind != 0
        now, last = self.now, c.last_time
        itl = self.itl
        counts, log_low, scale, top, low = itl.counts, itl._log_low, itl._scale, itl._top, itl.low
        total, total_sq, gmax, hn = itl.total, itl.total_sq, itl.max, itl.n
        kv_integral, busy, peak, k = self.kv_integral, self.busy, self.peak_kv, self.iterations
        k0 = k
        recent = self.recent_batch_times.append
        timeline = self.timeline.append if self.timeline is not None else None
        batches = self.batches.append if self.batches is not None else None
        running = len(self._running)
        base, gaps = c._base, c._gaps
        glen = len(gaps)
        allocated = 0
        track = self.track_start
        hooks = self._on_finish is not None or self._on_done is not None
        nf = len(fresh)                         # fresh members only before the first batch
        dnew = residue[-clock % bs]
        while True:
            held = used + dnew
            nb = n
            if track:                           # the router summary at the batch's start
                self._snap = (self.outstanding, held, self.prefill_backlog)
            dt_o = decode_time(n, ctx + n, switch)
            dt = dt_o if type(dt_o) is float else _seconds(dt_o)
            switch = False
            start, now = now, now + dt
            if not start < now < INF:
                self._batch_end(start, dt)      # the error, if dt is one
            clock += 1
            if clock - base >= glen:
                c.clock = clock                 # as Cohort.step: _trim reads the new clock
                c._trim()
                base, gaps = c._base, c._gaps
                glen = len(gaps)
            gap = now - last
            gaps[clock - base] = gap
            last = now
            ctx += n
            allocated += dnew
            used = held
            m = n - nf
            if m > 0:                           # GapHistogram.add(gap, m), inline
                if gap > low:
                    x = (_log(gap) - log_low) * scale
                    b = cython.cast(cython.longlong, x) + 1     # int(x): toward zero
                    if b >= top:
                        b = top
                else:
                    b = 0
                counts[b] += m
                hn += m
                total += gap * m
                total_sq += gap * gap * m
                if gap > gmax:
                    gmax = gap
            if nf:                              # fresh decoders' first gaps, into the histogram
                itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
                self._first_gaps(c, now)
                total, total_sq, gmax, hn = itl.total, itl.total_sq, itl.max, itl.n
                nf = 0
            if clock >= f:                      # finishes: the general code, on the state written back
                self._write_back(c, clock, ctx, now, allocated, used)
                allocated = 0
                if hooks:                       # what a hook may look at: the figures so far
                    self.kv_integral, self.busy, self.peak_kv, self.iterations = kv_integral, busy, peak, k
                    self.now, self._last_kind = now, 2
                    itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
                for i in c.due():
                    self._finish(i, now, self._leave_decode(i))
                if self._finishing:
                    self._free_finished()
                f = heap[0][0] if heap else 1 << 62
                n, ctx, used, running = c.n, c.ctx, kv.used, len(self._running)
                base, gaps = c._base, c._gaps
                glen = len(gaps)
            recent(dt)
            if timeline is not None:
                timeline((now, 0, running, used * bs))
            if batches is not None:
                batches((start, dt, 0, 0, nb, held * bs))
            kv_integral += held * dt
            busy += dt
            if held > peak:
                peak = held
            k += 1
            dnew = residue[-clock % bs]
            if not now < until or not n or used + dnew > cap:
                break
        self._write_back(c, clock, ctx, now, allocated, used)
        itl.total, itl.total_sq, itl.max, itl.n = total, total_sq, gmax, hn
        self._end_run(k0, k, kv_integral, busy, peak, now)

    def _end_run(self, k0: int, k: int, kv_integral: float, busy: float, peak: int, now: float) -> None:
        """The end of a decode run (`_plain_decodes`): its figures written
        back, batches k0..k done, decode-only, the row logs' full chunks spilled."""
        self.kv_integral, self.busy, self.peak_kv, self.now = kv_integral, busy, peak, now
        self._last_kind = 2
        if self._stall:
            self._stall = 0
        self.iterations = k
        if k0 // CHUNK != k // CHUNK:
            self._spill_logs()

    def _spill_logs(self) -> None:
        """Every CHUNK batches the row logs spill their full chunks to disk (memory stays flat)."""
        for log in (self.timeline, self.batches):
            if log is not None:
                log.check()

    def _write_back(self, c: Cohort, clock: int, ctx: int, now: float, allocated: int, used: int) -> None:
        """A run's cohort and KV state, from `_plain_decodes`' locals: the blocks its batches
        took are allocated in one call (the same blocks, in the same order: nothing was freed
        in between)."""
        c.clock, c.ctx, c.last_time = clock, ctx, now
        if self.cache is None:
            self.kv.used = used
        elif allocated:
            self.cache.allocate(allocated)

    def _batch_end(self, start: float, dt: float) -> float:
        """The clock after a batch of `dt` seconds from `start` (checked)."""
        if not 0 < dt < INF:
            raise KvschedError(f"cost model gave batch time {dt!r}; it must be positive and finite")
        end = start + dt
        if not end > start:
            raise KvschedError(f"batch time {dt!r} s vanishes at t={start!r} s (below the clock's "
                               "resolution): rescale the workload's times or the cost model")
        if end == INF:
            raise KvschedError(f"a batch of {dt!r} s from t={start!r} s ends beyond the largest time a "
                               "float holds: rescale the workload's times or the cost model")
        return end

    # ----- policy safety ---------------------------------------------------------------
    def _named(self, exc: KvschedError) -> KvschedError:
        """A KvschedError a policy raised, with the policy's name in front if it lacks it."""
        return exc if str(exc).startswith(f"policy {self.name}") else PlanError(f"policy {self.name}: {_short(exc, 300)}")

    def _policy_failed(self, where: str, exc: Exception, i: int | None = None) -> PlanError:
        req = f" (request {i})" if i is not None else ""
        msg = _short(exc, 300) or "no message"
        return PlanError(f"policy {self.name} raised {type(exc).__name__} in {where}{req} at "
                         f"t={self.now:.6g}s: {msg}")

    def _cost_failed(self, exc: BaseException) -> KvschedError:
        return KvschedError(f"cost model {type(self.cost).__name__} raised {type(exc).__name__} at t={self.now:.6g}s "
                            f"on replica {self.index}: {_short(exc, 300) or 'no message'}")

    def _call(self, fn, where: str, i: int | None) -> None:
        try:
            if i is None:
                fn(self.view)
            else:
                fn(i, self.view)
        except KvschedError as exc:
            raise self._named(exc) from exc
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise self._policy_failed(where, exc, i) from exc

    # ----- one batch ---------------------------------------------------------------------
    @cython.locals(ds="DecodeSet", c0="Cohort", co="Cohort", kv="PagedKV")
    def _execute(self, plan: Plan) -> bool:
        """Check and run one plan; False if it is empty."""
        preempt, admit, chunks, d = check_plan(plan, self._face, self.name, self._plan_hooks)
        preempted = self.preemptions
        for i in preempt:
            self._preempt(i)
        for i in admit:
            self._admit(i)
        bs = self.block_size
        ds = self._decoders
        if d is True:
            cohorts = ds.cohorts if len(ds.cohorts) == 1 else ds.everyone()
            nd = ds.n
        elif d is False:
            cohorts, nd = (), 0
        else:
            cohorts = self._selected(d)
            nd = 0
            for co in cohorts:
                nd += co.n
        dnew = dctx = 0
        if nd:
            if len(cohorts) == 1:
                c0 = cohorts[0]
                dnew = c0.residue[-c0.clock % bs]     # c0.new_blocks, inline
                dctx = c0.ctx
            else:
                for co in cohorts:
                    dnew += co.new_blocks
                    dctx += co.ctx
        if chunks:
            new_blocks, pt, pattn, pctx, shape_chunks = self._prefill_shape(chunks, dnew)
            if self.cache is not None:          # allocated there, the decode step included
                dnew = 0
        else:
            new_blocks = pt = pattn = pctx = 0
            shape_chunks = ()
            if self.cache is not None and dnew:
                self._allocate(dnew)
                dnew = 0
        if pt == 0 and nd == 0:
            return False
        kv = self.kv
        held = kv.used + new_blocks + dnew
        if held > kv.capacity_blocks:
            raise kv_error(self.name, held, kv.capacity_blocks, bs)
        kind = (pt > 0) + 2 * (nd > 0)          # 1 prefill-only, 2 decode-only, 3 mixed
        switch = kind != self._last_kind and self._last_kind != 0
        self._last_kind = kind
        try:
            dt = self.cost.time(BatchShape(pt, len(shape_chunks), pattn, pctx, nd, dctx + nd, shape_chunks, switch))
        except KvschedError:
            raise
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise self._cost_failed(exc) from exc
        if type(dt) is not float:               # an int or numpy scalar: the clock holds Python floats
            dt = _seconds(dt)
        start = self.now
        end = start + dt
        if not start < end < INF:
            end = self._batch_end(start, dt)    # the error, if dt is one
        if self.track_start:
            self._snap = (self.outstanding, held, self.prefill_backlog - pt)
        kv.used = held
        self.now = end                          # hooks called by the batch's effects see its end
        if nd:
            self._decode_step(end, cohorts)
            if self._stall:
                self._stall = 0
        if pt:
            self.prefill_backlog -= pt
            out = nd
            computed, target = self._computed, self._target
            for i, c in chunks:
                computed[i] += c
                if computed[i] == target[i]:
                    self._prefill_complete(i, end)
                    out = True
            if out:
                if self._stall:
                    self._stall = 0
            elif self.preemptions != preempted:  # preempted again, still no output token
                self._stalled(end)
        if self._finishing:
            self._free_finished()
        self.recent_batch_times.append(dt)
        if self.timeline is not None:
            self.timeline.append((end, len(self._queue), len(self._running), kv.used * bs))
        if self.batches is not None:
            self.batches.append((start, dt, pt, len(shape_chunks), nd, held * bs))
        self.kv_integral += held * dt
        self.busy += dt
        if held > self.peak_kv:
            self.peak_kv = held
        self.iterations += 1
        if not self.iterations % CHUNK:
            self._spill_logs()
        return True

    def _prefill_shape(self, chunks, decode_blocks: int = 0) -> tuple[int, int, float, int, list[tuple[int, int]]]:
        """The checked plan's chunks (sim/plan_check.py): (new KV blocks, tokens, query-key
        pairs, KV touched, per chunk).

        With prefix caching the blocks are allocated here, as vLLM's scheduler does (new KV
        blocks returned: 0): the running requests' chunks and the decode step
        (`decode_blocks`) first, then each admitted request's first chunk takes its cache hit
        (as far as the chunk leaves room: `PrefixCache.hit`) and its new blocks, in plan order;
        every chunk's full blocks are cached as it is scheduled, so later chunks of the batch
        hit them."""
        computed, bs = self._computed, self.block_size
        cache, fresh = self.cache, self._fresh
        # an inert cache (nothing keyed, nothing to key) misses every lookup: one allocation
        inert = cache is not None and cache.inert
        new_blocks = pt = pattn = pctx = 0
        in_turn = False                         # cached: chunks allocate one by one (an admission came)
        shape_chunks = []
        for i, c in chunks:
            if inert and i in fresh:
                fresh.discard(i)
                cache.miss(i)
            elif cache is not None and i in fresh:
                if not in_turn:
                    self._allocate(new_blocks + decode_blocks)
                    new_blocks = decode_blocks = 0
                    in_turn = True
                fresh.discard(i)
                h = cache.hit(i, c)
                computed[i] = h
                self.prefill_backlog -= h
                if h and self.reqs.preempts[i]:
                    self.reqs.recomputed[i] -= min(h, self.reqs.recomputed[i])
            p = computed[i]
            n = -(-(p + c) // bs) - -(-p // bs)
            if cache is not None and not inert:
                cache.register(i, p, c)
            if in_turn:
                self._allocate(n)
            else:
                new_blocks += n
            pt += c
            pattn += c * (p + (c + 1) / 2)
            pctx += p + c
            shape_chunks.append((p, c))
        if cache is not None:
            self._allocate(new_blocks + decode_blocks)
            new_blocks = 0
        return new_blocks, pt, pattn, pctx, shape_chunks

    def _allocate(self, n: int) -> None:
        """n new KV blocks from the prefix cache's pool (evicting), or the plan's KV error."""
        if not n:
            return
        kv = self.kv
        if kv.used + n > kv.capacity_blocks:
            raise kv_error(self.name, kv.used + n, kv.capacity_blocks, self.block_size)
        self.cache.allocate(n)

    def _free(self, i: int, kv_tokens: int, done: bool) -> None:
        """Request i's KV leaves this replica (finished, preempted or handed off)."""
        if self.cache is None:
            self.kv.used -= -(-kv_tokens // self.block_size)
        else:
            self.cache.free(i, kv_tokens, done)

    def _free_finished(self) -> None:
        """With prefix caching, the requests a batch finished free their blocks in vLLM's order
        (its scheduled order: running requests by admission, then the new ones), which decides
        which cached blocks are evicted first."""
        done, order, cache = self._finishing, self._order, self.cache
        if cache.inert:                         # no keys, no shared blocks: the order cannot matter
            cache.free_private(done)
        else:
            if len(done) > 1:                   # landed (disaggregated) ones first
                done.sort(key=_ByAdmission(order))
            for i, kv_tokens in done:
                cache.free(i, kv_tokens, True)
        for i, _ in done:
            order.pop(i, None)
        done.clear()

    def _stalled(self, end: float) -> None:
        """A batch that preempted and gave no output token: stop the policy after
        `stall_batches` of them with no output token between. Batches that preempt nothing
        neither count nor reset: without a preemption every request only moves forward, so
        such batches end (a long prompt prefilled in small chunks, or the recomputation of
        what a preemption discarded, in as many batches as it takes). A policy that preempts
        and recomputes over and over, gaining a prompt token per round or none, is stopped."""
        self._stall += 1
        if self._stall >= self._stall_limit:
            raise PlanError(
                f"policy {self.name} made no progress: no output token in {self._stall} batches that preempted, "
                f"with {len(self._queue)} waiting and {len(self._running)} running requests on replica {self.index} "
                f"(t={end:.6g}s; the limit is stall_batches={self._stall_limit})")

    def _selected(self, d: frozenset | set) -> list[Cohort]:
        """The cohorts that decode when the checked plan names a set of decoders."""
        ds = self._decoders
        if not d:
            return []
        return ds.everyone() if len(d) == ds.n else ds.select(d)

    @cython.locals(r="RequestTable")
    def _admit(self, i: int) -> None:
        r = self.reqs
        q = self._queue
        if q[0] == i:                           # the common case: the queue front
            q.popleft()
        else:
            q.remove(i)
        r.status[i] = PREFILL
        self._running[i] = None
        self._prefilling[i] = None
        if self.cache is not None:
            self._fresh.add(i)
            self._admissions += 1
            self._order[i] = self._admissions
        if r.admitted[i] == INF:
            r.admitted[i] = self.now

    @cython.locals(ch="Cohort", itl="GapHistogram")
    def _decode_step(self, end: float, cohorts) -> None:
        if self.tier_itl is not None:
            self._tier_first_gaps(end, cohorts)
        itl = self.itl
        for ch in cohorts:
            if not ch.n:
                continue
            fresh = ch.fresh
            gap = ch.step(end)
            itl.add(gap, ch.n - len(fresh))
            if fresh:
                self._first_gaps(ch, end)
            for i in ch.due():
                kv_tokens = self._leave_decode(i)
                self._finish(i, end, kv_tokens)

    @cython.locals(itl="GapHistogram", r="RequestTable")
    def _first_gaps(self, ch: Cohort, end: float) -> None:
        """The first decode step of the cohort's fresh members: each gap is from its own last
        token (its first token, or one before it moved cohorts)."""
        itl, r = self.itl, self.reqs
        itl_max, viol, tbt, last = r.itl_max, r.viol, r.tbt, r.last_tok
        for i in ch.fresh:
            g = end - last[i]
            itl.add(g)
            if g > itl_max[i]:
                itl_max[i] = g
            if g > tbt[i]:
                viol[i] += 1
        ch.fresh.clear()

    def _tier_first_gaps(self, end: float, cohorts) -> None:
        """Each fresh decoder's first gap (end - its last token, the gap `_decode_step` records
        for it) into its tier's histogram; the other gaps reach the tier histograms through
        `_fold`."""
        hists, tier, last = self.tier_itl, self.reqs.tier, self.reqs.last_tok
        for ch in cohorts:
            for i in ch.fresh:
                t = tier[i]
                if t >= 0:
                    hists[t].add(end - last[i])

    def pending_tier_gaps(self) -> Iterator[tuple[int, np.ndarray]]:
        """(tier, gaps) of each request still decoding here, not yet folded into `tier_itl`."""
        tier = self.reqs.tier
        for i, c in self._decoders.where.items():
            t = tier[i]
            window = c.window(i)
            if t >= 0 and len(window):
                yield t, window

    @cython.locals(r="RequestTable")
    def _fold(self, i: int, gen: int, last: float, window: np.ndarray) -> None:
        """Record what a request did in a cohort it leaves: its gaps' maximum and SLO misses,
        and with tiers the window's gaps (one per decode step after the first in the cohort,
        the gaps `_decode_step` counted for it as the cohort's) into its tier's histogram."""
        r = self.reqs
        r.gen[i] = gen
        r.last_tok[i] = last
        if len(window):
            m = _window_max(window)
            if m > r.itl_max[i]:
                r.itl_max[i] = m
            if m > r.tbt[i]:
                r.viol[i] += int(np.count_nonzero(window > r.tbt[i]))
            if self.tier_itl is not None and r.tier[i] >= 0:
                self.tier_itl[r.tier[i]].add_many(window)

    def _leave_decode(self, i: int) -> int:
        kv_tokens, gen, last, window = self._decoders.leave(i)
        self._fold(i, gen, last, window)
        return kv_tokens

    def _move(self, i: int, src: Cohort, dst: Cohort) -> None:
        """Move a decoder between cohorts (a decode selection split or merged them)."""
        kv_tokens, gen, last, window = src.leave(i)
        self._fold(i, gen, last, window)
        dst.join(i, kv_tokens, gen, self.reqs.output[i], last)

    @cython.locals(r="RequestTable")
    def _prefill_complete(self, i: int, t: float) -> None:
        del self._prefilling[i]
        r = self.reqs
        g = r.gen[i] + 1
        r.gen[i] = g
        if g == 1:
            r.first[i] = t
        else:                                   # resumed after preemption: one long gap
            gap = t - r.last_tok[i]
            self.itl.add(gap)
            if self.tier_itl is not None and r.tier[i] >= 0:
                self.tier_itl[r.tier[i]].add(gap)
            if gap > r.itl_max[i]:
                r.itl_max[i] = gap
            if gap > r.tbt[i]:
                r.viol[i] += 1
        r.last_tok[i] = t
        if g >= r.output[i]:
            self._finish(i, t, r.computed[i])
        elif self._handoff is not None:         # prefill replica: the KV moves on, held until sent
            r.status[i] = TRANSFER
            del self._running[i]
            self.outstanding -= 1
            self._handoff(i, t)
        else:
            r.status[i] = DECODE
            self._decoders.join(i, r.computed[i], g, r.output[i], t)

    @cython.locals(r="RequestTable", ds="DecodeSet")
    def _land_ready(self) -> None:
        """Landed requests (their KV reserved by `reserve`) join the decode set."""
        r, ds = self.reqs, self._decoders
        for i in self._landing:
            r.status[i] = DECODE
            self._running[i] = None
            ds.join(i, r.computed[i], r.gen[i], r.output[i], r.last_tok[i])
        self._landing.clear()

    @cython.locals(r="RequestTable")
    def _finish(self, i: int, t: float, kv_tokens: int) -> None:
        r = self.reqs
        r.status[i] = DONE
        r.finished[i] = t
        del self._running[i]
        if self.cache is None:
            self._free(i, kv_tokens, True)
        else:                                   # freed at the batch's end, in vLLM's order
            self._finishing.append((i, kv_tokens))
        r.done += 1
        r.in_flight -= 1
        self.outstanding -= 1
        self.recent_finished.append((r.prompt[i], r.output[i]))
        if self._on_finish is not None:
            self._call(self._on_finish, "on_finish", i)
        # drop this request's own int/float objects: later reads see shared ones
        r.gen[i] = r.output[i]
        r.computed[i] = 0
        r.last_tok[i] = 0.0
        if self._on_done is not None:
            self._on_done(i, t)

    @cython.locals(r="RequestTable")
    def _preempt(self, i: int) -> None:
        r = self.reqs
        if i in self._where:                    # decoding
            kv_tokens = self._leave_decode(i)
            r.target[i] = r.prompt[i] + r.gen[i]
            r.recomputed[i] += kv_tokens + 1
            self.prefill_backlog += r.target[i]
        else:                                   # prefilling (the check made sure it runs here)
            kv_tokens = r.computed[i]
            del self._prefilling[i]
            r.recomputed[i] += kv_tokens
            self.prefill_backlog += kv_tokens
        self._fresh.discard(i)
        self._free(i, kv_tokens, False)
        r.computed[i] = 0
        r.status[i] = WAITING
        del self._running[i]
        self._queue.appendleft(i)
        r.preempts[i] += 1
        self.preemptions += 1
        if self._on_preempt is not None:
            self._call(self._on_preempt, "on_preempt", i)




class _ByAdmission:
    """A sort key: a finished request's admission rank (0: landed here, not admitted)."""
    __slots__ = ("order",)

    def __init__(self, order: dict[int, int]) -> None:
        self.order = order

    def __call__(self, item: tuple[int, int]) -> int:
        return self.order.get(item[0], 0)


def merged_tiers(replicas: list[Replica]) -> list[GapHistogram]:
    """The per-tier gap histograms of `replicas` merged, with the gaps of requests still
    decoding on them added (`Replica.pending_tier_gaps`; none once a run ends)."""
    out = [GapHistogram.merged([r.tier_itl[t] for r in replicas]) for t in range(len(replicas[0].tier_itl))]
    for r in replicas:
        for t, window in r.pending_tier_gaps():
            out[t].add_many(window)
    return out


@cython.locals(w=cython.double[:], k=cython.Py_ssize_t, m=cython.double)
def _window_max(window: np.ndarray) -> float:
    """The largest gap of a non-empty window of a cohort's gaps (finite floats). Compiled, a loop
    over its buffer; as Python, numpy's reduction: the same float either way (a maximum of
    finite floats), each the fast way of its build."""
    if not cython.compiled:
        return float(np.maximum.reduce(window))
    w = window
    m = w[0]
    for k in range(1, w.shape[0]):
        if w[k] > m:
            m = w[k]
    return m


def _seconds(dt) -> float:
    """A cost model's batch time as a Python float (`_batch_end` checks its value)."""
    if isinstance(dt, bool) or not isinstance(dt, Real):
        raise KvschedError(f"cost model gave batch time {_short(dt)}; it must be a number of seconds")
    try:
        return float(dt)
    except OverflowError:
        return INF


def _decode_time(cost) -> Callable[[int, int, bool], float]:
    """The time of a decode-only batch (n requests over ctx KV tokens): the cost model's
    `decode_time` when the class that defines `time` defines it too (a subclass that
    redefines `time` alone is not bypassed), else `time` of that BatchShape."""
    fn = getattr(cost, "decode_time", None)
    owner, timer = defined_in(type(cost), "decode_time"), defined_in(type(cost), "time")
    if callable(fn) and owner is not None and timer is not None and issubclass(owner, timer):
        return fn
    return lambda n, ctx, switch: cost.time(BatchShape(0, 0, 0, 0, n, ctx, (), switch))


def _declared(types, share: float):
    """The workload's declared types with rates scaled to this replica's share of arrivals."""
    return None if types is None else tuple((p, o, r * share) for p, o, r in types)
