"""Per-request state and records of one run, shared by every replica of a cluster.

A request is on one replica at a time (on a prefill replica, then a decode replica when
prefill and decode are disaggregated), so replicas read and write one table instead of
each holding arrays over the whole workload. Records live in preallocated arrays, so
memory does not grow as requests finish.
"""
from __future__ import annotations

import warnings

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.request import Workload

# SWAPPED: sim/host_swap.py; LOADING: its prefix loading from a tier below the GPU (sim/kv_tiers.py)
ARRIVING, WAITING, PREFILL, DECODE, DONE, REJECTED, TRANSFER, SWAPPED, LOADING = range(9)
INF = float("inf")


class RequestTable:
    def __init__(self, workload: Workload, block_size: int, capacity_blocks: int, *,
                 max_model_len: int | None = None, strict: bool = False,
                 spec_slots: tuple[int, int] = (0, 0)) -> None:
        if not workload.timed:
            raise KvschedError(f"{workload.source} has no arrival times: give --rate or --arrivals")
        w = self.workload = workload
        n = len(w)
        self.n = n
        self.arrival = w.arrival.tolist()
        self.prompt = w.prompt.tolist()
        self.output = w.output.tolist()
        self.known = w.output_known.tolist()
        slo = [INF if t.tbt_slo is None else t.tbt_slo for t in w.tiers]
        tiers = w.tier_index.tolist()
        self.tier = tiers                               # tier index per request (-1: none)
        self.tbt = [INF if t < 0 else slo[t] for t in tiers]
        self.priority = [0 if t < 0 else w.tiers[t].priority for t in tiers]
        self.target = list(self.prompt)
        self.computed = [0] * n
        self.gen = [0] * n
        self.status = [ARRIVING] * n
        self.last_tok = [0.0] * n
        self.admitted = np.full(n, INF)
        self.first = np.full(n, INF)
        self.finished = np.full(n, INF)
        self.itl_max = np.zeros(n)
        self.viol = np.zeros(n, np.int64)
        self.preempts = np.zeros(n, np.int64)
        self.recomputed = np.zeros(n, np.int64)
        self.replica = np.full(n, -1, np.int32)         # where it was routed on arrival
        # the float records as typed buffers of the same memory, for the compiled engine's writes
        # (requests.pxd; no numpy scalar per access); as Python they are the arrays themselves
        self.admitted_c, self.first_c, self.finished_c, self.itl_max_c = self.admitted, self.first, self.finished, self.itl_max
        self.output_ro = tuple(self.output)             # a read-only copy for the view
        self.rejected = self._find_rejected(block_size, capacity_blocks, max_model_len, strict, spec_slots)
        self.rejected_list = self.rejected.tolist()
        for i in np.flatnonzero(self.rejected).tolist():
            self.status[i] = REJECTED
        self.remaining = n - int(self.rejected.sum())
        self.done = 0           # finished requests
        self.issued = 0         # requests that have arrived so far (index order)
        self.in_flight = 0      # arrived, not rejected and not finished (all replicas)
        self.rows = None        # a replica's own table: its requests' rows in the cluster's (routed_ahead.py)

    def _find_rejected(self, block_size: int, capacity_blocks: int, max_model_len: int | None,
                       strict: bool, spec_slots: tuple[int, int] = (0, 0)) -> np.ndarray:
        """Requests no replica can serve: KV for prompt + output - 1 tokens, and with speculative
        decoding (`spec_slots` = (k, lookahead)) the slots of its last verify step past them (vLLM
        allocates them whatever the output left: alone, such a request preempts itself forever);
        or longer than the model. vLLM gives no request slots past max_model_len."""
        w = self.workload
        cap = capacity_blocks * block_size
        # each length alone first, so that the sums below cannot overflow int64 unnoticed
        last = w.prompt + w.output - 1
        drafts, look = spec_slots
        if drafts:                          # its last verify step's slots: vLLM caps a step's tokens at
            last = last + drafts + look     # max_model_len - computed - 1 and its slots at max_model_len
            if max_model_len:
                last = np.minimum(last, max_model_len - 1 + min(look, 1))
        too_big = (w.prompt > cap) | (w.output > cap) | (last > cap)
        too_long = ((w.prompt > max_model_len) | (w.output > max_model_len) | (w.prompt + w.output > max_model_len)
                    if max_model_len else np.zeros(len(w), bool))
        bad = too_big | too_long
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            s, o = int(w.prompt[k]), int(w.output[k])
            need = s + o - 1                # Python ints: the lengths may be near int64's limit
            if spec_slots[0]:
                need += spec_slots[0] + spec_slots[1]
                if max_model_len:
                    need = min(need, max_model_len - 1 + min(spec_slots[1], 1))
            why = (f"needs {need} KV tokens" + (" with its drafts' slots (--spec)" if spec_slots[0] else "")
                   + f", capacity is {cap}" if too_big[k]
                   else f"is {s + o} tokens, model max is {max_model_len}")
            msg = (f"{int(bad.sum())} request(s) can never be served; first: request "
                   f"{int(w.ids[k])} (prompt {s}, output {o}) {why}")
            if strict:
                raise KvschedError(msg)
            warnings.warn(msg + "; they are counted as rejected", stacklevel=4)
        return bad

    def next_servable(self, k: int) -> int:
        """The first request at or after index k that is not rejected (n if none)."""
        rejected = self.rejected_list
        while k < self.n and rejected[k]:
            k += 1
        return k
