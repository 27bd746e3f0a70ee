"""PackingPlanner against PLoRA's greedy planner on the same cost model."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest

from lightning_multilora import AdapterSpec
from lightning_multilora.scheduling import PackingPlanner, plora_greedy
from lightning_multilora.scheduling.packing import EVERY_PACKING_UP_TO

GB = 1e9


def memory(specs, d):
    """A base of 16 GB sharded over d GPUs, 1.5 GB per batch row, 0.02 GB per rank unit."""
    return (16 * GB + sum(1.5 * GB * s.batch_size + 0.02 * GB * s.rank for s in specs)) / d


def step_time(specs, d):
    """A fixed base cost plus work per row; more GPUs help with diminishing returns."""
    return (3.0 + 0.2 * sum(s.batch_size for s in specs) + 0.001 * sum(s.rank for s in specs)) / d ** 0.8


def configs(n, seed=0):
    rng = random.Random(seed)
    return [AdapterSpec(f"c{i}", rank=rng.choice([8, 16, 64]), batch_size=rng.choice([1, 2, 4, 8]),
                        max_steps=rng.choice([50, 100, 200])) for i in range(n)]


def overlaps(placements):
    for a, b in itertools.combinations(placements.values(), 2):
        if set(a.gpu_ids) & set(b.gpu_ids) and a.start < b.end - 1e-9 and b.start < a.end - 1e-9:
            return True
    return False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_planner_covers_every_configuration_once_within_memory_and_beats_plora_greedy(seed):
    specs = configs(14, seed)
    # (1 s: its plan is ~half greedy's makespan within it, and the same plan as in 5 s)
    planner = PackingPlanner(4, memory, step_time, gpu_bytes=80 * GB, time_limit_s=1)
    jobs, schedule = planner.plan(specs)
    packed = sorted(s.name for job in jobs for s in job.specs)
    assert packed == sorted(s.name for s in specs)
    assert all(memory(job.specs, job.gpus) <= 0.9 * 80 * GB for job in jobs)
    assert not overlaps(schedule.placements)
    assert any(len(job.specs) > 1 for job in jobs)  # packing happened
    greedy_jobs, greedy_placements, greedy_makespan = plora_greedy(specs, 4, memory, step_time, 80 * GB)
    assert sorted(s.name for job in greedy_jobs for s in job.specs) == packed
    assert not overlaps(greedy_placements)
    assert schedule.makespan <= greedy_makespan + planner.resolution_s * len(jobs)


def test_a_tiny_instance_is_solved_optimally():
    # two configurations that fit together on one GPU: together (one job) beats apart (two 1-GPU jobs
    # side by side take as long as the longer one, and the pack is faster per row)
    specs = [AdapterSpec("a", rank=8, batch_size=1, max_steps=100), AdapterSpec("b", rank=8, batch_size=1, max_steps=100)]
    planner = PackingPlanner(1, memory, step_time, gpu_bytes=80 * GB)
    jobs, schedule = planner.plan(specs)
    together = 100 * step_time(specs, 1)
    apart = 2 * 100 * step_time(specs[:1], 1)
    assert len(jobs) == 1 and schedule.optimal and schedule.makespan == pytest.approx(min(together, apart), abs=1)


def test_configurations_that_cannot_be_planned_get_clear_errors():
    planner = PackingPlanner(2, memory, step_time, gpu_bytes=10 * GB)
    with pytest.raises(ValueError, match=r"do not fit even alone on 2 GPUs"):
        planner.plan([AdapterSpec("huge", rank=8, batch_size=32, max_steps=10)])
    with pytest.raises(ValueError, match="needs `max_steps`"):
        planner.plan([AdapterSpec("epochs", rank=8, max_epochs=1)])
    with pytest.raises(ValueError, match="no configurations"):
        planner.plan([])
    with pytest.raises(ValueError, match="load_factor|safety_margin"):
        PackingPlanner(2, memory, step_time, gpu_bytes=10 * GB, load_factor=0)


def test_a_job_may_take_every_power_of_two_of_the_machines_gpus():
    """The GPU counts stopped at 64: a configuration that fits 128 GPUs alone was refused on a machine of 128."""
    def spread(specs, d):
        return 100.0 / d

    planner = PackingPlanner(128, spread, lambda specs, d: 1.0, gpu_bytes=1.0, load_factor=1.0, time_limit_s=1,
                             workers=1)
    assert planner.gpu_options == [1, 2, 4, 8, 16, 32, 64, 128]
    jobs, plan = planner.plan([AdapterSpec("big", rank=8, max_steps=10)])
    assert [job.gpus for job in jobs] == [128] and plan.makespan > 0
    greedy_jobs, _, _ = plora_greedy([AdapterSpec("big", rank=8, max_steps=10)], 128, spread, lambda specs, d: 1.0,
                                     1.0, 1.0)
    assert [job.gpus for job in greedy_jobs] == [128]
    assert PackingPlanner(100, spread, step_time, gpu_bytes=1.0).gpu_options[-1] == 64


def test_the_plan_says_its_packs_are_chosen_among_candidates_and_bad_settings_are_named():
    specs = [AdapterSpec("a", rank=8, batch_size=1, max_steps=100), AdapterSpec("b", rank=8, batch_size=1, max_steps=100)]
    _, schedule = PackingPlanner(1, memory, step_time, gpu_bytes=80 * GB).plan(specs)
    assert "every packing a candidate (3 packs that fit): 'optimal' is over every packing" in schedule.table()
    _, schedule = PackingPlanner(2, memory, step_time, gpu_bytes=80 * GB).plan(configs(EVERY_PACKING_UP_TO + 1, 2))
    assert "candidates (not every packing)" in schedule.table()
    for kwargs, message in (({"num_gpus": True}, "`num_gpus` must be an integer >= 1"),
                            ({"resolution_s": 0}, "`resolution_s` must be a finite number of seconds > 0"),
                            ({"time_limit_s": float("nan")}, "`time_limit_s` must be a finite number of seconds > 0"),
                            ({"gpu_bytes": -1}, "`gpu_bytes` must be a finite number of bytes > 0")):
        with pytest.raises(ValueError, match=message):
            PackingPlanner(**{"num_gpus": 2, "memory": memory, "step_time": step_time, "gpu_bytes": 80 * GB,
                              **kwargs})


def test_jobs_keep_their_own_durations_and_the_plan_is_never_longer_than_the_greedy_one():
    """Durations rounded up to `resolution_s` made three 1.5 s jobs that cannot share a GPU 2 s each: a 6 s plan,
    marked optimal, where PLoRA's greedy one takes 4.5 s."""
    specs = [AdapterSpec(f"c{i}", rank=8, max_steps=100) for i in range(3)]
    memory, step_time = (lambda ss, d: 60e9 * len(ss) / d), (lambda ss, d: 0.015)  # (one a GPU, 1.5 s each)
    _, _, greedy = plora_greedy(specs, 1, memory, step_time, 80e9, 0.9)
    jobs, schedule = PackingPlanner(1, memory, step_time, gpu_bytes=80e9, resolution_s=1.0).plan(specs)
    assert greedy == pytest.approx(4.5) and schedule.makespan == pytest.approx(4.5) and not schedule.optimal
    assert "greedy plan" in schedule.notes[0] and "finer resolution_s" in schedule.notes[0]
    jobs, schedule = PackingPlanner(1, memory, step_time, gpu_bytes=80e9, resolution_s=0.5).plan(specs)
    assert schedule.optimal and schedule.makespan == pytest.approx(4.5)
    assert [j.duration for j in jobs] == pytest.approx([1.5] * 3)
    assert max(p.end for p in schedule.placements.values()) == pytest.approx(schedule.makespan)


