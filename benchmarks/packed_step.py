"""Step time of N packed LoRA adapters vs. N sequential PEFT runs vs. the frozen-base floor.

Run on the GPU (estimated 4-5 minutes on one H200; ``--budget-s`` skips, as null, whatever would run
past 450 s):

    PYTHONPATH=. python benchmarks/packed_step.py --seqs 256 1024 --ns 1 4 16 32 --reps 3 --out benchmarks/results/packed_step_h200.json

The same with each forward + backward replayed from a CUDA graph (the floor's too; rows say `"replayed"` in
``base_floor_cuda_graph`` / ``packed_cuda_graph``, or why a capture failed):

    PYTHONPATH=. python benchmarks/packed_step.py --seqs 256 --ns 4 32 --skip-peft --cuda-graph --warmup 3 --append --out benchmarks/results/packed_step_h200.json

End-to-end check on a CPU (tiny model; writes to a temp file, never to the results file):

    PYTHONPATH=. python benchmarks/packed_step.py --tiny --ns 1 4 --seqs 32 --reps 2 --out /tmp/ps.json

The base is a Llama-3.1-8B-shaped model with random bf16 weights (built from a config, no hub download),
sdpa attention and non-reentrant gradient checkpointing. Every adapter is r=16, alpha=32, on the 7
projections, with fp32 weights (the default of both our layers and PEFT). Each adapter has batch size 1,
so N adapters make a batch of N rows. One step is forward + next-token cross entropy + backward, plus an
AdamW step over the adapter weights for the two LoRA variants (ours as `MultiLoRAModule` runs it: one flat
parameter per adapter, gradients zeroed in place):

- ``base_floor_ms``: the model without LoRA at batch N, backward through every layer (the input
  embeddings require grad, no weight grads): the least any LoRA training step can cost.
- ``packed_ms``: our `MultiLoRALinear` layers with N adapters, one step on the (N, seq) batch.
- ``sequential_peft_ms``: PEFT, one adapter at batch 1, N steps run back to back: the cost of training the
  N adapters one after another (every adapter's step costs the same, so one adapter is stepped N times).

Each time is the median over ``--reps`` timed repetitions after ``--warmup`` untimed steps. Rows are
written to ``--out`` as JSON and printed as a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

# Run as `python benchmarks/<script>.py`, this folder led the import path, and its kernels.py hid Hugging Face's
# `kernels` package, which transformers imports as it builds a model: the folder is taken off the path (the
# `benchmarks.` imports come from the repository root, PYTHONPATH=.)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_multilora.base_model import TINY_CONFIGS, one_sequence_per_row
from lightning_multilora.graphs import StepGraphs
from lightning_multilora.kernels import resolve_backend
from lightning_multilora.kernels.recompute import checkpointing_kwargs
from lightning_multilora.layer import LoRALayers, MultiLoRALinear, inject_multilora
from lightning_multilora.layout import BatchLayout
from lightning_multilora.optim import GroupedAdamW

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 16, 32, 1e-4
H200_RESULTS = Path(__file__).resolve().parent / "results" / "packed_step_h200.json"
# Tokens per cross-entropy chunk. Each chunk's fp32 logits (4096 x 128256 x 4 B = 2 GiB) live only inside
# the chunk and are recomputed in backward, instead of N*seq*vocab fp32 logits (17 GiB at N=32, seq 1024).
LOSS_CHUNK_TOKENS = 4096

# Llama-3.1-8B's config.json, transformers 5 spelling (rope_scaling became rope_parameters).
LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)


class Skipped(Exception):
    """A measurement left out on purpose (time budget), recorded as null with the reason."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024], help="sequence lengths")
    p.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16, 32], help="numbers of adapters")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each measurement (>= 1)")
    p.add_argument("--tiny", action="store_true", help="tiny Llama, runs on CPU: checks the script end to end")
    p.add_argument("--skip-peft", action="store_true", help="leave out the sequential PEFT baseline")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="skip (record null) any measurement that would end later than this many seconds "
                        "after start")
    p.add_argument("--optimizer", choices=("fused", "grouped", "foreach"), default="grouped",
                   help="the packed step's AdamW: GroupedAdamW (one launch over every adapter, writing their bf16 "
                        "shadows: what MultiLoRAModule runs on CUDA), torch's fused=True (the shadows then copied once "
                        "a step) or torch's foreach default; PEFT takes fused=True with 'fused', else torch's default")
    p.add_argument("--cprofile", action="store_true", help="print where the host time of one packed step goes")
    p.add_argument("--trace", action="store_true",
                   help="print, for one floor and one packed step, host enqueue vs wall time, GPU busy time and the "
                        "kernels that take it (torch.profiler)")
    p.add_argument("--trace-top", type=int, default=18, help="how many kernels --trace lists (by time)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay the forward + backward of the floor and of the packed step from CUDA graphs "
                        "(`StepGraphs`, captured at the second warm-up step; the optimizer steps eagerly)")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out and add these after them")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default: benchmarks/results/packed_step_h200.json; with --tiny a temp file)")
    args = p.parse_args()
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be >= 1 (the last warm-up step estimates the time budget)")
    if args.cuda_graph and args.warmup < 3:
        p.error("--cuda-graph needs --warmup >= 3: an eager step, the capture, then a replay that estimates the budget")
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "packed_step_tiny.json" if args.tiny else H200_RESULTS
    if args.tiny and args.out.resolve() == H200_RESULTS:
        p.error(f"--tiny must not overwrite the H200 results {H200_RESULTS}")
    return args


