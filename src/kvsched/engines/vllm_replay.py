"""Replay a workload through the installed vLLM's own v1 scheduler, beside a kvsched policy.

vLLM's `Scheduler` is built without a model, as vLLM's own tests build it (tests/v1/core/utils.py,
`create_scheduler`): a local tiny-Llama config (no download, no tokenizer), prefix caching on or
off (`Limits.prefix_caching`), `num_gpu_blocks` G. It is stepped with a constant step time:
1. requests that have arrived by the step's start are added (`max_tokens` = output length,
   `ignore_eos`), their prompt token ids made from their content (`token_ids`): the same
   content gives the same tokens, so vLLM's own block hashing finds the prefixes kvsched shares;
2. `schedule()`;
3. a fabricated `ModelRunnerOutput` gives one sampled token to every request whose computed
   tokens reached its token count (decodes and last prefill chunks; none for a partial chunk),
   the next token of the request's own content;
4. `update_from_output()`.
A step that schedules nothing waits for the next arrival. kvsched runs the same workload on one
replica with `constant` batch time `step_time` and KV of (G - 1) x block_size tokens (vLLM holds
one block back as its null block). Steps are compared by the tokens each request computes, the
preempted requests and the start time.

With `Limits.kv_offloading_gib` > 0 vLLM runs its KV offloading connector to CPU memory (its
`--kv-offloading-size`: `OffloadingConnector`, `cpu_bytes_to_use`), scheduler half only: its
worker half cannot run on the CPU build (vllm/v1/kv_offload/cpu/spec.py, `get_worker`). A
stand-in worker reports each step's load jobs done in that step's output (`finished_recving`,
`completed_jobs`) and its store jobs done in the next step's (vLLM's worker submits a step's
stores at the next step). kvsched gets a host tier of as many blocks with `--kv-write through`
over a link of 1e9 GB/s and no latency: a load lands before the next step, a write is readable
from the step after next, as on vLLM's side.

vLLM is imported here only, lazily; install it with the `vllm` extra (README).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsched.errors import KvschedError

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 1 << 17,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


KV_BYTES_PER_TOKEN = 2 * 2 * 16 * 4      # TINY_LLAMA's one KV layer of the replay: K and V, 2 heads of 16, float32


@dataclass
class Step:
    """One batch: when it started, tokens computed per request (a decode computes 1), and the
    requests preempted to make it."""
    time: float
    tokens: dict[int, int]
    preempted: frozenset[int] = frozenset()
    hits: dict[int, int] = field(default_factory=dict)     # prompt tokens taken from the prefix cache


@dataclass
class Limits:
    """The scheduler limits both sides run under (vLLM's names)."""
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    num_gpu_blocks: int = 0            # G; kvsched gets (G - 1) x block_size tokens of KV
    max_model_len: int = 8192
    prefix_caching: bool = False       # vLLM's enable_prefix_caching; kvsched's --prefix-caching
    kv_offloading_gib: float = 0.0     # vLLM's --kv-offloading-size (GiB of CPU memory); 0: off
    spec: str = ""                     # ngram:k, vLLM's speculative_config (method ngram); "": none
    spec_acceptance: str = ""          # kvsched's --spec-acceptance (both sides draw the same)
    spec_proposal_rate: float = 1.0    # kvsched's --spec-proposal-rate: steps whose n-gram lookup finds drafts
    spec_seed: int = 0

    def spec_config(self):
        """The replay's speculation (sim/spec_decode.py), or None: n-gram only (it needs no
        draft model, and the replay builds none)."""
        if not self.spec:
            if self.spec_acceptance or self.spec_proposal_rate != 1.0 or self.spec_seed:
                raise KvschedError("replay: --spec-acceptance, --spec-proposal-rate and --spec-seed need --spec ngram:k")
            return None
        from kvsched.sim.spec_decode import parse_spec, spec_config
        if parse_spec(self.spec)[0] != "ngram":
            raise KvschedError(f"replay: --spec {self.spec!r}: the replay drives vLLM's scheduler with n-gram "
                               "speculation only (ngram:k), which needs no draft model")
        return spec_config(self.spec, self.spec_acceptance, (), self.spec_proposal_rate, "", self.spec_seed)

    def check(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise KvschedError(f"replay: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks < 2:
            raise KvschedError(f"replay: the KV must hold at least 2 blocks (G = {self.num_gpu_blocks}; "
                               "vLLM keeps one as its null block)")
        if self.long_prefill_token_threshold < 0:
            raise KvschedError("replay: long_prefill_token_threshold must be >= 0")
        if not (0 <= self.kv_offloading_gib < 1e6 and math.isfinite(self.kv_offloading_gib)):
            raise KvschedError(f"replay: --kv-offloading-size must be in [0, 1e6) GiB, got {self.kv_offloading_gib}")
        if self.kv_offloading_gib and not self.prefix_caching:
            raise KvschedError("replay: --kv-offloading-size needs --prefix-caching on (both sides offload the cache)")
        if self.kv_offloading_gib and self.offload_blocks() < 1:
            raise KvschedError(f"replay: --kv-offloading-size {self.kv_offloading_gib:g} GiB holds no block")
        self.spec_config()

    def offload_blocks(self) -> int:
        """Blocks of the CPU tier: vLLM's `num_chunks` (kv_offload/cpu/spec.py, `__init__`:
        cpu_bytes_to_use // the tiny model's KV bytes per block of one worker, one block per
        chunk, rounded up to the page size, `BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE`)."""
        import mmap
        page = mmap.PAGESIZE
        return int(self.kv_offloading_gib * (1 << 30)) // (-(-(KV_BYTES_PER_TOKEN * self.block_size) // page) * page)


def import_vllm():
    """vLLM's scheduler pieces, or a one-line error saying how to install them."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")      # its INFO lines would bury the report
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                     # torch/vLLM deprecation notices at import
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise KvschedError("replay --engine vllm needs vLLM: pip install 'kvsched[vllm]' (GPU) or, for CPU, "
                               "see the README's vLLM section") from None
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    return dict(CacheConfig=CacheConfig, ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig,
                VllmConfig=VllmConfig, SamplingParams=SamplingParams, Scheduler=Scheduler,
                FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
                ModelRunnerOutput=ModelRunnerOutput, Request=Request, get_hash_fn_by_name=get_hash_fn_by_name,
                get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
                StructuredOutputManager=StructuredOutputManager)


def vllm_version() -> str:
    import vllm
    return getattr(vllm, "__version__", "unknown")


def build_scheduler(limits: Limits, model_dir: Path, scheduler_cls=None, async_scheduling: bool = False):
    v = import_vllm()
    import torch
    warnings.filterwarnings("ignore", module="torch")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    mc = v["ModelConfig"](model=str(model_dir), skip_tokenizer_init=True, max_model_len=limits.max_model_len,
                          dtype="float32")
    sc = v["SchedulerConfig"](max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                              max_model_len=limits.max_model_len, enable_chunked_prefill=True,
                              long_prefill_token_threshold=limits.long_prefill_token_threshold,
                              is_encoder_decoder=False)
    cc = v["CacheConfig"](block_size=limits.block_size, enable_prefix_caching=limits.prefix_caching)
    cc.num_gpu_blocks = limits.num_gpu_blocks
    offload = {}
    if limits.kv_offloading_gib:            # as vLLM's --kv-offloading-size sets it (config/vllm.py)
        from vllm.config import KVTransferConfig
        offload["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": int(limits.kv_offloading_gib * (1 << 30))})
    spec = limits.spec_config()
    if spec is not None:                    # n-gram speculation: the scheduler's budget, slots and rollback
        from vllm.config import ParallelConfig, SpeculativeConfig
        pc = ParallelConfig()
        speculative = {"parallel_config": pc, "speculative_config": SpeculativeConfig(
            method="ngram", num_speculative_tokens=spec.k, prompt_lookup_max=spec.k, prompt_lookup_min=1,
            target_model_config=mc, target_parallel_config=pc)}
    else:
        speculative = {}
    vc = v["VllmConfig"](model_config=mc, scheduler_config=sc, cache_config=cc, **offload, **speculative)
    vc.scheduler_config.async_scheduling = async_scheduling     # after the platform's say (CPU: off)
    spec = v["FullAttentionSpec"](block_size=limits.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    tensors = []
    if offload:                             # the CPU tier's size follows the GPU's bytes per block
        from vllm.v1.kv_cache_interface import KVCacheTensor
        page = spec.page_size_bytes
        tensors = [KVCacheTensor(size=page * limits.num_gpu_blocks, layers=["layer"],
                                 layer_stride=page * limits.num_gpu_blocks, block_stride=page)]
    kv = v["KVCacheConfig"](num_blocks=limits.num_gpu_blocks, kv_cache_tensors=tensors,
                            kv_cache_groups=[v["KVCacheGroupSpec"](["layer"], spec)])
    scheduler = (scheduler_cls or v["Scheduler"])(vllm_config=vc, kv_cache_config=kv,
                                                  structured_output_manager=v["StructuredOutputManager"](vc),
                                                  block_size=limits.block_size, log_stats=False)
    if offload:                             # kvsched's host tier must hold what vLLM's CPU tier holds
        manager = getattr(getattr(getattr(scheduler, "connector", None), "connector_scheduler", None), "manager", None)
        chunks = getattr(manager, "_num_chunks", None)
        if chunks != limits.offload_blocks():
            raise KvschedError(f"replay: vLLM's CPU tier holds {chunks} blocks, kvsched's {limits.offload_blocks()}")
    return v, scheduler


def vllm_steps(workload, limits: Limits, step_time: float, max_steps: int = 10_000_000,
               scheduler_cls=None, async_scheduling: bool = False) -> list[Step]:
    """vLLM's own scheduler (or `scheduler_cls`, e.g. the kvsched adapter) on the workload, one
    Step per non-empty batch. With `async_scheduling` the scheduler is configured as under an
    async engine, but stepped in lock-step (each step's output before the next schedule)."""
    with tempfile.TemporaryDirectory() as tmp:
        v, sched = build_scheduler(limits, Path(tmp) / "tiny-llama", scheduler_cls, async_scheduling)
        n = len(workload)
        order = sorted(range(n), key=lambda i: (workload.arrival[i], i))
        nxt, t, steps, done = 0, 0.0, [], 0
        if hasattr(sched, "set_clock"):                     # the kvsched adapter: on the replay's clock
            sched.set_clock(lambda: t, lambda: (nxt < n, float(workload.arrival[order[nxt]]) if nxt < n else None))
        content = token_ids(workload)
        hasher = None
        if limits.prefix_caching:                           # as vLLM's EngineCore sets it up
            fn = v["get_hash_fn_by_name"](sched.cache_config.prefix_caching_hash_algo)
            v["init_none_hash"](fn)
            hasher = v["get_request_block_hasher"](limits.block_size, fn)
        progress: dict[str, int] = {}                       # computed tokens we expect each request to have
        worker = StandInWorker() if limits.kv_offloading_gib else None
        drafter = StandInDrafter(limits.spec_config(), content) if limits.spec else None
        while done < n:
            while nxt < n and workload.arrival[order[nxt]] <= t:
                i = order[nxt]
                sched.add_request(v["Request"](str(i), content.prompt(i),
                                               v["SamplingParams"](max_tokens=int(workload.output[i]), ignore_eos=True),
                                               None, arrival_time=float(workload.arrival[i]), block_hasher=hasher))
                nxt += 1
            out = sched.schedule()
            kv_out = worker.step(out) if worker is not None else None
            if not out.num_scheduled_tokens:
                if kv_out is not None:              # transfers done this step: schedule again at t
                    sched.update_from_output(out, v["ModelRunnerOutput"](req_ids=[], req_id_to_index={},
                                                                          kv_connector_output=kv_out))
                    continue
                if nxt >= n:
                    raise KvschedError(f"vLLM's scheduler made no progress at t={t:g} with {n - done} requests left "
                                       "(a request larger than the KV?)")
                t = max(t, float(workload.arrival[order[nxt]]))
                sched.update_from_output(out, v["ModelRunnerOutput"](req_ids=[], req_id_to_index={}))
                continue
            ids = list(out.num_scheduled_tokens)
            reqs = sched.requests
            if drafter is None:
                sampled = [[content.output(int(r), len(reqs[r].output_token_ids))]
                           if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
            else:
                sampled = drafter.sampled(out, reqs, ids)
            preempted = frozenset(int(r) for r in (out.preempted_req_ids or ()))
            hits = {}
            for r in preempted:
                progress[str(r)] = 0
            for r, k in out.num_scheduled_tokens.items():
                start = reqs[r].num_computed_tokens - k
                if start > progress.get(r, 0):              # a prefix-cache hit
                    hits[int(r)] = start - progress.get(r, 0)
                progress[r] = reqs[r].num_computed_tokens
            steps.append(Step(t, {int(r): k for r, k in out.num_scheduled_tokens.items()}, preempted, hits))
            t += step_time                                  # the batch ends before its output is read
            sched.update_from_output(out, v["ModelRunnerOutput"](req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                                  sampled_token_ids=sampled, kv_connector_output=kv_out))
            if drafter is not None:                         # as EngineCore.post_step: the next step's drafts
                sched.update_draft_token_ids(drafter.drafts(ids, sampled, sched.requests))
            done = nxt - len(sched.requests)
            if len(steps) > max_steps:
                raise KvschedError(f"replay stopped after {max_steps} vLLM steps")
        sched.shutdown()                                    # the adapter closes its step log
        return steps


class StandInWorker:
    """The offloading connector's worker half, as the replay needs it (module docstring): a
    step's loads done in its own output, its stores in the next step's."""

    def __init__(self) -> None:
        self.stores: list[int] = []             # store jobs submitted last step

    def step(self, out):
        """The KVConnectorOutput for this step's model output (None: nothing finished)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput
        meta = out.kv_connector_metadata
        loads = dict(meta.load_jobs) if meta is not None else {}
        done = {job: 1 for job in [*loads, *self.stores]}
        self.stores = list(meta.store_jobs) if meta is not None else []
        if not done:
            return None
        return KVConnectorOutput(finished_recving={job.req_id for job in loads.values()} or None,
                                 kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done))


class StandInDrafter:
    """The model runner's n-gram drafter and rejection sampler, as the replay needs them: the
    drafts and acceptances kvsched draws (sim/spec_decode.py, `keyed_uniforms`: request i's n-th
    decode step), fed through vLLM's own output path. A request's decode steps are counted from
    the step after the one that gave it a token (its prefill's last chunk), until it is preempted."""

    def __init__(self, cfg, content) -> None:
        self.cfg, self.content = cfg, content
        self.steps: dict[str, int] = {}         # decode steps so far, per request (the draws' key)
        self.decoding: set[str] = set()         # requests whose next step is a decode step

    def sampled(self, out, reqs, ids: list[str]) -> list[list[int]]:
        """Each scheduled request's sampled tokens: none for a partial prefill chunk; else the
        accepted drafts (leading positions whose uniform is below their rate) and one more."""
        from kvsched.sim.spec_decode import keyed_uniforms
        for r in out.preempted_req_ids or ():
            self.decoding.discard(r)
        k, rates = self.cfg.k, self.cfg.acceptance.rates
        u = keyed_uniforms(self.cfg.seed, [int(r) for r in ids], [self.steps.get(r, 0) for r in ids], k + 1)
        result = []
        for row, r in enumerate(ids):
            req = reqs[r]
            if req.num_computed_tokens < req.num_tokens:        # a partial chunk (or drafts beyond: none here)
                result.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(r, ())
            a = 0                                               # a placeholder (-1: padding) is rejected
            while a < len(drafts) and drafts[a] != -1 and u[row, 1 + a] < rates[a]:
                a += 1
            g = len(req.output_token_ids)
            result.append([self.content.output(int(r), g + j) for j in range(a + 1)])
            if r in self.decoding:
                self.steps[r] = self.steps.get(r, 0) + 1
        return result

    def drafts(self, ids: list[str], sampled: list[list[int]], reqs):
        """The drafts of the next step: k for a request whose n-gram lookup hits (column 0 of its
        next step's uniforms below --spec-proposal-rate), none otherwise."""
        from vllm.v1.outputs import DraftTokenIds

        from kvsched.sim.spec_decode import keyed_uniforms
        live = [r for r, tokens in zip(ids, sampled) if tokens and r in reqs and not reqs[r].is_finished()]
        self.decoding.update(live)
        u = keyed_uniforms(self.cfg.seed, [int(r) for r in live], [self.steps.get(r, 0) for r in live], 1)
        out = []
        for row, r in enumerate(live):
            g = len(reqs[r].output_token_ids)
            hit = u[row, 0] < self.cfg.proposal_rate
            out.append([self.content.output(int(r), g + j) for j in range(self.cfg.k)] if hit else [])
        return DraftTokenIds(live, out)


class _Recorder:
    """Wraps a kvsched policy and writes down each batch it plans, as a Step (so every batch
    is planned: the replica's idle-decode fast path is off, `decodes_when_idle` unset)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.steps: list[Step] = []
        self.offload = None                     # the replica's tiers (kvsched_steps sets it)
        self._open = False                      # the last step is not settled yet

    def _settle(self) -> None:
        """The last step as it ran: an admission that loaded its prefix instead of prefilling, or
        that a load which did not fit kept out (sim/batch.py, `prefill_shape`: now loading,
        landed and not yet admitted, or still waiting), ran no chunk."""
        from kvsched.sim.requests import LOADING, WAITING
        off, self._open = self.offload, False
        if off is None or not self.steps:
            return
        last = self.steps[-1]
        status = off.clock.reqs.status
        gone = [i for i in last.tokens if status[i] in (WAITING, LOADING) or i in off.landed_src]
        if gone:
            tokens = {i: c for i, c in last.tokens.items() if i not in gone}
            hits = {i: h for i, h in last.hits.items() if i not in gone}
            if tokens:
                self.steps[-1] = Step(last.time, tokens, last.preempted, hits)
            else:
                self.steps.pop()

    def on_batch_end(self, v) -> None:
        if self._open:
            self._settle()
        hook = getattr(self.inner, "on_batch_end", None)
        if hook is not None:
            hook(v)

    def schedule(self, v):
        if self._open:                          # the last plan ran no batch
            self._settle()
        plan = self.inner.schedule(v)
        gone = set(plan.preempt)
        cap = getattr(plan, "spec", None)
        tokens = {i: c + (cap.get(i, 0) if isinstance(cap, dict) and i in plan.admit else 0) for i, c in plan.chunks}
        hits = {}
        planner = v.prefix_planner()
        if planner is not None:                 # where each chunk starts, as the replica applies the plan
            for i in plan.preempt:
                planner.preempt(i)
            for i, c in plan.chunks:
                done = 0 if i in gone or i in plan.admit else v.prefill_done(i)
                start = planner.chunk(i, c, cap.get(i, 0) if isinstance(cap, dict) and i in plan.admit else 0)
                if start > done:
                    hits[i] = start - done
        decoding = [i for i in v.decoding if i not in gone] if plan.decode is True else list(plan.decode or ())
        for i in decoding:                      # 1 + its drafts (as far as Plan.spec lets it verify them)
            s = v.spec_tokens(i)
            if cap is not None:
                s = min(s, cap if isinstance(cap, int) else cap.get(i, s))
            tokens[i] = 1 + s
        if tokens:
            self.steps.append(Step(v.now, tokens, frozenset(plan.preempt), hits))
            self._open = self.offload is not None
        return plan

    def __getattr__(self, name: str):           # the optional hooks, when the policy has them
        return getattr(self.inner, name)


def engine_policy(name: str, params: dict[str, Any], max_num_batched_tokens: int, max_num_seqs: int,
                  long_prefill_token_threshold: int = 0):
    """The policy `name` as an engine runs it: with the engine's token budget, seats and
    long-prefill cap for the parameters of those names the policy has (`params` win), as the
    vLLM adapter builds it."""
    import dataclasses

    from kvsched.hardware import get_gpu
    from kvsched.policies import make_policy, policy_class
    cls = policy_class(name)
    has = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    limits = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
              "long_prefill_token_threshold": long_prefill_token_threshold}
    return make_policy(name, {**{k: v for k, v in limits.items() if k in has}, **params}, get_gpu("a100-80gb"))


def kvsched_steps(workload, policy: str, params: dict[str, Any], limits: Limits, step_time: float) -> list[Step]:
    """kvsched's policy on the workload, on a replica with a constant batch time; params as
    the adapter takes them (`engine_policy`)."""
    from kvsched.cost import ConstantCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server
    rec = _Recorder(engine_policy(policy, params, limits.max_num_batched_tokens, limits.max_num_seqs,
                                  limits.long_prefill_token_threshold))
    spec = limits.spec_config()
    server = Server(workload, rec, ConstantCost(step_time), PagedKV((limits.num_gpu_blocks - 1) * limits.block_size,
                                                                    limits.block_size),
                    max_model_len=limits.max_model_len, prefix_caching=limits.prefix_caching,
                    spec_slots=(spec.k, spec.lookahead) if spec is not None else (0, 0))
    if spec is not None:                    # n-gram: no drafter model, no GPU time of its own
        from kvsched.run import attach_spec
        attach_spec(server.replicas, spec, None, None, None, max_len=limits.max_model_len)
    if limits.kv_offloading_gib:            # a host tier of vLLM's CPU blocks, written through, loads at once
        from kvsched.run import attach_offload
        gb = (limits.offload_blocks() + 0.5) * KV_BYTES_PER_TOKEN * limits.block_size / 1e9   # floors to the count
        attach_offload(server.replicas, (f"host:{gb!r}:1000000000:0",), "through", KV_BYTES_PER_TOKEN)
        rec.offload = server.replica._offload
        store = server.replica._offload.ports[0].store
        if store.capacity_blocks != limits.offload_blocks():
            raise KvschedError(f"replay: the host tier holds {store.capacity_blocks} blocks, vLLM's "
                               f"{limits.offload_blocks()}")
    server.run()
    if rec._open:
        rec._settle()
    return rec.steps


@dataclass
class Agreement:
    steps: int
    steps_differing: int
    vllm_steps: int
    kvsched_steps: int
    first_difference: dict[str, Any] | None
    preemptions: dict[str, int]
    first_token_step_diff: dict[str, float]
    finish_step_diff: dict[str, float]
    rows: list[dict[str, Any]] = field(repr=False, default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "rows"}


def compare(a: list[Step], b: list[Step], prompts, rel_time: float = 1e-9) -> Agreement:
    """Step by step: the tokens each request computes, the preempted set and the start time."""
    rows, differing, first = [], 0, None
    for k in range(max(len(a), len(b))):
        x = a[k] if k < len(a) else None
        y = b[k] if k < len(b) else None
        what = []
        if x is None or y is None:
            what.append("missing on " + ("vllm" if x is None else "kvsched"))
        else:
            if x.tokens != y.tokens:
                what.append("tokens")
            if x.preempted != y.preempted:
                what.append("preempted")
            if x.hits != y.hits:
                what.append("hits")
            if not math.isclose(x.time, y.time, rel_tol=rel_time, abs_tol=1e-9):
                what.append("time")
        if what:
            differing += 1
            if first is None:
                first = {"step": k, "differs_in": what,
                         "vllm": _describe(x), "kvsched": _describe(y)}
        rows.append({"step": k, "time_vllm": x.time if x else None, "time_kvsched": y.time if y else None,
                     "tokens_vllm": sum(x.tokens.values()) if x else None,
                     "tokens_kvsched": sum(y.tokens.values()) if y else None,
                     "requests_vllm": len(x.tokens) if x else None, "requests_kvsched": len(y.tokens) if y else None,
                     "preempted_vllm": len(x.preempted) if x else None,
                     "preempted_kvsched": len(y.preempted) if y else None, "differs": ";".join(what)})
    fa, fb = _first_token_and_finish(a, prompts), _first_token_and_finish(b, prompts)
    return Agreement(max(len(a), len(b)), differing, len(a), len(b), first,
                     {"vllm": sum(len(s.preempted) for s in a), "kvsched": sum(len(s.preempted) for s in b)},
                     _diffs(fa[0], fb[0]), _diffs(fa[1], fb[1]), rows)


def _describe(s: Step | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"time": s.time, "tokens": {str(i): c for i, c in sorted(s.tokens.items())},
            "preempted": sorted(s.preempted), "hits": {str(i): c for i, c in sorted(s.hits.items())}}


def _first_token_and_finish(steps: list[Step], prompts) -> tuple[dict[int, int], dict[int, int]]:
    """Per request, the step of its first output token (its computed tokens, cache hits
    included, first reach its prompt) and the last step it computes in (its finish)."""
    computed: dict[int, int] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, s in enumerate(steps):
        for i in s.preempted:
            computed[i] = 0
        for i, c in s.tokens.items():
            computed[i] = computed.get(i, 0) + c + s.hits.get(i, 0)
            if i not in first and computed[i] >= prompts[i]:
                first[i] = k
            last[i] = k
    return first, last


class token_ids:
    """Token ids made from each request's content (sim/prefix_cache.py's sources): a token is
    a function of its content id and offset, so requests that share content share tokens, and
    the rest are (almost surely) distinct. Output tokens continue the request's own content."""
    VOCAB = TINY_LLAMA["vocab_size"]

    def __init__(self, workload) -> None:
        from kvsched.sim.prefix_cache import _sources
        self._w, self._src = workload, _sources(workload)

    @classmethod
    def _token(cls, kind: int, cid: int, offset: int) -> int:
        return 10 + hash((kind, cid, offset)) % (cls.VOCAB - 10)

    def prompt(self, i: int) -> list[int]:
        segments, (kind, own) = self._src(i)
        out: list[int] = []
        for k, cid, n in segments:
            out += [self._token(k, cid, j) for j in range(n)]
        m = len(out)
        out += [self._token(kind, own, j) for j in range(int(self._w.prompt[i]) - m)]
        return out

    def output(self, i: int, g: int) -> int:
        """Output token g (0 = the first) of request i."""
        segments, (kind, own) = self._src(i)
        return self._token(kind, own, int(self._w.prompt[i]) - sum(n for _, _, n in segments) + g)


def _diffs(x: dict[int, int], y: dict[int, int]) -> dict[str, float]:
    keys = set(x) | set(y)
    d = [abs(x.get(i, -1) - y.get(i, -1)) for i in keys]
    return {"max": float(max(d)) if d else 0.0, "mean": float(sum(d) / len(d)) if d else 0.0,
            "requests_differing": sum(1 for v in d if v)}


def replay(workload, policy: str, params: dict[str, Any], limits: Limits, step_time: float = 0.01) -> Agreement:
    limits.check()
    workload.refuse_sessions("replay")
    if not step_time > 0 or not math.isfinite(step_time):
        raise KvschedError(f"--step-time must be a finite number > 0, got {step_time}")
    return compare(vllm_steps(workload, limits, step_time), kvsched_steps(workload, policy, params, limits, step_time),
                   workload.prompt)
