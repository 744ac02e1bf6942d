"""Fit batch-time models to a measured step log (`kvsched calibrate`, docs/calibration.md).

A step log is a CSV with one row per engine step (kvsched's vLLM adapter writes it,
`KVSCHED_STEP_LOG`): the step's `BatchShape` and its measured `seconds`. Each model is fitted
by least squares on the relative residuals (predicted - measured) / measured, the error it is
scored by; every fit is deterministic.

    phase     exclusive-batching-eb.txt sections 3.1 and 3.5, appendix A.3-A.4 (`fit_phase`)
    linear    fluid-wait-nested-wait.txt eq. (1) (`fit_linear`)
    roofline  the catalogue roofline of `RooflineCost` (`fit_roofline`; needs a model and GPU)
    tiled     rad-slai.txt eq. (7) (`fit_tiled`; needs a model and GPU)

Each fitted model is scored by the per-step relative error |predicted - measured| / measured,
median and p90 per batch kind and over all steps, with predictions from the model's own
`time()` on each step's shape (what the simulator computes).

Speculative steps (docs/speculative-decoding.md): a verifying decoder is a prefill-like chunk
of 1 + s tokens in the step's shape, and the optional column `draft_passes` gives the drafter's
passes after the step (its k; 0 or absent without speculation). Each pass costs e0 plus e1 per
token it runs, the first over the step's tokens and the others over one token per request. Each
model is fitted with its drafter by alternating least squares (`fit_with_drafter`): the drafter
starts from a joint fit with the linear model (`fit_drafter`), the model is fitted to the steps
less the drafter's time, the drafter to the steps less the model's, until neither moves. The
model is scored on the sum, and its cost file carries `"drafter": {"e0", "e1"}`, which `--spec`
then uses in place of the roofline's drafter (cost/spec_cost.py, `DrafterLine`).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kvsched.cost import CATALOGUE_MODELS, COST_FILE_KEY, COST_FILE_VERSION, COST_MODELS
from kvsched.cost.roofline import RooflineCost
from kvsched.cost.shape import BatchShape
from kvsched.cost.tiled import TiledCost
from kvsched.errors import KvschedError
from kvsched.files import atomic_file
from kvsched.hardware import GPU, Model
from kvsched.params import build

STEP_LOG_HEADER = ["step", "prefill_tokens", "prefill_chunks", "prefill_attn", "prefill_ctx", "decodes",
                   "decode_context", "chunks", "kv_used_blocks", "planned_tokens", "tokens", "seconds"]
# the columns the fits read; the others (step, kv_used_blocks, planned_tokens, tokens) and any
# extra columns are informational: neither required nor checked
NUMERIC = ("prefill_tokens", "prefill_chunks", "prefill_attn", "prefill_ctx", "decodes", "decode_context",
           "seconds")
REQUIRED = (*NUMERIC, "chunks")
DRAFT_PASSES = "draft_passes"                    # optional: the drafter's passes after the step (speculation)
MODELS = ("phase", "linear", "roofline", "tiled")
COUNTS = ("prefill_tokens", "prefill_chunks", "prefill_ctx", "decodes", "decode_context", "draft_passes")
MIN_SECONDS = 1e-9                               # below a clock's resolution: not a measured step
NEEDS_HARDWARE = "needs --model and --gpu"
EFFICIENCY_FLOOR = 1e-4                          # roofline efficiencies are fitted in [1e-4, 1]


# -- the step log ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepLog:
    """A step log's rows as arrays (one entry per step); `line` is each row's line in the file."""
    path: str
    line: np.ndarray
    prefill_tokens: np.ndarray
    prefill_chunks: np.ndarray
    prefill_attn: np.ndarray
    prefill_ctx: np.ndarray
    decodes: np.ndarray
    decode_ctx: np.ndarray
    seconds: np.ndarray
    chunks: tuple[tuple[tuple[int, int], ...], ...]
    sha256: str = ""
    draft_passes: np.ndarray | None = None          # None: no speculative steps (the column absent or all 0)

    def __len__(self) -> int:
        return len(self.seconds)

    def masks(self) -> dict[str, np.ndarray]:
        """Boolean masks of the batch kinds: prefill-only (no decodes), decode-only (no
        prefill tokens), mixed (both)."""
        p, n = self.prefill_tokens > 0, self.decodes > 0
        return {"prefill": p & ~n, "decode": n & ~p, "mixed": p & n}

    def counts(self) -> dict[str, int]:
        return {kind: int(m.sum()) for kind, m in self.masks().items()}

    def shapes(self) -> BatchShape:
        """All steps as one BatchShape of arrays (aggregates only, no chunks)."""
        return BatchShape(self.prefill_tokens, self.prefill_chunks, self.prefill_attn, self.prefill_ctx,
                          self.decodes, self.decode_ctx)

    def shape(self, i: int) -> BatchShape:
        """Step i as the simulator builds it: plain numbers and its chunks."""
        return BatchShape(float(self.prefill_tokens[i]), float(self.prefill_chunks[i]), float(self.prefill_attn[i]),
                          float(self.prefill_ctx[i]), float(self.decodes[i]), float(self.decode_ctx[i]),
                          list(self.chunks[i]))

    def tail(self, skip: int) -> "StepLog":
        """The log without its first `skip` steps (warm-up)."""
        if skip < 0:
            raise KvschedError(f"--skip must be >= 0, got {skip}")
        if skip >= len(self):
            raise KvschedError(f"--skip {skip} leaves no steps: {self.path} has {len(self)}")
        arrays = {name: getattr(self, name)[skip:] for name in
                  ("line", "prefill_tokens", "prefill_chunks", "prefill_attn", "prefill_ctx", "decodes",
                   "decode_ctx", "seconds")}
        passes = self.draft_passes[skip:] if self.draft_passes is not None else None
        return StepLog(self.path, chunks=self.chunks[skip:], sha256=self.sha256,
                       draft_passes=passes if passes is not None and passes.any() else None, **arrays)

    def drafter_time(self, e0: float, e1: float) -> np.ndarray:
        """The drafter's seconds per step: passes x e0 + e1 x (the step's tokens + (passes - 1)
        x its requests), 0 where it made no pass."""
        p = self.draft_passes if self.draft_passes is not None else np.zeros(len(self))
        work = np.where(p > 0, self.prefill_tokens + self.decodes + (p - 1) * (self.prefill_chunks + self.decodes), 0)
        return p * e0 + work * e1


def read_step_log(path: str | Path) -> StepLog:
    """Read and check a step log; every problem is a one-line error `FILE:LINE: what`."""
    import hashlib                      # not at import time: `kvsched --help` stays fast
    name = str(path)
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8-sig")
    except FileNotFoundError:
        raise KvschedError(f"{name}: no such step log") from None
    except OSError as exc:
        raise KvschedError(f"{name}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KvschedError(f"{name}: not a text (UTF-8) file") from None
    reader = csv.reader(text.splitlines())
    header = [h.strip() for h in next(reader, [])]
    if not any(header):
        raise KvschedError(f"{name}: empty step log (no header)")
    twice = sorted({c for c in header if c and header.count(c) > 1})
    if twice:
        raise KvschedError(f"{name}:1: column {twice[0]} appears twice")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise KvschedError(f"{name}:1: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                           f"(a step log's header: {','.join(STEP_LOG_HEADER)})")
    col = {c: header.index(c) for c in REQUIRED}
    drafts = header.index(DRAFT_PASSES) if DRAFT_PASSES in header else None
    lines, numbers, chunks, passes = [], [], [], []
    for row in reader:
        if not row:
            continue                                # blank line
        where = f"{name}:{reader.line_num}"
        if len(row) != len(header):
            raise KvschedError(f"{where}: {len(row)} fields, the header has {len(header)}")
        values = {c: _number(where, c, row[col[c]]) for c in NUMERIC}
        pairs = _chunks(where, row[col["chunks"]])
        _check_row(where, values, pairs)
        if drafts is not None:
            passes.append(_number(where, DRAFT_PASSES, row[drafts]))
        lines.append(reader.line_num)
        numbers.append([values[c] for c in NUMERIC])
        chunks.append(pairs)
    if not lines:
        raise KvschedError(f"{name}: empty step log (no steps after the header)")
    a = np.array(numbers, dtype=float).T
    p = np.array(passes, dtype=float) if passes else None
    return StepLog(name, np.array(lines), *a[:6], seconds=a[6], chunks=tuple(chunks),
                   sha256=hashlib.sha256(raw).hexdigest(), draft_passes=p if p is not None and p.any() else None)


def _number(where: str, column: str, text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise KvschedError(f"{where}: {column} is not a number: {text.strip()!r}") from None
    if not math.isfinite(x):
        raise KvschedError(f"{where}: {column} must be finite, got {text.strip()}")
    if x < 0:
        raise KvschedError(f"{where}: {column} must be >= 0, got {x:g}")
    if column == "seconds" and x < MIN_SECONDS:
        raise KvschedError(f"{where}: seconds must be >= {MIN_SECONDS:g} (a step's measured time), got {x:g}")
    if column in COUNTS and x != int(x):
        raise KvschedError(f"{where}: {column} must be a whole number, got {x:g}")
    return x


def _chunks(where: str, text: str) -> tuple[tuple[int, int], ...]:
    """'p:c p:c ...' -> ((p, c), ...): p >= 0 tokens already computed, c >= 1 new."""
    out = []
    for item in text.split():
        p, sep, c = item.partition(":")
        try:
            pair = (int(p), int(c))
        except ValueError:
            pair = None
        if not sep or pair is None or pair[0] < 0 or pair[1] < 1:
            raise KvschedError(f"{where}: chunks: {item!r} is not p:c (whole numbers, p >= 0, c >= 1)")
        out.append(pair)
    return tuple(out)


def _check_row(where: str, v: dict[str, float], pairs: tuple[tuple[int, int], ...]) -> None:
    """A step computes something, and its chunks agree with its prefill aggregates (the fits
    read the aggregates, the tiled fit the chunks: they must describe the same batch), within
    0.5 or 1e-5 relative: a value written with 6 significant digits (`%g`) passes."""
    if v["prefill_tokens"] == 0 and v["decodes"] == 0:
        raise KvschedError(f"{where}: the step computes no tokens (prefill_tokens and decodes are 0)")
    if v["decodes"] == 0 and v["decode_context"] != 0:
        raise KvschedError(f"{where}: decode_context {v['decode_context']:g} with no decodes")
    if v["decode_context"] < v["decodes"]:
        raise KvschedError(f"{where}: decode_context {v['decode_context']:g} is below decodes {v['decodes']:g} "
                           "(each decode's context includes the token it computes)")
    implied = {"prefill_chunks": len(pairs), "prefill_tokens": sum(c for _, c in pairs),
               "prefill_ctx": sum(p + c for p, c in pairs), "prefill_attn": sum(c * (p + (c + 1) / 2) for p, c in pairs)}
    for column, x in implied.items():
        if abs(x - v[column]) > max(0.5, 1e-5 * x):
            raise KvschedError(f"{where}: the chunks give {column} {x:g}, the row says {v[column]:g}")


# -- least squares ---------------------------------------------------------------------------

class CannotFit(KvschedError):
    """A model (or a kind of step) the log does not determine; the message says why."""


@dataclass
class Fit:
    """One fitted model: its cost-file parameters, those that came from a fallback (a kind of
    step missing) and those held fixed, with why; notes; its relative errors per batch kind."""
    cost: str
    params: dict[str, float]
    fallbacks: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    drafter: tuple[float, float] | None = None      # (e0, e1) with speculative steps (`fit_with_drafter`)

    def drafter_params(self) -> dict:
        return {"drafter": dict(zip(("e0", "e1"), self.drafter))} if self.drafter else {}

    def as_dict(self) -> dict:
        return {**self.drafter_params(), "params": self.params, "fallbacks": self.fallbacks, "fixed": self.fixed,
                "notes": self.notes,
                "errors": self.errors}


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin sum ((X b - y) / y)^2 over b >= 0: the relative residuals, the error the fits are
    scored by, so short steps count as much as long ones and a machine's slow outliers pull the
    fit less than absolute residuals would. Bounded-variable least squares (scipy lsq_linear,
    bvls) on the rows divided by y and the columns scaled to max |x| = 1, so coefficients of
    very different magnitudes fit alike."""
    from scipy.optimize import lsq_linear
    Xr = X / y[:, None]
    scale = np.abs(Xr).max(axis=0)
    scale[scale == 0] = 1.0
    res = lsq_linear(Xr / scale, np.ones_like(y), bounds=(0.0, np.inf), method="bvls", tol=1e-14)
    return res.x / scale


