"""Decode-only batches without the policy (docs/architecture.md, "Replica"): while nothing waits
or prefills and one decode step of every decoder fits, a policy that `decodes_when_idle`
plans Plan([], [], True, []); these run back to back here, inlined, with the results of
`batch.execute` bit for bit, until the caller's next event.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.cost.roofline import DenseTime, RooflineCost
from kvsched.cost.shape import BatchShape
from kvsched.policies.base import Plan, defined_in
from kvsched.sim.batch import batch_end, execute, seconds
from kvsched.sim.decode_set import Cohort
from kvsched.sim.kv_blocks import free_finished, take
from kvsched.sim.lifecycle import finish, leave_decode
from kvsched.sim.records import first_gaps, spill_logs
from kvsched.sim.requests import INF
from kvsched.sim.rowlog import CHUNK

if TYPE_CHECKING:
    from kvsched.sim.replica import Replica

IDLE_PLAN = Plan([], [], True, [])      # what a `decodes_when_idle` policy plans when idle (read only)


@cython.locals(ds="DecodeSet", c="Cohort", kv="PagedKV")
def idle_fits(rep: Replica) -> bool:
    """Nothing waits or prefills here, the decoders are one cohort and one decode step of
    them all fits in free KV: the state where a steady policy decodes everyone."""
    ds = rep._decoders
    if rep._queue or rep._prefilling or not ds.n or len(ds.cohorts) != 1 or rep._spec is not None:
        return False
    c = ds.cohorts[0]
    kv = rep.kv
    return kv.used + c.residue[-c.clock % rep.block_size] <= kv.capacity_blocks


def decode_run(rep: Replica, until: float) -> None:
    """The batches `batch.execute` runs for Plan([], [], True, []), bit for bit, while the
    state stays idle (`idle_fits`) and the clock is before `until`; at least one.
    Without tiers or an `on_batch_end` hook they take the inlined `plain_decodes`."""
    if rep.pulls or rep._side is not None and rep._side.busy():    # KV pulled, swapped in or loaded after every batch
        until = 0.0
    if rep._on_batch_end is None and rep.tier_itl is None:
        c = rep._decoders.cohorts[0]
        plain_decodes(rep, c, until)
        return
    while True:                             # tiers or a batch hook: the general batch
        execute(rep, IDLE_PLAN)
        if rep._on_batch_end is not None:
            rep._call(rep._on_batch_end, "on_batch_end", None)
        if not (rep.now < until and idle_fits(rep)):
            return


@cython.locals(bs=cython.longlong, cap=cython.longlong, n=cython.longlong, clock=cython.longlong,
               ctx=cython.longlong, used=cython.longlong, f=cython.longlong, switch=cython.bint,
               now=cython.double, last=cython.double, kv_integral=cython.double,
               busy=cython.double, peak=cython.longlong, k=cython.longlong, k0=cython.longlong,
               running=cython.Py_ssize_t, base=cython.longlong, gaps=cython.double[:], glen=cython.Py_ssize_t,
               allocated=cython.longlong, track=cython.bint, hooks=cython.bint, nf=cython.Py_ssize_t,
               dnew=cython.longlong, held=cython.longlong, nb=cython.longlong,
               dt=cython.double, start=cython.double, gap=cython.double,
               residue=list, heap=list, kv="PagedKV", itl="GapHistogram", dense="DenseTime")
@cython.overflowcheck(True)
def plain_decodes(rep: Replica, c: Cohort, until: float) -> None:
    """`decode_run`'s batches inlined (the bulk of a run): what `decode_step` and
    `batch.execute` does, in the same order of float operations. The batch's figures are kept in
    locals (C's, when compiled: counts bounded by the KV capacity, kvcache.py's
    `TOKEN_LIMIT`) and written back before anything outside can look (a finish's hooks,
    the end)."""
    bs, kv, cap = rep.block_size, rep.kv, rep.kv.capacity_blocks
    residue, fresh, heap = c.residue, c.fresh, c._heap
    n, clock, ctx, used = c.n, c.clock, c.ctx, kv.used
    f = heap[0][0] if heap else 1 << 62    # the next finish (maybe stale: due() sorts it out)
    decode_time, dense = rep._decode_time, rep._dense_time
    last_kind = rep._last_kind
    switch = last_kind != 2 and last_kind != 0
    now, last = rep.now, c.last_time
    itl = rep.itl
    kv_integral, busy, peak, k = rep.kv_integral, rep.busy, rep.peak_kv, rep.iterations
    k0 = k
    recent = rep.recent_batch_times.append
    timeline = rep.timeline.append if rep.timeline is not None else None
    batches = rep.batches.append if rep.batches is not None else None
    running = len(rep._running)
    base, gaps = c._base, c._gaps_c
    glen = len(gaps)
    allocated = 0
    track = rep.track_start
    hooks = rep._on_finish is not None or rep._on_done is not None
    nf = len(fresh)                         # fresh members only before the first batch
    dnew = residue[-clock % bs]
    while True:
        held = used + dnew
        nb = n
        if track:                           # the router summary at the batch's start
            rep._snap = (rep.outstanding, held, rep.prefill_backlog)
        if dense is not None and ctx + n <= dense.ctx_limit:
            dt = dense._batch(n, n, ctx + n, ctx + n)
        else:
            dt_o = decode_time(n, ctx + n, switch)
            dt = dt_o if type(dt_o) is float else seconds(dt_o)
        switch = False
        start, now = now, now + dt
        if not start < now < INF:
            batch_end(start, dt)      # the error, if dt is one
        clock += 1
        if clock - base >= glen:
            c.clock = clock                 # as Cohort.step: _trim reads the new clock
            c._trim()
            base, gaps = c._base, c._gaps_c
            glen = len(gaps)
        gap = now - last
        gaps[clock - base] = gap
        last = now
        ctx += n
        allocated += dnew
        used = held
        itl.add(gap, n - nf)                # the members that decoded the step before
        if nf:                              # fresh decoders' first gaps, into the histogram
            first_gaps(rep, c, now)
            nf = 0
        if clock >= f:                      # finishes: the general code, on the state written back
            write_back(rep, c, clock, ctx, now, allocated, used)
            allocated = 0
            if hooks:                       # what a hook may look at: the figures so far
                rep.kv_integral, rep.busy, rep.peak_kv, rep.iterations = kv_integral, busy, peak, k
                rep.now, rep._last_kind = now, 2
            for i in c.due():
                finish(rep, i, now, leave_decode(rep, i))
            if rep._finishing:
                free_finished(rep)
            f = heap[0][0] if heap else 1 << 62
            n, ctx, used, running = c.n, c.ctx, kv.used, len(rep._running)
            base, gaps = c._base, c._gaps_c
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
    write_back(rep, c, clock, ctx, now, allocated, used)
    end_run(rep, k0, k, kv_integral, busy, peak, now)


def end_run(rep: Replica, k0: int, k: int, kv_integral: float, busy: float, peak: int, now: float) -> None:
    """The end of a decode run (`plain_decodes`): its figures written
    back, batches k0..k done, decode-only, the row logs' full chunks spilled."""
    rep.kv_integral, rep.busy, rep.peak_kv, rep.now = kv_integral, busy, peak, now
    rep._last_kind = 2
    if rep._stall:
        rep._stall = 0
    rep.iterations = k
    if k0 // CHUNK != k // CHUNK:
        spill_logs(rep)


