"""Merging an adapter-parallel checkpoint's per-rank files (a run resumed on another number of ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_multilora import AdapterSpec
from lightning_multilora.callbacks import EarlyExit
from lightning_multilora.data import MultiLoRADataModule
from lightning_multilora.registry import merge_by_owner
from lightning_multilora.strategies import AdapterParallelStrategy
from lightning_multilora.strategies.rank_checkpoints import merge_rank_checkpoints


def record(name: str, step: int, state: str = "running") -> dict:
    return {"spec": AdapterSpec(name).to_dict(), "state": state, "step": step}


def rank_file(rank: int, adapters: dict[str, int], owners: dict[str, int], steps: dict[str, int],
              placeholder: bool = False) -> dict:
    """What rank ``rank`` of a 2-rank run saves: its adapters' tensors and optimizer groups (2 tensors each, ids from
    0 in its own optimizer), the registry with its own adapters' steps current."""
    groups, state, ids = [], {}, 0
    if placeholder:
        groups.append({"params": [ids], "lr": 0.0, "adapter": None})
        ids += 1
    for name, value in adapters.items():
        groups.append({"params": [ids, ids + 1], "lr": 0.1 * value, "adapter": name})
        state[ids] = {"exp_avg": torch.full((2,), float(value))}
        state[ids + 1] = {"exp_avg": torch.full((3,), float(value))}
        ids += 2
    return {
        "rank": rank, "world_size": 2, "adapter_owner": dict(owners), "global_step": 4,
        "state_dict": {f"layer.lora_A.{n}": torch.full((2,), float(v)) for n, v in adapters.items()},
        "optimizer_states": [{"state": state, "param_groups": groups}],
        "multilora": {"registry": {"records": [record(n, s if owners[n] == rank else s - 1) for n, s in steps.items()]},
                      "best_weights": {n: {"w": torch.full((1,), float(v))} for n, v in adapters.items()},
                      "dropout_steps": {n: v for n, v in adapters.items()}, "exited_since_sync": [f"x{rank}"],
                      "freed": None, "run_id": "run", "torch_rng": torch.full((1,), rank), "cuda_rng": None},
        "callbacks": {"Same": {"k": 1}, "Differs": {"k": rank},
                      "EarlyExit{}": {"watches": {n: {"ema": float(v)} for n, v in adapters.items()},
                                      "exits": [{"adapter": f"e{rank}", "step": 3 - rank}]}},
        "MultiLoRADataModule": {"streams": {n: {"epoch": 0, "position": v} for n, v in adapters.items()}},
    }


OWNERS = {"a": 0, "b": 1, "c": 1}
STEPS = {"a": 4, "b": 4, "c": 2}


def two_ranks() -> list[dict]:
    return [rank_file(0, {"a": 1}, OWNERS, STEPS), rank_file(1, {"b": 2, "c": 3}, OWNERS, STEPS, placeholder=True)]


