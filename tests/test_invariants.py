"""The engine's named invariants (kvsched/sim/invariants.py): KVSCHED_CHECK=1 checks them at
every step without changing a result, and each one, broken on purpose, is named."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsched.cost import make_cost_model
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model
from kvsched.kvcache import PagedKV
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.sim import invariants
from kvsched.sim.invariants import InvariantError, check_same
from kvsched.sim.server import Server
from kvsched.workload import Uniform, synthetic

SCENARIOS = [
    ("vllm-v1", {}, {}),
    ("sarathi", {}, {"kv_capacity": 6_000}),
    ("eb", {}, {"kv_capacity": 6_000, "prefix_caching": False}),
    ("vllm-v1", {}, {"replicas": 3, "router": "least-kv", "kv_capacity": 8_000}),
    ("vllm-v1", {}, {"prefill_replicas": 1, "decode_replicas": 2, "kv_capacity": 8_000}),
    ("slai", {}, {"kv_capacity": 8_000}),
]


def _workload(n=300, seed=3):
    return synthetic(Uniform(1, 1400), Uniform(1, 400), rate=6.0, n=n, seed=seed)


@pytest.mark.parametrize("policy,params,fields", SCENARIOS)
def test_checked_runs_are_clean_and_give_the_same_results(policy, params, fields, monkeypatch):
    sc = Scenario(_workload(), **fields)
    plain = simulate(sc, policy, params).records
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    checked = simulate(sc, policy, params).records
    check_same(plain, checked, "determinism")


COMPARED = ("vllm-v1", "sarathi")
RECORD_ARRAYS = ("arrival", "admitted", "first_token", "finished", "preemptions", "recomputed", "itl_max",
                 "tbt_violations", "rejected")
RECORD_COUNTERS = ("iterations", "kv_time_integral", "kv_peak_tokens", "peak_queue", "busy_time")
# The interpreted runs: a process of its own with KVSCHED_PURE_PYTHON=1 (the compiled and the
# interpreted code are one module file, so one process cannot hold both). Their records go back
# as plain values (a compiled GapHistogram's pickle does not load as the .py class's).
INTERPRETED = """
import pickle, sys
sys.path[:0] = [sys.argv[2]]
import kvsched.compiled as c
from kvsched.run import Scenario, simulate
import test_invariants as t
sc = Scenario(t._workload(), kv_capacity=6_000)
out = {}
for policy in t.COMPARED:
    r = simulate(sc, policy).records
    out[policy] = ({f: getattr(r, f) for f in t.RECORD_ARRAYS + t.RECORD_COUNTERS},
                   dict(counts=list(r.itl.counts), total=r.itl.total, n=r.itl.n, max=r.itl.max))
assert "kvsched.sim.replica" in sys.modules
assert not any(c.is_compiled(m) for n, m in list(sys.modules.items()) if n in c.NAMES)
with open(sys.argv[1], "wb") as f:
    pickle.dump(out, f)
"""


def test_compiled_equals_interpreted(tmp_path):
    """The records of this process's runs (compiled where built) and of the same runs in a
    KVSCHED_PURE_PYTHON=1 process agree bit for bit (tests/test_compiled.py: everything else)."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace
    out = tmp_path / "interpreted.pickle"
    env = {**os.environ, "KVSCHED_PURE_PYTHON": "1"}
    p = subprocess.run([sys.executable, "-c", INTERPRETED, str(out), str(Path(__file__).resolve().parent)],
                       env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    interpreted = pickle.loads(out.read_bytes())
    sc = Scenario(_workload(), kv_capacity=6_000)
    for policy in COMPARED:
        fields, itl = interpreted[policy]
        check_same(simulate(sc, policy).records, SimpleNamespace(**fields, itl=SimpleNamespace(**itl)),
                   "compiled-equals-interpreted")


def _server(hook, n=60):
    """A checked single replica whose policy calls hook(server, i) as request i finishes."""
    pol = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
    cost = make_cost_model("constant", {}, get_model("llama-3-8b"), get_gpu("a100-80gb"))
    holder = {}

    class Breaking(type(pol)):
        def on_finish(self, i, v):
            hook(holder["server"], i)

    bad = Breaking(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol) if f.init})
    server = Server(_workload(n), bad, cost, PagedKV(40_000, 16))
    holder["server"] = server
    return server


