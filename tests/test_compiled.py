"""The compiled fast path (src/kvsched/sim/_fast.pyx) gives the pure-Python results bit for bit:
every run here is made twice, compiled and with the module switched off (what
KVSCHED_PURE_PYTHON=1 or an install without a C compiler runs), and everything a run reports
is compared. CI builds the module (`pip install .`), so there these tests cannot skip."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsched.sim.replica as replica
from kvsched.sim import compiled
from kvsched.cost.roofline import RooflineCost
from kvsched.hardware import get_gpu, get_model
from kvsched.workload.request import Workload

from kvsched.policies import make_policy
from kvsched.policies.baselines import VllmV1
from test_fast_paths import STEADY, fingerprint, policy_fingerprint, workload

_fast = replica._fast


def test_ci_builds_the_compiled_module():
    if _fast is None:
        assert not os.environ.get("CI"), "CI installs kvsched with its compiled module (setup.py)"
        pytest.skip("kvsched.sim._fast is not built here (no C compiler at install, or KVSCHED_PURE_PYTHON)")


needs_fast = pytest.mark.skipif(_fast is None, reason="kvsched.sim._fast is not built")


def both(monkeypatch, w: Workload, name: str, **kw) -> tuple[str, str]:
    """The fingerprints of a run compiled and of the same run in pure Python."""
    compiled = fingerprint(w, name, True, **kw)[0]
    with monkeypatch.context() as m:
        m.setattr(replica, "_fast", None)
        pure = fingerprint(w, name, True, **kw)[0]
    return compiled, pure


def twice(monkeypatch, run) -> list:
    """[run() compiled, run() in pure Python]."""
    out = [run()]
    with monkeypatch.context() as m:
        m.setattr(replica, "_fast", None)
        out.append(run())
    return out


@needs_fast
@pytest.mark.parametrize("name", STEADY)
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("kv_capacity", [None, 12_000])
def test_compiled_runs_are_the_pure_python_runs(name, caching, kv_capacity, monkeypatch):
    compiled, pure = both(monkeypatch, workload(400, 20.0, 1), name, prefix_caching=caching, kv_capacity=kv_capacity)
    assert compiled == pure


@needs_fast
def test_compiled_runs_with_tiers_clusters_and_closed_loops(monkeypatch):
    tiered = workload(300, 15.0, 3, tiers=True)
    assert len(set(both(monkeypatch, tiered, "sarathi"))) == 1
    for router in ("least-kv", "least-outstanding"):
        assert len(set(both(monkeypatch, workload(600, 60.0, 2), "vllm-v1", replicas=3, router=router,
                            kv_capacity=15_000))) == 1
    g = np.random.default_rng(4)
    closed = Workload.build(np.zeros(200), g.integers(1, 600, 200), g.integers(1, 200, 200),
                            concurrency=np.full(200, 8))
    assert len(set(both(monkeypatch, closed, "vllm-v1"))) == 1
    assert len(set(both(monkeypatch, workload(300, 10.0, 5), "vllm-v1", prefill_replicas=1,
                        decode_replicas=2))) == 1


@needs_fast
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rate=st.floats(0.5, 80.0), caching=st.booleans(),
       name=st.sampled_from(STEADY), kv=st.sampled_from([None, 3_000, 8_000]), bs=st.sampled_from([1, 16]),
       model=st.sampled_from(["llama-2-7b", "qwen2-7b"]))
def test_compiled_runs_are_exact_on_random_workloads(seed, rate, caching, name, kv, bs, model, monkeypatch):
    kw = dict(prefix_caching=caching, kv_capacity=kv, block_size=bs, model=model)
    compiled, pure = both(monkeypatch, workload(120, rate, seed), name, **kw)
    assert compiled == pure


@needs_fast
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-9, 1e9), min_size=1, max_size=300), st.integers(0, 5))
def test_window_max_is_numpy_s(values, skip):
    a = np.array(values + [0.0] * skip)[:len(values)]          # a view, as a cohort's window
    assert _fast.window_max(a) == float(np.maximum.reduce(a))


@needs_fast
def test_window_max_refuses_what_is_not_a_window():
    with pytest.raises(ValueError):
        _fast.window_max(np.zeros(0))
    for wrong in (np.zeros(3, np.float32), np.zeros(3, np.int64), np.zeros((2, 2)), np.zeros(6)[::2]):
        with pytest.raises((TypeError, ValueError, BufferError)):
            _fast.window_max(wrong)


@needs_fast
def test_only_a_dense_roofline_s_own_decode_time_is_compiled():
    cost = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    terms = _fast.roofline_terms(cost, cost.decode_time)
    assert terms is not None and terms[-1] == cost._kv_bytes

    class Slower(RooflineCost):
        pass
    sub = Slower(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    assert _fast.roofline_terms(sub, sub.decode_time) is None
    assert _fast.roofline_terms(cost, lambda n, ctx, switch: 1.0) is None
    moe = RooflineCost(get_model("qwen3-30b-a3b"), get_gpu("a100-80gb"))
    assert _fast.roofline_terms(moe, moe.decode_time) is None
    ints = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"), compute_efficiency=1)
    assert (_fast.roofline_terms(ints, ints.decode_time) is None) == (type(ints._flop_rate) is not float)


def test_kvsched_pure_python_switches_the_module_off():
    code = "import kvsched.sim.replica as r; print(r._fast is None)"
    env = {**os.environ, "KVSCHED_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _small_row_chunks(m, chunk: int, piece: int) -> None:
    """Row logs that spill every `chunk` rows, and compiled runs that fill arrays of `piece`
    rows: their seams, which a real run reaches after 65,536 and 8,192 rows, come often."""
    from kvsched.sim import rowlog
    m.setattr(rowlog, "CHUNK", chunk)
    m.setattr(rowlog, "PIECE", piece)
    m.setattr(replica, "CHUNK", chunk)


@needs_fast
@pytest.mark.parametrize("chunk,piece", [(64, 16), (100, 7), (1 << 16, 1 << 13)])
@pytest.mark.parametrize("name,kw", [("vllm-v1", {}), ("sarathi", dict(kv_capacity=6_000)),
                                     ("vllm-v1", dict(replicas=2, router="least-kv")),
                                     ("orca", dict(prefill_replicas=1, decode_replicas=2))])
def test_compiled_rows_are_the_appended_rows(chunk, piece, name, kw, monkeypatch):
    with monkeypatch.context() as m:
        _small_row_chunks(m, chunk, piece)
        compiled, pure = both(monkeypatch, workload(300, 20.0, 8), name, **kw)
    assert compiled == pure


@needs_fast
def test_compiled_out_files_are_the_pure_python_files(tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from kvsched.cli import app
    args = ["simulate", "--num-requests", "400", "--rate", "30", "--record-batches", "--policy", "sarathi"]
    files = {}
    for mode in ("compiled", "pure"):
        with monkeypatch.context() as m:
            _small_row_chunks(m, 64, 16)
            if mode == "pure":
                m.setattr(replica, "_fast", None)
            r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / mode)])
            assert r.exit_code == 0, r.output
        files[mode] = {f.name: f.read_bytes() for f in (tmp_path / mode).iterdir() if f.suffix == ".csv"}
    assert set(files["pure"]) == {"requests.csv", "timeline.csv", "batches.csv"}
    assert files["compiled"] == files["pure"]


@needs_fast
@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(["append", "odd", "big", "write", "check", "read"]), max_size=60),
       st.integers(1, 9), st.integers(2, 20))
def test_a_rowlog_keeps_its_rows_in_order_through_compiled_writes(ops, piece, chunk):
    """RowLog written as the compiled run writes it (`_fast.sink_rows`: the appended rows moved
    into its array first where they read back the same), mixed with appends (some with an int in
    the float column, or an int past int64: those stay tuples), spills and reads, gives what a
    RowLog given the same rows by `append` gives: the same rows, in order, of the same types,
    with as many on disk."""
    from kvsched.sim import rowlog
    old = rowlog.CHUNK, rowlog.PIECE
    rowlog.CHUNK, rowlog.PIECE = chunk, piece
    try:
        log, plain = rowlog.RowLog(rowlog.TIMELINE.kinds), rowlog.RowLog(rowlog.TIMELINE.kinds)
        big = False
        for k, op in enumerate(ops):
            if op in ("append", "odd", "big"):
                row = (k if op == "odd" else k + 0.5, k, 0, 2**70 if op == "big" else -k)
                big = big or op == "big"
                log.append(row)
                plain.append(row)
            elif op == "write":
                rows = [(k + j / 4, -k, j, 2 ** 40) for j in range(k % 3 + 1)]
                _fast.sink_rows(log, rowlog.TIMELINE.kinds, rows)
                for row in rows:
                    plain.append(row)
            elif op == "check" and not big:         # an int past int64 cannot spill (either way)
                log.check()
                plain.check()
            elif op == "read" and not big:
                got, want = list(log), list(plain)
                assert [tuple(map(type, r)) for r in got] == [tuple(map(type, r)) for r in want] and got == want
                assert log._spilled == plain._spilled
                if want:
                    assert log[len(want) // 2] == want[len(want) // 2] and log[-1] == want[-1]
        got, want = _in_memory(log), _in_memory(plain)     # (list() would spill: not with a big int)
        assert got == want and [tuple(map(type, r)) for r in got] == [tuple(map(type, r)) for r in want]
        assert log._spilled == plain._spilled
    finally:
        rowlog.CHUNK, rowlog.PIECE = old


def _in_memory(log) -> list[tuple]:
    return [row for part in log._parts() for row in (part.tolist() if isinstance(part, np.ndarray) else part)]


class Watching:
    """vllm-v1 with an `on_finish` hook (no batch hook, so decode runs stay inline) that
    records what the view shows at every finish."""
    name = "watching"
    decodes_when_idle = True

    def __init__(self) -> None:
        from kvsched.policies import make_policy
        self.inner = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
        self.seen: list = []

    def schedule(self, v):
        return self.inner.schedule(v)

    def on_finish(self, i, v):
        self.seen.append((i, v.now, v.iterations, v.kv_used_blocks, v.num_decoding, len(v.running),
                          v.mean_batch_time, tuple(v.recent_batch_times)[-3:]))


@needs_fast
@pytest.mark.parametrize("caching", [False, True])
def test_a_finish_hook_sees_the_same_view_compiled(caching, monkeypatch):
    from kvsched.run import Scenario, simulate
    w = workload(300, 15.0, 9)

    def run():
        p = Watching()
        simulate(Scenario(w, gpu="a100-80gb", model="llama-2-7b", prefix_caching=caching), p)
        return p.seen
    seen = twice(monkeypatch, run)
    assert len(seen[0]) == 300 and seen[0] == seen[1]


@needs_fast
def test_compiled_runs_with_a_fractional_kv_bytes_model_and_numpy_ints(monkeypatch):
    import dataclasses
    from kvsched import hardware
    odd = dataclasses.replace(hardware.get_model("llama-2-7b"), name="odd-7b", dtype_bytes=1.5)
    monkeypatch.setitem(hardware.MODELS, "odd-7b", odd)
    w = workload(200, 20.0, 10)
    assert type(RooflineCost(odd, get_gpu("a100-80gb"))._kv_bytes) is float
    assert len(set(both(monkeypatch, w, "vllm-v1", model="odd-7b"))) == 1
    assert len(set(both(monkeypatch, w, "sarathi", block_size=np.int64(16), kv_capacity=np.int64(9_000)))) == 1
    assert both(monkeypatch, w, "sarathi", block_size=np.int64(16))[0] == both(monkeypatch, w, "sarathi")[0]


def test_a_batch_ending_past_the_largest_float_is_an_error(monkeypatch):
    from kvsched.errors import KvschedError
    from kvsched.run import Scenario, simulate
    def run():
        sc = Scenario(workload(20, 5.0, 1), gpu="a100-80gb", model="llama-2-7b", cost_params={"overhead": 1e308})
        with pytest.raises(KvschedError, match="ends beyond the largest time a float holds"):
            simulate(sc, Watching())
    twice(monkeypatch, run)


@needs_fast
def test_replicas_beyond_64_bit_counts_run_the_pure_python_code():
    from kvsched.kvcache import PagedKV
    from kvsched.sim.requests import RequestTable
    cost = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    w = workload(5, 1.0, 0)
    for tokens, fast in ((2**40, True), (2**62, False)):
        kv = PagedKV(tokens, 16)
        rep = replica.Replica(RequestTable(w, 16, kv.capacity_blocks), Watching(), cost, kv)
        assert (rep._fast is not None, rep._roof is not None) == (fast, fast)


@needs_fast
def test_the_module_records_every_mirrored_file_and_any_edit_is_seen(tmp_path, monkeypatch):
    """The module is used only while the .pyx and every Python file it mirrors are as built."""
    recorded = compiled.parse_sources(_fast.SOURCES)
    assert sorted(recorded) == sorted(compiled.MIRRORS) and compiled.changed(recorded) == []
    assert compiled.load() is _fast
    for rel in compiled.MIRRORS:                # an edit to any one of them is found, by name
        copy = tmp_path / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes((compiled.PACKAGE / rel).read_bytes())
    assert compiled.changed(recorded, tmp_path) == []
    for rel in compiled.MIRRORS:
        original = (tmp_path / rel).read_bytes()
        (tmp_path / rel).write_bytes(original + b"\n")
        assert compiled.changed(recorded, tmp_path) == [rel]
        (tmp_path / rel).write_bytes(original)
    (tmp_path / "cost/roofline.py").unlink()
    assert compiled.changed(recorded, tmp_path) == ["cost/roofline.py"]
    monkeypatch.setattr(compiled, "PACKAGE", tmp_path)
    with pytest.warns(UserWarning, match=r"kvsched/cost/roofline\.py: running the pure-Python code"):
        assert compiled.load() is None
    monkeypatch.setattr(compiled, "PACKAGE", compiled.PACKAGE)
    monkeypatch.setenv("KVSCHED_PURE_PYTHON", "1")
    assert compiled.load() is None


def test_every_module_the_compiled_code_depends_on_is_mirrored():
    """A module the .pyx, the replica or the baselines import may hold logic the .pyx copies (the
    view's free-block count, for one): it is in MIRRORS, so an edit to it is seen, or it is
    named in NOT_MIRRORED with the reason."""
    import re
    imported = set()
    for rel in ("sim/_fast.pyx", "sim/replica.py", "policies/baselines.py"):
        text = (compiled.PACKAGE / rel).read_text()
        for module in re.findall(r"^\s*from kvsched((?:\.\w+)+) import", text, re.M):
            imported.add(module.strip(".").replace(".", "/") + ".py")
        for module in re.findall(r"^\s*from kvsched\.(\w+) import (\w+)", text, re.M):
            if (compiled.PACKAGE / module[0] / f"{module[1]}.py").is_file():      # from kvsched.sim import x
                imported.add(f"{module[0]}/{module[1]}.py")
    imported = {m for m in imported if (compiled.PACKAGE / m).is_file()}
    assert "sim/view.py" in imported and "cost/roofline.py" in imported
    assert imported <= set(compiled.MIRRORS) | set(compiled.NOT_MIRRORED), imported - set(compiled.MIRRORS)


RUN = ("import json, sys; from kvsched.run import Scenario, simulate; from kvsched.workload import Jitter, synthetic\n"
       "r = simulate(Scenario(synthetic(Jitter(512), Jitter(256), rate=20.0, n=400, seed=3)), 'vllm-v1')\n"
       "from kvsched.sim import replica\n"
       "print(json.dumps([replica._fast is not None, r.summary['mean_ttft_ms'], r.summary['mean_itl_ms'], "
       "r.summary['duration']]))")


def run_copy(root, pure: bool) -> tuple[list, str]:
    """RUN on the kvsched package copied under `root`: (whether it ran compiled, its figures, its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(root), "KVSCHED_PURE_PYTHON": "1" if pure else ""}
    p = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, cwd=root, check=True)
    fast, *figures = json.loads(p.stdout)
    return fast, figures, p.stderr


