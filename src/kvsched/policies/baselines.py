"""Baseline schedulers of today's engines, written against the engine-agnostic contract.

All use recompute preemption with vLLM's victim order: the most recently admitted running
request first (LIFO), until the step fits; no request is admitted in a step that preempted.
Both rules are vLLM's own (vllm/v1/core/sched/scheduler.py), not simplifications.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.policies.base import Plan, ServerView, noop_hook
from kvsched.workload.lengths import MAX_TOKENS


# Compiled (kvsched/compiled.py), the counts below are C integers: blocks and tokens, bounded by
# the KV capacity (kvcache.py's TOKEN_LIMIT) and the workload's lengths.
@cython.locals(free=cython.longlong, need=cython.longlong, nd=cython.longlong)
def make_room(v: ServerView, reserve: int = 0,
              release: Callable[[int], int] | None = None) -> tuple[list[int], int, int]:
    """Preempt newest-first until one decode step of every remaining decoder fits.

    `reserve` blocks are held back (promised to running prefills); `release(i)` is what
    preempting i frees, reservation included (default: its KV blocks). Returns (victims,
    free blocks after the decode step, decoders left).
    """
    free = v.kv_free_blocks - reserve
    need = v.decode_new_blocks
    nd = v.num_decoding
    victims: list[int] = []
    if need > free:
        release = release or v.kv_blocks
        for i in reversed(v.running):
            if need <= free:
                break
            victims.append(i)
            free += release(i)
            if v.is_decoding(i):
                need -= v.needs_block(i)
                nd -= 1
    return victims, free - need, nd


@cython.locals(total=cython.longlong)
def draft_slots(v: ServerView) -> int:
    """Input slots a scheduled request takes beside its tokens under speculative decoding: vLLM's
    `max_num_new_slots_for_drafting` (vllm/config/speculative.py: 1 for a sequential draft
    model, 0 for EAGLE, MTP and n-gram)."""
    return 1 if v.spec_method == "draft" else 0


def verify_tokens(v: ServerView, i: int, room: int, cut: dict[int, int]) -> int:
    """Tokens decoder i's step takes from a budget with `room` left (>= 1): 1 and its drafts,
    those that do not fit cut (recorded in `cut`, for Plan.spec), as vLLM cuts them."""
    s = v.spec_tokens(i)
    if s >= room:
        s = room - 1
        cut[i] = s
    return 1 + s


def spec_decodes(v: ServerView, budget: int, gone: set) -> tuple[int, dict, object]:
    """The decoders' share of a token budget under speculative decoding, in running order: each
    takes 1 + its drafts (`verify_tokens`); once the budget is spent the rest get no step.
    Returns (budget left, {decoder: drafts} for the ones cut, True or the decoders that step)."""
    cut: dict[int, int] = {}
    chosen = []
    for i in v.running:
        if i in gone or not v.is_decoding(i):
            continue
        if budget <= 0:
            return budget, cut, chosen
        chosen.append(i)
        budget -= verify_tokens(v, i, budget, cut)
    return budget, cut, True


def reserved_blocks(v: ServerView, prefilling: Iterable[int]) -> int:
    """Blocks the running prefills still need for their whole prompts (promised to them: the
    vLLM-v0 block manager's reservation, under Sarathi-Serve and SLAI)."""
    total = 0
    for i in prefilling:
        total += v.blocks_for(v.prefill_target(i)) - v.kv_blocks(i)
    return total


def whole_count(name: str, what: str, value, low: int = 1) -> None:
    """A policy's count parameter is an integer in [low, MAX_TOKENS] (the command line's limit
    on whole numbers; compiled, the counts it feeds are C integers, which a float or a larger
    number would not be as Python: kvsched/compiled.py)."""
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: {what} must be a whole number, got {value!r}") from None
    if not low <= value <= MAX_TOKENS:
        raise ValueError(f"{name}: {what} must be in [{low}, {MAX_TOKENS:,}], got {value}")


def _check_limits(name: str, tokens: int, seqs: int) -> None:
    whole_count(name, "the token budget", tokens)
    whole_count(name, "max_num_seqs", seqs)
    if seqs > tokens:
        raise ValueError(f"max_num_seqs ({seqs}) exceeds the token budget ({tokens}): every "
                         "decode takes one token of the budget (vLLM rejects this too)")


ORDERS = ("spf", "fcfs", "lpm")
LPM_QUEUE_LIMIT = 128       # SGLang's lpm falls back to FCFS beyond this many waiting requests


def prefill_order(v: ServerView, order: str, user_priority: bool = False, aging: float = 0.0) -> list[int]:
    """Waiting requests in the order new prefills are considered: SPF (by the tokens left to
    prefill, stable), queue order, or LPM: the longest prefix cached on the GPU first, stable,
    as SGLang's `lpm` (python/sglang/srt/managers/schedule_policy.py, `_sort_by_longest_prefix`
    on the device match; FCFS beyond 128 waiting requests, as its `_determine_active_policy`):
    a request whose prefix must first be loaded from a tier below, or computed, goes after
    those whose prefix is on the GPU (the view's `prefix_blocks`). Optionally by tier priority
    first and aged requests first (shared by `slai` and `sarathi`; rad-slai.txt section 6
    step 3)."""
    queue = list(v.waiting)
    if order == "lpm" and len(queue) <= LPM_QUEUE_LIMIT:
        gpu = {i: (v.prefix_blocks(i) or (0,))[0] for i in queue}
        queue.sort(key=lambda i: (v.tier_priority(i), -gpu[i]) if user_priority else -gpu[i])
    elif order == "spf":
        queue.sort(key=(lambda i: (v.tier_priority(i), v.prefill_target(i))) if user_priority
                   else v.prefill_target)
    elif user_priority:
        queue.sort(key=v.tier_priority)
    if aging > 0:
        old = [i for i in v.waiting if v.now - v.arrival(i) > aging]
        if old:
            seen = set(old)
            queue = old + [i for i in queue if i not in seen]
    return queue


@cython.locals(free=cython.longlong, budget=cython.longlong, seats=cython.longlong, keep=cython.longlong,
               target=cython.longlong, hit=cython.longlong, taken=cython.longlong, need=cython.longlong,
               c=cython.longlong)
def admit_reserving(v: ServerView, queue: Iterable[int], free: int, budget: int, seats: int,
                    watermark: float, hits=None) -> tuple[list[int], list[tuple[int, int]], int, int]:
    """Admission as the vLLM-v0 block manager under Sarathi-Serve (and SLAI): in `queue` order,
    while budget and seats last, a request is admitted when KV for its whole prompt fits beyond
    `watermark` x blocks kept free (while requests run); its first chunk runs and the rest is
    reserved. The first request that does not fit ends admission. With prefix caching
    (`hits`, the view's planner), a request needs KV only beyond its cached prefix, plus the
    cached blocks it takes from the free pool, and computes from its prefix on. Returns
    (admitted, their chunks, free blocks left, budget left)."""
    admit: list[int] = []
    chunks: list[tuple[int, int]] = []
    keep = int(watermark * v.kv_capacity_blocks) if v.running else 0
    for i in queue:
        if budget <= 0 or seats <= 0:
            break
        target = v.prefill_target(i)
        hit, taken = hits.lookup(i) if hits is not None else (0, 0)
        need = v.blocks_for(target) - v.blocks_for(hit) + taken
        if free - need < keep:
            break
        c = min(budget, target - hit)
        admit.append(i)
        chunks.append((i, c))
        if hits is not None:
            hits.chunk(i, c)
        free -= need
        budget -= c
        seats -= 1
    return admit, chunks, free, budget


class _Base:
    name = "base"

    @noop_hook
    def on_finish(self, i: int, view: ServerView) -> None:
        """Baselines keep no per-request state."""


@dataclass
class VllmV1(_Base):
    """vLLM v1 scheduler: one token budget per step, running requests first (decodes, then
    unfinished chunked prefills in admission order; with speculative decoding vLLM's single
    loop over the running requests in admission order, `_running_spec`), then waiting requests
    FCFS with the last one chunked to fit. KV is allocated per chunk; a running prefill whose chunk does
    not fit preempts the newest running requests (itself last, ending the step's running
    phase). Defaults are vLLM's: 8192 tokens / 1024 sequences on GPUs with >= 70 GiB,
    else 2048 / 256.

    As vLLM 0.32: a waiting request is admitted only if KV blocks for its whole prompt are
    free (`scheduler_reserve_full_isl`, checked in `KVCacheManager.allocate_slots`; only its
    first chunk is allocated), and the first one that fails ends admission for the step
    (`reserve_full_prompt=false` checks the first chunk only, as older vLLM); the
    long-prefill cap is not applied when the request is the only one running or waiting.
    vLLM orders running decodes and chunked prefills by admission rather than decodes
    first; in 92,000 steps compared with vLLM 0.32's scheduler that never changed a batch."""
    max_num_batched_tokens: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "token budget per step"})
    max_num_seqs: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "max running requests"})
    reserve_full_prompt: bool = field(default=True, metadata={
        "help": "admit only when KV for the whole prompt is free (vLLM 0.32's scheduler_reserve_full_isl)"})
    long_prefill_token_threshold: int = field(default=0, metadata={"range": "[0, inf)", 
        "help": "cap on one request's prefill tokens per step, 0 = none (vLLM's option; the chunk s_hat of stability-capacity.txt)"})
    name = "vllm-v1"
    allocates_in_order = True               # victims freed as allocations fail (base.py, allocates_in_order)
    plans_prefix_hits = True                # chunks start after the cached prefix (view.prefix_planner)
    replica_local = True                    # reads only its own replica, shares nothing (base.py)
    decodes_when_idle = True                # nothing waits or prefills: decode everyone (base.py)

    def __post_init__(self) -> None:
        _check_limits(self.name, self.max_num_batched_tokens, self.max_num_seqs)
        whole_count(self.name, "long_prefill_token_threshold (0 = no cap)", self.long_prefill_token_threshold, 0)
        self._cap = self.long_prefill_token_threshold or None

    prefix_caching_default = True           # vLLM v1 turns automatic prefix caching on

    def schedule(self, v: ServerView) -> Plan:
        hits = v.prefix_planner()
        release = hits.preempt if hits is not None else v.kv_blocks
        cap = self._cap if self._cap and len(v.running) + len(v.waiting) > 1 else None    # a lone request is not capped
        if v.spec_method is None:
            victims, chunks, decode, free, budget = self._running(v, hits, release, cap)
            spec, slots = None, 0
        else:                               # speculative decoding: vLLM's running loop itself
            victims, chunks, decode, free, budget, spec = self._running_spec(v, hits, release, cap)
            slots = draft_slots(v)
        admit: list[int] = []
        if not victims:
            pad_k = 1 if v.spec_method is not None and not chunks else 0       # padding possible
            ran = bool(chunks) or decode is True or (decode is not False and len(decode) > 0)   # running ones stepped
            spec = self._admit(v, hits, cap, free, budget, slots, pad_k, ran, admit, chunks, spec)
        return Plan(admit, chunks, decode, victims, spec=spec or None)

    @cython.locals(free=cython.longlong, nd=cython.longlong, budget=cython.longlong, done=cython.longlong,
                   c=cython.longlong, need=cython.longlong)
    def _running(self, v: ServerView, hits, release, cap) -> tuple:
        """The running requests without speculation: (victims, chunks, decode, free blocks, budget
        left). Every decode first (1 token each; in 92,000 steps against vLLM 0.32 the order
        never changed a batch), then the running prefills' chunks in admission order."""
        victims, free, nd = make_room(v, release=release)
        budget = self.max_num_batched_tokens - nd
        chunks: list[tuple[int, int]] = []
        gone = set(victims)
        newest = None                       # the running requests newest first, not yet preempted (made when needed)
        for i in v.prefilling:
            if i in gone:
                break                       # reached the preempted tail of the running list
            done = v.prefill_done(i)
            c = min(budget, v.prefill_target(i) - done)
            if cap is not None and cap < c:
                c = cap
            if c <= 0:
                break
            need = v.blocks_for(done + c) - v.blocks_for(done)
            while need > free:              # victims are newer than i: none has a chunk yet
                if newest is None:
                    newest = (j for j in reversed(v.running) if j not in gone)
                j = next(newest)
                victims.append(j)
                gone.add(j)
                if j == i:
                    break
                free += release(j)
                if v.is_decoding(j):
                    free += v.needs_block(j)
                    budget += 1
            if i in gone:
                break
            chunks.append((i, c))
            if hits is not None:
                hits.chunk(i, c)
            free -= need
            budget -= c
        decoders_left = v.num_decoding - (sum(1 for j in victims if v.is_decoding(j)) if victims else 0)
        return victims, chunks, decoders_left > 0, free, budget

    @cython.locals(free=cython.longlong, budget=cython.longlong, slots=cython.longlong, done=cython.longlong,
                   n=cython.longlong, s=cython.longlong, need=cython.longlong, k=cython.Py_ssize_t,
                   end=cython.Py_ssize_t)
    def _running_spec(self, v: ServerView, hits, release, cap) -> tuple:
        """The running requests with speculative decoding, as vLLM 0.32's running loop
        (scheduler.py `schedule`): in admission order, a decoder takes 1 + its drafts and a
        prefill its chunk, each cut to the long-prefill cap and to the budget left (less the
        draft slots, `draft_slots`); its blocks (`spec_step_blocks`: the tokens it is given, so a
        cut decoder takes fewer) come from the free ones, and when they do not fit the newest
        running requests are preempted, itself last (which ends the loop); the loop ends when the
        budget does. Returns (victims, chunks, decode, free blocks, budget left, cut drafts)."""
        slots = draft_slots(v)
        budget = self.max_num_batched_tokens
        free = v.kv_free_blocks
        running = list(v.running)
        end = len(running)                  # running[end:]: preempted, newest first
        victims: list[int] = []
        chunks: list[tuple[int, int]] = []
        decode: list[int] = []
        cut: dict[int, int] = {}
        k = 0
        while k < end and budget > slots:
            i = running[k]
            decoding = v.is_decoding(i)
            if decoding:
                s = v.spec_tokens(i)
                n = 1 + s
            else:
                done = v.prefill_done(i)
                n = v.prefill_target(i) - done
            if cap is not None and cap < n:
                n = cap
            if n > budget - slots:
                n = budget - slots
            need = v.spec_step_blocks(i, n - 1) if decoding else v.blocks_for(done + n) - v.blocks_for(done)
            while need > free:
                end -= 1
                j = running[end]
                victims.append(j)
                if j == i:
                    break
                free += release(j)
            if end <= k:                    # it preempted itself: vLLM's loop breaks
                break
            if decoding:
                decode.append(i)
                if n - 1 < s:
                    cut[i] = n - 1
            else:
                chunks.append((i, n))
                if hits is not None:
                    hits.chunk(i, n)
            free -= need
            budget -= n + slots
            k += 1
        everyone = len(decode) == v.num_decoding
        return victims, chunks, (len(decode) > 0 if everyone else decode), free, budget, cut

    @cython.locals(free=cython.longlong, budget=cython.longlong, slots=cython.longlong, c=cython.longlong,
                   need=cython.longlong, seqs=cython.longlong, target=cython.longlong, hit=cython.longlong,
                   taken=cython.longlong, pad=cython.longlong, pad_k=cython.longlong)
    def _admit(self, v: ServerView, hits, cap, free: int, budget: int, slots: int, pad_k: int, ran: bool,
               admit: list, chunks: list, spec):
        """Waiting requests FCFS while seats, budget and KV allow (appended to `admit` and
        `chunks`); returns Plan.spec with the padded admissions: vLLM pads a one-token admission
        to 1 + k rows (placeholder drafts, all rejected) when no running prefill chunk was
        scheduled (`pad_k`), running requests were or it has a prefix hit (`ran`), and the
        rows stay within max_model_len (`spec_pad`; scheduler.py `pad_spec_decode`), and rather
        stops than admit it unpadded."""
        seqs = len(v.running)
        for i in v.waiting:
            if seqs >= self.max_num_seqs or budget <= slots:
                break
            target = v.prefill_target(i)
            hit, taken = hits.lookup(i) if hits is not None else (0, 0)
            pad = v.spec_pad(hit) if pad_k and target - hit == 1 and (ran or hit > 0) else 0
            if pad and 1 + pad > budget - slots:
                break
            c = min(budget - slots, target - hit)
            if cap is not None and cap < c:
                c = cap
            # the hit's blocks are shared, and those now free leave the free pool (vLLM's allocate_slots)
            need = v.blocks_for(hit + c + pad) - v.blocks_for(hit) + taken
            if need > free or self.reserve_full_prompt and v.blocks_for(target + pad) - v.blocks_for(hit) + taken > free:
                break
            admit.append(i)
            chunks.append((i, c))
            if hits is not None:
                hits.chunk(i, c, pad)
            if pad:
                if spec is None:
                    spec = {}
                spec[i] = pad
            free -= need
            budget -= c + pad + slots
            seqs += 1
        return spec


