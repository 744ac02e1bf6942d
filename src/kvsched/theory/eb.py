"""Exclusive batching EB(k) closed forms (exclusive-batching-eb.txt section 3, appendix D).

N slots; a decode phase runs until k = theta N requests finish, then one prefill batch
refills them. Prefill time alpha_p + beta_p x tokens, decode iteration alpha_d + beta_d x n,
a mixed batch alpha_MB + beta_MB^e x tokens. Output lengths have hazard rate h(t), p0 =
h under CFR (geometric outputs, mu_O = 1 / p0), h(t) = p0 + eta t under IFR.
"""
from __future__ import annotations

import math

import numpy as np

from kvsched.errors import KvschedError
from kvsched.theory.checks import finite, in_range, nonnegative, positive, probability
from kvsched.theory.roots import bracketed_root
from kvsched.workload.lengths import MAX_TOKENS


def check_p0(p0: float) -> None:
    """p0 is a probability: the chance that a decoding request finishes at an iteration,
    h(t) = P(O = t | O >= t) under CFR (section 3.2; appendix B's Binomial(N_t, p0)
    completions). Checked where a user gives it; a fitted intercept is used as it comes."""
    probability("--p0", p0, "the completion hazard per decode iteration, 1 / mean output under CFR", one=True)


def check_batch_size(batch_size: float) -> None:
    """N, the request slots of a batch (section 3): 1..MAX_TOKENS. Each slot holds at least
    one KV token, so a larger N fits no KV cache (kvsched's token counts stop at MAX_TOKENS);
    it also keeps k0* = floor(theta0 N), the requests that end a decode phase (section 3.2),
    a count of requests, not a 300-digit integer."""
    if not 1 <= batch_size <= MAX_TOKENS:
        raise KvschedError(f"the batch size N (--batch-size) must be 1..{MAX_TOKENS:,} request slots "
                           f"(each holds at least one KV token), got {batch_size:.15g}")


def check_kv_capacity(kv_capacity: float) -> None:
    """C, KV tokens: a finite number > 0 up to MAX_TOKENS (beyond it N* is a meaningless giant)."""
    positive(kv_capacity=kv_capacity)
    if kv_capacity > MAX_TOKENS:
        raise KvschedError(f"the KV capacity C (--kv-capacity) must be at most {MAX_TOKENS:,} tokens, "
                           f"got {kv_capacity:.15g}")


def theta0(p0: float, alpha_p: float, alpha_d: float) -> float:
    """The CFR base threshold: the unique theta0 in (0, 1) with
    theta0 / (1 - theta0) + ln(1 - theta0) = p0 alpha_p / alpha_d (eq. 3, Proposition 3.1).
    The left side is 0 at 0, strictly increasing (derivative theta / (1 - theta)^2) and
    unbounded, so the root exists and is unique, and it grows with p0 alpha_p / alpha_d."""
    positive(p0=p0, alpha_p=alpha_p, alpha_d=alpha_d)
    rhs = in_range("p0 alpha_p / alpha_d (eq. 3)", lambda: p0 * alpha_p / alpha_d, nonzero=True,
                   p0=p0, alpha_p=alpha_p, alpha_d=alpha_d)

    def f(x: float) -> float:
        return _cfr_lhs(x) - rhs
    hi = 1 - 1e-16
    if f(hi) < 0:                        # only for astronomically large ratios
        raise KvschedError(f"p0 alpha_p / alpha_d = {rhs:.4g} is too large: theta0 rounds to 1")
    th = bracketed_root(f, 0.0, hi)      # f(0) = -rhs < 0
    if th <= 0:
        raise KvschedError(f"p0 alpha_p / alpha_d = {rhs:.4g} is too small: theta0 rounds to 0")
    return th


SERIES_BELOW = 0.1       # _cfr_lhs sums its series below this theta (about 17 terms at most)


def _cfr_lhs(x: float) -> float:
    """theta / (1 - theta) + ln(1 - theta), eq. (3)'s left side. Below SERIES_BELOW, where its
    two terms cancel to about theta^2 / 2 (and rounding would leave noise that a root search
    takes for a root), as its Taylor series sum_{k>=2} (1 - 1/k) theta^k, summed while a term
    adds to the sum."""
    if x >= SERIES_BELOW:
        return x / (1 - x) + math.log1p(-x)
    power, total, k = x * x, 0.0, 2
    while True:
        term = power * (k - 1) / k
        if total + term == total:
            return total
        total += term
        power *= x
        k += 1


