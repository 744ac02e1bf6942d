"""Domain checks shared by the closed forms: a parameter outside its formula's domain, or a
result beyond the floating-point range, is a one-line KvschedError naming the parameters
instead of a nan, an inf, a numpy warning or a traceback."""
from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np

from kvsched.errors import KvschedError


def positive(**values: float) -> None:
    """Each value a finite number > 0."""
    for name, v in values.items():
        if not (v > 0 and math.isfinite(v)):
            raise KvschedError(f"{name} must be a positive number, got {v}")


def nonnegative(**values: float) -> None:
    """Each value a finite number >= 0."""
    for name, v in values.items():
        if not (v >= 0 and math.isfinite(v)):
            raise KvschedError(f"{name} must be a finite number >= 0, got {v}")


def finite(**values: float) -> None:
    """Each value a finite number."""
    for name, v in values.items():
        if not math.isfinite(v):
            raise KvschedError(f"{name} must be a finite number, got {v}")


def probability(name: str, v: float, meaning: str, one: bool = False) -> None:
    """v in (0, 1), or (0, 1] with `one`; `meaning` says what the probability is."""
    if not (0 < v < 1 or (one and v == 1)):
        raise KvschedError(f"{name} must be a probability in (0, 1{']' if one else ')'} ({meaning}), got {v}")


def in_range(what: str, compute: Callable[[], float], *, nonzero: bool = False, **inputs: float) -> float:
    """compute() as a float, or an error naming `what` and its inputs when the true value is
    beyond the float range: an overflow (inf, nan, ZeroDivisionError, OverflowError; numpy's
    warnings silenced) or, with `nonzero`, a positive quantity below the smallest normal float."""
    try:
        with np.errstate(all="ignore"):
            v = float(compute())
    except (ZeroDivisionError, OverflowError):
        v = math.inf
    if not math.isfinite(v) or (nonzero and abs(v) < sys.float_info.min):
        given = ", ".join(f"{k}={x:g}" for k, x in inputs.items())
        raise KvschedError(f"{what} is beyond the floating-point range" + (f" at {given}" if given else ""))
    return v
