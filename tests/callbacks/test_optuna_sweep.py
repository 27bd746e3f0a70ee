"""OptunaSweep: trials fill slots, states and values land in a real SQLite study, resume loses nothing."""

from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path

import lightning as L
import pytest

optuna = pytest.importorskip("optuna")  # absent on the GPU image; installed by `make test`

from lightning_multilora import MultiLoRADataModule, MultiLoRAModule, OptunaSweep, WarmupSelection
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.registry import AdapterRecord, AdapterState

SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
         "rank": {"type": "categorical", "choices": [2, 4]}}


def dm() -> MultiLoRADataModule:
    return MultiLoRADataModule(sources={"a": GeneratedArithmetic(300)}, max_val_examples=16)


def fit(tmp_path, trainer_kwargs, sweep, callbacks=(), ckpt=None, **kwargs):
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"))
    trainer = L.Trainer(**dict(trainer_kwargs, **{"val_check_interval": 3, **kwargs}), callbacks=[sweep, *callbacks])
    trainer.fit(module, dm(), ckpt_path=ckpt)
    return trainer, module


def test_trials_fill_slots_and_are_told_complete_in_sqlite(tmp_path, trainer_kwargs):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = OptunaSweep(SPACE, n_trials=5, storage=storage, base={"max_steps": 6, "batch_size": 2}, slots=2)
    _, module = fit(tmp_path, trainer_kwargs, sweep)
    study = optuna.load_study(study_name="multilora", storage=storage)  # read back from the file
    trials = study.get_trials()
    assert len(trials) == 5 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:
        rec = module.registry[f"trial-{t.number}"]
        assert rec.state == AdapterState.FINISHED and t.user_attrs["adapter"] == rec.name
        assert t.value == pytest.approx(rec.last_val_loss)  # (no EarlyExit: the export holds the last weights)
        assert rec.spec.lr == t.params["lr"] and rec.spec.rank == t.params["rank"]
        assert rec.spec.alpha == 2 * rec.spec.rank
        assert set(t.intermediate_values) == {step for step, _ in rec.val_losses if step > 0}  # (0: untrained)
        assert t.user_attrs["adapter_spec"] == {k: v for k, v in rec.spec.to_dict().items() if k != "name"}
        assert t.user_attrs["adapter_spec"]["alpha"] == 2 * t.params["rank"]  # (derived: in no param)
    assert {r.name for r in module.registry} == {f"trial-{i}" for i in range(5)}


def test_a_dpo_trial_records_the_preference_accuracy_of_the_weights_its_value_is_of(tmp_path, trainer_kwargs):
    """(The study had the DPO losses alone, while the sweep's own warning says to compare DPO trials on their
    preference accuracy.)"""
    from lightning_multilora.data import PreferenceSource

    pairs = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(40)]
    sweep = OptunaSweep({"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}, n_trials=2,
                        base={"max_steps": 4, "batch_size": 2, "objective": "dpo"}, slots=2)
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"))
    L.Trainer(**dict(trainer_kwargs, val_check_interval=2), callbacks=[sweep]).fit(
        module, MultiLoRADataModule(sources={"p": PreferenceSource(records=pairs)}, max_val_examples=8))
    for trial in sweep.study.get_trials():
        rec = module.registry[trial.user_attrs["adapter"]]
        assert trial.value == pytest.approx(rec.last_val_loss)
        assert trial.user_attrs["adapter_exit"]["val_preference_accuracy"] == rec.last_val_preference_accuracy


def test_trial_handles_are_opened_only_to_report_new_validations(tmp_path, trainer_kwargs, monkeypatch):
    # A Trial handle reads the storage; opening one per trial at every step cost ~1 ms each (60 trials: 70 ms).
    opened = []
    init = optuna.trial.Trial.__init__

    def counting(self, study, trial_id):
        opened.append(trial_id)
        init(self, study, trial_id)

    monkeypatch.setattr(optuna.trial.Trial, "__init__", counting)
    sweep = OptunaSweep(SPACE, n_trials=2, base={"max_steps": 9, "batch_size": 2}, slots=2,
                        storage=f"sqlite:///{tmp_path / 'study.db'}")
    trainer, module = fit(tmp_path, trainer_kwargs, sweep)
    assert trainer.global_step == 9
    validations = sum(len(r.val_losses) for r in module.registry)  # at steps 3, 6, 9 (and on finishing)
    assert validations >= 6 and all(t.intermediate_values for t in sweep.study.get_trials())
    # one handle per ask (Optuna's own) and at most one per reported validation; none on the other steps (18)
    assert len(opened) <= 2 + validations


def test_an_enqueued_value_the_search_space_does_not_hold_is_said_unused(tmp_path):
    """A "known good baseline" enqueued with a field nobody searches (`dropout`) trained without it, unsaid."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="q")
    study.enqueue_trial({"lr": 5e-3, "rank": 4, "dropout": 0.1})
    sweep = OptunaSweep(SPACE, n_trials=2, study=study)
    sweep._ensure_study(None)
    with pytest.warns(UserWarning, match=r"trial 0 was enqueued with \['dropout'\], which the search space \(\['lr', "
                                         r"'rank'\]\) does not hold: not used .*give a field fixed for every trial in "
                                         r"`base`"):
        trial = sweep._ask_trial(study)
    assert trial.params == {"lr": 5e-3, "rank": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a trial not enqueued: nothing said)
        sweep._ask_trial(study)


def test_enqueued_trials_go_first_and_warmup_pruning_is_told_pruned(tmp_path, trainer_kwargs):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="q")
    study.enqueue_trial({"lr": 5e-3, "rank": 4})
    sweep = OptunaSweep(SPACE, n_trials=4, study=study, base={"max_steps": 20, "batch_size": 2}, slots=2)
    _, module = fit(tmp_path, trainer_kwargs, sweep, callbacks=[WarmupSelection(warmup_fraction=0.1)])
    trials = study.get_trials()
    assert trials[0].params == {"lr": 5e-3, "rank": 4}
    states = [t.state for t in trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 1  # 25% of 4
    assert states.count(optuna.trial.TrialState.PRUNED) == 3
    for t in trials:
        assert (module.registry[f"trial-{t.number}"].state == AdapterState.PRUNED) == (
            t.state == optuna.trial.TrialState.PRUNED)


def test_an_exhausted_grid_ends_the_run_cleanly(tmp_path, trainer_kwargs):
    grid_space = {"lr": {"type": "categorical", "choices": [1e-3, 3e-3]},
                  "rank": {"type": "categorical", "choices": [2, 4]}}
    sweep = OptunaSweep(grid_space, n_trials=50, sampler="grid", base={"max_steps": 3, "batch_size": 1}, slots=3)
    trainer, module = fit(tmp_path, trainer_kwargs, sweep, default_root_dir=str(tmp_path))
    trials = sweep.study.get_trials()
    assert len(trials) == 4 and sweep.exhausted
    assert sorted((t.params["lr"], t.params["rank"]) for t in trials) == [(1e-3, 2), (1e-3, 4), (3e-3, 2), (3e-3, 4)]
    assert sweep.storage.startswith("sqlite:///") and sweep.storage.endswith("optuna.db")  # the default storage


def test_kill_and_resume_loses_and_duplicates_no_trial(tmp_path, trainer_kwargs):
    storage = f"sqlite:///{tmp_path / 'resume.db'}"

    def sweep():
        return OptunaSweep(SPACE, n_trials=5, storage=storage, base={"max_steps": 6, "batch_size": 2}, slots=2)

    with pytest.warns(UserWarning, match=r"stay RUNNING in study 'multilora': the Trainer stopped") as said:
        trainer, first = fit(tmp_path, trainer_kwargs, sweep(), max_steps=8)  # "killed" after 8 steps
    ckpt = tmp_path / "kill.ckpt"
    trainer.save_checkpoint(ckpt)
    running_at_kill = [t.number for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()
                       if t.state == optuna.trial.TrialState.RUNNING]
    assert running_at_kill  # the kill interrupted live trials
    told = str([w.message for w in said if "RUNNING" in str(w.message)][0])
    assert f"trials {running_at_kill} stay RUNNING" in told
    assert "no checkpoint of this run was saved: fitting this module again goes on with them" in told  # (none here)
    _, resumed = fit(tmp_path, trainer_kwargs, sweep(), ckpt=str(ckpt))
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]  # none lost, none duplicated
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert {r.name for r in resumed.registry} == {f"trial-{t.number}" for t in trials}
    for t in trials:  # study and registry agree
        assert t.value == pytest.approx(resumed.registry[f"trial-{t.number}"].best_val_loss)
    # the trials asked after the resume have the uninterrupted run's parameters (each ask is seeded by the seed
    # and the study's trial count: a sampler made anew at the resume does not start its draws over)
    storage = f"sqlite:///{tmp_path / 'full.db'}"
    fit(tmp_path / "full", trainer_kwargs, sweep())
    full = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.params for t in full] == [t.params for t in trials]


def test_a_second_run_on_a_study_asks_new_configurations(tmp_path, trainer_kwargs):
    """A script run again against its study (no checkpoint) asks configurations its first run did not: Optuna's
    usual workflow. Before, every run's sampler started from the same seed and asked the same ones again."""
    storage = f"sqlite:///{tmp_path / 'again.db'}"
    for run in range(2):
        sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, sampler="random",
                            base={"max_steps": 2, "batch_size": 1}, slots=2)
        fit(tmp_path / f"run{run}", trainer_kwargs, sweep)
    params = [t.params for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()]
    assert len(params) == 4 and params[2:] != params[:2] and len({p["lr"] for p in params}) == 4


def test_bad_search_space():
    with pytest.raises(ValueError, match="`type` can be float, int, categorical"):
        OptunaSweep({"lr": {"type": "loguniform", "low": 1e-5, "high": 1e-3}})
    with pytest.raises(ValueError, match="needs `low` and `high`"):
        OptunaSweep({"lr": {"type": "float"}})
    with pytest.raises(ValueError, match="`search_space` 'rank': its value 0 makes no valid adapter .*`rank` must be an "
                                         "integer >= 1") as raised:
        OptunaSweep({"rank": {"type": "categorical", "choices": [0, 4]}})
    assert "'check'" not in str(raised.value)
    with pytest.raises(ValueError, match="`search_space` 'rank': its value 0 makes no valid adapter"):
        OptunaSweep({"rank": {"type": "int", "low": 0, "high": 8}})
    # a bad value is named under its own parameter, not the first one checked beside it
    with pytest.raises(ValueError, match="`search_space` 'rank': its value 0 makes no valid adapter"):
        OptunaSweep({"lr": {"type": "float", "low": 1e-4, "high": 1e-2},
                     "rank": {"type": "categorical", "choices": [0, 8]}})
    with pytest.raises(ValueError, match=r"`search_space` \['max_epochs', 'max_steps'\]: their values together make "
                                         r"no valid adapter \(.*exclusive"):  # (each valid alone)
        OptunaSweep({"max_steps": {"type": "int", "low": 5, "high": 9},
                     "max_epochs": {"type": "float", "low": 0.5, "high": 1.0}})
    with pytest.raises(ValueError, match=r"'max_epochs': its value 0.5 makes no valid adapter with `base` "
                                         r"\{'max_steps': 4\} \(.*exclusive"):  # (the conflict's other half named)
        OptunaSweep({"max_epochs": {"type": "float", "low": 0.5, "high": 1.0}}, base={"max_steps": 4})
    with pytest.raises(ValueError, match=r"'rank': its value 0 makes no valid adapter \("):  # (its own: no base said)
        OptunaSweep({"rank": {"type": "int", "low": 0, "high": 8}}, base={"max_steps": 4})
    with pytest.raises(ValueError, match=r"'dpo_beta': its value -1.0 makes no valid adapter \("):  # (a DPO one's)
        OptunaSweep({"dpo_beta": {"type": "float", "low": -1.0, "high": 1.0}}, base={"objective": "dpo"})
    with pytest.raises(ValueError, match="sampler 'grid' needs categorical parameters .*`search_space` 'lr' is "
                                         "FloatDistribution"):  # (at construction: it failed as the fit started)
        OptunaSweep({"lr": {"type": "float", "low": 1e-5, "high": 1e-3}}, sampler="grid")
    with pytest.raises(ValueError, match="`sampler` can be tpe, random, grid"):
        OptunaSweep(SPACE, sampler="cmaes")
    import optuna

    with pytest.raises(ValueError, match=r"`sampler` can be tpe, random, grid, got <optuna.*CmaEsSampler.*> \(a "
                                         r"CmaEsSampler object: give a study made with it, `study=optuna.create_study"):
        OptunaSweep(SPACE, sampler=optuna.samplers.CmaEsSampler(seed=1))  # (an Optuna user's first try)
    # misspelled or unknown keys are named with the ones the type takes, not dropped
    with pytest.raises(ValueError, match="`lr`: a float parameter takes type, low, high, log, step; got 'Log'"):
        OptunaSweep({"lr": {"type": "float", "low": 1e-5, "high": 1e-3, "Log": True}})
    with pytest.raises(ValueError, match="`lr`: a parameter is a dict"):
        OptunaSweep({"lr": [1e-4, 1e-3]})
    with pytest.raises(ValueError, match="`rank`: .*step"):  # Optuna's own check, under the parameter's name
        OptunaSweep({"rank": {"type": "int", "low": 4, "high": 64, "step": 4, "log": True}})
    with pytest.raises(ValueError, match=r"OptunaSweep `search_space` names \['lrr'\]: not an AdapterSpec field; "
                                         r"allowed: \[.*'lr'"):
        OptunaSweep({"lrr": {"type": "float", "low": 1e-5, "high": 1e-3}})
    with pytest.raises(ValueError, match=r"OptunaSweep `base` names \['max_step'\]: not an AdapterSpec field"):
        OptunaSweep(SPACE, base={"max_step": 10})
    with pytest.raises(ValueError, match=r"OptunaSweep: \['lr'\] in both `search_space` and `base`: each trial's "
                                         r"value is searched, so the base's would change nothing"):
        OptunaSweep({"lr": {"type": "float", "low": 1e-5, "high": 1e-3}}, base={"lr": 5e-4, "max_steps": 10})
    with pytest.raises(ValueError, match="`lr`: `log` must be True or False, got 'no'"):  # (was read as True)
        OptunaSweep({"lr": {"type": "float", "low": 1e-5, "high": 1e-3, "log": "no"}})
    with pytest.raises(ValueError, match=r"`search_space` must be a non-empty mapping"):
        OptunaSweep({})
    # bounds and choices of the wrong type are named (they failed inside Optuna: "'>' not supported", "not iterable")
    for space, message in (
            ({"lr": {"type": "float", "low": None, "high": 1e-3}}, "`low` of a float one must be a number"),
            ({"lr": {"type": "float", "low": "1e-", "high": 1e-3}}, "got '1e-'"),
            ({"rank": {"type": "int", "low": 2.5, "high": 8}}, "`low` of an int parameter must be an integer, got 2.5"),
            ({"rank": {"type": "categorical", "choices": 8}}, "needs `choices`, a non-empty list, got 8")):
        with pytest.raises(ValueError, match=message):
            OptunaSweep(space)
    # (NaN asked no trial, and fit then said "no adapter to train"; 1.5 failed at the first ask)
    for name, value in (("n_trials", float("nan")), ("slots", float("nan")), ("seed", 1.5), ("n_trials", 2.5)):
        with pytest.raises(ValueError, match=rf"OptunaSweep: `{name}` must be an integer >= [01]"):
            OptunaSweep(SPACE, **{name: value})


