"""kvsched policies inside the real vLLM engine (CPU build, a random-weight tiny Llama built
here), and plan errors inside vLLM's scheduler. Skipped when vLLM is not installed."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvsched.engines.vllm_replay import Limits, vllm_steps  # noqa: E402
from kvsched.errors import PlanError  # noqa: E402
from kvsched.policies.base import Plan  # noqa: E402
from kvsched.workload.source import WorkloadOptions, load  # noqa: E402

LIMITS = Limits(256, 16, num_gpu_blocks=200, block_size=32, max_model_len=2048)   # CPU attention: blocks of 32


def workload(n=40, rate=50.0, seed=1):
    return load(WorkloadOptions(num_requests=n, rate=rate, prompt_len="uniform:20:300", output_len="uniform:5:40",
                                seed=seed))


def read_log(path):
    with open(path) as f:
        return [{k: (v if k == "chunks" else float(v)) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """One workload through the real engine, with vllm-v1 and with EB inside it."""
    from kvsched.engines.vllm_engine import ServeOptions, build_random_model, run_real
    d = tmp_path_factory.mktemp("real")
    model = build_random_model(d / "tiny-llama")
    w = workload()
    runs = {}
    for policy in ("vllm-v1", "eb"):
        log = d / f"{policy}.csv"
        summary = run_real(w, model, ServeOptions(LIMITS, policy=policy, step_log=log))
        runs[policy] = (summary, read_log(log))
    return w, runs


def test_eb_inside_the_real_engine_never_mixes(real_runs):
    w, runs = real_runs
    for policy, (summary, log) in runs.items():
        assert summary["completed"] == len(w) and summary["total_output"] == int(w.output.sum())
    mixed = {p: sum(1 for r in log if r["prefill_tokens"] and r["decodes"]) for p, (_, log) in runs.items()}
    assert mixed["eb"] == 0
    assert mixed["vllm-v1"] > 0             # the same workload does mix under vLLM's own policy


def test_the_step_log_counts_every_token(real_runs):
    """Without preemption (the KV holds every request), each prompt is prefilled once and each
    later token decoded once; each row's shape adds up."""
    w, runs = real_runs
    for _, log in runs.values():
        assert sum(r["prefill_tokens"] for r in log) == int(w.prompt.sum())
        assert sum(r["decodes"] for r in log) == int((w.output - 1).sum())
        for r in log:
            assert r["tokens"] == r["prefill_tokens"] + r["decodes"] and r["seconds"] > 0
            pairs = [tuple(map(int, c.split(":"))) for c in r["chunks"].split()]
            assert len(pairs) == r["prefill_chunks"] and sum(c for _, c in pairs) == r["prefill_tokens"]
            assert r["prefill_ctx"] == sum(p + c for p, c in pairs)


class _Bad:
    """A policy that makes one kind of illegal plan on its first call."""
    name = "bad"

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def schedule(self, v):
        if not v.waiting:
            return Plan()
        if self.kind == "decode-waiting":
            return Plan(decode=[v.waiting[0]])
        if self.kind == "too-much-kv":                  # admit everyone, prefill them whole
            return Plan(admit=list(v.waiting), chunks=[(i, v.prefill_target(i)) for i in v.waiting])
        return Plan(admit=[v.waiting[0]], chunks=[(v.waiting[0], 10**6)])


def _simulated_error(w, policy, limits: Limits) -> str:
    from kvsched.cost import ConstantCost
    from kvsched.kvcache import PagedKV
    from kvsched.sim.server import Server
    with pytest.raises(PlanError) as e:
        Server(w, policy, ConstantCost(0.01), PagedKV((limits.num_gpu_blocks - 1) * limits.block_size,
                                                      limits.block_size), max_model_len=limits.max_model_len).run()
    return str(e.value)


