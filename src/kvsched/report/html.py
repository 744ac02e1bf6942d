"""The report page: one self-contained HTML file (PNG images inline as data: URIs, inline CSS,
no scripts, no links out), so it opens from a copied folder with no network. Written
atomically, and listed in the folder's `.kvsched-run` manifest so `--out` may reuse it."""
from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvsched.errors import KvschedError
from kvsched.files import atomic_file
from kvsched.report.folders import Folder, load, own_files

CSS = """body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1160px;margin:24px auto;
padding:0 16px;color:#222}h1{font-size:1.6em;margin-bottom:4px}h2{margin-top:36px;border-bottom:1px solid #ddd;
padding-bottom:4px}p.caption{color:#555;margin:4px 0 10px}p.meta{color:#555;margin-top:0}img{max-width:100%;
height:auto;display:block}table{border-collapse:collapse;font-size:.9em;margin:8px 0}th,td{border:1px solid #ddd;
padding:4px 8px;text-align:right}th:first-child,td:first-child{text-align:left;white-space:nowrap}th{background:#f4f4f4}
ul.notes{color:#8a5300}"""

MS = "ms"          # format of milliseconds: 4 significant digits, whole numbers from 1,000 up
# summary table columns: figure key, heading, format
TABLE = [("request_throughput", "req/s", "{:.3g}"), ("median_ttft_ms", "median TTFT ms", MS),
         ("p99_ttft_ms", "p99 TTFT ms", MS), ("median_tpot_ms", "median TPOT ms", MS),
         ("p99_tpot_ms", "p99 TPOT ms", MS), ("p99_itl_ms", "p99 ITL ms", MS),
         ("mean_kv_usage", "mean KV use", "{:.1%}"), ("peak_queue_length", "peak queue", "{:g}"),
         ("preemptions", "preemptions", "{:g}"), ("completed", "completed", "{:g}")]


@dataclass
class Section:
    id: str
    heading: str
    caption: str
    image: Optional[bytes]
    extra: str = ""


def write_report(folder: Path, output: Optional[Path] = None) -> tuple[Path, list[str]]:
    """Render `folder`'s report into `output` (default folder/report.html); the plots' ids.
    `output` may not be one of the folder's own files (its data would become HTML)."""
    target = Path(output) if output is not None else folder / "report.html"
    if target.is_dir():
        raise KvschedError(f"--output {target} is a folder; give a file name")
    data = load(folder)
    if target.resolve() in own_files(folder):
        raise KvschedError(f"--output {target} is one of the folder's own files; give another file name "
                           f"(default: {folder / 'report.html'})")
    page, ids = render(data)
    _list_in_manifest(folder, target)
    _write_text(target, page)
    return target, ids


def render(folder: Folder) -> tuple[str, list[str]]:
    """The page's HTML and the ids of the sections holding a plot."""
    from kvsched.report import plots
    with plots.style():
        labels = list(dict.fromkeys([c.label for c in folder.curves] + [r.label for r in folder.runs]))
        colors = plots.palette(labels)
        sections = [s for s in (make(folder, colors) for make in SECTIONS) if s is not None]
    body = "".join(_section(s) for s in sections)
    return _page(folder, body), [s.id for s in sections if s.image is not None]


