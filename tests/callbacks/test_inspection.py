"""What a person sees: TensorBoard scalars, exit texts, HParams and pictures, read back from event files."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_multilora import (
    AdapterSpec,
    EarlyExit,
    MultiLoRADataModule,
    MultiLoRAModule,
    OptunaSweep,
    SweepReport,
    WarmupSelection,
)
from lightning_multilora.callbacks.report import slot_assignment
from lightning_multilora.registry import AdapterState
from lightning_multilora.data import GeneratedArithmetic


def test_tensorboard_holds_scalars_exits_hparams_and_pictures(tmp_path, trainer_kwargs, capsys):
    sweep = OptunaSweep({"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
                         "rank": {"type": "categorical", "choices": [2, 4]}},
                        n_trials=4, base={"max_steps": 20, "batch_size": 2}, slots=2)
    module = MultiLoRAModule("tiny-llama", adapters=[])
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = L.Trainer(**dict(trainer_kwargs, logger=logger, log_every_n_steps=1, val_check_interval=4),
                        callbacks=[sweep, EarlyExit(), WarmupSelection(warmup_fraction=0.1), SweepReport()])
    trainer.fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(300)}, max_val_examples=16))

    events = EventAccumulator(trainer.log_dir, size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    for rec in module.registry:
        for metric in ("train_loss", "train_loss_ema", "val_loss", "lr", "grad_norm", "tokens_seen"):
            assert f"adapters/{rec.name}/{metric}" in tags["scalars"], (rec.name, metric)
        assert f"adapters/{rec.name}/exit/text_summary" in tags["tensors"]
    assert {"sweep/loss_curves", "sweep/timeline"} <= set(tags["images"])
    pruned = [r for r in module.registry if r.state.value == "pruned"]
    assert len(pruned) == 3
    text = events.Tensors(f"adapters/{pruned[0].name}/exit/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "pruned" in text and "warmup selection" in text
    for rec in module.registry:  # an HParams run per adapter
        hp_dir = Path(trainer.log_dir) / "hparams" / rec.name
        hp = EventAccumulator(str(hp_dir))
        hp.Reload()
        assert "hparams/best_val_loss" in hp.Tags()["scalars"]
        assert "_hparams_/session_start_info" in hp.PluginTagToContent("hparams")
    out = capsys.readouterr().out
    assert "weights their exports hold (their best-validation weights)" in out and "pruned" in out
    assert f"TensorBoard logs: {trainer.log_dir}" in out


def test_with_another_logger_first_the_report_points_at_tensorboards_folder_and_the_summary(tmp_path, capsys):
    """The TensorBoard line named the run's log directory, the first logger's (a CSV logger's), where TensorBoard
    finds nothing; the summary file's line was left out."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    from lightning_multilora import AdapterSpec
    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    registry.add(AdapterSpec("a"))
    csv, tb = CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")
    trainer = SimpleNamespace(loggers=[csv, tb], is_global_zero=True, log_dir=csv.log_dir,
                              default_root_dir=str(tmp_path))
    SweepReport(tensorboard=False).on_fit_end(trainer, SimpleNamespace(registry=registry))
    out = capsys.readouterr().out
    assert f"TensorBoard logs: {tb.log_dir}  (tensorboard --logdir {tb.log_dir})" in out
    assert f"Summary:          {Path(csv.log_dir) / 'sweep_summary.json'}" in out


def test_without_a_tensorboard_logger_the_report_points_at_its_summary_file(tmp_path, capsys):
    from types import SimpleNamespace

    from lightning_multilora import AdapterSpec
    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    registry.add(AdapterSpec("a"))
    trainer = SimpleNamespace(loggers=[], is_global_zero=True, log_dir=None, default_root_dir=str(tmp_path))
    SweepReport().on_fit_end(trainer, SimpleNamespace(registry=registry))
    out = capsys.readouterr().out
    assert "TensorBoard" not in out and f"Summary:          {tmp_path / 'sweep_summary.json'}" in out
    import json

    def strict(token):
        raise ValueError(f"not strict JSON: {token}")

    (row,) = json.loads((tmp_path / "sweep_summary.json").read_text(), parse_constant=strict)
    assert row["adapter"] == "a" and row["best_val_loss"] is None  # never validated: null, not Infinity


def test_a_summary_file_in_a_subfolder_is_written_and_one_that_cannot_be_is_warned_of(tmp_path, capsys):
    """``filename`` with a folder: made (it failed after training with FileNotFoundError, losing the printout);
    a path that cannot be written warns and the table is still printed; a filename that is no path is refused."""
    from types import SimpleNamespace

    from lightning_multilora import AdapterSpec
    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    registry.add(AdapterSpec("a"))
    trainer = SimpleNamespace(loggers=[], is_global_zero=True, log_dir=None, default_root_dir=str(tmp_path))
    SweepReport(filename="reports/summary.json").on_fit_end(trainer, SimpleNamespace(registry=registry))
    assert (tmp_path / "reports" / "summary.json").is_file()
    (tmp_path / "a_file").write_text("")
    with pytest.warns(UserWarning, match=r"SweepReport could not write `filename` '.*a_file/summary.json'"):
        SweepReport(filename="a_file/summary.json").on_fit_end(trainer, SimpleNamespace(registry=registry))
    assert "the weights their exports hold (their last weights; EarlyExit keeps the best)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"SweepReport `filename` must be a file name .* got 3"):
        SweepReport(filename=3)
    for name in ("print_table", "tensorboard"):  # ("yes" was taken, and "no" printed the table)
        with pytest.raises(ValueError, match=rf"SweepReport: `{name}` must be True or False, got 'no'"):
            SweepReport(**{name: "no"})
    (tmp_path / "sweep_summary.json").unlink(missing_ok=True)
    SweepReport(filename="").on_fit_end(trainer, SimpleNamespace(registry=registry))  # ("": no file, as None)
    assert not (tmp_path / "sweep_summary.json").exists()


def test_slots_are_reused_once_free():
    slots = slot_assignment([("a", 0, 10), ("b", 0, 5), ("c", 5, 12), ("d", 10, 20), ("e", 6, 8)])
    assert slots == {"b": 0, "a": 1, "c": 0, "e": 2, "d": 1}


def test_a_fit_stopped_by_ctrl_c_is_reported_with_its_exports_once(tmp_path, trainer_kwargs, capsys):
    """Ctrl+C mid-fit: the adapters are exported (the module's callback) and the report still comes, listing those
    exports under a line that says where the fit stopped (it came only from ``on_fit_end``, which an exception
    skips). A second SweepReport (a config's beside the CLI's) stays silent instead of printing the table twice."""
    from lightning.pytorch.callbacks import Callback

    from lightning_multilora import AdapterSpec

    class CtrlC(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise KeyboardInterrupt

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec(n, rank=2, batch_size=1, max_steps=50, seed=i)
                                                     for i, n in enumerate(("x", "y"))], validate_on_finish=False)
    reports = [SweepReport(tensorboard=False), SweepReport(tensorboard=False, filename="second.json")]
    trainer = L.Trainer(**trainer_kwargs, callbacks=[CtrlC(), *reports])
    with pytest.warns(UserWarning, match="a second SweepReport among the Trainer's callbacks is left silent"), \
            pytest.raises(SystemExit):  # (Lightning's answer to Ctrl+C: `exit(1)` after the callbacks)
        trainer.fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(300)}, max_val_examples=8))
    assert trainer.interrupted
    out = capsys.readouterr().out
    assert out.count("Adapters ranked by") == 1 and "fit stopped by KeyboardInterrupt at step 3" in out, out
    assert "(export_loss '-': weights not validated, the run having stopped before a validation" in out
    rows = {row["adapter"]: row for row in reports[0].rows}
    assert set(rows) == {"x", "y"} and not reports[1].rows
    for row in rows.values():
        assert row["status"] == "running" and row["steps"] == 3, row
        assert (Path(row["export_path"]) / "adapter_model.safetensors").is_file()
    assert (Path(trainer.log_dir) / "sweep_summary.json").is_file()
    assert not (Path(trainer.log_dir) / "second.json").exists()