def test_a_storage_that_cannot_be_opened_is_named_and_an_sqlite_folder_is_made(tmp_path, trainer_kwargs):
    """A URL Optuna cannot open fails the fit as it starts, naming `storage` (it failed in SQLAlchemy's words); an
    SQLite file in a folder not made yet gets its folder."""
    model = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "e"), validate_on_finish=False)
    with pytest.raises(ValueError, match=r"OptunaSweep: `storage` .notaurl. could not be opened .* a database URL"):
        L.Trainer(**trainer_kwargs, callbacks=[OptunaSweep(SPACE, n_trials=1, storage="notaurl")]).fit(
            model, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, max_val_examples=8))
    sweep = OptunaSweep(SPACE, n_trials=1, storage=f"sqlite:///{tmp_path / 'new' / 'sub' / 's.db'}")
    study = sweep._ensure_study(None)
    assert (tmp_path / "new" / "sub" / "s.db").is_file() and study.study_name == "multilora"


def test_bounds_read_as_strings_or_whole_floats_are_taken_as_the_numbers_they_spell():
    """Plain YAML 1.1 (PyYAML) reads ``low: 1e-5`` as the string '1e-5'; an int bound may come as a whole float."""
    dists = OptunaSweep({"lr": {"type": "float", "low": "1e-5", "high": "5e-4", "log": True},
                         "rank": {"type": "int", "low": "4", "high": 1e2},  # (1e2: 100.0, whole)
                         "batch_size": {"type": "categorical", "choices": range(1, 4)}}).distributions
    assert (dists["lr"].low, dists["lr"].high, dists["rank"].low, dists["rank"].high) == (1e-5, 5e-4, 4, 100)
    assert dists["batch_size"].choices == (1, 2, 3)


def test_a_search_space_over_the_losses_scale_is_warned_of():
    """A trial's value is its validation loss: over dpo_beta (a larger beta, a smaller DPO loss for the same
    preferences) or the objective, the study favours a scale, not an adapter."""
    import warnings

    space = {"dpo_beta": {"type": "float", "low": 0.05, "high": 1.0}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OptunaSweep(space, base={"objective": "dpo"})
        OptunaSweep(space)  # (SFT adapters: their beta is unused, their losses compare)
        OptunaSweep({"dataset": {"type": "categorical", "choices": ["a", "b"]}})
    said = [str(w.message) for w in caught if "whose scale these change" in str(w.message)]
    assert [m.split(":")[0] for m in said] == ["OptunaSweep `search_space` ['dpo_beta']",
                                               "OptunaSweep `search_space` ['dataset']"]
    # (a beta searched for SFT trials alone searches nothing: said, as AdapterSpec says of one SFT adapter's beta)
    assert [str(w.message) for w in caught if "searched beta changes nothing" in str(w.message)] == [
        "OptunaSweep `search_space` 'dpo_beta' applies to objective='dpo' alone, and every trial here is SFT (`base` "
        "objective): the searched beta changes nothing; set base={'objective': 'dpo', ...} for preference training"]


def test_a_search_space_step_reaches_the_distribution():
    from lightning_multilora.callbacks.optuna_sweep import distributions

    space = distributions({"rank": {"type": "int", "low": 4, "high": 64, "step": 4},
                           "lr": {"type": "float", "low": 0.1, "high": 0.5, "step": 0.1}})
    assert space["rank"] == optuna.distributions.IntDistribution(4, 64, step=4)
    assert space["lr"] == optuna.distributions.FloatDistribution(0.1, 0.5, step=0.1)


def test_optuna_distributions_are_taken_as_the_parameters_they_are(tmp_path, trainer_kwargs):
    """A search space of Optuna's own distributions, as an Optuna user writes one, was refused ("a parameter is a
    dict"): each is taken as the dict that gives it, and its trials are asked from it."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    given = {"lr": FloatDistribution(1e-3, 1e-2, log=True), "rank": CategoricalDistribution([2, 4]),
             "batch_size": IntDistribution(1, 3), "dropout": FloatDistribution(0.0, 0.2, step=0.1)}
    sweep = OptunaSweep(given, n_trials=2, storage=f"sqlite:///{tmp_path / 's.db'}", base={"max_steps": 2}, slots=2)
    assert sweep.distributions == given
    assert sweep.search_space == {"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
                                  "rank": {"type": "categorical", "choices": [2, 4]},
                                  "batch_size": {"type": "int", "low": 1, "high": 3, "log": False, "step": 1},
                                  "dropout": {"type": "float", "low": 0.0, "high": 0.2, "log": False, "step": 0.1}}
    fit(tmp_path, trainer_kwargs, sweep)
    trials = sweep.study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2 and all(t.distributions == given for t in trials)
    with pytest.raises(ValueError, match=r"search space `lr`: a parameter is a dict such as"):
        OptunaSweep({"lr": 1e-3})


def test_a_step_is_a_number_and_an_integer_for_an_int_parameter():
    """A step went to Optuna as given: an int step of 2.5 (or True) was truncated to 2 (1), 0.5 divided by zero, and
    YAML 1.1's '5e-2' failed in a comparison; a zero step is named too."""
    from lightning_multilora.callbacks.optuna_sweep import distributions

    assert distributions({"dropout": {"type": "float", "low": 0.0, "high": 0.3, "step": "5e-2"}})["dropout"].step == 0.05
    assert distributions({"rank": {"type": "int", "low": 2, "high": 16, "step": 2.0}})["rank"].step == 2
    for step in (2.5, 0.5, True, None):
        with pytest.raises(ValueError, match=rf"`rank`: `step` of an int parameter must be an integer, got {step}"):
            distributions({"rank": {"type": "int", "low": 2, "high": 16, "step": step}})
    for kind, step in (("int", 0), ("float", -0.1)):
        with pytest.raises(ValueError, match=rf"`x`: `step` must be greater than 0, got {step}"):
            distributions({"x": {"type": kind, "low": 0, "high": 1, "step": step}})


def test_a_study_that_does_not_minimize_one_value_is_named_before_any_adapter_trains(tmp_path):
    """The sweep tells each trial's validation loss: a study maximizing (given, or found in `storage` under
    `study_name`) steered towards the worst adapters, and a multi-objective one failed after the first had trained."""
    with pytest.raises(ValueError, match=r"OptunaSweep: `study` is a study of direction\(s\) \['maximize'\]"):
        OptunaSweep(SPACE, study=optuna.create_study(direction="maximize"))
    with pytest.raises(ValueError, match=r"direction\(s\) \['minimize', 'minimize'\]"):
        OptunaSweep(SPACE, study=optuna.create_study(directions=["minimize", "minimize"]))
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(storage=url, study_name="accuracy", direction="maximize")
    with pytest.raises(ValueError, match=r"`study_name` 'accuracy' in `storage` .* direction\(s\) \['maximize'\]"):
        OptunaSweep(SPACE, storage=url, study_name="accuracy")._ensure_study(None)
    assert OptunaSweep(SPACE, storage=url)._ensure_study(None).direction == optuna.study.StudyDirection.MINIMIZE


def test_two_runs_feed_one_study_through_its_storage(tmp_path, trainer_kwargs):
    # Two sweeps (as two processes would) share an SQLite study: trial numbers and adapter names never collide.
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    names = []
    for run in range(2):
        sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, study_name="shared",
                            base={"max_steps": 3, "batch_size": 1}, slots=2, seed=run)
        _, module = fit(tmp_path / f"run{run}", trainer_kwargs, sweep)
        names += [r.name for r in module.registry]
    trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3] and sorted(names) == [f"trial-{i}" for i in range(4)]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def test_the_admission_controller_sets_how_many_trials_run(tmp_path, trainer_kwargs):
    from lightning_multilora.scheduling import AdmissionController

    # 100 bytes a row, a 500-byte budget, batch size 2: two trials run at once, a third waits in the queue
    ctrl = AdmissionController(lambda specs: 100 * sum(s.batch_size for s in specs), 500, safety_margin=1.0)
    sweep = OptunaSweep(SPACE, n_trials=5, base={"max_steps": 4, "batch_size": 2})
    running: list[int] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            running.append(len(batch["layout"].names))
            queued = [r for r in pl_module.registry if r.state == AdapterState.QUEUED]
            assert len(queued) <= 1

    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), admission=ctrl)
    L.Trainer(**trainer_kwargs, callbacks=[sweep, Watch()]).fit(module, dm())
    assert max(running) == 2 and running[0] == 2
    assert len(sweep.study.get_trials()) == 5
    assert all(r.state == AdapterState.FINISHED for r in module.registry)


def test_a_trial_that_can_never_fit_the_memory_budget_fails_and_the_sweep_goes_on(tmp_path, trainer_kwargs):
    """A trial whose batch alone exceeds the admission budget would wait in the queue forever: the study is told it
    failed, with the numbers, and the sweep asks the next trial."""
    import optuna

    from lightning_multilora.scheduling import AdmissionController

    ctrl = AdmissionController(lambda specs: 100 * sum(s.batch_size for s in specs), 500, safety_margin=1.0)
    space = {"batch_size": {"type": "categorical", "choices": [1, 8]}}
    sweep = OptunaSweep(space, n_trials=6, base={"max_steps": 2, "rank": 2}, sampler="grid")
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), admission=ctrl)
    with pytest.warns(UserWarning, match=r"trial \d+ with \{'batch_size': 8\} failed: .*\(batch_size=8\) alone "
                                         "needs .* so it can never start"):
        L.Trainer(**trainer_kwargs, callbacks=[sweep]).fit(module, dm())
    states = {t.params["batch_size"]: t.state for t in sweep.study.get_trials()}
    assert states == {1: optuna.trial.TrialState.COMPLETE, 8: optuna.trial.TrialState.FAIL}
    failed = next(t.number for t in sweep.study.get_trials() if t.state == optuna.trial.TrialState.FAIL)
    # known by number, told: a resume does not count it again among the FAIL trials it told (`failed_by`)
    assert sweep.trials[f"trial-{failed}"]["told"] and sweep.asked == len(sweep.study.get_trials())
    assert [r.spec.batch_size for r in module.registry] == [1]
    assert all(r.state == AdapterState.FINISHED for r in module.registry)


class _OverfitAtFirstValidation(L.Callback):
    """Stops the first adapter validated with a new loss as EarlyExit's overfitting rule does (best weights kept)."""

    def __init__(self) -> None:
        self.stopped: list[str] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        for rec in list(pl_module.registry.running):
            if rec.val_losses and not self.stopped:
                pl_module.remove_adapter(rec.name, reason="test", state=AdapterState.OVERFIT)
                self.stopped.append(rec.name)


