"""WarmupSelection: all K candidates warm up through M < K slots; the top 25% train on."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule, SweepGrid, WarmupSelection
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.registry import AdapterState


def test_warmup_selection_keeps_the_top_quarter_of_more_candidates_than_slots(tmp_path, trainer_kwargs):
    grid = SweepGrid(axes={"lr": [1e-4, 1e-3, 5e-3, 2e-2], "rank": [2, 8]}, base={"max_steps": 40, "batch_size": 2})
    module = MultiLoRAModule("tiny-llama", grid=grid, max_running=3, export_dir=str(tmp_path / "out"))
    selection = WarmupSelection(warmup_fraction=0.1, keep_fraction=0.25)
    concurrent = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            concurrent.append(len(batch["layout"].names))

    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(400)}, max_val_examples=16)
    L.Trainer(**trainer_kwargs, callbacks=[selection, Watch()]).fit(module, dm)

    names = [s.name for s in grid.specs()]
    assert set(selection.warmup_losses) == set(names)  # every candidate warmed up, through 3 slots
    assert max(concurrent) == 3
    ranked = sorted(names, key=selection.warmup_losses.get)
    assert selection.kept == ranked[:2]  # 25% of 8
    for name in names:
        rec = module.registry[name]
        assert rec.val_losses[0] == (4, selection.warmup_losses[name])  # compared after the same 4 steps
        if name in selection.kept:
            assert rec.state == AdapterState.FINISHED and rec.step == 40
        else:
            assert rec.state == AdapterState.PRUNED and rec.step == 4 and "warmup selection" in rec.reason
            assert rec.export_path is not None  # what it trained is kept on disk
    assert not module.lora_layers.adapter_names and not module.trainer.optimizers[0].state


def test_kept_adapters_beyond_max_running_wait_for_a_slot_and_all_train(tmp_path, trainer_kwargs):
    """More kept than `max_running` allows: the best resume at once, the others wait paused (in `waiting`, saved
    with the callback's state) and resume as the first finish; every kept adapter trains to its end."""
    grid = SweepGrid(axes={"lr": [1e-4, 1e-3, 5e-3, 2e-2, 5e-2, 1e-1]}, base={"max_steps": 12, "batch_size": 2,
                                                                               "rank": 2})
    module = MultiLoRAModule("tiny-llama", grid=grid, max_running=2, export_dir=str(tmp_path / "out"))
    selection = WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5)
    running, saved = [], []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            running.append(len(pl_module.registry.running))
            if selection.waiting and not saved:
                saved.append(selection.state_dict())

    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=8)
    L.Trainer(**trainer_kwargs, callbacks=[selection, Watch()]).fit(module, dm)

    assert len(selection.kept) == 3 and max(running) == 2
    assert saved and saved[0]["waiting"] == selection.kept[2:]  # the third waited, the best two trained first
    for name in selection.kept:
        assert module.registry[name].state == AdapterState.FINISHED and module.registry[name].step == 12
    firsts = [module.registry[n].spans[-1][0] for n in selection.kept]
    assert firsts[2] > max(firsts[:2])  # resumed after the first two
    restored = WarmupSelection()
    restored.load_state_dict(saved[0])
    assert restored.waiting == saved[0]["waiting"] and restored.decided


def test_a_selection_given_to_another_fit_selects_afresh(tmp_path, trainer_kwargs):
    """The same callback object in a second fit (a new sweep, its adapters' names the last one's): it used to count
    the selection as made and kept every candidate."""
    selection = WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5)
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=8)
    for run in range(2):
        specs = [AdapterSpec(f"c{i}", lr=lr, max_steps=8, batch_size=2)
                 for i, lr in enumerate([1e-4, 1e-2, 3e-2, 1e-3])]
        module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / f"out{run}"))
        L.Trainer(**trainer_kwargs, callbacks=[selection]).fit(module, dm)
        states = sorted(r.state.value for r in module.registry)
        assert states == ["finished", "finished", "pruned", "pruned"], (run, states)
        assert len(selection.kept) == 2 and set(selection.warmup_losses) == {s.name for s in specs}


