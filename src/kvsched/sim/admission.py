"""Admission control, load shedding and abandonment by tier (docs/control-plane.md,
"Admission and shedding").

- `--admit TIER:rate=R[:burst=B]`: a token bucket per tier (R requests/s refill, B deep,
  default B = R x 1 s, full at t = 0); an arrival that finds it empty is shed.
- `--admit TIER:concurrency=N`: at most N of the tier's requests in the cluster (arrived,
  not finished); an arrival over the limit is shed.
- `--shed TIER[:ttft=S]`: an arrival whose predicted TTFT on the replica the router chose
  is above S (default the tier's TTFT SLO) is shed. The prediction is the wait ahead plus the
  request's own prompt over the replica's prefill rate (tokens/s of a full chunk, from its
  batch-time model). The wait ahead is the larger of two estimates: the replica's queued
  prefill tokens over that rate plus what is left of its current batch (what a prefill-bound
  replica gives), and the head-of-line delay, how long the request at the head of its queue
  has waited (Ibrahim and Whitt, "Real-time delay estimation based on delay history", MSOM
  2009: the HOL predictor), which sees the waits that KV and sequence limits cause.
- `--abandon-after S` (or `TIER=S`, repeatable): a client gives up S seconds after its
  arrival when it has no first token; a request still waiting then leaves the replica's
  queue. One already admitted is served (vLLM would abort it on disconnect; a waiting one is
  what a client's timeout removes in practice, and removing running work needs a policy
  hook kvsched's contract does not have).
`TIER` is a tier's name, or `all` (every request; `--abandon-after S` alone means all).
Shed and abandoned requests are counted per tier and in requests.csv (`status`), never lost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvsched.errors import KvschedError

ALL = "all"
SHED, ABANDONED = 1, 2          # `ControlPlane.dropped` codes


@dataclass(frozen=True)
class Limit:
    tier: str
    kind: str                   # "rate" or "concurrency"
    value: float                # req/s or requests
    burst: float = 0.0


@dataclass(frozen=True)
class ShedRule:
    tier: str
    ttft_s: float | None        # None: the tier's TTFT SLO


def _tier(text: str, flag: str, tiers: Sequence[str]) -> str:
    if text != ALL and text not in tiers:
        raise KvschedError(f"{flag}: unknown tier {text!r}; tiers: {', '.join([*tiers, ALL])}")
    return text


def _number(flag: str, key: str, text: str, whole: bool = False) -> float:
    try:
        v = int(text) if whole else float(text)
    except ValueError:
        raise KvschedError(f"{flag}: {key}={text!r} is not a {'whole number' if whole else 'number'}") from None
    if not (v > 0 and math.isfinite(v)):
        raise KvschedError(f"{flag}: {key} must be > 0, got {text}")
    return v


def parse_admit(text: str, tiers: Sequence[str]) -> Limit:
    flag = f"--admit {text!r}"
    tier, *opts = str(text).split(":")
    kv = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in ("rate", "burst", "concurrency") or k in kv:
            raise KvschedError(f"{flag}: write TIER:rate=R[:burst=B] or TIER:concurrency=N")
        kv[k] = v
    if ("rate" in kv) == ("concurrency" in kv) or ("burst" in kv and "rate" not in kv):
        raise KvschedError(f"{flag}: write TIER:rate=R[:burst=B] or TIER:concurrency=N")
    tier = _tier(tier, flag, tiers)
    if "concurrency" in kv:
        return Limit(tier, "concurrency", _number(flag, "concurrency", kv["concurrency"], True))
    rate = _number(flag, "rate", kv["rate"])
    return Limit(tier, "rate", rate, _number(flag, "burst", kv["burst"]) if "burst" in kv else rate)


def parse_shed(text: str, tiers: Sequence[str], slos: dict[str, float | None]) -> ShedRule:
    flag = f"--shed {text!r}"
    tier, colon, rest = str(text).partition(":")
    tier = _tier(tier, flag, tiers)
    if colon:
        k, eq, v = rest.partition("=")
        if k != "ttft" or not eq:
            raise KvschedError(f"{flag}: write TIER[:ttft=SECONDS]")
        return ShedRule(tier, _number(flag, "ttft", v))
    if tier == ALL or slos.get(tier) is None:
        raise KvschedError(f"{flag}: tier {tier} has no TTFT SLO to shed at: give TIER:ttft=SECONDS")
    return ShedRule(tier, None)


def parse_abandon(text: str, tiers: Sequence[str]) -> tuple[str, float]:
    tier, eq, s = str(text).rpartition("=")
    tier = _tier(tier if eq else ALL, f"--abandon-after {text!r}", tiers)
    return tier, _number(f"--abandon-after {text!r}", "seconds", s)


class Admission:
    """The per-tier limits, shedding rules and patience of one run, as arrays by tier index
    (index len(tiers): requests without a tier)."""

    def __init__(self, tiers: Sequence, limits: Sequence[Limit], shed: Sequence[ShedRule],
                 abandon: Sequence[tuple[str, float]]) -> None:
        names = [t.name for t in tiers]
        n = len(names) + 1

        def index(tier: str) -> list[int]:
            return list(range(n)) if tier == ALL else [names.index(tier)]
        self.bucket: list[list[float] | None] = [None] * n      # [tokens, rate, burst, last t]
        self.limit: list[int | None] = [None] * n
        self.ttft: list[float | None] = [None] * n
        self.patience: list[float | None] = [None] * n
        for lim in limits:
            for k in index(lim.tier):
                if lim.kind == "rate":
                    self.bucket[k] = [lim.burst, lim.value, lim.burst, 0.0]
                else:
                    self.limit[k] = int(lim.value)
        for rule in shed:
            for k in index(rule.tier):
                self.ttft[k] = rule.ttft_s if rule.ttft_s is not None else tiers[k].ttft_slo
        for tier, s in abandon:
            for k in index(tier):
                self.patience[k] = s
        self.in_cluster = [0] * n
        self.shed = [0] * n
        self.abandoned = [0] * n

    @property
    def active(self) -> bool:
        return any(x is not None for x in (*self.bucket, *self.limit, *self.ttft, *self.patience))

    def admit(self, k: int, t: float) -> bool:
        """Whether tier k's arrival at t passes its bucket and concurrency limit (taking a
        token and a seat if so)."""
        b = self.bucket[k]
        if b is not None:
            b[0] = min(b[2], b[0] + (t - b[3]) * b[1])
            b[3] = t
            if b[0] < 1.0:
                return False
        lim = self.limit[k]
        if lim is not None and self.in_cluster[k] >= lim:
            return False
        if b is not None:
            b[0] -= 1.0
        self.in_cluster[k] += 1
        return True

    def breaks_slo(self, k: int, predicted_ttft: float) -> bool:
        bound = self.ttft[k]
        return bound is not None and predicted_ttft > bound
