"""Start-up time of the `kvsched` command (issue "Hardening", E: under 0.4 s; issue "Speed": 0.3 s or less, for
`kvsched --help`): the median wall time of N runs of `kvsched --help`, of `kvsched policies`
and of importing the package, each in a fresh interpreter; then the slowest imports.

    python benchmarks/bench_startup.py [--runs 10]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

TARGET = 0.3


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    py = sys.executable
    rows = [("python -c pass (interpreter alone)", [py, "-c", "pass"]),
            ("import kvsched.cli", [py, "-c", "import kvsched.cli"]),
            ("kvsched --help", [py, "-m", "kvsched", "--help"]),
            ("kvsched policies", [py, "-m", "kvsched", "policies"])]
    print(f"median of {args.runs} runs, wall seconds")
    for label, cmd in rows:
        t = wall(cmd, args.runs)
        mark = f"  (target <= {TARGET} s: {'ok' if t <= TARGET else 'MISSED'})" if label == "kvsched --help" else ""
        print(f"  {label:38} {t:6.3f}{mark}")
    out = subprocess.run([py, "-X", "importtime", "-c", "import kvsched.cli"], capture_output=True, text=True).stderr
    rows = [line.split("|") for line in out.splitlines() if line.startswith("import time:") and "cumulative" not in line]
    top = sorted(((int(r[1]), r[2].rstrip()) for r in rows), reverse=True)[:8]
    print("slowest imports (cumulative microseconds):")
    for us, name in top:
        print(f"  {us:>8,}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
