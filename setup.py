"""The compiled build (issue "One engine, one source"): Cython compiles the readable Python
modules listed in kvsched/compiled.py (`COMPILED`) as they are, and the CSV text leaf
(src/kvsched/_csv.pyx), when Cython and a C compiler are at hand on a 64-bit machine; without
them kvsched installs and runs the same .py files, with the same results bit for bit.
Everything else is in pyproject.toml."""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PACKAGE = Path(__file__).resolve().parent / "src/kvsched"
# no fused multiply-add or fast-math: C must round every float operation as Python does.
# Install time (issue "First contact"): no debug information (Python's default -g is most of the
# compile and of the modules' size) and -O1: the compiled code calls back into Python, so -O2
# and -O3 compile slower and gain nothing measurable (benchmarks/bench_simulator.py).
FLAGS = ["-O1", "-g0", "-ffp-contract=off", "-fno-fast-math"]
# Python semantics kept: no type taken from annotations (an `int` annotation would refuse a
# numpy integer), Python's division and modulo (cdivision off), bounds and negative indices checked.
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True}


def warn(why: str) -> None:
    print(f"kvsched: a compiled module is not built ({why}); its Python code runs", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install; the modules compile in parallel.
    The manifest lists only the modules built now, with the hashes of the sources they were
    built from: a module that failed leaves no built file behind (an old one would pass for
    current in an editable install)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        hashes = {rel: RULES.source_digest(PACKAGE, rel) for rel in RULES.COMPILED}
        self.built: set[str] = set()
        from Cython.Build import cythonize     # here, not at import: other setup.py commands need no C
        ready = []
        for ext in self.extensions:             # each on its own: a failure of one keeps the others
            try:
                ext.sources = cythonize([ext], quiet=True, force=True, compiler_directives=DIRECTIVES)[0].sources
                ready.append(ext)
            except Exception as exc:            # it does not compile
                self.drop(ext.name, f"{type(exc).__name__}: {exc}")
        self.extensions = ready
        try:
            super().run()
        except Exception as exc:                # no compiler at all
            warn(str(exc))
        package = Path(self.get_ext_fullpath("kvsched.x")).parent
        lines = [f"{rel} {sha}" for rel, sha in hashes.items() if RULES.module_name(rel) in self.built]
        package.mkdir(parents=True, exist_ok=True)
        (package / RULES.MANIFEST).write_text("".join(line + "\n" for line in lines))

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
            self.built.add(ext.name)
        except Exception as exc:
            self.drop(ext.name, str(exc))

    def drop(self, name: str, why: str) -> None:
        """A module not built: no built file of it may stay, here or in the source tree (an
        editable install's), where an old one would be imported."""
        Path(self.get_ext_fullpath(name)).unlink(missing_ok=True)
        for old in PACKAGE.glob(name.removeprefix("kvsched.").replace(".", "/") + ".*.so"):
            old.unlink()
        warn(f"{name}: {why}")


def build_rules():
    """kvsched/compiled.py, loaded by path (kvsched itself is not importable at build time; that
    file needs only the standard library): what to compile and how the manifest is written."""
    spec = importlib.util.spec_from_file_location("kvsched_compiled_rules", PACKAGE / "compiled.py")
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    return rules


RULES = build_rules()


def extensions() -> list:
    """The modules to compile (their .py and .pyx sources: `OptionalBuildExt` runs Cython)."""
    if sys.maxsize < 2 ** 62:           # 32-bit x86 rounds in 80-bit registers: results could differ
        warn("not a 64-bit Python")
        return []
    try:
        import Cython  # noqa: F401
    except Exception as exc:            # no Cython
        warn(f"{type(exc).__name__}: {exc}")
        return []
    exts = [Extension(RULES.module_name(rel), [f"src/kvsched/{rel}"], extra_compile_args=FLAGS) for rel in RULES.COMPILED]
    return exts + [Extension("kvsched._csv", ["src/kvsched/_csv.pyx"], extra_compile_args=FLAGS)]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
