"""kvsched: scheduling LLM inference under KV-cache memory limits.

Start with `kvsched.run.simulate(Scenario(workload), "vllm-v1")`; workloads come from
`kvsched.workload`, policies from `kvsched.policies`, batch-time models from `kvsched.cost`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvsched import compiled as _compiled
from kvsched.errors import KvschedError, PlanError

_compiled.install()         # a compiled module runs only while its .py is what it was built from

if TYPE_CHECKING:
    from kvsched.run import Result, Scenario, simulate

__version__ = "0.1.0"
__all__ = ["KvschedError", "PlanError", "Result", "Scenario", "simulate", "__version__"]

_FROM_RUN = ("Result", "Scenario", "simulate")


def __getattr__(name: str) -> Any:
    """`kvsched.simulate` etc. import kvsched.run (numpy, the simulator) on first use only, so
    that `import kvsched` (and the `kvsched` command's start-up) stays cheap (PEP 562)."""
    if name in _FROM_RUN:
        import kvsched.run
        return getattr(kvsched.run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_RUN))
