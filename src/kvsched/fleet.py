"""What a run costs (docs/control-plane.md, "Cost and energy"): GPU-hours, dollars and joules,
and per million output tokens (`gpu_hours`, `usd`, `joules`, `usd_per_mtok`,
`joules_per_mtok` in summary.json).

- GPU-hours: each replica's GPUs (tp x pp x dp) times the seconds it held them: a fixed
  fleet from t = 0 to the run's end (the last finish or arrival), an autoscaled replica from
  the decision that started it (its cold start is paid for) to its drain's end.
- Dollars: GPU-hours times the GPU's price per GPU-hour (prices.py: the bundled table or
  --prices FILE); None when a GPU has no price.
- Power: P(u) = P_idle + (P_peak - P_idle) u per GPU, linear in utilisation u, the server
  power model of Fan, Weber and Barroso, "Power provisioning for a warehouse-sized computer"
  (ISCA 2007, section 4.1). u is the share of time a batch runs (NVML's utilization.gpu: the
  share of a sample period during which a kernel ran), so a replica's energy is
  GPUs x (P_idle x held seconds + (P_peak - P_idle) x busy seconds); cold starts and adapter
  loads draw idle power. P_peak is the board power of the GPU file (`power`, from datasheets)
  and P_idle its `idle_power`; the bundled idle figures are an assumption (15% of the board
  power), not measurements: give yours in a GPU file.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from kvsched.errors import KvschedError

MAX_BUCKETS = 1_000_000     # windows of `over_time` at most
POWER_MODEL = "P = idle_power + (power - idle_power) x busy share, per GPU (Fan, Weber, Barroso, ISCA 2007)"


def run_end(records) -> float:
    """The last finish or arrival of the run (seconds; 0 for an empty run)."""
    done = np.isfinite(records.finished)
    times = [float(records.finished[done].max()) if done.any() else 0.0]
    if len(records.arrival):
        times.append(float(np.max(records.arrival)))
    return max(times)


def fleet_summary(holds: Sequence[float], busy: Sequence[float], gpus: Sequence, gpus_per_replica: Sequence[int],
                  output_tokens: int, prices: dict[str, Any]) -> dict[str, Any]:
    """The cost and energy figures of replicas that held their GPUs `holds` seconds and ran
    batches `busy` seconds (module docstring)."""
    hours = [h * n / 3600 for h, n in zip(holds, gpus_per_replica)]
    table = prices["per_gpu_hour"]
    priced = all(g.name in table for g in gpus)
    usd = sum(h * table[g.name] for h, g in zip(hours, gpus)) if priced else None
    powered = all(g.power > 0 for g in gpus)
    joules = sum(n * (g.idle_power * h + (g.power - g.idle_power) * min(b, h))
                 for h, b, g, n in zip(holds, busy, gpus, gpus_per_replica)) if powered else None
    mtok = output_tokens / 1e6

    def per(x: float | None) -> float | None:
        return x / mtok if x is not None and mtok > 0 else None
    out = {"gpu_hours": sum(hours), "usd": usd, "joules": joules, "usd_per_mtok": per(usd),
           "joules_per_mtok": per(joules), "power_model": POWER_MODEL,
           "prices": {"source": prices["source"], "date": prices["date"]}}
    if not priced:
        out["prices"]["missing"] = sorted({g.name for g in gpus if g.name not in table})
    return out


def over_time(records, counts: list[tuple[float, list[int]]], bucket_s: float, end: float,
              ttft_slo_s: float | None, dropped: np.ndarray | None) -> list[dict[str, Any]]:
    """Per `bucket_s` window of arrivals: requests, completed, shed or abandoned, p99 TTFT (ms,
    as the summary's: the client's where it has a client path), the share meeting the TTFT
    SLO (`ttft_slo_s`, else each request's tier's; dropped requests count as missing it; None
    when no request has one), and the mean replicas up (time-weighted from the fleet's
    `counts`)."""
    rows = []
    arrival = records.arrival
    first = records.client.times(records)[0] if records.client is not None else records.first_token   # as the summary's
    windows = end / bucket_s
    if not windows <= MAX_BUCKETS:
        raise KvschedError(f"--report-bucket {bucket_s:g} s cuts a run of {end:.6g} s into more than {MAX_BUCKETS:,} "
                           "windows")
    n_buckets = max(1, math.ceil(windows - 1e-12))
    order = np.argsort(arrival, kind="stable")          # each window's requests by one search
    edges = np.searchsorted(arrival[order], np.arange(n_buckets + 1) * bucket_s, side="left")
    if ttft_slo_s is None and records.tiers:            # each request against its tier's TTFT SLO
        slos = np.array([math.nan if t.ttft_slo is None else t.ttft_slo for t in records.tiers] + [math.nan])
        bound = slos[records.tier_index]
    else:
        bound = np.full(len(arrival), math.nan if ttft_slo_s is None else ttft_slo_s)
    times = np.array([t for t, _ in counts] + [end])
    ups = np.array([sum(u) for _, u in counts], np.float64)
    kept = ~records.rejected
    done = np.isfinite(records.finished)
    lost_all = dropped > 0 if dropped is not None else np.zeros(len(arrival), bool)
    for b in range(n_buckets):
        lo, hi = b * bucket_s, (b + 1) * bucket_s
        mine = order[edges[b]:edges[b + 1]]            # this window's requests (indices), served or not
        mine = mine[kept[mine]]
        wait = first[mine] - arrival[mine]
        served = np.isfinite(wait)
        limit = bound[mine]
        judged = np.isfinite(limit)
        row = {"start_s": lo, "requests": len(mine), "completed": int(done[mine].sum()),
               "dropped": int(lost_all[mine].sum()),
               "p99_ttft_ms": float(np.percentile(wait[served], 99)) * 1000 if served.any() else None,
               "slo_attainment": None, "mean_replicas": _mean_between(times, ups, lo, min(hi, end))}
        if judged.any():
            row["slo_attainment"] = int((judged & served & (wait <= limit)).sum()) / int(judged.sum())
        rows.append(row)
    return rows


def _mean_between(times: np.ndarray, values: np.ndarray, lo: float, hi: float) -> float | None:
    """Time-weighted mean of a step function (values[k] from times[k] to times[k+1]) over [lo, hi)."""
    if hi <= lo:
        return None
    starts, ends = np.maximum(times[:-1], lo), np.minimum(times[1:], hi)
    w = np.clip(ends - starts, 0, None)
    return float((values * w).sum() / (hi - lo))
