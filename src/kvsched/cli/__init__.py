"""The `kvsched` command. Each module adds its commands to the one Typer app."""
from __future__ import annotations

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
      (tens of ms at 50,000 requests), memory the OS takes back as the process ends: the
      objects alive then are frozen out of it (`gc.freeze`). atexit handlers, module clean-up
      and the freeing of what is not in a reference cycle still run; every file the command
      writes is closed before it returns.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        # what `app()` runs (a group: the app has many commands), less the other commands; typer's
        # exception hook is left out: with pretty exceptions off, it prints Python's traceback
        typer.main.get_group(only(argv[0] if argv else None))(args=argv, prog_name="kvsched")
    finally:
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
