"""The adapter registry: every adapter of a run, its lifecycle state and its history."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from lightning_multilora.spec import AdapterSpec

# `AdapterSpec.hparams` entries the summary table shows where they differ between adapters, with their headers
_EXTRA_COLUMNS = {"dropout": "dropout", "weight_decay": "wd", "schedule": "schedule", "dataset": "dataset",
                  "objective": "objective", "dpo_beta": "beta", "use_rslora": "rslora", "warmup_steps": "warmup",
                  "grad_clip": "clip", "max_steps": "max_steps", "max_epochs": "epochs", "seed": "seed",
                  "target_modules": "targets", "init_from": "init_from"}


class AdapterState(str, enum.Enum):
    """Where an adapter stands in a run: waiting (queued), training (running), held aside (paused), or ended
    (`exited`: finished, diverged, overfit, pruned, failed; its weights exported, then freed)."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # holds its weights and optimizer state, not trained (e.g. waiting for warmup selection)
    FINISHED = "finished"
    DIVERGED = "diverged"
    OVERFIT = "overfit"
    PRUNED = "pruned"
    FAILED = "failed"

    @property
    def exited(self) -> bool:
        return self not in (AdapterState.QUEUED, AdapterState.RUNNING, AdapterState.PAUSED)


@dataclass
class AdapterRecord:
    """One adapter's run: spec, state (and why), progress and loss history."""

    spec: AdapterSpec
    state: AdapterState = AdapterState.QUEUED
    reason: str = ""
    step: int = 0
    max_steps: Optional[int] = None
    tokens_seen: int = 0
    samples_seen: int = 0
    best_val_loss: float = math.inf
    best_val_step: int = -1
    last_val_loss: float = math.nan
    last_val_preference_accuracy: float = math.nan
    """A DPO adapter's, at its last validation: the fraction of held-out pairs whose chosen answer it prefers more
    than the frozen base does (NaN for an SFT adapter)."""
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    export_path: Optional[str] = None
    started_at_step: Optional[int] = None
    ended_at_step: Optional[int] = None
    spans: list[list[Optional[int]]] = field(default_factory=list)
    """Global-step intervals ``[start, end)`` in which the adapter held a slot (end None while it does)."""
    exported_step: Optional[int] = None
    """The step whose weights its own export (``export_path``) holds: its best validation's, or its last step's."""
    exported_val_loss: float = math.nan
    """The validation loss of the weights its export holds (NaN: not measured at that step)."""
    best_val_preference_accuracy: float = math.nan
    """A DPO adapter's preference accuracy at its best validation (``best_val_step``)."""
    exported_val_preference_accuracy: float = math.nan
    """A DPO adapter's preference accuracy of the weights its export holds (NaN: not measured at that step)."""
    loss_scale: Optional[float] = None
    """fp16 with a loss scaler (``precision="16-mixed"``): the adapter's own factor (None otherwise)."""
    scale_growth: int = 0
    """Steps taken at ``loss_scale`` since it last changed (it grows after the scaler's ``growth_interval``)."""
    skipped_steps: int = 0
    """Steps whose scaled gradient overflowed: not taken (``loss_scale`` backed off)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "spec" and isinstance(value, AdapterSpec):  # (the record of how it trains: fixed, `hold`)
            value.hold()
        super().__setattr__(name, value)

    def __setstate__(self, state: dict[str, Any]) -> None:  # (a copied or unpickled record's spec is held too: the
        self.__dict__.update(state)  # spec's own copy is free)
        if isinstance(self.__dict__.get("spec"), AdapterSpec):
            self.spec.hold()

    def open_span(self, step: int) -> None:
        self.spans.append([step, None])

    def close_span(self, step: int) -> None:
        if self.spans and self.spans[-1][1] is None:
            self.spans[-1][1] = step

    @property
    def name(self) -> str:
        return self.spec.name

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(), "state": self.state.value, "reason": self.reason, "step": self.step,
            "max_steps": self.max_steps, "tokens_seen": self.tokens_seen, "samples_seen": self.samples_seen,
            "best_val_loss": self.best_val_loss, "best_val_step": self.best_val_step,
            "last_val_loss": self.last_val_loss, "last_val_preference_accuracy": self.last_val_preference_accuracy,
            "train_losses": list(self.train_losses),
            "val_losses": list(self.val_losses), "export_path": self.export_path,
            "started_at_step": self.started_at_step, "ended_at_step": self.ended_at_step,
            "spans": [list(x) for x in self.spans], "exported_step": self.exported_step,
            "exported_val_loss": self.exported_val_loss, "loss_scale": self.loss_scale,
            "best_val_preference_accuracy": self.best_val_preference_accuracy,
            "exported_val_preference_accuracy": self.exported_val_preference_accuracy,
            "scale_growth": self.scale_growth,
            "skipped_steps": self.skipped_steps,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "AdapterRecord":
        rec = cls(spec=AdapterSpec.from_dict(state["spec"]))
        rec.state = AdapterState(state["state"])
        for key in ("reason", "step", "max_steps", "tokens_seen", "samples_seen", "best_val_loss",
                    "best_val_step", "last_val_loss", "last_val_preference_accuracy", "export_path", "started_at_step",
                    "ended_at_step", "exported_step", "exported_val_loss", "loss_scale", "scale_growth",
                    "skipped_steps", "best_val_preference_accuracy", "exported_val_preference_accuracy"):
            if key in state:
                setattr(rec, key, state[key])
        rec.train_losses = [tuple(x) for x in state.get("train_losses", [])]
        rec.val_losses = [tuple(x) for x in state.get("val_losses", [])]
        rec.spans = [list(x) for x in state.get("spans", [])]
        return rec


def exported_loss(r: AdapterRecord, exported: str) -> float:
    """The validation loss of the weights adapter ``r``'s export holds: as measured at the step they are of (NaN
    where none was: weights exported after Ctrl+C or an error, between validations; an earlier step's loss is
    another weights'). An adapter not exported: ``exported``'s loss, the best or the last."""
    if r.exported_step is not None:
        if not math.isnan(r.exported_val_loss):  # (measured; inf where the measure was not finite)
            return r.exported_val_loss
        return next((v for s, v in reversed(r.val_losses) if s == r.exported_step), math.nan)
    loss = r.best_val_loss if exported == "best" else r.last_val_loss
    return math.nan if not r.val_losses and not math.isfinite(loss) else loss  # (never validated: no loss, not the
    # record's starting best of inf)


def exported_accuracy(r: AdapterRecord, exported: str) -> float:
    """A DPO adapter's preference accuracy of the weights `exported_loss` is of (NaN: an SFT adapter, or not
    measured there): its export's (as measured where it was exported, else its last or best validation's where that
    was at the exported step), else its best or last validation's."""
    if r.exported_step is not None:
        if not math.isnan(r.exported_val_preference_accuracy):
            return r.exported_val_preference_accuracy
        return _accuracy_at(r, r.exported_step)
    return _accuracy_at(r, r.best_val_step if exported == "best" else r.val_losses[-1][0] if r.val_losses else -1)


