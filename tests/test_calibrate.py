"""`kvsched calibrate`: fits recovered from synthetic step logs, fallbacks, malformed logs,
and cost files through `--cost FILE` (docs/calibration.md)."""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost import BatchShape, LinearCost, PhaseCost, RooflineCost, TiledCost, make_cost_model
from kvsched.cost.calibrate import STEP_LOG_HEADER, read_step_log, write_cost_file
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model

runner = CliRunner()
SMALL = ["--num-requests", "60", "--rate", "5"]
KINDS = ("prefill", "decode", "mixed")
LLAMA, A100 = get_model("llama-3-8b"), get_gpu("a100-80gb")
HW = ["--model", "llama-3-8b", "--gpu", "a100-80gb"]
PHASE = dict(alpha_p=0.004, beta_p=3e-5, alpha_d=0.009, beta_d=5e-5, alpha_mb=0.006, c0=3.1e-5, c1=6e-5, c2=-2e-5)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def batch(rng: np.random.Generator, kind: str) -> BatchShape:
    """A random batch of `kind` with consistent aggregates: 1-3 chunks (p, c), 1-199 decodes."""
    chunks = [(int(rng.integers(0, 2000)), int(rng.integers(1, 1024))) for _ in range(rng.integers(1, 4))] \
        if kind != "decode" else []
    ctx = rng.integers(10, 4000, size=rng.integers(1, 200)) if kind != "prefill" else np.array([], dtype=int)
    return BatchShape(sum(c for _, c in chunks), len(chunks), sum(c * (p + (c + 1) / 2) for p, c in chunks),
                      sum(p + c for p, c in chunks), len(ctx), int(ctx.sum()), chunks)


def row(step: int, s: BatchShape, seconds: float) -> list:
    return [step, s.prefill_tokens, s.prefill_seqs, int(s.prefill_attn), s.prefill_ctx, s.decode_seqs, s.decode_ctx,
            " ".join(f"{p}:{c}" for p, c in s.chunks), 0, s.tokens, s.tokens, repr(float(seconds))]


