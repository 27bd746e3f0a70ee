"""LocalExecutor: real subprocesses on their GPU sets through the ScheduleRunner, on the CPU."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_multilora.scheduling import LocalExecutor, ScheduleRunner, SimulatedExecutor, Task, TaskScheduler

RECORD_GPUS = "import os, sys, time; open(sys.argv[1], 'w').write(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(0.3)"
FLAKY = ("import os, sys; m = sys.argv[1]; first = not os.path.exists(m); open(m, 'a').close(); "
         "sys.exit(3 if first else 0)")


def tiny_training_config(tmp_path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(textwrap.dedent(f"""\
        seed_everything: 0
        trainer:
          accelerator: cpu
          devices: 1
          default_root_dir: {tmp_path / 'run'}
          enable_progress_bar: false
          enable_model_summary: false
          limit_val_batches: 0
        model:
          base_model: tiny-llama
          adapters:
            - {{name: only, rank: 2, batch_size: 2, max_steps: 2}}
          validate_on_finish: false
        data:
          sources:
            arithmetic:
              class_path: lightning_multilora.data.GeneratedArithmetic
              init_args: {{num_examples: 40}}
        """))
    return str(path)


def test_three_tiny_tasks_run_as_subprocesses_on_their_gpus_with_a_retried_failure(tmp_path):
    py = sys.executable
    tasks = [
        Task("train", 20.0, 1, [py, "-m", "lightning_multilora.cli", "fit", "--config", tiny_training_config(tmp_path)]),
        Task("pair", 1.0, 2, [py, "-c", RECORD_GPUS, str(tmp_path / "pair.gpus")]),
        Task("flaky", 1.0, 1, [py, "-c", FLAKY, str(tmp_path / "flaky.marker")]),
    ]
    executor = LocalExecutor(tmp_path / "logs")
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5), executor, max_retries=1)
    for task in tasks:
        runner.submit(task)
    records = runner.run()
    assert {r.task_id: r.state for r in records.values()} == {"train": "finished", "pair": "finished",
                                                             "flaky": "finished"}
    assert records["flaky"].attempts == 2 and (tmp_path / "logs" / "flaky.1.log").exists()
    pair = records["pair"]
    assert (tmp_path / "pair.gpus").read_text() == ",".join(map(str, pair.gpu_ids)) and len(pair.gpu_ids) == 2
    # the 2-GPU task never overlapped a 1-GPU task on two GPUs
    train = records["train"]
    assert pair.end <= train.start + 1e-6 or train.end <= pair.start + 1e-6
    assert list((tmp_path / "run").rglob("adapter_model.safetensors"))  # the training task really trained


def test_a_task_that_keeps_failing_is_marked_failed_with_its_log(tmp_path):
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path), max_retries=1)
    runner.submit(Task("bad", 1.0, 1, [sys.executable, "-c", "raise SystemExit(2)"]))
    record = runner.run()["bad"]
    assert record.state == "failed" and record.attempts == 2 and "exit status 2" in record.detail
    # a death by a signal is named (Python's -9 read as an exit status, not the shell's 137 or a signal's name)
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "killed"), max_retries=0)
    runner.submit(Task("killed", 1.0, 1, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                                                                  "signal.SIGKILL)"]))
    killed = runner.run()["killed"]
    assert killed.detail.startswith("killed by SIGKILL (exit status -9), log ") and killed.exit_code == -9
    # a second schedule over the same log folder numbers its logs on: the first one's are kept
    (tmp_path / "bad.1.log").write_text("kept")
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path), max_retries=0)
    runner.submit(Task("bad", 1.0, 1, [sys.executable, "-c", "raise SystemExit(2)"]))
    assert runner.run()["bad"].state == "failed"
    assert sorted(p.name for p in tmp_path.glob("bad.*.log")) == ["bad.1.log", "bad.2.log", "bad.3.log"]
    assert (tmp_path / "bad.1.log").read_text() == "kept"


def test_a_running_schedule_accepts_new_tasks_and_tasks_need_commands(tmp_path):
    inbox = [[Task("late", 2.0, 1)]]
    polls = {"n": 0}

    def poll():
        polls["n"] += 1
        return inbox.pop() if polls["n"] == 2 and inbox else []  # arrives while "first" runs

    runner = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), poll=poll)
    runner.submit(Task("first", 5.0, 1))
    records = runner.run()
    assert set(records) == {"first", "late"} and records["late"].start >= records["first"].end
    with pytest.raises(ValueError, match="has no `command`"):
        LocalExecutor(tmp_path).start(Task("x", 1.0), (0,))
    with pytest.raises(ValueError, match="`command` must not be empty"):
        Task("y", 1.0, 1, [])
    for blank in ([""], ["  ", "train.py"], "'' train.py"):  # (no program: it failed as the task started)
        with pytest.raises(ValueError, match=r"task 'y': `command` must start with a program to run, got '\s*' first"):
            Task("y", 1.0, 1, blank)
    assert Task("z", 1.0, 1, "python -c 'print(1)'").command == ("python", "-c", "print(1)")


def test_a_missing_program_is_a_failed_attempt_and_stop_ends_running_tasks(tmp_path):
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path), max_retries=1)
    runner.submit(Task("ghost", 1.0, 1, ["/no/such/program"]))
    record = runner.run()["ghost"]
    assert record.state == "failed" and record.attempts == 1 and "could not start" in record.detail  # (was retried)
    assert "No such file or directory: '/no/such/program' (not retried)" in record.detail
    executor = LocalExecutor(tmp_path)
    executor.start(Task("sleeper", 1.0, 1, [sys.executable, "-c", "import time; time.sleep(60)"]), (0,))
    executor.stop()
    assert executor.wait(0.0) == []  # nothing left running


def test_a_bare_program_is_found_beside_this_python_and_one_found_nowhere_is_not_retried(tmp_path):
    """``.venv/bin/multilora schedule`` (the environment not activated) started no ``multilora fit`` task: "No such
    file or directory: 'multilora'", tried three times in 0.1 s."""
    import os

    stamp = tmp_path / "ran"
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs", env={"PATH": os.devnull}),
                            max_retries=2)
    program = os.path.basename(sys.executable)  # (beside this Python, as a venv's multilora is; on no PATH here)
    runner.submit(Task("found", 1.0, 1, [program, "-c", f"open({str(stamp)!r}, 'w').write('yes')"]))
    runner.submit(Task("ghost", 1.0, 1, ["no-such-program-anywhere", "--help"]))
    records = runner.run()
    assert records["found"].state == "finished" and stamp.read_text() == "yes"
    ghost = records["ghost"]
    assert ghost.state == "failed" and ghost.attempts == 1, ghost
    # (a script on PATH whose interpreter is gone, a moved virtual environment's: said so, not "not on PATH")
    (tmp_path / "bin").mkdir()
    moved = tmp_path / "bin" / "moved-tool"
    moved.write_text("#!/no/such/python\n")
    moved.chmod(0o755)
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs2", env={"PATH": str(tmp_path / "bin")}))
    runner.submit(Task("moved", 1.0, 1, ["moved-tool"]))
    record = runner.run()["moved"]
    assert record.attempts == 1 and "'moved-tool' (on PATH) could not be run" in record.detail, record.detail
    assert ("could not start: no program 'no-such-program-anywhere' on PATH, nor beside this Python" in ghost.detail
            and "(not retried)" in ghost.detail)


