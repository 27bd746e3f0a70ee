"""Grouped multi-LoRA Triton kernels over a packed token buffer.

Adapter ``i`` owns rows ``[start_i, end_i)``. A schedule table of (adapter, first row) pairs, one per
``BLOCK_M`` rows of each segment, drives the row-blocked kernels, so adapters with more tokens get more
programs and boundary blocks are masked: no token padding. Ranks differ per adapter: the rank axis is cut
into ``BLOCK_R``-wide chunks masked by ``offs_r < r_i``; a chunk past an adapter's rank costs nothing (its
program returns at once, or the rank loop ends), so a mix of ranks 8..128 does each adapter's own work rather
than the largest rank's. Weights are never padded in memory. Each adapter keeps
its own ``A_i (r_i, d_in)`` and ``B_i (d_out, r_i)`` tensors, reached through device arrays of pointers.
All accumulation is fp32; matrix products take the activation dtype (bf16 / fp16 / fp32; fp32 products
are tf32 unless ``torch.backends.cuda.matmul.allow_tf32`` is off, then exact "ieee").

The kernels:
- `_rows_times_weight`: ``OUT[t, :r_i] = c_i * (drop_i(IN[t]) @ W_i)`` where W_i is ``A_i^T`` (shrink,
  ``S = drop(X) A^T``) or ``B_i`` (``dS = dY B``, kept without the scaling); one program per (row block,
  rank chunk), the chunks of one row block adjacent (the second reads its rows from L2); split over K (tuned)
  into an fp32 ``OUT`` (``S``, ``dS``) that must be zeroed. An ``OUT`` in the activation dtype (many rows:
  `triton_lora.low_rank_dtype`) takes only the candidates that store (no split).
- `_rank_times_weight`: ``Y[t, :] (+)= c_i * (R[t, :r_i] @ W_i) [* drop mask]`` where W_i is ``B_i^T``
  (expand + add, ``Y = Y_base + s S B^T``) or ``A_i`` (``dX = s drop'(dS A)``); one program per (row block,
  ``N_PER`` columns), a pipelined loop over its column blocks, each over the rank chunks. ``NARROW``: the
  kernel also holds copies of that loop for tiles of half (and a quarter of) ``BLOCK_R``, and a program whose
  adapter's rank fits one runs it: with ranks 8..128 (a 128 tile) an adapter of rank 8 no longer multiplies and
  holds 128 rank columns (`triton_lora.NARROW_RANK_TILES`). ``PREFETCH``: each step of that loop loads the next
  block's ``Y`` tile, so a read of ``Y`` is in flight while a block multiplies and stores. ``HOLD_W`` (tuning
  candidates beside the others): a program instead holds one weight tile of ``BLOCK_N`` columns and walks a tall
  block of its adapter's rows (`_rank_rows`), so the tile it re-reads per step is the low-rank one.
- `_weight_grad`: per adapter, ``G_i += c_i * L_i^T @ drop_i(M_i)`` over its rows, added into the
  adapter's own gradient tensor (reached through a pointer array) in A's layout (``dA = s dS^T drop(X)``)
  or B's (``dB^T = s S^T dY``); one program per (adapter, rank chunk, K block, row split; the split is a
  runtime value), the adapters taken in ``ORDER`` (`triton_lora.schedule`: most rows first). It adds into what
  is there, as autograd's gradient accumulation does (its autotuning trials must therefore run on scratch
  targets: see `triton_lora`), or, into new gradients (``ADD_TO_G`` off: made
  empty by a backward that found none, after ``zero_grad(set_to_none=True)``), stores without reading them: no
  zeroing and no read of zeros, each as many bytes as the gradients. ``WITH_DS`` (the ``dB`` launch): each
  program also adds its K block's share of ``dS = dY B`` into a zeroed fp32 ``dS`` (atomically, one
  ``(BLOCK_T, r)`` tile per ``dY`` tile), so ``dY`` is read once for both instead of twice. ``TRANS_ACC`` (rank
  chunks of 32 and more: `triton_lora.GRAD_TRANSPOSE_MIN_TILE`): the program accumulates ``G_i^T = drop_i(M_i)^T L_i``,
  a ``(BLOCK_K, BLOCK_R)`` tile with the wide operand on the left of the product (dB's own layout; dA's is stored
  transposed).
- `_ds_and_db`: the dS row launch's programs and the dB launch's in one launch (`triton_lora.DS_DB_ONE_LAUNCH`), in
  an order tuned with the tiles: each adapter's side by side, so that both read its dY tiles from DRAM once between
  them (L2 keeps them for the second), or every dS program first.
Dropout masks come from a per-adapter seed and the element's (row, column), the row counted from the adapter's first
row (so an adapter's masks do not depend on where its segment lies): the backward regenerates the forward's mask
instead of storing it. The seeds come from each adapter's stream and step (`_stream_seeds`) or from torch's random
state.

``W_ALIGNED`` / ``G_ALIGNED``: every weight (gradient) row starts on a 16-byte boundary (every rank a multiple of
8, every tensor aligned). Triton cannot know the alignment of a pointer read from a table, so without the hint a
weight tile is loaded element by element in every loop iteration; with it, as vectors (asynchronous copies in the
row kernel). On the H200, one forward + backward over the four Llama-8B shapes, 32 adapters x 256 tokens: r=64
1971 -> 1435 us, ranks 8..128 3309 -> 2173 us, r=16 926 -> 874 us.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Fixed tiles for the interpreter; on the GPU the tiles below are autotuned per shape.
DEFAULT_META = {
    "rows": dict(BLOCK_K=64),  # SPLIT_K: `triton_lora._split_k`
    "rank": dict(BLOCK_N=64, N_PER=128, PREFETCH=True, HOLD_W=False),
    "grad": dict(BLOCK_K=64, BLOCK_T=64),
    "ds_db": dict(ROWS_BLOCK_K=64, GRAD_BLOCK_T=64, INTERLEAVE=True),
}


def _quick_bench(fn, quantiles=None, **kwargs):
    """Triton's timing with a short budget (1 ms warm-up, 5 ms of runs per candidate, not 25 and 100; each run
    follows a 256 MB cache flush, so a launch of microseconds is still timed over about 50 runs): a run whose
    adapter set changes meets new row buckets as it goes, and tunes each inside its steps (on the H200 the headline
    sweep's full system spent 88 of its 145 s tuning 145 keys at 5 and 25 ms)."""
    return triton.testing.do_bench(fn, warmup=1, rep=5, quantiles=quantiles)


# A launch whose widest operand holds at most this many elements (8 MB in bf16, a few microseconds of memory traffic,
# about what a launch costs anyway) takes one candidate (the interpreter's tiles, `DEFAULT_META`, where a candidate
# has them; Triton 3.6 still times it once, later versions launch it untimed), while tuning it compiles and times
# every candidate (up to 23), once per tuning key: a run meets many (every projection width, rank tile, row bucket
# and dtype; a run whose adapters exit and are replaced, a new row bucket every few steps). Why: on a fresh H200 the
# two-adapter fp32 run of `tests/test_graphs.py` (tiny-llama, 320 tokens) was still compiling candidates after 6
# minutes; the headline sweep (`benchmarks/sweep.py`, a 512-wide model, 60 adapters) tuned 145 keys inside its full
# system's timed run at 2^17 (88 of its 145 s), 87 at 2^22 (8 s of 45 with `_quick_bench`'s budget; on the H200,
# `benchmarks/results/sweep_h200.md`). Each launch decides by its own widest operand (tokens x columns), so some
# launches of `benchmarks/kernels.py`'s points of few adapters are below it (at 4096x1024, up to 16 x 256 tokens). The
# launch says so in its tuning key (`tuning_buckets`, ``ROW_BUCKET`` 0 in every kernel here, or the negated K split of
# a row launch, `small_rows_bucket`): a row block holds 1 to 64 rows, so launches of one row bucket may be small or
# not. 0: tune every launch.
SMALL_PROBLEM = 1 << 22


def tuning_buckets(wide, *buckets: int) -> tuple[int, ...]:
    """The buckets a launch passes that only key its tuning (``ROW_BUCKET`` first, then ``TOKEN_BUCKET`` or
    ``ROWS_PER``): as given, or all 0 (never a bucket: `triton_lora._bucket`) where its widest operand ``wide`` (rows
    x columns) has at most `SMALL_PROBLEM` elements, so that the one candidate of a small launch (`_small_or`) and the
    tuned tiles of a larger one of the same bucket are kept apart, and small launches of any layout share one key
    (Triton 3.6 times even a lone candidate once per key: ~30 ms on the H200). A small row launch on the GPU then
    names its K split in place of the 0 (`small_rows_bucket`)."""
    return buckets if wide.numel() > SMALL_PROBLEM else (0,) * len(buckets)


def _small_or(prune, small):
    """An ``early_config_prune`` that keeps ``prune``'s candidates (all, without it), or, for a small launch
    (``ROW_BUCKET`` 0 or below: `tuning_buckets`, `small_rows_bucket`), only the one with the tiles ``small`` (a
    dict, or a function of the launch's arguments giving one; else the first)."""

    def candidates(configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs) if prune is not None else configs
        if named_args["ROW_BUCKET"] > 0:
            return kept
        tiles = small(named_args) if callable(small) else small
        return [next((c for c in kept if all(c.kwargs.get(k) == v for k, v in tiles.items())), kept[0])]

    return candidates


def _tuned(configs, key, small, prune=None, **kwargs):
    """Autotuned on the GPU over ``configs`` (``prune``: the launch's `early_config_prune`), except launches too
    small for it (`SMALL_PROBLEM`, `_small_or`); the choices are cached on disk (Triton's cache), so a new process
    does not tune the same shapes again."""
    if INTERPRETED:
        return lambda fn: fn
    return triton.autotune(configs=configs, key=key, cache_results=True, do_bench=_quick_bench,
                           prune_configs_by={"early_config_prune": _small_or(prune, small)}, **kwargs)


# Few candidates per kernel: each is compiled once per shape the first time it runs.
# The row kernel streams its input once: how many programs share a row block (SPLIT_K, each over a slice of
# K, adding into OUT atomically) decides whether the GPU has enough loads in flight; it depends on the
# number of row blocks (ROW_BUCKET, `triton_lora._bucket`), so it is tuned per bucket with the tiles.
_ROWS_CONFIGS = [triton.Config({"BLOCK_K": k, "SPLIT_K": sp}, num_warps=w, num_stages=st)
                 for sp in (1, 2, 4, 8) for k, w, st in ((64, 4, 4), (128, 8, 3), (256, 8, 3))]
# The expand / dX kernel walks its N_PER columns in BLOCK_N-wide steps, a loop the compiler pipelines (num_stages):
# the next weight tile (and, for the expand, the next Y tile) is in flight while this one is multiplied and stored,
# and the low-rank tile is read once per program. On the H200, 32 adapters x 1024 tokens at r=64: dX of 4096 columns
# took 126 us with the best unrolled candidate (two column blocks a program, one stage) and 96 with a whole row
# pipelined over three stages (its writes alone take 63); dX of 14336 columns 420 -> 312 us; the expand into a 4096-
# and a 14336-wide Y 166 -> 154 and 566 -> 513 us. N_PER == BLOCK_N: one block a program; one stage: the earlier
# unrolled candidates' shapes (fewer rows, r=16). In `benchmarks/kernels.py --ns 32` (36 points, 34 tuning keys) 12
# of these were chosen somewhere; the others are kept for other row counts.
# PREFETCH (Y a column block ahead, `_rank_columns`) in every candidate that pipelines its loop (num_stages > 1).
_RANK_CONFIGS = [triton.Config({"BLOCK_N": n, "N_PER": per, "PREFETCH": st > 1, "HOLD_W": False}, num_warps=w,
                                num_stages=st)
                 for n, per, w, st in ((128, 16384, 8, 3), (128, 16384, 4, 3), (256, 16384, 8, 3), (64, 16384, 4, 3),
                                       (128, 2048, 4, 3), (128, 2048, 8, 3), (128, 512, 4, 3), (64, 512, 4, 3),
                                       (64, 64, 4, 1), (128, 128, 4, 1), (256, 256, 8, 1), (128, 128, 8, 1),
                                       (64, 64, 4, 2), (128, 128, 8, 3), (64, 256, 4, 1), (128, 256, 4, 1),
                                       (128, 512, 8, 1), (256, 512, 8, 1))]
# HOLD_W: a program holds one (rank x BLOCK_N) weight tile and walks a tall block of its adapter's rows (the
# schedule's `wide` blocks), reading a (BLOCK_M x rank) low-rank tile per step: the tile re-read from
# L2 per BLOCK_M x BLOCK_N of output is then r x BLOCK_M elements (the low-rank rows) instead of r x BLOCK_N (the
# weights), which at rank tiles of 64 and 128 (BLOCK_M 64) were as many elements as the output or twice as many. On the H200, 32 adapters x 1024
# tokens, 4096x4096, the tuner took them for most keys: the expand + dX a forward + backward 245.9 -> 238.6 us at r=64,
# 283.3 -> 278.0 at ranks 8..128, 340.5 -> 326.8 at r=128 (a step 1-2% faster; `benchmarks/results/kernels_h200.md`).
# (Measured and dropped: the tiles stored through device-made tensor descriptors, the copy engine's asynchronous store
# beside the next step's product. Each program's descriptor cost more than the overlap gained: launched alone, dX at
# r=128 129.4 -> 140.8 us, the expand 189.6 -> 197.4; the tuner took none of them in a step, session 28.)
_RANK_CONFIGS += [triton.Config({"BLOCK_N": n, "N_PER": n, "PREFETCH": True, "HOLD_W": True}, num_warps=w,
                                num_stages=st)
                  for n, w, st in ((128, 4, 3), (128, 8, 3), (256, 8, 3), (256, 8, 2), (64, 4, 3))]
# (256, 64, 8 warps): on the H200, 32 adapters x 256 tokens at r=16, the dB + dS launch took 34.1 us at K=4096 (38.2
# with the best of the others) and 106 us at K=14336 (121).
# (256, 32, 4 warps) and (128, 32, 4): the best of a sweep (BLOCK_T 32-128, BLOCK_K 64-256, 4/8 warps, 2-4 stages) on the
# H200, 32 adapters x 1024 tokens, K=4096: dA at r=64 107.5 us (127.9 with the others), at r=128 274 us (307).
# (256, 64, 8 warps, 4 stages): dB at K=14336, r=64, 32 x 1024 tokens, 340 us (356 with the best of the others).
_GRAD_CONFIGS = [triton.Config({"BLOCK_K": k, "BLOCK_T": t}, num_warps=w, num_stages=st)
                 for k, t, w, st in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3), (256, 32, 8, 3), (256, 64, 8, 3),
                                     (256, 32, 4, 3), (128, 32, 4, 3), (256, 64, 8, 4))]


