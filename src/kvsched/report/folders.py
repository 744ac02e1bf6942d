"""A simulate, compare, sweep or capacity folder read into one shape (`Folder`), so the plots
and the page know nothing of file layouts. Every malformed file is a one-line error naming it."""
from __future__ import annotations

import contextlib
import csv
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from kvsched.errors import KvschedError

LATENCY = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
CURVE_KEYS = ("request_throughput",) + LATENCY
# Figures the page reads as numbers (curves, the summary table: html.TABLE's keys, a test
# checks) and as text; with the flat tier figures (tier_<name>_<key>) each is checked where read.
NUMBERS = CURVE_KEYS + ("p99_itl_ms", "mean_kv_usage", "peak_queue_length", "preemptions", "completed")
TEXTS = ("policy", "model", "gpu", "cost_model")
COUNTS = ("completed", "rejected", "preemptions", "peak_queue_length")    # whole numbers >= 0 (or null)
SHARES = ("mean_kv_usage", "peak_kv_usage")          # figures that are shares of the KV capacity
TIER_COUNTS = ("_requests", "_completed", "_rejected")                   # a tier's: tier_<name>_requests, ...
STATUSES = ("finished", "unfinished", "rejected")      # requests.csv's status column
RUN_FILES = ("summary.json", "requests.csv", "timeline.csv")   # what a simulate run's folder is read from
MAX_RUNS = 10           # configurations drawn in the distribution, timeline and tier plots


@dataclass
class Run:
    """One run: flat scalar figures (tiers as `tier_<name>_<key>`), TTFT and TPOT percentiles
    0..100 in ms, and the binned timeline rows (time, queue, running, KV fraction)."""
    label: str
    figures: dict[str, Any]
    ttft_q: list[float]
    tpot_q: list[float]
    timeline: list[list[float]]


@dataclass
class Curve:
    """A line of the latency-throughput plot: per rate (ascending), CURVE_KEYS averaged over seeds."""
    label: str
    points: list[dict[str, float]]


@dataclass
class Evaluation:
    seed: int
    rate: float
    met: bool
    figures: dict[str, Any]


@dataclass
class CapacityPolicy:
    """One policy of a capacity search: the max rate over seeds and every probe it made."""
    name: str
    max_rate: float                     # NaN: no probed rate met the SLOs
    max_rate_min: float
    max_rate_max: float
    mu: Optional[float]
    bounded_by: str
    met: Optional[bool]
    evaluations: list[Evaluation]
    gpus: Optional[dict[str, Any]]


@dataclass
class Limit:
    """A capacity criterion on one figure: an SLO (at most `bound` ms) or the goodput
    attainment (at least `bound`, a share)."""
    key: str
    bound: float
    title: str
    unit: str
    upper: bool = True


@dataclass
class Capacity:
    limits: list[Limit]
    policies: list[CapacityPolicy]
    seeds: list[int]


@dataclass
class Folder:
    """What the page shows: `curves` (source described by `curves_from`), `runs` for the
    distributions, timeline and tiers (`runs_from`), and a capacity search when there is one."""
    kind: str
    curves: list[Curve]
    runs: list[Run]
    curves_from: str
    runs_from: str
    capacity: Optional[Capacity] = None
    notes: list[str] = field(default_factory=list)


def load(path: Path) -> Folder:
    """The folder's kind is told by the file that names it."""
    if not path.is_dir():
        raise KvschedError(f"{path}: no such folder")
    for name, loader in (("capacity.json", _capacity), ("sweep.json", _sweep), ("compare.json", _compare),
                         ("summary.json", _simulate)):
        if (path / name).is_file():
            return loader(path)
    raise KvschedError(f"{path} is not a kvsched simulate, compare, sweep or capacity folder "
                       "(it has no summary.json, compare.json, sweep.json or capacity.json)")


@contextlib.contextmanager
def about(path: Path) -> Iterator[None]:
    """Unreadable or malformed content becomes one line naming the file."""
    try:
        yield
    except KvschedError:
        raise
    except OSError as exc:
        raise KvschedError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise KvschedError(f"{path}: not UTF-8 text (byte {exc.start + 1})") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise KvschedError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None


def read_json(path: Path, kind: type = dict) -> Any:
    with about(path):
        doc = json.loads(path.read_text())
        if not isinstance(doc, kind):
            raise TypeError(f"expected a JSON {kind.__name__}, got {type(doc).__name__}")
        return doc