@dataclass
class Sarathi(_Base):
    """Sarathi-Serve (rad-slai.txt, Appendix E.2, Algorithm 4): every decode, then ongoing
    chunked prefills, then new prefills in arrival order (`order=fcfs`) or shortest prompt
    first (`order=spf`, re-sorted every batch, stable: the SLAI authors' variant), under a
    token budget (the chunk size; with speculative decoding a decode takes 1 + its drafts, cut
    to the budget left, as vLLM cuts them) and max_num_seqs. As in its vLLM-v0 block manager, a
    request is admitted only if KV for its whole prompt is free (reserved for its remaining
    chunks), beyond `watermark` x blocks while requests run (vLLM v0 keeps 1%; 0 by default
    here; a lone request that fits is never starved, as `vllm-v0`)."""
    chunk_size: int = field(default=512, metadata={"range": "[1, inf)", "help": "token budget per batch"})
    max_num_seqs: int = field(default=128, metadata={"range": "[1, inf)", "help": "max running requests"})
    order: str = field(default="fcfs", metadata={"range": "fcfs|spf|lpm", "help": "new-prefill order: FCFS, shortest prompt first, or longest prefix cached on the GPU first (SGLang's lpm)"})
    watermark: float = field(default=0.0, metadata={"range": "[0, 1)", "help": "share of KV blocks kept free at admission"})
    name = "sarathi"
    plans_prefix_hits = True                # chunks start after the cached prefix (view.prefix_planner)
    replica_local = True                    # reads only its own replica, shares nothing (base.py)
    decodes_when_idle = True                # nothing waits or prefills: decode everyone (base.py)

    def __post_init__(self) -> None:
        _check_limits(self.name, self.chunk_size, self.max_num_seqs)
        if self.order not in ORDERS:
            raise ValueError(f"order must be fcfs, spf or lpm, got {self.order!r}")

    @cython.locals(reserve=cython.longlong, budget=cython.longlong, c=cython.longlong)
    def schedule(self, v: ServerView) -> Plan:
        blocks, target = v.blocks_for, v.prefill_target
        reserve = reserved_blocks(v, v.prefilling)

        def release(i: int) -> int:
            return blocks(target(i)) if not v.is_decoding(i) else v.kv_blocks(i)

        hits = v.prefix_planner()
        if hits is not None:
            plain = release

            def release(i: int) -> int:         # shared blocks stay held by the others
                return plain(i) - v.kv_blocks(i) + hits.preempt(i)
        victims, free, nd = make_room(v, reserve, release)
        gone = set(victims)
        cut = None
        decode = nd > 0
        if v.spec_method is None:
            budget = self.chunk_size - nd
        else:                               # a decode takes 1 + its drafts of the chunk (sim/spec_decode.py)
            budget, cut, decode = spec_decodes(v, self.chunk_size, gone)
            if decode is True:
                decode = nd > 0
        chunks: list[tuple[int, int]] = []
        for i in v.prefilling:
            if budget <= 0:
                break
            if i not in gone:
                c = min(budget, target(i) - v.prefill_done(i))
                chunks.append((i, c))
                if hits is not None:
                    hits.chunk(i, c)
                budget -= c
        admit: list[int] = []
        if not victims and v.waiting and budget > 0:
            queue = v.waiting if self.order == "fcfs" else prefill_order(v, self.order)
            admit, new, _, _ = admit_reserving(v, queue, free, budget, self.max_num_seqs - len(v.running),
                                               self.watermark, hits)
            chunks += new
        return Plan(admit, chunks, decode, victims, spec=cut or None)


