"""The public traces shipped inside the package (kvsched/data/traces/), found by name.

A trace is named by a path or by a name: `azure2023-conv` or `azure2023-conv.csv`. A path that
exists is read as it is. A name is looked up in $KVSCHED_TRACES (a folder of the user's, when
set) and then among the bundled traces; nothing else is ever substituted. Bundled files are
xz-compressed copies of their sources (traces.toml: source, commit, licence, citation, sha256),
decompressed when read and checked against their sha256 each time, so a damaged install is an
error, not a different workload. Any trace path ending in .xz or .gz is read decompressed.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import io
import lzma
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvsched.errors import KvschedError

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
MANIFEST = DATA / "traces.toml"
SUFFIXES = (".csv", ".jsonl")           # what a bare name may leave out
OPENERS = {".xz": lzma.open, ".gz": gzip.open}


@dataclass(frozen=True)
class BundledTrace:
    """One shipped trace, as traces.toml describes it."""
    name: str
    file: str                           # the source file's name; shipped as `file`.xz
    what: str
    rows: int
    sha256: str                         # of the decompressed file
    source: str
    commit: str
    license: str
    cite: str

    @property
    def path(self) -> Path:
        return DATA / f"{self.file}.xz"


@functools.cache
def catalogue() -> dict[str, BundledTrace]:
    """The bundled traces by name, in traces.toml's order."""
    with open(MANIFEST, "rb") as f:
        table = tomllib.load(f)
    return {name: BundledTrace(name, **fields) for name, fields in table.items()}


def _bundled(name: str) -> BundledTrace | None:
    """The bundled trace called `name`, with or without its file's suffix."""
    for t in catalogue().values():
        if name in (t.name, t.file):
            return t
    return None


def user_folder() -> Path | None:
    """$KVSCHED_TRACES, the folder searched before the bundled traces (None: unset)."""
    env = os.environ.get("KVSCHED_TRACES", "")
    if not env:
        return None
    folder = Path(env).expanduser()
    if not folder.is_dir():
        raise KvschedError(f"KVSCHED_TRACES={env!r} is not a folder")
    return folder


def find_trace(given: str | Path, base: Path | None = None) -> Path:
    """The file a trace argument names: an existing path (relative to `base` when given, as a
    workload file's are), else NAME or NAME.csv/.jsonl in $KVSCHED_TRACES, else the bundled
    trace of that name. Anything else is an error listing the bundled names."""
    path = Path(given).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if path.exists():
        return path
    text = str(given)
    if "/" not in text and "\\" not in text and text not in ("", ".", ".."):
        folder = user_folder()
        if folder is not None:
            for candidate in (text, *(text + s for s in SUFFIXES)):
                if (folder / candidate).is_file():
                    return folder / candidate
        shipped = _bundled(text)
        if shipped is not None:
            return shipped.path
    where = f" (nor in KVSCHED_TRACES={os.environ['KVSCHED_TRACES']})" if os.environ.get("KVSCHED_TRACES") else ""
    raise KvschedError(f"trace {text!r} not found: no such file{where}, and no bundled trace of that name "
                       f"(bundled: {', '.join(catalogue())})")


def is_bundled(path: Path) -> bool:
    return any(path == t.path for t in catalogue().values())


def open_trace(path: Path) -> BinaryIO:
    """A trace file opened for reading bytes: a bundled one decompressed and checked against its
    sha256 (traces.toml), another .xz/.gz file decompressed as read, any other file as it is."""
    for t in catalogue().values():
        if path == t.path:
            return io.BytesIO(_checked(t))
    opener = OPENERS.get(path.suffix.lower())
    return opener(path, "rb") if opener else open(path, "rb")


def _checked(t: BundledTrace) -> bytes:
    try:
        data = lzma.decompress(t.path.read_bytes())
    except (OSError, lzma.LZMAError) as exc:
        raise KvschedError(f"bundled trace {t.path}: cannot be read ({exc}); reinstall kvsched") from None
    if hashlib.sha256(data).hexdigest() != t.sha256:
        raise KvschedError(f"bundled trace {t.path}: its content does not match its sha256 in {MANIFEST.name} "
                           "(a damaged install?); reinstall kvsched")
    return data


def notice() -> str:
    """NOTICE's text: each bundled file's source, commit, licence and citation."""
    head = ("kvsched ships these public workload traces as xz-compressed, byte-for-byte copies of\n"
            "their source files (kvsched/data/traces/). Their licences are their own:\n")
    parts = [head]
    for t in catalogue().values():
        parts.append(f"\n{t.file}\n  {t.what}\n  source:  {t.source} @ {t.commit}\n"
                     f"  licence: {t.license}\n  cite:    {t.cite}\n")
    return "".join(parts)
