"""The bundled GPU, model and price files, a user's own, and the pools and candidates that use
them (issue "Today's deployments"): every file loads with its sources, bad files are one error
naming file and key, mixed and disaggregated clusters of several kinds run."""
from __future__ import annotations

import json
import tomllib

import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import DATA, GPUS, MODELS, get_gpu, read_gpu
from kvsched.layout import Layout
from kvsched.pools import parse_candidate, parse_pool
from kvsched.prices import price_of, read_prices

runner = CliRunner()
ASKED = ("b200", "gb200", "mi300x", "mi325x", "mi355x", "h20", "h100-pcie", "h100-nvl", "l4", "a10g", "rtx-4090",
         "rtx-5090")


def invoke(*args):
    return runner.invoke(app, list(args))


def test_every_bundled_gpu_loads_with_a_source_on_every_line():
    assert set(ASKED) <= set(GPUS) and len(GPUS) >= 22
    for name in GPUS:
        g = GPUS[name]
        assert g.name == name and g.flops == g.formats["bf16"] and g.bandwidth > 0 and g.link_bandwidth > 0
        text = (DATA / "gpus" / f"{name}.toml").read_text()
        for line in text.splitlines():
            if "=" in line and not line.startswith(("name", "link =", "#")):
                assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, (name, line)
    assert get_gpu("h100-sxm").rate("fp8") == pytest.approx(2 * get_gpu("h100-sxm").rate("bf16"), rel=1e-3)
    assert get_gpu("a100-80gb").rate("fp8") == 312e12          # no FP8 path: bf16
    assert get_gpu("b200").rate("fp4") == 4 * get_gpu("b200").rate("bf16")


def test_every_bundled_model_has_its_source():
    sources = tomllib.loads((DATA / "models" / "SOURCES.toml").read_text())
    assert set(sources) == set(MODELS) and len(MODELS) >= 25
    for name, src in sources.items():
        assert src["hf"] and ("copied_from" in src or "derived" in src), name


def test_a_user_gpu_file_and_its_errors(tmp_path):
    text = (DATA / "gpus" / "l40s.toml").read_text().replace('name = "l40s"', 'name = "my-card"')
    p = tmp_path / "card.toml"
    p.write_text(text)
    assert read_gpu(p) == GPUS["l40s"].__class__(**{**GPUS["l40s"].__dict__, "name": "my-card"})
    assert get_gpu(str(p)).name == "my-card"
    for bad, message in [("memory_gib = 8\nbandwidth = -1\n[flops]\nbf16 = 1e14", "bandwidth must be a positive"), ("memory_gib = 8\nbandwidth = 1e12\n[flops]\nfp8 = 1e15", "at least bf16"),
                         ("memory_gib = 8\nbandwidth = 1e12\ncolour = 1\n[flops]\nbf16 = 1e14", "unknown key 'colour'"),
                         ("memory_gib = 8\nbandwidth = 1e12\n[flops]\nbf16 = 1e14\nint3 = 1", "unknown format 'int3'"),
                         ("memory_gib = 8\nbandwidth = 1e12\nlink = 'wire'\n[flops]\nbf16 = 1e14", "link must be"),
                         ("memory_gib = nan\nbandwidth = 1e12\n[flops]\nbf16 = 1e14", "memory_gib must be"),
                         ("memory_gib = 1e308\nbandwidth = 1e12\n[flops]\nbf16 = 1e14", "memory_gib must be .* up to"),
                         ("memory_gib = 8\nbandwidth = 1e12\nlink_latency = 5\n[flops]\nbf16 = 1e14", "link_latency"),
                         ("memory_gib = 8\nbandwidth = 1e12\n[flops]\nbf16 = 1e14\n[roofline]\nspeed = 1", "roofline. takes"),
                         ("memory_gib = 8\nbandwidth = 1e12\n[flops]\nbf16 = 1e14\n[roofline]\noverhead = 2", "at most 1"),
                         ("memory_gib = 8\nbandwidth = 1e12\n[flops]\nbf16 = 1e14\n[roofline]\ncompute_efficiency = 0",
                          "compute_efficiency must be a positive"),
                         ("memory_gib = = 1", "not TOML")]:
        p.write_text(bad)
        with pytest.raises(KvschedError, match=message):
            read_gpu(p)
    with pytest.raises(KvschedError, match="cannot read"):
        get_gpu(str(tmp_path / "none.toml"))
    with pytest.raises(KvschedError, match="unknown GPU 'h900'"):
        get_gpu("h900")