EDITS = {   # a cost model's formula and a built-in policy's budget, changed in place after the build
    "cost/roofline.py": ("return self.overhead + ", "return 2 * self.overhead + ", 2),
    "policies/baselines.py": ("budget = self.max_num_batched_tokens - nd", "budget = self.max_num_batched_tokens // 16 - nd", 2),
}


@needs_fast
@pytest.mark.parametrize("rel", sorted(EDITS))
def test_an_edited_mirrored_file_runs_as_edited_with_a_warning(tmp_path, rel):
    """As in an editable install: a cost model or a policy changed in place after the build
    takes effect at the next run. The copy's compiled module must not run the old code: the
    results are the edited pure-Python ones."""
    import kvsched
    root = tmp_path / "site"
    shutil.copytree(Path(kvsched.__file__).parent, root / "kvsched", ignore=shutil.ignore_patterns("__pycache__"))
    fast, before, err = run_copy(root, pure=False)
    assert fast and "pure-Python" not in err and before == run_copy(root, pure=True)[1]
    source = root / "kvsched" / rel
    old, new, count = EDITS[rel]
    text = source.read_text()
    assert text.count(old) == count
    source.write_text(text.replace(old, new))
    fast, after, err = run_copy(root, pure=False)
    assert not fast and f"kvsched/{rel}: running the pure-Python code" in err and "pip install" in err
    assert after != before and after == run_copy(root, pure=True)[1]


