"""`FlatAdapter`: one adapter's weights in every layer as views of one flat parameter, its gradients as views of
one flat gradient.

A LoRA adapter on an 8B model's 7 projections has 448 tensors (A and B in 32 layers); 32 adapters have 14,336.
Whatever touches each of them from Python costs host time at every step: on the H200 a fused AdamW step over
14,336 tensors took 98 ms of host time (its per-tensor bookkeeping), where the frozen base's whole step
(seq 16) takes about 160 ms. With the weights and gradients flat, the optimizer, the gradient norm, clipping and
the zeroing see one tensor per adapter. The layers keep their own ``lora_A`` / ``lora_B`` parameters (views),
so state dicts, exports and the kernels' pointer tables are unchanged.
"""

from __future__ import annotations

from operator import attrgetter, is_
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_multilora.optim import GroupedAdamW
from lightning_multilora.shadow import Shadow, register_shadow

_data_ptr = Tensor.data_ptr
_grad = attrgetter("grad")
ALIGN = 64  # elements: each view starts on a 256-byte boundary (fp32), as a separately allocated tensor would

# Optimizers whose update is elementwise (the same on a concatenation as on its parts): they step the flat
# parameter. Others (factored, per-matrix or trust-ratio ones, or optimizers we do not know) step the layers'
# own parameters, whose gradients are the same views.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, GroupedAdamW,
)


