"""`kvsched sweep`'s engine: a grid of points (policies x parameters x options x rates x
seeds), each keyed by a hash of everything it simulates, run in worker processes or on Ray,
each stored as it finishes (so a killed sweep resumes where it stopped), and one tidy table.

The folder (docs/sweep.md, "Folder"; `kvsched report` reads it):
    DIR/sweep.json          {"kind": "sweep", "version": 1, "axes": {...}, "points": N, "keys": [...]}
    DIR/points/<key>.json   one finished point: key, axes, status, error, seconds, figures
    DIR/sweep.csv           one row per point, in grid order (and sweep.parquet with pyarrow)
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import time
import tomllib
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from kvsched import limits, workers
from kvsched.errors import KvschedError
from kvsched.files import atomic_file, is_temporary, names_a_file, remove, stale_temporaries
from kvsched.point import Point, check_rate, figures
from kvsched.run import Scenario, check_out, jsonable

VERSION = 1                         # of the folder format and of the key's definition
KEY_LENGTH = 16                     # hex digits of the SHA-256 kept as a point's key
DEFAULT_POLICY = "vllm-v1"
AXIS_NAMES = ("policy", "rate", "seed")
FILE_KEYS = ("policies", "rates", "seeds", "set")   # a grid file's own keys; the others are option flags


# ---- the grid, as given -------------------------------------------------------------------

@dataclass
class RawAxes:
    """Axes as given (by flags or a grid file), checked for form but not yet against each
    other; `None` where not given. `where` names the source in messages."""
    where: str
    policies: list[str] | None = None
    rates: list[float] | None = None
    seeds: list[int] | None = None
    params: dict[str, list[str]] = field(default_factory=dict)    # 'key' or 'POLICY.key' -> values (text)
    options: dict[str, list[Any]] = field(default_factory=dict)   # option field name -> values
    settings: dict[str, Any] = field(default_factory=dict)        # option field name -> one value (no axis)


def from_flags(policies: str | None, rates: str | None, seeds: str | None, sets: list[str]) -> RawAxes:
    """The command line's axes: --policies a,b  --rates 1,2  --seeds 0-9  --set key=v1,v2."""
    from kvsched.params import parse_assignments
    params = parse_assignments(sets, "--set")
    if len(params) < len(sets):         # parse_assignments keeps the last of a key given twice
        keys = [item.partition("=")[0].strip() for item in sets]
        twice = next(k for k in keys if keys.count(k) > 1)
        raise KvschedError(f"--set {twice} is given twice; give an axis once, with all its values ({twice}=v1,v2)")
    return RawAxes("command line",
                   policies=None if policies is None else split_list(policies, "--policies"),
                   rates=None if rates is None else parse_rates(split_list(rates, "--rates"), "--rates"),
                   seeds=None if seeds is None else parse_seeds(seeds, "--seeds"),
                   params={k: split_list(v, f"--set {k}") for k, v in params.items()})


def split_list(text: str, where: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not all(items):
        raise KvschedError(f"{where}: expected a comma-separated list without empty items, got {text!r}")
    return items


def parse_rates(items: Iterable[Any], where: str) -> list[float]:
    out = []
    for item in _nonempty(items, where):
        if isinstance(item, bool):
            raise KvschedError(f"{where}: {item!r} is not a rate")
        try:
            value = float(item) if isinstance(item, str) else item
        except ValueError:
            raise KvschedError(f"{where}: {item!r} is not a number") from None
        out.append(check_rate(value, where))
    return _distinct(out, where)


def parse_seeds(spec: Any, where: str) -> list[int]:
    """0, [0, 1, 2], '0,1,2', '0-9' or '0-4,10' -> whole numbers >= 0 (a range includes both ends).
    The ranges' sizes are added up before any list is built (a typo like 0-50000000)."""
    if isinstance(spec, str):
        ranges = [_seed_range(item, where) for item in split_list(spec, where)]
        count = sum(max(last - first + 1, 0) for first, last in ranges)
        if count > limits.MAX_SWEEP_POINTS:
            raise KvschedError(f"{where}: {spec} is {count:,} seeds; a sweep has at most {limits.MAX_SWEEP_POINTS:,} "
                               "points (kvsched.limits)")
        items = [seed for first, last in ranges for seed in range(first, last + 1)]
    else:
        items = _listed(spec)
    if not items or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in items):
        raise KvschedError(f"{where}: seeds are whole numbers >= 0 (0, 0-9 or 0,1,2), got {spec!r}")
    return _distinct(items, where)


