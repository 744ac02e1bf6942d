"""Synthetic workloads: one request type, or a mixture of types with their own rates."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import poisson_arrivals
from kvsched.workload.lengths import LengthDist
from kvsched.workload.request import Tier, Workload


@dataclass(frozen=True)
class RequestType:
    """A request type of fluid-wait-nested-wait.txt (section 3): prompt length l_j, output
    length l'_j (here distributions; Fixed gives the paper's deterministic types) and an
    arrival rate lambda_j."""
    prompt: LengthDist
    output: LengthDist
    rate: float
    tier: Tier | None = None


def synthetic(prompt: LengthDist, output: LengthDist, rate: float, n: int, seed: int = 0,
              output_known: bool = False, tier: Tier | None = None) -> Workload:
    """n requests with Poisson arrivals at `rate` and independent prompt/output lengths."""
    return mixture([RequestType(prompt, output, rate, tier)], n, seed, output_known)


def mixture(types: Sequence[RequestType], n: int, seed: int = 0,
            output_known: bool = False) -> Workload:
    """Superposed Poisson streams: a Poisson process at sum(rate_j) whose arrivals are of
    type j with probability rate_j / sum(rate) (the same law as independent streams)."""
    if not types:
        raise KvschedError("mixture needs at least one request type")
    if n < 1:
        raise KvschedError(f"--num-requests must be >= 1, got {n}")
    rates = np.array([t.rate for t in types], dtype=float)
    if not np.all(rates > 0):
        raise KvschedError(f"every request type needs a rate > 0, got {rates.tolist()}")
    rng = np.random.default_rng(seed)
    arrival = poisson_arrivals(rng, float(rates.sum()), n)
    kind = rng.choice(len(types), size=n, p=rates / rates.sum()) if len(types) > 1 else np.zeros(n, int)
    prompt = np.empty(n, np.int64)
    output = np.empty(n, np.int64)
    tiers = [t.tier for t in types if t.tier is not None]
    tiers = list(dict.fromkeys(tiers))
    tier_index = np.full(n, -1, np.int16)
    for j, t in enumerate(types):
        mask = kind == j
        k = int(mask.sum())
        prompt[mask] = t.prompt.sample(rng, k)
        output[mask] = t.output.sample(rng, k)
        if t.tier is not None:
            tier_index[mask] = tiers.index(t.tier)
    return Workload.build(arrival, prompt, output, output_known=output_known,
                          tier_index=tier_index, tiers=tiers, source="synthetic")
