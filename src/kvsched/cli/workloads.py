"""`kvsched workloads`, `kvsched workload stats` and `kvsched workload export`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvsched.cli.common import JsonOpt, app, emit, guard, say, workload_flags
from kvsched.errors import KvschedError

if TYPE_CHECKING:       # the engine is imported when a command runs (fast `kvsched --help`)
    from kvsched.workload.source import WorkloadOptions

workload_app = typer.Typer(no_args_is_help=True, help="Describe and export workloads.")
app.add_typer(workload_app, name="workload")


@app.command("workloads")
def workloads_cmd() -> None:
    """List the workload presets with their sources."""
    from rich.console import Console
    from rich.table import Table
    from kvsched.workload.presets import PRESETS
    t = Table(title="Workload presets (use with --workload NAME)", title_justify="left")
    for c in ("name", "source", "what"):
        t.add_column(c)
    for p in PRESETS.values():
        t.add_row(p.name, p.source, p.description)
    Console().print(t)


def _with_source(source: Optional[str], wopts: WorkloadOptions) -> WorkloadOptions:
    if source is not None:
        if wopts.workload is not None or wopts.trace is not None:
            raise KvschedError("give the workload once: as SOURCE or with --workload/--trace")
        wopts.workload = source
    return wopts


@workload_app.command("stats")
@workload_flags
def workload_stats_cmd(wopts: WorkloadOptions,
                       source: Optional[str] = typer.Argument(None, help="trace file, bundled trace name, preset or .toml workload file"),
                       json_: bool = JsonOpt) -> None:
    """Count, span, mean rate, CV of gaps, token percentiles, prefix reuse, phases and tiers."""
    def body() -> None:
        from kvsched.report.table import workload_table
        from kvsched.workload.source import load
        from kvsched.workload.stats import describe as workload_stats
        wopts.keep_hashes = wopts.untimed_ok = True
        stats = workload_stats(load(_with_source(source, wopts)))
        emit(stats, json_, lambda: workload_table(stats))
    guard(body)


@workload_app.command("export")
@workload_flags
def workload_export_cmd(wopts: WorkloadOptions,
                        source: Optional[str] = typer.Argument(None, help="trace file, bundled trace name, preset or .toml workload file"),
                        out: Path = typer.Option(..., "--out", help="file to write: NAME.jsonl keeps shared prompt segments (prefix caching) and Mooncake hash_ids; any other name gets CSV (refused if it would lose them)")) -> None:
    """Write a workload as the generic CSV arrival_time,prompt_tokens,output_tokens[,tier], or
    with --out NAME.jsonl as the generic JSONL, which also keeps its shared prompt content."""
    def body() -> None:
        from kvsched.workload.source import load
        from kvsched.files import check_writable
        from kvsched.workload.traces import export, not_carried
        check_writable(out, "--out")
        wopts.keep_hashes = True        # a Mooncake trace's hash_ids go into the file too
        w = load(_with_source(source, wopts))
        export(w, out)
        say("info", f"wrote {len(w)} requests to {out}")
        for what in not_carried(w):
            say("warning", f"{out} does not hold {what}")
    guard(body)
