"""What every `kvsched` command shares: one-line errors, the progress bar, the workload
flags and the hardware and output options (their names are a contract)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import typer
from typer.core import TyperGroup

# Only typer and tiny modules at import time, so `kvsched --help` stays fast: the engine (numpy,
# kvsched.run, .sim, .workload, .cost) and rich (tables) are imported by the code that uses them.
from kvsched.cli.names import COST_MODELS, DEFAULT_LENGTH, DEFAULT_RATE, DEFAULT_STALL_BATCHES, FORMATS, ROUTERS
from kvsched.errors import KvschedError

if TYPE_CHECKING:
    from kvsched.run import Scenario
    from kvsched.workload.source import WorkloadOptions

class OneLineErrors(TyperGroup):
    """Usage errors (a bad value, a missing or unknown option) as one line, exit code 2."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except Exception as exc:     # click's exceptions (vendored by newer typer): matched by shape
            code = getattr(exc, "exit_code", None)
            if callable(getattr(exc, "format_message", None)) and isinstance(code, int):
                if exc.format_message().strip():        # empty after no_args_is_help's help text
                    say("error", exc.format_message())
                sys.exit(code)
            if type(exc).__name__ == "Abort":
                say("error", "aborted")
                sys.exit(1)
            raise
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Simulate LLM serving under KV-cache limits and compare schedulers.")


def say(kind: str, message: str) -> None:
    """One unwrapped line on stderr (a terminal console would wrap it)."""
    sys.stderr.write(f"kvsched: {kind}: {' '.join(str(message).split())}\n")


def fail(message: str) -> None:
    say("error", message)
    raise typer.Exit(2)


def emit(payload, as_json: bool, render: Callable[[], object]) -> None:
    """`--json`: the payload as one JSON line on stdout; else the rendered table."""
    if as_json:
        from kvsched.run import jsonable
        typer.echo(json.dumps(jsonable(payload), allow_nan=False, default=str))
    else:
        from rich.console import Console
        Console().print(render())


def guard(fn: Callable[[], None]) -> None:
    """Run a command body: user errors become one line on stderr and exit code 2."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except KvschedError as exc:
            fail(str(exc))
        except MemoryError:
            fail("out of memory: the run needs more than this machine gives it (fewer or shorter requests, "
                 "fewer replicas, or a smaller --kv-capacity need less)")
        finally:
            for w in caught:
                say("warning", w.message)


class Progress:
    """A progress bar on a terminal, shown only once a run has taken over a second."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.enabled, self.label = enabled and sys.stderr.isatty(), label
        self.start = time.perf_counter()
        self.bar = self.task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or time.perf_counter() - self.start < 1.0:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress
            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# The workload flags of every command that takes a workload (names are a contract).
