"""`kvsched capacity`: the largest arrival rate at which a configuration meets its SLOs."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from kvsched.cli.common import (ClusterOptions, HardwareOptions, JsonOpt, Progress, app, cluster_flags, emit, guard,
                                hardware_flags, workload_flags)
from kvsched.cli.theory import ChunkOpt
from kvsched.errors import KvschedError
from kvsched.limits import MAX_JOBS, MAX_SEEDS, check_count

if TYPE_CHECKING:       # the engine is imported when the command runs (fast `kvsched --help`)
    from rich.table import Table
    from kvsched.workload.source import WorkloadOptions


@app.command("capacity")
@workload_flags
@hardware_flags
@cluster_flags
def capacity_cmd(wopts: WorkloadOptions, hw: HardwareOptions, copts: ClusterOptions,
                 policies: str = typer.Option("vllm-v1", "--policies", help="comma-separated policy names"),
                 set_: list[str] = typer.Option([], "--set", help="POLICY.key=value, or key=value for every policy that has key"),
                 slo: list[str] = typer.Option([], "--slo", help="METRIC:STAT:MS (repeatable): METRIC ttft, tpot, itl or e2el; STAT mean, p50, p90 or p99; e.g. ttft:p99:2000"),
                 goodput: list[str] = typer.Option([], "--goodput", help="with --attainment: SLOs of a good request, ttft:MS tpot:MS e2el:MS"),
                 attainment: Optional[float] = typer.Option(None, "--attainment", help="least share of requests meeting every --goodput SLO, e.g. 0.9"),
                 seeds: int = typer.Option(3, "--seeds", help="seeds searched (--seed, --seed + 1, ...); max_rate is their median"),
                 tolerance: float = typer.Option(0.02, "--tolerance", help="stop when the bracket is narrower than this share of mu"),
                 jobs: int = typer.Option(0, "--jobs", help="worker processes (0: all cores)"),
                 batch_time: Optional[float] = typer.Option(None, "--batch-time", help="b for mu, seconds (default: measured on a saturated simulated replica)"),
                 chunk_size: int = ChunkOpt,
                 utilization: Optional[float] = typer.Option(None, "--utilization", show_default="0.9", help="with --rate: rho of the closed form ceil(rate / (mu rho))"),
                 out: Optional[Path] = typer.Option(None, "--out", help="write capacity.json (every evaluation, the runs at max_rate) here"),
                 candidate: list[str] = typer.Option([], "--candidate", help="with --rate: a replica kind to price, NAME=GPU[:tp=N][:pp=N][:ep=N][:dp-attention][:model=M][:weight-dtype=D][:kv-dtype=D] (repeatable); names the cheapest pool meeting the SLOs"),
                 minimise: Optional[str] = typer.Option(None, "--minimise", help="with --candidate: cost (USD per hour, the default) or gpus; the candidate meeting the SLOs at --rate with the least"),
                 json_: bool = JsonOpt) -> None:
    """Largest arrival rate meeting the SLOs, by bisection in simulation below the stability
    service rate mu (the upper bracket); with --rate, the replicas that rate needs, closed form
    beside simulated (docs/capacity.md).

    JSON keys: max_rate (req/s, median over seeds), max_rate_min, max_rate_max, max_rate_seeds,
    mu, max_rate_over_mu, bounded_by (slo, stability or bracket), at_max_rate (the SLO figures
    there, seed means; met, met_seeds), evaluations, gpus (with --rate: closed_form_stability,
    closed_form_slo, simulated). Several --policies: one such object per policy under
    "policies". With --candidate: kind "cheapest", candidates (each one's replicas for --rate,
    GPUs, usd_per_hour and its capacity search), cheapest, prices (source, date)."""
    def body() -> None:
        from kvsched.run import check_out, jsonable, write_atomically
        if out is not None:
            check_out(out)
        if candidate or copts.prices is not None or minimise is not None:
            payload = _cheapest(candidate, copts.prices, minimise, wopts, hw, copts, policies, set_, slo, goodput, attainment, seeds,
                                tolerance, jobs, batch_time, chunk_size, utilization, json_)
            if out is not None:
                text = json.dumps(jsonable(payload), indent=2, allow_nan=False, default=str) + "\n"
                write_atomically(out, lambda d: (d / "capacity.json").write_text(text))
            emit(payload, json_, lambda: _cheapest_table(payload))
            return
        payload = _capacity(wopts, hw, copts, policies, set_, slo, goodput, attainment, seeds, tolerance, jobs,
                            batch_time, chunk_size, utilization, json_)
        if out is not None:
            text = json.dumps(jsonable(payload), indent=2, allow_nan=False, default=str) + "\n"
            write_atomically(out, lambda d: (d / "capacity.json").write_text(text))
        names = list(payload["policies"])
        shown = {k: v for k, v in payload.items() if k != "policies"}
        for res in payload["policies"].values():
            res.pop("at_max_rate_runs", None)
        printed = {**shown, "policy": names[0], **payload["policies"][names[0]]} if len(names) == 1 else payload
        emit(printed, json_, lambda: _tables(payload))
    guard(body)


def _capacity(wopts, hw, copts, policies: str, set_: list[str], slo: list[str], goodput: list[str],
              attainment: float | None, seeds: int, tolerance: float, jobs: int, batch_time: float | None,
              chunk: int, utilization: float | None, quiet: bool) -> dict[str, Any]:
    """Everything checked before any simulation; then mu, then one search per policy."""
    from kvsched.capacity import Attainment, Criteria, Search, Slo, process_pool, replicas_needed
    from kvsched.cli.run import _scoped_params
    from kvsched.metrics import Goodput
    from kvsched.params import parse_assignments
    from kvsched.point import Point, check_rate
    from kvsched.policies import POLICIES, policy_class
    from kvsched.theory.plan import PlanInputs, service_rate
    from kvsched.workload.arrivals import Closed
    from kvsched.workload.source import load, resolve
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise KvschedError(f"unknown policy {policies!r}; known: {', '.join(POLICIES)}")
    for p in names:
        policy_class(p, "--policies")
    twice = [p for p in dict.fromkeys(names) if names.count(p) > 1]
    if twice:
        raise KvschedError(f"--policies: {twice[0]} given twice")
    if attainment is None and goodput:
        raise KvschedError("--goodput in capacity sets the SLOs of --attainment; give --attainment too")
    criteria = Criteria([Slo.parse(s) for s in slo],
                        Attainment(attainment, Goodput.parse(goodput)) if attainment is not None else None)
    seeds = check_count("--seeds", seeds, MAX_SEEDS)        # before the seed list is built
    check_count("--jobs", jobs, MAX_JOBS, low=0)            # 0: all cores
    if not (math.isfinite(tolerance) and 0 < tolerance < 1):
        raise KvschedError(f"--tolerance must be in (0, 1), got {tolerance}")
    target = check_rate(wopts.rate, "--rate") if wopts.rate is not None else None
    if utilization is not None and target is None:
        raise KvschedError("--utilization sets rho of --rate's closed form: give --rate too")
    utilization = 0.9 if utilization is None else utilization
    if not (math.isfinite(utilization) and 0 < utilization <= 1):      # before the search, not after
        raise KvschedError(f"--utilization must be in (0, 1], got {utilization}")
    if target is not None and (copts.replicas != 1 or copts.prefill_replicas or copts.decode_replicas):
        raise KvschedError("--rate sizes a cluster of one-replica configurations: drop --replicas and the "
                           "prefill/decode pools, or drop --rate")
    given = [f for f, v in (("--autoscale", copts.autoscale), ("--admit", copts.admit), ("--shed", copts.shed),
                            ("--abandon-after", copts.abandon_after)) if v]
    if given:
        raise KvschedError(f"capacity searches the rate a fixed set of replicas serves: drop {given[0]} (simulate or "
                           "sweep run the control plane)")
    wopts = dataclasses.replace(wopts, rate=None)
    if any(isinstance(ph.arrivals, Closed) for ph in resolve(wopts).phases):
        raise KvschedError("capacity searches over the arrival rate: the workload must be open loop, "
                           "not --arrivals closed:C")
    params = _scoped_params(parse_assignments(set_, "--set"), names)
    template = copts.apply(hw.scenario(None, goodput if attainment is not None else ()), wopts.seed)
    workload = load(dataclasses.replace(wopts, rate=1.0))
    st, b_source, _, _ = service_rate(PlanInputs(dataclasses.replace(template, workload=workload, replicas=1,
                                                                     prefill_replicas=0, decode_replicas=0),
                                                 batch_time=batch_time, chunk=chunk, seed=wopts.seed))
    replicas, _ = template.pools()
    seed_list = [wopts.seed + k for k in range(seeds)]
    payload: dict[str, Any] = {
        "kind": "capacity", "slos": [s.as_dict() for s in criteria.slos],
        "attainment": criteria.attainment.as_dict() if criteria.attainment else None,
        "tolerance": tolerance, "seeds": seed_list, "requests": len(workload), "replicas": replicas,
        "mu_per_replica": st.mu, "batch_time": st.batch_time, "batch_time_source": b_source, "chunk_size": chunk,
        "policies": {}}
    run, ex = process_pool(jobs)
    try:
        for name in names:
            point = Point(wopts, template, name, params[name], decode=copts.decode_args())
            bar = Progress(not quiet, f"capacity {name}")
            try:
                res = Search(point, criteria, st.mu * replicas, seed_list, tolerance, progress=bar).run(run)
            finally:
                bar.close()
            if target is not None:
                bar = Progress(not quiet, f"replicas {name}")
                try:
                    res["gpus"] = replicas_needed(point, criteria, target, st.mu, res["max_rate"], utilization,
                                                  seed_list, run, len(workload), progress=bar)
                finally:
                    bar.close()
            payload["policies"][name] = res
    finally:
        if ex is not None:
            ex.shutdown()
    return payload


MINIMISE = {"cost": "usd_per_hour", "gpus": "gpus"}     # --minimise: the candidates' figure it takes the least of


def _cheapest(candidates: list[str], prices: Path | None, minimise: str | None, wopts, hw, copts, policies: str,
              *search) -> dict[str, Any]:
    """Each --candidate's replicas for --rate at the SLOs (a capacity search of one replica,
    then the fewest replicas meeting them in simulation), priced per GPU-hour; the cheapest."""
    from kvsched.capacity import Infeasible
    from kvsched.hardware import get_gpu
    from kvsched.layout import layout_summary
    from kvsched.pools import parse_candidate
    from kvsched.prices import price_of, read_prices
    if minimise not in (None, *MINIMISE):
        raise KvschedError(f"--minimise must be one of {', '.join(MINIMISE)}, got {minimise!r}")
    if not candidates:
        raise KvschedError("--prices and --minimise choose among the --candidate pools: give --candidate too")
    if wopts.rate is None:
        raise KvschedError("--candidate needs --rate: the arrival rate each candidate pool must serve")
    if "," in policies:
        raise KvschedError("--candidate compares pools under one policy: give one --policies")
    if copts.pool or copts.replicas != 1 or copts.prefill_replicas or copts.decode_replicas:
        raise KvschedError("--candidate sizes pools of one-replica kinds: drop --pool, --replicas and the "
                           "prefill/decode pools")
    table = read_prices(prices)
    base = hw.layout().check()
    pools = [parse_candidate(text, hw.model, base) for text in candidates]
    names = [p.name for p in pools]
    if len(set(names)) < len(names):
        raise KvschedError("--candidate: each candidate needs its own name")
    fits = _check_candidates(pools, hw)                             # bad input: an error before any search
    priced = [(p, price_of(table, get_gpu(p.gpu).name)) for p in pools]     # every price known before a search
    rows = []
    for (pool, usd), why in zip(priced, fits):
        lay = pool.layout
        mine = dataclasses.replace(hw, gpu=pool.gpu, model=pool.model, tp=lay.tp, pp=lay.pp, ep=lay.ep,
                                   dp_attention=lay.dp_attention, weight_dtype=lay.weight_dtype, kv_dtype=lay.kv_dtype)
        row = {"name": pool.name, "gpu": get_gpu(pool.gpu).name, "model": pool.model, **layout_summary(lay),
               "usd_per_gpu_hour": usd}
        if why is None:
            try:
                res = _capacity(wopts, mine, copts, policies, *search)
            except Infeasible as exc:       # no cluster size meets the SLOs at the rate
                why = str(exc)
        if why is not None:
            rows.append({**row, "replicas": None, "gpus": None, "usd_per_hour": None, "max_rate_per_replica": None,
                         "infeasible": why})
            continue
        found = next(iter(res["policies"].values()))
        found.pop("at_max_rate_runs", None)
        replicas = found["gpus"]["simulated"]
        rows.append({**row, "replicas": replicas, "gpus": replicas * lay.gpus, "usd_per_hour": replicas * lay.gpus * usd,
                     "max_rate_per_replica": found["max_rate"], "search": found})
    feasible = [r for r in rows if r["usd_per_hour"] is not None]
    if not feasible:
        raise KvschedError(f"no --candidate meets the SLOs at {wopts.rate:g} req/s: " + "; ".join(
            f"{r['name']}: {r['infeasible']}" for r in rows))
    key = MINIMISE[minimise or "cost"]
    best = min(feasible, key=lambda r: (r[key], r["usd_per_hour"], names.index(r["name"])))
    return {"kind": "cheapest", "rate": wopts.rate, "policy": policies.strip(), "minimise": minimise or "cost",
            "cheapest": best["name"],
            "candidates": rows, "prices": {"source": table["source"], "date": table["date"]}}


def _check_candidates(pools: list, hw) -> list[str | None]:
    """Each candidate's model, GPU, layout and cost model built as a run builds them (a bad one
    is an error); per candidate, why its weights leave no KV cache (None: they fit)."""
    from kvsched.cost import make_cost_model
    from kvsched.hardware import get_gpu, get_model, usable_kv_tokens
    from kvsched.params import parse_assignments
    from kvsched.pools import check_reads_hardware
    costs, hardware, fits = [], set(), []
    for pool in pools:
        model, gpu = get_model(pool.model), get_gpu(pool.gpu)
        layout = pool.layout.check(model)
        costs.append(make_cost_model(hw.cost, parse_assignments(hw.cost_set, "--cost-set"), model, gpu, layout))
        hardware.add((model.name, gpu.name))
        try:
            if hw.kv_tokens() is None:
                usable_kv_tokens(model, gpu, hw.memory_utilization, hw.block_size, layout)
            fits.append(None)
        except KvschedError as exc:
            fits.append(str(exc))
    check_reads_hardware(hw.cost, costs, hardware, "the candidates")
    return fits


def _cheapest_table(p: dict[str, Any]) -> Table:
    from rich.table import Table
    t = Table(title=f"Cheapest pool for {p['rate']:g} req/s under {p['policy']}: {p['cheapest']}", title_justify="left",
              caption=f"prices: {p['prices']['source']} ({p['prices']['date']})", caption_justify="left")
    for c in ("candidate", "gpu", "layout", "max req/s per replica", "replicas", "GPUs", "USD/GPU-h", "USD/h"):
        t.add_column(c, justify="left" if c in ("candidate", "gpu", "layout") else "right")
    for r in p["candidates"]:
        if r["usd_per_hour"] is None:
            t.add_row(r["name"], r["gpu"], "", "-", "-", "-", f"{r['usd_per_gpu_hour']:.3g}", "cannot meet the SLOs")
            continue
        lay = " ".join([f"tp={r['tp']}"] + [f"{k}={r[k]}" for k in ("pp", "ep") if r[k] > 1]
                       + ["dp-attn"] * r["dp_attention"] + [r["weight_dtype"]] + [f"kv {r['kv_dtype']}"] * (r["kv_dtype"] != "auto"))
        t.add_row(r["name"] + (" *" if r["name"] == p["cheapest"] else ""), r["gpu"], lay,
                  f"{r['max_rate_per_replica']:.4g}", str(r["replicas"]), str(r["gpus"]),
                  f"{r['usd_per_gpu_hour']:.3g}", f"{r['usd_per_hour']:.4g}")
    return t


def _tables(p: dict[str, Any]) -> Table:
    """One column per policy (as `compare`), so several fit a terminal."""
    from rich.table import Table
    slos = ", ".join(f"{s['metric']} {s['stat']} <= {s['ms']:g} ms" for s in p["slos"])
    if p["attainment"]:
        slos += (", " if slos else "") + f"goodput attainment >= {p['attainment']['target']:g}"
    t = Table(title=f"Capacity at SLOs ({slos})", title_justify="left", caption_justify="left",
              caption=f"mu = {p['mu_per_replica']:.4g} req/s per replica (b = {p['batch_time'] * 1000:.2f} ms); "
                      f"{len(p['seeds'])} seeds of {p['requests']:,} requests; bisection to {p['tolerance']:g} x mu")
    t.add_column("quantity")
    res = p["policies"]
    for name in res:
        t.add_column(name, justify="right")
    rows: list[tuple[str, Any]] = [
        ("max_rate, req/s (seed median)", lambda r: f"{r['max_rate']:.4g}"),
        ("seeds' min - max", lambda r: f"{r['max_rate_min']:.4g} - {r['max_rate_max']:.4g}"),
        ("max_rate / mu", lambda r: f"{r['max_rate_over_mu']:.2f}"),
        ("bounded by", lambda r: r["bounded_by"])]
    keys = [(s["key"], f"<= {s['ms']:g}") for s in p["slos"]]
    if p["attainment"]:
        keys.append(("goodput_attainment", f">= {p['attainment']['target']:g}"))
    rows += [(f"{k} at max_rate ({bound})", lambda r, k=k: _fig((r["at_max_rate"] or {}).get(k))) for k, bound in keys]
    rows.append(("seeds meeting at max_rate", lambda r: f"{(r['at_max_rate'] or {}).get('met_seeds', 0)}/{len(p['seeds'])}"))
    g = next(iter(res.values())).get("gpus")
    if g:
        rows += [(f"replicas for {g['rate']:g} req/s: R / (mu x {g['utilization']:g})",
                  lambda r: str(r["gpus"]["closed_form_stability"])),
                 ("  R / max_rate", lambda r: str(r["gpus"]["closed_form_slo"] or "-")),
                 ("  simulated, fewest meeting", lambda r: str(r["gpus"]["simulated"]))]
    for label, cell in rows:
        t.add_row(label, *(cell(r) for r in res.values()))
    return t


def _fig(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
