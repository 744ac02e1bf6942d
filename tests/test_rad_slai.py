"""RAD, SLAI, Sarathi's SPF order and DistServe (rad-slai.txt)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from conftest import run
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.policies.baselines import prefill_order
from kvsched.policies.slai import Slai
from kvsched.run import Scenario, simulate
from kvsched.workload import Request, Workload
from kvsched.workload.source import WorkloadOptions, load

TIERS = ["paying:0.3:tbt=0.1:priority=0", "free:0.7:tbt=0.5:priority=1"]


def tiered(n=300, rate=4.0, seed=3):
    return load(WorkloadOptions(num_requests=n, rate=rate, prompt_len="uniform:10:1500",
                                output_len="uniform:2:300", tiers=TIERS, seed=seed))


@dataclass
class View:
    """A hand-set ServerView: block size 1, so blocks are tokens."""
    now: float = 10.0
    waiting: list = field(default_factory=list)
    prefilling: list = field(default_factory=list)       # running, in their prefill
    decoding: list = field(default_factory=list)         # running, in their decode
    prompt: dict = field(default_factory=dict)
    done: dict = field(default_factory=dict)             # prefill tokens computed
    kv: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    slo: dict = field(default_factory=dict)
    prio: dict = field(default_factory=dict)
    grow: set = field(default_factory=set)               # decodes whose next token needs a block
    kv_capacity_blocks: int = 1000
    mean_batch_time: float | None = 0.02
    block_size: int = 1
    spec_method = None                                   # no speculative decoding (docs/speculative-decoding.md)

    @property
    def running(self):
        return self.prefilling + self.decoding

    @property
    def num_decoding(self):
        return len(self.decoding)

    @property
    def kv_used_blocks(self):
        return sum(self.kv.values())

    @property
    def kv_free_blocks(self):
        return self.kv_capacity_blocks - self.kv_used_blocks

    def blocks_for(self, t):
        return t

    def prefill_target(self, i):
        return self.prompt[i]

    def prefill_done(self, i):
        return self.done.get(i, 0)

    def kv_blocks(self, i):
        return self.kv.get(i, 0)

    def needs_block(self, i):
        return i in self.grow

    def is_decoding(self, i):
        return i in self.decoding

    def tbt_slo(self, i):
        return self.slo.get(i, math.inf)

    def tier_priority(self, i):
        return self.prio.get(i, 0)

    def last_token_time(self, i):
        return self.last.get(i)

    def arrival(self, i):
        return 0.0


def test_last_schedulable_time_eq8_frozen_and_dynamic():
    """C = e + TBT - delta t_bar (eq. 8): delta 5 below 96% KV use, 10 above; frozen once
    computed; requests without a tier SLO use 0.2 s."""
    v = View(decoding=[1, 2], kv={1: 100, 2: 100}, last={1: 9.9, 2: 9.95}, slo={1: 0.1})
    pol = Slai()
    pol.schedule(v)
    assert pol._lst[1] == (9.9, pytest.approx(9.9 + 0.1 - 5 * 0.02))
    assert pol._lst[2] == (9.95, pytest.approx(9.95 + 0.2 - 5 * 0.02))
    v.mean_batch_time, v.kv = 0.05, {1: 480, 2: 480}          # 96% used: delta 10, t_bar changed
    pol.schedule(v)
    assert pol._lst[1][1] == pytest.approx(9.9)                # frozen: same token, same C
    v.last[1] = 10.0                                           # a new token: recomputed
    pol.schedule(v)
    assert pol._lst[1][1] == pytest.approx(10.0 + 0.1 - 10 * 0.05)


def decoded(plan, v) -> list:
    return list(v.decoding) if plan.decode is True else list(plan.decode or [])


def test_batch_order_critical_prefills_then_noncritical():
    """Critical decodes by C, then the partial prefill, then SPF admissions, then the
    non-critical decodes by C while the budget lasts."""
    v = View(now=10.0, decoding=[1, 2, 3], prefilling=[4], waiting=[5, 6, 7],
             prompt={1: 50, 2: 50, 3: 50, 4: 300, 5: 400, 6: 30, 7: 30}, done={4: 100},
             kv={1: 60, 2: 60, 3: 60, 4: 100}, last={1: 9.95, 2: 9.0, 3: 9.9}, slo={1: 0.5, 2: 0.1, 3: 0.5})
    plan = Slai(token_budget=240, dynamic=False, offset=0).schedule(v)
    # C: 1 -> 10.45, 2 -> 9.1 (critical), 3 -> 10.4
    assert plan.chunks[0] == (4, 200)                          # 239 tokens after the critical decode
    assert plan.admit == [6, 7] and plan.chunks[1:] == [(6, 30), (7, 9)]
    assert decoded(plan, v) == [2]                            # no budget left for 3 and 1
    plan = Slai(token_budget=300, dynamic=False, offset=0).schedule(v)
    assert plan.admit == [6, 7, 5] and plan.chunks[1:] == [(6, 30), (7, 30), (5, 39)]
    assert decoded(plan, v) == [2]                             # the last admission is chunked
    v.kv_capacity_blocks = 800                                 # 5's whole prompt no longer fits:
    plan = Slai(token_budget=300, dynamic=False, offset=0).schedule(v)
    assert plan.admit == [6, 7] and plan.decode is True        # 39 tokens left for 3 and 1


def test_kv_exhaustion_preempts_newest_partial_prefill_then_the_decode():
    v = View(decoding=[1, 2], prefilling=[3, 4], prompt={1: 10, 2: 10, 3: 50, 4: 50},
             kv={1: 500, 2: 440, 3: 20, 4: 20}, done={3: 20, 4: 20}, last={1: 9.0, 2: 9.0},
             slo={1: 0.1, 2: 0.1}, grow={1, 2}, kv_capacity_blocks=1040)
    # free 60 - reserved (30 + 30) = 0: decode 1 preempts request 4 (newest partial prefill,
    # frees its 50 reserved+held blocks), decode 2 takes one more; nothing is admitted.
    plan = Slai(dynamic=False, offset=0).schedule(v)
    assert plan.preempt == [4] and plan.decode is True
    assert plan.chunks == [(3, 30)] and plan.admit == []
    v.prefilling, v.kv = [], {1: 500, 2: 540}                  # no partial prefill, KV full:
    plan = Slai(dynamic=False, offset=0).schedule(v)          # decode 1 preempts itself,
    assert plan.preempt == [1] and decoded(plan, v) == [2]     # which makes room for 2


def test_spf_is_stable_and_user_priority_goes_first():
    v = View(waiting=[1, 2, 3, 4, 5], prompt={1: 300, 2: 100, 3: 300, 4: 100, 5: 50}, prio={1: 0, 2: 1, 3: 0, 4: 1, 5: 1})
    assert prefill_order(v, "spf") == [5, 2, 4, 1, 3]
    assert prefill_order(v, "fcfs") == [1, 2, 3, 4, 5]
    assert prefill_order(v, "spf", user_priority=True) == [1, 3, 5, 2, 4]


def test_slai_with_every_decode_critical_is_sarathi_exactly():
    """A huge fixed offset makes every decode critical; with FCFS SLAI's batches are
    sarathi's: identical first-token and finish times (KV tight enough to block admissions)."""
    w = tiered()
    out = {}
    for name, params in (("sarathi", {"watermark": 0.01}),
                         ("slai", {"order": "fcfs", "dynamic": False, "offset": 1e9})):
        _, rec, _ = run(w, name, params, cost="roofline", kv_tokens=20_000, block_size=16)
        out[name] = rec
    a, b = out["sarathi"], out["slai"]
    assert a.iterations == b.iterations
    assert np.array_equal(a.first_token, b.first_token) and np.array_equal(a.finished, b.finished)
    assert np.isfinite(a.finished).all()


