"""Per-batch rows (timeline, batches) kept in bounded memory: full chunks go to an anonymous
temporary file, so a long run with `--out` does not grow in memory. Reads give the rows
back exactly (ints as ints, floats as float64)."""
from __future__ import annotations

import heapq
import tempfile
import weakref
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

try:
    import cython
except ModuleNotFoundError:                 # run as Python without Cython installed
    from kvsched import cython_shim as cython

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


class RowLog:
    """Append-only rows of a fixed column layout (`kinds`: 'f' float64 or 'i' int64), in
    flat memory: rows are written into a chunk of the layout (`_buf`, CHUNK rows; compiled,
    through typed views of its memory), and each full chunk goes to a temporary file. A row
    the chunk could not give back as the same Python values (a value not of its column's
    exact type, e.g. an int in a float column, or not a tuple of one value per column) is kept
    as given in `_rows`, and so is every row after it until a chunk boundary empties `_rows`;
    numpy converts those when their chunk goes to the file, as it converts any spilled row."""

    def __init__(self, kinds: str, chunk: int | None = None) -> None:
        """`chunk`: rows per chunk (default CHUNK, read now: tests shrink it)."""
        self.dtype = layout(kinds)
        self._kinds = kinds
        self._width = len(kinds)
        if not self._width:
            raise ValueError("a row log needs at least one column")
        self._floats = [kind == "f" for kind in kinds]
        self._cap = CHUNK if chunk is None else chunk
        self._buf = np.empty(self._cap, self.dtype)   # untouched pages cost no memory until written
        self._f = self._buf.view(np.float64).reshape(self._cap, self._width)
        self._q = self._buf.view(np.int64).reshape(self._cap, self._width)
        self._n = 0                                   # rows in _buf
        self._rows: list = []                         # rows after _buf's, kept as given
        self._file = None
        self._spilled = 0

    @cython.locals(n=cython.Py_ssize_t, c=cython.Py_ssize_t)
    def append(self, row) -> None:
        """Add a row: one value per column (the hot path: written into the chunk)."""
        n = self._n
        if not self._rows and type(row) is tuple and len(row) == self._width:
            try:
                for c in range(self._width):
                    v = row[c]
                    if self._floats[c]:
                        if type(v) is not float:
                            break
                        self._f[n, c] = v
                    elif type(v) is int:
                        self._q[n, c] = v       # OverflowError beyond int64
                    else:
                        break
                else:
                    self._n = n + 1
                    if n + 1 == self._cap:
                        self._spill()
                    return
            except OverflowError:
                pass                            # row n is not counted: what was written is dropped
        self._rows.append(row)

    def __len__(self) -> int:
        self._spill_if_full()
        return self._spilled + self._n + len(self._rows)

    def __reduce__(self):
        """Pickled (or copied) as its layout and its rows as they read now: a new log, with
        its own chunk and file (a run's result pickles, as it did when rows were a list)."""
        return _rebuilt, (self._kinds, list(self), self._cap)

    def _spill_if_full(self) -> None:
        while self._n + len(self._rows) >= self._cap:
            self._spill()

    def _spill(self) -> None:
        """The oldest chunk of rows goes to the file (a whole chunk: what the file holds does
        not depend on when this is called)."""
        if self._file is None:
            self._file = tempfile.TemporaryFile()
            weakref.finalize(self, self._file.close)     # closed with the log: no ResourceWarning at exit
        self._file.seek(0, 2)
        if self._rows:                          # the chunk's rows, then the first ones kept as given
            k = self._cap - self._n
            rows = self._buf[:self._n].tolist() + self._rows[:k]
            chunk = exact_chunk(rows, self.dtype)
            if chunk is None:                   # other types: numpy converts them
                chunk = np.array(rows, dtype=self.dtype)
            del self._rows[:k]
        else:
            chunk = self._buf
        chunk.tofile(self._file)
        self._spilled += self._cap
        self._n = 0

    def check(self) -> None:
        """Move full chunks of rows kept as given to disk (the replica calls it every few
        thousand batches; a full chunk of written rows goes at once)."""
        self._spill_if_full()

    def _in_memory(self) -> tuple[np.ndarray, list]:
        """The rows in memory now: a copy of the chunk's, and a snapshot of those kept as given."""
        return self._buf[:self._n].copy(), list(self._rows)

    def __iter__(self) -> Iterator[tuple]:
        total, (head, rest) = self._spilled, self._in_memory()     # a spill meanwhile changes neither
        for block in self.spilled_chunks(total):
            yield from block.tolist()
        yield from head.tolist()
        yield from rest

    def spilled_chunks(self, total: int) -> Iterator[np.ndarray]:
        """The first `total` rows on disk, a chunk (a structured array) at a time (later
        spills append to the file, so they stay what they were)."""
        done = 0                             # own position: several iterators may share the file
        while done < total:
            self._file.seek(done * self.dtype.itemsize)
            block = np.fromfile(self._file, dtype=self.dtype, count=min(self._cap, total - done))
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
        if k < self._n:
            return self._buf[k].tolist()
        return self._rows[k - self._n]


Sequence.register(RowLog)                   # compiled, a C type: it cannot subclass Sequence


def _rebuilt(kinds: str, rows: list, chunk: int) -> RowLog:
    log = RowLog(kinds, chunk)
    for row in rows:
        log.append(row)
    return log


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
    changes neither), or None if a row kept as given would not come back from a chunk as the
    same Python value (written the same)."""
    spilled, (head, rest) = log._spilled, log._in_memory()
    chunks = ([head] if len(head) else []) + [exact_chunk(rest[lo:lo + PIECE], log.dtype) for lo in range(0, len(rest), PIECE)]
    return None if any(chunk is None for chunk in chunks) else (spilled, chunks)


@cython.locals(n=cython.Py_ssize_t, m=cython.Py_ssize_t, j=cython.Py_ssize_t, c=cython.Py_ssize_t,
               f=cython.double[:, ::1], q=cython.longlong[:, ::1])
def exact_chunk(rows: list[tuple], dtype: np.dtype) -> np.ndarray | None:
    """`rows` as a chunk of `dtype` (a `layout`: 8-byte fields), or None unless every row has
    a value per column and every value is its column's exact type (float in a float column,
    an int within int64 in an int column): what a chunk gives back as the same Python values.
    Compiled, one typed pass writing the chunk's memory (through float64 and int64 views of
    it); as Python, numpy's column assignments: the same chunk either way, each the fast way
    of its build."""
    names = dtype.names
    n, m = len(rows), len(names)
    for row in rows:                            # every row first, in either build: a tuple or list
        if type(row) is not tuple and type(row) is not list or len(row) != m:    # of one value per column
            return None                         # (numpy converts other rows at a spill)
    chunk = np.empty(n, dtype)
    if not cython.compiled or dtype.itemsize != 8 * m:
        for name, values in zip(names, zip(*rows)):
            if set(map(type, values)) != {float if dtype[name].kind == "f" else int}:
                return None
            try:
                chunk[name] = values
            except OverflowError:               # an int beyond int64
                return None
        return chunk
    floats = [dtype[name].kind == "f" for name in names]
    f = chunk.view(np.float64).reshape(n, m)
    q = chunk.view(np.int64).reshape(n, m)
    try:
        for j in range(n):
            row = rows[j]
            for c in range(m):
                v = row[c]
                if floats[c]:
                    if type(v) is not float:
                        return None
                    f[j, c] = v
                else:
                    if type(v) is not int:
                        return None
                    q[j, c] = v
    except OverflowError:                       # an int beyond int64
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
