"""One simulation from names and numbers: the Python API behind `kvsched simulate/compare`."""
from __future__ import annotations

import contextlib
import copy
import csv
import io
import itertools
import json
import math
import numbers
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from functools import partial
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvsched.cost import make_cost_model
from kvsched.errors import PASS_THROUGH, KvschedError
from kvsched.files import remove, stale_temporaries, temp_prefix
from kvsched.hardware import GPU, get_gpu, get_model, usable_kv_tokens
from kvsched import pools
from kvsched.client import DEFAULT as DEFAULT_CLIENT, ClientPath
from kvsched.kvcache import PagedKV
from kvsched.layout import PLAIN, Layout, kv_bytes_per_token, layout_summary
from kvsched.limits import MAX_REPLICAS, check_count
from kvsched.memory_profile import EngineLimits, default_limits
from kvsched.metrics import Goodput, RunRecords, summarize
from kvsched.policies import Policy, make_policy
from kvsched.sim.cluster import Cluster
from kvsched.sim.replica import DEFAULT_STALL_BATCHES
from kvsched.sim.rowlog import BATCHES, TIMELINE
from kvsched.workload.request import Workload

if TYPE_CHECKING:
    from kvsched.csvtext import Column


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
    replicas: int = 1                       # replicas behind `router` (ignored when disaggregated)
    router: str = "round-robin"             # a name (sim/routers.py, kvsched/plugins.py) or a Router
    router_seed: int = 0
    router_params: dict[str, Any] = field(default_factory=dict)   # --router-set key=value
    prefill_replicas: int = 0               # > 0 with decode_replicas > 0: disaggregated pools
    decode_replicas: int = 0
    kv_transfer_bandwidth: float | None = None   # GB/s (1e9 bytes) per prefill replica's link; None: 25, or
                                                 # between --pool prefill/decode the slower side's network
    kv_transfer_latency: float = 0.0        # seconds
    stall_batches: int = DEFAULT_STALL_BATCHES   # preempting batches without an output token before a policy is stopped
    tbt_first_zero: bool = False            # also report p99 TBT with a 0 s gap per first token (SLAI's telemetry)
    prefix_caching: bool | None = None      # None: the policy's default (on for vllm-v1, as vLLM)
    layout: Layout = PLAIN                  # a replica's TP, PP, EP, DP attention, number formats (layout.py)
    pool: tuple[str, ...] = ()              # --pool NAME=GPU:COUNT[:...] (pools.py): replicas of several kinds
    client: ClientPath | None = DEFAULT_CLIENT      # front end and output path (client.py); None: the engine's figures
    preemption: str = "recompute"           # --preemption: recompute, or swap to --kv-tier host (sim/host_swap.py)
    kv_tiers: tuple[str, ...] = ()          # --kv-tier KIND:GB:GBps[:latency_s]: swap's host tier, or the prefix
                                            # cache's tiers below the GPU (sim/kv_tiers.py)
    kv_write: str = "evict"                 # --kv-write: blocks go down when evicted, or `through` as computed
    gpus_per_node: int = 0                  # --gpus-per-node: replicas on one node share its host and disk tiers
                                            # (0: each replica its own; sim/kv_tiers.py, `node_groups`)
    spec: str = ""                          # --spec METHOD:k, speculative decoding (sim/spec_decode.py); "": none
    spec_acceptance: str = ""               # --spec-acceptance ALPHA | a_1,..,a_k | RATES;TIER=RATES
    spec_proposal_rate: float = 1.0         # --spec-proposal-rate: share of n-gram lookups that find drafts
    spec_adaptive: str = ""                 # --spec-adaptive FIRST-LAST:K,... (vLLM's dynamic k per batch size)
    spec_draft_model: str | None = None     # --spec-draft-model: the catalogue model of --spec draft:k
    spec_seed: int = 0                      # --spec-seed: the key of the draws of drafts and acceptances
    autoscale: str = ""                     # --autoscale hpa|slo (sim/autoscale.py); "": a fixed fleet
    autoscale_params: dict[str, Any] = field(default_factory=dict)     # --autoscale-set key=value
    admit: tuple[str, ...] = ()             # --admit TIER:rate=R[:burst=B] | TIER:concurrency=N (sim/admission.py)
    shed: tuple[str, ...] = ()              # --shed TIER[:ttft=S]
    abandon_after: tuple[str, ...] = ()     # --abandon-after [TIER=]S
    lora_params: dict[str, Any] = field(default_factory=dict)          # --lora-set key=value (sim/lora.py)
    prices: str | None = None               # --prices FILE: price per GPU-hour (prices.py); None: the bundled table
    report_bucket_s: float | None = None    # --report-bucket: seconds per window of `over_time` (an autoscaled
                                            # run's default: 3600)

    def pools(self) -> tuple[int, int]:
        """(replicas, prefill replicas), checked: whole numbers, within `limits.MAX_REPLICAS`
        together, and a KV link only between pools."""
        p, d = self.prefill_replicas, self.decode_replicas
        if self.pool:
            from kvsched.pools import ROLES, check_pools, parse_pool
            if not isinstance(self.pool, (tuple, list)) or not all(isinstance(text, str) for text in self.pool):
                raise KvschedError(f"Scenario.pool must be a tuple of --pool texts, got {self.pool!r}")
            given = [parse_pool(text, self.model, self.layout) for text in self.pool]
            if check_pools(given):
                return sum(x.count for x in given), next(x.count for x in given if x.name == ROLES[0])
            p = d = 0
        if p or d:
            p = check_count("--prefill-replicas", p, MAX_REPLICAS, low=0)
            d = check_count("--decode-replicas", d, MAX_REPLICAS, low=0)
            if p < 1 or d < 1:
                raise KvschedError(f"disaggregation needs --prefill-replicas >= 1 and --decode-replicas >= 1, "
                                   f"got {p} and {d}")
            if self.replicas != 1:
                raise KvschedError("give either --replicas or --prefill-replicas/--decode-replicas, not both")
            check_count("--prefill-replicas + --decode-replicas", p + d, MAX_REPLICAS)
            return p + d, p
        link = [f for f, v, default in (("--kv-transfer-bandwidth", self.kv_transfer_bandwidth, None),
                                        ("--kv-transfer-latency", self.kv_transfer_latency, 0.0)) if v != default]
        if link:
            raise KvschedError(f"{link[0]} sets the KV link between prefill and decode pools: it needs "
                               "--prefill-replicas and --decode-replicas")
        return check_count("--replicas", self.replicas, MAX_REPLICAS), 0

    def check(self) -> None:
        """The scenario's own numbers, checked without building anything (a sweep checks every
        setting of its grid this way before it runs a point)."""
        for flag, v in (("--kv-capacity", self.kv_capacity), ("--max-model-len", self.max_model_len),
                        ("--block-size", self.block_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise KvschedError(f"{flag} must be >= 1 (a whole number of tokens), got {v!r}")
        u = self.memory_utilization
        if isinstance(u, bool) or not isinstance(u, Real) or not 0 < u <= 1:
            raise KvschedError(f"--memory-utilization must be in (0, 1], got {u!r}")
        check_count("--trim", self.trim, 2 ** 63 - 1, low=0)
        check_count("--stall-batches", self.stall_batches, 2 ** 63 - 1)
        check_count("--seed (of the router)", self.router_seed, 2 ** 63 - 1, low=0)
        for name in ("model", "gpu", "cost") + (("router",) if not hasattr(self.router, "route") else ()):
            if not isinstance(getattr(self, name), str):
                raise KvschedError(f"Scenario.{name} must be a name (text), got {getattr(self, name)!r}")
        if not isinstance(self.router, str) and not all(hasattr(self.router, a) for a in ("name", "uses_state")):
            raise KvschedError(f"Scenario.router {type(self.router).__name__} needs name, uses_state and route "
                               "(sim/routers.py, Router)")
        for flag, v in (("--kv-transfer-bandwidth", self.kv_transfer_bandwidth),
                        ("--kv-transfer-latency", self.kv_transfer_latency)):
            if v is None and flag == "--kv-transfer-bandwidth":
                continue
            if isinstance(v, bool) or not isinstance(v, Real):
                raise KvschedError(f"{flag} must be a number, got {v!r}")
        checks = (("cost_params", dict, self.cost_params), ("router_params", dict, self.router_params),
                  ("goodput", (Goodput, type(None)), self.goodput))
        for name, kind, v in checks:
            if not isinstance(v, kind):
                raise KvschedError(f"Scenario.{name} must be {getattr(kind, '__name__', 'a Goodput or None')}, "
                                   f"got {type(v).__name__}")
        for name in ("strict", "tbt_first_zero") + (("prefix_caching",) if self.prefix_caching is not None else ()):
            if not isinstance(getattr(self, name), (bool, np.bool_)):   # "off" would be true
                raise KvschedError(f"Scenario.{name} must be True or False, got {getattr(self, name)!r}")
        self.pools()
        if self.client is not None and not isinstance(self.client, ClientPath):
            raise KvschedError(f"Scenario.client must be a ClientPath (kvsched.client) or None, got {self.client!r}")
        if not isinstance(self.layout, Layout):
            raise KvschedError(f"Scenario.layout must be a Layout (kvsched.layout), got {type(self.layout).__name__}")
        self.layout.check()
        self.host_tier()
        if self.pool:
            self.kinds_of_pools()
        self.spec_config()
        self.control_config()

    def control_config(self) -> dict[str, Any]:
        """The control plane's settings, checked (sim/control.py): autoscale (an AutoscaleConfig
        or None), admission (an Admission or None), lora (a LoraConfig or None); {} when none
        is used (the cluster then runs without a control plane)."""
        from kvsched.sim.admission import Admission, parse_abandon, parse_admit, parse_shed
        from kvsched.sim.autoscale import parse_autoscale
        from kvsched.sim.lora import parse_lora
        w = self.workload
        for name in ("admit", "shed", "abandon_after"):
            v = getattr(self, name)
            if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
                raise KvschedError(f"Scenario.{name} must be a tuple of texts, got {v!r}")
        for name in ("autoscale_params", "lora_params"):
            if not isinstance(getattr(self, name), dict):
                raise KvschedError(f"Scenario.{name} must be a dict of key=value settings")
        b = self.report_bucket_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, Real) or not 0 < b < math.inf):
            raise KvschedError(f"--report-bucket must be a positive number of seconds, got {self.report_bucket_s!r}")
        if self.autoscale_params and not self.autoscale:
            raise KvschedError("--autoscale-set sets the scaler's parameters: it needs --autoscale hpa|slo")
        auto = parse_autoscale(self.autoscale, self.autoscale_params) if self.autoscale else None
        if w is None:                       # a template (a sweep's): the rest is checked with its workload
            parse_lora(self.lora_params)
            return {}
        names = [t.name for t in w.tiers]
        adm = Admission(w.tiers, [parse_admit(x, names) for x in self.admit],
                        [parse_shed(x, names, {t.name: t.ttft_slo for t in w.tiers}) for x in self.shed],
                        [parse_abandon(x, names) for x in self.abandon_after])
        adapters = bool(len(w) and (w.adapter >= 0).any())
        if self.lora_params and not adapters:
            raise KvschedError("--lora-set sets how replicas hold LoRA adapters: the workload names none "
                               "(--adapters N)")
        lora = parse_lora(self.lora_params) if adapters else None
        out = {"autoscale": auto, "admission": adm if adm.active else None, "lora": lora}
        if not any(out.values()) and not w.models:
            return {}
        if self.prefill_replicas or self.decode_replicas or any(t.split("=")[0].strip() in ("prefill", "decode")
                                                                for t in self.pool):
            raise KvschedError("the control plane (--autoscale, --admit, --shed, --abandon-after, adapters, "
                               "--model-mix) is modelled on replicas behind one router, not on prefill/decode pools")
        if (adm.active and (w.closed_loop or w.has_sessions)):
            raise KvschedError("--admit, --shed and --abandon-after drop requests: a closed loop or sessions would "
                               "wait for them forever; use open-loop arrivals")
        if self.spec or self.kv_tiers or self.preemption != "recompute":
            raise KvschedError("the control plane is not modelled with --spec, --kv-tier or --preemption swap")
        return out

    def spec_config(self):
        """--spec and its options, checked (sim/spec_decode.py): a SpecConfig, or None without --spec."""
        from kvsched.sim.spec_decode import spec_config
        if not self.spec:
            given = [f for f, v, d in (("--spec-acceptance", self.spec_acceptance, ""),
                                       ("--spec-proposal-rate", self.spec_proposal_rate, 1.0),
                                       ("--spec-adaptive", self.spec_adaptive, ""),
                                       ("--spec-draft-model", self.spec_draft_model, None),
                                       ("--spec-seed", self.spec_seed, 0)) if v != d]
            if given:
                raise KvschedError(f"{given[0]} sets speculative decoding: it needs --spec METHOD:k")
            return None
        if self.pool:
            raise KvschedError("--spec is not modelled with --pool (replicas of several kinds)")
        if self.spec_draft_model is not None:
            get_model(self.spec_draft_model)
        return spec_config(self.spec, self.spec_acceptance, self.workload.tiers, self.spec_proposal_rate,
                           self.spec_adaptive, self.spec_seed, self.spec_draft_model,
                           bool((self.workload.tier_index < 0).any()))

    def host_tier(self):
        """--kv-tier and --preemption, checked: the host tier that swap preemption uses, or None
        (docs/kv-tiers.md). With --preemption recompute the tiers hold the prefix cache's
        blocks instead (`offload_tiers`)."""
        from kvsched.sim.host_swap import parse_kv_tier
        from kvsched.sim.kv_tiers import WRITE_MODES
        if self.preemption not in ("recompute", "swap"):
            raise KvschedError(f"--preemption must be recompute or swap, got {self.preemption!r}")
        if self.kv_write not in WRITE_MODES:
            raise KvschedError(f"--kv-write must be one of {', '.join(WRITE_MODES)}, got {self.kv_write!r}")
        if not isinstance(self.kv_tiers, (tuple, list)):
            raise KvschedError(f"Scenario.kv_tiers must be a tuple of --kv-tier texts, got {self.kv_tiers!r}")
        tiers = [parse_kv_tier(t) for t in self.kv_tiers]
        kinds = [t.kind for t in tiers]
        if len(set(kinds)) < len(kinds):
            raise KvschedError(f"--kv-tier: {kinds[0] if kinds.count(kinds[0]) > 1 else kinds[1]} given twice")
        if self.preemption == "swap" and kinds != ["host"]:
            raise KvschedError("--preemption swap needs exactly one tier, the host tier it swaps to: --kv-tier "
                               "host:GB:GBps[:latency_s] (offloading the prefix cache alongside swap is not modelled)")
        if tiers and self.pool:
            raise KvschedError("--kv-tier is not modelled with --pool (replicas of several kinds)")
        if self.preemption == "swap" and (self.prefill_replicas or self.decode_replicas):
            raise KvschedError("--preemption swap is modelled on replicas of one kind behind a router (no "
                               "disaggregation yet)")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, numbers.Integral) \
                or self.gpus_per_node < 0:
            raise KvschedError(f"--gpus-per-node must be a whole number >= 0 (0: each replica its own tiers), "
                               f"got {self.gpus_per_node!r}")
        if self.gpus_per_node and not (tiers and self.preemption == "recompute"):
            raise KvschedError("--gpus-per-node shares a node's --kv-tier host and disk tiers between its replicas: "
                               "it needs a --kv-tier and --preemption recompute")
        if self.kv_write != "evict" and not (tiers and self.preemption == "recompute"):
            raise KvschedError("--kv-write sets how the prefix cache's blocks go down to --kv-tier tiers: it needs "
                               "a --kv-tier and --preemption recompute")
        return tiers[0] if tiers and self.preemption == "swap" else None

    def offload_tiers(self) -> tuple[str, ...]:
        """The --kv-tier texts the prefix cache offloads to (sim/kv_tiers.py): all of them,
        unless --preemption swap uses the host tier."""
        self.host_tier()
        return () if self.preemption == "swap" else tuple(self.kv_tiers)

    def kinds_of_pools(self, limits: Callable[[GPU], EngineLimits] | None = None) -> list:
        """--pool's kinds of replica (pools.py), or [] without pools; `limits` as in `resolve`."""
        from kvsched.pools import check_pools, parse_pool, resolve
        if not self.pool:
            return []
        if self.replicas != 1 or self.prefill_replicas or self.decode_replicas:
            raise KvschedError("give either --pool or --replicas/--prefill-replicas/--decode-replicas, not both")
        if not isinstance(self.pool, (tuple, list)) or not all(isinstance(text, str) for text in self.pool):
            raise KvschedError(f"Scenario.pool must be a tuple of --pool texts, got {self.pool!r}")
        pools = [parse_pool(text, self.model, self.layout) for text in self.pool]
        check_pools(pools)
        return resolve(pools, self, limits)

    def resolve(self, limits: Callable[[GPU], EngineLimits] | None = None):
        """(model, GPU, KV tokens, cost model). The KV tokens are --kv-capacity, else what vLLM's
        memory profile leaves (memory_profile.py) with `limits` of the GPU (default: vLLM's)."""
        self.check()
        if self.pool:
            raise KvschedError("--pool (replicas of several kinds) works with kvsched simulate and compare")
        model, gpu = get_model(self.model), get_gpu(self.gpu)
        layout = self.layout.check(model)
        tokens = self.kv_capacity if self.kv_capacity is not None else usable_kv_tokens(
            model, gpu, self.memory_utilization, self.block_size, layout, limits(gpu) if limits else None)
        cost = make_cost_model(self.cost, self.cost_params, model, gpu, layout)
        spec = self.spec_config()
        if spec is not None and self.kv_capacity is None:     # the drafter's weights and KV share the GPU
            from kvsched.cost.spec_cost import capacity_with_drafter, drafter_model
            draft = get_model(spec.draft_model) if spec.draft_model else None
            tokens = capacity_with_drafter(tokens, self.block_size, model, drafter_model(spec.method, model, draft),
                                           layout)
            if tokens < self.block_size:
                raise KvschedError(f"{model.name} and its {spec.method} drafter on {gpu.name} leave no KV block")
        return model, gpu, tokens, cost


