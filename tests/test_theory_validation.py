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
    (["theory", "eb-threshold", "--p0", "-1", "--alpha-p", "1", "--alpha-d", "1"], "--p0 must be a probability"),
    (["theory", "eb-batch-size", "--kv-capacity", "1000", "--p0", "0.1", "--mu-l", "10", "--theta", "1.5"], "0 < theta < 1"),
])
def test_theory_bad_input(args, needle):
    r = invoke(*args)
    assert r.exit_code == 2 and needle in r.stderr, r.output


EB = ["--alpha-p", "0.05", "--alpha-d", "0.02"]
EB_BATCH = ["theory", "eb-batch-size", "--kv-capacity", "400000", "--mu-l", "512", "--theta", "0.3"]
EB_CROSS = ["theory", "eb-crossover", "--batch-size", "512", "--alpha-p", "0.03", "--alpha-d", "0.01", "--beta-p",
            "4e-5", "--beta-d", "3e-5", "--alpha-mb", "0.01", "--beta-mb", "5e-5", "--mu-l", "512", "--mu-o", "256"]
NESTED = ["theory", "nested-wait-thresholds", "--type", "20:10:20", "--d0", "0.01", "--d1", "2e-7"]
TYPES2 = ["--type", "20:10:19", "--type", "40:10:39"]
STAB = ["theory", "stability", "-w", "stability-pd-switch"]


