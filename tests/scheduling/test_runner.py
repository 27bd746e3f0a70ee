"""ScheduleRunner on the simulated executor: early completions, arrivals and retried failures."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_multilora.scheduling import ScheduleRunner, SimulatedExecutor, Task, TaskScheduler
from lightning_multilora.scheduling.task_file import records_table


def no_gpu_shared_at_once(records) -> bool:
    for a, b in itertools.combinations(records.values(), 2):
        if a.start < b.end and b.start < a.end and set(a.gpu_ids) & set(b.gpu_ids):
            return False
    return True


def test_early_completions_shorten_the_run_and_replanning_fills_the_gap():
    tasks = [Task("a", 10, 2), Task("b", 10, 2), Task("c", 10, 2), Task("d", 4, 1)]
    planned = TaskScheduler(4).plan(tasks).makespan
    executor = SimulatedExecutor(actual={"a": 3, "b": 3})
    runner = ScheduleRunner(TaskScheduler(4), executor)
    for t in tasks:
        runner.submit(t)
    records = runner.run()
    assert {r.state for r in records.values()} == {"finished"}
    assert runner.makespan < planned
    # (several plans are optimal; whichever ran) the first early exit freed GPUs that were used at once
    early = min((records[x] for x in "ab"), key=lambda r: r.end)
    assert early.end - early.start == pytest.approx(3)
    assert any(start == pytest.approx(early.end) for start, _, _ in executor.started)
    assert no_gpu_shared_at_once(records) and runner.replans >= 2


def test_a_task_far_past_its_estimate_brings_few_replans():
    """A 60 s estimate that runs an hour, another task waiting for its GPU: the runner assumed it would end a tick
    from now at every replan, so replanned every tick (3542 solves); now it waits ever longer between them."""
    runner = ScheduleRunner(TaskScheduler(1, time_limit_s=0.2), SimulatedExecutor(actual={"slow": 3600}))
    runner.submit(Task("slow", 60, 1))
    runner.submit(Task("next", 60, 1), at=1)
    records = runner.run()
    assert records["next"].start == pytest.approx(3600) and records["next"].state == "finished"
    assert runner.replans <= 15


def test_a_task_arriving_mid_run_is_planned_in():
    runner = ScheduleRunner(TaskScheduler(2), SimulatedExecutor())
    runner.submit(Task("long", 10, 1))
    runner.submit(Task("late", 5, 2), at=4)
    records = runner.run()
    assert records["late"].start == pytest.approx(10)  # it needs both GPUs: after `long`
    assert runner.makespan == pytest.approx(15)


def test_failures_are_retried_then_marked_failed():
    runner = ScheduleRunner(TaskScheduler(2), SimulatedExecutor(failures={"flaky": 1, "broken": 5}), max_retries=2)
    for t in (Task("flaky", 4, 1), Task("broken", 4, 1), Task("fine", 4, 1)):
        runner.submit(t)
    records = runner.run()
    assert (records["flaky"].state, records["flaky"].attempts) == ("finished", 2)
    assert (records["broken"].state, records["broken"].attempts) == ("failed", 3)
    assert records["fine"].state == "finished"


def test_bad_submissions():
    runner = ScheduleRunner(TaskScheduler(2), SimulatedExecutor())
    runner.submit(Task("a", 1, 1))
    with pytest.raises(ValueError, match="duplicate task id 'a'"):
        runner.submit(Task("a", 2, 1))
    with pytest.raises(ValueError, match="needs 3 GPUs but only 2 exist"):
        runner.submit(Task("b", 2, 3))
    for value in (-1, 1.5, "2", None):  # (a string or None: a bare TypeError; 1.5 was taken)
        with pytest.raises(ValueError, match=rf"ScheduleRunner: `max_retries` must be an integer >= 0, got "
                                             rf"{re.escape(repr(value))}"):
            ScheduleRunner(TaskScheduler(2), SimulatedExecutor(), max_retries=value)
    with pytest.raises(ValueError, match=r"ScheduleRunner.submit: `at` must be a time in seconds .*got 'soon'"):
        runner.submit(Task("c", 2, 1), at="soon")  # (was taken; the next submit crashed inside heapq)


def runner_with_a_task_polled_at_1s(*tasks: Task) -> ScheduleRunner:
    """A runner on 2 GPUs (simulated) whose ``poll`` hands it ``tasks`` once the clock reaches 1 s."""
    executor = SimulatedExecutor()
    sent: list[Task] = []

    def poll() -> list[Task]:
        if executor.now() >= 1.0 and not sent:
            sent.extend(tasks)
            return sent
        return []

    return ScheduleRunner(TaskScheduler(2), executor, poll=poll)


def test_a_polled_task_starts_on_a_free_gpu_while_another_task_runs():
    """New tasks are looked for every `POLL_S` whether or not a task runs: one that arrives while a long task holds
    one of two GPUs starts on the other at once, not when the long task ends; without arrivals or completions
    nothing is replanned."""
    from lightning_multilora.scheduling.runner import POLL_S

    runner = runner_with_a_task_polled_at_1s(Task("new", 2, 1))
    runner.submit(Task("long", 30, 1))
    records = runner.run()
    assert records["new"].start == pytest.approx(1.0, abs=POLL_S) and records["new"].end < 30
    assert records["long"].end == 30 and set(records["new"].gpu_ids) != set(records["long"].gpu_ids)
    assert runner.replans == 2  # the first task and the arrival (the completions leave nothing pending)


def test_the_runner_follows_the_plan_it_was_given_until_it_cannot():
    """The plan shown to the user (`multilora schedule` prints it) is the one run: a given plan is followed as it is
    (here a valid one that a solve would not choose: b after a on one GPU, the other idle). When a task runs past its
    estimate, the next start finds its GPU busy and the rest is replanned."""
    from lightning_multilora.scheduling.task_scheduler import Placement, Schedule

    tasks = [Task("a", 2, 1), Task("b", 2, 1)]
    given = Schedule({"a": Placement("a", 0, 2, (0,)), "b": Placement("b", 2, 4, (0,))}, 4.0, False, 0.0)
    runner = ScheduleRunner(TaskScheduler(2), SimulatedExecutor(), plan=given)
    for t in tasks:
        runner.submit(t)
    records = runner.run()
    assert (records["a"].start, records["a"].gpu_ids, records["b"].start, records["b"].gpu_ids) == (0, (0,), 2, (0,))
    # a runs 5 s, not 2: at 2 s b's GPU is busy, so b is replanned onto the free one
    runner = ScheduleRunner(TaskScheduler(2), SimulatedExecutor(actual={"a": 5}), plan=given)
    for t in tasks:
        runner.submit(t)
    records = runner.run()
    assert records["b"].start == 2 and records["b"].gpu_ids == (1,) and no_gpu_shared_at_once(records)


@pytest.mark.parametrize("resolution_s", [1.0, 60.0])
def test_a_plan_followed_from_a_clock_a_little_past_zero_starts_one_task_a_gpu(resolution_s):
    """A wall clock reads a few milliseconds at the first start: the given plan's tasks of tick 0 and tick 1 both
    fall on the first tick from now. The second waits for the first on their GPU (it ran both at once)."""
    duration = resolution_s / 2  # a task that fits in one tick, another after it on the same GPU
    tasks = [Task("first", duration, 1), Task("second", duration, 1)]
    scheduler = TaskScheduler(1, resolution_s=resolution_s)
    executor = SimulatedExecutor(actual={"first": 3 * resolution_s})
    executor._now = 0.003
    runner = ScheduleRunner(scheduler, executor, plan=scheduler.plan(tasks))
    for t in tasks:
        runner.submit(t)
    records = runner.run()
    assert [s[1] for s in executor.started] == ["first", "second"]
    assert records["second"].start >= records["first"].end and no_gpu_shared_at_once(records)


def test_a_polled_task_no_plan_can_hold_is_refused_and_the_running_ones_go_on(capsys):
    """A task dropped in while others run that makes the plan too long for the solver (a typo'd duration) is
    recorded as failed, said, and the schedule goes on: the running task is not stopped, a task that came with it
    runs."""
    runner = runner_with_a_task_polled_at_1s(Task("good", 3, 1), Task("huge", 2.0e12, 1))  # (polled together)
    runner.submit(Task("running", 5, 1))
    records = runner.run()
    assert records["running"].state == "finished" and records["running"].end == 5
    assert records["huge"].state == "failed" and "at most" in records["huge"].detail
    assert records["good"].state == "finished"  # (refused with the one too long, it was)
    assert "refused task 'huge'" in capsys.readouterr().out


def test_an_oserror_starting_a_task_is_a_failed_attempt_and_the_others_go_on():
    """An executor raising OSError on a start (a log name the file system refuses: ENAMETOOLONG) crashed the runner,
    stopping the tasks already running; it is that task's failed attempt, retried, then failed."""

    class RefusingExecutor(SimulatedExecutor):
        def start(self, task, gpu_ids):
            if task.id == "refused":
                raise OSError(36, "File name too long")
            super().start(task, gpu_ids)

    runner = ScheduleRunner(TaskScheduler(2), RefusingExecutor(), max_retries=1)
    for t in (Task("long", 10, 1), Task("refused", 2, 1), Task("after", 2, 1)):
        runner.submit(t)
    records = runner.run()
    assert (records["long"].state, records["long"].end) == ("finished", 10)
    assert records["after"].state == "finished"
    refused = records["refused"]
    assert (refused.state, refused.attempts) == ("failed", 2) and "File name too long" in refused.detail


def test_replans_solve_briefly_and_the_plans_starts_do_not_wait_for_them():
    """A replan solved for the scheduler's whole `time_limit_s` (5 s per completion, GPUs idle): it solves for 1 s at
    most. What the plan followed starts at a completion starts before the replan's solve."""
    events = []

    class Recording(SimulatedExecutor):
        def start(self, task, gpu_ids):
            events.append(("start", task.id))
            super().start(task, gpu_ids)

    scheduler = TaskScheduler(1, time_limit_s=30)
    solve = scheduler.plan

    def plan(*args, **kwargs):
        events.append(("plan", kwargs.get("time_limit_s")))
        return solve(*args, **kwargs)

    scheduler.plan = plan
    runner = ScheduleRunner(scheduler, Recording())
    for t in (Task("a", 2, 1), Task("b", 2, 1), Task("c", 2, 1)):
        runner.submit(t)
    records = runner.run()
    # the first plan solves for the scheduler's limit (optimal at once here), the replan for 1 s
    assert runner.replan_time_limit_s == 1.0
    assert [e for e in events if e[0] == "plan"] == [("plan", None), ("plan", 1.0)]
    first, second, third = sorted(records.values(), key=lambda r: r.start)
    assert (first.start, second.start, third.start) == (0, 2, 4)
    assert events.index(("start", second.task_id)) < events.index(("plan", 1.0))  # at the first end, before the solve
    assert ScheduleRunner(TaskScheduler(1, time_limit_s=0.3), SimulatedExecutor()).replan_time_limit_s == 0.3
    with pytest.raises(ValueError, match=r"`replan_time_limit_s` must be a number of seconds > 0"):
        ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), replan_time_limit_s=0)