WORKLOAD_FLAGS = {
    "workload": (Optional[str], typer.Option(None, "--workload", "-w", help="a preset (kvsched workloads), a .toml workload file, a trace file or a bundled trace's name")),
    "trace": (Optional[str], typer.Option(None, "--trace", help="trace file (Azure 2023 CSV, Mooncake JSONL, length-only CSV, or arrival_time,prompt_tokens,output_tokens[,tier] CSV/JSONL; .gz/.xz read decompressed) or a bundled trace's name: azure2023-conv, azure2023-code, mooncake-conversation, mooncake-synthetic, sharegpt-lengths, sharegpt-vidur-10k-lengths, bwb-translation-lengths, arxiv-summarization-lengths")),
    "format": (str, typer.Option("auto", "--format", help=f"trace format: {', '.join(FORMATS)}")),
    "rate": (Optional[float], typer.Option(None, "--rate", help=f"mean arrival rate, requests/s: Poisson for synthetic and length-only workloads (built in: {DEFAULT_RATE:g}); a timed trace's times rescaled to it")),
    "arrivals": (Optional[str], typer.Option(None, "--arrivals", help="poisson:RATE, poisson-trunc:RATE:K (gaps capped at K x the mean), gamma:RATE:CV, piecewise:R1:S1,R2:S2,..., sine:MEAN:AMP:PERIOD, closed:C, replay, replay:RATE, replay:xF")),
    "num_requests": (Optional[int], typer.Option(None, "--num-requests", help="requests (per phase); a trace's first N rows, resampled with replacement beyond them")),
    "seed": (int, typer.Option(0, "--seed")),
    "prompt_len": (Optional[str], typer.Option(None, "--prompt-len", help=f"synthetic prompt lengths (built in: {DEFAULT_LENGTH}): fixed:N, uniform:LOW:HIGH, jitter:MEAN, geometric:MEAN, gamma:SHAPE:MEAN, hazard:P0:ETA")),
    "output_len": (Optional[str], typer.Option(None, "--output-len", help=f"synthetic output lengths (built in: {DEFAULT_LENGTH}), same forms")),
    "output_known": (bool, typer.Option(False, "--output-known", help="schedulers may see output lengths")),
    "tiers": (list[str], typer.Option([], "--tier", help="user tier NAME:SHARE[:ttft=S][:tbt=S][:priority=P] (repeatable)")),
    "phases": (list[str], typer.Option([], "--phase", help="a phase: 'requests=N prompt=.. output=.. arrivals=..' or 'trace=FILE ..' (repeatable, in order)")),
    "cap_len": (Optional[int], typer.Option(None, "--cap-len", help="cap prompt + output at this many tokens (reports how many were capped)")),
    "window": (Optional[str], typer.Option(None, "--window", help="trace time window START:END, seconds from its first request")),
    "spread": (Optional[float], typer.Option(None, "--spread", help="spread replayed times uniformly over [t, t + S) seconds (Mooncake's 3 s grid)")),
    "shared_prefix": (Optional[str], typer.Option(None, "--shared-prefix", help="system prompts of synthetic phases: TOKENS:SHARE[,TOKENS:SHARE...]; a request (a session) begins with prompt k with probability SHARE_k")),
    "adapters": (Optional[str], typer.Option(None, "--adapters", help="a LoRA adapter per request: N[:zipf=S][:none=F], Zipf(S) over N adapters (S 1), a share F with none (docs/control-plane.md)")),
    "model_mix": (Optional[str], typer.Option(None, "--model-mix", help="a base model per request: NAME:SHARE,...; each model is served by the --pool pools of that model")),
    "sessions": (Optional[str], typer.Option(None, "--sessions", help="multi-turn sessions in synthetic open-loop phases: turns=T[,think=S] (T an integer or a length distribution; S seconds, fixed:S, exponential:MEAN or uniform:LOW:HIGH); --num-requests counts every turn")),
}


def _flags(table: dict, make: Callable, arg: str) -> Callable[[Callable], Callable]:
    """A decorator adding the flags of `table` to a command, which receives them bundled as
    `arg` = make(**values). Decorators stack: each adds its own flags."""
    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)
                 for name, (kind, opt) in table.items()]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != arg]

        @functools.wraps(fn)
        def command(**kwargs):
            return fn(**{arg: make(**{name: kwargs.pop(name) for name in table})}, **kwargs)
        command.__signature__ = sig.replace(parameters=own + extra)
        # typer resolves the annotations (typing.get_type_hints): drop `arg`'s, whose class
        # (e.g. WorkloadOptions) is imported only when the command runs.
        command.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != arg}
        return command
    return decorate


def _workload_options(**values) -> WorkloadOptions:
    from kvsched.workload.source import WorkloadOptions
    return WorkloadOptions(**values)


workload_flags = _flags(WORKLOAD_FLAGS, _workload_options, "wopts")

# Hardware and batch-time flags of simulate, compare and plan (names are a contract; see README).
ModelOpt = typer.Option("llama-3-8b", "--model",
                        help="a catalogue model (`kvsched info`) or a Hugging Face config.json (its path or folder)")