def _rank(X: np.ndarray) -> int:
    """Numerical rank of X with its columns scaled to max |x| = 1."""
    if not len(X):
        return 0
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    return int(np.linalg.matrix_rank(X / scale))


def _line(x: np.ndarray, y: np.ndarray, steps: str, what: str) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y against x, or CannotFit when x has fewer than 2 values."""
    distinct = len(np.unique(x))
    if distinct < 2:
        raise CannotFit(f"no {steps}" if len(x) == 0 else f"{steps}: {len(x)}, with {distinct} distinct {what} (need 2)")
    a, b = _nnls(np.column_stack([np.ones_like(x), x]), y)
    return float(a), float(b)


# -- phase (exclusive-batching-eb.txt) ---------------------------------------------------------

def _mixed(p: np.ndarray, n: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """(alpha_mb, c0, c1, c2) of time = alpha_MB + beta_MB(r) T, T = p + n, r = n / T,
    beta_MB(r) = c0 + c1 r + c2 r^2 (exclusive-batching-eb.txt section 3.5; appendix A.3
    eq. 10, A.4), linear in the coefficients. Fitted in beta_MB's Bernstein form
    b0 (1-r)^2 + b_half 2r(1-r) + b1 r^2 (b0 = c0, b_half = c0 + c1/2, b1 = c0 + c1 + c2),
    columns T(1-r)^2 = p^2/T, 2Tr(1-r) = 2pn/T, Tr^2 = n^2/T, with alpha_mb, b0, b_half,
    b1 >= 0: beta_MB(r) >= 0 on all of [0, 1], so every mixed batch takes at least alpha_MB
    (PhaseCost's check, alpha_MB + beta_MB(r) > 0 at r = 0, 1/2, 1, then holds unless all
    are 0). A.3's concave kappa < 0 (c2 < 0) stays free. The bounds are sufficient, not necessary
    (b_half >= -sqrt(b0 b1) is): a valid deep convex dip is fitted by the nearest curve with b_half >= 0."""
    T = p + n
    X = np.column_stack([np.ones_like(T), p * p / T, 2 * p * n / T, n * n / T]) if len(T) else np.empty((0, 4))
    rank = _rank(X)
    if rank < 4:
        raise CannotFit("no mixed steps" if len(T) == 0 else
                        f"mixed steps: {len(T)}, whose tokens and decode shares vary too little to determine "
                        f"alpha_mb, c0, c1, c2 (rank {rank} < 4)")
    amb, b0, bh, b1 = (float(v) for v in _nnls(X, y))
    return amb, b0, 2 * (bh - b0), b0 - 2 * bh + b1


def fit_phase(log: StepLog) -> Fit:
    """PhaseCost's coefficients (exclusive-batching-eb.txt): prefill-only steps give
    T_p = alpha_p + beta_p p and decode-only steps t_d(n) = alpha_d + beta_d n (section 3.1),
    mixed steps alpha_MB + beta_MB(r) T (section 3.5, `_mixed`), each kind on its own steps.
    Fallbacks (`Fit.fallbacks`: coefficient -> how it was obtained), when a kind's steps do not
    determine its coefficients:
      no mixed fit:   one pass doing both, alpha_mb = max(alpha_p, alpha_d), c0 = beta_p,
                      c1 = beta_d - beta_p, c2 = 0, i.e. time = alpha_mb + beta_p p + beta_d n:
                      slopes as appendix A.3's linear interpolation K(r) bar with kappa = 0
                      (eq. 9-11), no interference; the intercept is a conservative choice (A.3
                      would interpolate it too). Positive: alpha_p + beta_p > 0 and alpha_d + beta_d > 0
                      (PhaseCost's check) with p, n >= 1.
      no prefill fit: the mixed fit at r = 0 (T = p): alpha_p = alpha_mb, beta_p = c0.
      no decode fit:  the mixed fit at r = 1 (T = n): alpha_d = alpha_mb, beta_d = c0 + c1 + c2.
    (both >= 0: `_mixed` keeps beta_MB(r) >= 0). Two missing kinds are a CannotFit naming them."""
    m = log.masks()
    p, n, y = log.prefill_tokens, log.decodes, log.seconds
    mp, md, mm = m["prefill"], m["decode"], m["mixed"]
    return _phase_params({
        "prefill": _attempt(_line, p[mp], y[mp], "prefill-only steps", "prefill token counts"),
        "decode": _attempt(_line, n[md], y[md], "decode-only steps", "decode counts"),
        "mixed": _attempt(_mixed, p[mm], n[mm], y[mm])})


def _attempt(fit: Callable[..., tuple], *args: np.ndarray | str) -> tuple | str:
    """fit(*args), or the reason it cannot fit."""
    try:
        return fit(*args)
    except CannotFit as exc:
        return str(exc)


def _phase_params(fits: dict[str, tuple | str]) -> Fit:
    missing = [k for k, f in fits.items() if isinstance(f, str)]
    if len(missing) >= 2:
        raise CannotFit("phase needs two of prefill-only, decode-only and mixed steps: "
                        + "; ".join(fits[k] for k in missing))
    fallbacks: dict[str, str] = {}
    if "mixed" in missing:
        (ap, bp), (ad, bd) = fits["prefill"], fits["decode"]
        why = f"({fits['mixed']})"
        amb, c0, c1, c2 = max(ap, ad), bp, bd - bp, 0.0
        fallbacks = {"alpha_mb": f"max(alpha_p, alpha_d) {why}", "c0": f"beta_p {why}",
                     "c1": f"beta_d - beta_p {why}", "c2": f"0, no interference (kappa = 0) {why}"}
    else:
        amb, c0, c1, c2 = fits["mixed"]
        ap, bp = fits["prefill"] if "prefill" not in missing else (amb, c0)
        ad, bd = fits["decode"] if "decode" not in missing else (amb, c0 + c1 + c2)
        if "prefill" in missing:
            fallbacks.update(alpha_p=f"alpha_mb, the mixed fit at r=0 ({fits['prefill']})",
                             beta_p=f"c0, the mixed fit at r=0 ({fits['prefill']})")
        if "decode" in missing:
            fallbacks.update(alpha_d=f"alpha_mb, the mixed fit at r=1 ({fits['decode']})",
                             beta_d=f"c0 + c1 + c2, the mixed fit at r=1 ({fits['decode']})")
    params = dict(alpha_p=ap, beta_p=bp, alpha_d=ad, beta_d=bd, alpha_mb=amb, c0=c0, c1=c1, c2=c2, switch_s=0.0)
    return Fit("phase", {k: float(v) for k, v in params.items()}, fallbacks,
               {"switch_s": "the paper's linear model has no phase-switch term"})


# -- linear (fluid-wait-nested-wait.txt) -------------------------------------------------------

def fit_linear(log: StepLog) -> Fit:
    """tau = d0 + d1 (prefill tokens + decode context), d0, d1 >= 0, on all steps
    (fluid-wait-nested-wait.txt eq. 1; the log's decode_context is its sum of s_i)."""
    d0, d1 = _line(log.prefill_tokens + log.decode_ctx, log.seconds, "steps", "token counts touched")
    return Fit("linear", {"d0": d0, "d1": d1})


def fit_drafter(log: StepLog) -> tuple[float, float]:
    """The drafter's e0, e1 >= 0 (module docstring), by least squares on the relative residuals
    jointly with the linear model's d0 + d1 (prefill tokens + decode context) for the target:
    tau = d0 + d1 x touched + passes x e0 + e1 x drafted tokens (`StepLog.drafter_time`)."""
    p = log.draft_passes
    work = log.drafter_time(0.0, 1.0)
    X = np.column_stack([np.ones(len(log)), log.prefill_tokens + log.decode_ctx, p, work])
    if _rank(X) < 4:
        raise CannotFit("the drafter's passes and tokens do not vary apart from the step's size: its e0 and e1 "
                        "are not determined (log steps with and without drafts, of several sizes)")
    coef = _nnls(X, log.seconds)
    return float(coef[2]), float(coef[3])


def fit_with_drafter(name: str, log: StepLog, model: Model | None, gpu: GPU | None,
                     rounds: int = 100) -> tuple[Fit, tuple[float, float]]:
    """Model `name` and its drafter, alternately (module docstring): the model on the steps less
    the drafter's time, the drafter (e0, e1 >= 0, least squares relative to each step's measured
    time) on the steps less the model's, from `fit_drafter`'s start, until the relative squared
    error stops falling by 1e-12 (at most `rounds` rounds), or a round's drafter takes a whole
    step (the round before stands); deterministic."""
    from scipy.optimize import lsq_linear
    d = fit_drafter(log)
    X = np.column_stack([log.draft_passes, log.drafter_time(0.0, 1.0)]) / log.seconds[:, None]
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    best, err = None, math.inf
    for _ in range(rounds):
        try:
            fit = _FITTERS[name](without_drafter(log, *d), model, gpu)
            pred = predict(fitted_model(name, fit.params, model, gpu), log)
        except CannotFit:
            if best is None:
                raise
            break                           # this round's drafter leaves the model nothing: the last one stands

        e = float(np.sum(((pred + log.drafter_time(*d) - log.seconds) / log.seconds) ** 2))
        if e > err - 1e-12:
            break
        best, err = (fit, d), e
        res = lsq_linear(X / scale, (log.seconds - pred) / log.seconds, bounds=(0.0, np.inf), method="bvls", tol=1e-14)
        d = tuple(float(x) for x in res.x / scale)
    return best


def without_drafter(log: StepLog, e0: float, e1: float) -> StepLog:
    """The log with the drafter's fitted time taken off every step (what the target took)."""
    rest = log.seconds - log.drafter_time(e0, e1)
    bad = np.flatnonzero(rest < MIN_SECONDS)
    if len(bad):
        raise CannotFit(f"the drafter's fitted time is the whole of the step at {log.path}:{int(log.line[bad[0]])}; "
                        "the target's share cannot be fitted")
    return dataclasses.replace(log, seconds=rest)


# -- roofline ----------------------------------------------------------------------------------

def fit_roofline(log: StepLog, model: Model, gpu: GPU) -> Fit:
    """RooflineCost's overhead >= 0 and compute_efficiency, memory_efficiency in [1e-4, 1]:
    bounded nonlinear least squares (scipy least_squares) from a fixed grid of 9 starts, each
    with the overhead that fits best there; the lowest squared relative error wins (ties: the first).
    The model is the catalogue roofline (roofline.py), not a paper's. An efficiency that no
    step's time depends on (no step bound by it) is left where the fit stopped, and noted."""
    from scipy.optimize import least_squares
    shapes, y = log.shapes(), log.seconds
    ys = float(np.median(y))

    def times(x: np.ndarray) -> np.ndarray:
        return RooflineCost(model, gpu, compute_efficiency=x[1], memory_efficiency=x[2], overhead=x[0]).time(shapes)

    lower, upper = [0.0, EFFICIENCY_FLOOR, EFFICIENCY_FLOOR], [np.inf, 1.0, 1.0]
    best = None
    for ce in (0.2, 0.5, 0.9):
        for me in (0.3, 0.6, 0.9):
            x0 = np.array([max(0.0, float(np.mean(y - times(np.array([0.0, ce, me]))))), ce, me])
            r = least_squares(lambda x: (times(x) - y) / y, x0, bounds=(lower, upper),
                              x_scale=np.array([ys, 0.1, 0.1]), xtol=1e-12, ftol=1e-12, gtol=1e-12)
            best = r if best is None or r.cost < best.cost else best
    overhead, ce, me = (float(v) for v in best.x)
    params = {"compute_efficiency": ce, "memory_efficiency": me, "overhead": overhead}
    return Fit("roofline", params, notes=_roofline_notes(times, best.x))


def _roofline_notes(times: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> list[str]:
    """Which steps each efficiency acts on: a step is compute-bound when a slightly lower
    compute efficiency makes it longer (likewise memory)."""
    base = times(x)
    notes = []
    for k, name in ((1, "compute"), (2, "memory")):
        lower = x.copy()
        lower[k] *= 0.999
        bound = int(np.sum(times(lower) > base))
        if bound == 0:
            notes.append(f"no step is {name}-bound at the fit: {name}_efficiency is not determined by this log")
    return notes


# -- tiled (rad-slai.txt) ----------------------------------------------------------------------

TILED_TERMS = ("lin_tile_s", "nonlin_token_s", "decode_attn_token_s", "pair_tile_s", "overhead")


def fit_tiled(log: StepLog, model: Model, gpu: GPU) -> Fit:
    """TiledCost's coefficients that enter linearly, by non-negative least squares: rad-slai.txt
    eq. (7), T = lin_tile_s ceil(tau/t_col) (eq. 4) + nonlin_token_s tau (section 3.2.3)
    + decode_attn_token_s N sum_j i_j (eq. 5 without ceilings) + pair_tile_s N sum_chunks
    tile products (eq. 6), plus overhead; features from `TiledCost.components` on each step's
    exact chunks (tiles 128 x 128 x 64, TiledCost's defaults). weight_floor stays 0 (max(.,
    floor) is not linear). A term no step has (no decodes, no prefill) is not fitted:
    decode_attn_token_s is then the catalogue's KV read time and pair_tile_s 0 (fallbacks)."""
    try:
        unit = TiledCost(model, gpu, lin_tile_s=1.0)
    except ValueError as exc:
        raise CannotFit(f"tiled: {exc}") from None
    F = np.array([unit.components(log.shape(i)) for i in range(len(log))], dtype=float)
    X = np.column_stack([F, np.ones(len(log))])
    params = dict.fromkeys(TILED_TERMS, 0.0)
    fallbacks = {}
    if not X[:, 2].any():
        params["decode_attn_token_s"] = float(unit.decode_attn_token_s)
        fallbacks["decode_attn_token_s"] = "the catalogue's KV read time per token per layer (no decode steps)"
    if not X[:, 3].any():
        fallbacks["pair_tile_s"] = "0 (no prefill chunks)"
    free = [k for k in range(len(TILED_TERMS)) if TILED_TERMS[k] not in fallbacks]
    coef = _nnls(X[:, free], log.seconds)      # the columns left out are all 0
    params.update({TILED_TERMS[k]: float(v) for k, v in zip(free, coef)})
    notes = []
    if _rank(X[:, free]) < len(free):
        notes.append("the log does not separate all of " + ", ".join(TILED_TERMS[k] for k in free)
                     + ": the fit is one of equally good splits (predictions for batches like these agree)")
    params.update(t_row=unit.t_row, t_col=unit.t_col, t_red=unit.t_red, weight_floor=0.0)
    fixed = {**{k: "TiledCost's default tile" for k in ("t_row", "t_col", "t_red")},
             "weight_floor": "max(., floor) is not linear"}
    return Fit("tiled", params, fallbacks, fixed, notes)


# -- all of it ---------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Every requested model fitted to one log, or skipped with the reason."""
    log: StepLog
    skip: int
    model: str | None
    gpu: str | None
    fits: dict[str, Fit] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def free_parameters(self, name: str) -> int:
        """Parameters of fitted model `name` not held fixed."""
        return len(self.fits[name].params) - len(self.fits[name].fixed)

    def too_few_steps(self, name: str) -> str | None:
        """Why fitted model `name`'s fit is not checked by the log, or None: with no more steps
        than free parameters any log fits exactly (its errors are 0 whatever the model)."""
        n, k = len(self.log), self.free_parameters(name)
        if n > k:
            return None
        return f"{n} steps for {k} parameters, needs at least {k + 1} (with fewer any log fits exactly)"

    def best(self) -> str | None:
        """The fitted model with the lowest median relative error over all steps (the first on
        ties), among those with more steps than parameters (`too_few_steps`)."""
        ok = [k for k in self.fits if self.too_few_steps(k) is None]
        return min(ok, key=lambda k: self.fits[k].errors["all"]["median"], default=None)

    def why_no_best(self) -> str:
        """Why no model can be chosen (`best` is None): the log's steps per kind and, per model,
        why it was skipped or how many steps it needs."""
        n, kinds = len(self.log), self.log.counts()
        why = {**self.skipped, **{k: self.too_few_steps(k) for k in self.fits}}
        return (f"no model could be fitted to {self.log.path}: {n} step{'s' if n != 1 else ''} "
                f"({kinds['prefill']} prefill-only, {kinds['decode']} decode-only, {kinds['mixed']} mixed); "
                + "; ".join(f"{k}: {why[k]}" for k in sorted(why, key=MODELS.index)))

    def provenance(self) -> dict:
        return {"source": self.log.path, "source_sha256": self.log.sha256, "skipped_steps": self.skip,
                "steps": len(self.log), "kinds": self.log.counts(), "fitted_by": "kvsched calibrate",
                "kvsched_version": _version()}

    def as_dict(self) -> dict:
        return {**self.provenance(), "model": self.model, "gpu": self.gpu, "best": self.best(),
                "models": {**{k: f.as_dict() for k, f in self.fits.items()},
                           **{k: {"skipped": why} for k, why in self.skipped.items()}}}

    def cost_file(self, name: str) -> dict:
        """The cost file of fitted model `name` (docs/calibration.md, "The cost file")."""
        fit = self.fits[name]
        return {COST_FILE_KEY: COST_FILE_VERSION, "cost": fit.cost, "params": fit.params, **fit.drafter_params(),
                "model": self.model, "gpu": self.gpu,
                "provenance": {**self.provenance(), "fallbacks": fit.fallbacks, "fixed": fit.fixed, "notes": fit.notes},
                "errors": fit.errors}


def _version() -> str:
    from kvsched import __version__
    return __version__


def calibrate(log: StepLog, models: Sequence[str] = MODELS, model: Model | None = None, gpu: GPU | None = None,
              skip: int = 0) -> Calibration:
    """Fit `models` to `log` (already without its `skip` warm-up steps, recorded only). roofline
    and tiled need `model` and `gpu`; a model the log does not determine is skipped with why."""
    cal = Calibration(log, skip, model.name if model else None, gpu.name if gpu else None)
    for name in models:
        if name not in MODELS:
            raise KvschedError(f"cannot calibrate {name!r}; models: {', '.join(MODELS)}")
        if name in ("roofline", "tiled") and (model is None or gpu is None):
            cal.skipped[name] = NEEDS_HARDWARE
            continue
        try:
            if log.draft_passes is None:
                fit = _FITTERS[name](log, model, gpu)
                extra = 0.0
            else:                           # speculative steps: the model with its drafter
                fit, fit.drafter = fit_with_drafter(name, log, model, gpu)
                extra = log.drafter_time(*fit.drafter)
            fit.errors = relative_errors(predict(fitted_model(name, fit.params, model, gpu), log) + extra, log)
        except CannotFit as exc:
            cal.skipped[name] = str(exc)
            continue
        cal.fits[name] = fit
    return cal


_FITTERS: dict[str, Callable] = {
    "phase": lambda log, model, gpu: fit_phase(log),
    "linear": lambda log, model, gpu: fit_linear(log),
    "roofline": fit_roofline,
    "tiled": fit_tiled,
}


def fitted_model(name: str, params: dict[str, float], model: Model | None, gpu: GPU | None):
    """The cost model of fitted `params`, built and checked as a cost file's are
    (`kvsched.cost.make_cost_model`); parameters the model refuses are a CannotFit."""
    cls = COST_MODELS[name]
    context = {"model": model, "gpu": gpu} if cls in CATALOGUE_MODELS else {}
    try:
        return build(cls, f"fitted {name} model", {}, {**params, **context})
    except KvschedError as exc:
        raise CannotFit(str(exc)) from None


def predict(cost, log: StepLog) -> np.ndarray:
    """The model's time for every step, from each step's own shape (with its chunks)."""
    return np.array([cost.time(log.shape(i)) for i in range(len(log))], dtype=float)


def relative_errors(pred: np.ndarray, log: StepLog) -> dict[str, dict[str, float | int | None]]:
    """|pred - measured| / measured: steps, median and p90 per batch kind and over all steps."""
    err = np.abs(pred - log.seconds) / log.seconds
    out = {}
    for kind, mask in (*log.masks().items(), ("all", np.ones(len(log), dtype=bool))):
        e = err[mask]
        out[kind] = {"steps": int(mask.sum()),
                     "median": float(np.median(e)) if len(e) else None,
                     "p90": float(np.percentile(e, 90)) if len(e) else None}
    return out


def write_cost_file(path: str | Path, payload: dict) -> None:
    """Write JSON `payload` to `path` atomically: a temporary file beside it, then a rename,
    so `path` is either untouched or complete."""
    path = Path(path)
    text = json.dumps(payload, indent=2, allow_nan=False) + "\n"
    with atomic_file(path) as f:
        f.write(text)


__all__ = ["STEP_LOG_HEADER", "MODELS", "StepLog", "read_step_log", "Calibration", "Fit", "calibrate",
           "fit_phase", "fit_linear", "fit_roofline", "fit_tiled", "fitted_model", "predict", "relative_errors",
           "write_cost_file", "CannotFit"]
