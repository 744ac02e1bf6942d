"""Terminal tables of run summaries."""
from __future__ import annotations

import math
from typing import Any, Sequence

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

ROWS = [
    ("completed", "completed"), ("rejected", "rejected"), ("duration", "duration s"),
    ("request_throughput", "requests/s"), ("request_goodput", "goodput req/s"),
    ("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"),
    ("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"), ("median_tpot_ms", "median TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"),
    ("mean_itl_ms", "mean ITL ms"), ("median_itl_ms", "median ITL ms"), ("p99_itl_ms", "p99 ITL ms"),
    ("mean_e2el_ms", "mean E2EL ms"), ("p99_e2el_ms", "p99 E2EL ms"),
    ("engine_mean_ttft_ms", "engine mean TTFT ms"), ("engine_mean_e2el_ms", "engine mean E2EL ms"),
    ("mean_kv_usage", "mean KV use"), ("peak_kv_usage", "peak KV use"),
    ("peak_queue_length", "peak queue"), ("preemptions", "preemptions"),
    ("iterations", "iterations"), ("simulated_seconds", "simulated s"), ("wall_seconds", "wall s"),
    ("replicas", "replicas"), ("router", "router"), ("prefill_replicas", "prefill replicas"),
    ("decode_replicas", "decode replicas"), ("decode_policy", "decode policy"),
    ("mean_transfer_ms", "mean KV transfer ms"), ("p99_transfer_ms", "p99 KV transfer ms"),
    ("prefill_busy_fraction", "prefill pool busy"), ("decode_busy_fraction", "decode pool busy"),
    ("prefix_hit_rate", "prefix hit rate (tokens)"), ("prefix_block_hit_rate", "prefix hit rate (blocks)"),
    ("prefill_tokens_saved", "prefill tokens saved"), ("prefix_evictions", "cached blocks evicted"),
    ("tier_reads", "KV tiers read (--kv-tier)"), ("tier_loads", "loads from KV tiers"),
    ("shed", "shed (--admit, --shed)"), ("abandoned", "abandoned (--abandon-after)"),
    ("gpu_hours", "GPU-hours"), ("usd", "USD"), ("usd_per_mtok", "USD per M output tokens"),
    ("joules_per_mtok", "joules per M output tokens"),
]
OPTIONAL = {"engine_mean_ttft_ms", "engine_mean_e2el_ms", "replicas", "router", "prefill_replicas", "decode_replicas", "decode_policy", "mean_transfer_ms",
            "p99_transfer_ms", "prefill_busy_fraction", "decode_busy_fraction", "prefix_hit_rate",
            "prefix_block_hit_rate", "prefill_tokens_saved", "prefix_evictions", "tier_reads",
            "tier_loads", "shed", "abandoned"}   # shown when present
PERCENT = {"mean_kv_usage", "peak_kv_usage", "prefix_hit_rate", "prefix_block_hit_rate", "prefill_busy_fraction", "decode_busy_fraction",
           "busy_fraction", "ttft_slo_attainment", "tbt_slo_attainment", "itl_slo_attainment"}
REPLICA_ROWS = 32         # per-replica rows a terminal table shows (JSON and files hold all)
REPLICA_COLUMNS = [("replica", "replica"), ("role", "role"), ("completed", "completed"),
                   ("request_throughput", "requests/s"), ("mean_ttft_ms", "mean TTFT ms"),
                   ("iterations", "iterations"), ("preemptions", "preemptions"), ("busy_fraction", "busy"),
                   ("mean_kv_usage", "mean KV use"), ("peak_queue_length", "peak queue")]

# per-tier figures (summary["tiers"]): key, short column label, label in comparison rows;
# p99_tbt_first_zero_ms only when the run asked for it, SLO shares only for tiers that set SLOs
TIER_COLUMNS = [("name", "tier", "tier"), ("requests", "requests", "requests"), ("completed", "done", "completed"),
                ("shed", "shed", "shed"), ("abandoned", "abandoned", "abandoned"),
                ("median_ttft_ms", "p50 TTFT ms", "median TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms", "p99 TTFT ms"),
                ("p99_itl_ms", "p99 ITL ms", "p99 ITL ms"),
                ("p99_tbt_first_zero_ms", "p99 TBT0 ms", "p99 TBT with first-token 0s ms"),
                ("ttft_slo_attainment", "TTFT ok", "requests meeting TTFT SLO"),
                ("tbt_slo_attainment", "TBT ok", "requests meeting TBT SLO"),
                ("itl_slo_attainment", "gaps ok", "gaps within TBT SLO")]
