"""Per-batch rows (timeline, batches) kept in bounded memory: full chunks go to an anonymous
temporary file, so a long run with `--out` does not grow in memory. Reads give the rows
back exactly (ints as ints, floats as float64)."""
from __future__ import annotations

import heapq
import tempfile
import weakref
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
    from kvsched.csvtext import Column

CHUNK = 1 << 16             # rows held in memory before they go to disk
PIECE = 1 << 13             # rows converted or merged at once (a few MB)


class RowSchema(NamedTuple):
    """A per-batch row log's named columns: (name, kind) pairs, kind 'f' float64 or 'i' int64.
    The one place a column of timeline.csv or batches.csv is named: the replica's logs and the
    --out writer take it from here."""
    columns: tuple[tuple[str, str], ...]

    @property
    def kinds(self) -> str:
        return "".join(kind for _, kind in self.columns)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.columns]


# a row per batch: its end, then the waiting and running requests and the KV tokens held
TIMELINE = RowSchema((("time", "f"), ("queue_length", "i"), ("running", "i"), ("kv_used_tokens", "i")))
# a row per batch: its start and duration, its shape, the KV tokens it held
BATCHES = RowSchema((("start", "f"), ("duration", "f"), ("prefill_tokens", "i"), ("prefill_requests", "i"),
                     ("decode_requests", "i"), ("kv_used_tokens", "i")))


def layout(kinds: str) -> np.dtype:
    """The row dtype of a column layout (`kinds`: 'f' float64 or 'i' int64 per column)."""
    return np.dtype([(f"c{k}", np.float64 if c == "f" else np.int64) for k, c in enumerate(kinds)])


class RowLog(Sequence):
    """Append-only rows of a fixed column layout (`kinds`: 'f' float64 or 'i' int64): in
    memory as Python's appends (`_rows`, oldest first), whole chunks of the oldest spilled to
    a temporary file (memory stays flat)."""

    def __init__(self, kinds: str) -> None:
        self.dtype = layout(kinds)
        self._rows: list[tuple] = []
        self._file = None
        self._spilled = 0
        self.append = self._rows.append           # the hot path: a list append

    def _parts(self, snapshot: bool = True) -> list[list[tuple]]:
        """The rows in memory: a snapshot (later appends change none of it), or the list itself
        (for a read at once)."""
        if not self._rows:
            return []
        return [list(self._rows) if snapshot else self._rows]

    def __len__(self) -> int:
        self._spill_if_full()
        return self._spilled + len(self._rows)

    def _spill_if_full(self) -> None:
        if len(self._rows) >= CHUNK:
            self._spill()

    def _spill(self) -> None:
        """Whole chunks of the oldest rows go to the file (the same rows whenever it is
        called); the rest stay."""
        if self._file is None:
            self._file = tempfile.TemporaryFile()
            weakref.finalize(self, self._file.close)     # closed with the log: no ResourceWarning at exit
        self._file.seek(0, 2)
        k = len(self._rows) // CHUNK * CHUNK
        np.array(self._rows[:k], dtype=self.dtype).tofile(self._file)
        self._spilled += k
        del self._rows[:k]                        # in place: `append` stays bound to it

    def check(self) -> None:
        """Move full chunks to disk (the replica calls it every few thousand batches)."""
        self._spill_if_full()

    def __iter__(self) -> Iterator[tuple]:
        total, parts = self._spilled, self._parts()     # the rows now: a spill meanwhile changes neither
        for block in self.spilled_chunks(total):
            yield from block.tolist()
        for part in parts:
            yield from part

    def spilled_chunks(self, total: int) -> Iterator[np.ndarray]:
        """The first `total` rows on disk, a chunk (a structured array) at a time (later
        spills append to the file, so they stay what they were)."""
        done = 0                             # own position: several iterators may share the file
        while done < total:
            self._file.seek(done * self.dtype.itemsize)
            block = np.fromfile(self._file, dtype=self.dtype, count=min(CHUNK, total - done))
            if not len(block):
                raise OSError(f"row log file ended after {done} of {total} rows")
            done += len(block)
            yield block

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        if k < self._spilled:
            self._file.seek(k * self.dtype.itemsize)
            return np.fromfile(self._file, dtype=self.dtype, count=1).tolist()[0]
        k -= self._spilled
        for part in self._parts(snapshot=False):
            if k < len(part):
                return part[k]
            k -= len(part)
        raise IndexError(k)


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


# ----- the rows as blocks of numpy columns (run.py writes CSV files from them) ------------
# Iterating a RowLog makes a Python tuple per row, and MergedRows merges the replicas row by
# row with heapq: together some seconds for a million-request run's timeline. The blocks
# below give the same rows in the same order, as numpy arrays: (values, None) per column,
# the `Column` of kvsched.csvtext.


