"""CSV lines of columns of numbers, byte for byte what csv.writer writes for their Python
values (`ndarray.tolist`): ints in decimal, floats by repr (the shortest text that reads back
as the same float), a missing value as an empty cell, lines ending in CRLF.

Why not csv.writer: Python's repr costs about 0.5 us a float, most of the time it takes to
write a run's CSV files (a million requests make some 14 million floats). The compiled leaf
(kvsched/_csv.pyx) lays out a block of rows at once in C, with repr's digits found in 80-bit
long-double arithmetic. Without it (no C compiler at install, KVSCHED_PURE_PYTHON=1) each
value's repr or str is written as csv.writer would: slower, the same bytes.
"""
from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

# A column of a block of rows: its values, and where it has them (None: in every row; a
# False is an empty cell).
Column = tuple[np.ndarray, "np.ndarray | None"]


_UNSAFE = np.frombuffer(b',"\r\n', np.uint8)          # csv would quote a word with one of them
# x87 80-bit long doubles (Linux on x86-64) only: the compiled leaf's error bounds are theirs
_EXTENDED = np.finfo(np.longdouble).nmant == 63


BLOCK = 1 << 13                 # rows laid out at once: a few MB for requests.csv's 17 columns


def csv_lines(columns: Sequence[Column]) -> Iterator[bytes]:
    """The CSV lines of two or more columns of equal length (csv.writer quotes a lone empty
    cell): float, int, or str (plain ASCII words) arrays, each with an optional mask of the
    cells that hold a value. A block of rows at a time, so memory stays small."""
    if len(columns) < 2:
        raise ValueError("csv_lines writes rows of two cells or more")
    for lo in range(0, len(columns[0][0]), BLOCK):
        yield _lines([(values[lo:lo + BLOCK], None if present is None else present[lo:lo + BLOCK])
                      for values, present in columns])


def _lines(columns: Sequence[Column]) -> bytes:
    n = len(columns[0][0])
    fast = _compiled()
    if fast is not None:
        return fast.csv_block([_column(np.asarray(values), present) for values, present in columns], n,
                              _extended_works())
    cells = [_texts(np.asarray(values), present) for values, present in columns]
    return "".join(",".join(row) + "\r\n" for row in zip(*cells)).encode("ascii")


def _compiled():
    """The compiled leaf (kvsched/_csv.pyx), or None: not built (no C compiler at install), or
    KVSCHED_PURE_PYTHON=1."""
    if os.environ.get("KVSCHED_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from kvsched import _csv
    except ImportError:
        return None
    return _csv


def _texts(values: np.ndarray, present: np.ndarray | None) -> list[str]:
    """A column's cells as csv.writer writes them: repr of a float, str of an int or a word."""
    kind = _kind(values)
    if kind == "U":
        _word_cells(values)                     # the words the compiled leaf takes, and no other
    text = repr if kind == "f" else str
    cells = [text(v) for v in (values.astype(np.float64) if kind == "f" else values).tolist()]
    if present is not None:
        cells = [c if p else "" for c, p in zip(cells, np.asarray(present, bool).tolist())]
    return cells


def _column(values: np.ndarray, present: np.ndarray | None) -> tuple:
    """A column as `_csv.csv_block` takes it: (kind, values, shown), or for words (kind, byte
    matrix, width, shown); `shown` (uint8) is 0 where the cell is empty."""
    kind = _kind(values)
    shown = np.ones(len(values), np.uint8) if present is None else np.asarray(present, bool).view(np.uint8)
    if kind == "U":
        words = np.ascontiguousarray(_word_cells(values))
        return "w", words, words.shape[1], np.ascontiguousarray(shown)
    dtype = {"f": np.float64, "i": np.int64, "u": np.uint64}[kind]
    return kind, np.ascontiguousarray(values, dtype), np.ascontiguousarray(shown)


def _kind(values: np.ndarray) -> str:
    """The dtype kind of a column CSV cells can be made of ("f", "i", "u" or "U"), else TypeError."""
    kind = values.dtype.kind
    if kind == "f" and values.dtype.itemsize > 8:
        raise TypeError(f"no CSV cells for {values.dtype} values (floats of more than 64 bits)")
    if kind not in "fiuU":
        raise TypeError(f"no CSV cells for {values.dtype} values")
    return kind


def _word_cells(values: np.ndarray) -> np.ndarray:
    """Words as they are: plain ASCII that csv would not quote (one byte a character, from
    the UCS-4 codes numpy holds; str -> bytes conversion costs ~200 ns a word)."""
    codes = np.ascontiguousarray(values, values.dtype.newbyteorder("=")).view(np.uint32).reshape(len(values), -1)
    unsafe = (codes >= 128) | np.isin(codes, _UNSAFE)
    unsafe[:, :-1] |= (codes[:, :-1] == 0) & (codes[:, 1:] != 0)    # a NUL inside a word
    if unsafe.any():
        raise ValueError(f"{values[unsafe.any(axis=1)][0]!r} is not a plain word for a CSV cell")
    return codes.astype(np.uint8)


def _extended_works() -> bool:
    """Whether long doubles have their 64-bit significand now (a library may have set the
    x87 unit to round to 53 bits)."""
    one = np.ones(1, np.longdouble)
    return bool(_EXTENDED and (one + np.longdouble(2.0) ** -63 != one)[0])
