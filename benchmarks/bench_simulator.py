"""Simulator speed on the workload Vidur was timed on (issue 2's target: >= 13,000 simulated
requests per wall second, 50x Vidur's ~260/s on this machine kind).

ShareGPT (Vidur's 10k sample, ../shared/traces/sharegpt-vidur-10k-lengths.csv) resampled to
10k, 50k and 100k requests, Qwen2-7B on A30 with the roofline model, Poisson arrivals at 90%
of the policy's simulated capacity (measured first with every request arriving at once).
Prints: requests per wall second; where the time goes (cProfile, top entries); memory
(traced Python + numpy allocations) sampled as requests finish.

    python benchmarks/bench_simulator.py [--sizes 10000,50000,100000] [--policies sarathi,vllm-v1]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import tracemalloc
from pathlib import Path

from kvsched.run import Scenario, simulate
from kvsched.workload import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "sharegpt-vidur-10k-lengths.csv"
PARAMS = {"sarathi": {"chunk_size": "512"}, "vllm-v1": {}}


def scenario(n: int, rate: float, seed: int = 0) -> Scenario:
    return Scenario(load_trace(TRACE, rate=rate, num_requests=n, seed=seed), model="qwen2-7b", gpu="a30")


def capacity(policy: str) -> float:
    """Throughput with 5,000 requests all queued at the start (saturated server)."""
    r = simulate(scenario(5000, 1e6), policy, PARAMS[policy])
    return r.summary["request_throughput"]


def timed(policy: str, n: int, rate: float) -> tuple[float, dict]:
    sc = scenario(n, rate)
    t0 = time.perf_counter()
    r = simulate(sc, policy, PARAMS[policy])
    return time.perf_counter() - t0, r.summary


def memory_profile(policy: str, n: int, rate: float) -> list[tuple[int, float]]:
    """(finished requests, traced MiB) at checkpoints during the run."""
    sc = scenario(n, rate)
    samples: list[tuple[int, float]] = []
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    step = max(1, n // 5)

    def probe(done: int, total: int) -> None:
        if not samples or done - samples[-1][0] >= step:
            samples.append((done, (tracemalloc.get_traced_memory()[0] - base) / 2**20))

    r = simulate(sc, policy, PARAMS[policy], progress=probe)
    peak = (tracemalloc.get_traced_memory()[1] - base) / 2**20
    tracemalloc.stop()
    samples.append((r.summary["completed"], peak))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,50000,100000")
    ap.add_argument("--policies", default="sarathi,vllm-v1")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"trace not found: {TRACE}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    print(f"workload: {TRACE.name} resampled; qwen2-7b on a30, roofline cost; rate = 0.9 x capacity")
    print(f"{'policy':10} {'requests':>9} {'rate/s':>8} {'wall s':>8} {'sim req/s':>10} {'iterations':>11} "
          f"{'iter/s':>9} {'thr/s':>7} {'preempt':>8}")
    for policy in policies:
        rate = 0.9 * capacity(policy)
        for n in sizes:
            wall, s = timed(policy, n, rate)
            print(f"{policy:10} {n:>9,} {rate:>8.2f} {wall:>8.2f} {n / wall:>10,.0f} {s['iterations']:>11,} "
                  f"{s['iterations'] / wall:>9,.0f} {s['request_throughput']:>7.2f} {s['preemptions']:>8,}")
    if not args.no_profile:
        policy, n = policies[-1], sizes[min(1, len(sizes) - 1)]
        rate = 0.9 * capacity(policy)
        sc = scenario(n, rate)
        prof = cProfile.Profile()
        prof.enable()
        simulate(sc, policy, PARAMS[policy])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        print(f"\nwhere the time goes ({policy}, {n:,} requests, cProfile, by own time):")
        print("\n".join(line for line in buf.getvalue().splitlines()[4:] if line.strip()))
    print("\nmemory during the run (traced allocations, MiB, after the workload is loaded):")
    for policy in policies:
        rate = 0.9 * capacity(policy)
        for n in sizes:
            samples = memory_profile(policy, n, rate)
            line = "  ".join(f"{done:,}:{mib:.1f}" for done, mib in samples[:-1])
            print(f"  {policy:10} {n:>9,}  finished:MiB {line}  peak {samples[-1][1]:.1f} "
                  f"({samples[-1][1] * 2**20 / n:.0f} B/request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
