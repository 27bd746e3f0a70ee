"""RayExecutor on a local Ray cluster of two nodes (CPU, a custom resource standing in for GPUs): a plan over the
nodes, each task run on its planned node."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

from lightning_multilora.scheduling import ScheduleRunner, Task, TaskScheduler  # noqa: E402
from lightning_multilora.scheduling.ray_executor import RayExecutor  # noqa: E402

STAMP = ("import sys, time; open(sys.argv[1] + '.start', 'w').write(repr(time.time())); "
         "time.sleep(float(sys.argv[2])); open(sys.argv[1] + '.end', 'w').write(repr(time.time()))")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2,
                                                            "resources": {"fake_gpu": 2}})
    cluster.add_node(num_cpus=1, num_gpus=2, resources={"fake_gpu": 2})  # (Ray's "GPU" stands in too: no device)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    cluster.shutdown()


def test_a_plan_over_two_nodes_runs_each_task_on_its_planned_node(two_nodes, tmp_path):
    """Planned as one pool of 4 GPUs, the two 1-GPU tasks went to both 2-GPU nodes, and the 2-GPU task planned beside
    them found no node with 2 free: it ran after them, while the records said it started at once."""
    executor = RayExecutor(resource="fake_gpu", log_dir=tmp_path / "logs")
    nodes = executor.nodes()
    assert [count for _, count in nodes] == [2, 2] and len({node for node, _ in nodes}) == 2
    executor.place_on([node for node, _ in nodes], [2, 2])
    py = sys.executable
    tasks = [Task(name, seconds, gpus, [py, "-c", STAMP, str(tmp_path / name), str(seconds)])
             for name, seconds, gpus in (("long1", 6.0, 1), ("long2", 6.0, 1), ("wide", 0.5, 2))]
    scheduler = TaskScheduler(4, resolution_s=0.5, nodes=[2, 2])
    plan = scheduler.plan(tasks)
    assert plan.makespan == 6 and plan.placements["wide"].start == 0
    runner = ScheduleRunner(scheduler, executor, plan=plan)
    for task in tasks:
        runner.submit(task)
    records = runner.run()
    assert {t: r.state for t, r in records.items()} == {"long1": "finished", "long2": "finished", "wide": "finished"}

    def stamp(name, which):
        return float((tmp_path / f"{name}.{which}").read_text())

    # the wide task ran beside the long ones (on the node they left free), not after them
    assert stamp("wide", "start") < min(stamp("long1", "end"), stamp("long2", "end"))
    with pytest.raises(ValueError, match=r"RayExecutor.place_on: a Ray node id for each of the 2 nodes, got 1"):
        executor.place_on([nodes[0][0]], [2, 2])


def test_the_schedule_command_plans_over_the_clusters_nodes(two_nodes, tmp_path, capsys):
    import textwrap

    from lightning_multilora.scheduling.task_file import main

    py = sys.executable
    lines = [f"  - {{id: {name}, duration: {seconds}, gpus: {gpus}, command: [{py}, -c, {STAMP!r}, "
             f"{tmp_path / name}, '{seconds}']}}" for name, seconds, gpus in (("long1", 6, 1), ("long2", 6, 1),
                                                                              ("wide", 1, 2))]
    path = tmp_path / "tasks.yaml"
    path.write_text(textwrap.dedent(f"""\
        gpus: 4
        resolution_s: 0.5
        log_dir: {tmp_path / 'run'}
        tasks:
        """) + "\n".join(lines) + "\n")
    assert main([str(path), "--ray", "auto"]) == 0
    out = capsys.readouterr().out
    assert "makespan 6.0" in out, out
    assert float((tmp_path / "wide.start").read_text()) < float((tmp_path / "long1.end").read_text())
