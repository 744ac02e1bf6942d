"""Workload speed: reading large traces (rows per second, peak memory against file size) and
simulating closed-loop workloads (requests per wall second).

Writes synthetic traces in the formats of the bundled traces (kvsched/data/traces) (Azure 2023 CSV, Mooncake JSONL
with hash_ids) to a temporary folder, reads them with kvsched's streaming readers, and runs
the EB balanced preset at c = 2048 scaled up. Peak memory is traced Python + numpy
allocations during the read.

    python benchmarks/bench_workloads.py [--rows 1000000] [--requests 50000]
"""
from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from kvsched.run import Scenario, simulate
from kvsched.workload.readers import read_trace
from kvsched.workload.source import WorkloadOptions, load


def write_azure(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    ticks = np.cumsum(rng.integers(0, 4_000_000, size=rows))          # 100 ns ticks
    prompt, output = rng.integers(1, 8000, size=rows), rng.integers(1, 1000, size=rows)
    with open(path, "w", newline="") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\r\n")
        for k in range(rows):
            t = t0 + timedelta(microseconds=int(ticks[k]) // 10)
            f.write(f"{t:%Y-%m-%d %H:%M:%S}.{int(ticks[k]) % 10_000_000:07d},{prompt[k]},{output[k]}\r\n")


def write_mooncake(path: Path, rows: int) -> None:
    rng = np.random.default_rng(1)
    stamps = np.cumsum(rng.integers(0, 600, size=rows))
    next_id = 0
    with open(path, "w") as f:
        for k in range(rows):
            blocks = int(rng.integers(1, 50))
            ids = list(range(next_id, next_id + blocks))
            next_id += blocks
            f.write(f'{{"timestamp": {int(stamps[k])}, "input_length": {blocks * 512}, '
                    f'"output_length": {int(rng.integers(1, 1000))}, "hash_ids": {ids}}}\n')


def read_figures(path: Path, keep_hashes: bool) -> tuple[float, float, int]:
    """Wall time of a plain read, then peak memory in a second, traced read (tracing slows
    Python allocations several times over, so it is kept out of the timing)."""
    t = time.perf_counter()
    n = len(read_trace(path, keep_hashes=keep_hashes).prompt)
    wall = time.perf_counter() - t
    tracemalloc.start()
    read_trace(path, keep_hashes=keep_hashes)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return wall, peak, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=50_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print(f"{'trace':28} {'rows':>10} {'file MiB':>9} {'read s':>7} {'rows/s':>10} {'peak MiB':>9}")
        for name, writer, hashes in (("azure 2023 CSV", write_azure, False),
                                     ("mooncake JSONL + hash_ids", write_mooncake, True)):
            path = Path(d) / name.split()[0]
            writer(path, args.rows)
            wall, peak, n = read_figures(path, hashes)
            print(f"{name:28} {n:>10,} {path.stat().st_size / 2**20:>9.1f} {wall:>7.2f} {n / wall:>10,.0f} {peak:>9.1f}")
    print()
    print(f"{'closed loop (eb-balanced)':28} {'requests':>10} {'c':>6} {'wall s':>7} {'sim req/s':>10}")
    for c in (256, 2048):
        w = load(WorkloadOptions(workload="eb-balanced", num_requests=args.requests, arrivals=f"closed:{c}"))
        t = time.perf_counter()
        r = simulate(Scenario(w, model="qwen3-8b", gpu="h200"), "vllm-v1")
        wall = time.perf_counter() - t
        print(f"{'vllm-v1, qwen3-8b / h200':28} {r.summary['completed']:>10,} {c:>6} {wall:>7.2f} "
              f"{r.summary['completed'] / wall:>10,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