# A small row launch (`SMALL_PROBLEM`) of few programs still walks all of K in each: one adapter of 256 tokens at
# K=14336 is 4 row blocks, 4 programs of 224 steps each (on the H200 the shrink took 53 us for 9 MB, `_grouped_mm`'s
# 38). Its K split is then chosen without tuning: as many programs as fill the SMs once, in powers of two up to the
# largest of `_ROWS_CONFIGS`, each over at least `SMALL_SPLIT_MIN_K` of K, and only into fp32 (the split adds
# atomically, so such a launch's S / dS, bitwise the same from run to run before, may now differ in the last bits);
# the launch passes it, negated, as its ROW_BUCKET (`small_rows_bucket`), so each split has its key.
# On the H200 (`benchmarks/results/kernels_h200.md`, session 38), a forward + backward of that adapter at r=64 took
# 0.128 -> 0.072 ms (`_grouped_mm`: 0.120), and over 46 points of 1 and 4 adapters a median 0.87x the time (0.42x-1.02x).
SMALL_SPLIT_MIN_K = 256
_MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _ROWS_CONFIGS)


def small_rows_bucket(programs: int, k: int, sms: int, out_fp32: bool) -> int:
    """The ROW_BUCKET of a small row launch: ``-split`` (see above), 0 where it does not split."""
    split = 1
    while out_fp32 and split < _MAX_SPLIT_K and 2 * split * programs <= sms and k >= 2 * split * SMALL_SPLIT_MIN_K:
        split *= 2
    return -split if split > 1 else 0


