"""What a replica records of its requests as they decode (docs/architecture.md, "Replica"):
inter-token gaps into its histograms (per tier too), each request's largest gap and SLO
misses, and its row logs spilled to disk (the rows' one schema: sim/rowlog.py); and a run's
records over a cluster's replicas (`run_records`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.metrics import GapHistogram, RunRecords
from kvsched.sim.decode_set import Cohort

if TYPE_CHECKING:
    from kvsched.sim.cluster import Cluster
    from kvsched.sim.replica import Replica


@cython.locals(r="RequestTable", m=cython.double)
def fold(rep: Replica, i: int, gen: int, last: float, c: Cohort, lo: int, hi: int) -> None:
    """Record what a request did in the cohort `c` it left (`Cohort.leave`): the maximum and
    SLO misses of its gaps `c._gaps[lo:hi]`, and with tiers those gaps (one per decode step
    after the first in the cohort, the gaps `batch.decode_step` counted for it as the
    cohort's) into its tier's histogram."""
    r = rep.reqs
    r.gen[i] = gen
    r.last_tok[i] = last
    if hi > lo:
        m = c.gap_max(lo, hi)
        if m > r.itl_max_c[i]:
            r.itl_max_c[i] = m
        tiered = rep.tier_itl is not None and r.tier[i] >= 0
        if m > r.tbt[i] or tiered:              # the rare cases that read the gaps themselves
            window = c._gaps[lo:hi]
            if m > r.tbt[i]:
                r.viol[i] += int(np.count_nonzero(window > r.tbt[i]))
            if tiered:
                rep.tier_itl[r.tier[i]].add_many(window)


@cython.locals(itl="GapHistogram", r="RequestTable", itl_max=cython.double[:])
def first_gaps(rep: Replica, ch: Cohort, end: float) -> None:
    """The first decode step of the cohort's fresh members: each gap is from its own last
    token (its first token, or one before it moved cohorts)."""
    itl, r = rep.itl, rep.reqs
    itl_max, viol, tbt, last = r.itl_max_c, r.viol, r.tbt, r.last_tok
    for i in ch.fresh:
        g = end - last[i]
        itl.add(g)
        if g > itl_max[i]:
            itl_max[i] = g
        if g > tbt[i]:
            viol[i] += 1
    ch.fresh.clear()


def tier_first_gaps(rep: Replica, end: float, cohorts) -> None:
    """Each fresh decoder's first gap (end - its last token, the gap `batch.decode_step` records
    for it) into its tier's histogram; the other gaps reach the tier histograms through
    `fold`."""
    hists, tier, last = rep.tier_itl, rep.reqs.tier, rep.reqs.last_tok
    for ch in cohorts:
        for i in ch.fresh:
            t = tier[i]
            if t >= 0:
                hists[t].add(end - last[i])


def spill_logs(rep: Replica) -> None:
    """Every CHUNK batches the row logs spill their full chunks to disk (memory stays flat)."""
    for log in (rep.timeline, rep.batches):
        if log is not None:
            log.check()


def merged_tiers(replicas: list[Replica]) -> list[GapHistogram]:
    """The per-tier gap histograms of `replicas` merged, with the gaps of requests still
    decoding on them added (`pending_tier_gaps`; none once a run ends)."""
    out = [GapHistogram.merged([r.tier_itl[t] for r in replicas]) for t in range(len(replicas[0].tier_itl))]
    for r in replicas:
        for t, window in pending_tier_gaps(r):
            out[t].add_many(window)
    return out


def pending_tier_gaps(rep: Replica) -> Iterator[tuple[int, np.ndarray]]:
    """(tier, gaps) of each request still decoding here, not yet folded into `tier_itl`."""
    tier = rep.reqs.tier
    for i, c in rep._decoders.where.items():
        t = tier[i]
        window = c.window(i)
        if t >= 0 and len(window):
            yield t, window


def run_records(cluster: Cluster, wall: float) -> RunRecords:
    """The run's records over a cluster's replicas (one replica's figures are its own; KV
    capacity is the smallest replica's, each replica's in `replica_stats`)."""
    reqs, reps = cluster.reqs, cluster.replicas
    w = reqs.workload
    bs = reps[0].block_size
    itl = reps[0].itl if len(reps) == 1 else GapHistogram.merged([r.itl for r in reps])
    rec = RunRecords(
        ids=w.ids, arrival=np.array(reqs.arrival, np.float64), prompt=w.prompt, output=w.output,
        admitted=reqs.admitted, first_token=reqs.first, finished=reqs.finished,
        preemptions=reqs.preempts, recomputed=reqs.recomputed, itl_max=reqs.itl_max,
        tbt_violations=reqs.viol, rejected=reqs.rejected, itl=itl,
        iterations=sum(r.iterations for r in reps), kv_capacity_tokens=min(r.kv.capacity_tokens for r in reps),
        kv_time_integral=sum(r.kv_integral for r in reps) * bs,
        kv_peak_tokens=max(r.peak_kv for r in reps) * bs, peak_queue=max(r.peak_queue for r in reps),
        busy_time=sum(r.busy for r in reps), wall_seconds=wall)
    if w.tiers:
        rec.tier_index, rec.tiers, rec.tier_itl = w.tier_index, tuple(w.tiers), merged_tiers(reps)
    if len(reps) > 1:
        rec.replica, rec.decode_replica, rec.transfer = reqs.replica, cluster.decode_replica, cluster.transfer
        rec.replica_stats = [{"replica": r.index, "role": r.role, "iterations": r.iterations,
                              "busy_time": r.busy, "preemptions": r.preemptions,
                              "kv_time_integral": r.kv_integral * bs, "kv_peak_tokens": r.peak_kv * bs,
                              "peak_queue": r.peak_queue, "kv_capacity_tokens": r.kv.capacity_tokens}
                             for r in reps]
    return rec
