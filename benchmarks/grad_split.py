"""Weight-gradient row splits and the dS + dB launch choice, before session 39 and now, side by side (ours_shadow).

Run on the H200 (on a fresh machine, most of it compiling, 240 s measured its first 16 points; ``--budget-s`` stops
early, the points done are written after each one):

    PYTHONPATH=. python benchmarks/grad_split.py --out benchmarks/results/kernels_h200_grad_split.json

For the points of `benchmarks/kernels.py`'s grid (N up to 32) where a launch is small or a row split is likely (a
weight-gradient launch of at most `triton_kernels.SMALL_PROBLEM` elements; N = 8 x 256 tokens at r=64 and ranks
8..128; N = 16 and 32 x 256 tokens at r=64 on the shapes of dY over 1024 wide), times a forward + backward of
``ours_shadow`` (`benchmarks.kernels.graph_ms`: CUDA graph, cold L2) under two rules, and checks every A and B
gradient against the fp32 per-adapter loop (``max_rel_err_grads``, the largest of their relative errors):

- ``before``: a weight-gradient row split keeps more than 64 rows a program at every rank chunk, and dS and dB come
  from one launch wherever the dB launch splits no rows;
- ``package``: `triton_lora.GRAD_SPLIT_MIN_ROWS` by rank chunk, and `triton_lora.ds_db_one_launch`.

Rows go to ``--out``: shape, n_adapters, ranks, tokens, variant, impl, ms, max_rel_err_grads (GPU, versions and date
beside them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import triton

from benchmarks.kernels import SHAPES, graph_ms, make, ranks_for, shadow_step, tokens_for
from lightning_multilora.kernels import LoRAWeights, multi_lora_reference
from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels import triton_lora as TL
from lightning_multilora.kernels.triton_lora import reset_rank_tiles

VARIANTS = {"before": (((64, 64),), lambda grad_split, k, ds_programs, sms: grad_split == 1),
            "package": (TL.GRAD_SPLIT_MIN_ROWS, TL.ds_db_one_launch)}


def use(name: str) -> None:
    TL.GRAD_SPLIT_MIN_ROWS, TL.ds_db_one_launch = VARIANTS[name]


def points() -> list[tuple]:
    out = []
    for d_in, d_out in (SHAPES[3], SHAPES[2], SHAPES[0], SHAPES[1]):
        for n in (1, 4, 8, 16, 32):
            for rk in ("16", "64", "mixed"):
                for tk in ("256", "1024", "mixed"):
                    rng = random.Random(f"{d_in}-{d_out}-{n}-{rk}-{tk}")  # (the grid's draw for the point)
                    ranks, tokens = ranks_for(rk, n, rng), tokens_for(tk, n, rng)
                    if (sum(tokens) * min(d_in, d_out) <= K.SMALL_PROBLEM
                            or n == 8 and rk != "16" and tk == "256"
                            or n in (16, 32) and rk == "64" and tk == "256" and d_out != 1024):
                        out.append((d_in, d_out, n, rk, tk, ranks, tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/kernels_h200_grad_split.json")
    parser.add_argument("--budget-s", type=float, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/grad_split.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    common = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"))
    rows, ratios, start = [], [], time.monotonic()
    for d_in, d_out, n, rk, tk, ranks, tokens in points():
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s reached")
            break
        torch.manual_seed(0)
        reset_rank_tiles()
        x, base, w = make(d_in, d_out, ranks, tokens, device)
        grad = torch.randn_like(base)
        step = shadow_step(x, base, w, grad)
        ref = LoRAWeights(tuple(a.detach().clone().requires_grad_() for a in w.a),
                          tuple(b.detach().clone().requires_grad_() for b in w.b), w.scaling, w.dropout, w.starts,
                          w.ends)
        torch.autograd.backward(multi_lora_reference(x.float(), base.float(), ref, True), grad.float())

        line, times = f"{d_in}x{d_out} N={n} r={rk} t={tk}:", {}
        for name in VARIANTS:
            use(name)
            for p in (*w.a, *w.b):
                p.grad = None
            step()
            err = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip((*w.a, *w.b), (*ref.a, *ref.b)))
            times[name] = graph_ms(step)
            rows.append(dict(shape=f"{d_in}x{d_out}", n_adapters=n, ranks=rk, tokens=tk, variant=name,
                             impl="ours_shadow", ms=round(times[name], 4), max_rel_err_grads=round(err, 5)))
            line += f" {name} {times[name] * 1e3:6.1f} us (grad err {err:.1e})"
        ratios.append(times["package"] / times["before"])
        print(line, flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(common, rows=rows), f, indent=1)
    use("package")
    if ratios:
        print(f"package / before: median {statistics.median(ratios):.3f}x, {min(ratios):.3f}x-{max(ratios):.3f}x "
              f"over {len(ratios)} points")


if __name__ == "__main__":
    main()