GpuOpt = typer.Option("a100-80gb", "--gpu")
KvCap = typer.Option(None, "--kv-capacity", help="KV capacity in tokens (default: what vLLM's memory profile leaves: docs/fidelity.md)")
MemUtil = typer.Option(0.9, "--memory-utilization")
HARDWARE_FLAGS = {
    "model": (str, ModelOpt),
    "gpu": (str, GpuOpt),
    "kv_capacity": (Optional[int], KvCap),
    "num_gpu_blocks": (Optional[int], typer.Option(None, "--num-gpu-blocks", help="KV blocks as vLLM logs num_gpu_blocks (or sets them with --num-gpu-blocks-override): the KV capacity is (N - 1) x --block-size tokens, vLLM's block 0 being its null block")),
    "block_size": (int, typer.Option(16, "--block-size", help="KV block size in tokens (1 = token-granular)")),
    "memory_utilization": (float, MemUtil),
    "max_model_len": (Optional[int], typer.Option(None, "--max-model-len", help="default: the model's maximum")),
    "cost": (str, typer.Option("roofline", "--cost", help=f"batch-time model: {', '.join(COST_MODELS)}; or a cost file (.json) written by kvsched calibrate")),
    "cost_set": (list[str], typer.Option([], "--cost-set", help="cost model parameter key=value (repeatable)")),
    "prefix_caching": (Optional[str], typer.Option(None, "--prefix-caching", help="on|off: share cached prompt blocks as vLLM's automatic prefix caching (default: the policy's; on for vllm-v1)")),
    "tp": (int, typer.Option(1, "--tp", help="tensor-parallel GPUs per replica")),
    "pp": (int, typer.Option(1, "--pp", help="pipeline stages per replica")),
    "ep": (int, typer.Option(1, "--ep", help="MoE: GPUs the experts are spread over (1, --tp, or with --dp-attention a multiple of --tp)")),
    "dp_attention": (bool, typer.Option(False, "--dp-attention", help="MoE: attention data-parallel over --ep / --tp ranks")),
    "weight_dtype": (str, typer.Option("bf16", "--weight-dtype", help="weights: bf16, fp8, int4 (AWQ/GPTQ), nvfp4, mxfp4")),
    "kv_dtype": (str, typer.Option("auto", "--kv-dtype", help="KV cache: auto (the model's 16-bit), bf16, fp8")),
    "client_path": (Optional[str], typer.Option(None, "--client-path", show_default="front_s=0.005,output_steps=1", help="what a client adds to TTFT and E2E beyond the engine: off (the engine's figures), or key=value of front_s, front_per_prompt_token_s, output_steps (docs/fidelity.md)")),
}


@dataclass
class HardwareOptions:
    model: str
    gpu: str
    kv_capacity: Optional[int]
    block_size: int
    memory_utilization: float
    max_model_len: Optional[int]
    cost: str
    cost_set: list[str]
    prefix_caching: Optional[str]
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_attention: bool = False
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"
    client_path: Optional[str] = None
    num_gpu_blocks: Optional[int] = None

    def kv_tokens(self) -> Optional[int]:
        """--kv-capacity, or --num-gpu-blocks as tokens (hardware.py, `tokens_of_gpu_blocks`)."""
        n = self.num_gpu_blocks
        if n is None:
            return self.kv_capacity
        if self.kv_capacity is not None:
            raise KvschedError("give --kv-capacity or --num-gpu-blocks, not both")
        from kvsched.hardware import tokens_of_gpu_blocks
        return tokens_of_gpu_blocks(n, self.block_size)

    def scenario(self, workload, goodput: list[str] = (), trim: int = 0, strict: bool = False,
                 tbt_first_zero: bool = False) -> Scenario:
        from kvsched.client import parse_client_path
        from kvsched.hardware import get_gpu, get_model
        from kvsched.metrics import Goodput
        from kvsched.params import parse_assignments
        from kvsched.run import Scenario
        get_model(self.model), get_gpu(self.gpu)
        if self.prefix_caching not in (None, "on", "off"):
            raise KvschedError(f"--prefix-caching must be on or off, got {self.prefix_caching!r}")
        return Scenario(workload, model=self.model, gpu=self.gpu, cost=self.cost,
                        cost_params=parse_assignments(self.cost_set, "--cost-set"),
                        kv_capacity=self.kv_tokens(), memory_utilization=self.memory_utilization,
                        block_size=self.block_size, max_model_len=self.max_model_len,
                        goodput=Goodput.parse(list(goodput)), trim=trim, strict=strict,
                        tbt_first_zero=tbt_first_zero,
                        prefix_caching=None if self.prefix_caching is None else self.prefix_caching == "on",
                        layout=self.layout(), client=parse_client_path(self.client_path))

    def layout(self):
        """--tp, --pp, --ep, --dp-attention, --weight-dtype, --kv-dtype as a Layout (checked later)."""
        from kvsched.layout import Layout
        return Layout(self.tp, self.pp, self.ep, self.dp_attention, self.weight_dtype, self.kv_dtype)


