"""Speculative decoding's acceptance model (issue "Speculative decoding", item 2; the replica
draws from it through sim/spec_decode.py).

A verify step checks a request's k proposed tokens in order. Position j (0-based) is accepted
with probability a_j given that every earlier one was; the first rejection ends the run, and
the target model's own token follows it (the correction, or the bonus token when all k were
accepted), so one step emits 1 + (accepted) tokens, from 1 to k + 1. With a constant alpha
(`--spec-acceptance ALPHA`, geometric) the expected tokens per step is
sum_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan, Kalman and Matias, "Fast
Inference from Transformers via Speculative Decoding", ICML 2023, eq. 1; the issue's closed
form); with per-position rates (`--spec-acceptance a_1,..,a_k`, as vLLM's spec-decode metrics
report acceptance per position) it is sum_{j=0..k} prod_{i<j} a_i.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsched.errors import KvschedError

MAX_K = 64                      # speculative tokens per step (vLLM's num_speculative_tokens is a few)


@dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance rates, one for each of the k proposed tokens."""
    rates: tuple[float, ...]

    @property
    def k(self) -> int:
        return len(self.rates)

    def expected_tokens(self) -> float:
        """Mean tokens one verify step emits: sum over j = 0..k of the chance that the first j
        proposals are all accepted (module docstring)."""
        total, run = 1.0, 1.0
        for a in self.rates:
            run *= a
            total += run
        return total

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Tokens emitted by n verify steps (int64, each 1..k+1), drawn from `rng`: position j
        of a step is accepted when its uniform draw is below a_j and every earlier one was."""
        if n < 0:
            raise KvschedError(f"spec acceptance: draw needs n >= 0 steps, got {n}")
        accepted = rng.random((n, self.k)) < np.asarray(self.rates)
        return 1 + np.cumprod(accepted, axis=1).sum(axis=1, dtype=np.int64)


def geometric_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha), the closed form (k + 1 when alpha = 1)."""
    return k + 1.0 if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def parse_acceptance(text: str, k: int) -> Acceptance:
    """`--spec-acceptance`: ALPHA (one rate for every position) or a_1,..,a_k (one per
    position), each in [0, 1], for k speculative tokens (1..MAX_K)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise KvschedError(f"speculative tokens k must be a whole number from 1 to {MAX_K}, got {k!r}")
    if not isinstance(text, str) or not text.strip():
        raise KvschedError(f"--spec-acceptance must be ALPHA or a_1,..,a_k, got {text!r}")
    parts = [p.strip() for p in text.split(",")]
    rates = []
    for p in parts:
        try:
            a = float(p)
        except ValueError:
            raise KvschedError(f"--spec-acceptance {text!r}: {p!r} is not a number") from None
        if not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise KvschedError(f"--spec-acceptance {text!r}: each rate must be in [0, 1], got {p!r}")
        rates.append(a)
    if len(rates) == 1:
        return Acceptance(tuple(rates) * k)
    if len(rates) != k:
        raise KvschedError(f"--spec-acceptance {text!r}: give one rate or one per speculative token "
                           f"({k}), got {len(rates)}")
    return Acceptance(tuple(rates))