def test_tier_slos_are_positive_float_seconds():
    from kvsched.errors import KvschedError
    from kvsched.workload.request import Tier
    assert Tier("a", tbt_slo=1).tbt_slo == 1.0 and type(Tier("a", tbt_slo=1).tbt_slo) is float
    for bad in (0, -1.0, "0.1", True, float("nan"), float("inf"), 10**400):
        with pytest.raises(KvschedError, match="must be a positive finite number of seconds"):
            Tier("a", tbt_slo=bad)


@needs_fast
def test_a_huge_kv_bytes_context_takes_python_s_exact_ints(monkeypatch):
    """kv_bytes * context past 2**62 (a model whose KV bytes per token are huge): those batch
    times come from Python's exact ints, as in the pure run."""
    import dataclasses
    from kvsched import hardware
    huge = dataclasses.replace(hardware.get_model("llama-2-7b"), name="huge-kv", layers=2**40)
    monkeypatch.setitem(hardware.MODELS, "huge-kv", huge)
    cost = RooflineCost(huge, get_gpu("a100-80gb"))
    assert _fast.roofline_terms(cost, cost.decode_time) is not None and cost._kv_bytes > 2**50
    compiled, pure = both(monkeypatch, workload(60, 30.0, 2), "vllm-v1", model="huge-kv", kv_capacity=200_000)
    assert compiled == pure


