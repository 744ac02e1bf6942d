"""A workload through the real vLLM engine: a random-weight model built locally (no download),
requests sent at their arrival times, every output token time-stamped, figures as kvsched's.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), stepped by `serve()`:
before each step, every request whose arrival time has passed is added; when nothing is in the
engine, it sleeps until the next arrival. A token is stamped when the step that made it returns,
as a client would see it streamed. TTFT, TPOT and E2EL are then computed by `metrics.summarize`
from the scheduled arrival times, as `vllm bench serve` computes them from its send times
(TPOT excludes the first token).

A kvsched policy runs inside the engine through `engines/vllm_scheduler.py` (`policy=`), which
also writes the step log that `kvsched calibrate` fits. vLLM is imported lazily, here only.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.engines.vllm_replay import Limits, import_vllm
from kvsched.errors import KvschedError
from kvsched.metrics import GapHistogram, RunRecords, summarize

# A small Llama: a few ms per step on a CPU core, large enough that step time grows with tokens.
TINY_LLAMA_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=4, vocab_size=1000, max_position_embeddings=8192,
                        bos_token_id=1, eos_token_id=2)


def build_random_model(path: Path, seed: int = 0, **shape: Any) -> Path:
    """A Llama with random weights (transformers' `LlamaForCausalLM`), saved to `path`;
    `shape` overrides TINY_LLAMA_SHAPE (e.g. a real model's config for a GPU run). No tokenizer:
    engines run it with `skip_tokenizer_init`. The same seed gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = {**TINY_LLAMA_SHAPE, **shape}
    marker = path / "kvsched-model.json"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, **cfg}:
        return path
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    marker.write_text(json.dumps({"seed": seed, **cfg}))
    return path


@dataclass
class ServeOptions:
    """The engine's settings (vLLM's names). Block size: vLLM's CPU attention needs a multiple
    of 32."""
    limits: Limits
    policy: str | None = None            # a kvsched policy through the adapter; None: vLLM's own scheduler
    policy_params: dict[str, Any] | None = None
    step_log: Path | None = None         # KVSCHED_STEP_LOG (only with a policy: vllm-v1 logs vLLM's batches)
    dtype: str = "float32"
    seed: int = 0


def make_engine(model_dir: Path, opts: ServeOptions):
    """vLLM's LLMEngine in this process, with the kvsched adapter when a policy is given."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"    # the scheduler lives here: its log, its errors
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import_vllm()
    from vllm import EngineArgs, LLMEngine
    lim = opts.limits
    lim.check()
    if lim.max_model_len > (lim.num_gpu_blocks - 1) * lim.block_size:
        raise KvschedError(f"max_model_len {lim.max_model_len} exceeds the KV, (G - 1) x block size = "
                           f"{(lim.num_gpu_blocks - 1) * lim.block_size} tokens: vLLM refuses to start")
    extra: dict[str, Any] = {}
    env = {"KVSCHED_POLICY": None, "KVSCHED_POLICY_PARAMS": None, "KVSCHED_STEP_LOG": None}
    if opts.policy is not None:
        env.update(KVSCHED_POLICY=opts.policy, KVSCHED_POLICY_PARAMS=json.dumps(opts.policy_params or {}),
                   KVSCHED_STEP_LOG=None if opts.step_log is None else str(opts.step_log))
        from vllm.platforms import current_platform         # CPUs run without async scheduling
        cls = "KvschedScheduler" if current_platform.is_cpu() else "KvschedAsyncScheduler"
        extra["scheduler_cls"] = f"kvsched.engines.vllm_scheduler.{cls}"
    elif opts.step_log is not None:
        raise KvschedError("a step log needs a policy (vllm-v1 logs vLLM's own batches)")
    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype=opts.dtype, seed=opts.seed,
                      max_num_batched_tokens=lim.max_num_batched_tokens, max_num_seqs=lim.max_num_seqs,
                      long_prefill_token_threshold=lim.long_prefill_token_threshold, block_size=lim.block_size,
                      num_gpu_blocks_override=lim.num_gpu_blocks, max_model_len=lim.max_model_len,
                      enable_prefix_caching=False, enable_chunked_prefill=True, **extra)
    with _environment(env):                 # the in-process scheduler reads it while the engine is built
        return LLMEngine.from_engine_args(args)


@contextmanager
def _environment(values: dict[str, str | None]):
    """Set (or, for None, remove) environment variables, and restore them afterwards: a later
    scheduler in this process must not inherit this engine's policy or step log."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _put(values)
        yield
    finally:
        _put(saved)


def _put(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def serve(engine, workload, limits: Limits, timeout_s: float = 600.0) -> RunRecords:
    """Send the workload at its arrival times, step the engine until every request finished."""
    from vllm import SamplingParams
    n = len(workload)
    order = sorted(range(n), key=lambda i: (workload.arrival[i], i))
    first = np.full(n, np.inf)
    finished = np.full(n, np.inf)
    last = np.full(n, np.nan)
    seen = np.zeros(n, dtype=np.int64)
    itl = GapHistogram()
    nxt, done, steps = 0, 0, 0
    t0 = time.monotonic()
    while done < n:
        now = time.monotonic() - t0
        if now > timeout_s:
            raise KvschedError(f"the engine did not finish the workload in {timeout_s:g} s ({n - done} requests left)")
        while nxt < n and workload.arrival[order[nxt]] <= now:
            i = order[nxt]
            prompt = {"prompt_token_ids": [3 + (7 * i + j) % 900 for j in range(int(workload.prompt[i]))]}
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=int(workload.output[i]), ignore_eos=True,
                                                              detokenize=False))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, float(workload.arrival[order[nxt]]) - now))
            continue
        outputs = engine.step()
        stamp = time.monotonic() - t0
        steps += 1
        for o in outputs:
            i = int(o.request_id)
            k = len(o.outputs[0].token_ids)
            if k > seen[i]:
                if seen[i] == 0:
                    first[i] = stamp
                else:
                    itl.add(stamp - last[i], int(k - seen[i]))
                seen[i], last[i] = k, stamp
            if o.finished:
                finished[i] = stamp
                done += 1
    wall = time.monotonic() - t0
    return _records(workload, first, finished, seen, itl, steps, limits, wall)


