"""Capacity at SLOs (`kvsched capacity`): the largest arrival rate at which a configuration
meets its latency SLOs and stays stable, found by bisection over rate in simulation with the
stability service rate mu = M / (b E[g(s,o)]) (stability-capacity.txt eq. 1) as the upper
bracket; and, for a target rate, the replicas needed, closed form beside simulated.

Method (docs/capacity.md):
- A rate *meets* for a seed when every SLO figure of the run is within its bound (or the
  goodput attainment reaches its target) and the run is stable (`theory.plan.queue_verdict`:
  no upward queue trend, throughput keeping up with arrivals). The stability check keeps a
  finite run from passing a rate above capacity because its queue had no time to grow.
- Each seed is searched on its own: hi = mu (times the replicas); while hi meets, lo = hi and
  hi grows by `EXPAND` (a policy may beat the vllm-v1 model behind mu), at most
  `MAX_EXPANSIONS` times; then bisection until hi - lo <= tolerance x mu. The seed's capacity
  is lo (0 when no rate down to tolerance x mu meets).
- `max_rate` is the median of the seeds' capacities; the spread is their min and max. The
  SLO figures are then measured at `max_rate` on every seed (means and per-seed verdicts).
- Seeds share random numbers across rates: the same seed at another rate rescales the same
  arrival gaps (`Arrivals.with_rate`), which keeps the SLO figures close to monotone in rate.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from kvsched import workers
from kvsched.errors import KvschedError
from kvsched.metrics import Goodput
from kvsched.point import Point, figures
from kvsched.theory.plan import JUDGE_WINDOW, queue_verdict

METRICS = ("ttft", "tpot", "itl", "e2el")


class Infeasible(KvschedError):
    """No cluster size meets the SLOs at the rate (a configuration that cannot serve it)."""

STATS = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99"}
EXPAND = 1.25               # bracket growth while the upper end still meets the SLOs
MAX_EXPANSIONS = 8          # 1.25^8 = 6x mu at most
DEFAULT_TOLERANCE = 0.02    # stop when the bracket is within 2% of mu


@dataclass(frozen=True)
class Slo:
    """METRIC:STAT:MS, e.g. ttft:p99:2000: the run's STAT of METRIC within MS milliseconds."""
    metric: str
    stat: str
    ms: float

    @classmethod
    def parse(cls, text: str) -> "Slo":
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in METRICS or parts[1] not in STATS:
            raise KvschedError(f"--slo expects METRIC:STAT:MS with METRIC in {', '.join(METRICS)} and STAT in "
                               f"{', '.join(STATS)}, got {text!r}")
        try:
            ms = float(parts[2])
        except ValueError:
            raise KvschedError(f"--slo {text}: {parts[2]!r} is not a number of milliseconds") from None
        if not (math.isfinite(ms) and ms > 0):
            raise KvschedError(f"--slo {text}: the bound must be > 0 ms")
        return cls(parts[0], parts[1], ms)

    @property
    def key(self) -> str:
        """The summary figure it bounds (vLLM's benchmark names)."""
        return f"{STATS[self.stat]}_{self.metric}_ms"

    def met(self, fig: dict[str, Any]) -> bool:
        v = fig.get(self.key)
        return v is not None and math.isfinite(v) and v <= self.ms

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "stat": self.stat, "ms": self.ms, "key": self.key}


@dataclass(frozen=True)
class Attainment:
    """A goodput attainment: the share of requests meeting every goodput SLO (vLLM's
    request_goodput over request_throughput) at least `target`."""
    target: float
    goodput: Goodput
    key = "goodput_attainment"

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise KvschedError(f"--attainment must be in (0, 1], got {self.target}")
        if all(v is None for v in (self.goodput.ttft, self.goodput.tpot, self.goodput.e2el)):
            raise KvschedError("--attainment needs --goodput SLOs (ttft:MS tpot:MS e2el:MS)")

    def met(self, fig: dict[str, Any]) -> bool:
        v = fig.get(self.key)
        return v is not None and v >= self.target

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "goodput": dataclasses.asdict(self.goodput)}


