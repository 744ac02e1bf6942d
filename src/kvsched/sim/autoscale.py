"""Autoscaling in the loop (docs/control-plane.md, "Autoscaling"): scalers that decide a
replica count per pool every interval, and the fleet of replicas they start and drain.

A replica is `off`, `starting` (its cold start: a fixed start time plus its weights read from
storage), `up` (routable) or `draining` (no new requests; off when its last one leaves). Its
GPU-hours count from the decision that starts it to the moment it is off (or the run's end):
a cold start is paid for. The scaler sees `PoolSignals` of each pool and returns the count it
wants; the fleet starts replicas (a draining one is taken back first: it is warm), cancels
starting ones (newest first) and drains up ones (fewest outstanding first), never going below
`min` or above the pool's replicas.

Built-in scalers:
- `hpa`: Kubernetes' Horizontal Pod Autoscaler algorithm (kubernetes.io/docs/tasks/run-
  application/horizontal-pod-autoscale, "Algorithm details"; `HpaScaler.recommend`):
  desired = ceil(current x metric / target), skipped within a tolerance of 10% of the target;
  on a scale-up, replicas not yet ready count as using nothing, and if that reverses the
  direction or falls within tolerance the count stays. A scale-down takes the highest
  recommendation of the last `down_stabilization_s` (default 300 s, Kubernetes'
  scaleDown stabilizationWindowSeconds); a scale-up is at most the larger of +100% and +4
  replicas a decision (Kubernetes' default scale-up policies per 15 s, the default interval;
  with another interval the limit is still per decision).
  The metric is vLLM's `kv_cache_usage_perc` (`kv`), `num_requests_waiting` (`queue`) or
  waiting + running (`outstanding`), per ready replica.
- `slo`: replicas for the forecast arrival rate at one replica's capacity at the SLO (what
  `kvsched capacity` measures, capacity.py), times a headroom; the forecast extrapolates the
  rate's trend over the cold start and the interval (a replica started now serves then), and
  a window whose p99 TTFT broke the SLO adds one replica (feedback beside the feed-forward).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvsched.errors import KvschedError
from kvsched.params import convert

OFF, STARTING, UP, DRAINING = "off", "starting", "up", "draining"
HPA_METRICS = ("kv", "queue", "outstanding")


@dataclass
class PoolSignals:
    """What a scaler sees of one pool at a decision (sums over its up replicas; the window
    is the last `window_s` seconds)."""
    name: str
    up: int
    starting: int
    draining: int
    min: int
    max: int
    waiting: int                # requests waiting (vLLM's num_requests_waiting), summed
    outstanding: int            # waiting + running, summed
    kv_use: float               # KV used over capacity, summed over up replicas
    arrival_rate: float         # requests/s arriving at the pool over the window
    ttft_p99_s: float | None    # p99 TTFT of the window's arrivals (unserved ones count as waited so far)
    cold_start_s: float         # a new replica's cold start here
    tpot_mean_s: float | None = None    # mean time per output token (the mean ITL) of the window's
                                        # arrivals finished by now
    replicas: tuple = ()        # each up replica's (index, waiting, outstanding, KV use), the sums' parts

    @property
    def current(self) -> int:
        return self.up + self.starting


class Scaler(Protocol):
    name: str

    def decide(self, t: float, pools: Sequence[PoolSignals]) -> list[int]: ...


MOST = 1 << 30          # a recommendation past any pool (kept finite: a scaler's ratio may be huge)


def ceil_count(x: float) -> int:
    """ceil(x) as a replica count, MOST for anything above it (inf included)."""
    return math.ceil(x - 1e-9) if x < MOST else MOST


@dataclass
class _Stabilized:
    """Kubernetes' stabilization (pkg/controller/podautoscaler/horizontal.go,
    `stabilizeRecommendationWithBehaviors`): the current count, raised to the lowest
    recommendation of the scale-up window (0 s by default: the new one) and lowered to the
    highest of the scale-down window; and the default scale-up limit, the larger of +100% and
    +4 replicas per 15 s period (`behavior.scaleUp.policies`)."""
    down_stabilization_s: float = 300.0
    _history: list = field(default_factory=list, repr=False)

    def stabilize(self, t: float, k: int, desired: int, current: int) -> int:
        while len(self._history) <= k:
            self._history.append(deque())
        h = self._history[k]
        while h and h[0][0] <= t - self.down_stabilization_s:   # Kubernetes keeps those after the cutoff
            h.popleft()
        highest = max([desired, *(d for _, d in h)])          # the new one always counts
        h.append((t, desired))
        out = min(max(current, desired), highest)
        return min(out, max(2 * current, current + 4))


@dataclass
class HpaScaler(_Stabilized):
    metric: str = "kv"
    target: float = 0.8
    tolerance: float = 0.1
    name: str = "hpa"

    def __post_init__(self) -> None:
        if self.metric not in HPA_METRICS:
            raise KvschedError(f"--autoscale-set metric must be one of {', '.join(HPA_METRICS)}, got {self.metric!r}")
        _positive("target", self.target)
        if not 0 <= self.tolerance < 1:
            raise KvschedError(f"--autoscale-set tolerance must be in [0, 1), got {self.tolerance}")

    def decide(self, t: float, pools: Sequence[PoolSignals]) -> list[int]:
        out = []
        for k, p in enumerate(pools):
            total = {"kv": p.kv_use, "queue": p.waiting, "outstanding": p.outstanding}[self.metric]
            out.append(self.stabilize(t, k, self.recommend(total, p.up, p.current), p.current))
        return out

    def recommend(self, total: float, ready: int, current: int) -> int:
        """Kubernetes' replica calculator (pkg/controller/podautoscaler/replica_calculator.go):
        the ready replicas' usage ratio; within tolerance, no change; a scale-up with replicas
        not yet ready counts them at 0 and keeps the count if that reverses the direction or
        falls within tolerance; else ceil(ratio x current)."""
        ratio = total / (ready * self.target) if ready else 1.0
        if abs(ratio - 1) <= self.tolerance:
            return current
        if ratio > 1 and current > ready:
            ratio = total / (current * self.target)
            if ratio <= 1 or abs(ratio - 1) <= self.tolerance:
                return current
            return ceil_count(ratio * current)
        return ceil_count(ratio * ready)            # not a scale-up with unready ones: the ready alone


@dataclass
class SloScaler(_Stabilized):
    rate_per_replica: float = 0.0       # one replica's capacity at the SLO, req/s (0: measured, run.py)
    headroom: float = 0.9               # run each replica at this share of its capacity
    ttft_slo_s: float | None = None     # the p99 TTFT bound whose breach adds a replica
    name: str = "slo"
    rates: list = field(default_factory=list, repr=False)       # per pool, measured (run.py): else rate_per_replica
    _last: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise KvschedError(f"--autoscale-set headroom must be in (0, 1], got {self.headroom}")
        if self.rate_per_replica < 0 or not math.isfinite(self.rate_per_replica):
            raise KvschedError(f"--autoscale-set rate_per_replica must be >= 0 req/s, got {self.rate_per_replica}")

    def decide(self, t: float, pools: Sequence[PoolSignals]) -> list[int]:
        out = []
        for k, p in enumerate(pools):
            last = self._last.get(k)
            self._last[k] = (t, p.arrival_rate)
            slope = (p.arrival_rate - last[1]) / (t - last[0]) if last and t > last[0] else 0.0
            lead = p.cold_start_s + (t - last[0] if last else 0.0)
            forecast = max(p.arrival_rate, p.arrival_rate + slope * lead)
            per = self.rates[k] if self.rates else self.rate_per_replica
            if not per > 0:
                raise KvschedError(f"--autoscale slo: one replica of pool {p.name} meets the TTFT SLO at no rate "
                                   "(its capacity is 0 req/s); loosen ttft_slo_s or give rate_per_replica")
            each = per * self.headroom
            desired = ceil_count(forecast / each) if each > 0 else MOST
            if self.ttft_slo_s is not None and p.ttft_p99_s is not None and p.ttft_p99_s > self.ttft_slo_s:
                desired = max(desired, p.current + 1)
            out.append(self.stabilize(t, k, desired, p.current))
        return out


@dataclass(frozen=True)
class AutoscaleConfig:
    """--autoscale NAME with --autoscale-set key=value, checked; `scaler` is a built-in's name,
    or a scaler object (the Python API: anything with `name` and `decide`)."""
    scaler: Any
    interval_s: float = 15.0            # Kubernetes HPA's default sync period
    window_s: float = 60.0              # the signals' window
    min: int = 1
    initial: int | None = None          # replicas up at t = 0 (default: min)
    start_s: float = 30.0               # fixed part of a cold start (container, engine start, graph capture)
    storage_gbps: float = 2.0           # GB/s each GPU reads its weights at (the rest of the cold start)
    cold_start_s: float | None = None   # the whole cold start, given (start_s and the weights then unused)
    params: tuple = ()                  # the scaler's own (key, value) pairs

    def build(self, ttft_slo_s: float | None = None) -> Scaler:
        if not isinstance(self.scaler, str):
            return self.scaler
        cls = SCALERS[self.scaler]
        kw = dict(self.params)
        if cls is SloScaler and ttft_slo_s is not None and "ttft_slo_s" not in kw:
            kw["ttft_slo_s"] = ttft_slo_s
        return cls(**kw)

    def cold_start(self, weight_bytes_per_gpu: float) -> float:
        """Seconds from the decision to a routable replica: start_s + weights / storage_gbps
        (every GPU of a replica reads its own shard at once); or cold_start_s when given."""
        if self.cold_start_s is not None:
            return self.cold_start_s
        return self.start_s + weight_bytes_per_gpu / (self.storage_gbps * 1e9)


SCALERS: dict[str, type] = {"hpa": HpaScaler, "slo": SloScaler}
COMMON = {"interval_s": "float", "window_s": "float", "min": "int", "initial": "int", "start_s": "float",
          "storage_gbps": "float", "cold_start_s": "float"}
OWN = {"hpa": {"metric": "str", "target": "float", "tolerance": "float", "down_stabilization_s": "float"},
       "slo": {"rate_per_replica": "float", "headroom": "float", "ttft_slo_s": "float",
               "down_stabilization_s": "float"}}


def parse_autoscale(name: Any, assignments: dict[str, Any]) -> AutoscaleConfig:
    """--autoscale NAME (or a scaler object) and its --autoscale-set values (texts converted),
    checked; every bad value is one error naming the key."""
    given = not isinstance(name, str)
    if given and not (isinstance(getattr(name, "name", None), str) and callable(getattr(name, "decide", None))):
        raise KvschedError(f"Scenario.autoscale must be hpa, slo or a scaler (name, decide(t, pools)), got {name!r}")
    if not given and name not in SCALERS:
        raise KvschedError(f"--autoscale must be one of {', '.join(SCALERS)}, got {name!r}")
    own_keys = {} if given else OWN[name]
    common, own = {}, {}
    for key, value in assignments.items():
        kind = COMMON.get(key) or own_keys.get(key)
        if kind is None:
            raise KvschedError(f"--autoscale-set: {getattr(name, 'name', name)} has no key {key!r}; keys: "
                               f"{', '.join([*COMMON, *own_keys])}")
        v = convert(f"--autoscale {getattr(name, 'name', name)}", key, value, kind)
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
            raise KvschedError(f"--autoscale-set {key} must be a whole number, got {value!r}")
        if kind == "float" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise KvschedError(f"--autoscale-set {key} must be a finite number, got {value!r}")
        (common if key in COMMON else own)[key] = float(v) if kind == "float" else v
    for key in ("interval_s", "window_s", "storage_gbps"):
        if key in common:
            _positive(key, common[key])
    for key in ("interval_s", "window_s"):
        if common.get(key, 1.0) < 1e-3:
            raise KvschedError(f"--autoscale-set {key} must be at least 0.001 seconds, got {common[key]}")
    if common.get("initial") is not None and common["initial"] < common.get("min", 1):
        raise KvschedError(f"--autoscale-set initial={common['initial']} is below min={common.get('min', 1)}")
    for key in ("start_s", "cold_start_s"):
        if common.get(key, 0.0) < 0:
            raise KvschedError(f"--autoscale-set {key} must be >= 0 seconds, got {common[key]}")
    for key in ("min", "initial"):
        if key in common and not 1 <= common[key] <= 1 << 20:
            raise KvschedError(f"--autoscale-set {key} must be a whole number >= 1 (a pool keeps a replica up), "
                               f"got {common[key]}")
    if "down_stabilization_s" in own and own["down_stabilization_s"] < 0:
        raise KvschedError("--autoscale-set down_stabilization_s must be >= 0 seconds")
    if "ttft_slo_s" in own:
        _positive("ttft_slo_s", own["ttft_slo_s"])
    cfg = AutoscaleConfig(name, **common, params=tuple(sorted(own.items())))
    cfg.build()                                             # the scaler's own checks, now
    return cfg


def _positive(key: str, v: float) -> None:
    if not (v > 0 and math.isfinite(v)):
        raise KvschedError(f"--autoscale-set {key} must be a positive finite number, got {v}")


@dataclass
class Fleet:
    """Each replica's state and the times it held GPUs ([start, stop) intervals), by pool."""
    pools: list[list[int]]                  # replica indices of each pool
    state: list[str]
    since: list[float]                      # when the current hold began (starting / up)
    held: list[list[tuple[float, float]]]   # closed holds per replica
    counts: list[tuple[float, list[int]]] = field(default_factory=list)   # (t, up per pool) at each change

    @classmethod
    def of(cls, pools: list[list[int]], initial: list[int]) -> "Fleet":
        n = sum(len(p) for p in pools)
        f = cls(pools, [OFF] * n, [0.0] * n, [[] for _ in range(n)])
        for p, k in zip(pools, initial):
            for r in p[:k]:
                f.state[r] = UP
        f.note(0.0)
        return f

    def members(self, pool: int, state: str) -> list[int]:
        return [r for r in self.pools[pool] if self.state[r] == state]

    def note(self, t: float) -> None:
        """The replicas up per pool from t on (kept only when they change; one entry an instant)."""
        up = [len(self.members(k, UP)) for k in range(len(self.pools))]
        if self.counts and self.counts[-1][0] == t:
            self.counts.pop()
        if not self.counts or self.counts[-1][1] != up:
            self.counts.append((t, up))

    def stop(self, r: int, t: float) -> None:
        """Replica r gives its GPUs back at t."""
        self.held[r].append((self.since[r], t))
        self.state[r] = OFF

    def hours(self, end: float) -> list[float]:
        """GPU-holding seconds per replica up to `end` (open holds end there)."""
        out = []
        for r, holds in enumerate(self.held):
            s = sum(b - a for a, b in holds)
            if self.state[r] != OFF:
                s += max(0.0, end - self.since[r])
            out.append(s)
        return out
