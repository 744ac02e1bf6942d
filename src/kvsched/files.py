"""Files written whole or not at all (a temporary file beside the target, renamed over it), and
whether an option names a file."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

from kvsched.errors import KvschedError


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", suffix: str = ".tmp") -> Iterator[IO]:
    """Open a temporary file beside `path`; when the block ends normally it replaces `path`
    with a plain file's permissions, otherwise it is removed, so `path` is either untouched or
    complete. An OSError becomes a KvschedError naming `path`. Text files are opened with
    newline="" (CSV writers choose their own line ends)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.resolve().parent)
    except OSError as exc:
        raise KvschedError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": "", "encoding": "utf-8"})) as f:
            yield f
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)           # mkstemp makes 0600
        os.replace(tmp, path)
    except OSError as exc:
        raise KvschedError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def names_a_file(given: str | Path) -> bool:
    """Whether an option's text names an existing regular file; text that cannot be a file name
    (too long, a NUL) names none, so the option is read as a name instead."""
    try:
        return Path(given).is_file()
    except (OSError, ValueError):
        return False
