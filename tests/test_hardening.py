"""Bad input that used to give silently wrong results or tracebacks: each is now a one-line
error with exit code 2, or a correct result (issue "Hardening", parts A and B)."""
import math

import numpy as np
import pytest

from conftest import one_line_error, runner
from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.workload import Workload
from kvsched.workload.lengths import LinearHazard



def test_int64_lengths_are_rejected_and_counted(tmp_path):
    """A trace refuses lengths beyond 2**40 tokens (file:line); lengths near int64 given
    through the API are rejected and counted, never wrapped into a 'fitting' footprint."""
    trace = tmp_path / "huge.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,9223372036854775807,5\n")
    one_line_error(["simulate", "--trace", str(trace)], "huge.csv:2: prompt_tokens 9223372036854775807 is beyond")
    big = 2 ** 63 - 1
    w = Workload.build(np.array([0.0, 0.1, 0.2]), [big, 10, 5], [5, 5, big])
    with pytest.raises(KvschedError, match=f"needs {big + 4} KV tokens"):
        simulate(Scenario(w, strict=True))
    with pytest.warns(UserWarning, match="2 request\\(s\\) can never be served"):
        s = simulate(Scenario(w)).summary
    assert s["completed"] == 1 and s["rejected"] == 2


@pytest.mark.parametrize("args,needle", [
    (["--prompt-len", "geometric:1e300"], "geometric: mean must be in 1.."),
    (["--prompt-len", "fixed:99999999999999999999"], "fixed: length must be an integer in 1.."),
    (["--prompt-len", "uniform:1:99999999999999999999"], "uniform: need 1 <= low <= high <="),
    (["--output-len", "hazard:0.01:nan"], "hazard: need 0 < p0 <= 1 and a finite eta >= 0"),
    (["--output-len", "hazard:1e-9:1e-16"], "give lengths beyond 4,000,000 tokens"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--max-model-len", "-5"], "--max-model-len must be >= 1"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--arrivals", "gamma:1:1e308"], "gamma CV must be a number > 0 whose square is finite"),
    (["--num-requests", str(10 ** 12)], "1,000,000,000,000 requests need about"),
    (["--rate", "1e-300"], "vanishes at t="),
    (["--arrivals", "gamma:1e-300:1"], "vanishes at t="),
])
def test_bad_inputs_one_line(args, needle):
    one_line_error(["simulate", "--num-requests", "5", *args] if "--num-requests" not in args else ["simulate", *args],
                   needle)


def test_far_future_arrivals_refused(tmp_path):
    trace = tmp_path / "late.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n1e18,10,5\n1e18,10,5\n")
    one_line_error(["simulate", "--trace", str(trace)], "below the clock's resolution")
    w = Workload.build(np.array([1e6, 1e6 + 1]), [10, 10], [5, 5])        # far, but representable
    r = simulate(Scenario(w, cost="constant"))
    assert r.summary["completed"] == 2 and r.summary["mean_ttft_ms"] > 0


def test_closed_concurrency_beyond_int32():
    for c in ("4294967297", "3000000000"):
        r = runner.invoke(app, ["simulate", "--num-requests", "20", "--arrivals", f"closed:{c}", "--json"])
        assert r.exit_code == 0, r.output
        many = __import__("json").loads(r.stdout)
        all_at_once = __import__("json").loads(runner.invoke(
            app, ["simulate", "--num-requests", "20", "--arrivals", "closed:20", "--json"]).stdout)
        assert many["mean_ttft_ms"] == all_at_once["mean_ttft_ms"]     # not concurrency 1
    one_line_error(["simulate", "--arrivals", "closed:99999999999999999999999"], "at most")


@pytest.mark.parametrize("cap", [math.nan, math.inf, 1.5, True, 0, -3])
def test_kv_capacity_must_be_whole_tokens(cap):
    w = Workload.build(np.zeros(2), [10, 10], [5, 5])
    with pytest.raises(KvschedError, match="--kv-capacity must be >= 1"):
        simulate(Scenario(w, kv_capacity=cap))


def test_hazard_has_the_right_mean_far_out():
    assert LinearHazard(1e-6, 0).mean == pytest.approx(1e6)
    x = LinearHazard(1e-6, 0).sample(np.random.default_rng(0), 20000)
    assert x.mean() == pytest.approx(1e6, rel=0.03) and x.max() > 1_000_000
    small = LinearHazard(0.004, 1e-5)                       # unchanged for ordinary values
    assert small.sample(np.random.default_rng(1), 5).tolist() == \
        LinearHazard(0.004, 1e-5).sample(np.random.default_rng(1), 5).tolist()


def test_eb_threshold_refuses_invalid_eta():
    one_line_error(["theory", "eb-threshold", "--p0", "0.004", "--alpha-p", "0.05", "--alpha-d", "0.02",
                    "--eta", "-1"], "--eta must be a finite slope >= 0")
    one_line_error(["theory", "eb-threshold", "--p0", "0.004", "--alpha-p", "0.05", "--alpha-d", "0.02",
                    "--eta", "1"], "is outside (0, 1)")


