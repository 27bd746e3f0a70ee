"""`SweepReport`: the ranked table, TensorBoard HParams and pictures of the sweep at the end of fit."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_multilora.arguments import UsageError, check_bool
from lightning_multilora.log_dir import log_dir_of
from lightning_multilora.registry import AdapterRegistry, AdapterState

_STATE_COLORS = {
    AdapterState.FINISHED: "tab:green", AdapterState.DIVERGED: "tab:red", AdapterState.OVERFIT: "tab:orange",
    AdapterState.PRUNED: "tab:gray", AdapterState.FAILED: "black", AdapterState.RUNNING: "tab:blue",
    AdapterState.PAUSED: "tab:purple", AdapterState.QUEUED: "white",
}


class SweepReport(Callback):
    """The sweep's report: every adapter ranked, its summary file and its TensorBoard pictures.

    At the end of ``fit`` (and where it stops on an exception, Ctrl+C included, after the module's exports):

    - prints every adapter ranked by the validation loss of the weights its export holds (the best-validation
      ones where the module keeps them, as with `EarlyExit`; else the last ones), with its hyperparameters,
      status and steps, the PEFT export directories and the TensorBoard log directory, and writes the rows to
      ``<log_dir>/sweep_summary.json`` (``best_val_loss``, ``last_val_loss``, ``exported_val_loss``);
    - with a TensorBoard logger: an HParams run per adapter (``<log_dir>/hparams/<name>``: its
      hyperparameters and status against its best validation loss), and two pictures,
      ``sweep/loss_curves`` (every adapter's training and validation losses, exits marked) and
      ``sweep/timeline`` (each adapter's lifetime on the slot it held).

    One report a run: a second SweepReport among the Trainer's callbacks stays silent (the CLI adds one).

    Args:
        print_table: print the ranked table (rank 0).
        filename: the summary file, under the log directory unless absolute; None or '' for none.
        tensorboard: with a TensorBoard logger, write the HParams runs and the two pictures.
    """

    def __init__(self, print_table: bool = True, filename: Optional[str] = "sweep_summary.json",
                 tensorboard: bool = True) -> None:
        if filename is not None and not isinstance(filename, (str, Path)):
            raise ValueError(f"SweepReport `filename` must be a file name or path (under the log dir unless "
                             f"absolute), or None or '' for no file, got {filename!r}")
        check_bool("SweepReport", "print_table", print_table)
        check_bool("SweepReport", "tensorboard", tensorboard)
        self.print_table = print_table
        self.filename = filename
        self.tensorboard = tensorboard
        self.rows: list[dict] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        reports = [cb for cb in trainer.callbacks if isinstance(cb, SweepReport)]
        self._silent = reports[0] is not self  # (the CLI adds one: a config that lists another would print twice)
        if self._silent and trainer.is_global_zero:
            warnings.warn("a second SweepReport among the Trainer's callbacks is left silent; the first reports")
        self._path: Optional[Path] = None  # (this fit's summary file, once chosen: `_summary_path`)
        self._written: Optional[tuple[int, int]] = None  # (which file it is and when this fit last wrote it)
        self._started = False  # (its training loop began: on_train_start)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Chooses this run's summary file and writes the summary as training starts, before any checkpoint: a
        resume from one, or another fit of the module, writes on in the same file (`_summary_path`)."""
        self._started = True
        if self.filename and trainer.is_global_zero and not getattr(self, "_silent", False) and hasattr(
                pl_module, "registry"):
            self._write_summary(trainer, pl_module, self._rows(trainer, pl_module.registry, pl_module))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A fit stopped by an exception (Ctrl+C included) is reported too, after the module has exported the
        adapters it held (`MultiLoRAMixin.export_after_exception`), under a line that says where it stopped: the
        adapters' states are those they had then (on rank 0, which under adapter parallelism knows the other ranks'
        adapters as of the last validation)."""
        if trainer.state.fn != "fit":  # (a validate, or a refused test / predict: the fit's report stands)
            return
        registry = getattr(pl_module, "registry", None)
        untrained = registry is not None and not any(r.step for r in registry)
        if isinstance(exception, UsageError) and (untrained or not getattr(self, "_started", True)):
            return  # (a setting refused before this fit trained: its error says it all, and no summary is left)
        export = getattr(pl_module, "export_after_exception", None)
        try:
            if export is not None:
                export(exception)
            stopped = f"fit stopped by {type(exception).__name__} at step {trainer.global_step}"
            if trainer.world_size > 1:  # (no exchange after an exception: rank 0 knows its own exports only)
                stopped += (" (each process exports its own adapters, those of the others only where they got the "
                            "interrupt too, as a terminal's Ctrl+C reaches them all; their export paths are not "
                            "listed here)")
            self._report(trainer, pl_module, stopped=stopped)
        except Exception as err:  # noqa: BLE001 - the run's own exception is the one to raise
            warnings.warn(f"SweepReport after {type(exception).__name__} failed: {type(err).__name__}: {err}")

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, stopped: Optional[str] = None) -> None:
        registry: Optional[AdapterRegistry] = getattr(pl_module, "registry", None)
        if registry is None or not trainer.is_global_zero or getattr(self, "_silent", False):
            return
        exported = "best" if getattr(pl_module, "keep_best_weights", False) else "last"
        source_name = getattr(getattr(trainer, "datamodule", None), "source_name", None)  # (ranks by data source)
        self.rows = self._rows(trainer, registry, pl_module)
        self._write_summary(trainer, pl_module, self.rows, ended=stopped is None)
        log_dir = log_dir_of(trainer)
        if self.tensorboard:
            self._write_tensorboard(trainer, registry, pl_module)
        if self.print_table:
            said = ("their best-validation weights" if exported == "best"
                    else "their last weights; EarlyExit keeps the best")
            lines = ["", f"Adapters ranked by export_loss, the validation loss of the weights their exports hold "
                     f"({said}):", registry.summary_table(exported, source_name), ""]
            unmeasured = [r for r in self.rows if math.isnan(r["exported_val_loss"])]
            if unmeasured:  # (why, for the rows it is of)
                unexported = sorted({r["status"] for r in unmeasured if not r["export_path"]})
                why = [f"{', '.join(unexported)} adapters without an export"] if unexported else []
                # (a validation of the exported step that measured no token: NaN too, not "not validated")
                tokenless = [r for r in unmeasured if r["export_path"] and r["adapter"] in registry
                             and registry[r["adapter"]].val_losses
                             and registry[r["adapter"]].val_losses[-1][0] == r["exported_step"]]
                if tokenless:
                    why.append("validations that measured no token (every completion of the split cut or empty)")
                if any(r["export_path"] and r not in tokenless for r in unmeasured):
                    why.append("weights not validated, " + (
                        "the run having stopped before a validation of them" if stopped else
                        "validation being off (`Trainer(limit_val_batches=0)`)" if getattr(
                            trainer, "limit_val_batches", None) == 0 else
                        "with `validate_on_finish=False` (an adapter leaves before the Trainer's validation of the "
                        "step it finishes at)" if not getattr(
                            pl_module, "validate_on_finish", True) else "their adapters having ended (removed, "
                        "failed) between validations"))
                lines.insert(3, f"(export_loss '-': {'; '.join(why)}; those follow the others, by their last "
                                "validation loss)")
            if any(r["exported_val_loss"] == math.inf for r in self.rows):  # (not a model to load)
                lines.insert(3, "(export_loss inf: weights that gave a non-finite loss, in a validation or, for a "
                                "failed adapter, its last training step; its export folder's multilora_export.json "
                                "says so; those rank last)")
            if stopped:
                lines[1:1] = [f"{stopped}: the adapters as they were then (those that had taken a step exported)"]
            exports = sorted({str(Path(r["export_path"]).parent) for r in self.rows if r["export_path"]})
            lines.append(f"PEFT adapters:   {', '.join(exports) if exports else '(none exported)'}")
            boards = _tensorboard_loggers(trainer)
            if boards:  # (its own folder: with another logger first, the run's log directory is that one's)
                board = boards[0].log_dir
                lines.append(f"TensorBoard logs: {board}  (tensorboard --logdir {board})")
            if self.filename and log_dir and not (boards and Path(boards[0].log_dir) == Path(log_dir)):
                lines.append(f"Summary:          {getattr(self, '_path', None) or Path(log_dir) / self.filename}")
            print("\n".join(lines), flush=True)

    @staticmethod
    def _rows(trainer: L.Trainer, registry: AdapterRegistry, pl_module: L.LightningModule) -> list[dict]:
        """The summary's rows: every adapter, ranked by the validation loss of the weights its export holds."""
        exported = "best" if getattr(pl_module, "keep_best_weights", False) else "last"
        source_name = getattr(getattr(trainer, "datamodule", None), "source_name", None)  # (ranks by data source)
        return registry.summary_rows(exported, source_name)

    def _write_summary(self, trainer: L.Trainer, pl_module: L.LightningModule, rows: list[dict],
                       ended: bool = False) -> None:
        """Writes ``rows`` to this run's summary file, if any, and beside it which run and branch wrote it and whether
        that fit ended as fits end (``ended``: another resume of its checkpoint keeps it, `_summary_path`)."""
        path = self._summary_path(trainer, pl_module)
        if path is None:
            return
        try:  # (the table, the pictures and the printout still come if the file cannot be written)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_finite(rows), indent=1, default=str, allow_nan=False))
            self._written = _file_key(path)
            lineage = getattr(pl_module, "_lineage", None) or [""]
            _branch_stamp(path).write_text(
                f"{getattr(pl_module, '_run_id', '')}\n{lineage[-1]}\n{'ended' if ended else 'open'}\n")
        except OSError as err:
            warnings.warn(f"SweepReport could not write `filename` {str(path)!r}: {err}")

    def _summary_path(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Optional[Path]:
        """This run's summary file: the one this module wrote in the log directory in an earlier fit (the module's
        checkpoint says which: a resume writes on in it), else ``filename`` under the log directory where no file is
        there, else, beside another run's (kept, under a warning), the first free ``<stem>-v<N><suffix>``. Chosen
        once a fit; a file this run wrote that another has written over since is another run's too."""
        log_dir = log_dir_of(trainer)
        if not self.filename or not log_dir:
            return None
        path = getattr(self, "_path", None)
        if path is not None and _file_key(path) in (getattr(self, "_written", None), None):
            return path
        taken = Path(log_dir) / self.filename
        own = [] if path is not None else [p for p in map(Path, sorted(getattr(pl_module, "_summary_files", ())))
                                            if p.parent == taken.parent.resolve() and _is_version_of(p.name, taken)]
        sibling = bool(own) and _by_a_sibling(own[-1], pl_module)
        if own and not sibling:
            path = own[-1]
        elif path is None and not sibling and _claimed(taken):
            path = taken
        else:  # another run's (or another resume's of this run's checkpoint): kept, and this one written beside it
            version, path, kept = 1, taken, own[-1] if sibling else taken
            while not _claimed(path):
                path = taken.with_name(f"{taken.stem}-v{version}{taken.suffix}")
                version += 1
            whose = "another resume's summary of this run" if sibling else "another run's summary"
            warnings.warn(f"SweepReport: {kept} is {whose}; it is kept, and this run's is {path}")
        self._path = path
        if hasattr(pl_module, "registry"):  # (saved in its checkpoints: `MultiLoRAMixin.on_save_checkpoint`)
            pl_module._summary_files = getattr(pl_module, "_summary_files", set()) | {str(path.resolve())}
        return path

    def _write_tensorboard(self, trainer: L.Trainer, registry: AdapterRegistry, pl_module: L.LightningModule) -> None:
        loggers = _tensorboard_loggers(trainer)
        if not loggers:
            return
        logger = loggers[0]
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        exported = {row["adapter"]: row["exported_val_loss"] for row in self.rows or []}
        best = {row["adapter"]: row["best_val_loss"] for row in self.rows or []}  # (the table's: `summary_rows`)
        runs = []
        for rec in registry:
            # (a field not set, an SFT adapter's beta or the default source's `dataset`: none, not the text "None")
            hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                       for k, v in rec.spec.hparams().items() if v is not None}
            hparams["status"] = rec.state.value
            best_loss = float(best.get(rec.name, rec.best_val_loss))
            if not rec.val_losses and math.isinf(best_loss):  # (never validated: no loss, as in the table, not the
                best_loss = math.nan  # record's starting best of inf)
            metrics = {"hparams/export_loss": float(exported.get(rec.name, math.nan)),  # (what the table ranks by)
                       "hparams/best_val_loss": best_loss, "hparams/steps": float(rec.step)}
            runs.append((rec.name, hparams, metrics))
        root = Path(logger.log_dir) / "hparams"
        if runs:  # one experiment for all: every adapter's columns (TensorBoard reads one run's experiment, any one:
            # each run writing its own showed one adapter's fields alone, an SFT adapter's lacking `dpo_beta`...)
            columns = {k: v for _, hparams, _ in reversed(runs) for k, v in hparams.items()}
            experiment, _, _ = hparams_summary(columns, dict.fromkeys(runs[0][2], 0.0))
            with SummaryWriter(str(root)) as writer:
                writer.file_writer.add_summary(experiment)
        for name, hparams, metrics in runs:
            _, start, end = hparams_summary(hparams, metrics)
            with SummaryWriter(str(root / name)) as writer:
                writer.file_writer.add_summary(start)
                writer.file_writer.add_summary(end)
                for key, value in metrics.items():
                    writer.add_scalar(key, value)
        writer = logger.experiment
        writer.add_figure("sweep/loss_curves", loss_curves_figure(registry), trainer.global_step)
        run_step = getattr(pl_module, "_run_step", lambda: trainer.global_step)()  # (the spans' axis, across fits)
        writer.add_figure("sweep/timeline", timeline_figure(registry, run_step), trainer.global_step)
        writer.flush()


def _tensorboard_loggers(trainer: L.Trainer) -> list:
    from lightning.pytorch.loggers import TensorBoardLogger

    return [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def loss_curves_figure(registry: AdapterRegistry):
    """Training (thin) and validation (dots) losses of every adapter; an X where it exited early."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for rec in registry:
        color = _STATE_COLORS.get(rec.state, "tab:blue")
        if rec.train_losses:
            steps, losses = zip(*rec.train_losses)
            ax_train.plot(steps, losses, lw=0.6, color=color, alpha=0.6)
        if rec.val_losses:
            steps, losses = zip(*rec.val_losses)
            ax_val.plot(steps, losses, marker=".", lw=0.8, color=color, alpha=0.8)
            if rec.state in (AdapterState.DIVERGED, AdapterState.OVERFIT, AdapterState.PRUNED, AdapterState.FAILED):
                ax_val.plot(steps[-1], losses[-1], marker="x", ms=9, color=color)
    ax_train.set(title="training loss", xlabel="adapter step", ylabel="loss")
    ax_val.set(title="validation loss (x: early exit)", xlabel="adapter step")
    handles = [plt.Line2D([], [], color=c, label=s.value) for s, c in _STATE_COLORS.items()
               if any(r.state == s for r in registry)]
    ax_val.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    return fig


def slot_assignment(intervals: list[tuple[str, int, int]]) -> dict[str, int]:
    """Greedy interval colouring: each adapter's [start, end) on the lowest slot free at its start."""
    slot_free_at: list[int] = []
    slots = {}
    for name, start, end in sorted(intervals, key=lambda x: (x[1], x[2])):
        for i, free in enumerate(slot_free_at):
            if free <= start:
                slot_free_at[i], slots[name] = end, i
                break
        else:
            slots[name] = len(slot_free_at)
            slot_free_at.append(end)
    return slots


def timeline_figure(registry: AdapterRegistry, last_step: int):
    """A Gantt chart of the spans (the run's steps, counted on across fits of one module) in which adapters held a
    slot, coloured by how each ended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals = [(f"{r.name}#{i}", start, end if end is not None else last_step)
                 for r in registry for i, (start, end) in enumerate(r.spans)]
    slots = slot_assignment(intervals)
    n_slots = len(set(slots.values()))
    fig, ax = plt.subplots(figsize=(12, 0.45 * max(4, n_slots) + 1.2))
    for key, start, end in intervals:
        name = key.rsplit("#", 1)[0]
        ax.barh(slots[key], max(end - start, 1), left=start, color=_STATE_COLORS.get(registry[name].state, "tab:blue"),
                edgecolor="black", lw=0.4)
        ax.text(start, slots[key], f" {name}", va="center", fontsize=6)
    ax.set(xlabel="step of the run", ylabel="slot", title="adapters holding each slot (colour: how they ended)")
    ax.set_yticks(range(n_slots))
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


def _file_key(path: Optional[Path]) -> Optional[tuple[int, int]]:
    """Which file ``path`` is and when it last changed (None: absent), to tell whether another run wrote it."""
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        return None
    return None if stat is None else (stat.st_ino, stat.st_mtime_ns)


def _branch_stamp(path: Path) -> Path:
    """The file beside a summary that says which run and branch wrote it (`SweepReport._write_summary`)."""
    return path.with_name(f".{path.name}.multilora_branch")


def _by_a_sibling(path: Path, pl_module: L.LightningModule) -> bool:
    """Whether the summary at ``path`` was last written by another resume of a checkpoint of this module's run (a
    branch not on this fit's line) whose fit ended as fits end: kept, as its exports are. One stopped by an error or
    Ctrl+C (an attempt retried) is written over."""
    try:
        run, branch, state = (_branch_stamp(path).read_text().split("\n") + ["", "", ""])[:3]
    except OSError:
        return False
    lineage = getattr(pl_module, "_lineage", None) or []
    return run == getattr(pl_module, "_run_id", None) and branch not in ("", *lineage) and state == "ended"


def _is_version_of(name: str, path: Path) -> bool:
    """``name`` is ``path``'s or a versioned one of it (``<stem>-v<N><suffix>``)."""
    return name == path.name or re.fullmatch(re.escape(path.stem) + r"-v[0-9]+" + re.escape(path.suffix),
                                            name) is not None


def _claimed(path: Path) -> bool:
    """``path`` made by this call (an empty file, created exclusively): another run choosing a summary name at the
    same moment takes another."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # (a folder that cannot be made, a file in its place: the write says so)
        return True
    try:
        with path.open("x"):
            return True
    except FileExistsError:
        return False
    except OSError:  # (a folder that cannot be written: the write says so)
        return True


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None: the summary is strict JSON (``null``; ``Infinity`` is
    rejected by ``jq``, JavaScript and other strict parsers), for an adapter never validated, say."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
