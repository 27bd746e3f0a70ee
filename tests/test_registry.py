"""AdapterRegistry's summary: the ranked table a sweep prints."""

from __future__ import annotations

from lightning_multilora import AdapterSpec
from lightning_multilora.registry import AdapterRegistry


def test_the_summary_table_shows_the_hyperparameters_that_differ_between_adapters():
    """Two adapters that differ only in dropout are told apart; a hyperparameter all share gets no column."""
    registry = AdapterRegistry()
    for name, dropout in (("a", 0.0), ("b", 0.1)):
        registry.add(AdapterSpec(name, rank=4, lr=1e-3, dropout=dropout, weight_decay=0.01))
    registry["b"].best_val_loss = 1.5
    header, _, first, second = registry.summary_table().splitlines()
    assert header.split() == ["#", "adapter", "lr", "rank", "alpha", "bs", "dropout", "status", "export_loss",
                              "best_val_loss", "steps"]
    assert first.split()[:7] == ["1", "b", "0.001", "4", "16", "4", "0.1"]
    assert second.split()[6] == "0"
    registry.add(AdapterSpec("c", rank=4, lr=1e-3, dropout=0.1, weight_decay=0.01, lr_schedule="cosine",
                             dataset="gsm8k"))
    header = registry.summary_table().splitlines()[0].split()
    assert header[6:9] == ["dropout", "schedule", "dataset"] and "wd" not in header


def test_adapters_differing_in_targets_seed_or_budget_are_told_apart_in_the_table_and_the_rows():
    """A sweep over `target_modules`, `seed`, `grad_clip` or `warmup_steps` printed rows that looked alike (the values
    were in the names alone, and in no summary field)."""
    registry = AdapterRegistry()
    registry.add(AdapterSpec("a", target_modules=["q_proj", "v_proj"], seed=1, max_steps=10))
    registry.add(AdapterSpec("b", target_modules="all-linear", seed=2, max_steps=10, grad_clip=None))
    header = registry.summary_table().splitlines()[0].split()
    assert header[6:9] == ["clip", "seed", "targets"] and "max_steps" not in header
    lines = {line.split()[1]: line.split() for line in registry.summary_table().splitlines()[2:]}
    assert lines["a"][6:9] == ["1", "1", "q_proj,v_proj"] and lines["b"][6:9] == ["-", "2", "all-linear"]
    rows = {r["adapter"]: r for r in registry.summary_rows()}
    assert (rows["a"]["seed"], rows["a"]["target_modules"], rows["b"]["grad_clip"]) == (1, "q_proj,v_proj", None)
    assert rows["a"]["max_steps"] == 10 and rows["a"]["warmup_steps"] == 0 and rows["a"]["use_rslora"] is False


def test_the_summary_ranks_by_the_validation_loss_of_the_weights_exported():
    """Without best weights kept the exports hold the last weights: the ranking and the table follow them (an adapter
    best at one validation and worse since ranked first by its best loss beside an export that did not have it)."""
    import pytest

    registry = AdapterRegistry()
    for name, best, last in (("peaked", 1.0, 3.0), ("steady", 1.5, 1.6)):
        registry.add(AdapterSpec(name, rank=4))
        registry[name].best_val_loss, registry[name].last_val_loss = best, last
    assert [r["adapter"] for r in registry.summary_rows()] == ["peaked", "steady"]
    rows = registry.summary_rows("last")
    assert [r["adapter"] for r in rows] == ["steady", "peaked"]
    assert [(r["best_val_loss"], r["last_val_loss"], r["exported_val_loss"]) for r in rows] == [(1.5, 1.6, 1.6),
                                                                                                (1.0, 3.0, 3.0)]
    header, _, first, _ = registry.summary_table("last").splitlines()
    assert header.split()[-4:] == ["export_loss", "best_val_loss", "last_val_loss", "steps"]
    assert first.split()[1] == "steady" and first.split()[-4:-1] == ["1.6000", "1.5000", "1.6000"]
    with pytest.raises(ValueError, match="`exported` can be 'best' or 'last', got 'final'"):
        registry.summary_rows("final")


def test_a_failed_adapters_export_measured_not_finite_ranks_last():
    """A failed adapter's export (its last weights, measured not finite: no model to load) ranked by its last finite
    validation among the unmeasured exports: first in the table and the summary, above healthy adapters."""
    import math

    registry = AdapterRegistry()
    for name, exported, last in (("failed", math.inf, 1.0), ("unmeasured", math.nan, 2.0), ("fine", 3.0, 3.0)):
        registry.add(AdapterSpec(name, rank=4))
        rec = registry[name]
        rec.step, rec.exported_step, rec.exported_val_loss = 5, 5, exported
        rec.val_losses, rec.best_val_loss, rec.last_val_loss = [(2, last)], last, last
    assert [r["adapter"] for r in registry.summary_rows()] == ["fine", "unmeasured", "failed"]
    assert [line.split()[1] for line in registry.summary_table().splitlines()[2:5]] == ["fine", "unmeasured",
                                                                                         "failed"]


