"""MultiLoRAModule: lifecycle (queue, add/remove mid-fit), checkpoint resume, logging."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import warnings
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.arguments import UsageError
from lightning_multilora.registry import AdapterState


def exported(module: MultiLoRAModule, name: str) -> dict[str, torch.Tensor]:
    return load_file(f"{module.registry[name].export_path}/adapter_model.safetensors")


def small_dm(**kwargs) -> MultiLoRADataModule:
    from lightning_multilora.data import GeneratedArithmetic

    return MultiLoRADataModule(sources={"arith": GeneratedArithmetic(400)}, max_val_examples=24, **kwargs)


def fixed_dm() -> MultiLoRADataModule:
    return small_dm(padding="max_length", max_length=96)


class AddAndRemove(Callback):
    def __init__(self, new: AdapterSpec, add_at: int, remove: str, remove_at: int):
        self.new, self.add_at, self.remove, self.remove_at = new, add_at, remove, remove_at
        self.running_after_add: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.add_at:
            pl_module.add_adapter(self.new)
        if trainer.global_step == self.add_at + 1:
            self.running_after_add = list(batch["layout"].names)
        if trainer.global_step == self.remove_at:
            pl_module.remove_adapter(self.remove, reason="removed by test")


def test_add_and_remove_adapters_mid_fit(tmp_path, trainer_kwargs):
    a = AdapterSpec("a", rank=4, lr=1e-3, batch_size=2, max_steps=30, seed=1)
    b = AdapterSpec("b", rank=3, lr=2e-3, batch_size=1, max_steps=15, seed=2)
    new = AdapterSpec("new", rank=5, lr=3e-3, batch_size=3, max_steps=10, seed=3)
    module = MultiLoRAModule("tiny-llama", adapters=[a, b], export_dir=str(tmp_path / "x"), validate_on_finish=False)
    callback = AddAndRemove(new, add_at=4, remove="a", remove_at=8)
    L.Trainer(**trainer_kwargs, callbacks=[callback]).fit(module, fixed_dm())

    assert callback.running_after_add == ["a", "b", "new"]  # joined at the very next step
    rec_a, rec_b, rec_new = (module.registry[n] for n in ("a", "b", "new"))
    assert (rec_a.state, rec_a.step, rec_a.reason) == (AdapterState.PRUNED, 8, "removed by test")
    assert rec_b.state == AdapterState.FINISHED and rec_b.step == 15
    assert rec_new.state == AdapterState.FINISHED and rec_new.step == 10 and rec_new.started_at_step == 4
    # everything freed: no adapter weights, no optimizer groups or state left
    assert module.lora_layers.adapter_names == []
    optimizer = module.trainer.optimizers[0]
    assert optimizer.param_groups == [] and len(optimizer.state) == 0
    assert all(not layer.lora_A and not layer.lora_B for layer in module.lora_layers.values())
    # nothing trained is lost: the removed adapter was exported with its 8 steps of training
    assert any(t.abs().max() > 0 for k, t in exported(module, "a").items() if "lora_B" in k)

    # the adapter that joined mid-run ends as if trained alone from the start
    alone = MultiLoRAModule("tiny-llama", adapters=[new], export_dir=str(tmp_path / "y"), validate_on_finish=False)
    L.Trainer(**trainer_kwargs).fit(alone, fixed_dm())
    for key, value in exported(alone, "new").items():
        torch.testing.assert_close(exported(module, "new")[key], value, rtol=1e-5, atol=1e-7)


def test_exits_at_a_validation_that_empty_every_slot_refill_them_before_the_next_step(tmp_path, trainer_kwargs):
    # An exit at validation time (EarlyExit's) can leave no adapter running before the next step; the queued one
    # starts at that validation's end (as a run resumed from a checkpoint written there does), not after an idle
    # step, and the run does not fail on an empty batch.
    class ExitAllAtValidation(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            for rec in list(pl_module.registry.running):
                if rec.name == "first":
                    pl_module.remove_adapter(rec.name, reason="test: exited at validation")

    specs = [AdapterSpec("first", max_steps=100), AdapterSpec("second", max_steps=6, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=1, export_dir=str(tmp_path / "out"))
    trainer = L.Trainer(**dict(trainer_kwargs, val_check_interval=4), callbacks=[ExitAllAtValidation()])
    trainer.fit(module, small_dm())
    first, second = module.registry["first"], module.registry["second"]
    assert (first.state.value, first.step) == ("pruned", 4)
    assert (second.state.value, second.step) == ("finished", 6)
    assert second.started_at_step == 4  # admitted at the validation of step 4
    assert trainer.global_step == 10


def test_a_run_resumed_from_a_checkpoint_written_at_a_validation_exit_refills_as_the_uninterrupted_one(
        tmp_path, trainer_kwargs):
    """A checkpoint written at validation end (ModelCheckpoint's default when it saves on validation) holds the slot
    an exit there freed: the resumed run fills it before its next step, and so does the uninterrupted run (it filled
    it a step later, so the refilled adapter validated at other steps and could be judged differently)."""
    import glob

    from lightning.pytorch.callbacks import ModelCheckpoint

    class ExitAtValidation(Callback):
        def on_validation_end(self, trainer, pl_module):
            if "first" in [r.name for r in pl_module.registry.running]:
                pl_module.remove_adapter("first", reason="test: exited at validation")

    def run(where, max_steps=-1, ckpt=None, save=False):
        specs = [AdapterSpec("first", max_steps=100, rank=2, batch_size=2),
                 AdapterSpec("second", max_steps=6, seed=1, rank=2, batch_size=2),
                 AdapterSpec("third", max_steps=9, seed=2, rank=2, batch_size=2)]
        module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=2, export_dir=str(tmp_path / where / "out"))
        callbacks = [ExitAtValidation()] + ([ModelCheckpoint(dirpath=tmp_path / where / "ck", every_n_train_steps=None,
                                                             save_top_k=-1, filename="{step}")] if save else [])
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps, "val_check_interval": 4,
                               "enable_checkpointing": save}, callbacks=callbacks)
        trainer.fit(module, small_dm(), ckpt_path=ckpt)
        return {r.name: (r.state.value, r.step, r.started_at_step, [s for s, _ in r.val_losses]) for r in module.registry}

    full = run("full")
    run("part", max_steps=6, save=True)
    (ckpt,) = glob.glob(str(tmp_path / "part" / "ck" / "step=4*.ckpt"))
    assert run("part", ckpt=ckpt) == full
    assert full["third"][2] == 4  # started at the validation of step 4, where "first" left


def test_a_slot_freed_at_the_validation_after_the_last_step_is_not_filled(tmp_path, trainer_kwargs):
    """The run ends there: an adapter admitted then would never train, and be exported untrained."""

    class ExitAtValidation(Callback):
        def on_validation_end(self, trainer, pl_module):
            if "first" in [r.name for r in pl_module.registry.running]:
                pl_module.remove_adapter("first", reason="test: exited at validation")

    specs = [AdapterSpec("first", max_steps=100, rank=2, batch_size=2), AdapterSpec("second", max_steps=6, rank=2)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=1, export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "max_steps": 4, "val_check_interval": 4},
              callbacks=[ExitAtValidation()]).fit(module, small_dm())
    assert module.registry["second"].state == AdapterState.QUEUED and module.registry["second"].export_path is None


def test_a_slot_refilled_at_a_validation_step_is_not_measured_untrained(tmp_path, trainer_kwargs):
    """An adapter started at a step that also validates (a slot freed by one that finished there) has taken no step:
    that validation leaves it out, so its initialisation's loss is neither in its history nor its best (nor, stopped
    before it is measured, what it exports); it is measured from its first own validation on."""
    seen: list[tuple[int, list[str]]] = []

    class Watch(Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            seen.append((trainer.global_step, list(batch["layout"].names)))

    specs = [AdapterSpec("first", max_steps=4, rank=2), AdapterSpec("refill", max_steps=8, rank=2, lr=1e-2)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=1, export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "val_check_interval": 4}, callbacks=[Watch()]).fit(module, small_dm())
    refill = module.registry["refill"]
    assert refill.spans[0][0] == 4 and refill.state == AdapterState.FINISHED
    assert [step for step, names in seen if "refill" in names] and all(
        step > 4 for step, names in seen if "refill" in names)  # (not in the validation at the step it started)
    assert [s for s, _ in refill.val_losses] == [4, 8] and refill.best_val_step in (4, 8)


def test_a_folder_another_run_has_begun_to_export_into_is_not_written_into(tmp_path, trainer_kwargs):
    """Two runs sharing an export root, each exporting adapter "a" at once: the second saw the first's folder free
    (stamped, its config not yet written) and wrote into it; the last one's weights were kept for both runs."""
    from lightning_multilora.module import _RUN_STAMP

    folder = tmp_path / "out" / "a"
    folder.mkdir(parents=True)
    (folder / _RUN_STAMP).write_text("another-run\na\n2\n")  # (its weights still being written)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)],
                             export_dir=str(tmp_path / "out"), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"holds an adapter this run did not write for it \(another run's\)"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert module.registry["a"].export_path == str(tmp_path / "out" / "a-v1")
    assert sorted(p.name for p in folder.iterdir()) == [_RUN_STAMP]  # (left to the run writing it)


def test_a_measure_outside_the_validation_loop_takes_its_precision(tmp_path, trainer_kwargs):
    """The losses the module measures itself (the adapters held when a Trainer's ``max_steps`` stops the fit; at a
    step's end, under adapter parallelism, those finishing together) are taken in the validation loop's precision:
    under "bf16-mixed" its autocast, the loss `trainer.validate` gives."""
    specs = [AdapterSpec("a", max_steps=10, rank=4, lr=1e-2), AdapterSpec("b", max_steps=10, rank=2, seed=3)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / "out"))
    kwargs = {**trainer_kwargs, "precision": "bf16-mixed"}
    L.Trainer(**{**kwargs, "max_steps": 3}).fit(module, small_dm())
    held = {name: json.loads((Path(module.registry[name].export_path) / "multilora_export.json").read_text())
            ["val_loss"] for name in ("a", "b")}  # (the export's loss: its weights', measured as the fit stopped)
    assert all(module.registry[name].step == 3 and math.isfinite(held[name]) for name in held)
    measured = L.Trainer(**kwargs).validate(module, small_dm())[0]
    assert held == pytest.approx({name: measured[f"adapters/{name}/val_loss"] for name in held}, rel=1e-6)
    fp32 = L.Trainer(**trainer_kwargs).validate(module, small_dm())[0]
    assert held["a"] != pytest.approx(fp32["adapters/a/val_loss"], rel=1e-6)  # (the precision matters here)


def test_queue_respects_max_running_and_backfills(tmp_path, trainer_kwargs):
    specs = [AdapterSpec(f"q{i}", rank=2, batch_size=1, max_steps=3 + i, seed=i) for i in range(5)]
    seen: list[tuple[str, ...]] = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(tuple(batch["layout"].names))

    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=2, export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(module, small_dm())
    assert max(len(s) for s in seen) == 2
    assert seen[0] == ("q0", "q1") and seen[3] == ("q1", "q2")  # q0 left after 3 steps, q2 took its slot
    assert all(r.state == AdapterState.FINISHED and r.step == r.spec.max_steps for r in module.registry)


def test_epochs_are_counted_on_each_adapters_own_dataset(tmp_path, trainer_kwargs):
    from lightning_multilora.data import GeneratedArithmetic

    dm = MultiLoRADataModule(sources={"small": GeneratedArithmetic(23, seed=1), "big": GeneratedArithmetic(100)},
                             val_fraction=0.2)
    specs = [AdapterSpec("s", batch_size=4, max_epochs=2, dataset="small"),
             AdapterSpec("b", batch_size=8, max_epochs=0.5, dataset="big")]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**trainer_kwargs).fit(module, dm)
    # 'small' has 23 - 5 = 18 training examples: ceil(18 / 4) = 5 steps per epoch; 'big' has 80: 10 per epoch
    assert module.registry["s"].step == 10 and module.registry["s"].samples_seen == 36
    assert module.registry["b"].step == 5
    # (their reason said "reached max_steps=10", a field their specs leave None)
    assert module.registry["s"].reason == "reached max_epochs=2 (10 steps)"
    assert module.registry["b"].reason == "reached max_epochs=0.5 (5 steps)"


def test_a_fraction_of_epochs_counts_the_steps_it_names_not_one_float_rounding_past(tmp_path, trainer_kwargs):
    """2.2 epochs of 25 steps: 2.2 * 25 is 55.00000000000001 in floats, and the adapter trained 56 steps."""
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.spec import steps_of_epochs

    assert [steps_of_epochs(e, n) for e, n in ((2.2, 25), (1.1, 50), (2.7, 90), (0.5, 5), (1e-3, 10))] == [55, 55, 243,
                                                                                                           3, 1]
    dm = MultiLoRADataModule(sources={"s": GeneratedArithmetic(125)}, val_fraction=0.2)  # 100 to train: 25 steps
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("f", batch_size=4, max_epochs=2.2, dataset="s")],
                             validate_on_finish=False, export_dir=str(tmp_path))
    L.Trainer(**dict(trainer_kwargs, max_steps=1, limit_val_batches=0)).fit(module, dm)
    assert module.registry["f"].max_steps == 55


def test_a_warmup_past_an_adapters_epochs_is_said_when_they_are_counted(tmp_path, trainer_kwargs):
    """Said of `max_steps` as the spec is made; of `max_epochs` it was never said (its steps are known at its
    start): its learning rate rose to a tenth of its `lr` and the run ended."""
    dm = small_dm(val_fraction=0.2)
    spec = AdapterSpec("e", batch_size=64, max_epochs=0.5, warmup_steps=10, lr=1e-3)  # 320 examples: 3 steps
    module = MultiLoRAModule("tiny-llama", adapters=[spec], export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapter 'e': warmup_steps=10 >= its 3 steps \(max_epochs=0.5\), so its "
                                         r"learning rate never reaches lr=0.001 \(it ends at 0.2 x lr\)"):
        L.Trainer(**trainer_kwargs).fit(module, dm)
    assert module.registry["e"].step == 3


class PerLayerAdamW(torch.optim.AdamW):
    """AdamW under another class: not known to be elementwise, so it steps (and saves state for) every layer's
    parameters, as checkpoints written before adapters were held flat did."""


def run_resumable(tmp_path, trainer_kwargs, stop_at=None, ckpt=None, callbacks=(), optimizer="torch.optim.AdamW"):
    specs = [
        AdapterSpec("r1", rank=4, lr=2e-3, batch_size=2, max_steps=16, seed=1, dropout=0.1),
        AdapterSpec("r2", rank=3, lr=1e-3, batch_size=3, max_steps=6, seed=2, lr_schedule="cosine", warmup_steps=2),
        AdapterSpec("r3", rank=5, lr=3e-3, batch_size=1, max_steps=12, seed=3),
    ]
    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=2, export_dir=str(tmp_path / "export"),
                             optimizer=optimizer)
    kwargs = dict(trainer_kwargs, val_check_interval=5)
    if stop_at is not None:
        kwargs["max_steps"] = stop_at
    if callbacks:
        kwargs.update(callbacks=list(callbacks), enable_checkpointing=True)
    trainer = L.Trainer(**kwargs)
    L.seed_everything(0)  # (dropout masks come from each adapter's seed and step: the checkpoint carries the steps)
    trainer.fit(module, fixed_dm(), ckpt_path=ckpt)
    return trainer, module


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path, trainer_kwargs):
    _, full = run_resumable(tmp_path / "full", trainer_kwargs)
    trainer, first = run_resumable(tmp_path / "part", trainer_kwargs, stop_at=9)
    assert first.registry["r2"].state == AdapterState.FINISHED and first.registry["r3"].state == AdapterState.RUNNING
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert all(".lora_" in k for k in saved["state_dict"])  # the frozen base is not in the checkpoint
    _, resumed = run_resumable(tmp_path / "part", trainer_kwargs, ckpt=str(ckpt))
    for name in ("r1", "r2", "r3"):
        a, b = full.registry[name], resumed.registry[name]
        assert (a.state, a.step, a.tokens_seen) == (b.state, b.step, b.tokens_seen)
        assert a.val_losses == b.val_losses
        for key, value in exported(full, name).items():
            assert torch.equal(exported(resumed, name)[key], value), f"{name}: {key}"


def test_per_layer_optimizer_state_resumes_into_flat_parameters(tmp_path, trainer_kwargs):
    """A checkpoint whose optimizer state is per layer resumes into one flat parameter per adapter, moments and step
    counts carried over: the result is the uninterrupted run's."""
    _, full = run_resumable(tmp_path / "full", trainer_kwargs, optimizer=PerLayerAdamW)
    trainer, _ = run_resumable(tmp_path / "part", trainer_kwargs, stop_at=9, optimizer=PerLayerAdamW)
    assert sorted(len(g["params"]) for g in trainer.optimizers[0].param_groups) == [28, 28]
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    seen = []

    class Groups(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            opt = trainer.optimizers[0]
            seen.append({g["adapter"]: (len(g["params"]), float(opt.state[g["params"][0]].get("step", -1)))
                         for g in opt.param_groups})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = run_resumable(tmp_path / "part", trainer_kwargs, ckpt=str(tmp_path / "mid.ckpt"),
                                   callbacks=[Groups()])
    assert not [w for w in caught if "starts fresh" in str(w.message)]
    assert seen[0]["r1"] == (1, 9.0)  # one flat tensor, its 9 steps of moments restored
    for name in ("r1", "r2", "r3"):
        for key, value in exported(full, name).items():
            torch.testing.assert_close(exported(resumed, name)[key], value, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_flat_optimizer_state_resumes_into_per_layer_parameters(tmp_path, trainer_kwargs):
    """The other way (a per-tensor optimizer now, or a model now split over devices): the moments started fresh,
    with a warning, and the adapters trained on otherwise than the uninterrupted run."""
    _, full = run_resumable(tmp_path / "full", trainer_kwargs)
    trainer, _ = run_resumable(tmp_path / "part", trainer_kwargs, stop_at=9)
    assert sorted(len(g["params"]) for g in trainer.optimizers[0].param_groups) == [1, 1]
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = run_resumable(tmp_path / "part", trainer_kwargs, ckpt=str(tmp_path / "mid.ckpt"),
                                   optimizer=PerLayerAdamW)
    assert not [w for w in caught if "starts fresh" in str(w.message)]
    for name in ("r1", "r2", "r3"):
        for key, value in exported(full, name).items():
            torch.testing.assert_close(exported(resumed, name)[key], value, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_resume_from_a_checkpoint_written_at_an_exit_and_refill_equals_uninterrupted_run(tmp_path, trainer_kwargs):
    """ModelCheckpoint writes in its on_train_batch_end, before the module refills the slot r2 freed at step 6
    (r3 waits for it): the saved optimizer has no group for r3, the resumed one does."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, full = run_resumable(tmp_path / "full", trainer_kwargs)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    run_resumable(tmp_path / "part", trainer_kwargs, stop_at=6, callbacks=[save])
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert [g["adapter"] for g in saved["optimizer_states"][0]["param_groups"]] == ["r1"]
    assert {r["spec"]["name"]: r["state"] for r in saved["multilora"]["registry"]["records"]}["r3"] == "queued"
    _, resumed = run_resumable(tmp_path / "part", trainer_kwargs, ckpt=str(ckpt))
    for name in ("r1", "r2", "r3"):
        a, b = full.registry[name], resumed.registry[name]
        assert (a.state, a.step, a.tokens_seen, a.started_at_step) == (b.state, b.step, b.tokens_seen, b.started_at_step)
        assert a.val_losses == b.val_losses
        for key, value in exported(full, name).items():
            assert torch.equal(exported(resumed, name)[key], value), f"{name}: {key}"


def test_per_adapter_metrics_are_logged_to_tensorboard(tmp_path, trainer_kwargs):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    specs = [AdapterSpec("x", batch_size=2, max_steps=12), AdapterSpec("y", batch_size=1, max_steps=8, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs)
    kwargs = dict(trainer_kwargs, logger=TensorBoardLogger(str(tmp_path), name="tb"), log_every_n_steps=5,
                  val_check_interval=4)
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, small_dm())
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("x", "y"):
        for metric in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_seen"):
            assert f"adapters/{name}/{metric}" in tags
    # the steps a logger writes (every log_every_n_steps and at the stop, x's 12th step), and each adapter's last
    # values as it ends (y's 8th step), once: y's were written again at every later write (9 and 11)
    for name, steps in (("x", [4, 9, 11]), ("y", [4, 7])):
        written = events.Scalars(f"adapters/{name}/train_loss")
        assert [e.step for e in written] == steps
        assert written[-1].value == pytest.approx(module.registry[name].train_losses[-1][1])
    assert module.registry["x"].export_path.startswith(trainer.log_dir)


def test_an_adapter_stopped_at_a_validation_has_its_last_values_written(tmp_path, trainer_kwargs):
    """Stopped in a validation's `on_validation_end` (EarlyExit, a pruner), an adapter's last training values were
    never written: with the default `log_every_n_steps` and a stop before it, it had no train_loss series at all."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class StopAtFirstValidation(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            if pl_module.registry["b"].state == AdapterState.RUNNING:
                pl_module.remove_adapter("b", reason="stopped by the test")

    specs = [AdapterSpec("a", rank=2, max_steps=6), AdapterSpec("b", rank=2, max_steps=6, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    kwargs = dict(trainer_kwargs, logger=TensorBoardLogger(str(tmp_path), name="tb"), val_check_interval=3)
    trainer = L.Trainer(**kwargs, callbacks=[StopAtFirstValidation()])
    trainer.fit(module, small_dm())
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    assert module.registry["b"].step == 3 and module.registry["b"].state.exited
    for name, step in (("a", 5), ("b", 2)):  # (a: at the stop; b: at its last step, where its validation is)
        for metric in ("train_loss", "lr", "grad_norm", "tokens_seen"):
            written = events.Scalars(f"adapters/{name}/{metric}")
            assert [e.step for e in written] == [step], (name, metric)
        assert events.Scalars(f"adapters/{name}/train_loss")[0].value == pytest.approx(
            module.registry[name].train_losses[-1][1])
    assert [e.step for e in events.Scalars("adapters/b/val_loss")] == [2]


def test_grad_norms_are_each_groups_l2_norm_in_one_pass():
    from lightning_multilora.module import _grad_norms

    torch.manual_seed(0)
    groups = [[torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)],
              [torch.zeros(2, requires_grad=True)],  # no gradient at all: norm 0
              [torch.zeros(7, requires_grad=True), torch.zeros(1, 3, requires_grad=True)]]
    for group in (groups[0], groups[2]):
        for p in group:
            p.grad = torch.randn_like(p)
    groups[2][1].grad = None  # a parameter without a gradient counts for nothing
    norms = _grad_norms(groups, torch.zeros(()))
    expected = [torch.cat([p.grad.flatten() for p in g if p.grad is not None] or [torch.zeros(0)]).norm()
                for g in groups]
    torch.testing.assert_close(norms, torch.stack(expected))
    assert norms[1] == 0


def test_a_paused_adapter_keeps_its_weights_until_resumed(tmp_path, trainer_kwargs):
    # A paused adapter (e.g. waiting for warmup selection) keeps its optimizer state, but the optimizer must not
    # step it with its last gradients while it waits.
    snapshots = {}

    class PauseThenResume(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == 2:
                pl_module.pause_adapter("p")
                snapshots["paused"] = {k: v.clone() for k, v in pl_module.lora_layers.peft_state_dict("p").items()}
            elif step == 5:
                snapshots["before_resume"] = {k: v.clone() for k, v in pl_module.lora_layers.peft_state_dict("p").items()}
                pl_module.resume_adapter("p")

    specs = [AdapterSpec("p", max_steps=6, weight_decay=0.1), AdapterSpec("q", max_steps=10, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / "out"))
    L.Trainer(**trainer_kwargs, callbacks=[PauseThenResume()]).fit(module, small_dm())
    for key, value in snapshots["paused"].items():
        assert torch.equal(snapshots["before_resume"][key], value), key
    assert module.registry["p"].step == 6 and module.registry["p"].state.value == "finished"


def test_optimizer_state_that_no_longer_fits_starts_fresh_with_a_warning():
    from lightning_multilora.module import _match_optimizer_state

    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [p], "adapter": "a"}, {"params": [q], "adapter": "b"}])
    saved = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}, 1: {"step": torch.tensor(5.0)},
                       2: {"step": torch.tensor(5.0)}},
             "param_groups": [{"params": [0], "adapter": "a", "lr": 0.5}, {"params": [1, 2], "adapter": "b", "lr": 0.25}]}
    checkpoint = {"optimizer_states": [saved]}
    with pytest.warns(UserWarning, match="adapter 'b' .* starts fresh"):
        _match_optimizer_state(checkpoint, optimizer, lambda name, states: None)
    matched = checkpoint["optimizer_states"][0]
    assert matched["param_groups"][0]["lr"] == 0.5 and torch.equal(matched["state"][0]["exp_avg"], torch.ones(4))
    assert matched["param_groups"][1]["params"] == [1] and 1 not in matched["state"]  # b: fresh
    checkpoint = {"optimizer_states": [saved]}
    _match_optimizer_state(checkpoint, optimizer, lambda name, states: {"step": states[0]["step"]})
    assert float(checkpoint["optimizer_states"][0]["state"][1]["step"]) == 5.0  # converted: kept


