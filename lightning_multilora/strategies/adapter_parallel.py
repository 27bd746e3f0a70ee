"""`AdapterParallelStrategy`: adapters split across ranks, the frozen base sharded with FSDP2 (ALTO's
adapter parallelism).

Every rank joins FSDP's all-gathers of the frozen base; each rank trains a disjoint set of adapters on its
own data; with ``shard_size`` the base is sharded over groups of that many ranks and replicated across the
groups (FSDP2's hybrid sharding), and ``shard_size=1`` keeps a whole copy on every rank, with no collective of
the base at all (the fastest choice for a base that fits one device with its adapters). Adapter parameters
and gradients never enter a collective (they are FSDP ``ignored_params``, or created after sharding, so FSDP
never manages them; the base is frozen, so nothing is reduce-scattered).
The module keeps the same registry on every rank: admission runs identically everywhere (an admission
controller judges each rank's own adapters against one device's memory, `select_admitted`), `place` gives
each admitted adapter an owner (balanced by rows per step, same batch sizes together), and after every
step the ranks exchange their adapters' progress and exits (``all_gather_object``) so that the next
admission, and the end of training, are decided alike. A rank with no adapter left still runs the base's
forward and backward, so the collectives never wait on it; likewise a rank without DPO rows joins the
reference forward (the base alone) that a rank with some runs.

Callbacks that decide across adapters (`OptunaSweep` asks trials and tells results, `WarmupSelection` ranks
the cohort) decide on rank 0 alone, from the shared registry, through `decide_once`: the decision (or the
error it raised) is broadcast, and every rank applies the same one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch
from lightning.pytorch.plugins import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_multilora.arguments import UsageError
from lightning_multilora.spec import AdapterSpec

T = TypeVar("T")


def _rank_files(folder: Path, strict: bool = True) -> list[Path]:
    """``rank0.ckpt``, ``rank1.ckpt``, ... of a checkpoint folder, in rank order; a gap is an error (a rank's file
    missing: its adapters would be lost), unless not ``strict``."""
    if not folder.is_dir():
        return []
    found = {int(m.group(1)): f for f in folder.iterdir() if (m := re.fullmatch(r"rank(\d+)\.ckpt", f.name))}
    missing = sorted(set(range(max(found, default=-1) + 1)) - set(found))
    if missing and strict:
        raise FileNotFoundError(f"{folder} lacks rank{missing[0]}.ckpt (of rank0..rank{max(found)}.ckpt): every rank's "
                                "file is needed to resume, each holds its own adapters")
    return [found[r] for r in sorted(found)]


def _load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A rank file (``mmap``: its tensors left on disk, for a look at its size and step only)."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def _written_by(path: Path, files: Sequence[Path]) -> int:
    """How many ranks wrote the checkpoint folder ``path``: rank 0's file says so; one written before the files
    said their size, the files from rank 0 on that were written at its step. Files past those: an earlier run's,
    left in a folder saved again, ignored with a warning."""
    first = _load(files[0], mmap=True)
    size = first.get("world_size")
    if size is None:
        size = 1
        while size < len(files) and _load(files[size], mmap=True).get("global_step") == first.get("global_step"):
            size += 1
    if len(files) < size:
        raise FileNotFoundError(f"{path} lacks rank{len(files)}.ckpt: it was written by {size} ranks, and every "
                                "rank's file is needed to resume (each holds its own adapters)")
    if len(files) > size:
        warnings.warn(f"{path} holds files of ranks past the {size} that wrote it ({files[size].name}...): left "
                      "over from an earlier run, ignored", stacklevel=3)
    return size


def _mismatch(path: Path, size: int, files: Sequence[Path], parts: Sequence[Mapping[str, Any]],
              ranks: Sequence[int]) -> Optional[str]:
    """Why ``parts`` (the files of ``ranks``) are not one checkpoint of ``size`` ranks written at one step, or
    None."""
    for file, part, rank in zip(files, parts, ranks):
        if (part.get("rank") != rank or part.get("world_size", size) != size
                or part.get("global_step") != parts[0].get("global_step")):
            return (f"{path} is not one checkpoint of {size} ranks: {file.name} was written by rank {part.get('rank')} "
                    f"of {part.get('world_size', 'an unknown number')} at step {part.get('global_step')} (rank0.ckpt: "
                    f"step {parts[0].get('global_step')})")
    return None


def _local(path: Any, done: str) -> str:
    """``path`` as a local path: an adapter-parallel checkpoint is a folder of one file per rank, written and read
    with local file operations (a URL's "s3://bucket/x" would be written as the local folder "s3:/bucket/x")."""
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    if not _is_local_file_protocol(str(path)):
        raise ValueError(f"an adapter-parallel checkpoint is {done} as a folder on a file system every rank sees, not "
                         f"through a URL: got {str(path)!r}; give a local or mounted path (ModelCheckpoint's "
                         "`dirpath`, the `ckpt_path`)")
    path = str(path)
    return path[len("file://"):] if path.startswith("file://") else path


def assign_adapters(specs: Sequence[AdapterSpec], num_ranks: int,
                    current: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """A disjoint, balanced owner for every adapter: adapters already placed stay; new ones go, largest batch
    first, to an empty rank where there is one; else to the rank that already holds that batch size and has the
    least rows where that leaves the most rows a rank holds no higher than the least-loaded rank would, else the
    least-loaded rank. (The module places adapters as they start, one after the other: a rank of the same batch
    size taken whatever its load put two 8-row adapters on one rank and a 1-row one on the other.)"""
    if num_ranks < 1:
        raise ValueError(f"`num_ranks` must be >= 1, got {num_ranks}")
    owner = dict(current or {})
    by_name = {s.name: s for s in specs}
    load = [0] * num_ranks
    sizes: list[set[int]] = [set() for _ in range(num_ranks)]
    for name, rank in owner.items():
        if name in by_name:
            load[rank] += by_name[name].rows_per_step
            sizes[rank].add(by_name[name].batch_size)
    for spec in sorted((s for s in specs if s.name not in owner), key=lambda s: (-s.batch_size, s.name)):
        rows = spec.rows_per_step
        bound = max(max(load), min(load) + rows)  # the most rows a rank holds with this one on the least-loaded
        same = [r for r in range(num_ranks) if spec.batch_size in sizes[r] and load[r] + rows <= bound
                and min(load) > 0]  # (never beside another while a rank holds none: placed adapters stay, and the
        # rank left empty idled once a large one that set the bound ended)
        rank = min(same, key=lambda r: (load[r], r)) if same else min(range(num_ranks), key=lambda r: (load[r], r))
        owner[spec.name] = rank
        load[rank] += spec.rows_per_step
        sizes[rank].add(spec.batch_size)
    return owner


class AdapterParallelStrategy(ModelParallelStrategy):
    """``Trainer(strategy="adapter_parallel")``: each rank trains its own adapters; the frozen base sharded with
    FSDP2 over all ranks (default), within groups of ``shard_size`` ranks, or held whole on each rank.

    Args:
        param_dtype: the dtype the base computes in (``torch.bfloat16``, or its name, ``"bfloat16"``): FSDP2 mixed
            precision for a sharded base's gathered parameters; a replicated base (``shard_size=1``) is cast to it
            once.
        reshard_after_forward: FSDP2's choice (True: least memory, the base is gathered again in backward).
        shard_size: ranks that share one copy of the base, each holding a shard: ``None`` (all of them,
            ALTO's setting), a divisor of the world size (sharded within groups of that many consecutive ranks,
            replicated across groups), or 1 (a whole base on every rank: no collective of the base per step,
            at the memory of a whole base per device).
        **kwargs: `ModelParallelStrategy`'s (``process_group_backend``, ``timeout``...).
    """

    strategy_name = "adapter_parallel"

    def __init__(self, param_dtype: Optional[Union[torch.dtype, str]] = None, reshard_after_forward: bool = True,
                 shard_size: Optional[int] = None, **kwargs: Any) -> None:
        if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int)
                                       or shard_size < 1):
            raise ValueError(f"`shard_size` must be None (every rank) or a positive int that divides the number "
                             f"of ranks, got {shard_size!r}")
        fixed = sorted({"data_parallel_size", "tensor_parallel_size"} & kwargs.keys())
        if fixed:
            raise ValueError(f"AdapterParallelStrategy takes no {fixed}: it splits adapters over every rank (and "
                             "shards or replicates the base, `shard_size`), with no data or tensor parallelism")
        if isinstance(param_dtype, str):  # (as `MultiLoRAModule(dtype=...)` takes it: "bfloat16")
            param_dtype = getattr(torch, param_dtype.removeprefix("torch."), param_dtype)
        if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
            raise ValueError(f"AdapterParallelStrategy: `param_dtype` must be None or a floating dtype "
                             f"(torch.bfloat16, 'bfloat16', 'float16', 'float32'...), got {param_dtype!r}")
        kwargs.setdefault("save_distributed_checkpoint", False)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.shard_size = shard_size
        self.owner: dict[str, int] = {}
        self._admitted_to: dict[str, int] = {}  # the rank `select_admitted` found room on, for `place` to give
        self.resized_from: Optional[int] = None  # the ranks that wrote the checkpoint resumed, where not this run's
        self._sigterm_pending = False  # (`_sigterm_notifier`: a SIGTERM this rank has had, not yet shared)
        self._signal_connector: Any = None

    def setup(self, trainer: Any) -> None:
        # Lightning's SIGTERM handler broadcasts from inside the handler: a rank signalled while it waits in another
        # collective (this strategy's per-step `exchange`) then waited for ever, its peers in that collective. Here
        # the handler notes the signal (and stops the launcher's processes, as Lightning's does), and `exchange`,
        # which every rank reaches at each step's end, sets `trainer.received_sigterm` on every rank at once: all
        # of them stop after the same step.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            self._signal_connector = connector
            self._sigterm_pending = False
            connector._sigterm_notifier_fn = self._sigterm_notifier  # (registered after this: `Trainer._run`)
        super().setup(trainer)

    def _sigterm_notifier(self, signum: Any, frame: Any) -> None:
        connector = self._signal_connector
        if not (self._sigterm_pending or connector.received_sigterm) and self.launcher is not None:
            self.launcher.kill(signum)
        self._sigterm_pending = True

    def _configure_launcher(self) -> None:
        """Lightning's launcher, whose observer lets rank 0 export after another rank's process failed (it killed
        rank 0 within 5 s: `strategies.launcher`)."""
        from lightning_multilora.strategies.launcher import AdapterParallelLauncher

        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = AdapterParallelLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        world = self.num_processes * self.num_nodes
        if self.shard_size is not None and world % self.shard_size:
            raise ValueError(f"`shard_size` must divide the number of ranks ({world}), got {self.shard_size}")
        self._data_parallel_size = world  # every rank trains its own adapters on its own data
        super().setup_environment()

    # -- the base ---------------------------------------------------------------------------------

    @property
    def base_shard_size(self) -> int:
        """How many ranks share one copy of the base (1: every rank holds it whole)."""
        return self.shard_size if self.shard_size is not None else self.world_size

    def parallelize(self, model: nn.Module, adapter_params: Sequence[nn.Parameter]) -> None:
        """``fully_shard`` every decoder layer, then the root, leaving adapter parameters out; over every rank,
        or hybrid (sharded within groups of ``shard_size``, replicated across them). With one rank per copy
        the base is not sharded (Lightning moves it whole to each rank's device), only cast to ``param_dtype``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        size = self.base_shard_size
        quantized = [n for n, m in model.named_modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")]
        if size > 1 and quantized:  # (seen on the CPU: after a forward, each rank decodes its shard wrongly)
            raise ValueError(f"a bitsandbytes-quantized base ({quantized[0]}, ...) cannot be sharded here: its packed "
                             "weights and their quantization state are one per whole tensor; give "
                             "`AdapterParallelStrategy(shard_size=1)`, every rank holding the whole 4-bit base")
        if size == 1:
            if self.param_dtype is not None:
                ignored = {id(p) for p in adapter_params}
                with torch.no_grad():
                    for p in model.parameters():
                        if id(p) not in ignored and p.is_floating_point():
                            p.data = p.data.to(self.param_dtype)
            return
        if size == self.world_size:
            mesh = self.device_mesh["data_parallel"]
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.root_device.type, (self.world_size // size, size),
                                    mesh_dim_names=("replicate", "shard"))
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype)
        ignored = set(adapter_params)
        blocks = _decoder_layers(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy,
                        ignored_params=ignored & set(block.parameters()))
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored)

    # -- checkpoints: one file per rank, adapters only ------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's adapter tensors (the frozen base is never saved; no collective is needed)."""
        module = self.lightning_module
        names = set(getattr(module.lora_layers, "adapter_names", [])) if hasattr(module, "lora_layers") else set()
        return {k: v.detach().cpu() for k, v in module.state_dict().items()
                if (".lora_A." in k or ".lora_B." in k) and any(f".{n}" in k for n in names)}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return optimizer.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """``filepath`` becomes a folder with ``rank<r>.ckpt`` per rank: its adapters, optimizer state and the
        (shared) registry."""
        path = Path(self.broadcast(_local(filepath, "written")))
        if path.is_file():
            self.barrier("adapter_parallel_ckpt")
            if self.global_rank == 0:
                path.unlink()
        self.barrier("adapter_parallel_ckpt_ready")
        path.mkdir(parents=True, exist_ok=True)
        checkpoint = dict(checkpoint, adapter_owner=dict(self.owner), rank=self.global_rank, world_size=self.world_size)
        torch.save(checkpoint, path / f"rank{self.global_rank}.ckpt")
        self.barrier("adapter_parallel_ckpt_saved")
        if self.global_rank == 0:  # a folder written again (``last.ckpt``) by a run of fewer ranks than wrote it: the
            for stale in _rank_files(path, strict=False)[self.world_size:]:  # others' files, once every rank's is new
                stale.unlink()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore before the optimizer is built: the registry and this rank's adapters come back first, then
        # `configure_optimizers` makes their param groups and the saved optimizer state loads into them.
        return False

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """This rank's file of a checkpoint folder written by `save_checkpoint`. Written by another number of
        ranks (or a single-process checkpoint file): every rank's file, merged (`merge_rank_checkpoints`), and
        the adapters of ranks this run does not have placed anew on the ranks it has (`place`, when the module
        restores its registry), all of them on more ranks than wrote it; each adapter keeps its weights, optimizer
        state and progress. Every rank reads
        ``rank0.ckpt``'s size and step (the folder is on storage every rank sees)."""
        from lightning_multilora.strategies.rank_checkpoints import merge_rank_checkpoints

        path = Path(self.broadcast(_local(checkpoint_path, "read")))
        self.resized_from = None
        if path.is_file():  # a single-process checkpoint: its adapters placed on this run's ranks
            part = _load(path)
            if part.get("world_size", 1) > 1:
                raise ValueError(f"{path} is rank {part.get('rank')}'s file of a checkpoint of {part['world_size']} "
                                 f"ranks: resume from its folder, {path.parent}")
            self.resized_from = 1 if self.world_size != 1 else None
            checkpoint = merge_rank_checkpoints([part], self.global_rank, self._state_mergers(),
                                                self._attached_states())
        else:
            files = _rank_files(path)
            if not files:
                raise FileNotFoundError(f"{path} does not exist or holds no rank<r>.ckpt: an adapter-parallel "
                                        "checkpoint is a folder with one rank<r>.ckpt per rank that wrote it")
            size = _written_by(path, files)
            if size == self.world_size:
                rank = self.global_rank
                checkpoint = _load(files[rank])
                head = checkpoint if rank == 0 else _load(files[0], mmap=True)
                self._raise_on_every_rank(_mismatch(path, size, [files[0], files[rank]], [head, checkpoint], [0, rank]))
                del head
            else:
                self.resized_from = size
                parts = [_load(f) for f in files[:size]]
                error = _mismatch(path, size, files[:size], parts, list(range(size)))  # (alike on every rank)
                if error:
                    raise ValueError(error)
                checkpoint = merge_rank_checkpoints(parts, self.global_rank, self._state_mergers(),
                                                    self._attached_states())
        # adapters owned by ranks this run does not have are placed again by the module; resumed over more ranks than
        # wrote it, every adapter is (its state is in every rank's merged checkpoint): the new ranks were left idle
        grown = self.resized_from is not None and self.resized_from < self.world_size
        self.owner = {} if grown else {n: r for n, r in (checkpoint.get("adapter_owner") or {}).items()
                                       if r < self.world_size}
        return checkpoint

    def _raise_on_every_rank(self, error: Optional[str]) -> None:
        """Raise ``error`` (this rank's, or another's) on every rank, none left waiting in a collective."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(errors, error)
            error = error or next((e for e in errors if e), None)
        if error:
            raise ValueError(error)

    def _state_mergers(self) -> dict[str, Any]:
        """The ``merge_rank_states`` of the trainer's callbacks (by state key) and datamodule (by class name)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        objects: dict[str, Any] = {}
        if trainer is not None:
            objects.update({cb.state_key: cb for cb in trainer.callbacks})
            if trainer.datamodule is not None:
                objects[type(trainer.datamodule).__qualname__] = trainer.datamodule
        return {k: o.merge_rank_states for k, o in objects.items() if callable(getattr(o, "merge_rank_states", None))}

    def _attached_states(self) -> Optional[set[str]]:
        """The state keys of the trainer's callbacks (those a checkpoint's callback states load into)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return {cb.state_key for cb in trainer.callbacks} if trainer is not None else None

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=False)  # adapters only

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning.pytorch.strategies import Strategy

        Strategy.load_optimizer_state_dict(self, checkpoint)

    # -- adapters -------------------------------------------------------------------------------

    def place(self, specs: Sequence[AdapterSpec]) -> None:
        self.owner = assign_adapters(specs, self.world_size, {**self.owner, **self._admitted_ranks(specs)})

    def _admitted_ranks(self, specs: Sequence[AdapterSpec]) -> dict[str, int]:
        """The ranks `select_admitted` chose for those of ``specs`` not placed yet."""
        return {s.name: rank for s in specs if s.name not in self.owner
                and (rank := self._admitted_to.get(s.name)) is not None and rank < self.world_size}

    def owners_if_started(self, specs: Sequence[AdapterSpec]) -> dict[str, int]:
        """Where ``specs`` would train if started in this order, one after the other, as the module starts
        them (`place` after each): the adapters already placed stay."""
        owner = {**self.owner, **self._admitted_ranks(specs)}
        placed: list[AdapterSpec] = []
        for spec in specs:
            placed.append(spec)
            if spec.name not in owner:
                owner = assign_adapters(placed, self.world_size, owner)
        return owner

    def select_admitted(self, admission: Any, running: Sequence[AdapterSpec], candidates: Sequence[AdapterSpec],
                        freed: Optional[AdapterSpec] = None) -> list[AdapterSpec]:
        """Admission per rank: ``admission``'s predictor and budget (one device's) judge each rank's own adapters
        (``running``: the resident ones, paused included, on the ranks that hold them). The order is the greedy
        controller's (largest batch first, the freed slot's batch size before the others). A candidate goes to the
        rank the placement balances it to (`assign_adapters`) where it fits there, else to the first other rank,
        fewest rows first, where it fits (that rank, `place` gives it), else it waits (a paused one, owned, fits on
        its owner or waits): a candidate balanced to a rank full by memory waited while another had room, and a rank
        over the budget (adapters a resume moved there) held every rank's candidates back. The same registry on every
        rank gives the same decision everywhere.

        Any controller is applied this way, greedily: a `CPSATAdmission`'s knapsack and priorities are not used
        under this strategy (its predictor is). The predictor is asked about one rank's adapters as if the whole
        base sat on that device: under FSDP2 a rank holds a shard and one gathered layer, so this errs on the safe
        side (give ``admission`` a predictor for one rank to pack more)."""
        from lightning_multilora.scheduling.admission import AdmissionController, admission_order

        fits = (AdmissionController(admission.predict, admission.capacity_bytes, admission.safety_margin).fits
                if all(hasattr(admission, k) for k in ("predict", "capacity_bytes", "safety_margin"))
                else admission.fits)  # (a controller of the user's: fits / select / alone alone)
        owner = assign_adapters(running, self.world_size, {**self.owner, **self._admitted_ranks(running)})
        on: list[list[AdapterSpec]] = [[s for s in running if owner[s.name] == r] for r in range(self.world_size)]
        chosen: list[AdapterSpec] = []
        self._admitted_to = {}
        for spec in admission_order(candidates, freed):
            balanced = assign_adapters([*running, *chosen, spec], self.world_size, owner)[spec.name]
            rows = [sum(s.rows_per_step for s in specs) for specs in on]
            others = sorted((r for r in range(self.world_size) if r != balanced), key=lambda r: (rows[r], r))
            # (a paused adapter, owned, resumes where its weights and optimizer state are: judged on that rank alone;
            # it was taken as fitting on another rank with room, and resumed over its own rank's budget)
            ranks = (self.owner[spec.name],) if spec.name in self.owner else (balanced, *others)
            rank = next((r for r in ranks if fits([*on[r], spec])), None)
            if rank is None:
                continue
            owner[spec.name] = self._admitted_to[spec.name] = rank
            on[rank].append(spec)
            chosen.append(spec)
        return chosen

    def owns(self, name: str) -> bool:
        return self.owner.get(name) == self.global_rank

    def exchange(self, updates: dict[str, Any]) -> dict[str, Any]:
        """Every rank's ``updates`` (its own adapters' progress), merged; and whether any rank has had a SIGTERM
        (`setup`): then every rank's Trainer has ``received_sigterm`` from here."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (self._sigterm_pending, updates))
        merged: dict[str, Any] = {}
        for _, part in gathered:
            merged.update(part)
        if any(pending for pending, _ in gathered) and self._signal_connector is not None:
            self._signal_connector.received_sigterm = True
        return merged

    def decide_on_rank_zero(self, decide: Callable[[], T]) -> T:
        """``decide()`` on rank 0 alone; its result reaches every rank (``broadcast_object_list``). Rank 0 also
        broadcasts the error it raised, which every other rank then raises (a ValueError, TypeError or `UsageError`
        as such, others as RuntimeError): none is left waiting in a collective that rank 0 never joins."""
        outcome: Any = None
        if self.global_rank == 0:
            try:
                outcome = ("ok", decide())
            except Exception as err:
                self.broadcast(("error", (type(err).__name__, str(err))), src=0)
                raise
        kind, value = self.broadcast(outcome, src=0)
        if kind == "error":
            name, message = value
            cls = {"ValueError": ValueError, "TypeError": TypeError, "UsageError": UsageError}.get(name, RuntimeError)
            raise cls(f"rank 0 failed to decide for every rank: {name}: {message}")
        return value


