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


def test_presets_never_read_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sharegpt-lengths.csv").write_text("num_prefill_tokens,num_decode_tokens\n7,9\n")
    r = invoke("workload", "stats", "sharegpt", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["input_tokens"]["median"] > 1000, r.output


def test_paths_are_paths_and_bad_ones_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("./azure2023-conv", "azure2023-conv/", "~nosuchuser-kvsched/x", "a" * 300):
        for flag in ("--trace", "-w"):
            r = invoke("simulate", flag, given, "--num-requests", "5")
            assert r.exit_code == 2 and r.stderr.startswith("kvsched: error: ") and r.stderr.count("\n") == 1, \
                (given, r.output)
    (tmp_path / "w.toml").write_text('[[phases]]\ntrace = "~nosuchuser-kvsched/x"\n')
    r = invoke("simulate", "-w", "w.toml")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output


def test_kvsched_traces_entries_a_folder_beside_and_compressed_copies(tmp_path, monkeypatch):
    (tmp_path / "azure2023-code").mkdir()                               # raw data beside the file
    (tmp_path / "azure2023-code.csv").write_text("arrival_time,prompt_tokens,output_tokens\n0,5,6\n")
    (tmp_path / "mooncake-synthetic.jsonl.gz").write_bytes(
        gzip.compress(b'{"arrival_time": 0, "prompt_tokens": 3, "output_tokens": 4}\n'))
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))
    assert read_trace("azure2023-code").prompt.tolist() == [5]
    assert read_trace("mooncake-synthetic").prompt.tolist() == [3]          # not the bundled 3,993 rows


def test_broken_links_and_odd_names_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "azure2023-code.csv").symlink_to(tmp_path / "unmounted" / "x.csv")   # not the bundled one
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))
    for given in ("azure2023-code.csv", "a\0b", "", " "):
        r = invoke("workload", "stats", "--trace", given)
        assert r.exit_code == 2 and r.stderr.startswith("kvsched: error: ") and r.stderr.count("\n") == 1, \
            (given, r.output)
    (tmp_path / "w.toml").write_text('[[phases]]\ntrace = "a\\u0000b"\nrequests = 5\n')
    r = invoke("simulate", "-w", "w.toml", "--rate", "1")
    assert r.exit_code == 2 and "NUL" in r.stderr and r.stderr.count("\n") == 1, r.output


@pytest.mark.parametrize("entry", ["folder", "broken-link"])
def test_a_bad_entry_in_kvsched_traces_is_an_error_not_the_bundled_copy(entry, tmp_path, monkeypatch):
    if entry == "folder":
        (tmp_path / "azure2023-conv.csv").mkdir()
    else:
        (tmp_path / "azure2023-conv.csv").symlink_to(tmp_path / "unmounted" / "x.csv")
    monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path))
    r = invoke("simulate", "--trace", "azure2023-conv", "--num-requests", "5")
    assert r.exit_code == 2 and "is not a readable file" in r.stderr, r.output


def test_damage_past_the_rows_read_is_found(tmp_path):
    """gzip checks its CRC at the end: a file read only in part is still read to the end."""
    rows = "".join(f"{k},5,6\n" for k in range(2000))
    raw = bytearray(gzip.compress(f"arrival_time,prompt_tokens,output_tokens\n{rows}".encode(), compresslevel=0))
    at = raw.rindex(b",5,6\n")
    raw[at + 1] = ord("9")              # the last row's prompt, 5 -> 9: still a trace, but the CRC fails
    (tmp_path / "t.csv.gz").write_bytes(bytes(raw))
    for args in ((), ("--num-requests", "10"), ("--window", "0:10")):
        r = invoke("workload", "stats", str(tmp_path / "t.csv.gz"), *args)
        assert r.exit_code == 2 and "cannot decompress" in r.stderr, (args, r.output)


def test_a_damaged_manifest_is_one_line_and_leaves_other_files_alone(tmp_path, monkeypatch):
    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(b"arrival_time,prompt_tokens,output_tokens\n0,5,6\n"))
    monkeypatch.setattr(bundled, "MANIFEST", tmp_path / "missing.toml")
    bundled.catalogue.cache_clear()
    try:
        assert read_trace(tmp_path / "t.csv.gz").prompt.tolist() == [5]
        r = invoke("simulate", "--trace", "azure2023-code")
        assert r.exit_code == 2 and "reinstall kvsched" in r.stderr and r.stderr.count("\n") == 1, r.output
    finally:
        bundled.catalogue.cache_clear()


def test_messages_name_a_bundled_trace_by_its_name():
    r = invoke("simulate", "--trace", "sharegpt-lengths")          # length-only: needs a rate
    assert r.exit_code == 2 and "sharegpt-lengths.csv (bundled) has no arrival times" in r.stderr, r.output


def test_a_sweep_point_is_new_when_a_name_leads_to_another_file(tmp_path, monkeypatch):
    """The sweep key holds the content of every trace a phase reads, wherever its name led."""
    for name, prompt in (("a", 7), ("b", 8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sharegpt-lengths.csv").write_text(
            "num_prefill_tokens,num_decode_tokens\n" + f"{prompt},9\n" * 20)
    args = ["sweep", "-w", "sharegpt", "--policies", "vllm-v1", "--rates", "1", "--seeds", "0",
            "--num-requests", "20", "--out", str(tmp_path / "s"), "--json"]
    runs = []
    for name in ("a", "b", "a"):
        monkeypatch.setenv("KVSCHED_TRACES", str(tmp_path / name))
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        runs.append(json.loads(r.stdout))
    assert [(s["done"], s["skipped"]) for s in runs] == [(1, 0), (1, 0), (0, 1)]
    monkeypatch.chdir(tmp_path / "a")                   # a path's spelling is not a new point
    for given, done in (("sharegpt-lengths.csv", 1), ("./sharegpt-lengths.csv", 0), (".//sharegpt-lengths.csv", 0)):
        r = invoke("sweep", "--trace", given, *args[3:-3], "--out", str(tmp_path / "s2"), "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["done"] == done, (given, r.output)