@dataclass
class VllmV0(_Base):
    """vLLM v0 default scheduler: exclusive batching that prioritises prefills. Whenever
    waiting requests can be admitted (FCFS, whole prompts, token budget, max_num_seqs, KV
    for the prompt beyond a watermark of free blocks), the step is prefill-only; otherwise
    it is decode-only, preempting the newest requests if decodes do not fit. A prompt
    longer than the budget runs alone (vLLM v0 would refuse it). The watermark applies
    only while requests run, so a lone request that fits is never starved. While any
    request is swapped out (--preemption swap), no new prompt is admitted, as v0's
    `_schedule_default` schedules prefills only when its swapped queue is empty."""
    max_num_batched_tokens: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "token budget per prefill step"})
    max_num_seqs: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "max running requests"})
    watermark: float = field(default=0.01, metadata={"range": "[0, 1)", "help": "fraction of KV blocks kept free at admission"})
    name = "vllm-v0"
    plans_prefix_hits = True                # chunks start after the cached prefix (view.prefix_planner)
    replica_local = True                    # reads only its own replica, shares nothing (base.py)
    decodes_when_idle = True                # nothing waits or prefills: decode everyone (base.py)

    def __post_init__(self) -> None:
        _check_limits(self.name, self.max_num_batched_tokens, self.max_num_seqs)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def schedule(self, v: ServerView) -> Plan:
        hits = v.prefix_planner()
        if hits is not None:
            hits.decodes(0)                     # an admission step is prefill-only
        admit, chunks = admit_whole_prompts(
            v, v.kv_free_blocks, self.max_num_batched_tokens, self.max_num_seqs - len(v.running),
            int(self.watermark * v.kv_capacity_blocks) if v.num_decoding else 0, alone_ok=True,
            hits=hits) if not v.swapped else ([], [])
        if admit:
            return Plan(admit, chunks, False, [])
        victims, _, nd = make_room(v, release=hits.preempt if hits is not None else None)
        return Plan([], [], nd > 0, victims)


