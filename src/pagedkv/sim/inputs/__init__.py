"""Simulator inputs: request traces and their loaders, seeded synthetic workloads, the block keys
of trace prompts and, from those keys, the future a replay's offline optimum reads.

Below every run mode; knows nothing of the scheduler or the manager.
"""

from pagedkv.sim.inputs.block_keys import TraceBlockHasher, TraceBlockKeys
from pagedkv.sim.inputs.future import ReplayOracle, hittable_keys
from pagedkv.sim.inputs.traces import Trace, TraceFormatError, TraceRequest, load_trace
from pagedkv.sim.inputs.workloads import WORKLOADS, WorkloadParams, make_workload

__all__ = [
    "WORKLOADS",
    "ReplayOracle",
    "Trace",
    "TraceBlockHasher",
    "TraceBlockKeys",
    "TraceFormatError",
    "TraceRequest",
    "WorkloadParams",
    "hittable_keys",
    "load_trace",
    "make_workload",
]
