"""What each request asks for besides its lengths: a LoRA adapter (`--adapters N[:zipf=S]`)
and a base model (`--model-mix NAME:SHARE,...`), drawn per request after the workload is
built (docs/control-plane.md, "LoRA adapters and several models").

Adapters: request i takes adapter k in 0..N-1 with probability (k+1)^-S / H(N, S) (a Zipf
law, S = 1 by default: the popularity skew of S-LoRA's and dLoRA's adapter workloads), a
share `none=F` of requests taking no adapter (the base model). Models: each request's
model is drawn by the shares. Both are drawn from their own random stream of the workload's
seed, so tagging leaves arrivals and lengths as they were.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.request import Workload

MAX_ADAPTERS = 1 << 20
ADAPTER_STREAM, MODEL_STREAM = 351, 352        # the tags' own random streams (of the workload's seed)


def parse_adapters(text: str) -> tuple[int, float, float]:
    """'N[:zipf=S][:none=F]' -> (N, S, F)."""
    head, *opts = str(text).split(":")
    if not (head.isascii() and head.isdigit()) or not 1 <= int(head) <= MAX_ADAPTERS:
        raise KvschedError(f"--adapters {text!r}: N must be a whole number of adapters in 1..{MAX_ADAPTERS}")
    got = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if k not in ("zipf", "none") or not eq or k in got:
            raise KvschedError(f"--adapters {text!r}: write N[:zipf=S][:none=F]")
        try:
            got[k] = float(v)
        except ValueError:
            raise KvschedError(f"--adapters {text!r}: {k}={v!r} is not a number") from None
    s, none = got.get("zipf", 1.0), got.get("none", 0.0)
    if not (math.isfinite(s) and s >= 0):
        raise KvschedError(f"--adapters {text!r}: zipf must be a finite number >= 0, got {s}")
    if not 0 <= none < 1:
        raise KvschedError(f"--adapters {text!r}: none (the share without an adapter) must be in [0, 1), got {none}")
    return int(head), s, none


def parse_model_mix(text: str) -> tuple[tuple[str, ...], np.ndarray]:
    """'NAME:SHARE,...' -> (names, shares normalised to 1)."""
    names, shares = [], []
    for part in str(text).split(","):
        name, colon, share = part.strip().rpartition(":")
        try:
            x = float(share)
        except ValueError:
            x = math.nan
        if not colon or not name or not (math.isfinite(x) and x > 0):
            raise KvschedError(f"--model-mix {text!r}: write NAME:SHARE,... with shares > 0")
        if name in names:
            raise KvschedError(f"--model-mix {text!r}: {name} given twice")
        names.append(name)
        shares.append(x)
    p = np.array(shares) / max(shares)          # first to 1 at most: huge shares do not overflow
    return tuple(names), p / p.sum()


def tag(w: Workload, seed: int, adapters: str | None, model_mix: str | None) -> Workload:
    """The workload with each request's adapter and model drawn (the flags' forms above)."""
    changes = {}
    n = len(w)
    if adapters is not None:
        count, s, none = parse_adapters(adapters)
        rng = np.random.default_rng([seed, ADAPTER_STREAM])
        p = np.arange(1, count + 1, dtype=np.float64) ** -s
        a = rng.choice(count, size=n, p=p / p.sum()).astype(np.int32)
        if none:
            a[rng.random(n) < none] = -1
        changes["adapter"] = a
    if model_mix is not None:
        names, p = parse_model_mix(model_mix)
        rng = np.random.default_rng([seed, MODEL_STREAM])
        changes["model_index"] = rng.choice(len(names), size=n, p=p).astype(np.int16)
        changes["models"] = names
    return dataclasses.replace(w, **changes) if changes else w