def _small_rows_tiles(named_args) -> dict:
    """The tiles of a small row launch: the interpreter's, and the K split its ROW_BUCKET names."""
    return dict(DEFAULT_META["rows"], SPLIT_K=max(1, -named_args["ROW_BUCKET"]))


# Added to a tuned row launch's ROW_BUCKET (at most 2**14: `triton_lora._bucket`) where its call is deterministic
# (`triton_lora._Call.deterministic`): its candidates then store only, and keep tuned tiles of their own.
STORES_ONLY = 1 << 15


def _stores_unless_fp32(configs, named_args, **kwargs):
    """The row kernel's candidates for its output: into fp32 any K split (a split adds atomically), unless the launch
    stores only (`STORES_ONLY`); into a half-precision ``OUT`` (``S`` / ``dS`` in the activation dtype:
    `triton_lora.low_rank_dtype`) only those that store."""
    if named_args["OUT"].element_size() == 4 and named_args["ROW_BUCKET"] < STORES_ONLY:
        return configs
    return [c for c in configs if c.kwargs["SPLIT_K"] == 1]


@triton.jit
def _dropout_scale(values, seed, p, tokens, cols, n_cols, row_tokens):
    """``values * keep / (1 - p)`` (fp32), ``keep`` drawn by ``seed`` for the element's (sequence row, position in
    it, column): ``tokens`` count from the adapter's first token, ``row_tokens`` is the (padded) length of a row,
    negative when rows are left-padded (positions then count from the row's end). So an adapter's masks depend
    neither on where its segment lies in the packed buffer nor on the padded length its neighbours set. (A row as
    long as every token: ``rand(seed, token * n_cols + col)``.)"""
    length = tl.abs(row_tokens)
    row = tokens // length
    pos = tokens % length
    pos = tl.where(row_tokens < 0, length - 1 - pos, pos)
    c0 = pos[:, None] * n_cols + cols[None, :]
    zero = c0 * 0
    bits, _, _, _ = tl.philox(seed, c0, row[:, None] + zero, zero, zero)
    keep = tl.uint_to_uniform_float(bits) >= p
    return tl.where(keep, values.to(tl.float32) / (1.0 - p), 0.0)


@_tuned(_ROWS_CONFIGS, key=["K", "BLOCK_M", "BLOCK_R", "W_IS_A", "HAS_DROPOUT", "W_ALIGNED", "DOT_PRECISION",
                             "ROW_BUCKET"],
        reset_to_zero=["OUT"], prune=_stores_unless_fp32, small=_small_rows_tiles)
@triton.jit(do_not_specialize=["R_CHUNKS", "ROW_BUCKET", "ROW_TOKENS"])
def _rows_times_weight(
    # pointers
    IN, W_PTRS, W_WITNESS, OUT, BLK_ADAPTER, BLK_START, SEG_START, SEG_END, RANKS, COEF, DROP_P, SEEDS,
    # sizes (ROW_BUCKET, a bucket of the programs (`triton_lora._bucket`; 0 or -split: a small launch, `tuning_buckets`,
    # `small_rows_bucket`; plus `STORES_ONLY`: a deterministic call's), only keys the tuning: a runtime value, so
    # every bucket shares the compiled kernels)
    K, R_CHUNKS, ROW_BUCKET, ROW_TOKENS,
    # strides
    stride_in_m, stride_out_m,
    # meta-parameters
    W_IS_A: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, W_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
):
    _rows_program(tl.program_id(0) // R_CHUNKS, (tl.program_id(0) % R_CHUNKS) * BLOCK_R, tl.program_id(1), IN, W_PTRS,
                  W_WITNESS, OUT, BLK_ADAPTER, BLK_START, SEG_START, SEG_END, RANKS, COEF, DROP_P, SEEDS, K, ROW_TOKENS,
                  stride_in_m, stride_out_m, W_IS_A, HAS_DROPOUT, DOT_PRECISION, W_ALIGNED, BLOCK_M, BLOCK_K, BLOCK_R,
                  SPLIT_K)


