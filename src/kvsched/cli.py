"""The `kvsched` command: simulate, compare, policies, info."""
from __future__ import annotations

import functools
import inspect
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvsched.errors import KvschedError
from kvsched.hardware import GPUS, MODELS, get_gpu, get_model, kv_capacity_tokens
from kvsched.metrics import Goodput
from kvsched.params import describe, parse_assignments
from kvsched.policies import POLICIES, SOURCES, engine_defaults
from kvsched.report.table import comparison_table, summary_table, workload_table
from kvsched.run import Result, Scenario, simulate, write_atomically
from kvsched.workload.presets import PRESETS
from kvsched.workload.readers import FORMATS
from kvsched.workload.source import DEFAULT_LENGTH, DEFAULT_RATE, WorkloadOptions, load
from kvsched.workload.stats import describe as workload_stats
from kvsched.workload.traces import export_csv

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Simulate LLM serving under KV-cache limits and compare schedulers.")
err = Console(stderr=True)


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


def _scenario(workload, model, gpu, kv_capacity, block_size, memory_utilization, max_model_len,
              cost, cost_set, goodput, trim, strict) -> Scenario:
    get_model(model), get_gpu(gpu)
    return Scenario(workload, model=model, gpu=gpu, cost=cost,
                    cost_params=parse_assignments(cost_set, "--cost-set"), kv_capacity=kv_capacity,
                    memory_utilization=memory_utilization, block_size=block_size,
                    max_model_len=max_model_len, goodput=Goodput.parse(goodput), trim=trim,
                    strict=strict)


# The workload flags of every command that takes a workload (names are a contract).
WORKLOAD_FLAGS = {
    "workload": (Optional[str], typer.Option(None, "--workload", "-w", help="a preset (kvsched workloads), a .toml workload file or a trace file")),
    "trace": (Optional[Path], typer.Option(None, "--trace", help="trace file: Azure 2023 CSV, Mooncake JSONL, length-only CSV, or arrival_time,prompt_tokens,output_tokens[,tier] CSV/JSONL")),
    "format": (str, typer.Option("auto", "--format", help=f"trace format: {', '.join(FORMATS)}")),
    "rate": (Optional[float], typer.Option(None, "--rate", help=f"mean arrival rate, requests/s: Poisson for synthetic and length-only workloads (built in: {DEFAULT_RATE:g}); a timed trace's times rescaled to it")),
    "arrivals": (Optional[str], typer.Option(None, "--arrivals", help="poisson:RATE, gamma:RATE:CV, piecewise:R1:S1,R2:S2,..., sine:MEAN:AMP:PERIOD, closed:C, replay, replay:RATE, replay:xF")),
    "num_requests": (Optional[int], typer.Option(None, "--num-requests", help="requests (per phase); a trace's first N rows, resampled with replacement beyond them")),
    "seed": (int, typer.Option(0, "--seed")),
    "prompt_len": (Optional[str], typer.Option(None, "--prompt-len", help=f"synthetic prompt lengths (built in: {DEFAULT_LENGTH}): fixed:N, uniform:LOW:HIGH, jitter:MEAN, geometric:MEAN, gamma:SHAPE:MEAN")),
    "output_len": (Optional[str], typer.Option(None, "--output-len", help=f"synthetic output lengths (built in: {DEFAULT_LENGTH}), same forms")),
    "output_known": (bool, typer.Option(False, "--output-known", help="schedulers may see output lengths")),
    "tiers": (list[str], typer.Option([], "--tier", help="user tier NAME:SHARE[:ttft=S][:tbt=S][:priority=P] (repeatable)")),
    "phases": (list[str], typer.Option([], "--phase", help="a phase: 'requests=N prompt=.. output=.. arrivals=..' or 'trace=FILE ..' (repeatable, in order)")),
    "cap_len": (Optional[int], typer.Option(None, "--cap-len", help="cap prompt + output at this many tokens (reports how many were capped)")),
    "window": (Optional[str], typer.Option(None, "--window", help="trace time window START:END, seconds from its first request")),
    "spread": (Optional[float], typer.Option(None, "--spread", help="spread replayed times uniformly over [t, t + S) seconds (Mooncake's 3 s grid)")),
}


