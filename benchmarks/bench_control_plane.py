"""The control plane's experiments (docs/control-plane.md): prints their tables.

    python benchmarks/bench_control_plane.py day      # 24 h diurnal day, 1,000,000 requests:
                                                      # a fixed fleet sized for the peak vs hpa vs slo
    python benchmarks/bench_control_plane.py spike    # a 3x spike, two tiers, shedding the free one
    python benchmarks/bench_control_plane.py lora     # 50 adapters (Zipf), 8 slots: routing with and
                                                      # without adapter residency
    python benchmarks/bench_control_plane.py all

Everything is simulated (the roofline batch-time model of llama-3-8b on L40S or L4, bf16),
nothing measured on a GPU. `--requests N` shrinks the day (its rate scales so the day stays
24 h long).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings

import numpy as np

from kvsched.capacity import rate_at_ttft_slo
from kvsched.metrics import Goodput
from kvsched.run import Scenario, simulate
from kvsched.workload.source import WorkloadOptions, load

SLO_S = 2.0                 # p99 TTFT bound of the day (seconds)
MODEL, GPU = "llama-3-8b", "l40s"


def run(sc: Scenario, policy: str = "vllm-v1"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate(sc, policy)


def day(requests: int) -> None:
    rate = requests / 86400
    w = load(WorkloadOptions(trace="sharegpt-lengths", arrivals=f"diurnal:{rate:.6g}:0.6:0.1", num_requests=requests))
    base = Scenario(w, model=MODEL, gpu=GPU, router="least-outstanding", report_bucket_s=3600.0,
                    goodput=Goodput(ttft=SLO_S * 1000))
    t0 = time.perf_counter()
    per = rate_at_ttft_slo(base, "vllm-v1", None, SLO_S)
    peak = max(np.histogram(w.arrival, bins=np.arange(0, 86400 + 300, 300))[0]) / 300     # busiest 5 minutes
    fixed = math.ceil(peak / per)
    print(f"day: {requests:,} requests, mean {rate:.3g} req/s, busiest 5 min {peak:.3g} req/s; one replica meets "
          f"p99 TTFT <= {SLO_S:g} s up to {per:.3g} req/s -> fixed fleet of {fixed} ({time.perf_counter() - t0:.1f} s)")
    cap = fixed + 4
    runs = {
        f"fixed x{fixed}": dataclasses.replace(base, replicas=fixed),
        "hpa (kv 0.5)": dataclasses.replace(base, replicas=cap, autoscale="hpa", autoscale_params={
            "metric": "kv", "target": "0.5", "initial": str(fixed // 2)}),
        "slo": dataclasses.replace(base, replicas=cap, autoscale="slo", autoscale_params={
            "ttft_slo_s": str(SLO_S), "rate_per_replica": str(per), "initial": str(fixed // 2)}),
    }
    results = {}
    for name, sc in runs.items():
        t = time.perf_counter()
        results[name] = r = run(sc).summary
        print(f"  ran {name} in {time.perf_counter() - t:.0f} s")
    print(f"\n{'fleet':<14}{'GPU-h':>8}{'USD':>9}{'USD/Mtok':>10}{'kJ/Mtok':>9}{'p99 TTFT ms':>13}{'hours < 99% in SLO':>20}")
    for name, s in results.items():
        att = [row["slo_attainment"] for row in s["over_time"] if row["requests"]]
        att = [a for a in att if a is not None]
        print(f"{name:<14}{s['gpu_hours']:>8.1f}{s['usd']:>9.2f}{s['usd_per_mtok']:>10.3f}{s['joules_per_mtok'] / 1e3:>9.0f}"
              f"{s['p99_ttft_ms']:>13.0f}{sum(a < 0.99 for a in att):>20}")
    print("\nper hour: mean replicas up / p99 TTFT (ms) / share of requests with TTFT <= 2 s")
    print(f"{'hour':>4}  " + "  ".join(f"{n:>24}" for n in results))
    for h in range(24):
        cells = []
        for s in results.values():
            row = s["over_time"][h]
            cells.append(f"{row['mean_replicas']:>5.1f} / {row['p99_ttft_ms'] or 0:>6.0f} / {row['slo_attainment'] or 0:>6.3f}")
        print(f"{h:>4}  " + "  ".join(f"{c:>24}" for c in cells))


def spike() -> None:
    opts = WorkloadOptions(trace="sharegpt-lengths", arrivals="piecewise:2.7:600,8.1:180,2.7:600", num_requests=5000,
                           tiers=["paid:0.3:ttft=2", "free:0.7:ttft=10"])
    base = Scenario(load(opts), model=MODEL, gpu=GPU, replicas=4, router="least-outstanding")
    print("spike: 4 replicas, 2.7 req/s for 600 s, 8.1 req/s (3x) for 180 s, 2.7 req/s; paid 30% (TTFT SLO 2 s), "
          "free 70% (10 s)")
    print(f"{'admission':<22}{'tier':<6}{'requests':>9}{'completed':>10}{'shed':>6}{'p99 TTFT ms':>13}{'in SLO':>8}")
    for name, shed in (("none", ()), ("--shed free:ttft=0.5", ("free:ttft=0.5",)),
                       ("--shed free:kv=0.8", ("free:kv=0.8",))):
        s = run(dataclasses.replace(base, shed=shed)).summary
        dropped = {r["tier"]: r["shed"] for r in s.get("admission", [])}
        for t in s["tiers"]:
            print(f"{name:<22}{t['name']:<6}{t['requests']:>9}{t['completed']:>10}{dropped.get(t['name'], 0):>6}"
                  f"{t['p99_ttft_ms']:>13.0f}{t['ttft_slo_attainment']:>8.3f}")


def lora() -> None:
    opts = WorkloadOptions(trace="sharegpt-lengths", rate=7.0, num_requests=20000, adapters="50")
    w = load(opts)
    print("lora: 8 replicas, 7 req/s, 50 adapters (Zipf s = 1), max_loras 8, rank 16")
    print(f"{'router':<20}{'mean TTFT ms':>13}{'p50':>8}{'p99':>9}{'adapter loads':>15}{'waited for a slot':>19}")
    base = Scenario(w, model=MODEL, gpu=GPU, replicas=8, lora_params={"max_loras": "8"})
    plain = run(dataclasses.replace(base, workload=dataclasses.replace(w, adapter=np.full(len(w), -1, np.int32)),
                                    router="least-outstanding", lora_params={})).summary
    print(f"{'(no adapters)':<20}{plain['mean_ttft_ms']:>13.0f}{plain['median_ttft_ms']:>8.0f}{plain['p99_ttft_ms']:>9.0f}")
    for router in ("round-robin", "least-outstanding", "lora-affinity"):
        s = run(dataclasses.replace(base, router=router)).summary
        print(f"{router:<20}{s['mean_ttft_ms']:>13.0f}{s['median_ttft_ms']:>8.0f}{s['p99_ttft_ms']:>9.0f}"
              f"{s['lora']['adapter_loads']:>15}{s['lora']['adapters_waited']:>19}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=("day", "spike", "lora", "all"))
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests of the day (default 1,000,000)")
    a = ap.parse_args()
    t = time.perf_counter()
    if a.which in ("day", "all"):
        day(a.requests)
    if a.which in ("spike", "all"):
        spike()
    if a.which in ("lora", "all"):
        lora()
    print(f"\n{time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
