"""A request's life on a replica (docs/architecture.md, "Replica"): admitted from the queue,
preempted back to its front (recompute) or swapped out to host memory and back
(sim/host_swap.py), its cached prefix loaded from the tiers below the GPU (sim/kv_tiers.py),
its prefill complete (first token: it decodes here,
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
from kvsched.sim.kv_blocks import decode_blocks, free
from kvsched.sim.records import fold
from kvsched.sim.requests import DECODE, DONE, INF, LOADING, PREFILL, SWAPPED, TRANSFER, WAITING

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
def preempt(rep: Replica, i: int, defer: list | None = None) -> None:
    """Preempt running request i by recompute. `defer` (a list): its KV is freed later, when an
    allocation needs it (kv_blocks.py, `allocate_in_order`), as vLLM frees a victim only once a
    running request's allocation fails."""
    r = rep.reqs
    if i in rep._where:                    # decoding
        kv_tokens = leave_decode(rep, i, defer)
        if defer is None:
            free(rep, i, kv_tokens, False)
        requeue_decoder(rep, i, kv_tokens)
    else:                                   # prefilling (the check made sure it runs here)
        kv_tokens = r.computed[i]
        del rep._prefilling[i]
        if defer is None:
            free(rep, i, kv_tokens, False)
        else:
            defer.append((i, kv_tokens, 0))
        requeue(rep, i, kv_tokens, kv_tokens)
    rep._fresh.discard(i)
    del rep._running[i]
    r.preempts[i] += 1
    rep.preemptions += 1
    if rep._on_preempt is not None:
        rep._call(rep._on_preempt, "on_preempt", i)


@cython.locals(r="RequestTable")
def requeue(rep: Replica, i: int, recomputed: int, backlog: int) -> None:
    """Request i, its KV gone, goes back to the queue's front (with tiers: behind the requests
    holding a loaded prefix, `held_front`): `recomputed` tokens to compute again, `backlog`
    more prefill tokens waiting here."""
    r = rep.reqs
    r.recomputed[i] += recomputed
    rep.prefill_backlog += backlog
    r.computed[i] = 0
    r.status[i] = WAITING
    q = rep._queue
    if rep._offload is not None and rep.cache.held and q and q[0] in rep.cache.held:
        q.insert(held_front(rep), i)        # behind the requests holding a loaded prefix
    else:
        q.appendleft(i)


def held_front(rep: Replica) -> int:
    """How many requests at the queue's front hold a loaded prefix: vLLM 0.32 serves them first
    (`kv_holding_waiting` is drained before `waiting`, scheduler.py `schedule`), so a request
    preempted now goes behind them, where vLLM's `waiting.prepend_request` puts it."""
    q, held = rep._queue, rep.cache.held
    k = 0
    while k < len(q) and q[k] in held:
        k += 1
    return k


@cython.locals(r="RequestTable")
def requeue_decoder(rep: Replica, i: int, kv_tokens: int) -> None:
    """Decoder i, its kv_tokens of KV gone, recomputes its prompt and its tokens so far
    (vLLM's preemption by recompute): all of them, its last token's KV included."""
    r = rep.reqs
    r.target[i] = r.prompt[i] + r.gen[i]
    requeue(rep, i, kv_tokens + 1, r.target[i])