def test_the_mixin_trains_adapters_of_a_model_that_is_not_a_hugging_face_one(tmp_path, trainer_kwargs):
    # (the ready-made module passes Hugging Face's use_cache=False; a plain model's forward takes no such argument)
    from types import SimpleNamespace

    from lightning_multilora import MultiLoRAMixin

    class PlainLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.q_proj = torch.nn.Embedding(258, 16), torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 258)

        def forward(self, input_ids, attention_mask=None):  # (its mask read: a model of one's own is given it)
            hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
            return SimpleNamespace(logits=self.head(torch.tanh(self.q_proj(hidden))))

    class Sweep(MultiLoRAMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = PlainLM()
            self.init_multilora(self.model, adapters=[AdapterSpec("a", lr=1e-2, max_steps=3)],
                                target_modules=["q_proj"], export_dir=str(tmp_path / "out"), validate_on_finish=False)

    module = Sweep()
    module.scale = torch.nn.Parameter(torch.tensor(2.5))  # a module's own state, beside its frozen base
    trainer = L.Trainer(**trainer_kwargs)
    trainer.fit(module, small_dm())
    rec = module.registry["a"]
    assert rec.state == AdapterState.FINISHED and rec.step == 3 and len(rec.train_losses) == 3
    assert set(exported(module, "a")) == {f"base_model.model.q_proj.lora_{x}.weight" for x in "AB"}
    module.decoder = module.model.q_proj  # the base reached under a second name (a head of its own reads it, say)
    trainer.save_checkpoint(tmp_path / "c.ckpt")  # without the frozen base, with the module's own state
    assert set(torch.load(tmp_path / "c.ckpt", weights_only=False)["state_dict"]) == {"scale"}
    # PEFT loads the export into the plain model (a causal-LM task type called its generation hooks: it failed)
    from peft import PeftModel

    plain = PlainLM()
    loaded = PeftModel.from_pretrained(plain, rec.export_path)
    assert loaded.peft_config["default"].task_type is None
    ids = torch.randint(0, 258, (1, 5))
    for key, value in exported(module, "a").items():
        torch.testing.assert_close(loaded.state_dict()[key.replace(".weight", ".default.weight")], value)
    assert loaded(ids, torch.ones(1, 5)).logits.shape == (1, 5, 258)

    class Own(MultiLoRAMixin, L.LightningModule):  # the base under a name of its own; a loss of the wrong shape
        def __init__(self, wrong=False):
            super().__init__()
            self.lm, self.wrong = PlainLM(), wrong
            self.init_multilora(self.lm, adapters=[AdapterSpec("a", lr=1e-2, max_steps=2)], target_modules=["q_proj"],
                                export_dir=str(tmp_path / f"own{wrong}"), validate_on_finish=False)

        def adapter_loss_terms(self, batch):
            loss_sum, count = super().adapter_loss_terms(batch)
            return (loss_sum.sum(), count.sum()) if self.wrong else (loss_sum, count)

    own = Own()
    L.Trainer(**trainer_kwargs).fit(own, small_dm())  # (the loss read `self.model`: an AttributeError)
    assert own.registry["a"].step == 2
    with pytest.raises(ValueError, match=r"Own.adapter_loss_terms must return \(loss sums, counts\), two tensors of "
                                         r"shape \(1,\), one value per adapter of batch\['layout'\].names; got "
                                         r"\[\(\), \(\)\]"):
        L.Trainer(**trainer_kwargs).fit(Own(wrong=True), small_dm())


def test_mixin_set_up_mistakes_are_named_before_anything_trains(tmp_path, trainer_kwargs):
    """(The bases in the wrong order gave Lightning's "no training_step"; no `init_multilora`, an AttributeError; a
    base that is no submodule trained, but no checkpoint held its adapters, and a resume restarted them from fresh
    weights, silently.)"""
    from lightning_multilora import MultiLoRAMixin
    from lightning_multilora.base_model import build_base_model

    with pytest.raises(TypeError, match=r"class Reversed: list MultiLoRAMixin before LightningModule"):
        class Reversed(L.LightningModule, MultiLoRAMixin):
            pass

    class NoInit(MultiLoRAMixin, L.LightningModule):
        pass

    class Unheld(MultiLoRAMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.init_multilora(build_base_model("tiny-llama"), adapters=[AdapterSpec("a", max_steps=1)],
                                export_dir=str(tmp_path / "out"))

    with pytest.raises(RuntimeError, match=r"NoInit never called `self.init_multilora\(model, ...\)`"):
        L.Trainer(**trainer_kwargs).fit(NoInit(), small_dm())
    unheld = Unheld()
    with pytest.raises(RuntimeError, match=r"the model given to `init_multilora` is not a submodule of Unheld: "
                                           r"assign it to an attribute \(`self.model = model`\)"):
        L.Trainer(**trainer_kwargs).fit(unheld, small_dm())
    assert unheld.registry["a"].step == 0 and not (tmp_path / "out").exists()


def test_a_model_given_that_is_no_causal_lm_is_refused_unless_the_loss_is_the_modules_own():
    """(A BertForMaskedLM or a T5 given as a module trained silently on a meaningless next-token loss.)"""
    from transformers import AutoConfig, BertForMaskedLM, T5ForConditionalGeneration

    from lightning_multilora import MultiLoRAMixin

    bert = AutoConfig.for_model("bert", vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64)
    t5 = AutoConfig.for_model("t5", vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match=r"`base_model` is a BertForMaskedLM \(model_type 'bert'\)"):
        MultiLoRAModule(BertForMaskedLM(bert))

    class Host(MultiLoRAMixin, L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.init_multilora(model, target_modules=["q", "v"])

    class OwnLoss(Host):
        def adapter_loss_terms(self, batch):
            raise NotImplementedError  # (never reached here: a loss of its own may read any model)

    with pytest.raises(ValueError, match=r"`model` is a T5ForConditionalGeneration \(model_type 't5'\), an "
                                         r"encoder-decoder"):
        Host(T5ForConditionalGeneration(t5))
    assert len(OwnLoss(T5ForConditionalGeneration(t5)).lora_layers) == 6  # (self- and cross-attention q, v)


def test_a_peft_lora_config_given_as_an_adapter_is_refused_with_the_fields_that_map():
    """(A PEFT user's first try: the refusal said only that it is no AdapterSpec.)"""
    from peft import LoraConfig

    for make in (lambda c: MultiLoRAModule("tiny-llama", adapters=[c]),
                 lambda c: MultiLoRAModule("tiny-llama").add_adapter(c)):
        with pytest.raises(TypeError, match=r"got LoraConfig: write a PEFT LoraConfig `c` as AdapterSpec\(name=\.\.\., "
                                            r"rank=c\.r, alpha=c\.lora_alpha, dropout=c\.lora_dropout"):
            make(LoraConfig(r=4, target_modules=["q_proj"]))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"])
    spec = AdapterSpec("p", rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                       use_rslora=config.use_rslora, target_modules=config.target_modules)  # (the hint, as written)
    assert spec.target_modules == ["q_proj", "v_proj"]
    assert MultiLoRAModule("tiny-llama", adapters=[spec]).registry["p"].spec == spec
    # PEFT's "all-linear" in any case, for the module's targets too (an adapter without its own took them as a regex)
    module = MultiLoRAModule("tiny-llama", target_modules="ALL-LINEAR", adapters=[AdapterSpec("a", rank=2)])
    assert module.default_target_modules == "all-linear"
    assert len(module.lora_layers.layers_for(module._targets_of(module.registry["a"].spec))) == 14


def test_a_data_parallel_strategy_is_refused_naming_the_one_that_works(tmp_path):
    """Over several processes only `AdapterParallelStrategy` places adapters: DDP (say) would get every adapter on
    every process, none of them there when it wraps the model. Refused before it wraps anything (Lightning calls
    ``configure_model`` first), naming the field and the strategy to use; one process takes a single device's
    (DDP over one process failed in PyTorch: `test_a_data_parallel_strategy_is_refused_in_our_words`)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path))
    module._trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy())
    with pytest.raises(ValueError, match="`strategy`.*'adapter_parallel'.*got DDPStrategy over 2 processes"):
        module.configure_model()
    module._trainer = SimpleNamespace(world_size=1, strategy=SingleDeviceStrategy("cpu"))
    module.configure_model()
    assert not getattr(module, "_parallelized", False)  # (one process: the base is not sharded)


@pytest.mark.parametrize("option", [dict(gradient_clip_val=0.5), dict(accumulate_grad_batches=2)])
def test_trainer_clipping_and_accumulation_are_refused_naming_the_adapter_fields(tmp_path, trainer_kwargs, option):
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=2)],
                             export_dir=str(tmp_path / "export"))
    field = {"gradient_clip_val": "grad_clip", "accumulate_grad_batches": "batch_size"}[next(iter(option))]
    with pytest.raises(ValueError, match=rf"`Trainer\({next(iter(option))}=.*`AdapterSpec.{field}`"):
        L.Trainer(**trainer_kwargs, **option).fit(module, small_dm())
    assert module.registry["a"].step == 0
    L.Trainer(**trainer_kwargs, gradient_clip_val=0).fit(module, small_dm())  # (0: Lightning's "no clipping")
    assert module.registry["a"].step == 2


@pytest.mark.parametrize("option, named", [(dict(min_steps=8), "min_steps=8"), (dict(min_epochs=1), "min_epochs=1"),
                                           (dict(min_steps=0), "min_steps=0")])  # (it was named min_epochs=1)
def test_a_trainer_minimum_is_refused_and_a_trainer_max_epochs_is_said_to_bound_nothing(tmp_path, trainer_kwargs,
                                                                                         option, named):
    """A minimum kept the run stepping with no adapter, for ever (Lightning waits for the endless epoch's end);
    ``max_epochs=1`` was silently nothing, Lightning saying at the end that it was reached."""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=2)],
                             export_dir=str(tmp_path / "export"))
    with pytest.raises(ValueError, match=rf"`Trainer\({named}\)`: the run ends when every adapter has"):
        L.Trainer(**trainer_kwargs, **option).fit(module, small_dm())
    assert module.registry["a"].step == 0
    with pytest.warns(UserWarning, match=r"`Trainer\(max_epochs=1\)` does not bound the run: it is one endless "
                                         r"epoch.*set max_epochs=-1"):
        L.Trainer(**{**trainer_kwargs, "max_epochs": 1}).fit(module, small_dm())
    assert module.registry["a"].step == 2


def _fp16(scaler, device="cpu"):
    """fp16 mixed precision as Lightning builds it on CUDA (``precision="16-mixed"``), with ``scaler``."""
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", device, scaler=scaler)


def test_fp16_scales_each_adapters_loss_on_its_own(tmp_path, trainer_kwargs):
    """fp16 with a loss scaler: Lightning's one factor sat in the gradients that the adapters' norms, clipping and
    failure checks read, and an overflow anywhere skipped every adapter's step (so it was refused). The module takes
    the scaler over: an adapter's overflow skips its step alone and backs its own scale off; the others step, their
    gradients unscaled, as without a scaler; the scaler goes back to the plugin after the fit."""
    def fit(scaler, *callbacks):
        torch.manual_seed(0)
        specs = [AdapterSpec("a", rank=2, batch_size=2, max_steps=6, lr=0.5, grad_clip=0.05),
                 AdapterSpec("b", rank=4, batch_size=2, max_steps=6, lr=0.5, seed=1)]
        module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer="torch.optim.SGD",  # (AdamW: scale-free)
                                 export_dir=str(tmp_path / f"export{len(list(tmp_path.iterdir()))}"))
        plugin = _fp16(scaler)
        L.Trainer(**{**trainer_kwargs, "max_steps": 40}, plugins=[plugin], callbacks=list(callbacks)).fit(module,
                                                                                                       small_dm())
        assert plugin.scaler is scaler
        return module, {n: load_file(Path(module.registry[n].export_path) / "adapter_model.safetensors")
                        for n in ("a", "b")}

    plain, plain_weights = fit(torch.amp.GradScaler("cpu", enabled=False))  # fp16, nothing scaled
    assert all(r.loss_scale is None for r in plain.registry)
    scaled, scaled_weights = fit(torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3))
    for name in ("a", "b"):
        rec = scaled.registry[name]
        assert (rec.step, rec.skipped_steps, rec.loss_scale) == (6, 0, 2.0 ** 10), name  # grown twice in 6 steps
        for key, value in plain_weights[name].items():
            assert (scaled_weights[name][key] - value).norm() <= 1e-2 * value.norm(), (name, key)
        # the unscaled norms, as without a scaler (clipping read them: adapter a's were clipped to 0.05)
        assert [loss for _, loss in rec.train_losses] == pytest.approx(
            [loss for _, loss in plain.registry[name].train_losses], rel=1e-2)

    class Overflow(Callback):  # adapter b's scale set far past what fp16 holds, after its second step
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                pl_module.registry["b"].loss_scale = 2.0 ** 40

    from lightning_multilora.callbacks import EarlyExit

    early_exit = EarlyExit(ema_alpha=0.5)
    module, _ = fit(torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=100), Overflow(), early_exit)
    a, b = module.registry["a"], module.registry["b"]
    ema = b.train_losses[0][1]  # EarlyExit's average reads each step taken once (not a skipped step's last loss again)
    for _, loss in b.train_losses[1:]:
        ema = 0.5 * loss + 0.5 * ema
    assert early_exit.watches["b"].ema == pytest.approx(ema)
    assert (a.state, a.step, a.skipped_steps, a.loss_scale) == (AdapterState.FINISHED, 6, 0, 2.0 ** 8)
    # b skipped steps until its scale was back where its fp16 gradients fit, then took its remaining 4
    assert (b.state, b.step) == (AdapterState.FINISHED, 6) and b.skipped_steps >= 20
    assert b.loss_scale == 2.0 ** (40 - b.skipped_steps) and [s for s, _ in b.train_losses] == [1, 2, 3, 4, 5, 6]
    assert b.spans == [[0, 6 + b.skipped_steps]]


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_fp16_on_cuda_scales_each_adapters_loss_on_its_own(tmp_path, trainer_kwargs, cuda_graphs):
    """The CUDA path of fp16 loss scaling: the Triton kernels in fp16, `GroupedAdamW` stepping with one adapter's
    gradient dropped for a skipped step, and (``cuda_graphs``) the captured step reading the scales' tensor."""
    class Overflow(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                pl_module.registry["b"].loss_scale = 2.0 ** 40

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4, batch_size=2, max_steps=10, lr=1e-3),
                                                     AdapterSpec("b", rank=8, batch_size=2, max_steps=10, lr=1e-3)],
                             cuda_graphs=cuda_graphs, export_dir=str(tmp_path / "export"))
    plugin = _fp16(torch.amp.GradScaler("cuda", init_scale=2.0 ** 8, growth_interval=1000), "cuda")
    L.Trainer(**{**trainer_kwargs, "accelerator": "gpu", "max_steps": 80}, plugins=[plugin],
              callbacks=[Overflow()]).fit(module, small_dm())
    a, b = module.registry["a"], module.registry["b"]
    assert (a.state, a.step, a.skipped_steps, a.loss_scale) == (AdapterState.FINISHED, 10, 0, 2.0 ** 8)
    assert (b.state, b.step) == (AdapterState.FINISHED, 10) and b.skipped_steps >= 10
    assert b.loss_scale == 2.0 ** (40 - b.skipped_steps)
    assert all(math.isfinite(loss) for r in (a, b) for _, loss in r.train_losses)
    assert a.train_losses[-1][1] < a.train_losses[0][1]
    assert plugin.scaler is not None


def test_fp16_fails_an_adapter_whose_gradient_overflows_unscaled(tmp_path, trainer_kwargs):
    """An adapter whose gradient overflows at a loss scale of 1 or less fails (it would back off forever); its loss
    is finite. The other adapter finishes."""
    import torch.nn.functional as F

    class Huge(MultiLoRAModule):  # adapter b's loss times 1e30: finite in float32, its fp16 gradients infinite
        def adapter_loss_terms(self, batch):
            loss_sum, count = super().adapter_loss_terms(batch)
            names = batch["layout"].names
            if "b" in names:
                loss_sum = loss_sum * (1 + (1e30 - 1) * F.one_hot(torch.tensor(names.index("b")), len(names)))
            return loss_sum, count

    module = Huge("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=4),
                                          AdapterSpec("b", rank=2, batch_size=1, max_steps=4)],
                  export_dir=str(tmp_path / "export"))
    L.Trainer(**trainer_kwargs, plugins=[_fp16(torch.amp.GradScaler("cpu", init_scale=4.0))]).fit(module, small_dm())
    a, b = module.registry["a"], module.registry["b"]
    assert a.state == AdapterState.FINISHED and a.step == 4
    assert b.state == AdapterState.FAILED and (b.step, b.skipped_steps) == (0, 2)
    assert "non-finite gradient norm (nan) in step 1 (its steps done: 0) at loss scale 1" in b.reason


class AddAt(Callback):
    """Adds ``specs`` to the run after step ``step`` (adapters that start mid-run)."""

    def __init__(self, step, *specs):
        self.step, self.specs = step, specs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            for spec in self.specs:
                pl_module.add_adapter(spec)


def test_an_adapter_that_cannot_start_mid_run_fails_alone(tmp_path, trainer_kwargs):
    """A misspelled `dataset` on an adapter that starts mid-run (added, or asked of a study) fails that adapter
    with the error, tells callbacks of its exit, and the others train on and are exported; at the start of a fit
    (nothing trained yet) the run stops at once with the same error, for an adapter given that would wait in the
    queue too (it failed only when it started, the run long under way)."""
    specs = [AdapterSpec("long", rank=2, batch_size=1, max_steps=5, seed=1),
             AdapterSpec("short", rank=2, batch_size=1, max_steps=2, seed=2),
             AdapterSpec("typo", rank=2, batch_size=1, max_steps=2, dataset="arithm", seed=3)]
    exits = []

    class Exits(Callback):
        def on_adapter_exit(self, trainer, pl_module, rec):
            exits.append((rec.name, rec.state))

    module = MultiLoRAModule("tiny-llama", adapters=specs[:2], max_running=2, export_dir=str(tmp_path),
                             validate_on_finish=False)
    with pytest.warns(UserWarning, match="'typo' could not start: .*`dataset` 'arithm' is not a data source"):
        L.Trainer(**trainer_kwargs, callbacks=[Exits(), AddAt(1, specs[2])]).fit(module, small_dm())
    states = {r.name: r.state for r in module.registry}
    assert states == {"long": AdapterState.FINISHED, "short": AdapterState.FINISHED, "typo": AdapterState.FAILED}
    assert "is not a data source" in module.registry["typo"].reason and ("typo", AdapterState.FAILED) in exits
    assert exported(module, "long") and module.registry["typo"].export_path is None
    for given, max_running in ((specs[2:], None), (specs, 2)):  # starting at once, or queued behind two
        first = MultiLoRAModule("tiny-llama", adapters=given, max_running=max_running,
                                export_dir=str(tmp_path / "b"), validate_on_finish=False)
        trainer = L.Trainer(**trainer_kwargs)
        with pytest.raises(ValueError, match="`dataset` 'arithm' is not a data source; sources are: \\['arith'\\]"):
            trainer.fit(first, small_dm())
        assert trainer.global_step == 0


def test_an_adapter_whose_data_cannot_serve_it_fails_alone_as_it_starts(tmp_path, trainer_kwargs):
    """An adapter added mid-run whose source cannot be read (a missing file), or whose objective its source cannot
    serve (DPO on plain completions), fails as it starts, with the reason; the run goes on (it used to fail at that
    adapter's first batch, stopping every adapter). Given at the start, the run stops before its first step."""
    from lightning_multilora.data import GeneratedArithmetic, JSONLSource

    specs = [AdapterSpec("first", rank=2, batch_size=1, max_steps=3, seed=1),
             AdapterSpec("missing", rank=2, batch_size=1, max_steps=2, dataset="gone", seed=2),
             AdapterSpec("dpo", rank=2, batch_size=1, max_steps=2, objective="dpo", seed=3),
             AdapterSpec("last", rank=2, batch_size=1, max_steps=2, seed=4)]

    def dm():
        return MultiLoRADataModule(sources={"arith": GeneratedArithmetic(100),
                                            "gone": JSONLSource(str(tmp_path / "no.jsonl"))}, max_val_examples=8)

    module = MultiLoRAModule("tiny-llama", adapters=specs[:1], max_running=1, export_dir=str(tmp_path / "out"),
                             validate_on_finish=False)
    with pytest.warns(UserWarning) as caught:
        L.Trainer(**trainer_kwargs, callbacks=[AddAt(1, *specs[1:])]).fit(module, dm())
    states = {r.name: r.state.value for r in module.registry}
    assert states == {"first": "finished", "missing": "failed", "dpo": "failed", "last": "finished"}
    assert "data source 'gone' (" in module.registry["missing"].reason and "could not be read" in \
        module.registry["missing"].reason
    assert "objective 'dpo' needs preference pairs, and data source 'arith'" in module.registry["dpo"].reason
    assert sum("could not start" in str(w.message) for w in caught) == 2
    given = MultiLoRAModule("tiny-llama", adapters=[specs[0], specs[2]], max_running=1,
                            export_dir=str(tmp_path / "out2"), validate_on_finish=False)
    with pytest.raises(ValueError, match="objective 'dpo' needs preference pairs"):
        L.Trainer(**trainer_kwargs).fit(given, dm())


def test_a_run_left_with_paused_adapters_alone_stops_and_exports_them(tmp_path, trainer_kwargs):
    """Nothing could resume them: the run ends with a warning, and each paused adapter is exported as it is."""

    class PauseAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                pl_module.pause_adapter("p", reason="by test")

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("p", rank=2, batch_size=1, max_steps=50, seed=1)],
                             export_dir=str(tmp_path), validate_on_finish=False)
    trainer = L.Trainer(**trainer_kwargs, callbacks=[PauseAt()])
    with pytest.warns(UserWarning, match=r"\['p'\] are paused and nothing is left to run"):
        trainer.fit(module, small_dm())
    rec = module.registry["p"]
    assert trainer.global_step == 2 and rec.state == AdapterState.PAUSED and rec.step == 2
    weights = exported(module, "p")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in weights.items())


def test_evaluate_takes_held_adapters_by_spec_or_name_and_refuses_the_others(tmp_path, trainer_kwargs):
    """An adapter that has left (its weights freed) would be measured on the base model alone: refused, saying
    where its weights went; a name never added is refused with the module's adapters."""
    specs = [AdapterSpec("done", rank=2, batch_size=1, max_steps=2, seed=1),
             AdapterSpec("on", rank=2, batch_size=1, max_steps=50, seed=2)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(module, small_dm())
    by_name, by_spec = module.evaluate("on"), module.evaluate([module.registry["on"].spec])
    assert by_name == by_spec and set(by_name) == {"on"} and by_name["on"] > 0
    with pytest.raises(ValueError, match="^evaluate's `specs`: .*'done' is finished; its weights were exported to"):
        module.evaluate(["done", "on"])
    with pytest.raises(ValueError, match=r"'nope' is not an adapter of this module; adapters: \['done', 'on'\]"):
        module.evaluate([AdapterSpec("nope")])
    ids = torch.ones(2, 3, dtype=torch.long)  # generate names its own argument
    with pytest.raises(ValueError, match="^generate's `adapters`: generate takes adapters .*'done' is finished"):
        module.generate(["done", None], ids)
    with pytest.raises(ValueError, match="^generate's `adapters`: 'typo' is not an adapter of this module"):
        module.generate(["typo", None], ids)
    # a name given twice is measured once; what is no name or spec is said (an AttributeError or a TypeError of
    # iterating None before); a spec of another objective would measure the adapter on other rows: refused
    assert module.evaluate(["on", "on"]) == by_name
    with pytest.raises(TypeError, match=r"^evaluate's `specs`: an adapter's name or AdapterSpec, or a list of them, "
                                        r"got NoneType None"):
        module.evaluate(None)
    with pytest.raises(TypeError, match=r"^generate's `adapters`: each is an adapter's name or its AdapterSpec, got "
                                        r"int 3"):
        module.generate(["on", 3], ids)
    with pytest.raises(ValueError, match=r"the AdapterSpec given for 'on' has objective='dpo', and the adapter was "
                                         r"trained with objective='sft', dpo_beta=0.1: give its name"):
        module.evaluate([replace(module.registry["on"].spec, objective="dpo")])
    with pytest.raises(ValueError, match=r"^`input_ids` has no rows: give at least one prompt"):
        module.generate([], ids[:0])  # (a ZeroDivisionError before)
    with pytest.raises(TypeError, match=r"^`input_ids` are token ids, an integer tensor \(rows, tokens\), got "
                                        r"torch.float32"):
        module.generate(["on", None], ids.float())
    with pytest.raises(ValueError, match=r"^`attention_mask` is of shape \(2, 2\): it masks `input_ids`, of shape "
                                         r"\(2, 3\)"):
        module.generate(["on", None], ids, attention_mask=torch.ones(2, 2, dtype=torch.long))
    queued = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("q", rank=2)])
    with pytest.raises(ValueError, match=r"'q' is queued: it has not started, no weights yet \(they are made as it "
                                         r"starts, in `fit`\)"):
        queued.generate(["q"], ids[:1])
    # each submodule's mode is its own after an evaluation (one kept in evaluation mode stays so)
    module.train()
    module.model.model.norm.eval()
    module.evaluate("on")
    assert module.training and module.model.model.layers[0].training and not module.model.model.norm.training


def test_a_removal_or_pause_asked_inside_a_step_or_a_validation_is_made_as_it_ends(tmp_path, trainer_kwargs):
    """`remove_adapter` / `pause_adapter` from a hook inside a training step (before its backward, before its
    optimizer step) or a validation (a batch's end): the removed adapter's group was gone as the step stepped
    (KeyError), a removal in a validation's batch left its next batches naming it (the fit died), and an adapter
    paused before its optimizer step counted a step (loss, data position) its gradients did not take: resumed, it
    trained otherwise than alone. Each is made once the step (or validation) ends, whole."""
    import json as _json

    class Stops(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == 2:
                pl_module.remove_adapter("a", reason="asked before the backward")
                assert pl_module.registry["a"].state == AdapterState.RUNNING  # (made as the step ends)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                pl_module.pause_adapter("p", reason="asked before the optimizer step")
                pl_module.pause_adapter("p", reason="asked again")  # (still running until the step ends: one pause)
            if trainer.global_step == 2:  # (a pause asked, then taken back within the step: it goes on)
                pl_module.pause_adapter("v", reason="changed my mind")
                pl_module.resume_adapter("v")

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 4:
                pl_module.resume_adapter("p")

        def on_validation_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3 and pl_module.registry["v"].state == AdapterState.RUNNING:
                pl_module.remove_adapter("v", reason="asked in a validation")

    specs = [AdapterSpec("a", rank=2, batch_size=1, max_steps=8, seed=1),
             AdapterSpec("p", rank=2, batch_size=1, max_steps=6, seed=2),
             AdapterSpec("v", rank=2, batch_size=1, max_steps=8, seed=3)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / "run"), validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "val_check_interval": 3}, callbacks=[Stops()]).fit(module, fixed_dm())
    a, v = module.registry["a"], module.registry["v"]
    info = {n: _json.loads((tmp_path / "run" / n / "multilora_export.json").read_text()) for n in ("a", "v")}
    assert (a.state, a.step, len(a.train_losses), info["a"]["weights_step"]) == (AdapterState.PRUNED, 3, 3, 3)
    assert (v.state, v.step, info["v"]["weights_step"], v.spans) == (AdapterState.PRUNED, 3, 3, [[0, 3]])
    assert module.registry["p"].spans == [[0, 2], [4, 8]]  # (paused once, after its step 2)
    assert info["v"]["val_loss"] == pytest.approx(v.val_losses[-1][1]) and v.val_losses[-1][0] == 3
    alone = MultiLoRAModule("tiny-llama", adapters=[specs[1]], export_dir=str(tmp_path / "alone"),
                            validate_on_finish=False)
    L.Trainer(**trainer_kwargs).fit(alone, fixed_dm())
    p = module.registry["p"]
    assert p.state == AdapterState.FINISHED and [l for _, l in p.train_losses] == [
        l for _, l in alone.registry["p"].train_losses]
    for key, value in exported(alone, "p").items():
        torch.testing.assert_close(exported(module, "p")[key], value, atol=0, rtol=0)


