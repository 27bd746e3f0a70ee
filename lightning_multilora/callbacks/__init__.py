"""Lightning callbacks of a multi-adapter run: early exit, warmup selection, Optuna, the sweep report."""

from lightning_multilora.callbacks.early_exit import EarlyExit
from lightning_multilora.callbacks.optuna_sweep import OptunaSweep
from lightning_multilora.callbacks.report import SweepReport
from lightning_multilora.callbacks.warmup import WarmupSelection

__all__ = ["EarlyExit", "OptunaSweep", "SweepReport", "WarmupSelection"]
