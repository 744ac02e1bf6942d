"""The runs tests/test_compiled.py makes twice: in the test process (the compiled modules of
kvsched.compiled.COMPILED, where built) and in a process of its own with KVSCHED_PURE_PYTHON=1
(every module from its .py file). `fingerprints()` runs every scenario and gives its name ->
a fingerprint of everything the run reports (summary, per-request records, timeline and batch
rows, what a policy or hook saw, an error's message): both processes must give the same
strings. Every workload and random case is drawn from fixed seeds, so both build the same."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvsched.errors import KvschedError, PlanError
from kvsched.hardware import get_gpu, get_model
from kvsched.policies import POLICIES, make_policy
from kvsched.run import Scenario, simulate
from kvsched.workload.request import Ragged, Segments, Workload
from test_fast_paths import STEADY, Fast, workload
from test_properties import POLICY_PARAMS

SCENARIOS: dict[str, Callable[[], str]] = {}
UNEXPECTED = "UNEXPECTED "          # a scenario that raised where it should not (both sides may)


def scenario(name: str):
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        assert name not in SCENARIOS, name
        SCENARIOS[name] = fn
        return fn
    return register


def fingerprints(names: list[str] | None = None) -> dict[str, str]:
    """name -> fingerprint of every scenario (or of `names`)."""
    out = {}
    for name in SCENARIOS if names is None else names:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*can never be served")
                out[name] = SCENARIOS[name]()
        except Exception as e:          # one scenario's failure names it, the others still run
            out[name] = f"{UNEXPECTED}{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out


# ----- fingerprints ----------------------------------------------------------------------

def canon(x: Any) -> str:
    """A text of `x` that is equal for equal values of equal types, bit for bit: floats by
    repr (which round-trips), numpy arrays by dtype, shape and bytes, scalars with their type."""
    t = type(x)
    if t in (list, tuple):
        return ("[" if t is list else "(") + ",".join(canon(y) for y in x) + ("]" if t is list else ")")
    if t is dict:
        return "{" + ",".join(f"{canon(k)}:{canon(v)}" for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
    if t in (set, frozenset):
        return "set{" + ",".join(sorted(canon(y) for y in x)) + "}"
    if t is np.ndarray:
        return f"nd<{x.dtype.str}{x.shape}:{hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]}>"
    if t in (int, float, bool, str, type(None)):
        return repr(x) if t in (int, str) or x is None else f"{t.__name__}:{x!r}"
    return f"{t.__module__}.{t.__qualname__}:{x!r}"


def short(x: Any) -> str:
    return hashlib.sha256(canon(x).encode()).hexdigest()[:16]


RECORD_FIELDS = ("arrival", "admitted", "first_token", "finished", "itl_max", "tbt_violations", "preemptions",
                 "recomputed", "rejected", "replica", "decode_replica", "transfer", "tier_index")
RECORD_COUNTERS = ("iterations", "kv_capacity_tokens", "kv_time_integral", "kv_peak_tokens", "peak_queue", "busy_time")


def result_print(r) -> str:
    """Parts of a run's result, each `name=hash`, so that a mismatch names what differs."""
    rec = r.records
    summary = {k: v for k, v in r.summary.items() if k != "wall_seconds"}
    parts = {"summary": summary, "timeline": list(r.timeline), "batches": list(r.batches),
             "counters": [getattr(rec, k) for k in RECORD_COUNTERS],
             "itl": (list(rec.itl.counts), rec.itl.n, rec.itl.total, rec.itl.max),
             "tier_itl": None if rec.tier_itl is None else [(list(h.counts), h.n, h.total, h.max) for h in rec.tier_itl],
             "replica_stats": rec.replica_stats}
    parts.update((k, getattr(rec, k)) for k in RECORD_FIELDS)
    return " ".join(f"{k}={short(v)}" for k, v in parts.items()) + f" iterations={rec.iterations}"


def run_print(w: Workload, policy, params: dict | None = None, **kw) -> str:
    """A run with every record on (llama-2-7b on an A100 unless `kw` says otherwise)."""
    kw.setdefault("model", "llama-2-7b")
    kw.setdefault("gpu", "a100-80gb")
    if isinstance(policy, str):
        policy = make_policy(policy, dict(params or {}), get_gpu(kw["gpu"]))
    r = simulate(Scenario(w, **kw), policy, record_timeline=True, record_batches=True)
    return result_print(r)


