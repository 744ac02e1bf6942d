"""A request's life on a replica (docs/architecture.md, "Replica"): admitted from the queue,
preempted back to its front (recompute), its prefill complete (first token: it decodes here,
is handed off, or is done), landed from a prefill replica, finished. The one place its status,
the replica's queues and its counters change.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.sim.decode_set import Cohort
from kvsched.sim.kv_blocks import free
from kvsched.sim.records import fold
from kvsched.sim.requests import DECODE, DONE, INF, PREFILL, TRANSFER, WAITING

if TYPE_CHECKING:
    from kvsched.sim.replica import Replica


@cython.locals(r="RequestTable")
def admit(rep: Replica, i: int) -> None:
    r = rep.reqs
    q = rep._queue
    if q[0] == i:                           # the common case: the queue front
        q.popleft()
    else:
        q.remove(i)
    r.status[i] = PREFILL
    rep._running[i] = None
    rep._prefilling[i] = None
    if rep.cache is not None:
        rep._fresh.add(i)
        rep._admissions += 1
        rep._order[i] = rep._admissions
    if r.admitted_c[i] == INF:
        r.admitted_c[i] = rep.now


@cython.locals(r="RequestTable")
def preempt(rep: Replica, i: int) -> None:
    r = rep.reqs
    if i in rep._where:                    # decoding
        kv_tokens = leave_decode(rep, i)
        r.target[i] = r.prompt[i] + r.gen[i]
        r.recomputed[i] += kv_tokens + 1
        rep.prefill_backlog += r.target[i]
    else:                                   # prefilling (the check made sure it runs here)
        kv_tokens = r.computed[i]
        del rep._prefilling[i]
        r.recomputed[i] += kv_tokens
        rep.prefill_backlog += kv_tokens
    rep._fresh.discard(i)
    free(rep, i, kv_tokens, False)
    r.computed[i] = 0
    r.status[i] = WAITING
    del rep._running[i]
    rep._queue.appendleft(i)
    r.preempts[i] += 1
    rep.preemptions += 1
    if rep._on_preempt is not None:
        rep._call(rep._on_preempt, "on_preempt", i)


@cython.locals(r="RequestTable")
def prefill_complete(rep: Replica, i: int, t: float) -> None:
    del rep._prefilling[i]
    r = rep.reqs
    g = r.gen[i] + 1
    r.gen[i] = g
    if g == 1:
        r.first_c[i] = t
    else:                                   # resumed after preemption: one long gap
        gap = t - r.last_tok[i]
        rep.itl.add(gap)
        if rep.tier_itl is not None and r.tier[i] >= 0:
            rep.tier_itl[r.tier[i]].add(gap)
        if gap > r.itl_max_c[i]:
            r.itl_max_c[i] = gap
        if gap > r.tbt[i]:
            r.viol[i] += 1
    r.last_tok[i] = t
    if g >= r.output[i]:
        finish(rep, i, t, r.computed[i])
    elif rep._handoff is not None:         # prefill replica: the KV moves on, held until sent
        r.status[i] = TRANSFER
        del rep._running[i]
        rep.outstanding -= 1
        rep._handoff(i, t)
    else:
        r.status[i] = DECODE
        rep._decoders.join(i, r.computed[i], g, r.output[i], t)


@cython.locals(r="RequestTable", ds="DecodeSet")
def land_ready(rep: Replica) -> None:
    """Landed requests (their KV reserved by `reserve`) join the decode set."""
    r, ds = rep.reqs, rep._decoders
    for i in rep._landing:
        r.status[i] = DECODE
        rep._running[i] = None
        ds.join(i, r.computed[i], r.gen[i], r.output[i], r.last_tok[i])
    rep._landing.clear()


@cython.locals(r="RequestTable")
def finish(rep: Replica, i: int, t: float, kv_tokens: int) -> None:
    r = rep.reqs
    r.status[i] = DONE
    r.finished_c[i] = t
    del rep._running[i]
    if rep.cache is None:
        free(rep, i, kv_tokens, True)
    else:                                   # freed at the batch's end, in vLLM's order
        rep._finishing.append((i, kv_tokens))
    r.done += 1
    r.in_flight -= 1
    rep.outstanding -= 1
    rep.recent_finished.append((r.prompt[i], r.output[i]))
    if rep._on_finish is not None:
        rep._call(rep._on_finish, "on_finish", i)
    # drop this request's own int/float objects: later reads see shared ones
    r.gen[i] = r.output[i]
    r.computed[i] = 0
    r.last_tok[i] = 0.0
    if rep._on_done is not None:
        rep._on_done(i, t)


@cython.locals(ds="DecodeSet", c="Cohort")
def leave_decode(rep: Replica, i: int) -> int:
    ds = rep._decoders
    c = ds.where[i]
    kv_tokens, gen, last, lo, hi = ds.leave(i)
    fold(rep, i, gen, last, c, lo, hi)
    return kv_tokens


def move(rep: Replica, i: int, src: Cohort, dst: Cohort) -> None:
    """Move a decoder between cohorts (a decode selection split or merged them)."""
    kv_tokens, gen, last, lo, hi = src.leave(i)
    fold(rep, i, gen, last, src, lo, hi)
    dst.join(i, kv_tokens, gen, rep.reqs.output[i], last)