# ---------------------------------------------------------------------------------------------- model


def build_model(tiny: bool, max_seq: int, device: torch.device) -> nn.Module:
    """A randomly initialised bf16 causal LM with gradient checkpointing, frozen, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if tiny:
        kwargs = dict(TINY_CONFIGS["tiny-llama"])
        kwargs["max_position_embeddings"] = max(kwargs["max_position_embeddings"], max_seq)
        config = AutoConfig.for_model(**kwargs)
    else:
        config = LlamaConfig(**LLAMA_31_8B)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())
    model.train()  # transformers only checkpoints layers in training mode
    return model


def lm_loss(lm_head: nn.Linear, hidden: Tensor, ids: Tensor) -> Tensor:
    """Next-token cross entropy, mean over each row's tokens, summed over rows (one row = one adapter).

    The logits are made chunk by chunk under activation checkpointing, so at most one chunk of fp32
    logits exists at a time, in forward and in backward.
    """
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = ids[:, 1:].reshape(-1)

    def chunk_loss(h_chunk: Tensor, y_chunk: Tensor) -> Tensor:
        return F.cross_entropy(lm_head(h_chunk).float(), y_chunk, reduction="sum")

    total = sum(checkpoint(chunk_loss, h[i:i + LOSS_CHUNK_TOKENS], labels[i:i + LOSS_CHUNK_TOKENS],
                           use_reentrant=False)
                for i in range(0, labels.numel(), LOSS_CHUNK_TOKENS))
    return total / (ids.shape[1] - 1)


def lm_backward(model: nn.Module, ids: Tensor, inputs_embeds: Optional[Tensor] = None,
                before_backward: Optional[Callable[[], None]] = None) -> None:
    """Forward through the decoder (hidden states, not logits: `lm_loss` makes those), loss, backward
    (``before_backward`` is called between the two)."""
    if inputs_embeds is None:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    else:
        hidden = model.model(inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
    loss = lm_loss(model.lm_head, hidden, ids)
    if before_backward is not None:
        before_backward()
    loss.backward()


# ---------------------------------------------------------------------------------------------- timing


def pick_device(tiny: bool) -> torch.device:
    """The CPU for ``--tiny``, else the GPU (an 8B benchmark has nothing to measure without one)."""
    if tiny:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise SystemExit("the 8B benchmark needs a CUDA GPU; use --tiny to check the script on a CPU")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(step: Callable[[], None], n_steps: int, args: argparse.Namespace, deadline: float,
          device: torch.device) -> float:
    """Median milliseconds of ``n_steps`` consecutive steps over ``args.reps`` repetitions.

    Raises `Skipped` when the budget is spent, or when the last warm-up step says the timed repetitions
    would end past ``deadline``.
    """
    if time.perf_counter() > deadline:
        raise Skipped("time budget spent")
    for _ in range(args.warmup):
        t0 = time.perf_counter()
        step()
        sync(device)
        last = time.perf_counter() - t0
    estimate = last * n_steps * args.reps
    if time.perf_counter() + estimate > deadline:
        raise Skipped(f"~{estimate:.0f} s of timed steps would run past --budget-s")
    times = []
    for _ in range(args.reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n_steps):
            step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(label: str, step: Callable[[], None], n_steps: int, args: argparse.Namespace, deadline: float,
            device: torch.device) -> tuple[Optional[float], Optional[float], Optional[str]]:
    """(median ms, peak GiB allocated, why it is null): an OOM or a budget skip is reported, not raised."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = peak = note = None
    try:
        ms = timed(step, n_steps, args, deadline, device)
        if device.type == "cuda":
            peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    except torch.OutOfMemoryError as err:
        note = f"out of memory ({str(err).splitlines()[0][:160]})"
    except Skipped as err:
        note = f"skipped, {err}"
    # Only now, with the exception and its frames released, can the step's tensors be freed.
    free_memory(device)
    print(f"  {label}: " + (f"{ms:.1f} ms" if ms is not None else note), flush=True)
    return (round(ms, 2) if ms is not None else None), peak, note


