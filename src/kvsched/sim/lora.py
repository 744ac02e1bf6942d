"""LoRA adapters on a replica (docs/control-plane.md, "LoRA adapters and several models").

A replica holds at most `max_loras` adapters on its GPU (vLLM's `max_loras`). An adapter is
*pinned* while any of its requests is on the replica (waiting or running) and stays resident,
in LRU order, after its last one leaves. A request whose adapter is resident joins the
replica's queue at once; one whose adapter is not, but where a slot is free or holds an
unpinned adapter (the least recently used is evicted), loads it: the GPU stalls for the
adapter's bytes over `load_gbps` (vLLM loads adapters synchronously in the step that first
uses them: `LRUCacheWorkerLoRAManager._apply_adapters`), and the request joins the queue.
Otherwise it waits outside the scheduler until a slot unpins; waiting requests are then taken
in arrival order, skipping those whose adapter still finds no slot, as vLLM's scheduler skips a
waiting request whose LoRA would exceed max_loras (`vllm/v1/core/sched/scheduler.py`,
`schedule`: `len(scheduled_loras) == self.lora_config.max_loras`).

Departure from vLLM, on purpose: vLLM caps the distinct adapters of each *batch*; here an
adapter holds its slot while its requests wait in the replica's queue too, so the cap is on
the adapters of the requests on the replica, the queue included. The two agree whenever the
scheduler admits what waits (a queue of other adapters' requests is then what vLLM skips).

The cost (roofline terms, as cost/roofline.py's): an adapter of rank r adds, per adapted
projection of shape d_in x d_out, r (d_in + d_out) weights; with every attention and MLP
projection adapted that is r x sum(d_in + d_out) x layers weights (`adapter_params`). A batch
reads each distinct pinned adapter's weights once and computes 2 x adapter_params FLOPs per
token of a LoRA request (Punica's SGMV kernel, Chen et al. 2023, batches the adapters of one
batch this way); `LoraCost` adds the larger of the two times to the batch, the request share
of LoRA tokens taken as the share of LoRA requests on the replica.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvsched.errors import KvschedError
from kvsched.params import convert

BYTES = 2               # bf16 adapter weights


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int = 8          # adapters resident per replica (vLLM's max_loras)
    rank: int = 16              # adapters' rank (vLLM's max_lora_rank bounds it)
    load_gbps: float = 2.0      # GB/s an adapter loads at (storage or host memory to GPU)

    def __post_init__(self) -> None:
        if isinstance(self.load_gbps, bool):
            raise KvschedError(f"--lora-set load_gbps must be a number, got {self.load_gbps!r}")
        for key in ("max_loras", "rank"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 16:
                raise KvschedError(f"--lora-set {key} must be a whole number in 1..65536, got {v!r}")
        if not (math.isfinite(self.load_gbps) and self.load_gbps > 0):
            raise KvschedError(f"--lora-set load_gbps must be a positive number, got {self.load_gbps!r}")


KEYS = {"max_loras": "int", "rank": "int", "load_gbps": "float"}


def parse_lora(assignments: dict) -> LoraConfig:
    out = {}
    for key, value in assignments.items():
        if key not in KEYS:
            raise KvschedError(f"--lora-set has no key {key!r}; keys: {', '.join(KEYS)}")
        out[key] = convert("--lora-set", key, value, KEYS[key])
    return LoraConfig(**out)


def adapter_params(model, rank: int) -> int:
    """Weights of a rank-r adapter on every projection: r x (sum of d_in + d_out) x layers
    (q, k, v, o; gate, up, down of the dense MLP)."""
    h, q, kv, inter = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim, model.intermediate
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    return rank * per_layer * model.layers


class Residency:
    """One replica's adapter slots: pins per resident adapter, in LRU order (oldest first)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.pins: OrderedDict[int, int] = OrderedDict()
        self.waiting: deque[int] = deque()      # requests (their ids) waiting for a slot
        self.loads = 0

    def state(self, a: int) -> int:
        """2: adapter a is resident; 1: it can be loaded now; 0: no slot for it."""
        if a in self.pins:
            return 2
        return 1 if len(self.pins) < self.slots or any(v == 0 for v in self.pins.values()) else 0

    def pin(self, a: int) -> bool | None:
        """Pin adapter a: False if it was resident, True if it must load, None if no slot."""
        if a in self.pins:
            self.pins[a] += 1
            self.pins.move_to_end(a)
            return False
        if len(self.pins) >= self.slots:
            idle = next((x for x, v in self.pins.items() if v == 0), None)
            if idle is None:
                return None
            del self.pins[idle]
        self.pins[a] = 1
        self.loads += 1
        return True

    def unpin(self, a: int) -> None:
        self.pins[a] -= 1

    def clear(self) -> None:
        """The replica is off: nothing resident (it holds no request)."""
        assert not self.waiting and not any(self.pins.values()), "a replica with requests is never off"
        self.pins.clear()

    @property
    def pinned(self) -> int:
        return sum(1 for v in self.pins.values() if v > 0)


class LoraCost:
    """A replica's batch-time model with its adapters' cost added (module docstring)."""

    def __init__(self, cost, residency: Residency, counts: list, adapter_bytes: float, gpu, layout) -> None:
        self.cost, self.res, self.counts = cost, residency, counts      # counts: [LoRA requests, all requests]
        self.bytes = adapter_bytes / layout.gpus
        self.flops = 2 * adapter_bytes / BYTES / layout.gpus
        self.bw, self.peak = gpu.bandwidth, gpu.flops
        self.model, self.gpu = getattr(cost, "model", None), getattr(cost, "gpu", gpu)

    def time(self, shape):
        base = self.cost.time(shape)
        lora, total = self.counts
        if not lora:
            return base
        tokens = shape.tokens * lora / max(total, lora)
        return base + max(self.res.pinned * self.bytes / self.bw, tokens * self.flops / self.peak)

    def __getattr__(self, name):
        return getattr(self.cost, name)
