"""Executors run planned tasks and report completions to the `ScheduleRunner`.

An executor has a clock (``now()``, seconds), ``start(task, gpu_ids)`` (optionally ``attempt=``: the runner then says
the attempt's number, 1 on a task's first) and ``wait(deadline)``: block until at least one running task completes or
the clock reaches ``deadline`` (None: until a completion), and return the completions; optionally ``stop()`` (stop
every running task; it may return their `Completion`s) and ``needs_command`` (True: the runner refuses a task without a
``command`` when it is submitted). `SimulatedExecutor` runs on a virtual clock (tests, what-if planning);
`LocalExecutor` runs each task's command as a subprocess on its GPUs (``CUDA_VISIBLE_DEVICES``;
``torchrun`` for multi-GPU tasks) on the wall clock. Both `LocalExecutor` and `RayExecutor` give a task's command
``MULTILORA_TASK_ID`` (its id) and ``MULTILORA_TASK_ATTEMPT`` (its attempt, from 1), e.g. to resume its own
checkpoints alone.
"""

from __future__ import annotations

import heapq
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional

from lightning_multilora.arguments import check_int, check_real
from lightning_multilora.scheduling.task_scheduler import Task
from lightning_multilora.signals import stop_signals_deferred


@dataclass(order=True)
class Completion:
    """An attempt's end: when, whether it succeeded, what went wrong; its exit status and log where there are."""

    time: float
    task_id: str = field(compare=False)
    ok: bool = field(compare=False)
    detail: str = field(default="", compare=False)
    exit_code: Optional[int] = field(default=None, compare=False)
    log: Optional[str] = field(default=None, compare=False)
    final: bool = field(default=False, compare=False)  # (a failure a retry would repeat: no retry)
    # (returned by a stop, of a task whose own process had exited before it, what it left being stopped: its end)
    exited: bool = field(default=False, compare=False)


def _program_found(command: list[str], path: Optional[str]) -> list[str]:
    """``command``, its program (a bare name not on ``path``) taken from beside this Python where it is there: the
    `multilora` of the environment the schedule runs in (``.venv/bin/multilora schedule``, the environment not
    activated, started tasks whose ``multilora fit`` was found nowhere)."""
    program = command[0] if command else ""
    if not program or os.sep in program or shutil.which(program, path=path) is not None:
        return command
    beside = Path(sys.executable).parent / program
    return [str(beside), *command[1:]] if beside.is_file() and os.access(beside, os.X_OK) else command


def task_env(task: Task, attempt: int) -> dict[str, str]:
    """What a task's command is told of itself: ``MULTILORA_TASK_ID`` and ``MULTILORA_TASK_ATTEMPT`` (from 1)."""
    return {"MULTILORA_TASK_ID": task.id, "MULTILORA_TASK_ATTEMPT": str(attempt)}


def next_attempt(task: Task, attempt: Optional[int], started: dict[str, int]) -> int:
    """The attempt a start is: the runner's ``attempt``, or (None: started without a runner) one more than this
    executor's starts of the task so far (``started`` counts them)."""
    if attempt is None:
        attempt = started.get(task.id, 0) + 1
    else:
        check_int(f"task {task.id!r}", "attempt", attempt, 1)
    started[task.id] = max(started.get(task.id, 0), attempt)
    return attempt


