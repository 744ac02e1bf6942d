"""The `kvsched` command. Each module adds its commands to the one Typer app."""
# each module registers its commands
from kvsched.cli import calibrate, capacity, replay, report, run, sweep, theory, workloads  # noqa: F401
from kvsched.cli.common import app


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "main"]
