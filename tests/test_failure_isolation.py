"""A non-finite loss in one adapter fails that adapter alone; its neighbours are bit-identical.

Batches are padded to a fixed length here: with "longest" padding, removing an adapter's rows can
shorten the padded length, and attention's reductions over a different length round differently
(by ~1e-7), which is floating point, not leakage between adapters.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import torch

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.registry import AdapterState

HEALTHY = [
    AdapterSpec("h1", rank=4, lr=2e-3, batch_size=2, max_steps=12, seed=1),
    AdapterSpec("h2", rank=6, lr=1e-3, batch_size=3, max_steps=12, seed=2, weight_decay=0.1),
]


class Poisoned(MultiLoRAModule):
    """Sets one adapter's B to inf at a given step, so its rows (and loss) become non-finite."""

    def __init__(self, *args, poison: str, at_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.poison, self.at_step = poison, at_step

    def on_train_batch_start(self, batch, batch_idx):
        rec = self.registry[self.poison]
        if rec.state == AdapterState.RUNNING and rec.step == self.at_step:
            with torch.no_grad():
                for layer in self.lora_layers.values():
                    if self.poison in layer.lora_B:
                        layer.lora_B[self.poison].fill_(float("inf"))


def final_weights(module: MultiLoRAModule, tmp_path, trainer_kwargs) -> dict[str, torch.Tensor]:
    L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(padding="max_length", max_length=96))
    from safetensors.torch import load_file

    return {name: load_file(f"{module.registry[name].export_path}/adapter_model.safetensors") for name in ("h1", "h2")}


def test_nan_adapter_fails_alone_and_neighbours_are_bit_identical(tmp_path, trainer_kwargs):
    bad = AdapterSpec("bad", rank=5, lr=1e-3, batch_size=2, max_steps=12, seed=3)
    poisoned = Poisoned("tiny-llama", adapters=[HEALTHY[0], bad, HEALTHY[1]], poison="bad", at_step=4,
                        export_dir=str(tmp_path / "p"), validate_on_finish=False)
    with_bad = final_weights(poisoned, tmp_path, trainer_kwargs)
    rec = poisoned.registry["bad"]
    assert rec.state == AdapterState.FAILED
    assert "non-finite loss (nan) in step 5 (its steps done: 4)" in rec.reason and rec.step == 4, rec.reason
    # (its export looked like a good one's; its weights gave that loss: the folder and the summary say so)
    info = json.loads((Path(rec.export_path) / "multilora_export.json").read_text())
    assert (info["state"], info["weights_step"], info["val_loss"]) == ("failed", 4, math.inf)
    assert info["reason"] == rec.reason
    assert rec.exported_val_loss == math.inf
    assert "bad" not in poisoned.lora_layers.adapter_names  # weights freed
    assert not any(g.get("adapter") == "bad" for g in poisoned.trainer.optimizers[0].param_groups)
    # the failed adapter was exported with its last finite weights
    from safetensors.torch import load_file

    exported = load_file(f"{rec.export_path}/adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for k, t in exported.items() if "lora_A" in k)

    clean = MultiLoRAModule("tiny-llama", adapters=HEALTHY, export_dir=str(tmp_path / "c"), validate_on_finish=False)
    without_bad = final_weights(clean, tmp_path, trainer_kwargs)
    for name in ("h1", "h2"):
        assert poisoned.registry[name].state == AdapterState.FINISHED
        for key, value in without_bad[name].items():
            assert torch.equal(with_bad[name][key], value), f"{name}:{key} differs"


def test_a_failed_adapter_validated_at_its_last_step_keeps_that_loss_for_its_export(tmp_path, trainer_kwargs):
    """A failure in the step right after a validation exported the weights that validation measured, and called
    their loss inf (the failing step's): the report ranked a usable export last."""
    class NaNFrom5(MultiLoRAModule):
        def adapter_loss_terms(self, batch):
            sums, counts = super().adapter_loss_terms(batch)
            names = batch["layout"].names
            if self.training and "bad" in names and self.registry["bad"].step >= 4:
                sums = sums.clone()
                sums[names.index("bad")] = float("nan")
            return sums, counts

    module = NaNFrom5("tiny-llama", validate_on_finish=False, export_dir=str(tmp_path),
                      adapters=[AdapterSpec("bad", rank=2, max_steps=8), AdapterSpec("ok", rank=2, max_steps=8)])
    L.Trainer(**{**trainer_kwargs, "val_check_interval": 4}).fit(
        module, MultiLoRADataModule(padding="max_length", max_length=96, max_val_examples=16))
    rec = module.registry["bad"]
    assert rec.state == AdapterState.FAILED and rec.step == 4 and rec.val_losses[-1][0] == 4
    assert (rec.exported_step, rec.exported_val_loss) == (4, rec.val_losses[-1][1])
    assert math.isfinite(rec.exported_val_loss)
    info = json.loads((Path(rec.export_path) / "multilora_export.json").read_text())
    assert (info["state"], info["weights_step"], info["val_loss"]) == ("failed", 4, rec.val_losses[-1][1])
