"""Thresholds of WAIT (known output lengths) and Nested WAIT (unknown output lengths),
fluid-wait-nested-wait.txt sections 4, 5, 6 and 7.2.

A batch takes d0 + d1 x (tokens held), eq. (1). WAIT keeps n_j type-j prompts at every
stage k = 0..l'_j. Nested WAIT groups decode stages into segments ending at l'_1 < ... < l'_m
(segment 1: stages 0..l'_1; segment i: l'_{i-1} + 1 .. l'_i) and keeps n_i prompts per stage
of segment i; segment i is fed at rate Lambda_i = sum_{j >= i} lambda_j.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kvsched.errors import KvschedError
from kvsched.theory.checks import in_range, probability
from kvsched.theory.fluid import FluidType, check_costs, load as fluid_load


def _counts(n: Sequence[float], m: int) -> np.ndarray:
    a = np.asarray(n, dtype=np.float64)
    if len(a) != m or not np.all(np.isfinite(a) & (a > 0)):
        raise KvschedError(f"need {m} positive thresholds, got {list(n)}")
    return a


# ----- WAIT (section 4) -----------------------------------------------------------------

def wait_memory(types: Sequence[FluidType], n: Sequence[float]) -> float:
    """M^pi = sum_j n_j (l'_j + 1)(l_j + l'_j / 2): memory of a batch holding n_j prompts of
    type j at every stage (eq. 9)."""
    a = _counts(n, len(types))
    return in_range("the memory M^pi (eq. 9)", lambda: sum(nj * (t.decode + 1) * (t.prompt + t.decode / 2)
                                                           for nj, t in zip(a, types)), largest_threshold=a.max())


def check_wait(types: Sequence[FluidType], n: Sequence[float], d0: float, d1: float,
               strict: bool = False) -> dict[str, object]:
    """Condition (9): Delta T = d0 + d1 M^pi <= n_j / lambda_j for every type j (strict
    '<' gives Theorem 1's O(1) latency)."""
    check_costs(d0, d1)
    dt = in_range("Delta T = d0 + d1 M^pi (eq. 9)", lambda: d0 + d1 * wait_memory(types, n), d0=d0, d1=d1)
    slack = [nj / t.rate - dt for nj, t in zip(n, types)]
    ok = all(s > 0 for s in slack) if strict else all(s >= -1e-12 for s in slack)
    return {"satisfied": ok, "iteration_time": dt, "memory": wait_memory(types, n), "slack": slack}


def solve_wait(types: Sequence[FluidType], d0: float, d1: float, strict: bool = False) -> list[int]:
    """Smallest integer thresholds on the ray n_j proportional to lambda_j that satisfy (9).

    With n_j = c lambda_j, (9) reads d0 + d1 c A <= c, A = sum_j lambda_j (l'_j + 1)(l_j +
    l'_j / 2), so c >= d0 / (1 - d1 A): the fluid time per iteration, eq. (7), and then
    M^pi = M* (eq. 6). Rounding up to integers can break (9) again, so c is raised to the
    rounded batch's time until it holds."""
    check_costs(d0, d1)
    a = fluid_load(types)
    if d1 * a >= 1:
        raise KvschedError(f"no thresholds satisfy (9): d1 x load = {d1 * a:.4g} >= 1 (unstable)")
    c = d0 / (1 - d1 * a)
    if not all(math.isfinite(t.rate * c) for t in types):
        raise KvschedError(f"the thresholds n_j = lambda_j d0 / (1 - d1 load) overflow at d0={d0:g}, d1={d1:g}")
    for _ in range(10_000):
        n = [max(1, math.ceil(t.rate * c * (1 + 1e-12) + (1e-9 if strict else 0))) for t in types]
        if check_wait(types, n, d0, d1, strict)["satisfied"]:
            return n
        c = max(c * (1 + 1e-9), d0 + d1 * wait_memory(types, n))
    raise KvschedError("could not find integer WAIT thresholds (the load is too close to 1)")


def practical_wait(types: Sequence[FluidType], batch_size: int) -> list[float]:
    """n_j = B rho_j / (l'_j + 1), rho_j = lambda_j / sum lambda (section 6.1)."""
    if batch_size < 1:
        raise KvschedError(f"batch size B must be >= 1, got {batch_size}")
    total = sum(t.rate for t in types)
    return [batch_size * (t.rate / total) / (t.decode + 1) for t in types]


# ----- Nested WAIT (sections 5 and 7.2) ---------------------------------------------------

def _segments(decodes: Sequence[float], rates: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    ends, lam = np.asarray(decodes, float), np.asarray(rates, float)
    if len(ends) == 0 or len(ends) != len(lam) or np.any(np.diff(ends) <= 0) or ends[0] < 0 or np.any(lam <= 0):
        raise KvschedError("segments need increasing decode lengths l'_1 < ... < l'_m and a rate > 0 each")
    return ends, lam


def segment_rates(rates: Sequence[float]) -> np.ndarray:
    """Lambda_i = sum_{j >= i} lambda_j: the rate at which prompts reach segment i."""
    return np.cumsum(np.asarray(rates, float)[::-1])[::-1]


def continuation(rates: Sequence[float]) -> np.ndarray:
    """p_i = Lambda_{i+1} / Lambda_i, i = 1..m-1 (eq. 10; eq. 14 with merged rates)."""
    lam = segment_rates(rates)
    return lam[1:] / lam[:-1]


def merge_types(decodes: Sequence[float], rates: Sequence[float], segments: int) -> tuple[list[float], list[float]]:
    """Section 7.2: m types into L segments of Delta L = floor(m / L) consecutive types each,
    the last taking types (L - 1) Delta L + 1 to m (the paper's partition; Delta L = m / L
    when L divides m). A segment ends at its longest type and is fed at its types' summed
    rate lambda'_i."""
    ends, lam = _segments(decodes, rates)
    m = len(ends)
    if isinstance(segments, bool) or int(segments) != segments or not 1 <= segments <= m:
        raise KvschedError(f"L = {segments} segments must be a whole number in 1..m = {m} (section 7.2)")
    size = m // int(segments)
    bounds = [i * size for i in range(int(segments))] + [m]
    return ([float(ends[b - 1]) for b in bounds[1:]],
            [float(lam[a:b].sum()) for a, b in zip(bounds, bounds[1:])])


def nested_memory(prompt: float, decodes: Sequence[float], n: Sequence[float]) -> float:
    """M^pi: memory of a batch with n_i prompts at every stage of segment i, by its
    definition in section 5.2: sum_i n_i sum_{k in segment i} (l + k).

    Deviation: eq. (11) prints sum_j n_j (l + L'_j / 2) Delta l'_j with L'_j = l'_1 + ... +
    l'_j. For segments 1 and 2 that is the stage sum up to a boundary stage (segment 1 has
    l'_1 + 1 stages, not l'_1); from segment 3 on L'_j / 2 is no longer the segment's mean
    stage and the two part. Section 7.2's closed form (l + i Delta L / 2) Delta L parts from
    the sum already at segment 2: with l = 62 and Delta L = 50, 5,600 per unit threshold
    against the exact 6,875. This uses the exact sum."""
    ends = np.asarray(decodes, float)
    a = _counts(n, len(ends))
    starts = np.concatenate(([0.0], ends[:-1] + 1))
    stages = ends - starts + 1
    return in_range("the memory M^pi (section 5.2)", lambda: np.sum(a * stages * (prompt + (starts + ends) / 2)),
                    largest_threshold=a.max())


def check_nested(prompt: float, decodes: Sequence[float], rates: Sequence[float], n: Sequence[float],
                 d0: float, d1: float) -> dict[str, object]:
    """Conditions (10) / (14): Delta T(n) = d0 + d1 M^pi < n_1 / sum lambda, and
    n_{i+1} / n_i > p_i for i < m."""
    check_costs(d0, d1)
    ends, lam = _segments(decodes, rates)
    a = _counts(n, len(ends))
    dt = in_range("Delta T = d0 + d1 M^pi (eq. 10)", lambda: d0 + d1 * nested_memory(prompt, ends, a), d0=d0, d1=d1)
    p = continuation(lam)
    ratios = a[1:] / a[:-1]
    ok = bool(dt < a[0] / lam.sum()) and bool(np.all(ratios > p))
    return {"satisfied": ok, "iteration_time": float(dt), "memory": nested_memory(prompt, ends, a),
            "p": p.tolist(), "ratios": ratios.tolist(), "first_segment_budget": float(a[0] / lam.sum())}


def solve_nested(prompt: float, decodes: Sequence[float], rates: Sequence[float], d0: float,
                 d1: float, max_first: int = 10**7) -> list[int]:
    """Small integer thresholds satisfying (10) / (14): each n_{i+1} is the least integer
    above n_i p_i, and n_1 the least value, searched upward from ceil(tau* Lambda_1) (tau* the
    fluid time per iteration, eq. 7, a lower bound), for which Delta T(n) < n_1 / sum lambda.

    Equal thresholds are allowed: Lemma 8 needs n_(k-1) > n_k only for a finite theta_k
    (eq. 16). When n_k >= n_(k-1), at most n_(k-1) prompts enter segment k per batch, so the
    number left waiting to enter it after each batch (the paper's W_(k), Lemma 7) never
    exceeds n_k and the tail term of eq. (12) is 0 (`theta` returns inf)."""
    check_costs(d0, d1)
    ends, lam = _segments(decodes, rates)
    p = continuation(lam)
    load = fluid_load([FluidType(float(r), prompt, float(e)) for r, e in zip(lam, ends)])
    if d1 * load >= 1:
        raise KvschedError(f"no Nested WAIT thresholds: d1 x load = {d1 * load:.4g} >= 1 (Proposition 1: unstable)")
    tau = d0 / (1 - d1 * load)      # eq. (7); n_1 > tau Lambda_1 since M^pi >= (n_1 / Lambda_1) x load

    def chain(n1: int) -> list[int]:
        n = [n1]
        for pi in p:
            n.append(math.floor(n[-1] * pi) + 1)
        return n
    if not tau * float(lam.sum()) <= max_first:     # n_1 > tau Lambda_1, below
        raise KvschedError(f"no Nested WAIT thresholds with n_1 <= {max_first:,}: n_1 > tau* sum lambda, and the "
                           f"fluid iteration time tau* = d0 / (1 - d1 load) is {tau:.4g} s at d0={d0:g}, d1={d1:g}")
    n1 = max(1, math.ceil(tau * lam.sum() * (1 - 1e-12)))
    while n1 <= max_first:
        n = chain(n1)
        if check_nested(prompt, ends, lam, n, d0, d1)["satisfied"]:
            return n
        # chain() grows with n_1, so Delta T does too: no n_1 up to Delta T(n) Lambda_1 can satisfy (10)
        n1 = max(n1 + 1, math.floor((d0 + d1 * nested_memory(prompt, ends, n)) * lam.sum()) + 1)
    raise KvschedError("no Nested WAIT thresholds found: the load is at or beyond capacity")


def theta(n_prev: float, n_k: float, p_k: float) -> float:
    """The theta_k > 0 solving exp(-theta n_k) (1 - p_k + p_k e^theta)^(n_{k-1}) = 1
    (eq. 16; Lemma 8: it exists, is unique and satisfies theta_k >= 8 (n_k - n_{k-1} p_k) /
    n_{k-1} when n_{k-1} > n_k > n_{k-1} p_k and 0 < p_k < 1).

    When n_k >= n_(k-1) the increments Binomial(n_(k-1), p_k) - n_k are never positive, so
    the dominating queue of Lemma 7 stays at n_k: the root is at infinity and this returns `math.inf`
    (the tail term of eq. 12 is then 0)."""
    if not (0 < p_k < 1 and n_k > n_prev * p_k):
        raise KvschedError(f"eq. (16) has a positive root only when n_k > n_(k-1) p_k and 0 < p_k < 1; "
                           f"got n_(k-1)={n_prev}, n_k={n_k}, p_k={p_k}")
    if n_k >= n_prev:
        return math.inf

    def g(th: float) -> float:          # log of the left-hand side
        return -th * n_k + n_prev * (math.log1p(-p_k) + math.log1p(p_k / (1 - p_k) * math.exp(th))
                                     if th < 700 else th + math.log(p_k))
    lo = 8 * (n_k - n_prev * p_k) / n_prev * (1 - 1e-12)
    hi = max(2 * lo, 1.0)
    while g(hi) <= 0:
        hi *= 2
    if g(lo) >= 0:                       # the bound is tight to rounding
        return lo
    from scipy.optimize import brentq    # here, not at the top: importing it costs 0.35 s of start-up
    return float(brentq(g, lo, hi, xtol=1e-14, rtol=1e-12))


def check_horizon(batches: float, delta: float) -> None:
    """Eq. (12)'s horizon and confidence: S >= 1 batches (finite) and delta in (0, 1), the
    probability that memory exceeds the bound within them."""
    if not (batches >= 1 and math.isfinite(batches)):
        raise KvschedError(f"--batches S must be a finite number of batches >= 1 (eq. 12), got {batches}")
    probability("--delta", delta, "eq. 12: memory stays under the bound with probability >= 1 - delta")


def memory_bound(prompt: float, decodes: Sequence[float], rates: Sequence[float], n: Sequence[float],
                 batches: float, delta: float, zeta: float = 1.0) -> dict[str, object]:
    """Memory that Nested WAIT stays under with probability >= 1 - delta over `batches`
    batches S (eq. 12; eq. 15 for merged segments):

        M^pi + sum_{j >= 2} (l + l'_{j-1}) (n_j + ln(m zeta S / delta) / theta_j).

    A segment with theta_j = inf (n_j >= n_(j-1)) adds no tail term."""
    ends, lam = _segments(decodes, rates)
    a = _counts(n, len(ends))
    check_horizon(batches, delta)
    if not (zeta > 0 and math.isfinite(zeta)):
        raise KvschedError(f"need a finite zeta > 0, got {zeta}")
    p = continuation(lam)
    thetas = [theta(a[j - 1], a[j], p[j - 1]) for j in range(1, len(ends))]
    log_term = math.log(len(ends)) + math.log(zeta) + math.log(batches) - math.log(delta)   # no overflow
    later = range(1, len(ends))
    queue = in_range("the queue term of eq. (12)", lambda: sum((prompt + ends[j - 1]) * a[j] for j in later),
                     largest_threshold=a.max())
    tail = in_range("the tail term of eq. (12)", lambda: sum((prompt + ends[j - 1]) * log_term / thetas[j - 1]
                                                            for j in later if math.isfinite(thetas[j - 1])),
                    batches=batches, delta=delta)
    m_pi = nested_memory(prompt, ends, a)
    total = in_range("the memory bound (eq. 12)", lambda: m_pi + queue + tail, batches=batches, delta=delta)
    return {"memory_bound": total, "M_pi": m_pi, "queue_term": queue, "tail_term": tail,
            "theta": thetas}
