"""The Triton multi-LoRA path: launch plans, pointer tables and the autograd Function."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor

from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels.weights import LoRAWeights

BLOCK_M = 64  # rows per program in the row-blocked kernels (the schedule's block); other tiles are tuned
_CACHE_SIZE = 256


class _LRU(OrderedDict):
    def get_or_make(self, key: Any, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        if len(self) > _CACHE_SIZE:
            self.popitem(last=False)
        return value


_schedules = _LRU()
_pointer_tables = _LRU()


@dataclass(frozen=True)
class Schedule:
    """Device tables of one layout: per block its adapter and first row; per adapter its rows."""

    blk_adapter: Tensor  # (num_blocks,) int32
    blk_start: Tensor  # (num_blocks,) int32
    seg_start: Tensor  # (num_adapters,) int32
    seg_end: Tensor  # (num_adapters,) int32
    num_blocks: int
    covers_all_rows: bool
    max_tokens: int


def schedule(starts: tuple[int, ...], ends: tuple[int, ...], num_rows: int, device: torch.device) -> Schedule:
    """The (adapter, block) schedule of a layout, built once per layout and device and cached."""

    def make() -> Schedule:
        adapters, firsts = [], []
        for i, (s, e) in enumerate(zip(starts, ends)):
            for m in range(s, e, BLOCK_M):
                adapters.append(i)
                firsts.append(m)
        host = torch.tensor([adapters, firsts], dtype=torch.int32).reshape(2, -1)
        segs = torch.tensor([starts, ends], dtype=torch.int32).reshape(2, -1)
        covered = sum(e - s for s, e in zip(starts, ends)) == num_rows
        return Schedule(host[0].to(device, non_blocking=True), host[1].to(device, non_blocking=True),
                        segs[0].to(device, non_blocking=True), segs[1].to(device, non_blocking=True),
                        len(adapters), covered, max((e - s for s, e in zip(starts, ends)), default=0))

    return _schedules.get_or_make((starts, ends, num_rows, str(device)), make)


@dataclass(frozen=True)
class PointerTable:
    a_ptrs: Tensor  # (n,) int64 addresses of A_i
    b_ptrs: Tensor  # (n,) int64 addresses of B_i
    ranks: Tensor  # (n,) int32
    scaling: Tensor  # (n,) fp32
    ones: Tensor  # (n,) fp32
    drop_p: Tensor  # (n,) fp32
    grad_offsets: Tensor  # (2, n) int64: where dA_i starts in the dA buffer, dB_i in the dB buffer
    grad_sizes: list[int]  # numel of dA_0..dA_n-1, dB_0..dB_n-1
    block_r: int


def pointer_table(weights: LoRAWeights, device: torch.device) -> PointerTable:
    """Pointers to every adapter's own A and B, with ranks and scalings; cached by address, so it is
    rebuilt only when the adapter set (or a parameter's storage) changes."""
    key = (tuple(a.data_ptr() for a in weights.a), tuple(b.data_ptr() for b in weights.b),
           tuple(a.shape[0] for a in weights.a), weights.scaling, weights.dropout, str(device))

    def make() -> PointerTable:
        _check(weights)
        n = len(weights.a)
        ptrs = torch.tensor([[a.data_ptr() for a in weights.a], [b.data_ptr() for b in weights.b]],
                            dtype=torch.int64).reshape(2, n)
        ranks = [a.shape[0] for a in weights.a]
        floats = torch.tensor([list(weights.scaling), [1.0] * n, list(weights.dropout)], dtype=torch.float32)
        floats = floats.reshape(3, n).to(device, non_blocking=True)
        sizes = [a.numel() for a in weights.a] + [b.numel() for b in weights.b]
        offsets = torch.tensor([[0] + sizes[:n - 1], [0] + sizes[n:-1]], dtype=torch.int64).reshape(2, n).cumsum(1)
        return PointerTable(ptrs[0].to(device, non_blocking=True), ptrs[1].to(device, non_blocking=True),
                            torch.tensor(ranks, dtype=torch.int32).to(device, non_blocking=True),
                            floats[0], floats[1], floats[2], offsets.to(device, non_blocking=True), sizes,
                            max(16, triton.next_power_of_2(max(ranks))))

    return _pointer_tables.get_or_make(key, make)


def _precision(x: Tensor) -> str:
    """fp32 products follow torch's tf32 switch; other dtypes take the tensor cores' native path."""
    if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _check(weights: LoRAWeights) -> None:
    """Checked once per adapter set (when its pointer table is built), not on every call."""
    if max(a.shape[0] for a in weights.a) > 256:
        raise ValueError("the Triton path supports ranks up to 256")
    d_in, d_out = weights.a[0].shape[1], weights.b[0].shape[0]
    for a, b in zip(weights.a, weights.b):
        if a.shape[1] != d_in or b.shape[0] != d_out or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit d_in={d_in}, d_out={d_out}")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("adapter weights must be contiguous")
        if a.dtype != weights.a[0].dtype or b.dtype != weights.a[0].dtype:
            raise ValueError("all adapter weights of one call must share a dtype")


class GroupedLoRAFunction(torch.autograd.Function):
    """``Y = Y_base + s_i * drop_i(X_i) A_i^T B_i^T`` on every adapter's rows, in place on ``Y_base``.

    Forward (2 launches):   ``S_i = drop_i(X_i) A_i^T``;   ``Y_i = Y_base_i + s_i S_i B_i^T``.
    Backward (4 launches):  ``dS_i = s_i dY_i B_i``;        ``dX_i = drop_i'(dS_i A_i)``;
                            ``dA_i = dS_i^T drop_i(X_i)``;  ``dB_i = s_i dY_i^T S_i``.
    ``dY_base = dY``. ``S`` is kept from the forward; dropout masks are regenerated from per-adapter
    seeds. Rows outside every segment keep ``Y_base`` (and get ``dX = 0``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool, *params: Tensor) -> Tensor:
        n = len(weights.a)
        device = x.device
        table = pointer_table(weights, device)
        sched = schedule(weights.starts, weights.ends, x.shape[0], device)
        has_dropout = training and any(p > 0 for p in weights.dropout)
        # Seeds drawn on the device: no host sync, and checkpoint recomputation (which restores the RNG
        # state) regenerates the same masks.
        seeds = (torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device=device) if has_dropout else table.ranks)
        x = x if x.stride(-1) == 1 else x.contiguous()
        split = _split_k(sched.num_blocks, x.shape[1], device)
        s = _low_rank_buffer(x.shape[0], table.block_r, split, device)
        if sched.num_blocks:
            K._rows_times_weight[(sched.num_blocks, split)](
                x, table.a_ptrs, weights.a[0], s, sched.blk_adapter, sched.blk_start, sched.seg_end, table.ranks,
                table.ones, table.drop_p, seeds, x.shape[1], x.stride(0), s.stride(0),
                W_IS_A=True, HAS_DROPOUT=has_dropout, DOT_PRECISION=_precision(x), SPLIT_K=split, BLOCK_M=BLOCK_M,
                BLOCK_R=table.block_r, **_meta("rows"))
            d_out = base_out.shape[1]
            K._rank_times_weight[lambda meta: (sched.num_blocks, triton.cdiv(d_out, meta["BLOCK_N"]))](
                s, table.b_ptrs, weights.a[0], base_out, sched.blk_adapter, sched.blk_start, sched.seg_end,
                table.ranks, table.scaling, table.drop_p, seeds, d_out, s.stride(0), base_out.stride(0),
                W_IS_A=False, ACCUMULATE=True, HAS_DROPOUT=False, DOT_PRECISION=_precision(x), BLOCK_M=BLOCK_M,
                BLOCK_R=table.block_r, **_meta("rank"))
        ctx.mark_dirty(base_out)
        ctx.save_for_backward(x, s, seeds)
        ctx.weights, ctx.has_dropout = weights, has_dropout
        return base_out

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, s, seeds = ctx.saved_tensors
        weights: LoRAWeights = ctx.weights
        n = len(weights.a)
        device = dy.device
        table = pointer_table(weights, device)
        sched = schedule(weights.starts, weights.ends, x.shape[0], device)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        d_in, d_out = x.shape[1], dy.shape[1]
        split = _split_k(sched.num_blocks, d_out, device)
        ds = _low_rank_buffer(x.shape[0], table.block_r, split, device)
        dx = None
        if sched.num_blocks:
            K._rows_times_weight[(sched.num_blocks, split)](
                dy, table.b_ptrs, weights.a[0], ds, sched.blk_adapter, sched.blk_start, sched.seg_end, table.ranks,
                table.scaling, table.drop_p, seeds, d_out, dy.stride(0), ds.stride(0),
                W_IS_A=False, HAS_DROPOUT=False, DOT_PRECISION=_precision(x), SPLIT_K=split, BLOCK_M=BLOCK_M,
                BLOCK_R=table.block_r, **_meta("rows"))
        if ctx.needs_input_grad[0]:
            dx = (torch.empty_like(x) if sched.covers_all_rows else torch.zeros_like(x))
            if sched.num_blocks:
                K._rank_times_weight[lambda meta: (sched.num_blocks, triton.cdiv(d_in, meta["BLOCK_N"]))](
                    ds, table.a_ptrs, weights.a[0], dx, sched.blk_adapter, sched.blk_start, sched.seg_end,
                    table.ranks, table.ones, table.drop_p, seeds, d_in, ds.stride(0), dx.stride(0),
                    W_IS_A=True, ACCUMULATE=False, HAS_DROPOUT=ctx.has_dropout, DOT_PRECISION=_precision(x),
                    BLOCK_M=BLOCK_M, BLOCK_R=table.block_r, **_meta("rank"))
        grads_a, grads_b = _weight_grads(x, dy, s, ds, seeds, weights, table, sched, ctx.has_dropout)
        return (dx, dy, None, None, *grads_a, *grads_b)


def _meta(kind: str) -> dict[str, int]:
    """Tiles for a launch: none on the GPU (autotuned), the fixed ones in the interpreter."""
    return dict(K.DEFAULT_META[kind]) if K.INTERPRETED else {}


_SMS: dict[int, int] = {}


def _low_rank_buffer(rows: int, block_r: int, split: int, device: torch.device) -> Tensor:
    """``S`` / ``dS``: fp32 (precision, and atomics when split over K); zeroed only when split."""
    alloc = torch.zeros if split > 1 else torch.empty
    return alloc((rows, block_r), device=device, dtype=torch.float32)


def _split_k(num_blocks: int, k: int, device: torch.device) -> int:
    """Programs per row block for the row kernels: enough for two waves of the GPU, at least 256 of K each."""
    if device.type != "cuda" or num_blocks == 0:
        return 1
    split = 1
    while num_blocks * split < 2 * _sm_count(device) and k // (split * 2) >= 256:
        split *= 2
    return split


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _split_for(num_programs: int, max_tokens: int, device: torch.device) -> int:
    """Row splits so that small problems still fill the GPU (each split adds into G atomically)."""
    if device.type != "cuda":
        return 1
    split = 1
    while num_programs * split < 2 * _sm_count(device) and max_tokens > split * 128:
        split *= 2
    return split


def _weight_grads(x, dy, s, ds, seeds, weights: LoRAWeights, table: PointerTable, sched: Schedule, has_dropout):
    n = len(weights.a)
    device, wdtype = x.device, weights.a[0].dtype
    d_in, d_out = x.shape[1], dy.shape[1]
    split_a = _split_for(n * triton.cdiv(d_in, 128), sched.max_tokens, device)
    split_b = _split_for(n * triton.cdiv(d_out, 128), sched.max_tokens, device)
    # One buffer for all dA and one for all dB: the autotuner zeroes a kernel's output buffer between its
    # trials, so the two launches must not share one.
    sizes_a, sizes_b = table.grad_sizes[:n], table.grad_sizes[n:]
    flat_a = (torch.zeros if split_a > 1 else torch.empty)(sum(sizes_a), device=device, dtype=wdtype)
    flat_b = (torch.zeros if split_b > 1 else torch.empty)(sum(sizes_b), device=device, dtype=wdtype)
    grads_a = [g.view_as(a) for g, a in zip(torch.split(flat_a, sizes_a), weights.a)]
    grads_b = [g.view_as(b) for g, b in zip(torch.split(flat_b, sizes_b), weights.b)]
    K._weight_grad[lambda meta: (n, triton.cdiv(d_in, meta["BLOCK_K"]), split_a)](
        ds, x, flat_a, table.grad_offsets[0], sched.seg_start, sched.seg_end, table.ranks, table.ones, table.drop_p,
        seeds, d_in, ds.stride(0), x.stride(0),
        G_IS_A=True, HAS_DROPOUT=has_dropout, SPLIT_T=split_a, DOT_PRECISION=_precision(x),
        BLOCK_R=table.block_r, **_meta("grad"))
    K._weight_grad[lambda meta: (n, triton.cdiv(d_out, meta["BLOCK_K"]), split_b)](
        s, dy, flat_b, table.grad_offsets[1], sched.seg_start, sched.seg_end, table.ranks, table.scaling, table.drop_p,
        seeds, d_out, s.stride(0), dy.stride(0),
        G_IS_A=False, HAS_DROPOUT=False, SPLIT_T=split_b, DOT_PRECISION=_precision(x),
        BLOCK_R=table.block_r, **_meta("grad"))
    return grads_a, grads_b


def multi_lora_triton(x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool) -> Tensor:
    """The Triton path of `multi_lora`: same contract, ``base_out`` is updated in place and returned."""
    if x.dim() != 2 or base_out.dim() != 2 or x.shape[0] != base_out.shape[0]:
        raise ValueError(f"expected x (T, d_in) and base_out (T, d_out), got {tuple(x.shape)}, {tuple(base_out.shape)}")
    if len(weights.a) == 0:
        return base_out
    if weights.a[0].shape[1] != x.shape[1] or weights.b[0].shape[0] != base_out.shape[1]:
        raise ValueError(f"adapter shapes do not fit x {tuple(x.shape)} and base_out {tuple(base_out.shape)}")
    return GroupedLoRAFunction.apply(x, base_out, weights, training, *weights.a, *weights.b)
