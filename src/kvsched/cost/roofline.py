"""Roofline batch time from the model and GPU catalogue: no profiling needed."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.cost.shape import BatchShape
from kvsched.hardware import GPU, Model
from kvsched.layout import (ACT_BYTES, COMPUTE_FORMAT, PLAIN, Layout, expert_bytes_per_gpu,
                            kv_bytes_per_token_per_gpu, weight_bytes_per_gpu)


DEFAULTS = {"compute_efficiency": 0.5, "memory_efficiency": 0.8, "overhead": 0.004,
            # the engine's CPU time per scheduled request: BLIS trained-physics beta_6, 4.42 us
            # (inference-sim/inference-sim@f90a1e3 defaults.yaml trained_physics_coefficients)
            "cpu_per_request": 4.42e-6, "cpu_per_token": 0.0}


@dataclass(frozen=True)
class RooflineCost:
    """time = overhead + max(GPU, CPU) (async scheduling; overhead + GPU + CPU without it), with
    GPU = max(FLOPs / (flops * compute_efficiency), bytes / (bandwidth * memory_efficiency))
          + collectives
    CPU = cpu_per_request x requests + cpu_per_token x tokens

    CPU is the engine's own time per step that grows with the batch (scheduling, input
    preparation, sampling, output processing). vLLM's async scheduling (vllm/config/vllm.py:
    `async_scheduling` None becomes True where the executor supports it; vllm/v1/engine/core.py
    `step_with_batch_queue`) prepares step k + 1 while the GPU runs step k, so the two overlap
    and the slower one sets the pace; `async_scheduling=False` adds them. `overhead` is the
    part that overlaps nothing (synchronisation, launches, the sampler's kernels).

    FLOPs: 2 * active parameters per computed token (the GEMMs, at the weight format's rate:
    layout.py COMPUTE_FORMAT) plus attention, 4 * layers * heads * head_dim per query-key pair
    (QK^T and AV, at the bf16 rate), split over the tp x dp GPUs that compute in parallel.
    Bytes, per GPU: its non-expert weights once per batch; for MoE its routed experts that the
    batch's tokens touch, E x (1 - (1 - k/E)^tokens) of E in expectation (each token picks k of E
    experts, taken as uniform and independent); and the KV cache the batch reads and writes, its
    heads' share (layout.py). Pipeline stages run one after another on one batch in flight, so
    their times add: pp GPUs hold the model but do not shorten an iteration (the bubble: each
    stage idles (pp - 1) / pp of it). Collectives (docs/hardware.md), on the GPU's link:
    tensor parallelism all-reduces each rank's T / dp tokens' activations (hidden x 2 bytes) twice
    per layer (ring: 2 (tp - 1) / tp x bytes / link bandwidth + latency), once in a MoE layer
    under data-parallel attention, whose experts' inputs and outputs are exchanged instead: an
    all-gather of the T tokens and a reduce-scatter of their outputs over the dp ranks, each
    (dp - 1) / dp x T x hidden x 2 bytes / link bandwidth + latency; pipeline stages hand
    T x hidden x 2 bytes over pp - 1 times (each + latency). Attention: MLA's prefill pairs at
    2 x heads x (qk + v head sizes), its decode pairs at 2 x heads x (latent + kv_lora_rank).
    The max is written as (a + b + |a - b|) / 2 so the model also evaluates on arrays.
    """
    model: Model
    gpu: GPU
    compute_efficiency: float | None = field(default=None, metadata={
        "help": "achieved / peak FLOP/s (default: the GPU file's [roofline], else 0.5)"})
    memory_efficiency: float | None = field(default=None, metadata={
        "help": "achieved / peak bandwidth (default: the GPU file's [roofline], else 0.8)"})
    overhead: float | None = field(default=None, metadata={
        "help": "per-iteration CPU/launch seconds (default: the GPU file's [roofline], else 0.004)"})
    cpu_per_request: float | None = field(default=None, metadata={
        "help": "engine CPU seconds per request in a step (default: the GPU file's [roofline], else 4.42e-6)"})
    cpu_per_token: float | None = field(default=None, metadata={
        "help": "engine CPU seconds per token in a step (default: the GPU file's [roofline], else 0)"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "the CPU step overlaps the GPU step (vLLM's default); false adds them"})
    layout: Layout = field(default=PLAIN, metadata={"help": "set with --tp, --pp, --ep, --dp-attention, "
                                                            "--weight-dtype, --kv-dtype"})

    def __post_init__(self) -> None:
        for name, default in DEFAULTS.items():        # None: the GPU's measured default, else the generic one
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.gpu.roofline.get(name, default))
        for name in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {self.overhead}")
        for name in ("cpu_per_request", "cpu_per_token"):
            v = getattr(self, name)
            if not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be seconds >= 0, got {v}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")
        m, lay, g = self.model, self.layout.check(self.model), self.gpu
        parallel = lay.tp * lay.dp                  # GPUs computing side by side
        gemm_rate = g.rate(COMPUTE_FORMAT[lay.weight_dtype])
        # attention at the bf16 rate, expressed in GEMM-rate FLOPs (x 1.0 when the rates agree)
        set_ = object.__setattr__
        ratio = gemm_rate / g.flops if gemm_rate != g.flops else 1.0
        set_(self, "_attn_flops", 4.0 * m.layers * m.heads * m.head_dim * ratio)
        # MLA (vLLM's mla_attention.py): prefill expanded, 2 h (qk + v) per pair and layer; decode
        # absorbed into the latent, 2 h (kv_lora_rank + rope) for QK and 2 h kv_lora_rank for AV
        qk, v, rank = m.mla_dims
        if m.mla and not (qk and v and rank):
            raise ValueError(f"{m.name}: an MLA model needs mla_dims (qk and v head sizes, kv_lora_rank)")
        set_(self, "_mla", (2.0 * m.layers * m.heads * (qk + v) * ratio,
                            2.0 * m.layers * m.heads * (m.head_dim + rank) * ratio) if m.mla else None)
        set_(self, "_flop_rate", gemm_rate * self.compute_efficiency * parallel)
        set_(self, "_byte_rate", g.bandwidth * self.memory_efficiency)
        kv = kv_bytes_per_token_per_gpu(m, replace(lay, pp=1))     # every stage's layers, in turn
        set_(self, "_kv_bytes", kv if lay.dp == 1 else kv / lay.dp)
        set_(self, "_gemm_flops", 2.0 * m.active)     # per computed token
        set_(self, "_dense", not m.experts)
        weights = weight_bytes_per_gpu(m, lay) * lay.pp          # every stage's, in turn
        experts = expert_bytes_per_gpu(m, lay)
        set_(self, "_weights", weights if not m.experts else weights - experts)
        set_(self, "_experts", experts)
        set_(self, "_miss", 1 - m.experts_per_token / m.experts if m.experts else 1.0)
        set_(self, "_comm", _collectives(m, g, lay))

    def time(self, shape: BatchShape):
        tokens = shape.prefill_tokens + shape.decode_seqs
        if self._mla is None:
            flops = self._gemm_flops * tokens + self._attn_flops * (shape.prefill_attn + shape.decode_ctx)
        else:
            flops = self._gemm_flops * tokens + self._mla[0] * shape.prefill_attn + self._mla[1] * shape.decode_ctx
        if self._dense:
            weights = self._weights + 0 * tokens
        else:   # MoE: the experts the batch's tokens touch, in expectation
            weights = self._weights + self._experts * (1 - self._miss ** tokens)
        kv = self._kv_bytes * (shape.prefill_ctx + shape.decode_ctx)
        compute = flops / self._flop_rate
        memory = (weights + kv) / self._byte_rate
        roof = (compute + memory + abs(compute - memory)) / 2
        if self._comm is not None:
            per_token, fixed = self._comm
            roof = roof + per_token * tokens + fixed
        cpu = self.cpu_per_request * (shape.prefill_seqs + shape.decode_seqs) + self.cpu_per_token * tokens
        if not self.async_scheduling:
            roof = roof + cpu
        elif isinstance(roof, np.ndarray) or isinstance(cpu, np.ndarray):
            roof = np.maximum(roof, cpu)
        elif cpu > roof:                    # as DenseTime: the GPU's time itself, bit for bit, when it is longer
            roof = cpu
        return self.overhead + roof

    def decode_time(self, n: int, ctx: int, phase_switch: bool = False) -> float:
        """A decode-only batch of n requests over ctx KV tokens: `time` of that BatchShape. (The
        replica times the roofline's batches with `DenseTime`, made from these terms when it
        starts: sim/decode_run.py, `dense_time`.)"""
        return self.time(BatchShape(0, 0, 0, 0, n, ctx, (), phase_switch))


def _collectives(m: Model, g: GPU, lay: Layout) -> tuple[float, float] | None:
    """(seconds per token, seconds per iteration) of the collectives (RooflineCost), or None on
    one GPU. Each call costs its bytes through one GPU's link plus the link's latency once (a
    call on small messages is latency-bound: vLLM's custom all-reduce does it in one or two
    shots). A ring all-reduce moves 2 (n - 1) / n of the bytes through each GPU's link, an
    all-gather or a reduce-scatter (n - 1) / n (NCCL's docs, "Performance": bus bandwidth).
    MoE: vLLM runs its expert-parallel exchange only with data-parallel attention
    (fused_moe/config.py `use_all2all_kernels`: use_ep and dp_size > 1), by default as an
    all-gather of the dp ranks' tokens and a reduce-scatter of the experts' outputs
    (config/parallel.py, all2all_backend "allgather_reducescatter"); with ep = tp the experts'
    partial outputs are all-reduced over the TP GPUs like a dense MLP's."""
    if lay.plain:
        return None
    act, bw, lat = ACT_BYTES * m.hidden, g.link_bandwidth, g.link_latency
    per_token = fixed = 0.0
    exchange = m.moe_layers if m.experts and lay.dp > 1 else 0
    if lay.tp > 1:                      # after attention and after the MLP (not the exchanged experts)
        reduces = 2 * m.layers - exchange
        per_token += reduces * 2 * (lay.tp - 1) / lay.tp * act / (lay.dp * bw)
        fixed += reduces * lat
    if exchange:                        # all-gather, then reduce-scatter, over the dp ranks
        per_token += exchange * 2 * (lay.dp - 1) / lay.dp * act / bw
        fixed += exchange * 2 * lat
    if lay.pp > 1:                      # the activations handed from stage to stage
        per_token += (lay.pp - 1) * act / bw
        fixed += (lay.pp - 1) * lat
    return per_token, fixed


class DenseTime:
    """`RooflineCost.time` of one batch of a dense model from its aggregates, bit for bit: the
    same operations in the same order, on the same numbers. Its terms are C doubles and
    integers when compiled (kvsched/compiled.py), so the replica's batches (sim/batch.py) and
    decode runs (sim/decode_run.py) call it without a Python number or a BatchShape; `of`
    builds one only when that holds: the float terms are Python floats, the KV bytes per
    token an int (its product with the KV tokens is then an exact integer in both, up to
    `ctx_limit`), and the weights' bytes a float or an int (kept an exact integer then, as
    Python's sum is), and the rates are nonzero (no division raises, in C or in Python).
    `seconds` and `batch` check their arguments; the engine calls `_batch` (a C call when
    compiled) with numbers it has checked. tests/test_cost.py compares it with `time`."""

    def __init__(self, gemm: float, attn: float, flop_rate: float, weights: float | int, kv_bytes: int,
                 byte_rate: float, overhead: float, cpu_request: float = 0.0, cpu_token: float = 0.0,
                 overlap: bool = True) -> None:
        self.gemm, self.attn, self.flop_rate, self.byte_rate, self.overhead = gemm, attn, flop_rate, byte_rate, overhead
        self.cpu_request, self.cpu_token, self.overlap = cpu_request, cpu_token, overlap
        self.kv_bytes = kv_bytes
        self.int_weights = type(weights) is int
        self.weights = float(weights) if not self.int_weights else 0.0
        self.weights_int = weights if self.int_weights else 0
        # the largest ctx whose integer terms stay below 2**63 (C's long long)
        self.ctx_limit = ((1 << 63) - 1 - self.weights_int) // max(kv_bytes, 1)

    @staticmethod
    def of(cost: RooflineCost) -> DenseTime | None:
        terms = (cost._gemm_flops, cost._attn_flops, cost._flop_rate, cost._weights, cost._kv_bytes,
                 cost._byte_rate, cost.overhead, cost.cpu_per_request, cost.cpu_per_token)
        floats, weights, kv_bytes = terms[:3] + terms[5:], terms[3], terms[4]
        if (not cost._dense or cost._comm is not None or cost._mla is not None or any(type(x) is not float for x in floats) or type(kv_bytes) is not int
                or not 0 <= kv_bytes < 1 << 62 or type(weights) not in (int, float)
                or type(weights) is int and not 0 <= weights < 1 << 62
                or cost._flop_rate == 0 or cost._byte_rate == 0):
            return None
        return DenseTime(*terms, cost.async_scheduling)

    def seconds(self, n: int, ctx: int) -> float:
        """A decode-only batch: n requests over ctx KV tokens (ints, 0 <= n <= ctx <= `ctx_limit`)."""
        if type(n) is not int or type(ctx) is not int or not 0 <= n <= ctx <= self.ctx_limit:
            raise ValueError(f"DenseTime.seconds({n!r}, {ctx!r}): needs ints 0 <= n <= ctx <= {self.ctx_limit}")
        return self._batch(n, n, ctx, ctx)

    def batch(self, tokens: int, requests: int, pairs: float, ctx: int) -> float:
        """A batch of BatchShape `s`: tokens = s.prefill_tokens + s.decode_seqs, requests =
        s.prefill_seqs + s.decode_seqs, pairs = s.prefill_attn + s.decode_ctx (as Python adds
        them: an int or a float), ctx = s.prefill_ctx + s.decode_ctx; tokens, requests and ctx
        ints in [0, `ctx_limit`]."""
        if (type(tokens) is not int or type(ctx) is not int or type(requests) is not int
                or type(pairs) not in (int, float)
                or not (0 <= tokens <= self.ctx_limit and 0 <= ctx <= self.ctx_limit
                        and 0 <= requests <= self.ctx_limit)):
            raise ValueError(f"DenseTime.batch({tokens!r}, {requests!r}, {pairs!r}, {ctx!r}): needs ints tokens, "
                             f"requests, ctx in [0, {self.ctx_limit}] and a number of pairs")
        return self._batch(tokens, requests, pairs, ctx)

    @cython.locals(compute=cython.double, memory=cython.double, roof=cython.double, cpu=cython.double)
    def _batch(self, tokens: int, requests: int, pairs: float, ctx: int) -> float:
        """`batch` unchecked: the engine's call (sim/batch.py, sim/decode_run.py), a C call when
        both are compiled, with ints tokens, requests and ctx it keeps in [0, `ctx_limit`]
        (compiled, a float would be truncated here: other callers use `batch` or `seconds`)."""
        compute = (self.gemm * tokens + self.attn * pairs) / self.flop_rate
        if self.int_weights:                # Python's exact integer sum, then the division
            memory = (self.weights_int + 0 * tokens + self.kv_bytes * ctx) / self.byte_rate
        else:
            memory = (self.weights + 0 * tokens + self.kv_bytes * ctx) / self.byte_rate
        roof = (compute + memory + abs(compute - memory)) / 2
        cpu = self.cpu_request * requests + self.cpu_token * tokens
        if not self.overlap:
            roof = roof + cpu
        elif cpu > roof:
            roof = cpu
        return self.overhead + roof
