"""Terminal tables of run summaries."""
from __future__ import annotations

import math
from typing import Any, Sequence

from rich.table import Table

ROWS = [
    ("completed", "completed"), ("rejected", "rejected"), ("duration", "duration s"),
    ("request_throughput", "requests/s"), ("request_goodput", "goodput req/s"),
    ("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"),
    ("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"), ("median_tpot_ms", "median TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"),
    ("mean_itl_ms", "mean ITL ms"), ("median_itl_ms", "median ITL ms"), ("p99_itl_ms", "p99 ITL ms"),
    ("mean_e2el_ms", "mean E2EL ms"), ("p99_e2el_ms", "p99 E2EL ms"),
    ("mean_kv_usage", "mean KV use"), ("peak_kv_usage", "peak KV use"),
    ("peak_queue_length", "peak queue"), ("preemptions", "preemptions"),
    ("iterations", "iterations"), ("simulated_seconds", "simulated s"), ("wall_seconds", "wall s"),
]
PERCENT = {"mean_kv_usage", "peak_kv_usage"}


def _fmt(key: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key in PERCENT:
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def summary_table(s: dict[str, Any]) -> Table:
    t = Table(title=f"{s.get('policy')} on {s.get('model')} / {s.get('gpu')} ({s.get('cost_model')} cost)",
              title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in ROWS:
        t.add_row(label, _fmt(key, s.get(key)))
    return t


def comparison_table(summaries: Sequence[dict[str, Any]]) -> Table:
    first = summaries[0]
    t = Table(title=f"{first.get('model')} / {first.get('gpu')} ({first.get('cost_model')} cost)",
              title_justify="left")
    t.add_column("metric")
    for s in summaries:
        t.add_column(str(s.get("policy")), justify="right")
    for key, label in ROWS:
        t.add_row(label, *(_fmt(key, s.get(key)) for s in summaries))
    return t
