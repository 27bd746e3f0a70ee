"""Shadows: an adapter's weights in the activation dtype, written by GroupedAdamW's step or copied when stale, read by
the LoRA kernels instead of copies of their own (the Triton interpreter on the CPU, fp16: it mishandles bf16)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from lightning_multilora.flat import FlatAdapter  # noqa: E402
from lightning_multilora.layer import inject_multilora  # noqa: E402
from lightning_multilora.layout import BatchLayout  # noqa: E402
from lightning_multilora.optim import GroupedAdamW  # noqa: E402
from lightning_multilora.shadow import invalidate_shadows, refresh, shadow_of  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def flat_adapter(seed=0, shapes=((4, 24), (40, 4), (3, 7))):
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in shapes]
    return FlatAdapter(params)


def test_a_shadow_is_fresh_after_a_refresh_and_stale_after_any_write_torch_counts():
    flat = flat_adapter()
    shadow = flat.keep_shadow(DTYPE)
    assert shadow_of(flat.flat) is shadow and flat.keep_shadow(DTYPE) is shadow
    assert not shadow.fresh()
    assert refresh([shadow]) == 1 and shadow.fresh() and refresh([shadow]) == 0
    assert all(torch.equal(v, p.detach().to(DTYPE)) for v, p in zip(shadow.views, flat.params))
    writes = [
        lambda: flat.params[1].add_(1.0),  # a layer's parameter (its own version counter)
        lambda: flat.flat.mul_(2.0),
        lambda: flat.params[2].copy_(torch.ones(3, 7, device=DEVICE)),  # what load_state_dict does
        lambda: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1).step(),  # any optimizer's step
    ]
    for write in writes:
        with torch.no_grad():
            write()
        assert not shadow.fresh()
        assert refresh([shadow]) == 1 and shadow.fresh()
        assert all(torch.equal(v, p.detach().to(DTYPE)) for v, p in zip(shadow.views, flat.params))
    flat.params[0].data.fill_(3.0)  # through .data: no counter sees it
    assert shadow.fresh()
    invalidate_shadows()
    assert not shadow.fresh() and refresh([shadow]) == 1
    assert torch.equal(shadow.views[0], torch.full((4, 24), 3.0, dtype=DTYPE, device=DEVICE))
    flat.drop_shadow()
    assert flat.shadow is None and shadow_of(flat.flat) is None
    with torch.inference_mode():  # made during a validation, refreshed by a training step after
        shadow = flat.keep_shadow(DTYPE)
        assert refresh([shadow]) == 1
    with torch.no_grad():
        flat.flat.add_(1.0)
    assert refresh([shadow]) == 1 and torch.equal(shadow.views[1], flat.params[1].detach().to(DTYPE))
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        flat.keep_shadow(torch.float32)


def test_grouped_adamw_writes_the_shadow_in_its_step(triton_backend):
    """The step's launch stores the new weights rounded as ``Tensor.to`` rounds, and leaves the shadow fresh (beside a
    parameter without one, in the same launch); an adapter it did not step (no gradient), or one stepped by torch's
    AdamW, is left stale and copied when asked."""
    if DEVICE == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not set")
    flats = [flat_adapter(seed) for seed in range(3)]
    shadows = [f.keep_shadow(DTYPE) for f in flats]
    refresh(shadows)
    reference = [copy.deepcopy(f.flat) for f in flats]
    plain = [nn.Parameter(torch.randn(300, device=DEVICE)) for _ in range(2)]  # no shadow: a launch of both kinds
    opt = GroupedAdamW([{"params": [f.flat], "lr": 1e-2 * (i + 1)} for i, f in enumerate(flats[:2])]
                       + [{"params": [plain[0]], "lr": 1e-2}])
    torch_opt = torch.optim.AdamW([{"params": [reference[0]], "lr": 1e-2}, {"params": [reference[1]], "lr": 2e-2},
                                   {"params": [plain[1]], "lr": 1e-2}], foreach=False)
    with torch.no_grad():
        plain[1].copy_(plain[0])
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        for i, (f, r) in enumerate(zip(flats[:2], reference[:2])):
            f.prepare_grads()
            grad = torch.randn(f.flat.shape, generator=g).to(DEVICE)
            if step == 2 and i == 1:  # no gradient: not stepped
                f.drop_grads()
                r.grad = None
                continue
            f.flat.grad.copy_(grad)
            r.grad = grad.clone()
        plain[0].grad = torch.randn(300, generator=g).to(DEVICE)
        plain[1].grad = plain[0].grad.clone()
        torch_opt.step()  # (any optimizer's step leaves every shadow stale but those the step writes: first)
        opt.step()
        assert shadows[0].fresh() and torch.equal(shadows[0].tensor, flats[0].flat.detach().to(DTYPE))
        assert shadows[1].fresh() == (step < 2)
        assert not shadows[2].fresh()  # another optimizer's adapter: stale after any step
        assert refresh(shadows) == (1 if step < 2 else 2)
        for f, s in zip(flats, shadows):
            assert torch.equal(s.tensor, f.flat.detach().to(DTYPE))
        for ours, ref in zip([flats[0].flat, flats[1].flat, plain[0]], [*reference[:2], plain[1]]):
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    other = torch.optim.AdamW([flats[0].flat], lr=1e-2)  # torch's AdamW: writes no shadow
    flats[0].prepare_grads()
    other.step()
    assert not shadows[0].fresh() and refresh(shadows[:1]) == 1


def _tiny(dtype=torch.float16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24)).to(DEVICE, dtype)


def _train(model, layers, steps, names=("a", "b"), lr=1e-2):
    flats = [layers.flat_adapter(n) for n in names]
    opt = GroupedAdamW([{"params": [f.flat], "lr": lr * (i + 1)} for i, f in enumerate(flats)])
    layout = BatchLayout(names, (0, 3), (3, 8), 8)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(DEVICE, torch.float16)
        layers.prepare_grads(*names)
        with layers.use(layout):
            model(x).float().square().mean().backward()
        opt.step()
    with torch.no_grad(), layers.use(layout):
        return model(torch.ones(8, 32, device=DEVICE, dtype=torch.float16)).float()


def test_the_layers_read_their_adapters_shadows_and_train_as_with_copies(triton_backend, monkeypatch):
    """Adapters of a half-precision base get shadows (fp32 weights, the Triton path): the layers' calls read them and
    launch no copies; GroupedAdamW writes them, so training gives the weights that copying at every call gives,
    exactly. A loaded adapter (weights written by ``copy_``) is copied again before the next forward."""
    if DEVICE == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from lightning_multilora.kernels import triton_lora

    launches = []
    copy_launch = triton_lora._copy_weights
    monkeypatch.setattr(triton_lora, "_copy_weights", lambda *a, **k: launches.append(1) or copy_launch(*a, **k))
    runs = {}
    for shadows in (True, False):
        model = _tiny()
        layers = inject_multilora(model, ["0", "2"])
        layers.shadows = shadows
        for i, name in enumerate(("a", "b")):
            layers.add_adapter(name, rank=4 + 4 * i, alpha=8, seed=i)
            for layer in layers.values():
                nn.init.normal_(layer.lora_B[name], std=0.1)
        assert all(bool(layer.shadows) == shadows for layer in layers.values())
        launches.clear()
        runs[shadows] = (_train(model, layers, 3), [p.detach().clone() for p in layers.parameters_of("a")])
        assert bool(launches) != shadows
        if shadows:
            state = layers.peft_state_dict("a")
            with torch.no_grad():
                for p in layers.parameters_of("a"):
                    p.zero_()
            layout = BatchLayout(("a",), (0,), (8,), 8)
            x = torch.ones(8, 32, device=DEVICE, dtype=torch.float16)
            with torch.no_grad(), layers.use(layout):
                assert torch.equal(model(x), model[2].base(model[1](model[0].base(x))))  # the zeroed adapter
            layers.load_peft_state_dict("a", state)
            with torch.no_grad(), layers.use(layout):
                assert not torch.equal(model(x), model[2].base(model[1](model[0].base(x))))
            layers.remove_adapter("b")
            assert all("b" not in layer.shadows for layer in layers.values())
            model.double()  # fp64 adapters in an fp64 base: no shadow
            layers.rebind()  # (what MultiLoRAMixin does at a move or cast)
            assert layers.flat_adapter("a").shadow is None and not any(layer.shadows for layer in layers.values())
    assert torch.equal(runs[True][0], runs[False][0])
    assert all(torch.equal(p, q) for p, q in zip(runs[True][1], runs[False][1]))


@pytest.mark.gpu
def test_the_module_trains_bf16_adapters_from_shadows_as_from_copies(tmp_path, monkeypatch):
    """`MultiLoRAModule` on CUDA, bf16 base: its default optimizer (GroupedAdamW) writes the shadows, the training
    steps launch no weight copies, and the adapters train to the weights of the per-call copies."""
    import lightning as L
    from safetensors.torch import load_file

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.kernels import triton_lora

    launches = []
    copy_launch = triton_lora._copy_weights
    monkeypatch.setattr(triton_lora, "_copy_weights", lambda *a, **k: launches.append(1) or copy_launch(*a, **k))
    weights, counts = [], []
    for shadows in (True, False):
        specs = [AdapterSpec("a", lr=1e-3, batch_size=2, max_steps=6, weight_decay=0.1),
                 AdapterSpec("b", lr=3e-3, rank=16, batch_size=3, max_steps=4, seed=1)]
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(100)}, max_length=96, truncate=True)
        module = MultiLoRAModule("tiny-llama", adapters=specs, dtype="bfloat16", export_dir=str(tmp_path / str(shadows)),
                                 validate_on_finish=False)
        module.lora_layers.shadows = shadows
        launches.clear()
        L.Trainer(accelerator="gpu", devices=1, max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, logger=False, limit_val_batches=0,
                  default_root_dir=str(tmp_path)).fit(module, dm)
        assert type(module.trainer.optimizers[0]) is GroupedAdamW
        counts.append(len(launches))
        weights.append({n: load_file(f"{module.registry[n].export_path}/adapter_model.safetensors") for n in "ab"})
    assert counts[0] == 0 and counts[1] > 0
    for n in "ab":
        for k, ours in weights[0][n].items():
            ref = weights[1][n][k]
            assert ((ours.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item() < 1e-3, (n, k)


def test_a_dropped_model_frees_its_adapters_and_their_shadows(triton_backend):
    """Nothing global holds an adapter's weights or shadow: a model built per trial is freed with its layers."""
    import gc
    import weakref

    from lightning_multilora import shadow as shadow_module

    model = _tiny()
    layers = inject_multilora(model, ["0", "2"])
    layers.add_adapter("a", rank=4, alpha=8)
    flat = layers.flat_adapter("a")
    refs = [weakref.ref(flat.flat), weakref.ref(flat.shadow)]
    assert shadow_of(flat.flat) is flat.shadow
    before = len(shadow_module._registry)
    del model, layers, flat
    gc.collect()
    assert all(r() is None for r in refs) and len(shadow_module._registry) == before - 1


