"""`kvsched report DIR` and `--plot`: one self-contained page per folder kind (simulate,
compare, sweep, capacity), its plot sections, one-line errors, byte-identical renders."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsched.cli import app

runner = CliRunner()
SMALL = ["--num-requests", "60", "--rate", "6"]
TIERS = ["--tier", "paying:0.3:tbt=0.1", "--tier", "free:0.7:tbt=0.5"]
POLICIES = ("vllm-v1", "sarathi")
SLOS = [{"metric": "ttft", "stat": "p50", "ms": 150.0, "key": "median_ttft_ms"},
        {"metric": "tpot", "stat": "p99", "ms": 60.0, "key": "p99_tpot_ms"}]


def point_figures(policy: str, rate: float, seed: int, tiers: tuple[str, ...] = ()) -> dict:
    """A real point's figures (kvsched.point), on a small KV cache so queues form."""
    from kvsched.point import Point, figures
    from kvsched.run import Scenario
    from kvsched.workload.source import WorkloadOptions
    point = Point(WorkloadOptions(num_requests=60, tiers=list(tiers)), Scenario(None, kv_capacity=30000), policy,
                  rate=rate, seed=seed)
    return figures(point.run())


def make_sweep(d: Path, rates=(2.0, 6.0), seeds=(0, 1), tiers: tuple[str, ...] = ()) -> Path:
    """A sweep folder as `kvsched sweep` writes it, with one failed point."""
    (d / "points").mkdir(parents=True)
    n = 0
    for policy in POLICIES:
        for rate in rates:
            for seed in seeds:
                key = f"{policy}-r{rate:g}-s{seed}"
                doc = {"key": key, "axes": {"policy": policy, "rate": rate, "seed": seed, "params": {}},
                       "status": "ok", "error": None, "seconds": 0.1,
                       "figures": point_figures(policy, rate, seed, tiers)}
                (d / "points" / f"{key}.json").write_text(json.dumps(doc))
                n += 1
    failed = {"key": "bad", "axes": {"policy": "sarathi", "rate": 99.0, "seed": 0, "params": {}},
              "status": "error", "error": "stalled", "seconds": 0.1, "figures": None}
    (d / "points" / "bad.json").write_text(json.dumps(failed))
    (d / "sweep.json").write_text(json.dumps({"kind": "sweep", "version": 1, "points": n + 1,
                                              "axes": {"policy": list(POLICIES), "rate": list(rates),
                                                       "seed": list(seeds)}}))
    return d


def make_capacity(d: Path, rates=(2.0, 5.0, 8.0, 11.0), seeds=(0, 1)) -> Path:
    """A capacity folder from real evaluations: max rate per seed = the highest rate meeting SLOS."""
    d.mkdir(parents=True)
    policies = {}
    for k, policy in enumerate(POLICIES):
        evals = []
        for seed in seeds:
            for rate in rates:
                f = {key: v for key, v in point_figures(policy, rate, seed).items() if not isinstance(v, list)}
                evals.append({"seed": seed, "rate": rate, "met": all(f[s["key"]] <= s["ms"] for s in SLOS),
                              "stable": True, "figures": f})
        per_seed = [max([e["rate"] for e in evals if e["seed"] == s and e["met"]], default=0.0) for s in seeds]
        best = sum(per_seed) / len(per_seed)
        policies[policy] = {
            "max_rate": best, "max_rate_min": min(per_seed), "max_rate_max": max(per_seed),
            "max_rate_seeds": per_seed, "mu": 12.0 + k, "max_rate_over_mu": best / (12.0 + k), "bounded_by": "slo",
            "at_max_rate": {"met": True}, "at_max_rate_runs": [point_figures(policy, max(best, 1.0), s) for s in seeds],
            "evaluations": evals, "gpus": None}
    (d / "capacity.json").write_text(json.dumps({
        "kind": "capacity", "slos": SLOS, "attainment": None, "tolerance": 0.02, "seeds": list(seeds),
        "requests": 60, "policies": policies}))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("report")
    assert runner.invoke(app, ["simulate", *SMALL, *TIERS, "--out", str(base / "run")]).exit_code == 0
    assert runner.invoke(app, ["compare", *SMALL, "--policies", ",".join(POLICIES), "--replicas", "2",
                               "--out", str(base / "compare")]).exit_code == 0
    return {"run": base / "run", "compare": base / "compare", "sweep": make_sweep(base / "sweep"),
            "tiered-sweep": make_sweep(base / "tiered-sweep", rates=(4.0,), seeds=(0,), tiers=("a:0.5:tbt=0.1",
                                                                                             "b:0.5")),
            "capacity": make_capacity(base / "capacity")}