@triton.jit
def _rows_program(pid, r0, split, IN, W_PTRS, W_WITNESS, OUT, BLK_ADAPTER, BLK_START, SEG_START, SEG_END, RANKS, COEF,
                  DROP_P, SEEDS, K, ROW_TOKENS, stride_in_m, stride_out_m, W_IS_A: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, W_ALIGNED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr):
    """`_rows_times_weight`'s program for row block ``pid``, the rank chunk from ``r0`` and K split ``split``."""
    a = tl.load(BLK_ADAPTER + pid)
    r = tl.load(RANKS + a)
    if r0 >= r:  # a chunk past this adapter's rank
        return
    m0 = tl.load(BLK_START + pid)
    end = tl.load(SEG_END + a)
    w = tl.load(W_PTRS + a).to(W_WITNESS.dtype)
    if W_ALIGNED:  # 16-byte weight rows: vector (and asynchronous) loads of the weight tile
        w = tl.multiple_of(w, 16)
        r = tl.multiple_of(r, 8)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask_m = offs_m < end
    mask_r = offs_r < r
    if W_IS_A:  # W = A^T: element (k, j) is A[j, k], A row-major (r, K)
        stride_wk = 1
        stride_wr = K
    else:  # W = B: element (k, j) is B[k, j], B row-major (K, r)
        stride_wk = r
        stride_wr = 1
    # SPLIT_K programs share one row block, each over its own range of K, adding into OUT atomically:
    # few rows (small batches) still give the GPU enough programs to pull the input at full bandwidth.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        x = tl.load(IN + offs_m.to(tl.int64)[:, None] * stride_in_m + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if HAS_DROPOUT:
            x = _dropout_scale(x, tl.load(SEEDS + a), tl.load(DROP_P + a), offs_m - tl.load(SEG_START + a), offs_k,
                               K, ROW_TOKENS).to(x.dtype)
        wt = tl.load(w + offs_k[:, None] * stride_wk + offs_r[None, :] * stride_wr,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc += tl.dot(x, wt.to(x.dtype), input_precision=DOT_PRECISION)
    acc = acc * tl.load(COEF + a)
    out_ptrs = OUT + offs_m.to(tl.int64)[:, None] * stride_out_m + offs_r[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


@triton.jit
def _rank_tile(low, wt, y_cur, R, w, y_ptrs, a, offs_m, mask_m, offs_n, mask_n, r, coef, after, DROP_P, SEEDS,
               SEG_START, ROW_TOKENS, N, stride_r_m, stride_wr, stride_wn, ACCUMULATE: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
               MULTI_CHUNK: tl.constexpr, SCALE_PRODUCT: tl.constexpr, PREFETCH: tl.constexpr):
    """One (BLOCK_M x BLOCK_N) output tile of `_rank_times_weight`: ``low @ wt`` (the first rank chunk, in the dot
    dtype, the scaling in one of them) plus the further chunks, ``after`` (fp16), the dropout mask, ``Y`` added
    (``y_cur``, the tile loaded ahead with ``PREFETCH``), stored."""
    dot_dtype = wt.dtype
    acc = tl.dot(low, wt, input_precision=DOT_PRECISION)
    if MULTI_CHUNK:  # ranks beyond one chunk (compiled only for them: even an empty loop slows the kernel)
        for r0 in range(BLOCK_R, r, BLOCK_R):
            offs_c = r0 + tl.arange(0, BLOCK_R)
            mask_c = offs_c < r
            more = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r_m + offs_c[None, :],
                           mask=mask_m[:, None] & mask_c[None, :], other=0.0)
            wc = tl.load(w + offs_c[:, None] * stride_wr + offs_n[None, :] * stride_wn,
                         mask=mask_c[:, None] & mask_n[None, :], other=0.0)
            acc += tl.dot((more * coef).to(dot_dtype), wc.to(dot_dtype), input_precision=DOT_PRECISION)
    if SCALE_PRODUCT:
        acc = acc * after
    if HAS_DROPOUT:
        acc = _dropout_scale(acc, tl.load(SEEDS + a), tl.load(DROP_P + a), offs_m - tl.load(SEG_START + a), offs_n,
                             N, ROW_TOKENS)
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        if PREFETCH:
            acc += y_cur.to(tl.float32)
        else:
            acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(dot_dtype), mask=mask)