class Reading:
    """A policy without hooks (so finishes take `finish_due`) whose `schedule` records what the
    view shows of the engine's counters and records; `seen` is compared compiled and pure."""
    name = "reading"
    decodes_when_idle = True

    def __init__(self, inner: str = "vllm-v1") -> None:
        from kvsched.policies import make_policy
        self.inner = make_policy(inner, {}, get_gpu("a100-80gb"))
        self.seen: list = []

    def schedule(self, v):
        fin = tuple(v.recent_finished)[-2:]
        self.seen.append((v.now, v.iterations, v.kv_used_blocks, v.num_decoding, v.num_waiting, len(v.running), v.in_flight,
                          v.decode_new_blocks, fin, tuple(v.recent_batch_times)[-2:],
                          [(v.generated(i), v.kv_tokens(i)) for i in list(v.running)[:4]]))
        return self.inner.schedule(v)


@needs_fast
@pytest.mark.parametrize("kw", [{}, dict(prefix_caching=True, kv_capacity=8_000),
                                dict(replicas=2, router="least-outstanding")])
def test_a_policy_reads_the_same_engine_state_compiled(kw, monkeypatch):
    from kvsched.run import Scenario, simulate
    w = workload(300, 25.0, 11)

    def run():
        p = Reading()
        r = simulate(Scenario(w, gpu="a100-80gb", model="llama-2-7b", **kw), p)
        return p.seen, r.summary["completed"], r.records.finished.tolist()
    seen = twice(monkeypatch, run)
    assert seen[0] == seen[1] and len(seen[0][0]) > 100


