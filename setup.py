"""The compiled fast path (src/kvsched/sim/_fast.pyx, issue "Speed"): built when Cython and a C
compiler are at hand; without them kvsched installs and runs its pure-Python code, with the
same results bit for bit. Everything else about the package is in pyproject.toml."""
from setuptools import setup
from setuptools.command.build_ext import build_ext

# no fused multiply-add or fast-math: C must round every float operation as Python does
FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math"]


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:        # no compiler at all
            self.warn(f"kvsched: compiled fast path not built ({exc}); the pure-Python code runs")

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self.warn(f"kvsched: {ext.name} not built ({exc}); the pure-Python code runs")


def extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    from setuptools import Extension
    ext = Extension("kvsched.sim._fast", ["src/kvsched/sim/_fast.pyx"], extra_compile_args=FLAGS)
    return cythonize([ext], quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
