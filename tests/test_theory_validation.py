"""The closed forms against the simulator, and the `plan` / `theory` commands."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import run
from kvsched.cli import app
from kvsched.theory import fluid, stability
from kvsched.theory.fluid import FluidType
from kvsched.workload import Fixed, RequestType, Uniform, mixture, synthetic

runner = CliRunner()
M, B, CHUNK = 131_000, 0.0372, 512
PD = {"1:1": (1600, 1600), "2:1": (2133, 1066), "1:2": (1066, 2133), "8:1": (2844, 356)}


def mu_of(hp: int, ho: int) -> float:
    s, o = np.arange(10, hp + 1), np.arange(10, ho + 1)
    g = stability.mean_lifetime_memory_independent(s, np.full(len(s), 1 / len(s)), o, np.full(len(o), 1 / len(o)), CHUNK)
    return stability.service_rate(M, B, g)


def simulate_pd(hp: int, ho: int, rate: float, n: int, seed: int = 1):
    w = synthetic(Uniform(10, hp), Uniform(10, ho), rate=rate, n=n, seed=seed)
    server, rec, _ = run(w, "vllm-v1", {"long_prefill_token_threshold": CHUNK}, cost="constant",
                         cost_params={"b": B}, kv_tokens=M, block_size=1, checked=False)
    return w, server, rec


@pytest.mark.parametrize("mix", list(PD))
def test_saturated_replica_completes_at_mu(mix):
    """stability-capacity.txt eq. 1 under `constant` cost b, M tokens, block size 1, vllm-v1
    with chunk 512, arrivals at 3 mu: completions within 10% of mu."""
    mu = mu_of(*PD[mix])
    _, _, rec = simulate_pd(*PD[mix], rate=3 * mu, n=3000)
    f = np.sort(rec.finished)
    lo, hi = int(0.2 * len(f)), int(0.8 * len(f))
    served = (hi - lo) / (f[hi] - f[lo])
    assert abs(served / mu - 1) < 0.10, (mix, served, mu)


def queue_at(server, times: np.ndarray) -> np.ndarray:
    tl = np.array(server.timeline)
    idx = np.searchsorted(tl[:, 0], times, side="right") - 1
    return tl[np.maximum(idx, 0), 1]


def test_queue_bounded_below_stable_rate_and_linear_above_mu():
    hp, ho = PD["1:1"]
    mu = mu_of(hp, ho)
    delta = stability.memory_slack(hp + ho, M)
    rate = 0.8 * stability.stable_rate(mu, delta)
    w, server, rec = simulate_pd(hp, ho, rate, 6000, seed=2)
    end = w.arrival[-1]
    grid = np.linspace(0.1 * end, end, 200)
    q = queue_at(server, grid)
    assert q[100:].max() < 60 and q[150:].mean() <= q[50:100].mean() + 5     # no drift
    assert abs(np.count_nonzero(rec.finished <= end) / end / rate - 1) < 0.05
    rate = 1.5 * mu
    w, server, rec = simulate_pd(hp, ho, rate, 6000, seed=3)
    end = w.arrival[-1]
    grid = np.linspace(0.2 * end, end, 200)
    q = queue_at(server, grid)
    slope, icept = np.polyfit(grid, q, 1)
    r2 = 1 - np.sum((q - (slope * grid + icept)) ** 2) / np.sum((q - q.mean()) ** 2)
    assert r2 > 0.98 and slope == pytest.approx(rate - mu, rel=0.15)


def test_fluid_equilibrium_matches_linear_cost_simulation():
    """fluid-wait-nested-wait.txt eqs. (6)-(7): with batches following the fluid dynamics
    (every arrival prefilled whole in the next batch, every running request decoding, ample
    memory, which `orca` does), mean batch time and mean memory held per batch match
    d0 / (1 - d1 A) and d0 A / (1 - d1 A)."""
    d0, d1 = 0.02, 1.5e-7                     # d1 x load = 0.51
    types = [RequestType(Fixed(10), Fixed(20), 200.0), RequestType(Fixed(10), Fixed(40), 400.0),
             RequestType(Fixed(100), Fixed(160), 100.0)]
    w = mixture(types, 40_000, seed=4)
    server, rec, _ = run(w, "orca", {"max_num_seqs": 100_000, "max_num_batched_tokens": 10**7},
                         cost="linear", cost_params={"d0": d0, "d1": d1}, kv_tokens=10**8, block_size=1,
                         checked=False)
    ft = [FluidType(t.rate, t.prompt.mean, t.output.mean - 1) for t in types]
    batches = np.array(server.batches)
    steady = (batches[:, 0] > 0.2 * w.arrival[-1]) & (batches[:, 0] < 0.8 * w.arrival[-1])
    mean_time = batches[steady, 1].mean()
    mean_memory = batches[steady, 5].mean()
    assert mean_time == pytest.approx(fluid.iteration_time(ft, d0, d1), rel=0.10)
    assert mean_memory == pytest.approx(fluid.equilibrium_memory(ft, d0, d1), rel=0.10)


def invoke(*args):
    return runner.invoke(app, list(args))


def test_theory_commands_json_keys():
    r = invoke("theory", "eb-threshold", "--p0", "0.004", "--alpha-p", "0.05", "--alpha-d", "0.02",
               "--eta", "1e-5", "--beta-d", "3e-5", "--batch-size", "512", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"theta0", "delta_theta"} <= set(d) and d["delta_theta"] > 0
    r = invoke("theory", "eb-batch-size", "--kv-capacity", "400000", "--p0", "0.004", "--mu-l", "512",
               "--theta", "0.3", "--eps", "0.01", "--json")
    d = json.loads(r.stdout)
    assert d["n_star"] <= d["n_expected"] <= d["n_static"]
    r = invoke("theory", "fluid", "--type", "20:10:19", "--type", "40:10:39", "--d0", "0.01", "--d1", "2e-6", "--json")
    d = json.loads(r.stdout)
    assert {"M_star", "iteration_time", "throughput_star", "stable"} <= set(d) and d["stable"] is True
    assert d["throughput_star"] == 20 * 20 + 40 * 40
    r = invoke("theory", "wait-thresholds", "--type", "20:10:19", "--type", "40:10:39", "--d0", "0.01",
               "--d1", "2e-6", "--batch-size", "256", "--json")
    assert json.loads(r.stdout)["satisfied"] is True
    r = invoke("theory", "nested-wait-thresholds", *sum((["--type", f"{x}:10:{x}"] for x in (20, 40, 80, 160)), []),
               "--d0", "0.01", "--d1", "2e-7", "--json")
    d = json.loads(r.stdout)
    assert d["satisfied"] and d["memory_bound"] > d["memory"]
    r = invoke("theory", "eb-crossover", "--batch-size", "512", "--p0", "0.004", "--alpha-p", "0.03",
               "--alpha-d", "0.01", "--beta-p", "4e-5", "--beta-d", "3e-5", "--alpha-mb", "0.01",
               "--beta-mb", "5e-5", "--mu-l", "512", "--mu-o", "256", "--json")
    assert json.loads(r.stdout)["favours"] in ("EB", "MB")


def test_theory_stability_from_a_trace_and_the_paper_mixture(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_tokens,output_tokens\n0,512,10\n1,1024,20\n")
    r = invoke("theory", "stability", "--trace", str(f), "--kv-capacity", "131000", "--batch-time", "0.05",
               "--chunk-size", "512", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    g = (stability.lifetime_memory(512, 10, 512) + stability.lifetime_memory(1024, 20, 512)) / 2
    assert d["mean_lifetime_memory"] == pytest.approx(g) and d["mu"] == pytest.approx(131_000 / (0.05 * g))
    assert d["delta"] == pytest.approx(1044 / 131_000)
    r = invoke("theory", "stability", "-w", "stability-pd-switch", "--kv-capacity", "131000",
               "--batch-time", "0.0430", "--batch-time", "0.0337", "--json")
    d = json.loads(r.stdout)
    assert d["exact"] and abs(d["mu"] / 3.385 - 1) < 0.02           # the paper's mixture
    table = tmp_path / "p.csv"
    table.write_text("prompt_tokens,output_tokens,count\n512,10,1\n1024,20,3\n")
    d = json.loads(invoke("theory", "stability", "--joint-table", str(table), "--kv-capacity", "131000",
                          "--batch-time", "0.05", "--json").stdout)
    g = (stability.lifetime_memory(512, 10, 512) + 3 * stability.lifetime_memory(1024, 20, 512)) / 4
    assert d["mean_lifetime_memory"] == pytest.approx(g)
    table.write_text("prompt_tokens,output_tokens,count\n512,10,1\n0,20,3\n")
    r = invoke("theory", "stability", "--joint-table", str(table), "--kv-capacity", "131000", "--batch-time", "0.05")
    assert r.exit_code == 2 and f"{table}:3:" in r.stderr


def test_plan_azure_conv_on_h100_and_the_planned_replica_is_stable(traces_dir):
    r = invoke("plan", "--trace", str(traces_dir / "azure2023-conv.csv"), "--model", "llama-3-8b",
               "--gpu", "h100-sxm", "--rate", "40", "--validate", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"mu", "delta", "stable_rate", "gpus_needed"} <= set(d)
    assert d["gpus_needed"] == int(np.ceil(40 / (d["mu"] * 0.9)))
    assert d["validation"]["stable"] and d["validation"]["arrival_rate"] == pytest.approx(40 / d["gpus_needed"])
    r = invoke("plan", "--trace", str(traces_dir / "azure2023-conv.csv"), "--model", "llama-3-8b",
               "--gpu", "h100-sxm", "--rate", "40")
    assert r.exit_code == 0 and "service rate mu" in r.stdout and "GPUs needed" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["plan", "-w", "eb-balanced"], "give --rate"),
    (["plan", "--rate", "0"], "--rate must be > 0"),
    (["plan", "--rate", "5", "--batch-time", "-1"], "--batch-time must be > 0"),
    (["plan", "--rate", "5", "--batch-time-estimator", "mode"], "unknown batch-time estimator"),
    (["theory", "fluid", "--d0", "0.01", "--d1", "1e-6"], "at least one --type"),
    (["theory", "fluid", "--type", "1:2", "--d0", "0.01", "--d1", "1e-6"], "RATE:PROMPT:OUTPUT"),
    (["theory", "eb-threshold", "--p0", "-1", "--alpha-p", "1", "--alpha-d", "1"], "p0 must be a positive"),
    (["theory", "eb-batch-size", "--kv-capacity", "1000", "--p0", "0.1", "--mu-l", "10", "--theta", "1.5"], "0 < theta < 1"),
])
def test_theory_bad_input(args, needle):
    r = invoke(*args)
    assert r.exit_code == 2 and needle in r.stderr, r.output
