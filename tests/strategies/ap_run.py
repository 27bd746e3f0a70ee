"""Trains four adapters with `AdapterParallelStrategy` on 2 gloo processes, or in one process (the reference).

    python tests/strategies/ap_run.py OUT_DIR MODE [MODE ...]

MODE: parallel|single|stop|resume|resume_one|resume_four|resume_mixed|stop_single|resume_two|load_two|early_exit|
early_exit_single|early_exit_stop_single|early_exit_resume_two|optuna|optuna_single|warmup|warmup_single|
optuna_bad_target|admission|dpo|dpo_single|warmup_stop|warmup_resume|optuna_admission|optuna_defaults|optuna_prune|
replicated|hybrid|remove|remove_single|end_eval|end_eval_single|refit|refit_on|disagree|smoke|sigterm|rank1_error|
owner_pause|owner_pause_single|one_rank_stop|one_rank_add|one_rank_unqueue|optuna_crash|optuna_crash_resume.
Several modes run one after the other in the same processes (one import, one process group: the modes of one
invocation must agree on the number of processes), each from the same seeds and with its own records, as if alone.
A mode that resumes another's checkpoint waits for that mode's record (an invocation beside it may be running it).

``stop`` runs 2 steps on 2 ranks and checkpoints there (OUT_DIR/ckpt_stop); ``resume`` finishes from that checkpoint,
``resume_one`` too, on one process (the strategy's, over one rank), ``resume_four`` on four;
``resume_mixed`` from OUT_DIR/ckpt_mixed, a copy of that checkpoint whose rank1.ckpt names another step (made by
the test), which every rank refuses (its message recorded).
``stop_single`` / ``resume_two``: the same from one process without the strategy (a checkpoint file,
OUT_DIR/ckpt_stop_single) to 2 ranks;
``early_exit_stop_single`` / ``early_exit_resume_two`` likewise with the ``early_exit`` rule (`RESUMES`).
``load_two``: ``stop_single``'s checkpoint loaded (`load_from_checkpoint`), fitted on 2 ranks without it as
``ckpt_path`` (refused: its message recorded), then with it.
``early_exit`` (2 ranks) and ``early_exit_single`` (one process): EarlyExit stops a1 at its first validation.
``optuna`` / ``optuna_single``: no fixed adapters; OptunaSweep asks 5 trials (2 slots) from an in-memory TPE study
that every process creates (2 random startup trials, so later asks depend on what was told before them).
``warmup`` / ``warmup_single``: OptunaSweep (random sampler, SQLite OUT_DIR/<mode>.db) feeds 4 candidates through 2
slots to WarmupSelection, which keeps the best 2. ``optuna_bad_target``: every trial names a missing target module
(the fit fails on every rank: each records its error).
``admission``: an `AdmissionController` whose "memory" is 1 GiB a row per step and 2 GiB a device, so a rank holds
2 rows at a time (one process: a0 alone, then the others as slots free).
``warmup_stop`` / ``warmup_resume``: the ``warmup`` sweep stopped after 3 steps (checkpoint in OUT_DIR/ckpt_warmup_stop; the
study in OUT_DIR/warmup_resumed.db) and resumed from there.
``optuna_admission``: OptunaSweep (random sampler, no ``slots``) asks 6 trials of batch 1 while the ``admission``
controller's 2 "GiB" a device admit them (2 a rank).
``dpo`` / ``dpo_single``: a DPO adapter (5 steps) and an SFT one (2 steps): on 2 ranks, one each.
``optuna_prune``: a study whose pruner prunes both trials at the run's last validation (Trainer max_steps=3).
``optuna_defaults``: OptunaSweep (3 random trials) and SweepReport with no directory given: the study, the exports
and the summary go to the TensorBoard logger's directory.
``remove`` / ``remove_single``: a callback written as for one process (run on every rank) evaluates a0 and a1 after
step 2 (`MultiLoRAModule.evaluate`) and removes a1 (`remove_adapter`). ``end_eval`` / ``end_eval_single``: 2 steps, then
a callback's ``on_train_end`` evaluates the adapters still running, recording the losses (`evaluate(record=True)`).
The ``early_exit``, ``remove`` and ``end_eval`` modes log every step to a CSV and a TensorBoard logger
(OUT_DIR/logs_<mode>/csv|tb/version_0). ``refit``: 4 steps (checkpoints every 2), then the same module object fits
again from the step-2 checkpoint to the end. ``refit_on``: 2 steps, then the same module object fits again (a new
Trainer and strategy, no checkpoint) to the end. ``disagree``: an adapter added after step 2 that rank 1's
datamodule refuses (its data "gone" there) and rank 0's accepts. ``smoke``: ``fast_dev_run=2`` with no export
folder given (the smoke run's temporary folder holds the exports). ``sigterm``: SIGTERM to rank 0 after step 2.
``rank1_error``: rank 1 raises after step 1, and rank 0's exports take 2 s each (the launcher's observer looks at
the other ranks every 5 s). ``owner_pause`` / ``owner_pause_single``: two adapters queued after step 1 (an admission
controller orders them, `max_running` 3), a1 paused after step 2 and resumed after step 5 by the rank that trains it
alone, and x removed by its rank alone after its first step. ``one_rank_stop``: rank 0 alone removes an adapter
rank 1 trains, after step 2. ``one_rank_add``: rank 0 alone queues an adapter after step 2; ``one_rank_unqueue``: two
adapters queued on every rank after step 1 (`max_running` 4), one of them removed by rank 1 alone after step 2.
``optuna_crash`` / ``optuna_crash_resume``: an OptunaSweep (SQLite OUT_DIR/optuna_crash.db, 5 trials of 6 steps, 2
slots) checkpointed every 6 steps and crashed after step 13 (trials told after the step-6 checkpoint), then resumed
from that checkpoint.

Writes OUT_DIR/<mode>/... PEFT exports and, per rank, OUT_DIR/<mode>.rank<r>.json: the adapters it owned
and every collective's tensor sizes (FSDP's all-gathers and reduce-scatters), with the base's shard sizes; in the
sweep modes also its calls of the Optuna study (ask, report, tell), the trials of its study object and the
callbacks' states.
Run by tests/strategies/test_adapter_parallel.py.
"""