def row_blocks(rows) -> Iterator[list[Column]] | None:
    """`rows` a block of columns at a time, or None where only writing them row by row is
    sure to give the same text: another kind of sequence, rows a numpy chunk cannot hold as
    the same Python values (an int in a float column), or a cluster log whose times go back
    (heapq.merge's order is then not the sort made here)."""
    if isinstance(rows, RowLog):
        tail = _exact_tail(rows)
        return None if tail is None else (_columns(chunk) for chunk in _chunks(rows, tail))
    if isinstance(rows, MergedRows):
        return _merged_blocks(rows._logs)
    return None


def _columns(chunk: np.ndarray) -> list[Column]:
    return [(chunk[name], None) for name in chunk.dtype.names]


def _chunks(log: RowLog, tail: tuple[int, list[np.ndarray]]) -> Iterator[np.ndarray]:
    """A log's rows a chunk at a time, as `_exact_tail` found them: the rows spilled to its
    file then, and the rows it held in memory (as RowLog.__iter__ reads them)."""
    spilled, chunks = tail
    yield from log.spilled_chunks(spilled)
    yield from chunks


def _exact_tail(log: RowLog) -> tuple[int, list[np.ndarray]] | None:
    """(rows on disk, the rows in memory as chunks of its dtype), both now (a later spill
    changes neither), or None if a value in memory would not come back from a chunk as the
    same Python value (written the same)."""
    spilled, chunks = log._spilled, []
    for part in log._parts():
        chunks += [_exact_chunk(part[lo:lo + PIECE], log.dtype) for lo in range(0, len(part), PIECE)]
    return None if any(chunk is None for chunk in chunks) else (spilled, chunks)


def _exact_chunk(rows: list[tuple], dtype: np.dtype) -> np.ndarray | None:
    if any(len(row) != len(dtype.names) for row in rows):
        return None
    chunk = np.empty(len(rows), dtype)
    for name, values in zip(dtype.names, zip(*rows)):
        if set(map(type, values)) != {float if dtype[name].kind == "f" else int}:
            return None
        try:
            chunk[name] = values
        except OverflowError:                   # an int beyond int64
            return None
    return chunk


def _merged_blocks(logs: list[tuple[int, RowLog]]) -> Iterator[list[Column]] | None:
    """MergedRows' rows (every replica's by time, then replica, with the replica's number
    last) a block at a time, where that is what heapq.merge gives: every log a RowLog of the
    same layout whose times never decrease, each replica's number its own."""
    if (len({k for k, _ in logs}) != len(logs) or not all(type(k) is int for k, _ in logs)
            or not all(isinstance(log, RowLog) for _, log in logs)):
        return None
    tails = [_exact_tail(log) for _, log in logs]
    if any(tail is None for tail in tails) or len({log.dtype for _, log in logs}) > 1:
        return None
    if not all(_in_time_order(_chunks(log, tail)) for (_, log), tail in zip(logs, tails)):
        return None
    return _merge({k: _pieces(_chunks(log, tail)) for (k, log), tail in zip(logs, tails)})


def _pieces(chunks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Chunks cut to at most PIECE rows (views): a merge round then holds a few MB."""
    for chunk in chunks:
        for lo in range(0, len(chunk), PIECE):
            yield chunk[lo:lo + PIECE]


def _in_time_order(chunks: Iterator[np.ndarray]) -> bool:
    """Whether the first column (time) never decreases and is never NaN."""
    last = -np.inf
    for chunk in chunks:
        t = chunk[chunk.dtype.names[0]]
        if len(t):
            if np.isnan(t).any() or t[0] < last or (t[1:] < t[:-1]).any():
                return False
            last = t[-1]
    return True


def _merge(streams: dict[int, Iterator[np.ndarray]]) -> Iterator[list[Column]]:
    """Replicas' sorted chunk streams merged by (time, replica), in order within a stream.
    Each round takes, from every replica's buffered rows, those whose key is at most the
    least of the buffers' last keys: no row still unread can come before them. That empties
    at least one buffer a round."""
    buffered: dict[int, np.ndarray] = {}
    while True:
        for k in list(streams):
            while not len(buffered.get(k, ())):
                buffered[k] = next(streams[k], None)
                if buffered[k] is None:
                    del streams[k], buffered[k]
                    break
        if not buffered:
            return
        time = next(iter(buffered.values())).dtype.names[0]
        cut_time, cut_k = min((rows[time][-1], k) for k, rows in buffered.items())
        parts = []
        for k, rows in buffered.items():
            n = int(np.searchsorted(rows[time], cut_time, side="right" if k <= cut_k else "left"))
            parts.append((k, rows[:n]))
            buffered[k] = rows[n:]
        yield _merged_columns(parts)


def _merged_columns(parts: list[tuple[int, np.ndarray]]) -> list[Column]:
    """Replicas' chunks as one block by (time, replica) (a stable sort: rows of one replica
    at one time keep their order), the replica's number as a last column."""
    rows = np.concatenate([chunk for _, chunk in parts])
    replica = np.concatenate([np.full(len(chunk), k, np.int64) for k, chunk in parts])
    order = np.lexsort((replica, rows[rows.dtype.names[0]]))
    return _columns(rows[order]) + [(replica[order], None)]
