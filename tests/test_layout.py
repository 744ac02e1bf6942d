"""Replicas over several GPUs and in other number formats (issue "Today's deployments"): the
roofline's hand-worked cases, KV per GPU and capacity under sharding, and the checks."""
from __future__ import annotations

import math

import pytest

from kvsched.cost.roofline import DenseTime, RooflineCost
from kvsched.cost.shape import BatchShape
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model, kv_capacity_tokens
from kvsched.layout import Layout, kv_bytes_per_token, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu

H100 = dict(bf16=989e12, fp8=1979e12, bw=3.35e12, link=450e9, lat=1e-5, overhead=0.0005, me=0.75)   # its GPU file
CE, ME, OVERHEAD = 0.5, 0.8, 0.004          # the roofline's defaults (H100's file sets its own overhead)


def decode(n: int, ctx_each: int) -> BatchShape:
    return BatchShape(0, 0, 0, 0, n, n * ctx_each, (), False)


def test_llama_3_1_70b_tp4_decode_64_at_2000_by_hand():
    """Llama-3.1-70B (80 layers, hidden 8192, 64 heads, 8 KV heads of 128) on 4 H100 SXM, one
    decode batch of 64 requests at context 2,000, worked out with the numbers themselves."""
    m = get_model("llama-3.1-70b")
    P = 70_553_706_496                                      # parameters, from its config.json
    assert m.params == P
    T, C = 64, 64 * 2000
    compute = (2 * P * T + 4 * 80 * 64 * 128 * C) / (H100["bf16"] * CE * 4)
    kv_gpu = 80 * (8 // 4) * 2 * 128 * 2                    # 2 KV heads per GPU: 81,920 bytes a token
    memory = (P * 2 / 4 + kv_gpu * C) / (H100["bw"] * H100["me"])
    allreduce = 2 * 80 * (2 * 3 / 4 * T * 8192 * 2 / H100["link"] + H100["lat"])   # 160 ring all-reduces
    expected = H100["overhead"] + max(compute, memory) + allreduce
    cost = RooflineCost(m, get_gpu("h100-sxm"), layout=Layout(tp=4))
    assert cost.time(decode(64, 2000)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.020873, abs=1e-6)     # 18.2 ms of reads, 2.2 ms of all-reduces
    assert kv_bytes_per_token_per_gpu(m, Layout(tp=4)) == kv_gpu
    assert DenseTime.of(cost) is None                        # the collectives: the general path


@pytest.mark.parametrize("n", [1, 256])
def test_mixtral_8x7b_ep2_decode_by_hand(n):
    """Mixtral-8x7B with its 8 experts spread over 2 H100s (tp 2, ep 2): the batch reads the
    experts its tokens touch, 8 x (1 - (1 - 2/8)^n) of 8 (a quarter at n = 1, all at 256); each
    GPU holds 4 whole experts, and their partial outputs are all-reduced like a dense MLP's
    (vLLM exchanges tokens between experts only under data-parallel attention)."""
    m = get_model("mixtral-8x7b")
    expert = 3 * 4096 * 14336                               # one expert of one layer
    X = 32 * 8 * expert                                     # the routed experts: 45.1 billion
    assert m.expert_params == X and (m.experts, m.experts_per_token, m.moe_layers) == (8, 2, 32)
    P, A, emb = m.params, m.active, m.embedding_params
    T, C = n, n * 1000
    touched = 1 - (1 - 2 / 8) ** T
    compute = (2 * A * T + 4 * 32 * 32 * 128 * C) / (H100["bf16"] * CE * 2)
    kv_gpu = 32 * 4 * 2 * 128 * 2
    non_expert = (emb * 2 + (P - emb - X) * 2) / 2
    memory = (non_expert + X * 2 * 4 / 8 * touched + kv_gpu * C) / (H100["bw"] * H100["me"])
    allreduce = 2 * 32 * (2 * 1 / 2 * T * 4096 * 2 / H100["link"] + H100["lat"])
    expected = H100["overhead"] + max(compute, memory) + allreduce
    cost = RooflineCost(m, get_gpu("h100-sxm"), layout=Layout(tp=2, ep=2))
    assert cost.time(decode(n, 1000)) == pytest.approx(expected, rel=1e-12)
    assert touched == (0.25 if n == 1 else pytest.approx(1.0))


def test_qwen3_moe_with_data_parallel_attention_by_hand():
    """Qwen3-30B-A3B on 4 H200s, attention data-parallel over 4 ranks (tp 1, ep 4): each GPU
    computes a quarter of the batch, holds 32 of the 128 experts and a quarter of the KV, and
    every MoE layer all-gathers the ranks' tokens and reduce-scatters the outputs."""
    m = get_model("qwen3-30b-a3b")
    lay = Layout(tp=1, ep=4, dp_attention=True)
    assert (lay.dp, lay.gpus) == (4, 4)
    T, C = 128, 128 * 3000
    X, P, emb = m.expert_params, m.params, m.embedding_params
    touched = 1 - (1 - 8 / 128) ** T
    compute = (2 * m.active * T + 4 * 48 * 32 * 128 * C) / (989e12 * CE * 4)
    kv_gpu = 48 * 4 * 2 * 128 * 2
    memory = ((P - X) * 2 + X * 2 * 32 / 128 * touched + kv_gpu * C / 4) / (4.8e12 * ME)
    exchange = 48 * 2 * (3 / 4 * T * 2048 * 2 / 450e9 + 1e-5)
    cost = RooflineCost(m, get_gpu("h200"), layout=lay)
    assert cost.time(decode(T, 3000)) == pytest.approx(OVERHEAD + max(compute, memory) + exchange, rel=1e-12)
    assert weight_bytes_per_gpu(m, lay) == pytest.approx((P - X) * 2 + X * 2 / 4)


def test_moe_decode_turns_from_bandwidth_to_compute_bound():
    """Per token, a MoE decode batch costs ever less as the batch grows until every expert is
    read; at batch 1 it reads a quarter of Mixtral's experts, not all of them (nor k/E x n)."""
    cost = RooflineCost(get_model("mixtral-8x7b"), get_gpu("h100-sxm"), layout=Layout(tp=2, ep=2))
    per_token = [cost.time(decode(n, 1000)) / n for n in (1, 2, 4, 8, 64, 256)]
    assert all(a > b for a, b in zip(per_token, per_token[1:]))
    one = cost.time(decode(1, 1000))
    dense_reads = RooflineCost(get_model("mixtral-8x7b"), get_gpu("h100-sxm"), layout=Layout(tp=2, ep=2))
    assert one < dense_reads.time(decode(256, 1000))


def test_deepseek_v3_mla_kv_and_one_prefill_chunk_by_hand():
    """DeepSeek-V3: the MLA cache holds kv_lora_rank + qk_rope_head_dim = 576 values per token
    and layer on every TP rank (61 layers: 70,272 bytes at bf16, 35,136 at fp8); one prefill
    chunk of 2,048 new tokens on 8 H200s, FP8 weights, experts spread over the 8 (tp 8, ep 8);
    a decode pair costs the absorbed 2 x 128 x (576 + 512) FLOPs per layer."""
    m = get_model("deepseek-v3")
    assert m.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    lay = Layout(tp=8, ep=8, weight_dtype="fp8", kv_dtype="fp8")
    assert kv_bytes_per_token_per_gpu(m, lay) == 61 * 576 == kv_bytes_per_token(m, lay)   # not split by TP
    h200 = get_gpu("h200")
    c = 2048
    pairs = c * (0 + (c + 1) / 2)
    E, k, X, P = 256, 8, m.expert_params, m.params
    emb = m.embedding_params
    touched = 1 - (1 - k / E) ** c
    # MLA prefill runs expanded: per pair and layer 2 x 128 heads x (192 qk + 128 v), at the bf16 rate
    compute = (2 * m.active * c + 2 * 61 * 128 * (192 + 128) * pairs * (1979e12 / 989e12)) / (1979e12 * CE * 8)
    non_expert = (emb * 2 + (P - emb - X) * 1) / 8
    memory = (non_expert + X * 32 / 256 * touched + 61 * 576 * c) / (4.8e12 * ME)
    tp_reduce = 2 * 61 * (2 * 7 / 8 * c * 7168 * 2 / 450e9 + 1e-5)     # experts all-reduced as an MLP
    expected = OVERHEAD + max(compute, memory) + tp_reduce
    cost = RooflineCost(m, h200, layout=lay)
    assert cost.time(BatchShape(c, 1, pairs, c, 0, 0, ((0, c),), False)) == pytest.approx(expected, rel=1e-12)
    assert compute > memory                                 # a long prefill chunk is compute-bound
    # its FP8 weights fit 8 H200s, its bf16 weights do not
    assert kv_capacity_tokens(m, h200, 0.9, lay) > 0
    with pytest.raises(KvschedError, match="do not fit"):
        kv_capacity_tokens(m, h200, 0.9, Layout(tp=8, ep=8))
    one = RooflineCost(m, h200, layout=lay, compute_efficiency=1.0)
    d = BatchShape(0, 0, 0, 0, 1, 1000, (), False)
    assert one._mla[1] == 2 * 61 * 128 * (576 + 512) * (1979e12 / 989e12)
    assert one.time(d) > 0


def test_one_bf16_gpu_is_the_single_gpu_roofline_bit_for_bit():
    """A layout of one bf16 GPU changes nothing: the same terms, the same DenseTime."""
    m, g = get_model("llama-3.1-8b"), get_gpu("a100-80gb")
    plain, laid = RooflineCost(m, g), RooflineCost(m, g, layout=Layout())
    for s in (decode(7, 900), BatchShape(512, 1, 512 * 256.5, 512, 3, 3000, ((0, 512),), False)):
        assert plain.time(s) == laid.time(s)
    assert DenseTime.of(laid) is not None
    assert weight_bytes_per_gpu(m, Layout()) == m.weight_bytes
    profile = 80 * 2**30 * 0.9 - m.params * 2 - 1024 * m.vocab * 16 - int(1.35 * 2**30)   # memory_profile.py
    assert kv_capacity_tokens(m, g, 0.9) == int(profile // m.kv_bytes_per_token)


def test_precision_sets_bytes_and_rate():
    """FP8 weights halve the bytes of all but the embeddings and head and run at the FP8 rate
    where the GPU has one (H100), at the bf16 rate where it has none (A100: weight-only)."""
    m = get_model("llama-3.1-8b")
    emb = m.embedding_params
    assert weight_bytes_per_gpu(m, Layout(weight_dtype="fp8")) == pytest.approx(emb * 2 + (m.params - emb))
    assert weight_bytes_per_gpu(m, Layout(weight_dtype="int4")) == pytest.approx(
        emb * 2 + (m.params - emb) * (0.5 + 2.5 / 128))
    assert kv_bytes_per_token_per_gpu(m, Layout(kv_dtype="fp8")) * 2 == m.kv_bytes_per_token
    prefill = BatchShape(4096, 1, 4096 * 2048.5, 4096, 0, 0, ((0, 4096),), False)
    h100, a100 = get_gpu("h100-sxm"), get_gpu("a100-80gb")
    fast = RooflineCost(m, h100, layout=Layout(weight_dtype="fp8"))._flop_rate
    assert fast == 1979e12 * 0.5 and RooflineCost(m, a100, layout=Layout(weight_dtype="fp8"))._flop_rate == 312e12 * 0.5
    assert RooflineCost(m, h100, layout=Layout(weight_dtype="fp8")).time(prefill) < RooflineCost(m, h100).time(prefill)
    tokens = kv_capacity_tokens(m, h100, 0.9, Layout(kv_dtype="fp8"))
    assert tokens == pytest.approx(2 * kv_capacity_tokens(m, h100, 0.9), abs=2)


def test_kv_heads_are_replicated_past_tp_and_capacity_grows_with_gpus():
    """vLLM keeps max(1, kv_heads // tp) heads per GPU: Llama-3.1-70B's 8 KV heads at tp 16
    leave one per GPU (not half); pipeline stages hold ceil(layers / pp) layers each."""
    m = get_model("llama-3.1-70b")
    assert kv_bytes_per_token_per_gpu(m, Layout(tp=8)) == 80 * 1 * 256 * 2
    assert kv_bytes_per_token_per_gpu(m, Layout(tp=16)) == 80 * 1 * 256 * 2
    assert kv_bytes_per_token_per_gpu(m, Layout(pp=3)) == math.ceil(80 / 3) * 8 * 256 * 2
    h100 = get_gpu("h100-sxm")
    with pytest.raises(KvschedError, match="do not fit"):
        kv_capacity_tokens(m, h100, 0.9)
    two, four = (kv_capacity_tokens(m, h100, 0.9, Layout(tp=t)) for t in (2, 4))
    assert four > 2 * two
    dp = Layout(tp=2, ep=8, dp_attention=True)
    q = get_model("qwen3-30b-a3b")
    assert dp.gpus == 8 and kv_capacity_tokens(q, h100, 0.9, dp) % 4 == 0


@pytest.mark.parametrize("layout, model, message", [
    (Layout(tp=0), "llama-3.1-8b", "--tp must be a whole number"),
    (Layout(tp=3), "llama-3.1-8b", "does not divide"),
    (Layout(ep=2), "llama-3.1-8b", "--ep 2 without --dp-attention"),
    (Layout(tp=2, ep=2), "llama-3.1-8b", "has no experts"),
    (Layout(ep=3, tp=2, dp_attention=True), "qwen3-30b-a3b", "modelled with --tp 1"),
    (Layout(ep=1, dp_attention=True), "qwen3-30b-a3b", "at least 2"),
    (Layout(pp=99), "llama-3.1-8b", "more than llama-3.1-8b's 32 layers"),
    (Layout(tp=16, ep=16), "mixtral-8x7b", "--ep 16 is more than mixtral-8x7b's 8 experts"),
    (Layout(ep=16, dp_attention=True), "mixtral-8x7b", "more than mixtral-8x7b's 8 experts"),
    (Layout(tp=7), "qwen2-7b", "neither divides nor is a multiple of qwen2-7b.s 4 KV heads"),
    (Layout(tp=6), "mixtral-8x22b", "neither divides nor is a multiple of mixtral-8x22b's 8 KV heads"),
    (Layout(kv_dtype=["fp8"]), "llama-3.1-8b", "--kv-dtype must be one of"),
    (Layout(weight_dtype="fp6"), "llama-3.1-8b", "--weight-dtype must be one of"),
    (Layout(kv_dtype="int8"), "llama-3.1-8b", "--kv-dtype must be one of"),
    (Layout(tp=True), "llama-3.1-8b", "--tp must be a whole number"),
])
def test_bad_layouts_are_one_line_errors(layout, model, message):
    with pytest.raises(KvschedError, match=message):
        layout.check(get_model(model))


def test_the_tiled_model_refuses_a_layout():
    from kvsched.cost import make_cost_model
    m, g = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    with pytest.raises(KvschedError, match="needs --cost roofline"):
        make_cost_model("tiled", {}, m, g, Layout(tp=2))
    with pytest.raises(KvschedError, match="set layout with --tp"):
        make_cost_model("roofline", {"layout": "x"}, m, g)


def test_an_mla_model_without_its_dims_is_refused():
    import dataclasses
    m = dataclasses.replace(get_model("deepseek-v3"), mla_dims=(0, 0, 0))
    with pytest.raises(ValueError, match="needs mla_dims"):
        RooflineCost(m, get_gpu("h200"), layout=Layout(tp=8, weight_dtype="fp8"))