from __future__ import annotations

import json
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

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
DPO_SPECS = [AdapterSpec("d", objective="dpo", dataset="pairs", rank=2, batch_size=2, lr=5e-3, max_steps=5, seed=1),
             AdapterSpec("s", dataset="arith", rank=2, batch_size=2, lr=2e-3, max_steps=2, seed=2)]
PAIRS = [{"prompt": f"Q{i}: is {i} even?", "chosen": " yes" if i % 2 == 0 else " no",
          "rejected": " no" if i % 2 == 0 else " yes"} for i in range(40)]
CALLS: list[tuple[str, int, int]] = []  # (collective, largest tensor's numel, ranks in its group)
STUDY_CALLS: list[list] = []
RESUMES = {"resume": "stop", "resume_one": "stop", "resume_four": "stop", "resume_mixed": "mixed",
           "resume_two": "stop_single",
           "load_two": "stop_single",
           "early_exit_resume_two": "early_exit_stop_single", "warmup_resume": "warmup_stop",
           "optuna_crash_resume": "optuna_crash"}  # a resuming mode: the mode whose checkpoint it reads
PROCESSES = {"hybrid": 4, "resume_one": 1, "resume_four": 4}  # (modes of another number of processes than 2)
SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
         "rank": {"type": "categorical", "choices": [2, 4]}}


def record(name):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        CALLS.append((name, max((t.numel() for t in tensors), default=0), dist.get_world_size(group)))
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)


