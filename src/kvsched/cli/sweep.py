"""`kvsched sweep`: a grid of policies x parameters x rates x seeds, in parallel, resumable."""
from __future__ import annotations

import os
import time
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from kvsched.cli.common import (CLUSTER_FLAGS, HARDWARE_FLAGS, OUTPUT_FLAGS, WORKLOAD_FLAGS, ClusterOptions,
                                HardwareOptions, JsonOpt, Progress, app, cluster_flags, emit, guard,
                                hardware_flags, say, workload_flags)
from kvsched.errors import KvschedError
from kvsched.limits import MAX_JOBS, check_count

if TYPE_CHECKING:       # the engine is imported when the command runs (fast `kvsched --help`)
    from rich.table import Table
    from kvsched.sweep import Grid, Store, Task
    from kvsched.workload.source import WorkloadOptions

OPTION_FLAGS = {**WORKLOAD_FLAGS, **HARDWARE_FLAGS, **CLUSTER_FLAGS}
# Option flags a grid file may vary: the scalar ones; rate and seed are the sweep's own axes.
AXIS_KINDS = {name: kind for name, (kind, _) in OPTION_FLAGS.items()
              if name not in ("rate", "seed") and typing.get_origin(kind) is not list}
BACKENDS = ("process", "ray")


@app.command("sweep")
@workload_flags
@hardware_flags
@cluster_flags
def sweep_cmd(ctx: typer.Context, wopts: WorkloadOptions, hw: HardwareOptions, copts: ClusterOptions,
              policies: Optional[str] = typer.Option(None, "--policies", help="comma-separated policy names (default: vllm-v1)"),
              rates: Optional[str] = typer.Option(None, "--rates", help="arrival rates, requests/s: 1,2,4 (required unless in --grid)"),
              seeds: Optional[str] = typer.Option(None, "--seeds", help="workload seeds: 0-9 or 0,1,2 (default: 0)"),
              set_: list[str] = typer.Option([], "--set", help="a parameter axis: key=v1,v2 (every policy having key) or POLICY.key=v1,v2 (repeatable)"),
              grid: Optional[Path] = typer.Option(None, "--grid", help="a grid file (.toml): these axes and axes over the workload, hardware and cluster flags (docs/sweep.md)"),
              out: Path = typer.Option(..., "--out", help="the sweep's folder: points/ as they finish, sweep.json, sweep.csv (and .parquet); a re-run resumes it"),
              jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="worker processes (default: all cores; with --backend ray: the CPUs of a local Ray)"),
              backend: str = typer.Option("process", "--backend", help="process (this machine) or ray (a Ray cluster; the ray extra)"),
              ray_address: Optional[str] = typer.Option(None, "--ray-address", help="with --backend ray: the cluster's address (default: RAY_ADDRESS, else a local Ray)"),
              retry_failed: bool = typer.Option(False, "--retry-failed", help="run failed points again (by default a re-run keeps their recorded error)"),
              minimise: Optional[str] = typer.Option(None, "--minimise", help="name the point with the least cost (usd_per_mtok), energy (joules_per_mtok) or gpu_hours among those meeting every --slo"),
              slo: list[str] = typer.Option([], "--slo", help="with --minimise: METRIC:STAT:MS a point must meet (repeatable), as capacity's"),
              goodput: list[str] = OUTPUT_FLAGS["goodput"][1],
              trim: int = OUTPUT_FLAGS["trim"][1],
              json_: bool = JsonOpt) -> None:
    """Run a grid of points (policy, parameters, options, rate, seed) and write one table."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        from kvsched import sweep as sw
        from kvsched.cli.run import _scoped_params
        _check_flags(wopts, backend, jobs)
        best = _best_rule(minimise, slo)
        if backend == "ray":
            sw.ray_module()
        raw = sw.from_flags(policies, rates, seeds, set_)
        if grid is not None:
            raw = sw.merge(raw, sw.read_grid_file(grid, AXIS_KINDS), _given(ctx))
        the_grid = sw.resolve(raw, _scoped_params)
        tasks = sw.plan(the_grid, sw.Base(wopts, hw, copts, list(goodput), trim))
        store = sw.Store(sw.check_folder(out))
        outcome.update(_run(the_grid, tasks, store, json_, retry_failed,
                           lambda todo, save: _execute(todo, save, backend, jobs, ray_address), best))
    guard(body)
    if outcome.get("failed"):
        say("warning", f"{outcome['failed']} of {outcome['points']} points failed (first: {outcome['first_error']}); "
                       f"see the status and error columns of {out / 'sweep.csv'}")
        raise typer.Exit(1)


def _check_flags(wopts: WorkloadOptions, backend: str, jobs: int | None) -> None:
    if wopts.rate is not None:
        raise KvschedError("a sweep's rates are --rates (or rates in the --grid file), not --rate")
    if wopts.seed != 0:
        raise KvschedError("a sweep's seeds are --seeds (or seeds in the --grid file), not --seed")
    if backend not in BACKENDS:
        raise KvschedError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if jobs is not None:
        check_count("--jobs", jobs, MAX_JOBS)


def _given(ctx: typer.Context) -> set[str]:
    """The option flags given on the command line, at any value (a flag given at its default,
    e.g. --gpu a100-80gb beside a gpu axis, would otherwise be silently overridden)."""
    return {name for name in OPTION_FLAGS
            if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


MINIMISE = {"cost": "usd_per_mtok", "energy": "joules_per_mtok", "gpu_hours": "gpu_hours"}


def _best_rule(minimise: str | None, slo: list[str]):
    """--minimise and --slo checked: (figure, SLOs), or None."""
    from kvsched.capacity import Slo
    if minimise is None:
        if slo:
            raise KvschedError("--slo in a sweep bounds the points --minimise chooses among: give --minimise too")
        return None
    if minimise not in MINIMISE:
        raise KvschedError(f"--minimise must be one of {', '.join(MINIMISE)}, got {minimise!r}")
    return MINIMISE[minimise], [Slo.parse(s) for s in slo]


def _best(records: list[dict], rule) -> dict[str, Any] | None:
    """The finished point meeting every SLO with the least of the rule's figure (None: none)."""
    key, slos = rule
    ok = [r for r in records if r["status"] == "ok" and all(s.met(r["figures"]) for s in slos)
          and r["figures"].get(key) is not None]
    if not ok:
        return None
    r = min(ok, key=lambda r: r["figures"][key])
    return {"axes": r["axes"], key: r["figures"][key], **{s.key: r["figures"].get(s.key) for s in slos}}