@cython.locals(free=cython.longlong, budget=cython.longlong, seats=cython.longlong, keep_free=cython.longlong,
               hit=cython.longlong, taken=cython.longlong, target=cython.longlong, t=cython.longlong,
               need=cython.longlong)
def admit_whole_prompts(v: ServerView, free: int, budget: int, seats: int, keep_free: int = 0,
                        alone_ok: bool = True, hits=None) -> tuple[list[int], list[tuple[int, int]]]:
    """FCFS admission of whole prompts (no chunking) while tokens, seats and KV allow.
    A prompt longer than the budget may run alone when `alone_ok`. With prefix caching
    (`hits`), only the uncached part is computed and needs new KV."""
    admit: list[int] = []
    chunks: list[tuple[int, int]] = []
    for i in v.waiting:
        hit, taken = hits.lookup(i) if hits is not None else (0, 0)
        target = v.prefill_target(i)
        t = target - hit
        if seats <= 0 or (t > budget and (admit or not alone_ok)):
            break
        need = v.blocks_for(target) - v.blocks_for(hit) + taken
        if free - need < keep_free:
            break
        admit.append(i)
        chunks.append((i, t))
        if hits is not None:
            hits.chunk(i, t)
        free -= need
        budget -= t
        seats -= 1
    return admit, chunks