def test_sft_and_dpo_adapters_rank_apart_and_an_unmeasured_export_has_no_loss():
    """A DPO loss (log 2 at the start) ranked above every SFT one in one list, with no column telling them or their
    betas apart. An export whose weights were not measured at their step (Ctrl+C between validations) reported an
    earlier step's loss as its weights': it has the loss its history holds at that step, else none (NaN, ranked
    after the measured ones)."""
    import math

    registry = AdapterRegistry()
    registry.add(AdapterSpec("sft", rank=4))
    registry.add(AdapterSpec("dpo-a", rank=4, objective="dpo", dpo_beta=0.1))
    registry.add(AdapterSpec("dpo-b", rank=4, objective="dpo", dpo_beta=2.0))
    for name, loss, accuracy in (("sft", 3.0, math.nan), ("dpo-a", 0.6, 0.7), ("dpo-b", 0.01, 0.65)):
        rec = registry[name]
        rec.best_val_loss = rec.last_val_loss = loss
        rec.last_val_preference_accuracy = accuracy
        rec.best_val_step = 4
        rec.exported_step, rec.exported_val_loss = 6, math.nan  # (last weights, not measured as they were exported)
        rec.val_losses = [(4, loss), (6, loss)] if name != "dpo-b" else [(4, loss)]
    rows = registry.summary_rows("last")
    assert [r["adapter"] for r in rows] == ["sft", "dpo-a", "dpo-b"]
    assert [r["exported_val_loss"] for r in rows][:2] == [3.0, 0.6] and math.isnan(rows[2]["exported_val_loss"])
    registry["dpo-b"].val_losses.append((6, 0.01))
    rows = registry.summary_rows("last")  # (DPO losses of two betas do not compare: each beta ranked apart, the
    assert [r["adapter"] for r in rows] == ["sft", "dpo-a", "dpo-b"]  # larger's 0.01 ranked above the smaller's 0.6)
    assert [r["dpo_beta"] for r in rows] == [None, 0.1, 2.0] and rows[1]["val_preference_accuracy"] == 0.7
    assert [line.split()[:2] for line in registry.summary_table("last").splitlines()[2:]] == [
        ["1", "sft"], ["1", "dpo-a"], ["1", "dpo-b"]]  # (numbered within each group)
    registry["sft"].exported_val_loss = math.inf  # (measured at its step, and not finite: not the older loss)
    assert registry.summary_rows("last")[0]["exported_val_loss"] == math.inf
    registry["sft"].exported_val_loss = math.nan
    header, _, first, second, third = registry.summary_table("last").splitlines()
    assert header.split()[6:8] == ["objective", "beta"] and header.split()[-2] == "pref_acc"
    assert first.split()[6:8] == ["sft", "-"] and second.split()[6:8] == ["dpo", "0.1"]
    assert first.split()[-2] == "-" and second.split()[-2] == "0.7000" and third.split()[-2] == "0.6500"


def test_a_record_of_an_older_checkpoint_keeps_its_dpo_accuracy_where_its_best_validation_was_the_last():
    """(A record saved before the best validation's accuracy was kept showed none in the summary, though the last
    validation, its best, held it.)"""
    import math

    registry = AdapterRegistry()
    rec = registry.add(AdapterSpec("d", rank=4, objective="dpo"))
    state = dict(rec.state_dict(), val_losses=[(4, 0.7), (8, 0.5)], best_val_loss=0.5, best_val_step=8,
                 last_val_loss=0.5, last_val_preference_accuracy=0.75)
    for key in ("best_val_preference_accuracy", "exported_val_preference_accuracy"):
        del state[key]  # (as a checkpoint of before them holds it)
    registry.load_state_dict({"records": [state]})
    assert registry.summary_rows("best")[0]["val_preference_accuracy"] == 0.75
    registry["d"].exported_step = 8  # (exported at its best, not measured then: its history says)
    assert registry.summary_rows("best")[0]["val_preference_accuracy"] == 0.75
    registry["d"].exported_step = 4  # (an earlier validation's accuracy is not kept)
    assert math.isnan(registry.summary_rows("best")[0]["val_preference_accuracy"])


