"""The `kvsched` command: outputs, and one-line errors with exit code 2 and nothing written."""
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvsched.cli import app

runner = CliRunner()
SMALL = ["--num-requests", "60", "--rate", "5"]


def invoke(*args):
    return runner.invoke(app, list(args))


def test_simulate_json_summary_has_vllm_names():
    r = invoke("simulate", *SMALL, "--json", "--goodput", "ttft:500", "--goodput", "tpot:100")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    for key in ("completed", "total_input", "total_output", "duration", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "mean_ttft_ms",
                "median_tpot_ms", "std_itl_ms", "p90_e2el_ms", "p99_itl_ms", "mean_kv_usage",
                "peak_kv_usage", "peak_queue_length", "preemptions", "iterations",
                "simulated_seconds", "wall_seconds", "rejected"):
        assert key in s
    assert s["completed"] == 60 and 0 <= s["request_goodput"] <= s["request_throughput"]


def test_out_writes_all_files(tmp_path):
    out = tmp_path / "run"
    r = invoke("simulate", *SMALL, "--policy", "sarathi", "--set", "chunk_size=256",
               "--out", str(out), "--record-batches", "--json")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == [".kvsched-run", "batches.csv", "requests.csv", "run.json",
                                                    "summary.json", "timeline.csv"]
    rows = (out / "batches.csv").read_text().splitlines()
    assert rows[0] == "start,duration,prefill_tokens,prefill_requests,decode_requests,kv_used_tokens"
    assert all(int(row.split(",")[2]) + int(row.split(",")[4]) <= 256 for row in rows[1:])
    assert len((out / "requests.csv").read_text().splitlines()) == 61
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.")]   # temp folder gone


def test_compare_table_and_scoped_set(tmp_path):
    r = invoke("compare", *SMALL, "--policies", "vllm-v1,sarathi", "--set", "sarathi.chunk_size=128",
               "--set", "max_num_seqs=16", "--json")
    assert r.exit_code == 0, r.output
    both = json.loads(r.stdout)
    assert set(both) == {"vllm-v1", "sarathi"}
    r = invoke("compare", *SMALL, "--policies", "vllm-v1,orca")
    assert r.exit_code == 0 and "vllm-v1" in r.stdout and "orca" in r.stdout


def test_policies_and_info_list_the_catalogue():
    r = invoke("policies")
    assert r.exit_code == 0
    for name in ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level", "chunk_size", "Algorithm 4"):
        assert name in r.stdout
    r = invoke("info", "--model", "qwen2-7b", "--gpu", "a30")
    assert r.exit_code == 0 and "KV capacity of qwen2-7b on a30" in r.stdout


def test_same_seed_same_result():
    a = json.loads(invoke("simulate", *SMALL, "--json", "--seed", "7").stdout)
    b = json.loads(invoke("simulate", *SMALL, "--json", "--seed", "7").stdout)
    c = json.loads(invoke("simulate", *SMALL, "--json", "--seed", "8").stdout)
    for s in (a, b, c):
        s.pop("wall_seconds")
    assert a == b and a != c