def test_prices_bundled_and_a_user_s(tmp_path):
    t = read_prices()
    assert t["source"] and t["date"] and price_of(t, "h100-sxm") > price_of(t, "l40s")
    p = tmp_path / "p.toml"
    p.write_text('source = "my contract"\ndate = "2026-11"\n[per_gpu_hour]\nh100-sxm = 1.5\n')
    mine = read_prices(p)
    assert price_of(mine, "h100-sxm") == 1.5
    p.write_text('[per_gpu_hour]\nH100-SXM = 1.25\n')
    assert price_of(read_prices(p), "h100-sxm") == 1.25
    p.write_text('source = "my contract"\ndate = "2026-11"\n[per_gpu_hour]\nh100-sxm = 1.5\n') and price_of(mine, "l40s") == price_of(t, "l40s")
    with pytest.raises(KvschedError, match="no price per GPU-hour for gb200"):
        price_of(mine, "gb200")
    p.write_text("[per_gpu_hour]\nh100-sxm = -2\n")
    with pytest.raises(KvschedError, match="must be a positive number"):
        read_prices(p)


def test_pool_text():
    p = parse_pool("big=h100-sxm:2:tp=2:weight-dtype=fp8", "llama-3.1-8b", Layout())
    assert (p.name, p.gpu, p.count, p.model, p.layout) == ("big", "h100-sxm", 2, "llama-3.1-8b",
                                                          Layout(tp=2, weight_dtype="fp8"))
    assert parse_pool("m=h100-sxm:1:tp=2:ep=4:dp-attention:model=qwen3-30b-a3b", "x", Layout()).layout.dp == 2
    assert parse_candidate("c=l40s:kv-dtype=fp8", "m", Layout()).layout == Layout(kv_dtype="fp8")
    for bad, message in [("h100-sxm:2", "write NAME=GPU:COUNT"), ("a=h100-sxm", "needs GPU:COUNT"),
                         ("a=h100-sxm:x", "COUNT must be a whole number"), ("a=h100-sxm:0", "COUNT"),
                         ("a=h100-sxm:1:colour=red", "unknown option 'colour'"), ("a=h100-sxm:1:tp", "tp needs a value"),
                         ("a=h100-sxm:1:tp=two", "tp must be a whole number"), ("a=h100-sxm:1:tp=2:tp=4", "given twice"),
                         ("a=h100-sxm:1:dp-attention=yes", "on or off"), ("a=h100-sxm:\u00b2", "COUNT must be"),
                         ("a=h100-sxm:1:tp=\u00b2", "tp must be a whole number"), ("a=h100-sxm:" + "9" * 5000, "COUNT")]:
        with pytest.raises(KvschedError, match=message):
            parse_pool(bad, "m", Layout())
    with pytest.raises(KvschedError, match="--candidate"):
        parse_candidate("c=l40s:tp=x", "m", Layout())


SMALL = ["--model", "llama-3.1-8b", "--num-requests", "300", "--rate", "8", "--json"]


def test_a_mixed_cluster_runs_behind_least_outstanding():
    """2 H100 replicas of TP 2 and 4 L40S, one router that sees each replica's kind."""
    r = invoke("simulate", "--pool", "big=h100-sxm:2:tp=2", "--pool", "small=l40s:4", "--router",
               "least-outstanding", *SMALL)
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["completed"] == 300 and s["replicas"] == 6 and s["gpu"] == "h100-sxm+l40s"
    assert [p["name"] for p in s["pools"]] == ["big", "small"] and s["pools"][0]["gpus_per_replica"] == 2
    caps = [row["peak_kv_usage"] for row in s["replica_breakdown"]]
    assert len(caps) == 6
    assert s["kv_capacity_tokens"] == s["pools"][1]["kv_capacity_tokens"] < s["pools"][0]["kv_capacity_tokens"]


def test_the_router_sees_each_replica_s_kind():
    from kvsched.run import Scenario, simulate
    from kvsched.workload.synthetic import synthetic
    from kvsched.workload.lengths import Fixed

    class Kinds:
        name, uses_state = "kinds", True

        def __init__(self):
            self.seen = set()

        def route(self, i, t, replicas):
            self.seen |= {r.kind for r in replicas}
            return i % len(replicas)

    router = Kinds()
    w = synthetic(Fixed(64), Fixed(16), rate=5, n=40, seed=0)
    sc = Scenario(w, model="llama-3.1-8b", router=router, pool=("big=h100-sxm:1:tp=2", "small=l40s:2"))
    assert simulate(sc).summary["completed"] == 40
    assert router.seen == {"big: h100-sxm tp=2", "small: l40s tp=1"}


