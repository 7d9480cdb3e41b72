"""Scheduler layer: a small reference scheduler that drives a `KVCacheManager`.

Sits above the manager facade and below the simulator; policies are injected objects.
"""

from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput, StepRecord
from pagedkv.sched.policy import (
    FCFSPolicy,
    FCFSWaitingQueue,
    PriorityPolicy,
    PriorityWaitingQueue,
    SchedulingPolicy,
    WaitingQueue,
)
from pagedkv.sched.scheduler import Scheduler

__all__ = [
    "FCFSPolicy",
    "FCFSWaitingQueue",
    "PriorityPolicy",
    "PriorityWaitingQueue",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "StepRecord",
    "WaitingQueue",
]
