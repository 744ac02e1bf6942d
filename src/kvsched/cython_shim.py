"""The `cython` names kvsched's compiled modules use, as no-ops, for where Cython is not
installed (it is needed only to build them: setup.py). A module compiled by Cython reads its
`import cython` at build time; run as Python it falls back to this, as SQLAlchemy's
`util/cython.py` does, so the same file runs either way:

    try:
        import cython
    except ModuleNotFoundError:
        from kvsched import cython_shim as cython
"""
from __future__ import annotations

from typing import Any, Callable

compiled = False


class _Type:
    """A C type's name (`cython.longlong`, `cython.double[:]`): nothing in Python."""

    def __init__(self, name: str, py: Callable[[Any], Any] | None = None) -> None:
        self.name, self.py = name, py

    def __getitem__(self, _: Any) -> "_Type":
        return _Type(self.name + "[:]")

    def __call__(self, value: Any) -> Any:      # a conversion: cython.longlong(x)
        return value if self.py is None else self.py(value)

    def __repr__(self) -> str:
        return f"cython.{self.name}"


_int = int
bint = _Type("bint", bool)
int = _Type("int", _int)                            # noqa: A001 (Cython's own names)
long = _Type("long", _int)
longlong = _Type("longlong", _int)
Py_ssize_t = _Type("Py_ssize_t", _int)
double = _Type("double", float)
object = _Type("object")                            # noqa: A001


def _same(fn: Callable) -> Callable:
    return fn


def locals(**_: Any) -> Callable[[Callable], Callable]:      # noqa: A001
    return _same


def returns(_type: Any) -> Callable[[Callable], Callable]:
    return _same


def declare(_type: Any, value: Any = None, **__: Any) -> Any:
    return value


def cast(_type: Any, value: Any, **__: Any) -> Any:
    """C's cast: to an integer type truncates toward zero, as Python's int() does."""
    return _type(value) if isinstance(_type, _Type) else value


class _Directive:
    """`@cython.boundscheck(False)` or `with cython.boundscheck(False):`."""

    def __call__(self, arg: Any) -> Any:
        return arg if callable(arg) else self       # the decorated function, or the directive

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


boundscheck = wraparound = cdivision = overflowcheck = _Directive()
cfunc = ccall = inline = final = _same
