"""The prefix cache's lower tiers: host memory, local disk and a remote store shared by the
replicas (issue "The KV memory hierarchy", items 1, 2 and 5; docs/kv-tiers.md).

A tier keeps whole KV blocks under their prefix-cache keys (sim/prefix_cache.py), in LRU
order, up to its capacity. Blocks go down when the GPU's prefix cache evicts them
(`--kv-write evict`, the default) or as soon as a prefill computes them (`--kv-write through`),
into every tier that lacks them: the tiers are inclusive, as LMCache stores a chunk to each of
its backends (lmcache/v1/cache_engine.py, `store`). A waiting request whose prefix continues
below the GPU loads it back before it prefills (lifecycle.py, `load_tick`), as vLLM's
scheduler does for a connector's asynchronous hit (vllm/v1/core/sched/scheduler.py,
`WAITING_FOR_REMOTE_KVS`): its GPU blocks are allocated, the request waits while the blocks
cross the link, and other requests run meanwhile.

Links: each replica has its own two links to each tier (read: tier to GPU; write: GPU to
tier), FIFO (sim/transfer.py, `KVLink`): a transfer starts when the link is free and its data
is ready, holds it for bytes / bandwidth and lands `latency` later. So two loads on one link
take, together, the sum of their bytes over the bandwidth, the second landing after the
first (a processor-sharing link would land both at that sum; FIFO lands the first earlier and
the second at the same time). A block becomes readable in a tier when its write lands there.

The remote tier is one store for all replicas (one replica's blocks serve another's hits);
its capacity is the store's, each replica's link to it has the bandwidth given. Host and disk
tiers are each replica's own, of the size given (for a TP replica: the host memory its GPUs
share, and the sum of their links); with --gpus-per-node N they are the node's: the replicas
on one node (N / GPUs per replica of them, in order) share one host store and one disk store
of the size given, so one's blocks serve another's hits there, each over its own links (its
GPUs' PCIe and NVMe paths). A node-level cache server such as LMCache's local server
(`lm://localhost`, a remote backend on the same machine) shares host memory so; vLLM's
OffloadingConnector and SGLang's HiCache keep one per engine instance (the default here).
"""
from __future__ import annotations

from collections import OrderedDict

from kvsched.errors import KvschedError
from kvsched.sim.host_swap import TierSpec, parse_kv_tier
from kvsched.sim.transfer import KVLink

WRITE_MODES = ("evict", "through")
ORDER = {"host": 0, "disk": 1, "remote": 2}     # a block is read from the fastest tier holding it


