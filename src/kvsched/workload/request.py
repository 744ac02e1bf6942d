"""Requests and workloads, stored as arrays (one entry per request, sorted by arrival)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from numbers import Real
from typing import Sequence

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import MAX_CONCURRENCY
from kvsched.workload.lengths import numbers, whole, whole_array


@dataclass(frozen=True)
class Tier:
    """A service class: SLOs in seconds (None: no target) and a priority (lower is more urgent)."""
    name: str
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or any(ord(ch) < 32 or ch == "\x7f" for ch in self.name):
            raise KvschedError(f"tier name {self.name!r} must be non-empty, without spaces at either end, and "
                               "hold no control characters (newlines, tabs)")
        for key in ("ttft_slo", "tbt_slo"):     # seconds, kept as floats (compared with float times)
            v = getattr(self, key)
            if v is None:
                continue
            try:
                x = float(v) if isinstance(v, Real) and not isinstance(v, bool) else None
            except OverflowError:
                x = None
            if x is None or not 0 < x < float("inf"):
                raise KvschedError(f"tier {self.name}: {key} must be a positive finite number of seconds or None, "
                                   f"got {v!r:.40}")
            object.__setattr__(self, key, x)
        priority = whole(f"tier {self.name}: priority", self.priority, -INT64_MAX - 1, INT64_MAX)
        object.__setattr__(self, "priority", priority)


@dataclass(frozen=True)
class Request:
    """One request, as users build them by hand; `Workload.from_requests` collects them."""
    arrival: float
    prompt_tokens: int
    output_tokens: int
    tier: Tier | None = None
    output_known: bool = False
    id: int | None = None


@dataclass(frozen=True)
class Ragged:
    """One integer list per request (Mooncake `hash_ids`, segments), stored flat: request i owns
    values[offsets[i]:offsets[i + 1]]."""
    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def take(self, idx: np.ndarray) -> "Ragged":
        """The lists of requests `idx`, in that order (repeats allowed)."""
        idx = np.asarray(idx, np.int64)
        lengths = np.diff(self.offsets)[idx]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        shift = np.repeat(self.offsets[:-1][idx] - offsets[:-1], lengths)
        return Ragged(self.values[np.arange(offsets[-1], dtype=np.int64) + shift], offsets)

    @staticmethod
    def concat(parts: Sequence["Ragged"]) -> "Ragged":
        values = np.concatenate([p.values for p in parts]) if parts else np.zeros(0, np.int64)
        sizes = np.concatenate([np.diff(p.offsets) for p in parts]) if parts else np.zeros(0, np.int64)
        return Ragged(values.astype(np.int64), np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))

    def rows(self) -> np.ndarray:
        """The request each value belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.offsets))


@dataclass(frozen=True)
class Segments:
    """Per request, the shared token segments its prompt begins with. ids[i] and lengths[i] (same length)
    list request i's segments in order: its prompt starts with the first lengths[i][k] tokens of content
    ids[i][k], one after the other; the rest of its prompt, then its output, are its own tokens.
    An id >= 0 names content (a Mooncake hash_id block, a system prompt); an id < 0 names the own
    tokens of the request whose caller id (Workload.ids) is -(id + 1): its prompt after its segments,
    then its output (a session's next turn begins with the previous turn's segments and own tokens)."""
    ids: Ragged
    lengths: Ragged

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx) -> "Segments":
        """The segments of requests `idx`, in that order (repeats allowed), as `Ragged.take`."""
        return Segments(self.ids.take(idx), self.lengths.take(idx))

    @staticmethod
    def concat(parts: Sequence["Segments"]) -> "Segments":
        return Segments(Ragged.concat([p.ids for p in parts]), Ragged.concat([p.lengths for p in parts]))

    @staticmethod
    def empty(n: int) -> "Segments":
        """n requests without segments."""
        flat = Ragged(np.zeros(0, np.int64), np.zeros(n + 1, np.int64))
        return Segments(flat, flat)

    def tokens(self) -> np.ndarray:
        """Segment tokens per request (the shared part of each prompt)."""
        total = np.concatenate(([0], np.cumsum(self.lengths.values, dtype=np.int64)))
        return total[self.lengths.offsets[1:]] - total[self.lengths.offsets[:-1]]

    def clip(self, prompt: np.ndarray) -> "Segments":
        """The segments within each request's first prompt[i] tokens: later ones dropped, the
        one crossing the end shortened (a shorter length of the same content shares its first
        tokens)."""
        lengths, offsets = self.lengths.values, self.lengths.offsets
        rows = self.lengths.rows()
        before = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))     # tokens before each value
        start = before[:-1] - before[offsets[:-1]][rows]                          # ... within its request
        room = np.asarray(prompt, np.int64)[rows] - start
        keep = room > 0
        counts = np.bincount(rows[keep], minlength=len(self))
        new = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return Segments(Ragged(self.ids.values[keep], new), Ragged(np.minimum(lengths, room)[keep], new))


