"""Adapter parallelism vs FSDP data parallelism over the same adapters (vs one GPU where the base fits).

On two H200s (a Qwen2.5-32B-shaped base, random bf16, 8 adapters at batch size 1, seq 256):

    torchrun --nproc-per-node 2 benchmarks/adapter_parallel.py --model qwen2.5-32b --adapters 8 --batch-size 1 --seq 256 --out benchmarks/results/adapter_parallel_h200x2.json
    # adapter parallelism alone, the base replicated (shard size 1) and sharded (0: over every rank), one row each:
    torchrun --nproc-per-node 2 benchmarks/adapter_parallel.py --model qwen2.5-32b --adapters 16 --modes adapter_parallel --shard-sizes 1 0 --no-reshard --out ...
    python benchmarks/adapter_parallel.py --model qwen2.5-32b --adapters 8 --batch-size 1 --seq 256 --out benchmarks/results/adapter_parallel_h200x1.json

With each rank's forward + backward replayed from a CUDA graph (the base whole on each rank, or one GPU):

    torchrun --nproc-per-node 2 benchmarks/adapter_parallel.py --model qwen2.5-32b --adapters 8 --modes adapter_parallel --shard-sizes 1 --no-reshard --cuda-graph --out ...
    python benchmarks/adapter_parallel.py --model qwen2.5-32b --adapters 8 --cuda-graph --out ...

On four (issue 10: a Llama-3.1-70B-shaped base, per-adapter batch 1, 2, 4 or 8):

    torchrun --nproc-per-node 4 benchmarks/adapter_parallel.py --model llama-3.1-70b --adapters 8 --batch-size 2 --seq 256 --out benchmarks/results/adapter_parallel_h200x4.json

Check on a CPU (2 gloo processes, tiny model; writes a temp file):

    torchrun --nproc-per-node 2 benchmarks/adapter_parallel.py --tiny --steps 3 --out /tmp/adapter_parallel.json

The base is built on the meta device, sharded with FSDP2 (each decoder layer, the embeddings, the LM head and
the decoder), then materialized and randomly initialized on each rank's GPU: no rank ever holds the whole model.
Gradient checkpointing, the chunked loss of packed_step.py, r=16 adapters on the 7 projections, fused AdamW (over one
flat parameter per adapter, as `MultiLoRAModule` holds them, except in the FSDP modes).

- ``adapter_parallel``: each rank owns a disjoint, balanced set of adapters (`assign_adapters`), trains them on its
  own rows; adapter weights are FSDP ``ignored_params`` (local, never communicated).
- ``fsdp_dp``: every adapter on every rank as FSDP-managed (sharded, gradients reduce-scattered) parameters; the
  global batch (adapters x batch size rows) split evenly over the ranks (multi-LoRA packing under plain FSDP).
- ``fsdp_per_adapter``: the usual way (PEFT + FSDP, ALTO's FSDP baseline): one adapter at a time, its batch split
  over the ranks; a rank without a row runs a zero-weighted dummy row (FSDP needs every rank in every step).
  Its tokens/s is that of training the adapters one after another.
- with one process: everything on one GPU (where it fits).

Reported: median step time and tokens/s over ``--steps`` steps after ``--warmup``, the host's time per step (until
the step's Python returned, before waiting for the GPU), peak memory per GPU; ``--profile`` adds torch.profiler
tables of one more step (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

# Run as `python benchmarks/<script>.py`, this folder led the import path, and its kernels.py hid Hugging Face's
# `kernels` package, which transformers imports as it builds a model: the folder is taken off the path (the
# `benchmarks.` imports come from the repository root, PYTHONPATH=.)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import torch
import torch.distributed as dist

from benchmarks.packed_step import ALPHA, LLAMA_31_8B, LR, RANK, TARGETS, lm_loss, profile_host
from lightning_multilora.base_model import TINY_CONFIGS, one_sequence_per_row
from lightning_multilora.graphs import StepGraphs
from lightning_multilora.kernels.recompute import checkpointing_kwargs
from lightning_multilora.layer import MultiLoRALinear, inject_multilora
from lightning_multilora.layout import BatchLayout
from lightning_multilora.spec import AdapterSpec
from lightning_multilora.strategies.adapter_parallel import assign_adapters

MODELS = {
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=32768, tie_word_embeddings=False),
    "llama-3.1-70b": dict(LLAMA_31_8B, model_type="llama", hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "llama-3.1-8b": dict(LLAMA_31_8B, model_type="llama"),
}


def build(config_kwargs: dict, device: torch.device, mode: str, names: list[str], world: int,
          reshard_after_forward: bool = True, shard_size: int = 0):
    """The sharded base with ``names``' adapters; adapters are FSDP-managed only in ``fsdp_dp``. ``shard_size``
    (adapter_parallel only): 0 shards over every rank, 1 keeps a whole base on each, others shard within groups
    of that many ranks and replicate across them (as `AdapterParallelStrategy(shard_size=...)`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_kwargs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())
    model.train()
    layers = inject_multilora(model, TARGETS)
    for i, name in enumerate(names):
        layers.add_adapter(name, rank=RANK, alpha=ALPHA, seed=i)
    adapter_params = {p for n in names for p in layers.parameters_of(n)}
    size = shard_size if mode == "adapter_parallel" and shard_size else world
    if size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = (init_device_mesh(device.type, (world,)) if size == world else
                init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard")))
        ignored = adapter_params if mode == "adapter_parallel" else set()
        policy = MixedPrecisionPolicy()
        units = [*model.model.layers, model.model.embed_tokens, model.lm_head]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored & set(unit.parameters()),
                        reshard_after_forward=reshard_after_forward)
        fully_shard(model.model, mesh=mesh, mp_policy=policy, ignored_params=ignored & set(model.model.parameters()))
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if ".lora_B." in name:
                local.zero_()
            elif "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():  # rotary tables are buffers: recompute them on the real device
            if hasattr(module, "inv_freq") and hasattr(module, "config"):
                inv_freq, module.attention_scaling = rope_init_fn(module)(module.config)
                inv_freq = inv_freq.to(device)
                module.inv_freq = inv_freq
                module.original_inv_freq = inv_freq.clone()
    flat = not mode.startswith("fsdp")  # FSDP shards (and reduces) the adapters' per-layer parameters itself
    if flat:
        # As `MultiLoRAModule` holds them: one flat parameter per adapter (every layer's A and B as views), which
        # follows the storage `to_empty` gave each parameter; the optimizer steps one tensor per adapter
        layers.rebind()
    lora = [p for n in names for p in layers.optimizer_parameters(n, elementwise=flat)]  # after to_empty
    optimizer = torch.optim.AdamW(lora, lr=LR, fused=device.type == "cuda")
    return model, layers, optimizer