def steady(w: Workload, name: str, **kw) -> str:
    """A built-in policy wrapped as test_fast_paths runs it (decodes_when_idle)."""
    return run_print(w, Fast(name), **kw)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).split(' at t=')[0]}"


@contextlib.contextmanager
def patched(obj, **values):
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def extra_model(name: str, **changes):
    """A model `name` (llama-2-7b with `changes`) in kvsched.hardware.MODELS while it runs."""
    from kvsched import hardware
    changes = {"kv_token_bytes": None, **changes}     # KV from the shape (and the changed dtype)
    hardware.MODELS[name] = dataclasses.replace(hardware.get_model("llama-2-7b"), name=name, **changes)
    try:
        yield
    finally:
        del hardware.MODELS[name]


# ----- workloads -------------------------------------------------------------------------

def short_and_long(n: int, rate: float, seed: int) -> Workload:
    """Prompts from 1 to 3,000 tokens (chunked by small budgets), outputs from 1 (done at the
    first token) to 400."""
    g = np.random.default_rng(seed)
    return Workload.build(np.cumsum(g.exponential(1 / rate, n)), g.integers(1, 3000, n),
                          np.where(g.random(n) < 0.1, 1, g.integers(1, 400, n)))


def shared_prefixes(n: int = 300, seed: int = 11) -> Workload:
    """Keyed prompts, some sharing a first segment of 64 or 160 tokens (7 keys)."""
    g = np.random.default_rng(seed)
    prompts = g.integers(40, 600, n)
    shared = np.minimum(g.choice([0, 64, 160], n), prompts - 1)
    segments = [[(int(s) % 7, int(s)), (100 + i, int(p - s))] if s else [(100 + i, int(p))]
                for i, (p, s) in enumerate(zip(prompts, shared))]
    off = np.concatenate(([0], np.cumsum([len(x) for x in segments]))).astype(np.int64)
    seg = Segments(Ragged(np.array([k for x in segments for k, _ in x], np.int64), off),
                   Ragged(np.array([t for x in segments for _, t in x], np.int64), off))
    return Workload.build(np.cumsum(g.exponential(1 / 25.0, n)), prompts, g.integers(1, 250, n), segments=seg)


def closed_loop() -> Workload:
    g = np.random.default_rng(4)
    return Workload.build(np.zeros(200), g.integers(1, 600, 200), g.integers(1, 200, 200),
                          concurrency=np.full(200, 8))


# ----- every STEADY policy, caching on and off, a small KV pool -------------------------

for _name in STEADY:
    for _caching in (False, True):
        for _kv in (None, 12_000):
            scenario(f"steady/{_name}/caching={_caching}/kv={_kv}")(
                lambda n=_name, c=_caching, kv=_kv: steady(workload(400, 20.0, 1), n, prefix_caching=c, kv_capacity=kv))


# ----- the built-in classes themselves (their own `schedule`, compiled with baselines.py) -

for _name in STEADY:
    for _caching in (False, True):
        scenario(f"builtin/{_name}/caching={_caching}/kv=9000")(
            lambda n=_name, c=_caching: run_print(short_and_long(300, 20.0, 1), n, prefix_caching=c,
                                                 kv_capacity=9_000))


SMALL_PARAMS = POLICY_PARAMS      # tests/test_properties.py's small limits, so that budgets, seats and gates bind

DEFAULT_PARAMS = {"nested-wait": {"segments": "60,240,1000"}}     # it needs segments or typed requests


def every_policy(name: str, small: bool, caching: bool) -> str:
    g = np.random.default_rng(21)
    n = 250
    w = Workload.build(np.cumsum(g.exponential(1 / 15.0, n)), g.integers(1, 900, n), g.integers(1, 250, n),
                       output_known=name in ("wait", "nested-wait"))
    pools = dict(prefill_replicas=1, decode_replicas=2) if name == "distserve" else {}
    params = SMALL_PARAMS[name] if small else DEFAULT_PARAMS.get(name, {})
    return run_print(w, name, params, kv_capacity=7_000, prefix_caching=caching, **pools)


for _name in sorted(POLICIES):
    for _small in (False, True):
        for _caching in (False, True):
            scenario(f"policy/{_name}/{'small' if _small else 'default'}/caching={_caching}")(
                lambda n=_name, s=_small, c=_caching: every_policy(n, s, c))


# ----- other cost models (their BatchShape from the compiled cost/shape.py) --------------