@dataclass
class Result:
    policy: str
    summary: dict[str, Any]
    records: RunRecords
    timeline: list | None
    batches: list | None
    policy_state: Any = None    # the policy object after the run (adaptive state, decisions)
    policies: list = field(default_factory=list)    # every replica's policy object, in order

    def write(self, out: Path) -> None:
        """Write summary.json, requests.csv, timeline.csv (and batches.csv) into `out`,
        via a temporary folder so a failure leaves nothing half written."""
        write_atomically(out, self.write_files)

    def write_files(self, d: Path) -> None:
        results = {k: v for k, v in self.summary.items() if k not in RUN_ENVIRONMENT}
        (d / "summary.json").write_text(json.dumps(jsonable(results), indent=2, allow_nan=False) + "\n")
        (d / "run.json").write_text(json.dumps(jsonable({k: self.summary.get(k) for k in RUN_ENVIRONMENT}),
                                               indent=2, allow_nan=False) + "\n")
        # requests.csv in a thread beside the row logs: their text is laid out without the GIL
        # (csvtext, compiled), so the two files take two cores
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as pool:
            requests = pool.submit(self._write_requests, d / "requests.csv")
            per_replica = ["replica"] if self.records.replica_stats is not None else []
            if self.timeline is not None:
                _write_rows(d / "timeline.csv", TIMELINE.names + per_replica, self.timeline)
            if self.batches is not None:
                _write_rows(d / "batches.csv", BATCHES.names + per_replica, self.batches)
            requests.result()

    def _write_requests(self, path: Path) -> None:
        from kvsched.csvtext import csv_lines      # only runs that write files pay for its tables
        r = self.records
        with open(path, "wb") as f:
            f.write(_csv_rows([["id", "arrival", "prompt_tokens", "output_tokens", "status", "admitted",
                                "first_token", "finished", "ttft", "e2el", "preemptions",
                                "recomputed_tokens", "itl_count", "itl_max", "itl_sum", "tbt_violations",
                                "replica"] + (["decode_replica", "transfer_s"] if r.decode_replica is not None
                                              else [])]))
            for lo in range(0, len(r.arrival), ROWS_PER_WRITE):     # bounded memory for any run
                f.writelines(csv_lines(_request_columns(r, slice(lo, lo + ROWS_PER_WRITE))))


