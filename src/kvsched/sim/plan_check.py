"""The one check of a policy's plan (policies/base.py, `Plan`), used by the simulator
(sim/replica.py) and by the vLLM adapter (engines/vllm_scheduler.py) alike: a bad plan fails
the same way, with the same one-line message naming the policy, in simulation and inside vLLM.

`check(plan, state, name, hooks)` reads the plan once (a generator is not consumed twice),
checks it against the replica's state as the plan's own steps change it (preemptions first,
then admissions, then chunks, then the decode selection) and returns it normalized, as the
tuple (preempt, admit, chunks, decode): lists of Python ints, `decode` True, False or a set of
ints (copies where user code could edit the policy's own while the plan is applied: `check`).
What it does not check is KV room: the replica allocates check-then-act (with prefix caching
a hit or an eviction decides what fits), and `kv_error` words the refusal for both.
"""
from __future__ import annotations

from typing import Collection, Container, Protocol

import numpy as np

from kvsched.errors import PlanError
from kvsched.policies.base import Plan
from kvsched.sim.requests import WAITING


class PlanState(Protocol):
    """What the check reads of a replica (each engine answers for its own)."""
    count: int                               # requests are 0..count-1
    index: int                               # the replica's number, for messages
    running: Container[int]                  # running here (admitted, not finished or preempted)
    prefilling: Container[int]               # running here, in the prefill phase
    decoders: Collection[int]                # running here, in the decode phase (paused ones too)

    def waiting_here(self, i: int) -> bool: ...
    def prefill_left(self, i: int) -> int: ...       # prefill target - tokens computed
    def restart_target(self, i: int) -> int: ...     # prompt + generated: its target once preempted
    def is_waiting(self, i: int) -> bool: ...        # waiting on any replica (for the message)


_INT = {int}


class PlanFace:
    """What the plan check (sim/plan_check.py, its `PlanState`) reads of a replica: live
    references to its containers and the request table's lists."""
    __slots__ = ("count", "index", "running", "prefilling", "decoders", "_queue", "_status", "_target",
                 "_computed", "_prompt", "_gen")

    def __init__(self, rep) -> None:
        r = rep.reqs
        self.count, self.index = r.n, rep.index
        self.running, self.prefilling, self.decoders = rep._running, rep._prefilling, rep._decoders.where
        self._queue, self._status, self._target, self._computed = rep._queue, r.status, r.target, r.computed
        self._prompt, self._gen = r.prompt, r.gen

    def waiting_here(self, i: int) -> bool:
        q = self._queue                         # the front at once; elsewhere a scan, as the admission's
        return self._status[i] == WAITING and bool(q) and (q[0] == i or i in q)

    def is_waiting(self, i: int) -> bool:
        return self._status[i] == WAITING

    def prefill_left(self, i: int) -> int:
        return self._target[i] - self._computed[i]

    def restart_target(self, i: int) -> int:
        c = self.decoders.get(i)                # a decoder's tokens are its cohort's (the table's lag)
        return self._prompt[i] + (self._gen[i] if c is None else c.progress(i)[1])


