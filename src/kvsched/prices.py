"""Prices per GPU-hour for `kvsched capacity --candidate` (issue "Today's deployments", item 7):
the bundled table (data/prices.toml, with its source and date) or a user's file of the same form,
whose entries replace the bundled ones."""
from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from kvsched.errors import KvschedError
from kvsched.hardware import DATA

BUNDLED = DATA / "prices.toml"


def read_prices(path: str | Path | None = None) -> dict[str, Any]:
    """{"source", "date", "per_gpu_hour": {gpu: USD}}: the bundled table, updated by `path`'s."""
    table = _read(BUNDLED)
    if path is not None:
        mine = _read(Path(path))
        table = {"source": mine.get("source", str(path)), "date": mine.get("date", ""),
                 "per_gpu_hour": {**table["per_gpu_hour"], **mine["per_gpu_hour"]}}
    return table


def _read(p: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvschedError(f"--prices {p}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KvschedError(f"{p}: not a TOML price table: {exc}") from None
    prices = data.get("per_gpu_hour")
    if not isinstance(prices, dict) or not prices:
        raise KvschedError(f"{p}: needs a [per_gpu_hour] table of GPU = USD per GPU-hour")
    for gpu, usd in prices.items():
        if isinstance(usd, bool) or not isinstance(usd, (int, float)) or not (math.isfinite(usd) and 0 < usd <= 1e6):
            raise KvschedError(f"{p}: per_gpu_hour.{gpu} must be a positive number of USD up to 1e6, got {usd!r}")
    unknown = set(data) - {"source", "date", "per_gpu_hour"}
    if unknown:
        raise KvschedError(f"{p}: unknown key {sorted(unknown)[0]!r}; keys: source, date, per_gpu_hour")
    return {"source": str(data.get("source", p)), "date": str(data.get("date", "")),
            "per_gpu_hour": {k.lower(): float(v) for k, v in prices.items()}}


def price_of(table: dict[str, Any], gpu: str) -> float:
    try:
        return table["per_gpu_hour"][gpu]
    except KeyError:
        raise KvschedError(f"no price per GPU-hour for {gpu}: add it with --prices FILE "
                           f"([per_gpu_hour] {gpu} = USD)") from None
