"""AdapterParallelStrategy on 2 gloo CPU processes against one process; adapter placement."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from lightning_multilora import AdapterSpec
from lightning_multilora.strategies import AdapterParallelStrategy, assign_adapters

sys.path.insert(0, str(Path(__file__).parent))
from ap_run import study_rows  # noqa: E402

SCRIPT = Path(__file__).parent / "ap_run.py"


def test_adapters_are_placed_disjoint_balanced_and_sticky():
    specs = [AdapterSpec(f"b{i}", batch_size=b) for i, b in enumerate([4, 1, 4, 1, 2, 2, 1, 1])]
    owner = assign_adapters(specs, 2)
    assert set(owner) == {s.name for s in specs} and set(owner.values()) == {0, 1}
    load = [sum(s.batch_size for s in specs if owner[s.name] == r) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= 1
    new = [*specs, AdapterSpec("late", batch_size=2)]
    again = assign_adapters(new, 2, owner)
    assert all(again[n] == r for n, r in owner.items())  # placed adapters never move
    assert again["late"] == min((0, 1), key=lambda r: load[r])  # the least-loaded rank takes a newcomer
    with pytest.raises(ValueError, match="num_ranks"):
        assign_adapters(specs, 0)
    # one after the other, as the module starts them: a rank of the same batch size only where that keeps balance
    owner = {}
    specs = [AdapterSpec("big1", batch_size=8), AdapterSpec("small", batch_size=1), AdapterSpec("big2", batch_size=8)]
    for k in range(1, 4):
        owner = assign_adapters(specs[:k], 2, owner)
    assert owner["big1"] != owner["big2"]
    # an empty rank first: a large adapter set the bound, and small ones of one batch size joined one rank while two
    # held none (idle for the rest of the run once the large one ended)
    specs = [AdapterSpec("a0", batch_size=8), *(AdapterSpec(f"a{i}", batch_size=2) for i in range(1, 5))]
    owner = {}
    for k in range(1, 6):
        owner = assign_adapters(specs[:k], 4, owner)
    assert sorted(set(owner.values())) == [0, 1, 2, 3], owner


def test_a_checkpoint_url_is_refused_not_written_as_a_local_folder_of_its_name():
    """"memory://ckpts/x" (or "s3://bucket/x") was written as the local folder "memory:/ckpts/x": a resume looking in
    the bucket found nothing."""
    strategy = AdapterParallelStrategy()
    for call in (lambda path: strategy.save_checkpoint({}, path), strategy.load_checkpoint):
        with pytest.raises(ValueError, match=r"not through a URL: got 's3://bucket/step=2.ckpt'; give a local"):
            call("s3://bucket/step=2.ckpt")
    from lightning_multilora.strategies.adapter_parallel import _local

    assert _local("file:///tmp/x.ckpt", "read") == "/tmp/x.ckpt" and _local("rel/x.ckpt", "read") == "rel/x.ckpt"


def test_a_sigterm_stops_every_rank_after_the_same_step_and_each_exports_its_adapters(runs):
    """Lightning's handler broadcast from inside the signal handler: rank 0 signalled while rank 1 went into the
    step's exchange waited in two different collectives until the timeout. The signal is now shared at the step's
    exchange: both ranks stop after step 2, and every adapter is exported by its owner."""
    ranks = [json.loads((runs / f"sigterm.rank{r}.json").read_text()) for r in (0, 1)]
    assert [rank["evaluated"]["stopped"] for rank in ranks] == ["SIGTERMException after step 2"] * 2
    assert ranks[0]["exported"] == ranks[1]["exported"] and ranks[0]["owned"] and ranks[1]["owned"]
    assert all(path and step == 2 for path, step in ranks[0]["exported"].values())
    assert all((Path(path) / "adapter_model.safetensors").is_file() for path, _ in ranks[0]["exported"].values())


def test_a_rank_that_fails_leaves_rank_0_the_time_to_export_its_adapters(runs):
    """Lightning's launcher killed the main process (rank 0) within 5 s of another rank's failing: its adapters, being
    exported after the lost collective, were cut short (a folder of its stamp alone), and no summary came. The
    observer now waits for rank 0 to end on its own (`launcher.CHILD_FAILURE_GRACE_S`)."""
    returncode, stderr = json.loads((runs / "rank1_error.end").read_text())
    assert returncode == 1, (returncode, stderr[-3000:])  # (not -9: killed)
    assert "rank 1 lost its GPU" in stderr
    for name in ("a0", "a1", "a2", "a3"):
        assert (runs / "rank1_error" / name / "adapter_model.safetensors").is_file(), name


def test_the_strategy_is_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry.get("adapter_parallel").__class__ is AdapterParallelStrategy


def test_a_replicated_base_is_cast_to_param_dtype_and_its_adapters_are_not():
    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.layer import inject_multilora

    model = build_base_model("tiny-llama")
    layers = inject_multilora(model, ["q_proj", "v_proj"])
    layers.add_adapter("a", rank=4, alpha=8)
    adapters = list(layers.parameters_of("a"))
    AdapterParallelStrategy(param_dtype=torch.bfloat16, shard_size=1).parallelize(model, adapters)
    kept = {id(p) for p in adapters}
    assert all(p.dtype == torch.float32 for p in adapters)
    assert {p.dtype for p in model.parameters() if id(p) not in kept} == {torch.bfloat16}


def start(out: Path, *modes: str) -> Callable[[], subprocess.CompletedProcess]:
    """``python ap_run.py OUT MODES...`` started: the function returned waits for its end (its exit code and its
    errors, kept in OUT/launch_<first mode>.stderr). One thread of torch's a process: launches run side by side on
    the test machine's 2 cores (with torch's 2 threads each, the fixture took 198 s, not 138)."""
    import os

    errors = out / f"launch_{modes[0]}.stderr"
    with errors.open("w") as stream:
        process = subprocess.Popen([sys.executable, str(SCRIPT), str(out), *modes], stdout=subprocess.DEVNULL,
                                   stderr=stream, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def wait() -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(process.args, process.wait(timeout=900), "", errors.read_text())

    return wait


OPTUNA = importlib.util.find_spec("optuna") is not None  # absent on the GPU image; installed by `make test`
# Resuming modes after the ones they resume from (`ap_run.RESUMES`)
SINGLE_MODES = ["single", "stop_single", "early_exit_single", "early_exit_stop_single", "dpo_single",
                "remove_single", "end_eval_single", "owner_pause_single",
                *(["optuna_single", "warmup_single"] if OPTUNA else []), "resume_one"]  # (last: it starts a process group)
TWO_RANK_MODES = ["parallel", "stop", "resume_two", "load_two", "early_exit", "early_exit_resume_two", "replicated",
                  "dpo", "remove", "end_eval", "refit", "refit_on", "admission", "disagree", "smoke", "owner_pause",
                  *(["optuna_admission", "optuna", "optuna_defaults", "optuna_prune", "warmup", "warmup_stop"]
                    if OPTUNA else []), *(["optuna_crash"] if OPTUNA else []), "one_rank_add", "one_rank_unqueue",
                  "one_rank_stop", *(["optuna_bad_target"] if OPTUNA else [])]  # (last: their fits end in an error)
# resumes of two-rank checkpoints, in processes of their own (nothing but the checkpoint carries the run over); then
# a SIGTERM (last: the signal's handlers are the Trainer's while it runs)
RESUME_MODES = ["resume", *(["warmup_resume", "optuna_crash_resume"] if OPTUNA else []), "resume_mixed", "sigterm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests read, in one folder: the two-rank modes in one pair of processes (an import and a process
    group for all of them, not one a mode: the file's tests took 9.5 minutes of the suite's 15 with a pair of
    processes a mode), beside them the one-process modes in one process (the two-rank modes that resume their
    checkpoints wait for them; last, ``resume_one``, the two-rank checkpoint resumed on one process, waits for it)
    and a pair whose rank 1 fails (``rank1_error``, its end in OUT/rank1_error.end). Then the other resumes of the
    two-rank checkpoint: on another pair, and on four (with the ``hybrid`` base). (Side by side: a launch's ranks
    spend seconds in turn importing, and in waits. A process spends some 12 s of CPU importing.)"""
    out = tmp_path_factory.mktemp("adapter_parallel")
    two_ranks, one, failing = start(out, *TWO_RANK_MODES), start(out, *SINGLE_MODES), start(out, "rank1_error")
    for ended in (one(), two_ranks()):
        assert ended.returncode == 0, ended.stderr[-3000:]
    failed = failing()
    (out / "rank1_error.end").write_text(json.dumps([failed.returncode, failed.stderr]))
    mixed_steps(out / "ckpt_stop", out / "ckpt_mixed")
    launches = [start(out, *RESUME_MODES), start(out, "hybrid", "resume_four")]
    for ended in [wait() for wait in launches]:
        assert ended.returncode == 0, ended.stderr[-3000:]
    return out


