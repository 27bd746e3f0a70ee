"""Multi-LoRA compute over a packed token buffer.

`multi_lora` is the one function the layer calls; the backend is chosen here so that faster kernels
plug in without touching the layer.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_multilora.kernels.reference import multi_lora_reference
from lightning_multilora.kernels.weights import LoRAWeights

BACKENDS = ("auto", "reference", "triton")
TRITON_MAX_RANK = 256  # the Triton kernels' largest adapter rank (the reference path takes any)
_backend = os.environ.get("MULTILORA_BACKEND", "auto")


def set_backend(name: str) -> None:
    """Force a backend for every layer: one of ``BACKENDS``.

    ``auto``: Triton kernels for CUDA tensors, the reference elsewhere. ``triton`` on CPU tensors needs
    ``TRITON_INTERPRET=1`` (the Triton interpreter; slow, for tests).
    """
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"`backend` can be {', '.join(BACKENDS)}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def multi_lora(x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool) -> Tensor:
    """Return ``base_out`` plus every adapter's LoRA term on its own rows.

    Args:
        x: ``(T, d_in)`` packed input tokens of the layer.
        base_out: ``(T, d_out)`` the frozen layer's output for ``x``.
        weights: per-adapter ``A``, ``B``, scaling, dropout and token segments.
        training: apply dropout.

    Returns:
        ``(T, d_out)`` in ``base_out``'s dtype; differentiable in ``x``, every ``A`` and ``B``. The Triton
        backend adds into ``base_out`` itself and returns it (no second pass over it): give a fresh one (a leaf
        that requires grad, which autograd would refuse to change, is copied first; one its producer saved for its
        backward, a sigmoid's output say, must be given as a copy). An adapter whose segment holds no rows gets a
        zero gradient from the Triton backend (every adapter's gradients are made at once), none from the
        reference (as autograd gives): weight decay or momentum then moves it on the GPU alone; leave such
        adapters out of the call, as `MultiLoRALinear` does.
    """
    backend = resolve_backend(x, base_out)
    if backend == "triton":
        from lightning_multilora.kernels.triton_lora import multi_lora_triton

        if base_out.requires_grad and base_out.is_leaf:  # (an in-place add to it is refused by autograd)
            base_out = base_out.clone()
        return multi_lora_triton(x, base_out, weights, training)
    return multi_lora_reference(x, base_out, weights, training)


def multi_lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], weights: LoRAWeights,
                      training: bool) -> Tensor:
    """``F.linear(x, weight, bias)`` plus every adapter's LoRA term: `multi_lora` over a frozen dense base.

    ``weight`` (and ``bias``) must be frozen and in ``x``'s dtype. On the Triton backend the base product is
    computed inside the LoRA autograd Functions, whose backward adds the LoRA part of ``dX`` straight into
    the base's ``dY W`` (no separate LoRA ``dX`` for autograd to sum); the reference computes the same.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad) or weight.dtype != x.dtype:
        raise ValueError(f"multi_lora_linear needs a frozen base weight (and bias) in the input's dtype {x.dtype}, "
                         f"got weight {weight.dtype} requires_grad={weight.requires_grad}")
    if resolve_backend(x) == "triton":
        from lightning_multilora.kernels.triton_lora import multi_lora_linear_triton

        return multi_lora_linear_triton(x, weight, bias, weights, training)
    return multi_lora_reference(x, F.linear(x, weight, bias), weights, training)


def keep_calls():
    """A context collecting the Triton calls made while it is open (see `triton_lora.keep_calls`); an empty list
    where Triton is not installed."""
    if not _triton_available():
        from contextlib import nullcontext

        return nullcontext([])
    from lightning_multilora.kernels.triton_lora import keep_calls as _keep_calls

    return _keep_calls()


def keep_alive(obj):
    """``obj``, kept by the innermost open `keep_calls` context too (device state that a CUDA graph being
    captured reads, and that no cache may free while the graph lives)."""
    if not _triton_available():
        return obj
    from lightning_multilora.kernels.triton_lora import keep_alive as _keep_alive

    return _keep_alive(obj)


def resolve_backend(x: Tensor, *others: Tensor) -> str:
    """The backend that runs for ``x`` (and ``others``, the call's other activations): what ``auto`` resolves to, or
    the forced one."""
    if _backend not in BACKENDS:
        raise ValueError(f"`backend` can be {', '.join(BACKENDS)}, got {_backend!r}")
    if _backend == "auto":
        # (float64, the oracle's dtype, is the reference's: the kernels take bf16, fp16 and fp32)
        return "triton" if x.is_cuda and x.dtype != torch.float64 and _triton_available() else "reference"
    if _backend == "triton" and not x.is_cuda and not _interpreted():
        late = os.environ.get("TRITON_INTERPRET") == "1"  # (the kernels were made for the GPU as they were imported)
        raise ValueError(f"the 'triton' backend runs on CUDA tensors (got a {x.device.type} one), or on the CPU under "
                         "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported" +
                         (": it was set after the kernels were imported" if late else "") +
                         "); use 'reference' or 'auto' here")
    if _backend == "triton" and not x.is_cuda and (any(t.dtype == torch.bfloat16 for t in (x, *others))
                                                   or _cpu_autocast_bf16()):  # (gradients off by 1e12, unsaid)
        raise ValueError("Triton's interpreter (the 'triton' backend on the CPU) computes bfloat16 wrongly: give it "
                         "float16 or float32 inputs, or use 'reference' or 'auto' for bfloat16 on the CPU")
    if _backend == "triton" and x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"the 'triton' backend takes bfloat16, float16 and float32 inputs, got {x.dtype} (its "
                         "products would run in float32); use 'reference' or 'auto' for it")
    return _backend


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cpu_autocast_bf16() -> bool:
    """Whether CPU autocast runs in bfloat16 (``precision="bf16-mixed"``: a float32 input's products, and the
    gradients back, in bfloat16)."""
    try:
        return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    except (TypeError, AttributeError):  # (an older torch's signatures)
        return False


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: TRITON_INTERPRET=1 was set when they were imported."""
    if not _triton_available():
        return False
    from lightning_multilora.kernels import triton_kernels

    return triton_kernels.INTERPRETED


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["BACKENDS", "LoRAWeights", "get_backend", "keep_alive", "keep_calls", "multi_lora", "multi_lora_linear",
           "multi_lora_reference", "resolve_backend", "set_backend"]
