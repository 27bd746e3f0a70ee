"""`Shadow`: a flat fp32 parameter's copy in the activation dtype, for the LoRA kernels to read.

The kernels multiply in the activation dtype (bf16): each layer's call used to copy its adapters' fp32 weights into
bf16 first (a read of 4 bytes and a write of 2 a parameter, and a launch, in every projection of every step). An
adapter's shadow holds all its weights in bf16, laid out as its flat parameter (`FlatAdapter`). `GroupedAdamW` writes
it in the launch that updates the weights (2 bytes a parameter more in a step that moves 28); anything else that
changes the weights leaves it stale, and `refresh` copies it again (one launch for every stale adapter) before a
forward reads it.

How staleness is seen, without reading the weights:

- every optimizer step (any optimizer, through torch's global pre- and post-step hooks) starts a new epoch; a shadow is
  fresh only if it was written for the current epoch (by the step's `GroupedAdamW`, or by `refresh` since);
- the version counters of the flat parameter and of every layer's parameter (its view), which torch bumps at
  every in-place write (``copy_`` of a loaded state dict, ``add_`` under ``no_grad``), and the flat's address;
- `LoRALayers.refresh_shadows` also holds an adapter flat again where a layer's parameter no longer is its view
  (``p.data = t``, ``load_state_dict(..., assign=True)``, a deep copy).

An in-place write that bumps no version counter, outside an optimizer step, is not seen: through ``.data``
(``p.data.copy_(w)``) or by a custom kernel. Call `invalidate_shadows` (or `refresh` with ``force``) after one.
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Optional, Sequence

import torch
from torch import Tensor

_version = attrgetter("_version")
_epoch = 0  # bumped before and after every optimizer step (`_count_step`)
_hooks: tuple = ()
_shadows: "weakref.WeakSet[Shadow]" = weakref.WeakSet()


def _count_step(optimizer, args, kwargs) -> None:
    global _epoch
    _epoch += 1


def _install_hook() -> None:
    global _hooks
    if not _hooks:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # after too: a closure's forward (inside the step) may refresh a shadow before the step writes the weights
        _hooks = (register_optimizer_step_pre_hook(_count_step), register_optimizer_step_post_hook(_count_step))


class Shadow:
    """``flat`` (a flat fp32 parameter) in ``dtype``, with ``views`` (the parameters that are views of ``flat``,
    in layout order at ``offsets``) mirrored as views of `tensor`.

    `fresh` says whether `tensor` holds ``flat``'s values: set by `refresh` and by an optimizer that writes it
    (`mark_written`), lost at the next optimizer step or at any in-place write torch counts."""

    def __init__(self, flat: Tensor, views: Sequence[Tensor], offsets: Sequence[int], dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"a shadow's dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        _install_hook()
        self.flat = flat
        self.params = tuple(views)
        # a normal tensor even when made under inference_mode (a validation): later steps write it in place
        with torch.inference_mode(False):
            self.tensor = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
            self.views = tuple(self.tensor[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, self.params))
        self._valid: Optional[tuple] = None
        _shadows.add(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def _signature(self, epoch: int) -> tuple:
        return (epoch, self.flat.data_ptr(), self.flat._version, sum(map(_version, self.params)))

    def fresh(self) -> bool:
        return self._valid is not None and self._valid == self._signature(_epoch)

    def mark_written(self, in_step: bool = False) -> None:
        """The caller has just written `tensor` from ``flat``'s current values; ``in_step``: inside an optimizer's
        step, whose post-step hook then starts the epoch this shadow is fresh in (a step that raises before it
        leaves the shadow stale)."""
        self._valid = self._signature(_epoch + 1 if in_step else _epoch)

    def invalidate(self) -> None:
        self._valid = None


# id(param) -> (param, its shadow), both weakly: the shadow's owner (a `FlatAdapter`) keeps it alive, and the shadow
# keeps its parameter alive, so a registry holding either would keep every adapter ever made
_registry: dict[int, tuple["weakref.ref[Tensor]", "weakref.ref[Shadow]"]] = {}


def register_shadow(param: Tensor, shadow: Optional[Shadow]) -> None:
    """``shadow`` is ``param``'s (None: it has none): what an optimizer stepping ``param`` asks `shadow_of`. The
    registration ends with the shadow or the parameter, whichever goes first."""
    key = id(param)
    if shadow is None:
        _registry.pop(key, None)
        return

    def forget(_, key=key, registry=_registry):  # (holds the dict: at exit the module's globals may be gone)
        entry = registry.get(key)
        if entry is not None and (entry[0]() is None or entry[1]() is None):
            registry.pop(key, None)

    _registry[key] = (weakref.ref(param, forget), weakref.ref(shadow, forget))


def shadow_of(param: Tensor) -> Optional[Shadow]:
    """The `Shadow` registered for ``param`` (the very object), or None."""
    entry = _registry.get(id(param))
    return entry[1]() if entry is not None and entry[0]() is param else None


def refresh(shadows: Sequence[Shadow], force: bool = False) -> int:
    """Copy ``flat`` into every stale shadow of ``shadows`` (every one with ``force``) in one multi-tensor copy;
    returns how many were copied. Not during a CUDA graph capture (a replay would not ask again)."""
    stale = [s for s in shadows if force or not s.fresh()]
    if not stale:
        return 0
    if stale[0].tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("adapter shadows were to be refreshed during a CUDA graph capture; refresh them before it")
    record_copy(stale)
    for s in stale:
        s.mark_written()
    return len(stale)


def record_copy(shadows: Sequence[Shadow]) -> None:
    """Copy every shadow of ``shadows`` from its flat parameter (one launch), leaving their freshness as it is:
    `refresh` marks them after; during a CUDA graph capture the copy is recorded, so that each replay copies them
    again before the forward reads them, as the per-call copies did (the capture runs nothing)."""
    with torch.no_grad():
        torch._foreach_copy_([s.tensor for s in shadows], [s.flat.detach() for s in shadows])


def invalidate_shadows() -> None:
    """Mark every shadow stale: after writing adapter weights in a way torch does not count (through ``.data``, or
    a custom kernel), the next forward copies them again."""
    for s in list(_shadows):
        s.invalidate()


__all__ = ["Shadow", "invalidate_shadows", "record_copy", "refresh", "register_shadow", "shadow_of"]