ROWS_PER_WRITE = 1 << 14        # requests a block: at 65,536 the write peaked ~10 MB higher, no faster


def _request_columns(records: RunRecords, rows: slice) -> list[Column]:
    """requests.csv's columns for `rows`, built a column at a time (a row at a time costs
    seconds per million requests); a time that did not happen is an empty cell."""
    r = _Rows(records, rows)
    done, first_ok = np.isfinite(r.finished), np.isfinite(r.first_token)
    with np.errstate(invalid="ignore"):
        ttft, e2el, itl_sum = r.first_token - r.arrival, r.finished - r.arrival, r.finished - r.first_token
    status = np.where(r.rejected, "rejected", np.where(done, "finished", "unfinished"))
    if r.dropped is not None:
        status = np.where(r.dropped == 1, "shed", np.where(r.dropped == 2, "abandoned", status))
    replica = r.replica if r.replica is not None else np.where(r.rejected, -1, 0)
    cols = [(r.ids.astype(np.int64), None), (r.arrival, None), (r.prompt.astype(np.int64), None),
            (r.output.astype(np.int64), None), (status, None), (r.admitted, np.isfinite(r.admitted)),
            (r.first_token, first_ok), (r.finished, done), (ttft, first_ok), (e2el, done),
            (r.preemptions.astype(np.int64), None), (r.recomputed.astype(np.int64), None),
            (r.output.astype(np.int64) - 1, done), (r.itl_max, done), (itl_sum, done),
            (r.tbt_violations.astype(np.int64), None), (replica, None)]
    if r.decode_replica is not None:
        dr = r.decode_replica.astype(np.int64)
        cols += [(dr, dr >= 0), (r.transfer.astype(np.float64), np.isfinite(r.transfer))]
    return cols


