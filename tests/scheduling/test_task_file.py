"""`multilora schedule tasks.yaml`: parsing, clear errors, plan + Gantt chart, simulated and real runs."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from lightning_multilora.cli import main as cli_main
from lightning_multilora.scheduling.task_file import load_task_file, main


def write(tmp_path, text: str, name: str = "tasks.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


ALTO_MIX = """\
    gpus: 8
    log_dir: {log_dir}
    tasks:
      - {{id: llama70b-a, duration: 300, gpus: 4}}
      - {{id: llama70b-b, duration: 240, gpus: 4}}
      - {{id: qwen32b-a, duration: 200, gpus: 2}}
      - {{id: qwen32b-b, duration: 180, gpus: 2}}
      - {{id: llama8b-a, duration: 120, gpus: 1}}
      - {{id: llama8b-b, duration: 100, gpus: 1}}
      - {{id: qwen7b, duration: 90, gpus: 1}}
    """


def test_plan_only_prints_the_plan_and_draws_the_gantt_chart(tmp_path, capsys):
    path = write(tmp_path, ALTO_MIX.format(log_dir=tmp_path / "logs"))
    assert main([str(path), "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "llama70b-a" in out and "makespan" in out and "optimal" in out
    assert (tmp_path / "logs" / "plan.png").stat().st_size > 1000
    first = (tmp_path / "logs" / "plan.png").read_bytes()
    assert main([str(path), "--plan-only"]) == 0  # a rerun over the same log_dir keeps the earlier chart
    assert (tmp_path / "logs" / "plan.png").read_bytes() == first and (tmp_path / "logs" / "plan.1.png").exists()


def test_a_simulated_run_through_the_multilora_command(tmp_path, capsys):
    path = write(tmp_path, ALTO_MIX.format(log_dir=tmp_path / "logs"))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["schedule", str(path), "--simulate"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("finished") == 7 and (tmp_path / "logs" / "run.png").exists()
    with pytest.raises(SystemExit):
        cli_main(["schedule", str(path), "--simulate"])
    assert {p.name for p in (tmp_path / "logs").glob("*.png")} == {"plan.png", "run.png", "plan.1.png", "run.1.png"}


def test_a_real_run_accepts_tasks_dropped_into_the_inbox(tmp_path, capsys):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    py = sys.executable
    staged = write(tmp_path, f"tasks: [{{id: late, duration: 1, command: [{py}, -c, 'print(2)']}}]", "staged.yaml")
    # the first task drops a new task file into the inbox while the schedule runs
    drop = f"import shutil, time; shutil.copy('{staged}', '{inbox / 'new.yaml'}'); time.sleep(0.5)"
    path = write(tmp_path, f"""\
        gpus: 1
        resolution_s: 0.5
        log_dir: {tmp_path / 'logs'}
        tasks:
          - {{id: first, duration: 1, command: [{py}, -c, "{drop}"]}}
        """)
    assert main([str(path), "--inbox", str(inbox)]) == 0
    out = capsys.readouterr().out
    assert "late" in out and out.count("finished") == 2
    assert (inbox / "new.yaml.done").exists()


@pytest.mark.parametrize("body, message", [
    ("gpus: 2\ntasks: [{id: a, duration: -5}]", "`duration` must be a finite number > 0"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, gpus: 4}]", "needs 4 GPUs but only 2 exist"),
    ("gpus: 2\ntasks: [{id: a, duration: 5}, {id: a, duration: 3}]", "duplicate task id 'a'"),
    ("gpus: 0\ntasks: [{id: a, duration: 5}]", "`gpus` must be an integer >= 1"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, memory: 3}]", "unknown fields \\['memory'\\]"),
    ("gpus: 2\ntasks: []", "`tasks` must be a non-empty list"),
    ("gpus: 2\nworkers: 3\ntasks: [{id: a, duration: 5}]", "unknown fields \\['workers'\\]"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, command: 123}]", "`command` must be a string or a list of arguments"),
    # (split into words and run without a shell, these ran `echo` with '>' and 'out.txt' as arguments, "finished")
    ("gpus: 2\ntasks: [{id: a, duration: 5, command: 'echo $HOME > out.txt'}]", "task 'a': `command` 'echo \\$HOME "
     "> out.txt' uses shell syntax \\('\\$'\\), but a command string is split into words and run without a shell; "
     "to run it in one, write the command as a list: \\[sh, -c, 'echo \\$HOME > out.txt'\\]"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, command: 'mkdir -p sub && touch sub/made'}]", "uses shell syntax "
     "\\('&'\\)"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, command: 'OMP_NUM_THREADS=1 python t.py'}]", "uses shell syntax "
     "\\('OMP_NUM_THREADS=...'\\)"),  # (an environment variable: run as a program named OMP_NUM_THREADS=1)
    ("gpus: 2\ntasks:\n  - id: a\n    duration: 5\n    command: |\n      python a.py\n      python b.py\n",
     "uses shell syntax \\('line break'\\)"),  # (the second line ran as the first one's arguments, "finished")
    ("gpus: 2\ntasks: [{id: a, duration: 5, torchrun: 'false'}]", "`torchrun` must be true or false, got 'false'"),
    ("gpus: 2\ntasks: [{id: a, duration: 5, gpus: true}]", "`gpus` must be an integer >= 1, got True"),
    ("gpus: 2\ntasks: [{id: a, duration: true}]", "`duration` must be a finite number > 0, got True"),
    ("gpus: 2\ntasks: [{id: , duration: 5}]", "task `id` must be letters, digits, .* got None"),
    ("gpus: 2\ntasks: [{id: ../../escaped, duration: 5}]", "task `id` must be letters, digits, '.', '_' and '-', "
     "starting with a letter or digit \\(it names the task's log files\\), got '../../escaped'"),
    ("gpus: 2\ntasks: [{id: a/b, duration: 5}]", "task `id` must be .* got 'a/b'"),
    ("gpus: true\ntasks: [{id: a, duration: 5}]", "`gpus` must be an integer >= 1, got True"),
    ("gpus: 2\ntime_limit_s: fast\ntasks: [{id: a, duration: 5}]", "`time_limit_s` must be a number of seconds > 0"),
    ("gpus: 2\nresolution_s: 0\ntasks: [{id: a, duration: 5}]", "`resolution_s` must be a number of seconds > 0"),
    ("gpus: 2\ntime_limit_s: 1e-9\ntasks: [{id: a, duration: 5}]", "got '1e-9' \\(text: YAML reads an exponent as a "
     "number only with a dot and a signed exponent; write 1.0e-09\\)"),
    ("gpus: 2\ntasks: [{id: a, duration: 3e2}]", "got '3e2' \\(text: YAML reads an exponent .*; write 300.0\\)"),
    # (YAML's base 60: a plan of 90 s for an hour and a half)
    ("gpus: 2\ntasks: [{id: a, duration: 1:30}]", "`duration: 1:30` is YAML's base-60 number 90, not hours and "
     "minutes: give it in seconds"),
    ("gpus: 2\ntime_limit_s: 1:00\ntasks: [{id: a, duration: 5}]", "`time_limit_s: 1:00` is YAML's base-60 number "
     "60"),
    ("gpus: 2\nmax_retries: -1\ntasks: [{id: a, duration: 5}]", "`max_retries` must be an integer >= 0"),
    ("gpus: 2\ndeterministic: yes please\ntasks: [{id: a, duration: 5}]", "`deterministic` must be true or false, "
     "got 'yes please'"),
    ("gpus: 2\nmax_retries: 1.7\ntasks: [{id: a, duration: 5}]", "`max_retries` must be an integer >= 0"),
    ("gpus: 2\nlog_dir:\ntasks: [{id: a, duration: 5}]", "`log_dir` must be a directory path, got None"),
    ("gpus: 2\ntasks: [{id: a, duration: 5}", "(?s)not valid YAML: .*line 2"),  # (the parser's message named no file)
])
def test_bad_task_files_get_clear_errors(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ValueError, match=message) as raised:
        load_task_file(path)
    assert str(raised.value).startswith(f"{path}: ")  # which file


def test_the_command_line_reports_bad_files_and_missing_commands(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(write(tmp_path, "gpus: 1\ntasks: [{id: a, duration: -1}]"))])
    assert "`duration` must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, command: [echo]}}, "
                                  "{id: b, duration: 1}]"))])
    assert "every task needs a `command` to run (or use --simulate / --plan-only); tasks ['b'] have none" in \
        capsys.readouterr().err
    for path, said in ((tmp_path / "nope.yaml", "No such file or directory"),  # (it said "[Errno 2] ...:
                       (tmp_path, "Is a directory (give the YAML file of the tasks)")):  # 'nope.yaml'", no more)
        with pytest.raises(SystemExit):
            main([str(path)])
        assert f"error: task file {str(path)!r}: {said}" in capsys.readouterr().err


def test_bad_inbox_files_are_rejected_and_the_schedule_goes_on(tmp_path, capsys):
    from lightning_multilora.scheduling.task_file import inbox_poller

    inbox = tmp_path / "inbox"
    poll = inbox_poller(inbox, 2, known=lambda: {"taken"}, need_command=True)
    (inbox / "a.yaml").write_text("tasks: [{id: ok, duration: 1, command: [echo]}]")
    (inbox / "b.yaml").write_text("tasks: [{id: taken, duration: 1, command: [echo]}]")
    (inbox / "c.yaml").write_text("tasks: [{id: x, duration: 1}]")
    (inbox / "d.yaml").write_text("tasks: [{id: y, duration: 1")  # broken YAML
    (inbox / "e.yaml").write_text("tasks: [{id: z, duration: 1, command: 123}]")  # (was a TypeError: the run died)
    (inbox / "f.yaml").write_text("tasks: [{id: 7, duration: 1, command: [echo, 1]}]")  # a number read as the id
    (inbox / "g.yaml").write_text("gpus: 8\ntasks: [{id: w, duration: 1, command: [echo]}]")  # a machine setting
    assert [t.id for t in poll()] == ["ok", "7"]
    assert sorted(p.name for p in inbox.iterdir()) == ["a.yaml.done", "b.yaml.rejected", "c.yaml.rejected",
                                                       "d.yaml.rejected", "e.yaml.rejected", "f.yaml.done",
                                                       "g.yaml.rejected"]
    assert "every task needs a `command` to run; tasks ['x'] have none" in capsys.readouterr().out


def test_an_inbox_file_being_written_is_read_once_it_has_settled(tmp_path):
    """A file written in two pieces was read half-written and rejected for good (or, cut between two tasks, ran the
    first alone): a file is read once its size and time have not changed for `settle_s` (of this clock: a file
    whose own time is ahead, copied from another machine, is read too; `poll.waiting` says one is awaited)."""
    import os
    import time

    from lightning_multilora.scheduling.task_file import inbox_poller

    inbox = tmp_path / "inbox"
    poll = inbox_poller(inbox, 2, need_command=True, settle_s=0.4)
    (inbox / "a.yaml").write_text("tasks: [{id: one, duration: 1, command: [echo]},")  # (the rest yet to come)
    assert poll() == [] and poll.waiting() and sorted(p.name for p in inbox.iterdir()) == ["a.yaml"]
    time.sleep(0.3)
    with open(inbox / "a.yaml", "a") as fh:
        fh.write(" {id: two, duration: 1, command: [echo]}]\n")
    time.sleep(0.3)  # (0.6 s since it was first seen, 0.3 s unchanged)
    assert poll() == [] and poll.waiting()
    time.sleep(0.5)
    assert [t.id for t in poll()] == ["one", "two"] and (inbox / "a.yaml.done").exists() and not poll.waiting()
    (inbox / "b.yaml").write_text("tasks: [{id: three, duration: 1, command: [echo]}]\n")
    ahead = time.time() + 3600  # (its time an hour ahead of this machine's)
    os.utime(inbox / "b.yaml", (ahead, ahead))
    assert poll() == []
    time.sleep(0.5)
    assert [t.id for t in poll()] == ["three"]


def test_ray_without_a_cluster_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from lightning_multilora.scheduling import ray_executor

    def no_cluster(address=None, **kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray_executor, "RayExecutor", no_cluster)
    path = write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, command: [echo]}}]")
    with pytest.raises(SystemExit):
        main([str(path), "--ray", "auto"])
    assert "--ray auto: no Ray cluster to run on (ConnectionError: Could not find any running Ray instance.)" in \
        capsys.readouterr().err


def test_a_real_run_needs_as_many_gpus_as_the_file_names(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, f"gpus: 3\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, command: [echo]}}]")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(SystemExit):
        main([str(path)])
    said = capsys.readouterr()
    assert "`gpus` is 3, but CUDA_VISIBLE_DEVICES=4,6 gives 2; lower `gpus`, or use --plan-only / --simulate" in \
        said.err
    assert "makespan" not in said.out  # (refused before the plan: its search and table came first)
    assert main([str(path), "--simulate"]) == 0  # a what-if needs no GPUs


def test_conflicting_flags_and_an_inbox_holding_the_task_file_are_refused(tmp_path, capsys):
    path = write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path / 'logs'}\ntasks: [{{id: a, duration: 1, command: [echo]}}]")
    config = write(tmp_path, "lr: 1.0e-4\n", name="sweep_a.yaml")  # a config a task reads, beside the task file
    for flags, message in ((["--simulate", "--ray", "auto"], "give one of them"),
                           (["--plan-only", "--inbox", str(tmp_path / "inbox")], "--plan-only runs nothing"),
                           (["--inbox", str(tmp_path)], "the folder holds the task file"),
                           (["--inbox", str(config)], "not a folder (a file of that name exists)")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(path), *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert path.exists() and config.exists() and not (tmp_path / "logs").exists()  # nothing renamed, nothing run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tasks.yaml").symlink_to(path)  # (a link in the inbox to a task file beside it: the inbox's too)
    with pytest.raises(SystemExit):
        main([str(elsewhere / "tasks.yaml"), "--inbox", str(elsewhere)])
    assert "the folder holds the task file" in capsys.readouterr().err and (elsewhere / "tasks.yaml").is_symlink()


def test_a_grid_coarser_than_the_tasks_is_warned_of_and_ctrl_c_while_planning_is_said(tmp_path, capsys,
                                                                                       monkeypatch):
    """``resolution_s: 10`` over 1-second tasks planned a makespan of 20 s without a word; Ctrl-C while the solver
    searched ended in a KeyboardInterrupt traceback out of OR-Tools."""
    from lightning_multilora.scheduling.task_scheduler import TaskScheduler

    path = write(tmp_path, f"gpus: 2\nresolution_s: 10\nlog_dir: {tmp_path}\n"
                           "tasks: [{id: a, duration: 1}, {id: b, duration: 1}, {id: c, duration: 1}]")
    assert main([str(path), "--plan-only"]) == 0
    assert ("warning: `resolution_s` is 10 s: the plan rounds the durations of 3 of the 3 tasks up by more than half "
            "('a': 1 s)" in capsys.readouterr().err)
    exact = write(tmp_path, f"gpus: 2\nresolution_s: 1\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1}}]")
    assert main([str(exact), "--plan-only"]) == 0 and "warning" not in capsys.readouterr().err  # (nothing rounded)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(TaskScheduler, "plan", interrupted)
    assert main([str(write(tmp_path, ALTO_MIX.format(log_dir=tmp_path / "logs"))), "--plan-only"]) == 130
    assert "interrupted while planning: no task ran" in capsys.readouterr().err


def test_a_plan_or_chart_that_cannot_be_made_is_a_clear_error(tmp_path, capsys):
    too_fine = write(tmp_path, f"gpus: 1\nresolution_s: 1.0e-6\nlog_dir: {tmp_path}\n"
                               "tasks: [{id: a, duration: 2000000, command: [echo]}]")
    with pytest.raises(SystemExit) as exit_info:
        main([str(too_fine), "--plan-only"])
    assert exit_info.value.code == 2 and f"{too_fine}: " in capsys.readouterr().err
    path = write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, command: [echo]}}]")
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--plan-only", "--gantt", str(tmp_path / "plan.txt")])
    assert exit_info.value.code == 2 and "the plan's Gantt chart" in capsys.readouterr().err
    (tmp_path / "charts").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--plan-only", "--gantt", str(tmp_path / "charts")])
    assert exit_info.value.code == 2 and "charts is a folder: give the chart's file" in capsys.readouterr().err
    assert main([str(path), "--plan-only", "--gantt", str(tmp_path / "myplan")]) == 0  # (no suffix: a PNG)
    assert f"Gantt chart: {tmp_path / 'myplan.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "myplan.png").is_file()


def test_a_ray_cluster_with_too_few_gpus_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    from lightning_multilora.scheduling import ray_executor

    started = []

    class TwoNodesOfOne:
        def __init__(self, address=None, **kwargs):
            pass

        def capacity(self):
            return 2, 1

        def start(self, task, gpu_ids):
            started.append(task.id)

    monkeypatch.setattr(ray_executor, "RayExecutor", TwoNodesOfOne)
    path = write(tmp_path, f"gpus: 2\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, gpus: 2, command: [echo]}}]")
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--ray", "auto"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "the widest task takes 2 on one node" in err and "at most 1 on a node" in err
    wide = write(tmp_path, f"gpus: 3\nlog_dir: {tmp_path}\ntasks: [{{id: a, duration: 1, gpus: 1, command: [echo]}}]")
    with pytest.raises(SystemExit):  # more GPUs than the cluster has in all
        main([str(wide), "--ray", "auto"])
    assert "`gpus` is 3 and the widest task takes 1 on one node, but the Ray cluster has 2 GPUs" in capsys.readouterr().err
    assert not started


RUN_AND_WAIT = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)")


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_an_interrupted_schedule_stops_its_running_tasks(tmp_path, sig, code):
    """Ctrl-C (after CP-SAT's solves, whose own SIGINT handler killed the process outright) or a `kill`: the running
    tasks are stopped, not left running in their own sessions; they are listed as stopped, in the records on disk
    too, and the run's chart is drawn (the table was only printed, without them)."""
    import os
    import signal
    import subprocess
    import time

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # (tasks without GPUs; no torch import to count them)
    command = _waiting_tasks_schedule(tmp_path, "ab")
    schedule = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # (a signal of its own: not pytest's process group)
    pids = [tmp_path / "a.pid", tmp_path / "b.pid"]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in pids) and time.monotonic() < deadline and schedule.poll() is None:
        time.sleep(0.1)
    assert all(p.exists() for p in pids), schedule.communicate(timeout=30)[0]
    schedule.send_signal(getattr(signal, sig))
    out, _ = schedule.communicate(timeout=60)
    assert schedule.returncode == code, out
    assert "interrupted: stopped the tasks ['a', 'b']" in out
    for pid in (int(p.read_text()) for p in pids):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert re.search(r"^a +stopped +1 ", out, re.M) and re.search(r"^b +stopped +1 ", out, re.M)
    records = {e["id"]: e for e in json.loads((tmp_path / "logs" / "records.json").read_text())["tasks"]}
    assert {t: (e["state"], e["log"]) for t, e in records.items()} == {
        t: ("stopped", str(tmp_path / "logs" / "logs" / f"{t}.1.log")) for t in "ab"}
    assert (tmp_path / "logs" / "run.png").exists()