def test_a_virtual_clock_polls_at_each_event_not_every_half_second():
    """``poll_s=None``: a simulation asks ``poll`` at each event, jumping from one to the next (every `POLL_S` of its
    clock, a 2,000,000 s task made 4,000,000 polls)."""
    calls = []

    def poll():
        calls.append(1)
        return [Task("late", 5, 1)] if len(calls) == 1 else []

    runner = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), poll=poll, poll_s=None)
    runner.submit(Task("long", 2e6, 1))
    records = runner.run()
    assert records["late"].state == records["long"].state == "finished" and runner.makespan == 2e6 + 5
    assert len(calls) <= 5
    with pytest.raises(ValueError, match=r"`poll_s` must be a number of seconds > 0 \(or None"):
        ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), poll_s=0)


def read_records_file(path):
    import json

    return {e["id"]: e for e in json.loads(path.read_text())["tasks"]}


def test_records_are_kept_on_disk_after_every_completion_and_a_resume_skips_what_finished(tmp_path, capsys):
    """The records were kept in memory alone: a re-run redid finished work. They are written after every completion
    (``b`` starts after ``a`` ends: the file already says ``a`` finished), a failed task's every attempt's start is
    kept, and a resumed run skips ``a``, says so, runs ``b`` again numbering its attempts on, and keeps ``a``'s
    entry."""
    path = tmp_path / "records.json"
    seen_at_b = {}

    class Peeking(SimulatedExecutor):
        def start(self, task, gpu_ids, attempt=None):
            if task.id == "b" and not seen_at_b:
                seen_at_b.update(read_records_file(path))
            self.attempts_seen = [*getattr(self, "attempts_seen", []), (task.id, attempt)]
            super().start(task, gpu_ids)

    executor = Peeking(failures={"b": 2})
    runner = ScheduleRunner(TaskScheduler(1), executor, max_retries=1, records=path)
    runner.submit(Task("a", 2, 1))
    runner.submit(Task("b", 4, 1))
    records = runner.run()
    assert seen_at_b["a"]["state"] == "finished" and seen_at_b["a"]["end"] == 2
    assert executor.attempts_seen == [("a", 1), ("b", 1), ("b", 2)]
    failed = records["b"]
    assert (failed.state, failed.attempts, failed.starts) == ("failed", 2, (2.0, 4.0)) and failed.start == 4.0
    on_disk = read_records_file(path)
    assert on_disk["b"]["state"] == "failed" and on_disk["b"]["starts"] == [2.0, 4.0]
    assert {k: on_disk["a"][k] for k in ("state", "attempts", "start", "end")} == {
        "state": "finished", "attempts": 1, "start": 0.0, "end": 2.0}
    assert "attempts started at 2.0, 4.0" in records_table(records)

    executor = Peeking()
    resumed = ScheduleRunner(TaskScheduler(1), executor, max_retries=1, records=path, resume=True)
    resumed.submit(Task("a", 2, 1))
    resumed.submit(Task("b", 4, 1))
    records = resumed.run()
    assert executor.attempts_seen == [("b", 3)] and set(records) == {"b"} and records["b"].state == "finished"
    assert "resume: skipped 1 task that" in capsys.readouterr().out and set(resumed.skipped) == {"a"}
    on_disk = read_records_file(path)
    assert on_disk["a"]["state"] == "finished" and on_disk["a"]["end"] == 2.0  # (kept from the first run)
    assert (on_disk["b"]["state"], on_disk["b"]["attempts"]) == ("finished", 3)
    with pytest.raises(ValueError, match="`resume` reads the `records` file"):
        ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), resume=True)
    path.write_text('{"tasks": [{"id": "a", "sta')  # (cut short)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the schedule's records do not read")):
        ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), records=path, resume=True)


