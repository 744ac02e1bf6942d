"""`kvsched simulate`, `compare`, `policies` and `info`."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvsched.cli.common import (ClusterOptions, HardwareOptions, MemUtil, OutputOptions, Progress, app, cluster_flags,
                                emit, guard, hardware_flags, output_flags, workload_flags)
from kvsched.cli.names import BASELINES
from kvsched.errors import KvschedError

if TYPE_CHECKING:       # the engine is imported when a command runs (fast `kvsched --help`)
    from kvsched.run import Result, Scenario
    from kvsched.workload.source import WorkloadOptions


@app.command("simulate")
@workload_flags
@hardware_flags
@cluster_flags
@output_flags
def simulate_cmd(wopts: WorkloadOptions, hw: HardwareOptions, copts: ClusterOptions, outs: OutputOptions,
                 policy: str = typer.Option("vllm-v1", "--policy"),
                 set_: list[str] = typer.Option([], "--set", help="policy parameter key=value (repeatable)")) -> None:
    """Simulate one policy on a workload (one replica, a cluster, or prefill/decode pools)."""
    def body() -> None:
        from kvsched.params import parse_assignments
        from kvsched.workload.source import load
        sc = copts.apply(hw.scenario(load(wopts), outs.goodput, outs.trim, outs.strict, outs.tbt_first_zero), wopts.seed)
        _run_policies(sc, {policy: parse_assignments(set_, "--set")}, outs, keyed=False, decode=copts.decode_args())
    guard(body)


@app.command("compare")
@workload_flags
@hardware_flags
@cluster_flags
@output_flags
def compare_cmd(wopts: WorkloadOptions, hw: HardwareOptions, copts: ClusterOptions, outs: OutputOptions,
                policies: str = typer.Option(",".join(BASELINES), "--policies",
                                             help="comma-separated policy names (default: the baselines, "
                                                  "which run on any workload; `kvsched policies` lists all)"),
                set_: list[str] = typer.Option([], "--set", help="POLICY.key=value, or key=value for every policy that has key")) -> None:
    """Run several policies on one workload and show them side by side."""
    def body() -> None:
        from kvsched.params import parse_assignments
        from kvsched.policies import POLICIES, policy_class
        from kvsched.workload.source import load
        names = [p.strip() for p in policies.split(",") if p.strip()]
        if not names:
            raise KvschedError(f"unknown policy {policies!r}; known: {', '.join(POLICIES)}")
        for p in names:
            policy_class(p, "--policies")
        sc = copts.apply(hw.scenario(load(wopts), outs.goodput, outs.trim, outs.strict, outs.tbt_first_zero), wopts.seed)
        _run_policies(sc, _scoped_params(parse_assignments(set_, "--set"), names), outs, keyed=True,
                      decode=copts.decode_args())
    guard(body)


def _run_policies(sc: Scenario, runs: dict[str, dict[str, str]], outs: OutputOptions, keyed: bool,
                  decode: dict | None = None) -> None:
    """Simulate each policy on the scenario, write --out (one folder per policy when keyed)
    only once all have run, and print the table or JSON."""
    from kvsched.run import RUN_ENVIRONMENT, check_out, jsonable, simulate, write_atomically
    json_, out, record_batches = outs.json_, outs.out, outs.record_batches
    if outs.plot and out is None:
        raise KvschedError("--plot needs --out (report.html goes into that folder)")
    if out is not None:
        check_out(out)                  # before the runs, not after them
    if keyed:                           # the names classes declare, before the runs (instances may
        from kvsched.policies import policy_class                  # set theirs: checked after too)
        declared = [getattr(policy_class(n), "name", None) for n in runs]
        _check_keys([d for d in declared if isinstance(d, str)])
    results = []
    for name, params in runs.items():
        bar = Progress(not json_, name)
        try:
            results.append(simulate(sc, name, params, record_timeline=out is not None,
                                    record_batches=record_batches and out is not None, progress=bar,
                                    **(decode or {})))
        finally:
            bar.close()
    if keyed:
        _check_keys([r.policy for r in results])
    if out is not None:
        def fill(d: Path) -> None:
            for r in results:
                target = d / r.policy if keyed else d
                target.mkdir(exist_ok=True)
                r.write_files(target)
            if keyed:
                keep = {r.policy: {k: v for k, v in r.summary.items() if k not in RUN_ENVIRONMENT} for r in results}
                (d / "compare.json").write_text(json.dumps(jsonable(keep), indent=2, allow_nan=False,
                                                           default=str) + "\n")
            if outs.plot:
                from kvsched.report.html import write_report
                write_report(d)
        write_atomically(out, fill)
    _emit(results, json_, keyed)


def _check_keys(names: list[str]) -> None:
    """The compared policies' names key the JSON and name the --out folders: each once, each a
    plain folder name (a user's policy may call itself anything)."""
    for k, name in enumerate(names):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
            raise KvschedError(f"--policies: a policy named {name!r} cannot key the comparison: names are letters, "
                               "digits and . _ + - (set the class's `name`)")
        if name in names[:k]:
            raise KvschedError(f"--policies: two policies are named {name!r}: give each its own `name`")


def _scoped_params(params: dict[str, str], names: list[str]) -> dict[str, dict[str, str]]:
    """'sarathi.chunk_size=256' goes to sarathi; 'max_num_seqs=64' to every policy having it."""
    from kvsched.params import describe
    from kvsched.policies import policy_class
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for key, value in params.items():
        scope, dot, field = key.rpartition(".")
        if dot:
            if scope not in out:
                raise KvschedError(f"--set {key}: {scope!r} is not among the compared policies")
            out[scope][field] = value
            continue
        takers = [n for n in names if key in {row[0] for row in describe(policy_class(n))}]
        if not takers:
            raise KvschedError(f"--set {key}: no compared policy has parameter {key!r}")
        for n in takers:
            out[n][key] = value
    return out


def _emit(results: list[Result], as_json: bool, keyed: bool) -> None:
    summaries = [r.summary for r in results]
    payload = {r.policy: r.summary for r in results} if keyed else summaries[0]

    def render():                           # rich is imported only for a table
        from kvsched.report.table import comparison_table, summary_table
        return comparison_table(summaries) if keyed else summary_table(summaries[0])
    emit(payload, as_json, render)


@app.command("policies")
def policies_cmd() -> None:
    """List the scheduling policies with their parameters, defaults and sources."""
    from rich.console import Console
    from rich.table import Table
    from kvsched.hardware import GPUS
    from kvsched.params import describe
    from kvsched.policies import POLICIES, SOURCES, engine_defaults
    console = Console()
    for name, cls in POLICIES.items():
        table = Table(title=f"{name} — {SOURCES[name]}", title_justify="left", show_edge=False)
        table.add_column("parameter")
        table.add_column("default")
        table.add_column("range")
        table.add_column("meaning")
        for pname, default, range_, help_ in describe(cls):
            if default == "auto" and pname in engine_defaults(GPUS['a30']):
                default = "{} / {} (>=70 GiB GPU / smaller)".format(
                    engine_defaults(GPUS['h100-sxm'])[pname], engine_defaults(GPUS['a30'])[pname])
            table.add_row(pname, default, range_, help_)
        console.print(table)
        console.print((cls.__doc__ or "").strip().split("\n\n")[0].replace("\n    ", " ") + "\n",
                      markup=False, highlight=False)
    from kvsched.plugins import plugin_names
    plugins = plugin_names("policy")
    console.print(f"Installed plugins: {', '.join(plugins) if plugins else 'none'}. Your own: --policy "
                  "FILE.py:CLASS or MODULE:CLASS (docs/extending.md).", markup=False, highlight=False)


@app.command("info")
def info_cmd(model: Optional[str] = typer.Option(None, "--model"), gpu: Optional[str] = typer.Option(None, "--gpu"),
             memory_utilization: float = MemUtil) -> None:
    """The GPU and model catalogue; with --model and --gpu, the KV capacity they give."""
    def body() -> None:
        from rich.console import Console
        from rich.table import Table
        from kvsched.hardware import GPUS, MODELS, get_gpu, get_model, kv_capacity_tokens, usable_kv_tokens
        console = Console()
        gpus = [get_gpu(gpu)] if gpu else list(GPUS.values())
        models = [get_model(model)] if model else list(MODELS.values())
        tokens = kv_capacity_tokens(models[0], gpus[0], memory_utilization) if model and gpu else None
        usable = usable_kv_tokens(models[0], gpus[0], memory_utilization) if model and gpu else None
        if not 0 < memory_utilization <= 1:     # checked before anything is printed
            raise KvschedError(f"--memory-utilization must be in (0, 1], got {memory_utilization}")
        t = Table(title="GPUs", title_justify="left")
        for c in ("gpu", "memory GiB", "bandwidth TB/s", "bf16 TFLOP/s", "fp8", "fp4", "link GB/s"):
            t.add_column(c)
        for g in gpus:
            fmt = [f"{g.formats[f] / 1e12:g}" if f in g.formats else "-" for f in ("fp8", "fp4")]
            t.add_row(g.name, f"{g.memory_gib:g}", f"{g.bandwidth / 1e12:.3g}", f"{g.flops / 1e12:g}", *fmt,
                      f"{g.link} {g.link_bandwidth / 1e9:g}")
        console.print(t)
        t = Table(title="Models", title_justify="left")
        for c in ("model", "layers", "hidden", "heads", "kv heads", "head dim", "params (B)", "experts", "KV KiB/token",
                  "max len"):
            t.add_column(c)
        for m in models:
            t.add_row(m.name, str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads), str(m.head_dim),
                      f"{m.params / 1e9:.4g}" + (f" ({m.active / 1e9:.3g} active)" if m.active_params else ""),
                      f"{m.experts_per_token} of {m.experts}" if m.experts else "-",
                      f"{m.kv_bytes_per_token / 1024:g}" + (" (MLA)" if m.mla else ""), str(m.max_len))
        console.print(t)
        if tokens is not None:
            from kvsched.memory_profile import default_limits, profile
            limits = default_limits(gpus[0])
            terms = profile(models[0], gpus[0], memory_utilization, limits=limits)
            console.print(f"KV capacity of {models[0].name} on {gpus[0].name} at {memory_utilization:.0%} "
                          f"memory: {tokens:,} tokens; usable {usable:,} in blocks of 16 "
                          f"(vLLM's null block left out, as simulate does). vLLM's memory profile per GPU "
                          f"(docs/fidelity.md): weights {terms['weights'] / 2**30:.2f} GiB, activation "
                          f"{terms['activation'] / 2**30:.2f} GiB at vLLM's defaults of {limits.max_num_batched_tokens:,} "
                          f"batched tokens and {limits.max_num_seqs:,} sequences (a run's --set changes it), CUDA "
                          f"graphs and non-torch memory {terms['runtime'] / 2**30:.2f} GiB")
    guard(body)
