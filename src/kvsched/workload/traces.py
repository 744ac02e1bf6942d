"""Trace readers. Every malformed row is an error naming the file and line; nothing is dropped.

Formats (chosen by the header):
- timed CSV:       arrival_time,prompt_tokens,output_tokens   (seconds; extra columns ignored)
- length-only CSV: num_prefill_tokens,num_decode_tokens,...   (../shared/traces/*-lengths.csv);
                   arrivals come from a Poisson process at `rate`.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import poisson_arrivals
from kvsched.workload.request import Workload

TIMED = ("arrival_time", "prompt_tokens", "output_tokens")
LENGTHS = ("num_prefill_tokens", "num_decode_tokens")


def _read_rows(path: Path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            rows = [(reader.line_num, row) for row in reader if row]
    except OSError as exc:
        raise KvschedError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise KvschedError(f"{path}: not a readable CSV file ({exc})") from None
    if header is None:
        raise KvschedError(f"{path}: empty file")
    return [h.strip() for h in header], rows


def _int(path: Path, line: int, name: str, text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise KvschedError(f"{path}:{line}: {name} {text!r} is not a number") from None
    if not value.is_integer() or value < 1:
        raise KvschedError(f"{path}:{line}: {name} must be an integer >= 1, got {text!r}")
    return int(value)


def _columns(path: Path, header: list[str], rows, names: tuple[str, ...]) -> list[list[str]]:
    idx = [header.index(n) for n in names]
    out = [[] for _ in names]
    width = len(header)
    for line, row in rows:
        if len(row) != width:
            raise KvschedError(f"{path}:{line}: expected {width} fields, got {len(row)}")
        for k, j in enumerate(idx):
            out[k].append((line, row[j].strip()))
    return out


def load_trace(path: str | Path, *, rate: float | None = None, num_requests: int | None = None,
               seed: int = 0) -> Workload:
    """Read a trace. `num_requests` takes the first N rows, or, when N exceeds the rows,
    resamples rows (and, for timed traces, inter-arrival gaps) with replacement, seeded.
    With `rate`, a timed trace's arrivals are replaced by Poisson arrivals at that rate."""
    path = Path(path)
    header, rows = _read_rows(path)
    if not rows:
        raise KvschedError(f"{path}: no requests after the header")
    timed = all(n in header for n in TIMED)
    if not timed and not all(n in header for n in LENGTHS):
        raise KvschedError(f"{path}:1: unknown header {','.join(header)!r}; expected "
                           f"{','.join(TIMED)} or {','.join(LENGTHS)},...")
    names = TIMED if timed else LENGTHS
    cols = _columns(path, header, rows, names)
    prompt = np.array([_int(path, ln, names[-2], t) for ln, t in cols[-2]], np.int64)
    output = np.array([_int(path, ln, names[-1], t) for ln, t in cols[-1]], np.int64)
    arrival = None
    if timed:
        arrival = np.array([_arrival(path, ln, t) for ln, t in cols[0]], np.float64)
    elif rate is None:
        raise KvschedError(f"{path} has no arrival times: give --rate REQ_PER_S")
    if num_requests is not None and num_requests < 1:
        raise KvschedError(f"--num-requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    n = len(prompt) if num_requests is None else num_requests
    ids = np.arange(n, dtype=np.int64)
    if n > len(prompt):
        rows_idx = rng.integers(0, len(prompt), size=n)
        if arrival is not None and rate is None:
            order = np.sort(arrival)
            gaps = np.diff(order) if len(order) > 1 else np.zeros(1)
            arrival = order[0] + np.concatenate(([0.0], np.cumsum(rng.choice(gaps, size=n - 1))))
        prompt, output, ids = prompt[rows_idx], output[rows_idx], rows_idx
    else:
        prompt, output = prompt[:n], output[:n]
        if arrival is not None:
            arrival = arrival[:n]
    if rate is not None:
        arrival = poisson_arrivals(rng, rate, n)
    return Workload.build(arrival, prompt, output, ids=ids, source=str(path))


def _arrival(path: Path, line: int, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KvschedError(f"{path}:{line}: arrival_time {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise KvschedError(f"{path}:{line}: arrival_time must be finite and >= 0, got {text!r}")
    return value
