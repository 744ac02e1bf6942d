"""Per-batch rows (timeline, batches) kept in bounded memory: full chunks go to an anonymous
temporary file, so a long run with `--out` does not grow in memory. Reads give the rows
back exactly (ints as ints, floats as float64)."""
from __future__ import annotations

import heapq
import tempfile
from typing import Iterable, Iterator, Sequence

import numpy as np

CHUNK = 1 << 16             # rows held in memory before they go to disk


class RowLog(Sequence):
    """Append-only rows of a fixed column layout (`kinds`: 'f' float64 or 'i' int64)."""

    def __init__(self, kinds: str) -> None:
        self.dtype = np.dtype([(f"c{k}", np.float64 if c == "f" else np.int64) for k, c in enumerate(kinds)])
        self._rows: list[tuple] = []
        self._file = None
        self._spilled = 0
        self.append = self._rows.append           # the hot path: a list append

    def __len__(self) -> int:
        self._spill_if_full()
        return self._spilled + len(self._rows)

    def _spill_if_full(self) -> None:
        if len(self._rows) >= CHUNK:
            self._spill()

    def _spill(self) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile()
        self._file.seek(0, 2)
        k = len(self._rows) // CHUNK * CHUNK    # whole chunks: the same rows spill whenever it is called
        np.array(self._rows[:k], dtype=self.dtype).tofile(self._file)
        self._spilled += k
        del self._rows[:k]

    def check(self) -> None:
        """Move full chunks to disk (the replica calls it every few thousand batches)."""
        self._spill_if_full()

    def __iter__(self) -> Iterator[tuple]:
        done, total = 0, self._spilled       # own position: several iterators may share the file
        while done < total:
            self._file.seek(done * self.dtype.itemsize)
            block = np.fromfile(self._file, dtype=self.dtype, count=min(CHUNK, total - done))
            if not len(block):
                raise OSError(f"row log file ended after {done} of {total} rows")
            done += len(block)
            yield from block.tolist()
        yield from list(self._rows)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        if k >= self._spilled:
            return self._rows[k - self._spilled]
        self._file.seek(k * self.dtype.itemsize)
        return np.fromfile(self._file, dtype=self.dtype, count=1).tolist()[0]


class MergedRows(Sequence):
    """Several replicas' rows as one sequence, by time then replica, each row with the
    replica's number appended (iterated lazily, again on every pass)."""

    def __init__(self, logs: Iterable[tuple[int, RowLog]]) -> None:
        self._logs = list(logs)

    def __len__(self) -> int:
        return sum(len(log) for _, log in self._logs)

    def __iter__(self) -> Iterator[tuple]:
        return heapq.merge(*(_tagged(log, k) for k, log in self._logs), key=lambda row: (row[0], row[-1]))

    def __getitem__(self, k):
        rows = list(self)
        return rows[k]


def _tagged(log: RowLog, k: int) -> Iterator[tuple]:
    for row in log:
        yield (*row, k)
