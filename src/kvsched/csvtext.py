"""CSV lines of columns of numbers, byte for byte what csv.writer writes for their Python
values (`ndarray.tolist`): ints in decimal, floats by repr (the shortest text that reads back
as the same float), a missing value as an empty cell, lines ending in CRLF.

Why not csv.writer: Python's repr costs about 0.5 us a float, most of the time it takes to
write a run's CSV files (a million requests make some 14 million floats). Here numpy lays
out a block of rows at once in a byte matrix, each cell in fixed columns with NUL bytes
where it is shorter, and the NULs are dropped at the end.

A float's text is repr's, by the rule repr follows (Python's dtoa, mode 0): the fewest
significant digits p such that some p-digit decimal reads back as x, and of those decimals
the nearest to x. `_shortest` decides this with 80-bit long-double arithmetic and known error
bounds. A float it cannot decide for certain gets Python's own repr, and so does every float
outside [1e-4, 1e16) (where repr writes an exponent), zero, negatives, powers of two (the
floats reading back as them are not centred on them), non-finite values, and every float on
a platform without 80-bit long doubles.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

# A column of a block of rows: its values, and where it has them (None: in every row; a
# False is an empty cell).
Column = tuple[np.ndarray, "np.ndarray | None"]


def _quads(lead: bool, zero: str = "") -> np.ndarray:
    """"0000".."9999" as 4-byte words; with `lead`, leading zeros as NULs and 0 as `zero`."""
    k = np.arange(10000)[:, None]
    place = 10 ** np.arange(3, -1, -1)
    quads = (k // place % 10 + ord("0")).astype(np.uint8)
    if lead:
        quads[k < place] = 0
        quads[0, 3] = ord(zero) if zero else 0
    return quads.view(np.uint32).ravel()


_QUADS = _quads(False)                      # every digit
_LEADING_QUADS = _quads(True)               # the first digits of a number; 0: nothing
_LAST_QUADS = _quads(True, "0")             # a number's last 4 digits when it has no more
_POINT = np.frombuffer(b"\0\0\0.", np.uint32)[0]
_KEEP = np.frombuffer(bytes([0, 0, 0, 0, 0, 0, 0, 255, 0, 0, 255, 255, 0, 255, 255, 255] + [255] * 4),
                      np.uint32)            # _KEEP[m]: a word's last m bytes
_POW10 = 10 ** np.arange(19, dtype=np.int64)
_POW10_FLOAT = 10.0 ** np.arange(28)
_POW10_LONG = np.cumprod(np.r_[1, np.full(27, 10)].astype(np.longdouble))   # exact up to 10**27
_EXTENDED = np.finfo(np.longdouble).nmant == 63     # x87 80-bit (Linux on x86-64) only: the error bounds are its
_UNSAFE = np.frombuffer(b',"\r\n', np.uint8)          # csv would quote a word with one of them


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
    if fast is not None:                    # the same text, laid out in C
        return fast.csv_block([_column(np.asarray(values), present) for values, present in columns], n,
                              _extended_works())
    comma, crlf = np.full((n, 1), ord(","), np.uint8), np.tile(np.frombuffer(b"\r\n", np.uint8), (n, 1))
    pieces = []
    for values, present in columns:
        pieces += [_cells(np.asarray(values), present), comma]
    pieces[-1] = crlf
    lines = np.concatenate(pieces, axis=1).ravel()
    return np.compress(lines != 0, lines).tobytes()


def _compiled():
    """The compiled module (kvsched/sim/_fast.pyx, `csv_block`), or None where the simulator runs
    its pure-Python code (no C compiler at install, KVSCHED_PURE_PYTHON=1)."""
    from kvsched.sim import replica
    return replica._fast


def _column(values: np.ndarray, present: np.ndarray | None) -> tuple:
    """A column as `_fast.csv_block` takes it: (kind, values, shown), or for words (kind,
    byte matrix, width, shown); `shown` (uint8) is 0 where the cell is empty. It writes the
    text `_cells` gives: repr's for floats (by `_shortest`'s rule, compiled), decimal ints."""
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


def _cells(values: np.ndarray, present: np.ndarray | None) -> np.ndarray:
    """A column's cells as an (n, width) byte matrix, NUL-padded: an absent value is all
    NULs, and a value the fast path leaves (`done` False) is Python's text."""
    kind = _kind(values)
    if present is not None:
        present = np.asarray(present, bool)     # a mask of 0/1 ints would index rows under ~
    if kind == "f":
        values = values.astype(np.float64)
        (cells, done), text = _float_cells(values), repr
    elif kind in "iu":
        (cells, done), text = _int_cells(values), str
    else:
        cells, done, text = _word_cells(values), np.ones(len(values), bool), str
    cells[~done if present is None else ~(done & present)] = 0
    todo = ~done if present is None else ~done & present
    return _with_python_text(cells, values, todo, text) if todo.any() else cells


