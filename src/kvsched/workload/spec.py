"""Workload specifications: a sequence of phases (each with its own lengths and arrival
process), user tiers drawn with probabilities, and options; `build()` makes the Workload.

A phase takes its lengths from request types (fluid-wait-nested-wait.txt section 3: lengths
and a rate per type) or from a trace file. Open-loop phases follow one another in time: a
phase's clock starts at the previous phase's last arrival. Closed-loop phases follow one
another in issue order, each with its own concurrency (exclusive-batching-eb.txt section 4.4,
"concurrency shift"). A workload is all open-loop or all closed-loop.
"""
from __future__ import annotations

import os

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import Arrivals, Closed, Poisson, Replay, TraceRate
from kvsched.workload.bundled import label
from kvsched.workload.readers import read_trace
from kvsched.workload.lengths import MAX_TOKENS, Fixed, LengthDist, is_whole, numbers
from kvsched.workload.request import Ragged, Segments, Tier, Workload, session_roots
from kvsched.workload.sharing import Sessions, SharedPrefix, check_shared, share


BYTES_PER_REQUEST = 400     # workload arrays, per-request state and records, measured ~330 B


def max_requests() -> int:
    """Requests whose simulation fits in this machine's physical memory."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 2 ** 36
    return mem // BYTES_PER_REQUEST


@dataclass(frozen=True)
class RequestType:
    """A request type of fluid-wait-nested-wait.txt (section 3): prompt length l_j, output
    length l'_j (here distributions; Fixed gives the paper's deterministic types) and an
    arrival rate lambda_j (relative, when the phase has its own arrival process)."""
    prompt: LengthDist
    output: LengthDist
    rate: float = 1.0
    tier: Tier | None = None


@dataclass(frozen=True)
class TierShare:
    """A tier and the probability that a request belongs to it (None: the tier only names
    SLOs for a trace's `tier` column)."""
    tier: Tier
    share: float | None = None


@dataclass(frozen=True)
class Phase:
    """`requests` requests with lengths from `types` or from `trace`, arriving by `arrivals`
    (default: the types' summed rates as Poisson; a timed trace's own stamps).

    `sample` picks a trace's rows:
      False          the first `requests` rows, in file order (rows drawn with replacement,
                     seeded, when `requests` exceeds the rows);
      True           `requests` rows drawn with replacement (seeded);
      "permutation"  the first `requests` rows of the trace shuffled once by the seed: rows
                     without replacement, as the SLAI authors read their shuffled ShareGPT
                     file (rad-slai.txt section 7). More requests than rows is an error; no
                     `requests` takes every row, shuffled. A replayed timed trace keeps each
                     chosen row's own time (a seeded random subset of the trace).

    A synthetic phase may share prompt content (workload/sharing.py): `shared_prefix` system
    prompts, each begun with by a share of the requests (prepended to the drawn prompt), and
    `sessions`: requests form multi-turn sessions (`requests` counts every turn).
    """
    requests: int | None = None
    types: tuple[RequestType, ...] = ()
    trace: Path | None = None
    format: str = "auto"
    window: tuple[float, float] | None = None
    arrivals: Arrivals | None = None
    name: str = ""
    sample: bool | str = False          # how trace rows are picked: False, True or "permutation"
    shared_prefix: tuple[SharedPrefix, ...] = ()
    sessions: Sessions | None = None

    def label(self, k: int) -> str:
        return self.name or f"phase {k + 1}"

    def check(self, k: int) -> None:
        where = self.label(k)
        if bool(self.types) == (self.trace is not None):
            raise KvschedError(f"{where}: give either request lengths (prompt/output or types) or a trace")
        if self.requests is not None and not (is_whole(self.requests) and self.requests >= 1):
            raise KvschedError(f"{where}: requests must be an integer >= 1, got {self.requests!r:.40}")
        if self.types and self.requests is None:
            raise KvschedError(f"{where}: a synthetic phase needs a number of requests")
        if self.types and isinstance(self.arrivals, Replay):
            raise KvschedError(f"{where}: replay needs a timed trace; synthetic phases take poisson, "
                               "poisson-trunc, gamma, piecewise, sine or closed arrivals")
        if not (isinstance(self.sample, bool) or self.sample == "permutation"):
            raise KvschedError(f"{where}: sample must be False (first rows), True (with replacement) or "
                               f"'permutation' (without replacement), got {self.sample!r}")
        if self.sample == "permutation" and self.trace is None:
            raise KvschedError(f"{where}: sample='permutation' draws a trace's rows; this phase has no trace")
        if self.window is not None and (any(isinstance(x, bool) for x in self.window)
                                        or not 0 <= self.window[0] < self.window[1]):
            raise KvschedError(f"{where}: window needs 0 <= start < end, got {self.window}")
        if (self.shared_prefix or self.sessions) and self.trace is not None:
            raise KvschedError(f"{where}: shared_prefix and sessions apply to synthetic phases (prompt/output "
                               "or types), not to a trace")
        if self.sessions is not None and isinstance(self.arrivals, Closed):
            raise KvschedError(f"{where}: sessions need open-loop arrivals (a follow-up turn is issued think "
                               "seconds after its previous turn finishes), not a closed loop")
        try:
            check_shared(self.shared_prefix)
        except KvschedError as exc:
            raise KvschedError(f"{where}: {exc}") from None


@dataclass
class _Part:
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    tier_codes: np.ndarray
    tiers: list[Tier]
    concurrency: int
    prefix: Ragged | None
    timed: bool = True
    segments: Segments | None = None
    prev: np.ndarray | None = None      # previous turn, index in the part (-1: none); None: no sessions
    think: np.ndarray | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    phases: tuple[Phase, ...]
    tiers: tuple[TierShare, ...] = ()
    seed: int = 0
    output_known: bool = False
    cap_len: int | None = None          # cap prompt + output at this many tokens
    keep_hashes: bool = False           # keep Mooncake hash_ids on the requests
    name: str = "workload"
    untimed_ok: bool = False            # a length-only trace without arrivals is allowed (stats)

    def build(self) -> Workload:
        if not self.phases:
            raise KvschedError(f"{self.name}: a workload needs at least one phase")
        for k, ph in enumerate(self.phases):
            try:
                ph.check(k)
            except KvschedError as exc:
                raise KvschedError(f"{self.name}: {exc}") from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise KvschedError(f"{self.name}: --seed must be an integer >= 0, got {self.seed!r}")
        total = sum(ph.requests or 0 for ph in self.phases)
        if total > max_requests():
            raise KvschedError(f"{self.name}: {total:,} requests need about {total * BYTES_PER_REQUEST / 2**30:,.0f} GiB "
                               f"to simulate; this machine fits at most {max_requests():,}")
        seeds = np.random.SeedSequence(self.seed).spawn(len(self.phases) + 1)
        parts, t0 = [], 0.0
        for k, ph in enumerate(self.phases):
            part = _generate(ph, k, np.random.default_rng(seeds[k]), self.keep_hashes, self.untimed_ok)
            if part.concurrency == 0 and len(part.arrival):
                part.arrival = part.arrival + t0
                t0 = float(part.arrival.max())
            parts.append(part)
        closed = {p.concurrency > 0 for p in parts}
        if len(closed) > 1:
            raise KvschedError(f"{self.name}: phases mix closed-loop and open-loop arrivals; "
                               "use one kind for the whole workload")
        sessions = any(p.prev is not None for p in parts)
        if sessions and self.cap_len is not None:
            raise KvschedError(f"{self.name}: cap_len does not apply to sessions (a turn's prompt holds the "
                               "previous turns); give max_model_len to reject turns that grow too long")
        prompt, output = _cap(np.concatenate([p.prompt for p in parts]),
                              np.concatenate([p.output for p in parts]), self.cap_len)
        tiers, codes = self._assign_tiers(parts, np.random.default_rng(seeds[-1]))
        sizes = [len(p.prompt) for p in parts]
        prefix = None
        if all(p.prefix is not None for p in parts):
            prefix = Ragged.concat([p.prefix for p in parts])
        segments, prev, think = _joined(parts, prompt)
        if sessions:
            codes = codes[session_roots(prev)]          # a session's turns share its first turn's tier
        return Workload.build(
            np.concatenate([p.arrival for p in parts]), prompt, output,
            output_known=self.output_known, tier_index=codes, tiers=tiers, source=self.name,
            phase=np.repeat(np.arange(len(parts)), sizes),
            phases=[ph.label(k) for k, ph in enumerate(self.phases)],
            concurrency=np.repeat([p.concurrency for p in parts], sizes), prefix=prefix,
            timed=all(p.timed for p in parts), declared_types=self.declared_types(),
            segments=segments, session_prev=prev, think=think)

    def declared_types(self) -> tuple[tuple[int, int, float], ...] | None:
        """(prompt, output, rate req/s) per request type, sorted by (output, prompt), when the
        workload has one open-loop phase of fixed-length types and an arrival process with a
        mean rate (the fluid model's types, fluid-wait-nested-wait.txt section 2.1); else None.
        A type's rate is the phase's rate times its share of the types' weights; types with the
        same lengths are merged. A length cap that changes a type leaves the workload undeclared."""
        if len(self.phases) != 1 or not self.phases[0].types:
            return None
        ph = self.phases[0]
        if ph.shared_prefix or ph.sessions is not None:     # prompts are no longer the types' lengths
            return None
        if not all(isinstance(t.prompt, Fixed) and isinstance(t.output, Fixed) for t in ph.types):
            return None
        weights = np.array([t.rate for t in ph.types], float)
        arrivals = ph.arrivals or Poisson(float(weights.sum()))
        rate = getattr(arrivals, "mean_rate", None)
        if isinstance(arrivals, Closed) or rate is None:
            return None
        merged: dict[tuple[int, int], float] = {}
        for t, w in zip(ph.types, weights):
            key = (int(t.prompt.value), int(t.output.value))
            if self.cap_len is not None and key[0] + key[1] > self.cap_len:
                return None
            merged[key] = merged.get(key, 0.0) + float(rate) * w / weights.sum()
        return tuple((p, o, r) for (p, o), r in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0])))

    def _assign_tiers(self, parts: list[_Part], rng: np.random.Generator):
        """Tiers from the phases (trace column, request types), else drawn by share."""
        named = {ts.tier.name: ts.tier for ts in self.tiers}
        tiers: list[Tier] = []
        codes = []
        for p in parts:
            local = [named.get(t.name, t) for t in p.tiers]
            for t in local:
                if t not in tiers:
                    tiers.append(t)
            remap = np.array([tiers.index(t) for t in local] + [-1], np.int16)
            codes.append(remap[p.tier_codes])          # code -1 picks the trailing -1
        codes = np.concatenate(codes)
        shares = [ts for ts in self.tiers if ts.share is not None]
        if not shares:
            return tiers, codes
        if tiers:
            raise KvschedError(f"{self.name}: tier shares cannot be combined with tiers that the "
                               "trace or the request types already set")
        p = numbers(f"{self.name}: tier shares", [ts.share for ts in shares]).astype(float)
        if not np.isfinite(p).all() or np.any(p < 0) or abs(p.sum() - 1) > 1e-9:
            raise KvschedError(f"{self.name}: tier shares must be >= 0 and sum to 1, got "
                               f"{', '.join(f'{ts.tier.name}={ts.share:g}' for ts in shares)}")
        return [ts.tier for ts in shares], rng.choice(len(shares), size=len(codes), p=p).astype(np.int16)


