"""Grouped LoRA kernels, forward + backward of one layer's LoRA path, against the alternatives.

Run on the H200 (minutes per shape on a fresh machine, most of them compiling and tuning; ``--ns 32`` for the
N=32 rows alone, ``--impls ours_direct`` for ours alone, ``--budget-s`` to stop early, ``--kernel-times`` for
where each implementation's time goes, kernel by kernel):

    PYTHONPATH=. python benchmarks/kernels.py --out benchmarks/results/kernels_h200.json

The whole grid (with LoRAFusion beside ours, below) takes longer than one 10-minute device call: run it in parts,
each adding the points the last one did not reach:

    PYTHONPATH=. python benchmarks/kernels.py --lorafusion-src .lorafusion --shapes 0 1 --budget-s 480 --resume \
        --out benchmarks/results/kernels_h200.json

``--report`` measures nothing and prints a results file as markdown (the N=32 tables, the goals over the whole grid,
LoRAFusion beside ours); it runs without a GPU:

    python benchmarks/kernels.py --report --out benchmarks/results/kernels_h200.json

For each Llama-8B projection shape, N adapters, ranks and tokens per adapter, times one call's forward
and backward (gradients of x, every A and every B; bf16 activations, fp32 adapters) of:

- ``ours``: `multi_lora_triton` (6 launches whatever N), gradients of A and B returned through autograd;
- ``ours_direct``: the same with ``direct_grads=True`` (what `MultiLoRALinear` uses): dA/dB added straight
  into ``.grad``, one autograd input instead of 2N;
- ``ours_shadow``: ``ours_direct`` reading bf16 copies of the weights that the caller keeps (``LoRAWeights.a_copies``:
  the adapters' shadows, which `GroupedAdamW` writes at its step, `lightning_multilora.shadow`), so the call copies
  nothing. Its rows also give ``shadow_write_ms``, the time the optimizer's extra write of the shadows (2 bytes a
  parameter) takes at the copy rate, and ``pct_of_floor_with_shadow_write``, the share of the floor counting it;
- ``loop``: the per-adapter PyTorch reference (what PEFT's mixed-batch path does);
- ``grouped_mm``: ``torch._grouped_mm`` over rank-padded stacked weights (one launch per product);
- ``floor``: the bytes that must move (x, Y read + written, dY, x again for dA, dX written, the
  weights and their gradients) over the device-to-device copy bandwidth measured in the same run.

Adapter gradients (``--grads``): by default they stay in place, so that each step adds into the last one's (a read
and a write of them), as `MultiLoRAModule`'s steps add into flat gradients zeroed before each backward (and as a
later micro-batch of gradient accumulation does). ``--grads fresh``: every step starts without them, as after
``zero_grad(set_to_none=True)``; the floor counts that case (a write alone), and ours then stores the new
gradients without reading them. Rows say which (``grads``; rows without the field accumulated).

``ms`` is GPU time: forward + backward steps captured back to back in a CUDA graph (about 3 ms of them, at most
20) and replayed (``triton.testing.do_bench`` medians, divided by the steps), so that the host's Python and launch
costs, which a training step overlaps with the frozen base's GEMMs, do not hide the kernels. Each step starts
with a cold L2 (a 256 MB write before it, timed apart and subtracted: `graph_ms`). Every implementation writes a fresh dX (``x.grad`` is dropped before each
call): adding it into an older ``x.grad`` (autograd's accumulation, two reads and a write of ``(T, d_in)``) is no
part of the LoRA path, and in a model dX is consumed by the layer below. ``eager_ms`` is the same call run eagerly back to back (host time included,
with one autograd backward per call), for ours_direct (and the LoRAFusion pair below) only.

With ``--lorafusion-src DIR`` (a CentML/lorafusion source tree, imported at run time, never committed), points
with N <= 4 also time LoRAFusion's fused multi-LoRA linear (``lorafusion``) beside ours with the same frozen
linear fused in (``ours_linear_direct``), and the frozen linear alone (``frozen_linear``, compute-bound); the
floor of the two fused rows is ``frozen_linear``'s time plus the LoRA bytes' floor (``floor_ms`` in each row).

The products have a floor too: ``compute_floor_ms`` (the ``floor`` rows) is the LoRA path's flops (`lora_flops`) at
the bf16 matrix rate measured in the same run (``matmul_tflops``). ``pct_of_serial_floor``: the share of the byte
floor plus that one, the time of a kernel that moved its bytes and did its products one after the other at the two
rates; above 100%, some of the two overlapped.

Rows go to ``--out``: op, shape, n_adapters, ranks, tokens, impl, ms, eager_ms, gbps, floor_ms, pct_of_floor; the
tiles the kernels' autotuning chose, per tuning key, to ``--out`` with the suffix ``.tuning.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from lightning_multilora.kernels import LoRAWeights, multi_lora_reference
from lightning_multilora.kernels.triton_lora import multi_lora_linear_triton, multi_lora_triton, reset_rank_tiles

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
# (frozen_linear, lorafusion and ours_linear_direct run only with --lorafusion-src)
IMPLS = ["ours", "ours_direct", "ours_shadow", "loop", "grouped_mm", "frozen_linear", "lorafusion", "ours_linear_direct"]


def ranks_for(kind: str, n: int, rng: random.Random) -> list[int]:
    if kind == "mixed":
        return [rng.choice([8, 16, 24, 32, 48, 64, 96, 128]) for _ in range(n)]
    return [int(kind)] * n


def tokens_for(kind: str, n: int, rng: random.Random) -> list[int]:
    if kind == "mixed":
        return [rng.choice([64, 128, 256, 512, 1024, 2048]) for _ in range(n)]
    return [int(kind)] * n


def make(d_in, d_out, ranks, tokens, device):
    starts, ends, row = [], [], 0
    for t in tokens:
        starts.append(row)
        row += t
        ends.append(row)
    x = torch.randn(row, d_in, device=device, dtype=torch.bfloat16)
    base = torch.randn(row, d_out, device=device, dtype=torch.bfloat16)
    a = tuple((torch.randn(r, d_in, device=device) / d_in ** 0.5).requires_grad_() for r in ranks)
    b = tuple((torch.randn(d_out, r, device=device) * 0.01).requires_grad_() for r in ranks)
    w = LoRAWeights(a, b, tuple(2.0 for _ in ranks), tuple(0.0 for _ in ranks), tuple(starts), tuple(ends))
    return x, base, w


def shadow_step(x, base, w: LoRAWeights, grad):
    """``ours_shadow``'s forward + backward of a point made by `make` (the adapters' bf16 shadows copied once, as the
    optimizer keeps them; dX stored, adapter gradients added into)."""
    xg = x.clone().requires_grad_()
    shadow = LoRAWeights(w.a, w.b, w.scaling, w.dropout, w.starts, w.ends, direct_grads=True,
                         a_copies=tuple(a.detach().to(x.dtype) for a in w.a),
                         b_copies=tuple(b.detach().to(x.dtype) for b in w.b))

    def step():
        xg.grad = None
        torch.autograd.backward(multi_lora_triton(xg, base.detach(), shadow, True), grad)

    return step


class GroupedMM:
    """torch._grouped_mm over stacked, rank-padded bf16 copies of the weights (kept stacked, as a
    grouped-mm implementation would hold them)."""

    def __init__(self, w: LoRAWeights, device):
        r_max = -(-max(a.shape[0] for a in w.a) // 8) * 8
        n, d_in, d_out = len(w.a), w.a[0].shape[1], w.b[0].shape[0]
        at = torch.zeros(n, d_in, r_max, device=device, dtype=torch.bfloat16)
        bt = torch.zeros(n, r_max, d_out, device=device, dtype=torch.bfloat16)
        for i, (a, b) in enumerate(zip(w.a, w.b)):
            at[i, :, : a.shape[0]] = a.detach().t()
            bt[i, : a.shape[0]] = b.detach().t()
        self.at, self.bt = at.requires_grad_(), bt.requires_grad_()
        self.offs = torch.tensor(w.ends, device=device, dtype=torch.int32)
        scale = torch.cat([torch.full((e - s, 1), sc) for s, e, sc in zip(w.starts, w.ends, w.scaling)])
        self.scale = scale.to(device, torch.bfloat16)

    def __call__(self, x, base):
        s = torch._grouped_mm(x, self.at, offs=self.offs)
        return base + torch._grouped_mm(s, self.bt, offs=self.offs) * self.scale


def matmul_tflops(device) -> float:
    """The bf16 matrix rate measured in the run: an 8192 x 8192 x 8192 product on random data (TFLOP/s)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = do_bench(lambda: a @ b, warmup=25, rep=100)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def lora_flops(ranks, tokens, d_in: int, d_out: int) -> int:
    """The multiply-adds (x2) of one LoRA forward + backward: the shrink and dX (each 2 t r d_in), dA (2 t r d_in),
    the expand, dS and dB (each 2 t r d_out), summed over the adapters: ``6 sum_i t_i r_i (d_in + d_out)``."""
    return 6 * sum(t * r for t, r in zip(tokens, ranks)) * (d_in + d_out)


