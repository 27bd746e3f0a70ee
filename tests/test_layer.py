"""MultiLoRALinear and inject_multilora on Llama, Mistral and Qwen2 (q/k/v bias) built from configs."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

from lightning_multilora import BatchLayout, MultiLoRALinear, inject_multilora
from lightning_multilora.base_model import build_base_model
from lightning_multilora.layer import LayoutContext

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


def test_adapters_on_a_float64_base_are_float64_as_peft_makes_them():
    """PEFT's adapters take a float64 base's dtype; ours stayed float32, and a float64 run (``precision="64-true"``,
    the oracle's) trained in float32 (2e-7 from PEFT's float64 run). On a bf16 base they stay float32, drawn alike."""
    bases = {dtype: build_base_model("tiny-llama").to(dtype) for dtype in (torch.float32, torch.float64,
                                                                           torch.bfloat16)}
    layers = {dtype: inject_multilora(model, TARGETS) for dtype, model in bases.items()}
    for held in layers.values():
        held.add_adapter("x", 4, 8, seed=7)
    params = {dtype: held.parameters_of("x") for dtype, held in layers.items()}
    assert {p.dtype for p in params[torch.float64]} == {torch.float64}
    assert {p.dtype for p in params[torch.bfloat16]} == {p.dtype for p in params[torch.float32]} == {torch.float32}
    for p, q, r in zip(params[torch.float32], params[torch.float64], params[torch.bfloat16]):
        assert torch.equal(p.double(), q) and torch.equal(p, r)  # (drawn in float32, whatever they are held in)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    layer = layers[torch.float64]["model.layers.0.self_attn.q_proj"]
    with torch.no_grad():
        layer.lora_B["x"].normal_()
    layer.context.layout = BatchLayout.from_sizes(["x"], [2])
    expected = layer.base(x) + 2.0 * (x @ layer.lora_A["x"].t()) @ layer.lora_B["x"].t()
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_an_adapters_initialisation_and_dropout_do_not_depend_on_the_other_injected_layers():
    """(Each layer's generator was seeded by the layer's position among the injected ones: the same spec started
    from other weights in a module injecting more layers.)"""
    few = inject_multilora(build_base_model("tiny-llama"), ["q_proj", "v_proj"])
    every = inject_multilora(build_base_model("tiny-llama"), "all-linear")
    for layers in (few, every):
        layers.add_adapter("x", 4, 8, dropout=0.1, target_modules=["v_proj"], seed=1)
    assert set(few._targets["x"]) == set(every._targets["x"]) and len(few._targets["x"]) == 2
    for name in few._targets["x"]:
        assert torch.equal(few[name].lora_A["x"], every[name].lora_A["x"])
        assert few[name].streams["x"] == every[name].streams["x"]
    layer_0, layer_1 = few._targets["x"]
    assert not torch.equal(few[layer_0].lora_A["x"], few[layer_1].lora_A["x"])  # (each layer its own draw)


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


def test_a_layer_keeps_the_weights_of_recent_layouts_while_its_adapters_stay(monkeypatch):
    """A layout met again (an epoch's short last batch between full ones) reuses the weights, with the device tables
    the kernels made for them; a removed adapter drops them all (they would hold its parameters)."""
    from lightning_multilora import layer as layer_module

    monkeypatch.setattr(layer_module, "KEPT_LAYOUTS", 6)
    layer = MultiLoRALinear(nn.Linear(16, 12))
    for name in ("a", "b"):
        layer.add_adapter(name, rank=2, alpha=2)
    x = torch.randn(4, 3, 16)
    layouts = [BatchLayout(("a", "b"), (0, 2), (2, 4), 4), BatchLayout(("a", "b"), (0, 1), (1, 3), 3)]
    made = {}
    for i, layout in enumerate(layouts * 2):  # (equal layouts, new objects: compared by value)
        layout = BatchLayout(layout.names, layout.starts, layout.ends, layout.num_rows)
        with layer.context.use(layout):
            layer(x[:layout.num_rows])
        made.setdefault(i % 2, []).append(layer._weights)
    assert made[0][0] is made[0][1] and made[1][0] is made[1][1] and made[0][0] is not made[1][0]
    others = ([BatchLayout(("a", "b"), (0, k), (k, 4), 4) for k in (0, 1, 3, 4)]
              + [BatchLayout(("a",), (0,), (k,), 4) for k in (1, 2, 3, 4)])
    assert len(others) >= layer_module.KEPT_LAYOUTS - 1
    for layout in others[:layer_module.KEPT_LAYOUTS - 1]:  # the least recent (the first layout) forgotten
        with layer.context.use(layout):
            layer(x)
    with layer.context.use(layouts[0]):
        layer(x)
    assert layer._weights is not made[0][0] and len(layer._kept) == layer_module.KEPT_LAYOUTS
    removed = layer.lora_A["b"]
    layer.remove_adapter("b")
    assert not layer._kept and layer._weights is None  # (none holds the removed adapter's weights)
    with layer.context.use(BatchLayout(("a",), (0,), (4,), 4)):
        layer(x)
    assert len(layer._kept) == 1 and all(removed is not t for w in layer._kept.values() if w is not None for t in w.a)


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


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_adapter_without_rows_in_a_layout_gets_no_gradient_as_with_autograd(backend):
    """An adapter the layout names with no rows: the kernels gave it zero gradients, which AdamW's momentum and
    weight decay then stepped, where the reference (and PEFT, the adapter not run) gives it none."""
    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: the interpreter, set by conftest)
    before = kernels.get_backend()
    kernels.set_backend(backend)
    try:
        torch.manual_seed(0)
        layer = MultiLoRALinear(nn.Linear(16, 12))
        for name in ("a", "b"):
            layer.add_adapter(name, rank=4, alpha=4)
            nn.init.normal_(layer.lora_B[name])
        layer.to(device)
        x = torch.randn(4, 3, 16, device=device)
        with layer.context.use(BatchLayout(("a", "b"), (0, 4), (4, 4), 4)):
            layer(x).square().sum().backward()
        assert layer.lora_A["a"].grad is not None and layer.lora_A["a"].grad.abs().sum() > 0
        assert layer.lora_A["b"].grad is None and layer.lora_B["b"].grad is None
    finally:
        kernels.set_backend(before)


def test_a_forward_hook_on_the_base_keeps_the_bases_own_output_on_the_triton_path():
    """A hook registered on a linear before it was wrapped (activation capture) stays on the wrapped base; the
    kernels added the LoRA term into the output the hook held: base + LoRA on the GPU, the base's alone on the CPU."""
    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: the interpreter, set by conftest)
    held = []
    base = nn.Linear(16, 12, bias=False).to(device)
    base.register_forward_hook(lambda module, args, out: held.append(out))
    layer = MultiLoRALinear(base)
    layer.add_adapter("a", rank=4, alpha=4)
    nn.init.normal_(layer.lora_B["a"])
    x = torch.randn(2, 3, 16, device=device)
    before = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        with layer.context.use(BatchLayout(("a",), (0,), (2,), 2)):
            y = layer(x)
    finally:
        kernels.set_backend(before)
    torch.testing.assert_close(held[-1].reshape(2, 3, 12), base(x))
    assert not torch.allclose(y, base(x))