BREAKS = {
    "kv-within-capacity": lambda s, i: setattr(s.replica.kv, "used", s.replica.kv.capacity_blocks + 1),
    "tokens-conserved": lambda s, i: setattr(s.replica, "prefill_backlog", s.replica.prefill_backlog + 1),
    "time-order": lambda s, i: [s.reqs.admitted.__setitem__(j, s.reqs.arrival[j] - 1.0)
                                for j in list(s.replica._running)[:1]],
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_broken_invariant_is_named(name, monkeypatch):
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    server = _server(lambda s, i: BREAKS[name](s, i) if i == 20 else None)
    with pytest.raises(InvariantError, match=f"^invariant {name} broken: "):
        server.run()


def test_used_blocks_off_by_one_breaks_tokens_conserved(monkeypatch):
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    server = _server(lambda s, i: setattr(s.replica.kv, "used", s.replica.kv.used + 1) if i == 20 else None)
    with pytest.raises(InvariantError, match="^invariant tokens-conserved broken: replica 0 counts"):
        server.run()


def test_a_request_left_unfinished_breaks_all_accounted(monkeypatch):
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    last = {}

    def hook(s, i):
        last["server"] = s

    server = _server(hook, n=30)
    real = invariants.at_end

    def corrupted(reqs):
        reqs.status[7] = 1                  # a finished request marked waiting, in no queue
        real(reqs)
    monkeypatch.setattr(invariants, "at_end", corrupted)
    with pytest.raises(InvariantError, match="^invariant all-accounted broken: 1 request"):
        server.run()


def test_without_the_variable_nothing_is_checked(monkeypatch):
    monkeypatch.delenv("KVSCHED_CHECK", raising=False)
    server = _server(lambda s, i: setattr(s.replica, "prefill_backlog", s.replica.prefill_backlog + 1)
                     if i == 20 else None)
    server.run()                            # the corruption goes unnoticed: no check ran


@pytest.mark.parametrize("name", ["determinism", "compiled-equals-interpreted"])
def test_records_that_differ_are_named(name):
    sc = Scenario(_workload(80))
    a = simulate(sc, "vllm-v1").records
    b = simulate(sc, "vllm-v1").records
    check_same(a, b, name)
    b.finished = b.finished.copy()
    b.finished[5] = np.nextafter(b.finished[5], np.inf)
    with pytest.raises(InvariantError, match=f"^invariant {name} broken: finished differs .*request 5"):
        check_same(a, b, name)


def test_the_error_is_a_kvsched_error():
    assert issubclass(InvariantError, KvschedError)
    assert InvariantError("time-order", "x").invariant == "time-order"


def test_long_queues_on_every_replica_of_a_cluster_get_their_whole_check(monkeypatch):
    """Each replica counts its own steps for the amortised checks: with two replicas taking
    turns, a corruption of replica 0's backlog is found (a shared count skipped it)."""
    monkeypatch.setenv("KVSCHED_CHECK", "1")
    monkeypatch.setattr(invariants, "EVERY_STEP", 1)
    w = synthetic(Uniform(200, 400), Uniform(50, 100), rate=400.0, n=200, seed=5)
    pols = [make_policy("vllm-v1", {"max_num_seqs": 2}, get_gpu("a100-80gb")) for _ in range(2)]
    cost = make_cost_model("constant", {}, get_model("llama-3-8b"), get_gpu("a100-80gb"))
    from kvsched.sim.cluster import Cluster
    cluster = Cluster(w, pols, cost, PagedKV(40_000, 16), router="round-robin")
    real = invariants.after_step

    def corrupting(c, rep, step):
        if rep.index == 0 and step == 3:
            rep.prefill_backlog += 1                # from here on replica 0 is wrong
        real(c, rep, step)
    monkeypatch.setattr(invariants, "after_step", corrupting)
    with pytest.raises(InvariantError, match="^invariant tokens-conserved broken: replica 0's prefill backlog"):
        cluster.run()
