"""DistServe on disaggregated pools (rad-slai.txt Appendix E.3, Algorithm 5).

Run it with `--prefill-replicas P --decode-replicas D` (the pool sizes; the paper gives no
sizing) and the KV link flags (`--kv-transfer-bandwidth`, `--kv-transfer-latency`; the paper
gives no transfer cost). The cluster hands each request to a decode replica at its first
token and counts the KV transfer (sim/cluster.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.errors import KvschedError
from kvsched.policies.base import Plan, ServerView
from kvsched.policies.baselines import _Base, admit_whole_prompts, make_room


@dataclass
class DistServe(_Base):
    """Prefill replicas: one request at a time, FCFS, its whole prompt in one iteration
    (Algorithm 5 line 8), or in chunks of `chunk` tokens ("chunked prefill-iteration may be
    done too"); a request starts when KV for its whole prompt is free.
    Decode replicas: every decoder decodes each batch (Algorithm 5's decode node). A request
    preempted there (recompute: DistServe would swap it to host memory) is prefilled again
    on the decode replica, whole prompt, beside the decodes, when its KV fits."""
    chunk: int = field(default=0, metadata={"range": "[0, inf)", "help": "prefill chunk, tokens; 0 = whole prompt (Algorithm 5)"})
    name = "distserve"

    def schedule(self, v: ServerView) -> Plan:
        if v.role == "prefill":
            return self._prefill(v)
        if v.role == "decode":
            return self._decode(v)
        raise KvschedError("distserve runs on disaggregated pools: give --prefill-replicas P and "
                           "--decode-replicas D")

    def _prefill(self, v: ServerView) -> Plan:
        for i in v.prefilling:
            left = v.prefill_target(i) - v.prefill_done(i)
            return Plan([], [(i, min(self.chunk, left) if self.chunk else left)])
        if not v.waiting:
            return Plan()
        i = v.waiting[0]
        target = v.prefill_target(i)
        if v.blocks_for(target) > v.kv_free_blocks:
            return Plan()                   # wait for the decode pool to pull KV
        return Plan([i], [(i, min(self.chunk, target) if self.chunk else target)])

    def _decode(self, v: ServerView) -> Plan:
        victims, free, nd = make_room(v)
        admit, chunks = ([], []) if victims else admit_whole_prompts(v, free, 1 << 62, 1 << 62)
        return Plan(admit, chunks, nd > 0, victims)
