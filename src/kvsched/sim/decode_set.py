"""Requests in their decode phase: cohorts that advance together, one clock per cohort.

Every decode step adds one token to every member of a stepping cohort, so a member's state
is its state at join plus (cohort clock - clock at join). That makes a step O(1) whatever
the cohort's size:
- completions: a heap of the clock at which each member reaches its output length;
- KV growth: a member opens a new block when its KV length is a multiple of the block
  size, and KV length - clock is constant per member, so members are counted by that
  residue and a step needs `residue[-clock mod B]` new blocks;
- inter-token gaps: the gap of step k is the same for every member that also decoded at
  step k - 1, so gaps are kept per step (a buffer trimmed to the oldest member) and a
  member's maximum gap and SLO misses are read off its window when it leaves.

A policy may decode a chosen subset of the decoders (`Plan.decode` as a set of ids). The
others are paused: their cohort's clock does not move, so their KV is held and their next
gap spans the batches they sat out. A selection that cuts a cohort splits it, moving the
smaller side into a new cohort, and then the cohorts selected alike (and those paused alike)
are merged, smaller into larger: after a selection there are at most two cohorts. Moving a
member costs O(1) plus its gap window, so the cost of a batch grows with the number of
requests whose selection changed, not with the batch size; decoding every member
(`decode=True`) steps each cohort and moves nobody, except that cohorts of at most `FOLD`
members in all are folded into the largest.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

FOLD = 16       # decode-all batches fold cohorts this small (in all) into the largest


class Cohort:
    """Members advanced together by one clock."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.clock = 0
        self.n = 0
        self.ctx = 0                           # sum of members' KV tokens
        self.residue = [0] * block_size
        self.members: dict[int, tuple[int, int, int, float]] = {}   # id -> (clock, kv, gen, time)
        self.fresh: dict[int, None] = {}       # joined since the last step (a dict: O(1) removal)
        self.last_time = 0.0
        self._heap: list[tuple[int, int]] = []
        self._finish: dict[int, int] = {}
        self._gaps = self._gaps_c = np.zeros(1024)     # _gaps_c: the same buffer, typed when compiled
        self._base = 0                         # clock of _gaps[0]

    @property
    def new_blocks(self) -> int:
        return self.residue[-self.clock % self.block_size]

    def progress(self, i: int) -> tuple[int, int]:
        """Member i's (KV tokens, tokens generated) now: its state at join plus the steps since."""
        c0, k0, g0, _ = self.members[i]
        steps = self.clock - c0
        return k0 + steps, g0 + steps

    def kv_tokens(self, i: int) -> int:
        """Member i's KV tokens now (`progress(i)[0]`, without the pair)."""
        c0, k0, _, _ = self.members[i]
        return k0 + self.clock - c0

    @cython.locals(c0=cython.longlong, t0=cython.double)
    def last_token(self, i: int) -> float:
        c0, _, _, t0 = self.members[i]
        return self.last_time if self.clock > c0 else t0

    def join(self, i: int, kv: int, gen: int, output: int, time: float) -> None:
        c = self.clock
        self.members[i] = (c, kv, gen, time)
        self.fresh[i] = None
        self.n += 1
        self.ctx += kv
        self.residue[(kv - c) % self.block_size] += 1
        f = c + output - gen
        self._finish[i] = f
        heapq.heappush(self._heap, (f, i))

    def advance(self, i: int, e: int) -> None:
        """Member i emitted e tokens more in the step just taken (accepted speculative tokens,
        sim/spec_decode.py): its state at join moves on by e, and so do its KV block residue,
        the cohort's context and its completion clock (the old heap entry goes stale)."""
        c0, k0, g0, t0 = self.members[i]
        bs = self.block_size
        self.residue[(k0 - c0) % bs] -= 1
        self.residue[(k0 + e - c0) % bs] += 1
        self.members[i] = (c0, k0 + e, g0 + e, t0)
        self.ctx += e
        f = self._finish[i] - e
        self._finish[i] = f
        heapq.heappush(self._heap, (f, i))

    @cython.overflowcheck(True)
    def step(self, end: float) -> float:
        """One decode step ending at `end`; returns its gap for members that decoded the
        step before (the fresh ones have their own first gap: end - their last token)."""
        self.clock += 1
        gap = end - self.last_time
        k = self.clock - self._base
        if k >= len(self._gaps):
            self._trim()
            k = self.clock - self._base
        self._gaps_c[k] = gap
        self.last_time = end
        self.ctx += self.n
        return gap

    def due(self) -> list[int]:
        """Members whose output is complete at the current clock."""
        out = []
        heap, clock, finish = self._heap, self.clock, self._finish
        while heap and heap[0][0] <= clock:
            f, i = heapq.heappop(heap)
            if finish.get(i) == f:          # stale entries (left and rejoined) are skipped
                del finish[i]
                out.append(i)
        return out

    def leave(self, i: int) -> tuple[int, int, float, int, int]:
        """Remove a member: (kv tokens, tokens generated, time of its last token, lo, hi):
        `_gaps[lo:hi]` are the gaps of its decode steps after the first one (until the next
        step)."""
        c0, k0, g0, t0 = self.members.pop(i)
        self._finish.pop(i, None)
        steps = self.clock - c0
        kv = k0 + steps
        self.n -= 1
        self.ctx -= kv
        self.residue[(k0 - c0) % self.block_size] -= 1
        if steps == 0:
            del self.fresh[i]
        last = self.last_time if steps else t0
        lo, hi = self._bounds(c0)
        return kv, g0 + steps, last, lo, hi

    def _bounds(self, c0: int) -> tuple[int, int]:
        """(lo, hi): `_gaps[lo:hi]` are the gaps, after its first decode step here, of a member
        that joined at clock c0 (empty when lo >= hi)."""
        return c0 + 2 - self._base, self.clock + 1 - self._base

    @cython.locals(w=cython.double[:], k=cython.Py_ssize_t, m=cython.double, m1=cython.double,
                   m2=cython.double, m3=cython.double, x=cython.double)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def gap_max(self, lo: int, hi: int) -> float:
        """The largest of `_gaps[lo:hi]` (0 <= lo < hi <= the buffer's length, checked once;
        finite floats, none of them -0.0: a gap is a later time minus an earlier one).
        Compiled, a loop over the buffer with four running maxima (branch-free selects, four
        independent chains: the maximum of finite floats without -0.0 is the same value in
        any order); as Python, numpy's reduction: the same float either way, each the fast
        way of its build."""
        w = self._gaps_c
        if not 0 <= lo < hi <= w.shape[0]:
            raise IndexError(f"gap window [{lo}, {hi}) outside the cohort's buffer of {w.shape[0]}")
        if not cython.compiled:
            return float(np.maximum.reduce(self._gaps[lo:hi]))
        m = m1 = m2 = m3 = w[lo]
        k = lo + 1
        while k + 4 <= hi:
            x = w[k]
            m = x if x > m else m
            x = w[k + 1]
            m1 = x if x > m1 else m1
            x = w[k + 2]
            m2 = x if x > m2 else m2
            x = w[k + 3]
            m3 = x if x > m3 else m3
            k += 4
        while k < hi:
            x = w[k]
            m = x if x > m else m
            k += 1
        m = m1 if m1 > m else m
        m2 = m3 if m3 > m2 else m2
        return m2 if m2 > m else m

    def window(self, i: int) -> np.ndarray:
        """The gaps member i has had so far after its first decode step here (what `leave`
        would return for it), without removing it."""
        lo, hi = self._bounds(self.members[i][0])
        return self._gaps[lo:hi]

    def _trim(self) -> None:
        """Drop gaps older than every member's window; grow if still more than half full."""
        keep_from = self.clock
        for m in self.members.values():
            if m[0] < keep_from:
                keep_from = m[0]
        keep_from += 1
        kept = self._gaps[keep_from - self._base:self.clock - self._base]
        size = len(self._gaps)
        if 2 * (len(kept) + 1) > size:
            size *= 2
        gaps = np.zeros(size)
        gaps[:len(kept)] = kept
        self._gaps = self._gaps_c = gaps
        self._base = keep_from


