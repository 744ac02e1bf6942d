"""User code by name, for `--policy`, `--router` and `--cost` (docs/extending.md): a built-in
name, an installed plugin's entry point, or `MODULE:CLASS` / `FILE.py:CLASS` for code outside
the package, run without editing kvsched.

- `pkg.module:Class`: imported as Python imports it, with the working folder searched last
  (a console script's sys.path lacks it, `python -m` has it first: the same module either way
  unless an installed one has its name).
- `path/to/file.py:Class`: that file, loaded once per process under a name made from its
  absolute path (`kvsched_user_<stem>_<hash>`), so worker processes and copies find it.
- a plain name not built in: the entry point of that name in the group (`kvsched.policies`,
  `kvsched.routers`, `kvsched.cost_models`) of an installed distribution, as pytest and flake8
  find their plugins:
  `[project.entry-points."kvsched.policies"] my-policy = "my_pkg.policy:MyPolicy"`.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from kvsched.errors import PASS_THROUGH, KvschedError

GROUPS = {"policy": "kvsched.policies", "router": "kvsched.routers", "cost": "kvsched.cost_models"}
USER_CODE: list[str] = []       # the specs of user code resolved in this process (cli.main reads it)


def resolve(spec: str, kind: str, registry: dict[str, type], needs: str, flag: str | None = None) -> type:
    """The class `spec` names (see the module docstring); `needs` is the method an object of
    it must have ("schedule" for a policy, "route" for a router); `flag` names the option in
    errors (default --KIND)."""
    flag = flag or f"--{kind}"
    if not isinstance(spec, str) or not spec.strip():
        raise KvschedError(f"{flag}: expected a name or MODULE:CLASS, got {spec!r}")
    if spec in registry:
        return registry[spec]
    USER_CODE.append(spec)                      # before it runs (it may run and then fail)
    if ":" in spec:
        cls = _from_spec(spec, flag)
    else:
        cls = _entry_point(spec, kind, flag)
        if cls is None:
            plugins = sorted(plugin_names(kind))
            known = ", ".join([*registry, *plugins])
            raise KvschedError(f"{flag}: unknown {kind} {spec!r}; known: {known}; or MODULE:CLASS or FILE.py:CLASS "
                               "for your own (docs/extending.md)")
    if not isinstance(cls, type) or not callable(getattr(cls, needs, None)):
        what = cls.__name__ if isinstance(cls, type) else type(cls).__name__
        raise KvschedError(f"{flag} {spec}: {what} is not a {kind} class: it needs a {needs}() method")
    return cls


def plain_instance(cls: type, owner: str, overrides: dict, flag: str):
    """An object of a user's class that is not a dataclass: built with no arguments, so it takes
    no `flag` parameters; what its constructor raises is one error naming `owner`."""
    if overrides:
        raise KvschedError(f"{owner} takes no {flag} parameters (only a dataclass has them)")
    try:
        return cls()
    except KvschedError:
        raise
    except PASS_THROUGH:
        raise
    except BaseException as exc:                # SystemExit included: named, not an exit
        raise KvschedError(f"{owner}: {type(exc).__name__}: {exc}") from None


def _from_spec(spec: str, flag: str):
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise KvschedError(f"{flag} {spec!r}: expected MODULE:CLASS or FILE.py:CLASS")
    module = _load_file(where, flag) if where.endswith(".py") or os.sep in where or "/" in where \
        else _import(where, flag)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise KvschedError(f"{flag} {spec}: {where} has no {attr!r}") from None
    return obj


@contextlib.contextmanager
def _cwd_searched_last():
    """The working folder on sys.path, last (an installed module of the same name wins), for
    the duration: a console script's sys.path lacks it."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import(name: str, flag: str):
    try:
        with _cwd_searched_last():
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise KvschedError(f"{flag}: cannot import module {name!r}: {exc}") from None
    except KvschedError:
        raise
    except PASS_THROUGH:
        raise
    except BaseException as exc:
        raise KvschedError(f"{flag}: importing module {name!r} raised {type(exc).__name__}: {exc}") from None


def _load_file(path: str, flag: str):
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise KvschedError(f"{flag}: {path} is not a file")
    stem = "".join(ch if ch.isalnum() else "_" for ch in p.stem)
    name = f"kvsched_user_{stem}_{hashlib.sha256(str(p).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise KvschedError(f"{flag}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                  # before running it: its classes name this module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if isinstance(exc, PASS_THROUGH):
            raise
        where = ""
        tb = exc.__traceback__
        while tb is not None:                   # the line in the user's file
            if tb.tb_frame.f_code.co_filename == str(p):
                where = f":{tb.tb_lineno}"
            tb = tb.tb_next
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = f":{exc.lineno}"
        raise KvschedError(f"{flag}: loading {path}{where} raised {type(exc).__name__}: {exc}") from None
    return module


def source_file(spec) -> Path | None:
    """The file of a user's code that `spec` names (FILE.py:CLASS, or MODULE:CLASS's module
    file), for keys that must change when that code does (a sweep's points); None for a
    built-in or a plugin name, or where it cannot be found without running it."""
    if not isinstance(spec, str) or ":" not in spec:
        return None
    where = spec.rpartition(":")[0]
    if where.endswith(".py") or os.sep in where or "/" in where:
        p = Path(where).expanduser().resolve()
        return p if p.is_file() else None
    try:
        with _cwd_searched_last():
            found = importlib.util.find_spec(where)     # (may import the module's parent packages)
    except PASS_THROUGH:
        raise
    except BaseException:                           # what resolving it reports, as one line
        return None
    if found is None or not found.has_location or not found.origin:     # built-in, frozen, namespace
        return None
    return Path(found.origin) if Path(found.origin).is_file() else None


def _entry_points(kind: str):
    from importlib.metadata import entry_points
    return entry_points(group=GROUPS[kind])


def plugin_names(kind: str) -> list[str]:
    """Names of the installed plugins of `kind` (their entry points)."""
    return [ep.name for ep in _entry_points(kind)]


def _entry_point(name: str, kind: str, flag: str):
    for ep in _entry_points(kind):
        if ep.name == name:
            try:
                return ep.load()
            except PASS_THROUGH:
                raise
            except BaseException as exc:
                raise KvschedError(f"{flag} {name}: the plugin's entry point {ep.value!r} failed to load: "
                                   f"{type(exc).__name__}: {exc}") from None
    return None