def test_a_run_that_raises_stops_the_running_tasks_and_records_them_stopped(tmp_path):
    """An exception out of `run` (here a failing ``poll``; Ctrl-C alike) left the executor's tasks running and
    nothing on disk: the executor is stopped and the running task recorded "stopped", in the file too."""
    stops = []

    class Stoppable(SimulatedExecutor):
        def stop(self):
            stops.append(sorted(e.task_id for e in self._events))
            return []

    calls = {"n": 0}

    def poll():
        calls["n"] += 1
        if calls["n"] == 3:  # (the long task is running by now)
            raise RuntimeError("the inbox broke")
        return []

    path = tmp_path / "records.json"
    runner = ScheduleRunner(TaskScheduler(1), Stoppable(), poll=poll, poll_s=1.0, records=path)
    runner.submit(Task("long", 10, 1))
    with pytest.raises(RuntimeError, match="the inbox broke"):
        runner.run()
    assert stops == [["long"]]
    record = runner.records["long"]
    assert record.state == "stopped" and "the schedule raised RuntimeError: the inbox broke" in record.detail
    assert read_records_file(path)["long"]["state"] == "stopped"


def test_a_second_ctrl_c_while_the_tasks_stop_keeps_their_exit_statuses_and_logs(tmp_path):
    """A second Ctrl-C cut the executor's stop short: the exit statuses and logs of the tasks it stopped (found by
    the caller's stop again) were never recorded. The stop finishes first; the interrupt is raised after it."""
    import os
    import signal
    import time

    from lightning_multilora.scheduling.executors import Completion

    class CtrlCTwice(SimulatedExecutor):
        def wait(self, deadline):
            if self.started and not getattr(self, "interrupted", False):  # (the first Ctrl-C, the task running)
                self.interrupted = True
                raise KeyboardInterrupt
            return super().wait(deadline)

        def stop(self):
            os.kill(os.getpid(), signal.SIGINT)  # (the second, as the tasks stop)
            time.sleep(0.2)
            return [Completion(self.now(), "long", False, "stopped", -15, "logs/long.1.log")]

    path = tmp_path / "records.json"
    runner = ScheduleRunner(TaskScheduler(1), CtrlCTwice(), poll=lambda: [], poll_s=1.0, records=path)
    runner.submit(Task("long", 10, 1))
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    record = runner.records["long"]
    assert (record.state, record.exit_code, record.log) == ("stopped", -15, "logs/long.1.log")
    saved = read_records_file(path)["long"]
    assert (saved["exit_code"], saved["log"]) == (-15, "logs/long.1.log")


