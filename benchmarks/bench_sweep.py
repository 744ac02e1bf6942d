"""`kvsched sweep` speed (issue "kvsched sweep", Speed): a 1,000-point sweep, 4 policies x 25
rates x 10 seeds of 5,000 requests each, with 1 and then 2 worker processes.

Workload and hardware: the built-in workload (prompt and output `jitter:512`, Poisson
arrivals) on llama-3-8b, a100-80gb, roofline; that serves about 8 req/s, so rates 0.5 to
12.5 req/s span light load (short queues, many small decode batches: the slowest points to
simulate) to overload (a growing queue).

Each run is the whole command (`kvsched sweep ... --json`) in a fresh process, into a new
temporary folder, timed from start to exit. Printed per --jobs: points, wall seconds,
points/s, the CPU seconds of the whole process tree, and the load average before and after
(other work on the machine slows a run: CPU seconds show the cost regardless); then the
speed-up of each over the first, and whether the tables are equal bar the `seconds` column
(the figures must not depend on --jobs).

    python benchmarks/bench_sweep.py [--policies vllm-v1,sarathi,vllm-v0,orca] [--rates 25]
        [--seeds 10] [--requests 5000] [--jobs 1,2]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVSCHED = [sys.executable, "-m", "kvsched"]
HARDWARE = ["--model", "llama-3-8b", "--gpu", "a100-80gb", "--cost", "roofline"]


def sweep(args: argparse.Namespace, jobs: int, out: Path) -> tuple[float, float, dict]:
    rates = ",".join(f"{0.5 * (k + 1):g}" for k in range(args.rates))       # 0.5, 1, ..., 12.5
    cmd = [*KVSCHED, "sweep", "--policies", args.policies, "--rates", rates, "--seeds", f"0-{args.seeds - 1}",
           "--num-requests", str(args.requests), *HARDWARE, "--jobs", str(jobs), "--out", str(out), "--json"]
    cpu = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    if done.returncode != 0:
        sys.exit(f"kvsched sweep failed ({done.returncode}): {done.stderr.strip()}")
    return seconds, cpu, json.loads(done.stdout)


def _children_cpu() -> float:
    """User + system seconds of finished child processes (the sweep and its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def figures(out: Path) -> list[list[str]]:
    """sweep.csv without its `seconds` column (wall time, not a figure)."""
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.reader(f))
    k = rows[0].index("seconds")
    return [r[:k] + r[k + 1:] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="vllm-v1,sarathi,vllm-v0,orca")
    ap.add_argument("--rates", type=int, default=25, help="rates 0.5, 1, ... (this many)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--jobs", default="1,2", help="worker process counts to time, in order")
    args = ap.parse_args()
    timings, tables = [], []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for jobs in (int(j) for j in args.jobs.split(",")):
            out = Path(tmp) / f"jobs{jobs}"
            load = os.getloadavg()[0]
            seconds, cpu, summary = sweep(args, jobs, out)
            timings.append((jobs, seconds))
            tables.append(figures(out))
            print(f"--jobs {jobs}: {summary['points']} points ({summary['failed']} failed) in {seconds:.1f} s "
                  f"whole process, {summary['points'] / seconds:.2f} points/s, {cpu:.1f} CPU s; "
                  f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)
    base_jobs, base = timings[0]
    for jobs, seconds in timings[1:]:
        print(f"speed-up --jobs {base_jobs} -> {jobs}: {base / seconds:.2f}x")
    print("tables equal across --jobs (bar seconds):", all(t == tables[0] for t in tables))


if __name__ == "__main__":
    main()
