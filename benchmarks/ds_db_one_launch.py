"""dS and dB from one launch whose programs share dY in L2, against the two launches of today's backward.

Run on the H200 (a few minutes, most of them compiling):

    PYTHONPATH=. python benchmarks/ds_db_one_launch.py --out benchmarks/results/ds_db_one_launch_h200.json

Above rank tiles of 16 the backward reads dY twice: the dS row launch (`_rows_times_weight`, ``dS = dY B``) and the
dB launch (`_weight_grad`, ``dB_i += s_i dY_i^T S_i``). The floor of `benchmarks/kernels.py` counts dY once; the
second pass is 15% of it (`benchmarks/results/kernels_h200.md`, session 28). Folding dS into the dB launch (its
``WITH_DS``) adds dS atomically, which was 2-4x slower there. This probe tries the other way: one launch whose
program table lists, adapter by adapter, the dS programs of the adapter's row blocks and the dB programs of its
column blocks side by side (`triton_kernels._ds_and_db`, each program running one of the two kernels' own bodies,
in the order of `triton_lora.ds_db_table`), so that the adapters in flight are few and each dY tile the first reader
brings in is still in L2 for the second. ``apart`` runs the same kernel with every dS program first (the two launches
in one); ``two_launches`` is the pair the backward makes without `triton_lora.DS_DB_ONE_LAUNCH`; at rank tiles up to
`triton_lora.FUSED_DS_MAX_TILE` (``--ranks 16``) also ``fused_with_ds``, the dB launch adding dS atomically into a
zeroed fp32 one, which those tiles take today (the zeroing timed with it). (The results of
session 28 came from this probe's own copy of the kernel, at commit 7e79159, with dB K tiles of 64 or 128.) Every
variant's dS and dB are checked against the two launches'. ``--block-m 64 128``: the one launch also with dS programs
over taller row blocks (``interleaved_m128``, ``apart_m128``: each adapter's weights re-read from L2 per 128 rows,
not 64), with tiles of fewer bytes a stage beside the tuner's; ``--grad-block-k 128 256``: dB programs over 256
columns (``_k256``: S re-read from L2 per 256 columns, not 128). Times are `triton.testing.do_bench` medians (L2 flushed
before each run), fixed tiles each (no autotuning: the best of a few per variant).
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import datetime, timezone
from types import SimpleNamespace

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.testing import do_bench

from lightning_multilora.kernels import LoRAWeights
from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels import triton_lora as T


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--ranks", nargs="+", default=["mixed", "64", "128"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--d-out", type=int, nargs="+", default=[4096, 14336])
    parser.add_argument("--out", default="benchmarks/results/ds_db_one_launch_h200.json")
    parser.add_argument("--quick", action="store_true", help="two tiles per variant (the tuner's usual picks)")
    parser.add_argument("--grad-block-k", type=int, nargs="+", default=[128],
                        help="columns of the dB programs' K blocks in the one launch (the package's: "
                             "triton_kernels.DS_DB_GRAD_BLOCK_K); wider ones re-read S from L2 fewer times")
    parser.add_argument("--block-m", type=int, nargs="+", default=[64],
                        help="rows of the dS programs' blocks (the schedule's BLOCK_M) for the one launch; heights "
                             "other than the package's also take tiles with fewer bytes a stage")
    parser.add_argument("--grad-block-r", type=int, nargs="+", default=[],
                        help="also dB programs over rank chunks this wide in the one launch (the package's: "
                             "triton_lora.GRAD_MAX_TILE, 64; at r=128 two chunks a slot read each dY tile twice)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ds_db_one_launch.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    rows = []
    common = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.now(timezone.utc).date().isoformat(), n_adapters=args.n)
    for d_out in args.d_out:
        for kind in args.ranks:
            for tokens in args.tokens:
                rows += point(d_out, kind, tokens, args.n, device, common, quick=args.quick,
                              block_ms=args.block_m, grad_block_ks=args.grad_block_k,
                              grad_block_rs=args.grad_block_r)
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


def _plain(kernel):
    """The kernel without its autotuner (the interpreter's kernels have none)."""
    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def layout(kind: str, tokens: int, n: int) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """Ranks (``kind``: a rank, or ``mixed``: 8..128 drawn from a fixed seed) and the segments of ``n`` adapters
    of ``tokens`` rows each."""
    rng = random.Random(0)
    ranks = [rng.choice([8, 16, 24, 32, 48, 64, 96, 128]) for _ in range(n)] if kind == "mixed" else [int(kind)] * n
    return ranks, tuple(i * tokens for i in range(n)), tuple((i + 1) * tokens for i in range(n))


def grad_problem(kind: str, tokens: int, n: int, width: int, device, dtype: torch.dtype, of_a: bool):
    """One weight-gradient launch's setup: ``n`` adapters (`layout`), random bf16 shadows of the weight whose
    gradient is taken (A_i (r, width) where ``of_a``, else B_i (width, r)) and placeholders of the other, the
    pointer table and schedule, zeroed fp32 gradients in that weight's layout and their pointers."""
    ranks, starts, ends = layout(kind, tokens, n)
    shape = (lambda r: (r, width)) if of_a else (lambda r: (width, r))
    other = (lambda r: (16, r)) if of_a else (lambda r: (r, 16))
    full = tuple((torch.randn(shape(r), device=device) * 0.02).to(dtype) for r in ranks)
    empty = tuple(torch.zeros(other(r), device=device, dtype=dtype) for r in ranks)  # (unused: the table's other)
    a, b = (full, empty) if of_a else (empty, full)
    w = LoRAWeights(a, b, tuple(2.0 for _ in ranks), tuple(0.0 for _ in ranks), starts, ends)
    T.reset_rank_tiles()
    table = T.pointer_table(w, device)
    grads = [torch.zeros(shape(r), device=device) for r in ranks]
    return SimpleNamespace(ranks=ranks, starts=starts, ends=ends, rows=n * tokens, a=a, b=b, table=table,
                           sched=T.schedule(starts, ends, n * tokens, device, tuple(ranks)), grads=grads,
                           g_ptrs=torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64, device=device),
                           aligned=all(r % 8 == 0 for r in ranks))