def test_small_instances_are_packed_as_well_as_every_packing_allows_and_the_bound_holds_for_every_packing():
    """Only consecutive packs of batch-size-ordered configurations, each as large as memory allows, were candidates:
    a plan marked optimal (120 s, "lower bound 120") where {c0, c1} then {c2, c3}, each on 2 GPUs, take 103.4 s."""
    specs = [AdapterSpec(f"c{i}", rank=rank, batch_size=bs, max_steps=steps)
             for i, (rank, bs, steps) in enumerate([(16, 1, 40), (16, 4, 40), (8, 4, 10), (8, 2, 10)])]
    gb = 2 ** 30
    cost = (lambda ss, d: 30 * gb / d + sum(s.batch_size * 6 * gb + s.rank * 0.05 * gb for s in ss) / d,
            lambda ss, d: (1.0 + 0.5 * sum(s.batch_size for s in ss)) / d ** 0.8)
    planner = PackingPlanner(2, *cost, gpu_bytes=80 * gb, time_limit_s=5, resolution_s=0.01)
    jobs, schedule = planner.plan(specs)
    two = 40 * cost[1](specs[:2], 2) + 10 * cost[1](specs[2:], 2)  # {c0, c1} on 2 GPUs, then {c2, c3} on 2
    assert two == pytest.approx(103.38, abs=0.01) and schedule.makespan <= two + 0.01 and schedule.optimal
    assert schedule.lower_bound <= schedule.makespan
    assert schedule.lower_bound == pytest.approx(max(min(40 * cost[1]([s], d) for d in (1, 2)) for s in specs[:2]))