def check_resume_path(ckpt_path: Any, strategy: Any) -> None:
    """A checkpoint of `AdapterParallelStrategy` (a folder of one ``rank<r>.ckpt`` per process) given to another
    strategy, or a folder of checkpoints or an exported adapter: a named error (the loading would fail on the
    folder)."""
    if ckpt_path is None or isinstance(strategy, AdapterParallelStrategy) or not Path(str(ckpt_path)).is_dir():
        return
    folder = Path(str(ckpt_path))
    ranks = sorted(p.name for p in folder.glob("rank*.ckpt"))
    if ranks:
        raise ValueError(f"`ckpt_path` {str(ckpt_path)!r} is an adapter-parallel checkpoint, one file per process "
                         f"({', '.join(ranks)}): it resumes with strategy='adapter_parallel' (over any number of "
                         "processes, one included)")
    # (a folder of checkpoints or an export: the load's bare IsADirectoryError, after the run had taken its log
    # directory; another folder may be a strategy's sharded checkpoint, which it loads itself)
    inside = sorted(p.name for p in folder.glob("*.ckpt"))
    if inside:
        raise ValueError(f"`ckpt_path` {str(ckpt_path)!r} is a folder, not a checkpoint file; the checkpoints in it: "
                         f"{', '.join(inside[:6])}{' ...' if len(inside) > 6 else ''}")
    if (folder / "adapter_config.json").is_file():
        raise ValueError(f"`ckpt_path` {str(ckpt_path)!r} is an exported adapter, not a checkpoint: it starts an "
                         "adapter from its weights, `AdapterSpec(init_from=...)` (a config's adapter `init_from:`)")
    if (folder / ".metadata").is_file() or (folder / "meta.pt").is_file():
        return  # (torch's distributed checkpoint, as a sharded strategy writes one: it loads it itself)
    deeper = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.ckpt"))
    found = (f"the checkpoints under it: {', '.join(deeper[:6])}{' ...' if len(deeper) > 6 else ''}" if deeper else
             "it holds no checkpoint (*.ckpt)")
    raise ValueError(f"`ckpt_path` {str(ckpt_path)!r} is a folder, not a checkpoint file; {found} (`--ckpt_path last` "
                     "resumes a run's last checkpoint, found in its folders)")


