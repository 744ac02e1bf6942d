"""The KV link of a prefill replica (prefill/decode disaggregation, rad-slai.txt Algorithm 5
and DistServe): one FIFO link per prefill replica, so transfers queue behind each other.

A transfer of B bytes that is ready at t starts when the link is free, holds the link for
B / bandwidth seconds, and lands `latency` seconds after it leaves the link (latency is
propagation: it does not hold the link).
"""
from __future__ import annotations

from kvsched.errors import KvschedError


class KVLink:
    def __init__(self, bandwidth_gbps: float, latency_s: float = 0.0) -> None:
        if not 0 < bandwidth_gbps < float("inf"):
            raise KvschedError(f"--kv-transfer-bandwidth must be > 0 GB/s and finite, got {bandwidth_gbps}")
        if not 0 <= latency_s < float("inf"):
            raise KvschedError(f"--kv-transfer-latency must be >= 0 s and finite, got {latency_s}")
        self.bytes_per_s = bandwidth_gbps * 1e9
        self.latency = latency_s
        self.free_at = 0.0
        self.busy = 0.0

    def send(self, t: float, nbytes: float) -> float:
        """Queue a transfer ready at t; returns when it lands."""
        start = t if t > self.free_at else self.free_at
        hold = nbytes / self.bytes_per_s
        self.free_at = start + hold
        self.busy += hold
        return self.free_at + self.latency