def copy_bandwidth(device) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # GB/s, read + write


def graph_ms(step, target_ms: float = 3.0, max_repeats: int = 20) -> float:
    """GPU time of ``step`` (a forward + backward): captured in a CUDA graph and replayed. The graph holds several
    steps back to back (enough for ~``target_ms`` a replay, at most ``max_repeats``), and a replay's time is divided
    among them: the device-side start of a replay (tens of microseconds after its start event is recorded, the
    host still submitting the graph) would otherwise count against a step of a few hundred. Each step follows a
    write of 256 MB, so that every step starts with a cold L2 as a lone step does (a small problem's inputs would
    otherwise stay in the 50 MB L2 from one step to the next); the writes are timed in a graph of their own and
    subtracted. Whether each step starts without adapter gradients is ``step``'s to decide (``--grads``): a
    captured backward that makes new ones allocates them from the graph's own pool."""
    # The warm-up steps (compiling, tuning, allocating outside the capture) run on the stream the capture will run
    # on, and a garbage collection follows. A leaf's AccumulateGrad node keeps the stream it was made on; one made on
    # the default stream that outlives its step (a graph kept alive, or one in a reference cycle not yet collected)
    # makes the captured backward wait on the default stream, which invalidates the capture ("operation would make
    # the legacy stream depend on a capturing blocking stream", with PyTorch's warning that an AccumulateGrad node's
    # stream does not match its gradient's). Captures failed so at a few points of full runs (sessions 14-16) when
    # the warm-up ran on the default stream; emptying the allocator's cache (session 15) did not stop them. The
    # emptying stays: cached blocks of earlier points go back to the device, so that none is freed inside a capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    flush = torch.empty(2**28 // 4, dtype=torch.int32, device="cuda")

    def capture(repeats: int, fn) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm the side stream's allocations, as torch.cuda.make_graphed_callables does
            with torch.cuda.graph(graph):
                for _ in range(repeats):
                    flush.zero_()
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        return graph

    def per_step(repeats: int) -> float:
        steps = do_bench(capture(repeats, step).replay, warmup=5, rep=30)
        flushes = do_bench(capture(repeats, lambda: None).replay, warmup=5, rep=30)
        return (steps - flushes) / repeats

    one = per_step(1)
    repeats = max(1, min(max_repeats, round(target_ms / max(one, 1e-3))))
    return one if repeats == 1 else per_step(repeats)


