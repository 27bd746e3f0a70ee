"""dS and dB from one launch whose programs share dY in L2, against the two launches of today's backward.

Run on the H200 (a few minutes, most of them compiling):

    PYTHONPATH=. python benchmarks/ds_db_one_launch.py --out benchmarks/results/ds_db_one_launch_h200.json

Above rank tiles of 16 the backward reads dY twice: the dS row launch (`_rows_times_weight`, ``dS = dY B``) and the
dB launch (`_weight_grad`, ``dB_i += s_i dY_i^T S_i``). The floor of `benchmarks/kernels.py` counts dY once; the
second pass is 15% of it (`benchmarks/results/kernels_h200.md`, session 28). Folding dS into the dB launch (its
``WITH_DS``) adds dS atomically, which was 2-4x slower there. This probe tries the other way: one launch whose
program table lists, adapter by adapter, the dS programs of the adapter's row blocks and the dB programs of its
column blocks side by side (`_ds_and_db`, each program running one of the two kernels' own bodies,
`triton_kernels._rows_program` / `_grad_program`), so that the adapters in flight are few and each dY tile the first
reader brings in is still in L2 for the second. ``apart`` runs the same kernel with every dS program first (the two
launches in one, the control); ``two_launches`` is today's pair. Every variant's dS and dB are checked against
the two launches'. Times are `triton.testing.do_bench` medians (L2 flushed before each run), fixed tiles each (no
autotuning: the best of a few per variant).
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.testing import do_bench

from lightning_multilora.kernels import LoRAWeights
from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels import triton_lora as T


@triton.jit
def _ds_and_db(PROGS, DY, B_PTRS, B_WITNESS, DS, S, G_PTRS, G_WITNESS, BLK_ADAPTER, BLK_START, SEG_START, SEG_END,
               ORDER, RANKS, ONES, COEF, DROP_P, SEEDS, K_DIM, ROWS_R_CHUNKS, GRAD_R_CHUNKS, ROW_TOKENS, stride_dy_m,
               stride_ds_m, stride_s_m, DOT_PRECISION: tl.constexpr, W_ALIGNED: tl.constexpr,
               G_ALIGNED: tl.constexpr, ADD_TO_G: tl.constexpr, TRANS_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
               ROWS_BLOCK_K: tl.constexpr, ROWS_BLOCK_R: tl.constexpr, GRAD_BLOCK_K: tl.constexpr,
               GRAD_BLOCK_T: tl.constexpr, GRAD_BLOCK_R: tl.constexpr):
    """Program ``p`` runs ``PROGS[p]``: a code ``c >= 0`` is the dS row launch's program ``c`` (row block ``c //
    ROWS_R_CHUNKS``, its rank chunk), ``c < 0`` the dB launch's program ``-c - 1`` (K block, then adapter slot)."""
    code = tl.load(PROGS + tl.program_id(0))
    if code >= 0:
        K._rows_program(code // ROWS_R_CHUNKS, (code % ROWS_R_CHUNKS) * ROWS_BLOCK_R, 0, DY, B_PTRS, B_WITNESS, DS,
                        BLK_ADAPTER, BLK_START, SEG_START, SEG_END, RANKS, ONES, DROP_P, SEEDS, K_DIM, ROW_TOKENS,
                        stride_dy_m, stride_ds_m, False, False, DOT_PRECISION, W_ALIGNED, BLOCK_M, ROWS_BLOCK_K,
                        ROWS_BLOCK_R, 1)
    else:
        c = -code - 1
        k_blocks = tl.cdiv(K_DIM, GRAD_BLOCK_K)
        K._grad_program(c % k_blocks, 0, c // k_blocks, S, DY, G_PTRS, G_WITNESS, SEG_START, SEG_END, ORDER, RANKS,
                        COEF, DROP_P, SEEDS, B_PTRS, B_WITNESS, DS, K_DIM, GRAD_R_CHUNKS, 1, ROW_TOKENS, stride_s_m,
                        stride_dy_m, stride_ds_m, False, False, False, ADD_TO_G, DOT_PRECISION, G_ALIGNED, False,
                        False, TRANS_ACC, GRAD_BLOCK_T, GRAD_BLOCK_K, GRAD_BLOCK_R)


def program_table(sched, table, ranks: list[int], k_dim: int, grad_block_k: int, interleave: bool,
                  device) -> torch.Tensor:
    """The launch's program codes: per adapter (in the row blocks' order) its dS programs and its dB programs, merged
    evenly (``interleave``), or every dS program first, then every dB program in the dB launch's order."""
    grad_r, grad_chunks = T._grad_chunks(table.block_r, table.width)
    k_blocks = triton.cdiv(k_dim, grad_block_k)
    blk_adapter = sched.blk_adapter.tolist()
    ds_of: dict[int, list[int]] = {}
    order: list[int] = []
    for pid, a in enumerate(blk_adapter):
        if a not in ds_of:
            ds_of[a] = []
            order.append(a)
        ds_of[a] += [pid * table.r_chunks + c for c in range(table.r_chunks) if c * table.block_r < ranks[a]]
    db_of = {a: [-(((a * grad_chunks + c) * k_blocks + kb) + 1) for c in range(grad_chunks) if c * grad_r < ranks[a]
                 for kb in range(k_blocks)] for a in order}
    if not interleave:
        codes = [c for a in order for c in ds_of[a]] + [c for a in order for c in db_of[a]]
    else:
        codes = []
        for a in order:
            ds, db = ds_of[a], db_of[a]
            merged = [(i / len(ds), c) for i, c in enumerate(ds)] + [(i / len(db), c) for i, c in enumerate(db)]
            codes += [c for _, c in sorted(merged, key=lambda p: p[0])]
    return torch.tensor(codes, dtype=torch.int32, device=device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--ranks", nargs="+", default=["mixed", "64", "128"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--d-out", type=int, nargs="+", default=[4096, 14336])
    parser.add_argument("--out", default="benchmarks/results/ds_db_one_launch_h200.json")
    parser.add_argument("--quick", action="store_true", help="two tiles per variant (the tuner's usual picks)")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    common = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.now(timezone.utc).date().isoformat(), n_adapters=args.n)
    for d_out in args.d_out:
        for kind in args.ranks:
            for tokens in args.tokens:
                rows += point(d_out, kind, tokens, args.n, device, common, quick=args.quick)
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