for _cost, _params in (("constant", {}), ("linear", {}), ("phase", {"switch_s": 0.003}), ("tiled", {})):
    scenario(f"cost/{_cost}")(lambda c=_cost, p=_params: run_print(
        workload(300, 20.0, 13), "sarathi", cost=c, cost_params=dict(p), kv_capacity=8_000))


# ----- tiers, clusters, a closed loop, disaggregated pools -------------------------------

scenario("tiers/sarathi")(lambda: steady(workload(300, 15.0, 3, tiers=True), "sarathi"))
scenario("tiers/vllm-v1/kv=6000")(lambda: run_print(workload(300, 15.0, 3, tiers=True), "vllm-v1", kv_capacity=6_000))
for _router in ("least-kv", "least-outstanding", "round-robin"):
    scenario(f"cluster/{_router}")(lambda r=_router: steady(workload(600, 60.0, 2), "vllm-v1", replicas=3, router=r,
                                                            kv_capacity=15_000))
scenario("closed-loop/vllm-v1")(lambda: steady(closed_loop(), "vllm-v1"))
scenario("closed-loop/sarathi/kv=5000")(lambda: run_print(closed_loop(), "sarathi", kv_capacity=5_000))
scenario("disaggregated/vllm-v1")(lambda: steady(workload(300, 10.0, 5), "vllm-v1", prefill_replicas=1,
                                                 decode_replicas=2))
scenario("disaggregated/sarathi/kv=8000")(lambda: run_print(workload(300, 10.0, 5), "sarathi", prefill_replicas=1,
                                                            decode_replicas=2, kv_capacity=8_000))


# ----- swap preemption to a host tier (sim/host_swap.py) ---------------------------------

for _name in ("vllm-v1", "vllm-v0", "sarathi"):
    for _gb in (0.05, 50):
        for _caching in (False, True):
            scenario(f"swap/{_name}/host={_gb}/caching={_caching}")(lambda n=_name, g=_gb, c=_caching: run_print(
                workload(300, 15.0, 7), n, kv_capacity=3_000, prefix_caching=c, preemption="swap",
                kv_tiers=(f"host:{g}:16:0.0001",)))
scenario("swap/closed-loop/vllm-v1")(lambda: run_print(closed_loop(), "vllm-v1", kv_capacity=3_000, preemption="swap",
                                                       kv_tiers=("host:1:8:0.0001",)))


# ----- the prefix cache's tiers below the GPU (sim/kv_tiers.py) ---------------------------

for _name in ("vllm-v1", "vllm-v0", "sarathi"):
    for _tiers in (("host:0.2:16:0.0001",), ("host:0.05:16", "disk:0.3:2:0.001", "remote:1:1:0.002")):
        for _write in ("evict", "through"):
            scenario(f"tiers/{_name}/{len(_tiers)}-tiers/{_write}")(lambda n=_name, t=_tiers, wr=_write: run_print(
                shared_prefixes(), n, prefix_caching=True, kv_capacity=4_000, kv_tiers=t, kv_write=wr,
                replicas=2 if len(t) > 1 else 1))
scenario("tiers/disaggregated/remote")(lambda: run_print(
    shared_prefixes(), "vllm-v1", prefix_caching=True, kv_capacity=4_000, kv_tiers=("remote:1:0.5:0.002",),
    kv_write="through", prefill_replicas=2, decode_replicas=1))
scenario("tiers/node-shared-host/through")(lambda: run_print(
    shared_prefixes(), "vllm-v1", prefix_caching=True, kv_capacity=4_000, kv_tiers=("host:0.1:16:0.0001",),
    kv_write="through", replicas=2, gpus_per_node=2))
scenario("tiers/eb/written-only")(lambda: run_print(
    shared_prefixes(), "eb", prefix_caching=True, kv_capacity=4_000, kv_tiers=("host:0.2:16:0.0001",)))


# ----- shared prefixes: the prefix cache is not inert -----------------------------------

for _name in ("vllm-v1", "sarathi"):
    for _kv in (None, 6_000):
        scenario(f"shared-prefixes/{_name}/kv={_kv}")(
            lambda n=_name, kv=_kv: steady(shared_prefixes(), n, prefix_caching=True, kv_capacity=kv))
        scenario(f"shared-prefixes/builtin-{_name}/kv={_kv}")(
            lambda n=_name, kv=_kv: run_print(shared_prefixes(), n, prefix_caching=True, kv_capacity=kv))


# ----- sessions --------------------------------------------------------------------------

