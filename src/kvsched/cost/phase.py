"""Phase-linear batch time with mixed-batch interference (exclusive-batching-eb.txt)."""
from __future__ import annotations

import math
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
    switch_s:      added to a batch whose kind differs from the replica's previous batch
                   (a phase switch; `BatchShape.phase_switch`). Not in the paper's linear
                   model, 0 by default; docs/exclusive-batching.md estimates it from Tables
                   10-11 (`theory.eb.implied_prefill_overhead`).
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
    switch_s: float = field(default=0.0, metadata={"help": "seconds added when the batch kind changes (phase switch)"})

    def __post_init__(self) -> None:
        for name in ("alpha_p", "beta_p", "alpha_d", "beta_d", "alpha_mb", "switch_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.alpha_p + self.beta_p <= 0 or self.alpha_d + self.beta_d <= 0:
            raise ValueError("prefill and decode batches must take positive time")
        for name in ("c0", "c1", "c2"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        for r in (0.0, 0.5, 1.0):
            if self.alpha_mb + self.beta_mb(r) <= 0:
                raise ValueError(f"beta_MB(r) gives a non-positive mixed batch time at r={r}")
        low = min(self.beta_mb(r) for r in self._critical_points())
        if low < 0:                     # a large mixed batch would take negative time
            raise ValueError(f"beta_MB(r) = c0 + c1 r + c2 r^2 must be >= 0 on [0, 1]; its minimum is {low:g}")

    def _critical_points(self) -> list[float]:
        """r = 0, 1 and the vertex of the quadratic when it lies inside (0, 1)."""
        points = [0.0, 1.0]
        if self.c2 > 0 and 0 < -self.c1 / (2 * self.c2) < 1:
            points.append(-self.c1 / (2 * self.c2))
        return points

    def beta_mb(self, r):
        return self.c0 + self.c1 * r + self.c2 * r * r

    def time(self, shape: BatchShape):
        p, n = shape.prefill_tokens, shape.decode_seqs
        total = p + n
        if not hasattr(total, "__len__"):           # one batch: plain branches
            switch = self.switch_s if shape.phase_switch else 0.0
            if n == 0:
                return self.alpha_p + self.beta_p * p + switch
            if p == 0:
                return self.alpha_d + self.beta_d * n + switch
            return self.alpha_mb + self.beta_mb(n / total) * total + switch
        import numpy as np
        r = np.divide(n, total, out=np.zeros_like(total, dtype=float), where=total > 0)
        mixed = self.alpha_mb + self.beta_mb(r) * total
        return np.where(n == 0, self.alpha_p + self.beta_p * p,
                        np.where(p == 0, self.alpha_d + self.beta_d * n, mixed)) + self.switch_s * np.asarray(
                            shape.phase_switch, dtype=float)


def interference_index(c0: float, c1: float, c2: float) -> float:
    """kappa = 2 c2 / (c0 + c1 + c2) for beta_MB(r) = c0 + c1 r + c2 r^2
    (exclusive-batching-eb.txt appendix A.3, eq. 11)."""
    return 2 * c2 / (c0 + c1 + c2)


# The authors' Qwen3-8B calibrations. alpha_p, beta_p, alpha_d, beta_d are single-step
# measurements; beta_MB(r) is their least-squares quadratic on 1/throughput of whole vLLM v1
# runs (appendix A.4), i.e. whole-run seconds per token, which already holds every per-batch
# overhead. So alpha_MB = 0: charging a mixed-batch overhead on top would count it twice.
# Consistency with the phase lines: beta_MB(0) is the prefill cost per token (H200: 2.494e-5
# against beta_p 2.49e-5), and beta_MB(1) n equals a decode-only batch alpha_d + beta_d n at
# n = alpha_d / (beta_MB(1) - beta_d), the run's effective batch (H200: 195). The authors'
# code defaults alpha_MB to alpha_p ("alpha_p ~ alpha_d ~ alpha_MB"); --cost-set
# alpha_mb=... restores any such choice.
H200_QWEN3_8B = dict(alpha_p=1.28e-3, beta_p=2.49e-5, alpha_d=8.92e-3, beta_d=4.59e-5, alpha_mb=0.0,
                     c0=2.494e-5, c1=5.193e-5, c2=1.478e-5)
# RTX PRO 6000 / Qwen3-8B as the authors measured it; interference index +0.07 (the paper's
# -11.6 was measured on Qwen3-4B attention kernels at 4,096 tokens, appendix A.3).
RTX_PRO_6000_QWEN3_8B = dict(alpha_p=4.69e-3, beta_p=5.01e-5, alpha_d=1.038e-2, beta_d=1.039e-4, alpha_mb=0.0,
                             c0=6.29e-5, c1=1.969e-4, c2=9.90e-6)


def effective_decode_batch(preset: dict[str, float]) -> float:
    """n at which a mixed batch of n decodes (r = 1) costs what a decode-only batch does:
    beta_MB(1) n = alpha_d + beta_d n (alpha_MB = 0)."""
    return preset["alpha_d"] / (preset["c0"] + preset["c1"] + preset["c2"] - preset["beta_d"])


PHASE_PRESETS = {"eb-h200-qwen3-8b": H200_QWEN3_8B, "eb-rtx-pro-6000-qwen3-8b": RTX_PRO_6000_QWEN3_8B}