def test_an_overfit_exit_is_told_complete_with_its_best_validation_loss(tmp_path, trainer_kwargs):
    sweep = OptunaSweep(SPACE, n_trials=3, base={"max_steps": 6, "batch_size": 2}, slots=2, sampler="random")
    stop = _OverfitAtFirstValidation()
    _, module = fit(tmp_path, trainer_kwargs, sweep, callbacks=[stop])
    assert len(stop.stopped) == 1
    rec = module.registry[stop.stopped[0]]
    assert rec.state == AdapterState.OVERFIT and rec.step < 6
    trial = sweep.study.get_trials()[int(rec.name.split("-")[1])]
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == pytest.approx(rec.best_val_loss)
    assert trial.user_attrs["adapter_exit"]["export_loss"] == trial.value
    assert sweep.study.best_value <= rec.best_val_loss  # an overfit adapter competes for the study's best


def test_with_a_heartbeat_a_killed_runs_trials_are_failed_and_a_resumed_sweeps_kept(tmp_path, trainer_kwargs):
    """``heartbeat_interval``: the trials of a run killed without a checkpoint to resume from (Optuna's stale trials)
    are failed when a sweep next opens the study; a sweep resumed from its checkpoint after longer than the grace
    period keeps its own trials running and completes them."""
    import time

    storage = f"sqlite:///{tmp_path / 'beat.db'}"

    def sweep():
        return OptunaSweep(SPACE, n_trials=5, storage=storage, base={"max_steps": 6, "batch_size": 2}, slots=2,
                           heartbeat_interval=1, grace_period=2)

    trainer, _ = fit(tmp_path, trainer_kwargs, sweep(), max_steps=8)  # "killed" after 8 steps
    ckpt = tmp_path / "kill.ckpt"
    trainer.save_checkpoint(ckpt)
    study = optuna.load_study(study_name="multilora", storage=storage)
    orphan = study.ask()  # a trial of another worker that died: it beat once, long ago
    study._storage.record_heartbeat(orphan._trial_id)
    time.sleep(3)
    _, resumed = fit(tmp_path, trainer_kwargs, sweep(), ckpt=str(ckpt))
    states = {t.number: t.state for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()}
    assert states.pop(orphan.number) == optuna.trial.TrialState.FAIL
    assert len(states) == 5 and set(states.values()) == {optuna.trial.TrialState.COMPLETE}
    assert {r.name for r in resumed.registry} == {f"trial-{n}" for n in states}
    with pytest.raises(ValueError, match="`heartbeat_interval` must be an integer number of seconds >= 1"):
        OptunaSweep(SPACE, heartbeat_interval=0)
    with pytest.raises(ValueError, match="`grace_period` needs `heartbeat_interval`"):
        OptunaSweep(SPACE, grace_period=10)
    with pytest.raises(ValueError, match="`grace_period` must be longer than `heartbeat_interval` \\(60 s\\)"):
        OptunaSweep(SPACE, heartbeat_interval=60, grace_period=30)
    with pytest.raises(ValueError, match="`heartbeat_interval` opens `storage` as a URL"):
        OptunaSweep(SPACE, storage=optuna.storages.InMemoryStorage(), heartbeat_interval=5)


def test_a_trial_that_goes_stale_while_the_sweep_runs_is_failed_at_its_next_beat(tmp_path):
    """A killed run's trial still within the grace period when the sweep opens the study is failed at a later beat,
    once its heartbeat is older than the grace period; the sweep's own trials, beaten, are not."""
    import time

    storage = f"sqlite:///{tmp_path / 'late.db'}"
    sweep = OptunaSweep(SPACE, storage=storage, heartbeat_interval=1, grace_period=2)
    sweep._ensure_study(None)
    orphan = sweep.study.ask()
    sweep.study._storage.record_heartbeat(orphan._trial_id)
    ours = sweep.study.ask()
    sweep.trials["trial-x"] = {"trial_id": ours._trial_id, "number": ours.number, "reported": [], "told": False}
    sweep._beat(force=True)
    assert sweep.study.trials[orphan.number].state == optuna.trial.TrialState.RUNNING  # not stale yet
    for _ in range(3):
        time.sleep(1.1)
        sweep._beat()
    states = {t.number: t.state for t in sweep.study.trials}
    assert states == {orphan.number: optuna.trial.TrialState.FAIL, ours.number: optuna.trial.TrialState.RUNNING}


def test_a_trial_finished_by_another_process_keeps_its_slot_and_is_no_longer_reported(tmp_path, trainer_kwargs):
    """Another process fails a running trial (as stale): the sweep warns, reports nothing more to it, and its adapter
    keeps its slot until it exits (the sweep asks no extra trial meanwhile)."""
    storage = f"sqlite:///{tmp_path / 'lost.db'}"
    peaks = []

    class FailElsewhere(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            peaks.append(len(pl_module.registry.running))
            if trainer.global_step == 2:
                study = optuna.load_study(study_name="multilora", storage=storage)
                study.tell(0, state=optuna.trial.TrialState.FAIL)

    sweep = OptunaSweep(SPACE, n_trials=3, storage=storage, base={"max_steps": 6, "batch_size": 2}, slots=2)
    with pytest.warns(UserWarning, match="trial 0 \\(trial-0\\) was finished by another process"):
        _, module = fit(tmp_path, trainer_kwargs, sweep, callbacks=[FailElsewhere()])
    assert max(peaks) <= 2
    states = {t.number: t.state for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()}
    assert states == {0: optuna.trial.TrialState.FAIL, 1: optuna.trial.TrialState.COMPLETE,
                      2: optuna.trial.TrialState.COMPLETE}
    assert module.registry["trial-0"].state == AdapterState.FINISHED


@pytest.mark.parametrize("kept", [True, False])
def test_a_finished_trials_value_is_the_validation_loss_of_the_weights_exported(kept):
    """Best-validation weights kept (EarlyExit's default): its best loss; not kept: the last one, which the exported
    (final) weights scored (the best was told, describing weights that no file holds)."""
    from types import SimpleNamespace

    from lightning_multilora import AdapterSpec
    from lightning_multilora.registry import AdapterRegistry

    sweep = OptunaSweep(SPACE, n_trials=2)
    sweep.study = optuna.create_study()
    trial = sweep.study.ask(sweep.distributions)
    registry = AdapterRegistry()
    rec = registry.add(AdapterSpec("trial-0", max_steps=10))
    rec.state, rec.val_losses = AdapterState.FINISHED, [(5, 1.0), (10, 2.0)]
    rec.best_val_loss, rec.best_val_step, rec.last_val_loss = 1.0, 5, 2.0
    sweep.trials["trial-0"] = {"trial_id": trial._trial_id, "number": 0, "reported": [], "told": False}
    sweep._conclude(SimpleNamespace(registry=registry, keep_best_weights=kept), rec)
    assert sweep.study.trials[0].value == (1.0 if kept else 2.0)


def test_a_base_whose_data_cannot_train_fails_its_trial_and_the_run_before_the_first_step(tmp_path, trainer_kwargs):
    """A source that cannot train (one example: none left to validate on) in ``base``: the run stops at once naming
    it, and the trial asked is told FAIL (it stayed RUNNING, with no checkpoint to resume it from). A ``dataset``
    that names no source is said as the fit starts, before any trial is asked."""
    from lightning_multilora.data import ListSource

    def data() -> MultiLoRADataModule:
        return MultiLoRADataModule(sources={"a": GeneratedArithmetic(300),
                                            "one": ListSource([{"prompt": "1+1=", "completion": "2"}])},
                                   max_val_examples=16)

    def run(sweep, root):
        module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(root / "out"))
        L.Trainer(**dict(trainer_kwargs, val_check_interval=3), callbacks=[sweep]).fit(module, data())

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = OptunaSweep(SPACE, n_trials=4, storage=storage, slots=2,
                        base={"max_steps": 4, "batch_size": 2, "dataset": "one"})
    with pytest.raises(ValueError, match=r"trial 0 with \{.*\} cannot train: .*'one'"):
        run(sweep, tmp_path)
    states = [t.state for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()]
    assert states == [optuna.trial.TrialState.FAIL]
    # a trial asked before the one that cannot train (same ask): it never trained either, and no checkpoint holds it
    storage = f"sqlite:///{tmp_path / 'two.db'}"
    space = {"dataset": {"type": "categorical", "choices": ["a", "one"]}}
    study = optuna.create_study(study_name="multilora", storage=storage)
    study.enqueue_trial({"dataset": "a"})
    study.enqueue_trial({"dataset": "one"})
    sweep = OptunaSweep(space, n_trials=4, storage=storage, slots=2, sampler="random", base={"max_steps": 4})
    with pytest.raises(ValueError, match=r"trial 1 with \{'dataset': 'one'\} cannot train"):
        run(sweep, tmp_path / "two")
    states = [t.state for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()]
    assert states == [optuna.trial.TrialState.FAIL] * 2
    # misspelled: named before anything is asked
    for kwargs, where in ((dict(base={"max_steps": 4, "dataset": "aa"}), "`base`"),
                          (dict(search_space={"dataset": {"type": "categorical", "choices": ["a", "zz"]}}),
                           "`search_space` dataset")):
        storage = f"sqlite:///{tmp_path / 'three.db'}"
        sweep = OptunaSweep(**{"search_space": SPACE, **kwargs}, n_trials=2, storage=storage, slots=1)
        with pytest.raises(ValueError, match=rf"OptunaSweep {where}: adapter `dataset` '(aa|zz)' is not a data "):
            run(sweep, tmp_path / "three")
        assert not optuna.get_all_study_summaries(storage)  # (not even opened)


def test_an_adapter_named_like_a_trial_is_refused_as_the_fit_starts(tmp_path, trainer_kwargs):
    """The sweep names its adapters trial-<number>: a given one so named met a trial mid-run (Optuna's
    "Study.stop" error, the duplicate name buried in its traceback)."""
    from lightning_multilora import AdapterSpec

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("trial-1", max_steps=2, batch_size=2)],
                             export_dir=str(tmp_path / "out"))
    sweep = OptunaSweep(SPACE, n_trials=2, base={"max_steps": 2, "batch_size": 2})
    with pytest.raises(ValueError, match=r"adapter names \['trial-1'\] are an OptunaSweep's trial names"):
        L.Trainer(**trainer_kwargs, callbacks=[sweep]).fit(module, dm())


