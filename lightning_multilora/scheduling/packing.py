"""PLoRA's half of planning: which configurations share a packed job, and on how many GPUs.

`PackingPlanner` builds candidate packs for every GPU count ``d`` (powers of two up to the machine): up to
`EVERY_PACKING_UP_TO` configurations, every set of them that fits the memory model at ``d`` GPUs; past that, the
configurations ordered by batch size then length, and by length then batch size (homogeneous packs suit the grouped
kernels; packs of one length end together), cut into consecutive packs of at most 1, 2, 4... configurations that fit
at ``d`` GPUs, plus the packs PLoRA's greedy planner forms. One CP-SAT model then picks a set of packs that covers
every configuration exactly once and
schedules them (optional intervals, a cumulative GPU constraint) for minimum makespan: packing, GPU
counts and timing are decided together, on a grid of ``resolution_s`` (the jobs keep their own durations). The
greedy plan is the solver's starting hint, and the result is never worse than it or than one job a configuration
(where the solver finds nothing in its time limit, or the grid's rounding leaves its packing longer, the result is the
better of those two plans). Past
`EVERY_PACKING_UP_TO` configurations the packs are chosen among these candidates, not among every packing (there are
exponentially many): a plan marked optimal is the best over the candidates, and a packing outside them can be shorter
(its notes say so). A plan's ``lower_bound`` is the longest configuration's shortest time alone (no pack holding it
ends sooner, where a pack's step takes no less time than its members' alone): a bound no packing goes under.

`plora_greedy` is a greedy reading of PLoRA's planner (its Algorithms 4 and 5): whenever GPUs are free, for
each power-of-two ``D`` that fits, grow a pack (largest rank first) while the LoRA throughput
``sum(r_k) / T(pack, D)`` improves and memory allows, launch the pack with the best throughput per GPU, and
advance to the next predicted completion when no GPU is left. The paper solves a restricted ILP for each ``D``
instead of growing the pack, and keeps the candidate schedule of least makespan instead of the best throughput
per GPU. It is the baseline the planner is measured against.

Both take the same cost model: ``memory(specs, d)`` (peak bytes per GPU of a pack on ``d`` GPUs) and
``step_time(specs, d)`` (seconds per step); a job lasts ``max(steps) * step_time``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import NamedTuple, Optional

from lightning_multilora.arguments import check_bool, check_int, check_real
from lightning_multilora.scheduling.profiler import check_margin
from lightning_multilora.scheduling.task_scheduler import (MAX_TICKS, Placement, Schedule, Task, assign_gpu_ids,
                                                           check_planner, cp_solver, list_starts, load_cp_model,
                                                           solve)
from lightning_multilora.spec import AdapterSpec

CostFn = Callable[[Sequence[AdapterSpec], int], float]
EVERY_PACKING_UP_TO = 8  # configurations: every set of them a candidate pack (2^8 sets a GPU count)
FEW_FIRST = 0.3  # there, the most of the time limit a first solve over the fewer candidates takes (its answer the hint)


@dataclass(frozen=True)
class Job:
    """A packed fine-tuning job: adapters trained together on ``gpus`` GPUs for ``duration`` seconds."""

    id: str
    specs: tuple[AdapterSpec, ...]
    gpus: int
    duration: float

    def task(self) -> Task:
        return Task(self.id, self.duration, self.gpus)


def _steps(spec: AdapterSpec) -> int:
    if spec.max_steps is None:
        raise ValueError(f"adapter {spec.name!r}: planning needs `max_steps` (a length in steps)")
    return spec.max_steps


def _step_seconds(step_time: CostFn, specs: Sequence[AdapterSpec], gpus: int) -> float:
    """``step_time(specs, gpus)``, checked: a finite number of seconds > 0 (a 0 divided PLoRA's throughput by zero)."""
    value = step_time(specs, gpus)
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"`step_time` must return seconds per step, a finite number > 0; for "
                         f"{[s.name for s in specs]} on {gpus} GPU{'s' if gpus > 1 else ''} it returned {value!r}")
    return float(value)


def _bytes(memory: CostFn, specs: Sequence[AdapterSpec], gpus: int) -> float:
    """``memory(specs, gpus)``, checked: a finite number of bytes >= 0 (a NaN read as a size, None a bare TypeError,
    a negative one packed anything)."""
    value = memory(specs, gpus)
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"`memory` must return the bytes per GPU, a finite number >= 0; for "
                         f"{[s.name for s in specs]} on {gpus} GPU{'s' if gpus > 1 else ''} it returned {value!r}")
    return float(value)


