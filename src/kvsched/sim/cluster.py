"""Replicas behind a router, one event loop in time order (docs/architecture.md, "Cluster").

Events, earliest first; at equal times: the control plane's (sim/control.py: a replica whose
cold start ends at t takes an arrival at t), arrivals, then the loop's own events (closed-loop
seats freed, prefill hand-offs, KV landing), then the replica steps (lowest index first).
A replica steps at its clock and jumps to the end of the batch it runs, so every other
replica's events up to that end are processed before it decides again.

Prefill/decode disaggregation (`prefill_replicas` > 0): arrivals are routed to the prefill
replicas, whose requests hand off at their first token; at that moment the decode router
picks a decode replica. The decode replica pulls the request's KV when it has room for it
(beside its decoders and one decode step of them all), in hand-off order; until then the
request waits there and its KV stays on the prefill replica, so a full decode pool pushes
back on the prefill pool, as DistServe's decode instances pull KV from prefill instances
that act as queuing buffers. The pulled KV (its tokens x the model's KV bytes per token)
crosses the prefill replica's FIFO link (`KVLink`); the prefill replica frees it when it
lands, and the request decodes from the decode replica's next batch. Its transfer time is
from its first token to the landing (waiting for room and for the link included).
A preemption on a decode replica recomputes there (its policy prefills the request again).
This departs from DistServe (rad-slai.txt Algorithm 5), which swaps preempted KV to host
memory, and whose prefill instances run one whole prompt at a time FCFS: here the prefill
replicas run whatever policy is chosen, batched and chunked as it decides.

Sessions (a workload's `session_prev`): the open loop issues first turns at their arrival
times and skips later turns; when a turn finishes (or is rejected, at the moment it would
have been issued), its session's next turn is issued `think` seconds later, as a loop event,
and routed like any arrival. Arrivals stay pending while any turn remains to be issued.
"""
from __future__ import annotations

import heapq
import time as _time
from typing import Any, Callable, Sequence

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.errors import PASS_THROUGH, KvschedError, PlanError
from kvsched.kvcache import PagedKV
from kvsched.metrics import GapHistogram, RunRecords
from kvsched.sim.prefix_cache import fewer_collections
from kvsched.sim import invariants
from kvsched.sim.records import run_records
from kvsched.sim.replica import DEFAULT_STALL_BATCHES, Arrivals, Replica
from kvsched.sim.requests import INF, RequestTable
from kvsched.sim.routers import ReplicaSummary, Router, make_router
from kvsched.sim.routed_ahead import apart_tables, routed_ahead, run_apart
from kvsched.sim.rowlog import MergedRows
from kvsched.sim.transfer import KVLink
from kvsched.workload.request import Workload

SEAT, HANDOFF, PULL, LAND, ISSUE, CONTROL = range(6)   # CONTROL: sim/control.py's work
SCAN_UP_TO = 8          # replicas up to which choosing the next one scans them all (else a heap)
RAISED_AS_THEY_ARE = (KvschedError, *PASS_THROUGH)     # a router's other errors are named (`_route`)


class _Turns:
    """Sessions' later turns, issued `think` seconds after their previous turn finishes."""

    def __init__(self, w: Workload, reqs: RequestTable) -> None:
        prev = w.previous_turn()
        later = prev >= 0
        nxt = np.full(len(prev), -1, np.int64)
        nxt[prev[later]] = np.flatnonzero(later)
        self.next = nxt.tolist()                # the session's next turn (-1: none)
        self.think = w.think.tolist()
        self.arrival = w.arrival.tolist()       # stored times: the open loop's schedule
        self.skip = (reqs.rejected | later).tolist()     # rows the open loop does not issue
        self.rejected_firsts = np.flatnonzero(reqs.rejected & ~later & (nxt >= 0)).tolist()
        self.left = int(later.sum())            # later turns not issued yet
        self.due: list[float] = []              # heap: issue times of the scheduled ones
        self.open = 0                           # the open loop's next row to issue