def zeta(theta: float) -> float:
    """zeta = -ln(1 - theta0) (section 3.2.1)."""
    return -math.log1p(-theta)


def delta_theta(theta_0: float, p0: float, eta: float, alpha_d: float, beta_d: float, batch_size: float) -> float:
    """The IFR correction (eq. 5, Theorem 3.2) for h(t) = p0 + eta t:
    Delta theta = eta (1 - theta0)^2 / (p0^2 theta0) [zeta (theta0 / (1 - theta0) - zeta / 2)
    + (beta_d N / alpha_d) (zeta - theta0)], positive for eta > 0. The expansion is linear in
    eta, so a fitted eta < 0 (decreasing hazard) gives a negative correction."""
    positive(p0=p0, alpha_d=alpha_d, batch_size=batch_size)
    finite(eta=eta)
    nonnegative(beta_d=beta_d)
    if batch_size < 1 or not 0 < theta_0 < 1:
        raise KvschedError(f"need a batch size N >= 1 (slots) and 0 < theta0 < 1, got N={batch_size}, theta0={theta_0}")
    check_batch_size(batch_size)        # its upper bound
    z = zeta(theta_0)
    duration = z * (theta_0 / (1 - theta_0) - z / 2)

    def correction() -> float:
        per_token = beta_d * batch_size / alpha_d * (z - theta_0)
        return eta * (1 - theta_0) ** 2 / (p0 ** 2 * theta_0) * (duration + per_token)
    return in_range("delta_theta (eq. 5)", correction, p0=p0, eta=eta, beta_d=beta_d, batch_size=batch_size)


def _memory_per_slot(theta: float, p0: float, mu_l: float) -> float:
    """mu_L + (1 - theta) / (theta p0) ln(1 / (1 - theta)): expected KV per slot at the start
    of a decode phase (appendix D.2, E[X_0] / N)."""
    return mu_l + (1 - theta) / (theta * p0) * zeta(theta)


def implied_prefill_overhead(theta: float, p0: float, alpha_d: float) -> float:
    """The prefill-phase overhead alpha_p for which theta is eq. (3)'s theta0:
    alpha_p = alpha_d (theta / (1 - theta) + ln(1 - theta)) / p0 (eq. 3 solved for alpha_p).
    Applied to a measured best theta it gives the per-phase cost the hardware really pays."""
    if not (0 < theta < 1 and p0 > 0 and alpha_d > 0):
        raise KvschedError(f"need 0 < theta < 1, p0 > 0 and alpha_d > 0, got {theta}, {p0}, {alpha_d}")
    return alpha_d * (theta / (1 - theta) + math.log1p(-theta)) / p0


def implied_mean_output(p0: float, eta: float) -> float:
    """Mean output length implied by the fitted hazard h(t) = p0 + eta t (section 3.4):
    E[O] = integral of exp(-p0 t - eta t^2 / 2) dt = sqrt(pi / (2 eta)) erfcx(p0 / sqrt(2 eta))
    for eta > 0, 1 / p0 for eta <= 0 (a falling hazard is taken as flat: it cannot fall
    below 0 for ever). Used to judge whether a fit is plausible, not in the paper."""
    if not p0 > 0:
        return math.inf
    if eta <= 0:
        return 1.0 / p0
    return math.sqrt(math.pi / (2 * eta)) * erfcx(p0 / math.sqrt(2 * eta))


ERFCX_SERIES_FROM = 26.0        # exp(x^2) overflows just above 26.6


def erfcx(x: float) -> float:
    """The scaled complementary error function exp(x^2) erfc(x), for x >= 0, without scipy
    (its import costs a run 0.2 s): below ERFCX_SERIES_FROM as that product (relative error
    about 2 x^2 ulp, under 2e-13), above it by the asymptotic series 1 / (x sqrt(pi)) *
    sum_k (-1)^k (2k - 1)!! / (2 x^2)^k (Abramowitz & Stegun 7.1.23), summed while its terms
    shrink past 1e-17. tests/test_theory.py compares it with scipy.special.erfcx."""
    if not x >= 0:
        raise KvschedError(f"erfcx needs x >= 0, got {x!r}")
    if x < ERFCX_SERIES_FROM:
        return math.exp(x * x) * math.erfc(x)
    if x == math.inf:
        return 0.0
    u = 1.0 / (2.0 * x * x)
    term, total, k = 1.0, 1.0, 1
    while abs(term) > 1e-17:
        term *= -(2 * k - 1) * u
        total += term
        k += 1
    return total / x / math.sqrt(math.pi)      # in that order: x * sqrt(pi) overflows near the largest float


