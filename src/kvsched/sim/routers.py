"""Routers: which replica an arriving request goes to (`--router NAME`).

A router sees, for every replica, a read-only `ReplicaSummary` as of the arrival time
(during a batch: the replica's state at the batch start plus the requests routed to it
since). The state-based routers break ties in round-robin order, so an idle cluster
spreads requests instead of piling them on replica 0.
"""
from __future__ import annotations

import random
from typing import NamedTuple, Protocol, Sequence

from kvsched.errors import KvschedError


class ReplicaSummary(NamedTuple):
    index: int
    outstanding: int            # requests waiting or running there
    kv_used_blocks: int
    kv_capacity_blocks: int
    prefill_backlog: int        # prefill tokens queued there (waiting + unfinished prefills)


class Router(Protocol):
    name: str
    uses_state: bool            # False: route() gets no summaries (cheaper)

    def route(self, i: int, t: float, replicas: Sequence[ReplicaSummary] | int) -> int: ...


class RoundRobin:
    name, uses_state = "round-robin", False

    def __init__(self, seed: int = 0) -> None:
        self._next = 0

    def route(self, i: int, t: float, replicas: int) -> int:
        k = self._next % replicas
        self._next = k + 1
        return k


class RandomRouter:
    """Uniform over replicas, seeded (the same seed routes the same way)."""
    name, uses_state = "random", False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, i: int, t: float, replicas: int) -> int:
        return self._rng.randrange(replicas)


class _Least:
    """The replica with the least `key`; ties go round-robin."""
    uses_state = True
    column = 0

    def __init__(self, seed: int = 0) -> None:
        self._next = 0

    def route(self, i: int, t: float, replicas: Sequence[ReplicaSummary]) -> int:
        n = len(replicas)
        start = self._next % n
        best, best_v = start, replicas[start][self.column]
        for k in range(1, n):
            j = (start + k) % n
            v = replicas[j][self.column]
            if v < best_v:
                best, best_v = j, v
        self._next = start + 1
        return best


class LeastOutstanding(_Least):
    name, column = "least-outstanding", 1


class LeastKV(_Least):
    name, column = "least-kv", 2


class LeastPrefill(_Least):
    name, column = "least-prefill", 4


ROUTERS: dict[str, type] = {cls.name: cls for cls in (RoundRobin, RandomRouter, LeastOutstanding, LeastKV,
                                                       LeastPrefill)}
ROUTER_HELP = {
    "round-robin": "replicas in turn",
    "random": "uniform at random (seeded by --seed)",
    "least-outstanding": "fewest requests waiting or running",
    "least-kv": "least KV in use",
    "least-prefill": "fewest queued prefill tokens",
}


def make_router(name: str, seed: int = 0) -> Router:
    try:
        return ROUTERS[name](seed)
    except KeyError:
        raise KvschedError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}") from None
