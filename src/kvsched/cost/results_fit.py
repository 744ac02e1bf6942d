"""Fit kvsched's few timing constants to benchmark result files by simulating them
(`kvsched calibrate --bench-serve / --inference-perf`, docs/calibration.md "Calibration
from result files"; issue "Timing fidelity against real vLLM", item 4).

The constants: the roofline's `overhead`, `memory_efficiency` and `compute_efficiency`
(`RooflineCost`, kvsched/cost/roofline.py) and the client path's `front_s` and `output_steps`
(`ClientPath`, kvsched/client.py). Those named in `names` are fitted; the others stay at
their defaults (the GPU file's [roofline], then RooflineCost's; ClientPath's).

Each file's rebuilt run (kvsched/cost/results.py) is simulated with vllm-v1 (`kvsched.run.
simulate`); the fit minimises the sum of squared relative errors (simulated - measured) /
measured of every mean the files hold (TTFT, TPOT, ITL, E2E), with scipy's bounded
trust-region least squares (`least_squares`, trf) on finite differences of 1e-3 of each
constant's unit. The simulation is an event simulation: its means are piecewise smooth in the
constants (a batch's time is smooth, but which requests share a step can change), so the
the cost has small jumps and local minima. The fit first simulates every point of a coarse
grid over each constant's plausible range (GRID), then polishes the NSTART best points with
least squares and keeps the lowest cost (ties: the first). In review, starting from the
defaults alone stopped at 0.9-1.4 ms and 0.54-0.58 on two open-loop files made at 2.5 ms and
0.65; the grid start reaches 2.0 ms and 0.61 (docs/calibration.md, "Its limits").
Deterministic: the same files and options give the same fit, bit for bit.

What the means can tell apart: a run's mean TPOT and ITL are both step time, and mean E2E is
close to TTFT + (output - 1) x TPOT, so one file gives about two independent numbers. Fitting
three constants needs files that load the engine differently (e.g. concurrency 1 and a high
one, or short and long prompts): the notes say when the fit's Jacobian shows that the files
do not separate the constants fitted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvsched.client import DEFAULT as DEFAULT_CLIENT, ClientPath
from kvsched.cost.results import METRICS, MeasuredRun
from kvsched.errors import KvschedError
from kvsched.layout import PLAIN, Layout

ROOFLINE = ("overhead", "memory_efficiency", "compute_efficiency")
CLIENT = ("front_s", "output_steps")
FITTABLE = ROOFLINE + CLIENT
DEFAULT_FIT = ("overhead", "memory_efficiency", "front_s")
# per constant: (unit the fit works in, lower bound, upper bound), in the constant's own units;
# bounds as RooflineCost (efficiencies in (0, 1], overhead >= 0) and ClientPath (0 to 1000) allow
UNITS = {"overhead": (1e-3, 0.0, 1.0), "memory_efficiency": (1.0, 1e-3, 1.0), "compute_efficiency": (1.0, 1e-3, 1.0),
         "front_s": (1e-3, 0.0, 10.0), "output_steps": (1.0, 0.0, 10.0)}
# the coarse grid the fit starts from (module docstring): each constant's plausible range, log-spaced
GRID = {"overhead": (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
        "memory_efficiency": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
        "compute_efficiency": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
        "front_s": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05),
        "output_steps": (0.0, 0.5, 1.0, 2.0)}
NSTART = 3                      # grid points polished by least squares
MAX_GRID = 400                  # grid points simulated at most (about 2 s per two small files)
DIFF_STEP = 1e-3                # finite-difference step, a fraction of each constant's unit


@dataclass(frozen=True)
class Setup:
    """What the measured runs ran on: catalogue model and GPU, layout, vLLM's limits, KV."""
    model: str
    gpu: str
    layout: Layout = PLAIN
    policy_params: dict[str, int] = field(default_factory=dict)   # max_num_seqs, max_num_batched_tokens
    kv_capacity: int | None = None      # tokens; None: vLLM's memory profile (memory_profile.py)
    block_size: int = 16
    memory_utilization: float = 0.9     # the server's --gpu-memory-utilization, for the memory profile

    def describe(self) -> dict[str, Any]:
        from kvsched.layout import layout_summary
        return {"model": self.model, "gpu": self.gpu, "layout": layout_summary(self.layout) if self.layout != PLAIN
                else None, "policy": "vllm-v1", "policy_params": dict(self.policy_params),
                "kv_capacity_tokens": self.kv_capacity, "block_size": self.block_size,
                "memory_utilization": self.memory_utilization}


