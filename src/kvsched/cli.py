"""The `kvsched` command: simulate, compare, policies, info."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from kvsched.errors import KvschedError
from kvsched.hardware import GPUS, MODELS, get_gpu, get_model, kv_capacity_tokens
from kvsched.metrics import Goodput
from kvsched.params import describe, parse_assignments
from kvsched.policies import POLICIES, SOURCES, engine_defaults
from kvsched.report.table import comparison_table, summary_table
from kvsched.run import Result, Scenario, simulate, write_atomically
from kvsched.workload import load_trace, parse_length, synthetic

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Simulate LLM serving under KV-cache limits and compare schedulers.")
err = Console(stderr=True)

DEFAULT_RATE = 8.0
DEFAULT_REQUESTS = 1000


def _say(kind: str, message: str) -> None:
    """One unwrapped line on stderr (a terminal console would wrap it)."""
    sys.stderr.write(f"kvsched: {kind}: {' '.join(str(message).split())}\n")


def _fail(message: str) -> None:
    _say("error", message)
    raise typer.Exit(2)


def _guard(fn: Callable[[], None]) -> None:
    """Run a command body: user errors become one line on stderr and exit code 2."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except KvschedError as exc:
            _fail(str(exc))
        finally:
            for w in caught:
                _say("warning", w.message)