def _generate(ph: Phase, k: int, rng: np.random.Generator, keep_hashes: bool, untimed_ok: bool) -> _Part:
    if ph.trace is not None:
        return _from_trace(ph, k, rng, keep_hashes, untimed_ok)
    n = int(ph.requests)
    rates = numbers(f"{ph.label(k)}: request type rates", [t.rate for t in ph.types]).astype(float)
    if not np.all((rates > 0) & np.isfinite(rates)):
        raise KvschedError(f"{ph.label(k)}: every request type needs a finite rate (weight) > 0")
    arrivals = ph.arrivals or Poisson(float(rates.sum()))
    conc = arrivals.concurrency if isinstance(arrivals, Closed) else 0
    turns = ph.sessions.layout(rng, n) if ph.sessions is not None else None
    m = n if turns is None else len(turns)                  # first turns (a session is one user, one type)
    arrival = np.zeros(m) if conc else arrivals.times(rng, m)
    kind = rng.choice(len(rates), size=m, p=rates / rates.sum()) if len(rates) > 1 else np.zeros(m, int)
    if turns is not None:
        arrival, kind = np.repeat(arrival, turns), np.repeat(kind, turns)   # later turns: their session's start
    prompt, output = np.empty(n, np.int64), np.empty(n, np.int64)
    tiers = list(dict.fromkeys(t.tier for t in ph.types if t.tier is not None))
    codes = np.full(n, -1, np.int16)
    for j, t in enumerate(ph.types):
        mask = kind == j
        m = int(mask.sum())
        prompt[mask] = t.prompt.sample(rng, m)
        output[mask] = t.output.sample(rng, m)
        if t.tier is not None:
            codes[mask] = tiers.index(t.tier)
    if not ph.shared_prefix and ph.sessions is None:
        return _Part(arrival, prompt, output, codes, tiers, conc, None)
    s = share(k, ph.shared_prefix, turns, prompt, output, ph.sessions, rng)
    return _Part(arrival, s.prompt, output, codes, tiers, conc, None, segments=s.segments, prev=s.prev, think=s.think)


