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

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or any(ord(ch) < 32 or ch == "\x7f" for ch in self.name):
            raise KvschedError(f"tier name {self.name!r} must be non-empty, without spaces at either end, and "
                               "hold no control characters (newlines, tabs)")


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
class Ragged:
    """One integer list per request (Mooncake `hash_ids`), stored flat: request i owns
    values[offsets[i]:offsets[i + 1]]."""
    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def take(self, idx: np.ndarray) -> "Ragged":
        """The lists of requests `idx`, in that order (repeats allowed)."""
        idx = np.asarray(idx, np.int64)
        lengths = np.diff(self.offsets)[idx]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        shift = np.repeat(self.offsets[:-1][idx] - offsets[:-1], lengths)
        return Ragged(self.values[np.arange(offsets[-1], dtype=np.int64) + shift], offsets)

    @staticmethod
    def concat(parts: Sequence["Ragged"]) -> "Ragged":
        values = np.concatenate([p.values for p in parts]) if parts else np.zeros(0, np.int64)
        sizes = np.concatenate([np.diff(p.offsets) for p in parts]) if parts else np.zeros(0, np.int64)
        return Ragged(values.astype(np.int64), np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))


@dataclass(frozen=True)
class Workload:
    """Requests as arrays. Index i is request i; `ids` keeps the caller's ids.

    `output_known` says, per request, whether schedulers may see the output length
    (the fluid WAIT policy assumes they can, Nested WAIT that they cannot).
    `phase` indexes `phases` (names of the workload's consecutive phases).
    `concurrency` > 0 makes request i closed-loop: it is issued the moment fewer than
    concurrency[i] requests are in flight (`vllm bench serve --max-concurrency`), so its
    arrival time is decided by the simulation; the stored arrival is then 0. 0 = open loop.
    `prefix` keeps each prompt's prefix-block hashes when the trace has them.
    `timed` is False for lengths without arrival times (a length-only trace described by
    `kvsched workload stats`); such a workload can be described but not simulated.
    `declared_types` holds (prompt, output, rate req/s) per request type when the workload
    declares them (one open-loop phase of fixed-length types, fluid-wait-nested-wait.txt
    section 2.1), sorted by (output, prompt); None otherwise. WAIT reads its rates from here.
    """
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    output_known: np.ndarray
    tier_index: np.ndarray
    tiers: tuple[Tier, ...] = ()
    ids: np.ndarray = field(default=None)  # type: ignore[assignment]
    source: str = "synthetic"
    phase: np.ndarray = field(default=None)  # type: ignore[assignment]
    phases: tuple[str, ...] = ("all",)
    concurrency: np.ndarray = field(default=None)  # type: ignore[assignment]
    prefix: Ragged | None = None
    timed: bool = True
    declared_types: tuple[tuple[int, int, float], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(n, dtype=np.int64))
        if self.phase is None:
            object.__setattr__(self, "phase", np.zeros(n, np.int16))
        if self.concurrency is None:
            object.__setattr__(self, "concurrency", np.zeros(n, np.int64))
        for name in ("prompt", "output", "output_known", "tier_index", "ids", "phase", "concurrency"):
            if len(getattr(self, name)) != n:
                raise KvschedError(f"workload: {name} has {len(getattr(self, name))} entries, expected {n}")
        if self.prefix is not None and len(self.prefix) != n:
            raise KvschedError(f"workload: prefix has {len(self.prefix)} entries, expected {n}")
        if n and self.phase.max() >= len(self.phases):
            raise KvschedError("workload: phase index out of range")
        if n and self.concurrency.min() < 0:
            raise KvschedError("workload: concurrency must be >= 0")
        if n and self.closed_loop and self.concurrency.min() == 0:
            raise KvschedError("workload: closed-loop and open-loop requests cannot be mixed")
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
              tiers: Sequence[Tier] = (), ids=None, source: str = "synthetic", phase=None,
              phases: Sequence[str] = ("all",), concurrency=None,
              prefix: Ragged | None = None, timed: bool = True,
              declared_types: tuple[tuple[int, int, float], ...] | None = None) -> "Workload":
        """Arrays in any order -> a workload sorted by arrival (stable, so ties keep order)."""
        arrival = np.asarray(arrival, dtype=np.float64)
        n = len(arrival)
        order = np.argsort(arrival, kind="stable")

        def column(values, dtype, default):
            a = np.full(n, default, dtype) if values is None else np.asarray(values, dtype)
            return np.array(np.broadcast_to(a, (n,))[order])
        return cls(arrival[order], np.asarray(prompt, np.int64)[order],
                   np.asarray(output, np.int64)[order], column(output_known, bool, False),
                   column(tier_index, np.int16, -1), tuple(tiers),
                   np.arange(n, dtype=np.int64)[order] if ids is None else np.asarray(ids, np.int64)[order],
                   source, column(phase, np.int16, 0), tuple(phases), column(concurrency, np.int64, 0),
                   None if prefix is None else prefix.take(order), timed, declared_types)

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

    @property
    def closed_loop(self) -> bool:
        return bool(len(self.concurrency)) and int(self.concurrency.max()) > 0

    def tier_of(self, i: int) -> Tier | None:
        t = int(self.tier_index[i])
        return None if t < 0 else self.tiers[t]
