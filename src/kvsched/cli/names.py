"""Registry names and defaults that the CLI's option help texts and defaults show, copied
here so that `kvsched --help` does not import the engine (numpy, the simulator, the
policies, the cost models). tests/test_startup.py checks they equal the real registries.
Commands validate against the real registries, imported when they run."""
from __future__ import annotations

COST_MODELS = ("roofline", "constant", "linear", "phase", "eb-h200-qwen3-8b", "eb-rtx-pro-6000-qwen3-8b",
               "tiled", "tiled-mistral-7b-rtx-6000-ada")                     # kvsched.cost.COST_MODELS
CALIBRATION_MODELS = ("phase", "linear", "roofline", "tiled")               # kvsched.cost.calibrate.MODELS
POLICIES = ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level", "eb", "eb-adaptive", "eb-plus", "wait",
            "nested-wait", "rad", "slai", "distserve")                       # kvsched.policies.POLICIES
BASELINES = ("vllm-v1", "sarathi", "vllm-v0", "orca", "request-level")       # kvsched.policies.BASELINES
ROUTERS = ("round-robin", "random", "least-outstanding", "least-kv", "least-prefill",
           "prefix-affinity", "lora-affinity")                               # kvsched.sim.routers.ROUTERS
FORMATS = ("azure", "mooncake", "lengths", "csv", "jsonl", "auto")          # kvsched.workload.readers.FORMATS
DEFAULT_RATE = 8.0                                  # kvsched.workload.source.DEFAULT_RATE
DEFAULT_LENGTH = "jitter:512"                       # kvsched.workload.source.DEFAULT_LENGTH
DEFAULT_STALL_BATCHES = 100_000                     # kvsched.sim.replica.DEFAULT_STALL_BATCHES
