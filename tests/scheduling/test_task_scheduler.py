"""TaskScheduler: optimal makespans (checked by brute force), valid GPU ids, replanning, bad tasks."""

from __future__ import annotations

import itertools
import random
import re
import warnings

import pytest

from lightning_multilora.scheduling import Placement, Task, TaskScheduler, list_schedule, lower_bound


def brute_force_makespan(tasks: list[Task], gpus: int) -> int:
    """The optimum over all integer start times (small instances only)."""
    horizon = int(sum(t.duration for t in tasks))
    best = horizon
    for starts in itertools.product(range(horizon), repeat=len(tasks)):
        end = max(s + t.duration for s, t in zip(starts, tasks))
        if end >= best:
            continue
        if all(sum(t.gpus for s, t in zip(starts, tasks) if s <= time < s + t.duration) <= gpus for time in range(int(end))):
            best = int(end)
    return best


def check_valid(schedule, tasks: list[Task], gpus: int) -> None:
    by_id = {t.id: t for t in tasks}
    for p in schedule.placements.values():
        if p.task_id in by_id:
            assert len(p.gpu_ids) == by_id[p.task_id].gpus and p.end - p.start == pytest.approx(by_id[p.task_id].duration)
        assert all(0 <= g < gpus for g in p.gpu_ids)
    for a, b in itertools.combinations(schedule.placements.values(), 2):
        if a.start < b.end and b.start < a.end:  # overlapping in time: disjoint GPUs
            assert not set(a.gpu_ids) & set(b.gpu_ids), (a, b)


@pytest.mark.parametrize("seed", range(6))
def test_plans_are_optimal_on_small_instances(seed):
    rng = random.Random(seed)
    gpus = rng.choice([2, 3])
    tasks = [Task(f"t{i}", rng.randint(1, 4), rng.randint(1, gpus)) for i in range(4)]
    schedule = TaskScheduler(gpus).plan(tasks)
    assert schedule.optimal
    assert schedule.makespan == brute_force_makespan(tasks, gpus)
    assert schedule.makespan >= lower_bound(tasks, gpus)
    check_valid(schedule, tasks, gpus)


def test_a_running_end_a_hair_past_a_tick_is_that_tick_and_bad_time_limits_are_named():
    scheduler = TaskScheduler(1, resolution_s=60)
    plan = scheduler.plan([Task("b", 10, 1)], running={"a": Placement("a", 0, 180.00000003, (0,))}, now=100)
    assert plan.placements["b"].start == pytest.approx(180) and plan.placements["b"].gpu_ids == (0,)
    for bad in (-1, float("nan"), "1"):
        with pytest.raises(ValueError, match="TaskScheduler.plan: `time_limit_s` must be a finite number of seconds"):
            scheduler.plan([Task("b", 10, 1)], time_limit_s=bad)


def test_tasks_shorter_than_a_tick_take_one_each():
    """The horizon counted them as 0 ticks while each interval takes at least 1: three 1e-8 s tasks on one GPU at
    `resolution_s`=60 were INFEASIBLE."""
    tasks = [Task(f"t{i}", 1e-8, 1) for i in range(3)]
    schedule = TaskScheduler(1, resolution_s=60).plan(tasks)
    assert sorted(p.start for p in schedule.placements.values()) == [0, 60, 120]


def test_alto_mix_beats_or_matches_longest_first_list_scheduling():
    tasks = ([Task(f"70b-{i}", d, 4) for i, d in enumerate([500, 420])] +
             [Task(f"32b-{i}", d, 2) for i, d in enumerate([300, 260, 240])] +
             [Task(f"8b-{i}", d, 1) for i, d in enumerate([200, 180, 150, 120, 90, 60])])
    schedule = TaskScheduler(8).plan(tasks)
    assert schedule.optimal and schedule.makespan <= list_schedule(tasks, 8)
    check_valid(schedule, tasks, 8)


def test_replanning_keeps_running_tasks_fixed():
    scheduler = TaskScheduler(4)
    tasks = [Task("a", 10, 2), Task("b", 6, 2), Task("c", 4, 4), Task("d", 3, 1)]
    first = scheduler.plan(tasks)
    started = {tid: p for tid, p in first.placements.items() if p.start == 0}
    assert started
    # an early completion and an arrival at t=2: the running tasks keep their start, end and GPUs
    now = 2.0
    running = {tid: Placement(tid, p.start, p.end, p.gpu_ids) for tid, p in started.items()}
    pending = [t for t in tasks if t.id not in running] + [Task("e", 5, 1)]
    second = scheduler.plan(pending, running=running, now=now)
    for tid, p in running.items():
        assert second.placements[tid] == p
    assert all(second.placements[t.id].start >= now for t in pending)
    check_valid(second, pending, 4)


