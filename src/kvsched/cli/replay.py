"""`kvsched replay --engine vllm`: the installed vLLM's own scheduler beside a kvsched policy,
step by step (kvsched.engines.vllm_replay)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvsched.cli.common import JsonOpt, app, emit, guard, workload_flags
from kvsched.errors import KvschedError

if TYPE_CHECKING:       # the engine is imported when the command runs (fast `kvsched --help`)
    from rich.table import Table
    from kvsched.workload.source import WorkloadOptions


@app.command("replay")
@workload_flags
def replay_cmd(wopts: WorkloadOptions,
               engine: str = typer.Option("vllm", "--engine", help="the real scheduler to replay against: vllm"),
               policy: str = typer.Option("vllm-v1", "--policy", help="the kvsched policy to compare"),
               set_: list[str] = typer.Option([], "--set", help="policy parameter key=value (repeatable)"),
               max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="token budget per step (both sides; vllm-v1's unless --set)"),
               max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="running requests (both sides; vllm-v1's unless --set)"),
               long_prefill_token_threshold: int = typer.Option(0, "--long-prefill-token-threshold", help="per-request prefill cap per step, 0 = none"),
               kv_capacity: int = typer.Option(65_536, "--kv-capacity", help="kvsched's KV tokens; vLLM gets G = kv/block + 1 blocks (one is its null block)"),
               block_size: int = typer.Option(16, "--block-size", help="KV block size, tokens"),
               max_model_len: int = typer.Option(8192, "--max-model-len", help="longest request, tokens"),
               step_time: float = typer.Option(0.01, "--step-time", help="constant seconds per step on both sides"),
               prefix_caching: str = typer.Option("on", "--prefix-caching", help="on|off: automatic prefix caching on both sides (vLLM's default: on)"),
               kv_offloading_size: float = typer.Option(0.0, "--kv-offloading-size", help="GiB of CPU memory the prefix cache offloads to (vLLM's OffloadingConnector; kvsched's host tier, written through); 0 = off"),
               spec: str = typer.Option("", "--spec", help="n-gram speculative decoding on both sides, ngram:k (vLLM's speculative_config; docs/speculative-decoding.md)"),
               spec_acceptance: str = typer.Option("", "--spec-acceptance", help="with --spec: acceptance per draft token, ALPHA or a_1,..,a_k (both sides draw the same)"),
               spec_proposal_rate: float = typer.Option(1.0, "--spec-proposal-rate", help="with --spec: share of steps whose n-gram lookup finds drafts"),
               spec_seed: int = typer.Option(0, "--spec-seed", help="with --spec: the seed of the drafts and acceptances"),
               json_: bool = JsonOpt,
               out: Optional[Path] = typer.Option(None, "--out", help="write agreement.json and steps.csv (one row per step) here")) -> None:
    """Run the installed vLLM's v1 scheduler (no model) and a kvsched policy on the same
    workload, arrivals, KV blocks, budget, seats and prefill cap, with a constant step time, and
    report where they agree. JSON keys: steps, steps_differing, vllm_steps, kvsched_steps,
    first_difference (step, differs_in, each side's tokens per request and preempted
    requests), preemptions, first_token_step_diff and finish_step_diff (max, mean,
    requests_differing over requests). vllm-v1 should agree on every step. Prompts get token
    ids from their content (shared segments give shared tokens), so vLLM's prefix cache finds
    the prefixes kvsched's does; a step's `hits` (prompt tokens from the cache) are compared too."""
    def body() -> None:
        if engine != "vllm":
            raise KvschedError(f"--engine {engine!r}: only vllm is supported")
        if prefix_caching not in ("on", "off"):
            raise KvschedError(f"--prefix-caching must be on or off, got {prefix_caching!r}")
        if kv_capacity < 2 * block_size:
            raise KvschedError(f"--kv-capacity {kv_capacity} holds fewer than two blocks of {block_size}")
        from kvsched.engines.vllm_replay import Limits, replay, vllm_version
        from kvsched.params import parse_assignments
        from kvsched.run import check_out, jsonable, write_atomically
        from kvsched.workload.source import load
        if out is not None:
            check_out(out)
        params = parse_assignments(set_, "--set")
        if policy == "vllm-v1":
            params = {"max_num_batched_tokens": str(max_num_batched_tokens), "max_num_seqs": str(max_num_seqs),
                      "long_prefill_token_threshold": str(long_prefill_token_threshold), **params}
        limits = Limits(max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold, block_size,
                        kv_capacity // block_size + 1, max_model_len, prefix_caching == "on", kv_offloading_size,
                        spec, spec_acceptance, spec_proposal_rate, spec_seed)
        limits.check()
        wopts.untimed_ok = False
        w = load(wopts)
        result = replay(w, policy, params, limits, step_time)
        summary = {"engine": f"vllm {vllm_version()}", "policy": policy, **result.as_dict()}
        if spec:
            summary["spec"] = spec
        if out is not None:
            write_atomically(out, lambda d: _write(d, summary, result.rows))
        emit(jsonable(summary), json_, lambda: _table(summary))
    guard(body)


def _write(folder: Path, summary: dict, rows: list[dict]) -> None:
    import json
    from kvsched.run import jsonable
    (folder / "agreement.json").write_text(json.dumps(jsonable(summary), indent=2, sort_keys=True) + "\n")
    with open(folder / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)


def _table(s: dict) -> Table:
    from rich.table import Table
    t = Table(title=f"replay: {s['policy']} against {s['engine']}'s scheduler", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for key in ("steps", "steps_differing", "vllm_steps", "kvsched_steps"):
        t.add_row(key, f"{s[key]:,}")
    t.add_row("preemptions (vllm / kvsched)", f"{s['preemptions']['vllm']} / {s['preemptions']['kvsched']}")
    for key in ("first_token_step_diff", "finish_step_diff"):
        d = s[key]
        t.add_row(key, f"max {d['max']:g}, mean {d['mean']:.3g}, {d['requests_differing']} requests")
    f = s["first_difference"]
    t.add_row("first difference", "none" if f is None else f"step {f['step']}: {', '.join(f['differs_in'])}")
    if f is not None:
        t.add_row("  vllm", str(f["vllm"]))
        t.add_row("  kvsched", str(f["kvsched"]))
    return t