@pytest.mark.parametrize("how", ["backward_hook", "global_hook", "forward_replaced"])
def test_a_base_hooked_otherwise_or_with_its_forward_replaced_is_called_as_a_module(how):
    """The fused path runs the base's product inside the LoRA function, its ``__call__`` skipped: a full backward hook
    on it, a global module hook, or a forward replaced on the instance (accelerate's offload hooks) were skipped with
    it, where PEFT calls the base."""
    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: the interpreter, set by conftest)
    calls = []
    base = nn.Linear(16, 12, bias=False).to(device).requires_grad_(False)
    handle = None
    if how == "backward_hook":
        base.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append("backward"))
    elif how == "global_hook":
        handle = nn.modules.module.register_module_forward_hook(
            lambda module, args, out: calls.append("forward") if module is base else None)
    else:
        plain = base.forward
        base.forward = lambda x: calls.append("forward") or plain(x)
    layer = MultiLoRALinear(base)
    layer.add_adapter("a", rank=4, alpha=4)
    nn.init.normal_(layer.lora_B["a"])
    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    before = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        with layer.context.use(BatchLayout(("a",), (0,), (2,), 2)):
            layer(x).square().sum().backward()
    finally:
        kernels.set_backend(before)
        if handle is not None:
            handle.remove()
    assert calls and layer.lora_A["a"].grad is not None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_scaling_or_dropout_set_after_a_forward_reaches_the_next(backend):
    """The kernels' weights of a layout are cached with each adapter's scaling and dropout by value: a value set in
    `scaling` after a forward (as PEFT's `set_scale` sets it) changed nothing until `forget_weights()`."""
    import copy
    import pickle

    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU, triton: the interpreter, set by conftest)
    torch.manual_seed(0)
    layer = MultiLoRALinear(nn.Linear(16, 12)).to(device)
    layer.add_adapter("a", rank=2, alpha=2)
    nn.init.normal_(layer.lora_B["a"])
    x = torch.randn(2, 3, 16, device=device)
    layout = BatchLayout(("a",), (0,), (2,), 2)
    before = kernels.get_backend()
    kernels.set_backend(backend)
    try:
        with layer.context.use(layout):
            first = layer(x)
            layer.scaling["a"] *= 2
            doubled = layer(x)
            layer.scaling.update(a=0.0)
            off = layer(x)
    finally:
        kernels.set_backend(before)
    base = layer.base(x)
    torch.testing.assert_close(doubled - base, 2 * (first - base))
    torch.testing.assert_close(off, base)
    for copied in (copy.deepcopy(layer.scaling), pickle.loads(pickle.dumps(layer.scaling))):
        assert copied == {"a": 0.0} and type(copied) is type(layer.scaling)  # (a module deep-copied or pickled)


