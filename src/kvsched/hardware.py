"""GPU and model catalogue: memory, bandwidth, FLOP/s, KV bytes per token, KV capacity.

GPU figures are vendor datasheet values (dense bf16 tensor FLOP/s without sparsity, peak
memory bandwidth) and total memory as the driver reports it. Model figures are from the
models' published configs (Hugging Face `config.json`), bf16 weights and KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvsched.errors import KvschedError

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float          # total device memory (as nvidia-smi reports it)
    bandwidth: float           # bytes/s, peak HBM/GDDR bandwidth
    flops: float               # dense bf16 FLOP/s

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


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


GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("a100-40gb", 40.0, 1.555e12, 312e12),
    GPU("a100-80gb", 80.0, 2.039e12, 312e12),
    GPU("a30", 24.0, 0.933e12, 165e12),
    GPU("h100-sxm", 79.6, 3.35e12, 989e12),
    GPU("h200", 140.4, 4.8e12, 989e12),
    GPU("l20", 45.0, 0.864e12, 119.5e12),
    GPU("l40s", 45.0, 0.864e12, 362e12),
    GPU("rtx-6000-ada", 48.0, 0.960e12, 364e12),
    GPU("rtx-pro-6000", 95.6, 1.792e12, 504e12),
    GPU("b300", 268.0, 8.0e12, 2.5e15),
]}

MODELS: dict[str, Model] = {m.name: m for m in [
    Model("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 6.74e9, 4096),
    Model("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, 13.0e9, 4096),
    Model("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, 8192),
    Model("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, 7.24e9, 32768),
    Model("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7.62e9, 32768),
    Model("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, 0.60e9, 40960),
    Model("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, 4.02e9, 40960),
    Model("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 8.19e9, 40960),
    Model("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, 14.8e9, 40960),
    Model("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 768, 151936, 30.5e9, 40960,
          active_params=3.3e9),
]}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise KvschedError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


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


def kv_capacity_tokens(model: Model, gpu: GPU, memory_utilization: float = 0.9) -> int:
    """Tokens of KV cache that fit beside the weights in `memory_utilization` of the GPU.

    Like vLLM's `gpu_memory_utilization`, less the weights; activation memory is not
    modelled (vLLM also subtracts a profiled activation peak, a few percent).
    """
    if not 0 < memory_utilization <= 1:
        raise KvschedError(f"memory utilization must be in (0, 1], got {memory_utilization}")
    free = gpu.memory_bytes * memory_utilization - model.weight_bytes
    if free <= 0:
        raise KvschedError(
            f"{model.name} weights ({model.weight_bytes / GiB:.1f} GiB) do not fit in "
            f"{memory_utilization:.0%} of {gpu.name} ({gpu.memory_gib:g} GiB)")
    return int(free // model.kv_bytes_per_token)


def usable_kv_tokens(model: Model, gpu: GPU, memory_utilization: float = 0.9, block_size: int = 16) -> int:
    """KV tokens a vLLM replica can use: of the G blocks that fit, block 0 is vLLM's null
    block, so (G - 1) x block_size."""
    tokens = (kv_capacity_tokens(model, gpu, memory_utilization) // block_size - 1) * block_size
    if tokens < block_size:
        raise KvschedError(f"{model.name} on {gpu.name} leaves no KV block beside vLLM's null block")
    return tokens
