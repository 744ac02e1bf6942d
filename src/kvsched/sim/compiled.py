"""Which code runs: the compiled module (sim/_fast.pyx, issue "Speed") or the pure-Python code
it mirrors, with the same results bit for bit.

The compiled module holds twins of Python functions and classes in the files of `MIRRORS`.
setup.py records the sha256 of each of them in the module as it builds it (`_fast.SOURCES`);
the module is used only while every one of those files still has the recorded content. An
edit to any of them (an editable install, a policy or the roofline changed in place) makes
kvsched run the pure-Python code, with one warning naming the changed files and the rebuild
command, so a researcher never gets the old logic's results from new code.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent.parent       # the kvsched package folder
# Paths relative to PACKAGE of what _fast.pyx compiles or copies (setup.py reads this tuple as
# a literal, without importing kvsched): the .pyx itself, the replica and the engine state it
# reads and writes, the view the built-in plans read (VllmV1, Sarathi), the roofline, the gap
# histogram and the row logs. tests/test_compiled.py checks that every
# kvsched module the .pyx, the replica or the baselines import is here or in NOT_MIRRORED.
MIRRORS = ("sim/_fast.pyx", "sim/replica.py", "sim/plan_check.py", "sim/decode_set.py", "sim/prefix_cache.py",
           "sim/requests.py", "sim/rowlog.py", "sim/view.py", "kvcache.py", "metrics.py", "cost/roofline.py",
           "cost/shape.py", "policies/base.py", "policies/baselines.py")
NOT_MIRRORED = {"errors.py": "exception classes only", "sim/compiled.py": "this loader"}
REBUILD = "`pip install .` rebuilds the module; `pip install -e .` in an editable install"


def digest(path: Path) -> str | None:
    """sha256 of a file's bytes; None if it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def changed(recorded: dict[str, str], root: Path | None = None) -> list[str]:
    """The mirrored files under `root` (the installed package) whose content is not what
    `recorded` (path -> sha256) says the compiled module was built from; a file missing on
    either side counts as changed."""
    root = PACKAGE if root is None else root
    return [rel for rel in MIRRORS if (built := recorded.get(rel)) is None or built != digest(root / rel)]


def parse_sources(text: str) -> dict[str, str]:
    """The module's record, 'path=sha256;...' (setup.py writes it), as a dict."""
    return dict(item.split("=", 1) for item in text.split(";") if "=" in item)


def load() -> ModuleType | None:
    """The compiled module, or None where the pure-Python code runs: KVSCHED_PURE_PYTHON=1, the
    module not built (no C compiler at install), or a mirrored file changed since it was built
    (warned once, naming the files)."""
    if os.environ.get("KVSCHED_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from kvsched.sim import _fast
    except ImportError:
        return None
    stale = changed(parse_sources(getattr(_fast, "SOURCES", "")))
    if stale:
        files = ", ".join(f"kvsched/{rel}" for rel in stale)
        warnings.warn(f"the compiled fast path was built from other versions of {files}: running the "
                      f"pure-Python code, slower but current; {REBUILD}", stacklevel=2)
        return None
    return _fast
