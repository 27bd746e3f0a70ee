"""`GroupedAdamW`: ``torch.optim.AdamW`` whose step updates every param group in one kernel launch."""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim.optimizer import _get_scalar_dtype

from lightning_multilora.shadow import shadow_of

_CACHE_SIZE = 8
# How a group steps, not what it learns: a loaded state dict keeps the optimizer's own (see `load_state_dict`).
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


class GroupedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, update, state and ``state_dict``) whose step, for CUDA fp32
    parameters, runs one Triton launch over every param group: the adapters' groups, each with its own
    learning rate, betas, eps, weight decay and step count (`kernels.triton_adamw`), where torch's fused AdamW
    launches per group. On the H200 the two take the same GPU
    time (32 adapters x 41.9 M parameters: 10.8 vs 10.9 ms, 82% of the copy bandwidth; `benchmarks/optimizer.py`).

    A parameter with a `Shadow` (`lightning_multilora.shadow`: an adapter's flat weights in bf16, which the LoRA
    kernels read) gets it written in the same launch, so the forward that follows copies nothing (the store costs
    1.57 ms of the 32 adapters' 12.3 ms step; the copy it replaces, 2.3 ms). That is why `MultiLoRAModule` steps its
    default AdamW as this on CUDA.

    Everything else steps through ``torch.optim.AdamW`` (``foreach`` as given): parameters on the CPU (or
    with ``kernels.set_backend("reference")``), other dtypes, sparse gradients, tensor subclasses (DTensor), a
    learning rate or betas held in a CUDA tensor, ``amsgrad``, ``capturable`` and ``differentiable``.
    ``fused=True`` is refused: this is the fused path. A state dict of any AdamW loads (a fused one's step counts
    are moved to the host), and torch's AdamW loads this one's.
    """

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        if kwargs.get("fused"):
            raise ValueError("GroupedAdamW's `fused` must be left unset or False (its CUDA step is already one "
                             f"fused launch over every group), got fused={kwargs['fused']!r}")
        kwargs.pop("fused", None)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)
        self._tables: OrderedDict[tuple, Any] = OrderedDict()

    def __setstate__(self, state: dict[str, Any]) -> None:  # copy.deepcopy, pickle
        super().__setstate__(state)
        self._tables = OrderedDict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, keeping this optimizer's own implementation flags (a checkpoint of a fused AdamW carries
        ``fused=True``, which would turn the grouped step off) and every step count on the host."""
        flags = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, own in zip(self.param_groups, flags):
            group.update(own)
            if group.get("capturable"):
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if state and torch.is_tensor(state.get("step")) and state["step"].device.type != "cpu":
                    state["step"] = state["step"].to("cpu", _get_scalar_dtype())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        check = getattr(self, "_accelerator_graph_capture_health_check", None) or self._cuda_graph_capture_health_check
        check()  # (a capture needs capturable=True, which steps through torch)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        members = self._grouped_members()
        if members is None:
            _adamw_step(self)
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
            if any(isinstance(v, Tensor) and v.device.type != "cpu" for v in (group["lr"], *group["betas"])):
                return None
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if (type(p) not in (Tensor, nn.Parameter) or type(g) is not Tensor or p.dtype != torch.float32
                        or g.dtype != torch.float32 or g.is_sparse or not p.is_contiguous() or not g.is_contiguous()
                        or (device is not None and p.device != device) or g.device != p.device):
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
        hyper, tensors, steps, shadows, shadow_ptrs = [], [], [], [], []
        for p, group in members:
            state = self.state[p]
            if len(state) == 0:  # as torch.optim.AdamW starts a parameter
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
                if t.shape != p.shape or t.device != p.device or t.dtype != torch.float32 or not t.is_contiguous():
                    raise ValueError(f"GroupedAdamW: the state's {name} must be a contiguous fp32 tensor shaped and "
                                     f"placed as its parameter {tuple(p.shape)} on {p.device}, got {tuple(t.shape)} "
                                     f"{t.dtype} on {t.device} (a state loaded from another model?)")
            step = float(state["step"]) + 1  # counted once the launch is made
            lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
            hyper.append((1.0 - lr * float(group["weight_decay"]), 1.0 - beta1, beta2, 1.0 - beta2,
                          lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), float(group["eps"]),
                          -1.0 if group["maximize"] else 1.0))
            shadow = shadow_of(p)
            if shadow is not None and (shadow.tensor.device != device or shadow.tensor.numel() != p.numel()
                                       or shadow.dtype != (shadows[0].dtype if shadows else shadow.dtype)):
                shadow = None  # (one shadow dtype a launch; a mismatched one is left stale, and copied when read)
            if shadow is not None:
                shadows.append(shadow)
            tensors.append((p, p.grad, m, v))
            shadow_ptrs.append(0 if shadow is None else shadow.tensor.data_ptr())
            steps.append(state["step"])
        ptrs = tuple(x for quad, s in zip(tensors, shadow_ptrs) for x in (*map(Tensor.data_ptr, quad), s))
        numels = tuple(p.numel() for p, *_ in tensors)
        key = (device, ptrs, numels)
        tables = self._tables.get(key)
        if tables is None:
            tables = _make_tables(ptrs, numels, device, triton_adamw.BLOCK)
            self._tables[key] = tables
            if len(self._tables) > _CACHE_SIZE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        ptr_table, numel_table, blk_tensor, blk_index, aligned = tables
        hyper_table = _upload(torch.tensor(hyper, dtype=torch.float32), device)
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            triton_adamw.launch(ptr_table, tensors[0][0], numel_table, hyper_table, blk_tensor, blk_index, aligned,
                                shadows[0].tensor if shadows else None)
        torch.autograd.graph.increment_version([p for p, *_ in tensors])  # (written through their addresses: the
        for step in steps:  # module tells a step taken by the parameters' versions)
            step.add_(1)
        for shadow in shadows:
            shadow.mark_written(in_step=True)


def _make_tables(ptrs: tuple[int, ...], numels: tuple[int, ...], device: torch.device, block: int):
    """Device tables of the kernel: the four addresses and the size of each tensor, and per program its (tensor,
    block) pair; and whether every tensor starts on a 16-byte boundary (vector accesses)."""
    from lightning_multilora.kernels.triton_lora import _upload

    sizes = torch.tensor(numels, dtype=torch.int64)
    blocks = (sizes + block - 1) // block
    first = torch.cumsum(blocks, 0) - blocks
    blk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    blk_index = torch.arange(int(blocks.sum()), dtype=torch.int64) - torch.repeat_interleave(first, blocks)
    return (_upload(torch.tensor(ptrs, dtype=torch.int64), device), _upload(sizes, device),
            _upload(blk_tensor, device), _upload(blk_index.to(torch.int32), device), all(p % 16 == 0 for p in ptrs))


def _adamw_step(optimizer: torch.optim.AdamW) -> None:
    """torch's AdamW step, without the step hooks a second time: once any AdamW exists, torch has wrapped
    ``AdamW.step`` in the hook runner, and ``GroupedAdamW.step`` (wrapped too) has run them already."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


__all__ = ["GroupedAdamW"]
