"""The compiled build (kvsched/compiled.py: the modules of COMPILED, compiled by Cython from
their own .py files) gives the interpreted results bit for bit. Compiled and interpreted code
are one module file, so one process holds one of them: the scenarios of compiled_battery.py run
here (compiled where built) and once in a process with KVSCHED_PURE_PYTHON=1 (every .py, as an
install without a C compiler runs), and everything a run reports is compared, per scenario.
Then the guard (an edited .py runs as edited, with a warning) and the `cython` stand-in
(kvsched/cython_shim.py). CI builds the modules (`pip install .`), so there nothing skips."""
from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

import compiled_battery
from compiled_battery import SCENARIOS, UNEXPECTED
from kvsched import compiled
from kvsched import cython_shim as shim
from kvsched.errors import KvschedError

TESTS_DIR = str(Path(__file__).resolve().parent)
SUBPROCESS_TIMEOUT = 600        # a bound against a hung child only: the battery takes ~20 s interpreted


def built(rel: str) -> bool:
    """Whether setup.py left a built module of `rel` beside it."""
    return any((compiled.PACKAGE / (rel[:-3] + suffix)).is_file() for suffix in EXTENSION_SUFFIXES)


@functools.cache
def _interpreted_here() -> frozenset[str]:
    return frozenset(compiled.interpreted(compiled.PACKAGE)[0])


def current(rel: str) -> bool:
    """Built from its sources as they are now, and so are the modules it is compiled against."""
    return built(rel) and rel not in _interpreted_here()


COMPILED_HERE = sorted(n for n in compiled.NAMES if compiled.is_compiled(importlib.import_module(n)))
needs_compiled = pytest.mark.skipif(
    not COMPILED_HERE, reason="no module of kvsched.compiled.COMPILED runs compiled here (not built, or "
    "KVSCHED_PURE_PYTHON set): both sides would be the interpreted code")


def test_ci_builds_the_compiled_modules():
    """Every module of COMPILED imports compiled where it is built from its current .py."""
    if compiled.pure():
        assert not os.environ.get("CI"), "CI runs the tests compiled (.ci/run unsets KVSCHED_PURE_PYTHON)"
        pytest.skip("KVSCHED_PURE_PYTHON is set: every module runs its .py")
    missing = [n for n, rel in compiled.NAMES.items() if not current(rel)]
    if missing:
        assert not os.environ.get("CI"), f"CI installs kvsched with its compiled modules (setup.py): {missing}"
        pytest.skip(f"not built, or built from another version of the .py: {missing}")
    assert COMPILED_HERE == sorted(compiled.NAMES)


# ----- the battery: here and in a KVSCHED_PURE_PYTHON=1 process ---------------------------

BATTERY = ("import importlib, json, sys; sys.path[:0] = [sys.argv[1]]\n"
           "import compiled_battery, kvsched.compiled as c\n"
           "prints = compiled_battery.fingerprints()\n"
           "imported = sorted(n for n in c.NAMES if n in sys.modules)\n"
           "print(json.dumps(dict(prints=prints, imported=imported, "
           "compiled=[n for n in imported if c.is_compiled(sys.modules[n])])))")


def run_battery(tmp: Path, **env: str) -> dict:
    """compiled_battery.fingerprints() in a process of its own (with `env`), from `tmp` (the
    tests do not depend on the working directory)."""
    p = subprocess.run([sys.executable, "-c", BATTERY, TESTS_DIR], env={**os.environ, **env}, cwd=tmp,
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def here() -> dict[str, str]:
    """The scenarios run in this process (compiled where built)."""
    return compiled_battery.fingerprints()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """The scenarios run with KVSCHED_PURE_PYTHON=1: every module from its .py."""
    return run_battery(tmp_path_factory.mktemp("interpreted"), KVSCHED_PURE_PYTHON="1")


def differing(a: str, b: str) -> list[str]:
    """The `part=hash` parts of two fingerprints that differ (all of them if they have none)."""
    pa = dict(x.split("=", 1) for x in a.split() if "=" in x)
    pb = dict(x.split("=", 1) for x in b.split() if "=" in x)
    return sorted(k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k)) or ["(whole fingerprint)"]


