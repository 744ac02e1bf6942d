"""Simulation against the real engine: vLLM (CPU build) serving a random-weight tiny Llama
built here, against kvsched simulating the same workload with a cost model calibrated from the
engine's own step log.

    python benchmarks/bench_real.py [--requests 300] [--rate 25] [--repeats 3] [--out DIR]

0. Warm-up: one short run, thrown away (a process's first engine runs slower).
1. Calibrate: a calibration workload (its own seed) through the real engine with vllm-v1, EB
   and Sarathi inside it (mixed steps of all sizes, pure prefill and decode steps), each step
   logged by the adapter (engines/vllm_scheduler.py); `kvsched.cost.calibrate` fits the phase
   and linear models to the logs joined (docs/calibration.md); the table of their errors is
   printed and the better model becomes the cost file.
2. Serve the test workload (another seed) through the real engine, `--repeats` times each:
   vLLM's own scheduler (vllm-v1) without and with the adapter, EB through the adapter, and
   Sarathi (chunk budget `--chunk`) through the adapter; and vLLM's own scheduler past
   saturation (`--saturated-rate`), where throughput measures the engine. Each figure is the median over the
   repeats, with their range: on a shared 2-core machine identical runs differ by up to ~20%
   in TPOT, which bounds how close any simulation can be judged.
3. Simulate the same workload, policies, KV blocks, token budget and seats with the calibrated
   cost model: the held-out one of step 1, and each repeat's own (fitted to the step logs of
   that repeat's adapter runs: the machine's speed drifts by tens of percent over minutes,
   and the same-run calibration removes that drift from the comparison). Print real against
   simulated: throughput, and median and p99 TTFT, TPOT and
   E2EL (as `vllm bench serve` measures them: TPOT excludes the first token), with the errors.
   Targets (issue 14): throughput and median TPOT within 10%, median TTFT within 15%.

Needs vLLM (`.ci/run` installs the CPU build; README). Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvsched.engines.vllm_replay import Limits  # noqa: E402
from kvsched.workload.source import WorkloadOptions, load  # noqa: E402

METRICS = [("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT ms"),
           ("p99_ttft_ms", "p99 TTFT ms"), ("median_tpot_ms", "median TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"),
           ("median_e2el_ms", "median E2EL ms"), ("p99_e2el_ms", "p99 E2EL ms")]
TARGETS = {"output_throughput": 0.10, "median_tpot_ms": 0.10, "median_ttft_ms": 0.15}


def workload(n: int, rate: float, seed: int):
    return load(WorkloadOptions(num_requests=n, rate=rate, prompt_len="uniform:16:480", output_len="uniform:2:80",
                                seed=seed))


def real_run(w, model: Path, limits: Limits, policy, params, log: Path | None):
    from kvsched.engines.vllm_engine import ServeOptions, run_real
    return run_real(w, model, ServeOptions(limits, policy=policy, policy_params=params, step_log=log))


def calibrate_from(logs: list[Path], path: Path, verbose: bool = True) -> tuple[Path, dict]:
    """Fit phase and linear to the logs joined; write the better one as a cost file at `path`."""
    from kvsched.cost.calibrate import calibrate, read_step_log, write_cost_file
    joined = path.with_suffix(".steps.csv")
    with joined.open("w") as f:
        for k, log in enumerate(logs):
            lines = log.read_text().splitlines(keepends=True)
            f.writelines(lines if k == 0 else lines[1:])
    cal = calibrate(read_step_log(joined), models=("phase", "linear"))
    best = cal.best()
    write_cost_file(path, cal.cost_file(best))
    if verbose:
        print(f"calibration: {len(cal.log)} steps {cal.log.counts()}")
        print(f"{'model':8} {'kind':8} {'steps':>6} {'median err':>11} {'p90 err':>8}")
        for name, fit in cal.fits.items():
            for kind, e in fit.errors.items():
                if e["steps"]:
                    print(f"{name:8} {kind:8} {e['steps']:6d} {e['median']:11.1%} {e['p90']:8.1%}")
            print(f"{name:8} params {json.dumps({k: float(f'{v:.4g}') for k, v in fit.params.items()})}")
        print(f"cost model for simulation: {best} ({path})")
    else:
        e = cal.fits[best].errors["all"]
        print(f"  same-run calibration {path.name}: {best}, {len(cal.log)} steps, median error {e['median']:.1%}, "
              f"p90 {e['p90']:.1%}")
    return path, cal.as_dict()


def simulate(w, cost: Path, limits: Limits, policy: str, params: dict) -> dict:
    from kvsched.engines.vllm_replay import engine_policy
    from kvsched.run import Scenario
    from kvsched.run import simulate as sim
    pol = engine_policy(policy, params, limits.max_num_batched_tokens, limits.max_num_seqs)
    scenario = Scenario(w, model="llama-3-8b", gpu="a100-80gb", cost=str(cost), client=None,
                        kv_capacity=(limits.num_gpu_blocks - 1) * limits.block_size, block_size=limits.block_size,
                        max_model_len=limits.max_model_len)
    return sim(scenario, pol).summary


def _err(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def _mark(key: str, err: float) -> str:
    target = TARGETS.get(key)
    return "" if target is None else (" ok" if abs(err) <= target else " MISS")


def table(label: str, reals: list[dict], held_out: dict, same_run: list[dict]) -> list[dict]:
    """Real (median of the repeats, and their range) against simulated: with the held-out
    calibration, and with each repeat's own calibration (median of the repeats)."""
    rows = []
    print(f"\n{label}")
    print(f"{'metric':15} {'real':>8} {'real range':>16} {'sim held-out':>12} {'error':>11} {'sim same-run':>12} {'error':>11}")
    for key, name in METRICS:
        values = sorted(x[key] for x in reals)
        r = float(np.median(values))
        h, m = held_out[key], float(np.median([x[key] for x in same_run]))
        eh, em = _err(h, r), _err(m, r)
        span = f"{values[0]:.1f}-{values[-1]:.1f}"
        print(f"{name:15} {r:8.1f} {span:>16} {h:12.1f} {eh:+7.1%}{_mark(key, eh):4} {m:12.1f} {em:+7.1%}{_mark(key, em):4}")
        rows.append({"config": label, "metric": key, "real": r, "real_runs": values, "simulated_held_out": h,
                     "error_held_out": eh, "simulated_same_run": m, "error_same_run": em})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=25.0, help="arrivals per second (Poisson)")
    ap.add_argument("--repeats", type=int, default=3, help="real runs per configuration")
    ap.add_argument("--saturated-rate", type=float, default=60.0, help="arrival rate of the saturated run")
    ap.add_argument("--calibration-requests", type=int, default=300)
    ap.add_argument("--calibration-rate", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=64, help="Sarathi's token budget")
    ap.add_argument("--out", type=Path, default=None, help="keep the logs, cost file and results.json here")
    args = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("bench_real needs vLLM: see the README's 'Real engine: vLLM' section")
    from kvsched.engines.vllm_engine import build_random_model
    work = Path(tempfile.mkdtemp(prefix="kvsched-bench-real-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    try:
        model = build_random_model(work / "tiny-llama", seed=args.seed)
        limits = Limits(256, 32, num_gpu_blocks=400, block_size=32, max_model_len=4096)
        print(f"engine: vLLM CPU, random-weight Llama {json.dumps({'layers': 4, 'hidden': 256})}, "
              f"max_num_batched_tokens {limits.max_num_batched_tokens}, max_num_seqs {limits.max_num_seqs}, "
              f"{limits.num_gpu_blocks} blocks of {limits.block_size}")
        real_run(workload(50, args.rate, args.seed + 2000), model, limits, None, None, None)      # warm-up
        cw = workload(args.calibration_requests, args.calibration_rate, args.seed + 1000)
        logs = []
        for policy, params in (("vllm-v1", {}), ("eb", {}), ("sarathi", {"chunk_size": args.chunk})):
            logs.append(out / f"steps-calibration-{policy}.csv")
            real_run(cw, model, limits, policy, params, logs[-1])
        cost, calibration = calibrate_from(logs, out / "cost.json")
        w = workload(args.requests, args.rate, args.seed)
        over = workload(args.requests, args.saturated_rate, args.seed)
        configs = [("vllm-v1 (vLLM's own scheduler, no adapter)", w, None, "vllm-v1", {}),
                   ("vllm-v1 (through the adapter)", w, "vllm-v1", "vllm-v1", {}),
                   ("eb (inside vLLM)", w, "eb", "eb", {}),
                   (f"sarathi chunk {args.chunk} (inside vLLM)", w, "sarathi", "sarathi", {"chunk_size": args.chunk}),
                   (f"vllm-v1 (no adapter), saturated: Poisson {args.saturated_rate:g}/s", over, None, "vllm-v1", {})]
        print(f"\ntest workload: {args.requests} requests, Poisson {args.rate:g}/s, prompts uniform 16-480, "
              f"outputs uniform 2-80, seed {args.seed}; real: median of {args.repeats} runs. Below saturation the "
              "throughput is the offered load; the saturated run is the one that measures the engine's.")
        reals: dict[str, list[dict]] = {label: [] for label, *_ in configs}
        same: dict[str, list[dict]] = {label: [] for label, *_ in configs}
        for k in range(args.repeats):                      # interleaved: slow phases of the machine hit all
            logs = []
            for n, (label, wl, inside, policy, params) in enumerate(configs):
                log = out / f"steps-r{k}-c{n}.csv" if inside else None
                reals[label].append(real_run(wl, model, limits, inside, params if inside else None, log))
                logs += [log] if log else []
            cost_k, _ = calibrate_from(logs, out / f"cost-r{k}.json", verbose=False)
            for label, wl, inside, policy, params in configs:
                same[label].append(simulate(wl, cost_k, limits, policy, params))
        rows = []
        for label, wl, inside, policy, params in configs:
            rows += table(label, reals[label], simulate(wl, cost, limits, policy, params), same[label])
        (out / "results.json").write_text(json.dumps({"calibration": calibration, "rows": rows}, indent=2))
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
