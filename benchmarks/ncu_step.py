"""Where one forward + backward spends its time, launch by launch, from the GPU's counters (Nsight Compute).

    PYTHONPATH=. python benchmarks/ncu_step.py --shape 4096 4096 --ranks 64 --tokens 1024 \
        --out benchmarks/results/kernels_h200_ncu.json

Builds `benchmarks/kernels.py`'s ``ours_shadow`` point (32 adapters by default, bf16 activations, fp32 adapters read
through bf16 shadows, gradients accumulated; the same random ranks and tokens for ``mixed``), runs its step a few
times in a process of its own (the autotuner's choices then sit in Triton's on-disk cache), then again under ``ncu
--profile-from-start off --clock-control none --set full`` with the profiled range around one step, and writes per
launch: duration, DRAM and L2 throughput (% of peak), memory throughput, L2 hit rate, achieved occupancy, registers,
shared memory a program, issued IPC, grid and block. ``--ncu-log``: the ncu report as text, beside the rows.
``--parse FILE``: only read an earlier ncu text report (``--page details``) into rows (labelled with the
``--shape``, ``--ranks``, ``--tokens`` given).

Needs ``ncu`` with access to the counters (the H200 image has it at /usr/local/cuda/bin/ncu; a machine whose
runtime hides the counters fails at its first kernel). ncu replays each launch several times, restoring memory between
passes, so gradient accumulation does not run away; its clocks are left alone (``--clock-control none``), so durations
are the boost clock's, close to `benchmarks/kernels.py --kernel-times` (eager launches, profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

# (metric name in ncu's details page, its unit there (a unit's tail: "byte/s" takes Tbyte/s, Gbyte/s...) or None for
# any, row field); the units that ncu scales (`_SCALE`) are converted to the field's, an unknown one refused
_METRICS = (("Duration", None, "duration_us"), ("DRAM Throughput", "%", "dram_pct"),
            ("L2 Cache Throughput", "%", "l2_pct"), ("Memory Throughput", "byte/s", "memory_tbps"),
            ("L2 Hit Rate", "%", "l2_hit_pct"), ("Achieved Occupancy", "%", "achieved_occupancy_pct"),
            ("Registers Per Thread", None, "registers"), ("Dynamic Shared Memory Per Block", None, "shared_kb"),
            ("Executed Ipc Active", None, "ipc"), ("Compute (SM) Throughput", "%", "sm_pct"))
_SCALE = {"duration_us": {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6},
          "memory_tbps": {"Tbyte/s": 1.0, "Gbyte/s": 1e-3, "Mbyte/s": 1e-6},
          "shared_kb": {"byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}}
# a launch's header line: its name (a C++ kernel's holds spaces), grid and block
_LAUNCH = re.compile(r"^  (.+?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context", re.MULTILINE)


_SECTION = re.compile(r"^\s+Section: Command line profiler metrics\n((?:\s+.*\n?)*?)(?=^\s+Section:|\Z|^\s*$)",
                      re.MULTILINE)
_RAW = re.compile(r"^\s+([a-z][\w.:]+)\s+(?:(\S+)\s+)?([\d,.]+)\s*$", re.MULTILINE)


def parse_ncu_details(text: str) -> list[dict]:
    """One row per profiled launch of an ncu ``--page details`` report: the kernel's name, grid, block and
    `_METRICS` (durations in us, shared memory in KB); with metrics asked for by name (``--metrics``), ``metrics``:
    each one's value and unit as ncu printed them."""
    heads = list(_LAUNCH.finditer(text))
    rows = []
    for head, nxt in zip(heads, heads[1:] + [None]):
        body = text[head.end():nxt.start() if nxt else len(text)]
        row = dict(kernel=head.group(1), grid=[int(head.group(i)) for i in (2, 3, 4)],
                   block=[int(head.group(i)) for i in (5, 6, 7)])
        for metric, unit, field in _METRICS:
            pattern = r"\S*" + re.escape(unit) if unit else r"\S+"
            found = re.search(rf"^\s+{re.escape(metric)}\s+({pattern})\s+([\d,.]+)\s*$", body, re.MULTILINE)
            if found:
                scale = 1.0
                if field in _SCALE:
                    if found.group(1) not in _SCALE[field]:
                        raise ValueError(f"ncu gave {metric} in {found.group(1)!r}; known: {sorted(_SCALE[field])}")
                    scale = _SCALE[field][found.group(1)]
                row[field] = float(found.group(2).replace(",", "")) * scale
        section = _SECTION.search(body)
        if section:
            row["metrics"] = {m.group(1): [float(m.group(3).replace(",", "")), m.group(2) or ""]
                              for m in _RAW.finditer(section.group(1))}
        rows.append(row)
    return rows