@triton.jit
def _rank_columns(R, w, Y, a, m0, end, r, pid_n, coef, after, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
                  stride_y_m, stride_wr, stride_wn, ACCUMULATE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  MULTI_CHUNK: tl.constexpr, SCALE_PRODUCT: tl.constexpr, N_PER: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """`_rank_times_weight`'s work for one row block and its ``N_PER`` columns, over a rank tile of ``BLOCK_R``."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    dot_dtype = Y.dtype.element_ty
    # The first rank chunk is loaded once, outside every loop, and scaled as a (BLOCK_M, BLOCK_R) tile rather than
    # on the product: with ranks up to one chunk (the usual case) each column block is then a plain streaming
    # read-modify-write of Y (on the H200, a 16384 x 14336 bf16 Y: 253 us, 3.7 TB/s; 304 us with the chunk loop
    # compiled in although it never ran; 331 us with all chunks in the loop and the scaling on the product).
    # A program takes N_PER columns, reusing that tile for all of them (at r=64, 32 x 1024 rows, the fp32 tile re-read
    # per 128 columns was as many L2 bytes as dX's writes), in a loop pipelined over the column blocks.
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < r
    low = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r_m + offs_r[None, :],
                  mask=mask_m[:, None] & mask_r[None, :],
                  other=0.0)
    low = (low * coef).to(dot_dtype)
    n_lo = pid_n * N_PER
    n_hi = tl.minimum(n_lo + N_PER, N)
    # PREFETCH: the compiler pipelines the weight tiles (asynchronous copies, num_stages) but loads the Y tile, which
    # becomes the product's accumulator, when it is needed: each column block waited for its Y. Loading the next
    # block's Y a block ahead, in registers, keeps a read in flight while a block multiplies and stores (on the H200,
    # 32 x 1024 rows at r=64, Y read and written, 8 warps, 3 stages: 179.7 -> 161.5 us at 4096 columns, 594.6 ->
    # 547.2 at 14336, 79-81% of the copy rate against 76-78% for the best candidate without it; one-stage candidates,
    # one block a program, got slower, and do not prefetch). In a forward + backward only the expand reads Y (dX is
    # written fresh): N=32 steps within noise.
    if ACCUMULATE and PREFETCH:  # the first column block's Y tile
        offs_n = n_lo + tl.arange(0, BLOCK_N)
        y_next = tl.load(Y + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :],
                         mask=mask_m[:, None] & (offs_n < n_hi)[None, :], other=0.0)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :]
        y_cur = 0.0
        if ACCUMULATE and PREFETCH:  # this block's Y was loaded a step ago; the next block's goes out now
            y_cur = y_next
            y_next = tl.load(y_ptrs + BLOCK_N, mask=mask_m[:, None] & ((offs_n + BLOCK_N) < n_hi)[None, :], other=0.0)
        wt = tl.load(w + offs_r[:, None] * stride_wr + offs_n[None, :] * stride_wn,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        _rank_tile(low, wt.to(dot_dtype), y_cur, R, w, y_ptrs, a, offs_m, mask_m, offs_n, mask_n, r, coef, after,
                   DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m, stride_wr, stride_wn, ACCUMULATE, HAS_DROPOUT,
                   DOT_PRECISION, BLOCK_R, MULTI_CHUNK, SCALE_PRODUCT, PREFETCH)


@triton.jit
def _rank_rows(R, w, Y, a, m_lo, m_hi, r, n0, coef, after, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
               stride_y_m, stride_wr, stride_wn, ACCUMULATE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
               MULTI_CHUNK: tl.constexpr, SCALE_PRODUCT: tl.constexpr, PREFETCH: tl.constexpr):
    """`_rank_times_weight`'s work (``HOLD_W``) for rows ``[m_lo, m_hi)`` of one adapter and the ``BLOCK_N``
    columns from ``n0``: the first rank chunk's weight tile is loaded once (and scaled, but for fp16's
    ``SCALE_PRODUCT``, which scales each low-rank tile), the rows walked in ``BLOCK_M`` steps, each reading its
    low-rank tile (and, with ``PREFETCH``, the next step's ``Y`` tile ahead)."""
    dot_dtype = Y.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < r
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    wt = tl.load(w + offs_r[:, None] * stride_wr + offs_n[None, :] * stride_wn,
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    if not SCALE_PRODUCT:  # scaled once here; fp16 scales each low-rank tile (an unscaled one may leave fp16's range)
        wt = wt * coef
    wt = wt.to(dot_dtype)
    if ACCUMULATE and PREFETCH:  # the first row block's Y tile
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        y_next = tl.load(Y + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :],
                         mask=(offs_m < m_hi)[:, None] & mask_n[None, :], other=0.0)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_hi
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :]
        y_cur = 0.0
        if ACCUMULATE and PREFETCH:  # this block's Y was loaded a step ago; the next block's goes out now
            y_cur = y_next
            y_next = tl.load(y_ptrs + BLOCK_M * stride_y_m,
                             mask=((offs_m + BLOCK_M) < m_hi)[:, None] & mask_n[None, :], other=0.0)
        low = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r_m + offs_r[None, :],
                      mask=mask_m[:, None] & mask_r[None, :],
                      other=0.0)
        if SCALE_PRODUCT:
            low = low * coef
        # (further rank chunks: their tiles read each step)
        _rank_tile(low.to(dot_dtype), wt, y_cur, R, w, y_ptrs, a, offs_m, mask_m, offs_n, mask_n, r, coef, after,
                   DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m, stride_wr, stride_wn, ACCUMULATE, HAS_DROPOUT,
                   DOT_PRECISION, BLOCK_R, MULTI_CHUNK, SCALE_PRODUCT, PREFETCH)


@triton.jit
def _rank_program(R, w, Y, a, m0, end, r, pid_n, COEF, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
                  stride_y_m, W_IS_A: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  MULTI_CHUNK: tl.constexpr, SCALE_PRODUCT: tl.constexpr, N_PER: tl.constexpr,
                  PREFETCH: tl.constexpr, HOLD_W: tl.constexpr):
    """The weight's strides and the adapter's scaling, then one of the two program shapes (``HOLD_W``)."""
    if W_IS_A:  # W = A: element (j, n) is A[j, n], A row-major (r, N)
        stride_wr = N
        stride_wn = 1
    else:  # W = B^T: element (j, n) is B[n, j], B row-major (N, r)
        stride_wr = 1
        stride_wn = r
    # SCALE_PRODUCT (fp16 outputs): the low-rank tile takes min(s, 1) and the fp32 product max(s, 1), so the fp16
    # tile is never larger than the unscaled or the scaled one (either may leave fp16's range where the result does
    # not)
    coef = tl.load(COEF + a)
    after = 1.0
    if SCALE_PRODUCT:
        after = tl.maximum(coef, 1.0)
        coef = tl.minimum(coef, 1.0)
    if HOLD_W:  # (end: the tall block's)
        _rank_rows(R, w, Y, a, m0, end, r, pid_n * BLOCK_N, coef, after, DROP_P, SEEDS,
                   SEG_START, ROW_TOKENS, N, stride_r_m, stride_y_m, stride_wr, stride_wn, ACCUMULATE, HAS_DROPOUT,
                   DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, MULTI_CHUNK, SCALE_PRODUCT, PREFETCH)
    else:
        _rank_columns(R, w, Y, a, m0, end, r, pid_n, coef, after, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N,
                      stride_r_m, stride_y_m, stride_wr, stride_wn, ACCUMULATE, HAS_DROPOUT, DOT_PRECISION, BLOCK_M,
                      BLOCK_N, BLOCK_R, MULTI_CHUNK, SCALE_PRODUCT, N_PER, PREFETCH)


@_tuned(_RANK_CONFIGS, key=["N", "BLOCK_M", "BLOCK_R", "W_IS_A", "ACCUMULATE", "HAS_DROPOUT", "MULTI_CHUNK",
                            "SCALE_PRODUCT", "W_ALIGNED", "NARROW", "DOT_PRECISION", "ROW_BUCKET", "ROWS_PER"],
        restore_value=["Y"], small=dict(BLOCK_N=64, N_PER=64, HOLD_W=False))