def test_a_fit_stopped_by_an_exception_exports_the_adapters_it_held(tmp_path, trainer_kwargs):
    """Ctrl+C or an error mid-fit calls no module hook, only callbacks' ``on_exception``: the module's own callback
    (``configure_callbacks``) exports every adapter it held, and the run's exception is raised as it was."""

    class Boom(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("boom")

    specs = [AdapterSpec(n, rank=2, batch_size=1, max_steps=50, seed=i) for i, n in enumerate(("x", "y"))]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.warns(UserWarning, match="fit stopped by RuntimeError: the adapters it held are exported"):
        with pytest.raises(RuntimeError, match="boom"):
            L.Trainer(**trainer_kwargs, callbacks=[Boom()]).fit(module, small_dm())
    for name in ("x", "y"):
        assert module.registry[name].state == AdapterState.RUNNING and module.registry[name].step == 3
        assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in exported(module, name).items())


def test_a_fit_stopped_before_any_step_exports_no_untrained_adapter(tmp_path, trainer_kwargs):
    """An adapter that has taken no step holds its initial weights: a fit stopped before its first step (an error in
    the first batch, say) says so and writes no export for it."""

    class Boom(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            raise RuntimeError("boom")

    specs = [AdapterSpec(n, rank=2, batch_size=1, max_steps=50, seed=i) for i, n in enumerate(("x", "y"))]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"before any adapter took a step: nothing to export; \['x', 'y'\] had "
                                         "taken no step"):
        with pytest.raises(RuntimeError, match="boom"):
            L.Trainer(**trainer_kwargs, callbacks=[Boom()]).fit(module, small_dm())
    assert [module.registry[n].export_path for n in ("x", "y")] == [None, None]
    assert not any(tmp_path.iterdir())


def test_the_sweep_report_lists_the_adapters_exported_when_training_stops_early(tmp_path, trainer_kwargs):
    """Adapters still running at the Trainer's own stop (``max_steps``) are exported before the report is written
    (``on_train_end``, before callbacks' ``on_fit_end``), so the report names their exports."""
    from lightning_multilora import SweepReport

    report = SweepReport(print_table=False, filename=None, tensorboard=False)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("r", rank=2, batch_size=1, max_steps=50, seed=1)],
                             export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "max_steps": 2}, callbacks=[report]).fit(module, small_dm())
    (row,) = report.rows
    assert row["status"] == "running" and row["export_path"] == module.registry["r"].export_path is not None


def test_an_adapter_that_cannot_be_exported_costs_no_other_its_export(tmp_path, trainer_kwargs, monkeypatch):
    """One export that fails (a full disk, a name the file system refuses) is reported after the other adapters are
    written: nothing else trained is lost."""
    import lightning_multilora.module as module_lib

    save = module_lib.save_peft_adapter

    def failing(directory, spec, *args, **kwargs):
        if spec.name == "x":
            raise OSError(28, "No space left on device")
        return save(directory, spec, *args, **kwargs)

    monkeypatch.setattr(module_lib, "save_peft_adapter", failing)
    specs = [AdapterSpec(n, rank=2, batch_size=1, max_steps=50, seed=i) for i, n in enumerate(("x", "y", "z"))]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.raises(RuntimeError, match=r"exporting 'x' \(OSError: .*No space left.*\) failed; the other adapters "
                                           r"were exported to \[.*/y', .*/z'\]"):
        with warnings.catch_warnings():  # (the exception's own export is that one: not tried again)
            warnings.filterwarnings("error", message="exporting the adapters after")
            L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(module, small_dm())
    assert module.registry["x"].export_path is None
    for name in ("y", "z"):
        assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in exported(module, name).items())


def test_an_export_where_another_runs_adapter_is_goes_beside_it(tmp_path, trainer_kwargs):
    def fit(seed: int, max_steps: int = -1) -> MultiLoRAModule:
        module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("best", rank=2, batch_size=1, max_steps=2,
                                                                     seed=seed)],
                                 export_dir=str(tmp_path / "adapters"), validate_on_finish=False)
        L.Trainer(**{**trainer_kwargs, "max_steps": max_steps}).fit(module, small_dm())
        return module

    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        first = exported(fit(1), "best")
    assert not [w for w in quiet if "did not write" in str(w.message)]  # (a run's own export: no warning)
    with pytest.warns(UserWarning, match=r"adapter 'best': .*adapters/best holds an adapter this run did not write "
                                         r"for it \(another run's\); it is kept, and this one is written to "
                                         r".*adapters/best-v1 \(give each new run its own"):
        second_module = fit(2, max_steps=1)  # stopped while "best" runs: exported, still held
    assert second_module.registry["best"].export_path == str(tmp_path / "adapters" / "best-v1")
    second = exported(second_module, "best")
    assert any(not torch.equal(second[k], first[k]) for k in first)  # the second run's own weights
    kept = load_file(tmp_path / "adapters" / "best" / "adapter_model.safetensors")
    assert all(torch.equal(kept[k], first[k]) for k in first)  # the first run's, untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert second_module.save_adapter("best") == tmp_path / "adapters" / "best-v1"  # its own folder from then on
        second_module.save_adapter("best", tmp_path / "snapshot")  # a copy where the caller says: not its folder
        assert second_module.save_adapter("best") == tmp_path / "adapters" / "best-v1"


def test_a_file_where_an_adapters_export_folder_goes_is_kept_and_the_export_goes_beside_it(tmp_path, trainer_kwargs):
    """(It raised FileExistsError as the adapter exited, and the export retried at the error failed alike.)"""
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "best").write_text("notes")
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("best", rank=2, batch_size=1, max_steps=2)],
                             export_dir=str(tmp_path / "adapters"), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapters/best is a file; it is kept, and this adapter is written to "
                                         r".*adapters/best-v1"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert (tmp_path / "adapters" / "best").read_text() == "notes"
    assert module.registry["best"].export_path == str(tmp_path / "adapters" / "best-v1")


def test_a_module_given_as_the_base_refuses_build_options_and_takes_a_dtype():
    from lightning_multilora.base_model import build_base_model

    for kwargs, named in ((dict(quantization="nf4"), "`quantization` applies"),
                          (dict(config_overrides={"num_hidden_layers": 1}, quantization="nf4"),
                           "`config_overrides` and `quantization` apply")):
        with pytest.raises(ValueError, match=f"{named} to a base the module builds"):
            MultiLoRAModule(build_base_model("tiny-llama"), **kwargs)
    given = build_base_model("tiny-llama")
    assert MultiLoRAModule(given).model is given and next(given.parameters()).dtype == torch.float32
    assert next(MultiLoRAModule(build_base_model("tiny-llama"), dtype="bfloat16").model.parameters()).dtype \
        == torch.bfloat16
    assert next(MultiLoRAModule("tiny-llama", dtype=torch.float16).model.parameters()).dtype == torch.float16
    # (a float32 asked of a bfloat16 module: it was the default too, and left the module as it was)
    assert next(MultiLoRAModule(build_base_model("tiny-llama", dtype="bfloat16"), dtype="float32").model.parameters()
                ).dtype == torch.float32
    assert next(MultiLoRAModule(build_base_model("tiny-llama", dtype="bfloat16")).model.parameters()).dtype \
        == torch.bfloat16
    assert next(MultiLoRAModule("tiny-llama").model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match=r"`dtype` can be float32, bfloat16, float16 \(or the torch dtype\), got "
                                         r"torch.float64"):
        MultiLoRAModule("tiny-llama", dtype=torch.float64)
    if importlib.util.find_spec("bitsandbytes") is not None:  # (transformers' "You cannot cast a bitsandbytes model
        with warnings.catch_warnings():  # in a new `dtype`", naming no argument of the module)
            warnings.simplefilter("ignore")  # (a 4-bit base on the CPU)
            four_bit = build_base_model("tiny-llama", quantization="nf4")
        with pytest.raises(ValueError, match=r"`dtype` 'bfloat16' casts a base the module is given, and this one is "
                                             r"quantized .* leave `dtype` unset"):
            MultiLoRAModule(four_bit, dtype="bfloat16")


def test_a_base_and_export_dir_given_as_paths_come_back_with_load_from_checkpoint(tmp_path, trainer_kwargs):
    """`pathlib.Path`s were left out of the hyperparameters (plain data alone): `load_from_checkpoint` built the
    default 'tiny-llama' in place of the checkpoint's base, and exported to the default folder."""
    from lightning_multilora.base_model import build_base_model

    build_base_model("tiny-llama", seed=7).save_pretrained(tmp_path / "base")
    module = MultiLoRAModule(tmp_path / "base", export_dir=tmp_path / "exports",
                             adapters=[AdapterSpec("a", rank=2, max_steps=2)], validate_on_finish=False)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 1})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "stop.ckpt")
    assert not [str(w.message) for w in seen if "resume on one" in str(w.message)]
    assert (loaded.hparams["base_model"], loaded.hparams["export_dir"]) == (str(tmp_path / "base"),
                                                                            str(tmp_path / "exports"))
    for ours, theirs in zip(loaded.model.state_dict().values(), module.model.state_dict().values()):
        assert torch.equal(ours, theirs)


def test_a_checkpoint_of_a_model_given_as_the_base_is_loaded_with_it_given_again(tmp_path, trainer_kwargs):
    """A base given as a model is not in the hyperparameters: `load_from_checkpoint` without it built the default
    'tiny-llama', and where that had the model's architecture (another seed's weights) the adapters ran on it,
    unsaid. Refused, naming the way; given again, the loaded module generates as the one saved."""
    from lightning_multilora.base_model import build_base_model

    module = MultiLoRAModule(build_base_model("tiny-llama", seed=5), validate_on_finish=False,
                             adapters=[AdapterSpec("a", rank=2, max_steps=4, lr=5e-2)], export_dir=str(tmp_path))
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match=r"this checkpoint's base was a model given to the module "
                                         r"\(`base_model=<model>`\), which a checkpoint does not hold, and this "
                                         r"module built 'tiny-llama': give the model again"):
        MultiLoRAModule.load_from_checkpoint(tmp_path / "c.ckpt")
    loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "c.ckpt",
                                                  base_model=build_base_model("tiny-llama", seed=5))
    ids = torch.randint(1, 250, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.generate(["a"], ids, max_new_tokens=4), module.generate(["a"], ids, max_new_tokens=4))


def test_a_resume_queues_new_adapters_applies_edits_to_queued_ones_and_warns_of_the_rest(tmp_path, trainer_kwargs):
    """The checkpoint's registry is the run's; an adapter given now and not in it is queued, a queued one takes the
    spec given now, a started one keeps its own (the change is named in a warning). A finished run resumed with
    nothing new says so."""

    def fit(specs, ckpt=None, max_steps=-1):
        module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=1, export_dir=str(tmp_path / "export"),
                                 validate_on_finish=False)
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps})
        trainer.fit(module, small_dm(), ckpt_path=ckpt)
        return trainer, module

    first = [AdapterSpec(n, rank=2, batch_size=1, lr=1e-3, max_steps=3, seed=i) for i, n in enumerate("abc")]
    trainer, _ = fit(first, max_steps=2)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    edited = [AdapterSpec("a", rank=2, batch_size=1, lr=5e-3, max_steps=3, seed=0),  # started: kept as it was
              AdapterSpec("b", rank=2, batch_size=1, lr=1e-3, max_steps=2, seed=1),  # queued: takes the edit
              first[2], AdapterSpec("d", rank=2, batch_size=1, max_steps=1, seed=3)]  # new: queued
    with pytest.warns(UserWarning) as caught:
        trainer, module = fit(edited, ckpt=str(tmp_path / "mid.ckpt"))
    messages = [str(w.message) for w in caught]
    assert any("adapters not in the checkpoint are queued: ['d']" in m for m in messages)
    assert any("keep the specs they started with" in m and "'a' (running; lr 0.001 -> 0.005)" in m for m in messages)
    assert not any("'b'" in m for m in messages if "keep the specs" in m)
    reg = module.registry
    assert [(n, reg[n].state.value, reg[n].step) for n in "abcd"] == [
        ("a", "finished", 3), ("b", "finished", 2), ("c", "finished", 3), ("d", "finished", 1)]
    assert reg["a"].spec.lr == 1e-3 and reg["b"].spec.max_steps == 2
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    with pytest.raises(ValueError, match=r"nothing to train: every adapter has already ended \(a: finished, .*\); "
                                         r"their exports: .*; resuming a finished run trains nothing"):
        fit(edited, ckpt=str(tmp_path / "end.ckpt"))
    with pytest.raises(ValueError, match=r"every adapter has already ended \(a: finished, .*\); their exports: "
                                         r".*; add new ones \(`module.add_adapter"):  # (a second fit of one done)
        L.Trainer(**trainer_kwargs).fit(module, small_dm())


def test_the_log_dir_is_asked_on_every_rank_even_where_a_subclass_setup_skips_super(tmp_path, trainer_kwargs):
    """``Trainer.log_dir`` is a collective: the module's callback asks it in its own ``setup`` (every rank runs it),
    so a subclass whose ``setup`` does not call ``super()`` still has it remembered for exports on one rank."""
    from lightning_multilora import log_dir

    class Own(MultiLoRAModule):
        def setup(self, stage):
            self.seen_stage = stage

    module = Own("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=1)], validate_on_finish=False)
    trainer = L.Trainer(**trainer_kwargs)
    trainer.fit(module, small_dm())
    assert module.seen_stage == "fit" and log_dir._seen[trainer] == trainer.default_root_dir
    assert module.registry["a"].export_path == str(tmp_path / "adapters" / "a")


@pytest.mark.parametrize("case", ["other_type", "other_size", "older_config", "other_dtype"])
def test_a_resume_on_another_base_model_is_refused_and_keeps_the_exports(tmp_path, trainer_kwargs, case):
    """A checkpoint records its base's architecture: a resume on another one (another model type, or other sizes)
    is refused before any weight loads, naming what differs, and the trained exports stay as they were. An entry
    one side lacks (a config that gained `head_dim` in a newer transformers) is no difference."""
    a = AdapterSpec("a", rank=2, batch_size=2, max_steps=6, lr=1e-2)
    export_dir = str(tmp_path / "e")
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 4})
    first = MultiLoRAModule("tiny-llama", adapters=[a], export_dir=export_dir, validate_on_finish=False)
    trainer.fit(first, small_dm())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    trained = load_file(tmp_path / "e" / "a" / "adapter_model.safetensors")
    base, overrides = {"other_type": ("tiny-qwen2", {}), "other_size": ("tiny-llama", {"num_hidden_layers": 1}),
                       "older_config": ("tiny-llama", {}), "other_dtype": ("tiny-llama", {})}[case]
    if case == "older_config":
        checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=False)
        del checkpoint["multilora"]["base"]["head_dim"]
        torch.save(checkpoint, tmp_path / "c.ckpt")
    resumed = MultiLoRAModule(base, adapters=[a], export_dir=export_dir, validate_on_finish=False,
                              config_overrides=overrides, dtype="bfloat16" if case == "other_dtype" else "float32")
    ckpt = str(tmp_path / "c.ckpt")
    if case == "other_dtype":  # (the same architecture, held otherwise, as a 4-bit base: resumed silently before)
        with pytest.warns(UserWarning, match=r"trained on the base held as float32 and resume on it held as bfloat16"):
            L.Trainer(**trainer_kwargs).fit(resumed, small_dm(), ckpt_path=ckpt)
        assert resumed.registry["a"].state.value == "finished"
        return
    if case == "older_config":
        L.Trainer(**trainer_kwargs).fit(resumed, small_dm(), ckpt_path=ckpt)
        assert resumed.registry["a"].state.value == "finished"
        return
    differs = "model_type 'llama' -> 'qwen2'" if case == "other_type" else "num_hidden_layers 2 -> 1"
    with pytest.raises(ValueError, match=rf"trained on another base model .*{differs}.* resume with the `base_model`"):
        L.Trainer(**trainer_kwargs).fit(resumed, small_dm(), ckpt_path=ckpt)
    after = load_file(tmp_path / "e" / "a" / "adapter_model.safetensors")
    assert set(after) == set(trained) and all(torch.equal(after[k], trained[k]) for k in trained)


@pytest.mark.parametrize("bad", ["export_dir", "export_dir_under_a_file", "export_dir_through_a_broken_link",
                                 "betas", "unknown_kwarg", "fused_and_foreach"])
def test_an_unusable_export_dir_or_optimizer_kwargs_fail_as_the_fit_starts(tmp_path, trainer_kwargs, bad):
    """Refused before the first step (an export root that is a file, or under one, would otherwise fail each
    adapter's export after it trained), naming the setting. The check makes no folder: a fit that exports nothing
    leaves none."""
    taken = tmp_path / "a_file"
    taken.write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # (exists() is False for it: the walk must not pass it by)
    kwargs = {"export_dir": dict(export_dir=str(taken)), "betas": dict(optimizer_kwargs={"betas": 0.9}),
              "export_dir_under_a_file": dict(export_dir=str(taken / "sub" / "e")),
              "export_dir_through_a_broken_link": dict(export_dir=str(tmp_path / "link" / "e")),
              "unknown_kwarg": dict(optimizer_kwargs={"momentum": 0.9}),
              "fused_and_foreach": dict(optimizer_kwargs={"fused": True, "foreach": True})}[bad]
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=2, max_steps=4)],
                             validate_on_finish=False, **{"export_dir": str(tmp_path / "e"), **kwargs})
    trainer = L.Trainer(**trainer_kwargs)
    message = {"export_dir": r"`export_dir` '.*a_file' cannot hold the adapters' exports",
               "export_dir_under_a_file": r"`export_dir` '.*a_file/sub/e' cannot hold the adapters' exports: "
                                          r"'.*a_file' is a file",
               "export_dir_through_a_broken_link": r"`export_dir` '.*link/e' cannot hold the adapters' exports: "
                                                   r"'.*link' is a link to nothing",
               "betas": r"`optimizer_kwargs` \{'betas': 0.9\} rejected by AdamW",
               "unknown_kwarg": r"`optimizer_kwargs` \{'momentum': 0.9\} rejected by AdamW: .*momentum",
               # (torch's bare RuntimeError, naming neither the setting nor the optimizer)
               "fused_and_foreach": r"`optimizer_kwargs` \{'fused': True, 'foreach': True\} rejected by AdamW: "
                                    r"`fused` and `foreach` cannot be `True` together"}[bad]
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, small_dm())
    assert trainer.global_step == 0
    assert sorted(tmp_path.rglob("*")) == before  # (no export folder made, wherever the root was)


def test_optimizer_kwargs_that_each_adapter_sets_are_refused():
    """``lr`` and ``weight_decay`` are AdapterSpec fields (each adapter's param group): in ``optimizer_kwargs`` they
    were silently overridden."""
    with pytest.raises(ValueError, match=r"`optimizer_kwargs` \['lr', 'weight_decay'\] are set per adapter: give them "
                                         r"as AdapterSpec fields \(lr=, weight_decay=\)"):
        MultiLoRAModule("tiny-llama", optimizer_kwargs={"weight_decay": 0.5, "lr": 7.0, "betas": (0.9, 0.99)})


def test_the_optimizer_chosen_on_a_gpu_is_one_torch_can_build():
    """On CUDA, Adam (or AdamW with amsgrad / capturable / differentiable) was made fused, which torch refuses with
    ``differentiable``; AdamW plain steps grouped; the user's ``fused`` / ``foreach`` and the CPU are left alone."""
    from lightning_multilora.module import _optimizer_choice
    from lightning_multilora.optim import GroupedAdamW

    adam, adamw = torch.optim.Adam, torch.optim.AdamW
    assert _optimizer_choice(adamw, {}, True) == (GroupedAdamW, {})
    assert _optimizer_choice(adamw, {"amsgrad": True}, True) == (adamw, {"amsgrad": True, "fused": True})
    assert _optimizer_choice(adam, {}, True) == (adam, {"fused": True})
    for cls in (adam, adamw):
        chosen, kwargs = _optimizer_choice(cls, {"differentiable": True}, True)
        assert (chosen, kwargs) == (cls, {"differentiable": True})
        with pytest.raises(RuntimeError, match="differentiable"):  # (what the fused choice met)
            cls([torch.nn.Parameter(torch.zeros(2))], differentiable=True, fused=True)
    assert _optimizer_choice(adam, {"foreach": False}, True) == (adam, {"foreach": False})
    assert _optimizer_choice(adamw, {}, False) == (adamw, {})


@pytest.mark.parametrize("field, value, message", [
    ("max_running", 2.5, r"`max_running` must be an integer >= 1 or None, got 2.5"),
    ("validate_on_finish", "no", r"`validate_on_finish` must be True or False, got 'no'"),
    ("gradient_checkpointing", "no", r"`gradient_checkpointing` must be True or False, got 'no'"),
    ("cuda_graphs", 1, r"`cuda_graphs` must be True or False, got 1"),
    ("base_seed", 2**70, r"`base_seed` must be an integer from -9223372036854775808 to 9223372036854775807"),
    ("base_seed", "0", r"`base_seed` must be an integer from -9223372036854775808 to 9223372036854775807"),
])
def test_module_arguments_of_a_wrong_type_are_named(field, value, message):
    """("no" turned gradient checkpointing on; 2.5 adapters could run)."""
    with pytest.raises(ValueError, match=rf"MultiLoRAModule: {message}"):
        MultiLoRAModule("tiny-llama", **{field: value})


def test_gradient_checkpointing_of_a_plain_torch_base_is_named():
    """("'Tiny' object has no attribute 'gradient_checkpointing_enable'")"""
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

        def forward(self, input_ids):
            return self.q_proj(torch.zeros(input_ids.shape + (4,)))

    with pytest.raises(ValueError, match=r"`gradient_checkpointing=True` needs a Hugging Face model \(its "
                                         r"`gradient_checkpointing_enable`\); Tiny has none"):
        MultiLoRAModule(Tiny(), target_modules=["q_proj"], gradient_checkpointing=True)


