"""A model from its Hugging Face config.json (kvsched/model_config.py): KV bytes per token as
vLLM sizes them, parameters as the published totals, errors naming file and key."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvsched.errors import KvschedError
from kvsched.hardware import get_model

LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
         "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
CONFIGS = {
    "llama-3-8b": LLAMA,
    "llama-3.1-70b": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                      "num_hidden_layers": 80, "max_position_embeddings": 131072},
    "mixtral-8x7b": {**LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
                     "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3-30b-a3b": {**LLAMA, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 151936,
                      "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
                      "attention_bias": False},
    "deepseek-v3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "num_hidden_layers": 61, "first_k_dense_replace": 3,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "n_group": 8,
                    "topk_group": 4, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5},
}
# Hand-worked KV bytes per token (bf16): layers x KV heads x (K + V head size) x 2 bytes; MLA
# one latent of kv_lora_rank + qk_rope_head_dim per layer.
KV = {"llama-3-8b": 32 * 8 * 256 * 2, "llama-3.1-70b": 80 * 8 * 256 * 2, "mixtral-8x7b": 32 * 8 * 256 * 2,
      "qwen3-30b-a3b": 48 * 4 * 256 * 2, "deepseek-v3": 61 * (512 + 64) * 2}
# Published parameter counts (total, active), from the model cards.
PUBLISHED = {"llama-3-8b": (8.03e9, None), "llama-3.1-70b": (70.6e9, None), "mixtral-8x7b": (46.7e9, 12.9e9),
             "qwen3-30b-a3b": (30.5e9, 3.3e9), "deepseek-v3": (671e9, 37e9)}


def write(tmp_path, name: str, config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("name", CONFIGS)
def test_kv_bytes_and_parameters(tmp_path, name):
    folder = write(tmp_path, name, CONFIGS[name])
    m = get_model(folder)
    assert get_model(folder + "/config.json") == m                   # the file or its folder
    assert m.name == name and m.kv_bytes_per_token == KV[name]
    total, active = PUBLISHED[name]
    assert m.params == pytest.approx(total, rel=0.01)
    assert (m.active_params is None) == (active is None)
    if active is not None:
        assert m.active_params == pytest.approx(active, rel=0.02)


def test_a_config_agrees_with_the_catalogue(tmp_path):
    m, known = get_model(write(tmp_path, "l3", LLAMA)), get_model("llama-3-8b")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab, m.kv_bytes_per_token) == (
        known.layers, known.hidden, known.heads, known.kv_heads, known.head_dim, known.intermediate, known.vocab,
        known.kv_bytes_per_token)
    assert m.params == pytest.approx(known.params, rel=1e-3)


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"), ("{not json", ":1: not JSON"), ("[1, 2]", "a model config is a JSON object"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"}), "missing key 'hidden_size'"),
    (json.dumps({**LLAMA, "num_hidden_layers": 0}), "num_hidden_layers must be a whole number from 1 to 2147483647, "
                                                      "got 0"),
    (json.dumps({**LLAMA, "num_hidden_layers": 10 ** 30}), "num_hidden_layers must be a whole number"),
    (json.dumps({**LLAMA, "vocab_size": 10 ** 400}), "vocab_size must be a whole number"),
    (json.dumps({**LLAMA, "num_attention_heads": "32"}), "num_attention_heads must be a whole number"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"}),
     "tie_word_embeddings is not in the config, and its default depends on the architecture"),
    (json.dumps({**LLAMA, "tie_word_embeddings": "false"}), "tie_word_embeddings must be true or false"),
    (b"\xff\xfe{}", "not UTF-8"),
    (json.dumps({**CONFIGS["deepseek-v3"], "index_topk": 2048}), "not modelled yet: its indexer cache"),
    (json.dumps({**CONFIGS["deepseek-v3"], "model_type": "minicpm3"}), "not modelled yet: kv_lora_rank outside"),
    (json.dumps({**CONFIGS["mixtral-8x7b"], "num_experts_per_tok": 16}), "num_experts_per_tok 16 is more than the 8"),
    (json.dumps({**LLAMA, "num_key_value_heads": 5}), "num_key_value_heads 5 must divide"),
    (json.dumps({**LLAMA, "num_key_value_heads": 64}), "num_key_value_heads 64 must divide"),
    (json.dumps({**CONFIGS["qwen3-30b-a3b"], "decoder_sparse_step": 2}), "decoder_sparse_step"),
    (json.dumps({**CONFIGS["qwen3-30b-a3b"], "mlp_only_layers": [0, 1]}), "mlp_only_layers"),
    (json.dumps({**LLAMA, "layer_types": ["full_attention", "linear_attention"]}), "not modelled yet: layers that"),
])
def test_a_bad_config_is_one_error_naming_it(tmp_path, content, message):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(KvschedError, match=message):
        get_model(str(path))


def test_an_unknown_name_says_a_config_path_is_taken():
    with pytest.raises(KvschedError, match="unknown model 'llama-9'.*config.json"):
        get_model("llama-9")


def test_simulate_runs_a_config(tmp_path):
    folder = write(tmp_path, "qw", CONFIGS["qwen3-30b-a3b"])
    ok = subprocess.run([sys.executable, "-m", "kvsched", "simulate", "--model", folder, "--gpu", "h200",
                         "--num-requests", "20", "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model"] == "qw"
    bad = subprocess.run([sys.executable, "-m", "kvsched", "simulate", "--model", str(tmp_path / "none.json"),
                          "--num-requests", "5"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot read" in bad.stderr


@pytest.mark.vllm
@pytest.mark.parametrize("name", CONFIGS)
def test_kv_bytes_are_vllm_s(tmp_path, name):
    """vLLM 0.32 as the oracle: its ModelConfig's per-GPU KV heads, head size and layers (MLA:
    one head of kv_lora_rank + qk_rope_head_dim and no V), 2 bytes each at bf16."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig
    folder = write(tmp_path, name, CONFIGS[name])
    mc = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16")
    pc = ParallelConfig(tensor_parallel_size=1)
    head = mc.get_head_size()
    vllm_bytes = mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * (head + (0 if mc.use_mla else head)) * 2
    assert get_model(folder).kv_bytes_per_token == vllm_bytes


