"""Hardening, second round (issue 36): each case used to write through a device, grow
without bound, let a policy write the engine or fail late; now a one-line error (exit 2) or
the correct result."""
import collections
import copy
import os
import pickle
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import one_line_error, runner
from kvsched.cli import app
from kvsched.errors import KvschedError, PlanError
from kvsched.hardware import get_gpu
from kvsched.policies import Plan, make_policy
from kvsched.run import Scenario, simulate
from kvsched.sim import replica as replica_mod
from kvsched.workload import Workload

_BASE = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))


# ---- the view cannot be written ----------------------------------------------------------

_LEAVES = (int, float, str, bytes, bool, type(None), complex, range)
_FOLLOW = ("__self__", "__func__", "__wrapped__", "__dict__", "__closure__", "cell_contents",
           "base", "mapping", "obj", "gi_frame", "f_locals")


def _reachable(root, depth: int = 6):
    """Every object reachable from `root` through attributes (public, private, the dunders
    that lead from an object to another instance), items of containers and the planner
    `prefix_planner()` returns."""
    seen, frontier, out = {id(root)}, [root], []
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            out.append(obj)
            if isinstance(obj, _LEAVES) or isinstance(obj, type) or isinstance(obj, types.ModuleType):
                continue
            kids = []
            names = set(_FOLLOW) | {n for n in dir(obj) if not n.startswith("__")}
            names.discard("cost_model")        # the policy's own copy (tested below)
            if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)) \
                    or type(obj).__name__ == "cython_function_or_method":     # a compiled module's function
                names.discard("__dict__")      # a function's attributes: the class's, not an instance's
                names -= {"func_dict", "func_globals"}      # a compiled function's names of __dict__, __globals__
            for n in names:
                try:
                    kids.append(getattr(obj, n))
                except Exception:
                    pass
            if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
                kids.extend(list(obj)[:50])
            if isinstance(obj, (dict, types.MappingProxyType)):
                kids.extend(list(obj.values())[:50])
            if isinstance(obj, types.MethodType) and obj.__name__ == "prefix_planner":
                kids.append(obj())
            for k in kids:
                if id(k) not in seen and not isinstance(k, type) and not isinstance(k, types.ModuleType):
                    seen.add(id(k))
                    nxt.append(k)
        frontier = nxt
    return out


class _Probe:
    """Collects, at its first batch, what can be reached from the view."""
    name = "probe"

    def __init__(self):
        self.found = None

    def schedule(self, v):
        if self.found is None:
            self.found = _reachable(v)
        return _BASE.schedule(v)


@pytest.mark.parametrize("prefix", [False, True])
def test_no_engine_object_is_reachable_from_the_view(prefix):
    """Issue 36: `view._kv.used = -1000` and `view.prompt_len.__self__.now = 0.0` wrote the
    engine. No object reached from the view now is the replica, its KV, decode set, cache or
    request table, or a mutable container or writable array of theirs."""
    w = Workload.build(np.arange(30) * 0.05, [300] * 30, [20] * 30)
    probe = _Probe()
    simulate(Scenario(w, prefix_caching=prefix), probe)
    found = probe.found
    from kvsched.kvcache import PagedKV
    from kvsched.sim.decode_set import Cohort, DecodeSet
    from kvsched.sim.prefix_cache import PrefixCache
    from kvsched.sim.prefix_planner import HitPlanner, LazyPlanner
    from kvsched.sim.requests import RequestTable
    engine = (replica_mod.Replica, PagedKV, Cohort, DecodeSet, RequestTable, PrefixCache, HitPlanner, LazyPlanner)
    bad = [type(o).__name__ for o in found if isinstance(o, engine)]
    assert not bad, bad
    writable = [type(o).__name__ for o in found
                if isinstance(o, (list, dict, set, collections.deque, bytearray))
                or isinstance(o, np.ndarray) and o.flags.writeable]
    assert not writable, writable


