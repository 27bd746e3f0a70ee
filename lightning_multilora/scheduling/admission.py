"""ALTO's admission and backfill policy: as many adapters as the memory model says fit.

Candidates are grouped by per-adapter batch size and admitted greedily in decreasing batch-size order
while the predicted peak stays within the safety margin. When an adapter exits, its slot goes first to
a candidate of the same batch size (homogeneous packing suits the grouped kernels), then to any
candidate the model says fits next to the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from lightning_multilora.scheduling.memory import MemoryFit
from lightning_multilora.scheduling.profiler import check_margin
from lightning_multilora.spec import AdapterSpec

Predict = Callable[[Sequence[AdapterSpec]], float]


def fit_predictor(fit: MemoryFit, seq_len: int, params_of: Callable[[AdapterSpec], int]) -> Predict:
    """Peak bytes of a set of adapters from a `MemoryFit`: tokens ``sum(b) * seq_len``, their parameters."""
    if seq_len < 1:
        raise ValueError(f"`seq_len` must be >= 1, got {seq_len}")

    def predict(specs: Sequence[AdapterSpec]) -> float:
        return fit.predict(sum(s.batch_size for s in specs) * seq_len, sum(params_of(s) for s in specs))

    return predict


class AdmissionController:
    """Which queued adapters start now, under ``predict(specs) <= safety_margin * capacity_bytes``.

    Args:
        predict: predicted peak bytes of training a set of adapters together (`fit_predictor`, or the
            analytic model).
        capacity_bytes: the device's memory.
        safety_margin: the usable fraction of it, in (0, 1].
    """

    def __init__(self, predict: Predict, capacity_bytes: float, safety_margin: float = 0.9) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"`capacity_bytes` must be > 0, got {capacity_bytes}")
        self.predict = predict
        self.capacity_bytes = float(capacity_bytes)
        self.safety_margin = check_margin(safety_margin)

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
        order = sorted(candidates, key=lambda s: -s.batch_size)  # stable: queue order within a size
        if freed is not None:
            order = ([s for s in order if s.batch_size == freed.batch_size]
                     + [s for s in order if s.batch_size != freed.batch_size])
        chosen: list[AdapterSpec] = []
        for spec in order:
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
            raise ValueError(f"not even one adapter fits: {smallest.name!r} (batch_size={smallest.batch_size}) "
                             f"needs {self.predict([smallest]) / 2**30:.2f} GiB, the budget is "
                             f"{self.budget / 2**30:.2f} GiB ({self.safety_margin:.0%} of "
                             f"{self.capacity_bytes / 2**30:.2f} GiB)")
        return chosen


def choose_gradient_checkpointing(specs: Sequence[AdapterSpec], with_checkpointing: Predict,
                                  without_checkpointing: Predict, budget_bytes: float) -> bool:
    """Whether to recompute activations: only when the admitted set does not fit without (recomputation
    costs about a third of the base step)."""
    if without_checkpointing(specs) <= budget_bytes:
        return False
    if with_checkpointing(specs) > budget_bytes:
        raise ValueError(f"{len(specs)} adapters do not fit even with gradient checkpointing "
                         f"({with_checkpointing(specs) / 2**30:.2f} GiB > {budget_bytes / 2**30:.2f} GiB)")
    return True