class _Rows:
    """The per-request arrays of `records`, sliced to `rows` (None stays None)."""

    def __init__(self, records: RunRecords, rows: slice) -> None:
        self._r, self._rows = records, rows

    def __getattr__(self, name: str):
        a = getattr(self._r, name)
        return None if a is None else a[self._rows]


def _write_rows(path: Path, header: list[str], rows) -> None:
    """A CSV file of per-batch rows: a block of columns at a time where `row_blocks` can
    read them so, else row by row through the csv module."""
    from kvsched.csvtext import csv_lines
    from kvsched.sim.rowlog import row_blocks
    with open(path, "wb") as f:
        f.write(_csv_rows([header]))
        blocks = row_blocks(rows)
        if blocks is None:
            rows = iter(rows)
            while batch := list(itertools.islice(rows, ROWS_PER_WRITE)):
                f.write(_csv_rows(batch))
            return
        for columns in blocks:
            f.writelines(csv_lines(columns))


def _csv_rows(rows: list) -> bytes:
    """Rows as csv.writer writes them: headers, and rows `csv_lines` is not given."""
    text = io.StringIO(newline="")
    csv.writer(text).writerows(rows)
    return text.getvalue().encode("utf-8")


RUN_ENVIRONMENT = ("wall_seconds",)    # figures of the machine, not of the run: kept out of summary.json


def jsonable(x):
    """Non-finite floats as None (strict JSON has no NaN or Infinity), numpy scalars as Python
    numbers, through dicts, lists and tuples."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


MANIFEST = ".kvsched-run"          # the files kvsched wrote into an --out folder, one per line


def write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """Write a run into folder `out`: `fill` writes a new sibling folder, which then replaces
    `out` by renames, so `out` always holds exactly one complete run. A folder `out` that
    holds files kvsched did not write (not in its manifest) is refused, never deleted.
    SIGTERM and SIGINT during the write leave no temporary folder behind; what a `kill -9`
    left (`.NAME.PID.*`, files.stale_temporaries) the next write to `out` removes."""
    out = check_out(out)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _clear_stale(parent, out)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), dir=parent))
    except OSError as exc:
        raise KvschedError(f"cannot write to {out}: {exc.strerror or exc}") from None
    old = None
    try:
        with _terminate_as_interrupt():
            fill(tmp)
            (tmp / MANIFEST).write_text("".join(f"{p.relative_to(tmp)}\n" for p in sorted(tmp.rglob("*"))
                                                if p.is_file()))
            if out.is_dir():
                _check_ours(out)
                old = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name) + "old.", dir=parent))
                os.replace(out, old / "run")
            os.replace(tmp, out)
    except OSError as exc:
        raise KvschedError(f"cannot write to {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            _restore(old, out)


def _restore(old: Path, out: Path) -> None:
    """Put back the earlier run a writer moved aside into `old` if it stopped before its own
    run took the place; then remove `old`."""
    if not out.exists() and (old / "run").is_dir():
        os.rename(old / "run", out)
    shutil.rmtree(old, ignore_errors=True)


def _clear_stale(parent: Path, out: Path) -> None:
    """Remove the temporary folders of killed writers of `out` (files.stale_temporaries),
    restoring a run one of them had moved aside. A moved-aside folder that is a link, or
    holds anything but an empty folder or one kvsched run (every file in its manifest), is
    left alone."""
    def moved(p: Path) -> bool:          # `.NAME.PID.old.*`
        return ".old." in p.name[len(out.name) + 1:]
    for path in sorted(stale_temporaries(parent, out.name), key=moved, reverse=True):   # moved-aside runs first
        if not moved(path):
            remove(path)
        elif not path.is_symlink() and path.is_dir() and _moved_run(path):
            with contextlib.suppress(OSError):
                _restore(path, out)


def _moved_run(old: Path) -> bool:
    """Whether `old` is what write_atomically moves aside: nothing yet (killed before the
    move), or one folder `run` holding only files of its kvsched manifest."""
    try:
        names = [p.name for p in old.iterdir()]
        if not names:
            return True
        run = old / "run"
        if names != ["run"] or run.is_symlink() or not run.is_dir():
            return False
        _check_ours(run)
        return True
    except (OSError, KvschedError):
        return False


def check_out(out) -> Path:
    """--out checked before any work: a name, not a file, not a link, nothing foreign in it."""
    if str(out).strip() in ("", ".") or Path(out).resolve() == Path.cwd():
        raise KvschedError("--out needs a folder name (an empty name would write into the current folder)")
    out = Path(out)
    if out.is_symlink():
        raise KvschedError(f"--out {out} is a symbolic link; give the folder itself")
    if out.exists() and not out.is_dir():
        raise KvschedError(f"--out {out} exists and is not a folder")
    if out.is_dir():
        _check_ours(out)
    return out


def _check_ours(out: Path) -> None:
    """Refuse a non-empty folder unless every file in it is listed in kvsched's manifest."""
    entries = {str(p.relative_to(out)) for p in out.rglob("*")}
    if not entries:
        return
    listed = set(manifest_names(out))
    folders = {str(parent) for name in listed for parent in Path(name).parents if str(parent) != "."}
    strangers = sorted(entries - listed - folders - {MANIFEST})
    if strangers:
        raise KvschedError(f"--out {out} holds files kvsched did not write ({strangers[0]}"
                           f"{f' and {len(strangers) - 1} more' if len(strangers) > 1 else ''}); "
                           "choose a new or empty folder")


