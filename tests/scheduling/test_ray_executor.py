"""RayExecutor on a local Ray cluster on the CPU, with a custom resource standing in for GPUs."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

from lightning_multilora.scheduling import ScheduleRunner, Task, TaskScheduler  # noqa: E402
from lightning_multilora.scheduling.ray_executor import RayExecutor  # noqa: E402

REPORT = ("import os, sys, time; open(sys.argv[1], 'w').write(os.environ['MULTILORA_TASK_ID'] + ' ' + "
          "os.environ['MULTILORA_ASSIGNED']); time.sleep(0.5)")


@pytest.fixture(scope="module")
def cluster():
    # (address="local": a cluster of its own, also where another runs on the machine, which ray.init would join and
    # then refuse the resources given)
    ray.init(address="local", num_cpus=2, resources={"fake_gpu": 2}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def test_planned_tasks_run_on_placement_groups_with_their_gpu_counts(cluster, tmp_path):
    py = sys.executable
    tasks = [Task("wide", 1.0, 2, [py, "-c", REPORT, str(tmp_path / "wide")]),
             Task("n1", 1.0, 1, [py, "-c", REPORT, str(tmp_path / "n1")]),
             Task("n2", 1.0, 1, [py, "-c", REPORT, str(tmp_path / "n2")]),
             Task("bad", 1.0, 1, [py, "-c", "import sys; print('starting'); sys.exit('it broke')"])]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "bad.1.log").write_text("an earlier schedule's")
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5),
                            RayExecutor(resource="fake_gpu", log_dir=tmp_path / "logs"), max_retries=1)
    for task in tasks:
        runner.submit(task)
    records = runner.run()
    assert {t: records[t].state for t in ("wide", "n1", "n2")} == {"wide": "finished", "n1": "finished",
                                                                   "n2": "finished"}
    bad = records["bad"]
    # each attempt's whole output in a log of its own (numbered past an earlier schedule's), as LocalExecutor keeps
    assert bad.state == "failed" and bad.attempts == 2
    # (and the log's last line, its error, as LocalExecutor's record says it: it said the exit status alone)
    assert bad.detail == f"exit status 1, log {tmp_path / 'logs' / 'bad.3.log'}; its log ends: it broke"
    assert (tmp_path / "logs" / "bad.1.log").read_text() == "an earlier schedule's"
    for attempt in (2, 3):
        assert (tmp_path / "logs" / f"bad.{attempt}.log").read_text() == "starting\nit broke\n"
    assert (tmp_path / "logs" / "wide.1.log").is_file()
    assert (tmp_path / "wide").read_text() == "wide 2.0"  # Ray granted the task both "GPUs"
    assert (tmp_path / "n1").read_text() == "n1 1.0"
    wide = records["wide"]
    for name in ("n1", "n2"):  # never alongside the 2-GPU task on a 2-GPU cluster
        r = records[name]
        assert r.end <= wide.start + 1e-6 or wide.end <= r.start + 1e-6


def test_the_clusters_capacity_counts_its_gpus_in_all_and_on_one_node(cluster):
    assert RayExecutor(resource="fake_gpu").capacity() == (2, 2)


def test_stop_cancels_the_running_tasks_and_frees_their_placement_groups(cluster):
    from ray.util.placement_group import placement_group_table

    executor = RayExecutor(resource="fake_gpu")
    executor.start(Task("long", 60.0, 1, [sys.executable, "-c", "import time; time.sleep(60)"]), (0,))
    (ref, (_, pg)), = executor._refs.items()
    executor.stop()
    assert not executor._refs
    with pytest.raises(Exception):  # (cancelled: Ray's TaskCancelledError or a killed worker's error)
        ray.get(ref, timeout=30)
    assert placement_group_table(pg)["state"] == "REMOVED"


def test_capacity_is_the_gpus_of_the_live_nodes_in_all_and_on_the_largest():
    from types import SimpleNamespace

    executor = object.__new__(RayExecutor)  # (no cluster: the nodes Ray would list)
    executor.resource = "GPU"
    executor.ray = SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": {"GPU": 4.0, "CPU": 32.0}},
                                                  {"Alive": True, "Resources": {"GPU": 2.0}},
                                                  {"Alive": False, "Resources": {"GPU": 8.0}},
                                                  {"Alive": True, "Resources": {"CPU": 8.0}}])
    assert executor.capacity() == (6, 4)


def test_a_tasks_command_is_told_its_id_and_attempt_on_the_cluster(cluster, tmp_path):
    """``MULTILORA_TASK_ATTEMPT`` beside ``MULTILORA_TASK_ID``, as `LocalExecutor` gives them: the first attempt fails,
    the retry is told it is attempt 2."""
    said = tmp_path / "said"
    tell = ("import os, sys; m = sys.argv[1]; first = not os.path.exists(m); "
            "open(m, 'a').write(os.environ['MULTILORA_TASK_ID'] + ' ' + os.environ['MULTILORA_TASK_ATTEMPT'] + '\\n');"
            " sys.exit(3 if first else 0)")
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5),
                            RayExecutor(resource="fake_gpu", log_dir=tmp_path / "logs"), max_retries=1)
    runner.submit(Task("flaky", 1.0, 1, [sys.executable, "-c", tell, str(said)]))
    record = runner.run()["flaky"]
    assert said.read_text() == "flaky 1\nflaky 2\n"
    assert (record.state, record.exit_code, record.log) == ("finished", 0, str(tmp_path / "logs" / "flaky.2.log"))


def test_a_task_runs_in_the_schedules_folder_with_its_environment_once_an_attempt(cluster, tmp_path, monkeypatch):
    """A Ray worker ran a task in the folder and environment its node was started with: a task file's relative
    paths and the schedule's `PYTHONPATH` went elsewhere, a bare program beside the schedule's Python was not found
    (and its 127 retried); and Ray's own retries ran an attempt again, unsaid."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCHEDULE_SAYS", "hello")
    tell = "import os; open('where', 'w').write(os.getcwd() + ' ' + os.environ['SCHEDULE_SAYS'])"
    executor = RayExecutor(resource="fake_gpu", log_dir=tmp_path / "logs")
    assert executor._remote._default_options["max_retries"] == 0
    runner = ScheduleRunner(TaskScheduler(2, resolution_s=0.5), executor, max_retries=2)
    runner.submit(Task("here", 1.0, 1, [sys.executable, "-c", tell]))
    runner.submit(Task("gone", 1.0, 1, ["no-such-program-anywhere", "x"]))
    records = runner.run()
    assert records["here"].state == "finished"
    assert (tmp_path / "where").read_text() == f"{tmp_path} hello"
    assert (records["gone"].state, records["gone"].attempts) == ("failed", 1), records["gone"]
    assert "(not retried)" in records["gone"].detail