def _alone_text(specs: Sequence[AdapterSpec], memory: CostFn, options: Sequence[int], budget: float,
                gpu_bytes: float, load_factor: float) -> str:
    """What each configuration alone needs at best (its fewest bytes per GPU over the GPU counts) against the budget."""
    from lightning_multilora.scheduling.admission import size_text

    needs = []
    for spec in specs:
        least, d = min((memory([spec], d), d) for d in options)
        needs.append(f"{spec.name!r} needs {size_text(least)} per GPU at best (on {d} GPU{'s' if d > 1 else ''})")
    return (f"{'; '.join(needs)}; the budget is {size_text(budget)} per GPU ({load_factor:.0%} of "
            f"{size_text(gpu_bytes)})")


class PackingPlanner:
    """Packs configurations into jobs and places the jobs on ``num_gpus`` GPUs (CP-SAT).

    Args:
        num_gpus: GPUs of the machine.
        memory: peak bytes per GPU of a pack on ``d`` GPUs.
        step_time: seconds per training step of a pack on ``d`` GPUs.
        gpu_bytes: memory of one GPU.
        load_factor: the usable fraction of it (PLoRA's ``C``), in (0, 1].
        time_limit_s: CP-SAT's limit.
        resolution_s: the plan's time grid.
        workers: CP-SAT search workers.
        deterministic: the same plan for the same configurations every time (one worker, its limit in CP-SAT's
            deterministic time: `TaskScheduler`'s); by default the best that ``workers`` racing each other find in
            ``time_limit_s`` of wall-clock time, which differs from run to run.
    """

    def __init__(self, num_gpus: int, memory: CostFn, step_time: CostFn, gpu_bytes: float, load_factor: float = 0.9,
                 time_limit_s: float = 5.0, resolution_s: float = 1.0, workers: int = 8,
                 deterministic: bool = False) -> None:
        check_planner("PackingPlanner", num_gpus, time_limit_s, resolution_s)
        check_int("PackingPlanner", "workers", workers, 1)
        self.workers = int(workers)
        self.deterministic = check_bool("PackingPlanner", "deterministic", deterministic)
        check_real("PackingPlanner", "gpu_bytes", gpu_bytes, lambda v: v > 0, "a finite number of bytes > 0")
        self.num_gpus, self.memory, self.step_time = int(num_gpus), memory, step_time
        self.gpu_bytes, self.load_factor = float(gpu_bytes), check_margin(load_factor, "PackingPlanner", "load_factor")
        self.budget = gpu_bytes * self.load_factor
        self.time_limit_s, self.resolution_s = float(time_limit_s), float(resolution_s)
        self.gpu_options = _powers_of_two(self.num_gpus)

    def duration(self, specs: Sequence[AdapterSpec], gpus: int) -> float:
        return max(_steps(s) for s in specs) * _step_seconds(self.step_time, specs, gpus)

    def fits(self, specs: Sequence[AdapterSpec], gpus: int) -> bool:
        return _bytes(self.memory, specs, gpus) <= self.budget

    def singles(self, specs: Sequence[AdapterSpec]) -> tuple[list[Job], dict[str, Placement], float]:
        """No packing: each configuration a job of its own, on the fewest GPUs it fits, longest first on the GPUs
        as they free, in order (`list_schedule`: a job waits behind a wider one). A plan never returns worse: PLoRA's
        greedy plan, the planner's other start, came to twice its makespan on the README's benchmark."""
        jobs = []
        for spec in sorted(specs, key=lambda s: (-min(self.duration([s], d) for d in self.gpu_options
                                                     if self.fits([s], d)), s.name)):
            d = next(d for d in self.gpu_options if self.fits([spec], d))
            jobs.append(Job(f"single{len(jobs)}", (spec,), d, self.duration([spec], d)))
        starts = list_starts([job.task() for job in jobs], self.num_gpus, [job.id for job in jobs])
        rows = [(job.id, starts[job.id], starts[job.id] + job.duration, job.gpus) for job in jobs]
        ids = assign_gpu_ids(rows, self.num_gpus)
        placements = {jid: Placement(jid, start, end, ids[jid]) for jid, start, end, _ in rows}
        return jobs, placements, max((p.end for p in placements.values()), default=0.0)

    def candidate_packs(self, specs: Sequence[AdapterSpec],
                        every: Optional[bool] = None) -> list[tuple[tuple[AdapterSpec, ...], int]]:
        """For each GPU count: with ``every`` (default: up to `EVERY_PACKING_UP_TO` configurations), every set of
        them; else consecutive packs of at most 1, 2, 4... configurations and of all of them (9 to 15 never shared one
        pack, where that was the shortest plan), each as large as memory allows, of the
        configurations ordered by (batch size, length) and by (length, batch size). Only packs that fit; each
        configuration alone among them (so any cover exists), or an error naming those that fit nowhere."""
        packs: dict[tuple[frozenset, int], tuple[tuple[AdapterSpec, ...], int]] = {}
        ordered = sorted(specs, key=lambda s: (-s.batch_size, -_steps(s), s.name))
        every = [combo for n in range(1, len(ordered) + 1) for combo in combinations(ordered, n)] \
            if (len(specs) <= EVERY_PACKING_UP_TO if every is None else every) else None
        orders = (ordered, sorted(specs, key=lambda s: (-_steps(s), -s.batch_size, s.name)))
        for d in self.gpu_options:
            groups = every if every is not None else [
                pack for order in orders for cap in sorted({*(2 ** k for k in range(len(specs).bit_length())),
                                                            len(specs)})
                for pack in self._consecutive(order, cap, d)]
            for group in groups:
                packs.setdefault((frozenset(s.name for s in group), d), (tuple(group), d))
        feasible = [(p, d) for p, d in packs.values() if self.fits(p, d)]
        alone = {p[0].name for p, _ in feasible if len(p) == 1}
        missing = [s for s in specs if s.name not in alone]
        if missing:
            raise ValueError(f"configurations {[s.name for s in missing]} do not fit even alone on {self.num_gpus} "
                             f"GPUs: " + _alone_text(missing, self.memory, self.gpu_options, self.budget,
                                                     self.gpu_bytes, self.load_factor))
        return feasible

    def _consecutive(self, order: Sequence[AdapterSpec], cap: int, d: int) -> list[tuple[AdapterSpec, ...]]:
        """``order`` cut into consecutive packs of at most ``cap`` configurations that fit at ``d`` GPUs."""
        packs, current = [], []
        for spec in order:
            if current and (len(current) == cap or not self.fits([*current, spec], d)):
                packs.append(tuple(current))
                current = []
            current.append(spec)
        return packs + [tuple(current)] if current else packs

    def bound(self, specs: Sequence[AdapterSpec]) -> float:
        """No packing of ``specs`` ends sooner: the longest configuration's shortest time alone (a pack's step taking
        no less time than its members' alone)."""
        return max(min(self.duration([s], d) for d in self.gpu_options if self.fits([s], d)) for s in specs)

    def plan(self, specs: Sequence[AdapterSpec]) -> tuple[list[Job], Schedule]:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            twice = sorted(name for name, n in Counter(names).items() if n > 1)
            raise ValueError(f"configuration names must be unique; given more than once: {twice}")
        if not specs:
            raise ValueError("no configurations to plan")
        packs = self.candidate_packs(specs)  # (first: its error names what fits nowhere)
        greedy_jobs, greedy_placements, greedy_makespan = plora_greedy(specs, self.num_gpus, self.memory,
                                                                       self.step_time, self.budget, 1.0)
        greedy = [(job.specs, job.gpus, greedy_placements[job.id].start) for job in greedy_jobs]  # (the hint: a
        # search from no packing went less far, 1144 s against 964 s for 120 configurations in the benchmark)
        start = "PLoRA's greedy plan"
        single = self.singles(specs)
        if single[2] < greedy_makespan:  # (the better of the two: the plan at worst)
            (greedy_jobs, greedy_placements, greedy_makespan), start = single, "one job a configuration (no packing)"
        every = len(specs) <= EVERY_PACKING_UP_TO
        best, wall, limit = None, 0.0, self.time_limit_s
        if every:  # (every set: a model some 30 times larger, which a short limit may not solve; first the few
            # candidates', its answer the larger model's hint and the plan where that finds none shorter)
            best = self._solve(specs, self.candidate_packs(specs, every=False), greedy, limit * FEW_FIRST)
            wall = best.wall if best else 0.0
            # (what the first left: all but moments where it proved its answer at once)
            limit = max(limit - (best.spent if best else 0.0), limit * (1 - FEW_FIRST))
            if best is not None:
                best = best._replace(optimal=False)  # (optimal among the few alone)
        solved = self._solve(specs, packs, best.placed if best else greedy, limit)
        wall += solved.wall if solved else 0.0
        if solved is not None and (best is None or solved.length <= best.length):
            best = solved
        res = self.resolution_s
        if best is None:  # out of time before a first packing: the greedy plan, as the solver's hint
            note = (f"CP-SAT found no packing within time_limit_s={self.time_limit_s} s: {start}; raise "
                    "time_limit_s for an optimized one")
            warnings.warn(note)
            return greedy_jobs, Schedule(greedy_placements, greedy_makespan, False, wall, self.bound(specs), [note])
        if greedy_makespan < best.length:  # (the grid's rounding can cost more than the packing gained)
            note = (f"{start}: {greedy_makespan:.6g} s, shorter than the best packing found on the "
                    f"{res:g} s grid ({best.length:.6g} s); a finer resolution_s may find a shorter one")
            return greedy_jobs, Schedule(greedy_placements, greedy_makespan, False, wall, self.bound(specs), [note])
        jobs, rows = [], []
        for pack, d, start in best.placed:  # (its own duration: the solver's, rounded up to the grid, holds it)
            job = Job(f"job{len(jobs)}", pack, d, self.duration(pack, d))
            jobs.append(job)
            rows.append((job.id, start, start + job.duration, d))
        # GPU ids by the model's grid (a job a hair longer than its ticks would hold its GPUs past the next's start)
        ids = assign_gpu_ids([(jid, start, best.grid_ends[k], d) for k, (jid, start, _, d) in enumerate(rows)],
                             self.num_gpus)
        placements = {jid: Placement(jid, start, end, ids[jid]) for jid, start, end, _ in rows}
        schedule = Schedule(placements, best.length, best.optimal, wall, self.bound(specs),
                            [f"every packing a candidate ({len(packs)} packs that fit): 'optimal' is over every "
                             f"packing, on the {res:g} s grid" if every else
                             f"packs chosen among {best.candidates} candidates (not every packing): 'optimal' is "
                             f"among those, on the {res:g} s grid"])
        shortest = min(job.duration for job in jobs)
        if res > shortest / 10:  # (jobs of a tick or two each tie on the grid: a plan 3.5 times the best was optimal)
            schedule.notes.append(f"the {res:g} s grid is coarse against the shortest job ({shortest:.3g} s): jobs "
                                  "round up to it and tie, so the plan can be much longer than the best one; give "
                                  "resolution_s under a tenth of the shortest job")
        return jobs, schedule

    def _solve(self, specs: Sequence[AdapterSpec], packs: list[tuple[tuple[AdapterSpec, ...], int]],
               hint: Sequence[tuple[tuple[AdapterSpec, ...], int, float]], time_limit_s: float) -> Optional[_Solved]:
        """The packs among ``packs`` that cover ``specs`` in the least makespan, and their starts (CP-SAT, hinted
        with ``hint``'s (pack, GPUs, start) rows, which join the candidates); None where it finds none in time."""
        cp_model = load_cp_model()

        packs = list(packs)
        hinted_start = {}
        for pack, d, start in hint:
            key = (frozenset(s.name for s in pack), d)
            hinted_start[key] = start
            if not any((frozenset(q.name for q in p), e) == key for p, e in packs):
                packs.append((tuple(pack), d))
        res = self.resolution_s
        sizes = [max(1, math.ceil(self.duration(p, d) / res - 1e-9)) for p, d in packs]
        horizon = sum(sizes)
        if horizon > MAX_TICKS:  # (CP-SAT's integers, as `TaskScheduler.plan`'s: ortools' bare TypeError past them)
            raise ValueError(f"the candidate jobs' durations add up to {horizon * res:.3g} s, {horizon:.3g} steps of "
                             f"`resolution_s`={res}: at most {MAX_TICKS:.3g} steps can be planned (shorter steps, "
                             "fewer of them or a coarser `resolution_s`)")
        model = cp_model.CpModel()
        chosen, starts, intervals, ends = [], [], [], []
        for k, ((pack, d), size) in enumerate(zip(packs, sizes)):
            x = model.NewBoolVar(f"x{k}")
            s = model.NewIntVar(0, horizon, f"s{k}")
            e = model.NewIntVar(0, horizon + size, f"e{k}")
            intervals.append(model.NewOptionalIntervalVar(s, size, e, x, f"i{k}"))
            hinted = hinted_start.get((frozenset(q.name for q in pack), d))
            model.AddHint(x, hinted is not None)
            if hinted is not None:
                model.AddHint(s, math.ceil(hinted / res - 1e-9))
            chosen.append(x)
            starts.append(s)
            ends.append(e)
        for spec in specs:
            model.AddExactlyOne(x for x, (pack, _) in zip(chosen, packs) if any(p.name == spec.name for p in pack))
        model.AddCumulative(intervals, [d for _, d in packs], self.num_gpus)
        makespan = model.NewIntVar(0, horizon, "makespan")
        for x, e in zip(chosen, ends):
            model.Add(makespan >= e).OnlyEnforceIf(x)
        model.Minimize(makespan)
        solver = cp_solver(time_limit_s, self.workers, self.deterministic)
        status = solve(solver, model)
        if status == cp_model.UNKNOWN:
            return None
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError(f"CP-SAT found no packing ({solver.StatusName(status)}) within {time_limit_s} s")
        placed, grid_ends = [], []
        for k, (pack, d) in enumerate(packs):
            if solver.Value(chosen[k]):
                start = solver.Value(starts[k]) * res
                placed.append((pack, d, start))
                grid_ends.append(start + sizes[k] * res)
        length = max(start + self.duration(pack, d) for pack, d, start in placed)
        spent = solver.deterministic_time if self.deterministic else solver.WallTime()  # (of its limit)
        return _Solved(placed, grid_ends, length, status == cp_model.OPTIMAL, solver.WallTime(), len(packs), spent)


