"""RAD, the throughput-optimal Resource Aware Dynamic scheduler (rad-slai.txt section 4.2,
Algorithm 1), and the prefill-first variant of Appendix D (Algorithm 2).

Both run cycles of up to `n` requests (0 = unlimited). Prefills run one request at a time,
FCFS, in chunks of `t_lcm` = LCM(t_row, t_col, t_red) tokens (the last chunk smaller);
decode batches hold at most `t_col` decodes, the GEMM column tile.

Algorithm 1 line 13 reads c = min(t_lcm, L^P(R) - i) with a 1-based start index i, which
would leave the last prompt token out; the chunk here is min(t_lcm, L^P - i + 1), the tokens
left (issue 12).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.errors import KvschedError
from kvsched.policies.base import Plan, ServerView
from kvsched.policies.baselines import _Base, make_room


@dataclass
class Rad(_Base):
    """Algorithm 1 (default) or Algorithm 2 (`variant=prefill-first`).

    Algorithm 1, before each batch: a request part-way through its prefill continues
    (lines 12-16 run a prefill to completion); else if |D| = t_col, or nothing waits, or
    `n` requests started this cycle, every decode-phase request decodes (lines 6-9; the
    cycle ends when D empties); else the next waiting request (FCFS) starts its prefill.

    Algorithm 2: prefill up to `n` waiting requests (FCFS, one at a time), then decode with
    at most t_col active requests, refilling the active set from the cycle's other
    decode-phase requests as requests finish, until all have finished; then the next cycle.

    Memory (Assumption 4): a request starts only when KV for its whole prompt, beyond one
    decode step of every decoder, is free; otherwise the decoders run (and preempt the
    newest, by recompute, if even they do not fit, as vLLM does)."""
    t_col: int = field(default=128, metadata={"range": "[1, inf)", "help": "decode batch size t_col* (the GEMM column tile)"})
    t_lcm: int = field(default=128, metadata={"range": "[1, inf)", "help": "prefill chunk LCM(t_row*, t_col*, t_red*), tokens"})
    n: int = field(default=0, metadata={"range": "[0, inf)", "help": "max requests started per cycle, 0 = unlimited"})
    variant: str = field(default="rad", metadata={"range": "rad|prefill-first", "help": "rad (Algorithm 1) or prefill-first (Algorithm 2)"})
    name = "rad"
    replica_local = True                    # reads only its own replica, shares nothing (base.py)

    def __post_init__(self) -> None:
        if self.variant not in ("rad", "prefill-first"):
            raise ValueError(f"variant must be rad or prefill-first, got {self.variant!r}")
        self._in_cycle = 0              # requests_in_cycle
        self._decoded = False           # the last batch was a decode batch (line 9's test)
        self._decoding_cycle = False    # Algorithm 2: in decode mode
        self._active: dict[int, None] = {}   # Algorithm 2: D_active, in activation order

    def schedule(self, v: ServerView) -> Plan:
        if v.role != "mixed":
            raise KvschedError(f"rad runs whole requests on one node (its cycles mix prefill and decode); it "
                               f"cannot run on a {v.role} replica of disaggregated pools")
        for i in v.prefilling:          # a started prefill runs to completion (lines 12-16)
            return Plan([], [(i, min(self.t_lcm, v.prefill_target(i) - v.prefill_done(i)))])
        if self.variant == "rad":
            return self._rad(v)
        return self._prefill_first(v)

    def _rad(self, v: ServerView) -> Plan:
        nd = v.num_decoding
        if nd == 0 and (self._decoded or self._in_cycle == self.n > 0):
            self._in_cycle = 0          # line 9: a decode batch emptied D (or an empty one would)
        self._decoded = False
        if nd and (nd >= self.t_col or not v.waiting or self._in_cycle == self.n > 0):
            self._decoded = True
            return self._decode(v, True)
        start = self._start(v)
        if start is not None:
            return start
        self._decoded = nd > 0
        return self._decode(v, True) if nd else Plan()

    def _prefill_first(self, v: ServerView) -> Plan:
        if not self._decoding_cycle:
            if v.waiting and not (self.n and self._in_cycle >= self.n):
                start = self._start(v)
                if start is not None:
                    return start
            if not v.num_decoding:
                return Plan()           # nothing to decode and nothing fits: wait
            self._decoding_cycle = True     # lines 14-15: change to decode mode
            self._in_cycle = 0
        active = self._active
        for i in [i for i in active if not v.is_decoding(i)]:
            del active[i]               # finished (line 18)
        for i in v.decoding:            # refill from D (lines 15, 19)
            if len(active) >= self.t_col:
                break
            active.setdefault(i, None)
        if not active:                  # the cycle's requests have all finished
            self._decoding_cycle = False
            return self._prefill_first(v)
        return self._decode(v, list(active) if len(active) < v.num_decoding else True)

    def _start(self, v: ServerView) -> Plan | None:
        """Admit the queue front and run its first chunk, if KV for its whole prompt is free."""
        i = v.waiting[0]
        target = v.prefill_target(i)
        if v.blocks_for(target) > v.kv_free_blocks - v.decode_new_blocks:
            return None
        self._in_cycle += 1
        return Plan([i], [(i, min(self.t_lcm, target))])

    def _decode(self, v: ServerView, which) -> Plan:
        """Decode every decoder (`which` True) or the listed ones, preempting the newest
        running requests by recompute while their new KV blocks do not fit."""
        if which is True:
            victims, _, nd = make_room(v)
            return Plan([], [], nd > 0, victims)
        chosen = dict.fromkeys(which)
        need, free = sum(v.needs_block(i) for i in chosen), v.kv_free_blocks
        victims: list[int] = []
        for i in reversed(list(v.running)):
            if need <= free:
                break
            victims.append(i)
            free += v.kv_blocks(i)
            if i in chosen:
                del chosen[i]
                need -= v.needs_block(i)
        return Plan([], [], list(chosen) or False, victims)

    def on_preempt(self, i: int, view: ServerView) -> None:
        self._active.pop(i, None)
