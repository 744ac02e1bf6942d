"""Any workload source the CLI accepts, resolved to a WorkloadSpec: a preset name, a TOML
workload file, a trace file, `--phase` flags, or the built-in default; then the flags that
override it (applied to every phase)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import Closed, Poisson, parse_arrivals
from kvsched.workload.bundled import TraceNotFound, catalogue, find_trace
from kvsched.workload.config import (load_workload_file, parse_phase_flag, parse_tier_flag,
                                     parse_window, with_spread)
from kvsched.workload.lengths import parse_length
from kvsched.workload.presets import PRESETS
from kvsched.workload.request import Workload
from kvsched.workload.sharing import parse_sessions, parse_shared_prefix
from kvsched.workload.spec import Phase, RequestType, WorkloadSpec, check_cap_len
from kvsched.workload.traces import trace_arrivals

DEFAULT_RATE = 8.0
DEFAULT_REQUESTS = 1000
DEFAULT_LENGTH = "jitter:512"


@dataclass
class WorkloadOptions:
    """The workload flags of `simulate`, `compare` and `workload stats/export`."""
    workload: str | None = None         # preset name, workload file, trace file or bundled trace name
    trace: str | Path | None = None     # trace file or bundled trace name, as given
    format: str = "auto"
    rate: float | None = None
    arrivals: str | None = None
    num_requests: int | None = None
    seed: int = 0
    prompt_len: str | None = None
    output_len: str | None = None
    output_known: bool = False
    tiers: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    cap_len: int | None = None
    window: str | None = None
    spread: float | None = None
    keep_hashes: bool = False
    untimed_ok: bool = False            # describe a length-only trace without arrivals
    shared_prefix: str | None = None    # 'TOKENS:SHARE,...': system prompts of synthetic phases
    sessions: str | None = None         # 'turns=T,think=S': multi-turn sessions in synthetic phases
    adapters: str | None = None         # 'N[:zipf=S][:none=F]': a LoRA adapter per request (workload/tags.py)
    model_mix: str | None = None        # 'NAME:SHARE,...': a base model per request (workload/tags.py)


def base_spec(opts: WorkloadOptions) -> WorkloadSpec:
    given = [x for x in (opts.workload, opts.trace, opts.phases or None) if x is not None]
    if len(given) > 1:
        raise KvschedError("give one workload source: --workload, --trace or --phase")
    if opts.phases:
        return WorkloadSpec(tuple(parse_phase_flag(p, k) for k, p in enumerate(opts.phases)), name="--phase")
    if opts.trace is not None:
        return WorkloadSpec((Phase(trace=find_trace(opts.trace)),), name=str(opts.trace))
    if opts.workload is not None:
        if opts.workload in PRESETS:
            return PRESETS[opts.workload].make()
        path = Path(opts.workload)
        if path.suffix == ".toml":
            return load_workload_file(path)
        try:
            path = find_trace(opts.workload)
        except TraceNotFound:
            raise KvschedError(f"unknown workload {opts.workload!r}: not a preset (`kvsched workloads` lists "
                               "them), a .toml workload file, a trace file or a bundled trace's name "
                               f"({', '.join(catalogue())})") from None
        return WorkloadSpec((Phase(trace=path),), name=str(opts.workload))
    return WorkloadSpec((Phase(DEFAULT_REQUESTS, (RequestType(parse_length(DEFAULT_LENGTH),
                                                               parse_length(DEFAULT_LENGTH)),),
                               arrivals=Poisson(DEFAULT_RATE)),), name="built-in")


def resolve(opts: WorkloadOptions) -> WorkloadSpec:
    """The spec the options describe, overrides applied."""
    if opts.rate is not None and not opts.rate > 0:
        raise KvschedError(f"--rate must be > 0 requests per second, got {opts.rate}")
    if opts.num_requests is not None and opts.num_requests < 1:
        raise KvschedError(f"--num-requests must be >= 1, got {opts.num_requests}")
    if opts.cap_len is not None:
        check_cap_len(opts.cap_len)
    spec = base_spec(opts)
    arrivals = parse_arrivals(opts.arrivals) if opts.arrivals is not None else None
    window = parse_window("--window", opts.window) if opts.window is not None else None
    phases = tuple(_override(ph, k, opts, arrivals, window) for k, ph in enumerate(spec.phases))
    tiers = tuple(parse_tier_flag(t) for t in opts.tiers) or spec.tiers
    return replace(spec, phases=phases, tiers=tiers, seed=opts.seed,
                   output_known=spec.output_known or opts.output_known,
                   cap_len=opts.cap_len if opts.cap_len is not None else spec.cap_len,
                   keep_hashes=spec.keep_hashes or opts.keep_hashes, untimed_ok=opts.untimed_ok)


def load(opts: WorkloadOptions) -> Workload:
    from kvsched.workload.tags import tag
    return tag(resolve(opts).build(), opts.seed, opts.adapters, opts.model_mix)


def _override(ph: Phase, k: int, opts: WorkloadOptions, arrivals, window) -> Phase:
    where = ph.label(k)
    changes: dict = {}
    if opts.num_requests is not None:
        changes["requests"] = opts.num_requests
    if opts.prompt_len is not None or opts.output_len is not None:
        if ph.trace is not None or len(ph.types) != 1:
            raise KvschedError(f"{where}: --prompt-len/--output-len apply to synthetic workloads with one "
                               "request type, not to a trace or a mix of types")
        t = ph.types[0]
        changes["types"] = (replace(t, prompt=parse_length(opts.prompt_len) if opts.prompt_len else t.prompt,
                                    output=parse_length(opts.output_len) if opts.output_len else t.output),)
    if ph.trace is None and (opts.window is not None or opts.format != "auto"):
        raise KvschedError(f"{where}: --window and --format apply to trace files")
    if opts.shared_prefix is not None or opts.sessions is not None:
        if ph.trace is not None:
            raise KvschedError(f"{where}: --shared-prefix and --sessions apply to synthetic workloads, not to a trace")
        if opts.shared_prefix is not None:
            changes["shared_prefix"] = _flag("--shared-prefix", parse_shared_prefix, opts.shared_prefix)
        if opts.sessions is not None:
            changes["sessions"] = _flag("--sessions", parse_sessions, opts.sessions)
    if window is not None:
        changes["window"] = window
    if opts.format != "auto":
        changes["format"] = opts.format
    new = arrivals if arrivals is not None else ph.arrivals
    if opts.rate is not None:
        if ph.trace is not None:
            new = trace_arrivals(None, opts.rate, new)
        elif isinstance(new, Closed):
            raise KvschedError("--rate does not apply to closed-loop arrivals (the loop sets the rate); "
                               "change the concurrency with --arrivals closed:C")
        else:
            new = new.with_rate(opts.rate) if new is not None else Poisson(opts.rate)
    if opts.spread is not None:
        new = with_spread(f"{where}: --spread", new, opts.spread)
    changes["arrivals"] = new
    return replace(ph, **changes)


def _flag(flag: str, parse, text: str):
    try:
        return parse(text)
    except KvschedError as exc:
        raise KvschedError(f"{flag}: {exc}") from None