def _train_with_dropout(backend, rows, streams=True, checkpointed=False, steps=2, lengths=None):
    """Adapter "b"'s outputs over ``steps`` training forwards and its gradients, with the adapters of ``rows`` (name:
    rows, in order) sharing the batch; each adapter's rows are its own ids whatever its neighbours, ``lengths[name]``
    tokens long (default 8), right-padded to the longest."""
    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU, triton: the interpreter, set by conftest)
    before = kernels.get_backend()
    kernels.set_backend(backend)
    try:
        torch.manual_seed(0)
        # (one decoder layer: the interpreter's kernels, each of its three layers' two steps, are most of the time)
        model = build_base_model("tiny-llama", {"num_hidden_layers": 1}).float().to(device)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = inject_multilora(model, ["q_proj", "v_proj", "down_proj"])
        for name in rows:
            layers.add_adapter(name, rank=4, alpha=8, dropout=0.3, seed=ord(name))
            generator = torch.Generator().manual_seed(ord(name))
            for layer_name in layers.layers_for(None):
                b = layers[layer_name].lora_B[name]
                with torch.no_grad():
                    b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
            if not streams:  # masks from torch's random state, as before streams
                for layer in layers.values():
                    layer.streams.pop(name, None)
        model.train()
        bounds = torch.tensor([0, *rows.values()]).cumsum(0).tolist()
        layout = BatchLayout(tuple(rows), tuple(bounds[:-1]), tuple(bounds[1:]), bounds[-1])
        lengths = {name: 8 for name in rows} | dict(lengths or {})
        longest = max(lengths.values())
        ids = torch.cat([torch.nn.functional.pad(
            torch.randint(1, 100, (n, lengths[name]), generator=torch.Generator().manual_seed(ord(name))),
            (0, longest - lengths[name])) for name, n in rows.items()]).to(device)
        i = list(rows).index("b")
        torch.manual_seed(len(rows))  # another random state for each set of adapters
        outs = []
        for _ in range(steps):
            with layers.use(layout):
                out = model(input_ids=ids).logits[bounds[i]:bounds[i + 1], :lengths["b"]]
                out.square().mean().backward()
            outs.append(out.detach())
        return outs, [p.grad for p in layers.parameters_of("b")]
    finally:
        kernels.set_backend(before)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_adapters_dropout_masks_do_not_depend_on_its_neighbours(backend):
    """With dropout, an adapter's outputs and gradients over two steps are the same alone as packed between others
    (its rows elsewhere in the batch, padded to a neighbour's longer rows, another random state): its masks come from
    its seed, layer, step and each element's row and position. Masks drawn from torch's random state (no streams)
    differ."""
    alone = _train_with_dropout(backend, {"b": 2})
    packed = _train_with_dropout(backend, {"a": 3, "b": 2, "c": 1})
    longer = _train_with_dropout(backend, {"a": 3, "b": 2}, lengths={"a": 13})  # b's rows padded to 13 tokens
    for ours, theirs, padded in zip(alone[0] + alone[1], packed[0] + packed[1], longer[0] + longer[1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours, padded, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(alone[0][0], alone[0][1])  # each step its own masks
    shared = _train_with_dropout(backend, {"a": 3, "b": 2, "c": 1}, streams=False, steps=1)
    assert not torch.allclose(shared[0][0], packed[0][0])


def test_a_checkpointed_forward_recomputes_the_adapters_dropout_masks(triton_backend):
    """Gradient checkpointing recomputes each layer's forward in backward: the same masks (same seeds, same step),
    so the gradients are the uncheckpointed run's."""
    plain = _train_with_dropout("triton", {"a": 3, "b": 2}, steps=1)
    checkpointed = _train_with_dropout("triton", {"a": 3, "b": 2}, checkpointed=True, steps=1)
    for ours, theirs in zip(plain[0] + plain[1], checkpointed[0] + checkpointed[1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_dropout_steps_count_an_adapters_training_forwards():
    """An adapter's dropout step advances at each forward with gradients in which it has rows and dropout (not at one
    that raises); a removed adapter's slot goes to the next one added, from step 0; a resumed run sets the steps."""
    layers = inject_multilora(build_base_model("tiny-llama").float(), ["q_proj"])
    for name, dropout in (("a", 0.1), ("b", 0.0), ("c", 0.2)):
        layers.add_adapter(name, rank=2, alpha=4, dropout=dropout)
    layout = BatchLayout(("a", "b", "c"), (0, 2, 3), (2, 3, 3), 3)  # ("c": no rows)
    ids = torch.randint(0, 100, (3, 4))
    with layers.use(layout):
        layers.model(input_ids=ids)
    with torch.no_grad(), layers.use(layout):  # an evaluation
        layers.model(input_ids=ids)
    assert layers.dropout_steps() == {"a": 1, "b": 0, "c": 0}
    with pytest.raises(RuntimeError, match="out of memory"), layers.use(layout):  # a step that fails takes none
        layers.model(input_ids=ids)
        raise RuntimeError("out of memory")
    assert layers.dropout_steps() == {"a": 1, "b": 0, "c": 0}
    layers.set_dropout_steps({"a": 7})
    assert layers.dropout_steps()["a"] == 7
    layers.remove_adapter("a")
    layers.add_adapter("d", rank=2, alpha=4, dropout=0.1)
    assert layers.dropout_steps() == {"b": 0, "c": 0, "d": 0}
    with pytest.raises(KeyError, match=r"\['zz'\].*present"):
        layers.set_dropout_steps({"zz": 1})
    for step in (-1, 1.5, True, 2**70):
        with pytest.raises(ValueError, match=r"dropout steps must be integers in \[0, 2\*\*62\)"):
            layers.set_dropout_steps({"b": step})
    for dropout in (1.0, -0.5, float("nan"), "0.1"):
        with pytest.raises(ValueError, match=r"`dropout` must be a number in \[0, 1\)"):
            layers.add_adapter("e", rank=2, alpha=4, dropout=dropout)


def test_a_second_training_forward_inside_one_use_is_warned_of():
    """The dropout steps advance as `use` opens: a second training forward inside it would repeat the masks."""
    layers = inject_multilora(build_base_model("tiny-llama").float(), ["q_proj"])
    layers.add_adapter("a", rank=2, alpha=4, dropout=0.1)
    ids = torch.randint(0, 100, (2, 4))
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        layers.model(input_ids=ids)
        with pytest.warns(UserWarning, match="repeats the adapters' dropout masks"):
            layers.model(input_ids=ids)
    layers.model.eval()  # an evaluation with gradients on: no dropout, no step
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        layers.model(input_ids=ids)
    assert layers.dropout_steps() == {"a": 1}


def test_a_training_forward_on_the_meta_device_with_dropout_runs():
    """Shapes only (a model sized before it is materialized): no masks are drawn from the meta step table."""
    with torch.device("meta"):
        model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj"])
    layers.add_adapter("a", rank=2, alpha=4, dropout=0.1)
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        out = model(input_ids=torch.zeros(2, 5, dtype=torch.long, device="meta")).logits
    assert out.is_meta and out.shape[:2] == (2, 5) and layers.dropout_steps() == {"a": 0}


def test_peft_weights_of_another_rank_or_targets_are_refused_not_broadcast():
    """``copy_`` broadcasts: a rank-1 adapter's weights loaded into a rank-4 one filled every row with copies (its
    update 4x too large), and weights of layers the adapter does not target were dropped, silently."""
    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8, seed=1, target_modules=["q_proj"])
    layers.add_adapter("one", rank=1, alpha=8, seed=2, target_modules=["q_proj"])
    layers.add_adapter("qv", rank=4, alpha=8, seed=3)
    good = layers.peft_state_dict("a")
    layers.load_peft_state_dict("a", {k: v + 1 for k, v in good.items()})
    assert all(torch.equal(v, good[k] + 1) for k, v in layers.peft_state_dict("a").items())
    before = layers.peft_state_dict("a")
    with pytest.raises(ValueError, match=r"weights for adapter 'a' do not fit it: other shapes: .*lora_A.weight "
                                         r"\(1, 64\) \(adapter 'a''s is \(4, 64\)\)"):
        layers.load_peft_state_dict("a", layers.peft_state_dict("one"))
    with pytest.raises(ValueError, match=r"not targeted by it \[.*v_proj.lora_A.weight"):
        layers.load_peft_state_dict("a", layers.peft_state_dict("qv"))
    with pytest.raises(ValueError, match=r"missing \[.*q_proj.lora_B.weight"):
        layers.load_peft_state_dict("a", {k: v for k, v in good.items() if "lora_A" in k})
    # DoRA's magnitudes and LoRA biases (PEFT's use_dora / lora_bias) have no place here: ignored, outputs were wrong
    dora = {k.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(64) for k in good if "lora_A" in k}
    with pytest.raises(ValueError, match=r"not plain LoRA weights .*lora_magnitude_vector"):
        layers.load_peft_state_dict("a", {**good, **dora})
    with pytest.raises(ValueError, match=r"not plain LoRA weights .*lora_B.bias"):
        layers.load_peft_state_dict("a", {**good, **{k.replace("weight", "bias"): torch.zeros(64) for k in good
                                                     if "lora_B" in k}})
    # PEFT's bias="all" / "lora_only" save the base's biases, modules_to_save a copy of the module: dropped, silently
    for other in ("base_model.model.model.layers.0.self_attn.q_proj.bias", "base_model.model.lm_head.weight"):
        with pytest.raises(ValueError, match=rf"not plain LoRA weights .*bias='all'.*\['{re.escape(other)}'\]"):
            layers.load_peft_state_dict("a", {**good, other: torch.zeros(64)})
    with pytest.raises(ValueError, match=r"not tensors \["):
        layers.load_peft_state_dict("a", {k: v.tolist() for k, v in good.items()})
    assert all(torch.equal(v, before[k]) for k, v in layers.peft_state_dict("a").items())  # nothing loaded



@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=2.5), "`rank` must be an integer >= 1, got 2.5"), (dict(rank=True), "`rank` must be an integer"),
    (dict(name=3), "`name` must be 1 to 200 letters"), (dict(name="a.b"), "`name` must be 1 to 200 letters"),
    (dict(alpha="x"), "`alpha` must be a number > 0, got 'x'"), (dict(alpha=float("nan")), "`alpha` must be"),
    (dict(dropout=1.0), "`dropout` must be a number in \\[0, 1\\)"), (dict(use_rslora="yes"), "`use_rslora` must be"),
    (dict(seed=1.5), "`seed` must be an integer"), (dict(dtype="float32"), "`dtype` must be a floating torch.dtype")])
