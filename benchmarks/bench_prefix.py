"""Prefix caching (docs/prefix-caching.md): its effect on the Mooncake traces and the
simulator's speed with it on.

1. Mooncake: `mooncake-conversation.jsonl` and `mooncake-synthetic.jsonl` (bundled with kvsched),
   each replayed at its own times (the conversation trace spans an hour), qwen2-7b on 4 x
   H200 (roofline cost, max_model_len 200,000 so that no prompt is rejected), vllm-v1:
   `least-outstanding` with caching off and on, and `prefix-affinity` with caching on.
   Prints hit rates, evictions, throughput, TTFT and TPOT.
2. Speed: simulated requests per wall second for vllm-v1 with caching off and on, on the
   Vidur's ShareGPT sample (50,000 requests, qwen2-7b on A30, 7 req/s; no shared prefixes,
   so only preempted requests hit) and on the Mooncake
   runs above.

    python benchmarks/bench_prefix.py [--traces conversation,synthetic] [--replicas 4]
        [--requests 50000] [--skip-speed]
"""
from __future__ import annotations

import argparse
import sys
import time

from kvsched.run import Scenario, simulate
from kvsched.workload import load_trace

RUNS = [("least-outstanding", False), ("least-outstanding", True), ("prefix-affinity", True)]
COLUMNS = [("prefix_hit_rate", "hit tok", "{:.1%}"), ("prefix_block_hit_rate", "hit blk", "{:.1%}"),
           ("prefix_evictions", "evicted", "{:,}"), ("request_throughput", "req/s", "{:.3f}"),
           ("output_throughput", "out tok/s", "{:,.0f}"), ("mean_ttft_ms", "mean TTFT", "{:,.0f}"),
           ("median_ttft_ms", "p50 TTFT", "{:,.0f}"), ("p99_ttft_ms", "p99 TTFT", "{:,.0f}"),
           ("mean_tpot_ms", "mean TPOT", "{:.1f}")]


def cell(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def mooncake(names: list[str], replicas: int) -> None:
    print(f"1. Mooncake traces replayed, qwen2-7b on {replicas} x h200 (roofline), vllm-v1; times in ms")
    print(f"{'trace':14} {'router':18} {'cache':5} " + " ".join(f"{label:>10}" for _, label, _ in COLUMNS)
          + f" {'wall s':>7} {'sim req/s':>9}")
    for name in names:
        w = load_trace(f"mooncake-{name}")          # bundled
        for router, caching in RUNS:
            sc = Scenario(w, model="qwen2-7b", gpu="h200", max_model_len=200_000, replicas=replicas,
                          router=router, prefix_caching=caching)
            t0 = time.perf_counter()
            s = simulate(sc, "vllm-v1").summary
            wall = time.perf_counter() - t0
            print(f"{name:14} {router:18} {'on' if caching else 'off':5} "
                  + " ".join(f"{cell(fmt, s.get(k)):>10}" for k, _, fmt in COLUMNS)
                  + f" {wall:>7.1f} {len(w) / wall:>9,.0f}", flush=True)


def speed(n: int) -> None:
    w = load_trace("sharegpt-vidur-10k-lengths", rate=7.0, num_requests=n, seed=0)
    print(f"\n2. speed: vllm-v1 on sharegpt-vidur-10k-lengths resampled to {n:,}, "
          "qwen2-7b on a30, Poisson 7 req/s")
    for caching in (False, True):
        sc = Scenario(w, model="qwen2-7b", gpu="a30", prefix_caching=caching)
        t0 = time.perf_counter()
        s = simulate(sc, "vllm-v1").summary
        wall = time.perf_counter() - t0
        print(f"  caching {'on ' if caching else 'off'}: {wall:6.2f} s  {n / wall:>9,.0f} simulated req/s  "
              f"preemptions {s['preemptions']:,}  prefill tokens saved {s.get('prefill_tokens_saved', 0):,}",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    mooncake(args.traces.split(","), args.replicas)
    if not args.skip_speed:
        speed(args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
