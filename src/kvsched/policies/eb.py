"""Exclusive batching (exclusive-batching-eb.txt): EB(k), the adaptive EB(k*) controller and
the EB+ hybrid. Every closed form comes from `kvsched.theory.eb`.

Where the paper leaves a value open, defaults follow the authors' public vLLM patch; where
the paper and that patch differ, the default is the paper's and the patch's choice is an
option (the docstrings name both). One exception: EB+'s switch back to MB defaults to the
patch's hysteresis, because the issue asks for stable switching. EB(k*) also has a guard
of its own on implausible fits and an ill-conditioned eq. (6), in neither (see `EbAdaptive`):

| what                        | paper (default here)          | authors' patch (option)            |
|-----------------------------|-------------------------------|------------------------------------|
| hazard fit range            | [1, t95]                      | fit_lower_quantile=0.05 (5%-95%)   |
| eta < 0 from the fit        | used as fitted                | clamp_eta=true                     |
| p0                          | as fitted (1/mean if <= 0)    | floor_p0=true (p0 >= 1/mean)       |
| delta theta                 | uncapped                      | delta_theta_cap=5 (<= 5 theta0)    |
| theta update                | applied directly              | theta_ema=0.3                      |
| EB+ switch back to MB       | when eq. (8) fails (-1)       | mb_margin=3: the default here      |
| KV gate (appendix D.6)      | not in Algorithm 1: off       | kv_gate=true                       |
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvsched.cost.fit import coefficients
from kvsched.errors import KvschedError
from kvsched.policies.base import Plan, ServerView
from kvsched.policies.baselines import VllmV1, _check_limits, make_room
from kvsched.theory import eb as theory


@dataclass
class ExclusiveBatching:
    """EB(k) (section 3.1): N slots. A decode phase runs decode-only batches until k slots are
    idle; then a prefill phase refills the idle slots with prefill-only batches (chunked
    under the token budget) and decoding resumes. Optional KV-aware gate (appendix D.6,
    eq. 23): the switch to prefill waits until free KV >= f_KV x capacity, f_KV =
    clip(N mu_O s_KV / (block_size x total blocks) + f_0, 0.05, 0.6)."""
    max_num_seqs: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "N, the slots (max running requests)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"range": "[1, inf)", "help": "token budget of a prefill batch"})
    k: int = field(default=1, metadata={"range": "[1, inf)", "help": "idle slots that trigger a prefill phase"})
    theta: float = field(default=0.0, metadata={"range": "[0, 1]", "help": "if > 0: k = max(1, floor(theta N))"})
    kv_gate: bool = field(default=False, metadata={"help": "defer the prefill phase while free KV is short (D.6)"})
    gate_safety: float = field(default=0.5, metadata={"range": "(0, inf)", "help": "s_KV, multiplier on mu_O in the gate"})
    gate_base: float = field(default=0.0, metadata={"range": "[0, 1]", "help": "f_0, base reserve of the gate"})
    watermark: float = field(default=0.01, metadata={"range": "[0, 1)", "help": "fraction of KV blocks kept free at admission while requests decode (as vllm-v0)"})
    name = "eb"
    replica_local = True                    # reads only its own replica, shares nothing (base.py)

    def __post_init__(self) -> None:
        _check_limits(self.name, self.max_num_batched_tokens, self.max_num_seqs)
        if self.k < 1 or not 0 <= self.theta <= 1 or not 0 <= self.watermark < 1:
            raise ValueError("need k >= 1, 0 <= theta <= 1 and 0 <= watermark < 1")
        self._prefill = False
        self.gate_deferrals = 0

    # ----- limits (eb-adaptive overrides these) ----------------------------------------
    def slots(self, v: ServerView) -> int:
        return self.max_num_seqs

    def threshold(self, v: ServerView) -> int:
        n = self.slots(v)
        return max(1, math.floor(self.theta * n)) if self.theta > 0 else min(self.k, n)

    def mean_output(self, v: ServerView) -> float | None:
        done = v.recent_finished
        return sum(o for _, o in done) / len(done) if done else None

    # ----- the schedule ----------------------------------------------------------------
    def schedule(self, v: ServerView) -> Plan:
        if not self._prefill and self._refill_due(v):
            self._prefill = True
        if self._prefill:
            plan = self._prefill_step(v)
            if plan is not None:
                return plan
            self._prefill = False
        victims, _, nd = make_room(v)
        if nd == 0 and not victims and any(True for _ in v.prefilling):
            return self._unstick(v)
        return Plan([], [], nd > 0, victims)

    def _refill_due(self, v: ServerView) -> bool:
        pending = bool(v.waiting) or any(True for _ in v.prefilling)
        if not pending:
            return False
        if v.num_decoding == 0:
            return True
        idle = self.slots(v) - len(v.running)
        if idle < self.threshold(v):
            return False
        if self.kv_gate and not self._gate_open(v):
            self.gate_deferrals += 1
            return False
        return True

    def gate_fraction(self, v: ServerView) -> float | None:
        """f_KV of eq. (23), None before any request has finished (no mu_O yet)."""
        mu_o = self.mean_output(v)
        if mu_o is None:
            return None
        f = self.slots(v) * mu_o * self.gate_safety / (v.block_size * v.kv_capacity_blocks) + self.gate_base
        return min(0.6, max(0.05, f))

    def _gate_open(self, v: ServerView) -> bool:
        f = self.gate_fraction(v)
        return f is None or v.kv_free_blocks >= f * v.kv_capacity_blocks

    def _prefill_step(self, v: ServerView) -> Plan | None:
        """One prefill-only batch: ongoing chunked prefills first, then new requests into
        idle slots, FCFS, the last one chunked to the budget; None when nothing fits. A new
        request is admitted only when KV for its whole prompt is free beyond what ongoing
        prefills still need (and, while requests decode, beyond the watermark), as vLLM
        v0 admits, so a half-prefilled request is not preempted for lack of room."""
        budget, free = self.max_num_batched_tokens, v.kv_free_blocks
        chunks: list[tuple[int, int]] = []
        reserved = 0
        for i in v.prefilling:
            done, target = v.prefill_done(i), v.prefill_target(i)
            c = min(budget, target - done)
            need = v.blocks_for(done + c) - v.blocks_for(done)
            if c > 0 and need <= free:
                chunks.append((i, c))
                free -= need
                budget -= c
                done += c
            reserved += v.blocks_for(target) - v.blocks_for(done)
        admit: list[int] = []
        seats = self.slots(v) - len(v.running)
        keep = int(self.watermark * v.kv_capacity_blocks) if v.num_decoding else 0
        for i in v.waiting:
            if seats <= 0 or budget <= 0:
                break
            target = v.prefill_target(i)
            if free - reserved - v.blocks_for(target) < keep:
                break
            c = min(budget, target)
            admit.append(i)
            chunks.append((i, c))
            free -= v.blocks_for(c)
            reserved += v.blocks_for(target) - v.blocks_for(c)
            budget -= c
            seats -= 1
        return Plan(admit, chunks, False, []) if chunks else None

    def _unstick(self, v: ServerView) -> Plan:
        """No decoder left and no prefill chunk fits: preempt the newest prefilling requests
        until the oldest one's next chunk fits (recompute, as vLLM does)."""
        order = list(v.prefilling)
        first, free, victims = order[0], v.kv_free_blocks, []
        done = v.prefill_done(first)
        c = min(self.max_num_batched_tokens, v.prefill_target(first) - done)
        need = v.blocks_for(done + c) - v.blocks_for(done)
        for j in reversed(order[1:]):
            if need <= free:
                break
            victims.append(j)
            free += v.kv_blocks(j)
        if need > free:
            raise KvschedError(f"policy {self.name}: request {first} cannot continue its prefill "
                               f"({need} blocks needed, {free} free)")
        return Plan([], [(first, c)], False, victims)

    def on_finish(self, i: int, view: ServerView) -> None:
        """EB(k) keeps no per-request state."""