def test_a_disaggregated_run_with_h100_prefill_and_l40s_decode():
    r = invoke("simulate", "--pool", "prefill=h100-sxm:1", "--pool", "decode=l40s:2", *SMALL)
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["completed"] == 300 and (s["prefill_replicas"], s["decode_replicas"]) == (1, 2)
    assert s["mean_transfer_ms"] > 0
    # the link is the slower side's network: an L40S's 25 GB/s, not the H100's 50
    fast = json.loads(invoke("simulate", "--pool", "prefill=h100-sxm:1", "--pool", "decode=l40s:2",
                             "--kv-transfer-bandwidth", "50", *SMALL).stdout)
    assert fast["mean_transfer_ms"] < s["mean_transfer_ms"]


@pytest.mark.parametrize("args, message", [
    (["--pool", "prefill=h100-sxm:1"], "exactly two pools, named prefill and decode"),
    (["--pool", "a=h100-sxm:1", "--pool", "a=l40s:1"], "given twice"),
    (["--pool", "a=h100-sxm:1", "--replicas", "2"], "either --pool or --replicas"),
    (["--pool", "a=h200:1", "--pool", "b=l4:1", "--cost", "eb-h200-qwen3-8b"], "use --cost roofline"),
    (["--pool", "a=h100-sxm:1", "--pool", "b=l4:1", "--cost", "tiled-mistral-7b-rtx-6000-ada"], "use --cost roofline"),
    (["--pool", "a=l40s:2", "--kv-transfer-bandwidth", "10"], "or --pool prefill="),
    (["--pool", "a=h900:1"], "unknown GPU 'h900'"),
    (["--pool", "a=l40s:1:tp=3"], "does not divide"),
    (["--pool", "prefill=h100-sxm:1", "--pool", "decode=l40s:1:kv-dtype=fp8"], "one --kv-dtype"),
    (["--pool", "a=l4:1:model=llama-3.1-70b"], "do not fit"),
    (["--pool", "a=l40s:2", "--kv-transfer-bandwidth", "10"], "needs --prefill-replicas"),
])
def test_bad_pools_are_one_line_errors(args, message):
    r = invoke("simulate", *args, *SMALL)
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_simulate_a_config_with_tp_and_fp8(tmp_path):
    """The issue's command: a config.json, H100 SXM, TP 2, FP8 weights and KV."""
    cfg = tmp_path / "qwen3" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text((DATA / "models" / "qwen3-32b.json").read_text())
    r = invoke("simulate", "--model", str(cfg), "--gpu", "h100-sxm", "--tp", "2", "--weight-dtype", "fp8",
               "--kv-dtype", "fp8", "--num-requests", "200", "--rate", "5", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["model"], s["tp"], s["weight_dtype"], s["kv_dtype"], s["gpus_per_replica"]) == ("qwen3", 2, "fp8", "fp8", 2)
    assert s["completed"] == 200
    bad = invoke("simulate", "--model", str(cfg), "--tp", "3", "--num-requests", "5")
    assert bad.exit_code == 2 and "does not divide" in bad.output