def manifest_names(folder: Path) -> list[str]:
    """The names in folder's manifest (none without one), decoded as file names are
    (surrogateescape), so any bytes compare with the folder's names instead of failing."""
    manifest = folder / MANIFEST
    try:
        text = manifest.read_bytes().decode("utf-8", "surrogateescape") if manifest.is_file() else ""
    except OSError as exc:
        raise KvschedError(f"cannot read {manifest}: {exc.strerror or exc}") from None
    return [line for line in text.split("\n") if line]


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while writing, so the cleanup above runs."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:                  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def simulate(scenario: Scenario, policy: str | Policy = "vllm-v1", policy_params: dict[str, Any] | None = None,
             *, record_timeline: bool = False, record_batches: bool = False,
             progress: Callable[[int, int], None] | None = None,
             decode_policy: str | Policy | None = None, decode_params: dict[str, Any] | None = None) -> Result:
    """Run one policy on a scenario and summarize it.

    `policy` is a name from `kvsched.policies.POLICIES` (built with `policy_params`) or a
    policy object (anything with `name` and `schedule(view) -> Plan`; see README). Each
    replica gets its own copy (policies keep state). When prefill and decode are
    disaggregated, `decode_policy` (default: the same) runs on the decode replicas.
    """
    if not isinstance(scenario.workload, Workload):
        raise KvschedError(f"Scenario.workload must be a Workload, got {type(scenario.workload).__name__}")
    limits = partial(engine_limits, policy, policy_params)
    kinds = scenario.kinds_of_pools(limits)
    if kinds:
        each = [k for k in kinds for _ in range(k.pool.count)]      # one per replica, prefill pool first
        replicas, prefill = len(each), kinds[0].pool.count if kinds[0].pool.name == "prefill" else 0
        model, gpu = min((k.model for k in kinds), key=lambda m: m.max_len), None
        gpus, cost = [k.gpu for k in each], [k.cost for k in each]
        kv = [PagedKV(k.tokens, scenario.block_size) for k in each]
    else:
        model, gpu, tokens, cost = scenario.resolve(limits)
        replicas, prefill = scenario.pools()
        gpus, kv = [gpu] * replicas, PagedKV(tokens, scenario.block_size)
    pols = [_policy(policy, policy_params, gpus[k], k) for k in range(prefill or replicas)]
    if prefill:
        if decode_policy is None:
            dp, dparams = policy, {**(policy_params or {}), **(decode_params or {})}
        else:
            dp, dparams = decode_policy, decode_params
        first = prefill if dp is policy else 0      # the same object: copies for every decode replica
        pols += [_policy(dp, dparams, gpus[prefill + k], first + k) for k in range(replicas - prefill)]
    max_len = scenario.max_model_len if scenario.max_model_len is not None else model.max_len
    link = scenario.kv_transfer_bandwidth
    if link is None:
        link = pools.link_gbps(kinds) if kinds and prefill else 25.0
    offload = scenario.offload_tiers()
    per_node = node_groups(scenario.gpus_per_node, scenario.layout.gpus) if offload else 1
    spec = scenario.spec_config()
    ctl = scenario.control_config()
    cluster = Cluster(scenario.workload, pols, cost, kv, router=scenario.router, router_seed=scenario.router_seed,
                      router_params=scenario.router_params, kinds=[k.describe() for k in each] if kinds else None,
                      prefill_replicas=prefill, kv_bytes_per_token=pools.transfer_bytes(kinds) if kinds else
                      kv_bytes_per_token(model, scenario.layout),
                      bandwidth_gbps=link, latency_s=scenario.kv_transfer_latency,
                      max_model_len=max_len, record_timeline=record_timeline, record_batches=record_batches,
                      strict=scenario.strict, stall_batches=scenario.stall_batches,
                      prefix_caching=prefix_caching_for(scenario, pols[0]),
                      shared_tiers=shares_tiers(offload, per_node, (prefill or len(pols)) > 1),
                      spec_slots=(spec.k, spec.lookahead) if spec is not None else (0, 0), controlled=bool(ctl))
    tier = scenario.host_tier()
    if tier is not None:                    # each replica its own host tier and links
        for rep in cluster.replicas:
            attach_host_swap(rep, tier, kv_bytes_per_token(model, scenario.layout))
    if spec is not None:
        from kvsched.cost import cost_file_drafter
        attach_spec(cluster.replicas, spec, model, gpu, scenario.layout, cost_file_drafter(scenario.cost), max_len)
    if offload:                             # disaggregated: the prefill replicas, the ones that look prefixes up
        attach_offload(cluster.replicas[:prefill] if prefill else cluster.replicas, offload, scenario.kv_write,
                       kv_bytes_per_token(model, scenario.layout), cluster.links, per_node)
    layouts = [k.pool.layout for k in each] if kinds else [scenario.layout] * replicas
    control = attach_control(cluster, scenario, ctl, kinds, model, gpus, layouts, policy, policy_params) if ctl else None
    records = cluster.run(progress)
    records.dropped = control.dropped if control is not None else None
    name = pols[0].name if hasattr(pols[0], "name") else type(pols[0]).__name__
    records.extra = {"policy": name, "cost_model": scenario.cost,
                     "model": "+".join(dict.fromkeys(k.model.name for k in kinds)) if kinds else model.name,
                     "gpu": "+".join(dict.fromkeys(g.name for g in gpus)) if kinds else gpu.name,
                     "block_size": cluster.replicas[0].kv.block_size}
    if kinds:
        records.extra["pools"] = [k.summary() for k in kinds]
        records.extra["kv_capacity_total_tokens"] = sum(r.kv.capacity_tokens for r in cluster.replicas)
    elif scenario.layout != PLAIN:
        records.extra.update(layout_summary(scenario.layout))
    if replicas > 1:
        records.extra.update({"replicas": replicas, "router": cluster.router.name})
        if scenario.router_params:
            records.extra["router_params"] = dict(scenario.router_params)
    if prefill:
        records.extra.update({"prefill_replicas": prefill, "decode_replicas": replicas - prefill,
                              "decode_policy": pols[-1].name})
    records.client = scenario.client
    summary = summarize(records, scenario.goodput, scenario.trim, tbt_first_zero=scenario.tbt_first_zero)
    caches = [r.cache for r in cluster.replicas if r.cache is not None]
    if caches:
        summary.update(prefix_cache_summary(caches))
    if tier is not None:
        summary.update(swap_summary([r._swap for r in cluster.replicas], max(r.now for r in cluster.replicas)))
    if offload:
        summary.update(offload_summary(cluster.replicas, records, max(r.now for r in cluster.replicas)))
    if spec is not None:
        from kvsched.sim.spec_decode import spec_summary
        summary.update(spec_summary([r._spec for r in cluster.replicas]))
    summary.update(run_cost(scenario, records, cluster, control, gpus, layouts))
    if control is not None and control.admission is not None:      # each tier's dropped requests in its row
        for k, row in enumerate(summary.get("tiers", [])):
            row["shed"], row["abandoned"] = control.admission.shed[k], control.admission.abandoned[k]
    reports = [p.report() for p in pols if callable(getattr(p, "report", None))]
    if reports:                 # what the policy decided (e.g. WAIT's thresholds), per replica
        summary["policy_report"] = reports[0] if len(pols) == 1 else reports
    return Result(name, summary, records, cluster.timeline, cluster.batches, pols[0], pols)


