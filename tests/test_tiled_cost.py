"""The tiled batch-time model (rad-slai.txt eq. 7), its Theorem 1 helpers and its fitted preset."""
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost import COST_MODELS, BatchShape, make_cost_model
from kvsched.cost.fit import coefficients
from kvsched.cost.tiled import TILED_PRESETS, TiledCost
from kvsched.errors import KvschedError
from kvsched.hardware import Model, get_gpu, get_model

# 2 layers, d = heads * head_dim = 2 * 8 = 16
TOY = Model("toy", layers=2, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=100,
            params=1e6, max_len=4096)
ADA = get_gpu("rtx-6000-ada")
MISTRAL = get_model("mistral-7b")
COEF = dict(lin_tile_s=1e-3, nonlin_token_s=2e-5, pair_tile_s=3e-7, decode_attn_token_s=4e-8,
            t_row=8, t_col=4, t_red=2)


def toy(**kw):
    return TiledCost(TOY, ADA, **{**COEF, **kw})


def shape(chunks, decodes=()):
    """A batch from per-chunk (p, c) and per-decode contexts, with consistent aggregates."""
    return BatchShape(prefill_tokens=sum(c for _, c in chunks), prefill_seqs=len(chunks),
                      prefill_attn=sum(c * (p + (c + 1) / 2) for p, c in chunks),
                      prefill_ctx=sum(p + c for p, c in chunks), decode_seqs=len(decodes),
                      decode_ctx=sum(decodes), chunks=list(chunks))


# the hand-computed batch: chunk A over 5 cached tokens (not a tile multiple), chunk B fresh,
# three decodes at contexts 10, 20, 7
BATCH = shape([(5, 6), (0, 9)], [10, 20, 7])
# tau = 6 + 9 + 3 = 18                       ceil(18 / t_col=4) = 5 column tiles
LINEAR = 1e-3 * 5
NONLINEAR = 2e-5 * 18
DECODE = 2 * 4e-8 * (10 + 20 + 7)           # N * decode_attn_token_s * decode context
# chunk A, p + c = 11: ceil(11/8) * ceil(6/4) * 16/2 + 16/8 * ceil(6/4) * ceil(11/2) = 2*2*8 + 2*2*6 = 56
# chunk B, p + c = 9:  ceil(9/8) * ceil(9/4) * 16/2 + 16/8 * ceil(9/4) * ceil(9/2)   = 2*3*8 + 2*3*5 = 78
PREFILL_ATTN = 3e-7 * 2 * (56 + 78)         # pair_tile_s * N * tile products
HAND = LINEAR + NONLINEAR + DECODE + PREFILL_ATTN     # = 5.44336e-3 s


def test_hand_computed_batch_is_exact():
    assert HAND == pytest.approx(5.44336e-3, rel=1e-12)
    assert toy().time(BATCH) == pytest.approx(HAND, rel=1e-12)
    assert toy().compute_time(BATCH) == pytest.approx(HAND, rel=1e-12)
    tiles, tau, decode, attn = toy().components(BATCH)
    assert (tiles, tau, decode, attn) == (5, 18, 2 * 37, 2 * 134)


def test_chunk_ceilings_make_a_staircase():
    cm = toy(lin_tile_s=0.0, nonlin_token_s=0.0, decode_attn_token_s=0.0, overhead=1.0)
    # p + c from 9 to 16 stays in 2 row tiles, c = 6 in 2 column tiles; only ceil((p+c)/2) moves
    steps = [cm.time(shape([(p, 6)])) - 1.0 for p in range(3, 11)]
    expected = [3e-7 * 2 * (2 * 2 * 8 + 2 * 2 * math.ceil((p + 6) / 2)) for p in range(3, 11)]
    assert steps == pytest.approx(expected, rel=1e-12)
    assert steps[0] == steps[1] and steps[1] < steps[2]


def test_weight_floor_and_overhead():
    assert toy(overhead=0.002).time(BATCH) == pytest.approx(HAND + 0.002, rel=1e-12)
    assert toy(weight_floor=0.01).time(BATCH) == 0.01                     # eq. (7) below the floor
    assert toy(weight_floor=0.01, overhead=0.002).time(BATCH) == pytest.approx(0.012, rel=1e-12)
    assert toy(weight_floor=0.001).time(BATCH) == pytest.approx(HAND, rel=1e-12)   # above it
    arrays = BatchShape(np.array([0.0, 4000.0]), np.array([0.0, 1.0]), np.zeros(2), np.array([0.0, 4000.0]),
                        np.array([1.0, 0.0]), np.array([10.0, 0.0]))
    t = toy(weight_floor=0.01, overhead=0.002).time(arrays)
    assert t[0] == pytest.approx(0.012) and t[1] > 0.012


