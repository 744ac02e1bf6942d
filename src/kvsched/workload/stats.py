"""A workload in numbers (`kvsched workload stats`), computed as the bundled traces' README.md (kvsched/data/traces)
states: percentiles by numpy's linear interpolation; span = last - first arrival; mean rate
= (n - 1) / span; CV = population std / mean of the gaps between consecutive arrivals, zero
gaps kept; repeated prefix share = blocks whose hash appeared earlier / all blocks. With
sessions, the arrival figures are those of the sessions' first turns."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvsched.workload.request import Workload


def token_summary(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(x.mean()), "median": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)), "max": float(x.max())}


def arrival_summary(t: np.ndarray) -> dict[str, float | None]:
    span = float(t[-1] - t[0]) if len(t) > 1 else 0.0
    gaps = np.diff(t)
    return {"span_s": span, "mean_rate": (len(t) - 1) / span if span > 0 else None,
            "cv_interarrival": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else None}


def repeated_prefix_share(w: Workload) -> float | None:
    if w.prefix is None or not len(w.prefix.values):
        return None
    return 1.0 - len(np.unique(w.prefix.values)) / len(w.prefix.values)


def describe(w: Workload) -> dict[str, Any]:
    out: dict[str, Any] = {"source": w.source, "requests": len(w)}
    closed = w.closed_loop
    firsts = w.session_prev < 0             # a later turn's stored arrival is a placeholder
    out.update(arrival_summary(w.arrival[firsts]) if w.timed and not closed else
               {"span_s": None, "mean_rate": None, "cv_interarrival": None})
    out["sessions"] = int(firsts.sum()) if w.has_sessions else None
    out["arrival_times"] = w.timed
    out["closed_loop_concurrency"] = list(dict.fromkeys(w.concurrency.tolist())) if closed else None
    out["input_tokens"] = token_summary(w.prompt)
    out["output_tokens"] = token_summary(w.output)
    out["output_known"] = bool(w.output_known.all())
    out["repeated_prefix_block_share"] = repeated_prefix_share(w)
    out["phases"] = [_phase(w, k, name) for k, name in enumerate(w.phases)] if len(w.phases) > 1 else []
    out["tiers"] = [{"name": t.name, "share": float((w.tier_index == j).mean()), "ttft_slo_s": t.ttft_slo,
                     "tbt_slo_s": t.tbt_slo, "priority": t.priority} for j, t in enumerate(w.tiers)]
    return out


def _phase(w: Workload, k: int, name: str) -> dict[str, Any]:
    mask = w.phase == k
    row: dict[str, Any] = {"name": name, "requests": int(mask.sum()),
                           "mean_input": float(w.prompt[mask].mean()) if mask.any() else None,
                           "mean_output": float(w.output[mask].mean()) if mask.any() else None}
    if w.closed_loop:
        row["concurrency"] = int(w.concurrency[mask][0]) if mask.any() else None
    elif w.timed:
        row["mean_rate"] = arrival_summary(w.arrival[mask & (w.session_prev < 0)])["mean_rate"]
    return row