def attach_control(cluster: Cluster, scenario: Scenario, ctl: dict[str, Any], kinds: list, model, gpus: list,
                   layouts: list, policy, params):
    """The control plane of `ctl` (Scenario.control_config) on the cluster (sim/control.py):
    its pools (--pool's, or one of every replica), each pool's cold start from its weights,
    the SLO scaler's capacity per replica (measured when not given: `rate_at_ttft_slo`), and
    the adapters' size per replica."""
    from kvsched.layout import weight_bytes_per_gpu
    from kvsched.sim.autoscale import SloScaler
    from kvsched.sim.control import ControlPlane
    from kvsched.sim.lora import BYTES, adapter_params
    if kinds:
        pools, start = [], 0
        for k in kinds:
            pools.append((k.pool.name, k.model.name, list(range(start, start + k.pool.count))))
            start += k.pool.count
        models = [k.model for k in kinds for _ in range(k.pool.count)]
    else:
        pools, models = [("replicas", model.name, list(range(len(cluster.replicas))))], [model] * len(cluster.replicas)
    auto, lora = ctl["autoscale"], ctl["lora"]
    scaler = cold = None
    if auto is not None:
        slo = auto_ttft_slo(scenario)
        scaler = auto.build(slo)
        cold = [auto.cold_start(weight_bytes_per_gpu(models[m[0]], layouts[m[0]])) for _, _, m in pools]
        if isinstance(scaler, SloScaler):
            if scaler.ttft_slo_s is None:
                raise KvschedError("--autoscale slo scales to a TTFT SLO: give --autoscale-set ttft_slo_s=S (or "
                                   "--goodput ttft:MS)")
            if not scaler.rate_per_replica:
                from kvsched.capacity import rate_at_ttft_slo
                scaler.rates = [rate_at_ttft_slo(pool_template(scenario, kinds[k] if kinds else None), policy, params,
                                                 scaler.ttft_slo_s) for k in range(len(pools))]
    adm = ctl["admission"]
    if adm is not None and any(x is not None for x in adm.patience):
        for rep in cluster.replicas:                # a request leaving its queue would break that state
            refuse_own_state(rep, "--abandon-after")
    sizes = [adapter_params(m, lora.rank) * BYTES for m in models] if lora else None
    cluster.control = ControlPlane(cluster, pools, autoscale=auto, scaler=scaler, cold_s=cold,
                                   admission=ctl["admission"], lora=lora, adapter_bytes=sizes, gpus=gpus,
                                   layouts=layouts)
    return cluster.control


def auto_ttft_slo(scenario: Scenario) -> float | None:
    """The TTFT bound (s) of an autoscaled run: --autoscale-set ttft_slo_s, else --goodput ttft."""
    v = scenario.autoscale_params.get("ttft_slo_s")
    if v is not None:
        return float(v)
    g = scenario.goodput
    return g.ttft / 1000 if g is not None and g.ttft is not None else None


def pool_template(scenario: Scenario, kind) -> Scenario:
    """One replica of the scenario's kind (or of `kind`, a --pool's), without the control plane:
    what the SLO scaler's capacity per replica is measured on."""
    import dataclasses
    one = dataclasses.replace(scenario, replicas=1, pool=(), autoscale="", autoscale_params={}, admit=(), shed=(),
                              abandon_after=(), report_bucket_s=None)
    if kind is not None:
        one = dataclasses.replace(one, gpu=kind.pool.gpu, model=kind.pool.model, layout=kind.pool.layout)
    w = one.workload
    if w.models:                            # the requests of this model only (-1: the run's own model)
        model = kind.model.name if kind else get_model(one.model).name
        names = np.array([get_model(scenario.model).name, *w.models])
        w = w.take(np.flatnonzero(names[w.model_index.astype(np.int64) + 1] == model))
        one = dataclasses.replace(one, workload=dataclasses.replace(w, model_index=np.full(len(w), -1, np.int16),
                                                                    models=()))
    return one


