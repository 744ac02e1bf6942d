"""`key=value` parameters for policies and cost models (the CLI's --set / --cost-set).

Both are dataclasses; each field may carry `metadata={"help": ...}`. Values arrive as strings
and are converted to the field's type; anything that does not convert is an error naming the
owner, key and value. Nothing is clamped.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Iterable

import numpy as np

from kvsched.errors import PASS_THROUGH, KvschedError


def parse_assignments(items: Iterable[str], flag: str) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}; malformed items are errors naming the flag."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise KvschedError(f"{flag} expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def convert(owner: str, key: str, value: Any, kind: str) -> Any:
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


MAX_INT = 2 ** 40


def parse_range(text: str) -> tuple[float, float, bool, bool]:
    """'[1, inf)' -> (1, inf, lower included, upper included)."""
    lo, hi = text[1:-1].split(",")
    return float(lo), float(hi), text[0] == "[", text[-1] == "]"


def check_range(owner: str, key: str, value: Any, kind: str, text: str) -> None:
    """A parameter's value against its type and its range `text` (values finite, ints whole)."""
    if kind.startswith("bool"):
        if not isinstance(value, (bool, np.bool_)):
            raise KvschedError(f"{owner}: {key}={value!r} must be true or false")
        return
    integer = kind.startswith("int")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer) if integer else (int, float, np.number)):
        raise KvschedError(f"{owner}: {key}={value!r} must be {'a whole number' if integer else 'a number'} in {text}")
    lo, hi, lo_in, hi_in = parse_range(text)
    ok = (value > lo or lo_in and value == lo) and (value < hi or hi_in and value == hi)
    if not (ok and math.isfinite(value)) or integer and value > MAX_INT:
        raise KvschedError(f"{owner}: {key}={value!r} is outside its range {text}"
                           + (f" (whole numbers stop at {MAX_INT:,})" if integer and value > MAX_INT else ""))


def _plain(value: Any, kind: str) -> Any:
    """A checked value as a plain Python bool, int or float (numpy scalars would overflow)."""
    if kind.startswith("bool"):
        return bool(value)
    if kind.startswith("int"):
        return int(value)
    return float(value) if kind.startswith("float") else value


def build(cls: type, owner: str, overrides: dict[str, Any], defaults: dict[str, Any] | None = None):
    """Instantiate dataclass `cls` from defaults overlaid with (string) overrides; every
    numeric or boolean field with a `range` in its metadata is checked (type and range)
    before the object is built (a text field's `range` only describes it; the class checks it)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise KvschedError(f"{owner} has no parameter {unknown[0]!r} (parameters: {known})")
    values = dict(defaults or {})
    for key, value in overrides.items():
        values[key] = convert(owner, key, value, _kind(fields[key]))
    for key, f in fields.items():
        text = f.metadata.get("range", "true/false" if _kind(f).startswith("bool") else None)
        value = values.get(key, f.default)
        if text is not None and value is not None and value is not dataclasses.MISSING and not _kind(f).startswith("str"):
            check_range(owner, key, value, _kind(f), text)
            if key in values:
                values[key] = _plain(value, _kind(f))
    try:
        return cls(**values)
    except KvschedError:
        raise
    except PASS_THROUGH:
        raise
    except (TypeError, ValueError) as exc:
        raise KvschedError(f"{owner}: {exc}") from None
    except BaseException as exc:                # a user's class raising anything: named, one line
        raise KvschedError(f"{owner}: {type(exc).__name__}: {exc}") from None


def _kind(f: dataclasses.Field) -> str:
    return type_name(f.type)


def type_name(annotation) -> str:
    """An annotation as the text conversions read ("int", "float | None"...): a string as it is
    (`from __future__ import annotations`), a type's name, and for a union (`float | None`,
    `Optional[float]`) its first member that is not None first."""
    if isinstance(annotation, str):
        return annotation
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(members + (["None"] if type(None) in args else []))
    return getattr(annotation, "__name__", str(annotation))


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, default, range, help) for each parameter of a dataclass (none for another class)."""
    if not dataclasses.is_dataclass(cls):
        return []
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "required"
        rng = f.metadata.get("range", "true/false" if _kind(f).startswith("bool") else "")
        rows.append((f.name, "auto" if default is None else str(default), rng, f.metadata.get("help", "")))
    return rows