# ---------------------------------------------------------------------------------------------- variants


def run_floor(model: nn.Module, rows: dict, args: argparse.Namespace, deadline: float, device: torch.device):
    """Frozen base at batch N; the input embeddings require grad so backward runs through every layer."""
    embed = model.get_input_embeddings()
    for seq in args.seqs:
        for n in args.ns:
            ids = torch.randint(model.config.vocab_size, (n, seq), device=device)
            graphs = StepGraphs(warmup=1, enabled=args.cuda_graph)

            def floor_step(ids: Tensor) -> None:
                with one_sequence_per_row():  # (no mask: a capture would otherwise build a full one)
                    lm_backward(model, ids, inputs_embeds=embed(ids).detach().requires_grad_(True))

            def step() -> None:
                graphs("floor", floor_step, ids)

            record(rows[seq, n], "base_floor", *measure(f"floor seq={seq} N={n}", step, 1, args, deadline, device))
            if args.trace and rows[seq, n]["base_floor_ms"] is not None:
                rows[seq, n]["base_floor_trace"] = profile_device(step, device, f"floor seq={seq} N={n}", args.trace_top)
            rows[seq, n]["base_floor_cuda_graph"] = note_graphs(graphs, args)
            del ids, step, graphs, floor_step


def note_graphs(graphs: StepGraphs, args: argparse.Namespace) -> Optional[str]:
    """What a row says of its CUDA graph: None without --cuda-graph, "replayed", or why it ran eagerly."""
    if not args.cuda_graph:
        return None
    return "replayed" if graphs.replays else next(iter(graphs.failures.values()), "not captured")


def run_packed(model: nn.Module, rows: dict, args: argparse.Namespace, deadline: float, device: torch.device):
    """Our layers with N adapters at batch 1 each, one packed step; the base is restored afterwards."""
    layers = inject_multilora(model, TARGETS)
    for n in args.ns:
        names = [f"adapter{i}" for i in range(n)]
        for i, name in enumerate(names):
            layers.add_adapter(name, rank=RANK, alpha=ALPHA, seed=i)
        # As `MultiLoRAModule` does: one param group per adapter holding its flat parameter (every layer's A and B),
        # gradients zeroed in place before each backward.
        groups = [{"params": layers.optimizer_parameters(name, elementwise=True)} for name in names]
        if args.optimizer == "grouped":
            optimizer = GroupedAdamW(groups, lr=LR)
        else:
            optimizer = torch.optim.AdamW(groups, lr=LR, fused=args.optimizer == "fused" or None)
        layout = BatchLayout.from_sizes(names, [1] * n)
        for seq in args.seqs:
            ids = torch.randint(model.config.vocab_size, (n, seq), device=device)
            graphs = StepGraphs(warmup=1, enabled=args.cuda_graph)

            def packed_step(ids: Tensor) -> None:
                # Backward stays inside `use`: gradient checkpointing re-runs the layers during backward. The
                # gradients are zeroed between forward and backward, as `MultiLoRAModule` does.
                with layers.use(layout), one_sequence_per_row():
                    lm_backward(model, ids, before_backward=lambda: layers.prepare_grads(*names))

            def step() -> None:
                # As `MultiLoRAModule` does: the adapters' stale shadows copied before the graph (a replay runs no
                # Python), which may then read them
                layers.refresh_shadows(names)
                with layers.refreshed_before_replays():
                    graphs("packed", packed_step, ids)
                optimizer.step()

            record(rows[seq, n], "packed", *measure(f"packed seq={seq} N={n}", step, 1, args, deadline, device))
            if args.cprofile and rows[seq, n]["packed_ms"] is not None:
                profile_host(step, device)
            if args.trace and rows[seq, n]["packed_ms"] is not None:
                rows[seq, n]["packed_trace"] = profile_device(step, device, f"packed seq={seq} N={n}", args.trace_top)
            rows[seq, n]["packed_cuda_graph"] = note_graphs(graphs, args)
            del ids, step, graphs, packed_step
        for name in names:
            layers.drop_grads(name)
        del optimizer
        for name in names:
            layers.remove_adapter(name)
        free_memory(device)
    restore_base(model, layers)


