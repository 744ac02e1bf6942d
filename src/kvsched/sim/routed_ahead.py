"""Replicas behind a router that reads no state (docs/architecture.md, "Cluster loop").

Such a built-in router (`uses_state` false: round-robin, random) sees only the request, its
arrival time and the pool's size, so in an open loop (no closed loop, no sessions) on one
pool its choices are known before the run: `routed_ahead` makes them up front, by the same
calls in the same order as the loop would. (Not a user's router: it may read what the run
does through other channels, and its errors would come before the run's.) Replicas of one
pool then change each other only through the cluster-wide figures the view shows
(`arrivals_pending`, `next_arrival`, `issued`, `in_flight`), through state their policies'
copies share, and through the cost model, one object for all of them. So, with a built-in
cost model (a user's may keep state):
- a replica whose policy is `replica_local` (policies/base.py: it reads none of those
  figures and its copies share nothing) runs its idle decode batches, which run without the
  policy, up to its own next arrival, not the next one anywhere (`Cluster._run`);
- when every policy is a built-in `replica_local` one, the replicas run one after another,
  each alone on a request table of its own requests (`apart_tables`, `run_apart`): the same
  batches, bit for bit, with one replica's working set in the caches at a time (8 replicas
  of 125,000 requests about as fast as one of 125,000, eight times over).
"""
from __future__ import annotations

import time as _time
from typing import TYPE_CHECKING, Callable

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

import numpy as np

from kvsched.errors import KvschedError
from kvsched.kvcache import PagedKV
from kvsched.policies.base import replica_local
from kvsched.sim import invariants
from kvsched.sim.records import run_records
from kvsched.sim.requests import INF, RequestTable

if TYPE_CHECKING:
    from kvsched.metrics import RunRecords
    from kvsched.sim.cluster import Cluster

Ahead = tuple[list[int], list[int], list[int], list[bool]]


def route_all(cluster: Cluster, size: int) -> list[int]:
    """Each request's replica of a pool of `size` (-1: rejected), routed in arrival order by
    the calls the loop's `Cluster._arrive` makes (errors named as there)."""
    reqs = cluster.reqs
    n, arrival, rejected = reqs.n, reqs.arrival, reqs.rejected_list
    pool = range(size)                  # `_route` reads only its size when the router reads no state
    route = [-1] * n
    for i in range(n):
        if not rejected[i]:
            route[i] = cluster._route(cluster.router, pool, i, arrival[i])
    return route


def ahead_of_time(cluster: Cluster, chain: bool, size: int) -> bool:
    """Whether the routes of a pool of `size` replicas may be made before the run: an open loop
    (`chain`: no closed loop, no sessions) on one pool of two replicas or more behind a
    built-in router that reads no state, with a built-in cost model."""
    return (chain and not cluster.disaggregated and size >= 2 and not cluster.router.uses_state
            and cluster.control is None
            and type(cluster.router).__module__ == "kvsched.sim.routers"
            and all(type(c).__module__.startswith("kvsched.") for c in cluster._costs))


def routed_ahead(cluster: Cluster, chain: bool) -> Ahead | None:
    """When `ahead_of_time`: each servable request's replica (-1: rejected), routed now in
    arrival order; each request's next one on the same replica (n: none); each replica's
    first; and which replicas may run their idle decode batches to their own next arrival
    (`runs_ahead`, and a `replica_local` policy). Else None."""
    pool = cluster.front
    if not ahead_of_time(cluster, chain, len(pool)):
        return None
    n = cluster.reqs.n
    route = route_all(cluster, len(pool))
    next_same, upcoming = [n] * n, [n] * len(pool)
    for i in range(n - 1, -1, -1):
        k = route[i]
        if k >= 0:
            next_same[i], upcoming[k] = upcoming[k], i
    alone = [bool(r.runs_ahead) and replica_local(r.policy) for r in pool]
    return route, next_same, upcoming, alone


def apart_tables(cluster: Cluster, policies, kv: PagedKV, max_model_len: int | None,
                 strict: bool, spec_slots: tuple[int, int] = (0, 0)) -> list[RequestTable] | None:
    """Each replica's own request table (its requests in arrival order, `rows` their rows in
    the cluster's table), when its replicas may run one after another (`run_apart`): routes
    made `ahead_of_time` and built-in `replica_local` policies, one object per replica. Else
    None. Made before the replicas, which are built on them."""
    w = cluster.reqs.workload
    if (not ahead_of_time(cluster, not (w.closed_loop or w.has_sessions), len(policies))
            or not all(replica_local(p) and type(p).__module__.startswith("kvsched.policies.") for p in policies)
            or len({id(p) for p in policies}) < len(policies)):     # one object on two replicas shares its state
        return None
    route = np.array(route_all(cluster, len(policies)), np.int64)
    order = np.argsort(route, kind="stable")    # each replica's rows in arrival order, in one pass
    ends = np.searchsorted(route[order], np.arange(len(policies) + 1) - 1, side="right")
    tables = []
    for k in range(len(policies)):
        rows = order[ends[k]:ends[k + 1]]
        table = RequestTable(w.take(rows), kv.block_size, kv.capacity_blocks, max_model_len=max_model_len,
                             strict=strict, spec_slots=spec_slots)
        table.rows = rows
        tables.append(table)
    return tables