class FlatAdapter:
    """The parameters ``params`` (one adapter's, every layer, one device and dtype) re-pointed at views of
    ``flat``, with their ``.grad`` views of one flat gradient.

    The views stay valid as long as nothing replaces a parameter's storage. Something may (``module.to()`` to
    another device or dtype, an assignment to ``.data``): `rebind` (which `MultiLoRAMixin` calls whenever the
    module is moved or cast) and `prepare_grads` see it by the parameters' addresses and bind them again, keeping
    their values and ``flat``'s identity (the optimizer's key).

    Between `prepare_grads` and the optimizer's step nothing may set the gradients to None
    (``optimizer.zero_grad()``): an elementwise optimizer would then skip the adapter.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        if not params:
            raise ValueError("a FlatAdapter needs at least one parameter")
        self.params = tuple(params)
        self.flat = nn.Parameter(torch.empty(0, dtype=params[0].dtype, device=params[0].device))
        self.shadow: Optional[Shadow] = None
        self._bind()

    @staticmethod
    def can_hold(params: Sequence[Tensor]) -> bool:
        """One device and one dtype (a model split over devices keeps per-layer parameters), plain tensors (FSDP2's
        sharded parameters, DTensors, are views of their shards: "_foreach_copy_ got mixed torch.Tensor and
        DTensor")."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # (a torch built without distributed: no DTensor)
            DTensor = ()
        return bool(params) and len({(p.device, p.dtype) for p in params}) == 1 and \
            not any(isinstance(p, DTensor) for p in params)

    def _views(self, flat: Tensor) -> tuple[Tensor, ...]:
        return tuple(flat[o:o + p.numel()].view(p.shape) for o, p in zip(self._offsets, self.params))

    def _bind(self) -> None:
        """Copy the parameters' values into a new flat storage and point them at its views (the gradient is made
        by the first `prepare_grads`: an adapter only evaluated never holds one)."""
        if not self.can_hold(self.params):
            raise ValueError("an adapter's parameters must share one device and dtype to be held flat; got "
                             f"{sorted({(str(p.device), str(p.dtype)) for p in self.params})}")
        offsets, total = layout(self.params)
        self._offsets = offsets
        first = self.params[0]
        with torch.no_grad():
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
            views = self._views(flat)
            torch._foreach_copy_(list(views), [p.detach() for p in self.params])
            for p, view in zip(self.params, views):
                p.grad = None  # a gradient of the old storage (moved or cast with it) no longer aliases anything
                p.data = view
            self.flat.grad = None
            self.flat.data = flat
        self._grad: Optional[Tensor] = None
        self._grad_views: tuple[Tensor, ...] = ()
        self._ptrs = (flat.data_ptr(), *map(_data_ptr, self.params))
        if self.shadow is not None:  # a new storage (moved or cast): a new shadow beside it
            self.keep_shadow(self.shadow.dtype, renew=True)

    def keep_shadow(self, dtype: torch.dtype, renew: bool = False) -> Shadow:
        """Hold the adapter's weights in ``dtype`` too (a `Shadow`: `GroupedAdamW` writes it at its step, `refresh`
        copies it where it is stale), laid out as ``flat``; made again when ``flat`` is bound anew."""
        if renew or self.shadow is None or self.shadow.dtype != dtype:
            self.shadow = Shadow(self.flat, self.params, self._offsets, dtype)
            register_shadow(self.flat, self.shadow)
        return self.shadow

    def drop_shadow(self) -> None:
        """No shadow any more (its memory is freed once no forward holds it)."""
        self.shadow = None
        register_shadow(self.flat, None)

    def bound(self) -> bool:
        """Every parameter is still its view of ``flat``."""
        return (self.flat.data_ptr(), *map(_data_ptr, self.params)) == self._ptrs

    def rebind(self) -> None:
        """Bind the parameters again if something replaced their storage (a move to another device or dtype)."""
        if not self.bound():
            self._bind()

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """Tensors shaped as ``params`` (an optimizer's per-parameter moments, say) laid out as ``flat`` is."""
        out = torch.zeros(self.flat.numel(), dtype=tensors[0].dtype, device=tensors[0].device)
        torch._foreach_copy_(list(self._views(out)), [t.reshape(p.shape) for t, p in zip(tensors, self.params)])
        return out

    def prepare_grads(self, zero: bool = True) -> Tensor:
        """Before a step's backward: the flat gradient zeroed, ``flat.grad`` set to it and every parameter's
        ``.grad`` its view (set again where something dropped or replaced it). Returns the flat gradient.

        ``zero=False`` leaves the gradient's values, an existing one's or a new one's (made empty), for the caller to
        zero (`LoRALayers.prepare_grads` zeroes every adapter's in one launch)."""
        self.rebind()
        if self._grad is None:
            self._grad = (torch.zeros_like if zero else torch.empty_like)(self.flat.data)
            self._grad_views = self._views(self._grad)
        elif zero:
            self._grad.zero_()
        if self.flat.grad is not self._grad:
            self.flat.grad = self._grad
        if not all(map(is_, map(_grad, self.params), self._grad_views)):
            for p, g in zip(self.params, self._grad_views):
                p.grad = g
        return self._grad

    def drop_grads(self) -> None:
        """No gradient for this step (the optimizer skips the adapter): ``flat`` and every parameter lose theirs,
        and the buffer is freed (a paused adapter holds none; the next `prepare_grads` makes it again)."""
        self.flat.grad = None
        for p in self.params:
            p.grad = None
        self._grad, self._grad_views = None, ()


def layout(params: Sequence[Tensor]) -> tuple[list[int], int]:
    """Where each of ``params`` starts in their flat tensor, and its length (each start aligned to `ALIGN`)."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() // ALIGN) * ALIGN
    return offsets, total


def unflatten(flat: Tensor, params: Sequence[Tensor]) -> Optional[list[Tensor]]:
    """A tensor laid out as ``params``' flat tensor (an optimizer's moments of a flat parameter) as one tensor per
    parameter, shaped as it is (copies); None where its length is not theirs."""
    offsets, total = layout(params)
    if flat.dim() != 1 or flat.numel() != total:
        return None
    return [flat[o:o + p.numel()].view(p.shape).clone() for o, p in zip(offsets, params)]


def make_flat(params: Sequence[nn.Parameter]) -> Optional[FlatAdapter]:
    """A `FlatAdapter` over ``params`` where they can be held flat, else None."""
    return FlatAdapter(params) if FlatAdapter.can_hold(params) else None
