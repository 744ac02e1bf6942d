"""One point of an experiment: a scenario at one arrival rate and seed, simulated, and the
figures kept from it. `kvsched capacity` and `kvsched sweep` run points, in this process or
in worker processes (a `Point` pickles: it holds options, not a built workload)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsched.errors import KvschedError
from kvsched.run import Result, Scenario, simulate
from kvsched.workload.source import WorkloadOptions, load

QUANTILES = np.arange(101)          # percentiles kept of TTFT and TPOT (the distributions in reports)
TIMELINE_BINS = 200                 # time bins kept of queue length, running requests and KV use


@dataclass
class Point:
    """`template` is the scenario without its workload; the workload is built from `workload`
    with `rate` (None: the workload's own) and `seed`, which also seeds the router."""
    workload: WorkloadOptions
    template: Scenario
    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    rate: float | None = None
    seed: int = 0
    decode: dict[str, Any] = field(default_factory=dict)    # simulate()'s decode_policy / decode_params

    def scenario(self) -> Scenario:
        opts = dataclasses.replace(self.workload, rate=self.rate, seed=self.seed)
        return dataclasses.replace(self.template, workload=load(opts), router_seed=self.seed)

    def run(self, timeline: bool = True) -> Result:
        return simulate(self.scenario(), self.policy, self.params, record_timeline=timeline, **self.decode)


def figures(result: Result) -> dict[str, Any]:
    """The summary's numbers, flat (tiers as `tier_<name>_<key>`), with the percentiles of TTFT
    and TPOT in ms (`ttft_quantiles_ms`, `tpot_quantiles_ms`, 0..100) and the timeline in
    `TIMELINE_BINS` equal time bins (`timeline`: time, queue_length, running, kv_usage)."""
    out: dict[str, Any] = {}
    for key, value in result.summary.items():
        if key == "tiers":
            for tier in value:
                out.update({f"tier_{tier['name']}_{k}": v for k, v in tier.items() if _scalar(v) and k != "name"})
        elif _scalar(value) and key != "wall_seconds":
            out[key] = value
    rec = result.records
    done = np.isfinite(rec.finished)
    first = rec.client.times(rec)[0] if rec.client is not None else rec.first_token    # as the summary's TTFT
    ttft = (first - rec.arrival)[done] * 1000
    multi = done & (rec.output > 1)
    tpot = (rec.finished - rec.first_token)[multi] / (rec.output[multi] - 1) * 1000
    out["ttft_quantiles_ms"] = np.percentile(ttft, QUANTILES).tolist() if len(ttft) else []
    out["tpot_quantiles_ms"] = np.percentile(tpot, QUANTILES).tolist() if len(tpot) else []
    total = result.summary.get("kv_capacity_total_tokens")
    out["timeline"] = binned_timeline(result.timeline, rec.kv_capacity_tokens, total=total) \
        if result.timeline is not None else []
    return out


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, np.generic))


def binned_timeline(rows, kv_capacity: int, bins: int = TIMELINE_BINS, total: int | None = None) -> list[list[float]]:
    """Rows (time, queue, running, KV tokens[, replica]) as `bins` equal time bins: each bin's
    mean per replica, summed over replicas; KV as a share of all replicas' capacity (`total`
    where replicas differ, kvsched/pools.py; else kv_capacity x replicas). Empty bins are left
    out."""
    a = np.asarray(list(rows), dtype=np.float64)
    if len(a) == 0:
        return []
    rep = a[:, 4].astype(np.int64) if a.shape[1] > 4 else np.zeros(len(a), np.int64)
    n_rep = int(rep.max()) + 1
    t0, t1 = float(a[:, 0].min()), float(a[:, 0].max())
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    b = np.minimum(((a[:, 0] - t0) / width).astype(np.int64), bins - 1)
    idx = b * n_rep + rep
    count = np.bincount(idx, minlength=bins * n_rep)
    with np.errstate(invalid="ignore"):
        means = [np.nan_to_num(np.bincount(idx, a[:, c], bins * n_rep) / count).reshape(bins, n_rep).sum(axis=1)
                 for c in (1, 2, 3)]
    used = count.reshape(bins, n_rep).sum(axis=1) > 0
    mid = t0 + (np.arange(bins) + 0.5) * width
    held = total if total is not None else kv_capacity * n_rep
    return [[float(mid[k]), float(means[0][k]), float(means[1][k]), float(means[2][k]) / held]
            for k in np.flatnonzero(used)]

def check_rate(rate: float, flag: str = "rate") -> float:
    if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise KvschedError(f"{flag} must be a finite number > 0 requests per second, got {rate!r}")
    return float(rate)
