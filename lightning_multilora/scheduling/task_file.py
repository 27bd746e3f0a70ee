"""`multilora schedule tasks.yaml`: plan a task file on the GPUs (table + Gantt chart), then run it.

A task file::

    gpus: 8                 # GPUs of this machine
    time_limit_s: 5         # CP-SAT limit per plan (default 2; a replan while running: 1 s at most)
    resolution_s: 1         # plan grid in seconds (default 1)
    deterministic: false    # true: the same plan every time (one CP-SAT worker, up to 10x time_limit_s)
    max_retries: 2          # attempts after a failure (default 2)
    log_dir: runs/schedule  # task logs, records and Gantt charts (default runs/schedule)
    tasks:
      - {id: llama70b-sweep, duration: 3600, gpus: 4, command: "multilora fit --config a.yaml"}
      - {id: qwen7b-sweep, duration: 900, gpus: 1, command: [multilora, fit, --config, b.yaml, --data.split_seed, 007]}
      - {id: own-ddp, duration: 600, gpus: 2, command: [train.py, --lr, 1.0e-3], torchrun: true}

A task ``id`` is at most 200 letters, digits, ``.``, ``_`` and ``-`` (it names the task's logs,
``<log_dir>/logs/<id>.<n>.log``; a rerun over the same ``log_dir`` numbers its logs on and keeps the earlier ones; its
Gantt charts likewise: ``plan.png`` and ``run.png``, then ``plan.1.png`` and ``run.1.png``...). A ``command`` list's
items reach the process as written (``007``, ``1.10``, ``false``: not YAML's 7, 1.1 and False). ``torchrun: true``
runs the command as ``torchrun --nproc-per-node <gpus> <command>``: it then starts with a Python script, ``-m module``
or ``--no-python program`` (refused otherwise: torchrun would run ``python multilora``); ``multilora fit`` needs no
torchrun (Lightning starts a process per GPU), or runs as ``-m lightning_multilora.cli fit ...``.
``--plan-only`` prints the plan and stops; ``--simulate`` runs it on a virtual clock; ``--ray ADDRESS``
hands each task to a Ray cluster (``auto``: the local one; placement groups with GPU bundles); otherwise
each task runs as a subprocess on its GPUs (GPU ``i`` is the ``i``-th of ``CUDA_VISIBLE_DEVICES`` where that is
set; ``gpus`` above what it, or the machine, has is refused, before any chart is drawn). ``--inbox DIR``: task files
(``*.yaml`` or ``*.yml``, a ``tasks:`` list) dropped into ``DIR`` while the schedule runs are submitted and replanned
(then renamed ``<name>.done``; other files are said once and left alone); write a file elsewhere and move it in, or
it is read once it has not changed for a second (`INBOX_SETTLE_S`).

A run keeps its task records in ``<log_dir>/records.json`` (each task's state, attempts, starts and end, exit status and
log; `lightning_multilora.scheduling.records`), rewritten after every completion and when it stops: on Ctrl-C, SIGTERM
or SIGHUP the running tasks are stopped and recorded ``stopped``, and ``run.png`` is drawn as at an end (a hangup
ignored as the schedule starts, ``nohup``'s, stays ignored; the tasks stopped get SIGTERM, and ``SIGKILL`` 30 s later
where they still run; a task that had ended is recorded as it ended). ``--resume`` runs the file again over the same
``log_dir`` without the tasks those records say finished (said, and their records kept); a task recorded finished as
another task (another ``command``, ``gpus`` or ``torchrun``: another task file's records over the same ``log_dir``, or
the task edited since) runs, warned of; a task recorded failed or stopped runs again, its attempts numbered on, and so
does one an inbox added (the records hold each task's definition; a task since removed from the file is not run
again). A schedule that runs tasks holds ``<log_dir>/.schedule.lock`` while it runs (its PID in it; a ``kill -9``
leaves no stale lock): a second one over the same ``log_dir``, or a ``--resume`` of one still running, is refused,
naming the running one's PID (``--plan-only`` and ``--simulate`` write no records, and take no lock). A task's
command gets ``MULTILORA_TASK_ID`` and ``MULTILORA_TASK_ATTEMPT`` (1 on its first attempt); a failed attempt's record
says its exit status and the last line of its log. A run without ``--resume`` runs every task and starts the records
afresh, the earlier ones moved to ``records.<n>.json``; a ``--simulate`` one writes none (a resume after it would skip
what never ran). On Linux a task's process also gets SIGTERM when the schedule's process dies otherwise
(``kill -9``); its own children do not (``exec`` the last command of a ``[sh, -c, ...]`` task, or stop them on
SIGTERM). A ``command`` string is split into words and run without a shell: shell syntax in it (``&&``, ``|``, ``>``,
``$VAR``, ``*``, a second line, a leading ``NAME=value``) is refused, and ``[sh, -c, "..."]`` runs a shell.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_multilora.scheduling.executors import LocalExecutor, SimulatedExecutor, visible_gpus
from lightning_multilora.scheduling.records import (LOCK_FILE, LogDirLocked, changed_warning, definition_changes,
                                                    ids_text, lock_log_dir, read_records, records_path,
                                                    unlock_log_dir)
from lightning_multilora.scheduling.runner import POLL_S, RunRecord, ScheduleRunner
from lightning_multilora.scheduling.task_scheduler import (Schedule, Task, TaskScheduler, validate_tasks,
                                                           yaml_number_hint)

TASK_FIELDS = ("id", "duration", "gpus", "command", "torchrun")
INBOX_SUFFIXES = (".yaml", ".yml")  # an inbox's task files (any case); ``.done`` and ``.rejected`` ones stay put
INBOX_SETTLE_S = 1.0  # an inbox file is read once unchanged for this long (one being written: half of it)
FILE_FIELDS = ("gpus", "time_limit_s", "resolution_s", "deterministic", "max_retries", "log_dir", "tasks")
# the most GPUs a Gantt chart has rows for (a row each: 100000 took minutes, a figure 45000 inches tall)
MAX_CHART_GPUS = 256


def parse_tasks(entries: Any, where: str) -> list[Task]:
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: `tasks` must be a non-empty list of tasks")
    tasks = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: task #{i} must be a mapping with {', '.join(TASK_FIELDS)}")
        unknown = set(entry) - set(TASK_FIELDS)
        if unknown:
            raise ValueError(f"{where}: task #{i} has unknown fields {sorted(unknown)}; allowed: "
                             f"{', '.join(TASK_FIELDS)}")
        if "id" not in entry or "duration" not in entry:
            raise ValueError(f"{where}: task #{i} needs `id` and `duration` (seconds)")
        task_id = entry["id"]
        if isinstance(task_id, (int, float)) and not isinstance(task_id, bool):
            task_id = str(task_id)  # (YAML reads `id: 7` as a number)
        try:
            tasks.append(Task(task_id, entry["duration"], entry.get("gpus", 1), entry.get("command"),
                              entry.get("torchrun", False)))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    return tasks


_SECONDS = ("duration", "time_limit_s", "resolution_s")  # (fields of seconds: base-60 numbers refused)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it kept the last one, silently; a key merged
    in with ``<<:`` may be given again, as YAML allows); an ``id`` written as a plain scalar keeps its text (``007``,
    ``1.10``, ``12:30``, ``off``, ``2024-01-01``: YAML's numbers 7, 1.1 and 750, False and a date), and so does every
    scalar of a ``command`` list: ``[train.py, --lr, 1.10, --steps, 1_000, --flag, false]`` reaches the process as
    written (YAML's 1.1, 1000 and False turned back into text were other arguments, or refused). A ``duration``
    written ``1:30`` (YAML's base-60 number 90) is refused, as are ``time_limit_s`` and ``resolution_s``: seconds."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        "found unhashable key", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"`{key}` is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        mapping = super().construct_mapping(node, deep=deep)  # (merges first: the pairs given last win)
        given = [v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "id"]
        value = mapping.get("id")
        if (given and isinstance(given[-1], yaml.ScalarNode) and given[-1].style is None
                and not isinstance(value, str) and value is not None):
            mapping["id"] = given[-1].value  # (a number, boolean or date as written: its text names the task's logs)
        for key, value in node.value:  # (YAML's base 60: 1:30 is 90, a plan of seconds for an hour and a half)
            if (isinstance(key, yaml.ScalarNode) and key.value in _SECONDS and isinstance(value, yaml.ScalarNode)
                    and value.style is None and ":" in value.value
                    and isinstance(mapping.get(key.value), (int, float))):
                raise yaml.constructor.ConstructorError(
                    None, None, f"`{key.value}: {value.value}` is YAML's base-60 number {mapping[key.value]:g}, not "
                    "hours and minutes: give it in seconds", value.start_mark)
        commands = [v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "command"]
        if commands and isinstance(commands[-1], yaml.SequenceNode):  # (a nested list or mapping: Task names it)
            mapping["command"] = [item.value if isinstance(item, yaml.ScalarNode)
                                  else self.construct_object(item, deep=True) for item in commands[-1].value]
        return mapping


def read_yaml(stream: Any) -> Any:
    """A task file's YAML (a string or a stream), each mapping's keys given once."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def load_task_file(path: str | Path) -> tuple[dict[str, Any], list[Task]]:
    """The file's settings and its tasks, validated (ids unique, no task wider than the machine)."""
    try:
        with open(path, encoding="utf-8") as fh:  # (a stream: the parser's message then names the file)
            data = read_yaml(fh)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: a task file is UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:  # (it said "[Errno 2] No such file or directory: 'x.yaml'", not what the file was)
        raise ValueError(f"task file {str(path)!r}: {err.strerror or err}"
                         + (" (give the YAML file of the tasks)" if Path(path).is_dir() else "")) from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a task file is a mapping with {', '.join(FILE_FIELDS)}")
    unknown = set(data) - set(FILE_FIELDS)
    if unknown:
        raise ValueError(f"{path}: unknown fields {sorted(unknown)}; allowed: {', '.join(FILE_FIELDS)}")
    if "gpus" not in data:
        raise ValueError(f"{path}: `gpus` is required: the GPUs the tasks are planned on, an integer >= 1")
    gpus = data.get("gpus")
    if not (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1):
        raise ValueError(f"{path}: `gpus` must be an integer >= 1, got {gpus!r}")
    settings = dict(gpus=gpus, time_limit_s=_setting(data, "time_limit_s", 2.0, path),
                    resolution_s=_setting(data, "resolution_s", 1.0, path), max_retries=data.get("max_retries", 2),
                    log_dir=data.get("log_dir", "runs/schedule"), deterministic=data.get("deterministic", False))
    if not isinstance(settings["deterministic"], bool):
        raise ValueError(f"{path}: `deterministic` must be true or false, got {settings['deterministic']!r}")
    if not (isinstance(settings["max_retries"], int) and not isinstance(settings["max_retries"], bool)
            and settings["max_retries"] >= 0):
        raise ValueError(f"{path}: `max_retries` must be an integer >= 0, got {settings['max_retries']!r}")
    if not (isinstance(settings["log_dir"], str) and settings["log_dir"]):
        raise ValueError(f"{path}: `log_dir` must be a directory path, got {settings['log_dir']!r}")
    settings["log_dir"] = os.path.expanduser(settings["log_dir"])  # (`~/runs` made a folder named "~" here)
    tasks = parse_tasks(data.get("tasks"), str(path))
    try:
        validate_tasks(tasks, gpus)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    return settings, tasks


