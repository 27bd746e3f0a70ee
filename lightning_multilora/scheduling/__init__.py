"""Scheduling: memory models and admission on one GPU, placing training tasks on GPUs (CP-SAT)."""

from lightning_multilora.scheduling.admission import (
    AdmissionController,
    CPSATAdmission,
    choose_gradient_checkpointing,
    fit_predictor,
    simulate_sweep,
)
from lightning_multilora.scheduling.memory import (
    AnalyticMemoryModel,
    MemoryFit,
    MemoryFitCache,
    MemoryPoint,
    ModelShape,
)
from lightning_multilora.scheduling.profiler import MemoryProfiler, ThroughputProfiler, cuda_step_measure
from lightning_multilora.scheduling.executors import Completion, LocalExecutor, SimulatedExecutor
from lightning_multilora.scheduling.packing import Job, PackingPlanner, plora_greedy
from lightning_multilora.scheduling.ray_executor import RayExecutor  # (Ray itself is imported when one is made)
from lightning_multilora.scheduling.runner import RunRecord, ScheduleRunner
from lightning_multilora.scheduling.task_scheduler import (
    Placement,
    Schedule,
    Task,
    TaskScheduler,
    list_schedule,
    lower_bound,
)

__all__ = ["AdmissionController", "CPSATAdmission", "simulate_sweep", "AnalyticMemoryModel", "MemoryFit", "MemoryFitCache", "MemoryPoint",
           "MemoryProfiler", "ModelShape", "ThroughputProfiler", "choose_gradient_checkpointing",
           "Completion", "Job", "LocalExecutor", "PackingPlanner", "plora_greedy", "RayExecutor", "cuda_step_measure", "fit_predictor", "Placement", "RunRecord", "Schedule", "ScheduleRunner", "SimulatedExecutor", "Task", "TaskScheduler",
           "list_schedule", "lower_bound"]
