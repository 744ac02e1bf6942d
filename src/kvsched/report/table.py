"""Terminal tables of run summaries."""
from __future__ import annotations

import math
from typing import Any, Sequence

from rich.console import Group
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


def _num(v: float | None, digits: int = 1) -> str:
    """Integers as integers, other values with `digits` decimals: never rounds a .5 away."""
    if v is None:
        return "-"
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.{digits}f}"


def workload_table(s: dict[str, Any]) -> Group:
    """`kvsched workload stats` as two tables: arrivals and more, then token percentiles."""
    t = Table()
    t.add_column("statistic")
    t.add_column("value", justify="right")
    t.add_row("source", str(s["source"]))
    t.add_row("requests", f"{s['requests']:,}")
    if s["closed_loop_concurrency"] is not None:
        t.add_row("arrivals", "closed loop, c = " + " -> ".join(map(str, s["closed_loop_concurrency"])))
    elif not s["arrival_times"]:
        t.add_row("arrivals", "none (lengths only: give --rate or --arrivals)")
    else:
        t.add_row("span s", _num(s["span_s"], 3))
        t.add_row("mean rate req/s", _num(s["mean_rate"], 3))
        t.add_row("CV of inter-arrival gaps", _num(s["cv_interarrival"], 3))
    if s["repeated_prefix_block_share"] is not None:
        t.add_row("repeated prefix blocks", f"{s['repeated_prefix_block_share']:.1%}")
    t.add_row("output lengths known", "yes" if s["output_known"] else "no")
    for p in s["phases"]:
        how = f"c = {p['concurrency']}" if "concurrency" in p else f"{_num(p['mean_rate'], 3)} req/s"
        t.add_row(f"phase {p['name']}", f"{p['requests']:,} requests, mean {_num(p['mean_input'])} in / "
                                        f"{_num(p['mean_output'])} out, {how}")
    for tier in s["tiers"]:
        slo = ", ".join(f"{k.split('_')[0].upper()} {tier[k]:g} s" for k in ("ttft_slo_s", "tbt_slo_s") if tier[k] is not None)
        t.add_row(f"tier {tier['name']}", f"{tier['share']:.1%} (priority {tier['priority']}{', ' + slo if slo else ''})")
    tokens = Table(title_justify="left")
    cols = ("mean", "median", "p90", "p99", "max")
    tokens.add_column("tokens")
    for c in cols:
        tokens.add_column(c, justify="right")
    for kind in ("input", "output"):
        tokens.add_row(kind, *(_num(s[f"{kind}_tokens"][c]) for c in cols))
    return Group(t, tokens)
