"""The read-only view of a replica that policies and routers receive (policies/base.py,
`ServerView`, documents every field).

Read-only in fact: assigning any attribute raises a `PlanError` naming the policy, and
every collection it hands out is a read-only face of the replica's own. Per-request reads
are the replica's bound methods and the scalars are properties, so a read costs one
attribute lookup more than reading the replica itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from kvsched.errors import PlanError

_METHODS = ("blocks_for", "arrival", "prompt_len", "output_len", "prefill_target", "prefill_done",
            "generated", "kv_tokens", "kv_blocks", "is_decoding", "needs_block", "tier_priority",
            "tbt_slo", "last_token_time", "cached_tokens", "prefix_planner")
# view attribute -> the replica attribute path it reads (C-level attrgetter, no Python frame)
_SCALARS = {"now": "now", "num_decoding": "_decoders.n", "kv_used_blocks": "kv.used",
            "mean_batch_time": "mean_batch_time", "iterations": "iterations",
            "arrivals_pending": "_arrivals.pending", "next_arrival": "_arrivals.next_time",
            "outstanding": "outstanding", "prefill_backlog": "prefill_backlog", "num_waiting": "num_waiting",
            "issued": "reqs.issued", "in_flight": "reqs.in_flight", "prefix_hit_rate": "prefix_hit_rate"}
_FIXED = ("index", "role", "block_size", "kv_capacity_blocks", "cost_model", "waiting", "running",
          "prefilling", "decoding", "recent_batch_times", "recent_finished", "_output", "_admitted", "declared_types",
          "prefix_caching")


class ReadOnlySeq(Sequence):
    """Read-only face of a deque or list."""
    __slots__ = ("_q",)

    def __init__(self, q) -> None:
        self._q = q

    def __len__(self) -> int:
        return len(self._q)

    def __getitem__(self, k):
        return self._q[k]

    def __iter__(self):
        return iter(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)


class ReplicaView:
    __slots__ = ("_r", "_kv", "_ds", "_policy_name") + _METHODS + _FIXED

    def __init__(self, replica, fixed: dict) -> None:
        put = object.__setattr__
        put(self, "_r", replica)
        put(self, "_kv", replica.kv)
        put(self, "_ds", replica._decoders)
        put(self, "_policy_name", getattr(replica.policy, "name", type(replica.policy).__name__))
        for name in _METHODS:
            put(self, name, getattr(replica, name))
        for name in _FIXED:
            put(self, name, fixed[name])

    def __setattr__(self, name: str, value) -> None:
        raise PlanError(f"policy {self._policy_name} assigned view.{name}: the view is read-only "
                        "(keep policy state in the policy object)")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    # the hottest reads, one Python call each
    @property
    def kv_free_blocks(self) -> int:
        kv = self._kv
        return kv.capacity_blocks - kv.used

    @property
    def decode_new_blocks(self) -> int:
        """Blocks one decode step of every decoder needs."""
        return self._ds.new_blocks

    def __repr__(self) -> str:
        return f"<view of replica {self.index} at t={self.now:.6g}>"


for _name, _path in _SCALARS.items():
    setattr(ReplicaView, _name, property(attrgetter(f"_r.{_path}")))