@pytest.mark.parametrize("same_objects", [True, False])
def test_another_fit_of_a_module_stopped_mid_selection_goes_on_with_it(tmp_path, trainer_kwargs, same_objects):
    """A fit stopped (``max_steps``) while warmed-up candidates waited, paused, for the selection, then fitted again
    (the same callback or a new one): the selection started over, the paused candidates stayed paused for good and
    the others trained whatever their rank. It goes on now as the run that was not stopped; so do EarlyExit's
    averages and patience counters (`carried_callback_state`), which started over."""
    from lightning_multilora import EarlyExit

    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=8)

    def run(stops: list[int]) -> tuple[MultiLoRAModule, WarmupSelection, EarlyExit]:
        specs = [AdapterSpec(f"c{i}", lr=lr, max_steps=8, batch_size=2, seed=i)
                 for i, lr in enumerate([1e-4, 1e-2, 3e-2, 1e-3])]
        module = MultiLoRAModule("tiny-llama", adapters=specs, max_running=2, export_dir=str(tmp_path / f"{stops}"))
        callbacks = [WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5), EarlyExit()]
        for stop in stops:
            if not same_objects:
                callbacks = [WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5), EarlyExit()]
            L.Trainer(**{**trainer_kwargs, "max_steps": stop, "val_check_interval": 3},
                      callbacks=callbacks).fit(module, dm)
        return module, *callbacks

    (once, selection, _), (twice, carried, early_exit) = run([-1]), run([3, -1])
    assert [r.state.value for r in twice.registry] == [r.state.value for r in once.registry]
    assert carried.kept == selection.kept and carried.warmup_losses == selection.warmup_losses
    assert [r.step for r in twice.registry] == [r.step for r in once.registry]
    kept = carried.kept[0]
    assert early_exit.watches[kept].evaluated_steps[0] < 3 <= early_exit.watches[kept].evaluated_steps[-1]


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup_fraction": 0.0}, "`warmup_fraction` must be a number in \\(0, 1\\)"),
    ({"warmup_fraction": "0.1"}, "`warmup_fraction` must be a number in \\(0, 1\\), got '0.1'"),
    ({"keep_fraction": 1.5}, "`keep_fraction` must be a number in \\(0, 1\\]"),
    ({"min_keep": 0}, "`min_keep` must be an integer >= 1"),
    ({"min_keep": 1.5}, "`min_keep` must be an integer >= 1, got 1.5"),  # (was a TypeError at the ranking)
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupSelection(**kwargs)


