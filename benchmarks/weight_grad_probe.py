"""The dA launch (`triton_kernels._weight_grad`, ``G_IS_A``) alone, over fixed tiles (the tuner's and others), row
splits (``SPLIT_T`` programs sharing an adapter's rows, adding atomically: against the wave quantization of 1024
programs) and storing vs adding into the gradients (``ADD_TO_G``), 32 adapters, bf16 X and dS.

    PYTHONPATH=. python benchmarks/weight_grad_probe.py --ranks 64 128 --tokens 1024 \
        --out benchmarks/results/kernels_h200_wg_probe.json

Each row: the tile (block_k, block_t, warps, stages), split, add_to_g, us (`triton.testing.do_bench` median, L2 flushed
before each run), x_tbps (X's bytes over that time: the read that bounds the launch) and err (the largest relative
difference to the first tile's gradients: the variants must agree).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import torch
import triton
from triton.testing import do_bench

from benchmarks.ds_db_one_launch import _plain, grad_problem
from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels import triton_lora as T


def point(d_in: int, kind: str, tokens: int, n: int, out: list, path: str) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    p = grad_problem(kind, tokens, n, d_in, device, dtype, of_a=True)
    rows, table, sched, grads, g_ptrs, aligned = p.rows, p.table, p.sched, p.grads, p.g_ptrs, p.aligned
    x = torch.randn(rows, d_in, device=device, dtype=dtype)
    ds = torch.randn(rows, table.width, device=device, dtype=dtype)
    grad_r, chunks = T._grad_chunks(table.block_r, table.width)
    trans = grad_r >= T.GRAD_TRANSPOSE_MIN_TILE
    x_bytes = x.numel() * x.element_size()
    reference = None
    for bk, bt, nw, st in ((128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 5), (128, 128, 4, 3),
                           (128, 128, 8, 3), (256, 64, 8, 3), (256, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 4)):
        for split in (1, 2, 4):
            for add in (True, False):
                if split > 1 and not add:
                    continue

                def run():
                    _plain(K._weight_grad)[(triton.cdiv(d_in, bk) * split, n * chunks)](
                        ds, x, g_ptrs, grads[0], sched.seg_start, sched.seg_end, sched.grad_order, table.ranks,
                        table.scaling, table.drop_p, table.ranks, g_ptrs, grads[0], ds, d_in, chunks, split, 1, 1,
                        1 << 30, ds.stride(0), x.stride(0), 0, G_IS_A=True, HAS_DROPOUT=False, ATOMIC=split > 1,
                        ADD_TO_G=add, DOT_PRECISION="ieee", G_ALIGNED=aligned, WITH_DS=False, W_ALIGNED=False,
                        TRANS_ACC=trans, BLOCK_T=bt, BLOCK_K=bk, BLOCK_R=grad_r, num_warps=nw, num_stages=st)

                try:
                    for g in grads:
                        g.zero_()
                    run()
                    torch.cuda.synchronize()
                except Exception as err:  # noqa: BLE001 - a tile that does not fit
                    print(bk, bt, nw, st, split, add, type(err).__name__, str(err)[:120], flush=True)
                    continue
                got = [g.clone() for g in grads]
                if reference is None:
                    reference = got
                err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, reference))
                us = do_bench(run, warmup=25, rep=200) * 1000
                row = dict(d_in=d_in, ranks=kind, tokens=tokens, block_k=bk, block_t=bt, warps=nw, stages=st,
                           split=split, add_to_g=add, us=round(us, 2), x_tbps=round(x_bytes / us / 1e6, 3), err=err)
                out.append(row)
                print(json.dumps(row), flush=True)
                dump(out, path)


def dump(out: list, path: str) -> None:
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       date=datetime.now(timezone.utc).date().isoformat(), rows=out), f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--ranks", nargs="+", default=["64", "128", "mixed"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--d-in", type=int, nargs="+", default=[4096])
    parser.add_argument("--out", default="benchmarks/results/kernels_h200_wg_probe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/weight_grad_probe.py measures on a CUDA GPU: torch finds none here")
    out: list = []
    for d_in in args.d_in:
        for kind in args.ranks:
            for tokens in args.tokens:
                point(d_in, kind, tokens, args.n, out, args.out)


if __name__ == "__main__":
    main()
