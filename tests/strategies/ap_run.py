"""Trains four adapters with `AdapterParallelStrategy` on 2 gloo processes, or in one process (the reference).

    python tests/strategies/ap_run.py OUT_DIR parallel|single|stop|resume|early_exit|early_exit_single

``stop`` runs 2 steps on 2 ranks and checkpoints there (OUT_DIR/ckpt); ``resume`` finishes from that checkpoint.
``early_exit`` (2 ranks) and ``early_exit_single`` (one process): EarlyExit stops a1 at its first validation.

Writes OUT_DIR/<mode>/... PEFT exports and, per rank, OUT_DIR/<mode>.rank<r>.json: the adapters it owned
and every collective's tensor sizes (FSDP's all-gathers and reduce-scatters), with the base's shard sizes.
Run by tests/strategies/test_adapter_parallel.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.strategies import AdapterParallelStrategy

SPECS = [AdapterSpec("a0", rank=2, batch_size=2, lr=1e-3, max_steps=3, seed=1),
         AdapterSpec("a1", rank=4, batch_size=2, lr=2e-3, max_steps=6, seed=2),
         AdapterSpec("a2", rank=3, batch_size=1, lr=1e-3, max_steps=4, seed=3),
         AdapterSpec("a3", rank=2, batch_size=1, lr=3e-3, max_steps=2, seed=4)]
CALLS: list[tuple[str, int]] = []


def record(name):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        CALLS.append((name, max((t.numel() for t in tensors), default=0)))
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    module = MultiLoRAModule("tiny-llama", adapters=SPECS, export_dir=str(out / mode))  # validates on finish
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, padding="max_length", max_length=96,
                             max_val_examples=8)
    kwargs = dict(accelerator="cpu", max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                  enable_model_summary=False, logger=False, default_root_dir=str(out / f"root_{mode}"),
                  val_check_interval=3, check_val_every_n_epoch=None)  # checkpointing on: ModelCheckpoint saves at the end
    ckpt_path = None
    if mode == "stop":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs.update(max_steps=2, callbacks=[ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)])
    if mode == "resume":
        (ckpt_path,) = (out / "ckpt").glob("*.ckpt")
    if mode in ("early_exit", "early_exit_single"):
        from lightning_multilora.callbacks import EarlyExit

        class ExitA1(EarlyExit):
            """EarlyExit whose rule says "overfit" for a1 at its first validation: the coordination is under
            test here, the rule itself in tests/callbacks."""

            def observe_validation(self, name, val_loss, step=-1):
                super().observe_validation(name, val_loss, step)
                return "overfit" if name == "a1" else None

        kwargs.update(callbacks=[ExitA1()])
    if not mode.endswith("single"):
        for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_reduce"):
            if hasattr(dist, name):
                record(name)
        strategy = AdapterParallelStrategy(process_group_backend="gloo")
        trainer = L.Trainer(strategy=strategy, devices=2, **kwargs)
    else:
        trainer = L.Trainer(devices=1, **kwargs)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    rank = trainer.global_rank
    shards = []
    if not mode.endswith("single"):
        from torch.distributed.tensor import DTensor

        shards = sorted({p.to_local().numel() for p in module.model.parameters() if isinstance(p, DTensor)})
    owned = sorted(n for n, r in getattr(trainer.strategy, "owner", {}).items() if r == rank)
    states = {r.name: (r.state.value, r.step) for r in module.registry}
    val = {r.name: r.val_losses for r in module.registry}
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps(dict(owned=owned, calls=CALLS, shard_numels=shards,
                                                                 states=states, val=val)))


if __name__ == "__main__":
    main()