def test_slai_defers_relaxed_decodes():
    """With the calibrated cost (the tiled preset, decode attention x 1.4 as bench_slai
    calibrates it): free-tier decodes (TBT 0.5 s) are deferred while paying ones (0.1 s) keep
    their p99 within the SLO. The deferral shows in the free tier's tail (p99 several times
    sarathi's); its median gap stays the batch time, as non-critical decodes fill the budget
    left after prefills in most batches."""
    w = load(WorkloadOptions(num_requests=1500, arrivals="poisson-trunc:1.2:3", prompt_len="uniform:100:4000",
                             output_len="uniform:50:800", tiers=["paying:0.05:tbt=0.1:priority=0",
                                                                 "free:0.95:tbt=0.5:priority=1"], seed=1))
    tiers = {}
    for name, params in (("sarathi", {"watermark": 0.01}), ("slai", {})):
        sc = Scenario(w, model="mistral-7b", gpu="rtx-6000-ada", cost="tiled-mistral-7b-rtx-6000-ada",
                      cost_params={"decode_attn_token_s": 1.4 * 4.267e-9}, kv_capacity=205_000, max_model_len=8192)
        tiers[name] = {t["name"]: t for t in simulate(sc, name, params).summary["tiers"]}
    sarathi, slai = tiers["sarathi"], tiers["slai"]
    assert slai["free"]["p99_itl_ms"] > 3 * sarathi["free"]["p99_itl_ms"]
    assert slai["free"]["median_itl_ms"] >= 0.95 * sarathi["free"]["median_itl_ms"]
    assert slai["paying"]["p99_itl_ms"] <= 100 and slai["paying"]["tbt_slo_attainment"] > 0.9