def _waiting_tasks_schedule(tmp_path, ids: str = "a", setup: str = "pass") -> list[str]:
    """The command of a schedule process running tasks ``ids`` that each write their pid and wait, on as many GPUs
    (slots). ``setup``: Python run in the schedule's process before it starts, after its stop signals are set as at
    a terminal: a process started with one ignored keeps ignoring it, as Python does, and so would the schedule (a
    test run in a shell's background job ignores SIGINT; one under `nohup`, SIGHUP)."""
    py = sys.executable
    setup = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.signal(signal.SIGHUP, signal.SIG_DFL); {setup}")
    lines = "".join(f"  - {{id: {t}, duration: 100, command: [{py}, -c, \"{RUN_AND_WAIT}\", "
                    f"{tmp_path / f'{t}.pid'}]}}\n" for t in ids)
    path = write(tmp_path, f"gpus: {len(ids)}\nlog_dir: {tmp_path / 'logs'}\ntasks:\n{lines}")
    return [py, "-c", f"import sys; {setup}; from lightning_multilora.scheduling.task_file import main; "
                      f"sys.exit(main([{str(path)!r}]))"]


def _one_waiting_task_schedule(tmp_path, setup: str = "pass"):
    """A schedule process (its own session) running one task that waits, started: the process, and the task's
    pid. ``setup``: Python run in the schedule's process before it starts."""
    import os
    import subprocess
    import time

    schedule = subprocess.Popen(_waiting_tasks_schedule(tmp_path, setup=setup),
                                env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "a.pid").exists() and time.monotonic() < deadline and schedule.poll() is None:
        time.sleep(0.1)
    assert (tmp_path / "a.pid").exists(), schedule.communicate(timeout=30)[0]
    return schedule, int((tmp_path / "a.pid").read_text())