def run_cost(scenario: Scenario, records, cluster: Cluster, control, gpus: list, layouts: list) -> dict[str, Any]:
    """The run's GPU-hours, dollars and joules (fleet.py), and with a control plane or
    --report-bucket its figures per window (`over_time`)."""
    from kvsched import fleet
    from kvsched.prices import read_prices
    end = fleet.run_end(records)
    scaled = control is not None and control.scaler is not None
    holds = control.fleet.hours(end) if scaled else [end] * len(cluster.replicas)
    out_tokens = int(records.output[np.isfinite(records.finished)].sum())
    out = fleet.fleet_summary(holds, [r.busy for r in cluster.replicas], gpus, [lay.gpus for lay in layouts],
                              out_tokens, read_prices(scenario.prices))
    if control is not None:
        out.update(control.summary())
    bucket = scenario.report_bucket_s
    if bucket is None and scaled:
        bucket = 3600.0
    if bucket is not None:
        counts = control.fleet.counts if scaled else [(0.0, [len(cluster.replicas)])]
        out["over_time"] = fleet.over_time(records, counts, bucket, end, auto_ttft_slo(scenario),
                                           control.dropped if control is not None else None)
    return out


def refuse_own_state(rep, flag: str) -> None:
    """`flag` moves requests behind the policy's back: refused for a policy with an `on_preempt`
    hook, which keeps its own state per request."""
    if rep._on_preempt is not None:
        raise KvschedError(f"{flag}: policy {rep.name} keeps its own request state (on_preempt); it is "
                           "modelled for policies without that hook (vllm-v1, vllm-v0, sarathi, orca, request-level, "
                           "the eb policies)")


def attach_host_swap(rep, tier, kv_bytes_per_token: int) -> None:
    """--preemption swap on replica `rep`: its host tier (sim/host_swap.py). A policy with an
    `on_preempt` hook keeps its own state for a preempted request (it expects it back in the
    queue, where a swap keeps it out), so it is refused."""
    from kvsched.sim.host_swap import HostSwap
    refuse_own_state(rep, "--preemption swap")
    rep._swap = rep._side = HostSwap(tier, rep.block_size * kv_bytes_per_token)


def attach_spec(replicas: list, cfg, model, gpu, layout, drafter=None, max_len: int | None = None) -> None:
    """--spec on every replica (sim/spec_decode.py): its drafts and acceptances, and its cost model
    with the verify chunks and the drafter's passes (cost/spec_cost.py). The dense roofline's
    fast path is off: the verify chunks need the general shape. `--spec-adaptive auto`: the
    schedule of k by batch size that the cost model finds best (`best_k_schedule`) for a decoder
    of the workload's typical context (mean prompt + half the mean output), up to the policy's
    max_num_seqs (else 1024). `drafter`: one fitted by `kvsched calibrate` (the cost file's), in
    place of the roofline's."""
    import dataclasses

    from kvsched.cost.spec_cost import SpecCost, best_k_schedule, drafter_cost
    from kvsched.sim.spec_decode import Speculation
    draft = get_model(cfg.draft_model) if cfg.draft_model else None
    if drafter is None or cfg.method == "ngram":
        drafter = drafter_cost(cfg.method, model, draft, gpu, layout)
    if cfg.schedule == "auto":
        w = replicas[0].reqs.workload
        ctx = int(np.mean(w.prompt) + np.mean(w.output) / 2) if len(w) else 1
        seats = getattr(replicas[0].policy, "max_num_seqs", None) or 1024
        cfg = dataclasses.replace(cfg, schedule=best_k_schedule(replicas[0].cost, drafter, cfg.acceptance.rates,
                                                                ctx, min(int(seats), 4096), cfg.proposal_rate))
    for rep in replicas:
        rep._spec = Speculation(cfg, rep.block_size, rep.reqs.tier, rep.cache is not None, max_len)
        rep.cost = SpecCost(rep.cost, drafter, rep._spec)
        rep._dense_time = None


def attach_offload(replicas: list, texts: tuple[str, ...], write: str, kv_bytes_per_token: int,
                   links: list | None = None, per_node: int = 1) -> None:
    """--kv-tier with --preemption recompute: the prefix cache's tiers below the GPU on each
    replica (sim/kv_tiers.py); a remote tier is one store shared by them all. `links`: the
    prefill replicas' KV transfer links when disaggregated, which their remote tier's traffic
    shares (the node's network link). `per_node` replicas in turn share a node's host and disk
    stores (`node_groups`). Under a policy that does not declare `plans_prefix_hits`
    (it computes each prompt from token 0, so a loaded prefix would be computed again), the
    tiers are written and never read (`tier_reads: false`, docs/kv-tiers.md)."""
    from kvsched.sim.kv_tiers import Offload, parse_tiers
    if any(r.cache is None for r in replicas):
        raise KvschedError("--kv-tier offloads the prefix cache: turn it on with --prefix-caching (or give "
                           "--preemption swap to swap preempted requests to a host tier)")
    bs = replicas[0].block_size
    for k, (rep, stores) in enumerate(zip(replicas, parse_tiers(texts, write, bs * kv_bytes_per_token, len(replicas),
                                                                         per_node))):
        rep._offload = rep._side = rep.cache.spill = Offload(stores, bs, write == "through",
                                                             links[k] if links else None, tier_reads(rep.policy))
        rep._offload.clock = rep


def node_groups(gpus_per_node: int, replica_gpus: int) -> int:
    """Replicas per node under --gpus-per-node: replica k takes the node's GPUs after replica
    k-1's, so a node of N GPUs holds N / (tp x pp x dp) replicas, which share its host and disk
    tiers; 1 (each replica its own) without the flag. A replica may not straddle two nodes."""
    if not gpus_per_node:
        return 1
    if gpus_per_node % replica_gpus:
        raise KvschedError(f"--gpus-per-node {gpus_per_node} is not a whole number of replicas of {replica_gpus} "
                           "GPUs (tp x pp x dp): a replica's GPUs sit on one node")
    return int(gpus_per_node) // replica_gpus


def shares_tiers(texts: tuple[str, ...], per_node: int, replicas: bool) -> bool:
    """Whether some tier of `texts` is one store for several replicas (`replicas`: more than one
    has tiers): a remote store, or a node's host or disk tier shared by `per_node` > 1."""
    from kvsched.sim.host_swap import parse_kv_tier
    return replicas and any(parse_kv_tier(t).kind == "remote" or per_node > 1 for t in texts)


def tier_reads(policy) -> bool:
    """Whether a replica loads prefixes from its tiers: only under a policy that starts a waiting
    request's first chunk after its cached prefix (`plans_prefix_hits`, policies/base.py). The
    others keep no request in vLLM's WAITING_FOR_REMOTE_KVS either, so their own queues (wait,
    nested-wait) never meet a request the engine moved behind their back."""
    return bool(getattr(policy, "plans_prefix_hits", False))


