"""Any torch optimizer class, one param group per adapter, its state per adapter."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.module import resolve_optimizer


def test_any_torch_optimizer_by_import_path_with_per_adapter_groups(tmp_path, trainer_kwargs):
    specs = [AdapterSpec("a", lr=0.05, batch_size=2, max_steps=4), AdapterSpec("b", lr=0.01, batch_size=1, max_steps=8)]
    groups_seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            groups_seen.append({g["adapter"]: (g["lr"], len(g["params"])) for g in opt.param_groups})

    module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer="torch.optim.SGD",
                             optimizer_kwargs={"momentum": 0.9}, export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(60)}))
    assert isinstance(module.trainer.optimizers[0], torch.optim.SGD)
    assert groups_seen[0] == {"a": (0.05, 28), "b": (0.01, 28)}  # 14 layers x (A, B)
    assert set(groups_seen[4]) == {"b"}  # a left after 4 steps, its group went with it


def test_bad_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match="`optimizer` must be an optimizer class or its import path"):
        resolve_optimizer("torch.optim.NoSuchThing")
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer subclass"):
        resolve_optimizer("torch.nn.Linear")
