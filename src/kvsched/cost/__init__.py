"""Batch-time models: `time(BatchShape) -> seconds`, selected by name with parameters, or
from a cost file that `kvsched calibrate` writes (docs/calibration.md)."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any, Protocol

from kvsched.cost.constant import ConstantCost
from kvsched.cost.linear import LinearCost
from kvsched.cost.phase import PHASE_PRESETS, PhaseCost
from kvsched.cost.roofline import RooflineCost
from kvsched.cost.shape import BatchShape
from kvsched.cost.tiled import TILED_PRESETS, TiledCost
from kvsched.errors import KvschedError
from kvsched.files import names_a_file
from kvsched.hardware import GPU, Model
from kvsched.layout import PLAIN, Layout
from kvsched.params import build
from kvsched.plugins import plain_instance, resolve


class CostModel(Protocol):
    """`time(shape)` is required. A model may add `decode_time(n, ctx, phase_switch)`: the time
    of a decode-only batch of n requests over ctx KV tokens, equal bit for bit to `time` of
    that shape (the replica's decode fast path; docs/architecture.md, "Batch-time models")."""
    def time(self, shape: BatchShape) -> float: ...


COST_MODELS: dict[str, type] = {
    "roofline": RooflineCost,
    "constant": ConstantCost,
    "linear": LinearCost,
    "phase": PhaseCost,
    **{name: PhaseCost for name in PHASE_PRESETS},     # phase models with calibrated defaults
    "tiled": TiledCost,
    **{name: TiledCost for name in TILED_PRESETS},     # tiled models with fitted defaults
}


COST_FILE_KEY = "kvsched_cost"     # a cost file's format marker; its value is the version
COST_FILE_VERSION = 1
CATALOGUE_MODELS = (RooflineCost, TiledCost)      # need the model and GPU: parameters tied to them


def make_cost_model(name: str, overrides: dict[str, Any], model: Model, gpu: GPU, layout: Layout = PLAIN) -> CostModel:
    """A registered model by name, or the model of a cost file when `name` is not registered
    and ends in .json or is a file; `overrides` (--cost-set) apply on top of the file's
    parameters. `layout` (TP, PP, EP, number formats) goes to a model with a `layout` field
    (the roofline); another model refuses any but one bf16 GPU."""
    if name not in COST_MODELS and (name.endswith(".json") or names_a_file(name)):
        cost, params = read_cost_file(Path(name), model, gpu)
        return _build(cost, overrides, model, gpu, params, f"cost file {name} ({cost})", layout)
    return _build(name, overrides, model, gpu, {}, f"cost model {name}", layout)


def cost_class(name: str) -> type:
    """The class `--cost NAME` names: a built-in, an installed plugin (entry point group
    `kvsched.cost_models`), or MODULE:CLASS / FILE.py:CLASS (kvsched/plugins.py)."""
    if name in COST_MODELS:
        return COST_MODELS[name]
    try:
        return resolve(name, "cost", COST_MODELS, "time")
    except KvschedError as exc:
        if str(exc).startswith("--cost: unknown cost "):
            text = str(exc).replace("unknown cost ", "unknown cost model ", 1)
            raise KvschedError(f"{text}; or a cost file (.json) from kvsched calibrate") from None
        raise


def _build(name: str, overrides: dict[str, Any], model: Model, gpu: GPU, params: dict[str, Any], owner: str,
           layout: Layout = PLAIN):
    cls = cost_class(name)
    takes_layout = dataclasses.is_dataclass(cls) and "layout" in {f.name for f in dataclasses.fields(cls)}
    if layout != PLAIN and not takes_layout:
        raise KvschedError(f"{owner} times one GPU in bf16: {layout.describe()} needs --cost roofline")
    if not dataclasses.is_dataclass(cls):
        return plain_instance(cls, owner, overrides, "--cost-set")
    # a user's dataclass with `model` and `gpu` fields takes the catalogue's, as the roofline does
    catalogue = cls in CATALOGUE_MODELS or (cls not in COST_MODELS.values()
                                            and {"model", "gpu"} <= {f.name for f in dataclasses.fields(cls)})
    if catalogue and (model is None or gpu is None):
        raise KvschedError(f"{owner} needs a catalogue model and GPU, and none was given here "
                           "(inside vLLM: use a phase or linear cost file from kvsched calibrate)")
    context = {"model": model, "gpu": gpu} if catalogue else {}
    if takes_layout:
        context["layout"] = layout
    bad = {"model", "gpu", "layout"} & set(overrides)
    if bad:
        flag = sorted(bad)[0]
        raise KvschedError(f"cost model {name}: set {flag} with " + ("--tp, --pp, --ep, --dp-attention, --weight-dtype "
                                                                     "and --kv-dtype" if flag == "layout" else f"--{flag}"))
    defaults = {**PHASE_PRESETS.get(name, {}), **TILED_PRESETS.get(name, {}), **params, **context}
    return build(cls, owner, overrides, defaults)


def read_cost_file(path: Path, model: Model | None, gpu: GPU | None) -> tuple[str, dict[str, Any]]:
    """(registered cost model name, parameters) of a cost file, checked; every problem is a
    one-line error naming the file. A file fitted with --model/--gpu (roofline, tiled) is
    refused for another model or GPU; a phase or linear file only warns. model and gpu may be
    None (a caller without a catalogue entry, e.g. the vLLM adapter): not compared then."""
    data = _load_json(path)
    version = data.get(COST_FILE_KEY) if isinstance(data, dict) else None
    if type(version) is not int or version != COST_FILE_VERSION:
        raise KvschedError(f"cost file {path}: not a kvsched cost file (needs \"{COST_FILE_KEY}\": "
                           f"{COST_FILE_VERSION})")
    cost, params = data.get("cost"), data.get("params")
    if cost not in COST_MODELS:
        raise KvschedError(f"cost file {path}: unknown cost model {cost!r}; known: {', '.join(COST_MODELS)}")
    if not isinstance(params, dict):
        raise KvschedError(f"cost file {path}: \"params\" must be an object of parameter values")
    fields = {f.name for f in dataclasses.fields(COST_MODELS[cost]) if f.init} - {"model", "gpu", "layout"}
    for key, value in params.items():
        if key not in fields:
            raise KvschedError(f"cost file {path}: cost model {cost} has no parameter {key!r} "
                               f"(parameters: {', '.join(sorted(fields))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise KvschedError(f"cost file {path}: {key}={value!r} must be a finite number")
    _check_hardware(path, data, COST_MODELS[cost], model, gpu)
    drafter_params(path, data)
    return cost, params


def drafter_params(path: Path, data: dict) -> dict[str, float] | None:
    """A cost file's `drafter` (e0, e1 >= 0: speculative steps' drafter, cost/calibrate.py
    `fit_drafter`), checked; None when it has none."""
    d = data.get("drafter")
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"e0", "e1"} or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in d.values()):
        raise KvschedError(f"cost file {path}: \"drafter\" must be {{\"e0\": seconds >= 0, \"e1\": seconds >= 0}}, "
                           f"got {d!r}")
    return {"e0": float(d["e0"]), "e1": float(d["e1"])}


