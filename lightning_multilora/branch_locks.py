"""Which fits are writing exports now: a fit holds a shared ``flock`` on a file of its branch of the run's line beside
the export folders it writes (``<parent>/.multilora_branch.<branch>.<rank>``) until it ends or stops; the kernel
lets go of it when the process dies, ``kill -9`` included. Another fit resumed from the same checkpoint into the
same ``export_dir`` asks `branch_alive` before it writes over an export that branch made: two resumes running at
once wrote over each other's finished adapters (an export is known as another resume's only once that fit ended)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_PREFIX = ".multilora_branch."


def _fcntl():
    try:
        import fcntl
    except ImportError:  # (Windows: no locks; a resume running beside another is not told apart from a dead one)
        return None
    return fcntl


class BranchLocks:
    """The locks one fit holds: one file per folder its exports sit in (all of them, as a rule, under one
    ``export_dir``)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def hold(self, directory: Path, branch: str, rank: int = 0) -> None:
        """Hold the lock of ``branch`` beside export folder ``directory`` (once per parent folder) until `release`.
        A folder that cannot be written or locked holds none (its exports are then told apart only once the fit
        ends, as before)."""
        fcntl = _fcntl()
        path = Path(directory).parent / f"{_PREFIX}{branch}.{rank}"
        if fcntl is None or str(path) in self._held:
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (waits only while an `branch_alive` holds it for a moment)
        except OSError:  # (e.g. ENOLCK on a network file system that keeps no locks)
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return
        self._held[str(path)] = fd

    def release(self) -> None:
        """The fit ended or stopped: its files removed and their locks let go."""
        held, self._held = self._held, {}
        for path, fd in held.items():
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)

    def __deepcopy__(self, memo: dict) -> "BranchLocks":  # (a copy of a module holds no lock of the original's)
        return BranchLocks()

    def __getstate__(self) -> dict:
        return {"_held": {}}


def branch_alive(directory: Path, branch: str) -> bool:
    """Whether a fit of ``branch`` holds its lock beside export folder ``directory`` now (any of its ranks), in this
    process or another."""
    fcntl = _fcntl()
    if fcntl is None or not branch:
        return False
    for path in Path(directory).parent.glob(f"{_PREFIX}{branch}.*"):
        try:
            fd = os.open(path, os.O_RDWR)  # (written: NFS takes an exclusive lock on a file open for writing alone)
        except OSError:  # (gone: that fit ended)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            continue
        finally:
            os.close(fd)  # (a lock taken here goes with it)
    return False
