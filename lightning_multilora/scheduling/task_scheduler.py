"""`TaskScheduler`: minimum-makespan placement of training tasks on GPUs with OR-Tools CP-SAT.

The problem is P|size_j|C_max (ALTO's inter-task scheduler): task ``j`` runs ``d_j`` on ``g_j`` GPUs at
once. A cumulative constraint (at most ``G`` GPUs busy at any time) gives the optimal makespan; concrete
GPU ids are assigned afterwards by sweeping the tasks in start order, which always succeeds because the
cumulative bound holds at every instant and tasks do not need contiguous ids. A second solve keeps that makespan and
starts the tasks as early as it allows (least sum of starts): the makespan alone leaves a task anywhere that ends by
then, GPUs idle meanwhile. On several nodes (``nodes``: GPUs a node, a Ray cluster's) a task takes its GPUs on one
node: each task chooses a node (optional intervals, one cumulative constraint a node), and its GPU ids are that
node's (node ``k`` holds the ids after those of nodes ``0..k-1``).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from lightning_multilora.arguments import check_bool, check_int, check_real
from lightning_multilora.scheduling.task import Task, yaml_number_hint  # noqa: F401 - (yaml_number_hint: re-exported)
from lightning_multilora.signals import stop_signals_deferred


def load_cp_model() -> Any:
    """OR-Tools' ``cp_model`` module, imported with Ctrl-C held back until the import ends: a KeyboardInterrupt in
    its C++ module's initialization came out as "ImportError: initialization failed" (a schedule interrupted as it
    began planning said so, a traceback, instead of stopping as interrupted)."""
    with stop_signals_deferred():
        from ortools.sat.python import cp_model
    return cp_model


def cp_solver(time_limit_s: float, workers: int, deterministic: bool = False) -> Any:
    """A CP-SAT solver with this time limit and these search workers that leaves Ctrl-C to the caller (CP-SAT's own
    SIGINT handler outlives the solve: Ctrl-C then kills the process outright, past the caller's clean-up).
    ``deterministic``: the same answer every run: one search worker (several race each other), its limit in CP-SAT's
    deterministic time (about seconds; the wall-clock limit, ten times it, only guards against a slow machine)."""
    cp_model = load_cp_model()

    solver = cp_model.CpSolver()
    solver.parameters.catch_sigint_signal = False
    solver.parameters.max_time_in_seconds = time_limit_s * (10 if deterministic else 1)
    solver.parameters.num_search_workers = 1 if deterministic else workers
    if deterministic:
        solver.parameters.max_deterministic_time = time_limit_s
    return solver


def solve(solver: Any, model: Any) -> Any:
    """``solver.Solve(model)``, stopped at once by Ctrl-C: on the main thread the search runs in a thread of its own
    while this one waits, and an exception a signal handler raises here (KeyboardInterrupt, a SIGTERM handler's, a
    timeout's) stops it (``StopSearch``) and is raised once the search has returned (`cp_solver` turns CP-SAT's own
    SIGINT handling off: Python saw the signal only when the search returned, up to the time limit later, ten times
    it where deterministic). The wait is on an event the search sets as it returns, not on the thread: a join
    interrupted by a signal takes the thread for ended (Python 3.11), and the process, exiting with a search still
    in C++, aborted."""
    if threading.current_thread() is not threading.main_thread():
        return solver.Solve(model)
    out: list = []
    done = threading.Event()

    def search() -> None:
        try:
            out.append((True, solver.Solve(model)))
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            out.append((False, err))
        finally:
            done.set()

    threading.Thread(target=search, name="cp-sat", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except BaseException as interrupt:
        solver.StopSearch()
        while not done.is_set():  # (the search returns within moments of StopSearch; a second Ctrl-C waits too)
            try:
                done.wait(0.1)
            except BaseException:  # noqa: BLE001 - the first interruption is the one raised
                solver.StopSearch()
        raise interrupt
    ok, value = out[0]
    if not ok:
        raise value
    return value


def first_gpu_ids(counts: Sequence[int]) -> list[int]:
    """The first GPU id of each node, for ``counts`` GPUs a node numbered node after node."""
    return [sum(counts[:k]) for k in range(len(counts))]


def node_holding(gpu_id: int, firsts: Sequence[int]) -> int:
    """The node holding GPU ``gpu_id``, its nodes' first ids ``firsts`` (`first_gpu_ids`)."""
    return bisect.bisect_right(firsts, gpu_id) - 1


def check_planner(where: str, num_gpus: Any, time_limit_s: Any, resolution_s: Any) -> None:
    """A planner's machine and solver settings: an integer GPU count >= 1, finite positive seconds."""
    check_int(where, "num_gpus", num_gpus, 1)
    for name, value in (("time_limit_s", time_limit_s), ("resolution_s", resolution_s)):
        check_real(where, name, value, lambda v: v > 0, "a finite number of seconds > 0")


# The most resolution steps a plan may span (its makespan variable spans twice that, within CP-SAT's int64).
MAX_TICKS = 2**40
# The share of a plan's `time_limit_s` for its second solve: the best makespan found kept, the tasks' starts made
# as early as it allows (the makespan alone left tasks anywhere that ends by then: 5 of 8 GPUs idle at time 0)
EARLY_SHARE = 0.25


@dataclass(frozen=True)
class Placement:
    task_id: str
    start: float
    end: float
    gpu_ids: tuple[int, ...]


@dataclass
class Schedule:
    placements: dict[str, Placement]
    makespan: float
    optimal: bool
    solve_s: float
    lower_bound: float = 0.0
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = sorted(self.placements.values(), key=lambda p: (p.start, p.task_id))
        lines = [f"{'task':<16} {'start':>10} {'end':>10}  gpus"]
        lines += [f"{p.task_id:<16} {p.start:>10.1f} {p.end:>10.1f}  {','.join(map(str, p.gpu_ids))}" for p in rows]
        lines.append(f"makespan {self.makespan:.1f} ({'optimal' if self.optimal else 'feasible'}, "
                     f"lower bound {self.lower_bound:.1f}, solved in {self.solve_s:.3f} s)")
        lines += self.notes
        return "\n".join(lines)


def validate_tasks(tasks: Sequence[Task], num_gpus: int, largest_node: Optional[int] = None) -> None:
    seen = set()
    for task in tasks:
        if task.id in seen:
            raise ValueError(f"duplicate task id {task.id!r}; task ids must be unique")
        seen.add(task.id)
        if task.gpus > num_gpus:
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs but only {num_gpus} exist")
        if largest_node is not None and task.gpus > largest_node:
            raise ValueError(f"task {task.id!r} needs {task.gpus} GPUs on one node, but the largest node has "
                             f"{largest_node}")


def lower_bound(tasks: Iterable[Task], num_gpus: int, now: float = 0.0) -> float:
    """max(total work / G, longest task) from ``now``: no schedule ends earlier."""
    check_int("lower_bound", "num_gpus", num_gpus, 1)
    tasks = list(tasks)
    if not tasks:
        return now
    return now + max(sum(t.duration * t.gpus for t in tasks) / num_gpus, max(t.duration for t in tasks))


def assign_gpu_ids(intervals: Sequence[tuple[str, float, float, int]], num_gpus: int,
                   fixed: Optional[dict[str, tuple[int, ...]]] = None) -> dict[str, tuple[int, ...]]:
    """Concrete GPU ids for (task, start, end, gpus) intervals that never exceed ``num_gpus`` at once."""
    fixed = fixed or {}
    busy: list[tuple[float, tuple[int, ...]]] = []  # (end, ids) of tasks holding GPUs
    free = set(range(num_gpus))
    out: dict[str, tuple[int, ...]] = {}
    for task_id, start, end, gpus in sorted(intervals, key=lambda x: (x[1], x[0] not in fixed)):
        for item in [b for b in busy if b[0] <= start + 1e-9]:
            busy.remove(item)
            free.update(item[1])
        if task_id in fixed:
            ids = fixed[task_id]
            if not set(ids) <= free:
                raise ValueError(f"running task {task_id!r} holds GPUs {ids} that are not free")
        else:
            if len(free) < gpus:
                raise RuntimeError(f"no {gpus} free GPUs for {task_id!r} at {start}: the plan exceeds {num_gpus}")
            ids = tuple(sorted(free)[:gpus])
        free.difference_update(ids)
        busy.append((end, ids))
        out[task_id] = ids
    return out


class TaskScheduler:
    """Plans tasks on ``num_gpus`` GPUs for minimum makespan; replans with running tasks fixed.

    Args:
        num_gpus: GPUs available (>= 1).
        time_limit_s: CP-SAT's time limit per plan; the best plan found by then is returned (three quarters for the
            makespan, the rest to start the tasks as early as that makespan allows, `EARLY_SHARE`).
        resolution_s: durations are rounded up to this grid for the integer model (a plan is no shorter than its
            tasks' durations so rounded: keep it well under the shortest).
        workers: CP-SAT search workers.
        deterministic: the same plan for the same tasks every time (one worker, `cp_solver`'s, not warm-started from
            the last plan); ``time_limit_s`` is then CP-SAT's deterministic time, which can take several times as
            long on the wall clock (ten times at most). By default the plan is the best that ``workers`` find in
            ``time_limit_s`` of wall-clock time, which can differ between runs: a longer one where none is proven
            optimal, and, where one is, another of the same makespan (tasks of equal sizes swapped, say).
        nodes: GPUs of each node, adding up to ``num_gpus`` (default: one node of them all); a task's GPUs are on
            one node, node ``k``'s ids following those of the nodes before it.
    """

    def __init__(self, num_gpus: int, time_limit_s: float = 1.0, resolution_s: float = 1.0, workers: int = 8,
                 deterministic: bool = False, nodes: Optional[Sequence[int]] = None) -> None:
        check_planner("TaskScheduler", num_gpus, time_limit_s, resolution_s)
        check_int("TaskScheduler", "workers", workers, 1)
        if nodes is not None:
            nodes = list(nodes)
            for count in nodes:
                check_int("TaskScheduler", "nodes", count, 1)
            if not nodes or sum(nodes) != num_gpus:
                raise ValueError(f"TaskScheduler: `nodes` (GPUs a node) must add up to num_gpus={num_gpus}, got "
                                 f"{nodes}")
        self.nodes = nodes if nodes is not None else [int(num_gpus)]
        self._first_id = first_gpu_ids(self.nodes)
        self.num_gpus, self.time_limit_s, self.resolution_s = int(num_gpus), float(time_limit_s), float(resolution_s)
        self.workers = int(workers)
        self.deterministic = check_bool("TaskScheduler", "deterministic", deterministic)
        self.last: Optional[Schedule] = None
        self._warned_greedy = False

    def _ticks(self, seconds: float) -> int:
        return max(0, math.ceil(seconds / self.resolution_s - 1e-9))

    def node_of(self, gpu_id: int) -> int:
        """The node holding GPU ``gpu_id``."""
        return node_holding(gpu_id, self._first_id)

    def _node_ids(self, rows: list[tuple[str, float, float, int]], node_of: dict[str, int],
                  fixed: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """GPU ids for (task, start, end, gpus) rows, each on its node (`assign_gpu_ids` a node)."""
        ids: dict[str, tuple[int, ...]] = {}
        for k, (first, count) in enumerate(zip(self._first_id, self.nodes)):
            local = assign_gpu_ids([r for r in rows if node_of[r[0]] == k], count,
                                   {t: tuple(g - first for g in v) for t, v in fixed.items() if node_of[t] == k})
            ids.update({t: tuple(g + first for g in v) for t, v in local.items()})
        return ids

    def plan(self, tasks: Sequence[Task], running: Optional[dict[str, Placement]] = None, now: float = 0.0,
             hint: Optional[Schedule] = None, time_limit_s: Optional[float] = None) -> Schedule:
        """Place ``tasks`` (not yet started) from ``now``; ``running`` placements stay as they are.

        ``hint`` (default: the previous plan) warm-starts the solver with the starts it still applies to;
        ``time_limit_s`` overrides the scheduler's limit for this solve (replanning wants a short one).
        """
        cp_model = load_cp_model()

        if time_limit_s is not None:
            check_real("TaskScheduler.plan", "time_limit_s", time_limit_s, lambda v: v > 0,
                       "a finite number of seconds > 0 (or None: the scheduler's)")
            time_limit_s = float(time_limit_s)
        running = dict(running or {})
        validate_tasks(list(tasks), self.num_gpus, max(self.nodes) if len(self.nodes) > 1 else None)
        overlap = {t.id for t in tasks} & set(running)
        if overlap:
            raise ValueError(f"tasks {sorted(overlap)} are both running and to be planned")
        hint = hint if hint is not None or self.deterministic else self.last  # (deterministic: the same plan for
        # the same tasks, whatever was planned before)
        model = cp_model.CpModel()
        t0 = self._ticks(now)
        horizon = t0 + sum(max(1, self._ticks(t.duration)) for t in tasks) + sum(  # (each at least a tick, as below)
            max(0, self._ticks(p.end) - t0) for p in running.values()) + 1
        if horizon > MAX_TICKS:  # CP-SAT's integers: the makespan variable spans twice the horizon
            raise ValueError(f"the tasks' durations add up to {horizon * self.resolution_s:.3g} s, "
                             f"{horizon:.3g} steps of `resolution_s`={self.resolution_s}: at most {MAX_TICKS:.3g} "
                             "steps can be planned (shorter durations or a coarser `resolution_s`)")
        per_node: list[tuple[list, list]] = [([], []) for _ in self.nodes]  # (intervals, demands) a node
        ends, starts, on = [], {}, {}  # (on: a task's node choices, a literal each, where there are several)
        running_node = {tid: self.node_of(p.gpu_ids[0]) if p.gpu_ids else 0 for tid, p in running.items()}
        for task_id, p in running.items():
            start, end = self._ticks(p.start), max(self._ticks(p.end), t0)
            per_node[running_node[task_id]][0].append(model.NewIntervalVar(start, end - start, end, f"run_{task_id}"))
            per_node[running_node[task_id]][1].append(len(p.gpu_ids))
            ends.append(end)
        for task in tasks:
            size = max(1, self._ticks(task.duration))
            start = model.NewIntVar(t0, horizon, f"s_{task.id}")
            end = model.NewIntVar(t0, horizon + size, f"e_{task.id}")
            fitting = [k for k, count in enumerate(self.nodes) if count >= task.gpus]
            hinted = hint.placements.get(task.id) if hint is not None else None
            if len(fitting) == 1:
                per_node[fitting[0]][0].append(model.NewIntervalVar(start, size, end, f"i_{task.id}"))
                per_node[fitting[0]][1].append(task.gpus)
            else:
                on[task.id] = {k: model.NewBoolVar(f"n{k}_{task.id}") for k in fitting}
                for k, chosen in on[task.id].items():
                    per_node[k][0].append(model.NewOptionalIntervalVar(start, size, end, chosen, f"i{k}_{task.id}"))
                    per_node[k][1].append(task.gpus)
                    if hinted is not None and hinted.gpu_ids:
                        model.AddHint(chosen, self.node_of(hinted.gpu_ids[0]) == k)
                model.AddExactlyOne(on[task.id].values())
            ends.append(end)
            starts[task.id] = start
            if hinted is not None:
                model.AddHint(start, max(t0, self._ticks(hinted.start)))
        for (intervals, demands), count in zip(per_node, self.nodes):
            model.AddCumulative(intervals, demands, count)
        makespan = model.NewIntVar(t0, horizon * 2, "makespan")
        model.AddMaxEquality(makespan, ends) if ends else model.Add(makespan == t0)
        model.Minimize(makespan)
        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        solver = cp_solver(limit * (1 - EARLY_SHARE), self.workers, self.deterministic)
        status = solve(solver, model)
        notes, solve_s = [], solver.WallTime()

        def span_of(start_of: dict[str, int]) -> int:
            return max([t0, *(start_of[t.id] + max(1, self._ticks(t.duration)) for t in tasks),
                        *(max(self._ticks(p.end), t0) for p in running.values())])

        def node_choice(value) -> dict[str, int]:  # (a task's node, from a solve; the only one that fits else)
            return {t.id: next(k for k, lit in on[t.id].items() if value(lit)) if t.id in on else
                    next(k for k, count in enumerate(self.nodes) if count >= t.gpus) for t in tasks}

        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            start_of = {t.id: solver.Value(starts[t.id]) for t in tasks}
            node_at = node_choice(solver.Value)
            span = solver.Value(makespan)
            if status == cp_model.FEASIBLE:  # (out of time: never a longer plan than the greedy list schedule's)
                greedy_from = time.perf_counter()
                greedy, greedy_nodes = self._greedy_starts(tasks, running, t0)
                solve_s += time.perf_counter() - greedy_from
                if span_of(greedy) < span:
                    start_of, node_at, span = greedy, greedy_nodes, span_of(greedy)
            start_of, node_at, early_s = self._start_early(model, starts, on, makespan, span, start_of, node_at,
                                                           limit * EARLY_SHARE, node_choice)
            solve_s += early_s
            span = span_of(start_of)  # (the second solve may end sooner than the first's makespan)
        elif status == cp_model.UNKNOWN:  # out of time before a first plan: a greedy one, valid but not optimized
            greedy_from = time.perf_counter()  # (in the time the plan took: it runs in the share left after the solve)
            start_of, node_at = self._greedy_starts(tasks, running, t0)
            solve_s += time.perf_counter() - greedy_from
            span = span_of(start_of)
            notes.append(f"CP-SAT found no plan within time_limit_s={limit} s: greedy list schedule (longest first); "
                         "raise time_limit_s for an optimized plan")
            if not self._warned_greedy:  # (a runner replans often; the plan's table keeps the note)
                self._warned_greedy = True
                warnings.warn(notes[-1])
        else:
            raise RuntimeError(f"CP-SAT found no plan ({solver.StatusName(status)}) for {len(tasks)} tasks on "
                               f"{self.num_gpus} GPUs")
        res = self.resolution_s
        rows = [(tid, p.start, p.end, len(p.gpu_ids)) for tid, p in running.items()]
        rows += [(t.id, start_of[t.id] * res, (start_of[t.id] + max(1, self._ticks(t.duration))) * res, t.gpus)
                 for t in tasks]
        # GPU ids by the model's own grid: a running task's end as the model rounded it (an end a hair past a tick,
        # 180.00000003 s at 60 s ticks, is tick 3 there; in seconds it held its GPU past the task planned at 180)
        on_grid = [(tid, start, max(self._ticks(end), t0) * res if tid in running else end, gpus)
                   for tid, start, end, gpus in rows]
        ids = self._node_ids(on_grid, {**running_node, **node_at}, {tid: p.gpu_ids for tid, p in running.items()})
        placements = {tid: Placement(tid, start, end, ids[tid]) for tid, start, end, _ in rows}
        schedule = Schedule(placements, span * res, status == cp_model.OPTIMAL, solve_s,
                            lower_bound(tasks, self.num_gpus, now), notes)
        self.last = schedule
        return schedule

    def _start_early(self, model: Any, starts: dict[str, Any], on: dict[str, dict[int, Any]], makespan: Any,
                     span: int, start_of: dict[str, int], node_at: dict[str, int], time_limit_s: float,
                     node_choice: Any) -> tuple[dict[str, int], dict[str, int], float]:
        """The start ticks (and nodes) of a second solve: the makespan kept to ``span``, the sum of the starts least
        (a plan with the best makespan that starts each task as early as it can: a runner starts what the plan starts
        now, and a task started later than it could leaves GPUs idle meanwhile). From the first solve's ``start_of``
        and ``node_at`` (its hint, and the answer where this finds nothing better in ``time_limit_s``); with the
        seconds it took."""
        cp_model = load_cp_model()

        if not starts:
            return start_of, node_at, 0.0
        model.Add(makespan <= span)
        model.ClearHints()
        for task_id, var in starts.items():
            model.AddHint(var, start_of[task_id])
        for task_id, choices in on.items():
            for k, lit in choices.items():
                model.AddHint(lit, node_at[task_id] == k)
        model.Minimize(cp_model.LinearExpr.Sum(list(starts.values())))
        solver = cp_solver(time_limit_s, self.workers, self.deterministic)
        status = solve(solver, model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return start_of, node_at, solver.WallTime()
        return ({task_id: solver.Value(var) for task_id, var in starts.items()}, node_choice(solver.Value),
                solver.WallTime())

    def _greedy_starts(self, tasks: Sequence[Task], running: dict[str, Placement],
                       t0: int) -> tuple[dict[str, int], dict[str, int]]:
        """Start ticks (and nodes) of ``tasks`` by list scheduling from ``t0`` around the ``running`` placements:
        longest first, each at the earliest tick from which enough GPUs of one node stay free for its whole duration
        (so a short task fills GPUs that a wide one waits for), on the node where that tick is earliest.

        The GPUs in use on a node are kept as a step function (`_Steps`): a task's window is checked step by step, a
        full step sends the search past it, and usage only rises as tasks are placed, so the first step with room
        for ``g`` GPUs only moves on (1000 tasks on 8 GPUs: a fraction of a second; summing every placed interval at
        each candidate start took 22-31 s). The earliest start found is the one every placed interval's sum gave."""
        steps = [_Steps(t0, count) for count in self.nodes]
        for p in running.values():
            steps[self.node_of(p.gpu_ids[0]) if p.gpu_ids else 0].occupy(
                self._ticks(p.start), max(self._ticks(p.end), t0), len(p.gpu_ids))
        starts: dict[str, int] = {}
        nodes: dict[str, int] = {}
        for task in sorted(tasks, key=lambda t: -t.duration):
            size = max(1, self._ticks(task.duration))
            start, k = min((steps[k].earliest(size, task.gpus), k) for k, count in enumerate(self.nodes)
                           if count >= task.gpus)
            starts[task.id], nodes[task.id] = start, k
            steps[k].occupy(start, start + size, task.gpus)
        return starts, nodes


class _Steps:
    """The GPUs in use on one node from tick ``t0`` on, as a step function: ``times[k]``, where it changes;
    ``used[k]``, from there to the next (sorted; 0 from the last one on, a sentinel no window reaches)."""

    def __init__(self, t0: int, count: int) -> None:
        self.t0, self.count = t0, count
        self.times: list[float] = [t0, math.inf]
        self.used = [0, 0]
        self.room_from: dict[int, float] = {}  # per width: a tick before which no step has room for it (only moves on)

    def _step_at(self, tick: int) -> int:  # the index of the step starting at ``tick`` (made there if need be)
        k = bisect.bisect_right(self.times, tick) - 1
        if self.times[k] != tick:
            self.times.insert(k + 1, tick)
            self.used.insert(k + 1, self.used[k])
            k += 1
        return k

    def occupy(self, start: int, end: int, gpus: int) -> None:
        start = max(start, self.t0)
        if end <= start:
            return
        first, last = self._step_at(start), self._step_at(end)
        for k in range(first, last):
            self.used[k] += gpus

    def earliest(self, size: int, gpus: int) -> int:
        """The earliest tick from which ``gpus`` stay free for ``size`` ticks."""
        times, used, limit = self.times, self.used, self.count - gpus
        k = bisect.bisect_right(times, self.room_from.get(gpus, self.t0)) - 1
        while used[k] > limit:  # (the last step is 0: a task wider than the node is refused before)
            k += 1
        self.room_from[gpus] = times[k]
        while True:
            start, j = times[k], k
            end = start + size
            while times[j] < end and used[j] <= limit:
                j += 1
            if times[j] >= end:
                return int(start)
            k = j + 1  # step j has no room: no window that holds it does


def list_schedule(tasks: Sequence[Task], num_gpus: int, order: Optional[Sequence[str]] = None) -> float:
    """Greedy list scheduling (default order: longest first), in order: each task starts once enough GPUs are
    free, and not before the task before it (no backfill: a narrow task waits behind a wide one, GPUs idle; the
    scheduler's own greedy start, `TaskScheduler._greedy_starts`, fills them). Returns the makespan; the baseline
    the CP-SAT plan is compared with, never shorter than it."""
    starts = list_starts(tasks, num_gpus, order)
    return max((starts[t.id] + t.duration for t in tasks), default=0.0)


def list_starts(tasks: Sequence[Task], num_gpus: int, order: Optional[Sequence[str]] = None) -> dict[str, float]:
    """`list_schedule`'s start of each task, by id."""
    check_int("list_schedule", "num_gpus", num_gpus, 1)
    validate_tasks(tasks, num_gpus)
    by_id = {t.id: t for t in tasks}
    order = list(order) if order is not None else [t.id for t in sorted(tasks, key=lambda t: -t.duration)]
    if sorted(order) != sorted(by_id):
        raise ValueError(f"list_schedule: `order` must name every task once, got {order} for tasks {sorted(by_id)}")
    running: list[tuple[float, int]] = []  # (end, gpus)
    free, now, starts = num_gpus, 0.0, {}
    for task_id in order:
        task = by_id[task_id]
        while free < task.gpus:
            running.sort()
            end, gpus = running.pop(0)
            now, free = max(now, end), free + gpus
        running.append((now + task.duration, task.gpus))
        free -= task.gpus
        starts[task_id] = now
    return starts