def kernel_times(step, steps: int = 5) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """GPU microseconds a step per kernel name (torch.profiler over ``steps`` eager steps after an untimed one),
    largest first: where a point's time goes (``--kernel-times``); and every launch of a step in launch order,
    (name, us) averaged over the steps (a launch per class of ranks shows apart: `triton_lora.rank_classes`)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # (older torch)
            us = event.self_cuda_time_total
        if us > 0:
            times[event.key[:80]] = times.get(event.key[:80], 0.0) + us / steps
    kernels = sorted((e for e in prof.events() if getattr(e, "device_time", 0) > 0 and e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    launches = []
    if per_step * steps == len(kernels):  # (else some step launched differently: no per-launch view)
        for i in range(per_step):
            same = kernels[i::per_step]
            launches.append((same[0].name.split("(")[0][:40], round(sum(e.device_time for e in same) / steps, 1)))
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}, launches


def floor_bytes(x, base, w) -> int:
    t, d_in, d_out = x.shape[0], x.shape[1], base.shape[1]
    act = 2 * t * (3 * d_in + 3 * d_out)  # x, Y r+w, dY, x (dA), dX (bf16)
    weights = sum(4 * (a.numel() + b.numel()) * 2 for a, b in zip(w.a, w.b))  # read + grad write (fp32)
    return act + weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--ranks", nargs="+", default=["16", "64", "mixed"])
    parser.add_argument("--tokens", nargs="+", default=["256", "1024", "mixed"])
    parser.add_argument("--shapes", type=int, nargs="+", default=None, help="indices into SHAPES")
    parser.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    parser.add_argument("--max-loop-n", type=int, default=64)
    parser.add_argument("--lorafusion-src", default=None,
                        help="a CentML/lorafusion source tree (e.g. .lorafusion, never committed): adds its fused "
                             "multi-LoRA linear (N <= 4) beside ours with the frozen linear fused in "
                             "(benchmarks/lorafusion_side.py)")
    parser.add_argument("--impls", nargs="+", default=None, choices=IMPLS, metavar="IMPL",
                        help=f"time only these implementations ({', '.join(IMPLS)}; default: all)")
    parser.add_argument("--grads", choices=["accumulate", "fresh"], default="accumulate",
                        help="accumulate (default): each step adds into the adapter gradients the last one left, as "
                             "MultiLoRAModule's steps add into their zeroed flat gradients; fresh: every step starts "
                             "without them (zero_grad(set_to_none=True)), and ours stores new ones without reading")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new points after this many seconds and write the rows measured so far")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out and measure only the points it does not finish (a "
                             "point is finished once its floor row is written): a grid split over several runs, "
                             "each under --budget-s")
    parser.add_argument("--report", action="store_true",
                        help="measure nothing: print --out's rows as markdown (the N=32 tables, the goals, LoRAFusion "
                             "beside ours); runs without a GPU")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also profile each implementation's eager steps (the loop's too): each row gets "
                             "kernels_us, GPU us a step per kernel (the launches of a forward + backward, by name), "
                             "and launches_us, each launch of a step in order")
    parser.add_argument("--rank-class-launches", type=int, default=None,
                        help="launches of the expand and of dX for ranks that differ (triton_lora.RANK_CLASS_LAUNCHES; "
                             "default: the package's)")
    parser.add_argument("--hold-w", choices=["tuned", "on", "off"], default="tuned",
                        help="the expand / dX candidates that hold a weight tile and walk rows (HOLD_W): tuned with "
                             "the others (default), alone, or left out")
    parser.add_argument("--ds-db-one-launch", choices=["on", "off"], default=None,
                        help="dS and dB from one launch (triton_lora.DS_DB_ONE_LAUNCH; default: the package's)")
    parser.add_argument("--wide-rows", type=int, default=None,
                        help="row blocks a HOLD_W program walks (triton_lora.WIDE_ROWS; default: the package's)")
    parser.add_argument("--block-m", type=int, default=None,
                        help="rows of the schedule's blocks (triton_lora.BLOCK_M: the row kernels', dS's and the "
                             "expand / dX's tile height; default: the package's); the tall blocks keep their rows, "
                             "and S / dS take the activation dtype from the same rows (LOW_RANK_MIN_WAVES scaled)")
    parser.add_argument("--wide-rows-wide-ranks", type=int, default=None,
                        help="... for adapters of ranks over triton_lora.WIDE_RANK (triton_lora.WIDE_ROWS_WIDE_RANKS; "
                             "default: the package's)")
    parser.add_argument("--ds-db-block-m", type=int, default=None,
                        help="rows of the dS + dB launch's dS blocks (triton_lora.DS_DB_BLOCK_M; default: BLOCK_M)")
    parser.add_argument("--ds-db-grad-block-k", type=int, default=None,
                        help="columns of its dB blocks (triton_kernels.DS_DB_GRAD_BLOCK_K; default: the package's)")
    parser.add_argument("--ds-db-grad-tile", type=int, default=None,
                        help="its dB programs' widest rank chunk (triton_lora.DS_DB_GRAD_MAX_TILE; default: "
                             "GRAD_MAX_TILE)")
    parser.add_argument("--low-rank-min-waves", type=float, default=None,
                        help="row-kernel programs a SM from which S and dS take the activation dtype "
                             "(triton_lora.LOW_RANK_MIN_WAVES; fewer: fp32, the row launches may split K; default: "
                             "the package's)")
    parser.add_argument("--small-split-min-k", type=int, default=None,
                        help="columns of K each split of a small row launch walks at least "
                             "(triton_kernels.SMALL_SPLIT_MIN_K; over half of K: no split; default: the package's)")
    parser.add_argument("--deterministic", choices=["fill", "nofill"], default=None,
                        help="time under torch.use_deterministic_algorithms (Trainer(deterministic=True)): no launch "
                             "of ours adds atomically; fill: torch's default there, every torch.empty filled with NaN "
                             "(a pass over each new buffer), nofill: "
                             "torch.utils.deterministic.fill_uninitialized_memory off")
    args = parser.parse_args()
    if args.report:
        if not Path(args.out).is_file():
            parser.error(f"--report prints the rows of --out, a results file: there is none at {args.out}")
        print(report(json.loads(Path(args.out).read_text())))
        return
    from lightning_multilora.kernels import triton_kernels, triton_lora

    ds_db = dict(ds_db_block_m=args.ds_db_block_m, ds_db_grad_block_k=args.ds_db_grad_block_k,
                 ds_db_grad_tile=args.ds_db_grad_tile)
    for module, name, value in ((triton_lora, "DS_DB_BLOCK_M", args.ds_db_block_m),
                                (triton_kernels, "DS_DB_GRAD_BLOCK_K", args.ds_db_grad_block_k),
                                (triton_lora, "DS_DB_GRAD_MAX_TILE", args.ds_db_grad_tile)):
        if value is not None:
            setattr(module, name, value)
    triton_lora._check_ds_db_sizes()  # (before the first point: a value no tile takes is named here)

    if args.rank_class_launches is not None:
        triton_lora.RANK_CLASS_LAUNCHES = args.rank_class_launches
    if args.small_split_min_k is not None:
        if args.small_split_min_k < 1:
            parser.error(f"--small-split-min-k must be 1 or more, got {args.small_split_min_k}")
        triton_kernels.SMALL_SPLIT_MIN_K = args.small_split_min_k
    if args.block_m is not None:  # (the tall blocks' rows kept: WIDE_ROWS counts blocks; and the rows from which S
        # and dS take the activation dtype: LOW_RANK_MIN_WAVES counts row blocks)
        tall = triton_lora.BLOCK_M * triton_lora.WIDE_ROWS, triton_lora.BLOCK_M * triton_lora.WIDE_ROWS_WIDE_RANKS
        triton_lora.LOW_RANK_MIN_WAVES *= triton_lora.BLOCK_M / args.block_m
        triton_lora.BLOCK_M = args.block_m
        triton_lora.WIDE_ROWS = max(1, tall[0] // args.block_m)
        triton_lora.WIDE_ROWS_WIDE_RANKS = max(1, tall[1] // args.block_m)
    if args.low_rank_min_waves is not None:
        triton_lora.LOW_RANK_MIN_WAVES = args.low_rank_min_waves
    if args.wide_rows is not None:
        triton_lora.WIDE_ROWS = args.wide_rows
    if args.wide_rows_wide_ranks is not None:
        triton_lora.WIDE_ROWS_WIDE_RANKS = args.wide_rows_wide_ranks
    if args.ds_db_one_launch is not None:
        triton_lora.DS_DB_ONE_LAUNCH = args.ds_db_one_launch == "on"
    if args.hold_w != "tuned":
        tuner = triton_kernels._rank_times_weight
        tuner.configs = [c for c in tuner.configs if c.kwargs["HOLD_W"] == (args.hold_w == "on")]
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    lorafusion = None
    if args.lorafusion_src:
        from benchmarks.lorafusion_side import load_lorafusion

        lorafusion = load_lorafusion(args.lorafusion_src)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    tflops = matmul_tflops(device)
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {bandwidth:.0f} GB/s, bf16 matrix rate "
          f"{tflops:.0f} TFLOP/s", flush=True)
    common = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.now(timezone.utc).date().isoformat(), copy_gbps=round(bandwidth, 1),
                  matmul_tflops=round(tflops, 1),
                  timing="ms: CUDA graph of back-to-back forward+backward steps (~3 ms a replay), per step, each after an L2 flush (subtracted)",
                  grads=args.grads)
    if args.rank_class_launches is not None:
        common["rank_class_launches"] = args.rank_class_launches
    if args.wide_rows is not None or args.hold_w != "tuned":
        common.update(wide_rows=args.wide_rows, hold_w=args.hold_w)
    if args.wide_rows_wide_ranks is not None:
        common["wide_rows_wide_ranks"] = args.wide_rows_wide_ranks
    if args.block_m is not None:
        common["block_m"] = args.block_m
    if args.block_m is not None or args.low_rank_min_waves is not None:
        common["low_rank_min_waves"] = triton_lora.LOW_RANK_MIN_WAVES
    if args.small_split_min_k is not None:
        common["small_split_min_k"] = args.small_split_min_k
    common["ds_db_one_launch"] = triton_lora.DS_DB_ONE_LAUNCH
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = args.deterministic == "fill"
        common["deterministic"] = args.deterministic
    common.update({k: v for k, v in ds_db.items() if v is not None})
    rows = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else []
    finished = {_point(r) for r in rows if r["impl"] == "floor"}
    rows = [r for r in rows if _point(r) in finished]
    start = time.monotonic()
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    for d_in, d_out in shapes:
        for n in args.ns:
            for rk in args.ranks:
                for tk in args.tokens:
                    if (f"{d_in}x{d_out}", n, rk, tk) in finished:
                        continue
                    if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                        print(f"budget of {args.budget_s:.0f} s reached: skipping {d_in}x{d_out} N={n} r={rk} t={tk}")
                        continue
                    rng = random.Random(f"{d_in}-{d_out}-{n}-{rk}-{tk}")
                    reset_rank_tiles()  # each point takes its own rank tile (a training run's never narrows)
                    ranks, tokens = ranks_for(rk, n, rng), tokens_for(tk, n, rng)
                    x, base, w = make(d_in, d_out, ranks, tokens, device)
                    grad = torch.randn_like(base)
                    xg = x.clone().requires_grad_()
                    params = [xg, *w.a, *w.b]
                    nbytes = floor_bytes(x, base, w)
                    floor_ms = nbytes / (bandwidth * 1e9) * 1e3
                    compute_ms = lora_flops(ranks, tokens, d_in, d_out) / (tflops * 1e12) * 1e3

                    def fwd_bwd(fn):
                        def step():  # ours adds into `base` in place (its contract); repeats only grow it
                            xg.grad = None  # dX written, not added into the last one (see the module docstring)
                            if args.grads == "fresh":  # a step of one micro-batch (see --grads)
                                for p in params[1:]:
                                    p.grad = None
                            y = fn(xg, base.detach())
                            torch.autograd.backward(y, grad)
                        return step

                    wd = LoRAWeights(w.a, w.b, w.scaling, w.dropout, w.starts, w.ends, direct_grads=True)
                    ws = LoRAWeights(w.a, w.b, w.scaling, w.dropout, w.starts, w.ends, direct_grads=True,
                                     a_copies=tuple(a.detach().to(x.dtype) for a in w.a),
                                     b_copies=tuple(b.detach().to(x.dtype) for b in w.b))
                    shadow_write_ms = sum(2 * (a.numel() + b.numel()) for a, b in zip(w.a, w.b)) / (bandwidth * 1e6)
                    impls = {"ours": fwd_bwd(lambda xx, bb: multi_lora_triton(xx, bb, w, True)),
                             "ours_direct": fwd_bwd(lambda xx, bb: multi_lora_triton(xx, bb, wd, True)),
                             "ours_shadow": fwd_bwd(lambda xx, bb: multi_lora_triton(xx, bb, ws, True))}
                    if n <= args.max_loop_n:
                        impls["loop"] = fwd_bwd(lambda xx, bb: multi_lora_reference(xx, bb, w, True))
                    gmm = GroupedMM(w, device)
                    impls["grouped_mm"] = fwd_bwd(gmm)
                    fused = set()  # impls with the frozen linear inside: their floor is frozen_linear's time + the LoRA bytes'
                    if lorafusion is not None:
                        from benchmarks.lorafusion_side import make_lorafusion_step

                        frozen = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).to(torch.bfloat16)
                        try:
                            lf_step = make_lorafusion_step(x, frozen, w, grad, lorafusion)
                            # the frozen product alone: the fused rows' floor is its time plus the LoRA bytes
                            impls["frozen_linear"] = fwd_bwd(lambda xx, bb: torch.nn.functional.linear(xx, frozen))
                            impls["lorafusion"] = lf_step
                            impls["ours_linear_direct"] = fwd_bwd(
                                lambda xx, bb: multi_lora_linear_triton(xx, frozen, None, wd, True))
                            fused |= {"lorafusion", "ours_linear_direct"}
                        except ValueError as err:  # more than 4 adapters, unaligned widths, ...
                            print(f"  lorafusion skipped: {err}")
                    if args.impls:
                        impls = {k: v for k, v in impls.items() if k in args.impls}
                    shape = f"{d_in}x{d_out}"
                    line = [f"{shape:>11} N={n:<2} r={rk:<5} t={tk:<5}"]
                    frozen_ms = None
                    for impl, step in impls.items():
                        impl_floor_ms = floor_ms + (frozen_ms if impl in fused and frozen_ms is not None else 0.0)
                        try:
                            ms = graph_ms(step)
                            eager = (do_bench(step, warmup=5, rep=30)
                                     if impl in ("ours_direct", "lorafusion", "ours_linear_direct") else None)
                        except Exception as err:  # noqa: BLE001 - a baseline that cannot run this shape
                            print(f"  {impl} failed: {type(err).__name__}: {str(err)[:120]}")
                            continue
                        if impl == "frozen_linear":
                            frozen_ms = ms
                        rows.append(dict(op="lora_fwd_bwd", shape=shape, n_adapters=n, ranks=rk, tokens=tk,
                                         total_tokens=x.shape[0], impl=impl, ms=round(ms, 4),
                                         eager_ms=None if eager is None else round(eager, 4),
                                         gbps=round(nbytes / (ms * 1e-3) / 1e9, 1),
                                         floor_ms=round(impl_floor_ms, 4),
                                         pct_of_floor=round(100 * impl_floor_ms / ms, 1), **common))
                        if args.kernel_times:
                            rows[-1]["kernels_us"], rows[-1]["launches_us"] = kernel_times(step)
                            print(f"  {impl} kernels (us a step): " + ", ".join(
                                f"{k.split('(')[0][:40]} {v}" for k, v in list(rows[-1]["kernels_us"].items())[:6]))
                            print(f"  {impl} launches in order (us): " + ", ".join(
                                f"{k} {v}" for k, v in rows[-1]["launches_us"]))
                        if impl not in fused and impl != "frozen_linear":  # (the LoRA products alone)
                            rows[-1]["pct_of_serial_floor"] = round(100 * (floor_ms + compute_ms) / ms, 1)
                        if impl == "ours_shadow":
                            rows[-1].update(shadow_write_ms=round(shadow_write_ms, 4), pct_of_floor_with_shadow_write=
                                            round(100 * impl_floor_ms / (ms + shadow_write_ms), 1))
                        line.append(f"{impl} {ms:7.3f} ms ({100 * impl_floor_ms / ms:4.0f}%)")
                    rows.append(dict(op="lora_fwd_bwd", shape=shape, n_adapters=n, ranks=rk, tokens=tk,
                                     total_tokens=x.shape[0], impl="floor", ms=round(floor_ms, 4),
                                     gbps=round(bandwidth, 1), pct_of_floor=100.0,
                                     compute_floor_ms=round(compute_ms, 4), **common))
                    print("  ".join(line) + f"  floor {floor_ms:.3f} ms", flush=True)
                    del x, base, w, wd, ws, grad, xg, params, gmm
                    write(args.out, rows)  # after every point: a run stopped early keeps what it measured
    write(args.out, rows)
    tuning_file = Path(args.out).with_suffix(".tuning.json")
    choices = tuning_choices()
    if args.resume and tuning_file.exists():  # (the earlier runs' choices first)
        earlier = json.loads(tuning_file.read_text())
        choices = {name: earlier.get(name, []) + entries for name, entries in choices.items()}
    tuning_file.write_text(json.dumps(choices, indent=1))
    summarize(rows)


def write(out: str, rows: list) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1))


def tuning_choices() -> dict:
    """The tiles each autotuned kernel chose, per tuning key (Triton's ``Autotuner.cache``): which layouts shared a
    choice, and whether two runs chose alike (the weight-gradient tuning has varied between runs)."""
    from lightning_multilora.kernels import triton_kernels

    return {name: [dict(key=list(map(str, key)), config=str(config))
                   for key, config in getattr(getattr(triton_kernels, name), "cache", {}).items()]
            for name in ("_rows_times_weight", "_rank_times_weight", "_weight_grad", "_ds_and_db")}


def summarize(rows) -> None:
    """Per implementation of ours and per rank kind: wins against grouped_mm and LoRAFusion, N=32 floor shares and
    speed-ups over the loop."""
    by_key = _points(rows)
    print()
    for impl in ("ours_shadow", "ours_direct", "ours"):
        for kind in sorted({k[2] for k in by_key}):
            points = {k: v for k, v in by_key.items() if k[2] == kind and impl in v}
            if not points:  # (an implementation left out with --impls)
                continue
            line = [f"{impl} r={kind}:"]
            versus = [v for v in points.values() if "grouped_mm" in v]
            if versus:
                wins = sum(v[impl]["ms"] <= v["grouped_mm"]["ms"] for v in versus)
                line.append(f"faster than grouped_mm at {wins}/{len(versus)} points;")
            n32 = [v for k, v in points.items() if k[1] == 32]
            if n32:
                pct = sorted(v[impl]["pct_of_floor"] for v in n32)
                line.append(f"N=32 at {pct[0]}..{pct[-1]}% of the floor (median {pct[len(pct) // 2]}%);")
                if impl == "ours_shadow":
                    pct = sorted(v[impl]["pct_of_floor_with_shadow_write"] for v in n32)
                    line.append(f"counting the optimizer's shadow write {pct[0]}..{pct[-1]}% (median "
                                f"{pct[len(pct) // 2]}%);")
                speed = sorted(v["loop"]["ms"] / v[impl]["ms"] for v in n32 if "loop" in v)
                if speed:
                    line.append(f"{speed[0]:.1f}x..{speed[-1]:.1f}x the loop")
            print(" ".join(line))
    fused = [v for v in by_key.values() if "lorafusion" in v and "ours_linear_direct" in v]
    if fused:
        wins = sum(v["ours_linear_direct"]["ms"] <= v["lorafusion"]["ms"] for v in fused)
        print(f"ours_linear_direct faster than LoRAFusion at {wins}/{len(fused)} points")


def _point(row: dict) -> tuple:
    """A row's point of the grid: (shape, N, ranks, tokens)."""
    return row["shape"], row["n_adapters"], row["ranks"], row["tokens"]


def _points(rows) -> dict:
    """Each point's rows by implementation."""
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(_point(r), {})[r["impl"]] = r
    return by_key


def _ms(v: dict, impl: str) -> str:
    return f"{v[impl]['ms']:.3f}" if impl in v else "-"


def report(rows) -> str:
    """``rows`` (a `--out` file's) as markdown: per tokens kind, the N=32 points of ours (``ours_shadow``, what
    `MultiLoRAModule` runs on CUDA, and ``ours_direct``) beside ``grouped_mm`` and the loop; the issue's goals over the
    whole grid; LoRAFusion beside ours with the frozen linear fused in."""
    by_key = _points(rows)
    ours = [i for i in ("ours_shadow", "ours_direct", "ours") if any(i in v for v in by_key.values())]
    out = []
    first = next(iter(rows), {})
    out.append(f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '?')}, "
               f"{first.get('date', '?')}; copy bandwidth {first.get('copy_gbps', '?')} GB/s; "
               f"{len(by_key)} points.")
    for tokens in sorted({k[3] for k in by_key}, key=str):
        keys = sorted(k for k in by_key if k[1] == 32 and k[3] == tokens)
        if not keys:
            continue
        out.append(f"\n### N = 32 adapters x {tokens} tokens\n")
        head = ["shape", "ranks"] + [c for i in ours for c in (f"{i} ms", "% of floor")] + [
            "grouped_mm ms", "loop ms", f"{ours[0]} vs loop"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|---|---|" + "---:|" * (len(head) - 2))
        for k in keys:
            v = by_key[k]
            cells = [k[0], str(k[2])]
            for i in ours:
                cells += [_ms(v, i), f"{v[i]['pct_of_floor']}%" if i in v else "-"]
            speed = f"{v['loop']['ms'] / v[ours[0]]['ms']:.1f}x" if "loop" in v and ours[0] in v else "-"
            cells += [_ms(v, "grouped_mm"), _ms(v, "loop"), speed]
            out.append("| " + " | ".join(cells) + " |")
    if ours:
        impl = ours[0]
        out.append(f"\n### Goals ({impl})\n")
        n32 = {k: v for k, v in by_key.items() if k[1] == 32 and impl in v}
        pct = sorted(v[impl]["pct_of_floor"] for v in n32.values())
        if pct:
            met = sum(p >= 70 for p in pct)
            out.append(f"- >= 70% of the floor at N=32: {met} of {len(pct)} points ({pct[0]}..{pct[-1]}%, median "
                       f"{pct[len(pct) // 2]}%); by ranks:")
            for kind in sorted({k[2] for k in n32}, key=str):
                p = sorted(v[impl]["pct_of_floor"] for k, v in n32.items() if k[2] == kind)
                out.append(f"  - {kind}: {p[0]}..{p[-1]}% (median {p[len(p) // 2]}%), {sum(x >= 70 for x in p)} of "
                           f"{len(p)} at or above 70%")
        speed = sorted(v["loop"]["ms"] / v[impl]["ms"] for v in n32.values() if "loop" in v)
        if speed:
            out.append(f"- the per-adapter loop at N=32: {speed[0]:.1f}x..{speed[-1]:.1f}x "
                       f"({sum(x >= 3 for x in speed)} of {len(speed)} points at 3x or more)")
        versus = {k: v for k, v in by_key.items() if impl in v and "grouped_mm" in v}
        losses = sorted(k for k, v in versus.items() if v[impl]["ms"] > v["grouped_mm"]["ms"])
        out.append(f"- faster than `torch._grouped_mm` at {len(versus) - len(losses)} of {len(versus)} points"
                   + (", slower (ours / grouped_mm) at:" if losses else ""))
        out += [f"  - {k[0]} N={k[1]} r={k[2]} t={k[3]}: {by_key[k][impl]['ms'] / by_key[k]['grouped_mm']['ms']:.2f}x"
                for k in losses]
    fused = {k: v for k, v in by_key.items() if "lorafusion" in v and "ours_linear_direct" in v}
    unrun = sum("ours_linear_direct" in v and "lorafusion" not in v for v in by_key.values())
    if fused:
        wins = sum(v["ours_linear_direct"]["ms"] <= v["lorafusion"]["ms"] for v in fused.values())
        out.append(f"- faster than LoRAFusion (the frozen linear fused in, N <= 4) at {wins} of {len(fused)} points"
                   + (f"; {unrun} more points it could not run (no row)" if unrun else ""))
        out.append("\n### LoRAFusion beside ours, the frozen linear fused in\n")
        out.append("| shape | N | ranks | tokens | frozen linear ms | LoRAFusion ms | ours (linear fused) ms | "
                   "LoRAFusion / ours |")
        out.append("|---|---:|---|---|---:|---:|---:|---:|")
        for k in sorted(fused, key=str):
            v = fused[k]
            ratio = v["lorafusion"]["ms"] / v["ours_linear_direct"]["ms"]
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {_ms(v, 'frozen_linear')} | {_ms(v, 'lorafusion')} | "
                       f"{_ms(v, 'ours_linear_direct')} | {ratio:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
