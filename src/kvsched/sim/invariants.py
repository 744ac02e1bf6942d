"""The engine's named invariants (docs/architecture.md, "Invariants"), checked at every step of
a run when KVSCHED_CHECK=1 is set, whatever the policy (a user's included).

As BLIS names and tests its simulator's invariants (inference-sim, docs "invariants"), each
has a name, and a broken one stops the run with `InvariantError` whose message starts
"invariant NAME broken". The checks read the engine's state after every `Replica.step` (one
batch, or a run of decode-only batches that nothing else can see until it ends); they never
change it, so a checked run gives the same results bit for bit.

- kv-within-capacity: a replica's KV blocks in use are between 0 and its capacity (with
  prefix caching, in use plus cached-free never exceed it).
- tokens-conserved: the KV blocks in use are exactly those of the tokens the replica holds
  (prefilling requests' computed tokens, decoders' prompt + generated - 1, KV held for a
  transfer or reserved for one); each request's counts stay in range; the prefill backlog
  the routers read is the sum of the prefill tokens still to compute (a queue longer than
  `EVERY_STEP` requests: its front every step, the whole of it every few steps; the same for
  the prefix cache's held blocks); a
  finished request generated exactly its output.
- time-order: arrival <= admission <= first token <= last token <= finish <= the clock.
- all-accounted: at the end of a run, every request finished or was counted rejected.
- determinism, compiled-equals-interpreted: two runs' records agree bit for bit
  (`check_same`; the tests run them).
"""
from __future__ import annotations

import os

import numpy as np

from kvsched.errors import KvschedError
from kvsched.sim.requests import DECODE, DONE, LOADING, PREFILL, REJECTED, WAITING

NAMES = ("kv-within-capacity", "tokens-conserved", "time-order", "all-accounted", "determinism",
         "compiled-equals-interpreted")
ENV = "KVSCHED_CHECK"
# a waiting queue, or blocks held in the prefix cache, longer than this is checked whole every
# len / EVERY_STEP steps (a queue's front every step): an overloaded run's queue, or a cache of
# 1-token blocks, would otherwise make checking quadratic
EVERY_STEP = 512


class InvariantError(KvschedError):
    """An engine invariant does not hold: a simulator bug, or state changed from outside."""

    def __init__(self, name: str, detail: str) -> None:
        assert name in NAMES, name
        self.invariant = name
        super().__init__(f"invariant {name} broken: {detail}")


def enabled() -> bool:
    """Whether KVSCHED_CHECK asks for the checks (any value but empty or 0)."""
    return os.environ.get(ENV, "") not in ("", "0")


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def after_step(cluster, rep, step: int) -> None:
    """Every per-replica invariant of `rep` (a sim.replica.Replica of `cluster`, a
    sim.cluster.Cluster) after its own `step`-th step."""
    _kv_within_capacity(rep)
    _tokens_conserved(rep, in_transfer(cluster, rep), step)
    _time_order_here(rep)


def _kv_within_capacity(rep) -> None:
    kv, cache = rep.kv, rep.cache
    if not 0 <= kv.used <= kv.capacity_blocks:
        raise InvariantError("kv-within-capacity", f"replica {rep.index} holds {kv.used} KV blocks; "
                             f"capacity is {kv.capacity_blocks}")
    if cache is not None and kv.used + cache.queued > kv.capacity_blocks:
        raise InvariantError("kv-within-capacity", f"replica {rep.index} holds {kv.used} KV blocks and "
                             f"{cache.queued} cached free ones; capacity is {kv.capacity_blocks}")
    off = rep._offload
    if off is not None:
        for p in off.ports:
            s = p.store
            if len(s.keys) > s.capacity_blocks:
                raise InvariantError("kv-within-capacity", f"the {s.kind} tier holds {len(s.keys)} blocks; "
                                     f"capacity is {s.capacity_blocks}")
    sw = rep._swap
    if sw is not None and not (0 <= sw.used <= sw.capacity_blocks and sw.used == sum(sw.blocks.values())):
        raise InvariantError("kv-within-capacity", f"replica {rep.index}'s host tier holds {sw.used} blocks for "
                             f"{len(sw.blocks)} swapped requests ({sum(sw.blocks.values())}); capacity is "
                             f"{sw.capacity_blocks}")


