"""Shared helpers: run a policy on a small workload with every record switched on."""
from __future__ import annotations

from pathlib import Path

import os

import pytest
from hypothesis import HealthCheck, settings
from typer.testing import CliRunner

from kvsched.cli import app

from kvsched.cost import make_cost_model
from kvsched.hardware import get_gpu, get_model
from kvsched.kvcache import PagedKV
from kvsched.policies import make_policy
from kvsched.sim.server import Server

# no deadlines and no too_slow health check: a test's outcome must not depend on how busy the machine is
CALM = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=150, **CALM)
settings.register_profile("ci", max_examples=400, **CALM)
settings.register_profile("deep", max_examples=2000, **CALM)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

runner = CliRunner()


def one_line_error(args, needle):
    """The CLI refuses `args` with one line naming `needle`, exit code 2."""
    r = runner.invoke(app, args)
    assert r.exit_code == 2, (args, r.output)
    err = r.output.strip()
    assert err.count("\n") == 0 and err.startswith("kvsched: error:") and "Traceback" not in err, err
    assert needle in err, err


class Forwarding:
    """Wraps a policy: its optional hooks are passed on."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name

    def _pass(self, hook: str, *args) -> None:
        f = getattr(self.inner, hook, None)      # hooks are optional
        if f is not None:
            f(*args)

    def on_finish(self, i, v) -> None:
        self._pass("on_finish", i, v)

    def on_preempt(self, i, v) -> None:
        self._pass("on_preempt", i, v)


class Checked(Forwarding):
    """Wraps a policy and checks server invariants from per-request state at every step
    (independently of the server's running counters)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.finished: list[int] = []
        self.admission_order: list[int] = []

    def schedule(self, v):
        used = sum(v.blocks_for(v.kv_tokens(i)) for i in v.running)
        assert used == v.kv_used_blocks <= v.kv_capacity_blocks
        for i in v.running:
            if v.is_decoding(i):
                assert v.kv_tokens(i) == v.prompt_len(i) + v.generated(i) - 1
                assert v.generated(i) < v._output[i]
        plan = self.inner.schedule(v)
        self.admission_order.extend(i for i in plan.admit if v._admitted[i] == float("inf"))
        return plan

    def on_finish(self, i, v) -> None:
        assert v.generated(i) == v._output[i]
        self.finished.append(i)
        super().on_finish(i, v)


def run(workload, policy="vllm-v1", params=None, *, cost="constant", cost_params=None,
        kv_tokens=100_000, block_size=1, gpu="a100-80gb", model="llama-3-8b", checked=True,
        strict=False):
    pol = make_policy(policy, params or {}, get_gpu(gpu)) if isinstance(policy, str) else policy
    if checked:
        pol = Checked(pol)
    cm = make_cost_model(cost, cost_params or {}, get_model(model), get_gpu(gpu))
    server = Server(workload, pol, cm, PagedKV(kv_tokens, block_size), max_model_len=None,
                    record_timeline=True, record_batches=True, strict=strict)
    return server, server.run(), pol


@pytest.fixture(scope="session")
def traces_dir(tmp_path_factory) -> Path:
    """The bundled traces (kvsched/data/traces) as plain files in a temporary folder, with their
    README.md, for tests that need a file path; tests of the bundled files name them instead."""
    import shutil
    from kvsched.workload.bundled import DATA, catalogue, open_trace
    folder = tmp_path_factory.mktemp("traces")
    for t in catalogue().values():
        with open_trace(t.path) as f:
            (folder / t.file).write_bytes(f.read())
    shutil.copy(DATA / "README.md", folder / "README.md")
    return folder