def test_a_schedule_started_with_its_hangup_ignored_keeps_running_on_a_hangup(tmp_path):
    """(`nohup multilora schedule ...`: the hangup handler installed over nohup's SIG_IGN stopped the tasks at an SSH
    logout, which the run was started to outlive.)"""
    import signal
    import time

    schedule, pid = _one_waiting_task_schedule(tmp_path, "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)")
    schedule.send_signal(signal.SIGHUP)
    time.sleep(1.5)
    still = schedule.poll() is None and _alive(pid)
    schedule.send_signal(signal.SIGTERM)  # (then stopped as a `kill` stops it)
    out, _ = schedule.communicate(timeout=60)
    assert still, out
    assert schedule.returncode == 143 and "interrupted: stopped the tasks ['a']" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal closed under the schedule")
def test_a_hangup_with_the_terminal_gone_still_stops_draws_and_says_129(tmp_path):
    """(The first print after the hangup raised EIO on the dead terminal: exit status 1, no run chart.)"""
    import os
    import pty
    import select
    import signal
    import subprocess
    import time

    master, slave = pty.openpty()
    schedule = subprocess.Popen(_waiting_tasks_schedule(tmp_path), env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                                stdin=slave, stdout=slave, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(slave)
    deadline = time.monotonic() + 120
    while not (tmp_path / "a.pid").exists() and time.monotonic() < deadline and schedule.poll() is None:
        if select.select([master], [], [], 0.2)[0]:
            os.read(master, 65536)  # (a terminal that is read, until it goes)
    os.close(master)
    schedule.send_signal(signal.SIGHUP)
    assert schedule.wait(timeout=60) == 129
    records = json.loads((tmp_path / "logs" / "records.json").read_text())["tasks"]
    assert [(e["id"], e["state"]) for e in records] == [("a", "stopped")]
    assert (tmp_path / "logs" / "run.png").exists()


def test_an_inbox_task_not_started_when_the_schedule_stops_is_recorded_for_the_resume(tmp_path):
    """(Its inbox file renamed done and no record of it: neither the inbox nor a resume would ever run it.)"""
    from lightning_multilora.scheduling.executors import SimulatedExecutor
    from lightning_multilora.scheduling.runner import ScheduleRunner
    from lightning_multilora.scheduling.task import Task
    from lightning_multilora.scheduling.task_scheduler import TaskScheduler

    runner = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), records=tmp_path / "records.json")
    runner.submit(Task("a", 5.0, command=["true"]))
    runner.submit(Task("late", 5.0, command=["true"]), added=True)
    runner.stop("interrupted")
    entries = json.loads((tmp_path / "records.json").read_text())["tasks"]
    assert [(e["id"], e["state"], e["added"], e["task"]["command"]) for e in entries] == [
        ("late", "stopped", True, ["true"])]  # (a, the file's, runs again from the file)
    assert entries[0]["detail"] == "stopped before it started (interrupted)" and entries[0]["attempts"] == 0
    assert runner.stopped_running == []  # (the interrupt's message named "late" among the tasks it stopped)


