"""Roofline batch time from the model and GPU catalogue: no profiling needed."""
from __future__ import annotations

from dataclasses import dataclass, field

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

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
        """A decode-only batch of n requests over ctx KV tokens: `time` of that BatchShape. (The
        replica times the roofline's batches with `DenseTime`, made from these terms when it
        starts: sim/decode_run.py, `dense_time`.)"""
        return self.time(BatchShape(0, 0, 0, 0, n, ctx, (), phase_switch))


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
                 byte_rate: float, overhead: float) -> None:
        self.gemm, self.attn, self.flop_rate, self.byte_rate, self.overhead = gemm, attn, flop_rate, byte_rate, overhead
        self.kv_bytes = kv_bytes
        self.int_weights = type(weights) is int
        self.weights = float(weights) if not self.int_weights else 0.0
        self.weights_int = weights if self.int_weights else 0
        # the largest ctx whose integer terms stay below 2**63 (C's long long)
        self.ctx_limit = ((1 << 63) - 1 - self.weights_int) // max(kv_bytes, 1)

    @staticmethod
    def of(cost: RooflineCost) -> DenseTime | None:
        terms = (cost._gemm_flops, cost._attn_flops, cost._flop_rate, cost._weights, cost._kv_bytes,
                 cost._byte_rate, cost.overhead)
        floats, weights, kv_bytes = terms[:3] + terms[5:], terms[3], terms[4]
        if (not cost._dense or any(type(x) is not float for x in floats) or type(kv_bytes) is not int
                or not 0 <= kv_bytes < 1 << 62 or type(weights) not in (int, float)
                or type(weights) is int and not 0 <= weights < 1 << 62
                or cost._flop_rate == 0 or cost._byte_rate == 0):
            return None
        return DenseTime(*terms)

    def seconds(self, n: int, ctx: int) -> float:
        """A decode-only batch: n requests over ctx KV tokens (ints, 0 <= n <= ctx <= `ctx_limit`)."""
        if type(n) is not int or type(ctx) is not int or not 0 <= n <= ctx <= self.ctx_limit:
            raise ValueError(f"DenseTime.seconds({n!r}, {ctx!r}): needs ints 0 <= n <= ctx <= {self.ctx_limit}")
        return self._batch(n, ctx, ctx)

    def batch(self, tokens: int, pairs: float, ctx: int) -> float:
        """A batch of BatchShape `s`: tokens = s.prefill_tokens + s.decode_seqs, pairs =
        s.prefill_attn + s.decode_ctx (as Python adds them: an int or a float), ctx =
        s.prefill_ctx + s.decode_ctx; tokens and ctx ints in [0, `ctx_limit`]."""
        if (type(tokens) is not int or type(ctx) is not int or type(pairs) not in (int, float)
                or not (0 <= tokens <= self.ctx_limit and 0 <= ctx <= self.ctx_limit)):
            raise ValueError(f"DenseTime.batch({tokens!r}, {pairs!r}, {ctx!r}): needs ints tokens, ctx in "
                             f"[0, {self.ctx_limit}] and a number of pairs")
        return self._batch(tokens, pairs, ctx)

    @cython.locals(compute=cython.double, memory=cython.double)
    def _batch(self, tokens: int, pairs: float, ctx: int) -> float:
        """`batch` unchecked: the engine's call (sim/batch.py, sim/decode_run.py), a C call when
        both are compiled, with ints tokens and ctx it keeps in [0, `ctx_limit`] (compiled, a
        float would be truncated here: other callers use `batch` or `seconds`)."""
        compute = (self.gemm * tokens + self.attn * pairs) / self.flop_rate
        if self.int_weights:                # Python's exact integer sum, then the division
            memory = (self.weights_int + 0 * tokens + self.kv_bytes * ctx) / self.byte_rate
        else:
            memory = (self.weights + 0 * tokens + self.kv_bytes * ctx) / self.byte_rate
        return self.overhead + (compute + memory + abs(compute - memory)) / 2