def test_trials_failed_after_the_checkpoint_are_not_asked_again_on_resume(tmp_path, trainer_kwargs):
    """Trials this sweep told FAIL after the checkpoint a resume starts from count as asked (their configurations
    were retrained, and the study held 6 trials of 4); one failed as stale by another process is still asked again
    (`test_with_a_heartbeat_...`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    space = {"lr": {"type": "categorical", "choices": [1e-3, 1e30]}}  # (1e30: the trial fails within two steps)

    def fit(storage, callbacks, ckpt=None, **kwargs):
        sweep = OptunaSweep(space, n_trials=4, storage=storage, slots=1, sampler="random", seed=3,
                            base={"max_steps": 3, "batch_size": 1, "grad_clip": None})
        module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), validate_on_finish=False)
        L.Trainer(**{**trainer_kwargs, **kwargs}, callbacks=[sweep, *callbacks]).fit(module, dm(), ckpt_path=ckpt)
        return optuna.load_study(study_name="multilora", storage=storage).get_trials()

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                raise RuntimeError("node lost")

    storage = f"sqlite:///{tmp_path / 's.db'}"
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        fit(storage, [Crash(), save], enable_checkpointing=True)
    told = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert optuna.trial.TrialState.FAIL in [t.state for t in told[1:]]  # (told after the checkpoint of step 2)
    resumed = fit(storage, [], ckpt=str(tmp_path / "ck" / "step=2.ckpt"))
    uninterrupted = fit(f"sqlite:///{tmp_path / 'u.db'}", [])
    assert [(t.params, t.state) for t in resumed] == [(t.params, t.state) for t in uninterrupted]


def test_an_alpha_given_in_base_is_not_replaced_by_alpha_over_rank():
    assert OptunaSweep(SPACE, base={"alpha": 64.0})._spec_kwargs({"rank": 8})["alpha"] == 64.0
    assert OptunaSweep(SPACE)._spec_kwargs({"rank": 8})["alpha"] == 16.0  # alpha_over_rank=2 by default
    assert OptunaSweep(SPACE)._spec_kwargs({"rank": 8, "alpha": 4.0})["alpha"] == 4.0  # searched
    for ratio in ("2", True, -1, 0):  # ("2" made alpha "22222222" at rank 8: a string repeated)
        with pytest.raises(ValueError, match=rf"OptunaSweep `alpha_over_rank` must be a number > 0 or None, "
                                             rf"got {ratio!r}"):
            OptunaSweep(SPACE, alpha_over_rank=ratio)


@pytest.mark.parametrize("kind, crash_step", [("random", 8), ("grid", 8), ("heartbeat", 8), ("random", 13)])
def test_a_sweep_resumed_from_a_periodic_checkpoint_takes_up_the_trials_asked_after_it(tmp_path, trainer_kwargs, kind,
                                                                                       crash_step):
    """Trials asked after the checkpoint (a run that crashed later) are RUNNING in the study: the resumed sweep takes
    them up in place of its asks, so none is left RUNNING or asked twice, and the study ends as an uninterrupted
    run's. A grid they complete still takes them; with heartbeats they are this sweep's, kept alive (not failed as
    stale, however long the run was down). Those already told before the crash (at step 12, a crash at 13) count as
    asked: not trained again."""
    import time

    from lightning.pytorch.callbacks import ModelCheckpoint

    grid = {"lr": {"type": "categorical", "choices": [1e-3, 3e-3]}, "rank": {"type": "categorical", "choices": [2, 4]}}
    n_trials = 4 if crash_step == 8 else 5  # (a fifth trial, asked at step 12, is training at 13)

    def sweep(storage):
        extra = dict(heartbeat_interval=1, grace_period=2) if kind == "heartbeat" else {}
        return OptunaSweep(grid if kind == "grid" else SPACE, n_trials=n_trials, storage=storage, slots=2,
                           base={"max_steps": 6, "batch_size": 2}, sampler="grid" if kind == "grid" else "random",
                           **extra)

    def fit(storage, callbacks, ckpt=None, **kwargs):
        module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), validate_on_finish=False)
        L.Trainer(**{**trainer_kwargs, **kwargs}, callbacks=[sweep(storage), *callbacks]).fit(module, dm(),
                                                                                             ckpt_path=ckpt)
        return optuna.load_study(study_name="multilora", storage=storage)

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == crash_step:
                raise RuntimeError("node lost")

    storage = f"sqlite:///{tmp_path / 's.db'}"
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        fit(storage, [Crash(), save], enable_checkpointing=True)
    study = optuna.load_study(study_name="multilora", storage=storage)
    running = [t.number for t in study.get_trials() if t.state == optuna.trial.TrialState.RUNNING]
    assert running == ([2, 3] if crash_step == 8 else [4])  # asked after the checkpoint of step 6 was written
    assert len(study.get_trials()) == n_trials
    if kind == "heartbeat":
        time.sleep(3)  # longer than the grace period
    exports = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    trials = fit(storage, [], ckpt=str(tmp_path / "ck" / "step=6.ckpt")).get_trials()
    if crash_step == 13:  # trials 2 and 3 were told at step 12: their exports are left as they were
        assert {n: t for n, t in exports.items() if n in ("trial-2", "trial-3")} == {
            p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.name in ("trial-2", "trial-3")}
    uninterrupted = fit(f"sqlite:///{tmp_path / 'u.db'}", []).get_trials()
    assert len(trials) == len(uninterrupted) and optuna.trial.TrialState.RUNNING not in [t.state for t in trials]
    assert optuna.trial.TrialState.FAIL not in [t.state for t in trials], trials
    assert [t.params for t in trials] == [t.params for t in uninterrupted]
    assert [t.state for t in trials] == [t.state for t in uninterrupted]


def test_a_resume_does_not_report_again_what_the_run_reported_after_its_checkpoint(tmp_path, trainer_kwargs):
    """The values a run reported after its checkpoint were reported again by the resume: Optuna warned "The reported
    value is ignored because this `step` ... is already reported" for each."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    storage = f"sqlite:///{tmp_path / 's.db'}"
    sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, slots=2, base={"max_steps": 6, "batch_size": 2})
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    with pytest.warns(UserWarning, match="stay RUNNING"):
        fit(tmp_path, trainer_kwargs, sweep, [save], max_steps=5, val_check_interval=2, enable_checkpointing=True)
    reported = {t.number: dict(t.intermediate_values)
                for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()}
    assert all(len(values) == 2 for values in reported.values())  # (steps 2 and 4: the second after the checkpoint)
    sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, slots=2, base={"max_steps": 6, "batch_size": 2})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(tmp_path, trainer_kwargs, sweep, ckpt=str(tmp_path / "ck" / "step=2.ckpt"), val_check_interval=2)
    assert not [w for w in seen if "already reported" in str(w.message)]
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:  # (the first run's values kept: the resumed run's own equal them anyway)
        assert {k: v for k, v in t.intermediate_values.items() if k in reported[t.number]} == reported[t.number]


def test_a_finished_trial_never_validated_is_said_and_the_study_name_is_checked(tmp_path, trainer_kwargs):
    """No validation in the adapters' runs (none on finishing either): no value for the study, told PRUNED (FAIL is
    for trials lost or failed), and now said. ``study_name`` names the study a resumed sweep tells its trials in: a
    missing or empty one, or another than the checkpoint's, is refused."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, base={"max_steps": 2, "batch_size": 2}, slots=2)
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"trial 0 \('trial-0'\) finished with no finite validation loss"):
        L.Trainer(**dict(trainer_kwargs, val_check_interval=50), callbacks=[sweep]).fit(module, dm())
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    assert all(r.state == AdapterState.FINISHED for r in module.registry)
    for bad in (None, "", 3):
        with pytest.raises(ValueError, match="OptunaSweep: `study_name` must be a non-empty string"):
            OptunaSweep(SPACE, n_trials=2, study_name=bad)
    other = OptunaSweep(SPACE, n_trials=2, storage=storage, study_name="another")
    with pytest.raises(ValueError,
                       match="this checkpoint's sweep ran study 'multilora', and `study_name` is 'another'"):
        other.load_state_dict(sweep.state_dict())



def test_a_trial_whose_export_was_not_validated_says_which_steps_loss_its_value_is(tmp_path, trainer_kwargs):
    """With `validate_on_finish=False` the trials (7 steps, validations every 3) export step 7's weights, never
    validated: each was told its step-6 loss as the value of the weights it exports, silently."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = OptunaSweep(SPACE, n_trials=2, storage=storage, base={"max_steps": 7, "batch_size": 2}, slots=2)
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), validate_on_finish=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**dict(trainer_kwargs, val_check_interval=3), callbacks=[sweep]).fit(module, dm())
    said = [str(w.message) for w in seen if "is told its last validation's loss" in str(w.message)]
    assert len(said) == 1 and "at step 6: the weights it exports, of step 7, were not validated" in said[0]
    for trial in optuna.load_study(study_name="multilora", storage=storage).get_trials():
        rec = module.registry[f"trial-{trial.number}"]
        assert (rec.exported_step, rec.val_losses[-1][0]) == (7, 6)
        assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == rec.val_losses[-1][1]
        assert trial.user_attrs["adapter_exit"]["value_step"] == 6


class _PruneAfter(optuna.pruners.BasePruner):
    """Prunes every trial whose last reported step is at least ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def prune(self, study, trial) -> bool:
        return trial.last_step is not None and trial.last_step >= self.step


def test_the_studys_pruner_is_asked_after_each_validation_and_its_trials_are_told_pruned(tmp_path, trainer_kwargs):
    """A study given with a pruner (as Optuna's Lightning callback consults it): its pruned trials' adapters are
    exported and told PRUNED with their last value; a sweep's own study prunes nothing unless given a `pruner`."""
    study = optuna.create_study(direction="minimize", pruner=_PruneAfter(6),
                                storage=f"sqlite:///{tmp_path / 'study.db'}")
    sweep = OptunaSweep(SPACE, n_trials=3, study=study, base={"max_steps": 12, "batch_size": 2}, slots=2)
    _, module = fit(tmp_path, trainer_kwargs, sweep)
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    for t in trials:
        rec = module.registry[f"trial-{t.number}"]
        assert rec.state == AdapterState.PRUNED and rec.step == 6 and "_PruneAfter at step 6" in rec.reason
        assert rec.export_path is not None  # what it trained is kept
        assert t.value == pytest.approx(t.intermediate_values[6])
        assert t.user_attrs["adapter_exit"]["export_loss"] == pytest.approx(rec.val_losses[-1][1])  # (last: exported)

    own = OptunaSweep(SPACE, n_trials=1, base={"max_steps": 6, "batch_size": 2},
                      storage=f"sqlite:///{tmp_path / 'own.db'}")
    _, module = fit(tmp_path / "own", trainer_kwargs, own)
    assert isinstance(own.study.pruner, optuna.pruners.NopPruner)
    assert module.registry["trial-0"].state == AdapterState.FINISHED
    assert isinstance(OptunaSweep(SPACE, pruner="median").pruner, optuna.pruners.MedianPruner)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pruner="mean"), "`pruner` can be None, median, percentile, hyperband, successive_halving"),
    (dict(pruner="median", study="given"), "`pruner` is for the study the sweep makes"),
    (dict(sampler="random", study="given"), "`sampler` 'random' is for the study the sweep makes"),
    # (it was ignored: the study's own sampler asked other values each run)
    (dict(seed=123, study="given"), r"`seed` 123 seeds the sampler of the study the sweep makes; a `study` given "
                                    r"keeps its own .*TPESampler\(seed=123\)")])
def test_a_bad_pruner_is_named(kwargs, message):
    if kwargs.get("study") == "given":
        kwargs["study"] = optuna.create_study(direction="minimize")
    with pytest.raises(ValueError, match=message):
        OptunaSweep(SPACE, **kwargs)


def test_one_sweep_object_resumed_in_the_process_that_crashed_takes_up_its_trials(tmp_path, trainer_kwargs):
    """The same OptunaSweep given to the resumed fit (a notebook, a retry loop): it looks for the trials asked after
    the checkpoint again (it had looked once, at the first fit) and asks no more than ``n_trials``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 8:
                raise RuntimeError("node lost")

    storage = f"sqlite:///{tmp_path / 's.db'}"
    sweep = OptunaSweep(SPACE, n_trials=4, storage=storage, slots=2, base={"max_steps": 6, "batch_size": 2},
                        sampler="random")
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), sweep, callbacks=[Crash(), save])
    fit(tmp_path, trainer_kwargs, sweep, ckpt=str(tmp_path / "ck" / "step=6.ckpt"))
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def test_a_resume_given_fewer_trials_fails_the_trials_asked_after_its_checkpoint_past_them(tmp_path, trainer_kwargs):
    """Trials 2 and 3 are asked after the checkpoint of step 6, and the run dies; resumed with ``n_trials`` 3 (of 4),
    the sweep took up trial 2 and stopped asking: trial 3 stayed RUNNING for ever, unsaid. It is told FAIL (the
    resume is back before it was asked; `n_trials` bounds the trials run), with a warning and its ``fail_reason``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 8:
                raise RuntimeError("node lost")

    storage = f"sqlite:///{tmp_path / 's.db'}"

    def sweep(n_trials):
        return OptunaSweep(SPACE, n_trials=n_trials, storage=storage, slots=2, base={"max_steps": 6, "batch_size": 2},
                           sampler="random")

    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), sweep(4), callbacks=[Crash(), save])
    with pytest.warns(UserWarning, match=r"OptunaSweep: trials \[3\] were asked after the checkpoint this run resumed "
                                         r"from, and this sweep has asked its n_trials=3 before them: told FAIL in "
                                         r"study 'multilora', not trained"):
        _, module = fit(tmp_path, trainer_kwargs, sweep(3), ckpt=str(tmp_path / "ck" / "step=6.ckpt"))
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL"]
    assert trials[3].user_attrs["fail_reason"] == ("asked after the checkpoint a run resumed from with n_trials=3, "
                                                   "past those: not taken up")
    assert sorted(r.name for r in module.registry) == ["trial-0", "trial-1", "trial-2"]


