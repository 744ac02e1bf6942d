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