def test_view_private_slots_and_bound_methods_lead_nowhere():
    seen = {}

    class Writer:
        name = "writer"

        def schedule(self, v):
            for route in ("_r", "_kv", "_ds", "_cost"):
                with pytest.raises(AttributeError):
                    getattr(v, route)
            assert v.prompt_len.__self__ is v
            with pytest.raises(PlanError, match="writer assigned view.now"):
                v.now = 0.0
            seen["cost"] = v.cost_model
            v.cost_model.__dict__.clear() if hasattr(v.cost_model, "__dict__") else None
            return _BASE.schedule(v)

    w = Workload.build(np.arange(20) * 0.05, [200] * 20, [10] * 20)
    a = simulate(Scenario(w), Writer()).summary
    b = simulate(Scenario(w), "vllm-v1").summary
    assert a["completed"] == b["completed"] == 20
    assert a["duration"] == b["duration"]          # the policy's cost copy was emptied, not the engine's


def test_view_copies_and_pickles_lead_nowhere():
    """Compiled, the view is a C type whose replica is a C field (sim/view.pxd): no pickling
    or copying protocol hands it out, and a view made without the engine reads nothing."""
    from kvsched.sim.view import ReplicaView
    seen = {}

    class Copier:
        name = "copier"

        def schedule(self, v):
            if not seen:
                seen["reduced"] = _reachable(v.__reduce_ex__(2))
                for make in (lambda: pickle.dumps(v), lambda: copy.copy(v), lambda: copy.deepcopy(v)):
                    with pytest.raises((TypeError, AttributeError, PlanError)):
                        make()
            return _BASE.schedule(v)

    w = Workload.build(np.arange(10) * 0.05, [200] * 10, [10] * 10)
    assert simulate(Scenario(w), Copier()).summary["completed"] == 10
    from kvsched.sim.decode_set import Cohort, DecodeSet
    from kvsched.sim.requests import RequestTable
    engine = (replica_mod.Replica, Cohort, DecodeSet, RequestTable)
    assert not [type(o).__name__ for o in seen["reduced"] if isinstance(o, engine)]
    bare = ReplicaView.__new__(ReplicaView)
    for read in (lambda: bare.now, lambda: bare.prompt_len(0), lambda: bare.num_waiting, lambda: bare.cost_model):
        with pytest.raises(AttributeError):
            read()


_FOREIGN_SELF = r"""
import numpy as np
from kvsched.hardware import get_gpu
from kvsched.policies import make_policy
from kvsched.run import Scenario, simulate
from kvsched.workload import Workload
base, out = make_policy("vllm-v1", {}, get_gpu("a100-80gb")), []

class Foreign:
    name = "foreign"

    def schedule(self, v):
        if not out:
            kind = type(v)
            for name in sorted(n for n in dir(kind) if not n.startswith("__")):
                attr = getattr(kind, name)
                calls = [lambda: attr.__get__(object())] if hasattr(attr, "__set__") else []
                if callable(attr):
                    calls += [lambda: attr(object(), 0), lambda: attr(object()), lambda: attr(1, 16)]
                for call in calls:
                    try:
                        call()
                        out.append(name)
                    except (TypeError, AttributeError):     # as Python, the body may fail first
                        pass
            out.append("-")
        return base.schedule(v)

simulate(Scenario(Workload.build(np.arange(4) * 0.05, [50] * 4, [5] * 4)), Foreign())
print(",".join(out))
"""


