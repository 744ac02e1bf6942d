"""`kvsched sweep`: grid expansion (flags and grid files), the folder and its table, resuming
after a kill without repeating finished points, failing points recorded while the sweep goes
on, the same figures whatever --jobs, and the Ray backend."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsched import sweep as sw
from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.files import _alive, is_temporary
from kvsched.cli.run import _scoped_params

runner = CliRunner()
SMALL = ["--num-requests", "40"]


def sweep(*args: str):
    return runner.invoke(app, ["sweep", *args])


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def figures_only(table: list[dict[str, str]]) -> list[dict[str, str]]:
    """Rows without `seconds` (wall time, not a figure)."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in table]


def point_files(out: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime_ns) of each stored point."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "points").glob("*.json")}


# ---- the grid ---------------------------------------------------------------------------

def test_flags_expand_with_parameters_scoped_to_the_policies_having_them():
    raw = sw.from_flags("vllm-v1,sarathi", "2,4", "0-1", ["chunk_size=128,256", "max_num_seqs=8,16"])
    grid = sw.resolve(raw, _scoped_params)
    assert grid.params == {"vllm-v1": {"max_num_seqs": ["8", "16"]},
                           "sarathi": {"chunk_size": ["128", "256"], "max_num_seqs": ["8", "16"]}}
    points = [axes for _, axes in grid.expand()]
    assert len(points) == 2 * 2 * 2 + 4 * 2 * 2     # vllm-v1 has no chunk_size: not multiplied by it
    assert points[0] == {"policy": "vllm-v1", "rate": 2.0, "seed": 0, "params": {"max_num_seqs": 8}}
    assert points[1]["seed"] == 1 and points[2]["rate"] == 4.0           # seed innermost, then rate
    assert points[8] == {"policy": "sarathi", "rate": 2.0, "seed": 0, "params": {"chunk_size": 128, "max_num_seqs": 8}}


def test_a_scoped_axis_wins_over_the_unscoped_one():
    raw = sw.from_flags("sarathi,vllm-v1", "1", None, ["sarathi.max_num_seqs=4", "max_num_seqs=8,16"])
    grid = sw.resolve(raw, _scoped_params)
    assert grid.params == {"sarathi": {"max_num_seqs": ["4"]}, "vllm-v1": {"max_num_seqs": ["8", "16"]}}
    assert grid.seeds == [0]


@pytest.mark.parametrize("spec, seeds", [("0-3", [0, 1, 2, 3]), ("0,2,5", [0, 2, 5]), ("0-1,7", [0, 1, 7]),
                                         ("4", [4])])
def test_seed_forms(spec, seeds):
    assert sw.parse_seeds(spec, "--seeds") == seeds


def test_grid_file_axes_and_settings(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('policies = ["vllm-v1", "sarathi"]\nrates = [1, 2.5]\nseeds = "0-1"\n'
                    'gpu = ["a100-80gb", "h100-sxm"]\nnum-requests = 40\n'
                    '[set]\n"sarathi.chunk_size" = [256, 512]\n')
    from kvsched.cli.sweep import AXIS_KINDS
    raw = sw.read_grid_file(path, AXIS_KINDS)
    assert raw.rates == [1.0, 2.5] and raw.seeds == [0, 1]
    assert raw.options == {"gpu": ["a100-80gb", "h100-sxm"]} and raw.settings == {"num_requests": 40}
    grid = sw.resolve(raw, _scoped_params)
    assert len(list(grid.expand())) == (1 + 2) * 2 * 2 * 2
    out = tmp_path / "out"
    r = sweep("--grid", str(path), "--out", str(out), "--jobs", "2")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "sweep.json").read_text())
    keys = meta.pop("keys")
    assert len(set(keys)) == 24 and {p.stem for p in (out / "points").glob("*.json")} == set(keys)
    assert meta == {"kind": "sweep", "version": 1, "points": 24,
                    "axes": {"policy": ["vllm-v1", "sarathi"], "rate": [1.0, 2.5], "seed": [0, 1],
                             "params": {"sarathi": {"chunk_size": [256, 512]}}, "gpu": ["a100-80gb", "h100-sxm"]}}
    table = rows(out / "sweep.csv")
    assert list(table[0])[:8] == ["policy", "rate", "seed", "param.chunk_size", "gpu", "status", "error", "seconds"]
    assert {r["completed"] for r in table} == {"40"}                      # the setting applies everywhere
    assert [r["gpu"] for r in table[:8]] == ["a100-80gb"] * 4 + ["h100-sxm"] * 4


