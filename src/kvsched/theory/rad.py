"""Throughput limits of rad-slai.txt: Theorem 1's capacity, Theorem 2's cycle length, and the
capacity of a static prefill/decode split (derived here, not in the paper).

Lengths: the paper's L^D counts decode iterations after the first output token, which the
last prefill chunk yields (Definition 1). A kvsched request with o output tokens has
L^D = o - 1; every function here takes kvsched's o and converts.

The batch-time coefficients come from a `TiledCost` (rad-slai.txt eq. 7): T_R is its
`mean_request_time`, the prefill and decode parts its `theorem1_terms`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvsched.errors import KvschedError
from kvsched.theory.checks import in_range


def decode_iterations(outputs) -> np.ndarray:
    """L^D = o - 1 for requests with o >= 1 output tokens."""
    o = np.asarray(outputs, dtype=float).ravel()
    if o.size == 0 or not np.all(np.isfinite(o)) or o.min() < 1:
        raise KvschedError("outputs must be finite, at least 1 token each (L^D = o - 1 decode iterations)")
    return o - 1


def _lengths(prompts, outputs) -> tuple[np.ndarray, np.ndarray]:
    lp = np.asarray(prompts, dtype=float).ravel()
    ld = decode_iterations(outputs)
    if lp.shape != ld.shape:
        raise KvschedError(f"prompts and outputs differ in length ({lp.size} and {ld.size})")
    if not np.all(np.isfinite(lp)) or lp.min() < 1:
        raise KvschedError("prompts must be finite, at least 1 token each")
    return lp, ld


def phase_times(cost, prompts, outputs) -> dict[str, float]:
    """T_R of Theorem 1 (rad-slai.txt section 4.3) and its split into
    T_P = (lin_tile_s / t_col + nonlin_token_s) E[L^P] + N d pair_tile_s / (t_row t_col t_red) E[L^P (L^P + t_lcm)]
    (the prefill iterations' terms) and T_D = T_R - T_P, the decode iterations' terms
    (lin_tile_s / t_col + nonlin_token_s) E[L^D] + N E[sum_{i=1}^{L^D} T^{D,SA}(L^P + i)].
    The split is derived: Theorem 1 sums the two."""
    lp, ld = _lengths(prompts, outputs)
    k = cost.theorem1_terms()
    t_r = cost.mean_request_time(lp, ld)
    t_p = ((k["linear_per_token"] + k["nonlinear_per_token"]) * float(lp.mean())
           + k["prefill_attn_per_pair"] * float(np.mean(lp * (lp + k["t_lcm"]))))
    return {"T_R": t_r, "T_P": t_p, "T_D": t_r - t_p}


def capacity(cost, prompts, outputs, replicas: int = 1) -> float:
    """lambda* = r / T_R (Theorem 1): no planner and scheduler is stable above it, and RAD is
    stable below it (Theorem 2)."""
    if replicas < 1:
        raise KvschedError(f"replicas must be >= 1, got {replicas}")
    return replicas / phase_times(cost, prompts, outputs)["T_R"]


def worst_case_time(cost, max_prompt: int, max_output: int) -> float:
    """T^max of eq. (14) for one tile configuration: every token its own column tile,
    (l^P,max + l^D,max)(lin_tile_s + nonlin_token_s) + N sum_{i=1}^{l^P,max + l^D,max} T^{D,SA}(i),
    with T^{D,SA}(i) = decode_attn_token_s i. (The paper's max over tile configurations is over
    the one configuration the cost model has.)"""
    length = max_prompt + float(decode_iterations([max_output])[0])
    k = cost.theorem1_terms()
    return length * (cost.lin_tile_s + cost.nonlin_token_s) + k["decode_attn_per_token"] * length * (length + 1) / 2


def cycle_length(t_col: int, t_max: float, t_r: float, eps: float) -> int:
    """The smallest n with n > (t_col - 1) T^max / (eps T_R) (Theorem 2), for an arrival rate
    with lambda T_R <= r (1 - eps)."""
    if not 0 < eps < 1:
        raise KvschedError(f"eps must be in (0, 1), got {eps}")
    if t_col < 1 or not (t_max > 0 and t_r > 0):
        raise KvschedError("t_col must be >= 1 and T^max, T_R > 0")
    bound = in_range("Theorem 2's cycle bound (t_col - 1) T^max / (eps T_R)", lambda: (t_col - 1) * t_max / (eps * t_r),
                     eps=eps, t_col=t_col, T_max=t_max, T_R=t_r)
    return math.floor(bound) + 1


def split_capacity(cost, prompts, outputs, prefill_replicas: int, decode_replicas: int) -> float:
    """min(r_p / T_P, r_d / T_D): the rate a static split can serve if each pool runs optimally
    tiled batches of its own phase (derived from Theorem 1 applied to each pool)."""
    return _split(phase_times(cost, prompts, outputs), prefill_replicas, decode_replicas)


def _split(t: dict[str, float], prefill_replicas: int, decode_replicas: int) -> float:
    """min(r_p / T_P, r_d / T_D) from phase_times `t` (computed once for every split)."""
    if prefill_replicas < 1 or decode_replicas < 1:
        raise KvschedError("a split needs at least one prefill and one decode replica")
    return min(prefill_replicas / t["T_P"], decode_replicas / t["T_D"] if t["T_D"] > 0 else math.inf)


def analyse(cost, prompts, outputs, replicas: int = 1, eps: float = 0.1, t_col: int | None = None) -> dict[str, Any]:
    """Everything `kvsched theory rad-capacity` prints; JSON keys are the paper's quantities."""
    if replicas < 1:
        raise KvschedError(f"replicas must be >= 1, got {replicas}")
    lp, _ = _lengths(prompts, outputs)
    t = phase_times(cost, prompts, outputs)
    t_col = t_col or cost.t_col
    t_max = worst_case_time(cost, int(lp.max()), int(np.max(outputs)))
    out: dict[str, Any] = {"T_R": t["T_R"], "capacity": replicas / t["T_R"], "replicas": replicas,
                           "T_P": t["T_P"], "T_D": t["T_D"], "t_lcm": cost.t_lcm, "t_col": t_col,
                           "T_max": t_max, "eps": eps, "cycle_n": cycle_length(t_col, t_max, t["T_R"], eps)}
    if replicas >= 2:
        splits = {p: _split(t, p, replicas - p) for p in range(1, replicas)}
        best = max(splits, key=splits.get)
        out["split_capacity"] = {f"{p}P+{replicas - p}D": v for p, v in splits.items()}
        out["best_split"] = f"{best}P+{replicas - best}D"
        out["best_split_capacity"] = splits[best]
    return out