def test_a_schedule_that_dies_unrecorded_leaves_its_running_and_retried_tasks_for_a_resume(tmp_path):
    """The file held the ended tasks alone: after a ``kill -9`` (the OOM killer) in a task's second attempt, a resume
    told it attempt 1 again (a script taking attempt 1 for "start afresh" wiped its progress), its retries anew."""
    path = tmp_path / "records.json"
    died = {}

    class Dying(SimulatedExecutor):  # (the file as each wait begins: what a kill -9 then would leave)
        def wait(self, deadline):
            if any(e.task_id == "flaky" for e in self._events) and [t for _, t, _ in self.started].count("flaky") == 2:
                died.setdefault("file", path.read_text())
            return super().wait(deadline)

    runner = ScheduleRunner(TaskScheduler(2), Dying(failures={"flaky": 1}), max_retries=2, records=path)
    for task in (Task("flaky", 4, 1), Task("quick", 1, 1), Task("long", 20, 1)):
        runner.submit(task)
    runner.run()
    path.write_text(died["file"])
    on_disk = read_records_file(path)
    assert (on_disk["flaky"]["state"], on_disk["flaky"]["attempts"]) == ("stopped", 2), on_disk["flaky"]
    assert "unrecorded: killed?" in on_disk["flaky"]["detail"] and on_disk["quick"]["state"] == "finished"
    assert on_disk["long"]["state"] == "stopped" and on_disk["long"]["attempts"] == 1

    class Seeing(SimulatedExecutor):
        def start(self, task, gpu_ids, attempt=None):
            self.seen = [*getattr(self, "seen", []), (task.id, attempt)]
            super().start(task, gpu_ids)

    executor = Seeing()
    resumed = ScheduleRunner(TaskScheduler(2), executor, max_retries=2, records=path, resume=True)
    for task in (Task("flaky", 4, 1), Task("quick", 1, 1), Task("long", 20, 1)):
        resumed.submit(task)
    records = resumed.run()
    assert sorted(executor.seen) == [("flaky", 3), ("long", 2)]
    assert {t: r.state for t, r in records.items()} == {"flaky": "finished", "long": "finished"}


