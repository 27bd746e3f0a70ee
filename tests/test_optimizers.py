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


@pytest.mark.parametrize("name", ["bitsandbytes.optim.AdamW8bit", "bitsandbytes.optim.PagedAdamW8bit"])
def test_bitsandbytes_8bit_adamw_keeps_8bit_states_per_adapter(tmp_path, trainer_kwargs, name):
    pytest.importorskip("bitsandbytes")
    specs = [AdapterSpec("a", rank=4, lr=1e-2, batch_size=2, max_steps=3, weight_decay=0.01),
             AdapterSpec("b", rank=8, lr=2e-2, batch_size=1, max_steps=6, weight_decay=0.01)]
    states: dict[str, set] = {}

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            for g in opt.param_groups:
                dtypes = {t.dtype for p in g["params"] for t in opt.state[p].values() if torch.is_tensor(t) and t.numel() > 1}
                states.setdefault(g["adapter"], set()).update(dtypes)

    # the tiny model's adapter tensors are small: let bnb quantize them too (default: tensors >= 4096 values)
    module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer=name, optimizer_kwargs={"min_8bit_size": 128},
                             export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(60)}))
    assert type(module.trainer.optimizers[0]).__name__ == name.rsplit(".", 1)[1]
    assert set(states) == {"a", "b"} and all(torch.uint8 in d for d in states.values())  # 8-bit moments per adapter
    assert all(r.step == r.spec.max_steps for r in module.registry)
