"""EarlyExit's rules on scripted loss curves: each exit fires exactly when the rule says."""

from __future__ import annotations

import math
import random
import warnings

import pytest

from lightning_multilora import EarlyExit
from lightning_multilora.callbacks.early_exit import slope


def feed(rule: EarlyExit, train: list[float], val: list[float], per_eval: int = 1) -> list:
    """Feed `per_eval` training losses then one validation loss; return the decision after each eval."""
    out = []
    for i, v in enumerate(val):
        for loss in train[i * per_eval:(i + 1) * per_eval]:
            rule.observe_train_loss("a", loss)
        out.append(rule.observe_validation("a", v, step=i))
    return out


def test_slope_is_least_squares():
    assert slope([1.0, 2.0]) == pytest.approx(1.0)
    assert slope([3.0, 1.0, 2.0, 0.0]) == pytest.approx(-0.8)
    assert slope([5.0]) == 0.0


def test_divergence_fires_on_the_second_consecutive_rising_evaluation():
    rule = EarlyExit(ema_alpha=1.0, tau_gap=10.0)  # ema = the raw loss, to script it exactly; no overfit rule
    decisions = feed(rule, train=[1.0, 1.1, 1.3, 1.6], val=[1.2, 1.3, 1.5, 1.8])
    # eval 0: no slope yet; eval 1: both slopes > tau (count 1); eval 2: count 2 -> diverged
    assert decisions[:3] == [None, None, "diverged"]


def test_a_transient_spike_resets_the_divergence_count():
    rule = EarlyExit(ema_alpha=1.0, tau_gap=10.0)
    decisions = feed(rule, train=[1.0, 1.2, 0.9, 1.1, 0.8, 1.0], val=[1.0, 1.2, 0.9, 1.1, 0.8, 1.0])
    assert decisions == [None] * 6  # up, down, up, down: never two rising evaluations in a row
    assert rule.watches["a"].divergence_count == 1


def test_only_training_rising_is_not_divergence():
    rule = EarlyExit(ema_alpha=1.0, tau_gap=10.0)
    assert feed(rule, train=[1.0, 1.1, 1.2, 1.3], val=[1.0, 0.9, 0.8, 0.7]) == [None] * 4


def test_a_validation_loss_that_overflows_is_the_steepest_rise():
    """(An infinite validation loss was skipped: an adapter whose held-out loss overflowed while its training loss
    rose never diverged.) It is a rise past any slope, and past any gap where training does not rise; NaN (no
    validation tokens measured it) is still no evaluation."""
    rule = EarlyExit(ema_alpha=1.0, tau_gap=10.0)
    assert feed(rule, train=[1.0, 1.2, 1.4, 1.6], val=[1.0, 1.3, math.nan, math.inf]) == [None, None, None,
                                                                                          "diverged"]
    assert slope([1.0, math.inf]) == math.inf
    rule = EarlyExit(ema_alpha=1.0)
    assert feed(rule, train=[1.0, 0.9, 0.8], val=[1.0, math.inf, math.inf]) == [None, None, "overfit"]
    # (a validation loss back from an overflow fell: the next evaluation counted it as a rise, and an adapter whose
    # training loss crept up diverged as it recovered)
    assert slope([math.inf, 1.0]) == -math.inf and slope([1.0, math.inf, 1.2]) == pytest.approx(0.1)
    # (with a longer window, any overflow in it had hidden a rise of the finite losses around it)
    assert slope([0.5, math.inf, 3.0]) == pytest.approx(1.25)
    assert slope([math.inf, 0.6, math.inf, 3.0]) == pytest.approx(1.2)
    rule = EarlyExit(ema_alpha=1.0, tau_gap=math.inf, window=3)
    assert feed(rule, train=[1.0, 1.1, 1.2, 1.3], val=[0.5, 0.6, math.inf, 3.0])[-1] == "diverged"
    rule = EarlyExit(ema_alpha=1.0, tau_gap=math.inf)
    assert feed(rule, train=[1.0, 1.01, 1.02], val=[1.0, math.inf, 0.9]) == [None, None, None]


