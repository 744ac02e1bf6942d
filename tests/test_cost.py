"""Batch-time models against their formulas, scalar and vectorised."""
import numpy as np
import pytest

from kvsched.cost import BatchShape, make_cost_model
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model

M, G = get_model("qwen2-7b"), get_gpu("a30")


def model(name, **p):
    return make_cost_model(name, {k: str(v) for k, v in p.items()}, M, G)


def test_constant_and_linear():
    s = BatchShape(prefill_tokens=100, prefill_seqs=1, decode_seqs=3, decode_ctx=60)
    assert model("constant", b=0.05).time(s) == 0.05
    assert model("linear", d0=0.01, d1=0.001).time(s) == pytest.approx(0.01 + 0.001 * 160)


def test_phase_picks_the_batch_kind():
    pm = model("phase", alpha_p=1, beta_p=0.1, alpha_d=2, beta_d=0.2, alpha_mb=3, c0=0.01, c1=0.02, c2=0.04)
    assert pm.time(BatchShape(prefill_tokens=10)) == pytest.approx(1 + 0.1 * 10)
    assert pm.time(BatchShape(decode_seqs=5, decode_ctx=50)) == pytest.approx(2 + 0.2 * 5)
    r = 5 / 15
    assert pm.time(BatchShape(prefill_tokens=10, decode_seqs=5)) == pytest.approx(3 + (0.01 + 0.02 * r + 0.04 * r * r) * 15)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    rm = model("roofline", overhead=0)
    decode = rm.time(BatchShape(decode_seqs=1, decode_ctx=1000))
    assert decode == pytest.approx((M.weight_bytes + 1000 * M.kv_bytes_per_token) / (G.bandwidth * 0.8))
    p = 4096
    prefill = rm.time(BatchShape(prefill_tokens=p, prefill_seqs=1, prefill_attn=p * (p + 1) / 2, prefill_ctx=p))
    flops = 2 * M.params * p + 4 * M.layers * M.heads * M.head_dim * p * (p + 1) / 2
    assert prefill == pytest.approx(flops / (G.flops * 0.5))


def test_moe_reads_only_touched_experts():
    moe = make_cost_model("roofline", {"overhead": "0"}, get_model("qwen3-30b-a3b"), get_gpu("h200"))
    one = moe.time(BatchShape(decode_seqs=1, decode_ctx=1))
    many = moe.time(BatchShape(decode_seqs=512, decode_ctx=512))
    assert one < many and many <= 1.01 * get_model("qwen3-30b-a3b").weight_bytes / (4.8e12 * 0.8) + 1e-3


@pytest.mark.parametrize("name", ["constant", "linear", "phase", "roofline"])
def test_vectorised_equals_scalar(name):
    rng = np.random.default_rng(0)
    n = 50
    pt = rng.integers(0, 2000, n) * (rng.random(n) < 0.7)
    nd = rng.integers(0, 200, n)
    nd[pt == 0] = np.maximum(nd[pt == 0], 1)
    arrays = BatchShape(pt.astype(float), (pt > 0).astype(float), pt * (pt + 1) / 2.0, pt.astype(float),
                        nd.astype(float), nd * 300.0)
    cm = model(name)
    vec = cm.time(arrays)
    for k in range(n):
        scalar = cm.time(BatchShape(float(pt[k]), float(pt[k] > 0), pt[k] * (pt[k] + 1) / 2.0, float(pt[k]),
                                    float(nd[k]), nd[k] * 300.0))
        assert vec[k] == pytest.approx(scalar, rel=1e-12)


@pytest.mark.parametrize("name,params", [("constant", {"b": 0}), ("linear", {"d0": 0, "d1": 0}),
                                         ("phase", {"alpha_p": -1}), ("roofline", {"memory_efficiency": 2})])
def test_bad_parameters(name, params):
    with pytest.raises(KvschedError):
        model(name, **params)


def test_roofline_decode_time_is_time_bit_for_bit():
    """The decode runs' batch time (DenseTime.seconds, C numbers when compiled) equals `time`
    of that decode-only shape exactly, for every catalogue model it applies to."""
    import random

    from kvsched.cost.roofline import DenseTime, RooflineCost
    from kvsched.cost.shape import BatchShape
    from kvsched.hardware import MODELS, get_gpu, get_model
    rng = random.Random(0)
    for name in MODELS:
        c = RooflineCost(get_model(name), get_gpu("h100-sxm"))
        d = DenseTime.of(c)
        for _ in range(300):
            n = rng.randint(1, 2048)
            ctx = rng.randint(n, 8_000_000)
            shape_time = c.time(BatchShape(0, 0, 0, 0, n, ctx, (), False))
            assert c.decode_time(n, ctx) == shape_time
            assert d is None or d.seconds(n, ctx) == shape_time