def own_files(path: Path) -> set[Path]:
    """The files of folder `path` that are its data, resolved (another spelling or a linked
    parent names the same file): what `load` reads of each kind (RUN_FILES here and in each
    policy's folder, compare.json, sweep.json and points/*.json, capacity.json), a sweep's
    tables, and an --out folder's manifest with every file it lists but report pages (.html:
    kvsched writes no other HTML, and a report joins the manifest). A report must never
    replace one; report.html, or an earlier report anywhere, may be written again."""
    from kvsched.run import MANIFEST, manifest_names
    names = (MANIFEST, *RUN_FILES, "compare.json", "sweep.json", "sweep.csv", "sweep.parquet", "capacity.json")
    with about(path):
        folders = [path, *(sub for sub in path.iterdir() if sub.is_dir())]
        files = {d / name for d in folders for name in names} | set((path / "points").glob("*.json"))
        files |= {path / name for name in manifest_names(path) if not name.endswith(".html")}
        return {f.resolve() for f in files}


# ---- simulate and compare folders: requests.csv, timeline.csv, summary.json ----

def _simulate(d: Path) -> Folder:
    run = _run_folder(d, None)
    return Folder("simulate", [_one_point(run)], [run], "summary.json", "requests.csv and timeline.csv")


def _compare(d: Path) -> Folder:
    summaries = read_json(d / "compare.json")
    bad = next((name for name in summaries if not _is_key(name)), None)
    if bad is not None:         # a name such as ../x would read another folder
        raise KvschedError(f"{d / 'compare.json'}: {_brief(bad)} is not the name of a policy's folder")
    runs = [_run_folder(d / name, name) for name in summaries]
    if not runs:
        raise KvschedError(f"{d / 'compare.json'}: no policies in it")
    return Folder("compare", [_one_point(r) for r in runs], runs, "each policy's summary.json",
                  "each policy's requests.csv and timeline.csv")


def _one_point(run: Run) -> Curve:
    return Curve(run.label, [{k: number(run.figures.get(k)) for k in CURVE_KEYS}])


def _run_folder(d: Path, label: Optional[str]) -> Run:
    from kvsched.point import binned_timeline
    summary = read_json(d / "summary.json")
    with about(d / "summary.json"):
        figures = flatten(summary)
        check_figures(figures, "")
        capacity = _whole(summary, "kv_capacity_tokens", 1)
        counts = {key: _whole(summary, key, 0) for key in ("completed", "rejected")}
        label = label if label is not None else summary["policy"]
        if not isinstance(label, str):
            raise ValueError(f"policy must be text, got {_brief(label)}")
    ttft, tpot, rows = _latencies(d / "requests.csv")
    _check_rows(d / "requests.csv", rows, counts)
    timeline = []
    if (d / "timeline.csv").is_file():
        total = summary.get("kv_capacity_total_tokens")
        if total is not None:
            total = _whole(summary, "kv_capacity_total_tokens", 1)
        timeline = binned_timeline(_timeline_rows(d / "timeline.csv"), capacity, total=total)
    return Run(label, figures, _percentiles(ttft), _percentiles(tpot), timeline)


def _latencies(path: Path) -> tuple[list[float], list[float], Counter]:
    """TTFT and TPOT in ms of finished requests (TPOT of those with more than one token), as
    `kvsched.point.figures` counts them, and the rows of each status. Every other cell is
    checked too: a number or empty, the status one of STATUSES."""
    ttft, tpot, statuses = [], [], Counter()
    rows = _read_csv(path)
    header = next(rows)
    col = {name: k for k, name in enumerate(header)}
    missing = [name for name in ("status", "ttft", "itl_count", "itl_sum") if name not in col]
    if missing:
        raise KvschedError(f"{path}: no {missing[0]} column")
    status, t, n, s = col["status"], col["ttft"], col["itl_count"], col["itl_sum"]
    numeric = [k for k in range(len(header)) if k != status]
    for where, row in rows:
        values = _numbers(where, header, row, numeric)
        if row[status] not in STATUSES:
            raise KvschedError(f"{where}: status {_brief(row[status])} is not one of {', '.join(STATUSES)}")
        statuses[row[status]] += 1
        if row[status] != "finished":
            continue
        if (None in (values[t], values[n], values[s]) or values[n] < 0 or not values[n].is_integer()
                or values[t] < 0 or values[s] < 0):
            raise KvschedError(f"{where}: a finished request needs ttft >= 0, itl_sum >= 0 and a whole itl_count >= 0")
        ttft.append(values[t] * 1000)
        if values[n] > 0:
            tpot.append(values[s] / values[n] * 1000)
    return ttft, tpot, statuses


