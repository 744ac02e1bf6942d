"""Swap preemption to a host-memory tier (issue "The KV memory hierarchy", item 3;
docs/kv-tiers.md): a preempted decoder's KV is copied to host memory over the GPU's host link
and copied back when it resumes, instead of being recomputed.

The reference is vLLM v0's scheduler (vllm/core/scheduler.py, v0.6: `_preempt` with
PreemptionMode.SWAP, `_preempt_by_swap`, `_swap_out`, `_schedule_swapped`, `_swap_in`; the
copies by `CacheEngine.swap_out` / `swap_in`). kvsched departs from it where its engine works
otherwise, each on purpose:
- **Only decoding victims swap.** A victim still prefilling recomputes (v0 swaps a running
  sequence group whatever its phase).
- **The copies overlap the batches.** v0 runs a step's swaps before its forward pass. Here
  the victim's GPU blocks are freed at the batch's start (as the policy's plan assumes), the
  copy-out holds the device-to-host link, and the copy-in the host-to-device link. The
  request waits for them; other requests keep running.
- **Resumption.** At every step's start the swapped requests, oldest first, get GPU room
  beside the decoders and one decode step of them all (`Replica.reserve`, the rule of a
  disaggregated landing) before the policy plans. v0 schedules the swapped queue before new
  prefills and admits no new prefill while any request is swapped out: kvsched's `vllm-v0`
  does the same through the view's `swapped`; other policies may still admit into what is
  left.
- **A full host tier** falls back to recompute for that victim and counts it (`fallbacks`).
  v0 raises an error ("lack of CPU swap space").
- **The GPU blocks are reused during the copy-out.** They are freed at the batch's start
  (the policy's plan counts on the room), while the copy to host holds the link afterwards.
  v0 finishes the copy before the step's forward pass reuses them, so a step that swaps out
  takes longer there; kvsched charges the copy to the victim's wait only. A copy-in starts
  only once the copy-out has reached host, and GPU room is reserved for it only then.

Each copy moves whole blocks, blocks x block size x KV bytes per token, on a FIFO link
(sim/transfer.py, `KVLink`): it starts when the link is free and the data is ready, holds the
link for bytes / bandwidth, and lands `latency` later. The two directions are separate links
(PCIe is full duplex).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from kvsched.errors import KvschedError
from kvsched.sim.transfer import KVLink

TIER_KINDS = ("host", "disk", "remote")
MIN_GBPS = 1e-6                 # 1 kB/s: slower links leave the simulated times' range


@dataclass(frozen=True)
class TierSpec:
    """One `--kv-tier KIND:GB:GBps[:latency_s]`: its capacity (1e9 bytes), its link's
    bandwidth per direction (GB/s, 1e9 bytes) and latency (s)."""
    kind: str
    gb: float
    gbps: float
    latency_s: float = 0.0

    def describe(self) -> str:
        return f"{self.kind}:{self.gb:g}:{self.gbps:g}:{self.latency_s:g}"


def parse_kv_tier(text: str) -> TierSpec:
    """--kv-tier KIND:GB:GBps[:latency_s] (docs/kv-tiers.md)."""
    if not isinstance(text, str):
        raise KvschedError(f"--kv-tier must be text KIND:GB:GBps[:latency_s], got {text!r}")
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in TIER_KINDS:
        raise KvschedError(f"--kv-tier {text!r}: write KIND:GB:GBps[:latency_s] with KIND one of "
                           f"{', '.join(TIER_KINDS)} (e.g. host:256:25:0.00001)")
    values = []
    for name, part in zip(("GB", "GBps", "latency_s"), parts[1:]):
        try:
            v = float(part)
        except ValueError:
            raise KvschedError(f"--kv-tier {text!r}: {name} must be a number, got {part!r}") from None
        low = {"GB": 0.0, "GBps": MIN_GBPS, "latency_s": 0.0}[name]
        if not math.isfinite(v) or v < low or (name == "GB" and v <= 0) or v > 1e9:
            raise KvschedError(f"--kv-tier {text!r}: {name} must be a finite number "
                               f"{'>= 0' if name == 'latency_s' else '> 0' if name == 'GB' else f'>= {MIN_GBPS:g}'} "
                               f"(at most 1e9), got {part!r}")
        values.append(v)
    return TierSpec(parts[0], *values)


class HostSwap:
    """One replica's host tier for swapped KV and its two links (module docstring)."""

    def __init__(self, spec: TierSpec, block_bytes: int) -> None:
        self.spec = spec
        self.block_bytes = block_bytes
        self.capacity_blocks = int(spec.gb * 1e9 // block_bytes)
        self.d2h, self.h2d = KVLink(spec.gbps, spec.latency_s), KVLink(spec.gbps, spec.latency_s)
        self.used = 0                               # host blocks holding swapped KV
        self.out: deque[int] = deque()              # swapped out, waiting for GPU room (oldest first)
        self.ready: dict[int, float] = {}           # request -> when its copy-out reaches host
        self.inflight: list[tuple[float, int, int]] = []    # (lands on GPU, sequence, request)
        self.parked: deque[int] = deque()           # back on the GPU, waiting for a seat (max_num_seqs)
        self.blocks: dict[int, int] = {}            # request -> its host blocks
        self.swapped_at: dict[int, float] = {}      # request -> when it was swapped out
        self._seq = 0
        self.outs = self.ins = self.fallbacks = 0
        self.bytes_in = self.bytes_out = 0          # into host (swap-outs), out of host (swap-ins)
        self.wait_s = 0.0                           # swap-out to back on the GPU, summed

    def busy(self) -> bool:
        return bool(self.out or self.inflight or self.parked)

    def tick(self, rep) -> bool:
        from kvsched.sim.lifecycle import swap_tick
        return swap_tick(rep)

    def wake(self, rep) -> float:
        from kvsched.sim.lifecycle import swap_wake
        return swap_wake(rep)

    def pending(self) -> int:
        """Swapped requests that will take a seat: copying in, or back and waiting for one."""
        return len(self.inflight) + len(self.parked)

    def fits(self, blocks: int) -> bool:
        return self.used + blocks <= self.capacity_blocks

    def copy_out(self, i: int, blocks: int, t: float) -> None:
        """Request i's `blocks` leave the GPU at t for host memory."""
        nbytes = blocks * self.block_bytes
        self.used += blocks
        self.blocks[i] = blocks
        self.out.append(i)
        self.ready[i] = self.d2h.send(t, nbytes)
        self.swapped_at[i] = t
        self.outs += 1
        self.bytes_in += nbytes

    def copy_in(self, i: int, t: float) -> None:
        """Request i's KV (its GPU room reserved at t) is copied back once it is on host."""
        ready = self.ready.pop(i)
        land = self.h2d.send(ready if ready > t else t, self.blocks[i] * self.block_bytes)
        heapq.heappush(self.inflight, (land, self._seq, i))
        self._seq += 1

    def drop(self, i: int) -> None:
        """Swapped-out request i gives up its host copy (it will recompute instead)."""
        self.used -= self.blocks.pop(i)
        self.ready.pop(i)
        self.swapped_at.pop(i)
        self.fallbacks += 1

    def landed(self, now: float) -> list[int]:
        """The requests whose copy-in has landed by `now` (their host blocks freed)."""
        done = []
        while self.inflight and self.inflight[0][0] <= now:
            land, _, i = heapq.heappop(self.inflight)
            b = self.blocks.pop(i)
            self.used -= b
            self.ins += 1
            self.bytes_out += b * self.block_bytes
            self.wait_s += land - self.swapped_at.pop(i)
            done.append(i)
        return done

    def link_busy(self) -> float:
        """Seconds either link was busy (both directions summed)."""
        return self.d2h.busy + self.h2d.busy