def test_dense_time_is_time_bit_for_bit_at_the_edges():
    """DenseTime at integer weights and at its `ctx_limit`; it refuses what it cannot compute
    as `time` does (floats, numpy integers, beyond the limit: ValueError, in both builds);
    None for an MoE model or a GPU with a zero rate (`time` then raises for itself)."""
    import dataclasses

    from kvsched.cost.roofline import DenseTime, RooflineCost
    from kvsched.cost.shape import BatchShape
    from kvsched.hardware import GPU, MODELS, get_gpu, get_model
    gpu = get_gpu("h100-sxm")
    m = get_model("llama-2-7b")
    for model in (m, dataclasses.replace(m, params=6_738_415_616)):     # float and int weight bytes
        c = RooflineCost(model, gpu)
        d = DenseTime.of(c)
        assert d is not None and d.int_weights == (type(model.weight_bytes) is int)
        for n, ctx in ((1, 1), (0, 0), (7, 3**20), (5, d.ctx_limit)):
            assert d.seconds(n, ctx) == c.time(BatchShape(0, 0, 0, 0, n, ctx, (), False)), (n, ctx)
        for bad in ((7, d.ctx_limit + 1), (5000.9, 6000), (np.int64(4), 5000), (3, 2), (-1, 5), (2, 2**64)):
            with pytest.raises(ValueError, match="DenseTime.seconds"):
                d.seconds(*bad)
        with pytest.raises(ValueError, match="DenseTime.batch"):
            d.batch(3, 1, 10.5, 10.5)
        with pytest.raises(ValueError, match="DenseTime.batch"):
            d.batch(3, 1.0, 10, 10)
        assert c.decode_time(2, 10**19) == c.time(BatchShape(0, 0, 0, 0, 2, 10**19, (), False))   # beyond: Python
    moe = next(get_model(k) for k in MODELS if get_model(k).active_params is not None)
    assert DenseTime.of(RooflineCost(moe, gpu)) is None
    assert DenseTime.of(RooflineCost(m, GPU("no-flops", 80.0, 2e12, 0.0))) is None


def test_dense_time_of_mixed_batches_is_time_bit_for_bit():
    """DenseTime.batch from a shape's aggregates, as the replica calls it (sim/batch.py), equals
    `time` of that BatchShape for random prefill chunks and decodes, and a lone decode step."""
    import random

    from kvsched.cost.roofline import DenseTime, RooflineCost
    from kvsched.cost.shape import BatchShape
    from kvsched.hardware import MODELS, get_gpu, get_model
    rng = random.Random(1)
    cpu = ({}, {"cpu_per_request": 2e-4, "cpu_per_token": 1e-6}, {"cpu_per_request": 2e-4, "async_scheduling": False})
    for name, extra in ((name, extra) for name in MODELS for extra in cpu):
        c = RooflineCost(get_model(name), get_gpu("a100-80gb"), **extra)
        d = DenseTime.of(c)
        if d is None:
            continue
        for _ in range(300):
            chunks = [(rng.randint(0, 50_000), rng.randint(1, 8192)) for _ in range(rng.randint(0, 6))]
            pt = sum(k for _, k in chunks)
            pattn = sum(k * (p + (k + 1) / 2) for p, k in chunks) if chunks else 0
            pctx = sum(p + k for p, k in chunks)
            nd = rng.randint(0 if chunks else 1, 512)
            dctx = rng.randint(nd, 4_000_000) if nd else 0
            shape = BatchShape(pt, len(chunks), pattn, pctx, nd, dctx, chunks, False)
            assert d.batch(pt + nd, len(chunks) + nd, pattn + dctx, pctx + dctx) == c.time(shape), shape


def test_roofline_cpu_step_overlaps_the_gpu_step_under_async_scheduling():
    """RooflineCost: time = overhead + max(GPU, CPU) with async scheduling (vLLM's default),
    overhead + GPU + CPU without; CPU = cpu_per_request x requests + cpu_per_token x tokens."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.cost.shape import BatchShape
    from kvsched.hardware import get_gpu, get_model
    m, g = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    shape = BatchShape(100, 2, 100 * 50.5, 100, 30, 30_000, ((0, 60), (0, 40)), False)
    bare = RooflineCost(m, g, overhead=0.001, cpu_per_request=0.0, cpu_per_token=0.0)
    gpu = bare.time(shape) - 0.001
    for per_req, per_tok in ((1e-3, 0.0), (0.0, 1e-4), (1e-6, 0.0)):
        cpu = per_req * 32 + per_tok * 130
        on = RooflineCost(m, g, overhead=0.001, cpu_per_request=per_req, cpu_per_token=per_tok)
        off = RooflineCost(m, g, overhead=0.001, cpu_per_request=per_req, cpu_per_token=per_tok, async_scheduling=False)
        assert on.time(shape) == pytest.approx(0.001 + max(gpu, cpu), rel=1e-12)
        assert off.time(shape) == pytest.approx(0.001 + gpu + cpu, rel=1e-12)
    assert RooflineCost(m, g, overhead=0.001, cpu_per_request=1e-6).time(shape) == bare.time(shape)  # hidden, bit for bit
    for bad in ({"cpu_per_request": -1e-6}, {"cpu_per_token": float("nan")}, {"async_scheduling": "no"}):
        with pytest.raises(ValueError):
            RooflineCost(m, g, **bad)