def batch_sizes(kv_capacity: float, p0: float, mu_l: float, theta: float, eps: float) -> dict[str, int | float]:
    """Memory-safe batch sizes (appendix D.5): with v = 1 / (p0^2 mu_L) (appendix D.4),
        N*          = floor((C - v ln(1/eps)) / (mu_L + (1 - theta)/(theta p0) ln(1/(1 - theta))))  (eq. 6)
        N_expected  = floor((C - v) / (same))
        N_static    = floor(C / (same)).
    N* <= N_expected <= N_static holds when ln(1/eps) >= 1, i.e. eps <= 1/e."""
    check_kv_capacity(kv_capacity)
    positive(p0=p0, mu_l=mu_l)
    if not 0 < theta < 1 or not 0 < eps < 1:
        raise KvschedError(f"need 0 < theta < 1 and 0 < eps < 1, got theta={theta}, eps={eps}")
    given = {"kv_capacity": kv_capacity, "p0": p0, "mu_l": mu_l, "theta": theta}
    per_slot = in_range("the memory per slot (appendix D.2)", lambda: _memory_per_slot(theta, p0, mu_l), **given)
    v = in_range("v_bar = 1 / (p0^2 mu_L) (appendix D.4)", lambda: 1.0 / (p0 ** 2 * mu_l), **given)

    def size(what: str, memory: float) -> int:      # a floor of inf is an error, not a traceback
        return 0 if memory <= 0 else math.floor(in_range(what, lambda: memory / per_slot, **given))
    return {"n_star": size("n_star (eq. 6)", kv_capacity + v * math.log(eps)),
            "n_expected": size("n_expected", kv_capacity - v), "n_static": size("n_static", kv_capacity),
            "v_bar": v, "memory_per_slot": per_slot}


def throughput_eb(k: float, alpha_p: float, alpha_d: float, beta_p: float, beta_d: float,
                  mu_l: float, mu_o: float, theta: float) -> float:
    """TP_EB = [(alpha_p + alpha_d zeta mu_O) / k + beta_EB^w (mu_L + mu_O)]^-1 requests per
    second, beta_EB^w (mu_L + mu_O) = beta_p mu_L + beta_d mu_O (eq. 4, with theta = k / N)."""
    positive(k=k, mu_l=mu_l, mu_o=mu_o)
    return in_range("throughput_eb (eq. 4)", lambda: 1.0 / ((alpha_p + alpha_d * zeta(theta) * mu_o) / k
                                                           + beta_p * mu_l + beta_d * mu_o),
                    nonzero=True, k=k, mu_l=mu_l, mu_o=mu_o)


def throughput_mb(batch_size: float, alpha_mb: float, beta_mb: float, mu_l: float, mu_o: float) -> float:
    """TP_MB(N) = [alpha_MB (1 + mu_O) / N + beta_MB^e (mu_L + mu_O)]^-1 (section 3.5)."""
    positive(batch_size=batch_size, mu_l=mu_l, mu_o=mu_o)
    return in_range("throughput_mb (section 3.5)",
                    lambda: 1.0 / (alpha_mb * (1 + mu_o) / batch_size + beta_mb * (mu_l + mu_o)),
                    nonzero=True, batch_size=batch_size, mu_l=mu_l, mu_o=mu_o)