def guard_folder_checkpoints(strategy: Any) -> None:
    """Under another strategy than `AdapterParallelStrategy`, a resume from an adapter-parallel checkpoint folder
    (from Python: `trainer.fit(ckpt_path=folder)`) is the named error of `check_resume_path`, not the load's bare
    IsADirectoryError: the strategy's checkpoint IO checks the path it loads (no Lightning hook sees the path
    before). Once per strategy."""
    if isinstance(strategy, AdapterParallelStrategy) or isinstance(strategy.checkpoint_io, _FolderCheck):
        return
    try:
        strategy.checkpoint_io = _FolderCheck(strategy.checkpoint_io)
    except TypeError:  # (a strategy that takes its own kind of checkpoint IO only, XLA's: left as it is)
        pass


class _FolderCheck(CheckpointIO):
    """A strategy's checkpoint IO (``inner``), refusing an adapter-parallel checkpoint folder by name."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        check_resume_path(path, None)
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def placement_of(pl_module: Any) -> Optional[AdapterParallelStrategy]:
    """The `AdapterParallelStrategy` training ``pl_module``'s adapters, or None in a single process."""
    placement = getattr(pl_module, "_placement", lambda: None)()
    return placement if isinstance(placement, AdapterParallelStrategy) else None


def decides_here(pl_module: Any) -> bool:
    """Whether this process makes the run's shared decisions (the single process, or rank 0)."""
    placement = placement_of(pl_module)
    return placement is None or placement.global_rank == 0


def decide_once(pl_module: Any, decide: Callable[[], T]) -> T:
    """``decide()`` in a single process; under adapter parallelism rank 0's, broadcast (`decide_on_rank_zero`).
    Every rank must call it at the same point: it is a collective."""
    placement = placement_of(pl_module)
    return decide() if placement is None else placement.decide_on_rank_zero(decide)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers``), else every child ModuleList's items."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    found = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    if not found:
        raise TypeError(f"{type(model).__name__}: no decoder layers (model.model.layers) to shard")
    return found