BAD_FILES = {
    "unknown-key": ('rates = [1]\nspeed = 3\n', "bad.toml: unknown key 'speed'"),
    "syntax": ('rates = [1\n', "bad.toml: not valid TOML"),
    "option-type": ('rates = [1]\nkv_capacity = [1.5]\n', "bad.toml: kv_capacity: 1.5 must be a whole number"),
    "empty-axis": ('rates = [1]\ngpu = []\n', "bad.toml: gpu: an axis needs at least one value"),
    "bad-gpu": ('rates = [1]\ngpu = ["a100-80gb", "tpu"]\n', "unknown GPU 'tpu'"),
    "both": ('rates = [1]\n', "rates are given both by --rates and in"),
    "bool-rate": ('rates = [10, true]\n', "bad.toml: rates: True is not a rate"),
    "memory": ('rates = [1]\nmemory_utilization = [0.9, 1.5]\n',
               "bad.toml: memory_utilization = 1.5: --memory-utilization must be in (0, 1], got 1.5"),
    "kv-zero": ('rates = [1]\nkv_capacity = [20000, 0]\n', "--kv-capacity must be >= 1"),
    "block-zero": ('rates = [1]\nblock_size = [16, 0]\n', "--block-size must be >= 1"),
    "model-len": ('rates = [1]\nmax_model_len = [4096, -1]\n', "--max-model-len must be >= 1"),
    "cap-len": ('rates = [1]\ncap_len = [100, 0]\n', "--cap-len must be an integer >= 2"),
    "kv-below-block": ('rates = [1]\nkv_capacity = [20000, 10]\n',
                       "bad.toml: kv_capacity = 10: --kv-capacity (10 tokens) is smaller than one block (16 tokens)"),
    "no-trace": ('rates = [1]\ntrace = "no-such-trace.csv"\n', "bad.toml: trace 'no-such-trace.csv' not found: no such file"),
    "closed-file": ('rates = [1]\narrivals = ["poisson:2", "closed:4"]\n',
                    'bad.toml: arrivals = "closed:4": a sweep\'s rates need open-loop arrivals'),
    "decode-policy": ('rates = [1]\nprefill_replicas = 1\ndecode_replicas = 1\ndecode_policy = ["sarathi", "fifo"]\n',
                      'decode_policy = "fifo": --decode-policy: unknown policy \'fifo\''),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_grid_files_are_errors_before_any_work(tmp_path, name):
    text, message = BAD_FILES[name]
    (tmp_path / "bad.toml").write_text(text)
    out = tmp_path / "out"
    r = sweep("--grid", str(tmp_path / "bad.toml"), "--out", str(out), *(["--rates", "2"] if name == "both" else []))
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


BAD_FLAGS = {
    "rate": (["--rates", "1,fast"], "--rates: 'fast' is not a number"),
    "negative-rate": (["--rates", "1,-2"], "--rates must be a finite number > 0"),
    "no-rates": ([], "a sweep needs rates"),
    "policy": (["--rates", "1", "--policies", "vllm-v1,fifo"], "unknown policy 'fifo'"),
    "seeds": (["--rates", "1", "--seeds", "0-x"], "--seeds: '0-x' is not a seed"),
    "twice": (["--rates", "1,1"], "--rates: 1.0 is given twice"),
    "param": (["--rates", "1", "--set", "chunk=1,2"], "no compared policy has parameter 'chunk'"),
    "scoped-param": (["--rates", "1", "--policies", "sarathi", "--set", "sarathi.chunk=1"],
                     "sarathi has no parameter 'chunk'"),
    "rate-flag": (["--rates", "1", "--rate", "3"], "not --rate"),
    "backend": (["--rates", "1", "--backend", "dask"], "--backend must be one of process, ray"),
    "workload": (["--rates", "1", "--workload", "no-such-preset"], "unknown workload 'no-such-preset'"),
    "trim": (["--rates", "1", "--trim", "-1"], "--trim must be >= 0"),
    "closed": (["--rates", "1", "--arrivals", "closed:4"], "need open-loop arrivals"),
    "huge-seeds": (["--rates", "1", "--seeds", "0-50000000"], "a sweep has at most 1,000,000 points"),
    "huge-seed-ranges": (["--rates", "1", "--seeds", "0-999999,1000000-1999999"],     # added up before building
                         "--seeds: 0-999999,1000000-1999999 is 2,000,000 seeds; a sweep has at most 1,000,000"),
    "decode-set": (["--rates", "1", "--prefill-replicas", "1", "--decode-replicas", "1", "--decode-set", "chunk=1"],
                   "--decode-set chunk: vllm-v1 has no parameter 'chunk'"),
    "huge-grid": (["--rates", ",".join(str(r) for r in range(1, 1201)), "--seeds", "0-999"],
                  "the grid's points (policies x parameter values x option values x rates x seeds) must be "
                  "<= 1,000,000 (kvsched.limits), got 1,200,000"),
    "set-twice": (["--rates", "1", "--set", "max_num_seqs=4", "--set", "max_num_seqs=8"],
                  "--set max_num_seqs is given twice"),
}


@pytest.mark.parametrize("name", BAD_FLAGS)
def test_bad_flags_are_errors_before_any_work(tmp_path, name):
    args, message = BAD_FLAGS[name]
    out = tmp_path / "out"
    r = sweep(*args, "--out", str(out))
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_an_option_spelt_both_ways_in_a_grid_file_is_an_error(tmp_path):
    """num-requests and num_requests are one key: the later one was silently used."""
    (tmp_path / "g.toml").write_text('rates = [1]\nnum-requests = [10]\nnum_requests = [20]\n')
    out = tmp_path / "out"
    r = sweep("--grid", str(tmp_path / "g.toml"), "--out", str(out))
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr == f"kvsched: error: {tmp_path / 'g.toml'}: 'num-requests' and 'num_requests' are the same key; give it once\n"


def test_a_flag_at_its_default_beside_its_grid_axis_is_an_error(tmp_path):
    """--gpu at its default value and a gpu axis in the grid: the flag was silently dropped."""
    from kvsched.cli.common import HARDWARE_FLAGS
    default = HARDWARE_FLAGS["gpu"][1].default
    (tmp_path / "g.toml").write_text(f'rates = [1]\ngpu = ["{default}", "h100-sxm"]\n')
    out = tmp_path / "out"
    r = sweep("--gpu", default, "--grid", str(tmp_path / "g.toml"), "--out", str(out))
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr == f"kvsched: error: gpu is given both on the command line and in {tmp_path / 'g.toml'}; give it once\n"


def test_every_option_spelt_both_ways_is_an_error(tmp_path):
    from kvsched.cli.sweep import AXIS_KINDS
    names = [n for n in AXIS_KINDS if "_" in n]
    assert "num_requests" in names and len(names) > 10
    for name in names:
        path = tmp_path / f"{name}.toml"
        path.write_text(f'{name} = 1\n{name.replace("_", "-")} = 2\n')
        with pytest.raises(KvschedError, match=f"'{name}' and '{name.replace('_', '-')}' are the same key"):
            sw.read_grid_file(path, AXIS_KINDS)


def test_the_grid_size_is_checked_against_the_shared_limit_before_any_point_is_built(monkeypatch):
    from kvsched import limits

    def built(self):
        raise AssertionError("points built before the size check")
    monkeypatch.setattr(limits, "MAX_SWEEP_POINTS", 10)
    monkeypatch.setattr(sw.Grid, "expand", built)
    raw = sw.from_flags("vllm-v1,sarathi", "1,2", "0-2", [])           # 2 x 2 x 3 = 12 points
    with pytest.raises(KvschedError, match=r"must be <= 10 \(kvsched.limits\), got 12"):
        sw.resolve(raw, _scoped_params)
    with pytest.raises(KvschedError, match=r"--seeds: 0-10 is 11 seeds; a sweep has at most 10 points"):
        sw.parse_seeds("0-10", "--seeds")


def test_a_trace_is_read_before_any_work(tmp_path):
    """A trace setting is read up front, as a point reads it: a malformed row or an empty
    window is the user's error (exit 2, nothing written), not a failure of every point."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0.0,100,20\n0.5,abc,30\n")
    out = tmp_path / "out"
    r = sweep("--rates", "1", "--trace", str(trace), "--out", str(out))
    assert r.exit_code == 2 and r.stderr == f"kvsched: error: {trace}:3: prompt_tokens 'abc' is not a number\n"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0.0,100,20\n0.5,120,30\n")
    (tmp_path / "g.toml").write_text('window = ["0:1", "100:200"]\n')
    r = sweep("--rates", "1", "--trace", str(trace), "--grid", str(tmp_path / "g.toml"), "--out", str(out))
    assert r.exit_code == 2 and 'g.toml: window = "100:200": ' in r.stderr and "no requests in the time window" in r.stderr
    assert not out.exists()


def test_a_foreign_folder_is_refused_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = sweep("--rates", "2", *SMALL, "--out", str(tmp_path))
    assert r.exit_code == 2 and "holds no sweep" in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# ---- the folder and the table --------------------------------------------------------------

def small_grid(out):
    r = sweep("--policies", "vllm-v1,orca", "--rates", "2,6", "--seeds", "0-1", "--set", "max_num_seqs=4,64",
              *SMALL, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_folder_and_table(tmp_path):
    out = tmp_path / "s"
    summary = small_grid(out)
    assert summary["points"] == summary["done"] == 16 and summary["skipped"] == summary["failed"] == 0
    assert summary["tables"][0] == str(out / "sweep.csv")      # sweep.parquet with the parquet extra
    table = rows(out / "sweep.csv")
    columns = list(table[0])
    assert columns[:7] == ["policy", "rate", "seed", "param.max_num_seqs", "status", "error", "seconds"]
    assert "mean_ttft_ms" in columns and "ttft_quantiles_ms" not in columns and "timeline" not in columns
    assert [(r["policy"], r["param.max_num_seqs"], r["rate"], r["seed"]) for r in table[:5]] == [
        ("vllm-v1", "4", "2.0", "0"), ("vllm-v1", "4", "2.0", "1"), ("vllm-v1", "4", "6.0", "0"),
        ("vllm-v1", "4", "6.0", "1"), ("vllm-v1", "64", "2.0", "0")]
    stored = [json.loads(p.read_text()) for p in (out / "points").glob("*.json")]
    assert len(stored) == 16 and {len(s["key"]) for s in stored} == {sw.KEY_LENGTH}
    one = stored[0]
    assert set(one) == {"key", "axes", "status", "error", "seconds", "figures"}
    assert set(one["axes"]) == {"policy", "rate", "seed", "params"}
    assert len(one["figures"]["ttft_quantiles_ms"]) == 101 and one["figures"]["timeline"]


@pytest.mark.parquet
def test_parquet_table(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "s"
    assert small_grid(out)["tables"] == [str(out / "sweep.csv"), str(out / "sweep.parquet")]
    table = rows(out / "sweep.csv")
    data = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [d["mean_ttft_ms"] for d in data] == [float(r["mean_ttft_ms"]) for r in table]
    assert [d["param.max_num_seqs"] for d in data][:5] == [4, 4, 4, 4, 64]


def test_failing_points_are_recorded_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "s"
    # chunk_size=0 is outside sarathi's range; llama-2-13b does not fit an a30: both fail only their points
    grid = tmp_path / "g.toml"
    grid.write_text('gpu = ["a100-80gb", "a30"]\n')
    r = sweep("--policies", "sarathi", "--rates", "2,4", "--set", "chunk_size=256,0", "--model", "llama-2-13b",
              "--grid", str(grid), *SMALL, "--out", str(out))
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("kvsched: warning: 6 of 8 points failed (first: sarathi at rate 2, seed 0: ")
    table = rows(out / "sweep.csv")
    ok = [r for r in table if r["status"] == "ok"]
    assert [(r["param.chunk_size"], r["gpu"]) for r in ok] == [("256", "a100-80gb")] * 2
    assert all(float(r["mean_ttft_ms"]) > 0 for r in ok)
    errors = {(r["param.chunk_size"], r["gpu"]): r["error"] for r in table if r["status"] == "error"}
    assert "chunk_size=0 is outside its range" in errors[("0", "a100-80gb")]
    assert "do not fit in 90% of a30" in errors[("256", "a30")]
    assert all(r["mean_ttft_ms"] == "" for r in table if r["status"] == "error")
    assert len(point_files(out)) == 8
    before = point_files(out)           # a re-run keeps failed points (deterministic) ...
    r = sweep("--policies", "sarathi", "--rates", "2,4", "--set", "chunk_size=256,0", "--model", "llama-2-13b",
              "--grid", str(grid), *SMALL, "--out", str(out), "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["skipped"] == 8 and point_files(out) == before
    r = sweep("--policies", "sarathi", "--rates", "2,4", "--set", "chunk_size=256,0", "--model", "llama-2-13b",
              "--grid", str(grid), *SMALL, "--out", str(out), "--json", "--retry-failed")   # ... unless asked
    assert r.exit_code == 1 and json.loads(r.stdout)["done"] == 6
    ok_files = {k for k in before if json.loads((out / "points" / k).read_text())["status"] == "ok"}
    assert len(ok_files) == 2 and all(point_files(out)[k] == before[k] for k in ok_files)


def test_planned_keys_are_the_points_keys(tmp_path):
    """plan() computes each setting's share of the key once: the keys are point_key's."""
    (tmp_path / "g.toml").write_text('gpu = ["a100-80gb", "h100-sxm"]\nnum_requests = [40, 50]\n')
    from kvsched.cli.sweep import AXIS_KINDS
    raw = sw.merge(sw.from_flags("vllm-v1,sarathi", "1,2", "0-1", ["sarathi.chunk_size=256,512"]),
                   sw.read_grid_file(tmp_path / "g.toml", AXIS_KINDS), set())
    grid = sw.resolve(raw, _scoped_params)
    from kvsched.cli.common import CLUSTER_FLAGS, HARDWARE_FLAGS, ClusterOptions, HardwareOptions
    from kvsched.workload.source import WorkloadOptions
    hw = HardwareOptions(**{name: opt.default for name, (_, opt) in HARDWARE_FLAGS.items()})
    cl = ClusterOptions(**{name: opt.default for name, (_, opt) in CLUSTER_FLAGS.items()})
    tasks = sw.plan(grid, sw.Base(WorkloadOptions(), hw, cl))
    assert len(tasks) == 3 * 2 * 2 * 2 * 2 == len({t.key for t in tasks})
    assert [t.key for t in tasks] == [sw.point_key(t.point) for t in tasks]


def test_keys_follow_the_definition(tmp_path):
    out = tmp_path / "s"
    args = ["--policies", "orca", "--rates", "3", "--seeds", "0-1", "--out", str(out), "--json"]
    assert sweep(*args, *SMALL).exit_code == 0
    again = json.loads(sweep(*args, *SMALL).stdout)
    assert (again["done"], again["skipped"]) == (0, 2)
    changed = json.loads(sweep(*args, "--num-requests", "30").stdout)        # a changed flag: new points
    assert (changed["done"], changed["skipped"]) == (2, 0)
    assert len(point_files(out)) == 4 and len(rows(out / "sweep.csv")) == 2


def test_same_figures_whatever_jobs(tmp_path):
    args = ["--policies", "vllm-v1,sarathi", "--rates", "2,8", "--seeds", "0-2", *SMALL, "--json"]
    for jobs in ("1", "2"):
        assert sweep(*args, "--jobs", jobs, "--out", str(tmp_path / jobs)).exit_code == 0
    one, two = ({p.name: json.loads(p.read_text()) for p in (tmp_path / j / "points").glob("*.json")}
                for j in ("1", "2"))
    assert one.keys() == two.keys() and len(one) == 12
    assert all(one[k]["figures"] == two[k]["figures"] for k in one)
    assert figures_only(rows(tmp_path / "1" / "sweep.csv")) == figures_only(rows(tmp_path / "2" / "sweep.csv"))


@pytest.mark.parquet
def test_same_parquet_whatever_jobs(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    args = ["--policies", "vllm-v1,sarathi", "--rates", "2,8", "--seeds", "0-2", *SMALL, "--json"]
    for jobs in ("1", "2"):
        assert sweep(*args, "--jobs", jobs, "--out", str(tmp_path / jobs)).exit_code == 0
    # seconds: the one column that differs (docs/sweep.md)
    one, two = (pq.read_table(tmp_path / j / "sweep.parquet").drop(["seconds"]) for j in ("1", "2"))
    assert one.equals(two) and one.num_rows == 12


def test_a_point_is_the_simulate_run(tmp_path):
    """Bit for bit: a point's figures are simulate's summary at that policy, rate and seed."""
    common = ["--set", "chunk_size=128", "--num-requests", "40", "--replicas", "2", "--router", "random", "--json"]
    r = sweep("--policies", "sarathi", "--rates", "3", "--seeds", "5", *common, "--out", str(tmp_path / "s"))
    assert r.exit_code == 0, r.output
    [point] = [json.loads(p.read_text()) for p in (tmp_path / "s" / "points").glob("*.json")]
    r = runner.invoke(app, ["simulate", "--policy", "sarathi", "--rate", "3", "--seed", "5", *common])
    summary = json.loads(r.stdout)
    scalars = {k: v for k, v in point["figures"].items() if not isinstance(v, list)}
    assert len(scalars) > 30 and all(summary[k] == v for k, v in scalars.items())


# ---- resuming after a kill -------------------------------------------------------------------

KILL_GRID = ["--policies", "vllm-v1,sarathi", "--rates", "1,2,4,8", "--seeds", "0-2", "--num-requests", "300"]


def test_a_killed_sweep_resumes_without_repeating_finished_points(tmp_path):
    out, ref = tmp_path / "killed", tmp_path / "whole"
    total = 24
    proc = subprocess.Popen([sys.executable, "-m", "kvsched", "sweep", *KILL_GRID, "--jobs", "1", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(point_files(out)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    time.sleep(0.6)                     # orphaned workers notice and exit; nothing else writes
    before = point_files(out)
    assert 3 <= len(before) < total, "the sweep finished before the kill: make KILL_GRID larger"
    r = sweep(*KILL_GRID, "--jobs", "2", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (summary["points"], summary["skipped"], summary["done"]) == (total, len(before), total - len(before))
    after = point_files(out)
    assert len(after) == total and all(after[name] == before[name] for name in before)    # not recomputed
    # no temporary files but a writer's the kill interrupted mid-write: files.stale_temporaries
    # removes one only once it is STALE_AFTER old (a younger one may be a live writer's elsewhere)
    left = [(p.name, is_temporary(p.name, None, ".tmp")) for p in out.rglob(".*") if p.is_file()]
    assert all(m is not None and not _alive(int(m.group(1))) for _, m in left), left
    r = sweep(*KILL_GRID, "--jobs", "2", "--out", str(ref), "--json")
    assert r.exit_code == 0, r.output
    assert figures_only(rows(out / "sweep.csv")) == figures_only(rows(ref / "sweep.csv"))


def _drop(key: str):
    return lambda r: r.pop(key)


INCOMPLETE = {
    "no-figures": _drop("figures"),
    "figures-text": lambda r: r.update(figures="x"),
    "figures-null": lambda r: r.update(figures=None),
    "figure-text": lambda r: r["figures"].update(request_throughput="fast"),
    "quantiles-short": lambda r: r["figures"].update(ttft_quantiles_ms=[1.0]),
    "no-status": _drop("status"),
    "status-number": lambda r: r.update(status=1),
    "error-without-message": lambda r: r.update(status="error", error=None),
    "no-error": _drop("error"),
    "no-seconds": _drop("seconds"),
    "seconds-text": lambda r: r.update(seconds="1"),
    "no-axes": _drop("axes"),
    "axes-text": lambda r: r.update(axes="x"),
    "axes-params-list": lambda r: r["axes"].update(params=[]),
    "axes-seed-bool": lambda r: r["axes"].update(seed=False),
    "axes-other-rate": lambda r: r["axes"].update(rate=3.0),
    "not-an-object": lambda r: r.clear(),
    # JSON integers of 401 digits: math.isfinite raised OverflowError through Store.load
    "figure-huge-integer": lambda r: r["figures"].update(completed=10 ** 400),
    "seconds-huge-integer": lambda r: r.update(seconds=10 ** 400),
    "count-negative": lambda r: r["figures"].update(completed=-5),
}


@pytest.fixture(scope="module")
def one_point(tmp_path_factory) -> tuple[Path, dict]:
    """A sweep of one point: its folder and record."""
    out = tmp_path_factory.mktemp("one") / "s"
    assert sweep("--rates", "2", "--num-requests", "20", "--jobs", "1", "--out", str(out)).exit_code == 0
    [path] = (out / "points").glob("*.json")
    return out, json.loads(path.read_text())


@pytest.mark.parametrize("name", INCOMPLETE)
def test_a_point_file_missing_a_field_is_not_a_finished_point(tmp_path, one_point, name):
    key, axes = one_point[1]["key"], one_point[1]["axes"]
    store = sw.Store(tmp_path)
    store.points.mkdir()
    record = json.loads(json.dumps(one_point[1]))
    store.save(record)
    assert store.load(key, axes) == record
    INCOMPLETE[name](record)
    store.save({**record, "key": key})
    assert store.load(key, axes) is None


def test_a_resumed_sweep_runs_a_point_file_missing_its_figures_again(tmp_path, one_point):
    """It was loaded as finished and the table failed with KeyError: 'figures'."""
    import shutil
    out = tmp_path / "s"
    shutil.copytree(one_point[0], out)
    [path] = (out / "points").glob("*.json")
    record = json.loads(path.read_text())
    del record["figures"]
    path.write_text(json.dumps(record))
    r = sweep("--rates", "2", "--num-requests", "20", "--jobs", "1", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["done"], json.loads(r.stdout)["skipped"]) == (1, 0)
    assert json.loads(path.read_text()) == {**one_point[1], "seconds": json.loads(path.read_text())["seconds"]}
    assert rows(out / "sweep.csv")[0]["completed"] == "20"


def test_a_resumed_sweep_runs_a_point_with_a_huge_integer_again(tmp_path, one_point):
    """A figure of 401 digits: the resume crashed with OverflowError; now the point runs again."""
    import shutil
    out = tmp_path / "s"
    shutil.copytree(one_point[0], out)
    [path] = (out / "points").glob("*.json")
    path.write_text(json.dumps({**one_point[1], "figures": {**one_point[1]["figures"], "completed": 10 ** 400}}))
    r = sweep("--rates", "2", "--num-requests", "20", "--jobs", "1", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["done"], json.loads(r.stdout)["skipped"]) == (1, 0)
    assert json.loads(path.read_text())["figures"]["completed"] == 20


# ---- Ray -------------------------------------------------------------------------------------

def test_ray_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)       # `import ray` raises ImportError
    r = sweep("--rates", "2", *SMALL, "--backend", "ray", "--out", str(tmp_path / "s"))
    assert r.exit_code == 2 and r.stderr == "kvsched: error: --backend ray needs Ray: pip install 'kvsched[ray]'\n"
    assert not (tmp_path / "s").exists()


def test_a_module_named_ray_that_is_not_ray_is_one_line(tmp_path, monkeypatch):
    """Ray keeps its session files in /tmp/ray: seen from /tmp, `import ray` finds that folder."""
    import types
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    r = sweep("--rates", "2", *SMALL, "--backend", "ray", "--out", str(tmp_path / "s"))
    assert r.exit_code == 2 and "which is not Ray" in r.stderr and r.stderr.count("\n") == 1, r.output
    assert not (tmp_path / "s").exists()


@pytest.mark.ray
def test_ray_backend_runs_the_same_grid(tmp_path):
    if getattr(pytest.importorskip("ray"), "__file__", None) is None:
        pytest.skip("only a folder named ray on the path (Ray's own /tmp/ray, seen from /tmp), not Ray")
    args = ["--policies", "vllm-v1,orca", "--rates", "2,6", *SMALL, "--json", "--jobs", "2"]
    r = sweep(*args, "--backend", "ray", "--out", str(tmp_path / "ray"))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["done"] == 4
    assert sweep(*args, "--out", str(tmp_path / "proc")).exit_code == 0
    assert figures_only(rows(tmp_path / "ray" / "sweep.csv")) == figures_only(rows(tmp_path / "proc" / "sweep.csv"))


def test_report_leaves_the_folder_resumable_and_shows_only_the_current_grid(tmp_path):
    """`kvsched report` adds report.html to a sweep's folder: a re-run still resumes it. After
    a re-run with a smaller grid, the report shows that grid's points only."""
    out = tmp_path / "sw"
    assert sweep("--policies", "vllm-v1,sarathi", "--rates", "2,4", *SMALL, "--out", str(out)).exit_code == 0
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    r = sweep("--policies", "vllm-v1", "--rates", "2", *SMALL, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["skipped"] == 1
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["points"] == len(meta["keys"]) == 1 and len(list((out / "points").glob("*.json"))) == 4
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    page = (out / "report.html").read_text()
    assert "1 points of the grid in sweep.json" in page and "sarathi" not in page
    for stranger in (out / "notes.txt", out / "points" / "notes.txt"):     # other files are still refused
        stranger.write_text("mine")
        r = sweep("--policies", "vllm-v1", "--rates", "2", *SMALL, "--out", str(out))
        assert r.exit_code == 2 and f"{stranger.relative_to(out)} is not a sweep's" in r.stderr, r.output
        stranger.unlink()


def test_a_grid_varies_gpu_tp_and_formats(tmp_path):
    """Issue "Today's deployments", item 7: GPU, TP and the number formats are sweep axes; a
    bad value in one is an error before any point runs."""
    path = tmp_path / "grid.toml"
    path.write_text('policies = "vllm-v1"\nrates = [4]\nmodel = "llama-3.1-8b"\nnum-requests = 60\n'
                    'gpu = ["h100-sxm", "l40s"]\ntp = [1, 2]\nweight-dtype = ["bf16", "fp8"]\n')
    out = tmp_path / "out"
    r = sweep("--grid", str(path), "--out", str(out), "--jobs", "1")
    assert r.exit_code == 0, r.output
    table = rows(out / "sweep.csv")
    assert len(table) == 8 and {r["completed"] for r in table} == {"60"}
    tpot = {(r["gpu"], r["tp"], r["weight_dtype"]): float(r["mean_tpot_ms"]) for r in table}
    for gpu in ("h100-sxm", "l40s"):
        assert tpot[gpu, "2", "bf16"] < tpot[gpu, "1", "bf16"] and tpot[gpu, "1", "fp8"] < tpot[gpu, "1", "bf16"]
    path.write_text('policies = "vllm-v1"\nrates = [4]\ntp = [1, 3]\n')
    bad = sweep("--grid", str(path), "--out", str(tmp_path / "bad"))
    assert bad.exit_code == 2 and "does not divide" in bad.output and not (tmp_path / "bad" / "points").exists()
