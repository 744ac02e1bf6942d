"""Files written whole or not at all (a temporary file beside the target, renamed over it), and
whether an option names a file.

A writer replaces only a regular file or creates an absent one: a FIFO, a device, a folder or
a symbolic link at the target is refused, so `--out /dev/full` never turns a device node into
a file and a link never leads a write out of its folder. Temporary names carry the writer's
process id (`.NAME.PID.*`), so a later write to NAME removes what a killed writer left
(`stale_temporaries` says which names count).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator

from kvsched.errors import KvschedError

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_writable(path: str | Path, flag: str = "") -> Path:
    """`path` if a writer may replace it (absent, or a regular file that is not a link), else a
    KvschedError naming it (and `flag`, the option that gave it). Call it before long work, so
    a bad target is refused first; the writers call it again just before they rename."""
    path = Path(path)
    who = f"{flag} {path}" if flag else str(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except (OSError, ValueError) as exc:
        raise KvschedError(f"cannot write {who}: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISREG(mode):
        return path
    if stat.S_ISDIR(mode):
        raise KvschedError(f"{who} is a folder: it must name a file to write")
    kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
    raise KvschedError(f"cannot write {who}: it is {kind}; kvsched writes only regular files "
                       "(give a new file name)")


def temp_prefix(name: str) -> str:
    """The prefix of this process's temporary names for target `name`."""
    return f".{name}.{os.getpid()}."


STALE_AFTER = 60.0      # seconds: a temporary younger than this is never taken for a killed writer's


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):    # another user's live process, or not a pid at all
        return True
    return True


def is_temporary(entry: str, name: str | None = None, suffix: str = "") -> re.Match | None:
    """Whether file name `entry` is a kvsched temporary for target `name` (any target: None):
    `.NAME.PID.`, then `old.` for a moved-aside run, tempfile's 8 random characters and
    `suffix`. The match's group 1 is the writer's pid."""
    target = ".+" if name is None else re.escape(name)
    return re.fullmatch(rf"\.{target}\.(\d{{1,7}})\.(?:old\.)?[a-z0-9_]{{8}}{re.escape(suffix)}", entry)


def stale_temporaries(folder: Path, name: str | None, suffix: str = "") -> list[Path]:
    """Temporary files and folders for target `name` (any: None) in `folder` left by writers
    that are no longer running (killed before they could clean up). Only exact kvsched
    temporary names count (`is_temporary`), owned by this user, at least STALE_AFTER seconds
    old (a writer in another PID namespace sharing the folder is not judged by a pid it does
    not have here), whose pid runs no process."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    now = time.time()
    for e in entries:
        m = is_temporary(e.name, name, suffix)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.geteuid() and now - st.st_mtime >= STALE_AFTER and not _alive(int(m.group(1))):
            found.append(Path(e.path))
    return found


def remove(path: Path) -> None:
    """Remove a file or a folder tree (not following links); quietly if gone or not ours."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", suffix: str = ".tmp", clean: bool = True) -> Iterator[IO]:
    """Open a temporary file beside `path`; when the block ends normally it replaces `path`
    with a plain file's permissions, otherwise it is removed, so `path` is either untouched or
    complete. A target that is not a regular file is refused (`check_writable`). An OSError
    becomes a KvschedError naming `path`. Text files are opened with newline="" (CSV writers
    choose their own line ends). `clean`: first remove what killed writers of `path` left
    (a scan of the folder: a caller writing many files into one folder cleans it once itself)."""
    path = check_writable(path)
    folder = Path(os.path.abspath(path)).parent
    if clean:
        for stale in stale_temporaries(folder, path.name, suffix):
            remove(stale)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=suffix, dir=folder)
    except OSError as exc:
        raise KvschedError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": "", "encoding": "utf-8"})) as f:
            yield f
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)           # mkstemp makes 0600
        check_writable(path)                    # it may have changed while we wrote
        os.replace(tmp, folder / path.name)
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
