"""Tiles chosen inside the step, not alone: how much faster the forward + backward would be (ours_shadow).

Run on the H200 (``--budget-s`` stops early; the points done are written after each one):

    PYTHONPATH=. python benchmarks/tune_in_context.py --shapes 0 1 --ns 8 32 --ranks mixed --tokens 256 \
        --out benchmarks/results/tune_in_context_h200.json

The package tunes each launch alone (Triton's autotuner: every candidate timed by `triton_kernels._quick_bench`, a
cold L2 before each run) and keeps the fastest per tuning key. Two processes choose differently at many of the keys
(session 40: 47 of 121 between two runs of the same 18 points), and the step's time then differs by up to
20% (`benchmarks/results/kernels_h200.md`). This measures what choosing in the step would give: for each point of
`benchmarks/kernels.py`'s grid asked for (its seeds, so the same ranks and tokens), the launches are tuned as the
package tunes them (this process's own timings: Triton's disk cache of choices is not read), the step is timed
(`benchmarks.kernels.graph_ms`: CUDA graph, cold L2), and then, one tuning key at a time, the step is timed with each
of that key's candidates (the ``--top`` fastest alone) and the fastest kept (``--passes`` rounds over the keys).

Rows go to ``--out`` (after every point), one per point: ms with the tiles chosen alone (``ms_alone``; timed again
after the search, ``ms_alone_again``: the timing's own spread) and in the step (``ms_in_context``), the slowest step
seen with one key's choice changed (``ms_worst_single``), the share of the copy-bandwidth floor of both, and per key
(each pass) the kernel, its candidates, the choice alone and in the step, the step's time with each tried and each
candidate's time alone (``keys``); GPU, versions and date beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import triton

from benchmarks.kernels import (SHAPES, copy_bandwidth, floor_bytes, graph_ms, make, ranks_for, shadow_step,
                               tokens_for)
from lightning_multilora.kernels import triton_kernels as K
from lightning_multilora.kernels import triton_lora as TL
from lightning_multilora.kernels.triton_lora import reset_rank_tiles

TUNED = ("_rows_times_weight", "_rank_times_weight", "_weight_grad", "_ds_and_db")
# A candidate that cannot run at a key (more shared memory than the GPU has: the autotuner timed it as inf) raises
# these when forced on the step
CANNOT_RUN = tuple(getattr(triton.runtime.errors, n) for n in ("OutOfResources", "PTXASError")
                   if hasattr(triton.runtime.errors, n))


class Recorder:
    """Each tuned kernel's candidates per tuning key, as its autotuner pruned them when it first met the key, and
    their times alone (`alone_times`)."""

    def __init__(self) -> None:
        self.candidates: dict[tuple[str, tuple], list] = {}
        self.alone: dict[tuple[str, tuple], dict] = {}
        self._pending: dict[str, list] = {name: [] for name in TUNED}
        for name in TUNED:
            tuner = getattr(K, name)
            tuner.cache_results = False  # (choose by this process's timings, not an earlier one's)
            prune = tuner.prune_configs

            def logged(kwargs, _prune=prune, _name=name):
                pruned = _prune(kwargs)
                self._pending[_name].append(list(pruned))
                return pruned

            tuner.prune_configs = logged

    def clear(self) -> None:
        for name in TUNED:
            getattr(K, name).cache.clear()
            self._pending[name].clear()
        self.candidates.clear()
        self.alone.clear()
        relaunch()

    def collect(self) -> None:
        """Pair the keys the step added to each cache (in the order met) with the candidate lists logged."""
        for name in TUNED:
            tuner = getattr(K, name)
            keys = list(tuner.cache)
            if len(keys) != len(self._pending[name]):
                raise RuntimeError(f"{name}: {len(keys)} tuning keys but {len(self._pending[name])} prunings logged")
            for key, configs in zip(keys, self._pending[name]):
                self.candidates[(name, key)] = configs


def relaunch() -> None:
    """Make the next launches read the autotuners' choices again: the package's launchers keep each variant's compiled
    kernel and tiles after its first launch (`launch.FastLauncher`), and a weight-gradient key tunes on scratch
    gradients once (`triton_lora._tuned_grad_keys`)."""
    for name in TUNED:
        getattr(TL, name)._variants.clear()
    TL._tuned_grad_keys.clear()


def alone_times(rec: Recorder, step) -> None:
    """Time every candidate of every key alone, as the autotuner does, but for each key (Triton keeps only the last
    key's timings): each key's cache entry removed in turn and the step run once, so the tuner times that key again."""
    for (name, key) in list(rec.candidates):
        tuner = getattr(K, name)
        if len(rec.candidates[(name, key)]) < 2:
            continue
        chosen = tuner.cache.pop(key)
        before = len(rec._pending[name])
        relaunch()
        step()
        torch.cuda.synchronize()
        del rec._pending[name][before:]  # (the re-pruning: same list)
        rec.alone[(name, key)] = dict(getattr(tuner, "configs_timings", {}))
        tuner.cache[key] = chosen  # (the first tuning's choice stays the package's)
    relaunch()


def median_ms(timing) -> float:
    return timing[0] if isinstance(timing, (list, tuple)) else timing


def ms_or_none(value: float):
    """Rounded for the rows, None where not finite (JSON has no infinity)."""
    return round(value, 4) if math.isfinite(value) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=int, nargs="+", default=[0, 1], help="indices into benchmarks.kernels.SHAPES")
    parser.add_argument("--ns", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--ranks", nargs="+", default=["mixed"])
    parser.add_argument("--tokens", nargs="+", default=["256"])
    parser.add_argument("--top", type=int, default=6, help="candidates a key tried in the step, the fastest alone")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="start no new point after this many seconds")
    parser.add_argument("--out", default="benchmarks/results/tune_in_context_h200.json")
    args = parser.parse_args()
    if args.top < 1 or args.passes < 1:
        parser.error(f"--top and --passes must be 1 or more, got {args.top} and {args.passes}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tune_in_context.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    common = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), copy_gbps=round(bandwidth, 1))
    rec, rows, start = Recorder(), [], time.monotonic()
    for si in args.shapes:
        d_in, d_out = SHAPES[si]
        for n in args.ns:
            for rk in args.ranks:
                for tk in args.tokens:
                    if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                        print(f"budget of {args.budget_s:.0f} s reached: skipping {d_in}x{d_out} N={n} r={rk} t={tk}")
                        continue
                    rng = random.Random(f"{d_in}-{d_out}-{n}-{rk}-{tk}")  # (the grid's draw for the point)
                    ranks, tokens = ranks_for(rk, n, rng), tokens_for(tk, n, rng)
                    rows.append(dict(point(rec, d_in, d_out, ranks, tokens, args, bandwidth, device),
                                     shape=f"{d_in}x{d_out}", n_adapters=n, ranks=rk, tokens=tk, impl="ours_shadow"))
                    r = rows[-1]
                    print(f"{r['shape']} N={n} r={rk} t={tk}: alone {r['ms_alone'] * 1e3:.1f} us "
                          f"({r['pct_of_floor_alone']:.0f}%), in the step {r['ms_in_context'] * 1e3:.1f} us "
                          f"({r['pct_of_floor_in_context']:.0f}%), worst single change "
                          f"{r['ms_worst_single'] * 1e3:.1f} us; {r['keys_changed']} of {r['keys_tuned']} keys changed",
                          flush=True)
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(dict(common, rows=rows), indent=1))


def point(rec: Recorder, d_in, d_out, ranks, tokens, args, bandwidth, device) -> dict:
    torch.manual_seed(0)
    reset_rank_tiles()
    rec.clear()
    x, base, w = make(d_in, d_out, ranks, tokens, device)
    grad = torch.randn_like(base)
    for p in (*w.a, *w.b):  # (gradients added into, as every timed step does: the keys tuned are the steps' keys)
        p.grad = torch.zeros_like(p)
    step = shadow_step(x, base, w, grad)
    step()  # (tunes every key, as the package would)
    torch.cuda.synchronize()
    rec.collect()
    alone_times(rec, step)
    floor_ms = floor_bytes(x, base, w) / (bandwidth * 1e6)
    ms_alone = graph_ms(step)
    package = {nk: getattr(K, nk[0]).cache[nk[1]] for nk in rec.candidates}  # (the tiles chosen alone)
    worst, keys = ms_alone, []
    for _ in range(args.passes):
        for (name, key), configs in rec.candidates.items():
            if len(configs) < 2:
                continue
            tuner = getattr(K, name)
            timings = rec.alone.get((name, key), {})
            ranked = sorted((c for c in configs if c in timings and math.isfinite(median_ms(timings[c]))),
                            key=lambda c: median_ms(timings[c]))  # (those that ran alone, fastest first)
            kept, tried = tuner.cache[key], {}
            for cand in (kept, *ranked[: args.top]):  # (the choice kept timed again beside the others)
                if str(cand) in tried:
                    continue
                tuner.cache[key] = cand
                relaunch()
                try:
                    tried[str(cand)] = graph_ms(step)
                except CANNOT_RUN:  # (raised in graph_ms' eager warm-up, before any capture)
                    tried[str(cand)] = float("inf")
                    torch.cuda.synchronize()
                if math.isfinite(tried[str(cand)]):
                    worst = max(worst, tried[str(cand)])
            choice = min(tried, key=tried.get)
            tuner.cache[key] = next(c for c in configs if str(c) == choice)
            relaunch()
            keys.append(dict(kernel=name, key=list(map(str, key)), candidates=len(configs),
                             alone=str(package[(name, key)]), in_context=choice,
                             step_ms={c: ms_or_none(t) for c, t in tried.items()},
                             alone_ms={str(c): ms_or_none(median_ms(t)) for c, t in timings.items()}))
    changed = sum(getattr(K, name).cache[key] is not config for (name, key), config in package.items())
    ms_in_context = graph_ms(step)  # (the choices together, timed again)
    for (name, key), config in package.items():  # (the choices alone again: the timing's own spread)
        getattr(K, name).cache[key] = config
    relaunch()
    ms_alone_again = graph_ms(step)
    del x, base, w, grad, step
    return dict(ms_alone=round(ms_alone, 4), ms_alone_again=round(ms_alone_again, 4),
                ms_in_context=round(ms_in_context, 4), ms_worst_single=round(worst, 4),
                floor_ms=round(floor_ms, 4), pct_of_floor_alone=round(100 * floor_ms / ms_alone, 1),
                pct_of_floor_in_context=round(100 * floor_ms / ms_in_context, 1),
                keys_changed=changed, keys_tuned=sum(len(c) > 1 for c in rec.candidates.values()), keys=keys)


if __name__ == "__main__":
    main()
