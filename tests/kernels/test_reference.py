"""The reference multi-LoRA function: the oracle for every kernel."""

from __future__ import annotations

import pytest
import torch

from lightning_multilora import kernels
from lightning_multilora.kernels import LoRAWeights, multi_lora, multi_lora_reference


def random_problem(ranks, tokens, d_in=24, d_out=18, dtype=torch.float64, seed=None, gap=2):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    starts, ends, offset = [], [], gap
    for t in tokens:
        starts.append(offset)
        offset += t
        ends.append(offset)
        offset += gap  # rows between segments belong to no adapter
    x = torch.randn(offset, d_in, generator=g, dtype=dtype, requires_grad=True)
    base = torch.randn(offset, d_out, generator=g, dtype=dtype, requires_grad=True)
    a = tuple(torch.randn(r, d_in, generator=g, dtype=dtype, requires_grad=True) for r in ranks)
    b = tuple(torch.randn(d_out, r, generator=g, dtype=dtype, requires_grad=True) for r in ranks)
    scaling = tuple(float(s) for s in torch.rand(len(ranks), generator=g) * 3 + 0.1)
    weights = LoRAWeights(a, b, scaling, tuple(0.0 for _ in ranks), tuple(starts), tuple(ends))
    return x, base, weights


def test_matches_the_dense_formula_with_gaps_and_empty_segments():
    x, base, w = random_problem(ranks=[1, 7, 100, 3], tokens=[5, 0, 9, 1])
    y = multi_lora_reference(x, base, w, training=False)
    expected = base.clone()
    for a, b, s, lo, hi in zip(w.a, w.b, w.scaling, w.starts, w.ends):
        expected[lo:hi] = base[lo:hi] + s * x[lo:hi] @ a.t() @ b.t()
    torch.testing.assert_close(y, expected)


def test_float64_gradcheck_of_x_a_b_and_base():
    x, base, w = random_problem(ranks=[1, 4, 7], tokens=[3, 0, 4], d_in=6, d_out=5)

    def f(x, base, *ab):
        n = len(w.a)
        weights = LoRAWeights(ab[:n], ab[n:], w.scaling, w.dropout, w.starts, w.ends)
        return multi_lora_reference(x, base, weights, training=False)

    assert torch.autograd.gradcheck(f, (x, base, *w.a, *w.b))


def test_dropout_only_in_training_and_only_on_its_adapter():
    x, base, w = random_problem(ranks=[2, 2], tokens=[50, 50])
    w = LoRAWeights(w.a, w.b, w.scaling, (0.5, 0.0), w.starts, w.ends)
    evaluated = multi_lora_reference(x, base, w, training=False)
    trained = multi_lora_reference(x, base, w, training=True)
    first, second = slice(w.starts[0], w.ends[0]), slice(w.starts[1], w.ends[1])
    assert not torch.allclose(trained[first], evaluated[first])
    torch.testing.assert_close(trained[second], evaluated[second])


def test_dispatch_and_backend_switch():
    x, base, w = random_problem(ranks=[3], tokens=[4], dtype=torch.float32, seed=0)
    torch.testing.assert_close(multi_lora(x, base, w, False), multi_lora_reference(x, base, w, False))
    with pytest.raises(ValueError, match="`backend` can be auto, reference, triton"):
        kernels.set_backend("cuda-magic")
    kernels.set_backend("reference")
    try:
        assert kernels.get_backend() == "reference"
    finally:
        kernels.set_backend("auto")
    pytest.importorskip("triton")
    kernels.set_backend("triton")  # on CPU tensors outside Triton's interpreter: named, not an assertion deep inside
    try:
        with pytest.MonkeyPatch.context() as patch:
            from lightning_multilora.kernels import triton_kernels

            interpreted = triton_kernels.INTERPRETED
            patch.delenv("TRITON_INTERPRET", raising=False)
            patch.setattr(triton_kernels, "INTERPRETED", False)  # (the kernels made for the GPU as imported)
            with pytest.raises(ValueError, match=r"the 'triton' backend runs on CUDA tensors \(got a cpu one\), or "
                                                 r"on the CPU under Triton's interpreter \(TRITON_INTERPRET=1 set "
                                                 r"before triton is imported\); use"):
                multi_lora(x, base, w, False)
            patch.setenv("TRITON_INTERPRET", "1")  # (set late: the kernels were made for the GPU, an assertion deep
            with pytest.raises(ValueError, match=r"\(TRITON_INTERPRET=1 set before triton is imported: it was set "
                                                 r"after the kernels were imported\)"):  # inside Triton's launch)
                multi_lora(x, base, w, False)
            patch.setattr(triton_kernels, "INTERPRETED", interpreted)
            x64, base64, w64 = random_problem(ranks=[3], tokens=[4], dtype=torch.float64, seed=0)
            with pytest.raises(ValueError, match=r"the 'triton' backend takes bfloat16, float16 and float32 inputs, "
                                                 r"got torch.float64"):  # (not products silently in float32)
                multi_lora(x64, base64, w64, False)
            x16, base16, w16 = random_problem(ranks=[3], tokens=[4], dtype=torch.bfloat16, seed=0)
            with pytest.raises(ValueError, match=r"Triton's interpreter \(the 'triton' backend on the CPU\) computes "
                                                 r"bfloat16 wrongly"):  # (gradients 1e12 times too large, unsaid)
                multi_lora(x16, base16, w16, False)
            x32, base32, w32 = random_problem(ranks=[3], tokens=[4], dtype=torch.float32, seed=0)
            for x_, base_ in ((x32, base32.bfloat16()), (x32, base32)):  # (a bf16 base output; CPU autocast in bf16)
                with pytest.raises(ValueError, match=r"computes bfloat16 wrongly"), \
                        torch.autocast("cpu", dtype=torch.bfloat16, enabled=base_.dtype == torch.float32):
                    multi_lora(x_, base_, w32, False)
    finally:
        kernels.set_backend("auto")


def test_mismatched_weights_are_rejected():
    with pytest.raises(ValueError, match="one entry per adapter"):
        LoRAWeights((torch.zeros(1, 2),), (), (1.0,), (0.0,), (0,), (1,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_base_output_is_rounded_once_as_peft_rounds_it(dtype):
    """PEFT adds the float32 LoRA term to a bf16 / fp16 base output and rounds the sum once; the reference rounded
    the term to the base dtype before the add, a second rounding (1 ulp off on ~3% of the outputs, 0.03 on bf16
    logits)."""
    x, base, w = random_problem(ranks=[4, 8], tokens=[40, 60], d_in=64, d_out=48, dtype=torch.float32, seed=3)
    base = (base * 50).to(dtype).detach()
    y = multi_lora_reference(x.detach().to(dtype), base, w, training=False)
    for a, b, s, lo, hi in zip(w.a, w.b, w.scaling, w.starts, w.ends):
        delta = (x[lo:hi].to(dtype).float() @ a.t()) @ b.t() * s  # (PEFT: the input cast to the adapter dtype)
        assert torch.equal(y[lo:hi], (base[lo:hi] + delta).to(dtype))  # (PEFT's `result + delta`, cast back once)
