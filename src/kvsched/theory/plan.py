"""Capacity planning (`kvsched plan`): the papers' closed forms applied to one workload on one
model and GPU, with the batch time b measured by simulation when not given, and an optional
simulation of the planned deployment."""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsched.cost.fit import coefficients
from kvsched.errors import KvschedError
from kvsched.run import Scenario, simulate
from kvsched.theory import eb, fluid, stability
from kvsched.workload.arrivals import Poisson, Replay
from kvsched.workload.request import Workload
from kvsched.workload.stats import arrival_summary

SATURATION_REQUESTS = 2000


@dataclass
class PlanInputs:
    """A scenario (workload, model, GPU, KV, cost model) and the planning choices."""
    scenario: Scenario
    batch_time: float | None = None
    batch_time_estimator: str = "median"
    chunk: int = 512
    rate: float | None = None
    utilization: float = 0.9
    eps: float = 0.01
    seed: int = 0

    def with_workload(self, workload: Workload) -> Scenario:
        return dataclasses.replace(self.scenario, workload=workload)


def plan(inp: PlanInputs, validate: bool = False) -> dict[str, Any]:
    sc = inp.scenario
    w = sc.workload
    model, gpu, kv_tokens, cost = sc.resolve()
    rate = _arrival_rate(w, inp.rate)
    st, b_source, s, o = service_rate(inp)
    gpus = stability.gpus_needed(rate, st.mu, inp.utilization)
    mu_l, mu_o = float(s.mean()), float(o.mean())
    coef = coefficients(cost, mu_l, mu_o)
    out: dict[str, Any] = {
        "workload": w.source, "requests": int(len(s)), "model": model.name, "gpu": gpu.name,
        "kv_capacity": kv_tokens, "chunk_size": inp.chunk, "rate": rate, "utilization": inp.utilization,
        "batch_time": st.batch_time, "batch_time_source": b_source,
        **{k: v for k, v in st.as_dict().items() if k not in ("kv_capacity", "batch_time", "chunk_size")},
        "gpus_needed": gpus, "per_gpu_rate": rate / gpus, "per_gpu_load": rate / gpus / st.mu,
        "cost_coefficients": coef.as_dict(),
        "fluid": _fluid(s, o, rate / gpus, coef.d0, coef.d1, kv_tokens, st, sc.cost),
        "eb": _eb(o, mu_l, mu_o, coef, kv_tokens, inp.eps),
    }
    if validate:
        out["validation"] = validation(inp, rate / gpus, st.mu)
    out["next_step"] = NEXT_STEP
    return out


NEXT_STEP = ("mu ignores latency SLOs: `kvsched capacity` with the same workload and hardware flags, --rate and "
             "--chunk-size, plus --slo METRIC:STAT:MS, finds the largest rate per replica that meets them, and the "
             "replicas for --rate, by simulation")


def service_rate(inp: PlanInputs) -> tuple[stability.Stability, str, np.ndarray, np.ndarray]:
    """mu of one replica (stability-capacity.txt eq. 1) for the scenario's workload, with b as
    given or measured, and where b came from; also the servable (prompt, output) lengths."""
    sc = inp.scenario
    model, _, kv_tokens, _ = sc.resolve()
    if inp.chunk < 1:
        raise KvschedError(f"--chunk-size must be >= 1 token, got {inp.chunk}")
    s, o = _servable(sc.workload, kv_tokens, sc.max_model_len or model.max_len)
    b, b_source = _batch_time(inp, s, o)
    return stability.analyse(s, o, kv_tokens, b, inp.chunk), b_source, s, o


