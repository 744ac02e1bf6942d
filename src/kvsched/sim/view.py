# cython: auto_pickle=False, binding=False
# (compiled: no pickling, which would hand out the C fields; methods that check their `self`,
# which Cython's binding methods of a C type do not: `ReplicaView.now(object())` would read
# whatever memory lies where the replica field would be)
"""The read-only view of a replica that policies and routers receive (policies/base.py,
`ServerView`, documents every field).

Read-only in fact, not by convention:
- assigning any attribute raises a `PlanError` naming the policy, and so does making the
  view again (`view.__init__`);
- no attribute of the view, nor of anything it hands out, leads to an engine object:
  compiled, the view is a C type (view.pxd) whose replica and cost-model copy are C fields,
  read through C functions (`_R`, `_COST`) that this module does not export (no
  `__pyx_capi__` entry: ctypes finds none either); as Python, they sit in
  slots whose descriptors are removed from the class (`_sealed`) and `_R` is the slot's
  getter; the per-request reads are the view's own methods, defined here only (a bound
  method's `__self__` is the view); collections come as faces that hide what they wrap,
  `cost_model` is the policy's own copy and `prefix_planner()` returns a face of the planner.
What is left is what any Python code can do outside the view object: introspect the
interpreter (`gc.get_referents`; frames: `sys._getframe().f_back`, or an exception's
`__traceback__`, reach the replica's own frames), or import this module and call the
getters of the faces' sealed slots (`_Q`, `_D`, `_P`, `_IT`, module globals in either
build; as Python `_R` too). A policy can still change its own
view's fields through their descriptors (`type(v).__dict__["index"].__set__`): nothing of
the engine.

A per-request read is one Python call: compiled, a C method and a field read.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence, Set

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.errors import KvschedError, PlanError
from kvsched.sim.kv_blocks import decode_blocks
from kvsched.sim.requests import DECODE, DONE

_FIXED = ("index", "role", "block_size", "kv_capacity_blocks", "waiting", "running",
          "prefilling", "decoding", "recent_batch_times", "recent_finished", "_output", "_admitted", "declared_types",
          "prefix_caching")


def _sealed(cls, name: str):
    """Remove slot `name`'s descriptor from `cls` (so `obj.name` no longer reaches it) and
    return its (get, set) functions, kept by this module only."""
    slot = cls.__dict__[name]
    delattr(cls, name)
    return slot.__get__, slot.__set__


SNAPSHOT_UP_TO = 1024       # a longer sequence is iterated lazily (`_Lazy`), not copied first


class ReadOnlySeq(Sequence):
    """Read-only face of a deque, list or array (what it wraps is not reachable from it: a
    deque's or list's own iterator hands out its container through `__reduce__`, so an
    iterator runs over a snapshot, or lazily through `_Lazy` when the sequence is long (a
    policy that stops early in a long queue must not pay for copying it); a slice of an array
    is a copy, not a view of it)."""
    __slots__ = ("_q",)

    def __init__(self, q) -> None:
        _SET_Q(self, q)

    def __len__(self) -> int:
        return len(_Q(self))

    def __getitem__(self, k):
        v = _Q(self)[k]
        return v.copy() if isinstance(v, np.ndarray) else v

    def __iter__(self):
        q = _Q(self)
        return iter(tuple(q)) if len(q) <= SNAPSHOT_UP_TO else _Lazy(iter(q))

    def __bool__(self) -> bool:
        return bool(_Q(self))

    def __repr__(self) -> str:
        return f"ReadOnlySeq({list(_Q(self))!r})"


_Q, _SET_Q = _sealed(ReadOnlySeq, "_q")


class _Lazy:
    """An iterator that holds another one out of reach; pickled (`__reduce__`), it hands out a
    tuple of what is left, never the container behind it."""
    __slots__ = ("_it",)

    def __init__(self, it) -> None:
        _SET_IT(self, it)

    def __iter__(self):
        return self

    def __next__(self):
        return next(_IT(self))

    def __reduce__(self):
        rest = tuple(_IT(self))
        _SET_IT(self, iter(rest))
        return iter, (rest,)


_IT, _SET_IT = _sealed(_Lazy, "_it")


class ReadOnlyKeys(Set):
    """Read-only face of a dict's keys (its values, engine objects, are not reachable; an
    iterator runs over a snapshot of the keys). Set algebra (`-`, `&`, `|`, `^`) gives
    frozensets."""
    __slots__ = ("_d",)

    def __init__(self, d: dict) -> None:
        _SET_D(self, d)

    @classmethod
    def _from_iterable(cls, it) -> frozenset:
        return frozenset(it)

    def __contains__(self, k) -> bool:
        return k in _D(self)

    def __len__(self) -> int:
        return len(_D(self))

    def __iter__(self):
        return iter(tuple(_D(self)))

    def __repr__(self) -> str:
        return f"ReadOnlyKeys({list(_D(self))!r})"


_D, _SET_D = _sealed(ReadOnlyKeys, "_d")


class PlannerFace:
    """The planner `prefix_planner()` hands out (sim/prefix_cache.py, `HitPlanner`), without
    a way to the cache or the replica behind it."""
    __slots__ = ("_p",)

    def __init__(self, planner) -> None:
        _SET_P(self, planner)

    def lookup(self, i: int, chunk: int | None = None) -> tuple[int, int]:
        return _P(self).lookup(i, chunk)

    def chunk(self, i: int, tokens: int, slots: int = 0) -> int:
        return _P(self).chunk(i, tokens, slots)

    def preempt(self, i: int) -> int:
        return _P(self).preempt(i)

    def decodes(self, blocks: int) -> None:
        _P(self).decodes(blocks)


_P, _SET_P = _sealed(PlannerFace, "_p")


if cython.compiled:     # a field's own setter, past the view's __setattr__ (object.__setattr__ refuses a C type's)
    from cython.cimports.cpython.object import PyObject_GenericSetAttr as _put
else:
    _put = object.__setattr__


# Compiled, C functions of this module only (not exported: Python, ctypes included, finds no
# entry to them); as Python, the getters and setters of the sealed slots replace them (below
# the class).
@cython.cfunc
@cython.locals(v="ReplicaView")
@cython.returns("Replica")
def _R(v: ReplicaView) -> Replica:
    """The replica behind view v."""
    if v is None or v._r is None:       # a view not made by the engine (ReplicaView.__new__)
        raise AttributeError("this view has no replica")
    return v._r


@cython.cfunc
@cython.locals(v="ReplicaView", r="Replica")
def _SET_R(v: ReplicaView, r: Replica) -> None:
    v._r = r


@cython.cfunc
@cython.locals(v="ReplicaView")
def _COST(v: ReplicaView):
    return v._cost


@cython.cfunc
@cython.locals(v="ReplicaView")
def _SET_COST(v: ReplicaView, cost) -> None:
    v._cost = cost


@cython.locals(r="Replica")
def _wide(v: ReplicaView, what: str) -> Replica:
    """The replica behind view v, whose cluster-wide figure `what` a policy reads: refused
    while a cluster runs its replicas one after another (`sim.routed_ahead.Unseen`: the figures
    there are not those of the replica's time)."""
    r = _R(v)
    refuse = getattr(r._arrivals, "refuse", None)
    if refuse is not None:
        refuse(what)
    return r


class ReplicaView:
    """The view. Compiled, a C type (view.pxd) whose replica and cost-model copy are C fields:
    a per-request read is one C call and a field read, no slot getter's Python call."""
    __slots__ = ("_r", "_cost", "_policy_name") + _FIXED

    def __init__(self, replica, fixed: dict) -> None:
        try:
            _R(self)
        except AttributeError:                  # a new view: no replica yet
            pass
        else:
            raise PlanError(f"policy {self._policy_name} called view.__init__: the view is read-only")
        _SET_R(self, replica)
        _SET_COST(self, None)
        _put(self, "_policy_name", getattr(replica.policy, "name", type(replica.policy).__name__))
        for name in _FIXED:
            _put(self, name, fixed[name])

    def __setattr__(self, name: str, value) -> None:
        raise PlanError(f"policy {self._policy_name} assigned view.{name}: the view is read-only "
                        "(keep policy state in the policy object)")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    # the replica's state now
    @property
    def now(self) -> float:
        return _R(self).now

    @property
    def num_decoding(self) -> int:
        return _R(self)._decoders.n

    @property
    def kv_used_blocks(self) -> int:
        return _R(self).kv.used

    @property
    def iterations(self) -> int:
        return _R(self).iterations

    @property
    def outstanding(self) -> int:
        return _R(self).outstanding

    @property
    def prefill_backlog(self) -> int:
        return _R(self).prefill_backlog

    @property
    @cython.locals(r="Replica")
    def kv_free_blocks(self) -> int:
        r = _R(self)
        return r.kv.capacity_blocks - r.kv.used

    @property
    @cython.locals(r="Replica")
    def decode_new_blocks(self) -> int:
        """Blocks one decode step of every decoder needs (with speculation, its drafts' and
        lookahead slots too)."""
        return decode_blocks(_R(self))

    @property
    def num_waiting(self) -> int:
        return _R(self).num_waiting

    @property
    def mean_batch_time(self) -> float | None:
        return _R(self).mean_batch_time

    @property
    def prefix_hit_rate(self) -> float | None:
        return _R(self).prefix_hit_rate

    @property
    def swapped(self) -> int:
        """Requests swapped out here and not yet running again (sim/host_swap.py)."""
        sw = _R(self)._swap
        return 0 if sw is None else len(sw.out) + sw.pending()

    @property
    def tier_free_blocks(self) -> tuple[tuple[str, int], ...]:
        """(name, free blocks) of each tier below the GPU, fastest first (() without tiers;
        sim/kv_tiers.py)."""
        off = _R(self)._offload
        return () if off is None else off.free_blocks()

    @property
    def spec_method(self) -> str | None:
        """Speculative decoding's method (sim/spec_decode.py), None without it."""
        sp = _R(self)._spec
        return None if sp is None else sp.cfg.method

    @property
    def spec_k(self) -> int:
        """Draft tokens proposed per step now (--spec's k, or --spec-adaptive's); 0 without."""
        sp = _R(self)._spec
        return 0 if sp is None else sp.k_now

    def spec_pad(self, computed: int) -> int:
        """Placeholder drafts vLLM pads a one-token admission after `computed` tokens (its hit)
        with: k; 0 without speculation, with --spec-adaptive, or where 1 + k + 1 more tokens
        would pass max_model_len (vLLM does not pad then). Plan.spec names such an admission."""
        sp = _R(self)._spec
        return 0 if sp is None else sp.pad_limit(computed)

    @property
    @cython.locals(r="Replica")
    def decode_tokens(self) -> int:
        """Tokens one decode step of every decoder schedules: 1 + its drafts each."""
        r = _R(self)
        return r._decoders.n if r._spec is None else r._spec.decode_tokens(r)

    @cython.locals(r="Replica")
    def spec_tokens(self, i: int) -> int:
        """Draft tokens decoder i has for its next step (0: none, or not decoding here)."""
        r = _R(self)
        c = r._where.get(i)
        return 0 if r._spec is None or c is None else r._spec.proposal(i, c.kv_tokens(i))

    @cython.locals(r="Replica", c="Cohort")
    def spec_step_blocks(self, i: int, drafts: int) -> int:
        """New blocks decoder i's next step allocates verifying `drafts` draft tokens (its slots
        for kv + 1 + drafts + lookahead past the blocks it holds; sim/spec_decode.py)."""
        r = _R(self)
        c = r._where.get(i)
        if c is None:
            return 0
        if r._spec is None:                 # no drafts without speculation
            return c.kv_tokens(i) % r.block_size == 0
        return r._spec.step_blocks(i, c.kv_tokens(i), drafts)

    def spec_acceptance(self, i: int) -> float | None:
        """Accepted / drafted tokens at request i's last verify step (None before one)."""
        sp = _R(self)._spec
        return None if sp is None else sp.recent.get(i)

    @property
    def arrivals_pending(self) -> bool:
        return _wide(self, "arrivals_pending")._arrivals.pending

    @property
    def next_arrival(self) -> float | None:
        return _wide(self, "next_arrival")._arrivals.next_time

    @property
    def issued(self) -> int:
        return _wide(self, "issued").reqs.issued

    @property
    def in_flight(self) -> int:
        return _wide(self, "in_flight").reqs.in_flight

    @property
    def cost_model(self):
        """The batch-time model: the policy's own deep copy (made at its first read), so
        nothing a policy does to it changes the engine's timing."""
        cost = _COST(self)
        if cost is not None:
            return cost
        try:
            cost = copy.deepcopy(_R(self).cost)
        except Exception as exc:
            raise KvschedError(f"the cost model {type(_R(self).cost).__name__} cannot be copied for "
                               f"policy {self._policy_name}'s read-only view: {exc}") from None
        _SET_COST(self, cost)
        return cost

    # ----- per request (the replica's tables; requests are workload indices) --------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def arrival(self, i: int) -> float:
        return _R(self)._arrival[i]

    def prompt_len(self, i: int) -> int:
        return _R(self)._prompt[i]

    @cython.locals(r="Replica")
    def output_len(self, i: int) -> int | None:
        r = _R(self)
        return r._output[i] if r._known[i] else None

    def prefill_target(self, i: int) -> int:
        return _R(self)._target[i]

    def prefill_done(self, i: int) -> int:
        return _R(self)._computed[i]

    @cython.locals(r="Replica", c="Cohort")
    def generated(self, i: int) -> int:
        r = _R(self)
        c = r._where.get(i)
        if c is not None:
            return c.progress(i)[1]
        return r.reqs.gen[i] if r._status[i] != DECODE else self._remote(i)

    @cython.locals(r="Replica", c="Cohort")
    def kv_tokens(self, i: int) -> int:
        r = _R(self)
        c = r._where.get(i)
        if c is not None:
            return c.kv_tokens(i)
        return r._computed[i] if r._status[i] != DECODE else self._remote(i)

    def _remote(self, i: int):
        raise PlanError(f"policy {self._policy_name} asked about request {i}, which is decoding on another replica")

    @cython.locals(r="Replica")
    def kv_blocks(self, i: int) -> int:
        """Blocks request i holds here (a speculating decoder's may reach past its KV tokens)."""
        r = _R(self)
        if r._spec is not None and i in r._where:
            return r._spec.blocks_held(i, self.kv_tokens(i))
        return -(-self.kv_tokens(i) // self.block_size)

    def is_decoding(self, i: int) -> bool:
        return i in _R(self)._where

    @cython.locals(r="Replica", c="Cohort")
    def needs_block(self, i: int):
        """Whether decoder i's next step opens a block (with speculation: how many it opens,
        its drafts and lookahead slots included)."""
        r = _R(self)
        c = r._where.get(i)
        if c is not None and r._spec is not None:
            return r._spec.next_blocks(i, c.kv_tokens(i))
        return c is not None and c.kv_tokens(i) % r.block_size == 0

    def tier_priority(self, i: int) -> int:
        return _R(self).reqs.priority[i]

    def tbt_slo(self, i: int) -> float:
        """The request's time-between-tokens SLO in seconds (infinity when its tier has none)."""
        return _R(self).reqs.tbt[i]

    @cython.locals(r="Replica", c="Cohort")
    def last_token_time(self, i: int) -> float | None:
        """When its last output token came out (None before the first)."""
        r = _R(self)
        c = r._where.get(i)
        if c is not None:
            return c.last_token(i)              # its cohort's
        t = r.reqs
        if t.status[i] == DONE:
            return float(t.finished[i])
        return t.last_tok[i] if t.gen[i] else None

    def cached_tokens(self, i: int) -> int:
        """Prompt tokens of waiting request i that would hit the prefix cache now (0 without it)."""
        cache = _R(self).cache
        return cache.cached_tokens(i) if cache is not None else 0

    def prefix_blocks(self, i: int) -> tuple[int, ...]:
        """Waiting request i's cached prefix: its blocks on the GPU, then the blocks each tier
        below would load after them (in tier_free_blocks' order); () without prefix caching."""
        r = _R(self)
        if r.cache is None:
            return ()
        if r._offload is None:
            return (r.cache.cached_tokens(i) // r.block_size,)
        return r._offload.prefix_blocks(r.cache, i)

    def prefix_planner(self) -> PlannerFace | None:
        """What a plan being built finds in the cache (None without prefix caching)."""
        planner = _R(self).prefix_planner()
        return None if planner is None else PlannerFace(planner)

    def __repr__(self) -> str:
        return f"<view of replica {self.index} at t={self.now:.6g}>"


if not cython.compiled:     # as Python, the slots' descriptors go (compiled, the fields are C's)
    _R, _SET_R = _sealed(ReplicaView, "_r")
    _COST, _SET_COST = _sealed(ReplicaView, "_cost")


def view_of(replica, share: float, prefix_caching: bool) -> ReplicaView:
    """The view of `replica` (sim/replica.py) its policy receives; `share` of the arrivals it
    gets scales the workload's declared rates."""
    r, types = replica, replica.reqs.workload.declared_types
    return ReplicaView(r, {
        "index": r.index, "role": r.role, "block_size": r.block_size, "kv_capacity_blocks": r.kv_capacity_blocks,
        "waiting": ReadOnlySeq(r._queue), "running": r._running.keys(),
        "prefilling": r._prefilling.keys(), "decoding": ReadOnlyKeys(r._decoders.where),
        "recent_batch_times": ReadOnlySeq(r.recent_batch_times),
        "recent_finished": ReadOnlySeq(r.recent_finished),
        "_output": r.reqs.output_ro, "_admitted": ReadOnlySeq(r.reqs.admitted),
        "declared_types": None if types is None else tuple((p, o, rate * share) for p, o, rate in types),
        "prefix_caching": prefix_caching})
