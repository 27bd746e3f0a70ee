"""`OptunaSweep`: an Optuna study feeds the run's free slots; each adapter is one trial."""

from __future__ import annotations

import math
import numbers
import re
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_multilora.arguments import UsageError, check_int
from lightning_multilora.export import init_from_config
from lightning_multilora.log_dir import log_dir_of
from lightning_multilora.registry import AdapterRecord, AdapterState, exported_accuracy, exported_loss
from lightning_multilora.spec import AdapterSpec, check_alpha_over_rank, check_spec_fields, without_unused_beta
from lightning_multilora.strategies.adapter_parallel import decide_once, decides_here, placement_of

if TYPE_CHECKING:
    import optuna

PARAM_TYPES = ("float", "int", "categorical")
PRUNED_STATES = (AdapterState.DIVERGED, AdapterState.PRUNED)
# an overfit exit keeps (and exports) its best-validation weights: a result, as a finished adapter's
COMPLETE_STATES = (AdapterState.FINISHED, AdapterState.OVERFIT)
_TRIAL_NAME = re.compile(r"trial-\d+")


# The keys a parameter of each type takes (Optuna's distributions' arguments)
PARAM_KEYS = {"float": ("type", "low", "high", "log", "step"), "int": ("type", "low", "high", "log", "step"),
              "categorical": ("type", "choices")}
# Optuna warns of a categorical choice that is a list (`target_modules`' ["q_proj", "v_proj"]) at every distribution it
# makes, each ask, report and tell reading them back from its storage (16 times in a sweep of 4 trials): its JSON
# keeps lists, and trials read them back as given. Silenced in the process once a search space has one
_LIST_CHOICES = (r"Choices for a categorical distribution should be a tuple of None, bool, int, float and str "
                 r"for persistent storage but contains .* which is of type (list|tuple)\.")