def test_an_adapters_bad_argument_is_named_before_any_layer_changes(kwargs, message):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    layers = inject_multilora(model, ["0", "1"])
    args = dict(dict(name="a", rank=2, alpha=4), **kwargs)
    with pytest.raises(ValueError, match=f"LoRALayers.add_adapter: {message}"):
        layers.add_adapter(**args)
    assert not layers.adapter_names and all(not layer.lora_A for layer in layers.values())
    if "seed" not in kwargs:  # (one layer's adapter takes a generator, not a seed)
        with pytest.raises(ValueError, match=f"MultiLoRALinear.add_adapter: {message}"):
            MultiLoRALinear(nn.Linear(8, 8)).add_adapter(**args)


@pytest.mark.parametrize("args, message", [
    ((("a", "b"), (0, 1), (1, 2), 2.0), "`num_rows` must be an integer >= 0, got 2.0"),
    ((("a",), (0.5,), (1,), 2), "`starts` must be a sequence of row indices"),
    (("a", (0,), (1,), 1), "`names` must be a sequence of adapter names")])
def test_a_bad_layout_is_named_and_a_good_one_holds_tuples_of_ints(args, message):
    import numpy as np

    with pytest.raises(ValueError, match=f"BatchLayout: {message}"):
        BatchLayout(*args)
    layout = BatchLayout(["a"], [np.int64(0)], [1], np.int64(2))
    assert layout == BatchLayout(("a",), (0,), (1,), 2) and type(layout.starts[0]) is int and hash(layout.starts)