@needs_compiled
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compiled_runs_are_the_interpreted_runs(name, here, interpreted):
    mine, theirs = here[name], interpreted["prints"][name]
    assert not mine.startswith(UNEXPECTED), mine
    assert not theirs.startswith(UNEXPECTED), theirs
    assert mine == theirs, f"{name}: compiled and interpreted differ in {differing(mine, theirs)}"


def test_the_interpreted_process_ran_every_module_from_its_py(interpreted):
    imported = set(interpreted["imported"])
    assert {"kvsched.sim.replica", "kvsched.cost.roofline", "kvsched.policies.baselines"} <= imported
    assert interpreted["compiled"] == []


@needs_compiled
def test_this_process_ran_the_compiled_modules(here):
    """After the battery, every module of COMPILED it imported runs compiled where it is built
    from its current .py; the engine's core always among them."""
    imported = [n for n in compiled.NAMES if n in sys.modules]
    assert {"kvsched.sim.replica", "kvsched.cost.roofline", "kvsched.policies.baselines"} <= set(imported)
    for n in imported:
        assert compiled.is_compiled(sys.modules[n]) == (current(compiled.NAMES[n]) and not compiled.pure()), n


def test_the_scenarios_exercise_what_they_name(here):
    """The battery's runs do what their names say (here; the comparison covers the other side)."""
    for name, value in here.items():
        assert not value.startswith(UNEXPECTED), (name, value)
    assert here["finish-hook/caching=False"].startswith("finishes=300 ")
    assert here["finish-hook/caching=True"].startswith("finishes=300 ")
    for name in ("reading/one-replica", "reading/caching-kv=8000", "reading/least-outstanding"):
        assert int(here[name].split()[0].split("=")[1]) > 100, here[name]
    # numpy numbers from a policy leave no numpy state: rows of Python floats and ints
    assert here["numpy-chunks"].startswith("row_types=float,int summary_types=NoneType,dict,float,int,str ")
    assert here["numpy-ints/block"] == here["numpy-ints/none"]
    assert here["numpy-ints/block-and-kv"] != here["numpy-ints/block"]
    assert here["fractional-kv-bytes"].startswith("kv_bytes=float:")
    assert set(x.split("=")[0] for x in here["out-files"].split()) == {"requests.csv", "timeline.csv",
                                                                        "batches.csv"}
    assert "ends beyond the largest time a float holds" in here["error/batch-past-the-largest-float"]
    for w in ("inf", "nan"):
        assert here[f"error/sarathi-watermark={w}"].startswith("PlanError: policy sarathi")
    err = here["error/kv-capacity-past-64-bit-counts"]
    assert err.startswith("KvschedError: ") and "must be below 2**62" in err and "64-bit integers" in err
    for name in SCENARIOS:
        if name.startswith("budget-cut/"):
            assert here[name].startswith("cuts=[") and not here[name].startswith("cuts=[] "), here[name]
    assert len({here[n] for n in SCENARIOS if n.startswith("random/")}) == 12


def test_the_seeded_cases_are_fixed():
    """Both processes draw the same random cases (numpy's default_rng from fixed seeds)."""
    assert compiled_battery.random_cases() == compiled_battery.random_cases()
    assert len(compiled_battery.random_cases()) == 12
    assert len({c["name"] for c in compiled_battery.random_cases()}) > 2


# ----- plain behaviour, the same compiled or not -----------------------------------------

def test_tier_slos_are_positive_float_seconds():
    from kvsched.workload.request import Tier
    assert Tier("a", tbt_slo=1).tbt_slo == 1.0 and type(Tier("a", tbt_slo=1).tbt_slo) is float
    for bad in (0, -1.0, "0.1", True, float("nan"), float("inf"), 10**400):
        with pytest.raises(KvschedError, match="must be a positive finite number of seconds"):
            Tier("a", tbt_slo=bad)


