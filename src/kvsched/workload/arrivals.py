"""Arrival processes. Open-loop ones give arrival times (seconds from the phase start);
`Closed` issues requests from the simulation itself; `Replay` re-times a trace's stamps.

Spec strings (CLI `--arrivals`, workload files):
    poisson:RATE                 Poisson process, RATE requests/s
    poisson-trunc:RATE:K         exponential gaps of mean 1/RATE, each capped at K/RATE (K times
                                 the mean): mean rate RATE / (1 - e^-K), e.g. 1.0524 RATE for K = 3
    gamma:RATE:CV                renewal process with Gamma gaps: mean 1/RATE, coefficient of
                                 variation CV (CV > 1 is burstier than Poisson)
    piecewise:R1:S1,R2:S2,...    Poisson at R1 for S1 seconds, then R2 for S2 s, ..., cyclic
    sine:MEAN:AMPLITUDE:PERIOD   Poisson at MEAN * (1 + AMPLITUDE sin(2 pi t / PERIOD))
    diurnal:MEAN[:AMPLITUDE[:NOISE[:PERIOD]]]   a day: trough at 04:00, peak at 16:00, log-normal
                                 noise per 5 minutes (`Diurnal`); PERIOD < 86400 time-scales it
    closed:C                     closed loop at concurrency C
    replay | replay:RATE | replay:xF   a timed trace's own stamps, as they are, scaled to a
                                 mean rate RATE, or sped up F times
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.lengths import is_whole


class OpenLoop(Protocol):
    mean_rate: float

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray: ...

    def with_rate(self, rate: float) -> "OpenLoop": ...


def _check_rate(rate: float, what: str = "rate") -> float:
    if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise KvschedError(f"arrivals: {what} must be a positive number of requests per second, got {rate}")
    return float(rate)


@dataclass(frozen=True)
class _AtRate:
    """A process given by its mean rate alone."""
    rate: float

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    @property
    def mean_rate(self) -> float:
        return self.rate


@dataclass(frozen=True)
class Poisson(_AtRate):
    """Exponential gaps at `rate` requests per second."""

    def times(self, rng, n):
        return np.cumsum(rng.exponential(1.0 / self.rate, size=n))

    def with_rate(self, rate):
        return Poisson(rate)

    def __str__(self) -> str:
        return f"poisson:{self.rate:g}"


@dataclass(frozen=True)
class PoissonTruncated:
    """Exponential gaps of mean 1/`rate`, each capped at `k` times that mean (k / rate): the
    SLAI authors' trace generator (rad-slai.txt section 7) caps its Poisson gaps at 3x the mean.

    `rate` is the nominal rate, the one the authors quote. Capping shortens the mean gap, so the
    process runs faster than `rate`: with X ~ Exp(lambda) and c = K / lambda,
        E[min(X, c)] = integral_0^c P(X > x) dx = integral_0^c e^(-lambda x) dx
                     = (1 - e^(-lambda c)) / lambda = (1 - e^-K) / lambda,
    so `mean_rate` (the effective rate, what the fluid and capacity figures read) is
    rate / (1 - e^-K): 1.0524 rate for K = 3, 1.0187 rate for K = 4.
    `with_rate(r)` keeps K and sets the nominal rate to r (the effective rate is then
    r / (1 - e^-K)), so `--rate 1.6` on a `poisson-trunc:1:3` workload means the paper's
    lambda = 1.6, as the spec string's RATE does.
    """
    rate: float
    k: float

    def __post_init__(self) -> None:
        _check_rate(self.rate, "poisson-trunc rate")
        if isinstance(self.k, bool) or not (isinstance(self.k, (int, float)) and self.k > 0 and math.isfinite(self.k)):
            raise KvschedError(f"arrivals: poisson-trunc K (the gap cap, in mean gaps) must be a finite number "
                               f"> 0, got {self.k}")
        if not math.isfinite(self.mean_rate):
            raise KvschedError(f"arrivals: poisson-trunc:{self.rate:g}:{self.k:g} has an effective rate too "
                               "large to represent; use a larger K")

    @property
    def mean_rate(self) -> float:
        """The effective rate, rate / (1 - e^-K) (the class docstring derives it)."""
        return self.rate / -math.expm1(-self.k)

    def times(self, rng, n):
        mean = 1.0 / self.rate
        return np.cumsum(np.minimum(rng.exponential(mean, size=n), self.k * mean))

    def with_rate(self, rate):
        return PoissonTruncated(rate, self.k)

    def __str__(self) -> str:
        return f"poisson-trunc:{self.rate:g}:{self.k:g}"


@dataclass(frozen=True)
class GammaArrivals:
    """Gamma-distributed gaps with shape 1/CV^2 and scale CV^2/rate: mean 1/rate, CV as given
    (CV = 1 is Poisson)."""
    rate: float
    cv: float

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not (self.cv > 0 and math.isfinite(self.cv) and 0 < self.cv * self.cv < math.inf):
            raise KvschedError(f"arrivals: gamma CV must be a number > 0 whose square is finite and > 0, got {self.cv}")

    @property
    def mean_rate(self) -> float:
        return self.rate

    def times(self, rng, n):
        k = 1.0 / self.cv ** 2
        return np.cumsum(rng.gamma(k, 1.0 / (k * self.rate), size=n))

    def with_rate(self, rate):
        return GammaArrivals(rate, self.cv)

    def __str__(self) -> str:
        return f"gamma:{self.rate:g}:{self.cv:g}"


def _thinned(rng: np.random.Generator, intensity: Callable[[np.ndarray], np.ndarray],
             peak: float, mean: float, n: int) -> np.ndarray:
    """n points of a non-homogeneous Poisson process by thinning (Lewis and Shedler):
    candidates at the peak rate, each kept with probability intensity(t) / peak."""
    out, got, t0 = [], 0, 0.0
    while got < n:
        k = max(256, int(1.2 * (n - got) * peak / mean))
        cand = t0 + np.cumsum(rng.exponential(1.0 / peak, size=k))
        keep = cand[rng.random(k) * peak < intensity(cand)]
        out.append(keep)
        got += len(keep)
        t0 = float(cand[-1])
    return np.concatenate(out)[:n]


@dataclass(frozen=True)
class Piecewise:
    """Piecewise-constant rate, repeating: segments of (rate, seconds). A time-varying
    arrival rate lambda^t of fluid-wait-nested-wait.txt section 7.1 (there continuous;
    `Sinusoid` is the continuous one)."""
    segments: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise KvschedError("arrivals: piecewise needs at least one RATE:SECONDS segment")
        for rate, dur in self.segments:
            if not (rate >= 0 and math.isfinite(rate)) or not (dur > 0 and math.isfinite(dur)):
                raise KvschedError(f"arrivals: piecewise segment {rate:g}:{dur:g} needs a rate >= 0 "
                                   "and a duration > 0")
        if max(r for r, _ in self.segments) <= 0:
            raise KvschedError("arrivals: piecewise needs a segment with a rate > 0")

    @property
    def mean_rate(self) -> float:
        return sum(r * d for r, d in self.segments) / sum(d for _, d in self.segments)

    def times(self, rng, n):
        rates = np.array([r for r, _ in self.segments])
        ends = np.cumsum([d for _, d in self.segments])
        period = float(ends[-1])

        def intensity(t):
            return rates[np.minimum(np.searchsorted(ends, np.mod(t, period), side="right"), len(rates) - 1)]
        return _thinned(rng, intensity, float(rates.max()), self.mean_rate, n)

    def with_rate(self, rate):
        f = _check_rate(rate) / self.mean_rate
        return Piecewise(tuple((r * f, d) for r, d in self.segments))

    def __str__(self) -> str:
        return "piecewise:" + ",".join(f"{r:g}:{d:g}" for r, d in self.segments)


@dataclass(frozen=True)
class Sinusoid:
    """lambda(t) = mean * (1 + amplitude * sin(2 pi t / period)), 0 <= amplitude <= 1: a
    continuous time-varying rate as in fluid-wait-nested-wait.txt section 7.1."""
    mean: float
    amplitude: float
    period: float

    def __post_init__(self) -> None:
        _check_rate(self.mean, "sine mean rate")
        if not 0 <= self.amplitude <= 1:
            raise KvschedError(f"arrivals: sine amplitude must be in [0, 1], got {self.amplitude}")
        if not (self.period > 0 and math.isfinite(self.period)):
            raise KvschedError(f"arrivals: sine period must be > 0 seconds, got {self.period}")

    @property
    def mean_rate(self) -> float:
        return self.mean

    def times(self, rng, n):
        w = 2 * math.pi / self.period
        return _thinned(rng, lambda t: self.mean * (1 + self.amplitude * np.sin(w * t)),
                        self.mean * (1 + self.amplitude), self.mean, n)

    def with_rate(self, rate):
        return replace(self, mean=_check_rate(rate))

    def __str__(self) -> str:
        return f"sine:{self.mean:g}:{self.amplitude:g}:{self.period:g}"


DAY = 86400.0
NOISE_BUCKETS = 288             # noise windows per period: 5 minutes of a day
MAX_NOISE = 1_000_000           # noise windows drawn at most (they repeat after)


@dataclass(frozen=True)
class Diurnal:
    """A day of traffic: lambda(t) = mean x (1 + amplitude x sin(2 pi (t / period - 10/24)))
    x noise(t), lowest at 04:00 and highest at 16:00 of each period. Production LLM traffic
    follows a daily cycle (the week-long Azure LLM inference traces of 2024, released with
    Stojkovic et al., "DynamoLLM", HPCA 2025); the bundled 2023 traces span an hour, so no day
    is bundled, and the phase and the default amplitude here are a documented choice, not a
    fit. noise is log-normal per 1/288 of the period (5 minutes of a day), exp(s Z -
    s^2 / 2) with Z standard normal (mean 1), drawn from the workload's random stream; the
    windows repeat after as many as the requests need (at most 1,000,000). `period` below 86400 runs a day
    faster (time-scaled: `diurnal:MEAN:A:NOISE:864` is a day in 864 s)."""
    mean: float
    amplitude: float = 0.6
    noise: float = 0.1
    period: float = DAY

    def __post_init__(self) -> None:
        _check_rate(self.mean, "diurnal mean rate")
        if not 0 <= self.amplitude < 1:
            raise KvschedError(f"arrivals: diurnal amplitude must be in [0, 1), got {self.amplitude}")
        if not (0 <= self.noise <= 2):
            raise KvschedError(f"arrivals: diurnal noise (log-normal sigma) must be in [0, 2], got {self.noise}")
        if not (self.period >= 1 and math.isfinite(self.period)):
            raise KvschedError(f"arrivals: diurnal period must be at least 1 second, got {self.period}")

    @property
    def mean_rate(self) -> float:
        return self.mean

    def times(self, rng, n):
        width = self.period / NOISE_BUCKETS
        count = int(min(MAX_NOISE, max(NOISE_BUCKETS, 2 * n / self.mean / width + 1)))
        z = rng.standard_normal(count)
        noise = np.exp(self.noise * z - self.noise ** 2 / 2)
        w = 2 * math.pi / self.period

        def intensity(t):
            k = (t // width).astype(np.int64) % count
            return self.mean * (1 + self.amplitude * np.sin(w * t - 2 * math.pi * 10 / 24)) * noise[k]
        return _thinned(rng, intensity, self.mean * (1 + self.amplitude) * float(noise.max()), self.mean, n)

    def with_rate(self, rate):
        return replace(self, mean=_check_rate(rate))

    def __str__(self) -> str:
        return f"diurnal:{self.mean:g}:{self.amplitude:g}:{self.noise:g}:{self.period:g}"


MAX_CONCURRENCY = 2 ** 40


@dataclass(frozen=True)
class Closed:
    """Closed loop at concurrency c: c requests in flight; the next is issued the moment one
    finishes (exclusive-batching-eb.txt section 4.1; `vllm bench serve --max-concurrency`)."""
    concurrency: int

    def __post_init__(self) -> None:
        if not is_whole(self.concurrency) or not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise KvschedError(f"arrivals: closed-loop concurrency must be an integer >= 1 and at most "
                               f"{MAX_CONCURRENCY:,}, got {self.concurrency!r:.40}")
        object.__setattr__(self, "concurrency", int(self.concurrency))

    def __str__(self) -> str:
        return f"closed:{self.concurrency}"


@dataclass(frozen=True)
class Replay:
    """A timed trace's own stamps. `rate` rescales time so the mean rate (n - 1) / span is
    `rate`; `speedup` divides time by a factor; `spread` moves each stamp uniformly into
    [t, t + spread) (seeded), for traces on a coarse grid such as Mooncake's 3 s buckets."""
    rate: float | None = None
    speedup: float = 1.0
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.rate is not None:
            _check_rate(self.rate, "replay rate")
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise KvschedError(f"arrivals: replay speed-up must be > 0, got {self.speedup}")
        if not (self.spread >= 0 and math.isfinite(self.spread)):
            raise KvschedError(f"arrivals: spread must be >= 0 seconds, got {self.spread}")

    def apply(self, stamps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t = np.asarray(stamps, np.float64)
        if self.spread:
            t = t + rng.uniform(0.0, self.spread, size=len(t))
        if self.rate is not None:
            span = float(t.max() - t.min()) if len(t) > 1 else 0.0
            if span <= 0:
                raise KvschedError("arrivals: cannot scale a trace whose requests all arrive at once to a rate")
            t = (t - t.min()) * ((len(t) - 1) / span / self.rate) + t.min()
        return t / self.speedup

    def with_rate(self, rate):
        return replace(self, rate=_check_rate(rate), speedup=1.0)

    def __str__(self) -> str:
        base = "replay" + (f":{self.rate:g}" if self.rate else "") + (
            f":x{self.speedup:g}" if self.speedup != 1 else "")
        return base + (f" (spread {self.spread:g} s)" if self.spread else "")


@dataclass(frozen=True)
class TraceRate(_AtRate):
    """`--rate` on a trace not yet read: its own times rescaled to `rate` if it is timed
    (Replay), Poisson at `rate` if it holds lengths only. Resolved when the trace is read, so
    the file is read once (a pipe can be read only once)."""

    def resolve(self, timed: bool) -> "Replay | Poisson":
        return Replay(rate=self.rate) if timed else Poisson(self.rate)

    def with_rate(self, rate):
        return TraceRate(_check_rate(rate))

    def __str__(self) -> str:
        return f"trace times at {self.rate:g} req/s (Poisson if the trace has no times)"


Arrivals = Poisson | PoissonTruncated | GammaArrivals | Piecewise | Sinusoid | Diurnal | Closed | Replay | TraceRate

_FORMS = ("poisson:RATE, poisson-trunc:RATE:K, gamma:RATE:CV, piecewise:R1:S1,R2:S2,..., "
          "sine:MEAN:AMPLITUDE:PERIOD, diurnal:MEAN[:AMPLITUDE[:NOISE[:PERIOD]]], closed:C, replay, replay:RATE "
          "or replay:xF")


def parse_arrivals(spec: str) -> Arrivals:
    """Parse an arrival-process spec string (forms in the module docstring)."""
    name, _, rest = str(spec).strip().partition(":")
    try:
        if name == "poisson" and rest:
            return Poisson(float(rest))
        if name == "poisson-trunc":
            parts = rest.split(":") if rest else []
            if len(parts) != 2 or not all(x.strip() for x in parts):
                raise KvschedError(f"arrivals {spec!r}: expected poisson-trunc:RATE:K (RATE req/s, each gap "
                                   "capped at K times the mean gap 1/RATE), e.g. poisson-trunc:1.0:3")
            return PoissonTruncated(float(parts[0]), float(parts[1]))
        if name == "gamma" and rest.count(":") == 1:
            return GammaArrivals(*map(float, rest.split(":")))
        if name == "sine" and rest.count(":") == 2:
            return Sinusoid(*map(float, rest.split(":")))
        if name == "diurnal" and rest and rest.count(":") <= 3:
            return Diurnal(*map(float, rest.split(":")))
        if name == "closed" and rest:
            return Closed(int(rest))
        if name == "piecewise" and rest:
            segs = [seg.split(":") for seg in rest.split(",")]
            if any(len(s) != 2 for s in segs):
                raise KvschedError(f"arrivals {spec!r}: piecewise segments are RATE:SECONDS")
            return Piecewise(tuple((float(r), float(d)) for r, d in segs))
        if name == "replay":
            if not rest:
                return Replay()
            if rest.startswith("x"):
                return Replay(speedup=float(rest[1:]))
            return Replay(rate=float(rest))
    except ValueError:
        raise KvschedError(f"arrivals {spec!r}: values must be numbers (forms: {_FORMS})") from None
    raise KvschedError(f"unknown arrival process {spec!r}; use one of {_FORMS}")


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """n arrival times of a Poisson process at `rate` requests/s, the first at t = 0 + gap."""
    if not (rate > 0 and np.isfinite(rate)):
        raise KvschedError(f"--rate must be a positive number of requests per second, got {rate}")
    return Poisson(rate).times(rng, n)
