"""Where speculative decoding stops paying (issue "Speculative decoding"; docs/speculative-decoding.md).

Llama-3.1-8B on one H100 SXM (roofline, vllm-v1 with its defaults: 8192 tokens and 1024 seats a
step, prefix caching on, vLLM's KV capacity at 0.9 memory utilisation, less the EAGLE head's
weights and KV), --requests requests at each rate (Poisson), prompts of --prompt-len and outputs
of --output-len tokens (default: uniform 32-256 and 32-512: short contexts, so that the batch
grows large before the KV fills). Three
configurations per rate:
  - no speculation;
  - `--spec eagle:3 --spec-acceptance 0.7` (an EAGLE head proposing 3 tokens, each accepted with
    probability 0.7 given the ones before: 2.53 tokens per verify step);
  - the same with `--spec-adaptive auto` (the cost model's best k for each batch size: k drops
    as the batch grows, to 0 where verifying costs more than it yields).
Prints, per rate and configuration: output throughput (tokens/s), median TPOT and ITL (ms; ITL
per streamed chunk, as vLLM's benchmark records it), the mean number of running decoders and
the mean tokens per verify step; then the adaptive schedule.

    python benchmarks/bench_spec_decode.py [--requests 2000] [--rates 1,2,4,8,16,32,64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CONFIGS = (("none", {}),
           ("eagle:3", {"spec": "eagle:3", "spec_acceptance": "0.7"}),
           ("eagle:3 adaptive", {"spec": "eagle:3", "spec_acceptance": "0.7", "spec_adaptive": "auto"}))


def main() -> None:
    from kvsched.run import Scenario, simulate
    from kvsched.workload.source import WorkloadOptions, load
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rates", default="1,2,4,8,16,32,64")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--prompt-len", default="uniform:32:256")
    ap.add_argument("--output-len", default="uniform:32:512")
    args = ap.parse_args()
    print(f"{args.model} on one {args.gpu}, vllm-v1, prompts {args.prompt_len}, outputs {args.output_len}, "
          f"{args.requests} requests per rate")
    print(f"{'rate':>5} {'config':<18} {'tok/s':>8} {'TPOT p50':>9} {'ITL p50':>8} {'decoders':>9} {'tok/step':>8}")
    schedule = None
    for rate in (float(r) for r in args.rates.split(",")):
        w = load(WorkloadOptions(num_requests=args.requests, rate=rate, prompt_len=args.prompt_len,
                                 output_len=args.output_len, seed=0))
        for name, spec in CONFIGS:
            r = simulate(Scenario(w, model=args.model, gpu=args.gpu, **spec), "vllm-v1", record_batches=True)
            s = r.summary
            rows = r.batches
            busy = sum(b[1] for b in rows)
            decoders = sum(b[1] * b[4] for b in rows) / busy if busy else 0.0      # time-weighted
            per_step = s.get("spec_tokens_per_step")
            print(f"{rate:5g} {name:<18} {s['output_throughput']:8.0f} {s['median_tpot_ms']:9.2f} "
                  f"{s['median_itl_ms']:8.2f} {decoders:9.1f} {per_step if per_step else 1.0:8.2f}")
            schedule = s.get("spec_adaptive", schedule)
    print("adaptive schedule (batch sizes: k):", ", ".join(f"{a}-{b}: {k}" for a, b, k in schedule or ()))


if __name__ == "__main__":
    main()