@pytest.mark.parametrize("tasks, message", [
    ([Task("a", 1, 1), Task("a", 2, 1)], "duplicate task id 'a'"),
    ([Task("a", 1, 9)], "needs 9 GPUs but only 4 exist"),
    ([Task("a", 1e15, 1), Task("b", 1e15, 1)], r"add up to 2e\+15 s, 2e\+15 steps of `resolution_s`=1.0: at most "
                                               r"1.1e\+12 steps can be planned"),
])
def test_bad_task_sets(tasks, message):
    with pytest.raises(ValueError, match=message):
        TaskScheduler(4).plan(tasks)


@pytest.mark.parametrize("kwargs, message", [
    ({"id": "x", "duration": -1}, "`duration` must be a finite number > 0"),
    ({"id": "x", "duration": 3, "gpus": 0}, "`gpus` must be an integer >= 1"),
    ({"id": "", "duration": 3}, "`id` must be letters, digits, '.', '_' and '-'"),
    ({"id": "../x", "duration": 3}, "`id` must be letters, digits, .* got '../x'"),
])
def test_bad_tasks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Task(**kwargs)


@pytest.mark.parametrize("args, message", [
    ((True,), "TaskScheduler: `num_gpus` must be an integer >= 1, got True"),
    ((2, float("nan")), "`time_limit_s` must be a finite number of seconds > 0, got nan"),
    ((2, "1"), "`time_limit_s` must be a finite number of seconds > 0, got '1'"),
    ((2, 1.0, float("inf")), "`resolution_s` must be a finite number of seconds > 0, got inf"),
    ((2, 1.0, 0), "`resolution_s` must be a finite number of seconds > 0, got 0"),
    ((2, 1.0, 1.0, 0), "`workers` must be an integer >= 1, got 0"),
    ((2, 1.0, 1.0, 8, "yes"), "`deterministic` must be True or False, got 'yes'"),
])
def test_bad_scheduler_settings_are_named(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TaskScheduler(*args)


def test_numpy_numbers_are_gpu_counts_and_durations():
    import numpy as np

    task = Task("a", np.float32(2.5), np.int64(2))
    assert (task.duration, task.gpus) == (2.5, 2) and type(task.gpus) is int
    assert TaskScheduler(np.int64(2)).plan([task]).makespan == 3.0


@pytest.mark.parametrize("value, hint", [
    ("1e-05", "write 1.0e-05"), ("1.5e3", "write 1500.0"), ("5", "write the number without quotes"), ("abc", None)])
def test_the_yaml_number_hint_writes_what_yaml_reads_as_a_number(value, hint):
    import yaml

    from lightning_multilora.scheduling.task_scheduler import yaml_number_hint

    said = yaml_number_hint(value)
    if hint is None:
        assert said == ""
        return
    assert hint in said
    if said.rstrip(")").split("write ")[1][0].isdigit():  # what it says to write is a number to YAML
        assert yaml.safe_load(said.rstrip(")").split("write ")[1]) == float(value)


def test_a_solve_out_of_time_before_any_plan_falls_back_to_list_scheduling(monkeypatch):
    """CP-SAT stopping at ``time_limit_s`` without a first solution (UNKNOWN) no longer ends the schedule: the plan is a
    greedy list schedule around the running tasks, valid, not marked optimal, with a warning and a note naming
    ``time_limit_s``."""
    from ortools.sat.python import cp_model

    rng = random.Random(3)
    tasks = [Task(f"t{i}", float(rng.randint(5, 60)), rng.choice([1, 2, 4])) for i in range(12)]
    running = {"r": Placement("r", 0.0, 30.0, (0, 1))}
    solve = cp_model.CpSolver.Solve  # (solved, then reported as out of time: what a too small limit gives)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", lambda self, model, *a, **k: solve(self, model) and cp_model.UNKNOWN)
    scheduler = TaskScheduler(4, time_limit_s=0.5)
    with pytest.warns(UserWarning, match="time_limit_s=0.5"):
        plan = scheduler.plan(tasks, running, now=10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a scheduler: a runner replans often (the plan's table keeps the note)
        assert "time_limit_s" in scheduler.plan(tasks, running, now=10.0).table()
    check_valid(plan, tasks, 4)
    assert plan.placements["r"] == running["r"] and not plan.optimal
    assert all(plan.placements[t.id].start >= 10.0 for t in tasks)
    assert plan.makespan == max(p.end for p in plan.placements.values())
    assert plan.makespan >= lower_bound(tasks, 4, 10.0) and "time_limit_s" in plan.table()


def test_the_fallback_plan_fills_gpus_a_wide_task_waits_for(monkeypatch):
    """The greedy fallback starts a short task on GPUs that a task needing all of them waits for (backfilling),
    instead of holding every later task behind it; random instances stay valid."""
    from ortools.sat.python import cp_model

    solve = cp_model.CpSolver.Solve
    monkeypatch.setattr(cp_model.CpSolver, "Solve", lambda self, model, *a, **k: solve(self, model) and cp_model.UNKNOWN)
    running = {"r": Placement("r", 0.0, 100.0, (0,))}
    tasks = [Task("wide", 200.0, 4), Task("short", 50.0, 2)]
    with pytest.warns(UserWarning):
        plan = TaskScheduler(4).plan(tasks, running)
    assert plan.placements["short"].start == 0.0 and plan.placements["wide"].start == 100.0
    rng = random.Random(7)
    for _ in range(40):
        gpus = rng.choice([2, 4, 8])
        tasks = [Task(f"t{i}", float(rng.randint(1, 40)), rng.randint(1, gpus)) for i in range(rng.randint(0, 9))]
        now = float(rng.randint(0, 20))
        running = {f"r{i}": Placement(f"r{i}", 0.0, float(rng.randint(1, 50)), (i,)) for i in range(rng.randint(0, 2))}
        with pytest.warns(UserWarning):
            plan = TaskScheduler(gpus).plan(tasks, running, now=now)
        check_valid(plan, tasks, gpus)
        assert all(plan.placements[t.id].start >= now for t in tasks)
        assert all(plan.placements[k] == p for k, p in running.items())


def brute_force_best(tasks: list[Task], gpus: int) -> tuple[int, int]:
    """The least (makespan, sum of starts) over all integer start times (small instances only)."""
    horizon = int(sum(t.duration for t in tasks))
    best = (horizon + 1, 0)
    for starts in itertools.product(range(horizon), repeat=len(tasks)):
        key = (max(s + t.duration for s, t in zip(starts, tasks)), sum(starts))
        if key < best and all(sum(t.gpus for s, t in zip(starts, tasks) if s <= time < s + t.duration) <= gpus
                              for time in range(int(key[0]))):
            best = key
    return best


def test_among_plans_of_the_best_makespan_tasks_start_earliest():
    """The makespan alone left tasks anywhere that ends by then (5 of 8 GPUs idle at time 0, tasks waiting): a second
    solve keeps the makespan and starts the tasks as early as it allows (least sum of starts, by brute force)."""
    for seed in range(40):
        rng = random.Random(seed)
        gpus = rng.choice([2, 3])
        tasks = [Task(f"t{i}", rng.randint(1, 4), rng.randint(1, gpus)) for i in range(4)]
        schedule = TaskScheduler(gpus).plan(tasks)
        got = (schedule.makespan, sum(p.start for p in schedule.placements.values()))
        assert got == brute_force_best(tasks, gpus), seed
        check_valid(schedule, tasks, gpus)


def test_a_command_from_python_keeps_its_numbers_and_names_a_bad_item():
    assert Task("a", 1, command=["train.py", 3, 2.5]).command == ("train.py", "3", "2.5")
    with pytest.raises(ValueError, match=re.escape("task 'a': `command` item #2 must be a string (or a number), got "
                                                   "False (bool): write it as text ('false')")):
        Task("a", 1, command=["multilora", "--flag", False])
    with pytest.raises(ValueError, match=re.escape("`command` item #1 must be a string (or a number), got None")):
        Task("a", 1, command=["echo", None])


def test_a_task_id_is_at_most_200_characters():
    assert Task("x" * 200, 1).id == "x" * 200
    with pytest.raises(ValueError, match=r"task `id` must be at most 200 characters .* got 201: 'xxxx"):
        Task("x" * 201, 1)


def summed_greedy_starts(scheduler, tasks, running, t0):
    """The greedy fallback as it was written first (every placed interval summed at every candidate start, ~O(n^3)):
    the reference its fast form must agree with."""
    placed = [(scheduler._ticks(p.start), max(scheduler._ticks(p.end), t0), len(p.gpu_ids)) for p in running.values()]
    starts = {}
    for task in sorted(tasks, key=lambda t: -t.duration):
        size = max(1, scheduler._ticks(task.duration))
        for start in sorted({t0, *(end for _, end, _ in placed if end > t0)}):
            end = start + size
            points = [start, *(s for s, _, _ in placed if start < s < end)]
            if all(sum(g for s, e, g in placed if s <= q < e) + task.gpus <= scheduler.num_gpus for q in points):
                break
        starts[task.id] = start
        placed.append((start, end, task.gpus))
    return starts


def test_the_greedy_fallback_is_fast_and_starts_every_task_where_summing_every_interval_did():
    """1000 tasks on 8 GPUs: the fallback summed every placed interval at every candidate start (22-31 s; a replan
    limited to 1 s took 33-48 s). A free-GPU profile gives the same starts (random instances, running tasks, ticks of
    several sizes) in a fraction of a second, and `plan` out of time stays near its limit, the fallback counted in
    its ``solve_s``."""
    import time

    rng = random.Random(11)
    for _ in range(150):
        gpus = rng.choice([1, 2, 3, 4, 8])
        scheduler = TaskScheduler(gpus, resolution_s=rng.choice([0.5, 1.0, 7.0]))
        tasks = [Task(f"t{i}", rng.choice([0.3, 1.0, 5.0, 33.3, rng.uniform(0.1, 50)]), rng.randint(1, gpus))
                 for i in range(rng.randint(1, 30))]
        now, free, running = rng.choice([0.0, 3.0, 10.5]), gpus, {}
        for i in range(rng.randint(0, 3)):
            width = rng.randint(0, free)
            if width:
                free -= width
                running[f"r{i}"] = Placement(f"r{i}", rng.uniform(0, now), now + rng.uniform(-2, 20),
                                             tuple(range(free, free + width)))
        t0 = scheduler._ticks(now)
        assert scheduler._greedy_starts(tasks, running, t0)[0] == summed_greedy_starts(scheduler, tasks, running, t0)
    rng = random.Random(7)
    tasks = [Task(f"t{i}", rng.randint(60, 7200), rng.choice([1, 1, 1, 2, 4, 8])) for i in range(1000)]
    scheduler = TaskScheduler(8, time_limit_s=1.0)
    began = time.perf_counter()
    scheduler._greedy_starts(tasks, {}, 0)
    assert time.perf_counter() - began < 3.0  # (about 0.1 s; it took 22-31 s)
    began = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.plan(tasks, time_limit_s=0.2)
    took = time.perf_counter() - began
    assert "greedy list schedule" in plan.table() and took < 10.0 and plan.solve_s <= took  # (about 0.5 s)
    check_valid(plan, tasks, 8)


def test_a_plan_out_of_time_is_never_longer_than_the_greedy_one_and_says_its_own_makespan(monkeypatch):
    """CP-SAT stopped with a plan (FEASIBLE) kept it, though the greedy list schedule was shorter (174 against 156
    here); and the makespan reported was the first solve's, though the second one (earliest starts) may end sooner."""
    from lightning_multilora.scheduling import task_scheduler

    solver_of = task_scheduler.cp_solver

    def first_plan_found(*args, **kwargs):  # (what a solve stopped early by its time limit returns, reproducibly)
        solver = solver_of(*args, **kwargs)
        solver.parameters.stop_after_first_solution = True
        return solver

    monkeypatch.setattr(task_scheduler, "cp_solver", first_plan_found)
    for seed in range(8):
        rng = random.Random(seed)
        tasks = [Task(f"t{i}", rng.randint(1, 50), rng.randint(1, 4)) for i in range(12)]
        plan = TaskScheduler(4, deterministic=True).plan(tasks)
        check_valid(plan, tasks, 4)
        assert plan.makespan <= list_schedule(tasks, 4), seed
        assert plan.makespan == max(p.end for p in plan.placements.values()), seed


def test_a_deterministic_scheduler_plans_the_same_every_time():
    """Eight workers racing for a wall-clock limit gave another plan each run where none was proven optimal (a
    `--plan-only` table changed from one run to the next)."""
    rng = random.Random(0)
    tasks = [Task(f"t{i}", rng.randint(1, 50), rng.randint(1, 8)) for i in range(24)]
    plans = [TaskScheduler(8, time_limit_s=0.5, deterministic=True).plan(tasks) for _ in range(2)]
    assert plans[0].placements == plans[1].placements
    check_valid(plans[0], tasks, 8)
    rng = random.Random(1)  # the same scheduler again: not warm-started from its last plan (which gave another)
    tasks = [Task(f"t{i}", rng.randint(5, 200), rng.choice([1, 1, 2, 4, 8])) for i in range(60)]
    scheduler = TaskScheduler(8, time_limit_s=0.3, deterministic=True)
    plans = [scheduler.plan(tasks) for _ in range(2)]
    assert plans[0].placements == plans[1].placements


def test_the_baselines_name_a_bad_machine_or_order():
    """``list_schedule`` said "pop from empty list" for a task wider than the machine and for no GPUs, and
    ``lower_bound`` divided by zero."""
    tasks = [Task("wide", 5, 3), Task("b", 2, 1)]
    with pytest.raises(ValueError, match=r"task 'wide' needs 3 GPUs but only 2 exist"):
        list_schedule(tasks, 2)
    for call in (lambda: list_schedule(tasks, 0), lambda: lower_bound(tasks, 0)):
        with pytest.raises(ValueError, match=r"`num_gpus` must be an integer >= 1, got 0"):
            call()
    with pytest.raises(ValueError, match=r"list_schedule: `order` must name every task once, got \['b', 'x'\]"):
        list_schedule(tasks, 4, order=["b", "x"])
    assert list_schedule(tasks, 4, order=["b", "wide"]) == 5


def check_on_nodes(schedule, nodes: list[int]) -> None:
    """Each placement's GPUs are those of one node."""
    firsts = [sum(nodes[:k]) for k in range(len(nodes))]
    for p in schedule.placements.values():
        held = {max(k for k, first in enumerate(firsts) if first <= g) for g in p.gpu_ids}
        assert len(held) == 1, (p, nodes)


def brute_force_on_nodes(tasks: list[Task], nodes: list[int]) -> int:
    """The optimum over every node choice and integer start times (tiny instances only)."""
    best = int(sum(t.duration for t in tasks))
    for choice in itertools.product(range(len(nodes)), repeat=len(tasks)):
        if any(t.gpus > nodes[k] for t, k in zip(tasks, choice)):
            continue
        best = min(best, max(brute_force_makespan([t for t, c in zip(tasks, choice) if c == k], nodes[k])
                             if k in choice else 0 for k in range(len(nodes))))
    return best


def test_on_several_nodes_a_task_takes_its_gpus_on_one_node_and_the_plan_is_the_best_there():
    """Planned as one pool of GPUs, two 1-GPU tasks went to two 2-GPU nodes, and a 2-GPU task planned beside them
    found no node with 2 free (Ray ran it after them: the schedule took 9.9 s where the plan said 6)."""
    tasks = [Task("long1", 6, 1), Task("long2", 6, 1), Task("wide", 1, 2)]
    schedule = TaskScheduler(4, nodes=[2, 2]).plan(tasks)
    check_valid(schedule, tasks, 4)
    check_on_nodes(schedule, [2, 2])
    assert schedule.makespan == 6 and schedule.placements["wide"].start == 0
    rng = random.Random(3)
    for _ in range(12):
        nodes = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
        tasks = [Task(f"t{i}", rng.randint(1, 4), rng.randint(1, max(nodes))) for i in range(rng.randint(1, 4))]
        schedule = TaskScheduler(sum(nodes), nodes=nodes).plan(tasks)
        check_valid(schedule, tasks, sum(nodes))
        check_on_nodes(schedule, nodes)
        assert schedule.makespan == brute_force_on_nodes(tasks, nodes), (nodes, tasks)
        starts, on = TaskScheduler(sum(nodes), nodes=nodes)._greedy_starts(tasks, {}, 0)
        assert all(nodes[on[t.id]] >= t.gpus for t in tasks)
    with pytest.raises(ValueError, match=r"task 'wide' needs 3 GPUs on one node, but the largest node has 2"):
        TaskScheduler(4, nodes=[2, 2]).plan([Task("wide", 1, 3)])
    with pytest.raises(ValueError, match=r"`nodes` \(GPUs a node\) must add up to num_gpus=4, got \[2, 1\]"):
        TaskScheduler(4, nodes=[2, 1])


def test_replanning_on_nodes_keeps_running_tasks_on_theirs_and_the_fallback_keeps_to_one_node(monkeypatch):
    from ortools.sat.python import cp_model

    scheduler = TaskScheduler(4, nodes=[2, 2])
    running = {"r": Placement("r", 0, 10, (2,))}  # (node 1: GPU 3 is the only one free there)
    tasks = [Task("a", 5, 2), Task("b", 5, 1), Task("c", 3, 1)]
    schedule = scheduler.plan(tasks, running=running, now=1)
    check_valid(schedule, tasks, 4)
    check_on_nodes(schedule, [2, 2])
    assert schedule.placements["r"].gpu_ids == (2,) and schedule.placements["a"].gpu_ids == (0, 1)
    solve = cp_model.CpSolver.Solve  # (solved, then reported as out of time: what a too small limit gives)
    monkeypatch.setattr(cp_model.CpSolver, "Solve",
                        lambda self, model, *a, **k: solve(self, model) and cp_model.UNKNOWN)
    with pytest.warns(UserWarning, match="greedy list schedule"):
        schedule = TaskScheduler(4, nodes=[2, 2]).plan(tasks, running=running, now=1)
    check_valid(schedule, tasks, 4)
    check_on_nodes(schedule, [2, 2])
    assert schedule.placements["r"].gpu_ids == (2,)


def test_ctrl_c_stops_a_search_at_once():
    """Ctrl-C while CP-SAT searched reached Python only when the search returned: up to the time limit later (ten
    times it where deterministic), the schedule silent meanwhile."""
    import os
    import signal
    import threading
    import time

    rng = random.Random(0)
    tasks = [Task(f"t{i}", rng.randint(60, 7200), rng.choice([1, 2, 4, 8, 16])) for i in range(100)]
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        TaskScheduler(64, time_limit_s=60.0).plan(tasks)
    assert time.monotonic() - began < 20  # (its first solve alone had 45 s)
    assert not [t for t in threading.enumerate() if t.name == "cp-sat"]  # (the search has returned)


def test_a_process_interrupted_while_planning_exits_as_it_says():
    """Waiting on the search's thread, an interrupted join took it for ended (Python 3.11): the search still ran in
    C++ as the process exited, which aborted it (SIGABRT) after "interrupted while planning", not exit 130."""
    import subprocess
    import sys

    script = ("import os, random, signal, sys, threading\n"
              "from lightning_multilora.scheduling import Task, TaskScheduler\n"
              "rng = random.Random(0)\n"
              "tasks = [Task(f't{i}', rng.randint(60, 7200), rng.choice([1, 2, 4, 8, 16])) for i in range(100)]\n"
              "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
              "try:\n"
              "    TaskScheduler(64, time_limit_s=60.0).plan(tasks)\n"
              "except KeyboardInterrupt:\n"
              "    sys.exit(130)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])


def test_a_ctrl_c_while_or_tools_imports_waits_for_the_import():
    """A Ctrl-C inside OR-Tools' import (its C++ module's initialization, the half second a first plan starts with)
    came out as "ImportError: initialization failed", a traceback, not as an interruption. It is held until the
    import ends, then raised: the module is whole, and the process stops as interrupted."""
    import subprocess
    import sys

    script = ("import signal, sys\n"
              "class Interrupting:  # (a Ctrl-C as the import reaches OR-Tools' C++ module)\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'ortools.sat.python.cp_model_helper':\n"
              "            signal.raise_signal(signal.SIGINT)\n"
              "sys.meta_path.insert(0, Interrupting())\n"
              "from lightning_multilora.scheduling import Task, TaskScheduler\n"
              "try:\n"
              "    TaskScheduler(2, time_limit_s=5.0).plan([Task('a', 60, 1)])\n"
              "except KeyboardInterrupt:\n"
              "    print('imported' if 'ortools.sat.python.cp_model' in sys.modules else 'cut short')\n"
              "    sys.exit(130)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (130, "imported"), (done.stdout, done.stderr[-2000:])