def _model_with_adapter(dtype=torch.float16):
    model = _tiny(dtype)
    layers = inject_multilora(model, ["0", "2"])
    layers.add_adapter("a", rank=8, alpha=8)
    for layer in layers.values():
        nn.init.normal_(layer.lora_B["a"], std=0.1)
    return model, layers


def _forward(model, layers, shadows=True):
    """The model's output for adapter "a" on every row, reading the shadows (or with them off: the weights)."""
    before, layers.shadows = layers.shadows, shadows
    try:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
        with torch.no_grad(), layers.use(BatchLayout(("a",), (0,), (8,), 8)):
            return model(x).float()
    finally:
        layers.shadows = before


@pytest.mark.parametrize("replace", ["data", "assign", "deepcopy"])
def test_weights_replaced_behind_the_flat_parameter_are_read_as_they_are(triton_backend, replace):
    """``p.data = t`` (what ``vector_to_parameters`` does), ``load_state_dict(assign=True)`` (new parameter objects)
    and a deep copy (its parameters no longer views of its flat one) leave a shadow of the old storage: the next
    forward holds the adapter flat again and reads the weights as they are now."""
    model, layers = _model_with_adapter()
    _forward(model, layers)
    if replace == "data":
        for layer in layers.values():
            layer.lora_B["a"].data = torch.randn_like(layer.lora_B["a"])
    elif replace == "assign":
        state = {k: torch.randn_like(v) for k, v in model.state_dict().items() if "lora_" in k}
        model.load_state_dict(state, strict=False, assign=True)
    else:
        model, layers = copy.deepcopy((model, layers))
        with torch.no_grad():
            for p in layers.parameters_of("a"):
                p.mul_(-0.5)
    if replace == "assign":  # new parameter objects: an optimizer built before must be built again, and is told
        with pytest.warns(UserWarning, match="an optimizer built before steps the old parameters"):
            out = _forward(model, layers)
    else:
        out = _forward(model, layers)
    assert layers.flat_adapter("a").bound() and layers.flat_adapter("a").shadow is not None
    assert torch.equal(out, _forward(model, layers, shadows=False))


