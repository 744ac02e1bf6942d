"""WAIT and Nested WAIT, the threshold schedulers of fluid-wait-nested-wait.txt (Algorithms 1
and 2); their thresholds come from `kvsched.theory.wait`.

A request at stage 0 waits for its prefill; at stage k >= 1 it has k output tokens and is
scheduled to receive its k-th decode token (the paper's stage k; kvsched's prefill yields
the first token, so a request with o output tokens has stages 0..o-1, l' = o - 1). Both
policies launch a batch only when threshold queues are full, run whole prompts (no
chunking) and pause what they leave out with its KV kept (`Plan.decode` as a collection).

Not in the paper, required here (documented in docs/theory.md):
- **Drain.** With the literal rules the last prompts of a type never start once arrivals
  stop. When no arrival is pending (`view.arrivals_pending` false) the thresholds drop:
  every group with anything left runs, min(n, queue) per stage.
- **max_wait** (seconds, off by default so the theory regime stays exact) flushes a partial
  batch once the oldest waiting prompt of a type (WAIT) or of segment 1 (Nested WAIT) has
  waited that long. It is checked when the policy plans (batch ends and arrivals).
- **KV check.** WAIT needs no preemption when KV >= M^pi (eq. 9; in tokens at block size 1,
  larger blocks round each request up). A batch that would not fit anyway (smaller KV,
  online thresholds) drops the newest work first: prompts not yet admitted, then running
  requests (paused ones before the batch's own), preempted by recompute and counted in
  `preemptions`.
- **Closed loops.** A new request arrives only when one finishes; when the thresholds would
  leave the replica idle while it holds requests, the policy flushes as in the drain.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Hashable

from kvsched.cost.fit import coefficients
from kvsched.errors import KvschedError
from kvsched.params import MAX_INT
from kvsched.policies.base import Plan, ServerView
from kvsched.theory import wait as theory
from kvsched.theory.fluid import FluidType


def parse_counts(text: str, what: str) -> list[int]:
    """'22,22' -> [22, 22]: whole numbers >= 1 (thresholds) or >= 0 (stage ends), <= 2**40."""
    if not text.strip():
        return []
    low = 0 if what == "segments" else 1
    try:
        if "_" in text:
            raise ValueError
        values = [int(x.strip()) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} expects comma-separated whole numbers, got {text!r}") from None
    if any(not low <= x <= MAX_INT for x in values):
        raise ValueError(f"{what} must be whole numbers in {low}..{MAX_INT:,}, got {text!r}")
    return values


class _Threshold:
    """Inventories by (group, stage) and the batch mechanics both algorithms share.

    Stage 0 (waiting prompts) is a FIFO per group; stages >= 1 are ordered sets per group,
    moved forward as the policy selects them, so planning costs O(stages + batch)."""
    name = "threshold"
    max_wait: float = 0.0

    def _check_role(self, v: ServerView) -> None:
        if v.role != "mixed":
            raise KvschedError(f"{self.name} schedules whole requests on one replica (the paper's single GPU); "
                               f"it cannot run on a {v.role} replica of disaggregated pools")

    def _setup(self) -> None:
        self._waiting: dict[Hashable, deque[int]] = {}
        self._stages: dict[Hashable, dict[int, dict[int, None]]] = {}
        self._where: dict[int, tuple[Hashable, int]] = {}      # request -> (group, stage)
        self._running_of: dict[Hashable, int] = {}
        self._moved: list[int] = []
        self._staged = True             # stages >= 1 kept in `_stages` (off when every decoder runs)
        self.preemptions = 0
        self.batches = 0
        self._seen, self._first, self._last = 0, 0.0, 0.0      # arrivals seen, first and last times
        self._given = parse_counts(self.thresholds, "thresholds")
        self._n: list[int] = []
        self._rates: list[float] | None = None                  # declared
        self._since = 0                                         # events since the last online solve
        self._source = ""
        self._theory: dict[str, object] = {}

    def _arrival_rate(self) -> float | None:
        """Arrivals per second between the first and the latest arrival seen."""
        return (self._seen - 1) / (self._last - self._first) if self._last > self._first else None

    def _resolve_online(self, v: ServerView, estimate, source: str) -> None:
        """Count one event; every `resolve_every` of them re-solve the thresholds from online
        rates (`estimate(arrival rate)`), unless they are given or the rates declared. An
        estimate that looks overloaded keeps the last thresholds (its error is reported)."""
        self._since += 1
        rate = self._arrival_rate()
        if self._rates is not None or self._given or self._since < self.resolve_every or not rate:
            return
        self._since = 0
        try:
            self._solve(v, estimate(rate))
            self._source = source
        except KvschedError as exc:
            self._theory["last_error"] = str(exc)

    # ----- inventories ---------------------------------------------------------------
    def _sync(self, v: ServerView) -> None:
        """Place new arrivals (the unseen tail of the replica's queue) in their groups."""
        new = []
        for i in reversed(v.waiting):
            if i in self._where:
                break
            new.append(i)
        for i in reversed(new):
            t = v.arrival(i)
            if not self._seen:
                self._first = t
            self._seen, self._last = self._seen + 1, t
            g = self._group(v, i)
            self._where[i] = (g, 0)
            self._waiting.setdefault(g, deque()).append(i)
            self._arrived(v, i, g)

    def _group(self, v: ServerView, i: int) -> Hashable:
        raise NotImplementedError

    def _arrived(self, v: ServerView, i: int, g: Hashable) -> None:
        """Hook for rate estimates."""

    def _take(self, g: Hashable, stage: int, n: int) -> list[int]:
        if stage == 0:
            q = self._waiting.get(g)
            return list(islice(q, n)) if q else []
        ids = self._stages.get(g, {}).get(stage)
        return list(islice(ids, n)) if ids else []

    def _count(self, g: Hashable, stage: int) -> int:
        return len(self._waiting.get(g, ())) if stage == 0 else len(self._stages.get(g, {}).get(stage, ()))

    def _advance(self, v: ServerView, admit: list[int], decode: list[int]) -> None:
        """Record the planned batch: admitted prompts leave stage 0 (stage -1: in flight);
        `_settle` places them and the decoders at the stage the replica reports."""
        for i in admit:
            g, _ = self._where[i]
            q = self._waiting[g]
            q.popleft() if q[0] == i else q.remove(i)
            self._where[i] = (g, -1)
            self._running_of[g] = self._running_of.get(g, 0) + 1
        self._moved = decode + admit

    def _settle(self, v: ServerView) -> None:
        """Move last batch's requests to the stage the replica reports (`view.generated`),
        so the inventories follow what ran even if the plan was changed on its way (an
        admission that did not happen returns to the front of stage 0)."""
        where, gen = self._where, v.generated
        for i in self._moved:
            at = where.get(i)
            if at is None or at[1] == 0:        # finished, or preempted back to stage 0
                continue
            g, k = at
            if k == -1 and not v.is_decoding(i):
                where[i] = (g, 0)
                self._waiting[g].appendleft(i)
                self._running_of[g] -= 1
                continue
            new = gen(i)
            if not self._staged:
                where[i] = (g, new)
            elif new != k:
                if k > 0:
                    self._drop(g, k, i)
                self._put(i, g, new)
                self._entered(new)
        self._moved = []

    def _entered(self, stage: int) -> None:
        """Hook: a request reached `stage`."""

    def _put(self, i: int, g: Hashable, stage: int) -> None:
        self._where[i] = (g, stage)
        self._stages.setdefault(g, {}).setdefault(stage, {})[i] = None

    def _drop(self, g: Hashable, k: int, i: int) -> None:
        stages = self._stages[g]
        del stages[k][i]
        if not stages[k]:
            del stages[k]

    def on_finish(self, i: int, view: ServerView) -> None:
        g, k = self._where.pop(i)
        if k > 0 and self._staged:
            self._drop(g, k, i)
        self._running_of[g] -= 1

    def on_preempt(self, i: int, view: ServerView) -> None:
        g, k = self._where[i]
        if k > 0 and self._staged:
            self._drop(g, k, i)
        if k:
            self._running_of[g] -= 1
        self._where[i] = (g, 0)
        self._waiting.setdefault(g, deque()).appendleft(i)
        self.preemptions += 1

    @staticmethod
    def _stuck(v: ServerView, plan: Plan) -> bool:
        """A closed loop (arrivals pending, no time known) where this plan leaves requests held
        and nothing running: only a finish could bring the next arrival."""
        return (not plan.admit and not plan.decode and v.arrivals_pending and v.next_arrival is None
                and bool(v.running or v.waiting))

    def _overdue(self, v: ServerView, g: Hashable) -> bool:
        q = self._waiting.get(g)
        return bool(self.max_wait and q and v.now - v.arrival(q[0]) >= self.max_wait)

    # ----- the batch -----------------------------------------------------------------
    def schedule(self, v: ServerView) -> Plan:
        if self._source == "":
            self._start(v)
        self._settle(v)
        self._sync(v)
        plan = self._plan(v, not v.arrivals_pending)
        if self._stuck(v, plan):
            plan = self._plan(v, True)
        return plan

    def _start(self, v: ServerView) -> None:
        raise NotImplementedError

    def _plan(self, v: ServerView, drain: bool) -> Plan:
        raise NotImplementedError

    def _report(self, **head) -> dict[str, object]:
        """`report()`: what identifies the thresholds, then source, counts and the last solve."""
        return {**head, "source": self._source, "preemptions": self.preemptions, "batches": self.batches,
                **self._theory}

    def _record(self, v: ServerView, rates: list[float], d0: float, d1: float, check: dict) -> None:
        """What `report()` shows of the last solve: rates, d0/d1, the condition and fits_kv."""
        self._theory = {"rates": rates, "d0": d0, "d1": d1, **check,
                        "fits_kv": check["memory"] <= v.kv_capacity_blocks * v.block_size}

    def _launch(self, v: ServerView, admit: list[int], decode: list[int], all_decoders: bool = False) -> Plan:
        """Fit the batch in KV (`_fit`), record it and return the plan (decode=True when it
        selects every remaining decoder, the engine's fast path)."""
        if not admit and not decode and not (all_decoders and v.num_decoding):
            return Plan()
        victims = self._fit(v, admit, decode, all_decoders)
        if victims:
            gone = set(victims)
            decode = [i for i in decode if i not in gone]
        self._advance(v, admit, [] if all_decoders else decode)
        self.batches += 1
        chunks = [(i, v.prefill_target(i)) for i in admit]
        remaining = v.num_decoding - sum(1 for i in victims if v.is_decoding(i))
        if all_decoders or (decode and len(decode) == remaining):
            sel: bool | list[int] = remaining > 0
        else:
            sel = decode
        return Plan(admit, chunks, sel, victims)

    def _fit(self, v: ServerView, admit: list[int], decode: list[int], all_decoders: bool) -> list[int]:
        """The newest work goes first: prompts not yet admitted (the last planned first);
        then, if the decodes alone do not fit, running requests by recompute, paused ones
        before the batch's own, newest first; then the dropped prompts that fit again."""
        need = v.decode_new_blocks if all_decoders else sum(v.needs_block(i) for i in decode)   # (an int with --spec)
        free = v.kv_free_blocks
        blocks = [v.blocks_for(v.prefill_target(i)) for i in admit]
        prompts = sum(blocks)
        dropped: list[tuple[int, int]] = []
        while need + prompts > free and admit:
            b = blocks.pop()
            dropped.append((admit.pop(), b))
            prompts -= b
        victims: list[int] = []
        if need > free:
            chosen = None if all_decoders else set(decode)
            running = list(reversed(v.running))
            paused = [] if chosen is None else [i for i in running if i not in chosen]
            for i in paused + [i for i in running if chosen is None or i in chosen]:
                if need <= free:
                    break
                victims.append(i)
                free += v.kv_blocks(i)
                if v.is_decoding(i) and (chosen is None or i in chosen):
                    need -= v.needs_block(i)
        while dropped and need + prompts + dropped[-1][1] <= free:
            i, b = dropped.pop()
            admit.append(i)
            prompts += b
        return victims


def _declared_solve(solve) -> None:
    try:
        solve()
    except KvschedError as exc:
        raise KvschedError(f"{exc}; the declared rates overload this replica under its cost model: "
                           "lower --rate or give thresholds=") from None


def _solve_coefficients(v: ServerView, types: list[FluidType]) -> tuple[float, float]:
    """d0, d1 of eq. (1) from the replica's cost model (`cost.fit`), at the types' mean lengths."""
    total = sum(t.rate for t in types)
    mu_l = sum(t.rate * t.prompt for t in types) / total
    mu_o = sum(t.rate * (t.decode + 1) for t in types) / total
    c = coefficients(v.cost_model, mu_l, mu_o)
    return c.d0, c.d1


@dataclass
class Wait(_Threshold):
    """WAIT (Algorithm 1, known output lengths). Types are the distinct (prompt, output)
    pairs: the workload's declared types, else discovered online (binned by `type_bins`).
    When the replica is idle only stage-0 queues are tested: every type j with at least n_j
    waiting prompts is included and takes up to n_j prompts from each of its stages; the
    other types pause with their KV kept (`pause_excluded=false`: every running request
    decodes and only admission is gated).

    Thresholds: `thresholds` as given (types sorted by (output, prompt)); else rule=fluid
    solves eq. (9) with `theory.wait.solve_wait` from the cost model's d0/d1 and the type
    rates (declared, or estimated online from arrivals and re-solved every `resolve_every`
    arrivals; thresholds are 1 until the first estimate); rule=practical is section 6.1's
    n_j = B rho_j / (l'_j + 1), rounded to the nearest whole number >= 1. The practical rule
    ignores memory and can violate eq. (9): long types get too small a threshold, so their
    queues grow. `report()` gives the thresholds used."""
    thresholds: str = field(default="", metadata={"range": "n,n,.. (whole, >= 1)", "help": "n_1,...,n_m in type order (output, prompt); empty: solve"})
    rule: str = field(default="fluid", metadata={"range": "fluid|practical", "help": "fluid (eq. 9) or practical (section 6.1, needs batch_size)"})
    batch_size: int = field(default=0, metadata={"range": "[0, inf)", "help": "B of the practical rule"})
    pause_excluded: bool = field(default=True, metadata={"help": "types not included pause (Algorithm 1); false: they decode, only admission is gated"})
    strict: bool = field(default=False, metadata={"help": "solve with Delta T < n_j / lambda_j (Theorem 1's O(1) latency)"})
    type_bins: int = field(default=0, metadata={"range": "[0, 64]", "help": "online types: lengths rounded up to K bins per doubling (0: exact pairs)"})
    resolve_every: int = field(default=500, metadata={"range": "[1, inf)", "help": "online rates: arrivals between re-solves"})
    max_wait: float = field(default=0.0, metadata={"range": "[0, inf)", "help": "seconds before a partial batch is flushed (0: off)"})
    name = "wait"

    def __post_init__(self) -> None:
        self._setup()
        if self.rule not in ("fluid", "practical"):
            raise ValueError(f"rule must be fluid or practical, got {self.rule!r}")
        if self.rule == "practical" and self.batch_size < 1:
            raise ValueError("rule=practical needs batch_size=B >= 1 (section 6.1)")
        if self.rule == "fluid" and self.batch_size:
            raise ValueError("batch_size is B of rule=practical; rule=fluid solves eq. (9) instead")
        if self._given and self.rule == "practical":
            raise ValueError("give either thresholds or rule=practical, not both")
        self._staged = self.pause_excluded
        self._types: list[tuple[int, int]] = []         # (prompt, output) per type index
        self._index: dict[tuple[int, int], int] = {}
        self._counts: list[int] = []

    def _start(self, v: ServerView) -> None:
        self._check_role(v)
        declared = v.declared_types
        if declared is not None:
            for p, o, _ in declared:
                self._new_type((p, o))
            self._rates = [r for _, _, r in declared]
        elif self._given:
            raise KvschedError("thresholds= needs a workload that declares its types (one phase of fixed-length "
                               "types); this one does not, so leave thresholds empty to solve online")
        if self._given and len(self._given) != len(self._types):
            raise KvschedError(f"thresholds= gives {len(self._given)} values for {len(self._types)} types "
                               f"{self._types} (sorted by output, prompt)")
        self._n = self._given or [1] * len(self._types)
        self._source = "given" if self._given else "pending"
        if self._rates is not None:
            _declared_solve(lambda: self._solve(v, self._rates, self._given or None))   # given: eq. (9) checked
            if not self._given:
                self._source = f"{self.rule} (declared rates)"

    def _new_type(self, key: tuple[int, int]) -> int:
        self._index[key] = len(self._types)
        self._types.append(key)
        self._counts.append(0)
        self._n.append(1)
        return self._index[key]

    def _group(self, v: ServerView, i: int) -> int:
        o = v.output_len(i)
        if o is None:
            raise KvschedError(f"WAIT needs known output lengths and request {i}'s is unknown "
                               "(use --output-known, a workload that declares them, or nested-wait)")
        key = (v.prompt_len(i), o)
        if key in self._index:
            return self._index[key]
        if self._rates is not None:
            raise KvschedError(f"request {i} ({key[0]} prompt, {key[1]} output tokens) matches no declared type")
        if self.type_bins:
            key = (_bin(key[0], self.type_bins), _bin(key[1], self.type_bins))
            if key in self._index:
                return self._index[key]
        return self._new_type(key)

    def _arrived(self, v: ServerView, i: int, g: int) -> None:
        self._counts[g] += 1
        self._resolve_online(v, lambda rate: [rate * max(c, 0.5) / sum(self._counts) for c in self._counts],
                             f"{self.rule} (online rates)")

    def _solve(self, v: ServerView, rates: list[float], given: list[int] | None = None) -> None:
        types = [FluidType(r, p, o - 1) for (p, o), r in zip(self._types, rates)]
        d0, d1 = _solve_coefficients(v, types)
        if given is not None:
            n = given
        elif self.rule == "practical":
            n = [max(1, math.floor(x + 0.5)) for x in theory.practical_wait(types, self.batch_size)]
        else:
            n = theory.solve_wait(types, d0, d1, self.strict)
        self._n = n
        self._record(v, rates, d0, d1, theory.check_wait(types, n, d0, d1, self.strict))

    def _plan(self, v: ServerView, drain: bool) -> Plan:
        admit: list[int] = []
        decode: list[int] = []
        for j, n in enumerate(self._n):
            full = self._count(j, 0) >= n
            if not (full or drain and (self._count(j, 0) or self._running_of.get(j)) or self._overdue(v, j)):
                continue
            admit += self._take(j, 0, n)
            if self.pause_excluded:
                for k in list(self._stages.get(j, ())):
                    decode += self._take(j, k, n)
        return self._launch(v, admit, decode, all_decoders=not self.pause_excluded)

    def report(self) -> dict[str, object]:
        order = sorted(range(len(self._types)), key=lambda j: (self._types[j][1], self._types[j][0]))
        per_type = ("rates", "slack")           # lists in type-index order: sorted like the types
        out = self._report(thresholds=[self._n[j] for j in order], types=[list(self._types[j]) for j in order])
        return {k: [x[j] for j in order] if k in per_type else x for k, x in out.items()}


def _bin(x: int, per_doubling: int) -> int:
    """x rounded up to the geometric grid ceil(2^(m / K)) (K bins per doubling)."""
    return max(x, math.ceil(2 ** (math.ceil(per_doubling * math.log2(x)) / per_doubling)))


@dataclass
class NestedWait(_Threshold):
    """Nested WAIT (Algorithm 2, unknown output lengths; it never reads them). Decode stages
    are grouped into segments ending at stages e_1 < ... < e_L (segment 1: stages 0..e_1,
    segment i: e_(i-1)+1..e_i; stages past e_L belong to segment L). Only entry stages are
    tested: segment i runs only if segments 1..i-1 do and its entry stage holds n_i
    requests; every batch prefills exactly n_1 new prompts and takes up to n_i requests from
    each stage of each running segment; later segments pause with their KV kept.

    Segments: `segments` (stage ends), `groups=L` (the declared types merged into L groups,
    section 7.2) or `bin_width=W` (ends W, 2W, .., section 6.2; `bins` of them, default
    enough for the longest declared output); default: one segment per declared output
    length. Thresholds: `thresholds`, else `theory.wait.solve_nested` (eq. 10) from the
    cost model's d0/d1 and the segments' rates: declared, or estimated online from finished
    requests (the total rate from arrivals, each segment's share from finished requests,
    since a finish reveals a length only after the fact) and re-solved every
    `resolve_every` finishes (all 1 until then).

    Deviation: Algorithm 2 line 1 indexes segment i's stages by cumulative sums of the
    l'_j, which contradicts the text (segment i spans stages l'_(i-1)+1..l'_i); this
    follows the text."""
    thresholds: str = field(default="", metadata={"range": "n,n,.. (whole, >= 1)", "help": "n_1,...,n_L, one per segment; empty: solve"})
    segments: str = field(default="", metadata={"range": "e,e,.. (increasing, >= 0)", "help": "stages where segments end, e.g. 19,39,79,159"})
    groups: int = field(default=0, metadata={"range": "[0, inf)", "help": "L: merge the declared types into L segments (section 7.2)"})
    bin_width: int = field(default=0, metadata={"range": "[0, inf)", "help": "W: segments of W decode stages (section 6.2)"})
    bins: int = field(default=0, metadata={"range": "[0, inf)", "help": "number of W-stage segments (0: up to the longest declared output)"})
    resolve_every: int = field(default=500, metadata={"range": "[1, inf)", "help": "online rates: finishes between re-solves"})
    max_wait: float = field(default=0.0, metadata={"range": "[0, inf)", "help": "seconds before a partial first segment is flushed (0: off)"})
    name = "nested-wait"

    def __post_init__(self) -> None:
        self._setup()
        self._ends = parse_counts(self.segments, "segments")
        if self._ends and any(b <= a for a, b in zip(self._ends, self._ends[1:])):
            raise ValueError(f"segments must be increasing stage ends, got {self.segments!r}")
        if sum(bool(x) for x in (self._ends, self.groups, self.bin_width)) > 1:
            raise ValueError("give one of segments, groups or bin_width")
        if self.bins and not self.bin_width:
            raise ValueError("bins needs bin_width")
        self._finished: list[int] = []
        self._reached: list[int] = []
        self._entry: dict[int, int] = {}
        self._prompts = [0, 0]          # arrivals seen, prompt tokens summed

    def _start(self, v: ServerView) -> None:
        self._check_role(v)
        declared = v.declared_types
        ends, rates = self._design(declared)
        self._ends = ends
        if self._given and len(self._given) != len(ends):
            raise KvschedError(f"thresholds= gives {len(self._given)} values for {len(ends)} segments ending at {ends}")
        self._n = self._given or [1] * len(ends)
        self._finished = [0] * len(ends)
        self._reached = [0] * (len(ends) + 1)
        self._entry = {e + 1: s + 1 for s, e in enumerate(ends[:-1])}     # entry stage -> segment
        self._source = "given" if self._given else "pending"
        if declared is not None:
            self._rates = rates
            total = sum(r for _, _, r in declared)
            self._prompt = sum(p * r for p, _, r in declared) / total
            _declared_solve(lambda: self._solve(v, rates, self._given or None))     # given: eq. (10) checked
            if not self._given:
                self._source = "solved (declared rates)"

    def _design(self, declared) -> tuple[list[int], list[float]]:
        """Segment ends (stages) and, with declared types, each segment's rate."""
        outs: dict[int, float] = {}
        for _, o, r in declared or ():
            outs[o - 1] = outs.get(o - 1, 0.0) + r
        if self._ends:
            ends = self._ends
        elif self.bin_width:
            if not self.bins and not outs:
                raise KvschedError("bin_width without bins needs a workload that declares its types")
            count = self.bins or max(1, math.ceil(max(outs) / self.bin_width))
            ends = [self.bin_width * (i + 1) for i in range(count)]
        elif outs:
            ends = sorted(outs)
            if self.groups:
                ends, _ = theory.merge_types(ends, [outs[e] for e in ends], self.groups)
                ends = [int(e) for e in ends]
        else:
            raise KvschedError("nested-wait needs segments (segments=, bin_width= with bins=) or a workload "
                               "that declares its types (groups= or the default, one segment per output length)")
        if outs and max(outs) > ends[-1]:       # longer types stay in the last segment: end it there
            ends = ends[:-1] + [max(outs)]
        rates = [0.0] * len(ends)
        for e, r in outs.items():
            rates[min(bisect.bisect_left(ends, e), len(ends) - 1)] += r
        return ends, rates

    def _segment(self, stage: int) -> int:
        return min(bisect.bisect_left(self._ends, stage), len(self._ends) - 1)

    def _group(self, v: ServerView, i: int) -> int:
        return 0

    def _arrived(self, v: ServerView, i: int, g: int) -> None:
        self._prompts[0] += 1
        self._prompts[1] += v.prompt_len(i)

    def _entered(self, stage: int) -> None:
        s = self._entry.get(stage)
        if s is not None and self._reached:
            self._reached[s] += 1

    def on_finish(self, i: int, view: ServerView) -> None:
        _, k = self._where[i]
        super().on_finish(i, view)
        if not self._reached:
            return
        self._finished[self._segment(max(k, 0))] += 1     # its last stage (-1: finished at its prefill)
        self._resolve_online(view, self._estimate, "solved (online rates)")

    def _estimate(self, total: float) -> list[float]:
        """The mean prompt seen so far (for eq. 10), and segment rates lambda'_i from the
        arrival rate Lambda_1 and continuation
        probabilities p_i = (entered segment i+1) / (entered i+1 + finished in i), counted
        over requests whose fate in segment i is known; short requests finish first, so
        shares of finishes alone would be biased towards early segments."""
        self._prompt = self._prompts[1] / self._prompts[0]
        lam, out = total, []
        for i in range(len(self._ends)):
            nxt = self._reached[i + 1] if i + 1 < len(self._ends) else 0
            known = nxt + self._finished[i]
            p = nxt / known if known else 0.5
            if i + 1 < len(self._ends):
                p = min(max(p, 0.5 / max(known, 1)), 1 - 0.5 / max(known, 1))    # keep 0 < p < 1
            else:
                p = 0.0
            out.append(lam * (1 - p))
            lam *= p
        return out

    def _solve(self, v: ServerView, rates: list[float], given: list[int] | None = None) -> None:
        if any(r <= 0 for r in rates):
            empty = [i + 1 for i, r in enumerate(rates) if r <= 0]
            raise KvschedError(f"segment(s) {empty} of {self._ends} hold no declared type: choose other "
                               "segments or give thresholds")
        types = [FluidType(r, self._prompt, e) for e, r in zip(self._ends, rates)]
        d0, d1 = _solve_coefficients(v, types)
        self._n = given or theory.solve_nested(self._prompt, self._ends, rates, d0, d1)
        self._record(v, rates, d0, d1, theory.check_nested(self._prompt, self._ends, rates, self._n, d0, d1))

    def _plan(self, v: ServerView, drain: bool) -> Plan:
        n = self._n
        last = len(n) if drain else 0           # segments 1..last run
        if not drain:
            while last < len(n):
                entry = 0 if last == 0 else self._ends[last - 1] + 1
                if self._count(0, entry) < n[last] and not (last == 0 and self._overdue(v, 0)):
                    break
                last += 1
        if last == 0:
            return Plan()
        admit = self._take(0, 0, n[0])
        decode: list[int] = []
        for k in list(self._stages.get(0, ())):
            s = self._segment(k)
            if s < last:
                decode += self._take(0, k, n[s])
        return self._launch(v, admit, decode)

    def report(self) -> dict[str, object]:
        return self._report(thresholds=list(self._n), segment_ends=list(self._ends))
