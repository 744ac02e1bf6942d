"""Workloads: requests, length distributions, arrival processes, trace readers."""
from kvsched.workload.arrivals import poisson_arrivals
from kvsched.workload.lengths import (Empirical, Fixed, Gamma, Geometric, Jitter, Uniform,
                                      empirical, parse_length)
from kvsched.workload.request import Request, Tier, Workload
from kvsched.workload.synthetic import RequestType, mixture, synthetic
from kvsched.workload.traces import load_trace

__all__ = ["Empirical", "Fixed", "Gamma", "Geometric", "Jitter", "Uniform", "empirical",
           "parse_length", "poisson_arrivals", "Request", "Tier", "Workload", "RequestType",
           "mixture", "synthetic", "load_trace"]
