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
A task a resumed run skipped keeps its entry from the run that finished it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

RECORDS_FILE = "records.json"
STATES = ("finished", "failed", "stopped")
FORMAT = 1


def records_path(log_dir: str | Path) -> Path:
    """Where a schedule over ``log_dir`` keeps its task records."""
    return Path(log_dir) / RECORDS_FILE


def record_entry(record: Any, run_started_at: str, task: Any = None, added: bool = False) -> dict[str, Any]:
    """A `RunRecord` as the file holds it, with its `Task`'s definition (``task``, where given) and whether it was
    added while the schedule ran (``added``: an inbox's, which a resume runs again from its definition)."""
    entry = {"id": record.task_id, "state": record.state, "attempts": record.attempts, "start": record.start,
             "end": record.end, "starts": list(record.starts), "gpu_ids": list(record.gpu_ids),
             "exit_code": record.exit_code, "log": record.log, "detail": record.detail,
             "run_started_at": run_started_at}
    if task is not None:
        entry["task"] = {"duration": task.duration, "gpus": task.gpus, "torchrun": task.torchrun,
                         "command": None if task.command is None else list(task.command)}
    if added:
        entry["added"] = True
    return entry


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
