"""kvsched: scheduling LLM inference under KV-cache memory limits.

Start with `kvsched.run.simulate(Scenario(workload), "vllm-v1")`; workloads come from
`kvsched.workload`, policies from `kvsched.policies`, batch-time models from `kvsched.cost`.
"""
from kvsched.errors import KvschedError, PlanError
from kvsched.run import Result, Scenario, simulate

__version__ = "0.1.0"
__all__ = ["KvschedError", "PlanError", "Result", "Scenario", "simulate", "__version__"]
