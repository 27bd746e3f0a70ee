"""GroupedAdamW: torch.optim.AdamW's update and state, every group in one Triton launch (the interpreter on CPU)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("triton")

from lightning_multilora import kernels  # noqa: E402
from lightning_multilora.optim import GroupedAdamW  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_RUNS = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

# groups of different sizes (an empty tensor, sizes across the 4096-element block), hyperparameters and step counts
SIZES = [[1, 7], [5000], [2 * 4096 + 3, 0], [300]]
HYPER = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
         dict(lr=0.1, weight_decay=0.01, maximize=True), dict(lr=1e-3)]


def params(seed=1, scale=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n * scale, generator=g).to(DEVICE).requires_grad_() for n in grp] for grp in SIZES]


def set_grads(groups_a, groups_b, step):
    g = torch.Generator().manual_seed(100 + step)
    for ga, gb in zip(groups_a, groups_b):
        for i, (a, b) in enumerate(zip(ga, gb)):
            grad = torch.randn(a.shape, generator=g).to(DEVICE)
            if step == 2 and i == 0:  # no gradient this step: skipped, its step count stays behind
                a.grad = b.grad = None
                continue
            a.grad, b.grad = grad.clone(), grad.clone()


def max_rel(groups_a, groups_b):
    return max(((a - b).abs().max() / b.abs().max()).item() for ga, gb in zip(groups_a, groups_b)
               for a, b in zip(ga, gb) if a.numel())


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
def test_one_launch_matches_torch_adamw_per_group(triton_backend, monkeypatch):
    ours, ref = params(), params()
    opt = GroupedAdamW([dict(params=p, **h) for p, h in zip(ours, HYPER)])
    torch_opt = torch.optim.AdamW([dict(params=p, **h) for p, h in zip(ref, HYPER)], foreach=False)
    launches = []
    from lightning_multilora.kernels import triton_adamw
    real_launch = triton_adamw.launch
    monkeypatch.setattr(triton_adamw, "launch", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    for step in range(5):
        set_grads(ours, ref, step)
        versions = [p._version for group in ours for p in group]
        opt.step()
        torch_opt.step()
        assert max_rel(ours, ref) < 2e-6, step
        # (written through their addresses, the stepped parameters' versions move: the module tells a step taken so)
        stepped = [p.grad is not None for group in ours for p in group]
        assert [p._version > v for p, v in zip((p for group in ours for p in group), versions)] == stepped
    assert len(launches) == 5  # one launch per step, every group in it
    for a, b in zip(opt.state_dict()["state"].values(), torch_opt.state_dict()["state"].values()):
        assert a["step"].device.type == "cpu" and float(a["step"]) == float(b["step"])  # 4 for the skipped ones
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {4.0, 5.0}


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
def test_state_dict_moves_between_grouped_and_torch_adamw(triton_backend):
    """A checkpoint of either optimizer resumes in the other: the state and groups are torch.optim.AdamW's."""
    ours, ref = params(), params()
    opt = GroupedAdamW([dict(params=p, **h) for p, h in zip(ours, HYPER)])
    torch_opt = torch.optim.AdamW([dict(params=p, **h) for p, h in zip(ref, HYPER)], foreach=False)
    for step in range(3):
        set_grads(ours, ref, step)
        opt.step()
        torch_opt.step()
    # swap: the torch state continues in GroupedAdamW and ours in torch's
    ours2 = [[p.detach().clone().requires_grad_() for p in g] for g in ref]
    ref2 = [[p.detach().clone().requires_grad_() for p in g] for g in ours]
    resumed = GroupedAdamW([dict(params=p, **h) for p, h in zip(ours2, HYPER)])
    resumed.load_state_dict(torch_opt.state_dict())
    torch_resumed = torch.optim.AdamW([dict(params=p, **h) for p, h in zip(ref2, HYPER)], foreach=False)
    torch_resumed.load_state_dict(opt.state_dict())
    for step in range(3, 5):
        set_grads(ours2, ref2, step)
        resumed.step()
        torch_resumed.step()
    assert max_rel(ours2, ref2) < 2e-6


@pytest.fixture
def launches(monkeypatch):
    """The grouped kernel's launches, counted."""
    from lightning_multilora.kernels import triton_adamw

    made = []
    real = triton_adamw.launch
    monkeypatch.setattr(triton_adamw, "launch", lambda *a, **k: made.append(1) or real(*a, **k))
    return made