def _check_rows(path: Path, statuses: Counter, counts: dict[str, int]) -> None:
    """requests.csv has a row per request (run.py): as many finished and rejected rows as
    summary.json's completed and rejected, else it was cut at a row boundary or is another
    run's. (Unfinished requests have no count in summary.json to check.)"""
    for status, key in (("finished", "completed"), ("rejected", "rejected")):
        if statuses[status] != counts[key]:
            raise KvschedError(f"{path}: {statuses[status]:,} {status} rows, but summary.json has {key} "
                               f"{counts[key]:,} (cut short, or another run's file)")


def _timeline_rows(path: Path) -> list[list[float]]:
    """timeline.csv's rows: time, queue, running, KV tokens[, replica], every cell a number,
    a replica a whole number below kvsched.limits.MAX_REPLICAS."""
    from kvsched.limits import MAX_REPLICAS
    rows = _read_csv(path)
    header = next(rows)
    if len(header) not in (4, 5):
        raise KvschedError(f"{path}:1: expected 4 or 5 columns (time, queue_length, running, kv_used_tokens"
                           f"[, replica]), got {len(header)}")
    out = []
    for where, row in rows:
        values = _numbers(where, header, row, range(len(header)))
        if None in values:
            raise KvschedError(f"{where}: {header[values.index(None)]} is empty")
        if len(values) == 5 and not (values[4].is_integer() and 0 <= values[4] < MAX_REPLICAS):
            raise KvschedError(f"{where}: replica must be a whole number in [0, {MAX_REPLICAS:,}), "
                               f"got {_brief(row[4])}")
        out.append(values)
    return out


def _read_csv(path: Path) -> Iterator[Any]:
    """A CSV file kvsched wrote: its header, then each row as (`path:line`, cells). Every row
    has the header's number of cells, and the file ends with a line break (one cut short
    is refused, not read as a shorter last row)."""
    with about(path), open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f)
        try:
            header = next(rows, None)
            if not header:
                raise KvschedError(f"{path}: empty (no header line)")
            yield header
            for row in rows:
                if len(row) != len(header):
                    raise KvschedError(f"{path}:{rows.line_num}: {len(row)} fields, the header has {len(header)}")
                yield f"{path}:{rows.line_num}", row
        except UnicodeDecodeError:      # decoded a block at a time: find the line
            raise KvschedError(f"{path}:{_not_utf8(path)}: not UTF-8 text") from None
        f.buffer.seek(-1, 2)
        if f.buffer.read(1) != b"\n":
            raise KvschedError(f"{path}:{rows.line_num}: cut short (the last line has no line break)")


def _not_utf8(path: Path) -> int:
    """The first line of `path` that is not UTF-8 (a line break is never part of a UTF-8 character)."""
    with open(path, "rb") as f:
        for line, text in enumerate(f, 1):
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                return line
    return 0


def _numbers(where: str, header: list[str], row: list[str], columns: Any) -> list[Optional[float]]:
    """The cells of `columns` as finite numbers (None: an empty cell, a time that did not
    happen), indexed as the row; the other cells None."""
    values: list[Optional[float]] = [None] * len(row)
    for k in columns:
        if row[k] == "":
            continue
        try:
            values[k] = float(row[k])
        except ValueError:
            raise KvschedError(f"{where}: {header[k]} {_brief(row[k])} is not a number") from None
        if not math.isfinite(values[k]):
            raise KvschedError(f"{where}: {header[k]} {_brief(row[k])} is not a finite number")
    return values


def _percentiles(values: list[float]) -> list[float]:
    import numpy as np
    from kvsched.point import QUANTILES
    return np.percentile(values, QUANTILES).tolist() if values else []


def flatten(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary's scalars, its tiers as `tier_<name>_<key>` (the sweep's and capacity's form)."""
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) or v is None}
    tiers = summary.get("tiers") or []
    if not (isinstance(tiers, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tiers)):
        raise ValueError("tiers must be a list of objects, each with a name")
    for tier in tiers:
        flat.update({f"tier_{tier['name']}_{k}": v for k, v in tier.items() if k != "name"})
    return flat


# ---- sweep folders: sweep.json, points/<key>.json ----