def mixed_steps(source: Path, folder: Path) -> None:
    """A copy of `source`'s checkpoint whose rank1.ckpt says it was written a step earlier (say, a folder saved again
    that a crash left half-written)."""
    import shutil

    (saved,) = source.glob("*.ckpt")
    shutil.copytree(saved, folder / saved.name)
    state = torch.load(folder / saved.name / "rank1.ckpt", weights_only=False)
    torch.save({**state, "global_step": state["global_step"] - 1}, folder / saved.name / "rank1.ckpt")


def test_two_ranks_train_each_adapter_exactly_like_one_process(runs):
    ranks = [json.loads((runs / f"parallel.rank{r}.json").read_text()) for r in (0, 1)]
    # disjoint owners; every rank saw every adapter finish (rank 0's last adapter ends at step 4, rank 1's at 6:
    # rank 0 kept joining the base's collectives for two steps and nothing hung)
    assert set(ranks[0]["owned"]) | set(ranks[1]["owned"]) == {"a0", "a1", "a2", "a3"}
    assert not set(ranks[0]["owned"]) & set(ranks[1]["owned"])
    assert ranks[0]["states"] == ranks[1]["states"]
    assert all(state == "finished" for state, _ in ranks[0]["states"].values())
    # validation (every 3 steps, and on finishing) ran on every rank for its own adapters, results shared
    single = json.loads((runs / "single.rank0.json").read_text())
    assert ranks[0]["val"] == ranks[1]["val"]
    for name, history in single["val"].items():
        assert [s for s, _ in ranks[0]["val"][name]] == [s for s, _ in history] and history
        for (_, a), (_, b) in zip(ranks[0]["val"][name], history):
            assert a == pytest.approx(b, rel=1e-5)
    # every adapter's training losses reached every rank (SweepReport's curves on rank 0)
    assert ranks[0]["train"] == ranks[1]["train"]
    for name, history in single["train"].items():
        assert [s for s, _ in ranks[0]["train"][name]] == [s for s, _ in history] == list(range(1, len(history) + 1))
        assert [v for _, v in ranks[0]["train"][name]] == pytest.approx([v for _, v in history], rel=1e-5)
    for name in ("a0", "a1", "a2", "a3"):
        parallel = load_file(runs / "parallel" / name / "adapter_model.safetensors")
        single = load_file(runs / "single" / name / "adapter_model.safetensors")
        assert parallel.keys() == single.keys()
        for key in single:
            assert (parallel[key] - single[key]).abs().max() <= 1e-6, (name, key)
        assert any(t.abs().max() > 0 for k, t in single.items() if "lora_B" in k)  # it did train


def test_checkpoints_hold_each_ranks_adapters(runs):
    folders = list((runs / "root_parallel").rglob("*.ckpt"))
    assert folders, "the default ModelCheckpoint saved nothing"
    owned = []
    for rank in (0, 1):
        state = torch.load(folders[0] / f"rank{rank}.ckpt", weights_only=False)
        keys = set(state["state_dict"])
        assert state["rank"] == rank and keys == {k for k in keys if ".lora_" in k}
        owned.append({n for n, r in state["adapter_owner"].items() if r == rank})
    assert owned[0].isdisjoint(owned[1])


SPEC_NAMES = ("a0", "a1", "a2", "a3")


