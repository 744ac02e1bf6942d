"""The public traces ship inside the package: found by name (with or without their suffix) from
any folder, checked against their sha256 when read, attributed in NOTICE; KVSCHED_TRACES is
searched first; nothing is ever substituted for a missing file."""
from __future__ import annotations

import gzip
import json
import lzma
import shutil

import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.run import RUN_ENVIRONMENT
from kvsched.workload import bundled
from kvsched.workload.bundled import DATA, catalogue, find_trace, notice
from kvsched.workload.readers import read_trace
from kvsched.workload.traces import load_trace

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def test_all_eight_traces_ship_with_their_attribution():
    assert sorted(catalogue()) == sorted(["azure2023-conv", "azure2023-code", "mooncake-conversation",
                                          "mooncake-synthetic", "sharegpt-lengths", "sharegpt-vidur-10k-lengths",
                                          "bwb-translation-lengths", "arxiv-summarization-lengths"])
    assert (DATA / "NOTICE").read_text() == notice()          # NOTICE is traces.toml's, rendered
    for t in catalogue().values():
        assert t.path.is_file() and t.name in t.file and t.commit and t.cite
        assert any(lic in t.license for lic in ("CC-BY-4.0", "Apache-2.0", "MIT"))
        assert t.file in (DATA / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(catalogue()))
def test_every_trace_reads_by_name_from_any_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = catalogue()[name]
    rows = read_trace(name)
    assert rows.path == t.path and rows.rows_in_file == t.rows
    assert read_trace(t.file).rows_in_file == t.rows                   # the file's name works too
    with bundled.open_trace(t.path) as f:
        assert f.read().count(b"\n") >= t.rows - 1


def test_names_on_the_command_line_and_in_workload_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    def figures(*args):
        r = invoke("simulate", *args, "--json")
        assert r.exit_code == 0, r.output
        return {k: v for k, v in json.loads(r.stdout).items() if k not in RUN_ENVIRONMENT}
    by_name = figures("--trace", "azure2023-conv", "--num-requests", "50")
    assert by_name["completed"] == 50
    assert figures("-w", "azure2023-conv.csv", "--num-requests", "50") == by_name
    (tmp_path / "w.toml").write_text('[[phases]]\ntrace = "azure2023-conv"\nrequests = 50\n')
    assert figures("-w", "w.toml") == by_name
    stats = json.loads(invoke("workload", "stats", "mooncake-synthetic", "--json").stdout)
    assert stats["requests"] == 3993
    assert len(load_trace("sharegpt-vidur-10k-lengths", rate=5.0)) == 10_000


def test_a_missing_trace_is_an_error_naming_the_bundled_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args in (("simulate", "--trace", "azure2099"), ("simulate", "-w", "azure2099"),
                 ("workload", "stats", "nope.csv"), ("simulate", "--trace", "sub/azure2023-conv")):
        r = invoke(*args)
        assert r.exit_code == 2 and "azure2023-conv" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(KvschedError, match="no bundled trace of that name"):
        find_trace("azure2023")


@pytest.mark.parametrize("kvsched_traces", [None, "empty"])
def test_length_flags_on_the_sharegpt_preset_are_an_error(kvsched_traces, tmp_path, monkeypatch):
    """A trace preset: never a synthetic stand-in that would accept --prompt-len."""
    if kvsched_traces:
        monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))
    r = invoke("simulate", "-w", "sharegpt", "--prompt-len", "fixed:3")
    assert r.exit_code == 2 and "--prompt-len" in r.stderr


def test_kvsched_traces_is_searched_first(tmp_path, monkeypatch):
    (tmp_path / "azure2023-conv.csv").write_text("arrival_time,prompt_tokens,output_tokens\n0,5,6\n1,5,6\n")
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))
    assert find_trace("azure2023-conv") == tmp_path / "azure2023-conv.csv"
    assert read_trace("azure2023-conv").prompt.tolist() == [5, 5]
    assert find_trace("mooncake-synthetic") == catalogue()["mooncake-synthetic"].path     # not there: bundled


def test_a_damaged_bundled_file_is_an_error_not_a_workload(tmp_path, monkeypatch):
    shutil.copytree(DATA, tmp_path / "traces")
    monkeypatch.setattr(bundled, "DATA", tmp_path / "traces")
    t = catalogue()["azure2023-code"]
    original = lzma.decompress(t.path.read_bytes())
    t.path.write_bytes(lzma.compress(original.replace(b",374,", b",375,", 1)))    # one token changed
    with pytest.raises(KvschedError, match="does not match its sha256"):
        read_trace("azure2023-code")
    t.path.write_bytes(t.path.read_bytes()[:1000])                                   # truncated
    with pytest.raises(KvschedError, match="cannot be read"):
        read_trace("azure2023-code")


def test_compressed_trace_files_of_ones_own(tmp_path):
    text = "arrival_time,prompt_tokens,output_tokens\n0,5,6\n0.5,7,8\n"
    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "t.csv.xz").write_bytes(lzma.compress(text.encode()))
    for name in ("t.csv.gz", "t.csv.xz"):
        assert read_trace(tmp_path / name).prompt.tolist() == [5, 7]
    (tmp_path / "bad.csv.gz").write_bytes(gzip.compress(text.encode())[:-12])
    with pytest.raises(KvschedError, match=r"bad\.csv\.gz:\d+: cannot decompress"):
        read_trace(tmp_path / "bad.csv.gz")