class OtherParameter(torch.nn.Parameter):
    pass


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
@pytest.mark.parametrize("case", ["amsgrad", "float64", "subclass", "reference backend"])
def test_everything_else_steps_through_torch_adamw(triton_backend, launches, case):
    """With amsgrad, a non-fp32 parameter, a tensor subclass or the reference backend, the step is torch's own:
    no launch, the same numbers to the bit."""
    if case == "reference backend":
        kernels.set_backend("reference")
    dtype = torch.float64 if case == "float64" else torch.float32
    hyper = {"amsgrad": True} if case == "amsgrad" else {}
    make = OtherParameter if case == "subclass" else torch.nn.Parameter
    a = make(torch.randn(64, dtype=dtype, device=DEVICE))
    b = make(a.detach().clone())  # (torch itself steps a subclass through another path than a Parameter)
    opt, ref = GroupedAdamW([a], lr=0.1, **hyper), torch.optim.AdamW([b], lr=0.1, **hyper)
    for step in range(3):
        a.grad = torch.full_like(a, float(step + 1))
        b.grad = a.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
    assert not launches


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
def test_a_fused_adamw_checkpoint_resumes_grouped(triton_backend, launches):
    """A state dict of torch's fused AdamW (the module's optimizer before GroupedAdamW) keeps the grouped step on:
    its ``fused=True`` is not taken over, its step counts come to the host, and training continues as torch's."""
    ours, ref = params(), params()
    fused = torch.optim.AdamW([dict(params=p, **h) for p, h in zip(ref, HYPER)], fused=True)
    for step in range(2):
        set_grads(ref, ref, step)
        fused.step()
    for ga, gb in zip(ours, ref):
        for a, b in zip(ga, gb):
            a.data.copy_(b.detach())
    opt = GroupedAdamW([dict(params=p, **h) for p, h in zip(ours, HYPER)])
    opt.load_state_dict(copy.deepcopy(fused.state_dict()))  # (torch would share the moment tensors)
    assert all(g["fused"] is None for g in opt.param_groups)
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    for step in range(2, 5):
        set_grads(ours, ref, step)
        opt.step()
        fused.step()
    assert len(launches) == 3 and max_rel(ours, ref) < 2e-6


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
def test_a_state_of_another_shape_is_refused(triton_backend):
    small = torch.nn.Parameter(torch.randn(4096, device=DEVICE))
    other = GroupedAdamW([small])
    small.grad = torch.ones_like(small)
    other.step()
    big = torch.nn.Parameter(torch.randn(16384, device=DEVICE))
    opt = GroupedAdamW([big])
    opt.load_state_dict(other.state_dict())
    big.grad = torch.ones_like(big)
    with pytest.raises(ValueError, match="exp_avg must be .* shaped and placed as its parameter"):
        opt.step()
    assert float(opt.state[big]["step"]) == 1.0  # nothing was counted


@pytest.mark.skipif(not KERNEL_RUNS, reason="no GPU and TRITON_INTERPRET is not set")
@pytest.mark.parametrize("grouped", [True, False])
def test_step_hooks_run_once_and_a_copy_steps(triton_backend, launches, grouped):
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch wraps AdamW.step in its hook runner now
    w = torch.nn.Parameter(torch.ones(8, device=DEVICE, dtype=torch.float32 if grouped else torch.float64))
    opt = GroupedAdamW([w], lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    w.grad = torch.ones_like(w)
    opt.step()
    assert seen == ["pre", "post"] and len(launches) == int(grouped)
    clone = copy.deepcopy(opt)  # (pickling keeps no device tables)
    clone.param_groups[0]["params"][0].grad = torch.ones_like(w)
    clone.step()
    assert float(clone.state[clone.param_groups[0]["params"][0]]["step"]) == 2.0


def test_a_resumed_group_keeps_the_optimizers_own_flags():
    """The module matches a checkpoint's groups to the optimizer built now by adapter name: the hyperparameters and
    state come from the checkpoint, ``fused`` / ``foreach`` / ... from the optimizer (a fused run resumed as
    GroupedAdamW stays grouped, a grouped one resumed with ``fused=True`` stays fused)."""
    from lightning_multilora.module import _match_optimizer_state

    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = GroupedAdamW([{"params": [p], "adapter": "a", "lr": 1e-3}])
    saved = {"state": {0: {"step": torch.tensor(4.0)}},
             "param_groups": [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                               "params": [0], "lr": 5e-4, "fused": True}]}
    checkpoint = {"optimizer_states": [saved]}
    _match_optimizer_state(checkpoint, optimizer)
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == 5e-4 and group["fused"] is None and group["adapter"] == "a"