def test_validation_losses_are_logged_at_the_step_of_the_training_values_and_hparams_hold_no_none_text(
        tmp_path, trainer_kwargs, monkeypatch):
    """An adapter's validation loss was written at the global step, one past the step Lightning writes the values
    logged at the same point at (the training values of the batch before it, a user's own ``self.log`` in the
    validation): each validation point sat one step to the right. The HParams table said "None" for the `dataset`
    of an adapter on the default source."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    import torch.utils.tensorboard.summary as summary

    written, hparams_of = [], summary.hparams
    monkeypatch.setattr(summary, "hparams", lambda hparams, *a, **k: (written.append(hparams),
                                                                      hparams_of(hparams, *a, **k))[1])
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=2, max_steps=5)],
                             validate_on_finish=False)
    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    trainer = L.Trainer(**dict(trainer_kwargs, logger=loggers, log_every_n_steps=1, val_check_interval=2),
                        callbacks=[SweepReport(print_table=False), EarlyExit()])
    trainer.fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(100)}, max_val_examples=8))
    with open(Path(loggers[0].log_dir) / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    at = lambda key: [int(r["step"]) for r in rows if r.get(key)]  # noqa: E731
    assert at("adapters/a/val_loss") == [1, 3]  # (the validations after the 2nd and 4th steps: batches 1 and 3)
    assert at("adapters/a/train_loss") == at("adapters/a/train_loss_ema") == [0, 1, 2, 3, 4]  # (EarlyExit's)
    assert written and all("None" not in map(str, h.values()) for h in written) and "dataset" not in written[0]


def test_the_hparams_dashboard_has_every_adapters_columns_and_the_export_loss(tmp_path, capsys):
    """Each adapter's run wrote its own experiment of its own set fields, and TensorBoard shows one run's, any one:
    an adapter trained by `max_steps` beside one by `max_epochs` lost one of the two columns. Its metric was the best
    validation loss alone, not the export's the table ranks by."""
    from types import SimpleNamespace

    from tensorboard.plugins.hparams import plugin_data_pb2

    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    registry.add(AdapterSpec("a", max_steps=10))
    registry.add(AdapterSpec("b", max_epochs=2, dataset="other"))
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = SimpleNamespace(loggers=[logger], is_global_zero=True, log_dir=logger.log_dir, global_step=0,
                              default_root_dir=str(tmp_path))
    SweepReport(print_table=False).on_fit_end(trainer, SimpleNamespace(registry=registry))
    root = EventAccumulator(str(Path(logger.log_dir) / "hparams"))
    root.Reload()
    data = plugin_data_pb2.HParamsPluginData.FromString(root.PluginTagToContent("hparams")["_hparams_/experiment"])
    columns = {h.name for h in data.experiment.hparam_infos}
    assert {"max_steps", "max_epochs", "dataset", "lr", "rank", "status"} <= columns
    assert {m.name.tag for m in data.experiment.metric_infos} == {"hparams/export_loss", "hparams/best_val_loss",
                                                                  "hparams/steps"}
    for name in ("a", "b"):  # (the runs hold their sessions and metrics, and no experiment of their own)
        run = EventAccumulator(str(Path(logger.log_dir) / "hparams" / name))
        run.Reload()
        assert "_hparams_/experiment" not in run.PluginTagToContent("hparams")
        assert "hparams/export_loss" in run.Tags()["scalars"]
        # (never validated: no loss, as the table's '-'; it said the record's starting best, inf)
        assert math.isnan(run.Scalars("hparams/best_val_loss")[0].value)