def test_an_inbox_task_waiting_for_a_gpu_is_recorded_before_any_stop(tmp_path):
    """Its inbox file was renamed done at once, and it was recorded only as a task started or ended or the schedule
    stopped: a schedule killed outright (`kill -9`, the OOM killer) while it waited lost it for good."""
    from lightning_multilora.scheduling.executors import SimulatedExecutor
    from lightning_multilora.scheduling.runner import ScheduleRunner
    from lightning_multilora.scheduling.task import Task
    from lightning_multilora.scheduling.task_scheduler import TaskScheduler

    class Killed(BaseException):
        """The schedule's process dying, as far as the runner's records go (it neither stops nor writes them)."""

    polls = iter([[], [Task("late", 5.0, command=["true"])]])  # (it comes as `a` runs on the one GPU)

    def poll():
        try:
            return next(polls)
        except StopIteration:  # (the next poll: the process is killed here, the late task still waiting)
            entries = json.loads((tmp_path / "records.json").read_text())["tasks"]
            raise Killed(entries)

    runner = ScheduleRunner(TaskScheduler(1), SimulatedExecutor(), records=tmp_path / "records.json", poll_s=0.5)
    runner.poll = poll
    runner.submit(Task("a", 50.0, command=["true"]))
    runner.stop = lambda why: None  # (killed outright: no stop runs)
    with pytest.raises(Killed) as killed:
        runner.run()
    entries = {e["id"]: e for e in killed.value.args[0]}
    assert entries["late"]["state"] == "stopped" and entries["late"]["added"] is True
    assert entries["late"]["detail"].startswith("stopped before it started") and "late" not in runner.running