@pytest.mark.parametrize("args,needle", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--gpu", "tpu"], "unknown GPU 'tpu'"),
    (["--rate", "-1"], "--rate must be > 0"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--set", "max_num_seqs"], "--set expects key=value"),
    (["--set", "max_num_seqs=lots"], "max_num_seqs='lots' is not a valid int"),
    (["--set", "chunk=3"], "has no parameter 'chunk'"),
    (["--cost", "constant", "--cost-set", "b=-1"], "b must be > 0"),
    (["--cost", "quantum"], "unknown cost model 'quantum'"),
    (["--trace", "/no/such/file.csv"], "trace '/no/such/file.csv' not found: no such file"),
    (["--kv-capacity", "0"], "--kv-capacity must be >= 1"),
    (["--model", "llama-2-13b", "--gpu", "a30"], "do not fit"),
    (["--prompt-len", "zipf:3"], "unknown length distribution"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    out = tmp_path / "out"
    r = invoke("simulate", *SMALL, *args, "--out", str(out))
    assert r.exit_code == 2, r.output
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content,needle", [
    ("arrival_time,prompt_tokens,output_tokens\n0.0,10,5\n0.5,abc,5\n", ":3: prompt_tokens 'abc' is not a number"),
    ("arrival_time,prompt_tokens,output_tokens\n0.0,10,5\n0.5,10\n", ":3: expected 3 fields"),
    ("arrival_time,prompt_tokens,output_tokens\n-1,10,5\n", ":2: arrival_time must be a finite number >= 0"),
    ("arrival_time,prompt_tokens,output_tokens\n0,10,0\n", ":2: output_tokens must be an integer >= 1"),
    ("time,in,out\n0,1,1\n", ":1: unknown header"),
    ("", "empty file"),
    ("num_prefill_tokens,num_decode_tokens\n5,2.5\n", ":2: num_decode_tokens must be an integer >= 1"),
])
def test_malformed_trace_names_file_and_line(tmp_path, content, needle):
    trace = tmp_path / "t.csv"
    trace.write_text(content)
    out = tmp_path / "out"
    r = invoke("simulate", "--trace", str(trace), "--rate", "1", "--out", str(out))
    assert r.exit_code == 2, r.output
    assert str(trace) in r.stderr and needle in r.stderr
    assert not out.exists()


def test_length_only_trace_needs_rate(tmp_path):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n10,5,15,2\n")
    r = invoke("simulate", "--trace", str(trace))
    assert r.exit_code == 2 and "give --rate" in r.stderr


def test_unservable_requests_rejected_with_warning_or_strict_error(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,10,5\n0.1,500,100\n0.2,20,5\n")
    r = invoke("simulate", "--trace", str(trace), "--kv-capacity", "256", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["rejected"] == 1 and s["completed"] == 2
    assert "request 1 (prompt 500, output 100) needs 599 KV tokens" in r.stderr
    r = invoke("simulate", "--trace", str(trace), "--kv-capacity", "256", "--strict")
    assert r.exit_code == 2 and "can never be served" in r.stderr
    r = invoke("simulate", "--trace", str(trace), "--max-model-len", "100", "--json")
    assert json.loads(r.stdout)["rejected"] == 1


def test_console_script_runs_and_fails_cleanly():
    ok = subprocess.run([sys.executable, "-m", "kvsched", "simulate", *SMALL, "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["completed"] == 60 and ok.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "kvsched", "simulate", "--rate", "-3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr


def test_client_path_flag():
    """--client-path: the default adds the front end and output path to TTFT and E2E (engine_*
    keep the engine's), off reports the engine's own, key=value sets the terms; bad text exits 2."""
    default = json.loads(invoke("simulate", *SMALL, "--json").stdout)
    off = json.loads(invoke("simulate", *SMALL, "--json", "--client-path", "off").stdout)
    set_ = json.loads(invoke("simulate", *SMALL, "--json", "--client-path", "front_s=0.05,output_steps=0").stdout)
    assert off["mean_ttft_ms"] == default["engine_mean_ttft_ms"] < default["mean_ttft_ms"]
    assert set_["mean_ttft_ms"] == pytest.approx(off["mean_ttft_ms"] + 50)
    assert off["mean_itl_ms"] == default["mean_itl_ms"] == set_["mean_itl_ms"]
    for bad, message in [("speed=1", "write off, or key=value"), ("front_s=x", "must be a number"),
                         ("front_s=-1", "from 0 to 1000"), ("front_s=1,front_s=2", "given twice"),
                         ("front_s=1_0", "plain number")]:
        r = invoke("simulate", *SMALL, "--client-path", bad)
        assert r.exit_code == 2 and message in r.output, r.output
