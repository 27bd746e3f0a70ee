"""MultiLoRALinear and inject_multilora on Llama, Mistral and Qwen2 (q/k/v bias) built from configs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_multilora import BatchLayout, MultiLoRALinear, inject_multilora
from lightning_multilora.base_model import build_base_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("base", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_inject_wraps_every_target_and_freezes_the_base(base):
    model = build_base_model(base)
    layers = inject_multilora(model, TARGETS)
    assert len(layers) == 7 * model.config.num_hidden_layers
    assert all(isinstance(m, MultiLoRALinear) for m in layers.values())
    assert not any(p.requires_grad for p in model.parameters())
    if base == "tiny-qwen2":
        assert layers["model.layers.0.self_attn.q_proj"].base.bias is not None
    layers.add_adapter("a", rank=3, alpha=6)
    assert all(p.requires_grad for p in layers.parameters_of("a"))
    assert len(layers.parameters_of("a")) == 2 * len(layers)


def test_unknown_target_lists_the_models_linear_modules():
    with pytest.raises(ValueError, match=r"\['qproj'\].*'down_proj'.*'q_proj'"):
        inject_multilora(build_base_model("tiny-llama"), ["qproj", "v_proj"])
    with pytest.raises(ValueError, match="not a linear layer"):
        inject_multilora(build_base_model("tiny-llama"), ["mlp"])
    layers = inject_multilora(build_base_model("tiny-llama"), ["q_proj"])
    with pytest.raises(ValueError, match="not among the injected layers"):
        layers.add_adapter("a", 2, 4, target_modules=["v_proj"])


def test_peft_initialisation_and_scaling():
    layer = MultiLoRALinear(nn.Linear(40, 30))
    layer.add_adapter("a", rank=5, alpha=10, generator=torch.Generator().manual_seed(0))
    layer.add_adapter("rs", rank=4, alpha=10, use_rslora=True)
    a = layer.lora_A["a"]
    bound = 1 / math.sqrt(40)  # kaiming_uniform(a=sqrt(5)) on fan_in 40
    assert a.shape == (5, 40) and a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert layer.lora_B["a"].shape == (30, 5) and not layer.lora_B["a"].any()
    assert layer.scaling == {"a": 2.0, "rs": 5.0}
    with pytest.raises(ValueError, match="already exists"):
        layer.add_adapter("a", rank=5, alpha=10)
    layer.remove_adapter("a")
    assert layer.adapter_names == ["rs"]


def test_initialisation_depends_only_on_the_adapters_seed():
    one = inject_multilora(build_base_model("tiny-llama"), TARGETS)
    two = inject_multilora(build_base_model("tiny-llama"), TARGETS)
    one.add_adapter("x", 4, 8, seed=7)
    two.add_adapter("other", 2, 4, seed=1)
    two.add_adapter("x", 4, 8, seed=7)
    for p, q in zip(one.parameters_of("x"), two.parameters_of("x")):
        assert torch.equal(p, q)


def test_each_row_uses_its_own_adapter_and_unassigned_rows_the_base():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    layer = MultiLoRALinear(base)
    for name, r in (("a", 2), ("b", 3)):
        layer.add_adapter(name, rank=r, alpha=2 * r)
        nn.init.normal_(layer.lora_B[name])
    x = torch.randn(5, 7, 16)  # (B, T, d_in)
    layout = BatchLayout(("a", "b"), (0, 3), (2, 5), 5)  # row 2 has no adapter
    with layer.context.use(layout):
        y = layer(x)
    expected = base(x)
    for name, rows in (("a", slice(0, 2)), ("b", slice(3, 5))):
        expected[rows] += layer.scaling[name] * x[rows] @ layer.lora_A[name].t() @ layer.lora_B[name].t()
    torch.testing.assert_close(y, expected)
    with pytest.raises(RuntimeError, match="layout describes 5"):
        with layer.context.use(layout):
            layer(x[:4])


@pytest.mark.parametrize("rank", [4, 40])  # (rank tiles: dB launched with dS, and after the dS row launch)
def test_an_inputs_gradient_leaves_the_adapters_gradients_alone_on_the_triton_path(rank):
    """``torch.autograd.grad`` w.r.t. the input (saliency, a gradient penalty, adversarial embeddings) adds nothing
    to the adapters' ``.grad`` with the layer's direct gradients, as with PEFT's; ``backward`` then adds as usual;
    asking autograd for the adapters' gradients names ``direct_grads``."""
    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: the interpreter, set by conftest)
    before = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        torch.manual_seed(0)
        layer = MultiLoRALinear(nn.Linear(16, 12))
        for name in ("a", "b"):
            layer.add_adapter(name, rank=rank, alpha=rank)
            nn.init.normal_(layer.lora_B[name])
        layer.to(device)
        x = torch.randn(4, 3, 16, device=device, requires_grad=True)
        with layer.context.use(BatchLayout(("a", "b"), (0, 2), (2, 4), 4)):
            (dx,) = torch.autograd.grad(layer(x).square().sum(), [x])
            assert all(p.grad is None for p in layer.parameters() if p.requires_grad)
            layer(x).square().sum().backward()
            torch.testing.assert_close(x.grad, dx, rtol=1e-4, atol=1e-5)  # (the fused launch adds dS atomically)
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters() if p.requires_grad)
            with pytest.raises(RuntimeError, match="direct_grads=False"):
                torch.autograd.grad(layer(x).sum(), [x, layer.lora_A["a"]])
    finally:
        kernels.set_backend(before)