@pytest.mark.parametrize("kw,name", [
    ({"t_row": 0}, "t_row"), ({"t_col": -4}, "t_col"), ({"t_red": 2.5}, "t_red"), ({"t_col": True}, "t_col"),
    ({"lin_tile_s": -1e-3}, "lin_tile_s"), ({"nonlin_token_s": float("nan")}, "nonlin_token_s"),
    ({"pair_tile_s": float("inf")}, "pair_tile_s"), ({"decode_attn_token_s": -1.0}, "decode_attn_token_s"),
    ({"weight_floor": float("nan")}, "weight_floor"), ({"overhead": -0.1}, "overhead"),
    ({"lin_tile_s": 0.0, "nonlin_token_s": 0.0}, "lin_tile_s"),
])
def test_bad_parameters_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        toy(**kw)


@pytest.mark.parametrize("overrides,needle", [({"t_row": "0"}, "t_row"), ({"lin_tile_s": "nan"}, "lin_tile_s"),
                                              ({"pair_tile_s": "-1"}, "pair_tile_s"), ({"t_red": "1.5"}, "t_red"),
                                              ({"model": "x"}, "--model"), ({"gpu": "x"}, "--gpu")])
def test_make_cost_model_rejects(overrides, needle):
    with pytest.raises(KvschedError, match=needle):
        make_cost_model("tiled", overrides, MISTRAL, ADA)


def test_make_cost_model_and_registry():
    assert COST_MODELS["tiled"] is TiledCost and COST_MODELS["tiled-mistral-7b-rtx-6000-ada"] is TiledCost
    cm = make_cost_model("tiled", {"t_row": "64", "t_col": "32", "t_red": "16", "overhead": "0.001"}, MISTRAL, ADA)
    assert (cm.t_row, cm.t_col, cm.t_red, cm.t_lcm, cm.overhead) == (64, 32, 16, 64, 0.001)
    assert cm.model is MISTRAL and cm.gpu is ADA and cm.weight_floor == 0
    # decode attention defaults to the KV read time per token per layer
    assert cm.decode_attn_token_s == pytest.approx(2 * 8 * 128 * 2 / 0.96e12, rel=1e-12)
    preset = make_cost_model("tiled-mistral-7b-rtx-6000-ada", {"overhead": "0"}, MISTRAL, ADA)
    assert preset.overhead == 0 and preset.lin_tile_s == TILED_PRESETS["tiled-mistral-7b-rtx-6000-ada"]["lin_tile_s"]
    assert TiledCost(MISTRAL, ADA, t_row=8, t_col=12, t_red=32).t_lcm == 96
    with pytest.raises(ValueError, match="t_red=10 does not divide d"):
        TiledCost(MISTRAL, ADA, t_red=10)