def test_the_reports_note_on_unmeasured_exports_says_why(tmp_path, trainer_kwargs, capsys):
    """The note said "the run having stopped before a validation of them" for a run that ended, its adapters exported
    unvalidated under `validate_on_finish=False`, and for adapters that never started."""
    from lightning_multilora import AdapterSpec

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("x", rank=2, max_steps=3),
                                                     AdapterSpec("never", rank=2, batch_size=64, max_steps=3)],
                             validate_on_finish=False, max_running=1)
    module.registry["never"].state = AdapterState.FAILED  # (as a failed start leaves it)
    L.Trainer(**trainer_kwargs, callbacks=[SweepReport(tensorboard=False)]).fit(
        module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(300)}, max_val_examples=8))
    out = capsys.readouterr().out
    assert ("(export_loss '-': failed adapters without an export; weights not validated, with "
            "`validate_on_finish=False` (an adapter leaves before the Trainer's validation of the step it finishes "
            "at);") in out, out
    # an adapter held as the run stopped at `max_steps`, validation off: not "ended between validations"
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("held", rank=2, max_steps=9)])
    L.Trainer(**{**trainer_kwargs, "max_steps": 2, "limit_val_batches": 0},
              callbacks=[SweepReport(tensorboard=False)]).fit(module, MultiLoRADataModule(
                  sources={"a": GeneratedArithmetic(300)}, max_val_examples=8))
    out = capsys.readouterr().out
    assert "(export_loss '-': weights not validated, validation being off (`Trainer(limit_val_batches=0)`);" in out