class Unseen:
    """A replica's arrivals while the replicas run apart: the cluster-wide figures then are
    not those of the replica's time, so a policy reading them stops the run, named."""
    __slots__ = ("policy",)

    def __init__(self, policy: str) -> None:
        self.policy = policy

    def refuse(self, what: str) -> None:
        raise KvschedError(f"view.{what} is the cluster's, and policy {self.policy} declares replica_local = True "
                           "(it reads nothing of other replicas), so the replicas run one after another: "
                           "remove the declaration to read it (policies/base.py, Policy)")


@cython.locals(j=cython.Py_ssize_t, last=cython.double)
def run_apart(cluster: Cluster, progress: Callable[[int, int], None] | None, wall0: float) -> RunRecords:
    """Each replica alone, in index order, on its own table (`apart_tables`), from its first
    arrival to its last finish; then its requests' records go to the cluster's table. A
    replica takes its own arrivals and, as the loop gives it, the end of the arrivals
    anywhere (a blocked policy plans again: `Cluster._pending`) at the last servable
    arrival's time, after the arrivals at that time. Its batches are the loop's, bit for
    bit; what differs is the order in which replicas run, seen only by reads of the
    cluster-wide figures (refused: `Unseen`) and by a run that fails: it stops at the first
    replica that fails, in index order, not at the earliest failure in time, and an error
    naming a request gives its row in the replica's table. The cluster's table ends as the
    loop leaves it, but for `issued` (0: nothing reads it after the run)."""
    reqs, reps = cluster.reqs, cluster.replicas
    j = reqs.n - 1
    while j >= 0 and reqs.rejected_list[j]:
        j -= 1
    last = reqs.arrival[j] if j >= 0 else INF
    check = invariants.enabled()            # KVSCHED_CHECK=1: the invariants after every step
    for rep in reps:
        rep._arrivals = Unseen(rep.name)
    try:
        _each_alone(cluster, last, progress, check)
    finally:                                # the view reads the cluster's figures again
        for rep in reps:
            rep._arrivals = cluster.arrivals
    _gather(reqs, reps)
    cluster.arrivals.pending, cluster.arrivals.next_time = False, None     # as the loop leaves them
    if check:
        invariants.at_end(reqs)
    return run_records(cluster, _time.perf_counter() - wall0)


@cython.locals(rep="Replica", part="RequestTable", j=cython.Py_ssize_t, m=cython.Py_ssize_t,
               steps=cython.longlong, checked=cython.longlong, t_arr=cython.double, t_rep=cython.double,
               t_end=cython.double, last=cython.double, woken=cython.bint, before=cython.Py_ssize_t)
def _each_alone(cluster: Cluster, last: float, progress: Callable[[int, int], None] | None, check: bool) -> None:
    """`run_apart`'s replicas, one after another (`last`: the last servable arrival's time)."""
    reqs = cluster.reqs
    steps, before = 0, 0
    for rep in cluster.replicas:
        part = rep.reqs
        arrival, m = part.arrival, part.n
        j, woken, checked = 0, False, 0
        while part.done < part.remaining:
            t_arr = arrival[j] if j < m else INF
            t_end = INF if woken else last
            t_rep = rep.next_event_time()
            if t_arr < INF and t_arr <= t_rep and t_arr <= t_end:
                rep.accept(j, t_arr)
                j += 1
                continue
            if t_end < INF and t_end <= t_rep:
                rep.wake(last)
                woken = True
                continue
            if t_rep == INF:
                cluster._deadlock(False)
            if rep.step(t_arr if rep.runs_ahead and not rep._queue else 0.0):
                steps += 1
                if progress is not None and steps % 4096 == 0:
                    progress(before + part.done, reqs.remaining)
            if check:
                checked += 1
                invariants.after_step(cluster, rep, checked)
        before += part.done


def _gather(whole: RequestTable, reps: list) -> None:
    """The replicas' records and their requests' end states into the cluster's table, at their
    requests' rows (a finished request's other per-request values are back at their start)."""
    status, gen = np.array(whole.status, np.int64), np.array(whole.gen, np.int64)
    for rep in reps:
        part, rows = rep.reqs, rep.reqs.rows
        for name in ("admitted", "first", "finished", "itl_max", "viol", "preempts", "recomputed"):
            getattr(whole, name)[rows] = getattr(part, name)
        whole.replica[rows] = rep.index
        status[rows], gen[rows] = part.status, part.gen
    whole.status, whole.gen = status.tolist(), gen.tolist()
    whole.done = sum(rep.reqs.done for rep in reps)
