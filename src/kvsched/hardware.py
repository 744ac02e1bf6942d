"""GPU and model catalogue: memory, bandwidth, FLOP/s per format, interconnect, KV bytes per
token, KV capacity.

Both are data files shipped in the package (issue "Today's deployments", items 1 and 3):
`data/gpus/NAME.toml`, datasheet figures with their source on each line (dense tensor FLOP/s per
number format without sparsity, peak memory bandwidth, the GPU-to-GPU link and the network), and
`data/models/NAME.json`, the models' Hugging Face `config.json` files (sources in
`data/models/SOURCES.toml`), read by model_config.py. `--gpu` and `--model` also take a user's
file (docs/hardware.md).
"""
from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvsched.errors import KvschedError

GiB = 1024**3
DATA = Path(__file__).parent / "data"
FORMATS = ("bf16", "fp8", "fp4")        # number formats a GPU file may give FLOP/s for
LINKS = ("nvlink", "xgmi", "pcie")
LARGEST = {"memory_gib": 1e7, "link_latency": 1.0, "power": 1e5, "idle_power": 1e5}      # a GPU file's bounds (others: 1e20 per second)
ROOFLINE_KEYS = ("compute_efficiency", "memory_efficiency", "overhead", "cpu_per_request", "cpu_per_token")
EFFICIENCIES = ("compute_efficiency", "memory_efficiency")     # in (0, 1]; the others seconds >= 0


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float          # total device memory (as nvidia-smi reports it, or the datasheet's)
    bandwidth: float           # bytes/s, peak HBM/GDDR bandwidth
    flops: float               # dense bf16 FLOP/s
    formats: Mapping[str, float] = field(default_factory=dict)   # dense FLOP/s per format (bf16 included)
    link: str = "pcie"         # GPU-to-GPU interconnect inside a replica
    link_bandwidth: float = 32e9    # bytes/s each way per GPU
    link_latency: float = 1e-5      # seconds per collective call
    network_bandwidth: float = 25e9     # bytes/s per GPU between replicas (KV transfer)
    roofline: Mapping[str, float] = field(default_factory=dict)   # the roofline's defaults measured on this GPU
    power: float = 0.0         # W at full load (board power); 0: unknown (fleet.py reports no energy)
    idle_power: float = 0.0    # W with nothing running (fleet.py, `Power`)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    def rate(self, fmt: str) -> float:
        """Dense FLOP/s in `fmt`, or the bf16 rate where the GPU has no faster path for it (a
        weight-only format then computes in bf16, as vLLM's Marlin kernels do)."""
        return self.formats.get(fmt, self.flops)


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: float              # total parameters
    max_len: int               # max_position_embeddings
    active_params: float | None = None   # MoE: parameters touched per token
    dtype_bytes: int = 2
    kv_token_bytes: int | None = None    # KV bytes per token when not K and V per head (MLA: model_config.py)
    experts: int = 0                     # MoE: routed experts per MoE layer (0: dense)
    experts_per_token: int = 0           # MoE: routed experts each token goes to (top-k)
    expert_params: float = 0.0           # MoE: routed experts' parameters over all MoE layers
    embedding_params: float = 0.0        # embeddings and an untied LM head (kept 16-bit when quantised)
    mla: bool = False                    # KV is one latent per token and layer, on every TP rank
    moe_layers: int = 0                  # MoE: layers whose MLP is the experts
    mla_dims: tuple[int, int, int] = (0, 0, 0)   # MLA: qk and v head sizes (prefill), kv_lora_rank

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype bytes (else as given)."""
        if self.kv_token_bytes is not None:
            return self.kv_token_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def active(self) -> float:
        return self.active_params if self.active_params is not None else self.params


class _Catalogue(MutableMapping):
    """The bundled entries by name, each file read on first use (`kvsched --help` reads none);
    a program may add its own entries (or replace or remove one) as in a dict."""

    def __init__(self, folder: str, suffix: str, read: Callable[[Path], object]) -> None:
        self.folder, self.suffix, self.read = DATA / folder, suffix, read
        self._names: list[str] | None = None
        self._read: dict[str, object] = {}

    def names(self) -> list[str]:
        if self._names is None:
            self._names = sorted(p.name[:-len(self.suffix)] for p in self.folder.glob("*" + self.suffix))
        return self._names

    def __getitem__(self, name: str):
        if name not in self._read:
            if name not in self.names():
                raise KeyError(name)
            self._read[name] = self.read(self.folder / (name + self.suffix))
        return self._read[name]

    def __setitem__(self, name: str, value) -> None:
        if name not in self.names():
            self._names = self.names() + [name]
        self._read[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self.names():
            raise KeyError(name)
        self._names = [n for n in self.names() if n != name]
        self._read.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def read_gpu(path: str | Path) -> GPU:
    """A GPU from a TOML file (the bundled ones are the template: data/gpus/h100-sxm.toml); every
    problem is one error naming the file and the key."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvschedError(f"--gpu {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KvschedError(f"{p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise KvschedError(f"{p}: not TOML: {exc}") from None
    known = {"name", "memory_gib", "bandwidth", "link", "link_bandwidth", "link_latency", "network_bandwidth",
             "flops", "roofline", "power", "idle_power"}
    for key in data:
        if key not in known:
            raise KvschedError(f"{p}: unknown key {key!r}; keys: {', '.join(sorted(known))}")

    def number(key: str, value, positive: bool = True) -> float:
        most = LARGEST.get(key, 1e20)           # far above any card: a larger figure is a typo
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (positive and value == 0) or value > most:
            raise KvschedError(f"{p}: {key} must be a {'positive' if positive else 'non-negative'} number up to "
                               f"{most:g}, got {value!r}")
        return float(value)

    for key in ("memory_gib", "bandwidth", "flops"):
        if key not in data:
            raise KvschedError(f"{p}: missing key {key!r}")
    flops = data["flops"]
    if not isinstance(flops, dict) or "bf16" not in flops:
        raise KvschedError(f"{p}: [flops] must be a table with at least bf16 (dense FLOP/s per format)")
    for fmt in flops:
        if fmt not in FORMATS:
            raise KvschedError(f"{p}: [flops] has unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    formats = {fmt: number(f"flops.{fmt}", v) for fmt, v in flops.items()}
    name = data.get("name", p.stem)
    link = data.get("link", "pcie")
    if not isinstance(name, str) or not name:
        raise KvschedError(f"{p}: name must be text, got {name!r}")
    if link not in LINKS:
        raise KvschedError(f"{p}: link must be one of {', '.join(LINKS)}, got {link!r}")
    extra = {k: number(k, data[k], positive=k not in ("link_latency", "idle_power"))
             for k in ("link_bandwidth", "link_latency", "network_bandwidth", "power", "idle_power") if k in data}
    if extra.get("idle_power", 0.0) > extra.get("power", 0.0) or ("idle_power" in data) != ("power" in data):
        raise KvschedError(f"{p}: give power and idle_power together, idle_power <= power (W per GPU)")
    roof = data.get("roofline", {})
    if not isinstance(roof, dict) or set(roof) - set(ROOFLINE_KEYS):
        raise KvschedError(f"{p}: [roofline] takes {', '.join(ROOFLINE_KEYS)} (the roofline's defaults on this GPU)")
    for key, v in roof.items():
        ok = number(f"roofline.{key}", v, positive=key in EFFICIENCIES)
        if ok > 1:                      # an efficiency, or seconds per step, request or token
            raise KvschedError(f"{p}: roofline.{key} must be at most 1, got {v!r}")
    extra["roofline"] = {k: float(v) for k, v in roof.items()}
    return GPU(name, number("memory_gib", data["memory_gib"]), number("bandwidth", data["bandwidth"]),
               formats["bf16"], formats, link, **extra)


def _read_model(path: Path) -> Model:
    from kvsched.model_config import read_model
    return read_model(path, name=path.stem)


GPUS: MutableMapping[str, GPU] = _Catalogue("gpus", ".toml", read_gpu)
MODELS: MutableMapping[str, Model] = _Catalogue("models", ".json", _read_model)


def get_gpu(name: str) -> GPU:
    """A catalogue GPU by name, or a user's GPU file (a path ending in .toml)."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        pass
    if name.endswith(".toml") or "/" in name or "\\" in name:
        return read_gpu(name)
    raise KvschedError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}; or a GPU file (.toml)")


def get_model(name: str) -> Model:
    """A catalogue model by name, or the model a Hugging Face config.json describes (a path to
    it or to its folder: model_config.py)."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        pass
    from kvsched.model_config import is_config_path, read_model
    if is_config_path(name):
        return read_model(name)
    raise KvschedError(f"unknown model {name!r}; known: {', '.join(MODELS)}; or a config.json (a path)")


def kv_capacity_tokens(model: Model, gpu: GPU, memory_utilization: float = 0.9, layout=None, limits=None) -> int:
    """Tokens of KV cache vLLM's memory profile leaves (memory_profile.py, `kv_capacity_tokens`;
    one bf16 GPU without a layout, vLLM's default limits for the GPU without `limits`)."""
    from kvsched.layout import PLAIN
    from kvsched.memory_profile import kv_capacity_tokens as capacity
    return capacity(model, gpu, memory_utilization, layout or PLAIN, limits)


def usable_kv_tokens(model: Model, gpu: GPU, memory_utilization: float = 0.9, block_size: int = 16,
                     layout=None, limits=None) -> int:
    """KV tokens a vLLM replica can use: of the G blocks that fit, block 0 is vLLM's null
    block, so (G - 1) x block_size."""
    tokens = (kv_capacity_tokens(model, gpu, memory_utilization, layout, limits) // block_size - 1) * block_size
    if tokens < block_size:
        raise KvschedError(f"{model.name} on {gpu.name} leaves no KV block beside vLLM's null block")
    return tokens


def tokens_of_gpu_blocks(num_gpu_blocks: int, block_size: int) -> int:
    """KV tokens of vLLM's `num_gpu_blocks` (its log, or --num-gpu-blocks-override): block 0 is
    the null block, never allocated (vllm/v1/core/block_pool.py, `BlockPool.__init__`), so
    (N - 1) x block size, as `usable_kv_tokens` counts it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KvschedError(f"--block-size must be >= 1 (a whole number of tokens), got {block_size!r}")
    if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int) or not 2 <= num_gpu_blocks <= 1 << 40:
        raise KvschedError(f"--num-gpu-blocks must be a whole number from 2 to 2**40 (block 0 is vLLM's null "
                           f"block), got {num_gpu_blocks!r}")
    return (num_gpu_blocks - 1) * block_size
