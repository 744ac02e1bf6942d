"""`kvsched report DIR`: a self-contained HTML page from a simulate, compare, sweep or capacity folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kvsched.cli.common import app, guard


@app.command("report")
def report_cmd(folder: Path = typer.Argument(..., help="a simulate/compare --out, sweep or capacity folder"),
               output: Optional[Path] = typer.Option(None, "--output", "-o", help="the HTML file (default: DIR/report.html)"),
               json_: bool = typer.Option(False, "--json", help='print {"report": path, "plots": [ids]} as one JSON object')) -> None:
    """Write one HTML page of plots (latency vs throughput, distributions, timeline, capacity, tiers) that opens offline."""
    def body() -> None:
        from kvsched.files import check_writable
        from kvsched.report.html import write_report
        if output is not None:
            check_writable(output, "--output")      # before the folder is read and plotted
        path, plots = write_report(folder, output)
        typer.echo(json.dumps({"report": str(path), "plots": plots}) if json_ else f"wrote {path} ({', '.join(plots)})")
    guard(body)
