"""Greedy (ALTO) vs CP-SAT slot filling on a simulated sweep: adapters admitted, tokens/s, makespan.

    PYTHONPATH=. python benchmarks/admission.py --out benchmarks/results/admission.json

A sweep of ``--configs`` LoRA configurations (ranks 8-128, batch sizes 1-8, 100-1000 steps) on one H200
with a Llama-3.1-8B-shaped base at seq 1024. Memory: `MemoryFit` with the coefficients fitted to the
H200 peaks measured by packed_step.py (tests/scheduling/fixtures); step time: the H200 frozen-base steps
at seq 1024 (about 60 ms + 95 ms per row, LoRA +20%). Runs on the CPU (the simulation is on a virtual
clock); the machine is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from datetime import datetime, timezone
from pathlib import Path

from lightning_multilora.scheduling import (
    AdmissionController,
    CPSATAdmission,
    MemoryFit,
    MemoryPoint,
    ModelShape,
    fit_predictor,
    simulate_sweep,
)
from lightning_multilora.spec import AdapterSpec

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "scheduling" / "fixtures" / "h200_llama8b_peaks.json"
SEQ = 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", type=int, default=120)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/admission.json")
    args = parser.parse_args()
    fixture = json.loads(FIXTURE.read_text())
    shape = ModelShape.from_config(fixture["config"])
    fit = MemoryFit.fit([MemoryPoint(p["n_adapters"], p["batch_size"], p["seq_len"],
                                     p["n_adapters"] * shape.adapter_params(p["rank"]), p["peak_gib"] * 2**30)
                         for p in fixture["points"]])
    params_of = lambda s: shape.adapter_params(s.rank)  # noqa: E731
    step = lambda specs: (0.06 + 0.095 * sum(s.batch_size for s in specs)) * 1.2  # noqa: E731
    rows = []
    for seed in range(args.seeds):
        rng = random.Random(seed)
        specs = [AdapterSpec(f"c{i}", rank=rng.choice([8, 16, 32, 64, 128]), batch_size=rng.choice([1, 2, 4, 8]),
                             max_steps=rng.choice([100, 200, 500, 1000])) for i in range(args.configs)]
        for name, ctrl in (("greedy", AdmissionController(fit_predictor(fit, SEQ, params_of), 141e9, 0.9)),
                           ("cpsat", CPSATAdmission(fit, SEQ, params_of, 141e9, 0.9))):
            start = time.perf_counter()
            result = simulate_sweep(ctrl, specs, step, SEQ)
            rows.append(dict(policy=name, seed=seed, configs=args.configs, decide_s=round(time.perf_counter() - start, 2),
                             **{k: round(v, 2) for k, v in result.items()}))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores (CPU)",
            "date": datetime.now(timezone.utc).date().isoformat(), "ortools": __import__("ortools").__version__,
            "fit": {"k0_gib": round(fit.k0 / 2**30, 2), "k1": fit.k1, "k2": fit.k2}}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
