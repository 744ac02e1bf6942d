"""A replica's KV blocks (docs/architecture.md, "Replica"): the one owner of allocation and
freeing, in front of the paged pool (kvcache.py) and, with prefix caching, the cache that keeps
freed blocks (sim/prefix_cache.py). Allocation is check-then-act: blocks that do not fit are
the plan's error, raised before anything is taken.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvsched.sim.plan_check import kv_error

if TYPE_CHECKING:
    from kvsched.sim.replica import Replica


def check(rep: Replica, held: int) -> None:
    """The plan's KV error if `held` blocks would not fit (the check before any take)."""
    if held > rep.kv.capacity_blocks:
        raise kv_error(rep.name, held, rep.kv.capacity_blocks, rep.block_size)


def allocate(rep: Replica, n: int) -> None:
    """n new KV blocks from the prefix cache's pool (evicting): checked first, then taken (as
    vLLM's `allocate_slots` returns None when they do not fit); the plan's KV error if not."""
    if not n:
        return
    check(rep, rep.kv.used + n)
    rep.cache.allocate(n)


def free(rep: Replica, i: int, kv_tokens: int, done: bool) -> None:
    """Request i's KV leaves this replica (finished, preempted or handed off)."""
    if rep.cache is None:
        rep.kv.used -= -(-kv_tokens // rep.block_size)
    elif rep._spec is None:
        rep.cache.free(i, kv_tokens, done)
    else:                                   # the last step's accepted drafts fill blocks vLLM never hashed
        rep.cache.free(i, kv_tokens, done, kv_tokens - rep._spec.unhashed.pop(i, 0))


def free_finished(rep: Replica) -> None:
    """With prefix caching, the requests a batch finished free their blocks in vLLM's order
    (its scheduled order: running requests by admission, then the new ones), which decides
    which cached blocks are evicted first."""
    done, order, cache = rep._finishing, rep._order, rep.cache
    # a speculating request's last accepted drafts: vLLM has not hashed their blocks (sim/spec_decode.py)
    unhashed = rep._spec.unhashed if rep._spec is not None else None
    if cache.inert:                         # no keys, no shared blocks: the order cannot matter
        if unhashed:
            cache.free_private(done, unhashed)
        else:
            cache.free_private(done)
    else:
        if len(done) > 1:                   # landed (disaggregated) ones first
            done.sort(key=_ByAdmission(order))
        for i, kv_tokens in done:
            if unhashed:
                cache.free(i, kv_tokens, True, kv_tokens - unhashed.pop(i, 0))
            else:
                cache.free(i, kv_tokens, True)
    for i, _ in done:
        order.pop(i, None)
    done.clear()


def allocate_in_order(rep: Replica, defer: list, decode: dict, chunks: dict) -> None:
    """The running requests' new blocks in vLLM's order, victims freed as they are needed: each
    running request, in admission order (vLLM's `running` list), allocates its decode step's
    (`decode`) or its chunk's (`chunks`) blocks; one that does not fit frees the next victim
    first (vllm/v1/core/sched/scheduler.py `schedule`: a failed `allocate_slots` preempts from
    the tail, then retries). With prefix caching the order decides which cached blocks are
    evicted: a victim freed before the others allocate would give them its uncached blocks."""
    cap = rep.kv.capacity_blocks
    for i in rep._running:
        n = decode.get(i, 0) + chunks.get(i, 0)
        while defer and rep.kv.used + n > cap:
            release(rep, defer.pop(0))
        allocate(rep, n)


def release(rep: Replica, victim: tuple[int, int, int]) -> None:
    """A deferred victim's KV freed (lifecycle.py, `preempt`): (request, KV tokens, blocks held past them)."""
    i, kv_tokens, extra = victim
    rep.kv.used -= extra
    free(rep, i, kv_tokens, False)


def decode_blocks(rep: Replica) -> int:
    """Blocks one decode step of every decoder needs (with speculation: their drafts' and
    lookahead slots, sim/spec_decode.py)."""
    return rep._decoders.new_blocks if rep._spec is None else rep._spec.new_blocks(rep)


def take(rep: Replica, n: int) -> None:
    """n blocks already judged to fit (a transfer's reservation, a decode run's steps)."""
    if rep.cache is None:
        rep.kv.used += n
    elif n:
        rep.cache.allocate(n)


class _ByAdmission:
    """A sort key: a finished request's admission rank (0: landed here, not admitted)."""
    __slots__ = ("order",)

    def __init__(self, order: dict[int, int]) -> None:
        self.order = order

    def __call__(self, item: tuple[int, int]) -> int:
        return self.order.get(item[0], 0)