def _word_cells(values: np.ndarray) -> np.ndarray:
    """Words as they are: plain ASCII that csv would not quote (one byte a character, from
    the UCS-4 codes numpy holds; str -> bytes conversion costs ~200 ns a word)."""
    codes = np.ascontiguousarray(values, values.dtype.newbyteorder("=")).view(np.uint32).reshape(len(values), -1)
    unsafe = (codes >= 128) | np.isin(codes, _UNSAFE)
    unsafe[:, :-1] |= (codes[:, :-1] == 0) & (codes[:, 1:] != 0)    # a NUL inside a word
    if unsafe.any():
        raise ValueError(f"{values[unsafe.any(axis=1)][0]!r} is not a plain word for a CSV cell")
    return codes.astype(np.uint8)


def _int_cells(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ints in decimal, and which were done (negative ones, or from 10**18, are not)."""
    done = (values >= 0) & (values < 10 ** 18)
    v = np.where(done, values, 0).astype(np.int64)
    words = np.empty((len(v), _words(v)), np.uint32)
    _whole(v, words)
    return words.view(np.uint8), done


def _float_cells(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Floats as repr writes them, "whole.fraction", and which were done."""
    fast = (x >= 1e-4) & (x < 1e16) & (np.frexp(x)[0] != 0.5) & _extended_works()
    digits, ndigits, exp10, sure = _shortest(np.where(fast, x, 1.5))
    fast &= sure
    after = ndigits - 1 - exp10             # digits after the point; <= 0: the point ends the digits
    shift = _POW10[np.minimum(np.abs(after), 18)]        # digits < 10**17: 10**18 will do for 19, 20
    whole = np.where(fast, np.where(after > 0, digits // shift, digits * shift), 0)
    fraction = np.where(fast & (after > 0), digits - whole * shift, 0)
    after = np.where(fast, np.maximum(after, 1), 1)      # "x.0" when the digits end at the point
    left = _words(whole)
    words = np.empty((len(x), left + 1 + -(-int(after.max(initial=1)) // 4)), np.uint32)
    _whole(whole, words[:, :left])
    words[:, left] = _POINT
    _fraction(fraction, after, words[:, left + 1:])
    return words.view(np.uint8), fast


def _shortest(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For floats x in [1e-4, 1e16) but powers of two: repr's significant digits as an int,
    how many, the power of ten of the first, and whether all that is certain.

    The floats reading back as x are those within h, half its spacing, on either side. Take
    p0, the fewest digits whose spacing is finer than 2h (some p0-digit decimal is within h),
    and y = x * 10**s, with s such that the p0-digit decimals are the integers: the
    (p0 - k)-digit decimals are then the multiples of 10**k, and repr's p is p0 - k for the
    largest k whose nearest multiple lies within h (if one does for k, one does for k - 1).
    y is one long-double product (10**s is exact), off by at most 2**-64 y; a comparison
    closer than that bound, plus float64 rounding, is left undecided."""
    exp10 = np.floor(np.log10(x)).astype(np.int64)
    spacing = np.spacing(x)
    p0 = np.minimum(np.floor(exp10 + 1 - np.log10(spacing)).astype(np.int64) + 1, 17)
    scale = p0 - 1 - exp10
    sure = (scale >= 0) & (scale < len(_POW10_LONG))
    scale = np.where(sure, scale, 0)
    y = x.astype(np.longdouble) * _POW10_LONG[scale]
    sure &= (y >= 2.0 ** 20) & (y < 2.0 ** 62)
    whole = np.minimum(y, 2.0 ** 62).astype(np.int64)
    fraction = (y - whole).astype(np.float64)       # exact: a multiple of y's spacing, >= 2**-43
    h = spacing * 0.5 * _POW10_FLOAT[scale]
    err = y.astype(np.float64) * 2.0 ** -63 + 1e-12
    rests = [(whole % 10 ** j).astype(np.float64) + fraction for j in range(4)]     # y mod 10**j, exact
    k = np.full(len(x), -1)                         # the largest k so far whose multiple is within h
    for j, rest in enumerate(rests):
        gap = np.minimum(rest, 10 ** j - rest)      # to the nearest multiple of 10**j
        sure &= (k != j - 1) | (np.abs(gap - h) > err)
        k = np.where((k == j - 1) & (gap < h), j, k)
    sure &= (k >= 0) & (k < 3)                      # p0 digits do; 3 fewer do not
    k = np.minimum(np.maximum(k, 0), 2)             # (np.clip costs ~10 us a call more)
    rest, half = np.choose(k, rests[:3]), _POW10[k] / 2
    sure &= np.abs(rest - half) > err               # which way to round is certain
    digits = whole // _POW10[k] + (rest > half)
    ndigits = np.maximum(p0 - k, 1)                 # p0 <= 17
    sure &= (digits >= _POW10[ndigits - 1]) & (digits < _POW10[ndigits])
    return digits, ndigits, exp10, sure


def _extended_works() -> bool:
    """Whether long doubles have their 64-bit significand now (a library may have set the
    x87 unit to round to 53 bits)."""
    one = np.ones(1, np.longdouble)
    return bool(_EXTENDED and (one + np.longdouble(2.0) ** -63 != one)[0])


def _words(v: np.ndarray) -> int:
    """How many 4-digit words the largest of non-negative ints v takes."""
    return max(1, -(-len(str(int(v.max(initial=0)))) // 4))


def _whole(v: np.ndarray, out: np.ndarray) -> None:
    """Non-negative ints in decimal, right-aligned in `out`'s words."""
    for at in range(out.shape[1] - 1, -1, -1):
        v, low = np.divmod(v, 10000)
        first = _LAST_QUADS if at == out.shape[1] - 1 else _LEADING_QUADS
        out[:, at] = np.where(v > 0, _QUADS[low], first[low])


def _fraction(v: np.ndarray, length: np.ndarray, out: np.ndarray) -> None:
    """Non-negative ints v < 10**length as `length` digits (leading zeros kept), right-aligned
    in `out`'s words."""
    words = out.shape[1]
    for at in range(words - 1, -1, -1):
        v, low = np.divmod(v, 10000)
        shown = np.minimum(np.maximum(length - 4 * (words - 1 - at), 0), 4)
        out[:, at] = _QUADS[low] & _KEEP[shown]


def _with_python_text(cells: np.ndarray, values: np.ndarray, rows: np.ndarray, text: Callable) -> np.ndarray:
    """`cells` (widened if need be) holding text(value) in `rows` (a mask)."""
    rows = np.flatnonzero(rows)
    words = np.array([text(v) for v in values[rows].tolist()], dtype=np.bytes_)
    if words.dtype.itemsize > cells.shape[1]:
        cells = np.concatenate([cells, np.zeros((len(cells), words.dtype.itemsize - cells.shape[1]), np.uint8)],
                               axis=1)
    cells[rows] = np.frombuffer(words.astype(f"S{cells.shape[1]}").tobytes(), np.uint8).reshape(len(rows), -1)
    return cells