@dataclass
class EbAdaptive(ExclusiveBatching):
    """EB(k*) (section 3.4, Algorithm 1 of appendix D.7): every `update_every` completions
    once `min_samples` exist, fit h(t) = p0 + eta t to the last `window` output lengths,
    theta* = clip(theta0 (eq. 3) + Delta theta (eq. 5, at the previous N*), theta_min,
    theta_max), N* from eq. (6) at the KV capacity, k* = floor(theta* N*); the batch uses
    min(N*, max_num_seqs) slots (section 4.3). alpha/beta come from the server's cost model
    (`cost.fit.coefficients`: a phase model's own values, else lines fitted to its times on
    batches shaped like the window's mean lengths).

    Guard (not in the paper): an update never shrinks the server on a bad estimate. The
    windowed fit of geometric outputs with mean 1024 sometimes gives p0 of 1e-6 to 2e-4
    against the true 9.8e-4 (after a closed-loop start the window holds the short outputs
    that finished first); eq. (6)'s v = 1 / (p0^2 mu_L) then exceeded the KV and N* fell to 1
    (2,304 against 15,121 tokens/s). Three rules, each counted in `held_updates` or visible
    in `history`:
    - When the fit's implied mean output (`theory.eb.implied_mean_output`) is off the
      window's mean by more than a factor 2, or p0 < 1 / (2 mu_O) (a CFR prior: it also
      catches genuine IFR fits, whose eta still raises Delta theta), the CFR value 1/mu_O
      stands in for p0 in that update (as for p0 <= 0). `history` keeps the fitted p0 too.
    - Eq. (6) takes p0 no lower than 1/mu_O. Its v and memory per slot model slots freeing at
      the CFR rate p0; the window's mean gives that rate directly, while a fitted intercept
      below it (an IFR fit, or a length-biased window) assumes slots free more slowly than the
      observed mean shows. Under IFR a fresh slot's remaining decode is shorter than under CFR
      with the same mean, so this stays on the safe side.
    - When eq. (6) has no positive solution, or its safety term v ln(1/eps) takes more than
      half the KV (N* < N_static / 2, where a relative error e in p0 moves N* by more than
      2e), theta is updated and N* kept (the previous N*, or max_num_seqs before the first),
      capped at N_static, the slots that fit in KV on average.
    Keeping N* and theta unchanged on implausible fits, without the second rule, was tried:
    decode-heavy lost 5.4% to the best fixed theta (theta stayed at early, biased values).

    The KV gate of appendix D.6 is not part of Algorithm 1 and stays off by default
    (kv_gate=true turns it on, as the authors run it). Options for the authors' practice:
    see the module docstring."""
    eps: float = field(default=0.01, metadata={"range": "(0, 1)", "help": "allowed probability of exceeding KV (eq. 2)"})
    window: int = field(default=500, metadata={"range": "[2, inf)", "help": "completions in the estimation window"})
    update_every: int = field(default=100, metadata={"range": "[1, inf)", "help": "completions between updates"})
    min_samples: int = field(default=30, metadata={"range": "[2, inf)", "help": "completions before the first update"})
    theta_start: float = field(default=0.70, metadata={"range": "(0, 1)", "help": "theta before the first update"})
    theta_min: float = field(default=0.01, metadata={"range": "(0, 1)", "help": "lower clip of theta*"})
    theta_max: float = field(default=0.80, metadata={"range": "(0, 1)", "help": "upper clip of theta*"})
    theta_ema: float = field(default=1.0, metadata={"range": "(0, 1]", "help": "weight of a new theta* (1 = paper; practice 0.3)"})
    delta_theta_cap: float = field(default=0.0, metadata={"range": "[0, inf)", "help": "cap Delta theta at this x theta0 (0 = none; practice 5)"})
    clamp_eta: bool = field(default=False, metadata={"help": "eta = max(eta, 0) (practice)"})
    floor_p0: bool = field(default=False, metadata={"help": "p0 = max(p0, 1/mean output) (practice)"})
    fit_lower_quantile: float = field(default=0.0, metadata={"range": "[0, 1)", "help": "start of the fit range (0 = t=1; practice 0.05)"})
    name = "eb-adaptive"
    replica_local = True                    # reads only its own replica, shares nothing (base.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 < self.theta_min <= self.theta_max < 1) or not 0 < self.theta_ema <= 1:
            raise ValueError("need 0 < theta_min <= theta_max < 1 and 0 < theta_ema <= 1")
        if self.window < 2 or self.update_every < 1 or self.min_samples < 2:
            raise ValueError("need window >= 2, update_every >= 1, min_samples >= 2")
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.window)
        self._since = 0
        self.theta_now = self.theta_start
        self.n_star: int | None = None
        self.estimates: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.held_updates = {"mean_mismatch": 0, "cfr_prior": 0, "infeasible": 0}

    def slots(self, v: ServerView) -> int:
        return self.max_num_seqs if self.n_star is None else max(1, min(self.n_star, self.max_num_seqs))

    def threshold(self, v: ServerView) -> int:
        return max(1, math.floor(self.theta_now * self.slots(v)))

    def mean_output(self, v: ServerView) -> float | None:
        return self.estimates.get("mu_o") or super().mean_output(v)

    def on_finish(self, i: int, view: ServerView) -> None:
        self._recent.append((view.prompt_len(i), view.generated(i)))
        self._since += 1
        if self._since >= self.update_every and len(self._recent) >= self.min_samples:
            self._since = 0
            self.update(view)

    @staticmethod
    def implausible(e: dict[str, float]) -> str:
        """"mean_mismatch" when the fitted hazard's implied mean output is off the window's
        mean by more than a factor 2; "cfr_prior" when p0 is below half the CFR value 1/mu_O
        (a prior, not a test: a genuine IFR fit, e.g. gamma shape 2, has p0 near 0 and is
        caught too; its eta still raises Delta theta); "" otherwise."""
        implied = theory.implied_mean_output(e["p0"], e["eta"])
        if not 0.5 <= implied / e["mu_o"] <= 2:
            return "mean_mismatch"
        return "cfr_prior" if e["p0"] * e["mu_o"] < 0.5 else ""

    def estimate(self, view: ServerView, cost) -> dict[str, float]:
        """p0, eta, mu_L, mu_O from the window, and the cost model's coefficients."""
        lengths = np.array(self._recent, dtype=np.int64)
        mu_l, outs = float(lengths[:, 0].mean()), lengths[:, 1]
        mu_o = float(outs.mean())
        fit = theory.hazard_fit(outs, lower_quantile=self.fit_lower_quantile)
        p0, eta = fit["p0"], fit["eta"]
        if self.floor_p0 or p0 <= 0:            # p0 <= 0 has no theta0; CFR 1/mu_O stands in
            p0 = max(p0, 1.0 / mu_o)
        if self.clamp_eta:
            eta = max(eta, 0.0)
        c = coefficients(cost, mu_l, mu_o)
        return {"p0": p0, "eta": eta, "mu_l": mu_l, "mu_o": mu_o, "alpha_p": c.alpha_p, "alpha_d": c.alpha_d,
                "beta_p": c.beta_p, "beta_d": c.beta_d, "alpha_mb": c.alpha_mb, "beta_mb": c.beta_mb}

    def update(self, view: ServerView) -> None:
        """One step of Algorithm 1."""
        cost = view.cost_model      # outside the try: a missing batch-time model is an error, not a held update
        try:
            e = self.estimate(view, cost)
        except KvschedError:
            return                              # e.g. every output the same length: keep theta
        e["p0_fit"] = e["p0"]
        reason = self.implausible(e)
        if reason:                              # the CFR value stands in, as for p0 <= 0
            e["p0"] = 1.0 / e["mu_o"]
            self.held_updates[reason] += 1
        th0 = theory.theta0(e["p0"], e["alpha_p"], e["alpha_d"])
        n_prev = self.slots(view)
        dth = theory.delta_theta(th0, e["p0"], e["eta"], e["alpha_d"], e["beta_d"], n_prev)
        if self.delta_theta_cap > 0:
            dth = min(dth, self.delta_theta_cap * th0)
        target = min(self.theta_max, max(self.theta_min, th0 + dth))
        self.theta_now = self.theta_ema * target + (1 - self.theta_ema) * self.theta_now
        capacity = view.kv_capacity_blocks * view.block_size
        p0_memory = max(e["p0"], 1.0 / e["mu_o"])     # eq. (6) at no less than the CFR rate: see above
        sizes = theory.batch_sizes(capacity, p0_memory, e["mu_l"], self.theta_now, self.eps)
        if 2 * sizes["n_star"] >= sizes["n_static"] >= 1:
            self.n_star = sizes["n_star"]
        else:                   # eq. (6) infeasible or ill-conditioned: never shrink on it,
            self.held_updates["infeasible"] += 1    # but never hold more than fits on average
            if sizes["n_static"] >= 1:
                self.n_star = min(self.n_star or self.max_num_seqs, sizes["n_static"])
        self.estimates = {**e, "theta0": th0, "delta_theta": dth}
        self.history.append({"time": view.now, "theta0": th0, "delta_theta": dth, "theta": self.theta_now,
                             "n_star": self.n_star, "k": self.threshold(view), "p0": e["p0"],
                             "p0_fit": e["p0_fit"], "eta": e["eta"]})