def sessions(**kw) -> str:
    from test_prefix_workloads import session_workload
    w = session_workload(n=200)
    assert w.has_sessions
    return steady(w, "vllm-v1", **kw)


scenario("sessions/one-replica")(lambda: sessions())
scenario("sessions/least-outstanding")(lambda: sessions(replicas=2, router="least-outstanding"))
scenario("sessions/caching")(lambda: sessions(prefix_caching=True))


# ----- what a policy's hooks and schedule see --------------------------------------------

class Watching:
    """vllm-v1 with an `on_finish` hook (no batch hook, so decode runs stay inline) that
    records what the view shows at every finish."""
    name = "watching"
    decodes_when_idle = True

    def __init__(self) -> None:
        self.inner = make_policy("vllm-v1", {}, get_gpu("a100-80gb"))
        self.seen: list = []

    def schedule(self, v):
        return self.inner.schedule(v)

    def on_finish(self, i, v):
        self.seen.append((i, v.now, v.iterations, v.kv_used_blocks, v.num_decoding, len(v.running),
                          v.mean_batch_time, tuple(v.recent_batch_times)[-3:]))


def watching(caching: bool) -> str:
    p = Watching()
    simulate(Scenario(workload(300, 15.0, 9), gpu="a100-80gb", model="llama-2-7b", prefix_caching=caching), p)
    return f"finishes={len(p.seen)} seen={short(p.seen)}"


for _caching in (False, True):
    scenario(f"finish-hook/caching={_caching}")(lambda c=_caching: watching(c))


class Reading:
    """A policy without hooks whose `schedule` records what the view shows of the engine's
    counters and records."""
    name = "reading"
    decodes_when_idle = True

    def __init__(self, inner: str = "vllm-v1") -> None:
        self.inner = make_policy(inner, {}, get_gpu("a100-80gb"))
        self.seen: list = []

    def schedule(self, v):
        fin = tuple(v.recent_finished)[-2:]
        self.seen.append((v.now, v.iterations, v.kv_used_blocks, v.num_decoding, v.num_waiting, len(v.running),
                          v.in_flight, v.decode_new_blocks, fin, tuple(v.recent_batch_times)[-2:],
                          [(v.generated(i), v.kv_tokens(i)) for i in list(v.running)[:4]]))
        return self.inner.schedule(v)


def reading(**kw) -> str:
    p = Reading()
    r = simulate(Scenario(workload(300, 25.0, 11), gpu="a100-80gb", model="llama-2-7b", **kw), p)
    return f"plans={len(p.seen)} seen={short(p.seen)} completed={r.summary['completed']} " \
           f"finished={short(r.records.finished)}"


scenario("reading/one-replica")(lambda: reading())
scenario("reading/caching-kv=8000")(lambda: reading(prefix_caching=True, kv_capacity=8_000))
scenario("reading/least-outstanding")(lambda: reading(replicas=2, router="least-outstanding"))


class NumpyChunks:
    """sarathi with its chunk sizes as numpy ints: the engine keeps Python numbers."""
    name = "numpy-chunks"
    decodes_when_idle = True

    def __init__(self) -> None:
        self.inner = make_policy("sarathi", {}, get_gpu("a100-80gb"))

    def schedule(self, v):
        plan = self.inner.schedule(v)
        plan.chunks = [(i, np.int64(c)) for i, c in plan.chunks]
        return plan


@scenario("numpy-chunks")
def numpy_chunks() -> str:
    r = simulate(Scenario(workload(200, 20.0, 12), gpu="a100-80gb", model="llama-2-7b"), NumpyChunks(),
                 record_timeline=True, record_batches=True)
    rows = list(r.timeline) + list(r.batches)
    row_types = sorted({type(x).__name__ for row in rows for x in row})
    summary_types = sorted({type(v).__name__ for k, v in r.summary.items() if k != "wall_seconds"})
    return f"row_types={','.join(row_types)} summary_types={','.join(summary_types)} {result_print(r)}"


# ----- odd numbers: a fractional kv-bytes model, numpy ints, huge KV bytes ---------------

@scenario("fractional-kv-bytes")
def fractional_kv_bytes() -> str:
    from kvsched.cost.roofline import RooflineCost
    with extra_model("odd-7b", dtype_bytes=1.5):
        kv_bytes = RooflineCost(get_model("odd-7b"), get_gpu("a100-80gb"))._kv_bytes
        return f"kv_bytes={canon(kv_bytes)} {run_print(workload(200, 20.0, 10), 'vllm-v1', model='odd-7b')}"