@dataclass
class Orca(_Base):
    """Orca: iteration-level scheduling with mixed batches and no chunking. Every decode runs
    each step and new requests join with their whole prompt (FCFS) while max_num_seqs and KV
    allow. Like Orca (and Vidur's Orca) it has no token budget by default; with
    max_num_batched_tokens > 0, a prompt longer than the remaining budget waits, and one
    longer than the whole budget runs alone once no decode is running. max_num_seqs follows
    vllm-v1's default for the GPU."""
    max_num_batched_tokens: int = field(default=0, metadata={"range": "[0, inf)", "help": "token budget per step, 0 = none (Orca's)"})
    max_num_seqs: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "max running requests"})
    name = "orca"
    plans_prefix_hits = True                # chunks start after the cached prefix (view.prefix_planner)
    replica_local = True                    # reads only its own replica, shares nothing (base.py)
    decodes_when_idle = True                # nothing waits or prefills: decode everyone (base.py)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens:
            _check_limits(self.name, self.max_num_batched_tokens, self.max_num_seqs)
        elif self.max_num_seqs is not None:
            whole_count(self.name, "max_num_seqs", self.max_num_seqs)

    def schedule(self, v: ServerView) -> Plan:
        hits = v.prefix_planner()
        victims, free, nd = make_room(v, release=hits.preempt if hits is not None else None)
        admit: list[int] = []
        chunks: list[tuple[int, int]] = []
        if not victims:
            budget = self.max_num_batched_tokens - nd if self.max_num_batched_tokens else 1 << 62
            admit, chunks = admit_whole_prompts(v, free, budget, self.max_num_seqs - len(v.running),
                                                alone_ok=nd == 0, hits=hits)
        return Plan(admit, chunks, nd > 0, victims)