def test_gradient_checkpointing_is_turned_on_without_a_deprecation_warning():
    """transformers 5.2x deprecates `gradient_checkpointing_enable` (a FutureWarning at every module built with
    checkpointing): its `activation_checkpointing_enable` is called where it has one, with the same recomputation."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = MultiLoRAModule("tiny-llama", gradient_checkpointing=True)
    assert not [str(w.message) for w in seen if "checkpointing" in str(w.message)]
    model = module.model
    assert getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False))


@pytest.mark.parametrize("fails_at", ["load", "narrower", "make"])
def test_a_resume_that_fails_before_the_weights_load_keeps_the_trained_exports(tmp_path, trainer_kwargs, fails_at):
    """A resume made with other target layers fails, at the checkpoint's load (naming `target_modules`: layers it
    lacks, or layers it holds that the module no longer targets) or while it makes the adapters (one's own targets
    are not among the module's); the adapters it made, new and never loaded, are not exported over the trained
    ones."""
    a = AdapterSpec("a", rank=2, batch_size=2, max_steps=10, lr=1e-2)
    b = AdapterSpec("b", rank=2, batch_size=2, max_steps=10, lr=1e-2, target_modules=["v_proj"])
    export_dir = str(tmp_path / "e")
    module = MultiLoRAModule("tiny-llama", adapters=[a, b], export_dir=export_dir, target_modules=["q_proj", "v_proj"],
                             validate_on_finish=False)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 4})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    trained = load_file(tmp_path / "e" / "a" / "adapter_model.safetensors")
    targets = {"load": {}, "narrower": {"target_modules": ["v_proj"]},  # ("load": the default targets)
               "make": {"target_modules": ["q_proj"]}}[fails_at]
    resumed = MultiLoRAModule("tiny-llama", adapters=[a], export_dir=export_dir, validate_on_finish=False, **targets)
    message = {"load": r"checkpoint lacks adapter weights .* resume with the `target_modules`",
               "narrower": r"checkpoint holds adapter weights for layers this module no longer targets "
                           r"\[.*q_proj.lora_A.a.*resume with the `target_modules`", "make": "v_proj"}
    with pytest.raises(ValueError, match=message[fails_at]):
        L.Trainer(**trainer_kwargs).fit(resumed, small_dm(), ckpt_path=str(tmp_path / "c.ckpt"))
    after = load_file(tmp_path / "e" / "a" / "adapter_model.safetensors")
    assert set(after) == set(trained) and all(torch.equal(after[k], trained[k]) for k in trained)


def test_a_checkpoint_written_after_best_weights_are_exported_resumes_as_if_never_stopped(tmp_path, trainer_kwargs):
    """At the stop, an adapter's export holds its best-validation weights (`EarlyExit(keep_best_weights=True)`); the
    module keeps the weights it trained to, so that a checkpoint written afterwards resumes from them."""
    from lightning_multilora import EarlyExit

    def fit(directory, max_steps=-1, ckpt=None):
        spec = AdapterSpec("r1", rank=4, lr=2e-3, batch_size=2, max_steps=12, seed=1)
        module = MultiLoRAModule("tiny-llama", adapters=[spec], export_dir=str(directory / "export"))
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps, "val_check_interval": 5},
                            callbacks=[EarlyExit(tau_gap=1e9, tau_slope=1e9, keep_best_weights=True)])
        L.seed_everything(0)
        trainer.fit(module, fixed_dm(), ckpt_path=ckpt)
        return trainer, module

    _, uninterrupted = fit(tmp_path / "full")
    trainer, stopped = fit(tmp_path / "part", max_steps=9)  # exported at the stop: step 5's weights (its best)
    assert stopped.registry["r1"].export_path is not None
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    # `save_adapter` writes what the run exports for it, its best weights (it wrote its last ones over that export,
    # the report still naming step 5); its live ones where asked (`best=False`)
    export = Path(stopped.registry["r1"].export_path)
    best = load_file(export / "adapter_model.safetensors")
    assert json.loads((export / "multilora_export.json").read_text())["weights_step"] == 5
    assert stopped.save_adapter("r1") == export
    assert json.loads((export / "multilora_export.json").read_text())["weights_step"] == 5
    assert all(torch.equal(v, best[k]) for k, v in load_file(export / "adapter_model.safetensors").items())
    live = stopped.save_adapter("r1", tmp_path / "live", best=False)
    assert json.loads((live / "multilora_export.json").read_text())["weights_step"] == 9
    assert stopped.registry["r1"].exported_step == 5 and stopped.registry["r1"].export_path == str(export)
    assert stopped.restore_best_weights("r1")  # (the live weights become step 5's, the best's)
    restored = stopped.lora_layers.peft_state_dict("r1")
    assert restored.keys() == best.keys() and all(torch.equal(restored[k], v) for k, v in best.items())
    copy = json.loads((stopped.save_adapter("r1", tmp_path / "restored", best=False) / "multilora_export.json")
                      .read_text())  # (the live weights, step 5's now: they were said step 9's)
    assert (copy["weights_step"], copy["val_loss"]) == (5, pytest.approx(stopped.registry["r1"].best_val_loss))
    with pytest.raises(ValueError, match=r"'r2' is not an adapter of this module; adapters: \['r1'\]"):
        stopped.restore_best_weights("r2")  # (a name misspelt: it returned False, as for one without best weights)
    _, resumed = fit(tmp_path / "part", ckpt=str(tmp_path / "mid.ckpt"))
    assert [s for s, _ in resumed.registry["r1"].val_losses] == [5, 10, 12]
    assert resumed.registry["r1"].val_losses == uninterrupted.registry["r1"].val_losses


def test_a_resumed_run_writes_over_its_own_exports_only(tmp_path, trainer_kwargs):
    """Exports carry their run's id (kept in checkpoints): a run resumed from an earlier checkpoint writes over the
    exports its crashed run made after that checkpoint (its own lineage: no `-v1`), while a new run beside them does
    not."""
    spec = AdapterSpec("a", rank=2, batch_size=2, max_steps=8, lr=1e-2)
    export_dir = str(tmp_path / "e")

    class Crash(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 5:
                raise RuntimeError("node lost")

    def fit(max_steps=-1, ckpt=None, callbacks=()):
        module = MultiLoRAModule("tiny-llama", adapters=[spec], export_dir=export_dir, validate_on_finish=False)
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps}, callbacks=list(callbacks))
        trainer.fit(module, small_dm(), ckpt_path=ckpt)
        return trainer, module

    trainer, _ = fit(max_steps=2)
    trainer.save_checkpoint(tmp_path / "early.ckpt")  # before any export of "a" is recorded
    with pytest.raises(RuntimeError, match="node lost"), pytest.warns(UserWarning, match="fit stopped by"):
        fit(ckpt=str(tmp_path / "early.ckpt"), callbacks=[Crash()])  # exports a at step 5 as it stops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = fit(ckpt=str(tmp_path / "early.ckpt"))  # the same lineage as the step-5 export
    assert not [w for w in caught if "did not write" in str(w.message)]
    assert resumed.registry["a"].export_path == str(tmp_path / "e" / "a")
    _, other = fit()  # a new run
    assert other.registry["a"].export_path == str(tmp_path / "e" / "a-v1")


@pytest.mark.parametrize("first", ["a", "a-v1"])
def test_an_adapter_versioned_past_another_runs_export_keeps_clear_of_this_runs_other_adapters(
        tmp_path, trainer_kwargs, first):
    """Another run left ``e/a``: this run's ``a`` goes to ``e/a-v1``, and its adapter named ``a-v1`` must not write
    over it (nor ``a`` over ``a-v1``'s, whichever exports first): each folder holds the adapter that names it."""
    import json

    export_dir = str(tmp_path / "e")
    L.Trainer(**trainer_kwargs).fit(MultiLoRAModule(
        "tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=2, max_steps=2)], export_dir=export_dir,
        validate_on_finish=False), small_dm())
    steps = {"a": 2 if first == "a" else 4, "a-v1": 2 if first == "a-v1" else 4}
    module = MultiLoRAModule("tiny-llama", adapters=[
        AdapterSpec("a", rank=4, batch_size=2, max_steps=steps["a"]),
        AdapterSpec("a-v1", rank=8, batch_size=2, max_steps=steps["a-v1"], seed=1)], export_dir=export_dir,
        validate_on_finish=False)
    with pytest.warns(UserWarning, match="holds an adapter this run did not write for it"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    paths = {name: module.registry[name].export_path for name in ("a", "a-v1")}
    assert len(set(paths.values())) == 2 and str(tmp_path / "e" / "a") not in paths.values()
    for name, rank in (("a", 4), ("a-v1", 8)):
        assert json.loads((Path(paths[name]) / "adapter_config.json").read_text())["r"] == rank
    assert json.loads((tmp_path / "e" / "a" / "adapter_config.json").read_text())["r"] == 2  # (the other run's)


def test_a_grid_given_as_a_mapping_of_its_fields_is_a_sweep_grid():
    """The Python spelling of a config's ``grid:`` (jsonargparse makes the SweepGrid there): it failed with an
    AttributeError ('dict' object has no attribute 'specs')."""
    module = MultiLoRAModule("tiny-llama", grid={"axes": {"rank": [2, 4]}, "base": {"max_steps": 3}})
    assert [rec.spec.rank for rec in module.registry] == [2, 4]
    with pytest.raises(ValueError, match=r"`grid` takes SweepGrid's fields \['axes', 'base', .*; got \['axis'\]"):
        MultiLoRAModule("tiny-llama", grid={"axis": {"rank": [2]}})
    with pytest.raises(ValueError, match=r"`grid` must be a SweepGrid \(or a mapping of its fields\), got list"):
        MultiLoRAModule("tiny-llama", grid=[{"rank": 2}])


def test_one_adapter_given_without_a_list_is_refused_by_name():
    """``adapters=AdapterSpec("a")`` failed with "TypeError: 'AdapterSpec' object is not iterable" (a mapping alone
    would have been read as its keys); a tuple of specs and mappings is a list."""
    with pytest.raises(ValueError, match=r"^`adapters` is a list of AdapterSpec \(or of mappings of their fields\), "
                                         r"got one AdapterSpec: give it in a list, "
                                         r"adapters=\[AdapterSpec\(\.\.\.\)\]$"):
        MultiLoRAModule("tiny-llama", adapters=AdapterSpec("a"))
    with pytest.raises(ValueError, match=r"got one dict: give it in a list, adapters=\[\{\.\.\.\}\]$"):
        MultiLoRAModule("tiny-llama", adapters={"name": "a", "rank": 2})
    with pytest.raises(ValueError, match=r"of mappings of their fields\), got str$"):
        MultiLoRAModule("tiny-llama", adapters="a")
    module = MultiLoRAModule("tiny-llama", adapters=(AdapterSpec("a", rank=2), {"name": "b", "rank": 4}))
    assert [(rec.name, rec.spec.rank) for rec in module.registry] == [("a", 2), ("b", 4)]
    assert [a["name"] for a in module.hparams["adapters"]] == ["a", "b"]

    from lightning_multilora import MultiLoRAMixin
    from lightning_multilora.base_model import build_base_model

    class Mixed(MultiLoRAMixin, L.LightningModule):  # (its adapters are AdapterSpecs alone: mappings not offered)
        def __init__(self, adapters):
            super().__init__()
            self.model = build_base_model("tiny-llama")
            self.init_multilora(self.model, adapters=adapters)

    with pytest.raises(ValueError, match=r"^`adapters` is a list of AdapterSpec, got one dict: give it in a list, "
                                         r"adapters=\[AdapterSpec\(\.\.\.\)\]$"):
        Mixed({"name": "a"})


def test_the_recorded_base_of_a_compiled_model_is_the_model_it_compiled():
    """torch.compile wraps a model in an OptimizedModule holding it as ``_orig_mod``: a resume with or without the
    compile is on the same base (a model without a Hugging Face config is known by its class)."""
    from types import SimpleNamespace

    from lightning_multilora.module import MultiLoRAMixin

    class OptimizedModule(torch.nn.Module):  # (torch._dynamo's wrapper, without compiling anything)
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    def identity(model):
        return MultiLoRAMixin._base_identity(SimpleNamespace(lora_layers=SimpleNamespace(model=model)))

    assert identity(OptimizedModule(torch.nn.Linear(2, 2))) == identity(torch.nn.Linear(2, 2)) == {"class": "Linear"}


@pytest.mark.parametrize("option, message", [
    (dict(overfit_batches=2), r"`Trainer\(overfit_batches=2\)` would not repeat batches"),
    (dict(limit_val_batches=1), r"`Trainer\(limit_val_batches=1\)` would validate part of each adapter's split"),
    (dict(callbacks="swa"), r"`StochasticWeightAveraging` averages one model's weights"),
    (dict(callbacks="gas"), r"`GradientAccumulationScheduler` would accumulate every adapter's gradients"),
    (dict(callbacks="lr"), r"`LearningRateFinder` \(or `Tuner.lr_find`\) tunes one learning rate, and each adapter "
                           r"has its own, `AdapterSpec.lr`"),
    (dict(callbacks="bs"), r"`BatchSizeFinder` \(or `Tuner.scale_batch_size`\) tunes one batch size"),
])
def test_trainer_tools_that_cannot_act_per_adapter_are_refused(tmp_path, trainer_kwargs, option, message):
    """(overfit_batches had no effect; SWA never started in the one endless epoch, or crashed once it did; the
    accumulation scheduler got Lightning's "switch to automatic optimization"; the tuners, Lightning's "model or
    model.hparams should have ... lr".)"""
    from lightning.pytorch.callbacks import (BatchSizeFinder, GradientAccumulationScheduler, LearningRateFinder,
                                             StochasticWeightAveraging)

    made = {"swa": lambda: [StochasticWeightAveraging(swa_lrs=1e-3)],
            "gas": lambda: [GradientAccumulationScheduler({0: 2})], "lr": lambda: [LearningRateFinder()],
            "bs": lambda: [BatchSizeFinder()]}
    option = {k: made[v]() if k == "callbacks" else v for k, v in option.items()}
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.raises(ValueError, match=message):
        L.Trainer(**{**trainer_kwargs, **option}).fit(module, small_dm())


def test_a_run_without_periodic_validation_is_warned_of_and_a_user_scheduler_refused(tmp_path, trainer_kwargs):
    """Lightning's default val_check_interval (1.0 of an epoch that never ends) validated nothing during the run,
    silently; a scheduler returned by a subclass's configure_optimizers was never stepped, silently."""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.warns(UserWarning, match=r"val_check_interval=1.0\)`: the run is one endless epoch"):
        L.Trainer(**{**trainer_kwargs, "val_check_interval": 1.0, "check_val_every_n_epoch": 1}).fit(module,
                                                                                                   small_dm())
    # an epoch of `limit_train_batches` ends, and validates: nothing to say; another share of an epoch is refused
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**{**trainer_kwargs, "val_check_interval": 1.0, "check_val_every_n_epoch": 1,
                     "limit_train_batches": 2}).fit(module, small_dm())
    assert not [w for w in seen if "endless" in str(w.message)] and [s for s, _ in module.registry["a"].val_losses]
    # no validation asked for (`limit_val_batches=0`, as the DPO example runs): none to miss, nothing to say
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**{**trainer_kwargs, "val_check_interval": 1.0, "check_val_every_n_epoch": 1,
                     "limit_val_batches": 0}).fit(module, small_dm())
    assert not [w for w in seen if "endless" in str(w.message)] and module.registry["a"].step == 2
    with pytest.raises(ValueError, match=r"`Trainer\(val_check_interval=0.5\)` is a share of an epoch, and the run "
                                         r"is one endless epoch"):
        L.Trainer(**{**trainer_kwargs, "val_check_interval": 0.5, "check_val_every_n_epoch": 1}).fit(
            MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)]), small_dm())

    class Scheduled(MultiLoRAModule):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    module = Scheduled("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.raises(ValueError, match=r"learning-rate scheduler from `configure_optimizers` would never be "
                                         r"stepped.*AdapterSpec\(lr_schedule="):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())


def test_a_training_step_that_does_not_call_the_modules_is_named(tmp_path, trainer_kwargs):
    """(The run never ended: no adapter took a step, and the global step never advanced.)"""
    class Mine(MultiLoRAModule):
        def training_step(self, batch, batch_idx):
            return torch.zeros(())

    module = Mine("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.raises(RuntimeError, match=r"Mine.training_step did not call super\(\).training_step"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())


def test_an_export_that_fails_as_training_stops_is_not_repeated_for_the_others(tmp_path, trainer_kwargs, monkeypatch):
    """One adapter's export failing at the end of training raised; the exception's own export then wrote every
    adapter again (the others' exported losses lost with it)."""
    import lightning_multilora.module as module_file

    calls, save = [], module_file.save_peft_adapter

    def failing(directory, spec, *args, **kwargs):
        calls.append(spec.name)
        if spec.name == "b":
            raise OSError("disk full")
        return save(directory, spec, *args, **kwargs)

    monkeypatch.setattr(module_file, "save_peft_adapter", failing)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=10),
                                                     AdapterSpec("b", rank=2, max_steps=10)],
                             export_dir=str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match=r"exporting 'b' \(OSError: disk full\) failed; the other adapters were "
                                           r"exported to"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 3, "val_check_interval": 2}).fit(module, small_dm())
    assert calls == ["a", "b"]
    a = module.registry["a"]
    assert a.exported_step == 3 and math.isfinite(a.exported_val_loss)


def test_a_configure_optimizers_that_does_not_call_the_modules_is_named(tmp_path, trainer_kwargs):
    """An override building its own optimizer never started the adapters: torch's "optimizer got an empty parameter
    list" (only the adapters train), or, over the frozen base's parameters, no adapter stepping."""
    class Trainable(MultiLoRAModule):
        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    class Everything(MultiLoRAModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    for cls in (Trainable, Everything):
        module = cls("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
        with pytest.raises(ValueError, match=rf"{cls.__name__}.configure_optimizers must return \(or wrap\) "
                                             r"super\(\).configure_optimizers\(\).*`optimizer` and `optimizer_kwargs`"):
            L.Trainer(**trainer_kwargs).fit(module, small_dm())

    class Wrapped(Trainable):  # (a subclass of a subclass, calling its parent's that calls the module's)
        def configure_optimizers(self):
            return MultiLoRAModule.configure_optimizers(self)

    module = Wrapped("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert module.registry["a"].step == 2

    class Two(MultiLoRAModule):  # (failed at the first step: "'list' object has no attribute 'param_groups'")
        def configure_optimizers(self):
            return [super().configure_optimizers(), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)]

    with pytest.raises(ValueError, match=r"Two.configure_optimizers returns 2 optimizers; the module steps one"):
        L.Trainer(**trainer_kwargs).fit(Two("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)]),
                                        small_dm())


def test_lightnings_monitors_of_one_adapter_wait_for_it_and_let_go_when_it_ends(tmp_path, trainer_kwargs):
    """EarlyStopping on an adapter that had finished read its last value again at every validation and stopped the
    run (the other adapters cut short); ModelCheckpoint and EarlyStopping on a queued adapter failed the fit (no such
    key); a monitored adapter the module does not have is named up front. LearningRateMonitor's series are the
    adapters' (its param groups' names), not slots that several adapters take in turn."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    def specs():
        return [AdapterSpec("short", rank=2, max_steps=4), AdapterSpec("long", rank=2, max_steps=16),
                AdapterSpec("later", rank=2, max_steps=4)]

    stopping = EarlyStopping(monitor="adapters/short/val_loss", patience=1)
    waiting = EarlyStopping(monitor="adapters/long/val_loss", patience=100)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="adapters/later/val_loss", save_top_k=1)
    # the usual pairs, one key each: an ended adapter's (EarlyStopping let go of it), a queued one's
    ended = ModelCheckpoint(dirpath=tmp_path / "ended", monitor="adapters/short/val_loss", save_top_k=1)
    queued = EarlyStopping(monitor="adapters/later/val_loss", patience=100)
    module = MultiLoRAModule("tiny-llama", adapters=specs(), max_running=1, export_dir=str(tmp_path / "out"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**{**trainer_kwargs, "val_check_interval": 2, "enable_checkpointing": True, "log_every_n_steps": 1,
                     "logger": CSVLogger(tmp_path, name="csv")},
                  callbacks=[stopping, waiting, checkpoint, ended, queued, LearningRateMonitor()]).fit(module,
                                                                                                     small_dm())
    assert any("EarlyStopping(monitor='adapters/short/val_loss'): adapter 'short' has ended (finished); it stops "
               "nothing from here" in str(w.message) for w in caught)
    assert all(r.state == AdapterState.FINISHED for r in module.registry)  # (long ran its 16 steps)
    assert module.registry["long"].step == 16 and checkpoint.best_model_path
    assert checkpoint.best_model_score.isfinite()  # (the queued adapter's placeholder never ranked best)
    assert ended.best_model_score == min(loss for _, loss in module.registry["short"].val_losses)
    import csv

    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as fh:
        columns = next(csv.reader(fh))
    assert {"lr-AdamW/adapters/short", "lr-AdamW/adapters/long", "lr-AdamW/adapters/later"} <= set(columns)
    class Own(MultiLoRAModule):  # the pair from the module (Lightning puts it after the Trainer's callbacks)
        def configure_callbacks(self):
            return [*super().configure_callbacks(), EarlyStopping(monitor="adapters/later/val_loss", patience=100),
                    ModelCheckpoint(dirpath=tmp_path / "own", monitor="adapters/later/val_loss", save_top_k=1)]

    module = Own("tiny-llama", adapters=specs(), max_running=1, export_dir=str(tmp_path / "out2"))
    L.Trainer(**{**trainer_kwargs, "val_check_interval": 2, "enable_checkpointing": True}).fit(module, small_dm())
    assert all(r.state == AdapterState.FINISHED for r in module.registry)  # (it stopped at step 2, on inf)
    module = MultiLoRAModule("tiny-llama", adapters=specs())
    with pytest.warns(UserWarning, match=r"`EarlyStopping\(monitor='adapters/shrot/val_loss'\)` monitors adapter "
                                         r"'shrot', which the module does not have \(yet\); its adapters are "
                                         r"\['short'"):
        L.Trainer(**trainer_kwargs, callbacks=[EarlyStopping(monitor="adapters/shrot/val_loss")]).fit(module,
                                                                                                    small_dm())


def test_an_adapters_values_stay_in_callback_metrics_where_an_early_stopping_monitors_it(tmp_path, trainer_kwargs):
    """The module takes an ended adapter's value away from an EarlyStopping monitoring it (it would stop the run on
    it), and put it back for a ModelCheckpoint alone: with an EarlyStopping only, the adapter's last validation
    loss was gone from ``trainer.callback_metrics``, where the README says each validation's values are."""
    from lightning.pytorch.callbacks import EarlyStopping

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=8),
                                                     AdapterSpec("b", rank=2, max_steps=4)],
                             export_dir=str(tmp_path / "out"))
    trainer = L.Trainer(**{**trainer_kwargs, "val_check_interval": 2},
                        callbacks=[EarlyStopping(monitor="adapters/b/val_loss", patience=100)])
    trainer.fit(module, small_dm())
    assert module.registry["b"].state == AdapterState.FINISHED and module.registry["a"].step == 8
    for name in "ab":
        assert float(trainer.callback_metrics[f"adapters/{name}/val_loss"]) == pytest.approx(
            module.registry[name].last_val_loss)


def test_a_dataloader_in_place_of_the_data_module_is_named_before_any_step(tmp_path, trainer_kwargs):
    """`trainer.validate(module, loader)` (and a second fit, its adapters started) failed at the first batch with a
    bare "KeyError: 'layout'"."""
    from torch.utils.data import DataLoader

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=4)],
                             export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(module, small_dm())
    for run in (L.Trainer(**trainer_kwargs).validate, L.Trainer(**trainer_kwargs).fit):
        with pytest.raises(ValueError, match=r"the module needs a MultiLoRADataModule: `trainer.fit\(module, "
                                             r"datamodule=MultiLoRADataModule\(...\)\)`.*a DataLoader's batches"):
            run(module, DataLoader([{"input_ids": torch.zeros(4, dtype=torch.long)}]))
    assert module.registry["a"].step == 2


def test_a_monitored_value_the_module_never_logs_is_said_as_the_fit_starts(tmp_path, trainer_kwargs):
    """A ModelCheckpoint on a misspelt value of a real adapter was given +inf at every validation (as a queued
    adapter's is): no error, its "best" checkpoint any. A run-wide `val_loss` failed the fit at the first validation,
    after its steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=4)],
                             export_dir=str(tmp_path / "out"))
    typo = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="adapters/a/valid_loss", save_top_k=1)
    kwargs = {**trainer_kwargs, "val_check_interval": 2, "enable_checkpointing": True}
    with pytest.warns(UserWarning, match=r"`ModelCheckpoint\(monitor='adapters/a/valid_loss'\)`: 'valid_loss' is no "
                                         r"value the module logs for an adapter \(did you mean 'val_loss'\?\)"):
        with pytest.raises(MisconfigurationException, match="adapters/a/valid_loss"):  # (Lightning's: the keys)
            L.Trainer(**kwargs, callbacks=[typo]).fit(module, small_dm())
    # (DPO's value of an SFT adapter: the same, where its "best" checkpoint had been its first)
    dpo_only = ModelCheckpoint(dirpath=tmp_path / "ckpt3", monitor="adapters/a/val_preference_accuracy", mode="max")
    with pytest.warns(UserWarning, match=r"`ModelCheckpoint\(monitor='adapters/a/val_preference_accuracy'\)`: "
                                         r"adapter 'a' is trained with objective 'sft', which logs no "
                                         r"'val_preference_accuracy' \(an adapter with objective 'dpo' logs it\)"):
        with pytest.raises(MisconfigurationException, match="adapters/a/val_preference_accuracy"):
            L.Trainer(**kwargs, callbacks=[dpo_only]).fit(MultiLoRAModule(
                "tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=4)],
                export_dir=str(tmp_path / "out3")), small_dm())
    latest = ModelCheckpoint(dirpath=tmp_path / "latest", monitor="step", mode="max", save_top_k=2)  # (Lightning's)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**kwargs, callbacks=[latest]).fit(module, small_dm())
    assert not [w for w in seen if "monitor=" in str(w.message)]
    assert len(list((tmp_path / "latest").glob("*.ckpt"))) == 1  # (its one validation of the step left: step 4)
    plain = ModelCheckpoint(dirpath=tmp_path / "ckpt2", monitor="val_loss", save_top_k=1)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=1, max_steps=4)],
                             export_dir=str(tmp_path / "out2"))
    with pytest.warns(UserWarning, match=r"`ModelCheckpoint\(monitor='val_loss'\)`: no run-wide 'val_loss': the "
                                         r"module logs each adapter's values as 'adapters/<name>/<value>'"):
        with pytest.raises(MisconfigurationException):
            L.Trainer(**kwargs, callbacks=[plain]).fit(module, small_dm())


def test_loggers_get_each_adapters_values_while_it_runs_and_monitors_find_them(tmp_path, trainer_kwargs):
    """An adapter that ended kept its last values in Lightning's results, written again at every logging step (flat
    made-up curves); the validation losses reached the loggers only, so ModelCheckpoint / EarlyStopping could not
    monitor them."""
    import csv

    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    specs = [AdapterSpec("long", rank=2, max_steps=12, lr=5e-3), AdapterSpec("short", rank=2, max_steps=6, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="adapters/long/val_loss", save_top_k=1)
    stopping = EarlyStopping(monitor="adapters/long/val_loss", patience=100)
    trainer = L.Trainer(**{**trainer_kwargs, "logger": CSVLogger(tmp_path), "log_every_n_steps": 1,
                           "val_check_interval": 4, "enable_checkpointing": True}, callbacks=[checkpoint, stopping])
    trainer.fit(module, small_dm())
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    short = [int(r["step"]) for r in rows if r.get("adapters/short/train_loss")]
    long = [int(r["step"]) for r in rows if r.get("adapters/long/train_loss")]
    assert len(short) == len(set(short)) == 6 and len(long) == 12, (short, long)
    best = min(loss for _, loss in module.registry["long"].val_losses)
    assert checkpoint.best_model_score is not None and float(checkpoint.best_model_score) == pytest.approx(best)
    assert float(stopping.best_score) == pytest.approx(best)
    # a training value is the step's own when a callback checks it (callbacks' on_train_batch_end run first)
    seen = []

    class Reads(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["adapters/x/train_loss"]))

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("x", rank=2, max_steps=3)])
    monitor = ModelCheckpoint(dirpath=tmp_path / "t", monitor="adapters/x/train_loss")
    L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True}, callbacks=[monitor, Reads()]).fit(module, small_dm())
    assert seen == pytest.approx([loss for _, loss in module.registry["x"].train_losses])


def test_each_validations_losses_are_in_callback_metrics_for_any_reader(trainer_kwargs):
    """``trainer.callback_metrics`` held only the values some callback's ``monitor`` named: a user's callback (or Ray
    Tune's, which names its metrics otherwise) found none of the adapters' validation losses."""
    seen = []

    class Reads(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("/val_loss")})

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4),
                                                     AdapterSpec("b", rank=2, max_steps=6, seed=1)])
    trainer = L.Trainer(**{**trainer_kwargs, "val_check_interval": 2}, callbacks=[Reads()])
    trainer.fit(module, small_dm())
    a, b = module.registry["a"], module.registry["b"]
    assert seen[0] == pytest.approx({"adapters/a/val_loss": a.val_losses[0][1],
                                     "adapters/b/val_loss": b.val_losses[0][1]})
    assert {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("/val_loss")} == pytest.approx(
        {"adapters/a/val_loss": a.last_val_loss, "adapters/b/val_loss": b.last_val_loss})


def test_trainer_validate_returns_the_held_adapters_losses_and_test_is_named(tmp_path, trainer_kwargs):
    """After a fit that left adapters running, ``trainer.validate`` returned ``[{}]`` (each adapter counted as
    measured at its step); it now returns each held adapter's loss over its split, as `evaluate` measures it, without
    recording it. ``trainer.test`` / ``predict`` name what to use."""
    specs = [AdapterSpec("a", rank=2, max_steps=20), AdapterSpec("b", rank=2, max_steps=20, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    dm = small_dm()
    L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(module, dm)
    before = {n: list(module.registry[n].val_losses) for n in ("a", "b")}
    (results,) = L.Trainer(**trainer_kwargs).validate(module, dm)
    expected = module.evaluate(["a", "b"])
    assert results == pytest.approx({f"adapters/{n}/val_loss": expected[n] for n in ("a", "b")}, rel=1e-5)
    assert {n: module.registry[n].val_losses for n in ("a", "b")} == before
    for call in ("test", "predict"):
        with pytest.raises(ValueError, match=rf"`trainer.{call}` has no step here: .*module.evaluate"):
            getattr(L.Trainer(**trainer_kwargs), call)(module, dm)
    # a paused adapter is held too (a warmup's candidate): it was left out, unsaid
    module.pause_adapter("b")
    (results,) = L.Trainer(**trainer_kwargs).validate(module, dm)
    assert results == pytest.approx({f"adapters/{n}/val_loss": expected[n] for n in ("a", "b")}, rel=1e-5)
    module.pause_adapter("a")
    (results,) = L.Trainer(**trainer_kwargs).validate(module, dm)
    assert results == pytest.approx({f"adapters/{n}/val_loss": expected[n] for n in ("a", "b")}, rel=1e-5)


def test_a_base_that_applies_dropout_is_warned_of(trainer_kwargs):
    """The base's dropout draws from one random stream for the whole packed batch: adapters sharing a step then
    change each other's masks (an adapter no longer trains as it would alone), which nothing said."""
    specs = [AdapterSpec("a", rank=2, max_steps=1), AdapterSpec("b", rank=2, max_steps=1, seed=1)]
    for overrides, expected in [({"attention_dropout": 0.1}, [r"config.attention_dropout=0.1"]), ({}, [])]:
        module = MultiLoRAModule("tiny-llama", adapters=specs, config_overrides=overrides or None,
                                 validate_on_finish=False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs).fit(module, small_dm())
        found = [str(w.message) for w in seen if "applies dropout" in str(w.message)]
        assert len(found) == len(expected) and all(re.search(e, f) for e, f in zip(expected, found))
        if expected:
            assert "no longer trains exactly as it would alone" in found[0] and "config_overrides" in found[0]
    # OPT applies its `dropout` (0.1 by default, as every facebook/opt-* checkpoint) with F.dropout: never said
    from transformers import AutoModelForCausalLM, OPTConfig

    opt = AutoModelForCausalLM.from_config(OPTConfig(vocab_size=300, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                                     num_attention_heads=4, word_embed_proj_dim=32))
    module = MultiLoRAModule(opt, adapters=specs, validate_on_finish=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    found = [str(w.message) for w in seen if "applies dropout" in str(w.message)]
    assert len(found) == 1 and "config.dropout=0.1" in found[0] and "{'dropout': 0.0}" in found[0], found
    from lightning_multilora.module import _base_dropout

    opt.config.dropout, opt.config.residual_dropout = 0.0, 0.2  # (StarCoder2's key, applied with F.dropout)
    assert _base_dropout(opt)[1] == ["residual_dropout"]
    # an MoE router's noise draws from the same stream (Mixtral's jitter: 0.77 relative from the adapter alone)
    from types import SimpleNamespace

    from transformers import MixtralConfig

    mixtral = SimpleNamespace(named_modules=lambda: [], config=MixtralConfig(router_jitter_noise=0.2))
    assert _base_dropout(mixtral) == ("config.router_jitter_noise=0.2", ["router_jitter_noise"])
    dbrx = SimpleNamespace(named_modules=lambda: [], config=SimpleNamespace(ffn_config=SimpleNamespace(
        moe_jitter_eps=0.01)))
    assert _base_dropout(dbrx)[0] == "config.ffn_config.moe_jitter_eps=0.01"
    phimoe = SimpleNamespace(named_modules=lambda: [], config=SimpleNamespace(model_type="phimoe"))
    assert "PhiMoE's router, which samples its experts in training" in _base_dropout(phimoe)[0]


def test_a_longrope_base_is_warned_of_where_rows_pass_its_short_length(trainer_kwargs):
    """Phi-3's LongRoPE takes its long factors for every row once the batch's longest row passes
    original_max_position_embeddings: an adapter beside longer rows trained 1.1 relative from itself alone, unsaid."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_multilora.module import _longrope_limit

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 64}
    config = AutoConfig.for_model("phi3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  original_max_position_embeddings=64, rope_scaling=rope, pad_token_id=0)
    assert _longrope_limit(config) == 64 and _longrope_limit(AutoConfig.for_model("phi3")) is None
    specs = [AdapterSpec("a", rank=2, max_steps=1), AdapterSpec("b", rank=2, max_steps=1, seed=1)]
    for max_length, said in ((None, 1), (64, 0)):
        torch.manual_seed(0)
        module = MultiLoRAModule(AutoModelForCausalLM.from_config(config), adapters=specs, validate_on_finish=False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs).fit(module, small_dm(max_length=max_length, truncate=True))
        found = [str(w.message) for w in seen if "LongRoPE" in str(w.message)]
        assert len(found) == said and all("original_max_position_embeddings=64" in f and "max_length=64" in f
                                          for f in found), found


def test_generate_on_a_longrope_base_warns_where_its_rows_lengths_pass_the_short_length_apart(trainer_kwargs):
    """`generate` packs prompts of several lengths: on a LongRoPE base every row took the long factors once the
    longest passed original_max_position_embeddings, so a short prompt generated otherwise than alone, unsaid (the
    fit warned of it; `generate` did not)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 64}
    config = AutoConfig.for_model("phi3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  original_max_position_embeddings=64, rope_scaling=rope, pad_token_id=0)
    torch.manual_seed(0)
    module = MultiLoRAModule(AutoModelForCausalLM.from_config(config), validate_on_finish=False,
                             adapters=[AdapterSpec("a", rank=2, max_steps=5), AdapterSpec("b", rank=2, max_steps=5)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fit's own LongRoPE warning)
        L.Trainer(**{**trainer_kwargs, "max_steps": 1}).fit(module, small_dm(max_length=64, truncate=True))

    def said(lengths, new=None, **kwargs):
        ids = torch.randint(1, 300, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
        mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module.generate(["a", "b"][:len(lengths)], ids * mask, attention_mask=mask, pad_token_id=0,
                            eos_token_id=None, **({} if new is None else {"max_new_tokens": new}), **kwargs)
        return [str(w.message) for w in seen if "LongRoPE" in str(w.message)]

    (message,) = said([10, 60], 8)
    assert "original_max_position_embeddings=64: prompts of 10 to 60 tokens with 8 new ones" in message
    # (the last forward reads position 58 + 8 - 1 = 65 > 64: every row on the long factors; at 57, 64: none)
    assert len(said([10, 58], 8)) == 1 and said([10, 57], 8) == []
    assert len(said([10, 50])) == 1  # (generate's own default: 20 new tokens)
    assert len(said([10, 60], 8, return_dict_in_generate=True)) == 1  # (the sequences in a dict)
    assert said([60, 60], 8) == [] and said([60], 8) == [] and said([70, 80], 8) == []  # (one length; all long)


def test_an_adapters_targets_outside_the_modules_layers_name_the_adapter_and_the_fix():
    """A PEFT user's ``["q_proj", "v_proj", "lm_head"]`` was refused naming neither the adapter (of a grid's many)
    nor the module's `target_modules`, which takes the head; a regex matching nothing listed no layers."""
    with pytest.raises(ValueError, match=r"adapter 'b': `target_modules` \['lm_head'\] are not among the injected "
                                         r"layers; .*\['lm_head'\] are linear modules the module does not wrap: add "
                                         r"them to its `target_modules` \('all-linear' now\)"):
        MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a"), AdapterSpec("b", target_modules=["q_proj",
                                                                                                     "lm_head"])])
    with pytest.raises(ValueError, match=r"adapter 'c': `target_modules` '.\*c_attn' match none of the injected "
                                         r"layers; injected module names end in: \['down_proj', 'gate_proj', "):
        MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("c", target_modules=".*c_attn")])