scenario("numpy-ints/block-and-kv")(lambda: run_print(workload(200, 20.0, 10), Fast("sarathi"),
                                                      block_size=np.int64(16), kv_capacity=np.int64(9_000)))
scenario("numpy-ints/block")(lambda: run_print(workload(200, 20.0, 10), Fast("sarathi"), block_size=np.int64(16)))
scenario("numpy-ints/none")(lambda: run_print(workload(200, 20.0, 10), Fast("sarathi")))


@scenario("huge-kv-bytes")
def huge_kv_bytes() -> str:
    """kv_bytes * context past 2**62 (a model whose KV bytes per token are huge)."""
    from kvsched.cost.roofline import RooflineCost
    with extra_model("huge-kv", layers=2 ** 40):
        kv_bytes = RooflineCost(get_model("huge-kv"), get_gpu("a100-80gb"))._kv_bytes
        assert kv_bytes > 2 ** 50
        return f"kv_bytes={canon(kv_bytes)} {steady(workload(60, 30.0, 2), 'vllm-v1', model='huge-kv', kv_capacity=200_000)}"


# ----- row logs that spill often (their seams come after 64 or 100 rows, not 65,536) -----

@contextlib.contextmanager
def small_row_chunks(chunk: int, piece: int):
    from kvsched.sim import batch, decode_run, rowlog
    with patched(rowlog, CHUNK=chunk, PIECE=piece), patched(batch, CHUNK=chunk), patched(decode_run, CHUNK=chunk):
        yield


ROW_RUNS = {"vllm-v1": ("vllm-v1", {}), "sarathi-kv=6000": ("sarathi", dict(kv_capacity=6_000)),
            "vllm-v1-least-kv": ("vllm-v1", dict(replicas=2, router="least-kv")),
            "orca-disaggregated": ("orca", dict(prefill_replicas=1, decode_replicas=2))}
for _chunk, _piece in ((64, 16), (100, 7)):
    for _key, (_name, _kw) in ROW_RUNS.items():
        def _rows(c=_chunk, p=_piece, n=_name, kw=_kw) -> str:
            with small_row_chunks(c, p):
                return steady(workload(300, 20.0, 8), n, **kw)
        scenario(f"rows/chunk={_chunk}-piece={_piece}/{_key}")(_rows)


@scenario("out-files")
def out_files() -> str:
    """`kvsched simulate --out` (small row chunks): the CSV files' bytes."""
    from typer.testing import CliRunner
    from kvsched.cli import app
    with tempfile.TemporaryDirectory() as tmp, small_row_chunks(64, 16):
        out = Path(tmp) / "out"
        r = CliRunner().invoke(app, ["simulate", "--num-requests", "400", "--rate", "30", "--record-batches",
                                     "--policy", "sarathi", "--out", str(out)])
        if r.exit_code:
            raise RuntimeError(f"exit code {r.exit_code}: {r.output}")
        files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted(out.iterdir())
                 if f.suffix == ".csv"}
    return " ".join(f"{k}={v}" for k, v in files.items())


# ----- errors: the same in both -----------------------------------------------------------

@scenario("error/batch-past-the-largest-float")
def batch_past_the_largest_float() -> str:
    sc = Scenario(workload(20, 5.0, 1), gpu="a100-80gb", model="llama-2-7b", cost_params={"overhead": 1e308})
    try:
        simulate(sc, Watching())
    except KvschedError as e:
        return error_text(e)
    return "no error"


for _watermark in ("inf", "nan"):
    @scenario(f"error/sarathi-watermark={_watermark}")
    def _watermark_run(w=float(_watermark)) -> str:
        """A watermark set past its checks: the policy's own error (a PlanError naming it)."""
        p = make_policy("sarathi", {}, get_gpu("a100-80gb"))
        p.watermark = w
        try:
            run_print(workload(60, 30.0, 3), p)
        except PlanError as e:
            return error_text(e)
        return "no error"