def rope_init_fn(module: torch.nn.Module):
    """The function that makes a rotary embedding's ``inv_freq``: kept on the module by older transformers, looked
    up from its ``rope_type`` by newer ones (5.17 keeps none: `to_empty` left the tables uninitialized)."""
    init = getattr(module, "rope_init_fn", None)
    if init is not None:
        return init
    rope_type = getattr(module, "rope_type", "default")
    if rope_type == "default" and hasattr(module, "compute_default_rope_parameters"):
        return module.compute_default_rope_parameters
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type]


def link_bandwidth(device: torch.device, mib: int = 512, iters: int = 5) -> float:
    """All-gather bandwidth between the ranks, GB/s received per rank (what FSDP's gathers of the base get)."""
    world = dist.get_world_size()
    shard = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=device)
    dist.all_gather_into_tensor(full, shard)
    times, _ = measure(lambda: dist.all_gather_into_tensor(full, shard), iters, 1, device)
    return (world - 1) * shard.numel() * shard.element_size() / statistics.median(times) / 1e9


def measure(step, steps: int, warmup: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Wall seconds per step (synchronized), and the host's: until ``step()`` returned, before waiting for
    the GPU (close to the wall time when the host, not the GPU, sets the pace)."""
    times, host = [], []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier() if dist.is_initialized() else None
        start = time.perf_counter()
        step()
        queued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier() if dist.is_initialized() else None
        if i >= warmup:
            times.append(time.perf_counter() - start)
            host.append(queued - start)
    return times, host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="qwen2.5-32b", choices=sorted(MODELS))
    p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU (gloo): checks the script")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--modes", nargs="+", default=["adapter_parallel", "fsdp_dp", "fsdp_per_adapter"],
                   choices=["adapter_parallel", "fsdp_dp", "fsdp_per_adapter"], help="with several processes")
    p.add_argument("--no-reshard", action="store_true",
                   help="FSDP2 reshard_after_forward=False: gather the base once per step, not again in backward")
    p.add_argument("--profile", type=Path, help="rank 0 writes torch.profiler tables of one more step here")
    p.add_argument("--cprofile", action="store_true",
                   help="print where the host time of one more step goes (cProfile; a single process only)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay each rank's forward + backward from a CUDA graph captured at the second warmup step "
                        "(`StepGraphs`); the optimizer steps eagerly. Needs a base that is not sharded: one process, "
                        "or adapter_parallel with --shard-sizes 1")
    p.add_argument("--shard-sizes", type=int, nargs="+", default=[0],
                   help="adapter_parallel's base: 0 sharded over every rank, 1 whole on each rank, k sharded "
                        "within groups of k ranks; one row each")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    config = dict(TINY_CONFIGS["tiny-llama"]) if args.tiny else MODELS[args.model]
    names = [f"a{i}" for i in range(args.adapters)]
    specs = [AdapterSpec(n, rank=RANK, batch_size=args.batch_size) for n in names]
    rows = []
    link = round(link_bandwidth(device), 1) if world > 1 else None
    if rank == 0 and link:
        print(f"all-gather: {link} GB/s received per rank", flush=True)
    if any(k < 0 or (k and world % k) for k in args.shard_sizes):
        p.error(f"--shard-sizes must be 0 or divisors of the world size {world}, got {args.shard_sizes}")
    runs = [(m, k) for m in (args.modes if world > 1 else ("single",))
            for k in (args.shard_sizes if m == "adapter_parallel" else [0])]
    if args.cuda_graph and args.warmup < 2:
        p.error("--cuda-graph needs --warmup >= 2: an eager step, then the capture (the timed steps replay)")
    if args.cuda_graph and world > 1 and any(m != "adapter_parallel" or k != 1 for m, k in runs):
        p.error("--cuda-graph captures no collective: with several processes it needs --modes adapter_parallel "
                "--shard-sizes 1 (a whole base on each rank)")
    for mode, shard_size in runs:
        weights = None  # per-row loss weights (the dummy rows of fsdp_per_adapter)
        if mode == "adapter_parallel":
            owner = assign_adapters(specs, world)
            mine = [n for n in names if owner[n] == rank]
            row_sizes = [args.batch_size] * len(mine)
        elif mode == "fsdp_dp":
            mine = names  # every adapter everywhere; this rank's share of the global rows
            total = args.adapters * args.batch_size
            lo, hi = rank * total // world, (rank + 1) * total // world
            row_sizes = [max(0, min(hi, (i + 1) * args.batch_size) - max(lo, i * args.batch_size)) for i in range(len(names))]
        elif mode == "fsdp_per_adapter":
            mine = names[:1]
            share = args.batch_size // world + (rank < args.batch_size % world)
            row_sizes = [max(share, 1)]
            if share == 0:
                weights = 0.0
        else:
            mine, row_sizes = names, [args.batch_size] * len(names)
        MultiLoRALinear.direct_grads = not mode.startswith("fsdp")  # FSDP manages those gradients itself
        model, layers, optimizer = build(config, device, mode, mine, world, not args.no_reshard, shard_size)
        present = [(n, r) for n, r in zip(mine, row_sizes) if r > 0]
        layout = BatchLayout.from_sizes([n for n, _ in present], [r for _, r in present])
        ids = torch.randint(config["vocab_size"], (max(1, layout.num_rows), args.seq), device=device)
        if mode.startswith("fsdp"):
            # FSDP reduce-scatters the same set of gradients on every rank: adapters without rows on this rank
            # get a zero-weighted term, added inside the layer's forward (where the parameters are unsharded)
            def touch_all(module, args, out):
                extra = sum(p.sum() for p in [*module.lora_A.values(), *module.lora_B.values()])
                return out + 0.0 * extra.to(out.dtype)

            for layer in layers.values():
                layer.register_forward_hook(touch_all)

        flat = not mode.startswith("fsdp")
        graphs = StepGraphs(warmup=1, enabled=args.cuda_graph)

        def forward_backward(ids: torch.Tensor) -> torch.Tensor:
            with layers.use(layout if layout.num_rows else None), one_sequence_per_row():
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                loss = lm_loss(model.lm_head, hidden, ids)
                if weights is not None:
                    loss = loss * weights
                if flat:  # gradients zeroed in place (flat views the kernels add into), as `MultiLoRAModule` does
                    layers.prepare_grads(*mine)
                loss.backward()
            return loss.detach()

        def step() -> None:
            graphs("step", forward_backward, ids)
            optimizer.step()
            if not flat:
                optimizer.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times, host = measure(step, args.steps, args.warmup, device)
        ms = statistics.median(times) * 1e3
        if args.cprofile and world == 1:  # the launches' host time without the profiler's hooks (see packed_step.py)
            profile_host(step, device)
        if args.profile:  # every rank runs the step (a sharded base's gathers need them all); rank 0 records it
            from contextlib import nullcontext

            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with (profile(activities=activities) if rank == 0 else nullcontext()) as prof:
                step()
                torch.cuda.synchronize() if cuda else None
            if rank == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                table += "\n" + prof.key_averages().table(
                    sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25)
                name = f"{args.profile.stem}_{mode}_{shard_size}{args.profile.suffix}"
                args.profile.with_name(name).write_text(table)
        # the whole (global) batch per step: every adapter's, or the one adapter's for fsdp_per_adapter
        tokens = (1 if mode == "fsdp_per_adapter" else args.adapters) * args.batch_size * args.seq
        row = dict(mode=mode, model="tiny-llama" if args.tiny else args.model, world_size=world,
                   reshard_after_forward=not args.no_reshard, allgather_gbps=link,
                   shard_size=(shard_size or world) if mode == "adapter_parallel" else (world if world > 1 else None),
                   adapters=args.adapters, batch_size=args.batch_size, seq=args.seq, step_ms=round(ms, 1),
                   host_ms=round(statistics.median(host) * 1e3, 1),
                   cuda_graph=bool(graphs.replays) if args.cuda_graph else None,
                   graph_failure=next(iter(graphs.failures.values()), None) if args.cuda_graph else None,
                   tokens_per_s=round(tokens / (ms / 1e3), 1),
                   peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del model, layers, optimizer, graphs, forward_backward, step
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        meta = dict(gpu=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                    date=datetime.now(timezone.utc).date().isoformat())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