def workload_flags(fn: Callable) -> Callable:
    """Add the workload flags to a command; it receives them as `wopts: WorkloadOptions`."""
    sig = inspect.signature(fn)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)
             for name, (kind, opt) in WORKLOAD_FLAGS.items()]
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != "wopts"]

    @functools.wraps(fn)
    def command(**kwargs):
        wopts = WorkloadOptions(**{name: kwargs.pop(name) for name in WORKLOAD_FLAGS})
        return fn(wopts=wopts, **kwargs)
    command.__signature__ = sig.replace(parameters=own + extra)
    return command


# Options shared by simulate and compare (names are a contract; see README).
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
@workload_flags
def simulate_cmd(
    wopts: WorkloadOptions,
    policy: str = typer.Option("vllm-v1", "--policy"),
    set_: list[str] = typer.Option([], "--set", help="policy parameter key=value (repeatable)"),
    model: str = ModelOpt, gpu: str = GpuOpt, kv_capacity: Optional[int] = KvCap, block_size: int = BlockSize,
    memory_utilization: float = MemUtil, max_model_len: Optional[int] = MaxLen, cost: str = CostOpt,
    cost_set: list[str] = CostSet, goodput: list[str] = GoodputOpt, trim: int = Trim, strict: bool = Strict,
    json_: bool = JsonOpt, out: Optional[Path] = Out, record_batches: bool = RecordBatches,
) -> None:
    """Simulate one policy on a workload."""
    def body() -> None:
        sc = _scenario(load(wopts), model, gpu, kv_capacity, block_size, memory_utilization,
                       max_model_len, cost, cost_set, goodput, trim, strict)
        _run_policies(sc, {policy: parse_assignments(set_, "--set")}, json_, out, record_batches,
                      keyed=False)
    _guard(body)


@app.command("compare")
@workload_flags
def compare_cmd(
    wopts: WorkloadOptions,
    policies: str = typer.Option(",".join(POLICIES), "--policies", help="comma-separated policy names"),
    set_: list[str] = typer.Option([], "--set", help="POLICY.key=value, or key=value for every policy that has key"),
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
        sc = _scenario(load(wopts), model, gpu, kv_capacity, block_size, memory_utilization,
                       max_model_len, cost, cost_set, goodput, trim, strict)
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


workload_app = typer.Typer(no_args_is_help=True, help="Describe and export workloads.")
app.add_typer(workload_app, name="workload")


@app.command("workloads")
def workloads_cmd() -> None:
    """List the workload presets with their sources."""
    t = Table(title="Workload presets (use with --workload NAME)", title_justify="left")
    for c in ("name", "source", "what"):
        t.add_column(c)
    for p in PRESETS.values():
        t.add_row(p.name, p.source, p.description)
    Console().print(t)


def _with_source(source: Optional[str], wopts: WorkloadOptions) -> WorkloadOptions:
    if source is not None:
        if wopts.workload is not None or wopts.trace is not None:
            raise KvschedError("give the workload once: as SOURCE or with --workload/--trace")
        wopts.workload = source
    return wopts


@workload_app.command("stats")
@workload_flags
def workload_stats_cmd(wopts: WorkloadOptions,
                       source: Optional[str] = typer.Argument(None, help="trace file, preset or .toml workload file"),
                       json_: bool = JsonOpt) -> None:
    """Count, span, mean rate, CV of gaps, token percentiles, prefix reuse, phases and tiers."""
    def body() -> None:
        wopts.keep_hashes = wopts.untimed_ok = True
        stats = workload_stats(load(_with_source(source, wopts)))
        if json_:
            typer.echo(json.dumps(stats))
        else:
            Console().print(workload_table(stats))
    _guard(body)


@workload_app.command("export")
@workload_flags
def workload_export_cmd(wopts: WorkloadOptions,
                        source: Optional[str] = typer.Argument(None, help="trace file, preset or .toml workload file"),
                        out: Path = typer.Option(..., "--out", help="CSV file to write")) -> None:
    """Write a workload as the generic CSV arrival_time,prompt_tokens,output_tokens[,tier]."""
    def body() -> None:
        w = load(_with_source(source, wopts))
        export_csv(w, out)
        _say("info", f"wrote {len(w)} requests to {out}")
    _guard(body)


def main() -> None:  # pragma: no cover
    app()
