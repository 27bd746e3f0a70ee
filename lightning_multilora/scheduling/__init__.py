"""Scheduling: placing training tasks on GPUs (CP-SAT makespan scheduler)."""

from lightning_multilora.scheduling.runner import RunRecord, ScheduleRunner, SimulatedExecutor
from lightning_multilora.scheduling.task_scheduler import (
    Placement,
    Schedule,
    Task,
    TaskScheduler,
    list_schedule,
    lower_bound,
)

__all__ = ["Placement", "RunRecord", "Schedule", "ScheduleRunner", "SimulatedExecutor", "Task", "TaskScheduler",
           "list_schedule", "lower_bound"]