@pytest.mark.parametrize("args,needle", [
    # p0 is the per-iteration completion probability (exclusive-batching-eb.txt section 3.2, appendix B)
    (["theory", "eb-threshold", "--p0", "100", *EB], "--p0 must be a probability in (0, 1]"),
    (["theory", "eb-threshold", "--p0", "nan", *EB], "--p0 must be a probability in (0, 1]"),
    ([*EB_BATCH, "--p0", "2"], "--p0 must be a probability in (0, 1]"),
    ([*EB_CROSS, "--p0", "1.5"], "--p0 must be a probability in (0, 1]"),
    (["theory", "eb-threshold", "--p0", "0.004", *EB, "--eta", "1e-5", "--beta-d", "nan"], "beta_d must be a finite"),
    (["theory", "eb-threshold", "--p0", "0.004", *EB, "--eta", "1e-5", "--batch-size", "0.5"], "batch size N >= 1"),
    ([*EB_CROSS, "--p0", "0.004", "--beta-p", "nan"], "beta_p must be a finite number >= 0"),
    ([*EB_CROSS, "--p0", "0.004", "--alpha-mb", "-1"], "alpha_mb must be a finite number >= 0"),
    ([*EB_BATCH, "--p0", "0.004", "--mu-l", "1e-308"], "v_bar = 1 / (p0^2 mu_L) (appendix D.4) is beyond"),
    ([*EB_BATCH, "--p0", "1e-308"], "is beyond the floating-point range"),
    # delta is eq. (12)'s overflow probability, S its horizon in batches: checked with one type too
    ([*NESTED, "--delta", "2"], "--delta must be a probability in (0, 1)"),
    ([*NESTED, "--type", "40:10:40", "--delta", "2"], "--delta must be a probability in (0, 1)"),
    ([*NESTED, "--delta", "nan"], "--delta must be a probability in (0, 1)"),
    ([*NESTED, "--batches", "inf"], "--batches S must be a finite number of batches >= 1"),
    ([*NESTED, "--batches", "0"], "--batches S must be a finite number of batches >= 1"),
    # nan, inf and overflowing fluid parameters (were tracebacks or nan/inf results)
    (["theory", "fluid", "--type", "20:nan:19", "--d0", "0.01", "--d1", "2e-6"], "fluid type needs finite"),
    (["theory", "wait-thresholds", "--type", "20:10:nan", "--d0", "0.01", "--d1", "2e-6"], "fluid type needs finite"),
    (["theory", "fluid", *TYPES2, "--d0", "inf", "--d1", "2e-6"], "needs finite d0 > 0"),
    (["theory", "fluid", *TYPES2, "--d0", "0.01", "--d1", "inf"], "needs finite d0 > 0"),
    (["theory", "fluid", *TYPES2, "--d0", "1e308", "--d1", "2e-6"], "M* = d0 A / (1 - d1 A) (eq. 6) is beyond"),
    (["theory", "fluid", "--type", "1e308:10:19", "--d0", "0.01", "--d1", "2e-6"], "type 1's load"),
    (["theory", "wait-thresholds", *TYPES2, "--d0", "1e308", "--d1", "2e-6"], "overflow at d0=1e+308"),
    (["theory", "wait-thresholds", "--type", "20:1e308:19", "--d0", "0.01", "--d1", "2e-6"], "type 1's load"),
    ([*NESTED[:-4], "--type", "40:10:40", "--d0", "1e308", "--d1", "2e-7"], "no Nested WAIT thresholds with n_1 <="),
    (["theory", "rad-capacity", "--prompt-len", "fixed:512", "--output-len", "fixed:65", "--num-requests", "10",
      "--eps", "1e-308"], "cycle bound"),
    ([*STAB, "--kv-capacity", "131000", "--batch-time", "0.05", "--chunk-size", "1" + "0" * 400],
     "--chunk-size) must be 1..1,099,511,627,776"),
    # N beyond any KV capacity: exit 0 with rhs -4e-310 (underflow) and a 309-digit k0_star
    ([*EB_CROSS, "--p0", "0.004", "--batch-size", "1e30"],
     "the batch size N (--batch-size) must be 1..1,099,511,627,776 request slots (each holds at least one KV "
     "token), got 1e+30"),
    ([*EB_CROSS, "--p0", "0.004", "--batch-size", "1e308"], "--batch-size) must be 1..1,099,511,627,776"),
    ([*EB_CROSS, "--p0", "0.004", "--batch-size", "1099511627777"], "got 1099511627777"),
    ([*EB_CROSS, "--p0", "0.004", "--batch-size", "nan"], "--batch-size) must be 1..1,099,511,627,776"),
    (["theory", "eb-threshold", "--p0", "0.004", *EB, "--eta", "1e-5", "--batch-size", "1e30"],
     "--batch-size) must be 1..1,099,511,627,776"),
    ([*EB_BATCH[:2], "--kv-capacity", "1e300", *EB_BATCH[4:], "--p0", "0.004"],
     "the KV capacity C (--kv-capacity) must be at most 1,099,511,627,776 tokens, got 1e+300"),
    # a term of eq. (7) below the float range (its difference with the other is no check)
    ([*EB_CROSS[:-4], "--mu-l", "1e306", "--mu-o", "256", "--p0", "0.004"],
     "(alpha_p + alpha_d zeta mu_O) / (k0* (mu_L + mu_O)) in eq. (7) is beyond the floating-point range"),
    ([*EB_CROSS[:-4], "--mu-l", "1e300", "--mu-o", "256", "--p0", "0.004", "--alpha-mb", "1e-20"],
     "alpha_MB (1 + mu_O) / (N (mu_L + mu_O)) in eq. (7) is beyond"),
])
def test_theory_parameter_outside_its_domain_is_one_line(args, needle):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.output and "warning" not in r.stderr


