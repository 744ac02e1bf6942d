"""Benchmark result files read back as kvsched runs (`kvsched calibrate --bench-serve /
--inference-perf`, docs/calibration.md "Calibration from result files").

Each file becomes a `MeasuredRun`: the requests the benchmark sent, rebuilt as a kvsched
`Workload`, and the mean latencies it measured (ms, under vLLM's names `mean_ttft_ms`,
`mean_tpot_ms`, `mean_itl_ms`, `mean_e2el_ms`).

**`vllm bench serve --save-result`** (vllm/benchmarks/serve.py: `benchmark`, which builds
`result`; `main`, which adds the traffic keys and, without `--save-detailed`, drops the
per-request lists):
- `completed` successful requests, `request_rate` (a number, or the string "inf"),
  `burstiness`, `max_concurrency` (null: none), `total_input_tokens`, `total_output_tokens`,
  `mean_{ttft,tpot,itl,e2el}_ms` (only the metrics in `--percentile-metrics`: by default ttft,
  tpot and itl), `failed`, `ramp_up_strategy`;
- with `--save-detailed` also `input_lens` and `output_lens`, one entry per request sent
  (`output_lens` is 0 for a failed one: `calculate_metrics`).

Arrivals as `get_request` draws them: gaps Gamma(shape = burstiness, scale = 1 / (rate x
burstiness)) (burstiness 1: Poisson; inf: constant gaps 1 / rate), summed, and scaled so the
last request is sent at n / rate; an infinite rate sends every request at t = 0. With
`--max-concurrency` C the requests wait for one of C slots (`limited_request_func`, an
asyncio.Semaphore) and TTFT is measured from the send, so an infinite rate with C is a closed
loop at concurrency C (kvsched.workload.arrivals `Closed`).

**inference-perf** per-stage report `stage_N_lifecycle_metrics.json` (kubernetes-sigs/
inference-perf, inference_perf/reportgen/base.py `summarize_requests`, at e8e0aa99 and at
7de5ef2): `load_summary` {`count` requests sent, `requested_rate`, and for a concurrent stage
`concurrency`}, `successes` {`count`, `latency` {`time_to_first_token`,
`time_per_output_token`, `inter_token_latency`, `request_latency`: {`mean`, ...} in seconds,
or null when no request streamed}, `prompt_len` (e8e0aa99) or `prompt_tokens` (7de5ef2)
{`mean`}, `output_len` {`mean`}}. Arrivals as its default load type, `constant`
(inference_perf/loadgen/load_timer.py `ConstantLoadTimer`): int(rate x duration) exponential
gaps of mean 1 / rate, scaled to sum to the stage's duration, taken here as count / rate.

What a result file cannot give back, and its effect:
- **the send times**, without `--save-detailed`: both tools draw them from an unrecorded random
  state, so kvsched draws its own of the same process (`seed`); the fit then matches the means
  of a run like the one measured, not the same run (at high load, where queueing depends on
  bursts, this adds noise to the measured TTFT the fit cannot explain). With
  `--save-detailed`, bench serve's `start_times` are the send times themselves and are used
  (a finite rate; an infinite rate with `max_concurrency` stays a closed loop);
- **the prompts' contents**: shared prefixes (a system prompt, inference-perf's
  shared_prefix data) hit vLLM's prefix cache, and the rebuilt prompts share nothing, so
  kvsched computes every prompt token and the fit makes prefill look slower than it was;
- **per-request lengths** without `--save-detailed` (and always for inference-perf): every
  request gets the mean prompt and output, which hides the length spread (a few long
  requests raise mean TTFT and KV use more than their share);
- **failed requests**: the metrics are over successful requests only; a failed one is left
  out (bench serve) or rebuilt with the mean lengths (inference-perf), a note says how many;
- **the Poisson load type** of inference-perf is not recorded in its report; the constant
  timer is assumed.
- A run both rate- and concurrency-limited (a finite `request_rate` with `max_concurrency`
  below the number of requests) is rebuilt only from its `start_times`, else refused:
  kvsched's closed loop issues on a free slot only.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import GammaArrivals
from kvsched.workload.lengths import MAX_TOKENS
from kvsched.workload.request import Workload

MAX_SPAN = 1e7                  # seconds (about 116 days): the longest run rebuilt from its send times
MIN_RATE = 1e-6                 # requests/s (one in 11.6 days): the lowest rate a rebuilt run takes
METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms")
# inference-perf's latency summaries (seconds) under vLLM's names (ms)
INFERENCE_PERF_METRICS = {"time_to_first_token": "mean_ttft_ms", "time_per_output_token": "mean_tpot_ms",
                          "inter_token_latency": "mean_itl_ms", "request_latency": "mean_e2el_ms"}


@dataclass(frozen=True)
class MeasuredRun:
    """One result file: its requests rebuilt, and the means it measured (ms)."""
    path: str
    kind: str                           # "bench-serve" or "inference-perf"
    sha256: str
    workload: Workload
    measured: dict[str, float]          # METRICS present in the file
    arrivals: str                       # how the arrivals were rebuilt, in words
    lengths: str                        # "per request" or "means"
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"source": self.path, "kind": self.kind, "source_sha256": self.sha256,
                "requests": len(self.workload), "arrivals": self.arrivals, "lengths": self.lengths,
                "notes": list(self.notes)}


# -- reading a JSON file, strictly ------------------------------------------------------------

def _load(path: str | Path) -> tuple[dict, str]:
    """(the top-level object, sha256 of the bytes). NaN is refused; Infinity is read as inf and
    refused later by the key that holds it (vLLM writes burstiness inf as Infinity)."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise KvschedError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise KvschedError(f"{name}: a folder, not a result file") from None
    except OSError as exc:
        raise KvschedError(f"{name}: cannot read it: {exc.strerror or exc}") from None

    def constant(text: str) -> float:
        if text == "Infinity":
            return math.inf
        raise ValueError(f"{text} is not a number")
    try:
        data = json.loads(raw.decode("utf-8-sig"), parse_constant=constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KvschedError(f"{name}: not JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise KvschedError(f"{name}: not a result file (the top level must be a JSON object)")
    return data, hashlib.sha256(raw).hexdigest()


def _get(data: dict, key: str, where: str) -> Any:
    """data[key] (key may be a dotted path), else an error naming the file and key."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KvschedError(f"{where}: missing key {key}")
        node = node[part]
    return node


def _number(value: Any, key: str, where: str, *, low: float = 0.0, strict: bool = False,
            whole: bool = False, inf_ok: bool = False) -> float:
    """A JSON number checked: finite (or inf where allowed), >= low (> low if strict), whole."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvschedError(f"{where}: {key} must be a number, got {value!r:.40}")
    x = float(value)
    if math.isnan(x) or (math.isinf(x) and not (inf_ok and x > 0)):
        raise KvschedError(f"{where}: {key} must be a finite number, got {value!r}")
    if x < low or (strict and x <= low):
        raise KvschedError(f"{where}: {key} must be {'>' if strict else '>='} {low:g}, got {x:g}")
    if whole and math.isfinite(x) and x != int(x):
        raise KvschedError(f"{where}: {key} must be a whole number, got {x:g}")
    return x


def _mean_length(total: float, count: int, key: str, where: str) -> int:
    """A mean length in whole tokens (rounded half to even), at least 1, at most MAX_TOKENS."""
    mean = total / count
    if mean < 0.5:
        raise KvschedError(f"{where}: {key} gives a mean of {mean:g} tokens per request; a request needs >= 1")
    if mean > MAX_TOKENS:
        raise KvschedError(f"{where}: {key} gives a mean of {mean:g} tokens per request, more than {MAX_TOKENS}")
    return max(1, round(mean))


# -- arrivals -------------------------------------------------------------------------------

def bench_serve_arrivals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """n send times (s) as vllm/benchmarks/serve.py `get_request` draws them, without a
    ramp-up: gaps Gamma(shape = b, scale = 1 / (rate b)) (kvsched's GammaArrivals at CV =
    1 / sqrt(b)), constant 1 / rate when b is inf, cumulated and scaled so the last is n / rate;
    all 0 at an infinite rate."""
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        t = np.arange(1, n + 1, dtype=np.float64) / rate
    else:
        t = GammaArrivals(rate, 1.0 / math.sqrt(burstiness)).times(np.random.default_rng(seed), n)
    return t * ((n / rate) / t[-1])


def inference_perf_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """n send times (s) of inference-perf's `ConstantLoadTimer` (inference_perf/loadgen/
    load_timer.py): exponential gaps of mean 1 / rate, scaled to sum to the duration n / rate,
    each request sent after its gap."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps * ((n / rate) / gaps.sum()))


# -- vllm bench serve -----------------------------------------------------------------------

def read_bench_serve(path: str | Path, seed: int = 0) -> MeasuredRun:
    """A `vllm bench serve` result file as a MeasuredRun (module docstring); every problem is a
    one-line error naming the file and the key."""
    data, sha = _load(path)
    where = str(path)
    if data.get("ramp_up_strategy") is not None:
        raise KvschedError(f"{where}: ramp_up_strategy {data['ramp_up_strategy']!r}: a ramp-up run's send times "
                           "are not rebuilt (give a run at one request_rate)")
    completed = int(_number(_get(data, "completed", where), "completed", where, whole=True))
    if completed < 1:
        raise KvschedError(f"{where}: completed is 0: no request succeeded, nothing to fit")
    failed = int(_number(data.get("failed", 0) or 0, "failed", where, whole=True))
    rate = _rate(_get(data, "request_rate", where), where)
    burstiness = _number(data.get("burstiness", 1.0), "burstiness", where, strict=True, inf_ok=True)
    concurrency = data.get("max_concurrency")
    if concurrency is not None:
        concurrency = int(_number(concurrency, "max_concurrency", where, low=1, whole=True))
    measured = _bench_metrics(data, where)
    prompt, output, lengths, notes, ok = _bench_lengths(data, completed, failed, where)
    n = len(prompt)
    sent_at = _start_times(data, ok, where) if ok is not None else None
    if sent_at is not None and math.isfinite(rate):
        w = Workload.build(sent_at, prompt, output, source=f"bench serve {where}")
        arrivals = "the file's start_times (--save-detailed), from the first"
    elif concurrency is not None and concurrency < n and math.isfinite(rate):
        raise KvschedError(f"{where}: max_concurrency {concurrency} with request_rate {rate:g}: a run limited by "
                           "both is rebuilt only from its start_times (vllm bench serve --save-detailed)")
    elif concurrency is not None and concurrency < n:
        w = Workload.build(np.zeros(n), prompt, output, concurrency=concurrency, source=f"bench serve {where}")
        arrivals = f"closed loop at concurrency {concurrency} (max_concurrency, request_rate inf)"
    else:
        w = Workload.build(bench_serve_arrivals(n, rate, burstiness, seed), prompt, output,
                           source=f"bench serve {where}")
        arrivals = ("all at t = 0 (request_rate inf)" if math.isinf(rate) else
                    f"{rate:g} req/s, burstiness {burstiness:g}, seed {seed} (vLLM's gamma process)")
    return MeasuredRun(where, "bench-serve", sha, w, measured, arrivals, lengths, notes)


def _rate(value: Any, where: str) -> float:
    """request_rate: a number >= MIN_RATE, or "inf" (vLLM writes an infinite rate as that string)."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    return _number(value, "request_rate", where, low=MIN_RATE, inf_ok=True)


def _bench_metrics(data: dict, where: str) -> dict[str, float]:
    """The mean latencies the file holds (ms), each finite and > 0; at least one."""
    got = {k: _number(data[k], k, where, strict=True) for k in METRICS if data.get(k) is not None}
    if not got:
        raise KvschedError(f"{where}: missing key mean_ttft_ms (no mean latency to fit: needs one of "
                           f"{', '.join(METRICS)})")
    return got


def _start_times(data: dict, ok: np.ndarray, where: str) -> np.ndarray | None:
    """The successful requests' send times (s, from the first one sent), or None without
    start_times: vllm/benchmarks/serve.py writes each request's time.perf_counter() at its send
    (`RequestFuncOutput.start_time`, backends in benchmarks/lib/endpoint_request_func.py) with
    --save-detailed, in the order of input_lens."""
    if data.get("start_times") is None:
        return None
    value = data["start_times"]
    if not isinstance(value, list) or len(value) != len(ok):
        raise KvschedError(f"{where}: start_times must be a list of {len(ok)} send times (one per request sent)")
    t = np.array([_number(x, f"start_times[{i}]", where, low=-math.inf) for i, x in enumerate(value)], np.float64)
    t = t[ok] - t.min()
    if t.max() > MAX_SPAN:
        raise KvschedError(f"{where}: start_times span {t.max():g} s, more than {MAX_SPAN:g} s")
    return t


def _bench_lengths(data: dict, completed: int, failed: int,
                   where: str) -> tuple[np.ndarray, np.ndarray, str, list[str], np.ndarray | None]:
    """(prompt, output, "per request" | "means", notes, the successful requests' mask or None):
    --save-detailed's input_lens and output_lens (successful requests: output_lens > 0), else
    the file's means."""
    notes = [f"{failed} failed request{'s' if failed != 1 else ''} left out (the metrics are over successful ones)"] \
        if failed else []
    if "input_lens" not in data and "output_lens" not in data:
        total_in = _number(_get(data, "total_input_tokens", where), "total_input_tokens", where)
        total_out = _number(_get(data, "total_output_tokens", where), "total_output_tokens", where)
        p = _mean_length(total_in, completed, "total_input_tokens / completed", where)
        o = _mean_length(total_out, completed, "total_output_tokens / completed", where)
        return np.full(completed, p, np.int64), np.full(completed, o, np.int64), "means", notes, None
    lens = {k: _length_list(_get(data, k, where), k, where) for k in ("input_lens", "output_lens")}
    sent = completed + failed
    for k, v in lens.items():
        if len(v) != sent:
            raise KvschedError(f"{where}: {k} has {len(v)} entries; completed + failed is {sent}")
    ok = lens["output_lens"] > 0
    if int(ok.sum()) != completed:
        notes.append(f"{int(ok.sum())} requests have output_lens > 0 and completed is {completed}: "
                     "the ones with output tokens are rebuilt")
    if not ok.any():
        raise KvschedError(f"{where}: output_lens holds no request with an output token")
    if (lens["input_lens"][ok] < 1).any():
        raise KvschedError(f"{where}: input_lens has a successful request with no prompt token")
    return lens["input_lens"][ok], lens["output_lens"][ok], "per request", notes, ok


def _length_list(value: Any, key: str, where: str) -> np.ndarray:
    if not isinstance(value, list):
        raise KvschedError(f"{where}: {key} must be a list of token counts")
    for i, x in enumerate(value):
        if _number(x, f"{key}[{i}]", where, whole=True) > MAX_TOKENS:
            raise KvschedError(f"{where}: {key}[{i}] must be at most {MAX_TOKENS} tokens, got {x:g}")
    return np.array(value, dtype=np.int64)


# -- inference-perf -------------------------------------------------------------------------

def read_inference_perf(path: str | Path, seed: int = 0) -> MeasuredRun:
    """An inference-perf stage report (stage_N_lifecycle_metrics.json) as a MeasuredRun
    (module docstring); every problem is a one-line error naming the file and the key."""
    data, sha = _load(path)
    where = str(path)
    load = _get(data, "load_summary", where)
    if not isinstance(load, dict):
        raise KvschedError(f"{where}: load_summary must be an object")
    sent = int(_number(_get(data, "load_summary.count", where), "load_summary.count", where, whole=True))
    ok = int(_number(_get(data, "successes.count", where), "successes.count", where, whole=True))
    if ok < 1 or sent < 1:
        raise KvschedError(f"{where}: successes.count is 0: no request succeeded, nothing to fit")
    if ok > sent:
        raise KvschedError(f"{where}: successes.count {ok} exceeds load_summary.count {sent}")
    measured = _inference_perf_metrics(data, where)
    prompt_key = "successes.prompt_len" if "prompt_len" in data["successes"] else "successes.prompt_tokens"
    p = _mean_length(_number(_get(data, f"{prompt_key}.mean", where), f"{prompt_key}.mean", where), 1,
                     f"{prompt_key}.mean", where)
    o = _mean_length(_number(_get(data, "successes.output_len.mean", where), "successes.output_len.mean", where), 1,
                     "successes.output_len.mean", where)
    notes = [f"{sent - ok} failed request{'s' if sent - ok != 1 else ''} rebuilt with the mean lengths "
             "(the metrics are over successful ones)"] if sent > ok else []
    if load.get("concurrency") is not None:
        c = int(_number(load["concurrency"], "load_summary.concurrency", where, low=1, whole=True))
        w = Workload.build(np.zeros(sent), p, o, concurrency=c, source=f"inference-perf {where}")
        return MeasuredRun(where, "inference-perf", sha, w, measured, f"closed loop at concurrency {c}", "means", notes)
    if "requested_rate" not in load:
        raise KvschedError(f"{where}: missing key load_summary.requested_rate (a summary report mixes stages: "
                           "give the per-stage files, stage_N_lifecycle_metrics.json)")
    rate = _number(load["requested_rate"], "load_summary.requested_rate", where, low=MIN_RATE)
    w = Workload.build(inference_perf_arrivals(sent, rate, seed), p, o, source=f"inference-perf {where}")
    return MeasuredRun(where, "inference-perf", sha, w, measured,
                       f"{rate:g} req/s over {sent / rate:g} s, seed {seed} (constant load timer)", "means", notes)


def _inference_perf_metrics(data: dict, where: str) -> dict[str, float]:
    latency = _get(data, "successes.latency", where)
    if not isinstance(latency, dict):
        raise KvschedError(f"{where}: successes.latency must be an object")
    got = {}
    for key, name in INFERENCE_PERF_METRICS.items():
        summary = latency.get(key)
        if summary is None:
            continue                        # null: no request streamed more than one token
        full = f"successes.latency.{key}.mean"
        got[name] = 1000.0 * _number(_get(data, full, where), full, where, strict=True)
    if not got:
        raise KvschedError(f"{where}: missing key successes.latency.time_to_first_token.mean (no mean latency "
                           "to fit)")
    return got


READERS = {"bench-serve": read_bench_serve, "inference-perf": read_inference_perf}

__all__ = ["METRICS", "MeasuredRun", "READERS", "read_bench_serve", "read_inference_perf", "bench_serve_arrivals",
           "inference_perf_arrivals"]