def _run(grid: Grid, tasks: list[Task], store: Store, json_: bool, retry_failed: bool, execute,
         best=None) -> dict[str, Any]:
    """Run the points not yet finished, saving each as it arrives; write the tables from all
    point files; print the summary, and return it with the first failed point's error."""
    from kvsched import sweep as sw
    start = time.perf_counter()
    store.open(grid.axes(), [t.key for t in tasks])
    kept = {t.key: store.load(t.key, t.axes) for t in tasks}
    todo = [t for t in tasks if not _finished(kept[t.key], retry_failed)]
    bar = Progress(not json_, "sweep")

    def save(record: dict) -> None:
        store.save(record)
        kept[record["key"]] = record
        save.done += 1
        bar(save.done, len(todo))
    save.done = 0
    try:
        if todo:
            execute(todo, save)
    finally:
        bar.close()
    records = [kept[t.key] for t in tasks]
    paths = sw.write_tables(store, *sw.table(grid, records))
    failed = [f"{r['axes']['policy']} at rate {r['axes']['rate']:g}, seed {r['axes']['seed']}: {r['error']}"
              for r in records if r["status"] != "ok"]
    summary = {"points": len(tasks), "done": len(todo), "skipped": len(tasks) - len(todo), "failed": len(failed),
               "seconds": round(time.perf_counter() - start, 3), "tables": [str(p) for p in paths]}
    if best is not None:
        summary["best"] = _best(records, best)
    emit(summary, json_, lambda: _summary_table(summary))
    return {**summary, "first_error": failed[0] if failed else None}


def _summary_table(summary: dict[str, Any]) -> Table:
    from rich.table import Table
    t = Table(show_header=False, box=None)
    for name, value in (("points", summary["points"]), ("run now", summary["done"]),
                        ("already done", summary["skipped"]), ("failed", summary["failed"]),
                        ("seconds", f"{summary['seconds']:.1f}"), ("tables", "\n".join(summary["tables"]))):
        t.add_row(name, str(value))
    if "best" in summary:
        b = summary["best"]
        t.add_row("best", "none meets the SLOs" if b is None else
                  ", ".join(f"{k}={v}" for k, v in b["axes"].items() if k != "params") + "  " +
                  ", ".join(f"{k}={v:.4g}" for k, v in b.items() if k != "axes" and isinstance(v, float)))
    return t


def _finished(record: dict | None, retry_failed: bool) -> bool:
    """A point is done once it has a record; a failed one too unless --retry-failed (its
    failure is deterministic: the same definition fails the same way)."""
    return record is not None and (record.get("status") == "ok" or not retry_failed)


def _execute(todo: list[Task], save, backend: str, jobs: int | None, ray_address: str | None) -> None:
    from kvsched import sweep as sw
    if backend == "ray":
        sw.run_ray(todo, jobs or os.cpu_count() or 1, ray_address, save)
    else:
        sw.run_processes(todo, jobs or os.cpu_count() or 1, save)
