"""KV capacity as vLLM sizes it at start-up: its memory profile (issue "Timing fidelity against
real vLLM", item 2; docs/fidelity.md gives the formula and its fit).

vLLM measures, on each GPU, what is not KV cache and gives the KV cache the rest of its share
(vllm/v1/worker/gpu_worker.py, `determine_available_memory`; vllm/utils/mem_utils.py,
`memory_profiling`):

    KV bytes = gpu_memory_utilization x GPU memory - weights - peak activation
               - CUDA graphs - non-torch memory

kvsched estimates each term per GPU:
- **weights**: layout.py, `weight_bytes_per_gpu`.
- **peak activation**: vLLM's profile run is one forward pass of `max_num_batched_tokens`
  dummy tokens, then the sampler on `max_num_seqs` rows (vllm/v1/worker/gpu_model_runner.py,
  `profile_run`, `_dummy_sampler_run`). The forward's tensors are freed before the sampler runs,
  so the larger of the two peaks counts:
  - forward: T x (2 hidden + 3 I / tp) x 2 bytes. The residual stream and the layer's input
    (hidden each), the MLP's gate-up output (2 I over tp) and its activation (I over tp), in
    bf16 (vllm/model_executor/models/llama.py, `LlamaMLP`). For MoE, I is the larger of the
    dense intermediate size and top-k x the experts' intermediate size (fused_moe's caches hold
    top-k rows per token).
  - sampler: max_num_seqs x vocab x 16 bytes: the float32 logits, and their sort's float32
    values and int64 indices (vllm/v1/sample/ops/topk_topp_sampler.py, `apply_top_k_top_p`;
    the dummy sampler sets top-k and top-p).
- **CUDA graphs and non-torch memory** (NCCL and custom all-reduce buffers, cuBLAS workspaces,
  the attention backend's buffers): one constant per GPU, `runtime_bytes`. vLLM measures these
  (`profile_cudagraph_memory`, `non_torch_increase`), so kvsched fits one number instead:
  1.35 GiB, the median residual over the train/val runs of the sim-to-real benchmark (vLLM
  v0.15.1 on H100, dense models, TP 1 to 4; docs/fidelity.md).

Deviations: vLLM profiles the vision encoder of a multimodal model too, and a quantisation
method's own workspaces; neither is estimated (docs/fidelity.md: Llama-4-Scout's gap).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvsched.errors import KvschedError
from kvsched.hardware import GPU, Model
from kvsched.layout import ACT_BYTES, PLAIN, Layout, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu

GIB = 2 ** 30
RUNTIME_BYTES = int(1.35 * GIB)     # CUDA graphs + non-torch memory per GPU (module docstring)
SAMPLER_BYTES = 4 + 4 + 8           # per logit: float32 logits, sorted float32 values, int64 indices


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings vLLM's profile run uses: its token budget and its sequence cap."""
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 40:
                raise KvschedError(f"{name} must be a whole number from 1 to 2**40, got {v!r}")


def default_limits(gpu: GPU) -> EngineLimits:
    """vLLM's defaults for the GPU (policies/__init__.py, `engine_defaults`)."""
    from kvsched.policies import engine_defaults
    d = engine_defaults(gpu)
    return EngineLimits(d["max_num_batched_tokens"], d["max_num_seqs"])


def mlp_width(model: Model) -> float:
    """I of the forward's activation (module docstring): the MLP's intermediate size, or for MoE
    the larger of it and top-k x one expert's (3 hidden x I' parameters per expert)."""
    if not model.experts:
        return model.intermediate
    per_expert = model.expert_params / (model.moe_layers * model.experts * 3 * model.hidden)
    return max(model.intermediate, model.experts_per_token * per_expert)


def activation_bytes(model: Model, layout: Layout, limits: EngineLimits) -> float:
    """The profile run's peak activation on one GPU: max(forward, sampler) (module docstring)."""
    forward = limits.max_num_batched_tokens * (2 * model.hidden + 3 * mlp_width(model) / layout.tp) * ACT_BYTES
    sampler = limits.max_num_seqs * model.vocab * SAMPLER_BYTES
    return max(forward, sampler)


def profile(model: Model, gpu: GPU, memory_utilization: float, layout: Layout = PLAIN,
            limits: EngineLimits | None = None) -> dict[str, float]:
    """Each term of the formula (module docstring) in bytes per GPU, and `kv` what is left."""
    if not 0 < memory_utilization <= 1:
        raise KvschedError(f"memory utilization must be in (0, 1], got {memory_utilization}")
    limits = limits or default_limits(gpu)
    terms = {"requested": gpu.memory_bytes * memory_utilization,
             "weights": weight_bytes_per_gpu(model, layout),
             "activation": activation_bytes(model, layout, limits),
             "runtime": float(RUNTIME_BYTES)}
    terms["kv"] = terms["requested"] - terms["weights"] - terms["activation"] - terms["runtime"]
    return terms


def kv_capacity_tokens(model: Model, gpu: GPU, memory_utilization: float = 0.9, layout: Layout = PLAIN,
                       limits: EngineLimits | None = None) -> int:
    """Tokens of KV cache vLLM's profile leaves on each GPU (`profile`), x dp (each data-parallel
    rank caches its own requests: layout.py)."""
    terms = profile(model, gpu, memory_utilization, layout, limits)
    on = f"{gpu.name}" + (f" with {layout.describe()}" if layout != PLAIN else "")
    if terms["requested"] <= terms["weights"]:
        raise KvschedError(f"{model.name} weights ({terms['weights'] / GIB:.1f} GiB per GPU) do not fit in "
                           f"{memory_utilization:.0%} of {on} ({gpu.memory_gib:g} GiB)")
    if terms["kv"] <= 0:
        raise KvschedError(
            f"{model.name} leaves no KV cache in {memory_utilization:.0%} of {on} ({gpu.memory_gib:g} GiB): "
            f"weights {terms['weights'] / GIB:.1f} GiB, activation {terms['activation'] / GIB:.2f} GiB and "
            f"CUDA graphs + non-torch memory {terms['runtime'] / GIB:.2f} GiB per GPU")
    return int(terms["kv"] // kv_bytes_per_token_per_gpu(model, layout)) * layout.dp
