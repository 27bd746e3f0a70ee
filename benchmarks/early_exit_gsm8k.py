"""Early exit + warmup selection vs exhaustive training: ALTO's 60-configuration grid on GSM8K.

    PYTHONPATH=. python benchmarks/early_exit_gsm8k.py --data ../shared/data/gsm8k/train.jsonl \
        --out benchmarks/results/early_exit_gsm8k.md

The default sizes suit a 2-core CPU (about 25 minutes); the epochs are ALTO's 3. No hub model here, so
the base is ours: a small Llama built from a config and pretrained briefly (full-parameter, causal LM) on
a part of GSM8K's training split that the sweep never sees. The sweep fine-tunes LoRA adapters on another
part (problems that fit ``--max-length`` whole) and validates on a third. The grid is ALTO's single-GPU one:
lr {1e-5, 5e-5, 2e-4, 3e-4, 5e-4} x rank {16, 32, 64} x batch size {1, 2, 4, 8}, alpha = 2r, all 7
projections, AdamW, constant lr, ``--epochs`` epochs each.

- exhaustive: every configuration trained to the end (packed, one run);
- early exit: the same run with `EarlyExit` (w=2, p=2, tau_gap=0.1, tau_slope=0.001) and
  `WarmupSelection` (5% warmup, keep 25%).

Reported: wall time, samples trained, best validation loss and its configuration, and whether the
exhaustive best survived, to ``--out`` (markdown) and the same path with ``.json``. Runs on the CPU or a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

# Run as `python benchmarks/<script>.py`, this folder led the import path, and its kernels.py hid Hugging Face's
# `kernels` package, which transformers imports as it builds a model: the folder is taken off the path (the
# `benchmarks.` imports come from the repository root, PYTHONPATH=.)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import lightning as L
import torch
import transformers

from lightning_multilora import EarlyExit, MultiLoRADataModule, MultiLoRAModule, SweepGrid, WarmupSelection
from lightning_multilora.base_model import build_base_model
from lightning_multilora.data import ByteTokenizer, ListSource
from lightning_multilora.data.sources import format_record

GRID = {"lr": [1e-5, 5e-5, 2e-4, 3e-4, 5e-4], "rank": [16, 32, 64], "batch_size": [1, 2, 4, 8]}


def load_gsm8k(path: str) -> list[dict]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = []
    for i, r in enumerate(records):
        ex = format_record(r, "gsm8k", "question", "answer", f"{path}:{i + 1}")
        out.append({"prompt": ex.prompt, "completion": ex.completion})
    return out


def split_gsm8k(path: str, seed: int, pretrain_examples: int, sweep_examples: int,
                max_length: int) -> tuple[list[dict], list[dict]]:
    """Shuffled GSM8K: the first ``pretrain_examples`` problems pretrain the base; the sweep takes the next
    ``sweep_examples`` that fit ``max_length`` bytes whole (no truncation: every adapter trains on complete
    question/answer pairs)."""
    records = load_gsm8k(path)
    random.Random(seed).shuffle(records)
    fits = [r for r in records[pretrain_examples:]
            if len((r["prompt"] + r["completion"]).encode("utf-8")) + 1 <= max_length]
    return records[:pretrain_examples], fits[:sweep_examples]


SMALL_BASE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4}


def pretrain_base(texts: list[str], out_dir: Path, steps: int, max_length: int, seed: int,
                  config: Optional[dict] = None, batch_size: int = 16, device: str = "cpu", lr: float = 3e-3) -> float:
    """Full-parameter causal-LM pretraining of a small Llama (``config``: overrides of tiny-llama's, default
    `SMALL_BASE`) on raw GSM8K text, bf16 autocast on a GPU; saved (fp32) to ``out_dir``. Returns the last loss."""
    tok = ByteTokenizer()
    model = build_base_model("tiny-llama", {**(config or SMALL_BASE), "max_position_embeddings": max_length,
                                            "initializer_range": 0.02}, seed=seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    model.train()
    loss = math.nan
    for _ in range(steps):
        batch = [tok.encode(t)[:max_length - 1] + [tok.eos_token_id] for t in rng.sample(texts, batch_size)]
        length = max(len(b) for b in batch)
        ids = torch.full((len(batch), length), tok.pad_token_id)
        labels = torch.full((len(batch), length), -100)
        for i, b in enumerate(batch):
            ids[i, :len(b)] = torch.tensor(b)
            labels[i, :len(b)] = torch.tensor(b)
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm):  # a spike's non-finite gradients would poison every weight: skip that step
            opt.step()
        sched.step()
    last = loss.item()
    if not all(torch.isfinite(p).all() for p in model.parameters()) or not math.isfinite(last):
        raise RuntimeError(f"pretraining diverged (last loss {last}); lower `lr` ({lr}) or the steps")
    model.save_pretrained(out_dir)
    return last


def run_sweep(base_dir: Path, train: list[dict], val_fraction: float, args, early_exit: bool, root: Path) -> dict:
    grid = SweepGrid(axes=GRID, base={"max_epochs": args.epochs, "grad_clip": 1.0}, alpha_over_rank=2.0)
    module = MultiLoRAModule(str(base_dir), grid=grid, max_running=args.slots, export_dir=str(root / "adapters"))
    data = MultiLoRADataModule(sources={"gsm8k": ListSource(train)}, max_length=args.max_length, truncate=True,
                               val_fraction=val_fraction, max_val_examples=args.val_examples, val_batch_size=16,
                               split_seed=args.seed)
    callbacks = [EarlyExit(), WarmupSelection(warmup_fraction=0.05, keep_fraction=0.25)] if early_exit else []
    trainer = L.Trainer(accelerator="auto", devices=1, max_steps=-1, max_epochs=-1,
                        val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - start
    rows = module.registry.summary_rows()
    best = rows[0]
    return {
        "wall_s": round(wall, 1),
        "samples": sum(r.samples_seen for r in module.registry),
        "best_adapter": best["adapter"], "best_val_loss": best["best_val_loss"],
        "statuses": module.registry.counts(),
        "per_adapter": {r.name: {"status": r.state.value, "best_val_loss": r.best_val_loss,
                                 "samples": r.samples_seen, "steps": r.step} for r in module.registry},
        "steps": trainer.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    parser.add_argument("--out", default="benchmarks/results/early_exit_gsm8k.md")
    parser.add_argument("--workdir", default="runs/early_exit_gsm8k")
    parser.add_argument("--pretrain-examples", type=int, default=3000)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--train-examples", type=int, default=48)
    parser.add_argument("--val-examples", type=int, default=48)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--val-every", type=int, default=8)
    parser.add_argument("--slots", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)

    pretrain, sweep_data = split_gsm8k(args.data, args.seed, args.pretrain_examples,
                                       args.train_examples + args.val_examples, args.max_length)
    val_fraction = args.val_examples / len(sweep_data)

    start = time.perf_counter()
    base_dir = root / "base"
    last = pretrain_base([r["prompt"] + r["completion"] for r in pretrain], base_dir, args.pretrain_steps,
                         args.max_length, args.seed)
    pretrain_s = time.perf_counter() - start
    print(f"pretrained the base in {pretrain_s:.0f} s (last loss {last:.3f})", flush=True)

    exhaustive = run_sweep(base_dir, sweep_data, val_fraction, args, False, root / "exhaustive")
    print(f"exhaustive: {exhaustive['wall_s']} s, {exhaustive['samples']} samples", flush=True)
    early = run_sweep(base_dir, sweep_data, val_fraction, args, True, root / "early_exit")
    print(f"early exit: {early['wall_s']} s, {early['samples']} samples", flush=True)

    best = exhaustive["best_adapter"]
    survived = early["per_adapter"][best]["status"] == "finished"
    ratio = early["samples"] / exhaustive["samples"]
    within = early["best_val_loss"] <= exhaustive["best_val_loss"] * 1.01
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    meta = dict(date=datetime.now(timezone.utc).date().isoformat(), device=device, torch=torch.__version__,
                lightning=L.__version__, transformers=transformers.__version__)
    lines = [
        "# Early exit on GSM8K: ALTO's 60-configuration grid",
        "",
        f"Date {meta['date']}, {device}, torch {torch.__version__}. Command: "
        "`PYTHONPATH=. python benchmarks/early_exit_gsm8k.py` with "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",)) + ".",
        "",
        f"Base: a 4-layer, 128-wide Llama (byte tokenizer) pretrained by this script for {args.pretrain_steps} steps "
        f"on {args.pretrain_examples} GSM8K problems ({pretrain_s:.0f} s, final loss {last:.3f}). Sweep data: "
        f"{args.train_examples} other problems for training, {args.val_examples} for validation, each at most "
        f"{args.max_length} tokens whole. Grid: lr {GRID['lr']} x rank {GRID['rank']} x batch size {GRID['batch_size']}, "
        f"alpha = 2r, {args.epochs:g} epochs, validation every {args.val_every} steps.",
        "",
        "| variant | wall time | samples trained | best val loss | best configuration | statuses |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, res in (("exhaustive", exhaustive), ("early exit + warmup selection", early)):
        statuses = ", ".join(f"{k} {v}" for k, v in res["statuses"].items() if v)
        lines.append(f"| {name} | {res['wall_s']:.0f} s | {res['samples']} | {res['best_val_loss']:.4f} | "
                     f"{res['best_adapter']} | {statuses} |")
    lines += [
        "",
        f"- Samples trained with early exit: **{ratio:.1%}** of exhaustive (goal <= 30%); wall time "
        f"{early['wall_s'] / exhaustive['wall_s']:.1%}.",
        f"- The exhaustive best, `{best}` (val loss {exhaustive['best_val_loss']:.4f}), "
        f"{'survived to the end' if survived else 'did not survive: ' + early['per_adapter'][best]['status']} "
        f"in the early-exit run; its best there is `{early['best_adapter']}` at {early['best_val_loss']:.4f} "
        f"({'within' if within else 'not within'} 1% of the exhaustive best).",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "exhaustive": exhaustive,
                                                              "early_exit": early, "args": vars(args)},
                                                             indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
