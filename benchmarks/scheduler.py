"""CP-SAT task scheduler: solve time and makespan against the lower bound and greedy list scheduling.

    PYTHONPATH=. python benchmarks/scheduler.py --out benchmarks/results/scheduler.json

Instances: ALTO's mix (11 tasks on 8 GPUs: Llama-70B-like tasks on 4 GPUs, 32B-like on 2, 7-8B-like on 1),
100 random tasks on 64 GPUs, and a replanning step (an early completion plus an arrival) on each.
Runs on the CPU; the machine is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from datetime import datetime, timezone
from pathlib import Path

from lightning_multilora.scheduling import Placement, Task, TaskScheduler, list_schedule, lower_bound


def alto_mix(rng: random.Random) -> list[Task]:
    tasks = [Task(f"llama70b-{i}", rng.uniform(3000, 6000), 4) for i in range(2)]
    tasks += [Task(f"qwen32b-{i}", rng.uniform(1500, 3500), 2) for i in range(3)]
    tasks += [Task(f"llama8b-{i}", rng.uniform(500, 2500), 1) for i in range(6)]
    return tasks


def random_tasks(rng: random.Random, n: int) -> list[Task]:
    return [Task(f"t{i}", rng.uniform(100, 5000), rng.choice([1, 1, 1, 2, 2, 4, 8])) for i in range(n)]


def replan(scheduler: TaskScheduler, tasks: list[Task], first, rng: random.Random) -> dict:
    """At the first completion, that task ended early (half its time) and a new task arrives: replan."""
    by_start = sorted(first.placements.values(), key=lambda p: p.start)
    now = min(p.start + (p.end - p.start) / 2 for p in by_start if p.start == 0)
    running = {p.task_id: p for p in by_start if p.start <= now < p.end}
    # the task that finished early leaves the running set
    done = min(running.values(), key=lambda p: p.end)
    del running[done.task_id]
    pending = [t for t in tasks if first.placements[t.id].start > now] + [Task("arrival", 1000.0, 2)]
    start = time.perf_counter()
    second = scheduler.plan(pending, running=running, now=now, time_limit_s=0.9)
    return {"replan_s": round(time.perf_counter() - start, 3), "makespan": round(second.makespan, 1),
            "optimal": second.optimal}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/scheduler.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for name, gpus, tasks, limit in (("alto_mix_11_on_8", 8, alto_mix(rng), 0.5),
                                     ("random_100_on_64", 64, random_tasks(rng, 100), 10.0)):
        scheduler = TaskScheduler(gpus, time_limit_s=limit, resolution_s=10.0)  # durations are 1e2..1e4 s
        start = time.perf_counter()
        plan = scheduler.plan(tasks)
        wall = time.perf_counter() - start
        lb = lower_bound(tasks, gpus)
        greedy = list_schedule(tasks, gpus)
        row = {"instance": name, "tasks": len(tasks), "gpus": gpus, "time_limit_s": limit,
               "solve_s": round(wall, 3), "optimal": plan.optimal, "makespan": round(plan.makespan, 1),
               "lower_bound": round(lb, 1), "gap_to_lower_bound_pct": round(100 * (plan.makespan / lb - 1), 2),
               "greedy_longest_first": round(greedy, 1),
               "greedy_over_cpsat_pct": round(100 * (greedy / plan.makespan - 1), 2),
               **{f"replan_{k}": v for k, v in replan(scheduler, tasks, plan, rng).items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores (CPU)", "date": datetime.now(timezone.utc).date().isoformat(),
            "ortools": __import__("ortools").__version__, "resolution_s": 10.0, "replan_time_limit_s": 0.9,
            "notes": "PLoRA's greedy planner is not compared yet (issue 6 is in progress)."}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