@dataclass
class RequestLevel(_Base):
    """Request-level batching, FasterTransformer style (rad-slai.txt, Appendix E.1,
    Algorithm 3): take up to b waiting requests FCFS, prefill all their prompts in one
    batch, then run decode-only batches until every one of them has finished; only then
    admit the next b. Requests whose prompts do not fit in free KV wait for the next cycle;
    decodes that outgrow KV preempt the newest (it rejoins the queue front)."""
    b: int = field(default=64, metadata={"range": "[1, inf)", "help": "requests per cycle"})
    name = "request-level"
    plans_prefix_hits = True                # chunks start after the cached prefix (view.prefix_planner)
    replica_local = True                    # reads only its own replica, shares nothing (base.py)
    decodes_when_idle = True                # nothing waits or prefills: decode everyone (base.py)

    def __post_init__(self) -> None:
        whole_count(self.name, "b", self.b)

    def schedule(self, v: ServerView) -> Plan:
        hits = v.prefix_planner()
        if v.num_decoding:
            victims, _, nd = make_room(v, release=hits.preempt if hits is not None else None)
            return Plan([], [], nd > 0, victims)
        admit, chunks = admit_whole_prompts(v, v.kv_free_blocks, 1 << 62, self.b, hits=hits)
        return Plan(admit, chunks, False, [])