def _seed_range(item: str, where: str) -> tuple[int, int]:
    """'A-B' -> (A, B); 'N' -> (N, N)."""
    lo, dash, hi = item.partition("-")
    try:
        return (int(lo), int(hi)) if dash else (int(item), int(item))
    except ValueError:
        raise KvschedError(f"{where}: {item!r} is not a seed (N) or a range of seeds (A-B)") from None


def _distinct(values: list, where: str) -> list:
    seen = set()
    for v in values:
        if v in seen:
            raise KvschedError(f"{where}: {v!r} is given twice")
        seen.add(v)
    return values


def read_grid_file(path: Path, option_kinds: dict[str, Any]) -> RawAxes:
    """A grid file (TOML): `policies`, `rates`, `seeds`, a `[set]` table of parameter axes,
    and option flags by name (`gpu = ["a100-80gb", "h100-sxm"]`); a list is an axis, a
    single value a fixed setting. `option_kinds`: the option flags' field names and types."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise KvschedError(f"--grid {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise KvschedError(f"--grid {path}: not valid TOML: {exc}") from None
    _one_spelling(data, path)
    raw = RawAxes(str(path))
    for key, value in data.items():
        name = key.replace("-", "_")
        where = f"{path}: {key}"
        if name == "policies":
            raw.policies = split_list(value, where) if isinstance(value, str) else _texts(_listed(value), where)
        elif name == "rates":
            raw.rates = parse_rates(split_list(value, where) if isinstance(value, str) else _listed(value), where)
        elif name == "seeds":
            raw.seeds = parse_seeds(value, where)
        elif name == "set":
            if not isinstance(value, dict):
                raise KvschedError(f"{where}: expected a table of parameter axes ([set] then key = [values])")
            raw.params = {k: [_text(v, f"{where}.{k}") for v in _nonempty(vs, f"{where}.{k}")]
                          for k, vs in value.items()}
        elif name in option_kinds and isinstance(value, list):
            raw.options[name] = _distinct([_coerce(v, option_kinds[name], where)
                                           for v in _nonempty(value, where)], where)
        elif name in option_kinds:
            raw.settings[name] = _coerce(value, option_kinds[name], where)
        else:
            known = ", ".join((*FILE_KEYS[:3], "[set]", *sorted(option_kinds)))
            raise KvschedError(f"{path}: unknown key {key!r} (known: {known})")
    return raw


def _one_spelling(data: dict[str, Any], path: Path) -> None:
    """A key spelt both ways (num-requests and num_requests) is one key given twice: refused,
    not the later one silently used."""
    seen: dict[str, str] = {}
    for key in data:
        first = seen.setdefault(key.replace("-", "_"), key)
        if first != key:
            raise KvschedError(f"{path}: {first!r} and {key!r} are the same key; give it once")


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _nonempty(value: Any, where: str) -> list:
    if value == []:
        raise KvschedError(f"{where}: an axis needs at least one value")
    return _listed(value)


def _texts(values: list, where: str) -> list[str]:
    if not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise KvschedError(f"{where}: expected names, got {values!r}")
    return [v.strip() for v in values]


def _text(value: Any, where: str) -> str:
    """A parameter value as the text --set would give (a policy converts text to its type)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)) and str(value).strip():
        return str(value)
    raise KvschedError(f"{where}: {value!r} is not a parameter value (a number, true/false or text)")


def _coerce(value: Any, kind: Any, where: str) -> Any:
    """A TOML value checked against an option flag's type (Optional[int] -> int, ...)."""
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    wanted = {bool: bool, int: int, float: float}.get(base, str)
    if not isinstance(value, wanted) or wanted is int and isinstance(value, bool):
        noun = {bool: "true or false", int: "a whole number", float: "a number"}.get(base, "text")
        raise KvschedError(f"{where}: {value!r} must be {noun}")
    return value