def test_cli_runs_with_the_tiled_models():
    for cost in ("tiled", "tiled-mistral-7b-rtx-6000-ada"):
        r = CliRunner().invoke(app, ["simulate", "--num-requests", "20", "--rate", "5", "--model", "mistral-7b",
                                     "--gpu", "rtx-6000-ada", "--cost", cost, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["completed"] == 20


def test_aggregate_path_matches_chunks_for_equal_chunks():
    cm = toy(weight_floor=0.004, overhead=0.001)
    rng = np.random.default_rng(1)
    p = rng.integers(0, 300, 40)
    c = rng.integers(1, 200, 40) * (rng.random(40) < 0.8)
    k = np.where(c > 0, rng.integers(1, 4, 40), 0)          # k equal chunks of c over p each
    nd = rng.integers(0, 20, 40)
    nd[k == 0] = np.maximum(nd[k == 0], 1)
    ctx = nd * rng.integers(1, 500, 40)
    arrays = BatchShape((k * c).astype(float), k.astype(float), k * c * (p + (c + 1) / 2), (k * (p + c)).astype(float),
                        nd.astype(float), ctx.astype(float))
    vec = cm.time(arrays)
    for j in range(40):
        exact = cm.time(BatchShape(int(k[j] * c[j]), int(k[j]), 0.0, int(k[j] * (p[j] + c[j])), int(nd[j]),
                                   int(ctx[j]), [(int(p[j]), int(c[j]))] * int(k[j])))
        assert vec[j] == pytest.approx(exact, rel=1e-12)
        agg = cm.time(BatchShape(float(k[j] * c[j]), float(k[j]), 0.0, float(k[j] * (p[j] + c[j])), float(nd[j]),
                                 float(ctx[j])))
        assert agg == pytest.approx(exact, rel=1e-12)


def test_fit_coefficients_run_on_tiled():
    for name in ("tiled", "tiled-mistral-7b-rtx-6000-ada"):
        co = coefficients(make_cost_model(name, {}, MISTRAL, ADA), 512, 256)
        assert all(math.isfinite(v) for v in co.as_dict().values()) and co.beta_p > 0 and not co.exact


def test_decode_error_bound_of_eq5():
    """eq. (5) with ceilings minus the model, per decode per layer, is in
    [0, decode_attn_token_s (t_row + t_col) / 2)."""
    cm = toy()
    d, tr, tc, a = 16, cm.t_row, cm.t_col, cm.decode_attn_token_s
    inv_mu = a * tr * tc / (2 * d)              # decode_attn_token_s = 2 d / (mu t_row t_col)
    for i in range(1, 400):
        exact = inv_mu * (d / tc * math.ceil(i / tr) + math.ceil(i / tc) * d / tr)
        gap = exact - a * i
        assert -1e-18 <= gap < a * (tr + tc) / 2


# --- Theorem 1 helpers ----------------------------------------------------------------------

def test_prefill_time_per_request_chunks_of_t_lcm():
    cm = toy()                                  # t_lcm = lcm(8, 4, 2) = 8
    assert cm.prefill_chunks(20) == [(0, 8), (8, 8), (16, 4)]
    by_hand = sum(1e-3 * math.ceil(c / 4) + 2e-5 * c
                  + 3e-7 * 2 * (math.ceil((p + c) / 8) * math.ceil(c / 4) * 8 + 2 * math.ceil(c / 4)
                                * math.ceil((p + c) / 2))
                  for p, c in [(0, 8), (8, 8), (16, 4)])
    assert cm.prefill_time_per_request(20) == pytest.approx(by_hand, rel=1e-12)
    assert cm.prefill_time_per_request(0) == 0
    assert list(cm.prefill_time_per_request(np.array([20, 8]))) == pytest.approx(
        [by_hand, cm.prefill_time_per_request(8)], rel=1e-12)
    floored = toy(weight_floor=1.0, overhead=0.5)
    assert floored.prefill_time_per_request(20, floor_and_overhead=True) == pytest.approx(3 * 1.5)
    # whole t_lcm chunks: the linear and attention terms are Theorem 1's exactly
    k = cm.theorem1_terms()
    for lp in (8, 16, 64):
        assert cm.prefill_time_per_request(lp) == pytest.approx(
            k["linear_per_token"] * lp + k["nonlinear_per_token"] * lp + k["prefill_attn_per_pair"] * lp * (lp + 8),
            rel=1e-12)


def test_mean_request_time_matches_brute_force():
    cm = toy()
    lp = np.array([8, 20, 64, 3, 100])
    ld = np.array([5, 1, 12, 0, 30])
    n, d, t = 2, 16, (8, 4, 2)
    per = []
    for p, o in zip(lp, ld):
        total = 1e-3 * (p + o) / 4 + 2e-5 * (p + o)
        for i in range(1, o + 1):
            total += n * 4e-8 * (p + i)
        total += n * d * 3e-7 / (t[0] * t[1] * t[2]) * p * (p + 8)
        per.append(total)
    assert cm.mean_request_time(lp, ld) == pytest.approx(sum(per) / len(per), rel=1e-12)
    # the same from eq. (7) itself when prompts are whole t_lcm chunks and decodes run in full
    # t_col-decode batches (each decode's share of a batch of t_col equal contexts)
    lp8 = np.array([8, 16, 64])
    ld8 = np.array([3, 0, 7])
    brute = [cm.prefill_time_per_request(int(p)) + sum(
        cm.compute_time(BatchShape(decode_seqs=4, decode_ctx=4 * (p + i))) / 4 for i in range(1, o + 1))
        for p, o in zip(lp8, ld8)]
    assert cm.mean_request_time(lp8, ld8) == pytest.approx(np.mean(brute), rel=1e-12)
    with pytest.raises(ValueError, match="equal-length"):
        cm.mean_request_time([1, 2], [1])


# --- the fitted preset ----------------------------------------------------------------------

BUDGETS = [64, 128, 256, 384, 512, 768, 1024]
MEAN_BATCH_MS = [22.72, 24.07, 28.82, 37.80, 46.51, 57.08, 74.69]
MEDIAN_TTFT_MS = [724.3, 386.3, 238.8, 243.9, 212.2, 204.9, 201.5]


def test_preset_reproduces_the_measured_batch_times():
    """Each measured run is the prompt's chunks plus one decode batch (context 2049): TTFT is the
    chunks' sum, the mean batch time averages them with the decode batch."""
    cm = make_cost_model("tiled-mistral-7b-rtx-6000-ada", {}, MISTRAL, ADA)
    decode = cm.time(BatchShape(decode_seqs=1, decode_ctx=2049))
    batch_err, ttft_err = [], []
    for c, mb, mt in zip(BUDGETS, MEAN_BATCH_MS, MEDIAN_TTFT_MS):
        times = [cm.time(shape([pc])) for pc in cm.prefill_chunks(2048, c)]
        batch_err.append(abs((np.sum(times) + decode) / (len(times) + 1) * 1e3 / mb - 1))
        ttft_err.append(abs(np.sum(times) * 1e3 / mt - 1))
    assert max(batch_err) <= 0.036             # documented: 3.5% (c = 384)
    assert max(ttft_err) <= 0.050              # documented: 4.9% (c = 384)


def test_fit_script_reproduces_the_preset_and_defaults():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_tiled.py"
    spec = importlib.util.spec_from_file_location("fit_tiled", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fits = mod.fit()
    assert fits["preset"] == TILED_PRESETS["tiled-mistral-7b-rtx-6000-ada"]
    defaults = TiledCost(MISTRAL, ADA)
    assert fits["paper"] == {k: getattr(defaults, k) for k in ("lin_tile_s", "nonlin_token_s", "pair_tile_s")}
