"""Theory against simulation: prints the figures behind issue 4's checks.

1. stability-capacity.txt's PD mixes: mu = M / (b E[g]) against the completion rate of a
   saturated simulated replica (constant cost b, M = 131,000 tokens, block 1, vllm-v1 with
   chunk 512), and the half-and-half mixture against the paper's 3.385 req/s.
2. Queue length below mu (1 - delta) and above mu.
3. fluid-wait-nested-wait.txt eqs. (6)-(7) against a linear-cost simulation whose batches
   follow the fluid dynamics (orca, ample memory).
4. `plan` on the Azure conversation trace (llama-3-8b / h100-sxm, 40 req/s) with roofline
   cost: mu with the median and the mean batch time against a saturated simulation.

    python benchmarks/bench_theory.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import run  # noqa: E402
from kvsched.run import Scenario, simulate  # noqa: E402
from kvsched.theory import fluid, stability  # noqa: E402
from kvsched.theory.fluid import FluidType  # noqa: E402
from kvsched.theory.plan import PlanInputs, plan  # noqa: E402
from kvsched.workload import Fixed, RequestType, Uniform, load_trace, mixture, synthetic  # noqa: E402
from kvsched.workload.source import WorkloadOptions, load  # noqa: E402

M, CHUNK = 131_000, 512
PAPER_B = {"1:1": 0.0372, "2:1": 0.0430, "1:2": 0.0337}
PD = {"1:1": (1600, 1600), "2:1": (2133, 1066), "1:2": (1066, 2133), "8:1": (2844, 356)}
AZURE = "azure2023-conv"          # bundled


def mu_of(hp: int, ho: int, b: float) -> float:
    s, o = np.arange(10, hp + 1), np.arange(10, ho + 1)
    g = stability.mean_lifetime_memory_independent(s, np.full(len(s), 1 / len(s)), o, np.full(len(o), 1 / len(o)), CHUNK)
    return stability.service_rate(M, b, g)


def saturated_rate(finished: np.ndarray) -> float:
    f = np.sort(finished[np.isfinite(finished)])
    lo, hi = int(0.2 * len(f)), int(0.8 * len(f))
    return (hi - lo) / (f[hi] - f[lo])


def pd_mixes() -> None:
    print("1. service rate mu vs a saturated replica (constant b = 0.0372 s, M = 131,000, chunk 512, vllm-v1)")
    print(f"   {'mix':5} {'mu':>8} {'simulated':>10} {'gap':>7} {'preemptions':>12}")
    for name, (hp, ho) in PD.items():
        mu = mu_of(hp, ho, 0.0372)
        w = synthetic(Uniform(10, hp), Uniform(10, ho), rate=3 * mu, n=3000, seed=1)
        _, rec, _ = run(w, "vllm-v1", {"long_prefill_token_threshold": CHUNK}, cost="constant",
                        cost_params={"b": 0.0372}, kv_tokens=M, block_size=1, checked=False)
        sim = saturated_rate(rec.finished)
        print(f"   {name:5} {mu:8.3f} {sim:10.3f} {sim / mu - 1:+7.1%} {int(rec.preemptions.sum()):12,}")
    mus = [mu_of(*PD[k], PAPER_B[k]) for k in ("2:1", "1:2")]
    mix = stability.mixture_rate([0.5, 0.5], mus)
    print(f"   paper's b: mu(2:1) = {mus[0]:.3f}, mu(1:2) = {mus[1]:.3f}, mu_mix = {mix:.3f} "
          f"(paper 3.385, {mix / 3.385 - 1:+.1%})")


def queues() -> None:
    hp, ho = PD["1:1"]
    mu = mu_of(hp, ho, 0.0372)
    stable = stability.stable_rate(mu, stability.memory_slack(hp + ho, M))
    print(f"2. queue length, PD 1:1, mu = {mu:.3f}, mu (1 - delta) = {stable:.3f}")
    for factor, base in ((0.8, stable), (1.5, mu)):
        rate = factor * base
        w = synthetic(Uniform(10, hp), Uniform(10, ho), rate=rate, n=6000, seed=2)
        server, rec, _ = run(w, "vllm-v1", {"long_prefill_token_threshold": CHUNK}, cost="constant",
                             cost_params={"b": 0.0372}, kv_tokens=M, block_size=1, checked=False)
        tl = np.array(server.timeline)
        end = w.arrival[-1]
        quarters = [tl[(tl[:, 0] >= a * end) & (tl[:, 0] < (a + 0.25) * end), 1].mean() for a in (0, .25, .5, .75)]
        grid = tl[(tl[:, 0] > 0.2 * end) & (tl[:, 0] < end)]
        slope = np.polyfit(grid[:, 0], grid[:, 1], 1)[0]
        print(f"   lambda = {rate:.3f}: mean queue by quarter {', '.join(f'{q:.1f}' for q in quarters)}; "
              f"slope {slope:+.3f} req/s (lambda - mu = {rate - mu:+.3f})")


def fluid_check() -> None:
    d0, d1 = 0.02, 1.5e-7
    types = [RequestType(Fixed(10), Fixed(20), 200.0), RequestType(Fixed(10), Fixed(40), 400.0),
             RequestType(Fixed(100), Fixed(160), 100.0)]
    w = mixture(types, 40_000, seed=4)
    server, _, _ = run(w, "orca", {"max_num_seqs": 100_000, "max_num_batched_tokens": 10**7}, cost="linear",
                       cost_params={"d0": d0, "d1": d1}, kv_tokens=10**8, block_size=1, checked=False)
    ft = [FluidType(t.rate, t.prompt.mean, t.output.mean - 1) for t in types]
    b = np.array(server.batches)
    steady = (b[:, 0] > 0.2 * w.arrival[-1]) & (b[:, 0] < 0.8 * w.arrival[-1])
    tau, mem = fluid.iteration_time(ft, d0, d1), fluid.equilibrium_memory(ft, d0, d1)
    print(f"3. fluid equilibrium (d0 = {d0}, d1 = {d1}, 3 types, orca, {int(steady.sum())} steady batches)")
    print(f"   time per iteration: eq. 7 {tau * 1000:.2f} ms, simulated {b[steady, 1].mean() * 1000:.2f} ms "
          f"({b[steady, 1].mean() / tau - 1:+.1%})")
    print(f"   memory held: eq. 6 {mem:,.0f}, simulated {b[steady, 5].mean():,.0f} ({b[steady, 5].mean() / mem - 1:+.1%})")


def azure_plan() -> None:
    w = load_trace(AZURE)
    print("4. plan: azure2023-conv, llama-3-8b / h100-sxm, 40 req/s, roofline cost")
    for est in ("median", "mean"):
        p = plan(PlanInputs(Scenario(w, model="llama-3-8b", gpu="h100-sxm"), rate=40, batch_time_estimator=est),
                 validate=est == "median")
        line = f"   b ({est}) = {p['batch_time'] * 1000:.1f} ms, mu = {p['mu']:.2f} req/s, GPUs = {p['gpus_needed']}"
        if "validation" in p:
            v = p["validation"]
            line += f"; one replica at {v['arrival_rate']:.2f} req/s: served {v['served_rate']:.2f}, " \
                    f"{'stable' if v['stable'] else 'NOT stable'}"
        print(line)
    over = load(WorkloadOptions(trace=AZURE, rate=40, num_requests=8000))
    r = simulate(Scenario(over, model="llama-3-8b", gpu="h100-sxm"), "vllm-v1", {"long_prefill_token_threshold": CHUNK})
    print(f"   one replica offered 40 req/s completes {saturated_rate(r.records.finished):.2f} req/s")


if __name__ == "__main__":
    import warnings
    warnings.simplefilter("ignore")
    pd_mixes()
    queues()
    fluid_check()
    azure_plan()