TIER_CAPTION = ("TTFT ok / TBT ok: share of requests meeting the tier's TTFT SLO / never exceeding its TBT "
                "SLO; gaps ok: share of inter-token gaps within the TBT SLO; p99 TBT0: p99 with a 0 s gap "
                "per first token (SLAI's telemetry)")

def _fmt(key: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if key in PERCENT:
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(k, label) for k, label in ROWS if k not in OPTIONAL or any(k in s for s in summaries)]


def summary_table(s: dict[str, Any]) -> Table | Group:
    t = Table(title=f"{s.get('policy')} on {s.get('model')} / {s.get('gpu')} ({s.get('cost_model')} cost)",
              title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in _rows([s]):
        t.add_row(label, _fmt(key, s.get(key)))
    parts: list[Table] = [t]
    if s.get("tiers"):
        cols = [(k, label) for k, label, _ in TIER_COLUMNS if any(row.get(k) is not None for row in s["tiers"])]
        tiers = Table(title="per tier", title_justify="left", caption=TIER_CAPTION, caption_justify="left")
        for _, label in cols:
            tiers.add_column(label, justify="right")
        for row in s["tiers"]:
            tiers.add_row(*(escape(_fmt(k, row.get(k))) for k, _ in cols))
        parts.append(tiers)
    if s.get("replica_breakdown"):
        rows = s["replica_breakdown"]
        shown = rows[:REPLICA_ROWS]         # a 1,000-replica table is unreadable (and slow) in a terminal
        caption = (f"the first {len(shown)} of {len(rows):,} replicas; --json and --out's summary.json "
                   "hold every one" if len(shown) < len(rows) else None)
        per = Table(title="per replica", title_justify="left", caption=caption, caption_justify="left")
        for _, label in REPLICA_COLUMNS:
            per.add_column(label, justify="right")
        for row in shown:
            per.add_row(*(_fmt(k, row.get(k)) for k, _ in REPLICA_COLUMNS))
        parts.append(per)
    return t if len(parts) == 1 else Group(*parts)


def comparison_table(summaries: Sequence[dict[str, Any]]) -> Table:
    first = summaries[0]
    t = Table(title=f"{first.get('model')} / {first.get('gpu')} ({first.get('cost_model')} cost)",
              title_justify="left")
    t.add_column("metric")
    for s in summaries:
        t.add_column(str(s.get("policy")), justify="right")
    for key, label in _rows(summaries):
        t.add_row(label, *(_fmt(key, s.get(key)) for s in summaries))
    names = list(dict.fromkeys(row["name"] for s in summaries for row in s.get("tiers") or ()))
    for name in names:
        rows = [next((row for row in s.get("tiers") or () if row["name"] == name), {}) for s in summaries]
        for key, _, label in TIER_COLUMNS[3:]:
            if any(row.get(key) is not None for row in rows):
                t.add_row(escape(f"tier {name}: {label}"), *(_fmt(key, row.get(key)) for row in rows))
    return t


def _num(v: float | None, digits: int = 1) -> str:
    """Integers as integers, other values with `digits` decimals: never rounds a .5 away."""
    if v is None:
        return "-"
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.{digits}f}"


def _fluid_caption(p: dict[str, Any], fl: dict[str, Any]) -> str:
    """How the fluid figures relate to mu's: two batch-time models, two limits."""
    binds = ("compute binds first: the fluid limit is below mu" if fl["max_rate"] < p["mu"] else
             "memory binds first: mu is below the fluid limit")
    at_mu = _num(fl["M_star_at_mu"], 0)
    held = ("more than" if fl["M_star_at_mu"] > p["kv_capacity"] else "within") + f" M = {p['kv_capacity']:,}"
    return (f"Batch time: {fl['batch_time_model']}. Throughput: the fluid model is stable up to "
            f"{_num(fl['max_rate'], 4)} req/s per GPU, mu = {p['mu']:.4g}; {binds}. At mu the fluid iteration "
            f"takes {_ms(fl['iteration_time_at_mu'])} against b = {_ms(fl['batch_time_b'])}, holding M* = {at_mu} "
            f"tokens, {held} (the fluid model has no memory limit).")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1000:.2f} ms"


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