def test_a_command_string_keeps_what_a_shell_passes_on_as_it_is(tmp_path):
    """A ``$`` no shell expands (a regex's end) and quoted code reach the program as written; nothing refused. A
    YAML block folded over lines (``command: >``, which keeps its last line break) and a backslash-newline were
    refused as a second line."""
    from lightning_multilora.scheduling.task import Task

    task = Task("a", 1.0, command='train.py --targets "^.*_proj$" --code \'print("a; b")\' --url http://h/x?y=1')
    assert task.command == ("train.py", "--targets", "^.*_proj$", "--code", 'print("a; b")', "--url",
                            "http://h/x?y=1")
    _, (folded, continued) = load_task_file(write(tmp_path, """\
        gpus: 1
        tasks:
          - id: a
            duration: 5
            command: >
              multilora fit --config a.yaml
              --seed_everything 7
          - id: b
            duration: 5
            command: |
              train.py \\
                --lr 1.0e-3
        """))
    assert folded.command == ("multilora", "fit", "--config", "a.yaml", "--seed_everything", "7")
    assert continued.command == ("train.py", "--lr", "1.0e-3")
    with pytest.raises(ValueError, match=r"task 'q': `command` '\"x' does not split into words: No closing quotation"):
        Task("q", 1.0, command='"x')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent's death signal is Linux's (prctl)")
def test_a_schedule_killed_outright_takes_its_running_tasks_with_it(tmp_path):
    """A ``kill -9`` (the OOM killer, a job manager's last resort) left the tasks running in their own sessions, and
    a ``--resume`` started them again beside themselves."""
    import os
    import signal
    import time

    schedule, pid = _one_waiting_task_schedule(tmp_path)
    assert _alive(pid)
    schedule.kill()
    schedule.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:  # (not left behind by a failing test)
        os.kill(pid, signal.SIGKILL)
    assert not alive


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which a container's first process may never reap, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_log_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """(``log_dir: ~/runs`` made a folder named "~" in the working directory.)"""
    monkeypatch.setenv("HOME", str(tmp_path))
    settings, _ = load_task_file(write(tmp_path, "gpus: 1\nlog_dir: ~/runs/s\ntasks: [{id: a, duration: 5}]"))
    assert settings["log_dir"] == str(tmp_path / "runs" / "s")


def test_a_key_given_twice_is_an_error_not_the_last_one_silently(tmp_path):
    path = write(tmp_path, "gpus: 2\ngpus: 8\ntasks: [{id: a, duration: 1}]")
    with pytest.raises(ValueError, match=r"not valid YAML: `gpus` is given twice in one mapping"):
        load_task_file(path)
    path = write(tmp_path, "gpus: 2\ntasks: [{id: a, duration: 1, duration: 5}]")
    with pytest.raises(ValueError, match=r"`duration` is given twice"):
        load_task_file(path)