def holdings(rep, transfers: dict[int, int]) -> dict[int, int]:
    """Request -> KV tokens `rep` holds for it: prefilling (computed so far), decoding (from
    its cohort), landed, and `transfers` (handed off and not yet sent, or reserved for a
    transfer in flight: `in_transfer`)."""
    r = rep.reqs
    held = {i: r.computed[i] for i in rep._prefilling}
    for i, c in rep._decoders.where.items():
        held[i] = c.progress(i)[0]
    for i in rep._landing:
        held[i] = r.computed[i]
    if rep._swap is not None:               # swapped back in: GPU room reserved while the copy lands
        for i in [e[2] for e in rep._swap.inflight] + list(rep._swap.parked):
            held[i] = r.computed[i]
    if rep._offload is not None:            # loading from a tier: its cached prefix and the blocks loading
        for i, (_, first, n, *_) in rep._offload.loading.items():
            held[i] = (first + n) * rep.block_size
        for i, blocks in rep.cache.held.items():    # waiting, holding its loaded prefix
            if r.status[i] == WAITING:
                held[i] = len(blocks) * rep.block_size
    held.update(transfers)
    return held


def in_transfer(cluster, rep) -> dict[int, int]:
    """Request -> KV tokens `rep` holds for a transfer (sim.cluster.Cluster's events): a
    prefill replica's handed-off requests until their KV is sent (a hand-off not routed yet,
    a pull waiting for room, a transfer in flight); a decode replica's reservations for
    transfers in flight."""
    from kvsched.sim.cluster import HANDOFF, LAND
    r, out = cluster.reqs, {}
    if rep.role == "prefill":
        mine = [ev[3] for ev in cluster._events if ev[2] == HANDOFF or ev[2] == LAND]
        mine += [i for d in cluster.back for i in d.pulls]
        out = {i: r.computed[i] for i in mine if r.replica[i] == rep.index}
    elif rep.role == "decode":
        k = rep.index - len(cluster.front)
        out = {ev[3]: r.computed[ev[3]] for ev in cluster._events if ev[2] == LAND and ev[5] == k}
    return out


def _tokens_conserved(rep, transfers: dict[int, int], step: int) -> None:
    r, bs, name = rep.reqs, rep.block_size, "tokens-conserved"
    held = holdings(rep, transfers)
    cache = rep.cache
    if cache is None:
        want = sum(_blocks(t, bs) for t in held.values())
    else:
        want = _cache_blocks(rep, held) if _due(step, sum(len(b) for b in cache.held.values())) else None
    if want is not None and rep._spec is not None:
        want += _spec_slots(rep)
    if want is not None and rep.kv.used != want:
        raise InvariantError(name, f"replica {rep.index} counts {rep.kv.used} KV blocks in use; its "
                             f"requests hold {want} ({len(held)} requests)")
    q = rep._queue
    whole = _due(step, len(q))
    backlog = 0
    for k, i in enumerate(q):
        if not whole and k == EVERY_STEP:
            break
        if r.status[i] != WAITING or r.computed[i] != 0:
            raise InvariantError(name, f"request {i} waits on replica {rep.index} with status {r.status[i]} "
                                 f"and {r.computed[i]} tokens computed")
        backlog += r.target[i]
    for i in rep._prefilling:
        if r.status[i] != PREFILL or not 0 <= r.computed[i] <= r.target[i]:
            raise InvariantError(name, f"request {i} prefills with {r.computed[i]} of {r.target[i]} tokens "
                                 f"computed (status {r.status[i]})")
        if r.target[i] != r.prompt[i] + r.gen[i]:
            raise InvariantError(name, f"request {i}'s prefill target {r.target[i]} is not its prompt "
                                 f"{r.prompt[i]} plus its {r.gen[i]} generated tokens")
        backlog += r.target[i] - r.computed[i]
    if rep._offload is not None:            # loading: all its prefill still to come (its hit is taken at admission)
        for i in rep._offload.loading:
            if r.status[i] != LOADING or r.computed[i] != 0:
                raise InvariantError(name, f"request {i} loads its prefix on replica {rep.index} with status "
                                     f"{r.status[i]} and {r.computed[i]} tokens computed")
            backlog += r.target[i]
    if whole and rep.prefill_backlog != backlog:
        raise InvariantError(name, f"replica {rep.index}'s prefill backlog is {rep.prefill_backlog} tokens; "
                             f"its requests have {backlog} left")
    for i, c in rep._decoders.where.items():
        kv, gen = c.progress(i)
        if r.status[i] != DECODE or not 1 <= gen < r.output[i] or kv != r.prompt[i] + gen - 1:
            raise InvariantError(name, f"request {i} decodes with {gen} of {r.output[i]} tokens generated and "
                                 f"{kv} KV tokens for a prompt of {r.prompt[i]} (status {r.status[i]})")


