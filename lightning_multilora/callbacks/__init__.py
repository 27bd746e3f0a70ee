"""Lightning callbacks of a multi-adapter run."""

from lightning_multilora.callbacks.report import SweepReport

__all__ = ["SweepReport"]
