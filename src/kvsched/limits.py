"""Upper limits on sizes a user gives, checked before anything is allocated, so a typo such
as `--replicas 1000000000` is a one-line error instead of a machine that swaps until killed.

The limits are far above what a single process can simulate usefully: raise one here if a
real deployment needs more.
"""
from __future__ import annotations

from numbers import Integral, Real

from kvsched.errors import KvschedError

MAX_REPLICAS = 10_000           # replicas in one cluster (all pools together)
MAX_SEEDS = 10_000              # seeds in one capacity search
MAX_SWEEP_POINTS = 1_000_000    # points in one sweep grid
MAX_JOBS = 1_024                # worker processes of capacity and sweep


def check_count(what: str, value, limit: int, low: int = 1) -> int:
    """`value` as an int in [low, limit], else a KvschedError naming `what` and the limit. A
    bool or a non-integral number is refused, not truncated."""
    if isinstance(value, Integral) and not isinstance(value, bool):      # numpy's integers too
        value = int(value)
    elif isinstance(value, Real) and not isinstance(value, Integral) and float(value).is_integer():
        value = int(value)
    else:
        raise KvschedError(f"{what} must be a whole number, got {value!r}")
    if value < low:
        raise KvschedError(f"{what} must be >= {low}, got {value}")
    if value > limit:
        raise KvschedError(f"{what} must be <= {limit:,} (kvsched.limits), got {value:,}")
    return value