def merge(flags: RawAxes, grid: RawAxes, given_options: set[str]) -> RawAxes:
    """One set of axes: each axis comes from the command line or from the grid file, never
    both (a silent precedence would run a grid nobody wrote down). `given_options`: option
    flags given on the command line (not at their defaults)."""
    for axis in ("policies", "rates", "seeds"):
        if getattr(flags, axis) is not None and getattr(grid, axis) is not None:
            raise KvschedError(f"{axis} are given both by --{axis} and in {grid.where}; give them once")
    both = sorted(set(flags.params) & set(grid.params)) or sorted(given_options & {*grid.options, *grid.settings})
    if both:
        raise KvschedError(f"{both[0]} is given both on the command line and in {grid.where}; give it once")
    return RawAxes(grid.where, *(getattr(flags, a) if getattr(flags, a) is not None else getattr(grid, a)
                                 for a in ("policies", "rates", "seeds")),
                   params={**grid.params, **flags.params}, options=dict(grid.options), settings=dict(grid.settings))


# ---- the grid, resolved -------------------------------------------------------------------

@dataclass
class Grid:
    """The axes, checked: known policies, parameter axes scoped to the policies that take
    them (a policy without the parameter does not multiply its points)."""
    policies: list[str]
    rates: list[float]
    seeds: list[int]
    params: dict[str, dict[str, list[str]]]     # policy -> parameter -> values (text, as a policy takes them)
    options: dict[str, list[Any]]               # option field name -> values
    settings: dict[str, Any] = field(default_factory=dict)     # options set once by the grid file (no axis)
    where: str = "command line"                 # the grid file, where options and settings come from

    def axes(self) -> dict[str, Any]:
        """sweep.json's `axes`: the names a point's axes use, with every value."""
        return {"policy": self.policies, "rate": self.rates, "seed": self.seeds,
                "params": {p: {k: [typed(v) for v in vs] for k, vs in d.items()} for p, d in self.params.items() if d},
                **self.options}

    def size(self) -> int:
        """Points in the grid, counted without building it."""
        per_policy = sum(math.prod(len(v) for v in self.params.get(p, {}).values()) for p in self.policies)
        return per_policy * math.prod(len(v) for v in self.options.values()) * len(self.rates) * len(self.seeds)

    def param_names(self) -> list[str]:
        return list(dict.fromkeys(k for d in self.params.values() for k in d))

    def expand(self) -> Iterator[tuple[dict[str, str], dict[str, Any]]]:
        """(parameters, axes) of each point in grid order: policy, its parameter values,
        option axes (first given outermost), rate, seed (innermost)."""
        for policy in self.policies:
            names = list(self.params.get(policy, {}))
            for values in itertools.product(*(self.params[policy][n] for n in names)):
                params = dict(zip(names, values))
                for opts in itertools.product(*self.options.values()):
                    for rate, seed in itertools.product(self.rates, self.seeds):
                        yield params, {"policy": policy, "rate": rate, "seed": seed,
                                       "params": {k: typed(v) for k, v in params.items()},
                                       **dict(zip(self.options, opts))}


def resolve(raw: RawAxes, scope: Callable[[dict[str, str], list[str]], dict[str, dict[str, str]]]) -> Grid:
    """Check the axes against the registries. `scope` is compare's --set scoping
    ('POLICY.key' to that policy, 'key' to every policy having it)."""
    policies = _distinct(raw.policies or [DEFAULT_POLICY], "--policies")
    for policy in policies:
        check_policy(policy)
    if raw.rates is None:
        raise KvschedError("a sweep needs rates: --rates 1,2,4 (or rates in the --grid file)")
    # scoped axes go last, so `sarathi.chunk_size` wins over `chunk_size` for sarathi
    order = sorted(raw.params, key=lambda k: "." in k)
    scoped = scope({k: str(i) for i, k in enumerate(order)}, policies)
    params = {p: {k: _distinct(raw.params[order[int(i)]], f"--set {k}") for k, i in d.items()}
              for p, d in scoped.items()}
    for policy, d in params.items():
        check_params(policy, d, f"--set {policy}.")
    grid = Grid(policies, raw.rates, raw.seeds if raw.seeds is not None else [0], params, raw.options,
                raw.settings, raw.where)
    limits.check_count("the grid's points (policies x parameter values x option values x rates x seeds)",
                       grid.size(), limits.MAX_SWEEP_POINTS)       # counted, before any point is built
    return grid


def check_policy(name: str, flag: str = "--policies") -> None:
    """A policy `flag` may name (a built-in, a plugin, MODULE:CLASS or FILE.py:CLASS), else the
    error `simulate` gives, naming `flag`."""
    from kvsched.policies import policy_class
    policy_class(name, flag)


