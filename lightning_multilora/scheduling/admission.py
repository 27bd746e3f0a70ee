"""ALTO's admission and backfill policy: as many adapters as the memory model says fit.

Candidates are grouped by per-adapter batch size and admitted greedily in decreasing batch-size order
while the predicted peak stays within the safety margin. When an adapter exits, its slot goes first to
a candidate of the same batch size (homogeneous packing suits the grouped kernels), then to any
candidate the model says fits next to the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from lightning_multilora.arguments import check_int, check_real
from lightning_multilora.scheduling.memory import MemoryFit
from lightning_multilora.scheduling.profiler import check_margin
from lightning_multilora.scheduling.task_scheduler import cp_solver, load_cp_model
from lightning_multilora.spec import AdapterSpec

Predict = Callable[[Sequence[AdapterSpec]], float]


def size_text(num_bytes: float) -> str:
    """Bytes in words at a scale that shows them: GiB with two decimals from 1 GiB, else MiB, else KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"


def fit_predictor(fit: MemoryFit, seq_len: int, params_of: Callable[[AdapterSpec], int],
                  beyond: Optional[Predict] = None) -> Predict:
    """Peak bytes of a set of adapters from a `MemoryFit`: tokens ``sum(b) * seq_len``, their parameters.

    ``beyond`` (e.g. the analytic model's prediction): for a set with more tokens or adapter parameters than
    any profiled point, the larger of the fit and ``beyond``. A line fitted on small configurations can
    under-predict far outside them (on the H200: a grid up to 40 rows at seq 1024 predicted 125.8 GiB for
    122 adapters that peaked at 137.5; the analytic model, ``loss_chunk_tokens=4096``, says 157.7).
    """
    check_int("fit_predictor", "seq_len", seq_len, 1)
    if beyond is not None:
        _check_predict("fit_predictor", "beyond", beyond)
    if not callable(params_of):
        raise TypeError(f"fit_predictor: `params_of` must be a function of an AdapterSpec returning its parameter "
                        f"count, got {type(params_of).__name__}")
    max_tokens = max((p.tokens for p in fit.points), default=0)
    max_params = max((p.adapter_params for p in fit.points), default=0)

    def predict(specs: Sequence[AdapterSpec]) -> float:
        tokens, params = sum(s.rows_per_step for s in specs) * seq_len, sum(params_of(s) for s in specs)
        peak = fit.predict(tokens, params)
        if beyond is not None and (tokens > max_tokens or params > max_params):
            peak = max(peak, beyond(specs))
        return peak

    predict.analytic = getattr(beyond, "analytic", None)  # type: ignore[attr-defined]  # (as `of_specs`' own)
    return predict


def _check_predict(where: str, field: str, predict: Any) -> None:
    """``predict``: a function of a list of AdapterSpecs returning bytes (a `TypeError` naming ``field`` else)."""
    if not callable(predict):
        hint = (" (an AnalyticMemoryModel: pass `analytic.of_specs(seq_len, targets)`)"
                if hasattr(predict, "of_specs") else "")
        raise TypeError(f"{where}: `{field}` must be a function of a list of AdapterSpecs returning bytes, got "
                        f"{type(predict).__name__}{hint}")


def admission_order(candidates: Sequence[AdapterSpec], freed: Optional[AdapterSpec] = None) -> list[AdapterSpec]:
    """The order the greedy controller tries ``candidates`` in: decreasing batch size (queue order within a size),
    those of ``freed``'s batch size first (the spec of an adapter that just exited)."""
    order = sorted(candidates, key=lambda s: -s.batch_size)  # stable: queue order within a size
    if freed is not None:
        order = ([s for s in order if s.batch_size == freed.batch_size]
                 + [s for s in order if s.batch_size != freed.batch_size])
    return order


