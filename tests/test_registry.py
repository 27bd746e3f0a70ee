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
    assert header.split() == ["#", "adapter", "lr", "rank", "alpha", "bs", "dropout", "status", "best_val_loss",
                              "steps"]
    assert first.split()[:7] == ["1", "b", "0.001", "4", "16", "4", "0.1"]
    assert second.split()[6] == "0"
    registry.add(AdapterSpec("c", rank=4, lr=1e-3, dropout=0.1, weight_decay=0.01, lr_schedule="cosine",
                             dataset="gsm8k"))
    header = registry.summary_table().splitlines()[0].split()
    assert header[6:9] == ["dropout", "schedule", "dataset"] and "wd" not in header


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
    assert header.split()[-3:] == ["best_val_loss", "last_val_loss", "steps"]
    assert first.split()[1] == "steady" and first.split()[-3:-1] == ["1.5000", "1.6000"]
    with pytest.raises(ValueError, match="`exported` can be 'best' or 'last', got 'final'"):
        registry.summary_rows("final")
