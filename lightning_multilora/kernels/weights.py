"""The argument bundle of the one multi-LoRA function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class LoRAWeights:
    """Per-adapter LoRA weights of one layer and the token segments they own, in segment order.

    Adapter ``i`` owns rows ``[starts[i], ends[i])`` of the flattened token buffer (sorted, disjoint);
    ``a[i]`` is ``(r_i, d_in)`` and ``b[i]`` is ``(d_out, r_i)`` (PEFT's ``lora_A.weight`` /
    ``lora_B.weight``); ``scaling[i]`` multiplies the low-rank product; ``dropout[i]`` is applied to
    the adapter's input rows in training.

    ``direct_grads``: when the weights are leaf parameters that require grad, the Triton path adds
    ``dA_i`` / ``dB_i`` straight into their ``.grad`` during backward (what autograd's gradient
    accumulation does), instead of handing 2N gradients to autograd: that per-adapter bookkeeping is
    most of a call's host time. ``loss.backward()`` gives the same ``.grad`` either way; with
    ``direct_grads`` the weights are not autograd inputs of the call, so ``torch.autograd.grad`` w.r.t.
    them (which raises otherwise), ``backward(inputs=...)`` naming some of them, and per-parameter gradient hooks
    need ``direct_grads=False``. ``torch.autograd.grad`` w.r.t. other tensors only (an input's gradient) leaves
    their ``.grad`` alone, as it does without.
    """

    a: tuple[Tensor, ...]
    b: tuple[Tensor, ...]
    scaling: tuple[float, ...]
    dropout: tuple[float, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    direct_grads: bool = False
    # Per-object memo of derived device state (the Triton path's pointer table, and its copies of the weights
    # in the activation dtype: 2 bytes a parameter), so the calls of a step do not rebuild them.
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.a)
        if not (len(self.b) == len(self.scaling) == len(self.dropout) == len(self.starts) == len(self.ends) == n):
            raise ValueError("LoRAWeights: a, b, scaling, dropout, starts and ends must have one entry per adapter")