INT64_MAX = 2 ** 63 - 1
INT16_MAX = 2 ** 15 - 1        # tier and phase indices are int16


def _per_request(values, n: int):
    """A scalar given for every request, as n copies (bools stay bools, to be refused)."""
    return [values] * n if isinstance(values, (int, float, bool, np.number, np.bool_)) else values


def _sorted(name: str, a: np.ndarray, n: int, order: np.ndarray) -> np.ndarray:
    if len(a) != n:
        raise KvschedError(f"Workload.build: {name} has {len(a)} entries, arrival has {n}")
    return a[order]


def _seconds(name: str, values, n: int | None) -> np.ndarray:
    """Times in seconds as float64: finite and >= 0, else a KvschedError naming name[index]. With
    n, None is n zeros and a scalar is n copies."""
    if n is not None:
        values = np.zeros(n) if values is None else _per_request(values, n)
    a = numbers(name, values).astype(np.float64)
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        k = int(np.argmax(bad))
        raise KvschedError(f"{name}[{k}] must be a finite number of seconds >= 0, got {a[k].item()!r}")
    return a


def _declared(types) -> tuple[tuple[int, int, float], ...] | None:
    """declared_types checked: (prompt, output, rate req/s) with whole token counts and a finite rate > 0."""
    if types is None:
        return None
    out = []
    for j, t in enumerate(types):
        if not isinstance(t, (tuple, list)) or len(t) != 3:
            raise KvschedError(f"Workload.build: declared_types[{j}] must be (prompt, output, rate), got {t!r:.60}")
        rate = t[2]
        if isinstance(rate, bool) or not isinstance(rate, Real) or not 0 < rate < float("inf"):
            raise KvschedError(f"Workload.build: declared_types[{j}] rate must be a finite number > 0, got {rate!r}")
        out.append((whole(f"Workload.build: declared_types[{j}] prompt", t[0]),
                    whole(f"Workload.build: declared_types[{j}] output", t[1]), float(rate)))
    return tuple(out)


def _flags(values, n: int) -> np.ndarray:
    """output_known: one bool, or one per request (True/False or 1/0), never another number read as true."""
    a = np.full(n, values) if isinstance(values, (bool, np.bool_)) else np.asarray(values)
    if a.ndim != 1 or not (a.dtype.kind == "b" or (a.dtype.kind in "iu" and np.isin(a, (0, 1)).all())):
        raise KvschedError(f"Workload.build: output_known must be True/False, or one per request, got {values!r:.60}")
    return a.astype(bool)


def session_roots(prev: np.ndarray) -> np.ndarray:
    """Each request's session's first turn, from the previous-turn indices (-1: a first turn),
    by pointer doubling (log of the longest session steps)."""
    root = np.where(prev >= 0, prev, np.arange(len(prev)))
    while True:
        nxt = root[root]
        if np.array_equal(nxt, root):
            return root
        root = nxt


