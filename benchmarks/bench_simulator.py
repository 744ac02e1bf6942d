"""Simulator speed on the workload Vidur was timed on: Vidur's ShareGPT sample
(../shared/traces/sharegpt-vidur-10k-lengths.csv, resampled), Qwen2-7B on A30 with the
roofline model, Poisson arrivals at 7 req/s per replica.

Prints, for every policy at 50,000 requests, simulated requests per wall second, iterations
per request (relative to vllm-v1) and iterations per second; the same for a policy that
pauses half of the decoders (the odd ids) every other batch; and for 8 replicas behind
`round-robin` with 400,000 requests (56 req/s). Then memory (traced Python + numpy
allocations after the workload is loaded) sampled as requests finish.

Targets (issue "Engine v2"): every single-replica policy and the 8-replica cluster at
>= 13,000 simulated requests per wall second, memory flat as requests finish; a policy
running over 5x the iterations per request of vllm-v1 must instead keep its iterations per
second at or above the figure measured before the change (pass it with --before-iter-s).

    python benchmarks/bench_simulator.py [--requests 50000] [--cluster-requests 400000]
        [--policies vllm-v1,sarathi,...] [--no-memory] [--before-iter-s orca=140000,...]

It runs on engines without decode selection or clusters too (those rows print n/a), so the
same script gives the "before" figures on an older checkout (PYTHONPATH=old/src).
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

from kvsched.policies import POLICIES, Plan, make_policy
from kvsched.hardware import get_gpu
from kvsched.run import Scenario, simulate
from kvsched.workload import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "sharegpt-vidur-10k-lengths.csv"
RATE = 7.0
TARGET = 13_000


class PauseOddEveryOther:
    """vllm-v1, except that every other batch the odd-id decoders sit out (KV held)."""
    name = "pause-half"

    def __init__(self) -> None:
        self.inner = make_policy("vllm-v1", {}, get_gpu("a30"))
        self.k = 0

    def schedule(self, v) -> Plan:
        plan = self.inner.schedule(v)
        self.k += 1
        if self.k % 2 and plan.decode is True and v.num_decoding:
            gone = set(plan.preempt)
            even = {i for i in v.decoding if not i & 1 and i not in gone}
            if even or plan.chunks:             # an empty batch would wait for an arrival
                plan.decode = even
        return plan

    def on_finish(self, i: int, v) -> None:
        self.inner.on_finish(i, v)


def scenario(n: int, rate: float, **kw) -> Scenario:
    """Prefix caching off unless asked (the engine's speed targets are for the plain path;
    benchmarks/bench_prefix.py times it on)."""
    if supports("prefix_caching"):
        kw.setdefault("prefix_caching", False)
    return Scenario(load_trace(TRACE, rate=rate, num_requests=n, seed=0), model="qwen2-7b", gpu="a30", **kw)


def supports(field: str) -> bool:
    return field in Scenario.__dataclass_fields__


def timed(sc: Scenario, policy, progress=None) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = simulate(sc, policy, progress=progress)
    return time.perf_counter() - t0, r.summary


def memory(sc: Scenario, policy, n: int) -> str:
    """Traced MiB at five points as requests finish, and the peak."""
    samples: list[tuple[int, float]] = []
    step = max(1, n // 5)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]

    def probe(done: int, total: int) -> None:
        if not samples or done - samples[-1][0] >= step:
            samples.append((done, (tracemalloc.get_traced_memory()[0] - base) / 2**20))

    simulate(sc, policy, progress=probe)
    peak = (tracemalloc.get_traced_memory()[1] - base) / 2**20
    tracemalloc.stop()
    return "  ".join(f"{d:,}:{m:.1f}" for d, m in samples) + f"  peak {peak:.1f} MiB ({peak * 2**20 / n:.0f} B/request)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--cluster-requests", type=int, default=400_000)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--before-iter-s", default="", help="policy=iter/s measured before, for the 5x rule")
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"trace not found: {TRACE}", file=sys.stderr)
        return 2
    before = {k: float(v) for k, v in (x.split("=") for x in args.before_iter_s.split(",") if x)}
    n = args.requests
    sc = scenario(n, RATE)
    print(f"workload: {TRACE.name} resampled to {n:,}; qwen2-7b on a30, roofline; Poisson {RATE:g} req/s per replica")
    print(f"{'run':24} {'wall s':>7} {'sim req/s':>10} {'iterations':>11} {'iter/req':>9} {'x v1':>5} "
          f"{'iter/s':>9} {'thr/s':>6} {'preempt':>8}  target")
    base_ipr = None
    rows = [(p, p) for p in args.policies.split(",")]
    rows.append(("pause-half (vllm-v1)", None))
    for label, policy in rows:
        if label.startswith("pause") and not supports("replicas"):
            print(f"{label:24} n/a (this engine has no decode selection)")
            continue
        if label.startswith("pause"):
            policy = PauseOddEveryOther()
        wall, s = timed(sc, policy)
        it = s["iterations"]
        ipr = it / n
        base_ipr = ipr if label == "vllm-v1" else base_ipr
        ratio = ipr / base_ipr if base_ipr else float("nan")
        rps, ips = n / wall, it / wall
        if ratio > 5:
            ref = before.get(label)
            verdict = (f"iter/s >= {ref:,.0f} before: {'ok' if ips >= ref else 'MISSED'}" if ref
                       else "over 5x vllm-v1's iterations: compare iter/s with before")
        else:
            verdict = f">= {TARGET:,} req/s: {'ok' if rps >= TARGET else 'MISSED'}"
        print(f"{label:24} {wall:>7.2f} {rps:>10,.0f} {it:>11,} {ipr:>9.2f} {ratio:>5.2f} {ips:>9,.0f} "
              f"{s['request_throughput']:>6.2f} {s['preemptions']:>8,}  {verdict}")
    m = args.cluster_requests
    if supports("replicas"):
        csc = scenario(m, 8 * RATE, replicas=8, router="round-robin")
        wall, s = timed(csc, "vllm-v1")
        print(f"{'8 replicas round-robin':24} {wall:>7.2f} {m / wall:>10,.0f} {s['iterations']:>11,} "
              f"{s['iterations'] / m:>9.2f} {'':>5} {s['iterations'] / wall:>9,.0f} {s['request_throughput']:>6.2f} "
              f"{s['preemptions']:>8,}  >= {TARGET:,} req/s: {'ok' if m / wall >= TARGET else 'MISSED'}")
    else:
        print(f"{'8 replicas round-robin':24} n/a (this engine has no clusters)")
    if not args.no_memory:
        print("\nmemory during the run (traced allocations after the workload is loaded; finished:MiB):")
        print(f"  vllm-v1, {n:,} requests:   {memory(sc, 'vllm-v1', n)}")
        if supports("replicas"):
            print(f"  pause-half, {n:,}:          {memory(sc, PauseOddEveryOther(), n)}")
            print(f"  8 replicas, {m:,}: {memory(scenario(m, 8 * RATE, replicas=8), 'vllm-v1', m)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
