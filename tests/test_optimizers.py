"""Any torch optimizer class, one param group per adapter, its state per adapter."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.module import resolve_optimizer


def test_any_torch_optimizer_by_import_path_with_per_adapter_groups(tmp_path, trainer_kwargs):
    specs = [AdapterSpec("a", lr=0.05, batch_size=2, max_steps=4), AdapterSpec("b", lr=0.01, batch_size=1, max_steps=8)]
    groups_seen, held = [], []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            groups_seen.append({g["adapter"]: (g["lr"], len(g["params"])) for g in opt.param_groups})
            if len(groups_seen) == 1:
                held.extend([opt.param_groups[1]["params"][0], pl_module.lora_layers.parameters_of("b")])

    module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer="torch.optim.SGD",
                             optimizer_kwargs={"momentum": 0.9}, export_dir=str(tmp_path), validate_on_finish=False)
    L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(60)}))
    assert isinstance(module.trainer.optimizers[0], torch.optim.SGD)
    assert groups_seen[0] == {"a": (0.05, 1), "b": (0.01, 1)}  # SGD is elementwise: one flat tensor per adapter
    assert set(groups_seen[4]) == {"b"}  # a left after 4 steps, its group went with it
    flat, per_layer = held
    assert len(per_layer) == 28 and flat.numel() >= sum(p.numel() for p in per_layer)  # 14 layers x (A, B)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in per_layer)


@pytest.mark.parametrize("optimizer, kwargs, decay", [("torch.optim.AdamW", {}, 0.1),
                                                      ("torch.optim.SGD", {"momentum": 0.9}, 0.01)])
def test_the_flat_parameter_steps_as_the_per_layer_parameters_would(tmp_path, trainer_kwargs, optimizer, kwargs,
                                                                     decay):
    """An elementwise optimizer steps each adapter's one flat parameter; the weights after training are those of
    the same optimizer stepping every layer's tensors (a subclass, so not known to be elementwise), clipping and
    each adapter's weight decay included."""
    results = {}
    per_tensor = type("PerTensor", (resolve_optimizer(optimizer),), {})
    for label, cls in (("flat", optimizer), ("per_layer", per_tensor)):
        specs = [AdapterSpec("a", lr=0.02, batch_size=2, max_steps=4, grad_clip=0.05, seed=3, weight_decay=decay),
                 AdapterSpec("b", rank=4, lr=0.01, batch_size=1, max_steps=3, seed=4, weight_decay=decay)]
        module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer=cls, optimizer_kwargs=kwargs,
                                 export_dir=str(tmp_path / label), validate_on_finish=False)
        counts = []

        class Watch(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                counts.append(sorted(len(g["params"]) for g in trainer.optimizers[0].param_groups))

        torch.manual_seed(0)
        L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(
            module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(60)}))
        results[label] = (counts[0], {n: dict(load_file(str(tmp_path / label / n / "adapter_model.safetensors")))
                                      for n in ("a", "b")})
    assert results["flat"][0] == [1, 1] and results["per_layer"][0] == [28, 28]
    for name in ("a", "b"):
        flat, per_layer = results["flat"][1][name], results["per_layer"][1][name]
        assert flat.keys() == per_layer.keys()
        for key in flat:
            torch.testing.assert_close(flat[key], per_layer[key], rtol=1e-5, atol=1e-7)
        assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in flat.items() if "lora_B" in k)  # it trained


def test_bad_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match="`optimizer` must be an optimizer class or its import path"):
        resolve_optimizer("torch.optim.NoSuchThing")
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer subclass"):
        resolve_optimizer("torch.nn.Linear")
    # (its first step failed: "float() argument must be a string or a real number, not 'NoneType'")
    with pytest.raises(ValueError, match=r"`optimizer` LBFGS needs a closure at each step .* stepped once after one "
                                         r"shared backward"):
        resolve_optimizer("torch.optim.LBFGS")
    assert resolve_optimizer("torch.optim.SGD") is torch.optim.SGD  # (its closure is optional)
    # (it failed at the first step, after a forward and backward: "SparseAdam does not support dense gradients")
    with pytest.raises(ValueError, match=r"`optimizer` SparseAdam steps sparse gradients alone; the adapters' are "
                                         r"dense"):
        resolve_optimizer("torch.optim.SparseAdam")
    # a class is checked as its import path is (LBFGS given as a class failed at its first step; a module class at
    # the optimizer's construction, "missing 1 required positional argument")
    with pytest.raises(ValueError, match=r"`optimizer` LBFGS needs a closure at each step"):
        resolve_optimizer(torch.optim.LBFGS)
    with pytest.raises(ValueError, match=r"`optimizer` SparseAdam steps sparse gradients alone"):
        resolve_optimizer(torch.optim.SparseAdam)
    with pytest.raises(ValueError, match=r"`optimizer` <class 'torch.nn.modules.linear.Linear'> is not a "
                                         r"torch.optim.Optimizer subclass"):
        resolve_optimizer(torch.nn.Linear)
    assert resolve_optimizer(torch.optim.SGD) is torch.optim.SGD


@pytest.mark.parametrize("kwargs", [["betas", (0.9, 0.95)], "betas=(0.9,0.95)", 0.9])
def test_optimizer_kwargs_that_are_no_mapping_are_a_clear_error(kwargs):
    """A list or text gave Python's "dictionary update sequence element #0 has length 5; 2 is required"."""
    with pytest.raises(ValueError, match=r"`optimizer_kwargs` must be a mapping of the optimizer's argument names to "
                                         r"values, such as \{'betas': \(0.9, 0.95\)\}, got "):
        MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a")], optimizer_kwargs=kwargs)


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "foreach", "fused", "nesterov"])
def test_an_optimizer_flag_that_is_no_bool_is_a_clear_error(flag):
    """``maximize: 'yes'`` was taken (torch's own constructor reads the flag's truth), and ``amsgrad: 'no'`` chose the
    fused AdamW for it on a GPU."""
    with pytest.raises(ValueError, match=rf"`optimizer_kwargs` {flag} must be True or False \(or None\), got 'no'"):
        MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a")], optimizer_kwargs={flag: "no"})
    MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a")], optimizer_kwargs={flag: None})


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


