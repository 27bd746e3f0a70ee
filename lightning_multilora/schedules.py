"""Per-adapter learning-rate schedules (the formulas of ``transformers.get_scheduler``)."""

from __future__ import annotations

import math

from lightning_multilora.spec import SCHEDULES


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the peak learning rate for the optimizer step numbered ``step`` (0-based).

    Linear warmup from 0 over ``warmup_steps``, then ``constant``, ``linear`` decay to 0 at
    ``total_steps``, or half-period ``cosine`` decay to 0: the same values as transformers'
    ``get_{constant,linear,cosine}_schedule_with_warmup`` give through ``LambdaLR``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`lr_schedule` can be {', '.join(SCHEDULES)}, got {schedule!r}")
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