def test_a_task_id_that_yaml_reads_as_a_number_keeps_its_text(tmp_path):
    path = write(tmp_path, "gpus: 1\ntasks: [{id: 007, duration: 1}, {id: 1.10, duration: 1}, {id: 1_000, duration: 1}, "
                           "{id: 0x1F, duration: 1}, {id: 7, duration: 1}]")
    assert [t.id for t in load_task_file(path)[1]] == ["007", "1.10", "1_000", "0x1F", "7"]  # (were 7, 1.1, 1000, 31)
    with pytest.raises(ValueError, match=r"`id` must be letters, digits.* got '12:30'"):  # (was 750, sexagesimal)
        load_task_file(write(tmp_path, "gpus: 1\ntasks: [{id: 12:30, duration: 1}]"))
    path = write(tmp_path, "gpus: 1\ntasks: [{id: off, duration: 1}, {id: 2024-01-01, duration: 1}, {id: 'no', "
                           "duration: 1}]")  # (were False and a date)
    assert [t.id for t in load_task_file(path)[1]] == ["off", "2024-01-01", "no"]
    (tmp_path / "latin1.yaml").write_bytes("gpus: 1\ntasks: [{id: caf\xe9, duration: 1}]".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.yaml: a task file is UTF-8 text \(invalid continuation byte"):
        load_task_file(tmp_path / "latin1.yaml")


def test_merge_keys_merge_and_an_unhashable_key_is_a_yaml_error(tmp_path):
    path = write(tmp_path, "gpus: 1\ntasks: [&d {id: a, duration: 5, command: [echo]}, {<<: *d, id: b}, "
                           "{<<: *d, id: 007, duration: 2}]")
    assert [(t.id, t.duration, t.command) for t in load_task_file(path)[1]] == [
        ("a", 5, ("echo",)), ("b", 5, ("echo",)), ("007", 2, ("echo",))]
    with pytest.raises(ValueError, match="(?s)not valid YAML: .*found unhashable key"):
        load_task_file(write(tmp_path, "gpus: 1\n? [a, b]\n: 1\n"))


def test_an_inbox_task_wider_than_the_largest_node_is_rejected(tmp_path):
    from lightning_multilora.scheduling.task_file import inbox_poller

    inbox = tmp_path / "inbox"
    poll = inbox_poller(inbox, 4, need_command=True, node_gpus=2)
    (inbox / "a.yaml").write_text("tasks: [{id: wide, duration: 1, gpus: 4, command: [echo]}]")
    (inbox / "b.yaml").write_text("tasks: [{id: ok, duration: 1, gpus: 2, command: [echo]}]")
    assert [t.id for t in poll()] == ["ok"]
    assert sorted(p.name for p in inbox.iterdir()) == ["a.yaml.rejected", "b.yaml.done"]


def test_a_command_lists_scalars_reach_the_process_as_written(tmp_path):
    """YAML read ``1.10``, ``007``, ``1:30``, ``0x10``, ``1_000`` and ``2.50`` as numbers, whose text went to the
    process as '1.1', '7', '90', '16', '1000' and '2.5'; ``false`` was refused as a bool. The list's scalars keep their
    text, also in a list shared through an anchor or a merge key; a nested list is refused, naming its item."""
    path = write(tmp_path, """\
        gpus: 1
        tasks:
          - {id: argv, duration: 1, command: [echo, 1.10, 007, 1:30, 0x10, 1_000, 2.50, false, null, 'no', 2024-01-01]}
          - &d {id: a, duration: 1, command: &c [echo, 1.0, off]}
          - {<<: *d, id: b}
          - {id: c, duration: 1, command: *c}
        """)
    commands = {t.id: t.command for t in load_task_file(path)[1]}
    assert commands["argv"] == ("echo", "1.10", "007", "1:30", "0x10", "1_000", "2.50", "false", "null", "no",
                                "2024-01-01")
    assert commands["a"] == commands["b"] == commands["c"] == ("echo", "1.0", "off")
    nested = write(tmp_path, "gpus: 1\ntasks: [{id: a, duration: 1, command: [echo, [1, 2]]}]")
    with pytest.raises(ValueError, match=r"`command` item #1 must be a string \(or a number\), got \[1, 2\] \(list\)"):
        load_task_file(nested)


def test_an_id_too_long_for_a_log_file_name_is_refused_when_the_file_is_loaded(tmp_path):
    """A 252-character id passed the checks, then the log's name (ENAMETOOLONG) crashed the running schedule."""
    path = write(tmp_path, f"gpus: 1\ntasks: [{{id: ok, duration: 1}}, {{id: {'x' * 252}, duration: 1}}]")
    with pytest.raises(ValueError, match=r"task `id` must be at most 200 characters \(it names the task's log files"
                                         r".*got 252") as raised:
        load_task_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    longest = write(tmp_path, f"gpus: 1\ntasks: [{{id: {'y' * 200}, duration: 1}}]")
    assert [len(t.id) for t in load_task_file(longest)[1]] == [200]


def test_a_torchrun_task_must_run_a_python_script_or_module(tmp_path):
    """torchrun runs its first argument with Python: ``multilora fit`` under it failed in the task's log alone
    ("can't open file '.../multilora'"). Refused when the file is loaded, naming the field; the module docstring's
    example file loads."""
    import re

    from lightning_multilora.scheduling import task_file

    path = write(tmp_path, "gpus: 2\ntasks: [{id: a, duration: 1, gpus: 2, torchrun: true, "
                           "command: multilora fit --config a.yaml}]")
    with pytest.raises(ValueError, match=r"task 'a': a `torchrun` task's `command` must start with a Python script "
                                         r"\(`train.py ...`\), `-m module ...` or `--no-python program ...`, got "
                                         r"'multilora'"):
        load_task_file(path)
    # an interpreter, torchrun itself or a shell: checked as `multilora` was (they failed in the task's log: "can't
    # open file '.../python'", three times with the retries)
    for first, why in (("python", r"leave `python` out: torchrun runs the script with Python itself"),
                       ("/usr/bin/python3.11", r"leave `/usr/bin/python3.11` out"),
                       ("torchrun", r"leave `torchrun` out: `torchrun: true` adds it"),
                       ("bash", r"run a program that is no Python script with `--no-python`: \[--no-python, bash")):
        path = write(tmp_path, f"gpus: 1\ntasks: [{{id: a, duration: 1, torchrun: true, "
                               f"command: [{first}, train.py]}}]")
        with pytest.raises(ValueError, match=rf"task 'a': a `torchrun` task's `command` must start with .*, got "
                                             rf"'{re.escape(first)}' .*; {why}"):
            load_task_file(path)
    path = write(tmp_path, "gpus: 2\ntasks: [{id: a, duration: 1, torchrun: true, command: [train.py, --lr, 1.10]}, "
                           "{id: b, duration: 1, torchrun: true, command: -m lightning_multilora.cli fit}, "
                           "{id: c, duration: 1, torchrun: true, command: --no-python multilora fit}, "
                           "{id: d, duration: 1, torchrun: true, command: --max-restarts 3 train.py}, "
                           "{id: e, duration: 1, torchrun: true, command: scripts/train --lr 1}]")
    assert [t.command[0] for t in load_task_file(path)[1]] == ["train.py", "-m", "--no-python", "--max-restarts",
                                                                "scripts/train"]
    example = re.search(r"A task file::\n\n(.*?)\n\n", task_file.__doc__, re.S).group(1)
    settings, tasks = load_task_file(write(tmp_path, example))
    assert any(t.torchrun for t in tasks) and tasks[1].command[-1] == "007"


def test_an_inbox_reads_yml_files_and_says_once_which_files_it_skips(tmp_path, capsys):
    from lightning_multilora.scheduling.task_file import inbox_poller

    inbox = tmp_path / "inbox"
    poll = inbox_poller(inbox, 1)
    (inbox / "a.yml").write_text("tasks: [{id: yml, duration: 1}]")
    (inbox / "b.YAML").write_text("tasks: [{id: upper, duration: 1}]")
    (inbox / "notes.txt").write_text("not a task file")
    (inbox / ".c.yaml.swp").write_text("an editor's")
    assert sorted(t.id for t in poll()) == ["upper", "yml"]
    assert poll() == []
    out = capsys.readouterr().out
    assert out.count("skipped") == 1 and f"skipped {inbox / 'notes.txt'}: an inbox's task files end in .yaml or .yml" \
        in out
    assert sorted(p.name for p in inbox.iterdir()) == [".c.yaml.swp", "a.yml.done", "b.YAML.done", "notes.txt"]
    import shutil  # the inbox moved away mid-run: said once, the schedule goes on (it stopped every running task)

    shutil.rmtree(inbox)
    assert poll() == [] and poll() == []
    assert capsys.readouterr().out.count(f"inbox {inbox} cannot be read") == 1
    inbox.mkdir()
    (inbox / "d.yaml").write_text("tasks: [{id: back, duration: 1}]")
    assert [t.id for t in poll()] == ["back"]


def test_a_refused_schedule_draws_no_chart(tmp_path, capsys, monkeypatch):
    """A schedule refused after planning (no `command` with --ray, more GPUs than CUDA_VISIBLE_DEVICES gives) wrote the
    plan's Gantt chart first, and the next run's took the next number."""
    logs = tmp_path / "logs"
    no_command = write(tmp_path, f"gpus: 1\nlog_dir: {logs}\ntasks: [{{id: a, duration: 1}}]")
    with pytest.raises(SystemExit) as exit_info:
        main([str(no_command), "--ray", "auto"])
    assert exit_info.value.code == 2 and "every task needs a `command`" in capsys.readouterr().err
    too_wide = write(tmp_path, f"gpus: 3\nlog_dir: {logs}\ntasks: [{{id: a, duration: 1, command: [echo]}}]")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(SystemExit) as exit_info:
        main([str(too_wide)])
    assert exit_info.value.code == 2 and "`gpus` is 3, but CUDA_VISIBLE_DEVICES=4,6 gives 2" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png"))
    assert main([str(too_wide), "--plan-only"]) == 0 and (logs / "plan.png").exists()  # (the first chart: plan.png)


def test_a_simulation_with_an_inbox_jumps_to_the_next_event(tmp_path, monkeypatch, capsys):
    """``--simulate --inbox`` polled every 0.5 s of the virtual clock: a 2,000,000 s task, 4,000,000 polls (41 s). The
    inbox is looked in at each event; a file dropped in before the run is still taken."""
    from lightning_multilora.scheduling import task_file

    calls = []
    make_poller = task_file.inbox_poller

    def counted(*args, **kwargs):
        poll = make_poller(*args, **kwargs)

        def count() -> list:
            calls.append(1)
            if len(calls) > 100:
                raise RuntimeError("the inbox was polled more than 100 times")
            return poll()
        return count

    monkeypatch.setattr(task_file, "inbox_poller", counted)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "new.yaml").write_text("tasks: [{id: late, duration: 10}]")
    path = write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path / 'logs'}\ntasks: [{{id: a, duration: 2000000}}]")
    assert main([str(path), "--simulate", "--inbox", str(inbox)]) == 0
    out = capsys.readouterr().out
    assert out.count("finished") == 2 and "makespan 2000010.0 s" in out and len(calls) <= 5


