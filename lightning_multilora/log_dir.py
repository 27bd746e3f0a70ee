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
    """``trainer.log_dir`` (or its ``default_root_dir`` where there is none), asked once per Trainer. A smoke run
    (``fast_dev_run``, whose logger and checkpoints Lightning turns off) gets a temporary folder instead, said once:
    its exports and summary land there, not beside the real runs' (where they were versioned on, and its summary
    refused the next real run a log directory without a logger); one for every rank, rank 0's."""
    try:
        return _seen[trainer]
    except KeyError:
        pass
    except TypeError:  # (an object that takes no weak reference: a stand-in of a Trainer)
        return trainer.log_dir or trainer.default_root_dir
    found = trainer.log_dir or trainer.default_root_dir
    if getattr(trainer, "fast_dev_run", False):
        import os
        import tempfile
        import warnings

        first = getattr(trainer, "is_global_zero", True)
        smoke = tempfile.mkdtemp(prefix="multilora-fast-dev-run-") if first else None
        strategy = getattr(trainer, "strategy", None)
        if strategy is not None and getattr(trainer, "world_size", 1) > 1:  # (one folder: rank 0's, as log_dir is)
            smoke = strategy.broadcast(smoke, src=0)
            os.makedirs(smoke, exist_ok=True)
        if first:
            warnings.warn(f"`Trainer(fast_dev_run=...)`: the smoke run writes its adapters and summary to {smoke}, "
                          f"not {found}", stacklevel=2)
        found = smoke
    _seen[trainer] = found
    return found
