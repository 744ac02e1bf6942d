"""Requests and workloads, stored as arrays (one entry per request, sorted by arrival)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvsched.errors import KvschedError


@dataclass(frozen=True)
class Tier:
    """A service class: SLOs in seconds (None: no target) and a priority (lower is more urgent)."""
    name: str
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    priority: int = 0


@dataclass(frozen=True)
class Request:
    """One request, as users build them by hand; `Workload.from_requests` collects them."""
    arrival: float
    prompt_tokens: int
    output_tokens: int
    tier: Tier | None = None
    output_known: bool = False
    id: int | None = None


@dataclass(frozen=True)
class Workload:
    """Requests as arrays. Index i is request i; `ids` keeps the caller's ids.

    `output_known` says, per request, whether schedulers may see the output length
    (the fluid WAIT policy assumes they can, Nested WAIT that they cannot).
    """
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    output_known: np.ndarray
    tier_index: np.ndarray
    tiers: tuple[Tier, ...] = ()
    ids: np.ndarray = field(default=None)  # type: ignore[assignment]
    source: str = "synthetic"

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(n, dtype=np.int64))
        for name in ("prompt", "output", "output_known", "tier_index", "ids"):
            if len(getattr(self, name)) != n:
                raise KvschedError(f"workload: {name} has {len(getattr(self, name))} entries, expected {n}")
        if n and (not np.all(np.isfinite(self.arrival)) or self.arrival.min() < 0):
            raise KvschedError("workload: arrival times must be finite and >= 0")
        if n and np.any(np.diff(self.arrival) < 0):
            raise KvschedError("workload: arrivals must be sorted (use Workload.build)")
        if n and (self.prompt.min() < 1 or self.output.min() < 1):
            raise KvschedError("workload: every request needs >= 1 prompt and >= 1 output token")
        if n and self.tier_index.max(initial=-1) >= len(self.tiers):
            raise KvschedError("workload: tier index out of range")

    @classmethod
    def build(cls, arrival, prompt, output, *, output_known=False, tier_index=None,
              tiers: Sequence[Tier] = (), ids=None, source: str = "synthetic") -> "Workload":
        """Arrays in any order -> a workload sorted by arrival (stable, so ties keep order)."""
        arrival = np.asarray(arrival, dtype=np.float64)
        n = len(arrival)
        order = np.argsort(arrival, kind="stable")
        known = np.broadcast_to(np.asarray(output_known, dtype=bool), (n,))
        tix = np.full(n, -1, np.int16) if tier_index is None else np.asarray(tier_index, np.int16)
        ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
        return cls(arrival[order], np.asarray(prompt, np.int64)[order],
                   np.asarray(output, np.int64)[order], np.array(known[order]), tix[order],
                   tuple(tiers), ids[order], source)

    @classmethod
    def from_requests(cls, requests: Sequence[Request]) -> "Workload":
        tiers: list[Tier] = []
        tix = []
        for r in requests:
            if r.tier is None:
                tix.append(-1)
            else:
                if r.tier not in tiers:
                    tiers.append(r.tier)
                tix.append(tiers.index(r.tier))
        ids = [r.id if r.id is not None else k for k, r in enumerate(requests)]
        return cls.build([r.arrival for r in requests], [r.prompt_tokens for r in requests],
                         [r.output_tokens for r in requests],
                         output_known=[r.output_known for r in requests], tier_index=tix,
                         tiers=tiers, ids=ids, source="requests")

    def __len__(self) -> int:
        return len(self.arrival)

    def tier_of(self, i: int) -> Tier | None:
        t = int(self.tier_index[i])
        return None if t < 0 else self.tiers[t]
