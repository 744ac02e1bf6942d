"""--out holds exactly one run, written atomically; JSON is strict; results are byte-identical
across identical runs (issue "Hardening", part C)."""
import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import kvsched.run
from kvsched.cli import app

runner = CliRunner()
SMALL = ["--num-requests", "40", "--rate", "5"]


def files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_reused_folder_holds_exactly_the_new_run(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["compare", *SMALL, "--policies", "vllm-v1,sarathi", "--out", str(out),
                               "--record-batches"]).exit_code == 0
    assert "sarathi/batches.csv" in files(out)
    r = runner.invoke(app, ["simulate", *SMALL, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert files(out) == [".kvsched-run", "requests.csv", "run.json", "summary.json", "timeline.csv"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]        # no temp folders left


def test_folder_with_foreign_files_is_refused_and_kept(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    r = runner.invoke(app, ["simulate", *SMALL, "--out", str(out)])
    assert r.exit_code == 2 and "holds files kvsched did not write (notes.txt)" in r.output
    assert files(out) == ["notes.txt"]
    ours = tmp_path / "ours"
    assert runner.invoke(app, ["simulate", *SMALL, "--out", str(ours)]).exit_code == 0
    (ours / "extra.csv").write_text("added later")
    r = runner.invoke(app, ["simulate", *SMALL, "--out", str(ours)])
    assert r.exit_code == 2 and "extra.csv" in r.output and (ours / "extra.csv").exists()


def test_empty_out_name_refused():
    r = runner.invoke(app, ["simulate", *SMALL, "--out", ""])
    assert r.exit_code == 2 and "--out needs a folder name" in r.output


def test_strict_json_everywhere(tmp_path):
    out = tmp_path / "c"
    r = runner.invoke(app, ["compare", "--num-requests", "3", "--rate", "5", "--policies", "vllm-v1,sarathi",
                            "--replicas", "5", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    s = strict(r.stdout)
    assert s["vllm-v1"]["request_goodput"] is None
    assert any(row["mean_ttft_ms"] is None for row in s["vllm-v1"]["replica_breakdown"])   # idle replicas
    strict((out / "compare.json").read_text())
    strict((out / "vllm-v1" / "summary.json").read_text())


def test_results_byte_identical_across_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert runner.invoke(app, ["simulate", *SMALL, "--out", str(d), "--record-batches"]).exit_code == 0
    for name in ("summary.json", "requests.csv", "timeline.csv", "batches.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert "wall_seconds" in json.loads((a / "run.json").read_text())
    assert "wall_seconds" not in json.loads((a / "summary.json").read_text())


def test_sigterm_during_write_leaves_nothing(tmp_path):
    """A run killed by SIGTERM while --out is being written leaves no temporary folder and
    no partial output."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\n"
        "import kvsched.run as run\n"
        "orig = run.Result.write_files\n"
        "def slow(self, d):\n"
        "    orig(self, d)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(30)\n"
        "run.Result.write_files = slow\n"
        "from kvsched.cli import app\n"
        "sys.argv = ['kvsched', 'simulate', '--num-requests', '20', '--out', sys.argv[1]]\n"
        "app()\n")
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=20)
    assert p.returncode != 0
    assert not out.exists() and [x.name for x in tmp_path.iterdir()] == ["slow.py"]


def test_tier_name_with_newline_refused(tmp_path):
    r = runner.invoke(app, ["workload", "export", "--num-requests", "3", "--tier", "a\nb:1", "--out",
                            str(tmp_path / "x.csv")])
    assert r.exit_code == 2 and "no control characters" in r.output and not (tmp_path / "x.csv").exists()


def test_trace_from_a_pipe_with_rate(traces_dir):
    src = traces_dir / "sharegpt-vidur-10k-lengths.csv"
    cmd = f"{sys.executable} -m kvsched simulate --trace <(cat {src}) --rate 5 --num-requests 30 --json"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["completed"] == 30


def test_rowlog_spills_to_disk_and_reads_back_exactly(monkeypatch):
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 100)
    log = rowlog.RowLog(rowlog.TIMELINE.kinds)
    rows = [(k * 0.1 + 1e-9, k, -k, 2 ** 40 + k) for k in range(1050)]
    for k, row in enumerate(rows):
        log.append(row)
        if k % 7 == 0:
            log.check()
    log.check()
    assert len(log._rows) < 100 and log._spilled >= 900
    assert list(log) == rows and len(log) == 1050
    assert log[3] == rows[3] and log[-1] == rows[-1] and log[5:8] == rows[5:8]
    assert all(type(v) is int for v in log[0][1:])
    merged = list(rowlog.MergedRows([(0, log), (1, log)]))
    assert len(merged) == 2100 and merged[0] == (*rows[0], 0) and merged[1] == (*rows[0], 1)



def test_a_spilled_rowlog_closes_its_file_when_dropped(monkeypatch):
    """No 'unclosed file' ResourceWarning (the CLI prints warnings) when a run's logs go away."""
    import gc
    import warnings
    from kvsched.sim import rowlog
    monkeypatch.setattr(rowlog, "CHUNK", 10)
    log = rowlog.RowLog("fi")
    for k in range(25):
        log.append((0.5, k))
    log.check()
    f = log._file
    assert f is not None and not f.closed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del log
        gc.collect()
    assert f.closed

def test_out_edge_cases_from_review(tmp_path, monkeypatch):
    out = tmp_path / "f2"
    (out / "sub").mkdir(parents=True)               # an empty folder of the user's
    r = runner.invoke(app, ["simulate", *SMALL, "--out", str(out)])
    assert r.exit_code == 2 and "holds files kvsched did not write (sub)" in r.output and (out / "sub").is_dir()
    real = tmp_path / "real"
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    r = runner.invoke(app, ["simulate", *SMALL, "--out", str(link)])
    assert r.exit_code == 2 and "symbolic link" in r.output and link.is_symlink()
    r = runner.invoke(app, ["workload", "export", "--num-requests", "3", "--out", ""])
    assert r.exit_code == 2 and "must name a file" in r.output
    # stopped between the two renames: the previous run is put back
    import kvsched.run as run_mod
    prev = tmp_path / "prev"
    assert runner.invoke(app, ["simulate", *SMALL, "--out", str(prev)]).exit_code == 0
    before = (prev / "summary.json").read_bytes()
    real_replace = os.replace

    def flaky(src, dst):
        if str(dst) == str(prev):
            raise KeyboardInterrupt("stopped")
        return real_replace(src, dst)
    monkeypatch.setattr(run_mod.os, "replace", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_mod.write_atomically(prev, lambda d: (d / "summary.json").write_text("new"))
    monkeypatch.setattr(run_mod.os, "replace", real_replace)
    assert (prev / "summary.json").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_early_out_check_before_simulating(tmp_path, monkeypatch):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mine.txt").write_text("keep")

    def never(*args, **kwargs):
        raise AssertionError("simulated before checking --out")
    monkeypatch.setattr(kvsched.run, "simulate", never)
    r = runner.invoke(app, ["simulate", "--num-requests", "5000", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "simulated before" not in r.output, r.output
    assert (tmp_path / "x" / "mine.txt").read_text() == "keep"


def test_tier_names_with_outer_spaces_refused():
    r = runner.invoke(app, ["workload", "export", "--num-requests", "3", "--tier", " a :1", "--out", "x.csv"])
    assert r.exit_code == 2 and "without spaces at either end" in r.output


def test_requests_csv_is_the_same_whatever_the_write_chunk(tmp_path, monkeypatch):
    import kvsched.run as run_module
    from kvsched.run import Scenario, simulate
    from kvsched.workload.source import WorkloadOptions, load
    r = simulate(Scenario(load(WorkloadOptions(num_requests=900, rate=30, seed=2)), kv_capacity=20000,
                          replicas=2, router="least-kv"), "vllm-v1")
    r.write(tmp_path / "a")
    monkeypatch.setattr(run_module, "ROWS_PER_WRITE", 97)
    r.write(tmp_path / "b")
    a, b = (tmp_path / "a" / "requests.csv").read_bytes(), (tmp_path / "b" / "requests.csv").read_bytes()
    assert a == b and a.count(b"\n") == 901


def test_row_log_spills_whole_chunks_whenever_checked():
    """What a RowLog reads back does not depend on when it was checked (the decode fast path
    checks once per run of batches): an int in a float column reads back the same."""
    from kvsched.sim.rowlog import CHUNK, RowLog
    logs = [RowLog("fi"), RowLog("fi")]
    for k in range(CHUNK + 5000):
        for log in logs:
            log.append((1, k))
        if not (k + 1) % CHUNK:
            logs[0].check()                     # every CHUNK rows, as the general path
        if not (k + 1) % 7777:
            logs[1].check()                     # at other times, as a run of batches
    logs[1].check()
    assert repr(list(logs[0])) == repr(list(logs[1])) and len(logs[1]) == CHUNK + 5000   # 1 vs 1.0 matters
