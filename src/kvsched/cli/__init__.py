"""The `kvsched` command. Each module adds its commands to the one Typer app."""
from __future__ import annotations

import atexit
import copy
import gc
import sys

import typer
import typer.main

# each module registers its commands
from kvsched.cli import calibrate, capacity, replay, report, run, sweep, theory, workloads  # noqa: F401
from kvsched.cli.common import app


def main(argv: list[str] | None = None) -> None:
    """The `kvsched` command (its console script and `python -m kvsched`); ends the process.

    Two start-up and shut-down costs a one-shot process need not pay:
    - Typer builds the click command of every registered command on each call (about 12 ms
      for 22): when the first argument names a command, only that one is built. What it
      parses, prints and exits with is the same (its usage line reads `kvsched NAME`).
    - The interpreter's last garbage collection walks every object and frees the run's data
      (tens of ms at 50,000 requests), memory the OS takes back as the process ends: at exit
      (atexit, after the handlers registered later), the objects alive are frozen out of it
      (`gc.freeze`), unless user code was loaded (`--policy FILE.py:Class` and the like,
      whose objects may need finalizing: a file to flush). kvsched closes every file it writes
      before the command returns; atexit handlers and module clean-up still run. A caller
      that catches the SystemExit goes on unfrozen until its own exit.
    """
    name = (sys.argv[1:] if argv is None else argv)[:1]
    atexit.unregister(_freeze_unless_user_code)        # once, however often main runs
    atexit.register(_freeze_unless_user_code)
    # what `app()` runs (a group: the app has many commands), less the other commands; typer's
    # exception hook is left out: with pretty exceptions off, it prints Python's traceback.
    # args=None lets click read sys.argv itself (and expand wildcards on Windows), as app() does
    typer.main.get_group(only(name[0] if name else None))(args=argv, prog_name="kvsched")


def _freeze_unless_user_code() -> None:
    plugins = sys.modules.get("kvsched.plugins")
    if plugins is None or not plugins.USER_CODE:
        gc.freeze()


def only(name: str | None) -> typer.Typer:
    """`app`, or a shallow copy of it holding just the top-level command `name` if it has one
    (a sub-app such as `theory` or `workload`, or no match: the whole app)."""
    found = [c for c in app.registered_commands if c.name == name]
    if len(found) != 1 or any(g.name == name for g in app.registered_groups):
        return app
    one = copy.copy(app)
    one.registered_commands, one.registered_groups = found, []
    return one


__all__ = ["app", "main", "only"]