def short(x, limit: int = 60) -> str:
    """repr (str for exceptions) on one line, at most `limit` characters."""
    text = " ".join((str(x) if isinstance(x, BaseException) else repr(x)).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def kv_error(name: str, held: int, capacity_blocks: int, block_size: int) -> PlanError:
    return PlanError(f"policy {name} planned a batch needing {held} KV blocks; only {capacity_blocks} exist "
                     f"({capacity_blocks * block_size} tokens)")


def _listed(plan, name: str) -> tuple[list, list, list, object]:
    if type(plan) is not Plan and not isinstance(plan, Plan):
        raise PlanError(f"policy {name} returned {short(plan)} ({type(plan).__name__}), not a Plan")
    preempt, admit, chunks, d = plan.preempt, plan.admit, plan.chunks, plan.decode
    for field in ("preempt", "admit", "chunks"):
        x = getattr(plan, field)
        if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
            raise PlanError(f"policy {name} gave Plan.{field}={short(x)}; it must be a list")
    if isinstance(d, (bool, np.bool_)):
        d = bool(d)
    elif isinstance(d, (str, bytes, int, float)) or d is None or not hasattr(d, "__iter__"):
        raise PlanError(f"policy {name} gave decode={short(d)}; it must be True, False "
                        "or a collection of request ids in their decode phase")
    try:                                        # copies: hooks the plan calls may edit the policy's lists
        preempt, admit, chunks = list(preempt), list(admit), list(chunks)
        if not isinstance(d, (bool, set, frozenset)):
            d = list(d)
    except Exception as exc:                 # e.g. a generator that raises
        raise PlanError(f"policy {name} gave a plan that cannot be read: {type(exc).__name__}: "
                        f"{short(exc, 120)}") from exc
    return preempt, admit, chunks, d


def _exists(i, state: PlanState, name: str, what: str) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < state.count:
        raise PlanError(f"policy {name} {what} request {short(i)}, which does not exist "
                        f"(requests are 0..{state.count - 1})")
    return int(i)


def _chunk(item, state: PlanState, name: str) -> tuple[int, object]:
    try:
        i, c = item
    except (TypeError, ValueError):
        raise PlanError(f"policy {name} gave a chunk {short(item)}; chunks are (request, tokens) pairs") from None
    i = _exists(i, state, name, "gave a chunk to")
    if isinstance(c, bool) or not isinstance(c, (int, np.integer, float, np.floating)):
        raise PlanError(f"policy {name} gave request {i} a chunk of {short(c)} tokens; tokens must be an integer")
    return i, c


# a checked plan: (preempt, admit, chunks, decode), in the order the replica applies them
Checked = tuple[list[int], list[int], list[tuple[int, int]], "bool | set[int] | frozenset[int]"]
_NONE: frozenset = frozenset()


def check(plan, state: PlanState, name: str, hooks: bool = True) -> Checked:
    """The plan, checked against `state` and normalized (see the module docstring). Written for
    speed: every batch of a Python policy passes here (plain loops, no per-id calls). The lists
    and set returned are copies where user code that runs while the plan is applied (the
    policy's hooks, a user's cost model) could edit the policy's own (`hooks`), or where an
    entry had to be converted; otherwise the caller reads them before any user code runs."""
    if type(plan) is Plan:
        preempt, admit, chunks, decode = plan.preempt, plan.admit, plan.chunks, plan.decode
        if type(preempt) is list and type(admit) is list and type(chunks) is list \
                and (decode is True or decode is False):
            if not preempt and not admit and not chunks:
                return preempt, admit, chunks, decode       # no request named: nothing to check
            if hooks:
                preempt, admit, chunks = preempt[:], admit[:], chunks[:]
        else:
            preempt, admit, chunks, decode = _listed(plan, name)
    else:
        preempt, admit, chunks, decode = _listed(plan, name)
    original = (plan.preempt, plan.admit, plan.chunks) if type(plan) is Plan else ()
    n = state.count
    gone = _NONE                                # preempted by this plan: waiting again
    if preempt:
        gone, running = set(), state.running
        for k, i in enumerate(preempt):
            if type(i) is not int or not 0 <= i < n:
                if original and preempt is original[0]:
                    preempt = preempt[:]                # the policy's own list stays as it was
                i = preempt[k] = _exists(i, state, name, "preempted")
            if i in gone or i not in running:
                raise PlanError(f"policy {name} preempted request {i}, which is not running")
            gone.add(i)
    started = _NONE                             # admitted by this plan: prefilling from 0
    if admit:
        started, waiting_here = set(), state.waiting_here
        for k, i in enumerate(admit):
            if type(i) is not int or not 0 <= i < n:
                if original and admit is original[1]:
                    admit = admit[:]
                i = admit[k] = _exists(i, state, name, "admitted")
            if i in started or not (i in gone or waiting_here(i)):
                here = i not in started and state.is_waiting(i)    # waiting, on another replica
                raise PlanError(f"policy {name} admitted request {i}, which is not waiting"
                                + (f" on replica {state.index}" if here else ""))
            started.add(i)
    if chunks:
        prefilling, prefill_left, seen = state.prefilling, state.prefill_left, set()
        for k, item in enumerate(chunks):
            plain = (type(item) is tuple and len(item) == 2 and type(item[0]) is int and type(item[1]) is int
                     and 0 <= item[0] < n)
            i, c = item if plain else _chunk(item, state, name)
            if i in started:
                left = state.restart_target(i) if i in gone else prefill_left(i)
            elif i in prefilling and i not in gone:
                left = prefill_left(i)
            else:
                raise PlanError(f"policy {name} gave request {i} a chunk of {c} tokens; it is not in its prefill "
                                f"phase on replica {state.index}")
            if not 0 < c <= left or not plain and c != int(c):
                raise PlanError(f"policy {name} gave request {i} a chunk of {c} tokens; it is {left} prefill "
                                "tokens left")
            if i in seen:
                raise PlanError(f"policy {name} gave one request two chunks in a batch")
            seen.add(i)
            if not plain:
                if original and chunks is original[2]:
                    chunks = chunks[:]
                chunks[k] = (i, int(c))
    if not (decode is True or decode is False):
        decode = _decoders(decode, state, gone, name)
        if hooks and preempt and type(decode) is set:   # on_preempt runs before the selection is
            decode = frozenset(decode)                  # made: it could edit the policy's own set
    return preempt, admit, chunks, decode


def _decoders(d, state: PlanState, gone: "set[int] | frozenset[int]", name: str) -> "frozenset | set":
    """The decode selection as a set of Python ints, each decoding here. A set is taken as it
    is, not copied (the cost of a large selection every batch); `check` copies it where user
    code runs mid-plan (`hooks`)."""
    chosen = d
    if type(d) is not set and type(d) is not frozenset:
        try:
            chosen = frozenset(d)
        except TypeError:                       # an unhashable id: named below
            chosen = None
    if chosen is None or chosen and set(map(type, chosen)) != _INT:    # (in C: the common case is quick)
        chosen = frozenset(_exists(i, state, name, "selected for decoding") for i in d)
    bad = chosen.difference(state.decoders)
    if gone:
        bad |= gone & chosen
    if bad:
        i = _exists(min(bad, key=repr), state, name, "selected for decoding")  # one that does not exist, or
        raise PlanError(f"policy {name} selected request {i} for decoding; it is not in its "
                        f"decode phase on replica {state.index}")
    return chosen


def swap_choice(chosen, victims, swapping: bool, name: str) -> frozenset:
    """`Plan.swap` checked: a collection of the plan's own victims, in a run that swaps
    (--preemption swap)."""
    try:
        ids = list(chosen)
    except TypeError:
        raise PlanError(f"policy {name}: Plan.swap must be a collection of request ids or None, "
                        f"got {short(chosen)}") from None
    for k, i in enumerate(ids):             # whole numbers (numpy's too), not bools or floats
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise PlanError(f"policy {name}: Plan.swap holds {short(i)}, which is not a request id")
        ids[k] = i.__index__()
    if ids and not swapping:
        raise PlanError(f"policy {name} chose victims to swap (Plan.swap) in a run without --preemption swap")
    ids = frozenset(ids)
    extra = ids.difference(victims)
    if extra:
        raise PlanError(f"policy {name} chose request {short(next(iter(extra)))} to swap (Plan.swap), "
                        "which its plan does not preempt")
    return ids


def spec_cap(cap, cohorts, admitted, chunks, pad_limit: int, name: str):
    """`Plan.spec` checked: (the decoders' limit, the padded admissions). The limit is None
    (every decoder verifies its drafts), a whole number >= 0 (at most that many draft tokens each
    this step) or a mapping of decoders selected in the plan to such numbers (the others verify
    all of theirs). The mapping may also name an admission of the plan with a one-token chunk:
    {request: n} pads it with n <= `pad_limit` placeholder drafts (vLLM's `pad_spec_decode`);
    docs/speculative-decoding.md."""
    if isinstance(cap, bool):
        raise PlanError(f"policy {name}: Plan.spec must be a whole number or a mapping request -> number, "
                        f"got {short(cap)}")
    if hasattr(cap, "__index__"):
        cap = cap.__index__()
        if cap < 0:
            raise PlanError(f"policy {name}: Plan.spec must be >= 0 draft tokens, got {cap}")
        return cap, None
    try:
        items = list(cap.items())
    except (AttributeError, TypeError):
        raise PlanError(f"policy {name}: Plan.spec must be a whole number or a mapping request -> number, "
                        f"got {short(cap)}") from None
    out, pads = {}, {}
    for i, n in items:
        if isinstance(n, bool) or not hasattr(n, "__index__") or n.__index__() < 0:
            raise PlanError(f"policy {name}: Plan.spec gives request {short(i)} {short(n)} draft tokens; "
                            "it must be a whole number >= 0")
        k = i.__index__() if not isinstance(i, bool) and hasattr(i, "__index__") else None
        if k is not None and any(k in c.members for c in cohorts):
            out[k] = n.__index__()
        elif k is not None and k in admitted:
            if dict(chunks).get(k) != 1 or n.__index__() > pad_limit:
                raise PlanError(f"policy {name}: Plan.spec pads admission {k} with {n.__index__()} placeholder "
                                f"drafts; only a one-token chunk is padded, with at most {pad_limit}")
            if n.__index__():
                pads[k] = n.__index__()
        else:
            raise PlanError(f"policy {name}: Plan.spec names request {short(i)}, which neither decodes nor is "
                            "admitted in this batch")
    return out, pads or None