class SimulatedExecutor:
    """Runs tasks on a virtual clock. ``actual`` gives a task's real duration when it differs from the
    estimate (an early exit ends a task early); ``failures`` how many of its first attempts fail (halfway)."""

    def __init__(self, actual: Optional[dict[str, float]] = None, failures: Optional[dict[str, int]] = None) -> None:
        self.actual = dict(actual or {})
        self.failures = dict(failures or {})
        self._events: list[Completion] = []
        self._now = 0.0
        self.started: list[tuple[float, str, tuple[int, ...]]] = []

    def now(self) -> float:
        return self._now

    def start(self, task: Task, gpu_ids: tuple[int, ...], attempt: Optional[int] = None) -> None:
        self.started.append((self._now, task.id, gpu_ids))
        duration = self.actual.get(task.id, task.duration)
        fails = self.failures.get(task.id, 0) > 0
        if fails:
            self.failures[task.id] -= 1
            duration /= 2
        heapq.heappush(self._events, Completion(self._now + duration, task.id, not fails))

    def wait(self, deadline: Optional[float]) -> list[Completion]:
        if not self._events or (deadline is not None and self._events[0].time > deadline):
            if deadline is None:
                raise RuntimeError("waiting for a completion with no task running")
            self._now = max(self._now, deadline)
            return []
        self._now = max(self._now, self._events[0].time)
        done = []
        while self._events and self._events[0].time <= self._now + 1e-9:
            done.append(heapq.heappop(self._events))
        return done


