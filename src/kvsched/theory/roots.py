"""A sign change's root to the last float, without scipy (importing scipy.optimize costs a
run about 0.35 s of start-up, more than the policies that need a root spend finding it)."""
from __future__ import annotations

from typing import Callable

from kvsched.errors import KvschedError


def bracketed_root(f: Callable[[float], float], lo: float, hi: float) -> float:
    """A root of f between lo < hi, where f(lo) < 0 <= f(hi), by bisection until lo and hi are
    adjacent floats (at most about 2,100 halvings, to the smallest subnormal): of the two, the
    one with the smaller |f| (lo on a tie). As exact as the floats allow; scipy's brentq, used
    here before, stops within its xtol/rtol of the root instead."""
    flo, fhi = f(lo), f(hi)
    if not (lo < hi and flo < 0 <= fhi):
        raise KvschedError(f"no sign change to bracket a root: f({lo!r}) = {flo!r}, f({hi!r}) = {fhi!r}")
    while True:
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            return lo if abs(flo) <= abs(fhi) else hi
        fm = f(mid)
        if fm != fm:
            raise KvschedError(f"the function is NaN at {mid!r}: no root can be bracketed there")
        if fm < 0:
            lo, flo = mid, fm
        else:
            hi, fhi = mid, fm
