"""One adapter's per-layer parameters held as views of one flat parameter and gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_multilora.base_model import build_base_model
from lightning_multilora.flat import ALIGN, FlatAdapter, make_flat
from lightning_multilora.layer import inject_multilora
from lightning_multilora.layout import BatchLayout


def params(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in shapes]


def test_the_parameters_become_aligned_views_of_the_flat_parameter_with_their_values():
    ps = params((3, 5), (7, 3), (2, 100))
    values = [p.detach().clone() for p in ps]
    flat = FlatAdapter(ps)
    for p, v in zip(ps, values):
        assert torch.equal(p, v) and p.is_contiguous()
        assert p.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr()
        assert (p.data_ptr() - flat.flat.data_ptr()) % (ALIGN * 4) == 0
    with torch.no_grad():
        flat.flat.mul_(2)  # what an optimizer step does to the flat parameter, every layer sees
    for p, v in zip(ps, values):
        assert torch.equal(p, 2 * v)


def test_gradients_are_views_of_one_zeroed_flat_gradient_and_accumulate_through_autograd():
    ps = params((3, 5), (7, 3))
    flat = FlatAdapter(ps)
    for _ in range(2):  # a second step starts from zero again
        grad = flat.prepare_grads()
        assert flat.flat.grad is grad and not grad.any()
        (ps[0].sum() * 2 + ps[1].pow(2).sum()).backward()  # autograd adds into the existing .grad in place
        assert torch.equal(ps[0].grad, torch.full((3, 5), 2.0)) and torch.equal(ps[1].grad, 2 * ps[1].detach())
        assert torch.isclose(grad.norm(), torch.cat([ps[0].grad.flatten(), ps[1].grad.flatten()]).norm())
    flat.drop_grads()
    assert flat.flat.grad is None and all(p.grad is None for p in ps)
    ps[0].grad = torch.ones(3, 5)  # someone set a gradient of their own: the next step links the view again
    flat.prepare_grads()
    assert ps[0].grad.data_ptr() == flat.flat.grad.data_ptr() and not ps[0].grad.any()


def test_a_replaced_storage_is_bound_again_keeping_the_values_and_the_flat_identity():
    ps = params((3, 5), (7, 3))
    flat = FlatAdapter(ps)
    key = flat.flat
    with torch.no_grad():
        ps[1].data = torch.full((7, 3), 4.0)  # what module.to(device) does to every parameter
    assert not flat.bound()
    flat.prepare_grads()
    assert flat.bound() and flat.flat is key
    assert torch.equal(flat.flat[ALIGN:ALIGN + 21], torch.full((21,), 4.0))
    assert ps[1].untyped_storage().data_ptr() == key.untyped_storage().data_ptr()


def test_a_model_cast_to_another_dtype_is_bound_again():
    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8, seed=1)
    before = {k: v.clone() for k, v in layers.peft_state_dict("a").items()}
    model.double()
    layers.prepare_grads("a")
    [flat] = layers.step_parameters("a")
    assert flat.dtype == torch.float64 and all(p.grad.dtype == torch.float64 for p in layers.parameters_of("a"))
    for k, v in layers.peft_state_dict("a").items():
        assert torch.equal(v, before[k].double())


def test_one_call_zeroes_the_gradients_of_several_adapters_flat_new_and_per_layer():
    """`LoRALayers.prepare_grads(*names)`: held gradients zeroed in place (the same tensors), a first one made,
    an adapter kept per layer zeroed too; adapters not named keep theirs."""
    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    for i, name in enumerate("abcd"):
        layers.add_adapter(name, rank=2 + i, alpha=8, seed=i)
    layers._flat["c"] = None  # as an adapter split over devices: per-layer parameters
    for name in "abd":
        layers.prepare_grads(name)
    for name in "abcd":
        for p in layers.parameters_of(name):
            if name != "b":
                p.grad.fill_(3.0) if p.grad is not None else setattr(p, "grad", torch.full_like(p, 3.0))
    held = {"a": layers.step_parameters("a")[0].grad}
    layers.flat_adapter("b").drop_grads()  # b holds none: made anew
    layers.prepare_grads("a", "b", "c")
    for name in "abc":
        assert all(p.grad is not None and not p.grad.any() for p in layers.parameters_of(name)), name
    assert layers.step_parameters("a")[0].grad is held["a"]  # in place, not replaced
    assert all(p.grad.data_ptr() >= held["a"].data_ptr() for p in layers.parameters_of("a"))
    assert all((p.grad == 3.0).all() for p in layers.parameters_of("d"))  # not named: untouched


def test_parameters_on_several_devices_or_dtypes_stay_per_layer():
    mixed = params((3, 5)) + params((2, 2), dtype=torch.float64)
    assert make_flat(mixed) is None
    with pytest.raises(ValueError, match="share one device and dtype"):
        FlatAdapter(mixed)


def test_sharded_parameters_stay_per_layer(tmp_path):
    """FSDP2's sharded parameters (DTensors) were held flat: the copy into the flat storage failed in the first
    forward, "_foreach_copy_ got mixed torch.Tensor and DTensor" (`benchmarks/adapter_parallel.py`'s FSDP baselines)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_available():
        pytest.skip("torch without distributed")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = [nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])) for _ in range(2)]
        assert not FlatAdapter.can_hold(sharded) and make_flat(sharded) is None
        assert FlatAdapter.can_hold([nn.Parameter(torch.ones(4, 2))])
    finally:
        dist.destroy_process_group()


