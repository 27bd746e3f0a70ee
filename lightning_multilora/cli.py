"""The ``multilora`` command: LightningCLI over `MultiLoRAModule` and `MultiLoRADataModule`.

    multilora fit --config sweep.yaml        # any LightningCLI subcommand and flag
    multilora demo [--trainer.max_steps 50]  # the packaged default sweep (configs/demo.yaml)
    multilora schedule tasks.yaml            # plan tasks on the GPUs (CP-SAT), print a table and a Gantt chart, run
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_multilora.arguments import UsageError
from lightning_multilora.callbacks.report import SweepReport
from lightning_multilora.data.datamodule import MultiLoRADataModule
from lightning_multilora.module import MultiLoRAModule
from lightning_multilora.spec import peft_hints


class _Parser(LightningArgumentParser):
    """Lightning's parser; an AdapterSpec field spelt as PEFT spells it (``r``, ``lora_alpha``...) is answered with
    this package's name for it, as `AdapterSpec` itself answers from Python."""

    def error(self, message: str, ex: Optional[Exception] = None):
        refused = set(re.findall(r"Option '([A-Za-z_]+)' is not accepted", message))
        return super().error(message + peft_hints(refused), ex)


class MultiLoRACLI(LightningCLI):
    """Adds the sweep report and step-based validation defaults (the training stream is endless:
    a run ends when every adapter has finished)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` alone: a run's adapters come and go within it (LightningCLI's validate ran idle forwards and
        reported nothing; test and predict have no step here). Validation losses are the run's, per adapter."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(SweepReport, "report")
        parser.set_defaults({
            "trainer.max_steps": -1,
            "trainer.max_epochs": -1,
            "trainer.val_check_interval": 50,
            "trainer.check_val_every_n_epoch": None,
            "trainer.default_root_dir": "runs",
            "trainer.log_every_n_steps": 10,
        })

    def instantiate_classes(self) -> None:
        """A value the classes refuse as they are built (an AdapterSpec field out of range, say) ends the command with
        its own message, as a parse error does, not under jsonargparse's traceback (which wraps it among the
        type's alternatives). So does an OSError (a `base_model` that is no checkpoint, a file a source cannot read)."""
        try:
            super().instantiate_classes()
        except (ValueError, OSError) as err:
            self.parser.error(config_error(err), ex=err)

    def before_fit(self) -> None:
        from lightning_multilora.strategies.adapter_parallel import check_resume_path

        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        check_resume_path(ckpt_path, self.trainer.strategy)
        # What the fit would find wrong only once under way (the base loaded, a log version made), found now and
        # said as a parse error is: a checkpoint that is not there, a tokenizer that does not load, an adapter's
        # unknown `dataset`, nothing to train
        path = str(ckpt_path) if ckpt_path is not None else None
        if path is not None and path not in ("last", "best", "hpc", "registry") and "://" not in path \
                and not Path(path).exists():
            self.parser.error(f"`ckpt_path` {path!r}: no such checkpoint file or folder")
        try:
            self.datamodule.tokenizer
            for rec in self.model.registry:
                self.datamodule.source_name(rec.spec.dataset)
        except (ValueError, OSError) as err:
            self.parser.error(str(err))
        providers = [cb for cb in self.trainer.callbacks if hasattr(cb, "has_pending_candidates")]
        if ckpt_path is None and not len(self.model.registry) and not providers:
            self.parser.error("no adapter to train: give `model.adapters`, `model.grid`, or a callback that asks them "
                              "(lightning_multilora.callbacks.OptunaSweep)")
        log_dir = self.trainer.log_dir  # (a logger's next version: new; without a logger, the root directory)
        previous = [n for n in PREVIOUS_RUN_FILES if log_dir and (Path(log_dir) / n).exists()]
        if previous and ckpt_path is None:  # (its study would be continued, its config and summary written over)
            self.parser.error(f"the log directory {log_dir} holds another run's {', '.join(previous)}: give this run "
                              "its own (--trainer.default_root_dir, or a logger that versions its runs), or resume "
                              "that run with --ckpt_path")

    def fit(self, model: MultiLoRAModule, **kwargs) -> None:
        """``Trainer.fit``; a `UsageError` it raises (a data file that does not read, a storage URL that does not
        open...) ends the command with its message, as a parse error does. Adapters trained before it are exported
        (`ExportOnException`). A SIGTERM ends it with status 143 (Lightning's exception for it is a
        ``SystemExit`` of status 0: a run stopped for pre-emption looked done to a scheduler)."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        try:
            self.trainer.fit(model, **kwargs)
        except UsageError as err:
            self.parser.error(str(err))
        except SIGTERMException as err:
            raise SystemExit(128 + signal.SIGTERM) from err


def config_error(err: Exception) -> str:
    """The message of a value refused while the config's classes were built: jsonargparse reports a value that none
    of a type's alternatives took (a list of AdapterSpecs, or None) with each alternative's error; the ones our
    classes raised are kept, its own "Expected a <class 'NoneType'>", "Not a valid subclass of ..." (with the forms a
    class may take) and the value's dump dropped."""
    text = str(err)
    if "Errors:" not in text:
        return text
    lines = text.split("Errors:", 1)[1].splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip().startswith("- ")), default=0)
    listed = [line.strip()[2:] for line in lines  # (the alternatives' own, not the lines nested in them)
              if line.strip().startswith("- ") and len(line) - len(line.lstrip()) == indent]
    ours = [line for line in listed if not line.startswith(("Expected a ", "Not a valid subclass of "))]
    return "; ".join(ours or listed) or text


class RawEpilogFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the epilog's lines kept as written."""


def demo_config() -> str:
    return str(resources.files("lightning_multilora") / "configs" / "demo.yaml")


# What a run leaves in its log directory (besides the logger's files), which another run there would write over
PREVIOUS_RUN_FILES = ("config.yaml", "sweep_summary.json", "optuna.db")

COMMANDS = """commands beside fit:
  demo [--trainer.max_steps 50]  the packaged default sweep (configs/demo.yaml): fit with its config
  schedule TASKS.yaml            plan tasks on the GPUs (CP-SAT), print a table and a Gantt chart, run them
                                 (`multilora schedule --help`)"""


def main(args: Optional[list[str]] = None) -> None:
    from_command_line = args is None
    args = list(sys.argv[1:] if args is None else args)
    if args[:1] == ["schedule"]:
        from lightning_multilora.scheduling.task_file import main as schedule

        sys.exit(schedule(args[1:]))
    if args[:1] == ["demo"]:
        args = ["fit", "--config", demo_config(), *args[1:]]
    if from_command_line:  # (LightningCLI warns when given both ``args`` and a command line)
        sys.argv[1:] = args
    # (no --optimizer / --lr_scheduler: LightningCLI's would replace the module's per-adapter optimizer groups and
    # schedules, `--model.optimizer`, `--model.optimizer_kwargs` and each adapter's `lr` / `lr_schedule`, silently)
    MultiLoRACLI(MultiLoRAModule, MultiLoRADataModule, subclass_mode_model=False, subclass_mode_data=False,
                 auto_configure_optimizers=False, parser_class=_Parser,
                 save_config_kwargs={"overwrite": True}, args=None if from_command_line else args,
                 parser_kwargs={"epilog": COMMANDS, "formatter_class": RawEpilogFormatter})


if __name__ == "__main__":
    main()
