"""Where one grouped-LoRA call spends its time: GPU time per kernel, host time per call.

    PYTHONPATH=. python benchmarks/profile_lora.py --n 32 --tokens 256 --rank 16 --shape 4096 4096 [--direct] [--cprofile]

Prints the profiler's per-kernel CUDA totals over ``--iters`` forward+backward calls, the host time of
one call without waiting for the GPU, and the wall time per call with a sync after every call.
``--direct``: adapter gradients go straight into ``.grad`` (what the layers do); ``--cprofile``: also
the Python functions that take the host time.
"""

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_multilora.kernels import LoRAWeights
from lightning_multilora.kernels.triton_lora import multi_lora_triton

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=32)
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--rank", type=int, default=16)
parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096])
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--direct", action="store_true")
parser.add_argument("--cprofile", action="store_true")
args = parser.parse_args()
if not torch.cuda.is_available():
    raise SystemExit("benchmarks/profile_lora.py measures on a CUDA GPU: torch finds none here")

d_in, d_out, n, t = args.shape[0], args.shape[1], args.n, args.tokens
x = torch.randn(n * t, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
base = torch.randn(n * t, d_out, device="cuda", dtype=torch.bfloat16)
a = tuple((torch.randn(args.rank, d_in, device="cuda") / d_in ** 0.5).requires_grad_() for _ in range(n))
b = tuple((torch.randn(d_out, args.rank, device="cuda") * 0.01).requires_grad_() for _ in range(n))
w = LoRAWeights(a, b, (2.0,) * n, (0.0,) * n, tuple(range(0, n * t, t)), tuple(range(t, n * t + 1, t)),
                direct_grads=args.direct)
grad = torch.randn_like(base)


def step():
    for p in (x, *a, *b):
        p.grad = None
    torch.autograd.backward(multi_lora_triton(x, base.detach(), w, True), grad)


for _ in range(3):  # compile and autotune
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(args.iters):
    step()
host = (time.perf_counter() - start) / args.iters
torch.cuda.synchronize()
wall = (time.perf_counter() - start) / args.iters
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(f"N={n} tokens={t} r={args.rank} {d_in}x{d_out}: host {host * 1e3:.3f} ms/call (no sync), "
      f"wall {wall * 1e3:.3f} ms/call over {args.iters} back-to-back calls")
if args.cprofile:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.iters):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
