"""`multilora schedule` against its own mistakes: two schedules over one log_dir, a resume over another task file's
records, a stop that loses what ended or leaves a task running, a stop that waits 30 s a task, a failure said only
by its exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from lightning_multilora.scheduling import LocalExecutor, ScheduleRunner, SimulatedExecutor, Task, TaskScheduler
from lightning_multilora.scheduling.task_file import main

PY = sys.executable
# writes its pid (atomically: a rename) to argv[1] and waits
RUN_AND_WAIT = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)")


def write(tmp_path, text: str, name: str = "tasks.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which a container's first process may never reap, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(path, process=None, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline and (process is None or process.poll() is None):
        time.sleep(0.1)
    assert path.exists(), process.communicate(timeout=30)[0] if process is not None else path


def entries(path) -> dict:
    return {e["id"]: e for e in json.loads(path.read_text())["tasks"]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock, and a task that dies with its schedule")
def test_a_second_schedule_over_a_running_ones_log_dir_is_refused_naming_its_pid(tmp_path, capsys, monkeypatch):
    """Nothing stopped a second schedule, or a ``--resume`` of one still running (started with ``nohup``, in another
    terminal), over the same log_dir: it moved the running one's records aside (or took its running tasks for
    stopped ones) and ran tasks twice, the two writing over each other's records. A schedule that runs tasks holds
    ``<log_dir>/.schedule.lock``; a plan or a simulation writes no records and takes none; a schedule killed
    outright (``kill -9``) leaves no stale lock."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # (tasks without GPUs; no torch import to count them)
    log_dir = tmp_path / "logs"
    running = write(tmp_path, f"""\
        gpus: 1
        log_dir: {log_dir}
        tasks:
          - {{id: a, duration: 100, command: [{PY}, -c, "{RUN_AND_WAIT}", {tmp_path / 'a.pid'}]}}
        """, "running.yaml")
    quick = write(tmp_path, f"gpus: 1\nlog_dir: {log_dir}\ntasks: [{{id: b, duration: 1, command: [{PY}, -c, pass]}}]",
                  "quick.yaml")
    first = subprocess.Popen([PY, "-c", f"import sys; from lightning_multilora.scheduling.task_file import main; "
                                        f"sys.exit(main([{str(running)!r}]))"],
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(tmp_path / "a.pid", first)
        task_pid = int((tmp_path / "a.pid").read_text())
        for resume in ([], ["--resume"]):
            with pytest.raises(SystemExit) as exit_info:
                main([str(quick), *resume])
            err = capsys.readouterr().err
            assert exit_info.value.code == 2 and f"{log_dir}: another schedule (PID {first.pid}) is running over " \
                                                  "this log_dir" in err, err
        assert alive(task_pid) and first.poll() is None
        assert list(entries(log_dir / "records.json")) == ["a"] and not (log_dir / "records.1.json").exists()
        assert sorted(p.name for p in (log_dir / "logs").iterdir()) == ["a.1.log"]  # (b never ran)
        assert main([str(quick), "--plan-only"]) == 0 and main([str(quick), "--simulate"]) == 0
        first.kill()  # (kill -9: the kernel lets the lock go)
        first.wait(timeout=30)
        capsys.readouterr()
        assert main([str(quick)]) == 0
        assert f"the earlier run's records kept as {log_dir / 'records.1.json'}" in capsys.readouterr().out
        assert entries(log_dir / "records.json")["b"]["state"] == "finished"
        assert (log_dir / ".schedule.lock").read_text() == ""  # (its PID wiped as it ended)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=30)
        if (tmp_path / "a.pid").exists() and alive(pid := int((tmp_path / "a.pid").read_text())):
            os.kill(pid, signal.SIGKILL)


def test_a_resume_runs_a_task_that_another_task_file_recorded_finished(tmp_path, capsys, monkeypatch):
    """Two task files over the default log_dir with task ids in common: B's run recorded its `lr-big` finished, and
    A's ``--resume`` then skipped A's `lr-big`, which had failed ("every task is finished: nothing to run"). A
    finished record of another definition (`command`, `gpus`, `torchrun`) is not the task's: warned of, naming the
    fields, and run; a `duration` changed alone (an estimate) still skips it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    log_dir, marker = tmp_path / "logs", tmp_path / "ran.txt"

    def task_file(name: str, fails: str, small_duration: int = 1):
        run = (f"import sys; open({str(marker)!r}, 'a').write('{name}:' + sys.argv[1] + ';'); "
               "sys.exit(int(sys.argv[2]))")
        return write(tmp_path, f"""\
            gpus: 1
            max_retries: 0
            log_dir: {log_dir}
            tasks:
              - {{id: lr-small, duration: {small_duration}, command: [{PY}, -c, "{run}", small, "0"]}}
              - {{id: lr-big, duration: 1, command: [{PY}, -c, "{run}", big, "{fails}"]}}
            """, f"{name}.yaml")

    a, b = task_file("A", fails="1"), task_file("B", fails="0")
    assert main([str(a)]) == 1 and main([str(b)]) == 0  # (A's lr-big failed; B ran both)
    capsys.readouterr()
    assert main([str(a), "--resume", "--simulate"]) == 0  # (a simulation's resume says it too: no runner resumes)
    out, err = capsys.readouterr()
    assert "records 0 of the 2 tasks as finished: they do not run again; 2 more as another task, which run: lr-big, " \
           "lr-small" in out, out
    said = f"warning: resume: {log_dir / 'records.json'} records task 'lr-big' as finished, but as another task " \
           "(`command` recorded "
    assert said in err and "'big', '0'], now " in err and "'big', '1']): it runs" in err, err  # (where they differ)
    marker.write_text("")
    assert main([str(a), "--resume"]) == 1  # (A's lr-big fails again: it ran)
    out, err = capsys.readouterr()
    assert marker.read_text() == "A:small;A:big;" and err.count("as finished, but as another task") == 2, (out, err)
    records = entries(log_dir / "records.json")
    assert {t: (e["state"], e["task"]["command"][-2]) for t, e in records.items()} == {
        "lr-small": ("finished", "small"), "lr-big": ("failed", "big")}
    assert "A:" in records["lr-small"]["task"]["command"][2]  # (A's definition recorded now)
    marker.write_text("")
    assert main([str(task_file("A", fails="1", small_duration=7)), "--resume"]) == 1  # (an estimate changed alone)
    out, err = capsys.readouterr()
    assert marker.read_text() == "A:big;" and "records 1 of the 2 tasks as finished" in out
    assert "another task" not in err
    # the runner alone: the same
    path = tmp_path / "runner.json"
    first = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), records=path)
    for task in (Task("x", 1, 1, ["one"]), Task("y", 1, 1, ["same"])):
        first.submit(task)
    first.run()
    resumed = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), records=path, resume=True)
    for task in (Task("x", 1, 1, ["two"]), Task("y", 3, 1, ["same"])):
        resumed.submit(task)
    assert set(resumed.run()) == {"x"} and set(resumed.skipped) == {"y"}
    assert "records task 'x' as finished, but as another task (`command` recorded ['one'], now ['two'])" in \
        capsys.readouterr().err


class SlowReplan(TaskScheduler):
    """Its second plan (a replan) waits for files (written by tasks as they end) and then is interrupted (Ctrl-C): as
    a 1 s replan of many tasks, during which tasks exit."""

    def __init__(self, *args, wait_for, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.wait_for = 0, wait_for

    def plan(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            for path in self.wait_for:
                wait_for(path, seconds=60)
            time.sleep(1.0)  # (their processes have exited by now)
            raise KeyboardInterrupt
        return super().plan(*args, **kwargs)


def test_a_task_that_ended_while_the_schedule_replanned_is_recorded_as_it_ended_on_ctrl_c(tmp_path):
    """Completions were collected in the executor's ``wait`` alone: a task that exited 0 during a replan
    interrupted by Ctrl-C was recorded "stopped", and a ``--resume`` ran it again. Those ended are recorded as they
    ended (a failure with retries left: stopped waiting for its retry), then the rest are stopped."""
    ends = [tmp_path / "quick.done", tmp_path / "bad.done"]
    tasks = [Task("short", 1, 1, [PY, "-c", "pass"]),  # (its end brings the replan)
             Task("quick", 1, 1, [PY, "-c", f"import time; time.sleep(1); open({str(ends[0])!r}, 'w').close()"]),
             Task("bad", 1, 1, [PY, "-c", f"import time; time.sleep(1); open({str(ends[1])!r}, 'w').close(); "
                                          "raise SystemExit(4)"]),
             Task("long", 5, 1, [PY, "-c", "import time; time.sleep(60)"]),
             Task("after", 5, 4, [PY, "-c", "pass"])]  # (waits for the GPUs of all: a replan at each end)
    path = tmp_path / "records.json"
    runner = ScheduleRunner(SlowReplan(4, time_limit_s=2, wait_for=ends), LocalExecutor(tmp_path / "logs"),
                            max_retries=1, records=path)
    for task in tasks:
        runner.submit(task)
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    records = entries(path)
    assert (records["quick"]["state"], records["quick"]["exit_code"]) == ("finished", 0), records["quick"]
    assert records["bad"]["state"] == "stopped" and "stopped waiting for a retry" in records["bad"]["detail"]
    assert "exit status 4" in records["bad"]["detail"]
    assert records["long"]["state"] == "stopped" and records["long"]["exit_code"] == -signal.SIGTERM
    assert runner.stopped_running == ["long"]


def test_a_stop_gives_every_task_one_grace_period_then_kills_the_rest_and_says_so(tmp_path, capsys, monkeypatch):
    """A task ignoring SIGTERM was waited for 30 s, then the next one 30 s, and so on (N x 30 s), with nothing
    said: one deadline for all of them, said as the wait begins, then SIGKILL. A stop cut short (a second Ctrl-C)
    and asked again keeps its deadline (the schedule's second stop waited 30 s more)."""
    import re
    import types

    from lightning_multilora.scheduling import executors

    executor = LocalExecutor(tmp_path / "logs")
    executor.stop_timeout_s = 1.0
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1], 'w').close(); time.sleep(120)")
    for name in ("s1", "s2", "s3"):
        executor.start(Task(name, 100, 1, [PY, "-c", stubborn, str(tmp_path / name)]), (0,))
    for name in ("s1", "s2", "s3"):
        wait_for(tmp_path / name, seconds=60)
    pids = [proc.pid for proc, _, _ in executor._procs.values()]
    cut: list = []

    def sleep_cut_short(seconds):  # (a second Ctrl-C as the stop waits)
        if not cut:
            cut.append(seconds)
            raise KeyboardInterrupt
        time.sleep(seconds)

    monkeypatch.setattr(executors, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep_cut_short))
    stopped: list = []

    def stop_twice():
        try:
            executor.stop()
        except KeyboardInterrupt:
            pass
        stopped.extend(executor.stop())

    began = time.monotonic()
    stopping = threading.Thread(target=stop_twice, daemon=True)
    stopping.start()
    stopping.join(timeout=10)
    took = time.monotonic() - began
    if stopping.is_alive():  # (not left behind by a failing test)
        for pid in pids:
            os.killpg(pid, signal.SIGKILL)
        stopping.join(timeout=30)
    assert took < 6, f"stop took {took:.1f} s"
    out = capsys.readouterr().out
    assert "stopping 3 tasks: SIGTERM sent, SIGKILL in 1 s\n" in out and cut, out
    assert re.search(r"^still stopping 3 tasks: SIGKILL in [01] s$", out, re.M), out
    assert sorted((c.task_id, c.exit_code) for c in stopped) == [(t, -signal.SIGKILL) for t in ("s1", "s2", "s3")]
    assert not any(alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork-exec Popen")
def test_a_ctrl_c_inside_popen_leaves_no_task_running(tmp_path, monkeypatch):
    """Ctrl-C landing while ``Popen`` waited for its forked child's exec (tens of ms for a process holding torch): the
    child ran, but the executor never knew it, and the stop neither stopped nor waited for it."""
    real = subprocess._fork_exec
    children = []

    def fork_exec(*args, **kwargs):
        pid = real(*args, **kwargs)
        children.append(pid)
        os.kill(os.getpid(), signal.SIGINT)  # (Ctrl-C, after the fork; its handler runs at the next bytecode)
        return pid

    monkeypatch.setattr(subprocess, "_fork_exec", fork_exec)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs"), records=tmp_path / "r.json")
        runner.submit(Task("t", 5, 1, [PY, "-c", "import time; time.sleep(60)"]))
        with pytest.raises(KeyboardInterrupt):
            runner.run()
    finally:
        signal.signal(signal.SIGINT, previous)
        monkeypatch.undo()
    try:
        running = alive(children[0])
        assert not running, "the task's process outlived the stop"
        record = entries(tmp_path / "r.json")["t"]
        assert record["state"] == "stopped" and record["exit_code"] == -signal.SIGTERM
    finally:
        if alive(children[0]):
            os.killpg(children[0], signal.SIGKILL)


def test_a_failed_tasks_record_says_the_last_line_of_its_log(tmp_path):
    """A failure said "exit status 1, log ...": its error is in the record (and the table) too."""
    runner = ScheduleRunner(TaskScheduler(1), LocalExecutor(tmp_path / "logs"), max_retries=0)
    runner.submit(Task("bad", 1, 1, [PY, "-c", "print('working'); raise RuntimeError('boom')"]))
    record = runner.run()["bad"]
    assert record.detail == f"exit status 1, log {tmp_path / 'logs' / 'bad.1.log'}; its log ends: RuntimeError: boom"
    from lightning_multilora.scheduling.executors import last_line

    (tmp_path / "empty.log").write_text("")
    (tmp_path / "bar.log").write_text("step 1\n 10%\r 50%\r 90% \r\n\n  \n")
    (tmp_path / "long.log").write_text("x" * 500 + "\n")
    assert last_line(tmp_path / "empty.log") == "" and last_line(tmp_path / "nothing.log") == ""
    assert last_line(tmp_path / "bar.log") == "90%" and last_line(tmp_path / "long.log") == "x" * 200 + "..."


def test_a_resume_counts_the_finished_tasks_an_inbox_added(tmp_path, capsys, monkeypatch):
    """After a run whose inbox added tasks, ``--resume`` said "records 0 of the 1 tasks as finished" of a run whose
    every task had finished, an inbox's among them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    log_dir = tmp_path / "logs"
    path = write(tmp_path, f"gpus: 1\nlog_dir: {log_dir}\ntasks: [{{id: a, duration: 1, command: [{PY}, -c, pass]}}]")
    entry = {"state": "finished", "attempts": 1, "start": 0.0, "end": 1.0, "starts": [0.0], "gpu_ids": [0],
             "exit_code": 0, "log": None, "detail": "", "run_started_at": "2026-01-01T10:00:00+00:00"}
    defined = {"duration": 1.0, "gpus": 1, "torchrun": False}
    tasks = [dict(entry, id="a", task=dict(defined, command=[PY, "-c", "pass"]))]
    tasks += [dict(entry, id=t, added=True, task=dict(defined, command=["true"])) for t in ("x", "y")]
    log_dir.mkdir()
    (log_dir / "records.json").write_text(json.dumps({"format": 1, "started_at": "", "tasks": tasks}))
    assert main([str(path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "records 3 of the 3 tasks as finished (2 of them added by an inbox): they do not run again" in out, out
    assert "every task is finished: nothing to run" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock")
def test_a_schedule_refused_after_taking_its_lock_leaves_no_log_dir_it_made(tmp_path, capsys, monkeypatch):
    """A schedule refused once it held its log_dir (more `gpus` than CUDA_VISIBLE_DEVICES gives) left the folder,
    and the parents made for it, holding only an empty ``.schedule.lock``; a log_dir that was there is kept."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for log_dir, kept in ((tmp_path / "new" / "deeper" / "logs", tmp_path), (tmp_path / "there", tmp_path / "there")):
        if kept == log_dir:
            log_dir.mkdir()
        tasks = write(tmp_path, f"gpus: 2\nlog_dir: {log_dir}\ntasks: [{{id: a, duration: 1, command: [{PY}, -c, "
                                f"pass]}}]")
        with pytest.raises(SystemExit) as exit_info:
            main([str(tasks)])
        assert exit_info.value.code == 2
        assert "`gpus` is 2, but CUDA_VISIBLE_DEVICES=0 gives 1" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.yaml"] + ["there"] * (kept == log_dir)
        if kept == log_dir:
            assert [p.name for p in log_dir.iterdir()] == [".schedule.lock"]  # (its folder: kept as it was given)