@needs_fast
def test_sessions_run_the_same_compiled(monkeypatch):
    from test_prefix_workloads import session_workload
    w = session_workload(n=200)
    assert w.has_sessions
    for kw in ({}, dict(replicas=2, router="least-outstanding"), dict(prefix_caching=True)):
        compiled, pure = both(monkeypatch, w, "vllm-v1", **kw)
        assert compiled == pure


class NumpyChunks:
    """sarathi with its chunk sizes as numpy ints: the engine keeps Python numbers, so compiled
    and pure runs agree in type too."""
    name = "numpy-chunks"
    decodes_when_idle = True

    def __init__(self) -> None:
        from kvsched.policies import make_policy
        self.inner = make_policy("sarathi", {}, get_gpu("a100-80gb"))

    def schedule(self, v):
        plan = self.inner.schedule(v)
        plan.chunks = [(i, np.int64(c)) for i, c in plan.chunks]
        return plan


@needs_fast
def test_numpy_numbers_from_a_policy_leave_no_numpy_state(monkeypatch):
    import hashlib
    import pickle
    from kvsched.run import Scenario, simulate
    w = workload(200, 20.0, 12)

    def run():
        r = simulate(Scenario(w, gpu="a100-80gb", model="llama-2-7b"), NumpyChunks(),
                     record_timeline=True, record_batches=True)
        rows = list(r.timeline) + list(r.batches)
        assert {type(x) for row in rows for x in row} == {float, int}
        summary = {k: v for k, v in r.summary.items() if k != "wall_seconds"}
        assert all(type(v) is not np.float64 for v in summary.values())
        return hashlib.sha256(pickle.dumps((sorted(summary.items(), key=str), rows))).hexdigest()
    blobs = twice(monkeypatch, run)
    assert blobs[0] == blobs[1]