def test_trials_told_after_the_checkpoint_are_in_the_resumed_runs_registry_and_report(tmp_path, trainer_kwargs):
    """Trials 2 and 3 finish (exported, told COMPLETE) at step 12, the run dies at 13, and resumes from the
    checkpoint of step 6: they are not trained again, and the resumed run's registry and report still show them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_multilora import SweepReport

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 13:
                raise RuntimeError("node lost")

    storage = f"sqlite:///{tmp_path / 's.db'}"

    def sweep():
        return OptunaSweep(SPACE, n_trials=5, storage=storage, slots=2, base={"max_steps": 6, "batch_size": 2},
                           sampler="random")

    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), sweep(), callbacks=[Crash(), save])
    report = SweepReport(print_table=False)
    _, module = fit(tmp_path, trainer_kwargs, sweep(), callbacks=[report], ckpt=str(tmp_path / "ck" / "step=6.ckpt"))
    study = optuna.load_study(study_name="multilora", storage=storage)
    assert [r["adapter"] for r in sorted(report.rows, key=lambda r: r["adapter"])] == [f"trial-{i}" for i in range(5)]
    for number in (2, 3):
        trial, rec = study.trials[number], module.registry[f"trial-{number}"]
        assert rec.state == AdapterState.FINISHED and "after the checkpoint" in rec.reason
        assert rec.spec.lr == trial.params["lr"] and rec.spec.rank == trial.params["rank"]
        assert rec.last_val_loss == pytest.approx(trial.value) and rec.step == 6
        assert rec.export_path == str(tmp_path / "out" / f"trial-{number}")
        row = next(r for r in report.rows if r["adapter"] == f"trial-{number}")  # (as the first run reported it)
        assert row["exported_step"] == 6 and row["exported_val_loss"] == pytest.approx(trial.value)
    # a study written before the exported step was kept: the record's best or last loss, as then (not the last step)
    old = optuna.trial.create_trial(params=study.trials[2].params, distributions=study.trials[2].distributions,
                                    value=1.0, intermediate_values={2: 1.0, 4: 2.0}, user_attrs={"adapter_exit": {
                                        "state": "finished", "reason": "reached max_steps=4", "step": 4,
                                        "export_path": "/x/trial-9"}})
    reader = sweep()
    reader.study = study
    rec = AdapterRecord.from_state_dict(reader._told_record(module, old))
    assert rec.exported_step is None and rec.best_val_step == 2 and rec.best_val_loss == 1.0


class _RecordingPruner(optuna.pruners.BasePruner):
    """Prunes every trial validated at step 3; records what it was asked."""

    def __init__(self) -> None:
        self.asked = []

    def prune(self, study, trial) -> bool:
        self.asked.append((trial.number, trial.last_step))
        return trial.last_step == 3


@pytest.mark.parametrize("exit_first", [False, True])
def test_the_pruner_is_asked_of_every_new_value_whichever_callback_reported_it(tmp_path, trainer_kwargs, exit_first):
    """An adapter that exits in an earlier callback's validation hook (EarlyExit listed first) makes the sweep report
    every trial's values then, without asking the pruner: it is asked of them in the sweep's own hook all the same."""
    from lightning_multilora.registry import AdapterState as S

    class ExitAtValidation(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            if trainer.global_step == 3 and pl_module.registry["trial-0"].state == S.RUNNING:
                pl_module.remove_adapter("trial-0", reason="overfit (a stand-in)", state=S.OVERFIT)

    pruner = _RecordingPruner()
    study = optuna.create_study(direction="minimize", pruner=pruner, storage=f"sqlite:///{tmp_path / 's.db'}")
    sweep = OptunaSweep(SPACE, n_trials=2, study=study, base={"max_steps": 9, "batch_size": 2}, slots=2)
    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"))
    callbacks = [ExitAtValidation(), sweep] if exit_first else [sweep, ExitAtValidation()]
    L.Trainer(**dict(trainer_kwargs, val_check_interval=3), callbacks=callbacks).fit(module, dm())
    assert (module.registry["trial-1"].state, module.registry["trial-1"].step) == (S.PRUNED, 3)
    assert pruner.asked.count((1, 3)) == 1  # (once a value)


def test_a_resumed_sweeps_registry_holds_no_trial_that_never_became_an_adapter(tmp_path, trainer_kwargs):
    """Trials told FAIL as they were asked (they could never fit) after the checkpoint are counted, not recorded:
    the resumed registry is the uninterrupted run's."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_multilora.scheduling import AdmissionController

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 11:
                raise RuntimeError("node lost")

    def run(root, callbacks, ckpt=None, **kwargs):
        sweep = OptunaSweep(SPACE, n_trials=6, storage=f"sqlite:///{root / 's.db'}", slots=2,
                            base={"max_steps": 6, "batch_size": 2}, sampler="random", seed=5)
        never_rank_4 = AdmissionController(lambda specs: float(sum(8 if s.rank == 4 else 1 for s in specs)) * 2**30,
                                           6 * 2**30, safety_margin=1.0)
        module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(root / "out"), admission=never_rank_4)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "trial .* can never start")
            L.Trainer(**dict(trainer_kwargs, val_check_interval=3, **kwargs), callbacks=[sweep, *callbacks]).fit(
                module, dm(), ckpt_path=ckpt)
        return module

    reference = run(tmp_path / "ref", [])
    save = ModelCheckpoint(dirpath=tmp_path / "x" / "ck", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):
        run(tmp_path / "x", [Crash(), save], enable_checkpointing=True)
    resumed = run(tmp_path / "x", [], ckpt=str(tmp_path / "x" / "ck" / "step=6.ckpt"))
    assert {r.name: r.state for r in resumed.registry} == {r.name: r.state for r in reference.registry}


def test_other_choices_of_a_categorical_parameter_over_an_existing_study_are_named(tmp_path, trainer_kwargs):
    """(Optuna's own error named neither the parameter nor the study, deep in the first ask.)"""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    fit(tmp_path / "one", trainer_kwargs, OptunaSweep(SPACE, n_trials=1, storage=storage,
                                                      base={"max_steps": 3, "batch_size": 2}))
    other = dict(SPACE, rank={"type": "categorical", "choices": [2, 8]})
    with pytest.raises(ValueError, match=r"`search_space` 'rank': choices \[2, 8\], and study 'multilora' holds "
                                         r"trials of choices \[2, 4\]"):
        fit(tmp_path / "two", trainer_kwargs, OptunaSweep(other, n_trials=1, storage=storage,
                                                          base={"max_steps": 3, "batch_size": 2}))


def test_list_choices_are_kept_in_the_studys_storage_without_optunas_warning_at_every_read(tmp_path, trainer_kwargs):
    """Optuna warns that a list choice (`target_modules`') should be a str or a number "for persistent storage" at each
    distribution it makes: 8 times in a sweep of 2 trials. Its SQLite storage keeps lists, read back as given."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    choices = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep = OptunaSweep({"target_modules": {"type": "categorical", "choices": choices}}, n_trials=2,
                            storage=storage, sampler="grid", base={"max_steps": 2, "batch_size": 2}, slots=2)
        _, module = fit(tmp_path, trainer_kwargs, sweep)
    assert not [w for w in caught if "categorical distribution" in str(w.message)]
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert sorted(t.params["target_modules"] for t in trials) == sorted(choices)
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert module.registry[f"trial-{t.number}"].spec.target_modules == t.params["target_modules"]


def test_a_trial_whose_validations_measured_no_token_is_not_said_unvalidated(tmp_path, trainer_kwargs, capsys):
    """A validation that measured no token (NaN) of the weights a trial exports: it was told "were not validated
    (`validate_on_finish=False`)", its export's step validated all the same; the report said "their adapters having
    ended (removed, failed) between validations"."""
    from lightning_multilora import SweepReport

    class NoTokens(MultiLoRAModule):
        def adapter_loss_terms(self, batch):
            sums, counts = super().adapter_loss_terms(batch)
            return (sums, counts) if self.training else (sums * 0, counts * 0)

    storage = f"sqlite:///{tmp_path / 's.db'}"
    sweep = OptunaSweep(SPACE, n_trials=1, storage=storage, base={"max_steps": 3, "batch_size": 2})
    module = NoTokens("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs, callbacks=[sweep, SweepReport(tensorboard=False)]).fit(module, dm())
    assert ("(export_loss '-': validations that measured no token (every completion of the split cut or empty); "
            "those follow the others") in capsys.readouterr().out
    said = [str(w.message) for w in seen if "trial 0" in str(w.message)]
    assert not [m for m in said if "validate_on_finish=False" in m], said
    assert any("with no finite validation loss (nan; its validations gave nan): told PRUNED" in m for m in said), said
    (trial,) = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert trial.state == optuna.trial.TrialState.PRUNED and "value_step" not in trial.user_attrs["adapter_exit"]


def _pruned_study(tmp_path, trainer_kwargs, max_steps):
    """Four trials in two slots, validation every 4 steps, a median pruner: two of lr 1e-2 start first, then two of
    lr 1e-5 (which learn nothing in a few steps) take their slots."""
    space = {"lr": {"type": "float", "low": 1e-5, "high": 1e-1, "log": True}, "rank": {"type": "categorical",
                                                                                      "choices": [2, 4]}}
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    for lr in (1e-2, 1e-2, 1e-5, 1e-5):
        study.enqueue_trial({"lr": lr, "rank": 2})
    sweep = OptunaSweep(space, n_trials=4, study=study, slots=2, base={"max_steps": max_steps, "batch_size": 1})
    _, module = fit(tmp_path, trainer_kwargs, sweep, val_check_interval=4)
    return study, module


def test_trials_started_at_a_validation_are_pruned_on_values_of_their_own_steps(tmp_path, trainer_kwargs):
    """Adapters of 8 steps, validation every 4: the trials refilled at step 8 are not validated there, at their step 0
    (`MultiLoRAModule.validation_roster`), but at their step 4, which the first trials reported too. Validations are
    reported at the adapter's own step, none at step 0: periodic ones were rounded down to the interval, so that one
    study step held losses after different numbers of steps (a soak of 30 trials that trained identically pruned 21
    of them, on when they started), and an untrained adapter's loss was reported at step 0 (and pruned on)."""
    study, module = _pruned_study(tmp_path, trainer_kwargs, max_steps=8)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {0: optuna.trial.TrialState.COMPLETE, 1: optuna.trial.TrialState.COMPLETE,
                      2: optuna.trial.TrialState.PRUNED, 3: optuna.trial.TrialState.PRUNED}, states
    for number in (2, 3):
        rec = module.registry[f"trial-{number}"]
        assert rec.spans[0][0] == 8 and rec.step == 4 and "MedianPruner at step 4" in rec.reason
        assert 0 not in dict(rec.val_losses) and sorted(study.trials[number].intermediate_values) == [4]
        assert study.trials[number].intermediate_values[4] == pytest.approx(dict(rec.val_losses)[4])
    assert sorted(study.trials[0].intermediate_values) == [4, 8]


def test_trials_started_between_validations_report_their_own_steps_and_are_warned_of(tmp_path, trainer_kwargs):
    """Adapters of 10 steps, validation every 4: the trials refilled at step 10 validate at their steps 2 and 6,
    which no other trial reported; the pruner cannot compare them (it was handed their step-6 losses as step 4's,
    beside the first trials' losses after 4 steps), and the sweep says why as the fit starts."""
    with pytest.warns(UserWarning, match=r"MedianPruner compares trials at equal steps, and max_steps \[10\] is not "
                                         r"a multiple of val_check_interval=4: .*Give max_steps in multiples of 4"):
        study, module = _pruned_study(tmp_path, trainer_kwargs, max_steps=10)
    assert [t.state for t in study.get_trials()] == [optuna.trial.TrialState.COMPLETE] * 4
    for number in (2, 3):
        assert module.registry[f"trial-{number}"].spans[0][0] == 10
        assert sorted(study.trials[number].intermediate_values) == [2, 6, 10]
    assert sorted(study.trials[0].intermediate_values) == [4, 8, 10]


def test_a_trial_resumed_off_the_validation_grid_is_said_once(tmp_path, trainer_kwargs):
    """A warmup pause (at step 2 of 20, validations every 4) resumes a trial between two validations: from there it
    reports at steps the trials started at a validation never do, so the pruner compares it with those of its own
    steps alone. `max_steps` on the grid does not prevent it: the sweep says so as it happens."""
    sweep = OptunaSweep(SPACE, n_trials=4, slots=2, pruner="median", base={"max_steps": 20, "batch_size": 2})
    with pytest.warns(UserWarning, match=r"trial 'trial-\d' validates at its step \d+, not a multiple of "
                                         r"val_check_interval=4 \(it resumed at step \d+, between two validations.*"
                                         r"MedianPruner compares trials at equal steps") as seen:
        fit(tmp_path, trainer_kwargs, sweep, callbacks=[WarmupSelection(warmup_fraction=0.1, keep_fraction=0.5)],
            val_check_interval=4)
    assert sum("not a multiple of val_check_interval" in str(w.message) for w in seen) == 1  # (once)


def test_the_lengths_off_the_validation_grid_are_said_before_any_step(tmp_path):
    """The lengths a sweep's trials may take, checked against the validation interval where the study's pruner
    compares steps: AdapterSpec's default 100 counts; one int value (low = high) is that value alone."""
    from types import SimpleNamespace

    module = SimpleNamespace(_trainer=SimpleNamespace(val_check_interval=30))

    def said(**kwargs) -> list[str]:
        sweep = OptunaSweep({**SPACE, **kwargs.pop("space", {})}, pruner="median", **kwargs)
        sweep.study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sweep._warn_unaligned(module)
        return [str(w.message) for w in seen]

    assert "max_steps [100] is not a multiple of val_check_interval=30" in said()[0]
    assert said(base={"max_steps": 60}) == said(base={"max_epochs": 2}) == []
    assert said(space={"max_steps": {"type": "int", "low": 60, "high": 60}}) == []
    assert "max_steps [45, 75] is not" in said(space={"max_steps": {"type": "int", "low": 45, "high": 90,
                                                                    "step": 30}})[0]


def test_a_grid_over_a_study_with_other_trials_asks_every_point(tmp_path, trainer_kwargs):
    """A grid sweep on a study that holds earlier random trials: they take no grid point (it counted them as the
    grid's, and ended early, or trained nothing)."""
    grid = {"lr": {"type": "categorical", "choices": [1e-3, 3e-3]}, "rank": {"type": "categorical", "choices": [2, 4]}}
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    fit(tmp_path / "random", trainer_kwargs,
        OptunaSweep(grid, n_trials=3, storage=storage, sampler="random", slots=3, base={"max_steps": 2}))
    sweep = OptunaSweep(grid, n_trials=4, storage=storage, sampler="grid", slots=2, base={"max_steps": 2})
    fit(tmp_path / "grid", trainer_kwargs, sweep)
    asked = sorted((t.params["lr"], t.params["rank"]) for t in sweep.study.get_trials()[3:])
    assert asked == [(1e-3, 2), (1e-3, 4), (3e-3, 2), (3e-3, 4)]


def test_a_grid_sampler_of_the_users_study_bounds_the_sweep_whatever_the_space(tmp_path, trainer_kwargs):
    """A `GridSampler` given in the study, over float and int parameters (its size was read from the search space:
    an AttributeError) and with fewer points than slots (a point was trained twice)."""
    space = {"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
             "rank": {"type": "int", "low": 2, "high": 4}}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"lr": [1e-3, 3e-3, 5e-3], "rank": [2]}))
    sweep = OptunaSweep(space, n_trials=6, study=study, slots=4, base={"max_steps": 2})
    _, module = fit(tmp_path, trainer_kwargs, sweep)
    assert sorted(t.params["lr"] for t in study.get_trials()) == [1e-3, 3e-3, 5e-3] and sweep.exhausted
    assert len(module.registry) == 3


