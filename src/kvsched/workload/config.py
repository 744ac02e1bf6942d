"""Workload descriptions: TOML workload files, and the `--phase` / `--tier` strings of the CLI.
The file format is documented in docs/workloads.md; an example:

    name = "shift"
    seed = 1
    [[tiers]]
    name = "paying"
    share = 0.05
    tbt_slo = 0.1
    priority = 0
    [[tiers]]
    name = "free"
    share = 0.95
    tbt_slo = 0.5
    priority = 1
    [[phases]]
    requests = 2000
    prompt = "jitter:1024"
    output = "jitter:128"
    arrivals = "closed:2048"
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import Replay, parse_arrivals
from kvsched.workload.bundled import find_trace
from kvsched.workload.lengths import parse_length
from kvsched.workload.readers import FORMATS
from kvsched.workload.request import Tier
from kvsched.workload.sharing import parse_sessions, parse_shared_prefix
from kvsched.workload.spec import Phase, RequestType, TierShare, WorkloadSpec

PHASE_KEYS = ("name", "requests", "prompt", "output", "types", "trace", "format", "window", "arrivals",
              "spread", "sample", "shared_prefix", "sessions")
TOP_KEYS = ("name", "seed", "output_known", "cap_len", "keep_hashes", "tiers", "phases")
TIER_KEYS = ("name", "share", "ttft_slo", "tbt_slo", "priority")
TYPE_KEYS = ("prompt", "output", "rate")


def _unknown(where: str, table: dict, known: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            raise KvschedError(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")


def _number(where: str, key: str, value: Any, kind=float, low: float = 0.0, strict: bool = False):
    """A number from TOML (typed) or from a CLI string."""
    what = "an integer" if kind is int else "a number"
    try:
        x = kind(value) if isinstance(value, str) else value
    except ValueError:
        raise KvschedError(f"{where}: {key} must be {what}, got {value!r}") from None
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (x > low if strict else x >= low)
    if not ok or (kind is int and x != int(x)):
        raise KvschedError(f"{where}: {key} must be {what} {'>' if strict else '>='} {low:g}, got {value!r}")
    return kind(x)


def _text(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise KvschedError(f"{where}: {key} must be a string, got {value!r}")
    return value


def parse_window(where: str, value: Any) -> tuple[float, float]:
    parts = value.split(":") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        raise KvschedError(f"{where}: window is START:END seconds (a file: [start, end]), got {value!r}")
    start, end = (_number(where, "window", p) for p in parts)
    if not end > start:
        raise KvschedError(f"{where}: window end must be after its start, got {value!r}")
    return start, end


def parse_phase(where: str, table: dict, base: Path | None = None) -> Phase:
    """One phase from a TOML table or a dict of CLI strings; trace paths are relative to `base`."""
    _unknown(where, table, PHASE_KEYS)
    requests = _number(where, "requests", table["requests"], int, 1) if "requests" in table else None
    types: tuple[RequestType, ...] = ()
    if "prompt" in table or "output" in table:
        if "types" in table or not ("prompt" in table and "output" in table):
            raise KvschedError(f"{where}: give prompt and output together, or a list of types")
        types = (RequestType(parse_length(_text(where, "prompt", table["prompt"])),
                             parse_length(_text(where, "output", table["output"]))),)
    elif "types" in table:
        if not isinstance(table["types"], list) or not table["types"]:
            raise KvschedError(f"{where}: types must be a list of tables with prompt, output, rate")
        types = tuple(_type(f"{where}, type {j + 1}", t) for j, t in enumerate(table["types"]))
    trace = None
    if "trace" in table:
        text = _text(where, "trace", table["trace"])
        try:            # a path relative to the file, else a name ($KVSCHED_TRACES, the bundled traces)
            trace = find_trace(text, base)
        except KvschedError as exc:
            raise KvschedError(f"{where}: {exc}") from None
    fmt = _text(where, "format", table.get("format", "auto"))
    if fmt not in FORMATS:
        raise KvschedError(f"{where}: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    arrivals = parse_arrivals(_text(where, "arrivals", table["arrivals"])) if "arrivals" in table else None
    if "spread" in table:
        arrivals = with_spread(where, arrivals, _number(where, "spread", table["spread"]))
    window = parse_window(where, table["window"]) if "window" in table else None
    sample = table.get("sample", False)
    if isinstance(sample, str) and sample in ("true", "false"):
        sample = sample == "true"
    if not (isinstance(sample, bool) or sample == "permutation"):
        raise KvschedError(f"{where}: sample must be true (rows with replacement), false (the first rows) or "
                           f"\"permutation\" (rows without replacement, shuffled by the seed), got {sample!r}")
    try:
        shared = parse_shared_prefix(table["shared_prefix"]) if "shared_prefix" in table else ()
        sessions = parse_sessions(table["sessions"]) if "sessions" in table else None
    except KvschedError as exc:
        raise KvschedError(f"{where}: {exc}") from None
    return Phase(requests, types, trace, fmt, window, arrivals, str(table.get("name", "")), sample,
                 shared_prefix=shared, sessions=sessions)


def with_spread(where: str, arrivals, spread: float):
    if arrivals is not None and not isinstance(arrivals, Replay):
        raise KvschedError(f"{where}: spread applies to replayed trace times, not to {arrivals}")
    return replace(arrivals or Replay(), spread=spread)


def _type(where: str, table: Any) -> RequestType:
    if not isinstance(table, dict):
        raise KvschedError(f"{where}: must be a table with prompt, output, rate")
    _unknown(where, table, TYPE_KEYS)
    if "prompt" not in table or "output" not in table:
        raise KvschedError(f"{where}: needs prompt and output")
    return RequestType(parse_length(_text(where, "prompt", table["prompt"])),
                       parse_length(_text(where, "output", table["output"])),
                       _number(where, "rate", table.get("rate", 1.0), strict=True))


def parse_tier(where: str, table: dict) -> TierShare:
    _unknown(where, table, TIER_KEYS)
    if "name" not in table:
        raise KvschedError(f"{where}: a tier needs a name")
    slo = {k: _number(where, k, table[k], strict=True) for k in ("ttft_slo", "tbt_slo") if k in table}
    share = _number(where, "share", table["share"]) if "share" in table else None
    if share is not None and share > 1:
        raise KvschedError(f"{where}: share must be in [0, 1], got {share:g}")
    priority = int(_number(where, "priority", table.get("priority", 0), int, -10**6))
    return TierShare(Tier(_text(where, "name", table["name"]), slo.get("ttft_slo"), slo.get("tbt_slo"), priority), share)


def load_workload_file(path: str | Path) -> WorkloadSpec:
    """A TOML workload file -> spec. Without [[phases]], the top level is the one phase."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvschedError(f"cannot read workload file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise KvschedError(f"{path}: not a valid TOML workload file: {exc}") from None
    phase_tables = data.get("phases")
    if phase_tables is None:                # the single-phase shorthand
        _unknown(str(path), data, TOP_KEYS + PHASE_KEYS)
        phase_tables = [{k: v for k, v in data.items() if k in PHASE_KEYS and k != "name"}]
    else:
        _unknown(str(path), data, TOP_KEYS)
    if not isinstance(phase_tables, list) or not all(isinstance(t, dict) for t in phase_tables):
        raise KvschedError(f"{path}: phases must be an array of tables ([[phases]])")
    phases = tuple(parse_phase(f"{path}: phase {k + 1}", t, path.parent) for k, t in enumerate(phase_tables))
    tiers = data.get("tiers", [])
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise KvschedError(f"{path}: tiers must be an array of tables ([[tiers]])")
    for flag in ("output_known", "keep_hashes"):
        if not isinstance(data.get(flag, False), bool):
            raise KvschedError(f"{path}: {flag} must be true or false")
    return WorkloadSpec(
        phases, tuple(parse_tier(f"{path}: tier {k + 1}", t) for k, t in enumerate(tiers)),
        seed=_number(str(path), "seed", data.get("seed", 0), int),
        output_known=data.get("output_known", False),
        cap_len=_number(str(path), "cap_len", data["cap_len"], int, 2) if "cap_len" in data else None,
        keep_hashes=data.get("keep_hashes", False), name=_text(str(path), "name", data.get("name", str(path))))


