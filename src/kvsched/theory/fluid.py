"""The fluid benchmark of LLM inference under memory constraints
(fluid-wait-nested-wait.txt section 3).

Type j arrives at rate lambda_j with l_j prompt tokens and l'_j decode stages; a request
passes through stages k = 0 (prefill) .. l'_j holding l_j + k tokens at stage k, and each
batch takes d0 + d1 x (tokens held), eq. (1). In kvsched's simulator a request with o
output tokens has l' = o - 1 decode stages (its prefill yields the first token); `FluidType`
takes l' as the paper does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvsched.errors import KvschedError
from kvsched.theory.checks import in_range


@dataclass(frozen=True)
class FluidType:
    rate: float          # lambda_j, requests per second
    prompt: float        # l_j
    decode: float        # l'_j, decode stages

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.prompt >= 0 and self.decode >= 0) \
                or not all(map(math.isfinite, (self.rate, self.prompt, self.decode))):
            raise KvschedError(f"fluid type needs finite rate > 0, prompt >= 0, decode >= 0; got {self}")

    @property
    def work(self) -> float:
        """lambda_j (l'_j + 1)(l_j + l'_j / 2): memory-iterations type j brings per second."""
        return self.rate * (self.decode + 1) * (self.prompt + self.decode / 2)


def load(types: Sequence[FluidType]) -> float:
    """sum_j lambda_j (l'_j + 1)(l_j + l'_j / 2): the sum in the denominators of eqs. (6)-(7)."""
    if not types:
        raise KvschedError("the fluid model needs at least one request type")
    works = [in_range(f"type {j + 1}'s load lambda (l' + 1)(l + l'/2)", lambda: t.work, rate=t.rate,
                      prompt=t.prompt, decode=t.decode) for j, t in enumerate(types)]
    return in_range("the load sum_j lambda_j (l'_j + 1)(l_j + l'_j / 2)", lambda: sum(works))


def unstable(types: Sequence[FluidType], d1: float) -> bool:
    """The instability condition (Proposition 1, extended to several types as eq. (6)
    requires): d1 sum_j lambda_j (l'_j + 1)(l_j + l'_j / 2) >= 1.

    Deviation: Proposition 1 prints d0 in this condition; its own derivation (processing
    time d1 (l'_j + 1)(l_j + l'_j / 2) per prompt) and the denominators of eqs. (3) and (6)
    give d1, which is what this uses."""
    return d1 * load(types) >= 1


def check_costs(d0: float, d1: float) -> None:
    """Eq. (1)'s batch time d0 + d1 x tokens: d0 > 0 and d1 >= 0, both finite."""
    if not (d0 > 0 and d1 >= 0 and math.isfinite(d0) and math.isfinite(d1)):
        raise KvschedError(f"the fluid model needs finite d0 > 0 and d1 >= 0, got d0={d0}, d1={d1}")


def _check(types: Sequence[FluidType], d0: float, d1: float) -> float:
    check_costs(d0, d1)
    a = load(types)
    if d1 * a >= 1:
        raise KvschedError(f"no fluid equilibrium: d1 x load = {d1 * a:.4g} >= 1 (Proposition 1: unstable)")
    return a


def equilibrium_memory(types: Sequence[FluidType], d0: float, d1: float) -> float:
    """M* = d0 A / (1 - d1 A), A = sum_j lambda_j (l'_j + 1)(l_j + l'_j / 2) (eq. 6)."""
    a = _check(types, d0, d1)
    return in_range("M* = d0 A / (1 - d1 A) (eq. 6)", lambda: d0 * a / (1 - d1 * a), d0=d0, d1=d1, A=a)


def iteration_time(types: Sequence[FluidType], d0: float, d1: float) -> float:
    """Processing time per iteration in equilibrium: d0 / (1 - d1 A) = d0 + d1 M* (eq. 7)."""
    a = _check(types, d0, d1)
    return in_range("the iteration time d0 / (1 - d1 A) (eq. 7)", lambda: d0 / (1 - d1 * a), d0=d0, d1=d1, A=a)


def active_requests(types: Sequence[FluidType], d0: float, d1: float) -> list[float]:
    """n_j* = lambda_j (l'_j + 1) x time per iteration: type j's requests in each batch
    (eq. 3 for one type; section 3.2 for several)."""
    tau = iteration_time(types, d0, d1)
    return [in_range("n_j* (eq. 3)", lambda: t.rate * (t.decode + 1) * tau, rate=t.rate, decode=t.decode, d0=d0)
            for t in types]


def throughput(types: Sequence[FluidType]) -> float:
    """Throughput* = sum_j lambda_j (l'_j + 1) tokens per second (eq. 8)."""
    return in_range("Throughput* = sum_j lambda_j (l'_j + 1) (eq. 8)",
                    lambda: sum(t.rate * (t.decode + 1) for t in types))


def single_type(t: FluidType, d0: float, d1: float) -> dict[str, float]:
    """n_j*, M_j* (eq. 3) and Throughput_j* (eq. 4) of one type alone."""
    n = d0 * t.rate * (t.decode + 1) / (1 - d1 * t.work) if d1 * t.work < 1 else math.inf
    m = n * (t.prompt + t.decode / 2)
    return {"n_star": n, "M_star": m, "throughput_star": n / (d0 + d1 * m) if math.isfinite(n) else math.nan}


def capacity_fit(types: Sequence[FluidType], d0: float, d1: float, capacity: float) -> dict[str, object]:
    """Whether the fluid memory M* (eq. 6) fits a KV capacity C. M* = d0 A / (1 - d1 A) <= C
    holds exactly when A <= C / (d0 + d1 C), so the finite-memory condition depends on d0
    as well as d1 (stability alone, Proposition 1, needs only d1 A < 1)."""
    if not (capacity > 0 and math.isfinite(capacity)):
        raise KvschedError(f"--kv-capacity must be a finite number of tokens > 0, got {capacity}")
    check_costs(d0, d1)
    a = load(types)
    max_load = capacity / (d0 + d1 * capacity)
    return {"kv_capacity": capacity, "fits": a <= max_load, "max_load": max_load}


def summary(types: Sequence[FluidType], d0: float, d1: float) -> dict[str, object]:
    """M_star, iteration_time, throughput_star and stable, as `kvsched theory fluid` prints."""
    check_costs(d0, d1)
    if unstable(types, d1):
        return {"M_star": math.inf, "iteration_time": math.inf, "throughput_star": throughput(types),
                "stable": False, "load": load(types), "n_star": [math.inf] * len(types)}
    return {"M_star": equilibrium_memory(types, d0, d1), "iteration_time": iteration_time(types, d0, d1),
            "throughput_star": throughput(types), "stable": True, "load": load(types),
            "n_star": active_requests(types, d0, d1)}