@needs_fast
@settings(max_examples=300, deadline=None)
@given(pt=st.integers(0, 5_000), chunks=st.integers(0, 4), nd=st.integers(0, 600), dctx=st.integers(0, 2_000_000),
       pctx=st.integers(0, 100_000), frac=st.booleans(), model=st.sampled_from(["llama-2-7b", "qwen2-7b", "qwen3-0.6b"]),
       gpu=st.sampled_from(["a100-80gb", "h100-sxm", "a30"]))
def test_batch_time_is_the_roofline_s_time(pt, chunks, nd, dctx, pctx, frac, model, gpu):
    """`batch_time` (what `_execute` takes for a dense roofline) is `RooflineCost.time` of the
    same BatchShape bit for bit: int query-key pairs (0, no prefill) or float ones, an int or
    a fractional kv_bytes."""
    from kvsched.cost.shape import BatchShape
    cost = RooflineCost(get_model(model), get_gpu(gpu))
    if frac:
        object.__setattr__(cost, "_kv_bytes", cost._kv_bytes * 0.37)
    pattn = 0 if not pt else pt * (pctx / 3 + (pt + 1) / 2)
    terms = _fast.roofline_terms(cost, cost.decode_time)
    got = _fast.batch_time(terms, pt, pattn, pctx, nd, dctx)
    want = cost.time(BatchShape(pt, chunks, pattn, pctx, nd, dctx, (), False))
    assert type(got) is float and got == want


@needs_fast
@settings(max_examples=300, deadline=None)
@given(ctx=st.integers(2**53, 2**61), kv_bytes=st.sampled_from([3, 511, 4096, 524_288]), pattn=st.integers(0, 2**40),
       pt=st.integers(0, 2**40), nd=st.integers(0, 2**40))