def _sweep(d: Path) -> Folder:
    meta = read_json(d / "sweep.json")
    keys = meta.get("keys")            # this grid's points (older sweep.json files: every point file)
    if keys is not None and not (isinstance(keys, list) and all(_is_key(k) for k in keys)):
        raise KvschedError(f"{d / 'sweep.json'}: keys must be a list of point keys (file names in points/)")
    files = [d / "points" / f"{k}.json" for k in keys] if keys is not None else sorted((d / "points").glob("*.json"))
    points = [_point(f) for f in files if f.is_file()]      # a listed point without a file: not finished
    ok = [p for p in points if p["status"] == "ok"]
    if not ok:
        raise KvschedError(f"{d}: no point of the sweep finished ok ({len(points)} of {meta.get('points', '?')} "
                           "points written)")
    groups: dict[str, list[dict]] = defaultdict(list)
    for p, label in sorted(zip(ok, _labels([p["axes"] for p in ok])), key=_order(meta)):
        groups[label].append(p)
    curves = [Curve(label, _by_rate([(p["axes"]["rate"], p["figures"]) for p in ps])) for label, ps in groups.items()]
    rate, runs_from = _shown_rate(groups)
    shown = list(groups.items())[:MAX_RUNS]
    runs = [_figures_run(label, _at(ps, rate)) for label, ps in shown]
    notes = [f"{len(files) - len(ok)} of {len(files)} points did not finish ok and are left out"] \
        if len(ok) < len(files) else []
    if len(groups) > MAX_RUNS:
        notes.append(f"distributions, timelines and tiers show the first {MAX_RUNS} of {len(groups)} configurations")
    source = "the grid in sweep.json" if keys is not None else "points/*.json"
    return Folder("sweep", curves, runs, f"{len(ok)} points of {source}, seeds averaged per rate", runs_from,
                  notes=notes)


def _is_key(k: Any) -> bool:
    """A point key names a file in points/: no separators, no leading dot."""
    return isinstance(k, str) and bool(re.fullmatch(r"[\w-][\w.-]*", k))


def _point(f: Path) -> dict:
    p = read_json(f)
    with about(f):
        if p["key"] != f.stem:         # a point file copied or renamed: not this grid's point
            raise ValueError(f"key {_brief(p['key'])} is not its file's name {f.stem!r} (points/KEY.json)")
        if p["status"] == "ok":
            axes, figures = p["axes"], p["figures"]
            if not isinstance(figures, dict) or not isinstance(axes["params"], dict):
                raise TypeError("figures and axes.params must be objects")
            check_figures(figures, "figures")
            _rate_key(axes["rate"]), int(axes["seed"]), str(axes["policy"])
    return p


def _labels(axes: list[dict]) -> list[str]:
    """Policy, then each other axis (parameters as key=value) that varies across the points."""
    def parts(a: dict) -> dict[str, str]:
        out = {k: f"{k}={v}" for k, v in a.items() if k not in ("policy", "rate", "seed", "params")}
        out.update({f"params.{k}": f"{k}={v}" for k, v in sorted(a["params"].items())})
        return out
    each = [parts(a) for a in axes]
    varying = sorted({k for p in each for k in p if len({q.get(k) for q in each}) > 1})
    return [" ".join([str(a["policy"])] + [p[k] for k in varying if k in p]) for a, p in zip(axes, each)]


def _order(meta: dict) -> Callable[[tuple[dict, str]], tuple]:
    """Configurations in the order of sweep.json's policy axis, then by label, numbers by value."""
    axes = meta.get("axes") if isinstance(meta.get("axes"), dict) else {}
    rank = {str(p): k for k, p in enumerate(axes.get("policy") or [])}

    def key(item: tuple[dict, str]) -> tuple:
        point, label = item
        words = [(0, float(w), "") if _is_number(w) else (1, 0.0, w) for w in re.split(r"([-+]?\d+(?:\.\d+)?)", label)]
        return rank.get(str(point["axes"]["policy"]), len(rank)), words, _rate_key(point["axes"]["rate"])
    return key


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _rate_key(rate: Any) -> float:
    """A point's rate; none (the trace's own rate) sorts first."""
    if rate is None:
        return -math.inf
    if not finite(rate):
        raise TypeError(f"axes.rate must be a number or null, got {_brief(rate)}")
    return float(rate)


def _by_rate(pairs: list[tuple[Any, dict]]) -> list[dict[str, float]]:
    """CURVE_KEYS averaged over the seeds of each rate, rates ascending."""
    by: dict[float, list[dict]] = defaultdict(list)
    for rate, figures in pairs:
        by[_rate_key(rate)].append(figures)
    return [{"rate": rate, **{k: _mean([f.get(k) for f in fs]) for k in CURVE_KEYS}} for rate, fs in sorted(by.items())]


