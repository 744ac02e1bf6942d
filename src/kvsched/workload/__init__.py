"""Workloads: requests, length distributions, arrival processes, trace readers, phases and
tiers, presets and statistics."""
from kvsched.workload.arrivals import (Closed, GammaArrivals, Piecewise, Poisson, PoissonTruncated, Replay, Sinusoid,
                                       parse_arrivals, poisson_arrivals)
from kvsched.workload.config import load_workload_file
from kvsched.workload.lengths import (Empirical, Fixed, Gamma, Geometric, Jitter, Quantiles, Uniform,
                                      empirical, parse_length)
from kvsched.workload.presets import PRESETS
from kvsched.workload.readers import read_trace
from kvsched.workload.request import Ragged, Request, Segments, Tier, Workload
from kvsched.workload.sharing import Sessions, SharedPrefix, ThinkTime
from kvsched.workload.spec import Phase, RequestType, TierShare, WorkloadSpec
from kvsched.workload.stats import describe
from kvsched.workload.synthetic import mixture, synthetic
from kvsched.workload.traces import export_csv, load_trace

__all__ = ["Closed", "GammaArrivals", "Piecewise", "Poisson", "PoissonTruncated", "Replay", "Sinusoid", "parse_arrivals",
           "poisson_arrivals", "load_workload_file", "Empirical", "Fixed", "Gamma", "Geometric",
           "Jitter", "Quantiles", "Uniform", "empirical", "parse_length", "PRESETS", "read_trace",
           "Ragged", "Request", "Segments", "Sessions", "SharedPrefix", "ThinkTime", "Tier", "Workload",
           "Phase", "RequestType", "TierShare",
           "WorkloadSpec", "describe", "mixture", "synthetic", "export_csv", "load_trace"]