def _records(workload, first, finished, seen, itl, steps, limits: Limits, wall: float) -> RunRecords:
    n = len(workload)
    if not np.array_equal(seen, np.asarray(workload.output)):
        bad = int(np.flatnonzero(seen != np.asarray(workload.output))[0])
        raise KvschedError(f"request {bad} produced {seen[bad]} tokens, not its {workload.output[bad]}")
    zeros = np.zeros(n, dtype=np.int64)
    return RunRecords(ids=np.arange(n), arrival=np.asarray(workload.arrival, dtype=float),
                      prompt=np.asarray(workload.prompt), output=np.asarray(workload.output),
                      admitted=np.full(n, np.nan), first_token=first, finished=finished, preemptions=zeros,
                      recomputed=zeros, itl_max=np.zeros(n), tbt_violations=zeros, rejected=np.zeros(n, dtype=bool),
                      itl=itl, iterations=steps, kv_capacity_tokens=(limits.num_gpu_blocks - 1) * limits.block_size,
                      kv_time_integral=0.0, kv_peak_tokens=0, peak_queue=0, busy_time=0.0, wall_seconds=wall)


def run_real(workload, model_dir: Path, opts: ServeOptions) -> dict[str, Any]:
    """One workload through a fresh engine: kvsched's summary of what the engine did."""
    workload.refuse_sessions("the real engine")
    engine = make_engine(model_dir, opts)
    try:
        return summarize(serve(engine, workload, opts.limits))
    finally:
        engine.engine_core.shutdown()                       # closes the step log, frees the KV