def test_the_schedules_gpus_are_the_visible_ones_in_order(tmp_path):
    # the runner's GPU i is the i-th of the CUDA_VISIBLE_DEVICES the executor was given, not the machine's GPU i
    py = sys.executable
    executor = LocalExecutor(tmp_path / "logs", env={"CUDA_VISIBLE_DEVICES": "5, GPU-7f"})
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5), executor, max_retries=0)
    runner.submit(Task("pair", 1.0, 2, [py, "-c", RECORD_GPUS, str(tmp_path / "pair.gpus")]))
    runner.submit(Task("one", 1.0, 1, [py, "-c", RECORD_GPUS, str(tmp_path / "one.gpus")]))
    records = runner.run()
    assert {r.state for r in records.values()} == {"finished"}
    assert (tmp_path / "pair.gpus").read_text() == "5,GPU-7f"
    assert (tmp_path / "one.gpus").read_text() == ["5", "GPU-7f"][records["one"].gpu_ids[0]]
    # a GPU id past them: a failed start (the runner retries or fails the task), no crash
    narrow = LocalExecutor(tmp_path / "logs", env={"CUDA_VISIBLE_DEVICES": "3"})
    narrow.start(Task("far", 1.0, 1, [py, "-c", "pass"]), (1,))
    (completion,) = narrow.wait(None)
    assert not completion.ok and "GPUs [1] asked for, but CUDA_VISIBLE_DEVICES gives 1" in completion.detail


