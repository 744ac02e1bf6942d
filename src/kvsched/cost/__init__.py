"""Batch-time models: `time(BatchShape) -> seconds`, selected by name with parameters."""
from __future__ import annotations

from typing import Any, Protocol

from kvsched.cost.constant import ConstantCost
from kvsched.cost.linear import LinearCost
from kvsched.cost.phase import PHASE_PRESETS, PhaseCost
from kvsched.cost.roofline import RooflineCost
from kvsched.cost.shape import BatchShape
from kvsched.cost.tiled import TILED_PRESETS, TiledCost
from kvsched.errors import KvschedError
from kvsched.hardware import GPU, Model
from kvsched.params import build


class CostModel(Protocol):
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


def make_cost_model(name: str, overrides: dict[str, Any], model: Model, gpu: GPU) -> CostModel:
    try:
        cls = COST_MODELS[name]
    except KeyError:
        raise KvschedError(f"unknown cost model {name!r}; known: {', '.join(COST_MODELS)}") from None
    context = {"model": model, "gpu": gpu} if cls in (RooflineCost, TiledCost) else {}
    bad = {"model", "gpu"} & set(overrides)
    if bad:
        raise KvschedError(f"cost model {name}: set {sorted(bad)[0]} with --{sorted(bad)[0]}")
    defaults = {**PHASE_PRESETS.get(name, {}), **TILED_PRESETS.get(name, {}), **context}
    return build(cls, f"cost model {name}", overrides, defaults)


__all__ = ["BatchShape", "CostModel", "COST_MODELS", "make_cost_model",
           "ConstantCost", "LinearCost", "PhaseCost", "RooflineCost", "TiledCost"]