class AdmissionController:
    """Which queued adapters start now, under ``predict(specs) <= safety_margin * capacity_bytes``.

    Args:
        predict: predicted peak bytes of training a set of adapters together (`fit_predictor`, or the
            analytic model).
        capacity_bytes: the device's memory.
        safety_margin: the usable fraction of it, in (0, 1].
    """

    def __init__(self, predict: Predict, capacity_bytes: float, safety_margin: float = 0.9) -> None:
        _check_predict(type(self).__name__, "predict", predict)
        check_real("AdmissionController", "capacity_bytes", capacity_bytes, lambda v: v > 0,
                   "a finite number of bytes > 0")
        self.predict = predict
        self.capacity_bytes = float(capacity_bytes)
        self.safety_margin = check_margin(safety_margin, "AdmissionController")

    @property
    def budget(self) -> float:
        return self.capacity_bytes * self.safety_margin

    def fits(self, specs: Sequence[AdapterSpec]) -> bool:
        return self.predict(specs) <= self.budget

    def select(self, running: Sequence[AdapterSpec], candidates: Sequence[AdapterSpec],
               freed: Optional[AdapterSpec] = None) -> list[AdapterSpec]:
        """The candidates to start next to ``running``, in admission order.

        Without ``freed``: decreasing batch size (queue order within a size). With ``freed`` (the spec of
        an adapter that just exited): candidates of its batch size first, then the rest as above.
        A candidate that does not fit is skipped; smaller ones after it may still fit.
        """
        chosen: list[AdapterSpec] = []
        for spec in admission_order(candidates, freed):
            if self.fits([*running, *chosen, spec]):
                chosen.append(spec)
        return chosen

    def plan(self, candidates: Sequence[AdapterSpec]) -> list[AdapterSpec]:
        """The adapters an empty device starts with (how many slots this run has)."""
        if not candidates:
            raise ValueError("no candidate adapters to plan slots for: the queue is empty")
        chosen = self.select([], candidates)
        if not chosen:
            smallest = min(candidates, key=lambda s: s.batch_size)
            raise ValueError(f"not even one adapter fits: {self.alone(smallest)} (lower its batch_size or rank, or "
                             "raise capacity_bytes or safety_margin)")
        return chosen

    def alone(self, spec: AdapterSpec) -> str:
        """What ``spec`` alone needs against the budget, in words."""
        return (f"{spec.name!r} (batch_size={spec.batch_size}) alone needs {size_text(self.predict([spec]))}, the "
                f"budget is {size_text(self.budget)} ({self.safety_margin:.0%} of {size_text(self.capacity_bytes)})")


def choose_gradient_checkpointing(specs: Sequence[AdapterSpec], with_checkpointing: Predict,
                                  without_checkpointing: Predict, budget_bytes: float) -> bool:
    """Whether to recompute activations: only when the admitted set does not fit without (recomputation
    costs about a third of the base step)."""
    if without_checkpointing(specs) <= budget_bytes:
        return False
    if with_checkpointing(specs) > budget_bytes:
        raise ValueError(f"{len(specs)} adapters do not fit even with gradient checkpointing "
                         f"({size_text(with_checkpointing(specs))} > {size_text(budget_bytes)}): admit fewer, or "
                         "lower their batch sizes or ranks")
    return True