def test_view_methods_refuse_a_foreign_self():
    """A policy calling the view's own methods or properties on another object
    (`type(v).prompt_len(object(), 0)`) gets an error, compiled a TypeError (methods of a C type
    that check their `self`: view.py is compiled with binding=False), not a read of
    whatever memory lies where the replica would be. In a child process: a crash fails this
    test instead of the run."""
    for pure in ("0", "1"):
        env = {**os.environ, "KVSCHED_PURE_PYTHON": pure}
        r = subprocess.run([sys.executable, "-c", _FOREIGN_SELF], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, (pure, r.returncode, r.stderr[-500:])
        assert r.stdout.strip() == "-", (pure, r.stdout)     # no call on a foreign object went through


def test_the_view_is_made_once():
    seen = {}

    class Remaker:
        name = "remaker"

        def schedule(self, v):
            if not seen:
                with pytest.raises(PlanError, match="remaker called view.__init__: the view is read-only"):
                    v.__init__(None, {})
                seen["now"] = v.now              # the view still reads its replica
            return _BASE.schedule(v)

    w = Workload.build(np.arange(5) * 0.05, [100] * 5, [5] * 5)
    assert simulate(Scenario(w), Remaker()).summary["completed"] == 5 and seen["now"] >= 0


# ---- writers never replace what is not a regular file ------------------------------------

def _targets(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "elsewhere.csv")
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    return [(fifo, "a FIFO"), (link, "a symbolic link"), (folder, "a folder"), (Path("/dev/null"), "a character device")]



def test_writers_refuse_fifos_links_folders_and_devices(tmp_path, monkeypatch):
    """Issue 36: `workload export --out FIFO` turned the FIFO into a file (as root, /dev/full
    into a file). Every single-file writer now refuses a target that is not a regular file,
    and leaves it as it was."""
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "steps.csv"
    log.write_text("kind,prefill_tokens,decode_requests,decode_context,seconds\n")
    sim = tmp_path / "run"
    assert runner.invoke(app, ["simulate", "--num-requests", "20", "--out", str(sim)]).exit_code == 0
    for target, kind in _targets(tmp_path):
        before = os.lstat(target)
        needle = target.name if kind == "a folder" else f"it is {kind}"   # a folder: each command's own words
        one_line_error(["workload", "export", "--num-requests", "20", "--out", str(target)], needle)
        one_line_error(["report", str(sim), "--output", str(target)], needle)
        one_line_error(["calibrate", str(log), "--out", str(target)], needle)
        after = os.lstat(target)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert not (tmp_path / "elsewhere.csv").exists()          # nothing written through the link


def test_a_regular_file_is_still_replaced(tmp_path):
    out = tmp_path / "w.csv"
    out.write_text("old\n")
    assert runner.invoke(app, ["workload", "export", "--num-requests", "20", "--out", str(out)]).exit_code == 0
    assert out.read_text().startswith("arrival_time,")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _aged(*paths: Path) -> None:
    """Make `paths` older than files.STALE_AFTER."""
    from kvsched.files import STALE_AFTER
    old = time.time() - STALE_AFTER - 5
    for p in paths:
        os.utime(p, (old, old))


def test_what_a_killed_writer_left_is_removed_by_a_later_write(tmp_path):
    """Issue 36: `kill -9` during --out left a hidden `.NAME.*` folder no later run removed.
    Temporary names now carry the writer's process id; a later write of NAME removes those of
    writers no longer running (exact kvsched names only, this user's, a minute old)."""
    dead = _dead_pid()
    left = tmp_path / f".run.{dead}.abc12_xy"
    left.mkdir()
    (left / "requests.csv").write_text("half")
    stale_file = tmp_path / f".w.csv.{dead}.q1w2e3r4.tmp"
    stale_file.write_text("half")
    young = tmp_path / f".run.{dead}.young123"          # too recent to judge
    young.mkdir()
    mine = tmp_path / f".run.{os.getpid()}.livewrit"     # a live writer's
    mine.mkdir()
    users = [tmp_path / f".w.csv.{dead}.backup", tmp_path / f".w.csv.{dead}.q1w2e3r4.tmp.keep",
             tmp_path / f".run.{dead}.old.zz", tmp_path / ".w.csv.99999999999999999999.abcdefgh.tmp"]
    for u in users:
        u.write_text("the user's own")
    _aged(left, stale_file, mine, *users)
    assert runner.invoke(app, ["simulate", "--num-requests", "20", "--out", str(tmp_path / "run")]).exit_code == 0
    assert runner.invoke(app, ["workload", "export", "--num-requests", "20", "--out", str(tmp_path / "w.csv")]).exit_code == 0
    assert not left.exists() and not stale_file.exists()
    assert young.exists() and mine.exists() and all(u.read_text() == "the user's own" for u in users)


def test_a_moved_aside_run_is_put_back(tmp_path):
    """A writer killed between its two renames left the old run in `.NAME.PID.old.*/run` and
    no NAME: a later write restores it first (then replaces it as usual). A folder of that
    name that does not hold a run is the user's: left alone."""
    from kvsched.run import MANIFEST, _clear_stale
    dead = _dead_pid()
    old = tmp_path / f".run.{dead}.old.abcdefgh" / "run"
    old.mkdir(parents=True)
    (old / "summary.json").write_text("{}")
    (old / MANIFEST).write_text("summary.json\n")
    theirs = tmp_path / f".mine.{dead}.old.abcdefgh" / "run"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    _aged(old.parent, theirs.parent)
    _clear_stale(tmp_path, tmp_path / "run")
    _clear_stale(tmp_path, tmp_path / "mine")
    assert (tmp_path / "run" / "summary.json").read_text() == "{}"
    assert (theirs / "notes.txt").read_text() == "mine" and not (tmp_path / "mine").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", theirs.parent.name])


def test_a_manifest_that_is_not_utf8_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".kvsched-run").write_bytes(b"\xff\xfe summary.json\n")
    (out / "summary.json").write_text("{}")
    one_line_error(["simulate", "--num-requests", "20", "--out", str(out)], "holds files kvsched did not write")


