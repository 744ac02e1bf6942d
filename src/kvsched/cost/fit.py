"""The papers' linear batch-time coefficients from any cost model.

Closed forms need alpha/beta (exclusive-batching-eb.txt section 3.1 and 3.5) or d0/d1
(fluid-wait-nested-wait.txt eq. 1). `phase`, `linear` and `constant` models carry them
exactly; for others (roofline) they are least-squares lines through the model's times on
batches shaped like the workload: whole prompts of mu_L tokens, decodes at context
mu_L + mu_O / 2, and mixed batches at decode share r = mu_O / (mu_L + mu_O).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.cost.constant import ConstantCost
from kvsched.cost.linear import LinearCost
from kvsched.cost.phase import PhaseCost
from kvsched.cost.shape import BatchShape


@dataclass(frozen=True)
class Coefficients:
    alpha_p: float
    beta_p: float
    alpha_d: float
    beta_d: float
    alpha_mb: float
    beta_mb: float          # beta_MB^e at the workload's decode share r
    d0: float
    d1: float
    exact: bool             # taken from the model rather than fitted

    def as_dict(self) -> dict[str, float | bool]:
        return dict(self.__dict__)


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    slope, intercept = np.polyfit(x.astype(float), y.astype(float), 1)
    return float(intercept), float(slope)


def coefficients(cost, mu_l: float, mu_o: float, max_batch: int = 1024, max_tokens: int = 8192) -> Coefficients:
    """alpha/beta for prefill, decode and mixed batches, and d0/d1 of eq. (1)."""
    r = mu_o / (mu_l + mu_o)
    if isinstance(cost, PhaseCost):
        # a prefill phase of exclusive batching costs two phase switches (into it and back to
        # decoding): the paper's alpha_p is charged once per prefill phase (section 3.1)
        return Coefficients(cost.alpha_p + 2 * cost.switch_s, cost.beta_p, cost.alpha_d, cost.beta_d, cost.alpha_mb,
                            float(cost.beta_mb(r)), *_fit_linear(cost, mu_l, mu_o, max_batch), exact=True)
    if isinstance(cost, ConstantCost):
        return Coefficients(cost.b, 0.0, cost.b, 0.0, cost.b, 0.0, cost.b, 0.0, exact=True)
    if isinstance(cost, LinearCost):
        ctx = mu_l + mu_o / 2           # a decode touches its context; a prefill its prompt
        return Coefficients(cost.d0, cost.d1, cost.d0, cost.d1 * ctx, cost.d0, cost.d1 * (r * ctx + 1 - r),
                            cost.d0, cost.d1, exact=True)
    prompts = np.arange(1, max(2, int(max_tokens // max(mu_l, 1))) + 1, dtype=float)
    tokens = prompts * mu_l
    alpha_p, beta_p = _line(tokens, cost.time(BatchShape(tokens, prompts, prompts * mu_l * (mu_l + 1) / 2, tokens)))
    n = np.arange(1, max_batch + 1, dtype=float)
    alpha_d, beta_d = _line(n, cost.time(BatchShape(decode_seqs=n, decode_ctx=n * (mu_l + mu_o / 2))))
    total = np.linspace(max(2.0, 1 / max(r, 1e-9)), max_tokens, 64)
    nd = np.maximum(1.0, np.round(r * total))
    pt = np.maximum(1.0, total - nd)
    chunks = np.maximum(1.0, np.ceil(pt / mu_l))
    mixed = cost.time(BatchShape(pt, chunks, pt * (pt / chunks + 1) / 2, pt, nd, nd * (mu_l + mu_o / 2)))
    alpha_mb, beta_mb = _line(pt + nd, mixed)
    return Coefficients(alpha_p, beta_p, alpha_d, beta_d, alpha_mb, beta_mb,
                        *_fit_linear(cost, mu_l, mu_o, max_batch), exact=False)


def _fit_linear(cost, mu_l: float, mu_o: float, max_batch: int) -> tuple[float, float]:
    """d0 + d1 x (tokens touched): decode batches at context mu_L + mu_O / 2 plus prefills."""
    n = np.arange(1, max_batch + 1, dtype=float)
    ctx = n * (mu_l + mu_o / 2)
    touched = np.concatenate([ctx, ctx + mu_l])
    times = np.concatenate([cost.time(BatchShape(decode_seqs=n, decode_ctx=ctx)),
                            cost.time(BatchShape(np.full_like(n, mu_l), np.ones_like(n),
                                                 np.full_like(n, mu_l * (mu_l + 1) / 2),
                                                 np.full_like(n, mu_l), n, ctx))])
    return _line(touched, times)