@pytest.mark.parametrize("costs", ["packing pays", "packing costs"])
def test_a_solve_out_of_time_before_any_packing_gives_the_better_of_the_greedy_plan_and_no_packing(monkeypatch,
                                                                                                  costs):
    """PLoRA's greedy plan was the only fallback (and hint): where packing costs more than it saves it came to twice
    the makespan of one job a configuration (985 s against 488 s on the README benchmark's cost model)."""
    from ortools.sat.python import cp_model

    specs = configs(10, 4)
    solve = cp_model.CpSolver.Solve  # (solved, then reported as out of time: what a too small limit gives)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", lambda self, model, *a, **k: solve(self, model) and cp_model.UNKNOWN)
    slow = (lambda specs, d: 1.0 / d) if costs == "packing pays" else lambda specs, d: 2.0 * len(specs) ** 2 / d
    planner = PackingPlanner(4, memory, slow, gpu_bytes=80 * GB, time_limit_s=0.01)
    with pytest.warns(UserWarning, match="time_limit_s=0.01"):
        jobs, schedule = planner.plan(specs)
    greedy_jobs, _, greedy_makespan = plora_greedy(specs, 4, memory, slow, 80 * GB * 0.9, 1.0)
    single_jobs, _, single_makespan = planner.singles(specs)
    expected = greedy_jobs if greedy_makespan <= single_makespan else single_jobs
    assert (greedy_makespan < single_makespan) == (costs == "packing pays")
    assert [j.specs for j in jobs] == [j.specs for j in expected] and not schedule.optimal
    assert schedule.makespan == pytest.approx(min(greedy_makespan, single_makespan))
    assert not overlaps(schedule.placements)
    assert sorted(s.name for job in jobs for s in job.specs) == sorted(s.name for s in specs)


def test_the_greedy_frees_every_job_ending_at_once_before_it_packs_again():
    """Jobs ending together were freed one at a time: two 1-GPU jobs took the GPUs one 2-GPU pack would have."""
    import random

    def mem(specs, d):
        return (16 * GB + sum(1.5 * GB * s.batch_size + 0.02 * GB * s.rank for s in specs)) / d

    def steps(specs, d):
        return (2 + sum(s.batch_size for s in specs)) * (1.0 if d == 1 else 1.25) / d

    rng = random.Random(26)  # (an instance where two jobs end at t=192 with both GPUs then free)
    gpus, n, gib = rng.choice([2, 4]), rng.randint(3, 8), rng.choice([24, 32, 40])
    specs = [AdapterSpec(f"c{i}", rank=rng.choice([8, 16, 64]), batch_size=rng.choice([1, 2, 4, 8]),
                         max_steps=16 * rng.randint(1, 3)) for i in range(n)]
    jobs, placements, makespan = plora_greedy(specs, gpus, mem, steps, gib * GB)
    assert [(sorted(s.name for s in j.specs), j.gpus) for j in jobs if placements[j.id].start == 192] == [
        (["c3", "c4"], 2)]
    assert makespan == 764


def test_a_pack_of_every_configuration_is_a_candidate_past_the_exhaustive_size():
    """Past `EVERY_PACKING_UP_TO` the packs were of at most 1, 2, 4, 8... configurations: 9 to 15 never shared one
    pack, which was the shortest plan where a larger pack runs faster (19% to 24% longer plans)."""
    def memory(specs, d):
        return (1.0 + sum(s.rank * s.batch_size for s in specs) / 64) / d * 2**30

    def step(specs, d):
        return (0.1 + 0.01 * sum(s.batch_size for s in specs)) / d ** 0.8

    specs = [AdapterSpec(f"a{i}", rank=8, batch_size=4, max_steps=100) for i in range(EVERY_PACKING_UP_TO + 1)]
    planner = PackingPlanner(4, memory, step, 16 * 2**30, time_limit_s=4, deterministic=True)
    assert max(len(pack) for pack, _ in planner.candidate_packs(specs)) == len(specs)
    jobs, schedule = planner.plan(specs)
    assert [(len(j.specs), j.gpus) for j in jobs] == [(len(specs), 4)]
    assert schedule.makespan == pytest.approx(planner.duration(specs, 4))


def test_a_memory_cost_that_is_no_size_is_named():
    """A NaN was read as a size ("needs nan KiB"), None failed with a bare TypeError, a negative one packed
    anything."""
    for bad in (math.nan, None, -1.0):
        planner = PackingPlanner(2, lambda specs, d, bad=bad: bad, step_time, gpu_bytes=80 * GB)
        with pytest.raises(ValueError, match=rf"`memory` must return the bytes per GPU, a finite number >= 0; for "
                                             rf"\['c\d'\] on 1 GPU it returned {re.escape(repr(bad))}"):
            planner.plan(configs(3))
        with pytest.raises(ValueError, match=r"`memory` must return the bytes per GPU"):
            plora_greedy(configs(3), 2, lambda specs, d, bad=bad: bad, step_time, 80 * GB)


