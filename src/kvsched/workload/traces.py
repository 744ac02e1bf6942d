"""Trace files as workloads, and the generic CSV writer (`kvsched workload export`).
Formats and their checks live in `readers.py`."""
from __future__ import annotations

import math
from pathlib import Path


from kvsched.errors import KvschedError
from kvsched.files import atomic_file
from kvsched.workload.arrivals import Arrivals, Closed, Poisson, Replay, TraceRate
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


def export_csv(workload: Workload, path: str | Path) -> None:
    """Write the generic CSV `arrival_time,prompt_tokens,output_tokens[,tier]`, exactly
    (shortest round-trip float text), via a temporary file so nothing is half written."""
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
    tiered = bool(workload.tiers) and bool((workload.tier_index >= 0).any())
    names = [t.name for t in workload.tiers]
    for name in names:
        if "," in name or '"' in name or not name.strip():
            raise KvschedError(f"tier name {name!r} cannot be written as a CSV field")
    with atomic_file(path) as f:
        f.write("arrival_time,prompt_tokens,output_tokens" + (",tier\n" if tiered else "\n"))
        tiers = workload.tier_index.tolist()
        for k, (t, p, o) in enumerate(zip(workload.arrival.tolist(), workload.prompt.tolist(),
                                          workload.output.tolist())):
            if not math.isfinite(t):
                raise KvschedError(f"request {k} has no finite arrival time")
            tail = f",{names[tiers[k]] if tiers[k] >= 0 else ''}" if tiered else ""
            f.write(f"{t!r},{p},{o}{tail}\n")