def test_a_kv_pool_past_64_bit_counts_is_an_error():
    from kvsched.kvcache import TOKEN_LIMIT, PagedKV
    assert TOKEN_LIMIT == 1 << 62
    assert PagedKV(TOKEN_LIMIT - 1, 16).capacity_blocks == (TOKEN_LIMIT - 1) // 16
    for tokens in (TOKEN_LIMIT, TOKEN_LIMIT + 1, 2**70):
        with pytest.raises(KvschedError, match=r"must be below 2\*\*62 .*64-bit integers"):
            PagedKV(tokens, 16)


# ----- without Cython: the no-op stand-in -------------------------------------------------

def test_the_cython_shim_is_a_no_op():
    assert shim.compiled is False
    assert shim.cast(shim.longlong, 3.7) == 3 and type(shim.cast(shim.longlong, 3.7)) is int
    assert shim.cast(shim.longlong, -3.7) == -3                # toward zero, as C
    assert shim.cast(shim.double, 2) == 2.0 and type(shim.cast(shim.double, 2)) is float
    assert shim.cast(shim.bint, 5) is True and shim.cast(shim.Py_ssize_t, 2.5) == 2
    x = object()
    assert shim.cast(shim.object, x) is x and shim.cast(int, 7.5) == 7.5     # not one of its types: as is
    assert shim.declare(shim.longlong, 5) == 5 and shim.declare(shim.double) is None

    def f(a, b):
        return a + b
    assert shim.locals(a=shim.longlong, b=shim.double)(f) is f
    for decorator in (shim.cfunc, shim.ccall, shim.inline, shim.final):
        assert decorator(f) is f


def test_the_cython_shim_s_directives_decorate_and_enter():
    for directive in (shim.boundscheck, shim.wraparound, shim.cdivision, shim.overflowcheck):
        @directive(False)
        def g(n):
            return n * 2
        assert g(3) == 6
        with directive(False):
            assert g(4) == 8


def test_the_cython_shim_s_types_subscript():
    view = shim.double[:]
    assert repr(view) == "cython.double[:]" and repr(shim.longlong) == "cython.longlong"
    a = [1.0, 2.0]
    assert shim.cast(view, a) is a and view(a) is a
    assert shim.longlong[:][:] is not None


def test_the_cython_shim_has_every_name_the_compiled_modules_use():
    import re
    used = set()
    for rel in compiled.COMPILED:
        # `from cython.cimports...` runs only under `if cython.compiled:`, never with the shim
        used |= set(re.findall(r"(?<!from )\bcython\.(\w+)", (compiled.PACKAGE / rel).read_text()))
    assert used and not [n for n in used if not hasattr(shim, n)]