# ---- sizes checked before anything is built ----------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["simulate", "--num-requests", "50", "--replicas", "1000000000"], "--replicas must be <= 10,000 (kvsched.limits)"),
    (["simulate", "--num-requests", "50", "--prefill-replicas", "6000", "--decode-replicas", "6000"],
     "--prefill-replicas + --decode-replicas must be <= 10,000"),
    (["capacity", "--num-requests", "50", "--slo", "ttft:p99:2000", "--seeds", "1000000000000"],
     "--seeds must be <= 10,000 (kvsched.limits)"),
    (["capacity", "--num-requests", "50", "--slo", "ttft:p99:2000", "--rate", "5", "--utilization", "2"],
     "--utilization must be in (0, 1], got 2.0"),
    (["capacity", "--num-requests", "50", "--slo", "ttft:p99:2000", "--utilization", "0.5"], "give --rate too"),
    (["capacity", "--num-requests", "50", "--slo", "ttft:p99:2000", "--tolerance", "5"], "--tolerance must be in (0, 1)"),
    (["simulate", "--num-requests", "20", "--kv-transfer-bandwidth", "5"], "--kv-transfer-bandwidth sets the KV link"),
    (["simulate", "--num-requests", "20", "--kv-transfer-latency", "0"], "--kv-transfer-latency sets the KV link"),
])
def test_sizes_and_settings_are_checked_first(args, needle, monkeypatch):
    """Each refused before any simulation: the search, the service-rate measurement and the
    cluster are never reached (they would raise here)."""
    import kvsched.capacity
    import kvsched.sim.cluster
    import kvsched.theory.plan

    def never(*a, **k):
        raise AssertionError("work started before the check")
    monkeypatch.setattr(kvsched.theory.plan, "service_rate", never)
    monkeypatch.setattr(kvsched.capacity.Search, "run", never)
    monkeypatch.setattr(kvsched.sim.cluster.Cluster, "__init__", never)
    one_line_error(args, needle)


@pytest.mark.parametrize("kw, needle", [
    (dict(replicas=2.5), "--replicas must be a whole number, got 2.5"),
    (dict(replicas=True), "--replicas must be a whole number"),
    (dict(replicas=0), "--replicas must be >= 1"),
    (dict(prefix_caching="off"), "Scenario.prefix_caching must be True or False, got 'off'"),
    (dict(strict="no"), "Scenario.strict must be True or False"),
    (dict(prefill_replicas=1.5, decode_replicas=1), "--prefill-replicas must be a whole number"),
    (dict(kv_transfer_latency=0.5), "--kv-transfer-latency sets the KV link"),
    (dict(stall_batches=2.5), "--stall-batches must be a whole number, got 2.5"),
    (dict(stall_batches=True), "--stall-batches must be a whole number"),
    (dict(stall_batches="5"), "--stall-batches must be a whole number"),
    (dict(trim=1.5), "--trim must be a whole number"),
    (dict(memory_utilization="0.9"), "--memory-utilization must be in (0, 1], got '0.9'"),
    (dict(router=5), "Scenario.router must be a name (text), got 5"),
    (dict(gpu=5), "Scenario.gpu must be a name (text), got 5"),
    (dict(router_seed=1.5), "--seed (of the router) must be a whole number"),
    (dict(kv_transfer_bandwidth="25"), "--kv-transfer-bandwidth must be a number, got '25'"),
    (dict(cost_params=None), "Scenario.cost_params must be dict, got NoneType"),
    (dict(goodput="ttft:5"), "Scenario.goodput must be a Goodput or None, got str"),
    (dict(workload=None), "Scenario.workload must be a Workload, got NoneType"),
    (dict(router=type("R", (), {"route": lambda *a: 0})()), "needs name, uses_state and route"),
])
def test_scenario_fields_are_checked(kw, needle):
    kw = {"workload": Workload.build(np.arange(5) * 0.1, [100] * 5, [10] * 5), **kw}
    with pytest.raises(KvschedError, match=__import__("re").escape(needle)):
        simulate(Scenario(**kw), "vllm-v1")