def count_study_calls() -> None:
    """Record every ask, report and tell this process makes on any Optuna study."""
    import optuna

    def wrap(cls, name, describe):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            STUDY_CALLS.append([name, *describe(self, result, *args, **kwargs)])
            return result

        setattr(cls, name, wrapper)

    wrap(optuna.Study, "ask", lambda self, trial, *a, **k: [trial.number])
    wrap(optuna.Study, "tell", lambda self, result, number, *a, **k: [number])
    wrap(optuna.trial.Trial, "report", lambda self, result, value, step: [self.number, step])


def sweep_callbacks(out: Path, mode: str) -> tuple[list, Callable[[], Any]]:
    """The callbacks of a sweep mode, and how to find the study this process holds after fit (to read back)."""
    import optuna

    from lightning_multilora.callbacks import OptunaSweep, WarmupSelection

    if mode == "optuna_admission":
        sweep = OptunaSweep(SPACE, n_trials=6, study=optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)),
                            base={"max_steps": 3, "batch_size": 1})
        return [sweep], lambda: sweep.study
    if mode == "optuna_defaults":  # the study, the exports and the summary where they go by default: the log dir
        from lightning_multilora.callbacks import SweepReport

        sweep = OptunaSweep(SPACE, n_trials=3, sampler="random", seed=1, base={"max_steps": 3, "batch_size": 1}, slots=2)
        return [sweep, SweepReport(print_table=False)], lambda: sweep.study
    if mode == "optuna_prune":  # the study's pruner prunes both trials at the run's last validation (step 3)
        class PruneFrom3(optuna.pruners.BasePruner):
            def prune(self, study, trial):
                return trial.last_step is not None and trial.last_step >= 3

        study = optuna.create_study(pruner=PruneFrom3(), sampler=optuna.samplers.RandomSampler(seed=0))
        return [OptunaSweep(SPACE, n_trials=2, study=study, base={"max_steps": 20, "batch_size": 1}, slots=2)], \
            lambda: study
    if mode.startswith("optuna_crash"):
        sweep = OptunaSweep(SPACE, n_trials=5, storage=f"sqlite:///{out / 'optuna_crash'}.db", sampler="random",
                            seed=5, base={"max_steps": 6, "batch_size": 2}, slots=2)
        return [sweep], lambda: sweep.study
    if mode.startswith("warmup"):
        db = out / ("warmup_resumed" if mode in ("warmup_stop", "warmup_resume") else mode)
        sweep = OptunaSweep(SPACE, n_trials=4, storage=f"sqlite:///{db}.db", sampler="random", seed=3,
                            base={"max_steps": 8, "batch_size": 1}, slots=2)
        return [sweep, WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5)], lambda: sweep.study
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=2))
    base = {"max_steps": 3, "batch_size": 1}
    if mode == "optuna_bad_target":
        base["target_modules"] = ["nope_proj"]
    return [OptunaSweep(SPACE, n_trials=5, study=study, base=base, slots=2)], lambda: study


class RefusedOnRankOne(MultiLoRADataModule):
    """Refuses adapter "late" on rank 1 alone, as if its data file were gone there (`check`), with an error that is
    no ValueError (a source's own)."""

    def check(self, spec: AdapterSpec) -> None:
        super().check(spec)
        if spec.name == "late" and self.trainer.global_rank == 1:
            raise RuntimeError("its data is not readable here")


def study_rows(study) -> list[dict]:
    return [dict(number=t.number, params=t.params, state=t.state.name, value=t.value,
                 steps=sorted(t.intermediate_values), adapter=t.user_attrs.get("adapter"))
            for t in study.get_trials(deepcopy=False)]


