"""`Task`: a training task to place on GPUs (an estimate of its duration, its GPU count, the command that runs it).

Checked when made, from a task file or from Python: an id that names log files, a command that reaches the process as
given, a `torchrun` command that torchrun can run.
"""

from __future__ import annotations

import math
import numbers
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

from lightning_multilora.arguments import check_int


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def yaml_number_hint(value: Any) -> str:
    """Why a number may have arrived as text: YAML 1.1 (PyYAML) reads ``1e-3`` and ``1.5e3`` as strings, ``1.0e-3``
    and ``1.5e+3`` as floats; a quoted number is a string."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    if "e" not in value.lower():
        return " (text: write the number without quotes)"
    mantissa, _, exponent = repr(number).partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    written = f"{mantissa}e{int(exponent):+03d}" if exponent else mantissa
    return (f" (text: YAML reads an exponent as a number only with a dot and a signed exponent; write "
            f"{written})")


MAX_ID_CHARS = 200  # a task's log file is ``<id>.<attempt>.log``: a file name has at most 255 bytes

# how a `torchrun` task's command may start: torchrun runs its first argument with Python, unless told otherwise
TORCHRUN_STARTS = "a Python script (`train.py ...`), `-m module ...` or `--no-python program ...`"


@dataclass(frozen=True)
class Task:
    """A training task: ``duration`` (seconds, > 0, an estimate) on ``gpus`` GPUs (>= 1).

    ``command`` (argv, or a string split like a shell would) is what a `LocalExecutor` runs; ``torchrun``
    launches it as ``torchrun --nproc-per-node <gpus> ...``: the command is then a Python script and its arguments
    (``train.py --lr 1e-3``), ``-m module ...`` or ``--no-python program ...`` (checked here: torchrun would run
    ``python multilora`` and fail in the task's log alone). ``multilora fit`` needs no torchrun: Lightning starts a
    process per GPU itself.
    """

    id: str
    duration: float
    gpus: int = 1
    command: Optional[tuple[str, ...]] = None
    torchrun: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise ValueError(f"task `id` must be letters, digits, '.', '_' and '-', starting with a letter or digit "
                             f"(it names the task's log files), got {self.id!r}")
        if len(self.id) > MAX_ID_CHARS:
            raise ValueError(f"task `id` must be at most {MAX_ID_CHARS} characters (it names the task's log files, "
                             f"<id>.<attempt>.log), got {len(self.id)}: {self.id[:40]!r}...")
        if self.command is not None:
            object.__setattr__(self, "command", command_args(self.id, self.command))
        if not (isinstance(self.duration, numbers.Real) and not isinstance(self.duration, bool)
                and math.isfinite(self.duration) and self.duration > 0):
            raise ValueError(f"task {self.id!r}: `duration` must be a finite number > 0, got {self.duration!r}"
                             f"{yaml_number_hint(self.duration)}")
        object.__setattr__(self, "duration", float(self.duration))
        check_int(f"task {self.id!r}", "gpus", self.gpus, 1)
        object.__setattr__(self, "gpus", int(self.gpus))  # (numpy's integers too)
        if not isinstance(self.torchrun, bool):
            raise ValueError(f"task {self.id!r}: `torchrun` must be true or false, got {self.torchrun!r}")
        why = _torchrun_refusal(self.command) if self.torchrun and self.command is not None else None
        if why is not None:
            raise ValueError(f"task {self.id!r}: a `torchrun` task's `command` must start with {TORCHRUN_STARTS}, got "
                             f"{self.command[0]!r} (torchrun runs `python {self.command[0]}`); {why}")


def command_args(task_id: str, command: Any) -> tuple[str, ...]:
    """A task's argv: a string split into words as a shell would (then run without a shell: its pipes,
    redirections, ``&&``, ``$VAR``, ``*``, a second line and ``NAME=value`` are refused, naming ``[sh, -c, ...]``), or
    a list of arguments.
    Python's ints and floats become their text (as they always have); anything else in the list (a bool, None, a
    nested list) is refused, naming it: its text would be a guess (a task file's scalars arrive as written,
    `read_yaml`)."""
    if isinstance(command, str):
        import shlex

        # (a shell drops a backslash-newline, and a YAML block's last line break: `command: >` folds a long one)
        command = command.replace("\\\n", " ").strip()
        shell = _shell_syntax(command)
        if shell is not None:  # (run as words, `a && b > out` ran `a` with the arguments '&&', 'b', '>', 'out')
            raise ValueError(f"task {task_id!r}: `command` {command!r} uses shell syntax ({shell!r}), but a command "
                             "string is split into words and run without a shell; to run it in one, write the "
                             f"command as a list: [sh, -c, {command!r}] (or quote the character for it to reach "
                             "the program as it is)")
        try:
            args = tuple(shlex.split(command))
        except ValueError as err:  # (shlex's "No closing quotation")
            raise ValueError(f"task {task_id!r}: `command` {command!r} does not split into words: {err}") from None
    elif isinstance(command, (list, tuple)):
        for i, arg in enumerate(command):
            if isinstance(arg, bool) or not isinstance(arg, (str, numbers.Real)):
                said = f"write it as text ({str(arg).lower()!r})" if isinstance(arg, bool) else "one string each"
                raise ValueError(f"task {task_id!r}: `command` item #{i} must be a string (or a number), got "
                                 f"{arg!r} ({type(arg).__name__}): {said}")
        args = tuple(str(arg) for arg in command)
    else:
        raise ValueError(f"task {task_id!r}: `command` must be a string or a list of arguments, got {command!r}")
    if not args:
        raise ValueError(f"task {task_id!r}: `command` must not be empty")
    if not args[0].strip():  # (it failed as the task started: no program of that name)
        raise ValueError(f"task {task_id!r}: `command` must start with a program to run, got {args[0]!r} first")
    return args


def _shell_syntax(command: str) -> Optional[str]:
    """What a shell would read in ``command`` as syntax rather than as a word's letters, or None: outside quotes an
    operator or redirection (``| & ; < > ( )``), a ``*`` glob, a ``#`` comment or ``~`` starting a word, a line
    break (a second command), a leading ``NAME=value`` (an environment variable); a ``$`` expansion (``$x``,
    ``${x}``, ``$(...)``, ``$1``...) or a backquote outside single quotes. A ``$`` a shell passes on as it is
    (``"^.*_proj$"``) is not; nor are ``?``, ``[...]`` and ``{a,b}`` (a shell passes the first two on as they are
    where they match no file, and expands a brace list): they reach the program as written."""
    quote, escaped, word_start, first_word = None, False, True, True
    for i, char in enumerate(command):
        if escaped:
            escaped, word_start = False, False
            continue
        if char == "\\" and quote != "'":
            escaped = True
            continue
        if quote == "'":
            quote = None if char == "'" else quote
            continue
        if char == "`" or (char == "$" and i + 1 < len(command) and (command[i + 1].isalnum() or command[i + 1] in
                                                                     "_{(@*#?$!-")):
            return char
        if quote == '"':
            quote = None if char == '"' else quote
            continue
        if char in "'\"":
            quote, word_start = char, False
        elif char in "|&;<>()*\n" or (char in "~#" and word_start):
            return "line break" if char == "\n" else char
        elif char == "=" and first_word and command[:i].strip().isidentifier():
            return f"{command[:i].strip()}=..."
        else:
            if char.isspace() and not word_start:
                first_word = False
            word_start = char.isspace()
    return None


def _torchrun_refusal(command: tuple[str, ...]) -> Optional[str]:
    """Why torchrun cannot run this command, or None: it runs the first word with Python as a script, so this
    package's console command, a Python interpreter, torchrun itself or a shell fail there, in the task's log alone
    (a script, ``-m module``, ``--no-python program`` and torchrun's own options before them, ``--max-restarts 3
    train.py``, are taken as they are)."""
    name = Path(command[0]).name
    if name == "multilora":
        return ("`multilora fit` runs without torchrun (Lightning starts a process per GPU), or as "
                "`-m lightning_multilora.cli fit ...`")
    if re.fullmatch(r"python[0-9.]*w?", name):
        return f"leave `{command[0]}` out: torchrun runs the script with Python itself"
    if name == "torchrun":
        return "leave `torchrun` out: `torchrun: true` adds it, with `--nproc-per-node` the task's `gpus`"
    if name in ("sh", "bash", "zsh", "dash", "env"):
        return f"run a program that is no Python script with `--no-python`: [--no-python, {command[0]}, ...]"
    return None