@pytest.mark.parametrize("policy,params,needle", [
    ("eb-adaptive", {"theta_start": "5"}, "theta_start=5.0 is outside its range (0, 1)"),
    ("eb-adaptive", {"theta_start": "-1"}, "outside its range (0, 1)"),
    ("eb-adaptive", {"theta_start": "inf"}, "theta_start=inf is outside"),
    ("eb-adaptive", {"fit_lower_quantile": "2"}, "outside its range [0, 1)"),
    ("eb-adaptive", {"delta_theta_cap": "-1"}, "outside its range [0, inf)"),
    ("eb-adaptive", {"eps": "0"}, "eps=0.0 is outside its range (0, 1)"),
    ("eb-plus", {"ema_up": "inf"}, "ema_up=inf is outside"),
    ("eb-plus", {"ema_down": "5"}, "ema_down=5.0 is outside"),
    ("eb-plus", {"evaluate_every": "0"}, "evaluate_every=0 is outside"),
    ("eb-plus", {"cooldown": "-5"}, "cooldown=-5 is outside"),
    ("sarathi", {"chunk_size": 256.7}, "chunk_size=256.7 must be a whole number"),
    ("eb", {"kv_gate": 1}, "kv_gate=1 must be true or false"),
])
def test_policy_parameters_have_ranges(policy, params, needle):
    with pytest.raises(KvschedError) as exc:
        make_policy(policy, params, get_gpu("a30"))
    assert needle in str(exc.value)


def test_policies_command_shows_every_range():
    from kvsched.params import describe
    from kvsched.policies import POLICIES
    r = runner.invoke(app, ["policies"])
    assert r.exit_code == 0 and "range" in r.stdout
    for cls in POLICIES.values():
        assert all(rng for _, _, rng, _ in describe(cls)), cls


@pytest.mark.parametrize("content,needle", [
    ("arrival_time,prompt_tokens,output_tokens\n0,99999999999999999999,5\n",
     ":2: prompt_tokens 99999999999999999999 is beyond"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [99999999999999999999]}\n',
     ":1: hash_ids must be a list of 64-bit integers"),
    ("arrival_time,prompt_tokens,output_tokens,tier\n0,5,5,\"" + "x" * 200_000 + "\"\n",
     ":2: malformed CSV: field larger than field limit"),
])
def test_trace_values_beyond_int64_or_csv_limits(tmp_path, content, needle):
    f = tmp_path / ("t.jsonl" if content.startswith("{") else "t.csv")
    f.write_text(content)
    args = ["workload", "stats", str(f)] + (["--keep-hashes"] if False else [])
    if content.startswith("{"):
        args = ["simulate", "--workload", str(f), "--num-requests", "1"]
        from kvsched.workload.readers import read_trace
        with pytest.raises(KvschedError, match="hash_ids must be a list of 64-bit integers"):
            read_trace(f, keep_hashes=True)
        return
    one_line_error(args, needle)


def test_file_without_newlines_is_read_in_bounded_memory(tmp_path):
    import tracemalloc
    from kvsched.workload import readers
    f = tmp_path / "nonl.csv"
    with open(f, "wb") as out:
        out.write(b"arrival_time,prompt_tokens,output_tokens\n")
        out.write(b"1" * (readers.MAX_LINE + 10))
    tracemalloc.start()
    with pytest.raises(KvschedError, match=r"nonl.csv:2: line longer than"):
        readers.read_trace(f)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * readers.MAX_LINE


@pytest.mark.parametrize("args,needle", [
    (["simulate", "--rate", "abc"], "Invalid value for '--rate'"),
    (["simulate", "--kv-capacity", "1.5"], "Invalid value for '--kv-capacity'"),
    (["theory", "stability"], "Missing option"),
    (["simulate", "--no-such-flag"], "No such option: --no-such-flag"),
    (["info", "--model", "qwen2-7b", "--gpu", "a30", "--memory-utilization", "1.5"],
     "memory utilization must be in (0, 1]"),
])
def test_usage_errors_are_one_line(args, needle):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert r.output.strip().count("\n") == 0 and needle in r.output, r.output   # info prints no table first


def test_cli_start_up_does_not_import_scipy_optimize():
    """`kvsched --help` stays fast (figures in benchmarks/bench_startup.py): scipy.optimize,
    0.35 s to import, loads only when a closed form needs a root."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, kvsched.cli; print('scipy.optimize' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_more_reproducers(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,10,5\n1,10,5\n")
    one_line_error(["simulate", "--trace", str(trace), "--arrivals", "replay:x1e-300"], "vanishes at t=")
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"arrival_time": 0, "prompt_tokens": 99999999999999999999, "output_tokens": 5}\n')
    one_line_error(["simulate", "--trace", str(jl)], "t.jsonl:1: prompt_tokens 99999999999999999999 is beyond")
    toml = tmp_path / "w.toml"
    toml.write_text('requests = 1000000000000\nprompt = "fixed:10"\noutput = "fixed:10"\narrivals = "poisson:5"\n')
    one_line_error(["simulate", "--workload", str(toml)], "1,000,000,000,000 requests need about")


def test_numpy_parameters_become_plain_numbers():
    import numpy as np
    from kvsched.workload import Uniform, synthetic
    w = synthetic(Uniform(1, 400), Uniform(1, 200), rate=20, n=200, seed=2)
    sc = Scenario(w, model="qwen2-7b", gpu="a30", kv_capacity=8192)
    plain = simulate(sc, "vllm-v1", {"max_num_batched_tokens": 4096, "max_num_seqs": 200}).summary
    numpy = simulate(sc, "vllm-v1", {"max_num_batched_tokens": np.uint64(4096), "max_num_seqs": np.int16(200)}).summary
    assert plain["mean_ttft_ms"] == numpy["mean_ttft_ms"]
    p = make_policy("sarathi", {"chunk_size": np.int16(256)}, get_gpu("a30"))
    assert type(p.chunk_size) is int
    assert make_policy("vllm-v1", {"reserve_full_prompt": np.False_}, get_gpu("a30")).reserve_full_prompt is False
    with pytest.raises(KvschedError, match="whole numbers stop at"):
        make_policy("orca", {"max_num_batched_tokens": np.uint64(2 ** 63)}, get_gpu("a30"))
