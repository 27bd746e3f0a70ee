"""`AdapterSpec`: everything that defines one LoRA adapter's training run."""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Union

from lightning_multilora.arguments import peft_targets

SCHEDULES = ("constant", "linear", "cosine")
OBJECTIVES = ("sft", "dpo")
DEFAULT_DPO_BETA = 0.1  # (TRL's `DPOConfig.beta`)
MAX_LR = 1e30  # (`lr`'s bound: an optimizer's step scales it by up to 1/(1 - beta1), within float32's range)


def without_unused_beta(kwargs: dict[str, Any]) -> dict[str, Any]:
    """AdapterSpec arguments of a grid's or a sweep's cell without a `dpo_beta` its objective does not use (an SFT
    cell of a grid over objectives with one beta: no warning that it ignores it, `AdapterSpec`)."""
    if kwargs.get("objective", "sft") != "dpo":
        kwargs = {k: v for k, v in kwargs.items() if k != "dpo_beta"}
    return kwargs
_NAME_RE = re.compile(r"[A-Za-z0-9_\-]{1,200}")  # (a directory name of the export: at most 255 bytes)


@functools.lru_cache(maxsize=1)
def _reserved_names() -> frozenset:
    """Attribute names of a ``ParameterDict`` (``eval``, ``train``, ``to``...): not usable as adapter names."""
    import torch

    return frozenset(dir(torch.nn.ParameterDict()))