class TierStore:
    """One tier's blocks: key -> when its write lands there, least recently used first."""

    def __init__(self, spec: TierSpec, block_bytes: int) -> None:
        self.spec, self.kind = spec, spec.kind
        self.block_bytes = block_bytes
        self.capacity_blocks = int(spec.gb * 1e9 // block_bytes)
        self.keys: OrderedDict[int, float] = OrderedDict()
        self.bytes_in = self.bytes_out = 0      # written into the tier, read back from it
        self.loaded_tokens = 0                  # prompt tokens loaded from here that admissions took (its hits)
        self.evictions = 0

    def put(self, key: int, ready: float) -> None:
        """Block `key`, readable from `ready` on, least recently used ones dropped to make room."""
        keys = self.keys
        keys[key] = ready
        self.bytes_in += self.block_bytes
        while len(keys) > self.capacity_blocks:
            keys.popitem(last=False)
            self.evictions += 1


class Clock:
    """A stand-in for the replica whose clock an `Offload` reads (tests drive it by hand)."""
    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now


class SharedLink:
    """A path of its own bandwidth and latency whose transfers queue on another link's FIFO
    (`base`): a disaggregated prefill replica's remote-tier traffic on the node's network link,
    behind and ahead of its KV transfers to decode replicas, one transfer at a time."""
    __slots__ = ("base", "bytes_per_s", "latency", "busy")

    def __init__(self, base: KVLink, gbps: float, latency_s: float) -> None:
        self.base, self.bytes_per_s, self.latency, self.busy = base, gbps * 1e9, latency_s, 0.0

    def send(self, t: float, nbytes: float) -> float:
        base = self.base
        start = t if t > base.free_at else base.free_at
        hold = nbytes / self.bytes_per_s
        base.free_at = start + hold
        base.busy += hold
        self.busy += hold
        return base.free_at + self.latency


class Port:
    """A replica's two links to one tier (with `network`, a remote tier's both directions
    queue on that link: `SharedLink`)."""
    __slots__ = ("store", "read", "write", "loads", "load_s")

    def __init__(self, store: TierStore, network: KVLink | None = None) -> None:
        spec = store.spec
        self.store = store
        if network is not None and store.kind == "remote":
            self.read = self.write = SharedLink(network, spec.gbps, spec.latency_s)
        else:
            self.read, self.write = KVLink(spec.gbps, spec.latency_s), KVLink(spec.gbps, spec.latency_s)
        self.loads = 0                          # loads that read from this tier
        self.load_s = 0.0                       # their load times, summed

    def busy_fraction(self, duration: float) -> float:
        """Share of the run [0, duration] its link(s) carried this tier's transfers (both
        directions: two links, or one shared). A FIFO link's backlog past the run's end is one
        busy stretch, so that part is left out exactly; on a `SharedLink` the stretch may hold
        other traffic too, so the part left out is at most the tier's."""
        def within(link) -> float:
            base = link.base if isinstance(link, SharedLink) else link
            return link.busy - min(link.busy, max(0.0, base.free_at - duration))
        if self.read is self.write:
            return within(self.read) / duration
        return (within(self.read) + within(self.write)) / (2 * duration)


class Offload:
    """One replica's tiers below the GPU (module docstring): the writes down, the lookups of a
    waiting request's prefix below the GPU, and the loads in flight."""

    def __init__(self, stores: list[TierStore], block_size: int, write_through: bool,
                 network: KVLink | None = None, reads: bool = True) -> None:
        self.ports = sorted((Port(s, network) for s in stores), key=lambda p: ORDER[p.store.kind])
        self.block_bytes = stores[0].block_bytes
        self.bs = block_size
        self.through = write_through
        # False under a policy that plans prompts from token 0 (no `plans_prefix_hits`): written, never read
        self.reads = reads
        self.clock = Clock()                    # its replica (`now`: the time of every write and load)
        # request -> (lands, GPU hit, blocks loaded, start, before its first admission, keys loading)
        self.loading: dict[int, tuple[float, int, int, float, bool, list[int]]] = {}
        self.inflight: dict[int, float] = {}    # key -> when the load bringing it here lands
        self.landed_src: dict[int, tuple[int, list[int]]] = {}   # request -> (GPU hit, tiers) of its landed load
        self.load_s: dict[int, float] = {}      # request -> seconds loading before its first admission
        self.deferred: list[int] = []           # write-through: keys computed this batch, written next step
        self.broke = False                      # a batch's admission found its load does not fit (batch.py)
        # write-through: request -> (first, end) of the prompt blocks it offered or loaded (vLLM's
        # next_stored_chunk_idx, and the keys its finish refreshes)
        self.offered: dict[int, tuple[int, int]] = {}
        self.loads = 0
        self.load_time = 0.0                    # seconds from each load's start to its landing, summed

    def busy(self) -> bool:
        return bool(self.loading)

    def tick(self, rep) -> bool:
        from kvsched.sim.lifecycle import load_tick
        return load_tick(rep)

    def wake(self, rep) -> float:
        from kvsched.sim.lifecycle import load_wake
        return load_wake(rep)

    # ----- writes down -----------------------------------------------------------------
    def write(self, keys: list[int]) -> None:
        """Blocks `keys` go down now (evicted, or computed last batch with write-through): each
        tier lacking one gets it over its write link, readable when the write lands; one it
        holds becomes its most recent when evicted again (write-through leaves it, as vLLM's
        CPU manager skips a chunk it holds: kv_offload/cpu/manager.py, `prepare_store`)."""
        bb, now, touch = self.block_bytes, self.clock.now, not self.through
        for p in self.ports:
            store, link = p.store, p.write
            have = store.keys
            for k in keys:
                if k in have:
                    if touch:
                        have.move_to_end(k)
                else:
                    store.put(k, link.send(now, bb))

    def finished(self, keys: list[int]) -> None:
        """Write-through: a finished request's blocks (those it offered or loaded, head to tail)
        become each tier's most recent, its head the newest, as vLLM's LRU updates them when
        the request finishes (kv_offload/cpu/policies/lru.py, `on_request_finished`)."""
        for p in self.ports:
            have = p.store.keys
            for k in reversed(keys):
                if k in have:
                    have.move_to_end(k)

    def defer(self, keys: list[int]) -> None:
        """Write-through: blocks keyed while a batch is planned are computed by its end, so they
        go down at the next step's start (`flush`), as vLLM's worker submits a step's stores
        at the next step (offloading/worker.py)."""
        self.deferred.extend(keys)

    def flush(self) -> None:
        keys, self.deferred = self.deferred, []
        self.write(keys)

    # ----- loads -------------------------------------------------------------------------
    def below(self, keys: list[int], first: int, cap: int) -> list[int]:
        """From block `first` on (up to `cap`), the tier each block of the prefix is read from
        (an index into `ports`), as long as some tier holds it readable now."""
        ports, now, out = self.ports, self.clock.now, []
        for j in range(first, cap):
            k = keys[j]
            for n, p in enumerate(ports):
                t = p.store.keys.get(k)
                if t is not None and t <= now:
                    out.append(n)
                    break
            else:
                break
        return out

    def delay(self, keys: list[int], first: int, cap: int, src: list[int], cached) -> float | None:
        """When a waiting request whose prefix continues below the GPU from block `first` (up to
        `cap`; `src`: the readable blocks, `below`) may be looked up again, or None to go on
        now. vLLM defers the lookup (offloading/scheduler.py, `get_num_new_matched_tokens`
        returns None) while a block of the run the tiers hold is still being stored
        (`_maximal_prefix_lookup`: HIT_PENDING; cpu/manager.py, `lookup`: not `is_ready`) or
        while another request is loading one of the hit blocks ("Hit chunks are being loaded").
        A pending write counts only while the block is still cached on this GPU (`cached`: the
        prefix cache's keys): vLLM finishes a store before it reuses the block's GPU memory
        (`jobs_to_flush`, offloading/scheduler.py `build_connector_meta`), so a block whose
        store is pending is still on the GPU; kvsched reuses an evicted block at once while its
        write is queued (docs/kv-tiers.md), and such a block counts as absent till its write
        lands. The time returned is that write's landing, else that load's."""
        ports, now, t = self.ports, self.clock.now, None
        for j in range(first, cap):
            k = keys[j]
            ready = None
            for p in ports:
                x = p.store.keys.get(k)
                if x is not None and (ready is None or x < ready):
                    ready = x
            if ready is None or ready > now and k not in cached:    # absent: the run ends
                break
            if ready > now and (t is None or ready > t):
                t = ready
        if t is not None:
            return t
        return self.loading_of(keys, first, len(src)) if src else None

    def loading_of(self, keys: list[int], first: int, n: int) -> float | None:
        """When the last load here bringing some of blocks first .. first + n - 1 lands (None:
        none is loading them)."""
        inflight, t = self.inflight, None
        if inflight:
            for k in keys[first:first + n]:
                x = inflight.get(k)
                if x is not None and (t is None or x > t):
                    t = x
        return t

    def start(self, i: int, keys: list[int], first: int, src: list[int], before_admission: bool) -> None:
        """Load blocks first .. first + len(src) - 1 of request i (keys `keys`) from the tiers
        `src` names (`below`: each is readable now). Each tier's blocks go as one transfer on
        its read link; different tiers' links run in parallel; the load lands with the last."""
        bb, now = self.block_bytes, self.clock.now
        land = now
        used = []
        for n, p in enumerate(self.ports):
            count = src.count(n)
            if not count:
                continue
            have = p.store.keys
            for j, s in enumerate(src):
                if s == n:
                    have.move_to_end(keys[first + j])
            land = max(land, p.read.send(now, count * bb))
            p.store.bytes_out += count * bb
            used.append(p)
        for p in used:
            p.loads += 1
            p.load_s += land - now
        loading = keys[first:first + len(src)]
        for k in loading:
            self.inflight[k] = land
        self.loading[i] = (land, first, len(src), now, before_admission, loading)
        self.landed_src[i] = (first, src)
        self.loads += 1
        self.load_time += land - now

    def wait_for(self, i: int, first: int, land: float, before_admission: bool) -> None:
        """Request i waits, loading nothing, for another request's load landing at `land`."""
        self.loading[i] = (land, first, 0, self.clock.now, before_admission, [])

    def landed(self, now: float) -> list[tuple[int, int, int]]:
        """(request, first block, blocks) of the loads landed by `now`, earliest first (ties by
        request), taken off the loads in flight."""
        done = sorted((v[0], i) for i, v in self.loading.items() if v[0] <= now)
        out = []
        inflight = self.inflight
        for land, i in done:
            _, first, n, start, before, keys = self.loading.pop(i)
            if before:
                self.load_s[i] = self.load_s.get(i, 0.0) + (land - start)
            for k in keys:
                if inflight.get(k) == land:
                    del inflight[k]
            out.append((i, first, n))
        return out

    def used(self, i: int, blocks: int) -> None:
        """Request i's admission took the first `blocks` blocks of its prefix (0: it let go of
        it): the loaded ones among them count as the tiers' hits."""
        first, src = self.landed_src.pop(i, (0, ()))
        for n in src[:max(0, blocks - first)]:
            self.ports[n].store.loaded_tokens += self.bs

    def next_landing(self) -> float:
        return min(v[0] for v in self.loading.values())

    # ----- what policies read (the view's `prefix_blocks`, `tier_free_blocks`) --------------
    def prefix_blocks(self, cache, i: int) -> tuple[int, ...]:
        """Request i's cached prefix now: its blocks on the GPU, then those each tier would
        load after them (in `ports` order), as `lifecycle.load_scan` would find them."""
        cap = cache.lookup_cap(i)
        g = cache.cached_tokens(i) // self.bs
        counts = [0] * len(self.ports)
        if g < cap:
            for n in self.below(cache.keys(i, cap), g, cap):
                counts[n] += 1
        return (g, *counts)

    def free_blocks(self) -> tuple[tuple[str, int], ...]:
        return tuple((p.store.kind, p.store.capacity_blocks - len(p.store.keys)) for p in self.ports)


def parse_tiers(texts, write: str, block_bytes: int, replicas: int, per_node: int = 1) -> list[list[TierStore]]:
    """--kv-tier values for prefix-cache offload: per replica, its tiers. Host and disk stores
    belong to a node: replicas k, k+1, .. in runs of `per_node` share one (--gpus-per-node;
    1: each replica its own), each over its own links; one remote store is shared by all."""
    if write not in WRITE_MODES:
        raise KvschedError(f"--kv-write must be one of {', '.join(WRITE_MODES)}, got {write!r}")
    specs = [parse_kv_tier(t) for t in texts]
    kinds = [s.kind for s in specs]
    for k in set(kinds):
        if kinds.count(k) > 1:
            raise KvschedError(f"--kv-tier {k} is given {kinds.count(k)} times: give each tier once")
    for s in specs:
        if int(s.gb * 1e9 // block_bytes) < 1:
            raise KvschedError(f"--kv-tier {s.describe()}: {s.gb:g} GB holds no KV block "
                               f"({block_bytes} bytes each)")
    shared = {s.kind: TierStore(s, block_bytes) for s in specs if s.kind == "remote"}
    nodes = [{s.kind: TierStore(s, block_bytes) for s in specs if s.kind != "remote"}
             for _ in range(-(-replicas // per_node))]
    return [[shared.get(s.kind) or nodes[r // per_node][s.kind] for s in specs] for r in range(replicas)]
