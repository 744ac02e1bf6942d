"""`key=value` parameters for policies and cost models (the CLI's --set / --cost-set).

Both are dataclasses; each field may carry `metadata={"help": ...}`. Values arrive as strings
and are converted to the field's type; anything that does not convert is an error naming the
owner, key and value. Nothing is clamped.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from kvsched.errors import KvschedError


def parse_assignments(items: Iterable[str], flag: str) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}; malformed items are errors naming the flag."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise KvschedError(f"{flag} expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _convert(owner: str, key: str, value: Any, kind: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            x = float(value)
            if math.isnan(x):
                raise ValueError
            return x
        if kind.startswith("bool"):
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
    except ValueError:
        raise KvschedError(f"{owner}: {key}={value!r} is not a valid {kind.split(' ')[0]}") from None
    return value


def build(cls: type, owner: str, overrides: dict[str, Any], defaults: dict[str, Any] | None = None):
    """Instantiate dataclass `cls` from defaults overlaid with (string) overrides."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise KvschedError(f"{owner} has no parameter {unknown[0]!r} (parameters: {known})")
    values = dict(defaults or {})
    for key, value in overrides.items():
        kind = fields[key].type if isinstance(fields[key].type, str) else fields[key].type.__name__
        values[key] = _convert(owner, key, value, kind)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise KvschedError(f"{owner}: {exc}") from None


def describe(cls: type) -> list[tuple[str, str, str]]:
    """(name, default, help) for each parameter of a dataclass."""
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "required"
        rows.append((f.name, "auto" if default is None else str(default), f.metadata.get("help", "")))
    return rows

