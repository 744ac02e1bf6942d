"""The papers' workloads by name (`kvsched workloads` lists them).

Where a paper leaves a number open, the preset picks one and says so in its description
(marked "assumed"); `--rate`, `--arrivals`, `--num-requests` and the other workload flags
override any of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvsched.errors import KvschedError
from kvsched.workload.arrivals import Arrivals, Closed, Poisson, PoissonTruncated, _check_rate
from kvsched.workload.bundled import find_named
from kvsched.workload.lengths import Fixed, Jitter, Uniform
from kvsched.workload.request import Tier
from kvsched.workload.spec import Phase, RequestType, TierShare, WorkloadSpec

EB = "exclusive-batching-eb.txt"
STAB = "stability-capacity.txt"
FLUID = "fluid-wait-nested-wait.txt"
SLAI = "rad-slai.txt"

# ShareGPT (openchat_sharegpt4) lengths, the SLAI evaluation's workload (rad-slai.txt, Table 1:
# median / p90 prompt 1730 / 5696, decode 415 / 834); bundled (kvsched/data/traces)
SHAREGPT_FILE = "sharegpt-lengths.csv"


@dataclass(frozen=True)
class Preset:
    name: str
    source: str
    description: str
    make: Callable[[], WorkloadSpec]


def sharegpt_phase(requests: int, rate: float | Arrivals, sample: bool | str = True) -> Phase:
    """ShareGPT lengths (sharegpt-lengths.csv: $KVSCHED_TRACES, else the bundled copy; never a file
    of that name in the working folder), its rows
    picked by `sample` (True: with replacement; "permutation": without, the file shuffled once by
    the seed, as the SLAI authors read it, rad-slai.txt section 7). `rate` is a Poisson rate or an
    arrival process."""
    arrivals = Poisson(rate) if isinstance(rate, (int, float)) else rate
    return Phase(requests, trace=find_named(SHAREGPT_FILE), arrivals=arrivals, name="sharegpt", sample=sample)


def _one(requests: int, prompt, output, arrivals, name: str = "") -> Phase:
    return Phase(requests, (RequestType(prompt, output),), arrivals=arrivals, name=name)


def _eb(prompt: int, output: int) -> Callable[[], WorkloadSpec]:
    return lambda: WorkloadSpec((_one(4000, Jitter(prompt), Jitter(output), Closed(2048)),),
                                name=f"eb {prompt}/{output}")


def _eb_distribution_shift() -> WorkloadSpec:
    means = ((1024, 128), (512, 512), (128, 1024))
    return WorkloadSpec(tuple(_one(2000, Jitter(p), Jitter(o), Closed(2048), f"{p}/{o}") for p, o in means),
                        name="eb-distribution-shift")


def _eb_concurrency_shift() -> WorkloadSpec:
    return WorkloadSpec(tuple(_one(2000, Jitter(512), Jitter(256), Closed(c), f"c={c}")
                              for c in (32, 512, 1024, 256, 2048)), name="eb-concurrency-shift")


PD = {"1-1": (1600, 1600), "2-1": (2133, 1066), "1-2": (1066, 2133), "8-1": (2844, 356)}


def _pd(ratio: str, requests: int = 10_000) -> Phase:
    hi_p, hi_o = PD[ratio]
    return _one(requests, Uniform(10, hi_p), Uniform(10, hi_o), Poisson(5.0), f"PD {ratio.replace('-', ':')}")


def _types(prompts, outputs, rates, requests: int, known: bool, name: str) -> WorkloadSpec:
    types = tuple(RequestType(Fixed(p), Fixed(o), r) for p, o, r in zip(prompts, outputs, rates))
    return WorkloadSpec((Phase(requests, types),), output_known=known, name=name)


SLAI_DURATION = 2100.0      # seconds: "Each experiment runs for 35 minutes" (rad-slai.txt section 7)
SLAI_GAP_CAP = 3.0          # gaps capped at 3x the mean (the authors' trace generator)
SLAI_PRESET_RATE = 1.0      # req/s (nominal) for the presets; the paper sweeps 0.2, 0.4, ..., 1.6


def slai_workload(paying: float, rate: float, seed: int = 0, duration: float = SLAI_DURATION,
                  truncated: bool = True) -> WorkloadSpec:
    """The SLAI experiment's workload (rad-slai.txt section 7): ShareGPT (openchat_sharegpt4)
    rows read without replacement from the length file shuffled once by `seed`, prompt + output
    capped at 8,192 tokens; arrivals `poisson-trunc:RATE:3` (exponential gaps capped at 3x
    their mean, as the authors' generator; effective rate RATE / (1 - e^-3) = 1.0524 RATE) or,
    with `truncated=False`, Poisson at `rate`; ceil(effective rate x `duration`) requests
    (the product rounded to 1e-9 first, so 0.2 x 2100 gives 420), 35 minutes by default.

    Each request is paying with probability `paying` (TBT SLO 0.1 s, priority 0), else free
    (TBT SLO 0.5 s, priority 1), drawn independently per request (`TierShare` shares are
    per-request probabilities: numpy `choice` with p, seeded by `seed`). The paper's warm-up before
    measurement is not given in seconds; use `Scenario.trim` for one."""
    if isinstance(paying, bool) or not (isinstance(paying, (int, float)) and 0 <= paying <= 1):
        raise KvschedError(f"slai_workload: paying must be a share in [0, 1], got {paying!r}")
    _check_rate(rate)
    if not (isinstance(duration, (int, float)) and duration > 0 and math.isfinite(duration)):
        raise KvschedError(f"slai_workload: duration must be > 0 seconds, got {duration!r}")
    arrivals = PoissonTruncated(float(rate), SLAI_GAP_CAP) if truncated else Poisson(float(rate))
    n = max(1, math.ceil(round(arrivals.mean_rate * duration, 9)))
    tiers = (TierShare(Tier("paying", tbt_slo=0.1, priority=0), float(paying)),
             TierShare(Tier("free", tbt_slo=0.5, priority=1), round(1 - paying, 12)))
    return WorkloadSpec((sharegpt_phase(n, arrivals, sample="permutation"),), tiers=tiers,
                        seed=seed, cap_len=8192, name=f"slai-paying-{paying * 100:g}")


def _sharegpt() -> WorkloadSpec:
    return WorkloadSpec((sharegpt_phase(2000, 1.0),), cap_len=8192, name="sharegpt")


def _slai(paying: float) -> Callable[[], WorkloadSpec]:
    return lambda: slai_workload(paying, SLAI_PRESET_RATE)


_SLAI_TEXT = (f"ShareGPT rows without replacement (the file shuffled by --seed), prompt + output capped "
              f"at 8,192; poisson-trunc:{SLAI_PRESET_RATE:g}:3 (gaps capped at 3x the mean: "
              f"{PoissonTruncated(SLAI_PRESET_RATE, SLAI_GAP_CAP).mean_rate:.4f} req/s effective; rate "
              f"{SLAI_PRESET_RATE:g} assumed, the paper sweeps 0.2..1.6), 35 minutes = "
              f"{math.ceil(PoissonTruncated(SLAI_PRESET_RATE, SLAI_GAP_CAP).mean_rate * SLAI_DURATION):,} "
              "requests; {paying}% paying users (TBT SLO 0.1 s, priority 0), the rest free (TBT 0.5 s, "
              "priority 1), drawn per request")


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("eb-decode-heavy", f"{EB} section 4.1", "Decode-heavy: prompt jitter:128, output jitter:1024 "
           "(0.5x-1.5x of the mean), closed loop c = 2048, 4,000 requests", _eb(128, 1024)),
    Preset("eb-balanced", f"{EB} section 4.1", "Balanced: jitter:512 / jitter:512, closed loop c = 2048, "
           "4,000 requests", _eb(512, 512)),
    Preset("eb-prefill-heavy", f"{EB} section 4.1", "Prefill-heavy: jitter:1024 / jitter:128, closed loop "
           "c = 2048, 4,000 requests", _eb(1024, 128)),
    Preset("eb-distribution-shift", f"{EB} section 4.4, Table 3", "mu_L 1024 -> 512 -> 128 with mu_O "
           "128 -> 512 -> 1024 (jitter), 2,000 requests per phase, c = 2048", _eb_distribution_shift),
    Preset("eb-concurrency-shift", f"{EB} section 4.4, Table 3", "c = 32 -> 512 -> 1024 -> 256 -> 2048; "
           "jitter:512 / jitter:256 as Table 3's stationary rows; 2,000 requests per phase (assumed)",
           _eb_concurrency_shift),
    Preset("stability-pd-1-1", f"{STAB} section 5.1", "PD 1:1: prompt and output uniform on 10..1600; "
           "Poisson 5 req/s; 10,000 requests", lambda: WorkloadSpec((_pd("1-1"),), name="stability-pd-1-1")),
    Preset("stability-pd-2-1", f"{STAB} section 5.1", "PD 2:1: uniform 10..2133 / 10..1066; Poisson "
           "5 req/s; 10,000 requests", lambda: WorkloadSpec((_pd("2-1"),), name="stability-pd-2-1")),
    Preset("stability-pd-1-2", f"{STAB} section 5.1", "PD 1:2: uniform 10..1066 / 10..2133; Poisson "
           "5 req/s; 10,000 requests", lambda: WorkloadSpec((_pd("1-2"),), name="stability-pd-1-2")),
    Preset("stability-pd-8-1", f"{STAB} appendix C", "PD 8:1: uniform 10..2844 / 10..356 (assumed: the "
           "paper gives no bounds; these keep section 5.1's 3,200-token sum of upper bounds); Poisson "
           "5 req/s; 10,000 requests", lambda: WorkloadSpec((_pd("8-1"),), name="stability-pd-8-1")),
    Preset("stability-pd-switch", f"{STAB} section 5.2", "first half PD 2:1, second half PD 1:2; Poisson "
           "5 req/s; 5,000 + 5,000 requests",
           lambda: WorkloadSpec((_pd("2-1", 5000), _pd("1-2", 5000)), name="stability-pd-switch")),
    Preset("wait-low-demand", f"{FLUID} section 6.1 (i)", "m = 2 types: prompts 10/10, outputs 10/20, "
           "rates 1000/1000 req/s, output lengths known; 20,000 requests",
           lambda: _types((10, 10), (10, 20), (1000, 1000), 20_000, True, "wait-low-demand")),
    Preset("wait-high-demand", f"{FLUID} section 6.1 (ii)", "m = 3 types: prompts 20, outputs "
           "100/200/300, rates 6000/4000/2000 req/s, output lengths known; 24,000 requests",
           lambda: _types((20, 20, 20), (100, 200, 300), (6000, 4000, 2000), 24_000, True, "wait-high-demand")),
    Preset("nested-wait-4type", f"{FLUID} section 6.2", "m = 4 types: prompt 10, outputs 20/40/80/160, "
           "rates 20:40:80:160 (as req/s, assumed: the paper gives the ratio), output lengths unknown; "
           "6,000 requests", lambda: _types((10,) * 4, (20, 40, 80, 160), (20, 40, 80, 160), 6000, False,
                                            "nested-wait-4type")),
    Preset("nested-wait-10type", f"{FLUID} section 6.2", "10 clustered types: prompt 60, outputs "
           "50..500, rates 23:11:8:7:6:4:3:2:1:1 at 55 QPS in all, output lengths unknown; 5,500 requests",
           lambda: _types((60,) * 10, tuple(range(50, 501, 50)),
                          tuple(55 * w / 66 for w in (23, 11, 8, 7, 6, 4, 3, 2, 1, 1)), 5500, False,
                          "nested-wait-10type")),
    Preset("sharegpt", f"{SLAI} section 7 ({SHAREGPT_FILE})", "ShareGPT lengths (rows with replacement), "
           "total capped at 8,192, Poisson 1 req/s, 2,000 requests", _sharegpt),
    Preset("slai-paying-5", f"{SLAI} section 7, Fig. 7", _SLAI_TEXT.format(paying=5), _slai(0.05)),
    Preset("slai-paying-50", f"{SLAI} appendix F.3", _SLAI_TEXT.format(paying=50), _slai(0.5)),
    Preset("slai-paying-95", f"{SLAI} appendix F.3", _SLAI_TEXT.format(paying=95), _slai(0.95)),
]}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise KvschedError(f"unknown workload preset {name!r}; `kvsched workloads` lists them")
    return PRESETS[name]