def _from_trace(ph: Phase, k: int, rng: np.random.Generator, keep_hashes: bool, untimed_ok: bool) -> _Part:
    perm = ph.sample == "permutation"
    rows = read_trace(ph.trace, format=ph.format, window=ph.window,
                      first=None if ph.sample else ph.requests, keep_hashes=keep_hashes)
    have = len(rows.prompt)
    n = have if ph.requests is None else int(ph.requests)
    if perm and n > have:
        raise KvschedError(f"{ph.label(k)}: {n:,} requests drawn without replacement (sample = "
                           f"'permutation') need as many rows; {label(rows.path)} has {have:,}")
    arrivals = ph.arrivals
    if isinstance(arrivals, TraceRate):
        arrivals = arrivals.resolve(rows.arrival is not None)
    untimed = arrivals is None and rows.arrival is None and untimed_ok
    if arrivals is None and not untimed:
        if rows.arrival is None:
            raise KvschedError(f"{label(rows.path)} has no arrival times: give --rate REQ_PER_S or --arrivals "
                               "(poisson:RATE, gamma:RATE:CV, closed:C, ...)")
        arrivals = Replay()
    if perm:
        idx = rng.permutation(have)[:n]
    else:
        idx = np.arange(n) if n <= have and not ph.sample else rng.integers(0, have, size=n)
    conc = arrivals.concurrency if isinstance(arrivals, Closed) else 0
    if conc or untimed:
        arrival = np.zeros(n)
    elif isinstance(arrivals, Replay):
        if rows.arrival is None:
            raise KvschedError(f"{label(rows.path)} is a length-only trace: it has no times to replay")
        stamps = arrivals.apply(rows.arrival, rng)
        if perm:
            arrival = stamps[idx]
        else:
            arrival = stamps[:n] if n <= have and not ph.sample else _resampled_gaps(rng, stamps, n)
    else:
        arrival = arrivals.times(rng, n)
    names = sorted(set(rows.tier) - {""}) if rows.tier is not None else []
    tiers = [Tier(name) for name in names]
    codes = np.full(n, -1, np.int16)
    if names:
        lookup = {name: j for j, name in enumerate(names)}
        codes = np.array([lookup.get(t, -1) for t in rows.tier], np.int16)[idx]
    prefix = rows.prefix.take(idx) if rows.prefix is not None else None
    segments = rows.segments.take(idx) if rows.segments is not None else None
    return _Part(arrival, rows.prompt[idx], rows.output[idx], codes, tiers, conc, prefix, not untimed, segments)


