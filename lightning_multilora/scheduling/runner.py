"""Event-driven execution of a plan: replan on every arrival and completion, retry failures a bounded
number of times. `SimulatedExecutor` runs tasks on a virtual clock (tests and what-if planning)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional

from lightning_multilora.scheduling.task_scheduler import Placement, Task, TaskScheduler


@dataclass(order=True)
class _Completion:
    time: float
    task_id: str = field(compare=False)
    ok: bool = field(compare=False)


class SimulatedExecutor:
    """Runs tasks on a virtual clock. ``actual`` gives a task's real duration when it differs from the
    estimate (an early exit ends a task early); ``failures`` how many of its first attempts fail (halfway)."""

    def __init__(self, actual: Optional[dict[str, float]] = None, failures: Optional[dict[str, int]] = None) -> None:
        self.actual = dict(actual or {})
        self.failures = dict(failures or {})
        self._events: list[_Completion] = []
        self.started: list[tuple[float, str, tuple[int, ...]]] = []

    def start(self, task: Task, gpu_ids: tuple[int, ...], now: float) -> None:
        self.started.append((now, task.id, gpu_ids))
        duration = self.actual.get(task.id, task.duration)
        fails = self.failures.get(task.id, 0) > 0
        if fails:
            self.failures[task.id] -= 1
            duration /= 2
        heapq.heappush(self._events, _Completion(now + duration, task.id, not fails))

    def next_completion_time(self) -> Optional[float]:
        return self._events[0].time if self._events else None

    def pop_completion(self) -> _Completion:
        return heapq.heappop(self._events)


@dataclass
class RunRecord:
    task_id: str
    state: str  # "finished" | "failed"
    attempts: int
    start: float
    end: float
    gpu_ids: tuple[int, ...]


class ScheduleRunner:
    """Keeps a living plan: tasks arrive (now or later), start when the plan says, and every arrival or
    completion triggers a replan with the running tasks fixed. A failed task is retried up to
    ``max_retries`` times, then marked failed."""

    def __init__(self, scheduler: TaskScheduler, executor: SimulatedExecutor, max_retries: int = 2) -> None:
        if max_retries < 0:
            raise ValueError(f"`max_retries` must be >= 0, got {max_retries}")
        self.scheduler, self.executor, self.max_retries = scheduler, executor, max_retries
        self.now = 0.0
        self.pending: dict[str, Task] = {}
        self.running: dict[str, tuple[Task, Placement]] = {}
        self.arrivals: list[tuple[float, int, Task]] = []
        self.attempts: dict[str, int] = {}
        self.records: dict[str, RunRecord] = {}
        self.replans = 0

    def submit(self, task: Task, at: Optional[float] = None) -> None:
        known = set(self.pending) | set(self.running) | set(self.records) | {t.id for _, _, t in self.arrivals}
        if task.id in known:
            raise ValueError(f"duplicate task id {task.id!r}; task ids must be unique")
        if task.gpus > self.scheduler.num_gpus:
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs but only {self.scheduler.num_gpus} exist")
        heapq.heappush(self.arrivals, (self.now if at is None else at, len(self.arrivals), task))

    def _replan_and_start(self) -> Optional[float]:
        """Replan from now; start what the plan starts now; return the next planned start after now."""
        if not self.pending:
            return None
        running = {tid: Placement(tid, p.start, max(p.end, self.now + self.scheduler.resolution_s), p.gpu_ids)
                   for tid, (_, p) in self.running.items()}
        plan = self.scheduler.plan(list(self.pending.values()), running=running, now=self.now)
        self.replans += 1
        later = []
        for tid, task in list(self.pending.items()):
            p = plan.placements[tid]
            if p.start <= self.now + 1e-9:
                del self.pending[tid]
                self.attempts[tid] = self.attempts.get(tid, 0) + 1
                self.running[tid] = (task, Placement(tid, self.now, self.now + task.duration, p.gpu_ids))
                self.executor.start(task, p.gpu_ids, self.now)
            else:
                later.append(p.start)
        return min(later) if later else None

    def run(self) -> dict[str, RunRecord]:
        next_start = None
        while self.arrivals or self.pending or self.running:
            while self.arrivals and self.arrivals[0][0] <= self.now + 1e-9:
                _, _, task = heapq.heappop(self.arrivals)
                self.pending[task.id] = task
            next_start = self._replan_and_start()
            times = [t for t in (self.executor.next_completion_time(), next_start,
                                 self.arrivals[0][0] if self.arrivals else None) if t is not None]
            if not times:
                raise RuntimeError(f"tasks {sorted(self.pending)} can never start")
            self.now = max(self.now, min(times))
            while self.executor.next_completion_time() is not None and self.executor.next_completion_time() <= self.now + 1e-9:
                done = self.executor.pop_completion()
                task, placement = self.running.pop(done.task_id)
                if done.ok:
                    self.records[task.id] = RunRecord(task.id, "finished", self.attempts[task.id], placement.start,
                                                      done.time, placement.gpu_ids)
                elif self.attempts[task.id] <= self.max_retries:
                    self.pending[task.id] = task  # retry: back to the plan
                else:
                    self.records[task.id] = RunRecord(task.id, "failed", self.attempts[task.id], placement.start,
                                                      done.time, placement.gpu_ids)
        return self.records

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.records.values()), default=0.0)