def eb_plus_mode(mode: str, lhs: float, rhs: float, n_obs: float, delta: float, mb_margin: float,
                 min_occupancy: float) -> str:
    """The EB+ rule (section 3.5, eq. 8): EB when LHS > RHS + delta. From EB, back to MB when
    LHS < RHS - mb_margin x delta (mb_margin = -1 is eq. 8 as printed; the authors use 3 for
    hysteresis). No switch while N_obs < min_occupancy."""
    if n_obs < min_occupancy:
        return mode
    if mode == "MB":
        return "EB" if lhs > rhs + delta else "MB"
    return "MB" if lhs < rhs - mb_margin * delta else "EB"


@dataclass
class EbPlus(EbAdaptive):
    """EB+ (section 3.5): each batch is EB(k*) or mixed batching (vllm-v1 with the same N and
    budget), by the crossover rule eq. (8), re-evaluated every `evaluate_every` completions:
    EB when beta_MB^e(r) - beta_EB^w > [(alpha_p + alpha_d zeta mu_O) / theta0 - alpha_MB
    (1 + mu_O)] / (N_obs (mu_L + mu_O)) + delta, with r = mu_O / (mu_L + mu_O) and beta_MB^e,
    alpha from the cost model. N_obs is an EMA of running requests updated after every batch
    from max_num_seqs (weight ema_up when it rises, ema_down when it falls; `on_batch_end`).
    Hysteresis (mb_margin), a cooldown of
    evaluations after a switch and no switching below min_occupancy: the paper asks for
    stable switching without giving values; these defaults are the authors'. Starts in MB."""
    delta: float = field(default=1e-5, metadata={"range": "[0, inf)", "help": "priority margin of eq. (8), s/token"})
    evaluate_every: int = field(default=100, metadata={"range": "[1, inf)", "help": "completions between mode decisions"})
    ema_up: float = field(default=0.3, metadata={"range": "(0, 1]", "help": "N_obs EMA weight when occupancy rises"})
    ema_down: float = field(default=0.03, metadata={"range": "(0, 1]", "help": "N_obs EMA weight when occupancy falls"})
    mb_margin: float = field(default=3.0, metadata={"range": "(-inf, inf)", "help": "back to MB when LHS < RHS - mb_margin x delta (-1: eq. 8 as printed)"})
    cooldown: int = field(default=3, metadata={"range": "[0, inf)", "help": "evaluations without a switch after one"})
    min_occupancy: float = field(default=16.0, metadata={"range": "[0, inf)", "help": "no switching while N_obs is below this"})
    count_waiting: bool = field(default=False, metadata={"help": "N_obs also counts waiting requests"})
    name = "eb-plus"
    replica_local = True                    # reads only its own replica, shares nothing (base.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._mb = VllmV1(self.max_num_batched_tokens, self.max_num_seqs)
        self.mode = "MB"
        self.n_obs: float | None = None
        self._evals = 0
        self._cool = 0
        self.decisions: list[dict[str, float | str]] = []

    def schedule(self, v: ServerView) -> Plan:
        return super().schedule(v) if self.mode == "EB" else self._mb.schedule(v)

    def on_finish(self, i: int, view: ServerView) -> None:
        super().on_finish(i, view)
        self._evals += 1
        if self._evals >= self.evaluate_every:
            self._evals = 0
            self.evaluate(view)

    def crossover_sides(self, n_obs: float) -> tuple[float, float] | None:
        """(LHS, RHS) of eq. (8) from the current estimates; None before any estimate."""
        e = self.estimates
        if not e:
            return None
        beta_eb = (e["beta_p"] * e["mu_l"] + e["beta_d"] * e["mu_o"]) / (e["mu_l"] + e["mu_o"])
        rhs = ((e["alpha_p"] + e["alpha_d"] * theory.zeta(e["theta0"]) * e["mu_o"]) / e["theta0"]
               - e["alpha_mb"] * (1 + e["mu_o"])) / (n_obs * (e["mu_l"] + e["mu_o"]))
        return e["beta_mb"] - beta_eb, rhs

    def on_batch_end(self, v: ServerView) -> None:
        """N_obs: an EMA of the occupancy updated after every batch, starting at
        max_num_seqs (the authors' implementation): weight ema_up when it rises, ema_down
        when it falls. Occupancy counts running requests ("active batch occupancy"), plus
        waiting ones with count_waiting=true (counting the queue biases eq. 8 toward EB at
        saturation)."""
        occupancy = len(v.running) + (len(v.waiting) if self.count_waiting else 0)
        n = self.n_obs if self.n_obs is not None else float(self.max_num_seqs)
        w = self.ema_up if occupancy > n else self.ema_down
        self.n_obs = w * occupancy + (1 - w) * n

    def evaluate(self, v: ServerView) -> None:
        if self.n_obs is None:
            self.n_obs = float(self.max_num_seqs)
        sides = self.crossover_sides(max(self.n_obs, 1e-9))
        if sides is None:
            return
        lhs, rhs = sides
        cooling = self._cool > 0
        new = self.mode if cooling else eb_plus_mode(self.mode, lhs, rhs, self.n_obs, self.delta,
                                                     self.mb_margin, self.min_occupancy)
        self._cool = max(0, self._cool - 1)
        self.decisions.append({"time": v.now, "n_obs": self.n_obs, "lhs": lhs, "rhs": rhs, "mode": new,
                               "cooling": cooling})
        if new != self.mode:
            self.mode = new
            self._prefill = False
            self._cool = self.cooldown