def test_an_empty_cuda_visible_devices_gives_the_tasks_no_gpu(tmp_path):
    py = sys.executable
    executor = LocalExecutor(tmp_path / "logs", env={"CUDA_VISIBLE_DEVICES": ""})
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5), executor, max_retries=0)
    runner.submit(Task("pair", 1.0, 2, [py, "-c", RECORD_GPUS, str(tmp_path / "pair.gpus")]))
    assert runner.run()["pair"].state == "finished"
    assert (tmp_path / "pair.gpus").read_text() == ""  # not the machine's GPUs 0 and 1


@pytest.mark.parametrize("value, visible", [("-1", []), ("0,-1,2", ["0"]), (" 3 , 5 ", ["3", "5"]), ("", []),
                                            ("GPU-8f2c,MIG-1a", ["GPU-8f2c", "MIG-1a"])])
def test_cuda_visible_devices_ends_at_its_first_negative_index(value, visible):
    from lightning_multilora.scheduling.executors import visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == visible


def test_a_log_name_the_file_system_refuses_is_a_failed_start(tmp_path, monkeypatch):
    """`next_log_path` raising OSError (a name too long, ENAMETOOLONG) escaped `start`: the schedule crashed."""
    from lightning_multilora.scheduling import executors

    def too_long(log_dir, task_id, attempts):
        raise OSError(36, "File name too long", str(log_dir / f"{task_id}.1.log"))

    monkeypatch.setattr(executors, "next_log_path", too_long)
    executor = LocalExecutor(tmp_path / "logs")
    executor.start(Task("a", 1.0, 1, [sys.executable, "-c", "pass"]), (0,))
    (completion,) = executor.wait(None)
    assert not completion.ok and "could not open its log: [Errno 36] File name too long" in completion.detail


# each attempt appends "<task id> <attempt>" to the file; the first one fails
TELL_ATTEMPT = ("import os, sys; m = sys.argv[1]; first = not os.path.exists(m); "
                "open(m, 'a').write(os.environ['MULTILORA_TASK_ID'] + ' ' + os.environ['MULTILORA_TASK_ATTEMPT'] "
                "+ '\\n'); sys.exit(3 if first else 0)")


def test_a_tasks_command_is_told_its_id_and_attempt(tmp_path):
    """``MULTILORA_TASK_ID`` and ``MULTILORA_TASK_ATTEMPT`` (from 1): a retried `multilora fit` can tell its own
    checkpoints and its retry from a first start. The record keeps the exit status and the log."""
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs"), max_retries=1)
    runner.submit(Task("flaky", 1.0, 1, [sys.executable, "-c", TELL_ATTEMPT, str(tmp_path / "said")]))
    record = runner.run()["flaky"]
    assert (tmp_path / "said").read_text() == "flaky 1\nflaky 2\n"
    assert (record.state, record.exit_code, record.log) == ("finished", 0, str(tmp_path / "logs" / "flaky.2.log"))
    # started without a runner, an executor numbers a task's starts itself
    executor = LocalExecutor(tmp_path / "alone")
    task = Task("alone", 1.0, 1, [sys.executable, "-c", TELL_ATTEMPT, str(tmp_path / "alone.said")])
    for _ in range(2):
        executor.start(task, (0,))
        while not executor.wait(None):
            pass
    assert (tmp_path / "alone.said").read_text() == "alone 1\nalone 2\n"


def test_a_run_that_raises_stops_its_subprocesses(tmp_path):
    """`run` raising (here its ``poll``) left the started tasks running (`sleep` outlived the schedule): they are
    stopped, and recorded "stopped" with their exit status (the signal) and log."""
    import os

    pid_file = tmp_path / "pid"
    sleeper = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                     "time.sleep(60)"]

    def poll():
        if pid_file.exists() and pid_file.read_text():
            raise RuntimeError("the inbox broke")
        return []

    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs"), poll=poll, poll_s=0.05)
    runner.submit(Task("sleeper", 60, 1, sleeper))
    with pytest.raises(RuntimeError, match="the inbox broke"):
        runner.run()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    record = runner.records["sleeper"]
    assert record.state == "stopped" and record.exit_code == -15 and record.log.endswith("sleeper.1.log")


