"""One serving replica fed by its workload: a cluster of one (see `sim.replica` for the
semantics and the step API, `sim.cluster` for the loop)."""
from __future__ import annotations

from kvsched.kvcache import PagedKV
from kvsched.sim.cluster import Cluster
from kvsched.sim.replica import DEFAULT_STALL_BATCHES
from kvsched.workload.request import Workload


class Server(Cluster):
    """Runs `policy` over `workload` with a KV pool and a batch-time model.

    `record_timeline` keeps (time, queue, running, KV used) per batch and `record_batches`
    one row per batch; both are off by default so memory stays flat in the number of
    requests served."""

    def __init__(self, workload: Workload, policy, cost, kv: PagedKV, *, max_model_len: int | None = None,
                 record_timeline: bool = False, record_batches: bool = False, strict: bool = False,
                 stall_batches: int = DEFAULT_STALL_BATCHES, prefix_caching: bool = False,
                 spec_slots: tuple[int, int] = (0, 0)) -> None:
        super().__init__(workload, [policy], cost, kv, max_model_len=max_model_len,
                         record_timeline=record_timeline, record_batches=record_batches, strict=strict,
                         stall_batches=stall_batches, prefix_caching=prefix_caching, spec_slots=spec_slots)
        self.replica = self.replicas[0]
        self.kv = kv
        self.view = self.replica.view
