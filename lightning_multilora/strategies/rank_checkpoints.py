"""One checkpoint from the per-rank files of an adapter-parallel checkpoint: a run resumed on another number of
processes than wrote it (`AdapterParallelStrategy.load_checkpoint`).

Each rank's file holds its own adapters (weights, optimizer state, best weights, dropout steps, data streams,
early-exit curves) and the registry as that rank saw it (its own adapters' records current, the others' a step
behind); what every rank keeps alike (the loops' progress, decisions made on rank 0) is taken from rank 0's file. A
single-process checkpoint file is one such part, every adapter placed anew. A state that a rank keeps for its own
adapters is merged by whoever owned each adapter: an object whose state it is (a callback, the datamodule) may
define ``merge_rank_states(states, owners)`` (``states``: the ranks' that saved one, in rank order; ``owners``: each
adapter's owner as a position in ``states``) to say how; without it, states that differ between ranks are taken from
the lowest rank that saved one (rank 0, but where its file lacks the state), with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Callable, Optional

from lightning_multilora.registry import merge_by_owner

# the module's own entry (`MultiLoRAMixin.on_save_checkpoint`): per-rank parts merged by adapter, the rest rank 0's
_BY_ADAPTER = ("best_weights", "dropout_steps")
_RNG = ("torch_rng", "cuda_rng")


def merge_rank_checkpoints(parts: Sequence[dict[str, Any]], rank: int,
                           mergers: Optional[Mapping[str, Callable[..., Any]]] = None,
                           attached: Optional[Collection[str]] = None) -> dict[str, Any]:
    """One checkpoint for rank ``rank`` of a run of another size, from ``parts`` (the files of ranks 0..n-1, in
    order): every adapter's weights and optimizer state, the ranks' per-adapter states merged
    (`merge_by_owner`), this rank's random state where it had a file (else rank 0's). ``mergers``: for a top-level
    key (a callback's ``state_key`` under ``"callbacks"``, the datamodule's class name), the ``merge_rank_states``
    of the object whose state it holds. ``attached``: the state keys of the callbacks that will load theirs (None:
    all); another's ranks' differing states are not warned of (the lowest rank's is kept, and nothing loads it).
    The adapters' owners (``"adapter_owner"``) are kept as saved: the strategy places them on the ranks it has."""
    if not parts:
        raise ValueError("merge_rank_checkpoints needs at least one rank's checkpoint")
    mergers = dict(mergers or {})
    owners: dict[str, int] = {}
    for part in reversed(parts):
        owners.update(part.get("adapter_owner") or {})
    merged = dict(parts[0])
    merged["adapter_owner"] = owners
    merged["rank"] = rank
    merged["state_dict"] = merge_by_owner([p.get("state_dict", {}) for p in parts], {})
    if any("optimizer_states" in p for p in parts):
        merged["optimizer_states"] = _merge_optimizer_states([p.get("optimizer_states") or [] for p in parts])
    if any("multilora" in p for p in parts):
        merged["multilora"] = _merge_module_state([p.get("multilora") or {} for p in parts], owners, rank)
    callbacks = [p.get("callbacks") or {} for p in parts]
    merged["callbacks"] = {key: _merge_states(f"callback {key!r}", [c.get(key, _MISSING) for c in callbacks],
                                              owners, mergers.get(key), attached is None or key in attached)
                           for key in dict.fromkeys(k for c in callbacks for k in c)}
    for key in mergers:
        if any(key in p for p in parts):  # the datamodule's state, under its class name
            merged[key] = _merge_states(key, [p.get(key, _MISSING) for p in parts], owners, mergers[key])
    return merged


_MISSING = object()  # a rank's file without the state


def _merge_states(what: str, per_rank: list[Any], owners: Mapping[str, int], merger: Optional[Callable],
                  loaded: bool = True) -> Any:
    """``per_rank``: each rank's state, `_MISSING` where its file has none. A merger sees the states present in rank
    order, with ``owners`` renumbered to match (an adapter whose owner's file lacks the state: none, so it is taken
    from the lowest rank that has it)."""
    present = [rank for rank, state in enumerate(per_rank) if state is not _MISSING]
    states = [per_rank[rank] for rank in present]
    if merger is not None:
        index = {rank: i for i, rank in enumerate(present)}
        return merger(states, {name: index[rank] for name, rank in owners.items() if rank in index})
    if loaded and any(not _same(states[0], s) for s in states[1:]):
        warnings.warn(f"the checkpoint's ranks saved different states for {what} and it defines no "
                      f"merge_rank_states(states, owners): rank {present[0]}'s is restored", stacklevel=3)
    return states[0]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (tensors inside: no single truth value)
        return False


def _merge_optimizer_states(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The first optimizer's groups of every rank, one per adapter (the module matches them by name: its
    ``_match_optimizer_state``), their tensors renumbered; an empty placeholder group (a rank without adapters)
    dropped; further optimizers rank 0's."""
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    count, seen = 0, set()
    for states in per_rank:
        if not states:
            continue
        saved = states[0]
        for group in saved["param_groups"]:
            if group.get("adapter") is None or group["adapter"] in seen:
                continue
            seen.add(group["adapter"])
            ids = list(range(count, count + len(group["params"])))
            count += len(ids)
            for old, new in zip(group["params"], ids):
                if old in saved["state"]:
                    state[new] = saved["state"][old]
            groups.append({**group, "params": ids})
    first = next((s for s in per_rank if s), [])
    return [{"state": state, "param_groups": groups}, *first[1:]]


def _merge_module_state(states: list[dict[str, Any]], owners: Mapping[str, int], rank: int) -> dict[str, Any]:
    """`MultiLoRAMixin`'s entry: the run's choices from rank 0; registry records, best weights and dropout steps by
    adapter; the exits not yet shared, from every rank; this rank's random state where it had a file."""
    merged = dict(states[0])
    # each adapter's record as its owner left it: the other ranks' copies lack the checkpoint's step, exchanged
    # after the checkpoint is written
    records = [{r["spec"]["name"]: r for r in (s.get("registry") or {}).get("records", [])} for s in states]
    merged["registry"] = {**(states[0].get("registry") or {}),
                          "records": list(merge_by_owner(records, owners).values())}
    for key in _BY_ADAPTER:
        merged[key] = merge_by_owner([s.get(key) or {} for s in states], owners)
    merged["exited_since_sync"] = list(dict.fromkeys(n for s in states for n in s.get("exited_since_sync", [])))
    own = states[rank] if rank < len(states) else states[0]
    for key in _RNG:
        merged[key] = own.get(key)
    return merged