def test_closure_and_bad_arguments():
    w = torch.ones(3, requires_grad=True)
    opt = GroupedAdamW([w], lr=0.1)
    loss = opt.step(lambda: (w.sum() * 2).backward() or 7.0)
    assert loss == 7.0 and w.grad is not None and (w < 1).all()
    with pytest.raises(ValueError, match="fused"):
        GroupedAdamW([w], fused=True)


@pytest.mark.gpu
def test_large_groups_match_torch_fused_on_the_gpu():
    """Millions of elements per group (whole 4096-blocks and a tail, 16-byte vector accesses) against torch's
    fused AdamW, and a parameter at an odd address (no vector accesses)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(n, device="cuda", generator=gen) for n in (3_000_001, 1 << 21, 4096)]
    odd = torch.randn(10_001, device="cuda", generator=gen)
    ours = [t.clone().requires_grad_() for t in base] + [torch.empty(10_002, device="cuda")[1:].copy_(odd).requires_grad_()]
    ref = [t.clone().requires_grad_() for t in base] + [odd.clone().requires_grad_()]
    hyper = [dict(lr=1e-3, weight_decay=0.01), dict(lr=1e-2, betas=(0.9, 0.95)), dict(lr=5e-4), dict(lr=2e-3)]
    opt = GroupedAdamW([dict(params=[p], **h) for p, h in zip(ours, hyper)])
    torch_opt = torch.optim.AdamW([dict(params=[p], **h) for p, h in zip(ref, hyper)], fused=True)
    for step in range(4):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, device="cuda", generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


@pytest.mark.gpu
def test_the_module_trains_with_grouped_adamw_as_with_torch_fused(tmp_path):
    """`MultiLoRAModule` on CUDA steps ``torch.optim.AdamW`` (the default) as `GroupedAdamW`, one launch per step, and
    trains the adapters to the weights of torch's fused AdamW (``optimizer_kwargs={"fused": True}``)."""
    import lightning as L
    from safetensors.torch import load_file

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.kernels import triton_adamw

    weights, classes, launched = [], [], []
    real = triton_adamw.launch
    triton_adamw.launch = lambda *a, **k: launched.append(1) or real(*a, **k)
    try:
        for optimizer, kwargs in (("torch.optim.AdamW", {}), ("torch.optim.AdamW", {"fused": True})):
            specs = [AdapterSpec("a", lr=1e-3, batch_size=2, max_steps=6, weight_decay=0.1),
                     AdapterSpec("b", lr=3e-3, rank=16, batch_size=3, max_steps=4, seed=1)]
            dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(100)}, max_length=96, truncate=True)
            module = MultiLoRAModule("tiny-llama", adapters=specs, dtype="float32", optimizer=optimizer,
                                     optimizer_kwargs=kwargs, export_dir=str(tmp_path / str(len(kwargs))),
                                     validate_on_finish=False)

            class Seen(L.Callback):
                def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                    classes.append(type(trainer.optimizers[0]))

            L.Trainer(accelerator="gpu", devices=1, max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, logger=False,
                      default_root_dir=str(tmp_path), callbacks=[Seen()]).fit(module, dm)
            weights.append({n: load_file(f"{module.registry[n].export_path}/adapter_model.safetensors")
                            for n in ("a", "b")})
            if kwargs:
                assert all(g["fused"] for g in module.trainer.optimizers[0].param_groups)
    finally:
        triton_adamw.launch = real
    grouped_steps = classes.count(GroupedAdamW)
    assert classes[0] is GroupedAdamW and classes[-1] is torch.optim.AdamW and 0 < len(launched) <= grouped_steps
    for n in ("a", "b"):
        for k, ours in weights[0][n].items():
            ref = weights[1][n][k]
            assert ((ours.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-4, (n, k)
