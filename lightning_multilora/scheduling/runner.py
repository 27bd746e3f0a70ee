"""Event-driven execution of a plan: replan on every arrival and completion, retry failures a bounded
number of times. The executor (`SimulatedExecutor`, `LocalExecutor`) runs the tasks and keeps the clock; the task
records can be kept on disk (`records`) and a re-run can skip what an earlier one finished (``resume``)."""

from __future__ import annotations

import datetime
import heapq
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_multilora.arguments import check_bool, check_int, check_real
from lightning_multilora.scheduling.executors import Completion
from lightning_multilora.signals import stop_signals_deferred
from lightning_multilora.scheduling.records import (changed_warning, definition_changes, ids_text, read_records,
                                                    record_entry, write_records)
from lightning_multilora.scheduling.task_scheduler import Placement, Schedule, Task, TaskScheduler


POLL_S = 0.5  # how often a running schedule with a ``poll`` asks it for new tasks (executor seconds)
# the most a replan solves (or the scheduler's own `time_limit_s`, where lower): the GPUs freed by the completion that
# brought it idle meanwhile, and the plan is made again at the next completion anyway (17 replans of a 5 s limit: 85 s)
REPLAN_TIME_LIMIT_S = 1.0


@dataclass
class RunRecord:
    """How a task ended: ``state`` "finished", "failed" or "stopped" (running, or waiting for a retry, when the
    schedule stopped); ``start`` / ``end`` and ``gpu_ids`` of its last attempt, ``starts`` of every attempt of this run
    (a failed task's first try included); ``exit_code`` and ``log`` of the last attempt where the executor says."""

    task_id: str
    state: str
    attempts: int
    start: float
    end: float
    gpu_ids: tuple[int, ...]
    detail: str = ""
    starts: tuple[float, ...] = ()
    exit_code: Optional[int] = None
    log: Optional[str] = None


