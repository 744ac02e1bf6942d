"""How one replica lays a model over its GPUs: tensor, pipeline and expert parallelism,
data-parallel attention, and the number formats of weights and KV cache (issue "Today's
deployments", items 2 and 4). The formulas (docs/hardware.md gives each with its source):

- GPUs per replica: tp x pp x dp, where dp = ep / tp with `dp_attention` (vLLM's
  --data-parallel-size with --enable-expert-parallel: attention data-parallel, experts spread
  over all dp GPUs; modelled with tp 1) and 1 without it (ep is then 1, or tp: vLLM's
  --enable-expert-parallel with tensor parallelism spreads whole experts over the tp GPUs
  instead of splitting each).
- Weights per GPU: the non-expert weights split over tp x pp; the routed experts split over
  tp x pp (ep 1), else the busiest GPU's ceil(E / ep) whole experts over pp; embeddings and an
  untied LM head stay 16-bit under weight quantisation (vLLM's quantisation methods leave
  VocabParallelEmbedding and ParallelLMHead unquantised).
- KV bytes per token on one GPU: the busiest stage's ceil(layers / pp) layers, each holding
  max(1, kv_heads // tp) KV heads (vllm/config/model.py, `get_num_kv_heads`: heads are replicated
  when tp exceeds them); under MLA every TP rank holds the whole latent (`get_num_kv_heads`
  returns 1), x the KV element bytes (`--kv-dtype fp8`: 1 byte, vllm/utils/torch_utils.py
  STR_DTYPE_TO_TORCH_DTYPE).
- KV capacity of a replica: what vLLM's memory profile leaves on one GPU (memory_profile.py), x dp
  (each DP rank caches its own requests; kvsched's one scheduler sees the ranks' caches as one,
  see docs/hardware.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvsched.errors import KvschedError
from kvsched.hardware import Model

# bytes per weight: the packed values plus their scales (AWQ/GPTQ int4: a 16-bit scale and a
# 4-bit zero per group of 128; NVFP4: an FP8 scale per 16; MXFP4: an 8-bit scale per 32)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5 + 2.5 / 128, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}
# the GEMMs' number format: int4 is weight-only (W4A16: bf16 tensor cores), the FP4 formats run
# at the FP4 rate where the GPU has one (else bf16: GPU.rate)
COMPUTE_FORMAT = {"bf16": "bf16", "fp8": "fp8", "int4": "bf16", "nvfp4": "fp4", "mxfp4": "fp4"}
KV_BYTES = {"auto": 2, "bf16": 2, "fp8": 1}      # "auto": the model's 16-bit dtype, as vLLM's default
ACT_BYTES = 2                                     # bf16 activations on every link
MAX_GPUS = 1024


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_attention: bool = False
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"

    def check(self, model: Model | None = None) -> Layout:
        """The layout, checked (and against `model` when given); every problem names its flag."""
        for flag, v in (("--tp", self.tp), ("--pp", self.pp), ("--ep", self.ep)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_GPUS:
                raise KvschedError(f"{flag} must be a whole number from 1 to {MAX_GPUS}, got {v!r}")
        if not isinstance(self.weight_dtype, str) or self.weight_dtype not in WEIGHT_BYTES:
            raise KvschedError(f"--weight-dtype must be one of {', '.join(WEIGHT_BYTES)}, got {self.weight_dtype!r}")
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in KV_BYTES:
            raise KvschedError(f"--kv-dtype must be one of {', '.join(KV_BYTES)}, got {self.kv_dtype!r}")
        if not isinstance(self.dp_attention, bool):
            raise KvschedError(f"--dp-attention is true or false, got {self.dp_attention!r}")
        if self.dp_attention:
            if self.tp > 1:     # vLLM then runs sequence-parallel MoE and more collectives (not modelled)
                raise KvschedError(f"--dp-attention is modelled with --tp 1 (attention data-parallel over --ep "
                                   f"ranks), got --tp {self.tp}: vLLM's sequence-parallel MoE for tp > 1 is not modelled")
            if self.ep < 2 or self.ep % self.tp:
                raise KvschedError(f"--dp-attention needs --ep a multiple of --tp and at least 2 (ep = tp x the "
                                   f"attention's data-parallel ranks), got --ep {self.ep} --tp {self.tp}")
        elif self.ep not in (1, self.tp):
            raise KvschedError(f"--ep {self.ep} without --dp-attention must be 1 or --tp ({self.tp}): experts "
                               "are spread over the tensor-parallel GPUs (vLLM's --enable-expert-parallel)")
        if self.gpus > MAX_GPUS:
            raise KvschedError(f"a replica of {self.gpus} GPUs (tp x pp x dp) is more than {MAX_GPUS}")
        if model is not None:
            if self.ep > 1 and not model.experts:
                raise KvschedError(f"--ep {self.ep}: {model.name} has no experts (expert parallelism is for MoE)")
            if self.pp > model.layers:
                raise KvschedError(f"--pp {self.pp} is more than {model.name}'s {model.layers} layers")
            if model.heads % self.tp:
                raise KvschedError(f"--tp {self.tp} does not divide {model.name}'s {model.heads} attention heads")
            kv = model.kv_heads
            if not model.mla and kv % self.tp and self.tp % kv:     # vLLM's QKVParallelLinear
                raise KvschedError(f"--tp {self.tp} neither divides nor is a multiple of {model.name}'s {kv} KV heads "
                                   "(vLLM splits or replicates them whole)")
            if model.experts and self.ep > model.experts:
                raise KvschedError(f"--ep {self.ep} is more than {model.name}'s {model.experts} experts")
        return self

    @property
    def dp(self) -> int:
        return self.ep // self.tp if self.dp_attention else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def plain(self) -> bool:
        """One GPU, nothing sharded: no collective, the single-GPU roofline."""
        return self.gpus == 1

    def describe(self) -> str:
        parts = [f"tp={self.tp}"] + [f"{k}={getattr(self, k)}" for k in ("pp", "ep") if getattr(self, k) > 1]
        parts += ["dp-attention"] * self.dp_attention
        parts += [f"weights {self.weight_dtype}"] * (self.weight_dtype != "bf16")
        parts += [f"kv {self.kv_dtype}"] * (self.kv_dtype != "auto")
        return " ".join(parts)


PLAIN = Layout()


def weight_bytes_per_gpu(model: Model, layout: Layout) -> float:
    """One GPU's weights: the non-expert weights, Emb x 2 + (P - Emb - X) x w, over tp x pp; the
    routed experts X x w over tp x pp when each is split over the TP GPUs (ep 1), else the
    busiest GPU's ceil(E / ep) whole experts of E over pp (vLLM's `determine_expert_map` gives
    the first E mod ep ranks one more). P: parameters, Emb: embeddings' and LM head's (16-bit),
    X: routed experts', w: the weight format's bytes. One bf16 GPU's is the model's
    `weight_bytes` itself (an int stays one)."""
    w = WEIGHT_BYTES[layout.weight_dtype]
    shards = layout.tp * layout.pp
    if w == model.dtype_bytes and layout.ep == 1:
        total = model.weight_bytes
        return total / shards if shards > 1 else total
    x = model.expert_params
    rest = model.embedding_params * model.dtype_bytes + (model.params - model.embedding_params - x) * w
    return rest / shards + expert_bytes_per_gpu(model, layout) / layout.pp


def expert_bytes_per_gpu(model: Model, layout: Layout) -> float:
    """The routed experts one GPU holds over all its stages' layers (weight_bytes_per_gpu)."""
    if not model.experts:
        return 0.0
    x = model.expert_params * WEIGHT_BYTES[layout.weight_dtype]
    if layout.ep == 1:
        return x / layout.tp
    return x * -(-model.experts // layout.ep) / model.experts


def kv_bytes_per_token_per_gpu(model: Model, layout: Layout) -> int:
    """KV bytes one token takes on one GPU of the busiest pipeline stage (module docstring); the
    model's own figure on one GPU with its own dtype."""
    if layout.tp == 1 and layout.pp == 1 and layout.kv_dtype == "auto":
        return model.kv_bytes_per_token
    per_layer = model.kv_bytes_per_token // model.layers          # all heads, the model's dtype
    if not model.mla and layout.tp > 1:
        per_layer = per_layer // model.kv_heads * max(1, model.kv_heads // layout.tp)
    if layout.kv_dtype != "auto":
        per_layer = per_layer * KV_BYTES[layout.kv_dtype] // model.dtype_bytes
    return math.ceil(model.layers / layout.pp) * per_layer


def kv_bytes_per_token(model: Model, layout: Layout) -> int:
    """The KV of one token over the whole replica, once (what a disaggregated prefill sends)."""
    if layout.kv_dtype == "auto":
        return model.kv_bytes_per_token
    return model.kv_bytes_per_token * KV_BYTES[layout.kv_dtype] // model.dtype_bytes


def layout_summary(layout: Layout) -> dict:
    """The layout's figures for summary.json (only what differs from one bf16 GPU)."""
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dp_attention": layout.dp_attention,
            "gpus_per_replica": layout.gpus, "weight_dtype": layout.weight_dtype, "kv_dtype": layout.kv_dtype}