def test_anything_an_executor_raises_on_a_start_is_a_failed_attempt():
    """Only `OSError` was caught: a ValueError out of ``start`` crashed the schedule, its running tasks left running."""

    class Raising(SimulatedExecutor):
        def start(self, task, gpu_ids):
            if task.id == "bad":
                raise ValueError("no such thing")
            super().start(task, gpu_ids)

    runner = ScheduleRunner(TaskScheduler(2), Raising(), max_retries=1)
    for t in (Task("long", 10, 1), Task("bad", 2, 1)):
        runner.submit(t)
    records = runner.run()
    assert (records["long"].state, records["long"].end) == ("finished", 10)
    assert (records["bad"].state, records["bad"].attempts) == ("failed", 2)
    assert "could not start: ValueError: no such thing" in records["bad"].detail


def test_a_task_without_a_command_is_refused_when_submitted_to_an_executor_that_runs_commands(tmp_path):
    """A task without a command crashed `run` after the others had started (they kept running): refused at submit,
    naming it; a simulation needs no command."""
    from lightning_multilora.scheduling import LocalExecutor

    runner = ScheduleRunner(TaskScheduler(2), LocalExecutor(tmp_path), max_retries=0)
    runner.submit(Task("a", 5, 1, ["sleep", "5"]))
    with pytest.raises(ValueError, match=r"task 'b' has no `command` to run \(LocalExecutor runs"):
        runner.submit(Task("b", 3))
    assert runner.known_ids() == {"a"} and not runner.running
    ScheduleRunner(TaskScheduler(2), SimulatedExecutor()).submit(Task("b", 3))