def test_integral_numpy_and_float_replica_counts_are_taken():
    w = Workload.build(np.arange(5) * 0.1, [100] * 5, [10] * 5)
    assert simulate(Scenario(w, replicas=np.int64(2)), "vllm-v1").summary["completed"] == 5
    assert simulate(Scenario(w, replicas=2.0), "vllm-v1").summary["completed"] == 5


# ---- policies named ----------------------------------------------------------------------

class _Uncopyable:
    name = "locked"

    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def schedule(self, v):
        return _BASE.schedule(v)


class _Exits:
    name = "quitter"

    def schedule(self, v):
        raise SystemExit(7)


def test_a_policy_that_cannot_be_copied_or_exits_is_named():
    w = Workload.build(np.arange(5) * 0.1, [100] * 5, [10] * 5)
    assert simulate(Scenario(w), _Uncopyable()).summary["completed"] == 5      # one replica: no copy needed
    with pytest.raises(KvschedError, match="policy locked cannot be copied for replica 1 .*TypeError"):
        simulate(Scenario(w, replicas=2), _Uncopyable())
    with pytest.raises(PlanError, match="policy quitter raised SystemExit in schedule at t=0s: 7"):
        simulate(Scenario(w), _Exits())


class _ExitsWhenCopied:
    name = "copyquit"

    def __deepcopy__(self, memo):
        raise SystemExit(7)

    def schedule(self, v):
        return _BASE.schedule(v)


class _Odd(BaseException):
    pass


class _RaisesOdd:
    name = "odd"

    def schedule(self, v):
        raise _Odd("odd")


class _OutOfMemory:
    name = "hungry"

    def schedule(self, v):
        raise MemoryError


def test_any_exit_from_policy_code_is_named_but_ctrl_c_and_memory_pass():
    w = Workload.build(np.arange(5) * 0.1, [100] * 5, [10] * 5)
    with pytest.raises(KvschedError, match="policy copyquit cannot be copied for replica 1 .*SystemExit: 7"):
        simulate(Scenario(w, replicas=2), _ExitsWhenCopied())
    with pytest.raises(PlanError, match="policy odd raised _Odd in schedule"):
        simulate(Scenario(w), _RaisesOdd())
    with pytest.raises(MemoryError):           # the machine's, not the policy's
        simulate(Scenario(w), _OutOfMemory())


def test_jobs_are_bounded():
    one_line_error(["capacity", "--num-requests", "30", "--slo", "ttft:p99:1000", "--jobs", "100000000"],
                   "--jobs must be <= 1,024 (kvsched.limits)")
    one_line_error(["sweep", "--num-requests", "5", "--rates", "1", "--jobs", "100000000", "--out", "x"],
                   "--jobs must be <= 1,024 (kvsched.limits)")


def test_a_router_that_raises_is_named():
    from kvsched.sim.routers import make_router
    router = make_router("least-outstanding", 0)

    def boom(*a, **k):
        raise SystemExit(3)
    router.route = boom
    w = Workload.build(np.arange(5) * 0.1, [100] * 5, [10] * 5)
    with pytest.raises(KvschedError, match="router least-outstanding raised SystemExit routing request 0"):
        simulate(Scenario(w, replicas=2, router=router), "vllm-v1")


