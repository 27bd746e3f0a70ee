"""ScheduleRunner on the simulated executor: early completions, arrivals and retried failures."""

from __future__ import annotations

import itertools

import pytest

from lightning_multilora.scheduling import ScheduleRunner, SimulatedExecutor, Task, TaskScheduler


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
    with pytest.raises(ValueError, match="`max_retries` must be >= 0"):
        ScheduleRunner(TaskScheduler(2), SimulatedExecutor(), max_retries=-1)
