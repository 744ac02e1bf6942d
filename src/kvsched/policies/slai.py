"""SLAI, the SLO-aware scheduler of rad-slai.txt section 6, as the authors' public
implementation (a Sarathi-Serve fork) runs it; docs/rad-slai.md tables where the code and
the paper differ.

Last schedulable time (eq. 8): C = e + TBT - delta * t_bar, where e is the end of the batch
that gave the request its last token, TBT its tier's SLO (`default_tbt` without one), t_bar
the mean of every batch time since the start (warm-up included) and delta the offset. delta
is fixed (`offset`; giving it turns the dynamic rule off) or, by default, dynamic:
`offset_low` (5) while used KV / total is below `memory_limit` (0.96), else `offset_high`
(10) (section 7.1). As in the authors' code, delta and t_bar are frozen into C when it is
computed, after the batch that produced the token; `freeze=false` recomputes C every batch
with the current delta and t_bar (eq. 8 read literally).

Each batch, under `token_budget` tokens (section 6, "Batch construction"):
1. critical decodes (C <= now), earliest C first, up to `max_decodes` (beta);
2. ongoing partial prefills, in admission order;
3. new prefills: the waiting requests re-sorted every batch by prompt length (`order=spf`,
   stable: ties keep queue order) or in queue order (`fcfs`); with `user_priority` the
   higher-priority tier's requests first, SPF within a tier (requests without a tier have
   priority 0). Admission stops at the first request without KV for its whole prompt beyond
   a `watermark` share of blocks kept free (while requests run: a lone request that fits is
   never starved, as `vllm-v0`), or without a seat (`max_num_seqs`, alpha, requests holding KV);
4. non-critical decodes in C order while budget, beta and free KV allow.
A critical decode that needs a KV block that is not free preempts the newest partial
prefill (recompute; its reserved prompt blocks are freed), then, with none left, the decode
itself. No request is admitted in a batch that preempted (vLLM's rule, as `sarathi`).
Non-critical decodes take a block only if one is free. When that leaves nothing to run while
requests decode (KV full, none critical yet), the batch is built as at the earliest C: the
authors' engine would spin until then, and a simulated replica has no event to wait for
(its clock only moves with batches and arrivals).

With speculative decoding (--spec, not in the paper) a decode takes 1 + its drafts from the
token budget, which bounds the batch's time: a verify step computes all of them. Drafts the
budget left cannot hold are cut (Plan.spec), as vLLM cuts them.

There is no starvation guard, as in the authors' code (a TTFT-slack ordering existed before
release and was removed). `aging` > 0 (off by default, not in the paper) serves requests
that have waited longer than `aging` seconds first, in queue order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

from kvsched.policies.base import Plan, ServerView
from kvsched.policies.baselines import (_Base, _check_limits, admit_reserving, prefill_order, reserved_blocks,
                                        verify_tokens, whole_count)


@dataclass
class Slai(_Base):
    token_budget: int = field(default=512, metadata={"range": "[1, inf)", "help": "tokens per batch (tau_budget)"})
    max_num_seqs: int = field(default=128, metadata={"range": "[1, inf)", "help": "alpha: max requests holding KV"})
    max_decodes: int = field(default=128, metadata={"range": "[1, inf)", "help": "beta: max decodes per batch"})
    order: str = field(default="spf", metadata={"range": "spf|fcfs", "help": "new-prefill order: shortest prompt first or FCFS"})
    dynamic: bool | None = field(default=None, metadata={"help": "delta by KV use (offset_low / offset_high); default: yes unless `offset` is given"})
    offset: float | None = field(default=None, metadata={"range": "[0, inf)", "help": "fixed delta (x mean batch time); 10 when dynamic=false"})
    offset_low: float | None = field(default=None, metadata={"range": "[0, inf)", "help": "dynamic delta below memory_limit (5)"})
    offset_high: float | None = field(default=None, metadata={"range": "[0, inf)", "help": "dynamic delta at or above memory_limit (10)"})
    memory_limit: float | None = field(default=None, metadata={"range": "[0, 1]", "help": "used KV share where the dynamic delta switches (0.96)"})
    freeze: bool = field(default=True, metadata={"help": "freeze delta and t_bar into C when computed (authors' code); false: recompute every batch"})
    user_priority: bool = field(default=False, metadata={"help": "higher-priority tiers' prefills first (SPF within a tier)"})
    default_tbt: float = field(default=0.2, metadata={"range": "(0, inf)", "help": "TBT SLO, s, of requests without a tier SLO"})
    watermark: float = field(default=0.01, metadata={"range": "[0, 1)", "help": "share of KV blocks kept free at admission"})
    aging: float = field(default=0.0, metadata={"range": "[0, inf)", "help": "serve requests waiting longer than this (s) first; 0 = off"})
    name = "slai"
    replica_local = True                    # reads only its own replica, shares nothing (base.py)

    def __post_init__(self) -> None:
        _check_limits(self.name, self.token_budget, self.max_num_seqs)
        whole_count(self.name, "max_decodes", self.max_decodes)
        tbt = self.default_tbt
        if isinstance(tbt, bool) or not isinstance(tbt, (int, float)) or not 0 < tbt < math.inf:
            raise ValueError(f"{self.name}: default_tbt must be a positive finite number of seconds, got {tbt!r}")
        if self.order not in ("spf", "fcfs"):
            raise ValueError(f"order must be spf or fcfs, got {self.order!r}")
        dynamic_set = [k for k in ("offset_low", "offset_high", "memory_limit") if getattr(self, k) is not None]
        if self.dynamic is None:
            self.dynamic = self.offset is None
        if self.dynamic and self.offset is not None:
            raise ValueError("offset is the fixed delta: it has no effect with dynamic=true (set dynamic=false, "
                             "or offset_low / offset_high)")
        if not self.dynamic and dynamic_set:
            raise ValueError(f"{dynamic_set[0]} belongs to the dynamic delta: it has no effect with dynamic=false")
        self.offset = 10.0 if self.offset is None else self.offset
        self.offset_low = 5.0 if self.offset_low is None else self.offset_low
        self.offset_high = 10.0 if self.offset_high is None else self.offset_high
        self.memory_limit = 0.96 if self.memory_limit is None else self.memory_limit
        if self.offset_low > self.offset_high:
            raise ValueError(f"offset_low ({self.offset_low}) exceeds offset_high ({self.offset_high}): the "
                             "dynamic delta grows with KV use")
        self._lst: dict[int, tuple[float, float]] = {}      # request -> (its last token time, C)

    def offset_now(self, v: ServerView, reserved: int) -> float:
        """delta: fixed, or by the share of KV blocks in use, reserved prompt blocks included
        (the authors' block manager allocates a whole prompt at admission)."""
        if not self.dynamic:
            return self.offset
        used = (v.kv_used_blocks + reserved) / v.kv_capacity_blocks
        return self.offset_low if used < self.memory_limit else self.offset_high

    @cython.locals(t_bar=cython.double, delta=cython.double, e=cython.double, slo=cython.double,
                   default=cython.double, freeze=cython.bint)
    def _deadlines(self, v: ServerView, delta: float) -> dict[int, float]:
        """C for every decode-phase request (eq. 8), computed once per produced token."""
        t_bar = v.mean_batch_time or 0.0
        lst = self._lst
        default, freeze = self.default_tbt, self.freeze
        out = {}
        for i in v.decoding:
            e = v.last_token_time(i)
            known = lst.get(i)
            if known is None or known[0] != e or not freeze:
                slo = v.tbt_slo(i)
                known = (e, e + (default if math.isinf(slo) else slo) - delta * t_bar)
                lst[i] = known
            out[i] = known[1]
        return out

    def schedule(self, v: ServerView) -> Plan:
        partial = list(v.prefilling)
        reserve = reserved_blocks(v, partial)
        deadline = self._deadlines(v, self.offset_now(v, reserve))
        by_deadline = sorted(deadline, key=deadline.__getitem__)
        plan = self._batch(v, v.now, list(partial), reserve, deadline, by_deadline)
        if not (plan.decode or plan.chunks or plan.preempt) and by_deadline:
            # as at the earliest C (the same C: nothing above changed the view)
            plan = self._batch(v, deadline[by_deadline[0]], partial, reserve, deadline, by_deadline)
        return plan

    # compiled (kvsched/compiled.py): the counts as C integers (blocks and tokens, bounded by the
    # KV capacity, kvcache.py's TOKEN_LIMIT)
    @cython.locals(reserve=cython.longlong, free=cython.longlong, budget=cython.longlong, need=cython.longlong,
                   k=cython.Py_ssize_t, c=cython.longlong)
    def _batch(self, v: ServerView, now: float, partial: list[int], reserve: int, deadline: dict[int, float],
               by_deadline: list[int]) -> Plan:
        """Steps 1-4 with decodes critical when C <= now: `partial` the running prefills (this
        pops the victims from it), `reserve` their reserved blocks, `deadline` C per decoder,
        `by_deadline` the decoders by C."""
        blocks, target = v.blocks_for, v.prefill_target
        beta = self.max_decodes
        free = v.kv_free_blocks - reserve
        budget = self.token_budget
        decode: list[int] = []
        victims: list[int] = []
        cut: dict[int, int] = {}                            # decoders whose drafts the budget cuts (--spec)
        spec = v.spec_method is not None
        while free < 0 and partial:     # reservations overrun (KV pulled in on a decode replica)
            j = partial.pop()
            victims.append(j)
            free += blocks(target(j))
        k = 0
        for k, i in enumerate(by_deadline):                 # 1. critical decodes
            if deadline[i] > now or len(decode) >= beta or budget <= 0:
                break
            need = v.needs_block(i)
            while need > free and partial:                  # the newest partial prefill goes first
                j = partial.pop()
                victims.append(j)
                free += blocks(target(j))
            if need > free:
                victims.append(i)                           # then the decode itself
                free += v.kv_blocks(i)
                continue
            free -= need
            decode.append(i)
            budget -= verify_tokens(v, i, budget, cut) if spec else 1
        else:
            k = len(by_deadline)
        chunks: list[tuple[int, int]] = []
        for i in partial:                                   # 2. ongoing partial prefills
            if budget <= 0:
                break
            c = min(budget, target(i) - v.prefill_done(i))
            chunks.append((i, c))
            budget -= c
        admit: list[int] = []
        if not victims:                                     # 3. new prefills
            admit, new, free, budget = admit_reserving(
                v, prefill_order(v, self.order, self.user_priority, self.aging), free, budget,
                self.max_num_seqs - len(v.running), self.watermark)
            chunks += new
        for i in by_deadline[k:]:                           # 4. non-critical decodes
            if budget <= 0 or len(decode) >= beta:
                break
            if deadline[i] <= now or i in victims:
                continue
            need = v.needs_block(i)
            if need > free:
                break
            free -= need
            decode.append(i)
            budget -= verify_tokens(v, i, budget, cut) if spec else 1
        which = True if len(decode) == v.num_decoding and decode else (decode or False)
        return Plan(admit, chunks, which, victims, spec=cut or None)

    def on_finish(self, i: int, view: ServerView) -> None:
        self._lst.pop(i, None)

    def on_preempt(self, i: int, view: ServerView) -> None:
        self._lst.pop(i, None)
