"""Records -> summary with vLLM's benchmark names (benchmarks/benchmark_serving.py).

TTFT, TPOT and E2EL are per request (percentiles by numpy's linear interpolation, as vLLM);
ITL is over every inter-token gap of every request, kept in a log-spaced histogram so the
count, mean and std are exact and the percentiles exact to the bin (relative width 1e-3)
for any number of tokens. A workload with tiers adds the same figures per tier (`tier_summary`),
from per-tier gap histograms the replicas keep only then.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython
if cython.compiled:                         # C's log, which math.log calls for a positive float
    from cython.cimports.libc.math import log as _log
else:
    from math import log as _log

from kvsched.errors import KvschedError


class GapHistogram:
    """Inter-token gaps in seconds: log bins of relative width `resolution` from `low` up."""

    def __init__(self, resolution: float = 1e-3, low: float = 1e-7, high: float = 1e6,
                 counts: list[int] | None = None) -> None:
        """`counts`: bins to share with other histograms of the same bins (a cluster's replicas
        share one list, ~120 KB, instead of one each); `merged` sums a shared list once."""
        self._log_low = math.log(low)
        self._scale = 1.0 / math.log1p(resolution)
        self._ratio = 1.0 + resolution
        self.low = low
        size = int((math.log(high) - self._log_low) * self._scale) + 2
        if counts is not None and len(counts) != size:
            raise ValueError(f"shared bins have {len(counts)} entries, these bins need {size}")
        self.counts = [0] * size if counts is None else counts
        self._top = len(self.counts) - 1
        self.n = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.max = 0.0

    @cython.locals(k=cython.Py_ssize_t, x=cython.double)
    def add(self, gap: float, n: int = 1) -> None:
        if n <= 0:
            return
        if gap > self.low:
            x = (_log(gap) - self._log_low) * self._scale
            k = cython.cast(cython.Py_ssize_t, x) + 1           # int(x): toward zero
            if k >= self._top:
                k = self._top
        else:
            k = 0
        self.counts[k] += n
        self.n += n
        self.total += gap * n
        self.total_sq += gap * gap * n
        if gap > self.max:
            self.max = gap

    def add_many(self, gaps: np.ndarray) -> None:
        """Add every gap of `gaps` (a 1-d float array), vectorised. Each lands in exactly the bin
        `add` gives it: bins come from numpy's log, and the few gaps whose bin position lies
        within 1e-6 of a bin edge (where numpy's and the math module's log could round apart)
        are binned again by `add`'s own formula. `total` and `total_sq` are summed by numpy, so
        they may differ from one-by-one `add`s in the last bits."""
        g = np.asarray(gaps, dtype=np.float64).ravel()
        if not len(g):
            return
        above = g > self.low
        k = np.zeros(len(g), np.int64)
        if above.any():
            x = (np.log(g[above]) - self._log_low) * self._scale
            kk = x.astype(np.int64) + 1
            edge = np.flatnonzero(np.abs(x - np.rint(x)) < 1e-6)
            if len(edge):
                lg, log_low, scale = g[above][edge].tolist(), self._log_low, self._scale
                kk[edge] = [int((_log(v) - log_low) * scale) + 1 for v in lg]
            np.minimum(kk, self._top, out=kk)
            k[above] = kk
        bins, counts = np.unique(k, return_counts=True)
        c = self.counts
        for b, m in zip(bins.tolist(), counts.tolist()):
            c[b] += m
        self.n += len(g)
        self.total += float(g.sum())
        self.total_sq += float(np.dot(g, g))
        m = float(g.max())
        if m > self.max:
            self.max = m

    def copy(self) -> "GapHistogram":
        return GapHistogram.merged([self])

    @classmethod
    def merged(cls, parts: list["GapHistogram"]) -> "GapHistogram":
        """One histogram holding every gap of `parts` (same bins). Parts that share their bins
        (`counts`) count them once; the totals are summed part by part, in order."""
        out = cls()
        bins = list({id(h.counts): h.counts for h in parts}.values())
        if bins:        # summed at once (exact: int64 counts), not one list per part
            out.counts = np.array(bins, np.int64).sum(axis=0).tolist()
        for h in parts:
            out.n += h.n
            out.total += h.total
            out.total_sq += h.total_sq
            out.max = max(out.max, h.max)
        return out

    def quantile(self, q: float, zeros: int = 0) -> float:
        """Gap at quantile q (0..1): the geometric centre of the bin holding that rank.
        `zeros` counts that many extra gaps of exactly 0 s in (below every other gap)."""
        n = self.n + zeros
        if n == 0:
            return math.nan
        rank = max(1, math.ceil(q * n))
        if rank <= zeros:
            return 0.0
        k = int(np.searchsorted(np.cumsum(self.counts), rank - zeros))
        if k == 0:
            return self.low
        lo = math.exp(self._log_low + (k - 1) / self._scale)
        return min(lo * math.sqrt(self._ratio), self.max)

    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    def std(self) -> float:
        if not self.n:
            return math.nan
        m = self.mean()
        return math.sqrt(max(0.0, self.total_sq / self.n - m * m))


@dataclass
class Goodput:
    """SLOs in ms for request_goodput (vLLM's --goodput ttft:MS tpot:MS e2el:MS)."""
    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> "Goodput":
        out = cls()
        for item in items:
            for part in item.split():
                key, sep, value = part.partition(":")
                if not sep or key not in ("ttft", "tpot", "e2el"):
                    raise KvschedError(f"--goodput expects ttft:MS, tpot:MS or e2el:MS, got {part!r}")
                try:
                    ms = float(value)
                except ValueError:
                    raise KvschedError(f"--goodput {key}: {value!r} is not a number") from None
                if not ms > 0:
                    raise KvschedError(f"--goodput {key} must be > 0 ms, got {value}")
                setattr(out, key, ms)
        return out


@dataclass
class RunRecords:
    """Everything a run produced, as arrays over requests plus run-level counters."""
    ids: np.ndarray
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    admitted: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    preemptions: np.ndarray
    recomputed: np.ndarray
    itl_max: np.ndarray
    tbt_violations: np.ndarray
    rejected: np.ndarray
    itl: GapHistogram
    iterations: int
    kv_capacity_tokens: int
    kv_time_integral: float     # sum of (KV tokens held during a batch) * batch time
    kv_peak_tokens: int
    peak_queue: int
    busy_time: float
    wall_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    # clusters only: where each request ran, KV transfer seconds, and per-replica counters
    replica: np.ndarray | None = None
    decode_replica: np.ndarray | None = None
    transfer: np.ndarray | None = None
    replica_stats: list[dict[str, Any]] | None = None
    # workloads with tiers: each request's tier (-1: none), the tiers, and per-tier ITL gaps
    tier_index: np.ndarray | None = None
    tiers: tuple = ()
    tier_itl: list[GapHistogram] | None = None
    client: Any = None          # kvsched.client.ClientPath: the summary's TTFT and E2E as a client sees them
    dropped: np.ndarray | None = None   # the control plane's: 1 shed, 2 abandoned, 0 neither (sim/admission.py)


def percentiles(values: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """`np.percentile(values, qs)` of a 1-d float64 array, bit for bit: numpy's default method
    'linear' (Hyndman and Fan's type 7, the one vLLM's benchmark_serving.py reports) as numpy
    computes it (numpy/lib/_function_base_impl.py: `_quantile`, `_get_indexes`, `_lerp`): the
    virtual index v = (n - 1) q / 100, the order statistics a, b at floor(v) and floor(v) + 1
    (both the last at v >= n - 1, where numpy's index is -1 and gamma v + 1), gamma = v - floor(v),
    and a + (b - a) gamma, or b - (b - a)(1 - gamma) where gamma >= 0.5.

    Not numpy's own because its path imports numpy.ma on first use (np.unique's masked-array
    check): about 10 ms of every run's start-up. numpy itself takes everything else: another
    dtype or shape, no values, a q not a Python number in 0..100, NaN or an infinity (its NaN
    rule and inf - inf are its own), and a zero (its partition may place -0.0 and 0.0
    otherwise than this one's, and the sign of a zero result with them)."""
    x = np.asarray(values)
    n = len(x) if x.ndim == 1 else 0
    if (x.dtype != np.float64 or n == 0 or not all(type(q) in (int, float) and 0 <= q <= 100 for q in qs)
            or not np.isfinite(x).all() or not x.all()):
        return [float(p) for p in np.atleast_1d(np.percentile(x, qs))]
    spots = []
    for q in qs:
        v = (n - 1) * (q / 100)
        if v >= n - 1:
            spots.append((n - 1, n - 1, v + 1))
        else:
            lo = math.floor(v)
            spots.append((lo, lo + 1, v - lo))
    order = np.partition(x, sorted({k for lo, hi, _ in spots for k in (lo, hi)}))
    out = []
    for lo, hi, t in spots:
        a, b = float(order[lo]), float(order[hi])
        d = b - a
        out.append(b - d * (1 - t) if t >= 0.5 else a + d * t)
    return out


def _stats(name: str, values_s: np.ndarray) -> dict[str, float]:
    ms = values_s * 1000.0
    if len(ms) == 0:
        return {f"{k}_{name}_ms": math.nan for k in ("mean", "median", "std", "p90", "p99")}
    p = percentiles(ms, (50, 90, 99))
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(p[0]),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(p[1]),
            f"p99_{name}_ms": float(p[2])}


def _itl_stats(h: GapHistogram) -> dict[str, float]:
    return {"mean_itl_ms": h.mean() * 1000, "median_itl_ms": h.quantile(0.5) * 1000,
            "std_itl_ms": h.std() * 1000, "p90_itl_ms": h.quantile(0.9) * 1000,
            "p99_itl_ms": h.quantile(0.99) * 1000}


def summarize(rec: RunRecords, goodput: Goodput | None = None, trim: int = 0,
              tbt_first_zero: bool = False) -> dict[str, Any]:
    """`engine_summary` of the records as a client sees them (`rec.client`, kvsched/client.py:
    every token later by the front end and output path; ITL unchanged), with the engine's own
    TTFT and E2E beside them as engine_*; without a client path, the engine's figures."""
    client = rec.client
    if client is None:
        return engine_summary(rec, goodput, trim, tbt_first_zero)
    first, finished = client.times(rec)
    seen = engine_summary(dataclasses.replace(rec, first_token=first, finished=finished, client=None), goodput, trim,
                          tbt_first_zero)
    summary = engine_summary(dataclasses.replace(rec, client=None), goodput, trim, tbt_first_zero)
    summary.update({f"engine_{k}": summary[k] for k in ENGINE_KEYS if k in summary})
    # what the client's clock changes: latencies from arrival, and what is judged on them;
    # throughput, TPOT and ITL stay the engine's (the same bit for bit)
    summary.update({k: v for k, v in seen.items() if "ttft" in k or "e2el" in k or k in ("request_goodput", "tiers")})
    summary.update({f"client_{k}": v for k, v in dataclasses.asdict(client).items()})
    return summary


ENGINE_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


def engine_summary(rec: RunRecords, goodput: Goodput | None = None, trim: int = 0,
                   tbt_first_zero: bool = False) -> dict[str, Any]:
    """The run summary. `trim` drops the first and last `trim` requests (arrival order) and
    measures throughput over the window from the arrival of request trim+1 to that of the
    trim-th last, counting requests finished inside it (stability-capacity.txt, section 5.2).

    A workload with tiers adds `tiers`, one dict per tier (`tier_summary`).
    `tbt_first_zero` adds `p99_tbt_first_zero_ms` (and the same per tier): the p99 of the
    inter-token gaps plus one gap of 0 s per request that produced a first token, which is the
    TBT sample list of the SLAI authors' telemetry (rad-slai.txt section 7 reports its p99). It
    biases the tail low; ITL (vLLM's definition, the gaps between consecutive output tokens)
    has no such zeros and stays as it is."""
    n = len(rec.arrival)
    done = np.isfinite(rec.finished)
    keep = done.copy()
    if trim:
        if trim < 0 or 2 * trim >= n:
            raise KvschedError(f"--trim {trim} leaves no requests out of {n}")
        # arrival order (a session's later turns arrive when the simulation issues them)
        order = np.argsort(rec.arrival, kind="stable")
        keep[order[:trim]] = False
        keep[order[n - trim:]] = False
        start, end = float(rec.arrival[order[trim]]), float(rec.arrival[order[n - trim - 1]])
        in_window = done & (rec.finished >= start) & (rec.finished <= end)
    else:
        start = float(rec.arrival.min()) if n else 0.0
        end = float(rec.finished[done].max()) if done.any() else start
        in_window = done
    duration = end - start
    ttft = rec.first_token[keep] - rec.arrival[keep]
    e2el = rec.finished[keep] - rec.arrival[keep]
    multi = keep & (rec.output > 1)
    tpot = (rec.finished[multi] - rec.first_token[multi]) / (rec.output[multi] - 1)
    rate = (lambda x: x / duration if duration > 0 else math.nan)
    out_tokens = int(rec.output[in_window].sum())
    in_tokens = int(rec.prompt[in_window].sum())
    summary: dict[str, Any] = {
        "completed": int(done.sum()),
        "rejected": int(rec.rejected.sum()),
        "total_input": int(rec.prompt[done].sum()),
        "total_output": int(rec.output[done].sum()),
        "duration": duration,
        "request_throughput": rate(int(in_window.sum())),
        "request_goodput": None,
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
    }
    if goodput is not None and any(v is not None for v in (goodput.ttft, goodput.tpot, goodput.e2el)):
        good = in_window.copy()
        if goodput.ttft is not None:
            good &= (rec.first_token - rec.arrival) * 1000 <= goodput.ttft
        if goodput.tpot is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                tp = np.where(rec.output > 1, (rec.finished - rec.first_token) / (rec.output - 1), 0.0)
            good &= tp * 1000 <= goodput.tpot
        if goodput.e2el is not None:
            good &= (rec.finished - rec.arrival) * 1000 <= goodput.e2el
        summary["request_goodput"] = rate(int(good.sum()))
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        summary.update(_stats(name, values))
    summary.update(_itl_stats(rec.itl))
    if tbt_first_zero:
        firsts = int(np.isfinite(rec.first_token).sum())
        summary["p99_tbt_first_zero_ms"] = rec.itl.quantile(0.99, zeros=firsts) * 1000
    summary.update(_stats("e2el", e2el))
    cap = rec.kv_capacity_tokens
    mean_kv, peak_kv = _kv_usage(rec)
    summary.update({
        "mean_kv_usage": mean_kv,
        "peak_kv_usage": peak_kv,
        "kv_capacity_tokens": cap,
        "peak_queue_length": rec.peak_queue,
        "preemptions": int(rec.preemptions.sum()),
        "iterations": rec.iterations,
        "simulated_seconds": float(rec.finished[done].max() - rec.arrival.min()) if done.any() else 0.0,
        "wall_seconds": rec.wall_seconds,
    })
    if rec.tiers:
        summary["tiers"] = tier_summary(rec, keep, tbt_first_zero)
    summary.update(rec.extra)
    if rec.replica_stats is not None:
        summary.update(cluster_summary(rec, in_window, duration))
    return summary


def _kv_usage(rec: RunRecords) -> tuple[float, float]:
    """(mean, peak) KV usage: KV token-seconds over busy seconds x capacity, and the peak over
    capacity; replicas of several kinds (kvsched/pools.py) each against their own capacity
    (the mean weighted by busy seconds x capacity, the peak the largest share)."""
    caps = {st["kv_capacity_tokens"] for st in rec.replica_stats or () if "kv_capacity_tokens" in st}
    if len(caps) > 1:
        stats = rec.replica_stats
        held = sum(st["busy_time"] * st["kv_capacity_tokens"] for st in stats)
        return (sum(st["kv_time_integral"] for st in stats) / held if held > 0 else 0.0,
                max(st["kv_peak_tokens"] / st["kv_capacity_tokens"] for st in stats))
    cap = rec.kv_capacity_tokens
    return (rec.kv_time_integral / rec.busy_time / cap if rec.busy_time > 0 else 0.0, rec.kv_peak_tokens / cap)


def tier_summary(rec: RunRecords, keep: np.ndarray, tbt_first_zero: bool = False) -> list[dict[str, Any]]:
    """One dict per tier of the workload: name, priority, SLOs (ttft_slo_s, tbt_slo_s, None
    when unset), requests, completed, rejected; TTFT and TPOT (mean, median, std, p90, p99,
    named as the summary's) over the tier's requests that the summary measures (`keep`:
    completed, outside `--trim`); ITL over every gap of the tier's requests, from the per-tier
    histograms the replicas keep. SLO attainment (None when the tier has no such SLO, NaN when
    nothing was measured):
      ttft_slo_attainment  share of the tier's measured requests with TTFT <= its TTFT SLO;
      tbt_slo_attainment   share of the tier's measured requests with no gap above its TBT
                           SLO (tbt_violations == 0);
      itl_slo_attainment   share of the tier's inter-token gaps <= its TBT SLO, exact: 1 - (the
                           tier's TBT violations) / (its gaps).
    With `tbt_first_zero`, p99_tbt_first_zero_ms as in `summarize`."""
    done = np.isfinite(rec.finished)
    first = np.isfinite(rec.first_token)
    rows = []
    for t, tier in enumerate(rec.tiers):
        mine = rec.tier_index == t
        k = keep & mine
        ttft = rec.first_token[k] - rec.arrival[k]
        multi = k & (rec.output > 1)
        tpot = (rec.finished[multi] - rec.first_token[multi]) / (rec.output[multi] - 1)
        h = rec.tier_itl[t] if rec.tier_itl is not None else GapHistogram()
        row: dict[str, Any] = {"name": tier.name, "priority": tier.priority, "ttft_slo_s": tier.ttft_slo,
                               "tbt_slo_s": tier.tbt_slo, "requests": int(mine.sum()),
                               "completed": int((mine & done).sum()), "rejected": int(rec.rejected[mine].sum())}
        row.update(_stats("ttft", ttft))
        row.update(_stats("tpot", tpot))
        row.update(_itl_stats(h))
        if tbt_first_zero:
            row["p99_tbt_first_zero_ms"] = h.quantile(0.99, zeros=int((mine & first).sum())) * 1000
        measured = int(k.sum())
        row["ttft_slo_attainment"] = None if tier.ttft_slo is None else (
            float((ttft <= tier.ttft_slo).mean()) if measured else math.nan)
        row["tbt_slo_attainment"] = None if tier.tbt_slo is None else (
            float((rec.tbt_violations[k] == 0).mean()) if measured else math.nan)
        row["itl_slo_attainment"] = None if tier.tbt_slo is None else (
            1.0 - int(rec.tbt_violations[mine].sum()) / h.n if h.n else math.nan)
        rows.append(row)
    return rows


def cluster_summary(rec: RunRecords, in_window: np.ndarray, duration: float) -> dict[str, Any]:
    """Per-replica breakdown, and for disaggregated pools the KV transfer times and each
    pool's busy fraction. A replica's `completed` counts the requests that finished there
    (a prefill replica finishes only one-token outputs) and its throughput those finished in
    the summary's window (`--trim`); TTFT is over the first tokens it produced; busy
    fractions are busy seconds over the whole simulated span (first arrival to last finish)."""
    done = np.isfinite(rec.finished)
    span = float(rec.finished[done].max() - rec.arrival.min()) if done.any() else 0.0
    cap = rec.kv_capacity_tokens
    routed = rec.replica
    decoded = rec.decode_replica if rec.decode_replica is not None else np.full(len(routed), -1)
    rows = []
    for st in rec.replica_stats:
        k, role = st["replica"], st["role"]
        here = (decoded == k) if role == "decode" else (routed == k) & (decoded < 0)
        firsts = (routed == k) & np.isfinite(rec.first_token) if role != "decode" else np.zeros(len(routed), bool)
        ttft = (rec.first_token[firsts] - rec.arrival[firsts]) * 1000
        busy, cap_k = st["busy_time"], st.get("kv_capacity_tokens", cap)      # kinds differ in KV
        rows.append({
            "replica": k, "role": role, "completed": int((here & done).sum()),
            "request_throughput": int((here & in_window).sum()) / duration if duration > 0 else math.nan,
            "first_tokens": int(firsts.sum()),
            "mean_ttft_ms": float(ttft.mean()) if len(ttft) else math.nan,
            "p99_ttft_ms": percentiles(ttft, (99,))[0] if len(ttft) else math.nan,
            "iterations": st["iterations"], "preemptions": st["preemptions"],
            "busy_fraction": busy / span if span > 0 else math.nan,
            "mean_kv_usage": st["kv_time_integral"] / busy / cap_k if busy > 0 else 0.0,
            "peak_kv_usage": st["kv_peak_tokens"] / cap_k, "peak_queue_length": st["peak_queue"]})
    out: dict[str, Any] = {"replica_breakdown": rows}
    if rec.transfer is not None:
        x = rec.transfer[np.isfinite(rec.transfer)] * 1000
        out["mean_transfer_ms"] = float(x.mean()) if len(x) else math.nan
        out["p99_transfer_ms"] = percentiles(x, (99,))[0] if len(x) else math.nan
        for role in ("prefill", "decode"):
            stats = [st for st in rec.replica_stats if st["role"] == role]
            busy = sum(st["busy_time"] for st in stats)
            out[f"{role}_busy_fraction"] = busy / (len(stats) * span) if span > 0 else math.nan
    return out