def test_a_tasks_processes_left_when_its_own_exits_are_ended_as_it_completes(tmp_path):
    """A multi-process task whose main process died (rank 0 killed) left its other ranks running, orphaned, as its
    retry started on the same GPUs (NCCL ranks wait for a lost peer up to the process group's timeout): they get
    SIGTERM as the task completes (and SIGKILL after `group_grace_s`; `stop` at once)."""
    termed = tmp_path / "termed"
    left = ("import signal, sys, time; "
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(termed)!r}, 'w').write('yes'), sys.exit(0))); "
            "time.sleep(60)")
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {left!r}]); time.sleep(1); "
              "sys.exit(3)")
    executor = LocalExecutor(tmp_path / "logs", env={"CUDA_VISIBLE_DEVICES": "0"})
    executor.start(Task("ranks", 1.0, 1, [sys.executable, "-c", script]), (0,))
    done = []
    while not done:
        done = executor.wait(executor.now() + 5)
    assert (done[0].task_id, done[0].ok, done[0].exit_code) == ("ranks", False, 3)
    assert termed.read_text() == "yes"  # (completed once what it left is gone: its GPUs busy until then)


LEFT_BEHIND = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "open({pid!r}, 'w').write(str(os.getpid())); time.sleep(60)")


def test_a_task_completes_once_what_it_left_is_gone_even_where_that_ignores_sigterm(tmp_path):
    """A task's leftover processes were sent SIGTERM as it completed, and its GPUs went to the next task (or its
    retry) at once, the leftovers (an NCCL rank that cannot run its handler) holding the GPUs' memory until their
    SIGKILL `group_grace_s` later. The task completes once they are gone: killed, where they ignore SIGTERM."""
    import time

    pid = tmp_path / "left.pid"
    left = LEFT_BEHIND.format(pid=str(pid))
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {left!r}]); time.sleep(1); "
              "sys.exit(0)")
    executor = LocalExecutor(tmp_path / "logs")
    executor.group_grace_s = 0.5
    executor.start(Task("ranks", 1.0, 1, [sys.executable, "-c", script]), (0,))
    done, began = [], time.monotonic()
    while not done:
        done = executor.wait(executor.now() + 5)
    assert (done[0].task_id, done[0].ok, done[0].exit_code) == ("ranks", True, 0)
    assert time.monotonic() - began >= 1.4  # (its own second, then the leftover's half second of grace)
    try:  # (gone, or a zombie no one reaps: a container whose first process does not)
        state = Path(f"/proc/{pid.read_text()}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z") and "outlived" not in done[0].detail


@pytest.mark.parametrize("code", [0, 3])
def test_a_stop_while_a_tasks_leftovers_drain_records_the_task_as_it_ended(tmp_path, code):
    """A task whose own process had exited while what it left was being stopped: a stop then (Ctrl-C) gave those
    leftovers no grace (SIGKILL at once) and would record the task "stopped" (run again by a resume). They get their
    grace, and the task is recorded as it ended: finished, or its failure said where a retry was due."""
    pid = tmp_path / "left.pid"
    left = LEFT_BEHIND.format(pid=str(pid))
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {left!r}]); time.sleep(0.5); "
              f"print('boom'); sys.exit({code})")
    executor = LocalExecutor(tmp_path / "logs")
    executor.group_grace_s = 1.0

    def poll():
        if executor._draining:  # (its own process exited: what it left is being stopped)
            raise KeyboardInterrupt
        return []

    runner = ScheduleRunner(TaskScheduler(1), executor, poll=poll, poll_s=0.05, max_retries=1)
    runner.submit(Task("done", 1.0, 1, [sys.executable, "-c", script]))
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    record = runner.records["done"]
    if code == 0:
        assert (record.state, record.exit_code) == ("finished", 0) and runner.stopped_running == []
    else:
        assert record.state == "stopped" and re.fullmatch(
            r"stopped waiting for a retry \(interrupted\) after: exit status 3, log .*done\.1\.log; its log ends: "
            r"boom", record.detail), record.detail


