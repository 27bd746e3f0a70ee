"""`EarlyExit`: ALTO's per-adapter divergence and overfitting detectors (Algorithm 1)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_multilora.arguments import check_bool, check_int, check_real
from lightning_multilora.registry import AdapterState, merge_by_owner


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (per evaluation); +inf where the last is +inf (a
    validation loss that overflowed: the steepest rise); where an earlier one is and the last is not, the slope of
    the finite ones (at their indices), or -inf where the last is the only one (the loss came back from an overflow:
    a fall, which counted as a rise, a recovered adapter diverging)."""
    if len(values) < 2:
        return 0.0
    if math.isinf(values[-1]):
        return math.inf
    points = [(i, v) for i, v in enumerate(values) if not math.isinf(v)]
    if len(points) < 2:
        return -math.inf
    n = len(points)
    mean_x, mean_y = sum(i for i, _ in points) / n, sum(v for _, v in points) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in points)
    den = sum((i - mean_x) ** 2 for i, _ in points)
    return num / den


@dataclass
class AdapterWatch:
    """What EarlyExit remembers about one adapter."""

    ema: float = math.nan
    ema_at_eval: list[float] = field(default_factory=list)
    val_at_eval: list[float] = field(default_factory=list)
    evaluated_steps: list[int] = field(default_factory=list)
    divergence_count: int = 0
    overfit_count: int = 0
    # the adapter step of the training loss last averaged (an fp16 step that overflowed and was skipped leaves its last
    # loss in place: not averaged again, after a resume too)
    averaged_step: int = -1


