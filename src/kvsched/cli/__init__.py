"""The `kvsched` command. Each module adds its commands to the one Typer app."""
from kvsched.cli import calibrate, replay, run, theory, workloads  # noqa: F401  (they register their commands)
from kvsched.cli.common import app


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "main"]
