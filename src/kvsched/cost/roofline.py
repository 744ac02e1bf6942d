"""Roofline batch time from the model and GPU catalogue: no profiling needed."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.cost.shape import BatchShape
from kvsched.hardware import GPU, Model


@dataclass(frozen=True)
class RooflineCost:
    """time = overhead + max(FLOPs / (flops * compute_efficiency),
                             bytes / (bandwidth * memory_efficiency))

    FLOPs: 2 * active parameters per computed token (the GEMMs) plus attention,
    4 * layers * heads * head_dim per query-key pair (QK^T and AV).
    Bytes: weights read once per batch (for MoE, at most active parameters per token, up to
    all of them) plus the KV cache the batch reads and writes.
    The max is written as (a + b + |a - b|) / 2 so the model also evaluates on arrays.
    """
    model: Model
    gpu: GPU
    compute_efficiency: float = field(default=0.5, metadata={"help": "achieved / peak FLOP/s"})
    memory_efficiency: float = field(default=0.8, metadata={"help": "achieved / peak bandwidth"})
    overhead: float = field(default=0.004, metadata={"help": "per-iteration CPU/launch seconds"})

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {self.overhead}")
        m = self.model
        object.__setattr__(self, "_attn_flops", 4.0 * m.layers * m.heads * m.head_dim)
        object.__setattr__(self, "_flop_rate", self.gpu.flops * self.compute_efficiency)
        object.__setattr__(self, "_byte_rate", self.gpu.bandwidth * self.memory_efficiency)
        object.__setattr__(self, "_kv_bytes", m.kv_bytes_per_token)
        object.__setattr__(self, "_gemm_flops", 2.0 * m.active)     # per computed token
        object.__setattr__(self, "_dense", m.active_params is None)
        object.__setattr__(self, "_weights", m.weight_bytes)
        # what `decode_time` reads, in one attribute (it runs for every decode-only batch)
        object.__setattr__(self, "_decode_terms", (self._gemm_flops, self._attn_flops, self._flop_rate, self._weights,
                                                   self._kv_bytes, self._byte_rate, self.overhead))

    def time(self, shape: BatchShape):
        tokens = shape.prefill_tokens + shape.decode_seqs
        pairs = shape.prefill_attn + shape.decode_ctx
        flops = self._gemm_flops * tokens + self._attn_flops * pairs
        if self._dense:
            weights = self._weights + 0 * tokens
        else:   # MoE: experts touched grow with tokens until all are read
            m = self.model
            touched = m.active * tokens
            weights = m.dtype_bytes * (touched + m.params - abs(touched - m.params)) / 2
        kv = self._kv_bytes * (shape.prefill_ctx + shape.decode_ctx)
        compute = flops / self._flop_rate
        memory = (weights + kv) / self._byte_rate
        return self.overhead + (compute + memory + abs(compute - memory)) / 2

    def decode_time(self, n: int, ctx: int, phase_switch: bool = False) -> float:
        """A decode-only batch of n requests over ctx KV tokens: `time` of that BatchShape, bit
        for bit (the same operations in the same order; tests/test_cost.py checks it), without
        building it (the replica's decode fast path)."""
        if not self._dense:
            return self.time(BatchShape(0, 0, 0, 0, n, ctx, (), phase_switch))
        gemm, attn, flop_rate, weights, kv_bytes, byte_rate, overhead = self._decode_terms
        compute = (gemm * n + attn * ctx) / flop_rate
        memory = (weights + 0 * n + kv_bytes * ctx) / byte_rate
        return overhead + (compute + memory + abs(compute - memory)) / 2