def crossover(batch_size: float, theta_0: float, alpha_p: float, alpha_d: float, beta_p: float,
              beta_d: float, alpha_mb: float, beta_mb: float, mu_l: float, mu_o: float) -> dict[str, object]:
    """The EB-MB crossover (eq. 7, Proposition 3.4): MB beats EB(k0*) iff
    beta_MB^e - beta_EB^w < [(alpha_p + alpha_d zeta mu_O) / k0* - alpha_MB (1 + mu_O) / N] / (mu_L + mu_O),
    with k0* = floor(theta0 N) and beta_EB^w = (beta_p mu_L + beta_d mu_O) / (mu_L + mu_O).
    Each positive term is checked for underflow on its own: a difference may rightly be 0 or
    negative, so a term lost below the float range would not show in it."""
    check_batch_size(batch_size)
    positive(mu_l=mu_l, mu_o=mu_o)
    finite(alpha_p=alpha_p, alpha_d=alpha_d, beta_p=beta_p, beta_d=beta_d, alpha_mb=alpha_mb, beta_mb=beta_mb)
    k0 = math.floor(theta_0 * batch_size)
    if k0 < 1:
        raise KvschedError(f"k0* = floor(theta0 N) = 0 for theta0={theta_0:.4g}, N={batch_size}: batch too small")
    given = {"batch_size": batch_size, "mu_l": mu_l, "mu_o": mu_o}
    beta_eb = in_range("beta_EB^w", lambda: (beta_p * mu_l + beta_d * mu_o) / (mu_l + mu_o),
                       nonzero=beta_p + beta_d > 0, beta_p=beta_p, beta_d=beta_d, **given)
    lhs = in_range("beta_MB^e - beta_EB^w (eq. 7)", lambda: beta_mb - beta_eb, beta_mb=beta_mb, beta_eb_w=beta_eb)
    eb_term = in_range("(alpha_p + alpha_d zeta mu_O) / (k0* (mu_L + mu_O)) in eq. (7)",
                       lambda: (alpha_p + alpha_d * zeta(theta_0) * mu_o) / k0 / (mu_l + mu_o), nonzero=True,
                       alpha_p=alpha_p, alpha_d=alpha_d, **given)
    mb_term = in_range("alpha_MB (1 + mu_O) / (N (mu_L + mu_O)) in eq. (7)",
                       lambda: alpha_mb * (1 + mu_o) / batch_size / (mu_l + mu_o), nonzero=alpha_mb > 0,
                       alpha_mb=alpha_mb, **given)
    rhs = eb_term - mb_term
    return {"lhs": lhs, "rhs": rhs, "favours": "MB" if lhs < rhs else "EB", "k0_star": k0,
            "beta_eb_w": beta_eb,
            "throughput_eb": throughput_eb(k0, alpha_p, alpha_d, beta_p, beta_d, mu_l, mu_o, theta_0),
            "throughput_mb": throughput_mb(batch_size, alpha_mb, beta_mb, mu_l, mu_o)}


def hazard_fit(outputs: np.ndarray, quantile: float = 0.95, lower_quantile: float = 0.0) -> dict[str, float]:
    """Fit h(t) = p0 + eta t to the empirical hazard h(t) = #{O = t} / #{O >= t} over
    t in [1, t95] by weighted least squares (section 3.4).

    The paper does not give the weights; this uses the number at risk #{O >= t}, the inverse
    of the hazard estimate's variance up to the factor h (1 - h). `lower_quantile` > 0 starts
    the range at that quantile instead of 1 (the authors' implementation uses 5%-95%)."""
    o = np.asarray(outputs, dtype=np.int64)
    if len(o) < 2 or o.min() < 1:
        raise KvschedError("the hazard fit needs at least two output lengths, all >= 1")
    t95 = int(math.ceil(np.quantile(o, quantile)))
    counts = np.bincount(o, minlength=t95 + 2)
    at_risk = len(o) - np.concatenate(([0], np.cumsum(counts)))[:len(counts)]
    t0 = max(1, int(np.floor(np.quantile(o, lower_quantile)))) if lower_quantile > 0 else 1
    t = np.arange(t0, max(t0, t95) + 1)
    keep = at_risk[t] > 0
    t, n_t = t[keep], at_risk[t][keep]
    if len(t) < 2:
        raise KvschedError("the hazard fit needs outputs spread over at least two lengths")
    h = counts[t] / n_t
    w = n_t.astype(float)
    x = np.column_stack([np.ones(len(t)), t.astype(float)])
    coef, *_ = np.linalg.lstsq(x * np.sqrt(w)[:, None], h * np.sqrt(w), rcond=None)
    return {"p0": float(coef[0]), "eta": float(coef[1]), "t95": float(t95), "points": float(len(t))}