def test_a_file_without_gpus_says_it_is_required(tmp_path):
    """It said "`gpus` must be an integer >= 1, got None"."""
    with pytest.raises(ValueError, match=r"`gpus` is required: the GPUs the tasks are planned on, an integer >= 1"):
        load_task_file(write(tmp_path, "tasks: [{id: a, duration: 5}]"))


def test_a_plan_on_more_gpus_than_a_chart_has_rows_draws_none(tmp_path, capsys):
    """``gpus: 100000`` with --plan-only spent minutes drawing a row per GPU: the plan is printed, no chart."""
    from lightning_multilora.scheduling.task_file import MAX_CHART_GPUS, gantt

    path = write(tmp_path, f"gpus: 100000\nlog_dir: {tmp_path / 'logs'}\ntasks: [{{id: a, duration: 5, gpus: 3}}]")
    assert main([str(path), "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert f"no Gantt chart: 100000 GPUs, more rows than a chart has ({MAX_CHART_GPUS} at most)" in out
    assert "makespan 5.0" in out and not list(tmp_path.rglob("*.png"))
    with pytest.raises(ValueError, match=rf"a row per GPU, {MAX_CHART_GPUS} at most; 100000 GPUs were given"):
        gantt({}, 100000, tmp_path / "chart.png")


# fails (exit 3) on its first run, finishes on the next; says "<id> <attempt>;" in the file each time
FIRST_FAILS = ("import os, sys; m = sys.argv[1]; first = not os.path.exists(m); "
               "open(m, 'a').write(os.environ['MULTILORA_TASK_ID'] + ' ' + os.environ['MULTILORA_TASK_ATTEMPT'] + "
               "';'); sys.exit(3 if first else 0)")


def test_a_resumed_schedule_skips_the_tasks_recorded_finished(tmp_path, capsys, monkeypatch):
    """A re-run redid finished tasks (nothing was kept on disk): the records are written to
    ``<log_dir>/records.json``, and ``--resume`` runs only what did not finish (said), its attempts numbered on."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # (tasks without GPUs; no torch import to count them)
    py = sys.executable
    log_dir = tmp_path / "logs"
    path = write(tmp_path, f"""\
        gpus: 2
        max_retries: 0
        log_dir: {log_dir}
        tasks:
          - {{id: ok, duration: 1, command: [{py}, -c, "{FIRST_FAILS}", {tmp_path / 'ok.marker'}]}}
          - {{id: flaky, duration: 1, command: [{py}, -c, "{FIRST_FAILS}", {tmp_path / 'flaky.marker'}]}}
        """)
    (tmp_path / "ok.marker").write_text("")  # (ok finishes at once)
    assert main([str(path)]) == 1
    records = {e["id"]: e for e in json.loads((log_dir / "records.json").read_text())["tasks"]}
    assert {t: (e["state"], e["exit_code"]) for t, e in records.items()} == {"ok": ("finished", 0),
                                                                              "flaky": ("failed", 3)}
    assert records["flaky"]["log"] == str(log_dir / "logs" / "flaky.1.log")
    capsys.readouterr()
    assert main([str(path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "records 1 of the 2 tasks as finished" in out and "resume: skipped 1 task that" in out
    assert (tmp_path / "ok.marker").read_text() == "ok 1;" and (tmp_path / "flaky.marker").read_text() == (
        "flaky 1;flaky 2;")  # (ok did not run again; flaky's retry knows it is attempt 2)
    assert sorted(p.name for p in (log_dir / "logs").iterdir()) == ["flaky.1.log", "flaky.2.log", "ok.1.log"]
    records = {e["id"]: e for e in json.loads((log_dir / "records.json").read_text())["tasks"]}
    assert {t: (e["state"], e["attempts"]) for t, e in records.items()} == {"ok": ("finished", 1),
                                                                            "flaky": ("finished", 2)}
    assert main([str(path), "--resume"]) == 0
    assert "every task is finished: nothing to run" in capsys.readouterr().out
    (log_dir / "records.json").write_text("{")
    with pytest.raises(SystemExit):
        main([str(path), "--resume"])
    assert f"--resume: {log_dir / 'records.json'}: the schedule's records do not read" in capsys.readouterr().err



def test_a_resume_runs_again_an_inboxs_unfinished_tasks_and_keeps_every_finished_record(tmp_path, capsys,
                                                                                         monkeypatch):
    """Tasks an inbox added were forgotten by ``--resume`` (the records held no definition to run them from), and the
    finished ones' entries dropped from the file, the resume exiting 0; a run afresh replaced an earlier run's
    records without a word."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    py = sys.executable
    log_dir = tmp_path / "logs"
    marker = tmp_path / "ran.txt"
    run = f"import os; open({str(marker)!r}, 'a').write(os.environ['MULTILORA_TASK_ID'] + ';')"
    path = write(tmp_path, f"""\
        gpus: 1
        log_dir: {log_dir}
        tasks:
          - {{id: a, duration: 1, command: [{py}, -c, "{run}"]}}
        """)
    assert main([str(path)]) == 0
    first = json.loads((log_dir / "records.json").read_text())
    assert first["tasks"][0]["task"] == {"duration": 1.0, "gpus": 1, "torchrun": False, "command": [py, "-c", run]}
    # as an interrupted run with an inbox leaves them: a stopped, x (inbox) finished, y (inbox) stopped, z (inbox,
    # a records file of before the definitions) stopped; and "gone", a task of the file since removed from it
    entry = dict(first["tasks"][0], state="stopped")
    assert "added" not in entry  # (the file's own task)
    tasks = [entry, dict(entry, id="x", state="finished", added=True), dict(entry, id="y", added=True),
             {k: v for k, v in dict(entry, id="z", added=True).items() if k != "task"}, dict(entry, id="gone")]
    (log_dir / "records.json").write_text(json.dumps(dict(first, tasks=tasks)))
    capsys.readouterr()
    assert main([str(path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "records 1 unfinished task an inbox added: y; they run again" in out
    assert "unfinished tasks that are not in the file (removed or renamed; or an inbox's, in records older than the " \
           "mark): gone; they do not run" in out
    assert "cannot run from their records (no definition, no command, or wider than `gpus`): z; add them" in out
    assert marker.read_text() == "a;a;y;"  # (x finished before, gone removed from the file: not run again)
    entries = {e["id"]: e for e in json.loads((log_dir / "records.json").read_text())["tasks"]}
    assert {t: e["state"] for t, e in entries.items()} == {"a": "finished", "x": "finished", "y": "finished",
                                                           "z": "stopped", "gone": "stopped"}
    assert entries["y"]["added"] and "added" not in entries["a"]  # (y came from an inbox: still said)
    # a run afresh keeps the records it starts over from beside its own
    before = (log_dir / "records.json").read_text()
    assert main([str(path)]) == 0
    assert f"the earlier run's records kept as {log_dir / 'records.1.json'}" in capsys.readouterr().out
    assert (log_dir / "records.1.json").read_text() == before
    assert [e["id"] for e in json.loads((log_dir / "records.json").read_text())["tasks"]] == ["a"]


def test_with_ray_the_plan_takes_the_largest_nodes_first_and_the_executor_runs_each_task_on_its_own(monkeypatch):
    """The nodes the plan takes for the file's `gpus` (a partial last node; one node alone: no pinning), without a
    cluster (a stand-in executor)."""
    import argparse

    from lightning_multilora.scheduling import ray_executor
    from lightning_multilora.scheduling.task import Task
    from lightning_multilora.scheduling.task_file import _ray_executor

    class Cluster:
        sizes = {"n-small": 1, "n-big": 4, "n-mid": 2}

        def __init__(self, **kwargs):
            self.placed = None

        def capacity(self):
            return sum(self.sizes.values()), max(self.sizes.values())

        def nodes(self):
            return sorted(self.sizes.items(), key=lambda item: -item[1])

        def place_on(self, ids, counts):
            self.placed = (list(ids), list(counts))

    monkeypatch.setattr(ray_executor, "RayExecutor", Cluster)
    args, parser = argparse.Namespace(ray="auto", task_file="tasks.yaml"), argparse.ArgumentParser()
    tasks = [Task("a", 1.0, 2)]
    executor, largest, nodes = _ray_executor(args, {"gpus": 5, "log_dir": "logs"}, tasks, parser)
    assert largest == 4 and nodes == [4, 1] and executor.placed == (["n-big", "n-mid"], [4, 1])
    executor, _, nodes = _ray_executor(args, {"gpus": 3, "log_dir": "logs"}, tasks, parser)
    assert nodes is None and executor.placed == (["n-big"], [3])  # (one node: planned as one, run there)
    Cluster.sizes = {"only": 4}
    executor, _, nodes = _ray_executor(args, {"gpus": 4, "log_dir": "logs"}, tasks, parser)
    assert nodes is None and executor.placed is None


def test_a_resume_that_finds_no_records_under_a_relative_log_dir_says_whose_directory_it_read(tmp_path, capsys,
                                                                                              monkeypatch):
    """A relative ``log_dir`` is the working directory's: a resume started elsewhere said only "no records at
    logs/records.json: every task runs", and reran every finished task."""
    path = write(tmp_path, "gpus: 1\nlog_dir: logs\ntasks: [{id: a, duration: 1}]")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main([str(path), "--resume", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert (f"resume: no records at logs/records.json (`log_dir` logs is relative: read from the working directory, "
            f"{tmp_path / 'elsewhere'}; run the resume from the first run's directory") in out
    path = write(tmp_path, f"gpus: 1\nlog_dir: {tmp_path / 'logs'}\ntasks: [{{id: a, duration: 1}}]")
    assert main([str(path), "--resume", "--simulate"]) == 0
    assert f"resume: no records at {tmp_path / 'logs' / 'records.json'}: every task runs" in capsys.readouterr().out
