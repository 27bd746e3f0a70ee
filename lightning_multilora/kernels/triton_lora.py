"""The Triton multi-LoRA path: launch plans, pointer tables and the two autograd Functions of a call."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels.launch import FastLauncher
from lightning_multilora.kernels.recompute import active_region
from lightning_multilora.kernels.weights import STREAM_SEED_MOD, STREAM_STEP_MIX, LoRAWeights

_ONE_ROW = 1 << 30  # a dropout row length that makes every adapter's tokens one row
# Rows per program in the row-blocked kernels (the schedule's block); other tiles are tuned. (Tried: 128 and 256, which
# re-read each adapter's weights from L2 per 128 / 256 rows instead of 64 (the shrink and dS read as many weight bytes
# from L2 as activation bytes at r=64): on the H200, 32 adapters x 1024 tokens, 4096x4096, r=64, a forward + backward
# 0.551 / 0.604 / 0.644 ms, but with tiles made for 64 rows and fp32 S / dS at the taller heights (fewer row blocks
# than `LOW_RANK_MIN_WAVES`); `benchmarks/results/kernels_h200.md`, session 30.)
BLOCK_M = 64
# The schedule's tall blocks, WIDE_ROWS x BLOCK_M rows of one adapter (`Schedule.wide_adapter`): the expand / dX
# candidates that hold a weight tile walk one (``HOLD_W``, `triton_kernels._rank_rows`). (Measured and dropped: the
# widest class of ranks launched with BLOCK_M 128; on the H200 at r=128 its dX got faster, its expand slower, and
# ranks 8..128 gained nothing: 0.656 -> 0.659 ms a forward + backward.)
WIDE_ROWS = 4
# ... and of adapters whose rank is over WIDE_RANK: a wider weight tile to hold, and more to save by re-reading it less.
# On the H200, 32 adapters x 1024 tokens, 4096x4096, a forward + backward with 4 / 8 / 16 row blocks for them: r=128
# 0.777 / 0.756 / 0.754 ms (the expand 199 / 185 / 174 us, dX 133 / 123 / 120), ranks 8..128 0.649 / 0.645 / 0.648
# (`benchmarks/results/kernels_h200_tall_s28.json`). Each tall block carries its end (`Schedule.wide_end`).
WIDE_RANK = 64
WIDE_ROWS_WIDE_RANKS = 8
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
_rows_times_weight = FastLauncher(K._rows_times_weight, K.INTERPRETED)
_rank_times_weight = FastLauncher(K._rank_times_weight, K.INTERPRETED)
_weight_grad = FastLauncher(K._weight_grad, K.INTERPRETED)
_ds_and_db = FastLauncher(K._ds_and_db, K.INTERPRETED)
_copy_weights = FastLauncher(K._copy_weights, K.INTERPRETED)
_stream_seeds = FastLauncher(K._stream_seeds, K.INTERPRETED)


_data_ptr = Tensor.data_ptr  # mapped over tuples of tensors: the per-call checks run at C speed, not Python's
_is_contiguous = Tensor.is_contiguous
_requires_grad = attrgetter("requires_grad")
_is_leaf = attrgetter("is_leaf")
_grad = attrgetter("grad")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function: costly to call from Python on every launch


def _upload(host: Tensor, device: torch.device) -> Tensor:
    """A small host table to the device without a stream sync (pageable copies wait for the stream)."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # A replay would copy from a pinned buffer recycled since: the table must exist before a capture
            raise RuntimeError("a device table of the LoRA kernels was to be made during a CUDA graph capture; "
                               "run the same step eagerly first (StepGraphs' warm-up) so that it is cached")
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _upload_rows(host: Tensor, device: torch.device) -> Tensor:
    """A (rows, n) host table uploaded with every row starting on a 16-byte boundary (its columns padded with
    zeros): a row is passed to the kernels as a pointer, and Triton compiles a kernel anew (every tuning
    candidate) for a pointer of another alignment. Unpadded, row 1 of an int32 table is aligned only when n
    is a multiple of 4, so a sweep whose adapter or block count changes recompiled the kernels (~8 s each
    time on the H200). Returns the padded (rows, n_padded) device tensor; slice ``[:, :n]`` row by row."""
    per = max(1, 16 // host.element_size())
    n = host.shape[1]
    padded = host.new_zeros((host.shape[0], -(-max(n, 1) // per) * per))
    padded[:, :n] = host
    return _upload(padded, device)


@dataclass(frozen=True)
class Schedule:
    """Device tables of one layout: per row block (and per tall block) its adapter and first row; per adapter its
    rows."""

    blk_adapter: Tensor  # (num_blocks,) int32
    blk_start: Tensor  # (num_blocks,) int32
    seg_start: Tensor  # (num_adapters,) int32
    seg_end: Tensor  # (num_adapters,) int32
    grad_order: Tensor  # (num_adapters,) int32: the adapters by token count, most first (`_weight_grad`'s ORDER)
    num_blocks: int
    covers_all_rows: bool
    max_tokens: int
    bucket: int  # the weight-gradient launches' tuning bucket: `_bucket` of num_blocks (`K.tuning_buckets`)
    token_bucket: int  # the weight-gradient launches' other one: `_bucket` of max_tokens
    # ranks that differ: (rank, first row block) of each run of one rank in the row blocks, largest rank first
    rank_runs: tuple[tuple[int, int], ...] = ()
    # (adapter, first row block, row blocks) of each adapter with rows, in the row blocks' order; the grad order
    by_block: tuple[tuple[int, int, int], ...] = ()
    grad_host: tuple[int, ...] = ()
    # the same row blocks, `WIDE_ROWS` (`WIDE_ROWS_WIDE_RANKS`) times as tall (each adapter's rows from its first, in
    # the same adapter order), each with its adapter, first row and end, and for each row block that starts an adapter
    # (and for num_blocks) the index of its tall block there
    wide_adapter: Optional[Tensor] = None
    wide_start: Optional[Tensor] = None
    wide_end: Optional[Tensor] = None
    wide_index: dict = field(default_factory=dict, compare=False)
    wide_rows: tuple[int, ...] = ()  # each tall block's height (its adapter's; the last one of a segment may be cut)
    classes: dict = field(default_factory=dict, compare=False)  # `rank_classes`' launches, `ds_db_table`s


def schedule(starts: tuple[int, ...], ends: tuple[int, ...], num_rows: int, device: torch.device,
             ranks: Optional[tuple[int, ...]] = None, block_m: Optional[int] = None) -> Schedule:
    """The (adapter, block) schedule of a layout, built once per layout, device and block height (``block_m``, by
    default `BLOCK_M`) and cached.

    The longest programs of a launch come first (longest-processing-time-first list scheduling: the GPU starts a
    launch's programs in grid order, each as a slot frees), so that none starts last and runs on alone: with
    ``ranks`` that differ, the row blocks are listed by their adapter's rank, largest first (an expand / dX
    program's work grows with its rank tile, `NARROW_RANK_TILES`); the weight-gradient launches take the adapters
    by token count, largest first (a program there runs over its adapter's rows, or a share of them where a
    launch splits them: `grad_order`). Ties keep the segment order in the row blocks, and reverse the row blocks'
    order in `grad_order`: the dB launch follows the dS row launch and reads the same dY, whose last rows read are
    then still in L2 (`DB_AFTER_DS`). On the H200, 32 adapters of 64..2048 tokens,
    the four Llama-8B shapes: a forward + backward took 0.92-0.99x the time of the segment order (the
    weight-gradient launches had started 2048-token programs last); ranks 8..128 at 1024 tokens each, 4096x4096:
    0.97x."""

    def make() -> Schedule:
        n = len(starts)
        by_rank = range(n) if ranks is None else sorted(range(n), key=lambda i: -ranks[i])
        adapters, firsts, wide_adapters, wide_firsts, wide_ends, wide_rows, wide_index = [], [], [], [], [], [], {}
        by_block = []
        for i in by_rank:
            wide_index[len(adapters)] = len(wide_adapters)
            first = len(adapters)
            for m in range(starts[i], ends[i], height):
                adapters.append(i)
                firsts.append(m)
            if len(adapters) > first:
                by_block.append((i, first, len(adapters) - first))
            for m in range(starts[i], ends[i], tall[i]):
                wide_adapters.append(i)
                wide_firsts.append(m)
                wide_ends.append(min(m + tall[i], ends[i]))
                wide_rows.append(tall[i])
        wide_index[len(adapters)] = len(wide_adapters)
        last_read = {a: -pos for pos, a in enumerate(by_rank)}  # ties: the row launches' last adapters first
        by_tokens = sorted(range(n), key=lambda i: (starts[i] - ends[i], last_read[i]))
        nb, nw = len(adapters), len(wide_adapters)
        host = torch.zeros(5, nb, dtype=torch.int32)  # (nw <= nb; each row of the upload starts on 16 bytes)
        for row, values in enumerate((adapters, firsts, wide_adapters, wide_firsts, wide_ends)):
            host[row, :len(values)] = torch.tensor(values, dtype=torch.int32)
        segs = torch.tensor([starts, ends, by_tokens], dtype=torch.int32).reshape(3, -1)
        # the segments tile [0, num_rows) exactly: every row is one adapter's
        bounds = [0] + [edge for span in sorted(zip(starts, ends)) for edge in span] + [num_rows]
        covered = all(a == b for a, b in zip(bounds[::2], bounds[1::2]))
        max_tokens = max((e - s for s, e in zip(starts, ends)), default=0)
        runs = () if ranks is None else tuple(_runs(adapters, ranks))
        host, segs = _upload_rows(host, device), _upload_rows(segs, device)
        return Schedule(host[0, :nb], host[1, :nb], segs[0, :n], segs[1, :n], segs[2, :n], nb, covered,
                        max_tokens, _bucket(nb), _bucket(max_tokens), runs, tuple(by_block), tuple(by_tokens), host[2, :nw],
                        host[3, :nw], host[4, :nw], wide_index, tuple(wide_rows))

    height = block_m or BLOCK_M
    # the tall blocks' rows, per adapter (by rank: `WIDE_RANK`)
    tall = tuple(height * (WIDE_ROWS_WIDE_RANKS if ranks is not None and ranks[i] > WIDE_RANK else WIDE_ROWS)
                 for i in range(len(starts)))
    if ranks is not None and len(set(ranks)) == 1:
        ranks = None  # one rank: the segment order (the layout's tables, shared by the ranks of one tall height)
    return _schedules.get_or_make((starts, ends, num_rows, str(device), ranks, height, tall), make)


def _runs(adapters: list[int], ranks: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(rank, first block) of each run of blocks whose adapters have one rank."""
    last = None
    for pos, a in enumerate(adapters):
        if ranks[a] != last:
            last = ranks[a]
            yield last, pos


@dataclass(frozen=True)
class PointerTable:
    a_ptrs: Tensor  # (n,) int64 addresses of A_i
    b_ptrs: Tensor  # (n,) int64 addresses of B_i
    ranks: Tensor  # (n,) int32
    scaling: Tensor  # (n,) fp32
    ones: Tensor  # (n,) fp32
    drop_p: Tensor  # (n,) fp32
    grad_offsets: Tensor  # (2, >= n) int64: where dA_i starts in the dA buffer, dB_i in the dB buffer (rows padded)
    grad_sizes: list[int]  # numel of dA_0..dA_n-1, dB_0..dB_n-1
    block_r: int  # the rank chunk (a tile width)
    r_chunks: int  # chunks that cover the largest rank
    width: int  # columns of S and dS: the largest rank rounded up to 16 (kernels touch no column past a rank)
    one_rank: bool  # every adapter has the same rank
    ranks8: bool  # every rank is a multiple of 8: rows of A_i, B_i (and of flat copies of them) stay 16-byte aligned
    params_aligned: bool  # every A_i and B_i starts on a 16-byte boundary
    # what the calls of this adapter set share whatever their layout: the weights' flat copies (`weight_copies`), so
    # that a layer keeping the weights of several layouts (`MultiLoRALinear`) keeps one copy of its adapters
    memo: dict = field(default_factory=dict, compare=False, repr=False)


# Measured on the H200 (4096x4096, 32 adapters of ranks 8..128, 1024 tokens each): with 64-wide chunks the
# forward+backward took 6.2 ms, with one 128-wide tile 4.2 (an earlier run, with a longer tuning budget): the row
# kernel reads X once per chunk. So ranks up to 128 keep one tile; only larger ones are chunked.
MAX_RANK_CHUNK = 128

# The widest rank tile used on each CUDA device so far. A tile never narrows within a process: a narrower one
# is a new kernel variant, and compiling its tuning candidates costs seconds (on the H200, 15 s of a sweep
# went to the last adapter left, whose smaller rank narrowed the tile), while a wider tile than the ranks need
# only masks part of a memory-bound product. `reset_rank_tiles` forgets them (benchmarks of fixed sets).
_widest_tile: dict[str, int] = {}


def rank_chunk(ranks: list[int], device: Optional[torch.device] = None) -> int:
    """The rank tile: the largest rank's (a power of two, at least 16) up to `MAX_RANK_CHUNK`; larger ranks
    take several chunks (no program runs a tile wider than the cap). On a CUDA ``device`` it is at least the
    widest tile used there before (see `_widest_tile`)."""
    tile = min(MAX_RANK_CHUNK, max(16, triton.next_power_of_2(max(ranks))))
    if device is None or device.type != "cuda":
        return tile
    key = str(device)
    tile = min(MAX_RANK_CHUNK, max(tile, _widest_tile.get(key, 0)))
    _widest_tile[key] = tile
    return tile


def reset_rank_tiles() -> None:
    """Let the next adapter set on every device take its own rank tile (the next tables built, that is)."""
    _widest_tile.clear()
    _pointer_tables.clear()


def pointer_table(weights: LoRAWeights, device: torch.device) -> PointerTable:
    """Pointers to every adapter's own A and B, with ranks and scalings; cached by address, so it is
    rebuilt only when the adapter set (or a parameter's storage) changes. Memoized on ``weights`` too,
    checked against every weight's address (a storage swapped in place is seen)."""
    check = (tuple(map(_data_ptr, weights.a + weights.b)), device)
    memo = weights.memo.get("pointer_table")
    if memo is not None and memo[0] == check:
        return memo[1]
    table = _pointer_table(weights, device)
    weights.memo["pointer_table"] = (check, table)
    return table


def _pointer_table(weights: LoRAWeights, device: torch.device) -> PointerTable:
    # the shapes and dtype too: another layer's adapters may sit at the same addresses once these are freed
    key = (tuple(map(_data_ptr, weights.a)), tuple(map(_data_ptr, weights.b)),
           tuple(a.shape[0] for a in weights.a), weights.a[0].shape[1], weights.b[0].shape[0], weights.a[0].dtype,
           weights.scaling, weights.dropout, str(device))

    def make() -> PointerTable:
        _check(weights)
        n = len(weights.a)
        ranks = [a.shape[0] for a in weights.a]
        chunk, width = rank_chunk(ranks, device), 16 * _cdiv(max(ranks), 16)
        # The weight-gradient launches' grid has a row per adapter and rank chunk, and CUDA allows 65535 rows.
        # Checked for every call, gradients or not: one limit for an adapter set.
        _, grad_chunks = _grad_chunks(chunk, width)
        if n * grad_chunks > 65535:
            raise ValueError(f"the Triton path takes at most {65535 // grad_chunks} adapters a call with ranks up to "
                             f"{max(ranks)} (got {n}); split them over several calls")
        ptrs = torch.tensor([[a.data_ptr() for a in weights.a], [b.data_ptr() for b in weights.b]],
                            dtype=torch.int64).reshape(2, n)
        floats = torch.tensor([list(weights.scaling), [1.0] * n, list(weights.dropout)], dtype=torch.float32)
        floats = _upload_rows(floats.reshape(3, n), device)
        sizes = [a.numel() for a in weights.a] + [b.numel() for b in weights.b]
        offsets = torch.tensor([[0] + sizes[:n - 1], [0] + sizes[n:-1]], dtype=torch.int64).reshape(2, n).cumsum(1)
        ptrs = _upload_rows(ptrs, device)
        return PointerTable(ptrs[0, :n], ptrs[1, :n], _upload(torch.tensor(ranks, dtype=torch.int32), device),
                            floats[0, :n], floats[1, :n], floats[2, :n], _upload_rows(offsets, device), sizes,
                            chunk, _cdiv(max(ranks), chunk), width, len(set(ranks)) == 1,
                            all(r % 8 == 0 for r in ranks), not any(p.data_ptr() & 15 for p in weights.a + weights.b))

    return _pointer_tables.get_or_make(key, make)


@dataclass(frozen=True)
class WeightCopies:
    """Every adapter's ``A_i`` and ``B_i`` in the activation dtype, in two flat buffers, with device pointer
    arrays into them. The products multiply in the activation dtype anyway (each kernel casts the weight tile
    it loads), so reading these instead of the fp32 parameters gives the same results; it halves the weight
    bytes every program reads and spares the kernels the conversion (on the H200, 16 adapters x 1024 tokens,
    4096->14336, the expand and dX launches of a forward + backward took 0.83 ms with fp32 weights, 0.46 ms with
    bf16 ones; the shrink and dS launches 0.24 and 0.18 ms)."""

    views: tuple[Tensor, ...]  # A_0..A_n-1, B_0..B_n-1 in the flat buffers (or the caller's copies)
    a_ptrs: Tensor
    b_ptrs: Tensor
    witness: Tensor
    copy_grid: tuple[int, int]  # `K._copy_weights`' programs: 2n tensors, blocks of the largest A_i or B_i
    aligned: bool  # every row of every copy starts on a 16-byte boundary


def weight_copies(weights: LoRAWeights, table: PointerTable, dtype: torch.dtype, device: torch.device) -> WeightCopies:
    """The adapters' weights in ``dtype``: the caller's copies where ``weights`` has them in that dtype
    (`LoRAWeights.a_copies`, read as they are), else buffers made once per adapter set and dtype (memoized on its
    ``table``, which the adapter set's calls in every layout share), refreshed on every forward call (one launch,
    `K._copy_weights`: the weights may have changed in any way since the last call). A backward reads the values of
    its call's forward: the weights do not change between a forward and its backward, and each call keeps its buffers
    alive (`_Call.copies`). For the same reason a recomputation under gradient checkpointing (a forward run inside
    backward) reads them as its forward left them, without a copy."""
    memo = weights.memo.setdefault("weight_copies", {})
    entry = memo.get(dtype)
    fresh = entry is None or entry[0] is not table
    if weights.a_copies and weights.a_copies[0].dtype == dtype:  # kept equal to the weights by the caller
        if fresh:
            copies = weights.a_copies + weights.b_copies
            n, host = len(weights.a), [c.data_ptr() for c in copies]
            ptrs = _upload_rows(torch.tensor(host, dtype=torch.int64).reshape(2, n), device)
            entry = (table, WeightCopies(copies, ptrs[0, :n], ptrs[1, :n], copies[0], (0, 0),
                                         table.ranks8 and not any(p & 15 for p in host)))
            memo[dtype] = entry
        return entry[1]
    if fresh:
        shared = table.memo.setdefault("weight_copies", {})  # (the same adapters in another layout: one copy)
        if dtype not in shared:
            # Normal tensors even when the first call runs under inference_mode (a validation before training):
            # inference tensors could not be refreshed in place by a later training forward.
            with torch.inference_mode(False):
                flat_a, _, ptrs_a, ptrs_b, views_a, views_b = _flat_like(weights, table, device, dtype, zero=False)
            most = max(max(a.numel() for a in weights.a), max(b.numel() for b in weights.b))
            grid = (2 * len(weights.a), _cdiv(most, K.COPY_META["BLOCK"] * K.COPY_META["PER"]))
            shared[dtype] = WeightCopies(views_a + views_b, ptrs_a, ptrs_b, flat_a, grid, table.ranks8)
        entry = memo[dtype] = (table, shared[dtype])
    copies = entry[1]
    if fresh or torch._C._current_graph_task_id() == -1:  # -1: not inside a backward (no recomputation)
        # one launch through the pointer tables (torch._foreach_copy_ took 1.2x its time: see `K.COPY_META`)
        a, b = weights.a[0], weights.b[0]
        _copy_weights(copies.copy_grid, (table.a_ptrs, table.b_ptrs, copies.a_ptrs, copies.b_ptrs, table.ranks, a,
                                         copies.witness, len(weights.a), a.shape[1], b.shape[0]),
                      dict(ALIGNED=table.ranks8 and table.params_aligned, **K.COPY_META))
    return copies


def _copy_dtype(x: Tensor, out_dtype: torch.dtype, weights: LoRAWeights) -> Optional[torch.dtype]:
    """The dtype to copy the weights into before the products (None: read the parameters as they are)."""
    if x.dtype in (torch.bfloat16, torch.float16) and out_dtype == x.dtype and weights.a[0].dtype != x.dtype:
        return x.dtype
    return None


def _precision(x: Tensor) -> str:
    """fp32 products follow torch's tf32 switch; other dtypes take the tensor cores' native path."""
    if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _check(weights: LoRAWeights) -> None:
    """Checked once per adapter set (when its pointer table is built), not on every call."""
    from lightning_multilora.kernels import TRITON_MAX_RANK

    if max(a.shape[0] for a in weights.a) > TRITON_MAX_RANK:
        raise ValueError(f"the Triton path supports ranks up to {TRITON_MAX_RANK}")
    d_in, d_out = weights.a[0].shape[1], weights.b[0].shape[0]
    for i, (a, b) in enumerate(zip(weights.a, weights.b)):
        if a.shape[1] != d_in or b.shape[0] != d_out or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit d_in={d_in}, d_out={d_out}")
        if not (a.is_contiguous() and b.is_contiguous()):
            which = " and ".join(n for n, t in (("A", a), ("B", b)) if not t.is_contiguous())
            raise ValueError(f"adapter {i}'s {which} must be contiguous (the kernels read its rows by pointer): "
                             "give `.contiguous()` weights")
        if a.dtype != weights.a[0].dtype or b.dtype != weights.a[0].dtype:
            raise ValueError(f"all adapter weights of one call must share a dtype: adapter 0's A is "
                             f"{weights.a[0].dtype}, adapter {i}'s A {a.dtype} and B {b.dtype}")


@dataclass
class _Call:
    """What both halves of one grouped LoRA call share: built once per forward, kept for backward (its tensors
    are device tables, the dropout seeds and the weight copies, never activations)."""

    weights: LoRAWeights
    table: PointerTable
    sched: Schedule
    seeds: Tensor  # (n,) int32 per-adapter dropout seeds (the ranks table when there is no dropout)
    # The weight copies the products read (kept alive until this call's backward); None: the adapters' own weights
    copies: Optional["WeightCopies"]
    has_dropout: bool
    precision: str
    direct: bool
    d_out: int
    out_dtype: torch.dtype
    params: tuple[Tensor, ...]  # the call's autograd inputs: every A_i and B_i, or A_0 alone (``direct``)
    # The expand's backward adds dB and dS in one launch (`FUSED_DS_DB`; decided with the forward, as S's dtype is)
    fuse_ds: bool
    low_dtype: torch.dtype  # of S and dS (`low_rank_dtype`)
    # ``S`` as this call's forward made it, kept for a recomputation under gradient checkpointing (`recompute`)
    kept_s: Optional[Tensor] = None
    # The gradients the expand's backward added dB into (with dS, `FUSED_DS_DB`, or after the dS row launch,
    # `DB_AFTER_DS`), for the shrink's backward to add dA into
    grad_targets: Optional["GradTargets"] = None
    # `torch.use_deterministic_algorithms` was on (Lightning's ``Trainer(deterministic=True)``) when the call was made:
    # every launch stores, none adds atomically (no row launch K split, no weight-gradient row split, no fused dB +
    # dS), so a call repeated gives bitwise the same outputs and gradients
    deterministic: bool = False

    @property
    def row_tokens(self) -> int:
        """The dropout masks' row length (`LoRAWeights.row_tokens`; without dropout or rows, one row for all: a
        constant, so that launches without dropout do not vary with it)."""
        return (self.weights.row_tokens or _ONE_ROW) if self.has_dropout else _ONE_ROW

    @property
    def a_ptrs(self) -> Tensor:  # (n,) the A_i the products read
        return self.table.a_ptrs if self.copies is None else self.copies.a_ptrs

    @property
    def b_ptrs(self) -> Tensor:
        return self.table.b_ptrs if self.copies is None else self.copies.b_ptrs

    @property
    def w_witness(self) -> Tensor:  # a tensor of the dtype behind a_ptrs / b_ptrs
        return self.weights.a[0] if self.copies is None else self.copies.witness

    @property
    def w_aligned(self) -> bool:
        """Every row of every weight the products read starts on a 16-byte boundary: the kernels' weight tiles
        are then loaded as vectors (flat copies keep that alignment when every rank is a multiple of 8)."""
        return self.copies.aligned if self.copies is not None else self.table.ranks8 and self.table.params_aligned


class _LoRAShrink(torch.autograd.Function):
    """First half of a grouped LoRA call: ``S_i = drop_i(X_i) A_i^T`` (one launch), and a placeholder ``Z`` of
    ``Y``'s shape over one element of storage, whose only use is to bring ``dY`` back from `_LoRAExpand`.

    Backward (2 launches): ``dA_i = s_i dS_i^T drop_i(X_i)``; ``dB_i = s_i dY_i^T S_i`` (``dY`` arrives as ``Z``'s
    gradient). ``dX`` is left to `_LoRAExpand`, which returns all of it. With direct gradients the expand's backward
    adds ``dB`` (with ``dS`` for rank tiles up to `FUSED_DS_MAX_TILE`: `FUSED_DS_DB`; after its dS row launch
    otherwise: `DB_AFTER_DS`; not in a second backward of a retained graph, which has no ``S`` there), and this
    then launches ``dA`` only.

    Why two Functions: this half saves ``X`` and ``S``, the expand half saves no tensor. Under non-reentrant
    gradient checkpointing a layer's recomputation stops once every saved tensor is back, so it stops after
    the layer's last shrink and never recomputes the last projection's frozen product (``down_proj``'s in a
    Llama layer: one large GEMM per layer and step, as the frozen base alone would skip it).

    ``direct``: ``dA_i`` and ``dB_i`` are added straight into each parameter's ``.grad`` (as autograd's
    AccumulateGrad would, and only where it would run: `_adds_direct_grads`) and only ``A_0`` is an autograd input,
    so that backward runs; otherwise every ``A_i`` and ``B_i`` is an input and gets its gradient through autograd.
    """

    @staticmethod
    def forward(ctx, x: Tensor, call: _Call, *params: Tensor) -> tuple[Tensor, Tensor]:
        table, sched = call.table, call.sched
        # A recomputation: S is the forward's (same inputs, same dropout seeds). Taken off the call, which stays on
        # ctx: S -> grad_fn -> ctx -> call -> S would be a reference cycle, holding the graph until a gc pass.
        kept, call.kept_s = call.kept_s, None
        s = kept if kept is not None else _low_rank_buffer(x.shape[0], table, x.device, call.low_dtype)
        if sched.num_blocks and kept is None:
            _row_launch(call, x, call.a_ptrs, s, True, call.has_dropout)
        z = torch.empty_strided((x.shape[0], call.d_out), (0, 0), device=x.device, dtype=call.out_dtype)
        ctx.save_for_backward(x, s)
        ctx.call, ctx.num_params = call, len(params)
        return s, z

    @staticmethod
    def backward(ctx, ds: Tensor, dy: Tensor):
        x, s = ctx.saved_tensors
        call: _Call = ctx.call
        if not any(ctx.needs_input_grad[2:]) or (call.direct and not _adds_direct_grads(ctx)):
            # frozen adapters, or gradients of other tensors only: nothing to compute here (dX is the expand's)
            return (None, None) + (None,) * ctx.num_params
        db = call.grad_targets is None  # else the expand's backward added dB (`FUSED_DS_DB`, `DB_AFTER_DS`)
        if not db:
            targets, call.grad_targets = call.grad_targets, None
            grads: tuple = (None,) * ctx.num_params
        else:  # new gradients are left empty where the launches below store every element of them
            empty = call.sched.num_blocks > 0
            if call.direct:
                targets = _grads_of_parameters(call.weights, call.table, x.device, empty)
                grads = (None,) * ctx.num_params
            else:
                targets = _fresh_grads(call.weights, call.table, x.device, empty)
                grads = targets.a + targets.b
        if call.sched.num_blocks:
            dy = dy if dy.stride(-1) == 1 else dy.contiguous()
            _weight_grad_launch(True, ds, x, call, targets)
            if db:
                _weight_grad_launch(False, s, dy, call, targets)
        for p, g in zip(call.weights.a, targets.later_a):  # new dA, made by the expand's backward: stored now
            p.grad = g
        return (None, None, *grads)


class _LoRAExpand(torch.autograd.Function):
    """Second half: ``Y_i = Y_base_i + s_i S_i B_i^T`` (one launch), written into ``Y_base``.

    Backward (2 launches): ``dS_i = dY_i B_i``; ``dX_i = s_i drop_i'(dS_i A_i)``. (``dS`` is kept without ``s_i``:
    in fp16 a scaled ``dS`` may overflow where ``dX`` and ``dA`` do not.) ``dY_base = dY``, and ``dY``
    goes back to `_LoRAShrink` as ``Z``'s gradient (for ``dB``). Rows outside every segment keep ``Y_base`` and
    get no LoRA ``dX``. No tensor is saved (see `_LoRAShrink` for why). With direct gradients and rank tiles up to
    `FUSED_DS_MAX_TILE` (`FUSED_DS_DB`) the first launch is ``dB_i += s_i dY_i^T S_i``, adding ``dS`` from the same
    ``dY`` tiles; with wider ones the dB launch follows the dS row launch (`DB_AFTER_DS`). (``S`` is held as an
    attribute, released by this backward.)

    ``base_out=None`` with a frozen ``base_weight`` (and ``base_bias``): this half owns the frozen linear too,
    ``Y_base = X W^T + b``, and its backward makes ``dX = dY W`` with the LoRA term added into that buffer by
    the last launch, instead of a separate LoRA ``dX`` that autograd then adds to the base's (one write and a
    three-pass add over ``(T, d_in)`` fewer per layer). Where every row is an adapter's and there is no bias
    (`_lora_first`), the order is reversed: the LoRA launch writes its term alone and the frozen GEMM adds its
    product to it (``addmm_``, the term read in cuBLAS's epilogue), in forward (``Y``) and backward (``dX``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, s: Tensor, z: Tensor, base_out: Optional[Tensor], base_weight: Optional[Tensor],
                base_bias: Optional[Tensor], call: _Call) -> Tensor:
        owns_base = base_out is None
        sched, d_out = call.sched, call.d_out
        # (not under autocast: an in-place addmm_ would keep x's dtype where F.linear casts)
        lora_first = owns_base and _lora_first(sched, base_bias) and not torch.is_autocast_enabled(x.device.type)
        if lora_first:
            base_out = torch.empty((x.shape[0], d_out), device=x.device, dtype=x.dtype)
        elif owns_base:
            base_out = F.linear(x, base_weight, base_bias)
        if sched.num_blocks:
            _rank_launch(call, s, call.b_ptrs, base_out, False, not lora_first, False)
        if lora_first:
            base_out.addmm_(x, base_weight.t())  # Y = X W^T + (s S B^T): the LoRA term read in the GEMM's epilogue
        if not owns_base:
            ctx.mark_dirty(base_out)
        # Attributes, not saved tensors (a saved tensor would bring this half back into the recomputation):
        # the frozen base weight is a parameter, and the shapes are all backward needs of x.
        ctx.call, ctx.base_weight, ctx.owns_base = call, base_weight, owns_base
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        # S for dB in this half's backward (`FUSED_DS_DB`, `DB_AFTER_DS`): the shrink keeps it anyway (saved, or kept
        # for a recomputation); an attribute, so that it brings nothing back into a recomputation
        ctx.s = s if call.direct else None
        return base_out

    @staticmethod
    def backward(ctx, dy: Tensor):
        call: _Call = ctx.call
        table, sched = call.table, call.sched
        device = dy.device
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        rows, d_out = ctx.x_shape[0], dy.shape[1]
        ds, dx = None, None
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):  # only base_out wants a gradient
            return dx, ds, dy, None if ctx.owns_base else dy, None, None, None
        s, ctx.s = ctx.s, None  # freed with this backward, as a saved tensor would be (a second backward: unfused)
        if s is not None and not _adds_direct_grads(ctx.next_functions[1][0]):  # (S's node: the shrink's)
            s = None  # no adapter gradients in this backward: no dB, and dS from the row launch (for dX)
        fused = sched.num_blocks and call.fuse_ds and s is not None
        # (dS goes back to autograd as S's gradient: zeroed under anomaly detection too, which checks all of it)
        ds = _low_rank_buffer(rows, table, device, call.low_dtype, zero=fused or torch.is_anomaly_enabled())
        one_launch = (sched.num_blocks and s is not None and not fused and DB_AFTER_DS and DS_DB_ONE_LAUNCH
                      and ds_db_one_launch(_grad_split(call, d_out, device), d_out, sched.num_blocks * table.r_chunks,
                                           None if K.INTERPRETED else _sm_count(device)))
        if sched.num_blocks and not fused and not one_launch:
            _row_launch(call, dy, call.b_ptrs, ds, False, False)
        if sched.num_blocks and s is not None and (fused or DB_AFTER_DS):
            # dB here, adding dS too (one pass over dY for both), or right after the dS row launch, while the end of
            # dY that it read is still in L2 (`DB_AFTER_DS`), or with dS in one launch (`DS_DB_ONE_LAUNCH`); the
            # shrink's backward then does dA only
            call.grad_targets = _grads_of_parameters(call.weights, table, device, empty=True, later_a=True)
            if one_launch:
                _ds_db_launch(call, dy, s, ds, call.grad_targets)
            else:
                _weight_grad_launch(False, s, dy, call, call.grad_targets, ds if fused else None)
        if ctx.needs_input_grad[0]:
            lora_first = ctx.owns_base and _lora_first(sched, None)
            if ctx.owns_base and not lora_first:
                dx = torch.mm(dy, ctx.base_weight)  # the frozen linear's dX; the LoRA term is added into it
            elif sched.covers_all_rows:
                dx = torch.empty(ctx.x_shape, device=device, dtype=ctx.x_dtype)
            else:
                dx = torch.zeros(ctx.x_shape, device=device, dtype=ctx.x_dtype)
            if sched.num_blocks:
                _rank_launch(call, ds, call.a_ptrs, dx, True, ctx.owns_base and not lora_first, call.has_dropout)
            if lora_first:
                dx.addmm_(dy, ctx.base_weight)  # dX = dY W + (LoRA dX), the LoRA term read in the GEMM's epilogue
        return dx, ds, dy, None if ctx.owns_base else dy, None, None, None


def _adds_direct_grads(shrink: Any) -> bool:
    """Whether a backward through the shrink's node ``shrink`` is to add direct gradients into the adapters'
    ``.grad``: where autograd's own accumulation would run for ``A_0`` (the one autograd input of a direct call).
    ``torch.autograd.grad(loss, [x])`` (an input's gradient: saliency, a gradient penalty, adversarial inputs)
    accumulates no parameter's gradient, and then neither does a direct call, as PEFT's layers would not; nor does
    ``backward(inputs=[x])``. (``backward(inputs=...)`` naming adapter weights other than ``A_0`` gets none either:
    they are not autograd inputs of a direct call; see `LoRAWeights`.)"""
    node = shrink.next_functions[-1][0]  # the edges of its tensor inputs (x, A_0): A_0's AccumulateGrad
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as err:  # torch raises where A_0 is one of torch.autograd.grad's inputs
        raise RuntimeError(
            "torch.autograd.grad with respect to adapter weights needs direct_grads=False (MultiLoRALinear."
            "direct_grads, LoRAWeights.direct_grads): with direct gradients they are added into .grad during "
            "backward, not returned") from err


# The dB launch adds dS = dY B too, from the dY tiles it reads anyway (`_weight_grad`'s WITH_DS), in place of the row
# launch that read dY a second time; with direct gradients (the default), where the expand's backward can add dB,
# and rank tiles up to `FUSED_DS_MAX_TILE`.
FUSED_DS_DB = True
# ... for rank tiles up to this width. Each program adds its K block's share of dS atomically, and those atomics grow
# with the tile: on the H200, 32 adapters x 1024 tokens, K=4096, the fused launch took 102 us at r=16 (a dS row launch
# and a dB launch: ~150) but 350 us at r=64 (82 + 124 apart) and 682 us at ranks 8..128 (tile 128). K tiles up to 512
# (fewer shares of dS to add) did not save it: at r=64, dA with the fused dB + dS took 431 us against 194 for dA and
# dB plus 80 for the dS row launch (session 17, `benchmarks/results/kernels_h200_ab_s17.json`). The tile is the
# table's (`rank_chunk`), which never narrows on a GPU: once a set with ranks over 16 has run there, later rank-16
# calls stay unfused until `reset_rank_tiles` (both ways give the same gradients).
FUSED_DS_MAX_TILE = 16
# Unfused, with direct gradients, the expand's backward launches dB right after the dS row launch (instead of the
# shrink's backward, after the dX and dA launches): both read dY, and the dB launch takes the adapters whose rows the
# row launch read last first (`Schedule.grad_order`'s ties), so that it finds the end of dY still in L2. On the H200,
# 32 adapters, r=64 and ranks 8..128, the four Llama-8B shapes, 256 / 1024 / 64..2048 tokens each: a forward +
# backward took 0.990-0.999x the time (14 of 14 points faster; 4096x4096, 256 tokens: the weight-gradient launches
# 63.3 -> 61.4 us), the same tuned tiles either way (`benchmarks/results/kernels_h200_ab_s21.json`).
DB_AFTER_DS = True
# ... both from one launch (`triton_kernels._ds_and_db`), its programs' order tuned with its tiles: where the dB launch
# splits no rows. Its dS programs store dS whole, even an fp32 one, which the row launch would split over K to fill
# the GPU (`low_rank_dtype`): the dB programs fill it here. On the H200, 32 adapters, a forward + backward
# (`benchmarks/kernels.py --ds-db-one-launch on|off`, `ours_shadow`), ms: 1024 tokens each, 4096x4096 ranks 8..128
# 0.645 -> 0.629, r=64 0.581 -> 0.550, r=128 0.762 -> 0.734; 4096x1024 ranks 8..128 0.390 -> 0.374, r=128 0.463 ->
# 0.453; 4096x14336 1.415 -> 1.389, r=64 1.310 -> 1.294; 14336x4096 1.231 -> 1.221, r=64 1.138 -> 1.113 (4096x1024 r=64
# takes a dB row split: the two launches). 256 tokens each (an fp32 dS): 4096x4096 ranks 8..128 0.232 -> 0.222, r=64
# 0.217 -> 0.209; 4096x1024 ranks 8..128 0.157 -> 0.152; 4096x14336 0.489 -> 0.476, r=64 0.465 -> 0.449; 14336x4096
# 0.474 -> 0.461, r=64 0.428 -> 0.420 (`kernels_h200_one_launch_s29.json`, `kernels_h200_one_launch_fp32_s29.json`).
DS_DB_ONE_LAUNCH = True
# Its dS programs each walk all of K: where K is wider than this and they are fewer than a quarter of the SMs, the
# two launches are faster (the dS row launch then splits K, `K.small_rows_bucket`): `ds_db_one_launch`. On the H200
# (`benchmarks/results/kernels_h200_grad_split_s39.json`, ours_shadow), one adapter of 128 tokens at r=64, 4096x14336
# (dY 14336 wide, 2 dS programs): a forward + backward 76.2 -> 49.9 us apart (75.9 -> 50.0 with no other change, in
# a run whose log was not kept); at 16 adapters x 256 tokens there (64 dS programs) one launch stayed the faster
# (243.3 vs 258.3 us apart), as at 32 x 256 (128, above); at 4096x1024 (dY 1024 wide), one adapter of rank 48 x 128
# tokens, too (30.3 vs 37.6 us apart, the same unlogged run).
DS_DB_ONE_LAUNCH_MAX_K = 4096
# ... its dS programs' rows (the row blocks of a schedule of this height: each re-reads its adapter's B_i from L2, as
# many bytes as its dY rows at r=64, twice as many at r=128) and its dB programs' widest rank chunk (`GRAD_MAX_TILE`'s
# chunks: each chunk's programs read the adapter's dY tiles, twice at r=128). The launch's K tile:
# `triton_kernels.DS_DB_GRAD_BLOCK_K`. None: `BLOCK_M`, `GRAD_MAX_TILE`.
# Measured on the H200 (32 adapters, 4096x4096, a forward + backward, `kernels_h200_ds_db_tall_s31.json`): 128 rows,
# 256 columns and 128-wide chunks together take r=128 x 1024 tokens from 0.733 to 0.719 ms, but ranks 8..128 from
# 0.627 to 0.632 and r=128 x 256 tokens from 0.308 to 0.323; left at the package's.
DS_DB_BLOCK_M: Optional[int] = None
DS_DB_GRAD_MAX_TILE: Optional[int] = None


def ds_db_one_launch(grad_split: int, k: int, ds_programs: int, sms: Optional[int]) -> bool:
    """Whether dS and dB (of width ``k``) come from one launch (`DS_DB_ONE_LAUNCH`): where the dB launch splits no
    rows (``grad_split``, `_grad_split`), and ``k`` is at most `DS_DB_ONE_LAUNCH_MAX_K` or the ``ds_programs`` (row
    blocks x rank chunks) fill a quarter of the GPU's ``sms`` (None: the interpreter, always)."""
    return grad_split == 1 and (sms is None or k <= DS_DB_ONE_LAUNCH_MAX_K or 4 * ds_programs >= sms)


# The weight-gradient launches take rank chunks of at most this width, whatever the table's tile: a 128-wide tile
# computes the full width for every adapter of a mix (its (r, BLOCK_K) fp32 accumulator too), where 64-wide chunks
# past an adapter's rank return at once. On the H200, 32 adapters x 1024 tokens, ranks 8..128: dA at K=4096 took
# 174 us with the 128 tile, 135 with 64-wide chunks, 142 with 32; dB at K=14336 611, 456, 483. At r=64 the 64 tile
# beats 32-wide chunks (dA 107 vs 139 us). The expand keeps the full tile (207 us at 128, 241 at 64). At r=128
# alone 128-wide chunks gained nothing (4096x4096, 1024 tokens: 0.739 -> 0.740 ms a forward + backward; 256 tokens
# 0.316 -> 0.327).
GRAD_MAX_TILE = 64


def _grad_chunks(block_r: int, width: int, max_tile: Optional[int] = None) -> tuple[int, int]:
    """The weight-gradient launches' rank chunk and how many cover ``width`` (S's columns), for a table tile
    ``block_r`` (chunks of at most ``max_tile``, by default `GRAD_MAX_TILE`)."""
    tile = min(block_r, max_tile or GRAD_MAX_TILE)
    return tile, _cdiv(width, tile)
# Weight-gradient launches with rank chunks of at least this width accumulate the transpose, G^T = M^T L (the wide
# tile as the product's left operand, a (BLOCK_K, BLOCK_R) accumulator; `_weight_grad`'s TRANS_ACC); narrower ones
# G = L^T M. On the H200, 32 adapters x 1024 tokens, K=4096, a launch: dA and dB at r=64 108 -> 103 us, at r=128 (two
# 64-wide chunks) 196 -> 164; at r=32 about even (dA 88.2 -> 87.0, dB 87.6 -> 85.6); at r=16 the transpose was slower,
# most in the fused dB + dS launch (256 tokens 42.8 -> 46.6 us; 14336 columns of dY, 1024 tokens, 340 -> 442).
GRAD_TRANSPOSE_MIN_TILE = 32

# The frozen linear takes the LoRA term as its GEMM's addend (``Y = X W^T + Y_lora``, cuBLAS with beta = 1) instead
# of the LoRA launch reading and rewriting the GEMM's output: one pass over Y (and over dX in backward) fewer.
LORA_FIRST = True


def _lora_first(sched: Schedule, bias: Optional[Tensor]) -> bool:
    """Whether the LoRA launch writes first and the frozen GEMM adds into it: every row is some adapter's (rows
    outside all segments would need zeros first) and there is no bias (the addend would need it added)."""
    return LORA_FIRST and sched.num_blocks > 0 and sched.covers_all_rows and bias is None


@dataclass(frozen=True)
class GradTargets:
    """Where the weight-gradient launches add ``dA_i`` and ``dB_i``: device pointer arrays (and the tensors)."""

    a_ptrs: Tensor
    b_ptrs: Tensor
    a: tuple[Tensor, ...]
    b: tuple[Tensor, ...]
    aligned: bool  # every row of every target starts on a 16-byte boundary (vector stores)
    # The two flat buffers behind the targets while nothing has been written into them (made empty): a launch then
    # stores its gradients instead of adding them (`_weight_grad_launch`); None: add into what is there
    new: Optional[tuple[Tensor, Tensor]] = None
    # New dA views not yet set as the A_i's ``.grad`` (`_grads_of_parameters`' ``later_a``): the shrink's backward
    # sets them once its launch has stored them
    later_a: tuple[Tensor, ...] = ()


_grad_tables = _LRU()


def _fresh_grads(weights: LoRAWeights, table: PointerTable, device: torch.device, empty: bool = False) -> GradTargets:
    """New gradients in two flat buffers (one for every dA, one for every dB), returned through autograd: zeroed,
    or with ``empty`` left for the launches that follow to store every element of (`GradTargets.new`)."""
    flat_a, flat_b, ptrs_a, ptrs_b, grads_a, grads_b = _flat_like(weights, table, device, zero=not empty)
    new = (flat_a, flat_b) if empty else None
    return keep_alive(GradTargets(ptrs_a, ptrs_b, grads_a, grads_b, table.ranks8, new))


def _flat_like(weights: LoRAWeights, table: PointerTable, device: torch.device,
               dtype: Optional[torch.dtype] = None, zero: bool = True):
    """Two flat buffers shaped as every A_i and every B_i (zeroed, or left empty): the buffers, device pointer
    arrays to every A_i and B_i view (computed on the device: no upload per call), and the views."""
    n = len(weights.a)
    dtype = dtype or weights.a[0].dtype
    sizes_a, sizes_b = table.grad_sizes[:n], table.grad_sizes[n:]
    make = torch.zeros if zero else torch.empty
    flat_a = make(sum(sizes_a), device=device, dtype=dtype)
    flat_b = make(sum(sizes_b), device=device, dtype=dtype)
    if table.one_rank:  # one call each (what a sweep of one rank has), not n views made in Python
        views_a = flat_a.view(n, *weights.a[0].shape).unbind(0)
        views_b = flat_b.view(n, *weights.b[0].shape).unbind(0)
    else:
        views_a = tuple(g.view_as(a) for g, a in zip(torch.split(flat_a, sizes_a), weights.a))
        views_b = tuple(g.view_as(b) for g, b in zip(torch.split(flat_b, sizes_b), weights.b))
    ptrs = table.grad_offsets * flat_a.element_size()
    ptrs[0] += flat_a.data_ptr()
    ptrs[1] += flat_b.data_ptr()
    return flat_a, flat_b, ptrs[0, :n], ptrs[1, :n], views_a, views_b


def _grads_of_parameters(weights: LoRAWeights, table: PointerTable, device: torch.device,
                         empty: bool = False, later_a: bool = False) -> GradTargets:
    """The parameters' own ``.grad`` tensors; missing ones are created in flat buffers (zeroed, as the first
    accumulation would, or with ``empty`` left for the launches that follow to store into: `_fresh_grads`).
    Pointer arrays are cached by the gradients' addresses. ``later_a``: new dA views are left for the caller to set
    as ``.grad`` once a launch has stored them (`GradTargets.later_a`): dB is stored first, and an error before
    dA's launch (out of memory in the dX product, say) leaves the A_i without a gradient, not with an unwritten
    one that a later backward would add into."""
    params = weights.a + weights.b
    grads = list(map(_grad, params))
    n = len(weights.a)
    # (not `grads.count(None)`: that compares every tensor with None through Tensor.__eq__, ~1 ms per call)
    if all(map(is_, grads, repeat(None))):  # the first backward of a step (after zero_grad(set_to_none=True))
        fresh = _fresh_grads(weights, table, device, empty)
        for p, g in zip(weights.b if later_a else params, fresh.b if later_a else fresh.a + fresh.b):
            p.grad = g
        targets = GradTargets(fresh.a_ptrs, fresh.b_ptrs, (), (), fresh.aligned)
        # a later backward before zero_grad (gradient accumulation) finds these by address, and adds into them
        key = (tuple(map(_data_ptr, fresh.a + fresh.b)), device, table.ranks8)
        weights.memo["grad_targets"] = (key, _grad_tables.get_or_make(key, lambda: targets))
        return keep_alive(replace(targets, new=fresh.new, later_a=fresh.a if later_a else ()))
    try:
        ready = all(map(_is_contiguous, grads))
    except TypeError:  # a gradient is None
        ready = False
    if not ready:
        redo = [i for i, g in enumerate(grads) if g is None or not g.is_contiguous()]
        flat = torch.zeros(sum(params[i].numel() for i in redo), device=device, dtype=params[redo[0]].dtype)
        for i, view in zip(redo, torch.split(flat, [params[i].numel() for i in redo])):
            if grads[i] is not None:
                view.copy_(grads[i].reshape(-1))
            params[i].grad = grads[i] = view.view_as(params[i])
    key = (tuple(map(_data_ptr, grads)), device, table.ranks8)  # `aligned` depends on the ranks too
    # Memoized on `weights` (one per layer): the shared cache alone holds fewer entries than a large model has
    # projections (Qwen2.5-32B: 448), and cycling through it rebuilt and uploaded every table at every backward.
    memo = weights.memo.get("grad_targets")
    if memo is not None and memo[0] == key:
        return keep_alive(memo[1])

    def make() -> GradTargets:
        host = [g.data_ptr() for g in grads]
        ptrs = _upload_rows(torch.tensor(host, dtype=torch.int64).reshape(2, n), device)
        return GradTargets(ptrs[0, :n], ptrs[1, :n], (), (), table.ranks8 and not any(p & 15 for p in host))

    targets = _grad_tables.get_or_make(key, make)
    weights.memo["grad_targets"] = (key, targets)
    return keep_alive(targets)


def _meta(kind: str) -> dict[str, int]:
    """Tiles for a launch: none on the GPU (autotuned), the fixed ones in the interpreter."""
    return dict(K.DEFAULT_META[kind]) if K.INTERPRETED else {}


_SMS: dict[int, int] = {}


def _low_rank_buffer(rows: int, table: PointerTable, device: torch.device, dtype: torch.dtype,
                     zero: bool = False) -> Tensor:
    """``S`` / ``dS`` in ``dtype`` (`low_rank_dtype`), as wide as the largest rank rounded up to 16 (not the rank
    tile, which may be wider than any rank left: `rank_chunk`). Left empty: the row kernel writes every segment
    row's first ``r_i`` columns, the only ones any kernel reads (masked by segment and rank), and `_zero_if_split`
    zeroes it where the launch adds into it instead."""
    return (torch.zeros if zero else torch.empty)((rows, table.width), device=device, dtype=dtype)


# S and dS in the activation dtype where it is one of these and every launch that writes them stores (no atomics):
# the products that read them take the activation dtype anyway (each kernel casts the tile it loads), so only the
# bytes change, halved: the weight-gradient launches read them once per K block, the expand and dX launches once per
# program. On the H200, 32 adapters x 1024 tokens, 4096x4096, profiler: the weight-gradient launches at r=64 took 206
# -> 192 us, at ranks 8..128 239 -> 212; the expand + dX 264 -> 257 and 348 -> 338; a forward + backward 0.662 ->
# 0.638 ms and 0.788 -> 0.750 (0.714 with `NARROW_RANK_TILES` too, in `benchmarks/kernels.py`). Otherwise fp32: fp32
# activations, the fused dB + dS launch (atomic adds into dS), row launches that may split K (few row blocks:
# `LOW_RANK_MIN_WAVES`), and fp16, whose range an unscaled S may leave where s * S does not (the expand scales the
# tile by min(s, 1) before its cast: `triton_kernels`' SCALE_PRODUCT).
LOW_RANK_HALF_DTYPES = (torch.bfloat16,)
# ... from this many row-kernel programs per SM up (fewer: the row kernel may split K, adding into fp32 atomically).
# Few row blocks gain from a K split only when very few: on the H200, 4096x4096 at 256 tokens an adapter, a forward +
# backward with S / dS in bf16 (no split) against fp32 (split tuned), ms: 32 adapters (128 row blocks, about one wave)
# r=64 0.213 -> 0.199, r=128 0.321 -> 0.283, ranks 8..128 0.236 -> 0.212 (4096x1024 and 14336x4096 alike, 5-10%);
# 16 adapters r=64 0.117 -> 0.117, 8..128 0.143 -> 0.132; 8 adapters (32 blocks) r=64 0.098 -> 0.102 (the shrink's
# split 10 -> 16 us), 8..128 0.098 -> 0.093 (`benchmarks/results/kernels_h200.md`, session 34). (It was 2.)
LOW_RANK_MIN_WAVES = 0.4


def low_rank_dtype(x: Tensor, d_out: int, sched: Schedule, table: PointerTable, fuse_ds: bool,
                   deterministic: bool = False) -> torch.dtype:
    """The dtype of a call's ``S`` and ``dS`` (one for both: ``dS`` is ``S``'s gradient, and autograd would cast a
    gradient of another dtype): `LOW_RANK_HALF_DTYPES`; at any row count for a ``deterministic`` call, whose row
    launches never split K (`_Call.deterministic`)."""
    if x.dtype not in LOW_RANK_HALF_DTYPES or fuse_ds:
        return torch.float32
    if deterministic:
        return x.dtype
    if x.device.type != "cuda":  # the interpreter: the row launches' K split is `_split_k`'s
        split = max(_split_k(sched.num_blocks, k, x.device) for k in (x.shape[1], d_out))
        return x.dtype if split == 1 else torch.float32
    programs = sched.num_blocks * table.r_chunks
    return x.dtype if programs >= LOW_RANK_MIN_WAVES * _sm_count(x.device) else torch.float32


# Rank tiles narrower than a launch's, in the expand and dX launches: an adapter whose rank fits half or a quarter of
# the tile runs a tile of that width (`triton_kernels`' NARROW): each width is compiled into the kernel, and a program
# takes one, by its adapter's rank. A tile is the largest rank's (and never narrows on a device: `rank_chunk`), so
# with ranks 8..128 every adapter used to multiply, and hold, 128 rank columns. Up to this many halvings, none below
# 16. On the H200, 32 adapters x 1024 tokens, 4096x4096, profiler: the expand + dX launches at ranks 8..128 took 348
# -> 314 us, at r=64 (every adapter the full tile: the narrower copies compiled, never run) 264 -> 262. The row
# and weight-gradient kernels do not take it: the row launches gained nothing (168 -> 167 us), and the
# weight-gradient launches, whose rank chunks are at most 64 already (`GRAD_MAX_TILE`), got slower with fp32 S / dS
# (r=64 206 -> 272 us, ranks 8..128 239 -> 268) and at most 3% faster with bf16 ones.
NARROW_RANK_TILES = 2
# Launches of the expand and of dX for a set of ranks that differ, at most one per rank tile (the tile, its halvings:
# `rank_classes`), each tuned on its own; 1: one launch with the narrower tiles compiled in (`NARROW_RANK_TILES`). The
# hope was that one kernel holding the 128-wide path ran every program at that path's occupancy. On the H200, 32
# adapters of ranks 8..128, a forward + backward (`benchmarks/kernels.py --ranks mixed --rank-class-launches`), the
# expand + dX launches took, with 1 / 2 / 4 launches: 4096x4096 at 1024 tokens each 299 / 287 / 297 us, at 256 tokens
# 79 / 80 / 89; 14336x4096 515 / 512 / 516 and 158 / 150 / 160. So 2: about 1% of the whole call, not the gap to r=64.
RANK_CLASS_LAUNCHES = 2
# Measured and dropped: the shrink and dS launched per class of ranks too, each row block's product as wide as its
# class's tile (H200, 32 adapters of ranks 8..128, 1024 tokens each, 4096x4096): the two row launches took 177.5 us a
# step per class and 173.7 us once, a forward + backward 0.663 and 0.655 ms. They stream their input (X, dY); a
# wider product costs them nothing measurable.


def narrow_levels(block_r: int) -> int:
    """How many narrower widths a launch of rank tile ``block_r`` compiles (`NARROW_RANK_TILES`)."""
    return min(NARROW_RANK_TILES, max(0, (block_r // 16).bit_length() - 1))


def _zero_if_split(out: Tensor):
    """The row launch's ``before``: ``out`` zeroed unless the launch is known to store (one program per row
    block); its programs add into it atomically otherwise. (On the H200 a zeroing is a launch of ~2 us per
    projection and pass; 672 a step at 32 layers x 7 projections.)"""
    return lambda full: out.zero_() if full is None or full["SPLIT_K"] > 1 else None


def _row_launch(call: _Call, full: Tensor, w_ptrs: Tensor, out: Tensor, w_is_a: bool, has_dropout: bool) -> None:
    """``OUT[t, :r_i] = drop_i(FULL[t]) @ W_i``: the shrink (``W_i = A_i^T``) or dS (``W_i = B_i``), one launch over
    every row block and rank chunk at the whole rank tile; its K split (with its tiles) is tuned per bucket of
    programs (row blocks x rank chunks), or set by rule for a small launch (`K.small_rows_bucket`). ``OUT`` is
    zeroed first where the launch splits K (`_zero_if_split`)."""
    sched, table, k = call.sched, call.table, full.shape[1]
    programs = sched.num_blocks * table.r_chunks
    bucket = _row_bucket(full, out, programs, None if K.INTERPRETED else _sm_count(full.device), call.deterministic)
    _rows_times_weight(
        lambda meta: (programs, meta["SPLIT_K"]),
        (full, w_ptrs, call.w_witness, out, sched.blk_adapter, sched.blk_start, sched.seg_start, sched.seg_end,
         table.ranks, table.ones, table.drop_p, call.seeds, k, table.r_chunks,
         bucket, call.row_tokens, full.stride(0), out.stride(0)),
        dict(W_IS_A=w_is_a, HAS_DROPOUT=has_dropout, DOT_PRECISION=call.precision, W_ALIGNED=call.w_aligned,
             BLOCK_M=BLOCK_M, BLOCK_R=table.block_r,
             **_rows_meta(sched.num_blocks, k, full.device, call.deterministic)),
        _zero_if_split(out))


def _row_bucket(full: Tensor, out: Tensor, programs: int, sms: Optional[int], deterministic: bool = False) -> int:
    """A row launch's ``ROW_BUCKET``: its programs' bucket, or for a small launch (`K.tuning_buckets`) 0, or on a
    GPU of ``sms`` SMs (None: the interpreter, which takes `_rows_meta`'s split) its K split negated
    (`K.small_rows_bucket`). ``deterministic`` (`_Call.deterministic`): no K split, the tuned bucket of an fp32
    ``out`` offset by `K.STORES_ONLY` (its candidates then store only, and are tuned apart)."""
    fp32 = out.dtype == torch.float32
    bucket, = K.tuning_buckets(full, _bucket(programs))
    if bucket == 0 and sms is not None:
        bucket = K.small_rows_bucket(programs, full.shape[1], sms, fp32 and not deterministic)
    elif bucket > 0 and deterministic and fp32:
        bucket += K.STORES_ONLY
    return bucket


def rank_classes(sched: Schedule, table: PointerTable) -> tuple[tuple[int, int, int, int, bool, int, int], ...]:
    """The expand / dX launches of a layout: (first row block, end, rank tile, narrower tiles compiled, rank chunks
    beyond the tile, tuning bucket of its row blocks, rows of its tallest block) each, up to `RANK_CLASS_LAUNCHES`.
    The row blocks are listed largest rank first (`schedule`), so the blocks whose ranks fit each halving of the tile
    are a contiguous run, launched with that tile; the last launch takes every narrower rank, with its
    `narrow_levels`. Ranks that all fit one class (one rank, say) launch as that class would beside others: an adapter
    set that shrinks to them mid-run (its widest ranks exited, the tile held: `rank_chunk`) compiles no new kernel
    (the tallest block, which keys the tuning, is the class's own)."""
    # (a schedule of one rank, shared by the ranks of its tall height, has no runs: its rank, rounded up to 16, is the
    # width; 128 and 256 have one tile, but 256 takes two chunks)
    key = (table.block_r, table.r_chunks > 1, table.width, RANK_CLASS_LAUNCHES, NARROW_RANK_TILES)
    classes = sched.classes.get(key)
    if classes is not None:
        return classes
    tiles = [table.block_r >> k for k in range(max(1, RANK_CLASS_LAUNCHES)) if table.block_r >> k >= 16]
    bounds: list[list[int]] = []  # [first block, tile index] of each launch
    for rank, first in sched.rank_runs or ((table.width, 0),)[:sched.num_blocks]:
        index = next((k for k in range(len(tiles) - 1, 0, -1) if rank <= tiles[k]), 0)
        if not bounds or bounds[-1][1] != index:
            bounds.append([first, index])
    ends = [b[0] for b in bounds[1:]] + [sched.num_blocks]
    classes = tuple((first, end, tiles[k], narrow_levels(tiles[k]) if k == len(tiles) - 1 else 0,
                     k == 0 and table.r_chunks > 1, _bucket(end - first),
                     max(sched.wide_rows[sched.wide_index[first]:sched.wide_index[end]], default=BLOCK_M))
                    for (first, k), end in zip(bounds, ends))
    sched.classes[key] = classes
    return classes


def _rank_launch(call: _Call, low: Tensor, w_ptrs: Tensor, out: Tensor, w_is_a: bool, accumulate: bool,
                 has_dropout: bool) -> None:
    """``OUT[t, :] (+)= c_i (LOW[t, :r_i] @ W_i) [* drop mask]``: the expand (``W_i = B_i^T``) or dX (``W_i = A_i``),
    one launch per class of ranks (`rank_classes`), over its row blocks, or, where the tuner picked a ``HOLD_W``
    tile, over the same adapters' tall blocks (``Schedule.wide_index`` maps the class's bounds)."""
    sched, table, width = call.sched, call.table, out.shape[1]
    for first, end, tile, narrow, multi_chunk, bucket, rows_per in rank_classes(sched, table):
        wide_first, wide_end = sched.wide_index[first], sched.wide_index[end]
        bucket, rows_per = K.tuning_buckets(out, bucket, rows_per)
        _rank_times_weight(
            lambda meta, blocks=end - first, tall=wide_end - wide_first:
                (tall, _cdiv(width, meta["BLOCK_N"])) if meta["HOLD_W"] else (blocks, _cdiv(width, meta["N_PER"])),
            (low, w_ptrs, call.w_witness, out, sched.blk_adapter, sched.blk_start, sched.wide_adapter,
             sched.wide_start, sched.wide_end, sched.seg_start, sched.seg_end, table.ranks, table.scaling,
             table.drop_p, call.seeds, width, bucket, call.row_tokens, first, wide_first,
             rows_per, low.stride(0), out.stride(0)),
            dict(W_IS_A=w_is_a, ACCUMULATE=accumulate, HAS_DROPOUT=has_dropout, DOT_PRECISION=call.precision,
                 BLOCK_M=BLOCK_M, BLOCK_R=tile, MULTI_CHUNK=multi_chunk, NARROW=narrow,
                 SCALE_PRODUCT=out.dtype == torch.float16, W_ALIGNED=call.w_aligned, **_meta("rank")))


def _bucket(count: int) -> int:
    """A tuning bucket: the next of ``2**k`` and ``3 * 2**(k-1)`` (two a doubling; triton's next_power_of_2 is slow
    to call), at most 2**14. Powers of two alone were too coarse: on the H200, 14336x4096 at r=64 with 32 adapters of
    mixed token counts (about 300 row blocks) took 0.796 ms with the row and rank tiles tuned on 32 x 1024 tokens
    (512 row blocks, the same power of two) and 0.726 ms with its own (bucket 384)."""
    top = 1 << (max(count, 1) - 1).bit_length()
    return min(top * 3 // 4 if 4 * count <= 3 * top and top >= 4 else top, 1 << 14)


def _rows_meta(num_blocks: int, k: int, device: torch.device, deterministic: bool = False) -> dict[str, int]:
    """The row kernel's meta-parameters: none on the GPU (tuned); the interpreter takes fixed tiles and
    `_split_k` (none where ``deterministic``)."""
    if K.INTERPRETED:
        return dict(K.DEFAULT_META["rows"], SPLIT_K=1 if deterministic else _split_k(num_blocks, k, device))
    return {}


def _split_k(num_blocks: int, k: int, device: torch.device) -> int:
    """Programs per row block in the interpreter: one (tests force more to run the atomic path)."""
    return 1


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _split_for(num_programs: int, max_tokens: int, sms: Optional[int], min_rows: int = 64) -> int:
    """Row splits so that small problems still fill the GPU of ``sms`` SMs (None: the interpreter, one) twice over,
    each program keeping more than ``min_rows`` of the largest adapter's rows (each split adds into G atomically)."""
    split = 1
    while sms is not None and num_programs * split < 2 * sms and max_tokens > 2 * split * min_rows:
        split *= 2
    return split


_tuned_grad_keys: set = set()


def _weight_grad_launch(g_is_a: bool, low: Tensor, full: Tensor, call: _Call, targets: GradTargets,
                        ds: Optional[Tensor] = None) -> None:
    """One launch into ``targets``: ``dA_i += s_i dS_i^T drop_i(X_i)`` (``g_is_a``: ``low`` = dS, ``full`` = X) or
    ``dB_i += s_i dY_i^T S_i`` (``low`` = S, ``full`` = dY), the latter also adding ``dS = dY B`` into ``ds``
    (zeroed) when given."""
    weights, table, sched, seeds = call.weights, call.table, call.sched, call.seeds
    n = len(weights.a)
    device = full.device
    k = full.shape[1]
    witness = targets.a[0] if targets.a else targets.later_a[0] if targets.later_a else weights.a[0].grad
    # (dS is kept without s; dropout only on X, in dA)
    dropout = call.has_dropout and g_is_a
    ptrs = targets.a_ptrs if g_is_a else targets.b_ptrs
    with_ds = ds is not None
    block_r, r_chunks = _grad_chunks(table.block_r, table.width)
    split = _grad_split(call, k, device)
    bucket, token_bucket = K.tuning_buckets(full, sched.bucket, sched.token_bucket)
    tail = (k, r_chunks, split, bucket, token_bucket, call.row_tokens, low.stride(0), full.stride(0),
            ds.stride(0) if with_ds else 0)
    w_args = (call.b_ptrs, call.w_witness, ds) if with_ds else (ptrs, witness, low)  # (unused without dS)
    args = (low, full, ptrs, witness, sched.seg_start, sched.seg_end, sched.grad_order, table.ranks, table.scaling,
            table.drop_p, seeds, *w_args, *tail)
    w_aligned = with_ds and call.w_aligned
    # Into new (empty) gradients: stored, or with a row split zeroed first and added into
    new = targets.new[0 if g_is_a else 1] if targets.new is not None else None
    if new is not None and split > 1:
        new.zero_()
    add_to_g = new is None
    meta = dict(G_IS_A=g_is_a, HAS_DROPOUT=dropout, ATOMIC=split > 1, ADD_TO_G=add_to_g, DOT_PRECISION=call.precision,
                G_ALIGNED=targets.aligned, WITH_DS=with_ds, W_ALIGNED=w_aligned, BLOCK_R=block_r,
                TRANS_ACC=block_r >= GRAD_TRANSPOSE_MIN_TILE,
                **_meta("grad"))
    grid = lambda m: (_cdiv(k, m["BLOCK_K"]) * split, n * r_chunks)  # noqa: E731
    tune_key = (k, block_r, g_is_a, split > 1, add_to_g, dropout, low.dtype, full.dtype, witness.dtype,
                meta["DOT_PRECISION"], targets.aligned, with_ds, w_aligned, w_args[1].dtype, bucket, token_bucket)
    if not K.INTERPRETED and tune_key not in _tuned_grad_keys:
        # The launch adds into its targets (and dS), and the autotuner's trials would add several times: let them
        # run on scratch ones first; the real launch below then reuses the chosen tiles.
        scratch = _fresh_grads(weights, table, device)
        scratch_w = (w_args[0], w_args[1], torch.zeros_like(ds)) if with_ds else (ptrs, scratch.a[0], low)
        K._weight_grad[grid](low, full, scratch.a_ptrs if g_is_a else scratch.b_ptrs, scratch.a[0], *args[4:11],
                             *scratch_w, *tail, **meta)
        _tuned_grad_keys.add(tune_key)
    _weight_grad(grid, args, meta)


# A weight-gradient launch split over rows adds each program's (rank chunk x K block) fp32 tile into G atomically: a
# split of s adds s times G, and atomics run far below the copy rate, the more so the wider the chunk. So each program
# of a split keeps more than this many rows of the largest adapter: (rank chunk up to, rows), the last for wider ones.
# On the H200 (`benchmarks/results/kernels_h200.md`, session 39; before, 64 rows at every chunk), over 74 points of 1
# to 32 adapters, 256 / 1024 / 64..2048 tokens each, the four Llama-8B shapes, a forward + backward (with
# `ds_db_one_launch`) takes a median 0.95x the time (0.62x-1.01x; composed per point from three runs of other rules
# that make the same choices there, not yet one run: `benchmarks/grad_split.py`): one adapter of 256 tokens at r=64,
# 4096x1024, 48.4 -> 32.8 us; 4 x 1024 tokens, ranks 8..128, 109.6 -> 89.9. A 64-wide chunk's split at 128 rows a
# program cost more than it gained (14336x4096, one adapter x 256 tokens: dA 20.3 -> 8.8 us unsplit); 512 rows beat
# 256 at 1024 tokens (4096x1024: 61.8 -> 52.2 us), while a 32-wide chunk did better at 128 than at 256 (one adapter
# of rank 24 x 1024 tokens, 4096x4096: 51.5 vs 53.1 us).
GRAD_SPLIT_MIN_ROWS = ((16, 64), (32, 128), (64, 512))


def _grad_split(call: _Call, k: int, device: torch.device) -> int:
    """The weight-gradient launches' row split (`_split_for`) at width ``k``: programs of more than
    `GRAD_SPLIT_MIN_ROWS` rows for their rank chunk; none for a deterministic call (`_Call.deterministic`)."""
    if call.deterministic:
        return 1
    block_r, chunks = _grad_chunks(call.table.block_r, call.table.width)
    return _split_for(len(call.weights.a) * chunks * _cdiv(k, 128), call.sched.max_tokens,
                      _sm_count(device) if device.type == "cuda" else None, grad_split_min_rows(block_r))


def grad_split_min_rows(block_r: int) -> int:
    """The rows of the largest adapter that a program of a weight-gradient row split keeps more than, at rank chunk
    ``block_r`` (`GRAD_SPLIT_MIN_ROWS`)."""
    return next((rows for chunk, rows in GRAD_SPLIT_MIN_ROWS if block_r <= chunk), GRAD_SPLIT_MIN_ROWS[-1][1])


def ds_db_table(sched: Schedule, table: PointerTable, k: int, device: torch.device,
                grad_block_k: Optional[int] = None, grad_tile: Optional[int] = None) -> Tensor:
    """The dS + dB launch's interleaved program codes (`triton_kernels._ds_and_db`): adapter by adapter, in the row
    blocks' order, its dS programs (row blocks x rank chunks) and its dB programs (slots of the grad order x K blocks
    of ``grad_block_k``, by default the launch's `triton_kernels.DS_DB_GRAD_BLOCK_K`, rank chunks of at most
    ``grad_tile``, by default `DS_DB_GRAD_MAX_TILE`) merged evenly; the dB programs of adapters without rows (which
    store their zeros) last. Built once per layout, tile and width."""
    chunks = _grad_chunks(table.block_r, table.width, grad_tile or DS_DB_GRAD_MAX_TILE)[1]
    k_blocks = _cdiv(k, grad_block_k or K.DS_DB_GRAD_BLOCK_K)
    key = ("ds_db", table.r_chunks, chunks, k_blocks)  # (what the codes depend on beside the layout)
    codes = sched.classes.get(key)
    if codes is None:
        slot_of = {a: pos * chunks for pos, a in enumerate(sched.grad_host)}

        def db(a: int) -> list[int]:
            return [-((slot_of[a] + c) * k_blocks + kb) - 1 for c in range(chunks) for kb in range(k_blocks)]

        merged: list[int] = []
        for a, first, blocks in sched.by_block:
            ds = list(range(first * table.r_chunks, (first + blocks) * table.r_chunks))
            dbs = db(a)
            pairs = [(i / len(ds), 0, c) for i, c in enumerate(ds)] + [(i / len(dbs), 1, c) for i, c in enumerate(dbs)]
            merged += [c for _, _, c in sorted(pairs)]
        with_rows = {a for a, _, _ in sched.by_block}
        merged += [c for a in sched.grad_host if a not in with_rows for c in db(a)]
        codes = sched.classes[key] = _upload(torch.tensor(merged, dtype=torch.int32), device)
    return codes


_ds_db_sizes_checked: Optional[tuple] = None  # (the settings last found good)


def _check_ds_db_sizes() -> None:
    """The dS + dB launch's block-size settings are tile sides: powers of two from 16 to 256 (or None: the default).
    Checked again only when they change (this runs at every launch)."""
    global _ds_db_sizes_checked
    sizes = (DS_DB_BLOCK_M, DS_DB_GRAD_MAX_TILE, K.DS_DB_GRAD_BLOCK_K)
    if sizes == _ds_db_sizes_checked:
        return
    names = ("triton_lora.DS_DB_BLOCK_M", "triton_lora.DS_DB_GRAD_MAX_TILE", "triton_kernels.DS_DB_GRAD_BLOCK_K")
    for name, value in zip(names, sizes):
        if value is not None and (type(value) is not int or value not in (16, 32, 64, 128, 256)):
            raise ValueError(f"`{name}` can be 16, 32, 64, 128 or 256 (a tile side), got {value!r}")
    _ds_db_sizes_checked = sizes


def _ds_db_launch(call: _Call, dy: Tensor, s: Tensor, ds: Tensor, targets: GradTargets) -> None:
    """``dS = dY B`` into ``ds`` (stored) and ``dB_i (+)= s_i dY_i^T S_i`` into ``targets`` from one launch
    (`DS_DB_ONE_LAUNCH`): the row launch's and the dB launch's programs, their order tuned (`ds_db_table`)."""
    _check_ds_db_sizes()
    weights, table, sched = call.weights, call.table, call.sched
    n, k, device = len(weights.a), dy.shape[1], dy.device
    block_m = DS_DB_BLOCK_M or BLOCK_M
    if block_m != BLOCK_M:  # (the dS programs' blocks at their own height)
        sched = schedule(weights.starts, weights.ends, dy.shape[0], device, tuple(a.shape[0] for a in weights.a),
                         block_m)
    block_r, chunks = _grad_chunks(table.block_r, table.width, DS_DB_GRAD_MAX_TILE)
    witness = targets.b[0] if targets.b else weights.b[0].grad
    n_ds = sched.num_blocks * table.r_chunks
    programs = n_ds + n * chunks * _cdiv(k, K.DS_DB_GRAD_BLOCK_K)
    add_to_g = targets.new is None
    bucket, token_bucket = K.tuning_buckets(dy, _bucket(n_ds), sched.token_bucket)
    tail = (sched.blk_adapter, sched.blk_start, sched.seg_start, sched.seg_end, sched.grad_order, table.ranks,
            table.ones, table.scaling, table.drop_p, call.seeds, k, n_ds, table.r_chunks, chunks, bucket,
            token_bucket, call.row_tokens, dy.stride(0), ds.stride(0), s.stride(0))
    args = (ds_db_table(sched, table, k, device), dy, call.b_ptrs, call.w_witness, ds, s, targets.b_ptrs, witness,
            *tail)
    meta = dict(DOT_PRECISION=call.precision, W_ALIGNED=call.w_aligned, G_ALIGNED=targets.aligned, ADD_TO_G=add_to_g,
                TRANS_ACC=block_r >= GRAD_TRANSPOSE_MIN_TILE, BLOCK_M=block_m, ROWS_BLOCK_R=table.block_r,
                GRAD_BLOCK_K=K.DS_DB_GRAD_BLOCK_K, GRAD_BLOCK_R=block_r, **_meta("ds_db"))
    # (all the autotuner keys on: a key it has not tuned must not reach real targets)
    tune_key = ("ds_db", k, table.block_r, block_r, add_to_g, call.w_aligned, targets.aligned, meta["TRANS_ACC"],
                ds.dtype, s.dtype, dy.dtype, witness.dtype, call.w_witness.dtype, call.precision, bucket,
                token_bucket, block_m, K.DS_DB_GRAD_BLOCK_K)
    if not K.INTERPRETED and tune_key not in _tuned_grad_keys:
        # (its trials would add into the gradients several times: they run on scratch ones; dS is stored, not added)
        scratch = _fresh_grads(weights, table, device)
        K._ds_and_db[(programs,)](*args[:6], scratch.b_ptrs, scratch.b[0], *tail, **meta)
        _tuned_grad_keys.add(tune_key)
    _ds_and_db((programs,), args, meta)


def multi_lora_triton(x: Tensor, base_out: Tensor, weights: LoRAWeights, training: bool) -> Tensor:
    """The Triton path of `multi_lora`: same contract, ``base_out`` is updated in place and returned (one whose rows
    are not of unit-stride columns, or overlap, or a view of part of a tensor, is copied first: the copy is
    returned)."""
    if x.dim() != 2 or base_out.dim() != 2 or x.shape[0] != base_out.shape[0]:
        raise ValueError(f"expected x (T, d_in) and base_out (T, d_out), got {tuple(x.shape)}, {tuple(base_out.shape)}")
    if len(weights.a) == 0:
        return base_out
    whole = base_out._base
    if whole is not None:
        # A view (GPT-2's Conv1D returns its product through ``.view``): updated in place by this Function, autograd
        # would hand the view the Function's first gradient (x's), not base_out's. The product itself where the view
        # is all of it, else a copy.
        same = (whole.shape == base_out.shape and whole.stride() == base_out.stride()
                and whole.storage_offset() == base_out.storage_offset())
        base_out = whole if same else base_out.clone()
    return _apply(x, base_out, None, None, weights, training, base_out.shape[1])


def multi_lora_linear_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], weights: LoRAWeights,
                             training: bool) -> Tensor:
    """The Triton path of `multi_lora_linear`: the frozen linear ``X W^T + b`` runs inside the LoRA call (its
    expand half), so the LoRA ``dX`` is added into the base's."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x (T, d_in) and weight (d_out, d_in), got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.requires_grad or (bias is not None and bias.requires_grad) or weight.dtype != x.dtype:
        raise ValueError("the fused path needs a frozen base weight (and bias) in the input's dtype")
    if len(weights.a) == 0:
        return F.linear(x, weight, bias)
    return _apply(x, None, weight, bias, weights, training, weight.shape[0])


def _apply(x: Tensor, base_out: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
           weights: LoRAWeights, training: bool, d_out: int) -> Tensor:
    if weights.a[0].shape[1] != x.shape[1] or weights.b[0].shape[0] != d_out:
        raise ValueError(f"adapter shapes A {tuple(weights.a[0].shape)}, B {tuple(weights.b[0].shape)} do not fit "
                         f"x {tuple(x.shape)} and an output of width {d_out}")
    if weights.ends[-1] > x.shape[0]:
        raise ValueError(f"the adapters' rows end at {weights.ends[-1]}, past x's {x.shape[0]} rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if base_out is not None and (base_out.stride(-1) != 1 or base_out.stride(0) < base_out.shape[1]):
        base_out = base_out.contiguous()  # (the expand writes rows of unit-stride columns, in place: its own copy)
    out_dtype = x.dtype if base_out is None else base_out.dtype
    precision = _precision(x)
    region = active_region() if torch.is_grad_enabled() else None  # a region checkpointed with `checkpoint_contexts`
    if region is None:
        call = _new_call(x, weights, training, d_out, out_dtype, precision)
        return _LoRAExpand.apply(x, *_LoRAShrink.apply(x, call, *call.params), base_out, weight, bias, call)
    # (``weights`` is held by the kept call until the region's backward, so its id is not reused meanwhile)
    key = (id(weights), x.shape, x.dtype, out_dtype, d_out, training, precision)
    kept = region.take(key) if region.replaying else None
    if kept is not None and kept[1] is not None:  # a recomputation: the forward's S and launch state
        s, call = kept
        if call.has_dropout and weights.streams is None:
            # the forward's draw again (the RNG state is restored): later ops see the same stream
            _draw_seeds(weights, x.device)
    else:
        call = _new_call(x, weights, training, d_out, out_dtype, precision)
    if kept is not None:
        call.kept_s = kept[0]
    s, z = _LoRAShrink.apply(x, call, *call.params)
    if not region.replaying:
        # The call only where its autograd inputs are leaves: a non-leaf weight's graph (made inside the region)
        # reaches back to the region through the checkpoint's hooks, a cycle that would outlive an unused graph
        region.keep(key, s, call if all(map(_is_leaf, call.params)) else None)
    return _LoRAExpand.apply(x, s, z, base_out, weight, bias, call)


def _draw_seeds(weights: LoRAWeights, device: torch.device) -> Tensor:
    """Per-adapter dropout seeds on the device (no host sync): each adapter's from its stream at its step
    (``weights.streams``), else drawn from torch's random state (a checkpoint recomputation, which restores that
    state, draws the same ones)."""
    streams = weights.streams
    if streams is None:
        return torch.randint(0, 2**31 - 1, (len(weights.a),), dtype=torch.int32, device=device)
    memo = weights.memo.get("streams")
    if memo is None or memo[0] != device:
        memo = weights.memo["streams"] = (device, _upload_rows(torch.tensor([streams.seeds, streams.slots],
                                                                            dtype=torch.int64), device))
    tables, n = memo[1], len(weights.a)
    seeds = torch.empty(n, dtype=torch.int32, device=device)
    _stream_seeds((_cdiv(n, K.SEEDS_BLOCK),),
                  (tables[0], tables[1], streams.steps, seeds, n, STREAM_STEP_MIX, STREAM_SEED_MOD),
                  dict(BLOCK=K.SEEDS_BLOCK))
    return seeds


# The lists of the open `keep_calls` contexts (innermost last)
_call_sinks: list[list] = []


@contextmanager
def keep_calls() -> Iterator[list]:
    """Collects every call made while open (forward calls; a recomputation reuses its forward's) and the
    gradient tables their backwards use (`keep_alive`). A CUDA graph captured meanwhile keeps reading those
    device tables (pointer arrays, schedules, gradient tables, weight copies) at every replay: holding them
    holds the tables, whichever cache drops them."""
    sink: list = []
    _call_sinks.append(sink)
    try:
        yield sink
    finally:
        _call_sinks.remove(sink)


def keep_alive(obj: Any) -> Any:
    """``obj``, also added to the innermost open `keep_calls` list (if any): device state a capture reads."""
    if _call_sinks:
        _call_sinks[-1].append(obj)
    return obj


def _new_call(x: Tensor, weights: LoRAWeights, training: bool, d_out: int, out_dtype: torch.dtype,
              precision: str) -> _Call:
    params = weights.a + weights.b
    direct = (weights.direct_grads and torch.is_grad_enabled() and all(map(_requires_grad, params))
              and all(map(_is_leaf, params)) and len(set(map(id, params))) == len(params))  # (a tensor shared by two
    # adapters gets its gradient summed by autograd: direct gradients would keep one adapter's, or race on the GPU)
    if direct:
        params = params[:1]  # the one autograd input that makes backward run; the gradients go to `.grad`
    device = x.device
    table = pointer_table(weights, device)
    has_dropout = training and any(p > 0 for p in weights.dropout)
    seeds = _draw_seeds(weights, device) if has_dropout else table.ranks
    copy_dtype = _copy_dtype(x, out_dtype, weights)
    copies = None if copy_dtype is None else weight_copies(weights, table, copy_dtype, device)
    memo = weights.memo.get("schedule")  # (rows, device): the segments are the weights' own
    if memo is None or memo[0] != (x.shape[0], device):
        sched = schedule(weights.starts, weights.ends, x.shape[0], device, tuple(a.shape[0] for a in weights.a))
        memo = weights.memo["schedule"] = ((x.shape[0], device), sched)
    sched = memo[1]
    deterministic = torch.are_deterministic_algorithms_enabled()
    fuse_ds = FUSED_DS_DB and direct and table.block_r <= FUSED_DS_MAX_TILE and not deterministic
    return keep_alive(_Call(weights, table, sched, seeds, copies, has_dropout, precision, direct, d_out, out_dtype,
                            params, fuse_ds, low_rank_dtype(x, d_out, sched, table, fuse_ds, deterministic),
                            deterministic=deterministic))