# ---- the progress guard ------------------------------------------------------------------

class _Trickle:
    """Prefills one request at a time in 1-token chunks (slow, but always progress)."""
    name = "trickle"

    def schedule(self, v):
        if v.running:
            i = next(iter(v.running))
            if v.is_decoding(i):
                return Plan([], [], True, [])
            return Plan([], [(i, 1)], False, [])
        i = v.waiting[0]
        return Plan([i], [(i, 1)], False, [])


class _Thrash:
    """Prefills half a prompt, preempts it, starts again: tokens computed, none new after the first pass."""
    name = "thrash"

    def schedule(self, v):
        if v.running:
            i = next(iter(v.running))
            if v.prefill_done(i) >= v.prompt_len(i) // 2:
                return Plan([i], [(i, 10)], False, [i])     # preempt it and start it again
            return Plan([], [(i, 10)], False, [])
        i = v.waiting[0]
        return Plan([i], [(i, 10)], False, [])



def test_a_long_prompt_in_one_token_chunks_is_progress():
    """Issue 36: the guard counted every batch without an output token, so one 150,000-token
    prompt prefilled in 1-token chunks was called a stall. Only batches that preempt count now
    (here 2,000 batches under a limit of 100)."""
    w = Workload.build(np.zeros(1), [2000], [3])
    s = simulate(Scenario(w, cost="constant", cost_params={"b": 0.01}, stall_batches=100), _Trickle()).summary
    assert s["completed"] == 1 and s["iterations"] == 2000 + 2


def test_recomputing_the_same_tokens_forever_is_still_a_stall():
    w = Workload.build(np.zeros(1), [200], [3])
    with pytest.raises(PlanError, match="policy thrash made no progress: no output token in 50 batches that preempted"):
        simulate(Scenario(w, cost="constant", cost_params={"b": 0.01}, stall_batches=50), _Thrash())


# ---- memory of clusters ------------------------------------------------------------------

def test_a_disaggregated_run_keeps_no_per_request_state_on_its_replicas():
    """Issue 36: disaggregated runs grew ~120 bytes per request: prefill replicas with prefix
    caching kept every handed-off request's admission rank. After a run every replica's
    per-request containers are empty."""
    from kvsched.cost.constant import ConstantCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.cluster import Cluster
    rng = np.random.default_rng(0)
    w = Workload.build(np.sort(rng.uniform(0, 20, 400)), rng.integers(20, 300, 400), rng.integers(2, 40, 400))
    pols = [make_policy("vllm-v1", {}, get_gpu("a100-80gb")) for _ in range(4)]
    c = Cluster(w, pols, ConstantCost(0.02), PagedKV(20_000, 16), prefill_replicas=2, prefix_caching=True,
                kv_bytes_per_token=1000)
    rec = c.run()
    assert int(np.isfinite(rec.finished).sum()) == 400
    for r in c.replicas:
        assert not (r._order or r._fresh or r._running or r._queue or r._landing or r.pulls), r.index