class EarlyExit(Callback):
    """Stops adapters that diverge or overfit, each on its own curves, never its neighbours.

    The training loss is smoothed per adapter, ``ema_t = alpha * l_t + (1 - alpha) * ema_{t-1}``; at every
    validation of an adapter:

    - *divergence*: the least-squares slopes (per evaluation) of the last ``window`` smoothed training
      losses and of the last ``window`` validation losses both exceed ``tau_slope`` for ``patience_div``
      consecutive evaluations: the adapter exits as ``diverged``. The count resets when either slope
      drops to ``tau_slope`` or below.
    - *overfitting*: ``g = (val - ema_train) / ema_train > tau_gap`` for ``patience_ovf`` consecutive
      evaluations whose validation loss is not a new best: the adapter's best-validation weights are exported
      (``keep_best_weights``; otherwise its last ones), and it exits as ``overfit``. An evaluation at a new best
      resets the count: a validation loss that still falls is not overfitting, whatever the gap (early in the first
      epoch a gap comes from which examples the smoothed training loss happened to see).
      ``overfit_while_improving=True`` counts those evaluations too, ALTO's rule as written.

    With ``keep_best_weights`` (the default) every adapter keeps its best-validation weights; they are what is
    exported when it leaves (finished included). The rules judge at validations: with none
    (``Trainer(limit_val_batches=0)``) they stop nothing, which is warned of. Defaults are ALTO's: window 2,
    patience 2, tau_gap 0.1, tau_slope 0.001; the paper gives no EMA factor, ``ema_alpha=0.1`` is ours. Slopes are
    per evaluation (the paper does not say per step or per evaluation: ``tau_slope`` reads per evaluation here).
    """

    carries_state = True  # (its state goes on into another fit of the module: `carried_callback_state`)

    def __init__(self, ema_alpha: float = 0.1, window: int = 2, patience_div: int = 2, patience_ovf: int = 2,
                 tau_gap: float = 0.1, tau_slope: float = 0.001, keep_best_weights: bool = True,
                 overfit_while_improving: bool = False) -> None:
        check_real("EarlyExit", "ema_alpha", ema_alpha, lambda v: 0 < v <= 1, "a number in (0, 1]")
        check_int("EarlyExit", "window", window, 2)  # (a slope needs two points)
        check_int("EarlyExit", "patience_div", patience_div, 1)
        check_int("EarlyExit", "patience_ovf", patience_ovf, 1)
        # (inf: the rule off)
        check_real("EarlyExit", "tau_gap", tau_gap, lambda v: v >= 0, "a number >= 0 (inf: never)", infinite=True)
        check_real("EarlyExit", "tau_slope", tau_slope, lambda v: v >= 0, "a number >= 0 (inf: never)", infinite=True)
        check_bool("EarlyExit", "keep_best_weights", keep_best_weights)
        check_bool("EarlyExit", "overfit_while_improving", overfit_while_improving)
        self.ema_alpha, self.window = float(ema_alpha), int(window)
        self.patience_div, self.patience_ovf = int(patience_div), int(patience_ovf)
        self.tau_gap, self.tau_slope = float(tau_gap), float(tau_slope)
        self.keep_best_weights = keep_best_weights
        self.overfit_while_improving = overfit_while_improving
        self.watches: dict[str, AdapterWatch] = {}
        self.exits: list[dict[str, Any]] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(window=self.window, tau_gap=self.tau_gap, tau_slope=self.tau_slope)

    # -- the rule, on plain numbers (unit-testable without a Trainer) --------------------------------

    def observe_train_loss(self, name: str, loss: float) -> float:
        watch = self.watches.setdefault(name, AdapterWatch())
        if math.isfinite(loss):
            watch.ema = loss if math.isnan(watch.ema) else self.ema_alpha * loss + (1 - self.ema_alpha) * watch.ema
        return watch.ema

    def observe_validation(self, name: str, val_loss: float, step: int = -1,
                           new_best: Optional[bool] = None) -> str | None:
        """Record one validation; returns ``"diverged"``, ``"overfit"`` or None (keep training). ``new_best``:
        whether it is the adapter's best validation so far (default: below every validation seen here; the
        callback passes the adapter record's own view, which also counts validations made outside the loop)."""
        watch = self.watches.setdefault(name, AdapterWatch())
        if math.isnan(watch.ema) or math.isnan(val_loss):  # (NaN: no validation tokens measured it)
            return None
        # (+inf, predictions that overflow on held-out data, is a rise past any slope and any gap: it was skipped, and
        # such an adapter never diverged)
        improving = (math.isfinite(val_loss) and all(val_loss < v for v in watch.val_at_eval)) if new_best is None \
            else new_best  # (+inf is never a best: it was taken for one at a first validation)
        watch.ema_at_eval.append(watch.ema)
        watch.val_at_eval.append(val_loss)
        watch.evaluated_steps.append(step)
        if len(watch.val_at_eval) >= self.window:
            s_train = slope(watch.ema_at_eval[-self.window:])
            s_val = slope(watch.val_at_eval[-self.window:])
            watch.divergence_count = watch.divergence_count + 1 if (s_train > self.tau_slope and s_val > self.tau_slope) else 0
        gap = (val_loss - watch.ema) / watch.ema if watch.ema > 0 else 0.0
        counts = gap > self.tau_gap and (self.overfit_while_improving or not improving)
        watch.overfit_count = watch.overfit_count + 1 if counts else 0
        if watch.divergence_count >= self.patience_div:
            return "diverged"
        if watch.overfit_count >= self.patience_ovf:
            return "overfit"
        return None

    # -- Lightning hooks ------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "registry"):
            raise TypeError("EarlyExit needs a MultiLoRAMixin module")
        pl_module.keep_best_weights = self.keep_best_weights
        pl_module._best_kept_by_callback = True  # (a later fit without an EarlyExit turns it off again)
        if stage == "fit" and trainer is not None and trainer.limit_val_batches == 0:
            rank_zero_warn("EarlyExit judges each adapter at its validations, and `Trainer(limit_val_batches=0)` runs "
                           "none: it stops no adapter (validate every few steps, e.g. val_check_interval=50 with "
                           "check_val_every_n_epoch=None, and cap each split with "
                           "`MultiLoRADataModule(max_val_examples=...)`)")
        if stage == "fit":  # a callback object given to another fit judges its adapters afresh (a sweep's adapters of
            # the same names, trial-0..., met the last fit's curves); a resumed fit's state is loaded after this, and
            # another fit of a module stopped with adapters left goes on with its last (`carried_callback_state`)
            self.watches, self.exits = {}, []
            carried = getattr(pl_module, "carried_callback_state", lambda callback: None)(self)
            if carried is not None:
                self._load(carried, "the last fit's")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        logs = {}
        for name in batch["layout"].names:
            rec = pl_module.registry[name]
            watch = self.watches.setdefault(name, AdapterWatch())
            # (an adapter that stepped: not one whose fp16 step overflowed and was skipped, its last loss again)
            if rec.train_losses and rec.train_losses[-1][0] == rec.step and watch.averaged_step != rec.step:
                watch.averaged_step = rec.step
                logs[f"adapters/{name}/train_loss_ema"] = self.observe_train_loss(name, rec.train_losses[-1][1])
        if logs and trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            # (through the module: under adapter parallelism rank 0 writes every rank's adapters')
            # (at the step Lightning writes the losses they smooth at: the module's `_logged_step`)
            pl_module.log_adapter_metrics({k: v for k, v in logs.items() if math.isfinite(v)})

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for rec in list(pl_module.registry.running):
            watch = self.watches.get(rec.name)
            if not rec.val_losses or watch is None or not pl_module._owns(rec.name):
                continue  # (a curve of another rank's adapter, from a run of another size resumed here: its owner's)
            step, val = rec.val_losses[-1]
            if watch.evaluated_steps and watch.evaluated_steps[-1] == step:
                continue  # no new validation of this adapter
            decision = self.observe_validation(rec.name, val, step, new_best=rec.best_val_step == step)
            if decision == "diverged":
                reason = (f"training and validation losses rising for {watch.divergence_count} evaluations "
                          f"(slopes over {self.window} points > {self.tau_slope})")
                pl_module.remove_adapter(rec.name, reason=reason, state=AdapterState.DIVERGED)
            elif decision == "overfit":
                gap = (val - watch.ema) / watch.ema
                kept = (f"best weights (step {rec.best_val_step}) kept" if pl_module.keep_best_weights
                        and rec.name in getattr(pl_module, "_best_weights", {}) else
                        "its last weights exported (no validation loss of it was finite)" if rec.best_val_step == -1
                        else f"its last weights exported (best validation at step {rec.best_val_step}, not kept)")
                reason = (f"validation {val:.4f} above smoothed training {watch.ema:.4f} by {gap:.1%} for "
                          f"{watch.overfit_count} evaluations; {kept}")
                pl_module.remove_adapter(rec.name, reason=reason, state=AdapterState.OVERFIT)
            if decision is not None:
                self.exits.append({"adapter": rec.name, "state": decision, "step": rec.step, "reason": reason})
        # Under adapter parallelism each rank decides for the adapters it trains (only those have training
        # curves here); the exits reach the other ranks now, before a checkpoint is written.
        sync = getattr(pl_module, "_sync_ranks", None)
        if sync is not None:
            sync()

    def _settings(self) -> dict[str, Any]:
        """The settings the rule decides with (those of its `state_key` too: another fit of the module takes its
        last state whatever its key, `carried_callback_state`)."""
        return {"window": self.window, "tau_gap": self.tau_gap, "tau_slope": self.tau_slope,
                "ema_alpha": self.ema_alpha, "patience_div": self.patience_div, "patience_ovf": self.patience_ovf,
                "keep_best_weights": self.keep_best_weights, "overfit_while_improving": self.overfit_while_improving}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"watches": {n: asdict(w) for n, w in self.watches.items()}, "exits": list(self.exits),
                "settings": self._settings()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load(state_dict, "the checkpoint's")

    def _load(self, state_dict: dict[str, Any], source: str) -> None:
        """Takes a state, of ``source`` ("the checkpoint's", "the last fit's"), saying which settings changed."""
        self.watches = {n: AdapterWatch(**w) for n, w in state_dict.get("watches", {}).items()}
        self.exits = list(state_dict.get("exits", []))
        saved, now = state_dict.get("settings") or {}, self._settings()
        changed = [k for k in now if k in saved and saved[k] != now[k]]
        if changed:  # (they went on under the new ones unsaid, which could turn an exit into another)
            rank_zero_warn(f"{source} EarlyExit ran with " + ", ".join(f"{k}={saved[k]!r}" for k in changed)
                           + "; now " + ", ".join(f"{k}={now[k]!r}" for k in changed) + ": every adapter's loss "
                           "average and patience counters go on under the new ones")

    @staticmethod
    def merge_rank_states(states: list[dict[str, Any]], owners: dict[str, int]) -> dict[str, Any]:
        """One state from an adapter-parallel checkpoint's ranks (a run resumed on another number of them): each
        rank watched the adapters it trained, and listed its own exits (those, by step)."""
        exits = list({repr(e): e for s in states for e in s.get("exits", [])}.values())
        return {"watches": merge_by_owner([s.get("watches", {}) for s in states], owners),
                "exits": sorted(exits, key=lambda e: e.get("step", 0)),
                **({"settings": states[0]["settings"]} if states and states[0].get("settings") else {})}

    def adopt_checkpoint_state(self, checkpoint: dict[str, Any]) -> None:
        """Lightning restores a callback's state by its `state_key`, which holds the rule's settings: one written
        with other settings was not restored, and every adapter's loss average and patience counters started over
        (under Lightning's "Please add the following callbacks"). The module calls this as it loads a checkpoint,
        before Lightning matches the callbacks' states: such a state is taken under this callback's key, and the
        change said (by `load_state_dict`; here, for an older checkpoint whose settings do not name those of the
        key)."""
        states = checkpoint.get("callbacks", {})
        others = [k for k in states if isinstance(k, str) and k.startswith("EarlyExit") and k != self.state_key]
        if len(others) == 1 and self.state_key not in states:
            states[self.state_key] = states.pop(others[0])
            if "window" in ((states[self.state_key] or {}).get("settings") or {}):
                return
            rank_zero_warn(f"the checkpoint's EarlyExit ran with other settings ({others[0]}; now {self.state_key}): "
                           "every adapter's loss average and patience counters go on under the new ones")