def _joined(parts: list[_Part], prompt: np.ndarray):
    """The parts' segments (clipped to `prompt`, the capped prompts), previous turns and think
    times over the whole workload, their indices shifted to caller ids (positions in part
    order); None for what no part has."""
    starts = np.cumsum([0] + [len(p.prompt) for p in parts])
    segments = prev = think = None
    if any(p.segments is not None for p in parts):
        own = []
        for p, base in zip(parts, starts):
            seg = p.segments if p.segments is not None else Segments.empty(len(p.prompt))
            ids = seg.ids.values
            if base and len(ids) and ids.min() < 0:         # own tokens of turn j: -(j + 1), shifted
                seg = Segments(Ragged(np.where(ids < 0, ids - base, ids), seg.ids.offsets), seg.lengths)
            own.append(seg)
        segments = Segments.concat(own)
        if (segments.tokens() > prompt).any():
            segments = segments.clip(prompt)
    if any(p.prev is not None for p in parts):
        prev = np.concatenate([np.full(len(p.prompt), -1, np.int64) if p.prev is None else
                               np.where(p.prev >= 0, p.prev + base, -1) for p, base in zip(parts, starts)])
        think = np.concatenate([np.zeros(len(p.prompt)) if p.think is None else p.think for p in parts])
    return segments, prev, think


