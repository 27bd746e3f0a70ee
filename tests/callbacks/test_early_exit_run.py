"""EarlyExit in a real tiny run: a far too high lr diverges, a tiny dataset overfits and keeps its best."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_multilora import AdapterSpec, EarlyExit, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.registry import AdapterState


def val_loss_of_export(path: str, spec: AdapterSpec, dm: MultiLoRADataModule) -> float:
    """Validation loss of an exported adapter, loaded into a fresh module (no Trainer)."""
    module = MultiLoRAModule("tiny-llama", adapters=[])
    module.lora_layers.add_adapter(spec.name, spec.rank, spec.alpha, spec.dropout, spec.use_rslora,
                                   module.default_target_modules, spec.seed)
    module.lora_layers.load_peft_state_dict(spec.name, load_file(f"{path}/adapter_model.safetensors"))
    module.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in dm.val_batches([spec]):
            with module.lora_layers.use(batch["layout"]):
                s, c = module.adapter_loss_terms(batch)
            total, count = total + s.sum().item(), count + c.sum().item()
    return total / count


@pytest.mark.slow
def test_divergence_and_overfitting_exit_in_a_real_run(tmp_path, trainer_kwargs):
    # Each curve is made to leave no doubt, so that float differences between machines cannot change a verdict:
    # - "sane" decays its lr to 0 and finishes;
    # - "hot" learns while its lr warms up slowly, then passes the stability edge (lr ~0.02) and its training
    #   and validation losses climb back from ~2.0 to the ~3.2 of predicting the token frequencies;
    # - "small" memorises 30 examples while its validation loss stays flat.
    # At that edge validation jumps within one evaluation, and ALTO's defaults (EMA alpha 0.1, window 2) often
    # read the jump as overfitting: the training EMA lags behind. An EMA of alpha 0.3 follows the climb within an
    # evaluation, and a window of 3 keeps the jump in both slopes for two evaluations.
    # Checked over seeds 0-6 of each adapter (the initialisation drawn by layer name): every run gave these verdicts
    # but "hot" at seed 1, whose jump read as overfitting.
    specs = [AdapterSpec("sane", lr=2e-3, lr_schedule="linear", batch_size=4, max_steps=120),
             AdapterSpec("hot", lr=0.3, warmup_steps=1200, batch_size=8, max_steps=200, grad_clip=None, seed=3),
             AdapterSpec("small", lr=4e-3, rank=16, alpha=32, batch_size=4, max_steps=200, dataset="tiny", seed=2)]
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(1000),
                                      "tiny": GeneratedArithmetic(60, seed=5, operations=("add", "sub", "mul"),
                                                                  max_operand=99)},
                             val_fraction=0.5, max_val_examples=32)
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / "out"))
    early_exit = EarlyExit(ema_alpha=0.3, window=3)
    L.Trainer(**dict(trainer_kwargs, val_check_interval=10), callbacks=[early_exit]).fit(module, dm)
    sane, hot, small = (module.registry[n] for n in ("sane", "hot", "small"))
    assert sane.state == AdapterState.FINISHED and sane.step == 120
    assert hot.state == AdapterState.DIVERGED and hot.step < 200 and "rising" in hot.reason
    assert small.state == AdapterState.OVERFIT and small.step < 200
    assert {e["adapter"] for e in early_exit.exits} == {"hot", "small"}
    # every adapter's export holds its best-validation weights: re-measured, the same loss
    for rec in (sane, hot, small):
        measured = val_loss_of_export(rec.export_path, rec.spec, dm)
        assert math.isclose(measured, rec.best_val_loss, rel_tol=1e-5), rec.name


def test_a_run_stopped_by_the_trainer_reports_the_loss_of_the_weights_it_exports(tmp_path, trainer_kwargs):
    """Adapters still training when the Trainer's max_steps stopped the run were exported with their last weights,
    reported with the loss of an older validation; they are validated first. Without best weights kept (an EarlyExit
    with keep_best_weights=False), an overfit exit says its last weights were exported, and the report agrees."""
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=16)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4, max_steps=30, lr=1e-2)],
                             export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "max_steps": 7, "val_check_interval": 5}).fit(module, dm)
    rec = module.registry["a"]
    # measured, not recorded: the history a resumed run goes on from is the uninterrupted run's
    assert [s for s, _ in rec.val_losses] == [5] and (rec.exported_step, rec.step) == (7, 7)
    exported = val_loss_of_export(rec.export_path, rec.spec, dm)
    assert rec.exported_val_loss == pytest.approx(exported, rel=1e-4) and rec.exported_val_loss != rec.val_losses[0][1]
    (row,) = module.registry.summary_rows("last")
    assert row["exported_val_loss"] == rec.exported_val_loss

    with pytest.warns(UserWarning, match=r"`Trainer\(limit_val_batches=0\)` runs none: it stops no adapter"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 1, "limit_val_batches": 0}, callbacks=[EarlyExit()]).fit(
            MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("b", rank=2, max_steps=1)],
                            export_dir=str(tmp_path / "out2")), dm)


def test_an_overfit_exit_without_best_weights_kept_says_its_last_weights_were_exported(tmp_path, trainer_kwargs):
    early = EarlyExit(keep_best_weights=False, tau_gap=0.0, patience_ovf=1, ema_alpha=1.0)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4, max_steps=60, lr=3e-2)],
                             export_dir=str(tmp_path / "out"))
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(40)}, max_val_examples=8)
    L.Trainer(**{**trainer_kwargs, "max_steps": 60, "val_check_interval": 5}, callbacks=[early]).fit(module, dm)
    rec = module.registry["a"]
    assert rec.state == AdapterState.OVERFIT, rec.reason
    assert "its last weights exported" in rec.reason and "kept)" in rec.reason
    assert rec.exported_step == rec.step and rec.exported_val_loss == rec.val_losses[-1][1]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_adapter_that_never_had_a_finite_validation_loss_is_said_so(tmp_path, trainer_kwargs, bad):
    """An adapter whose validations all overflowed (inf) exited "best validation at step -1, not kept", as though
    `keep_best_weights` were off; and its trial was said "never validated". A NaN over measured tokens (an fp16
    forward's inf - inf) is such an overflow too: it was taken for "no tokens", and the adapter trained on unjudged."""
    class Overflowing(MultiLoRAModule):
        def adapter_loss_terms(self, batch):
            sums, counts = super().adapter_loss_terms(batch)
            if not self.training and "b" in batch["layout"].names:
                sums = sums.clone()
                sums[batch["layout"].names.index("b")] = bad
            return sums, counts

    module = Overflowing("tiny-llama", validate_on_finish=False,
                         adapters=[AdapterSpec("a", rank=2, max_steps=12), AdapterSpec("b", rank=2, max_steps=12)])
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(400)}, max_val_examples=24)
    L.Trainer(**{**trainer_kwargs, "val_check_interval": 2}, callbacks=[EarlyExit()]).fit(module, dm)
    b = module.registry["b"]
    assert b.state == AdapterState.OVERFIT and b.best_val_step == -1
    assert b.reason.endswith("its last weights exported (no validation loss of it was finite)"), b.reason
    assert b.val_losses and all(v == math.inf for _, v in b.val_losses) and b.exported_val_loss == math.inf
    assert module.registry["a"].state == AdapterState.FINISHED
