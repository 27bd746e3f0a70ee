"""CP-SAT task scheduler: solve time and makespan against the lower bound and greedy list scheduling.

    PYTHONPATH=. python benchmarks/scheduler.py --out benchmarks/results/scheduler.json

Instances: ALTO's mix (11 tasks on 8 GPUs: Llama-70B-like tasks on 4 GPUs, 32B-like on 2, 7-8B-like on 1),
100 random tasks on 64 GPUs, and a replanning step (an early completion plus an arrival) on each.
Packing: 40 and 120 LoRA configurations (PLoRA's evaluation size) of a Llama-3.1-8B-shaped model on 8
GPUs, planned by `PackingPlanner` (CP-SAT over packs and GPU counts) and by PLoRA's greedy planner on the
same cost model: memory from `AnalyticMemoryModel` at seq 256 (within 12% of the H200 peaks measured by
packed_step.py), step time from the H200 frozen-base steps at seq 256 (136 ms at 1 row, 712 ms at 32:
about 118 ms + 19 ms per row, LoRA +20%), base and rows split over a job's GPUs with 90% scaling per
doubling. A job lasts its longest configuration's steps.
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

from lightning_multilora.scheduling import (
    AnalyticMemoryModel,
    ModelShape,
    PackingPlanner,
    Placement,
    Task,
    TaskScheduler,
    list_schedule,
    lower_bound,
    plora_greedy,
)
from lightning_multilora.spec import AdapterSpec

LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
SEQ = 256


def packing_cost_model():
    analytic = AnalyticMemoryModel(ModelShape.from_config(LLAMA_8B), loss_chunk_tokens=4096)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def memory(specs, d):
        return analytic.predict([(s.rank, s.batch_size, targets) for s in specs], SEQ) / d

    def step_time(specs, d):
        rows = sum(s.batch_size for s in specs)
        return (0.118 + 0.019 * rows) * 1.2 / (d * 0.9 ** (d.bit_length() - 1))

    return memory, step_time


def packing_configs(n: int, rng: random.Random) -> list[AdapterSpec]:
    return [AdapterSpec(f"cfg{i}", rank=rng.choice([8, 16, 32, 64, 128]), batch_size=rng.choice([1, 2, 4, 8]),
                        max_steps=rng.choice([200, 500, 1000])) for i in range(n)]


def packing_rows(rng: random.Random) -> list[dict]:
    memory, step_time = packing_cost_model()
    rows = []
    for n in (40, 120):
        specs = packing_configs(n, rng)
        planner = PackingPlanner(8, memory, step_time, gpu_bytes=141e9, load_factor=0.9, time_limit_s=10.0,
                                 resolution_s=10.0)
        start = time.perf_counter()
        jobs, plan = planner.plan(specs)
        wall = time.perf_counter() - start
        start = time.perf_counter()
        greedy_jobs, _, greedy = plora_greedy(specs, 8, memory, step_time, 141e9, 0.9)
        greedy_s = time.perf_counter() - start
        alone = list_schedule([Task(s.name, planner.duration([s], 1), 1) for s in specs], 8)
        row = {"instance": f"packing_{n}_configs_on_8", "configs": n, "gpus": 8, "solve_s": round(wall, 2),
               "optimal": plan.optimal, "jobs": len(jobs), "job_gpus": sorted(j.gpus for j in jobs),
               "makespan": round(plan.makespan, 1), "plora_greedy_makespan": round(greedy, 1),
               "plora_greedy_jobs": len(greedy_jobs), "plora_greedy_s": round(greedy_s, 3),
               "greedy_over_planner_pct": round(100 * (greedy / plan.makespan - 1), 2),
               "one_config_per_gpu_makespan": round(alone, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


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
    rows += packing_rows(rng)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores (CPU)", "date": datetime.now(timezone.utc).date().isoformat(),
            "ortools": __import__("ortools").__version__, "resolution_s": 10.0, "replan_time_limit_s": 0.9,
            "notes": "packing rows: cost model in the script's docstring; PLoRA's greedy as its paper describes it. "
                     "Task rows: solve_s is the plan's wall time, both CP-SAT solves (the makespan, then the "
                     "earliest starts at that makespan, EARLY_SHARE of the limit) with their start-up."}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
