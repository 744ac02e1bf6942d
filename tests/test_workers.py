"""Worker processes die with their driver, however it dies (SIGKILL included), and the stored
points stay consistent: a re-run of the killed command completes (issue "First contact")."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc (Linux)")

COMMANDS = {
    "capacity": ["capacity", "-w", "sharegpt", "--policies", "vllm-v1", "--slo", "ttft:p99:2000",
                 "--rate", "20", "--seeds", "2", "--num-requests", "400"],           # 8 s on 2 cores
    "sweep": ["sweep", "--policies", "vllm-v1,sarathi", "--rates", "1,2,4,8,16", "--seeds", "0-9",
              "--num-requests", "3000"],                                           # 5 s on 2 cores
}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text[text.rindex(")") + 2:].split()[:2]
    return state, int(ppid)


def children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            s = _stat(int(entry))
            if s is not None and s[1] == pid and s[0] != "Z":
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    s = _stat(pid)
    return s is not None and s[0] != "Z"       # a zombie has exited (its new parent may not reap it)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_workers_exit_when_the_driver_is_killed(tmp_path, command):
    args = [sys.executable, "-m", "kvsched", *COMMANDS[command], "--jobs", "2", "--out", str(tmp_path / "out")]
    driver = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(workers := children(driver.pid)) < 2:
        assert driver.poll() is None, driver.stderr.read().decode()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    time.sleep(0.5)                                 # the workers are computing
    assert driver.poll() is None, "the command finished before the kill: make it larger"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    driver.stderr.close()
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [w for w in workers if alive(w)]
    for w in left:                                  # do not leave them to the next test
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed driver by 10 s"
    if command == "capacity":                       # it writes its folder whole, at the end
        assert not (tmp_path / "out").exists()
        return
    stored = len(list((tmp_path / "out" / "points").glob("*.json")))   # a re-run resumes from them
    rerun = subprocess.run([*args, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["skipped"] == stored and summary["done"] + stored == summary["points"] == 100


def test_a_worker_killed_on_its_own_is_a_one_line_error(tmp_path):
    """The OOM killer takes a worker: the driver says so in one line (exit 2), no traceback."""
    args = [sys.executable, "-m", "kvsched", *COMMANDS["capacity"], "--jobs", "2"]
    driver = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (workers := children(driver.pid)):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read()
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(workers[0], signal.SIGKILL)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 2 and err.startswith("kvsched: error: a worker process died") and err.count("\n") == 1, err
