"""Queueing stability of LLM serving under a KV-cache limit (stability-capacity.txt).

Notation: M KV capacity in tokens, b mean batch time in seconds, s prompt tokens, o output
tokens, s_hat the prefill chunk size.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvsched.errors import KvschedError
from kvsched.theory.checks import in_range, positive
from kvsched.workload.lengths import MAX_TOKENS


def check_chunk(chunk: int) -> None:
    """The prefill chunk s_hat: 1..MAX_TOKENS tokens (a chunk longer than every prompt is a
    whole-prompt prefill, so no larger value means anything)."""
    if not 1 <= chunk <= MAX_TOKENS:
        raise KvschedError(f"the prefill chunk s_hat (--chunk-size) must be 1..{MAX_TOKENS:,} tokens, got {chunk}")


def lifetime_memory(s, o, chunk: int):
    """g(s, o): KV tokens held, summed over every batch of a request's service
    (stability-capacity.txt section 4, the display above eq. 1):

        g(s, o) = (s_hat + 2 s_hat + ... + s) + ((s + 1) + ... + (s + o))
                = ((1 + s / s_hat) s + 2 o s + (1 + o) o) / 2     when s_hat divides s.

    The paper assumes s_hat divides s. Otherwise the prompt takes k = ceil(s / s_hat)
    chunks, the last one partial, holding s_hat, 2 s_hat, ..., (k - 1) s_hat, then s tokens:
    prefill part s_hat (k - 1) k / 2 + s, which equals the paper's term when s_hat divides
    s. Vectorised over s and o.
    """
    check_chunk(chunk)
    s = np.asarray(s, dtype=np.float64)
    o = np.asarray(o, dtype=np.float64)
    k = np.ceil(s / chunk)
    return chunk * (k - 1) * k / 2 + s + o * s + o * (o + 1) / 2


def mean_lifetime_memory(prompt: np.ndarray, output: np.ndarray, chunk: int,
                         weights: np.ndarray | None = None) -> float:
    """E[g(s, o)] over samples (a trace) or over a joint table p(s, o) given as `weights`."""
    prompt, output = np.asarray(prompt), np.asarray(output)
    if len(prompt) == 0 or len(prompt) != len(output):
        raise KvschedError("need equally many (at least one) prompt and output lengths")
    g = lifetime_memory(prompt, output, chunk)
    if weights is None:
        return float(g.mean())
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != len(g) or not np.all(np.isfinite(w) & (w >= 0)) or not w.max() > 0:
        raise KvschedError("p(s, o) weights must be finite and >= 0, one per (s, o) pair, not all zero")
    w = w / w.max()                 # counts up to 1e308 sum without overflow
    return float(np.dot(g, w) / w.sum())


def service_rate(kv_capacity: float, batch_time: float, mean_g: float) -> float:
    """mu = M / (b E[g(s, o)]), requests per second (stability-capacity.txt eq. 1)."""
    positive(kv_capacity=kv_capacity, batch_time=batch_time, mean_lifetime_memory=mean_g)
    return in_range("mu = M / (b E[g]) (eq. 1)", lambda: kv_capacity / mean_g / batch_time, nonzero=True,
                    kv_capacity=kv_capacity, batch_time=batch_time, mean_lifetime_memory=mean_g)


def memory_slack(max_request_tokens: float, kv_capacity: float) -> float:
    """delta = ess sup(s + o) / M (stability-capacity.txt Theorem 4.2); the trace's largest
    s + o stands for the essential supremum."""
    positive(kv_capacity=kv_capacity)
    return in_range("delta = ess sup(s + o) / M (Theorem 4.2)", lambda: max_request_tokens / kv_capacity,
                    kv_capacity=kv_capacity, max_request_tokens=max_request_tokens)


def stable_rate(mu: float, delta: float) -> float:
    """lambda < mu (1 - delta) is stable (Theorem 4.2); lambda > mu is overloaded (Theorem
    4.1). Returns mu (1 - delta), 0 when one request can fill the memory (delta >= 1)."""
    return max(0.0, mu * (1.0 - delta))


def mixture_rate(shares: Sequence[float], rates: Sequence[float]) -> float:
    """mu_mix = (sum_l q_l / mu_l)^-1 for a trace whose fraction q_l follows distribution
    F_l (stability-capacity.txt section 5.2, the display after Table 1)."""
    q, mu = np.asarray(shares, float), np.asarray(rates, float)
    if len(q) != len(mu) or len(q) == 0 or np.any(q < 0) or abs(q.sum() - 1) > 1e-9 \
            or not np.all((mu > 0) & np.isfinite(mu)):
        raise KvschedError("mixture: shares must be >= 0 and sum to 1, one finite positive rate per share")
    low = mu[q > 0].min()           # (sum_l q_l low / mu_l)^-1 low: every ratio <= 1, so nothing overflows
    return float(low / np.sum(q * (low / mu)))


def gpus_needed(arrival_rate: float, mu: float, utilization: float = 0.9) -> int:
    """GPUs at a target utilisation rho: ceil(lambda / (mu rho)) (stability-capacity.txt,
    end of section 4; section 6 gives ceil(lambda / mu) at rho = 1)."""
    positive(arrival_rate=arrival_rate, mu=mu)
    if not 0 < utilization <= 1:
        raise KvschedError(f"--utilization must be in (0, 1], got {utilization}")
    gpus = in_range("lambda / (mu rho)", lambda: arrival_rate / (mu * utilization),
                    arrival_rate=arrival_rate, mu=mu, utilization=utilization)
    return max(1, math.ceil(gpus - 1e-12))


BATCH_TIME_ESTIMATORS = ("median", "mean", "trim5", "trim10")


def estimate_batch_time(times: np.ndarray, method: str = "median") -> float:
    """b from observed batch times: the median (stability-capacity.txt section 5.1), the
    mean, or the mean after discarding the top 5% or 10% of batches (appendix C: a trimmed
    mean for heavy-tailed batch times; the paper trims the top only, as outliers)."""
    t = np.sort(np.asarray(times, dtype=np.float64))
    if len(t) == 0 or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise KvschedError("need at least one positive, finite batch time")
    if method == "median":
        return float(np.median(t))
    if method == "mean":
        return float(t.mean())
    if method in ("trim5", "trim10"):
        cut = {"trim5": 0.05, "trim10": 0.10}[method]
        keep = len(t) - int(math.floor(cut * len(t)))
        return float(t[:max(1, keep)].mean())
    raise KvschedError(f"unknown batch-time estimator {method!r}; use {', '.join(BATCH_TIME_ESTIMATORS)}")


@dataclass(frozen=True)
class Stability:
    """What the stability paper says about one workload on one GPU."""
    mu: float
    delta: float
    stable_rate: float
    mean_lifetime_memory: float
    kv_capacity: float
    batch_time: float
    chunk: int

    def as_dict(self) -> dict[str, float]:
        return {"mu": self.mu, "delta": self.delta, "stable_rate": self.stable_rate,
                "mean_lifetime_memory": self.mean_lifetime_memory, "kv_capacity": self.kv_capacity,
                "batch_time": self.batch_time, "chunk_size": self.chunk}


def analyse(prompt: np.ndarray, output: np.ndarray, kv_capacity: float, batch_time: float,
            chunk: int, weights: np.ndarray | None = None) -> Stability:
    """mu, delta and the stable region for lengths from a trace or a joint table."""
    g = mean_lifetime_memory(prompt, output, chunk, weights)
    mu = service_rate(kv_capacity, batch_time, g)
    present = np.ones(len(prompt), bool) if weights is None else np.asarray(weights) > 0
    delta = memory_slack(float(np.max((np.asarray(prompt) + np.asarray(output))[present])), kv_capacity)
    return Stability(mu, delta, stable_rate(mu, delta), g, kv_capacity, batch_time, chunk)


def mean_lifetime_memory_independent(prompt_values, prompt_probs, output_values, output_probs,
                                     chunk: int) -> float:
    """E[g(s, o)] exactly when s and o are independent with the given finite marginals
    (as in stability-capacity.txt section 5.1's uniform PD mixes): by linearity,
    E[g] = E[prefill part of s] + E[s] E[o] + E[o (o + 1)] / 2."""
    s, ps = np.asarray(prompt_values, float), np.asarray(prompt_probs, float)
    o, po = np.asarray(output_values, float), np.asarray(output_probs, float)
    for name, p in (("prompt", ps), ("output", po)):
        if np.any(p < 0) or abs(p.sum() - 1) > 1e-9:
            raise KvschedError(f"{name} probabilities must be >= 0 and sum to 1")
    prefill = float(np.dot(lifetime_memory(s, np.zeros_like(s), chunk), ps))
    return prefill + float(np.dot(s, ps) * np.dot(o, po)) + float(np.dot(o * (o + 1) / 2, po))


def exact_moments(types, chunk: int) -> tuple[float, float] | None:
    """(E[g], max s + o) exactly for a mix of request types (weights = their rates) whose
    prompt and output distributions have finite support; None otherwise."""
    if not types or not all(hasattr(t.prompt, "support") and hasattr(t.output, "support") for t in types):
        return None
    w = np.array([t.rate for t in types], float)
    g, top = 0.0, 0.0
    for t, share in zip(types, w / w.sum()):
        (s, ps), (o, po) = t.prompt.support(), t.output.support()
        g += share * mean_lifetime_memory_independent(s, ps, o, po, chunk)
        top = max(top, float(s.max() + o.max()))
    return g, top


def load_joint_table(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A joint table p(s, o) as CSV `prompt_tokens,output_tokens,probability` (or `count`
    in place of probability; weights need not sum to 1). Errors name file and line."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as exc:
        raise KvschedError(f"cannot read joint table {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not rows:
        raise KvschedError(f"{path}:1: empty file")
    header = [h.strip() for h in rows[0]]
    weight = "probability" if "probability" in header else "count"
    for col in ("prompt_tokens", "output_tokens", weight):
        if col not in header:
            raise KvschedError(f"{path}:1: missing column {col!r} (prompt_tokens,output_tokens,probability|count)")
    cols = [header.index(c) for c in ("prompt_tokens", "output_tokens", weight)]
    s, o, w = [], [], []
    for line, row in enumerate(rows[1:], start=2):
        if not any(x.strip() for x in row):
            continue
        try:
            vals = [float(row[c]) for c in cols]
        except (ValueError, IndexError):
            raise KvschedError(f"{path}:{line}: expected numbers in {', '.join(header[c] for c in cols)}") from None
        if not all(1 <= v <= MAX_TOKENS and v == int(v) for v in vals[:2]) \
                or not (vals[2] >= 0 and math.isfinite(vals[2])):
            raise KvschedError(f"{path}:{line}: token counts must be integers in 1..{MAX_TOKENS:,} "
                               f"and the {weight} a finite number >= 0")
        s.append(vals[0]), o.append(vals[1]), w.append(vals[2])
    if not s or sum(w) <= 0:
        raise KvschedError(f"{path}: no (s, o) pair with positive {weight}")
    return np.array(s), np.array(o), np.array(w)


def analyse_workload(spec, workload, kv_capacity: float, batch_times: Sequence[float],
                     chunk: int) -> dict[str, object]:
    """mu, delta and the stable rate of a built workload, phase by phase: E[g] exact for
    phases of finite-support request types, else over the phase's requests; several phases
    combine as mu_mix = (sum_l q_l / mu_l)^-1 (section 5.2), q_l the phases' shares.
    `batch_times`: one b, or one per phase."""
    n = len(workload.phases)
    if len(batch_times) not in (1, n):
        raise KvschedError(f"give one --batch-time, or one per phase ({n})")
    bs = list(batch_times) * n if len(batch_times) == 1 else list(batch_times)
    mus, deltas, gs, exact = [], [], [], []
    for k, ph in enumerate(spec.phases):
        moments = None if ph.trace is not None else exact_moments(ph.types, chunk)
        exact.append(moments is not None)
        if moments is None:
            mask = workload.phase == k
            s, o = workload.prompt[mask], workload.output[mask]
            moments = (mean_lifetime_memory(s, o, chunk), float((s + o).max()))
        gs.append(moments[0])
        mus.append(service_rate(kv_capacity, bs[k], moments[0]))
        deltas.append(memory_slack(moments[1], kv_capacity))
    shares = [float(np.mean(workload.phase == k)) for k in range(n)]
    mu, delta = mixture_rate(shares, mus), max(deltas)
    out: dict[str, object] = {"mu": mu, "delta": delta, "stable_rate": stable_rate(mu, delta),
                              "mean_lifetime_memory": float(np.dot(shares, gs)), "exact": all(exact)}
    if n > 1:
        out.update(phase_mu=mus, phase_share=shares)
    return out