def profile_host(step: Callable[[], None], device: torch.device) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    sync(device)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def profile_device(step: Callable[[], None], device: torch.device, label: str, top: int = 18) -> dict:
    """One step under torch.profiler: host enqueue time (until ``step`` returns) vs wall time (until the GPU
    is done), GPU busy time (the union of kernel, copy and memset intervals) and the kernels taking it, the GPU's
    idle time (per 50 ms of the step, and the longest gaps with the kernels around them) and Python's garbage
    collections during the step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    collections: list[float] = []  # Python's garbage collections during the step (host pauses), ms each
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((time.perf_counter() - started.pop()) * 1e3)

    sync(device)
    gc.callbacks.append(on_gc)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            host = time.perf_counter() - t0
            sync(device)
            wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    device_events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[:60]) for e in device_events)
    busy, end, last = 0, None, None
    gaps = []  # (idle ns, start of the idle time, kernel before, kernel after)
    by_name: dict[str, list] = {}
    for lo, hi, name in spans:
        if end is None or lo > end:
            if end is not None:
                gaps.append((lo - end, end, last, name))
            busy += hi - lo
            end, last = hi, name
        elif hi > end:
            busy += hi - end
            end, last = hi, name
    for e in device_events:
        entry = by_name.setdefault(e.name()[:90], [0, 0])
        entry[0] += e.duration_ns()
        entry[1] += 1
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    # Where the GPU waits for the host: idle time inside the step per 50 ms window of the trace, and the longest gaps.
    first = spans[0][0] if spans else 0
    windows: dict[int, float] = {}
    for gap, at, _, _ in gaps:
        w = int((at - first) / 50e6) * 50
        windows[w] = windows.get(w, 0.0) + gap / 1e6
    longest = sorted(gaps, reverse=True)[:top]
    summary = dict(host_ms=round(host * 1e3, 1), wall_ms=round(wall * 1e3, 1), gpu_busy_ms=round(busy / 1e6, 1),
                   gc_collections=len(collections), gc_ms=round(sum(collections), 2),
                   kernels=[dict(name=k, ms=round(v[0] / 1e6, 2), count=v[1]) for k, v in kernels],
                   idle_ms_per_50ms=[[w, round(v, 2)] for w, v in sorted(windows.items())],
                   longest_gaps=[dict(us=round(g / 1e3, 1), at_ms=round((at - first) / 1e6, 2), after=a, before=b)
                                 for g, at, a, b in longest])
    print(f"  trace {label}: host {summary['host_ms']} ms, wall {summary['wall_ms']} ms, "
          f"GPU busy {summary['gpu_busy_ms']} ms (under the profiler); {len(collections)} garbage collections took "
          f"{summary['gc_ms']} ms")
    for k in summary["kernels"]:
        print(f"    {k['ms']:9.2f} ms {k['count']:6d}x  {k['name']}")
    print("  idle ms per 50 ms of the trace: " + ", ".join(f"{w}: {v}" for w, v in summary["idle_ms_per_50ms"]))
    for g in summary["longest_gaps"]:
        print(f"    idle {g['us']:8.1f} us at {g['at_ms']:8.2f} ms, after {g['after']} / before {g['before']}")
    return summary


def restore_base(model: nn.Module, layers: LoRALayers) -> None:
    """Undo `inject_multilora` (the package has no public way to): put each wrapped linear back."""
    modules = dict(model.named_modules())
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, layer.base)
    assert not any(isinstance(m, MultiLoRALinear) for m in model.modules())


def run_sequential_peft(model: nn.Module, rows: dict, args: argparse.Namespace, deadline: float,
                        device: torch.device):
    """One PEFT adapter at batch 1, stepped N times back to back (training N adapters one after another)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR,
                                  fused=args.optimizer == "fused" or None)
    # PEFT injects its layers into `model` in place, so calling `model` runs them, and the loss is computed
    # exactly as for the other variants.
    for seq in args.seqs:
        ids = torch.randint(model.config.vocab_size, (1, seq), device=device)

        def step() -> None:
            lm_backward(model, ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for n in args.ns:
            record(rows[seq, n], "sequential_peft",
                   *measure(f"sequential PEFT seq={seq} N={n}", step, n, args, deadline, device))
            optimizer.zero_grad(set_to_none=True)
        del ids, step


def record(row: dict, key: str, ms: Optional[float], peak: Optional[float], note: Optional[str]) -> None:
    row[f"{key}_ms"] = ms
    row[f"{key}_peak_gib"] = peak
    if note:
        row["issues"].append(f"{key}: {note}")


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    import peft
    import transformers

    device = pick_device(args.tiny)
    torch.manual_seed(0)
    model = build_model(args.tiny, max(args.seqs), device)
    model_name = "tiny-llama (random bf16)" if args.tiny else "Llama-3.1-8B-shaped (random bf16)"
    print(f"{model_name} on {device}, built in {time.perf_counter() - start:.1f} s", flush=True)

    notes = (
        f"Step = forward + next-token CE (chunked, checkpointed) + backward with non-reentrant gradient "
        f"checkpointing; LoRA variants also run AdamW (lr {LR}; ours: {args.optimizer}) over fp32 adapter weights "
        f"(r={RANK}, alpha={ALPHA}, 7 projections), no grad clipping. base_floor: frozen base at batch N, input "
        f"embeddings require grad. packed: lightning_multilora, N adapters x batch 1 in one step. "
        f"sequential_peft: one PEFT adapter at batch 1 stepped N times back to back (each adapter's step "
        f"costs the same). Median of {args.reps} reps after {args.warmup} warm-up steps."
    )
    common = dict(
        model=model_name,
        batch_size=1,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        backend=resolve_backend(torch.empty(0, device=device)),
        date=datetime.now(timezone.utc).date().isoformat(),
    )
    rows = {(seq, n): dict(common, seq=seq, n_adapters=n, packed_ms=None, base_floor_ms=None,
                           sequential_peft_ms=None, notes=notes, issues=[])
            for seq in args.seqs for n in args.ns}

    run_floor(model, rows, args, deadline, device)
    run_packed(model, rows, args, deadline, device)
    if args.skip_peft:
        for row in rows.values():
            row["issues"].append("sequential_peft: not measured (--skip-peft)")
    else:
        run_sequential_peft(model, rows, args, deadline, device)

    results = [rows[key] for key in sorted(rows)]
    kept = json.loads(args.out.read_text()) if args.append and args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(kept + results, indent=2) + "\n")
    print_table(results)
    print(f"\n{common['gpu']}, torch {common['torch']}, backend {common['backend']}; "
          f"total {time.perf_counter() - start:.0f} s; wrote {len(results)} rows to {args.out}")


def print_table(results: list[dict]) -> None:
    def ms(v: Optional[float]) -> str:
        return f"{v:.1f}" if v is not None else "-"

    def ratio(a: Optional[float], b: Optional[float]) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    print("\n| seq | N | floor ms | packed ms | sequential PEFT ms | packed / floor | PEFT / packed |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['seq']} | {r['n_adapters']} | {ms(r['base_floor_ms'])} | {ms(r['packed_ms'])} | "
              f"{ms(r['sequential_peft_ms'])} | {ratio(r['packed_ms'], r['base_floor_ms'])} | "
              f"{ratio(r['sequential_peft_ms'], r['packed_ms'])} |")
    for r in results:
        for issue in r["issues"]:
            print(f"seq={r['seq']} N={r['n_adapters']}: {issue}")


if __name__ == "__main__":
    main()