class _Progress:
    """A progress bar on a terminal, shown only once a run has taken over a second."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.enabled, self.label = enabled and sys.stderr.isatty(), label
        self.start = time.perf_counter()
        self.bar = self.task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or time.perf_counter() - self.start < 1.0:
            return
        if self.bar is None:
            from rich.progress import Progress
            self.bar = Progress(console=err, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _scenario(trace, rate, num_requests, seed, prompt_len, output_len, output_known, model, gpu,
              kv_capacity, block_size, memory_utilization, max_model_len, cost, cost_set, goodput,
              trim, strict) -> Scenario:
    if rate is not None and not rate > 0:
        raise KvschedError(f"--rate must be > 0 requests per second, got {rate}")
    if num_requests is not None and num_requests < 1:
        raise KvschedError(f"--num-requests must be >= 1, got {num_requests}")
    get_model(model), get_gpu(gpu)
    if trace is not None:
        workload = load_trace(trace, rate=rate, num_requests=num_requests, seed=seed)
    else:
        workload = synthetic(parse_length(prompt_len), parse_length(output_len),
                             DEFAULT_RATE if rate is None else rate,
                             DEFAULT_REQUESTS if num_requests is None else num_requests,
                             seed=seed, output_known=output_known)
    if output_known and trace is not None:
        workload = dataclasses.replace(workload, output_known=np.ones(len(workload), bool))
    return Scenario(workload, model=model, gpu=gpu, cost=cost,
                    cost_params=parse_assignments(cost_set, "--cost-set"), kv_capacity=kv_capacity,
                    memory_utilization=memory_utilization, block_size=block_size,
                    max_model_len=max_model_len, goodput=Goodput.parse(goodput), trim=trim,
                    strict=strict)


# Options shared by simulate and compare (names are a contract; see README).
Trace = typer.Option(None, "--trace", help="CSV trace: arrival_time,prompt_tokens,output_tokens or a length-only CSV")
Rate = typer.Option(None, "--rate", help=f"Poisson arrival rate, requests/s (default {DEFAULT_RATE} for the built-in workload)")
NumRequests = typer.Option(None, "--num-requests", help="requests (resamples a trace with replacement when larger)")
Seed = typer.Option(0, "--seed")
PromptLen = typer.Option("jitter:512", "--prompt-len", help="built-in workload prompt lengths: fixed:N, uniform:A:B, jitter:MEAN, geometric:MEAN, gamma:SHAPE:MEAN")
OutputLen = typer.Option("jitter:512", "--output-len", help="built-in workload output lengths (same forms)")
OutputKnown = typer.Option(False, "--output-known", help="schedulers may see output lengths")
ModelOpt = typer.Option("llama-3-8b", "--model")
GpuOpt = typer.Option("a100-80gb", "--gpu")
KvCap = typer.Option(None, "--kv-capacity", help="KV capacity in tokens (default: from model, GPU and memory utilization)")
BlockSize = typer.Option(16, "--block-size", help="KV block size in tokens (1 = token-granular)")
MemUtil = typer.Option(0.9, "--memory-utilization")
MaxLen = typer.Option(None, "--max-model-len", help="default: the model's maximum")
CostOpt = typer.Option("roofline", "--cost", help="roofline, constant, linear or phase")
CostSet = typer.Option([], "--cost-set", help="cost model parameter key=value (repeatable)")
GoodputOpt = typer.Option([], "--goodput", help="SLOs for request_goodput: ttft:MS tpot:MS e2el:MS")
Trim = typer.Option(0, "--trim", help="drop the first and last N requests from the figures (steady state)")
Strict = typer.Option(False, "--strict", help="a request that can never be served is an error")
JsonOpt = typer.Option(False, "--json", help="print the summary as one JSON object on stdout")
Out = typer.Option(None, "--out", help="write summary.json, requests.csv, timeline.csv here")
RecordBatches = typer.Option(False, "--record-batches", help="with --out: also batches.csv, one row per iteration")


@app.command("simulate")
def simulate_cmd(
    policy: str = typer.Option("vllm-v1", "--policy"),
    set_: list[str] = typer.Option([], "--set", help="policy parameter key=value (repeatable)"),
    trace: Optional[Path] = Trace, rate: Optional[float] = Rate, num_requests: Optional[int] = NumRequests,
    seed: int = Seed, prompt_len: str = PromptLen, output_len: str = OutputLen, output_known: bool = OutputKnown,
    model: str = ModelOpt, gpu: str = GpuOpt, kv_capacity: Optional[int] = KvCap, block_size: int = BlockSize,
    memory_utilization: float = MemUtil, max_model_len: Optional[int] = MaxLen, cost: str = CostOpt,
    cost_set: list[str] = CostSet, goodput: list[str] = GoodputOpt, trim: int = Trim, strict: bool = Strict,
    json_: bool = JsonOpt, out: Optional[Path] = Out, record_batches: bool = RecordBatches,
) -> None:
    """Simulate one policy on a workload."""
    def body() -> None:
        sc = _scenario(trace, rate, num_requests, seed, prompt_len, output_len, output_known, model, gpu,
                       kv_capacity, block_size, memory_utilization, max_model_len, cost, cost_set,
                       goodput, trim, strict)
        _run_policies(sc, {policy: parse_assignments(set_, "--set")}, json_, out, record_batches,
                      keyed=False)
    _guard(body)


@app.command("compare")
def compare_cmd(
    policies: str = typer.Option(",".join(POLICIES), "--policies", help="comma-separated policy names"),
    set_: list[str] = typer.Option([], "--set", help="POLICY.key=value, or key=value for every policy that has key"),
    trace: Optional[Path] = Trace, rate: Optional[float] = Rate, num_requests: Optional[int] = NumRequests,
    seed: int = Seed, prompt_len: str = PromptLen, output_len: str = OutputLen, output_known: bool = OutputKnown,
    model: str = ModelOpt, gpu: str = GpuOpt, kv_capacity: Optional[int] = KvCap, block_size: int = BlockSize,
    memory_utilization: float = MemUtil, max_model_len: Optional[int] = MaxLen, cost: str = CostOpt,
    cost_set: list[str] = CostSet, goodput: list[str] = GoodputOpt, trim: int = Trim, strict: bool = Strict,
    json_: bool = JsonOpt, out: Optional[Path] = Out, record_batches: bool = RecordBatches,
) -> None:
    """Run several policies on one workload and show them side by side."""
    def body() -> None:
        names = [p.strip() for p in policies.split(",") if p.strip()]
        unknown = [p for p in names if p not in POLICIES]
        if unknown or not names:
            raise KvschedError(f"unknown policy {unknown[0] if unknown else policies!r}; known: {', '.join(POLICIES)}")
        sc = _scenario(trace, rate, num_requests, seed, prompt_len, output_len, output_known, model, gpu,
                       kv_capacity, block_size, memory_utilization, max_model_len, cost, cost_set,
                       goodput, trim, strict)
        _run_policies(sc, _scoped_params(parse_assignments(set_, "--set"), names), json_, out,
                      record_batches, keyed=True)
    _guard(body)


def _run_policies(sc: Scenario, runs: dict[str, dict[str, str]], json_: bool, out: Optional[Path],
                  record_batches: bool, keyed: bool) -> None:
    """Simulate each policy on the scenario, write --out (one folder per policy when keyed)
    only once all have run, and print the table or JSON."""
    results = []
    for name, params in runs.items():
        bar = _Progress(not json_, name)
        try:
            results.append(simulate(sc, name, params, record_timeline=out is not None,
                                    record_batches=record_batches and out is not None, progress=bar))
        finally:
            bar.close()
    if out is not None:
        def fill(d: Path) -> None:
            for r in results:
                target = d / r.policy if keyed else d
                target.mkdir(exist_ok=True)
                r.write_files(target)
            if keyed:
                (d / "compare.json").write_text(json.dumps({r.policy: r.summary for r in results},
                                                           indent=2, default=str) + "\n")
        write_atomically(out, fill)
    _emit(results, json_, keyed)


def _scoped_params(params: dict[str, str], names: list[str]) -> dict[str, dict[str, str]]:
    """'sarathi.chunk_size=256' goes to sarathi; 'max_num_seqs=64' to every policy having it."""
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for key, value in params.items():
        scope, dot, field = key.rpartition(".")
        if dot:
            if scope not in out:
                raise KvschedError(f"--set {key}: {scope!r} is not among the compared policies")
            out[scope][field] = value
            continue
        takers = [n for n in names if key in {row[0] for row in describe(POLICIES[n])}]
        if not takers:
            raise KvschedError(f"--set {key}: no compared policy has parameter {key!r}")
        for n in takers:
            out[n][key] = value
    return out


def _emit(results: list[Result], as_json: bool, keyed: bool) -> None:
    if as_json:
        payload = {r.policy: r.summary for r in results} if keyed else results[0].summary
        typer.echo(json.dumps(payload, default=str, allow_nan=True))
        return
    console = Console()
    if not keyed:
        console.print(summary_table(results[0].summary))
    else:
        console.print(comparison_table([r.summary for r in results]))


@app.command("policies")
def policies_cmd() -> None:
    """List the scheduling policies with their parameters, defaults and sources."""
    console = Console()
    for name, cls in POLICIES.items():
        table = Table(title=f"{name} — {SOURCES[name]}", title_justify="left", show_edge=False)
        table.add_column("parameter")
        table.add_column("default")
        table.add_column("meaning")
        for pname, default, help_ in describe(cls):
            if default == "auto":
                default = "{} / {} (>=70 GiB GPU / smaller)".format(
                    engine_defaults(GPUS['h100-sxm'])[pname], engine_defaults(GPUS['a30'])[pname])
            table.add_row(pname, default, help_)
        console.print(table)
        console.print((cls.__doc__ or "").strip().split("\n\n")[0].replace("\n    ", " ") + "\n",
                      markup=False, highlight=False)


@app.command("info")
def info_cmd(model: Optional[str] = typer.Option(None, "--model"), gpu: Optional[str] = typer.Option(None, "--gpu"),
             memory_utilization: float = MemUtil) -> None:
    """The GPU and model catalogue; with --model and --gpu, the KV capacity they give."""
    def body() -> None:
        console = Console()
        gpus = [get_gpu(gpu)] if gpu else list(GPUS.values())
        models = [get_model(model)] if model else list(MODELS.values())
        t = Table(title="GPUs", title_justify="left")
        for c in ("gpu", "memory GiB", "bandwidth TB/s", "bf16 TFLOP/s"):
            t.add_column(c)
        for g in gpus:
            t.add_row(g.name, f"{g.memory_gib:g}", f"{g.bandwidth / 1e12:.3g}", f"{g.flops / 1e12:g}")
        console.print(t)
        t = Table(title="Models", title_justify="left")
        for c in ("model", "layers", "hidden", "heads", "kv heads", "head dim", "params (B)", "KV KiB/token", "max len"):
            t.add_column(c)
        for m in models:
            t.add_row(m.name, str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads), str(m.head_dim),
                      f"{m.params / 1e9:g}" + (f" ({m.active / 1e9:g} active)" if m.active_params else ""),
                      f"{m.kv_bytes_per_token / 1024:g}", str(m.max_len))
        console.print(t)
        if model and gpu:
            tokens = kv_capacity_tokens(models[0], gpus[0], memory_utilization)
            console.print(f"KV capacity of {models[0].name} on {gpus[0].name} at {memory_utilization:.0%} "
                          f"memory: {tokens:,} tokens ({models[0].weight_bytes / 2**30:.1f} GiB of weights)")
    _guard(body)


def main() -> None:  # pragma: no cover
    app()