def report(folder: Path, *extra: str) -> dict:
    r = runner.invoke(app, ["report", str(folder), "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def sections(page: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="([\w-]+)">(.*?)</section>', page, re.S))


EXPECTED = {"run": {"latency-throughput", "distributions", "timeline", "tiers"},
            "compare": {"latency-throughput", "distributions", "timeline"},
            "sweep": {"latency-throughput", "distributions", "timeline"},
            "tiered-sweep": {"latency-throughput", "distributions", "timeline", "tiers"},
            "capacity": {"latency-throughput", "distributions", "timeline", "capacity", "slos"}}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_page_holds_the_plots_of_its_folder_kind(folders, kind):
    out = report(folders[kind])
    page = Path(out["report"]).read_text()
    assert Path(out["report"]) == folders[kind] / "report.html"
    assert set(out["plots"]) == EXPECTED[kind]
    found = sections(page)
    assert set(found) == EXPECTED[kind] | {"summary"}
    for name in EXPECTED[kind]:
        assert 'src="data:image/png;base64,' in found[name], name
        assert '<p class="caption">' in found[name]
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//|url\(|<script|<link', page, re.I)
    assert "<table>" in found["summary"]


def test_sweep_caption_names_the_rate_shown_and_the_failed_point(folders):
    page = Path(report(folders["sweep"])["report"]).read_text()
    assert "rate 6 req/s, the highest at which every configuration has an ok point" in page
    assert "1 of 9 points did not finish ok" in page


def test_report_joins_the_manifest_and_the_folder_stays_reusable(folders, tmp_path):
    out = tmp_path / "c"
    assert runner.invoke(app, ["simulate", *SMALL, "--out", str(out)]).exit_code == 0
    report(out)
    assert "report.html" in (out / ".kvsched-run").read_text().split()
    assert runner.invoke(app, ["simulate", *SMALL, "--out", str(out)]).exit_code == 0     # not a stranger


def test_output_elsewhere_and_renders_are_byte_identical(folders, tmp_path):
    for kind in ("compare", "capacity"):
        a, b = tmp_path / f"{kind}-a.html", tmp_path / f"{kind}-b.html"
        report(folders[kind], "--output", str(a))
        report(folders[kind], "--output", str(b))
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--policies", ",".join(POLICIES)]])
def test_plot_writes_the_report_into_the_out_folder(tmp_path, command):
    out = tmp_path / "o"
    r = runner.invoke(app, [*command, *SMALL, "--out", str(out), "--plot"])
    assert r.exit_code == 0, r.output
    assert 'id="distributions"' in (out / "report.html").read_text()
    assert "report.html" in (out / ".kvsched-run").read_text().split()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_plot_without_out_is_one_line_exit_2():
    r = runner.invoke(app, ["simulate", *SMALL, "--plot"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "--plot needs --out" in r.output


def test_bad_folders_are_one_line_errors(folders, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    (broken / "points").mkdir(parents=True)
    (broken / "sweep.json").write_text("{}")
    (broken / "points" / "p1.json").write_text('{"status": "ok", "axes": {}}')
    for folder, words in ((tmp_path / "missing", "no such folder"), (empty, "is not a kvsched"),
                          (broken, "p1.json: malformed")):
        r = runner.invoke(app, ["report", str(folder)])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output
        assert not (folder / "report.html").exists()


@pytest.mark.parametrize("where,value,words", [
    ("ttft_quantiles_ms", [5.0], "ttft_quantiles_ms must be 101 finite numbers"),
    ("ttft_quantiles_ms", "x", "ttft_quantiles_ms must be 101 finite numbers"),
    ("tpot_quantiles_ms", [None] * 101, "tpot_quantiles_ms must be 101 finite numbers"),
    ("timeline", [[1, 2]], "timeline must be rows of 4 finite numbers"),
    ("max_rate", "abc", "max_rate must be a number"),
])
def test_corrupt_figures_are_one_line_errors(tmp_path, where, value, words):
    cap = make_capacity(tmp_path / "cap")
    doc = json.loads((cap / "capacity.json").read_text())
    pol = doc["policies"]["vllm-v1"]
    (pol if where == "max_rate" else pol["at_max_rate_runs"][0])[where] = value
    (cap / "capacity.json").write_text(json.dumps(doc))
    sw = make_sweep(tmp_path / "sw")
    point = next(p for p in (sw / "points").glob("*.json") if p.name != "bad.json")
    doc = json.loads(point.read_text())
    if where != "max_rate":
        doc["figures"][where] = value
        point.write_text(json.dumps(doc))
    for folder in (cap, sw) if where != "max_rate" else (cap,):
        r = runner.invoke(app, ["report", str(folder)])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output
        assert not (folder / "report.html").exists()


@pytest.mark.parametrize("change,words", [
    (lambda p: p.update(mu="abc"), "policies.vllm-v1.mu must be a number, got 'abc'"),
    (lambda p: p.update(max_rate_min=True), "policies.vllm-v1.max_rate_min must be a number, got True"),
    (lambda p: p.update(at_max_rate_runs="x"), "policies.vllm-v1.at_max_rate_runs must be a list of runs"),
    (lambda p: p.update(at_max_rate_runs=["x"]), "policies.vllm-v1.at_max_rate_runs[0] must be an object"),
    (lambda p: p["evaluations"][0].update(rate="3"), "policies.vllm-v1.evaluations[0].rate must be a number"),
    (lambda p: p["evaluations"][0].update(met="false"), "met true or false, got 0 and 'false'"),
    (lambda p: p["evaluations"][0]["figures"].update(median_ttft_ms="fast"),
     "policies.vllm-v1.evaluations[0].figures: median_ttft_ms must be a finite number or null, got 'fast'"),
    (lambda p: p["at_max_rate_runs"][0].update(completed="60"),
     "policies.vllm-v1.at_max_rate_runs[0]: completed must be a finite number or null, got '60'"),
    (lambda p: p["at_max_rate"].update(met="yes"), "policies.vllm-v1.at_max_rate must be an object whose met is"),
    (lambda p: p.update(bounded_by=3), "policies.vllm-v1: bounded_by must be text and gpus an object or null"),
    (lambda p: p.update(gpus="4"), "policies.vllm-v1: bounded_by must be text and gpus an object or null"),
    (lambda p: p.update(max_rate=10 ** 400), "policies.vllm-v1.max_rate must be a number, got 1000"),
    (lambda p: p["evaluations"][0]["figures"].update(preemptions=-1),
     "policies.vllm-v1.evaluations[0].figures: preemptions must be a whole number >= 0 or null, got -1"),
])
def test_corrupt_capacity_numbers_are_one_line_errors(tmp_path, change, words):
    cap = make_capacity(tmp_path / "cap", rates=(2.0, 5.0), seeds=(0,))
    doc = json.loads((cap / "capacity.json").read_text())
    change(doc["policies"]["vllm-v1"])
    (cap / "capacity.json").write_text(json.dumps(doc))
    r = runner.invoke(app, ["report", str(cap)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output
    assert "capacity.json: malformed" in r.output and not (cap / "report.html").exists()


def test_a_boolean_rate_is_a_malformed_point(tmp_path):
    sw = make_sweep(tmp_path / "sw", rates=(2.0,), seeds=(0,))
    point = sw / "points" / "vllm-v1-r2-s0.json"
    doc = json.loads(point.read_text())
    doc["axes"]["rate"] = True
    point.write_text(json.dumps(doc))
    r = runner.invoke(app, ["report", str(sw)])
    assert r.exit_code == 2 and "vllm-v1-r2-s0.json: malformed" in r.output and "axes.rate must be a number" in r.output


def test_the_sweep_report_shows_the_points_sweep_json_lists(tmp_path):
    """sweep.json's `keys`: the current grid's points, whatever else points/ holds; a listed
    point without a file is counted as not finished."""
    sw = make_sweep(tmp_path / "sw")
    meta = json.loads((sw / "sweep.json").read_text())
    keys = [p.stem for p in sorted((sw / "points").glob("vllm-v1-*.json"))]
    (sw / "sweep.json").write_text(json.dumps({**meta, "points": 5, "keys": keys + ["not-run-yet"]}))
    page = Path(report(sw)["report"]).read_text()
    assert "1 of 5 points did not finish ok" in page and "4 points of the grid in sweep.json" in page
    assert "sarathi" not in page
    for bad in (["../capacity"], "vllm-v1-r2-s0", [3]):
        (sw / "sweep.json").write_text(json.dumps({**meta, "keys": bad}))
        r = runner.invoke(app, ["report", str(sw)])
        assert r.exit_code == 2 and "sweep.json: keys must be a list of point keys" in r.output, r.output


def test_a_large_sweep_reports_in_seconds(folders, tmp_path):
    """400 points: aggregated into one line per configuration, not one figure per point."""
    d = tmp_path / "big"
    (d / "points").mkdir(parents=True)
    template = json.loads(next((folders["sweep"] / "points").glob("vllm-v1*.json")).read_text())
    for k in range(400):
        axes = {"policy": POLICIES[k % 2], "rate": 1.0 + k // 40, "seed": k % 4, "params": {"x": k // 4 % 10}}
        (d / "points" / f"p{k}.json").write_text(json.dumps({**template, "key": f"p{k}", "axes": axes}))
    (d / "sweep.json").write_text(json.dumps({"kind": "sweep", "version": 1, "points": 400, "axes": {}}))
    out = report(d)         # (its speed: a benchmark's business, not a test's)
    assert "first 10 of 20 configurations" in Path(out["report"]).read_text()


# ---- corrupt simulate and compare folders: refused with the file (and line) named ----

def _cell(name: str, column: str, value: bytes, line: int = 3):
    """Set `column` of CSV line `line` (1: the header) to `value`."""
    def change(d: Path) -> None:
        lines = (d / name).read_bytes().split(b"\r\n")
        header, row = lines[0].split(b","), lines[line - 1].split(b",")
        row[header.index(column.encode())] = value
        lines[line - 1] = b",".join(row)
        (d / name).write_bytes(b"\r\n".join(lines))
    return change


def _cut(name: str, n: int):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:-n])


def _bytes(name: str, line: int):
    """Bytes that are not UTF-8 at the start of line `line`."""
    def change(d: Path) -> None:
        lines = (d / name).read_bytes().split(b"\n")
        lines[line - 1] = b"\xff\xfe" + lines[line - 1]
        (d / name).write_bytes(b"\n".join(lines))
    return change


def _summary(change):
    def edit(d: Path) -> None:
        doc = json.loads((d / "summary.json").read_text())
        change(doc)
        (d / "summary.json").write_text(json.dumps(doc))
    return edit


CORRUPT_RUNS = {
    "requests-cut-in-a-row": (_cut("requests.csv", 30), "requests.csv:61: 14 fields, the header has 17"),
    "requests-cut-in-the-last-cell": (_cut("requests.csv", 3), "requests.csv:61: cut short"),
    "requests-cut-in-the-line-break": (_cut("requests.csv", 1), "requests.csv:61: cut short"),
    "requests-extra-field": (_cell("requests.csv", "status", b"finished,x"), "requests.csv:3: 18 fields"),
    "requests-ttft-text": (_cell("requests.csv", "ttft", b"abc"), "requests.csv:3: ttft 'abc' is not a number"),
    "requests-arrival-text": (_cell("requests.csv", "arrival", b"soon", 9), "requests.csv:9: arrival 'soon' is not"),
    "requests-nan": (_cell("requests.csv", "itl_sum", b"nan"), "requests.csv:3: itl_sum 'nan' is not a finite"),
    "requests-status": (_cell("requests.csv", "status", b"done"), "requests.csv:3: status 'done' is not one of"),
    "requests-no-ttft": (_cell("requests.csv", "ttft", b""), "requests.csv:3: a finished request needs ttft"),
    "requests-not-utf8": (_bytes("requests.csv", 5), "requests.csv:5: not UTF-8 text"),
    "timeline-text": (_cell("timeline.csv", "queue_length", b"x", 2), "timeline.csv:2: queue_length 'x' is not a"),
    "timeline-cut": (_cut("timeline.csv", 1), "cut short (the last line has no line break)"),
    "timeline-empty-cell": (_cell("timeline.csv", "running", b"", 2), "timeline.csv:2: running is empty"),
    "timeline-not-utf8": (_bytes("timeline.csv", 7), "timeline.csv:7: not UTF-8 text"),
    "summary-text-number": (_summary(lambda s: s.update(request_throughput="2.5")),
                            "summary.json: malformed (ValueError: request_throughput must be a finite number or "
                            "null, got '2.5')"),
    "summary-text-in-table": (_summary(lambda s: s.update(preemptions="none")), "preemptions must be a finite"),
    "summary-tier-figure": (_summary(lambda s: s["tiers"][0].update(p99_itl_ms="slow")),
                            "tier_paying_p99_itl_ms must be a finite number or null"),
    "summary-tiers-text": (_summary(lambda s: s.update(tiers="paying")), "tiers must be a list of objects"),
    "summary-capacity-text": (_summary(lambda s: s.update(kv_capacity_tokens="30000")),
                              "kv_capacity_tokens must be a whole number >= 1, got '30000'"),
    "summary-capacity-zero": (_summary(lambda s: s.update(kv_capacity_tokens=0)), "kv_capacity_tokens must be"),
    "summary-gpu-number": (_summary(lambda s: s.update(gpu=7)), "gpu must be text or null, got 7"),
    "summary-list": (lambda d: (d / "summary.json").write_text("[1, 2]"), "summary.json: malformed"),
    "summary-not-utf8": (lambda d: (d / "summary.json").write_bytes(b'{"policy": "\xff"}'),
                         "summary.json: not UTF-8 text (byte 13)"),
    # a JSON integer of 401 digits: math.isfinite raised OverflowError (a traceback)
    "summary-huge-count": (_summary(lambda s: s.update(completed=10 ** 400)),
                           "summary.json: malformed (ValueError: completed must be a finite number or null"),
    "summary-huge-rejected": (_summary(lambda s: s.update(rejected=10 ** 400)),
                              "rejected must be a whole number >= 0 or null, got 1000"),
    "summary-huge-capacity": (_summary(lambda s: s.update(kv_capacity_tokens=10 ** 400)),
                              "kv_capacity_tokens must be a whole number >= 1, got 1000"),
    "summary-negative-count": (_summary(lambda s: s.update(completed=-5)),
                               "summary.json: malformed (ValueError: completed must be a whole number >= 0 or "
                               "null, got -5)"),
    "summary-fractional-count": (_summary(lambda s: s.update(preemptions=1.5)), "preemptions must be a whole"),
    "summary-negative-tier-count": (_summary(lambda s: s["tiers"][0].update(requests=-3)),
                                    "tier_paying_requests must be a whole number >= 0 or null, got -3"),
    # requests.csv cut exactly at a row boundary: every row whole, 50 of 60 requests missing
    "requests-cut-at-a-row": (lambda d: (d / "requests.csv").write_bytes(
        b"".join((d / "requests.csv").read_bytes().splitlines(keepends=True)[:11])),
        "requests.csv: 10 finished rows, but summary.json has completed 60 (cut short, or another run's file)"),
    "summary-more-completed": (_summary(lambda s: s.update(completed=61)),
                               "requests.csv: 60 finished rows, but summary.json has completed 61"),
    "summary-more-rejected": (_summary(lambda s: s.update(rejected=2)),
                              "requests.csv: 0 rejected rows, but summary.json has rejected 2"),
}


@pytest.mark.parametrize("name", CORRUPT_RUNS)
def test_a_corrupt_run_folder_is_refused_naming_the_file(folders, tmp_path, name):
    import shutil
    change, words = CORRUPT_RUNS[name]
    d = tmp_path / "run"
    shutil.copytree(folders["run"], d)
    (d / "report.html").unlink(missing_ok=True)
    change(d)
    r = runner.invoke(app, ["report", str(d)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output
    assert r.output.startswith(f"kvsched: error: {d}") and not (d / "report.html").exists()


def test_a_corrupt_compare_folder_is_refused(folders, tmp_path):
    import shutil
    d = tmp_path / "compare"
    shutil.copytree(folders["compare"], d)
    (d / "report.html").unlink(missing_ok=True)
    _cell("requests.csv", "ttft", b"x", 4)(d / "sarathi")
    r = runner.invoke(app, ["report", str(d)])
    assert r.exit_code == 2 and f"{d / 'sarathi' / 'requests.csv'}:4: ttft 'x' is not a number" in r.output
    (d / "compare.json").write_text(json.dumps({"../run": {}}))        # a name that leaves the folder
    r = runner.invoke(app, ["report", str(d)])
    assert r.exit_code == 2 and "compare.json: '../run' is not the name of a policy's folder" in r.output
    assert not (d / "report.html").exists()


def test_a_manifest_with_bytes_that_are_not_utf8_keeps_them(folders, tmp_path):
    """run.py reads the manifest's names as bytes (surrogateescape); the report did
    read_text() and failed with a UnicodeDecodeError traceback."""
    import shutil
    d = tmp_path / "run"
    shutil.copytree(folders["run"], d)
    (d / "report.html").unlink(missing_ok=True)
    manifest = d / ".kvsched-run"
    manifest.write_bytes(manifest.read_bytes().replace(b"report.html\n", b"") + b"caf\xe9.txt\n")
    report(d)
    assert manifest.read_bytes().split(b"\n") == sorted(manifest.read_bytes().split(b"\n")[:-1]) + [b""]
    assert {b"caf\xe9.txt", b"report.html"} <= set(manifest.read_bytes().split(b"\n"))


def test_every_figure_the_page_reads_as_a_number_is_checked():
    from kvsched.report.folders import NUMBERS
    from kvsched.report.html import TABLE
    assert {key for key, _, _ in TABLE} <= set(NUMBERS)


@pytest.mark.parametrize("change,words", [
    (lambda f: f.update(request_throughput="3"), "figures: request_throughput must be a finite number or null"),
    (lambda f: f.update(tier_a_p99_itl_ms=[1]), "figures: tier_a_p99_itl_ms must be a finite number or null"),
    (lambda f: f.update(model=3), "figures: model must be text or null"),
    (lambda f: f.update(completed=10 ** 400), "figures: completed must be a finite number or null"),   # a traceback
    (lambda f: f.update(request_throughput=-10 ** 400), "figures: request_throughput must be a finite number"),
    (lambda f: f.update(completed=-5), "figures: completed must be a whole number >= 0 or null, got -5"),
])
def test_a_sweep_point_with_text_for_a_number_is_refused(tmp_path, change, words):
    sw = make_sweep(tmp_path / "sw", rates=(2.0,), seeds=(0,))
    point = sw / "points" / "vllm-v1-r2-s0.json"
    doc = json.loads(point.read_text())
    change(doc["figures"])
    point.write_text(json.dumps(doc))
    r = runner.invoke(app, ["report", str(sw)])
    assert r.exit_code == 2 and "vllm-v1-r2-s0.json: malformed" in r.output and words in r.output, r.output
    point.write_bytes(b'{"key": "\xff"}')
    r = runner.invoke(app, ["report", str(sw)])
    assert r.exit_code == 2 and "vllm-v1-r2-s0.json: not UTF-8 text" in r.output, r.output


@pytest.mark.parametrize("change,words", [
    (lambda doc: doc.update(seeds=["0"]), "capacity.json: malformed (ValueError: seeds must be a list of whole numbers"),
    (lambda doc: doc.update(seeds=[0.5]), "seeds must be a list of whole numbers, got [0.5]"),
    (lambda doc: doc["slos"][0].update(key=3), "slos[0]: key must be a figure's name, stat and metric text"),
])
def test_a_corrupt_capacity_document_is_refused(tmp_path, change, words):
    cap = make_capacity(tmp_path / "cap", rates=(2.0, 5.0), seeds=(0,))
    doc = json.loads((cap / "capacity.json").read_text())
    change(doc)
    (cap / "capacity.json").write_text(json.dumps(doc))
    r = runner.invoke(app, ["report", str(cap)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output
    (cap / "capacity.json").write_bytes(b'{"kind": "capacity\xff"}')
    r = runner.invoke(app, ["report", str(cap)])
    assert r.exit_code == 2 and "capacity.json: not UTF-8 text (byte 19)" in r.output, r.output
    assert not (cap / "report.html").exists()


def test_a_sweep_point_whose_key_is_not_its_file_name_is_refused(tmp_path):
    """points/KEY.json holds the point KEY (sweep.Store.path): another key is a copied or
    renamed file, not this grid's point (was rendered, exit 0)."""
    sw = make_sweep(tmp_path / "sw", rates=(2.0,), seeds=(0,))
    point = sw / "points" / "vllm-v1-r2-s0.json"
    point.write_text(json.dumps({**json.loads(point.read_text()), "key": "sarathi-r2-s0"}))
    r = runner.invoke(app, ["report", str(sw)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"{point}: malformed (ValueError: key 'sarathi-r2-s0' is not its file's name 'vllm-v1-r2-s0'" in r.output
    assert not (sw / "report.html").exists()


def _own_files(folders: dict[str, Path], tmp_path: Path) -> list[tuple[Path, str]]:
    """Copies of a run, compare, sweep and capacity folder, each with the names of its own files."""
    import shutil
    out = []
    for kind, names in (("run", ["requests.csv", "summary.json", "timeline.csv", "run.json", ".kvsched-run"]),
                        ("compare", ["compare.json", "sarathi/requests.csv", "vllm-v1/summary.json",
                                     "vllm-v1/run.json"]),
                        ("sweep", ["sweep.json", "points/bad.json", "points/vllm-v1-r2-s0.json"]),
                        ("capacity", ["capacity.json"])):
        d = tmp_path / kind
        shutil.copytree(folders[kind], d)
        (d / "report.html").unlink(missing_ok=True)
        out += [(d, name) for name in names]
    return out


def test_output_may_not_replace_one_of_the_folders_own_files(folders, tmp_path):
    """`--output DIR/requests.csv` replaced the run's data with HTML (exit 0): any file the
    report reads, the manifest or a file it lists is refused before anything is written,
    however the path is spelt (.., a linked parent)."""
    for d, name in _own_files(folders, tmp_path):
        before = (d / name).read_bytes()
        (tmp_path / "alias").unlink(missing_ok=True)
        (tmp_path / "alias").symlink_to(d)
        for spelling in (d / name, d / "points" / ".." / name, tmp_path / "alias" / name):
            r = runner.invoke(app, ["report", str(d), "--output", str(spelling)])
            assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
            assert f"--output {spelling} is one of the folder's own files" in r.output, r.output
        assert (d / name).read_bytes() == before and not (d / "report.html").exists()
        assert not [p for p in d.rglob("*") if p.name.startswith(".") and p.name != ".kvsched-run"]


def test_output_may_write_report_html_again_and_a_report_elsewhere(folders, tmp_path):
    """The default report.html, an earlier report (at any name in the folder, though the
    manifest lists it) and a file outside the folder are written, and written again."""
    import shutil
    d = tmp_path / "run"
    shutil.copytree(folders["run"], d)
    for args in ([], [], ["--output", str(d / "report.html")], ["--output", str(d / "other.html")],
                 ["--output", str(d / "other.html")], ["--output", str(tmp_path / "summary.json")]):
        r = runner.invoke(app, ["report", str(d), *args])
        assert r.exit_code == 0, r.output
    assert (tmp_path / "summary.json").read_text().startswith("<!DOCTYPE html>")
    assert json.loads((d / "summary.json").read_text())["completed"] == 60