def test_the_layers_hold_each_adapter_flat_and_free_it_with_the_adapter():
    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8, seed=1)
    layers.add_adapter("b", rank=2, alpha=8, seed=2)
    [flat_a] = layers.step_parameters("a")
    per_layer = layers.parameters_of("a")
    assert flat_a.numel() >= sum(p.numel() for p in per_layer)
    assert layers.optimizer_parameters("a", elementwise=False) == per_layer
    assert layers.optimizer_parameters("a", elementwise=True) == [flat_a]
    layers.remove_adapter("a")
    with pytest.raises(KeyError, match="no adapter 'a'"):
        layers.step_parameters("a")
    assert len(layers.step_parameters("b")) == 1


def test_adapters_of_a_model_materialized_from_the_meta_device_are_held_flat_again():
    """``to_empty`` from the meta device gives the layers new parameter objects (the flat adapter held the old
    ones): `rebind` holds each adapter flat over the new ones, with their values, and training reaches them."""
    with torch.device("meta"):
        model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8, seed=1)
    [old_flat] = layers.step_parameters("a")
    layout = BatchLayout.from_sizes(["a"], [2])
    with layers.use(layout):  # a forward on the meta device: the layers cache their adapters' (meta) weights
        model(input_ids=torch.zeros(2, 5, dtype=torch.long, device="meta"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        # buffers too (the rotary tables): `to_empty` left whatever the memory held, at times NaN
        for (name, buffer), (_, made) in zip(model.named_buffers(), build_base_model("tiny-llama").named_buffers()):
            buffer.copy_(made)
    values = [p.detach().clone() for p in layers.parameters_of("a")]
    layers.rebind()
    [flat] = layers.step_parameters("a")
    assert flat is not old_flat and flat.device.type == "cpu"
    for p, v in zip(layers.parameters_of("a"), values):
        assert torch.equal(p, v) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    optimizer = torch.optim.SGD(layers.optimizer_parameters("a", elementwise=True), lr=0.1)
    layers.prepare_grads("a")
    x = torch.randint(model.config.vocab_size, (2, 5))
    with layers.use(layout):  # the same layout object: the layers use the new parameters, not the cached ones
        model(input_ids=x).logits.float().square().mean().backward()
    assert flat.grad is not None and flat.grad.abs().sum() > 0
    optimizer.step()
    assert not all(torch.equal(p, v) for p, v in zip(layers.parameters_of("a"), values))
    layers.rebind()  # nothing replaced since: the same flat parameter
    assert layers.step_parameters("a")[0] is flat


def test_no_gradient_is_held_before_the_first_step_and_state_dicts_are_copies(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8, seed=1)
    [flat] = layers.step_parameters("a")
    assert flat.grad is None and all(p.grad is None for p in layers.parameters_of("a"))  # evaluation only: none
    state = layers.peft_state_dict("a")
    save_file(state, str(tmp_path / "a.safetensors"))  # each tensor its own storage (views would be refused)
    for v in state.values():
        v.zero_()  # a copy: the adapter's weights are untouched
    saved = load_file(str(tmp_path / "a.safetensors"))
    assert any(v.abs().sum() > 0 for v in saved.values())
    for k, v in layers.peft_state_dict("a").items():
        assert torch.equal(v, saved[k])


def test_a_module_moved_or_cast_rebinds_its_flat_parameters_at_once():
    from lightning_multilora import AdapterSpec, MultiLoRAModule

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=4)])
    module._create_weights(module.registry["a"])
    module.double()  # what Lightning's precision plugins and device placement do, before any optimizer exists
    [flat] = module.lora_layers.step_parameters("a")
    assert flat.dtype == torch.float64 and module.lora_layers.flat_adapter("a").bound()
    p = module.lora_layers.parameters_of("a")[0]
    assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