def check_params(policy: str, keys: Iterable[str], flag: str) -> None:
    """Parameter names the policy has; `flag` + the first unknown one names it in the error."""
    from kvsched.params import describe
    from kvsched.policies import policy_class
    names = [row[0] for row in describe(policy_class(policy))]
    bad = [k for k in keys if k not in names]
    if bad:
        raise KvschedError(f"{flag}{bad[0]}: {policy} has no parameter {bad[0]!r} "
                           f"(parameters: {', '.join(names) or 'none'})")


def typed(text: str) -> Any:
    """A parameter's text as the table shows it: a whole number, a number, true/false, else text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


# ---- points and their keys ----------------------------------------------------------------

@dataclass
class Base:
    """What every point shares: the command's workload, hardware and cluster options (the
    CLI's bundles, each with the grid's option axes applied per point) and its figures' options."""
    workload: Any           # kvsched.workload.source.WorkloadOptions
    hardware: Any           # kvsched.cli.common.HardwareOptions: .scenario(None, goodput, trim)
    cluster: Any            # kvsched.cli.common.ClusterOptions: .apply(scenario, seed), .decode_args()
    goodput: list[str] = field(default_factory=list)
    trim: int = 0

    def with_options(self, options: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The three bundles with `options` (field name -> value) replaced where they belong."""
        bundles = [self.workload, self.hardware, self.cluster]
        for name, value in options.items():
            k = next(k for k, b in enumerate(bundles) if name in {f.name for f in dataclasses.fields(b)})
            bundles[k] = dataclasses.replace(bundles[k], **{name: value})
        return tuple(bundles)


@dataclass
class Task:
    """One point to run, as a worker receives it (small: options, not a built workload)."""
    key: str
    axes: dict[str, Any]
    point: Point


def plan(grid: Grid, base: Base) -> list[Task]:
    """Every point of the grid, in grid order. Each distinct setting of the option axes is
    checked once, up front, as `simulate` checks it (a malformed setting is the user's error
    before any work; one that cannot run, such as a model too large for a GPU, or a parameter
    value its policy rejects, fails only its points)."""
    setups: dict[str, tuple] = {}
    built: set[str] = set()
    hashes: dict[str, str] = {}
    tasks = []
    for params, axes in grid.expand():
        options = {k: axes[k] for k in grid.options}
        tag = json.dumps(options, sort_keys=True, default=str)
        if tag not in setups:
            setups[tag] = _setup(base, grid, options, built, hashes)
        workload, template, decode, common = setups[tag]
        point = Point(workload, template, axes["policy"], params, axes["rate"], axes["seed"], decode)
        tasks.append(Task(point_key(point, hashes, common=common), axes, point))
    return tasks


def _setup(base: Base, grid: Grid, options: dict[str, Any], built: set[str],
           hashes: dict[str, str]) -> tuple[Any, Scenario, dict, dict]:
    """(workload options, scenario template, decode arguments, the key's shared part) for one
    setting of the option axes, checked with the calls a point makes: the workload resolved
    and built (once per distinct workload: trace files read), the scenario's numbers, the KV
    pool, the cost model, the decode policy. `built`: the workloads already built."""
    from kvsched.cost import make_cost_model
    from kvsched.hardware import get_gpu, get_model
    from kvsched.kvcache import PagedKV
    from kvsched.workload.arrivals import Closed
    from kvsched.workload.source import load, resolve as resolve_workload
    workload, hardware, cluster = base.with_options({**grid.settings, **options})
    values = "".join(f"{k} = {json.dumps(v, default=str)}: " for k, v in options.items())
    where = f"{grid.where}: {values}" if options or grid.settings else ""
    try:
        spec = resolve_workload(workload)
        closed = [ph.label(k) for k, ph in enumerate(spec.phases) if isinstance(ph.arrivals, Closed)]
        if closed:
            raise KvschedError(f"a sweep's rates need open-loop arrivals; {closed[0]} has closed-loop ones "
                               "(--arrivals closed:C)")
        tag = json.dumps(dataclasses.asdict(workload), sort_keys=True, default=str)
        if tag not in built:
            with warnings.catch_warnings():     # a point's warnings are dropped (run_task): these too
                warnings.simplefilter("ignore")
                load(dataclasses.replace(workload, rate=grid.rates[0], seed=grid.seeds[0]))
            built.add(tag)
        template = cluster.apply(hardware.scenario(None, base.goodput, base.trim), 0, grid=True)
        template.check()
        if template.kv_capacity is not None:
            PagedKV(template.kv_capacity, template.block_size)
        model = get_model(template.model)
        make_cost_model(template.cost, template.cost_params, model, get_gpu(template.gpu), template.layout.check(model))
        decode = cluster.decode_args()
        _check_decode(decode, grid.policies)
        return workload, template, decode, key_common(workload, template, decode, hashes)
    except KvschedError as exc:
        raise KvschedError(f"{where}{exc}") from None


def _check_decode(decode: dict[str, Any], policies: list[str]) -> None:
    """--decode-policy known, and --decode-set's keys parameters of the decode policy (of every
    policy of the grid when it has none: each then decodes its own points)."""
    name = decode.get("decode_policy")
    if name is not None:
        check_policy(name, "--decode-policy")
    for policy in [name] if name is not None else policies:
        check_params(policy, decode.get("decode_params", {}), "--decode-set ")


def point_key(point: Point, hashes: dict[str, str] | None = None, common: dict[str, Any] | None = None) -> str:
    """A stable hash of everything a point simulates: policy, parameters, rate, seed, every
    workload option and every field of the scenario (hardware, cost, cluster, figures'
    options), and the contents of the workload, trace and cost files it names. The same
    flags find the same key; any change makes a new point. `common`: `key_common` of the
    point's setting, when computed already (it is the same for every point of a setting)."""
    if common is None:
        common = key_common(point.workload, point.template, point.decode, hashes if hashes is not None else {})
    definition = {**common, "policy": point.policy, "params": point.params, "rate": point.rate, "seed": point.seed,
                  **_code(point.policy, hashes if hashes is not None else {})}
    text = json.dumps(definition, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_LENGTH]


def key_common(workload: Any, template: Scenario, decode: dict[str, Any], hashes: dict[str, str]) -> dict[str, Any]:
    """The part of a point's key definition its option setting fixes (all but policy,
    parameters, rate and seed); `hashes`: file contents' hashes by path, filled as read."""
    fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(template)
              if f.name not in ("workload", "router_seed")}       # the point's seed sets both
    named = {"workload": _spelling(workload.workload), "trace": _spelling(workload.trace)}
    specs = (decode.get("decode_policy"), template.router, template.cost)
    return {"version": VERSION, "decode": decode, **_code(specs, hashes),
            "workload": dataclasses.asdict(dataclasses.replace(workload, rate=None, seed=0, **named)),
            "scenario": jsonable(_plain(fields)),
            "files": {_spelling(p): _file_hash(Path(p), hashes) for p in (workload.workload, workload.trace, template.cost)
                      if p is not None and names_a_file(p)}, **_traces(workload, hashes)}