def check_adapter_name(name: Any, where: str = "") -> None:
    """An adapter's name: 1 to 200 letters, digits, '_' or '-', and no name torch.nn.Module takes (adapters are
    ParameterDict keys). ``where`` prefixes the error (the call it was given to)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{where}`name` must be 1 to 200 letters, digits, '_' or '-', got {name!r}")
    if name in _reserved_names():
        raise ValueError(f"{where}`name` {name!r} is taken by torch.nn.Module (adapters are ParameterDict keys); "
                         "pick another name")


_REGEX_CHARS = "*+?[](){}|^$\\"  # (a regex's; a dotted name, "self_attn.q_proj", is a name)


@dataclass
class AdapterSpec:
    """One adapter of a sweep: LoRA shape, optimisation hyperparameters, data and length.

    Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` naming the
    field and the allowed values.
    """

    name: str
    """Unique name; letters, digits, ``_`` and ``-`` (it becomes a parameter and directory name)."""
    rank: int = 8
    """LoRA rank r >= 1."""
    alpha: float = 16.0
    """LoRA alpha > 0; scaling is alpha / r (alpha / sqrt(r) with ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""
    lr: float = 2e-4
    """Peak learning rate > 0."""
    weight_decay: float = 0.0
    """The optimizer's ``weight_decay`` >= 0 for this adapter (decoupled in AdamW, the default; an L2 term in Adam
    and SGD)."""
    batch_size: int = 4
    """This adapter's micro-batch size per step, >= 1."""
    max_steps: Optional[int] = None
    """Optimizer steps to train; exactly one of ``max_steps`` / ``max_epochs`` is set (default 100 steps)."""
    max_epochs: Optional[float] = None
    """Passes over this adapter's own training set (may be fractional)."""
    lr_schedule: str = "constant"
    """One of constant, linear, cosine (decay to 0 after warmup)."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``, >= 0."""
    grad_clip: Optional[float] = 1.0
    """Max global L2 norm of this adapter's gradient, > 0, or None for no clipping."""
    target_modules: Optional[Union[str, list[str]]] = None
    """Modules to adapt, among the module's targets (PEFT style): a list of names (``["q_proj", "v_proj"]``), one name,
    ``"all-linear"`` or a regex on the full module name. None: the module's default targets."""
    objective: str = "sft"
    """Training objective: ``sft`` (completion-only cross-entropy) or ``dpo`` (preference pairs; the
    reference is the base with adapters off, also for an adapter with ``init_from``)."""
    dpo_beta: float = DEFAULT_DPO_BETA
    """DPO's beta (> 0): how far the adapter may move from the reference."""
    dataset: Optional[str] = None
    """Name of a data source in the data module; None: its default source."""
    seed: int = 0
    """Seed for this adapter's initialisation, data order and dropout masks (adapters of one seed share them)."""
    init_from: Optional[str] = None
    """A PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``, as
    ``save_pretrained`` or an export writes it) whose weights this adapter starts from instead of a fresh
    initialisation: to continue training it. Its ``r``, ``lora_alpha`` and ``use_rslora`` must be this spec's; with
    ``target_modules`` None the adapter targets the folder's layers. The optimizer state starts afresh. The folder is
    read as the fit starts and as the adapter starts (a resume takes the weights from its checkpoint). With
    ``objective="dpo"`` the reference stays the base without adapters, not the folder's adapter."""

    def __post_init__(self) -> None:
        check_adapter_name(self.name)
        for f in fields(self):  # numpy (and other) scalars, as a search or a grid may give them: Python numbers
            value = getattr(self, f.name)
            numpy_scalar = type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0  # (np.float64
            # is a float, np.bool_ no Number: kept, neither YAML nor a weights-only checkpoint load takes them)
            if hasattr(value, "item") and (numpy_scalar or (isinstance(value, numbers.Number)
                                                            and not isinstance(value, (int, float)))):
                setattr(self, f.name, value.item())
            elif isinstance(value, str) and type(value) is not str:  # (transformers' `SchedulerType.COSINE`: a str
                # enum; a weights-only checkpoint load refused its class)
                setattr(self, f.name, str.__str__(value))
        _check(self, "rank", _int(self.rank) and self.rank >= 1, "an integer >= 1")
        _check(self, "alpha", _num(self.alpha) and 0 < self.alpha < math.inf, "a finite number > 0")
        _check(self, "dropout", _num(self.dropout) and 0.0 <= self.dropout < 1.0, "a number in [0, 1)")
        _check(self, "use_rslora", isinstance(self.use_rslora, bool), "True or False")
        # (bounded: an optimizer's step scales lr by up to 1/(1 - beta1); past float32's range it raised in the
        # step, stopping every adapter, where a diverging adapter fails alone)
        _check(self, "lr", _num(self.lr) and 0 < self.lr <= MAX_LR, "a number in (0, 1e30]")
        _check(self, "weight_decay", _num(self.weight_decay) and 0 <= self.weight_decay < math.inf,
               "a finite number >= 0")
        _check(self, "batch_size", _int(self.batch_size) and self.batch_size >= 1, "an integer >= 1")
        if self.max_steps is not None and self.max_epochs is not None:
            raise ValueError(
                f"`max_steps` and `max_epochs` are exclusive; got max_steps={self.max_steps}, "
                f"max_epochs={self.max_epochs} for adapter {self.name!r} (a spec given neither holds the default "
                "max_steps=100: `dataclasses.replace(spec, max_steps=None, max_epochs=...)` trains by epochs)"
            )
        if self.max_steps is None and self.max_epochs is None:
            self.max_steps = 100
        if self.max_steps is not None:
            _check(self, "max_steps", _int(self.max_steps) and self.max_steps >= 1, "an integer >= 1")
        if self.max_epochs is not None:
            _check(self, "max_epochs", _num(self.max_epochs) and 0 < self.max_epochs < math.inf, "a finite number > 0")
        _check(self, "lr_schedule", self.lr_schedule in SCHEDULES, f"one of {', '.join(SCHEDULES)}"
               + _TRANSFORMERS_SCHEDULES.get(self.lr_schedule if isinstance(self.lr_schedule, str) else "", ""))
        _check(self, "warmup_steps", _int(self.warmup_steps) and self.warmup_steps >= 0, "an integer >= 0")
        if self.max_steps is not None and self.warmup_steps >= self.max_steps:
            # (stacklevel 4: the caller of `_init`, past it and the dataclass's `__init__`)
            warnings.warn(warmup_past_the_end(self, self.max_steps), stacklevel=4)
        _check(self, "grad_clip", self.grad_clip is None or (_num(self.grad_clip) and 0 < self.grad_clip < math.inf),
               "a finite number > 0 or None")
        _check(self, "objective", self.objective in OBJECTIVES, f"one of {', '.join(OBJECTIVES)}")
        _check(self, "dpo_beta", _num(self.dpo_beta) and 0 < self.dpo_beta < math.inf, "a finite number > 0")
        if self.objective != "dpo" and self.dpo_beta != DEFAULT_DPO_BETA:  # (said once a call site: a grid's many)
            warnings.warn(f"`dpo_beta` applies to objective='dpo' alone; an {self.objective.upper()} adapter ignores "
                          "it (set `objective='dpo'` for preference training)", stacklevel=4)
        if isinstance(self.target_modules, str):  # "all-linear" and a regex as they are; a plain name, listed
            _check(self, "target_modules", bool(self.target_modules),
                   "a non-empty list of module names, one name, 'all-linear' or a regex")
            self.target_modules = peft_targets(self.target_modules)  # (PEFT's "all-linear" in any case)
            if self.target_modules != "all-linear" and not set(self.target_modules) & set(_REGEX_CHARS):
                self.target_modules = [self.target_modules]
        elif self.target_modules is not None:
            self.target_modules = peft_targets(self.target_modules)  # (PEFT's `LoraConfig.target_modules`: a set)
            _check(self, "target_modules", isinstance(self.target_modules, (list, tuple)) and len(
                self.target_modules) > 0 and all(isinstance(t, str) and t for t in self.target_modules),
                   "a non-empty list of module names, one name, 'all-linear' or a regex")
            self.target_modules = list(self.target_modules)
        # (each layer's generator takes seed * 1_000_003 + its index, a 64-bit seed)
        _check(self, "seed", _int(self.seed) and abs(self.seed) < 2**42, "an integer of magnitude below 2**42")
        _check(self, "dataset", self.dataset is None or isinstance(self.dataset, str), "a data source's name or None")
        if isinstance(self.init_from, os.PathLike):
            self.init_from = os.fspath(self.init_from)
        _check(self, "init_from", self.init_from is None or (isinstance(self.init_from, str) and bool(self.init_from)),
               "a PEFT adapter folder's path or None")

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_held") and name in _SPEC_FIELDS:
            raise AttributeError(
                f"adapter {self.name!r}: its spec is the record of how a module trains it, fixed once the module holds "
                f"it: `{name}` = {value!r} would apply in part or not at all (its layers, data stream and export "
                "follow the spec it started with; a resume applies the checkpoint's). Train other settings as another "
                f"adapter: `module.add_adapter(dataclasses.replace(spec, name=..., {name}=..."
                f"{_OTHER_LENGTH.get(name, '')}))`")
        object.__setattr__(self, name, value)

    def hold(self) -> None:
        """Fix the spec's fields (an `AdapterRecord` holds it: a registry's record of how its adapter trains). A copy
        (``copy.deepcopy``, ``dataclasses.replace``) is free again."""
        object.__setattr__(self, "_held", True)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_held"}  # (a copy is free again)

    @property
    def rows_per_step(self) -> int:
        """Rows this adapter puts in a packed batch: ``batch_size``, twice that for DPO (chosen + rejected)."""
        return self.batch_size * (2 if self.objective == "dpo" else 1)

    @property
    def scaling(self) -> float:
        """LoRA scaling: alpha / r, or alpha / sqrt(r) for rsLoRA (as PEFT computes it)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AdapterSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown AdapterSpec fields {sorted(unknown)}; allowed: {sorted(known)}"
                             f"{peft_hints(unknown)}")
        return cls(**data)

    def hparams(self) -> dict[str, Any]:
        """The hyperparameters a sweep varies, for tables and loggers."""
        return {
            "rank": self.rank, "alpha": self.alpha, "lr": self.lr, "batch_size": self.batch_size,
            "dropout": self.dropout, "weight_decay": self.weight_decay, "schedule": self.lr_schedule,
            "dataset": self.dataset, "objective": self.objective,
            "dpo_beta": self.dpo_beta if self.objective == "dpo" else None,
            "use_rslora": self.use_rslora, "warmup_steps": self.warmup_steps, "grad_clip": self.grad_clip,
            "max_steps": self.max_steps, "max_epochs": self.max_epochs, "seed": self.seed,
            # (text: a list of module names, a regex or "all-linear"; None: the module's own)
            "target_modules": (None if self.target_modules is None else self.target_modules
                               if isinstance(self.target_modules, str) else ",".join(self.target_modules)),
            "init_from": self.init_from,
        }


_dataclass_init = AdapterSpec.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args: Any, **kwargs: Any) -> None:
    # (the dataclass's own __init__ says only "unexpected keyword argument": name the fields, and PEFT's spellings)
    unknown = set(kwargs) - _FIELD_NAMES
    if unknown:
        raise TypeError(f"AdapterSpec got unknown fields {sorted(unknown)}; allowed: {sorted(_FIELD_NAMES)}"
                        f"{peft_hints(unknown)}")
    _dataclass_init(self, *args, **kwargs)


AdapterSpec.__init__ = _init  # type: ignore[method-assign]
_FIELD_NAMES = frozenset(f.name for f in fields(AdapterSpec))

# PEFT's LoraConfig and transformers' TrainingArguments spellings (an optimizer's too): this package's field, or why
# there is none
_PEFT_NAMES = {
    "r": "`rank`", "lora_alpha": "`alpha`", "lora_dropout": "`dropout`", "learning_rate": "`lr`",
    "per_device_train_batch_size": "`batch_size`", "num_train_epochs": "`max_epochs`",
    "lr_scheduler_type": "`lr_schedule`", "warmup_ratio": "`warmup_steps` (a count)", "max_grad_norm": "`grad_clip`",
    "layers_to_transform": "a regex in `target_modules` (e.g. r'.*layers\\.(0|1)\\..*(q|v)_proj')",
    "exclude_modules": "a regex in `target_modules`", "init_lora_weights": "`init_from` (a PEFT adapter folder) or "
    "`seed` (PEFT's default initialisation, seeded per adapter)",
    "use_dora": None, "bias": None, "modules_to_save": None, "rank_pattern": None, "alpha_pattern": None,
    "lora_config": None, "peft_config": None,
    "gradient_accumulation_steps": "`batch_size` (no accumulation: each adapter steps once a batch of its own)",
    "lr_scheduler_kwargs": "`lr_schedule` and `warmup_steps`",
    **dict.fromkeys(("optim", "optimizer", "betas", "eps", "momentum", "adam_beta1", "adam_beta2", "adam_epsilon",
                     "optimizer_kwargs"), "the module's `optimizer` and `optimizer_kwargs` (one optimizer, every "
                    "adapter's: MultiLoRAModule(optimizer='torch.optim.AdamW', optimizer_kwargs={'betas': ...}))"),
}


def steps_of_epochs(max_epochs: float, steps_per_epoch: int) -> int:
    """The steps of ``max_epochs`` epochs (a fraction's last step whole), at least one; the product rounded to 1e-9
    first (``1.1 * 50`` is 55.00000000000001 in floats: 56 steps, one past 1.1 epochs)."""
    return max(1, math.ceil(round(max_epochs * steps_per_epoch, 9)))


def warmup_past_the_end(spec: AdapterSpec, max_steps: int) -> str:
    """What a warmup as long as an adapter's ``max_steps`` (or longer) does to it: its learning rate's last value."""
    given = f"max_steps={max_steps}" if spec.max_steps is not None else f"its {max_steps} steps (max_epochs=" \
        f"{spec.max_epochs})"
    return (f"adapter {spec.name!r}: warmup_steps={spec.warmup_steps} >= {given}, so its learning rate never reaches "
            f"lr={spec.lr} (it ends at {(max_steps - 1) / spec.warmup_steps:.2g} x lr)")


# TRL's DPOConfig spellings: this package's field, or why there is none
_TRL_NAMES = {
    "beta": "`dpo_beta` (with objective='dpo')",
    **dict.fromkeys(("loss_type", "label_smoothing"), "not supported: the sigmoid DPO loss alone (TRL's default "
                    "loss_type='sigmoid', label_smoothing=0)"),
    **dict.fromkeys(("reference_free", "ref_model", "ref_adapter_name", "precompute_ref_log_probs"),
                    "not supported: the reference is the base with every adapter off, run with each batch"),
    "rpo_alpha": "not supported (no NLL term beside DPO's)",
    **dict.fromkeys(("max_length", "max_prompt_length", "max_completion_length", "truncation_mode"),
                    "MultiLoRADataModule's `max_length` and `truncate` (one limit a row: the prompt's beginning is "
                    "cut first, as TRL's keep_end)"),
}


def peft_hints(unknown) -> str:
    """A hint for fields spelt as PEFT, transformers or TRL spell them ("" for none)."""
    hints = [f"{k} -> {_PEFT_NAMES[k]}" if _PEFT_NAMES[k] else f"{k}: not supported (plain LoRA adapters only)"
             for k in sorted(unknown) if k in _PEFT_NAMES]
    trl = [f"{k}: {_TRL_NAMES[k]}" if _TRL_NAMES[k].startswith("not") else f"{k} -> {_TRL_NAMES[k]}"
           for k in sorted(unknown) if k in _TRL_NAMES and k not in _PEFT_NAMES]
    return (f" (PEFT's names: {'; '.join(hints)})" if hints else "") + (f" (TRL's names: {'; '.join(trl)})"
                                                                        if trl else "")


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# transformers' `lr_scheduler_type` names that are not ours: what to give instead (said after the allowed values)
_TRANSFORMERS_SCHEDULES = {
    "constant_with_warmup": " (transformers' constant_with_warmup is our `constant`, which warms up over "
                            "`warmup_steps`)",
    **{name: f" (transformers' {name} schedule has no counterpart here)" for name in (
        "cosine_with_restarts", "polynomial", "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr",
        "cosine_warmup_with_min_lr", "warmup_stable_decay")},
}


def _check(spec: AdapterSpec, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"`{name}` must be {allowed}, got {getattr(spec, name)!r} for adapter {spec.name!r}")


_SPEC_FIELDS = frozenset(f.name for f in fields(AdapterSpec))
_OTHER_LENGTH = {"max_epochs": ", max_steps=None", "max_steps": ", max_epochs=None"}  # (exclusive: the copy's other)


@dataclass
class SweepGrid:
    """A grid of adapters: the cartesian product of ``axes`` over a ``base`` spec.

    >>> grid = SweepGrid(axes={"lr": [1e-4, 3e-4], "rank": [4, 8]}, base={"max_steps": 50})
    >>> [s.name for s in grid.specs()]
    ['lr1e-4-rank4', 'lr1e-4-rank8', 'lr3e-4-rank4', 'lr3e-4-rank8']
    """

    axes: dict[str, list[Any]]
    """Field name -> values; every combination becomes one adapter."""
    base: dict[str, Any] = field(default_factory=dict)
    """Fields shared by every adapter of the grid."""
    alpha_over_rank: Optional[float] = None
    """If set, alpha = alpha_over_rank * rank for each adapter (ALTO uses 2); not with ``alpha`` in axes or base."""
    prefix: str = ""
    """Prefix of every generated adapter name."""

    def specs(self) -> list[AdapterSpec]:
        if not isinstance(self.axes, Mapping) or not self.axes:
            raise ValueError(f"SweepGrid `axes` must be a non-empty mapping of AdapterSpec field -> list of values, "
                             f"got {self.axes!r}")
        check_alpha_over_rank("SweepGrid", self.alpha_over_rank)
        if not isinstance(self.base, Mapping):
            raise ValueError(f"SweepGrid `base` must be a mapping of AdapterSpec field -> value, got {self.base!r}")
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_\-]*", self.prefix):
            raise ValueError(f"SweepGrid `prefix` must be a string of letters, digits, '_' and '-' (it begins every "
                             f"adapter name), got {self.prefix!r}")
        check_spec_fields(list(self.axes) + list(self.base), "SweepGrid")
        for key, values in self.axes.items():
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"SweepGrid `axes[{key!r}]` must be a non-empty list of values, got {values!r}")
        both = sorted(set(self.axes) & set(self.base))
        if both:  # (the axis' values replaced the base's, silently: `--model.grid.base.lr` beside an lr axis)
            raise ValueError(f"SweepGrid: {both} in both `axes` and `base`: an axis sets each adapter's value, so "
                             "the base's would change nothing; give each field in one of them")
        if self.alpha_over_rank is not None and ("alpha" in self.axes or "alpha" in self.base):
            raise ValueError(f"SweepGrid: `alpha_over_rank` ({self.alpha_over_rank!r}) and `alpha` (in "
                             f"{'axes' if 'alpha' in self.axes else 'base'}) both set each adapter's alpha; give one")
        objectives = self.axes.get("objective", [self.base.get("objective", "sft")])
        if "dpo_beta" in self.axes and "dpo" not in objectives:  # (its values vanished: each cell is SFT, which takes
            # none, and an axis of betas alone made adapters with no name)
            raise ValueError(f"SweepGrid `axes['dpo_beta']` applies to objective='dpo' alone, and no adapter of the "
                             f"grid has it (objective {', '.join(map(repr, objectives))}): set `objective: dpo` in "
                             "`base`, or 'dpo' among the values of an `objective` axis")
        keys = list(self.axes)
        out, made, once = [], {}, set()
        for values in itertools.product(*(self.axes[k] for k in keys)):
            kwargs = dict(self.base)
            kwargs.update(zip(keys, values))
            cell = list(zip(keys, values))
            if "dpo_beta" in self.axes and kwargs.get("objective", "sft") != "dpo":
                # (an SFT cell takes no beta: one cell for all of the axis' betas, named without it; each beta made
                # an adapter of its own, named for a beta it trained without)
                cell = [(k, v) for k, v in cell if k != "dpo_beta"]
                if repr(cell) in once:
                    continue
                once.add(repr(cell))
            name = self.prefix + "-".join(f"{_short(k)}{_fmt(v)}" for k, v in cell)
            if name in made:
                raise ValueError(f"SweepGrid: the axes' values {made[name]} and {dict(zip(keys, values))} make one "
                                 f"adapter name, {name!r} (a name keeps a float's 4 significant digits below 0.01, 6 "
                                 "from there, and letters, digits, '_' and '-'); give values that differ there")
            made[name] = dict(cell)
            rank = kwargs.get("rank", AdapterSpec.rank)
            if self.alpha_over_rank is not None and _int(rank) and rank >= 1:  # (another rank: the spec's own error)
                kwargs["alpha"] = float(self.alpha_over_rank * rank)
                if not math.isfinite(kwargs["alpha"]):
                    raise ValueError(f"SweepGrid `alpha_over_rank` {self.alpha_over_rank!r} x rank {rank} makes alpha "
                                     f"{kwargs['alpha']!r}; alpha must be finite")
            out.append(AdapterSpec(name=name, **without_unused_beta(kwargs)))
        return out


_SHORT = {"batch_size": "bs", "weight_decay": "wd", "dropout": "do", "lr_schedule": "sched"}


def _short(key: str) -> str:
    return _SHORT.get(key, key)


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value != 0 and abs(value) < 1e-2:
        mantissa, exponent = f"{value:.3e}".split("e")
        text = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    else:
        text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9_\-]", "_", text.replace(".", "p"))


def check_alpha_over_rank(where: str, ratio: Any) -> None:
    """``alpha_over_rank`` (alpha = it x rank) is a number > 0 or None: else an error naming it and ``where``."""
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not ratio > 0):
        raise ValueError(f"{where} `alpha_over_rank` must be a number > 0 or None, got {ratio!r}")


def check_spec_fields(keys, where: str) -> None:
    """``keys`` (of a grid or a search space) are `AdapterSpec` fields, its ``name`` apart: else a named error."""
    known = {f.name for f in fields(AdapterSpec)} - {"name"}
    if "name" in set(keys):  # (it is a field: "not an AdapterSpec field" said otherwise)
        raise ValueError(f"{where} sets `name`: each adapter's name is made for it (a grid's from its `prefix` and "
                         "axes' values, a sweep's trial-<number>)")
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"{where} names {unknown}: not an AdapterSpec field; allowed: {sorted(known)}"
                         f"{peft_hints(unknown)}")
