"""Which code runs: a module's Python file, or the same file compiled (issue "One engine, one
source").

setup.py compiles the readable Python modules of `COMPILED` with Cython, as they are: no twin
is written by hand, so there is one source. Each built module sits beside its .py file, and
Python would import it first; setup.py records the sha256 of every .py it compiles in
`MANIFEST`. `Guard`, on `sys.meta_path` from `import kvsched` on, keeps a built module only
while its .py still has the recorded content: an edit (an editable install, a policy or cost
model changed in place) runs the edited .py at the next run, with one warning naming it and
the rebuild command, so nobody gets the old logic's results from new code.
KVSCHED_PURE_PYTHON=1 runs every .py (the reference the tests compare the compiled run with).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import warnings
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, PathFinder
from importlib.util import spec_from_file_location
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent          # the kvsched package folder
# Paths relative to PACKAGE of the modules setup.py compiles (it reads this tuple as a literal,
# without importing kvsched): the simulator's loop and what it calls every batch. Any may be
# added; tests/test_compiled.py checks each one builds and runs as its .py does.
COMPILED = ("sim/replica.py", "sim/lifecycle.py", "sim/kv_blocks.py", "sim/batch.py", "sim/decode_run.py",
            "sim/records.py", "sim/decode_set.py", "sim/view.py", "sim/plan_check.py", "sim/prefix_cache.py",
            "sim/prefix_planner.py", "sim/requests.py", "sim/rowlog.py", "sim/cluster.py", "sim/routed_ahead.py",
            "metrics.py", "kvcache.py", "cost/roofline.py", "cost/shape.py", "policies/base.py",
            "policies/baselines.py", "policies/eb.py", "policies/rad.py", "policies/slai.py", "policies/wait.py",
            "policies/distserve.py")
MANIFEST = "compiled_sources.txt"                  # in PACKAGE: "<path> <sha256>" per compiled module
WARNING = "the compiled module of"                 # the warning's start (workers.py filters it)
REBUILD = "`pip install .` rebuilds it (`pip install -e .` in an editable install)"


def module_name(rel: str) -> str:
    """'sim/replica.py' -> 'kvsched.sim.replica'."""
    return "kvsched." + rel[:-3].replace("/", ".")


NAMES = {module_name(rel): rel for rel in COMPILED}


def source_digest(root: Path, rel: str) -> str | None:
    """sha256 of what module `rel` under package folder `root` compiles from: its .py and its
    .pxd declarations, if any (None if the .py cannot be read). setup.py records it."""
    try:
        h = hashlib.sha256((root / rel).read_bytes())
        pxd = (root / rel).with_suffix(".pxd")
        if pxd.is_file():
            h.update(b"\0" + pxd.read_bytes())
    except OSError:
        return None
    return h.hexdigest()


def cimports(root: Path, rel: str) -> set[str]:
    """The modules of COMPILED whose types module `rel`'s .pxd declares it uses
    (`from kvsched.x cimport ...`): built against their C layout, it runs only beside them built."""
    pxd = (root / rel).with_suffix(".pxd")
    try:
        text = pxd.read_text()
    except OSError:
        return set()
    found = {m.replace(".", "/") + ".py" for m in re.findall(r"^from kvsched\.([\w.]+) cimport", text, re.M)}
    return found & set(COMPILED)


def recorded(root: Path | None = None) -> dict[str, str]:
    """The manifest setup.py wrote (path -> sha256 of each module it built); empty if none."""
    try:
        text = ((PACKAGE if root is None else root) / MANIFEST).read_text()
    except OSError:
        return {}
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


def has_built(root: Path, rel: str) -> bool:
    """Whether a built module of `rel` sits beside its .py."""
    return any((root / (rel[:-3] + suffix)).is_file() for suffix in EXTENSION_SUFFIXES)


def interpreted(root: Path) -> tuple[set[str], list[str]]:
    """(the modules under `root` that must run their .py, the stale ones among them): a module
    not built; one built from other sources than its .py and .pxd now (edited since, or not
    in the manifest); and every module compiled against one of those (its C layout would not
    match the Python class)."""
    manifest = recorded(root)
    stale = [rel for rel in COMPILED if has_built(root, rel) and manifest.get(rel) != source_digest(root, rel)]
    python = {rel for rel in COMPILED if not has_built(root, rel)} | set(stale)
    needs = {rel: cimports(root, rel) for rel in COMPILED}
    while more := {rel for rel in COMPILED if rel not in python and needs[rel] & python}:
        python |= more
    return python, stale


def pure() -> bool:
    return os.environ.get("KVSCHED_PURE_PYTHON", "") not in ("", "0")


class Guard:
    """A meta-path finder for the names of `COMPILED`: a built module is imported only while it
    and every module it is compiled against are built from their current sources (and
    KVSCHED_PURE_PYTHON is not set); otherwise its .py is. One warning names the edited files."""

    def __init__(self) -> None:
        self._python: set[str] | None = None

    def find_spec(self, name: str, path=None, target=None):
        rel = NAMES.get(name)
        if rel is None:
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or not isinstance(spec.loader, ExtensionFileLoader):
            return spec                         # not built (no compiler, or a source checkout)
        source = Path(spec.origin).with_name(rel.rsplit("/", 1)[-1])
        if pure():
            return spec_from_file_location(name, source)
        if self._python is None:
            self._python = self._judge(source.parents[rel.count("/")])
        return spec_from_file_location(name, source) if rel in self._python else spec

    @staticmethod
    def _judge(root: Path) -> set[str]:
        python, edited = interpreted(root)
        if edited:
            also = sorted(rel for rel in python - set(edited) if has_built(root, rel))
            names = ", ".join(f"kvsched/{rel}" for rel in edited)
            more = f" (and of {', '.join(f'kvsched/{rel}' for rel in also)}, compiled against it)" if also else ""
            warnings.warn_explicit(f"{WARNING} {names} was built from another version of it: running the pure-Python "
                                   f"code{more}, slower but current; {REBUILD}", RuntimeWarning,
                                   filename=str(root / edited[0]), lineno=1, module=module_name(edited[0]))
        return python


def install() -> None:
    """Put one Guard first on sys.meta_path (idempotent)."""
    if not any(type(f).__name__ == "Guard" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, Guard())


def is_compiled(module) -> bool:
    """Whether `module` (one of COMPILED) runs its built code."""
    return isinstance(getattr(module, "__loader__", None), ExtensionFileLoader)