hardware_flags = _flags(HARDWARE_FLAGS, HardwareOptions, "hw")

JsonOpt = typer.Option(False, "--json", help="print the summary as one JSON object on stdout")
OUTPUT_FLAGS = {
    "goodput": (list[str], typer.Option([], "--goodput", help="SLOs for request_goodput: ttft:MS tpot:MS e2el:MS")),
    "trim": (int, typer.Option(0, "--trim", help="drop the first and last N requests from the figures (steady state)")),
    "strict": (bool, typer.Option(False, "--strict", help="a request that can never be served is an error")),
    "tbt_first_zero": (bool, typer.Option(False, "--tbt-first-zero", help="also report p99_tbt_first_zero_ms: TBT with a 0 s sample per first token, as the SLAI authors' telemetry")),
    "json_": (bool, JsonOpt),
    "out": (Optional[Path], typer.Option(None, "--out", help="write summary.json, requests.csv, timeline.csv here")),
    "record_batches": (bool, typer.Option(False, "--record-batches", help="with --out: also batches.csv, one row per iteration")),
    "plot": (bool, typer.Option(False, "--plot", help="with --out: also report.html with the plots of this run")),
}


@dataclass
class OutputOptions:
    goodput: list[str]
    trim: int
    strict: bool
    tbt_first_zero: bool
    json_: bool
    out: Optional[Path]
    record_batches: bool
    plot: bool = False


output_flags = _flags(OUTPUT_FLAGS, OutputOptions, "outs")

