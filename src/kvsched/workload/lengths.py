"""Token-length distributions. Each samples integer lengths >= 1 from a numpy Generator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from kvsched.errors import KvschedError


class LengthDist(Protocol):
    """`mean` and `sample`; distributions with finite support also have `support()` ->
    (values, probabilities), for exact expectations."""
    mean: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


def _positive(name: str, **values: float) -> None:
    for key, v in values.items():
        if not v > 0:
            raise KvschedError(f"{name}: {key} must be > 0, got {v}")


@dataclass(frozen=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        if int(self.value) != self.value or self.value < 1:
            raise KvschedError(f"fixed: length must be an integer >= 1, got {self.value}")

    @property
    def mean(self) -> float:
        return float(self.value)

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array([self.value]), np.array([1.0])

    def sample(self, rng, n):
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform on [low, high], both included."""
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise KvschedError(f"uniform: need 1 <= low <= high, got {self.low}, {self.high}")

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        v = np.arange(self.low, self.high + 1)
        return v, np.full(len(v), 1.0 / len(v))

    def sample(self, rng, n):
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


def Jitter(mean: float) -> Uniform:
    """Uniform between 0.5x and 1.5x of a mean (exclusive-batching-eb.txt, section 4.1,
    'Workloads': per-request lengths drawn uniformly between 0.5x and 1.5x the mean)."""
    _positive("jitter", mean=mean)
    low = max(1, int(round(0.5 * mean)))
    return Uniform(low, max(low, int(round(1.5 * mean))))


@dataclass(frozen=True)
class Geometric:
    """Geometric on {1, 2, ...} with the given mean (p = 1 / mean): a constant hazard of
    finishing each token, the memoryless output model of exclusive-batching-eb.txt."""
    mean: float

    def __post_init__(self) -> None:
        if not self.mean >= 1:
            raise KvschedError(f"geometric: mean must be >= 1, got {self.mean}")

    def sample(self, rng, n):
        return rng.geometric(1.0 / self.mean, size=n).astype(np.int64)


@dataclass(frozen=True)
class Gamma:
    """Gamma(shape, scale = mean / shape), rounded to the nearest integer, at least 1
    (rounding moves the mean by well under a token for means >> 1)."""
    shape: float
    mean: float

    def __post_init__(self) -> None:
        _positive("gamma", shape=self.shape, mean=self.mean)

    def sample(self, rng, n):
        x = rng.gamma(self.shape, self.mean / self.shape, size=n)
        return np.maximum(1, np.rint(x)).astype(np.int64)


@dataclass(frozen=True)
class Empirical:
    """Resample (with replacement) from observed lengths."""
    values: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.values or min(self.values) < 1:
            raise KvschedError("empirical: need at least one length, all >= 1")

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        v, c = np.unique(np.asarray(self.values), return_counts=True)
        return v, c / c.sum()

    def sample(self, rng, n):
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)


@dataclass(frozen=True)
class Quantiles:
    """Lengths from a piecewise-linear quantile function through (probability, length)
    knots, probabilities from 0 to 1: matches the given percentiles by construction (used
    for stand-ins of traces known only by their published percentiles)."""
    knots: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        p = [k[0] for k in self.knots]
        x = [k[1] for k in self.knots]
        if len(p) < 2 or p[0] != 0 or p[-1] != 1 or any(b <= a for a, b in zip(p, p[1:])) \
                or any(b < a for a, b in zip(x, x[1:])) or x[0] < 1:
            raise KvschedError("quantiles: need knots from p=0 to p=1, increasing, lengths >= 1 and non-decreasing")

    @property
    def mean(self) -> float:
        return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(self.knots, self.knots[1:]))

    def sample(self, rng, n):
        p, x = zip(*self.knots)
        return np.maximum(1, np.rint(np.interp(rng.random(n), p, x))).astype(np.int64)


@dataclass(frozen=True)
class LinearHazard:
    """Output lengths whose discrete hazard is h(t) = min(1, p0 + eta t), t = 1, 2, ...: the
    IFR model of exclusive-batching-eb.txt section 3.2.2 (eta = 0 is geometric, mean 1/p0)."""
    p0: float
    eta: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.p0 <= 1 or self.eta < 0:
            raise KvschedError(f"hazard: need 0 < p0 <= 1 and eta >= 0, got {self.p0}, {self.eta}")

    def _pmf(self) -> np.ndarray:
        t = np.arange(1, 1_000_001, dtype=np.float64)
        h = np.minimum(1.0, self.p0 + self.eta * t)
        survive = np.concatenate(([1.0], np.cumprod(1 - h)[:-1]))
        pmf = h * survive
        last = int(np.searchsorted(-survive, -1e-15))        # where survival falls below 1e-15
        return pmf[:max(1, last)]

    @property
    def mean(self) -> float:
        pmf = self._pmf()
        return float(np.dot(np.arange(1, len(pmf) + 1), pmf) / pmf.sum())

    def sample(self, rng, n):
        cdf = np.cumsum(self._pmf())
        return 1 + np.searchsorted(cdf / cdf[-1], rng.random(n), side="right").astype(np.int64)


def parse_length(spec: str) -> LengthDist:
    """'fixed:512', 'uniform:128:1024', 'jitter:512', 'geometric:300', 'gamma:2:300',
    'hazard:0.002:0.00001' (h(t) = p0 + eta t)."""
    name, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    makers = {"fixed": (Fixed, 1, int), "uniform": (Uniform, 2, int), "jitter": (Jitter, 1, float),
              "geometric": (Geometric, 1, float), "gamma": (Gamma, 2, float),
              "hazard": (LinearHazard, 2, float)}
    if name not in makers:
        raise KvschedError(f"unknown length distribution {spec!r}; use one of "
                           "fixed:N, uniform:LOW:HIGH, jitter:MEAN, geometric:MEAN, gamma:SHAPE:MEAN, "
                           "hazard:P0:ETA")
    maker, arity, kind = makers[name]
    if len(args) != arity:
        raise KvschedError(f"length distribution {spec!r} takes {arity} value(s)")
    try:
        return maker(*(kind(a) for a in args))
    except ValueError:
        raise KvschedError(f"length distribution {spec!r}: values must be numbers") from None


def empirical(values: Sequence[int]) -> Empirical:
    return Empirical(tuple(int(v) for v in values))