def test_an_ask_the_study_refuses_fails_its_trial_and_names_the_parameter(tmp_path, trainer_kwargs):
    """An enqueued value outside the choices: Optuna's bare "'3' not in (2, 4)" stopped the fit and left the trial
    RUNNING for ever."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.enqueue_trial({"lr": 1e-3, "rank": 3})
    sweep = OptunaSweep(SPACE, n_trials=2, study=study, slots=1, base={"max_steps": 2})
    with pytest.raises(ValueError, match=r"could not ask trial 0 \(parameter 'rank'\): .*it is told FAIL"):
        fit(tmp_path, trainer_kwargs, sweep)
    assert [t.state for t in study.get_trials()] == [optuna.trial.TrialState.FAIL]
    # a parameter the study's earlier trials drew from another kind of distribution: "Cannot set different
    # distribution kind to the same parameter name." named none; it is named as the study opens, no trial asked
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'kinds.db'}")
    study.optimize(lambda t: t.suggest_int("rank", 2, 4) + t.suggest_float("lr", 1e-4, 1e-2, log=True), n_trials=1)
    sweep = OptunaSweep(SPACE, n_trials=2, study=study, slots=1, base={"max_steps": 2})
    with pytest.raises(ValueError, match=r"`search_space` 'rank': of type CategoricalDistribution, and study .* holds "
                                         r"trials where it is of type IntDistribution"):
        fit(tmp_path / "kinds", trainer_kwargs, sweep)
    assert len(study.get_trials()) == 1


def test_sweeps_sharing_a_study_ask_different_configurations_with_one_seed(tmp_path):
    """Each trial is seeded with the sweep's seed and the trial's number, which the study gives once: two processes
    started with the same seed asked the same configuration where both counted the study's trials before either's
    trial was made (a schedule's fit tasks starting together: 8 duplicate asks in 5 rounds of 3)."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    mine, other = OptunaSweep(SPACE, seed=0, storage=storage), OptunaSweep(SPACE, seed=0, storage=storage)
    for sweep in (mine, other):  # (each process its own study object, opened before either asks)
        sweep._ensure_study(None)
    first, second = mine._ask_trial(mine.study), other._ask_trial(other.study)
    assert (first.number, second.number) == (0, 1) and first.params != second.params
    alone = OptunaSweep(SPACE, seed=0, storage=f"sqlite:///{tmp_path / 'alone.db'}")  # a lone run draws alike
    alone._ensure_study(None)
    assert [alone._ask_trial(alone.study).params for _ in range(2)] == [first.params, second.params]


def test_a_new_study_opened_by_several_processes_at_once_is_opened_not_refused(tmp_path, monkeypatch):
    """Optuna's storage makes a new database's tables and study without a lock: processes opening it together
    found them half made (`UNIQUE constraint failed: alembic_version.version_num`, `table studies already exists`),
    and the sweep called the URL unusable (a schedule's task exited with status 2)."""
    import sqlalchemy.exc

    from lightning_multilora.callbacks import optuna_sweep

    create, raised = optuna.create_study, []

    def racing(**kwargs):
        if len(raised) < 2:
            raised.append(1)
            raise sqlalchemy.exc.IntegrityError("INSERT INTO alembic_version", {}, Exception(
                "UNIQUE constraint failed: alembic_version.version_num"))
        return create(**kwargs)

    monkeypatch.setattr(optuna, "create_study", racing)
    sweep = OptunaSweep(SPACE, storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert sweep._ensure_study(None).study_name == "multilora" and len(raised) == 2
    raised.clear()  # an error that is not such a race is said at once, naming the storage
    monkeypatch.setattr(optuna, "create_study", lambda **kwargs: (raised.append(1), (_ for _ in ()).throw(
        sqlalchemy.exc.OperationalError("connect", {}, Exception("unable to open database file"))))[1])
    with pytest.raises(ValueError, match=r"`storage` .*b\.db' could not be opened \(.*unable to open database"):
        optuna_sweep._open_study(f"sqlite:///{tmp_path / 'b.db'}", "multilora", optuna.samplers.RandomSampler())
    assert len(raised) == 1


def test_grid_sweeps_of_other_seeds_sharing_a_study_ask_each_point_once(tmp_path):
    """A grid's points are ordered by the seed the study keeps (its first grid sweep's): Optuna tells taken points
    by number, and a sweep of another seed, numbering them in another order, asked 5 distinct of 6 in two runs
    (one point twice, one never), and called the grid done."""
    grid = {"lr": {"type": "categorical", "choices": [1e-3, 3e-3, 1e-2]},
            "rank": {"type": "categorical", "choices": [2, 4]}}
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    points = []
    for seed in (0, 1):  # (a run, then another of another seed on its study)
        sweep = OptunaSweep(grid, sampler="grid", seed=seed, storage=storage)
        sweep._ensure_study(None)
        for _ in range(3):
            trial = sweep._ask_trial(sweep.study)
            sweep._tell(trial.number, values=1.0)
            points.append((trial.params["lr"], trial.params["rank"]))
    assert len(set(points)) == 6 and sweep._grid_exhausted(sweep.study)


def test_a_grid_point_another_process_asked_meanwhile_is_not_trained_twice(tmp_path, trainer_kwargs, monkeypatch):
    """Two processes on one grid study: one saw a point free (`_grid_exhausted`), the other asked it meanwhile, and
    Optuna's sampler gave the first a point already running: trained twice, the study holding more trials than the
    grid has points. The trial so asked is told FAIL, why said, and the sweep asks on while the grid has points."""
    grid = {"lr": {"type": "categorical", "choices": [1e-3, 3e-3, 1e-2]}}
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    other = OptunaSweep(grid, sampler="grid", storage=storage)
    other._ensure_study(None)
    for _ in range(2):  # (the other process's trials, running)
        other._ask_trial(other.study)
    sweep = OptunaSweep(grid, sampler="grid", storage=storage, n_trials=3, slots=3,
                        base={"max_steps": 2, "batch_size": 2})
    stale, check = iter([False, False]), sweep._grid_exhausted  # (two checks made before the other's asks)

    def exhausted(study):
        said = next(stale, None)
        return check(study) if said is None else said

    monkeypatch.setattr(sweep, "_grid_exhausted", exhausted)
    _, module = fit(tmp_path, trainer_kwargs, sweep)
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["RUNNING", "RUNNING", "COMPLETE", "FAIL"]
    assert re.fullmatch(r"its grid point is trial [01]'s, asked meanwhile by another process",
                        trials[3].user_attrs["fail_reason"])
    assert [r.name for r in module.registry] == ["trial-2"] and sweep.exhausted
    # a point two processes asked at once from a stale read, others free: the sweep asks on (it stopped asking)
    storage = f"sqlite:///{tmp_path / 'study2.db'}"
    sweep = OptunaSweep(grid, sampler="grid", storage=storage, n_trials=3, slots=3,
                        base={"max_steps": 2, "batch_size": 2})
    raced = iter([0])  # (its first ask: a point another process holds, as the sampler read the study stale)
    monkeypatch.setattr(sweep, "_grid_point_taken", lambda study, trial: next(raced, None))
    _, module = fit(tmp_path / "2", trainer_kwargs, sweep)
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert [r.name for r in module.registry] == ["trial-1", "trial-2"] and sweep.exhausted


@pytest.mark.parametrize("given", ["storage", "study"])
def test_a_sweep_over_a_storage_object_resumes_from_its_checkpoint(tmp_path, trainer_kwargs, given):
    """A storage object (Optuna's JournalStorage, its file storage for several processes) went into the checkpoint's
    sweep state, which a checkpoint then could not load (`UnpicklingError: Weights only load failed`). It is named
    there now, not kept: the resume is given it again (or a study over it), and one that is not says so."""
    from optuna.storages.journal import JournalFileBackend

    def sweep(how="storage"):
        kept = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
        where = ({"storage": kept} if how == "storage" else {} if how == "none" else
                 {"study": optuna.load_study(study_name="multilora", storage=kept)})
        return OptunaSweep(SPACE, n_trials=3, base={"max_steps": 4, "batch_size": 2}, slots=2, **where)

    trainer, _ = fit(tmp_path / "a", trainer_kwargs, sweep(), max_steps=3)
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    with pytest.raises(ValueError, match=r"in a storage object \(JournalStorage\), which a checkpoint does not hold: "
                                         r"give the same storage again"):
        fit(tmp_path / "b", trainer_kwargs, sweep("none"), ckpt=str(tmp_path / "stop.ckpt"))
    _, module = fit(tmp_path / "c", trainer_kwargs, resumed := sweep(given), ckpt=str(tmp_path / "stop.ckpt"))
    trials = resumed.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert {r.name for r in module.registry} == {f"trial-{t.number}" for t in trials}


def test_a_sweep_whose_run_folder_moved_resumes_with_the_study_beside_its_checkpoint(tmp_path, trainer_kwargs):
    """The run folder's own study is kept in the checkpoint by absolute path: after the folder moved, the resume made
    an empty study at the old place, asked trial 0 again and failed on a duplicate adapter name. It goes on with the
    optuna.db above the checkpoint now (warned), or names the missing study."""
    import shutil

    def sweep():
        return OptunaSweep(SPACE, n_trials=3, base={"max_steps": 4, "batch_size": 2}, slots=2)

    trainer, _ = fit(tmp_path / "a", {**trainer_kwargs, "default_root_dir": str(tmp_path / "a")}, sweep(), max_steps=3)
    trainer.save_checkpoint(tmp_path / "a" / "ck" / "stop.ckpt")
    shutil.move(tmp_path / "a", tmp_path / "b")
    kwargs = {**trainer_kwargs, "default_root_dir": str(tmp_path / "b")}
    with pytest.warns(UserWarning, match=r"the study this checkpoint's sweep ran is not at .*a/optuna.db \(the run "
                                         r"folder moved\?\): going on with .*b/optuna.db"):
        _, resumed = fit(tmp_path / "b", kwargs, sweep(), ckpt=str(tmp_path / "b" / "ck" / "stop.ckpt"))
    assert not (tmp_path / "a").exists()
    trials = optuna.load_study(study_name="multilora", storage=f"sqlite:///{tmp_path / 'b' / 'optuna.db'}").get_trials()
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state.is_finished() for t in trials)
    (tmp_path / "b" / "optuna.db").unlink()
    with pytest.raises(ValueError, match=r"the study this checkpoint's sweep ran, in .*a/optuna.db, is not there .*"
                                         r"give its place, `storage="):
        fit(tmp_path / "b", kwargs, sweep(), ckpt=str(tmp_path / "b" / "ck" / "stop.ckpt"))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("resumed", [False, True])
def test_a_fit_stopped_by_ctrl_c_tells_the_exits_and_fails_the_trials_no_checkpoint_resumes(tmp_path, trainer_kwargs,
                                                                                            resumed):
    """After Ctrl+C the trials still training stayed RUNNING without the word a ``max_steps`` stop gives; and where no
    checkpoint could resume them they stayed RUNNING for ever (without a heartbeat nothing fails them): they are told
    FAIL, why in ``fail_reason``, as Optuna's ``optimize`` tells a trial interrupted, once the module is dropped (or
    the process ends: a fit of it again goes on with them, `test_a_fit_again_after_ctrl_c_...`). A run resumed from a
    checkpoint and stopped before it saved one is resumed from that checkpoint again: its trials stay RUNNING, and
    the warning names it (it said that no checkpoint could resume them)."""
    import gc

    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class CtrlC(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                raise KeyboardInterrupt

    def sweep():
        return OptunaSweep(SPACE, n_trials=4, base={"max_steps": 3, "batch_size": 2}, slots=1,
                           storage=f"sqlite:///{tmp_path / 'study.db'}")

    ckpt = None
    if resumed:  # (a checkpoint at step 2, trial 1 asked at step 3 after it)
        save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        with pytest.warns(UserWarning, match=r"trials \[1\] stay RUNNING"), pytest.raises(SystemExit):
            fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), sweep(), callbacks=[CtrlC(), save])
        ckpt = str(tmp_path / "ck" / "step=2.ckpt")
    said = (r"trials \[1\] stay RUNNING in study 'multilora': the fit stopped by KeyboardInterrupt before their "
            r"adapters finished .*Resume from the last checkpoint \(.*step=2.ckpt; .*with `heartbeat_interval`, a later"
            if resumed else
            r"trials \[1\] stay RUNNING in study 'multilora': the fit stopped by KeyboardInterrupt before their "
            r"adapters finished .*and no checkpoint of this run was saved: fitting this module again goes on with them "
            r"\(and tells them\); else they are told FAIL as the module is dropped or this process ends")
    with pytest.warns(UserWarning, match=said), pytest.raises(SystemExit):
        fit(tmp_path, trainer_kwargs, sweep(), callbacks=[CtrlC()], ckpt=ckpt)
    study = optuna.load_study(study_name="multilora", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "RUNNING"]  # (the module may be fitted again)
    gc.collect()  # (the module dropped)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "RUNNING" if resumed else "FAIL"]
    assert trials[1].user_attrs.get("fail_reason") == (None if resumed else (
        "the fit stopped by KeyboardInterrupt at step 1 of its adapter, and no checkpoint of the run can resume it"))
    if not resumed:  # (its adapter exported as the fit stopped: the study leads to it, as to any trial's)
        exit_info = trials[1].user_attrs["adapter_exit"]
        assert exit_info["step"] == 1 and (Path(exit_info["export_path"]) / "adapter_model.safetensors").is_file()


