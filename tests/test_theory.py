"""The papers' closed forms, each against values derived independently here."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from kvsched.errors import KvschedError
from kvsched.theory import eb, fluid, stability, wait
from kvsched.theory.fluid import FluidType
from kvsched.workload.lengths import Gamma, Geometric, LinearHazard


# ----- stability-capacity.txt ---------------------------------------------------------------

def g_by_hand(s: int, o: int, chunk: int) -> int:
    """Sum, over the batches of one request, of the KV tokens it holds."""
    held, total = 0, 0
    while held < s:
        held = min(s, held + chunk)
        total += held
    for j in range(1, o + 1):
        total += s + j
    return total


@pytest.mark.parametrize("s,o,chunk", [(512, 1, 512), (1024, 10, 512), (1000, 7, 512), (3, 5, 512),
                                       (4096, 300, 256), (1, 1, 1), (17, 0, 4)])
def test_lifetime_memory(s, o, chunk):
    assert stability.lifetime_memory(s, o, chunk) == g_by_hand(s, o, chunk)
    if s % chunk == 0:                                   # the paper's closed form
        assert stability.lifetime_memory(s, o, chunk) == ((1 + s / chunk) * s + 2 * o * s + (1 + o) * o) / 2


def uniform(lo, hi):
    v = np.arange(lo, hi + 1)
    return v, np.full(len(v), 1 / len(v))


def test_paper_mixture_rate_within_two_percent():
    """stability-capacity.txt 5.1-5.2: M = 131,000, s_hat = 512, b = 0.0430 (PD 2:1) and
    0.0337 (PD 1:2); the half-and-half trace predicts 3.385 requests/s."""
    mus = []
    for (hp, ho), b in (((2133, 1066), 0.0430), ((1066, 2133), 0.0337)):
        g = stability.mean_lifetime_memory_independent(*uniform(10, hp), *uniform(10, ho), 512)
        s, o = np.meshgrid(np.arange(10, hp + 1), np.arange(10, ho + 1))
        assert g == pytest.approx(stability.lifetime_memory(s, o, 512).mean(), rel=1e-12)
        mus.append(stability.service_rate(131_000, b, g))
    mix = stability.mixture_rate([0.5, 0.5], mus)
    assert abs(mix / 3.385 - 1) < 0.02
    assert mix == pytest.approx(1 / (0.5 / mus[0] + 0.5 / mus[1]), rel=1e-12)


def test_service_rate_delta_and_gpus():
    st = stability.analyse(np.array([100, 300]), np.array([10, 30]), 10_000, 0.05, 64, np.array([1, 3]))
    g = (g_by_hand(100, 10, 64) * 1 + g_by_hand(300, 30, 64) * 3) / 4
    assert st.mean_lifetime_memory == pytest.approx(g)
    assert st.mu == pytest.approx(10_000 / (0.05 * g))
    assert st.delta == pytest.approx(330 / 10_000) and st.stable_rate == pytest.approx(st.mu * (1 - 0.033))
    assert stability.gpus_needed(40, 18, 0.9) == math.ceil(40 / 16.2) == 3
    assert stability.gpus_needed(18, 20, 0.9) == 1 and stability.gpus_needed(36, 20, 0.9) == 2
    with pytest.raises(KvschedError):
        stability.gpus_needed(10, 5, 1.5)


def test_batch_time_estimators():
    t = np.arange(1, 101, dtype=float)                   # 1..100
    assert stability.estimate_batch_time(t, "median") == 50.5
    assert stability.estimate_batch_time(t, "mean") == 50.5
    assert stability.estimate_batch_time(t, "trim5") == np.arange(1, 96).mean()
    assert stability.estimate_batch_time(t, "trim10") == np.arange(1, 91).mean()
    with pytest.raises(KvschedError, match="unknown batch-time estimator"):
        stability.estimate_batch_time(t, "mode")


# ----- fluid-wait-nested-wait.txt section 3 ----------------------------------------------------

TYPES = [FluidType(20.0, 10, 19), FluidType(40.0, 10, 39), FluidType(5.0, 200, 99)]


def test_fluid_equilibrium_solves_the_balance_equations():
    d0, d1 = 0.01, 2e-6
    # unknowns n_j (requests of type j per batch): balance n_j / (l'_j + 1) = lambda_j x time,
    # time = d0 + d1 sum_j n_j (l_j + l'_j / 2)
    def balance(n):
        tau = d0 + d1 * sum(nj * (t.prompt + t.decode / 2) for nj, t in zip(n, TYPES))
        return [nj / (t.decode + 1) - t.rate * tau for nj, t in zip(n, TYPES)]
    n = optimize.fsolve(balance, np.ones(len(TYPES)), xtol=1e-13)
    m = sum(nj * (t.prompt + t.decode / 2) for nj, t in zip(n, TYPES))
    assert fluid.equilibrium_memory(TYPES, d0, d1) == pytest.approx(m, rel=1e-9)
    assert fluid.iteration_time(TYPES, d0, d1) == pytest.approx(d0 + d1 * m, rel=1e-9)
    assert fluid.active_requests(TYPES, d0, d1) == pytest.approx(n, rel=1e-9)
    assert fluid.throughput(TYPES) == 20 * 20 + 40 * 40 + 5 * 100
    one = fluid.single_type(TYPES[0], d0, d1)
    assert one["M_star"] == pytest.approx(fluid.equilibrium_memory(TYPES[:1], d0, d1))
    assert one["throughput_star"] == pytest.approx(20 * 20)


def test_fluid_instability():
    t = FluidType(100.0, 100, 99)                        # work = 100 * 100 * 149.5
    assert fluid.unstable([t], 1 / (100 * 100 * 149.5))
    assert not fluid.unstable([t], 0.99 / (100 * 100 * 149.5))
    assert fluid.summary([t], 0.01, 1e-3)["stable"] is False
    with pytest.raises(KvschedError, match="unstable"):
        fluid.equilibrium_memory([t], 0.01, 1e-3)


# ----- WAIT and Nested WAIT ------------------------------------------------------------------

def test_wait_thresholds():
    d0, d1 = 0.01, 2e-6
    n = wait.solve_wait(TYPES, d0, d1)
    chk = wait.check_wait(TYPES, n, d0, d1)
    assert chk["satisfied"]
    m = sum(nj * (t.decode + 1) * (t.prompt + t.decode / 2) for nj, t in zip(n, TYPES))
    assert chk["memory"] == pytest.approx(m) and chk["iteration_time"] == pytest.approx(d0 + d1 * m)
    assert all(nj / t.rate >= d0 + d1 * m for nj, t in zip(n, TYPES))
    smaller = [max(1, x - 1) for x in n]
    assert not wait.check_wait(TYPES, [smaller[0], *n[1:]], d0, d1)["satisfied"] or n[0] == 1
    # large rates: the thresholds approach the fluid equilibrium, M^pi -> M* (eq. 6)
    big = [FluidType(t.rate * 1000, t.prompt, t.decode) for t in TYPES]
    nb = wait.solve_wait(big, d0, d1 / 1000)
    assert wait.wait_memory(big, nb) == pytest.approx(fluid.equilibrium_memory(big, d0, d1 / 1000), rel=0.01)
    assert wait.practical_wait(TYPES, 1000) == pytest.approx([1000 * 20 / 65 / 20, 1000 * 40 / 65 / 40,
                                                             1000 * 5 / 65 / 100])


def test_nested_memory_is_the_stage_sum():
    pl, ends, n = 10, [20, 40, 80, 160], [15, 14, 12, 8]
    stages = [range(0, 21), range(21, 41), range(41, 81), range(81, 161)]
    expect = sum(ni * sum(pl + k for k in st) for ni, st in zip(n, stages))
    assert wait.nested_memory(pl, ends, n) == expect


def test_nested_thresholds_and_memory_bound():
    pl, ends, rates, d0, d1 = 10, [20, 40, 80, 160], [20, 40, 80, 160], 0.01, 2e-7
    n = wait.solve_nested(pl, ends, rates, d0, d1)
    chk = wait.check_nested(pl, ends, rates, n, d0, d1)
    assert chk["satisfied"]
    lam = np.cumsum(rates[::-1])[::-1]
    assert chk["p"] == pytest.approx((lam[1:] / lam[:-1]).tolist())
    assert all(n[i + 1] / n[i] > chk["p"][i] for i in range(3))
    assert all(n[i + 1] <= n[i] for i in range(3))         # equal allowed: theta is then infinite
    assert chk["iteration_time"] < n[0] / sum(rates)
    mb = wait.memory_bound(pl, ends, rates, n, batches=10_000, delta=0.01)
    log_term = math.log(4 * 10_000 / 0.01)
    expect = wait.nested_memory(pl, ends, n) + sum((pl + ends[j - 1]) * (n[j] + log_term / mb["theta"][j - 1])
                                                   for j in range(1, 4))    # log / inf = 0
    assert mb["memory_bound"] == pytest.approx(expect)
    merged_ends, merged_rates = wait.merge_types(ends, rates, 2)
    assert merged_ends == [40, 160] and merged_rates == [60, 240]


@pytest.mark.parametrize("n_prev,n_k,p", [(15, 14, 0.9), (100, 60, 0.5), (40, 30, 0.7), (1000, 999, 0.99)])
def test_theta_solves_eq16_uniquely(n_prev, n_k, p):
    th = wait.theta(n_prev, n_k, p)
    log_lhs = -th * n_k + n_prev * math.log(1 - p + p * math.exp(th))
    assert th > 0 and log_lhs == pytest.approx(0, abs=1e-9)
    assert th >= 8 * (n_k - n_prev * p) / n_prev
    grid = np.linspace(1e-6, 3 * th, 3000)
    g = -grid * n_k + n_prev * np.log(1 - p + p * np.exp(grid))
    assert np.count_nonzero(np.diff(np.sign(g)) != 0) == 1    # one positive root
    # increasing in D = n_k - n_prev p
    assert wait.theta(n_prev, n_k, p * 0.99) > th


@pytest.mark.parametrize("n_prev,n_k,p", [(10, 10, 0.5), (10, 12, 0.5)])
def test_theta_is_infinite_without_a_decrease(n_prev, n_k, p):
    assert wait.theta(n_prev, n_k, p) == math.inf     # the dominating queue never grows


@pytest.mark.parametrize("n_prev,n_k,p", [(10, 4, 0.5), (10, 5, 0.5), (10, 8, 1.0)])
def test_theta_needs_lemma_8_conditions(n_prev, n_k, p):
    with pytest.raises(KvschedError, match="positive root only when"):
        wait.theta(n_prev, n_k, p)


# ----- exclusive-batching-eb.txt ---------------------------------------------------------------

def test_theta0_solves_eq3_and_depends_on_the_ratio_only():
    th = eb.theta0(0.004, 0.05, 0.02)
    assert th / (1 - th) + math.log(1 - th) == pytest.approx(0.004 * 0.05 / 0.02, abs=1e-13)
    assert eb.theta0(0.008, 0.025, 0.02) == pytest.approx(th, abs=1e-14)
    assert eb.theta0(0.004, 0.5, 0.2) == pytest.approx(th, abs=1e-14)
    ratios = np.geomspace(1e-4, 50, 60)
    thetas = [eb.theta0(r, 1.0, 1.0) for r in ratios]
    assert np.all(np.diff(thetas) > 0) and 0 < thetas[0] and thetas[-1] < 1
    x = np.linspace(1e-9, 1 - 1e-9, 100_001)               # the left side is increasing: one root
    assert np.all(np.diff(x / (1 - x) + np.log1p(-x)) > 0)


def test_delta_theta_formula_and_sign():
    th, p0, eta, ad, bd, n = eb.theta0(0.004, 0.05, 0.02), 0.004, 1e-5, 0.02, 3e-5, 512
    z = -math.log(1 - th)
    expect = eta * (1 - th) ** 2 / (p0 ** 2 * th) * (z * (th / (1 - th) - z / 2) + bd * n / ad * (z - th))
    assert eb.delta_theta(th, p0, eta, ad, bd, n) == pytest.approx(expect, rel=1e-12)
    rng = np.random.default_rng(0)
    for _ in range(500):
        p0 = rng.uniform(1e-4, 0.1)
        th = eb.theta0(p0, rng.uniform(1e-3, 1), rng.uniform(1e-3, 1))
        assert eb.delta_theta(th, p0, rng.uniform(1e-8, 1e-3), rng.uniform(1e-3, 1),
                              rng.uniform(0, 1e-3), rng.integers(1, 4096)) > 0


def test_batch_sizes():
    c, p0, mu_l, th, eps = 400_000, 0.004, 512, 0.3, 0.01
    per = mu_l + (1 - th) / (th * p0) * math.log(1 / (1 - th))
    v = 1 / (p0 ** 2 * mu_l)
    out = eb.batch_sizes(c, p0, mu_l, th, eps)
    assert out["n_star"] == math.floor((c - v * math.log(1 / eps)) / per)
    assert out["n_expected"] == math.floor((c - v) / per) and out["n_static"] == math.floor(c / per)
    rng = np.random.default_rng(1)
    for _ in range(500):
        o = eb.batch_sizes(rng.uniform(1e4, 1e6), rng.uniform(1e-4, 0.05), rng.uniform(16, 4096),
                           rng.uniform(0.01, 0.99), rng.uniform(1e-6, 1 / math.e))
        assert o["n_star"] <= o["n_expected"] <= o["n_static"]


def test_eb_throughput_and_crossover_agree():
    mu_l, mu_o, n, p0 = 512.0, 256.0, 512, 1 / 256
    ap, ad, bp, bd = 0.03, 0.01, 4e-5, 3e-5
    th = eb.theta0(p0, ap, ad)
    k = math.floor(th * n)
    t_d = (bd * n * th - ad * math.log(1 - th)) / p0                 # E[T_d], section 3.2.1
    assert eb.throughput_eb(k, ap, ad, bp, bd, mu_l, mu_o, th) == pytest.approx(
        1 / ((ap - ad * mu_o * math.log(1 - th)) / k + bp * mu_l + bd * mu_o), rel=1e-12)
    assert 1 / eb.throughput_eb(th * n, ap, ad, bp, bd, mu_l, mu_o, th) == pytest.approx(
        (t_d + ap + bp * th * n * mu_l) / (th * n), rel=1e-12)
    rng = np.random.default_rng(2)
    for _ in range(300):
        amb, bmb = rng.uniform(0.001, 0.05), rng.uniform(1e-5, 1e-4)
        c = eb.crossover(n, th, ap, ad, bp, bd, amb, bmb, mu_l, mu_o)
        assert c["favours"] == ("MB" if c["throughput_mb"] > c["throughput_eb"] else "EB")


def test_hazard_fit_recovers_p0_and_eta():
    rng = np.random.default_rng(3)
    fit = eb.hazard_fit(Geometric(250).sample(rng, 200_000))
    assert fit["p0"] == pytest.approx(1 / 250, rel=0.03) and abs(fit["eta"]) < 2e-6
    fit = eb.hazard_fit(LinearHazard(0.004, 2e-5).sample(rng, 200_000))
    assert fit["p0"] == pytest.approx(0.004, rel=0.05) and fit["eta"] == pytest.approx(2e-5, rel=0.05)
    # gamma (IFR for shape > 1): the fit on samples matches the same fit on the exact hazard
    dist = Gamma(2.0, 256.0)
    x = dist.sample(rng, 400_000)
    fit = eb.hazard_fit(x)
    t95 = int(fit["t95"])
    t = np.arange(1, t95 + 1)
    cdf = stats.gamma(2.0, scale=128.0).cdf
    pmf = np.where(t == 1, cdf(1.5), cdf(t + 0.5) - cdf(t - 0.5))
    at_risk = 1 - np.concatenate(([0.0], np.cumsum(pmf)))[:-1]
    h = pmf / at_risk
    coef = np.polyfit(t, h, 1, w=np.sqrt(at_risk))
    assert fit["eta"] > 0 and fit["eta"] == pytest.approx(coef[0], rel=0.1)
    assert fit["p0"] == pytest.approx(coef[1], rel=0.1, abs=2e-4)


def test_erfcx_matches_scipy_without_importing_it():
    """theory.eb.erfcx (no scipy import at run time) against scipy.special.erfcx, across the
    product form and the asymptotic series (ERFCX_SERIES_FROM), to 1e-12 relative."""
    import math

    import numpy as np
    from scipy.special import erfcx as reference

    from kvsched.theory.eb import ERFCX_SERIES_FROM, erfcx
    xs = np.concatenate([np.linspace(0, 40, 4001), np.logspace(-10, 10, 2001),
                         [np.nextafter(ERFCX_SERIES_FROM, 0), ERFCX_SERIES_FROM]])
    for x in xs.tolist():
        assert math.isclose(erfcx(x), float(reference(x)), rel_tol=1e-12, abs_tol=0), x
    assert erfcx(0.0) == 1.0 and erfcx(math.inf) == 0.0
    assert math.isclose(erfcx(1.01e308), float(reference(1.01e308)), rel_tol=1e-6)     # a subnormal, not 0
    for bad in (-1e-300, -1.0, math.nan):
        with pytest.raises(KvschedError, match="erfcx needs x >= 0"):
            erfcx(bad)


def test_bracketed_root_is_exact_to_adjacent_floats():
    """The bisection ends on adjacent floats around the root (or the root itself) and refuses
    an interval without a sign change."""
    import math

    from kvsched.theory.roots import bracketed_root
    for target in (1e-300, 1e-12, 0.3, 2.0, 1e6):
        r = bracketed_root(lambda x: x * x - target, 0.0, max(2.0, target))
        assert abs(r * r - target) <= 4 * math.ulp(target) or math.nextafter(r, math.inf) ** 2 >= target >= math.nextafter(r, 0) ** 2
    assert bracketed_root(lambda x: x - 0.5, 0.0, 1.0) == 0.5
    for lo, hi in ((1.0, 2.0), (2.0, 1.0), (0.0, 0.0)):
        with pytest.raises(KvschedError, match="no sign change"):
            bracketed_root(lambda x: x - 0.5, lo, hi)


def test_theta0_of_tiny_ratios_is_its_series_root():
    """Eq. (3)'s left side cancels to theta^2 / 2 for small theta: summed as its series there,
    theta0 of a tiny p0 alpha_p / alpha_d is sqrt(2 x ratio) to rounding, not a root of the
    cancellation's noise (found by the independent review: 5.6e-17 for a ratio of 1e-40)."""
    import math
    for ratio in (1e-300, 1e-100, 1e-40, 1e-20, 1e-12):
        th = eb.theta0(ratio, 1.0, 1.0)
        assert math.isclose(th, math.sqrt(2 * ratio) * (1 - (2 / 3) * math.sqrt(2 * ratio)), rel_tol=1e-9), ratio
    for ratio in (0.05, 0.3, 3.0):        # either side of SERIES_BELOW: eq. (3) holds to rounding
        th = eb.theta0(ratio, 1.0, 1.0)
        assert math.isclose(th / (1 - th) + math.log1p(-th), ratio, rel_tol=1e-12)