def _code(specs: Any, hashes: dict[str, str]) -> dict[str, Any]:
    """The contents' hashes of the users' code files that policy, router or cost specs name
    (kvsched/plugins.py, FILE.py:CLASS or MODULE:CLASS): an edit makes a new key."""
    from kvsched.plugins import source_file
    files = [source_file(s) for s in (specs if isinstance(specs, tuple) else (specs,))]
    return {"code": [_file_hash(f, hashes) for f in files if f is not None]} if any(files) else {}


def _spelling(given: Any) -> str | None:
    """A path as the key holds it: `tr.csv`, `./tr.csv` and `.//tr.csv` are one file."""
    return None if given is None else os.path.normpath(str(given))


def _traces(workload: Any, hashes: dict[str, str]) -> dict[str, list[str]]:
    """The contents' hashes of the trace every phase reads, wherever its name led (a preset's
    file in $KVSCHED_TRACES, a workload file's `trace = NAME`, the bundled copy), so that another
    file of that name makes a new key; nothing for workloads without traces."""
    from kvsched.workload.source import resolve as resolve_workload
    files = [ph.trace for ph in resolve_workload(workload).phases if ph.trace is not None]
    return {"traces": [_file_hash(f, hashes) if f.is_file() else str(f) for f in files]} if files else {}   # a pipe: its name


def _plain(x: Any) -> Any:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else (
        {k: _plain(v) for k, v in x.items()} if isinstance(x, dict) else x)


def _file_hash(path: Path, cache: dict[str, str]) -> str:
    if str(path) not in cache:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        cache[str(path)] = digest.hexdigest()
    return cache[str(path)]


# ---- running a point ----------------------------------------------------------------------

