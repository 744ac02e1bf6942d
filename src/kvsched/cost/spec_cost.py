"""Batch time under speculative decoding (docs/speculative-decoding.md): the target model's
batch, in which each verifying decoder is a prefill-like chunk of 1 + s tokens over its KV
(`sim/batch.py`, `verify_shape`: attention over the context, the weights read once by the whole
batch), plus the drafter's passes.

The drafter (vLLM 0.32's `vllm/v1/spec_decode/eagle.py` `propose`, which the draft-model proposer
shares): after the target's forward it runs once over every token the batch scheduled (its
hidden states or tokens), then k - 1 times over one token per request, k the drafts it
proposes (`Speculation.k_now`). Its model:
- `eagle` / `mtp`: extra layers on the target (an EAGLE head is one decoder layer, DeepSeek's
  MTP module one layer, `num_nextn_predict_layers`), costed as those layers of the target
  (`head_model`): its per-layer weights and KV, and the shared embeddings and LM head, read in
  every pass;
- `draft`: a catalogue model (`--spec-draft-model`) on the same GPUs and layout;
- `ngram`: proposed on the CPU, no GPU time.
The drafter's passes add no per-step overhead or CPU time of their own: they run inside the
target's step (vLLM captures them in the same CUDA graph launch sequence). The drafter is a
roofline whatever the target's cost model is (it needs the catalogue model).
"""
from __future__ import annotations

from dataclasses import replace

from kvsched.cost.shape import BatchShape
from kvsched.hardware import GPU, Model
from kvsched.layout import PLAIN, Layout, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu


def head_model(m: Model, layers: int = 1) -> Model:
    """The target's `layers` extra layers (EAGLE head, MTP module) as a model of their own: that
    share of its non-embedding weights (an MoE layer's routed experts if the target has MoE
    layers), the LM head it shares with the target (vocab x hidden, read whole by every draft
    pass; the embedding table is only looked up), and its per-layer KV."""
    dense_per_layer = (m.params - m.embedding_params - m.expert_params) / m.layers
    experts = m.expert_params / m.moe_layers * layers if m.moe_layers else 0.0
    lm_head = float(min(m.embedding_params, m.vocab * m.hidden)) if m.embedding_params else 0.0
    params = lm_head + dense_per_layer * layers + experts
    active = None
    if m.active_params is not None:
        active_experts = experts * m.experts_per_token / m.experts if m.experts else experts
        active = lm_head + dense_per_layer * layers + active_experts
    kv = None if m.kv_token_bytes is None else m.kv_token_bytes * layers // m.layers
    return replace(m, name=f"{m.name}+{layers}-layer-head", layers=layers, params=params, active_params=active,
                   expert_params=experts, embedding_params=lm_head, moe_layers=min(m.moe_layers, layers), kv_token_bytes=kv)


def drafter_model(method: str, target: Model, draft: Model | None) -> Model | None:
    """The model the drafter runs: None for n-gram."""
    if method == "ngram":
        return None
    if method == "draft":
        return draft
    return head_model(target, 1)


class DrafterLine:
    """A drafter pass fitted from step logs (cost/calibrate.py, `fit_drafter`): e0 seconds plus e1
    per token it runs (the first pass over the step's tokens, the others over one per request)."""

    def __init__(self, e0: float, e1: float) -> None:
        self.e0, self.e1 = e0, e1

    def time(self, shape: BatchShape):
        return self.e0 + self.e1 * shape.tokens


def drafter_cost(method: str, target: Model, draft: Model | None, gpu: GPU, layout: Layout = PLAIN):
    """The drafter's roofline (no overhead, no CPU time: module docstring), None for n-gram."""
    from kvsched.cost.roofline import RooflineCost
    m = drafter_model(method, target, draft)
    if m is None:
        return None
    return RooflineCost(model=m, gpu=gpu, layout=layout, overhead=0.0, cpu_per_request=0.0, cpu_per_token=0.0)


def capacity_with_drafter(tokens: int, block_size: int, target: Model, drafter: Model | None,
                          layout: Layout = PLAIN) -> int:
    """KV tokens left when the drafter's weights and KV share the GPU (vLLM profiles both models
    and gives every layer, the drafter's too, a slot per token): the bytes the target's `tokens`
    would use, less the drafter's weights, over the target's plus the drafter's bytes per token;
    whole blocks, vLLM's null block aside (hardware.py, `usable_kv_tokens`)."""
    if drafter is None:
        return tokens
    per_t = kv_bytes_per_token_per_gpu(target, layout)
    per_d = kv_bytes_per_token_per_gpu(drafter, layout)
    room = (tokens + block_size) * per_t - weight_bytes_per_gpu(drafter, layout)
    blocks = int(room // ((per_t + per_d) * block_size)) - 1
    return max(blocks, 0) * block_size


def best_k_schedule(target, drafter, rates: tuple[float, ...], ctx: int, max_batch: int = 1024,
                    proposal_rate: float = 1.0) -> tuple[tuple[int, int, int], ...]:
    """`--spec-adaptive auto`: for each batch size b of decoders (1..max_batch), the k in 0..K
    (K = len(rates)) with the most expected tokens per second, tokens(b, k) / time(b, k). Of the b
    decoders, v = round(b x proposal_rate) have drafts (n-gram hits) and yield
    E[tokens | k] = sum_{j=0..k} prod_{i<j} a_i each (sim/spec_acceptance.py), the others 1;
    time(b, k) is that batch over `ctx` KV tokens per decoder (`SpecCost`, the drafter's k passes
    included; k = 0 is plain decoding). The default acceptance only (per-tier rates are not
    weighed). As vLLM's schedule: inclusive batch-size ranges with their k
    (sim/spec_decode.py, `parse_schedule`)."""
    expect = [1.0]
    run = 1.0
    for a in rates:
        run *= a
        expect.append(expect[-1] + run)

    class _K:
        k_now = 0
    probe = _K()
    cost = SpecCost(target, drafter, probe)
    best = []
    for b in range(1, max_batch + 1):
        rate = []
        v = int(round(b * proposal_rate))
        for k in range(len(rates) + 1):
            probe.k_now = k
            q = 1 + k
            n = v if k else 0               # decoders verifying drafts
            shape = BatchShape(n * q, n, n * q * (ctx + (q + 1) / 2), n * (ctx + q), b - n, (b - n) * (ctx + 1),
                               [(ctx, q)] * n)
            rate.append((b - n + n * expect[k]) / float(cost.time(shape)))
        best.append(max(range(len(rate)), key=lambda k: (rate[k], -k)))
    out = []
    for b, k in enumerate(best, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return tuple(out)


class SpecCost:
    """The target's batch time plus the drafter's passes (module docstring). `spec` is the
    replica's `Speculation` (its `k_now`: the drafts proposed after this step)."""

    def __init__(self, target, drafter, spec) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec

    def time(self, shape: BatchShape):
        t = self.target.time(shape)
        k = self.spec.k_now
        if self.drafter is None or not k:
            return t
        t += self.drafter.time(replace(shape, phase_switch=False))
        if k > 1:
            each = BatchShape(decode_seqs=shape.prefill_seqs + shape.decode_seqs,
                              decode_ctx=shape.prefill_ctx + shape.decode_ctx)
            t += (k - 1) * self.drafter.time(each)
        return t

    def __getattr__(self, name: str):
        """What else the replica reads of a cost model (its name, parameters) is the target's."""
        if name in ("target", "drafter", "spec"):
            raise AttributeError(name)
        return getattr(self.target, name)
