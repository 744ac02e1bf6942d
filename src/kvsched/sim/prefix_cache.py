"""Automatic prefix caching on one replica's KV pool, as vLLM v1 keeps it (vllm/v1/core/
block_pool.py, kv_cache_manager.py; docs/prefix-caching.md).

Only full blocks are cached. A block's key chains its parent's key and the content of its
tokens, so two requests share a block exactly when their token sequences agree up to its
end. Content comes from the workload's segments (`Workload.segments`: Mooncake hash_ids,
system prompts, a session's previous turns); a request's other tokens (the rest of its
prompt, then its output) are its own. Cached blocks are reference-counted. A block whose
count drops to 0 stays cached at the tail of the free queue, in the order vLLM frees them
(a request's blocks in reverse, so its tail is evicted first); uncached free blocks sit at
the front (vLLM prepends them), so a new allocation takes those first and then evicts the
oldest cached block. A hit on a free cached block takes it out of the free queue. The pool's
counter (`PagedKV.used`) counts blocks with a reference: free = capacity - used counts
evictable cached blocks as free, as vLLM does.

Keys of a running request's blocks are registered when its prefill chunks compute them (so
a later chunk of the same batch, or a later request, hits them); blocks its decode steps
fill are registered when it frees them (no other request can hit a request's own tokens
while it runs), which keeps a decode step O(1).

Within a step the running requests' chunks and the decode step allocate first, then each
admission takes its hit and new blocks in plan order, and the requests the step finishes
free their blocks in vLLM's scheduled order. Departures from vLLM: docs/prefix-caching.md.
"""
from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict

import numpy as np