@dataclass(frozen=True)
class Workload:
    """Requests as arrays. Index i is request i; `ids` keeps the caller's ids.

    `output_known` says, per request, whether schedulers may see the output length
    (the fluid WAIT policy assumes they can, Nested WAIT that they cannot).
    `phase` indexes `phases` (names of the workload's consecutive phases).
    `concurrency` > 0 makes request i closed-loop: it is issued the moment fewer than
    concurrency[i] requests are in flight (`vllm bench serve --max-concurrency`), so its
    arrival time is decided by the simulation; the stored arrival is then 0. 0 = open loop.
    `prefix` keeps each prompt's prefix-block hashes when the trace has them.
    `timed` is False for lengths without arrival times (a length-only trace described by
    `kvsched workload stats`); such a workload can be described but not simulated.
    `declared_types` holds (prompt, output, rate req/s) per request type when the workload
    declares them (one open-loop phase of fixed-length types, fluid-wait-nested-wait.txt
    section 2.1), sorted by (output, prompt); None otherwise. WAIT reads its rates from here.
    `segments` lists the shared token segments each prompt begins with (`Segments`; None: no
    request shares any), for prefix caching.
    `session_prev` is the caller id of a request's previous turn in its session (-1: none, a
    first turn or no session); such a follow-up turn is issued `think[i]` seconds after its
    previous turn finishes (decided by the simulation), so its stored arrival is a placeholder
    (its session's start) that sorts it after its previous turn. A session is a chain: a turn
    has at most one follow-up.
    """
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    output_known: np.ndarray
    tier_index: np.ndarray
    tiers: tuple[Tier, ...] = ()
    ids: np.ndarray = field(default=None)  # type: ignore[assignment]
    source: str = "synthetic"
    phase: np.ndarray = field(default=None)  # type: ignore[assignment]
    phases: tuple[str, ...] = ("all",)
    concurrency: np.ndarray = field(default=None)  # type: ignore[assignment]
    prefix: Ragged | None = None
    timed: bool = True
    declared_types: tuple[tuple[int, int, float], ...] | None = None
    segments: Segments | None = None
    session_prev: np.ndarray = field(default=None)  # type: ignore[assignment]
    think: np.ndarray = field(default=None)  # type: ignore[assignment]
    adapter: np.ndarray = field(default=None)  # type: ignore[assignment]    # LoRA adapter per request (-1: none)
    model_index: np.ndarray = field(default=None)  # type: ignore[assignment]    # index into `models` (-1: the run's)
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(n, dtype=np.int64))
        if self.phase is None:
            object.__setattr__(self, "phase", np.zeros(n, np.int16))
        if self.concurrency is None:
            object.__setattr__(self, "concurrency", np.zeros(n, np.int64))
        if self.session_prev is None:
            object.__setattr__(self, "session_prev", np.full(n, -1, np.int64))
        if self.think is None:
            object.__setattr__(self, "think", np.zeros(n, np.float64))
        if self.adapter is None:
            object.__setattr__(self, "adapter", np.full(n, -1, np.int32))
        if self.model_index is None:
            object.__setattr__(self, "model_index", np.full(n, -1, np.int16))
        if n and not -1 <= self.model_index.min() <= self.model_index.max() < len(self.models):
            raise KvschedError("workload: model index out of range")
        if n and self.adapter.min() < -1:
            raise KvschedError("workload: adapter must be -1 (none) or an adapter's number >= 0")
        for name in ("prompt", "output", "output_known", "tier_index", "ids", "phase", "concurrency",
                     "session_prev", "think", "adapter", "model_index"):
            if len(getattr(self, name)) != n:
                raise KvschedError(f"workload: {name} has {len(getattr(self, name))} entries, expected {n}")
        if self.prefix is not None and len(self.prefix) != n:
            raise KvschedError(f"workload: prefix has {len(self.prefix)} entries, expected {n}")
        if n and self.phase.max() >= len(self.phases):
            raise KvschedError("workload: phase index out of range")
        if n and self.concurrency.min() < 0:
            raise KvschedError("workload: concurrency must be >= 0")
        if n and self.closed_loop and self.concurrency.min() == 0:
            raise KvschedError("workload: closed-loop and open-loop requests cannot be mixed")
        if n and (not np.all(np.isfinite(self.arrival)) or self.arrival.min() < 0):
            raise KvschedError("workload: arrival times must be finite and >= 0")
        if n and np.any(np.diff(self.arrival) < 0):
            raise KvschedError("workload: arrivals must be sorted (use Workload.build)")
        if n and (self.prompt.min() < 1 or self.output.min() < 1):
            raise KvschedError("workload: every request needs >= 1 prompt and >= 1 output token")
        if n and self.tier_index.max(initial=-1) >= len(self.tiers):
            raise KvschedError("workload: tier index out of range")
        if n and (not np.all(np.isfinite(self.think)) or self.think.min() < 0):
            raise KvschedError("workload: think times must be finite and >= 0 seconds")
        if n and self.session_prev.min() < -1:
            raise KvschedError("workload: session_prev holds caller ids of previous turns, or -1 (none)")
        if self.segments is not None:
            self._check_segments()
        if self.has_sessions or (self.segments is not None and len(self.segments.ids.values)
                                 and self.segments.ids.values.min() < 0):
            self._check_sessions()

    def _check_segments(self) -> None:
        s, n = self.segments, len(self)
        if len(s.ids) != n or len(s.lengths) != n:
            raise KvschedError(f"workload: segments have {len(s.ids)} ids and {len(s.lengths)} lengths entries, "
                               f"expected {n}")
        if not np.array_equal(s.ids.offsets, s.lengths.offsets):
            raise KvschedError("workload: segment ids and lengths differ in shape (one length per id)")
        short = s.lengths.values < 1
        if short.any():
            k = int(np.argmax(short))
            raise KvschedError(f"workload: request {int(self.ids[s.lengths.rows()[k]])} has a segment of "
                               f"{int(s.lengths.values[k])} tokens; each needs >= 1")
        tokens = s.tokens()
        over = tokens > self.prompt
        if over.any():
            k = int(np.argmax(over))
            raise KvschedError(f"workload: request {int(self.ids[k])}'s segments hold {int(tokens[k])} tokens, "
                               f"more than its prompt of {int(self.prompt[k])}")

    def _check_sessions(self) -> None:
        """Turns follow earlier turns, sessions are chains, and an own-token segment (id < 0)
        names an earlier turn of the same session."""
        n = len(self)
        if self.closed_loop and self.has_sessions:
            raise KvschedError("workload: sessions need open-loop arrivals (a follow-up turn is issued "
                               "think seconds after its previous turn finishes, not when a seat frees)")
        if len(np.unique(self.ids)) != n:
            raise KvschedError("workload: sessions and own-token segments need distinct request ids")
        prev = self.previous_turn()
        turns = prev[prev >= 0]
        if len(np.unique(turns)) != len(turns):
            k = int(np.flatnonzero(np.bincount(turns) > 1)[0])
            raise KvschedError(f"workload: request {int(self.ids[k])} has two follow-up turns; a session is a chain")
        if self.segments is None:
            return
        values = self.segments.ids.values
        own = values < 0
        if not own.any():
            return
        rows = self.segments.ids.rows()[own]
        names = -(values[own] + 1)
        where = self._index_of(names)
        root = session_roots(prev)
        bad = (where < 0) | (where >= rows)
        bad[~bad] = root[where[~bad]] != root[rows[~bad]]
        if bad.any():
            k = int(np.argmax(bad))
            raise KvschedError(f"workload: request {int(self.ids[rows[k]])} has a segment of request "
                               f"{int(names[k])}'s own tokens, which is not an earlier turn of its session")

    def _index_of(self, ids: np.ndarray) -> np.ndarray:
        """Index of each caller id (-1 where no request has it)."""
        if not len(self) or not len(ids):
            return np.full(len(ids), -1, np.int64)
        order = np.argsort(self.ids, kind="stable")
        known = self.ids[order]
        pos = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        return np.where(known[pos] == ids, order[pos], -1)

    def previous_turn(self) -> np.ndarray:
        """Index of each request's previous turn in its session (-1: none); checked to name an
        existing, earlier request."""
        prev = np.full(len(self), -1, np.int64)
        has = self.session_prev >= 0
        later = np.flatnonzero(has)
        where = self._index_of(self.session_prev[has])
        bad = (where < 0) | (where >= later)
        if bad.any():
            k = int(later[np.argmax(bad)])
            raise KvschedError(f"workload: request {int(self.ids[k])}'s previous turn {int(self.session_prev[k])} "
                               "is not an earlier request (session_prev: a caller id, or -1)")
        prev[has] = where
        return prev

    @property
    def has_sessions(self) -> bool:
        return bool(len(self.session_prev)) and int(self.session_prev.max()) >= 0

    def refuse_sessions(self, what: str) -> None:
        """`what` reads arrival times, which a session's later turns get only in simulation."""
        if self.has_sessions:
            raise KvschedError(f"{what} cannot take a workload with sessions: later turns arrive when the "
                               "simulation issues them (use kvsched simulate)")

    @classmethod
    def build(cls, arrival, prompt, output, *, output_known=False, tier_index=None,
              tiers: Sequence[Tier] = (), ids=None, source: str = "synthetic", phase=None,
              phases: Sequence[str] = ("all",), concurrency=None,
              prefix: Ragged | None = None, timed: bool = True,
              declared_types: tuple[tuple[int, int, float], ...] | None = None,
              segments: Segments | None = None, session_prev=None, think=None) -> "Workload":
        """Arrays in any order -> a workload sorted by arrival (stable, so ties keep order).
        Every value is checked before it is cast (a bool, nan, a non-integral token count or one
        out of range is a KvschedError naming the parameter, never truncated or wrapped);
        a per-request parameter other than arrival may be one scalar for all."""
        arrival = _seconds("Workload.build: arrival", arrival, None)
        n = len(arrival)
        order = np.argsort(arrival, kind="stable")

        def ints(name, values, default, low, high):
            if values is None and default is not None:
                return np.full(n, default, np.int64)
            return _sorted(name, whole_array(f"Workload.build: {name}", _per_request(values, n), low, high), n, order)
        tiers, phases = tuple(tiers), tuple(phases)
        known = _sorted("output_known", _flags(output_known, n), n, order)
        # lengths up to int64: the simulation rejects and counts those no server can hold
        return cls(arrival[order], ints("prompt", prompt, None, 1, INT64_MAX),
                   ints("output", output, None, 1, INT64_MAX), known,
                   ints("tier_index", tier_index, -1, -1, min(len(tiers), INT16_MAX) - 1).astype(np.int16), tiers,
                   order.astype(np.int64) if ids is None else ints("ids", ids, None, -INT64_MAX - 1, INT64_MAX),
                   source, ints("phase", phase, 0, 0, min(len(phases), INT16_MAX) - 1).astype(np.int16), phases,
                   ints("concurrency", concurrency, 0, 0, MAX_CONCURRENCY),
                   None if prefix is None else prefix.take(order), timed, _declared(declared_types),
                   None if segments is None else segments.take(order),
                   ints("session_prev", session_prev, -1, -1, INT64_MAX),
                   _sorted("think", _seconds("Workload.build: think", think, n), n, order))

    @classmethod
    def from_requests(cls, requests: Sequence[Request]) -> "Workload":
        tiers: list[Tier] = []
        tix = []
        for r in requests:
            if r.tier is None:
                tix.append(-1)
            else:
                if r.tier not in tiers:
                    tiers.append(r.tier)
                tix.append(tiers.index(r.tier))
        ids = [r.id if r.id is not None else k for k, r in enumerate(requests)]
        return cls.build([r.arrival for r in requests], [r.prompt_tokens for r in requests],
                         [r.output_tokens for r in requests],
                         output_known=[r.output_known for r in requests], tier_index=tix,
                         tiers=tiers, ids=ids, source="requests")

    def __len__(self) -> int:
        return len(self.arrival)

    def take(self, idx: np.ndarray) -> "Workload":
        """The requests at increasing indices `idx`, in their order, with everything else as it
        is (a replica's share of an open loop: sim/routed_ahead.py). Session links name caller
        ids, so a workload with sessions is refused."""
        self.refuse_sessions("Workload.take")
        per_request = ("arrival", "prompt", "output", "output_known", "tier_index", "ids", "phase", "concurrency",
                       "session_prev", "think", "adapter", "model_index")
        taken = {name: getattr(self, name)[idx] for name in per_request}
        for name in ("prefix", "segments"):
            part = getattr(self, name)
            taken[name] = None if part is None else part.take(idx)
        return replace(self, **taken)

    @property
    def closed_loop(self) -> bool:
        return bool(len(self.concurrency)) and int(self.concurrency.max()) > 0

    def tier_of(self, i: int) -> Tier | None:
        t = int(self.tier_index[i])
        return None if t < 0 else self.tiers[t]
