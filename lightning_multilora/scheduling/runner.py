"""Event-driven execution of a plan: replan on every arrival and completion, retry failures a bounded
number of times. The executor (`SimulatedExecutor`, `LocalExecutor`) runs the tasks and keeps the clock."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from lightning_multilora.arguments import check_int, check_real
from lightning_multilora.scheduling.executors import Completion
from lightning_multilora.scheduling.task_scheduler import Placement, Schedule, Task, TaskScheduler


POLL_S = 0.5  # how often a running schedule with a ``poll`` asks it for new tasks (executor seconds)
# the most a replan solves (or the scheduler's own `time_limit_s`, where lower): the GPUs freed by the completion that
# brought it idle meanwhile, and the plan is made again at the next completion anyway (17 replans of a 5 s limit: 85 s)
REPLAN_TIME_LIMIT_S = 1.0


@dataclass
class RunRecord:
    task_id: str
    state: str  # "finished" | "failed"
    attempts: int
    start: float
    end: float
    gpu_ids: tuple[int, ...]
    detail: str = ""


class ScheduleRunner:
    """Keeps a living plan: tasks arrive (now or later), start when the plan says, and every arrival or
    completion triggers a replan with the running tasks fixed (between them the plan is followed as it is). A
    failed task is retried up to ``max_retries`` times, then marked failed (an executor's `OSError` on starting it, a
    log that cannot be made, is a failed attempt too: the running tasks go on). ``poll()``, when given, is asked for
    newly submitted tasks every ``poll_s`` (executor seconds; None: at each event alone, for a virtual clock that jumps
    from one to the next) while the schedule runs, tasks running or not (a running schedule accepts new tasks). A
    replan solves for ``replan_time_limit_s`` at most (default: `REPLAN_TIME_LIMIT_S`, or the scheduler's limit where
    lower; a first plan, the scheduler's); what the plan followed starts now starts before it (GPUs do not wait)."""

    def __init__(self, scheduler: TaskScheduler, executor: Any, max_retries: int = 2,
                 poll: Optional[Callable[[], list[Task]]] = None, plan: Optional[Schedule] = None,
                 poll_s: Optional[float] = POLL_S, replan_time_limit_s: Optional[float] = None) -> None:
        check_int("ScheduleRunner", "max_retries", max_retries, 0)
        if poll_s is not None:
            check_real("ScheduleRunner", "poll_s", poll_s, lambda v: v > 0,
                       "a number of seconds > 0 (or None: at each event, for a virtual clock)")
        if replan_time_limit_s is None:
            replan_time_limit_s = min(REPLAN_TIME_LIMIT_S, scheduler.time_limit_s)
        check_real("ScheduleRunner", "replan_time_limit_s", replan_time_limit_s, lambda v: v > 0,
                   "a number of seconds > 0 (or None: the default)")
        self.scheduler, self.executor, self.max_retries = scheduler, executor, max_retries
        self.poll, self.poll_s, self.replan_time_limit_s = poll, poll_s, float(replan_time_limit_s)
        # the plan being followed; ``plan`` (one made from time 0 for exactly the tasks submitted before `run`,
        # the one a user was shown) is followed as it is until something changes
        self.plan: Optional[Schedule] = None
        self._given = plan
        self.pending: dict[str, Task] = {}
        self.running: dict[str, tuple[Task, Placement]] = {}
        self.arrivals: list[tuple[float, int, Task]] = []
        self.attempts: dict[str, int] = {}
        self.records: dict[str, RunRecord] = {}
        self.replans = 0
        self._failed_starts: list[Completion] = []  # starts the executor raised on, completed as failed attempts

    def known_ids(self) -> set[str]:
        """Ids of every task submitted so far (waiting, running or ended)."""
        return set(self.pending) | set(self.running) | set(self.records) | {t.id for _, _, t in self.arrivals}

    def submit(self, task: Task, at: Optional[float] = None) -> None:
        if task.id in self.known_ids():
            raise ValueError(f"duplicate task id {task.id!r}; task ids must be unique")
        if task.gpus > self.scheduler.num_gpus:
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs but only {self.scheduler.num_gpus} exist")
        if at is not None:
            check_real("ScheduleRunner.submit", "at", at, lambda v: True, "a time in seconds (the executor's clock)")
        heapq.heappush(self.arrivals, (self.now if at is None else at, len(self.arrivals), task))

    @property
    def now(self) -> float:
        return self.executor.now()

    def _replan_and_start(self, solve: bool = True) -> Optional[float]:
        """Replan from now (``solve``, or when the plan followed cannot go on: a task it starts now would find its
        GPUs busy, one before it having run past its estimate); start what the plan starts now; return the next
        planned start after now. Before a solve, what the plan followed starts now (on free GPUs) starts at once."""
        if not self.pending:
            return None
        given, self._given = self._given, None
        if given is not None and set(given.placements) == set(self.pending) and not self.running:
            self.plan, solve = given, False
        first_tick = self.scheduler._ticks(self.now) * self.scheduler.resolution_s  # the plan's time origin
        if not solve and self.plan is not None and set(self.pending) <= set(self.plan.placements):
            busy = {g for _, p in self.running.values() for g in p.gpu_ids}
            solve = any(busy & set(self.plan.placements[tid].gpu_ids) for tid in self.pending
                        if self.plan.placements[tid].start <= first_tick + 1e-9)
        else:
            solve = True
        if solve:
            if self.plan is not None:  # (running then, fixed in the solve: the new plan keeps them where they are)
                self._start_due(self.plan, first_tick)
            if not self.pending:
                return None
            running = {tid: Placement(tid, p.start, self._assumed_end(p), p.gpu_ids)
                       for tid, (_, p) in self.running.items()}
            limit = self.replan_time_limit_s if self.plan is not None else None  # (a first plan: the scheduler's)
            self.plan = self.scheduler.plan(list(self.pending.values()), running=running, now=self.now,
                                            time_limit_s=limit)
            self.replans += 1
            first_tick = self.scheduler._ticks(self.now) * self.scheduler.resolution_s  # (the solve took a while)
        return self._start_due(self.plan, first_tick)

    def _start_due(self, plan: Schedule, first_tick: float) -> Optional[float]:
        """Start the pending tasks that ``plan`` starts by ``first_tick``, where their GPUs are free; the next start
        it plans for the others (tasks it does not hold wait for a replan)."""
        later = []
        busy = {g for _, p in self.running.values() for g in p.gpu_ids}
        due = sorted((tid for tid in self.pending if tid in plan.placements), key=lambda t: plan.placements[t].start)
        for tid in due:
            p = plan.placements[tid]
            # planned for the first tick from now: start now, where its GPUs are free (a plan followed from time 0,
            # now a little past it, puts the tasks of tick 0 and of tick 1 there: one after another on a GPU)
            if p.start <= first_tick + 1e-9 and not busy & set(p.gpu_ids):
                busy |= set(p.gpu_ids)
                self._start(self.pending.pop(tid), p.gpu_ids)
            else:
                later.append(p.start)
        return min(later) if later else None

    def _start(self, task: Task, gpu_ids: tuple[int, ...]) -> None:
        self.attempts[task.id] = self.attempts.get(task.id, 0) + 1
        self.running[task.id] = (task, Placement(task.id, self.now, self.now + task.duration, gpu_ids))
        try:
            self.executor.start(task, gpu_ids)
        except OSError as err:  # (a log path the file system refuses...): this task's failed attempt, not a crash
            self._failed_starts.append(Completion(self.now, task.id, False, f"could not start: {err}"))

    def _assumed_end(self, p: Placement) -> float:
        """When a running task is taken to end, for a replan: its estimate, at least a tick from now; past its
        estimate, half as long again as it has run (at least a tick): a task running far past its estimate then
        brings a replan after ever longer waits (a 60 s estimate run for an hour, 11 replans), not one a tick (3542:
        the plan put the tasks waiting for its GPUs a tick from now, then found the GPUs still busy)."""
        res = self.scheduler.resolution_s
        if p.end > self.now:
            return max(p.end, self.now + res)
        return self.now + max(res, 0.5 * (self.now - p.start))

    def run(self) -> dict[str, RunRecord]:
        changed, next_start = True, None
        while True:
            polled = self.poll() if self.poll is not None else []
            for task in polled:
                self.submit(task)
            if not (self.arrivals or self.pending or self.running):
                return self.records
            while self.arrivals and self.arrivals[0][0] <= self.now + 1e-9:
                _, _, task = heapq.heappop(self.arrivals)
                self.pending[task.id] = task
                changed = True
            if changed or (next_start is not None and next_start <= self.now + 1e-9):
                try:
                    next_start = self._replan_and_start(solve=changed)
                except ValueError as err:  # new tasks no plan can hold (too long): refused, the others go on
                    next_start = self._refuse_until_planned(polled, err)
                changed = False
            if self._failed_starts:  # retried (replanned) or failed at once, as an executor's own failed starts
                failed, self._failed_starts = self._failed_starts, []
                for done in failed:
                    self._complete(done)
                changed = True
                continue
            deadlines = [t for t in (next_start, self.arrivals[0][0] if self.arrivals else None) if t is not None]
            polling = self.poll is not None and self.poll_s is not None
            if not self.running and not deadlines and not polling:
                raise RuntimeError(f"tasks {sorted(self.pending)} can never start")
            deadline = min(deadlines) if deadlines else None
            if polling:  # new tasks are looked for every `poll_s`, running tasks or not
                deadline = self.now + self.poll_s if deadline is None else min(deadline, self.now + self.poll_s)
            for done in self.executor.wait(deadline):
                self._complete(done)
                changed = True

    def _refuse_until_planned(self, polled: list[Task], err: ValueError) -> Optional[float]:
        """The plan failed on tasks just polled: refuse them longest first, one at a time, until it holds the rest
        (a task too long to plan is refused, not those that came with it)."""
        fresh = sorted((t for t in polled if t.id in self.pending), key=lambda t: -t.duration)
        while fresh:
            task = fresh.pop(0)
            del self.pending[task.id]
            self.records[task.id] = RunRecord(task.id, "failed", 0, self.now, self.now, (), f"refused: {err}")
            print(f"refused task {task.id!r}: {err}", flush=True)
            try:
                return self._replan_and_start(solve=True)
            except ValueError as again:
                err = again
        raise err

    def _complete(self, done: Any) -> None:
        task, placement = self.running.pop(done.task_id)
        detail = getattr(done, "detail", "")
        if done.ok:
            self.records[task.id] = RunRecord(task.id, "finished", self.attempts[task.id], placement.start,
                                              done.time, placement.gpu_ids)
        elif self.attempts[task.id] <= self.max_retries:
            self.pending[task.id] = task  # retry: back to the plan
        else:
            self.records[task.id] = RunRecord(task.id, "failed", self.attempts[task.id], placement.start,
                                              done.time, placement.gpu_ids, detail)

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.records.values()), default=0.0)