@contextlib.contextmanager
def fewer_collections(threshold: int = 200_000):
    """Run with the youngest GC generation collected every `threshold` allocations instead of
    700: a cached run allocates one `Block` per KV block and makes no cycles, and CPython's
    default collections cost it 40% of its time (mooncake-synthetic: 10.0 s -> 6.2 s)."""
    old = gc.get_threshold()
    gc.set_threshold(max(threshold, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


SHORTCUTS = True    # an inert cache's shortcuts (`PrefixCache.inert`); False: the general path only


class Block:
    """A cached block: its key and reference count (0: free, in the free queue)."""
    __slots__ = ("key", "ref")

    def __init__(self, key: int, ref: int) -> None:
        self.key, self.ref = key, ref


class Run:
    """Free cached blocks no request can ever hit (a finished request's own tokens), queued as
    one count: they take their place in the eviction order without a key each."""
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class PrefixCache:
    """The cache over `kv` (a PagedKV whose `used` it keeps) for requests of `reqs`.

    Only the leading blocks another request could hit (`_share`: those inside the request's
    segments, all of them when a later session turn starts with them) are keyed while the
    request runs; its own blocks are keyed when it is preempted (it may hit them again) and
    queued as a `Run` when it finishes, so a workload without shared content pays no hashing."""

    def __init__(self, kv, reqs) -> None:
        self.kv, self.reqs = kv, reqs
        self.bs = kv.block_size
        self.map: dict[int, Block] = {}              # key -> its cached block (the one a hit takes)
        self.dups: dict[int, list[Block]] = {}       # key -> later copies (vLLM keeps duplicates)
        self.free_q: OrderedDict[Block | Run, None] = OrderedDict()   # cached free blocks, eviction order
        self.queued = 0                              # blocks in free_q (runs counted whole)
        self.held: dict[int, list[Block]] = {}       # request -> its registered blocks 0..m-1
        self._keys: dict[int, list[int]] = {}
        self._sources = _sources(reqs.workload)
        self._share = _shareable(reqs.workload, self.bs)
        self._shared = any(self._share)              # some request has blocks another could hit
        # statistics (docs/prefix-caching.md, "Metrics")
        self.query_tokens = 0       # prompt tokens (prefill targets) looked up at admission
        self.hit_tokens = 0         # of them, taken from the cache (not computed)
        self.query_blocks = 0       # full blocks looked up (up to the hit cap)
        self.hit_blocks = 0
        self.evictions = 0
        self.spill = None           # the tiers below (sim/kv_tiers.py, Offload): evicted or computed blocks go down

    def clear(self) -> None:
        """Forget every cached block (the replica is off; a cold start begins empty). Only when
        no request holds blocks here."""
        assert not self.held, "a replica with requests is never off"
        self.map.clear()
        self.dups.clear()
        self.free_q.clear()
        self.queued = 0
        self._keys.clear()

    # ----- keys ------------------------------------------------------------------------
    def keys(self, i: int, n: int, keep: bool = True) -> list[int]:
        """Keys of request i's first n (or more) blocks; memoised while the request lives here
        unless `keep` is False (a router asking about a request not routed yet)."""
        ks = self._keys.get(i)
        if ks is None:
            ks = []
            if keep:
                self._keys[i] = ks
        if len(ks) < n:
            _extend_keys(ks, n, self.bs, self._sources(i))
        return ks

    # ----- lookups -----------------------------------------------------------------------
    def cap_blocks(self, i: int) -> int:
        """Blocks a hit may cover: the prefill target less one token (vLLM computes the last
        prompt token for its logits), whole blocks only."""
        return (self.reqs.target[i] - 1) // self.bs

    def lookup_cap(self, i: int, target: int | None = None, preempted: bool = False) -> int:
        """Blocks a lookup for request i walks: the hit cap, or only the blocks others could
        have cached while it has never been preempted (its own blocks are cached only then)."""
        cap = ((self.reqs.target[i] if target is None else target) - 1) // self.bs
        return cap if preempted or self.reqs.preempts[i] else min(cap, self._share[i])

    def walk(self, i: int, pending: set[int] | None = None, keep: bool = True):
        """Request i's longest cached prefix: yields its first cached block per key (None for
        a key only in `pending`, registered by an earlier chunk of the batch being planned).
        Keys are made as the walk goes, so a miss at the first block costs one key."""
        m, cap = self.map, self.lookup_cap(i)
        ks: list[int] = []
        for j in range(cap):
            if j >= len(ks):
                ks = self.keys(i, min(cap, 2 * j + 8), keep)
            k = ks[j]
            b = m.get(k)
            if b is not None:
                yield b
            elif pending is not None and k in pending:
                yield None
            else:
                return

    # ----- the replica's operations ----------------------------------------------------
    @property
    def inert(self) -> bool:
        """No block is keyed and none will be until a preemption: every lookup misses, and
        the free queue holds keyless blocks only (their order cannot matter). With
        `SHORTCUTS` False never: every batch takes the general path (tests compare the two)."""
        return SHORTCUTS and not self.map and not self._shared

    def miss(self, i: int) -> None:
        """`hit` of request i while the cache is inert: the lookup counted, nothing taken."""
        target = self.reqs.target[i]
        self.query_tokens += target
        self.query_blocks += (target - 1) // self.bs     # cap_blocks(i)

    def hit(self, i: int, chunk: int) -> int:
        """Request i's first chunk after admission: take its cached prefix, as far as the
        chunk leaves room before the prefill target (a policy that plans the chunk without the
        cache computes it from 0), and return the hit tokens. Free cached blocks it takes
        leave the free queue and count as used."""
        bs, target = self.bs, self.reqs.target[i]
        loaded = self.held.pop(i, None)             # its prefix loaded from a tier (`adopt`), held till now
        looked = self.cap_blocks(i)
        taken = self._hit_blocks(i, chunk)
        self.pin(i, taken)
        if loaded is not None:
            self.kv.used -= self._unref(loaded)
            self.spill.used(i, len(taken))
        h = len(taken) * bs
        self.query_tokens += target
        self.hit_tokens += h
        self.query_blocks += looked
        self.hit_blocks += len(taken)
        return h

    def _hit_blocks(self, i: int, chunk: int) -> list[Block]:
        """The cached prefix `hit(i, chunk)` takes: as far as the chunk leaves room."""
        room = (self.reqs.target[i] - chunk) // self.bs
        taken: list[Block] = []
        if room > 0:
            for b in self.walk(i):
                taken.append(b)
                if len(taken) >= room:
                    break
        return taken

    def would_hit(self, i: int, chunk: int) -> int:
        """The blocks `hit(i, chunk)` would take now, taking nothing."""
        return len(self._hit_blocks(i, chunk))

    def pin(self, i: int, blocks: list[Block]) -> None:
        """Request i takes `blocks` (its cached prefix, from `walk`) before its prefix is loaded
        from the tiers below (lifecycle.py, `load_tick`): held, so not evicted meanwhile."""
        for b in blocks:
            if b.ref == 0:
                del self.free_q[b]
                self.queued -= 1
                self.kv.used += 1
            b.ref += 1
        self.held[i] = blocks

    def adopt(self, i: int, first: int, n: int) -> None:
        """Blocks first .. first + n - 1 of request i (allocated to it, private) now hold its
        prefix loaded from a tier (lifecycle.py, `load_land`): cached under their keys and held
        by the request until its admission's hit takes them (vLLM caches loaded blocks when the
        load finishes and the request keeps them: scheduler.py, `_update_waiting_for_remote_kv`)."""
        blocks = [Block(k, 1) for k in self.keys(i, first + n)[first:first + n]]
        self.held.setdefault(i, []).extend(blocks)
        self._insert(blocks)
        off = self.spill
        if off.through:                     # the loaded blocks count as offered (vLLM: chunk-level, the hit skipped)
            lo, end = off.offered.get(i, (first, 0))
            off.offered[i] = (lo, max(end, first + n))

    def unpin(self, i: int) -> None:
        """Waiting request i lets go of the prefix it holds (`adopt`): its blocks stay cached."""
        self.kv.used -= self._unref(self.held.pop(i))
        self.spill.used(i, 0)

    def _unref(self, blocks: list[Block]) -> int:
        """Drop one reference to each of a request's blocks; those left unreferenced join the free
        queue's tail, the request's last block first. Returns how many."""
        q, n = self.free_q, 0
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                q[b] = None
                n += 1
        self.queued += n
        return n

    def register(self, i: int, start: int, chunk: int) -> None:
        """The blocks request i's chunk [start, start + chunk) fills are cached (by reference)."""
        held = self.held.setdefault(i, [])
        bs = self.bs
        lo, hi = len(held), min((start + chunk) // bs, self._share[i])
        if hi > lo:
            blocks = [Block(k, 1) for k in self.keys(i, hi)[lo:hi]]
            held.extend(blocks)
            self._insert(blocks)
        if self.spill is not None and self.spill.through:
            self._write_prompt(i, min((start + chunk) // bs, self.reqs.prompt[i] // bs))

    def _write_prompt(self, i: int, end: int) -> None:
        """Write-through tiers (`--kv-write through`): request i's full prompt blocks up to `end`
        (computed by now) that it has not offered yet go down, from block 0 (a GPU hit's blocks
        too: a tier lacking them gets them) and the request's own blocks too (keyed for the
        tiers only), as vLLM's offloading connector offers every full prompt block from
        `next_stored_chunk_idx` on (offloading/scheduler.py, `_build_store_jobs`;
        `offload_prompt_only`); a tier holding one leaves it."""
        off = self.spill
        lo, first = off.offered.get(i, (0, 0))
        if end > first:
            off.defer(self.keys(i, end)[first:end])
            off.offered[i] = (lo, end)

    def _insert(self, blocks: list[Block]) -> None:
        """Cache blocks under their keys; a key already cached keeps its block first."""
        m = self.map
        keys = [b.key for b in blocks]
        if m.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            m.update(zip(keys, blocks))
            return
        for b in blocks:
            if b.key in m:
                self.dups.setdefault(b.key, []).append(b)
            else:
                m[b.key] = b

    def candidates(self, k: int) -> list[Block]:
        """The cached blocks of key k, first the one a hit takes."""
        b = self.map.get(k)
        return [] if b is None else [b, *self.dups.get(k, ())]

    def allocate(self, n: int, protect: set | None = None) -> None:
        """n new blocks: uncached free blocks first, then the oldest cached ones are evicted
        (but none of `protect`, left where they are in the queue)."""
        kv = self.kv
        evict = n - (kv.capacity_blocks - kv.used - self.queued)
        if evict > 0:
            q, m, dups = self.free_q, self.map, self.dups
            b = next(iter(q))
            if type(b) is Run and b.n > evict:  # the common case: the oldest run covers it
                b.n -= evict
                self.evictions += evict
                self.queued -= evict
                kv.used += n
                return
            left = evict
            spill = self.spill if self.spill is not None and not self.spill.through else None
            gone: list[int] = []                        # keyed blocks evicted: written down (--kv-write evict)
            order = iter(list(q)) if protect else None
            while left:
                if order is None:
                    b = next(iter(q))
                else:                                   # the oldest not protected
                    b = next(order)
                    while type(b) is not Run and b in protect:
                        b = next(order)
                if type(b) is Run:
                    k = min(b.n, left)
                    b.n -= k
                    left -= k
                    if not b.n:
                        del q[b]
                    continue
                del q[b]
                left -= 1
                k = b.key
                if spill is not None:
                    gone.append(k)
                if k in dups:
                    rest = dups[k]
                    if m[k] is b:
                        m[k] = rest.pop(0)
                    else:
                        rest.remove(b)
                    if not rest:
                        del dups[k]
                else:
                    del m[k]
            self.evictions += evict
            self.queued -= evict
            if gone:
                spill.write(gone)
        kv.used += n

    def free(self, i: int, kv_tokens: int, done: bool, hashed: int | None = None) -> None:
        """Request i frees its KV (finished, preempted or handed off): its full blocks stay
        cached, queued tail first; blocks its decode steps filled are registered now. `hashed`
        (default kv_tokens): the tokens whose full blocks vLLM has hashed (a speculating decoder's
        last accepted drafts are not: sim/spec_decode.py); the blocks past them are freed uncached."""
        bs = self.bs
        held = self.held.pop(i, [])
        full, total = (kv_tokens if hashed is None else hashed) // bs, -(-kv_tokens // bs)
        released = total - len(held)                # private blocks, the partial tail included
        q = self.free_q
        own = full - len(held)
        if own > 0:
            if done and len(held) >= self._share[i]:        # nobody can hit these: no keys
                self._queue_run(own)
            else:
                blocks = [Block(k, 0) for k in reversed(self.keys(i, full)[len(held):full])]
                self._insert(blocks)
                q.update(dict.fromkeys(blocks))
            self.queued += own
        released += self._unref(held)
        self.kv.used -= released
        if done:
            if self.spill is not None and self.spill.through:
                lo, end = self.spill.offered.pop(i, (0, 0))
                if end > lo:
                    self.spill.finished(self.keys(i, end)[lo:end])
            self._keys.pop(i, None)

    def free_private(self, done: list[tuple[int, int]], unhashed: dict | None = None) -> None:
        """`free(i, kv_tokens, True)` for each (i, kv_tokens) of `done`, while the cache is
        inert: no request holds a cached block, so each frees all its blocks and queues its
        full ones as one run (runs side by side are one run: the same eviction order).
        `unhashed`: tokens at a speculating request's end that vLLM has not hashed (`free`)."""
        bs, keys, held = self.bs, self._keys, self.held
        full = released = 0
        for i, kv_tokens in done:
            full += (kv_tokens - unhashed.pop(i, 0) if unhashed else kv_tokens) // bs
            released += -(-kv_tokens // bs)
            held.pop(i, None)
            keys.pop(i, None)
        if full:
            self._queue_run(full)
            self.queued += full
        self.kv.used -= released

    def _queue_run(self, n: int) -> None:
        """n keyless free blocks at the tail of the free queue; runs side by side are one run
        (the same eviction order), so evicting from them stays O(1)."""
        q = self.free_q
        last = next(reversed(q), None) if q else None
        if type(last) is Run:
            last.n += n
        else:
            q[Run(n)] = None

    # ----- what policies and routers read ------------------------------------------------
    def cached_tokens(self, i: int, keep: bool = True) -> int:
        """Prompt tokens of request i cached here now (its hit if admitted now)."""
        n = 0
        for _ in self.walk(i, keep=keep):
            n += 1
        return n * self.bs

    def count_cached(self, keys: list[int]) -> int:
        """Tokens of the leading `keys` cached here (a router comparing replicas)."""
        m, n = self.map, 0
        for k in keys:
            if k not in m:
                break
            n += 1
        return n * self.bs

    def exclusive_blocks(self, i: int, kv_tokens: int, shared: dict[Block, int] | None = None) -> int:
        """Blocks freeing request i would return to the free pool: its private blocks and the
        cached ones no other request holds (`shared`: references already dropped in a plan)."""
        held = self.held.get(i, ())
        n = -(-kv_tokens // self.bs) - len(held)
        for b in held:
            if b.ref - (shared.get(b, 0) if shared else 0) == 1:
                n += 1
        return n


def _shareable(workload, bs: int) -> list[int]:
    """Per request, the leading blocks another request could hit: those inside its segments,
    or all of them when a later session turn begins with its tokens."""
    seg = getattr(workload, "segments", None)
    share = np.zeros(len(workload), np.int64) if seg is None else seg.tokens() // bs
    if getattr(workload, "has_sessions", False):
        prev = workload.previous_turn()
        share[prev[prev >= 0]] = 1 << 62
    return share.tolist()


def _sources(workload):
    """request row -> its content: ((kind, id, tokens), ...) segments, then its own source.
    Kind 0 is shared content (id >= 0), kind 1 a request's own tokens, named by its row (caller
    ids may repeat; a segment naming an earlier turn by caller id is mapped to that turn's row,
    unique when the workload has sessions). The kind tag keeps ids apart in the hash
    (hash(-1) == hash(-2) in CPython)."""
    seg = getattr(workload, "segments", None)
    if seg is None:
        return lambda i: ((), (1, i))
    sid, slen = seg.ids, seg.lengths
    row: dict[int, int] = {}
    if (seg.ids.values < 0).any():
        row = {int(c): k for k, c in enumerate(workload.ids.tolist())}

    def sources(i: int):
        return (tuple((0, s, n) if s >= 0 else (1, row[-1 - s], n) for s, n in zip(sid[i].tolist(), slen[i].tolist())),
                (1, i))
    return sources


def _extend_keys(ks: list[int], n: int, bs: int, source) -> None:
    """Append keys of blocks len(ks)..n-1: hash(parent key, the block's pieces), each piece
    (kind, content id, offset in that content, tokens)."""
    segments, own = source
    bounds = []                         # (start, end, (kind, id)) of each source, own last
    start = 0
    for kind, sid, length in segments:
        bounds.append((start, start + length, (kind, sid)))
        start += length
    bounds.append((start, 1 << 62, own))
    pos = len(ks) * bs
    parent = ks[-1] if ks else 0
    k = 0
    while len(ks) < n:
        while bounds[k][1] <= pos:
            k += 1
        lo, hi, (kind, sid) = bounds[k]
        whole = min((hi - pos) // bs, n - len(ks))
        if whole > 0:                   # blocks inside one source: the common case, one hash each
            for off in range(pos - lo, pos - lo + whole * bs, bs):
                parent = hash((parent, ((kind, sid, off, bs),)))
                ks.append(parent)
            pos += whole * bs
            continue
        end, p, pieces = pos + bs, pos, []
        while p < end:                  # a block across sources
            while bounds[k][1] <= p:
                k += 1
            lo, hi, (kind, sid) = bounds[k]
            take = min(hi, end) - p
            pieces.append((kind, sid, p - lo, take))
            p += take
        parent = hash((parent, tuple(pieces)))
        ks.append(parent)
        pos = end
