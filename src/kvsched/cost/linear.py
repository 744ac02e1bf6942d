"""Batch time linear in the memory a batch touches (fluid-wait-nested-wait.txt, eq. 1)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.cost.shape import BatchShape


@dataclass(frozen=True)
class LinearCost:
    """tau = d0 + d1 * (sum of prefill tokens + sum of decode context lengths).

    fluid-wait-nested-wait.txt eq. (1): prefill requests contribute their prompt tokens
    (here: the tokens of their chunk) and decode requests their current length s = prompt +
    tokens generated after this iteration, which is `BatchShape.decode_ctx`.
    """
    d0: float = field(default=0.01, metadata={"help": "fixed seconds per batch"})
    d1: float = field(default=2e-6, metadata={"help": "seconds per token touched"})

    def __post_init__(self) -> None:
        if self.d0 < 0 or self.d1 < 0 or self.d0 + self.d1 <= 0:
            raise ValueError(f"need d0 >= 0, d1 >= 0 and not both zero, got d0={self.d0}, d1={self.d1}")

    def time(self, shape: BatchShape):
        return self.d0 + self.d1 * (shape.prefill_tokens + shape.decode_ctx)