@cython.locals(r="RequestTable")
def swap_out(rep: Replica, i: int) -> None:
    """Preempt decoding request i by swapping its KV to host memory (sim/host_swap.py); where
    the host tier has no room, by recompute (`preempt`), counted as a fallback."""
    sw = rep._swap
    r = rep.reqs
    bs = rep.block_size
    blocks = -(-rep._where[i].kv_tokens(i) // bs)
    if not sw.fits(blocks):
        sw.fallbacks += 1
        preempt(rep, i)
        return
    kv_tokens = leave_decode(rep, i)
    free(rep, i, kv_tokens, False)
    r.computed[i] = kv_tokens
    r.status[i] = SWAPPED
    del rep._running[i]
    sw.copy_out(i, blocks, rep.now)
    r.preempts[i] += 1
    rep.preemptions += 1


def swap_tick(rep: Replica) -> bool:
    """At a step's start: swapped requests whose KV is back on the GPU join the decoders (as
    landed ones do), then the oldest swapped-out ones whose copy has reached host get GPU
    room while it fits (and while the policy's `max_num_seqs` has seats) and their copy-in
    starts. A copy that lands while every seat is taken waits, its GPU room held, for the
    first seat that frees (before the policy plans). A replica with nothing else to run waits
    for the next landing on either side as an event (`swap_wake`): stepped then, its clock
    moves there, so arrivals and other replicas' steps before it come first. True if it has
    nothing to run (the step plans nothing)."""
    sw = rep._swap
    if not sw.busy():
        return False
    seated = seats(rep)
    if rep._blocked or not (rep._queue or rep._running or rep._landing):     # stepped at its wake-up
        t = sw.inflight[0][0] if sw.inflight else sw.ready[sw.out[0]] if sw.out else rep.now
        if t > rep.now:
            rep.now = t
    while True:
        sw.parked.extend(sw.landed(rep.now))
        while sw.parked and len(rep._running) + len(rep._landing) < seated:     # back on the GPU: a seat each
            rep._landing.append(sw.parked.popleft())
            rep._blocked = False
        # oldest first, once its copy is on host, within the policy's seats (v0's _schedule_swapped budget)
        while (sw.out and sw.ready[sw.out[0]] <= rep.now and len(rep._running) + len(rep._landing) + sw.pending() < seated
               and rep.reserve(sw.out[0], rep.now)):
            sw.copy_in(sw.out.popleft(), rep.now)
        idle = rep._blocked or not (rep._queue or rep._running or rep._landing)
        if not idle:
            return False
        if sw.inflight or not sw.out or sw.ready[sw.out[0]] > rep.now:
            return True                     # wait for the next landing (`swap_wake`)
        if not rep.reserve(sw.out[0], rep.now):     # no room even on an idle GPU: it recomputes
            swap_to_recompute(rep, sw.out.popleft())
        else:
            sw.copy_in(sw.out.popleft(), rep.now)


def swap_to_recompute(rep: Replica, i: int) -> None:
    """Swapped-out request i goes back to the queue's front to recompute, as `preempt` sends a
    decoder (its host copy dropped): what a swap-in that can never fit does."""
    rep._swap.drop(i)
    requeue_decoder(rep, i, rep.reqs.computed[i])
    rep._blocked = False


def swap_wake(rep: Replica) -> float:
    """When a replica with swapped requests (and perhaps nothing else) steps next: now if it
    has work or room to give back, else the next copy-in's landing (`Replica.next_event_time`)."""
    sw = rep._swap
    if not (rep._blocked or not (rep._queue or rep._running or rep._landing)):
        return rep.now
    t = sw.inflight[0][0] if sw.inflight else sw.ready[sw.out[0]] if sw.out else INF
    return t if t > rep.now else rep.now


def seats(rep: Replica) -> int:
    """The policy's `max_num_seqs` (running requests at most), or no limit."""
    n = getattr(rep.policy, "max_num_seqs", None)
    return n if type(n) is int else 1 << 62


def load_tick(rep: Replica) -> bool:
    """At a step's start, with tiers below the GPU (sim/kv_tiers.py): blocks computed last batch
    go down (`--kv-write through`); loads that have landed put their requests back at the
    queue's front, their prefix now cached on the GPU; then waiting requests at the queue's
    front whose cached prefix continues in a tier start loading it (`load_scan`; not under a
    policy that computes prompts from token 0, `Offload.reads`). A replica with nothing else to
    run waits for the next landing as an event (`load_wake`): stepped then, its clock moves
    there, so arrivals and other replicas' steps before it come first. True if it has nothing
    to run (the step plans nothing)."""
    off = rep._offload
    if off.deferred:
        off.flush()
    if off.loading:
        if rep._blocked or not (rep._queue or rep._running or rep._landing):     # stepped at its wake-up
            t = off.next_landing()
            if t > rep.now:
                rep.now = t
        back = off.landed(rep.now)
        for i, first, n in reversed(back):
            load_land(rep, i, first, n)
    if rep._queue and off.reads:
        load_scan(rep)
    return rep._blocked or not (rep._queue or rep._running or rep._landing)


def load_scan(rep: Replica) -> None:
    """vLLM 0.32's waiting loop (scheduler.py, `schedule`) as far as loads go: the waiting
    requests in queue order, while the policy has seats and the step's token budget lasts; each
    needs its whole prompt beyond its cached prefix to fit in the free blocks beside the
    decoders' next step (`allocate_slots(..., full_sequence_must_fit=)`, kv_cache_manager.py):
    - one holding a loaded prefix (vLLM's `kv_holding_waiting`, served first) or with nothing
      below the GPU is the policy's to admit: its first chunk's blocks and tokens are counted,
      and the rest of its prompt joins the in-flight prefills' reservation;
    - one whose cached prefix continues in a tier starts loading it (`load_start`; no token
      budget, no seat); if another request here is loading some of those blocks, it waits for
      that load instead, holding nothing, whatever the room; so does one with a block of its run
      below still being written, till the write lands (vLLM delays it before any allocation:
      offloading/scheduler.py, `get_num_new_matched_tokens` returns None; `Offload.delay`);
    - a load also needs its blocks to fit beside what the in-flight prefills (running ones,
      loads in flight or landed and held) still need (`reserved_blocks`,
      `_inflight_prefill_reserved_blocks`);
    - the first that does not fit ends the scan (vLLM's loop breaks where `allocate_slots`
      fails), so no load takes the room of a request ahead of it. The scan's room is an estimate
      (it counts the admissions ahead by the policy's budget, not by its plan): a request it
      leaves is the policy's to plan, and if the policy admits it and its load does not fit
      then, the admission ends the batch's admissions (`load_instead`, vLLM's break)."""
    cache, off, kv, bs = rep.cache, rep._offload, rep.kv, rep.block_size
    free = seats(rep) - len(rep._running) - len(rep._landing)
    if free <= 0:
        return
    budget = getattr(rep.policy, "max_num_batched_tokens", None)     # 0 or None: none (orca's default)
    budget = budget - rep._decoders.n if type(budget) is int and budget > 0 else 1 << 62
    target = rep._target
    room = kv.capacity_blocks - kv.used - decode_blocks(rep)     # free blocks once the decodes have theirs
    reserved = reservation(rep, {})         # what in-flight prefills still need (a load must leave it free)
    passed: set = set()                     # the prefixes of the requests left to the policy: a load spares them
    held, q = cache.held, rep._queue
    pos = 0                                 # loads leave the queue and take none of the `free` seats
    while free > 0 and pos < len(q):
        if budget <= 0:
            return
        i = q[pos]
        t = target[i]
        whole = -(-t // bs)
        pinned = held.get(i)
        if pinned is not None:              # its load landed: the policy admits it first
            c = min(budget, t - len(pinned) * bs)
            if whole - len(pinned) > room:  # its whole prompt must fit (full_sequence_must_fit)
                return
            room -= -(-(len(pinned) * bs + c) // bs) - len(pinned)
            reserved += whole - -(-(len(pinned) * bs + c) // bs)
            budget -= c
            pos += 1
            free -= 1
            continue
        gpu, cap, keys, src = prefix_below(rep, i)
        g = len(gpu)
        if keys is not None:
            wait = off.delay(keys, g, cap, src, cache.map)
            if wait is not None:            # delayed, holding nothing, till that write or load lands
                load_start(rep, i, [], keys, src, wait)
                continue
        taken = free_blocks_of(gpu)
        if whole - g + taken > room:        # its whole prompt must fit (full_sequence_must_fit)
            return
        if not src:                         # the policy admits it: its first chunk's blocks, the rest reserved
            passed.update(gpu)
            c = min(budget, t - g * bs)
            room -= -(-(g * bs + c) // bs) - g + taken
            reserved += whole - -(-(g * bs + c) // bs)
            budget -= c
            pos += 1
            free -= 1
            continue
        if len(src) + taken > room - reserved:     # a load leaves the in-flight prefills' blocks free
            return
        room -= len(src) + taken
        reserved += whole - g - len(src)
        load_start(rep, i, gpu, keys, src, None, passed)


@cython.locals(r="RequestTable")
def load_instead(rep: Replica, i: int, ends: dict) -> bool:
    """Admitted request i, at its chunk (batch.py, `prefill_shape`), after the batch's earlier
    allocations: if its cached prefix now continues in a tier (the allocations before it evicted
    blocks a tier holds), it loads them instead of prefilling, as vLLM's waiting loop looks it
    up then (scheduler.py, `get_num_new_matched_tokens` after the earlier `allocate_slots`);
    or waits for another request's load of them. The load must fit as in `load_scan`: its
    whole prompt in the free blocks, the load's blocks beside what in-flight prefills still
    need (`ends`: where this batch's chunks so far end). True if it loads or waits, or if the
    load does not fit (`Offload.broke`: vLLM's loop breaks there, so neither it nor a later
    admission of the plan is admitted); False: admitted as planned."""
    cache, off, bs = rep.cache, rep._offload, rep.block_size
    if i in cache.held:                     # its load landed: it prefills from its prefix
        return False
    gpu, cap, keys, src = prefix_below(rep, i)
    if keys is None:
        return False
    g = len(gpu)
    wait = off.delay(keys, g, cap, src, cache.map)
    if wait is not None:
        load_start(rep, i, [], keys, src, wait)
        return True
    if not src:
        return False
    taken = free_blocks_of(gpu)
    kv = rep.kv
    room = kv.capacity_blocks - kv.used
    if -(-rep._target[i] // bs) - g + taken > room or len(src) + taken > room - reservation(rep, ends):
        off.broke = True
        return True
    load_start(rep, i, gpu, keys, src, None)
    return True


def prefix_below(rep: Replica, i: int) -> tuple[list, int, list | None, list | None]:
    """Waiting request i's lookup: (its cached prefix on the GPU, the hit cap in blocks, the
    keys up to the cap and the tier each block after the GPU prefix is read from, `below`;
    both None when the GPU prefix reaches the cap)."""
    cache = rep.cache
    cap = cache.lookup_cap(i)
    gpu = list(cache.walk(i)) if cap > 0 else []
    if len(gpu) >= cap:
        return gpu, cap, None, None
    keys = cache.keys(i, cap)
    return gpu, cap, keys, rep._offload.below(keys, len(gpu), cap)


def free_blocks_of(gpu: list) -> int:
    """The blocks of a cached prefix that are free now (an admission takes them from the pool)."""
    n = 0
    for b in gpu:
        n += b.ref == 0
    return n


def reservation(rep: Replica, ends: dict) -> int:
    """What the in-flight prefills still need for their whole prompts, that a load must leave
    free (vLLM's `_inflight_prefill_reserved_blocks`): the running prefills (from where `ends`
    says this batch's chunk leaves them, else where they are) and the loads in flight (not a
    request waiting for another's load, which holds nothing)."""
    bs, target, computed = rep.block_size, rep._target, rep._computed
    reserved = 0
    for j in rep._prefilling:
        reserved += -(-target[j] // bs) - -(-ends.get(j, computed[j]) // bs)
    for j, (_, g, n, _, _, _) in rep._offload.loading.items():
        if n:
            reserved += -(-target[j] // bs) - g - n
    return reserved


def plan_stale(rep: Replica, i: int, c: int) -> bool:
    """Admitted request i's first chunk of `c` tokens was planned on a hit (the policy's prefix
    planner, `HitPlanner.hits`) that the batch no longer gives it: an earlier admission of the
    batch loads or waits instead (`load_instead`), so the blocks its chunk would have cached
    are not there. True: i is not admitted this batch (the policy plans it again next step),
    rather than prefilling from a shorter hit than its plan counted on."""
    planner = getattr(rep._planner, "_real", rep._planner)     # a LazyPlanner's real one, if made
    want = planner.hits.get(i) if planner is not None else None
    return want is not None and rep.cache.would_hit(i, c) * rep.block_size < want


@cython.locals(r="RequestTable")
def load_start(rep: Replica, i: int, gpu: list, keys: list, src: list, wait, protect: set | None = None) -> None:
    """Waiting request i holds its cached prefix on the GPU (`gpu`) and new blocks for the
    blocks the tiers hold (`src`), and waits while they load (vLLM: WAITING_FOR_REMOTE_KVS,
    its blocks allocated by `allocate_slots`); or, with `wait` (when another request's load of
    some of them, or a write of one, lands here: `Offload.delay`), waits for it, holding and
    loading nothing (`gpu` empty)."""
    r = rep.reqs
    cache, off = rep.cache, rep._offload
    cache.pin(i, gpu)
    first = r.admitted_c[i] == INF          # before its first admission: TTFT's loading part
    if wait is None:
        off.start(i, keys, len(gpu), src, first)    # before the allocation's evictions write blocks down
        cache.allocate(len(src), protect)       # sparing the prefixes of admissions ahead (vLLM allocates them first)
    else:
        off.wait_for(i, len(gpu), wait, first)
    rep._queue.remove(i)
    r.status[i] = LOADING


@cython.locals(r="RequestTable")
def load_land(rep: Replica, i: int, first: int, n: int) -> None:
    """Request i's load has landed: the loaded blocks are cached and the request, holding its
    whole cached prefix, goes back to the queue's front (vLLM: `_update_waiting_for_remote_kv`
    caches them, the request waits again with its blocks); its admission takes them as its hit
    (`PrefixCache.hit`). A request that waited for another's load (n = 0) held nothing: it is
    a plain waiting request again, looked up afresh (the rest of its prefix may be below), at
    the front of those holding no KV (vLLM re-queues a skipped request at `waiting`'s front,
    served after `kv_holding_waiting`)."""
    rep.reqs.status[i] = WAITING
    if n:
        rep.cache.adopt(i, first, n)
        rep._queue.appendleft(i)
    else:                                   # behind those holding KV, as vLLM's `waiting` after `kv_holding_waiting`
        rep.cache.held.pop(i, None)
        rep._queue.insert(held_front(rep), i)
    rep._blocked = False


def load_unpin(rep: Replica) -> bool:
    """The policy planned nothing: waiting requests holding a loaded prefix let go of it (kept
    cached), so that the room they hold cannot stall the queue (a request ahead of them may need
    it). True if any did (the policy plans again)."""
    cache, status = rep.cache, rep._status
    waiting = [i for i in cache.held if status[i] == WAITING]
    for i in waiting:
        cache.unpin(i)
    return bool(waiting)


def load_wake(rep: Replica) -> float:
    """When a replica with loads in flight steps next: now if it has work, else the next
    landing (`Replica.next_event_time`)."""
    if not (rep._blocked or not (rep._queue or rep._running or rep._landing)):
        return rep.now
    t = rep._offload.next_landing()
    return t if t > rep.now else rep.now


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
    if rep._spec is not None and (g >= r.output[i] or rep._handoff is not None):    # not decoding here:
        rep.kv.used -= rep._spec.leave(i, r.computed[i])      # slots a padded chunk held (sim/spec_decode.py)
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
    if rep._spec is not None:
        rep._spec.forget(i)
    if rep._on_finish is not None:
        rep._call(rep._on_finish, "on_finish", i)
    # drop this request's own int/float objects: later reads see shared ones
    r.gen[i] = r.output[i]
    r.computed[i] = 0
    r.last_tok[i] = 0.0
    if rep._on_done is not None:
        rep._on_done(i, t)


@cython.locals(ds="DecodeSet", c="Cohort")
def leave_decode(rep: Replica, i: int, defer: list | None = None) -> int:
    """Decoder i leaves the decode set: its KV tokens. `defer` (a preemption's): its blocks are
    freed later (`preempt`), those past its KV included."""
    ds = rep._decoders
    c = ds.where[i]
    kv_tokens, gen, last, lo, hi = ds.leave(i)
    fold(rep, i, gen, last, c, lo, hi)
    extra = 0
    if rep._spec is not None:               # blocks it held past its KV (drafts' and lookahead slots)
        extra = rep._spec.leave(i, kv_tokens)
    if defer is not None:
        defer.append((i, kv_tokens, extra))
    else:
        rep.kv.used -= extra
    return kv_tokens



def move(rep: Replica, i: int, src: Cohort, dst: Cohort) -> None:
    """Move a decoder between cohorts (a decode selection split or merged them)."""
    kv_tokens, gen, last, lo, hi = src.leave(i)
    fold(rep, i, gen, last, src, lo, hi)
    dst.join(i, kv_tokens, gen, rep.reqs.output[i], last)
