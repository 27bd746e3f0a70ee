"""`WarmupSelection`: every candidate gets a short warmup; only the best fraction trains on."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_multilora.arguments import check_int, check_real
from lightning_multilora.registry import AdapterRegistry, AdapterState
from lightning_multilora.strategies.adapter_parallel import decide_once


class WarmupSelection(Callback):
    """ALTO's warmup selection over all K candidates, even when only M fit at once.

    Each adapter's warmup is ``warmup_fraction`` of its own total steps (at least one). An adapter that
    completes its warmup is validated and paused: it keeps its weights and optimizer state but frees its
    slot, so queued candidates rotate in and every candidate gets the same warmup. When no candidate is
    left warming up (or queued), the warmed-up ones are ranked by their warmup validation loss; the top
    ``keep_fraction`` of the candidates (at least ``min_keep``; of each objective, data source and DPO beta apart,
    where they differ: their losses do not compare) resume from where they stopped, best first, as slots
    free (the module's `max_running` and ``admission`` hold for them as for its queue: kept adapters beyond them wait,
    paused, in `waiting`), the rest are pruned (exported, then their weights and optimizer states freed).
    Candidates that exit during warmup (diverged, failed) count among the K but cannot be kept. While a callback such
    as `OptunaSweep` still has candidates to ask (``has_pending_candidates()``), the ranking waits for them.

    Under `AdapterParallelStrategy` the ranks first share their adapters' progress, then rank 0 decides which
    adapters have warmed up and, later, which are kept; every rank applies its decisions. All ranks validate
    the warmed-up adapters together (each its own), and the owners' results reach every registry before the
    ranking; a pruned adapter is exported and freed by the rank that trains it.
    """

    carries_state = True  # (its state goes on into another fit of the module: `carried_callback_state`)

    def __init__(self, warmup_fraction: float = 0.05, keep_fraction: float = 0.25, min_keep: int = 1) -> None:
        check_real("WarmupSelection", "warmup_fraction", warmup_fraction, lambda v: 0 < v < 1, "a number in (0, 1)")
        check_real("WarmupSelection", "keep_fraction", keep_fraction, lambda v: 0 < v <= 1, "a number in (0, 1]")
        check_int("WarmupSelection", "min_keep", min_keep, 1)
        self.warmup_fraction, self.keep_fraction = float(warmup_fraction), float(keep_fraction)
        self.min_keep = int(min_keep)
        self.warmup_losses: dict[str, float] = {}
        self.candidates: list[str] = []
        self.kept: list[str] = []
        self.waiting: list[str] = []  # kept adapters to resume as slots free, best first
        self.decided = False

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "registry"):  # (as EarlyExit's and OptunaSweep's: an AttributeError at the start)
            raise TypeError("WarmupSelection needs a MultiLoRAMixin module")
        if stage == "fit":  # another fit selects afresh (a resumed one's state is loaded after this), but one of a
            # module stopped with adapters left goes on with its last selection (`carried_callback_state`)
            self.warmup_losses, self.candidates, self.kept, self.waiting, self.decided = {}, [], [], [], False
            carried = getattr(pl_module, "carried_callback_state", lambda callback: None)(self)
            if carried is not None:
                self._load(carried, "the last fit's")

    def warmup_steps(self, max_steps: int) -> int:
        """``warmup_fraction`` of ``max_steps``, rounded half up (Python's ``round`` took 2.5 to 2 and 3.5 to 4:
        adapters of other lengths warmed up for unequal shares), at least 1, and short of ``max_steps`` where that
        is 2 or more (a warmup of the whole run, 0.95 of 10 steps rounded up, ended as the adapter finished: none was
        ranked, kept or pruned)."""
        steps = max(1, math.floor(round(self.warmup_fraction * max_steps, 9) + 0.5))
        return min(steps, max_steps - 1) if max_steps > 1 else steps

    def select(self, warmup_losses: dict[str, float], num_candidates: int) -> list[str]:
        """Names to keep: the lowest warmup losses, ``max(min_keep, ceil(keep_fraction * K))`` of them."""
        # (rounded first: 0.07 x 100 is 7.000000000000001 in floats, which ceil made 8)
        keep = max(self.min_keep, math.ceil(round(self.keep_fraction * num_candidates, 9)))
        # (a tie in the order the candidates warmed up, not by name: "trial-10" came before "trial-2")
        finite = sorted((loss, i, name) for i, (name, loss) in enumerate(warmup_losses.items()) if math.isfinite(loss))
        if keep < len(finite) and finite[keep - 1][0] == finite[keep][0]:
            tied = [name for loss, _, name in finite if loss == finite[keep][0]]
            rank_zero_warn(f"WarmupSelection: candidates {tied} tied at warmup loss {finite[keep][0]:.6g} for the last "
                          f"places kept: kept in the order they warmed up. A warmup too short to change an adapter "
                          "(one step at a learning-rate warmup's first rate, 0, leaves it the base model) tells none "
                          "apart: raise `warmup_fraction`, or the adapters' `max_steps`")
        return [name for _, _, name in finite[:keep]]

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # (a fit resumed from a checkpoint written as warmed-up adapters were validated, before they paused: they
        # pause now, at the step they warmed up at, as in the run that was not stopped; not after one step more)
        self._settle(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._settle(trainer, pl_module)

    def _settle(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The step's decisions: new candidates, the warmed-up adapters validated and paused, the selection where it
        is due."""
        if self.decided:
            self._tell_late(pl_module)
            return
        _sync(pl_module)  # under adapter parallelism: every adapter's step and state, current on every rank
        warmup = decide_once(pl_module, lambda: self._warmed_up(pl_module.registry))
        self.candidates += warmup["candidates"]
        if warmup["warmed"]:
            self._validate_and_pause(pl_module, warmup["warmed"])
        selection = decide_once(pl_module, lambda: self._selection(trainer, pl_module.registry))
        if selection is not None:
            self._apply(pl_module, selection)  # (the owners' prunes reach every rank there, before a checkpoint)

    def _tell_late(self, pl_module: L.LightningModule) -> None:
        """Adapters that started after the selection (added mid-run, or given to a resume after it): said once,
        they train without a warmup ranking."""
        late = [rec.name for rec in pl_module.registry
                if rec.name not in self.candidates and rec.state != AdapterState.QUEUED]
        if late:
            self.candidates += late  # (said once)
            rank_zero_warn(f"WarmupSelection: adapters {late} started after its selection was made: they train "
                           "without a warmup ranking (the selection ranks the candidates of a fit once; add "
                           "candidates before it, or fit them in a new run with their own WarmupSelection)")

    def _warmed_up(self, registry: AdapterRegistry) -> dict[str, list[str]]:
        """The decision of this step: new candidates (adapters that left the queue) and the adapters whose
        warmup just ended."""
        candidates = [rec.name for rec in registry
                      if rec.name not in self.candidates and rec.state != AdapterState.QUEUED]
        single = [n for n in candidates if registry[n].max_steps == 1]
        if single:
            rank_zero_warn(f"WarmupSelection: adapters {single} train for one step: their warmup cannot end before "
                           "they finish, so they finish unranked (neither kept nor pruned; give them more steps)")
        warmed = [rec.name for rec in registry.running
                  if rec.name not in self.warmup_losses and rec.step >= self.warmup_steps(rec.max_steps)]
        return {"candidates": candidates, "warmed": warmed}

    def _validate_and_pause(self, pl_module: L.LightningModule, names: list[str]) -> None:
        """Validate the warmed-up adapters (under adapter parallelism all ranks at once, each its own; the
        owners' losses then reach every registry) and pause them until the selection."""
        registry = pl_module.registry
        pl_module.evaluate([registry[n].spec for n in names], record=True)
        _sync(pl_module)
        for name in names:
            rec = registry[name]
            self.warmup_losses[name] = rec.last_val_loss
            pl_module.pause_adapter(name, reason=f"warmed up ({rec.step} steps), waiting for selection")

    def _selection(self, trainer: L.Trainer, registry: AdapterRegistry) -> Optional[dict[str, Any]]:
        """None while candidates are still warming up, queued or to come; else the ranking's decision: the
        names to keep, and the others with why they are pruned."""
        still_warming = [r for r in registry.running if r.name not in self.warmup_losses]
        more_coming = any(getattr(cb, "has_pending_candidates", lambda: False)() for cb in trainer.callbacks)
        if still_warming or registry.queued or more_coming:
            return None
        waiting = {r.name: self.warmup_losses[r.name] for r in registry.paused if r.name in self.warmup_losses}
        # Losses compare within one objective on one data source (a DPO loss starts at log 2, an SFT one far above):
        # each such group keeps its own top fraction
        # (and, for DPO, one beta: a larger one makes the same preferences' loss smaller)
        source = getattr(getattr(trainer, "datamodule", None), "source_name", lambda d: d)
        groups: dict[tuple, list[str]] = {}
        for name in self.candidates:
            spec = registry[name].spec if name in registry else None
            try:
                data = source(spec.dataset) if spec is not None else None
            except (KeyError, ValueError):  # (a candidate that failed as it started: its source is no source)
                data = spec.dataset
            key = ((spec.objective, data, spec.dpo_beta if spec.objective == "dpo" else None)
                   if spec is not None else (None, None, None))
            groups.setdefault(key, []).append(name)
        ranking, kept, pruned, places = [], [], {}, {}
        for key, members in groups.items():
            # (in the order they warmed up, which breaks ties, as `select` says: the order they started broke them)
            losses = {n: waiting[n] for n in self.warmup_losses if n in waiting and n in members}
            chosen = self.select(losses, len(members))
            index = {n: i for i, n in enumerate(losses)}  # (as `select` ranks: ties in warmup order)
            order = sorted(losses, key=lambda n: (not math.isfinite(losses[n]), losses[n], index[n]))
            where = ""
            if len(groups) > 1:
                beta = f" (beta {key[2]:g})" if key[2] is not None else ""
                where = f" among the {key[0]} adapters{beta} on {key[1] or 'the first source'}"
            for place, name in enumerate(order, start=1):
                places[name] = place
                if name not in chosen:
                    pruned[name] = (f"warmup selection: validation loss {losses[name]:.4f} ranked {place} of "
                                    f"{len(order)}{where}; kept the top {len(chosen)} of {len(members)} candidates")
            ranking += order
            kept += chosen
        kept.sort(key=lambda n: places[n])  # (resumed best first, each group's in turn; stable: groups in order)
        return {"ranking": ranking, "kept": kept, "pruned": pruned}

    def _apply(self, pl_module: L.LightningModule, selection: dict[str, Any]) -> None:
        """Prune the adapters not kept (their owner exports and frees them; the other ranks learn it at the next
        exchange), then resume the kept ones that have room (every rank)."""
        self.kept = list(selection["kept"])
        for name in selection["ranking"]:
            if name not in self.kept and pl_module._owns(name) and not pl_module.registry[name].state.exited:
                pl_module.remove_adapter(name, state=AdapterState.PRUNED, reason=selection["pruned"][name])
        _sync(pl_module)  # (the prunes reach every rank first: paused adapters weigh on admission, `startable`)
        self.waiting = list(self.kept)
        self.decided = True
        self._resume_waiting(pl_module)

    def fill_slots(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Resume the kept adapters still waiting, as slots free (the module asks before it admits from its queue,
        and before it ends a run with nothing running). Not decided yet: the selection, where it can be made now
        (the last candidate may be known only here: a resumed sweep's trials told after its checkpoint are counted
        as its provider fills the slots, after this step's `on_train_batch_end` waited for them)."""
        if not self.decided and self.candidates:
            # (the candidates first: a resumed sweep's trials told after its checkpoint came in this fill)
            self.candidates += decide_once(pl_module, lambda: self._warmed_up(pl_module.registry)["candidates"])
            selection = decide_once(pl_module, lambda: self._selection(trainer, pl_module.registry))
            if selection is not None:
                self._apply(pl_module, selection)  # (which shares the owners' prunes with every rank first)
        if self.waiting:
            self._resume_waiting(pl_module)

    def _resume_waiting(self, pl_module: L.LightningModule) -> None:
        registry = pl_module.registry
        self.waiting = [n for n in self.waiting if n in registry and registry[n].state == AdapterState.PAUSED]
        for spec in pl_module.startable([registry[n].spec for n in self.waiting]):
            pl_module.resume_adapter(spec.name)
            self.waiting.remove(spec.name)
        for name in self.waiting:
            registry[name].reason = "kept by the warmup selection, waiting for a slot"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"warmup_losses": dict(self.warmup_losses), "candidates": list(self.candidates),
                "kept": list(self.kept), "waiting": list(self.waiting), "decided": self.decided,
                "settings": {"warmup_fraction": self.warmup_fraction, "keep_fraction": self.keep_fraction,
                             "min_keep": self.min_keep}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load(state_dict, "the checkpoint's")

    def _load(self, state_dict: dict[str, Any], source: str) -> None:
        """Takes a state, of ``source`` ("the checkpoint's", "the last fit's"): a selection under way keeps the
        settings it began with, said where they changed."""
        self.warmup_losses = dict(state_dict.get("warmup_losses", {}))
        self.candidates = list(state_dict.get("candidates", []))
        self.kept = list(state_dict.get("kept", []))
        self.waiting = list(state_dict.get("waiting", []))
        self.decided = bool(state_dict.get("decided", False))
        saved = state_dict.get("settings") or {}
        changed = [k for k, v in saved.items() if getattr(self, k, v) != v]
        if changed and not self.decided and (self.candidates or self.warmup_losses):  # (a warmup under way: the
            # candidates resumed with another warmup length were ranked beside those warmed up before, unsaid)
            now = ", ".join(f"{k}={getattr(self, k)!r}" for k in changed)
            for k in changed:
                setattr(self, k, type(getattr(self, k))(saved[k]))
            rank_zero_warn(f"{source} WarmupSelection ran with " + ", ".join(f"{k}={saved[k]!r}" for k in
                           changed) + f" (now {now}): its selection under way keeps them, every candidate warmed up "
                           "and ranked alike")


def _sync(pl_module: L.LightningModule) -> None:
    """Share the ranks' adapter progress and exits (a no-op in a single process)."""
    sync = getattr(pl_module, "_sync_ranks", None)
    if sync is not None:
        sync()
