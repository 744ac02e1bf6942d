"""The policy contract (docs/architecture.md, "Policy contract"): a read-only view in, a plan
out, optional hooks to learn from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Protocol, Sequence


_FRESH: list = []       # an omitted list field: a new list each time (the dataclass's default_factory)


@dataclass(slots=True)
class Plan:
    """What the next batch does. Applied in this order: preempt, admit, run the batch.

    preempt: running requests to preempt by recompute (KV freed, back to the queue front).
    admit:   waiting requests to start (they hold no KV until a chunk runs).
    chunks:  (request, tokens) prefill chunks for requests in their prefill phase
             (admitted ones included); the last chunk of a prefill yields an output token.
             With prefix caching, a request's first chunk after admission starts after its
             cached prefix, as far as the chunk leaves room before its prefill target
             (`view.prefix_planner()` says how far that is).
    decode:  True: every request in its decode phase decodes one token (the O(1) path);
             False: none; or a collection of request ids in their decode phase: exactly
             those decode, the others stay paused with their KV held (their next
             inter-token gap spans the batches they sat out).
    swap:    with --preemption swap (docs/kv-tiers.md), the victims whose KV is swapped to
             host memory instead of recomputed (None, the default: every decoding victim);
             the others recompute. Each must be in `preempt`; a named victim still in its
             prefill recomputes, as every prefilling victim does.
    spec:    with speculative decoding (--spec, docs/speculative-decoding.md), at most how many
             draft tokens the decoders verify this step: None (the default: all of each one's
             drafts), a whole number for every decoder, or a mapping request -> number (the
             decoders it does not name verify all of theirs). Lowering it lowers the tokens and
             the lookahead slots the step takes. The mapping may also name an admitted request
             whose chunk is its last prompt token: that chunk is padded with that many
             placeholder drafts, all rejected (vLLM's `pad_spec_decode`, at most `spec_pad(hit)`).
    An empty plan (nothing to compute) means: wait for the next event (an arrival, KV freed).
    """
    admit: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    decode: bool | Collection[int] = False
    preempt: list[int] = field(default_factory=list)
    swap: Collection[int] | None = None
    spec: int | Mapping[int, int] | None = None

    def __init__(self, admit: list[int] = _FRESH, chunks: list[tuple[int, int]] = _FRESH,
                 decode: bool | Collection[int] = False, preempt: list[int] = _FRESH,
                 swap: Collection[int] | None = None, spec: int | Mapping[int, int] | None = None) -> None:
        """The dataclass's own __init__, written out: the generated one would run as
        interpreted code even in the compiled build (kvsched/compiled.py), once per batch."""
        self.admit = [] if admit is _FRESH else admit
        self.chunks = [] if chunks is _FRESH else chunks
        self.decode = decode
        self.preempt = [] if preempt is _FRESH else preempt
        self.swap = swap
        self.spec = spec


class ServerView(Protocol):
    """What a policy may read at a batch boundary (the replica's `ReplicaView`). Read only:
    assigning any attribute raises an error naming the policy.

    Requests are integer ids (workload indices). Lengths are tokens; KV is counted in blocks.
    """
    index: int                        # the replica's number in its cluster (0 alone)
    role: str                         # "mixed", or "prefill" / "decode" when disaggregated
    now: float
    waiting: Sequence[int]            # queue, front first (preempted requests go to the front)
    running: Iterable[int]            # admitted requests, oldest admission first
    prefilling: Iterable[int]         # running requests still in their prefill phase
    decoding: Collection[int]         # running requests in their decode phase (paused ones too)
    num_decoding: int                 # len(decoding)
    block_size: int
    kv_capacity_blocks: int
    kv_used_blocks: int
    kv_free_blocks: int
    decode_new_blocks: int            # blocks one decode step of every decoder needs
    recent_batch_times: Sequence[float]
    recent_finished: Sequence[tuple[int, int]]   # (prompt, output) of recent finishes
    mean_batch_time: float | None     # mean over every batch since the start (None before one)
    iterations: int                   # batches run so far
    arrivals_pending: bool            # whether any request is still to arrive (anywhere)
    next_arrival: float | None        # time of the next arrival when known (None in a closed loop)
    cost_model: object                # the batch-time model (`time(BatchShape)`), for calibration
    declared_types: tuple[tuple[int, int, float], ...] | None   # (prompt, output, rate req/s) per type
                                      # when the workload declares them, rates scaled to this
                                      # replica's share of arrivals (even split assumed); else None
    prefix_caching: bool              # whether the replica caches prefixes (docs/prefix-caching.md)
    prefix_hit_rate: float | None     # share of looked-up prompt tokens taken from the cache so far
    swapped: int                      # requests swapped out to host memory here, to resume (--preemption
                                      # swap, docs/kv-tiers.md); 0 without swap
    tier_free_blocks: tuple[tuple[str, int], ...]   # (name, free blocks) of each KV tier below the GPU,
                                      # fastest first; () without tiers
    spec_method: str | None           # speculative decoding's method (draft, eagle, mtp, ngram), None without
    spec_k: int                       # draft tokens proposed per step now (--spec's k, or --spec-adaptive's); 0 without
    decode_tokens: int                # tokens one decode step of every decoder schedules: 1 + its drafts each

    def blocks_for(self, tokens: int) -> int: ...
    def arrival(self, i: int) -> float: ...
    def prompt_len(self, i: int) -> int: ...
    def output_len(self, i: int) -> int | None: ...   # None unless the workload marks it known
    def prefill_target(self, i: int) -> int: ...      # prompt (+ generated tokens after preemption)
    def prefill_done(self, i: int) -> int: ...
    def generated(self, i: int) -> int: ...
    def kv_tokens(self, i: int) -> int: ...
    def kv_blocks(self, i: int) -> int: ...
    def is_decoding(self, i: int) -> bool: ...        # in its decode phase (selected or paused)
    def needs_block(self, i: int) -> int: ...         # new blocks its next decode step opens (0 or 1
                                                      # without speculation: a bool)
    def spec_tokens(self, i: int) -> int: ...         # draft tokens decoder i verifies next step (0: none)
    def spec_step_blocks(self, i: int, drafts: int) -> int: ...   # new blocks its next step takes with `drafts`
    def spec_pad(self, computed: int) -> int: ...    # placeholder drafts vLLM pads a one-token admission
                                                      # after `computed` tokens with (Plan.spec); 0: none
    def spec_acceptance(self, i: int) -> float | None: ...   # accepted / drafted at its last verify step
    def tier_priority(self, i: int) -> int: ...
    def tbt_slo(self, i: int) -> float: ...           # seconds; infinity when its tier has none
    def last_token_time(self, i: int) -> float | None: ...   # None before its first token
    def cached_tokens(self, i: int) -> int: ...       # prompt tokens of a waiting request cached now
    def prefix_blocks(self, i: int) -> tuple[int, ...]: ...   # its cached prefix blocks: GPU, then each
                                                      # tier below (tier_free_blocks' order); () without caching
    def prefix_planner(self): ...                     # a HitPlanner for the plan being built, or
                                                      # None without prefix caching (sim/prefix_cache.py)


class Policy(Protocol):
    """`schedule` is required; the hooks are optional (called when the policy has them):
    on_finish(i, view) when request i finishes, on_preempt(i, view) after the replica
    preempted i for the policy's plan, on_batch_end(view) after every batch. A policy that
    raises, returns something other than a `Plan`, names an unknown request or makes no
    progress stops the run with one error naming it.

    `decodes_when_idle = True` (optional, a class attribute) promises: whenever no request
    waits or prefills on the replica and one decode step of every decoder fits in free KV,
    `schedule` returns Plan([], [], True, []) and changes nothing. The replica then runs such
    batches without calling `schedule` (back to back until something happens), exactly as
    if it had. A policy that may pause decoders, preempt early or keep per-step state in
    `schedule` must not declare it. The promise is about `schedule`: a subclass that
    overrides `schedule` loses an inherited flag unless it declares it again
    (`decodes_when_idle(policy)`).

    `plans_prefix_hits = True` (optional, a class attribute) says the policy starts a waiting
    request's first chunk after its cached prefix (`view.prefix_planner()`). The prefix
    cache's tiers (--kv-tier, docs/kv-tiers.md) load prefixes only under such a policy (a
    prefix loaded from a tier that the plan then computes from token 0 would be wasted; under
    the others the tiers are written, never read). It also promises that the policy takes
    waiting requests from `view.waiting`, which a request leaves while its prefix loads.

    `replica_local = True` (optional, a class attribute of the policy's own class, not
    inherited) promises: the policy reads nothing of other replicas (not the view's
    cluster-wide `arrivals_pending`, `next_arrival`, `issued`, `in_flight`, nor another
    replica's requests) and its copies share no state. Behind round-robin or random, its
    replica may run idle decode batches (`decodes_when_idle`) up to its own next arrival, and
    a cluster of built-in policies that promise it runs its replicas one after another
    (sim/routed_ahead.py, `run_apart`), where reading a cluster-wide figure is an error
    naming the policy (`replica_local(policy)`)."""
    name: str

    def schedule(self, view: ServerView) -> Plan: ...


def decodes_when_idle(policy) -> bool:
    """Whether the replica may skip `policy.schedule` for idle decode batches: its class (not an
    instance or a wrapper's forwarding) declares `decodes_when_idle = True`, and `schedule` is
    the one of the class that declared it (a subclass overriding it must declare it again)."""
    cls = type(policy)
    owner = defined_in(cls, "decodes_when_idle")
    return (owner is not None and owner.__dict__["decodes_when_idle"] is True
            and "schedule" not in getattr(policy, "__dict__", {})
            and getattr(cls, "schedule", None) is getattr(owner, "schedule", None))


def allocates_in_order(policy) -> bool:
    """Whether `policy` (or the policy a wrapper forwards to) declares `allocates_in_order =
    True`: its victims are the ones vLLM v1 preempts when a running request's allocation fails,
    so the replica frees each only when an allocation needs it (sim/kv_blocks.py,
    `allocate_in_order`; it matters with prefix caching). `vllm-v1` declares it."""
    return getattr(policy, "allocates_in_order", False) is True


def replica_local(policy) -> bool:
    """Whether `policy`'s own class (not a base class: a subclass may read more) declares
    `replica_local = True` (see `Policy`)."""
    return type(policy).__dict__.get("replica_local") is True


def defined_in(cls: type, name: str) -> type | None:
    """The class of `cls`'s MRO whose own body defines `name` (None: none does)."""
    return next((k for k in cls.__mro__ if name in k.__dict__), None)


NOOP_HOOKS: set = set()


def noop_hook(fn):
    """Mark a hook that does nothing: the replica need not call it (a wrapper around it, even
    one made by functools.wraps, is another function and is called)."""
    NOOP_HOOKS.add(fn)
    return fn
