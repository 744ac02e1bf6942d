"""What a plan being built will find in a replica's prefix cache (sim/prefix_cache.py,
docs/prefix-caching.md): `HitPlanner` answers a policy's lookups, chunks and preemptions exactly
as the replica will apply them; `LazyPlanner` answers a plan that starts on an inert cache
without one, until it needs one.
"""
from __future__ import annotations

from kvsched.sim.kv_blocks import decode_blocks
from kvsched.sim.prefix_cache import Block, PrefixCache, Run


class LazyPlanner:
    """`HitPlanner` for a plan that starts on an inert cache (`PrefixCache.inert`): until the
    plan preempts, every lookup misses (nothing is keyed and its chunks key nothing) and a
    chunk only moves its request's start, so those are answered here, at a fraction of a
    planner's cost (most plans). Its calls are kept: the first other call (a preemption)
    replays them into a `HitPlanner`, which answers that call and every later one, so the
    answers are the planner's own."""
    __slots__ = ("_c", "_r", "_calls", "_start", "_real")

    def __init__(self, cache: PrefixCache, replica) -> None:
        self._c, self._r = cache, replica
        self._calls: list[tuple] = []
        self._start: dict[int, int] = {}
        self._real: HitPlanner | None = None

    def lookup(self, i: int, chunk: int | None = None) -> tuple[int, int]:
        if self._real is not None:
            return self._real.lookup(i, chunk)
        self._calls.append(("lookup", i, chunk))
        return 0, 0

    def chunk(self, i: int, tokens: int, slots: int = 0) -> int:
        if self._real is not None:
            return self._real.chunk(i, tokens, slots)
        self._calls.append(("chunk", i, tokens, slots))
        start = self._start.get(i)
        if start is None:                       # a waiting request's hit is empty
            start = 0 if self._r.awaits_hit(i) else self._r._computed[i]
        self._start[i] = start + tokens
        return start

    def decodes(self, blocks: int) -> None:
        if self._real is not None:
            return self._real.decodes(blocks)
        self._calls.append(("decodes", blocks))

    def preempt(self, i: int) -> int:
        return self._planner().preempt(i)

    def __getattr__(self, name: str):
        """Anything else a policy reads: the real planner's."""
        return getattr(self._planner(), name)

    def _planner(self) -> HitPlanner:
        """The real planner, after the calls so far."""
        if self._real is None:
            self._real = HitPlanner(self._c, self._r)
            for method, *args in self._calls:
                getattr(self._real, method)(*args)
        return self._real


