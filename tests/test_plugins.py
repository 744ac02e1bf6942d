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


EXITS = textwrap.dedent('''
    import sys
    from dataclasses import dataclass, field
    from kvsched.policies import Plan

    class ExitCtor:
        name = "exit-ctor"

        def __init__(self):
            sys.exit(3)

        def schedule(self, v):
            return Plan()

    @dataclass
    class Union:
        name = "union"
        k: int | None = field(default=None, metadata={"range": "[1, 10]"})

        def schedule(self, v):
            chunks = [(i, v.prefill_target(i) - v.prefill_done(i)) for i in v.prefilling]
            return Plan(list(v.waiting), chunks + [(i, v.prefill_target(i)) for i in v.waiting], True, [])

    @dataclass
    class RaisesInPost:
        name = "raises"
        k: int = 1

        def __post_init__(self):
            raise RuntimeError("bad k")

        def schedule(self, v):
            return Plan()
''')


def test_user_code_that_exits_or_raises_anything_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "users.py").write_text(EXITS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "exits_on_import", raising=False)
    one_line_error([*RUN, "--policy", "exits_on_import:X"], "importing module 'exits_on_import' raised SystemExit")
    one_line_error([*RUN, "--policy", "users.py:ExitCtor"], "policy users.py:ExitCtor: SystemExit: 3")
    one_line_error([*RUN, "--policy", "users.py:RaisesInPost", "--set", "k=2"], "RuntimeError: bad k")
    s = _summary([*RUN, "--policy", "users.py:Union", "--set", "k=3"])       # `int | None` as a type, not a string
    assert s["policy"] == "union"
    one_line_error([*RUN, "--policy", "users.py:Union", "--set", "k=11"], "k=11 is outside its range [1, 10]")


DC_ROUTER = textwrap.dedent('''
    from dataclasses import dataclass, field

    @dataclass
    class Share:
        seed: int = 0
        share: float = field(default=0.5, metadata={"range": "[0, 1]"})
        name = "share"
        uses_state = False

        def route(self, i, t, replicas):
            return 0 if (i * self.share) % 1 < 0.5 else replicas - 1
''')


def test_router_set_ranges_finiteness_and_replicas(tmp_path):
    (tmp_path / "r.py").write_text(DC_ROUTER)
    (tmp_path / "plain.py").write_text(ROUTER)
    spec = f"{tmp_path}/r.py:Share"
    assert _summary([*RUN, "--replicas", "2", "--router", spec, "--router-set", "share=0.25"])["completed"] == 60
    one_line_error([*RUN, "--replicas", "2", "--router", spec, "--router-set", "share=5"],
                   "share=5.0 is outside its range [0, 1]")
    one_line_error([*RUN, "--replicas", "2", "--router", f"{tmp_path}/plain.py:Second", "--router-set", "to=inf"],
                   "to='inf' is not a valid int")
    one_line_error([*RUN, "--replicas", "2", "--router", "prefix-affinity", "--router-set", "w_kv=inf"],
                   "w_kv=inf must be a finite number")
    one_line_error([*RUN, "--router", "prefix-affinity", "--router-set", "w_kv=1"],
                   "--router-set sets the router's parameters: it needs --replicas 2 or more")


def test_compare_refuses_names_that_cannot_key_it(tmp_path):
    (tmp_path / "p.py").write_text(POLICY)
    (tmp_path / "q.py").write_text(POLICY.replace('name = "shortest-first"', 'name = "../escaped"'))
    args = ["compare", "--num-requests", "30", "--json", "--policies"]
    one_line_error([*args, f"{tmp_path}/p.py:ShortestFirst,{tmp_path}/q.py:ShortestFirst,vllm-v1"],
                   "a policy named '../escaped' cannot key the comparison")
    (tmp_path / "q2.py").write_text(POLICY)              # (a file is loaded once per process)
    one_line_error([*args, f"{tmp_path}/p.py:ShortestFirst,{tmp_path}/q2.py:ShortestFirst"],
                   "two policies are named 'shortest-first'")
    one_line_error([*args, "vllm-v1,nope"], "--policies: unknown policy 'nope'")


def test_a_resumed_sweep_runs_again_a_point_whose_policy_file_was_edited(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.py").write_text(POLICY)
    args = ["sweep", "--policies", "p.py:ShortestFirst", "--rates", "5", "--num-requests", "20", "--out", "s",
            "--json"]

    def ran():                                       # points found done already
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["skipped"]
    assert ran() == 0 and ran() == 1                 # the second run finds the point done
    (tmp_path / "p.py").write_text(POLICY.replace("[:4]", "[:3]"))
    assert ran() == 0                                # edited: a new point


COSTS = textwrap.dedent('''
    import sys

    class Raises:
        def time(self, shape):
            if shape.decode_seqs and not shape.prefill_tokens:
                raise ZeroDivisionError("my cost model divided by zero")
            return 0.05

    class Exits:
        def time(self, shape):
            if shape.decode_seqs and not shape.prefill_tokens:
                sys.exit(0)
            return 0.05
''')


def test_a_user_cost_model_that_raises_or_exits_is_named_in_one_line(tmp_path):
    (tmp_path / "c.py").write_text(COSTS)
    one_line_error([*RUN, "--cost", f"{tmp_path}/c.py:Raises"],
                   "cost model Raises raised ZeroDivisionError at t=")
    one_line_error([*RUN, "--cost", f"{tmp_path}/c.py:Exits"], "cost model Exits raised SystemExit")


def test_router_set_with_pools_of_one_is_refused_and_optional_annotations_convert(tmp_path):
    one_line_error([*RUN, "--prefill-replicas", "1", "--decode-replicas", "1", "--router", "prefix-affinity",
                    "--router-set", "w_kv=5"], "needs --replicas 2 or more, or a prefill or decode pool of 2")
    (tmp_path / "o.py").write_text(ROUTER.replace("to: int = 1", "to: Optional[int] = 1")
                                   .replace("class Second:", "from typing import Optional\n\n\nclass Second:"))
    s = _summary([*RUN, "--replicas", "3", "--router", f"{tmp_path}/o.py:Second", "--router-set", "to=1"])
    assert {row["replica"]: row["completed"] for row in s["replica_breakdown"]} == {0: 0, 1: 60, 2: 0}