@needs_compiled
def test_without_cython_the_modules_run_the_shim_and_the_same_results(here, tmp_path):
    """An install without Cython: `import cython` fails, each module takes the shim, and the
    runs are the compiled ones."""
    names = [n for n in SCENARIOS if n.startswith(("steady/", "policy/", "random/", "cost/"))]
    code = ("import json, sys; sys.modules['cython'] = None; sys.path[:0] = [sys.argv[1]]\n"
            "import compiled_battery, kvsched.compiled as c, kvsched.cython_shim as shim\n"
            f"prints = compiled_battery.fingerprints({names!r})\n"
            "mods = [sys.modules[n] for n in c.NAMES if n in sys.modules]\n"
            "assert mods and all(m.cython is shim and not c.is_compiled(m) for m in mods if hasattr(m, 'cython'))\n"
            "assert sys.modules['kvsched.sim.decode_run'].cython is shim\n"
            "print(json.dumps(prints))")
    p = subprocess.run([sys.executable, "-c", code, TESTS_DIR], env={**os.environ, "KVSCHED_PURE_PYTHON": "1"},
                       cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert p.returncode == 0, p.stderr[-6000:]
    prints = json.loads(p.stdout.strip().splitlines()[-1])
    assert [n for n in names if prints[n] != here[n]] == []


# ----- the guard: an edited .py runs as edited ---------------------------------------------

RUN = ("import json, sys; from kvsched.run import Scenario, simulate; from kvsched.workload import Jitter, synthetic\n"
       "import kvsched, kvsched.compiled as c\n"
       "r = simulate(Scenario(synthetic(Jitter(512), Jitter(256), rate=20.0, n=400, seed=3)), 'vllm-v1')\n"
       "mods = {n: c.is_compiled(sys.modules[n]) for n in c.NAMES if n in sys.modules}\n"
       "print(json.dumps([kvsched.__file__, mods, [r.summary[k] for k in ('mean_ttft_ms', 'mean_itl_ms', "
       "'duration', 'iterations')]]))")
CORE = ("kvsched.sim.replica", "kvsched.cost.roofline", "kvsched.policies.baselines")


def copy_package(tmp_path: Path) -> Path:
    """The installed kvsched package (its .py files, built modules and manifest) copied under
    tmp_path/site; returns that root."""
    root = tmp_path / "site"
    shutil.copytree(compiled.PACKAGE, root / "kvsched", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    return root


def run_copy(root: Path, pure: bool) -> tuple[dict[str, bool], list, str]:
    """RUN on the package copied under `root`: (module -> whether it ran compiled, its figures,
    its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(root), "KVSCHED_PURE_PYTHON": "1" if pure else ""}
    p = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, cwd=root,
                       timeout=SUBPROCESS_TIMEOUT)
    assert p.returncode == 0, p.stderr[-6000:]
    where, mods, figures = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(where).resolve().is_relative_to(root.resolve()), where      # the copy ran, not the install
    assert set(CORE) <= set(mods)
    return mods, figures, p.stderr


def warned(err: str) -> set[str]:
    """The files the guard's warning names as built from other sources (not those only compiled
    against them, named in brackets)."""
    import re
    out = set()
    for line in err.splitlines():
        if compiled.WARNING + " " in line:
            names = line.split(compiled.WARNING + " ", 1)[1].split(" was built from", 1)[0]
            out |= set(re.findall(r"kvsched/[\w/]+\.py", names))
    return out


def stale_here() -> set[str]:
    """kvsched/<rel> of the modules built from another version of their .py in the package itself
    (the copies warn about those too)."""
    return {f"kvsched/{rel}" for rel in compiled.NAMES.values() if built(rel) and not current(rel)}


@needs_compiled
def test_an_untouched_copy_runs_compiled_without_a_warning(tmp_path):
    root = copy_package(tmp_path)
    mods, figures, err = run_copy(root, pure=False)
    assert mods == {n: n in COMPILED_HERE for n in mods}
    assert warned(err) == stale_here() & {f"kvsched/{compiled.NAMES[n]}" for n in mods}
    assert figures == run_copy(root, pure=True)[1]


@needs_compiled
def test_kvsched_pure_python_imports_every_py_without_a_warning(tmp_path):
    mods, _, err = run_copy(copy_package(tmp_path), pure=True)
    assert not any(mods.values()) and compiled.WARNING not in err


EDITS = {   # a cost model's formula and a built-in policy's budget, changed in place after the build
    "cost/roofline.py": ("return self.overhead + ", "return 2 * self.overhead + ", 2),     # time and DenseTime
    "policies/baselines.py": ("budget = self.max_num_batched_tokens - nd", "budget = self.max_num_batched_tokens // 16 - nd", 2),
}


@needs_compiled
@pytest.mark.parametrize("rel", sorted(EDITS))
def test_an_edited_module_runs_as_edited_with_a_warning(tmp_path, rel):
    """As in an editable install: a cost model or a policy changed in place after the build
    takes effect at the next run. The copy's compiled module must not run the old code: the
    results are the edited pure-Python ones."""
    name = compiled.module_name(rel)
    if name not in COMPILED_HERE:
        pytest.skip(f"{name} does not run compiled here")
    root = copy_package(tmp_path)
    mods, before, _ = run_copy(root, pure=False)
    assert mods[name] and before == run_copy(root, pure=True)[1]
    source = root / "kvsched" / rel
    old, new, count = EDITS[rel]
    text = source.read_text()
    assert text.count(old) == count
    source.write_text(text.replace(old, new))
    mods, after, err = run_copy(root, pure=False)
    python = {compiled.module_name(r) for r in compiled.interpreted(root / "kvsched")[0]}   # it and those built against it
    assert name in python and mods == {n: n in COMPILED_HERE and n not in python for n in mods}
    line = next(x for x in err.splitlines() if f"{compiled.WARNING} kvsched/{rel} " in x)
    assert line.split("RuntimeWarning: ", 1)[-1].startswith(compiled.WARNING)
    assert "running the pure-Python code" in line and "pip install" in line
    assert f"kvsched/{rel}" in warned(err)
    assert after != before and after == run_copy(root, pure=True)[1]


@needs_compiled
def test_a_copy_without_its_manifest_runs_every_py_with_warnings(tmp_path):
    root = copy_package(tmp_path)
    _, before, _ = run_copy(root, pure=False)
    (root / "kvsched" / compiled.MANIFEST).unlink()
    mods, after, err = run_copy(root, pure=False)
    assert not any(mods.values())
    assert warned(err) == {f"kvsched/{compiled.NAMES[n]}" for n in mods if built(compiled.NAMES[n])}
    assert "running the pure-Python code" in err and "pip install" in err
    assert after == before == run_copy(root, pure=True)[1]


@needs_compiled
@pytest.mark.parametrize("rel", ["metrics.py", "sim/decode_set.pxd"])
def test_an_edited_module_takes_the_modules_compiled_against_it_along(tmp_path, rel):
    """The replica is compiled against the C layout of the gap histogram (metrics.pxd) and of
    the decode set: with either edited (its .py or its declarations), the modules built against
    it run their .py too, so the run works (a compiled module beside the other's Python class
    would not even import) and gives the same figures."""
    root = copy_package(tmp_path)
    _, before, _ = run_copy(root, pure=False)
    source = root / "kvsched" / rel
    source.write_text(source.read_text() + "\n# edited\n")
    mods, after, err = run_copy(root, pure=False)
    edited = rel.replace(".pxd", ".py")
    dependents = {r for r in compiled.COMPILED if edited in compiled.cimports(compiled.PACKAGE, r)}
    assert "sim/replica.py" in dependents
    assert f"kvsched/{edited}" in warned(err) and "compiled against it" in err
    for name, ran_compiled in mods.items():
        r = compiled.NAMES[name]
        if r == edited or r in dependents or "sim/replica.py" in compiled.cimports(compiled.PACKAGE, r):
            assert not ran_compiled, name
    assert after == before


@needs_compiled
def test_an_edit_to_any_compiled_module_runs_and_gives_the_same_figures(tmp_path):
    """Each module of COMPILED edited in turn (a comment appended: the logic unchanged): the run
    works whatever the import order (the modules compiled against it run their .py too), the
    warning names the file, and the figures are the build's."""
    root = copy_package(tmp_path)
    _, before, _ = run_copy(root, pure=False)
    for rel in compiled.COMPILED:
        source = root / "kvsched" / rel
        text = source.read_text()
        source.write_text(text + "\n# edited\n")
        try:
            mods, after, err = run_copy(root, pure=False)
        finally:
            source.write_text(text)
        assert not mods.get(compiled.module_name(rel), False), rel
        assert f"kvsched/{rel}" in warned(err), rel
        assert after == before, rel
