"""How many packed LoRA adapters fit, and how fast they step, on a 4-bit (QLoRA) vs a bf16 base.

Run on the H200 (about 3-4 minutes; needs bitsandbytes, carried as a wheel where the image lacks it):

    PYTHONPATH=. python benchmarks/qlora.py --out benchmarks/results/qlora_h200.json

Check the script end to end on a CPU (tiny model, bitsandbytes' CPU 4-bit path; writes to a temp file):

    PYTHONPATH=. python benchmarks/qlora.py --tiny --ns 1 2 --fit-check 0 --out /tmp/qlora.json

The base is the Llama-3.1-8B-shaped model of `packed_step.py` (random bf16 weights, sdpa, gradient
checkpointing). For the 4-bit variant every decoder linear becomes a bitsandbytes ``Linear4bit`` (NF4, bf16
compute, the weights quantized on the GPU; ``lm_head`` and embeddings stay bf16, as QLoRA leaves them).
Adapters are r=16, alpha=32, on the 7 projections, fp32 weights, batch 1 each at ``--seq`` tokens; the
optimizer is ``--optimizer`` (default bitsandbytes ``PagedAdamW8bit``, one param group per adapter, weight
decay 0.01: ALTO's setting). For each base and each N in ``--ns``: step time (median of ``--reps`` after a
warm-up step) and peak reserved memory. ``peak(N) = p0 + p1 * N`` is fitted on those points; the largest N
whose predicted peak stays inside ``--margin`` of the GPU is reported, and (``--fit-check 1``) one step at
that N is run to show that it fits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

# Run as `python benchmarks/<script>.py`, this folder led the import path, and its kernels.py hid Hugging Face's
# `kernels` package, which transformers imports as it builds a model: the folder is taken off the path (the
# `benchmarks.` imports come from the repository root, PYTHONPATH=.)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import torch
from torch import nn

from benchmarks.packed_step import (ALPHA, LR, RANK, TARGETS, build_model, lm_backward, pick_device, restore_base,
                                    sync)
from lightning_multilora.layer import inject_multilora
from lightning_multilora.layout import BatchLayout


def quantize_decoder(model: nn.Module, device: torch.device) -> int:
    """Every ``nn.Linear`` of the decoder layers becomes an NF4 ``Linear4bit`` (bf16 compute), one at a time
    so that the bf16 and 4-bit copies of the whole model never coexist. Returns how many were replaced."""
    import bitsandbytes as bnb

    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu") if device.type == "cpu" else child.weight.data,
                                             requires_grad=False, quant_type="nf4").to(device)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                q.requires_grad_(False)
                setattr(parent, name, q)
                replaced += 1
                del child
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return replaced


def make_optimizer(name: str, groups: list[dict]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=LR, weight_decay=0.01, fused=torch.cuda.is_available() or None)
    import bitsandbytes as bnb

    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    return cls(groups, lr=LR, weight_decay=0.01)


def run_n(model: nn.Module, layers, n: int, seq: int, reps: int, optimizer_name: str,
          device: torch.device) -> dict:
    """One warm-up step and ``reps`` timed steps of ``n`` batch-1 adapters; OOM is reported, not raised."""
    names = [f"q{i}" for i in range(n)]
    for i, name in enumerate(names):
        layers.add_adapter(name, rank=RANK, alpha=ALPHA, seed=i)
    row: dict = dict(n_adapters=n, step_ms=None, peak_reserved_gib=None, tokens_per_s=None, note=None)
    optimizer = None
    try:
        optimizer = make_optimizer(optimizer_name, [dict(params=list(layers.parameters_of(nm))) for nm in names])
        layout = BatchLayout.from_sizes(names, [1] * n)
        ids = torch.randint(model.config.vocab_size, (n, seq), device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for rep in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            with layers.use(layout):
                lm_backward(model, ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            if rep:
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        row.update(step_ms=round(ms, 1), tokens_per_s=round(n * seq / (ms / 1e3)))
        if device.type == "cuda":
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    except torch.OutOfMemoryError as err:
        row["note"] = f"out of memory ({str(err).splitlines()[0][:120]})"
    finally:
        del optimizer
        for name in names:
            layers.remove_adapter(name)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"    N={n}: {row['step_ms']} ms, peak {row['peak_reserved_gib']} GiB {row['note'] or ''}", flush=True)
    return row


def fit_line(rows: list[dict]) -> tuple[float, float] | None:
    pts = [(r["n_adapters"], r["peak_reserved_gib"]) for r in rows if r["peak_reserved_gib"] is not None]
    if len(pts) < 2:
        return None
    mx = sum(n for n, _ in pts) / len(pts)
    my = sum(p for _, p in pts) / len(pts)
    slope = sum((n - mx) * (p - my) for n, p in pts) / sum((n - mx) ** 2 for n, _ in pts)
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--ns", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--optimizer", choices=["adamw", "adamw8bit", "paged_adamw8bit"], default="paged_adamw8bit")
    p.add_argument("--bases", nargs="+", choices=["bf16", "nf4"], default=["nf4", "bf16"])
    p.add_argument("--margin", type=float, default=0.9, help="fraction of the GPU's memory a predicted peak may use")
    p.add_argument("--fit-check", type=int, choices=[0, 1], default=1, help="run one step at the largest N that fits")
    p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU: checks the script end to end")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or (Path(tempfile.gettempdir()) / "qlora.json" if args.tiny
                       else Path("benchmarks/results/qlora_h200.json"))
    device = pick_device(args.tiny)
    import bitsandbytes
    import transformers

    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    results = []
    for base in args.bases:
        start = time.perf_counter()
        torch.manual_seed(0)
        model = build_model(args.tiny, args.seq, device)
        replaced = quantize_decoder(model, device) if base == "nf4" else 0
        sync(device)
        weights_gib = round(torch.cuda.memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        print(f"{base} base: {replaced} linears quantized, weights {weights_gib} GiB, "
              f"built in {time.perf_counter() - start:.0f} s", flush=True)
        layers = inject_multilora(model, TARGETS)
        rows = [run_n(model, layers, n, args.seq, args.reps, args.optimizer, device) for n in args.ns]
        line = fit_line(rows)
        fits = None
        check = None
        if line is not None and capacity is not None and line[1] > 0:
            fits = int((args.margin * capacity - line[0]) // line[1])
            if args.fit_check and fits > 0:
                check = run_n(model, layers, fits, args.seq, 1, args.optimizer, device)
        results.append(dict(base=base, linears_quantized=replaced, weights_gib=weights_gib, points=rows,
                            peak_fit_gib=dict(p0=round(line[0], 2), per_adapter=round(line[1], 4)) if line else None,
                            max_adapters_predicted=fits, max_adapters_check=check))
        restore_base(model, layers)
        del model, layers
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    doc = dict(
        benchmark="qlora", model="tiny-llama (random bf16)" if args.tiny else "Llama-3.1-8B-shaped (random bf16)",
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        capacity_gib=round(capacity, 1) if capacity else None, seq=args.seq, batch_size=1, rank=RANK,
        targets=TARGETS, optimizer=args.optimizer, margin=args.margin, torch=torch.__version__,
        transformers=transformers.__version__, bitsandbytes=bitsandbytes.__version__,
        date=datetime.now(timezone.utc).date().isoformat(), results=results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| base | weights GiB | N | step ms | tokens/s | peak GiB |\n|---|---:|---:|---:|---:|---:|")
    for r in results:
        for pt in r["points"] + ([r["max_adapters_check"]] if r["max_adapters_check"] else []):
            print(f"| {r['base']} | {r['weights_gib']} | {pt['n_adapters']} | {pt['step_ms']} | {pt['tokens_per_s']} | "
                  f"{pt['peak_reserved_gib']} |")
        print(f"{r['base']}: peak fit {r['peak_fit_gib']}, largest N predicted to fit: {r['max_adapters_predicted']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