@dataclass
class Criteria:
    slos: list[Slo]
    attainment: Attainment | None = None

    def __post_init__(self) -> None:
        if not self.slos and self.attainment is None:
            raise KvschedError("give at least one --slo METRIC:STAT:MS, or --attainment with --goodput")

    def met(self, fig: dict[str, Any]) -> bool:
        return all(s.met(fig) for s in self.slos) and (self.attainment is None or self.attainment.met(fig))

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.slos] + ([Attainment.key] if self.attainment else [])


@dataclass
class Evaluation:
    seed: int
    rate: float
    slo_met: bool
    stable: bool
    figures: dict[str, Any]
    judged: bool = True         # False: the run was too short to judge; stable means rate <= mu

    @property
    def met(self) -> bool:
        return self.slo_met and self.stable

    def as_dict(self, full: bool = False) -> dict[str, Any]:
        figs = self.figures if full else {k: v for k, v in self.figures.items() if not isinstance(v, list)}
        return {"seed": self.seed, "rate": self.rate, "met": self.met, "slo_met": self.slo_met, "stable": self.stable,
                "stability_judged": self.judged, "figures": figs}


def evaluate(job: tuple[Point, Criteria, float]) -> Evaluation:
    """Simulate one point and judge it (module-level: it runs in worker processes). `job`'s
    last item is mu for the point's configuration: when the run is too short for the queue
    verdict (`queue_verdict`'s `judged`), the theory decides: stable up to mu, not above."""
    point, criteria, mu = job
    result = point.run(timeline=True)
    fig = figures(result)
    thr, good = fig.get("request_throughput"), fig.get("request_goodput")
    if good is not None and thr:
        fig[Attainment.key] = good / thr
    verdict = queue_verdict(result)
    stable = verdict["stable"] if verdict["judged"] else point.rate <= mu * (1 + 1e-12)
    return Evaluation(point.seed, float(point.rate), criteria.met(fig), stable, fig, verdict["judged"])


@dataclass
class SeedSearch:
    """One seed's bracket: lo meets (0: none yet), hi fails (None: not found yet)."""
    seed: int
    hi: float
    lo: float = 0.0
    failed_at: float | None = None
    expansions: int = 0
    reason: str = ""            # why the smallest failing rate failed: "slo" or "stability"
    done: bool = False

    def next_rate(self, tolerance: float) -> float | None:
        if self.done:
            return None
        if self.failed_at is None:
            return self.hi
        if self.failed_at - self.lo <= tolerance:
            self.done = True
            return None
        return (self.lo + self.failed_at) / 2

    def record(self, ev: Evaluation) -> None:
        if ev.met:
            self.lo = ev.rate
            if self.failed_at is None:
                if self.expansions == MAX_EXPANSIONS:
                    self.done, self.reason = True, "bracket"
                else:
                    self.expansions += 1
                    self.hi = ev.rate * EXPAND
        else:
            self.failed_at = ev.rate
            self.reason = "slo" if not ev.slo_met else "stability"


