"""A fit's branch held as running beside its exports (`branch_locks`), seen from another process, and let go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_multilora.branch_locks import BranchLocks, branch_alive

pytest.importorskip("fcntl", reason="no flock on this platform (Windows): branches are not held")

HOLD = """
import sys, time
from pathlib import Path
from lightning_multilora.branch_locks import BranchLocks
BranchLocks().hold(Path(sys.argv[1]), sys.argv[2], 1)
print("held", flush=True)
time.sleep(120)
"""


def test_a_branch_is_alive_while_a_process_holds_it_and_not_once_that_process_is_killed(tmp_path):
    export = tmp_path / "exp" / "a"
    export.mkdir(parents=True)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(export), "b1"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdout.readline().strip() == "held"
        assert branch_alive(export, "b1") and branch_alive(tmp_path / "exp" / "other", "b1")
        assert not branch_alive(export, "b2") and not branch_alive(export, "")
        proc.send_signal(signal.SIGKILL)  # (nothing let go by the process: the kernel drops its lock)
        proc.wait(timeout=30)
        assert (tmp_path / "exp" / ".multilora_branch.b1.1").exists() and not branch_alive(export, "b1")
    finally:
        proc.kill()


def test_a_branch_held_in_this_process_is_let_go_with_its_file(tmp_path):
    locks = BranchLocks()
    for name in ("a", "b"):  # (one lock a folder of exports)
        (tmp_path / name).mkdir()
        locks.hold(tmp_path / name, "b1", 0)
    assert branch_alive(tmp_path / "a", "b1")
    assert [p.name for p in tmp_path.glob(".multilora_branch.*")] == [".multilora_branch.b1.0"]
    locks.release()
    assert not branch_alive(tmp_path / "a", "b1") and not list(tmp_path.glob(".multilora_branch.*"))
    locks.release()