class DecodeSet:
    """Every request in its decode phase, in cohorts (see the module docstring).

    `move(i, src, dst)` is the owner's: it removes i from cohort `src` (folding its gap
    window into its records) and joins it to `dst`; the owner keeps per-request records.
    """

    def __init__(self, block_size: int, move: Callable[[int, Cohort, Cohort], None]) -> None:
        self.block_size = block_size
        self.cohorts: list[Cohort] = [Cohort(block_size)]
        self.where: dict[int, Cohort] = {}     # member -> its cohort (insertion order: join order)
        self.n = 0
        self._move = move

    @property
    def new_blocks(self) -> int:
        """Blocks one decode step of every member needs."""
        cs = self.cohorts
        if len(cs) == 1:
            c = cs[0]
            return c.residue[-c.clock % c.block_size]
        return sum(c.new_blocks for c in cs)

    def join(self, i: int, kv: int, gen: int, output: int, time: float) -> None:
        c = self.cohorts[0]
        c.join(i, kv, gen, output, time)
        self.where[i] = c
        self.n += 1

    def leave(self, i: int) -> tuple[int, int, float, int, int]:
        """`Cohort.leave` of member i (its cohort: `where[i]` before the call)."""
        self.n -= 1
        return self.where.pop(i).leave(i)

    def select(self, chosen: set[int]) -> list[Cohort]:
        """Split cohorts so that `chosen` (a subset of the members) is exactly a union of
        cohorts, then merge each side into one; returns the chosen side's cohorts. Requests
        whose cohort is not returned stay paused."""
        on: list[Cohort] = []
        off: list[Cohort] = []
        cut: list[tuple[Cohort, set[int]]] = []
        for c in self.cohorts:
            if not c.n:
                continue
            inside = chosen.intersection(c.members)
            k = len(inside)
            if k == c.n:
                on.append(c)
            elif k == 0:
                off.append(c)
            else:
                cut.append((c, inside))
        for c, inside in cut:                   # the smaller side moves, into its side's largest cohort
            if 2 * len(inside) <= c.n:
                dst = max(on, key=lambda x: x.n) if on else Cohort(self.block_size)
                self._transfer(inside, c, dst)
                if dst not in on:
                    on.append(dst)
                off.append(c)
            else:
                dst = max(off, key=lambda x: x.n) if off else Cohort(self.block_size)
                self._transfer(c.members.keys() - inside, c, dst)
                if dst not in off:
                    off.append(dst)
                on.append(c)
        on, off = self._merged(on), self._merged(off)
        self.cohorts = (on + off) or [Cohort(self.block_size)]
        return on

    def everyone(self) -> list[Cohort]:
        """The cohorts when every member decodes; cohorts of at most `FOLD` members in all
        are folded into the largest first, so a one-off selection stops costing a clock."""
        cs = self.cohorts
        if len(cs) > 1:
            big = max(cs, key=lambda c: c.n)
            if self.n - big.n <= FOLD:
                self.cohorts = cs = self._merged(cs)
        return cs

    def _merged(self, group: list[Cohort]) -> list[Cohort]:
        """One cohort holding every member of `group` (the smaller ones move into the largest)."""
        group = [c for c in group if c.n]
        if len(group) <= 1:
            return group
        group.sort(key=lambda c: c.n)
        big = group[-1]
        for c in group[:-1]:
            self._transfer(list(c.members), c, big)
        return [big]

    def _transfer(self, ids, src: Cohort, dst: Cohort) -> None:
        where, move = self.where, self._move
        for i in sorted(ids):                   # sorted: the same runs give the same heaps
            move(i, src, dst)
            where[i] = dst