def test_selection_rule():
    rule = WarmupSelection(keep_fraction=0.25)
    assert rule.select({"a": 3.0, "b": 1.0, "c": 2.0, "d": float("nan")}, num_candidates=9) == ["b", "c", "a"]
    assert rule.select({"a": 3.0}, num_candidates=2) == ["a"]
    # ceil of the exact product: 0.07 x 100 is 7.000000000000001 in floats, which kept 8
    losses = {f"t{i}": float(i) for i in range(100)}
    for fraction, kept in ((0.07, 7), (0.14, 14), (0.28, 28), (0.55, 55), (0.071, 8)):
        assert len(WarmupSelection(keep_fraction=fraction, min_keep=1).select(losses, num_candidates=100)) == kept
    # a tie for the last places kept: in the order the candidates warmed up ("trial-10" sorted before "trial-2"), said
    # (a one-step warmup at a learning-rate warmup's rate 0 leaves every candidate the base: all tied)
    tied = {f"trial-{i}": 5.8436 for i in (2, 3, 10, 11)}
    with pytest.warns(UserWarning, match=r"candidates \['trial-2', 'trial-3', 'trial-10', 'trial-11'\] tied at warmup "
                                         r"loss 5.8436 for the last places kept: kept in the order they warmed up"):
        assert rule.select(tied, num_candidates=4) == ["trial-2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rule.select({"a": 1.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 4.0}, num_candidates=8) == ["a", "b"]


def test_a_tie_in_the_selection_keeps_the_candidate_that_warmed_up_first():
    """Ranked in the order the candidates started (a longer one started first warms up later), where the warning
    said "in the order they warmed up"."""
    from types import SimpleNamespace

    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    for name in ("long", "short"):  # (started in this order; "short" warmed up first)
        registry.add(AdapterSpec(name)).state = AdapterState.PAUSED
    selection = WarmupSelection(keep_fraction=0.5)
    selection.candidates, selection.warmup_losses = ["long", "short"], {"short": 2.0, "long": 2.0}
    trainer = SimpleNamespace(callbacks=[], datamodule=SimpleNamespace(source_name=lambda dataset: "arith"))
    with pytest.warns(UserWarning, match=r"candidates \['short', 'long'\] tied .* kept in the order they warmed up"):
        decision = selection._selection(trainer, registry)
    assert decision["kept"] == ["short"] and list(decision["pruned"]) == ["long"]


def test_candidates_of_another_objective_or_source_are_ranked_apart():
    """A DPO adapter that had learned nothing (its loss log 2) was kept over SFT adapters that had learned, their
    losses near 5: the ranking mixed losses that do not compare."""
    from types import SimpleNamespace

    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    losses = {"sft-good": 5.45, "sft-bad": 6.55, "dpo-good": 0.42, "dpo-bad": 0.693, "gsm-a": 2.0, "gsm-b": 1.0}
    for name in losses:
        spec = AdapterSpec(name, objective="dpo" if name.startswith("dpo") else "sft",
                           dataset="gsm8k" if name.startswith("gsm") else None)
        registry.add(spec).state = AdapterState.PAUSED
    selection = WarmupSelection(keep_fraction=0.5)
    selection.candidates, selection.warmup_losses = list(losses), dict(losses)
    decision = selection._selection(SimpleNamespace(callbacks=[]), registry)
    assert sorted(decision["kept"]) == ["dpo-good", "gsm-b", "sft-good"]
    assert decision["kept"][:1] == ["sft-good"]  # (each group's best first, in turn)
    said = decision["pruned"]["dpo-bad"]
    # one group: select's order (a NaN last, ties in warmup order); the first source by its name and by None alike;
    # betas apart
    registry = AdapterRegistry()
    losses = {"a": 3.0, "b": float("nan"), "c": 1.0, "d": 2.0, "z": 1.5, "y": 1.5, "beta": 0.2}
    for name in losses:
        spec = AdapterSpec(name, dataset="arith" if name in "cz" else None,
                           objective="dpo" if name == "beta" else "sft", dpo_beta=2.0)
        registry.add(spec).state = AdapterState.PAUSED
    one = WarmupSelection(keep_fraction=0.6)
    one.candidates, one.warmup_losses = [n for n in losses if n != "beta"], dict(losses)
    trainer = SimpleNamespace(callbacks=[], datamodule=SimpleNamespace(source_name=lambda d: d or "arith"))
    decision = one._selection(trainer, registry)
    assert decision["kept"] == one.select({n: losses[n] for n in one.candidates}, 6) == ["c", "z", "y", "d"]
    assert "ranked 2 of 2 among the dpo adapters (beta 0.1) on the first source; kept the top 1 of 2" in said


def test_the_warmup_rounds_half_up_and_a_candidate_without_a_source_is_ranked_apart():
    """(Python's round took 5% of 50 steps to 2 and of 70 to 4; a candidate that failed as it started, its `dataset`
    no source, crashed the ranking of the others, and every resume of the run.)"""
    from types import SimpleNamespace

    from lightning_multilora.registry import AdapterRegistry

    rule = WarmupSelection()
    assert [rule.warmup_steps(m) for m in (10, 30, 50, 70, 90, 100)] == [1, 2, 3, 4, 5, 5]
    # a warmup of the whole run (0.95 of 10 steps, rounded up) ended as the adapters finished: none was ranked, and
    # the selection kept and pruned nothing, unsaid; it ends a step short of the run now
    assert [WarmupSelection(warmup_fraction=0.95).warmup_steps(m) for m in (1, 2, 10, 100)] == [1, 1, 9, 95]
    registry = AdapterRegistry()
    for name, state in (("a", AdapterState.PAUSED), ("b", AdapterState.PAUSED), ("typo", AdapterState.FAILED)):
        registry.add(AdapterSpec(name, dataset="arithmetc" if name == "typo" else None)).state = state

    def source_name(dataset):
        if dataset is not None:
            raise ValueError(f"adapter dataset {dataset!r} is not a data source")
        return "arith"

    selection = WarmupSelection(keep_fraction=0.5)
    selection.candidates, selection.warmup_losses = ["a", "b", "typo"], {"a": 2.0, "b": 1.0}
    trainer = SimpleNamespace(callbacks=[], datamodule=SimpleNamespace(source_name=source_name))
    decision = selection._selection(trainer, registry)
    assert decision["kept"] == ["b"] and list(decision["pruned"]) == ["a"]


def test_a_selection_of_a_warmup_rounded_up_to_the_whole_run_is_still_made(tmp_path, trainer_kwargs):
    """0.95 of 10 steps rounded up to 10: every candidate finished as its warmup ended, and WarmupSelection kept and
    pruned none, without a word."""
    specs = [AdapterSpec(f"c{i}", rank=2, max_steps=4, lr=lr) for i, lr in enumerate([1e-4, 1e-3, 3e-2])]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path / "out"))
    selection = WarmupSelection(warmup_fraction=0.95, keep_fraction=0.3)
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(100)}, max_val_examples=4)
    L.Trainer(**trainer_kwargs, callbacks=[selection]).fit(module, dm)
    states = {r.name: (r.state, r.step) for r in module.registry}
    assert sorted(states.values()) == [(AdapterState.FINISHED, 4), (AdapterState.PRUNED, 3), (AdapterState.PRUNED, 3)]
    assert selection.decided and len(selection.kept) == 1 and set(selection.warmup_losses) == set(states)