def test_trials_a_max_steps_stop_leaves_with_no_checkpoint_are_failed_as_the_module_is_dropped(tmp_path,
                                                                                               trainer_kwargs):
    """A `multilora fit --trainer.max_steps 3` smoke test of a sweep on a shared study left its trials RUNNING for
    good (no checkpoint could resume them, and the process ended): the real run then skipped their grid points. They
    are told FAIL as the module is dropped (or the process ends), as after Ctrl+C; until then it may be fitted
    again."""
    import gc

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.warns(UserWarning, match=r"trials \[0, 1\] stay RUNNING in study 'multilora': the Trainer stopped at "
                                         r"its max_steps=2 .*and no checkpoint of this run was saved"):
        fit(tmp_path, trainer_kwargs, OptunaSweep(SPACE, n_trials=4, storage=storage, slots=2,
                                                  base={"max_steps": 6, "batch_size": 2}), max_steps=2)
    study = optuna.load_study(study_name="multilora", storage=storage)
    gc.collect()  # (the module dropped)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert trials[0].user_attrs["fail_reason"] == ("the Trainer stopped at its max_steps=2 at step 2 of its adapter, "
                                                   "and no checkpoint of the run can resume it")
    # a checkpoint the user writes after the stop resumes them: they stay RUNNING for it
    storage = f"sqlite:///{tmp_path / 'saved.db'}"
    with pytest.warns(UserWarning, match="stay RUNNING"):
        trainer, _ = fit(tmp_path, trainer_kwargs, OptunaSweep(SPACE, n_trials=4, storage=storage, slots=2,
                                                               base={"max_steps": 6, "batch_size": 2}), max_steps=2)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    del trainer, _
    gc.collect()
    assert [t.state.name for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()] == [
        "RUNNING", "RUNNING"]


