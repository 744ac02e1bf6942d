"""Admission control, load shedding and abandonment by tier (docs/control-plane.md,
"Admission and shedding").

- `--admit TIER:rate=R[:burst=B]`: a token bucket per tier (R requests/s refill, B deep,
  B >= 1 as a request takes a whole token, default max(R, 1), full at t = 0); an arrival
  that finds less than one token is shed.
- `--admit TIER:concurrency=N`: at most N of the tier's requests in the cluster (arrived,
  not finished); an arrival over the limit is shed.
- `--shed TIER[:ttft=S][:kv=F]`: an arrival whose predicted TTFT on the replica the router chose
  is above S (default the tier's TTFT SLO) is shed. The prediction is the wait ahead plus the
  request's own prompt over the replica's prefill rate (tokens/s of a full chunk, from its
  batch-time model). The wait ahead is the larger of two estimates: the replica's queued
  prefill tokens over that rate plus what is left of its current batch (what a prefill-bound
  replica gives), and the head-of-line delay, how long the request at the head of its queue
  has waited (Ibrahim and Whitt, "Real-time delay estimation based on delay history", MSOM
  2009: the HOL predictor), which sees the waits that KV and sequence limits cause.
  `:kv=F` also sheds while the chosen replica's KV use is at least F, as the Gateway API
  Inference Extension's saturation detector marks a pod saturated at a KV-cache utilisation
  threshold (its default 0.8): a queue-based prediction cannot see the wait that the running
  requests' decodes will cause once their KV fills the cache.
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
    ttft_s: float | None        # None: the tier's TTFT SLO (when kv is None)
    kv: float | None = None     # shed when the chosen replica's KV use is at least this share


def _tier(text: str, flag: str, tiers: Sequence[str]) -> str:
    if text != ALL and text not in tiers:
        raise KvschedError(f"{flag}: unknown tier {text!r}; tiers: {', '.join([*tiers, ALL])}")
    return text


def _number(flag: str, key: str, text: str, whole: bool = False, least: float = 0.0) -> float:
    try:
        v = int(text) if whole else float(text)
    except ValueError:
        raise KvschedError(f"{flag}: {key}={text!r} is not a {'whole number' if whole else 'number'}") from None
    if not (math.isfinite(v) and (v >= least if least else v > 0)):
        raise KvschedError(f"{flag}: {key} must be a finite number {'>= ' + format(least, 'g') if least else '> 0'}, "
                           f"got {text}")
    return v


def _options(text: str, flag: str, keys: tuple[str, ...], form: str) -> tuple[str, dict[str, str]]:
    tier, *opts = str(text).split(":")
    got: dict[str, str] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in keys or k in got:
            raise KvschedError(f"{flag}: write {form}")
        got[k] = v
    return tier, got


def parse_admit(text: str, tiers: Sequence[str]) -> Limit:
    """`--admit TIER:rate=R[:burst=B]` (B >= 1: a request takes a whole token; default
    max(R, 1)) or `TIER:concurrency=N`."""
    flag, form = f"--admit {text!r}", "TIER:rate=R[:burst=B] or TIER:concurrency=N"
    tier, kv = _options(text, flag, ("rate", "burst", "concurrency"), form)
    if ("rate" in kv) == ("concurrency" in kv) or ("burst" in kv and "rate" not in kv):
        raise KvschedError(f"{flag}: write {form}")
    tier = _tier(tier, flag, tiers)
    if "concurrency" in kv:
        return Limit(tier, "concurrency", _number(flag, "concurrency", kv["concurrency"], True))
    rate = _number(flag, "rate", kv["rate"])
    burst = _number(flag, "burst", kv["burst"], least=1.0) if "burst" in kv else max(rate, 1.0)
    return Limit(tier, "rate", rate, burst)


def parse_shed(text: str, tiers: Sequence[str], slos: dict[str, float | None]) -> ShedRule:
    """`--shed TIER[:ttft=S][:kv=F]`: S seconds of predicted TTFT (default the tier's TTFT SLO
    when no kv is given), F in (0, 1] of KV use on the chosen replica."""
    flag, form = f"--shed {text!r}", "TIER[:ttft=SECONDS][:kv=SHARE]"
    tier, got = _options(text, flag, ("ttft", "kv"), form)
    tier = _tier(tier, flag, tiers)
    kv = _number(flag, "kv", got["kv"]) if "kv" in got else None
    if kv is not None and kv > 1:
        raise KvschedError(f"{flag}: kv is a share of the KV cache in (0, 1], got {got['kv']}")
    if "ttft" in got:
        return ShedRule(tier, _number(flag, "ttft", got["ttft"]), kv)
    if kv is None and (tier == ALL or slos.get(tier) is None):
        raise KvschedError(f"{flag}: tier {tier} has no TTFT SLO to shed at: give TIER:ttft=SECONDS")
    return ShedRule(tier, None if kv is not None else slos[tier], kv)


def parse_abandon(text: str, tiers: Sequence[str]) -> tuple[str, float]:
    tier, eq, s = str(text).rpartition("=")
    tier = _tier(tier if eq else ALL, f"--abandon-after {text!r}", tiers)
    return tier, _number(f"--abandon-after {text!r}", "seconds", s)


class Admission:
    """The per-tier limits, shedding rules and patience of one run, as arrays by tier index
    (index len(tiers): requests without a tier). A rule for `all` applies to every tier that
    has no rule of its own of that flag; two rules of one flag for one tier are an error."""

    def __init__(self, tiers: Sequence, limits: Sequence[Limit], shed: Sequence[ShedRule],
                 abandon: Sequence[tuple[str, float]]) -> None:
        names = [t.name for t in tiers]
        n = len(names) + 1

        def spread(flag: str, rules: list, tier_of) -> list:
            """Each tier index's rule: its own, else all's (None: none)."""
            out: list = [None] * n
            seen = set()
            for rule in sorted(rules, key=lambda r: tier_of(r) != ALL):     # all's first, then named
                tier = tier_of(rule)
                if tier in seen:
                    raise KvschedError(f"{flag}: tier {tier} is given twice")
                seen.add(tier)
                for k in (range(n) if tier == ALL else [names.index(tier)]):
                    out[k] = rule
            return out
        rates = spread("--admit (rate)", [x for x in limits if x.kind == "rate"], lambda x: x.tier)
        seats = spread("--admit (concurrency)", [x for x in limits if x.kind == "concurrency"], lambda x: x.tier)
        sheds = spread("--shed", list(shed), lambda x: x.tier)
        waits = spread("--abandon-after", list(abandon), lambda x: x[0])
        self.bucket = [None if x is None else [x.burst, x.value, x.burst, 0.0] for x in rates]  # tokens, rate, burst, t
        self.limit = [None if x is None else int(x.value) for x in seats]
        self.ttft = [None if x is None else x.ttft_s for x in sheds]
        self.kv = [None if x is None else x.kv for x in sheds]
        self.patience = [None if x is None else x[1] for x in waits]
        self.in_cluster = [0] * n
        self.shed = [0] * n
        self.abandoned = [0] * n

    @property
    def active(self) -> bool:
        return any(x is not None for x in (*self.bucket, *self.limit, *self.ttft, *self.kv, *self.patience))

    def sheds(self, k: int) -> bool:
        """Whether tier k's arrivals are judged on the chosen replica (`--shed`)."""
        return self.ttft[k] is not None or self.kv[k] is not None

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

    def undo(self, k: int) -> None:
        """Tier k's arrival, admitted by `admit`, is shed after all: its token and seat back."""
        self.in_cluster[k] -= 1
        b = self.bucket[k]
        if b is not None:
            b[0] = min(b[2], b[0] + 1.0)

    def breaks_slo(self, k: int, predicted_ttft: float, kv_use: float) -> bool:
        bound, kv = self.ttft[k], self.kv[k]
        return bound is not None and predicted_ttft > bound or kv is not None and kv_use >= kv