def test_a_one_step_candidate_is_said_to_finish_unranked():
    from lightning_multilora.registry import AdapterRegistry

    registry = AdapterRegistry()
    for name, steps in (("one", 1), ("two", 2)):
        rec = registry.add(AdapterSpec(name, max_steps=steps))
        rec.state, rec.max_steps = AdapterState.RUNNING, steps  # (the module sets its length as it starts)
    with pytest.warns(UserWarning, match=r"WarmupSelection: adapters \['one'\] train for one step: their warmup cannot "
                                         r"end before they finish, so they finish unranked"):
        assert WarmupSelection()._warmed_up(registry)["candidates"] == ["one", "two"]


def test_warmup_selection_on_another_module_is_named(tmp_path, trainer_kwargs):
    """It failed at the train start with "'BoringModel' object has no attribute 'registry'"."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(TypeError, match="WarmupSelection needs a MultiLoRAMixin module"):
        L.Trainer(**{**trainer_kwargs, "max_steps": 1}, callbacks=[WarmupSelection()]).fit(BoringModel())


def test_an_adapter_started_after_the_selection_is_said_to_skip_it(tmp_path, trainer_kwargs):
    """(Added once the ranking was made, adapters trained unranked, silently.)"""
    class AddLate(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 6:
                pl_module.add_adapter(AdapterSpec("late", rank=2, max_steps=3, batch_size=2))

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec(f"c{i}", rank=2, max_steps=8, batch_size=2, seed=i)
                                                     for i in range(4)], export_dir=str(tmp_path / "out"))
    selection = WarmupSelection(warmup_fraction=0.25)
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=8)
    with pytest.warns(UserWarning, match=r"WarmupSelection: adapters \['late'\] started after its selection was "
                                         r"made: they train without a warmup ranking"):
        L.Trainer(**trainer_kwargs, callbacks=[selection, AddLate()]).fit(module, dm)
    assert selection.decided and "late" not in selection.warmup_losses
    assert module.registry["late"].state == AdapterState.FINISHED


def test_warmup_selection_ranks_once_a_sweeps_grid_is_used_up_before_its_n_trials(tmp_path, trainer_kwargs):
    """An Optuna grid with fewer points than ``n_trials``: the sweep has no more candidates once every point is
    asked, so the selection ranks the warmed-up trials instead of waiting for trials that never come (the run used
    to stop there, every trial paused after its warmup)."""
    from lightning_multilora import OptunaSweep

    # two points through two slots: the sweep asks both at once, and learns the grid is used up only at its next ask
    sweep = OptunaSweep({"rank": {"type": "categorical", "choices": [2, 8]}}, n_trials=4, sampler="grid",
                        base={"max_steps": 20, "batch_size": 2}, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    selection = WarmupSelection(warmup_fraction=0.2, keep_fraction=0.5)
    module = MultiLoRAModule("tiny-llama", max_running=2, export_dir=str(tmp_path / "out"))
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(400)}, max_val_examples=16)
    L.Trainer(**trainer_kwargs, callbacks=[sweep, selection]).fit(module, dm)
    assert selection.decided and len(selection.kept) == 1 and len(module.registry) == 2
    assert sorted(r.state.value for r in module.registry) == ["finished", "pruned"]


class _LastCandidateKnownAtTheFill(Callback):
    """A candidate provider whose last word comes as the module fills the slots: pending until its ``fill_slots``
    (a resumed sweep counts the trials told after its checkpoint there), then none."""

    def __init__(self, told: bool = False):
        self.pending, self.told = True, told

    def has_pending_candidates(self) -> bool:
        return self.pending

    def fill_slots(self, trainer, pl_module) -> None:
        if self.pending and all(r.state == AdapterState.PAUSED for r in pl_module.registry):
            self.pending = False
            if self.told:  # (a trial told after the resumed checkpoint: in the registry, ended, as it ended before)
                pl_module.registry.add(AdapterSpec("told", rank=2)).state = AdapterState.PRUNED


@pytest.mark.parametrize("provider_first, told", [(True, False), (False, False), (True, True)])
def test_a_selection_due_once_the_provider_fills_the_slots_is_made_then(trainer_kwargs, provider_first, told):
    """The selection waited for a provider's pending candidates at the step's end; the provider, filling the slots
    after it, had none, and the module ended the run with every candidate paused (a resumed sweep: its export of a
    finished trial overwritten by warmup weights). The selection is made at the fill now, whatever the order, and
    counts a candidate the fill brought (a trial told after the checkpoint: the top half of 3 keeps 2)."""
    module = MultiLoRAModule("tiny-llama", max_running=2, validate_on_finish=False,
                             adapters=[AdapterSpec(n, rank=2, max_steps=12, lr=lr, seed=i)
                                       for i, (n, lr) in enumerate((("a", 1e-2), ("b", 1e-4)))])
    selection = WarmupSelection(warmup_fraction=0.25, keep_fraction=0.5)
    provider = _LastCandidateKnownAtTheFill(told)
    callbacks = [provider, selection] if provider_first else [selection, provider]
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(200)}, max_val_examples=8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs, callbacks=callbacks).fit(module, dm)
    assert not [w for w in seen if "nothing is left to run" in str(w.message)]
    assert selection.decided and len(selection.kept) == (2 if told else 1)
    for name in ("a", "b"):
        rec = module.registry[name]
        if name in selection.kept:
            assert (rec.state, rec.step) == (AdapterState.FINISHED, 12)
        else:
            assert rec.state == AdapterState.PRUNED


def test_a_selection_under_way_resumed_with_other_settings_keeps_the_checkpoints_and_says_so():
    """The settings were not saved: a resume with another `warmup_fraction` warmed the later candidates up longer
    and ranked them beside those warmed up before (one trained 2.5 times longer won), unsaid."""
    first = WarmupSelection(warmup_fraction=0.1)
    first.candidates, first.warmup_losses = ["c0", "c1", "c2"], {"c0": 3.0}
    resumed = WarmupSelection(warmup_fraction=0.25, min_keep=2)
    with pytest.warns(UserWarning, match=r"the checkpoint's WarmupSelection ran with warmup_fraction=0.1, min_keep=1 "
                                         r"\(now warmup_fraction=0.25, min_keep=2\): its selection under way keeps "
                                         r"them"):
        resumed.load_state_dict(first.state_dict())
    assert (resumed.warmup_fraction, resumed.min_keep) == (0.1, 1)
    assert resumed.warmup_steps(40) == first.warmup_steps(40)
    from types import SimpleNamespace  # (another fit of the module goes on with its last fit's selection: said so)

    module = SimpleNamespace(registry=[], carried_callback_state=lambda callback: first.state_dict())
    with pytest.warns(UserWarning, match=r"the last fit's WarmupSelection ran with warmup_fraction=0.1"):
        WarmupSelection(warmup_fraction=0.25).setup(None, module, "fit")
    first.decided = True  # (made: the settings decide nothing more)
    later = WarmupSelection(warmup_fraction=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        later.load_state_dict(first.state_dict())
    assert later.warmup_fraction == 0.25