@pytest.mark.parametrize("replace", ["data", "assign"])
def test_weights_replaced_behind_the_flat_parameter_are_read_without_shadows_too(replace):
    """An fp32 adapter keeps no shadow, and the check for replaced weights ran only for adapters with one: after
    ``load_state_dict(assign=True)`` the layers kept their cached weights (the old parameters, which the optimizer
    stepped too) while the export read the new ones."""
    model, layers = _model_with_adapter(torch.float32)
    assert layers.flat_adapter("a").shadow is None
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layout = BatchLayout(("a",), (0,), (8,), 8)

    def forward():
        with torch.no_grad(), layers.use(layout):
            return model(x)

    before = forward()
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items() if "lora_" in k}
    if replace == "data":
        for name, p in model.named_parameters():
            if name in new:
                p.data = new[name]
        out = forward()
    else:
        model.load_state_dict(new, strict=False, assign=True)
        with pytest.warns(UserWarning, match="an optimizer built before steps the old parameters"):
            out = forward()
    flat = layers.flat_adapter("a")
    assert flat.bound() and all(p is q for p, q in zip(flat.params, layers.parameters_of("a")))
    fresh, fresh_layers = _model_with_adapter(torch.float32)
    fresh.load_state_dict(new, strict=False)
    with torch.no_grad(), fresh_layers.use(layout):
        expected = fresh(x)
    assert not torch.allclose(out, before) and torch.allclose(out, expected)