def _bound(name: str, key: str, value: Any, kind: str) -> Any:
    """A search-space bound as a number: YAML 1.1 reads ``1e-5`` (no dot) as a string, taken here as the number it
    spells; anything else that is not a number (an integer, for an int parameter) is a named error."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if kind == "int" and isinstance(number, numbers.Real) and not isinstance(number, bool) \
            and not isinstance(number, numbers.Integral) and float(number).is_integer():
        number = int(number)  # (1e2 reads as 100.0; Optuna took it as 100)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral if kind == "int" else numbers.Real):
        what = "an int parameter must be an integer" if kind == "int" else "a float one must be a number"
        raise ValueError(f"search space `{name}`: `{key}` of {what}, got {value!r}")
    return number


def as_parameter(name: str, spec: Any) -> Any:
    """A parameter given as an Optuna distribution (``FloatDistribution(1e-5, 1e-3, log=True)``, ``IntDistribution``,
    ``CategoricalDistribution``) in the form a config gives it (``{"type": "float", "low": ...}``); anything else as
    given."""
    import optuna.distributions as d

    if not isinstance(spec, d.BaseDistribution):
        return spec
    if isinstance(spec, (d.FloatDistribution, d.IntDistribution)):
        kind = "float" if isinstance(spec, d.FloatDistribution) else "int"
        return {"type": kind, "low": spec.low, "high": spec.high, "log": spec.log,
                **({} if spec.step is None else {"step": spec.step})}
    if isinstance(spec, d.CategoricalDistribution):
        return {"type": "categorical", "choices": list(spec.choices)}
    raise ValueError(f"search space `{name}`: an Optuna distribution can be FloatDistribution, IntDistribution or "
                     f"CategoricalDistribution, got {type(spec).__name__}")


def distributions(search_space: dict[str, dict[str, Any]]) -> dict[str, "optuna.distributions.BaseDistribution"]:
    """Optuna distributions from ``{"lr": {"type": "float", "low": 1e-5, "high": 5e-4, "log": True}, ...}``
    (``step`` too, for ``float`` and ``int``: Optuna's ``FloatDistribution`` / ``IntDistribution``)."""
    import optuna

    out = {}
    for name, spec in search_space.items():
        if not isinstance(spec, dict):
            raise ValueError(f"search space `{name}`: a parameter is a dict such as {{'type': 'float', 'low': 1e-5, "
                             f"'high': 1e-3, 'log': True}} (or an Optuna distribution), got {spec!r}")
        kind = spec.get("type")
        if kind not in PARAM_TYPES:
            raise ValueError(f"search space `{name}`: `type` can be {', '.join(PARAM_TYPES)}, got {kind!r}")
        unknown = sorted(set(spec) - set(PARAM_KEYS[kind]))
        if unknown:
            raise ValueError(f"search space `{name}`: a {kind} parameter takes {', '.join(PARAM_KEYS[kind])}; "
                             f"got {', '.join(map(repr, unknown))}")
        if kind == "categorical":
            choices = spec.get("choices")
            if isinstance(choices, (str, bytes, Mapping)) or not isinstance(choices, Sequence) or not choices:
                raise ValueError(f"search space `{name}`: a categorical parameter needs `choices`, a non-empty list, "
                                 f"got {choices!r}")
            if any(isinstance(c, (list, tuple)) for c in choices):  # (`_LIST_CHOICES`)
                warnings.filterwarnings("ignore", _LIST_CHOICES)
            out[name] = optuna.distributions.CategoricalDistribution(list(choices))
        else:
            if "low" not in spec or "high" not in spec:
                raise ValueError(f"search space `{name}`: a {kind} parameter needs `low` and `high`")
            spec = {**spec, **{key: _bound(name, key, spec[key], kind) for key in ("low", "high", "step")
                               if key in spec and not (key == "step" and spec[key] is None and kind == "float")}}
            cls = optuna.distributions.FloatDistribution if kind == "float" else optuna.distributions.IntDistribution
            step = spec.get("step", None if kind == "float" else 1)
            if step is not None and step <= 0:
                raise ValueError(f"search space `{name}`: `step` must be greater than 0, got {step!r}")
            log = spec.get("log", False)
            if not isinstance(log, bool):
                raise ValueError(f"search space `{name}`: `log` must be True or False, got {log!r}")
            try:
                out[name] = cls(spec["low"], spec["high"], log=log, step=step)
            except ValueError as err:  # Optuna's own checks (low > high, log with a step, ...)
                raise ValueError(f"search space `{name}`: {err}") from err
    return out


OPEN_ATTEMPTS = 8  # `_open_study`'s tries at a storage other processes are creating at the same moment


def _open_study(storage: Any, study_name: str, sampler: "optuna.samplers.BaseSampler",
                heartbeat_interval: Optional[int] = None, grace_period: Optional[int] = None,
                pruner: Optional["optuna.pruners.BasePruner"] = None) -> "optuna.Study":
    """The study ``study_name`` in ``storage`` (a URL, opened with a heartbeat where ``heartbeat_interval`` is given,
    or a storage object), created there if new; an SQLite file's folder is made first. A URL that cannot be opened
    is a `UsageError` (a `ValueError`) naming `storage`."""
    import random
    import time

    import optuna
    import sqlalchemy.exc

    url = storage
    try:
        if isinstance(storage, str) and storage.startswith("sqlite:///") and storage != "sqlite:///:memory:":
            Path(storage[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while True:
            try:
                if heartbeat_interval is not None:  # (`storage` is a URL: checked in __init__)
                    with warnings.catch_warnings():  # (Optuna marks the argument experimental)
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        storage = optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_interval,
                                                             grace_period=grace_period)
                return optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                           sampler=sampler, load_if_exists=True,
                                           pruner=pruner if pruner is not None else optuna.pruners.NopPruner())
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError,
                    optuna.exceptions.StorageInternalError) as err:
                # (processes opening a new database together: one creates its tables, or the study, and the others
                # find them half made; Optuna's storage takes no lock for that. A moment later they are there)
                attempt += 1
                racing = isinstance(err, sqlalchemy.exc.IntegrityError) or any(
                    words in str(err) for words in ("already exists", "locked", "UNIQUE constraint"))
                if attempt == OPEN_ATTEMPTS or not racing or not isinstance(url, str):
                    raise
                storage = url
                time.sleep(random.uniform(0.05, 0.25) * attempt)
    except (OSError, ValueError, sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(f"OptunaSweep: `storage` {url!r} could not be opened ({detail}); give a database URL "
                         "such as 'sqlite:///runs/optuna.db' or an RDB's (postgresql://..., mysql://...)") from err


def _resumed_storage(storage: str, ckpt_path: Optional[str], study_name: str, sweep_id: Optional[str]) -> str:
    """The study file a resumed sweep goes on with, where its checkpoint named the run folder's own (``optuna.db``,
    by absolute path): there if it is; else the ``optuna.db`` nearest above the checkpoint whose study holds this
    sweep's trials (the run folder moved, with a warning); else a `UsageError` (a new, empty study there would take
    the trials' numbers again)."""
    import optuna

    prefix = "sqlite:///"
    if not storage.startswith(prefix) or Path(storage[len(prefix):]).is_file():
        return storage

    def holds_this_sweep(path: Path) -> bool:
        try:
            trials = optuna.load_study(study_name=study_name, storage=f"{prefix}{path}").get_trials(deepcopy=False)
        except (KeyError, ValueError, OSError):  # (no such study there, or no database)
            return False
        return any(t.user_attrs.get("sweep") == sweep_id for t in trials)

    here = Path(ckpt_path).resolve().parent if ckpt_path and Path(ckpt_path).exists() else None
    found = next((p / "optuna.db" for p in ([here, *here.parents][:4] if here else [])
                  if (p / "optuna.db").is_file() and holds_this_sweep(p / "optuna.db")), None)
    if found is None:
        raise UsageError(f"OptunaSweep: the study this checkpoint's sweep ran, in {storage[len(prefix):]}, is not "
                         "there (its run folder moved, or the file was removed), nor in an optuna.db above the "
                         "checkpoint holding its trials: give its place, `storage='sqlite:///<path>/optuna.db'`")
    warnings.warn(f"OptunaSweep: the study this checkpoint's sweep ran is not at {storage[len(prefix):]} (the run "
                  f"folder moved?): going on with {found}, the optuna.db above the checkpoint")
    return f"{prefix}{found}"


def _validation_interval(pl_module: L.LightningModule) -> Optional[int]:
    """The Trainer's validation interval in steps, where it is one (``val_check_interval`` an integer > 1, as the
    CLI sets it), else None (`OptunaSweep._warn_unaligned`)."""
    trainer = getattr(pl_module, "_trainer", None)
    interval = getattr(trainer, "val_check_interval", None)
    return interval if isinstance(interval, int) and not isinstance(interval, bool) and interval > 1 else None


GRID_SEED = "multilora_grid_seed"  # a study's user attribute: the seed that orders its grid (`_grid_seed`)


def _grid_seed(study: "optuna.Study", seed: Optional[int]) -> int:
    """The seed of the ``GridSampler`` of a sweep over ``study``: the one the study keeps, which its first grid
    sweep wrote there (``seed``, or a random one for None). Optuna numbers a grid's points in the order its seed
    shuffles them to, and tells which are taken by number: sweeps of other seeds sharing the study would ask some
    points twice and others never."""
    import random

    kept = study.user_attrs.get(GRID_SEED)
    if kept is None:
        study.set_user_attr(GRID_SEED, random.randrange(2**32) if seed is None else seed)
        kept = study.user_attrs[GRID_SEED]  # (read back: of two sweeps writing it at once, the later one's)
    return int(kept)


def _check_minimizes(study: "optuna.Study", field: str) -> None:
    """A sweep tells its study each trial's validation loss, one number to minimize: a study of other directions
    (found in `storage`, or given) is a named error before any adapter trains."""
    import optuna

    if list(study.directions) != [optuna.study.StudyDirection.MINIMIZE]:
        names = [d.name.lower() for d in study.directions]
        raise ValueError(f"OptunaSweep: {field} is a study of direction(s) {names}; a sweep minimizes one value, the "
                         f"validation loss: give a study made with direction='minimize' (or another `study_name`)")


def _storage_name(study: "optuna.Study") -> str:
    """Where ``study`` is kept, in words: an RDB storage's URL, else its storage's class."""
    storage = getattr(study, "_storage", None)
    storage = getattr(storage, "_backend", storage)  # (Optuna's cached RDB storage wraps the RDB one)
    url = getattr(storage, "url", None)
    if not isinstance(url, str):
        return f"a {type(storage).__name__}"
    try:  # (a database's password is neither kept in a checkpoint nor printed)
        from sqlalchemy.engine import make_url

        url = make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - (a URL it cannot read: its scheme alone)
        url = url.split("://", 1)[0] + "://..."
    return f"storage {url!r}"


def _check_choices(study: "optuna.Study", distributions: Mapping[str, Any]) -> None:
    """A parameter of the search space of another kind than the study's trials hold (a float searched as categorical),
    or a categorical one whose choices differ from theirs, is a named error as the study opens (Optuna refuses them
    at the first ask, "Cannot set different distribution kind" / "CategoricalDistribution does not support dynamic
    value space", and left a trial failed in the study each time)."""
    import optuna

    categorical = optuna.distributions.CategoricalDistribution
    seen: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        for name, dist in trial.distributions.items():
            seen.setdefault(name, dist)
    for name, dist in seen.items():
        mine = distributions.get(name)
        if mine is not None and type(mine) is not type(dist):
            raise UsageError(f"OptunaSweep `search_space` {name!r}: of type {type(mine).__name__}, and study "
                             f"{study.study_name!r} holds trials where it is of type {type(dist).__name__} ({dist}; "
                             "Optuna keeps a parameter's kind): search it as the study did, or give another "
                             "`study_name` (or `storage`)")
        if mine is not None and not isinstance(mine, categorical):  # (a float's `log` or a step of another kind)
            try:
                optuna.distributions.check_distribution_compatibility(dist, mine)
            except ValueError as err:
                raise UsageError(f"OptunaSweep `search_space` {name!r}: {mine}, and study {study.study_name!r} holds "
                                 f"trials of {dist}: {err} (search it as the study did, or give another `study_name`"
                                 " or `storage`)") from None
        if isinstance(mine, categorical) and isinstance(dist, categorical) and mine.choices != dist.choices:
            raise UsageError(f"OptunaSweep `search_space` {name!r}: choices {list(mine.choices)}, and study "
                             f"{study.study_name!r} holds trials of choices {list(dist.choices)} (Optuna keeps a "
                             "categorical parameter's choices): give the study's choices, or another `study_name` "
                             "(or `storage`)")


def _resuming_checkpoint(trainer: Optional[L.Trainer], stopped: bool) -> Optional[str]:
    """A checkpoint from which a resumed sweep takes up this run's unfinished trials (those asked after it as well,
    `OptunaSweep._next_orphan`): one its checkpoint callbacks saved, or, for a fit ``stopped`` by an exception, the
    one an `OnExceptionCheckpoint` saves (its hook runs after this sweep's: Lightning calls checkpoint callbacks
    last); else the checkpoint the run resumed from, or Lightning's SLURM checkpoint in ``default_root_dir`` (a
    requeued job resumes from it). None: no checkpoint can resume them."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    callbacks = getattr(trainer, "checkpoint_callbacks", None) or []
    saved = [p for cb in callbacks for p in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""))]
    saved += [cb.ckpt_path for cb in callbacks if stopped and isinstance(cb, OnExceptionCheckpoint)]
    # (a ModelCheckpoint(save_on_exception=True) saves after this sweep's hook, as an OnExceptionCheckpoint does)
    saved += [f"{cb.dirpath or 'its folder'} (ModelCheckpoint saves on the exception)" for cb in callbacks
              if stopped and getattr(cb, "save_on_exception", False) and trainer is not None
              and not trainer.sanity_checking and not trainer.fast_dev_run]  # (when it saves none)
    saved.append(getattr(trainer, "ckpt_path", None))
    if not any(saved):
        saved.append(getattr(getattr(trainer, "_checkpoint_connector", None), "_hpc_resume_path", None))
    return next((str(p) for p in saved if p), None)


class OptunaSweep(Callback):
    """Fills free adapter slots with trials asked from an Optuna study (ask/tell), many trials per run. One a Trainer
    (Lightning refuses a second, "more than one stateful callback": its state is kept under the class's name; for one
    study a data source, run one fit a study).

    Args:
        search_space: AdapterSpec field -> ``{"type": "float"|"int"|"categorical", ...}``, or an Optuna distribution
            (``FloatDistribution``, ``IntDistribution``, ``CategoricalDistribution``; kept in the dict form).
        n_trials: trials this sweep asks in all (across resumes; a resume given fewer tells FAIL the trials its run
            asked after the checkpoint past them, with a warning).
        study: an Optuna study; else one is created or loaded from ``storage`` / ``study_name``.
        storage: any Optuna storage URL (an RDB for several processes); default an SQLite file
            ``optuna.db`` in the run's log directory.
        study_name: the study's name in the storage.
        sampler: ``"tpe"``, ``"random"`` or ``"grid"`` (a grid over the categorical choices) for a new study (a
            ``study`` given keeps its own: any Optuna sampler, CMA-ES or a ``GridSampler`` among them).
        base: AdapterSpec fields shared by every trial (``max_steps``, ``dataset``...).
        alpha_over_rank: alpha = this * rank unless ``alpha`` is searched or given in ``base`` (ALTO: 2).
        slots: trials kept running or queued at once (default: as many as the module's ``admission``
            controller says fit, plus one waiting; else the module's ``max_running``, else 4).
        seed: the sampler's seed (None: Optuna's random one); TPE and random asks are seeded with this and the
            trial's number in the study (which the study gives once, whichever process asks), so a resumed run asks
            what the uninterrupted one did, and a second run on the same study, or another process sharing it, asks
            new configurations. A grid's points are shuffled with the seed of the first sweep that made the study
            (kept in the study), so that sweeps sharing it, whatever their seeds, ask each point once. A ``study``
            given keeps its own sampler: seed that one (a ``seed`` other than 0 beside it is refused).
        heartbeat_interval: seconds; with a storage URL, the study is opened with Optuna's heartbeat
            (``RDBStorage(url, heartbeat_interval=..., grace_period=...)``). The sweep records a heartbeat for each
            of its running trials at most this often, and then fails the study's trials whose heartbeat is older
            than ``grace_period``: those of a run that was killed (``optuna.storages.fail_stale_trials``, as
            ``study.optimize`` does). A sweep resumed from its checkpoint beats its own trials first and keeps
            them, unless another process sharing the study failed them while the sweep was down for longer than
            the grace period (their adapters then train on, unreported, with a warning). A ``study`` given with a
            heartbeat storage is treated alike.
        grace_period: seconds without a heartbeat after which a running trial counts as stale (default: Optuna's,
            twice ``heartbeat_interval``). Make it longer than a step and a validation: another process sharing the
            study would fail the trials of a sweep that does not beat for that long. Each process judges the others'
            trials by its own grace period: give every process sharing a study the same two values (one of a
            shorter grace period fails the live trials of one that beats less often).
        pruner: the pruner of the study this sweep makes: ``"median"``, ``"percentile"`` (the 25th), ``"hyperband"``,
            ``"successive_halving"`` (Optuna's, with their defaults) or an ``optuna.pruners.BasePruner``; None: none.
            A ``study`` given keeps its own (Optuna's default: a ``MedianPruner``). After each validation the sweep
            asks it of every trial whose adapter reported a new value (``trial.should_prune()``, as Optuna's
            Lightning callback does); a trial it prunes is exported and told PRUNED.

    Each adapter is named ``trial-<number>`` (the trial's user attribute ``adapter``; ``adapter_spec`` holds every
    field it trains with, ``adapter_exit`` how it ended, its export and the validation loss of the weights exported
    (``export_loss``, where measured: a pruned trial's value is its last report, its export may be better), and for
    DPO its ``val_preference_accuracy``: of the weights the trial's value is of); its validation losses are reported as
    intermediate values at its own steps (those after step 0: a pruner compares trials at equal steps, so trials
    started, or resumed after a warmup pause, between two validations meet only those of their steps, as is said once:
    keep ``max_steps`` a multiple of the Trainer's ``val_check_interval``); a divergence exit or warmup pruning is told
    PRUNED; a finished adapter, or one stopped for overfitting, COMPLETE with the validation loss of the weights it
    exports (its best where best weights are kept, EarlyExit's default; else its last); a failure FAIL (a trial whose
    data cannot train, a misspelled ``dataset``, too: before the first step it also stops the run). An exhausted grid
    ends the sweep cleanly. A resumed run keeps its trials' numbers, and takes up the trials its earlier run asked after
    the checkpoint and left RUNNING (a crash), in place of asking them again; those it asked after the checkpoint and
    already told COMPLETE, PRUNED or FAIL (their adapters exited, and exported, before the crash) count as asked and
    are not trained again. The trials a fit stopped by Ctrl+C or an error leaves unfinished stay RUNNING where a
    checkpoint can resume them (one the run saved, or the one it resumed from), else are told FAIL (why in their
    ``fail_reason``, the export of what their adapters trained in ``adapter_exit``: under adapter parallelism, those
    rank 0 trained). Adapters given to the module may
    not take trial names. A sweep object given to the fit of another module asks its ``n_trials`` anew, as
    ``study.optimize`` called again does.

    Under `AdapterParallelStrategy` the study is used from rank 0 alone: it asks the trials and broadcasts them
    (with its bookkeeping), so every rank queues the same adapters in the same order and places them alike; it
    reports and tells from its registry, where every adapter's validation losses and exit arrive from the rank
    that trains it. An exit is told at the next fill of the slots (or at the end of training), before any new
    trial is asked, as a single process would.
    """

    carries_state = True  # (its state goes on into another fit of the module: `carried_callback_state`)

    def __init__(self, search_space: dict[str, dict[str, Any]], n_trials: int = 16,
                 study: Optional["optuna.Study"] = None, storage: Optional[str] = None,
                 study_name: str = "multilora", sampler: str = "tpe", base: Optional[dict[str, Any]] = None,
                 alpha_over_rank: Optional[float] = 2.0, slots: Optional[int] = None,
                 seed: Optional[int] = 0, heartbeat_interval: Optional[int] = None,
                 grace_period: Optional[int] = None, pruner: Optional[Any] = None) -> None:
        check_int("OptunaSweep", "n_trials", n_trials, 1)
        check_int("OptunaSweep", "slots", slots, 1, optional=True)
        check_int("OptunaSweep", "seed", seed, 0, optional=True)
        check_alpha_over_rank("OptunaSweep", alpha_over_rank)
        if not isinstance(search_space, Mapping) or not search_space:
            raise ValueError(f"OptunaSweep: `search_space` must be a non-empty mapping of AdapterSpec field -> "
                             f"parameter, got {search_space!r}")
        for name, value in (("heartbeat_interval", heartbeat_interval), ("grace_period", grace_period)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be an integer number of seconds >= 1 or None, got {value!r}")
        if grace_period is not None and heartbeat_interval is None:
            raise ValueError("`grace_period` needs `heartbeat_interval` (the heartbeat it is a grace period of)")
        if grace_period is not None and grace_period <= heartbeat_interval:
            raise ValueError(f"`grace_period` must be longer than `heartbeat_interval` ({heartbeat_interval} s), got "
                             f"{grace_period}: a live trial would look stale between two of its heartbeats")
        if heartbeat_interval is not None and storage is not None and not isinstance(storage, str):
            raise ValueError(f"`heartbeat_interval` opens `storage` as a URL (an RDB) with a heartbeat; got "
                             f"{type(storage).__name__} (pass the URL, or open the storage with its own heartbeat)")
        if study is not None and heartbeat_interval is not None:
            raise ValueError("`heartbeat_interval` opens a storage URL with a heartbeat; a `study` given keeps its "
                             "own storage (open it with RDBStorage(url, heartbeat_interval=...) instead)")
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self._last_beat = -math.inf
        self._opened = False  # the study's stale trials checked once this sweep opened it
        if study is not None and pruner is not None:
            raise ValueError("`pruner` is for the study the sweep makes; a `study` given keeps its own (make it with "
                             "optuna.create_study(..., pruner=...))")
        if study is not None and sampler != "tpe":  # (its default: a study given keeps its own sampler)
            raise ValueError(f"`sampler` {sampler!r} is for the study the sweep makes; a `study` given keeps its own "
                             "(make it with optuna.create_study(..., sampler=...))")
        if study is not None and seed not in (0, None):  # (its default, 0: said where another is given)
            raise ValueError(f"`seed` {seed!r} seeds the sampler of the study the sweep makes; a `study` given keeps "
                             "its own (make it with optuna.create_study(sampler=optuna.samplers.TPESampler("
                             f"seed={seed!r})))")
        self.pruner = _pruner(pruner)
        if not isinstance(sampler, str) or sampler not in ("tpe", "random", "grid"):
            made = "" if isinstance(sampler, str) else (
                f" (a {type(sampler).__name__} object: give a study made with it, `study=optuna.create_study("
                "sampler=..., direction='minimize')`, which keeps its own sampler)")
            raise ValueError(f"`sampler` can be tpe, random, grid, got {sampler!r}{made}")
        self.search_space = {name: as_parameter(name, spec) for name, spec in search_space.items()}
        self.base = dict(base or {})
        check_spec_fields(self.search_space, "OptunaSweep `search_space`")
        check_spec_fields(self.base, "OptunaSweep `base`")
        both = sorted(set(self.search_space) & set(self.base))
        if both:  # (the searched value replaced the base's, silently)
            raise ValueError(f"OptunaSweep: {both} in both `search_space` and `base`: each trial's value is searched, "
                             "so the base's would change nothing; give each field in one of them")
        self.distributions = distributions(self.search_space)
        if sampler == "grid":  # (checked here, not at the first ask: before a run starts)
            import optuna

            for name, dist in self.distributions.items():
                if not isinstance(dist, optuna.distributions.CategoricalDistribution):
                    raise ValueError(f"OptunaSweep: sampler 'grid' needs categorical parameters (a list of "
                                     f"`choices`); `search_space` {name!r} is {type(dist).__name__}")
        if not isinstance(study_name, str) or not study_name:
            raise ValueError(f"OptunaSweep: `study_name` must be a non-empty string (a resumed sweep finds its study "
                             f"by it), got {study_name!r}")
        self.n_trials, self.storage, self.study_name, self.sampler_name = int(n_trials), storage, study_name, sampler
        self.alpha_over_rank = alpha_over_rank  # (numpy integers as Python's: a seed's arithmetic must not wrap)
        self.slots, self.seed = (None if v is None else int(v) for v in (slots, seed))
        self._own_sampler = False
        joint = None  # every value of the space must make a valid AdapterSpec, with the others' and alone
        for name, dist in self.distributions.items():
            for value in (dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)):
                try:
                    with warnings.catch_warnings():  # (about the made-up "check": a trial that meets it is warned of)
                        warnings.simplefilter("ignore")
                        spec = AdapterSpec(name="check", **self._spec_kwargs(
                            {**{n: _example(d) for n, d in self.distributions.items()}, name: value}))
                except ValueError as err:  # (alone, it is this value's; else another's, said at its own turn)
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            spec = AdapterSpec(name="check", **self._spec_kwargs({name: value}))
                    except ValueError as own:  # (it named a made-up adapter "check", not the search space)
                        raise ValueError(f"OptunaSweep `search_space` {name!r}: its value {value!r} makes no valid "
                                         f"adapter{self._with_base(name, value)} ({_unnamed(own)})") from own
                    joint = joint or err
                    continue
                self._check_init_from(spec, name, value)
        if joint is not None:  # (each value valid alone: their combination is not)
            raise ValueError(f"OptunaSweep `search_space` {sorted(self.distributions)}: their values together make "
                             f"no valid adapter ({_unnamed(joint)})") from joint
        scale = sorted({"objective", "dataset", "dpo_beta"} & set(self.distributions))
        if "dpo_beta" in self.distributions and "objective" not in self.distributions \
                and self.base.get("objective", "sft") != "dpo":
            scale.remove("dpo_beta")  # (an SFT adapter has no beta: searching it searches nothing)
            warnings.warn("OptunaSweep `search_space` 'dpo_beta' applies to objective='dpo' alone, and every trial "
                          "here is SFT (`base` objective): the searched beta changes nothing; set "
                          "base={'objective': 'dpo', ...} for preference training", stacklevel=2)
        if scale:  # (each trial's value is its validation loss)
            warnings.warn(f"OptunaSweep `search_space` {scale}: a trial's value is its validation loss, whose scale "
                          "these change (SFT's cross-entropy against DPO's loss; another data source's loss; a larger "
                          "dpo_beta makes the same preferences' DPO loss smaller): the study then favours them for the "
                          "scale, not the adapter; compare DPO adapters of one beta, on their val_preference_accuracy "
                          "as well",
                          stacklevel=2)
        if study is not None:
            _check_minimizes(study, "`study`")
        self.study = study
        self._new_sweep()

    def _new_sweep(self) -> None:
        """No trial asked yet. A sweep object given to the fit of another module starts here again (its trials in
        the study as the last fit left them: an unfinished one goes on where that module resumes)."""
        self.trials: dict[str, dict[str, Any]] = {}  # adapter name -> trial id, number, reported steps, told
        # Tags this sweep's trials in the study (kept in checkpoints): a sweep resumed from a checkpoint finds the
        # trials it asked after that checkpoint and takes them up, or counts them where they were told (`_orphans`)
        self.sweep_id = uuid.uuid4().hex
        self._ran_in: Optional[str] = None  # (where a resumed sweep's study was kept: `_check_holds_trials`)
        self._orphans: Optional[list[Any]] = None
        self.asked = 0
        self.exhausted = False

    def _check_init_from(self, spec: AdapterSpec, name: str, value: Any) -> None:
        """A trial's `init_from` folder (where it is there now) holds its rank, alpha and rsLoRA: named as the
        searched value where that sets them, else as ``base``'s (alpha is `alpha_over_rank` x rank unless given)."""
        if not (spec.init_from and Path(spec.init_from).is_dir()):
            return
        try:
            with warnings.catch_warnings():  # (the trial's own adapter says them when it starts, by its name)
                warnings.simplefilter("ignore")
                init_from_config(spec)
        except ValueError as err:
            text = str(err).replace(f"adapter {'check'!r}: ", "")
            if "alpha=" in text and "alpha" not in self.base and "alpha" not in self.distributions:
                text += (f" (alpha is alpha_over_rank={self.alpha_over_rank} x rank where neither `base` nor the "
                         "space gives it)")
            if name in ("rank", "alpha", "use_rslora", "init_from", "alpha_over_rank"):
                raise ValueError(f"OptunaSweep `search_space` {name!r}: its value {value!r} makes no valid adapter "
                                 f"({text})") from None
            raise ValueError(f"OptunaSweep `base`: {text}") from None

    # -- study ----------------------------------------------------------------------------------

    def _sampler(self, ask: int = 0, study: Optional["optuna.Study"] = None):
        """The sampler of the study this sweep makes, for the trial numbered ``ask`` in the study: its seed is
        ``seed``'s and that number's. A trial therefore draws as the same trial of an uninterrupted run does after a
        resume from a checkpoint, and a second run against the study (a script run again), or another process
        sharing it, draws new configurations: a study numbers its trials once, whichever process asks them. (A grid
        keeps one sampler: its seed, the study's (`_grid_seed`), shuffles the grid's points, which it numbers in
        that order, and it asks the points no trial has.)"""
        import optuna

        seed = None if self.seed is None else (self.seed * 1_000_003 + ask) % 2**32
        if self.sampler_name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self.sampler_name == "grid":
            grid = {}
            for name, dist in self.distributions.items():
                grid[name] = list(dist.choices)
            return optuna.samplers.GridSampler(grid, seed=seed if study is None else _grid_seed(study, seed))
        return optuna.samplers.TPESampler(seed=seed)

    def _ensure_study(self, trainer: L.Trainer) -> "optuna.Study":
        if self.study is None:
            if getattr(self, "_storage_from_checkpoint", False):
                self.storage = _resumed_storage(self.storage, getattr(trainer, "ckpt_path", None), self.study_name,
                                                self.sweep_id)
            storage, default = self.storage, None
            if storage is None:
                root = Path(log_dir_of(trainer))
                root.mkdir(parents=True, exist_ok=True)
                default = (root / "optuna.db").resolve()
                storage = self.storage = f"sqlite:///{default}"
                default = default if default.exists() else None  # (another run's, where it is there already)
            self.study = _open_study(storage, self.study_name, self._sampler(), self.heartbeat_interval,
                                     self.grace_period, self.pruner)
            _check_minimizes(self.study, f"`study_name` {self.study_name!r} in `storage` {storage!r}")
            others = default and [t for t in self.study.get_trials(deepcopy=False)
                                  if t.user_attrs.get("sweep") != self.sweep_id]
            if others:  # (a study given in `storage` is shared on purpose; the run folder's own was not)
                warnings.warn(f"OptunaSweep: the log directory's {default} holds another run's {len(others)} trials "
                              f"in study {self.study_name!r}; this sweep goes on with that study (give each run its "
                              "own `default_root_dir` or a logger that versions its runs, or name a `storage`; "
                              "`multilora fit` refuses this)")
            self._own_sampler = True  # (a study given by the user keeps its own sampler)
            if self.sampler_name == "grid":  # (its points in the order of the study's first sweep)
                self.study.sampler = self._sampler(study=self.study)
        if not self._opened:
            self._opened = True
            _check_choices(self.study, self.distributions)
            self._check_holds_trials(self.study)
            self._find_orphans(self.study)  # before the stale trials are failed: they are this sweep's, alive
            self._beat(force=True)  # a resumed sweep's trials are alive, however long it was stopped
        return self.study

    def _check_holds_trials(self, study: "optuna.Study") -> None:
        """A resumed sweep's study holds its trials (by number, asked by this sweep); a study opened elsewhere (a
        relative SQLite path from another directory, a study given at first and not again, another storage) is a
        named error before any step: its trials were retrained and then failed unknown ("Record does not exist"), or
        were told into another study's trials of the same numbers, silently."""
        if not self.trials:
            return
        mine = {t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("sweep") == self.sweep_id}
        missing = sorted(info["number"] for info in self.trials.values() if info["number"] not in mine)
        if missing:
            where = self._ran_in or "a storage not recorded"
            raise UsageError(f"OptunaSweep: this checkpoint's sweep asked trials {missing} in study "
                             f"{self.study_name!r} of {where}, and the study opened now ({_storage_name(study)}) "
                             "does not hold them: give that storage again (`storage=`, an absolute path for SQLite; "
                             "or the same `study=`)")

    def _beats(self) -> bool:
        """The study's storage takes heartbeats (Optuna's RDBStorage with ``heartbeat_interval``)."""
        from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

        storage = getattr(self.study, "_storage", None)
        return isinstance(storage, BaseHeartbeat) and is_heartbeat_enabled(storage)

    def _beat(self, force: bool = False) -> None:
        """At most once per heartbeat interval: a heartbeat for each trial of this sweep not told yet, then the
        study's stale trials failed (another run's, killed for good: `fail_stale_trials`, as ``study.optimize`` does
        before each trial)."""
        import time

        import optuna

        if self.study is None or not self._beats():
            return
        storage = self.study._storage
        now = time.monotonic()
        if not force and now - self._last_beat < storage.get_heartbeat_interval():
            return
        self._last_beat = now
        for info in self.trials.values():
            if not info["told"] and not info.get("lost"):
                storage.record_heartbeat(info["trial_id"])
        for orphan in self._orphans or ():  # taken up as slots free (`_next_orphan`)
            if orphan.state == optuna.trial.TrialState.RUNNING:
                storage.record_heartbeat(orphan._trial_id)
        with warnings.catch_warnings():  # (Optuna marks it experimental)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def _with_base(self, name: str, value: Any) -> str:
        """" with `base` {...}" where ``value`` makes a valid adapter without the sweep's ``base``: the error is then
        their conflict (a searched `max_epochs` beside a `base` `max_steps`), which the searched name alone hid."""
        if not self.base:
            return ""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                AdapterSpec(name="check", **without_unused_beta({name: value, **(
                    {"objective": "dpo"} if name == "dpo_beta" else {})}))
        except (ValueError, TypeError):
            return ""
        return f" with `base` {self.base!r}"

    def _spec_kwargs(self, params: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(self.base)
        kwargs.update(params)
        rank = kwargs.get("rank", AdapterSpec.rank)
        if "alpha" not in kwargs and self.alpha_over_rank is not None and isinstance(rank, numbers.Integral) \
                and not isinstance(rank, bool):  # (an alpha given in `base` is kept; a bad rank is AdapterSpec's error)
            kwargs["alpha"] = float(self.alpha_over_rank * rank)
        return without_unused_beta(kwargs)

    def _grid_exhausted(self, study) -> bool:
        """Every point of the study's grid (this sweep's, or a ``GridSampler`` of the ``study`` given, whatever its
        search space) has a trial, running ones included: Optuna's own check counts finished trials only, and would
        hand out running points again. Trials that are not the grid's (a study's earlier random ones, enqueued ones)
        take no point."""
        import optuna

        sampler = study.sampler
        if not isinstance(sampler, optuna.samplers.GridSampler):
            return False
        taken = {t.system_attrs["grid_id"] for t in study.get_trials(deepcopy=False)
                 if "grid_id" in t.system_attrs and t.state in (optuna.trial.TrialState.RUNNING,
                                                                optuna.trial.TrialState.COMPLETE,
                                                                optuna.trial.TrialState.PRUNED,
                                                                optuna.trial.TrialState.FAIL)
                 and sampler._same_search_space(t.system_attrs.get("search_space", {}))}
        return len(taken) >= len(sampler._all_grids)

    def _grid_point_taken(self, study, trial: "optuna.Trial") -> Optional[int]:
        """The number of another trial holding the grid point ``trial`` was just given (a grid study shared by
        processes: two saw one point free, and Optuna's sampler handed the second a point already running), or None.
        Points are asked each once (`_grid_exhausted`)."""
        import optuna

        sampler = study.sampler
        if not isinstance(sampler, optuna.samplers.GridSampler):
            return None
        point = study._storage.get_trial(trial._trial_id).system_attrs.get("grid_id")
        return next((t.number for t in study.get_trials(deepcopy=False)
                     if t.number != trial.number and point is not None and t.system_attrs.get("grid_id") == point
                     and sampler._same_search_space(t.system_attrs.get("search_space", {}))), None)

    def _ask_trial(self, study) -> "optuna.Trial":
        """``study.ask`` over the search space. One that fails (an enqueued value outside a parameter's choices or
        range, a parameter the study's earlier trials drew from another kind of distribution) fails its trial,
        which Optuna left RUNNING, and names the parameter."""
        import optuna

        with warnings.catch_warnings():  # (heartbeats are recorded here, outside study.optimize: `_beat`)
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
            trial = study.ask()  # (then its parameters, as `study.ask(distributions)` draws them: this trial's alone
            # is told FAIL where one is refused, not another process's asked meanwhile)
            if self._own_sampler and self.sampler_name != "grid":  # (a grid's seed orders its points: kept)
                study.sampler = self._sampler(trial.number)  # (seeded by its number, which no other trial has)
            try:
                for name, dist in self.distributions.items():
                    trial._suggest(name, dist)
            except (ValueError, TypeError) as err:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                names = self._refused_parameters(study, study._storage.get_trial(trial._trial_id))
                raise ValueError(f"OptunaSweep: the study could not ask trial {trial.number}"
                                 f"{f' (parameter {names[0]!r})' if len(names) == 1 else ''}: {err}; it is told FAIL. "
                                 "An enqueued trial must hold values of the search space, and a parameter the study's "
                                 "earlier trials drew must keep its kind of distribution (search space: "
                                 f"{sorted(self.distributions)})") from err
        fixed = study._storage.get_trial(trial._trial_id).system_attrs.get("fixed_params") or {}
        unused = sorted(set(fixed) - set(self.distributions))
        if unused:  # (Optuna keeps an enqueued value only as a parameter is drawn: one out of the space, dropped)
            warnings.warn(f"OptunaSweep: trial {trial.number} was enqueued with {unused}, which the search space "
                          f"({sorted(self.distributions)}) does not hold: not used (its adapter takes `base`'s "
                          "values and the defaults); give a field fixed for every trial in `base`", stacklevel=2)
        return trial

    def _refused_parameters(self, study, trial: "optuna.trial.FrozenTrial") -> list[str]:
        """The parameters of the search space a failed ask stumbled on: a value enqueued in ``trial`` that its
        distribution does not hold, or a distribution of another kind than the study's earlier trials drew."""
        from optuna.distributions import check_distribution_compatibility

        names = []
        fixed = trial.system_attrs.get("fixed_params", {})
        for name, dist in self.distributions.items():
            if name in fixed:
                try:
                    if not dist._contains(dist.to_internal_repr(fixed[name])):
                        names.append(name)
                        continue
                except (ValueError, TypeError):
                    names.append(name)
                    continue
            for earlier in study.get_trials(deepcopy=False):
                if name in earlier.distributions:
                    try:
                        check_distribution_compatibility(earlier.distributions[name], dist)
                    except ValueError:
                        names.append(name)
                    break
        return names

    def _fill(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Queue asked trials for the free slots; under adapter parallelism rank 0 asks, every rank queues."""
        def ask() -> dict[str, Any]:
            try:
                return self._ask(trainer, pl_module)
            except ValueError:  # (a trial that cannot train: the run stops)
                self._fail_unstarted_if_first_step(pl_module)
                raise

        self._adopt(pl_module, decide_once(pl_module, ask))

    def _ask(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """On the deciding process: tell the exits not told yet, then ask trials while there is room (queueing
        them here). Returns what the other ranks need to queue the same adapters (`_adopt`)."""
        import optuna

        study = self._ensure_study(trainer)
        self._tell_exits(pl_module)
        retold = self._take_told_since(pl_module)
        registry = pl_module.registry
        # paused adapters (waiting for warmup selection) have freed their slots (their memory still counts)
        active = [n for n, t in self.trials.items() if not t["told"] and registry[n].state in
                  (AdapterState.RUNNING, AdapterState.QUEUED)]
        if self.slots is None and getattr(pl_module, "admission", None) is not None:
            # the module's memory model decides (every rank's): ask trials until one would have to wait in the queue
            def room() -> bool:  # (with nothing running or queued, one trial: paused adapters never block all)
                queued = [r.spec for r in registry.queued]
                if not queued and not registry.running:
                    return True
                cap = getattr(pl_module, "max_running", None)  # (which caps the count beside the budget: past it,
                if cap is not None and len(registry.running) + len(queued) >= cap:  # the trials asked waited, RUNNING
                    return False  # in the study, a sampler asking blind)
                return len(pl_module.admitted(pl_module._resident(), queued)) == len(queued)
        else:
            slots = self.slots or getattr(pl_module, "max_running", None) or 4

            def room() -> bool:
                return len(active) < slots
        specs: list[AdapterSpec] = []
        told: list[dict[str, Any]] = []  # records of the trials told after the checkpoint this run resumed from
        while room() and self.asked < self.n_trials and not self.exhausted:
            orphan = self._next_orphan(study)
            if orphan is None and self._grid_exhausted(study):
                self.exhausted = True
                break
            if orphan is not None and orphan.state.is_finished():  # asked and told after the checkpoint: counted
                self.trials[f"trial-{orphan.number}"] = {"trial_id": orphan._trial_id, "number": orphan.number,
                                                         "reported": [], "told": True}
                self.asked += 1
                if orphan.user_attrs.get("adapter"):  # (one that never became an adapter is in no registry)
                    told.append(self._told_record(pl_module, orphan))
                continue
            if orphan is not None:  # asked after the checkpoint this run resumed from: taken up, not asked again
                trial = optuna.Trial(study, orphan._trial_id)
            else:
                trial = self._ask_trial(study)
                trial.set_user_attr("sweep", self.sweep_id)
                other = self._grid_point_taken(study, trial)
                if other is not None:  # (a point another process asked since `_grid_exhausted`, or one two asked
                    # at once from a stale read: failed, and another asked while the grid has points)
                    study._storage.set_trial_user_attr(trial._trial_id, "fail_reason", f"its grid point is trial "
                                                       f"{other}'s, asked meanwhile by another process")
                    self._fail_asked(trial)
                    continue
            name = f"trial-{trial.number}"
            try:
                spec = AdapterSpec(name=name, **self._spec_kwargs(trial.params))
            except ValueError as err:
                self._fail_asked(trial)
                raise ValueError(f"trial {trial.number} with {trial.params}: {err}") from err
            admission = getattr(pl_module, "admission", None)
            if admission is not None and not admission.fits([spec]):  # it would wait in the queue forever
                self._fail_asked(trial)
                warnings.warn(f"trial {trial.number} with {trial.params} failed: {admission.alone(spec)}, so it can "
                              "never start")
                continue
            try:  # its data and `init_from` folder first: a misspelled `dataset` in `base` or the space, a folder
                pl_module.check_startable(spec)  # that does not fit, fails the trial, not the step
                pl_module.add_adapter(spec)
            except ValueError as err:
                self._fail_asked(trial)
                if pl_module._global_step() == 0:  # (the run stops before its first step, as with an adapter given)
                    raise UsageError(f"trial {trial.number} with {trial.params} cannot train: {err}") from err
                warnings.warn(f"trial {trial.number} with {trial.params} failed: {err}")
                continue
            trial.set_user_attr("adapter", name)
            # every field it trains with, those `base` and `alpha_over_rank` set too (the params hold the searched ones)
            trial.set_user_attr("adapter_spec", {k: v for k, v in spec.to_dict().items() if k != "name"})
            # (a trial taken up keeps the values its crashed run reported: Optuna keeps one a step, and warns)
            reported = sorted(orphan.intermediate_values) if orphan is not None else []
            self.trials[name] = {"trial_id": trial._trial_id, "number": trial.number, "reported": reported,
                                 "told": False}
            if self._beats():
                self.study._storage.record_heartbeat(trial._trial_id)
            self.asked += 1
            active.append(name)
            specs.append(spec)
        if self.asked >= self.n_trials:
            self._fail_orphans_beyond_n_trials()
        return {"specs": specs, "state": self.state_dict(), "told": told, "retold": retold}

    def _take_told_since(self, pl_module: L.LightningModule) -> list[dict[str, Any]]:
        """The trials the checkpoint this run resumed from holds untold, which the run that wrote it went on to
        tell (COMPLETE, PRUNED, or FAIL by this sweep) before it stopped: counted as told, their adapters not trained
        again; the records (`_told_record`) that replace theirs (`_adopt`). Trained again, one pruned after the
        checkpoint was judged anew (a pruner that saw the trials told since: another decision), its export written
        over by weights the study does not describe, and its reports refused as if another process had failed it."""
        records, numbers = [], []
        for trial in self.__dict__.pop("_told_since", None) or ():
            name = f"trial-{trial.number}"
            self.trials[name]["told"] = True
            if name in pl_module.registry and not pl_module.registry[name].state.exited:
                records.append(self._told_record(pl_module, trial, held=pl_module.registry[name]))
                pl_module._replace_with_record(AdapterRecord.from_state_dict(records[-1]))  # (its slot free now)
                numbers.append(f"{trial.number} ({trial.state.name})")
        if numbers:
            warnings.warn(f"OptunaSweep: trials {', '.join(numbers)} were told in study {self.study.study_name!r} "
                          "after the checkpoint this run resumed from, by the run that wrote it: their adapters are "
                          "not trained again, and what they exported stands as the study describes it")
        return records

    def _told_record(self, pl_module: L.LightningModule, trial: Any,
                     held: Optional[AdapterRecord] = None) -> dict[str, Any]:
        """The registry record (its state dict) of a trial told before the run resumed, from what the study holds:
        its adapter trained, exported and exited after the checkpoint, so the registry restored lacks it, and the
        run's report would (`SweepReport`). ``held``: the checkpoint's record of it (`_take_told_since`), which
        keeps what it says up to the checkpoint (its spec, spans, losses), the study's end put on it."""
        import copy

        name = f"trial-{trial.number}"
        if held is not None:
            rec, at = copy.deepcopy(held), pl_module._run_step()  # (the checkpoint's run step)
            studied = sorted((int(k), float(v)) for k, v in trial.intermediate_values.items())
            validated = max((step for step, _ in held.val_losses), default=-1)  # (reported after the checkpoint:)
            later = [(step, loss) for step, loss in studied if step > validated]
            rec.val_losses = [*rec.val_losses, *later]
            for step, loss in later:
                if loss < rec.best_val_loss:
                    rec.best_val_step, rec.best_val_loss = step, loss
            if later:
                rec.last_val_loss = later[-1][1]
            ended = trial.user_attrs.get("adapter_exit") or {}
            went = int(ended.get("step", held.step)) - held.step if held.state == AdapterState.RUNNING else 0
            rec.ended_at_step = at + max(0, went)  # (a running adapter steps with the run: as it went on there)
            rec.close_span(rec.ended_at_step)
            return self._told_end(rec, trial)
        rec = AdapterRecord(AdapterSpec(name=name, **self._spec_kwargs(trial.params)))
        rec.val_losses = sorted((int(k), float(v)) for k, v in trial.intermediate_values.items())
        if rec.val_losses:
            rec.step, rec.last_val_loss = rec.val_losses[-1]
            rec.best_val_step, rec.best_val_loss = min(rec.val_losses, key=lambda sv: sv[1])
        return self._told_end(rec, trial)

    def _told_end(self, rec: AdapterRecord, trial: Any) -> dict[str, Any]:
        """`_told_record`'s ``rec`` with how the study says it ended: its state and why, its step, its export."""
        import optuna

        ended = trial.user_attrs.get("adapter_exit") or {}  # (`_conclude`; absent where it was told otherwise)
        rec.state = AdapterState(ended["state"]) if "state" in ended else {
            optuna.trial.TrialState.COMPLETE: AdapterState.FINISHED,
            optuna.trial.TrialState.PRUNED: AdapterState.PRUNED}.get(trial.state, AdapterState.FAILED)
        why = ended.get("reason") or trial.user_attrs.get("fail_reason") or rec.state.value  # (`_fail`'s)
        rec.reason = (f"{why} (told {trial.state.name} in study {self.study.study_name!r} after the checkpoint this "
                      "run resumed from)")
        if trial.value is not None:  # (the validation loss of the weights its export holds)
            rec.best_val_loss = min(rec.best_val_loss, trial.value)
        rec.step = int(ended.get("step", rec.step))
        rec.export_path = ended.get("export_path")
        if rec.export_path is not None and ended.get("exported_step") is not None:  # what its export holds, as the
            # run that exported it reported it (a study written before the step was kept: its best or last, as before)
            rec.exported_step = ended["exported_step"]
            rec.exported_val_loss = float(ended.get("export_loss", math.nan))
            rec.exported_val_preference_accuracy = float(ended.get("val_preference_accuracy", math.nan))
        return rec.state_dict()

    def _fail(self, trial_id: int, number: int, reason: str, rec: Optional[AdapterRecord] = None) -> None:
        """Tell trial ``number`` FAIL, with why in its user attribute ``fail_reason`` (as ``adapter_exit`` says how
        the adapter of a trial told otherwise ended; where its adapter ``rec`` was exported, ``adapter_exit`` too)."""
        import optuna

        try:
            for key, value in _fail_attrs(reason, rec).items():
                self.study._storage.set_trial_user_attr(trial_id, key, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # finished by another process meanwhile (`_lost`)
        self._tell(number, state=optuna.trial.TrialState.FAIL)

    def _fail_orphans_beyond_n_trials(self) -> None:
        """The trials the resumed run asked after its checkpoint and left RUNNING (`_next_orphan`) that this sweep
        does not reach: it has asked its ``n_trials`` (lowered for the resume) before them. They stayed RUNNING for
        ever, unsaid; they are told FAIL, with a warning. (Not taken up past ``n_trials``: the resume goes back to the
        checkpoint, before they were asked, and what their adapters trained after it is lost: running them would be
        running more trials than asked for.)"""
        import optuna

        left = [t for t in self._orphans or () if t.state == optuna.trial.TrialState.RUNNING]
        if not left:
            return
        self._orphans = [t for t in self._orphans if t.state != optuna.trial.TrialState.RUNNING]
        for trial in left:
            self._fail(trial._trial_id, trial.number, f"asked after the checkpoint a run resumed from with "
                       f"n_trials={self.n_trials}, past those: not taken up")
        warnings.warn(f"OptunaSweep: trials {[t.number for t in left]} were asked after the checkpoint this run "
                      f"resumed from, and this sweep has asked its n_trials={self.n_trials} before them: told FAIL in "
                      f"study {self.study.study_name!r}, not trained (`n_trials` counts a sweep's trials across its "
                      "resumes)")

    def _fail_asked(self, trial: Any) -> None:
        """Tell a trial FAIL as it is asked (it could never start): it counts as asked, and is known by number (a
        resumed sweep must not count it again among the FAIL trials it finds, `_find_orphans`)."""
        import optuna

        self._tell(trial.number, state=optuna.trial.TrialState.FAIL)
        self.trials[f"trial-{trial.number}"] = {"trial_id": trial._trial_id, "number": trial.number, "reported": [],
                                                "told": True}
        self.asked += 1

    def _fail_unstarted_if_first_step(self, pl_module: L.LightningModule) -> None:
        """Before the run stops at its first step (an error raised while asking): the trials asked before the one
        that failed never trained and no checkpoint holds them, so they are told FAIL too (they stayed RUNNING)."""
        import optuna

        if pl_module._global_step() != 0:
            return  # (later, a checkpoint holds them: a resumed sweep takes them up)
        for info in self.trials.values():
            if not info["told"]:
                self._tell(info["number"], state=optuna.trial.TrialState.FAIL)
                info["told"] = True

    def _next_orphan(self, study) -> Optional[Any]:
        """The first of this sweep's trials that the study holds and this sweep does not know: asked after the
        checkpoint a resumed run started from. Each RUNNING one (its adapter lost in a crash) is taken up in place
        of an ask, in order, with its parameters (those the same ask draws again: `_sampler`); a COMPLETE, PRUNED
        or (told by this sweep) FAIL one (told before the crash) counts as an ask. So no trial is left RUNNING, asked
        twice or trained twice (those past a lowered ``n_trials``: told FAIL, `_fail_orphans_beyond_n_trials`)."""
        if self._orphans is None:
            self._find_orphans(study)
        return self._orphans.pop(0) if self._orphans else None

    def _find_orphans(self, study) -> None:
        """`_next_orphan`'s trials, looked up once, when this sweep opens the study (a resume: its own state is the
        checkpoint's by then)."""
        import optuna

        known = {t["number"] for t in self.trials.values()}
        # (FAIL only where this sweep told it, `_tell`: another process sharing the study may have failed a RUNNING
        # one as stale while this run was down, before its adapter trained; its configuration is asked again)
        states = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                  optuna.trial.TrialState.FAIL)
        mine = sorted((t for t in study.get_trials(deepcopy=False, states=states)
                       if t.user_attrs.get("sweep") == self.sweep_id and (
                           t.state != optuna.trial.TrialState.FAIL or t.user_attrs.get("failed_by") == self.sweep_id)),
                      key=lambda t: t.number)
        self._orphans = [t for t in mine if t.number not in known]
        # (trials the checkpoint holds untold that the run which wrote it went on to tell: `_take_told_since`)
        untold = {info["number"] for info in self.trials.values() if not info["told"]}
        self._told_since = [t for t in mine if t.number in untold and t.state.is_finished()]

    def _adopt(self, pl_module: L.LightningModule, decision: dict[str, Any]) -> None:
        """Apply the deciding process's trials and bookkeeping here (a no-op where they were decided): every
        rank's registry and sweep state stay the same, checkpoints included."""
        self.load_state_dict(decision["state"])
        for state in decision.get("retold", ()):  # (held by the checkpoint, told since: `_take_told_since`)
            if not pl_module.registry[state["spec"]["name"]].state.exited:  # (the deciding process's is replaced)
                pl_module._replace_with_record(AdapterRecord.from_state_dict(state))
        for state in decision.get("told", ()):
            if state["spec"]["name"] not in pl_module.registry:
                pl_module.registry.add_record(AdapterRecord.from_state_dict(state))
        for spec in decision["specs"]:
            if spec.name not in pl_module.registry:
                pl_module.add_adapter(spec)

    def _report(self, pl_module: L.LightningModule, prune: bool = False) -> dict[str, str]:
        """Report the trials' new validation losses; with ``prune``, ask the study's pruner of each trial whose
        adapter still trains (or waits, paused) and reported a value it has not been asked about (whichever call
        reported it: an exit in an earlier callback reports every trial's values). Returns those it prunes, with
        why."""
        import optuna

        pruned: dict[str, str] = {}
        if self.study is None or not decides_here(pl_module):
            return pruned  # under adapter parallelism rank 0 reports, for every rank
        self._warn_unaligned(pl_module)
        for name, info in self.trials.items():
            if info["told"] or info.get("lost"):
                continue
            rec = pl_module.registry[name]
            seen = info.setdefault("seen", list(info["reported"]))  # (adapter steps; "reported": the study's steps)
            # (at its own steps: a pruner compares trials at equal steps; step 0, untrained, says nothing of a trial)
            new = [(step, loss) for step, loss in rec.val_losses if step not in seen and step > 0
                   and math.isfinite(loss)]
            ask = (prune and rec.state in (AdapterState.RUNNING, AdapterState.PAUSED)
                   and not isinstance(self.study.pruner, optuna.pruners.NopPruner))  # (a storage read spared)
            # (a trial taken up on resume holds the values its crashed run reported past the checkpoint: the pruner,
            # which reads the study's last one, is asked once the adapter has validated that far again, not before)
            own = max((step for step, loss in rec.val_losses if step > 0 and math.isfinite(loss)), default=-1)

            def due() -> bool:
                last = max(info["reported"], default=-1)
                return ask and info.get("pruner_step", -1) < last <= own

            if not new and not due():
                continue  # a Trial handle reads the storage: ~1 ms each, for every trial at every step otherwise
            if prune and new:
                self._warn_off_grid(pl_module, rec)
            trial = optuna.trial.Trial(self.study, info["trial_id"])
            stored = None  # (the study's own values of the trial, read once where one is to be reported)
            try:
                for step, loss in new:
                    seen.append(step)
                    if step not in info["reported"]:
                        if stored is None:
                            stored = trial.storage.get_trial(info["trial_id"]).intermediate_values
                        if step not in stored:  # (a resumed run's: reported after its checkpoint, by the first run)
                            trial.report(loss, step)
                        info["reported"].append(step)
            except optuna.exceptions.UpdateFinishedTrialError:
                self._lost(info, name)
                continue
            last = max(info["reported"], default=-1)
            if due():
                info["pruner_step"] = last  # (asked once a value)
                if trial.should_prune():
                    step, loss = max(((s, v) for s, v in rec.val_losses if s in seen), default=(last, math.nan))
                    pruned[name] = (f"pruned by the study's {type(self.study.pruner).__name__} at step {step} "
                                    f"(validation loss {loss:.4f})")
        return pruned

    def _warn_unaligned(self, pl_module: L.LightningModule) -> None:
        """Said once: the study's pruner compares trials at equal steps, and trials of a ``max_steps`` that is not a
        multiple of the Trainer's ``val_check_interval`` end between two validations; the trials started in their
        slots then validate at other steps than those started at a validation, and the pruner cannot compare
        them."""
        import optuna

        interval = _validation_interval(pl_module)
        if getattr(self, "_told_unaligned", False) or interval is None or self.study is None or isinstance(
                self.study.pruner, optuna.pruners.NopPruner):
            return
        self._told_unaligned = True
        lengths = [self.base["max_steps"]] if isinstance(self.base.get("max_steps"), int) else []
        dist = self.distributions.get("max_steps")
        if isinstance(dist, optuna.distributions.CategoricalDistribution):
            lengths += [v for v in dist.choices if isinstance(v, int)]
        elif isinstance(dist, optuna.distributions.IntDistribution):  # (all its values are multiples where these are)
            lengths += [dist.low] + ([dist.low + dist.step] if dist.high >= dist.low + dist.step else [])
        elif "max_steps" not in self.base and "max_epochs" not in self.base and "max_epochs" not in self.distributions:
            lengths.append(AdapterSpec(name="check").max_steps)  # (AdapterSpec's default length)
        off = sorted({n for n in lengths if n % interval})
        if off:
            self._told_off_grid = True  # (what `_warn_off_grid` would say, said before the first step)
            warnings.warn(f"OptunaSweep: the study's {type(self.study.pruner).__name__} compares trials at equal "
                          f"steps, and max_steps {off} is not a multiple of val_check_interval={interval}: a trial "
                          "started in the slot of one that ended between two validations validates at other steps "
                          "than the trials started at a validation, and the pruner cannot compare it with them "
                          "(it prunes it only beside trials of the same steps). Give max_steps in multiples of "
                          f"{interval} for every trial to be compared")

    def _warn_off_grid(self, pl_module: L.LightningModule, rec: AdapterRecord) -> None:
        """Said once: a trial validated by a periodic validation at a step of its own that is not a multiple of the
        interval (started, or resumed after a warmup pause, between two validations), which the study's pruner
        compares only with trials of the same steps."""
        import optuna

        interval = _validation_interval(pl_module)
        trainer = getattr(pl_module, "_trainer", None)
        if getattr(self, "_told_off_grid", False) or interval is None or trainer is None or isinstance(
                self.study.pruner, optuna.pruners.NopPruner) or trainer.global_step % interval or \
                rec.step % interval == 0:
            return
        self._told_off_grid = True
        start = rec.spans[-1][0] if rec.spans else None
        warnings.warn(f"OptunaSweep: trial {rec.name!r} validates at its step {rec.step}, not a multiple of "
                      f"val_check_interval={interval} (it {'resumed' if len(rec.spans) > 1 else 'started'} at step "
                      f"{start}, between two validations: after a trial that ended there, or a warmup pause); the "
                      f"study's {type(self.study.pruner).__name__} compares trials at equal steps, so it meets only "
                      "trials of the same steps (this is said once)")

    def on_adapter_exit(self, trainer: L.Trainer, pl_module: L.LightningModule, rec: AdapterRecord) -> None:
        """Tell the study how an adapter's trial ended (called by the module when an adapter leaves; under
        adapter parallelism only on the rank that trained it, so rank 0 tells it later, `_tell_exits`)."""
        if placement_of(pl_module) is None:
            self._conclude(pl_module, rec)

    def _tell_exits(self, pl_module: L.LightningModule) -> None:
        """Tell every exited adapter's trial not told yet (under adapter parallelism: the exits shared by the
        ranks since the last fill)."""
        for name, info in self.trials.items():
            if not info["told"] and name in pl_module.registry and pl_module.registry[name].state.exited:
                self._conclude(pl_module, pl_module.registry[name])

    def _conclude(self, pl_module: L.LightningModule, rec: AdapterRecord) -> None:
        """Report the trial's last validations, then tell COMPLETE (its best validation loss), PRUNED or FAIL."""
        import optuna

        info = self.trials.get(rec.name)
        if info is None or info["told"] or self.study is None:
            return
        self._report(pl_module)
        # the value describes the weights exported: the best-validation ones where they are kept (EarlyExit's
        # default), else the last ones (the module's own default, without EarlyExit), as measured at their step (an
        # earlier validation's loss is other weights': with `validate_on_finish=False` the trial has none)
        exported = "best" if getattr(pl_module, "keep_best_weights", False) else "last"
        value = exported_loss(rec, exported)
        exit_info = {"state": rec.state.value, "reason": rec.reason, "step": rec.step, "export_path": rec.export_path,
                     "exported_step": rec.exported_step}
        if not math.isnan(value):  # (a PRUNED trial's too: its study value is its last report, its export its best;
            exit_info["export_loss"] = value  # inf: measured, not finite)
        accuracy = exported_accuracy(rec, exported)
        if math.isnan(value) and rec.val_losses and rec.state in COMPLETE_STATES \
                and rec.val_losses[-1][0] != rec.exported_step:  # (its export not validated, under
            # `validate_on_finish=False`: its last validation's value, said, rather than none for every trial; not
            # where the export's own validation measured no token)
            (value_step, value), accuracy = rec.val_losses[-1], rec.last_val_preference_accuracy
            exit_info["value_step"] = value_step
            if not getattr(self, "_said_value_step", False):
                self._said_value_step = True
                warnings.warn(f"trial {info['number']} ({rec.name!r}) is told its last validation's loss, at step "
                              f"{value_step}: the weights it exports, of step {rec.exported_step}, were not validated "
                              "(`validate_on_finish=False`); the trial's user attribute adapter_exit['value_step'] "
                              "says which step a value is of (this is said once)")
        if rec.spec.objective == "dpo" and math.isfinite(accuracy):  # (the same weights' share of pairs preferred)
            exit_info["val_preference_accuracy"] = accuracy
        try:  # how its adapter ended, for a run resumed from an earlier checkpoint (`_told_record`)
            self.study._storage.set_trial_user_attr(info["trial_id"], "adapter_exit", exit_info)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # finished by another process meanwhile (`_lost`)
        if rec.state in COMPLETE_STATES and math.isfinite(value):
            self._tell(info["number"], values=value)
        elif rec.state in PRUNED_STATES or rec.state in COMPLETE_STATES:
            if rec.state in COMPLETE_STATES:  # (FAIL is kept for trials lost or failed)
                why = (f"its validations gave {rec.val_losses[-1][1]}" if rec.val_losses else
                       "never validated: `validate_on_finish=False` and no validation in its run?")
                warnings.warn(f"trial {info['number']} ({rec.name!r}) {rec.state.value} with no finite validation "
                              f"loss ({value}; {why}): told PRUNED, without a value")
            self._tell(info["number"], state=optuna.trial.TrialState.PRUNED)
        else:
            self._tell(info["number"], state=optuna.trial.TrialState.FAIL)
        info["told"] = True

    @staticmethod
    def _lost(info: dict[str, Any], name: str) -> None:
        """Trial ``info`` was finished by another process (failed as stale: this sweep's heartbeat older than the
        study's grace period). Its adapter trains on and keeps its slot (a trial's slot is freed by its exit); the
        study hears no more of it."""
        info["lost"] = True
        warnings.warn(f"trial {info['number']} ({name}) was finished by another process sharing the study: its "
                      "heartbeat was older than the grace period (this run was stopped longer than that before a "
                      "resume, or a step or validation took longer: then lengthen grace_period); its adapter trains "
                      "on, and the study hears no more of it")

    def _tell(self, number: int, **kwargs: Any) -> None:
        import optuna

        try:
            if kwargs.get("state") == optuna.trial.TrialState.FAIL:  # (this sweep's own FAIL, told apart from a
                storage = self.study._storage  # stale trial failed by another process: `_find_orphans`)
                trial_id = storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
                storage.set_trial_user_attr(trial_id, "failed_by", self.sweep_id)
            # skip_if_finished: under adapter parallelism a trial is told after the checkpoint of the step it
            # exited in; a run resumed from that checkpoint finds it told already
            self.study.tell(number, skip_if_finished=True, **kwargs)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # finished by another process meanwhile (`_lost`)
        except RuntimeError as err:
            # GridSampler calls study.stop() once its grid is used up, which only an optimize() loop may do;
            # the trial's state is stored before that, so the grid is simply exhausted.
            if "Study.stop" not in str(err):
                raise
            self.exhausted = True

    def dataset_names(self) -> list[Optional[str]]:
        """The ``dataset`` values its trials may have (None: the data module's first source)."""
        dist = self.distributions.get("dataset")
        if dist is not None:
            return list(dist.choices) if hasattr(dist, "choices") else [None]
        return [self.base.get("dataset")]

    def has_pending_candidates(self) -> bool:
        """More trials will be asked: warmup selection waits for them before ranking. (A grid used up is seen here,
        not only at the next ask: the selection would otherwise wait for trials that never come.)"""
        if self.asked >= self.n_trials or self.exhausted:
            return False
        import optuna

        running = any(o.state == optuna.trial.TrialState.RUNNING for o in self._orphans or ())
        return self.study is None or running or not self._grid_exhausted(self.study)

    def fill_slots(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Called by the module before it builds the optimizer (after a checkpoint is restored)."""
        self._fill(trainer, pl_module)

    # -- Lightning hooks ------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "registry"):
            raise TypeError("OptunaSweep needs a MultiLoRAMixin module")
        given = getattr(pl_module, "_given", {})  # (the adapters given to the module, not a sweep's from a checkpoint)
        taken = [n for n in given if _TRIAL_NAME.fullmatch(n) and n not in self.trials] if stage == "fit" else []
        if taken:  # (the sweep names its adapters trial-<number>: one would meet them mid-run)
            raise UsageError(f"adapter names {taken} are an OptunaSweep's trial names (trial-<number>, the names of "
                             "the adapters it asks): rename them")
        if stage == "fit":  # another fit (resumed from a checkpoint, whose state is loaded after this) looks the
            self._opened, self._orphans = False, None  # study over again for the trials asked after that checkpoint
            carried = getattr(pl_module, "carried_callback_state", lambda callback: None)(self)
            if carried is not None:  # (another fit of a module stopped with trials left: a new sweep object too)
                study, storage = carried.get("study_name"), carried.get("storage")
                if study != self.study_name or (self.storage is not None and storage not in (None, self.storage)):
                    raise UsageError(f"the module holds the trials of another sweep from its last fit (study "
                                     f"{study!r} in {storage!r}; this one's: {self.study_name!r} in "
                                     f"{self.storage!r}): fit it again with that sweep's `study_name` and `storage` "
                                     "to go on with them, or fit a new module for this sweep")
                self.load_state_dict(carried)
                left = pl_module.__dict__.pop("_sweep_trials_left", None)
                if left is not None and left[0] == self.sweep_id:  # (taken up: this fit tells them)
                    left[1].detach()
                elif left is not None:
                    pl_module.__dict__["_sweep_trials_left"] = left
            elif any(n not in pl_module.registry for n in self.trials):
                self._new_sweep()  # (a fit of another module: its `n_trials` asked anew, as `study.optimize` again)
            self._check_datasets(trainer)

    def _check_datasets(self, trainer: L.Trainer) -> None:
        """Every ``dataset`` the sweep may ask (``base``'s, or the search space's choices) names a source of the
        data module, said as the fit starts (a misspelled choice failed only the trials that drew it, as they were
        asked)."""
        dm = getattr(trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "source_name"):
            return
        dist = self.distributions.get("dataset")
        for name in self.dataset_names():
            try:
                dm.source_name(name)
            except ValueError as err:
                raise UsageError(f"OptunaSweep {'`search_space` dataset' if dist is not None else '`base`'}: {err}") \
                    from err

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fill(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Exits after the last fill (a validation after the last step) are told too: under adapter parallelism
        # by rank 0, its bookkeeping shared (every rank calls this hook, so the broadcast is matched).
        self._adopt(pl_module, decide_once(pl_module, lambda: self._tell_remaining(pl_module)))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A fit stopped by Ctrl+C or an error: the exits so far are told, and the trials left unfinished named, as
        after a ``max_steps`` stop; where no checkpoint can resume them, told FAIL (rank 0, without the other ranks:
        they may not be in this hook)."""
        if trainer.state.fn != "fit" or self.study is None or not decides_here(pl_module):
            return
        try:
            export = getattr(pl_module, "export_after_exception", None)
            if export is not None:  # (the module's own callback runs after this one: once per exception)
                export(exception)  # a trial told FAIL names its adapter's export
            self._tell_remaining(pl_module, stopped_by=type(exception).__name__)
        except Exception as err:  # noqa: BLE001 - the run's own exception is the one to raise
            warnings.warn(f"OptunaSweep could not tell the study how its trials stand after "
                          f"{type(exception).__name__}: {err}")

    def _tell_remaining(self, pl_module: L.LightningModule, stopped_by: Optional[str] = None) -> dict[str, Any]:
        """`_tell_exits`, as a decision that asks nothing (for `_adopt`); trials whose adapters still train (the
        Trainer stopped first: its ``max_steps`` or ``max_time``, or ``stopped_by`` an exception) stay RUNNING, with a
        warning saying so and which checkpoint resumes them. With no such checkpoint they are told FAIL as the module
        is dropped or the process ends (`_fail_when_dropped`), as Optuna's ``optimize`` tells a trial it stopped:
        nothing could take them up, and they stayed RUNNING for ever (a later sweep on the study skipped their grid
        points). (The module may still be saved, or fitted again, from Python meanwhile: then they go on.)"""
        self._tell_exits(pl_module)
        unfinished = [info["number"] for name, info in self.trials.items() if not info["told"] and not info.get("lost")
                      and name in pl_module.registry and not pl_module.registry[name].state.exited]
        if unfinished and self.study is not None:
            trainer = getattr(pl_module, "_trainer", None)
            saved = _resuming_checkpoint(trainer, stopped_by is not None)
            stop, larger = (f"the fit stopped by {stopped_by}", "") if stopped_by else _stop_cause(trainer)
            why = f"{stop} before their adapters finished (those that had started are exported as they are)"
            if getattr(trainer, "fast_dev_run", False):  # (a smoke run: nothing resumes it; they stayed RUNNING)
                _fail_at_exit(self.study, self.sweep_id, [
                    (info["trial_id"], info["number"], _fail_attrs(
                        f"a smoke run (`fast_dev_run`) ended at step {pl_module.registry[name].step} of its adapter",
                        pl_module.registry[name]))
                    for name, info in self.trials.items() if info["number"] in unfinished])
                for info in self.trials.values():
                    info["told"] = info["told"] or info["number"] in unfinished
                warnings.warn(f"trials {sorted(unfinished)} of this smoke run (`fast_dev_run`) are told FAIL in study "
                              f"{self.study.study_name!r}: nothing resumes them")
                return {"specs": [], "state": self.state_dict()}
            if saved is None:  # (a `max_steps` stop too: under the CLI, the process ended with them RUNNING)
                self._fail_when_dropped(pl_module, [
                    (info["trial_id"], info["number"], _fail_attrs(
                        f"{stop} at step {pl_module.registry[name].step} of its adapter, and no checkpoint of the "
                        "run can resume it", pl_module.registry[name]))
                    for name, info in self.trials.items() if info["number"] in unfinished])
                warnings.warn(f"trials {sorted(unfinished)} stay RUNNING in study {self.study.study_name!r}: {why}, "
                              "and no checkpoint of this run was saved: fitting this module again goes on with them "
                              "(and tells them); else they are told FAIL as the module is dropped or this process "
                              "ends (a ModelCheckpoint saves at each validation, `val_check_interval`)")
                return {"specs": [], "state": self.state_dict()}
            how = (f"Resume from the last checkpoint ({saved}; the steps after it are trained again){larger} to "
                   "finish and tell them" if saved else
                   "No checkpoint of this run was saved, so none can resume them (a ModelCheckpoint saves at each "
                   "validation, `val_check_interval`)")
            how += (" (with `heartbeat_interval`, a later sweep on the study would fail them once this run is not "
                    "resumed)" if stopped_by and not self._beats() else "")
            warnings.warn(f"trials {sorted(unfinished)} stay RUNNING in study {self.study.study_name!r}: {why}. {how}")
        return {"specs": [], "state": self.state_dict()}

    def _fail_when_dropped(self, pl_module: L.LightningModule, left: list[tuple[int, int, dict[str, Any]]]) -> None:
        """Trials a fit stopped by an exception left, no checkpoint to resume them: told FAIL (`_fail_at_exit`) once
        the module holding them is dropped or the process ends, as Optuna's ``optimize`` tells a trial it stopped
        (they stayed RUNNING for ever); not at once, since the module may be fitted again from Python, which goes on
        with them and tells them (told FAIL at the exception, a notebook's second fit trained them to the end and
        the study kept them failed, their slots not counted). A later fit's sweep takes them back (`setup`)."""
        import weakref

        earlier = pl_module.__dict__.pop("_sweep_trials_left", None)
        if earlier is not None and earlier[1].alive:  # (a fit again, without the sweep, stopped again: all of them)
            known = {trial_id for trial_id, _, _ in left}
            left = [t for t in earlier[1].detach()[2][2] if t[0] not in known] + left
        pl_module.__dict__["_sweep_trials_left"] = (
            self.sweep_id, weakref.finalize(pl_module, _fail_at_exit, self.study, self.sweep_id, left))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._report(pl_module)
        if decides_here(pl_module):
            self._beat()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            # rank 0 asks the pruner (under adapter parallelism); each adapter's owner exports and frees it
            pruned = decide_once(pl_module, lambda: self._report(pl_module, prune=True))
            for name, reason in pruned.items():
                if pl_module._owns(name) and not pl_module.registry[name].state.exited:
                    pl_module.remove_adapter(name, state=AdapterState.PRUNED, reason=reason)
            if pruned:  # (the same on every rank: rank 0's) the owners' exits reach every rank now, to be told
                pl_module._sync_ranks()
        if decides_here(pl_module):
            self._beat()

    @override
    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written after a stop that left trials with none to resume them (`trainer.save_checkpoint`
        from Python): it resumes them now, so they are no longer told FAIL as the module is dropped
        (`_fail_when_dropped`; a resume in another process trained them to the end, the study keeping them FAIL)."""
        left = pl_module.__dict__.get("_sweep_trials_left")
        if left is not None and left[0] == self.sweep_id and left[1].alive:
            left[1].detach()
            del pl_module.__dict__["_sweep_trials_left"]

    def state_dict(self) -> dict[str, Any]:
        return {"trials": {n: dict(t) for n, t in self.trials.items()}, "asked": self.asked,
                "exhausted": self.exhausted, "study_name": self.study_name,
                # a storage object (Optuna's JournalStorage...) is named, not kept: a checkpoint loads plain data
                "storage": self.storage if self.storage is None or isinstance(self.storage, str) else None,
                "storage_object": None if self.storage is None or isinstance(self.storage, str) else
                type(self.storage).__name__,
                "ran_in": _storage_name(self.study) if self.study is not None else self._ran_in,
                "sweep_id": self.sweep_id}

    @staticmethod
    def merge_rank_states(states: list[dict[str, Any]], owners: dict[str, int]) -> dict[str, Any]:
        """One state from an adapter-parallel checkpoint's ranks (a run resumed on another number of them): rank
        0's, which asks, reports and tells for every rank."""
        return states[0]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trials = {n: dict(t) for n, t in state_dict.get("trials", {}).items()}
        self.asked = int(state_dict.get("asked", len(self.trials)))
        self.exhausted = bool(state_dict.get("exhausted", False))
        self.sweep_id = state_dict.get("sweep_id", self.sweep_id)
        self._ran_in = state_dict.get("ran_in")
        if self.storage is None:
            if state_dict.get("storage_object") and self.study is None:  # (a study given holds its storage)
                raise UsageError(f"OptunaSweep: this checkpoint's sweep ran its study in a storage object "
                                 f"({state_dict['storage_object']}), which a checkpoint does not hold: give the same "
                                 "storage again, `OptunaSweep(..., storage=...)`, to go on with its trials")
            self.storage = state_dict.get("storage")
            self._storage_from_checkpoint = self.storage is not None
        saved = state_dict.get("study_name")
        if saved is not None and self.study is None and saved != self.study_name:
            raise ValueError(f"OptunaSweep: this checkpoint's sweep ran study {saved!r}, and `study_name` is "
                             f"{self.study_name!r}: resume with study_name={saved!r} (its trials are told by number "
                             "in that study)")


def _fail_attrs(reason: str, rec: Optional[AdapterRecord] = None) -> dict[str, Any]:
    """The user attributes of a trial told FAIL: why (``fail_reason``) and, where its adapter ``rec`` was exported,
    ``adapter_exit`` (what it trained, where the study can find it), as a trial told otherwise has it."""
    attrs: dict[str, Any] = {"fail_reason": reason}
    if rec is not None and rec.export_path is not None:
        exit_info = {"state": rec.state.value, "reason": reason, "step": rec.step, "export_path": rec.export_path,
                     "exported_step": rec.exported_step}
        if not math.isnan(rec.exported_val_loss):  # (inf: its export measured, not finite)
            exit_info["export_loss"] = rec.exported_val_loss
        attrs["adapter_exit"] = exit_info
    return attrs


def _fail_at_exit(study: Any, sweep_id: str, left: list[tuple[int, int, dict[str, Any]]]) -> None:
    """Tell FAIL the trials in ``left`` (trial id, number, user attributes) still RUNNING: `_fail_when_dropped`'s,
    as their module is dropped or the process ends. Nothing is raised (the interpreter may be ending)."""
    import optuna

    for trial_id, number, attrs in left:
        try:
            if study._storage.get_trial(trial_id).state != optuna.trial.TrialState.RUNNING:
                continue  # (told meanwhile: by a later fit, or another process)
            for key, value in {**attrs, "failed_by": sweep_id}.items():
                study._storage.set_trial_user_attr(trial_id, key, value)
            study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        except Exception:  # noqa: BLE001 - (a grid's study.stop outside optimize; a storage gone at exit)
            continue


PRUNERS = ("median", "percentile", "hyperband", "successive_halving")


def _pruner(pruner: Any) -> Optional["optuna.pruners.BasePruner"]:
    """`OptunaSweep`'s ``pruner``: None, one of `PRUNERS` by name, or an Optuna pruner."""
    if pruner is None:
        return None
    import optuna

    if isinstance(pruner, optuna.pruners.BasePruner):
        return pruner
    made = {"median": lambda: optuna.pruners.MedianPruner(),
            "percentile": lambda: optuna.pruners.PercentilePruner(25.0),
            "hyperband": lambda: optuna.pruners.HyperbandPruner(),
            "successive_halving": lambda: optuna.pruners.SuccessiveHalvingPruner()}
    if not isinstance(pruner, str) or pruner not in made:
        raise ValueError(f"OptunaSweep: `pruner` can be None, {', '.join(PRUNERS)} or an optuna.pruners.BasePruner, "
                         f"got {pruner!r}")
    return made[pruner]()


def _unnamed(err: ValueError) -> str:
    """An AdapterSpec's error about the made-up adapter "check" of the search space's check, without its name."""
    return str(err).replace(" for adapter " + repr("check"), "")


def _example(dist) -> Union[float, int, Any]:
    """A value inside a distribution, to check the search space against AdapterSpec up front."""
    import optuna

    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return dist.choices[0]
    return dist.low


def _stop_cause(trainer: Optional[L.Trainer]) -> tuple[str, str]:
    """What stopped a fit whose adapters still trained, in words, and what a resume then needs (the steps to finish
    them; nothing where a callback stopped it). It said "its max_steps or max_time" of an EarlyStopping's stop too,
    and advised a larger max_steps for a run without one."""
    from lightning.pytorch.callbacks import EarlyStopping, Timer

    if trainer is None:
        return "the Trainer stopped", ""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return f"the Trainer stopped at its max_steps={trainer.max_steps}", " with a larger Trainer max_steps"
    timer = next((cb for cb in trainer.callbacks if isinstance(cb, Timer)), None)
    left = timer.time_remaining() if timer is not None else None
    if left is not None and left <= 0:
        return "the Trainer stopped at its max_time", " with a larger Trainer max_time"
    if trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
        return f"the Trainer stopped at its max_epochs={trainer.max_epochs}", " with a larger Trainer max_epochs"
    stoppers = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)
                and getattr(cb, "stopping_reason_message", None)]
    if stoppers:
        return (f"`EarlyStopping(monitor={stoppers[0].monitor!r})` stopped the run "
                f"({stoppers[0].stopping_reason_message.rstrip('.')})", "")
    return "a callback stopped the run (`trainer.should_stop`)", ""