@pytest.mark.parametrize("kind", ["decode-waiting", "too-much-kv", "chunk-too-long"])
def test_invalid_plans_fail_inside_vllm_as_in_simulation(kind):
    from kvsched.engines.vllm_scheduler import KvschedScheduler

    class BadInside(KvschedScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.policy = _Bad(kind)

    limits = Limits(4096, 64, num_gpu_blocks=20, block_size=16)
    w = load(WorkloadOptions(num_requests=8, rate=1e6, prompt_len="uniform:60:100", output_len="uniform:1:5", seed=3))
    expected = _simulated_error(w, _Bad(kind), limits)
    with pytest.raises(PlanError) as e:
        vllm_steps(w, limits, 0.01, scheduler_cls=BadInside)
    assert str(e.value) == expected


def test_async_adapter_matches_vllms_async_scheduler(monkeypatch):
    """KvschedAsyncScheduler with vllm-v1 makes AsyncScheduler's batches (stepped in lock-step
    here; the engine overlaps them on GPUs)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvsched.engines.vllm_replay import compare
    from kvsched.engines.vllm_scheduler import KvschedAsyncScheduler
    limits = Limits(256, 16, num_gpu_blocks=60, block_size=16)
    monkeypatch.setenv("KVSCHED_POLICY", "vllm-v1")
    monkeypatch.setenv("KVSCHED_POLICY_PARAMS", '{"max_num_batched_tokens": 256, "max_num_seqs": 16}')
    w = load(WorkloadOptions(num_requests=60, rate=50.0, prompt_len="uniform:10:300", output_len="uniform:1:60",
                             seed=2))
    a = compare(vllm_steps(w, limits, 0.01, scheduler_cls=KvschedAsyncScheduler, async_scheduling=True),
                vllm_steps(w, limits, 0.01, scheduler_cls=AsyncScheduler, async_scheduling=True), w.prompt)
    assert a.steps > 100 and a.steps_differing == 0, a.first_difference
    assert a.preemptions["vllm"] > 0


def test_the_wrong_adapter_class_is_refused():
    from kvsched.engines.vllm_scheduler import KvschedScheduler
    from kvsched.errors import KvschedError
    with pytest.raises(KvschedError, match="KvschedAsyncScheduler"):
        vllm_steps(workload(4), Limits(256, 16, num_gpu_blocks=200), 0.01, scheduler_cls=KvschedScheduler,
                   async_scheduling=True)


def test_a_plan_over_the_engines_token_budget_is_refused():
    """vLLM sizes its buffers to max_num_batched_tokens; simulation has no such limit, so this
    check is the adapter's own."""
    from kvsched.engines.vllm_scheduler import KvschedScheduler

    class Whole(KvschedScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.policy = _Bad("too-much-kv")

    w = load(WorkloadOptions(num_requests=4, rate=1e6, prompt_len="uniform:60:100", output_len="fixed:2", seed=3))
    with pytest.raises(PlanError, match="max_num_batched_tokens is 64"):
        vllm_steps(w, Limits(64, 64, num_gpu_blocks=200, block_size=16), 0.01, scheduler_cls=Whole)


def test_calibrate_fits_the_real_step_log(real_runs, tmp_path):
    """`kvsched calibrate` on the real engine's step logs (EB's pure phases and vllm-v1's mixed
    steps), then the cost file drives a simulation of the same workload."""
    import json

    from typer.testing import CliRunner

    from kvsched.cli import app
    w, runs = real_runs
    joined = tmp_path / "steps.csv"
    header = list(runs["eb"][1][0])
    with joined.open("w", newline="") as f:
        out = csv.DictWriter(f, header)
        out.writeheader()
        for _, log in runs.values():
            out.writerows(log)
    r = CliRunner().invoke(app, ["calibrate", str(joined), "--json", "--out", str(tmp_path / "cost.json")])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    phase = res["models"]["phase"]
    assert set(res["kinds"]) == {"prefill", "decode", "mixed"} and min(res["kinds"].values()) > 0
    assert not phase["fallbacks"] and phase["errors"]["all"]["median"] < 0.5
    assert res["models"]["roofline"]["skipped"]                     # no catalogue hardware for a CPU
    r = CliRunner().invoke(app, ["simulate", "--num-requests", "40", "--rate", "50", "--prompt-len", "uniform:20:300",
                                 "--output-len", "uniform:5:40", "--seed", "1", "--kv-capacity", str(199 * 32),
                                 "--block-size", "32", "--max-model-len", "2048", "--cost", str(tmp_path / "cost.json"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["completed"] == len(w)


def test_a_plan_vllm_cannot_follow_is_counted():
    """vLLM splits the budget by its own rule (running first, then FCFS, each as much as fits):
    a plan giving the first request a short chunk and the second a long one comes out otherwise,
    and the adapter counts it rather than pass it silently."""
    from kvsched.engines.vllm_scheduler import KvschedScheduler
    seen = []

    class Uneven:
        name = "uneven"

        def schedule(self, v):
            if len(v.waiting) < 2:                          # then: everything, whole
                todo = [*v.prefilling, *v.waiting]
                return Plan(admit=list(v.waiting), chunks=[(i, v.prefill_target(i) - v.prefill_done(i)) for i in todo],
                            decode=True)
            a, b = v.waiting[:2]
            return Plan(admit=[a, b], chunks=[(a, 10), (b, 50)], decode=True)

    class Inside(KvschedScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.policy = Uneven()
            seen.append(self)

    w = load(WorkloadOptions(num_requests=2, rate=1e6, prompt_len="fixed:100", output_len="fixed:3", seed=3))
    w.arrival[:] = 0.0                                      # both wait at the first step
    with pytest.warns(UserWarning, match="other tokens per request than the plan"):
        vllm_steps(w, Limits(4096, 64, num_gpu_blocks=200, block_size=16), 0.01, scheduler_cls=Inside)
    assert seen[0].departures >= 1


def test_plan_fields_given_as_iterators_are_applied_as_given(monkeypatch):
    """A generator `decode` or `chunks` is read once: the adapter must not consume it in its
    checks and then apply an empty plan (the simulator reads it once too)."""
    from kvsched.engines.vllm_replay import compare, engine_policy, kvsched_steps
    from kvsched.engines.vllm_scheduler import KvschedScheduler

    class Iterating:
        name = "eb"

        def __init__(self):
            self.inner = engine_policy("eb", {}, 256, 16)

        def schedule(self, v):
            p = self.inner.schedule(v)
            decode = p.decode if isinstance(p.decode, bool) else iter(list(p.decode))
            return Plan(iter(p.admit), iter(p.chunks), decode, iter(p.preempt))

    class Inside(KvschedScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.policy = Iterating()

    limits = Limits(256, 16, num_gpu_blocks=60, block_size=16)
    w = workload(60, seed=2)
    a = compare(vllm_steps(w, limits, 0.01, scheduler_cls=Inside), kvsched_steps(w, "eb", {}, limits, 0.01), w.prompt)
    assert a.steps > 100 and a.steps_differing == 0, a.first_difference