@pytest.mark.parametrize("targets", [None, ["q_proj", 3], 3])
def test_target_modules_that_are_not_names_are_named(targets):
    with pytest.raises(ValueError, match=r"`target_modules` must be a list of module names, a regex string or "
                                         r"'all-linear', got"):
        inject_multilora(build_base_model("tiny-llama"), targets)
    layers = inject_multilora(build_base_model("tiny-llama"), ["q_proj"])
    if targets is not None:
        with pytest.raises(ValueError, match=r"`target_modules` must be a list of module names, a regex string or "
                                             r"None, got"):
            layers.add_adapter("a", rank=2, alpha=4, target_modules=targets)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_conv1d_and_flattened_token_layers_run_the_kernels_as_the_reference(family):
    """GPT-2's Conv1D projections (weight (in, out)) and OPT's fc1 / fc2, which take the tokens flattened to (rows x
    tokens, d): the Triton path (the interpreter on the CPU, fp32; bf16 on a GPU) gives the reference's logits and
    gradients, and each adapter's rows differ from the base's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_multilora import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = {"gpt2": dict(n_layer=1, n_embd=32, n_head=2),
             "opt": dict(hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                         word_embed_proj_dim=32)}[family]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=64, **sizes))
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(1)).to(device)
    layout = BatchLayout(("a", "b"), (0, 1), (1, 3), 3)
    results = {}
    before = kernels.get_backend()
    try:
        for backend in ("reference", "triton"):
            kernels.set_backend(backend)
            torch.manual_seed(2)  # (the same B for both)
            model = copy.deepcopy(base).to(device, dtype)
            layers = inject_multilora(model, "all-linear")
            for name in ("a", "b"):
                layers.add_adapter(name, rank=3 if name == "a" else 5, alpha=8, seed=ord(name))
                for layer_name in layers.layers_for(None):
                    with torch.no_grad():
                        layers[layer_name].lora_B[name].normal_(0, 0.2)
            with layers.use(layout):
                logits = model(input_ids=ids).logits.float()
                logits.square().mean().backward()
            with torch.no_grad():
                plain = model(input_ids=ids).logits.float()
            results[backend] = (logits.detach(), plain, [p.grad.float() for n in ("a", "b")
                                                         for p in layers.parameters_of(n)])
    finally:
        kernels.set_backend(before)
    assert any(isinstance(m, MultiLoRALinear) and m.fan_in_fan_out for m in model.modules()) == (family == "gpt2")
    (ref, plain, ref_grads), (got, _, grads) = results["reference"], results["triton"]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, ref, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)
    assert (ref[0] - plain[0]).abs().max() > 1e-3 and (ref[1:] - plain[1:]).abs().max() > 1e-3


def test_flattened_tokens_must_be_the_whole_batch_seen_in_three_dimensions():
    """A layer given tokens flattened (OPT's fc1) takes rows x tokens of them, the tokens the model's other layers
    took per row; a share of them (a mixture-of-experts layer's routed tokens) whose count merely divides by the rows
    is refused, not spread over the adapters as if it were the batch. One a row (pooled features) is taken as such."""
    context = LayoutContext()
    attn, expert = MultiLoRALinear(nn.Linear(8, 8), context), MultiLoRALinear(nn.Linear(8, 8), context)
    for layer in (attn, expert):
        layer.add_adapter("a", rank=2, alpha=2)
        layer.add_adapter("b", rank=2, alpha=2)
    with context.use(BatchLayout(("a", "b"), (0, 1), (1, 2), 2)):
        attn(torch.randn(2, 3, 8))
        assert expert(torch.randn(6, 8)).shape == (6, 8)  # the whole batch, flattened
        with pytest.raises(RuntimeError, match=r"got an input of shape \(4, 8\) but the layout describes 2 rows of 3 "
                                               r"tokens.*mixture-of-experts routing"):
            expert(torch.randn(4, 8))  # 4 of its 6 tokens
    # a head on pooled features, one a row, after the (rows, tokens, d) layers: each row its adapter's (it was refused)
    pooled = torch.randn(2, 8)
    with torch.no_grad():  # (B nonzero: the adapters change the output)
        for p in expert.parameters():
            if p.requires_grad:
                p.normal_()
    with context.use(BatchLayout(("a", "b"), (0, 1), (1, 2), 2)):
        alone = expert(pooled)
    assert not torch.allclose(alone, expert.base(pooled))
    with context.use(BatchLayout(("a", "b"), (0, 1), (1, 2), 2)):
        attn(torch.randn(2, 3, 8))
        torch.testing.assert_close(expert(pooled), alone)


def test_a_second_injection_and_multihead_attentions_projection_are_refused():
    """A second injection with "all-linear" (or a regex) wrapped the first one's base layers again (nested layers, a
    second layout context); nn.MultiheadAttention reads its out_proj's weight itself: wrapped, every forward failed
    (no `weight`), and an adapter there would change nothing."""
    model = build_base_model("tiny-llama")
    inject_multilora(model, ["q_proj"])
    for targets in ("all-linear", r".*\.v_proj", ["v_proj"]):
        with pytest.raises(ValueError, match=r"already holds MultiLoRALinear layers .*inject once per model"):
            inject_multilora(model, targets)
    encoder = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    layers = inject_multilora(encoder, "all-linear")
    assert sorted(layers) == ["linear1", "linear2"]  # (not self_attn.out_proj)
    layers.add_adapter("a", rank=2, alpha=4)
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        assert encoder(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"selects 'self_attn.out_proj', a projection of nn.MultiheadAttention"):
        inject_multilora(nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True), ["out_proj"])
    # torch's default, sequence first: rows routed by their first dimension, the tokens' (wrong, unsaid, where the
    # tokens equal the rows)
    for layer in (nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16),
                  nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16)):
        with pytest.raises(ValueError, match=r"selects 'linear1', in a Transformer(Encoder|Decoder)Layer with "
                                             r"batch_first=False: its inputs are sequence first"):
            inject_multilora(layer, ["linear1"])


def test_a_forced_triton_backend_leaves_an_adapter_on_the_cpu_without_a_shadow(monkeypatch):
    """`_shadow_dtype` asked the backend of an adapter on the CPU: with 'triton' forced (outside the interpreter),
    `add_adapter` raised, and so would every move of the module (a fit's teardown moves it to the CPU)."""
    from lightning_multilora import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if kernels._triton_available():  # (the kernels made for the GPU as they were imported)
        from lightning_multilora.kernels import triton_kernels

        monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    model = build_base_model("tiny-llama", dtype="bfloat16")
    layers = inject_multilora(model, ["q_proj"])
    before = kernels.get_backend()
    kernels.set_backend("triton")
    try:
        layers.add_adapter("a", rank=2, alpha=4)
        layers.rebind()
        assert layers._shadow_dtype("a") is None
    finally:
        kernels.set_backend(before)


def test_torch_encoder_layers_use_their_adapters_in_inference_and_read_their_linears_weights():
    """(A wrapped layer had no `weight`: torch's encoder layer failed at its first validation, T5's feed-forward at
    its first forward. With it, the layer's inference fast path would read the weights and bypass the adapters: it
    is off while a layout is set.)"""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    layers = inject_multilora(encoder, "all-linear")
    assert layers["linear1"].weight is layers["linear1"].base.weight
    assert layers["linear2"].bias is layers["linear2"].base.bias
    layers.add_adapter("a", rank=2, alpha=4)
    with torch.no_grad():
        for p in layers.parameters_of("a"):
            p.normal_()
    x = torch.randn(2, 3, 8)
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        trained = encoder(x)  # (training mode: no fast path)
    encoder.eval()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad(), layers.use(BatchLayout.from_sizes(["a"], [2])):
        torch.testing.assert_close(encoder(x), trained)
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    with torch.no_grad():
        assert not torch.allclose(encoder(x), trained)  # (no layout: the base alone)


def test_a_wrapped_tied_head_is_tied_and_resized_as_transformers_does_it():
    """(With the layer's `weight` a property, transformers' `tie_weights` and `resize_token_embeddings` failed on a
    wrapped `lm_head`: "attribute 'weight' already exists".) The base head takes what is set."""
    model = build_base_model("tiny-llama", {"tie_word_embeddings": True})
    layers = inject_multilora(model, ["q_proj", "lm_head"])
    model.tie_weights()
    assert layers["lm_head"].weight is model.get_input_embeddings().weight
    model.resize_token_embeddings(300)
    assert layers["lm_head"].base.weight.shape == (300, 64) and layers["lm_head"].out_features == 300
    layers.add_adapter("a", rank=2, alpha=4, target_modules=["lm_head"])
    with layers.use(BatchLayout.from_sizes(["a"], [1])):
        assert model(torch.randint(0, 300, (1, 5))).logits.shape == (1, 5, 300)


def test_the_mha_fast_path_is_off_while_any_context_needs_it_and_untouched_by_others():
    """(The setting is process-wide: each context restored what it had read, so of two contexts in two threads the
    one closing first turned the fast path back on inside the other's forward; contexts that need nothing set it
    too.)"""
    needs, other = LayoutContext(), LayoutContext()
    needs.mha_fastpath_off = True
    layout = BatchLayout.from_sizes(["a"], [1])
    before = torch.backends.mha.get_fastpath_enabled()
    first, second = needs.use(layout), needs.use(layout)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # (the other context is still open: still off)
    assert not torch.backends.mha.get_fastpath_enabled()
    second.__exit__(None, None, None)
    assert torch.backends.mha.get_fastpath_enabled() == before
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with other.use(layout):
            torch.backends.mha.set_fastpath_enabled(True)  # (a user's choice inside a context that needs nothing)
        assert torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def test_mixture_of_experts_linears_are_left_out_of_all_linear_and_refused_by_name():
    """(Each expert is called on the tokens routed to it: wrapped, a forward failed with a bare shape error, or,
    where an expert took as many tokens as the batch has rows, gave tokens other rows' adapters, silently.)"""
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.gate = nn.Linear(8, 8), nn.Linear(8, 2)
            self.experts = nn.ModuleList([Expert(), Expert()])

    with pytest.warns(UserWarning, match=r"'all-linear' leaves out the 4 linear layers of mixture-of-experts experts"):
        layers = inject_multilora(Block(), "all-linear")
    assert sorted(layers) == ["gate", "q_proj"]
    with pytest.raises(ValueError, match=r"selects 'experts.0.w1' \(and 1 more\), the linear layers of mixture-of-"
                                         r"experts experts.*leave them out"):
        inject_multilora(Block(), ["q_proj", "w1"])


def test_fused_experts_and_routers_of_transformers_5_are_warned_of_under_all_linear():
    """transformers 5's Mixtral holds its experts as fused 3-D weights and routes with a module that is no
    nn.Linear: 'all-linear' adapted the attention alone, silently (PEFT's 'all-linear' adapts both there)."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with pytest.warns(UserWarning, match=r"'all-linear' leaves out 2 mixture-of-experts modules that are not plain "
                                         r"linear layers \('model.layers.0.mlp.gate' \(MixtralTopKRouter\), "
                                         r"'model.layers.0.mlp.experts' \(MixtralExperts\)\)"):
        layers = inject_multilora(transformers.MixtralForCausalLM(config), "all-linear")
    assert sorted(n.rsplit(".", 1)[1] for n in layers) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # PEFT's spellings: "all-linear" in any case, targets as a set (`LoraConfig.target_modules`)
    upper = inject_multilora(build_base_model("tiny-llama"), "ALL-LINEAR")
    assert sorted(upper) == sorted(inject_multilora(build_base_model("tiny-llama"), "all-linear"))
    assert sorted(inject_multilora(build_base_model("tiny-llama"), {"v_proj", "q_proj"})) == sorted(
        inject_multilora(build_base_model("tiny-llama"), ["q_proj", "v_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named targets: nothing left out that they asked for
        assert len(inject_multilora(transformers.MixtralForCausalLM(config), ["q_proj"])) == 1


@pytest.mark.parametrize("model_type", ["phimoe", "llama4_text"])
def test_a_router_that_subclasses_linear_is_left_out_of_all_linear_and_refused_by_name(model_type):
    """PhiMoE's and Llama 4's routers are nn.Linear subclasses returning their routing (a tuple): 'all-linear' wrapped
    them, and the first step failed, "can only concatenate tuple (not "Tensor") to tuple"."""
    import transformers

    extra = {"phimoe": {}, "llama4_text": dict(intermediate_size_mlp=64, head_dim=8, num_experts_per_tok=1)}
    config = transformers.AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=4, **extra[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    router = next(n for n, m in model.named_modules() if n.endswith("router"))
    with pytest.warns(UserWarning, match=rf"'all-linear' leaves out .* mixture-of-experts modules .*'{router}' "):
        layers = inject_multilora(model, "all-linear")
    assert not any(n.endswith("router") for n in layers)
    layers.add_adapter("a", 2, 4.0, 0.0, False, "all-linear", 0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # (the adapter's, lora_B too: it changes the output)
                p.normal_()
    ids = torch.randint(0, 64, (2, 5))
    with layers.use(BatchLayout.from_sizes(["a"], [2])):
        assert torch.isfinite(model(input_ids=ids).logits).all()
    with pytest.raises(ValueError, match=rf"`target_modules` selects '{router}' \(\w+Router\), a mixture-of-experts "
                                         r"router: a linear layer that returns its routing"):
        inject_multilora(transformers.AutoModelForCausalLM.from_config(config), ["q_proj", "router"])


def test_a_layout_naming_no_adapter_and_peft_keys_with_adapter_names_are_named():
    """A typo'd name in a layout ran its rows on the base alone, silently (PEFT refuses it); a live PeftModel's
    state_dict (keys carrying the adapter's name) was called DoRA magnitudes or LoRA biases."""
    layers = inject_multilora(build_base_model("tiny-llama"), ["q_proj"])
    layers.add_adapter("alpha", rank=2, alpha=4)
    with pytest.raises(ValueError, match=r"the layout names \['alhpa'\], which are no adapters of these layers; "
                                         r"adapters: \['alpha'\]"):
        with layers.use(BatchLayout.from_sizes(["alhpa"], [1])):
            pass
    live = {k.replace(".weight", ".alpha.weight"): v for k, v in layers.peft_state_dict("alpha").items()}
    with pytest.raises(ValueError, match=r"its keys carry PEFT adapter names \['alpha'\] .*get_peft_model_state_dict"):
        layers.load_peft_state_dict("alpha", live)
    # from_sizes: names as a string, lengths that differ, and rows left to the base
    with pytest.raises(ValueError, match=r"`names` must be a sequence of adapter names, got the string 'ab'"):
        BatchLayout.from_sizes("ab", [1, 1])
    with pytest.raises(ValueError, match=r"`names` and `sizes` must have the same length, got 1 names and 2 sizes"):
        BatchLayout.from_sizes(["a"], [1, 1])
    assert BatchLayout.from_sizes(["a"], [2], num_rows=3) == BatchLayout(("a",), (0,), (2,), 3)
    with pytest.raises(ValueError, match=r"`num_rows` must be an integer >= the sizes' sum 2, got 1"):
        BatchLayout.from_sizes(["a"], [2], num_rows=1)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_a_model_holding_peft_layers_is_refused(targets):
    """A PeftModel given as the base: its LoRA layers looked linear, so its adapter was wrapped and trained again
    under doubled key names (PEFT then loaded the export with its B zero), or "all-linear" wrapped PEFT's own
    lora_A / lora_B and failed on a missing ``weight``."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(build_base_model("tiny-llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"the model holds PEFT modules \(the model is a PeftModel\): .*unload\(\)"
                                         r".*AdapterSpec\(init_from=...\)"):
        inject_multilora(peft_model, targets)
    with pytest.raises(ValueError, match=r"the model holds PEFT modules \('model.layers.0.self_attn.q_proj' is a "):
        inject_multilora(peft_model.base_model.model, targets)
    layers = inject_multilora(peft_model.unload(), targets)  # the plain base
    assert len(layers) >= 4


def test_an_adapters_all_linear_leaves_out_the_output_head_whatever_its_name():
    """PEFT's "all-linear" leaves out the output head; an adapter's own "all-linear", among layers that include the
    head, left it out only where it was named `lm_head` (GPT-NeoX-Japanese's `embed_out` was adapted)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_neox_japanese", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    layers = inject_multilora(model, ["query_key_value", "embed_out"])
    assert "embed_out" in layers
    chosen = layers.layers_for("all-linear")
    assert chosen == [f"gpt_neox_japanese.layers.{i}.attention.query_key_value" for i in (0, 1)]
    peft = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(target_modules="all-linear"))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in peft.named_modules()
               if n.endswith(".lora_A")}
    assert set(chosen) == adapted & set(layers)
    assert layers.layers_for(["embed_out"]) == ["embed_out"]  # (named, it is taken)
    layers.add_adapter("x", 4, 8, target_modules="all-linear")
    assert "x" not in layers["embed_out"].lora_A and "x" in layers[chosen[0]].lora_A


@pytest.mark.parametrize("tied, targets, warned", [(True, ["q_proj", "lm_head"], True), (False, ["q_proj", "lm_head"],
                                                   False), (True, ["q_proj"], False), (True, "all-linear", False)])
def test_an_adapted_head_tied_to_the_input_embeddings_is_warned_of_as_peft_does(tied, targets, warned):
    """(PEFT warns that a merge of such an adapter changes the embeddings too; the fit said nothing.)"""
    model = build_base_model("tiny-llama", {"tie_word_embeddings": tied})
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inject_multilora(model, targets)
    said = [str(w.message) for w in seen if "output head" in str(w.message)]
    assert len(said) == warned and all("'lm_head'" in m and "merge_and_unload()" in m for m in said), said


@pytest.mark.parametrize("fails_at", ["second layer", "flat"])
def test_an_adapter_whose_adding_fails_partway_leaves_no_trace(monkeypatch, fails_at):
    """Out of memory partway through adding an adapter (in its second layer, or as its flat parameter is made) left it
    in the layers it had reached: its name could not be added again ("already exists in this layer")."""
    from lightning_multilora import layer as layer_module

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    layers = inject_multilora(model, ["0", "2"])
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    if fails_at == "flat":
        monkeypatch.setattr(layer_module, "make_flat", no_room)
    else:
        monkeypatch.setattr(layers["2"], "add_adapter", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        layers.add_adapter("a", rank=2, alpha=4)
    assert "a" not in layers.adapter_names and all("a" not in layer.lora_A for layer in layers.values())
    monkeypatch.undo()
    layers.add_adapter("a", rank=2, alpha=4)  # (room again: added as if never tried)
    assert layers.adapter_names == ["a"] and all("a" in layer.lora_A for layer in layers.values())
