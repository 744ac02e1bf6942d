"""Synthetic workloads: one request type, or a mixture of types with their own rates."""
from __future__ import annotations

from typing import Sequence

from kvsched.workload.lengths import LengthDist
from kvsched.workload.request import Tier, Workload
from kvsched.workload.spec import Phase, RequestType, WorkloadSpec


def synthetic(prompt: LengthDist, output: LengthDist, rate: float, n: int, seed: int = 0,
              output_known: bool = False, tier: Tier | None = None) -> Workload:
    """n requests with Poisson arrivals at `rate` and independent prompt/output lengths."""
    return mixture([RequestType(prompt, output, rate, tier)], n, seed, output_known)


def mixture(types: Sequence[RequestType], n: int, seed: int = 0,
            output_known: bool = False) -> Workload:
    """Superposed Poisson streams: a Poisson process at sum(rate_j) whose arrivals are of
    type j with probability rate_j / sum(rate) (the same law as independent streams)."""
    return WorkloadSpec((Phase(n, tuple(types)),), seed=seed, output_known=output_known,
                        name="synthetic").build()
