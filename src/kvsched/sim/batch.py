"""One batch of a replica, as named phases (docs/architecture.md, "Replica"): the plan checked
(sim/plan_check.py), then preempt, admit, allocate, shape and time, advance the clock, the
decode step, prefill completions, finishes, records. `decode_run.py` runs the decode-only
batches between events without a plan, the same phases inlined.
"""
from __future__ import annotations

from numbers import Real
from typing import TYPE_CHECKING

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.cost.shape import BatchShape
from kvsched.errors import PASS_THROUGH, KvschedError, PlanError
from kvsched.policies.base import Plan, allocates_in_order
from kvsched.sim.decode_set import Cohort
from kvsched.sim.kv_blocks import allocate, allocate_in_order, check, free_finished, release, take
from kvsched.sim.lifecycle import (admit, finish, leave_decode, load_instead, plan_stale, preempt, prefill_complete,
                                   swap_out)
from kvsched.sim.plan_check import check as check_plan, short, spec_cap, swap_choice
from kvsched.sim.records import first_gaps, spill_logs, tier_first_gaps
from kvsched.sim.requests import INF, PREFILL
from kvsched.sim.rowlog import CHUNK

if TYPE_CHECKING:
    from kvsched.sim.replica import Replica


@cython.locals(ds="DecodeSet", c0="Cohort", co="Cohort", kv="PagedKV", bs=cython.longlong, nd=cython.longlong,
               dnew=cython.longlong, dctx=cython.longlong, new_blocks=cython.longlong, pt=cython.longlong,
               pctx=cython.longlong, touched=cython.longlong, held=cython.longlong, kind=cython.int, switch=cython.bint,
               dt=cython.double, start=cython.double, end=cython.double, dense="DenseTime")
