"""`kvsched plan` and `kvsched theory NAME`: the papers' closed forms from the command line.
JSON keys are the papers' quantities; their meaning is in each command's --help."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvsched.cli.common import HardwareOptions, JsonOpt, app, emit, guard, hardware_flags, workload_flags
from kvsched.errors import KvschedError

if TYPE_CHECKING:       # the engine and the closed forms are imported when a command runs (fast `kvsched --help`)
    from rich.table import Table
    from kvsched.theory.fluid import FluidType
    from kvsched.workload.source import WorkloadOptions

theory_app = typer.Typer(no_args_is_help=True, help="The papers' closed forms, one command each (--json for scripts).")
app.add_typer(theory_app, name="theory")

ChunkOpt = typer.Option(512, "--chunk-size", help="prefill chunk s_hat, tokens (stability-capacity.txt)")


def _emit(values: dict, as_json: bool, title: str) -> None:
    emit(values, as_json, lambda: _quantities(values, title))


def _quantities(values: dict, title: str) -> Table:
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k, v in values.items():
        t.add_row(k, _text(v))
    return t


def _text(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_text(x) for x in v)
    return str(v)


def _types(specs: list[str]) -> list[FluidType]:
    """--type RATE:PROMPT:OUTPUT, OUTPUT being the paper's l'_j (decode stages)."""
    from kvsched.theory.fluid import FluidType
    if not specs:
        raise KvschedError("give at least one --type RATE:PROMPT:OUTPUT")
    out = []
    for spec in specs:
        parts = spec.split(":")
        try:
            rate, prompt, decode = (float(p) for p in parts)
        except ValueError:
            raise KvschedError(f"--type {spec!r}: expected RATE:PROMPT:OUTPUT numbers") from None
        out.append(FluidType(rate, prompt, decode))
    return out


def _ints(text: Optional[str], flag: str) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise KvschedError(f"{flag} expects comma-separated numbers, got {text!r}") from None


TypeOpt = typer.Option([], "--type", help="request type RATE:PROMPT:OUTPUT (repeatable): rate lambda_j req/s, prompt l_j, decode stages l'_j (a request with o output tokens has l' = o - 1)")
D0 = typer.Option(..., "--d0", help="fixed seconds per batch (fluid-wait-nested-wait.txt eq. 1)")
D1 = typer.Option(..., "--d1", help="seconds per token held (eq. 1)")


@app.command("plan")
@workload_flags
@hardware_flags
def plan_cmd(wopts: WorkloadOptions, hw: HardwareOptions,
             batch_time: Optional[float] = typer.Option(None, "--batch-time", help="b, seconds per batch (default: measured on a saturated simulated replica)"),
             batch_time_estimator: str = typer.Option("median", "--batch-time-estimator", help="median, mean, trim5 or trim10 of the saturated batch times"),
             chunk_size: int = ChunkOpt,
             utilization: float = typer.Option(0.9, "--utilization", help="target utilisation rho for the GPU count"),
             eps: float = typer.Option(0.01, "--eps", help="EB: allowed probability of exceeding KV memory (eq. 2)"),
             validate: bool = typer.Option(False, "--validate", help="also simulate one replica at rate / GPUs and say if it is stable"),
             json_: bool = JsonOpt) -> None:
    """Capacity plan: service rate mu = M / (b E[g]), stable region, GPUs needed at rho, fluid
    optimum, EB thresholds and the EB/MB crossover.

    JSON keys: mu (req/s per GPU, stability-capacity.txt eq. 1), delta (ess sup(s+o)/M),
    stable_rate (mu (1 - delta)), gpus_needed (ceil(lambda / (mu rho))), mean_lifetime_memory
    (E[g(s,o)]), batch_time (b), fluid.{M_star, iteration_time, throughput_star, stable}
    (fluid-wait-nested-wait.txt eqs. 6-8, at the per-GPU rate), eb.{theta0, delta_theta,
    n_star, k_star, crossover.favours} (exclusive-batching-eb.txt eqs. 3, 5, 6, 7)."""
    from kvsched.report.table import plan_report
    from kvsched.theory.plan import PlanInputs, plan
    from kvsched.workload.source import load

    def body() -> None:
        rate = wopts.rate
        wopts.rate, wopts.untimed_ok = None, True     # --rate is the planned arrival rate
        inp = PlanInputs(hw.scenario(load(wopts)), batch_time=batch_time,
                         batch_time_estimator=batch_time_estimator, chunk=chunk_size, rate=rate,
                         utilization=utilization, eps=eps, seed=wopts.seed)
        result = plan(inp, validate=validate)
        emit(result, json_, lambda: plan_report(result))
    guard(body)


@theory_app.command("stability")
@workload_flags
def stability_cmd(wopts: WorkloadOptions,
                  kv_capacity: float = typer.Option(..., "--kv-capacity", help="M, KV capacity in tokens"),
                  batch_time: list[float] = typer.Option(..., "--batch-time", help="b seconds; one per phase for a multi-phase workload"),
                  chunk_size: int = ChunkOpt,
                  joint_table: Optional[Path] = typer.Option(None, "--joint-table", help="CSV prompt_tokens,output_tokens,probability|count instead of a workload"),
                  json_: bool = JsonOpt) -> None:
    """mu = M / (b E[g(s,o)]) (eq. 1), delta = ess sup(s+o) / M, stable_rate = mu (1 - delta)
    (Theorem 4.2), mean_lifetime_memory = E[g]; exact for finite-support distributions
    (fixed, uniform, empirical) and joint tables, else over the workload's requests. For
    several phases also mu_mix = (sum_l q_l / mu_l)^-1 (section 5.2), q_l the phases'
    shares of requests, and phase_mu."""
    from kvsched.theory import stability
    from kvsched.workload.source import resolve

    def body() -> None:
        stability.check_chunk(chunk_size)
        if joint_table is not None:
            s, o, w = stability.load_joint_table(joint_table)
            _emit({**stability.analyse(s, o, kv_capacity, batch_time[0], chunk_size, w).as_dict(), "exact": True},
                  json_, f"stability of {joint_table}")
            return
        wopts.untimed_ok = True
        spec = resolve(wopts)
        w = spec.build()
        out = stability.analyse_workload(spec, w, kv_capacity, batch_time, chunk_size)
        _emit(out, json_, f"stability of {w.source}")
    guard(body)


@theory_app.command("fluid")
def fluid_cmd(types: list[str] = TypeOpt, d0: float = D0, d1: float = D1,
              kv_capacity: Optional[float] = typer.Option(None, "--kv-capacity", help="C, KV capacity in tokens: also say whether M* fits"),
              json_: bool = JsonOpt) -> None:
    """The fluid equilibrium (fluid-wait-nested-wait.txt section 3): M_star (eq. 6),
    iteration_time (eq. 7), throughput_star tokens/s (eq. 8), stable (Proposition 1),
    n_star (requests of each type per batch), load (sum lambda (l'+1)(l + l'/2)). With
    --kv-capacity C: fits (M_star <= C) and max_load = C / (d0 + d1 C), the largest load
    whose M* fits in C (M* <= C <=> load <= C / (d0 + d1 C): d0 matters, not only d1)."""
    from kvsched.theory import fluid

    def body() -> None:
        out = fluid.summary(_types(types), d0, d1)
        if kv_capacity is not None:
            out.update(fluid.capacity_fit(_types(types), d0, d1, kv_capacity))
        _emit(out, json_, "fluid equilibrium")
    guard(body)


@theory_app.command("wait-thresholds")
def wait_cmd(types: list[str] = TypeOpt, d0: float = D0, d1: float = D1,
             thresholds: Optional[str] = typer.Option(None, "--thresholds", help="n_1,...,n_m to check (default: solve)"),
             batch_size: Optional[int] = typer.Option(None, "--batch-size", help="also the practical n_j = B rho_j / (l'_j + 1) (section 6.1)"),
             strict: bool = typer.Option(False, "--strict", help="require Delta T < n_j / lambda_j (O(1) latency)"),
             json_: bool = JsonOpt) -> None:
    """WAIT thresholds (fluid-wait-nested-wait.txt eq. 9): thresholds n_j, satisfied,
    iteration_time (Delta T = d0 + d1 M^pi), memory (M^pi), slack (n_j / lambda_j - Delta T)."""
    from kvsched.theory import wait

    def body() -> None:
        ts = _types(types)
        n = _ints(thresholds, "--thresholds") or wait.solve_wait(ts, d0, d1, strict)
        out = {"thresholds": n, **wait.check_wait(ts, n, d0, d1, strict)}
        if batch_size is not None:
            out["practical_thresholds"] = wait.practical_wait(ts, batch_size)
        _emit(out, json_, "WAIT thresholds")
    guard(body)


@theory_app.command("nested-wait-thresholds")
def nested_cmd(types: list[str] = TypeOpt, d0: float = D0, d1: float = D1,
               segments: Optional[int] = typer.Option(None, "--segments", help="merge the m types into L segments (section 7.2)"),
               thresholds: Optional[str] = typer.Option(None, "--thresholds", help="n_1,...,n_L to check (default: solve)"),
               batches: float = typer.Option(10_000, "--batches", help="S, batches in the horizon (eq. 12)"),
               delta: float = typer.Option(0.01, "--delta", help="overflow probability (eq. 12)"),
               json_: bool = JsonOpt) -> None:
    """Nested WAIT (eqs. 10, 14, 12/15, 16): thresholds, satisfied, iteration_time,
    memory (M^pi), p (p_i), theta (theta_j of eq. 16) and memory_bound (eq. 12)."""
    from kvsched.theory import wait

    def body() -> None:
        wait.check_horizon(batches, delta)      # before the work, used or not (one type has no eq. 12)
        ts = sorted(_types(types), key=lambda t: t.decode)
        if len({t.prompt for t in ts}) != 1:
            raise KvschedError("Nested WAIT assumes one prefill length for all types (section 5.1)")
        decodes, rates = [t.decode for t in ts], [t.rate for t in ts]
        if segments is not None:
            decodes, rates = wait.merge_types(decodes, rates, segments)
        prompt = ts[0].prompt
        n = _ints(thresholds, "--thresholds") or wait.solve_nested(prompt, decodes, rates, d0, d1)
        out = {"thresholds": n, "segment_ends": decodes, **wait.check_nested(prompt, decodes, rates, n, d0, d1)}
        if len(decodes) > 1 and out["satisfied"]:
            out.update(wait.memory_bound(prompt, decodes, rates, n, batches, delta))
        _emit(out, json_, "Nested WAIT thresholds")
    guard(body)


@theory_app.command("eb-threshold")
def eb_threshold_cmd(p0: float = typer.Option(..., "--p0", help="completion hazard p0 (1 / mean output under CFR)"),
                     alpha_p: float = typer.Option(..., "--alpha-p", help="prefill batch overhead, s"),
                     alpha_d: float = typer.Option(..., "--alpha-d", help="decode iteration overhead, s"),
                     eta: float = typer.Option(0.0, "--eta", help="IFR slope: h(t) = p0 + eta t"),
                     beta_d: float = typer.Option(0.0, "--beta-d", help="decode seconds per request"),
                     batch_size: float = typer.Option(1.0, "--batch-size", help="N, for the IFR correction"),
                     json_: bool = JsonOpt) -> None:
    """theta0 (eq. 3: theta0/(1-theta0) + ln(1-theta0) = p0 alpha_p / alpha_d), delta_theta
    (IFR correction, eq. 5), theta_star = theta0 + delta_theta, zeta = -ln(1 - theta0)."""
    from kvsched.theory import eb

    def body() -> None:
        eb.check_p0(p0)
        if not 0 <= eta < float("inf"):
            raise KvschedError(f"--eta must be a finite slope >= 0 (h(t) = p0 + eta t is a hazard), got {eta}")
        th = eb.theta0(p0, alpha_p, alpha_d)
        dth = eb.delta_theta(th, p0, eta, alpha_d, beta_d, batch_size)
        if not 0 < th + dth < 1:
            raise KvschedError(f"theta_star = {th + dth:.6g} is outside (0, 1): the first-order IFR correction "
                               f"(eq. 5) does not hold at eta {eta:g} (delta_theta {dth:.6g} against theta0 {th:.6g})")
        _emit({"theta0": th, "delta_theta": dth, "theta_star": th + dth, "zeta": eb.zeta(th)}, json_,
              "EB switching threshold")
    guard(body)


@theory_app.command("eb-batch-size")
def eb_batch_cmd(kv_capacity: float = typer.Option(..., "--kv-capacity", help="C, KV capacity in tokens"),
                 p0: float = typer.Option(..., "--p0"), mu_l: float = typer.Option(..., "--mu-l", help="mean prompt tokens"),
                 theta: float = typer.Option(..., "--theta", help="normalised threshold k / N"),
                 eps: float = typer.Option(0.01, "--eps", help="allowed overflow probability"),
                 json_: bool = JsonOpt) -> None:
    """n_star (eq. 6), n_expected and n_static (appendix D.5), v_bar = 1/(p0^2 mu_L)."""
    from kvsched.theory import eb

    def body() -> None:
        eb.check_p0(p0)
        _emit(eb.batch_sizes(kv_capacity, p0, mu_l, theta, eps), json_, "EB memory-safe batch size")
    guard(body)


@theory_app.command("eb-crossover")
def eb_crossover_cmd(batch_size: float = typer.Option(..., "--batch-size", help="N"),
                     p0: float = typer.Option(..., "--p0"), alpha_p: float = typer.Option(..., "--alpha-p"),
                     alpha_d: float = typer.Option(..., "--alpha-d"), beta_p: float = typer.Option(..., "--beta-p"),
                     beta_d: float = typer.Option(..., "--beta-d"), alpha_mb: float = typer.Option(..., "--alpha-mb"),
                     beta_mb: float = typer.Option(..., "--beta-mb", help="beta_MB^e at the workload's decode share"),
                     mu_l: float = typer.Option(..., "--mu-l"), mu_o: float = typer.Option(..., "--mu-o"),
                     json_: bool = JsonOpt) -> None:
    """Eq. (7): lhs = beta_MB^e - beta_EB^w, rhs, favours (MB if lhs < rhs), k0_star,
    throughput_eb (eq. 4) and throughput_mb (section 3.5), requests/s."""
    from kvsched.theory import eb
    from kvsched.theory.checks import nonnegative

    def body() -> None:
        eb.check_p0(p0)
        nonnegative(beta_p=beta_p, beta_d=beta_d, alpha_mb=alpha_mb, beta_mb=beta_mb)   # seconds: costs
        th = eb.theta0(p0, alpha_p, alpha_d)
        _emit({"theta0": th, **eb.crossover(batch_size, th, alpha_p, alpha_d, beta_p, beta_d, alpha_mb,
                                            beta_mb, mu_l, mu_o)}, json_, "EB / MB crossover")
    guard(body)


@theory_app.command("hazard-fit")
@workload_flags
def hazard_cmd(wopts: WorkloadOptions, json_: bool = JsonOpt) -> None:
    """Fit h(t) = p0 + eta t to the workload's output lengths over [1, t95] (section 3.4):
    p0, eta, t95, points."""
    from kvsched.theory import eb
    from kvsched.workload.source import load

    def body() -> None:
        wopts.untimed_ok = True
        w = load(wopts)
        _emit({**eb.hazard_fit(w.output), "mean_output": float(w.output.mean()),
               "cfr_p0": 1 / float(w.output.mean())}, json_, f"hazard fit of {w.source}")
    guard(body)


@theory_app.command("rad-capacity")
@workload_flags
def rad_capacity_cmd(wopts: WorkloadOptions,
                     model: str = typer.Option("mistral-7b", "--model", help="model from the catalogue (N layers, d)"),
                     gpu: str = typer.Option("rtx-6000-ada", "--gpu", help="GPU from the catalogue"),
                     cost: str = typer.Option("tiled-mistral-7b-rtx-6000-ada", "--cost", help="a tiled batch-time model: tiled or a tiled preset"),
                     cost_set: list[str] = typer.Option([], "--cost-set", help="cost model parameter key=value (repeatable)"),
                     replicas: int = typer.Option(1, "--replicas", help="r, identical nodes"),
                     eps: float = typer.Option(0.1, "--eps", help="Theorem 2's load margin: lambda T_R <= r (1 - eps)"),
                     json_: bool = JsonOpt) -> None:
    """rad-slai.txt Theorems 1 and 2 over the workload's lengths (L^D = o - 1 for o output
    tokens). JSON keys: T_R (seconds of optimally tiled work per request), capacity (r / T_R,
    req/s: no scheduler is stable above it, RAD below it), T_P and T_D (its prefill and decode
    parts, derived), T_max (eq. 14), cycle_n (Theorem 2: the smallest n with n > (t_col - 1)
    T_max / (eps T_R)), t_lcm, t_col; with --replicas >= 2 also split_capacity per static split
    (min(r_p / T_P, r_d / T_D), derived) and best_split. The theorems use eq. (7) alone: a
    preset's weight_floor and overhead are left out (reported as *_left_out_s), so a simulated
    replica with them runs below this capacity."""
    from kvsched.cost import make_cost_model
    from kvsched.cost.tiled import TiledCost
    from kvsched.hardware import get_gpu, get_model
    from kvsched.limits import MAX_REPLICAS, check_count
    from kvsched.params import parse_assignments
    from kvsched.theory import rad
    from kvsched.workload.source import load

    def body() -> None:
        check_count("--replicas", replicas, MAX_REPLICAS)     # the static splits are linear in r
        cm = make_cost_model(cost, parse_assignments(cost_set, "--cost-set"), get_model(model), get_gpu(gpu))
        if not isinstance(cm, TiledCost):
            raise KvschedError(f"--cost {cost}: rad-capacity needs a tiled batch-time model (tiled or a tiled preset)")
        wopts.untimed_ok = True
        w = load(wopts)
        left_out = {"weight_floor_left_out_s": cm.weight_floor, "overhead_left_out_s": cm.overhead}
        cm = dataclasses.replace(cm, weight_floor=0.0, overhead=0.0)      # Theorem 1 is eq. (7) alone
        _emit({**rad.analyse(cm, w.prompt, w.output, replicas, eps), **left_out}, json_, f"RAD capacity of {w.source}")
    guard(body)
