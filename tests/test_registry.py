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