def test_a_fit_again_after_ctrl_c_without_a_checkpoint_goes_on_with_its_trials_and_tells_them(tmp_path,
                                                                                              trainer_kwargs):
    """Its trials were told FAIL at the Ctrl+C, and a fit of the module again (a notebook's) trained them to the end:
    the study kept them failed, and they no longer counted against `slots` (three adapters trained at once with two
    slots). They stay RUNNING until the module is dropped; the fit again takes them up and tells them."""
    import gc

    from lightning.pytorch.callbacks import Callback

    class CtrlC(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                raise KeyboardInterrupt

    class Running(Callback):
        def __init__(self):
            self.most = 0

        def on_train_batch_start(self, trainer, pl_module, *args):
            self.most = max(self.most, len(pl_module.registry.running))

    storage = f"sqlite:///{tmp_path / 'study.db'}"

    def sweep():
        return OptunaSweep(SPACE, n_trials=3, base={"max_steps": 4, "batch_size": 2}, slots=2, storage=storage)

    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"))
    with pytest.warns(UserWarning, match=r"trials \[0, 1\] stay RUNNING"), pytest.raises(SystemExit):
        L.Trainer(**trainer_kwargs, callbacks=[sweep(), CtrlC()]).fit(module, dm())
    running = Running()
    L.Trainer(**trainer_kwargs, callbacks=[sweep(), running]).fit(module, dm())
    gc.collect()
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3 and running.most == 2
    for t in trials:
        assert t.value == pytest.approx(module.registry[f"trial-{t.number}"].last_val_loss)
    del module
    gc.collect()  # (taken up: nothing is told FAIL as the module goes)
    assert [t.state.name for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()] == \
        ["COMPLETE"] * 3


def test_trials_a_checkpoint_saved_on_the_exception_resumes_stay_running(tmp_path, trainer_kwargs):
    """(A `ModelCheckpoint(save_on_exception=True)` saves after the sweep's hook: its trials were told FAIL, and the
    resume from the checkpoint it then saved trained them to the end, the study keeping them failed.)"""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class CtrlC(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                raise KeyboardInterrupt

    sweep = OptunaSweep(SPACE, n_trials=4, base={"max_steps": 3, "batch_size": 2}, slots=1,
                        storage=f"sqlite:///{tmp_path / 'study.db'}")
    save = ModelCheckpoint(dirpath=tmp_path / "ck", save_on_exception=True, every_n_train_steps=100)
    with pytest.warns(UserWarning, match=r"trials \[1\] stay RUNNING .*ModelCheckpoint saves on the exception"), \
            pytest.raises(SystemExit):
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), sweep, callbacks=[CtrlC(), save])
    trials = optuna.load_study(study_name="multilora", storage=f"sqlite:///{tmp_path / 'study.db'}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "RUNNING"] and list((tmp_path / "ck").glob("*.ckpt"))


def test_a_sweep_into_a_log_directory_holding_another_runs_study_says_so(tmp_path, trainer_kwargs):
    """The run folder's own study (no `storage` given) of another run was gone on with, silently (`multilora fit`
    refuses such a folder); a `storage` named is shared on purpose, and says nothing."""
    import warnings

    def sweep(**kwargs):
        return OptunaSweep(SPACE, n_trials=1, base={"max_steps": 2, "batch_size": 1}, slots=1, **kwargs)

    def said(make):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fit(tmp_path, trainer_kwargs, make())
        return [str(w.message) for w in seen if str(w.message).startswith("OptunaSweep: the log directory's")]

    assert said(sweep) == []
    (message,) = said(sweep)
    assert message.startswith(f"OptunaSweep: the log directory's {(tmp_path / 'optuna.db').resolve()} holds another "
                              "run's 1 trials in study 'multilora'; this sweep goes on with that study")
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    assert said(lambda: sweep(storage=storage)) == [] and said(lambda: sweep(storage=storage)) == []


def test_a_sweep_from_a_peft_folder_checks_the_space_and_fails_a_trial_whose_folder_no_longer_fits(tmp_path,
                                                                                                    trainer_kwargs):
    """With ``init_from`` in ``base``, a searched rank (or the alpha `alpha_over_rank` makes) that the folder does
    not hold is named before the run; a folder replaced mid-run by one that no longer fits fails the trial asked
    then, alone (a warning), and the trial already training finishes."""
    import shutil

    from lightning.pytorch.callbacks import Callback
    from peft import LoraConfig, get_peft_model

    from lightning_multilora.base_model import build_base_model

    def save_peft(folder, hidden):
        base = build_base_model("tiny-llama")
        if hidden != base.config.hidden_size:
            base.config.hidden_size = hidden
            base = type(base)(base.config)
        get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"])).save_pretrained(folder)

    save_peft(tmp_path / "peft", 64)
    with pytest.raises(ValueError, match=r"`search_space` 'rank': its value 4 makes no valid adapter .*differs from "
                                         r"the spec: rank=2 there, 4 in the spec"):
        OptunaSweep({"rank": {"type": "categorical", "choices": [2, 4]}}, base={"init_from": str(tmp_path / "peft")})
    with pytest.raises(ValueError, match=r"^OptunaSweep `base`: `init_from` '.*peft' differs from the spec: rank=2 "
                                         r"there, 8 in the spec"):  # (not the searched lr, nor adapter 'check')
        OptunaSweep({"lr": SPACE["lr"]}, base={"init_from": str(tmp_path / "peft"), "rank": 8, "alpha": 4})
    with pytest.raises(ValueError, match=r"alpha=4 there, 6.0 in the spec.*\(alpha is alpha_over_rank=3 x rank"):
        OptunaSweep(SPACE | {"rank": {"type": "categorical", "choices": [2]}}, alpha_over_rank=3,
                    base={"init_from": str(tmp_path / "peft")})

    class ReplaceFolder(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:  # (from a base of another width: the config fits, the weights do not)
                shutil.rmtree(tmp_path / "peft")
                save_peft(tmp_path / "peft", 32)

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep = OptunaSweep({"lr": SPACE["lr"]}, n_trials=2, storage=storage, slots=1,
                        base={"max_steps": 4, "batch_size": 2, "init_from": str(tmp_path / "peft"), "rank": 2})
    with pytest.warns(UserWarning, match=r"trial 1 with \{'lr': .*\} failed: .*other shapes"):
        _, module = fit(tmp_path, trainer_kwargs, sweep, callbacks=[ReplaceFolder()])
    states = [t.state for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    assert module.registry["trial-0"].state == AdapterState.FINISHED and module.registry["trial-0"].step == 4


def test_the_search_space_check_warns_of_no_made_up_adapter():
    """The search space is checked on a made-up adapter, "check": its warnings (a warmup longer than the run) named
    it to the user as if it were theirs."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OptunaSweep({"warmup_steps": {"type": "int", "low": 0, "high": 50}}, base={"max_steps": 20})
    assert not [w for w in caught if "'check'" in str(w.message)], [str(w.message) for w in caught]


def test_another_fit_goes_on_with_its_sweeps_trials_and_refuses_another_sweeps(tmp_path, trainer_kwargs):
    """A module stopped (``max_steps``) with trials running, fitted again with a new OptunaSweep object of the same
    study, goes on with them (the carried state: `carried_callback_state`); one of another study or storage was
    forced on them ("this checkpoint's sweep ran study...", or a KeyError from the other storage)."""
    storage = f"sqlite:///{tmp_path / 's.db'}"

    def sweep(study_name="multilora", where=storage):
        return OptunaSweep(SPACE, n_trials=3, storage=where, slots=2, base={"max_steps": 4, "batch_size": 2},
                           study_name=study_name)

    module = MultiLoRAModule("tiny-llama", adapters=[], export_dir=str(tmp_path / "out"), validate_on_finish=False)
    kwargs = dict(trainer_kwargs, val_check_interval=2)
    with pytest.warns(UserWarning, match="stay RUNNING"):
        L.Trainer(**{**kwargs, "max_steps": 2}, callbacks=[sweep()]).fit(module, dm())
    for other in (sweep("second"), sweep(where=f"sqlite:///{tmp_path / 'other.db'}")):
        with pytest.raises(ValueError, match=r"the module holds the trials of another sweep from its last fit "
                                             r"\(study 'multilora' in 'sqlite:///.*s.db'"):
            L.Trainer(**kwargs, callbacks=[other]).fit(module, dm())
    L.Trainer(**kwargs, callbacks=[sweep()]).fit(module, dm())  # (the refused fits kept the state for this one)
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert sorted(r.name for r in module.registry) == ["trial-0", "trial-1", "trial-2"]


@pytest.mark.parametrize("first_max_steps", [2, -1])
def test_one_sweep_object_given_to_the_fit_of_another_module_asks_its_trials_anew(tmp_path, trainer_kwargs,
                                                                                   first_max_steps):
    """As `study.optimize` called again: ``n_trials`` more. Given after a fit stopped with trials running, it looked
    up the first module's trials in the second ("no adapter 'trial-0'"); after one that finished them all, it asked
    none ("no adapter to train")."""
    study = optuna.create_study()
    sweep = OptunaSweep(SPACE, n_trials=2, study=study, slots=2, base={"max_steps": 3, "batch_size": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (trials left RUNNING by the stopped fit)
        fit(tmp_path / "one", dict(trainer_kwargs, max_steps=first_max_steps), sweep)
    _, module = fit(tmp_path / "two", trainer_kwargs, sweep)
    assert sorted(r.name for r in module.registry) == ["trial-2", "trial-3"]
    assert all(r.state == AdapterState.FINISHED for r in module.registry)
    gc.collect()  # (the first module dropped: the trials its stop left, no checkpoint to resume them, told FAIL)
    states = [t.state for t in study.get_trials()]
    first = optuna.trial.TrialState.FAIL if first_max_steps == 2 else optuna.trial.TrialState.COMPLETE
    assert states == [first] * 2 + [optuna.trial.TrialState.COMPLETE] * 2


def test_trials_left_running_by_an_early_stopping_name_it_and_not_max_steps(tmp_path, trainer_kwargs):
    """A run that an EarlyStopping ended left its trials RUNNING "as the Trainer stopped (its max_steps or max_time)",
    to be resumed "with a larger Trainer max_steps" (the run had none)."""
    from lightning.pytorch.callbacks import EarlyStopping

    sweep = OptunaSweep(SPACE, n_trials=2, storage=f"sqlite:///{tmp_path / 's.db'}",
                        base={"max_steps": 30, "batch_size": 2}, slots=2)
    stop = EarlyStopping(monitor="adapters/trial-0/val_loss", stopping_threshold=100.0, mode="min")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = fit(tmp_path, trainer_kwargs, sweep, callbacks=[stop])
    assert trainer.global_step == 3  # (its first validation)
    told = [str(w.message) for w in caught if "stay RUNNING" in str(w.message)]
    assert len(told) == 1 and "trials [0, 1] stay RUNNING in study 'multilora': `EarlyStopping(monitor='adapters/" \
                              "trial-0/val_loss')` stopped the run (" in told[0], told
    assert "max_steps" not in told[0] and "max_time" not in told[0]


def test_a_sweep_under_an_admission_budget_asks_no_more_trials_than_max_running_takes(tmp_path, trainer_kwargs):
    """With an admission controller the sweep asked trials until the memory model said one must wait, past the
    module's ``max_running``: nine trials asked before any result (seven waiting RUNNING in the study, a sampler
    asking blind)."""
    from lightning.pytorch.callbacks import Callback

    from lightning_multilora.scheduling.admission import AdmissionController

    class Count(Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rows.append((len(pl_module.registry.running), len(pl_module.registry.queued)))

    sweep = OptunaSweep(SPACE, n_trials=6, storage=f"sqlite:///{tmp_path / 's.db'}",
                        base={"max_steps": 3, "batch_size": 1})
    module = MultiLoRAModule("tiny-llama", max_running=2, export_dir=str(tmp_path / "out"),
                             admission=AdmissionController(lambda specs: 100.0 * sum(s.batch_size for s in specs),
                                                           capacity_bytes=800, safety_margin=1.0))  # (8 would fit)
    count = Count()
    L.Trainer(**trainer_kwargs, callbacks=[sweep, count]).fit(module, dm())
    assert count.rows and max(running + queued for running, queued in count.rows) == 2
    assert [t.state for t in sweep.study.get_trials()] == [optuna.trial.TrialState.COMPLETE] * 6


@pytest.mark.parametrize("how", ["study given first, not again", "another storage holding other trials"])
def test_a_resume_onto_a_study_that_holds_not_its_trials_is_refused_before_any_step(tmp_path, trainer_kwargs, how):
    """A resume that opened another study (the study given first and not again, a relative SQLite path from another
    directory, another storage) retrained its trials' steps and then failed at the first validation ("Record does not
    exist"), or told its values into the other study's trials of the same numbers, silently."""
    from lightning.pytorch.callbacks import Callback

    class Steps(Callback):
        def __init__(self):
            self.steps = 0

        def on_train_batch_end(self, *args):
            self.steps += 1

    first = f"sqlite:///{tmp_path / 'first.db'}"
    trainer, _ = fit(tmp_path / "a", trainer_kwargs, OptunaSweep(
        SPACE, n_trials=3, base={"max_steps": 4, "batch_size": 2}, slots=2,
        **({"study": optuna.create_study(storage=first, study_name="multilora")} if how.startswith("study") else
           {"storage": first})), max_steps=3)
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    other = f"sqlite:///{tmp_path / 'other.db'}"
    if how.startswith("another"):  # (a study of the same name and trial numbers, another sweep's)
        fit(tmp_path / "b", trainer_kwargs, OptunaSweep(SPACE, n_trials=3, storage=other,
                                                        base={"max_steps": 2, "batch_size": 2}, slots=3), max_steps=2)
    before = [(t.number, t.state, t.value) for t in optuna.load_study(study_name="multilora", storage=other)
              .get_trials()] if how.startswith("another") else []
    steps = Steps()
    where = f"storage '{first}'"  # (a study given: its storage's, too)
    with pytest.raises(ValueError, match=rf"this checkpoint's sweep asked trials \[0, 1\] in study 'multilora' of "
                                         rf"{re.escape(where)}.*does not hold them: give that storage again"):
        fit(tmp_path / "c", {**trainer_kwargs, "default_root_dir": str(tmp_path / "c")},
            OptunaSweep(SPACE, n_trials=3, base={"max_steps": 4, "batch_size": 2}, slots=2,
                        **({"storage": other} if how.startswith("another") else {})),
            callbacks=[steps], ckpt=str(tmp_path / "stop.ckpt"))
    assert steps.steps == 0
    if how.startswith("another"):  # (the other study's trials untouched)
        after = optuna.load_study(study_name="multilora", storage=other).get_trials()
        assert [(t.number, t.state, t.value) for t in after] == before
    kept = optuna.load_study(study_name="multilora", storage=first).get_trials()
    assert [t.state.name for t in kept] == ["RUNNING", "RUNNING"]  # (still the checkpoint's, to resume)


def test_a_parameter_searched_as_another_kind_than_the_studys_is_named_as_the_study_opens(tmp_path, trainer_kwargs):
    """Optuna refused it at the first ask ("Cannot set different distribution kind"), naming neither the parameter
    nor the study, and left a failed trial without parameters in the study at every attempt."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    fit(tmp_path / "one", trainer_kwargs, OptunaSweep(SPACE, n_trials=1, storage=storage,
                                                      base={"max_steps": 2, "batch_size": 2}))
    other = dict(SPACE, lr={"type": "categorical", "choices": [1e-3, 1e-2]})
    with pytest.raises(ValueError, match=r"`search_space` 'lr': of type CategoricalDistribution, and study "
                                         r"'multilora' holds trials where it is of type FloatDistribution .*search "
                                         r"it as the study did"):
        fit(tmp_path / "two", trainer_kwargs, OptunaSweep(other, n_trials=1, storage=storage,
                                                          base={"max_steps": 2, "batch_size": 2}))
    assert [t.state.name for t in optuna.load_study(study_name="multilora", storage=storage).get_trials()] == [
        "COMPLETE"]


def test_a_smoke_runs_trials_are_told_failed_not_left_running(tmp_path, trainer_kwargs, monkeypatch):
    """``fast_dev_run`` asks trials in the study it is given and stops after one step, no checkpoint to resume: its
    trials stayed RUNNING for ever, their numbers taken."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # (the smoke run's exports: not left in /tmp)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with pytest.warns(UserWarning, match=r"trials \[0, 1\] of this smoke run \(`fast_dev_run`\) are told FAIL"):
        fit(tmp_path, trainer_kwargs, OptunaSweep(SPACE, n_trials=4, storage=storage, slots=2,
                                                  base={"max_steps": 4, "batch_size": 2}), fast_dev_run=True)
    trials = optuna.load_study(study_name="multilora", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert trials[0].user_attrs["fail_reason"] == "a smoke run (`fast_dev_run`) ended at step 1 of its adapter"


def test_a_float_searched_on_another_scale_than_the_studys_is_named_as_the_study_opens(tmp_path, trainer_kwargs):
    """Optuna refuses a float parameter whose `log` differs from the study's ("Cannot set different log
    configuration"): it came at the first ask, a failed trial left in the study."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    fit(tmp_path / "one", trainer_kwargs, OptunaSweep(SPACE, n_trials=1, storage=storage,
                                                      base={"max_steps": 2, "batch_size": 2}))
    other = dict(SPACE, lr={"type": "float", "low": 1e-4, "high": 1e-2})
    with pytest.raises(ValueError, match=r"`search_space` 'lr': FloatDistribution\(.*log=False.*\), and study "
                                         r"'multilora' holds trials of FloatDistribution\(.*log=True.*\): .*log"):
        fit(tmp_path / "two", trainer_kwargs, OptunaSweep(other, n_trials=1, storage=storage,
                                                          base={"max_steps": 2, "batch_size": 2}))
    assert len(optuna.load_study(study_name="multilora", storage=storage).get_trials()) == 1


def test_where_a_study_is_kept_is_said_without_a_database_password():
    """The storage's URL went into the checkpoint's sweep state and the resume's error, a password included."""
    from types import SimpleNamespace as NS

    from lightning_multilora.callbacks.optuna_sweep import _storage_name

    study = NS(_storage=NS(url="postgresql://alice:s3cret@db.internal/optuna"))
    assert "s3cret" not in _storage_name(study) and "alice:***@db.internal/optuna" in _storage_name(study)


def _crash_at(step: int) -> L.Callback:
    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == step:
                raise RuntimeError("node lost")

    return Crash()


def _sweep_on(storage: str, pruner: optuna.pruners.BasePruner, n_trials: int, slots: int) -> OptunaSweep:
    study = optuna.create_study(storage=storage, study_name="s", load_if_exists=True, pruner=pruner)
    return OptunaSweep(SPACE, n_trials=n_trials, study=study, slots=slots, base={"max_steps": 8, "batch_size": 2})


def test_a_trial_taken_up_on_resume_is_judged_by_the_pruner_once_it_has_validated_as_far_again(tmp_path,
                                                                                               trainer_kwargs):
    """A trial asked after the checkpoint, RUNNING at the crash, holds the values its crashed run reported (steps 2
    and 4); its retrained adapter was asked of the pruner at its first settling, which read the study's step-4
    value: pruned before it had trained (step 0, "validation loss nan"), its export untrained."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    storage = f"sqlite:///{tmp_path / 's.db'}"
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=8, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):  # (trial 1 asked at step 8, after its checkpoint)
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), _sweep_on(storage, _PruneAfter(100), 2, 1),
            callbacks=[_crash_at(13), save], val_check_interval=2)
    trial = optuna.load_study(study_name="s", storage=storage).trials[1]
    assert trial.state == optuna.trial.TrialState.RUNNING and sorted(trial.intermediate_values) == [2, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, module = fit(tmp_path, trainer_kwargs, _sweep_on(storage, _PruneAfter(4), 2, 1),
                        ckpt=str(tmp_path / "ck" / "step=8.ckpt"), val_check_interval=2)
    rec = module.registry["trial-1"]
    assert (rec.state, rec.step, rec.exported_step) == (AdapterState.PRUNED, 4, 4), rec.reason
    assert "_PruneAfter at step 4" in rec.reason
    assert optuna.load_study(study_name="s", storage=storage).trials[1].state == optuna.trial.TrialState.PRUNED


def test_a_trial_the_checkpoint_holds_told_after_it_is_not_trained_again_on_resume(tmp_path, trainer_kwargs):
    """Trials the checkpoint holds RUNNING, pruned after it by the run that wrote it, were trained again on resume: a
    pruner judging anew (here one that prunes nothing) let them finish, their exports written over with weights the
    study does not describe, and their reports were refused "by another process sharing the study". They keep the
    study's end, and their exports stand; the trial asked after the checkpoint is taken up."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    storage = f"sqlite:///{tmp_path / 's.db'}"
    save = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="node lost"):  # (trials 0, 1 pruned at step 4, after its checkpoint)
        fit(tmp_path, dict(trainer_kwargs, enable_checkpointing=True), _sweep_on(storage, _PruneAfter(4), 3, 2),
            callbacks=[_crash_at(6), save], val_check_interval=2)
    study = optuna.load_study(study_name="s", storage=storage)
    assert [t.state.name for t in study.trials] == ["PRUNED", "PRUNED", "RUNNING"]
    described = {n: (tmp_path / "out" / f"trial-{n}" / "multilora_export.json").read_text() for n in (0, 1)}
    with pytest.warns(UserWarning, match=r"trials 0 \(PRUNED\), 1 \(PRUNED\) were told in study 's' after the "
                                         r"checkpoint this run resumed from, by the run that wrote it"):
        _, module = fit(tmp_path, trainer_kwargs, _sweep_on(storage, _PruneAfter(100), 3, 2),
                        ckpt=str(tmp_path / "ck" / "step=4.ckpt"), val_check_interval=2)
    for n in (0, 1):
        rec, trial = module.registry[f"trial-{n}"], study.trials[n]
        assert (rec.state, rec.step, rec.exported_step) == (AdapterState.PRUNED, 4, 4), rec.reason
        assert rec.export_path == trial.user_attrs["adapter_exit"]["export_path"]
        # (what the checkpoint's record says of it is kept: the report's chart and curves)
        assert (rec.spans, rec.ended_at_step, [s for s, _ in rec.train_losses]) == ([[0, 4]], 4, [1, 2, 3, 4])
        assert [s for s, _ in rec.val_losses] == [2, 4] and rec.tokens_seen > 0
        assert (tmp_path / "out" / f"trial-{n}" / "multilora_export.json").read_text() == described[n]
    assert module.registry["trial-2"].state == AdapterState.FINISHED
    assert [t.state.name for t in optuna.load_study(study_name="s", storage=storage).trials] == [
        "PRUNED", "PRUNED", "COMPLETE"]
