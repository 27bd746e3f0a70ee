"""`SweepReport`: the ranked table of adapters, and where their exports and logs are, at the end of fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class SweepReport(Callback):
    """At the end of ``fit``: print every adapter ranked by best validation loss (hyperparameters,
    status, steps), the PEFT export directories and the TensorBoard log directory, and write the
    same rows to ``<log_dir>/sweep_summary.json``.
    """

    def __init__(self, print_table: bool = True, filename: Optional[str] = "sweep_summary.json") -> None:
        self.print_table = print_table
        self.filename = filename
        self.rows: list[dict] = []

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        registry = getattr(pl_module, "registry", None)
        if registry is None or not trainer.is_global_zero:
            return
        self.rows = registry.summary_rows()
        log_dir = trainer.log_dir or trainer.default_root_dir
        if self.filename and log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / self.filename).write_text(json.dumps(self.rows, indent=1, default=str))
        if self.print_table:
            lines = ["", "Adapters ranked by best validation loss:", registry.summary_table(), ""]
            exports = sorted({str(Path(r["export_path"]).parent) for r in self.rows if r["export_path"]})
            lines.append(f"PEFT adapters:   {', '.join(exports) if exports else '(none exported)'}")
            lines.append(f"TensorBoard logs: {log_dir}  (tensorboard --logdir {log_dir})")
            print("\n".join(lines), flush=True)