class Cluster:
    """`policies` has one policy object per replica (policies keep state); `cost` and `kv` are
    one for all, or a list of one per replica (kinds of replica, kvsched/pools.py: requests
    must then fit the smallest KV pool; `kinds` names each for the router). With
    `prefill_replicas` = P > 0 the first P replicas are the prefill pool, the rest the
    decode pool; `kv_bytes_per_token`, `bandwidth_gbps` and `latency_s` set the link.
    `shared_tiers`: the replicas share a KV tier (a remote store, or a node's host tier: run.py,
    `attach_offload`), so they step together in time order: none runs apart from the others
    or ahead of them (sim/routed_ahead.py), which would write the store out of time order."""

    def __init__(self, workload: Workload, policies: Sequence, cost, kv: PagedKV, *,
                 router: str | Router = "round-robin", router_seed: int = 0,
                 router_params: dict[str, Any] | None = None, prefill_replicas: int = 0,
                 kv_bytes_per_token: float = 0.0, bandwidth_gbps: float = 25.0, latency_s: float = 0.0,
                 max_model_len: int | None = None, record_timeline: bool = False,
                 record_batches: bool = False, strict: bool = False,
                 stall_batches: int = DEFAULT_STALL_BATCHES, prefix_caching: bool = False,
                 kinds: Sequence[str] | None = None, shared_tiers: bool = False,
                 spec_slots: tuple[int, int] = (0, 0), controlled: bool = False) -> None:
        r = len(policies)
        if r < 1:
            raise KvschedError("a cluster needs at least one replica")
        costs = list(cost) if isinstance(cost, list) else [cost] * r
        kvs = list(kv) if isinstance(kv, list) else [kv] + [PagedKV(kv.capacity_tokens, kv.block_size) for _ in policies[1:]]
        kv = min(kvs, key=lambda k: k.capacity_blocks)      # what every request must fit
        self.kinds = list(kinds) if kinds is not None else [""] * r
        if prefill_replicas and not 0 < prefill_replicas < r:
            raise KvschedError(f"{prefill_replicas} prefill replicas out of {r} leaves no decode replica")
        self.reqs = RequestTable(workload, kv.block_size, kv.capacity_blocks,
                                 max_model_len=max_model_len, strict=strict, spec_slots=spec_slots)
        self.arrivals = Arrivals()
        self._turns = _Turns(workload, self.reqs) if workload.has_sessions else None
        if self._turns is not None:
            self._set_next = self._set_next_turns
        self.disaggregated = prefill_replicas > 0
        if router_params and not isinstance(router, str):
            raise KvschedError("router parameters go with a router name; a router object is used as given")
        self.router = make_router(router, router_seed, router_params) if isinstance(router, str) else router
        self._costs = costs
        self.shared_tiers = shared_tiers
        self.control = None                     # the control plane (sim/control.py), set after the replicas
        self._tables = None if shared_tiers or controlled else apart_tables(self, policies, kv, max_model_len, strict,
                                                              spec_slots)   # None: together
        self.replicas: list[Replica] = []
        # the bins of the inter-token gap histograms (one, and one per tier), shared by the replicas
        itl_bins = GapHistogram().counts
        tier_bins = [GapHistogram().counts for _ in workload.tiers]
        for k, pol in enumerate(policies):
            role = "mixed" if not self.disaggregated else ("prefill" if k < prefill_replicas else "decode")
            self.replicas.append(Replica(
                self.reqs if self._tables is None else self._tables[k], pol, costs[k], kvs[k], index=k, role=role,
                arrivals=self.arrivals, record_timeline=record_timeline, record_batches=record_batches,
                stall_batches=stall_batches, handoff=self._handoff if role == "prefill" else None,
                share=1 / (prefill_replicas if role == "prefill" else r - prefill_replicas),
                prefix_caching=prefix_caching, on_done=self._turn_done if self._turns is not None else None,
                itl_bins=itl_bins, tier_bins=tier_bins))
        self.front = self.replicas[:prefill_replicas] if self.disaggregated else self.replicas
        self.back = self.replicas[prefill_replicas:]
        spec = router if isinstance(router, str) else self.router.name
        self.decode_router = make_router(spec, router_seed + 1, router_params) if self.disaggregated else None
        pools = [(self.front, self.router)] + ([(self.back, self.decode_router)] if self.disaggregated else [])
        for pool, rt in pools:
            for rep in pool:
                rep.track_start = rt.uses_state and len(pool) > 1 or rep.role == "decode"
        self.links = [KVLink(bandwidth_gbps, latency_s) for _ in self.front] if self.disaggregated else []
        self.kv_bytes_per_token = kv_bytes_per_token
        n = self.reqs.n
        self.decode_replica = np.full(n, -1, np.int32) if self.disaggregated else None
        self.transfer = np.full(n, np.nan) if self.disaggregated else None
        self._events: list[tuple] = []
        self._seq = 0
        self._seats = 0
        # replicas with something to do, by (next event time, index): a heap whose entries a
        # later change of the replica makes stale (`_touch`), so choosing the next replica costs
        # O(log R) instead of a scan of every replica, idle ones included
        self._ready: list[tuple[float, int, int]] = []
        self._version = [0] * r
        self._heap = r > SCAN_UP_TO             # fewer replicas are scanned: cheaper than the heap

    def _touch(self, rep: Replica) -> None:
        """Replica `rep` may have changed its next event time: enter it anew."""
        if not self._heap:
            return
        k = rep.index
        v = self._version[k] = self._version[k] + 1
        t = rep.next_event_time()
        if t < INF:
            heapq.heappush(self._ready, (t, k, v))

    def _second(self) -> float:
        """The next event time of the replicas other than the earliest (INF if none)."""
        ready, version = self._ready, self._version
        top = heapq.heappop(ready)
        while ready and ready[0][2] != version[ready[0][1]]:
            heapq.heappop(ready)
        t = ready[0][0] if ready else INF
        heapq.heappush(ready, top)
        return t

    # ----- events ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, *payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, *payload))

    def _handoff(self, i: int, t: float) -> None:
        """A prefill replica's request yielded its first token at t (the replica runs ahead of
        the loop, so the hand-off is an event at t)."""
        self._push(t, HANDOFF, i)

    def _route(self, router: Router, pool: list[Replica], i: int, t: float, lora: list[int] | None = None) -> int:
        """`lora`: each replica's LoRA state for request i's adapter (ReplicaSummary.lora)."""
        if len(pool) == 1:
            return 0
        if router.uses_state:
            cached = self._cached(pool, i) if getattr(router, "uses_prefix", False) else None
            view = []
            for k, rep in enumerate(pool):
                out, kv, backlog = rep.summary_at(t)
                view.append(ReplicaSummary(k, out, kv, rep.kv_capacity_blocks, backlog, cached[k] if cached else 0,
                                           self.kinds[rep.index], lora[k] if lora is not None else 2))
            args, kw = (i, t, view), ({} if cached is None else {"prompt": self.reqs.target[i]})
        else:
            args, kw = (i, t, len(pool)), {}
        try:
            k = router.route(*args, **kw)
        except RAISED_AS_THEY_ARE:
            raise
        except BaseException as exc:        # a custom router's error, named
            raise KvschedError(f"router {getattr(router, 'name', type(router).__name__)} raised "
                               f"{type(exc).__name__} routing request {i} at t={t:.6g}s: {exc}") from exc
        if not (isinstance(k, (int, np.integer)) and 0 <= k < len(pool)):
            raise KvschedError(f"router {router.name} chose replica {k!r} of {len(pool)}")
        return int(k)

    def _cached(self, pool: list[Replica], i: int) -> list[int]:
        """Prompt tokens of request i cached on each replica of `pool` (its keys made once)."""
        caches = [rep.cache for rep in pool]
        if caches[0] is None:
            return [0] * len(pool)
        keys = caches[0].keys(i, caches[0].lookup_cap(i), keep=False)
        return [c.count_cached(keys) for c in caches]

    def _arrive(self, i: int, t: float) -> None:
        if self.control is not None:
            self.control.arrive(i, t)
            return
        k = self._route(self.router, self.front, i, t)
        self.front[k].accept(i, t)
        self.reqs.replica[i] = self.front[k].index
        self._touch(self.front[k])

    def _event(self, ev: tuple, closed: list[int] | None) -> None:
        t, _, kind = ev[:3]
        if kind == SEAT:
            self._seats -= ev[3]
            self._issue(t, closed)
        elif kind == HANDOFF:
            i = ev[3]
            k = self._route(self.decode_router, self.back, i, t)
            self.decode_replica[i] = self.back[k].index
            self.back[k].pulls.append(i)
            self._pull(k, t)
        elif kind == PULL:
            self._pull(ev[3], t)
        elif kind == ISSUE:
            self._issue_turn(ev[3], t)
        elif kind == CONTROL:
            ev[3](t, *ev[4:])
        else:
            _, _, _, i, p, k = ev
            self.replicas[p].release(i, t)
            self.back[k].land(i, t)
            self._touch(self.replicas[p])
            self._touch(self.back[k])

    def _pull(self, k: int, t: float) -> None:
        """Decode replica k pulls waiting requests' KV while it has room; if it lacks room during
        a batch, it looks again when the batch ends."""
        d, reqs = self.back[k], self.reqs
        q = d.pulls
        while q:
            i = q[0]
            if not d.reserve(i, t):
                if t < d.now:
                    self._push(d.now, PULL, k)
                return
            q.popleft()
            p = int(reqs.replica[i])
            land = self.links[p].send(t, reqs.computed[i] * self.kv_bytes_per_token)
            self.transfer[i] = land - reqs.first[i]
            self._push(land, LAND, i, p, k)

    def _issue(self, t: float, closed: list[int]) -> None:
        """Closed loop: issue requests while seats are free, arriving now."""
        reqs, rejected = self.reqs, self.reqs.rejected_list
        nxt = reqs.issued
        while nxt < reqs.n and self._seats < closed[nxt]:
            reqs.arrival[nxt] = t
            if not rejected[nxt]:
                self._seats += 1
                self._arrive(nxt, t)
            nxt += 1
        reqs.issued = nxt
        self._pending(nxt < reqs.n, t)

    # ----- the loop ----------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None = None) -> RunRecords:
        if all(r.cache is None for r in self.replicas):
            return self._run(progress)
        with fewer_collections():               # the prefix cache allocates a block object per block
            return self._run(progress)

    @cython.locals(reqs=RequestTable, single=Replica, rep=Replica, r=Replica, nxt=cython.Py_ssize_t,
                   n=cython.Py_ssize_t, k=cython.Py_ssize_t, steps=cython.longlong, t_arr=cython.double,
                   t_rep=cython.double, t_other=cython.double, t=cython.double, t_ev=cython.double,
                   until=cython.double, j=cython.Py_ssize_t)
    def _run(self, progress: Callable[[int, int], None] | None) -> RunRecords:
        wall0 = _time.perf_counter()
        reqs, reps, events = self.reqs, self.replicas, self._events
        arrival, rejected, n = reqs.arrival, reqs.rejected_list, reqs.n
        closed = reqs.workload.concurrency.tolist() if reqs.workload.closed_loop else None
        arr = self.arrivals
        turns = self._turns
        if turns is not None:                   # sessions: the open loop skips later turns
            arrival, rejected = turns.arrival, turns.skip
            for i in turns.rejected_firsts:
                self._turn_done(i, arrival[i])
        if closed is not None:
            arr.pending, arr.next_time = n > 0, None
            self._issue(0.0, closed)
        else:
            self._set_next(0, 0.0)
        single = reps[0] if len(reps) == 1 and self.control is None else None
        if self.control is not None:
            self.control.start()
        index = single.index if single is not None else -1
        # a replica may run several decode-only batches in one step() until the next thing that
        # happens elsewhere; a closed loop, sessions and the control plane (slots and seats freed,
        # drains ending) react to each batch's finishes
        chain = closed is None and turns is None
        check = invariants.enabled()            # KVSCHED_CHECK=1: the invariants after every step
        for r in reps:                          # replicas whose steady batches may run ahead
            r.runs_ahead = chain and r._steady and not self.shared_tiers and self.control is None
        if self._tables is not None:
            return run_apart(self, progress, wall0)
        ahead = routed_ahead(self, chain)
        route, next_same, upcoming, alone = ahead if ahead is not None else (None, None, None, None)
        nxt, steps, checked, t_other = 0, 0, [0] * len(reps), INF
        ready, version = self._ready, self._version
        scan, heap = single is None and not self._heap, single is None and self._heap
        while reqs.done < reqs.remaining:
            t_arr = arrival[nxt] if closed is None and nxt < n else INF
            if single is not None:                  # next_event_time(), inline: this is the hot loop
                rep = single
                if rep._side is None:
                    t_rep = INF if rep._blocked or not (rep._queue or rep._running or rep._landing) else rep.now
                else:                               # swaps and loads wake it too (sim/host_swap.py, kv_tiers.py)
                    t_rep = rep.next_event_time()
            elif scan:                              # a few replicas: the earliest, lowest index first
                rep, t_rep, t_other = None, INF, INF
                for r in reps:
                    t = r.next_event_time()
                    if t < t_rep:
                        rep, t_rep, t_other = r, t, t_rep
                    elif t < t_other:
                        t_other = t
            else:                                   # many: the same from the heap
                while ready and ready[0][2] != version[ready[0][1]]:
                    heapq.heappop(ready)            # an entry an earlier change made stale
                rep, t_rep = (reps[ready[0][1]], ready[0][0]) if ready else (None, INF)
            if t_arr <= t_rep or events:           # else the common case: the replica runs a batch
                t_ev = events[0][0] if events else INF
                if t_arr <= t_rep and t_arr < INF and (t_arr < t_ev or t_arr == t_ev and events[0][2] != CONTROL):
                    if rejected[nxt]:
                        pass
                    elif single is not None:        # _arrive, inline: one replica takes every request
                        single.accept(nxt, t_arr)
                        reqs.replica[nxt] = index
                    elif route is not None:         # routed up front (`routed_ahead`)
                        j = route[nxt]
                        r = reps[j]
                        r.accept(nxt, t_arr)
                        reqs.replica[nxt] = j
                        upcoming[j] = next_same[nxt]
                        self._touch(r)
                    else:
                        self._arrive(nxt, t_arr)
                    nxt += 1
                    reqs.issued = nxt
                    if turns is not None:
                        self._set_next(nxt, t_arr)
                        continue
                    k = nxt                         # _set_next, inline (without sessions `rejected` and
                    while k < n and rejected[k]:    # `arrival` are the table's)
                        k += 1
                    if k < n:
                        arr.pending, arr.next_time = True, arrival[k]
                    else:
                        self._pending(False, t_arr)
                        arr.next_time = None
                    continue
                if t_ev <= t_rep and t_ev < INF:
                    self._event(heapq.heappop(events), closed)
                    continue
                if t_rep == INF:
                    self._deadlock(closed is not None)
            before = reqs.done
            until = 0.0
            if rep.runs_ahead and not rep._queue:   # to the next thing that may change this replica
                until = min(t_arr, events[0][0] if events else INF)
                if alone is not None and alone[rep.index]:  # to its own next arrival (`routed_ahead`)
                    j = upcoming[rep.index]
                    until = min(arrival[j] if j < n else INF, events[0][0] if events else INF)
                if self.disaggregated:                  # another pool's batch may hand it work
                    until = min(until, t_other if scan else self._second())
            if rep.step(until):
                steps += 1
                if progress is not None and steps % 4096 == 0:
                    progress(reqs.done, reqs.remaining)
            if closed is not None and reqs.done > before:
                self._push(rep.now, SEAT, reqs.done - before)
            if rep.pulls:                           # a decode replica's KV may have room at the batch end
                self._push(rep.now, PULL, rep.index - len(self.front))
            if heap:
                self._touch(rep)
            if check:                               # the replica's own step count: its checks' turns
                checked[rep.index] += 1
                invariants.after_step(self, rep, checked[rep.index])
        if turns is not None:
            self._drain_turns()
        if check:
            invariants.at_end(reqs)
        return run_records(self, _time.perf_counter() - wall0)

    def _set_next(self, nxt: int, t: float) -> None:
        k = self.reqs.next_servable(nxt)
        self._pending(k < self.reqs.n, t)
        self.arrivals.next_time = self.reqs.arrival[k] if k < self.reqs.n else None

    def _pending(self, pending: bool, t: float) -> None:
        """Set whether arrivals are pending; when they end, every waiting replica plans again
        at t (a policy may hold requests back until then, e.g. WAIT's drain)."""
        if self.arrivals.pending and not pending:
            for r in self.replicas:
                r.wake(t)
                self._touch(r)
        self.arrivals.pending = pending

    # ----- sessions ----------------------------------------------------------------------
    def _turn_done(self, i: int, t: float) -> None:
        """Request i finished (or was rejected) at t: its session's next turn is due think later."""
        tr = self._turns
        s = tr.next[i]
        if s >= 0:
            due = t + tr.think[s]
            heapq.heappush(tr.due, due)
            self._push(due, ISSUE, s)
            self._turn_times(t)

    def _issue_turn(self, s: int, t: float) -> None:
        """Later turn s arrives at t (a rejected one finishes at once)."""
        tr, reqs = self._turns, self.reqs
        heapq.heappop(tr.due)
        tr.left -= 1
        reqs.arrival[s] = t
        if reqs.rejected_list[s]:
            self._turn_done(s, t)
        else:
            self._arrive(s, t)
        self._turn_times(t)

    def _set_next_turns(self, nxt: int, t: float) -> None:
        """`_set_next` with sessions: the open loop's next row skips later turns too."""
        tr, n = self._turns, self.reqs.n
        while nxt < n and tr.skip[nxt]:
            nxt += 1
        tr.open = nxt
        self._turn_times(t)

    def _turn_times(self, t: float) -> None:
        """Pending while a first turn or a later turn is still to come; the next known time is
        the open loop's next arrival or the earliest scheduled turn (None while the later turns
        wait for their previous turns to finish, as in a closed loop)."""
        tr = self._turns
        times = tr.due[:1] + ([tr.arrival[tr.open]] if tr.open < self.reqs.n else [])
        self._pending(bool(times) or tr.left > 0, t)
        self.arrivals.next_time = min(times) if times else None

    def _drain_turns(self) -> None:
        """After the last finish only rejected turns remain: record when they would have arrived."""
        events = self._events
        while events:
            ev = heapq.heappop(events)
            if ev[2] == ISSUE:
                self._issue_turn(ev[3], ev[0])

    def _deadlock(self, closed: bool) -> None:
        stuck = [r for r in self.replicas if r._queue or r._running or r._landing
                 or r._side is not None and r._side.busy()]
        if not stuck and any(r.pulls for r in self.back):
            raise KvschedError("disaggregation deadlock: requests wait for decode KV that never frees "
                               "(report this: it is a simulator bug)")
        r = stuck[0] if stuck else self.replicas[0]
        where = f" on replica {r.index}" if len(self.replicas) > 1 else ""
        raise PlanError(
            f"policy {r.name} returned an empty plan with {len(r._queue)} waiting and "
            f"{len(r._running)} running requests{where} and no arrivals left (deadlock"
            f"{'; in a closed loop requests arrive only when others finish' if closed else ''})")

    @property
    def timeline(self):
        """Rows (time, queue, running, KV used) per batch; in a cluster every replica's rows,
        by time, with the replica's number last."""
        return self._rows("timeline")

    @property
    def batches(self):
        """Rows (start, duration, prefill tokens, prefill requests, decode requests, KV used)
        per batch, as `timeline` (by start)."""
        return self._rows("batches")

    def _rows(self, name: str):
        reps = self.replicas
        if len(reps) == 1 or getattr(reps[0], name) is None:
            return getattr(reps[0], name)
        return MergedRows((r.index, getattr(r, name)) for r in reps)