def test_a_run_stopped_and_resumed_from_its_checkpoint_ends_as_if_never_stopped(runs):
    # the stop at the Trainer's max_steps=2 exported the adapters held, each on its owner: every rank knows where
    # and of which step (rank 0's report read neither for the other rank's adapters)
    stopped = [json.loads((runs / f"stop.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert stopped[0]["exported"] == stopped[1]["exported"]
    # (validated from its checkpoint, each rank's registry held its own adapters' steps and the others' one behind)
    assert stopped[0]["evaluated"]["steps_validated"] == stopped[1]["evaluated"]["steps_validated"] == {
        n: step for n, (_, step) in stopped[0]["states"].items()}
    held = [n for n, (state, _) in stopped[0]["states"].items() if state == "running"]
    assert held and all(stopped[0]["exported"][n][1] == 2 and stopped[0]["exported"][n][0] for n in held)
    assert {n for n in held if n in stopped[1]["owned"]}  # (one of them the other rank's)
    for rank in (0, 1):
        resumed_run = json.loads((runs / f"resume.rank{rank}.json").read_text())
        uninterrupted_run = json.loads((runs / f"parallel.rank{rank}.json").read_text())
        # a3 reached its 2 steps at the checkpoint's step: settled at the resume, not trained a third step
        assert resumed_run["states"] == uninterrupted_run["states"] and resumed_run["states"]["a3"] == ["finished", 2]
        for name in SPEC_NAMES:  # the same validations, at the same steps
            assert [s for s, _ in resumed_run["val"][name]] == [s for s, _ in uninterrupted_run["val"][name]]
            assert [v for _, v in resumed_run["val"][name]] == pytest.approx(
                [v for _, v in uninterrupted_run["val"][name]], rel=1e-5)
    for name in SPEC_NAMES:
        resumed = load_file(runs / "resume" / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "parallel" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert (resumed[key] - uninterrupted[key]).abs().max() <= 1e-6, (name, key)
    with pytest.raises(FileNotFoundError, match="one rank<r>.ckpt per rank"):
        AdapterParallelStrategy().load_checkpoint(runs / "nowhere")


def test_a_checkpoint_of_two_ranks_resumes_on_one_as_if_never_stopped(runs):
    """Resumed on one process, a run written by two: rank 1's adapters come back from its file onto rank 0 (their
    weights, optimizer state, data streams and validation history) and every adapter ends as in the run never
    stopped."""
    resumed_run = json.loads((runs / "resume_one.rank0.json").read_text())
    uninterrupted_run = json.loads((runs / "parallel.rank0.json").read_text())
    saved = torch.load(next((runs / "ckpt_stop").glob("*.ckpt")) / "rank1.ckpt", weights_only=False)
    moved = {n for n, r in saved["adapter_owner"].items() if r == 1}
    assert moved and saved["world_size"] == 2
    assert resumed_run["states"] == uninterrupted_run["states"]
    for name in SPEC_NAMES:
        assert [s for s, _ in resumed_run["val"][name]] == [s for s, _ in uninterrupted_run["val"][name]]
        assert [v for _, v in resumed_run["val"][name]] == pytest.approx(
            [v for _, v in uninterrupted_run["val"][name]], rel=1e-5)
        resumed = load_file(runs / "resume_one" / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "parallel" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert (resumed[key] - uninterrupted[key]).abs().max() <= 1e-6, (name, key)


def test_a_checkpoint_of_two_ranks_resumed_on_four_gives_the_new_ranks_adapters(runs):
    """Resumed over more ranks than wrote it, the adapters kept their saved owners: the new ranks trained nothing for
    the whole run (GPUs idle). Every adapter is placed anew, and each ends as in the run never stopped."""
    ranks = [json.loads((runs / f"resume_four.rank{r}.json").read_text()) for r in range(4)]
    uninterrupted_run = json.loads((runs / "parallel.rank0.json").read_text())
    assert all(rank["owned"] for rank in ranks), [rank["owned"] for rank in ranks]  # (one adapter each)
    assert all(rank["states"] == uninterrupted_run["states"] for rank in ranks)
    for name in SPEC_NAMES:
        assert [v for _, v in ranks[0]["val"][name]] == pytest.approx(
            [v for _, v in uninterrupted_run["val"][name]], rel=1e-5)
        resumed = load_file(runs / "resume_four" / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "parallel" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert (resumed[key] - uninterrupted[key]).abs().max() <= 1e-6, (name, key)


def test_a_folder_of_mixed_steps_fails_every_rank_with_its_reason(runs):
    """Rank 1's file of another step (`mixed_steps`): both ranks fail at the resume with the reason, rank 0 too,
    whose own files agree (none is left waiting in a collective: the launch's next mode runs)."""
    reason = "is not one checkpoint of 2 ranks: rank1.ckpt was written by rank 1 of 2 at step 1 (rank0.ckpt: step 2)"
    for r in (0, 1):
        failed = json.loads((runs / f"resume_mixed.rank{r}.json").read_text())["evaluated"]["failed"]
        assert failed.startswith("ValueError: ") and reason in failed, (r, failed)
    assert (runs / "sigterm.rank1.json").is_file()


def test_a_single_process_checkpoint_resumes_on_two_ranks_as_if_never_stopped(runs):
    """A checkpoint file of one process without the strategy, resumed on two ranks: its adapters placed over both,
    each ending as in the one process never stopped."""
    saved = list((runs / "ckpt_stop_single").glob("*.ckpt"))
    assert saved and all(p.is_file() for p in saved)
    ranks = [json.loads((runs / f"resume_two.rank{r}.json").read_text()) for r in (0, 1)]
    uninterrupted_run = json.loads((runs / "single.rank0.json").read_text())
    assert ranks[0]["owned"] and ranks[1]["owned"] and not set(ranks[0]["owned"]) & set(ranks[1]["owned"])
    for resumed_run in ranks:
        assert resumed_run["states"] == uninterrupted_run["states"]
        for name in SPEC_NAMES:
            assert [s for s, _ in resumed_run["val"][name]] == [s for s, _ in uninterrupted_run["val"][name]]
            assert [v for _, v in resumed_run["val"][name]] == pytest.approx(
                [v for _, v in uninterrupted_run["val"][name]], rel=1e-5)
    for name in SPEC_NAMES:  # (a3 finished in its step 2 in one process, before the checkpoint: exported there)
        resumed = load_file(runs / ("stop_single" if name == "a3" else "resume_two") / name
                            / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "single" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert (resumed[key] - uninterrupted[key]).abs().max() <= 1e-6, (name, key)


def test_a_loaded_module_is_refused_without_its_checkpoint_and_resumes_with_it_on_two_ranks(runs):
    """`load_from_checkpoint`, then a fit under the strategy without ``ckpt_path``: no rank owned any adapter, every
    rank held them all, and the run stepped for ever training nothing. Refused, naming ``ckpt_path``; with it, the
    loaded module ends as `resume_two` does."""
    ranks = [json.loads((runs / f"load_two.rank{r}.json").read_text()) for r in (0, 1)]
    uninterrupted_run = json.loads((runs / "single.rank0.json").read_text())
    for loaded in ranks:
        assert "loaded with `load_from_checkpoint`, which places no adapter on the ranks of " \
               "strategy='adapter_parallel': give the checkpoint to the fit instead" in loaded["evaluated"]["refused"]
        assert loaded["states"] == uninterrupted_run["states"]
    assert ranks[0]["owned"] and ranks[1]["owned"] and not set(ranks[0]["owned"]) & set(ranks[1]["owned"])
    for name in SPEC_NAMES:
        if name == "a3":  # (finished before the checkpoint, in stop_single's run)
            continue
        resumed = load_file(runs / "load_two" / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "single" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert (resumed[key] - uninterrupted[key]).abs().max() <= 1e-6, (name, key)


def test_no_adapter_tensor_enters_a_collective(runs):
    from lightning_multilora.base_model import build_base_model

    model = build_base_model("tiny-llama")
    per_layer = {sum(p.numel() for p in layer.parameters()) for layer in model.model.layers}
    layer_ids = {id(p) for layer in model.model.layers for p in layer.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in layer_ids)
    for rank in (0, 1):
        calls = json.loads((runs / f"parallel.rank{rank}.json").read_text())["calls"]
        assert not [c for c in calls if "reduce_scatter" in c[0]]  # nothing trainable is sharded: no gradient sync
        assert all(numel <= 1 for name, numel, _ in calls if name == "all_reduce")  # Lightning's control flags only
        gathered = {numel for name, numel, _ in calls if name.startswith("all_gather")}
        assert gathered and gathered <= per_layer | {root}  # only the frozen base is gathered


@pytest.mark.parametrize("mode, ranks", [("replicated", 2), ("hybrid", 4)])
def test_a_replicated_or_hybrid_sharded_base_trains_each_adapter_like_one_process(runs, mode, ranks):
    # shard_size=1: a whole base on each rank, nothing of it communicated; shard_size=2 of 4 ranks: sharded
    # within pairs (FSDP2 hybrid sharding), a layer's gathers are half the size of plain FSDP's over 4 ranks
    from lightning_multilora.base_model import build_base_model

    reports = [json.loads((runs / f"{mode}.rank{r}.json").read_text()) for r in range(ranks)]
    single = json.loads((runs / "single.rank0.json").read_text())
    assert sorted(n for r in reports for n in r["owned"]) == ["a0", "a1", "a2", "a3"]
    for report in reports:
        assert report["states"] == single["states"]
        for name, history in single["val"].items():
            assert [s for s, _ in report["val"][name]] == [s for s, _ in history]
            assert [v for _, v in report["val"][name]] == pytest.approx([v for _, v in history], rel=1e-5)
        assert not [c for c in report["calls"] if "reduce_scatter" in c[0]]
        assert all(numel <= 1 for name, numel, _ in report["calls"] if name == "all_reduce")
    model = build_base_model("tiny-llama")
    base_numel = sum(p.numel() for p in model.parameters())
    layer_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    gathers = [(numel, group) for r in reports for name, numel, group in r["calls"] if name.startswith("all_gather")]
    if mode == "replicated":
        assert not gathers and all(r["local_numel"] == 0 for r in reports)
    else:  # each pair holds one copy, half on each rank; a layer is gathered whole within a pair
        assert (layer_numel, 2) in gathers and {group for _, group in gathers} == {2}
        assert [r["local_numel"] for r in reports[:2]] == [r["local_numel"] for r in reports[2:]]
        assert sum(r["local_numel"] for r in reports[:2]) == base_numel
    for name in ("a0", "a1", "a2", "a3"):
        parallel = load_file(runs / mode / name / "adapter_model.safetensors")
        alone = load_file(runs / "single" / name / "adapter_model.safetensors")
        for key in alone:
            assert (parallel[key] - alone[key]).abs().max() <= 1e-6, (name, key)
    with pytest.raises(ValueError, match="shard_size"):
        AdapterParallelStrategy(shard_size=0)


def test_the_strategys_fixed_sizes_and_a_dtype_name_are_answered():
    """``tensor_parallel_size`` / ``data_parallel_size`` failed with Python's "got multiple values for keyword
    argument"; ``param_dtype="bfloat16"`` (as the module's ``dtype`` takes it) failed inside FSDP on every rank."""
    for fixed in ("tensor_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=rf"AdapterParallelStrategy takes no \['{fixed}'\]: it splits adapters"):
            AdapterParallelStrategy(**{fixed: 1})
    assert AdapterParallelStrategy(param_dtype="bfloat16").param_dtype == torch.bfloat16
    assert AdapterParallelStrategy(param_dtype="torch.float16").param_dtype == torch.float16
    for bad in ("bf16", torch.int8):
        with pytest.raises(ValueError, match=r"`param_dtype` must be None or a floating dtype .* got"):
            AdapterParallelStrategy(param_dtype=bad)


def test_an_early_exit_on_one_rank_reaches_the_other_and_matches_one_process(runs):
    ranks = [json.loads((runs / f"early_exit.rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((runs / "early_exit_single.rank0.json").read_text())
    assert ranks[0]["states"] == ranks[1]["states"] == single["states"]  # the exit reached the other rank
    assert single["states"]["a1"] == ["overfit", 3]  # a1 left at its first validation (step 3 of 6)
    assert sum("a1" in r["owned"] for r in ranks) == 1
    for name in ("a0", "a1", "a2", "a3"):  # the exported (best) weights are the single process's
        parallel = load_file(runs / "early_exit" / name / "adapter_model.safetensors")
        alone = load_file(runs / "early_exit_single" / name / "adapter_model.safetensors")
        assert_weights_close(parallel, alone)
    # stopped at step 2 in one process, resumed on two ranks: each adapter judged by its owner alone (the other
    # rank holds its curve from the checkpoint, and would remove an adapter it does not hold)
    resumed = [json.loads((runs / f"early_exit_resume_two.rank{r}.json").read_text()) for r in (0, 1)]
    assert resumed[0]["states"] == resumed[1]["states"] == single["states"]
    assert_weights_close(load_file(runs / "early_exit_resume_two" / "a1" / "adapter_model.safetensors"),
                         load_file(runs / "early_exit_single" / "a1" / "adapter_model.safetensors"))


def _logged(folder: Path) -> tuple[dict[tuple[int, str], float], dict[str, list[str]]]:
    """A run's CSV metrics, (step, key) -> value, and its TensorBoard texts, tag -> texts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = {}
    with open(folder / "csv" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value != "":
                    metrics[(int(row["step"]), key)] = float(value)
    events = EventAccumulator(str(folder / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    return metrics, texts


@pytest.mark.parametrize("mode", ["early_exit", "remove", "end_eval"])
def test_every_ranks_adapters_reach_rank_zeros_loggers(runs, mode):
    """Lightning's loggers write on rank 0 alone: the values of the adapters another rank trains (each step's
    training loss, gradient norm, learning rate and tokens; validation losses, those of an evaluation in a callback's
    ``on_train_end`` too; EarlyExit's smoothed loss; exit texts, a removal's by a callback run on every rank too)
    reach them through the ranks' exchange, and the two-rank run logs what one process logs, at the same steps."""
    parallel, texts = _logged(runs / f"logs_{mode}")
    single, single_texts = _logged(runs / f"logs_{mode}_single")
    assert parallel.keys() == single.keys()
    for key, value in single.items():
        assert parallel[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    logged = {"train_loss", "grad_norm", "lr", "tokens_seen", "val_loss"} | ({"train_loss_ema"} if mode == "early_exit"
                                                                             else set())
    for name in ("a0", "a1", "a2", "a3"):
        removed = (mode, name) == ("remove", "a1")  # (removed at step 2, before any validation)
        assert {k.split("/")[-1] for _, k in single if k.startswith(f"adapters/{name}/")} == \
            logged - ({"val_loss"} if removed else set()), name
    assert texts == single_texts
    exit_text = {"early_exit": "overfit", "remove": "removed by a callback", "end_eval": None}[mode]
    if exit_text is not None:
        assert any(exit_text in t for t in texts["adapters/a1/exit/text_summary"])
    if mode == "end_eval":  # (a1 and a2 still running after 2 steps: evaluated at the end, logged at step 2)
        assert {(2, "adapters/a1/val_loss"), (2, "adapters/a2/val_loss")} <= parallel.keys()
    ranks = [json.loads((runs / f"{mode}.rank{r}.json").read_text()) for r in (0, 1)]
    assert {"a0", "a1", "a2", "a3"} - set(ranks[0]["owned"])  # (rank 0 wrote adapters it did not train)
    assert ranks[0]["val"] == ranks[1]["val"]
    if mode == "end_eval":
        alone = json.loads((runs / "end_eval_single.rank0.json").read_text())["evaluated"]
        for rank in ranks:
            # trainer.validate returns every rank's held adapters (each rank had its own alone); an ended adapter
            # evaluated is refused on every rank (its owner alone refused, the other waited in a collective); the
            # checkpoint on rank 1's adapter's training loss was written every step (the ranks hung at step 1)
            assert rank["evaluated"]["validated"] == alone["validated"] == [f"adapters/a{i}/val_loss" for i in range(3)]
            assert "'a3' is finished" in rank["evaluated"]["refused"]
            assert rank["evaluated"]["best"] == alone["best"] and "step=" in rank["evaluated"]["best"]


def test_a_module_resumed_in_place_keeps_every_adapters_curve_on_every_rank(runs):
    """The same module object fit again from an earlier checkpoint: each rank sends its adapters' curves anew, and
    every rank ends with every adapter's whole training curve, as a run never stopped has it."""
    ranks = [json.loads((runs / f"refit.rank{r}.json").read_text()) for r in (0, 1)]
    never_stopped = json.loads((runs / "parallel.rank0.json").read_text())
    assert ranks[0]["train"] == ranks[1]["train"]
    assert ranks[0]["states"] == never_stopped["states"]
    for name, history in never_stopped["train"].items():
        assert [s for s, _ in ranks[0]["train"][name]] == [s for s, _ in history]
        assert [v for _, v in ranks[0]["train"][name]] == pytest.approx([v for _, v in history], rel=1e-5)


def test_a_module_fitted_again_goes_on_where_it_stopped_on_two_ranks(runs):
    """A second fit of the same module object (a new Trainer, a new strategy) knew no adapter's owner: every rank
    idled, holding the adapters it had trained, and a run without max_steps never ended. They keep their owners, and
    their optimizer states: the adapters end as a run never stopped does."""
    ranks = [json.loads((runs / f"refit_on.rank{r}.json").read_text()) for r in (0, 1)]
    never_stopped = json.loads((runs / "parallel.rank0.json").read_text())
    assert ranks[0]["states"] == ranks[1]["states"] == never_stopped["states"]
    for name in never_stopped["states"]:
        again = load_file(runs / "refit_on" / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "parallel" / name / "adapter_model.safetensors")
        for key, value in uninterrupted.items():
            torch.testing.assert_close(again[key], value, atol=1e-6, rtol=1e-5)


def test_a_callback_written_for_one_process_evaluates_and_removes_adapters_on_two_ranks(runs):
    """On every rank, after step 2: `evaluate` gave NaN for the adapters another rank holds, `remove_adapter`
    failed on the rank that did not hold a1 (it has no weights to export), and so did `save_adapter` ("holds no
    weights (running)"): each rank now writes the adapters it trains, the other's call returning None."""
    ranks = [json.loads((runs / f"remove.rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((runs / "remove_single.rank0.json").read_text())
    assert single["states"]["a1"] == ["pruned", 2]
    assert ranks[0]["states"] == ranks[1]["states"] == single["states"]
    for r in ranks:
        assert r["evaluated"].keys() == {"a0", "a1", "saved_a0", "saved_a1"}
        for name, loss in single["evaluated"].items():
            if not name.startswith("saved_"):
                assert r["evaluated"][name] == pytest.approx(loss, rel=1e-4)
    for name in ("a0", "a1"):
        assert sorted(r["evaluated"][f"saved_{name}"] for r in ranks) == [False, True]  # (written once: its owner)
        assert_weights_close(load_file(runs / "remove_saved" / name / "adapter_model.safetensors"),
                             load_file(runs / "remove_single_saved" / name / "adapter_model.safetensors"))
    assert_weights_close(load_file(runs / "remove" / "a1" / "adapter_model.safetensors"),
                         load_file(runs / "remove_single" / "a1" / "adapter_model.safetensors"))


def test_a_smoke_run_on_two_ranks_exports_into_one_temporary_folder(runs):
    """(Each rank made a temporary folder of its own: the exports split between two, the summary in rank 0's.)"""
    ranks = [json.loads((runs / f"smoke.rank{r}.json").read_text()) for r in (0, 1)]
    folders = {str(Path(path).parent) for rank in ranks for path, _ in rank["exported"].values() if path}
    assert len(folders) == 1 and "multilora-fast-dev-run-" in folders.pop()
    assert all(path for path, _ in ranks[0]["exported"].values())  # (every adapter exported, after its 2 steps)


def test_an_adapter_one_rank_cannot_start_fails_on_every_rank_and_the_others_train_on(runs):
    """(Each rank checked a starting adapter's data and `init_from` folder alone: where they disagreed, one rank
    trained an adapter the other had failed, and the ranks' registries parted.)"""
    ranks = [json.loads((runs / f"disagree.rank{r}.json").read_text()) for r in (0, 1)]
    parallel = json.loads((runs / "parallel.rank0.json").read_text())
    for rank in ranks:
        assert rank["states"]["late"] == ["failed", 0]
        assert re.fullmatch(r"adapter 'late' cannot start: RuntimeError: its data is not readable here \(raised at "
                            r".*ap_run.py:\d+\) \(on rank 1\)", rank["reasons"]["late"])
        assert {n: rank["train"][n] for n in parallel["train"]} == parallel["train"]  # the others, untouched
    assert ranks[0]["reasons"] == ranks[1]["reasons"]


def test_dpo_on_one_rank_and_sft_on_the_other_train_as_in_one_process(runs):
    """DPO's reference forward is a collective under FSDP: the rank without DPO rows (training SFT, then idle once
    its adapter finished, and in validation) joins it; every adapter ends as in one process."""
    ranks, single = load_runs(runs, "dpo")
    assert ranks[0]["owned"] == ["d"] and ranks[1]["owned"] == ["s"]
    assert ranks[0]["states"] == ranks[1]["states"] == single["states"] == {"d": ["finished", 5], "s": ["finished", 2]}
    assert ranks[0]["val"] == ranks[1]["val"]
    for name in ("d", "s"):
        assert [v for _, v in ranks[0]["val"][name]] == pytest.approx([v for _, v in single["val"][name]], rel=1e-5)
    # the DPO adapter's held-out preference accuracy: its owner's, on the other rank too (it stayed NaN there)
    assert ranks[1]["preference"] == ranks[0]["preference"] == single["preference"]
    assert 0 <= ranks[1]["preference"]["d"] <= 1
    assert_same_exports(runs, "dpo", ["d", "s"])


def test_admission_judges_each_ranks_adapters_against_one_devices_memory(runs):
    ranks = [json.loads((runs / f"admission.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["states"] == ranks[1]["states"] and ranks[0]["started"] == ranks[1]["started"]
    assert all(state == "finished" for state, _ in ranks[0]["states"].values())
    # 2 rows a rank: a0 (batch 2) on rank 0 and a1 (batch 2) on rank 1 start together (one device would start a0
    # alone); a2 and a3 (batch 1) wait until a0 frees rank 0 at step 3, then both go there
    assert ranks[0]["started"] == {"a0": 0, "a1": 0, "a2": 3, "a3": 3}
    assert ranks[0]["owned"] == ["a0", "a2", "a3"] and ranks[1]["owned"] == ["a1"]


def test_an_optuna_sweep_asks_as_many_trials_as_every_ranks_memory_admits(runs):
    pytest.importorskip("optuna")
    ranks = [json.loads((runs / f"optuna_admission.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["started"] == ranks[1]["started"] and len(ranks[0]["started"]) == 6
    # 2 rows a rank: 4 trials start at once (one device's view of the memory would have asked 3), then 2 more
    assert sorted(ranks[0]["started"].values()) == [0, 0, 0, 0, 3, 3]
    assert all(state == "finished" for state, _ in ranks[0]["states"].values())


def test_a_paused_adapter_is_admitted_only_where_its_weights_are():
    """A paused adapter keeps its weights and optimizer state on the rank that owns it: judged startable because
    another rank had room, it resumed on its own, over that device's budget (one process said it did not fit)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_multilora.scheduling import AdmissionController

    env = LightningEnvironment()
    env.set_world_size(2)  # no process group: only the placement arithmetic
    strategy = AdapterParallelStrategy()
    strategy.cluster_environment = env
    ranks = AdmissionController(lambda specs: float(sum(s.rank for s in specs)), 8.0, safety_margin=1.0)
    a, paused, b = AdapterSpec("a", rank=6), AdapterSpec("p", rank=4), AdapterSpec("b", rank=1)
    strategy.owner = {"a": 0, "p": 0, "b": 1}
    assert strategy.select_admitted(ranks, [a, b], [paused]) == [] and strategy._admitted_to == {}
    strategy.owner = {"a": 0, "p": 1, "b": 1}  # (on the rank with room: admitted there)
    assert strategy.select_admitted(ranks, [a, b], [paused]) == [paused]
    strategy.owner = {"a": 0, "b": 0}  # (none: queued, or its rank gone in a smaller resume: placed where it fits)
    assert strategy.select_admitted(ranks, [a, b], [paused]) == [paused] and strategy._admitted_to == {"p": 1}


def test_per_rank_admission_places_as_the_module_starts_adapters():
    from lightning_multilora.scheduling import AdmissionController

    from lightning.fabric.plugins.environments import LightningEnvironment

    env = LightningEnvironment()
    env.set_world_size(2)  # no process group: only the placement arithmetic
    strategy = AdapterParallelStrategy()
    strategy.cluster_environment = env
    rows = AdmissionController(lambda specs: float(sum(s.rows_per_step for s in specs)), 3.0, safety_margin=1.0)
    specs = [AdapterSpec(f"b{i}", batch_size=bs) for i, bs in enumerate([2, 2, 2, 1, 1, 1])]
    chosen = strategy.select_admitted(rows, [], specs)
    # ranks of 3 rows: b0 | b1, then b2 fits nowhere (2 + 2 > 3), b3 -> rank 0, b4 -> rank 1, b5 nowhere
    assert [s.name for s in chosen] == ["b0", "b1", "b3", "b4"]
    assert strategy.owners_if_started(chosen) == {"b0": 0, "b1": 1, "b3": 0, "b4": 1}
    # one device's view of the same controller admits 3 rows in all
    assert [s.name for s in rows.select([], specs)] == ["b0", "b3"]

    class ThreeRows:  # (a controller of the user's, fits / select / alone alone: "no attribute 'predict'")
        def fits(self, specs):
            return sum(s.rows_per_step for s in specs) <= 3

        def select(self, running, candidates, freed=None):
            return []

        def alone(self, spec):
            return None

    strategy = AdapterParallelStrategy()
    strategy.cluster_environment = env
    assert [s.name for s in strategy.select_admitted(ThreeRows(), [], specs)] == ["b0", "b1", "b3", "b4"]


def test_a_candidate_goes_to_a_rank_with_room_where_its_balanced_rank_has_none():
    """Placement balanced rows alone: a candidate balanced to a rank full by memory waited while another rank had
    room (for a trial's adapter, steps of a slot unused), and a rank over the budget (adapters a resume moved there)
    held back every rank's candidates. It goes to the first rank with room, and the module places it there."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_multilora.scheduling import AdmissionController

    env = LightningEnvironment()
    env.set_world_size(2)  # no process group: only the placement arithmetic
    strategy = AdapterParallelStrategy()
    strategy.cluster_environment = env
    by_rank = AdmissionController(lambda specs: float(sum(s.rank for s in specs)), 8.0, safety_margin=1.0)
    y, x = AdapterSpec("y", rank=1, batch_size=2), AdapterSpec("x", rank=7, batch_size=1)
    strategy.place([y, x])
    assert strategy.owner == {"y": 0, "x": 1}
    z = AdapterSpec("z", rank=2, batch_size=1)
    assert assign_adapters([y, x, z], 2, strategy.owner)["z"] == 1  # (rows: beside x, whose rank has 1 GiB left)
    assert strategy.select_admitted(by_rank, [y, x], [z]) == [z]
    assert strategy.owners_if_started([y, x, z])["z"] == 0
    strategy.place([y, x, z])
    assert strategy.owner == {"y": 0, "x": 1, "z": 0}
    # a rank over the budget holds back no other rank's candidate
    strategy.owner, big = {"y": 0}, AdapterSpec("big", rank=9, batch_size=1)
    strategy.place([y, big])
    assert strategy.owner["big"] == 1 and strategy.select_admitted(by_rank, [y, big], [z]) == [z]
    assert strategy.owners_if_started([y, big, z])["z"] == 0


def load_runs(tmp_path: Path, mode: str) -> tuple[list[dict], dict]:
    """Rank 0's and rank 1's reports of ``mode``, and the single process's (``<mode>_single``)."""
    ranks = [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, json.loads((tmp_path / f"{mode}_single.rank0.json").read_text())


def assert_same_exports(tmp_path: Path, mode: str, names) -> None:
    for name in names:
        parallel = load_file(tmp_path / mode / name / "adapter_model.safetensors")
        alone = load_file(tmp_path / f"{mode}_single" / name / "adapter_model.safetensors")
        assert parallel.keys() == alone.keys()
        assert_weights_close(parallel, alone)


def assert_weights_close(actual: dict, expected: dict, rel: float = 1e-3) -> None:
    """Per tensor, by norm: |actual - expected| <= rel |expected|. Not element by element: on another CPU (AVX2
    instead of AVX-512 kernels) Adam turns float noise into moves of up to ~lr of the few parameters whose gradient
    is ~0 (measured: 2.8e-4 of a tensor's norm), while a real difference (another batch, a lost update) moves whole
    tensors by far more (lora_B starts at zero: its norm is the training's alone)."""
    for key in expected:
        diff, scale = (actual[key].double() - expected[key].double()).norm(), expected[key].double().norm()
        assert diff <= rel * scale, f"{key}: |difference| {diff:.3g} against |expected| {scale:.3g}"


def assert_study_used_from_rank_zero_once_per_result(ranks: list[dict], study: list[dict]) -> None:
    """Rank 1 never touched a study; rank 0 asked and told each trial once and reported each validation once."""
    from collections import Counter

    assert ranks[1]["study_calls"] == []
    calls = Counter(tuple(c) for c in ranks[0]["study_calls"])
    numbers = [t["number"] for t in study]
    assert numbers == list(range(len(study)))
    assert all(calls[("ask", n)] == 1 and calls[("tell", n)] == 1 for n in numbers)
    reports = {c for c in calls if c[0] == "report"}
    assert all(calls[c] == 1 for c in reports)
    val = ranks[0]["val"]
    # (each validation at its own step, once a step; none at step 0, untrained)
    steps = {t["number"]: sorted({step for step, _ in val[t["adapter"]] if step > 0}) for t in study}
    assert reports == {("report", t["number"], step) for t in study for step in steps[t["number"]]}
    assert all(t["steps"] == steps[t["number"]] for t in study)


def assert_same_study(parallel: list[dict], single: list[dict]) -> None:
    assert [(t["number"], t["params"], t["state"], t["steps"]) for t in parallel] == [
        (t["number"], t["params"], t["state"], t["steps"]) for t in single]
    for a, b in zip(parallel, single):
        assert a["value"] == pytest.approx(b["value"], rel=1e-5)


def test_an_optuna_sweep_asks_and_tells_from_rank_zero_and_runs_the_trials_of_one_process(runs):
    pytest.importorskip("optuna")
    ranks, single = load_runs(runs, "optuna")
    # every rank queued the same trials with the same specs and ended with the same registry and sweep state
    assert ranks[0]["specs"] == ranks[1]["specs"] == single["specs"]
    assert ranks[0]["states"] == ranks[1]["states"] == single["states"]
    assert all(state == "finished" for state, _ in single["states"].values()) and len(single["states"]) == 5
    assert ranks[0]["val"] == ranks[1]["val"]
    assert ranks[0]["callbacks"] == ranks[1]["callbacks"]
    assert ranks[0]["owned"] and ranks[1]["owned"] and not set(ranks[0]["owned"]) & set(ranks[1]["owned"])
    # rank 1's own (in-memory) study stayed empty; rank 0's holds each result once, as the single process's does
    # (two random startup trials, then TPE: the later trials' parameters depend on what was told before them)
    assert ranks[1]["study"] == []
    assert_study_used_from_rank_zero_once_per_result(ranks, ranks[0]["study"])
    assert_same_study(ranks[0]["study"], single["study"])
    assert_same_exports(runs, "optuna", single["states"])


def test_trials_the_studys_pruner_prunes_at_the_last_validation_are_told_from_every_rank(runs):
    """Each owner prunes its trial; the exits reach rank 0 at once, which tells both PRUNED (rank 1's stayed RUNNING:
    the run ended before another exchange)."""
    pytest.importorskip("optuna")
    ranks = [json.loads((runs / f"optuna_prune.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["states"] == ranks[1]["states"] == {"trial-0": ["pruned", 3], "trial-1": ["pruned", 3]}
    assert ranks[0]["owned"] and ranks[1]["owned"]  # (one trial a rank)
    assert [row["state"] for row in ranks[0]["study"]] == ["PRUNED", "PRUNED"]


def test_the_default_directories_are_asked_on_every_rank(runs):
    """Without ``export_dir``, a storage or a summary path, all of them go to the log dir, which ``Trainer.log_dir``
    broadcasts from rank 0: asked by one rank alone (an export on the adapter's rank, the study on rank 0) the run
    hung. Every trial finishes and is exported there, the study and the summary beside them."""
    pytest.importorskip("optuna")
    ranks = [json.loads((runs / f"optuna_defaults.rank{r}.json").read_text()) for r in (0, 1)]
    states = ranks[0]["states"]
    assert len(states) == 3 and all(state == "finished" for state, _ in states.values()) and ranks[1]["states"] == states
    log_dir = runs / "root_optuna_defaults" / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (log_dir / "adapters").iterdir()) == sorted(states)
    assert (log_dir / "optuna.db").is_file()
    assert sorted(row["adapter"] for row in json.loads((log_dir / "sweep_summary.json").read_text())) == sorted(states)
    assert [p.name for p in log_dir.parent.iterdir()] == ["version_0"]


def test_warmup_selection_decided_on_rank_zero_keeps_what_one_process_keeps(runs):
    optuna = pytest.importorskip("optuna")
    ranks, single = load_runs(runs, "warmup")
    warmup = [r["callbacks"]["WarmupSelection"] for r in (*ranks, single)]
    assert warmup[0] == warmup[1]
    assert warmup[0]["decided"] and len(warmup[0]["candidates"]) == 4 and len(warmup[0]["kept"]) == 2
    assert (warmup[0]["candidates"], warmup[0]["kept"]) == (warmup[2]["candidates"], warmup[2]["kept"])
    assert warmup[0]["warmup_losses"] == pytest.approx(warmup[2]["warmup_losses"], rel=1e-5)
    assert ranks[0]["states"] == ranks[1]["states"] == single["states"]
    assert ranks[0]["reasons"] == ranks[1]["reasons"] == single["reasons"]
    assert sorted(state for state, _ in single["states"].values()) == ["finished", "finished", "pruned", "pruned"]
    assert ranks[0]["callbacks"]["OptunaSweep"] == ranks[1]["callbacks"]["OptunaSweep"]
    # the study, read back from its SQLite file: pruned trials told PRUNED, kept ones COMPLETE, once each
    studies = [study_rows(optuna.load_study(study_name="multilora", storage=f"sqlite:///{runs / m}.db"))
               for m in ("warmup", "warmup_single")]
    assert ranks[1]["study"] is None
    assert_study_used_from_rank_zero_once_per_result(ranks, studies[0])
    assert_same_study(*studies)
    assert {t["adapter"] for t in studies[0] if t["state"] == "PRUNED"} == {
        n for n, (state, _) in single["states"].items() if state == "pruned"}
    assert_same_exports(runs, "warmup", single["states"])  # pruned adapters too, exported by their owner


def test_a_sweep_stopped_in_its_warmup_and_resumed_ends_as_if_never_stopped(runs):
    """OptunaSweep + WarmupSelection on 2 ranks, checkpointed at step 3 (candidates paused and queued, the study
    half asked) and resumed from that checkpoint and the same SQLite study."""
    optuna = pytest.importorskip("optuna")
    stopped = [json.loads((runs / f"warmup_stop.rank{r}.json").read_text()) for r in (0, 1)]
    assert any(state in ("paused", "queued", "running") for state, _ in stopped[0]["states"].values())
    full = [json.loads((runs / f"warmup.rank{r}.json").read_text()) for r in (0, 1)]
    resumed = [json.loads((runs / f"warmup_resume.rank{r}.json").read_text()) for r in (0, 1)]
    for a, b in zip(resumed, full):
        assert a["states"] == b["states"] and a["reasons"] == b["reasons"] and a["owned"] == b["owned"]
        assert a["callbacks"]["WarmupSelection"]["kept"] == b["callbacks"]["WarmupSelection"]["kept"]
        assert a["callbacks"]["WarmupSelection"]["warmup_losses"] == pytest.approx(
            b["callbacks"]["WarmupSelection"]["warmup_losses"], rel=1e-5)
    studies = [study_rows(optuna.load_study(study_name="multilora", storage=f"sqlite:///{runs / m}.db"))
               for m in ("warmup_resumed", "warmup")]
    assert_same_study(*studies)  # no trial asked twice or lost across the restart
    for name, (state, _) in full[0]["states"].items():
        folder = "warmup_resume" if (runs / "warmup_resume" / name).exists() else "warmup_stop"
        resumed_weights = load_file(runs / folder / name / "adapter_model.safetensors")
        uninterrupted = load_file(runs / "warmup" / name / "adapter_model.safetensors")
        assert_weights_close(resumed_weights, uninterrupted)


def test_a_sweep_crashed_after_trials_were_told_resumes_on_two_ranks(runs):
    """A crash after trials were told past the checkpoint: on resume, rank 0 queued its new trial before taking up
    the told ones, the other rank after them; the ranks' registries differed in order alone, and the check of their
    agreement took it for a user's one-rank `add_adapter` (an error on every rank, at every resume)."""
    optuna = pytest.importorskip("optuna")
    crashed = json.loads((runs / "optuna_crash.rank0.json").read_text())
    assert crashed["evaluated"]["crashed"] == 13
    resumed = [json.loads((runs / f"optuna_crash_resume.rank{r}.json").read_text()) for r in (0, 1)]
    assert "refused" not in resumed[0]["evaluated"] and resumed[0]["states"] == resumed[1]["states"]
    assert sorted(resumed[0]["states"]) == [f"trial-{i}" for i in range(5)]
    assert all(state == "finished" for state, _ in resumed[0]["states"].values())
    study = optuna.load_study(study_name="multilora", storage=f"sqlite:///{runs / 'optuna_crash'}.db")
    assert sorted(t.state.name for t in study.get_trials()) == ["COMPLETE"] * 5


def test_an_error_in_rank_zeros_decision_fails_every_rank_with_its_message(runs):
    pytest.importorskip("optuna")
    # (every trial names a module the model does not have)
    failed = [json.loads((runs / f"optuna_bad_target.rank{r}.json").read_text())["evaluated"]["failed"] for r in (0, 1)]
    missing = "`target_modules` ['nope_proj'] are not among the injected layers; injected module names end in:"
    assert failed[0].startswith("UsageError: trial 0 with") and missing in failed[0]  # (before its first step)
    assert failed[1].startswith("UsageError: rank 0 failed to decide for every rank: UsageError: trial 0 with")
    assert missing in failed[1] and not any("timed out" in text.lower() for text in failed)


def test_a_4bit_base_is_refused_sharded_and_named_what_works():
    """(Sharded over two processes, a bitsandbytes 4-bit base decoded its shards wrongly after its first forward,
    silently: every later loss off; whole on each rank it trains as in one process.)"""
    pytest.importorskip("bitsandbytes")
    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.strategies.adapter_parallel import AdapterParallelStrategy

    if torch.cuda.is_available():
        model = build_base_model("tiny-llama", quantization="nf4")
    else:  # (bitsandbytes on the CPU: said)
        with pytest.warns(UserWarning, match="a 4-bit base on the CPU: it runs, slowly"):
            model = build_base_model("tiny-llama", quantization="nf4")
    with pytest.raises(ValueError, match=r"bitsandbytes-quantized base .* cannot be sharded here.*shard_size=1"):
        AdapterParallelStrategy(shard_size=2).parallelize(model, [])


def test_a_stop_asked_on_a_rank_that_does_not_train_the_adapter_is_a_named_error_on_every_rank(runs):
    """`remove_adapter` under ``trainer.is_global_zero`` for an adapter rank 1 trains was undone at the next exchange,
    silently: the adapter trained to its end, exported as finished, while rank 0's callbacks had been told it ended
    (and a `resume_adapter` after a pause so made failed on rank 0 alone, the ranks parted)."""
    for rank in (0, 1):
        said = json.loads((runs / f"one_rank_stop.rank{rank}.json").read_text())["evaluated"]["refused"]
        assert re.fullmatch(r"adapter 'a\d' is pruned on rank 0, and running on rank 1, which trains it: under adapter "
                            r"parallelism `remove_adapter`, `pause_adapter` and `resume_adapter` are called on every "
                            r"rank .*not under `trainer.is_global_zero`.*\(after step 2\)", said), said


def test_an_adapter_queued_or_unqueued_on_one_rank_alone_is_an_error_on_every_rank_not_a_hang(runs):
    """Rank 0 alone queued an adapter (under `trainer.is_global_zero`): the ranks' registries parted, rank 0 alone
    checked the adapter's data in a collective at the next admission, and both waited there until the process
    group's timeout (90 s here); likewise a queued adapter removed on rank 1 alone. Each is a named error on both
    ranks at the step's exchange, and the adapters each rank trained are exported."""
    for mode, said in (("one_rank_add", "'z': rank 0 holds it queued, rank 1 lacks it"),
                       ("one_rank_unqueue", "'w': rank 0 holds it queued, rank 1 holds it pruned")):
        for rank in (0, 1):
            ran = json.loads((runs / f"{mode}.rank{rank}.json").read_text())
            assert ran["evaluated"]["refused"] == (
                f"the ranks' adapters differ ({said}): under adapter parallelism `add_adapter`, and `remove_adapter` "
                "of a queued adapter, are called on every rank, as a callback's hooks run (not under "
                "`trainer.is_global_zero`) (after step 2)")
            assert all(ran["exported"][name][1] == 2 for name in ran["owned"])  # (trained two steps, exported)
        assert (runs / mode / "a0").is_dir() and (runs / mode / "a3").is_dir()


def test_a_pause_on_its_owner_alone_frees_the_same_slot_on_every_rank(runs):
    """Only the owner of a paused adapter knew its slot was freed: with an admission controller the ranks started
    different adapters in it (the owner the freed slot's batch size, the other the largest) and hung in the next
    collective; the other rank's registry kept the adapter's span open. (And an adapter admitted since the last
    exchange, removed by its own rank, was taken for a stop made on another rank.)"""
    single = json.loads((runs / "owner_pause_single.rank0.json").read_text())
    assert single["states"]["x"] == ["pruned", 1]
    assert single["reasons"]["x"] == "judged after its first step by its rank"
    for rank in (0, 1):
        parallel = json.loads((runs / f"owner_pause.rank{rank}.json").read_text())
        assert parallel["evaluated"]["running"] == single["evaluated"]["running"]
        assert parallel["states"] == single["states"] and parallel["spans"] == single["spans"]
        assert parallel["train"] == single["train"]


def test_the_exchange_refuses_a_removal_its_owner_did_not_make_and_forgets_a_stopped_fits_stops():
    """A removal on rank 0 alone while the owner paused the adapter went through unsaid (the adapter trained on and
    finished, rank 0's callbacks told it was pruned); and stops noted after a stopped fit's last exchange were
    checked at the next fit's first, against the states of the checkpoint it resumed (a false error)."""
    from types import SimpleNamespace as NS

    from lightning_multilora.module import _VIEWS_KEY, ExportOnException, MultiLoRAMixin
    from lightning_multilora.registry import AdapterState as S

    placement = NS(owner={"a1": 1})

    def exchange(view, owners_state):
        return {f"{_VIEWS_KEY}0": ({"a1": view}, []), f"{_VIEWS_KEY}1": ({}, []), "a1": {"state": owners_state}}

    for view, held in (((S.RUNNING, S.PRUNED), S.PAUSED), ((S.RUNNING, S.PRUNED), S.RUNNING),
                       ((S.RUNNING, S.PAUSED), S.RUNNING)):
        with pytest.raises(ValueError, match=rf"adapter 'a1' is {view[1].value} on rank 0, and {held.value} on rank "
                                             r"1, which trains it: under adapter parallelism `remove_adapter`"):
            MultiLoRAMixin._check_views(None, exchange(view, held), placement)
    for view, held in (((S.RUNNING, S.PAUSED), S.PRUNED), ((S.RUNNING, S.PRUNED), S.OVERFIT),
                       ((S.RUNNING, S.PAUSED), S.PAUSED)):  # (made on every rank; or the owner went further)
        MultiLoRAMixin._check_views(None, exchange(view, held), placement)
    module = type("Module", (), {})()  # (a stand-in: setup forgets the stops first, whatever it reads after)
    module.__dict__.update(_views={"a1": (S.RUNNING, S.PAUSED)}, _paused=["a1"])
    with pytest.raises(AttributeError):  # (the stand-in Trainer has nothing more)
        ExportOnException().setup(NS(), module, "fit")
    assert "_views" not in module.__dict__ and "_paused" not in module.__dict__
