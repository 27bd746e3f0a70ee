"""Pure-PyTorch multi-LoRA over a packed token buffer: the CPU path and the oracle for kernels."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_multilora.kernels.weights import STREAM_SEED_MOD, LoRAWeights, stream_seeds


def multi_lora_reference(x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool) -> Tensor:
    """``Y = Y_base + s_i * dropout_i(X_i) A_i^T B_i^T`` on each adapter's rows, one adapter at a time.

    The same arithmetic, in the same order, as PEFT's ``lora.Linear.forward`` on those rows: the input
    is cast to the adapter dtype, ``B(A(dropout(x))) * scaling`` is added to the base output in the adapter dtype
    (float32 beside a bf16 base), and the sum rounded once to the base output's dtype.
    Rows outside every segment keep ``base_out``. Autograd gives the gradients of x, A and B.
    """
    if weights.a and weights.ends[-1] > x.shape[0]:
        raise ValueError(f"the adapters' rows end at {weights.ends[-1]}, past x's {x.shape[0]} rows")
    seeds = None
    if training and weights.streams is not None and any(p > 0 for p in weights.dropout) and not x.is_meta:
        streams = weights.streams
        steps = streams.steps[list(streams.slots)].cpu()
        seeds = stream_seeds(torch.tensor(streams.seeds, dtype=torch.int64), steps).tolist()
    pieces: list[Tensor] = []
    prev = 0
    for i, (start, end) in enumerate(zip(weights.starts, weights.ends)):
        if start > prev:
            pieces.append(base_out[prev:start])
        if end > start:
            a, b = weights.a[i], weights.b[i]
            xi = x[start:end].to(a.dtype)  # (T_i, d_in)
            if training and weights.dropout[i] > 0:
                xi = _dropout(xi, weights.dropout[i], None if seeds is None else seeds[i], weights.row_tokens)
            delta = (xi @ a.t()) @ b.t() * weights.scaling[i]  # (T_i, d_out)
            pieces.append((base_out[start:end] + delta).to(base_out.dtype))  # (one rounding, as PEFT's)
        prev = end
    if prev < base_out.shape[0]:
        pieces.append(base_out[prev:])
    if not pieces:
        return base_out
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _dropout(x: Tensor, p: float, seed: Optional[int], row_tokens: int) -> Tensor:
    """``F.dropout`` from torch's random state, or (``seed``: the adapter's stream) with a mask that depends on the
    seed and each element's (sequence row, position, column) alone (`LoRAWeights.row_tokens`): each row's from a
    generator seeded by the seed and the row, drawn position by position, so a longer padded length only adds
    positions. (The Triton path's masks come from the same seed by another generator.)"""
    if seed is None:
        return F.dropout(x, p=p, training=True)
    n, width = x.shape
    length = abs(row_tokens) if row_tokens and n % abs(row_tokens) == 0 else n
    rows = []
    for row in range(n // length if length else 0):
        generator = torch.Generator().manual_seed((seed + row * _ROW_MIX) % STREAM_SEED_MOD)
        draws = torch.rand(length, width, generator=generator)
        rows.append(draws.flip(0) if row_tokens < 0 else draws)
    keep = (torch.cat(rows) if rows else torch.ones(0, width)).to(x.device) >= p
    return x * keep / (1.0 - p)


_ROW_MIX = 0x2C1B3C6D