def _accuracy_at(r: AdapterRecord, step: int) -> float:
    """A DPO adapter's preference accuracy at the validation of ``step``, where its record holds it: the last
    validation's, or the best one's (a record of a checkpoint written before it kept that one: the last one's where
    the best was the last)."""
    if r.val_losses and r.val_losses[-1][0] == step:
        return r.last_val_preference_accuracy
    return r.best_val_preference_accuracy if r.best_val_step == step else math.nan


class AdapterRegistry:
    """Adapters by name, in the order they were added (the packing order of running adapters)."""

    def __init__(self) -> None:
        self._records: dict[str, AdapterRecord] = {}

    def add(self, spec: AdapterSpec) -> AdapterRecord:
        if spec.name in self._records:  # (refused before a record holds, and fixes, the caller's spec)
            return self.add_record(AdapterRecord(copy.deepcopy(spec)))
        return self.add_record(AdapterRecord(spec))

    def add_record(self, rec: AdapterRecord) -> AdapterRecord:
        """Add a record as it is (an adapter that ran elsewhere: a trial told before a resumed run, say)."""
        if rec.name in self._records:
            held = self._records[rec.name]
            raise ValueError(f"duplicate adapter name {rec.name!r}; adapter names must be unique (the module holds "
                             f"one so named, {held.state.value} at step {held.step}: from the adapters given, an "
                             "earlier add_adapter, or the checkpoint a run resumed from; `name in module.registry` "
                             "tells)")
        self._records[rec.name] = rec
        return rec

    def replace_record(self, rec: AdapterRecord) -> AdapterRecord:
        """Put ``rec`` in place of the record of its name (an adapter that ended elsewhere since: a trial told after
        the checkpoint a run resumed from), in its place in the order."""
        self[rec.name]  # (its KeyError, naming the adapters, where there is none)
        self._records[rec.name] = rec
        return rec

    def __getitem__(self, name: str) -> AdapterRecord:
        if name not in self._records:
            raise KeyError(f"no adapter {name!r}; adapters are: {list(self._records)}")
        return self._records[name]

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[AdapterRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def in_state(self, *states: AdapterState) -> list[AdapterRecord]:
        return [r for r in self._records.values() if r.state in states]

    @property
    def running(self) -> list[AdapterRecord]:
        return self.in_state(AdapterState.RUNNING)

    @property
    def queued(self) -> list[AdapterRecord]:
        return self.in_state(AdapterState.QUEUED)

    @property
    def paused(self) -> list[AdapterRecord]:
        return self.in_state(AdapterState.PAUSED)

    @property
    def holding_weights(self) -> list[AdapterRecord]:
        """Running and paused adapters: those with weights and optimizer state, in registry order."""
        return self.in_state(AdapterState.RUNNING, AdapterState.PAUSED)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in AdapterState}
        for r in self._records.values():
            out[r.state.value] += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"records": [r.state_dict() for r in self._records.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._records = {}
        for rs in state["records"]:
            rec = AdapterRecord.from_state_dict(rs)
            self._records[rec.name] = rec

    def summary_rows(self, exported: str = "best",
                     source_name: Optional[Callable[[Optional[str]], str]] = None) -> list[dict[str, Any]]:
        """One row per adapter, ranked by ``exported_val_loss``, the validation loss of the weights its export holds (as
        measured where it was exported, `AdapterRecord.exported_val_loss`; an adapter not exported: ``exported`` says
        which, "best", the best-validation weights, where the module keeps them, `keep_best_weights`; "last", the last
        ones, where it does not), lowest first, within each group of losses that compare (`_loss_group`: SFT's, then
        DPO's, per data source and DPO beta; a DPO row has the ``val_preference_accuracy`` of the weights its loss is
        of, `exported_accuracy`). Adapters whose
        exported weights were not measured (stopped between validations) follow, by their last validation loss, those
        never validated after them; last, those whose export measured non-finite (a failed adapter's last weights: no
        model to load; by its last finite validation before, it ranked first)."""
        if exported not in ("best", "last"):
            raise ValueError(f"`exported` can be 'best' or 'last', got {exported!r}")
        rows = []
        for r in self._records.values():
            best, last, measured = r.best_val_loss, r.last_val_loss, exported_loss(r, exported)
            if math.isfinite(measured) and r.exported_step == r.step and not (r.val_losses and r.val_losses[-1][0]
                                                                              == r.step):  # (its last weights,
                # measured as training stopped and not recorded: best and last count that measure too, which was
                # below the "best" beside it in the table)
                best, last = min(best, measured), measured
            row = {"adapter": r.name, **r.spec.hparams(), "status": r.state.value, "reason": r.reason,
                   "best_val_loss": best, "last_val_loss": last,
                   "exported_val_loss": measured, "exported_step": r.exported_step,
                   "steps": r.step, "export_path": r.export_path,
                   "val_preference_accuracy": exported_accuracy(r, exported)}
            rows.append(row)
        def rank(row: dict[str, Any]) -> tuple:
            measured, last = row["exported_val_loss"], row["last_val_loss"]
            if math.isfinite(measured):
                return (*_loss_group(row, source_name), 0, measured)
            if math.isinf(measured):  # (measured, not finite: NaN is "not measured")
                return (*_loss_group(row, source_name), 2, last if math.isfinite(last) else math.inf)
            return (*_loss_group(row, source_name), 1, last if math.isfinite(last) else math.inf)

        rows.sort(key=rank)  # (stable: ties keep the order the adapters were added in)
        return rows

    def summary_table(self, exported: str = "best",
                      source_name: Optional[Callable[[Optional[str]], str]] = None) -> str:
        """The ranked table (`summary_rows`; ``#`` counts within each group of losses that compare): learning rate,
        rank, alpha and batch size, then each other hyperparameter of `AdapterSpec.hparams` whose value differs between
        adapters (two that differ only in dropout are told apart), the status, the loss it is ranked by
        (``export_loss``: the validation loss of the weights the export holds, ``exported_val_loss``), the best
        validation loss, and where the exports hold the last weights the last one too; with DPO adapters, the
        preference accuracy of the weights ``export_loss`` is of (``pref_acc``)."""
        rows = self.summary_rows(exported, source_name)
        varying = [k for k in _EXTRA_COLUMNS if len({repr(r[k]) for r in rows}) > 1]
        losses = ["exported_val_loss", "best_val_loss"] + (["last_val_loss"] if exported == "last" else [])
        if any(r["objective"] == "dpo" for r in rows):  # (the share of held-out pairs preferred, by the exported)
            losses.append("val_preference_accuracy")
        names = {"val_preference_accuracy": "pref_acc", "exported_val_loss": "export_loss"}
        header = ["#", "adapter", "lr", "rank", "alpha", "bs", *(_EXTRA_COLUMNS[k] for k in varying), "status",
                  *(names.get(k, k) for k in losses), "steps"]
        groups = [_loss_group(r, source_name) for r in rows]  # (numbered within each group of losses that compare)
        places = [sum(1 for g in groups[:i] if g == groups[i]) + 1 for i in range(len(rows))]
        lr_digits = next((d for d in range(2, 8) if len({f"{r['lr']:.{d}g}" for r in rows})
                          == len({r["lr"] for r in rows})), 8)  # (as many as tell the rates apart: a sweep's are close)
        lines = [[str(places[i]), r["adapter"], f"{r['lr']:.{lr_digits}g}", str(r["rank"]), f"{r['alpha']:g}",
                  str(r["batch_size"]), *("-" if r[k] is None else f"{r[k]:g}" if isinstance(r[k], float)
                                          else str(r[k]) for k in varying), r["status"],
                  *(f"{r[k]:.4f}" if math.isfinite(r[k]) else "inf" if k == "exported_val_loss" and r[k] == math.inf
                    else "-" for k in losses), str(r["steps"])]  # (inf: an export measured as not finite)
                 for i, r in enumerate(rows)]
        widths = [max(len(h), *(len(line[j]) for line in lines)) if lines else len(h) for j, h in enumerate(header)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def _loss_group(row: Mapping[str, Any], source_name: Optional[Callable[[Optional[str]], str]] = None) -> tuple:
    """The adapters whose validation losses compare, ranked together: one objective (SFT before DPO), one data
    source (``source_name``: the name a `dataset` resolves to, the data module's `source_name`, so that None and
    the first source's name are one) and, for DPO, one beta (a larger beta makes the same preferences' loss smaller),
    as `WarmupSelection` groups them."""
    dataset = row.get("dataset")
    if source_name is not None:
        try:
            dataset = source_name(dataset)
        except (KeyError, ValueError):  # (a name the data module does not have: as it is)
            pass
    return ({"sft": 0, "dpo": 1}.get(row["objective"], 2), str(dataset or ""), row.get("dpo_beta") or 0.0)


def merge_by_owner(states: Sequence[Mapping[str, Any]], owners: Mapping[str, int]) -> dict[str, Any]:
    """The union of per-rank dicts keyed by adapter name (``states[r]``: rank r's), each key's value from its
    owner's dict (``owners``: adapter -> rank) where that holds it, else from the lowest rank that does: how the
    per-adapter parts of an adapter-parallel checkpoint's ranks are merged (`merge_rank_states`)."""
    merged: dict[str, Any] = {}
    for rank, state in enumerate(states):
        for key, value in state.items():
            if key not in merged or owners.get(key) == rank:
                merged[key] = value
    return merged