def test_a_resume_stopped_before_it_retried_a_failed_task_keeps_that_tasks_record(tmp_path):
    """The records file held only the resumed run's records (and the skipped finished ones): stopped before it
    retried a task that had failed, it dropped that task's entry, so the next resume numbered its attempts from 1
    again and its failure was lost."""
    import json

    records = tmp_path / "records.json"
    tasks = lambda: [Task("x", 10, 1, ["true"]), Task("y", 5, 1, ["true"])]  # noqa: E731
    first = ScheduleRunner(TaskScheduler(1, 1.0), SimulatedExecutor(failures={"x": 99, "y": 99}), max_retries=1,
                           records=records, poll_s=None)
    for task in tasks():
        first.submit(task)
    first.run()

    polls = itertools.count()

    def interrupt():  # (Ctrl+C while the resumed run's first task runs)
        if next(polls) == 1:
            raise KeyboardInterrupt
        return []

    resumed = ScheduleRunner(TaskScheduler(1, 1.0), SimulatedExecutor(), max_retries=1, records=records,
                             resume=True, poll=interrupt, poll_s=None)
    for task in tasks():
        resumed.submit(task)
    with pytest.raises(KeyboardInterrupt):
        resumed.run()
    entries = {e["id"]: (e["state"], e["attempts"]) for e in json.loads(records.read_text())["tasks"]}
    waiting = {tid: attempts for tid, (state, attempts) in entries.items() if state != "finished"}
    assert set(entries) == {"x", "y"} and waiting and set(waiting.values()) == {2}  # (the first run's two tries)
    again = ScheduleRunner(TaskScheduler(1, 1.0), SimulatedExecutor(), max_retries=1, records=records, resume=True,
                           poll_s=None)
    assert again._attempts_before == waiting
