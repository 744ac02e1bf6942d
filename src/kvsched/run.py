"""One simulation from names and numbers: the Python API behind `kvsched simulate/compare`."""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvsched.cost import make_cost_model
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model, kv_capacity_tokens
from kvsched.kvcache import PagedKV
from kvsched.metrics import Goodput, RunRecords, summarize
from kvsched.policies import make_policy
from kvsched.sim.server import Server
from kvsched.workload.request import Workload


@dataclass
class Scenario:
    """Everything but the policy: workload, hardware, KV and batch-time model."""
    workload: Workload
    model: str = "llama-3-8b"
    gpu: str = "a100-80gb"
    cost: str = "roofline"
    cost_params: dict[str, Any] = field(default_factory=dict)
    kv_capacity: int | None = None          # tokens; default from model and GPU
    memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None        # default: the model's
    goodput: Goodput | None = None
    trim: int = 0
    strict: bool = False

    def resolve(self):
        model, gpu = get_model(self.model), get_gpu(self.gpu)
        if self.kv_capacity is not None and self.kv_capacity < 1:
            raise KvschedError(f"--kv-capacity must be >= 1 token, got {self.kv_capacity}")
        tokens = self.kv_capacity if self.kv_capacity is not None else kv_capacity_tokens(
            model, gpu, self.memory_utilization)
        cost = make_cost_model(self.cost, self.cost_params, model, gpu)
        return model, gpu, tokens, cost


@dataclass
class Result:
    policy: str
    summary: dict[str, Any]
    records: RunRecords
    timeline: list | None
    batches: list | None
    policy_state: Any = None    # the policy object after the run (adaptive state, decisions)

    def write(self, out: Path) -> None:
        """Write summary.json, requests.csv, timeline.csv (and batches.csv) into `out`,
        via a temporary folder so a failure leaves nothing half written."""
        write_atomically(out, self.write_files)

    def write_files(self, d: Path) -> None:
        (d / "summary.json").write_text(json.dumps(_jsonable(self.summary), indent=2) + "\n")
        r = self.records
        with open(d / "requests.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "arrival", "prompt_tokens", "output_tokens", "status", "admitted",
                        "first_token", "finished", "ttft", "e2el", "preemptions",
                        "recomputed_tokens", "itl_count", "itl_max", "itl_sum", "tbt_violations"])
            ids = r.ids
            for k in range(len(r.arrival)):
                status = "rejected" if r.rejected[k] else ("finished" if math.isfinite(r.finished[k]) else "unfinished")
                fin = r.finished[k] if math.isfinite(r.finished[k]) else ""
                first = r.first_token[k] if math.isfinite(r.first_token[k]) else ""
                adm = r.admitted[k] if math.isfinite(r.admitted[k]) else ""
                ttft = first - r.arrival[k] if first != "" else ""
                e2el = fin - r.arrival[k] if fin != "" else ""
                itl_sum = fin - first if fin != "" else ""
                w.writerow([int(ids[k]), r.arrival[k], int(r.prompt[k]), int(r.output[k]), status,
                            adm, first, fin, ttft, e2el, int(r.preemptions[k]), int(r.recomputed[k]),
                            int(r.output[k]) - 1 if fin != "" else "", r.itl_max[k] if fin != "" else "",
                            itl_sum, int(r.tbt_violations[k])])
        if self.timeline is not None:
            _write_rows(d / "timeline.csv", ["time", "queue_length", "running", "kv_used_tokens"], self.timeline)
        if self.batches is not None:
            _write_rows(d / "batches.csv", ["start", "duration", "prefill_tokens", "prefill_requests",
                                            "decode_requests", "kv_used_tokens"], self.batches)


def _write_rows(path: Path, header: list[str], rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KvschedError(f"--out {out} exists and is not a folder")
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as exc:
        raise KvschedError(f"cannot write to {out}: {exc.strerror or exc}") from None
    try:
        fill(tmp)
        out.mkdir(exist_ok=True)
        for item in sorted(tmp.iterdir()):
            dest = out / item.name
            if dest.is_dir() and not item.is_file():
                shutil.rmtree(dest)
            os.replace(item, dest)
    except OSError as exc:
        raise KvschedError(f"cannot write to {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def simulate(scenario: Scenario, policy: str = "vllm-v1", policy_params: dict[str, Any] | None = None,
             *, record_timeline: bool = False, record_batches: bool = False,
             progress: Callable[[int, int], None] | None = None) -> Result:
    """Run one policy on a scenario and summarize it."""
    model, gpu, tokens, cost = scenario.resolve()
    pol = make_policy(policy, policy_params or {}, gpu)
    kv = PagedKV(tokens, scenario.block_size)
    max_len = scenario.max_model_len if scenario.max_model_len is not None else model.max_len
    server = Server(scenario.workload, pol, cost, kv, max_model_len=max_len,
                    record_timeline=record_timeline, record_batches=record_batches,
                    strict=scenario.strict)
    records = server.run(progress)
    records.extra = {"policy": policy, "cost_model": scenario.cost, "model": model.name,
                     "gpu": gpu.name, "block_size": kv.block_size}
    summary = summarize(records, scenario.goodput, scenario.trim)
    return Result(policy, summary, records, server.timeline, server.batches, pol)