def _resampled_gaps(rng: np.random.Generator, stamps: np.ndarray, n: int) -> np.ndarray:
    """n arrivals whose gaps are drawn with replacement from the trace's gaps."""
    order = np.sort(stamps)
    gaps = np.diff(order) if len(order) > 1 else np.zeros(1)
    return order[0] + np.concatenate(([0.0], np.cumsum(rng.choice(gaps, size=n - 1))))


def _cap(prompt: np.ndarray, output: np.ndarray, cap: int | None):
    """Cap prompt + output at `cap` tokens: the prompt at cap - 1, then the output at what is
    left. Reports how many requests changed (a warning, never silent)."""
    if cap is None:
        return prompt, output
    cap = check_cap_len(cap)
    new_prompt = np.minimum(prompt, cap - 1)
    new_output = np.minimum(output, cap - new_prompt)
    p, o = int((new_prompt != prompt).sum()), int((new_output != output).sum())
    changed = int(((new_prompt != prompt) | (new_output != output)).sum())
    if changed:
        warnings.warn(f"capped {changed} of {len(prompt)} requests at {cap} tokens (prompt + output): "
                      f"{p} prompts and {o} outputs shortened", stacklevel=3)
    return new_prompt, new_output


MAX_CAP_LEN = 2 * MAX_TOKENS       # a longest prompt plus a longest output


def check_cap_len(cap) -> int:
    """--cap-len (a workload's cap_len) as an int in 2..MAX_CAP_LEN: never read from nan, a
    bool or a non-integral number, nor past int64 (numpy would overflow)."""
    if not is_whole(cap) or cap < 2:
        raise KvschedError(f"--cap-len must be an integer >= 2 tokens, got {cap!r:.40}")
    if cap > MAX_CAP_LEN:
        raise KvschedError(f"--cap-len must be at most {MAX_CAP_LEN:,} tokens (prompt + output), got {cap:,}")
    return int(cap)