@dataclass
class Search:
    """Bisection over rate for every seed, in lock step so the seeds run in parallel."""
    point: Point
    criteria: Criteria
    mu: float
    seeds: list[int]
    tolerance: float = DEFAULT_TOLERANCE
    jobs: int = 0
    progress: Callable[[int, int], None] | None = None
    evaluations: list[Evaluation] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tolerance) and 0 < self.tolerance < 1):
            raise KvschedError(f"--tolerance must be in (0, 1), got {self.tolerance}")
        if not (math.isfinite(self.mu) and self.mu > 0):
            raise KvschedError(f"the service rate mu must be > 0 req/s, got {self.mu}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise KvschedError(f"--seeds must be distinct, got {self.seeds}")

    def steps(self) -> int:
        """Evaluations per seed, an upper bound for the progress bar."""
        return 1 + math.ceil(math.log2(1 / self.tolerance)) + 1

    def run(self, pool) -> dict[str, Any]:
        searches = [SeedSearch(s, self.mu) for s in self.seeds]
        total, done = len(self.seeds) * (self.steps() + 1), 0
        while True:
            todo = [(s, r) for s in searches if (r := s.next_rate(self.tolerance * self.mu)) is not None]
            if not todo:
                break
            for (s, _), ev in zip(todo, pool([self._job(s.seed, r) for s, r in todo])):
                s.record(ev)
                self.evaluations.append(ev)
            done += len(todo)
            if self.progress:
                self.progress(min(done, total - len(self.seeds)), total)
        caps = [s.lo for s in searches]
        max_rate = float(statistics.median(caps))
        self._warn(max_rate, [s.reason for s in searches])
        out: dict[str, Any] = {
            "max_rate": max_rate, "max_rate_min": min(caps), "max_rate_max": max(caps), "max_rate_seeds": caps,
            "mu": self.mu, "max_rate_over_mu": max_rate / self.mu,
            "bounded_by": statistics.mode(s.reason for s in searches)}
        out.update(self._at(max_rate, pool))
        if self.progress:
            self.progress(total, total)
        out["evaluations"] = [e.as_dict() for e in self.evaluations]
        return out

    def _warn(self, max_rate: float, reasons: list[str]) -> None:
        """Say when the figures deserve doubt: runs too short to judge stability, a capacity
        above mu, a bracket that never failed, or no rate at all."""
        name = self.point.policy
        short = sum(not e.judged for e in self.evaluations)
        if short:
            warnings.warn(f"{name}: {short} of {len(self.evaluations)} runs were too short to judge stability "
                          f"(arrival window under {JUDGE_WINDOW:g} mean latencies), so mu decided it for them; "
                          "give more --num-requests")
        if "bracket" in reasons:
            warnings.warn(f"{name}: every rate up to {EXPAND ** MAX_EXPANSIONS:g} x mu met the SLOs on some seed; "
                          "the search stopped there")
        elif max_rate > self.mu:
            warnings.warn(f"{name}: max_rate {max_rate:.4g} req/s is above the stability service rate mu "
                          f"{self.mu:.4g} req/s (b may be too large for this policy, or the runs too short)")
        if max_rate == 0:
            warnings.warn(f"{name}: no rate down to {self.tolerance:g} x mu meets the SLOs")

    def _job(self, seed: int, rate: float) -> tuple[Point, Criteria, float]:
        return dataclasses.replace(self.point, rate=rate, seed=seed), self.criteria, self.mu

    def _at(self, rate: float, pool) -> dict[str, Any]:
        """The SLO figures at `rate` on every seed: their means, and how many seeds meet."""
        if rate <= 0:
            return {"at_max_rate": None, "at_max_rate_runs": []}
        evs = pool([self._job(s, rate) for s in self.seeds])
        keys = self.criteria.keys + ["request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                     "p99_tpot_ms"]
        at = {k: _mean(e.figures.get(k) for e in evs) for k in dict.fromkeys(keys)}
        at.update({"met": all(e.met for e in evs), "met_seeds": sum(e.met for e in evs),
                   "stable_seeds": sum(e.stable for e in evs)})
        return {"at_max_rate": at, "at_max_rate_runs": [{"seed": e.seed, **e.figures} for e in evs]}


def _mean(values: Iterable[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return float(np.mean(xs)) if xs else None


def replicas_needed(point: Point, criteria: Criteria, rate: float, mu: float, max_rate: float,
                    utilization: float, seeds: list[int], pool, requests: int,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Replicas for `rate`, closed form beside simulated.

    Closed form: ceil(rate / (mu rho)) (stability-capacity.txt, end of section 4) and
    ceil(rate / max_rate) (one replica's capacity at the SLOs, the public planners' rule).
    Simulated: a cluster of k replicas behind the scenario's router, fed `rate` with
    `requests` x k requests (each replica sees about as many as the capacity search), meets
    on every seed; searched from the second closed form, down while it meets, up until it does."""
    from kvsched.theory.stability import gpus_needed
    stab = gpus_needed(rate, mu, utilization)
    slo = math.ceil(rate / max_rate - 1e-12) if max_rate > 0 else None
    runs: dict[int, dict[str, Any]] = {}

    def meets(k: int) -> bool:
        if k not in runs:
            p = dataclasses.replace(point, template=dataclasses.replace(point.template, replicas=k),
                                    workload=dataclasses.replace(point.workload, num_requests=requests * k))
            evs = pool([(dataclasses.replace(p, rate=rate, seed=s), criteria, mu * k) for s in seeds])
            runs[k] = {"replicas": k, "met": all(e.met for e in evs), "met_seeds": sum(e.met for e in evs),
                       **{key: _mean(e.figures.get(key) for e in evs) for key in criteria.keys}}
            if progress:                # the number of cluster sizes tried is not known ahead
                progress(len(runs), len(runs) + 1)
        return runs[k]["met"]

    limit = 4 * max(stab, slo or 1) + 8
    k = slo or stab
    if meets(k):
        while k > 1 and meets(k - 1):
            k -= 1
    else:
        while not meets(k + 1):
            k += 1
            if k >= limit:
                raise Infeasible(f"no cluster of up to {limit} replicas meets the SLOs at {rate:g} req/s")
        k += 1
    return {"rate": rate, "utilization": utilization, "closed_form_stability": stab, "closed_form_slo": slo,
            "simulated": k, "runs": [runs[j] for j in sorted(runs)]}


def process_pool(jobs: int):
    """A map over evaluation jobs: in this process for one job, else in worker processes."""
    count = jobs or os.cpu_count() or 1
    if count == 1:
        return (lambda js: [evaluate(j) for j in js]), None
    ex = workers.pool(count)                # workers that die with this process, however it dies

    def run(js: list) -> list:
        from concurrent.futures.process import BrokenProcessPool
        try:
            return list(ex.map(evaluate, js))
        except BrokenProcessPool:
            raise KvschedError("a worker process died (killed, or out of memory?); run the command again, "
                               "or with --jobs 1") from None
    return run, ex


SLO_SAMPLE = 2000           # requests of the run's workload a per-replica capacity is measured on


@dataclass
class SampledPoint:
    """A point over a built workload's requests (lengths, tiers, adapters), re-timed as a Poisson
    process at `rate` seeded by `seed`: what `Search` bisects when there are no workload
    options to rebuild from (the SLO scaler inside a run, `rate_at_ttft_slo`)."""
    template: Any               # run.Scenario, its workload the sample
    policy: Any
    params: dict[str, Any]
    rate: float = 1.0
    seed: int = 0

    def run(self, timeline: bool = True):
        from kvsched.run import simulate
        from kvsched.workload.arrivals import Poisson
        w = self.template.workload
        times = Poisson(self.rate).times(np.random.default_rng(self.seed), len(w))
        sc = dataclasses.replace(self.template, workload=dataclasses.replace(w, arrival=times))
        policy = self.policy if isinstance(self.policy, str) else copy.deepcopy(self.policy)   # fresh state each run
        return simulate(sc, policy, self.params, record_timeline=timeline)


def rate_at_ttft_slo(template, policy, params: dict[str, Any] | None, ttft_slo_s: float, seed: int = 0) -> float:
    """The largest Poisson rate at which one replica of `template` (its workload's first
    `SLO_SAMPLE` requests, re-timed) keeps p99 TTFT within `ttft_slo_s` and stays stable: the
    capacity search of `kvsched capacity` (`Search`, one seed, 5% tolerance), which the SLO
    scaler divides the forecast rate by (sim/autoscale.py)."""
    from kvsched.theory.plan import PlanInputs, service_rate
    w = template.workload
    sample = w.take(np.arange(min(len(w), SLO_SAMPLE)))
    one = dataclasses.replace(template, workload=sample)
    mu = service_rate(PlanInputs(one, seed=seed))[0].mu
    criteria = Criteria([Slo("ttft", "p99", ttft_slo_s * 1000)])
    point = SampledPoint(one, policy, dict(params or {}), seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the search's doubts are about its own short runs
        res = Search(point, criteria, mu, [seed], tolerance=0.05).run(lambda js: [evaluate(j) for j in js])
    return float(res["max_rate"])
