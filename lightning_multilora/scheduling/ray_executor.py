"""`RayExecutor`: hand each planned task to a Ray cluster instead of launching it ourselves.

Each task gets a placement group with one bundle of ``task.gpus`` GPUs (``STRICT_PACK``: one node) and
runs its command there as a subprocess from a Ray task; placed on nodes (`place_on`, a plan over several nodes), a
task runs on the node its plan's GPU ids are on (a Ray task pinned there). Ray picks the devices and sets
``CUDA_VISIBLE_DEVICES`` for real GPUs; the plan's GPU ids are kept for the records. ``resource`` can
name a custom resource standing in for GPUs (tests on a CPU cluster: ``ray.init(resources={"fake_gpu":
4})``). Same protocol as the other executors: ``now``, ``start``, ``wait``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_multilora.arguments import check_real
from lightning_multilora.scheduling.executors import (Completion, _program_found, exit_text, last_text_line,
                                                      next_attempt, next_log_path, task_command, task_env)
from lightning_multilora.scheduling.task_scheduler import Task, first_gpu_ids, node_holding


OUTPUT_CHARS = 8 << 20  # the most of a task's output kept in its log (its end)


def _run_command(command: list[str], env: dict[str, str], resource: str, cwd: Optional[str] = None) -> tuple[int, str]:
    """Runs inside the Ray worker, in ``cwd`` where the node has it (the schedule's folder: a task's relative paths
    are the schedule's, as under `LocalExecutor`); returns the exit status and the output (stdout and stderr as they
    came)."""
    if resource != "GPU":  # a custom resource: say which "devices" Ray granted, as it does for GPUs
        import ray

        granted = ray.get_runtime_context().get_assigned_resources()
        env = {**env, "MULTILORA_ASSIGNED": str(granted.get(resource, 0))}
    env = {**os.environ, **env}
    try:
        result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", cwd=cwd if cwd is not None and os.path.isdir(cwd) else None)
    except OSError as err:  # the program not on that node (127, not retried), or a fork that failed (126: retried)
        return 127 if isinstance(err, (FileNotFoundError, NotADirectoryError)) else 126, \
            f"could not start {command}: {err}\n"
    output = result.stdout
    if len(output) > OUTPUT_CHARS:  # (through Ray's object store to the driver, which writes the log)
        output = f"[the first {len(output) - OUTPUT_CHARS} characters left out]\n" + output[-OUTPUT_CHARS:]
    return result.returncode, output


def _schedule_env() -> dict[str, str]:
    """The schedule's environment, which its tasks run with on a Ray worker (its `PYTHONPATH`, `PATH`, a token...), as
    `LocalExecutor`'s tasks do: a worker's is the Ray node's, started elsewhere. Not the devices (Ray's), nor Ray's own
    settings."""
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("RAY_")}


class RayExecutor:
    """Runs tasks on a Ray cluster (``ray.init(address)`` unless Ray is already initialised). Each attempt's output
    is written, as it ends, to ``log_dir/<task>.<attempt>.log`` on this machine (as `LocalExecutor` writes it;
    ``log_dir`` None: kept nowhere, a failure's last lines in its record). The command gets ``MULTILORA_TASK_ID`` and
    ``MULTILORA_TASK_ATTEMPT`` (`task_env`)."""

    needs_command = True  # (the runner refuses a task without one when it is submitted, before any task starts)

    def __init__(self, address: Optional[str] = None, resource: str = "GPU", poll_s: float = 0.05,
                 log_dir: Optional[str | Path] = None) -> None:
        import ray

        check_real("RayExecutor", "poll_s", poll_s, lambda v: v > 0, "a number of seconds > 0")
        if not ray.is_initialized():
            ray.init(address=address)
        self.ray = ray
        self.resource = resource
        self.poll_s = poll_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._attempts: dict[str, int] = {}
        self._started: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._remote = ray.remote(max_retries=0)(_run_command)  # (Ray's own retries ran an attempt twice, unsaid:
        # the runner retries, as the task's `max_retries` says)
        self._refs: dict[Any, tuple[str, Any]] = {}  # object ref -> (task id, placement group or None)
        self._node_ids: list[str] = []  # (`place_on`: the Ray node of each of the plan's nodes, and its first GPU id)
        self._first_ids: list[int] = []

    def now(self) -> float:
        return time.monotonic() - self._t0

    def start_clock(self) -> None:
        """Start the clock (`now`) again from 0: made before a plan is solved (its nodes planned over), it counted the
        solve as the schedule's time, and a plan followed from time 0 was already behind."""
        self._t0 = time.monotonic()

    def capacity(self) -> tuple[int, int]:
        """The cluster's ``resource`` (GPUs) in all, and on its largest node (a task's bundle takes one node)."""
        per_node = [node.get("Resources", {}).get(self.resource, 0) for node in self.ray.nodes() if node.get("Alive")]
        return int(sum(per_node)), int(max(per_node, default=0))

    def nodes(self) -> list[tuple[str, int]]:
        """(Ray node id, its ``resource`` count) of each alive node that has some, most first."""
        found = [(node["NodeID"], int(node.get("Resources", {}).get(self.resource, 0))) for node in self.ray.nodes()
                 if node.get("Alive")]
        return sorted(((n, c) for n, c in found if c > 0), key=lambda item: -item[1])

    def place_on(self, node_ids: Sequence[str], counts: Sequence[int]) -> None:
        """Run each task on the Ray node its GPU ids are on: the plan's ids numbered node after node, ``counts`` GPUs
        on each (a `TaskScheduler`'s ``nodes``), node ``k`` the Ray node ``node_ids[k]``."""
        if len(node_ids) != len(counts):
            raise ValueError(f"RayExecutor.place_on: a Ray node id for each of the {len(counts)} nodes, got "
                             f"{len(node_ids)}")
        self._node_ids = list(node_ids)
        self._first_ids = first_gpu_ids(counts)

    def start(self, task: Task, gpu_ids: tuple[int, ...], attempt: Optional[int] = None) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        # (its program from beside the schedule's Python where PATH has none: the `multilora` of the environment the
        # schedule runs in, as `LocalExecutor` finds it)
        command = _program_found(task_command(task), os.environ.get("PATH"))
        attempt = next_attempt(task, attempt, self._started)
        demand = {"num_gpus": task.gpus} if self.resource == "GPU" else {"resources": {self.resource: task.gpus}}
        if self._node_ids and gpu_ids:  # (the plan's node: its GPUs are free there, by the plan)
            node = node_holding(gpu_ids[0], self._first_ids)
            pg, strategy = None, NodeAffinitySchedulingStrategy(self._node_ids[node], soft=False)
        else:
            pg = placement_group([{self.resource: task.gpus}], strategy="STRICT_PACK")
            strategy = PlacementGroupSchedulingStrategy(pg)
        ref = self._remote.options(num_cpus=0, **demand, scheduling_strategy=strategy).remote(
            command, {**_schedule_env(), **task_env(task, attempt)}, self.resource, os.getcwd())
        self._refs[ref] = (task.id, pg)

    def _keep_log(self, task_id: str, output: str) -> tuple[str, Optional[str]]:
        """Writes an attempt's output to its log; what a failure's record says of it (the log, or the last lines),
        and the log's path (None where none was written)."""
        if self.log_dir is None:
            return f": {output[-300:]}", None
        path = next_log_path(self.log_dir, task_id, self._attempts)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(output, encoding="utf-8")
        except OSError as err:  # (the task has run: said in its record, the schedule goes on)
            return f", log not written ({err}): {output[-300:]}", None
        last = last_text_line(output)  # (its error, where it said one: as a local task's record says it)
        return f", log {path}" + (f"; its log ends: {last}" if last else ""), str(path)

    def stop(self) -> list[Completion]:
        """Cancel every running task (its worker killed) and free its placement group (an interrupted schedule
        leaves nothing running on the cluster); their completions (failed, "stopped"; a cancelled task's output is
        not kept)."""
        from ray.util.placement_group import remove_placement_group

        stopped = []
        for ref, (task_id, pg) in list(self._refs.items()):
            self.ray.cancel(ref, force=True)
            if pg is not None:
                remove_placement_group(pg)
            stopped.append(Completion(self.now(), task_id, False, "stopped (cancelled on the cluster)"))
        self._refs.clear()
        return stopped

    def wait(self, deadline: Optional[float]) -> list[Completion]:
        from ray.util.placement_group import remove_placement_group

        if not self._refs and deadline is None:
            raise RuntimeError("waiting for a completion with no task running")
        while True:
            timeout = self.poll_s if deadline is None else max(0.0, min(self.poll_s, deadline - self.now()))
            ready, _ = self.ray.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout) if self._refs \
                else ([], [])
            done = []
            for ref in ready:
                task_id, pg = self._refs.pop(ref)
                code, log = None, None
                final = False
                try:
                    code, output = self.ray.get(ref)
                    ok, detail = code == 0, "" if code == 0 else exit_text(code)
                    kept, log = self._keep_log(task_id, output)
                    detail += "" if ok else kept.rstrip()
                    final = code == 127 and output.startswith("could not start ")  # (a retry finds none either)
                    detail += " (not retried)" if final else ""
                except Exception as err:  # noqa: BLE001 - a crashed worker is a failed attempt
                    ok, detail = False, f"{type(err).__name__}: {err}"
                if pg is not None:
                    remove_placement_group(pg)
                done.append(Completion(self.now(), task_id, ok, detail, code, log, final=final))
            if done or (deadline is not None and self.now() >= deadline):
                return done
            if not self._refs:
                time.sleep(timeout)
