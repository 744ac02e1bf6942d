"""The shape of one batch: what every cost model needs, as aggregates over its requests."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BatchShape:
    """Aggregates of one iteration (fields may also be numpy arrays, one entry per batch).

    prefill_tokens: prompt tokens computed by prefill chunks in this batch.
    prefill_seqs:   requests with a prefill chunk.
    prefill_attn:   causal query-key pairs of the chunks, sum of c * (p + (c + 1) / 2) for a
                    chunk of c tokens over p cached tokens.
    prefill_ctx:    KV tokens the chunks read and write, sum of p + c.
    decode_seqs:    requests decoding one token.
    decode_ctx:     KV tokens the decodes attend over, sum of context lengths including the
                    token computed in this batch (prompt + tokens generated so far).
    chunks:         each prefill chunk as (tokens already computed, chunk tokens), for models
                    with per-chunk terms (e.g. GEMM tile ceilings); decodes stay aggregated.
                    Empty when the shape is built from aggregates only (arrays of batches).
    phase_switch:   the replica's previous batch was of another kind (prefill-only,
                    decode-only or mixed); the first batch is no switch.
    """
    prefill_tokens: float = 0
    prefill_seqs: float = 0
    prefill_attn: float = 0
    prefill_ctx: float = 0
    decode_seqs: float = 0
    decode_ctx: float = 0
    chunks: list[tuple[int, int]] | tuple = field(default_factory=tuple)
    phase_switch: bool = False

    def __init__(self, prefill_tokens=0, prefill_seqs=0, prefill_attn=0, prefill_ctx=0, decode_seqs=0,
                 decode_ctx=0, chunks=(), phase_switch=False) -> None:
        """The dataclass's own __init__, written out: the generated one would run as
        interpreted code even in the compiled build (kvsched/compiled.py), once per batch."""
        self.prefill_tokens, self.prefill_seqs, self.prefill_attn, self.prefill_ctx = (
            prefill_tokens, prefill_seqs, prefill_attn, prefill_ctx)
        self.decode_seqs, self.decode_ctx, self.chunks, self.phase_switch = decode_seqs, decode_ctx, chunks, phase_switch

    @property
    def tokens(self):
        """Tokens computed in the batch (a decode computes one)."""
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self):
        return self.prefill_seqs + self.decode_seqs