def run_task(task: Task) -> dict[str, Any]:
    """One point's record. Any exception fails this point only, recorded as one line. A
    point's warnings are dropped (from N workers they would interleave; its figures hold
    the counts they report, e.g. `rejected`)."""
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            figs, status, error = jsonable(figures(task.point.run())), "ok", None
    except Exception as exc:        # noqa: BLE001  (any failure is this point's, recorded)
        message = " ".join(str(exc).split()) or "no message"
        if not isinstance(exc, KvschedError):       # a bug, not a setting: name the exception
            message = f"{type(exc).__name__}: {message}"
        figs, status, error = {}, "error", message
    return {"key": task.key, "axes": task.axes, "status": status, "error": error,
            "seconds": time.perf_counter() - start, "figures": figs}


def run_processes(tasks: list[Task], jobs: int, save: Callable[[dict], None]) -> None:
    """Run tasks in `jobs` worker processes; `save` each record as it arrives (in this
    process, so a point file is complete or absent)."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool
    with workers.pool(min(jobs, len(tasks))) as pool:
        futures = [pool.submit(run_task, t) for t in tasks]
        try:
            for future in as_completed(futures):
                save(future.result())
        except BrokenProcessPool:
            raise KvschedError("a worker process died (killed, or out of memory?); finished points are "
                               "stored: run the same command again to resume") from None
        finally:
            for future in futures:
                future.cancel()


def ray_module():
    """Ray, imported only for --backend ray."""
    try:
        import ray
    except ImportError:
        raise KvschedError("--backend ray needs Ray: pip install 'kvsched[ray]'") from None
    if not all(hasattr(ray, f) for f in ("init", "is_initialized", "remote", "get")):   # a folder named ray
        where = getattr(ray, "__file__", None) or ", ".join(getattr(ray, "__path__", []))  # (Ray's /tmp/ray)
        raise KvschedError(f"--backend ray needs Ray: pip install 'kvsched[ray]' (`import ray` found {where}, "
                           "which is not Ray)")
    return ray


def run_ray(tasks: list[Task], jobs: int | None, address: str | None, save: Callable[[dict], None]) -> None:
    """Run tasks as Ray tasks (one CPU each) on the cluster at `address`, or on a local Ray
    started here with `jobs` CPUs; the driver saves records as they arrive."""
    import logging
    ray = ray_module()
    started = not ray.is_initialized()
    if started:
        local = address is None and not os.environ.get("RAY_ADDRESS")
        ray.init(address=address, num_cpus=jobs if local else None, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1)(run_task)
        pending = [remote.remote(t) for t in tasks]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                save(ray.get(ref))
    finally:
        if started:
            ray.shutdown()


# ---- the folder ---------------------------------------------------------------------------

POINTS = "points"
RECORD = ("key", "axes", "status", "error", "seconds", "figures")     # a point file's fields (run_task)
TEMP_SUFFIX = ".tmp"
OURS = {"sweep.json", "sweep.csv", "sweep.parquet", "report.html", POINTS}   # report.html: kvsched report


def check_folder(out: Path) -> Path:
    """--out checked before any work: new, empty, or a sweep's folder holding only a sweep's
    files (a re-run resumes it); anything else is refused, never overwritten."""
    out = Path(out)
    if not (out.is_dir() and not out.is_symlink() and any(out.iterdir())):
        return check_out(out)
    try:
        kind = json.loads((out / "sweep.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "sweep":
        raise KvschedError(f"--out {out} is not empty and holds no sweep (sweep.json); choose a new or empty "
                           "folder, or a sweep's folder to resume it")
    strangers = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not _ours(p.relative_to(out)))
    if strangers:
        raise KvschedError(f"--out {out}: {strangers[0]} is not a sweep's ({len(strangers)} such file(s)); "
                           "choose a new or empty folder")
    return out


def _ours(rel: Path) -> bool:
    if len(rel.parts) == 1:
        return rel.name in OURS or is_temporary(rel.name, None, TEMP_SUFFIX) is not None
    return len(rel.parts) == 2 and rel.parts[0] == POINTS and (
        rel.suffix == ".json" or is_temporary(rel.name, None, TEMP_SUFFIX) is not None)


class Store:
    """A sweep's folder: sweep.json, one file per finished point, the tables. Every file is
    written to a temporary name and renamed, so each is complete or absent."""

    def __init__(self, out: Path) -> None:
        self.out, self.points = Path(out), Path(out) / POINTS

    def open(self, axes: dict[str, Any], keys: list[str]) -> None:
        """Create the folder, drop temporary files a killed run left, write sweep.json (with
        the grid's point keys, in grid order: the points of this grid, whatever else the
        folder holds from earlier grids)."""
        try:
            self.points.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvschedError(f"cannot write to {self.out}: {exc.strerror or exc}") from None
        for d in (self.out, self.points):
            for stale in stale_temporaries(d, None, TEMP_SUFFIX):     # killed writers' only
                remove(stale)
        self.write_json(self.out / "sweep.json", {"kind": "sweep", "version": VERSION, "axes": axes,
                                                  "points": len(keys), "keys": keys})

    def path(self, key: str) -> Path:
        return self.points / f"{key}.json"

    def load(self, key: str, axes: dict[str, Any]) -> dict[str, Any] | None:
        """The record of the point `key` at `axes`, or None if it has none, or an unreadable or
        incomplete one (`whole`): run it again."""
        try:
            record = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return record if whole(record, key, axes) else None

    def save(self, record: dict[str, Any]) -> None:
        self.write_json(self.path(record["key"]), record)

    def write_json(self, path: Path, payload: Any) -> None:
        self.replace(path, lambda f: f.write(json.dumps(jsonable(payload), allow_nan=False, default=str)))

    @staticmethod
    def replace(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
        """Write `path` by a temporary file in the same folder and a rename."""
        with atomic_file(path, mode, suffix=TEMP_SUFFIX, clean=False) as f:    # `open` cleaned the folder
            write(f)


def whole(record: Any, key: str, axes: dict[str, Any]) -> bool:
    """Whether a stored record is one `run_task` wrote for this point: its key, the grid's axes
    for it (the same JSON), status ok without error or error with one, seconds a number, and
    figures an object `kvsched report` accepts. The table, the summary and the report read
    these fields; a file missing one (a partial copy, an edit) is not a finished point."""
    from kvsched.report.folders import check_figures, finite
    if not (isinstance(record, dict) and set(RECORD) <= set(record) and record["key"] == key
            and _same_json(record["axes"], axes)):
        return False
    status, error, seconds, figs = (record[k] for k in RECORD[2:])
    if not (status == "ok" and error is None or status == "error" and isinstance(error, str)):
        return False
    if not finite(seconds):         # a number a float holds (an integer of 400 digits overflows)
        return False
    try:
        check_figures(figs, "figures")
    except ValueError:
        return False
    return True


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON text (so 1, 1.0 and true differ, as they do in the table)."""
    def text(x: Any) -> str:
        return json.dumps(jsonable(x), sort_keys=True, default=str)
    return text(a) == text(b)