def write_back(rep: Replica, c: Cohort, clock: int, ctx: int, now: float, allocated: int, used: int) -> None:
    """A run's cohort and KV state, from `plain_decodes`' locals: the blocks its batches
    took are allocated in one call (the same blocks, in the same order: nothing was freed
    in between)."""
    c.clock, c.ctx, c.last_time = clock, ctx, now
    take(rep, allocated)                    # kv.used becomes `used`


def dense_time(cost) -> DenseTime | None:
    """The cost model's batch times in C (cost/roofline.py, `DenseTime`), made from its terms
    now (a subclass may have changed them in its own __post_init__), when it is a
    RooflineCost whose `time` and `decode_time` are RooflineCost's own; else None."""
    kind = type(cost)
    if defined_in(kind, "time") is not RooflineCost or defined_in(kind, "decode_time") is not RooflineCost:
        return None
    return DenseTime.of(cost)


def decode_clock(cost) -> Callable[[int, int, bool], float]:
    """The time of a decode-only batch (n requests over ctx KV tokens): the cost model's
    `decode_time` when the class that defines `time` defines it too (a subclass that
    redefines `time` alone is not bypassed), else `time` of that BatchShape."""
    fn = getattr(cost, "decode_time", None)
    owner, timer = defined_in(type(cost), "decode_time"), defined_in(type(cost), "time")
    if callable(fn) and owner is not None and timer is not None and issubclass(owner, timer):
        return fn
    return lambda n, ctx, switch: cost.time(BatchShape(0, 0, 0, 0, n, ctx, (), switch))
