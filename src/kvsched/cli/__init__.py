"""The `kvsched` command. Each module adds its commands to the one Typer app."""
from kvsched.cli import (calibrate, capacity, replay, report, run, sweep, theory,  # noqa: F401  (they register
                         workloads)                                               # their commands)
from kvsched.cli.common import app


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "main"]
