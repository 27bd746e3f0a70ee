"""Low-rank activations kept from a checkpointed forward for its recomputation.

Under gradient checkpointing a layer's forward runs twice: once in the forward pass, and again inside
backward to bring back the activations it dropped. The second run must produce the same outputs, so it
redoes every projection's shrink ``S_i = drop_i(X_i) A_i^T``, one more pass over ``X`` per projection (on
a Llama-8B layer, 637 MB of reads at 32 x 256 tokens) for a tensor of only ``rank`` columns.

`checkpoint_contexts` is a ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) that
keeps each shrink's ``S`` from the forward and hands it back, in order, to the recomputation of the same
region, which then skips the launch. It also reuses the forward call's launch state (pointer tables,
schedule, weight copies, dropout seeds), which the same inputs would rebuild the same, so a recomputed call
costs little host time. ``S`` costs ``tokens x max rank x 4`` bytes per projection until the region's
backward (about 117 MB for 32 adapters x 256 tokens on the 224 projections of Llama-8B), against the
activations checkpointing drops.

The entries are checked as they are taken back: a recomputation that asks for an ``S`` of another call
(another shape or adapter set) stops taking them, and computes from there on.

Usage with Hugging Face models (`MultiLoRAModule(gradient_checkpointing=True)` does this)::

    enable_checkpointing(model)  # (Hugging Face's checkpointing with `checkpointing_kwargs`)
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from torch import Tensor


class _Region:
    """The ``S`` tensors of one checkpointed region, in the order its forward made them."""

    __slots__ = ("entries", "cursor", "replaying")

    def __init__(self) -> None:
        self.entries: list[tuple[tuple, Tensor]] = []
        self.cursor = 0
        self.replaying = False

    def keep(self, key: tuple, s: Tensor, call: Any = None) -> None:
        """Keep ``S`` of a call with this key (and the call's launch state, which its recomputation reuses)."""
        self.entries.append((key, s.detach(), call))

    def take(self, key: tuple) -> Optional[tuple[Tensor, Any]]:
        """The next kept ``(S, call)`` if it belongs to a call with this key; else None from here on."""
        if self.cursor < len(self.entries) and self.entries[self.cursor][0] == key:
            _, s, call = self.entries[self.cursor]
            self.cursor += 1
            return s.detach(), call  # a fresh alias: the recomputation's Function becomes its grad_fn
        self.cursor = len(self.entries)
        return None


class _Active(threading.local):
    # The region whose forward or recomputation runs on this thread (recomputation runs in autograd's thread)
    region: Optional[_Region] = None


_active = _Active()


class _Within:
    """Makes ``region`` the active one while entered (forward, or a recomputation: a region is recomputed once per
    backward that needs it, e.g. twice with ``retain_graph=True``, so this can be entered again)."""

    __slots__ = ("region", "replaying", "previous")

    def __init__(self, region: _Region, replaying: bool) -> None:
        self.region, self.replaying, self.previous = region, replaying, None

    def __enter__(self) -> None:
        self.previous = _active.region
        _active.region = self.region
        self.region.replaying, self.region.cursor = self.replaying, 0

    def __exit__(self, *exc) -> None:
        _active.region = self.previous


def checkpoint_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint``: (forward context, recomputation context)
    sharing one region's kept ``S`` tensors."""
    region = _Region()
    return _Within(region, replaying=False), _Within(region, replaying=True)


def checkpointing_kwargs() -> dict:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` (Hugging Face's ``gradient_checkpointing_kwargs``):
    non-reentrant, with `checkpoint_contexts`."""
    return {"use_reentrant": False, "context_fn": checkpoint_contexts}


def active_region() -> Optional[_Region]:
    """The checkpointed region running on this thread, if it was entered through `checkpoint_contexts`."""
    return _active.region


def enable_checkpointing(model: Any) -> None:
    """Hugging Face's non-reentrant checkpointing of ``model``'s blocks, with `checkpointing_kwargs`:
    ``activation_checkpointing_enable`` where transformers has it (from 5.2x, which deprecates
    ``gradient_checkpointing_enable`` with a FutureWarning), else ``gradient_checkpointing_enable``; a model class's
    own ``gradient_checkpointing_enable`` (one that overrides transformers') is called as it is."""
    from transformers import PreTrainedModel

    kwargs = checkpointing_kwargs()
    own = getattr(type(model), "gradient_checkpointing_enable", None) is not getattr(
        PreTrainedModel, "gradient_checkpointing_enable", None)
    if callable(getattr(model, "activation_checkpointing_enable", None)) and not own:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