class _Solved(NamedTuple):
    """A packing solve's answer: the (pack, GPUs, start) rows chosen, their ends on the grid, the makespan in the
    jobs' own durations, whether proven optimal among the candidates, the solve's seconds, the candidates' count and
    the time it spent of its limit (deterministic: CP-SAT's deterministic time; else its seconds)."""

    placed: list[tuple[tuple[AdapterSpec, ...], int, float]]
    grid_ends: list[float]
    length: float
    optimal: bool
    wall: float
    candidates: int
    spent: float


def plora_greedy(specs: Sequence[AdapterSpec], num_gpus: int, memory: CostFn, step_time: CostFn, gpu_bytes: float,
                 load_factor: float = 0.9) -> tuple[list[Job], dict[str, Placement], float]:
    """PLoRA's greedy job planner (see the module doc). Returns the jobs, their placements and the makespan."""
    check_int("plora_greedy", "num_gpus", num_gpus, 1)
    check_real("plora_greedy", "gpu_bytes", gpu_bytes, lambda v: v > 0, "a finite number of bytes > 0")
    load_factor = check_margin(load_factor, "plora_greedy", "load_factor")
    budget = gpu_bytes * load_factor
    remaining = sorted(specs, key=lambda s: (-s.rank, s.name))
    options = _powers_of_two(num_gpus)
    now, free = 0.0, list(range(num_gpus))
    running: list[tuple[float, tuple[int, ...]]] = []
    jobs: list[Job] = []
    placements: dict[str, Placement] = {}
    while remaining:
        best = None
        for d in (d for d in options if d <= len(free)):
            pack: list[AdapterSpec] = []
            score = 0.0
            for spec in remaining:
                trial = [*pack, spec]
                if _bytes(memory, trial, d) > budget:
                    continue
                trial_score = sum(s.rank for s in trial) / _step_seconds(step_time, trial, d)
                if trial_score > score:
                    pack, score = trial, trial_score
            if pack and (best is None or score / d > best[0]):
                best = (score / d, pack, d)
        if best is None:
            if not running:
                names = [s.name for s in remaining]
                raise ValueError(f"configurations {names} do not fit on {num_gpus} GPUs: "
                                 + _alone_text(remaining, memory, options, budget, gpu_bytes, load_factor))
            running.sort()
            end, gpu_ids = running.pop(0)
            now = max(now, end)
            free.extend(gpu_ids)
            while running and running[0][0] <= end:  # (the jobs ending then: their GPUs free together, for a pack
                free.extend(running.pop(0)[1])  # over them; freed one at a time, two 1-GPU jobs took them)
            continue
        _, pack, d = best
        duration = max(_steps(s) for s in pack) * _step_seconds(step_time, pack, d)
        gpu_ids = tuple(sorted(free)[:d])
        free = [g for g in free if g not in gpu_ids]
        job = Job(f"greedy{len(jobs)}", tuple(pack), d, duration)
        jobs.append(job)
        placements[job.id] = Placement(job.id, now, now + duration, gpu_ids)
        running.append((now + duration, gpu_ids))
        remaining = [s for s in remaining if s not in pack]
    return jobs, placements, max((p.end for p in placements.values()), default=0.0)


def _powers_of_two(num_gpus: int) -> list[int]:
    """A job's GPU counts: 1, 2, 4... up to ``num_gpus`` (they stopped at 64: a configuration that fits 128 GPUs
    alone was refused on a machine of 128)."""
    return [2**k for k in range(int(num_gpus).bit_length())]