def budget_cut(name: str, attr: str, below: int) -> str:
    """A policy's budget set mid-run (its checks bypassed) to `below` fewer tokens than the
    replica has decoders (every 4,096 steps: cut, restore, ...): a negative rest."""
    from kvsched.cost.roofline import RooflineCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server
    gpu, model = get_gpu("a100-80gb"), get_model("llama-2-7b")
    policy = make_policy(name, {}, gpu)
    server = Server(short_and_long(3000, 40.0, 5), policy, RooflineCost(model, gpu), PagedKV(40_000, 16),
                    record_timeline=True, record_batches=True)
    full = getattr(policy, attr)
    cuts = []

    def cut(done: int, remaining: int) -> None:
        cutting = getattr(policy, attr) == full
        setattr(policy, attr, max(1, server.replica._decoders.n - below) if cutting else full)
        cuts.append(getattr(policy, attr))
    r = server.run(cut)
    return f"cuts={cuts} first_token={short(r.first_token)} finished={short(r.finished)} " \
           f"timeline={short(list(server.replica.timeline))} batches={short(list(server.replica.batches))}"


for _name, _attr in (("sarathi", "chunk_size"), ("vllm-v1", "max_num_batched_tokens")):
    for _below in (1, 2, 3):
        scenario(f"budget-cut/{_name}/below={_below}")(lambda n=_name, a=_attr, b=_below: budget_cut(n, a, b))


# ----- seeded random cases (the same list in every process) -------------------------------

def random_cases(count: int = 12, seed: int = 2024) -> list[dict]:
    g = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        cases.append(dict(seed=int(g.integers(0, 10_000)), rate=float(g.uniform(0.5, 80.0)),
                          caching=bool(g.integers(0, 2)), name=STEADY[int(g.integers(0, len(STEADY)))],
                          kv=[None, 3_000, 8_000][int(g.integers(0, 3))], bs=[1, 16][int(g.integers(0, 2))],
                          model=["llama-2-7b", "qwen2-7b"][int(g.integers(0, 2))]))
    return cases


for _k, _c in enumerate(random_cases()):
    scenario(f"random/{_k}/{_c['name']}/caching={_c['caching']}/kv={_c['kv']}/bs={_c['bs']}/{_c['model']}")(
        lambda c=_c: steady(workload(120, c["rate"], c["seed"]), c["name"], prefix_caching=c["caching"],
                            kv_capacity=c["kv"], block_size=c["bs"], model=c["model"]))


def random_builtin_cases(count: int = 6, seed: int = 7) -> list[tuple[str, dict, dict, int, float]]:
    """vllm-v1 and sarathi, the classes themselves, with random limits: (name, params, scenario
    fields, workload seed, rate)."""
    g = np.random.default_rng(seed)
    pick = lambda options: options[int(g.integers(0, len(options)))]    # noqa: E731
    cases = []
    for _ in range(count):
        fields = dict(prefix_caching=bool(g.integers(0, 2)), kv_capacity=pick([None, 2_000, 6_000]),
                      block_size=pick([1, 16]))
        cases.append(("vllm-v1", dict(max_num_batched_tokens=pick([64, 700, 8192]), max_num_seqs=pick([2, 16, 64]),
                                      long_prefill_token_threshold=pick([0, 100]),
                                      reserve_full_prompt=bool(g.integers(0, 2))),
                      fields, int(g.integers(0, 10_000)), float(g.uniform(1.0, 80.0))))
        fields = dict(prefix_caching=bool(g.integers(0, 2)), kv_capacity=pick([None, 2_000, 6_000]),
                      block_size=pick([1, 16]))
        cases.append(("sarathi", dict(chunk_size=pick([32, 256, 512]), max_num_seqs=pick([2, 16, 32]),
                                      watermark=pick([0.0, 0.05]), order=pick(["fcfs", "spf"])),
                      fields, int(g.integers(0, 10_000)), float(g.uniform(1.0, 80.0))))
    return cases


for _k, (_name, _params, _fields, _seed, _rate) in enumerate(random_builtin_cases()):
    scenario(f"random-builtin/{_k}/{_name}")(
        lambda n=_name, p=_params, f=_fields, s=_seed, r=_rate: run_print(short_and_long(80, r, s), n, p, **f))


@scenario("error/kv-capacity-past-64-bit-counts")
def kv_capacity_past_64_bit_counts() -> str:
    """kvsched.kvcache.TOKEN_LIMIT: a pool the compiled code's 64-bit counts could not hold is
    refused (interpreted too: both runs are one program)."""
    from kvsched.kvcache import TOKEN_LIMIT
    try:
        run_print(workload(5, 1.0, 0), "vllm-v1", kv_capacity=TOKEN_LIMIT)
    except KvschedError as e:
        return error_text(e)
    return "no error"


scenario("kv-capacity-just-below-the-limit")(lambda: run_print(
    workload(40, 10.0, 0), "vllm-v1", kv_capacity=(1 << 62) - 16))