def _servable(w: Workload, kv_tokens: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths of the requests a replica can serve; the others are named in a warning."""
    ok = (w.prompt + w.output <= max_len) & (w.prompt + w.output - 1 <= kv_tokens)
    if not ok.all():
        warnings.warn(f"{int((~ok).sum())} of {len(w)} requests exceed the model length {max_len} or the KV "
                      "capacity and are left out of the plan (a replica rejects them; --cap-len caps them)",
                      stacklevel=3)
    if not ok.any():
        raise KvschedError("no request of the workload fits the model and KV capacity")
    return w.prompt[ok], w.output[ok]


def _arrival_rate(w: Workload, rate: float | None) -> float:
    if rate is not None:
        if not rate > 0:
            raise KvschedError(f"--rate must be > 0 requests per second, got {rate}")
        return rate
    if w.closed_loop or not w.timed:
        raise KvschedError("the workload has no arrival rate (closed loop or lengths only): give --rate")
    measured = arrival_summary(w.arrival)["mean_rate"]
    if not measured:
        raise KvschedError("the workload's requests all arrive at once: give --rate")
    return float(measured)


def _batch_time(inp: PlanInputs, s: np.ndarray, o: np.ndarray) -> tuple[float, str]:
    """b as given, or the paper's estimate (stability-capacity.txt section 5.1): batch times of
    a saturated replica (vllm-v1, chunk s_hat) on requests drawn from the workload, while
    requests still wait."""
    if inp.batch_time is not None:
        if not (math.isfinite(inp.batch_time) and inp.batch_time > 0):
            raise KvschedError(f"--batch-time must be > 0 seconds, got {inp.batch_time}")
        return inp.batch_time, "given"
    rng = np.random.default_rng(inp.seed)
    idx = rng.integers(0, len(s), size=min(SATURATION_REQUESTS, max(len(s), 200)))
    w = Workload.build(np.zeros(len(idx)), s[idx], o[idx], source="saturation")
    r = simulate(inp.with_workload(w), "vllm-v1", {"long_prefill_token_threshold": inp.chunk},
                 record_timeline=True, record_batches=True)
    waiting = np.array([row[1] for row in r.timeline]) > 0
    times = np.array([row[1] for row in r.batches])[waiting]
    if len(times) < 10:
        times = np.array([row[1] for row in r.batches])
    b = stability.estimate_batch_time(times, inp.batch_time_estimator)
    return b, (f"{inp.batch_time_estimator} of {len(times)} saturated vllm-v1 batches "
               f"(chunk {inp.chunk}, {len(idx)} requests, {inp.scenario.cost} cost)")


def _fluid(s: np.ndarray, o: np.ndarray, rate: float, d0: float, d1: float, kv_tokens: int,
           st: stability.Stability, cost: str) -> dict[str, Any]:
    """The fluid benchmark at one GPU's rate, with the workload's (s, o) pairs as types (a
    request with o output tokens has l' = o - 1 decode stages).

    Its batch time is another model than mu's b: the linear d0 + d1 x (tokens held)
    (fluid-wait-nested-wait.txt eq. 1) fitted to the cost model, at the planned load, with no
    memory limit; b is the batch time of a saturated replica. To reconcile the two, the
    section also gives the fluid model at mu (iteration_time_at_mu, against b) and its own
    largest stable rate, max_rate = rate / (d1 A) (the load d1 A is linear in the rate and
    must stay below 1, eq. 6 and Proposition 1), which bounds compute where mu bounds memory."""
    pairs, counts = np.unique(np.column_stack([s, o]), axis=0, return_counts=True)

    def types(r: float) -> list:
        return [fluid.FluidType(r * (int(c) / len(s)), float(p), float(q - 1)) for (p, q), c in zip(pairs, counts)]
    if d0 <= 0:
        return {"note": "the cost model has no fixed batch overhead d0; the fluid model needs d0 > 0"}
    out = fluid.summary(types(rate), d0, d1)
    out.pop("n_star")
    at_mu = fluid.summary(types(st.mu), d0, d1)
    out.update({
        "d0": d0, "d1": d1, "fits_memory": bool(out["stable"] and out["M_star"] <= kv_tokens),
        "batch_time_model": f"linear d0 + d1 x tokens held, fitted to the {cost} cost model (eq. 1), no memory "
                            "limit; mu's b is a saturated replica's batch time",
        "max_rate": rate / (d1 * out["load"]) if d1 > 0 and out["load"] > 0 else math.inf,
        "iteration_time_at_mu": at_mu["iteration_time"], "M_star_at_mu": at_mu["M_star"],
        "batch_time_b": st.batch_time, "mu": st.mu,
    })
    return out


def _eb(o: np.ndarray, mu_l: float, mu_o: float, coef, kv_tokens: int, eps: float) -> dict[str, Any]:
    """EB thresholds (exclusive-batching-eb.txt sections 3.2-3.5) from the workload's outputs."""
    fit = eb.hazard_fit(o)
    p0, eta, note = fit["p0"], fit["eta"], ""
    if not p0 > 0:
        p0, eta, note = 1.0 / mu_o, 0.0, "hazard fit gave p0 <= 0; CFR p0 = 1 / mu_O used"
    if coef.alpha_d <= 0 or coef.alpha_p <= 0:
        return {"p0": p0, "eta": eta, "note": "the cost model has no prefill/decode overhead: EB thresholds undefined"}
    th0 = eb.theta0(p0, coef.alpha_p, coef.alpha_d)
    n0 = eb.batch_sizes(kv_tokens, p0, mu_l, th0, eps)["n_star"]
    dth = eb.delta_theta(th0, p0, max(eta, 0.0), coef.alpha_d, coef.beta_d, max(n0, 1)) if eta > 0 else 0.0
    th = min(th0 + dth, 0.99)
    sizes = eb.batch_sizes(kv_tokens, p0, mu_l, th, eps)
    out = {"p0": p0, "eta": eta, "theta0": th0, "delta_theta": dth, "theta_star": th, **sizes,
           "k_star": math.floor(th * sizes["n_star"]), "eps": eps}
    if note:
        out["note"] = note
    if sizes["n_star"] >= 1 and math.floor(th0 * sizes["n_star"]) >= 1:
        out["crossover"] = eb.crossover(sizes["n_star"], th0, coef.alpha_p, coef.alpha_d, coef.beta_p,
                                        coef.beta_d, coef.alpha_mb, coef.beta_mb, mu_l, mu_o)
    return out


def validation(inp: PlanInputs, per_gpu_rate: float, mu: float) -> dict[str, Any]:
    """Simulate one replica at its share of the traffic (round-robin across identical
    replicas gives each the same law), the trace's own times rescaled or Poisson, and again
    at 1.05 mu, where it must be unstable (`above_mu`). `consistent`: stable at the plan's
    load and unstable above mu, as the theory says."""
    planned = _replica_verdict(inp, per_gpu_rate)
    above = _replica_verdict(inp, ABOVE_MU * mu)
    return {**planned, "above_mu": above, "consistent": bool(planned["stable"] and not above["stable"])}


ABOVE_MU = 1.05


def _replica_verdict(inp: PlanInputs, rate: float) -> dict[str, Any]:
    w = inp.scenario.workload
    times = Replay(rate=rate).apply(w.arrival, np.random.default_rng(inp.seed)) \
        if w.timed and not w.closed_loop and len(w) > 1 and w.arrival[-1] > w.arrival[0] else \
        Poisson(rate).times(np.random.default_rng(inp.seed), len(w))
    replica = dataclasses.replace(w, arrival=np.asarray(times) - np.min(times),
                                  concurrency=np.zeros(len(w), np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # rejections were reported by the plan already
        r = simulate(inp.with_workload(replica), "vllm-v1", {"long_prefill_token_threshold": inp.chunk},
                     record_timeline=True)
    return {"arrival_rate": rate, **queue_verdict(r)}


def queue_verdict(r) -> dict[str, Any]:
    """Stable when neither the waiting queue nor the time in system trends up over the run:
    compared between the second and the last quarter of the arrival window (the first
    quarter is warm-up),
    - the mean waiting queue (summed over the replicas of a cluster) may grow by at most 1%
      of the requests, and
    - the mean end-to-end latency of the requests arriving in them may grow by at most 10%
      plus three standard errors of the difference.
    Above capacity both grow linearly with time; counting completions instead would need the
    run to be long against the latency (the first requests finish a latency late).

    `judged`: a trend was found, or the arrival window is at least `JUDGE_WINDOW` mean
    latencies (of the second quarter's requests) long. A shorter run ends before a queue can
    build up, so an overloaded run can look stable (a few hundred long requests at 1.5 mu
    do); "stable" is then given but not to be trusted, and `kvsched capacity` falls back on
    mu. An upward trend is evidence of overload however short the run."""
    tl = np.asarray(list(r.timeline), dtype=np.float64)
    rec = r.records
    n, end = len(rec.arrival), float(np.max(rec.arrival))
    q2, q4 = _mean_queue(tl, 0.25 * end, 0.5 * end), _mean_queue(tl, 0.75 * end, 1.0001 * end)

    def e2el(a: float, b_: float) -> np.ndarray:
        m = (rec.arrival >= a * end) & (rec.arrival < b_ * end) & np.isfinite(rec.finished)
        return (rec.finished - rec.arrival)[m]
    e2, e4 = e2el(0.25, 0.5), e2el(0.75, 1.0001)
    if len(e2) > 1 and len(e4) > 1:
        se = math.sqrt(e2.var(ddof=1) / len(e2) + e4.var(ddof=1) / len(e4))
        e2m, e4m = float(e2.mean()), float(e4.mean())
        latency_ok = e4m <= 1.1 * e2m + 3 * se
    else:
        e2m = e4m = math.nan
        latency_ok = True
    stable = latency_ok and q4 <= q2 + 0.01 * n
    return {"offered_rate": (n - 1) / end if end > 0 else math.nan, "mean_e2el_q2": e2m, "mean_e2el_q4": e4m,
            "mean_queue_q2": q2, "mean_queue_q4": q4, "peak_queue": int(r.summary["peak_queue_length"]),
            "completed": r.summary["completed"], "rejected": r.summary["rejected"], "stable": bool(stable),
            "judged": bool(not stable or (math.isfinite(e2m) and end >= JUDGE_WINDOW * e2m))}


JUDGE_WINDOW = 4.0      # arrival window / mean latency below which a run is too short to judge


def _mean_queue(tl: np.ndarray, a: float, b: float) -> float:
    """Mean waiting queue over batches starting in [a, b): per replica (a cluster's timeline
    has the replica last), summed over replicas."""
    m = (tl[:, 0] >= a) & (tl[:, 0] < b)
    if not m.any():
        return 0.0
    if tl.shape[1] <= 4:
        return float(tl[m, 1].mean())
    rep = tl[m, 4]
    return float(sum(tl[m, 1][rep == k].mean() for k in np.unique(rep)))