def test_an_adapters_regex_that_matches_layers_the_module_does_not_wrap_is_warned_of():
    """A regex adapted only the part of what it matched that the module wraps, silently (a list naming an unwrapped
    module is an error)."""
    regex = r".*\.(q|k)_proj"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MultiLoRAModule("tiny-llama", target_modules=["q_proj", "v_proj"],
                        adapters=[AdapterSpec("a", target_modules=regex)])
        MultiLoRAModule("tiny-llama", target_modules=["q_proj", "v_proj"],
                        adapters=[AdapterSpec("b", target_modules=r".*\.q_proj"),
                                  AdapterSpec("c", target_modules="all-linear")])
    said = [str(w.message) for w in seen if "does not wrap" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        f"adapter 'a': its `target_modules` {regex!r} also match linear modules the module does not wrap "
        "(['model.layers.0.self_attn.k_proj'")
    assert "it gets 2 layers" in said[0]  # (b's regex and c's "all-linear" take only wrapped layers: not warned of)


class _InterruptAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_an_interrupted_first_export_is_finished_in_its_own_folder(tmp_path, trainer_kwargs, monkeypatch):
    """Ctrl+C while an adapter's first export was being written left its folder with a config and no weights, and
    the exception's re-export took that folder for another run's (its stamp came last): it warned so and wrote to
    ``<name>-v1``. The stamp comes first now, and each file is moved into place whole."""
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted_once)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2, batch_size=1)],
                             validate_on_finish=False)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert not [w for w in seen if "did not write" in str(w.message)]
    folder = Path(trainer_kwargs["default_root_dir"]) / "adapters"
    assert sorted(p.name for p in folder.iterdir()) == ["a"]
    assert sorted(p.name for p in (folder / "a").iterdir()) == [".multilora_run", "adapter_config.json",
                                                                "adapter_model.safetensors", "multilora_export.json"]
    assert module.registry["a"].export_path == str(folder / "a") and len(calls) == 2


def test_a_resume_stopped_early_keeps_the_later_export_of_the_run_it_resumed(tmp_path, trainer_kwargs):
    """A run went on past its checkpoint and exported an adapter as it finished (then was killed); its resume,
    stopped before that step, exported the adapter's earlier weights over the finished ones, which then existed
    nowhere. They are kept, and the earlier ones written beside them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    specs = [AdapterSpec("a", rank=2, max_steps=4, batch_size=1, seed=1),
             AdapterSpec("b", rank=2, max_steps=5, batch_size=1, seed=2)]
    exports = tmp_path / "exports"
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True}, callbacks=[checkpoint]).fit(
        MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(exports), validate_on_finish=False), small_dm())
    finished = load_file(exports / "a" / "adapter_model.safetensors")
    resumed = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(exports), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapter 'a': .*exports/a holds its export of step 4, a later step than "
                                         r"this one's \(3\).*written to .*exports/a-v1"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(resumed, small_dm(),
                                                            ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    for key, value in load_file(exports / "a" / "adapter_model.safetensors").items():
        assert torch.equal(value, finished[key])
    assert resumed.registry["a"].export_path == str(exports / "a-v1") and resumed.registry["a"].exported_step == 3
    assert resumed.registry["b"].export_path == str(exports / "b-v1")  # (b's step 5 kept too)


def test_a_resume_names_its_own_later_export_where_another_runs_folder_came_first(tmp_path, trainer_kwargs):
    """`a` was another run's, so the run wrote `a-v1` (step 4); its resume, stopped at step 3, skipped both and said
    only that `a` was another run's, never that it kept its own later export."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_multilora.module import _RUN_STAMP

    exports = tmp_path / "exports"
    (exports / "a").mkdir(parents=True)
    (exports / "a" / _RUN_STAMP).write_text("another-run\na\n9\n")
    (exports / "a" / "adapter_config.json").write_text("{}")
    specs = [AdapterSpec("a", rank=2, max_steps=4, batch_size=1, seed=1)]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match="another run's"):
        L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True}, callbacks=[checkpoint]).fit(
            MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(exports), validate_on_finish=False),
            small_dm())
    resumed = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(exports), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapter 'a': .*exports/a-v1 holds its export of step 4, a later step than "
                                         r"this one's \(3\).*written to .*exports/a-v2"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(resumed, small_dm(),
                                                            ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed.registry["a"].export_path == str(exports / "a-v2")


def test_an_export_that_fails_as_its_adapter_finishes_stops_the_fit_naming_it(tmp_path, trainer_kwargs, monkeypatch):
    """(A full disk at an adapter's exit stopped the run with the bare OSError of a partial file.)"""
    import errno

    import lightning_multilora.module as module_file

    real = module_file.save_peft_adapter

    def full_for_a(directory, spec, *args, **kwargs):
        if spec.name == "a":
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return real(directory, spec, *args, **kwargs)

    monkeypatch.setattr(module_file, "save_peft_adapter", full_for_a)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2, batch_size=1),
                                                     AdapterSpec("b", rank=2, max_steps=5, batch_size=1)],
                             export_dir=str(tmp_path / "exports"), validate_on_finish=False)
    with pytest.raises(RuntimeError, match=r"adapter 'a' \(finished at its step 2: reached max_steps=2\) could not be "
                                           r"exported: OSError: \[Errno 28\] No space left on device.*resume from the "
                                           r"last checkpoint"), \
            pytest.warns(UserWarning, match="exporting the adapters"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert module.registry["a"].state == AdapterState.RUNNING and module.registry["b"].step == 2
    assert (tmp_path / "exports" / "b" / "adapter_model.safetensors").is_file()  # (exported as the fit stopped)


def test_an_export_after_ctrl_c_between_validations_has_no_earlier_steps_loss(trainer_kwargs):
    """After Ctrl+C the summary gave the exported weights (of the step the fit stopped at) the loss of an earlier
    validation's weights."""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=50, batch_size=1)])
    trainer = L.Trainer(**{**trainer_kwargs, "val_check_interval": 2}, callbacks=[_InterruptAt(3)])
    with pytest.warns(UserWarning, match="fit stopped by KeyboardInterrupt"), pytest.raises(SystemExit):
        trainer.fit(module, small_dm())
    rec = module.registry["a"]
    assert rec.exported_step == 3 and [s for s, _ in rec.val_losses] == [2]
    (row,) = module.registry.summary_rows("last")
    assert math.isnan(row["exported_val_loss"]) and row["last_val_loss"] == rec.val_losses[0][1]


def test_no_adapter_is_admitted_after_the_trainers_last_step(trainer_kwargs):
    """A slot freed at the Trainer's last step was filled from the queue: the adapter was exported untrained (its B
    zero), reported running with no step, and an Optuna trial spent on it."""
    module = MultiLoRAModule("tiny-llama", max_running=1, validate_on_finish=False,
                             adapters=[AdapterSpec("a", rank=2, max_steps=3), AdapterSpec("b", rank=2, max_steps=3)])
    L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(module, small_dm())
    assert module.registry["a"].state == AdapterState.FINISHED
    assert module.registry["b"].state == AdapterState.QUEUED and module.registry["b"].export_path is None


def test_an_error_in_validate_leaves_the_fits_exports_and_report(tmp_path, trainer_kwargs):
    """An exception in ``trainer.validate`` (or the refused ``trainer.test``) was handled as a stopped fit: the held
    adapters re-exported into that Trainer's log directory, their measured export losses reset, and SweepReport's
    summary overwritten by a "fit stopped" one."""
    from lightning_multilora import SweepReport

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=20)])
    L.Trainer(**{**trainer_kwargs, "max_steps": 3}, callbacks=[SweepReport(tensorboard=False)]).fit(module, small_dm())
    rec = module.registry["a"]
    path, loss, summary = rec.export_path, rec.exported_val_loss, (tmp_path / "sweep_summary.json").read_text()
    assert math.isfinite(loss)

    class Fails(Callback):
        def on_validation_batch_end(self, *args):
            raise RuntimeError("boom")

    other = {**trainer_kwargs, "default_root_dir": str(tmp_path / "other")}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom"):
            L.Trainer(**other, callbacks=[Fails(), SweepReport(tensorboard=False)]).validate(module, small_dm())
        with pytest.raises(ValueError, match="`trainer.test` has no step here"):
            L.Trainer(**other, callbacks=[SweepReport(tensorboard=False)]).test(module, small_dm())
    assert not [w for w in seen if "fit stopped" in str(w.message)]
    assert (rec.export_path, rec.exported_val_loss) == (path, loss) and not (tmp_path / "other").exists()
    assert (tmp_path / "sweep_summary.json").read_text() == summary


def test_fast_dev_run_runs_with_a_warning_and_writes_nothing_beside_the_real_runs(tmp_path, trainer_kwargs,
                                                                                 tmp_path_factory, monkeypatch):
    """``Trainer(fast_dev_run=True)`` was refused for a ``limit_val_batches`` the user never set (Lightning's). Its
    exports and summary went to the run's folders (`export_dir`, ``default_root_dir``), versioned on at each smoke
    run, and its summary refused the next real run a log directory without a logger: they go to a temporary
    folder, said."""
    from lightning_multilora import SweepReport

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path_factory.mktemp("smoke")))  # (not left in /tmp)
    for export_dir in (None, str(tmp_path / "exports")):  # (batch-1 adapters: the one batch holds each's examples)
        module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec(n, rank=2, max_steps=5, batch_size=1)
                                                         for n in "abc"], export_dir=export_dir)
        kwargs = {k: v for k, v in trainer_kwargs.items() if k not in ("max_steps", "val_check_interval")}
        with pytest.warns(UserWarning, match=r"`Trainer\(fast_dev_run=True\)`: a smoke run of 1 step\(s\); its "
                                             r"validations see 1 batch"):
            with pytest.warns(UserWarning, match=r"the smoke run writes its adapters and summary to .*"
                                                 r"multilora-fast-dev-run-"):
                trainer = L.Trainer(**kwargs, fast_dev_run=True, callbacks=[SweepReport(tensorboard=False)])
                trainer.fit(module, small_dm())
        assert {f"adapters/{n}/val_loss" for n in "abc"} <= set(trainer.callback_metrics)
        rec = module.registry["a"]
        assert rec.step == 1 and "multilora-fast-dev-run-" in rec.export_path
        assert rec.val_losses == [] and rec.best_val_step == -1  # (one batch's loss: kept, it sat beside splits')
        assert (Path(rec.export_path) / "adapter_model.safetensors").is_file()
        assert (Path(rec.export_path).parent.parent / "sweep_summary.json").is_file()
        assert not list(tmp_path.iterdir())


def test_an_earlier_fits_early_exit_does_not_keep_best_weights_in_a_later_fit(trainer_kwargs):
    """EarlyExit turned the module's best-weight exports on for good: a later fit without it still exported best
    weights and reported "best"."""
    from lightning_multilora import EarlyExit

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    L.Trainer(**trainer_kwargs, callbacks=[EarlyExit()]).fit(module, small_dm())
    assert module.keep_best_weights
    module.add_adapter(AdapterSpec("b", rank=2, max_steps=2))
    L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert not module.keep_best_weights
    module.add_adapter(AdapterSpec("c", rank=2, max_steps=2))
    L.Trainer(**trainer_kwargs, callbacks=[EarlyExit()]).fit(module, small_dm())
    assert module.keep_best_weights


def test_save_adapter_writes_live_weights_once_a_later_fit_keeps_no_best_ones(tmp_path, trainer_kwargs):
    """`save_adapter`'s default, the weights the run exports for the adapter, wrote an earlier fit's best-weight
    snapshot (EarlyExit's) after a fit without EarlyExit, labelled with this fit's best step, over the run's export."""
    from lightning_multilora import EarlyExit

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, lr=3e-3, max_steps=40)],
                             export_dir=str(tmp_path))
    kwargs = {**trainer_kwargs, "val_check_interval": 2}
    L.Trainer(**{**kwargs, "max_steps": 4}, callbacks=[EarlyExit(patience_div=100, patience_ovf=100)]).fit(
        module, small_dm())
    assert "a" in module._best_weights
    L.Trainer(**{**kwargs, "max_steps": 6}).fit(module, small_dm())
    live = module.lora_layers.peft_state_dict("a")
    written = load_file(module.save_adapter("a") / "adapter_model.safetensors")
    assert all(torch.equal(written[k], live[k]) for k in live)


def test_the_ranks_registries_agree_whatever_order_their_ended_unplaced_adapters_came_in():
    """A resumed adapter-parallel sweep: rank 0 took up the trials told after the checkpoint after its new ones, the
    other ranks before them; the digest of the ranks' registries took the order for a difference (a false error on
    every rank, at every resume). Ended adapters no rank trains count in any order; queued ones in theirs."""
    from types import SimpleNamespace as NS

    def digest(order, queued_order=("q1", "q2")):
        module = MultiLoRAModule("tiny-llama")
        for name in ("a", *order, *queued_order):
            module.add_adapter(AdapterSpec(name, rank=2))
        for name in order:
            module.registry[name].state = AdapterState.FINISHED
        return module._registry_digest(NS(owner={"a": 0}))

    assert digest(("t2", "t3")) == digest(("t3", "t2"))
    assert digest(("t2", "t3")) != digest(("t2", "t3"), ("q2", "q1"))


def test_an_export_under_early_exit_after_a_fit_without_it_holds_the_weights_it_names(tmp_path, trainer_kwargs):
    """A fit without EarlyExit validated a new best that no snapshot kept; a later fit's EarlyExit exported the earlier
    fit's snapshot, named as that new best (its step and loss), over the export of it. Now: the weights of that best
    where they are the adapter's as the fit starts, else its last ones, said."""
    from lightning_multilora import EarlyExit

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4, alpha=8, lr=1e-2, max_steps=100)],
                             export_dir=str(tmp_path / "out"))
    kwargs = dict(trainer_kwargs, val_check_interval=2)
    rec = module.registry["a"]

    def fit(steps: int, early: bool) -> tuple[dict, dict, list[str]]:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            L.Trainer(**dict(kwargs, max_steps=steps), callbacks=[EarlyExit()] if early else []).fit(module, small_dm())
        export = Path(rec.export_path)
        return (load_file(str(export / "adapter_model.safetensors")),
                json.loads((export / "multilora_export.json").read_text()), [str(w.message) for w in said])

    fit(2, early=True)  # (best at step 2, kept)
    fit(3, early=False)  # (a better one at step 4, not kept; the fit ends at step 5)
    assert [s for s, _ in rec.val_losses] == [2, 4] and rec.best_val_step == 4 and rec.step == 5
    weights, info, said = fit(1, early=True)
    live = module.lora_layers.peft_state_dict("a")
    assert info["weights_step"] == rec.exported_step == 6 and all(torch.equal(weights[k], live[k]) for k in live)
    assert any("its best-validation weights (step 4," in m and "its weights of step 6 are written" in m for m in said)
    fit(2, early=False)  # (a better one at step 8, where the fit ends)
    assert rec.best_val_step == rec.step == 8
    at_best = {k: v.clone() for k, v in module.lora_layers.peft_state_dict("a").items()}
    weights, info, said = fit(1, early=True)
    assert info["weights_step"] == rec.exported_step == 8 and info["val_loss"] == rec.best_val_loss
    assert all(torch.equal(weights[k], at_best[k]) for k in at_best)
    assert not any("were not kept" in m for m in said)


def test_a_second_fit_of_the_module_goes_on_with_its_optimizer_state(tmp_path, trainer_kwargs):
    """A fit stopped by the Trainer's ``max_steps`` and fitted again (a new Trainer) went on with the adapters' steps,
    schedules and data, but a new optimizer: AdamW's moments and step counts restarted, silently. Two fits of 3 steps
    now end where one of 6 does."""
    from safetensors.torch import load_file

    def run(stops: list[int], out: str) -> dict:
        module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / out),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=6, lr=1e-2),
                                           AdapterSpec("b", rank=2, max_steps=6, lr=3e-3, seed=1)])
        dm = small_dm()
        for stop in stops:
            L.Trainer(**{**trainer_kwargs, "max_steps": stop}).fit(module, dm)
        return {n: load_file(str(tmp_path / out / n / "adapter_model.safetensors")) for n in ("a", "b")}

    once, twice = run([-1], "once"), run([3, -1], "twice")
    for name in ("a", "b"):
        for key, value in once[name].items():
            torch.testing.assert_close(twice[name][key], value, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("how", ["another data module", "load_from_checkpoint", "load, validate, fit"])
def test_a_fit_of_a_loaded_module_or_with_a_new_data_module_goes_on_as_the_run_not_stopped(tmp_path, trainer_kwargs,
                                                                                           how):
    """A module from ``load_from_checkpoint`` fitted without ``ckpt_path`` went on with new optimizer states and its
    adapters' data from the start, and wrote its exports over the run's (an adapter finished after the checkpoint
    trained again, differently); a second fit given a new data module started every adapter's data over. Both now go
    on as the run that was not stopped."""
    from safetensors.torch import load_file

    def module_of(out: str) -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / out),
                               adapters=[AdapterSpec("a", rank=2, max_steps=7, lr=1e-2, dropout=0.1, seed=1),
                                         AdapterSpec("b", rank=2, max_steps=4, lr=3e-3, batch_size=3, seed=2)])

    def exports(module: MultiLoRAModule) -> dict:
        return {n: load_file(Path(module.registry[n].export_path) / "adapter_model.safetensors") for n in "ab"}

    once = module_of("once")
    L.Trainer(**trainer_kwargs).fit(once, small_dm())
    module = module_of("twice")
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 3})
    trainer.fit(module, small_dm())
    if how != "another data module":
        trainer.save_checkpoint(tmp_path / "stop.ckpt")
        L.Trainer(**{**trainer_kwargs, "max_steps": 5}).fit(module, small_dm())  # (b finishes and is exported)
        module = MultiLoRAModule.load_from_checkpoint(tmp_path / "stop.ckpt")
        if how == "load, validate, fit":  # (the validate dropped the checkpoint's optimizer states)
            L.Trainer(**trainer_kwargs).validate(module, small_dm())
    L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert [module.registry[n].tokens_seen for n in "ab"] == [once.registry[n].tokens_seen for n in "ab"]
    ours = exports(module)
    for name, tensors in exports(once).items():
        for key, value in tensors.items():
            torch.testing.assert_close(ours[name][key], value, atol=1e-6, rtol=1e-5)


def test_an_adapter_whose_finishing_validation_was_cut_short_finishes_at_its_length(tmp_path, trainer_kwargs,
                                                                                   monkeypatch):
    """An error (out of memory, say) or Ctrl+C in the validation an adapter gets as it reaches ``max_steps`` left it
    running: the next fit (or a resume from the exception's checkpoint) trained it a step past its length and wrote
    that over its export."""
    module = MultiLoRAModule("tiny-llama", export_dir=str(tmp_path),
                             adapters=[AdapterSpec("a", rank=2, max_steps=5, seed=1), AdapterSpec("b", rank=2,
                                                                                                  max_steps=3)])
    evaluate = module.evaluate

    def fails_once(specs, record=False):
        if [s.name for s in specs] == ["b"] and not getattr(fails_once, "failed", False):
            fails_once.failed = True
            raise RuntimeError("out of memory, say")
        return evaluate(specs, record)

    monkeypatch.setattr(module, "evaluate", fails_once)
    dm = small_dm()
    with pytest.warns(UserWarning, match="fit stopped by RuntimeError"), pytest.raises(RuntimeError, match="say"):
        L.Trainer(**trainer_kwargs).fit(module, dm)
    b = module.registry["b"]
    assert (b.state, b.step) == (AdapterState.RUNNING, 3)
    tokens = b.tokens_seen
    L.Trainer(**trainer_kwargs).fit(module, dm)
    assert (b.state, b.step, b.tokens_seen, b.exported_step) == (AdapterState.FINISHED, 3, tokens, 3)
    assert b.val_losses and b.val_losses[-1][0] == 3 and module.registry["a"].step == 5


def test_a_resume_with_another_optimizer_or_its_settings_says_what_it_keeps(tmp_path, trainer_kwargs):
    """A resume with another optimizer class (AdamW -> SGD with momentum) failed at its first step with a bare
    ``KeyError: 'momentum'`` (the groups were the checkpoint's AdamW ones); other settings of the same optimizer were
    left for the checkpoint's, silently."""
    specs = [AdapterSpec("a", rank=2, max_steps=6)]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False), small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    for kwargs, message in [
        (dict(optimizer="torch.optim.SGD", optimizer_kwargs={"momentum": 0.9}),
         r"the checkpoint's optimizer state is AdamW's, and the optimizer now is SGD: every adapter's optimizer "
         r"state starts fresh"),
        (dict(optimizer_kwargs={"betas": (0.8, 0.99)}),
         r"the optimizer's settings differ from the checkpoint's \(betas: \(0.9, 0.999\) -> \(0.8, 0.99\)\): the "
         r"adapters go on with the checkpoint's"),
    ]:
        module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False, **kwargs)
        with pytest.warns(UserWarning, match=message):
            L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))
        assert module.registry["a"].state == AdapterState.FINISHED and module.registry["a"].step == 6
    # (Adam's state resumed by AdamW: said to go on with the checkpoint's L2 decay; AdamW decouples it as it loads)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", adapters=specs, optimizer="torch.optim.Adam", validate_on_finish=False),
                small_dm())
    trainer.save_checkpoint(tmp_path / "adam.ckpt")
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 3})
    with pytest.warns(UserWarning, match=r"\(decoupled_weight_decay: False -> True\): the adapters go on with the "
                                         r"optimizer's, which AdamW sets as it loads a state"):
        trainer.fit(module, small_dm(), ckpt_path=str(tmp_path / "adam.ckpt"))