class CPSATAdmission(AdmissionController):
    """The slot-filling decision as a small CP-SAT model, in place of the greedy order.

    With a linear memory fit (``M = k0 + k1*B*L + k2*P``) each candidate's cost is linear, so choosing
    which queued candidates to admit is a knapsack: maximize ``sum x_i * value_i`` subject to the fit's
    prediction of running + chosen staying within the budget. ``value_i`` counts the rows admitted (the
    packed step's throughput), a bonus for the freed slot's batch size (homogeneous packs) and
    ``priority(spec)`` (e.g. the Optuna study's most promising candidates; default 0), in that strict order of
    weight (a row more outweighs any bonuses and priorities). ``beyond``: as `fit_predictor`'s (the analytic
    model's prediction past the profiled points); the chosen set is checked against it. Use it wherever an
    `AdmissionController` goes (the module, `OptunaSweep`).
    """

    def __init__(self, fit: MemoryFit, seq_len: int, params_of: Callable[[AdapterSpec], int], capacity_bytes: float,
                 safety_margin: float = 0.9, priority: Optional[Callable[[AdapterSpec], float]] = None,
                 time_limit_s: float = 0.5, beyond: Optional[Predict] = None) -> None:
        check_real("CPSATAdmission", "time_limit_s", time_limit_s, lambda v: v > 0, "a finite number of seconds > 0")
        super().__init__(fit_predictor(fit, seq_len, params_of, beyond), capacity_bytes, safety_margin)
        self.fit, self.seq_len, self.params_of = fit, seq_len, params_of
        self.priority = priority or (lambda spec: 0.0)
        self.time_limit_s = time_limit_s

    def select(self, running: Sequence[AdapterSpec], candidates: Sequence[AdapterSpec],
               freed: Optional[AdapterSpec] = None) -> list[AdapterSpec]:
        cp_model = load_cp_model()

        if not candidates:
            return []
        room = self.budget - self.predict(running)
        costs = [self.fit.k1 * s.rows_per_step * self.seq_len + self.fit.k2 * self.params_of(s) for s in candidates]
        scale = max(max(costs), 1.0) / 1e6  # integer costs, about 1e6 for the largest
        model = cp_model.CpModel()
        x = [model.NewBoolVar(s.name) for s in candidates]
        model.Add(sum(int(round(c / scale)) * xi for c, xi in zip(costs, x)) <= int(room / scale))
        priorities = [self.priority(s) for s in candidates]
        top = max((abs(p) for p in priorities), default=0.0) or 1.0
        # rows, then the freed slot's batch size, then priority, each outweighing all of the next ones together
        n = len(candidates)
        bonus = 100 * n + 1  # (priorities of all candidates span at most 100 * n)
        row = n * bonus + 100 * n + 1
        values = [row * s.rows_per_step + (bonus if freed is not None and s.batch_size == freed.batch_size else 0)
                  + int(round(50 * p / top)) for s, p in zip(candidates, priorities)]
        model.Maximize(sum(v * xi for v, xi in zip(values, x)))
        solver = cp_solver(self.time_limit_s, 1)
        status = solver.Solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return super().select(running, candidates, freed)
        chosen = sorted((s for s, xi in zip(candidates, x) if solver.Value(xi)), key=lambda s: -s.batch_size)
        # rounding the costs must never admit what the fit says does not fit
        while chosen and not self.fits([*running, *chosen]):
            chosen.pop()
        # nor admit fewer rows than the greedy order: the costs are the fit's alone, and `beyond` (the analytic model
        # past the profiled points) may refuse the set CP-SAT chose where a greedy one of other adapters fits
        greedy = super().select(running, candidates, freed)
        rows = sum(s.rows_per_step for s in chosen)
        return greedy if sum(s.rows_per_step for s in greedy) > rows else chosen


def simulate_sweep(controller: AdmissionController, specs: Sequence[AdapterSpec],
                   step_time: Callable[[Sequence[AdapterSpec]], float], seq_len: int) -> dict[str, float]:
    """A sweep on one device on a virtual clock: every step trains all running adapters (``step_time``
    seconds), each adapter leaves after its ``max_steps``, freed slots are refilled by ``controller``.
    Returns the makespan, tokens per second and the mean / largest number of adapters running."""
    queue = list(specs)
    running: dict[str, list] = {}  # name -> [spec, steps left]
    clock = tokens = 0.0
    counts: list[int] = []
    freed: Optional[AdapterSpec] = None
    while queue or running:
        for spec in controller.select([r[0] for r in running.values()], queue, freed):
            if spec.max_steps is None:
                raise ValueError(f"adapter {spec.name!r}: the simulation needs `max_steps`")
            running[spec.name] = [spec, spec.max_steps]
            queue.remove(spec)
        freed = None
        if not running:
            raise ValueError(f"adapters {[s.name for s in queue]} never fit the memory budget")
        active = [r[0] for r in running.values()]
        clock += step_time(active)
        tokens += sum(s.rows_per_step for s in active) * seq_len
        counts.append(len(active))
        for name in list(running):
            running[name][1] -= 1
            if running[name][1] == 0:
                freed = running.pop(name)[0]
    return dict(makespan_s=clock, tokens_per_s=tokens / clock, mean_running=sum(counts) / len(counts),
                max_running=max(counts))
