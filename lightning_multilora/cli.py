"""The ``multilora`` command: LightningCLI over `MultiLoRAModule` and `MultiLoRADataModule`.

    multilora fit --config sweep.yaml        # any LightningCLI subcommand and flag
    multilora demo [--trainer.max_steps 50]  # the packaged default sweep (configs/demo.yaml)
    multilora schedule tasks.yaml            # plan tasks on the GPUs (CP-SAT), print a table and a Gantt chart, run
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import warnings
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

from jsonargparse import DefaultHelpFormatter, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_multilora.arguments import RunEnded, UsageError
from lightning_multilora.callbacks.report import SweepReport
from lightning_multilora.data.datamodule import MultiLoRADataModule
from lightning_multilora.module import MultiLoRAModule
from lightning_multilora.spec import peft_hints


class _Parser(LightningArgumentParser):
    """Lightning's parser; a field a class does not take (a typo in a config's adapter) is named with the fields it
    does take and the closest one, and an AdapterSpec field spelt as PEFT spells it (``r``, ``lora_alpha``...) is
    answered with this package's name for it, as `AdapterSpec` itself answers from Python. Its usage line is one
    line (the whole of Lightning's, some 80, buried the error; ``--help`` has them)."""

    def error(self, message: str, ex: Optional[Exception] = None):
        refused = sorted(set(re.findall(r"Option '([A-Za-z_]\w*)(?:\.[\w.]*)?' is not accepted", message)))  # (a
        # mapping's field, `axis: {lr: ...}`, is named by its key: 'axis.lr')
        if "subcommand" in message and "{fit}" in message or "(choose from 'fit')" in message:
            # (demo and schedule are commands of `main`, not of the parser)
            message = message.rstrip(".") + "; the commands: fit, demo, schedule (`multilora --help`)"
        sub = re.search(r"Subcommand '(\w+)'", message)  # (a config's key: the command's parser names its keys)
        commands = getattr(getattr(self, "_subcommands_action", None), "_name_parser_map", {})
        parser = commands.get(sub[1]) if sub else None
        top = [a.dest for a in (parser or self)._actions if a.dest and "." not in a.dest
               and a.dest not in ("help", "config")]
        said = (_refused_fields(message, refused) or _section_typo(message, top) or _one_of_a_list(message)
                or _wrong_type(message) or _class_path(message) or _field_before_class(message)
                or _unknown_class(message) or message)
        return super().error(said + peft_hints(refused), ex)

    def print_usage(self, file=None) -> None:
        (file or sys.stdout).write(f"usage: {self.prog} [-h] [-c CONFIG] [--KEY VALUE ...]\n")


def _refused_fields(message: str, refused: list[str]) -> Optional[str]:
    """jsonargparse's error for fields a class refuses (``Option 'rnak' is not accepted``, under the union's other
    alternatives and the value's dump) as one sentence: the key, the fields refused with the closest accepted one,
    and the ones the class takes. None where the message is not that."""
    import difflib
    import inspect

    key, where = re.match(r'Parser key "([^"]+)"', message), re.search(r"class_path '([\w.]+)'", message)
    if not (refused and key and where):
        return None
    try:
        from jsonargparse.typing import import_object

        cls = import_object(where[1])
        fields = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # (a class it cannot import or read: its own message then)
        return None
    refused = [name for name in refused if name not in fields]  # (a field it takes, of the wrong type: the union's
    if not refused:  # base class alternative, `Callback`, refused it; `_wrong_type` says what is wrong)
        return None
    if not fields:  # (the declared base class, which jsonargparse fell back to: the class meant was not read)
        said = f"`{key[1]}`: {cls.__name__} takes no {', '.join(map(repr, refused))}: the class meant was not read"
        if key[1].rpartition(".")[2] in _MAPPING_KEYS:
            return (f"{said} with its fields; give each as NAME: {{class_path: <class>, init_args: {{<field>: "
                    f"<value>}}}} in a config, or on the command line as --{key[1]}.NAME <class> "
                    f"--{key[1]}.NAME.<field> <value>")
        return f"{said} (no class given takes it); {_class_first(key[1], refused)}"
    named = [f"{name!r}" + "".join(f" (did you mean {close!r}?)" for close in difflib.get_close_matches(
        name, fields, n=1) if not peft_hints([name])) for name in refused]  # (PEFT's spellings: their own hint)
    said = f"`{key[1]}`: {cls.__name__} takes no {', '.join(named)}; it takes {', '.join(fields)}"
    option = f"--{key[1]}.init_args."
    shorter = tuple(f"--{key[1]}.{name}" for name in refused)  # (jsonargparse's short form, without init_args)
    given_here = any(arg.split("=")[0] in (f"--{key[1]}", f"--{key[1]}+") for arg in _given)  # (the classes given
    # on the command line: a misspelt field of the one meant, not another's)
    if not given_here and any(arg.startswith(option) or arg.split("=")[0] in shorter for arg in _given):  # (the list's
        # last class takes it)
        said += (f" ({option}* sets the last item's: to change another, write the whole config with --print_config "
                 "> run.yaml, edit it, then `multilora fit --config run.yaml`)")
    return said


# the keys whose value is a mapping of names to classes (the others hold a class, or a list of them)
_MAPPING_KEYS = ("sources", "val_sources")


def _classes_taking(key: str, names: Sequence[str]) -> list[str]:
    """The classes that the option ``key`` may hold (this package's callbacks and Lightning's, Lightning's loggers, or
    this package's data sources) that take every field of ``names``, by import path."""
    import inspect

    import lightning.pytorch.callbacks as callbacks
    import lightning.pytorch.loggers as loggers

    import lightning_multilora

    if key.endswith("callbacks"):
        found = [(f"lightning_multilora.{n}", getattr(lightning_multilora, n))
                 for n in ("EarlyExit", "WarmupSelection", "OptunaSweep", "SweepReport")]
        found += [(f"lightning.pytorch.callbacks.{n}", getattr(callbacks, n)) for n in callbacks.__all__]
    elif key.rpartition(".")[2] in _MAPPING_KEYS:
        import lightning_multilora.data as data

        found = [(f"lightning_multilora.data.{n}", getattr(data, n))
                 for n in ("JSONLSource", "PreferenceSource", "HFDatasetSource", "ListSource", "GeneratedArithmetic")]
    elif key.endswith("logger"):
        found = [(f"lightning.pytorch.loggers.{n}", getattr(loggers, n))  # (the default logger's class first)
                 for n in sorted(loggers.__all__, key=lambda n: n != "TensorBoardLogger")]
    else:
        return []
    takers = []
    for path, cls in found:
        try:
            if isinstance(cls, type) and all(n in inspect.signature(cls).parameters for n in names):
                takers.append(path)
        except (TypeError, ValueError):  # (a class whose signature cannot be read)
            continue
    return takers


def _class_first(key: str, refused: Sequence[str]) -> str:
    """How to give option ``key`` (a class, or a list of them) the fields ``refused``: its class first, named where
    one this package or Lightning has takes them."""
    takers = _classes_taking(key, refused)
    cls_name, field = takers[0] if takers else "<class>", refused[0]
    return (f"give the class first, then its fields: --{key}{'+=' if key.endswith('callbacks') else ' '}{cls_name} "
            f"--{key}.init_args.{field} <value> (a field sets the last class given), or in a config {{class_path: "
            f"{cls_name}, init_args: {{{field}: <value>}}}}" + (f" ({', '.join(takers)} take {field!r})"
                                                             if len(takers) > 1 else ""))


def _unknown_class(message: str) -> Optional[str]:
    """jsonargparse's error for a class path that does not import (``--trainer.callbacks+=lightning_multilora.
    EarlyExitt``: the union's alternatives, the reason twice) as one sentence: the key, the class, why, and the closest
    class this package or Lightning has for the option. None where the message is not that."""
    import difflib

    found = re.search(r'Parser key "([\w.]+)":.*?(?:Problem with given class_path \'([\w.]+)\':\s+(.*?)\n|Expected a '
                      r"dot import path string: (\S+))", message, re.S)
    if found is None:
        return None
    key, path, why = found[1], found[2] or found[4], found[3] or "a class is named by its import path"
    try:  # (a class that imports, refused for another reason: a required argument missing, said so; any other,
        from jsonargparse.typing import import_object  # jsonargparse's message)

        import_object(path)
    except Exception:  # noqa: BLE001 - whatever a path that does not import raises
        pass
    else:
        required = re.match(r"the following arguments are required: ([\w, ]+)", why)
        if required is None:
            return None
        names = [n.strip() for n in required[1].split(",")]
        if key.rpartition(".")[2] in _MAPPING_KEYS:  # (a source's fields follow its name: `init_args` is refused)
            return (f"`{key}`: {path} needs {', '.join(map(repr, names))}: give "
                    f"{' '.join(f'--{key}.NAME.{n} <value>' for n in names)} after it (NAME: the source's), or "
                    f"NAME: {{class_path: {path}, init_args: {{{', '.join(f'{n}: <value>' for n in names)}}}}} in a "
                    "config")
        return (f"`{key}`: {path} needs {', '.join(map(repr, names))}: give "
                f"{' '.join(f'--{key}.init_args.{n} <value>' for n in names)} after it (or init_args: {{"
                f"{', '.join(f'{n}: <value>' for n in names)}}} in a config)")
    known = _classes_taking(key, [])
    short = {p.rpartition(".")[2]: p for p in known}
    close = difflib.get_close_matches(path, known, n=1) or [
        short[c] for c in difflib.get_close_matches(path.rpartition(".")[2], list(short), n=1)]
    hint = f" (did you mean {close[0]!r}?)" if close else (
        f" (this package's: {', '.join(p for p in known if p.startswith('lightning_multilora'))})"
        if any(p.startswith("lightning_multilora") for p in known) else "")
    return f"`{key}`: no class {path!r}: {why}{hint}"


def _field_before_class(message: str) -> Optional[str]:
    """jsonargparse's error for a class's field given to an option that holds no class (``--trainer.logger.init_args
    .save_dir logs`` with no logger class given: the union's alternatives, a ``NestedArg`` dump) as one sentence:
    give the class first. None where the message is not that."""
    found = re.search(r'Parser key "([\w.]+)":.*?Given value: NestedArg\(key=\'(\w+)\'', message, re.S)
    if found is None or "Problem with given class_path" in message:  # (a class named that does not import:
        return None  # `_unknown_class`'s, a source's `--data.sources.x <class>` among them)
    return f"`{found[1]}`: {found[2]!r} is a field of a class, and none is given; {_class_first(found[1], [found[2]])}"


def _one_of_a_list(message: str) -> Optional[str]:
    """jsonargparse's error for one adapter given where a list of them goes (a config's ``adapters:`` whose item lacks
    its ``- ``, or ``--model.adapters '{name: a}'``: "Expected a <class 'list'>", the union's alternatives): said so,
    with both spellings of the list. None where the message is not that."""
    found = re.match(r'Parser key "((?:model\.)?adapters)":', message)
    if not (found and "Expected a <class 'list'>" in message and "Given value type: <class 'dict'>" in message):
        return None
    given = re.search(r"Given value: (.*?)\n", message + "\n")
    return (f"`{found[1]}` is a list of adapters, got one mapping ({given[1] if given else '...'}): in a config, "
            f"begin each adapter with '- ' (`adapters:` then `  - name: a`); on the command line, "
            f"--{found[1]} '[{{name: a, rank: 4}}]' (or --{found[1]}+='{{name: a, rank: 4}}' to add one)")


def _wrong_type(message: str) -> Optional[str]:
    """jsonargparse's error for a value of the wrong type in a list of classes (``rank: eight`` in a config's
    adapters: the union's alternatives and a dump of every item, the field deep inside) as one sentence: the key, the
    item by its name where the dump shows it, the field, the type and the value. None where the message is not that."""
    found = re.search(r'Parser key "([\w.]+)":.*?Parser key "(\w+)":\s+Expected a <class \'(\w+)\'>\. '
                      r"Got value: (.*?)\n", message, re.S)
    if found is None:  # (an optional field, ``max_steps: 2.5``: a union of its type and None, one level deeper)
        found = re.search(r'Parser key "([\w.]+)":.*?Parser key "(\w+)":\s+Does not validate against any of the '
                          r"Union subtypes\s+Subtypes: \[<class '(\w+)'>, <class 'NoneType'>\].*?"
                          r"Given value: (.*?)\n", message, re.S)
    kinds = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text", "NoneType": "null"}
    if found is None:  # (a union of several types, ``target_modules: 5``: each alternative named)
        union = re.search(r'Parser key "([\w.]+)":.*?Parser key "(\w+)":\s+Does not validate against any of the '
                          r"Union subtypes\s+Subtypes: \[(.*?)\]\n.*?Given value: (.*?)\n", message, re.S)
        if union is None:
            return None
        key, field, subtypes, value = union.groups()
        alternatives = re.findall(r"<class '(\w+)'>|list\[<?(?:class ')?(\w+)'?>?\]|([^,\s][^,]*)", subtypes)
        if any(other or kinds.get(one or many) is None for one, many, other in alternatives):
            return None  # (a union of classes: jsonargparse's own account)
        # (in one order: jsonargparse lists a union's types in an order that depends on what it parsed before)
        named = [kinds[one] if one else f"a list of {kinds[many]}" for one, many, _ in
                 sorted(alternatives, key=lambda alt: (alt[0] == "NoneType", bool(alt[1]), list(kinds).index(
                     alt[0] or alt[1])))]
        kind, words = "union", named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
    else:
        key, field, kind, value = found.groups()
        words = kinds.get(kind, f"a {kind}")
    item = re.search(rf"'name': '([^']+)'[^{{}}]*?'{field}': '?{re.escape(value)}'?[,}}]", message)
    which = f"adapter {item[1]!r}: " if item and key.endswith("adapters") else ""
    axis = re.search(rf"'{field}': {{[^{{}}]*?'(\w+)': '?{re.escape(value)}'?[,}}]", message) \
        if kind == "list" and field == "axes" else None
    if axis:  # (a grid's axis given one value: jsonargparse names `axes` alone)
        return (f"`{key}`: `axes[{axis[1]!r}]` must be a list of values, got {value!r} (one value for every "
                f"adapter: give it in `base`, or as [{value}])")
    return f"`{key}`: {which}`{field}` must be {words}, got {value!r}"


def _class_path(message: str) -> Optional[str]:
    """jsonargparse's error for an adapter written as another class (``class_path: peft.LoraConfig``): it told
    the user to enable subclasses, which would not help. An adapter is AdapterSpec's fields, given directly; PEFT's
    LoRA fields by this package's names. None where the message is not that."""
    found = re.search(r"Parser key \"([\w.]+)\".*?thus '([\w.]+)' is not accepted as class_path", message, re.S)
    if found is None:
        return None
    from lightning_multilora.spec import AdapterSpec

    names = [f.name for f in fields(AdapterSpec)]
    return (f"`{found[1]}`: an adapter is AdapterSpec's fields given directly ({', '.join(names)}), not "
            f"class_path {found[2]!r}{peft_hints(['r', 'lora_alpha', 'lora_dropout'])}")


def _section_typo(message: str, top: Sequence[str] = ()) -> Optional[str]:
    """jsonargparse's error for a field the module, the data module or the Trainer does not take (``does not accept
    option 'model.max_runing'`` from a config, ``unrecognized arguments: --model.max_runing`` from the command line),
    with the closest field it takes; a misspelt section or top-level key, with the closest of ``top`` (the parser's
    keys). None where the message is not that, or no field is close."""
    import difflib
    import inspect

    found = re.search(r"does not accept option '([\w.]+)'|unrecognized arguments: --([\w.]+)", message)
    key = (found[1] or found[2]) if found else ""
    section, _, name = key.rpartition(".")
    from lightning.pytorch import Trainer

    from lightning_multilora.callbacks.report import SweepReport

    classes = {"model": MultiLoRAModule, "data": MultiLoRADataModule, "trainer": Trainer, "report": SweepReport}
    head, _, rest = key.partition(".")
    fields = [p for p in inspect.signature(classes[head]).parameters if p not in ("self", "args", "kwargs")] \
        if head in classes else []
    wrapped = rest.partition(".")[0] == head or (section == head and name in fields and "Group" in message)
    if head in classes and wrapped:  # (a `--model FILE` whose keys sit under its own `model:`: the hint repeated
        # the option refused, or named another field)
        return (f"{message.rstrip('.')} (a `--{head} FILE` holds the section's own keys: remove its top-level "
                f"`{head}:`)")
    if head in classes and section not in classes:  # (a misspelt field that holds a mapping, in a config file:
        name = rest.partition(".")[0]  # named by its innermost key, `model.grids.axes.lr`)
        close = difflib.get_close_matches(name, fields, n=1) if name not in fields else []
        return f"{message.rstrip('.')} (did you mean `{head}.{close[0]}`?)" if close else None
    if section not in classes:  # (a misspelt section or top-level key: `--modle.max_running`, `--seed_everthing`)
        dot = "." if rest else ""
        close = difflib.get_close_matches(head, top, n=1) if head and head not in top else []
        return f"{message.rstrip('.')} (did you mean `{close[0]}{dot}{rest}`?)" if close else None
    fields = [p for p in inspect.signature(classes[section]).parameters if p not in ("self", "args", "kwargs")]
    close = difflib.get_close_matches(name, fields, n=1)
    return f"{message.rstrip('.')} (did you mean `{section}.{close[0]}`?)" if close else None


def _written_at(path: Path) -> float:
    """When ``path`` was last written: a file's time, or the newest of a folder's files (an adapter-parallel
    checkpoint, whose rank files are rewritten in place: the folder's own time is its making)."""
    times = [p.stat().st_mtime for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return max(times, default=path.stat().st_mtime)


class MultiLoRACLI(LightningCLI):
    """Adds the sweep report and step-based validation defaults (the training stream is endless:
    a run ends when every adapter has finished)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` alone: a run's adapters come and go within it (LightningCLI's validate ran idle forwards and
        reported nothing; test and predict have no step here). Validation losses are the run's, per adapter."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        for action in parser._actions:  # (Lightning's text offered "best", refused here, and its own "last")
            if action.dest == "ckpt_path":
                action.help = ("Checkpoint to resume from: a path, or 'last': the newest checkpoint of a run of this "
                               "same config (model, data, sweep) under the log root, every version searched; none "
                               "found: a new run, warned. Adapters, optimizer, data positions and callbacks' states "
                               "resume; the base is rebuilt from the config.")
        return parser

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

    def _parse_ckpt_path(self) -> None:
        """Nothing: Lightning's CLI put the hyperparameters a checkpoint file holds over the whole `model` section the
        command gave (`--ckpt_path last`, no file when parsed, not): its settings were dropped unsaid (`export_dir`,
        `max_running`, adapters added to a resumed sweep, a moved `base_model`), and `--print_config` showed another
        config than the run's. The module is the command's, as a Python fit's with `ckpt_path=`; resumed, it keeps the
        checkpoint's adapters and says what it keeps or refuses (`MultiLoRAModule.on_load_checkpoint`)."""

    def instantiate_classes(self) -> None:
        """A value the classes refuse as they are built (an AdapterSpec field out of range, say) ends the command with
        its own message, as a parse error does, not under jsonargparse's traceback (which wraps it among the
        type's alternatives). So does an OSError (a `base_model` that is no checkpoint, a file a source cannot read)
        and a Trainer argument Lightning refuses (`val_check_interval=0.5` beside the CLI's
        `check_val_every_n_epoch=None`)."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            super().instantiate_classes()
        except (ValueError, OSError, MisconfigurationException) as err:  # (the last: the Trainer's own refusals)
            self.parser.error(config_error(err), ex=err)
        except RuntimeError as err:  # (a second EarlyExit, say, appended to a config that has one: a traceback)
            if "more than one stateful callback" not in str(err):
                raise
            self.parser.error(f"{str(err).split('. ')[0]}: the config has one already; set its options with "
                              "--trainer.callbacks.init_args.<name> (the last callback's), or edit the config "
                              "`--print_config` writes", ex=err)

    def before_fit(self) -> None:
        from lightning_multilora.strategies.adapter_parallel import check_resume_path

        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        self._ckpt_named = ckpt_path  # (as given: "last" resolved below)
        # (a logger that chooses its version, read before anything asks it: a version given is not moved)
        self._own_version = getattr(self.trainer.logger, "_version", 0) is None
        if ckpt_path in ("last", "best", "hpc"):  # (the checkpoint it names, given to the fit in its place)
            ckpt_path = self.config_init[self.subcommand]["ckpt_path"] = self._launch_named_checkpoint(ckpt_path)
        try:
            check_resume_path(ckpt_path, self.trainer.strategy)
        except ValueError as err:  # (a folder: it ended in a traceback)
            self.parser.error(str(err))
        # What the fit would find wrong only once under way (the base loaded, a log version made), found now and
        # said as a parse error is: a checkpoint that is not there, a tokenizer that does not load, an adapter's
        # unknown `dataset`, nothing to train
        path = str(ckpt_path) if ckpt_path is not None else None
        if path is not None and path not in ("last", "registry") and "://" not in path \
                and not Path(path).exists():
            self.parser.error(f"`ckpt_path` {path!r}: no such checkpoint file or folder")
        read = _checkpoint_file(path) if path is not None and "://" not in path else None  # (a folder's rank 0's)
        if read is not None and Path(read).is_file():  # (a text file or an export's weights:
            # Lightning's UnpicklingError; another module's checkpoint: a traceback, and the run's files left behind)
            checkpoint, problem = _run_checkpoint(read)
            if problem:
                self.parser.error(f"`ckpt_path` {path!r}: {problem}")
            saved = (checkpoint.get("hyper_parameters") or {}).get("base_model")
            given = getattr(self.model, "_base_named", None)
            if given == "tiny-llama" and saved not in (None, given):  # (the default base: no config given, as
                # Lightning's CLI took the checkpoint's arguments for; the module is the command's config now)
                config = Path(path).parent.parent / "config.yaml"
                self.parser.error(f"`ckpt_path` {path!r}: its run was trained on `base_model` {saved!r}, and this "
                                  "command builds 'tiny-llama' (the default): give the run's config to resume it, "
                                  f"--config {config if config.is_file() else '<its config.yaml>'} (a resume's module "
                                  "is the command's)")
            problem = self.model.other_base_problem((checkpoint.get("multilora") or {}).get("base") or {})
            if problem:  # (said as the fit loaded it: a traceback, a log version made)
                self.parser.error(f"`ckpt_path` {path!r}: {problem}")
            self._resumed_at = checkpoint.get("global_step")
        try:
            self.datamodule.tokenizer
            for rec in self.model.registry:  # (its data source, and its `init_from` folder where it is not a resume:
                self.datamodule.check_source(rec.spec)  # a resumed adapter's weights are in the checkpoint)
                if ckpt_path is None:
                    self.model.check_targets(rec.spec)
            with warnings.catch_warnings():  # (its warnings are the fit's own, said once, as it starts)
                warnings.simplefilter("ignore")
                self.model._refuse_trainer_options(self.trainer, "fit")
        except (ValueError, OSError) as err:
            self.parser.error(str(err))
        drawn = self._drawn_sources()
        held_out = getattr(self.datamodule, "val_sources", {})
        missing = [f"{role} {name!r}: {what}" for role, sources in (("data source", self.datamodule.sources),
                                                                     ("validation source", held_out))
                   for name, source in sources.items()
                   if name in drawn for what in [getattr(source, "missing", lambda: None)()] if what]
        if missing:
            self.parser.error("; ".join(missing))
        providers = [cb for cb in self.trainer.callbacks if hasattr(cb, "has_pending_candidates")]
        if ckpt_path is None and not len(self.model.registry) and not providers:
            self.parser.error("no adapter to train: give `model.adapters`, `model.grid`, or a callback that asks them "
                              "(lightning_multilora.callbacks.OptunaSweep)")
        # (a smoke run writes to a temporary folder, `log_dir_of`: it takes no log directory)
        self._claimed = None if self.trainer.fast_dev_run else self._claim_log_dir(path)

    def _launch_named_checkpoint(self, name: str) -> Optional[str]:
        """`_named_checkpoint`, found by process 0 and taken by the processes it launches (Lightning's launcher starts
        them with this command and its environment): each looked for itself, and process 0, which had taken the log
        directory by then (`_claim_log_dir`) and goes on writing there, could make another process find another
        checkpoint, or none, and the processes then waited on each other for good. A process started otherwise (a
        cluster's launcher) looks for itself, as does a later fit of the same processes (what they were given is
        taken once: a script's second fit reuses them, their environment as it was when they were started)."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        shared = os.environ.get(_NAMED_CHECKPOINT_ENV, "")
        launcher, _, found = shared.partition(":")
        if rank_zero_only.rank != 0 and launcher == f"{os.getppid()}/{name}":
            del os.environ[_NAMED_CHECKPOINT_ENV]
            return found or None
        found = self._named_checkpoint(name)
        if rank_zero_only.rank == 0:
            os.environ[_NAMED_CHECKPOINT_ENV] = f"{os.getpid()}/{name}:{found or ''}"
        return found

    def _named_checkpoint(self, name: str) -> Optional[str]:
        """The checkpoint ``--ckpt_path last`` (or ``hpc``, ``best``) names for this command. Lightning looks for "last"
        in the run's own checkpoint folder, and the CLI gives a run a log version of its own (a resume logs to the
        next one): it found none there, warned, and a fresh run started from step 0 with a new study, the interrupted
        run's trials left RUNNING. "last" is here the newest checkpoint (a ``last*.ckpt`` on a tie; an
        adapter-parallel folder by its newest rank file) in the folders the run's checkpoint callbacks save in, every
        version of the logger's included (`_checkpoint_folders`); under `multilora schedule` (``MULTILORA_TASK_ID``
        set) only the checkpoints of the runs of the same task (tasks share a root, each in its own versions; a
        retry resumed another task's run). None found: a new run, with a warning naming where it looked, as Lightning
        does for "last" (a command that says it once serves the first run and the ones that resume it). "hpc" is
        Lightning's newest ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` (none: a usage error). "best" is the best
        checkpoint of an earlier fit in the same process, which a command has not (Lightning's error for it blamed
        the ModelCheckpoint): refused."""
        from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

        if name == "best":
            self.parser.error("`ckpt_path` 'best' names the best checkpoint of an earlier fit in the same process, "
                              "and a command has none: give a checkpoint's path, or 'last' (the newest checkpoint "
                              "an earlier run of this log directory left)")
        if name == "hpc":
            found = self.trainer._checkpoint_connector._hpc_resume_path
            if found is None:
                self.parser.error(f"`ckpt_path` 'hpc': no hpc_ckpt_<n>.ckpt (Lightning's checkpoint of a SLURM run "
                                  f"requeued) in {self.trainer.default_root_dir}: give a checkpoint's path, or 'last'")
            return str(found)
        callbacks = self.trainer.checkpoint_callbacks
        lasts = {getattr(cb, "CHECKPOINT_NAME_LAST", "last") for cb in callbacks if isinstance(cb, ModelCheckpoint)}
        pattern = re.compile(rf"(?:{'|'.join(map(re.escape, sorted(lasts or {'last'})))})(?:-v\d+)?")
        exceptions = {Path(cb.ckpt_path) for cb in callbacks if isinstance(cb, OnExceptionCheckpoint)}
        places = [getattr(cb, "dirpath", None) for cb in callbacks] + [self.trainer.default_root_dir] + [
            getattr(logger, "save_dir", None) for logger in self.trainer.loggers]
        if any("://" in str(place) for place in places if place):  # (remote: Lightning's own search, which looks
            return name  # there; a path made of a URL loses its "//")
        folders, looked = self._checkpoint_folders()
        found = [p for folder in folders for p in folder.glob("*.ckpt") if p.exists()]  # (a folder too: one of
        found += [p for p in exceptions if p.exists() and p not in found]  # an adapter-parallel run)
        task = os.environ.get(TASK_ID_ENV)
        runs = {p: _checkpoint_run_id(str(p)) for p in found}
        if task:  # (a schedule's task: its own runs' checkpoints alone)
            own = self._task_runs(task)
            found = [p for p in found if runs[p] in own]
        configs = self._run_configs()  # (another command's runs in the same root: not this command's "last")
        config = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)  # (as it is saved)
        mine = self._config_sections(config)
        others = [p for p in found if configs.get(runs[p]) and not any(_agree(mine, c) for c in configs[runs[p]])]
        found = [p for p in found if p not in others]
        if not found:
            whose = f" of task {task!r}'s runs" if task else ""
            why = (f"the checkpoints there are of runs of another config (`model`, `data` or a sweep's callback: "
                   f"{', '.join(sorted(map(str, others)))}; give one's path to resume it)" if others else
                   "no ModelCheckpoint saved one: it saves at each validation, `val_check_interval`")
            warnings.warn(f"`ckpt_path` 'last': no checkpoint{whose} in {', '.join(looked) or 'no folder'} ({why}): "
                          "a new run starts, as Lightning starts one for 'last'", stacklevel=2)
            return None
        # the newest (a `last` file, or a folder of rank files, by its newest file's time): on a tie, a `last` one
        return str(max(found, key=lambda p: (_written_at(p), bool(pattern.fullmatch(p.stem)) or p in exceptions)))

    def _checkpoint_folders(self) -> tuple[list[Path], list[str]]:
        """The folders where this run's checkpoint callbacks (and so the earlier runs of its command) save, and how an
        error names them: a callback's ``dirpath``, else the logger's version folders' ``checkpoints`` (every
        version, where the logger chooses its own: the run being resumed took an earlier one), else
        ``default_root_dir``'s, as Lightning's ModelCheckpoint places them."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer, folders, named = self.trainer, [], []
        default = not trainer.checkpoint_callbacks
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "dirpath", None):
                folders.append(Path(cb.dirpath))
                named.append(str(cb.dirpath))
            elif isinstance(cb, ModelCheckpoint):
                default = True
        if default and trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
            if getattr(self, "_own_version", False):
                folders += [p / "checkpoints" for p in sorted(root.glob("*")) if (p / "checkpoints").is_dir()]
                named.append(str(root / "*" / "checkpoints"))
            else:
                version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
                folders.append(root / version / "checkpoints")
                named.append(str(folders[-1]))
        elif default:
            folders.append(Path(trainer.default_root_dir) / "checkpoints")
            named.append(str(folders[-1]))
        return folders, named

    def _run_configs(self) -> dict[str, list[dict]]:
        """The `model` and `data` sections of the configs (``config.yaml``) that the runs under this command's root
        saved, by run id (a run resumed with another config has several)."""
        configs: dict[str, list[dict]] = {}
        for root in self._log_roots():
            run = _read_claim(root)
            try:
                text = (root / "config.yaml").read_text(encoding="utf-8") if run else None
            except OSError:
                continue
            if text is not None:
                configs.setdefault(run, []).append(self._config_sections(text))
        return configs

    @staticmethod
    def _config_sections(text: str) -> dict:
        """What of a saved config makes its run: the `model` and `data` sections and the callbacks that ask adapters
        (an `OptunaSweep`'s search space, study...); the trainer's other settings may change on a resume."""
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError:
            return {}
        if not isinstance(config, dict):
            return {}
        callbacks = (config.get("trainer") or {}).get("callbacks") if isinstance(config.get("trainer"), dict) else None
        askers = [{"class_path": cb.get("class_path"),
                   "init_args": {k: v for k, v in (cb.get("init_args") or {}).items() if k in _ADAPTER_ASKERS[name]}}
                  for cb in callbacks or [] if isinstance(cb, dict)
                  for name in [str(cb.get("class_path", "")).rsplit(".", 1)[-1]] if name in _ADAPTER_ASKERS]
        model = config.get("model")
        if isinstance(model, dict):  # (how the run goes, not what it trains: a resume may change them)
            inner = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
            inner = {k: v for k, v in inner.items() if k not in _RUNTIME_MODEL_FIELDS}
            model = {**model, "init_args": inner} if inner is not model and "init_args" in model else inner
        return {"model": model, "data": config.get("data"), "askers": askers}

    def _log_roots(self) -> list[Path]:
        """The folders where the runs under this command's root keep their claims and configs: the root itself, and
        each version folder of the logger's."""
        trainer, roots = self.trainer, [Path(self.trainer.default_root_dir)]
        if trainer.loggers:
            logger = trainer.loggers[0]
            roots += sorted((Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)).glob("*"))
        return roots

    def _task_runs(self, task: str) -> set[str]:
        """The ids of the runs of schedule task ``task`` that left a log directory under this command's root: their
        claims (`CLAIM`) name the task."""
        claims = [_read_claim_lines(root / CLAIM) for root in self._log_roots()]
        return {lines[0] for lines in claims if len(lines) > 1 and lines[0] and lines[1] == f"task={task}"}

    def _drawn_sources(self) -> set[str]:
        """The data sources the run's adapters may draw: the given adapters' and those a sweep may ask
        (``dataset_names``; a callback that adds adapters and does not say, every source)."""
        dm = self.datamodule
        wanted = [rec.spec.dataset for rec in self.model.registry]
        for callback in self.trainer.callbacks:
            if hasattr(callback, "has_pending_candidates"):
                asked = getattr(callback, "dataset_names", None)
                wanted += asked() if asked is not None else list(dm.sources)
        # (a name that is no source is the sweep's error, as the fit starts)
        return {dm.source_name(n) for n in wanted if n is None or n in dm.sources}

    def _claim_log_dir(self, ckpt_path: Optional[str]) -> Optional[Path]:
        """The run's log directory, taken for it: a file naming the run (`CLAIM`) made there at once, so that runs
        started together (a schedule's tasks sharing ``default_root_dir``) cannot take the same logger version, as
        they did when each listed the versions before any wrote one (the one that loses takes the next version, where
        the logger chose it; a version given, or no logger, is refused). A directory holding another run's files
        (`PREVIOUS_RUN_FILES`) is refused unless this run resumes that one: a checkpoint of another run is refused
        too. Process 0 alone takes it (the others of a multi-process run follow its directory). Returns the claim
        made (None: none)."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if rank_zero_only.rank != 0:
            return None
        logger = self.trainer.logger
        run_id = _checkpoint_run_id(ckpt_path) if ckpt_path is not None else self.model._run_id
        for _ in range(10_000):
            log_dir = self.trainer.log_dir  # (a logger's next version: new; without a logger, the root directory)
            if not log_dir:
                return None
            folder = Path(log_dir)
            previous = [n for n in PREVIOUS_RUN_FILES if (folder / n).exists()]
            claimed = _read_claim(folder)
            if ckpt_path is not None and claimed is not None and run_id is not None and claimed != run_id:
                self.parser.error(f"the log directory {log_dir} holds run {claimed}'s files, and `ckpt_path` "
                                  f"{ckpt_path!r} is a checkpoint of another run ({run_id}): resume a run into its "
                                  "own log directory, or give this one another (--trainer.default_root_dir)")
            if not previous or ckpt_path is not None:
                try:
                    self._claimed_new = not previous
                    folder.mkdir(parents=True, exist_ok=True)
                    with open(folder / CLAIM, "x" if ckpt_path is None else "w", encoding="utf-8") as fh:
                        task = os.environ.get(TASK_ID_ENV)  # (a schedule's task: its retries resume its own runs)
                        fh.write(f"{run_id or ''}\n" + (f"task={task}\n" if task else ""))
                    if [p.name for p in folder.iterdir()] == [CLAIM]:  # (a CSVLogger's "exists and is not empty",
                        # "previous log files will be deleted": of this claim alone, which it keeps)
                        warnings.filterwarnings("ignore", message=f"Experiment logs directory {re.escape(log_dir)} "
                                                                  "exists and is not empty")
                    return folder / CLAIM
                except FileExistsError:  # another run took it between the listing and now
                    pass
            if not (getattr(self, "_own_version", False) and isinstance(getattr(logger, "version", None), int)):
                break
            logger._version = logger.version + 1  # (the next version: another run has this one)
        self.parser.error(f"the log directory {log_dir} holds another run's "
                          f"{', '.join(previous) or CLAIM}: give this run its own (--trainer.default_root_dir, or a "
                          "logger that versions its runs), or resume that run with --ckpt_path")

    def _release_log_dir(self) -> None:
        """A fit refused (or stopped) before any adapter took a step leaves no claim, config, study or summary in its
        log directory (they would refuse the corrected command; a logger's version folder keeps its event file); a
        resume, before it took a step, leaves none in the folder it took new (a checkpoint file's, whose step it
        knows; resumed into the run's own folder, the run's files stay)."""
        claim = getattr(self, "_claimed", None)
        if claim is None:
            return
        if self.config_init[self.subcommand].get("ckpt_path") is None:
            if any(r.step for r in self.model.registry):
                return
        elif not self._claimed_new or getattr(self, "_resumed_at", None) is None \
                or self.trainer.global_step > self._resumed_at:
            return
        for name in ("config.yaml", "optuna.db", "sweep_summary.json", ".sweep_summary.json.multilora_branch", CLAIM):
            (claim.parent / name).unlink(missing_ok=True)

    def fit(self, model: MultiLoRAModule, **kwargs) -> None:
        """``Trainer.fit``; a `UsageError` it raises (a data file that does not read, a storage URL that does not
        open...) ends the command with its message, as a parse error does. Adapters trained before it are exported
        (`ExportOnException`). A SIGTERM ends it with status 143 (Lightning's exception for it is a
        ``SystemExit`` of status 0: a run stopped for pre-emption looked done to a scheduler)."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        try:
            self.trainer.fit(model, **kwargs)
        except RunEnded as err:  # (a schedule's task resumed after its run ended, before its process did: done)
            self._release_log_dir()
            task = os.environ.get(TASK_ID_ENV)
            last = getattr(self, "_ckpt_named", None) == "last"  # (one command for a run and its resumes: a
            if task is None and not last:  # requeue after the run ended is done, as a schedule's task's retry is)
                self.parser.error(str(err))
            who = f"task {task!r}" if task is not None else "`--ckpt_path last`"
            said = f"{str(err)[0].lower()}{str(err)[1:]}"
            if last:  # (adapters added to the command make another config, whose `last` finds no checkpoint)
                said += ("; `last` finds the runs of this command's config: to train new adapters on from this run, "
                         "give its checkpoint's path as `--ckpt_path`")
            if rank_zero_only.rank == 0:  # (said once, not by each process)
                print(f"{who}: its run had ended, {said}", file=sys.stderr)
        except UsageError as err:
            self._release_log_dir()
            self.parser.error(str(err))
        except SIGTERMException as err:
            raise SystemExit(128 + signal.SIGTERM) from err
        except BaseException:  # (a fit that ends before any step leaves nothing that would refuse the next command)
            self._release_log_dir()
            raise


def _run_checkpoint(path: str) -> tuple[dict, str]:
    """The checkpoint at ``path`` (its tensors mapped, not read, where its format allows), and why it is not a
    checkpoint of a multilora fit ("" where it is one): it does not load, is no Lightning checkpoint, or holds no
    module of this package."""
    import zipfile

    import torch

    try:  # (its tensors mapped, where the file is torch's zip format; an older format is read whole)
        checkpoint = torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path), weights_only=False)
    except Exception as err:  # noqa: BLE001 - whatever a file that is no checkpoint raises as it is read
        return {}, f"not a checkpoint ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
    if not isinstance(checkpoint, dict) or "pytorch-lightning_version" not in checkpoint:
        return {}, "not a Lightning checkpoint (a `Trainer`'s or `ModelCheckpoint`'s file)"
    if "multilora" not in checkpoint:
        return checkpoint, "a checkpoint of another LightningModule than a MultiLoRAModule (no 'multilora' entry)"
    return checkpoint, ""


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
CLAIM = ".multilora_log"  # the run that took the directory (its id), made as it starts (`MultiLoRACLI._claim_log_dir`)
PREVIOUS_RUN_FILES = ("config.yaml", "sweep_summary.json", "optuna.db", CLAIM)


TASK_ID_ENV = "MULTILORA_TASK_ID"  # set by `multilora schedule` for each task's command: the task's id
# "<pid>/<name>:<path>": the checkpoint process <pid> found for `--ckpt_path <name>`, for the processes it launches
_NAMED_CHECKPOINT_ENV = "MULTILORA_NAMED_CHECKPOINT"
# callbacks that ask the run's adapters, and the arguments that make their run theirs (not its budget: `n_trials`,
# `slots`, the heartbeat's, which a resume may change)
# The module's settings of how a run goes, not of what it trains: a resume may change them (more adapters at once on a
# larger GPU, another export folder) and still be the same run (`--ckpt_path last` finds its checkpoints)
_RUNTIME_MODEL_FIELDS = ("max_running", "admission", "export_dir", "validate_on_finish", "cuda_graphs",
                         "gradient_checkpointing")
_ADAPTER_ASKERS = {"OptunaSweep": ("search_space", "base", "sampler", "seed", "study_name", "storage",
                                   "alpha_over_rank", "pruner")}


def _agree(mine: Any, theirs: Any) -> bool:
    """Whether two saved configs' values agree: mappings key by key, where a key one of them lacks counts only if the
    other sets it to something (a field a later version of the package added saves its default, mostly null, false
    or empty: no difference; a search space's or `config_overrides`' entry is one), lists item by item, the rest
    equal."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        unset = (None, False, "", [], {})
        return all(_agree(mine[k], theirs[k]) if k in mine and k in theirs else
                   (mine.get(k) if k in mine else theirs.get(k)) in unset for k in mine.keys() | theirs.keys())
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(_agree(a, b) for a, b in zip(mine, theirs))
    return mine == theirs


def _read_claim(folder: Path) -> Optional[str]:
    """The id of the run that claimed ``folder`` (None: no claim, or one without an id)."""
    lines = _read_claim_lines(folder / CLAIM)
    return lines[0] if lines and lines[0] else None


def _read_claim_lines(path: Path) -> list[str]:
    """A claim's lines: the run's id, then ``task=<id>`` where a schedule's task made it."""
    try:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except OSError:
        return []


def _checkpoint_file(path: str) -> str:
    """The file that holds checkpoint ``path``'s run: an adapter-parallel checkpoint's (a folder) ``rank0.ckpt``."""
    return str(Path(path) / "rank0.ckpt") if Path(path).is_dir() else path


def _checkpoint_run_id(path: str) -> Optional[str]:
    """The id of the run that wrote checkpoint ``path`` (a file, or an adapter-parallel run's folder; None where it
    cannot be read here: "last", a URL). A folder's was None: a resume of it took a log directory as a run of its
    own, writing over another run's files there, and emptied the claim of its own run's."""
    path = _checkpoint_file(path)
    if not Path(path).is_file():
        return None
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # (as Lightning loads it)
    except Exception:  # (Lightning says what is wrong with it as it loads it)
        return None
    return (checkpoint.get("multilora") or {}).get("run_id") if isinstance(checkpoint, dict) else None

DESCRIPTION = """lightning-multilora: train many LoRA adapters at once on one frozen base model.
`multilora fit` takes every argument of MultiLoRAModule (--model.*), MultiLoRADataModule (--data.*)
and the Trainer (--trainer.*), on the command line or in a --config file."""  # (kept as written, as the epilog)
COMMANDS = """commands beside fit:
  demo [--trainer.max_steps 50]  the packaged default sweep (configs/demo.yaml): fit with its config
  schedule TASKS.yaml            plan tasks on the GPUs (CP-SAT), print a table and a Gantt chart, run them
                                 (`multilora schedule --help`)"""


# (the list arguments a later one replaces, and whether only a list does: a logger given alone is one, merged)
_REPLACED = {"--model.adapters": False, "--trainer.callbacks": True, "--trainer.logger": True}


def _adapters_replaced(args: list[str]) -> list[str]:
    """``args`` where a `model.adapters` list given (``--model.adapters``, or a later ``--config`` / ``-c`` holding one)
    replaces the one given before it: jsonargparse merges a list of the same length item by item into the earlier
    one, so that each adapter took the fields its predecessor at that place had and it did not say (another name's
    `lr`, `dataset`, `max_epochs`...). A ``null`` is put before it; ``--model.adapters+=`` still appends. Likewise a
    `trainer.callbacks` or `trainer.logger` list (the demo's OptunaSweep lent its grid sampler and base to a
    config's)."""
    import yaml

    def listed(value: Any) -> bool:
        try:
            return isinstance(yaml.safe_load(value) if isinstance(value, str) else value, list)
        except yaml.YAMLError:
            return False

    out: list[str] = []
    start = args.index("fit") if "fit" in args else 0  # (the top-level parser's, before it: as given, a null there
    for i, arg in enumerate(args):  # was taken for the subcommand, "invalid choice: 'null'")
        if i < start:
            out.append(arg)
            continue
        flag, _, inline = arg.partition("=")
        value = inline if inline else args[i + 1] if i + 1 < len(args) else None
        if flag in _REPLACED and value not in (None, "null", "None") and (not _REPLACED[flag] or listed(value)):
            out += [flag, "null"]
        elif flag in ("--config", "-c") and value is not None:
            try:  # (a file, or the config itself inline: a long one is no file name the system takes)
                is_file = Path(value).is_file()
            except (OSError, ValueError):
                is_file = False
            try:
                config = yaml.safe_load(Path(value).read_text(encoding="utf-8") if is_file else value)
            except (OSError, ValueError, yaml.YAMLError):  # (jsonargparse says what is wrong with it)
                config = None
            for key, only_lists in _REPLACED.items():
                section, _, field = key[2:].partition(".")
                given = config.get(section) if isinstance(config, dict) else None
                given = given.get(field) if isinstance(given, dict) else None
                if given is not None and (not only_lists or isinstance(given, list)):
                    out += [key, "null"]
        out.append(arg)
    return out


_given: list[str] = []  # the arguments `main` parses (for its parser's errors)


def _shows_docs(args: list[str]) -> bool:
    """Whether the command shows the fields' descriptions: a help (``-h``, ``--help``, ``--<field>.help``) or a
    config printed with them (``--print_config=comments``, or ``--print_config comments,skip_null``...)."""
    for arg, after in zip(args, [*args[1:], ""]):
        option, _, value = arg.partition("=")
        if arg in ("-h", "--help") or option.endswith(".help"):
            return True
        if option == "--print_config" and "comments" in (value if "=" in arg else after):
            return True
    return False


def main(args: Optional[list[str]] = None) -> None:
    from_command_line = args is None
    args = list(sys.argv[1:] if args is None else args)
    if args[:1] == ["schedule"]:
        from lightning_multilora.scheduling.task_file import main as schedule

        sys.exit(schedule(args[1:]))
    if args[:1] == ["demo"]:
        if {"-h", "--help"} & set(args[1:]):
            import yaml

            config = yaml.safe_load(Path(demo_config()).read_text())
            own = ", ".join(f"--{section}.{key} {value}" for section in ("model", "trainer")
                            for key, value in (config.get(section) or {}).items()
                            if not isinstance(value, (dict, list)))
            print(f"multilora demo is `multilora fit --config {demo_config()}`; any of the options below overrides "
                  f"its settings. The defaults shown below are `fit`'s, which its config replaces ({own}, and its "
                  "callbacks and data): `multilora demo --print_config` shows every value it runs with.\n")
        args = ["fit", "--config", demo_config(), *args[1:]]
    given, args = args, _adapters_replaced(args)  # (`_given`: as given, without the nulls put before lists)
    # (the help of AdapterSpec's and SweepGrid's fields, `--model.adapters.help`: their attribute docstrings; read
    # for a help or a printed config alone: finding them parses the source of every class the parser takes, the
    # Trainer's too, 2 of the 2.7 s a parser takes to build)
    try:
        set_parsing_settings(docstring_parse_attribute_docstrings=_shows_docs(args))
    except (TypeError, ValueError, ImportError):  # (a jsonargparse without it, or no docstring_parser: types alone)
        pass
    if from_command_line:  # (LightningCLI warns when given both ``args`` and a command line)
        sys.argv[1:] = args
    _given[:] = given
    # (no --optimizer / --lr_scheduler: LightningCLI's would replace the module's per-adapter optimizer groups and
    # schedules, `--model.optimizer`, `--model.optimizer_kwargs` and each adapter's `lr` / `lr_schedule`, silently)
    MultiLoRACLI(MultiLoRAModule, MultiLoRADataModule, subclass_mode_model=False, subclass_mode_data=False,
                 auto_configure_optimizers=False, parser_class=_Parser,
                 save_config_kwargs={"overwrite": True}, args=None if from_command_line else args,
                 parser_kwargs={"description": DESCRIPTION, "epilog": COMMANDS, "formatter_class": RawEpilogFormatter})


if __name__ == "__main__":
    main()