def test_a_resume_names_a_quantized_bases_compute_dtype_and_an_8bit_base(tmp_path, trainer_kwargs):
    """A 4-bit base's identity named its type alone (nf4 computing in bfloat16 resumed in float32: silent), an 8-bit
    base's the dtype of its other weights (as a float32 base's). A checkpoint that named the type alone still resumes
    on that type silently."""
    pytest.importorskip("bitsandbytes")
    a = AdapterSpec("a", rank=2, max_steps=4)
    kwargs = dict(adapters=[a], validate_on_finish=False, quantization="nf4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a 4-bit base on the CPU)
        first = MultiLoRAModule("tiny-llama", dtype="bfloat16", **kwargs)
        assert first._base_identity()["weights"] == "nf4 computing in bfloat16"
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
        trainer.fit(first, small_dm())
        trainer.save_checkpoint(tmp_path / "c.ckpt")
        resumed = MultiLoRAModule("tiny-llama", dtype="float32", **kwargs)
    with pytest.warns(UserWarning, match=r"held as nf4 computing in bfloat16 and resume on it held as nf4 computing "
                                         r"in float32"):
        L.Trainer(**trainer_kwargs).fit(resumed, small_dm(), ckpt_path=str(tmp_path / "c.ckpt"))
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=False)
    checkpoint["multilora"]["base"]["weights"] = "nf4"  # (as a checkpoint written before named it)
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = MultiLoRAModule("tiny-llama", dtype="bfloat16", **kwargs)
        L.Trainer(**trainer_kwargs).fit(again, small_dm(), ckpt_path=str(tmp_path / "old.ckpt"))
    assert not [w for w in caught if "held as" in str(w.message)] and again.registry["a"].step == 4
    from transformers import BitsAndBytesConfig

    from lightning_multilora.base_model import build_base_model

    def int8():
        model = build_base_model("tiny-llama", quantization=None)
        model.config.quantization_config = BitsAndBytesConfig(load_in_8bit=True)  # (how transformers marks one)
        return model

    module = MultiLoRAModule(int8(), adapters=[a], validate_on_finish=False)
    assert module._base_identity()["weights"] == "int8 beside float32"
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "int8.ckpt")
    checkpoint = torch.load(tmp_path / "int8.ckpt", weights_only=False)
    checkpoint["multilora"]["base"]["weights"] = "float32"  # (as a checkpoint written before named an 8-bit base)
    torch.save(checkpoint, tmp_path / "int8.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(MultiLoRAModule(int8(), adapters=[a], validate_on_finish=False), small_dm(),
                                        ckpt_path=str(tmp_path / "int8.ckpt"))
    assert not [w for w in caught if "held as" in str(w.message)]


def test_a_resume_tells_bitsandbytes_optimizers_apart_by_their_state(tmp_path, trainer_kwargs):
    """bitsandbytes' AdamW and torch's share a class name, and every bitsandbytes optimizer generic bases
    (Optimizer8bit): torch's AdamW -> bitsandbytes' AdamW failed at the first step (KeyError: 'state1'), AdamW8bit ->
    Lion8bit went on with AdamW's moments as Lion's. Those start fresh, with a warning; states alike go on (a paged
    optimizer's and its unpaged twin's; a checkpoint that named its classes without their modules)."""
    pytest.importorskip("bitsandbytes")
    specs = [AdapterSpec("a", rank=2, max_steps=6)]

    def saved(optimizer, name, classes=None):
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
        trainer.fit(MultiLoRAModule("tiny-llama", adapters=specs, optimizer=optimizer, validate_on_finish=False),
                    small_dm())
        trainer.save_checkpoint(tmp_path / name)
        if classes is not None:  # (as an older checkpoint names them)
            checkpoint = torch.load(tmp_path / name, weights_only=False)
            checkpoint["multilora"]["optimizer_classes"] = classes
            torch.save(checkpoint, tmp_path / name)
        return str(tmp_path / name)

    def resumed(optimizer, path):
        module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer=optimizer, validate_on_finish=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=path)
        assert module.registry["a"].state == AdapterState.FINISHED and module.registry["a"].step == 6
        return [str(w.message) for w in caught if "optimizer state starts fresh" in str(w.message)]

    torch_adamw, bnb_adamw = saved("torch.optim.AdamW", "torch.ckpt"), saved("bitsandbytes.optim.AdamW", "bnb.ckpt")
    assert resumed("bitsandbytes.optim.AdamW", torch_adamw) == [
        "the checkpoint's optimizer state is AdamW's, and the optimizer now is bitsandbytes.AdamW: every adapter's "
        "optimizer state starts fresh"]
    assert resumed("torch.optim.AdamW", bnb_adamw)
    adamw8 = saved("bitsandbytes.optim.AdamW8bit", "adamw8.ckpt")
    assert resumed("bitsandbytes.optim.Lion8bit", adamw8) and resumed("bitsandbytes.optim.AdamW", adamw8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*paged.*", category=UserWarning)  # (no paging on the CPU)
        assert resumed("bitsandbytes.optim.PagedAdamW8bit", adamw8) == []
    assert resumed("torch.optim.AdamW", saved("torch.optim.AdamW", "old.ckpt", ["AdamW", "Adam"])) == []
    from lightning_multilora.module import _states_alike

    # one's own optimizer, saved from a script (its module __main__) and resumed where it is imported: alike
    assert _states_alike(["__main__:SignSGD"], ["myopt:SignSGD"])
    assert not _states_alike(["torch.optim.adamw:AdamW"], ["bitsandbytes.optim.adamw:AdamW", "bitsandbytes:adam "
                                                                                              "32-bit state"])


def test_a_resume_names_queued_adapters_no_longer_given_and_running_ones_over_the_cap(tmp_path, trainer_kwargs):
    """A checkpoint's queued adapter left out of the adapters given now still trained, and a lower `max_running`
    left the checkpoint's running adapters over it; neither was said."""
    specs = [AdapterSpec(n, rank=2, max_steps=4, seed=i) for i, n in enumerate("abc")]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", adapters=specs, max_running=2, validate_on_finish=False), small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    module = MultiLoRAModule("tiny-llama", adapters=specs[:2], max_running=1, validate_on_finish=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))
    said = " | ".join(str(w.message) for w in seen)
    assert "adapters queued in the checkpoint and not given now still start: ['c']" in said
    assert "running or paused in the checkpoint and not given now go on" not in said
    assert "the checkpoint has 2 adapters running (['a', 'b']), over `max_running`=1: they go on" in said
    assert all(module.registry[n].state == AdapterState.FINISHED for n in "abc")


def test_a_resume_on_a_base_of_the_same_architecture_loaded_from_elsewhere_is_warned_of(tmp_path, trainer_kwargs):
    """(Another model of the same sizes, say an instruct model beside its base, resumed the adapters silently.)"""
    for seed in (0, 1):
        MultiLoRAModule("tiny-llama", base_seed=seed).model.save_pretrained(tmp_path / f"base{seed}")
    specs = [AdapterSpec("a", rank=2, max_steps=4)]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule(str(tmp_path / "base0"), adapters=specs, validate_on_finish=False), small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    for seed, warned, dtype in ((0, False, "float32"), (1, True, "float32"), (1, True, "bfloat16")):
        module = MultiLoRAModule(str(tmp_path / f"base{seed}"), adapters=specs, validate_on_finish=False, dtype=dtype)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))
        said = [str(w.message) for w in seen if "were trained on the base loaded from" in str(w.message)]
        assert len(said) == warned and (not warned or f"{str(tmp_path / 'base1')!r}" in said[0])
        assert module.registry["a"].state == AdapterState.FINISHED


def test_a_project_moved_with_its_relative_base_path_resumes_unwarned(tmp_path, trainer_kwargs, monkeypatch):
    """A base named by a relative path is held by its absolute one (its exports name it so, for PEFT to load from
    anywhere): a checkpoint compared that, and a project moved with its `base_model: models/base` was warned of as
    another base. The path as given is what a checkpoint keeps."""
    import shutil

    MultiLoRAModule("tiny-llama").model.save_pretrained(tmp_path / "p1" / "models" / "base")
    monkeypatch.chdir(tmp_path / "p1")
    specs = [AdapterSpec("a", rank=2, max_steps=4)]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("models/base", adapters=specs, validate_on_finish=False), small_dm())
    trainer.save_checkpoint(tmp_path / "p1" / "stop.ckpt")
    shutil.copytree(tmp_path / "p1", tmp_path / "p2")
    monkeypatch.chdir(tmp_path / "p2")
    module = MultiLoRAModule("models/base", adapters=specs, validate_on_finish=False)
    assert module.model.config.name_or_path == str(tmp_path / "p2" / "models" / "base")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path="stop.ckpt")
    assert not [w for w in seen if "were trained on the base loaded from" in str(w.message)]
    assert module.registry["a"].state == AdapterState.FINISHED


def test_a_resume_on_a_built_in_base_of_another_seed_or_overrides_is_warned_of(tmp_path, trainer_kwargs):
    """A built-in base's `base_seed` makes its weights, and `config_overrides` (`rope_theta`...) its numbers: a
    resume with others went on from another base's outputs, unsaid. An override restating the config's own value
    changes nothing, and is not said."""
    specs = [AdapterSpec("a", rank=2, max_steps=4)]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False), small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    for given, said_as in (({}, None), ({"config_overrides": {"max_position_embeddings": 256}}, None),  # (its own)
                           ({"base_seed": 1}, "built with base_seed=0, and resume on one built with "
                                                           "base_seed=1"),
                           ({"config_overrides": {"rope_theta": 1.0}}, 'config_overrides={}, and resume on one built '
                                                                       'with config_overrides={"rope_theta": 1}')):
        module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False, **given)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))
        said = [str(w.message) for w in seen if "were trained on a base built with" in str(w.message)]
        assert said == [] if said_as is None else len(said) == 1 and said_as in said[0], said
        assert module.registry["a"].state == AdapterState.FINISHED


def test_a_resume_names_running_adapters_no_longer_given(tmp_path, trainer_kwargs):
    """(A queued adapter left out was named; a running one trained on to its end, unsaid.)"""
    specs = [AdapterSpec(n, rank=2, max_steps=4, seed=i) for i, n in enumerate("ab")]
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    first = MultiLoRAModule("tiny-llama", adapters=specs[:1], validate_on_finish=False)
    first.add_adapter(specs[1])
    trainer.fit(first, small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    with warnings.catch_warnings():  # (a load is given the run's own adapters: nothing to say)
        warnings.filterwarnings("error", message=".*not given now")
        MultiLoRAModule.load_from_checkpoint(tmp_path / "stop.ckpt")
    module = MultiLoRAModule("tiny-llama", adapters=specs[:1], validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapters running or paused in the checkpoint and not given now go on: "
                                         r"\['b'\] \(a resume keeps the checkpoint's adapters; "
                                         r"`module.remove_adapter\(name\)`"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))
    assert module.registry["b"].state == AdapterState.FINISHED
    # removed before the resume (given, then removed): the checkpoint's adapter went on, unsaid
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    module.remove_adapter("b", reason="not wanted")
    with pytest.warns(UserWarning, match=r"adapters removed before this resume are 'b' running in its checkpoint, "
                                         r"and go on \(a resume keeps the checkpoint's adapters; "
                                         r"`module.remove_adapter\(name\)` after the resume starts"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm(), ckpt_path=str(tmp_path / "stop.ckpt"))


def test_validate_says_why_it_measures_nothing_and_a_loaded_checkpoint_is_held(tmp_path, trainer_kwargs):
    """``trainer.validate`` before any fit said the adapters "ended and were exported" (they were queued); with a
    module from ``load_from_checkpoint`` (or a ``ckpt_path``) it said the module held none, then measured both; and
    ``load_from_checkpoint`` listed every frozen base weight as missing from the checkpoint."""
    specs = [AdapterSpec("a", rank=2, max_steps=6), AdapterSpec("b", rank=2, max_steps=6, seed=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"holds none: its adapters have not started \(\['a', 'b'\]: they start in "):
        L.Trainer(**trainer_kwargs).validate(module, small_dm())
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    expected = module.evaluate(["a", "b"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "stop.ckpt")
        (from_loaded,) = L.Trainer(**trainer_kwargs).validate(loaded, small_dm())
        (from_path,) = L.Trainer(**trainer_kwargs).validate(MultiLoRAModule("tiny-llama"), small_dm(),
                                                            ckpt_path=str(tmp_path / "stop.ckpt"))
    said = [str(w.message) for w in seen]
    assert not [m for m in said if "holds none" in m or "not in the checkpoint" in m], said
    for results in (from_loaded, from_path):
        assert results == pytest.approx({f"adapters/{n}/val_loss": expected[n] for n in "ab"}, rel=1e-5)


def test_a_fit_into_another_runs_log_directory_is_warned_of(tmp_path, trainer_kwargs):
    """``multilora fit`` refuses a log directory holding another run's summary or study; from Python the new run's
    report replaced the other's and a default OptunaSweep went on with its study, silently. The same module fitted
    again, or a resume, writes its own."""
    from lightning_multilora import SweepReport

    def fit(module, **kwargs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs, callbacks=[SweepReport(tensorboard=False, print_table=False)]).fit(
                module, small_dm(), **kwargs)
        return [str(w.message) for w in seen if "another run's" in str(w.message)]

    first = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)], validate_on_finish=False)
    assert fit(first) == []
    first.add_adapter(AdapterSpec("b", rank=2, max_steps=2))
    assert fit(first) == []  # (its own summary)
    before = (tmp_path / "sweep_summary.json").read_text()
    (said,) = fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("c", rank=2, max_steps=2)]))
    assert said == (f"SweepReport: {tmp_path / 'sweep_summary.json'} is another run's summary; it is kept, and this "
                    f"run's is {tmp_path / 'sweep_summary-v1.json'}")
    assert (tmp_path / "sweep_summary.json").read_text() == before  # kept; this run's beside it
    assert [row["adapter"] for row in json.loads((tmp_path / "sweep_summary-v1.json").read_text())] == ["c"]


def test_a_module_loaded_from_its_checkpoint_writes_over_its_own_summary(tmp_path, trainer_kwargs):
    """`load_from_checkpoint` and a fit go on as the resume from that checkpoint does: its summary was taken for
    another run's, kept stale (adapters "running") with the run's own written beside it, under a warning."""
    from lightning_multilora import SweepReport

    def trainer(**kwargs):
        return L.Trainer(**{**trainer_kwargs, **kwargs}, callbacks=[SweepReport(tensorboard=False, print_table=False)])

    first = trainer(max_steps=2)
    first.fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4)], validate_on_finish=False),
              small_dm())
    first.save_checkpoint(tmp_path / "stop.ckpt")
    assert [row["status"] for row in json.loads((tmp_path / "sweep_summary.json").read_text())] == ["running"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer().fit(MultiLoRAModule.load_from_checkpoint(tmp_path / "stop.ckpt"), small_dm())
    assert not [str(w.message) for w in seen if "another run's" in str(w.message)]
    assert not (tmp_path / "sweep_summary-v1.json").exists()
    assert [row["status"] for row in json.loads((tmp_path / "sweep_summary.json").read_text())] == ["finished"]


def _fit_reported(trainer_kwargs, module, max_steps=-1, **kwargs):
    """A fit with a `SweepReport` (no table, no TensorBoard): its Trainer and the warnings about summaries."""
    from lightning_multilora import SweepReport

    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps},
                        callbacks=[SweepReport(tensorboard=False, print_table=False)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, small_dm(), **kwargs)
    return trainer, [str(w.message) for w in seen if "summary" in str(w.message)]


def test_a_resume_and_a_refit_write_their_own_summary_beside_another_runs(tmp_path, trainer_kwargs):
    """A run that wrote `sweep_summary-v1.json` beside another run's: its resume (its checkpoint taken before it
    reported) and a second fit of its module wrote over the other run's `sweep_summary.json`, leaving their own
    stale. They write their own files."""
    from lightning_multilora import SweepReport

    def fit(module, **kwargs):
        return _fit_reported(trainer_kwargs, module, **kwargs)

    def steps(name):
        return [row["steps"] for row in json.loads((tmp_path / name).read_text())]

    fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)], validate_on_finish=False))
    before = (tmp_path / "sweep_summary.json").read_text()

    class SaveAtStart(Callback):  # (a checkpoint of this run taken before it reports: ModelCheckpoint's)
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 1:
                trainer.save_checkpoint(tmp_path / "b.ckpt")

    second = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("b", rank=2, max_steps=3)], validate_on_finish=False)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2},
                        callbacks=[SaveAtStart(), SweepReport(tensorboard=False, print_table=False)])
    with pytest.warns(UserWarning, match="another run's summary"):
        trainer.fit(second, small_dm())
    assert steps("sweep_summary-v1.json") == [2]
    assert fit(MultiLoRAModule("tiny-llama"), ckpt_path=str(tmp_path / "b.ckpt"))[1] == []  # (the resume)
    assert steps("sweep_summary-v1.json") == [3]
    # a second fit of the module goes on from where it stopped, beside the resume of its checkpoint (which ran to
    # its end): another branch of the run, whose summary is kept, as its exports are
    second.add_adapter(AdapterSpec("c", rank=2, max_steps=1))
    said = fit(second)[1]
    assert any("sweep_summary-v1.json is another resume's summary of this run" in m for m in said), said
    assert steps("sweep_summary-v1.json") == [3]
    assert sorted(row["adapter"] for row in json.loads((tmp_path / "sweep_summary-v2.json").read_text())) == ["b", "c"]
    assert (tmp_path / "sweep_summary.json").read_text() == before


def test_a_second_resume_of_one_checkpoint_keeps_the_summary_the_first_ended_with(tmp_path, trainer_kwargs):
    """Two resumes of one checkpoint into one log directory (no logger): the second wrote over the summary of the
    first, which had run to its end (its exports are kept, `-v1`). A resume of an attempt that stopped (an error, a
    Ctrl+C) still writes on in the file."""
    def fit(module, **kwargs):
        return _fit_reported(trainer_kwargs, module, **kwargs)

    def rows(name):
        return [(row["status"], row["steps"]) for row in json.loads((tmp_path / name).read_text())]

    trainer, _ = fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=6)],
                                     validate_on_finish=False), max_steps=3)
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    fit(MultiLoRAModule("tiny-llama"), ckpt_path=str(tmp_path / "three.ckpt"))  # (to its end)
    assert rows("sweep_summary.json") == [("finished", 6)]
    _, said = fit(MultiLoRAModule("tiny-llama"), max_steps=4, ckpt_path=str(tmp_path / "three.ckpt"))
    assert rows("sweep_summary.json") == [("finished", 6)]
    assert rows("sweep_summary-v1.json") == [("running", 4)]
    assert any("another resume's summary" in m for m in said), said


def test_a_summary_another_run_writes_while_this_one_trains_is_kept(tmp_path, trainer_kwargs):
    """Two runs started together in one directory (no logger): the one reporting last replaced the other's summary,
    silently (the other's file was not there yet as it began)."""
    from lightning_multilora import SweepReport

    class OtherRunReports(Callback):
        def on_train_start(self, trainer, pl_module):
            (tmp_path / "sweep_summary.json").write_text('[{"adapter": "other"}]')

    with pytest.warns(UserWarning, match=r"sweep_summary.json is another run's summary; it is kept, and this run's "
                                         r"is .*sweep_summary-v1.json"):
        L.Trainer(**trainer_kwargs, callbacks=[OtherRunReports(), SweepReport(tensorboard=False, print_table=False)]
                  ).fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)],
                                        validate_on_finish=False), small_dm())
    assert json.loads((tmp_path / "sweep_summary.json").read_text()) == [{"adapter": "other"}]
    assert [row["adapter"] for row in json.loads((tmp_path / "sweep_summary-v1.json").read_text())] == ["a"]


def test_the_learning_rate_monitor_reads_the_rate_each_step_takes(tmp_path, trainer_kwargs):
    """LearningRateMonitor reads the param groups as a batch starts: they held the last step's rate (one step late),
    and an adapter's first point was its peak rate in the middle of its warmup. Each point is now the rate the
    module logs for that step (`adapters/<name>/lr`), for an adapter admitted mid-run too."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    specs = [AdapterSpec("a", rank=2, max_steps=5, lr=3e-3, lr_schedule="cosine", warmup_steps=2),
             AdapterSpec("b", rank=2, max_steps=3, lr=1e-3, warmup_steps=2)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=1, validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "log_every_n_steps": 1, "logger": CSVLogger(tmp_path, name="csv")},
              callbacks=[LearningRateMonitor()]).fit(module, small_dm())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    for name, steps in (("a", range(0, 5)), ("b", range(5, 8))):
        monitored = {int(r["step"]): float(r[f"lr-AdamW/adapters/{name}"]) for r in rows
                     if r[f"lr-AdamW/adapters/{name}"]}
        logged = {int(r["step"]): float(r[f"adapters/{name}/lr"]) for r in rows if r[f"adapters/{name}/lr"]}
        assert sorted(logged) == list(steps) and monitored == logged, (name, monitored, logged)
        assert logged[steps[0]] == 0.0 and logged[steps[2]] == module.registry[name].spec.lr  # (warmup, then peak)


def test_a_data_parallel_strategy_is_refused_in_our_words(trainer_kwargs):
    """DDP over one process failed in PyTorch's words ("DistributedDataParallel is not needed when a module doesn't
    have any parameter that requires a gradient"), under a traceback; the adapter-parallel strategy is named."""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.raises(UsageError, match=r"`strategy`: MultiLoRAModule trains in one process, or over several with "
                                         r"strategy='adapter_parallel' .*got DDPStrategy over 1 process: leave the "
                                         r"strategy out"):
        L.Trainer(**{**trainer_kwargs, "strategy": "ddp"}).fit(module, small_dm())
    assert module.registry["a"].step == 0


def test_a_data_parallel_strategy_over_several_processes_is_told_of_devices_1():
    """Lightning's default devices='auto' on a machine of several GPUs starts a DDP process on each: the refusal says
    `Trainer(devices=1)`."""
    import types

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_multilora.module import _refuse_strategy

    with pytest.raises(UsageError, match=r"got DDPStrategy over 8 processes: give `Trainer\(devices=1\)` \(Lightning's "
                                         r"default, devices='auto', takes every GPU of the machine, a process on each\)"
                                         r", or strategy='adapter_parallel' to split the adapters over them"):
        _refuse_strategy(types.SimpleNamespace(strategy=DDPStrategy(), world_size=8))


def test_a_time_interval_validates_by_the_clock(tmp_path, trainer_kwargs):
    """Lightning's time-based `val_check_interval` (a timedelta, or "DD:HH:MM:SS") leaves the Trainer's
    ``val_check_interval`` unset: the fit's option check read it and raised an AttributeError before the first step.
    It validates by the clock, also in the run's endless epoch."""
    import datetime

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=2, max_steps=4)],
                             export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "val_check_interval": datetime.timedelta(microseconds=1)}).fit(module, small_dm())
    assert module.registry["a"].state == AdapterState.FINISHED
    assert [step for step, _ in module.registry["a"].val_losses][:3] == [1, 2, 3]


class _InterruptIn(Callback):
    """Ctrl+C inside a step, at global step ``step``: in its forward (before the backward), after its backward (at
    the step's one sync of the losses, where the host waits for the device: the token count's `segment_sum`, the
    integer one), or in the optimizer's step (a step pre-hook of the optimizer: raised there, or a SIGINT sent)."""

    def __init__(self, step: int, where: str):
        self.step, self.where = step, where

    def on_train_start(self, trainer, pl_module):
        def pre_hook(optimizer, args, kwargs):
            if trainer.global_step == self.step:
                raise KeyboardInterrupt

        if self.where == "optimizer_step":
            trainer.optimizers[0].register_step_pre_hook(pre_hook)
        if self.where in ("sigint_in_optimizer_step", "sigterm_in_optimizer_step"):  # (a signal: held until the
            import os  # step is taken and counted)
            import signal

            def signalled(optimizer, args, kwargs):
                if trainer.global_step == self.step:
                    os.kill(os.getpid(), signal.SIGINT if self.where.startswith("sigint") else signal.SIGTERM)

            trainer.optimizers[0].register_step_pre_hook(signalled)
        if self.where == "after_backward":
            import lightning_multilora.module as module_file

            real = module_file.segment_sum

            def interrupted(values, layout):
                if trainer.global_step == self.step and not values.is_floating_point():
                    module_file.segment_sum = real
                    raise KeyboardInterrupt
                return real(values, layout)

            module_file.segment_sum = interrupted

    def on_before_backward(self, trainer, pl_module, loss):
        if self.where == "forward" and trainer.global_step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize("epochs", [False, True])
def test_a_resume_from_a_checkpoint_written_before_its_steps_validation_runs_that_validation(tmp_path,
                                                                                             trainer_kwargs, epochs):
    """`ModelCheckpoint(every_n_train_steps=4)` writes in step 4's ``on_train_batch_end``, before its validation
    (`val_check_interval=4`): Lightning's resume took that validation for done, and the resumed run never measured
    step 4 (a best there lost, EarlyExit and a pruner not asked). It runs, logged at the uninterrupted run's step; and
    none runs where none was due (``epochs``: a checkpoint at an epoch's last batch, step 6 of 6-batch epochs)."""
    import csv

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    every, crash = (6, 8) if epochs else (4, 6)
    over = {"limit_train_batches": 6, "check_val_every_n_epoch": 1, "max_epochs": -1} if epochs else {}

    class Crash(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == crash:
                raise RuntimeError("node lost")

    def run(name, callbacks=(), ckpt=None):
        module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=2, max_steps=12,
                                                                     lr=3e-3)], export_dir=str(tmp_path / name))
        logger = CSVLogger(tmp_path / name, name="csv", version=1 if ckpt else 0)
        trainer = L.Trainer(**{**trainer_kwargs, "val_check_interval": 4, "logger": logger, "log_every_n_steps": 1,
                               "enable_checkpointing": bool(callbacks), **over}, callbacks=list(callbacks))
        try:
            trainer.fit(module, small_dm(), ckpt_path=ckpt)
        except RuntimeError:
            pass
        with open(logger.log_dir + "/metrics.csv") as f:
            steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("adapters/a/val_loss")]
        return module.registry["a"], steps

    full, full_steps = run("full")
    run("stopped", [Crash(), ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=every, save_top_k=-1,
                                             filename="{step}")])
    resumed, steps = run("stopped", ckpt=str(tmp_path / "ck" / f"step={every}.ckpt"))
    assert [s for s, _ in full.val_losses] == ([4, 10, 12] if epochs else [4, 8, 12])
    assert [s for s, _ in resumed.val_losses] == [s for s, _ in full.val_losses]
    assert [v for _, v in resumed.val_losses] == pytest.approx([v for _, v in full.val_losses], rel=1e-6)
    assert resumed.train_losses == full.train_losses and steps == [s for s in full_steps if s >= every - 1]