def point(d_out: int, kind: str, tokens: int, n: int, device, common: dict, dtype: torch.dtype = torch.bfloat16,
          bench: bool = True, quick: bool = False, block_ms: tuple[int, ...] = (64,),
          grad_block_ks: tuple[int, ...] = (128,), grad_block_rs: tuple[int, ...] = ()) -> list[dict]:
    """Every variant at one point: rows of its time and its dS / dB error against the first variant's. The one
    launch at each of ``block_ms`` (the dS programs' rows) and ``grad_block_ks`` (the dB programs' columns)."""
    p = grad_problem(kind, tokens, n, d_out, device, dtype, of_a=False)  # (B_i: the bf16 shadows)
    ranks, starts, ends, rows_total, b, table, sched = p.ranks, p.starts, p.ends, p.rows, p.b, p.table, p.sched
    grads, g_ptrs, w_aligned = p.grads, p.g_ptrs, p.aligned
    dy = torch.randn(rows_total, d_out, device=device, dtype=dtype)
    s = torch.randn(rows_total, table.width, device=device, dtype=dtype)
    ds = torch.empty(rows_total, table.width, device=device, dtype=dtype)
    grad_r, grad_chunks = T._grad_chunks(table.block_r, table.width)
    trans = grad_r >= T.GRAD_TRANSPOSE_MIN_TILE
    dtype_bytes = rows_total * d_out * dy.element_size()
    label = dict(d_out=d_out, ranks=kind, tokens=tokens, dy_mb=round(dtype_bytes / 2**20, 1), **common)

    def two_launches(rk, rw, rs, gk, gt, gw, gs):
        def run():
            _plain(K._rows_times_weight)[(sched.num_blocks * table.r_chunks, 1)](
                dy, table.b_ptrs, b[0], ds, sched.blk_adapter, sched.blk_start, sched.seg_start, sched.seg_end,
                table.ranks, table.ones, table.drop_p, table.ranks, d_out, table.r_chunks, 1, 1 << 30, dy.stride(0),
                ds.stride(0), W_IS_A=False, HAS_DROPOUT=False, DOT_PRECISION="ieee", W_ALIGNED=w_aligned,
                BLOCK_M=T.BLOCK_M, BLOCK_R=table.block_r, BLOCK_K=rk, SPLIT_K=1, num_warps=rw, num_stages=rs)
            _plain(K._weight_grad)[(triton.cdiv(d_out, gk), n * grad_chunks)](
                s, dy, g_ptrs, grads[0], sched.seg_start, sched.seg_end, sched.grad_order, table.ranks, table.scaling,
                table.drop_p, table.ranks, g_ptrs, grads[0], ds, d_out, grad_chunks, 1, 1, 1, 1 << 30, s.stride(0),
                dy.stride(0), 0, G_IS_A=False, HAS_DROPOUT=False, ATOMIC=False, ADD_TO_G=True, DOT_PRECISION="ieee",
                G_ALIGNED=w_aligned, WITH_DS=False, W_ALIGNED=False, TRANS_ACC=trans, BLOCK_T=gt, BLOCK_K=gk,
                BLOCK_R=grad_r, num_warps=gw, num_stages=gs)
        return run

    def one_launch(interleave, rk, gk, gt, nw, st, block_m=T.BLOCK_M, grad_tile=T.GRAD_MAX_TILE):
        package_block_m, package_tile = T.BLOCK_M, T.GRAD_MAX_TILE
        T.BLOCK_M = block_m  # (the schedule's blocks, and so the program table, at this height)
        T.GRAD_MAX_TILE = grad_tile  # (the dB programs' rank chunks, and so the table's dB codes)
        try:
            at = T.schedule(starts, ends, rows_total, device, tuple(ranks))
            progs = T.ds_db_table(at, table, d_out, device, gk)
            grad_r, grad_chunks = T._grad_chunks(table.block_r, table.width)
        finally:
            T.BLOCK_M, T.GRAD_MAX_TILE = package_block_m, package_tile
        trans = grad_r >= T.GRAD_TRANSPOSE_MIN_TILE
        n_ds = at.num_blocks * table.r_chunks

        def run():
            _plain(K._ds_and_db)[(progs.numel(),)](
                progs, dy, table.b_ptrs, b[0], ds, s, g_ptrs, grads[0], at.blk_adapter, at.blk_start,
                at.seg_start, at.seg_end, at.grad_order, table.ranks, table.ones, table.scaling, table.drop_p,
                table.ranks, d_out, n_ds, table.r_chunks, grad_chunks, 1, 1, 1 << 30, dy.stride(0), ds.stride(0),
                s.stride(0), DOT_PRECISION="ieee", W_ALIGNED=w_aligned, G_ALIGNED=w_aligned, ADD_TO_G=True,
                TRANS_ACC=trans, BLOCK_M=block_m, ROWS_BLOCK_R=table.block_r, GRAD_BLOCK_K=gk, GRAD_BLOCK_R=grad_r,
                ROWS_BLOCK_K=rk, GRAD_BLOCK_T=gt, INTERLEAVE=interleave, num_warps=nw, num_stages=st)
        return run

    ds32 = torch.zeros(rows_total, table.width, device=device)  # (the fused launch adds dS into a zeroed fp32 one)

    def fused(gk, gt, gw, gs):  # what rank tiles up to FUSED_DS_MAX_TILE take today: dB adding dS atomically
        def run():
            ds32.zero_()
            _plain(K._weight_grad)[(triton.cdiv(d_out, gk), n * grad_chunks)](
                s, dy, g_ptrs, grads[0], sched.seg_start, sched.seg_end, sched.grad_order, table.ranks, table.scaling,
                table.drop_p, table.ranks, table.b_ptrs, b[0], ds32, d_out, grad_chunks, 1, 1, 1, 1 << 30,
                s.stride(0), dy.stride(0), ds32.stride(0), G_IS_A=False, HAS_DROPOUT=False, ATOMIC=False,
                ADD_TO_G=True, DOT_PRECISION="ieee", G_ALIGNED=w_aligned, WITH_DS=True, W_ALIGNED=w_aligned,
                TRANS_ACC=trans, BLOCK_T=gt, BLOCK_K=gk, BLOCK_R=grad_r, num_warps=gw, num_stages=gs)
        return run

    def result(run, out):
        for g in grads:
            g.zero_()
        out.fill_(float("nan"))
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out.clone(), [g.clone() for g in grads]

    variants = {}
    for rk, rw, rs in ((64, 4, 4), (128, 8, 3))[:1 if quick else 2]:
        for gk, gt, gw, gs in ((128, 64, 4, 3), (64, 64, 4, 3), (256, 32, 4, 3))[:2 if quick else 3]:
            variants[("two_launches", rk, gk, gt, f"rows {rw}w{rs}s grad {gw}w{gs}s")] = \
                two_launches(rk, rw, rs, gk, gt, gw, gs), ds
    if table.block_r <= T.FUSED_DS_MAX_TILE:
        for gk, gt, gw, gs in ((256, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3))[:2 if quick else 3]:
            variants[("fused_with_ds", 0, gk, gt, f"{gw}w{gs}s")] = fused(gk, gt, gw, gs), ds32
    grad_tiles = sorted({grad_r} | {min(table.block_r, t) for t in grad_block_rs})
    for block_m in block_ms:
        for gk in grad_block_ks:
            for grad_tile in grad_tiles:
                package = (block_m, gk, grad_tile) == (T.BLOCK_M, K.DS_DB_GRAD_BLOCK_K, grad_r)
                tiles = ((64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 32, 4, 3))[:2 if quick else 4]
                if not package:  # (taller or wider tiles: fewer bytes a stage, more warps: 2-3 an SM)
                    tiles += ((32, 64, 8, 3), (32, 32, 4, 3), (64, 32, 8, 3), (32, 64, 8, 4))
                if grad_tile > T.GRAD_MAX_TILE:  # (a (K, 128) fp32 accumulator: 8 warps, or it spills)
                    tiles = tuple(t for t in tiles if t[2] == 8) + ((64, 64, 8, 3),)
                for interleave in (True, False) if package else (True,):  # (apart: the package's tiles only)
                    for rk, gt, nw, st in tiles:
                        name = (("interleaved" if interleave else "apart")
                                + ("" if block_m == T.BLOCK_M else f"_m{block_m}")
                                + ("" if gk == K.DS_DB_GRAD_BLOCK_K else f"_k{gk}")
                                + ("" if grad_tile == grad_r else f"_r{grad_tile}"))
                        variants[(name, rk, gk, gt, f"{nw}w{st}s")] = \
                            one_launch(interleave, rk, gk, gt, nw, st, block_m, grad_tile), ds
    valid = torch.zeros_like(ds, dtype=torch.bool)  # dS holds each adapter's first r_i columns of its rows
    for st, en, r in zip(starts, ends, ranks):
        valid[st:en, :r] = True
    reference = None
    out = []
    for (name, rk, gk, gt, launch), (run, out_ds) in variants.items():
        try:
            got_ds, got_g = result(run, out_ds)
        except Exception as err:  # noqa: BLE001 - a tile that does not fit: reported, not fatal
            print(f"{name} {rk} {gk} {gt} {launch}: {type(err).__name__}: {str(err)[:160]}", flush=True)
            continue
        got_ds = torch.where(valid, got_ds.float(), 0)
        if reference is None:
            reference = got_ds, got_g
        err_ds = ((got_ds.float() - reference[0].float()).abs().max() / reference[0].float().abs().max()).item()
        err_db = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got_g, reference[1]))
        us = do_bench(run, warmup=25, rep=200) * 1000 if bench else float("nan")
        row = dict(variant=name, rows_block_k=rk, grad_block_k=gk, grad_block_t=gt, launch=launch, us=round(us, 2),
                   dy_once_tbps=round(dtype_bytes / (us * 1e-6) / 1e12, 3), err_ds=err_ds, err_db=err_db, **label)
        out.append(row)
        print(json.dumps({k: row[k] for k in ("d_out", "ranks", "tokens", "variant", "rows_block_k", "grad_block_k",
                                              "grad_block_t", "launch", "us", "err_ds", "err_db")}), flush=True)
    best = {}
    for row in out:
        if row["variant"] not in best or row["us"] < best[row["variant"]]["us"]:
            best[row["variant"]] = row
    print(f"d_out={d_out} ranks={kind} tokens={tokens}: " +
          ", ".join(f"{k} {v['us']:.1f} us" for k, v in best.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
