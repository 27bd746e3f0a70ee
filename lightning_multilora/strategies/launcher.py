"""The processes of an adapter-parallel run: Lightning's launcher, whose observer lets the main process export.

Lightning's launcher watches the other ranks' processes from a thread of the main one (rank 0): one that ended with
an error (a Python error, a CUDA OOM, the OOM killer) got every process, the main one included, a SIGKILL within
5 s. Rank 0, which had met the error through the lost collective and was exporting its adapters, was killed in the
middle: its exports cut short (a folder with its stamp alone), no summary written. Here the observer waits
`CHILD_FAILURE_GRACE_S` for the main process to end on its own before it kills what is left (a rank 0 hung in a
collective with the dead one); the other ranks are killed as the main process exits, not left behind."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

log = logging.getLogger(__name__)

CHILD_FAILURE_GRACE_S = 120.0  # how long rank 0 has to export after another rank's process failed (a rank 0 hung
# in a collective with the dead one, as NCCL may leave it, is killed then: Lightning's observer killed it in 5 s)


class _ObserverLettingRankZeroExport(_ChildProcessObserver):
    """Lightning's observer, waiting ``grace_s`` before it kills the main process (`CHILD_FAILURE_GRACE_S`)."""

    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], grace_s: float) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes)
        self._grace_s = grace_s

    def _terminate_all(self) -> None:
        failed = [(p.pid, p.returncode) for p in self._child_processes if p.returncode]
        log.warning(f"rank process(es) {failed} (PID, exit code) ended with an error: rank 0 exports its adapters "
                    f"and ends; what still runs in {self._grace_s:g} s is killed")
        atexit.register(self._kill_children)  # (rank 0 ends first: the ranks left, hung in a collective, go too)
        time.sleep(self._grace_s)  # (a daemon thread: the main process ending ends the wait)
        super()._terminate_all()

    def _kill_children(self) -> None:
        kill = signal.SIGTERM if sys.platform == "win32" else signal.SIGKILL
        for proc in self._child_processes:
            if proc.poll() is None:
                proc.send_signal(kill)


class AdapterParallelLauncher(_SubprocessScriptLauncher):
    """`_SubprocessScriptLauncher` whose process observer is `_ObserverLettingRankZeroExport`."""

    grace_s: float = CHILD_FAILURE_GRACE_S

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _ObserverLettingRankZeroExport(os.getpid(), self.procs, self.grace_s).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
