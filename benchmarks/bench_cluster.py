"""Cluster scale (issue "Hardening, second round"): what idle and busy replicas cost, and
whether a long disaggregated run keeps flat memory.

1. `kvsched simulate --replicas R --num-requests N --json` (the built-in workload, so 1,000
   replicas are mostly idle): whole-process seconds and peak memory. Target: 1,000 replicas
   and 10,000 requests in seconds (10 s or less), not minutes.
2. A disaggregated run (`--prefill-replicas 2 --decode-replicas 2`, vllm-v1 with its default
   prefix caching) of N requests: the child's resident memory sampled every 0.25 s; printed
   at each quarter of the run, and its growth during the loop (from 25% to 90% of the run;
   the end adds the summary's arrays) per 100,000 requests. Target: flat (the per-request
   tables are allocated up front, so nothing should grow while requests are served).

    python benchmarks/bench_cluster.py [--replicas 1000] [--requests 10000] [--pd-requests 1000000]
        [--python PY]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_SECONDS = 10.0


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(cmd: list[str], sample: float | None = None) -> tuple[float, float, list[tuple[float, float]], dict]:
    """(wall seconds, peak RSS MiB, [(seconds, RSS MiB)] samples, the --json summary)."""
    t0 = time.perf_counter()
    out_file = tempfile.TemporaryFile("w+")        # not a pipe: a large summary would fill it
    p = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.DEVNULL, text=True)
    samples = []
    while True:                         # wait4, not poll: this child's own peak memory
        pid, status, usage = os.wait4(p.pid, os.WNOHANG if sample else 0)
        if pid:
            break
        m = rss_mib(p.pid)
        if m is not None:
            samples.append((time.perf_counter() - t0, m))
        time.sleep(sample)
    wall = time.perf_counter() - t0
    out_file.seek(0)
    out = out_file.read()
    out_file.close()
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(cmd[2:])}: exit {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_maxrss / 1024, samples, json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--pd-requests", type=int, default=1_000_000)
    ap.add_argument("--pd-rate", type=float, default=16.0, help="req/s of the disaggregated run")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    k = [args.python, "-m", "kvsched", "simulate", "--json"]
    wall, peak, _, s = run(k + ["--replicas", str(args.replicas), "--num-requests", str(args.requests)])
    print(f"{args.replicas:,} replicas, {args.requests:,} requests: {wall:.2f} s whole process, peak {peak:.0f} MiB, "
          f"{s['completed']:,} completed  (<= {TARGET_SECONDS:g} s: {'ok' if wall <= TARGET_SECONDS else 'MISSED'})",
          flush=True)
    n = args.pd_requests
    wall, peak, samples, s = run(k + ["--prefill-replicas", "2", "--decode-replicas", "2", "--num-requests", str(n),
                                      "--rate", f"{args.pd_rate:g}"], sample=0.25)
    print(f"disaggregated 2+2, {n:,} requests: {wall:.1f} s, peak {peak:.0f} MiB, {s['completed']:,} completed")
    if len(samples) >= 8:
        quarter = [samples[min(len(samples) - 1, q * len(samples) // 4)] for q in (1, 2, 3)] + [samples[-1]]
        print("  resident MiB at each quarter of the run: " + ", ".join(f"{m:.0f} ({t:.0f} s)" for t, m in quarter))
        # the loop: from a quarter of the run to 90% of it (the end adds the summary's arrays)
        (t1, m1), (t9, m9) = samples[len(samples) // 4], samples[9 * len(samples) // 10]
        growth = (m9 - m1) / ((t9 - t1) / wall * n / 100_000)
        print(f"  growth during the loop (25% to 90% of the run): {growth:+.2f} MiB per 100,000 requests "
              f"({growth * 1024 * 1024 / 100_000:+.1f} bytes per request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
