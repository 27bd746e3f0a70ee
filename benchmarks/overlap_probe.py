"""How much of a LoRA step's fixed part could fewer launches win back? Two independent steps side by side.

Run on the GPU (a few minutes on a fresh machine, most of them compiling and tuning; session 50's rows, taken on an
H100, are in ``overlap_probe_h100.json``):

    PYTHONPATH=. python benchmarks/overlap_probe.py --tokens 256 1024 mixed \
        --out benchmarks/results/overlap_probe_h100.json

At N=32 our forward + backward (``ours_shadow`` of `benchmarks/kernels.py`) moves its bytes at 83-94% of the copy
rate at r=16 and still misses 70% of the floor at the 256-token points: a fixed ~35-45 us a step, which the
profiler puts inside the launches (their ramps and tails: a row launch of 256-token adapters is one partial wave),
not between them (`benchmarks/results/kernels_h200.md`, session 40). Fusing launches (a row block's shrink and
expand, or its dS and dX, in one program or one launch) can win back at most what a second, independent step
running beside the first wins: the GPU fills the ramps and tails of one step's launches with the other's work.

For each point this builds two independent problems (``a`` and ``b``: the same shape, N, ranks and tokens, other
data and weights) and times, each as CUDA-graph replays after a 256 MB L2 flush (the flush timed apart and
subtracted, several steps a replay: `benchmarks.kernels.graph_ms`):

- ``one``: a step of ``a`` alone;
- ``serial``: ``a``'s step, then ``b``'s, on one stream;
- ``side_by_side``: ``a``'s step on one stream, ``b``'s on another, both after the same flush.

``pct_of_floor`` counts each variant's own bytes (two problems' for the pairs) at the copy rate measured in the run.
``serial`` against twice ``one`` is the cost of a second step's flush-free start; ``side_by_side`` against ``serial``
is what overlapping the launches' ramps and tails is worth: the most that fusing launches could win.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from datetime import datetime, timezone

import torch
import triton

from benchmarks.kernels import SHAPES, copy_bandwidth, floor_bytes, graph_ms, make, ranks_for, shadow_step, tokens_for


def together(fns: list, side_by_side: bool):
    """One step running the steps ``fns`` one after the other, or each on its own stream (forked from the current
    one and joined back), for `benchmarks.kernels.graph_ms` to capture and time."""
    streams = [torch.cuda.Stream() for _ in fns]

    def step() -> None:
        if not side_by_side:
            for fn in fns:
                fn()
            return
        here = torch.cuda.current_stream()
        for fn, stream in zip(fns, streams):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                fn()
        for stream in streams:
            here.wait_stream(stream)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=int, nargs="+", default=[0, 1], help="indices into benchmarks.kernels.SHAPES")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--ranks", nargs="+", default=["16", "64", "mixed"])
    parser.add_argument("--tokens", nargs="+", default=["256", "1024"])
    parser.add_argument("--out", default="benchmarks/results/overlap_probe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/overlap_probe.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = []
    for shape_index in args.shapes:
        d_in, d_out = SHAPES[shape_index]
        for rank_kind in args.ranks:
            for token_kind in args.tokens:
                rng = random.Random(0)
                ranks, tokens = ranks_for(rank_kind, args.n, rng), tokens_for(token_kind, args.n, rng)
                steps, floor_gb = [], 0.0
                for _ in range(2):
                    x, base, w = make(d_in, d_out, ranks, tokens, device)
                    grad = torch.randn_like(base)
                    steps.append(shadow_step(x, base, w, grad))
                    floor_gb += floor_bytes(x, base, w) / 1e9
                one_floor_ms = floor_gb / 2 / bandwidth * 1e3
                variants = {"one": (steps[:1], False, one_floor_ms), "serial": (steps, False, 2 * one_floor_ms),
                            "side_by_side": (steps, True, 2 * one_floor_ms)}
                for name, (fns, side, floor_ms) in variants.items():
                    ms = graph_ms(together(fns, side))
                    row = dict(shape=f"{d_in}x{d_out}", n_adapters=args.n, ranks=rank_kind, tokens=token_kind,
                               variant=name, ms=round(ms, 4), floor_ms=round(floor_ms, 4),
                               pct_of_floor=round(100 * floor_ms / ms, 1))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del steps
                gc.collect()
                torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=round(bandwidth, 1), date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
