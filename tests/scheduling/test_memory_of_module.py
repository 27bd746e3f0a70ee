"""`AnalyticMemoryModel.of_module` of quantized (bitsandbytes 4-bit and 8-bit) bases and 8-bit optimizers: the bytes
the base holds, the dtype it computes in, and the optimizer states the module keeps."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_multilora import AdapterSpec, MultiLoRAModule
from lightning_multilora.base_model import build_base_model
from lightning_multilora.scheduling.memory import AnalyticMemoryModel

pytest.importorskip("bitsandbytes")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _quiet_module(*args, **kwargs) -> MultiLoRAModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a 4-bit base on the CPU)
        return MultiLoRAModule(*args, **kwargs)


@pytest.fixture
def saved(tmp_path) -> str:
    build_base_model("tiny-llama").save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


@pytest.mark.parametrize("double", [False, True])
def test_a_4bit_bases_quantization_state_is_counted(saved, double):
    """(A `Params4bit`'s quantization state, its blocks' absmax and its code, and double-quantized the nested state's
    own, are no parameters nor buffers: they were left out, 9% of this nf4 base's bytes.)"""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                                bnb_4bit_use_double_quant=double)
    model = AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, dtype=torch.bfloat16)
    states = [layer.weight.quant_state for layer in model.modules() if type(layer).__name__ == "Linear4bit"]
    assert len(states) == 14 and all(s.nested == double for s in states)
    extra = [s.absmax for s in states] + [s.code for s in states]
    if double:
        extra += [s.state2.absmax for s in states] + [s.state2.code for s in states] + [s.offset for s in states]
    held = _bytes([*model.parameters(), *model.buffers()]) + _bytes(extra)
    assert _bytes(extra) > 0.05 * model.get_memory_footprint()
    assert AnalyticMemoryModel.of_module(model).base_bytes() == held
    module = _quiet_module(model, adapters=[AdapterSpec("a", rank=4)], validate_on_finish=False)
    assert AnalyticMemoryModel.of_module(module).base_bytes() == held  # (the module's base: its frozen tensors)
    assert AnalyticMemoryModel.of_module(module).activation_bytes == 2.0  # (its compute dtype)


def test_an_8bit_base_computes_in_its_weights_dtype_and_its_row_scales_are_counted(saved):
    """(An 8-bit base's config holds `bnb_4bit_compute_dtype`'s default, float32, which `of_module` read: a bf16 base
    was counted as computing in 4-byte values, and the module warned a right model of describing another base. Its
    weights' row scales, `SCB`, were left out.)"""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(saved, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                 dtype=torch.bfloat16)
    layers = [layer for layer in model.modules() if type(layer).__name__ == "Linear8bitLt"]
    assert len(layers) == 14
    scales = [layer.weight.SCB for layer in layers]
    held = _bytes([*model.parameters(), *model.buffers()]) + _bytes(scales)
    measured = AnalyticMemoryModel.of_module(model)
    assert (measured.activation_bytes, measured.base_bytes()) == (2.0, held)
    model.train()
    model(torch.tensor([[1, 2, 3]]))  # (the layers' first forward moves the scales onto their `state`)
    assert all(layer.weight.SCB is None and layer.state.SCB is not None for layer in layers)
    assert AnalyticMemoryModel.of_module(model).base_bytes() == held
    module = _quiet_module(model, adapters=[AdapterSpec("a", rank=4)], validate_on_finish=False)
    assert AnalyticMemoryModel.of_module(module).activation_bytes == 2.0


@pytest.mark.parametrize(("optimizer", "kwargs", "states"), [
    ("torch.optim.AdamW", {}, 2.0),
    ("bitsandbytes.optim.AdamW8bit", {}, 0.5),
    ("bitsandbytes.optim.PagedAdamW8bit", {}, 0.5),
    ("bitsandbytes.optim.AdamW", {"optim_bits": 8}, 0.5),
    ("bitsandbytes.optim.AdamW", {}, 2.0),
    ("bitsandbytes.optim.Lion8bit", {}, 0.25),
    ("bitsandbytes.optim.Lion", {}, 1.0),
    ("bitsandbytes.optim.AdEMAMix8bit", {}, 0.75),
    # (a torch optimizer's: AdamW's two stood for any, AdamW with amsgrad keeping three, SGD none)
    ("torch.optim.AdamW", {"amsgrad": True}, 3.0),
    ("torch.optim.SGD", {}, 0.0),
    ("torch.optim.SGD", {"momentum": 0.9}, 1.0),
    ("torch.optim.RMSprop", {"momentum": 0.9, "centered": True}, 3.0),
])
def test_the_optimizer_states_are_those_of_the_optimizer_the_module_steps(optimizer, kwargs, states):
    """(`of_module` kept AdamW's two fp32 states whatever the module stepped: a module stepping AdamW8bit, one byte a
    state, was counted four times its optimizer's bytes.)"""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4)], optimizer=optimizer,
                             optimizer_kwargs=kwargs, validate_on_finish=False)
    assert AnalyticMemoryModel.of_module(module).optimizer_states == states
    assert AnalyticMemoryModel.of_module(module, optimizer_states=1).optimizer_states == 1  # (a field given wins)


def test_an_8bit_optimizers_states_predicted_are_those_it_holds(tmp_path, trainer_kwargs):
    """The states an AdamW8bit holds after a step (one byte a value, and a float32 scale per 256 of them), against
    `of_module`'s count for the same adapter (its tensors at least bitsandbytes' `min_8bit_size`, 4096 values)."""
    import lightning as L

    from lightning_multilora import MultiLoRADataModule
    from lightning_multilora.data import GeneratedArithmetic

    spec = AdapterSpec("a", rank=64, batch_size=1, max_steps=2, target_modules=["q_proj", "o_proj"])
    module = MultiLoRAModule("tiny-llama", adapters=[spec], optimizer="bitsandbytes.optim.AdamW8bit",
                             validate_on_finish=False)
    held = {}

    class Peek(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            optimizer = trainer.optimizers[0]
            if held:  # (after the first step: the adapter still running, its group in the optimizer)
                return
            held["states"] = sum(v.numel() * v.element_size() for g in optimizer.param_groups for p in g["params"]
                                 for k, v in optimizer.state[p].items() if torch.is_tensor(v) and k != "qmap1"
                                 and k != "qmap2")
            held["values"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])

    L.Trainer(**{**trainer_kwargs, "callbacks": [Peek()]}).fit(
        module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(20)}, max_val_examples=2))
    model = AnalyticMemoryModel.of_module(module)
    predicted = held["values"] * model.adapter_bytes_per_param * model.optimizer_states
    assert held["values"] == 2 * 64 * (64 + 64) * 2  # (A and B of two projections in each of two layers)
    assert predicted <= held["states"] <= 1.04 * predicted
