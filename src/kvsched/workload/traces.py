"""Trace files as workloads, and the generic CSV and JSONL writers (`kvsched workload export`).
Formats and their checks live in `readers.py`."""
from __future__ import annotations

import json
from pathlib import Path

from kvsched.errors import KvschedError
from kvsched.files import atomic_file
from kvsched.workload.arrivals import Arrivals, Closed, Poisson, Replay, TraceRate
from kvsched.workload.bundled import OPENERS
from kvsched.workload.request import Workload
from kvsched.workload.spec import Phase, WorkloadSpec


def trace_arrivals(timed: bool | None, rate: float | None, arrivals: Arrivals | None) -> Arrivals | None:
    """The arrival process for a trace: `arrivals` if given (its mean rate set to `rate`),
    else the trace's own times (scaled to `rate`), else Poisson at `rate`."""
    if arrivals is not None:
        if rate is None:
            return arrivals
        if isinstance(arrivals, Closed):
            raise KvschedError("--rate does not apply to closed-loop arrivals (the loop sets the rate)")
        return arrivals.with_rate(rate)
    if rate is None:
        return None
    if timed is None:
        return TraceRate(rate)
    return Replay(rate=rate) if timed else Poisson(rate)


def load_trace(path: str | Path, *, rate: float | None = None, arrivals: Arrivals | None = None,
               num_requests: int | None = None, seed: int = 0, format: str = "auto",
               window: tuple[float, float] | None = None, cap_len: int | None = None,
               keep_hashes: bool = False) -> Workload:
    """Read a trace as a workload. A timed trace replays its own times (`rate` rescales them
    to that mean rate); a length-only trace needs `rate` (Poisson) or `arrivals`.
    `num_requests` takes the first N rows, or, when N exceeds the rows, resamples rows (and
    a timed trace's gaps) with replacement, seeded."""
    path = Path(path)
    if num_requests is not None and num_requests < 1:
        raise KvschedError(f"--num-requests must be >= 1, got {num_requests}")
    phase = Phase(num_requests, trace=path, format=format, window=window,
                  arrivals=trace_arrivals(None, rate, arrivals))
    return WorkloadSpec((phase,), seed=seed, cap_len=cap_len, keep_hashes=keep_hashes,
                        name=str(path)).build()


def export(workload: Workload, path: str | Path) -> None:
    """`kvsched workload export`: NAME.jsonl gets the generic JSONL (every request's content
    kept), any other name the generic CSV (refused if it would lose content)."""
    (export_jsonl if Path(path).suffix.lower() == ".jsonl" else export_csv)(workload, path)


def not_carried(workload: Workload) -> list[str]:
    """What schedulers see of `workload` that neither export format holds (the flags that set
    it again when the file is read: `workload export` says so, it drops nothing silently)."""
    out = []
    if workload.output_known.any():
        out.append("which output lengths schedulers may see (read it with --output-known)")
    if any(t.ttft_slo is not None or t.tbt_slo is not None or t.priority for t in workload.tiers):
        out.append("the tiers' SLOs and priorities (give the same --tier flags)")
    if workload.declared_types is not None:
        out.append("the declared request types WAIT reads")
    return out


def export_csv(workload: Workload, path: str | Path) -> None:
    """Write the generic CSV `arrival_time,prompt_tokens,output_tokens[,tier]`, exactly
    (shortest round-trip float text), via a temporary file so nothing is half written. A
    workload whose content a CSV cannot hold (shared segments, hash_ids) is refused."""
    path = _target(workload, path)
    lost = _content(workload)
    if lost:
        raise KvschedError(f"--out {path}: a CSV cannot hold the workload's {' and '.join(lost)}; "
                           f"write {path.with_suffix('.jsonl').name} (JSONL) to keep them")
    names = [t.name for t in workload.tiers]
    for name in names:
        if "," in name or '"' in name or not name.strip():
            raise KvschedError(f"tier name {name!r} cannot be written as a CSV field")
    tiered = _tiered(workload)
    with atomic_file(path) as f:
        f.write("arrival_time,prompt_tokens,output_tokens" + (",tier\n" if tiered else "\n"))
        tiers = workload.tier_index.tolist()
        for k, (t, p, o) in enumerate(zip(workload.arrival.tolist(), workload.prompt.tolist(),
                                          workload.output.tolist())):
            tail = f",{names[tiers[k]] if tiers[k] >= 0 else ''}" if tiered else ""
            f.write(f"{t!r},{p},{o}{tail}\n")


def export_jsonl(workload: Workload, path: str | Path) -> None:
    """Write the generic JSONL (readers.py): arrival_time, prompt_tokens, output_tokens, and where
    the workload has them tier, segments ([[content_id, tokens], ...]) and hash_ids, so reading
    the file back gives the same requests and the same prefix-cache hits. Times are exact (JSON
    writes a float's shortest round-trip text); nothing is half written."""
    path = _target(workload, path)
    tiered = _tiered(workload)
    names = [t.name for t in workload.tiers]
    seg, prefix = workload.segments, workload.prefix
    with atomic_file(path) as f:
        tiers = workload.tier_index.tolist()
        for k, (t, p, o) in enumerate(zip(workload.arrival.tolist(), workload.prompt.tolist(),
                                          workload.output.tolist())):
            row: dict = {"arrival_time": t, "prompt_tokens": p, "output_tokens": o}
            if tiered and tiers[k] >= 0:
                row["tier"] = names[tiers[k]]
            if seg is not None:
                row["segments"] = [list(x) for x in zip(seg.ids[k].tolist(), seg.lengths[k].tolist())]
            if prefix is not None:
                row["hash_ids"] = prefix[k].tolist()
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _target(workload: Workload, path: str | Path) -> Path:
    """The file to export to, once the workload is known to have an arrival time per request
    (without sessions, no segment names another request's own tokens: Workload checks it)."""
    if not workload.timed:
        raise KvschedError("the workload has no arrival times (a length-only trace): give --rate "
                           "or --arrivals to export it")
    if workload.closed_loop:
        raise KvschedError("a closed-loop workload has no arrival times to export (they are decided "
                           "by the simulation); give open-loop arrivals, e.g. --arrivals poisson:RATE")
    if workload.has_sessions:
        raise KvschedError("a workload with sessions has no arrival times to export for its later turns (each is "
                           "issued think seconds after its previous turn finishes, in the simulation)")
    if str(path).strip() in ("", ".") or Path(path).is_dir():
        raise KvschedError(f"--out {str(path)!r} must name a file to write")
    path = Path(path)
    if path.suffix.lower() in OPENERS:
        raise KvschedError(f"--out {path}: export writes plain text, but a {path.suffix} file is read back "
                           "as compressed; name it .csv or .jsonl")
    return path


def _content(workload: Workload) -> list[str]:
    """What a workload holds beyond times, lengths and tiers (each a CSV would drop)."""
    lost = []
    if workload.segments is not None and len(workload.segments.ids.values):
        lost.append("shared prompt segments (the content prefix caching shares)")
    if workload.prefix is not None and len(workload.prefix.values):
        lost.append("Mooncake hash_ids")
    return lost


def _tiered(workload: Workload) -> bool:
    return bool(workload.tiers) and bool((workload.tier_index >= 0).any())