def _plain(kernel):
    """The kernel without its autotuner (the interpreter's kernels have none)."""
    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def point(d_out: int, kind: str, tokens: int, n: int, device, common: dict, dtype: torch.dtype = torch.bfloat16,
          bench: bool = True, quick: bool = False) -> list[dict]:
    """Every variant at one point: rows of its time and its dS / dB error against the first variant's."""
    rng = random.Random(0)
    ranks = [rng.choice([8, 16, 24, 32, 48, 64, 96, 128]) for _ in range(n)] if kind == "mixed" else [int(kind)] * n
    starts = tuple(i * tokens for i in range(n))
    ends = tuple((i + 1) * tokens for i in range(n))
    rows_total = n * tokens
    b = tuple((torch.randn(d_out, r, device=device) * 0.02).to(dtype) for r in ranks)  # the bf16 shadows
    a = tuple(torch.zeros(r, 16, device=device, dtype=dtype) for r in ranks)  # (unused: the table's A)
    w = LoRAWeights(a, b, tuple(2.0 for _ in ranks), tuple(0.0 for _ in ranks), starts, ends)
    T.reset_rank_tiles()
    table = T.pointer_table(w, device)
    sched = T.schedule(starts, ends, rows_total, device, tuple(ranks))
    dy = torch.randn(rows_total, d_out, device=device, dtype=dtype)
    s = torch.randn(rows_total, table.width, device=device, dtype=dtype)
    grads = [torch.zeros(d_out, r, device=device) for r in ranks]
    g_ptrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64, device=device)
    ds = torch.empty(rows_total, table.width, device=device, dtype=dtype)
    identity = torch.arange(n, dtype=torch.int32, device=device)
    w_aligned = all(r % 8 == 0 for r in ranks)
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
                s, dy, g_ptrs, grads[0], sched.seg_start, sched.seg_end, identity, table.ranks, table.scaling,
                table.drop_p, table.ranks, g_ptrs, grads[0], ds, d_out, grad_chunks, 1, 1, 1, 1 << 30, s.stride(0),
                dy.stride(0), 0, G_IS_A=False, HAS_DROPOUT=False, ATOMIC=False, ADD_TO_G=True, DOT_PRECISION="ieee",
                G_ALIGNED=w_aligned, WITH_DS=False, W_ALIGNED=False, TRANS_ACC=trans, BLOCK_T=gt, BLOCK_K=gk,
                BLOCK_R=grad_r, num_warps=gw, num_stages=gs)
        return run

    def one_launch(interleave, rk, gk, gt, nw, st):
        progs = program_table(sched, table, ranks, d_out, gk, interleave, device)

        def run():
            _ds_and_db[(progs.numel(),)](
                progs, dy, table.b_ptrs, b[0], ds, s, g_ptrs, grads[0], sched.blk_adapter, sched.blk_start,
                sched.seg_start, sched.seg_end, identity, table.ranks, table.ones, table.scaling, table.drop_p,
                table.ranks, d_out, table.r_chunks, grad_chunks, 1 << 30, dy.stride(0), ds.stride(0), s.stride(0),
                DOT_PRECISION="ieee", W_ALIGNED=w_aligned, G_ALIGNED=w_aligned, ADD_TO_G=True, TRANS_ACC=trans,
                BLOCK_M=T.BLOCK_M, ROWS_BLOCK_K=rk, ROWS_BLOCK_R=table.block_r, GRAD_BLOCK_K=gk, GRAD_BLOCK_T=gt,
                GRAD_BLOCK_R=grad_r, num_warps=nw, num_stages=st)
        return run

    def result(run):
        for g in grads:
            g.zero_()
        ds.fill_(float("nan"))
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return ds.clone(), [g.clone() for g in grads]

    variants = {}
    for rk, rw, rs in ((64, 4, 4), (128, 8, 3))[:1 if quick else 2]:
        for gk, gt, gw, gs in ((128, 64, 4, 3), (64, 64, 4, 3), (256, 32, 4, 3))[:2 if quick else 3]:
            variants[("two_launches", rk, gk, gt, f"rows {rw}w{rs}s grad {gw}w{gs}s")] = \
                two_launches(rk, rw, rs, gk, gt, gw, gs)
    for interleave in (True, False):
        for rk, gk, gt, nw, st in ((64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3),
                                   (64, 128, 32, 4, 3))[:2 if quick else 5]:
            variants[("interleaved" if interleave else "apart", rk, gk, gt, f"{nw}w{st}s")] = \
                one_launch(interleave, rk, gk, gt, nw, st)
    valid = torch.zeros_like(ds, dtype=torch.bool)  # dS holds each adapter's first r_i columns of its rows
    for st, en, r in zip(starts, ends, ranks):
        valid[st:en, :r] = True
    reference = None
    out = []
    for (name, rk, gk, gt, launch), run in variants.items():
        try:
            got_ds, got_g = result(run)
        except Exception as err:  # noqa: BLE001 - a tile that does not fit: reported, not fatal
            print(f"{name} {rk} {gk} {gt} {launch}: {type(err).__name__}: {str(err)[:160]}", flush=True)
            continue
        got_ds = torch.where(valid, got_ds, 0)
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