def cost_file_drafter(name: str):
    """The drafter a cost file's calibration fitted (cost/spec_cost.py `DrafterLine`), or None:
    `name` is a registered model, or a file without one."""
    if name in COST_MODELS or not (name.endswith(".json") or names_a_file(name)):
        return None
    from kvsched.cost.spec_cost import DrafterLine
    d = drafter_params(Path(name), _load_json(Path(name)))
    return DrafterLine(**d) if d else None


def _load_json(path: Path) -> Any:
    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a number JSON allows")
    try:
        return json.loads(path.read_text(), parse_constant=no_constant)
    except FileNotFoundError:
        raise KvschedError(f"cost file {path}: no such file") from None
    except OSError as exc:
        raise KvschedError(f"cost file {path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise KvschedError(f"cost file {path}: not JSON ({' '.join(str(exc).split())})") from None


def _check_hardware(path: Path, data: dict, cls: type, model: Model | None, gpu: GPU | None) -> None:
    """The file's model and GPU (those given to kvsched calibrate) against the simulation's."""
    fitted = {"model": data.get("model"), "gpu": data.get("gpu")}
    for key, value in fitted.items():
        if value is not None and not isinstance(value, str):
            raise KvschedError(f"cost file {path}: \"{key}\" must be a catalogue name or null, got {value!r}")
    if model is None or gpu is None:
        return
    differs = [f"{k} {v}" for k, v, now in (("model", fitted["model"], model.name), ("gpu", fitted["gpu"], gpu.name))
               if v is not None and v != now]
    if not differs:
        return
    message = (f"cost file {path} was fitted for {' and '.join(differs)}, not {model.name} on {gpu.name}")
    if cls in CATALOGUE_MODELS:
        raise KvschedError(f"{message}: its parameters are relative to that catalogue entry; run with "
                           f"--model {fitted['model'] or model.name} --gpu {fitted['gpu'] or gpu.name}")
    if (str(path), model.name, gpu.name) not in _WARNED:       # once, not once per policy or replica
        _WARNED.add((str(path), model.name, gpu.name))
        warnings.warn(f"{message}: its batch times are those measured there", stacklevel=2)


_WARNED: set[tuple[str, str, str]] = set()


__all__ = ["BatchShape", "CostModel", "COST_MODELS", "COST_FILE_KEY", "COST_FILE_VERSION", "make_cost_model",
           "read_cost_file",
           "ConstantCost", "LinearCost", "PhaseCost", "RooflineCost", "TiledCost"]
