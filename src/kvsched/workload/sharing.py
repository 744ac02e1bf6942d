"""Shared prompt content, for prefix caching: system prompts that a share of a phase's requests
begin with, and multi-turn sessions whose turns resend the conversation so far.

System prompt k (0-based) of phase p (0-based, in the workload's order) is content id
2**62 + (p << 20) + k: above every Mooncake hash id (a Mooncake trace numbers its blocks from 0),
and distinct across phases, so two phases never share a system prompt by accident.

A session of T turns: its first turn arrives by the phase's arrival process; turn k+1's prompt
is turn k's prompt, turn k's output and new user tokens (drawn from the phase's prompt
lengths), its output drawn from the phase's output lengths, and it is issued `think` seconds
after turn k finishes (the simulation decides when). Its segments are turn k's segments, then
turn k's own tokens (its prompt after its segments, then its output), named by turn k's id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.lengths import MAX_TOKENS, Fixed, LengthDist, parse_length
from kvsched.workload.request import Ragged, Segments

SYSTEM_PROMPT_BASE = 2 ** 62
MAX_SYSTEM_PROMPTS = 2 ** 20            # per phase: k has 20 bits in the content id


def system_prompt_id(phase: int, k):
    """The content id of system prompt k of phase `phase` (module docstring)."""
    return SYSTEM_PROMPT_BASE + (phase << 20) + k


@dataclass(frozen=True)
class SharedPrefix:
    """A system prompt of `tokens` tokens that each request begins with with probability `share`."""
    tokens: int
    share: float

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, (int, np.integer)) \
                or not 1 <= self.tokens <= MAX_TOKENS:
            raise KvschedError(f"shared_prefix: tokens must be an integer in 1..{MAX_TOKENS:,}, got {self.tokens!r}")
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0 <= self.share <= 1:
            raise KvschedError(f"shared_prefix: share must be a number in [0, 1], got {self.share!r}")


def check_shared(prefixes: tuple[SharedPrefix, ...]) -> None:
    """Shares that a request's draw can honour: at most one system prompt each."""
    if len(prefixes) > MAX_SYSTEM_PROMPTS:
        raise KvschedError(f"shared_prefix: at most {MAX_SYSTEM_PROMPTS:,} system prompts per phase")
    total = math.fsum(p.share for p in prefixes)
    if total > 1 + 1e-9:
        raise KvschedError(f"shared_prefix: shares sum to {total:g}; a request has one system prompt at most, "
                           "so they must sum to <= 1")


@dataclass(frozen=True)
class ThinkTime:
    """Seconds between a turn's finish and the next turn's issue: `fixed` (a), `exponential`
    (mean a) or `uniform` (a to b)."""
    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "exponential", "uniform"):
            raise KvschedError(f"sessions: think time kind must be fixed, exponential or uniform, got {self.kind!r}")
        bad_range = self.kind == "uniform" and self.b < self.a
        if bad_range or not all(math.isfinite(x) and x >= 0 for x in (self.a, self.b)):
            raise KvschedError(f"sessions: think time {self} needs finite seconds >= 0 (uniform: low <= high)")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, float(self.a))
        if self.kind == "exponential":
            return rng.exponential(self.a, size=n) if self.a > 0 else np.zeros(n)
        return rng.uniform(self.a, self.b, size=n)

    def __str__(self) -> str:
        return {"fixed": f"{self.a:g}", "exponential": f"exponential:{self.a:g}",
                "uniform": f"uniform:{self.a:g}:{self.b:g}"}[self.kind]