def _latency(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import latency_throughput
    if not folder.curves:
        return None
    what = "one point per policy" if folder.kind in ("simulate", "compare") else "one line per configuration"
    return Section("latency-throughput", "Latency against throughput",
                   f"Median and p99 TTFT and TPOT against achieved request throughput, {what}; "
                   f"from {folder.curves_from}.", latency_throughput(folder.curves, colors))


def _distributions(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import distributions
    if not any(r.ttft_q for r in folder.runs):
        return None
    return Section("distributions", "TTFT and TPOT distributions",
                   "CDFs of TTFT and TPOT of finished requests (TPOT: requests with more than one output token), "
                   f"from their percentiles 0..100; {folder.runs_from}.", distributions(folder.runs, colors))


def _timeline(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import timeline
    if not any(r.timeline for r in folder.runs):
        return None
    return Section("timeline", "KV use and queue length over time",
                   "KV cache in use (share of the capacity of all replicas) and waiting requests, means over "
                   f"200 equal time bins, summed over replicas; {folder.runs_from}.", timeline(folder.runs, colors))


def _capacity(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import capacity_bars
    cap = folder.capacity
    if cap is None:
        return None
    seeds = ", ".join(map(str, cap.seeds)) or "?"
    return Section("capacity", "Capacity",
                   f"Largest arrival rate meeting every SLO: bars max_rate (the median over seeds {seeds}), "
                   "whiskers the seeds' min and max, dashed the stability service rate mu, the label what "
                   "bounded it (slo, stability or the search bracket); from capacity.json.", capacity_bars(cap, colors), _capacity_table(cap))


def _slos(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import slo_panels
    cap = folder.capacity
    if cap is None or not cap.limits:
        return None
    return Section("slos", "SLO figures against rate",
                   "Each SLO's figure at every probed rate and seed (circle: that run met every SLO and was "
                   "stable, cross: it was not), dashed the SLO bound, dotted each policy's max rate; from "
                   "capacity.json's evaluations.", slo_panels(cap, colors))


def _tiers(folder: Folder, colors: dict) -> Optional[Section]:
    from kvsched.report.plots import tiers
    image = tiers(folder.runs, colors)
    if image is None:
        return None
    return Section("tiers", "Per-tier figures",
                   "Per user tier: median TTFT, p99 inter-token latency and SLO attainment where the tier sets "
                   f"SLOs, dashed the tier's TTFT or TBT SLO; {folder.runs_from}.", image)


SECTIONS: list[Callable[[Folder, dict], Optional[Section]]] = [_latency, _distributions, _timeline, _capacity,
                                                               _slos, _tiers]


def _section(s: Section) -> str:
    img = ""
    if s.image is not None:
        data = base64.b64encode(s.image).decode("ascii")
        img = f'<img alt="{html.escape(s.heading)}" src="data:image/png;base64,{data}">'
    return (f'<section id="{s.id}"><h2>{html.escape(s.heading)}</h2>'
            f'<p class="caption">{html.escape(s.caption)}</p>{img}{s.extra}</section>\n')


def _page(folder: Folder, body: str) -> str:
    first = folder.runs[0].figures if folder.runs else {}
    setup = " · ".join(str(first[k]) for k in ("model", "gpu", "cost_model") if first.get(k) is not None)
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in folder.notes)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kvsched {folder.kind} report</title><style>{CSS}</style></head><body>\n"
            f"<h1>kvsched {folder.kind} report</h1><p class=\"meta\">{html.escape(setup)}</p>"
            + (f'<ul class="notes">{notes}</ul>' if notes else "")
            + f'<section id="summary"><h2>Summary</h2><p class="caption">Key figures of the runs the '
              f'distribution and timeline plots show ({html.escape(folder.runs_from)}).</p>{_runs_table(folder)}'
              "</section>\n" + body + "</body></html>\n")


def _runs_table(folder: Folder) -> str:
    rows = [[r.label] + [_fmt(r.figures.get(k), f) for k, _, f in TABLE] for r in folder.runs]
    return _table(["run"] + [h for _, h, _ in TABLE], rows)


def _capacity_table(cap: Any) -> str:
    gpus = any(p.gpus for p in cap.policies)
    head = ["policy", "max rate req/s", "min", "max", "mu", "max rate / mu", "bounded by", "SLOs met at max rate"]
    rows = []
    for p in cap.policies:
        ratio = p.max_rate / p.mu if p.mu else math.nan
        rows.append([p.name, _fmt(p.max_rate, "{:.3g}"), _fmt(p.max_rate_min, "{:.3g}"),
                     _fmt(p.max_rate_max, "{:.3g}"), _fmt(p.mu, "{:.3g}"), _fmt(ratio, "{:.2f}"), p.bounded_by,
                     {True: "yes", False: "no"}.get(p.met, "—")]
                    + ([_gpus(p.gpus)] if gpus else []))
    return _table(head + (["GPUs (closed form stability / SLO / simulated)"] if gpus else []), rows)


def _gpus(g: Optional[dict]) -> str:
    if not g:
        return "—"
    return (f"at {g.get('rate')} req/s: {g.get('closed_form_stability')} / {g.get('closed_form_slo')} / "
            f"{g.get('simulated')}")


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _fmt(v: Any, form: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "—" if v is None or isinstance(v, float) else str(v)
    if form == MS:
        form = "{:,.0f}" if abs(v) >= 1000 else "{:.4g}"
    return form.format(v)


def _list_in_manifest(folder: Path, target: Path) -> None:
    """A report written into a kvsched --out folder joins its manifest (else a later --out
    into that folder would refuse it as a stranger)."""
    from kvsched.run import MANIFEST, manifest_names
    manifest = folder / MANIFEST
    try:
        rel = str(target.resolve().relative_to(folder.resolve()))
    except ValueError:
        return
    if not manifest.is_file():
        return
    listed = manifest_names(folder)     # any bytes (surrogateescape), written back unchanged
    if rel not in listed:
        text = "".join(f"{name}\n" for name in sorted(listed + [rel]))
        with atomic_file(manifest, "wb") as f:
            f.write(text.encode("utf-8", "surrogateescape"))


def _write_text(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)
