"""`kvsched calibrate --bench-serve FILE / --inference-perf FILE`: fit kvsched's timing
constants to benchmark result files by simulating them (kvsched.cost.results_fit,
docs/calibration.md "Calibration from result files")."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from kvsched.cli.common import emit
from kvsched.errors import KvschedError

if TYPE_CHECKING:
    from rich.console import Group

METRIC_LABELS = {"mean_ttft_ms": "TTFT", "mean_tpot_ms": "TPOT", "mean_itl_ms": "ITL", "mean_e2el_ms": "E2E"}


@dataclass
class ResultsOptions:
    bench_serve: list[Path]
    inference_perf: list[Path]
    fit: Optional[str]
    model: Optional[str]
    gpu: Optional[str]
    max_num_seqs: Optional[int]
    max_num_batched_tokens: Optional[int]
    num_gpu_blocks: Optional[int]
    block_size: int
    tp: int
    pp: int
    weight_dtype: str
    kv_dtype: str
    seed: int
    out: Optional[Path]
    json_: bool
    memory_utilization: float = 0.9

    def files(self) -> tuple[str, list[Path]]:
        return ("bench-serve", self.bench_serve) if self.bench_serve else ("inference-perf", self.inference_perf)


def calibrate_results(opts: ResultsOptions, steplog_only: dict[str, Any]) -> None:
    """Check every option, read every file, fit, then (only then) write --out and print."""
    from kvsched.cli.calibrate import _check_out
    from kvsched.cost.calibrate import write_cost_file
    from kvsched.cost.results import READERS
    from kvsched.cost.results_fit import fit_results, parse_fit
    given = [flag for flag, v in steplog_only.items() if v is not None]
    if given:
        raise KvschedError(f"{given[0]} goes with a step log (STEPLOG), not result files")
    if opts.model is None or opts.gpu is None:
        raise KvschedError("result files need --model and --gpu (the catalogue model and GPU the server ran)")
    names = parse_fit(opts.fit)
    setup = _setup(opts)
    kind, paths = opts.files()
    if opts.out is not None:
        _check_out(opts.out)
        if opts.out.exists() and any(opts.out.resolve() == p.resolve() for p in paths if p.exists()):
            raise KvschedError(f"--out {opts.out} is one of the result files: name another file")
    if opts.seed < 0:
        raise KvschedError(f"--seed must be >= 0, got {opts.seed}")
    runs = [READERS[kind](p, opts.seed) for p in paths]
    result = fit_results(runs, setup, names)
    if opts.out is not None:
        write_cost_file(opts.out, result.cost_file())
    payload = {**result.as_dict(), "out": str(opts.out) if opts.out is not None else None}
    emit(payload, opts.json_, lambda: _render(payload))


def _setup(opts: ResultsOptions):
    """The Setup of the flags, checked before any file is read."""
    from kvsched.cost.results_fit import Setup
    from kvsched.hardware import tokens_of_gpu_blocks
    from kvsched.hardware import get_gpu, get_model
    from kvsched.layout import Layout
    from kvsched.policies import make_policy
    model, gpu = get_model(opts.model), get_gpu(opts.gpu)
    layout = Layout(tp=opts.tp, pp=opts.pp, weight_dtype=opts.weight_dtype, kv_dtype=opts.kv_dtype)
    layout.check(model)
    if isinstance(opts.block_size, bool) or opts.block_size < 1:
        raise KvschedError(f"--block-size must be >= 1 (tokens), got {opts.block_size}")
    params = {k: v for k, v in (("max_num_seqs", opts.max_num_seqs),
                                ("max_num_batched_tokens", opts.max_num_batched_tokens)) if v is not None}
    make_policy("vllm-v1", dict(params), gpu)          # --max-num-seqs and the token budget checked here
    kv = tokens_of_gpu_blocks(opts.num_gpu_blocks, opts.block_size) if opts.num_gpu_blocks is not None else None
    u = opts.memory_utilization
    if isinstance(u, bool) or not 0 < u <= 1:
        raise KvschedError(f"--memory-utilization must be in (0, 1], got {u!r}")
    return Setup(model.name, gpu.name, layout, params, kv, opts.block_size, u)


def _render(s: dict) -> Group:
    from rich.console import Group
    from rich.text import Text
    parts: list = [_error_table(s), _param_table(s)]
    parts += [Text(f"note: {n}") for n in s["notes"]]
    parts.append(Text("simulate with: " + " ".join(s["flags"])))
    if s["out"] is not None:
        parts.append(Text(f"wrote {s['out']}: the roofline constants (use it with --cost {s['out']} and "
                          f"--client-path {s['flags'][-1].split(' ', 1)[1]})"))
    return Group(*parts)


def _error_table(s: dict):
    from rich.table import Table
    t = Table(title=f"mean latencies (ms), measured and simulated: {s['model']} on {s['gpu']}, "
                    f"fitted {', '.join(s['fit'])}", title_justify="left")
    for c in ("file (requests)", "mean", "measured", "defaults", "error", "fit", "error"):
        t.add_column(c, justify="left" if c in ("file (requests)", "mean") else "right")
    for f in s["files"]:
        for k, m in f["metrics"].items():
            t.add_row(f"{Path(f['source']).name} ({f['requests']:,})", METRIC_LABELS[k], f"{m['measured']:.2f}",
                      f"{m['default']:.2f}", f"{m['default_error']:+.1%}", f"{m['fitted']:.2f}",
                      f"{m['fitted_error']:+.1%}")
        t.add_section()
    return t


def _param_table(s: dict):
    from rich.table import Table
    t = Table(title="constants", title_justify="left")
    for c in ("constant", "default", "value", "from"):
        t.add_column(c, justify="left" if c in ("constant", "from") else "right")
    for k, v in s["params"].items():
        t.add_row(k, f"{s['defaults'][k]:.6g}", f"{v:.6g}", "fit" if k in s["fit"] else "default")
    return t