def offload_summary(replicas: list, records, duration: float) -> dict[str, Any]:
    """summary.json's `tier_breakdown` for the prefix cache's tiers (docs/kv-tiers.md): per tier
    (a shared remote store once), its hit rate (prompt tokens loaded from it over the prompt
    tokens looked up at admission, the denominator of `prefix_cache_hit_rate`), bytes written
    in and read out, capacity, the links' busy fraction (both directions, averaged over the
    replicas) and the loads that read from it; then `ttft_split_ms`."""
    replicas = [r for r in replicas if r._offload is not None]     # disaggregated: the prefill replicas
    offs = [r._offload for r in replicas]
    query = sum(r.cache.query_tokens for r in replicas)
    rows = []
    for k, port in enumerate(offs[0].ports):
        ports = [o.ports[k] for o in offs]
        stores = list({id(p.store): p.store for p in ports}.values())
        loads = sum(p.loads for p in ports)
        rows.append({
            "name": port.store.kind,
            "hit_rate": sum(s.loaded_tokens for s in stores) / query if query else None,
            "bytes_in": sum(s.bytes_in for s in stores), "bytes_out": sum(s.bytes_out for s in stores),
            "capacity_bytes": sum(s.capacity_blocks * s.block_bytes for s in stores),
            "link_busy_fraction": sum(p.busy_fraction(duration) for p in ports) / len(ports)
            if duration > 0 else None,
            "loads": loads, "mean_load_wait_ms": 1000 * sum(p.load_s for p in ports) / loads if loads else None,
            "evictions": sum(s.evictions for s in stores)})
    loads = sum(o.loads for o in offs)
    waited = {i: s for o in offs for i, s in o.load_s.items()}
    return {"kv_write": "through" if offs[0].through else "evict", "tier_reads": all(o.reads for o in offs),
            "tier_breakdown": rows, "tier_loads": loads,
            "mean_load_wait_ms": 1000 * sum(o.load_time for o in offs) / loads if loads else None,
            "ttft_split_ms": ttft_split(records, waited)}


def ttft_split(records, loading: dict[int, float]) -> dict[str, dict[str, float] | None]:
    """TTFT in three parts, mean and median over finished requests (ms): queueing (arrival to
    admission, less the time spent loading from the tiers), loading, and prefill (admission to
    the first token: chunks, and the batches they wait for)."""
    adm, first, arr = records.admitted, records.first_token, records.arrival
    done = np.flatnonzero(np.isfinite(first))
    if not len(done):
        return {"queueing": None, "loading": None, "prefill": None}
    load = np.zeros(len(arr))
    for i, s in loading.items():
        load[i] = s
    parts = {"queueing": adm[done] - arr[done] - load[done], "loading": load[done],
             "prefill": first[done] - adm[done]}
    return {k: {"mean": 1000 * float(v.mean()), "p50": 1000 * float(np.median(v))} for k, v in parts.items()}


def swap_summary(swaps: list, duration: float) -> dict[str, Any]:
    """summary.json's `tier_breakdown` (one object per tier, over every replica's; the links'
    busy time over both directions of every replica's for the run) and the swap counters
    (sim/host_swap.py, `HostSwap`)."""
    ins = sum(sw.ins for sw in swaps)
    tier = {"name": swaps[0].spec.kind, "hit_rate": None, "bytes_in": sum(sw.bytes_in for sw in swaps),
            "bytes_out": sum(sw.bytes_out for sw in swaps),
            "capacity_bytes": sum(sw.capacity_blocks * sw.block_bytes for sw in swaps),
            "link_busy_fraction": sum(sw.link_busy() / (2 * duration) for sw in swaps) / len(swaps)
            if duration > 0 else None}
    return {"preemption": "swap", "tier_breakdown": [tier], "swap_outs": sum(sw.outs for sw in swaps),
            "swap_ins": ins, "swap_fallbacks": sum(sw.fallbacks for sw in swaps),
            "mean_swap_wait_ms": 1000 * sum(sw.wait_s for sw in swaps) / ins if ins else None}


def prefix_caching_for(scenario: Scenario, policy) -> bool:
    """--prefix-caching, else the policy's default (`prefix_caching_default`, off if it has none)."""
    if scenario.prefix_caching is not None:
        return bool(scenario.prefix_caching)
    return bool(getattr(policy, "prefix_caching_default", False))


def prefix_cache_summary(caches) -> dict[str, Any]:
    """Prefix-cache figures over the replicas (docs/prefix-caching.md, "Metrics")."""
    q = sum(c.query_tokens for c in caches)
    h = sum(c.hit_tokens for c in caches)
    qb = sum(c.query_blocks for c in caches)
    hb = sum(c.hit_blocks for c in caches)
    return {"prefix_hit_rate": h / q if q else 0.0, "prefix_block_hit_rate": hb / qb if qb else 0.0,
            "prefill_tokens_saved": h, "prefix_evictions": sum(c.evictions for c in caches)}


def engine_limits(policy: str | Policy, params: dict[str, Any] | None, gpu: GPU) -> EngineLimits:
    """The token budget and sequence cap of vLLM's memory profile (memory_profile.py): the run's
    policy's max_num_batched_tokens and max_num_seqs (built from its --set, so texts are typed
    as the policy types them; or a policy object's own), else vLLM's defaults for the GPU."""
    d = default_limits(gpu)
    built = make_policy(policy, params or {}, gpu) if isinstance(policy, str) else policy   # --set's texts typed

    def pick(key: str, default: int) -> int:
        v = getattr(built, key, None)
        return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 40 else default
    return EngineLimits(pick("max_num_batched_tokens", d.max_num_batched_tokens),
                        pick("max_num_seqs", d.max_num_seqs))


def _policy(policy: str | Policy, params: dict[str, Any] | None, gpu, k: int) -> Policy:
    """A fresh policy for replica k: built from its name, or a copy of the given object."""
    if isinstance(policy, str):
        return make_policy(policy, params or {}, gpu)
    if params:
        raise KvschedError("policy parameters go with a policy name; a policy object is used as given")
    if not callable(getattr(policy, "schedule", None)):
        raise KvschedError(f"{type(policy).__name__} is not a policy: it has no schedule(view) method")
    if k == 0:
        return policy
    try:
        return copy.deepcopy(policy)
    except PASS_THROUGH:
        raise
    except BaseException as exc:        # each replica needs its own: policies keep state
        name = getattr(policy, "name", type(policy).__name__)
        raise KvschedError(f"policy {name} cannot be copied for replica {k} (every replica runs its own "
                           f"copy; make it deep-copyable or run one replica): {type(exc).__name__}: {exc}") from None
