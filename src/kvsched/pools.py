"""Clusters of several replica kinds (issue "Today's deployments", item 6).

`--pool NAME=GPU:COUNT[:tp=N][:pp=N][:ep=N][:dp-attention][:model=M][:weight-dtype=D][:kv-dtype=D]`,
repeated, describes COUNT replicas of one kind: a GPU (a catalogue name or a GPU file), a
layout (layout.py; --tp, --pp, ... give what a pool leaves out) and a model (--model's unless
given). Pools named `prefill` and `decode` are a disaggregated cluster: the prefill pool's
replicas hand each request's KV to the decode pool's over the slower of the two sides' networks
(each replica's GPUs x the GPU file's network_bandwidth) unless --kv-transfer-bandwidth is
given. Any other names are one cluster behind --router, which sees each replica's kind
(`ReplicaSummary.kind`).

What is simplified: a request is servable when it fits the smallest replica's KV cache and
the shortest max_model_len (a router may send it to any replica); one --cost model (and
--cost-set) times every kind, each on its own hardware (a cost model that does not read the
hardware, e.g. a calibration, is refused for pools of several GPUs or models); --kv-capacity
gives every kind the same capacity.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvsched.errors import KvschedError
from kvsched.hardware import GPU, Model, get_gpu, get_model, usable_kv_tokens
from kvsched.layout import Layout, kv_bytes_per_token, layout_summary
from kvsched.limits import MAX_REPLICAS, check_count

ROLES = ("prefill", "decode")
KEYS = {"tp": int, "pp": int, "ep": int, "dp-attention": bool, "model": str, "weight-dtype": str, "kv-dtype": str}


@dataclass(frozen=True)
class Pool:
    name: str
    gpu: str
    count: int
    model: str
    layout: Layout


def parse_pool(text: str, model: str, base: Layout, where: str | None = None) -> Pool:
    """One --pool value, checked; `model` and `base` fill in what it leaves out; `where` names
    it in errors (--pool TEXT)."""
    where = where or f"--pool {text!r}"
    name, eq, rest = str(text).partition("=")
    if not eq or not name.strip():
        raise KvschedError(f"{where}: write NAME=GPU:COUNT[:tp=N][:pp=N][:ep=N][:dp-attention][:model=M]"
                           "[:weight-dtype=D][:kv-dtype=D]")
    parts = rest.split(":")
    if len(parts) < 2 or not parts[0]:
        raise KvschedError(f"{where}: needs GPU:COUNT after the name")
    gpu, count_text, options = parts[0], parts[1], parts[2:]
    if not (count_text.isascii() and count_text.isdigit()) or len(count_text) > 9:
        raise KvschedError(f"{where}: COUNT must be a whole number of replicas, got {count_text!r}")
    count = check_count(f"{where}: COUNT", int(count_text), MAX_REPLICAS)
    given: dict[str, Any] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in KEYS:
            raise KvschedError(f"{where}: unknown option {key!r}; options: {', '.join(KEYS)}")
        if key in given:
            raise KvschedError(f"{where}: {key} given twice")
        if KEYS[key] is bool:
            if eq and value not in ("on", "off"):
                raise KvschedError(f"{where}: dp-attention is on or off, got {value!r}")
            given[key] = value != "off"
        elif not eq or not value:
            raise KvschedError(f"{where}: {key} needs a value ({key}=...)")
        elif KEYS[key] is int:
            if not (value.isascii() and value.isdigit()) or len(value) > 9:
                raise KvschedError(f"{where}: {key} must be a whole number, got {value!r}")
            given[key] = int(value)
        else:
            given[key] = value
    layout = dataclasses.replace(base, **{k.replace("-", "_"): v for k, v in given.items() if k != "model"})
    return Pool(name.strip(), gpu, count, given.get("model", model), layout)


def parse_candidate(text: str, model: str, base: Layout) -> Pool:
    """One `kvsched capacity --candidate NAME=GPU[:tp=N]...` (a pool without its count)."""
    name, eq, rest = str(text).partition("=")
    gpu, colon, options = rest.partition(":")
    if not eq or not gpu:
        raise KvschedError(f"--candidate {text!r}: write NAME=GPU[:tp=N][:pp=N][:ep=N][:dp-attention][:model=M]"
                           "[:weight-dtype=D][:kv-dtype=D]")
    return parse_pool(f"{name}={gpu}:1" + (f":{options}" if colon else ""), model, base, f"--candidate {text!r}")


def check_pools(pools: list[Pool]) -> bool:
    """The pools as a whole, checked; whether they are disaggregated (prefill and decode)."""
    names = [p.name for p in pools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise KvschedError(f"--pool: the name {twice[0]!r} is given twice")
    check_count("the replicas of every --pool", sum(p.count for p in pools), MAX_REPLICAS)
    roles = [n for n in names if n in ROLES]
    if roles and sorted(names) != sorted(ROLES):
        raise KvschedError("--pool: a disaggregated cluster is exactly two pools, named prefill and decode; "
                           f"got {', '.join(names)}")
    return bool(roles)


@dataclass
class Kind:
    """A pool resolved: its model, GPU, KV tokens per replica and batch-time model."""
    pool: Pool
    model: Model
    gpu: GPU
    tokens: int
    cost: Any

    def describe(self) -> str:
        return f"{self.pool.name}: {self.gpu.name} {self.pool.layout.describe()}"

    def summary(self) -> dict[str, Any]:
        return {"name": self.pool.name, "gpu": self.gpu.name, "replicas": self.pool.count, "model": self.model.name,
                **layout_summary(self.pool.layout), "kv_capacity_tokens": self.tokens}


def resolve(pools: list[Pool], scenario, limits=None) -> list[Kind]:
    """Each pool's Kind (prefill first when disaggregated), built as Scenario.resolve builds one
    (`limits`: the memory profile's engine limits for a GPU, as there)."""
    from kvsched.cost import make_cost_model
    if check_pools(pools):
        pools = sorted(pools, key=lambda p: ROLES.index(p.name))
    kinds = []
    for p in pools:
        model, gpu = get_model(p.model), get_gpu(p.gpu)
        layout = p.layout.check(model)
        tokens = scenario.kv_capacity if scenario.kv_capacity is not None else usable_kv_tokens(
            model, gpu, scenario.memory_utilization, scenario.block_size, layout, limits(gpu) if limits else None)
        kinds.append(Kind(p, model, gpu, tokens, make_cost_model(scenario.cost, scenario.cost_params, model, gpu,
                                                                 layout)))
    check_reads_hardware(scenario.cost, [k.cost for k in kinds], {(k.model.name, k.gpu.name) for k in kinds},
                         "the pools")
    if kinds[0].pool.name == "prefill":
        a, b = kinds
        if a.model != b.model or a.pool.layout.kv_dtype != b.pool.layout.kv_dtype:
            raise KvschedError("--pool prefill and decode must serve one model with one --kv-dtype: the decode "
                               f"pool takes over the prefill pool's KV ({a.model.name}, {b.model.name})")
    return kinds


def check_reads_hardware(name: str, costs: list, hardware: set, what: str) -> None:
    """Replicas of several GPUs or models need a cost model that reads them: the roofline, or a
    user's with `model` and `gpu`; a calibration or a fitted preset times every batch as the
    hardware it was fitted on."""
    from kvsched.cost import RooflineCost
    fitted = [c for c in costs if not isinstance(c, RooflineCost)
              and (type(c).__module__.startswith("kvsched.") or getattr(c, "gpu", None) is None)]
    if len(hardware) > 1 and fitted:
        raise KvschedError(f"--cost {name} times every batch as the one GPU and model it was fitted on (or as fixed "
                           f"numbers), but {what} run {len(hardware)} kinds of GPU or model: use --cost roofline "
                           "(or a cost model of yours that reads model and gpu)")


def link_gbps(kinds: list[Kind]) -> float:
    """The KV link's GB/s between a prefill and a decode replica: the slower side's network."""
    return min(k.pool.layout.gpus * k.gpu.network_bandwidth for k in kinds) / 1e9


def transfer_bytes(kinds: list[Kind]) -> int:
    return kv_bytes_per_token(kinds[0].model, kinds[0].pool.layout)
