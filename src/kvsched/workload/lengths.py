"""Token-length distributions. Each samples integer lengths >= 1 from a numpy Generator."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from kvsched.errors import KvschedError


class LengthDist(Protocol):
    """`mean` and `sample`; distributions with finite support also have `support()` ->
    (values, probabilities), for exact expectations."""
    mean: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


MAX_TOKENS = 2 ** 40       # longest length a distribution may produce (about 1.1e12 tokens)


def is_whole(value) -> bool:
    """Whether `value` is an integer (a Python or numpy int, or an integral float such as 5.0);
    a bool, a string, nan and inf are not."""
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    return not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))


def whole(what: str, value, low: int = 1, high: int = MAX_TOKENS) -> int:
    """`value` as an int in [low, high], else a KvschedError naming `what` and the range: never
    truncated (5.7) or read from a bool. (limits.check_count refuses numpy integers and names
    kvsched.limits as the bound's home.)"""
    if not is_whole(value) or not low <= value <= high:
        raise KvschedError(f"{what} must be an integer in {low:,}..{high:,}, got {value!r:.40}")
    return int(value)


def whole_array(what: str, values, low: int = 1, high: int = MAX_TOKENS) -> np.ndarray:
    """`values` (a list or a 1-D array) as int64 in [low, high], checked before any cast: a bool,
    a string, nan, inf, a non-integral or an out-of-range entry is a KvschedError naming
    what[index], never truncated, wrapped or clamped."""
    a = numbers(what, values)
    floats = a.dtype.kind == "f"
    bad = ~np.isfinite(a) | (a != np.trunc(a)) if floats else np.zeros(len(a), bool)
    if bad.any():
        k = int(np.argmax(bad))
        raise KvschedError(f"{what}[{k}] must be a whole number, got {a[k].item()!r}")
    out = (a < low) | (a > high)
    if floats:
        out |= np.abs(a) >= 2.0 ** 63           # float(high) may round up past int64
    if out.any():
        k = int(np.argmax(out))
        raise KvschedError(f"{what}[{k}] must be in {low:,}..{high:,}, got {int(a[k].item()):,}")
    return a.astype(np.int64)


def numbers(what: str, values) -> np.ndarray:
    """`values` as a 1-D numeric array (ints or floats, as given), else a KvschedError naming
    `what`: bools (numpy would count True as 1), strings and nested lists are refused."""
    if isinstance(values, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in values):
        raise KvschedError(f"{what} must hold numbers, not True/False")
    try:
        a = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is None or a.ndim != 1:
        raise KvschedError(f"{what} must be a 1-D list of numbers, got {_short(values)}")
    if a.dtype.kind not in "iuf":
        within = " within 64 bits" if a.dtype.kind == "O" else ""
        raise KvschedError(f"{what} must hold numbers{within}, got {_short(values)}")
    return a


def _short(values) -> str:
    text = repr(values)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(name: str, **values: float) -> None:
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise KvschedError(f"{name}: {key} must be a number, got {v!r:.40}")
        if not (v > 0 and math.isfinite(v)):
            raise KvschedError(f"{name}: {key} must be a finite number > 0, got {v}")
        if v > MAX_TOKENS:
            raise KvschedError(f"{name}: {key} {v:g} is beyond {MAX_TOKENS:,} tokens")


@dataclass(frozen=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", whole("fixed: length", self.value))

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
        if not (is_whole(self.low) and is_whole(self.high) and 1 <= self.low <= self.high <= MAX_TOKENS):
            raise KvschedError(f"uniform: need 1 <= low <= high <= {MAX_TOKENS:,}, integers, "
                               f"got {self.low}, {self.high}")
        object.__setattr__(self, "low", int(self.low))
        object.__setattr__(self, "high", int(self.high))

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
        if isinstance(self.mean, bool) or not 1 <= self.mean <= MAX_TOKENS:
            raise KvschedError(f"geometric: mean must be in 1..{MAX_TOKENS:,}, got {self.mean}")

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
        if not len(self.values):
            raise KvschedError("empirical: need at least one length")
        object.__setattr__(self, "values", tuple(whole_array("empirical: lengths", self.values).tolist()))

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
        finite = numbers("quantiles: knots", p + x)
        if not np.isfinite(finite).all() or max(x, default=0) > MAX_TOKENS:
            raise KvschedError(f"quantiles: probabilities and lengths must be finite, lengths <= {MAX_TOKENS:,}")
        if len(p) < 2 or p[0] != 0 or p[-1] != 1 or any(b <= a for a, b in zip(p, p[1:])) \
                or any(b < a for a, b in zip(x, x[1:])) or x[0] < 1:
            raise KvschedError("quantiles: need knots from p=0 to p=1, increasing, lengths >= 1 and non-decreasing")

    @property
    def mean(self) -> float:
        return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(self.knots, self.knots[1:]))

    def sample(self, rng, n):
        p, x = zip(*self.knots)
        return np.maximum(1, np.rint(np.interp(rng.random(n), p, x))).astype(np.int64)


HAZARD_SUPPORT = 4_000_000     # tokens a hazard pmf is tabulated over at most


@dataclass(frozen=True)
class LinearHazard:
    """Output lengths whose discrete hazard is h(t) = min(1, p0 + eta t), t = 1, 2, ...: the
    IFR model of exclusive-batching-eb.txt section 3.2.2 (eta = 0 is geometric, mean 1/p0)."""
    p0: float
    eta: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.p0, bool) or not (0 < self.p0 <= 1 and 0 <= self.eta < math.inf):
            raise KvschedError(f"hazard: need 0 < p0 <= 1 and a finite eta >= 0, got {self.p0}, {self.eta}")
        if self.eta > 0 and self._support() > HAZARD_SUPPORT:
            raise KvschedError(f"hazard: p0 {self.p0:g} and eta {self.eta:g} give lengths beyond "
                               f"{HAZARD_SUPPORT:,} tokens (raise p0 or eta)")

    def _support(self) -> int:
        """A length t with survival below 1e-15: sum of h up to t >= ln(1e15), since
        prod(1 - h) <= exp(-sum h)."""
        need = math.log(1e15)
        if self.eta == 0:
            return math.ceil(need / self.p0)
        return math.ceil((-self.p0 + math.sqrt(self.p0 ** 2 + 2 * self.eta * need)) / self.eta)

    def _pmf(self) -> np.ndarray:
        t = np.arange(1, max(self._support(), 1_000_000) + 1, dtype=np.float64)
        h = np.minimum(1.0, self.p0 + self.eta * t)
        survive = np.concatenate(([1.0], np.cumprod(1 - h)[:-1]))
        pmf = h * survive
        last = int(np.searchsorted(-survive, -1e-15))        # where survival falls below 1e-15
        return pmf[:max(1, last)]

    @property
    def mean(self) -> float:
        if self.eta == 0 and self._support() > HAZARD_SUPPORT:
            return 1.0 / self.p0
        pmf = self._pmf()
        return float(np.dot(np.arange(1, len(pmf) + 1), pmf) / pmf.sum())

    def sample(self, rng, n):
        if self.eta == 0 and self._support() > HAZARD_SUPPORT:     # constant hazard: geometric, exact
            return rng.geometric(self.p0, size=n).astype(np.int64)
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
    except (ValueError, OverflowError):
        raise KvschedError(f"length distribution {spec!r}: values must be finite numbers") from None


def empirical(values: Sequence[int]) -> Empirical:
    return Empirical(tuple(values))