def _trained_alike(once: MultiLoRAModule, twice: MultiLoRAModule, names: str) -> None:
    """The adapters ``names`` of a run stopped and fitted again (``twice``) trained as those of the run not stopped."""
    for name in names:
        assert twice.registry[name].train_losses == once.registry[name].train_losses
        assert twice.registry[name].tokens_seen == once.registry[name].tokens_seen
        ours = load_file(Path(twice.registry[name].export_path) / "adapter_model.safetensors")
        for key, value in load_file(Path(once.registry[name].export_path) / "adapter_model.safetensors").items():
            torch.testing.assert_close(ours[key], value, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("where", ["forward", "after_backward", "optimizer_step"])
def test_a_ctrl_c_inside_a_step_then_another_fit_trains_that_step_again(tmp_path, trainer_kwargs, where):
    """The batch in flight had advanced its adapters' data positions: a checkpoint (OnExceptionCheckpoint) or another
    fit after a Ctrl+C in the forward or backward skipped it. A Ctrl+C inside the optimizer's step had counted the
    step (the export stamped a step its weights had not taken) and advanced the dropout masks: the next fit lost an
    update. Both now go on as the run that was not stopped."""
    import signal

    def run(stop: bool) -> MultiLoRAModule:
        module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / f"{where}{stop}"),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=5, lr=1e-2, dropout=0.1, seed=1),
                                           AdapterSpec("b", rank=2, max_steps=5, lr=3e-3, batch_size=3, seed=2)])
        dm = small_dm()
        if stop:
            with pytest.warns(UserWarning, match="fit stopped by KeyboardInterrupt"), pytest.raises(SystemExit):
                L.Trainer(**trainer_kwargs, callbacks=[_InterruptIn(2, where)]).fit(module, dm)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # (as Lightning's shutdown left it)
            assert [module.registry[n].step for n in "ab"] == [2, 2] and module.registry["a"].exported_step == 2
        L.Trainer(**trainer_kwargs).fit(module, dm)
        return module

    _trained_alike(run(False), run(True), "ab")


@pytest.mark.parametrize("how", ["error", "sigint", "bitsandbytes"])
def test_an_optimizer_step_stopped_between_adapters_counts_those_it_updated(tmp_path, trainer_kwargs, monkeypatch,
                                                                           how):
    """torch's optimizers update the adapters' groups one after another: an error there (out of memory as a new
    adapter's state is made) after adapter a's group, before b's, left a's weights and moments a step ahead of its
    count, and the next fit took that batch again for both (a updated twice by it). A Ctrl+C arriving there is held
    until the step is taken and counted (the step whole, with any optimizer); an error counts a, and b takes the step
    again. Either way the next fit ends as the run that was not stopped. (bitsandbytes' 8-bit AdamW writes the weights
    through their addresses: its step counts tell.)"""
    import os
    import signal

    import torch.optim.adam as adam_file

    real = adam_file.adam
    if how == "bitsandbytes":
        pytest.importorskip("bitsandbytes")

    class StopBetweenGroups(Callback):
        def on_train_start(self, trainer, pl_module):
            b = pl_module.lora_layers.step_parameters("b")[0]
            if how == "bitsandbytes":
                optimizer = pl_module.optimizers().optimizer
                update = optimizer.update_step

                def update_step(group, p, *args):
                    if trainer.global_step == 2 and group.get("adapter") == "b":
                        monkeypatch.setattr(optimizer, "update_step", update)
                        raise torch.OutOfMemoryError("out of memory (simulated)")
                    return update(group, p, *args)

                monkeypatch.setattr(optimizer, "update_step", update_step)

            def adam(params, *args, **kwargs):
                if trainer.global_step == 2 and params and params[0] is b:
                    monkeypatch.setattr(adam_file, "adam", real)
                    if how == "error":
                        raise torch.OutOfMemoryError("out of memory (simulated)")
                    os.kill(os.getpid(), signal.SIGINT)
                return real(params, *args, **kwargs)

            monkeypatch.setattr(adam_file, "adam", adam)

    def run(stop: bool) -> MultiLoRAModule:
        module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / f"{how}{stop}"),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=5, lr=1e-2, dropout=0.1, seed=1),
                                           AdapterSpec("b", rank=2, max_steps=5, lr=3e-3, batch_size=3, seed=2)],
                                 **({"optimizer": "bitsandbytes.optim.AdamW8bit"} if how == "bitsandbytes" else {}))
        dm = small_dm()
        if stop:
            stopped = pytest.raises(SystemExit if how == "sigint" else torch.OutOfMemoryError)
            with pytest.warns(UserWarning) as said, stopped:
                L.Trainer(**trainer_kwargs, callbacks=[StopBetweenGroups()]).fit(module, dm)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # (as Lightning's shutdown left it)
            said = [str(w.message) for w in said]
            taken = [3, 3] if how == "sigint" else [3, 2]
            assert [module.registry[n].step for n in "ab"] == taken
            assert [module.registry[n].exported_step for n in "ab"] == taken
            assert (how != "sigint") == any("the optimizer's step stopped after it updated adapters ['a']: they are "
                                           "counted as having taken step 3 (the others take it again)" in m
                                           for m in said), said
        L.Trainer(**trainer_kwargs).fit(module, dm)
        return module

    _trained_alike(run(False), run(True), "ab")


class _ValidatedAt(Callback):
    def __init__(self):
        self.steps = []

    def on_validation_start(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


class _SaveAsAdapterExits(Callback):
    """Writes a checkpoint as an adapter exits: inside the step, after its optimizer step (a finishing adapter's
    validation and export run there)."""

    def __init__(self, path):
        self.path = path

    def on_adapter_exit(self, trainer, pl_module, rec):
        if not self.path.exists():  # (the first exit's)
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("where", ["forward", "optimizer_step", "adapter_exit", "sigint_in_optimizer_step",
                                   "sigint_before_validation", "sigterm_before_validation"])
def test_a_resume_of_a_checkpoint_written_by_a_ctrl_c_inside_a_step_validates_at_the_runs_steps(
        tmp_path, trainer_kwargs, where):
    """Lightning counted the batch in flight as begun: resumed from `OnExceptionCheckpoint`'s file, it validated one
    step early from then on (steps 4, 7, 10 for 3, 6, 9), other losses and other `EarlyExit` decisions. A checkpoint
    written after the step's optimizer step (an adapter exiting) has the step taken: it resumes as it was. A Ctrl+C
    (SIGINT) inside the optimizer's step is held until the step is taken: the checkpoint has it taken, and, where the
    step is one the run validates at (3), its validation was lost (raised inside the step, the batch unfinished); so
    was it by a SIGTERM handler of one's own that exits (a cluster script's `sys.exit(143)`)."""
    import signal
    import sys

    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    def run(callbacks, ckpt=None):
        module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "e"),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=10, lr=1e-2, seed=1),
                                           AdapterSpec("b", rank=2, max_steps=5, lr=1e-2, seed=2)])
        at = _ValidatedAt()
        kwargs = {**trainer_kwargs, "val_check_interval": 3, "enable_checkpointing": True}
        L.Trainer(**kwargs, callbacks=[at, *callbacks]).fit(module, small_dm(), ckpt_path=ckpt)
        return at.steps, module.registry["a"].val_losses

    once = run([])
    assert once[0][:3] == [3, 6, 9]
    if where == "adapter_exit":  # ('b' ends in step 5: the checkpoint's step counts 5, its batches processed 4)
        run([_SaveAsAdapterExits(tmp_path / "stopped.ckpt")])
        after = 5
    else:
        at = {"sigint_in_optimizer_step": 3}.get(where, 2 if where.endswith("before_validation") else 4)  # (steps
        kind = {"sigint": "sigint_in_optimizer_step", "sigterm": "sigterm_in_optimizer_step"}.get(  # done)
            where.split("_")[0], where)
        signalled = where.startswith(("sigint", "sigterm"))
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # (a cluster script's)
        try:
            with pytest.warns(UserWarning, match="fit stopped by (KeyboardInterrupt|SystemExit)"), \
                    pytest.raises(SystemExit):
                run([_InterruptIn(at, kind), OnExceptionCheckpoint(str(tmp_path), filename="stopped")])
        finally:
            signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (as Lightning's shutdown left it)
        after = at + signalled  # (a signal's step is taken: its validation, if due, not yet run)
    resumed = run([], ckpt=str(tmp_path / "stopped.ckpt"))
    assert resumed[0] == [step for step in once[0] if step > after or (step == after and signalled)]
    assert not where.endswith("before_validation") or resumed[0][0] == 3
    assert [s for s, _ in resumed[1]] == [s for s, _ in once[1]]
    torch.testing.assert_close([v for _, v in resumed[1]], [v for _, v in once[1]], atol=1e-6, rtol=1e-5)


def test_a_loaded_checkpoint_validated_then_saved_again(tmp_path, trainer_kwargs):
    """(A TypeError: 'bool' object is not callable, the checkpoint's flag of a due validation set on the module under
    the name of the method that computes it.)"""
    module = MultiLoRAModule("tiny-llama", export_dir=str(tmp_path / "e"),
                             adapters=[AdapterSpec("a", rank=2, max_steps=10, lr=1e-2, seed=1)])
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "c.ckpt")
    again = L.Trainer(**trainer_kwargs)
    again.validate(loaded, small_dm())
    again.save_checkpoint(tmp_path / "again.ckpt")
    assert (tmp_path / "again.ckpt").is_file()


def test_a_resume_of_a_checkpoint_written_before_the_last_steps_validation_says_it_did_not_run(tmp_path,
                                                                                                trainer_kwargs):
    """Written in step 4's `on_train_batch_end` with `max_steps=4`: the resumed fit was done, trained nothing, and
    that step's validation, due, never ran, unsaid; a larger `max_steps` runs it and goes on."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, callbacks=(), ckpt=None):
        module = MultiLoRAModule("tiny-llama", export_dir=str(tmp_path / "e"),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=10, lr=1e-2, seed=1)])
        at = _ValidatedAt()
        kwargs = {**trainer_kwargs, "val_check_interval": 2, "enable_checkpointing": True, "max_steps": max_steps}
        L.Trainer(**kwargs, callbacks=[at, *callbacks]).fit(module, small_dm(), ckpt_path=ckpt)
        return at.steps, [s for s, _ in module.registry["a"].val_losses]

    saving = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, filename="four")
    assert run(4, [saving]) == ([2, 4], [2, 4])
    ckpt = str(tmp_path / "ck" / "four.ckpt")
    with pytest.warns(UserWarning, match=r"this fit resumed a checkpoint written at step 4 before that step's "
                                         r"validation, and the run was done there .* that validation did not run"):
        assert run(4, ckpt=ckpt) == ([], [2])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert run(6, ckpt=ckpt) == ([4, 6], [2, 4, 6])
    assert not [w for w in said if "that validation did not run" in str(w.message)]


def test_a_resume_of_a_checkpoint_at_the_trainers_end_says_it_trained_and_exported_nothing(tmp_path, trainer_kwargs):
    """A checkpoint of the run's last step resumed with the same `max_steps` (the CLI's `--ckpt_path last` run again):
    Lightning skips training and said only "`max_steps=4` reached"; the new log folder held no adapters, unsaid. The
    run's exports are named: the adapters' own paths where the checkpoint has them (written after the exports), else
    the checkpoint's run folder's `adapters` (a `ModelCheckpoint`'s, written in the last step)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt=None):
        module = MultiLoRAModule("tiny-llama", export_dir=str(tmp_path / ("run" if ckpt is None else "again") /
                                                              "adapters"),
                                 adapters=[AdapterSpec("a", rank=2, max_steps=10, lr=1e-2, seed=1),
                                           AdapterSpec("b", rank=2, max_steps=2, lr=1e-2, seed=2)])
        saving = ModelCheckpoint(dirpath=str(tmp_path / "run" / "checkpoints"), every_n_train_steps=4,
                                 filename="four")
        trainer = L.Trainer(**{**trainer_kwargs, "max_steps": max_steps, "enable_checkpointing": True},
                            callbacks=[saving] if ckpt is None else [])
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer.fit(module, small_dm(), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(tmp_path / "end.ckpt")
        return module, [str(w.message) for w in said if "it trained nothing" in str(w.message)]

    first, said = run(4)
    exported = first.registry["a"].export_path
    assert said == [] and exported == str(tmp_path / "run" / "adapters" / "a")
    tail = "); resume with a larger `max_steps` (or `max_epochs`) to train on"
    assert first.registry["b"].export_path is not None  # (ended before: not the resume's to name)
    named = f"'a' {exported}"  # (from the record of a checkpoint written after the exports, or the folder's)
    for ckpt in (tmp_path / "end.ckpt", tmp_path / "run" / "checkpoints" / "four.ckpt"):
        again, said = run(4, ckpt=str(ckpt))
        assert len(said) == 1 and said[0].startswith(
            "this fit resumed a checkpoint written at step 4, where the run was done (the Trainer's `max_steps` 4, "
            "`max_epochs` "), said
        assert said[0].endswith("it trained nothing and exported nothing (the adapters' exports are those the run "
                                f"wrote as it stopped: {named}{tail}"), said
        assert not (tmp_path / "again").exists()
    on, said = run(6, ckpt=str(tmp_path / "end.ckpt"))
    assert said == [] and on.registry["a"].step == 6 and (tmp_path / "again" / "adapters" / "a").is_dir()


def test_adapter_parallelism_with_fewer_adapters_than_ranks_is_warned_of(monkeypatch):
    """(A rank with no adapter ran idle forwards and backwards the whole run, unsaid.)"""
    from types import SimpleNamespace

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2)])
    monkeypatch.setattr(module, "_placement", lambda: SimpleNamespace(world_size=3))
    said = []
    for callbacks in ([], [SimpleNamespace(fill_slots=print)]):  # (a sweep asks more: not said)
        module._trainer = SimpleNamespace(lr_scheduler_configs=[], callbacks=callbacks)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module.on_train_start()
        said.append([str(w.message) for w in seen if "adapter parallelism over" in str(w.message)])
    assert [len(s) for s in said] == [1, 0]
    assert said[0][0].startswith("adapter parallelism over 3 ranks with 1 adapter to train: 2 rank(s) hold none")


@pytest.mark.parametrize("hook", ["on_validation_epoch_start", "on_train_end", "configure_callbacks"])
def test_a_hook_overridden_without_super_is_refused_by_name(trainer_kwargs, hook):
    """Lightning's own hooks do nothing, so an override seldom calls super(): a mixin module's then summed every
    validation's losses into the next (``on_validation_epoch_start``), exported nothing at a ``max_steps`` stop
    (``on_train_end``) or lost its exports after an error (``configure_callbacks``), silently."""
    bodies = {"on_validation_epoch_start": lambda self: None, "on_train_end": lambda self: None,
              "configure_callbacks": lambda self: []}
    Forgets = type("Forgets", (MultiLoRAModule,), {hook: bodies[hook]})
    module = Forgets("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4, batch_size=1)],
                     validate_on_finish=False)
    with pytest.raises(RuntimeError, match=rf"Forgets.{hook} did not call super\(\).{hook}\(...\): MultiLoRAMixin's "
                                           rf"{hook} does the run's work there"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 2, "val_check_interval": 1}).fit(module, small_dm())

    def calls_super(self):  # (the same override, calling super(): as before)
        out = getattr(super(Remembers, self), hook)()
        return out

    Remembers = type("Remembers", (MultiLoRAModule,), {hook: calls_super})
    module = Remembers("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4, batch_size=1)],
                       validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "max_steps": 2, "val_check_interval": 1}).fit(module, small_dm())
    assert module.registry["a"].step == 2 and len(module.registry["a"].val_losses) == 2
    if hook == "on_validation_epoch_start":  # (Lightning's idiom: the sanity check's skipped, loses nothing)
        def skips_the_sanity_check(self):
            if not self.trainer.sanity_checking:
                super(SkipsSanity, self).on_validation_epoch_start()

        SkipsSanity = type("SkipsSanity", (MultiLoRAModule,), {hook: skips_the_sanity_check})
        module = SkipsSanity("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2, batch_size=1)])
        L.Trainer(**{**trainer_kwargs, "num_sanity_val_steps": 1}).fit(module, small_dm())
        assert module.registry["a"].state == AdapterState.FINISHED


def test_a_loss_that_self_logs_runs_in_the_validation_of_held_adapters_at_a_stop(trainer_kwargs):
    """An `adapter_loss_terms` that calls ``self.log`` (as Lightning users log from their loss) failed the fit at a
    ``max_steps`` stop: the held adapters' last validation runs from ``on_train_end``, where Lightning refuses
    ``self.log``. Inside `evaluate` the calls are dropped; in the training step they log as before."""
    from lightning_multilora.base_model import build_base_model

    from lightning_multilora import MultiLoRAMixin

    class Mine(MultiLoRAMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_base_model("tiny-llama", {"num_hidden_layers": 1})
            self.init_multilora(self.model, adapters=[AdapterSpec("a", rank=2, max_steps=10, batch_size=2),
                                                      AdapterSpec("b", rank=2, max_steps=2, batch_size=2)])

        def adapter_loss_terms(self, batch):
            sums, counts = super().adapter_loss_terms(batch)
            self.log("aux/tokens", counts.sum().float(), batch_size=1)
            return sums, counts

    module = Mine()
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 4})
    trainer.fit(module, small_dm())
    assert module.registry["a"].step == 4 and math.isfinite(module.registry["a"].exported_val_loss)
    assert math.isfinite(module.registry["b"].last_val_loss)  # (validated as it finished, inside a training step)
    assert "aux/tokens" in trainer.callback_metrics


def test_load_from_checkpoint_builds_the_runs_base_and_adapters(tmp_path, trainer_kwargs):
    """`MultiLoRAModule.load_from_checkpoint(path)` took the constructor's defaults (no hyperparameters were saved):
    a run on another `base_seed` loaded onto seed 0's weights silently, its logits 5.16 off."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def admit_all(specs):  # (a local function: no checkpoint can hold it; given again to load_from_checkpoint)
        return 0.0

    from lightning_multilora.scheduling import AdmissionController

    module = MultiLoRAModule("tiny-llama", base_seed=1, config_overrides={"num_hidden_layers": 1},
                             adapters=[AdapterSpec("a", rank=2, max_steps=3, batch_size=1)], validate_on_finish=False,
                             admission=AdmissionController(admit_all, 1e12))
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True}, callbacks=[save]).fit(module, small_dm())
    path = next((tmp_path / "ck").glob("*step=2*.ckpt"))
    assert "admission" not in torch.load(path, weights_only=False)["hyper_parameters"]
    loaded = MultiLoRAModule.load_from_checkpoint(path)
    assert loaded.model.config.num_hidden_layers == 1 and loaded.registry["a"].step == 2
    theirs = dict(loaded.model.named_parameters())
    base = {n: p for n, p in module.model.named_parameters() if "lora_" not in n}
    assert base and all(torch.equal(p, theirs[n]) for n, p in base.items())  # (seed 1's weights, as the run's)

    class Sub(MultiLoRAModule):  # (a subclass's own `__init__`: its arguments are its own, none saved for it)
        def __init__(self, rank: int = 2, **kwargs):
            super().__init__("tiny-llama", adapters=[AdapterSpec("a", rank=rank, max_steps=3, batch_size=1)],
                             validate_on_finish=False, **kwargs)

    save = ModelCheckpoint(dirpath=tmp_path / "sub", every_n_train_steps=2, save_top_k=-1)
    L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True}, callbacks=[save]).fit(Sub(), small_dm())
    loaded = Sub.load_from_checkpoint(next((tmp_path / "sub").glob("*step=2*.ckpt")))
    assert loaded.registry["a"].step == 2


def test_load_from_checkpoint_names_an_adapter_parallel_checkpoint(tmp_path, trainer_kwargs):
    """Its folder failed with a bare IsADirectoryError; a rank's file with "checkpoint lacks adapter weights ...
    resume with the target_modules the checkpoint was trained with" (the other ranks' adapters are in their files)."""
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4)]), small_dm())
    folder = tmp_path / "epoch=0-step=2.ckpt"
    folder.mkdir()
    trainer.save_checkpoint(folder / "rank0.ckpt")
    with pytest.raises(ValueError, match=r"`checkpoint_path` '.*epoch=0-step=2.ckpt' is a folder, an adapter-parallel "
                                         r"checkpoint of one file per process \(rank0.ckpt\).*`ckpt_path`"):
        MultiLoRAModule.load_from_checkpoint(folder)
    part = torch.load(folder / "rank0.ckpt", weights_only=False)
    torch.save({**part, "rank": 1, "world_size": 2}, folder / "rank1.ckpt")  # (as the strategy writes its files)
    with pytest.raises(ValueError, match=r"this is rank 1's file of an adapter-parallel checkpoint of 2 ranks, which "
                                         r"`load_from_checkpoint` cannot read whole: give its folder to a fit"):
        MultiLoRAModule.load_from_checkpoint(folder / "rank1.ckpt")
    assert MultiLoRAModule.load_from_checkpoint(folder / "rank0.ckpt").registry["a"].step == 2  # (one process's)
    # a fit of one process resuming from that file: its adapters were "lacking" (the other ranks' are in their files)
    with pytest.raises(ValueError, match=r"this is rank 1's file of an adapter-parallel checkpoint of 2 ranks, which "
                                         r"a fit without adapter parallelism cannot read whole: give its folder"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(
            MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=4)]), small_dm(),
            ckpt_path=folder / "rank1.ckpt")
    with pytest.raises(TypeError, match="cannot be called on an instance"):  # (Lightning's guard, kept)
        MultiLoRAModule("tiny-llama").load_from_checkpoint(folder / "rank0.ckpt")


def test_what_a_resume_logs_as_it_sets_up_is_at_the_checkpoints_step():
    """(An adapter's finishing validation, completed as a resume set up, was logged at step 0: Lightning restores its
    loops after the optimizer is built.)"""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2)])
    module._resume_checkpoint = {"global_step": 7, "loops": {"fit_loop": {"epoch_loop.state_dict": {
        "_batches_that_stepped": 6}}}}
    assert module._logged_step() == 6
    module._loaded_outside_fit = True  # (`load_from_checkpoint`, then a fit: the new Trainer's steps)
    assert module._logged_step() != 6


def test_remove_adapter_takes_an_ended_state_and_checks_it_first(tmp_path, trainer_kwargs):
    """`state` was used as given after the adapter was exported and freed: "diverged" (a string) crashed the fit
    later ('str' object has no attribute 'exited'), QUEUED trained it again from new weights over its export,
    RUNNING failed the next step."""
    class Rule(L.Callback):
        def __init__(self):
            self.refused = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step != 2:
                return
            for state in (AdapterState.QUEUED, "running", "paused", "bogus"):
                with pytest.raises(ValueError, match=r"remove_adapter's `state` must be one of finished, diverged, "
                                                     r"overfit, pruned, failed .*; got "):
                    pl_module.remove_adapter("a", state=state)
                self.refused.append(pl_module.registry["a"].state)  # (nothing done: still running)
            pl_module.remove_adapter("a", reason="my rule", state="diverged")

    rule = Rule()
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=6),
                                                     AdapterSpec("b", rank=2, max_steps=6)],
                             export_dir=str(tmp_path / "out"))
    L.Trainer(**trainer_kwargs, callbacks=[rule]).fit(module, small_dm())
    assert rule.refused == [AdapterState.RUNNING] * 4
    a = module.registry["a"]
    assert (a.state, a.reason, a.step, a.exported_step) == (AdapterState.DIVERGED, "my rule", 2, 2)
    assert module.registry["b"].state == AdapterState.FINISHED


def test_an_adapter_added_in_the_validation_after_the_last_one_finished_trains(tmp_path, trainer_kwargs):
    """The last running adapter finished at a validation step: the module stopped the run before that validation,
    and an adapter a callback queued (or resumed) in its on_validation_end stayed queued, unsaid."""
    class Next(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            if "next" not in pl_module.registry and pl_module.registry["first"].state.exited:
                pl_module.add_adapter(AdapterSpec("next", rank=2, max_steps=4))

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("first", rank=2, max_steps=4)],
                             export_dir=str(tmp_path / "out"))
    trainer = L.Trainer(**{**trainer_kwargs, "val_check_interval": 4}, callbacks=[Next()])
    trainer.fit(module, small_dm())
    assert [(r.name, r.state, r.step) for r in module.registry] == [("first", AdapterState.FINISHED, 4),
                                                                     ("next", AdapterState.FINISHED, 4)]
    assert trainer.global_step == 8