def _setting(data: Mapping[str, Any], name: str, default: float, path: Any) -> float:
    value = data.get(name, default)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
        raise ValueError(f"{path}: `{name}` must be a number of seconds > 0, got {value!r}{yaml_number_hint(value)}")
    return float(value)


def chart_paths(log_dir: Path) -> tuple[Path, Path]:
    """This schedule's plan and run charts in ``log_dir``: ``plan.png`` / ``run.png``, or the first ``plan.<n>.png`` /
    ``run.<n>.png`` that neither an earlier schedule's plan nor its run took (theirs are kept)."""
    n = 0
    while True:
        suffix = f".{n}" if n else ""
        paths = log_dir / f"plan{suffix}.png", log_dir / f"run{suffix}.png"
        if not any(p.exists() for p in paths):
            return paths
        n += 1


def gantt(placements: Mapping[str, Any], num_gpus: int, path: str | Path, title: str = "") -> Path:
    """A Gantt chart (one row per GPU, `MAX_CHART_GPUS` at most) of placements or run records (``start``, ``end``,
    ``gpu_ids``)."""
    if num_gpus > MAX_CHART_GPUS:
        raise ValueError(f"a Gantt chart has a row per GPU, {MAX_CHART_GPUS} at most; {num_gpus} GPUs were given "
                         "(the plan's table says it all)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * num_gpus))
    colors = plt.get_cmap("tab20")
    for k, (task_id, p) in enumerate(sorted(placements.items(), key=lambda kv: kv[1].start)):
        for gpu in p.gpu_ids:
            ax.barh(gpu, p.end - p.start, left=p.start, color=colors(k % 20), edgecolor="black", linewidth=0.5)
            ax.text(p.start + (p.end - p.start) / 2, gpu, task_id, ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks(range(num_gpus), [f"GPU {i}" for i in range(num_gpus)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    if path.is_dir():
        plt.close(fig)
        raise ValueError(f"{path} is a folder: give the chart's file (e.g. {path / 'plan.png'})")
    if not path.suffix:  # (matplotlib writes its default format's suffix onto a name without one)
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def inbox_poller(inbox: Path, num_gpus: int, known: Optional[Any] = None, need_command: bool = False,
                 node_gpus: Optional[int] = None, settle_s: float = 0.0):
    """Tasks from task files dropped into ``inbox`` (each read once, then renamed ``.done``); a bad file is
    renamed ``.rejected`` and reported, and the schedule goes on. ``known()`` gives the task ids already in
    the schedule (a new task may not reuse one); ``node_gpus``, the most GPUs one task may take (a Ray cluster's
    largest node). Write files elsewhere and move them in (a rename is atomic); a file changed in the last
    ``settle_s`` seconds is left for a later poll (one written in two pieces was read half-written and rejected for
    good, or, cut between two tasks, ran the first alone). A file of another name is said once (a ``.yml`` was
    ignored, silently) and left alone; hidden ones (an editor's) are not said."""
    inbox.mkdir(parents=True, exist_ok=True)
    said: set[str] = set()
    unsettled: set[str] = set()  # (files left for a later poll: the schedule waits for them, `ScheduleRunner`)
    # each file's size and change time as first seen, and when (this clock: a file's own time may be another
    # machine's, ahead, copied with its times kept)
    first_seen: dict[str, tuple[tuple[int, int], float]] = {}

    def poll() -> list[Task]:
        tasks: list[Task] = []
        unsettled.clear()
        try:
            entries = sorted(inbox.iterdir())
        except OSError as err:  # (moved or removed mid-run: the runner and its running tasks go on)
            if "\0gone" not in said:  # (said once while it is away)
                said.add("\0gone")
                print(f"inbox {inbox} cannot be read ({err}); new tasks wait for it", flush=True)
            return []
        said.discard("\0gone")
        for path in entries:
            if path.suffix.lower() not in INBOX_SUFFIXES:
                if not (path.name.endswith((".done", ".rejected")) or path.name.startswith(".") or path.name in said):
                    said.add(path.name)
                    print(f"skipped {path}: an inbox's task files end in {' or '.join(INBOX_SUFFIXES)}", flush=True)
                continue
            try:
                if settle_s:
                    stat = path.stat()
                    now, signature = time.monotonic(), (stat.st_size, stat.st_mtime_ns)
                    seen = first_seen.get(path.name)
                    if seen is None or seen[0] != signature:
                        first_seen[path.name] = seen = (signature, now)
                    if now - seen[1] < settle_s:
                        unsettled.add(path.name)
                        continue  # (being written, perhaps: read at a later poll)
            except OSError:  # (moved away meanwhile)
                continue
            try:
                data = read_yaml(path.read_text(encoding="utf-8")) or {}
                unknown = sorted(set(data) - {"tasks"}) if isinstance(data, Mapping) else []
                if unknown:  # (the machine's settings are the running schedule's)
                    raise ValueError(f"an inbox file holds a `tasks:` list alone; unknown fields {unknown}")
                new = parse_tasks(data.get("tasks") if isinstance(data, Mapping) else None, str(path))
                validate_tasks([*tasks, *new], num_gpus)
                taken = sorted({t.id for t in new} & set(known() if known is not None else ()))
                if taken:
                    raise ValueError(f"task ids {taken} are already in the schedule")
                if need_command and any(t.command is None for t in new):
                    raise ValueError(f"every task needs a `command` to run; tasks "
                                     f"{[t.id for t in new if t.command is None]} have none")
                wide = [t.id for t in new if node_gpus is not None and t.gpus > node_gpus]
                if wide:
                    raise ValueError(f"tasks {wide} take more GPUs than the largest node has ({node_gpus})")
            except Exception as err:  # (whatever is wrong with a dropped file, the running tasks go on)
                _rename(path, ".rejected")
                print(f"rejected {path}: {err}", flush=True)
                continue
            if _rename(path, ".done"):  # (renamed first: a file that stays would be read again)
                tasks += new
        return tasks

    poll.waiting = lambda: bool(unsettled)  # type: ignore[attr-defined]
    return poll


def _rename(path: Path, suffix: str) -> bool:
    try:
        path.rename(path.with_name(path.name + suffix))
        return True
    except OSError as err:  # (moved away or unwritable meanwhile: said, and the schedule goes on)
        print(f"could not rename {path} to *{suffix}: {err}", flush=True)
        return False


def records_table(records: Mapping[str, RunRecord]) -> str:
    """The records as a table: ``start`` is the last attempt's; a task tried more than once says every start."""
    lines = [f"{'task':<16} {'state':<9} {'tries':>5} {'start':>9} {'end':>9}  gpus"]
    for r in sorted(records.values(), key=lambda r: (r.start, r.task_id)):
        starts = getattr(r, "starts", ())
        said = [f"attempts started at {', '.join(f'{t:.1f}' for t in starts)}"] if len(starts) > 1 else []
        said += [r.detail] if r.detail else []
        lines.append(f"{r.task_id:<16} {r.state:<9} {r.attempts:>5} {r.start:>9.1f} {r.end:>9.1f}  "
                     f"{','.join(map(str, r.gpu_ids))}{'  ' + '; '.join(said) if said else ''}")
    return "\n".join(lines)


def _gpus_here(visible: Optional[list[str]]) -> Optional[tuple[int, str]]:
    """How many GPUs a local executor can hand out, and what says so: ``visible`` (its ``CUDA_VISIBLE_DEVICES``,
    `visible_gpus`), else the machine's GPUs; None on a machine without, or with ``CUDA_VISIBLE_DEVICES`` empty (the
    tasks' GPU ids are then slots only, and the tasks get no GPU)."""
    if visible == []:  # every GPU hidden on purpose: tasks that use none
        return None
    if visible is not None:
        return len(visible), f"CUDA_VISIBLE_DEVICES={','.join(visible)}"
    import torch

    count = torch.cuda.device_count()
    return (count, "this machine") if count else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="multilora schedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task_file", type=Path)
    parser.add_argument("--plan-only", action="store_true", help="print the plan and the Gantt chart, run nothing")
    parser.add_argument("--simulate", action="store_true", help="run on a virtual clock (durations as given)")
    parser.add_argument("--ray", default=None, metavar="ADDRESS", help="run the tasks on this Ray cluster ('auto')")
    parser.add_argument("--inbox", type=Path, default=None,
                        help="folder watched for new task files while running (write one elsewhere and move it in, "
                             f"or it is read once unchanged for {INBOX_SETTLE_S:g} s)")
    parser.add_argument("--gantt", type=Path, default=None,
                        help="Gantt chart image of the plan (default <log_dir>/plan.png, numbered on where taken)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the tasks <log_dir>/records.json records as finished (an earlier run of this file); "
                             "those recorded failed or stopped run again")
    args = parser.parse_args(argv)
    if args.simulate and args.ray is not None:
        parser.error("--simulate runs the tasks on a virtual clock, --ray on a cluster: give one of them")
    if args.plan_only and (args.simulate or args.ray is not None or args.inbox is not None):
        parser.error("--plan-only runs nothing: leave out --simulate, --ray and --inbox")
    if args.inbox is not None and args.inbox.resolve() in (args.task_file.resolve().parent,
                                                           args.task_file.absolute().parent.resolve()):
        parser.error(f"--inbox {args.inbox}: the folder holds the task file {args.task_file} (every *.yaml or *.yml "
                     "in an inbox is taken as a new task file and renamed): give the inbox a folder of its own")
    if args.inbox is not None and args.inbox.exists() and not args.inbox.is_dir():
        parser.error(f"--inbox {args.inbox}: not a folder (a file of that name exists): give a folder, made if absent")
    try:
        settings, tasks = load_task_file(args.task_file)
    except (OSError, ValueError, yaml.YAMLError) as err:
        parser.error(str(err))
    if not (args.plan_only or args.simulate) and any(t.command is None for t in tasks):
        parser.error(f"{args.task_file}: every task needs a `command` to run (or use --simulate / --plan-only); tasks "
                     f"{[t.id for t in tasks if t.command is None]} have none")
    # a schedule that runs tasks holds its log_dir, from before it reads or moves the records to its end (the kernel
    # lets it go when the process ends, however): two over one log_dir, or a --resume of one still running, ran the
    # tasks twice and wrote over each other's records (a plan or a simulation writes none, and takes none)
    lock, log_dir = None, Path(settings["log_dir"])
    made = [p for p in (log_dir, *log_dir.absolute().parents) if not p.exists()]  # (the folders the lock makes)
    if not (args.plan_only or args.simulate):
        try:
            lock = lock_log_dir(log_dir)
        except LogDirLocked as err:
            parser.error(str(err))
        except OSError as err:
            parser.error(f"`log_dir` {log_dir}: cannot be made or locked ({err})")
    try:
        return _schedule(args, parser, settings, tasks)
    finally:
        unlock_log_dir(lock)
        if made and lock is not None:  # (a schedule refused before it wrote anything leaves no log_dir behind)
            _remove_if_lock_alone(made)


def _remove_if_lock_alone(made: list[Path]) -> None:
    """Removes the folders the lock made (``made``, the log_dir first, then the parents made for it) where the
    log_dir holds only the lock's file: a schedule refused before it wrote anything there."""
    try:
        if [p.name for p in made[0].iterdir()] != [LOCK_FILE]:
            return
        (made[0] / LOCK_FILE).unlink()
        for folder in made:
            folder.rmdir()
    except OSError:  # (another process wrote there meanwhile: the folder is kept)
        pass


def _schedule(args: argparse.Namespace, parser: argparse.ArgumentParser, settings: dict[str, Any],
              tasks: list[Task]) -> int:
    """`main`'s plan and run of a task file's ``tasks`` (``settings``), its log_dir locked where it runs them."""
    records_file = records_path(settings["log_dir"])
    to_run = tasks
    if args.resume:
        try:
            earlier = read_records(records_file) or {}
        except ValueError as err:
            parser.error(f"--resume: {err}")
        finished = {tid for tid, e in earlier.items() if e["state"] == "finished"}
        added = _recorded_tasks(earlier, {t.id for t in tasks}, records_file, settings["gpus"])
        tasks = tasks + added
        # (a finished record of another definition of the task, another task file's or the task edited since: it
        # runs, warned of by the runner, or here where no runner resumes)
        changed = {t.id: c for t in tasks if t.id in finished and (c := definition_changes(earlier[t.id], t))}
        to_run = [t for t in tasks if t.id not in finished or t.id in changed]
        skipped = [t.id for t in tasks if t.id in finished and t.id not in changed]
        # (the finished tasks an inbox added, not rebuilt: counted, of the run's tasks)
        ids = {t.id for t in tasks}
        inbox_done = sorted(tid for tid in finished if earlier[tid].get("added") and tid not in ids)
        if not records_file.exists():  # (a relative log_dir is the working directory's, not the task file's)
            where = "" if Path(settings["log_dir"]).is_absolute() else (
                f" (`log_dir` {settings['log_dir']} is relative: read from the working directory, {Path.cwd()}; run "
                "the resume from the first run's directory, or give the log_dir as an absolute path)")
            print(f"resume: no records at {records_file}{where}: every task runs", flush=True)
        else:  # (the runner names the tasks it skips; a simulation's, here)
            done = skipped + inbox_done
            said = [f"resume: {records_file} records {len(done)} of the {len(tasks) + len(inbox_done)} tasks as "
                    f"finished{f' ({len(inbox_done)} of them added by an inbox)' if inbox_done else ''}: they do not "
                    f"run again{': ' + ids_text(done) if done and args.simulate else ''}"]
            if changed:
                said.append(f"{len(changed)} more as another task, which run{'s' * (len(changed) == 1)}: "
                            f"{ids_text(changed)}")
            print("; ".join(said), flush=True)
        if args.plan_only or args.simulate:
            for tid, changes in changed.items():
                print(changed_warning(records_file, tid, changes), file=sys.stderr, flush=True)
        if not to_run:
            print("every task is finished: nothing to run")
            return 0
    # a run this machine or the cluster cannot hold is refused here, before any plan or chart is made (a refused
    # schedule left a plan.<n>.png behind, and took the next number from the schedule run after it)
    executor, node_gpus, nodes = _ray_executor(args, settings, tasks, parser) if args.ray is not None else (None,) * 3
    scheduler = TaskScheduler(settings["gpus"], settings["time_limit_s"], settings["resolution_s"],
                              deterministic=settings["deterministic"], nodes=nodes)
    res = settings["resolution_s"]  # (each duration is rounded up to the grid, to one step at least)
    stretched = [t for t in to_run if max(1, math.ceil(t.duration / res - 1e-9)) * res > 1.5 * t.duration]
    if stretched:
        print(f"warning: `resolution_s` is {res:g} s: the plan rounds the durations of {len(stretched)} of the "
              f"{len(to_run)} tasks up by more than half ({stretched[0].id!r}: {stretched[0].duration:g} s), so its "
              "makespan may be far longer than the tasks need; lower `resolution_s`", file=sys.stderr, flush=True)
    if not (args.plan_only or args.simulate or args.ray is not None):  # (before the plan: a search of minutes and
        available = _gpus_here(visible_gpus(os.environ))  # its table came first)
        if available is not None and settings["gpus"] > available[0]:
            parser.error(f"{args.task_file}: `gpus` is {settings['gpus']}, but {available[1]} gives {available[0]}; "
                         "lower `gpus`, or use --plan-only / --simulate")
    try:
        plan: Schedule = scheduler.plan(to_run)
    except ValueError as err:
        parser.error(f"{args.task_file}: {err}")
    except KeyboardInterrupt:  # (the search stopped at once: `solve`)
        print("interrupted while planning: no task ran", file=sys.stderr, flush=True)
        return 130
    print(plan.table())
    plan_path, run_path = chart_paths(Path(settings["log_dir"]))
    if settings["gpus"] > MAX_CHART_GPUS:  # (a row a GPU: 100000 of them took minutes)
        print(f"no Gantt chart: {settings['gpus']} GPUs, more rows than a chart has ({MAX_CHART_GPUS} at most)")
    else:
        try:
            chart = gantt(plan.placements, settings["gpus"], args.gantt or plan_path,
                          f"plan: makespan {plan.makespan:.0f} s")
        except (OSError, ValueError) as err:  # (an unwritable folder, a format matplotlib does not write)
            parser.error(f"the plan's Gantt chart {args.gantt or plan_path}: {err}")
        print(f"Gantt chart: {chart}")
    if args.plan_only:
        return 0
    if executor is None:  # (a local executor's clock starts when it is made: after the chart)
        executor = SimulatedExecutor() if args.simulate else LocalExecutor(Path(settings["log_dir"]) / "logs")
    else:  # (made before the plan, over whose nodes it planned: its clock from now, as a local one's)
        executor.start_clock()
    # the plan shown is the one run; a simulation looks in the inbox at each event, its clock jumping from one to the
    # next (every 0.5 s of its clock, a 2,000,000 s task took 41 s)
    # (a simulation writes no records: a real run resumed after it would skip what never ran)
    if not (args.resume or args.simulate) and records_file.exists():  # (a run afresh: the earlier records kept)
        print(f"records: the earlier run's records kept as {_keep_records(records_file)} (`--resume` continues a "
              "run instead)", flush=True)
    runner = ScheduleRunner(scheduler, executor, settings["max_retries"], plan=plan,
                            poll_s=None if args.simulate else POLL_S, records=None if args.simulate else records_file,
                            resume=args.resume and not args.simulate and records_file.exists())
    if args.inbox is not None:
        runner.poll = inbox_poller(args.inbox, settings["gpus"], known=lambda: runner.known_ids(),
                                   need_command=not args.simulate, node_gpus=node_gpus,
                                   settle_s=0.0 if args.simulate else INBOX_SETTLE_S)
    recorded = {t.id for t in added} if args.resume else set()
    for task in tasks if not args.simulate else to_run:  # (resumed, the runner skips the finished ones, said)
        runner.submit(task, added=task.id in recorded)
    in_main = threading.current_thread() is threading.main_thread()  # (signal handlers: the main thread's alone)
    # a `kill`, a job stop, a closed terminal or SSH session: as Ctrl-C (a hangup left the tasks running, and a
    # `--resume` started them again beside themselves); a signal ignored as the schedule started (`nohup`'s hangup)
    # stays ignored
    previous = {sig: signal.signal(sig, _terminated) for sig in _STOP_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN} if in_main else {}
    interrupted: Optional[KeyboardInterrupt] = None
    try:
        records = runner.run()
    except KeyboardInterrupt as interrupt:  # (the runner stopped the running tasks and recorded them "stopped")
        interrupted, records = interrupt, runner.records
        waiting = sorted(t for t, r in records.items() if r.state == "stopped" and t not in runner.stopped_running)
        said = f" (recorded stopped, for a resume to run: {waiting}, which waited)" if waiting else ""
        try:  # (after a hangup the terminal is gone: EIO, which the stop, the chart and the status must not wait on)
            print(f"interrupted: stopped the tasks {runner.stopped_running}{said}; the records so far:", flush=True)
        except OSError:
            pass
    finally:  # an interrupted or failed schedule leaves no task running: a second Ctrl-C or kill waits for that
        if in_main:
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            interrupt_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if hasattr(executor, "stop"):
                executor.stop()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, interrupt_handler)
                for sig, handler in previous.items():
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    try:
        done = gantt(records, settings["gpus"], run_path, f"run{' (interrupted)' if interrupted else ''}: makespan "
                     f"{runner.makespan:.0f} s")
    except (OSError, ValueError) as err:  # (the tasks have run: said, not raised)
        done = f"not written ({err})"
    try:  # (after a hangup the terminal is gone: EIO, which the records and the chart must not wait on)
        print(records_table(records))
        print(f"makespan {runner.makespan:.1f} s, {runner.replans} replans; Gantt chart of the run: {done}")
        if runner.records_path is not None:
            print(f"task records: {runner.records_path} (`--resume` runs again only what did not finish)")
    except OSError:
        pass
    if interrupted is not None:  # (the shell's statuses: 128 + the signal's number)
        return 128 + interrupted.signum if isinstance(interrupted, _Terminated) else 130
    return 0 if all(r.state == "finished" for r in records.values()) else 1


def _ray_executor(args: argparse.Namespace, settings: dict[str, Any], tasks: list[Task],
                  parser: argparse.ArgumentParser) -> tuple[Any, int, Optional[list[int]]]:
    """A `RayExecutor` on ``--ray``'s cluster, the most GPUs its largest node gives a task, and the GPUs of each node
    the plan takes (its largest nodes, the file's `gpus` in all; None: one node), the executor told to run each task
    on its planned node; a parser error where there is no cluster, or it has fewer GPUs than the file asks for (Ray
    would wait forever for a placement group that cannot be made)."""
    from lightning_multilora.scheduling.ray_executor import RayExecutor

    try:
        executor = RayExecutor(address=args.ray, log_dir=Path(settings["log_dir"]) / "logs")
    except (ConnectionError, RuntimeError, ValueError) as err:  # (before any task started)
        parser.error(f"--ray {args.ray}: no Ray cluster to run on ({type(err).__name__}: {err}); start one "
                     "(`ray start --head`) or leave out --ray to run the tasks here")
    total, largest = executor.capacity()
    widest = max(t.gpus for t in tasks)
    if settings["gpus"] > total or widest > largest:
        parser.error(f"{args.task_file}: `gpus` is {settings['gpus']} and the widest task takes {widest} on one "
                     f"node, but the Ray cluster has {total} GPUs, at most {largest} on a node; lower them, or "
                     "use --plan-only / --simulate")
    nodes = executor.nodes()
    if len(nodes) <= 1:
        return executor, largest, None
    ids, counts, left = [], [], settings["gpus"]
    for node_id, count in nodes:  # (most GPUs first: the fewest nodes that hold the file's `gpus`, the widest task
        if left > 0:  # on the first)
            ids.append(node_id)
            counts.append(min(count, left))
            left -= counts[-1]
    executor.place_on(ids, counts)
    return executor, largest, counts if len(counts) > 1 else None


def _recorded_tasks(earlier: Mapping[str, Mapping[str, Any]], in_file: set[str], records_file: Path,
                    gpus: int) -> list[Task]:
    """The tasks ``earlier`` (a records file's entries) records unfinished that an inbox added while the schedule
    ran (``added``), rebuilt from their recorded definitions, said; those that cannot be rebuilt (no definition, no
    command, wider than ``gpus``) named and left out. The unfinished tasks that are no longer in the file (removed,
    renamed) are named and not run again."""
    added, undefined, removed = [], [], []
    for tid, entry in sorted(earlier.items()):
        if tid in in_file or entry["state"] == "finished":
            continue
        if not entry.get("added"):
            removed.append(tid)
            continue
        try:
            task = Task(tid, **entry["task"])
            validate_tasks([task], gpus)
        except (KeyError, TypeError, ValueError):
            undefined.append(tid)
            continue
        if task.command is None:
            undefined.append(tid)
        else:
            added.append(task)
    if added:
        print(f"resume: {records_file} records {len(added)} unfinished task{'s' * (len(added) > 1)} an inbox added: "
              f"{ids_text(t.id for t in added)}; they run again", flush=True)
    if undefined:
        print(f"resume: {records_file} records unfinished tasks an inbox added that cannot run from their records "
              f"(no definition, no command, or wider than `gpus`): {ids_text(undefined)}; add them to the file to "
              "run them", flush=True)
    if removed:
        print(f"resume: {records_file} records unfinished tasks that are not in the file (removed or renamed; or "
              f"an inbox's, in records older than the mark): {ids_text(removed)}; they do not run (add them to the "
              "file to run them)", flush=True)
    return added


def _keep_records(records_file: Path) -> Path:
    """Moves an earlier run's records aside, to the first free ``records.<n>.json`` beside them; the new path."""
    n = 1
    while (kept := records_file.with_name(f"{records_file.stem}.{n}{records_file.suffix}")).exists():
        n += 1
    os.replace(records_file, kept)
    return kept


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``signum``), raised where the schedule runs so that its running tasks are stopped as on
    Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)