def parse_think(value) -> ThinkTime:
    """A number of seconds, 'fixed:S', 'exponential:MEAN' or 'uniform:LOW:HIGH'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ThinkTime("fixed", float(value))
    if not isinstance(value, str):
        raise KvschedError(f"sessions: think must be seconds or fixed:S, exponential:MEAN, uniform:LOW:HIGH, "
                           f"got {value!r}")
    kind, _, rest = value.partition(":")
    args = rest.split(":") if rest else []
    arity = {"fixed": 1, "exponential": 1, "uniform": 2}
    try:
        if kind not in arity and not rest:
            return ThinkTime("fixed", float(kind))
        if kind in arity and len(args) == arity[kind]:
            return ThinkTime(kind, *(float(a) for a in args))
    except ValueError:
        pass
    raise KvschedError(f"sessions: think {value!r} must be seconds or fixed:S, exponential:MEAN, uniform:LOW:HIGH")


@dataclass(frozen=True)
class Sessions:
    """Requests form sessions of `turns` turns (a length distribution: Fixed(4), geometric:3, ...)
    with `think` seconds between a turn's finish and the next turn."""
    turns: LengthDist
    think: ThinkTime = ThinkTime()

    def layout(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Turns per session, drawn until n requests are covered (the last session cut to fit)."""
        parts, total = [], 0
        while total < n:
            t = self.turns.sample(rng, max(16, math.ceil((n - total) / max(self.turns.mean, 1.0))))
            parts.append(t)
            total += int(t.sum())
        turns = np.concatenate(parts)
        ends = np.cumsum(turns)
        s = int(np.searchsorted(ends, n)) + 1
        turns = turns[:s].copy()
        turns[-1] -= ends[s - 1] - n
        return turns

    def __str__(self) -> str:
        return f"turns={self.turns},think={self.think}"


def parse_sessions(value) -> Sessions:
    """A TOML table {turns = 4 | "geometric:4", think = 5 | "exponential:5"} or the string
    'turns=4,think=exponential:5' (flags and --phase)."""
    if isinstance(value, str):
        table = {}
        for item in value.split(","):
            key, eq, v = item.strip().partition("=")
            if not eq:
                raise KvschedError(f"sessions {value!r}: expected turns=T[,think=S] items, got {item!r}")
            table[key] = v
    elif isinstance(value, dict):
        table = value
    else:
        raise KvschedError(f"sessions must be a table {{turns = .., think = ..}} or 'turns=T,think=S', got {value!r}")
    unknown = set(table) - {"turns", "think"}
    if unknown or "turns" not in table:
        raise KvschedError(f"sessions {value!r}: give turns (an integer or a length distribution) and "
                           "optionally think (seconds or a distribution)")
    turns = table["turns"]
    if isinstance(turns, str) and turns.isascii() and turns.isdigit() and len(turns) < 19:
        turns = int(turns)
    if isinstance(turns, bool) or not isinstance(turns, (int, str)):
        raise KvschedError(f"sessions: turns must be an integer >= 1 or a length distribution, got {turns!r}")
    try:
        dist = Fixed(turns) if isinstance(turns, int) else parse_length(turns)
    except KvschedError as exc:
        raise KvschedError(f"sessions: turns: {exc}") from None
    return Sessions(dist, parse_think(table.get("think", 0.0)))


def parse_shared_prefix(value) -> tuple[SharedPrefix, ...]:
    """A TOML list [{tokens = 1000, share = 0.3}, ...] or the string '1000:0.3,500:0.2'."""
    if isinstance(value, str):
        items = []
        for item in value.split(","):
            tokens, colon, share = item.strip().partition(":")
            if not colon:
                raise KvschedError(f"shared_prefix {value!r}: expected TOKENS:SHARE items, got {item!r}")
            try:
                items.append({"tokens": int(tokens), "share": float(share)})
            except ValueError:
                raise KvschedError(f"shared_prefix {value!r}: TOKENS is an integer, SHARE a number") from None
    elif isinstance(value, list) and all(isinstance(t, dict) for t in value):
        items = value
    else:
        raise KvschedError(f"shared_prefix must be a list of {{tokens, share}} tables or 'TOKENS:SHARE,...', "
                           f"got {value!r}")
    out = []
    for t in items:
        if set(t) != {"tokens", "share"}:
            raise KvschedError(f"shared_prefix: each entry needs exactly tokens and share, got {t!r}")
        out.append(SharedPrefix(t["tokens"], t["share"]))
    prefixes = tuple(out)
    check_shared(prefixes)
    return prefixes


@dataclass
class Shared:
    """What sharing adds to a phase's requests (indices local to the phase)."""
    prompt: np.ndarray
    segments: Segments
    prev: np.ndarray | None             # previous turn (-1: none); None without sessions
    think: np.ndarray | None


def share(phase: int, prefixes: tuple[SharedPrefix, ...], turns: np.ndarray | None, drawn: np.ndarray,
          output: np.ndarray, sessions: Sessions | None, rng: np.random.Generator) -> Shared:
    """Prompts and segments of a phase's requests, laid out session by session (`turns` per
    session, None: every request alone). `drawn` are the prompt lengths drawn for each request:
    a first turn's prompt is its system prompt (if any) and these; a later turn's adds them to
    the previous turn's prompt and output. One system prompt draw per session."""
    n = len(drawn)
    turns = np.ones(n, np.int64) if turns is None else turns
    start = np.concatenate(([0], np.cumsum(turns)[:-1])).astype(np.int64)
    first = np.repeat(start, turns)                         # each request's session's first turn
    t = np.arange(n, dtype=np.int64) - first                # its turn number (0 = the first)
    system = np.full(len(turns), -1, np.int64)
    if prefixes:
        p = np.array([x.share for x in prefixes] + [0.0])
        p[-1] = max(0.0, 1.0 - p[:-1].sum())
        system = rng.choice(len(p), size=len(turns), p=p / p.sum())
        system[system == len(prefixes)] = -1
    system = np.repeat(system, turns)
    sized = np.array([x.tokens for x in prefixes] + [0], np.int64)
    sys_len = sized[system]                                 # system -1 picks the trailing 0
    own = drawn + output                                    # a turn's own tokens (prompt after segments, output)
    before = np.cumsum(own) - own
    prompt = sys_len + (before - before[first]) + drawn
    has = system >= 0
    counts = has + t
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    ids = np.empty(offsets[-1], np.int64)
    lengths = np.empty(offsets[-1], np.int64)
    ids[offsets[:-1][has]] = system_prompt_id(phase, system[has])
    lengths[offsets[:-1][has]] = sys_len[has]
    req = np.repeat(np.arange(n, dtype=np.int64), t)        # one row per earlier turn of each request
    k = np.arange(len(req), dtype=np.int64) - np.repeat(np.cumsum(t) - t, t)
    ref = first[req] + k
    pos = offsets[req] + has[req] + k
    ids[pos] = -(ref + 1)
    lengths[pos] = own[ref]
    segments = Segments(Ragged(ids, offsets), Ragged(lengths, offsets))
    if sessions is None:
        return Shared(prompt, segments, None, None)
    prev = np.where(t > 0, np.arange(n, dtype=np.int64) - 1, -1)
    think = np.zeros(n)
    think[t > 0] = sessions.think.sample(rng, int((t > 0).sum()))
    return Shared(prompt, segments, prev, think)