def write_log(path: Path, cost, steps: int = 240, kinds=KINDS, noise: float = 0.0, seed: int = 0,
              extra: bool = False) -> Path:
    """A step log of `cost`'s times (times exp(N(0, noise)) when noise > 0) on random batches,
    the kinds in turn; `extra` adds an unknown column."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(STEP_LOG_HEADER + (["gpu_util"] if extra else []))
        for i in range(steps):
            s = batch(rng, kinds[i % len(kinds)])
            t = cost.time(s) * (math.exp(rng.normal(0, noise)) if noise else 1.0)
            w.writerow(row(i + 1, s, t) + ([0.5] if extra else []))
    return path


def calibrate_json(*args) -> dict:
    r = invoke("calibrate", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def close(fitted: dict, true: dict, rel: float) -> None:
    for k, v in true.items():
        assert fitted[k] == pytest.approx(v, rel=rel, abs=1e-15), k


# -- fits --------------------------------------------------------------------------------------

def test_phase_and_linear_recovered_exactly_without_noise(tmp_path):
    s = calibrate_json(write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), extra=True), "--models", "phase,linear")
    phase = s["models"]["phase"]
    close(phase["params"], PHASE, 1e-8)
    assert phase["fallbacks"] == {} and s["best"] == s["use"] == "phase" and s["out"] is None
    assert s["kinds"] == {"prefill": 80, "decode": 80, "mixed": 80} and s["steps"] == 240
    for kind in (*KINDS, "all"):
        assert phase["errors"][kind]["median"] < 1e-10 and phase["errors"][kind]["p90"] < 1e-10
    linear = calibrate_json(write_log(tmp_path / "lin.csv", LinearCost(d0=0.02, d1=3e-8)))
    close(linear["models"]["linear"]["params"], {"d0": 0.02, "d1": 3e-8}, 1e-8)
    assert linear["best"] == "linear"


def test_phase_with_noise_stays_close(tmp_path):
    s = calibrate_json(write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), steps=600, noise=0.02, seed=3),
                       "--models", "phase")
    fit = s["models"]["phase"]
    close(fit["params"], {k: PHASE[k] for k in ("alpha_p", "beta_p", "alpha_d", "beta_d")}, 0.05)
    for r in (0.1, 0.5, 0.9):       # beta_MB(r) itself, not its (correlated) coefficients
        true, got = PhaseCost(**PHASE).beta_mb(r), PhaseCost(**fit["params"]).beta_mb(r)
        assert got == pytest.approx(true, rel=0.05)
    for kind in (*KINDS, "all"):
        assert 0.005 < fit["errors"][kind]["median"] < 0.025 and fit["errors"][kind]["p90"] < 0.06


def test_roofline_and_tiled_fitted_with_model_and_gpu(tmp_path):
    roof = dict(compute_efficiency=0.45, memory_efficiency=0.7, overhead=0.003)
    s = calibrate_json(write_log(tmp_path / "r.csv", RooflineCost(LLAMA, A100, **roof)), *HW)
    close(s["models"]["roofline"]["params"], roof, 1e-6)
    assert s["best"] == "roofline" and s["model"] == "llama-3-8b" and s["gpu"] == "a100-80gb"
    tiled = dict(lin_tile_s=2e-3, nonlin_token_s=1e-6, pair_tile_s=2e-8, decode_attn_token_s=5e-9, overhead=4e-3)
    s = calibrate_json(write_log(tmp_path / "t.csv", TiledCost(LLAMA, A100, **tiled)), *HW, "--models", "tiled")
    close(s["models"]["tiled"]["params"], tiled, 1e-6)
    assert s["models"]["tiled"]["params"]["weight_floor"] == 0 and "weight_floor" in s["models"]["tiled"]["fixed"]
    s = calibrate_json(tmp_path / "t.csv")
    assert s["models"]["roofline"] == {"skipped": "needs --model and --gpu"} == s["models"]["tiled"]


def test_tiled_without_decodes_takes_the_catalogue_decode_attention(tmp_path):
    s = calibrate_json(write_log(tmp_path / "p.csv", PhaseCost(**PHASE), kinds=("prefill",)), *HW,
                       "--models", "tiled,linear")
    fit = s["models"]["tiled"]
    assert set(fit["fallbacks"]) == {"decode_attn_token_s"}
    assert fit["params"]["decode_attn_token_s"] == TiledCost(LLAMA, A100).decode_attn_token_s


# -- fallbacks ---------------------------------------------------------------------------------

def test_no_mixed_steps_one_pass_fallback(tmp_path):
    log = write_log(tmp_path / "eb.csv", PhaseCost(**PHASE), kinds=("prefill", "decode"))
    fit = calibrate_json(log, "--models", "phase")["models"]["phase"]
    p = fit["params"]
    close(p, {k: PHASE[k] for k in ("alpha_p", "beta_p", "alpha_d", "beta_d")}, 1e-8)
    assert set(fit["fallbacks"]) == {"alpha_mb", "c0", "c1", "c2"}
    assert all("no mixed steps" in why for why in fit["fallbacks"].values())
    assert (p["alpha_mb"], p["c0"], p["c1"], p["c2"]) == (max(p["alpha_p"], p["alpha_d"]), p["beta_p"],
                                                          p["beta_d"] - p["beta_p"], 0.0)
    cost = PhaseCost(**p)
    for pt, n in ((1, 1), (1, 500), (4000, 1), (300, 300)):       # one pass doing both: positive
        t = cost.time(BatchShape(prefill_tokens=pt, prefill_seqs=1, decode_seqs=n, decode_ctx=n))
        assert t == pytest.approx(p["alpha_mb"] + p["beta_p"] * pt + p["beta_d"] * n) and t > 0
    assert fit["errors"]["mixed"] == {"steps": 0, "median": None, "p90": None}
    r = invoke("calibrate", log, "--models", "phase")
    assert r.exit_code == 0 and "fallback: max(alpha_p, alpha_d)" in r.stdout


def test_no_prefill_only_steps_come_from_the_mixed_fit_at_r0(tmp_path):
    true = {**PHASE, "alpha_p": PHASE["alpha_mb"], "beta_p": PHASE["c0"]}
    fit = calibrate_json(write_log(tmp_path / "s.csv", PhaseCost(**true), kinds=("decode", "mixed")),
                         "--models", "phase")["models"]["phase"]
    close(fit["params"], true, 1e-8)
    assert set(fit["fallbacks"]) == {"alpha_p", "beta_p"} and "r=0" in fit["fallbacks"]["beta_p"]


def test_phase_needs_two_kinds_of_steps(tmp_path):
    log = write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), kinds=("decode",))
    r = invoke("calibrate", log, "--models", "phase")
    assert r.exit_code == 2 and "no prefill-only steps" in r.stderr and "no mixed steps" in r.stderr
    s = calibrate_json(log, "--models", "phase,linear")
    assert "no mixed steps" in s["models"]["phase"]["skipped"] and s["best"] == "linear"
    r = invoke("calibrate", log, "--models", "phase,linear", "--use", "phase", "--out", tmp_path / "c.json")
    assert r.exit_code == 2 and "--use phase: not fitted" in r.stderr and not (tmp_path / "c.json").exists()


def test_skip_drops_warmup_steps(tmp_path):
    log = write_log(tmp_path / "steps.csv", PhaseCost(**PHASE))
    lines = log.read_text().splitlines()
    slow = [",".join(r[:-1] + [repr(float(r[-1]) * 2)]) for r in (x.split(",") for x in lines[1:7])]
    log.write_text("\n".join([lines[0], *slow, *lines[7:]]) + "\n")     # 6 warm-up steps twice as slow
    assert calibrate_json(log, "--models", "phase")["models"]["phase"]["errors"]["all"]["median"] > 1e-3
    s = calibrate_json(log, "--models", "phase", "--skip", 6)
    assert s["steps"] == 234 and s["skipped_steps"] == 6
    close(s["models"]["phase"]["params"], PHASE, 1e-8)
    r = invoke("calibrate", log, "--skip", 240)
    assert r.exit_code == 2 and "--skip 240 leaves no steps" in r.stderr


# -- malformed logs ----------------------------------------------------------------------------

HEADER = ",".join(STEP_LOG_HEADER)
GOOD = "1,100,1,5050,100,0,0,0:100,0,100,100,0.01"


@pytest.mark.parametrize("content,needle", [
    ("", "steps.csv: empty step log (no header)"),
    (HEADER + "\n", "steps.csv: empty step log (no steps after the header)"),
    (HEADER.replace(",seconds", "") + "\n" + GOOD[:-5] + "\n", "steps.csv:1: missing column seconds"),
    (f"{HEADER}\n{GOOD}\n{GOOD[:-4]}0\n", "steps.csv:3: seconds must be >= 1e-09 (a step's measured time), got 0"),
    (f"{HEADER}\n{GOOD}\n{GOOD[:-4]}inf\n", "steps.csv:3: seconds must be finite, got inf"),
    (f"{HEADER}\n{GOOD}\n{GOOD[:-4]}nan\n", "steps.csv:3: seconds must be finite, got nan"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace('1,100,1', '1,1e2x,1')}\n", "steps.csv:3: prefill_tokens is not a number"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace(',0,0,0:100', ',-2,0,0:100')}\n", "steps.csv:3: decodes must be >= 0, got -2"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace('0:100', '0-100')}\n", "steps.csv:3: chunks: '0-100' is not p:c"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace('0:100', '0:60 60:40')}\n", "steps.csv:3: the chunks give prefill_chunks 2"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace('0:100', '')}\n", "steps.csv:3: the chunks give prefill_chunks 0"),
    (f"{HEADER}\n{GOOD}\n1,0,0,0,0,0,0,,0,0,0,0.01\n", "steps.csv:3: the step computes no tokens"),
    (f"{HEADER}\n{GOOD}\n1,0,0,0,0,3,2,,0,0,0,0.01\n", "steps.csv:3: decode_context 2 is below decodes 3"),
    (f"{HEADER}\n{GOOD}\n{GOOD},7\n", "steps.csv:3: 13 fields, the header has 12"),
    (f"{HEADER}\n{GOOD}\n{GOOD[:-4]}1e-320\n", "steps.csv:3: seconds must be >= 1e-09"),
    (f"{HEADER}\n{GOOD}\n1,0,0,0,0,2.5,3,,0,0,0,0.01\n", "steps.csv:3: decodes must be a whole number, got 2.5"),
    (f"{HEADER}\n{GOOD}\n{GOOD.replace(',0,0,0:100', ',0,999,0:100')}\n", "steps.csv:3: decode_context 999 with no decodes"),
    (f"{HEADER},seconds\n{GOOD},0.01\n", "steps.csv:1: column seconds appears twice"),
    (f"{HEADER}\n{GOOD}\n,,,,,,,,,,,\n", "steps.csv:3: prefill_tokens is not a number"),
])
def test_malformed_log_is_file_line_exit_2_nothing_written(tmp_path, monkeypatch, content, needle):
    monkeypatch.chdir(tmp_path)
    Path("steps.csv").write_text(content)
    r = invoke("calibrate", "steps.csv", "--out", "cost.json")
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]


@pytest.mark.parametrize("args,needle", [
    (["--models", "phase,quantum"], "--models: unknown model 'quantum'"),
    (["--model", "llama-3-8b"], "give both --model and --gpu"),
    (["--model", "gpt-5", "--gpu", "a100-80gb"], "unknown model 'gpt-5'"),
    (["--use", "tiled", "--models", "phase"], "--use tiled: not among --models"),
    (["--use", "tiled"], "--use tiled: not fitted (needs --model and --gpu)"),
    (["--out", "."], "is a folder"),
    (["--out", "no/such/dir/c.json"], "no folder no/such/dir"),
    (["--skip", "-1"], "--skip must be >= 0"),
])
def test_bad_options_exit_2(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    write_log(Path("steps.csv"), PhaseCost(**PHASE), steps=30)
    r = invoke("calibrate", "steps.csv", *args, *([] if "--out" in args else ["--out", "cost.json"]))
    assert r.exit_code == 2, r.output
    assert needle in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]


def test_missing_log_is_an_error(tmp_path):
    r = invoke("calibrate", tmp_path / "none.csv")
    assert r.exit_code == 2 and "none.csv: no such step log" in r.stderr


# -- cost files --------------------------------------------------------------------------------

def test_out_file_round_trips_through_simulate(tmp_path):
    cost_file = tmp_path / "cost.json"
    r = invoke("calibrate", write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), noise=0.01), "--out", cost_file)
    assert r.exit_code == 0, r.output
    assert f"wrote {cost_file}" in r.stdout
    data = json.loads(cost_file.read_text())
    assert data["kvsched_cost"] == 1 and data["cost"] == "phase" and data["provenance"]["steps"] == 240
    assert data["provenance"]["source"] == str(tmp_path / "steps.csv") and data["model"] is None
    fitted = PhaseCost(**data["params"])
    assert make_cost_model(str(cost_file), {}, LLAMA, A100) == fitted
    run = tmp_path / "run"
    r = invoke("simulate", *SMALL, "--cost", cost_file, "--record-batches", "--out", run, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["cost_model"] == str(cost_file)
    with open(run / "batches.csv") as f:
        batches = list(csv.DictReader(f))
    assert len(batches) > 100
    for b in batches:
        shape = BatchShape(prefill_tokens=int(b["prefill_tokens"]), prefill_seqs=int(b["prefill_requests"]),
                           decode_seqs=int(b["decode_requests"]))
        assert float(b["duration"]) == pytest.approx(fitted.time(shape), rel=1e-12)


def test_linear_file_simulates_as_the_named_model(tmp_path):
    cost_file = tmp_path / "lin.json"
    r = invoke("calibrate", write_log(tmp_path / "s.csv", LinearCost(d0=0.02, d1=3e-8)), "--use", "linear",
               "--out", cost_file)
    assert r.exit_code == 0, r.output
    params = json.loads(cost_file.read_text())["params"]
    by_file = json.loads(invoke("simulate", *SMALL, "--cost", cost_file, "--json").stdout)
    sets = [x for k, v in params.items() for x in ("--cost-set", f"{k}={v!r}")]
    by_name = json.loads(invoke("simulate", *SMALL, "--cost", "linear", *sets, "--json").stdout)
    for s in (by_file, by_name):
        s.pop("wall_seconds"), s.pop("cost_model")
    assert by_file == by_name


def test_cost_set_overrides_a_file_parameter(tmp_path):
    cost_file = tmp_path / "cost.json"
    assert invoke("calibrate", write_log(tmp_path / "s.csv", PhaseCost(**PHASE)), "--models", "phase",
                  "--out", cost_file).exit_code == 0
    cost = make_cost_model(str(cost_file), {"alpha_p": "0.5"}, LLAMA, A100)
    assert cost.alpha_p == 0.5 and cost.beta_d == pytest.approx(PHASE["beta_d"], rel=1e-8)
    base = json.loads(invoke("simulate", *SMALL, "--cost", cost_file, "--json").stdout)
    slow = json.loads(invoke("simulate", *SMALL, "--cost", cost_file, "--cost-set", "alpha_d=0.05", "--json").stdout)
    assert slow["duration"] > base["duration"]
    r = invoke("simulate", *SMALL, "--cost", cost_file, "--cost-set", "d0=1")
    assert r.exit_code == 2 and f"cost file {cost_file} (phase) has no parameter 'd0'" in r.stderr


def good_file(**change) -> dict:
    return {"kvsched_cost": 1, "cost": "phase", "params": dict(PHASE), **change}


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    (json.dumps({"cost": "phase", "params": {}}), 'not a kvsched cost file (needs "kvsched_cost": 1)'),
    (json.dumps(good_file(kvsched_cost=2)), "not a kvsched cost file"),
    (json.dumps(good_file(cost="quantum")), "unknown cost model 'quantum'"),
    (json.dumps(good_file(params=[1, 2])), '"params" must be an object'),
    (json.dumps(good_file(params={"alpha_q": 1})), "cost model phase has no parameter 'alpha_q'"),
    (json.dumps(good_file(params={"alpha_p": "fast"})), "alpha_p='fast' must be a finite number"),
    (json.dumps(good_file(params={"alpha_p": -1})), "alpha_p must be a finite number >= 0, got -1"),
    ('{"kvsched_cost": 1, "cost": "phase", "params": {"alpha_p": NaN}}', "NaN is not a number JSON allows"),
    (json.dumps(good_file(model=7)), '"model" must be a catalogue name or null'),
])
def test_bad_cost_file_is_one_line_naming_the_file(tmp_path, content, needle):
    path = tmp_path / "cost.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KvschedError) as e:
        make_cost_model(str(path), {}, LLAMA, A100)
    assert str(path) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)
    r = invoke("simulate", *SMALL, "--cost", path)
    assert r.exit_code == 2 and needle in r.stderr


def test_cost_file_for_another_model_or_gpu(tmp_path):
    path = tmp_path / "roof.json"
    path.write_text(json.dumps({"kvsched_cost": 1, "cost": "roofline", "params": {"overhead": 0.002},
                                "model": "llama-3-8b", "gpu": "a100-80gb"}))
    assert make_cost_model(str(path), {}, LLAMA, A100).overhead == 0.002
    with pytest.raises(KvschedError, match="fitted for gpu a100-80gb, not llama-3-8b on h100-sxm"):
        make_cost_model(str(path), {}, LLAMA, get_gpu("h100-sxm"))
    phase = tmp_path / "phase.json"
    phase.write_text(json.dumps(good_file(model="llama-3-8b", gpu="a100-80gb")))
    with pytest.warns(UserWarning, match="fitted for model llama-3-8b"):
        make_cost_model(str(phase), {}, get_model("mistral-7b"), A100)
    assert make_cost_model(str(phase), {}, None, None) == PhaseCost(**PHASE)    # the vLLM adapter's call


def test_out_is_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "cost.json"
    target.write_text("old\n")

    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("kvsched.files.os.replace", fail)
    with pytest.raises(KvschedError, match="cannot write .*No space left"):
        write_cost_file(target, {"kvsched_cost": 1})
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["cost.json"]


# -- output ------------------------------------------------------------------------------------

def test_table_and_json_are_deterministic(tmp_path):
    log = write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), noise=0.02, seed=5)
    first = invoke("calibrate", log, *HW, "--json").stdout
    assert first == invoke("calibrate", log, *HW, "--json").stdout
    s = json.loads(first)
    assert list(s["models"]) == ["phase", "linear", "roofline", "tiled"]
    assert s["source_sha256"] and s["best"] == "phase"
    r = invoke("calibrate", log, *HW)
    assert r.exit_code == 0
    for text in ("prefill-only", "decode-only", "mixed", "all steps", "roofline", "compute_efficiency", "best: phase"):
        assert text in r.stdout
    assert re.search(r"│ steps +│ +80 │ +80 │ +80 │ +240 │", r.stdout)


def test_aggregates_rounded_to_six_digits_pass(tmp_path):
    """The vLLM adapter may write prefill_attn with %g (6 significant digits)."""
    log = tmp_path / "steps.csv"
    log.write_text(f"{HEADER}\n1,1988,2,{2697094:g},3719,0,0,233:1004 1498:984,0,0,0,0.06\n")
    assert read_step_log(log).prefill_attn.tolist() == [2697090.0]


def test_read_step_log_keeps_file_lines(tmp_path):
    log = write_log(tmp_path / "steps.csv", PhaseCost(**PHASE), steps=6)
    log.write_text(log.read_text().replace("\r\n", "\n").replace("\n", "\n\n", 1))     # a blank line 2
    steps = read_step_log(log)
    assert steps.line.tolist() == [3, 4, 5, 6, 7, 8] and steps.tail(2).line.tolist() == [5, 6, 7, 8]
    assert steps.counts() == {"prefill": 2, "decode": 2, "mixed": 2}


@pytest.mark.parametrize("params,needle", [
    ({"alpha_p": 1e999}, "alpha_p=inf must be a finite number"),
    ({"c1": -1e-3, "c2": 1e-3}, "beta_MB(r) = c0 + c1 r + c2 r^2 must be >= 0 on [0, 1]"),
])
def test_cost_files_that_would_give_impossible_batch_times_are_refused(tmp_path, params, needle):
    f = tmp_path / "cost.json"
    f.write_text(json.dumps(good_file(params=params)).replace("Infinity", "1e999"))
    r = invoke("simulate", "--num-requests", "20", "--rate", "5", "--prompt-len", "uniform:10:100",
               "--output-len", "uniform:1:20", "--kv-capacity", "4000", "--cost", str(f))
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.output, r.output


def test_out_may_not_overwrite_the_step_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("steps.csv").write_text(f"{HEADER}\n{GOOD}\n")
    r = invoke("calibrate", "steps.csv", "--out", "steps.csv")
    assert r.exit_code == 2 and "is the step log itself" in r.stderr
    assert Path("steps.csv").read_text() == f"{HEADER}\n{GOOD}\n"


DECODE = "2,0,0,0,0,4,400,,0,4,4,0.02"


@pytest.mark.parametrize("args", [[], ["--json"], ["--out", "cost.json"], ["--use", "linear"],
                                  ["--use", "linear", "--json"], ["--use", "linear", "--out", "cost.json"]])
def test_too_few_steps_for_any_model_is_one_line_naming_the_counts(tmp_path, monkeypatch, args):
    """Two steps (one prefill-only, one decode-only): linear fits them exactly (2 steps, 2
    parameters), which `best` does not count, and phase has too few of each kind: a one-line
    error, exit 2, nothing written (was `best: None` with exit 0, and `KeyError: None` with --out;
    with --use linear, `best: None` with exit 0 and an exact-fit cost file)."""
    monkeypatch.chdir(tmp_path)
    Path("steps.csv").write_text(f"{HEADER}\n{GOOD}\n{DECODE}\n")
    r = invoke("calibrate", "steps.csv", *args)
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in r.output
    assert "no model could be fitted to steps.csv: 2 steps (1 prefill-only, 1 decode-only, 0 mixed)" in line
    assert "linear: 2 steps for 2 parameters, needs at least 3" in line
    assert "prefill-only steps: 1, with 1 distinct prefill token counts (need 2)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]


def test_one_step_more_than_parameters_is_fitted(tmp_path):
    third = "3,200,1,20100,200,0,0,0:200,0,200,200,0.015"
    (tmp_path / "steps.csv").write_text(f"{HEADER}\n{GOOD}\n{DECODE}\n{third}\n")
    s = calibrate_json(tmp_path / "steps.csv", "--models", "linear")
    assert s["best"] == s["use"] == "linear"


def test_use_of_a_model_with_too_few_steps_is_refused_though_another_has_enough(tmp_path, monkeypatch):
    """Three steps: linear (2 parameters) is checked by the log, roofline (3) fits it exactly;
    --use roofline is a one-line error naming its counts, nothing written."""
    monkeypatch.chdir(tmp_path)
    Path("steps.csv").write_text(f"{HEADER}\n{GOOD}\n{DECODE}\n3,200,1,20100,200,0,0,0:200,0,200,200,0.015\n")
    r = invoke("calibrate", "steps.csv", "--models", "linear,roofline", *HW, "--use", "roofline", "--out", "c.json")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "--use roofline: 3 steps for 3 parameters, needs at least 4" in r.stderr
    assert "without --use: linear, which has enough" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]
    s = calibrate_json("steps.csv", "--models", "linear,roofline", *HW, "--use", "linear")
    assert s["best"] == s["use"] == "linear"
