"""The cluster's control plane in the loop (docs/control-plane.md): autoscaling with cold
starts and drains (sim/autoscale.py), admission control, shedding and abandonment by tier
(sim/admission.py), LoRA adapter residency (sim/lora.py) and several base models, each served
by its own pools. It sits between an arrival and the router: `Cluster._arrive` hands every
arrival here, and its own timed work (scaler ticks, cold starts ending, clients giving up,
slots and replicas freed) runs as the cluster loop's CONTROL events, in time order with the
rest. Replicas are built up front (a pool's COUNT is the most it may run); those not up are
invisible to the router.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from kvsched.cost.shape import BatchShape
from kvsched.errors import KvschedError
from kvsched.sim.admission import ABANDONED, SHED, Admission
from kvsched.sim.autoscale import DRAINING, OFF, STARTING, UP, AutoscaleConfig, Fleet, PoolSignals
from kvsched.sim.cluster import CONTROL as CONTROL_EVENT
from kvsched.sim.lora import LoraConfig, LoraCost, Residency
from kvsched.sim.requests import INF, REJECTED, WAITING

PREFILL_PROBE = 2048        # tokens of the chunk that measures a replica's prefill rate (shedding)


class ControlPlane:
    """`pools`: (name, model, replica indices) of each pool; `cold_s` each pool's cold start."""

    def __init__(self, cluster, pools: list[tuple[str, str, list[int]]], *, autoscale: AutoscaleConfig | None = None,
                 scaler=None, cold_s: list[float] | None = None, admission: Admission | None = None,
                 lora: LoraConfig | None = None, adapter_bytes: list[float] | None = None, gpus=None,
                 layouts=None) -> None:
        self.cluster = c = cluster
        self.reqs = c.reqs
        w = c.reqs.workload
        self.names = [p[0] for p in pools]
        self.pool_of = [0] * len(c.replicas)
        for k, (_, _, members) in enumerate(pools):
            for r in members:
                self.pool_of[r] = k
        self.autoscale, self.scaler = autoscale, scaler
        initial = [len(m) for _, _, m in pools]
        if autoscale is not None:
            first = autoscale.initial if autoscale.initial is not None else autoscale.min
            initial = [first] * len(pools)
            for name, _, m in pools:
                for key in ("min", "initial"):
                    v = getattr(autoscale, key)
                    if v is not None and v > len(m):
                        raise KvschedError(f"--autoscale-set {key}={v} is above pool {name}'s {len(m)} replicas "
                                           "(a pool's COUNT, or --replicas, is the most the scaler may run)")
        self.fleet = Fleet.of([m for _, _, m in pools], initial)
        self.cold_s = cold_s or [0.0] * len(pools)
        self._gen = [0] * len(c.replicas)
        self._up: list[list[int]] = []
        self._eligible = self._pools_of_models(w, pools)
        self._candidates: list[list] = []      # per model: the replicas up that serve it (`_refresh`)
        self._model = w.model_index.tolist()
        self._refresh()
        self.admission = admission if admission is not None and admission.active else None
        self.tiers = len(w.tiers)
        self.dropped = np.zeros(len(w), np.uint8)
        self.lora = lora
        self.adapter = w.adapter.tolist()
        self.residency = [Residency(lora.max_loras) for _ in c.replicas] if lora else None
        self.lora_counts = [[0, 0] for _ in c.replicas]
        self.lora_waits = 0                 # requests that waited for an adapter slot
        self.load_s = [b / (lora.load_gbps * 1e9) for b in adapter_bytes] if lora else None
        if lora:
            for rep in c.replicas:
                k = rep.index
                rep.cost = LoraCost(rep.cost, self.residency[k], self.lora_counts[k], adapter_bytes[k], gpus[k],
                                    layouts[k])
                reset_clocks(rep)
        self._prefill_rate = [prefill_rate(r) for r in c.replicas] if self.admission else None
        self._window: list[deque] = [deque() for _ in pools]       # (arrival t, request) routed to each pool
        self.decisions = 0
        for rep in c.replicas:
            rep._on_done = self._chain(rep._on_done, rep.index)
            rep.track_start = True              # `summary_at` during a batch: the signals and shedding read it

    # ----- set-up -------------------------------------------------------------------------------
    def _pools_of_models(self, w, pools) -> list[list[int]]:
        """The pools serving each of the workload's models (the last entry: requests with none)."""
        out = []
        for name in (*w.models, None):
            mine = [k for k, (_, model, _) in enumerate(pools) if name is None or model == name]
            if not mine:
                raise KvschedError(f"--model-mix names model {name}, which no --pool serves (pools: "
                                   + ", ".join(f"{n}={m}" for n, m, _ in pools) + ")")
            out.append(mine)
        return out

    def _chain(self, before, r: int):
        def done(i: int, t: float) -> None:
            self.cluster._push(t, CONTROL_EVENT, self._left, i, r)
            if before is not None:
                before(i, t)
        return done

    def start(self) -> None:
        """The first scaler tick (the loop calls this before it runs)."""
        if self.scaler is not None:
            self.cluster._push(self.autoscale.interval_s, CONTROL_EVENT, self._tick)

    # ----- arrivals -----------------------------------------------------------------------------
    def arrive(self, i: int, t: float) -> None:
        c, reqs = self.cluster, self.reqs
        tier = self._tier(i)
        adm = self.admission
        m = self._model[i]
        if adm is not None and not adm.admit(tier, t):
            pools = self._eligible[m]               # offered to the model's pools: demand the scalers see
            for k in pools:
                self._window[k].append((t, i, 1 / len(pools)))
            self._drop(i, t, SHED)
            return
        candidates = self._candidates[m]
        k = c._route(c.router, candidates, i, t, self._lora_states(candidates, i))
        rep = candidates[k]
        self._window[self.pool_of[rep.index]].append((t, i, 1.0))
        if adm is not None and adm.sheds(tier) and adm.breaks_slo(
                tier, self._predicted_ttft(rep, i, t), rep.summary_at(t)[1] / rep.kv_capacity_blocks):
            adm.undo(tier)
            self._drop(i, t, SHED)
            return
        reqs.replica[i] = rep.index
        if adm is not None and adm.patience[tier] is not None:
            c._push(t + adm.patience[tier], CONTROL_EVENT, self._give_up, i)
        a = self.adapter[i]
        if self.residency is not None and a >= 0:
            res = self.residency[rep.index]
            loads = res.pin(a)
            if loads is None:                       # no slot: waits outside the scheduler
                res.waiting.append(i)
                self.lora_waits += 1
                reqs.status[i] = WAITING
                reqs.in_flight += 1
                rep.outstanding += 1                # the router sees it as outstanding there
                snapshot_add(rep, t, 1, 0)
                return
            self._count(rep.index, i, 1)
            if loads:                               # the GPU stalls while the adapter loads
                self._stall(rep, t)
        else:
            self._count(rep.index, i, 1)
        rep.accept(i, t)
        c._touch(rep)

    def _count(self, r: int, i: int, d: int) -> None:
        n = self.lora_counts[r]
        n[1] += d
        if self.adapter[i] >= 0:
            n[0] += d

    def _lora_states(self, candidates, i: int) -> list[int] | None:
        if self.residency is None:
            return None
        a = self.adapter[i]
        return [2 if a < 0 else self.residency[r.index].state(a) for r in candidates]

    def _predicted_ttft(self, rep, i: int, t: float) -> float:
        """The larger of the queue ahead over the replica's prefill rate (plus its current
        batch's rest) and the head-of-line delay (how long the request at the head of its queue
        has waited), plus the request's own prefill (sim/admission.py, `--shed`)."""
        rate = self._prefill_rate[rep.index]
        hol = t - self.reqs.arrival[rep._queue[0]] if rep._queue else 0.0
        ahead = max(max(0.0, rep.now - t) + rep.summary_at(t)[2] / rate, hol)
        return ahead + self.reqs.target[i] / rate

    # ----- requests leaving -----------------------------------------------------------------------
    def _stall(self, rep, t: float) -> None:
        """Replica `rep` loads an adapter from t (after its current batch): its clock moves on;
        routers see its state as of now meanwhile."""
        if rep.now <= t:
            rep._snap = (rep.outstanding, rep.kv.used, rep.prefill_backlog)
        rep.now = max(rep.now, t) + self.load_s[rep.index]

    def _tier(self, i: int) -> int:
        """Request i's tier index in the admission's arrays (len(tiers): none)."""
        k = self.reqs.tier[i]
        return k if k >= 0 else self.tiers

    def _drop(self, i: int, t: float, why: int) -> None:
        reqs = self.reqs
        reqs.status[i] = REJECTED
        reqs.remaining -= 1
        self.dropped[i] = why
        (self.admission.shed if why == SHED else self.admission.abandoned)[self._tier(i)] += 1

    def _give_up(self, t: float, i: int) -> None:
        """Request i's client gives up at t unless it has a first token or is admitted."""
        reqs = self.reqs
        if self.dropped[i] or reqs.status[i] != WAITING or reqs.first[i] < INF or reqs.computed[i]:
            return
        rep = self.cluster.replicas[int(reqs.replica[i])]
        res = self.residency[rep.index] if self.residency is not None else None
        if res is not None and i in res.waiting:
            res.waiting.remove(i)
        else:
            try:
                rep._queue.remove(i)
            except ValueError:
                return                              # not in the queue (a side state): served
            rep.prefill_backlog -= reqs.target[i]
            snapshot_add(rep, t, 0, -reqs.target[i])
            self._release(rep, i)
        rep.outstanding -= 1
        snapshot_add(rep, t, -1, 0)
        reqs.in_flight -= 1
        self.admission.in_cluster[self._tier(i)] -= 1
        self._drop(i, t, ABANDONED)
        self._after_leaving(rep, t)

    def _left(self, t: float, i: int, r: int) -> None:
        """Request i finished on replica r at t."""
        if self.admission is not None:
            self.admission.in_cluster[self._tier(i)] -= 1
        rep = self.cluster.replicas[r]
        self._release(rep, i)
        self._after_leaving(rep, t)

    def _release(self, rep, i: int) -> None:
        self._count(rep.index, i, -1)
        if self.residency is not None and self.adapter[i] >= 0:
            self.residency[rep.index].unpin(self.adapter[i])

    def _after_leaving(self, rep, t: float) -> None:
        """A request left `rep` at t: requests waiting for an adapter slot may go in now, and a
        draining replica may be empty."""
        res = self.residency[rep.index] if self.residency is not None else None
        if res is not None and res.waiting:
            for i in list(res.waiting):
                loads = res.pin(self.adapter[i])
                if loads is None:
                    continue                        # vLLM skips it and looks at the next
                res.waiting.remove(i)
                rep.outstanding -= 1                # accept counts it again
                snapshot_add(rep, t, -1, 0)
                self.reqs.in_flight -= 1
                self._count(rep.index, i, 1)
                if loads:
                    self._stall(rep, t)
                rep.accept(i, t)
            self.cluster._touch(rep)
        self._check_drained(rep.index, t)

    # ----- autoscaling -----------------------------------------------------------------------------
    def _refresh(self) -> None:
        """The replicas up, per pool and per model (what arrivals are routed among)."""
        self._up = [self.fleet.members(k, UP) for k in range(len(self.fleet.pools))]
        reps = self.cluster.replicas
        self._candidates = [[reps[r] for k in pools for r in self._up[k]] for pools in self._eligible]

    def _tick(self, t: float) -> None:
        sig = [self._signals(k, t) for k in range(len(self.fleet.pools))]
        want = self.scaler.decide(t, sig)
        if len(want) != len(sig):
            raise KvschedError(f"scaler {self.scaler.name} returned {len(want)} counts for {len(sig)} pools")
        for k, (s, n) in enumerate(zip(sig, want)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                raise KvschedError(f"scaler {self.scaler.name} returned {n!r} replicas for pool {s.name}")
            self._scale(k, min(max(int(n), s.min), s.max), t)
        self.decisions += 1
        if self.reqs.done < self.reqs.remaining:
            self.cluster._push(t + self.autoscale.interval_s, CONTROL_EVENT, self._tick)

    def _signals(self, k: int, t: float) -> PoolSignals:
        c, f, reqs = self.cluster, self.fleet, self.reqs
        win = self._window[k]
        w = self.autoscale.window_s
        while win and win[0][0] < t - w:
            win.popleft()
        each = []
        for r in self._up[k]:
            rep = c.replicas[r]
            out, used, _ = rep.summary_at(t)
            extra = len(self.residency[r].waiting) if self.residency is not None else 0
            each.append((r, len(rep._queue) + extra, out, used / rep.kv_capacity_blocks))
        waiting, outstanding, kv = sum(x[1] for x in each), sum(x[2] for x in each), sum(x[3] for x in each)
        ttfts = [min(reqs.first[i], t) - a for a, i, _ in win if not self.dropped[i]]
        p99 = float(np.percentile(ttfts, 99)) if ttfts else None
        out = reqs.output
        tpots = [(reqs.finished[i] - reqs.first[i]) / (out[i] - 1) for _, i, _ in win
                 if reqs.finished[i] <= t and out[i] > 1]
        offered = sum(x for _, _, x in win)
        return PoolSignals(self.names[k], len(self._up[k]), len(f.members(k, STARTING)), len(f.members(k, DRAINING)),
                           self.autoscale.min, len(f.pools[k]), waiting, outstanding, kv,
                           offered / min(w, t) if t > 0 else 0.0, p99, self.cold_s[k],
                           float(np.mean(tpots)) if tpots else None, tuple(each))

    def _scale(self, k: int, want: int, t: float) -> None:
        f = self.fleet
        starting, up = f.members(k, STARTING), self._up[k]
        cur = len(up) + len(starting)
        if want > cur:
            need = want - cur
            for r in f.members(k, DRAINING)[::-1][:need]:       # warm: back at once
                f.state[r] = UP
                need -= 1
            for r in f.members(k, OFF)[:need]:
                f.state[r], f.since[r] = STARTING, t
                self._gen[r] += 1
                self.cluster._push(t + self.cold_s[k], CONTROL_EVENT, self._ready, r, self._gen[r])
        elif want < cur:
            extra = cur - want
            for r in sorted(starting, key=lambda r: f.since[r], reverse=True)[:extra]:
                self._stop(r, t)
                extra -= 1
            c = self.cluster
            for r in sorted(up, key=lambda r: (c.replicas[r].summary_at(t)[0], -r))[:extra]:
                f.state[r] = DRAINING
                self._check_drained(r, t)
        else:
            return
        self._refresh()
        f.note(t)

    def _ready(self, t: float, r: int, gen: int) -> None:
        """Replica r's cold start ends at t: it takes traffic from now."""
        f = self.fleet
        if f.state[r] != STARTING or self._gen[r] != gen:
            return                                  # cancelled meanwhile
        f.state[r] = UP
        rep = self.cluster.replicas[r]
        if rep.now < t:
            rep.now = t
        self._refresh()
        f.note(t)

    def _check_drained(self, r: int, t: float) -> None:
        """A draining replica with nothing left is off at t; one whose last batch is still
        running (its requests counted out at the batch's start) is looked at again at its end."""
        f = self.fleet
        rep = self.cluster.replicas[r]
        waiting = len(self.residency[r].waiting) if self.residency is not None else 0
        if f.state[r] != DRAINING or rep.outstanding or rep.pulls or waiting or self.lora_counts[r][1]:
            return
        if rep.now > t:
            self.cluster._push(rep.now, CONTROL_EVENT, self._recheck, r)
            return
        self._stop(r, t)
        self._refresh()
        f.note(t)

    def _recheck(self, t: float, r: int) -> None:
        self._check_drained(r, t)

    def _stop(self, r: int, t: float) -> None:
        """Replica r gives its GPUs back at t: a later start is a cold one, its prefix cache and
        adapters gone."""
        self.fleet.stop(r, t)
        rep = self.cluster.replicas[r]
        if rep.cache is not None:
            rep.cache.clear()
        if self.residency is not None:
            self.residency[r].clear()

    # ----- the run's figures --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.admission is not None:
            names = [t.name for t in self.reqs.workload.tiers] + ["(none)"]
            adm = self.admission
            out["admission"] = [{"tier": names[k], "shed": adm.shed[k], "abandoned": adm.abandoned[k]}
                                for k in range(len(names)) if adm.shed[k] or adm.abandoned[k]
                                or k < len(names) - 1]
            out["shed"] = int(sum(adm.shed))
            out["abandoned"] = int(sum(adm.abandoned))
        if self.residency is not None:
            out["lora"] = {"max_loras": self.lora.max_loras, "rank": self.lora.rank,
                           "adapter_load_s": max(self.load_s), "adapter_loads": sum(r.loads for r in self.residency),
                           "adapters_waited": self.lora_waits}
        if self.scaler is not None:
            out["autoscale"] = {"scaler": self.scaler.name, "interval_s": self.autoscale.interval_s,
                                "cold_start_s": dict(zip(self.names, self.cold_s)),
                                "replicas_over_time": [[t, *ups] for t, ups in self.fleet.counts],
                                "pools": self.names, "decisions": self.decisions}
            rates = getattr(self.scaler, "rates", None) or getattr(self.scaler, "rate_per_replica", None)
            if rates:
                out["autoscale"]["rate_per_replica"] = rates if isinstance(rates, list) else [rates] * len(self.names)
        return out



def snapshot_add(rep, t: float, outstanding: int, backlog: int) -> None:
    """A change at t to what routers see of `rep` during its batch (`Replica.summary_at`)."""
    if t < rep.now:
        out, kv, pre = rep._snap
        rep._snap = (out + outstanding, kv, pre + backlog)


def reset_clocks(rep) -> None:
    """After its cost model is wrapped: the replica's cached decode clocks read the new one."""
    from kvsched.sim.decode_run import decode_clock
    rep._decode_time = decode_clock(rep.cost)
    rep._dense_time = None


def prefill_rate(rep) -> float:
    """Prompt tokens per second of one full chunk on `rep` (its batch-time model)."""
    n = int(getattr(rep.policy, "max_num_batched_tokens", 0) or PREFILL_PROBE)
    dt = float(rep.cost.time(BatchShape(n, 1, n * (n + 1) / 2, n, 0, 0, ((0, n),))))
    if not (dt > 0 and math.isfinite(dt)):
        raise KvschedError(f"--shed: the batch-time model gives {dt!r} s for a {n}-token prefill chunk")
    return n / dt
