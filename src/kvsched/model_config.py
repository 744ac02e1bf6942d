"""A model from its Hugging Face `config.json` (issue "Today's deployments", item 1): `--model`
takes a path to one, or to a folder holding one.

Read from the config: layers, hidden size, attention and KV heads, head size, MLP and vocab
sizes, context length; MoE (routed experts, experts per token, shared experts, dense first
layers); MLA (DeepSeek-V2/V3's latent KV). Computed from them:

- KV bytes per token, as vLLM 0.32 sizes a page (vllm/v1/kv_cache_interface.py,
  `AttentionSpec.page_size_bytes` per token and layer): num_kv_heads x (head_size +
  head_size_v) x dtype bytes, summed over the layers; MLA stores one latent vector per token
  and layer, `MLAAttentionSpec`: head_size = kv_lora_rank + qk_rope_head_dim, one head, no V
  (vllm/config/model.py: `get_head_size`, `get_num_kv_heads` returns 1 under MLA).
  Sliding-window layers store the same bytes per token (they hold fewer tokens; what that does
  to capacity is not modelled here).
- Parameters, total and touched per token, from the weight shapes of the architectures'
  modelling code (transformers' `modeling_llama`, `modeling_mixtral`, `modeling_qwen3_moe`,
  `modeling_deepseek_v3`): embeddings, an untied LM head, per layer the attention
  projections (q, k, v, o, with biases where `attention_bias`; MLA's q_a/q_b or q, kv_a, kv_b,
  o and their norms), the gated MLP (gate, up, down) or the router and experts, and the RMS
  norms. Multi-token-prediction layers (`num_nextn_predict_layers`) are left out, as vLLM
  does not load them for serving.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsched.errors import KvschedError
from kvsched.hardware import Model

CONFIG = "config.json"
BF16 = 2                    # bytes per weight and KV element (the catalogue's precision)
LARGEST = 2 ** 31           # above any dimension of a real config: a larger one is a mistake
# vLLM 0.32's MLA models whose weights are DeepSeek-V3's shapes (transformers_utils/
# model_arch_config_convertor.py, `is_deepseek_mla`); another config with kv_lora_rank (MiniCPM3
# stores full K and V) is refused, as are the caches vLLM adds beside them (below)
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
LLAMA4_TYPES = ("llama4", "llama4_text")
# a flag's default where the config leaves it out, by model_type, from the architecture's
# configuration class (transformers: configuration_llama4.py, Llama4Config/Llama4TextConfig)
# and Qwen2's, whose q, k and v projections always have biases (modeling_qwen2.py: bias=True)
CLASS_DEFAULTS = {"llama4": {"tie_word_embeddings": False}, "llama4_text": {"tie_word_embeddings": False},
                  "qwen2": {"qkv_bias": True}, "qwen2_moe": {"qkv_bias": True}}


def is_config_path(name: str) -> bool:
    """Whether `--model` names a file or folder rather than a catalogue entry."""
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).is_dir()


def read_model(path: str | Path, name: str | None = None) -> Model:
    """The Model a config.json describes (a path to the file, or to a folder holding one);
    `name` (a catalogue entry's) else the config's `_name_or_path` else the folder's."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvschedError(f"--model {path}: cannot read {p}: {exc.strerror or exc} (a Hugging Face id is "
                           "not downloaded: give the path of its config.json)") from None
    except UnicodeDecodeError:
        raise KvschedError(f"{p}: not UTF-8 text") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvschedError(f"{p}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise KvschedError(f"{p}: a model config is a JSON object")
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw   # multimodal wrappers
    if name is None:
        given = raw.get("_name_or_path")
        name = given if isinstance(given, str) and given else (p.parent.name if p.name == CONFIG else p.stem)
    return _model(_Config(cfg, raw, p), name)


class _Config:
    """The config's fields, each checked when read: a missing or bad one names file and key."""

    def __init__(self, cfg: dict[str, Any], outer: dict[str, Any], path: Path) -> None:
        self.cfg, self.outer, self.path = cfg, outer, path

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def int(self, key: str, default: int | None = None, low: int = 1) -> int:
        v = self.cfg.get(key, default)
        if v is None:
            raise KvschedError(f"{self.path}: missing key {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < LARGEST:
            raise KvschedError(f"{self.path}: {key} must be a whole number from {low} to {LARGEST - 1}, got {v!r}")
        return v

    def flag(self, key: str, required: bool = False) -> bool:
        """A true/false key (a multimodal config's may be beside its text_config); one whose
        default differs between architectures is `required`."""
        v = self.cfg.get(key, self.outer.get(key))
        if v is None:
            kind = self.outer.get("model_type", self.cfg.get("model_type"))
            v = CLASS_DEFAULTS.get(kind if isinstance(kind, str) else "", {}).get(key)
        if v is None and required:
            raise KvschedError(f"{self.path}: {key} is not in the config, and its default depends on the "
                               "architecture: add it")
        if v is not None and not isinstance(v, bool):
            raise KvschedError(f"{self.path}: {key} must be true or false, got {v!r}")
        return bool(v)

    def refuse_unmodelled(self) -> None:
        """What vLLM stores or loads differently from what this module computes, refused."""
        kind = self.cfg.get("model_type")
        why = None
        if self.has("index_topk"):
            why = "its indexer cache beside the MLA latent (vLLM's DeepseekV32IndexerCache)"
        elif self.has("kv_lora_rank") and kind not in MLA_TYPES:
            why = f"kv_lora_rank outside vLLM's DeepSeek MLA models ({', '.join(MLA_TYPES)})"
        elif any(t not in ("full_attention", "sliding_attention") for t in self.cfg.get("layer_types") or ()):
            why = "layers that are not attention (linear attention or state-space layers)"
        elif self.cfg.get("decoder_sparse_step", 1) != 1 or self.cfg.get("mlp_only_layers") or \
                self.cfg.get("moe_layer_freq", 1) != 1:
            why = "MoE layers placed by decoder_sparse_step, mlp_only_layers or moe_layer_freq (only every layer, " \
                  "first_k_dense_replace or interleave_moe_layer_step are counted)"
        if why:
            raise KvschedError(f"{self.path}: model_type {kind!r} is not modelled yet: {why}")


def _model(c: _Config, name: str) -> Model:
    c.refuse_unmodelled()
    layers, hidden, heads = c.int("num_hidden_layers"), c.int("hidden_size"), c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads)
    if kv_heads > heads or heads % kv_heads:
        raise KvschedError(f"{c.path}: num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    head_dim = c.int("head_dim", hidden // heads)
    vocab, inter = c.int("vocab_size"), c.int("intermediate_size")
    mla = c.has("kv_lora_rank")
    if mla:
        kv_per_layer = c.int("kv_lora_rank") + c.int("qk_rope_head_dim")           # one latent per token
        attn = _mla_params(c, hidden, heads)
    else:
        kv_per_layer = kv_heads * 2 * head_dim                                      # K and V
        bias = c.flag("attention_bias") or c.flag("qkv_bias")         # q, k, v biases (o's left out)
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        attn += (heads + 2 * kv_heads) * head_dim if bias else 0
        attn += 2 * head_dim if c.cfg.get("model_type") in ("qwen3", "qwen3_moe") else 0   # q_norm, k_norm
    dense_inter = c.int("intermediate_size_mlp") if c.has("intermediate_size_mlp") else inter   # Llama-4
    dense = attn + 3 * hidden * dense_inter + 2 * hidden    # a dense layer: attention, gated MLP, 2 norms
    moe, moe_layers = _moe(c, hidden, layers)
    if moe is None:
        total = active = layers * dense
        experts = top_k = routed_total = 0
    else:
        routed, per_token, shared, router, experts, top_k = moe
        n = moe_layers
        total = (layers - n) * dense + n * (attn + routed + shared + router + 2 * hidden)
        active = (layers - n) * dense + n * (attn + per_token + shared + router + 2 * hidden)
        routed_total = n * routed
    tied = c.flag("tie_word_embeddings", required=True)
    embedding = vocab * hidden * (1 if tied else 2)         # embeddings and an untied head
    outer = embedding + hidden                              # and the final norm
    # under MLA the cache holds one "head" of kv_lora_rank + qk_rope_head_dim per token and layer
    return Model(name, layers, hidden, heads, 1 if mla else kv_heads, kv_per_layer if mla else head_dim,
                 inter, vocab, float(total + outer), c.int("max_position_embeddings"),
                 active_params=float(active + outer) if moe is not None else None,
                 kv_token_bytes=layers * kv_per_layer * BF16, experts=experts, experts_per_token=top_k,
                 expert_params=float(routed_total), embedding_params=float(embedding), mla=mla,
                 moe_layers=moe_layers if moe is not None else 0,
                 mla_dims=(c.int("qk_nope_head_dim") + c.int("qk_rope_head_dim"), c.int("v_head_dim"),
                           c.int("kv_lora_rank")) if mla else (0, 0, 0))


def _mla_params(c: _Config, hidden: int, heads: int) -> int:
    """DeepSeek-V2/V3 attention (modeling_deepseek_v3): q through a low-rank q_a/q_b pair (or
    one projection), kv_a to the latent and the rope key, kv_b from the latent to the heads'
    nope keys and values, o; the two latent RMS norms."""
    nope, rope, v = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    kv_rank = c.int("kv_lora_rank")
    q = heads * (nope + rope)
    if c.has("q_lora_rank"):
        rank = c.int("q_lora_rank")
        q_params = hidden * rank + rank + rank * q
    else:
        q_params = hidden * q
    return q_params + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + heads * v * hidden


def _moe(c: _Config, hidden: int, layers: int) -> tuple[tuple[int, int, int, int, int, int] | None, int]:
    """(routed expert parameters, those a token touches, shared experts', router's, routed
    experts, experts per token) per MoE layer, or None for a dense model; and the number of MoE
    layers: all but DeepSeek's `first_k_dense_replace` first ones, or every
    `interleave_moe_layer_step`-th (Llama-4: modeling_llama4, layer i is MoE when (i + 1) %
    step == 0)."""
    experts = next((c.int(k) for k in ("n_routed_experts", "num_local_experts", "num_experts") if c.has(k)), None)
    if experts is None:
        return None, 0
    top_k = c.int("num_experts_per_tok")
    if top_k > experts:
        raise KvschedError(f"{c.path}: num_experts_per_tok {top_k} is more than the {experts} experts")
    inter = c.int("moe_intermediate_size") if c.has("moe_intermediate_size") else c.int("intermediate_size")
    expert = 3 * hidden * inter
    shared = c.int("n_shared_experts", 0, low=0) * expert
    if c.has("shared_expert_intermediate_size"):                 # Qwen2-MoE: one shared expert and its gate
        shared += 3 * hidden * c.int("shared_expert_intermediate_size") + hidden
    if c.cfg.get("model_type") in LLAMA4_TYPES:                  # Llama-4: one shared expert of the experts' size
        shared += expert
    if c.has("interleave_moe_layer_step"):
        step = c.int("interleave_moe_layer_step")
        moe_layers = layers // step
    else:
        moe_layers = layers - min(c.int("first_k_dense_replace", 0, low=0), layers)
    return (experts * expert, top_k * expert, shared, hidden * experts, experts, top_k), moe_layers
