"""The argument bundle of the one multi-LoRA function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


# The seed of adapter i's dropout masks at a call: its stream's seed advanced by its step (`stream_seeds`)
STREAM_STEP_MIX = 0x5851F42D  # (< 2^31: an int32 kernel argument)
STREAM_SEED_MOD = 2**31 - 1


@dataclass(frozen=True, eq=False)
class DropoutStreams:
    """Where each adapter's dropout masks come from: its own stream, not the run's shared random state, so that an
    adapter's masks do not depend on which adapters share its calls (nor on where its rows lie).

    ``seeds[i]``: adapter ``i``'s seed in this layer (its own seed with the layer mixed in); ``steps``: a table of
    int64 step counters on the weights' device, adapter ``i``'s at ``slots[i]``, which its owner advances once per
    training forward (`lightning_multilora.layer.LoRALayers.use`). A call masks adapter ``i``'s rows with
    ``stream_seeds(seeds, steps[slots])[i]``, each element kept or dropped by that seed and its (sequence row,
    position, column) alone (`LoRAWeights.row_tokens`); a recomputation under gradient checkpointing, within the same
    forward, gets the same masks."""

    seeds: tuple[int, ...]
    slots: tuple[int, ...]
    steps: Tensor


def stream_seeds(seeds: Tensor, steps: Tensor) -> Tensor:
    """``(seeds + steps * 0x5851F42D) mod (2^31 - 1)`` in int64, as int32: the seed of each adapter's masks at its
    step (the Triton path computes the same on the device)."""
    return ((seeds.to(torch.int64) + steps.to(torch.int64) * STREAM_STEP_MIX) % STREAM_SEED_MOD).to(torch.int32)


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

    ``a_copies`` / ``b_copies``: the same weights in a 16-bit activation dtype, kept equal to ``a`` / ``b`` by the
    caller (an optimizer that writes both at its step: `lightning_multilora.shadow`). Where the Triton path would
    copy the weights into the activation dtype before its products, it reads these instead and copies nothing; a
    caller that passes copies older than the weights gets the older weights' products. The reference path reads
    ``a`` and ``b``.

    ``streams``: each adapter's dropout masks from its own `DropoutStreams` entry; without, from seeds drawn from
    torch's random state at each call (the masks then depend on the other adapters of the call).
    ``row_tokens``: the token rows are sequences of this (padded) length, negative when left-padded (0: one sequence
    an adapter). A mask element is drawn for its (row, position in the row, column), the positions of a left-padded
    row counted from its end, so an adapter's masks do not change with the padded length that longer rows of other
    adapters set.
    """

    a: tuple[Tensor, ...]
    b: tuple[Tensor, ...]
    scaling: tuple[float, ...]
    dropout: tuple[float, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    direct_grads: bool = False
    a_copies: tuple[Tensor, ...] = ()
    b_copies: tuple[Tensor, ...] = ()
    streams: Optional[DropoutStreams] = None
    row_tokens: int = 0
    # Per-object memo of derived device state (the Triton path's pointer table, and its copies of the weights
    # in the activation dtype: 2 bytes a parameter), so the calls of a step do not rebuild them. Not an argument:
    # `dataclasses.replace` gives the new object its own (a copy with other scaling or segments reused the old
    # table and schedule, silently)
    memo: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.a)
        if not (len(self.b) == len(self.scaling) == len(self.dropout) == len(self.starts) == len(self.ends) == n):
            raise ValueError("LoRAWeights: a, b, scaling, dropout, starts and ends must have one entry per adapter")
        prev = 0
        for i, (start, end) in enumerate(zip(self.starts, self.ends)):  # (the kernels read and write these rows)
            if not prev <= start <= end:
                raise ValueError(f"LoRAWeights: adapter {i}'s rows [{start}, {end}) must start at or after the "
                                 f"previous adapter's end ({prev}) and end at or after their start: segments are "
                                 "sorted and disjoint")
            prev = end
        bad_p = [p for p in self.dropout if not 0 <= p < 1]
        if bad_p:
            raise ValueError(f"LoRAWeights: dropout probabilities must be in [0, 1), got {bad_p}")
        if self.streams is not None and not (len(self.streams.seeds) == len(self.streams.slots) == n):
            raise ValueError("LoRAWeights: streams must have one seed and one slot per adapter")
        if self.a_copies or self.b_copies:
            if len(self.a_copies) != n or len(self.b_copies) != n:
                raise ValueError("LoRAWeights: a_copies and b_copies must have one entry per adapter (or none)")
            dtypes = {c.dtype for c in self.a_copies + self.b_copies}
            if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float16}:
                raise ValueError(f"LoRAWeights: a_copies and b_copies must share one dtype, bfloat16 or float16; got "
                                 f"{sorted(map(str, dtypes))}")
            for w, c in zip(self.a + self.b, self.a_copies + self.b_copies):
                if c.shape != w.shape or c.device != w.device or not c.is_contiguous():
                    raise ValueError(f"LoRAWeights: each copy must be contiguous and shaped and placed as its weight; "
                                     f"got {tuple(c.shape)} on {c.device} for {tuple(w.shape)} on {w.device}")