def defaults(setup: Setup) -> dict[str, float]:
    """Every constant's default for this model, GPU and layout: RooflineCost's resolved fields
    (the GPU file's [roofline], else its generic defaults) and ClientPath's."""
    from kvsched.cost import make_cost_model
    from kvsched.hardware import get_gpu, get_model
    cost = make_cost_model("roofline", {}, get_model(setup.model), get_gpu(setup.gpu), setup.layout)
    return {**{k: float(getattr(cost, k)) for k in ROOFLINE}, **{k: float(getattr(DEFAULT_CLIENT, k)) for k in CLIENT}}


def simulate_run(run: MeasuredRun, setup: Setup, values: dict[str, float]) -> dict[str, float]:
    """The means `run` measured, as kvsched simulates its rebuilt requests with `values` (ms)."""
    from kvsched.run import Scenario, simulate
    client = ClientPath(front_s=values["front_s"], output_steps=values["output_steps"],
                        front_per_prompt_token_s=DEFAULT_CLIENT.front_per_prompt_token_s)
    sc = Scenario(run.workload, model=setup.model, gpu=setup.gpu, cost="roofline",
                  cost_params={k: values[k] for k in ROOFLINE}, kv_capacity=setup.kv_capacity,
                  block_size=setup.block_size, memory_utilization=setup.memory_utilization, layout=setup.layout,
                  client=client)
    summary = simulate(sc, "vllm-v1", dict(setup.policy_params)).summary
    return {k: float(summary[k]) for k in run.measured}


def parse_fit(text: str | None) -> tuple[str, ...]:
    """--fit: comma-separated constants (FITTABLE), each once; None: DEFAULT_FIT."""
    if text is None:
        return DEFAULT_FIT
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in FITTABLE]
    if bad or not names:
        raise KvschedError(f"--fit: unknown constant {bad[0] if bad else text!r}; known: {', '.join(FITTABLE)}")
    return names


@dataclass
class ResultsFit:
    """The fit and, per file and metric, the measured, default and fitted means."""
    runs: list[MeasuredRun]
    setup: Setup
    names: tuple[str, ...]
    defaults: dict[str, float]
    params: dict[str, float]            # every constant: fitted, or its default
    at_defaults: list[dict[str, float]]
    at_fit: list[dict[str, float]]
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """Per file: its description and, per metric, measured / default / fitted (ms) and the
        relative errors (simulated - measured) / measured."""
        out = []
        for run, d, f in zip(self.runs, self.at_defaults, self.at_fit):
            metrics = {k: {"measured": m, "default": d[k], "fitted": f[k], "default_error": (d[k] - m) / m,
                           "fitted_error": (f[k] - m) / m} for k, m in run.measured.items()}
            out.append({**run.describe(), "metrics": metrics})
        return out

    def flags(self) -> list[str]:
        """The simulate flags that reproduce the fit."""
        cost = [f"--cost-set {k}={self.params[k]:.6g}" for k in ROOFLINE]
        client = ",".join(f"{k}={self.params[k]:.6g}" for k in CLIENT)
        return [*cost, f"--client-path {client}"]

    def as_dict(self) -> dict[str, Any]:
        return {"source_kind": self.runs[0].kind, **self.setup.describe(), "fit": list(self.names),
                "params": dict(self.params), "defaults": dict(self.defaults),
                "fixed": {k: "default" for k in FITTABLE if k not in self.names},
                "client_path": {k: self.params[k] for k in CLIENT}, "flags": self.flags(), "notes": list(self.notes),
                "files": self.rows()}

    def cost_file(self) -> dict[str, Any]:
        """A roofline cost file for `--cost FILE` (docs/calibration.md "The cost file"); the client
        path is not a cost parameter: it is a record here, and `flags` gives its flag."""
        from kvsched.cost import COST_FILE_KEY, COST_FILE_VERSION
        from kvsched.cost.calibrate import _version
        return {COST_FILE_KEY: COST_FILE_VERSION, "cost": "roofline", "params": {k: self.params[k] for k in ROOFLINE},
                "model": self.setup.model, "gpu": self.setup.gpu,
                "provenance": {"sources": [r.describe() for r in self.runs], **self.setup.describe(),
                               "fitted_by": "kvsched calibrate", "kvsched_version": _version(),
                               "fit": list(self.names), "client_path": {k: self.params[k] for k in CLIENT},
                               "flags": self.flags(), "notes": list(self.notes)},
                "errors": {r["source"]: {k: v["fitted_error"] for k, v in r["metrics"].items()} for r in self.rows()}}