# ---- the table ----------------------------------------------------------------------------

def table(grid: Grid, records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows): one row per point in grid order; axis columns (policy, rate, seed,
    param.<name>, option axes), status, error, seconds, then every scalar figure (a figure
    named as an axis column, such as `policy` or `gpu`, is left to the axis)."""
    axis_cols = [*AXIS_NAMES, *(f"param.{k}" for k in grid.param_names()), *grid.options]
    head = [*axis_cols, "status", "error", "seconds"]
    figure_cols = list(dict.fromkeys(k for r in records for k, v in r["figures"].items()
                                     if not isinstance(v, (list, dict)) and k not in head))
    rows = []
    for r in records:
        axes = {**r["axes"], **{f"param.{k}": v for k, v in r["axes"].get("params", {}).items()}}
        rows.append([axes.get(c) for c in axis_cols] + [r["status"], r["error"], r["seconds"]]
                    + [r["figures"].get(c) for c in figure_cols])
    return head + figure_cols, rows


def write_tables(store: Store, columns: list[str], rows: list[list[Any]]) -> list[Path]:
    """sweep.csv, and sweep.parquet when pyarrow imports (a stale one is removed otherwise)."""
    csv_path, parquet_path = store.out / "sweep.csv", store.out / "sweep.parquet"

    def write_csv(f) -> None:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([["" if v is None else v for v in row] for row in rows])
    store.replace(csv_path, write_csv)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        parquet_path.unlink(missing_ok=True)
        return [csv_path]
    data = pa.table({c: _arrow_column(pa, [row[k] for row in rows]) for k, c in enumerate(columns)})
    store.replace(parquet_path, lambda f: pq.write_table(data, f), mode="wb")
    return [csv_path, parquet_path]


def _arrow_column(pa, values: list[Any]):
    """A typed column; one mixing types (a parameter that is a number for one policy and
    text for another) as text."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())