def test_an_exited_adapters_paged_optimizer_states_leave_bitsandbytes_page_manager(tmp_path, trainer_kwargs):
    """bitsandbytes lists every paged state buffer (on a GPU, of 1e5 values or more) in its global page manager, for
    good: an adapter's that exited stayed listed, its buffers held for the rest of the sweep. (On the CPU bitsandbytes
    pages nothing: its states are listed here as the GPU lists them.)"""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import GlobalPageManager

    manager = GlobalPageManager.get_instance()
    specs = [AdapterSpec("a", rank=4, batch_size=1, max_steps=2), AdapterSpec("b", rank=4, batch_size=1, max_steps=4)]
    listed: dict[str, list] = {}

    class ListAsTheGpuDoes(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            for g in opt.param_groups:
                if g["adapter"] not in listed:
                    listed[g["adapter"]] = [t for p in g["params"] for t in opt.state[p].values()
                                            if torch.is_tensor(t) and t.numel() > 1]
                    manager.paged_tensors.extend(listed[g["adapter"]])

    module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer="bitsandbytes.optim.PagedAdamW8bit",
                             export_dir=str(tmp_path), validate_on_finish=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (paged optimizers on the CPU)
            L.Trainer(**trainer_kwargs, callbacks=[ListAsTheGpuDoes()]).fit(
                module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(40)}))
        assert listed["a"] and listed["b"]
        for name in "ab":  # (both exited: finished)
            assert not any(t is u for t in manager.paged_tensors for u in listed[name])
    finally:
        manager.paged_tensors[:] = [t for t in manager.paged_tensors
                                    if not any(t is u for us in listed.values() for u in us)]


def test_the_constructor_gets_an_lr_so_its_own_checks_run_and_a_required_lr_is_given(tmp_path, trainer_kwargs):
    """Each adapter's lr lived in its param group alone: transformers' Adafactor (``relative_step=True``, its
    default) then ignored every adapter's lr and schedule silently (1e-5 and 1e-1 trained alike), and an optimizer
    whose lr has no default (bitsandbytes' SGD8bit) could not be built at all. An optimizer without weight decay is
    said to drop the adapters'."""
    class LrRequired(torch.optim.Rprop):  # (bitsandbytes' SGD8bit's signature: lr with no default; and, as Rprop,
        def __init__(self, params, lr):  # no weight decay)
            super().__init__(params, lr=lr)

    specs = [AdapterSpec("a", lr=0.05, batch_size=2, max_steps=2), AdapterSpec("b", lr=0.01, weight_decay=0.1,
                                                                               batch_size=2, max_steps=2)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, optimizer=LrRequired,
                             export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.warns(UserWarning, match="LrRequired has no `weight_decay`: the adapters' `weight_decay` is not "
                                         "applied"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(40)}))
    assert module.trainer.global_step == 2 and module.trainer.optimizers[0].defaults["lr"] == 0.05
    # an optimizer whose groups take a weight decay (SGD's, through a constructor without it): not warned of; and a
    # warmup's first rate, 0, is no constructor's lr (Lamb and Lion refuse lr <= 0)
    class NoDecayArgument(torch.optim.SGD):
        def __init__(self, params, lr):
            if lr <= 0:
                raise ValueError(f"Invalid learning rate: {lr}")
            super().__init__(params, lr=lr)

    warm = [AdapterSpec("w", lr=0.05, weight_decay=0.1, batch_size=2, max_steps=2, warmup_steps=2)]
    module = MultiLoRAModule("tiny-llama", adapters=warm, optimizer=NoDecayArgument, export_dir=str(tmp_path),
                             validate_on_finish=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(40)}))
    assert not [w for w in seen if "weight_decay" in str(w.message)]
    assert module.registry["w"].step == 2
    module = MultiLoRAModule("tiny-llama", adapters=specs[:1], optimizer="transformers.optimization.Adafactor",
                             export_dir=str(tmp_path), validate_on_finish=False)
    with pytest.raises(ValueError, match=r"`optimizer` Adafactor refused its settings: Cannot combine manual `lr` "
                                         r"and `relative_step=True` options \(with each adapter's `lr` given, the "
                                         r"first 0.05\)"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"x": GeneratedArithmetic(40)}))


@pytest.mark.parametrize("kwargs, message", [
    ({"differentiable": True}, r"differentiable=True: each adapter's weights are leaf parameters the step updates in "
                               r"place"),
    ({"capturable": True}, r"capturable=True needs the adapters on a CUDA device"),
])
def test_step_flags_no_adapter_can_step_with_are_refused_before_the_first_step(tmp_path, trainer_kwargs, kwargs,
                                                                               message):
    """They were built without a word; the first step failed after a whole forward and backward, with torch's "a leaf
    Variable that requires grad is being used in an in-place operation" (or its device assertion)."""
    module = MultiLoRAModule("tiny-llama", optimizer_kwargs=kwargs, adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    with pytest.raises(ValueError, match=message):
        L.Trainer(**{**trainer_kwargs, "accelerator": "cpu"}).fit(
            module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
    assert module.registry["a"].step == 0