# Replicas, routing, disaggregation and engine safety of simulate and compare (names are a contract).
CLUSTER_FLAGS = {
    "replicas": (int, typer.Option(1, "--replicas", help="replicas behind the router")),
    "router": (str, typer.Option("round-robin", "--router", help=f"routing: {', '.join(ROUTERS)}, or MODULE:CLASS")),
    "router_set": (list[str], typer.Option([], "--router-set", help="router parameter key=value (repeatable)")),
    "prefill_replicas": (int, typer.Option(0, "--prefill-replicas", help="disaggregate: replicas that only prefill")),
    "decode_replicas": (int, typer.Option(0, "--decode-replicas", help="disaggregate: replicas that decode")),
    "kv_transfer_bandwidth": (Optional[float], typer.Option(None, "--kv-transfer-bandwidth", show_default="25; between --pool prefill and decode the slower side's network", help="GB/s (1e9 bytes) of each prefill replica's KV link (with pools)")),
    "kv_transfer_latency": (Optional[float], typer.Option(None, "--kv-transfer-latency", show_default="0", help="seconds added to every KV transfer (with pools)")),
    "decode_policy": (Optional[str], typer.Option(None, "--decode-policy", help="policy of the decode replicas (default: --policy)")),
    "decode_set": (list[str], typer.Option([], "--decode-set", help="decode policy parameter key=value (repeatable)")),
    "stall_batches": (int, typer.Option(DEFAULT_STALL_BATCHES, "--stall-batches", help="stop a policy after this many batches that preempt with no output token between them")),
    "pool": (list[str], typer.Option([], "--pool", help="replicas of one kind: NAME=GPU:COUNT[:tp=N][:pp=N][:ep=N][:dp-attention][:model=M][:weight-dtype=D][:kv-dtype=D] (repeatable; pools named prefill and decode disaggregate; docs/hardware.md)")),
    "preemption": (str, typer.Option("recompute", "--preemption", help="a preempted decoder: recompute (vLLM v1), or swap its KV to --kv-tier host and back (vLLM v0's swap; docs/kv-tiers.md)")),
    "kv_tier": (list[str], typer.Option([], "--kv-tier", help="a KV tier below the GPU: KIND:GB:GBps[:latency_s], KIND host, disk (each replica's, or its node's with --gpus-per-node) or remote (one store for all); repeatable. With --prefix-caching the cache offloads to them and loads hits back; with --preemption swap, the host tier holds swapped KV (docs/kv-tiers.md)")),
    "kv_write": (str, typer.Option("evict", "--kv-write", help="when prefix-cache blocks go down to the --kv-tier tiers: evict (when the GPU evicts them) or through (as they are computed)")),
    "gpus_per_node": (int, typer.Option(0, "--gpus-per-node", help="GPUs per node: the replicas on one node share its --kv-tier host and disk tiers (0: each replica its own)")),
    "spec": (str, typer.Option("", "--spec", help="speculative decoding, METHOD:k: draft (--spec-draft-model), eagle, mtp or ngram, k draft tokens per step (docs/speculative-decoding.md)")),
    "spec_acceptance": (str, typer.Option("", "--spec-acceptance", help="with --spec: acceptance per draft token, ALPHA (geometric) or a_1,..,a_k; per tier RATES;TIER=RATES")),
    "spec_proposal_rate": (float, typer.Option(1.0, "--spec-proposal-rate", help="with --spec ngram:k: share of steps whose n-gram lookup finds drafts (the others decode one token)")),
    "spec_adaptive": (str, typer.Option("", "--spec-adaptive", help="with --spec: k by batch size, FIRST-LAST:K,... (vLLM's num_speculative_tokens_per_batch_size)")),
    "spec_draft_model": (Optional[str], typer.Option(None, "--spec-draft-model", help="with --spec draft:k: the draft model (a catalogue name)")),
    "spec_seed": (int, typer.Option(0, "--spec-seed", help="with --spec: the seed of the drafts and acceptances drawn")),
    "autoscale": (str, typer.Option("", "--autoscale", help="a scaler in the loop: hpa (Kubernetes HPA on KV use or queue) or slo (replicas for the forecast rate at one replica's capacity at the TTFT SLO); --replicas or a pool's COUNT is the most it runs (docs/control-plane.md)")),
    "autoscale_set": (list[str], typer.Option([], "--autoscale-set", help="scaler parameter key=value (repeatable): interval_s, window_s, min, initial, start_s, storage_gbps, cold_start_s; hpa: metric (kv|queue|outstanding), target, tolerance, down_stabilization_s; slo: ttft_slo_s, rate_per_replica, headroom, down_stabilization_s")),
    "admit": (list[str], typer.Option([], "--admit", help="admission limit per tier: TIER:rate=R[:burst=B] (token bucket) or TIER:concurrency=N; TIER a tier's name or all (repeatable)")),
    "shed": (list[str], typer.Option([], "--shed", help="shed a tier's arrivals: TIER[:ttft=S][:kv=F], when the predicted TTFT on the chosen replica is above S or its KV use is at least F (TIER alone: S is the tier's TTFT SLO); repeatable")),
    "abandon_after": (list[str], typer.Option([], "--abandon-after", help="clients give up without a first token after [TIER=]S seconds (repeatable)")),
    "lora_set": (list[str], typer.Option([], "--lora-set", help="LoRA serving key=value (with --adapters): max_loras (slots per replica, 8), rank (16), load_gbps (2)")),
    "prices": (Optional[Path], typer.Option(None, "--prices", help="a TOML price table ([per_gpu_hour] GPU = USD) replacing the bundled one's entries (usd_per_mtok; capacity --candidate)")),
    "report_bucket": (Optional[float], typer.Option(None, "--report-bucket", show_default="3600 with --autoscale", help="seconds per window of the over_time table (requests, p99 TTFT, SLO attainment, replicas up)")),
}