def test_a_graph_capture_copies_the_shadows_unless_its_caller_refreshes_them_before_replays(triton_backend,
                                                                                             monkeypatch):
    """A replay runs no Python: a capture of ``use(layout)`` records the copy of the weights into the shadows (so
    every replay reads them as they are, as the per-call copies did), unless it runs inside
    ``refreshed_before_replays``; neither launches per-call copies."""
    from lightning_multilora.kernels import triton_lora

    model, layers = _model_with_adapter()
    _forward(model, layers)  # (the device tables made and the shadows refreshed: a capture can do neither)
    launches = []
    copy_launch = triton_lora._copy_weights
    monkeypatch.setattr(triton_lora, "_copy_weights", lambda *a, **k: launches.append(1) or copy_launch(*a, **k))
    layers.flat_adapter("a").flat.data.mul_(0.5)  # a write no counter sees: the shadow still looks fresh
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # (as inside a capture)
    with layers.refreshed_before_replays():
        as_left = _forward(model, layers)  # the shadows as the caller left them
    replayed = _forward(model, layers)  # the shadows copied by the (here: captured and run) graph
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not launches
    assert torch.equal(replayed, _forward(model, layers, shadows=False))
    assert not torch.equal(as_left, replayed)


@pytest.mark.gpu
def test_a_graph_captured_around_use_replays_the_weights_as_they_are():
    """A CUDA graph of a forward under ``use(layout)``, captured after eager steps that read the shadows, copies
    the weights into them at each replay: a write after the capture is seen."""
    model, layers = _model_with_adapter()
    x = torch.randn(8, 32, device=DEVICE, dtype=torch.float16)
    layout = BatchLayout(("a",), (0,), (8,), 8)

    def forward():
        with torch.no_grad(), layers.use(layout):
            return model(x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    with torch.no_grad():
        layers.flat_adapter("a").flat.mul_(0.5)
    graph.replay()
    layers.shadows = False
    assert torch.equal(out, forward())


@pytest.mark.parametrize("optimizer", ["AdamW", "GroupedAdamW"])
def test_a_step_taken_inside_one_use_is_read_by_its_next_forward(triton_backend, optimizer):
    """Shadows were checked as `use` opened alone: a step taken inside it (a loop of its own around one `use`, with
    torch's AdamW) left the next forwards reading the last step's weights (39.97 off, where copies gave 0.007)."""
    if DEVICE == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not set")
    outputs = {}
    for shadows in (True, False):
        model, layers = _model_with_adapter()
        layers.shadows = shadows
        klass = GroupedAdamW if optimizer == "GroupedAdamW" else torch.optim.AdamW
        opt = klass([layers.flat_adapter("a").flat], lr=0.5)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
        with layers.use(BatchLayout(("a",), (0,), (8,), 8)):
            for _ in range(2):
                layers.prepare_grads("a")
                model(x).float().square().mean().backward()
                opt.step()
            with torch.no_grad():
                outputs[shadows] = model(x).float()
    assert torch.equal(outputs[True], outputs[False])


def test_a_closure_refresh_inside_a_step_does_not_hide_the_steps_write(triton_backend):
    """An optimizer step whose closure runs a forward (refreshing the shadows) and that then writes the weights
    through ``.data`` (no version counted): the step's end makes the shadows stale."""
    model, layers = _model_with_adapter()
    flat = layers.flat_adapter("a")

    class DataSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            closure()
            for p in self.param_groups[0]["params"]:
                p.data.add_(0.5)

    DataSGD([flat.flat]).step(lambda: _forward(model, layers))
    assert torch.equal(_forward(model, layers), _forward(model, layers, shadows=False))


def test_adapters_made_under_inference_mode_keep_no_shadow(triton_backend):
    """Inference tensors count no versions: an adapter loaded for evaluation under ``inference_mode`` has no shadow
    and its forward copies its weights."""
    with torch.inference_mode():
        model, layers = _model_with_adapter()
        assert layers.flat_adapter("a").shadow is None
        out = _forward(model, layers)
    assert torch.equal(out, _forward(model, layers, shadows=False))