def _step(args):
    """ours_shadow's forward + backward for the point (`benchmarks/kernels.py`'s tensors and seeds)."""
    import torch

    from benchmarks.kernels import make, ranks_for, shadow_step, tokens_for
    from lightning_multilora.kernels.triton_lora import reset_rank_tiles

    d_in, d_out = args.shape
    rng = random.Random(f"{d_in}-{d_out}-{args.n}-{args.ranks}-{args.tokens}")
    reset_rank_tiles()
    torch.manual_seed(0)
    x, base, w = make(d_in, d_out, ranks_for(args.ranks, args.n, rng), tokens_for(args.tokens, args.n, rng),
                      torch.device("cuda"))
    return shadow_step(x, base, w, torch.randn_like(base))


def _child(args) -> None:
    import torch

    step = _step(args)
    for _ in range(3):  # tunes (first process) or reads the tuned tiles back (under ncu)
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("D_IN", "D_OUT"))
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--ranks", default="64", help="a rank, or mixed (8..128, as benchmarks/kernels.py)")
    parser.add_argument("--tokens", default="1024", help="tokens an adapter, or mixed (64..2048)")
    parser.add_argument("--out", default="benchmarks/results/kernels_h200_ncu.json")
    parser.add_argument("--ncu", default=None, help="the ncu executable (default: on PATH, else /usr/local/cuda/bin)")
    parser.add_argument("--ncu-log", default=None, help="also keep ncu's text report here")
    parser.add_argument("--metrics", default=None,
                        help="also these metrics (ncu's --metrics: names, or breakdown:<metric> for what a "
                             "throughput is made of), each launch's in its row's metrics")
    parser.add_argument("--parse", default=None, help="read this ncu text report instead of profiling")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    point = dict(shape=f"{args.shape[0]}x{args.shape[1]}", n_adapters=args.n, ranks=args.ranks, tokens=args.tokens,
                 impl="ours_shadow", grads="accumulate")
    if args.parse:
        text = Path(args.parse).read_text()
        meta = {}
    else:
        ncu = args.ncu or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
        child = [sys.executable, __file__, "--child", "--shape", *map(str, args.shape), "--n", str(args.n),
                 "--ranks", args.ranks, "--tokens", args.tokens]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH")])))
        subprocess.run(child, check=True, env=env)  # tunes; its choices are read back from Triton's cache below
        extra = ["--metrics", args.metrics] if args.metrics else []
        done = subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--set", "full",
                               *extra, "--page", "details", *child], env=env, capture_output=True, text=True)
        text = done.stdout + done.stderr
        if args.ncu_log:
            Path(args.ncu_log).write_text(text)
        if done.returncode != 0:
            raise SystemExit(f"ncu exited {done.returncode}:\n{text[-2000:]}")
        import torch
        import triton

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.now(timezone.utc).date().isoformat())
    rows = [dict(point, **row, **meta) for row in parse_ncu_details(text)]
    if not rows:
        raise SystemExit("no profiled launch in ncu's report (is the counters' access refused?)")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(f"{row['kernel'][:24]:24s} {row.get('duration_us', float('nan')):8.1f} us  DRAM "
              f"{row.get('dram_pct', float('nan')):5.1f}%  L2 {row.get('l2_pct', float('nan')):5.1f}%  "
              f"{row.get('memory_tbps', float('nan')):5.2f} TB/s")


if __name__ == "__main__":
    main()
