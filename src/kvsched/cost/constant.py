"""Constant batch time: every batch takes b seconds (stability-capacity.txt, section 3)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.cost.shape import BatchShape


@dataclass(frozen=True)
class ConstantCost:
    """Batch time b, whatever the batch holds (stability-capacity.txt, the model behind
    mu = M / (b * E[g(s, o)]), eq. 1)."""
    b: float = field(default=0.05, metadata={"help": "seconds per batch"})

    def __post_init__(self) -> None:
        if not self.b > 0:
            raise ValueError(f"b must be > 0, got {self.b}")

    def time(self, shape: BatchShape):
        return self.b + 0 * shape.tokens
