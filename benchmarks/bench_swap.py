"""Swap against recompute preemption on a KV-tight workload (issue "The KV memory hierarchy":
where each wins, the crossover in prompt length and link bandwidth; docs/kv-tiers.md).

Llama-3-8B on one H100 SXM (roofline, vllm-v1, prefix caching off so a recompute is a real
prefill), the KV cache cut to --kv-capacity tokens so that decoders are preempted: a closed loop whose
concurrency asks for --pressure x the KV capacity (requests of a prompt of each length in
PROMPTS and --output tokens), so every run is KV-tight and none queues without bound. Each prompt
length is run with recompute and with swap to a host tier over links of each bandwidth in
LINKS (GB/s each way, 10 us latency). Prints, per run: throughput (output tokens/s), mean and
p99 TTFT, mean E2E, recomputed tokens, swap-outs, bytes moved to host, and the simulator's
own wall time (the cost of tiers on).

    python benchmarks/bench_swap.py [--pressure 1.5] [--output 512] [--kv-capacity 60000] [--requests 2000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvsched.run import Scenario, simulate  # noqa: E402
from kvsched.workload.request import Workload  # noqa: E402

PROMPTS = (256, 1024, 4096, 16384)
LINKS = (0.1, 0.25, 1.0, 4.0, 25.0)   # GB/s each way: slow remote paths, then PCIe-class host links


def concurrency(prompt: int, args) -> int:
    """Requests in flight: their full KV is --pressure x the capacity."""
    return max(1, round(args.pressure * args.kv_capacity / (prompt + args.output)))


def run(prompt: int, args, preemption: str, gbps: float | None) -> dict:
    n = args.requests
    w = Workload.build(np.zeros(n), np.full(n, prompt), np.full(n, args.output), concurrency=concurrency(prompt, args))
    tiers = (f"host:512:{gbps:g}:0.00001",) if preemption == "swap" else ()
    sc = Scenario(w, model="llama-3-8b", gpu="h100-sxm", kv_capacity=args.kv_capacity, prefix_caching=False,
                  max_model_len=prompt + args.output + 16, client=None, preemption=preemption, kv_tiers=tiers)
    t0 = time.perf_counter()
    r = simulate(sc, "vllm-v1")
    wall = time.perf_counter() - t0
    s = r.summary
    return {"tok/s": s["output_throughput"], "ttft": s["mean_ttft_ms"], "p99 ttft": s["p99_ttft_ms"],
            "e2e": s["mean_e2el_ms"], "recomputed": int(r.records.recomputed.sum()), "swaps": s.get("swap_outs", 0),
            "GB to host": s["tier_breakdown"][0]["bytes_in"] / 1e9 if "tier_breakdown" in s else 0.0, "wall s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pressure", type=float, default=1.5, help="KV the requests in flight ask for / capacity")
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--kv-capacity", type=int, default=60_000)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    if args.pressure <= 0 or args.output < 1 or args.kv_capacity < 1 or args.requests < 1:
        sys.exit("--pressure, --output, --kv-capacity and --requests must be positive")
    cols = ("tok/s", "ttft", "p99 ttft", "e2e", "recomputed", "swaps", "GB to host", "wall s")
    print(f"llama-3-8b on h100-sxm, vllm-v1, {args.requests} requests in a closed loop asking for {args.pressure:g} x "
          f"the KV ({args.kv_capacity:,} tokens), {args.output} output tokens; ms for TTFT and E2E")
    print(f"{'prompt':>7s} {'preemption':>18s} " + " ".join(f"{c:>11s}" for c in cols))
    for prompt in PROMPTS:
        if prompt + args.output + 16 > args.kv_capacity:
            print(f"{prompt:7d} skipped: a request does not fit in --kv-capacity")
            continue
        for pre, gbps in [("recompute", None)] + [("swap", g) for g in LINKS]:
            f = run(prompt, args, pre, gbps)
            label = pre if gbps is None else f"swap {gbps:g} GB/s"
            label = f"{label} (c {concurrency(prompt, args)})" if gbps is None else label
            print(f"{prompt:7d} {label:>18s} " + " ".join(
                f"{f[c]:11.1f}" if isinstance(f[c], float) else f"{f[c]:11d}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
