"""`kvsched --help` stays fast: the command-line layer imports typer and tiny modules only
(rich for a table); the engine loads when a command runs (timings: benchmarks/bench_startup.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from kvsched.cli import names

HEAVY = ("kvsched.run", "kvsched.sim", "kvsched.sim.replica", "kvsched.policies", "kvsched.workload", "kvsched.cost",
         "kvsched.theory", "numpy", "scipy")


def _loaded(code: str) -> list[str]:
    """The HEAVY modules in sys.modules after running `code` in a fresh interpreter."""
    script = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stderr.split()      # stderr: stdout carries --help's text


def test_cli_import_leaves_the_engine_unloaded():
    assert _loaded("import kvsched.cli") == []


def test_help_leaves_the_engine_unloaded():
    code = ("from kvsched.cli import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass")
    assert _loaded(code) == []


def test_package_exports_load_lazily():
    assert _loaded("import kvsched") == []
    assert "kvsched.run" in _loaded("from kvsched import Result, Scenario, simulate")
    import kvsched
    import kvsched.run
    assert (kvsched.simulate, kvsched.Scenario, kvsched.Result) == (kvsched.run.simulate, kvsched.run.Scenario,
                                                                    kvsched.run.Result)
    assert set(kvsched.__all__) <= set(dir(kvsched))


def test_names_equal_the_registries():
    """The help texts' copies (kvsched.cli.names) cannot drift from the real registries."""
    from kvsched.cost import COST_MODELS
    from kvsched.cost.calibrate import MODELS
    from kvsched.policies import BASELINES, POLICIES
    from kvsched.sim.replica import DEFAULT_STALL_BATCHES
    from kvsched.sim.routers import ROUTERS
    from kvsched.workload.readers import FORMATS
    from kvsched.workload.source import DEFAULT_LENGTH, DEFAULT_RATE
    assert names.COST_MODELS == tuple(COST_MODELS)
    assert names.CALIBRATION_MODELS == tuple(MODELS)
    assert names.POLICIES == tuple(POLICIES) and names.BASELINES == BASELINES
    assert names.ROUTERS == tuple(ROUTERS)
    assert names.FORMATS == tuple(FORMATS)
    assert (names.DEFAULT_RATE, names.DEFAULT_LENGTH) == (DEFAULT_RATE, DEFAULT_LENGTH)
    assert names.DEFAULT_STALL_BATCHES == DEFAULT_STALL_BATCHES


def test_a_json_run_of_the_adaptive_policies_loads_neither_rich_nor_scipy():
    """A `--json` simulate renders no table (rich loads for tables only), and EB(k*)/EB+
    find theta0 and erfcx without scipy (theory/roots.py, theory.eb.erfcx): each cost a run
    0.05-0.4 s of imports."""
    code = ("import sys\nfrom kvsched.cli import app\n"
            "try:\n    app(['simulate', '--policy', 'eb-adaptive', '--num-requests', '400', '--rate', '20', '--json',"
            " '--set', 'min_samples=30', '--set', 'update_every=20'])\nexcept SystemExit:\n    pass\n"
            "print(' '.join(m for m in ('rich', 'scipy') if m in sys.modules), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(p.stdout)["completed"] == 400      # 19 updates of k* ran
    assert p.stderr.split() == []


def test_the_command_builds_only_the_command_it_runs():
    """`kvsched NAME ...` builds the click command of NAME alone (`cli.only`); a sub-app, an
    unknown name or none builds the whole app, whose errors and help are then click's."""
    from kvsched.cli import app, only
    one = only("simulate")
    assert [c.name for c in one.registered_commands] == ["simulate"] and not one.registered_groups
    assert len(app.registered_commands) > 1 and app.registered_groups       # the app is untouched
    for name in ("theory", "workload", "simulat", None, "--help"):
        assert only(name) is app


def test_the_command_line_runs_as_the_app(tmp_path):
    """`main` (the console script and `python -m kvsched`) gives what `app` gives, output and
    exit code: a command, its help, a usage error, a sub-app and an unknown command."""
    cases = [["simulate", "--num-requests", "5", "--json"], ["simulate", "--help"], ["simulate", "--bogus"],
             ["theory", "stability", "--help"], ["simulat"], ["info"]]
    for args in cases:
        runs = []
        for entry in ("main(args)", "app(args, prog_name='kvsched')"):
            code = (f"import sys\nfrom kvsched.cli import app, main\nargs = {args!r}\n"
                    f"try:\n    {entry}\nexcept SystemExit as e:\n    print('exit', e.code, file=sys.stderr)")
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
            runs.append((re.sub(r'"wall_seconds": [0-9.e-]+', "", p.stdout), p.stderr))   # the one figure that varies
        assert runs[0] == runs[1], args


USER_POLICY = """
from kvsched.policies import Plan
class Mine:
    name = "mine"
    def schedule(self, v):
        return Plan(list(v.waiting)[:1], [(i, v.prefill_target(i)) for i in list(v.waiting)[:1]], decode=True)
"""


def test_the_command_freezes_what_is_left_at_exit_unless_user_code_ran(tmp_path):
    """At exit the objects alive are frozen out of the interpreter's last collection (atexit,
    after the handlers registered later); not when user code ran (its objects may need
    finalizing), and not before the exit (a caller catching SystemExit goes on unfrozen)."""
    (tmp_path / "mine.py").write_text(USER_POLICY)
    for policy, frozen in (("vllm-v1", True), ("mine.py:Mine", False)):
        code = ("import atexit, gc, sys\nfrom kvsched.cli import main\n"
                "atexit.register(lambda: print('at exit', gc.get_freeze_count() > 0, file=sys.stderr))\n"
                f"try:\n    main(['simulate', '--num-requests', '5', '--json', '--policy', {policy!r}])\n"
                "except SystemExit as e:\n    print('after', e.code, gc.get_freeze_count() > 0, file=sys.stderr)\n")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
        lines = p.stderr.splitlines()
        assert lines[-2:] == ["after 0 False", f"at exit {frozen}"], (policy, p.stderr)
