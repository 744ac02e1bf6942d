"""The public traces shipped inside the package (kvsched/data/traces/), found by name.

A trace is named by a path or by a name: `azure2023-conv` or `azure2023-conv.csv`. A path that
exists is read as it is. A name is looked up in $KVSCHED_TRACES (a folder of the user's, when
set) and then among the bundled traces; nothing else is ever substituted. Bundled files are
xz-compressed copies of their sources (traces.toml: source, commit, licence, citation, sha256),
decompressed when read and checked against their sha256 (once per process while the file is
unchanged), so a damaged install is an error, not a different workload. Any trace path ending
in .xz or .gz is read decompressed.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import io
import lzma
import os
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvsched.errors import KvschedError

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
MANIFEST = DATA / "traces.toml"
SUFFIXES = (".csv", ".jsonl")           # what a bare name may leave out
OPENERS = {".xz": lzma.open, ".gz": gzip.open}
DAMAGED = (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error)     # what a damaged stream raises


class TraceNotFound(KvschedError):
    """No file and no trace of that name."""


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
    try:
        with open(MANIFEST, "rb") as f:
            table = tomllib.load(f)
        return {name: BundledTrace(name, **fields) for name, fields in table.items()}
    except (OSError, ValueError, TypeError) as exc:     # ValueError: TOMLDecodeError, UnicodeDecodeError
        raise KvschedError(f"the bundled traces' manifest {MANIFEST} cannot be read ({exc}); "
                           "reinstall kvsched") from None


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
    folder = _path(env, "KVSCHED_TRACES")
    if not _probe(folder, Path.is_dir, "KVSCHED_TRACES"):
        raise KvschedError(f"KVSCHED_TRACES={env!r} is not a folder")
    return folder


def _no_nul(text: str, what: str) -> None:
    if "\0" in text:
        raise KvschedError(f"{what} {text!r}: a NUL character cannot be in a file name")


def _path(text: str, what: str) -> Path:
    _no_nul(text, what)
    try:
        return Path(text).expanduser()
    except RuntimeError as exc:         # ~user that does not exist
        raise KvschedError(f"{what} {text!r}: {exc}") from None


def _probe(path: Path, test, what: str) -> bool:
    """`test(path)`, with the file system's refusals (a name too long, no permission) as errors."""
    try:
        return test(path)
    except OSError as exc:
        raise KvschedError(f"{what} {str(path)!r}: {exc.strerror or exc}") from None


def _entry(path: Path) -> bool:
    """Whether a folder entry of that name exists (a broken link too); OSError if it cannot be told."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _readable(path: Path) -> bool:
    """An entry that can be read as a trace: not a folder, not a broken or looping link."""
    return path.exists() and not path.is_dir()


def is_name(text: str) -> bool:
    """A bare name (no folder part), which may name a trace in $KVSCHED_TRACES or the bundle."""
    return bool(text) and "/" not in text and "\\" not in text and text not in (".", "..")


def _candidates(folder: Path, name: str) -> list[Path]:
    """NAME, NAME.csv, NAME.jsonl, each as it is or compressed (.gz, .xz)."""
    return [folder / (base + z) for base in (name, *(name + s for s in SUFFIXES)) for z in ("", *OPENERS)]


def find_named(name: str) -> Path:
    """The trace called `name` (NAME, NAME.csv or NAME.jsonl, maybe .gz/.xz): in $KVSCHED_TRACES
    if there, else bundled; never a path in the working folder (the presets use this). An entry
    of that name in $KVSCHED_TRACES that cannot be read (a folder with no file beside it, a broken
    link) is an error, not a reason to fall back to the bundled copy."""
    _no_nul(name, "trace")
    folder = user_folder()
    if folder is not None:
        found = [c for c in _candidates(folder, name) if _probe(c, _entry, "trace")]
        readable = [c for c in found if _probe(c, _readable, "trace")]
        if readable:
            return readable[0]
        if found:
            raise KvschedError(f"{found[0]} (in KVSCHED_TRACES) is not a readable file")
    shipped = _bundled(name)
    if shipped is None:
        where = f" in KVSCHED_TRACES={os.environ['KVSCHED_TRACES']} or" if folder is not None else ""
        raise TraceNotFound(f"trace {name!r} not found:{where} no bundled trace of that name "
                            f"(bundled: {', '.join(catalogue())})")
    return shipped.path


def find_trace(given: str | Path, base: Path | None = None) -> Path:
    """The file a trace argument names: a path whose entry exists (relative to `base` when
    given, as a workload file's are; a broken link too, whose reading then fails), else a bare
    name (`find_named`). Anything else is an error listing the bundled names."""
    text = str(given)
    if not text.strip():
        raise KvschedError("a trace must be named: the file or bundled trace name is empty")
    path = _path(text, "trace")
    if base is not None and not path.is_absolute():
        path = base / path
    if _probe(path, _entry, "trace"):
        return path
    if is_name(text):
        try:
            return find_named(text)
        except TraceNotFound:
            pass
    where = " nor in KVSCHED_TRACES," if os.environ.get("KVSCHED_TRACES") else ""
    raise TraceNotFound(f"trace {text!r} not found: no such file,{where} and no bundled trace of that name "
                        f"(bundled: {', '.join(catalogue())})")


def bundled_trace(path: Path) -> BundledTrace | None:
    """The bundled trace stored at `path`, if it is one."""
    if path.parent != DATA:
        return None
    return next((t for t in catalogue().values() if t.path == path), None)


def label(path: Path) -> str:
    """How messages name a trace file: a bundled one by its name, others by their path."""
    t = bundled_trace(path)
    return f"{t.file} (bundled)" if t is not None else str(path)


def open_trace(path: Path) -> BinaryIO:
    """A trace file opened for reading bytes: a bundled one decompressed and checked against its
    sha256 (traces.toml), another .xz/.gz file decompressed as read, any other file as it is."""
    t = bundled_trace(path)
    if t is not None:
        return io.BytesIO(_checked(t))
    opener = OPENERS.get(path.suffix.lower())
    return opener(path, "rb") if opener else open(path, "rb")


def compressed(path: Path) -> bool:
    """Read through a decompressor: its integrity check (gzip's CRC, xz's) comes at the end."""
    return bundled_trace(path) is None and path.suffix.lower() in OPENERS


def _checked(t: BundledTrace) -> bytes:
    """The decompressed file, checked against its sha256. Kept per process while the file's size
    and time stay as they were: a sweep's or capacity search's points read the same trace again
    and again, and its decompression and hash were a quarter of each read."""
    try:
        st = t.path.stat()
    except OSError as exc:
        raise KvschedError(f"bundled trace {t.path}: cannot be read ({exc}); reinstall kvsched") from None
    return _verified(t.path, st.st_size, st.st_mtime_ns, t.sha256)


@functools.lru_cache(maxsize=16)
def _verified(path: Path, size: int, mtime_ns: int, sha256: str) -> bytes:
    try:
        data = lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as exc:
        raise KvschedError(f"bundled trace {path}: cannot be read ({exc}); reinstall kvsched") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise KvschedError(f"bundled trace {path}: its content does not match its sha256 in {MANIFEST.name} "
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
