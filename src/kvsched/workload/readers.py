"""Trace file formats, read row by row into compact arrays (never the whole file as text).

Formats (`--format`, or detected from the first line):
- `azure`:    Azure LLM inference 2023 CSV: TIMESTAMP (YYYY-MM-DD HH:MM:SS.fffffff),
              ContextTokens, GeneratedTokens; CRLF line ends.
- `mooncake`: Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (ids of
              the prompt's 512-token blocks; each full block becomes a shared segment).
- `lengths`:  length-only CSV: num_prefill_tokens, num_decode_tokens, ... (no times).
- `csv`:      generic CSV: arrival_time (s), prompt_tokens, output_tokens[, tier].
- `jsonl`:    generic JSONL with the same keys, and optionally, per row, `segments`: the
              shared content its prompt begins with, [[content_id, tokens], ...] (ids >= 0; what
              `Workload.segments` holds, for prefix caching), and `hash_ids`: Mooncake prefix-block
              ids, kept as `Workload.prefix` (statistics) and not made into segments. `kvsched
              workload export --out NAME.jsonl` writes them, so a re-read workload is the same.
A trace is a path or a bundled trace's name (workload/bundled.py); .gz and .xz files are read
decompressed. Every malformed row is an error naming file:line; no row is skipped (blank lines are not rows).
Times come back in seconds: Azure's relative to the first row, the others as written; with a
time window, relative to the window's start.
"""
from __future__ import annotations

import csv
import functools
import itertools
import json
import math
import re
from array import array
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.bundled import DAMAGED, compressed, find_trace, label, open_trace
from kvsched.workload.lengths import MAX_TOKENS
from kvsched.workload.request import Ragged, Segments

# format -> (columns or keys: time, prompt, output)
COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "lengths": (None, "num_prefill_tokens", "num_decode_tokens"),
    "csv": ("arrival_time", "prompt_tokens", "output_tokens"),
    "jsonl": ("arrival_time", "prompt_tokens", "output_tokens"),
}
FORMATS = tuple(COLUMNS) + ("auto",)
JSON_FORMATS = ("mooncake", "jsonl")
MOONCAKE_BLOCK = 512        # tokens per Mooncake hash_id block
_NO_HASHES: list = []       # a row without hash_ids (read only)
_AZURE_TIME = re.compile(r"(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)(?:\.(\d{1,7}))?\Z")


@dataclass
class TraceRows:
    """What a trace file holds, in file order."""
    path: Path
    format: str
    arrival: np.ndarray | None          # seconds; None for length-only traces
    prompt: np.ndarray
    output: np.ndarray
    tier: list[str] | None              # generic formats' optional tier column
    prefix: Ragged | None               # Mooncake hash_ids, when kept
    rows_in_file: int | None            # None when reading stopped early
    segments: Segments | None = None    # Mooncake's full blocks as shared segments


class _Where:
    """The current file:line, for error messages."""

    def __init__(self, path: Path) -> None:
        self.path, self.line = label(path), 0

    def error(self, message: str) -> KvschedError:
        return KvschedError(f"{self.path}:{self.line}: {message}")


MAX_LINE = 16 * 2 ** 20        # bytes: a longer line is refused (memory stays bounded)