def test_a_multimodal_config_s_text_model(tmp_path):
    """The text model of a multimodal wrapper, with a flag the wrapper holds (tied embeddings)."""
    text = {k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"}
    m = get_model(write(tmp_path, "vl", {"model_type": "llava", "tie_word_embeddings": True, "text_config": text}))
    untied = get_model(write(tmp_path, "l3", LLAMA))
    assert m.kv_bytes_per_token == untied.kv_bytes_per_token
    assert untied.params - m.params == LLAMA["vocab_size"] * LLAMA["hidden_size"]      # one matrix fewer


def _bundled():
    from kvsched.hardware import MODELS
    return list(MODELS)


@pytest.mark.vllm
@pytest.mark.parametrize("name", _bundled())
def test_every_bundled_config_s_kv_bytes_per_gpu_are_vllm_s(tmp_path, name):
    """Every bundled config through vLLM 0.32's ModelConfig: the KV bytes one token takes on one
    GPU (its layers x its KV heads at that TP, or MLA's latent, x (K + V) head size x the cache
    dtype's bytes) at tp 1, 2 and 8, with the model's dtype and an FP8 cache. The checkpoint's
    quantization_config is left out: vLLM would check its kernels on this CPU, and it does not
    change the cache's shape. Llama-4's multimodal wrapper goes in as its text model
    (Llama4ForCausalLM, whose cache it is): vLLM's vision half needs torchvision."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig
    from kvsched.hardware import DATA
    from kvsched.layout import Layout, kv_bytes_per_token_per_gpu
    cfg = json.loads((DATA / "models" / f"{name}.json").read_text())
    cfg.pop("quantization_config", None)
    if cfg.get("model_type") == "llama4":
        cfg = {**cfg["text_config"], "architectures": ["Llama4ForCausalLM"], "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = get_model(name)
    for kv_dtype, elem in (("auto", 2), ("fp8", 1)):
        mc = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16")
        for tp in (1, 2, 8):
            if model.heads % tp:
                continue
            pc = ParallelConfig(tensor_parallel_size=tp)
            head = mc.get_head_size()
            vllm_bytes = mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * (head + (0 if mc.use_mla else head)) * elem
            assert kv_bytes_per_token_per_gpu(model, Layout(tp=tp, kv_dtype=kv_dtype)) == vllm_bytes, (tp, kv_dtype)


def test_bundled_models_match_their_published_sizes():
    """Parameters from the bundled configs against the publishers' figures (billions): totals,
    and for MoE the active ones (Llama-4-Scout's 17B active; its 109B total counts the vision
    encoder, not read here)."""
    published = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "mixtral-8x7b": 46.7,
                 "mixtral-8x22b": 140.6, "deepseek-v3": 671, "qwen3-235b-a22b": 235.1, "qwen3-32b": 32.8,
                 "gpt-oss-120b": 116.8, "gpt-oss-20b": 20.9, "qwen2-7b": 7.62, "kimi-k2": 1026,
                 "mistral-small-24b": 23.57}
    for name, billions in published.items():
        assert get_model(name).params / 1e9 == pytest.approx(billions, rel=0.004), name
    assert get_model("llama-4-scout").active / 1e9 == pytest.approx(17.2, rel=0.01)
    assert get_model("qwen3-235b-a22b").active / 1e9 == pytest.approx(22.2, rel=0.01)
