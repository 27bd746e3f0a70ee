"""Pure-PyTorch multi-LoRA over a packed token buffer: the CPU path and the oracle for kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_multilora.kernels.weights import LoRAWeights


def multi_lora_reference(x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool) -> Tensor:
    """``Y = Y_base + s_i * dropout_i(X_i) A_i^T B_i^T`` on each adapter's rows, one adapter at a time.

    The same arithmetic, in the same order, as PEFT's ``lora.Linear.forward`` on those rows: the input
    is cast to the adapter dtype, ``B(A(dropout(x))) * scaling`` is added to the base output.
    Rows outside every segment keep ``base_out``. Autograd gives the gradients of x, A and B.
    """
    pieces: list[Tensor] = []
    prev = 0
    for i, (start, end) in enumerate(zip(weights.starts, weights.ends)):
        if start > prev:
            pieces.append(base_out[prev:start])
        if end > start:
            a, b = weights.a[i], weights.b[i]
            xi = x[start:end].to(a.dtype)  # (T_i, d_in)
            if training and weights.dropout[i] > 0:
                xi = F.dropout(xi, p=weights.dropout[i], training=True)
            delta = (xi @ a.t()) @ b.t() * weights.scaling[i]  # (T_i, d_out)
            pieces.append(base_out[start:end] + delta.to(base_out.dtype))
        prev = end
    if prev < base_out.shape[0]:
        pieces.append(base_out[prev:])
    if not pieces:
        return base_out
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