def test_idle_replicas_cost_no_work_per_event(monkeypatch):
    """Choosing the next replica no longer scans every replica: with 200 replicas and 20
    requests, next_event_time is asked only of replicas something happened to."""
    # counted in the interpreted engine (a compiled class's methods cannot be patched)
    body = ("import numpy as np; from kvsched.sim.replica import Replica; from kvsched.run import Scenario, simulate\n"
            "from kvsched.workload.request import Workload\n"
            "calls = []; orig = Replica.next_event_time\n"
            "Replica.next_event_time = lambda self: calls.append(1) or orig(self)\n"
            "w = Workload.build(np.arange(20) * 0.5, [100] * 20, [20] * 20)\n"
            "s = simulate(Scenario(w, replicas=200), 'vllm-v1').summary\n"
            "print(s['completed'], len(calls))")
    env = {**os.environ, "KVSCHED_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, env=env, check=True).stdout
    completed, calls = map(int, out.split())
    assert completed == 20
    assert calls < 20 * 60, calls             # a scan would ask 200 replicas at every step


def test_iterators_slices_and_set_algebra_hand_out_no_engine_container():
    """Review of issue 36: `iter(v.waiting).__reduce__()` returned the replica's queue, a slice
    of `v._admitted` was a writable view of the table, and `v.decoding - s` was a one-shot
    set. Iterators now run over snapshots, slices are copies, set algebra gives frozensets."""
    seen = {}

    class Poke:
        name = "poke"

        def schedule(self, v):
            if len(v.waiting) >= 2 and v.num_decoding >= 2 and "done" not in seen:
                seen["done"] = True
                for coll in (v.waiting, v.recent_batch_times, v.recent_finished, v.decoding, v.running):
                    reduced = iter(coll).__reduce__()
                    inner = [x for x in reduced[1] if not isinstance(x, int)] if len(reduced) > 1 else []
                    assert all(isinstance(x, (tuple, list)) for x in inner), reduced
                    for x in inner:             # a copy, if anything: changing it changes nothing
                        if isinstance(x, list):
                            x.clear()
                a = v._admitted[:]
                a[:] = 0.0                      # a copy
                d = v.decoding - {-1}
                assert isinstance(d, frozenset) and len(d) == v.num_decoding and list(d) == list(d)
            return _BASE.schedule(v)

    w = Workload.build(np.arange(60) * 0.01, [300] * 60, [40] * 60)
    a = simulate(Scenario(w, cost="constant", cost_params={"b": 0.01}), Poke())
    b = simulate(Scenario(w, cost="constant", cost_params={"b": 0.01}), "vllm-v1")
    assert seen.get("done")
    assert a.records.admitted.tolist() == b.records.admitted.tolist()
    assert a.records.finished.tolist() == b.records.finished.tolist()


class _Creep:
    """Prefills one token a batch; each time its request holds a token more than ever before, it
    preempts it and starts again from 0 (second review of issue 36: a prompt token gained per
    round reset a guard that counted new prompt tokens, so it ran ~P^2/2 batches)."""
    name = "creep"

    def __init__(self):
        self.high = 0

    def schedule(self, v):
        if v.running:
            i = next(iter(v.running))
            done = v.prefill_done(i)
            if done > self.high:
                self.high = done
                return Plan([i], [(i, 1)], False, [i])
            return Plan([], [(i, 1)], False, [])
        i = v.waiting[0]
        return Plan([i], [(i, 1)], False, [])


def test_gaining_a_prompt_token_per_preemption_is_no_progress():
    w = Workload.build(np.zeros(1), [8000], [3])
    with pytest.raises(PlanError, match="policy creep made no progress: no output token in 100 batches that preempted"):
        simulate(Scenario(w, cost="constant", cost_params={"b": 0.01}, stall_batches=100), _Creep())


def test_recomputing_a_long_prompt_after_one_preemption_is_progress():
    """Review of issue 36: vllm-v1 with an 11-token budget recomputes a preempted 6,000-token
    prompt for ~550 batches; only batches that preempt count, so a limit of 50 does not stop it."""
    w = Workload.build([0.0] * 4 + [0.001], [64] * 4 + [6000], [3000] * 4 + [2])
    r = simulate(Scenario(w, kv_capacity=8000, block_size=16, cost="constant", cost_params={"b": 0.01},
                          stall_batches=50), "vllm-v1", {"max_num_batched_tokens": 11, "max_num_seqs": 11})
    assert r.summary["completed"] == 5 and int(r.records.preemptions.sum()) >= 1


@pytest.mark.parametrize("kw", [
    dict(replicas=4), dict(replicas=5, router="least-outstanding"), dict(replicas=3, router="prefix-affinity"),
    dict(prefill_replicas=2, decode_replicas=3), dict(replicas=3, closed=6), dict(replicas=3, sessions=True),
])
def test_the_heap_and_the_scan_choose_the_same_replicas(kw, monkeypatch):
    """Clusters above SCAN_UP_TO replicas choose the next replica from a heap, smaller ones
    by a scan: both give the same run, bit for bit."""
    import kvsched.sim.cluster as cluster
    rng = np.random.default_rng(3)
    n = 300
    closed, sessions = kw.pop("closed", None), kw.pop("sessions", False)
    build = dict(concurrency=closed) if closed else {}
    if sessions:
        build["session_prev"] = [-1 if k % 3 == 0 else k - 1 for k in range(n)]
        build["think"] = [0.0 if k % 3 == 0 else 0.5 for k in range(n)]
    w = Workload.build(np.sort(rng.uniform(0, 30, n)), rng.integers(20, 600, n), rng.integers(2, 80, n), **build)
    runs = []
    for up_to in (cluster.SCAN_UP_TO, 0):
        monkeypatch.setattr(cluster, "SCAN_UP_TO", up_to)
        r = simulate(Scenario(w, prefix_caching=True, **kw), "vllm-v1", record_timeline=True)
        rec = r.records
        runs.append(({k: v for k, v in r.summary.items() if "wall" not in k}, rec.finished.tolist(),
                     rec.first_token.tolist(), list(r.timeline)))
    assert runs[0] == runs[1]


def test_a_sweep_folder_keeps_temporaries_that_are_not_a_killed_writers(tmp_path):
    """Second review of issue 36: opening a sweep folder deleted every `.*.tmp` in it. Only
    killed writers' exact temporaries go now (files.stale_temporaries)."""
    from kvsched.sweep import Store
    store = Store(tmp_path / "sw")
    store.points.mkdir(parents=True)
    dead, live = _dead_pid(), os.getppid()
    gone = store.points / f".seed=0.json.{dead}.abcdefgh.tmp"
    kept = [tmp_path / "sw" / ".notes.tmp", store.points / f".seed=1.json.{live}.abcdefgh.tmp",
            store.points / f".seed=2.json.{dead}.young123.tmp"]
    for f in [gone, *kept]:
        f.write_text("x")
    _aged(gone, *kept[:2])
    store.open({}, [])
    assert not gone.exists() and all(f.exists() for f in kept)


def test_moved_aside_leftovers_empty_removed_links_and_foreign_runs_kept(tmp_path):
    from kvsched.run import MANIFEST, _clear_stale
    dead = _dead_pid()
    (tmp_path / "run").mkdir()                                   # the current run
    empty = tmp_path / f".run.{dead}.old.emptyabc"               # killed before its move
    empty.mkdir()
    elsewhere = tmp_path / "elsewhere" / "run"
    elsewhere.mkdir(parents=True)
    (elsewhere / MANIFEST).write_text("")
    link = tmp_path / f".run.{dead}.old.symlinkx"
    link.symlink_to(tmp_path / "elsewhere")
    mixed = tmp_path / f".run.{dead}.old.mixedabc" / "run"
    mixed.mkdir(parents=True)
    (mixed / MANIFEST).write_text("summary.json\n")
    (mixed / "summary.json").write_text("{}")
    (mixed / "mynotes.txt").write_text("mine")
    _aged(empty, mixed.parent)
    os.utime(link, (time.time() - 3600, time.time() - 3600), follow_symlinks=False)
    _clear_stale(tmp_path, tmp_path / "run")
    assert not empty.exists()
    assert link.is_symlink() and elsewhere.is_dir()
    assert (mixed / "mynotes.txt").read_text() == "mine"


def test_report_refuses_negative_times(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["simulate", "--num-requests", "20", "--out", str(out)]).exit_code == 0
    lines = (out / "requests.csv").read_text().split("\n")
    head = lines[0].split(",")
    row = lines[1].split(",")
    row[head.index("ttft")] = "-3"
    (out / "requests.csv").write_text("\n".join([lines[0], ",".join(row), *lines[2:]]))
    one_line_error(["report", str(out)], "requests.csv:2: a finished request needs ttft >= 0")


def test_a_long_sequence_is_iterated_lazily_and_still_hides_its_container():
    from kvsched.sim.view import SNAPSHOT_UP_TO, ReadOnlySeq
    q = collections.deque(range(SNAPSHOT_UP_TO + 10))
    face = ReadOnlySeq(q)
    it = iter(face)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    fn, (rest,) = it.__reduce__()
    assert isinstance(rest, tuple) and rest[0] == 3 and len(rest) == len(q) - 3
    assert list(it) == list(rest) and list(face) == list(q)
    assert not hasattr(it, "_it")
