"""`GroupedAdamW`: ``torch.optim.AdamW`` whose step updates every param group in one kernel launch."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

_CACHE_SIZE = 8


class GroupedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, update, state and ``state_dict``) whose step, for CUDA fp32
    parameters, runs one Triton launch over every param group: the adapters' groups, each with its own
    learning rate, betas, eps, weight decay and step count (`kernels.triton_adamw`). With many adapters this
    is the largest memory pass of a LoRA step after the base model's; PyTorch's fused AdamW launches per group
    and moves it at about 60% of the H200's copy bandwidth.

    Everything else steps through ``torch.optim.AdamW`` (``foreach`` as given): parameters on the CPU (or
    with ``kernels.set_backend("reference")``), other dtypes, sparse gradients, a learning rate held in a
    CUDA tensor, ``amsgrad``, ``capturable`` and ``differentiable``. ``fused=True`` is refused: this is the
    fused path. `MultiLoRAModule` uses it for ``torch.optim.AdamW`` on CUDA unless ``optimizer_kwargs`` sets
    ``fused`` or ``foreach``.
    """

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        if kwargs.get("fused"):
            raise ValueError("GroupedAdamW's `fused` must be left unset or False (its CUDA step is already one "
                             f"fused launch over every group), got fused={kwargs['fused']!r}")
        kwargs.pop("fused", None)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)
        self._tables: OrderedDict[tuple, Any] = OrderedDict()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        members = self._grouped_members()
        if members is None:
            super().step()
        elif members:
            self._grouped_step(members)
        return loss

    def _grouped_members(self) -> Optional[list[tuple[Tensor, dict]]]:
        """The (parameter, group) pairs the grouped kernel steps, or None where ``torch.optim.AdamW`` must."""
        from lightning_multilora.kernels import resolve_backend

        members, device = [], None
        for group in self.param_groups:
            if group["amsgrad"] or group["capturable"] or group["differentiable"] or group.get("fused"):
                return None
            lr = group["lr"]
            if isinstance(lr, Tensor) and lr.device.type != "cpu":
                return None
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if (p.dtype != torch.float32 or g.dtype != torch.float32 or g.is_sparse or not p.is_contiguous()
                        or not g.is_contiguous() or (device is not None and p.device != device)
                        or g.device != p.device):
                    return None
                device = p.device
                members.append((p, group))
        if members and resolve_backend(members[0][0]) != "triton":
            return None
        return members

    def _grouped_step(self, members: list[tuple[Tensor, dict]]) -> None:
        from lightning_multilora.kernels import triton_adamw
        from lightning_multilora.kernels.triton_lora import _upload

        device = members[0][0].device
        hyper, tensors = [], []
        for p, group in members:
            state = self.state[p]
            if len(state) == 0:  # as torch.optim.AdamW starts a parameter
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device.type != "cpu":  # a state loaded from a fused or capturable AdamW
                state["step"] = state["step"].cpu()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if m.dtype != torch.float32 or v.dtype != torch.float32 or not (m.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"GroupedAdamW's exp_avg and exp_avg_sq must be contiguous fp32 like their parameter, "
                                 f"got {m.dtype} and {v.dtype}")
            state["step"] += 1
            step = float(state["step"])
            lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
            hyper.append((1.0 - lr * float(group["weight_decay"]), 1.0 - beta1, beta2, 1.0 - beta2,
                          lr / (1.0 - beta1 ** step),
                          math.sqrt(1.0 - beta2 ** step), float(group["eps"]), -1.0 if group["maximize"] else 1.0))
            tensors.append((p, p.grad, m, v))
        ptrs = tuple(t.data_ptr() for quad in tensors for t in quad)
        numels = tuple(p.numel() for p, *_ in tensors)
        key = (device, ptrs, numels)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._make_tables(ptrs, numels, device, triton_adamw.BLOCK, _upload)
            self._tables[key] = tables
            if len(self._tables) > _CACHE_SIZE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        ptr_table, numel_table, blk_tensor, blk_index = tables
        hyper_table = _upload(torch.tensor(hyper, dtype=torch.float32), device)
        aligned = all(ptr % 16 == 0 for ptr in ptrs)
        triton_adamw.launch(ptr_table, tensors[0][0], numel_table, hyper_table, blk_tensor, blk_index, aligned)

    @staticmethod
    def _make_tables(ptrs: tuple[int, ...], numels: tuple[int, ...], device: torch.device, block: int, upload):
        """Device tables of the kernel: the four addresses and the size of each tensor, and per program its
        (tensor, block) pair."""
        sizes = torch.tensor(numels, dtype=torch.int64)
        blocks = (sizes + block - 1) // block
        first = torch.cumsum(blocks, 0) - blocks
        blk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
        blk_index = (torch.arange(int(blocks.sum()), dtype=torch.int64) - torch.repeat_interleave(first, blocks))
        return (upload(torch.tensor(ptrs, dtype=torch.int64), device), upload(sizes, device),
                upload(blk_tensor, device), upload(blk_index.to(torch.int32), device))


__all__ = ["GroupedAdamW"]
