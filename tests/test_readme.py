"""The README works as written: every `kvsched ...` command in its code blocks exits 0, run in
order (a report after its sweep) from an empty temporary folder, and its Python examples run
(issue "First contact"). Nothing is read from outside the repository: traces are the bundled
ones, and $KVSCHED_TRACES is unset."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvsched.cost.phase import PhaseCost
from test_calibrate import PHASE, write_log

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS_VLLM = ("replay", "--engine", "vllm")     # the real engine's scheduler: the `vllm` extra
# Commands that take long here run with fewer requests (the README's figures are for its own):
SMALLER = {"capacity": ["--num-requests", "300"]}      # 48 s and 89 s on 2 cores, then about 5 s and 10 s


def code_blocks(text: str) -> tuple[list[str], list[str]]:
    """(lines of the indented code blocks, the ```python blocks) of a Markdown text."""
    indented, python, fence, language, previous_blank, inside = [], [], None, "", True, False
    for line in text.splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, language = [], line[3:].strip()
            else:
                if language == "python":
                    python.append("\n".join(fence))
                fence = None
            continue
        if fence is not None:
            fence.append(line)
            continue
        inside = line.startswith("    ") and (inside or previous_blank)
        if inside:
            indented.append(line[4:])
        previous_blank = not line.strip()
    return indented, python


def commands(text: str) -> list[list[str]]:
    """Every `kvsched ...` command of the indented code blocks: continuation lines joined, `&&`
    chains split, comments dropped."""
    out, pending = [], ""
    for line in code_blocks(text)[0]:
        line = f"{pending} {line.strip()}" if pending else line
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip()
            continue
        if line.lstrip().startswith("kvsched "):
            out += [shlex.split(part, comments=True) for part in line.split("&&")]
    return out


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVSCHED_TRACES", None)
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    extra = SMALLER.get(args[1], []) if len(args) > 1 else []
    return subprocess.run([sys.executable, "-m", "kvsched", *args[1:], *extra], cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=600)


def needs_vllm(args: list[str]) -> bool:
    return " ".join(NEEDS_VLLM) in " ".join(args)


def test_the_readme_has_its_commands():
    found = commands(README.read_text())
    assert len(found) >= 25 and found[0] == ["kvsched", "compare"]
    assert ["kvsched", "report", "sw1"] in found and sum(map(needs_vllm, found)) == 1


def test_every_readme_command_exits_0_from_an_empty_folder(tmp_path):
    """In order, in one folder: `report sw1` reads the sweep before it. `calibrate steps.csv`
    reads a real engine's step log (README: vLLM with KVSCHED_STEP_LOG); here it gets one made
    from a phase cost model."""
    write_log(tmp_path / "steps.csv", PhaseCost(**PHASE))
    failed = []
    for args in commands(README.read_text()):
        if needs_vllm(args):
            continue
        r = run(args, tmp_path)
        if r.returncode != 0:
            failed.append(f"{shlex.join(args)} -> exit {r.returncode}: {r.stderr.strip()[-400:]}")
    assert not failed, "\n".join(failed)
    assert (tmp_path / "sw1" / "report.html").is_file() and (tmp_path / "cost.json").is_file()


@pytest.mark.vllm
def test_the_readme_vllm_command_exits_0(tmp_path):
    pytest.importorskip("vllm")
    [args] = [a for a in commands(README.read_text()) if needs_vllm(a)]
    r = run(args, tmp_path)
    assert r.returncode == 0, r.stderr


def test_the_readme_python_examples_run_from_an_empty_folder(tmp_path):
    blocks = code_blocks(README.read_text())[1]
    assert len(blocks) >= 2 and all("simulate(" in b for b in blocks)
    script = "\n".join(blocks)          # one namespace: the second example uses the first's `w`
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\d+\.\d+ \d+\.\d+$", r.stdout, re.M)        # the first print: p99 ITL, throughput
