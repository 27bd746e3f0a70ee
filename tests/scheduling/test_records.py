"""A schedule's task records on disk: written whole or not at all, read back for a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_multilora.scheduling.records import finished_entries, read_records, write_records


def test_records_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Written beside the file and renamed into place: a write that fails midway (a killed run, a full disk) leaves
    the previous records, which a resume then reads, and no temporary file."""
    path = tmp_path / "records.json"
    write_records(path, [{"id": "a", "state": "finished"}], "2026-01-01T00:00:00+00:00")

    def cut_short(self, text, *args, **kwargs):
        with open(self, "w") as fh:
            fh.write(text[: len(text) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(OSError, match="No space left"):
        write_records(path, [{"id": "a", "state": "finished"}, {"id": "b", "state": "stopped"}], "later")
    monkeypatch.undo()
    assert set(finished_entries(path)) == {"a"} and list(tmp_path.iterdir()) == [path]
    assert json.loads(path.read_text())["started_at"] == "2026-01-01T00:00:00+00:00"


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "not a schedule's records"),
    ('{"format": 1, "tasks": [{"id": "a", "state": "done"}]}', r"task entry #0 needs an `id` and a `state` "
                                                               r"\(finished, failed, stopped\)"),
    ('{"format": 99, "tasks": []}', r"records are of format 99, this version reads format 1"),
    ('{"tasks": [', "the schedule's records do not read"),
])
def test_records_that_do_not_read_are_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "records.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_records(path)
    assert str(path) in str(info.value) and "remove the file to run every task again" in str(info.value)
    assert read_records(tmp_path / "none.json") is None and finished_entries(tmp_path / "none.json") == {}
