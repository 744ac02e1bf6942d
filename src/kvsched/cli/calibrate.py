"""`kvsched calibrate STEPLOG`: fit batch-time models to a measured step log and write a cost
file for `--cost` (kvsched.cost.calibrate, docs/calibration.md). `kvsched calibrate
--bench-serve FILE` / `--inference-perf FILE`: fit kvsched's timing constants to benchmark
result files by simulating them (kvsched.cost.results_fit, cli/calibrate_results.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvsched.cli.common import JsonOpt, app, emit, guard
from kvsched.cli.names import CALIBRATION_MODELS
from kvsched.errors import KvschedError
from kvsched.files import check_writable

if TYPE_CHECKING:       # the engine is imported when the command runs (fast `kvsched --help`)
    from rich.console import Group
    from rich.table import Table
    from kvsched.cost.calibrate import Calibration

KIND_LABELS = {"prefill": "prefill-only", "decode": "decode-only", "mixed": "mixed", "all": "all steps"}


@app.command("calibrate")
def calibrate_cmd(steplog: Optional[Path] = typer.Argument(None, help="step log CSV (KVSCHED_STEP_LOG of kvsched's vLLM adapter); or give result files instead"),
                  models: Optional[str] = typer.Option(None, "--models", show_default=",".join(CALIBRATION_MODELS), help=f"comma-separated models to fit: {', '.join(CALIBRATION_MODELS)}"),
                  model: Optional[str] = typer.Option(None, "--model", help="catalogue model the log ran (roofline and tiled need it)"),
                  gpu: Optional[str] = typer.Option(None, "--gpu", help="catalogue GPU the log ran on (roofline and tiled need it)"),
                  skip: int = typer.Option(0, "--skip", help="drop the first N steps (warm-up)"),
                  out: Optional[Path] = typer.Option(None, "--out", help="write the cost file (JSON) of --use here, for --cost FILE"),
                  use: Optional[str] = typer.Option(None, "--use", help="the model --out writes (default: the lowest median relative error over all steps)"),
                  bench_serve: list[Path] = typer.Option([], "--bench-serve", help="a `vllm bench serve --save-result` JSON file (repeatable), instead of STEPLOG"),
                  inference_perf: list[Path] = typer.Option([], "--inference-perf", help="an inference-perf stage_N_lifecycle_metrics.json (repeatable), instead of STEPLOG"),
                  fit: Optional[str] = typer.Option(None, "--fit", show_default="overhead,memory_efficiency,front_s", help="result files: the constants to fit, of overhead, memory_efficiency, compute_efficiency, front_s, output_steps"),
                  max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="result files: the server's --max-num-seqs (default: vLLM's for the GPU)"),
                  max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", help="result files: the server's --max-num-batched-tokens (default: vLLM's for the GPU)"),
                  num_gpu_blocks: Optional[int] = typer.Option(None, "--num-gpu-blocks", help="result files: num_gpu_blocks from the server's log (KV capacity; default: kvsched's estimate)"),
                  block_size: int = typer.Option(16, "--block-size", help="result files: the server's KV block size in tokens"),
                  memory_utilization: float = typer.Option(0.9, "--memory-utilization", help="result files: the server's --gpu-memory-utilization (KV capacity by vLLM's memory profile, without --num-gpu-blocks)"),
                  tp: int = typer.Option(1, "--tp", help="result files: tensor-parallel GPUs of the server"),
                  pp: int = typer.Option(1, "--pp", help="result files: pipeline stages of the server"),
                  weight_dtype: str = typer.Option("bf16", "--weight-dtype", help="result files: weights' format (bf16, fp8, int4, nvfp4, mxfp4)"),
                  kv_dtype: str = typer.Option("auto", "--kv-dtype", help="result files: KV cache format (auto, bf16, fp8)"),
                  seed: int = typer.Option(0, "--seed", help="result files: seed of the rebuilt send times (the files do not record them)"),
                  json_: bool = JsonOpt) -> None:
    """Fit batch-time models (phase, linear; roofline and tiled with --model and --gpu) to a
    step log and report each one's relative error |predicted - measured| / measured, median
    and p90 per batch kind. JSON keys: source, source_sha256, skipped_steps, steps, kinds,
    model, gpu, best, use, out, models (per model: params, fallbacks, fixed, notes, errors; or
    skipped: the reason).

    With --bench-serve or --inference-perf files instead of STEPLOG (one kind): rebuild each
    run, simulate it with vllm-v1, and fit --fit of the roofline's overhead, memory_efficiency,
    compute_efficiency and the client path's front_s, output_steps to the files' mean TTFT,
    TPOT, ITL and E2E (docs/calibration.md, "Calibration from result files"). --out writes a
    roofline cost file; the client path is printed as --client-path."""
    sources = {"STEPLOG": steplog is not None, "--bench-serve": bool(bench_serve),
               "--inference-perf": bool(inference_perf)}
    if sum(sources.values()) != 1:
        guard(lambda: _one_source(sources))
        return
    if steplog is None:
        from kvsched.cli.calibrate_results import ResultsOptions, calibrate_results
        opts = ResultsOptions(bench_serve, inference_perf, fit, model, gpu, max_num_seqs, max_num_batched_tokens,
                              num_gpu_blocks, block_size, tp, pp, weight_dtype, kv_dtype, seed, out, json_,
                              memory_utilization)
        guard(lambda: calibrate_results(opts, {"--models": models, "--skip": skip or None, "--use": use}))
        return
    results_only = {"--fit": fit, "--max-num-seqs": max_num_seqs, "--max-num-batched-tokens": max_num_batched_tokens,
                    "--num-gpu-blocks": num_gpu_blocks, "--block-size": block_size != 16 or None,
                    "--memory-utilization": memory_utilization != 0.9 or None,
                    "--tp": tp != 1 or None, "--pp": pp != 1 or None, "--weight-dtype": weight_dtype != "bf16" or None,
                    "--kv-dtype": kv_dtype != "auto" or None, "--seed": seed or None}

    def body() -> None:
        from kvsched.cost.calibrate import calibrate, read_step_log, write_cost_file
        given = [flag for flag, v in results_only.items() if v is not None]
        if given:
            raise KvschedError(f"{given[0]} goes with --bench-serve or --inference-perf files, not a step log")
        from kvsched.hardware import get_gpu, get_model
        names = _names(models if models is not None else ",".join(CALIBRATION_MODELS))
        if use is not None and use not in names:
            raise KvschedError(f"--use {use}: not among --models ({', '.join(names)})")
        if (model is None) != (gpu is None):
            raise KvschedError("give both --model and --gpu, or neither")
        if out is not None:
            _check_out(out)
            if out.exists() and out.resolve() == steplog.resolve():
                raise KvschedError(f"--out {out} is the step log itself: name another file")
        hardware = (get_model(model), get_gpu(gpu)) if model is not None else (None, None)
        cal = calibrate(read_step_log(steplog).tail(skip), names, *hardware, skip=skip)
        chosen = _chosen(cal, use)
        if out is not None:
            write_cost_file(out, cal.cost_file(chosen))
        payload = {**cal.as_dict(), "use": chosen, "out": str(out) if out is not None else None}
        emit(payload, json_, lambda: _render(payload))
    guard(body)


def _one_source(sources: dict[str, bool]) -> None:
    given = [k for k, v in sources.items() if v]
    if not given:
        raise KvschedError("give a step log (STEPLOG), or result files: --bench-serve FILE or --inference-perf FILE")
    raise KvschedError(f"give one kind of source, not {' and '.join(given)}")


def _names(models: str) -> list[str]:
    from kvsched.cost.calibrate import MODELS
    names = list(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        raise KvschedError(f"--models: unknown model {unknown[0] if unknown else models!r}; "
                           f"known: {', '.join(MODELS)}")
    return names


def _check_out(out: Path) -> None:
    """--out checked before any work: a file name in an existing folder."""
    if out.is_dir():
        raise KvschedError(f"--out {out} is a folder; give a file name (e.g. {out / 'cost.json'})")
    if not out.parent.is_dir():
        raise KvschedError(f"--out {out}: no folder {out.parent}")
    check_writable(out, "--out")        # a FIFO, device or link: refused before the fit


def _chosen(cal: Calibration, use: Optional[str]) -> str:
    """The model --out writes: --use, else the best fit. An error, --use or not, when no fit
    has more steps than parameters (best is None: no fit is checked, nothing to report or
    write), and when --use was not fitted or has too few steps itself."""
    best = cal.best()
    if best is None:
        raise KvschedError(cal.why_no_best())
    if use is None:
        return best
    if use in cal.skipped:
        raise KvschedError(f"--use {use}: not fitted ({cal.skipped[use]})")
    if (why := cal.too_few_steps(use)) is not None:
        raise KvschedError(f"--use {use}: {why}; without --use: {best}, which has enough")
    return use


def _render(s: dict) -> Group:
    from rich.console import Group
    from rich.text import Text
    fitted = {k: m for k, m in s["models"].items() if "params" in m}
    parts: list = [_error_table(s, fitted), _param_table(fitted)]
    for name, m in s["models"].items():
        if "skipped" in m:
            parts.append(Text(f"{name}: skipped, {m['skipped']}"))
        for note in m.get("notes", []):
            parts.append(Text(f"{name}: {note}"))
    parts.append(Text(f"best: {s['best']} (lowest median relative error over all steps)"))
    if s["out"] is not None:
        parts.append(Text(f"wrote {s['out']}: the {s['use']} model (use it with --cost {s['out']})"))
    return Group(*parts)


def _error_table(s: dict, fitted: dict) -> Table:
    from rich.table import Table
    from rich.text import Text
    skipped = f", first {s['skipped_steps']} skipped" if s["skipped_steps"] else ""
    t = Table(title=Text(f"relative error |predicted - measured| / measured, median / p90: {s['source']}, "
                         f"{s['steps']} steps{skipped}"), title_justify="left")
    t.add_column("model")
    counts = {**s["kinds"], "all": s["steps"]}
    for label in KIND_LABELS.values():
        t.add_column(label, justify="right")
    t.add_row("steps", *(f"{counts[kind]:,}" for kind in KIND_LABELS), end_section=True)
    for name, m in fitted.items():
        t.add_row(name + (" *" if name == s["use"] else ""), *(_cell(m["errors"][k]) for k in KIND_LABELS))
    return t


def _source(m: dict, key: str) -> str:
    if key in m["fallbacks"]:
        return f"fallback: {m['fallbacks'][key]}"
    return f"fixed: {m['fixed'][key]}" if key in m["fixed"] else "fit"


def _cell(e: dict) -> str:
    return "-" if e["median"] is None else f"{e['median']:.1%} / {e['p90']:.1%}"


def _param_table(fitted: dict) -> Table:
    from rich.table import Table
    t = Table(title="parameters", title_justify="left")
    for c in ("model", "parameter", "value", "from"):
        t.add_column(c, justify="right" if c == "value" else "left")
    for name, m in fitted.items():
        for key, value in m["params"].items():
            t.add_row(name, key, f"{value:.6g}", _source(m, key))
    return t
