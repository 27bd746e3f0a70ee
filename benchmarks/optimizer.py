"""AdamW over N adapters' flat fp32 parameters: `GroupedAdamW` (one launch) vs. torch's fused and foreach AdamW.

Run on the GPU (about a minute on one H200):

    PYTHONPATH=. python benchmarks/optimizer.py --out benchmarks/results/optimizer_h200.json

Each adapter is one flat fp32 parameter of ``--numel`` elements (default: a Llama-3.1-8B adapter at r=16 on the 7
projections of 32 layers, 41.9 M), in its own param group with its own learning rate and weight decay, as
`MultiLoRAModule` holds them. One step reads the parameter, its gradient and both moments and writes the
parameter and the moments: 28 bytes per element. ``grouped_shadow`` also writes each parameter's bf16 shadow (what the
LoRA kernels read, `lightning_multilora.shadow`): 30 bytes. ``refresh`` is the copy into the shadows that stands in
for that write when another optimizer steps (`shadow.refresh`: 6 bytes). ``gbps`` is that traffic over the measured time and
``pct_of_copy`` its share of the device-to-device copy bandwidth measured in the same run. ``max_rel_diff``: after
five steps, the largest difference of any parameter from torch's single-tensor AdamW relative to that parameter's
largest value. Rows also go to a markdown table next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
from triton.testing import do_bench

from benchmarks.kernels import copy_bandwidth
from lightning_multilora.optim import GroupedAdamW
from lightning_multilora.shadow import Shadow, refresh, register_shadow, shadow_of

BYTES = {"grouped": 28, "grouped_shadow": 30, "fused": 28, "foreach": 28, "refresh": 6}


class Refresh:
    """The shadows' copy alone, forced (as after a step of an optimizer that does not write them)."""

    def __init__(self, params):
        self.shadows = [Shadow(p, [p], [0], torch.bfloat16) for p in params]

    def step(self):
        refresh(self.shadows, force=True)

LLAMA8B_R16 = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))


def make(n: int, numel: int, impl: str, device) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(numel, device=device, generator=gen).mul_(0.02).requires_grad_() for _ in range(n)]
    for p in params:
        p.grad = torch.randn(numel, device=device, generator=gen)
    groups = [{"params": [p], "lr": 1e-4 * (1 + i % 4), "weight_decay": 0.01 * (i % 3)} for i, p in enumerate(params)]
    if impl in ("grouped", "grouped_shadow"):
        if impl == "grouped_shadow":
            for p in params:
                register_shadow(p, Shadow(p, [p], [0], torch.bfloat16))
        return GroupedAdamW(groups), params
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True} if impl == "foreach" else {"foreach": False}
    return torch.optim.AdamW(groups, **kwargs), params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="+", default=[1, 8, 32], help="numbers of adapters")
    p.add_argument("--numel", type=int, default=LLAMA8B_R16, help="elements of each adapter's flat parameter")
    p.add_argument("--out", default="benchmarks/results/optimizer_h200.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizer.py measures on a CUDA GPU: torch finds none here")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                triton=__import__("triton").__version__, python=platform.python_version(),
                date=datetime.now(timezone.utc).date().isoformat(), copy_gbps=round(bandwidth, 1))
    print(meta, flush=True)
    rows = []
    for n in args.ns:
        small = min(args.numel, 1 << 20)  # correctness on a smaller copy of the same setting
        reference, ref_params = make(n, small, "single", device)
        for impl in ("grouped", "grouped_shadow", "fused", "foreach", "refresh"):
            if impl == "refresh":
                diff = 0.0
                params = make(n, args.numel, "foreach", device)[1]
                opt = Refresh(params)
            else:
                opt, params = make(n, small, impl, device)
                for _ in range(5):
                    opt.step()
                if impl == "grouped":  # five steps of the reference once
                    for _ in range(5):
                        reference.step()
                diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(params, ref_params))
                if impl == "grouped_shadow":
                    assert all(shadow_of(p).fresh() and torch.equal(shadow_of(p).tensor, p.detach().bfloat16())
                               for p in params), "the shadows are not the parameters in bf16"
                del opt, params
                opt, params = make(n, args.numel, impl, device)
            ms = do_bench(opt.step, warmup=5, rep=50)
            gbps = BYTES[impl] * n * args.numel / (ms * 1e-3) / 1e9
            row = dict(meta, n_adapters=n, numel=args.numel, impl=impl, ms=round(ms, 3), gbps=round(gbps, 1),
                       pct_of_copy=round(100 * gbps / bandwidth, 1), max_rel_diff=float(f"{diff:.2e}"))
            rows.append(row)
            print(f"N={n:3d} {impl:8s} {ms:8.3f} ms {gbps:7.1f} GB/s {row['pct_of_copy']:5.1f}% of copy  "
                  f"max rel diff {diff:.1e}", flush=True)
            del opt, params
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# AdamW over N adapters ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
             f"copy bandwidth {meta['copy_gbps']} GB/s)", "",
             "| N | elements each | impl | ms | GB/s | % of copy | max rel diff |", "|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['n_adapters']} | {r['numel']} | {r['impl']} | {r['ms']} | {r['gbps']} | {r['pct_of_copy']} | "
              f"{r['max_rel_diff']:.1e} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