def test_slai_offset_parameters():
    gpu = get_gpu("a100-80gb")
    assert make_policy("slai", {"offset": "3"}, gpu).dynamic is False          # a fixed delta
    assert make_policy("slai", {}, gpu).offset_now(View(kv={1: 959}), 0) == 5.0
    assert make_policy("slai", {}, gpu).offset_now(View(kv={1: 960}), 0) == 10.0
    for bad, match in (({"dynamic": "true", "offset": "3"}, "fixed delta"),
                       ({"dynamic": "false", "offset_low": "2"}, "dynamic delta"),
                       ({"offset_low": "12"}, "exceeds offset_high")):
        with pytest.raises(KvschedError, match=match):
            make_policy("slai", bad, gpu)


def test_slai_unfrozen_deadline_follows_t_bar():
    v = View(decoding=[1], kv={1: 100}, last={1: 9.9}, slo={1: 0.5})
    pol = Slai(freeze=False)
    pol.schedule(v)
    v.mean_batch_time = 0.05
    pol.schedule(v)
    assert pol._lst[1][1] == pytest.approx(9.9 + 0.5 - 5 * 0.05)


def test_lone_request_is_not_starved_by_the_watermark():
    """KV for the prompt but not beyond the 1% watermark: admitted while nothing runs."""
    w = Workload.from_requests([Request(0.0, 3060, 5)])
    for name in ("slai", "sarathi"):
        _, rec, _ = run(w, name, {"watermark": 0.01}, kv_tokens=3072, block_size=16)
        assert np.isfinite(rec.finished).all()


@pytest.mark.parametrize("params", [{}, {"variant": "prefill-first", "n": 40}, {"n": 8}])
def test_rad_batches_follow_algorithms(params):
    """Never a mixed batch; decode batches <= t_col; one prefill chunk of <= t_lcm tokens."""
    server, rec, _ = run(tiered(200), "rad", {"t_col": 16, "t_lcm": 64, **params}, cost="roofline",
                         kv_tokens=200_000, block_size=16)
    assert np.isfinite(rec.finished).all()
    for _, _, pt, chunks, nd, _ in server.batches:
        assert pt == 0 or nd == 0
        assert nd <= 16 and chunks <= 1 and pt <= 64


def test_rad_cycle_limits_starts():
    """With n = 3 at most 3 requests start between two moments with no decoder."""
    w = Workload.from_requests([Request(0.0, 64, 5) for _ in range(10)])
    server, rec, pol = run(w, "rad", {"t_col": 8, "t_lcm": 64, "n": 3}, kv_tokens=10_000)
    assert np.isfinite(rec.finished).all()
    starts = [b for b in server.batches if b[3]]
    decodes = [b for b in server.batches if b[4]]
    # cycles: 3 prefills, decodes until all 3 finish, next 3 ...
    assert [b[3] for b in server.batches[:4]] == [1, 1, 1, 0]
    assert len(starts) == 10 and len(decodes) == 4 * 4


def test_bad_parameters_are_refused():
    gpu = get_gpu("a100-80gb")
    with pytest.raises(KvschedError, match="order"):
        make_policy("slai", {"order": "lifo"}, gpu)
    with pytest.raises(KvschedError, match="variant"):
        make_policy("rad", {"variant": "x"}, gpu)
    with pytest.raises(KvschedError, match="memory_limit"):
        make_policy("slai", {"memory_limit": "1.5"}, gpu)
    with pytest.raises(KvschedError, match="order"):
        make_policy("sarathi", {"order": "x"}, gpu)


def test_distserve_split_run_counts_the_transfer():
    w = tiered(100, rate=2.0)
    sc = Scenario(w, model="mistral-7b", gpu="rtx-6000-ada", prefill_replicas=1, decode_replicas=1)
    res = simulate(sc, "distserve")
    rec = res.records
    assert np.isfinite(rec.finished).all()
    assert (rec.transfer > 0).all() and res.summary["mean_transfer_ms"] > 0
    assert (rec.replica == 0).all() and (rec.decode_replica == 1).all()
    chunked = simulate(sc, "distserve", {"chunk": 128}).records
    assert np.isfinite(chunked.finished).all()
    with pytest.raises(KvschedError, match="disaggregated"):
        simulate(Scenario(w, model="mistral-7b", gpu="rtx-6000-ada"), "distserve")
    with pytest.raises(KvschedError, match="rad runs whole requests"):
        simulate(sc, "rad")