def plan_report(p: dict[str, Any]) -> Group:
    """`kvsched plan` as tables: capacity, then the fluid and EB figures behind it."""
    cap = Table(title=f"Capacity plan: {p['workload']} on {p['model']} / {p['gpu']}", title_justify="left")
    cap.add_column("quantity")
    cap.add_column("value", justify="right")
    cap.add_column("from")
    rows = [
        ("arrival rate lambda", f"{p['rate']:.4g} req/s", "--rate or the workload"),
        ("KV capacity M", f"{p['kv_capacity']:,} tokens", "model, GPU, memory utilization"),
        ("batch time b", f"{p['batch_time'] * 1000:.2f} ms", p["batch_time_source"]),
        ("E[g(s,o)]", f"{p['mean_lifetime_memory']:,.0f} token-batches", f"chunk {p['chunk_size']} (stability eq. 1)"),
        ("service rate mu", f"{p['mu']:.4g} req/s per GPU", "M / (b E[g])"),
        ("delta", f"{p['delta']:.4f}", "max(s + o) / M"),
        ("stable below", f"{p['stable_rate']:.4g} req/s per GPU", "mu (1 - delta), Theorem 4.2"),
        ("GPUs needed", str(p["gpus_needed"]), f"ceil(lambda / (mu x {p['utilization']:g}))"),
        ("per-GPU load", f"{p['per_gpu_load']:.1%} of mu", f"{p['per_gpu_rate']:.4g} req/s each"),
    ]
    for row in rows:
        cap.add_row(*(escape(c) for c in row))
    out = [cap]
    fl = p["fluid"]
    if "M_star" in fl:
        t = Table(title="Fluid benchmark per GPU (fluid-wait-nested-wait.txt eqs. 6-8)", title_justify="left",
                  caption=_fluid_caption(p, fl), caption_justify="left")
        for c in ("d0 s", "d1 s/token", "M* tokens", "time per iteration", "throughput* tok/s", "fits in M"):
            t.add_column(c, justify="right")
        t.add_row(f"{fl['d0']:.4g}", f"{fl['d1']:.3g}", _num(fl["M_star"], 0), _ms(fl["iteration_time"]),
                  _num(fl["throughput_star"], 1), "yes" if fl["fits_memory"] else "no")
        out.append(t)
    e = p["eb"]
    if "theta0" in e:
        t = Table(title="Exclusive batching (exclusive-batching-eb.txt eqs. 3, 5, 6, 7)", title_justify="left",
                  caption=e.get("note"), caption_justify="left")
        for c in ("p0", "eta", "theta0", "delta theta", "N*", "k*", "crossover favours"):
            t.add_column(c, justify="right")
        t.add_row(f"{e['p0']:.4g}", f"{e['eta']:.3g}", f"{e['theta0']:.4f}", f"{e['delta_theta']:.4f}",
                  f"{e['n_star']:,}", f"{e['k_star']:,}", e.get("crossover", {}).get("favours", "-"))
        out.append(t)
    v = p.get("validation")
    if v:
        short = not (v.get("judged", True) and v["above_mu"].get("judged", True))
        t = Table(title="Simulated replica (vllm-v1): at the plan's load, and at 1.05 mu where it must be unstable",
                  title_justify="left", caption_justify="left",
                  caption=("runs shorter than 4 mean latencies cannot show a queue building: give more "
                           "--num-requests" if short else
                           "the plan agrees with simulation" if v["consistent"] else
                           "the plan and the simulation DISAGREE"))
        for c in ("arrival req/s", "mean queue, 2nd quarter", "mean queue, last quarter", "mean e2e s, 2nd quarter",
                  "mean e2e s, last quarter", "verdict"):
            t.add_column(c, justify="right")
        for x in (v, v["above_mu"]):
            t.add_row(f"{x['arrival_rate']:.4g}", f"{x['mean_queue_q2']:.1f}", f"{x['mean_queue_q4']:.1f}",
                      _num(x["mean_e2el_q2"], 2), _num(x["mean_e2el_q4"], 2),
                      ("stable" if x["stable"] else "NOT stable") + ("" if x.get("judged", True) else
                                                                     " (run too short to judge)"))
        out.append(t)
    out.append(Text(f"Next: {p['next_step']}."))
    return Group(*out)
