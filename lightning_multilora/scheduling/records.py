"""A schedule's task records on disk: ``<log_dir>/records.json``, what a re-run with ``resume`` reads.

The file is rewritten whole after every completion, and when the schedule stops (Ctrl-C, SIGTERM, an error), written
to a temporary file and renamed into place (``os.replace``): a schedule killed mid-write leaves the previous version,
never half of one. Each task's entry::

    {"id": "quick", "state": "finished", "attempts": 1, "start": 0.0, "end": 1.2, "starts": [0.0],
     "gpu_ids": [0], "exit_code": 0, "log": "runs/schedule/logs/quick.1.log", "detail": "",
     "run_started_at": "2026-01-01T10:00:00+00:00"}

``state`` is ``finished``, ``failed`` or ``stopped`` (running, or waiting to be retried, when the schedule stopped,
or when the records were last written by a schedule that then died unrecorded: ``kill -9``; a resume runs it again,
its attempts numbered on); the file is written as each attempt starts too;
``start`` / ``end`` are seconds on the run's clock (from ``run_started_at``), ``start`` the last attempt's and
``starts`` every attempt's; ``task`` is the task's definition (``duration``, ``gpus``, ``torchrun``, ``command``),
and ``added`` (true) marks a task added while the schedule ran (through an inbox), not by the task file.
A task a resumed run skipped keeps its entry from the run that finished it; a resume skips a task recorded finished
only where its recorded definition is the task's (`definition_changes`: another task file's records over the same
``log_dir`` name other tasks by the same ids).

A schedule that runs tasks holds ``<log_dir>/.schedule.lock`` (`lock_log_dir`) from before it reads or moves the
records until it ends: a second schedule, or a ``--resume`` of a schedule still running, over the same ``log_dir``
is refused, naming the running one's PID.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

RECORDS_FILE = "records.json"
LOCK_FILE = ".schedule.lock"
STATES = ("finished", "failed", "stopped")
FORMAT = 1


def records_path(log_dir: str | Path) -> Path:
    """Where a schedule over ``log_dir`` keeps its task records."""
    return Path(log_dir) / RECORDS_FILE


def task_definition(task: Any) -> dict[str, Any]:
    """A `Task`'s definition as its record holds it (``task``): a resume runs an inbox's task again from it."""
    return {"duration": task.duration, "gpus": task.gpus, "torchrun": task.torchrun,
            "command": None if task.command is None else list(task.command)}


def record_entry(record: Any, run_started_at: str, task: Any = None, added: bool = False) -> dict[str, Any]:
    """A `RunRecord` as the file holds it, with its `Task`'s definition (``task``, where given) and whether it was
    added while the schedule ran (``added``: an inbox's, which a resume runs again from its definition)."""
    entry = {"id": record.task_id, "state": record.state, "attempts": record.attempts, "start": record.start,
             "end": record.end, "starts": list(record.starts), "gpu_ids": list(record.gpu_ids),
             "exit_code": record.exit_code, "log": record.log, "detail": record.detail,
             "run_started_at": run_started_at}
    if task is not None:
        entry["task"] = task_definition(task)
    if added:
        entry["added"] = True
    return entry


# what a task runs, as its record's ``task`` holds it: a record of other values is another task's. (``duration``, an
# estimate for the plan, is not: a finished task whose estimate was corrected since is not run again)
DEFINING_FIELDS = ("command", "gpus", "torchrun")


def definition_changes(entry: Mapping[str, Any], task: Any) -> dict[str, tuple[Any, Any]]:
    """The fields of ``task`` (a `Task`) whose values differ from those ``entry`` (a record) recorded for it, by
    name: (recorded, now); none where the entry records no definition (records older than the definitions)."""
    recorded = entry.get("task")
    if not isinstance(recorded, Mapping):
        return {}
    now = task_definition(task)
    return {name: (recorded.get(name), now[name]) for name in DEFINING_FIELDS if recorded.get(name) != now[name]}


def changes_text(changes: Mapping[str, tuple[Any, Any]], most: int = 160) -> str:
    """`definition_changes` in words: ``command`` recorded [...], now [...]; a value longer than ``most`` characters
    is shown around where the two first differ (two long commands differing in their last argument, cut at their
    start, read the same)."""
    said = []
    for name, (was, now) in changes.items():
        texts = repr(was), repr(now)
        differ = next((i for i, (x, y) in enumerate(zip(*texts)) if x != y), min(map(len, texts)))
        start = max(0, min(differ - most // 2, max(map(len, texts)) - most))
        cut = [("..." if start else "") + text[start:start + most] + ("..." if len(text) > start + most else "")
               for text in texts]
        said.append(f"`{name}` recorded {cut[0]}, now {cut[1]}")
    return "; ".join(said)


def changed_warning(path: Any, task_id: str, changes: Mapping[str, tuple[Any, Any]]) -> str:
    """What a resume says of a task ``path`` records as finished, but as another task (``changes``): it runs."""
    return (f"warning: resume: {path} records task {task_id!r} as finished, but as another task "
            f"({changes_text(changes)}): it runs")


class LogDirLocked(RuntimeError):
    """Another schedule holds the ``log_dir``'s lock (`lock_log_dir`)."""


def lock_log_dir(log_dir: str | Path) -> Optional[int]:
    """Takes ``<log_dir>/.schedule.lock`` for this process (``flock``, not waiting; the folder made where absent) and
    writes this process's PID in it; the lock's file descriptor, to give `unlock_log_dir` (the kernel releases it
    when the process ends, however: ``kill -9`` leaves no stale lock). `LogDirLocked`, naming the holder's PID and
    ``log_dir``, where another schedule holds it; None where locks are not had (no ``fcntl``: Windows; a file system
    that refuses them, said)."""
    try:
        import fcntl
    except ImportError:
        return None
    path = Path(log_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # (not inherited: a task's process does not hold it)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode("ascii", "replace").strip()
        os.close(fd)
        raise LogDirLocked(f"{log_dir}: another schedule (PID {holder or 'unknown'}) is running over this log_dir "
                           f"(it holds {path}): two schedules (or a --resume of a schedule still running) over one "
                           "log_dir would run tasks twice and write over each other's records; wait for it to end "
                           "or stop it, or give this task file another `log_dir`") from None
    except OSError as err:  # (e.g. ENOLCK on a network file system that keeps no locks)
        os.close(fd)
        print(f"warning: {path} cannot be locked ({err}): nothing stops a second schedule over {log_dir}",
              file=sys.stderr, flush=True)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def unlock_log_dir(fd: Optional[int]) -> None:
    """Releases a `lock_log_dir` lock (its PID wiped first: the file stays, an empty one free for the next)."""
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    os.close(fd)  # (the lock goes with the last descriptor of it)


def write_records(path: str | Path, entries: Iterable[Mapping[str, Any]], started_at: str) -> Path:
    """Writes the entries to ``path`` atomically (a temporary file beside it, renamed into place)."""
    path = Path(path)
    data = {"format": FORMAT, "started_at": started_at, "tasks": [dict(e) for e in entries]}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()
    return path


def read_records(path: str | Path) -> Optional[dict[str, dict[str, Any]]]:
    """The entries of a records file by task id; None where there is no file. A file that is not one (cut short,
    edited, another program's) is refused, naming it: a resume that misread it would skip or redo tasks."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: the schedule's records do not read ({type(err).__name__}: {err}); remove the file "
                         "to run every task again") from None
    if isinstance(data, Mapping) and data.get("format") != FORMAT:
        raise ValueError(f"{path}: the schedule's records are of format {data.get('format')!r}, this version reads "
                         f"format {FORMAT}; remove the file to run every task again")
    tasks = data.get("tasks") if isinstance(data, Mapping) else None
    if not isinstance(tasks, list):
        raise ValueError(f"{path}: not a schedule's records (a mapping with a `tasks` list); remove the file to run "
                         "every task again")
    entries: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(tasks):
        if not (isinstance(entry, Mapping) and isinstance(entry.get("id"), str) and entry.get("state") in STATES):
            raise ValueError(f"{path}: task entry #{i} needs an `id` and a `state` ({', '.join(STATES)}), got "
                             f"{entry!r}; remove the file to run every task again")
        entries[entry["id"]] = dict(entry)
    return entries


def finished_entries(path: str | Path) -> dict[str, dict[str, Any]]:
    """The entries ``path`` records as finished (none where there is no file)."""
    return {tid: e for tid, e in (read_records(path) or {}).items() if e["state"] == "finished"}


def ids_text(ids: Iterable[str], most: int = 20) -> str:
    """Task ids in words, the first ``most`` of them and how many more."""
    ids = sorted(ids)
    shown = ", ".join(ids[:most])
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")