class ScheduleRunner:
    """Keeps a living plan: tasks arrive (now or later), start when the plan says, and every arrival or
    completion triggers a replan with the running tasks fixed (between them the plan is followed as it is). A
    failed task is retried up to ``max_retries`` times, then marked failed (an executor's `OSError` on starting it, a
    log that cannot be made, is a failed attempt too: the running tasks go on; a `Completion` marked ``final``, a
    program found nowhere, is not retried). ``poll()``, when given, is asked for
    newly submitted tasks every ``poll_s`` (executor seconds; None: at each event alone, for a virtual clock that jumps
    from one to the next) while the schedule runs, tasks running or not (a running schedule accepts new tasks). A
    replan solves for ``replan_time_limit_s`` at most (default: `REPLAN_TIME_LIMIT_S`, or the scheduler's limit where
    lower; a first plan, the scheduler's); what the plan followed starts now starts before it (GPUs do not wait).

    ``records`` (a file, e.g. ``<log_dir>/records.json``; `lightning_multilora.scheduling.records`): the task records
    are written there as tasks start, after every completion and when the schedule stops, the tasks running then (or
    waiting for a retry) as "stopped" (so while it runs too: what a resume takes them for, should the schedule die
    unrecorded). ``resume``: a task that file records as finished is not run again (said, and its entry kept), unless
    the record's definition of it (its ``command``, ``gpus``, ``torchrun``) is not the task's: another task file's
    records over the same folder, or the task since changed (warned of, naming the fields; it runs, its entry kept
    until it is recorded anew); one recorded failed or stopped runs again, its attempts numbered on from the recorded
    ones (the retries, ``max_retries`` of them, are this run's). An executor whose ``start`` takes an ``attempt`` is
    told the attempt's number (1, 2...; `LocalExecutor` and `RayExecutor` put it in the task's
    ``MULTILORA_TASK_ATTEMPT``); anything ``start`` raises is that task's failed attempt, and if `run` itself raises
    (Ctrl-C, SIGTERM as one, a ``poll`` that fails), the attempts that had ended meanwhile are recorded as they
    ended, the executor's running tasks stopped (its ``stop()``) and recorded, before it does."""

    def __init__(self, scheduler: TaskScheduler, executor: Any, max_retries: int = 2,
                 poll: Optional[Callable[[], list[Task]]] = None, plan: Optional[Schedule] = None,
                 poll_s: Optional[float] = POLL_S, replan_time_limit_s: Optional[float] = None,
                 records: Optional[str | Path] = None, resume: bool = False) -> None:
        check_int("ScheduleRunner", "max_retries", max_retries, 0)
        check_bool("ScheduleRunner", "resume", resume)
        if resume and records is None:
            raise ValueError("ScheduleRunner: `resume` reads the `records` file of an earlier run: give `records`")
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
        self.records_path = Path(records) if records is not None else None
        self.resume = resume
        # resumed: the tasks finished before (skipped when submitted, their entries kept), the attempts made before
        earlier = read_records(self.records_path) if resume else None
        self.earlier_finished = {tid: e for tid, e in (earlier or {}).items() if e["state"] == "finished"}
        # (failed or stopped before: kept in the file until this run records the task anew)
        self._earlier_unfinished = {tid: e for tid, e in (earlier or {}).items() if e["state"] != "finished"}
        self._attempts_before = {tid: int(e.get("attempts") or 0) for tid, e in (earlier or {}).items()
                                 if e["state"] != "finished" and isinstance(e.get("attempts"), int)}
        self.skipped: dict[str, dict[str, Any]] = {}  # submitted, recorded finished by an earlier run: not run
        self._tasks: dict[str, Task] = {}  # every task submitted, by id (its definition goes into its record)
        self._added: set[str] = set()  # the tasks added while a schedule ran (`submit`'s ``added``)
        self._unsaid: list[str] = []  # skipped tasks not said yet
        self._tries: dict[str, int] = {}  # this run's attempts of a task (the retries count these)
        self._starts: dict[str, list[float]] = {}
        self._last_failure: dict[str, str] = {}
        self.stopped_running: list[str] = []  # the tasks `stop` stopped as they ran
        self.started_at = _clock_origin(executor)
        self._save_error: Optional[str] = None
        if resume and earlier is None:
            print(f"resume: no records at {self.records_path}: every task runs", flush=True)
        try:  # (a start that takes the attempt's number is told it)
            params = inspect.signature(executor.start).parameters.values()
            self._pass_attempt = any(p.name == "attempt" or p.kind is p.VAR_KEYWORD for p in params)
        except (TypeError, ValueError):
            self._pass_attempt = False

    def known_ids(self) -> set[str]:
        """Ids of every task submitted so far (waiting, running, ended, or skipped as finished before)."""
        return (set(self.pending) | set(self.running) | set(self.records) | set(self.skipped)
                | {t.id for _, _, t in self.arrivals})

    def submit(self, task: Task, at: Optional[float] = None, added: bool = False) -> None:
        """Adds a task (at ``at`` on the executor's clock, default now). Checked here, before any task starts: a task
        an executor that runs commands (``needs_command``) could not run is refused, naming it. Resumed, a task the
        records say finished is skipped (`skipped`), unless they record another definition of it (warned of: it
        runs). ``added``: a task added while a schedule ran (``poll``'s, an inbox's), which its record says, for a
        resume to run it again from there."""
        if task.id in self.known_ids():
            raise ValueError(f"duplicate task id {task.id!r}; task ids must be unique")
        if task.gpus > self.scheduler.num_gpus:
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs but only {self.scheduler.num_gpus} exist")
        nodes = getattr(self.scheduler, "nodes", None) or [self.scheduler.num_gpus]
        if task.gpus > max(nodes):
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs on one node, but the largest node has "
                             f"{max(nodes)}")
        if task.command is None and getattr(self.executor, "needs_command", False):
            raise ValueError(f"task {task.id!r} has no `command` to run ({type(self.executor).__name__} runs each "
                             "task's command; a SimulatedExecutor needs none)")
        if at is not None:
            check_real("ScheduleRunner.submit", "at", at, lambda v: True, "a time in seconds (the executor's clock)")
        self._tasks[task.id] = task
        if added:
            self._added.add(task.id)
        if task.id in self.earlier_finished:
            changes = definition_changes(self.earlier_finished[task.id], task)
            if not changes:
                self.skipped[task.id] = self.earlier_finished[task.id]
                self._unsaid.append(task.id)
                return
            # (the records of another task of that id: another task file's over the same log_dir, or this task
            # edited since; skipped, it never ran, the resume said "finished")
            print(changed_warning(self.records_path, task.id, changes), file=sys.stderr, flush=True)
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
        started = False
        for tid in due:
            p = plan.placements[tid]
            # planned for the first tick from now: start now, where its GPUs are free (a plan followed from time 0,
            # now a little past it, puts the tasks of tick 0 and of tick 1 there: one after another on a GPU)
            if p.start <= first_tick + 1e-9 and not busy & set(p.gpu_ids):
                busy |= set(p.gpu_ids)
                self._start(self.pending.pop(tid), p.gpu_ids)
                started = True
            else:
                later.append(p.start)
        if started:  # (their attempts, for a resume after the schedule died unrecorded; once for the tasks started)
            self.save_records()
        return min(later) if later else None

    def _start(self, task: Task, gpu_ids: tuple[int, ...]) -> None:
        self._tries[task.id] = self._tries.get(task.id, 0) + 1
        attempt = self._attempts_before.get(task.id, 0) + self._tries[task.id]
        self.attempts[task.id] = attempt
        now = self.now
        self._starts.setdefault(task.id, []).append(now)
        self.running[task.id] = (task, Placement(task.id, now, now + task.duration, gpu_ids))
        try:
            if self._pass_attempt:
                self.executor.start(task, gpu_ids, attempt=attempt)
            else:
                self.executor.start(task, gpu_ids)
        except Exception as err:  # noqa: BLE001 - (a log path refused, no command...): a failed attempt, not a crash
            said = str(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
            self._failed_starts.append(Completion(self.now, task.id, False, f"could not start: {said}"))


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
        """Runs the schedule to its end; the records of the tasks it ran. Whatever it raises, the executor's running
        tasks are stopped first, and recorded "stopped" (in `records`, and in the ``records`` file)."""
        try:
            records = self._run()
        except BaseException as err:
            said = f": {err}" if str(err) else ""
            self.stop(f"interrupted{said}" if isinstance(err, KeyboardInterrupt) else
                      f"the schedule raised {type(err).__name__}{said}")
            raise
        self.save_records()
        return records

    def _run(self) -> dict[str, RunRecord]:
        changed, next_start = True, None
        while True:
            self._say_skipped()
            polled = self.poll() if self.poll is not None else []
            for task in polled:
                self.submit(task, added=True)
            if polled:  # (recorded at once, "stopped" until it starts: its inbox file is marked done, and a schedule
                self.save_records()  # killed outright while it waited for a GPU lost it, a resume running it never)
            self._say_skipped()
            if not (self.arrivals or self.pending or self.running or getattr(self.poll, "waiting", bool)()):
                return self.records  # (a poll that waits for a file being written: read before the schedule ends)
            while self.arrivals and self.arrivals[0][0] <= self.now + 1e-9:
                _, _, task = heapq.heappop(self.arrivals)
                self.pending[task.id] = task
                changed = True
            if changed or (next_start is not None and next_start <= self.now + 1e-9):
                try:
                    next_start = self._replan_and_start(solve=changed)
                except ValueError as err:  # new tasks no plan can hold (too long): refused, the others go on
                    next_start = self._refuse_until_planned(polled, err)
                    self.save_records()
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
        ended = dict(starts=tuple(self._starts.get(task.id, ())), exit_code=getattr(done, "exit_code", None),
                     log=getattr(done, "log", None))
        if done.ok:
            self.records[task.id] = RunRecord(task.id, "finished", self.attempts[task.id], placement.start,
                                              done.time, placement.gpu_ids, **ended)
        elif self._tries[task.id] <= self.max_retries and not getattr(done, "final", False):
            self.pending[task.id] = task  # retry: back to the plan
            self._last_failure[task.id] = detail
        else:
            self.records[task.id] = RunRecord(task.id, "failed", self.attempts[task.id], placement.start,
                                              done.time, placement.gpu_ids, detail, **ended)
        self.save_records()

    def stop(self, why: str = "stopped") -> None:
        """Stops the executor's running tasks (its ``stop()``, where it has one) and records them, the tasks
        waiting for a retry and those an inbox added that have not started, as "stopped" (``why`` in their detail);
        writes the records. `run` calls it when it raises. First the attempts that have ended are recorded as they
        ended (`_complete_ended`). The records are written before the executor is asked to stop (a second Ctrl-C
        meanwhile keeps them), then again with the exit statuses and logs its ``stop()`` returns (`Completion`s)."""
        self._complete_ended()
        self.records.update(self._unended(why))
        stopping, placements = set(self.running), dict(self.running)
        self.stopped_running = sorted(stopping)
        self.running.clear()
        self._failed_starts.clear()
        self.save_records()
        with stop_signals_deferred():  # (a second Ctrl-C meanwhile waits for the stop, then is raised: it cut the
            # stop short, and the exit statuses and logs that the caller's stop found again were not recorded)
            stopped = self.executor.stop() if hasattr(self.executor, "stop") else None
            for done in stopped or ():
                record = self.records.get(done.task_id)
                if done.task_id in stopping and getattr(done, "exited", False):  # (its own process had exited, what
                    self.running[done.task_id] = placements[done.task_id]  # it left stopped: recorded as it ended)
                    self._complete(done)
                    self.stopped_running.remove(done.task_id)
                    if done.task_id in self.pending:  # (failed, a retry due: said, with its failure)
                        self.records[done.task_id] = self._unended(why)[done.task_id]
                elif done.task_id in stopping and record is not None:
                    record.exit_code, record.log = getattr(done, "exit_code", None), getattr(done, "log", None)
            if stopped:
                self.save_records()

    def _complete_ended(self) -> None:
        """Completes, as they ended, the attempts that ended before a stop: those whose start failed, and those whose
        process has exited, which the executor tells at once (``wait(now)``: a completion is collected in ``wait``
        alone, and a task that exited 0 while a replan solved was recorded "stopped", and run again by a resume)."""
        ended, self._failed_starts = self._failed_starts, []
        try:
            for _ in range(3):  # (an executor's own failed starts come first, then the exited processes)
                more = self.executor.wait(self.now)
                if not more:
                    break
                ended += more
        except Exception:  # noqa: BLE001 - (the executor that made `run` raise, say: the stop goes on)
            pass
        for done in ended:
            if done.task_id in self.running:
                self._complete(done)

    def _unended(self, why: str) -> dict[str, RunRecord]:
        """Records "stopped" for the tasks running, waiting for a retry, or added (an inbox's) and not started."""
        now, out = self.now, {}
        for tid, (task, placement) in self.running.items():
            out[tid] = RunRecord(tid, "stopped", self.attempts[tid], placement.start, now, placement.gpu_ids,
                                 f"stopped while running ({why})", tuple(self._starts.get(tid, ())))
        for tid in [t for t in self.pending if t in self._tries]:  # (failed, waiting for a retry)
            out[tid] = RunRecord(tid, "stopped", self.attempts[tid], self._starts[tid][-1], now, (),
                                 f"stopped waiting for a retry ({why}) after: {self._last_failure.get(tid)}",
                                 tuple(self._starts[tid]))
        waiting = [*self.pending, *(t.id for _, _, t in self.arrivals)]
        for tid in [t for t in waiting if t in self._added and t not in self.records and t not in out]:
            # (an inbox's, not started: its record is its only copy, for a resume to run it)
            out[tid] = RunRecord(tid, "stopped", self.attempts.get(tid, 0), now, now, (),
                                 f"stopped before it started ({why})")
        return out

    def save_records(self) -> None:
        """Writes the records to the ``records`` file (where given): this run's, and every entry of the earlier run
        (resumed) that this one has not recorded anew: the tasks it finished (skipped, or not submitted again: an
        inbox's), and those it recorded failed or stopped (a resume stopped before it retried them keeps them, and
        their attempts). A file that cannot be written is said once; the schedule goes on."""
        if self.records_path is None:
            return
        earlier = {**self.earlier_finished, **self._earlier_unfinished}
        # the tasks not ended yet, as a stop would record them: what a resume reads should the schedule die without
        # a word (kill -9, the OOM killer), to run them again and number their attempts on
        records = {**self._unended("the schedule ended here, unrecorded: killed?"), **self.records}
        entries = [*(dict(e) for tid, e in sorted(earlier.items()) if tid not in records),
                   *(record_entry(r, self.started_at, self._tasks.get(r.task_id), r.task_id in self._added)
                     for r in sorted(records.values(), key=lambda r: (r.start, r.task_id)))]
        try:
            write_records(self.records_path, entries, self.started_at)
        except OSError as err:  # (the tasks go on: their records are printed at the end)
            if self._save_error != str(err):
                self._save_error = str(err)
                print(f"could not write the task records to {self.records_path}: {err}", flush=True)

    def _say_skipped(self) -> None:
        if self._unsaid:
            print(f"resume: skipped {len(self._unsaid)} task{'s' if len(self._unsaid) > 1 else ''} that "
                  f"{self.records_path} records as finished: {ids_text(self._unsaid)}", flush=True)
            self._unsaid = []

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.records.values()), default=0.0)


def _clock_origin(executor: Any) -> str:
    """When ``executor``'s clock read 0, on the wall clock (to the second, with its time zone): the records' times
    count from it (a virtual clock's: from now)."""
    origin = time.time() - max(0.0, float(executor.now()))
    return datetime.datetime.fromtimestamp(origin).astimezone().isoformat(timespec="seconds")
