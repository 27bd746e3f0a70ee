"""Adapters trained packed end exactly as if each had been trained alone with PEFT."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import get_scheduler

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule, inject_multilora
from lightning_multilora.base_model import build_base_model
from lightning_multilora.data import AdapterStream, GeneratedArithmetic
from lightning_multilora.module import LLAMA_TARGETS

SPECS = [
    AdapterSpec("a", rank=2, alpha=4, lr=3e-3, batch_size=1, max_steps=20, dataset="add", seed=1),
    AdapterSpec("b", rank=7, alpha=16, lr=1e-3, batch_size=3, max_steps=20, dataset="mul", seed=2,
                weight_decay=0.05, lr_schedule="cosine", warmup_steps=3),
    AdapterSpec("c", rank=4, alpha=3, lr=5e-3, batch_size=2, max_steps=20, dataset="add", seed=3,
                use_rslora=True, grad_clip=0.05, lr_schedule="linear"),
    AdapterSpec("d", rank=8, alpha=8, lr=2e-3, batch_size=4, max_steps=20, dataset="sub", seed=4,
                target_modules=["q_proj", "v_proj"], grad_clip=None),
]


def make_datamodule() -> MultiLoRADataModule:
    return MultiLoRADataModule(sources={
        "add": GeneratedArithmetic(200, seed=1, operations=("add",)),
        "mul": GeneratedArithmetic(200, seed=2, operations=("mul",)),
        "sub": GeneratedArithmetic(200, seed=3, operations=("sub",)),
    })


def train_alone_with_peft(spec: AdapterSpec, dm: MultiLoRADataModule, device: str = "cpu",
                          quantization=None, base=None, module_targets=LLAMA_TARGETS) -> dict[str, torch.Tensor]:
    """The baseline: PEFT LoRA (QLoRA with ``quantization``), torch AdamW, transformers' schedule, the
    adapter's own batches; on the tiny Llama, or the model ``base()`` builds (its module's ``module_targets``)."""
    targets = spec.target_modules or module_targets
    base = base or (lambda: build_base_model("tiny-llama", quantization=quantization))
    layers = inject_multilora(base(), module_targets)
    layers.add_adapter(spec.name, spec.rank, spec.alpha, spec.dropout, spec.use_rslora, targets, spec.seed)
    init = layers.peft_state_dict(spec.name)

    model = get_peft_model(base(), LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, use_rslora=spec.use_rslora,
        target_modules=targets, task_type="CAUSAL_LM")).to(device)
    result = set_peft_model_state_dict(model, {k.replace("base_model.model.", "base_model.model.", 1): v
                                               for k, v in init.items()})
    assert not result.unexpected_keys
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    sched = get_scheduler(spec.lr_schedule, opt, num_warmup_steps=spec.warmup_steps,
                          num_training_steps=spec.max_steps)
    train = dm.split(spec.dataset)[0]
    stream = AdapterStream(len(train), spec.batch_size, spec.seed)
    model.train()
    for _ in range(spec.max_steps):
        idx = stream.next_indices()
        batch = dm.pack([spec.name], [([train.input_ids[i] for i in idx], [train.labels[i] for i in idx])])
        batch = {k: v.to(device) for k, v in batch.items() if k != "layout"}
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if spec.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        sched.step()
    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}


def assert_trained_alike(packed: dict, alone: dict, name: str, rel: float = 1e-3) -> None:
    """Per tensor, by norm: |packed - alone| <= rel |alone|. Not element by element: another CPU (AVX2 kernels instead
    of AVX-512) or the GPU sums in another order, and Adam turns that noise into moves of up to ~lr of the few
    parameters whose gradient is ~0 (measured: 2.5e-5 of a tensor's norm), while a real difference (another batch, a
    lost or doubled update) moves whole tensors by 1e-2 of their norm and more."""
    for key in alone:
        diff, scale = (packed[key].double() - alone[key].double()).norm(), alone[key].double().norm()
        assert diff <= rel * scale, f"{name}: {key}: |difference| {diff:.3g} against |alone| {scale:.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_adapters_equal_each_trained_alone_with_peft(tmp_path, trainer_kwargs, device, exact_fp32):
    module = MultiLoRAModule("tiny-llama", adapters=SPECS, export_dir=str(tmp_path / "out"), validate_on_finish=False)
    dm = make_datamodule()
    L.Trainer(**dict(trainer_kwargs, accelerator=device)).fit(module, dm)
    assert all(r.state.value == "finished" and r.step == 20 for r in module.registry)
    for spec in SPECS:
        packed = load_file(str(tmp_path / "out" / spec.name / "adapter_model.safetensors"))
        alone = train_alone_with_peft(spec, make_datamodule(), device)
        assert set(packed) == set(alone), spec.name
        # On the GPU the grouped kernels sum in another order than cuBLAS: measured on the H200, the
        # largest difference is 7e-6 absolute (1.2e-5 relative per tensor) after 20 steps.
        assert_trained_alike(packed, alone, spec.name)
        # the adapter must have moved, so that the comparison is not of two initialisations
        moved = [k for k in alone if "lora_B" in k and alone[k].abs().max() > 0]
        assert moved, f"adapter {spec.name} did not train"


@pytest.mark.parametrize("device, graphs", [("cpu", False), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                             pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_moe_adapters_add_their_own_rows_router_loss_as_each_alone_with_peft(tmp_path, trainer_kwargs, device, graphs,
                                                                            exact_fp32, tiny_mixtral):
    """A mixture-of-experts base with ``output_router_logits=True``: PEFT's loss (the model's, given labels) adds
    ``router_aux_loss_coef`` times the router's load-balancing loss over the batch. Each packed adapter adds that of
    its own rows, as when it trains alone; it was left out (trained on the cross-entropy alone, silently). With CUDA
    graphs on, its steps run eagerly: a replay has no padding mask, which that loss reads."""
    specs = [dataclasses.replace(s, max_steps=6, grad_clip=None) for s in SPECS if s.name in ("a", "d")]
    module = MultiLoRAModule(tiny_mixtral(), adapters=specs, target_modules=LLAMA_TARGETS[:4],
                             export_dir=str(tmp_path / "out"), validate_on_finish=False, cuda_graphs=graphs)
    L.Trainer(**dict(trainer_kwargs, accelerator=device)).fit(module, make_datamodule())
    assert all(r.state.value == "finished" and r.step == 6 for r in module.registry)
    assert module._step_graphs.captures == 0 and module._step_graphs.enabled == graphs  # (none tried, none failed)
    for spec in specs:
        packed = load_file(str(tmp_path / "out" / spec.name / "adapter_model.safetensors"))
        alone = train_alone_with_peft(spec, make_datamodule(), device, base=tiny_mixtral,
                                      module_targets=LLAMA_TARGETS[:4])
        assert set(packed) == set(alone), spec.name
        assert_trained_alike(packed, alone, spec.name)
        if spec.name == "a":  # (the router's loss moves an adapter: it is in the comparison)
            without = train_alone_with_peft(spec, make_datamodule(), base=lambda: tiny_mixtral(False),
                                            module_targets=LLAMA_TARGETS[:4])
            with pytest.raises(AssertionError):
                assert_trained_alike(packed, without, spec.name)
    # a validation (and `evaluate`) measures the cross-entropy alone, as with the router's logits off
    dm = make_datamodule()
    held = [dm.split(s.dataset)[1] for s in specs]
    batch = dm.pack([s.name for s in specs], [(val.input_ids[:2], val.labels[:2]) for val in held])
    terms = {}
    for on in (True, False):
        m = MultiLoRAModule(tiny_mixtral(on), adapters=specs, target_modules=LLAMA_TARGETS[:4])
        for spec in specs:
            m.lora_layers.add_adapter(spec.name, spec.rank, spec.alpha, target_modules=spec.target_modules,
                                      seed=spec.seed)
        for mode in ("train", "eval"):
            getattr(m, mode)()
            with torch.no_grad(), m.lora_layers.use(batch["layout"]):
                terms[on, mode] = m.adapter_loss_terms(batch)
    torch.testing.assert_close(terms[True, "eval"], terms[False, "eval"])
    torch.testing.assert_close(terms[False, "train"], terms[False, "eval"])
    assert (terms[True, "train"][0] > terms[False, "train"][0]).all()  # (the router's loss, > 0, added in training)


def test_qlora_packed_adapters_equal_each_trained_alone_with_peft_qlora(tmp_path, trainer_kwargs):
    pytest.importorskip("bitsandbytes")
    specs = [s for s in SPECS if s.name in ("a", "d")]
    module = MultiLoRAModule("tiny-llama", adapters=specs, quantization="nf4", export_dir=str(tmp_path / "out"),
                             validate_on_finish=False)
    assert type(module.model.model.layers[0].self_attn.q_proj.base).__name__ == "Linear4bit"
    L.Trainer(**trainer_kwargs).fit(module, make_datamodule())
    for spec in specs:
        packed = load_file(str(tmp_path / "out" / spec.name / "adapter_model.safetensors"))
        alone = train_alone_with_peft(spec, make_datamodule(), quantization="nf4")
        assert set(packed) == set(alone), spec.name
        assert_trained_alike(packed, alone, spec.name)  # the same 4-bit base and fp32 compute on both sides
        assert any(alone[k].abs().max() > 0 for k in alone if "lora_B" in k)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_deterministic_fit_repeated_on_the_gpu_gives_bitwise_the_same_adapters(tmp_path, trainer_kwargs, precision):
    """``Trainer(deterministic=True)``: the grouped kernels add nothing atomically (`triton_lora._Call.deterministic`),
    so a fit run twice, dropout included, writes the same bytes for every adapter."""
    specs = [dataclasses.replace(s, dropout=0.1) if s.name == "b" else s for s in SPECS]
    written = []
    for run in range(2):
        out = tmp_path / f"out{run}"
        module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(out), validate_on_finish=False)
        L.Trainer(**dict(trainer_kwargs, accelerator="cuda", precision=precision, deterministic=True)).fit(
            module, make_datamodule())
        written.append({s.name: load_file(str(out / s.name / "adapter_model.safetensors")) for s in specs})
    for spec in specs:
        first, again = written[0][spec.name], written[1][spec.name]
        assert set(first) == set(again) and any(first[k].abs().max() > 0 for k in first if "lora_B" in k)
        assert all(torch.equal(first[k], again[k]) for k in first), spec.name


def test_with_dropout_an_adapter_trains_as_alone_while_neighbours_exit_and_refill(tmp_path, trainer_kwargs):
    """Adapter "b" with dropout, packed with adapters that exit and are replaced from the queue (other datasets, so
    other padded lengths), ends as this module trains it alone: its masks come from its seed, layer, step and each
    element's row and position, not from the run's random state or its neighbours."""
    b = AdapterSpec("b", rank=4, alpha=8, lr=3e-3, batch_size=2, max_steps=10, dataset="mul", seed=2, dropout=0.3)
    neighbours = [AdapterSpec("a", rank=2, alpha=4, lr=3e-3, batch_size=1, max_steps=3, dataset="add", seed=1),
                  AdapterSpec("c", rank=8, alpha=8, lr=2e-3, batch_size=3, max_steps=4, dataset="sub", seed=3,
                              dropout=0.1),
                  AdapterSpec("e", rank=3, alpha=6, lr=1e-3, batch_size=2, max_steps=5, dataset="add", seed=5)]

    def trained(specs, out, max_running=None):
        module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / out), validate_on_finish=False,
                                 max_running=max_running)
        L.Trainer(**trainer_kwargs).fit(module, make_datamodule())
        assert module.registry["b"].step == 10
        return load_file(str(tmp_path / out / "b" / "adapter_model.safetensors"))

    alone = trained([b], "alone")
    packed = trained([b, *neighbours], "packed", max_running=2)
    assert_trained_alike(packed, alone, "b", rel=1e-5)
    without = trained([AdapterSpec(**{**b.to_dict(), "dropout": 0.0})], "without")
    assert any((without[k] - alone[k]).norm() > 1e-3 * alone[k].norm() for k in alone)  # its dropout mattered


def test_an_adapter_without_padding_trains_bitwise_as_alone_beside_one_with_padding(tmp_path, trainer_kwargs):
    """Rows of one length (``padding="max_length"``): an adapter whose rows fill it trained alone ran the base without
    a mask (all ones: dropped, SDPA's causal path), and beside an adapter with padding with the batch's mask (another
    attention): its weights moved (5e-8 in two steps). Right-padded rows run unmasked, as the captured steps do."""
    from lightning_multilora.data import ListSource

    full = [{"prompt": f"{i:02d}" + "x" * 50, "completion": " " + "y" * 10} for i in range(8)]  # 52 + 11 + <eos>
    short = [{"prompt": f"{i}+1=", "completion": f" {i + 1}"} for i in range(8)]
    specs = {"a": AdapterSpec("a", rank=4, batch_size=2, max_steps=2, lr=3e-3, dataset="full", seed=1, grad_clip=None),
             "p": AdapterSpec("p", rank=2, batch_size=1, max_steps=2, lr=3e-3, dataset="short", seed=2)}

    def trained(names, out):
        dm = MultiLoRADataModule(sources={"full": ListSource(full), "short": ListSource(short)}, padding="max_length",
                                 max_length=64)
        assert {len(r) for r in dm.split("full")[0].input_ids} == {64}  # (no padding in a's rows)
        module = MultiLoRAModule("tiny-llama", adapters=[specs[n] for n in names], export_dir=str(tmp_path / out),
                                 validate_on_finish=False)
        L.Trainer(**trainer_kwargs).fit(module, dm)
        return load_file(str(tmp_path / out / "a" / "adapter_model.safetensors")), module.registry["a"].train_losses

    (alone, alone_losses), (packed, packed_losses) = trained(["a"], "alone"), trained(["a", "p"], "packed")
    assert packed_losses == alone_losses
    for key, value in alone.items():
        torch.testing.assert_close(packed[key], value, atol=0, rtol=0)