def _mean(values: list[Any]) -> float:
    xs = [x for x in map(number, values) if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def finite(v: Any) -> bool:
    """A number (not a boolean) that is finite as a float: a JSON integer of 400 digits is not
    (math.isfinite raises OverflowError on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _brief(v: Any) -> str:
    """A bad value for a message: its repr, a long one cut with its length (a 401-digit
    integer cut to 40 digits would read as a plausible number)."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


def _count(key: str) -> bool:
    return key in COUNTS or key.startswith("tier_") and key.endswith(TIER_COUNTS)


def check_lists(figures: Any, where: str) -> None:
    """The figure lists a report draws: 101 percentiles (or none) and timeline rows of 4
    numbers, all finite; anything else is malformed (ValueError naming the key)."""
    if not isinstance(figures, dict):
        raise ValueError(f"{where} must be an object of figures, got {_brief(figures)}")
    for key in ("ttft_quantiles_ms", "tpot_quantiles_ms"):
        q = figures.get(key) or []
        if not (isinstance(q, list) and len(q) in (0, 101) and all(finite(v) and v >= 0 for v in q)):
            raise ValueError(f"{where}: {key} must be 101 finite numbers >= 0 (percentiles 0..100) or empty")
    rows = figures.get("timeline") or []
    if not (isinstance(rows, list) and all(isinstance(r, list) and len(r) == 4 and all(finite(v) for v in r)
                                           for r in rows)):
        raise ValueError(f"{where}: timeline must be rows of 4 finite numbers (time, queue, running, KV use)")


def check_figures(figures: Any, where: str, numbers: tuple[str, ...] = ()) -> None:
    """`check_lists`, and the figures the page reads: NUMBERS, `numbers` and the flat tier
    figures each a finite number or null, COUNTS and the tiers' counts whole numbers >= 0 or
    null, TEXTS text or null (ValueError naming the key)."""
    check_lists(figures, where)
    at = f"{where}: " if where else ""
    for key, v in figures.items():
        if (key in NUMBERS or key in numbers or key.startswith("tier_")) and not (v is None or finite(v)):
            raise ValueError(f"{at}{key} must be a finite number or null, got {_brief(v)}")
        if v is not None and finite(v) and (key.endswith("_ms") and v < 0 or key in SHARES and not 0 <= v <= 1):
            raise ValueError(f"{at}{key} must be {'a share in [0, 1]' if key in SHARES else 'a time >= 0'}, "
                             f"got {_brief(v)}")
        if _count(key) and not (v is None or isinstance(v, int) and finite(v) and v >= 0):
            raise ValueError(f"{at}{key} must be a whole number >= 0 or null, got {_brief(v)}")
        if key in TEXTS and not (v is None or isinstance(v, str)):
            raise ValueError(f"{at}{key} must be text or null, got {_brief(v)}")


def _whole(doc: dict, key: str, low: int) -> int:
    """doc[key], a whole number >= low that a float holds (not a boolean, not a float to
    truncate), else ValueError."""
    v = doc[key]
    if not (isinstance(v, int) and finite(v)) or v < low:
        raise ValueError(f"{key} must be a whole number >= {low}, got {_brief(v)}")
    return v


def number(v: Any) -> float:
    """A figure as a float; NaN for a missing, null or non-numeric one."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _shown_rate(groups: dict[str, list[dict]]) -> tuple[Optional[float], str]:
    """The highest rate at which every configuration has an ok point (None: each its own highest)."""
    common = set.intersection(*({_rate_key(p["axes"]["rate"]) for p in ps} for ps in groups.values()))
    if not common:
        return None, "each configuration's highest rate (no rate is common to all), lowest seed"
    rate = max(common)
    return rate, f"rate {_rate_text(rate)}, the highest at which every configuration has an ok point; lowest seed"


def _rate_text(rate: float) -> str:
    return "of the trace" if rate == -math.inf else f"{rate:g} req/s"


def _at(points: list[dict], rate: Optional[float]) -> dict:
    """The lowest-seed point at `rate` (None: at the group's highest rate)."""
    rate = max(_rate_key(p["axes"]["rate"]) for p in points) if rate is None else rate
    return min((p for p in points if _rate_key(p["axes"]["rate"]) == rate), key=lambda p: int(p["axes"]["seed"]))


def _figures_run(label: str, point: dict) -> Run:
    figures = point.get("figures", point)
    return Run(label, {k: v for k, v in figures.items() if not isinstance(v, (list, dict))},
               list(figures.get("ttft_quantiles_ms") or []), list(figures.get("tpot_quantiles_ms") or []),
               list(figures.get("timeline") or []))


# ---- capacity folders: capacity.json ----

def _capacity(d: Path) -> Folder:
    path = d / "capacity.json"
    doc = read_json(path)
    with about(path):
        limits = _limits(doc)
        seeds = doc.get("seeds") or []
        if not (isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ValueError(f"seeds must be a list of whole numbers, got {_brief(seeds)}")
        numbers = tuple(lim.key for lim in limits)
        cap = Capacity(limits, [_capacity_policy(n, p, numbers) for n, p in doc["policies"].items()], seeds)
        runs = [_figures_run(n, p["at_max_rate_runs"][0]) for n, p in doc["policies"].items()
                if p.get("at_max_rate_runs")][:MAX_RUNS]
    if not cap.policies:
        raise KvschedError(f"{path}: no policies in it")
    curves = [Curve(p.name, _by_rate([(e.rate, e.figures) for e in p.evaluations])) for p in cap.policies]
    return Folder("capacity", curves, runs, "capacity.json's evaluations (every probed rate), seeds averaged per rate",
                  "each policy's first seed's run at its max rate (at_max_rate_runs)", capacity=cap)


def _limits(doc: dict) -> list[Limit]:
    limits = []
    for k, s in enumerate(doc["slos"]):
        ms = _num(s, "ms", f"slos[{k}]")
        if not (isinstance(s["key"], str) and s["key"] and all(isinstance(s.get(f, ""), str) for f in ("stat", "metric"))):
            raise ValueError(f"slos[{k}]: key must be a figure's name, stat and metric text")
        limits.append(Limit(s["key"], ms, f"{s.get('stat', '')} {s.get('metric', '').upper()} <= "
                            f"{ms:g} ms ({s['key']})", "ms"))
    att = doc.get("attainment")
    if att:
        target = _num(att, "target", "attainment")
        limits.append(Limit("goodput_attainment", target, f"goodput attainment >= {target:g}", "share of requests",
                            upper=False))
    return limits


def _capacity_policy(name: str, p: dict, numbers: tuple[str, ...]) -> CapacityPolicy:
    """`numbers`: the SLOs' figures, read as numbers in every run besides NUMBERS."""
    where = f"policies.{name}"
    at = p.get("at_max_rate") or {}
    met = at.get("met") if isinstance(at, dict) else "?"
    if not (met is None or isinstance(met, bool)):
        raise ValueError(f"{where}.at_max_rate must be an object whose met is true, false or null")
    if not (isinstance(p.get("bounded_by", ""), str) and isinstance(p.get("gpus") or {}, dict)):
        raise ValueError(f"{where}: bounded_by must be text and gpus an object or null")
    rates = [_num(p, key, where) for key in ("max_rate", "max_rate_min", "max_rate_max")]
    mu = None if p.get("mu") is None else _num(p, "mu", where)
    runs = p.get("at_max_rate_runs") or []
    if not isinstance(runs, list):
        raise ValueError(f"{where}.at_max_rate_runs must be a list of runs, got {_brief(runs)}")
    for k, run in enumerate(runs):
        check_figures(run, f"{where}.at_max_rate_runs[{k}]", numbers)
    evaluations = []
    for k, e in enumerate(p.get("evaluations") or []):
        seed, met = e["seed"], e["met"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not isinstance(met, bool):
            raise ValueError(f"{where}.evaluations[{k}]: seed must be a whole number and met true or false, "
                             f"got {_brief(seed)} and {_brief(met)}")
        check_figures(e["figures"], f"{where}.evaluations[{k}].figures", numbers)
        evaluations.append(Evaluation(seed, _num(e, "rate", f"{where}.evaluations[{k}]"), met, dict(e["figures"])))
    return CapacityPolicy(name, *rates, mu, p.get("bounded_by", ""), met, evaluations, p.get("gpus"))


def _num(doc: dict, key: str, where: str) -> float:
    """doc[key], a finite number (not a boolean), else malformed (ValueError naming the key)."""
    if not finite(doc[key]):
        raise ValueError(f"{where}.{key} must be a number, got {_brief(doc[key])}")
    return float(doc[key])
