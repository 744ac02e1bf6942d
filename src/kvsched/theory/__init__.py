"""Closed forms of the four papers: stability and capacity, the fluid benchmark, WAIT and
Nested WAIT thresholds, exclusive batching, RAD capacity; `plan` applies them to a workload."""
from kvsched.theory import eb, fluid, rad, stability, wait

__all__ = ["eb", "fluid", "rad", "stability", "wait"]