def _pairs(flag: str, text: str, sep: str) -> dict[str, str]:
    out = {}
    for item in text.split(sep):
        if not item.strip():
            continue
        key, eq, value = item.strip().partition("=")
        if not eq or not key:
            raise KvschedError(f"{flag} {text!r}: expected key=value items, got {item!r}")
        out[key] = value
    return out


def parse_phase_flag(text: str, k: int) -> Phase:
    """--phase 'requests=2000 prompt=jitter:1024 output=jitter:128 arrivals=closed:2048'"""
    return parse_phase(f"--phase {k + 1}", _pairs("--phase", text, " "), None)


def parse_tier_flag(text: str) -> TierShare:
    """--tier NAME:SHARE[:ttft=S][:tbt=S][:priority=P] (SLOs in seconds)."""
    name, _, rest = text.partition(":")
    share, _, opts = rest.partition(":")
    if not name or not share:
        raise KvschedError(f"--tier {text!r}: expected NAME:SHARE[:ttft=S][:tbt=S][:priority=P]")
    table: dict[str, Any] = {"name": name, "share": share}
    keys = {"ttft": "ttft_slo", "tbt": "tbt_slo", "priority": "priority"}
    for key, value in _pairs("--tier", opts, ":").items():
        if key not in keys:
            raise KvschedError(f"--tier {text!r}: unknown option {key!r}; use ttft, tbt, priority")
        table[keys[key]] = value
    return parse_tier(f"--tier {text!r}", table)
