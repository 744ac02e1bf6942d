"""Arrival processes."""
from __future__ import annotations

import numpy as np

from kvsched.errors import KvschedError


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """n arrival times of a Poisson process at `rate` requests/s, the first at t = 0 + gap."""
    if not (rate > 0 and np.isfinite(rate)):
        raise KvschedError(f"--rate must be a positive number of requests per second, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))
