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

The replica holds the state (its fields, declared in replica.pxd) and the step API; the
work is done by its owners, each a module of functions over it: `lifecycle` (a request's
admission, preemption, first token, hand-off, landing and finish), `kv_blocks` (allocation,
check-then-act, and freeing), `batch` (one batch as named phases, after the plan check of
`plan_check`), `decode_run` (decode-only batches without the policy) and `records` (gaps,
per-request records, row logs).
"""
from __future__ import annotations

from collections import deque
from functools import partial
from typing import Callable

from kvsched.errors import PASS_THROUGH, KvschedError, PlanError
from kvsched.kvcache import PagedKV
from kvsched.metrics import GapHistogram
from kvsched.policies.base import NOOP_HOOKS, decodes_when_idle
from kvsched.sim.batch import execute
from kvsched.sim.decode_run import decode_clock, decode_run, dense_time, idle_fits
from kvsched.sim.decode_set import DecodeSet
from kvsched.sim.kv_blocks import decode_blocks, free, take
from kvsched.sim.lifecycle import land_ready, load_unpin, move
from kvsched.sim.plan_check import PlanFace, short as _short
from kvsched.sim.prefix_cache import PrefixCache
from kvsched.sim.prefix_planner import HitPlanner, LazyPlanner
from kvsched.sim.requests import INF, WAITING, RequestTable
from kvsched.sim.rowlog import BATCHES, TIMELINE, RowLog
from kvsched.sim.view import view_of


DEFAULT_STALL_BATCHES = 100_000


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
        self._queue, self._landing = deque(), deque()           # waiting; landed, to join the decoders
        self._running: dict[int, None] = {}
        self._prefilling: dict[int, None] = {}
        self.pulls: deque[int] = deque()        # decode role: handed-off requests waiting for KV room
        self._swap = None                       # --preemption swap: the host tier (sim/host_swap.py, HostSwap)
        self._offload = None                    # the prefix cache's tiers below the GPU (sim/kv_tiers.py, Offload)
        self._planner = None                    # the last prefix planner handed to the policy
        self._spec = None                       # --spec: speculative decoding (sim/spec_decode.py, Speculation)
        self._side = None                       # whichever of the two is set: its tick, busy and wake
        self._decoders = DecodeSet(bs, partial(move, self))
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
        # inter-token gaps, per tier too where the workload has tiers; a cluster's replicas share
        # the bins (`itl_bins`, `tier_bins`, ~120 KB a histogram: only `GapHistogram.merged` over
        # all of them, or `records.merged_tiers`, is a histogram), each keeps its own sums
        self.itl = GapHistogram(counts=itl_bins)
        self.tier_itl: list[GapHistogram] | None = None if not reqs.workload.tiers else [
            GapHistogram(counts=None if tier_bins is None else tier_bins[t]) for t in range(len(reqs.workload.tiers))]
        self.now, self.busy, self.kv_integral = 0.0, 0.0, 0.0
        self.iterations = self.peak_kv = self.peak_queue = self.preemptions = 0
        self._last_kind = 0             # kind of the previous batch (BatchShape.phase_switch)
        self.outstanding = 0            # waiting + running here
        self.prefill_backlog = 0        # prefill tokens still to compute for waiting + prefilling
        self._blocked = False           # the policy returned an empty plan: wait for an event
        self._snap = (0, 0, 0)          # router summary at the current batch's start
        self.track_start = False        # keep _snap (the cluster sets it for state-based routers)
        self.recent_batch_times: deque[float] = deque(maxlen=64)
        self.recent_finished: deque[tuple[int, int]] = deque(maxlen=1024)
        # per-batch rows (sim/rowlog.py: TIMELINE, BATCHES), spilled to disk (memory stays flat)
        self.timeline: RowLog | None = RowLog(TIMELINE.kinds) if record_timeline else None
        self.batches: RowLog | None = RowLog(BATCHES.kinds) if record_batches else None
        self._schedule = policy.schedule
        self._on_finish, self._on_preempt, self._on_batch_end = map(self._hook, ("on_finish", "on_preempt", "on_batch_end"))
        # user code that runs while a plan is applied (hooks, a cost model not kvsched's), and could
        # edit the policy's lists: the check copies them then
        self._plan_hooks = (self._on_finish is not None or self._on_preempt is not None
                            or not type(cost).__module__.startswith("kvsched."))
        # the policy promises Plan([], [], True, []) while nothing waits or prefills and the
        # decoders fit (policies/base.py, `decodes_when_idle`): such batches skip `schedule`
        self._steady = decodes_when_idle(policy)
        self.runs_ahead = False                 # the cluster loop lets steady batches run to its next event
        self._decode_time, self._dense_time = decode_clock(cost), dense_time(cost)
        self._face = PlanFace(self)
        self.view = view_of(self, share, prefix_caching)

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
        planner = LazyPlanner(c, self) if c.inert else HitPlanner(c, self)
        self._planner = planner                 # the plan's, for `lifecycle.plan_stale`
        return planner

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
        if self._side is not None and self._side.busy():
            return self._side.wake(self)
        return INF if self._blocked or not (self._queue or self._running or self._landing) else self.now

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
        if used + need + decode_blocks(self) + (tokens % bs == 0) > self.kv.capacity_blocks:
            return False
        take(self, need)
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
        free(self, i, self.reqs.computed[i], True)
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
        if self._side is not None and self._side.tick(self):
            return False
        if self._landing:
            land_ready(self)
        if self._steady and not self._queue and idle_fits(self):
            try:
                decode_run(self, until)
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
            ran = execute(self, plan)
        except KvschedError:
            raise
        except PASS_THROUGH:
            raise
        except BaseException as exc:            # e.g. a generator in the plan that raises
            raise PlanError(f"policy {self.name} gave a plan that cannot be read: {type(exc).__name__}: "
                            f"{_short(exc, 120)}") from exc
        if not ran:
            if self._offload is not None and load_unpin(self):
                return False                    # plan again with the room loaded prefixes held
            self._blocked = True
            return False
        if self._offload is not None and self._offload.deferred:
            self._offload.flush()               # write-through: the batch's blocks, computed by its end
        if self._on_batch_end is not None:
            self._call(self._on_batch_end, "on_batch_end", None)
        return True

    # ----- policy safety ---------------------------------------------------------------
    def _named(self, exc: KvschedError) -> KvschedError:
        """A KvschedError a policy raised, with the policy's name in front if it lacks it."""
        return exc if str(exc).startswith(f"policy {self.name}") else PlanError(f"policy {self.name}: {_short(exc, 300)}")

    def _policy_failed(self, where: str, exc: Exception, i: int | None = None) -> PlanError:
        req = f" (request {i})" if i is not None else ""
        return PlanError(f"policy {self.name} raised {type(exc).__name__} in {where}{req} at "
                         f"t={self.now:.6g}s: {_short(exc, 300) or 'no message'}")

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