@cython.overflowcheck(True)
def execute(rep: Replica, plan: Plan) -> bool:
    """Check and run one plan, phase by phase; False if it is empty. (Compiled, its counts are
    C integers, checked for overflow: blocks are bounded by the KV capacity, kvcache.py's
    `TOKEN_LIMIT`, and token sums by the requests' lengths, MAX_TOKENS each; with prefix
    caching a shared prefix counts once per request.)"""
    victims, admitted, chunks, d = check_plan(plan, rep._face, rep.name, rep._plan_hooks)
    preempted = rep.preemptions
    swap = rep._swap
    chosen = getattr(plan, "swap", None)    # the policy's choice of victims to swap (Plan.swap)
    if chosen is not None:
        chosen = swap_choice(chosen, victims, swap is not None, rep.name)
    # vLLM v1 frees a victim when a running request's allocation fails: with prefix caching, what
    # the earlier requests allocate first evicts other cached blocks (kv_blocks.allocate_in_order)
    # (not with tiers below the GPU: vLLM's offloading connector defers frees of blocks it stores,
    # and frees-first is what its replay agrees with, docs/kv-tiers.md)
    defer = ([] if victims and rep.cache is not None and rep._offload is None and allocates_in_order(rep.policy)
             else None)
    for i in victims:                       # preempt: recompute, or swap a decoder out (sim/host_swap.py)
        if swap is not None and i in rep._where and i not in admitted and (chosen is None or i in chosen):
            swap_out(rep, i)
        else:
            preempt(rep, i, defer)
    off = rep._offload
    if off is not None and off.reads and admitted:
        lazy = set(admitted)                # admitted at their chunk: a prefix there may load instead
    else:
        lazy = None
        for i in admitted:                  # admit
            admit(rep, i)
    bs = rep.block_size
    ds = rep._decoders
    if d is True:
        cohorts = ds.cohorts if len(ds.cohorts) == 1 else ds.everyone()
        nd = ds.n
    elif d is False:
        cohorts, nd = (), 0
    else:
        cohorts = selected(rep, d)
        nd = 0
        for co in cohorts:
            nd += co.n
    dnew = dctx = 0                         # allocate: the decode step's blocks, then the chunks'
    verify = order = pads = cap = None
    sp = rep._spec
    if sp is not None:                      # speculative decoding: drafts, lookahead slots (sim/spec_decode.py)
        sp.padded = 0
        cap = getattr(plan, "spec", None)
        if cap is not None:
            cap, pads = spec_cap(cap, cohorts, admitted, chunks, sp.pad_limit(), rep.name)
    elif getattr(plan, "spec", None) is not None:
        raise PlanError(f"policy {rep.name} limited speculative drafts (Plan.spec) in a run without --spec")
    if nd and sp is not None:
        for co in cohorts:
            dctx += co.ctx
        dnew, verify = sp.plan(cohorts, cap)
        if defer:
            order = rep._spec.needs
    elif nd:
        if len(cohorts) == 1:
            c0 = cohorts[0]
            dnew = c0.residue[-c0.clock % bs]     # c0.new_blocks, inline
            dctx = c0.ctx
        else:
            for co in cohorts:
                dnew += co.new_blocks
                dctx += co.ctx
    if defer and order is None:             # each selected decoder's new block, if its step opens one
        order = {}
        for co in cohorts:
            for i in co.members:
                if co.kv_tokens(i) % bs == 0:
                    order[i] = 1
    if chunks:
        new_blocks, pt, pattn, pctx, shape_chunks = prefill_shape(rep, chunks, dnew, lazy, defer, order, pads)
        if rep.cache is not None:          # allocated there, the decode step included
            dnew = 0
        if lazy is not None and len(shape_chunks) < len(chunks):    # some loaded instead, or were not admitted
            status = rep._status
            chunks = [(i, c) for i, c in chunks if status[i] == PREFILL]
    else:
        new_blocks = pt = pattn = pctx = 0
        shape_chunks = ()
        if rep.cache is not None and dnew:
            if defer:
                allocate_in_order(rep, defer, order, {})
            else:
                allocate(rep, dnew)
            dnew = 0
    while defer:                            # victims no allocation needed
        release(rep, defer.pop(0))
    if lazy and not rep._offload.broke:     # admitted without a chunk this batch (none past a break)
        for i in admitted:
            if i in lazy:
                admit(rep, i)
    if lazy is not None:
        rep._offload.broke = False
    if pt == 0 and nd == 0:
        return False
    if sp is not None:                      # the drafter's k after this step (dynamic k: this batch's size)
        sp.batch_done(len(shape_chunks) + nd)
    kv = rep.kv
    held = kv.used + new_blocks + dnew
    check(rep, held)
    kind = (pt > 0) + 2 * (nd > 0)          # shape and time: 1 prefill-only, 2 decode-only, 3 mixed
    switch = kind != rep._last_kind and rep._last_kind != 0
    rep._last_kind = kind
    dense = rep._dense_time
    touched = pctx + (dctx + nd)            # the shape's prefill_ctx + decode_ctx
    if dense is not None and touched <= dense.ctx_limit:     # the roofline's time of this shape, in C
        dt = dense._batch(pt + nd, len(shape_chunks) + nd, pattn + (dctx + nd), touched)
    else:
        shape = BatchShape(pt if sp is None else pt + sp.padded, len(shape_chunks), pattn, pctx, nd, dctx + nd,
                           shape_chunks, switch)
        if verify:
            shape = verify_shape(shape, verify)
        try:
            dt_o = rep.cost.time(shape)
        except KvschedError:
            raise
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise rep._cost_failed(exc) from exc
        # an int or numpy scalar: the clock holds Python floats
        dt = dt_o if type(dt_o) is float else seconds(dt_o)
    start = rep.now                         # advance the clock
    end = start + dt
    if not start < end < INF:
        end = batch_end(start, dt)          # the error, if dt is one
    if rep.track_start:
        rep._snap = (rep.outstanding, held, rep.prefill_backlog - pt)
    take(rep, held - kv.used)               # checked above: held <= capacity
    rep.now = end                          # hooks called by the batch's effects see its end
    if nd:                                  # the decode step
        decode_step(rep, end, cohorts)
        if rep._stall:
            rep._stall = 0
    if pt:                                  # prefill completions
        rep.prefill_backlog -= pt
        out = nd
        computed, target = rep._computed, rep._target
        for i, c in chunks:
            computed[i] += c
            if computed[i] == target[i]:
                prefill_complete(rep, i, end)
                out = True
        if out:
            if rep._stall:
                rep._stall = 0
        elif rep.preemptions != preempted:  # preempted again, still no output token
            stalled(rep, end)
    if rep._finishing:                      # finishes free their blocks (prefix caching: vLLM's order)
        free_finished(rep)
    rep.recent_batch_times.append(dt)       # records
    if rep.timeline is not None:
        rep.timeline.append((end, len(rep._queue), len(rep._running), kv.used * bs))
    if rep.batches is not None:
        rep.batches.append((start, dt, pt, len(shape_chunks), nd, held * bs))
    rep.kv_integral += held * dt
    rep.busy += dt
    if held > rep.peak_kv:
        rep.peak_kv = held
    rep.iterations += 1
    if not rep.iterations % CHUNK:
        spill_logs(rep)
    return True