def test_exports_never_validated_follow_by_their_last_loss_and_a_diverged_one_says_inf():
    """Stopped between validations (SIGTERM, Ctrl+C), no export's weights were measured: the rows are ranked by their
    last validation loss, not left in the order they were added, and the table says '-' for the export's loss; an
    export measured as not finite says inf, and comes last."""
    import math

    registry = AdapterRegistry()
    for name, last in (("a", 5.0), ("never", math.nan), ("b", 2.7)):
        registry.add(AdapterSpec(name, rank=4))
        rec = registry[name]
        rec.best_val_loss = rec.last_val_loss = last
        rec.exported_step, rec.exported_val_loss = 9, math.nan
        rec.val_losses = [(5, last)] if math.isfinite(last) else []
    assert [r["adapter"] for r in registry.summary_rows("last")] == ["b", "a", "never"]
    _, _, first, second, third = registry.summary_table("last").splitlines()
    assert first.split()[1] == "b" and first.split()[-4:-1] == ["-", "2.7000", "2.7000"]
    assert third.split()[1] == "never" and third.split()[-4:-1] == ["-", "-", "-"]
    registry["never"].best_val_loss = math.inf  # (a record's own, before any validation: no loss, not inf)
    assert registry.summary_table("last").splitlines()[4].split()[-4:-1] == ["-", "-", "-"]
    registry["a"].exported_val_loss = math.inf  # (measured at its step: diverged, last: no model to load)
    rows = registry.summary_rows("last")
    assert [r["adapter"] for r in rows] == ["b", "never", "a"] and rows[2]["exported_val_loss"] == math.inf
    assert registry.summary_table("last").splitlines()[4].split()[-4] == "inf"
    registry.add(AdapterSpec("queued", rank=4))  # (not exported, never validated: in "best" mode too)
    assert math.isnan(registry.summary_rows("best")[-2]["exported_val_loss"])  # (before the diverged one)
    queued = next(line for line in registry.summary_table("best").splitlines()[2:] if line.split()[1] == "queued")
    assert queued.split()[-3:-1] == ["-", "-"]


def test_adapters_of_one_source_rank_together_whether_named_or_not():
    """An adapter on the default source (`dataset` None) and one naming it were ranked in two groups, each numbered
    from 1: the report resolves the names as `WarmupSelection` does (the data module's `source_name`)."""
    registry = AdapterRegistry()
    for name, dataset, loss in (("a", None, 3.0), ("b", "math", 1.0), ("c", None, 2.0), ("d", "other", 0.5)):
        registry.add(AdapterSpec(name, rank=4, dataset=dataset))
        rec = registry[name]
        rec.best_val_loss = rec.last_val_loss = rec.exported_val_loss = loss
    resolve = lambda d: "math" if d is None else d  # noqa: E731
    assert [r["adapter"] for r in registry.summary_rows("last", resolve)] == ["b", "c", "a", "d"]
    places = [line.split()[:2] for line in registry.summary_table("last", resolve).splitlines()[2:]]
    assert places == [["1", "b"], ["2", "c"], ["3", "a"], ["1", "d"]]
    assert [r["adapter"] for r in registry.summary_rows("last")] == ["c", "a", "b", "d"]  # (unresolved: apart)


def test_learning_rates_that_differ_are_told_apart_in_the_table():
    """Two significant digits printed an Optuna sweep's log-uniform rates 0.026681 and 0.027440 both as 0.027."""
    registry = AdapterRegistry()
    for name, lr in (("a", 0.026681), ("b", 0.027440), ("c", 0.1)):
        registry.add(AdapterSpec(name, lr=lr))
    assert sorted(line.split()[2] for line in registry.summary_table().splitlines()[2:]) == ["0.0267", "0.0274", "0.1"]
    registry = AdapterRegistry()
    for name, lr in (("a", 1e-3), ("b", 2e-3)):
        registry.add(AdapterSpec(name, lr=lr))
    assert sorted(line.split()[2] for line in registry.summary_table().splitlines()[2:]) == ["0.001", "0.002"]


def test_last_weights_measured_as_training_stopped_count_in_the_best_and_last_columns():
    """After a ``max_steps`` stop the export holds the last weights, measured then (not recorded in the history): the
    table showed that measure as export_loss beside a higher "best" (1.8843 beside 1.9536)."""
    registry = AdapterRegistry()
    for name in ("stopped", "validated"):
        registry.add(AdapterSpec(name, rank=4))
        rec = registry[name]
        rec.step, rec.val_losses = 30, [(20, 1.9536)]
        rec.best_val_loss, rec.best_val_step, rec.last_val_loss = 1.9536, 20, 1.9536
        rec.exported_step, rec.exported_val_loss = 30, 1.8843
    registry["validated"].val_losses.append((30, 1.8843))  # (a recorded validation at its last step: as it is)
    registry["validated"].best_val_loss = registry["validated"].last_val_loss = 1.8843
    rows = {r["adapter"]: r for r in registry.summary_rows("last")}
    assert [(rows[n]["exported_val_loss"], rows[n]["best_val_loss"], rows[n]["last_val_loss"])
            for n in ("stopped", "validated")] == [(1.8843, 1.8843, 1.8843)] * 2
    assert registry["stopped"].best_val_loss == 1.9536  # (the history a resumed run goes on from: unchanged)
    registry["stopped"].exported_val_loss = 2.5  # (worse than its best validation: the best stays the best)
    assert {r["adapter"]: r["best_val_loss"] for r in registry.summary_rows("last")}["stopped"] == 1.9536