def test_overfitting_fires_after_patience_evaluations_above_the_gap():
    rule = EarlyExit(ema_alpha=1.0)
    train = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3]
    val = [1.05, 0.85, 0.7, 0.72, 0.75, 0.8]  # gaps: 5%, 6%, 16.7% (a new best), 44%, 87%, 167%
    assert feed(rule, train, val) == [None, None, None, None, "overfit", "overfit"]
    rule = EarlyExit(ema_alpha=1.0, patience_ovf=3)
    assert feed(rule, train, val) == [None, None, None, None, None, "overfit"]


def test_a_gap_while_the_validation_loss_still_falls_is_not_overfitting():
    train = [1.0, 0.8, 0.6, 0.5, 0.4]
    val = [1.05, 0.85, 0.7, 0.58, 0.5]  # gaps: 5%, 6%, 16.7%, 16%, 25%, every validation a new best
    assert feed(EarlyExit(ema_alpha=1.0), train, val) == [None] * 5
    # ALTO's rule as written counts them: overfit at the second gap above tau
    assert feed(EarlyExit(ema_alpha=1.0, overfit_while_improving=True), train, val) == [None, None, None, "overfit",
                                                                                        "overfit"]


def test_a_new_best_validation_resets_the_overfitting_count():
    rule = EarlyExit(ema_alpha=1.0)
    train = [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    val = [1.0, 0.9, 0.95, 0.8, 0.85, 0.9]  # above the best at 2, a new best at 3, above it at 4 and 5
    assert feed(rule, train, val) == [None, None, None, None, None, "overfit"]
    assert rule.watches["a"].overfit_count == 2


def test_overfitting_count_resets_when_the_gap_closes():
    rule = EarlyExit(ema_alpha=1.0)
    assert feed(rule, train=[1.0, 1.0, 1.0, 1.0], val=[1.2, 1.05, 1.2, 1.05]) == [None] * 4


def test_noisy_but_healthy_curves_never_exit():
    rng = random.Random(0)
    rule = EarlyExit(ema_alpha=0.1)
    train = [2.0 * math.exp(-i / 300) + rng.gauss(0, 0.15) for i in range(2000)]
    val = [2.0 * math.exp(-((i + 1) * 50) / 300) * 1.03 + rng.gauss(0, 0.005) for i in range(40)]
    assert feed(rule, train, val, per_eval=50) == [None] * 40


def test_ema_smooths_and_state_round_trips():
    rule = EarlyExit(ema_alpha=0.5)
    rule.observe_train_loss("a", 2.0)
    assert rule.observe_train_loss("a", 1.0) == pytest.approx(1.5)
    rule.observe_validation("a", 1.6, step=3)
    again = EarlyExit(ema_alpha=0.5)
    again.load_state_dict(rule.state_dict())
    assert again.watches["a"] == rule.watches["a"]


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 1}, "`window` must be an integer >= 2, got 1"),
    ({"window": 2.5}, "`window` must be an integer >= 2, got 2.5"),  # (was a TypeError at the first validation)
    ({"ema_alpha": 0.0}, "`ema_alpha` must be a number in \\(0, 1\\]"),
    ({"patience_div": 0}, "`patience_div` must be an integer >= 1"),
    ({"patience_ovf": float("nan")}, "`patience_ovf` must be an integer >= 1, got nan"),  # (never exited)
    ({"tau_gap": float("nan")}, "`tau_gap` must be a number >= 0 \\(inf: never\\), got nan"),  # (never overfit)
    ({"tau_slope": float("nan")}, "`tau_slope` must be a number >= 0 \\(inf: never\\), got nan"),  # (never diverged)
    ({"tau_slope": "0.1"}, "`tau_slope` must be a number >= 0 \\(inf: never\\), got '0.1'"),
    ({"keep_best_weights": "no"}, "`keep_best_weights` must be True or False"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyExit(**kwargs)


def test_the_callers_view_of_a_new_best_decides_whether_a_gap_counts():
    """The callback passes the adapter record's own best (it also counts validations made outside the loop)."""
    rule = EarlyExit(ema_alpha=1.0)
    rule.observe_train_loss("a", 0.5)
    # falling validations, yet not new bests for the record (a better one was measured by `evaluate`)
    assert rule.observe_validation("a", 0.9, step=1, new_best=False) is None
    assert rule.observe_validation("a", 0.8, step=2, new_best=False) == "overfit"
    rule = EarlyExit(ema_alpha=1.0)
    rule.observe_train_loss("a", 0.5)
    assert [rule.observe_validation("a", v, step=i, new_best=True) for i, v in enumerate([0.9, 0.95, 1.0])] == [None] * 3


def test_a_checkpoint_of_other_settings_is_restored_under_the_new_ones_and_said():
    """Lightning restores a callback's state by its key, which holds the rule's settings: a resume with other ones
    started the averages and counters over (under Lightning's "Please add the following callbacks"). The module hands
    the callback the checkpoint first: the state is taken under its key, and the change said."""
    written = EarlyExit()
    written.observe_train_loss("a", 2.0)
    checkpoint = {"callbacks": {written.state_key: written.state_dict(), "Other": {}}}
    resumed = EarlyExit(tau_gap=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.adopt_checkpoint_state(checkpoint)  # (taken under its key; loading it says what changed)
    assert set(checkpoint["callbacks"]) == {resumed.state_key, "Other"}
    with pytest.warns(UserWarning, match=r"the checkpoint's EarlyExit ran with tau_gap=0.1; now tau_gap=0.2: every "
                                         r"adapter's loss average and patience counters go on"):
        resumed.load_state_dict(checkpoint["callbacks"][resumed.state_key])
    assert resumed.watches["a"].ema == 2.0
    older = written.state_dict()  # (an older checkpoint's settings name none of the key's: said as it is moved)
    older["settings"] = {k: v for k, v in older["settings"].items() if k not in ("window", "tau_gap", "tau_slope")}
    checkpoint = {"callbacks": {written.state_key: older}}
    with pytest.warns(UserWarning, match=r"EarlyExit ran with other settings .*tau_gap.: 0.1.*now .*tau_gap.: 0.2.*: "
                                         r"every adapter's loss average and patience counters go on"):
        EarlyExit(tau_gap=0.2).adopt_checkpoint_state(checkpoint)
    checkpoint = {"callbacks": {written.state_key: written.state_dict()}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EarlyExit().adopt_checkpoint_state(checkpoint)  # the same settings: as it is, nothing to say
    assert list(checkpoint["callbacks"]) == [written.state_key]


def test_numpy_numbers_and_an_infinite_threshold_are_taken():
    import numpy as np

    rule = EarlyExit(window=np.int64(3), tau_gap=np.float32(0.25), tau_slope=math.inf)  # inf: never diverged
    assert (rule.window, rule.tau_gap, rule.tau_slope) == (3, 0.25, math.inf) and type(rule.window) is int


def test_a_callback_given_to_another_fit_starts_every_adapters_watch_afresh():
    """A sweep's second fit with the same EarlyExit names its adapters as the first did (trial-0, ...): their watches
    held the first fit's curves (a healthy adapter exited "diverged" at its second validation). Another stage (a
    validation run) keeps them; a resumed fit loads its checkpoint's after this."""
    from types import SimpleNamespace

    rule = EarlyExit(window=3)
    for step, (train, val) in enumerate([(3.0, 3.1), (2.0, 2.1), (1.0, 1.1)]):
        rule.observe_train_loss("a", train)
        rule.observe_validation("a", val, step)
    rule.exits.append({"adapter": "a", "state": "overfit", "step": 3, "reason": "..."})
    module = SimpleNamespace(registry=[])
    rule.setup(None, module, "validate")
    assert "a" in rule.watches and rule.exits
    rule.setup(None, module, "fit")
    assert rule.watches == {} and rule.exits == [] and module.keep_best_weights is True



def test_another_fit_of_the_module_with_other_settings_goes_on_under_them_and_says_so():
    """Another fit of a module stopped with adapters left takes the last fit's EarlyExit state, whatever its key: a
    changed `window`, `tau_gap` or `tau_slope` went on unsaid (another patience was said, as the checkpoint's)."""
    from types import SimpleNamespace

    last = EarlyExit()
    last.observe_train_loss("a", 2.0)
    module = SimpleNamespace(registry=[], carried_callback_state=lambda callback: last.state_dict())
    trainer = SimpleNamespace(limit_val_batches=1.0)
    with pytest.warns(UserWarning, match=r"the last fit's EarlyExit ran with window=2, tau_gap=0.1; now window=3, "
                                         r"tau_gap=0.5: every adapter's loss average and patience counters go on"):
        EarlyExit(window=3, tau_gap=0.5).setup(trainer, module, "fit")
    with pytest.warns(UserWarning, match=r"the last fit's EarlyExit ran with patience_ovf=2; now patience_ovf=5"):
        EarlyExit(patience_ovf=5).setup(trainer, module, "fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = EarlyExit()
        again.setup(trainer, module, "fit")
    assert again.watches["a"].ema == 2.0


def test_a_first_validation_that_overflows_is_no_new_best_and_counts_toward_overfitting():
    """Without the caller's view of a best, "below every validation seen" held vacuously for a first +inf: it was
    taken for a new best, and its gap never counted."""
    rule = EarlyExit(patience_ovf=1)
    rule.observe_train_loss("a", 2.0)
    assert rule.observe_validation("a", math.inf) == "overfit"


def test_a_skipped_step_after_a_resume_is_not_averaged_in_again():
    """The step whose training loss was last averaged was kept outside the callback's state: after a resume, a first
    step whose fp16 update overflowed and was skipped (its record's last loss the step before's) averaged that loss
    in a second time, where the run never stopped did not."""
    from types import SimpleNamespace as NS

    rec = NS(name="a", step=0, train_losses=[])
    module = NS(registry={"a": rec}, log_adapter_metrics=lambda metrics: None,
                carried_callback_state=lambda callback: None)
    trainer = NS(global_step=0, log_every_n_steps=50, limit_val_batches=1.0)
    batch = {"layout": NS(names=["a"])}

    def step(rule, loss=None):  # (None: a step skipped, the record as the module leaves it)
        if loss is not None:
            rec.step += 1
            rec.train_losses.append((rec.step, loss))
        trainer.global_step += 1
        rule.on_train_batch_end(trainer, module, None, batch, 0)

    unstopped = EarlyExit()
    unstopped.setup(trainer, module, "fit")
    for loss in (2.0, 3.0, 4.0):
        step(unstopped, loss)
    state = unstopped.state_dict()
    step(unstopped)
    resumed = EarlyExit()
    resumed.setup(trainer, module, "fit")
    resumed.load_state_dict(state)
    step(resumed)
    assert resumed.watches["a"].ema == unstopped.watches["a"].ema


def test_a_resume_with_other_settings_outside_the_state_key_is_said():
    """Only `window`, `tau_gap` and `tau_slope` (the state key's) were said changed on a resume: another patience or
    EMA factor went on unsaid, and could turn a divergence into an overfit exit."""
    state = EarlyExit().state_dict()
    with pytest.warns(UserWarning, match=r"the checkpoint's EarlyExit ran with ema_alpha=0.1, patience_div=2; now "
                                         r"ema_alpha=0.2, patience_div=5: every adapter's loss average"):
        EarlyExit(patience_div=5, ema_alpha=0.2).load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EarlyExit().load_state_dict(state)


def test_the_settings_warning_survives_a_resume_onto_another_number_of_ranks():
    """An adapter-parallel checkpoint's ranks are merged on a resume over another number of them: the settings were
    dropped there, and their change went unsaid."""
    merged = EarlyExit.merge_rank_states([EarlyExit().state_dict(), EarlyExit().state_dict()], {})
    with pytest.warns(UserWarning, match=r"ran with patience_div=2; now patience_div=5"):
        EarlyExit(patience_div=5).load_state_dict(merged)