class HitPlanner:
    """What a plan being built will find in the cache (`view.prefix_planner()`), exactly as
    the replica will apply it: call `preempt(i)` for each request the plan preempts (it
    returns the blocks that frees), then, in the plan's chunk order, `lookup(i)` for a waiting
    request (its hit and the free blocks it takes) and `chunk(i, c)` for every chunk placed
    (it returns where the chunk starts). `decodes(blocks)` declares the decode step's new
    blocks when not every remaining decoder decodes. The replica allocates the running
    requests' chunks and the decode step before the first admission's hit, then each
    admission's hit and blocks in turn, so an admission sees the blocks earlier chunks of the
    batch cache and the ones earlier allocations evict, as vLLM's scheduler does."""

    def __init__(self, cache: PrefixCache, replica) -> None:
        self._c, self._r = cache, replica
        kv = cache.kv
        self._pending: set[int] = set()             # keys the plan's chunks cache (held, not evictable)
        self._dropped: dict[Block, int] = {}        # references planned preemptions drop
        self._taken: dict[Block, int] = {}          # references planned hits add
        self._start: dict[int, int] = {}
        self.hits: dict[int, int] = {}              # waiting request -> the hit its first chunk was planned on
        self._preempted: set[int] = set()           # re-admitted in the same plan: they take a hit
        self._target: dict[int, int] = {}           # their prefill targets after the preemption
        self._anon = kv.capacity_blocks - kv.used - cache.queued    # uncached free blocks
        self._appended: list[Block] = []            # blocks preemptions queue, in order
        self._extra: dict[int, Block] = {}          # keys preemptions cache (decode-filled blocks)
        self._decode: int | None = None
        self._decoders_gone = 0                     # blocks the preempted decoders would have needed
        self._alloc = 0                             # blocks allocated so far (running chunks, decodes, admissions)
        self._settled = False                       # the decode step is allocated (first admission reached)
        self._evicted: set[Block] = set()
        self._n_evicted = 0                         # blocks evicted, runs' included
        self._queue = None                          # the virtual free queue, made when first evicting

    # ----- the plan's operations --------------------------------------------------------
    def preempt(self, i: int) -> int:
        """Plan to preempt running request i; returns the blocks that frees."""
        c, r = self._c, self._r.view               # the policy's reads of request i
        kv_tokens = r.kv_tokens(i)
        n = c.exclusive_blocks(i, kv_tokens, self._dropped)
        held = c.held.get(i, ())
        sp = self._r._spec
        full = (kv_tokens - sp.unhashed.get(i, 0) if sp is not None else kv_tokens) // c.bs
        self._anon += (kv_tokens % c.bs != 0) + (kv_tokens // c.bs - full)     # freed uncached
        extra = r.kv_blocks(i) - -(-kv_tokens // c.bs)     # a speculating decoder's blocks past its KV
        if extra:
            self._anon += extra
            n += extra
        if full > len(held):
            for k in reversed(c.keys(i, full)[len(held):full]):
                b = Block(k, 0)
                self._extra.setdefault(k, b)
                self._appended.append(b)
        for b in reversed(held):
            d = self._dropped.get(b, 0) + 1
            self._dropped[b] = d
            if b.ref == d:
                self._appended.append(b)
        if r.is_decoding(i):
            self._decoders_gone += r.needs_block(i)
        self._preempted.add(i)
        if r.is_decoding(i):                        # it will recompute its generated tokens too
            self._target[i] = r.prompt_len(i) + r.generated(i)
        return n

    def decodes(self, blocks: int) -> None:
        """The decode step of the plan needs `blocks` new blocks (default: one step of every
        decoder not preempted)."""
        self._decode = blocks

    def lookup(self, i: int, chunk: int | None = None) -> tuple[int, int]:
        """(hit tokens, blocks of the hit that are free now) for waiting request i; with
        `chunk`, the hit as far as that chunk leaves room (as `PrefixCache.hit`)."""
        hit = self._hit(i, chunk)
        return len(hit) * self._c.bs, sum(1 for b in hit if b is not None and self._free(b))

    def chunk(self, i: int, tokens: int, slots: int = 0) -> int:
        """A chunk of `tokens` for request i is placed in the plan (a waiting request's hit is
        taken then, as far as the chunk leaves room); returns the token the chunk starts at.
        `slots`: KV slots it takes past its tokens (a padded admission's placeholder drafts,
        Plan.spec)."""
        c, r = self._c, self._r
        bs = c.bs
        start = self._start.get(i)
        if start is None and (r.awaits_hit(i) or i in self._preempted):
            hit = self._hit(i, tokens)
            for b in hit:
                if b is not None:
                    self._taken[b] = self._taken.get(b, 0) + 1
            start = len(hit) * bs
            self.hits[i] = start
        elif start is None:
            start = r._computed[i]
        self._start[i] = start + tokens
        lo, hi = start // bs, min((start + tokens) // bs, c._share[i])   # as `PrefixCache.register`
        if hi > lo:
            self._pending.update(c.keys(i, hi)[lo:hi])
        self._alloc += -(-(start + tokens + slots) // bs) - -(-start // bs)
        return start

    # ----- the cache as the plan leaves it ------------------------------------------------
    def _hit(self, i: int, chunk: int | None) -> list[Block | None]:
        """The blocks request i would hit now (None: a block an earlier chunk caches)."""
        self._settle()
        c = self._c
        if not c.map and not self._pending and not self._extra:
            return []                           # nothing cached, nothing the plan caches
        target = self._target.get(i, c.reqs.target[i])
        cap = c.lookup_cap(i, target, i in self._preempted)
        room = cap if chunk is None else min(cap, (target - chunk) // c.bs)
        pending, extra = self._pending, self._extra
        self._evict()
        evicted = self._evicted
        hit: list[Block | None] = []
        j = 0
        ks: list[int] = []
        while j < room:
            if j >= len(ks):
                ks = c.keys(i, min(room, 2 * j + 8))
            k = ks[j]
            found: Block | None | bool = False
            for b in c.candidates(k):
                if b not in evicted:
                    found = b
                    break
            if found is False:
                if k in pending:
                    found = None
                elif k in extra and extra[k] not in evicted:
                    found = extra[k]
                else:
                    break
            hit.append(found)
            j += 1
        return hit

    def _free(self, b: Block) -> bool:
        return b.ref - self._dropped.get(b, 0) + self._taken.get(b, 0) == 0

    def _settle(self) -> None:
        """At the first admission: the decode step is allocated (before any admission's hit)."""
        if not self._settled:
            self._settled = True
            r = self._r
            self._alloc += self._decode if self._decode is not None else decode_blocks(r) - self._decoders_gone

    def _evict(self) -> None:
        """Evict, in queue order, the cached blocks the allocations so far took."""
        want = self._alloc - self._anon
        if self._n_evicted < want and self._queue is None:
            self._queue = self._virtual_queue()
        while self._n_evicted < want:
            b = next(self._queue, False)
            if b is False:
                return
            self._n_evicted += 1
            if b is not None:
                self._evicted.add(b)

    def _virtual_queue(self):
        """The free queue as the plan leaves it: cached free blocks not taken by a planned hit,
        then the blocks planned preemptions queue."""
        for b in self._c.free_q:
            if type(b) is Run:
                for _ in range(b.n):
                    yield None
            elif b not in self._taken:
                yield b
        for b in self._appended:
            if b not in self._taken:
                yield b
