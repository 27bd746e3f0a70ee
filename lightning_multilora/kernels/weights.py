"""The argument bundle of the one multi-LoRA function."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class LoRAWeights:
    """Per-adapter LoRA weights of one layer and the token segments they own, in segment order.

    Adapter ``i`` owns rows ``[starts[i], ends[i])`` of the flattened token buffer (sorted, disjoint);
    ``a[i]`` is ``(r_i, d_in)`` and ``b[i]`` is ``(d_out, r_i)`` (PEFT's ``lora_A.weight`` /
    ``lora_B.weight``); ``scaling[i]`` multiplies the low-rank product; ``dropout[i]`` is applied to
    the adapter's input rows in training.
    """

    a: tuple[Tensor, ...]
    b: tuple[Tensor, ...]
    scaling: tuple[float, ...]
    dropout: tuple[float, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.a)
        if not (len(self.b) == len(self.scaling) == len(self.dropout) == len(self.starts) == len(self.ends) == n):
            raise ValueError("LoRAWeights: a, b, scaling, dropout, starts and ends must have one entry per adapter")