def run_mode(out: Path, mode: str) -> None:
    CALLS.clear()
    STUDY_CALLS.clear()
    random.seed(0)
    torch.manual_seed(0)
    sweep = mode.startswith(("optuna", "warmup"))  # its adapters come from the study; adapters validate on finish
    admission = None
    if mode in ("admission", "optuna_admission", "owner_pause", "owner_pause_single"):
        from lightning_multilora.scheduling import AdmissionController

        budget = 100 if mode.startswith("owner_pause") else 2  # (owner_pause: it orders the queue; room for all)
        admission = AdmissionController(lambda specs: float(sum(s.rows_per_step for s in specs) * 2**30),
                                        budget * 2**30, safety_margin=1.0)
    dpo = mode.startswith("dpo")
    specs = [] if sweep else DPO_SPECS if dpo else SPECS
    defaults = mode in ("optuna_defaults", "smoke")
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=None if defaults else str(out / mode),
                             admission=admission, **({"max_running": 3} if mode.startswith("owner_pause") else {}))
    sources: dict[str, Any] = {"arith": GeneratedArithmetic(200)}
    if dpo:
        from lightning_multilora.data import PreferenceSource

        sources["pairs"] = PreferenceSource(records=PAIRS)
    dm = (RefusedOnRankOne if mode == "disagree" else MultiLoRADataModule)(
        sources=sources, padding="max_length", max_length=96, max_val_examples=8)
    kwargs = dict(accelerator="cpu", max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                  enable_model_summary=False, logger=defaults, default_root_dir=str(out / f"root_{mode}"),
                  val_check_interval=3, check_val_every_n_epoch=None)  # checkpointing on: ModelCheckpoint saves at the end
    ckpt_path = None
    if mode in ("stop", "stop_single", "early_exit_stop_single"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs.update(max_steps=2, callbacks=[ModelCheckpoint(dirpath=out / f"ckpt_{mode}", every_n_train_steps=2,
                                                              save_top_k=-1)])
    if mode in RESUMES:
        (ckpt_path,) = (out / f"ckpt_{RESUMES[mode]}").glob("*step=6*.ckpt" if mode == "optuna_crash_resume" else
                                                            "*.ckpt")
    if mode.startswith(("early_exit", "remove", "end_eval")) and mode not in ("early_exit_stop_single",
                                                                              "early_exit_resume_two"):
        # every adapter's values (and exit texts) to rank 0's loggers
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        kwargs.update(logger=[CSVLogger(out / f"logs_{mode}", name="csv", version=0),
                              TensorBoardLogger(out / f"logs_{mode}", name="tb", version=0)], log_every_n_steps=1)
    if mode.startswith("early_exit"):
        from lightning_multilora.callbacks import EarlyExit

        class ExitA1(EarlyExit):
            """EarlyExit whose rule says "overfit" for a1 at its first validation: the coordination is under
            test here, the rule itself in tests/callbacks."""

            def observe_validation(self, name, val_loss, step=-1, new_best=None):
                super().observe_validation(name, val_loss, step, new_best)
                return "overfit" if name == "a1" else None

        kwargs.update(callbacks=[*kwargs.get("callbacks", []), ExitA1()])
    evaluated: dict[str, float] = {}
    if mode.startswith("remove"):
        class EvaluateAndRemoveA1(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2 and pl_module.registry["a1"].state.value == "running":
                    evaluated.update(pl_module.evaluate(["a0", "a1"]))
                    for name in ("a0", "a1"):  # (its owner writes it; another rank's call returns None)
                        path = pl_module.save_adapter(name, directory=out / f"{mode}_saved" / name)
                        evaluated[f"saved_{name}"] = path is not None
                    pl_module.remove_adapter("a1", reason="removed by a callback at step 2")

        kwargs.update(callbacks=[*kwargs.get("callbacks", []), EvaluateAndRemoveA1()])
    if mode.startswith("end_eval"):
        class EvaluateAtTheEnd(L.Callback):
            def on_train_end(self, trainer, pl_module):
                evaluated.update(pl_module.evaluate([r.name for r in pl_module.registry.running], record=True))

        from lightning.pytorch.callbacks import ModelCheckpoint

        # and a checkpoint on rank 1's adapter's training loss, every step (its owner alone had the value: it hung)
        kwargs.update(max_steps=2, callbacks=[*kwargs.get("callbacks", []), EvaluateAtTheEnd(), ModelCheckpoint(
            dirpath=out / f"ckpt_{mode}", monitor="adapters/a1/train_loss", every_n_train_steps=1, save_top_k=1)])
    if mode.startswith("owner_pause"):
        class PauseOnItsOwner(L.Callback):
            """x (batch 2) and y (batch 1) queued after step 1 (on every rank), a1 paused after step 2 and resumed
            after step 5 on the rank that trains it alone: the admission prefers the freed slot's batch size."""

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                evaluated.setdefault("running", []).append(sorted(r.name for r in pl_module.registry.running))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                step = trainer.global_step
                if step == 1:
                    pl_module.add_adapter(AdapterSpec("x", rank=2, batch_size=2, lr=1e-3, max_steps=3, seed=7))
                    pl_module.add_adapter(AdapterSpec("y", rank=2, batch_size=1, lr=1e-3, max_steps=3, seed=8))
                if step in (2, 5) and pl_module._owns("a1"):
                    getattr(pl_module, "pause_adapter" if step == 2 else "resume_adapter")("a1")
                x = pl_module.registry["x"] if "x" in pl_module.registry else None  # (admitted after the exchange
                if x is not None and x.state.value == "running" and x.step == 1 and pl_module._owns("x"):  # before)
                    pl_module.remove_adapter("x", reason="judged after its first step by its rank")

        kwargs.update(callbacks=[PauseOnItsOwner()])
    if mode == "one_rank_stop":
        class RemoveOnRankZero(L.Callback):
            """Removes an adapter rank 1 trains, on rank 0 alone (under `trainer.is_global_zero`)."""

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2 and trainer.is_global_zero:
                    pl_module.remove_adapter(next(n for n, r in sorted(trainer.strategy.owner.items()) if r == 1
                                                  and pl_module.registry[n].state.value == "running"))

        kwargs.update(callbacks=[RemoveOnRankZero()])
    if mode in ("one_rank_add", "one_rank_unqueue"):
        class QueueOnOneRank(L.Callback):
            """Queues adapters (or removes a queued one) on one rank alone."""

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                step, rank = trainer.global_step, trainer.global_rank
                if mode == "one_rank_add" and step == 2 and trainer.is_global_zero:
                    pl_module.add_adapter(AdapterSpec("z", rank=2, batch_size=1, lr=1e-3, max_steps=2, seed=9))
                if mode == "one_rank_unqueue" and step == 1:
                    pl_module.max_running = 4
                    for name in ("z", "w"):
                        pl_module.add_adapter(AdapterSpec(name, rank=2, batch_size=1, lr=1e-3, max_steps=2, seed=9))
                if mode == "one_rank_unqueue" and step == 2 and rank == 1:
                    pl_module.remove_adapter("w", reason="unqueued on rank 1 alone")

        kwargs.update(callbacks=[QueueOnOneRank()])
    if mode == "refit_on":
        kwargs.update(max_steps=2)
    if mode == "sigterm":
        import os
        import signal
        import threading

        class TermAtStep2(L.Callback):
            """SIGTERM to rank 0 after step 2 while it waits in the step's exchange (rank 1 a second late to it)."""

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2:
                    if trainer.global_rank == 0:
                        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
                    else:
                        time.sleep(1.0)

        kwargs.update(callbacks=[TermAtStep2()])
    if mode == "rank1_error":
        import lightning_multilora.module as made

        class Rank1Fails(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == 1 and trainer.global_rank == 1:
                    raise RuntimeError("rank 1 lost its GPU")

        def slow(*args, save=made.save_peft_adapter, **kw):  # (rank 0's exports, as of a large adapter)
            if dist.get_rank() == 0:
                time.sleep(2.0)
            return save(*args, **kw)

        made.save_peft_adapter = slow
        kwargs.update(callbacks=[Rank1Fails()])
    if mode == "smoke":
        import tempfile

        kwargs.update(fast_dev_run=2)
        (out / "tmp").mkdir(exist_ok=True)
        tempfile.tempdir = str(out / "tmp")  # (the smoke run's temporary folder in the tests' own, not left in /tmp)
    if mode == "disagree":
        class AddLate(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2:
                    pl_module.add_adapter(AdapterSpec("late", rank=2, batch_size=1, lr=1e-3, max_steps=2, seed=5))

        kwargs.update(callbacks=[AddLate()])
    if mode == "refit":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs.update(max_steps=4, callbacks=[ModelCheckpoint(dirpath=out / "ckpt_refit", every_n_train_steps=2,
                                                              save_top_k=-1)])
    held_study = None
    if sweep:
        callbacks, held_study = sweep_callbacks(out, mode)
        kwargs.update(callbacks=callbacks)
    if mode == "optuna_prune":
        kwargs.update(max_steps=3)  # (the run's last step: its validation is the last, no later exchange)
    if mode == "optuna_crash":
        from lightning.pytorch.callbacks import ModelCheckpoint

        class CrashAt13(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == 13:
                    raise RuntimeError("node lost")

        kwargs.update(callbacks=[*kwargs["callbacks"], CrashAt13(), ModelCheckpoint(
            dirpath=out / f"ckpt_{mode}", every_n_train_steps=6, save_top_k=-1)])
    if mode == "warmup_stop":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs.update(max_steps=3, callbacks=[*kwargs["callbacks"], ModelCheckpoint(
            dirpath=out / f"ckpt_{mode}", every_n_train_steps=3, save_top_k=-1)])
    if not mode.endswith("single"):
        # a short collective timeout: a rank left waiting fails the run in a minute rather than hanging the tests
        # "replicated": a whole base on each of 2 ranks; "hybrid": 4 ranks, the base sharded within pairs
        shard_size = {"replicated": 1, "hybrid": 2}.get(mode)
        strategy = AdapterParallelStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90),
                                           shard_size=shard_size)
        trainer = L.Trainer(strategy=strategy, devices=PROCESSES.get(mode, 2),
                            **kwargs)
    else:
        trainer = L.Trainer(devices=1, **kwargs)
    if mode == "load_two":  # the checkpoint loaded first: a fit without it as `ckpt_path` is refused, one with it
        # goes on as `resume_two` does
        module = MultiLoRAModule.load_from_checkpoint(ckpt_path, export_dir=str(out / mode))
        refusing = L.Trainer(strategy=AdapterParallelStrategy(process_group_backend="gloo",
                                                              timeout=timedelta(seconds=90)), devices=2, **kwargs)
        try:
            refusing.fit(module, dm)
        except ValueError as err:
            evaluated["refused"] = str(err)
    try:
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    except BaseException as err:
        if mode in ("one_rank_stop", "one_rank_add", "one_rank_unqueue") and isinstance(err, ValueError):
            evaluated["refused"] = f"{str(err)} (after step {trainer.global_step})"
        elif mode in ("optuna_bad_target", "resume_mixed"):  # (failing on every rank: each one's error)
            evaluated["failed"] = f"{type(err).__name__}: {err}"
        elif mode == "optuna_crash" and "node lost" in str(err):
            evaluated["crashed"] = trainer.global_step
        elif mode != "sigterm" or type(err).__name__ != "SIGTERMException":
            raise
        else:
            evaluated["stopped"] = f"{type(err).__name__} after step {trainer.global_step}"
    if mode == "refit":  # the same module object resumed in place from its step-2 checkpoint, and run to the end
        (ckpt_path,) = (out / "ckpt_refit").glob("*step=2*.ckpt")
        again = AdapterParallelStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90))
        trainer = L.Trainer(strategy=again, devices=2, **dict(kwargs, max_steps=-1, callbacks=[]))
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    if mode == "refit_on":  # the same module object fitted again: each rank holds the adapters it trained
        again = AdapterParallelStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90))
        trainer = L.Trainer(strategy=again, devices=2, **dict(kwargs, max_steps=-1))
        trainer.fit(module, dm)
    rank = trainer.global_rank
    if mode.startswith("end_eval"):  # after the fit: what trainer.validate returns, and an ended adapter evaluated
        validated = sorted(trainer.validate(module, dm, verbose=False)[0])
        try:
            module.evaluate(["a3"])
        except ValueError as err:
            refused = str(err)
        evaluated["validated"], evaluated["refused"] = validated, refused
        evaluated["best"] = Path(trainer.checkpoint_callback.best_model_path).name
    shards, local = [], 0
    if not mode.endswith("single"):
        from torch.distributed.tensor import DTensor

        shards = sorted({p.to_local().numel() for p in module.model.parameters() if isinstance(p, DTensor)})
        local = sum(p.to_local().numel() for p in module.model.parameters() if isinstance(p, DTensor))
    owned = sorted(n for n, r in getattr(trainer.strategy, "owner", {}).items() if r == rank)
    states = {r.name: (r.state.value, r.step) for r in module.registry}
    started = {r.name: r.started_at_step for r in module.registry}
    val = {r.name: r.val_losses for r in module.registry}
    spans = {r.name: r.spans for r in module.registry}
    train = {r.name: r.train_losses for r in module.registry}
    preference = {r.name: r.last_val_preference_accuracy for r in module.registry if r.spec.objective == "dpo"}
    exported = {r.name: (r.export_path, r.exported_step) for r in module.registry}
    reasons = {r.name: r.reason for r in module.registry}
    sweep_state = {}
    if held_study is not None:
        study = held_study()
        sweep_state = dict(study=study_rows(study) if study is not None else None, study_calls=STUDY_CALLS,
                           callbacks={type(cb).__name__: cb.state_dict() for cb in trainer.callbacks
                                      if type(cb).__module__.startswith("lightning_multilora")},
                           specs={r.name: r.spec.to_dict() for r in module.registry})
    if mode == "stop":  # the checkpoint validated (after the records above: it restores
        # the checkpoint's registry): every rank's registry then holds the owners' progress
        trainer.validate(module, dm, ckpt_path=next((out / "ckpt_stop").glob("*.ckpt")), verbose=False)
        evaluated["steps_validated"] = {r.name: r.step for r in module.registry}
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps(dict(owned=owned, calls=CALLS, shard_numels=shards, local_numel=local,
                                                                 states=states, started=started, val=val, spans=spans,
                                                                 train=train,
                                                                 preference=preference, evaluated=evaluated,
                                                                 exported=exported, reasons=reasons,
                                                                 **sweep_state)))


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2:]
    processes = {1 if m.endswith("single") else PROCESSES.get(m, 2) for m in modes}
    if len(processes) != 1:
        sys.exit(f"modes of one invocation run on the same processes; these need {sorted(processes)}: {modes}")
    if not all(m.endswith("single") for m in modes):
        for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_reduce"):
            if hasattr(dist, name):
                record(name)
    for i, mode in enumerate(modes):
        source = RESUMES.get(mode)
        if source in modes[i:]:
            sys.exit(f"mode {mode!r} resumes the checkpoint of {source!r}: list {source!r} first")
    if any(m.startswith(("optuna", "warmup")) for m in modes):
        count_study_calls()
    for mode in modes:
        print(f"== ap_run.py mode {mode} ==", file=sys.stderr, flush=True)  # (whose traceback follows)
        if mode in RESUMES and RESUMES[mode] != "mixed":  # ("mixed": a checkpoint the test makes)
            wait_for(out / f"{RESUMES[mode]}.rank0.json")
        run_mode(out, mode)


def wait_for(record: Path, timeout_s: float = 600.0) -> None:
    """Until the mode whose checkpoint a mode resumes has ended (its record written), in an invocation started
    beside this one."""
    waited = time.monotonic()
    while not record.is_file():
        if time.monotonic() - waited > timeout_s:
            sys.exit(f"{record} did not come in {timeout_s:g} s: run the mode it records first")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # a gloo thread still running at the interpreter's exit aborts the process (rarely)
        dist.destroy_process_group()
