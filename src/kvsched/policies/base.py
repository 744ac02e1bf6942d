"""The policy contract (ARCHITECTURE.md, "Policy"): a read-only view in, a plan out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence


@dataclass(slots=True)
class Plan:
    """What the next batch does. Applied in this order: preempt, admit, run the batch.

    preempt: running requests to preempt by recompute (KV freed, back to the queue front).
    admit:   waiting requests to start (they hold no KV until a chunk runs).
    chunks:  (request, tokens) prefill chunks for requests in their prefill phase
             (admitted ones included); the last chunk of a prefill yields an output token.
    decode:  True runs one decode token for every request in its decode phase.
    An empty plan (nothing to compute) means: wait for the next arrival.
    """
    admit: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    decode: bool = False
    preempt: list[int] = field(default_factory=list)


class ServerView(Protocol):
    """What a policy may read at a batch boundary (the server implements it; read only).

    Requests are integer ids (workload indices). Lengths are tokens; KV is counted in blocks.
    """
    now: float
    waiting: Sequence[int]            # queue, front first (preempted requests go to the front)
    running: Iterable[int]            # admitted requests, oldest admission first
    prefilling: Iterable[int]         # running requests still in their prefill phase
    num_decoding: int                 # running requests in their decode phase
    block_size: int
    kv_capacity_blocks: int
    kv_used_blocks: int
    kv_free_blocks: int
    decode_new_blocks: int            # blocks one decode step of every decoder needs
    recent_batch_times: Sequence[float]
    recent_finished: Sequence[tuple[int, int]]   # (prompt, output) of recent finishes
    cost_model: object                # the batch-time model (`time(BatchShape)`), for calibration

    def blocks_for(self, tokens: int) -> int: ...
    def arrival(self, i: int) -> float: ...
    def prompt_len(self, i: int) -> int: ...
    def output_len(self, i: int) -> int | None: ...   # None unless the workload marks it known
    def prefill_target(self, i: int) -> int: ...      # prompt (+ generated tokens after preemption)
    def prefill_done(self, i: int) -> int: ...
    def generated(self, i: int) -> int: ...
    def kv_blocks(self, i: int) -> int: ...
    def is_decoding(self, i: int) -> bool: ...
    def needs_block(self, i: int) -> bool: ...        # its next decode token opens a new block
    def tier_priority(self, i: int) -> int: ...


class Policy(Protocol):
    name: str

    def schedule(self, view: ServerView) -> Plan: ...

    def on_finish(self, i: int, view: ServerView) -> None: ...
