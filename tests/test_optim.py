"""GroupedAdamW: torch.optim.AdamW's update and state, every group in one Triton launch (the interpreter on CPU)."""

from __future__ import annotations

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


@pytest.fixture
def triton_backend():
    """The kernel on CPU tensors too (the interpreter), as on CUDA ones."""
    before = kernels.get_backend()
    kernels.set_backend("triton")
    yield
    kernels.set_backend(before)


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
        opt.step()
        torch_opt.step()
        assert max_rel(ours, ref) < 2e-6, step
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


def test_everything_else_steps_through_torch_adamw():
    """On the reference backend (CPU's default), with amsgrad or a non-fp32 parameter, the step is torch's own."""
    before = kernels.get_backend()
    kernels.set_backend("reference")
    try:
        for hyper, dtype in (({}, torch.float32), ({"amsgrad": True}, torch.float32), ({}, torch.float64)):
            a = torch.randn(64, dtype=dtype, requires_grad=True)
            b = a.detach().clone().requires_grad_()
            opt, ref = GroupedAdamW([a], lr=0.1, **hyper), torch.optim.AdamW([b], lr=0.1, **hyper)
            for step in range(3):
                a.grad = torch.full_like(a, float(step + 1))
                b.grad = a.grad.clone()
                opt.step()
                ref.step()
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        kernels.set_backend(before)


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
def test_the_module_steps_adamw_in_one_launch_on_cuda(tmp_path):
    """`MultiLoRAModule` with torch.optim.AdamW on CUDA steps GroupedAdamW; with ``fused`` set, torch's; the two
    train the same adapters to the same weights."""
    import lightning as L
    from safetensors.torch import load_file

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.data import GeneratedArithmetic

    weights, classes = [], []
    for kwargs in ({}, {"fused": True}):
        specs = [AdapterSpec("a", lr=1e-3, batch_size=2, max_steps=6, weight_decay=0.1),
                 AdapterSpec("b", lr=3e-3, rank=16, batch_size=3, max_steps=4, seed=1)]
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(100)}, max_length=64, truncate=True)
        module = MultiLoRAModule("tiny-llama", adapters=specs, dtype="float32", optimizer_kwargs=kwargs,
                                 export_dir=str(tmp_path / str(bool(kwargs))), validate_on_finish=False)

        class Seen(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                classes.append(type(trainer.optimizers[0]))

        L.Trainer(accelerator="gpu", devices=1, max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, logger=False, default_root_dir=str(tmp_path),
                  callbacks=[Seen()]).fit(module, dm)
        weights.append({n: load_file(f"{module.registry[n].export_path}/adapter_model.safetensors") for n in ("a", "b")})
    assert classes[0] is GroupedAdamW and classes[-1] is torch.optim.AdamW
    for n in ("a", "b"):
        for k, ours in weights[0][n].items():
            ref = weights[1][n][k]
            assert ((ours.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-4, (n, k)