def test_a_stop_kills_what_a_stopped_task_left(tmp_path):
    """A running task's own process exited on the stop's SIGTERM, a process it started (a rank stuck in NCCL)
    ignoring it: the stop returned and left that process running, orphaned. It gets its grace, then SIGKILL."""
    import time

    pid = tmp_path / "left.pid"
    left = LEFT_BEHIND.format(pid=str(pid))
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {left!r}]); time.sleep(60)"
    executor = LocalExecutor(tmp_path / "logs")
    executor.group_grace_s = 0.5
    executor.start(Task("ranks", 60.0, 1, [sys.executable, "-c", script]), (0,))
    while not pid.exists() or not pid.read_text():
        time.sleep(0.05)
    (stopped,) = executor.stop()
    assert stopped.task_id == "ranks" and not stopped.ok
    try:
        state = Path(f"/proc/{pid.read_text()}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")



def test_a_stop_records_a_task_that_exited_before_it_as_it_ended(tmp_path):
    """A task whose process exited (0) after the runner's last `wait` and before the executor's stop (the records
    written between them, a Ctrl-C) was returned "stopped" with exit status 0: recorded stopped, run again by a
    resume. Its end is returned as it ended."""
    import time

    executor = LocalExecutor(tmp_path / "logs")
    executor.start(Task("quick", 1.0, 1, [sys.executable, "-c", "print('done')"]), (0,))
    executor.start(Task("slow", 60.0, 1, [sys.executable, "-c", "import time; time.sleep(60)"]), (1,))
    while executor._procs["quick"][0].poll() is None:
        time.sleep(0.02)
    stopped = {done.task_id: done for done in executor.stop()}
    assert (stopped["quick"].ok, stopped["quick"].exited, stopped["quick"].exit_code) == (True, True, 0)
    assert (stopped["slow"].ok, stopped["slow"].exited) == (False, False)
    assert stopped["slow"].detail.startswith("stopped, log ")


def test_a_ctrl_c_as_wait_collects_an_end_keeps_it(tmp_path, monkeypatch):
    """A Ctrl-C (KeyboardInterrupt, between two bytecodes) after `wait` collected a task's exit and before it returned
    it (scanning /proc for what the task left) lost that end: the stop then recorded the task "stopped", and a resume
    ran it again. The end is kept, and the stop records the task finished."""
    executor = LocalExecutor(tmp_path / "logs")
    drain_step, fired = executor._drain_step, []

    def interrupted(kill=False):
        drain_step(kill)
        if executor._started and not executor._procs and not fired:  # (its exit collected, not yet returned)
            fired.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(executor, "_drain_step", interrupted)
    runner = ScheduleRunner(TaskScheduler(1), executor, records=tmp_path / "records.json")
    runner.submit(Task("quick", 1.0, 1, [sys.executable, "-c", "print('done')"]))
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert fired and (runner.records["quick"].state, runner.records["quick"].exit_code) == ("finished", 0)
    assert runner.stopped_running == []


def test_a_stop_asked_again_records_the_tasks_the_first_one_stopped_as_stopped(tmp_path, monkeypatch):
    """A stop cut short (a second Ctrl-C in its wait) and asked again: a task that exited 0 on the first stop's
    SIGTERM (it traps it) was stopped, not ended on its own; taken for an end, a resume would skip it."""
    import time

    executor = LocalExecutor(tmp_path / "logs")
    executor.start(Task("traps", 60.0, 1, ["sh", "-c", "trap 'exit 0' TERM; sleep 30 & wait"]), (0,))
    time.sleep(0.3)  # (its trap set)
    sleep, cut = time.sleep, []

    def cut_short(seconds):
        if not cut:
            cut.append(seconds)
            raise KeyboardInterrupt
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", cut_short)
    with pytest.raises(KeyboardInterrupt):
        executor.stop()
    monkeypatch.setattr(time, "sleep", sleep)
    while executor._procs["traps"][0].poll() is None:
        time.sleep(0.02)
    (stopped,) = executor.stop()
    assert (stopped.task_id, stopped.ok, stopped.exited, stopped.exit_code) == ("traps", False, False, 0)
    assert stopped.detail.startswith("stopped, log ")
