"""The compiled fast path (src/kvsched/sim/_fast.pyx, issue "Speed"): built when Cython and a C
compiler are at hand on a 64-bit machine; without them kvsched installs and runs its
pure-Python code, with the same results bit for bit. Everything else is in pyproject.toml."""
import ast
import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PACKAGE = Path(__file__).resolve().parent / "src/kvsched"
PYX = PACKAGE / "sim/_fast.pyx"
# no fused multiply-add or fast-math: C must round every float operation as Python does.
# Install time (issue "First contact"): no debug information (Python's default -g is 40% of the
# compile and 85% of the module's size) and -O1, which compiles in 4.0 s against -O2's 6.1 s and
# -O3's 8.6 s with no loss measured (benchmarks/bench_simulator.py, vllm-v1: 50,000 requests 0.84
# s against 0.88 s, 1,000,000 with --out 14.1 s against 14.2 s): the loops call back into Python.
FLAGS = ["-O1", "-g0", "-ffp-contract=off", "-fno-fast-math"]


def warn(why: str) -> None:
    print(f"kvsched: a compiled module is not built ({why}); its pure-Python code runs", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:        # no compiler at all
            warn(str(exc))

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            warn(str(exc))


def mirrors() -> tuple[str, ...]:
    """kvsched.sim.compiled.MIRRORS, read as a literal (kvsched is not importable at build time)."""
    tree = ast.parse((PACKAGE / "sim/compiled.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MIRRORS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("MIRRORS not found in src/kvsched/sim/compiled.py")


def extensions() -> list:
    if sys.maxsize < 2 ** 62:           # 32-bit x86 rounds in 80-bit registers: results could differ
        warn("not a 64-bit Python")
        return []
    if not PYX.exists():
        warn(f"{PYX} is missing")
        return []
    # the sha256 of every file the module mirrors, recorded in it: kvsched/sim/compiled.py uses
    # the module only while the installed files still match (an edit runs the Python code)
    sources = ";".join(f"{rel}={hashlib.sha256((PACKAGE / rel).read_bytes()).hexdigest()}" for rel in mirrors())
    ext = Extension("kvsched.sim._fast", ["src/kvsched/sim/_fast.pyx"], extra_compile_args=FLAGS,
                    define_macros=[("KVSCHED_SOURCES", f'"{sources}"')])
    # the CSV text leaf (kvsched/csvtext.py's compiled layout): no Python twin, so no hashes
    csv = Extension("kvsched._csv", ["src/kvsched/_csv.pyx"], extra_compile_args=FLAGS)
    try:
        from Cython.Build import cythonize
    except Exception as exc:            # no Cython
        warn(f"{type(exc).__name__}: {exc}")
        return []
    built = []
    for one in (ext, csv):              # each on its own: a failure of one keeps the other
        try:
            built += cythonize([one], quiet=True)
        except Exception as exc:        # the .pyx does not compile
            warn(f"{one.name}: {type(exc).__name__}: {exc}")
    return built


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