def _due(step: int, work: int) -> bool:
    """Whether a check over `work` items runs whole at a replica's `step`-th step (EVERY_STEP)."""
    return work <= EVERY_STEP or not step % -(-work // EVERY_STEP)


def _spec_slots(rep) -> int:
    """Blocks speculating decoders hold past their KV tokens (sim/spec_decode.py: the slots of
    rejected drafts and the lookahead), each at most what one step of k drafts reaches."""
    sp, bs = rep._spec, rep.block_size
    total = 0
    for i, c in rep._decoders.where.items():
        kv = c.kv_tokens(i)
        extra = sp.blocks_held(i, kv) - _blocks(kv, bs)
        if not 0 <= extra <= _blocks(kv + 1 + sp.cfg.k + sp.cfg.lookahead, bs) - _blocks(kv, bs):
            raise InvariantError("tokens-conserved", f"request {i} on replica {rep.index} holds {extra} blocks past "
                                 f"its {kv} KV tokens; one step of {sp.cfg.k} drafts reaches at most "
                                 f"{_blocks(kv + 1 + sp.cfg.k + sp.cfg.lookahead, bs) - _blocks(kv, bs)}")
        total += extra
    return total


def _cache_blocks(rep, held: dict[int, int]) -> int:
    """Blocks `rep` should count in use with prefix caching: each request's private blocks (its
    KV less its registered blocks) and every registered block once, whose reference count must
    be the number of requests holding it."""
    cache, bs = rep.cache, rep.block_size
    refs: dict[int, int] = {}
    blocks = {}
    for bl in cache.held.values():
        for b in bl:
            refs[id(b)] = refs.get(id(b), 0) + 1
            blocks[id(b)] = b
    for k, b in blocks.items():
        if b.ref != refs[k]:
            raise InvariantError("tokens-conserved", f"replica {rep.index}: a cached block has {b.ref} "
                                 f"references; {refs[k]} requests hold it")
    return sum(_blocks(t, bs) - len(cache.held.get(i, ())) for i, t in held.items()) + len(blocks)


def _time_order_here(rep) -> None:
    r, now = rep.reqs, rep.now
    for i in rep._running:
        a, s = r.arrival[i], r.admitted[i]
        if i in rep._prefilling and r.gen[i] == 0:
            if not a <= s <= now:
                raise InvariantError("time-order", f"request {i} on replica {rep.index}: arrival {a!r}, "
                                     f"admission {s!r}, clock {now!r}")
            continue
        c = rep._decoders.where.get(i)
        f, last = r.first[i], r.last_tok[i] if c is None else c.last_token(i)
        if not a <= s <= f <= last <= now:
            raise InvariantError("time-order", f"request {i} on replica {rep.index}: arrival {a!r}, admission "
                                 f"{s!r}, first token {f!r}, last token {last!r}, clock {now!r}")


def at_end(reqs) -> None:
    """The whole run's invariants over every request (a sim.requests.RequestTable)."""
    status = np.asarray(reqs.status)
    rejected = np.asarray(reqs.rejected_list, bool)
    open_ = np.flatnonzero(~((status == DONE) | rejected | (status == REJECTED)))
    if len(open_):
        i = int(open_[0])
        raise InvariantError("all-accounted", f"{len(open_)} request(s) neither finished nor rejected; "
                             f"first: request {i} (status {int(status[i])})")
    done = np.flatnonzero(status == DONE)
    arrival = np.asarray(reqs.arrival, np.float64)[done]
    adm, first, fin = reqs.admitted[done], reqs.first[done], reqs.finished[done]
    bad = ~((arrival <= adm) & (adm <= first) & (first <= fin) & (fin < np.inf))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise InvariantError("time-order", f"request {int(done[k])}: arrival {arrival[k]!r}, admission "
                             f"{adm[k]!r}, first token {first[k]!r}, finish {fin[k]!r}")
    gen = np.asarray(reqs.gen)[done]
    out = np.asarray(reqs.output)[done]
    if (gen != out).any():
        k = int(np.flatnonzero(gen != out)[0])
        raise InvariantError("tokens-conserved", f"request {int(done[k])} finished with {int(gen[k])} of "
                             f"{int(out[k])} output tokens")


def check_same(a, b, name: str) -> None:
    """Two runs' records (metrics.RunRecords) agree bit for bit: `name` is "determinism" (the
    same inputs and seed) or "compiled-equals-interpreted"."""
    for field in ("arrival", "admitted", "first_token", "finished", "preemptions", "recomputed", "itl_max",
                  "tbt_violations", "rejected"):
        x, y = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
        if x.shape != y.shape or x.tobytes() != y.tobytes():
            where = np.flatnonzero(~((x == y) | (x != x) & (y != y)))
            k = int(where[0]) if len(where) else -1
            raise InvariantError(name, f"{field} differs between the runs (first at request {k})")
    for field in ("iterations", "kv_time_integral", "kv_peak_tokens", "peak_queue", "busy_time"):
        if getattr(a, field) != getattr(b, field):
            raise InvariantError(name, f"{field}: {getattr(a, field)!r} against {getattr(b, field)!r}")
    if a.itl.counts != b.itl.counts or (a.itl.total, a.itl.n, a.itl.max) != (b.itl.total, b.itl.n, b.itl.max):
        raise InvariantError(name, "the inter-token gap histograms differ")