@dataclass
class ClusterOptions:
    replicas: int
    router: str
    router_set: list[str]
    prefill_replicas: int
    decode_replicas: int
    kv_transfer_bandwidth: Optional[float]       # None: not given (Scenario's default)
    kv_transfer_latency: Optional[float]
    decode_policy: Optional[str]
    decode_set: list[str]
    stall_batches: int
    pool: list[str] = dataclasses.field(default_factory=list)
    preemption: str = "recompute"
    kv_tier: list[str] = dataclasses.field(default_factory=list)
    kv_write: str = "evict"
    gpus_per_node: int = 0
    spec: str = ""
    spec_acceptance: str = ""
    spec_proposal_rate: float = 1.0
    spec_adaptive: str = ""
    spec_draft_model: Optional[str] = None
    spec_seed: int = 0
    autoscale: str = ""
    autoscale_set: list[str] = dataclasses.field(default_factory=list)
    admit: list[str] = dataclasses.field(default_factory=list)
    shed: list[str] = dataclasses.field(default_factory=list)
    abandon_after: list[str] = dataclasses.field(default_factory=list)
    lora_set: list[str] = dataclasses.field(default_factory=list)
    prices: Optional[Path] = None
    report_bucket: Optional[float] = None

    def apply(self, sc: Scenario, seed: int, grid: bool = False) -> Scenario:
        """The scenario with these replicas, router (seeded by the workload --seed) and link;
        `grid`: one setting of a sweep's grid (router parameters may go unused in some)."""
        from kvsched.params import parse_assignments
        from kvsched.sim.routers import make_router
        from kvsched.sim.transfer import KVLink
        router_params = parse_assignments(self.router_set, "--router-set")
        make_router(self.router, seed, router_params)       # checks the name and the parameters
        pools = self.prefill_replicas or self.decode_replicas or any(p.split("=")[0].strip() == "prefill"
                                                                     for p in self.pool)
        routed = self.replicas > 1 or max(self.prefill_replicas, self.decode_replicas) > 1 or len(self.pool) > 0
        if router_params and not routed and not grid:   # (a sweep's grid may vary the replicas)
            raise KvschedError("--router-set sets the router's parameters: it needs --replicas 2 or more, or a "
                               "prefill or decode pool of 2 or more")
        if self.stall_batches < 1:
            raise KvschedError(f"--stall-batches must be >= 1, got {self.stall_batches}")
        if (self.decode_policy or self.decode_set) and not pools:
            raise KvschedError("--decode-policy and --decode-set need --prefill-replicas and --decode-replicas")
        link = {k: v for k, v in (("kv_transfer_bandwidth", self.kv_transfer_bandwidth),
                                  ("kv_transfer_latency", self.kv_transfer_latency)) if v is not None}
        if link and not pools:          # given at any value, the default's included
            raise KvschedError(f"--{next(iter(link)).replace('_', '-')} sets the KV link between prefill and "
                               "decode pools: it needs --prefill-replicas and --decode-replicas, or --pool prefill=... "
                               "and --pool decode=...")
        sc = dataclasses.replace(
            sc, replicas=self.replicas, router=self.router, router_seed=seed, router_params=router_params,
            prefill_replicas=self.prefill_replicas, decode_replicas=self.decode_replicas,
            stall_batches=self.stall_batches, pool=tuple(self.pool), preemption=self.preemption,
            kv_tiers=tuple(self.kv_tier), kv_write=self.kv_write, gpus_per_node=self.gpus_per_node,
            spec=self.spec, spec_acceptance=self.spec_acceptance, spec_proposal_rate=self.spec_proposal_rate,
            spec_adaptive=self.spec_adaptive, spec_draft_model=self.spec_draft_model, spec_seed=self.spec_seed,
            autoscale=self.autoscale, autoscale_params=parse_assignments(self.autoscale_set, "--autoscale-set"),
            admit=tuple(self.admit), shed=tuple(self.shed), abandon_after=tuple(self.abandon_after),
            lora_params=parse_assignments(self.lora_set, "--lora-set"),
            prices=str(self.prices) if self.prices is not None else None, report_bucket_s=self.report_bucket, **link)
        sc.pools()
        sc.host_tier()                                              # checks --preemption and --kv-tier
        sc.kinds_of_pools()                                         # checks --pool
        sc.spec_config()                                            # checks --spec and its options
        if sc.prices is not None:
            from kvsched.prices import read_prices
            read_prices(sc.prices)                                  # checks --prices
        KVLink(25.0 if sc.kv_transfer_bandwidth is None else sc.kv_transfer_bandwidth, sc.kv_transfer_latency)
        return sc

    def decode_args(self) -> dict:
        """simulate()'s decode_policy / decode_params."""
        from kvsched.params import parse_assignments
        if self.decode_policy is None:
            return {"decode_params": parse_assignments(self.decode_set, "--decode-set")} if self.decode_set else {}
        return {"decode_policy": self.decode_policy, "decode_params": parse_assignments(self.decode_set, "--decode-set")}


cluster_flags = _flags(CLUSTER_FLAGS, ClusterOptions, "copts")

