"""The run's log directory, asked of the Trainer once per Trainer.

``Trainer.log_dir`` is a collective (rank 0's directory, broadcast): every process must ask it at the same point, or
the one that asks alone waits for ever. The module's own callback (`module.ExportOnException`) asks it in ``setup``,
where every process is; the module and the callbacks take the remembered answer later, where one process may be
alone (an export on the adapter's rank, a decision on rank 0, the report on rank 0)."""

from __future__ import annotations

import weakref
from typing import Any

_seen: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def log_dir_of(trainer: Any) -> str:
    """``trainer.log_dir`` (or its ``default_root_dir`` where there is none), asked once per Trainer."""
    try:
        return _seen[trainer]
    except KeyError:
        pass
    except TypeError:  # (an object that takes no weak reference: a stand-in of a Trainer)
        return trainer.log_dir or trainer.default_root_dir
    found = _seen[trainer] = trainer.log_dir or trainer.default_root_dir
    return found