@triton.jit(do_not_specialize=["ROW_BUCKET", "ROW_TOKENS", "BLK_OFFSET", "WIDE_OFFSET", "ROWS_PER"])
def _rank_times_weight(
    # pointers (WIDE_ADAPTER, WIDE_START, WIDE_END: the schedule's tall blocks, the ones HOLD_W walks)
    R, W_PTRS, W_WITNESS, Y, BLK_ADAPTER, BLK_START, WIDE_ADAPTER, WIDE_START, WIDE_END, SEG_START, SEG_END, RANKS,
    COEF, DROP_P, SEEDS,
    # sizes (ROW_BUCKET, a bucket of the row blocks (0: a small launch, `tuning_buckets`), only keys the tuning: how
    # many columns a program should take depends on how many row blocks there are to fill the GPU with)
    N, ROW_BUCKET, ROW_TOKENS,
    BLK_OFFSET,  # the launch's first row block (a launch per class of ranks: `triton_lora.rank_classes`)
    WIDE_OFFSET,  # its first tall block
    ROWS_PER,  # the launch's tallest block (only keys the tuning, as ROW_BUCKET does; 0 with it)
    # strides
    stride_r_m, stride_y_m,
    # meta-parameters
    W_IS_A: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, MULTI_CHUNK: tl.constexpr,
    SCALE_PRODUCT: tl.constexpr, W_ALIGNED: tl.constexpr, N_PER: tl.constexpr, NARROW: tl.constexpr,
    PREFETCH: tl.constexpr, HOLD_W: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if HOLD_W:
        pid = tl.program_id(0) + WIDE_OFFSET
        a = tl.load(WIDE_ADAPTER + pid)
        m0 = tl.load(WIDE_START + pid)
        end = tl.load(WIDE_END + pid)
    else:
        pid = tl.program_id(0) + BLK_OFFSET
        a = tl.load(BLK_ADAPTER + pid)
        m0 = tl.load(BLK_START + pid)
        end = tl.load(SEG_END + a)
    r = tl.load(RANKS + a)
    w = tl.load(W_PTRS + a).to(W_WITNESS.dtype)
    if W_ALIGNED:  # 16-byte weight rows: vector loads of the weight tile
        w = tl.multiple_of(w, 16)
        r = tl.multiple_of(r, 8)
    # NARROW: an adapter whose rank fits a quarter (half) of the tile runs a tile of that width (see the module text);
    # the widths a launch does not compile are constexpr-false conditions, dropped with their calls
    if NARROW >= 2 and r <= BLOCK_R // 4:
        _rank_program(R, w, Y, a, m0, end, r, pid_n, COEF, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
                      stride_y_m, W_IS_A, ACCUMULATE, HAS_DROPOUT, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R // 4, False,
                      SCALE_PRODUCT, N_PER, PREFETCH, HOLD_W)
    elif NARROW >= 1 and r <= BLOCK_R // 2:
        _rank_program(R, w, Y, a, m0, end, r, pid_n, COEF, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
                      stride_y_m, W_IS_A, ACCUMULATE, HAS_DROPOUT, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R // 2, False,
                      SCALE_PRODUCT, N_PER, PREFETCH, HOLD_W)
    else:
        _rank_program(R, w, Y, a, m0, end, r, pid_n, COEF, DROP_P, SEEDS, SEG_START, ROW_TOKENS, N, stride_r_m,
                      stride_y_m, W_IS_A, ACCUMULATE, HAS_DROPOUT, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R,
                      MULTI_CHUNK, SCALE_PRODUCT, N_PER, PREFETCH, HOLD_W)


@_tuned(_GRAD_CONFIGS, key=["K", "BLOCK_R", "G_IS_A", "ATOMIC", "ADD_TO_G", "HAS_DROPOUT", "G_ALIGNED", "WITH_DS",
                             "W_ALIGNED", "TRANS_ACC", "DOT_PRECISION", "ROW_BUCKET", "TOKEN_BUCKET"],
        small=DEFAULT_META["grad"])
@triton.jit(do_not_specialize=["R_CHUNKS", "SPLIT_T", "ROW_BUCKET", "TOKEN_BUCKET", "ROW_TOKENS"])
def _weight_grad(
    # pointers (W_PTRS, W_WITNESS, DS: the B_i and dS of WITH_DS)
    L, M, G_PTRS, G_WITNESS, SEG_START, SEG_END, ORDER, RANKS, COEF, DROP_P, SEEDS, W_PTRS, W_WITNESS, DS,
    # sizes (SPLIT_T, the programs sharing one adapter's rows, is a runtime value: a run whose adapter set
    # shrinks meets several, and each would otherwise compile every tuning candidate again; ROW_BUCKET and
    # TOKEN_BUCKET, buckets of the row blocks and of the largest adapter's rows (both 0 for a small launch:
    # `tuning_buckets`), only key the tuning, so
    # that a layout of other row counts, or mixed ones, takes tiles tuned for it and not the first layout's: on the
    # H200, N=32 with 64..2048 tokens an adapter, a forward + backward with tiles tuned on 32 x 256 tokens took
    # 1.005-1.22x (median 1.03x) the time with tiles tuned on its own layout)
    K, R_CHUNKS, SPLIT_T, ROW_BUCKET, TOKEN_BUCKET, ROW_TOKENS,
    # strides
    stride_l_m, stride_m_m, stride_ds_m,
    # meta-parameters (ATOMIC: SPLIT_T > 1; ADD_TO_G: G holds gradients to add to, else it is stored)
    G_IS_A: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC: tl.constexpr, ADD_TO_G: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    G_ALIGNED: tl.constexpr, WITH_DS: tl.constexpr, W_ALIGNED: tl.constexpr, TRANS_ACC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # grid (K blocks x SPLIT_T, adapters x R_CHUNKS): the programs of one adapter's rank chunk are adjacent, and the
    # adapters come in ORDER (most rows first), so that the longest programs start first
    k_blocks = tl.cdiv(K, BLOCK_K)
    _grad_program(tl.program_id(0) % k_blocks, tl.program_id(0) // k_blocks, tl.program_id(1), L, M, G_PTRS, G_WITNESS,
                  SEG_START, SEG_END, ORDER, RANKS, COEF, DROP_P, SEEDS, W_PTRS, W_WITNESS, DS, K, R_CHUNKS, SPLIT_T,
                  ROW_TOKENS, stride_l_m, stride_m_m, stride_ds_m, G_IS_A, HAS_DROPOUT, ATOMIC, ADD_TO_G, DOT_PRECISION,
                  G_ALIGNED, WITH_DS, W_ALIGNED, TRANS_ACC, BLOCK_T, BLOCK_K, BLOCK_R)


@triton.jit
def _grad_program(pid_k, split, slot, L, M, G_PTRS, G_WITNESS, SEG_START, SEG_END, ORDER, RANKS, COEF, DROP_P, SEEDS,
                  W_PTRS, W_WITNESS, DS, K, R_CHUNKS, SPLIT_T, ROW_TOKENS, stride_l_m, stride_m_m, stride_ds_m,
                  G_IS_A: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC: tl.constexpr, ADD_TO_G: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, G_ALIGNED: tl.constexpr, WITH_DS: tl.constexpr,
                  W_ALIGNED: tl.constexpr, TRANS_ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """`_weight_grad`'s program for K block ``pid_k``, row split ``split`` and ``slot`` (the adapter ``ORDER[slot //
    R_CHUNKS]``, its rank chunk ``slot % R_CHUNKS``)."""
    a = tl.load(ORDER + slot // R_CHUNKS)
    r0 = (slot % R_CHUNKS) * BLOCK_R
    r = tl.load(RANKS + a)
    if r0 >= r:  # a chunk past this adapter's rank
        return
    start = tl.load(SEG_START + a)
    end = tl.load(SEG_END + a)
    g = tl.load(G_PTRS + a).to(G_WITNESS.dtype)  # this adapter's own gradient tensor
    if G_ALIGNED:  # 16-byte gradient rows: vector stores (and atomics)
        g = tl.multiple_of(g, 16)
        r = tl.multiple_of(r, 8)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask_k = offs_k < K
    mask_r = offs_r < r
    if WITH_DS:  # this program's (BLOCK_K, BLOCK_R) tile of B_i (row-major (K, r)), read once
        w = tl.load(W_PTRS + a).to(W_WITNESS.dtype)
        if W_ALIGNED:
            w = tl.multiple_of(w, 16)
        wt = tl.load(w + offs_k[:, None] * r + offs_r[None, :], mask=mask_k[:, None] & mask_r[None, :], other=0.0)
    if TRANS_ACC:  # G^T = M^T L, a (BLOCK_K, BLOCK_R) accumulator (see the module text)
        acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    # SPLIT_T programs share one adapter's rows, interleaved by BLOCK_T, and add into G atomically.
    for t0 in range(start + split * BLOCK_T, end, BLOCK_T * SPLIT_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < end
        low = tl.load(L + offs_t.to(tl.int64)[:, None] * stride_l_m + offs_r[None, :],
                      mask=mask_t[:, None] & mask_r[None, :],
                      other=0.0)
        full = tl.load(M + offs_t.to(tl.int64)[:, None] * stride_m_m + offs_k[None, :],
                       mask=mask_t[:, None] & mask_k[None, :],
                       other=0.0)
        if HAS_DROPOUT:
            full = _dropout_scale(full, tl.load(SEEDS + a), tl.load(DROP_P + a), offs_t - start, offs_k,
                                  K, ROW_TOKENS).to(full.dtype)
        if TRANS_ACC:
            acc += tl.dot(tl.trans(full), low.to(full.dtype), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(tl.trans(low.to(full.dtype)), full, input_precision=DOT_PRECISION)
        if WITH_DS:  # dS_i[t, :] += dY[t, k-block] B_i[k-block, :], from the dY tile already loaded
            part = tl.dot(full, wt.to(full.dtype), input_precision=DOT_PRECISION)
            tl.atomic_add(DS + offs_t.to(tl.int64)[:, None] * stride_ds_m + offs_r[None, :], part,
                          mask=mask_t[:, None] & mask_r[None, :])
    acc = acc * tl.load(COEF + a)
    # G = dA (r, K) or dB (K, r), row-major, stored from the accumulator's layout
    if not TRANS_ACC:  # acc[j, k] (rank j, column k)
        off_rk = offs_r[:, None]
        off_kk = offs_k[None, :]
        mask = mask_r[:, None] & mask_k[None, :]
    else:  # acc[k, j]
        off_rk = offs_r[None, :]
        off_kk = offs_k[:, None]
        mask = mask_k[:, None] & mask_r[None, :]
    if G_IS_A:
        g_ptrs = g + off_rk * K + off_kk
    else:
        g_ptrs = g + off_kk * r + off_rk
    if not ATOMIC:
        if ADD_TO_G:
            acc += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(g_ptrs, acc.to(G_WITNESS.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(g_ptrs, acc.to(G_WITNESS.dtype.element_ty), mask=mask)


# The dS + dB launch (`_ds_and_db`): the row kernel's tile over K and the weight-gradient kernel's over rows, warps and
# stages shared, and the order of the programs (INTERLEAVE), tuned together; the dB programs' K tile is the launch's
# (DS_DB_GRAD_BLOCK_K: the interleaved table is built for it). On the H200 (`benchmarks/ds_db_one_launch.py`, 32
# adapters, fixed tiles), against the two launches: 4096-wide dY, 1024 tokens, ranks 8..128 184 -> 169 us, r=64 172
# -> 143 (interleaved); 256 tokens 78 -> 68 (apart); 14336-wide, 1024 tokens 617 -> 616, 256 tokens 225 -> 212 (apart).
DS_DB_GRAD_BLOCK_K = 128
_DS_DB_TILES = ((64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 32, 4, 3))
# Taller dS blocks (`triton_lora.DS_DB_BLOCK_M` over 64), wider dB blocks (`DS_DB_GRAD_BLOCK_K` over 128) or dB rank
# chunks of 128 (`triton_lora.DS_DB_GRAD_MAX_TILE`) take these too, interleaved: fewer bytes a stage (at 128 rows the
# tiles above take 98-197 KB of shared memory, one or two programs an SM), and 8 warps only where an accumulator is
# (K, 128) fp32 (4 warps spill it: sm_90a compile, session 30). (`benchmarks/ds_db_one_launch.py --grad-block-r 128`
# found its best at 128 rows, 256 columns, 128-wide chunks with (128, 64, 8 warps, 3 stages) from the list above.)
_DS_DB_WIDE_TILES = ((32, 64, 8, 3), (32, 32, 4, 3), (64, 32, 8, 3), (32, 64, 8, 4), (64, 64, 8, 3))
_DS_DB_CONFIGS = [triton.Config({"ROWS_BLOCK_K": rk, "GRAD_BLOCK_T": gt, "INTERLEAVE": il}, num_warps=w, num_stages=st)
                  for tiles in (_DS_DB_TILES, _DS_DB_WIDE_TILES) for rk, gt, w, st in tiles
                  for il in (True, False)]


def _ds_db_candidates(configs, named_args, **kwargs):
    """The dS + dB launch's candidates for its block sizes: `_DS_DB_TILES` at 64 rows, 128 columns and rank chunks
    up to 64 (both orders); otherwise these and `_DS_DB_WIDE_TILES`, interleaved (8 warps for 128-wide rank chunks)."""
    wide = kwargs["BLOCK_M"] > 64 or kwargs["GRAD_BLOCK_K"] > 128 or kwargs["GRAD_BLOCK_R"] > 64
    if not wide:
        return [c for c in configs if (c.kwargs["ROWS_BLOCK_K"], c.kwargs["GRAD_BLOCK_T"], c.num_warps, c.num_stages)
                in _DS_DB_TILES]
    return [c for c in configs if c.kwargs["INTERLEAVE"] and (kwargs["GRAD_BLOCK_R"] <= 64 or c.num_warps == 8)]


@_tuned(_DS_DB_CONFIGS, key=["K", "ROWS_BLOCK_R", "GRAD_BLOCK_R", "ADD_TO_G", "W_ALIGNED", "G_ALIGNED", "TRANS_ACC",
                             "DOT_PRECISION", "ROW_BUCKET", "TOKEN_BUCKET", "BLOCK_M", "GRAD_BLOCK_K"],
        prune=_ds_db_candidates, small=DEFAULT_META["ds_db"])
@triton.jit(do_not_specialize=["N_DS", "ROWS_R_CHUNKS", "GRAD_R_CHUNKS", "ROW_BUCKET", "TOKEN_BUCKET", "ROW_TOKENS"])
def _ds_and_db(
    # pointers (PROGS: the interleaved order's program table; B_PTRS: the B_i, read by dS; G_PTRS: the dB_i)
    PROGS, DY, B_PTRS, B_WITNESS, DS, S, G_PTRS, G_WITNESS, BLK_ADAPTER, BLK_START, SEG_START, SEG_END, ORDER, RANKS,
    ONES, COEF, DROP_P, SEEDS,
    # sizes (N_DS: the dS programs, row blocks x ROWS_R_CHUNKS; ROW_BUCKET, TOKEN_BUCKET only key the tuning: 0 for a
    # small launch, `tuning_buckets`)
    K, N_DS, ROWS_R_CHUNKS, GRAD_R_CHUNKS, ROW_BUCKET, TOKEN_BUCKET, ROW_TOKENS,
    # strides
    stride_dy_m, stride_ds_m, stride_s_m,
    # meta-parameters
    DOT_PRECISION: tl.constexpr, W_ALIGNED: tl.constexpr, G_ALIGNED: tl.constexpr, ADD_TO_G: tl.constexpr,
    TRANS_ACC: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_BLOCK_R: tl.constexpr, GRAD_BLOCK_K: tl.constexpr,
    GRAD_BLOCK_R: tl.constexpr, ROWS_BLOCK_K: tl.constexpr, GRAD_BLOCK_T: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """``dS = dY B`` (the row kernel's programs, each storing its rows' dS: one program per row block and rank chunk)
    and ``dB_i (+)= s_i dY_i^T S_i`` (the weight-gradient kernel's, one per K block and (adapter, rank chunk) slot of
    ``ORDER``, no row split) in one launch. A program's code: ``c >= 0`` is dS program ``c``, ``c < 0`` dB program
    ``-c - 1`` (its slot times the K blocks, plus its K block). ``INTERLEAVE``: the codes come from ``PROGS``, each
    adapter's dS and dB programs side by side (`triton_lora.ds_db_table`), so that the few adapters in flight read
    their dY tiles from L2 the second time; otherwise every dS program first, then every dB program (the two
    launches' orders, with no gap between them)."""
    pid = tl.program_id(0)
    if INTERLEAVE:
        code = tl.load(PROGS + pid)
    else:
        code = tl.where(pid < N_DS, pid, N_DS - 1 - pid)
    if code >= 0:
        _rows_program(code // ROWS_R_CHUNKS, (code % ROWS_R_CHUNKS) * ROWS_BLOCK_R, 0, DY, B_PTRS, B_WITNESS, DS,
                      BLK_ADAPTER, BLK_START, SEG_START, SEG_END, RANKS, ONES, DROP_P, SEEDS, K, ROW_TOKENS,
                      stride_dy_m, stride_ds_m, False, False, DOT_PRECISION, W_ALIGNED, BLOCK_M, ROWS_BLOCK_K,
                      ROWS_BLOCK_R, 1)
    else:
        q = -code - 1
        k_blocks = tl.cdiv(K, GRAD_BLOCK_K)
        _grad_program(q % k_blocks, 0, q // k_blocks, S, DY, G_PTRS, G_WITNESS, SEG_START, SEG_END, ORDER, RANKS, COEF,
                      DROP_P, SEEDS, B_PTRS, B_WITNESS, DS, K, GRAD_R_CHUNKS, 1, ROW_TOKENS, stride_s_m, stride_dy_m,
                      stride_ds_m, False, False, False, ADD_TO_G, DOT_PRECISION, G_ALIGNED, False, False, TRANS_ACC,
                      GRAD_BLOCK_T, GRAD_BLOCK_K, GRAD_BLOCK_R)


# One launch copies every A_i and B_i into their activation-dtype copies (`triton_lora.WeightCopies`): program
# (t, j) takes elements [j * BLOCK * PER, (j + 1) * BLOCK * PER) of A_t (t < N) or B_(t-N) (the tensors on the
# grid's first axis: a second one holds at most 65535). Fixed tiles, the best of five on the H200 at 4096x4096:
# r=64 31 us (torch._foreach_copy_ 37), r=16 17 us (22); 4096x14336 r=64 60 us (73).
COPY_META = dict(BLOCK=4096, PER=2, num_warps=8)


@triton.jit(do_not_specialize=["N"])  # (the adapter count: a set that shrinks to one adapter compiles nothing new)
def _copy_weights(A_SRC, B_SRC, A_DST, B_DST, RANKS, SRC_WITNESS, DST_WITNESS, N, D_IN, D_OUT,
                  ALIGNED: tl.constexpr, BLOCK: tl.constexpr, PER: tl.constexpr):
    t = tl.program_id(0)
    is_a = t < N
    i = tl.where(is_a, t, t - N)
    size = tl.load(RANKS + i) * tl.where(is_a, D_IN, D_OUT)
    start = tl.program_id(1) * (BLOCK * PER)
    if start >= size:
        return
    src = tl.where(is_a, tl.load(A_SRC + i), tl.load(B_SRC + i)).to(SRC_WITNESS.dtype)
    dst = tl.where(is_a, tl.load(A_DST + i), tl.load(B_DST + i)).to(DST_WITNESS.dtype)
    if ALIGNED:  # every A_i, B_i and copy starts on a 16-byte boundary
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    for j in tl.static_range(PER):
        offs = start + j * BLOCK + tl.arange(0, BLOCK)
        mask = offs < size
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(DST_WITNESS.dtype.element_ty), mask=mask)


# Each adapter's dropout seed at a call, from its stream (`weights.DropoutStreams`, `weights.stream_seeds`): one tiny
# launch per call with dropout, in place of a draw from torch's random state.
SEEDS_BLOCK = 128


@triton.jit(do_not_specialize=["N"])
def _stream_seeds(SEEDS, SLOTS, STEPS, OUT, N, STEP_MIX, SEED_MOD, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    seed = tl.load(SEEDS + offs, mask=mask, other=0).to(tl.int64)
    step = tl.load(STEPS + tl.load(SLOTS + offs, mask=mask, other=0), mask=mask, other=0).to(tl.int64)
    tl.store(OUT + offs, ((seed + step * STEP_MIX) % SEED_MOD).to(tl.int32), mask=mask)