def test_eb_crossover_at_the_largest_batch_size_is_computed():
    """N = 2^40 slots: k0* = floor(theta0 N) a plausible count, rhs = eq. (7)'s right side."""
    from kvsched.theory.eb import theta0, zeta
    r = invoke(*EB_CROSS[:2], "--batch-size", str(2 ** 40), *EB_CROSS[4:], "--p0", "0.004", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    th = theta0(0.004, 0.03, 0.01)
    k0 = int(th * 2 ** 40)
    assert d["k0_star"] == k0 < 2 ** 40
    assert d["rhs"] == pytest.approx(((0.03 + 0.01 * zeta(th) * 256) / k0 - 0.01 * 257 / 2 ** 40) / (512 + 256))
    assert d["rhs"] > 1e-16 and d["favours"] == ("MB" if d["lhs"] < d["rhs"] else "EB")


def test_p0_of_one_is_a_probability():
    """p0 = 1 (every request ends after one decode iteration) is the closed end of (0, 1]."""
    r = invoke("theory", "eb-threshold", "--p0", "1", *EB, "--json")
    assert r.exit_code == 0 and 0 < json.loads(r.stdout)["theta0"] < 1


@pytest.mark.parametrize("option,value,needle", [
    ("--batch-time", "1e308", "mu = M / (b E[g]) (eq. 1) is beyond the floating-point range at kv_capacity=131000, "
                              "batch_time=1e+308"),
    ("--batch-time", "5e-324", "batch_time=4.94066e-324"),
    ("--batch-time", "inf", "batch_time must be a positive number, got inf"),
    ("--batch-time", "nan", "batch_time must be a positive number, got nan"),
    ("--kv-capacity", "1e-308", "kv_capacity=1e-308"),
    ("--kv-capacity", "inf", "kv_capacity must be a positive number, got inf"),
    ("--kv-capacity", "nan", "kv_capacity must be a positive number, got nan"),
])
def test_stability_out_of_range_is_one_line_without_numpy_warnings(option, value, needle):
    given = {"--kv-capacity": "131000", "--batch-time": "0.05", option: value}
    r = invoke(*STAB, *(x for kv in given.items() for x in kv))
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "warning" not in r.stderr, r.stderr


def test_stability_at_the_float_range_computes_finite_results(tmp_path):
    """Large but representable inputs give the exact finite answer, no warnings: M = 1e308
    tokens; one phase's b = 1e300 s (mu_mix = (sum q_l / mu_l)^-1 without overflowing its sum);
    joint-table counts of 1e308 weigh like counts of 1."""
    r = invoke(*STAB, "--kv-capacity", "1e308", "--batch-time", "0.05", "--json")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    d = json.loads(r.stdout)
    assert d["mu"] == pytest.approx(1e308 / (0.05 * d["mean_lifetime_memory"]))
    r = invoke(*STAB, "--kv-capacity", "131000", "--batch-time", "1e300", "--batch-time", "1e-300", "--json")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    d = json.loads(r.stdout)
    assert d["mu"] == pytest.approx(1 / (0.5 / d["phase_mu"][0] + 0.5 / d["phase_mu"][1])) and d["mu"] > 0
    table = tmp_path / "p.csv"
    table.write_text("prompt_tokens,output_tokens,count\n512,10,1e308\n1024,20,1e308\n")
    r = invoke(*STAB[:2], "--joint-table", str(table), "--kv-capacity", "131000", "--batch-time", "0.05", "--json")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    g = (stability.lifetime_memory(512, 10, 512) + stability.lifetime_memory(1024, 20, 512)) / 2
    assert json.loads(r.stdout)["mean_lifetime_memory"] == pytest.approx(g)
    table.write_text("prompt_tokens,output_tokens,count\n512,10,inf\n")
    r = invoke(*STAB[:2], "--joint-table", str(table), "--kv-capacity", "131000", "--batch-time", "0.05")
    assert r.exit_code == 2 and f"{table}:2: " in r.stderr and "finite" in r.stderr


def test_rad_capacity_replicas_bounded_before_any_work(monkeypatch):
    """The static splits are linear in r: --replicas beyond kvsched.limits.MAX_REPLICAS is
    refused before the workload is built or the theorems evaluated."""
    from kvsched.limits import MAX_REPLICAS
    from kvsched.theory import rad

    def no_work(*args, **kwargs):
        raise AssertionError("rad.analyse ran")
    monkeypatch.setattr(rad, "analyse", no_work)
    r = invoke("theory", "rad-capacity", "--prompt-len", "fixed:512", "--output-len", "fixed:65",
               "--replicas", "1000000000")
    assert r.exit_code == 2, r.output
    assert f"--replicas must be <= {MAX_REPLICAS:,} (kvsched.limits), got 1,000,000,000" in r.stderr