def test_a_param_group_of_its_own_is_refused_and_specs_added_are_the_adapters_own(tmp_path, trainer_kwargs):
    """A group of a subclass's own in the module's optimizer was trained with gradients summed over the steps (the
    module zeroes its adapters' alone) and dropped as an adapter was added mid-run. And a spec reused as a template
    by the caller (`spec.name = ...; add_adapter(spec)`) changed every adapter added with it."""
    class WithHead(MultiLoRAModule):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            self.head = torch.nn.Parameter(torch.zeros(3))
            optimizer.add_param_group({"params": [self.head], "lr": 1e-3})
            return optimizer

    with pytest.raises(ValueError, match=r"WithHead.configure_optimizers adds 1 param group\(s\) of its own \(3 "
                                         r"parameters\) to the module's optimizer, which trains the adapters alone"):
        L.Trainer(**trainer_kwargs).fit(WithHead("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2)]),
                                        small_dm())
    module = MultiLoRAModule("tiny-llama", export_dir=str(tmp_path / "out"))
    template = AdapterSpec("t0", rank=2, max_steps=2)
    for i, lr in enumerate((1e-3, 2e-3)):
        template.name, template.lr = f"t{i}", lr
        module.add_adapter(template)
    assert [(r.name, r.spec.name, r.spec.lr) for r in module.registry] == [("t0", "t0", 1e-3), ("t1", "t1", 2e-3)]
    # a field set since the spec was made is checked as its constructor checks it (a rank of 0 added mid-fit failed
    # the whole run as the adapter started)
    for field, value, message in [("rank", 0, r"`rank` must be an integer >= 1"),
                                  ("lr_schedule", "cosin", r"`lr_schedule`"), ("lr", -0.1, r"`lr`")]:
        template = AdapterSpec(f"bad-{field}", rank=2, max_steps=2)
        setattr(template, field, value)
        with pytest.raises(ValueError, match=message):
            module.add_adapter(template)
        assert f"bad-{field}" not in module.registry


def test_a_resume_with_a_data_module_subclass_goes_on_with_its_data(tmp_path, trainer_kwargs):
    """Lightning restores a data module's state under its class's name alone: a ``ckpt_path`` resume with another
    class (a subclass of MultiLoRADataModule) started every adapter's data over, silently."""
    class MyDM(MultiLoRADataModule):
        pass

    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False,
                               adapters=[AdapterSpec("a", rank=2, max_steps=6, batch_size=3, seed=1)])

    once = module_of()
    L.Trainer(**trainer_kwargs).fit(once, small_dm())
    module = module_of()
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 3})
    trainer.fit(module, small_dm())
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = module_of()
    L.Trainer(**trainer_kwargs).fit(resumed, MyDM(sources={"arith": small_dm().sources["arith"]}, max_val_examples=24),
                                    ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.registry["a"].step == 6
    assert resumed.registry["a"].tokens_seen == once.registry["a"].tokens_seen


def test_a_weights_only_checkpoint_given_as_ckpt_path_is_refused_naming_the_way_and_nothing_is_exported(
        tmp_path, trainer_kwargs):
    """A ``save_weights_only`` checkpoint resumed with ``ckpt_path`` failed in Lightning's optimizer restore, after
    exporting the checkpoint's weights into a new folder beside the run's own export; and a second fit refused before
    its first step exported the adapters again, moving their export paths to a folder of a fit that trained
    nothing."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                               adapters=[AdapterSpec("a", rank=2, max_steps=4, seed=1)])

    module = module_of()
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_weights_only=True, every_n_train_steps=2, save_top_k=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**{**trainer_kwargs, "enable_checkpointing": True, "callbacks": [saver]}).fit(module, small_dm())
    # (Lightning's advice to a manual-optimization module, to keep a copy of the weights before each step, is not
    # this module's case: after the step is what it resumes from)
    assert not [w for w in caught if "pre-optimization state" in str(w.message)]
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["a"]
    again = module_of()
    with pytest.raises(ValueError, match=r"this checkpoint holds weights only \(`ModelCheckpoint\(save_weights_only="
                                         r"True\)`\).*`MultiLoRAModule.load_from_checkpoint\(path\)` and fit that"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 6}).fit(again, small_dm(),
                                                             ckpt_path=tmp_path / "ck" / "epoch=0-step=2.ckpt")
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["a"]  # (no a-v1 holding the checkpoint's copy)
    # a second fit refused before its first step: an adapter the first left running stays exported where the first
    # fit wrote it (into its logger's version folder: the second's would be another)
    from lightning.pytorch.loggers import CSVLogger

    held = MultiLoRAModule("tiny-llama", validate_on_finish=False, adapters=[AdapterSpec("a", rank=2, max_steps=8)])
    L.Trainer(**{**trainer_kwargs, "max_steps": 2, "logger": CSVLogger(tmp_path / "logs")}).fit(held, small_dm())
    exported = held.registry["a"].export_path
    assert held.registry["a"].state == AdapterState.RUNNING and exported.endswith("version_0/adapters/a")
    held.add_adapter(AdapterSpec("c", rank=2, max_steps=2, dataset="nosuch"))
    with pytest.raises(ValueError, match=r"'nosuch' is not a data source"):
        L.Trainer(**{**trainer_kwargs, "logger": CSVLogger(tmp_path / "logs")}).fit(held, small_dm())
    assert held.registry["a"].export_path == exported
    assert not (tmp_path / "logs" / "lightning_logs" / "version_1" / "adapters").exists()
    loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "ck" / "epoch=0-step=2.ckpt")
    with pytest.raises(ValueError, match=r"the module is attached to no Trainer, .* measure its adapters with "
                                         r"`trainer.validate\(module, datamodule=MultiLoRADataModule"):
        loaded.evaluate(["a"])


def test_two_fits_resumed_from_one_checkpoint_into_one_export_dir_keep_each_others_exports(tmp_path, trainer_kwargs):
    """Both resumes carried the checkpoint's run id: the second wrote over the first's exports without a word. Each
    checkpoint load is a branch of the run's line now (stamped beside the run id): the second's go beside an adapter
    the first ended; a resume still writes over what the run it resumed wrote (its own line), and over an adapter
    another branch exported as it ran (an interrupted attempt's, as
    `test_a_resumed_run_writes_over_its_own_exports_only` has it)."""
    from safetensors.torch import load_file

    from lightning_multilora.data import GeneratedArithmetic

    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                               adapters=[AdapterSpec("a", rank=2, max_steps=4, lr=1e-2, seed=1)])

    first = module_of()
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(first, small_dm())
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    L.Trainer(**trainer_kwargs).fit(first, small_dm())  # (the run goes on past its checkpoint: exp/a at step 4)
    one = module_of()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(one, small_dm(), ckpt_path=tmp_path / "mid.ckpt")
    assert one.registry["a"].export_path == str(tmp_path / "exp" / "a")  # (over the run it resumed: its own line)
    assert not [w for w in caught if "did not write" in str(w.message)]
    written = load_file(tmp_path / "exp" / "a" / "adapter_model.safetensors")
    other = MultiLoRAModule.load_from_checkpoint(tmp_path / "mid.ckpt", export_dir=str(tmp_path / "exp"))
    with pytest.warns(UserWarning, match=r"exp/a holds an adapter this run did not write for it \(another resume of "
                                         r"this run's checkpoint\); it is kept, and this one is written to .*exp/a-v1"):
        L.Trainer(**trainer_kwargs).fit(other, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(400, seed=5)},
                                                                    max_val_examples=24))  # (other data)
    assert other.registry["a"].export_path == str(tmp_path / "exp" / "a-v1")
    kept = load_file(tmp_path / "exp" / "a" / "adapter_model.safetensors")
    assert all(torch.equal(kept[k], written[k]) for k in written)
    beside = load_file(tmp_path / "exp" / "a-v1" / "adapter_model.safetensors")
    assert not all(torch.equal(beside[k], written[k]) for k in written)


def test_a_retry_from_the_checkpoint_of_a_crashed_attempt_writes_over_all_its_exports(tmp_path, trainer_kwargs):
    """Exports a branch wrote in a fit that did not end as fits end (an error, Ctrl+C, a kill) are an interrupted
    attempt's, which a retry from the same checkpoint writes over, an adapter that finished in it included; those of
    a fit that ended are another resume's, kept (`test_two_fits_resumed_from_one_checkpoint...`)."""
    class Crash(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                raise RuntimeError("node lost")

    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                               adapters=[AdapterSpec("a", rank=2, max_steps=4), AdapterSpec("b", rank=2, max_steps=8)])

    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module_of(), small_dm())
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    crashed = module_of()
    with pytest.raises(RuntimeError, match="node lost"), pytest.warns(UserWarning, match="fit stopped by"):
        L.Trainer(**trainer_kwargs, callbacks=[Crash()]).fit(crashed, small_dm(), ckpt_path=tmp_path / "mid.ckpt")
    assert crashed.registry["a"].state == AdapterState.FINISHED  # (exported at its end, before the crash)
    retry = module_of()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(retry, small_dm(), ckpt_path=tmp_path / "mid.ckpt")
    assert not [w for w in caught if "did not write" in str(w.message)]
    assert {n: retry.registry[n].export_path for n in "ab"} == {n: str(tmp_path / "exp" / n) for n in "ab"}
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["a", "b"]


def test_a_resume_running_beside_another_of_its_checkpoint_keeps_the_exports_that_one_wrote(tmp_path,
                                                                                              trainer_kwargs):
    """Two resumes of one checkpoint into one `export_dir` at once: an export of the first was known as another
    resume's only once its fit ended, so the second, running meanwhile, wrote over the first's finished adapter. A
    fit holds its branch as running (a lock beside the exports, let go as it ends or stops, or its process dies):
    the second goes beside, and the lock leaves no file behind."""
    from lightning_multilora.data import GeneratedArithmetic

    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                               adapters=[AdapterSpec("a", rank=2, max_steps=4, lr=1e-2, seed=1),
                                         AdapterSpec("b", rank=2, max_steps=8, lr=1e-2, seed=2)])

    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module_of(), small_dm())
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    seen: dict = {}

    class SecondResumeMeanwhile(Callback):
        """The first resume, `a` finished and exported, `b` running: the second resume runs its whole fit."""
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 5 and not seen:
                seen["first"] = load_file(tmp_path / "exp" / "a" / "adapter_model.safetensors")
                second = module_of()
                with pytest.warns(UserWarning, match=r"exp/a holds an adapter this run did not write for it "
                                                     r"\(another resume of this run's checkpoint\)"):
                    L.Trainer(**trainer_kwargs).fit(second, MultiLoRADataModule(
                        sources={"arith": GeneratedArithmetic(400, seed=5)}, max_val_examples=24),
                        ckpt_path=tmp_path / "mid.ckpt")
                seen["second"] = {n: second.registry[n].export_path for n in "ab"}

    first = module_of()
    with pytest.warns(UserWarning, match=r"exp/b holds an adapter this run did not write for it \(another resume"):
        L.Trainer(**trainer_kwargs, callbacks=[SecondResumeMeanwhile()]).fit(first, small_dm(),
                                                                               ckpt_path=tmp_path / "mid.ckpt")
    # (`b`, still running in the first, was free when the second exported it; the first's goes beside it)
    assert seen["second"] == {"a": str(tmp_path / "exp" / "a-v1"), "b": str(tmp_path / "exp" / "b")}
    assert {n: first.registry[n].export_path for n in "ab"} == {"a": str(tmp_path / "exp" / "a"),
                                                                "b": str(tmp_path / "exp" / "b-v1")}
    kept = load_file(tmp_path / "exp" / "a" / "adapter_model.safetensors")
    assert all(torch.equal(kept[k], seen["first"][k]) for k in kept)
    beside = load_file(tmp_path / "exp" / "a-v1" / "adapter_model.safetensors")
    assert not all(torch.equal(beside[k], kept[k]) for k in kept)  # (other data)
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["a", "a-v1", "b", "b-v1"]


def test_an_adapter_of_a_rank_above_the_triton_kernels_is_refused_by_name(trainer_kwargs, triton_backend):
    """Accepted and queued, it stopped the whole fit at its first forward ("the Triton path supports ranks up to
    256", naming neither it nor a way out), every adapter with it. It cannot start, said by name: before the first
    step the fit is refused; admitted later it fails alone and the others train on."""
    from lightning_multilora.arguments import UsageError

    big = AdapterSpec("big", rank=300, max_steps=2)
    one = {"target_modules": ["q_proj"], "validate_on_finish": False}  # (the interpreter's kernels: few layers)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=2), big], **one)
    with pytest.raises(UsageError, match=r"adapter 'big': rank 300 is above the Triton kernels' 256; give it a rank "
                                         r"<= 256, or run every adapter on the reference path, "
                                         r"`lightning_multilora.kernels.set_backend\('reference'\)`"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    class AddBig(Callback):  # (as a sweep refills a slot)
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 1:
                pl_module.add_adapter(big)

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=3)], **one)
    with pytest.warns(UserWarning, match=r"adapter 'big' could not start: .*rank 300 is above the Triton kernels' 256"):
        L.Trainer(**trainer_kwargs, callbacks=[AddBig()]).fit(module, small_dm())
    assert module.registry["a"].state == AdapterState.FINISHED and module.registry["big"].state == AdapterState.FAILED


def test_a_fit_holds_its_branch_while_it_runs_and_leaves_no_lock_behind(tmp_path, trainer_kwargs):
    """A fit's branch is held beside its exports while it runs (`_sibling`), let go as it ends; a `save_adapter`
    after a fit returned (a ``max_steps`` stop, the module used from Python) took a lock never let go, its file left
    behind: the Trainer still said "fit"."""
    from lightning_multilora.branch_locks import branch_alive

    module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                             adapters=[AdapterSpec("a", rank=2, max_steps=2), AdapterSpec("b", rank=2, max_steps=8)])
    seen = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3:  # (a exported at its end, step 2)
                seen["alive"] = branch_alive(tmp_path / "exp" / "a", pl_module._lineage[-1])

    L.Trainer(**{**trainer_kwargs, "max_steps": 4}, callbacks=[Look()]).fit(module, small_dm())
    assert seen == {"alive": True}
    module.save_adapter("b")
    module.save_adapter("b", directory=tmp_path / "mine")
    assert not list(tmp_path.rglob(".multilora_branch.*"))
    assert not branch_alive(tmp_path / "exp" / "a", module._lineage[-1])


def test_a_fit_after_a_trainer_validate_trains_on_the_batch_shapes_the_validate_saw(trainer_kwargs, monkeypatch):
    """`trainer.validate` runs in inference mode: a batch's per-adapter row index it made first was cached as an
    inference tensor, and a later fit's step of the same rows (another module's too) failed in backward, "Inference
    tensors cannot be saved for backward"."""
    import lightning_multilora.module as made

    monkeypatch.setattr(made, "_DEVICE_INDICES", {})  # (none made yet: not by an earlier test's fit, in this process)
    first = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=5)], validate_on_finish=False)
    L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(first, small_dm())
    L.Trainer(**trainer_kwargs).validate(first, small_dm(val_batch_size=8))
    second = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("b", rank=2, batch_size=8, max_steps=2)],
                             validate_on_finish=False)
    L.Trainer(**trainer_kwargs).fit(second, small_dm())
    assert second.registry["b"].state == AdapterState.FINISHED and len(second.registry["b"].train_losses) == 2


def test_slot_spans_count_on_across_fits_of_one_module_and_a_loaded_checkpoint(tmp_path, trainer_kwargs):
    """A second fit's spans began at 0 again, over the first's (`b` ending before it began, `c` overlapping `a` in a
    run of one slot); so did a fit of a module loaded from a checkpoint. They count on the run's steps now, as a
    ``ckpt_path`` resume's did."""
    def module_of() -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", max_running=1, validate_on_finish=False,
                               adapters=[AdapterSpec("a", rank=2, max_steps=3), AdapterSpec("b", rank=2, max_steps=4),
                                         AdapterSpec("c", rank=2, max_steps=2)])

    once = module_of()
    L.Trainer(**trainer_kwargs).fit(once, small_dm())
    expected = {"a": [[0, 3]], "b": [[3, 7]], "c": [[7, 9]]}
    assert {n: once.registry[n].spans for n in "abc"} == expected
    twice = module_of()
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 5})
    trainer.fit(twice, small_dm())
    trainer.save_checkpoint(tmp_path / "five.ckpt")
    L.Trainer(**trainer_kwargs).fit(twice, small_dm())
    assert {n: twice.registry[n].spans for n in "abc"} == expected
    assert (twice.registry["c"].started_at_step, twice.registry["c"].ended_at_step) == (7, 9)
    loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "five.ckpt")
    L.Trainer(**trainer_kwargs).fit(loaded, small_dm())
    assert {n: loaded.registry[n].spans for n in "abc"} == expected


def test_check_val_every_n_epoch_above_one_in_the_endless_epoch_is_said(tmp_path, trainer_kwargs):
    """``Trainer(val_check_interval=5, check_val_every_n_epoch=2)`` ran no validation at all (the run is epoch 0):
    EarlyExit, WarmupSelection and the pruner judged nothing, and ModelCheckpoint wrote nothing, unsaid."""
    module = MultiLoRAModule("tiny-llama", validate_on_finish=False,
                             adapters=[AdapterSpec("a", rank=2, max_steps=6)])
    kwargs = {**trainer_kwargs, "val_check_interval": 3, "check_val_every_n_epoch": 2}
    with pytest.warns(UserWarning, match=r"`Trainer\(check_val_every_n_epoch=2\)` validates once every 2 epochs, and "
                                         r"the run is one endless epoch: no validation runs during it .* give "
                                         r"check_val_every_n_epoch=None"):
        L.Trainer(**kwargs).fit(module, small_dm())
    assert module.registry["a"].val_losses == []  # (as said: none ran)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**{**kwargs, "check_val_every_n_epoch": None}).fit(MultiLoRAModule(
            "tiny-llama", validate_on_finish=False, adapters=[AdapterSpec("a", rank=2, max_steps=6)]), small_dm())
    assert not [w for w in caught if "check_val_every_n_epoch=" in str(w.message)]


def test_an_adapter_target_name_that_the_modules_targets_narrow_is_said(tmp_path, trainer_kwargs):
    """A name of which the module wraps some modules alone (``q_proj`` of a module that wraps layer 0's) adapted
    fewer layers than PEFT's same name would, unsaid (a regex was warned of)."""
    with pytest.warns(UserWarning, match=r"adapter 'a': its `target_modules` \['q_proj'\] also match linear modules "
                                         r"the module does not wrap \(\['model.layers.1.self_attn.q_proj'\]...: 1\), "
                                         r"which it cannot adapt; it gets 1 layers"):
        module = MultiLoRAModule("tiny-llama", target_modules=r".*layers\.0\..*_proj",
                                 adapters=[AdapterSpec("a", rank=2, max_steps=1, target_modules=["q_proj"])])
    assert module.registry["a"].state == AdapterState.QUEUED
    with warnings.catch_warnings(record=True) as caught:  # (a subset of the module's own targets: nothing)
        warnings.simplefilter("always")
        MultiLoRAModule("tiny-llama", target_modules=["q_proj", "v_proj"],
                        adapters=[AdapterSpec("a", rank=2, max_steps=1, target_modules=["q_proj"])])
    assert not [w for w in caught if "does not wrap" in str(w.message)]


def test_the_progress_bar_counts_paused_adapters_apart_from_queued_ones(tmp_path, trainer_kwargs):
    """Paused adapters were counted as "queued" (12 queued at the end of a demo whose candidates waited for the
    warmup selection, none queued)."""
    class PauseB(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                pl_module.pause_adapter("b")

    module = MultiLoRAModule("tiny-llama", validate_on_finish=False, max_running=2,
                             adapters=[AdapterSpec("a", rank=2, max_steps=4), AdapterSpec("b", rank=2, max_steps=4),
                                       AdapterSpec("c", rank=2, max_steps=4)])
    trainer = L.Trainer(**{**trainer_kwargs, "enable_progress_bar": True, "max_steps": 3}, callbacks=[PauseB()])
    trainer.fit(module, small_dm())
    shown = {k: trainer.progress_bar_metrics[k] for k in ("running", "queued", "paused", "exited")}
    assert shown == {"running": 2.0, "queued": 0.0, "paused": 1.0, "exited": 0.0}


def test_an_adapter_paused_or_removed_at_a_batchs_start_leaves_that_step(tmp_path, trainer_kwargs):
    """The batch is drawn before the callbacks' ``on_train_batch_start``: an adapter removed there crashed the fit
    ("no adapter 'a'"), and one paused there trained that step anyway (past its max_steps, where it was its last).
    Now either acts from that step: a pause at step 3's start trains as a pause at step 2's end, data included."""
    from safetensors.torch import load_file

    class Act(Callback):
        def __init__(self, action: str, hook: str):
            self.action, self.hook = action, hook

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.hook == "on_train_batch_start" and trainer.global_step == 2:  # (before step 3)
                getattr(pl_module, f"{self.action}_adapter")("a")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.hook == "on_train_batch_end" and trainer.global_step == 2:
                getattr(pl_module, f"{self.action}_adapter")("a")
            if trainer.global_step == 5 and self.action == "pause":  # (both: after step 5, into the next batch)
                pl_module.resume_adapter("a")

    for action in ("pause", "remove"):
        exports = []
        for hook in ("on_train_batch_end", "on_train_batch_start"):
            module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / action / hook),
                                     adapters=[AdapterSpec("a", rank=2, max_steps=4, lr=1e-2, dropout=0.1),
                                               AdapterSpec("b", rank=2, max_steps=6, lr=1e-2, seed=1)])
            L.Trainer(**trainer_kwargs, callbacks=[Act(action, hook)]).fit(module, fixed_dm())
            a = module.registry["a"]
            expected = ((AdapterState.FINISHED, 4, [[0, 2], [5, 7]]) if action == "pause" else
                        (AdapterState.PRUNED, 2, [[0, 2]]))
            assert (a.state, a.step, a.spans) == expected, hook
            assert [s for s, _ in a.train_losses] == list(range(1, a.step + 1))
            exports.append(load_file(Path(a.export_path) / "adapter_model.safetensors"))
        assert all(torch.equal(exports[0][k], exports[1][k]) for k in exports[0])


def test_a_fit_refused_for_an_adapter_that_cannot_start_leaves_it_queued_for_the_next(tmp_path, trainer_kwargs):
    """The refusal marked the adapter failed: the fit after the fix (its data source added) skipped it without a
    word and trained the others alone."""
    from lightning_multilora.data import GeneratedArithmetic

    module = MultiLoRAModule("tiny-llama", validate_on_finish=False,
                             adapters=[AdapterSpec("a", rank=2, max_steps=2, dataset="extra"),
                                       AdapterSpec("b", rank=2, max_steps=2)])
    with pytest.raises(ValueError, match=r"'extra' is not a data source"):
        L.Trainer(**trainer_kwargs).fit(module, small_dm())
    assert module.registry["a"].state == AdapterState.QUEUED
    fixed = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(400), "extra": GeneratedArithmetic(60, seed=1)},
                                max_val_examples=24)
    L.Trainer(**trainer_kwargs).fit(module, fixed)
    assert [(module.registry[n].state, module.registry[n].step) for n in "ab"] == [(AdapterState.FINISHED, 2)] * 2


def test_an_adapter_a_callback_adds_in_setup_survives_a_resume(tmp_path, trainer_kwargs):
    """A callback's ``setup`` runs before Lightning loads a ``ckpt_path``: the checkpoint's registry replaced the
    module's, and the adapter added there vanished without a word (from ``on_fit_start`` it was kept)."""
    class AddInSetup(Callback):
        def setup(self, trainer, pl_module, stage):
            pl_module.add_adapter(AdapterSpec("x", rank=2, max_steps=2))

    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(MultiLoRAModule("tiny-llama", validate_on_finish=False,
                                adapters=[AdapterSpec("a", rank=2, max_steps=4)]), small_dm())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    module = MultiLoRAModule("tiny-llama", validate_on_finish=False, adapters=[AdapterSpec("a", rank=2, max_steps=4)])
    L.Trainer(**trainer_kwargs, callbacks=[AddInSetup()]).fit(module, small_dm(), ckpt_path=tmp_path / "two.ckpt")
    assert [(r.name, r.state, r.step) for r in module.registry] == [("a", AdapterState.FINISHED, 4),
                                                                   ("x", AdapterState.FINISHED, 2)]


def test_a_held_adapters_spec_is_fixed_and_a_copy_is_free(trainer_kwargs):
    """``registry[name].spec.alpha = 64`` on a running adapter trained at the old scaling and exported the new one
    (PEFT then loaded it 8x too strong); ``rank`` made an export PEFT could not load; ``lr`` applied, ``max_steps``
    not. A held spec refuses every field, naming how to train other settings."""
    import copy
    import dataclasses
    import pickle

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, alpha=8.0)])
    spec = module.registry["a"].spec
    for field, value in (("alpha", 64.0), ("rank", 16), ("lr", 0.5), ("max_steps", 3), ("name", "b")):
        with pytest.raises(AttributeError, match=rf"adapter 'a': its spec is the record of how a module trains it, "
                                                 rf"fixed once the module holds it: `{field}` = .* "
                                                 rf"`module.add_adapter\(dataclasses.replace\(spec, name=..., "
                                                 rf"{field}=...{', max_epochs=None' if field == 'max_steps' else ''}"
                                                 rf"\)\)`"):
            setattr(spec, field, value)
    assert (spec.alpha, spec.rank, spec.name) == (8.0, 2, "a")
    for copied in (copy.deepcopy(module.registry["a"]), pickle.loads(pickle.dumps(module.registry["a"]))):
        with pytest.raises(AttributeError, match="fixed once the module holds it"):  # (a copied record's: held)
            copied.spec.alpha = 64.0
    free = copy.deepcopy(spec)
    free.alpha = 64.0
    copy.copy(spec).rank = 4  # (a spec's own copies are free)
    pickle.loads(pickle.dumps(spec)).rank = 4
    mine = AdapterSpec("a", rank=4)
    with pytest.raises(ValueError, match="duplicate adapter name 'a'"):
        module.registry.add(mine)
    mine.rank = 8  # (a refused add fixed nothing of the caller's)
    other = dataclasses.replace(spec, name="b", rank=4)
    other.lr = 1e-3
    module.add_adapter(other)
    assert module.registry["b"].spec.rank == 4 and free.alpha == 64.0


def test_a_copy_saved_into_an_adapters_own_folder_is_written_over_by_its_export(tmp_path, trainer_kwargs):
    """``save_adapter("a", <export_dir>/a)`` mid-run wrote no stamp: the final export took the folder for another
    run's, went to ``a-v1`` (warning so), and ``a`` kept the mid-run copy."""
    class SaveAt2(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                pl_module.save_adapter("a", tmp_path / "exp" / "a")

    module = MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                             adapters=[AdapterSpec("a", rank=2, max_steps=4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs, callbacks=[SaveAt2()]).fit(module, small_dm())
    assert not [w for w in caught if "did not write" in str(w.message)]
    assert module.registry["a"].export_path == str(tmp_path / "exp" / "a")
    assert json.loads((tmp_path / "exp" / "a" / "multilora_export.json").read_text())["weights_step"] == 4


def test_a_loaded_modules_pause_and_removal_before_its_fit_count_at_the_checkpoints_step(tmp_path, trainer_kwargs):
    """Outside a fit, a module from ``load_from_checkpoint`` counted its run at step 0: a pause or removal there
    closed spans at 0 (``[[0, 0]]``, overlapping what followed)."""
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 3})
    trainer.fit(MultiLoRAModule("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path / "exp"),
                                adapters=[AdapterSpec("a", rank=2, max_steps=6),
                                          AdapterSpec("b", rank=2, max_steps=6)]), small_dm())
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    for validated in (False, True):  # (a `trainer.validate` first attaches a Trainer at step 0)
        loaded = MultiLoRAModule.load_from_checkpoint(tmp_path / "three.ckpt")
        if validated:
            L.Trainer(**trainer_kwargs).validate(loaded, small_dm())
        loaded.pause_adapter("a")
        loaded.remove_adapter("b")
        assert loaded.registry["a"].spans == [[0, 3]]
        assert (loaded.registry["b"].spans, loaded.registry["b"].ended_at_step) == ([[0, 3]], 3)


def test_max_running_set_after_construction_is_checked_as_the_constructor_checks_it():
    """``module.max_running = 0`` from a callback was taken: no queued adapter started, and the run took empty steps
    until the Trainer's max_steps (for ever without one)."""
    module = MultiLoRAModule("tiny-llama", max_running=2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"MultiLoRAModule: `max_running` must be an integer >= 1 or None"):
            module.max_running = bad
    assert module.max_running == 2
    module.max_running = None
    assert module.max_running is None
