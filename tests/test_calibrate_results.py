"""`kvsched calibrate --bench-serve / --inference-perf`: constants recovered from simulated
result files, the files' rebuilt runs, bad input, and the step-log path left as it was
(kvsched.cost.results, kvsched.cost.results_fit; docs/calibration.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.client import ClientPath
from kvsched.cost import read_cost_file
from kvsched.cost.results import METRICS, read_bench_serve, read_inference_perf
from kvsched.hardware import get_gpu, get_model
from kvsched.run import Scenario, simulate
from kvsched.workload.request import Workload

runner = CliRunner()
HW = ["--model", "llama-3-8b", "--gpu", "h100-sxm"]
TRUE = {"overhead": 0.0025, "memory_efficiency": 0.65, "front_s": 0.008}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(200, 3000, n), rng.integers(20, 200, n)


def bench_serve_result(summary: dict, prompt: np.ndarray, output: np.ndarray, *, rate="inf",
                       concurrency: int | None = None, detailed: bool = True) -> dict:
    """What vllm/benchmarks/serve.py writes (`benchmark`'s result and `main`'s traffic keys) for a
    run kvsched simulated: kvsched's summary uses vLLM's metric names (mean_ttft_ms, ...)."""
    out = {"date": "20260101-000000", "backend": "vllm", "num_prompts": len(prompt), "request_rate": rate,
           "burstiness": 1.0, "max_concurrency": concurrency, "duration": summary["duration"],
           "completed": summary["completed"], "failed": 0, "total_input_tokens": summary["total_input"],
           "total_output_tokens": summary["total_output"], **{k: summary[k] for k in METRICS}}
    if detailed:
        out.update(input_lens=prompt.tolist(), output_lens=output.tolist())
    return out


def simulated_file(path: Path, n: int, concurrency: int, seed: int, constants: dict = TRUE) -> Path:
    """A bench-serve result file of a closed-loop run kvsched simulated at `constants`."""
    prompt, output = lengths(n, seed)
    w = Workload.build(np.zeros(n), prompt, output, concurrency=concurrency)
    sc = Scenario(w, model="llama-3-8b", gpu="h100-sxm",
                  cost_params={k: v for k, v in constants.items() if k != "front_s"},
                  client=ClientPath(front_s=constants["front_s"]))
    summary = simulate(sc, "vllm-v1", {}).summary
    path.write_text(json.dumps(bench_serve_result(summary, prompt, output, concurrency=concurrency)))
    return path


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("runs")
    return [simulated_file(d / "c1.json", 12, 1, seed=1), simulated_file(d / "c48.json", 96, 48, seed=2)]


# -- the Done-when test ----------------------------------------------------------------------

def test_bench_serve_files_give_back_the_constants_of_a_simulated_run(two_runs, tmp_path):
    out = tmp_path / "fit.json"
    r = invoke("calibrate", "--bench-serve", two_runs[0], "--bench-serve", two_runs[1], *HW, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    for k, v in TRUE.items():
        assert s["params"][k] == pytest.approx(v, rel=0.02), k
    assert s["defaults"]["overhead"] != TRUE["overhead"]            # the defaults are elsewhere
    for f in s["files"]:
        for m in f["metrics"].values():
            assert abs(m["fitted_error"]) < 0.01
    cost, params = read_cost_file(out, get_model("llama-3-8b"), get_gpu("h100-sxm"))
    assert cost == "roofline" and params["overhead"] == pytest.approx(TRUE["overhead"], rel=0.02)
    assert any(f.startswith("--client-path front_s=0.008") for f in s["flags"])


def test_fit_chosen_constants_and_output_is_deterministic(two_runs):
    args = ["calibrate", "--bench-serve", two_runs[0], *HW, "--fit", "overhead", "--json"]
    a, b = invoke(*args), invoke(*args)
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout
    s = json.loads(a.stdout)
    assert s["fit"] == ["overhead"] and s["params"]["memory_efficiency"] == s["defaults"]["memory_efficiency"]
    table = invoke(*args[:-1])
    assert table.exit_code == 0 and "simulate with: --cost-set overhead=" in " ".join(table.stdout.split())


# -- the rebuilt runs ------------------------------------------------------------------------

def test_open_loop_rebuilt_as_vllm_sends_it(tmp_path):
    prompt, output = lengths(50, 3)
    summary = {"duration": 1.0, "completed": 50, "total_input": int(prompt.sum()), "total_output": int(output.sum()),
               **{k: 10.0 for k in METRICS}}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(bench_serve_result(summary, prompt, output, rate=4.0, detailed=False)))
    run = read_bench_serve(p)
    w = run.workload
    assert len(w) == 50 and not w.closed_loop and run.lengths == "means"
    assert w.arrival[-1] == pytest.approx(50 / 4.0)                 # scaled so the last is sent at n / rate
    assert set(w.prompt.tolist()) == {round(prompt.sum() / 50)}
    assert np.array_equal(read_bench_serve(p).workload.arrival, w.arrival)      # seeded: the same every time
    data = json.loads(p.read_text())
    p.write_text(json.dumps(data).replace('"burstiness": 1.0', '"burstiness": Infinity'))
    assert np.allclose(np.diff(read_bench_serve(p).workload.arrival), 0.25)      # constant gaps 1 / rate
    p.write_text(json.dumps({**data, "request_rate": "inf"}))
    assert read_bench_serve(p).workload.arrival.max() == 0


def test_save_detailed_start_times_are_the_send_times(tmp_path):
    """--save-detailed's start_times (perf_counter at each send) become the arrivals, from the
    first; a failed request (output_lens 0) is left out with its send time; a run limited by
    both rate and concurrency is rebuilt from them."""
    prompt, output = np.array([100, 200, 300, 400]), np.array([10, 0, 30, 40])
    summary = {"duration": 1.0, "completed": 3, "total_input": 800, "total_output": 80, **{k: 10.0 for k in METRICS}}
    data = {**bench_serve_result(summary, prompt, output, rate=2.0, concurrency=2), "failed": 1,
            "start_times": [1000.5, 1000.25, 1001.75, 1001.0]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(data))
    run = read_bench_serve(p)
    assert run.workload.arrival.tolist() == [0.25, 0.75, 1.5] and run.workload.prompt.tolist() == [100, 400, 300]
    assert "start_times" in run.arrivals


INFERENCE_PERF = {   # inference_perf/reportgen/base.py summarize_requests at e8e0aa99 (seconds)
    "load_summary": {"count": 60, "schedule_delay": {"mean": 0.0004}, "send_duration": 59.7, "requested_rate": 1.0,
                     "achieved_rate": 1.0048},
    "successes": {"count": 60, "latency": {"request_latency": {"mean": 0.483}, "normalized_time_per_output_token":
                                           {"mean": 0.0078}, "time_per_output_token": {"mean": 0.00348},
                                           "time_to_first_token": {"mean": 0.0333},
                                           "inter_token_latency": {"mean": 0.00348}},
                  "throughput": {"requests_per_sec": 0.997}, "prompt_len": {"mean": 200.68}, "output_len": {"mean": 62.35}},
    "failures": {"count": 0, "request_latency": None, "prompt_len": None}}


def test_inference_perf_stage_report_rebuilt(tmp_path):
    p = tmp_path / "stage_0_lifecycle_metrics.json"
    p.write_text(json.dumps(INFERENCE_PERF))
    run = read_inference_perf(p)
    assert len(run.workload) == 60 and run.workload.arrival[-1] == pytest.approx(60.0)
    assert set(run.workload.prompt.tolist()) == {201} and set(run.workload.output.tolist()) == {62}
    assert run.measured["mean_ttft_ms"] == pytest.approx(33.3) and run.measured["mean_e2el_ms"] == pytest.approx(483)
    newer = json.loads(json.dumps(INFERENCE_PERF))          # 7de5ef2: prompt_tokens, a concurrent stage
    newer["successes"]["prompt_tokens"] = newer["successes"].pop("prompt_len")
    newer["load_summary"]["concurrency"] = 8
    p.write_text(json.dumps(newer))
    assert read_inference_perf(p).workload.closed_loop


# -- bad input: one line, exit code 2, nothing written ------------------------------------------

GOOD = bench_serve_result({"duration": 1.0, "completed": 3, "total_input": 300, "total_output": 30,
                           **{k: 10.0 for k in METRICS}}, np.array([100, 100, 100]), np.array([10, 10, 10]))


@pytest.mark.parametrize("text,needle", [
    ("{not json", "r.json: not JSON"),
    ("[1, 2]", "r.json: not a result file"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "completed"}), "r.json: missing key completed"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "request_rate"}), "r.json: missing key request_rate"),
    (json.dumps({**GOOD, "completed": 0}), "r.json: completed is 0"),
    (json.dumps({**GOOD, "mean_ttft_ms": -1.0}), "r.json: mean_ttft_ms must be > 0"),
    (json.dumps(GOOD).replace('"mean_tpot_ms": 10.0', '"mean_tpot_ms": NaN'), "r.json: not JSON (NaN"),
    (json.dumps(GOOD).replace('"mean_tpot_ms": 10.0', '"mean_tpot_ms": Infinity'), "mean_tpot_ms must be a finite"),
    (json.dumps({**GOOD, "input_lens": [100, 100]}), "r.json: input_lens has 2 entries; completed + failed is 3"),
    (json.dumps({**GOOD, "output_lens": [10, "x", 10]}), "r.json: output_lens[1] must be a number"),
    (json.dumps({**GOOD, "request_rate": -2}), "r.json: request_rate must be >= 1e-06"),
    (json.dumps({**GOOD, "burstiness": 0}), "r.json: burstiness must be > 0"),
    (json.dumps({**GOOD, "max_concurrency": 1, "request_rate": 5}), "r.json: max_concurrency 1 with request_rate 5"),
    (json.dumps({k: v for k, v in GOOD.items() if k not in METRICS}), "r.json: missing key mean_ttft_ms"),
    (json.dumps({**GOOD, "ramp_up_strategy": "linear"}), "r.json: ramp_up_strategy 'linear'"),
    (json.dumps({**GOOD, "request_rate": 5, "start_times": [1.0, 2.0]}), "r.json: start_times must be a list of 3"),
    (json.dumps({**GOOD, "request_rate": 5, "start_times": [1.0, "x", 2.0]}), "r.json: start_times[1] must be a number"),
    (json.dumps({**GOOD, "request_rate": 5, "start_times": [1.0, 1e300, 2.0]}), "r.json: start_times span"),
])
def test_bad_bench_serve_file_is_one_line_exit_2(tmp_path, monkeypatch, text, needle):
    monkeypatch.chdir(tmp_path)
    Path("r.json").write_text(text)
    r = invoke("calibrate", "--bench-serve", "r.json", *HW, "--out", "fit.json")
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["successes"].update(count=0), "successes.count is 0"),
    (lambda d: d["load_summary"].pop("requested_rate"), "missing key load_summary.requested_rate"),
    (lambda d: d["successes"].pop("output_len"), "missing key successes.output_len"),
    (lambda d: d["successes"]["latency"]["time_to_first_token"].update(mean=None), "time_to_first_token.mean must be a number"),
])
def test_bad_inference_perf_file_is_one_line_exit_2(tmp_path, monkeypatch, change, needle):
    monkeypatch.chdir(tmp_path)
    data = json.loads(json.dumps(INFERENCE_PERF))
    change(data)
    Path("s.json").write_text(json.dumps(data))
    r = invoke("calibrate", "--inference-perf", "s.json", *HW)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,needle", [
    ([], "give a step log (STEPLOG), or result files"),
    (["steps.csv", "--bench-serve", "r.json"], "give one kind of source, not STEPLOG and --bench-serve"),
    (["--bench-serve", "r.json", "--inference-perf", "r.json"], "not --bench-serve and --inference-perf"),
    (["--bench-serve", "r.json"], "result files need --model and --gpu"),
    (["--bench-serve", "r.json", *HW, "--fit", "overhead,speed"], "--fit: unknown constant 'speed'"),
    (["--bench-serve", "r.json", *HW, "--num-gpu-blocks", "1"], "--num-gpu-blocks must be a whole number from 2"),
    (["--bench-serve", "r.json", *HW, "--models", "phase"], "--models goes with a step log"),
    (["--bench-serve", "none.json", *HW], "none.json: no such file"),
    (["--bench-serve", "r.json", *HW, "--out", "r.json"], "--out r.json is one of the result files"),
    (["steps.csv", "--tp", "2"], "--tp goes with --bench-serve or --inference-perf"),
    (["--bench-serve", "r.json", *HW, "--fit", "overhead,memory_efficiency,compute_efficiency,front_s,output_steps"],
     "the files hold 4 means for 5 constants"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    Path("r.json").write_text(json.dumps(GOOD))
    Path("steps.csv").write_text("")
    r = invoke("calibrate", *args)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "steps.csv"]


def test_num_gpu_blocks_sets_the_kv_capacity(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(GOOD))
    r = invoke("calibrate", "--bench-serve", p, *HW, "--num-gpu-blocks", "1001", "--fit", "overhead", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_capacity_tokens"] == 1000 * 16


# -- the step-log path is unchanged ------------------------------------------------------------

def test_step_log_path_unchanged(tmp_path):
    """STEPLOG alone gives what the library gives (kvsched.cost.calibrate), as before."""
    from kvsched.cost.calibrate import calibrate, read_step_log
    log = _step_log(tmp_path / "steps.csv")
    r = invoke("calibrate", log, "--json")
    assert r.exit_code == 0, r.output
    expected = {**calibrate(read_step_log(log), ["phase", "linear", "roofline", "tiled"]).as_dict(), "out": None}
    got = json.loads(r.stdout)
    assert got.pop("use") == expected["best"] == "phase"
    assert got == json.loads(json.dumps(expected))


def _step_log(path: Path) -> Path:
    """A small phase-model step log (tests/test_calibrate.py builds bigger ones)."""
    rows = ["step,prefill_tokens,prefill_chunks,prefill_attn,prefill_ctx,decodes,decode_context,chunks,"
            "kv_used_blocks,planned_tokens,tokens,seconds"]
    for i in range(1, 31):
        c, n = 50 * (i % 5 + 1), i % 7
        attn = int(c * (0 + (c + 1) / 2))
        rows.append(f"{i},{c},1,{attn},{c},{n},{n * 100},0:{c},0,{c + n},{c + n},{0.004 + 3e-5 * c + 5e-5 * n!r}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_memory_utilization_sizes_the_rebuilt_server(two_runs):
    """--memory-utilization goes to the memory profile of the simulated server (none given: 0.9)."""
    from kvsched.cost.results_fit import Setup, simulate_run
    from kvsched.cost.results import read_bench_serve
    run = read_bench_serve(two_runs[1])
    values = {"overhead": 0.0025, "memory_efficiency": 0.65, "compute_efficiency": 0.5, "front_s": 0.008,
              "output_steps": 1.0}
    full = simulate_run(run, Setup("llama-3-8b", "h100-sxm"), values)
    tight = simulate_run(run, Setup("llama-3-8b", "h100-sxm", memory_utilization=0.25), values)
    assert full != tight                                            # a smaller KV cache queues more
    r = invoke("calibrate", "--bench-serve", two_runs[0], *HW, "--memory-utilization", "1.5")
    assert r.exit_code == 2 and "--memory-utilization must be in (0, 1]" in r.output
    r = invoke("calibrate", "steps.csv", "--memory-utilization", "0.5")
    assert r.exit_code == 2 and "--memory-utilization goes with --bench-serve or --inference-perf" in r.output