def _lines(f, where: _Where) -> Iterator[str]:
    """Decoded non-blank lines, tracking the line number; a line is read at most MAX_LINE
    bytes at a time, so a file without newlines cannot fill memory."""
    while True:
        try:
            raw = f.readline(MAX_LINE + 1)
        except DAMAGED as exc:          # a damaged .xz/.gz
            raise where.error(f"cannot decompress: {exc or type(exc).__name__}") from None
        if not raw:
            return
        where.line += 1
        if len(raw) > MAX_LINE:
            raise where.error(f"line longer than {MAX_LINE:,} bytes (is this a trace?)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise where.error("not UTF-8 text") from None
        if text.strip():
            yield text


def _drain(f, where: _Where) -> None:
    """Read a decompressed stream to its end, so that damage past the rows read is found."""
    try:
        while f.read(1 << 20):
            pass
    except DAMAGED as exc:
        raise KvschedError(f"{where.path}: cannot decompress: {exc or type(exc).__name__}") from None


def _tokens(where: _Where, name: str, value) -> int:
    if type(value) is str and len(value) < 13 and value.isascii() and value.isdigit() and value[0] != "0":   # the common case, fast
        return int(value)
    if type(value) is int and 1 <= value <= MAX_TOKENS:
        return value
    if isinstance(value, bool):
        raise where.error(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise where.error(f"{name} {value!r} is not a number") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value) or value < 1:
        raise where.error(f"{name} must be an integer >= 1, got {value!r}")
    if value > MAX_TOKENS:
        raise where.error(f"{name} {int(value)} is beyond {MAX_TOKENS:,} tokens")
    return int(value)


def _seconds(where: _Where, name: str, value) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise where.error(f"{name} {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise where.error(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@functools.lru_cache(maxsize=64)
def _day_seconds(date: str) -> int:
    """'YYYY-MM-DD' -> seconds since the epoch at its midnight (ValueError if not a date)."""
    return (datetime.strptime(date, "%Y-%m-%d") - datetime(1970, 1, 1)).days * 86400


def _azure_ticks(where: _Where, text: str) -> int:
    """TIMESTAMP -> 100 ns ticks since the epoch, exactly (Python's %f takes 6 digits only)."""
    m = _AZURE_TIME.match(text.strip())
    try:
        if not m:
            raise ValueError
        clock = m.group(2)
        h, mi, sec = int(clock[0:2]), int(clock[3:5]), int(clock[6:8])
        if h > 23 or mi > 59 or sec > 59:
            raise ValueError
        seconds = _day_seconds(m.group(1)) + h * 3600 + mi * 60 + sec
    except ValueError:
        raise where.error(f"TIMESTAMP {text!r} is not a date and time YYYY-MM-DD HH:MM:SS.fffffff") from None
    return seconds * 10_000_000 + int((m.group(3) or "0").ljust(7, "0"))


def detect_format(path: Path, first_line: str) -> str:
    """Which format a file is in, from its first non-blank line."""
    if first_line.lstrip().startswith("{"):
        try:
            keys = json.loads(first_line)
        except json.JSONDecodeError:
            keys = {}
        return "mooncake" if isinstance(keys, dict) and "input_length" in keys else "jsonl"
    header = [h.strip() for h in next(csv.reader([first_line]))]
    best = max(("azure", "lengths", "csv"), key=lambda f: sum(c in header for c in COLUMNS[f] if c))
    if not any(c in header for c in COLUMNS[best] if c):
        raise KvschedError(
            f"{path}:1: unknown header {first_line.strip()!r}; expected one of: "
            "TIMESTAMP,ContextTokens,GeneratedTokens (Azure 2023) | "
            "num_prefill_tokens,num_decode_tokens,... (length-only) | "
            "arrival_time,prompt_tokens,output_tokens[,tier] (generic); or JSONL")
    return best


class _Collector:
    """Accumulates rows, checks time order, applies a time window and a row limit."""

    def __init__(self, where: _Where, timed: bool, window, limit: int | None, hashes: bool,
                 segments: bool = False) -> None:
        self.where, self.timed, self.window, self.limit = where, timed, window, limit
        self.times, self.prompt, self.output = array("d"), array("q"), array("q")
        self.tiers: list[str] | None = None         # made at the first row with a tier
        self.hashes, self.offsets = (array("q"), array("q", [0])) if hashes else (None, None)
        # generic JSONL: `segments` as (ids, lengths, offsets); whether any row had each key
        self.segments = (array("q"), array("q"), array("q", [0])) if segments else None
        self.saw_hashes = self.saw_segments = False
        self.origin = None
        self.last = -math.inf
        self.rows = 0

    def add(self, t, prompt: int, output: int, tier: str | None = None, hashes=None,
            segments: tuple[list[int], list[int]] | None = None) -> bool:
        """Take one row; False once no later row can be wanted (limit reached, window passed).
        `t` is seconds (float) or Azure ticks (int)."""
        self.rows += 1
        if self.timed:
            if t < self.last:
                raise self.where.error("arrival time goes backwards (rows must be sorted by time)")
            self.last = t
            if self.origin is None:
                self.origin = t
            rel = (t - self.origin) / 1e7 if isinstance(t, int) else t - self.origin
            if self.window is None:
                self.times.append(rel if isinstance(t, int) else t)
            elif rel < self.window[0] or rel >= self.window[1]:
                if hashes:
                    _check_hashes(self.where, hashes)     # checked, though not kept
                return rel < self.window[0]
            else:
                self.times.append(rel - self.window[0])
        self.prompt.append(prompt)
        self.output.append(output)
        if self.tiers is not None:
            self.tiers.append(tier or "")
        elif tier:
            self.tiers = [""] * (len(self.prompt) - 1) + [tier]
        if self.hashes is not None:
            try:
                self.hashes.extend(hashes)
            except (TypeError, OverflowError):
                raise self.where.error(HASH_ERROR) from None
            self.offsets.append(len(self.hashes))
        if self.segments is not None:
            ids, lengths, offsets = self.segments
            if segments is not None:
                ids.extend(segments[0])
                lengths.extend(segments[1])
            offsets.append(len(ids))
        return self.limit is None or len(self.prompt) < self.limit



def read_trace(path: str | Path, *, format: str = "auto", window: tuple[float, float] | None = None,
               first: int | None = None, keep_hashes: bool = False) -> TraceRows:
    """Read a trace, a file or a name (`bundled.find_trace`: $KVSCHED_TRACES, then the bundled
    traces). `window` = (start, end) seconds from the first row keeps rows with start <= t < end,
    re-timed to start at `start`; `first` stops after that many rows."""
    if format not in FORMATS:
        raise KvschedError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    path = find_trace(path)
    where = _Where(path)
    try:
        f = open_trace(path)
    except OSError as exc:
        raise KvschedError(f"cannot read trace {where.path}: {exc.strerror or exc}") from None
    with f:
        lines = _lines(f, where)
        first_line = next(lines, None)
        if first_line is None:
            raise KvschedError(f"{where.path}:1: empty file")
        fmt = detect_format(where.path, first_line) if format == "auto" else format
        if window is not None and fmt == "lengths":
            raise KvschedError(f"{where.path}: a length-only trace has no times, so no time window")
        col = _Collector(where, fmt != "lengths", window, first, fmt in JSON_FORMATS, fmt == "jsonl")
        if fmt in JSON_FORMATS:
            _read_jsonl(first_line, lines, where, fmt, col)
        else:
            _read_csv(first_line, lines, where, fmt, col)
        complete = next(lines, None) is None
        if not complete and compressed(path):       # read to the end: its checksum comes last
            _drain(f, where)
    if not col.rows:
        raise KvschedError(f"{where.path}:{where.line}: no requests in the file")
    if not len(col.prompt):
        raise KvschedError(f"{where.path}: no requests in the time window {window[0]:g}..{window[1]:g} s")
    # the arrays share the collectors' buffers (no copies: a large trace is held once)
    times = np.frombuffer(col.times, np.float64) if fmt != "lengths" else None
    prompt = np.frombuffer(col.prompt, np.int64)
    prefix = segments = None
    if col.hashes is not None and (fmt == "mooncake" or col.saw_hashes):
        hashes = Ragged(np.frombuffer(col.hashes, np.int64), np.frombuffer(col.offsets, np.int64))
        if fmt == "mooncake" and len(col.hashes):
            segments = _block_segments(prompt, hashes)
        prefix = hashes if keep_hashes else None
    if col.saw_segments:
        ids, lengths, offsets = (np.frombuffer(a, np.int64) for a in col.segments)
        segments = Segments(Ragged(ids, offsets), Ragged(lengths, offsets))
    return TraceRows(path, fmt, times, prompt, np.frombuffer(col.output, np.int64), col.tiers,
                     prefix, col.rows if complete else None, segments)


def _block_segments(prompt: np.ndarray, hashes: Ragged) -> Segments:
    """Each row's full 512-token blocks as segments (hash id, 512); a trailing partial block
    is not shared (the request's own tokens), nor is a block beyond the prompt."""
    counts = np.diff(hashes.offsets)
    full = np.minimum(prompt // MOONCAKE_BLOCK, counts)
    drop = counts - full                    # mostly 0 or 1 (the partial block) per row
    ids = hashes.values
    if drop.any():
        rows = np.flatnonzero(drop)
        first = hashes.offsets[rows] + full[rows]
        cut = np.repeat(first - np.cumsum(drop[rows]) + drop[rows], drop[rows])
        keep = np.ones(len(ids), bool)
        keep[cut + np.arange(len(cut))] = False
        ids = ids[keep]
    offsets = np.concatenate(([0], np.cumsum(full))).astype(np.int64)
    return Segments(Ragged(ids, offsets), Ragged(np.full(len(ids), MOONCAKE_BLOCK, np.int64), offsets))


def _read_csv(header_line: str, lines, where: _Where, fmt: str, col: _Collector) -> None:
    header = [h.strip() for h in next(csv.reader([header_line]))]
    names = COLUMNS[fmt]
    missing = [c for c in names if c and c not in header]
    if missing:
        raise KvschedError(f"{where.path}:1: missing column {missing[0]!r} for the {fmt} format "
                           f"(header: {header_line.strip()!r})")
    t_col, p_col, o_col = (header.index(c) if c else None for c in names)
    tier_col = header.index("tier") if fmt == "csv" and "tier" in header else None
    width = len(header)
    for row in _csv_rows(lines, where):
        if len(row) != width:
            raise where.error(f"expected {width} fields ({','.join(header)}), got {len(row)}")
        if t_col is None:
            t = None
        elif fmt == "azure":
            t = _azure_ticks(where, row[t_col])
        else:
            t = _seconds(where, names[0], row[t_col])
        if not col.add(t, _tokens(where, names[1], row[p_col]), _tokens(where, names[2], row[o_col]),
                       row[tier_col].strip() if tier_col is not None else None):
            return


def _csv_rows(lines, where: _Where):
    """csv rows; a malformed row (e.g. a field beyond the csv module's limit) names its line."""
    reader = csv.reader(lines)
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise where.error(f"malformed CSV: {exc}") from None


def _read_jsonl(first_line: str, lines, where: _Where, fmt: str, col: _Collector) -> None:
    names = COLUMNS[fmt]
    scale = 1000.0 if fmt == "mooncake" else 1.0            # Mooncake stamps are in ms
    for text in itertools.chain([first_line], lines):
        obj = _json(where, text)
        if not isinstance(obj, dict):
            raise where.error("each line must be a JSON object")
        for key in names:
            if key not in obj:
                raise where.error(f"missing key {key!r} for the {fmt} format")
        hashes = segments = None
        if fmt == "mooncake":
            hashes = obj.get("hash_ids", _NO_HASHES)
            # every row is checked, so fast: the collector's int64 array refuses floats, strings and
            # values beyond 64 bits; a negative id or a JSON true/false (which Python counts as an
            # integer) can only be there if the line holds '-', 'true' or 'false'
            if type(hashes) is not list or "-" in text or "true" in text or "false" in text:
                _check_hashes(where, hashes)
        else:
            hashes = obj.get("hash_ids", _NO_HASHES)
            if hashes is not _NO_HASHES:
                _check_hashes(where, hashes)
                col.saw_hashes = True
        tier = obj.get("tier") if fmt == "jsonl" else None
        if tier is not None and not isinstance(tier, str):
            raise where.error(f"tier must be a string, got {tier!r}")
        prompt = _tokens(where, names[1], obj[names[1]])
        if fmt == "jsonl" and "segments" in obj:
            segments = _segments(where, obj["segments"], prompt)
            col.saw_segments = True
        if not col.add(_seconds(where, names[0], obj[names[0]]) / scale, prompt,
                       _tokens(where, names[2], obj[names[2]]), tier, hashes, segments):
            return


def _segments(where: _Where, value, prompt: int) -> tuple[list[int], list[int]]:
    """A generic JSONL row's `segments`, [[content_id, tokens], ...], as (ids, lengths): ids are
    64-bit integers >= 0, token counts integers >= 1, together within the prompt."""
    if not isinstance(value, list) or not all(isinstance(x, list) and len(x) == 2 for x in value):
        raise where.error(f"segments must be a list of [content_id, tokens] pairs, got {value!r:.60}")
    ids = [x[0] for x in value]
    _check_hashes(where, ids, "segments content ids", "content")
    lengths = [_tokens(where, "segments tokens", x[1]) for x in value]
    if sum(lengths) > prompt:
        raise where.error(f"segments hold {sum(lengths)} tokens, more than the prompt's {prompt}")
    return ids, lengths


_SCAN = json.JSONDecoder().scan_once     # the C scanner: json.loads without its per-call Python layers
_JSON_SPACE = " \t\n\r"


def _json(where: _Where, text: str):
    """One line's JSON value, as json.loads reads it (surrounding whitespace allowed)."""
    try:
        obj, end = _SCAN(text, len(text) - len(text.lstrip(_JSON_SPACE)))
    except StopIteration:
        raise where.error("not a JSON object (Expecting value; truncated line?)") from None
    except json.JSONDecodeError as exc:
        raise where.error(f"not a JSON object ({exc.msg}; truncated line?)") from None
    if text[end:].strip(_JSON_SPACE):
        raise where.error("not a JSON object (Extra data; truncated line?)")
    return obj


HASH_ERROR = "hash_ids must be a list of 64-bit integers"


def _check_hashes(where: _Where, hashes, what: str = "hash_ids", kind: str = "block") -> None:
    """The exact check of a Mooncake row's hash_ids (or of other content ids): 64-bit integers >= 0."""
    if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                               and -2 ** 63 <= h < 2 ** 63 for h in hashes):
        raise where.error(f"{what} must be a list of 64-bit integers")
    if hashes and min(hashes) < 0:
        raise where.error(f"{what} holds {min(hashes)}; {kind} ids must be >= 0")
