"""Worker processes whose life is tied to the process that started them (`capacity`, `sweep`).

A driver killed by any signal, SIGKILL included (a job scheduler, a test timeout, the OOM
killer), cannot stop its workers itself. So each worker arranges its own end: on Linux the
kernel sends it SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG); everywhere, a daemon
thread also checks every half second that its parent is still the one that started it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

from kvsched import compiled

PR_SET_PDEATHSIG = 1        # linux/prctl.h
WATCH_SECONDS = 0.5


def _kill_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that created it ends (the pool's creator
    thread is the driver's main thread, or a thread that lives as long as the pool)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):       # no libc by that name: the watch thread still runs
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # alive, someone else's (a reused pid)
        return True
    return True


def start_worker(driver: int) -> None:
    """A pool's initializer (`driver`: the pid of the process that made the pool). Ctrl-C stops
    the driver, which stops its workers, so a worker ignores SIGINT itself; a worker whose driver
    died exits at once instead of computing points that nobody will store."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message=compiled.WARNING)      # the driver said it
    parent = os.getppid()               # the driver (fork, spawn) or a fork server of its own
    _kill_with_parent()
    if parent != driver and not _alive(driver) or os.getppid() != parent:    # it died before prctl held
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="kvsched-parent-watch").start()


def pool(workers: int) -> ProcessPoolExecutor:
    """A process pool whose workers exit when this process dies, however it dies. The engine is
    loaded here first, so that its warning about a stale compiled module (kvsched/compiled.py)
    shows once, from this process, not from every worker or inside a point's silenced warnings."""
    importlib.import_module("kvsched.sim.replica")
    return ProcessPoolExecutor(max_workers=workers, initializer=start_worker, initargs=(os.getpid(),))