def test_capacity_names_the_cheapest_of_three_pools(tmp_path):
    prices = tmp_path / "p.toml"
    prices.write_text('source = "test"\ndate = "2026"\n[per_gpu_hour]\nh100-sxm = 100.0\n')
    r = invoke("capacity", "--candidate", "h100=h100-sxm:tp=2", "--candidate", "l40s=l40s", "--candidate",
               "a100=a100-80gb", "--prices", str(prices), "--model", "llama-3.1-8b", "--rate", "6",
               "--slo", "ttft:p99:2000", "--num-requests", "200", "--seeds", "1", "--tolerance", "0.2", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    rows = {c["name"]: c for c in s["candidates"]}
    assert set(rows) == {"h100", "l40s", "a100"} and s["prices"]["source"] == "test"
    for c in rows.values():
        assert c["usd_per_hour"] == pytest.approx(c["replicas"] * c["gpus"] // c["replicas"] * c["usd_per_gpu_hour"])
    assert s["cheapest"] == min(rows, key=lambda k: rows[k]["usd_per_hour"]) != "h100"    # its price is 100
    assert rows["h100"]["gpus"] == 2 * rows["h100"]["replicas"]
    for args, message in [(["--candidate", "a=l40s"], "needs --rate"),
                          (["--prices", str(prices), "--rate", "1"], "give --candidate too"),
                          (["--candidate", "a=gb200", "--rate", "1"], "no price per GPU-hour for gb200")]:
        bad = invoke("capacity", *args, "--num-requests", "20")
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_kv_usage_of_mixed_kinds_is_each_against_its_own_capacity():
    """A full small replica beside a roomy big one: the cluster's usage stays within 1."""
    r = invoke("simulate", "--model", "llama-3.1-8b", "--pool", "big=h100-sxm:1:tp=2", "--pool", "small=l40s:2",
               "--router", "least-outstanding", "--rate", "60", "--num-requests", "400", "--prompt-len", "fixed:4000",
               "--output-len", "fixed:300", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    rows = s["replica_breakdown"]
    assert max(x["peak_kv_usage"] for x in rows) == s["peak_kv_usage"] <= 1
    assert 0 < s["mean_kv_usage"] <= 1
    assert s["kv_capacity_total_tokens"] == s["pools"][0]["kv_capacity_tokens"] + 2 * s["pools"][1]["kv_capacity_tokens"]


def test_the_timeline_s_kv_share_of_mixed_kinds_stays_within_one(tmp_path):
    from kvsched.report.folders import _run_folder
    out = tmp_path / "o"
    r = invoke("simulate", "--model", "llama-3.1-8b", "--pool", "big=h100-sxm:1:tp=2", "--pool", "small=l40s:2",
               "--router", "least-outstanding", "--rate", "60", "--num-requests", "300", "--prompt-len", "fixed:4000",
               "--output-len", "fixed:300", "--out", str(out))
    assert r.exit_code == 0, r.output
    timeline = _run_folder(out, None).timeline
    assert timeline and max(row[3] for row in timeline) <= 1


def test_a_candidate_that_cannot_meet_the_slos_is_left_out(tmp_path):
    """A pool whose weights do not fit is listed as infeasible; the cheapest of the rest wins,
    and a GPU given in capitals is priced by its catalogue name."""
    r = invoke("capacity", "--candidate", "big=H100-SXM:tp=2", "--candidate", "tiny=l4", "--model", "llama-3.1-70b",
               "--rate", "2", "--slo", "ttft:p99:5000", "--num-requests", "100", "--seeds", "1", "--tolerance", "0.3",
               "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    rows = {c["name"]: c for c in s["candidates"]}
    assert s["cheapest"] == "big" and rows["big"]["gpu"] == "h100-sxm"
    assert rows["tiny"]["usd_per_hour"] is None and "do not fit" in rows["tiny"]["infeasible"]
    none = invoke("capacity", "--candidate", "tiny=l4", "--model", "llama-3.1-70b", "--rate", "2", "--slo",
                  "ttft:p99:5000", "--num-requests", "20")
    assert none.exit_code == 2 and "no --candidate meets the SLOs" in none.output
    for args, message in [(["--candidate", "a=h100-sxm:tp=7", "--candidate", "b=h100-sxm"], "does not divide"),
                          (["--candidate", "a=h200", "--candidate", "b=l4", "--cost", "eb-h200-qwen3-8b"],
                           "use --cost roofline")]:
        bad = invoke("capacity", *args, "--model", "qwen3-8b", "--rate", "2", "--slo", "ttft:p99:5000",
                     "--num-requests", "20")
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_the_python_api_refuses_a_bare_pool_text():
    from kvsched.run import Scenario, simulate
    from kvsched.workload.synthetic import synthetic
    from kvsched.workload.lengths import Fixed
    w = synthetic(Fixed(8), Fixed(8), rate=5, n=5, seed=0)
    with pytest.raises(KvschedError, match="Scenario.pool must be a tuple"):
        simulate(Scenario(w, pool="a=h100-sxm:1"))


def test_a_gpu_file_s_roofline_defaults():
    """The H100 file sets the roofline's step overhead (fitted on real vLLM runs,
    docs/fidelity.md); other GPUs keep the generic defaults; --cost-set still wins."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.hardware import get_model
    m = get_model("llama-3.1-8b")
    h100 = RooflineCost(m, get_gpu("h100-sxm"))
    assert (h100.overhead, h100.compute_efficiency, h100.memory_efficiency) == (0.0005, 0.5, 0.75)
    assert RooflineCost(m, get_gpu("a100-80gb")).overhead == 0.004
    assert RooflineCost(m, get_gpu("h100-sxm"), overhead=0.004).overhead == 0.004