def test_every_adapter_keeps_its_tensors_optimizer_state_and_record_from_its_owner():
    mergers = {"EarlyExit{}": EarlyExit.merge_rank_states,
               "MultiLoRADataModule": MultiLoRADataModule.merge_rank_states}
    with pytest.warns(UserWarning, match="different states for callback 'Differs'.*rank 0's is restored"):
        merged = merge_rank_checkpoints(two_ranks(), rank=0, mergers=mergers)
    assert merged["rank"] == 0 and merged["adapter_owner"] == OWNERS and merged["global_step"] == 4
    assert {k: v.tolist() for k, v in merged["state_dict"].items()} == {
        "layer.lora_A.a": [1.0, 1.0], "layer.lora_A.b": [2.0, 2.0], "layer.lora_A.c": [3.0, 3.0]}
    (opt,) = merged["optimizer_states"]
    assert [g["adapter"] for g in opt["param_groups"]] == ["a", "b", "c"]  # (rank 1's empty placeholder dropped)
    assert [g["params"] for g in opt["param_groups"]] == [[0, 1], [2, 3], [4, 5]]
    assert [g["lr"] for g in opt["param_groups"]] == pytest.approx([0.1, 0.2, 0.3])
    assert [(s["exp_avg"].numel(), s["exp_avg"][0].item()) for _, s in sorted(opt["state"].items())] == [
        (2, 1.0), (3, 1.0), (2, 2.0), (3, 2.0), (2, 3.0), (3, 3.0)]
    state = merged["multilora"]
    assert [(r["spec"]["name"], r["step"]) for r in state["registry"]["records"]] == [("a", 4), ("b", 4), ("c", 2)]
    assert sorted(state["best_weights"]) == ["a", "b", "c"] and state["dropout_steps"] == {"a": 1, "b": 2, "c": 3}
    assert state["exited_since_sync"] == ["x0", "x1"] and state["torch_rng"].item() == 0
    assert merged["callbacks"]["Same"] == {"k": 1} and merged["callbacks"]["Differs"] == {"k": 0}
    assert merged["callbacks"]["EarlyExit{}"] == {
        "watches": {"a": {"ema": 1.0}, "b": {"ema": 2.0}, "c": {"ema": 3.0}},
        "exits": [{"adapter": "e1", "step": 2}, {"adapter": "e0", "step": 3}]}
    assert merged["MultiLoRADataModule"]["streams"] == {n: {"epoch": 0, "position": v}
                                                        for n, v in {"a": 1, "b": 2, "c": 3}.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = merge_rank_checkpoints(two_ranks()[:1], rank=3)  # one part, a rank it lacks: rank 0's rng
    assert again["multilora"]["torch_rng"].item() == 0 and again["rank"] == 3


def test_a_stale_copy_never_wins_over_the_owners():
    states = [{"a": "owner's", "b": "stale"}, {"b": "owner's", "c": "only here"}]
    assert merge_by_owner(states, {"a": 0, "b": 1}) == {"a": "owner's", "b": "owner's", "c": "only here"}
    assert merge_by_owner(states, {}) == {"a": "owner's", "b": "stale", "c": "only here"}


def test_a_state_missing_from_one_ranks_file_leaves_the_others_by_their_owners():
    """Three ranks, rank 1's file without the EarlyExit and datamodule states (a callback it did not run): the merger
    sees ranks 0 and 2 only, and rank 2's adapter keeps its owner's state, not rank 0's stale copy."""
    owners = {"a": 0, "b": 1, "c": 2}
    parts = [rank_file(r, {n: v}, owners, {"a": 4, "b": 4, "c": 4}) for r, (n, v) in enumerate([("a", 1), ("b", 2),
                                                                                                ("c", 3)])]
    parts[0]["callbacks"]["EarlyExit{}"]["watches"]["c"] = {"ema": -1.0}  # rank 0's stale view of c
    parts[0]["MultiLoRADataModule"]["streams"]["c"] = {"epoch": 0, "position": -1}
    del parts[1]["callbacks"]["EarlyExit{}"], parts[1]["MultiLoRADataModule"]
    mergers = {"EarlyExit{}": EarlyExit.merge_rank_states,
               "MultiLoRADataModule": MultiLoRADataModule.merge_rank_states}
    with pytest.warns(UserWarning, match="'Differs'"):
        merged = merge_rank_checkpoints(parts, rank=0, mergers=mergers)
    assert merged["callbacks"]["EarlyExit{}"]["watches"] == {"a": {"ema": 1.0}, "c": {"ema": 3.0}}
    assert merged["MultiLoRADataModule"]["streams"] == {"a": {"epoch": 0, "position": 1},
                                                        "c": {"epoch": 0, "position": 3}}
    # rank 0's file without them: the datamodule's state is still merged, a differing state the lowest rank's
    parts = [rank_file(r, {n: v}, owners, {"a": 4, "b": 4, "c": 4}) for r, (n, v) in enumerate([("a", 1), ("b", 2),
                                                                                                ("c", 3)])]
    del parts[0]["MultiLoRADataModule"], parts[0]["callbacks"]["Differs"]
    with pytest.warns(UserWarning, match="'Differs'.*rank 1's is restored"):
        merged = merge_rank_checkpoints(parts, rank=0, mergers=mergers)
    assert merged["MultiLoRADataModule"]["streams"] == {"b": {"epoch": 0, "position": 2},
                                                        "c": {"epoch": 0, "position": 3}}
    assert merged["callbacks"]["Differs"] == {"k": 1}


def test_the_strategy_reads_every_ranks_file_when_the_run_has_another_size(tmp_path):
    folder = tmp_path / "epoch=0-step=4.ckpt"
    folder.mkdir()
    for rank, part in enumerate(two_ranks()):
        torch.save(part, folder / f"rank{rank}.ckpt")
    strategy = AdapterParallelStrategy()  # (no process group: one rank)
    with pytest.warns(UserWarning, match="different states"):
        checkpoint = strategy.load_checkpoint(folder)
    assert sorted(checkpoint["state_dict"]) == ["layer.lora_A.a", "layer.lora_A.b", "layer.lora_A.c"]
    assert strategy.owner == {"a": 0}  # rank 1's adapters: placed again when the module restores its registry
    torch.save({**two_ranks()[1], "rank": 0}, folder / "rank1.ckpt")
    with pytest.raises(ValueError, match="not one checkpoint of 2 ranks: rank1.ckpt was written by rank 0 of 2"):
        strategy.load_checkpoint(folder)
    (folder / "rank1.ckpt").rename(folder / "rank2.ckpt")
    with pytest.raises(FileNotFoundError, match=r"lacks rank1.ckpt \(of rank0..rank2.ckpt\)"):
        strategy.load_checkpoint(folder)


@pytest.mark.filterwarnings("ignore:the checkpoint's ranks saved different states")
def test_files_of_another_run_or_step_are_refused_or_ignored_and_a_save_removes_them(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    strategy = AdapterParallelStrategy()
    first, second = two_ranks()
    torch.save(first, folder / "rank0.ckpt")
    with pytest.raises(FileNotFoundError, match="lacks rank1.ckpt: it was written by 2 ranks"):
        strategy.load_checkpoint(folder)
    torch.save({**second, "global_step": 3}, folder / "rank1.ckpt")
    with pytest.raises(ValueError, match=r"rank1.ckpt was written by rank 1 of 2 at step 3 \(rank0.ckpt: step 4\)"):
        strategy.load_checkpoint(folder)
    torch.save(second, folder / "rank1.ckpt")
    torch.save({**second, "rank": 2, "world_size": 3}, folder / "rank2.ckpt")  # an earlier run's, of 3 ranks
    with pytest.warns(UserWarning, match=r"files of ranks past the 2 that wrote it \(rank2.ckpt...\)"):
        checkpoint = strategy.load_checkpoint(folder)
    assert sorted(checkpoint["state_dict"]) == ["layer.lora_A.a", "layer.lora_A.b", "layer.lora_A.c"]
    strategy.save_checkpoint({"global_step": 5}, folder)  # one rank now writes the folder again
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.ckpt"]
    saved = torch.load(folder / "rank0.ckpt", weights_only=False)
    assert (saved["world_size"], saved["rank"], saved["global_step"]) == (1, 0, 5)


def test_adapters_placed_anew_on_resume_warn_where_a_rank_exceeds_the_admission_budget():
    """`MultiLoRAMixin._place_resumed`: every adapter holding weights gets an owner, this rank keeps its own best
    weights, and a rank whose new adapters exceed one device's admission budget is warned of (they still train)."""
    from types import SimpleNamespace

    from lightning_multilora.module import MultiLoRAMixin
    from lightning_multilora.scheduling import AdmissionController

    strategy = AdapterParallelStrategy()
    strategy.owner = {"a": 0}  # b and c: owned by a rank the resumed run lacks (one rank now)
    specs = [AdapterSpec("a", batch_size=2), AdapterSpec("b", batch_size=2), AdapterSpec("c", batch_size=1)]
    records = [SimpleNamespace(spec=s) for s in specs]
    module = SimpleNamespace(registry=SimpleNamespace(holding_weights=records, running=list(records)),
                             _best_weights={"a": 1, "b": 2, "gone": 3}, admission=None)
    MultiLoRAMixin._place_resumed(module, strategy)
    assert strategy.owner == {"a": 0, "b": 0, "c": 0} and module._best_weights == {"a": 1, "b": 2}
    module.admission = AdmissionController(lambda s: float(sum(x.batch_size for x in s)) * 2**30, 4 * 2**30, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiLoRAMixin._place_resumed(module, strategy)  # a resume of the size that wrote it: as admitted then
    strategy.resized_from = 2
    with pytest.warns(UserWarning, match=r"rank 0 trains \['a', 'b', 'c'\]: 5.00 GiB predicted, over the admission "
                                         r"budget of 4.00 GiB \(the checkpoint was written by 2\)"):
        MultiLoRAMixin._place_resumed(module, strategy)
    module.registry.running.pop()  # c paused: a and b, 4 GiB, within it (admission counts the running ones)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiLoRAMixin._place_resumed(module, strategy)


@pytest.mark.filterwarnings("ignore:the checkpoint's ranks saved different states")
def test_a_rank_file_alone_is_refused_and_an_older_folder_is_sized_by_its_step(tmp_path):
    folder = tmp_path / "epoch=0-step=4.ckpt"
    folder.mkdir()
    first, second = two_ranks()
    torch.save(second, folder / "rank1.ckpt")
    strategy = AdapterParallelStrategy()
    with pytest.raises(ValueError, match=r"rank1.ckpt is rank 1's file of a checkpoint of 2 ranks: resume from its "
                                         r"folder"):
        strategy.load_checkpoint(folder / "rank1.ckpt")
    # written before the files said their size, over a 3-rank run's folder: rank2.ckpt is of another step
    for rank, part in enumerate([first, second, {**second, "rank": 2, "global_step": 3}]):
        torch.save({k: v for k, v in part.items() if k != "world_size"}, folder / f"rank{rank}.ckpt")
    with pytest.warns(UserWarning, match=r"files of ranks past the 2 that wrote it \(rank2.ckpt...\)"):
        checkpoint = strategy.load_checkpoint(folder)
    assert sorted(checkpoint["state_dict"]) == ["layer.lora_A.a", "layer.lora_A.b", "layer.lora_A.c"]
    assert strategy.resized_from == 2 and strategy.owner == {"a": 0}


def test_differing_states_no_attached_callback_loads_are_not_warned_of():
    """A 2-rank checkpoint validated in one process without its callbacks warned that EarlyExit's (or any) ranks'
    states differed and rank 0's "is restored": nothing restores them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = merge_rank_checkpoints(two_ranks(), rank=0, mergers={}, attached=set())
    assert merged["callbacks"]["Differs"] == {"k": 0}
    with pytest.warns(UserWarning, match=r"'Differs' and it defines no merge_rank_states"):
        merge_rank_checkpoints(two_ranks(), rank=0, mergers={}, attached={"Differs"})
