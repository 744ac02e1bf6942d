"""Routers: which replica an arriving request goes to (`--router NAME`).

A router sees, for every replica, a read-only `ReplicaSummary` as of the arrival time
(during a batch: the replica's state at the batch start plus the requests routed to it
since). The state-based routers break ties in round-robin order, so an idle cluster
spreads requests instead of piling them on replica 0.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import random
from typing import Any, NamedTuple, Protocol, Sequence

from kvsched.errors import PASS_THROUGH, KvschedError
from kvsched.params import check_range, convert, type_name
from kvsched.plugins import resolve


class ReplicaSummary(NamedTuple):
    index: int
    outstanding: int            # requests waiting or running there
    kv_used_blocks: int
    kv_capacity_blocks: int
    prefill_backlog: int        # prefill tokens queued there (waiting + unfinished prefills)
    cached_tokens: int = 0      # prompt tokens of the arriving request cached there (routers with uses_prefix)
    kind: str = ""              # the replica's kind in a cluster of pools ("NAME: GPU tp=N ..."; pools.py)
    lora: int = 2               # the arriving request's LoRA adapter there: 2 resident (or no adapter), 1 a slot
                                # to load it into, 0 no free slot (sim/lora.py)


class Router(Protocol):
    name: str
    uses_state: bool            # False: route() gets no summaries (cheaper)
    # uses_prefix (optional, default False): summaries carry the request's cached prompt tokens

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


class PrefixAffinity:
    """Route to the replica with the best weighted score of prefix affinity and load, as the
    scorer-based cluster routers do (llm-d's inference scheduler, Dynamo's KV router):

        score = w_affinity * cached / prompt  +  w_queue * (q_max - q) / (q_max - q_min)
                + w_kv * (1 - KV used / capacity)

    where cached is the arriving request's prompt tokens already cached on the replica (its
    expected hit), q the requests outstanding there (the queue term is 1 everywhere when all
    are equal). The load terms guard against piling every request sharing a prefix on one
    replica. Highest score wins; ties go round-robin. Without prefix caching the affinity
    term is 0 and it routes on load alone."""
    name, uses_state, uses_prefix = "prefix-affinity", True, True

    def __init__(self, seed: int = 0, w_affinity: float = 3.0, w_queue: float = 2.0, w_kv: float = 2.0) -> None:
        for label, w in (("w_affinity", w_affinity), ("w_queue", w_queue), ("w_kv", w_kv)):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
                raise KvschedError(f"router prefix-affinity: {label} must be a finite number >= 0, got {w!r}")
        self.weights = (w_affinity, w_queue, w_kv)
        self._next = 0

    def route(self, i: int, t: float, replicas: Sequence[ReplicaSummary], prompt: int = 1) -> int:
        wa, wq, wk = self.weights
        qs = [r.outstanding for r in replicas]
        q_lo, q_hi = min(qs), max(qs)
        span = q_hi - q_lo
        n = len(replicas)
        start = self._next % n
        best, best_s = start, -1.0
        for k in range(n):
            j = (start + k) % n
            r = replicas[j]
            s = (wa * r.cached_tokens / max(prompt, 1) + wq * ((q_hi - r.outstanding) / span if span else 1.0)
                 + wk * (1 - r.kv_used_blocks / r.kv_capacity_blocks))
            if s > best_s:
                best, best_s = j, s
        self._next = start + 1
        return best


class LoraAffinity:
    """Adapter-aware routing, as the Gateway API Inference Extension's scheduler filters its pods
    (gateway-api-inference-extension, pkg/epp/scheduling: a queue filter, then LoRA affinity,
    then least queue): among the replicas within `slack` outstanding requests of the least
    loaded, those where the request's adapter is resident, else those with a free adapter slot
    (`ReplicaSummary.lora`, sim/lora.py), else all of them; then the fewest outstanding, ties
    round-robin. Without adapters it is least-outstanding."""
    name, uses_state = "lora-affinity", True

    def __init__(self, seed: int = 0, slack: int = 8) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise KvschedError(f"router lora-affinity: slack must be a whole number >= 0, got {slack!r}")
        self.slack = slack
        self._next = 0

    def route(self, i: int, t: float, replicas: Sequence[ReplicaSummary]) -> int:
        n = len(replicas)
        low = min(r.outstanding for r in replicas) + self.slack
        best_state = max(r.lora for r in replicas if r.outstanding <= low)
        start = self._next % n
        self._next = start + 1
        best, best_q = -1, 0
        for k in range(n):
            j = (start + k) % n
            r = replicas[j]
            if r.outstanding <= low and r.lora == best_state and (best < 0 or r.outstanding < best_q):
                best, best_q = j, r.outstanding
        return best


ROUTERS: dict[str, type] = {cls.name: cls for cls in (RoundRobin, RandomRouter, LeastOutstanding, LeastKV,
                                                       LeastPrefill, PrefixAffinity, LoraAffinity)}
ROUTER_HELP = {
    "round-robin": "replicas in turn",
    "random": "uniform at random (seeded by --seed)",
    "least-outstanding": "fewest requests waiting or running",
    "least-kv": "least KV in use",
    "least-prefill": "fewest queued prefill tokens",
    "prefix-affinity": "weighted score: cached prompt prefix, requests outstanding, KV use",
    "lora-affinity": "replicas holding the request's LoRA adapter (else a free slot), then fewest outstanding",
}


def router_class(name: str) -> type:
    """The class `--router NAME` names: a built-in, an installed plugin, or MODULE:CLASS /
    FILE.py:CLASS (kvsched/plugins.py)."""
    return resolve(name, "router", ROUTERS, "route")


def router_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """A router's parameters (`--router-set`): its constructor's keywords after `seed`."""
    sig = inspect.signature(cls.__init__)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in list(sig.parameters.values())[1:] if p.kind in kinds and p.name != "seed"}


def make_router(name: str, seed: int = 0, params: dict[str, Any] | None = None) -> Router:
    """Router `name` seeded with `seed`, its parameters set from `params`: strings converted to
    the type its constructor's annotation or default names, numbers finite, and within the
    `range` of a dataclass field's metadata where it has one; nothing is clamped."""
    cls = router_class(name)
    known = router_parameters(cls)
    ranges = {f.name: f.metadata["range"] for f in dataclasses.fields(cls)
              if "range" in f.metadata} if dataclasses.is_dataclass(cls) else {}
    owner, values = f"router {name}", {}
    for key, value in (params or {}).items():
        if key not in known:
            raise KvschedError(f"{owner} has no parameter {key!r} (parameters: {', '.join(known) or 'none'})")
        p = known[key]
        kind = type_name(p.annotation)
        if p.annotation is inspect.Parameter.empty and p.default is not inspect.Parameter.empty:
            kind = type(p.default).__name__
        v = values[key] = convert(owner, key, value, kind)
        if isinstance(v, float) and not math.isfinite(v):
            raise KvschedError(f"{owner}: {key}={v!r} must be a finite number")
        if key in ranges:
            check_range(owner, key, v, kind, ranges[key])
    try:
        router = cls(seed, **values)
    except KvschedError:
        raise
    except PASS_THROUGH:
        raise
    except BaseException as exc:
        raise KvschedError(f"router {name}: {type(exc).__name__}: {exc}") from None
    for attr in ("name", "uses_state"):
        if not hasattr(router, attr):
            raise KvschedError(f"router {name}: {cls.__name__} needs a {attr!r} attribute (sim/routers.py, Router)")
    return router
