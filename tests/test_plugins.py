"""Users' own policies and routers by name (kvsched/plugins.py): MODULE:CLASS, FILE.py:CLASS and
installed plugins' entry points, without editing the package; --router-set."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import one_line_error, runner
from kvsched.cli import app
from kvsched.errors import KvschedError
from kvsched.sim.routers import make_router

POLICY = textwrap.dedent('''
    from kvsched.policies import Plan


    class ShortestFirst:
        """Admit the shortest prompt that fits; decode everyone."""
        name = "shortest-first"

        def schedule(self, v):
            admit, chunks = [], []
            free = v.kv_free_blocks - v.decode_new_blocks
            for i in sorted(v.waiting, key=v.prompt_len)[:4]:
                need = v.blocks_for(v.prefill_target(i))
                if need <= free:
                    admit.append(i); chunks.append((i, v.prefill_target(i))); free -= need
            return Plan(admit, chunks, decode=True)
''')

ROUTER = textwrap.dedent('''
    class Second:
        """Every request to replica `to` (a parameter)."""
        name, uses_state = "second", False

        def __init__(self, seed: int = 0, to: int = 1) -> None:
            self.to = to

        def route(self, i, t, replicas):
            return self.to
''')

RUN = ["simulate", "--num-requests", "60", "--json"]


def _summary(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_a_policy_from_a_file_outside_the_package_runs(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(POLICY)
    s = _summary([*RUN, "--policy", f"{path}:ShortestFirst"])
    assert s["policy"] == "shortest-first" and s["completed"] == 60


def test_a_policy_module_in_the_working_folder_runs(tmp_path, monkeypatch):
    (tmp_path / "file_module.py").write_text(POLICY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "file_module", raising=False)
    s = _summary([*RUN, "--policy", "file_module:ShortestFirst"])
    assert s["policy"] == "shortest-first" and s["completed"] == 60
    assert str(tmp_path) not in sys.path            # the working folder was searched, not kept


def test_an_edited_policy_file_takes_effect_at_the_next_run(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text(POLICY)
    cmd = [sys.executable, "-m", "kvsched", *RUN, "--policy", f"{path}:ShortestFirst"]
    before = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tmp_path).stdout)
    path.write_text(POLICY.replace('name = "shortest-first"', 'name = "edited"'))
    after = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tmp_path).stdout)
    assert (before["policy"], after["policy"]) == ("shortest-first", "edited")


def test_an_installed_plugin_runs_by_its_entry_point_name(tmp_path, monkeypatch):
    pkg = tmp_path / "kvplug"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(POLICY)
    dist = tmp_path / "kvplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvsched.policies]\nshortest = kvplug:ShortestFirst\n\n"
                                           "[kvsched.routers]\nbroken = kvplug:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = _summary([*RUN, "--policy", "shortest"])
    assert s["policy"] == "shortest-first"
    one_line_error([*RUN, "--policy", "nonesuch"], "known: vllm-v1")
    one_line_error([*RUN, "--replicas", "2", "--router", "broken"], "failed to load")


@pytest.mark.parametrize("source,spec,needle", [
    (None, "{tmp}/missing.py:X", "is not a file"),
    (POLICY, "{tmp}/p.py:Nope", "has no 'Nope'"),
    (POLICY, "{tmp}/p.py:Plan", "Plan is not a policy class: it needs a schedule() method"),
    ("x = (\n", "{tmp}/p.py:X", "p.py:1 raised SyntaxError"),
    ("import os\n\nraise ValueError('boom')\n", "{tmp}/p.py:X", "p.py:3 raised ValueError: boom"),
    (None, "no_such_module_kv:X", "cannot import module 'no_such_module_kv'"),
    (None, ":X", "expected MODULE:CLASS"),
    (None, "mod:", "expected MODULE:CLASS"),
])
def test_a_bad_policy_spec_is_one_line(tmp_path, source, spec, needle):
    if source is not None:
        (tmp_path / "p.py").write_text(source)
    one_line_error([*RUN, "--policy", spec.format(tmp=tmp_path)], needle)


def test_a_plain_class_takes_no_set_parameters(tmp_path):
    (tmp_path / "p.py").write_text(POLICY)
    one_line_error([*RUN, "--policy", f"{tmp_path}/p.py:ShortestFirst", "--set", "a=1"], "takes no --set parameters")


def test_compare_and_sweep_take_a_policy_spec(tmp_path):
    (tmp_path / "p.py").write_text(POLICY)
    r = runner.invoke(app, ["compare", "--num-requests", "40", "--json", "--policies", f"vllm-v1,{tmp_path}/p.py:ShortestFirst"])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.output)) == {"vllm-v1", "shortest-first"}


def test_a_router_from_a_file_with_parameters(tmp_path):
    (tmp_path / "r.py").write_text(ROUTER)
    s = _summary([*RUN, "--replicas", "3", "--router", f"{tmp_path}/r.py:Second", "--router-set", "to=2"])
    per = {row["replica"]: row["completed"] for row in s["replica_breakdown"]}
    assert per == {0: 0, 1: 0, 2: 60}
    one_line_error([*RUN, "--replicas", "3", "--router", f"{tmp_path}/r.py:Second", "--router-set", "to=x"],
                   "router " + f"{tmp_path}/r.py:Second: to='x' is not a valid int")


def test_router_set_reaches_the_built_in_router():
    r = make_router("prefix-affinity", 0, {"w_affinity": "0", "w_queue": "1.5"})
    assert r.weights == (0.0, 1.5, 2.0)
    for params, needle in [({"w_kv": "-1"}, "w_kv must be a finite number >= 0"),
                           ({"w_kv": "inf"}, "finite"), ({"w_kv": "nan"}, "not a valid float"),
                           ({"nope": "1"}, "has no parameter 'nope' (parameters: w_affinity, w_queue, w_kv)")]:
        with pytest.raises(KvschedError, match="router prefix-affinity"):
            make_router("prefix-affinity", 0, params)
        with pytest.raises(KvschedError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            make_router("prefix-affinity", 0, params)
    one_line_error([*RUN, "--replicas", "2", "--router", "least-kv", "--router-set", "w=1"],
                   "router least-kv has no parameter 'w' (parameters: none)")
    one_line_error([*RUN, "--replicas", "2", "--router-set", "w"], "--router-set expects key=value")