def visible_gpus(env: Mapping[str, str]) -> Optional[list[str]]:
    """The GPUs that ``env``'s ``CUDA_VISIBLE_DEVICES`` lets a process use, as it names them (indices or UUIDs);
    None where it is unset (every GPU of the machine); empty where it is set empty or starts with a negative index
    (``-1``: no GPU, the tasks get none either, their GPU ids are slots only). As CUDA does, the list ends at its
    first negative index."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    names = []
    for name in (v.strip() for v in value.split(",")):
        if name.startswith("-"):
            break
        if name:
            names.append(name)
    return names


def next_log_path(log_dir: Path, task_id: str, attempts: dict[str, int]) -> Path:
    """``log_dir/<task>.<attempt>.log`` of a task's next attempt (``attempts`` counts them), numbered on past the
    logs an earlier schedule left there (which are kept)."""
    attempt = attempts.get(task_id, 0) + 1
    while (log_dir / f"{task_id}.{attempt}.log").exists():
        attempt += 1
    attempts[task_id] = attempt
    return log_dir / f"{task_id}.{attempt}.log"


class LocalExecutor:
    """Each task's ``command`` as a subprocess on its GPU set, output to ``log_dir/<task>.<attempt>.log`` (numbered on
    past the logs an earlier schedule left there, which are kept).

    ``CUDA_VISIBLE_DEVICES`` is the task's GPU ids: the schedule's GPU ``i`` is the ``i``-th of the
    ``CUDA_VISIBLE_DEVICES`` this executor was given (in ``env``, else its own environment's; `visible_gpus`), GPU
    ``i`` of the machine where that is unset, and none where it is empty; a ``torchrun`` task runs as
    ``python -m torch.distributed.run --nproc-per-node <gpus> --standalone <command>``. A non-zero exit
    status is a failed attempt (the runner retries it). ``poll_s`` is how often running tasks are checked. The command
    gets ``MULTILORA_TASK_ID`` and ``MULTILORA_TASK_ATTEMPT`` (`task_env`). A bare program name not on the task's
    ``PATH`` is taken from beside this Python where it is there (the ``multilora`` of the environment the schedule
    runs in, not activated); a program found nowhere is a failed start the runner does not retry.
    """

    needs_command = True  # (the runner refuses a task without one when it is submitted, before any task starts)
    stop_timeout_s = 30.0  # how long `stop` lets the tasks end on SIGTERM before it kills them (SIGKILL)
    group_grace_s = 5.0  # how long a task's other processes get, on SIGTERM, once its own has exited (`_drain`)

    def __init__(self, log_dir: str | Path, env: Optional[dict[str, str]] = None, poll_s: float = 0.05) -> None:
        check_real("LocalExecutor", "poll_s", poll_s, lambda v: v > 0, "a number of seconds > 0")
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.poll_s = poll_s
        self._t0 = time.monotonic()
        self._procs: dict[str, tuple[subprocess.Popen, object, Path]] = {}
        self.visible = visible_gpus({**os.environ, **self.env})
        self._attempts: dict[str, int] = {}
        self._started: dict[str, int] = {}
        self._failed_starts: list[Completion] = []
        # a stop under way (cut short by a second Ctrl-C, then asked again): when it kills the tasks still running,
        # and the processes it has sent SIGTERM
        self._kill_at: Optional[float] = None
        self._termed: set[int] = set()
        # (`_drain`: the process groups ended tasks left, when to kill them (then when to give up on them), whether
        # they were killed, and their tasks' completions, told once the groups are gone)
        self._draining: dict[int, list] = {}
        # (tasks' ends collected and not yet returned: a Ctrl-C between the two lost a task that had ended, recorded
        # "stopped" by the stop and run again by a resume; `wait` returns them, or `stop` as ended before it)
        self._ended: list[Completion] = []

    def now(self) -> float:
        return time.monotonic() - self._t0

    def start(self, task: Task, gpu_ids: tuple[int, ...], attempt: Optional[int] = None) -> None:
        command = task_command(task)
        attempt = next_attempt(task, attempt, self._started)
        if self.visible and max(gpu_ids, default=-1) >= len(self.visible):
            self._failed_starts.append(Completion(self.now(), task.id, False, (
                f"GPUs {list(gpu_ids)} asked for, but CUDA_VISIBLE_DEVICES gives {len(self.visible)}")))
            return
        if self.visible is None:
            devices = [str(i) for i in gpu_ids]
        else:  # (none where it hides every GPU)
            devices = [self.visible[i] for i in gpu_ids if i < len(self.visible)]
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": ",".join(devices), **task_env(task, attempt)}
        command = _program_found(command, env.get("PATH"))
        try:  # (the log's name too: a name the file system refuses, ENAMETOOLONG, stopped the whole schedule)
            log_path = next_log_path(self.log_dir, task.id, self._attempts)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "x")  # noqa: SIM115 - closed when the task completes
        except OSError as err:  # a failed attempt, not a crashed schedule that stops the running tasks
            self._failed_starts.append(Completion(self.now(), task.id, False, f"could not open its log: {err}"))
            return
        try:
            with stop_signals_deferred():  # (a Ctrl-C inside Popen, its child forked: registered, then stopped)
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=_dies_with_parent())
                self._procs[task.id] = (proc, log, log_path)
        except OSError as err:  # e.g. the program does not exist: a failed attempt, not a crashed schedule
            missing = isinstance(err, (FileNotFoundError, NotADirectoryError))  # (a retry would find none either)
            said = str(err)
            if missing and os.sep not in command[0] and shutil.which(command[0], path=env.get("PATH")):
                said = (f"{command[0]!r} (on PATH) could not be run: {err}; a script whose `#!` interpreter is gone "
                        "(a virtual environment moved or removed?) (not retried)")
            elif missing and os.sep not in command[0]:
                said = (f"no program {command[0]!r} on PATH, nor beside this Python ({Path(sys.executable).parent}): "
                        "give its full path, or start the schedule with the environment that installs it on PATH "
                        "(not retried)")
            elif missing:
                said += " (not retried)"
            log.write(f"could not start {command}: {said}\n")
            log.close()
            self._failed_starts.append(Completion(self.now(), task.id, False, f"could not start: {said}",
                                                  log=str(log_path), final=missing))

    def wait(self, deadline: Optional[float]) -> list[Completion]:
        if self._failed_starts:
            done, self._failed_starts = self._failed_starts, []
            return done
        if not self._procs and not self._draining and not self._ended and deadline is None:
            raise RuntimeError("waiting for a completion with no task running")
        while True:
            self._collect_exited()
            self._drain_step()
            if self._ended or (deadline is not None and self.now() >= deadline):
                done, self._ended = self._ended, []
                return done
            time.sleep(self.poll_s)

    def _collect_exited(self) -> None:
        """The tasks whose own process has exited: their ends (exit status, the log's last line where it failed) to
        `_ended`, or to `_drain` where they left processes (told once those are gone: `_drain_step`)."""
        for task_id, (proc, log, log_path) in list(self._procs.items()):
            code = proc.poll()
            if code is None:
                continue
            said = "" if code == 0 else f"{exit_text(code)}, log {log_path}"
            last = "" if code == 0 else last_line(log_path)  # (its error, where it said one)
            said += f"; its log ends: {last}" if last else ""
            ended = (task_id, code == 0, said, code, str(log_path))
            with stop_signals_deferred():  # (moved whole from running to ended)
                log.close()
                del self._procs[task_id]
                if not self._drain(proc, ended):
                    self._ended.append(Completion(self.now(), *ended))

    def _drain(self, proc: subprocess.Popen, ended: Optional[tuple]) -> bool:
        """The processes left of a task whose own process has exited (a multi-process fit's other ranks, its rank 0
        killed) get SIGTERM at once, and SIGKILL ``group_grace_s`` later where they are still there (`_drain_step`, at
        each poll); the task completes once they are gone (``ended``: its completion's fields), its GPUs busy until
        then. Orphaned, an NCCL rank waited for its lost peer up to the process group's timeout, holding its GPU's
        memory, while the retry started on the same GPUs. Whether any were left."""
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return False  # (none left)
        self._draining[proc.pid] = [time.monotonic() + self.group_grace_s, False, ended]
        return True

    def _drain_step(self, kill: bool = False) -> None:
        """`_drain`'s groups: the tasks of gone ones completed, to `_ended` (their processes that are this one's
        children reaped: a schedule that reaps orphans, a container's first process, held them as zombies), the others
        past their grace (all of them with ``kill``) given SIGKILL; a group still there ``group_grace_s`` after its
        SIGKILL (a process the kernel holds) is given up on, its task completed."""
        import signal

        live = _live_groups() if self._draining else set()
        for pgid, (at, killed, ended) in list(self._draining.items()):
            try:
                while os.waitpid(-pgid, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            if not _group_alive(pgid, live):
                at = None
            if at is not None and killed and time.monotonic() >= at:
                if ended is not None:
                    ended = (*ended[:2], ended[2] + ("; " if ended[2] else "") + "its other processes outlived "
                             "SIGKILL", *ended[3:])
                at = None
            if at is None:
                with stop_signals_deferred():
                    del self._draining[pgid]
                    if ended is not None:  # (None: a task `stop` stopped, completed there)
                        self._ended.append(Completion(self.now(), *ended))
            elif not killed and (kill or time.monotonic() >= at):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self._draining[pgid] = [time.monotonic() + self.group_grace_s, True, ended]

    def stop(self) -> list[Completion]:
        """Terminate every running task and its children (an interrupted schedule leaves no orphans): SIGTERM to
        each, then SIGKILL to those still running `stop_timeout_s` later (one wait for all of them: it was
        30 s for each in turn, said nowhere); their completions (failed, "stopped", the exit status and log). A task
        whose own process had exited before the stop (since the last `wait`) completes as it ended (``exited``): one
        that exited 0 as a Ctrl-C came was recorded "stopped", and run again by a resume."""
        import signal

        if self._kill_at is None:  # (a stop asked again: the tasks that exited since are the first one's, stopped)
            self._collect_exited()
        running = [proc for proc, _, _ in self._procs.values() if proc.poll() is None]
        tasks = f"{len(running)} task{'s' * (len(running) != 1)}"
        for proc, _, _ in self._procs.values():
            if proc.pid not in self._termed:  # (once: a task may take a second SIGTERM for "now")
                _signal_group(proc, signal.SIGTERM)
                self._termed.add(proc.pid)
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self.stop_timeout_s
            if running:
                _say(f"stopping {tasks}: SIGTERM sent, SIGKILL in {self.stop_timeout_s:g} s")
        elif running:  # (a stop cut short by a second Ctrl-C, asked again: the same deadline, not another)
            _say(f"still stopping {tasks}: SIGKILL in {max(0.0, self._kill_at - time.monotonic()):.0f} s")
        deadline = self._kill_at
        for proc, _, _ in self._procs.values():  # (what a stopped task left, a rank that ignores SIGTERM: drained,
            if proc not in running and proc.pid not in self._draining:  # its grace, then SIGKILL)
                self._drain(proc, None)
        while (running or self._draining) and time.monotonic() < deadline:
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
            for proc in [proc for proc in running if proc.poll() is not None]:
                running.remove(proc)
                self._drain(proc, None)
            self._drain_step()  # (a task that had exited before the stop: to `_ended` once what it left is gone)
        for proc in running:
            _signal_group(proc, signal.SIGKILL)
        while self._draining:  # (past the stop's deadline: killed, and given up on `group_grace_s` later)
            self._drain_step(kill=True)
            if self._draining:
                time.sleep(self.poll_s)
        stopped, self._ended = [replace(done, exited=True) for done in self._ended], []
        for task_id, (proc, log, log_path) in list(self._procs.items()):
            proc.wait()
            log.close()
            stopped.append(Completion(self.now(), task_id, False, f"stopped, log {log_path}", proc.returncode,
                                      str(log_path)))
        self._procs.clear()
        self._kill_at, self._termed = None, set()
        return stopped


def _live_groups() -> Optional[set[int]]:
    """The process groups that hold a process that has not exited (read from /proc once, for every group a poll
    looks at); None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    live = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:  # "pid (comm) state ppid pgrp ...": the fields after the command's closing parenthesis
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            live.add(int(fields[2]))
    return live


def _group_alive(pgid: int, live: Optional[set[int]]) -> bool:
    """Whether process group ``pgid`` has a process that has not exited (``live``: `_live_groups`): a zombie
    (exited, its parent gone and no one reaping it: a container whose first process does not) holds no memory, and
    counts as gone."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return live is None or pgid in live


def _say(text: str) -> None:
    """Prints ``text`` (after a hangup the terminal may be gone: EIO, which a stop must not fail on)."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def last_line(log: str | Path, most: int = 200) -> str:
    """The last line of ``log`` with any text in it (a failed task's error, ``RuntimeError: boom``; a progress bar's
    last state, ``\\r`` ending a line too), cut at ``most`` characters; empty where there is none."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return last_text_line(tail, most)


def last_text_line(text: str, most: int = 200) -> str:
    """`last_line` of output held in memory (a Ray task's, which comes back as text)."""
    for line in reversed(text[-8192:].splitlines()):
        line = line.strip()
        if line:
            return line if len(line) <= most else line[:most] + "..."
    return ""


def _dies_with_parent() -> Optional[Callable[[], None]]:
    """On Linux, what a task's process runs before its command so that it gets SIGTERM when the schedule's process
    ends, however it ends (``kill -9``, the OOM killer): in a session of its own, a task outlived a schedule that
    could not stop it, and a ``--resume`` started it again beside itself. (Linux tells it when the thread that
    started it ends: the runner's, which waits for its tasks.) None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:  # (in the child, between fork and exec)
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (the schedule ended before the call)
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def exit_text(code: int) -> str:
    """A process's exit status in words: a signal's death named (Python's -9 is a shell's 137, "killed by SIGKILL")."""
    if code >= 0:
        return f"exit status {code}"
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name} (exit status {code})"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each task runs in its own process group (start_new_session)
    except ProcessLookupError:
        pass


def task_command(task: Task) -> list[str]:
    """A task's argv: its ``command``, under ``torchrun --nproc-per-node <gpus>`` for a ``torchrun`` task."""
    if task.command is None:
        raise ValueError(f"task {task.id!r} has no `command` to run")
    if task.torchrun:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={task.gpus}", "--standalone",
                *task.command]
    return list(task.command)