def fit_results(runs: Sequence[MeasuredRun], setup: Setup, names: Sequence[str] = DEFAULT_FIT) -> ResultsFit:
    """Fit constants `names` to the runs' means (module docstring); the others stay at their
    defaults."""
    names = tuple(names)
    base = defaults(setup)
    n_metrics = sum(len(r.measured) for r in runs)
    if n_metrics < len(names):
        raise KvschedError(f"the files hold {n_metrics} mean{'s' if n_metrics != 1 else ''} for {len(names)} "
                           f"constants ({', '.join(names)}): give more files or fewer --fit constants")
    at_defaults = [_checked(r, simulate_run(r, setup, base)) for r in runs]
    residuals = _residuals(runs, setup, names, base)
    x, jac = _solve(residuals, names, base)
    params = {**base, **{k: float(v) * UNITS[k][0] for k, v in zip(names, x)}}
    at_fit = [simulate_run(r, setup, params) for r in runs]
    return ResultsFit(list(runs), setup, names, base, params, at_defaults, at_fit,
                      _notes(runs, names, params, jac))


def _checked(run: MeasuredRun, sim: dict[str, float]) -> dict[str, float]:
    bad = [k for k, v in sim.items() if not math.isfinite(v)]
    if bad:
        raise KvschedError(f"{run.path}: the simulation of its {len(run.workload)} requests gives no {bad[0]} "
                           "(no request finished: check --model, --num-gpu-blocks and the lengths)")
    return sim


def _residuals(runs: Sequence[MeasuredRun], setup: Setup, names: tuple[str, ...],
               base: dict[str, float]) -> Callable[[np.ndarray], np.ndarray]:
    """x (each fitted constant in its unit) -> relative errors of every file's means."""
    measured = np.array([m for r in runs for m in r.measured.values()])

    def f(x: np.ndarray) -> np.ndarray:
        values = {**base, **{k: float(v) * UNITS[k][0] for k, v in zip(names, x)}}
        sim = np.array([v for r in runs for v in simulate_run(r, setup, values).values()])
        res = (sim - measured) / measured
        return np.where(np.isfinite(res), res, 1e3)     # no request finished: far off, not NaN
    return f


def _solve(residuals: Callable[[np.ndarray], np.ndarray], names: tuple[str, ...],
           base: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """(best x, its Jacobian): least squares from the NSTART best points of GRID, the defaults
    among them (module docstring)."""
    import itertools

    from scipy.optimize import least_squares
    lower = np.array([UNITS[k][1] / UNITS[k][0] for k in names])
    upper = np.array([UNITS[k][2] / UNITS[k][0] for k in names])
    points = [np.array([base[k] / UNITS[k][0] for k in names])]
    axes = [GRID[k] for k in names]
    while math.prod(len(a) for a in axes) > MAX_GRID:       # many constants: every other value of the longest
        longest = max(range(len(axes)), key=lambda i: len(axes[i]))
        axes[longest] = axes[longest][::2]
    points += [np.array([v / UNITS[k][0] for k, v in zip(names, p)]) for p in itertools.product(*axes)]
    points = [np.clip(x, lower, upper) for x in points]
    costs = [float(np.sum(residuals(x) ** 2)) for x in points]
    best = None
    for i in np.argsort(costs, kind="stable")[:NSTART]:
        r = least_squares(residuals, points[i], bounds=(lower, upper), method="trf", diff_step=DIFF_STEP,
                          xtol=1e-10, ftol=1e-12, gtol=1e-12, max_nfev=200)
        best = r if best is None or r.cost < best.cost else best
    return best.x, best.jac


def _notes(runs: Sequence[MeasuredRun], names: tuple[str, ...], params: dict[str, float],
           jac: np.ndarray) -> list[str]:
    """What the fit cannot vouch for: constants at a bound, constants the files do not separate
    (the Jacobian's rank), and each file's own notes."""
    notes = []
    for k in names:
        _, lo, hi = UNITS[k]
        if params[k] <= lo or params[k] >= hi:
            notes.append(f"{k} is at its bound ({params[k]:g}): the files ask for more than the model allows")
    s = np.linalg.svd(np.asarray(jac, dtype=float), compute_uv=False) if jac.size else np.zeros(0)
    rank = int(np.sum(s > s.max() * 1e-6)) if len(s) and s.max() > 0 else 0
    if rank < len(names):
        notes.append(f"the files do not separate all of {', '.join(names)} (rank {rank} of {len(names)}): the fit "
                     "is one of several equally good ones; add files that load the engine differently "
                     "(another concurrency or rate, other lengths), or fit fewer constants (--fit)")
    notes += [f"{r.path}: {n}" for r in runs for n in r.notes]
    return notes


__all__ = ["FITTABLE", "DEFAULT_FIT", "Setup", "ResultsFit", "fit_results", "simulate_run", "defaults", "parse_fit", "METRICS"]