@cython.locals(bs=cython.longlong, new_blocks=cython.longlong, pt=cython.longlong, pctx=cython.longlong,
               p=cython.longlong, c=cython.longlong, cs=cython.longlong, n=cython.longlong, in_turn=cython.bint,
               inert=cython.bint)
@cython.overflowcheck(True)
def prefill_shape(rep: Replica, chunks, decode_blocks: int = 0, lazy: set | None = None, defer: list | None = None,
                  decoders: dict | None = None, pads: dict | None = None) -> tuple[int, int, float, int, list[tuple[int, int]]]:
    """The checked plan's chunks (sim/plan_check.py): (new KV blocks, tokens, query-key
    pairs, KV touched, per chunk).

    With prefix caching the blocks are allocated here, as vLLM's scheduler does (new KV
    blocks returned: 0): the running requests' chunks and the decode step
    (`decode_blocks`) first, then each admitted request's first chunk takes its cache hit
    (as far as the chunk leaves room: `PrefixCache.hit`) and its new blocks, in plan order;
    every chunk's full blocks are cached as it is scheduled, so later chunks of the batch
    hit them.

    `lazy` (tiers read below the GPU): the admitted requests, admitted here at their chunk. One
    whose prefix, as the allocations before it leave the cache, continues in a tier loads it
    instead of running its chunk (`lifecycle.load_instead`), as vLLM's waiting loop looks
    each request up after the ones before it allocated; its chunk is left out. A load that does
    not fit ends the admissions, as vLLM's loop breaks there: that request and the plan's later
    admissions stay waiting (`Offload.broke`).

    `defer` (victims whose KV is freed as needed, `kv_blocks.allocate_in_order`): the running
    requests allocate in admission order, the selected decoders `decoders` blocks each; an
    admission frees every victim left before it allocates.

    `pads` (Plan.spec naming admissions): a padded one-token last chunk takes its placeholder
    drafts' slots and rows too (sim/spec_decode.py, `Speculation.pad`)."""
    computed, bs = rep._computed, rep.block_size
    cache, fresh = rep.cache, rep._fresh
    # an inert cache (nothing keyed, nothing to key) misses every lookup: one allocation
    inert = cache is not None and cache.inert
    new_blocks = pt = pattn = pctx = 0
    in_turn = False                         # cached: chunks allocate one by one (an admission came)
    shape_chunks = []
    ends = {} if lazy is not None else None     # where each chunk placed so far ends (in-flight reservations)
    converted = False                       # an admission of this batch loads or waits instead
    running = {} if defer else None         # running requests' chunk blocks (allocated in order)
    for i, c in chunks:
        if lazy is not None and i in lazy:
            lazy.discard(i)
            if rep._offload.broke:          # past a load that did not fit: not admitted
                continue
            if not in_turn:
                first_turn(rep, new_blocks + decode_blocks, defer, decoders, running)
                new_blocks = decode_blocks = 0
                in_turn = True
            if load_instead(rep, i, ends):     # loads, waits, or (`broke`) does not fit
                converted = True
                continue
            if converted and plan_stale(rep, i, c):    # planned on blocks a converted chunk would have cached
                continue
            admit(rep, i)
        if inert and i in fresh:
            fresh.discard(i)
            cache.miss(i)
        elif cache is not None and i in fresh:
            if not in_turn:
                first_turn(rep, new_blocks + decode_blocks, defer, decoders, running)
                new_blocks = decode_blocks = 0
                in_turn = True
            fresh.discard(i)
            h = cache.hit(i, c)
            computed[i] = h
            rep.prefill_backlog -= h
            if h and rep.reqs.preempts[i]:
                rep.reqs.recomputed[i] -= min(h, rep.reqs.recomputed[i])
        p = computed[i]
        cs = c                              # rows and slots: with vLLM's pad_spec_decode, 1 + k
        if pads and i in pads:
            cs = rep._spec.pad(rep, i, p, c, pads[i])
        n = -(-(p + cs) // bs) - -(-p // bs)
        if ends is not None:
            ends[i] = p + c
        if cache is not None and not inert:
            cache.register(i, p, c)
        if in_turn:
            allocate(rep, n)
        else:
            new_blocks += n
            if running is not None:
                running[i] = n
        pt += c
        pattn += cs * (p + (cs + 1) / 2)
        pctx += p + cs
        shape_chunks.append((p, cs))
    if cache is not None:
        if in_turn or not defer:
            allocate(rep, new_blocks + decode_blocks)
        else:
            allocate_in_order(rep, defer, decoders, running)
        new_blocks = 0
    return new_blocks, pt, pattn, pctx, shape_chunks


def first_turn(rep: Replica, n: int, defer: list | None, decoders: dict | None, running: dict | None) -> None:
    """At the batch's first admission: the running requests' blocks (`n`, or in order with the
    victims freed as needed), then every victim left (vLLM admits nothing in a step that
    preempted; a policy that does, admits after the frees)."""
    if defer:
        allocate_in_order(rep, defer, decoders, running)
        while defer:
            release(rep, defer.pop(0))
    else:
        allocate(rep, n)


def selected(rep: Replica, d: frozenset | set) -> list[Cohort]:
    """The cohorts that decode when the checked plan names a set of decoders."""
    ds = rep._decoders
    if not d:
        return []
    return ds.everyone() if len(d) == ds.n else ds.select(d)


def stalled(rep: Replica, end: float) -> None:
    """A batch that preempted and gave no output token: stop the policy after
    `stall_batches` of them with no output token between. Batches that preempt nothing
    neither count nor reset: without a preemption every request only moves forward, so
    such batches end (a long prompt prefilled in small chunks, or the recomputation of
    what a preemption discarded, in as many batches as it takes). A policy that preempts
    and recomputes over and over, gaining a prompt token per round or none, is stopped."""
    rep._stall += 1
    if rep._stall >= rep._stall_limit:
        raise PlanError(
            f"policy {rep.name} made no progress: no output token in {rep._stall} batches that preempted, "
            f"with {len(rep._queue)} waiting and {len(rep._running)} running requests on replica {rep.index} "
            f"(t={end:.6g}s; the limit is stall_batches={rep._stall_limit})")


@cython.locals(ch="Cohort", itl="GapHistogram")
def decode_step(rep: Replica, end: float, cohorts) -> None:
    if rep.tier_itl is not None:
        tier_first_gaps(rep, end, cohorts)
    itl = rep.itl
    for ch in cohorts:
        if not ch.n:
            continue
        fresh = ch.fresh
        gap = ch.step(end)
        itl.add(gap, ch.n - len(fresh))
        if fresh:
            first_gaps(rep, ch, end)
        if rep._spec is not None:           # accepted drafts come out too (sim/spec_decode.py)
            rep._spec.verified(rep, ch)
        for i in ch.due():
            kv_tokens = leave_decode(rep, i)
            finish(rep, i, end, kv_tokens)


def verify_shape(shape: BatchShape, verify: list[tuple[int, int]]) -> BatchShape:
    """The batch with each verifying decoder as a prefill-like chunk of 1 + s tokens over its KV
    (issue "Speculative decoding", item 4: attention over the context, the weights read once by
    the whole batch): `verify` holds (KV tokens before the step, 1 + s) per such decoder; the
    shape's decode aggregates keep the decoders without drafts."""
    nv = len(verify)
    vt = vattn = vctx = kv_before = 0
    for p, c in verify:
        vt += c
        vattn += c * (p + (c + 1) / 2)
        vctx += p + c
        kv_before += p
    return BatchShape(shape.prefill_tokens + vt, shape.prefill_seqs + nv, shape.prefill_attn + vattn,
                      shape.prefill_ctx + vctx, shape.decode_seqs - nv, shape.decode_ctx - kv_before - nv,
                      list(shape.chunks) + verify, shape.phase_switch)


def batch_end(start: float, dt: float) -> float:
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


def seconds(dt) -> float:
    """A cost model's batch time as a Python float (`batch_end` checks its value)."""
    if isinstance(dt, bool) or not isinstance(dt, Real):
        raise KvschedError(f"cost model gave batch time {short(dt)}; it must be a number of seconds")
    try:
        return float(dt)
    except OverflowError:
        return INF
