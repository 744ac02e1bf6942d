"""Phase-linear batch time with mixed-batch interference (exclusive-batching-eb.txt)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.cost.shape import BatchShape


@dataclass(frozen=True)
class PhaseCost:
    """Separate linear models per batch kind (exclusive-batching-eb.txt, sections 3.1, 3.5).

    prefill-only:  T_p = alpha_p + beta_p * prefill tokens           (section 3.1)
    decode-only:   t_d(n) = alpha_d + beta_d * n                      (section 3.1)
    mixed:         alpha_MB + beta_MB(r) * (prefill tokens + n)       (section 3.5)
                   beta_MB(r) = c0 + c1 r + c2 r^2, r = n / (prefill tokens + n), the decode
                   share of the batch's tokens (Appendix A.3-A.4).
    Defaults are of the magnitude the paper reports for Qwen3-8B (1e-5 s/token range);
    fit your own for real hardware.
    """
    alpha_p: float = field(default=0.010, metadata={"help": "prefill batch overhead, s"})
    beta_p: float = field(default=6e-5, metadata={"help": "prefill seconds per token"})
    alpha_d: float = field(default=0.008, metadata={"help": "decode batch overhead, s"})
    beta_d: float = field(default=5e-5, metadata={"help": "decode seconds per request"})
    alpha_mb: float = field(default=0.010, metadata={"help": "mixed batch overhead, s"})
    c0: float = field(default=6e-5, metadata={"help": "beta_MB(r) constant term"})
    c1: float = field(default=0.0, metadata={"help": "beta_MB(r) linear term"})
    c2: float = field(default=0.0, metadata={"help": "beta_MB(r) quadratic term"})

    def __post_init__(self) -> None:
        for name in ("alpha_p", "beta_p", "alpha_d", "beta_d", "alpha_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.alpha_p + self.beta_p <= 0 or self.alpha_d + self.beta_d <= 0:
            raise ValueError("prefill and decode batches must take positive time")
        for r in (0.0, 0.5, 1.0):
            if self.alpha_mb + self.beta_mb(r) <= 0:
                raise ValueError(f"beta_MB(r) gives a non-positive mixed batch time at r={r}")

    def beta_mb(self, r):
        return self.c0 + self.c1 * r + self.c2 * r * r

    def time(self, shape: BatchShape):
        p, n = shape.prefill_tokens, shape.decode_seqs
        total = p + n
        if not hasattr(total, "__len__"):           # one batch: plain branches
            if n == 0:
                return self.alpha_p + self.beta_p * p
            if p == 0:
                return self.alpha_d + self.beta_d * n
            return self.alpha_mb + self.beta_mb(n / total) * total
        import numpy as np
        r = np.divide(n, total, out=np.zeros_like(total, dtype=float), where=total > 0)
        mixed = self.alpha_mb + self.beta_mb(r) * total
        return np.where(n == 0, self.alpha_p + self.beta_p * p,
                        np.where(p == 0, self.alpha_d + self.beta_d * n, mixed))
