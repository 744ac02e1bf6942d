"""vLLM's memory profile (kvsched/memory_profile.py) and --num-gpu-blocks."""
import json

import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model, kv_capacity_tokens
from kvsched.layout import Layout
from kvsched.memory_profile import RUNTIME_BYTES, EngineLimits, activation_bytes, profile
from kvsched.run import Scenario, engine_limits, simulate
from kvsched.workload.lengths import Fixed
from kvsched.workload.synthetic import synthetic

GIB = 2 ** 30


def test_llama_3_1_8b_on_h100_at_0_9_and_2048_batched_tokens_is_the_documented_formula():
    """KV = 0.9 x memory - weights - max(forward, sampler) - 1.35 GiB, over 128 KiB per token
    (docs/fidelity.md), worked by hand: H100 SXM 79.6 GiB = 85,469,849,190.4 bytes; weights
    8,030,261,248 x 2; forward 2,048 x (2 x 4,096 + 3 x 14,336) x 2 = 209,715,200; sampler
    max_num_seqs x 128,256 x 16 = 2,101,346,304 at vLLM's 1,024 sequences (larger: it counts),
    262,668,288 at 128."""
    m, g = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    assert RUNTIME_BYTES == int(1.35 * GIB) == 1449551462
    for seqs, sampler, tokens in ((1024, 2_101_346_304, 437_251), (128, 262_668_288, 451_279)):
        limits = EngineLimits(2048, seqs)
        kv = 85_469_849_190.4 * 0.9 - 8_030_261_248 * 2 - max(209_715_200, sampler) - 1_449_551_462
        assert int(kv // (2 * 32 * 8 * 128 * 2)) == tokens
        assert activation_bytes(m, Layout(), limits) == sampler
        assert kv_capacity_tokens(m, g, 0.9, limits=limits) == tokens
    assert profile(m, g, 0.9, limits=EngineLimits(2048, 1024))["weights"] == 8_030_261_248 * 2


def test_the_forward_pass_counts_when_it_is_the_larger_peak():
    m, g = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    big = EngineLimits(65536, 1)
    assert activation_bytes(m, Layout(), big) == 65536 * (2 * 4096 + 3 * 14336) * 2
    assert activation_bytes(m, Layout(tp=2), big) == 65536 * (2 * 4096 + 3 * 14336 / 2) * 2
    small = kv_capacity_tokens(m, g, 0.9, limits=big)
    assert small < kv_capacity_tokens(m, g, 0.9, limits=EngineLimits(2048, 1))


def test_a_run_profiles_with_its_own_engine_limits():
    """simulate sizes the KV cache with the run's max_num_batched_tokens and max_num_seqs."""
    g = get_gpu("h100-sxm")
    assert engine_limits("vllm-v1", {"max_num_seqs": 64}, g) == EngineLimits(8192, 64)
    assert engine_limits("eb", None, g) == EngineLimits(8192, 1024)      # vLLM's defaults on >= 70 GiB
    w = synthetic(Fixed(100), Fixed(10), 5.0, 20, seed=1)
    sc = Scenario(w, model="llama-3.1-8b", gpu="h100-sxm")
    runs = {s: simulate(sc, "vllm-v1", {"max_num_seqs": s, "max_num_batched_tokens": 2048}) for s in (128, 1024)}
    for s, r in runs.items():
        assert r.summary["kv_capacity_tokens"] == (kv_capacity_tokens(
            get_model("llama-3.1-8b"), g, 0.9, limits=EngineLimits(2048, s)) // 16 - 1) * 16


def test_weights_that_fit_but_leave_nothing_beside_the_profile_are_refused():
    m = get_model("llama-3.1-8b")
    g = get_gpu("l4")
    with pytest.raises(KvschedError, match="leaves no KV cache .* CUDA graphs"):
        kv_capacity_tokens(m, g, 0.72, limits=EngineLimits(2048, 1024))
    with pytest.raises(KvschedError, match="do not fit"):
        kv_capacity_tokens(m, g, 0.3)


def test_num_gpu_blocks_sets_the_capacity_as_vllm_does(tmp_path):
    runner = CliRunner()
    base = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-requests", "20", "--json"]
    r = runner.invoke(app, base + ["--num-gpu-blocks", "1000"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_capacity_tokens"] == 999 * 16
    for extra, msg in ((["--num-gpu-blocks", "1"], "--num-gpu-blocks must be a whole number from 2"),
                       (["--num-gpu-blocks", "10", "--kv-capacity", "5000"], "not both")):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 2 and msg in r.output, r.output


def test_the_cli_profiles_with_its_set_limits():
    """--set's texts are typed by the policy before the profile reads them (review finding)."""
    base = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-requests", "20", "--json",
            "--set", "max_num_batched_tokens=2048"]
    r = CliRunner().invoke(app, base + ["--set", "max_num_seqs=128"])
    assert r.exit_code == 0, r.output
    m, g = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    expected = (kv_capacity_tokens(m, g, 0.9, limits=EngineLimits(2048, 128)) // 16 - 1) * 16
    assert json.loads(r.stdout)["kv_capacity_tokens"] == expected == (451_279 // 16 - 1) * 16


def test_a_gpu_file_sets_the_cpu_terms(tmp_path):
    from kvsched.cost.roofline import RooflineCost
    from kvsched.hardware import read_gpu
    from kvsched.hardware import DATA
    src = DATA / "gpus" / "h100-sxm.toml"
    f = tmp_path / "mine.toml"
    f.write_text(src.read_text().replace("[roofline]", "[roofline]\ncpu_per_request = 1e-5\ncpu_per_token = 0", 1))
    g = read_gpu(f)
    c = RooflineCost(get_model("llama-3.1-8b"), g)
    assert (c.cpu_per_request, c.cpu_per_token) == (1e-5, 0.0)
    f.write_text(src.read_text().replace("[roofline]", "[roofline]\ncpu_per_request = -1", 1))
    with pytest.raises(KvschedError, match="cpu_per_request"):
        read_gpu(f)