def test_planner_errors_name_the_callers_field_the_numbers_and_the_duplicates():
    """``load_factor=1.5`` was refused as `safety_margin`; "do not fit even alone" gave no sizes; "names must be
    unique" named none; a `step_time` of 0 divided by zero in PLoRA's greedy planner."""
    with pytest.raises(ValueError, match=r"PackingPlanner: `load_factor` must be the usable fraction of device memory, "
                                         r"a number in \(0, 1\], got 1.5"):
        PackingPlanner(2, memory, step_time, gpu_bytes=10 * GB, load_factor=1.5)
    with pytest.raises(ValueError, match=r"PackingPlanner: `load_factor` .* got '0.9'"):
        PackingPlanner(2, memory, step_time, gpu_bytes=10 * GB, load_factor="0.9")
    planner = PackingPlanner(2, memory, step_time, gpu_bytes=10 * GB)
    huge = AdapterSpec("huge", rank=8, batch_size=32, max_steps=10)  # (16 + 48 + 0.16 GB) / 2 GPUs = 32.08 GB each
    with pytest.raises(ValueError, match=r"\['huge'\] do not fit even alone on 2 GPUs: 'huge' needs 29.88 GiB per GPU "
                                         r"at best \(on 2 GPUs\); the budget is 8.38 GiB per GPU \(90% of 9.31 GiB\)"):
        planner.plan([huge])
    with pytest.raises(ValueError, match=r"\['huge'\] do not fit on 2 GPUs: 'huge' needs 29.88 GiB"):
        plora_greedy([huge], 2, memory, step_time, 10 * GB)
    a = AdapterSpec("a", rank=8, batch_size=1, max_steps=10)
    with pytest.raises(ValueError, match=r"configuration names must be unique; given more than once: \['a'\]"):
        planner.plan([a, AdapterSpec("b", rank=8, max_steps=10), a])
    for zero in (0.0, float("nan"), None):
        with pytest.raises(ValueError, match=r"`step_time` must return seconds per step, a finite number > 0; for "
                                             r"\['a'\] on 1 GPU it returned " + re.escape(repr(zero))):
            PackingPlanner(2, memory, lambda specs, d, v=zero: v, gpu_bytes=80 * GB).plan([a])


def test_a_deterministic_planner_packs_the_same_every_time():
    """Eight workers racing for a wall-clock limit packed 30 configurations on 8 GPUs into 14, 16 or 4 jobs from one
    run to the next (makespans 12% apart), and no setting made it repeat."""
    specs = configs(EVERY_PACKING_UP_TO + 6, 3)

    def plan():
        jobs, schedule = PackingPlanner(4, memory, step_time, gpu_bytes=80 * GB, time_limit_s=0.5,
                                        deterministic=True).plan(specs)
        return [(sorted(s.name for s in job.specs), job.gpus) for job in jobs], schedule.placements

    first, second = plan(), plan()
    assert first == second
    for kwargs, message in (({"workers": 0}, "PackingPlanner: `workers` must be an integer >= 1"),
                            ({"deterministic": "yes"}, "PackingPlanner: `deterministic` must be True or False")):
        with pytest.raises(ValueError, match=message):
            PackingPlanner(2, memory, step_time, gpu_bytes=80 * GB, **kwargs)


def test_bad_machines_and_durations_past_the_solvers_integers_are_named():
    """``plora_greedy`` on 0 GPUs said "min() arg is an empty sequence"; durations past CP-SAT's integers gave
    ortools' bare TypeError about a Domain."""
    a = AdapterSpec("a", rank=8, batch_size=1, max_steps=10)
    with pytest.raises(ValueError, match=r"plora_greedy: `num_gpus` must be an integer >= 1, got 0"):
        plora_greedy([a], 0, memory, step_time, 80 * GB)
    slow = PackingPlanner(1, memory, lambda specs, d: 1e18, gpu_bytes=80 * GB)
    with pytest.raises(ValueError, match=r"durations add up to 1e\+19 s, .* at most 1.1e\+12 steps can be planned"):
        slow.plan([a])


def test_a_grid_coarse_against_the_shortest_job_is_noted():
    """Jobs a tick or two long tie on a coarse grid: a plan 3.5 times the best was marked optimal, unsaid."""
    specs = configs(4, 1)
    coarse = PackingPlanner(2, memory, step_time, gpu_bytes=80 * GB, resolution_s=400, deterministic=True)
    _, schedule = coarse.plan(specs)
    assert any("grid is coarse against the shortest job" in note for note in schedule.notes), schedule.notes
    _, fine = PackingPlanner(2, memory, step_time, gpu_bytes=80 * GB, resolution_s=1, deterministic=True).plan(specs)
    assert not any("coarse" in note for note in fine.notes), fine.notes
