"""Scheduling policies behind one interface (see `base.Plan` and `base.ServerView`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from kvsched.hardware import GPU
from kvsched.params import build
from kvsched.plugins import plain_instance, resolve
from kvsched.policies.base import Plan, Policy, ServerView
from kvsched.policies.baselines import Orca, RequestLevel, Sarathi, VllmV0, VllmV1
from kvsched.policies.distserve import DistServe
from kvsched.policies.eb import EbAdaptive, EbPlus, ExclusiveBatching
from kvsched.policies.rad import Rad
from kvsched.policies.slai import Slai
from kvsched.policies.wait import NestedWait, Wait

POLICIES: dict[str, type] = {cls.name: cls for cls in (VllmV1, Sarathi, VllmV0, Orca, RequestLevel,
                                                        ExclusiveBatching, EbAdaptive, EbPlus, Wait, NestedWait,
                                                        Rad, Slai, DistServe)}
# `kvsched compare`'s default: today's engines' schedulers, which run on any workload (the
# papers' policies need known output lengths, a cost model of their own or disaggregated pools)
BASELINES = tuple(cls.name for cls in (VllmV1, Sarathi, VllmV0, Orca, RequestLevel))
ENGINE_LIMITS = (VllmV1, VllmV0, Orca, ExclusiveBatching)   # take vLLM's token budget and max_num_seqs

SOURCES = {
    "vllm-v1": "vLLM v1 scheduler (vllm/v1/core/sched/scheduler.py)",
    "sarathi": "Sarathi-Serve; rad-slai.txt Appendix E.2, Algorithm 4",
    "vllm-v0": "vLLM v0 default scheduler (prefill-first exclusive batching)",
    "orca": "Orca (OSDI 22): iteration-level scheduling, no chunking",
    "request-level": "FasterTransformer style; rad-slai.txt Appendix E.1, Algorithm 3",
    "eb": "EB(k); exclusive-batching-eb.txt section 3.1, appendix D.6",
    "eb-adaptive": "EB(k*); exclusive-batching-eb.txt section 3.4, Algorithm 1 (appendix D.7)",
    "eb-plus": "EB+; exclusive-batching-eb.txt section 3.5, eq. (8)",
    "wait": "WAIT; fluid-wait-nested-wait.txt section 4, Algorithm 1",
    "nested-wait": "Nested WAIT; fluid-wait-nested-wait.txt section 5, Algorithm 2",
    "rad": "RAD; rad-slai.txt section 4.2, Algorithm 1 (Appendix D, Algorithm 2: variant=prefill-first)",
    "slai": "SLAI; rad-slai.txt section 6, as the authors' implementation (docs/rad-slai.md)",
    "distserve": "DistServe on disaggregated pools; rad-slai.txt Appendix E.3, Algorithm 5",
}


def engine_defaults(gpu: GPU) -> dict[str, int]:
    """vLLM's defaults: 8192 tokens / 1024 sequences on GPUs with >= 70 GiB, else 2048 / 256."""
    big = gpu.memory_gib >= 70
    return {"max_num_batched_tokens": 8192 if big else 2048, "max_num_seqs": 1024 if big else 256}


def policy_class(name: str, flag: str = "--policy") -> type:
    """The class `--policy NAME` names: a built-in, an installed plugin, or MODULE:CLASS /
    FILE.py:CLASS (kvsched/plugins.py); `flag` names the option in errors."""
    return resolve(name, "policy", POLICIES, "schedule", flag)


def make_policy(name: str, overrides: dict[str, Any], gpu: GPU) -> Policy:
    cls = policy_class(name)
    if not dataclasses.is_dataclass(cls):
        return plain_instance(cls, f"policy {name}", overrides, "--set")
    defaults = {}
    if issubclass(cls, ENGINE_LIMITS):
        defaults = engine_defaults(gpu)
        if cls is Orca:             # Orca has no token budget (its own field default: none)
            defaults.pop("max_num_batched_tokens")
    return build(cls, f"policy {name}", overrides, defaults)


__all__ = ["BASELINES", "POLICIES", "SOURCES", "Plan", "Policy", "ServerView", "make_policy", "engine_defaults", "policy_class"]
