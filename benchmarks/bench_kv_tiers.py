"""How much a host tier, and a remote store shared by the replicas, buy on the Mooncake
conversation trace (issue "The KV memory hierarchy"; docs/kv-tiers.md).

Qwen3-8B on H100 SXM (roofline, vllm-v1 with prefix caching, vLLM's KV capacity at 0.9 memory
utilisation), the bundled `mooncake-conversation` trace's first --requests requests per replica
at --rate requests/s per replica (its times rescaled), round-robin over the replicas. Each
configuration is run:
  - GPU-only (the prefix cache on the GPU alone);
  - + host: each replica's 256 GB of host memory over a 25 GB/s link, 10 us;
  - + host + remote: the same, plus one store of --remote-gb shared by all replicas, over
    each replica's --remote-gbps link with 0.5 ms latency;
on 1 replica and on --replicas replicas; and on --replicas replicas of one node, the same
total host memory as one store the node's replicas share (--gpus-per-node), each over its
own 25 GB/s link; then, on 1 replica, sarathi with new prefills FCFS
or longest GPU-cached prefix first (`order=lpm`, the policy view's `prefix_blocks`). Prints, per run: the prefix hit rate (prompt tokens
not computed), each tier's hit rate, median and p99 TTFT, request and output throughput, the
bytes written down and loaded back, the mean load time, and the simulator's wall time (the
cost of tiers on).

    python benchmarks/bench_kv_tiers.py [--requests 1500] [--rate 1.6] [--replicas 4] [--lpm-rate 2.5]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOST = "host:256:25:0.00001"


def run(replicas: int, tiers: list[str], args, policy: list[str] = ()) -> dict:
    """One configuration's summary; `policy`: more flags (the policy, --gpus-per-node)."""
    cmd = [sys.executable, "-m", "kvsched", "simulate", "-w", "mooncake-conversation", "--model", "qwen3-8b",
           *policy,
           "--gpu", "h100-sxm", "--num-requests", str(args.requests * replicas), "--rate",
           f"{args.rate * replicas:g}", "--replicas", str(replicas), "--router", "round-robin", "--json"]
    for t in tiers:
        cmd += ["--kv-tier", t]
    out = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    if out.returncode:
        sys.exit(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return json.loads(out.stdout.splitlines()[0])


def row(name: str, s: dict) -> str:
    tiers = s.get("tier_breakdown", [])
    hits = " ".join(f"{t['name']} {t['hit_rate']:.3f}" for t in tiers) or "-"
    down = sum(t["bytes_in"] for t in tiers) / 1e12
    up = sum(t["bytes_out"] for t in tiers) / 1e12
    load = s.get("mean_load_wait_ms")
    return (f"{name:<22} {s['prefix_hit_rate']:>6.3f}  {hits:<24} {s['median_ttft_ms'] / 1e3:>8.2f} "
            f"{s['p99_ttft_ms'] / 1e3:>8.2f} {s['request_throughput']:>7.3f} {s['output_throughput']:>8.1f} "
            f"{down:>7.2f} {up:>7.2f} {'-' if load is None else f'{load:.1f}':>7} {s['wall_seconds']:>6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500, help="requests per replica")
    ap.add_argument("--rate", type=float, default=1.6, help="requests/s per replica")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--remote-gb", type=float, default=4000.0)
    ap.add_argument("--remote-gbps", type=float, default=12.5, help="each replica's link to the store, GB/s")
    ap.add_argument("--lpm-rate", type=float, default=2.5, help="requests/s of the sarathi fcfs/lpm runs (1 replica)")
    args = ap.parse_args()
    if args.requests < 1 or args.rate <= 0 or args.replicas < 1 or args.lpm_rate <= 0:
        sys.exit("--requests, --rate and --replicas must be positive")
    remote = f"remote:{args.remote_gb:g}:{args.remote_gbps:g}:0.0005"
    print(f"mooncake-conversation, qwen3-8b on h100-sxm, vllm-v1, {args.requests} requests per replica at "
          f"{args.rate:g}/s per replica, round-robin")
    print(f"{'configuration':<22} {'hit':>6}  {'tier hit rates':<24} {'p50 TTFT':>8} {'p99 TTFT':>8} {'req/s':>7} "
          f"{'tok/s':>8} {'TB down':>7} {'TB up':>7} {'load ms':>7} {'wall s':>6}")
    for replicas, configs in ((1, (("GPU-only", []), ("+host 256 GB", [HOST]))),
                              (args.replicas, (("GPU-only", []), ("+host 256 GB", [HOST]),
                                               ("+host +remote", [HOST, remote])))):
        for name, tiers in configs:
            print(row(f"{replicas}x {name}", run(replicas, tiers, args)), flush=True)
    node = f"host:{256 * args.replicas}:25:0.00001"
    print(row(f"{args.replicas}x +node host {256 * args.replicas} GB",
              run(args.replicas, [node], args, ["--gpus-per-node", str(args.replicas)])), flush=True)
    print(f"the policy view: sarathi (prefix caching on) at {args.lpm_rate:g}/s, admitting new prefills FCFS or the "
          "longest prefix on the GPU first (lpm)")
    lpm = argparse.Namespace(**{**vars(args), "rate": args.lpm_rate})
    for order in ("fcfs", "lpm"):
        for name, tiers in (("GPU-only", []), ("+host 256 GB", [HOST])):
            s = run(1, tiers, lpm, ["--policy", "sarathi", "--set", f"order={order}", "--prefix-caching", "on"])
            print(row(f"1x {name} {order}", s), flush=True)


if __name__ == "__main__":
    main()
