"""Memory profile, fit and admission of a Llama-3.1-8B-shaped model on the GPU (ALTO's profiler).

Run on the H200 (about 4-5 minutes):

    PYTHONPATH=. python benchmarks/memory_model.py --out benchmarks/results/memory_model_h200.json

Check the script end to end on a CPU (no GPU: the analytic model stands in for the measured peaks, and
the admitted run is not executed; writes to a temp file):

    PYTHONPATH=. python benchmarks/memory_model.py --dry-run --out /tmp/memory_model.json

Steps: (1) `MemoryProfiler`: binary search of ``B_max`` with one adapter, then the ``(N, b)`` grid, one
real training step each (r=16 adapters on the 7 projections, seq ``--seq``, gradient checkpointing, AdamW),
peak = ``torch.cuda.max_memory_reserved``; fit ``M = k0 + k1*B*L + k2*P``. (2) Held-back points (not in
the grid) measured and predicted: relative error (goal <= 5%). (3) `AdmissionController` with the fit:
how many batch-1 adapters it admits next to the base (goal >= 64 at seq 1024), and a run of that many
for ``--steps`` steps: no out-of-memory, tokens/s. The analytic model's prediction is reported beside.
(4) The checkpointing decision: ``--compare-checkpointing N`` batch-1 adapters stepped with and without
gradient checkpointing (step time and peak both ways), and what `choose_gradient_checkpointing` decides for
them from the analytic model.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.packed_step import ALPHA, LLAMA_31_8B, LR, RANK, TARGETS, build_model, lm_backward
from lightning_multilora.layer import inject_multilora
from lightning_multilora.kernels.recompute import checkpointing_kwargs
from lightning_multilora.layout import BatchLayout
from lightning_multilora.scheduling import (
    AdmissionController,
    AnalyticMemoryModel,
    MemoryProfiler,
    ModelShape,
    cuda_step_measure,
    fit_predictor,
)
from lightning_multilora.spec import AdapterSpec

HELD_BACK = [(3, 1), (6, 2), (12, 1), (24, 1), (5, 4), (40, 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--safety-margin", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=3, help="steps of the admitted run")
    p.add_argument("--max-batch", type=int, default=40,
                   help="upper end of the B_max search (the grid needs b <= 32, the held-back points N*b <= 40; "
                        "a search up to the real B_max, ~300 rows at seq 1024, costs minutes of huge steps)")
    p.add_argument("--compare-checkpointing", type=int, default=4, metavar="N",
                   help="adapters (batch 1) timed with and without gradient checkpointing (0: skip)")
    p.add_argument("--dry-run", action="store_true", help="CPU: analytic peaks instead of measured ones")
    p.add_argument("--allocator", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF of the run ('' for the default): expandable segments keep the "
                        "reserved peaks close to what is allocated, so they are linear enough to fit")
    p.add_argument("--no-guard", action="store_true",
                   help="admit on the fit alone, without the analytic model as the guard beyond the profiled points")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.allocator:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.allocator)  # before the first CUDA allocation
    out = args.out or (Path(tempfile.gettempdir()) / "memory_model.json" if args.dry_run
                       else Path("benchmarks/results/memory_model_h200.json"))
    shape = ModelShape.from_config(LLAMA_31_8B)
    analytic = AnalyticMemoryModel(shape, loss_chunk_tokens=4096)
    params = shape.adapter_params(RANK, TARGETS)

    if args.dry_run:
        capacity = 141e9
        measure = lambda n, b: (None if (m := analytic.predict([(RANK, b, TARGETS)] * n, args.seq)) > capacity  # noqa: E731
                                else m)
        gpu, layers, model = "dry run (analytic peaks)", None, None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/memory_model.py measures on a CUDA GPU: torch finds none here")
        device = torch.device("cuda")
        capacity = torch.cuda.get_device_properties(device).total_memory
        gpu = torch.cuda.get_device_name(device)
        model = build_model(False, args.seq, device)
        layers = inject_multilora(model, TARGETS)

        def step(n: int, b: int) -> None:
            names = [f"p{i}" for i in range(n)]
            for i, name in enumerate(names):
                layers.add_adapter(name, rank=RANK, alpha=ALPHA, seed=i)
            try:
                params_ = [q for name in names for q in layers.parameters_of(name)]
                optimizer = torch.optim.AdamW(params_, lr=LR, fused=True)
                ids = torch.randint(shape.vocab_size, (n * b, args.seq), device=device)
                with layers.use(BatchLayout.from_sizes(names, [b] * n)):
                    lm_backward(model, ids)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            finally:
                for name in names:
                    layers.remove_adapter(name)

        measure = cuda_step_measure(step, device)

    start = time.perf_counter()
    profiler = MemoryProfiler(measure, capacity, args.seq, params, args.safety_margin, max_batch=args.max_batch)
    fit = profiler.profile(dict(model="llama-3.1-8b-shaped", seq_len=args.seq, ranks=[RANK], targets=TARGETS,
                                checkpointing=True, gpu=gpu))
    profile_s = time.perf_counter() - start
    held = []
    for n, b in HELD_BACK:
        if n * b > profiler.b_max:
            continue
        peak = measure(n, b)
        if peak is None:
            continue
        pred = fit.predict(n * b * args.seq, n * params)
        held.append(dict(n_adapters=n, batch_size=b, measured_gib=round(peak / 2**30, 2),
                         predicted_gib=round(pred / 2**30, 2), rel_error=round(abs(pred - peak) / peak, 4),
                         analytic_gib=round(analytic.predict([(RANK, b, TARGETS)] * n, args.seq) / 2**30, 2)))

    guard = lambda ss: analytic.predict([(s.rank, s.batch_size, TARGETS) for s in ss], args.seq)  # noqa: E731
    ctrl = AdmissionController(fit_predictor(fit, args.seq, lambda s: shape.adapter_params(s.rank, TARGETS),
                                             beyond=None if args.no_guard else guard),
                               capacity, args.safety_margin)
    candidates = [AdapterSpec(f"c{i}", rank=RANK, batch_size=1) for i in range(512)]
    admitted = len(ctrl.plan(candidates))
    run = dict(admitted=admitted, steps=args.steps, oom=None, tokens_per_s=None, peak_gib=None,
               predicted_gib=round(fit.predict(admitted * args.seq, admitted * params) / 2**30, 2),
               budget_gib=round(capacity * args.safety_margin / 2**30, 2))
    if not args.dry_run:
        names = [f"run{i}" for i in range(admitted)]
        for i, name in enumerate(names):
            layers.add_adapter(name, rank=RANK, alpha=ALPHA, seed=i)
        optimizer = torch.optim.AdamW([q for name in names for q in layers.parameters_of(name)], lr=LR, fused=True)
        ids = torch.randint(shape.vocab_size, (admitted, args.seq), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                with layers.use(BatchLayout.from_sizes(names, [1] * admitted)):
                    lm_backward(model, ids)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            run.update(oom=False, tokens_per_s=round(admitted * args.seq * args.steps / (time.perf_counter() - t0)),
                       peak_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 2))
        except torch.cuda.OutOfMemoryError:
            run["oom"] = True
        del optimizer, ids
        for name in names:
            layers.remove_adapter(name)
        torch.cuda.empty_cache()

    compare = None
    if args.compare_checkpointing:
        from lightning_multilora.scheduling import choose_gradient_checkpointing

        n = args.compare_checkpointing
        specs = [AdapterSpec(f"k{i}", rank=RANK, batch_size=1) for i in range(n)]
        analytic_without = AnalyticMemoryModel(shape, loss_chunk_tokens=4096, gradient_checkpointing=False)
        as_tuples = lambda ss: [(s.rank, s.batch_size, TARGETS) for s in ss]  # noqa: E731
        try:
            keep = choose_gradient_checkpointing(specs, lambda ss: analytic.predict(as_tuples(ss), args.seq),
                                                 lambda ss: analytic_without.predict(as_tuples(ss), args.seq),
                                                 capacity * args.safety_margin)
        except ValueError as err:
            keep = str(err)
        compare = dict(adapters=n, decision_keep_checkpointing=keep,
                       predicted_gib={"with": round(analytic.predict(as_tuples(specs), args.seq) / 2**30, 2),
                                      "without": round(analytic_without.predict(as_tuples(specs), args.seq) / 2**30, 2)})
        if not args.dry_run:
            for label, enable in (("with", True), ("without", False)):
                if enable:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())
                else:
                    model.gradient_checkpointing_disable()
                times = []
                peak = None
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    peak = measure(n, 1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                compare[f"step_s_{label}"] = round(sorted(times)[1], 3)  # includes adding/removing the adapters
                compare[f"peak_gib_{label}"] = None if peak is None else round(peak / 2**30, 2)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())

    result = dict(gpu=gpu, torch=torch.__version__, date=datetime.now(timezone.utc).date().isoformat(),
                  allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), max_batch=args.max_batch,
                  seq_len=args.seq, safety_margin=args.safety_margin, capacity_gib=round(capacity / 2**30, 2),
                  b_max=profiler.b_max, profile_s=round(profile_s, 1),
                  fit=dict(k0_gib=round(fit.k0 / 2**30, 3), k1_bytes_per_token=fit.k1, k2_bytes_per_param=fit.k2,
                           max_rel_error_on_grid=round(max(fit.relative_errors(fit.points)), 4)),
                  points=[dict(n_adapters=q.n_adapters, batch_size=q.batch_size, peak_gib=round(q.peak_bytes / 2**30, 2))
                          for q in fit.points],
                  held_back=held, admission=run, checkpointing=compare)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "points"}, indent=1))


if __name__ == "__main__":
    main()