def test_batch_time_is_exact_past_float_s_53_bits(ctx, kv_bytes, pattn, pt, nd):
    """Contexts past 2**53 with a small int kv_bytes: Python multiplies the ints exactly and
    rounds once; so must C (a float product would round twice). An int `pattn` too."""
    from kvsched.cost.shape import BatchShape
    cost = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    object.__setattr__(cost, "_kv_bytes", kv_bytes)
    for term in ("_gemm_flops", "_attn_flops"):         # the memory time decides (else compute hides it)
        object.__setattr__(cost, term, getattr(cost, term) * 1e-6)
    terms = _fast.roofline_terms(cost, cost.decode_time)
    got = _fast.batch_time(terms, pt, pattn, ctx // 3, nd, ctx - ctx // 3)
    want = cost.time(BatchShape(pt, 1, pattn, ctx // 3, nd, ctx - ctx // 3, (), False))
    if ctx * kv_bytes >= 2**62:
        assert got is None
    else:
        assert type(got) is float and got == want


@needs_fast
def test_batch_time_leaves_what_c_cannot_hold_exactly_to_the_cost_model():
    cost = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    terms = _fast.roofline_terms(cost, cost.decode_time)
    assert _fast.batch_time(terms, 1, 1.5, 1, 0, 2**62) is None          # past LIMIT
    assert _fast.batch_time(terms, 1, 1.5, 2**61, 0, 2**61 - 1) is None  # kv_bytes * context past 64 bits
    assert _fast.batch_time(terms, 1, np.float64(1.5), 1, 0, 1) is None  # a numpy number: the Python code's types
    assert _fast.batch_time(terms, -1, 1.5, 1, 0, 1) is None
    assert _fast.batch_time(terms, 2**64, 1.5, 1, 0, 1) is None
    assert _fast.batch_time(terms, 1, 1.5, 1, 0, -2**70) is None
    assert _fast.batch_time(terms, np.int64(1), 1.5, 1, 0, 1) is None
    assert _fast.batch_time(terms, 1, "1.5", 1, 0, 1) is None
    with pytest.raises(TypeError):
        _fast.finish_due(object(), object(), 1.0, None)     # a replica's Tables, never None
    shadowed = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    object.__setattr__(shadowed, "time", lambda shape: 1.0)              # its own `time`: not the roofline's
    assert _fast.roofline_terms(shadowed, shadowed.decode_time) is None


@needs_fast
@pytest.mark.parametrize("method", ["time", "decode_time"])
def test_a_patched_roofline_class_is_asked_not_compiled(method, monkeypatch):
    """A RooflineCost method patched on the class (before the run) is what both paths call."""
    orig = getattr(RooflineCost, method)
    monkeypatch.setattr(RooflineCost, method, lambda self, *a: 1.5 * orig(self, *a))
    cost = RooflineCost(get_model("llama-2-7b"), get_gpu("a100-80gb"))
    assert _fast.roofline_terms(cost, cost.decode_time) is None
    assert len(set(both(monkeypatch, workload(150, 20.0, 2), "vllm-v1"))) == 1


@needs_fast
@pytest.mark.parametrize("name", ["vllm-v1", "sarathi"])
def test_compiled_runs_with_shared_prefixes_are_the_pure_python_runs(name, monkeypatch):
    """Keyed prompts: the cache is not inert, so a decode run frees finishes through the cache's
    own order and its allocations may evict cached blocks (a small pool)."""
    from kvsched.workload.request import Ragged, Segments
    g = np.random.default_rng(11)
    n = 300
    prompts = g.integers(40, 600, n)
    shared = np.minimum(g.choice([0, 64, 160], n), prompts - 1)
    segments = [[(int(s) % 7, int(s)), (100 + i, int(p - s))] if s else [(100 + i, int(p))]
                for i, (p, s) in enumerate(zip(prompts, shared))]
    off = np.concatenate(([0], np.cumsum([len(x) for x in segments]))).astype(np.int64)
    seg = Segments(Ragged(np.array([k for x in segments for k, _ in x], np.int64), off),
                   Ragged(np.array([t for x in segments for _, t in x], np.int64), off))
    w = Workload.build(np.cumsum(g.exponential(1 / 25.0, n)), prompts, g.integers(1, 250, n), segments=seg)
    for kv in (None, 6_000):
        compiled, pure = both(monkeypatch, w, name, prefix_caching=True, kv_capacity=kv)
        assert compiled == pure


# ----- a baseline's batch planned and run compiled (admit_step) --------------------------
# The runs above wrap the policies (their `schedule` is not the class's own), so they never
# take admit_step; these run the built-in classes themselves.

class Counted:
    """The compiled module with admit_step's answers counted."""

    def __init__(self) -> None:
        self.taken = self.declined = 0

    def __getattr__(self, name: str):
        return getattr(_fast, name)

    def admit_step(self, *args) -> bool:
        done = _fast.admit_step(*args)
        self.taken += done
        self.declined += not done
        return done


def real_runs(monkeypatch, w: Workload, name: str, params: dict, **kw) -> tuple[str, str, Counted]:
    """Fingerprints of a run of the built-in policy compiled and in pure Python, and the
    compiled run's admit_step counts."""
    gpu = get_gpu("a100-80gb")
    counted = Counted()
    with monkeypatch.context() as m:
        m.setattr(replica, "_fast", counted)
        compiled = policy_fingerprint(w, make_policy(name, dict(params), gpu), **kw)[0]
        m.setattr(replica, "_fast", None)
        pure = policy_fingerprint(w, make_policy(name, dict(params), gpu), **kw)[0]
    return compiled, pure, counted


def short_and_long(n: int, rate: float, seed: int) -> Workload:
    """Prompts from 1 to 3,000 tokens (chunked by small budgets), outputs from 1 (done at the
    first token) to 400."""
    g = np.random.default_rng(seed)
    return Workload.build(np.cumsum(g.exponential(1 / rate, n)), g.integers(1, 3000, n),
                          np.where(g.random(n) < 0.1, 1, g.integers(1, 400, n)))


@needs_fast
@pytest.mark.parametrize("name", ["vllm-v1", "sarathi"])
def test_a_baseline_s_batches_are_planned_compiled_and_exact(name, monkeypatch):
    compiled, pure, counted = real_runs(monkeypatch, workload(400, 20.0, 1), name, {})
    assert compiled == pure
    assert counted.taken > 150 and counted.taken > 5 * counted.declined


@needs_fast
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rate=st.floats(1.0, 80.0), caching=st.booleans(),
       kv=st.sampled_from([None, 2_000, 6_000]), bs=st.sampled_from([1, 16]),
       tokens=st.sampled_from([64, 700, 8192]), seqs=st.sampled_from([2, 16, 64]),
       cap=st.sampled_from([0, 100]), whole=st.booleans())
def test_vllm_v1_batches_compiled_are_exact(seed, rate, caching, kv, bs, tokens, seqs, cap, whole, monkeypatch):
    params = dict(max_num_batched_tokens=tokens, max_num_seqs=seqs, long_prefill_token_threshold=cap,
                  reserve_full_prompt=whole)
    compiled, pure, counted = real_runs(monkeypatch, short_and_long(80, rate, seed), "vllm-v1", params,
                                        prefix_caching=caching, kv_capacity=kv, block_size=bs)
    assert compiled == pure
    assert counted.taken


@needs_fast
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rate=st.floats(1.0, 80.0), caching=st.booleans(),
       kv=st.sampled_from([None, 2_000, 6_000]), bs=st.sampled_from([1, 16]),
       size=st.sampled_from([32, 256, 512]), seqs=st.sampled_from([2, 16, 32]),
       watermark=st.sampled_from([0.0, 0.05]), order=st.sampled_from(["fcfs", "spf"]))
def test_sarathi_batches_compiled_are_exact(seed, rate, caching, kv, bs, size, seqs, watermark, order, monkeypatch):
    params = dict(chunk_size=size, max_num_seqs=seqs, watermark=watermark, order=order)
    compiled, pure, counted = real_runs(monkeypatch, short_and_long(80, rate, seed), "sarathi", params,
                                        prefix_caching=caching, kv_capacity=kv, block_size=bs)
    assert compiled == pure
    assert bool(counted.taken) == (order == "fcfs")     # shortest-prompt-first is planned by the policy


@needs_fast
def test_only_a_baseline_s_own_schedule_is_compiled():
    gpu = get_gpu("a100-80gb")
    v1 = make_policy("vllm-v1", {}, gpu)
    assert replica._compiled_plan(v1, v1.schedule) == _fast.VLLM_V1
    sarathi = make_policy("sarathi", {}, gpu)
    assert replica._compiled_plan(sarathi, sarathi.schedule) == _fast.SARATHI

    class Sub(VllmV1):
        pass
    sub = Sub(max_num_batched_tokens=2048, max_num_seqs=64)
    assert replica._compiled_plan(sub, sub.schedule) == 0                  # a subclass may change anything
    assert replica._compiled_plan(v1, sarathi.schedule) == 0               # another object's schedule
    assert replica._compiled_plan(v1, lambda v: VllmV1.schedule(v1, v)) == 0


@needs_fast
def test_a_patched_helper_of_the_baselines_is_asked_not_compiled(monkeypatch):
    from kvsched.policies import baselines
    v1 = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
    for name in ("make_room", "admit_reserving"):
        with monkeypatch.context() as m:
            m.setattr(baselines, name, lambda *a, **k: None)
            assert replica._compiled_plan(v1, v1.schedule) == 0
    assert replica._compiled_plan(v1, v1.schedule) == _fast.VLLM_V1


@needs_fast
@pytest.mark.parametrize("watermark", [float("inf"), float("nan")])
def test_a_watermark_python_cannot_use_fails_as_in_python(watermark, monkeypatch):
    """Set past its checks: the policy's own error (a PlanError naming it), compiled too."""
    from kvsched.errors import PlanError
    errors = []
    for fast in (_fast, None):
        monkeypatch.setattr(replica, "_fast", fast)
        p = make_policy("sarathi", {}, get_gpu("a100-80gb"))
        p.watermark = watermark
        with pytest.raises(PlanError) as e:
            policy_fingerprint(workload(60, 30.0, 3), p)
        errors.append(str(e.value).split(" at t=")[0])
    assert errors[0] == errors[1]


@needs_fast
@pytest.mark.parametrize("name,attr", [("sarathi", "chunk_size"), ("vllm-v1", "max_num_batched_tokens")])
@pytest.mark.parametrize("below", [1, 2, 3])
def test_a_token_budget_cut_below_the_decoders_mid_run_is_planned_as_python_plans_it(name, attr, below,
                                                                                      monkeypatch):
    """A policy's budget set mid-run (its checks bypassed) to `below` fewer tokens than the
    replica has decoders leaves a negative rest: no value of it may read as the compiled
    plan's decline or error (a rest of -2 once did: "error return without exception set")."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server
    gpu, model = get_gpu("a100-80gb"), get_model("llama-2-7b")
    runs = []
    for fast in (_fast, None):
        monkeypatch.setattr(replica, "_fast", fast)
        policy = make_policy(name, {}, gpu)
        server = Server(short_and_long(3000, 40.0, 5), policy, RooflineCost(model, gpu), PagedKV(40_000, 16),
                        record_timeline=True, record_batches=True)

        full = getattr(policy, attr)

        def cut(done: int, remaining: int) -> None:     # called every 4,096 steps: cut, restore, ...
            cutting = getattr(policy, attr) == full
            setattr(policy, attr, max(1, server.replica._decoders.n - below) if cutting else full)
        r = server.run(cut)
        runs.append((r.first_token.tolist(), r.finished.tolist(), list(server.replica.timeline)))
    assert runs[0] == runs[1]
