"""`MultiLoRAMixin` (many adapters in any LightningModule) and `MultiLoRAModule` (for HF causal LMs)."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import math
import os
import re
import sys
import traceback
import uuid
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch import Tensor, nn
from typing_extensions import override

from lightning_multilora.arguments import RunEnded, UsageError, check_bool, check_int, peft_targets
from lightning_multilora.base_model import QUANTIZATIONS, check_causal_lm, held_dtype, one_sequence_per_row
from lightning_multilora.data.datamodule import IGNORE_INDEX
from lightning_multilora.export import (init_from_layers, init_from_shapes, init_from_weights, peft_fused_names,
                                        peft_skipped_layers, peft_target_modules, save_peft_adapter)
from lightning_multilora.flat import ELEMENTWISE_OPTIMIZERS, unflatten
from lightning_multilora.graphs import StepGraphs
from lightning_multilora.kernels import keep_alive
from lightning_multilora.kernels.recompute import enable_checkpointing
from lightning_multilora.layer import LoRALayers, inject_multilora
from lightning_multilora.layout import BatchLayout
from lightning_multilora.log_dir import log_dir_of
from lightning_multilora.optim import IMPLEMENTATION_FLAGS, GroupedAdamW
from lightning_multilora.registry import AdapterRecord, AdapterRegistry, AdapterState
from lightning_multilora.router_loss import router_losses, routes
from lightning_multilora.schedules import lr_factor
from lightning_multilora.shadow import shadow_of
from lightning_multilora.signals import raise_signals, stop_signals_deferred
from lightning_multilora.spec import AdapterSpec, SweepGrid, steps_of_epochs, warmup_past_the_end
import lightning_multilora.strategies  # noqa: E402,F401 - registers strategy="adapter_parallel"

# What the modules' default target_modules, "all-linear", adapts in a Llama-family model (Qwen2, Mistral...)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LORA_KEYS = (".lora_A.", ".lora_B.")
# what a resume whose adapters' layers differ from its checkpoint's is told (a `UsageError`: the command's message)
_OTHER_TARGETS = ("resume with the `target_modules` (the module's, and each AdapterSpec's) the checkpoint was trained "
                  "with")
# a base model's config entries that a checkpoint's adapters depend on (`_base_identity`)
_BASE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")
_ENDED = "ended"  # (the stamp's last line, once the fit that wrote it ended: `_mark_branch_ended`)
_RUN_STAMP = ".multilora_run"  # in an export folder: the id of the run that wrote it and the adapter (`save_adapter`)
EXPORT_INFO = "multilora_export.json"  # in an export folder: what its weights are (`save_adapter`, `_describe_export`)
_EXITS_KEY = "\0exits-of-rank-"  # in the ranks' exchange: a rank's exits since the last one (not an adapter name)
_LOGS_KEY = "\0logs-of-rank-"  # and its adapters' logged values since the last one
_VIEWS_KEY = "\0views-of-rank-"  # and the stops it made of other ranks' adapters and its pauses since the last one
_HELD_KEY = "\0registry-of-rank-"  # and a digest of its registry: the adapters it holds, the unplaced ones' states


def _step_marks(optimizer: Any, params: Sequence[Tensor]) -> list[tuple[int, int]]:
    """Per parameter: its version (an in-place update moves it; a kernel writing through its address, as
    bitsandbytes' do, does not) and its optimizer state's step count: a tensor's version (moved as torch counts a
    step, before the update itself) or a number (bitsandbytes'), -1 where it has no state yet."""
    marks = []
    for p in params:
        step = optimizer.state[p].get("step") if p in optimizer.state else None
        marks.append((p._version, -1 if step is None else step._version if isinstance(step, Tensor) else int(step)))
    return marks


def _moved(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> bool:
    """Whether an adapter's optimizer step was taken, in part at least, between `_step_marks` ``before`` and
    ``after``: a parameter updated, or a step counted (a state made and not yet counted, 0, is not)."""
    return any(a[0] != b[0] or a[1] > max(b[1], 0) for b, a in zip(before, after))


def resolve_optimizer(optimizer: Union[str, type]) -> type:
    """An optimizer class from a class or an import path (``"torch.optim.AdamW"``, ``"bitsandbytes.optim.AdamW8bit"``)."""
    if isinstance(optimizer, type):  # (checked as its import path is: LBFGS given as a class failed at its step)
        cls = optimizer
    else:
        module_name, _, class_name = str(optimizer).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"`optimizer` must be an optimizer class or its import path such as "
                             f"'torch.optim.AdamW', got {optimizer!r} ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"`optimizer` {optimizer!r} is not a torch.optim.Optimizer subclass")
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:  # (LBFGS: it failed at the first step)
        raise ValueError(f"`optimizer` {cls.__name__} needs a closure at each step (it evaluates the loss again); "
                         "every adapter here is stepped once after one shared backward: give an optimizer whose "
                         "`step()` takes none (torch.optim.AdamW, SGD, Adam...)")
    if issubclass(cls, torch.optim.SparseAdam):  # (it failed at the first step, after a forward and backward)
        raise ValueError(f"`optimizer` {cls.__name__} steps sparse gradients alone; the adapters' are dense: give "
                         "torch.optim.AdamW, Adam, SGD...")
    return cls


def _untake_interrupted_batch(checkpoint: dict[str, Any]) -> None:
    """A checkpoint written as an exception stopped a step (`OnExceptionCheckpoint` after Ctrl+C, in the forward,
    backward or optimizer's step) counts that batch begun and not processed: the step is not taken, and is taken again
    on resume, but Lightning, resumed, counted one batch more than were taken and validated one step early from then
    on (`val_check_interval` counts batches begun, `total.ready`): other validation steps than the run's, other
    `EarlyExit` decisions. Its counts of a batch begun go back to those processed (a checkpoint of a batch processed,
    at its end, is as Lightning resumes it; one written after the step's optimizer step, as a finishing adapter is
    validated and exported inside the step, has the step taken: its counts stay)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_loop.batch_progress")
    total = progress.get("total") if isinstance(progress, dict) else None
    stepped = (loop.get("epoch_loop.manual_optimization.optim_step_progress") or {}).get("total") or {}
    if isinstance(total, dict) and total.get("processed", 0) == total.get("completed", 0) < total.get("ready", 0) \
            and stepped.get("completed", checkpoint.get("global_step")) == total.get("processed"):
        total["ready"] = total["started"] = total["processed"]


# torch optimizers' on / off arguments (Adam's, AdamW's, SGD's, RMSprop's...): a value of another type is refused
_OPTIMIZER_FLAGS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "nesterov", "centered",
                    "decoupled_weight_decay")


def _optimizer_choice(optimizer_class: type, optimizer_kwargs: dict[str, Any],
                      on_cuda: bool) -> tuple[type, dict[str, Any]]:
    """The optimizer a run builds, and its arguments: on a GPU, AdamW as `GroupedAdamW` (one launch for every adapter,
    which also writes the adapters' bf16 shadows that the LoRA kernels read; torch's would leave them to a copy
    before each forward), and Adam, or AdamW with ``amsgrad`` / ``capturable``, fused (thousands of small adapter
    tensors: the fused kernels cut the step's host time by ~4x), unless ``optimizer_kwargs`` sets ``fused`` or
    ``foreach``; ``differentiable`` keeps torch's default (its fused step refuses it)."""
    kwargs = dict(optimizer_kwargs)
    if on_cuda and optimizer_class in (torch.optim.Adam, torch.optim.AdamW) and not (
            {"fused", "foreach"} & kwargs.keys()) and not kwargs.get("differentiable"):
        if optimizer_class is torch.optim.AdamW and not any(kwargs.get(k) for k in ("amsgrad", "capturable")):
            return GroupedAdamW, kwargs
        kwargs["fused"] = True
    return optimizer_class, kwargs


def _constructor_arguments(optimizer_class: type) -> Optional[set[str]]:
    """The names an optimizer's constructor takes (None where it takes any, ``**kwargs``, or cannot be read)."""
    try:
        params = inspect.signature(optimizer_class).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


class PausedSpec:
    """A paused adapter's spec as an admission controller's memory model sees it (`MultiLoRAMixin.admitted`): its
    weights and optimizer state are held, its rows are not in the batch (``rows_per_step`` and ``batch_size`` 0);
    every other field is the spec's (a predictor given one reads them as an `AdapterSpec`'s; ``.spec`` is the spec
    itself)."""

    rows_per_step = 0
    batch_size = 0

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec

    def __getattr__(self, name: str) -> Any:
        if name == "spec" or name.startswith("__"):  # (copy and pickle ask before `spec` is set)
            raise AttributeError(name)
        return getattr(self.spec, name)

    def __repr__(self) -> str:
        return f"PausedSpec({self.spec!r})"


class MultiLoRAMixin:
    """Trains many LoRA adapters of one frozen base model in one LightningModule.

    Use it before ``L.LightningModule`` and call `init_multilora` in ``__init__``::

        class Sweep(MultiLoRAMixin, L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = build_my_causal_lm()
                self.init_multilora(self.model, adapters=[AdapterSpec("a", rank=8), ...])

    Each step the data module packs every running adapter's own micro-batch; the module computes a
    loss vector (one mean per adapter, `adapter_loss_terms`), runs one backward of its sum, clips
    each adapter's gradient, sets each adapter's learning rate from its schedule and steps one
    optimizer with one param group per adapter. A non-finite loss or gradient fails that adapter
    alone. Adapters join (from the queue, when a slot is free) and leave (finished, failed,
    removed) between steps; each is exported in PEFT format when it leaves.

    An override of ``training_step``, ``configure_optimizers`` or one of the hooks in `HOOKS_NEEDING_SUPER`
    (``on_train_batch_end``, ``validation_step``, ``configure_callbacks``...) must call ``super()``'s: the mixin
    does its work there, and a run without it is an error.
    """

    registry: AdapterRegistry
    lora_layers: LoRALayers

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if L.LightningModule in mro and mro.index(L.LightningModule) < mro.index(MultiLoRAMixin):
            raise TypeError(f"class {cls.__name__}: list MultiLoRAMixin before LightningModule among its bases "
                            f"(`class {cls.__name__}(MultiLoRAMixin, L.LightningModule)`), so that its training step "
                            "and hooks take precedence over LightningModule's defaults")
        own = cls.__dict__.get("configure_optimizers")
        if own is not None:
            cls.configure_optimizers = _needs_super_optimizer(own)
        for name in HOOKS_NEEDING_SUPER:  # (Lightning's own do nothing: an override seldom calls super())
            own = cls.__dict__.get(name)
            if own is not None and not getattr(own, "_checks_super", False):
                setattr(cls, name, _needs_super(name, own))

    def log(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log``; dropped inside `evaluate` (an `adapter_loss_terms` that logs, run by the
        validation of an adapter as it finishes or of those held at a ``max_steps`` stop, from a hook where Lightning
        refuses ``self.log``, "You can't self.log() inside on_train_end", or into the training step's values). Its
        results are the adapters' losses that `evaluate` returns and records (`log_adapter_metrics` for others)."""
        if self.__dict__.get("_in_evaluate", False):
            return
        super().log(*args, **kwargs)

    # -- construction ---------------------------------------------------------------------------

    def init_multilora(
        self,
        model: nn.Module,
        adapters: Sequence[AdapterSpec] = (),
        target_modules: Union[str, Sequence[str]] = "all-linear",
        optimizer: Union[str, type] = "torch.optim.AdamW",
        optimizer_kwargs: Optional[dict[str, Any]] = None,
        max_running: Optional[int] = None,
        export_dir: Optional[str] = None,
        validate_on_finish: bool = True,
        admission: Optional[Any] = None,
        cuda_graphs: bool = False,
    ) -> None:
        """``optimizer``: an optimizer class or its import path, built with ``optimizer_kwargs`` and one param group
        per adapter. On CUDA the default, ``torch.optim.AdamW``, steps as `GroupedAdamW` (one launch for every
        adapter, which also writes the adapters' bf16 shadows that the LoRA kernels read) unless ``optimizer_kwargs``
        sets ``fused``, ``foreach``, ``amsgrad`` or ``capturable``. ``torch.optim.Adam``, and AdamW with ``amsgrad``
        or ``capturable``, step with ``fused=True`` unless ``optimizer_kwargs`` sets ``fused`` or ``foreach``
        (``differentiable`` is refused: the adapters' weights are leaves updated in place; ``capturable`` needs
        CUDA).

        ``admission``: an `AdmissionController` (see `lightning_multilora.scheduling`): queued adapters
        start only while its memory model says they fit, largest batch sizes first, a freed slot going to
        the exited adapter's batch size first. ``max_running`` still caps the count when both are given.

        ``cuda_graphs``: replay each training step's forward and backward from a CUDA graph, captured at the
        third step of the same layout (`StepGraphs`): the host's Python then no longer paces small-batch steps.
        The optimizer, clipping and the per-adapter decisions stay eager. Applies to SFT steps on a CUDA device
        whose batches are right-padded (as `MultiLoRADataModule` packs them; the batch's layout says so with
        ``padding_side="right"``), in one process or under adapter parallelism with a whole base per rank
        (``shard_size=1``); other steps run eagerly. An override of `adapter_loss_terms` and the
        ``on_before_backward`` / ``on_after_backward`` hooks run their Python once per captured layout; the
        batch reaches them without its attention mask (right padding needs none under a causal mask). Each
        layout and batch shape has its own graph, which keeps its step's intermediate memory (the four most
        recently replayed are kept): pad batches to few shapes (``MultiLoRADataModule(padding="max_length")``
        or ``pad_to_multiple_of``), or most steps of a varying length run eagerly. Needs torch >= 2.10 with
        gradient checkpointing."""
        check_int("MultiLoRAModule", "max_running", max_running, 1, optional=True)  # (and at every change: below)
        check_bool("MultiLoRAModule", "validate_on_finish", validate_on_finish)
        check_bool("MultiLoRAModule", "cuda_graphs", cuda_graphs)
        if type(self).adapter_loss_terms is MultiLoRAMixin.adapter_loss_terms:  # (a loss of its own may take any)
            check_causal_lm(model, field="base_model" if isinstance(self, MultiLoRAModule) else "model")
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold adapter weights only, never the frozen base
        model.train()  # (from_pretrained returns eval mode: the base's dropout off, and Lightning warns at the start)
        self.lora_layers = inject_multilora(model, target_modules)
        self._all_module_names = [n for n, _ in self.lora_layers.model.named_modules()]  # (a compiled one's own)
        self.default_target_modules = peft_targets(target_modules)
        self.registry = AdapterRegistry()
        # adapters given to the module outside a fit (constructor, grid, `add_adapter` before `fit`): what a resume
        # merges into the checkpoint's registry (not those a sweep added during an earlier fit of this object)
        self._given: dict[str, AdapterSpec] = {}
        self.optimizer_class = resolve_optimizer(optimizer)
        if optimizer_kwargs is not None and not isinstance(optimizer_kwargs, Mapping):
            raise ValueError("`optimizer_kwargs` must be a mapping of the optimizer's argument names to values, such "
                             f"as {{'betas': (0.9, 0.95)}}, got {type(optimizer_kwargs).__name__} {optimizer_kwargs!r}")
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        for flag in _OPTIMIZER_FLAGS:  # ("no" was taken for True, by torch's constructors and by `_optimizer_choice`)
            value = self.optimizer_kwargs.get(flag)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"`optimizer_kwargs` {flag} must be True or False (or None), got {value!r}")
        per_adapter = sorted({"lr", "weight_decay"} & self.optimizer_kwargs.keys())
        if per_adapter:  # (each adapter's param group sets them: given here they would be ignored)
            raise ValueError(f"`optimizer_kwargs` {per_adapter} are set per adapter: give them as AdapterSpec "
                             f"fields ({', '.join(f'{k}=' for k in per_adapter)}), in a grid's `base` or axes, or an "
                             "OptunaSweep's `base` or search space")
        self.max_running = max_running
        missing = [m for m in ("fits", "select", "alone") if not callable(getattr(admission, m, None))]
        if admission is not None and missing:
            raise ValueError(f"`admission` must be an AdmissionController (lightning_multilora.scheduling), or "
                             f"anything with fits / select / alone; got {admission!r} (no {', '.join(missing)})")
        self.admission = admission
        self._freed_spec: Optional[AdapterSpec] = None
        self._resume_checkpoint: Optional[dict[str, Any]] = None  # between on_load_checkpoint and the optimizer
        self._not_loaded: set[str] = set()  # adapters a resume made, until the checkpoint's weights are loaded
        # names this run, and the runs resumed from its checkpoints: stamped into every export folder it writes
        # (`save_adapter`), so that a resumed run writes over its own earlier exports and never another run's
        self._run_id = uuid.uuid4().hex
        # this run's line of descent: an id for each checkpoint load (a branch), after those of the checkpoint's own
        # line; stamped beside the run id, it tells two resumes of one checkpoint apart (`_sibling`)
        self._lineage = [uuid.uuid4().hex]
        self._exited_since_sync: list[str] = []  # under adapter parallelism: exits the other ranks learn next
        self.export_dir = export_dir
        self.validate_on_finish = validate_on_finish
        self.keep_best_weights = False  # EarlyExit turns this on: exports then carry the best-validation weights
        self._best_weights: dict[str, dict[str, Tensor]] = {}
        self._val_sums: dict[str, list[float]] = {}
        self._step_logs: dict[str, dict[str, float]] = {}  # this step's per-adapter scalars, until they are logged
        # under adapter parallelism: values written to this rank's loggers that rank 0's write at the next exchange,
        # and how many of each adapter's training losses the other ranks have
        self._staged_metrics: list[tuple[dict[str, float], int]] = []
        self._train_losses_shared: dict[str, int] = {}
        self._exit_texts_pending: set[str] = set()
        self._step_graphs = StepGraphs(warmup=2, max_graphs=4, enabled=cuda_graphs)
        for spec in _adapter_list(adapters, mappings=False):
            self.add_adapter(spec)

    # -- what a subclass may override -----------------------------------------------------------

    def adapter_loss_terms(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Per adapter of ``batch["layout"]``: (sum of its loss terms, their count); the loss is their ratio.

        SFT adapters: causal-LM cross-entropy on the completion tokens (labels ``!= -100``) of
        the model's logits (the model `init_multilora` was given: ``model(input_ids, attention_mask)``, its
        ``.logits`` or the tensor it returns; for a Hugging Face model the mask is None for right-padded rows,
        `MultiLoRADataModule`'s, which its causal mask alone keeps from their padding). DPO adapters (their rows:
        chosen then rejected):
        ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` per pair, with sequence log-probabilities
        of the completion; the reference ``ref`` is the base with adapters off, one forward under no_grad
        over every DPO adapter's rows of the batch. A mixture-of-experts model returning router logits
        (``output_router_logits=True``) adds, in training, its ``router_aux_loss_coef`` times the load-balancing loss
        of each adapter's own rows to that adapter's loss, as it adds the batch's to its own loss
        (`router_loss.router_losses`); the validation losses stay the cross-entropy (or DPO loss) alone.

        An override that runs extra forwards of the base must, under adapter parallelism, run as many on every
        rank (the base's forward is a collective there): see how ``_reference_forward_needed`` pairs them.
        """
        layout: BatchLayout = batch["layout"]
        model = self.lora_layers.model
        # Right-padded rows (`MultiLoRADataModule`'s) need no attention mask under the causal one: every real token
        # comes before the padding. With a mask, a batch holding padding took another attention path than one
        # without (a materialised mask, read on the host): an adapter's gradients moved (1e-8) with its neighbours'
        # padding, and the eager steps' attention was not the `is_causal` one the captured steps take.
        mask = None if layout.padding_side == "right" and _hf_model(model) else batch["attention_mask"]
        out = model(input_ids=batch["input_ids"], attention_mask=mask, **self._no_cache())
        row_sum, row_count = _row_token_loss(_logits(out), batch["labels"])
        sums, counts = segment_sum(row_sum, layout), segment_sum(row_count.to(row_sum.dtype), layout)
        router = router_losses(model, out, layout, batch.get("attention_mask")) if model.training else None
        if router is not None:  # (its mean over the adapter's terms: added to their sum as many times)
            sums = sums + router.to(sums.dtype) * counts
        dpo = [i for i, n in enumerate(layout.names) if n in self.registry and self.registry[n].spec.objective == "dpo"
               and layout.ends[i] > layout.starts[i]]  # (an adapter without rows this step has no pairs)
        self._preference_accuracy, self._preference_rewards = {}, {}
        if not self._reference_forward_needed(bool(dpo)):
            return sums, counts
        if not dpo:  # another rank runs its reference forward: join the base's collectives
            self._idle_forward(reference=False)
            return sums, counts
        rows = torch.cat([torch.arange(layout.starts[i], layout.ends[i]) for i in dpo]).to(row_sum.device)
        # the reference: the frozen base alone, once for all, deterministic (its dropout off, as in evaluation)
        with torch.no_grad(), self.lora_layers.use(None), _evaluating(model):
            ref = model(input_ids=batch["input_ids"][rows], attention_mask=None if mask is None else mask[rows],
                        **self._no_cache())
            ref_sum, _ = _row_token_loss(_logits(ref), batch["labels"][rows])
        ref_logp = torch.zeros_like(row_sum)
        ref_logp[rows] = -ref_sum.to(row_sum.dtype)
        policy_logp = -row_sum
        sums, counts = list(sums.unbind(0)), list(counts.unbind(0))
        for i in dpo:
            start, end = layout.starts[i], layout.ends[i]
            half = (end - start) // 2
            chosen = policy_logp[start:start + half] - ref_logp[start:start + half]
            rejected = policy_logp[start + half:end] - ref_logp[start + half:end]
            beta = self.registry[layout.names[i]].spec.dpo_beta
            margin = beta * (chosen - rejected)
            sums[i] = -F.logsigmoid(margin).sum()
            counts[i] = margin.new_tensor(float(half))
            if router is not None:
                sums[i] = sums[i] + router[i].to(sums[i].dtype) * half
            self._preference_accuracy[layout.names[i]] = (margin.detach() > 0).float().mean()
            # (TRL's rewards/chosen and rewards/rejected: both falling is DPO's failure the loss alone hides)
            self._preference_rewards[layout.names[i]] = beta * torch.stack([chosen.detach().mean(),
                                                                            rejected.detach().mean()])
        return torch.stack(sums), torch.stack(counts)

    def _loss_terms(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """`adapter_loss_terms`, checked: one sum and one count per adapter of the layout."""
        terms = self.adapter_loss_terms(batch)
        n = len(batch["layout"].names)
        if not (isinstance(terms, tuple) and len(terms) == 2 and all(
                torch.is_tensor(t) and tuple(t.shape) == (n,) for t in terms)):
            got = ([tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in terms]
                   if isinstance(terms, (tuple, list)) else type(terms).__name__)
            raise ValueError(f"{type(self).__name__}.adapter_loss_terms must return (loss sums, counts), two tensors "
                             f"of shape ({n},), one value per adapter of batch['layout'].names; got {got}")
        return terms

    def _no_cache(self) -> dict[str, Any]:
        """``use_cache=False`` for a Hugging Face model (training keeps no key/value cache), nothing for others."""
        return {"use_cache": False} if hasattr(getattr(self.lora_layers.model, "config", None), "use_cache") else {}

    # -- adapter lifecycle ----------------------------------------------------------------------

    def add_adapter(self, spec: AdapterSpec) -> AdapterRecord:
        """Queue an adapter; it starts at the next step that has a free slot (at once before fit). Under adapter
        parallelism, call it on every rank, as a callback's hooks run (not under ``trainer.is_global_zero``): every
        rank's registry holds every adapter, and one added on some ranks alone is an error on every rank at the
        step's exchange (`_check_registries`)."""
        if not isinstance(spec, AdapterSpec):
            hint = ""
            if type(spec).__name__ == "LoraConfig":  # (PEFT's: no name, no run; its LoRA fields map one to one)
                hint = (": write a PEFT LoraConfig `c` as AdapterSpec(name=..., rank=c.r, alpha=c.lora_alpha, "
                        "dropout=c.lora_dropout, use_rslora=c.use_rslora, target_modules=c.target_modules) and the "
                        "run's fields (lr, max_steps, dataset...); where `c.target_modules` is None, PEFT's default "
                        "for the model (q_proj and v_proj for Llama) is not this module's (its `target_modules`, "
                        "'all-linear' by default): name them")
            raise TypeError(f"add_adapter takes an AdapterSpec, got {type(spec).__name__}{hint}")
        # (the adapter's own: a caller reusing one spec as a template changed them all; its fields checked again, as
        # its constructor checks them: one set since, `spec.rank = 0`, failed the whole fit as it started)
        spec = dataclasses.replace(copy.deepcopy(spec))
        self._targets_of(spec, queued=True)  # validates its targets before it is queued
        rec = self.registry.add(spec)
        trainer = self._trainer_or_none()
        if trainer is None or trainer.state.status != "running":
            self._given[spec.name] = spec
        elif not self.__dict__.get("_fit_started", False):  # (a callback's `setup`: before a resumed checkpoint's
            self.__dict__.setdefault("_added_before_start", {})[spec.name] = spec  # registry replaces this one's)
        return rec

    @property
    def max_running(self) -> Optional[int]:
        """Adapters trained at once (None: every one); set at any time (a callback's), checked as the constructor
        checks it (0 took empty steps for ever)."""
        return self.__dict__.get("_max_running")

    @max_running.setter
    def max_running(self, value: Optional[int]) -> None:
        check_int("MultiLoRAModule", "max_running", value, 1, optional=True)
        self.__dict__["_max_running"] = None if value is None else int(value)

    def remove_adapter(self, name: str, reason: str = "removed",
                       state: Union[AdapterState, str] = AdapterState.PRUNED) -> None:
        """Stop an adapter now: a running one is exported first, then its weights and optimizer state
        are freed; a queued one never starts. Under adapter parallelism, call it on every rank (as a callback's
        hooks run): the rank that holds the adapter exports and frees it, the others mark it ended (or on that rank
        alone: the others learn at the step's exchange; on another rank alone, or a queued adapter's on some ranks
        alone, it is an error there). ``state``: how it
        ended, one of the ended states (finished, diverged, overfit, pruned, failed; or their names)."""
        given, ended = state, [s.value for s in AdapterState if s.exited]
        try:
            state = AdapterState(state)
        except ValueError:
            state = None
        if state is None or not state.exited:  # (checked before anything is exported or freed)
            raise ValueError(f"remove_adapter's `state` must be one of {', '.join(ended)} (an AdapterState or its "
                             f"name: how the adapter ended); got {given!r}")
        rec = self.registry[name]
        if self._hold_stop(rec, "remove", name, reason, state):
            return
        before = rec.state
        trainer = self._trainer_or_none()
        if trainer is None or trainer.state.status != "running":  # (outside a fit: a resume's checkpoint, whose
            # adapters it keeps, may hold it; then said, not undone unsaid)
            self._given.pop(name, None)
            self.__dict__.setdefault("_removed_before_fit", set()).add(name)
        if rec.state in (AdapterState.RUNNING, AdapterState.PAUSED):
            self._exit(rec, state, reason)
        elif rec.state == AdapterState.QUEUED:
            rec.state, rec.reason = state, reason
            self._notify_exit(rec)
        else:
            raise ValueError(f"adapter {name!r} has already exited ({rec.state.value}: {rec.reason})")
        self._note_view(rec, before)

    def pause_adapter(self, name: str, reason: str = "") -> None:
        """Stop training a running adapter but keep its weights and optimizer state; it frees its slot. Under adapter
        parallelism, call it (and `resume_adapter`) on every rank, as `add_adapter`, or on the adapter's own rank
        alone (`remove_adapter`)."""
        rec = self.registry[name]
        if rec.state != AdapterState.RUNNING:
            raise ValueError(f"only a running adapter can be paused; {name!r} is {rec.state.value}")
        if self._hold_stop(rec, "pause", name, reason):
            return
        rec.state, rec.reason = AdapterState.PAUSED, reason
        rec.close_span(self._run_step())
        self._freed_spec = rec.spec  # (as an exit: the next admission prefers its batch size)
        self._note_view(rec, AdapterState.RUNNING)
        if name in self.lora_layers.adapter_names:
            self.lora_layers.drop_grads(name)  # the optimizer would step it with its last gradients at every step it waits

    def resume_adapter(self, name: str) -> None:
        """Train a paused adapter again, from where it stopped (it takes a slot, beyond `max_running` and the
        admission budget if need be; `startable` says whether one is free)."""
        rec = self.registry[name]
        held = self.__dict__.get("_stops_held") or {}
        if held.get(name, ("",))[0] == "pause":  # (its pause waits for the step's end: taken back, it goes on)
            del held[name]
            return
        if rec.state != AdapterState.PAUSED:
            raise ValueError(f"only a paused adapter can be resumed; {name!r} is {rec.state.value}")
        rec.state, rec.reason = AdapterState.RUNNING, ""
        rec.open_span(self._run_step())
        self._note_view(rec, AdapterState.PAUSED)

    def restore_best_weights(self, name: str) -> bool:
        """Load adapter ``name``'s best-validation weights back into the adapter (kept where `keep_best_weights` is
        on, as under `EarlyExit`); returns False, changing nothing, where none are kept (and on the ranks that do not
        train it, under adapter parallelism). Its optimizer state stays its last step's. ``name`` must be an adapter
        the module holds (running or paused)."""
        self._held_spec(name, "restore_best_weights", "name")
        snapshot = self._best_weights.get(name)
        if snapshot is None:
            return False
        self.lora_layers.load_peft_state_dict(name, snapshot)
        rec = self.registry[name]  # (until its next step, its live weights are its best validation's: `save_adapter`)
        self.__dict__.setdefault("_restored_best", {})[name] = (rec.step, rec.best_val_step)
        return True

    def _notify_exit(self, rec: AdapterRecord) -> None:
        """Tell callbacks with an ``on_adapter_exit(trainer, module, record)`` method, and log the exit. Under adapter
        parallelism the hook runs on the rank where the adapter ended (its owner, or every rank for an exit a callback
        made on every rank); the other ranks learn of it at the next exchange, their registries updated (as
        `OptunaSweep` reads them: ``registry[name].state``), without the hook."""
        if rec.started_at_step is not None:  # (one that never started freed no slot)
            self._freed_spec = rec.spec  # the next admission prefers its batch size
        if self._placement() is not None:
            self._exited_since_sync.append(rec.name)
        trainer = self._trainer_or_none()
        if trainer is None:
            return
        for callback in trainer.callbacks:
            hook = getattr(callback, "on_adapter_exit", None)
            if hook is not None:
                hook(trainer, self, rec)
        placement = self._placement()
        if placement is None or placement.owner.get(rec.name) in (None, placement.global_rank):
            self._log_exit(rec)
        else:  # (ended here too, by a callback run on every rank: the text waits for its owner's record)
            self._exit_texts_pending.add(rec.name)

    def _log_exit(self, rec: AdapterRecord) -> None:
        """The exit's state and reason, as text, to the loggers that take text (TensorBoard's): by the adapter's
        rank, and under adapter parallelism by every other rank once the owner's record of it arrives (rank 0
        writes)."""
        trainer = self._trainer_or_none()
        if trainer is None:
            return
        for logger in trainer.loggers:
            writer = getattr(logger, "experiment", None)
            if hasattr(writer, "add_text"):
                writer.add_text(f"adapters/{rec.name}/exit", f"**{rec.state.value}** at step {rec.step}: {rec.reason}",
                                self._logged_step())

    def save_adapter(self, name: str, directory: Optional[Union[str, Path]] = None,
                     best: Optional[bool] = None) -> Optional[Path]:
        """Write adapter ``name`` (running) in PEFT format; returns the directory: ``directory``, else its folder
        under the export root (``<root>/<name>``, or ``<name>-v1``, ``-v2``... where another run's adapter is there,
        which is kept, as Lightning's ModelCheckpoint versions a taken file name), which becomes the adapter's
        ``export_path`` (a ``directory`` given is a copy of the caller's: the record keeps its folder; one that holds
        another adapter's export of this run is refused). ``best``: its best-validation weights where they are kept
        (`keep_best_weights`), the live ones left as they are; False: the live ones; None (default): the weights the
        run exports for it, the best-validation ones where the module keeps them (under EarlyExit: a call written to
        export the adapter wrote its last weights over the run's export of its best). Under
        adapter parallelism the rank that trains the adapter writes it, and the others return None (a callback's
        hooks run on every rank: as `remove_adapter`)."""
        rec = self.registry[name]
        if not self._owns(name) and not rec.state.exited and rec.state != AdapterState.QUEUED:
            return None  # (its weights are on the rank that trains it)
        if name not in self.lora_layers.adapter_names:
            where = (f"its weights were exported to {rec.export_path}" if rec.export_path else
                     "it has not started: no weights yet" if rec.state == AdapterState.QUEUED else "it has no export")
            raise ValueError(f"adapter {name!r} holds no weights ({rec.state.value}); {where}")
        if best is None:  # (a snapshot kept by an earlier fit's EarlyExit is not this fit's best)
            best = self.keep_best_weights and name in self._best_weights
        own_folder = directory is None
        if own_folder:  # its own folder under the export root, as named by its first export there
            root = self._export_root()
            own = Path(rec.export_path) if rec.export_path else None
            directory = own if own is not None and own.parent == root else root / name
            taken = directory
            version, skipped = 0, []
            while self._folder_taken(directory, name, rec) or not self._claim(directory, name, rec):
                skipped.append(directory)
                version += 1
                directory = root / f"{name}-v{version}"
            # (this run's later export, said where it was skipped, whichever folder it is: `a` may be another run's)
            later, taken = next(((step, d) for d in skipped if (step := self._later_step(d, name, rec.step))
                                 is not None), (None, taken))
            if later is not None:
                warnings.warn(f"adapter {name!r}: {taken} holds its export of step {later}, a later step than this "
                              f"one's ({rec.step}), written after the checkpoint this run resumed from; it is kept, "
                              f"and this one is written to {directory}")
            elif version and not taken.is_dir():
                warnings.warn(f"adapter {name!r}: {taken} is a file; it is kept, and this adapter is written to "
                              f"{directory}")
            elif version:
                stamp = self._stamp(taken)
                whose = ("another resume of this run's checkpoint" if self._sibling(taken) else
                         f"this run's adapter {stamp[1]!r}" if stamp is not None and stamp[0] == self._run_id
                         else "another run's")
                warnings.warn(f"adapter {name!r}: {taken} holds an adapter this run did not write for it ({whose}); "
                              f"it is kept, and this one is written to {directory} (give each new run its own "
                              "`export_dir`)")
        else:  # (stamped as this run's, of this adapter: its own export there later writes over it, not beside as
            # though another run's)
            directory = Path(directory).expanduser()
            self._refuse_anothers_folder(directory, name)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / _RUN_STAMP).write_text(self._stamp_text(name, rec.step))
            self._hold_branch(directory)
        base = getattr(getattr(self.lora_layers.model, "config", None), "name_or_path", None)
        layers = self.lora_layers.target_layers(name)
        weights = self._best_weights.get(name) if best else None
        if best and weights is None and rec.best_val_step not in (-1, rec.step):
            why = ("the module kept none before this run, or a resume without them" if self.keep_best_weights else
                   "the module keeps none: `keep_best_weights` is off, as without EarlyExit")
            warnings.warn(f"adapter {name!r}: its best-validation weights (step {rec.best_val_step}, validation loss "
                          f"{rec.best_val_loss:.4f}) were not kept ({why}): its weights of step {rec.step} are "
                          "written", stacklevel=2)
        path = save_peft_adapter(directory, rec.spec, weights if weights is not None else
                                 self.lora_layers.peft_state_dict(name),
                                 peft_target_modules(layers, self._all_module_names,
                                                     peft_fused_names(self.lora_layers.model)), base or None,
                                 fan_in_fan_out=any(self.lora_layers[n].fan_in_fan_out for n in layers),
                                 task_type="CAUSAL_LM" if _generates(self.lora_layers.model) else None)
        build = getattr(self, "_base_build", {})  # (a checkpoint's overrides: PEFT's loader does not apply them)
        overrides = build.get("config_overrides") if "base_seed" not in build else None
        if overrides and base and not getattr(self, "_told_overrides", False):
            self._told_overrides = True  # (once a module)
            warnings.warn(f"adapter {name!r}: its export names the base {base!r}, which this module loaded with "
                          f"`config_overrides` {overrides}; PEFT loads that base without them: build it with "
                          f"`AutoModelForCausalLM.from_pretrained({base!r}, **{overrides!r})` before "
                          "`PeftModel.from_pretrained`", stacklevel=2)
        skipped = peft_skipped_layers(self.lora_layers.model, layers)
        if skipped and not getattr(self, "_told_peft_skips", False):
            self._told_peft_skips = True  # (once a module)
            kind = getattr(self.lora_layers.model.config, "model_type", "")
            warnings.warn(f"adapter {name!r}: PEFT's `PeftModel.from_pretrained` takes its layers named as a {kind} "
                          f"base's expert projections ({skipped[:3]}...: {len(skipped)}), plain linear layers here, "
                          "for the fused experts' parameters, and does not load their weights (or refuses the export, "
                          "where it targets one of a fused pair alone, gate_proj without up_proj): the export holds "
                          "them (`AdapterSpec(init_from=...)` reads them), but PEFT runs the adapter without them. "
                          "Leave them out of `target_modules` for an export PEFT loads whole", stacklevel=2)
        restored = self.__dict__.get("_restored_best", {}).get(name) == (rec.step, rec.best_val_step)
        if weights is not None or restored:  # (the best validation's weights, kept or restored)
            step, loss, accuracy = rec.best_val_step, rec.best_val_loss, rec.best_val_preference_accuracy
        else:  # (measured at its step: by a validation, or as training stopped, `_validate_held`; NaN: not measured,
            # inf: a measure that was not finite, `_mean_loss`)
            end = getattr(self, "_end_losses", {}).get(name)
            validated = bool(rec.val_losses) and rec.val_losses[-1][0] == rec.step
            again = rec.exported_step == rec.step and not math.isnan(rec.exported_val_loss)  # (written again)
            step = rec.step
            loss, accuracy = ((rec.val_losses[-1][1], rec.last_val_preference_accuracy) if validated else
                              end[1:] if end is not None and end[0] == rec.step else
                              (rec.exported_val_loss, rec.exported_val_preference_accuracy) if again else
                              (math.nan, math.nan))
        if own_folder:
            rec.export_path = str(path)
            rec.exported_step, rec.exported_val_loss, rec.exported_val_preference_accuracy = step, loss, accuracy
        # (a ``directory`` given says the loss too: its weights are the ones measured, the record's export is not it)
        self._describe_export(Path(path), rec, step, loss, accuracy)
        return path

    def _refuse_anothers_folder(self, directory: Path, name: str) -> None:
        """A ``directory`` given to `save_adapter` that holds another adapter's export of this run (its record's
        `export_path`, or stamped so): writing would replace it, that adapter's only copy once it has ended (its
        weights freed), and the record and the report would name this adapter's weights as its."""
        where = directory.resolve()
        other = next((r.name for r in self.registry if r.name != name and r.export_path
                      and Path(r.export_path).resolve() == where), None)
        stamp = self._stamp(directory) if other is None and directory.is_dir() else None
        if stamp is not None and stamp[0] == self._run_id and stamp[1] and stamp[1] != name:
            other = stamp[1]
        if other is not None:
            raise ValueError(f"save_adapter({name!r}, directory={str(directory)!r}): that folder holds the export "
                             f"of adapter {other!r} of this run, which this would replace; give each adapter its own "
                             f"directory (or none: its folder under the export root)")

    def _describe_export(self, directory: Path, rec: AdapterRecord, step: int, loss: Optional[float],
                         accuracy: Optional[float] = None) -> None:
        """Write `EXPORT_INFO` beside an export's weights: the adapter, the run, its state and why, the step its
        weights are of (its best validation's, where those are written) and their validation loss (None: not
        measured; Infinity: not finite), its steps trained, and how its base was built where its name alone builds
        another (a built-in base's seed and overrides, a checkpoint's overrides, a dtype other than float32): what
        the folder holds, without the run's summary. A DPO adapter's also says so, with its beta (its loss is of that
        beta: losses of other betas do not compare) and its weights' preference accuracy (``accuracy``)."""
        import json

        loss = None if loss is None or math.isnan(loss) else loss
        dpo = {"objective": "dpo", "dpo_beta": rec.spec.dpo_beta, "val_preference_accuracy": None
               if accuracy is None or math.isnan(accuracy) else accuracy} if rec.spec.objective == "dpo" else {}
        info = {"adapter": rec.name, "run": getattr(self, "_run_id", None), "state": rec.state.value,
                "reason": rec.reason, "weights_step": step, "steps_trained": rec.step,
                "val_loss": loss, **dpo, **({"base": base} if (base := self._export_base()) else {})}
        partial = directory / f".{EXPORT_INFO}.partial"  # (moved into place whole, as the weights are)
        partial.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(partial, directory / EXPORT_INFO)

    def _export_base(self) -> dict[str, Any]:
        """How the base was built where its name alone builds another (`EXPORT_INFO`'s ``base``, which
        `examples/load_with_peft.py` builds it from): a built-in one's seed (where its weights or shape are not its
        name's), the overrides that change its config, a dtype other than float32, a 4-bit type (`quantization`:
        its weights are not the float ones its name loads). For a module given: the dtype it is held in and, where
        it is quantized, its bitsandbytes settings whole (``quantization_config``: double quantization, 8-bit, its
        compute dtype), its weights otherwise its own (a built-in base `build_base_model` made: its seed and
        overrides too)."""
        model = self.lora_layers.model
        model = getattr(model, "_orig_mod", model)  # (torch.compile's wrapper: the model it compiled)
        config = getattr(model, "config", None)  # (as the model was built with it)
        values = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
        four_bit, held = _four_bit(values), held_dtype(model)
        dtype = str(held).removeprefix("torch.") if held is not None else None
        build = getattr(self, "_base_build", None)
        quant = values.get("quantization_config")
        settings = {k: v for k, v in quant.items() if not k.startswith("_") and k != "quant_method"} \
            if (build is None or self.__dict__.get("_base_given")) and isinstance(quant, dict) else {}
        overrides, seed = (build or {}).get("config_overrides"), (build or {}).get("base_seed")
        return {**({"base_seed": seed} if seed is not None and (seed != 0 or overrides) else {}),
                **({"config_overrides": overrides} if overrides else {}),
                **({"dtype": dtype} if dtype not in (None, "float32") else {}),
                **({"quantization": four_bit} if four_bit else {}),
                **({"quantization_config": settings} if settings else {})}

    def _wrote(self, directory: Path, name: str) -> bool:
        """Whether this run (or one it resumed from) wrote adapter ``name``'s export in ``directory`` (a stamp
        without a name, from before names were stamped: any adapter of the run); not a `_sibling`'s."""
        stamp = self._stamp(directory)
        return stamp is not None and stamp[0] == self._run_id and stamp[1] in ("", name) and \
            not self._sibling(directory)

    def _sibling(self, directory: Path) -> bool:
        """Whether ``directory`` holds an export that this run's id wrote on another line than this one's, in a fit
        that ended as fits end (its training's end reached, `_mark_branch_ended`) or that runs still (its lock held:
        `branch_locks`): another resume of a checkpoint this module resumed (two fits from one checkpoint into one
        `export_dir` wrote over each other's results, both carrying its run id). An attempt stopped by an error,
        Ctrl+C or a kill, retried from the same checkpoint, is written over, as is a stamp without a branch, from
        before branches were stamped."""
        from lightning_multilora.branch_locks import branch_alive

        stamp = self._stamp(directory)
        return stamp is not None and stamp[0] == self._run_id and stamp[3] not in ("", *self._lineage) and \
            (stamp[4] == _ENDED or branch_alive(directory, stamp[3]))

    def _hold_branch(self, directory: Path) -> None:
        """An export stamped in a fit: this fit's branch is held as running beside it until the fit ends or stops
        (`_release_branch`), for another resume of its checkpoint to see (`_sibling`)."""
        from lightning.pytorch.trainer.states import TrainerStatus

        from lightning_multilora.branch_locks import BranchLocks

        trainer = self._trainer_or_none()  # (a fit's Trainer after it returned still says "fit": not running, though)
        if trainer is None or trainer.state.fn != "fit" or trainer.state.status != TrainerStatus.RUNNING:
            return
        locks = self.__dict__.setdefault("_branch_locks", BranchLocks())
        locks.hold(directory, self._lineage[-1], int(getattr(trainer, "global_rank", 0)))

    def _release_branch(self) -> None:
        """The fit ended or stopped: its branch's locks let go (`_hold_branch`)."""
        locks = self.__dict__.get("_branch_locks")
        if locks is not None:
            locks.release()

    def _mark_branch_ended(self) -> None:
        """This fit's training ended as fits end: the exports it wrote are stamped so (`_sibling`)."""
        for rec in self.registry:
            directory = Path(rec.export_path) if rec.export_path else None
            stamp = self._stamp(directory) if directory is not None and self._owns(rec.name) else None
            if stamp is not None and stamp[0] == self._run_id and stamp[3] == self._lineage[-1] and stamp[4] != _ENDED:
                with contextlib.suppress(OSError):  # (a folder that cannot be written: left as it is)
                    (directory / _RUN_STAMP).write_text("\n".join((*stamp[:4], _ENDED)) + "\n")

    def _later_step(self, directory: Path, name: str, step: int) -> Optional[int]:
        """The step stamped in ``directory``, this run's export of adapter ``name`` (`_wrote`), where it is later than
        ``step``; else None."""
        stamp = self._stamp(directory)
        if not self._wrote(directory, name) or stamp is None or not stamp[2].isdigit():
            return None
        return int(stamp[2]) if int(stamp[2]) > step else None

    def _folder_taken(self, directory: Path, name: str, rec: AdapterRecord) -> bool:
        """Whether adapter ``name`` must not be exported to ``directory``: a file of that name; another run's
        adapter, or another adapter's of this run (`a` versioned into `a-v1`), unless it is the record's own export,
        written or being written (its stamp comes first: `_claim`); or this adapter's of a later step, written by the
        run this one resumed after its checkpoint, not to be replaced by weights of an earlier step (an interrupt of
        this resume exports them)."""
        if directory.exists() and not directory.is_dir():
            return True
        if not (directory / "adapter_config.json").exists() and self._stamp(directory) is None:
            return False
        if self._sibling(directory):  # (even the record's own export: the checkpoint's, written over by a sibling)
            return True
        if not self._wrote(directory, name):
            return str(directory) != rec.export_path
        return self._later_step(directory, name, rec.step) is not None

    def _claim(self, directory: Path, name: str, rec: AdapterRecord) -> bool:
        """Stamp ``directory`` as this run's export of adapter ``name`` at its step, before anything is written there
        (a folder an interrupt leaves half-written is still known as this run's); False where another run stamped it
        first: two runs sharing an export root, each exporting an adapter of that name at once, saw the folder free
        (its config not yet written) and wrote into the same one, the last one's weights kept for both."""
        directory.mkdir(parents=True, exist_ok=True)
        stamp = directory / _RUN_STAMP
        text = self._stamp_text(name, rec.step)
        if stamp.is_file() and (self._sibling(directory) or not (self._wrote(directory, name)
                                                                 or str(directory) == rec.export_path)):
            return False
        self._hold_branch(directory)  # (before the stamp is written: seen running from its first line)
        try:
            with open(stamp, "x" if not stamp.exists() else "w") as fh:  # (a new one: made by one run alone)
                fh.write(text)
        except FileExistsError:  # (another run's, made since the check)
            return self._wrote(directory, name)
        return True

    def _stamp_text(self, name: str, step: int) -> str:
        """An export folder's stamp as this run writes it (`_stamp` reads it; `_mark_branch_ended` adds its end)."""
        return f"{self._run_id}\n{name}\n{step}\n{self._lineage[-1]}\n"

    @staticmethod
    def _stamp(directory: Path) -> Optional[tuple[str, str, str, str, str]]:
        """The run id, the adapter name, its step, the branch of the run's line (`_lineage`) and whether that fit
        ended (`_ENDED`) stamped in an export folder (each later one "" in an older stamp), or None."""
        stamp = directory / _RUN_STAMP
        if not stamp.is_file():
            return None
        lines = [line.strip() for line in stamp.read_text().splitlines()] + [""] * 5
        return lines[0], lines[1], lines[2], lines[3], lines[4]

    def packing_roster(self) -> list[AdapterSpec]:
        """Specs of the adapters in the next packed batch (running, in registry order; under adapter
        parallelism, this rank's)."""
        return [r.spec for r in self.registry.running if self._owns(r.name)]

    def validation_roster(self) -> list[AdapterSpec]:
        """Specs of the adapters a validation measures: `packing_roster`'s, less, in a fit's validations, those that
        have taken no step yet (one started at this step, refilling a slot: its weights are its initialisation, whose
        loss would become its best, and what it exports if the run stops before it is measured again); in
        ``trainer.validate``, the paused adapters too (a warmup's candidates, held: they were left out unsaid)."""
        trainer = self._trainer_or_none()
        if trainer is not None and trainer.state.fn == "validate":
            return [r.spec for r in self.registry.holding_weights if self._owns(r.name)]
        if trainer is None or trainer.state.fn != "fit" or trainer.sanity_checking:
            return self.packing_roster()
        return [r.spec for r in self.registry.running if self._owns(r.name) and r.step > 0]

    # -- adapter parallelism (the strategy places adapters on ranks) ----------------------------

    def _placement(self) -> Optional[Any]:
        trainer = self._trainer_or_none()
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        return strategy if hasattr(strategy, "owns") and hasattr(strategy, "place") else None

    def _owns(self, name: str) -> bool:
        placement = self._placement()
        return placement is None or placement.owns(name)

    def _apply(self, fn, *args, **kwargs):
        """Moves and casts (``.to()``, Lightning's device placement and precision) replace the per-layer adapter
        parameters' storage: each adapter's flat parameter follows at once (before an optimizer is built on it)."""
        out = super()._apply(fn, *args, **kwargs)
        layers = self.__dict__.get("lora_layers")
        if layers is not None:
            layers.rebind()
        return out

    def configure_model(self) -> None:
        """Under `AdapterParallelStrategy`: shard the frozen base with FSDP2 (as its ``shard_size`` says; a
        replicated base is only cast to its ``param_dtype``), adapters left out. Other strategies over several
        processes are refused."""
        placement = self._placement()
        trainer = self._trainer_or_none()
        if trainer is not None:
            _refuse_strategy(trainer)
        if placement is not None and hasattr(placement, "parallelize"):
            if not getattr(self, "_parallelized", False):
                params = [p for n in self.lora_layers.adapter_names for p in self.lora_layers.parameters_of(n)]
                placement.parallelize(self.lora_layers.model, params)
                self._parallelized = True

    def _sync_ranks(self, step_logs: Optional[dict[str, dict[str, float]]] = None) -> None:
        """Share this rank's adapters' progress (training losses included) and exits with the others, so every
        rank's registry (and so admission, the end of training and `SweepReport`'s curves) stays the same; and the
        values its loggers were given (`log_adapter_metrics`), which every other rank's loggers then write (rank
        0's: Lightning's loggers write there alone). ``step_logs`` (adapter -> this step's values) gets the other
        ranks' adapters' added, so that every rank logs every adapter's."""
        placement = self._placement()
        if placement is None:
            return
        fields = ("state", "reason", "step", "max_steps", "tokens_seen", "samples_seen", "started_at_step",
                  "ended_at_step", "export_path", "best_val_loss", "best_val_step", "last_val_loss",
                  "last_val_preference_accuracy", "val_losses", "exported_step", "exported_val_loss", "loss_scale",
                  "scale_growth", "skipped_steps", "best_val_preference_accuracy", "exported_val_preference_accuracy",
                  "spans")
        views = {n: v for n, v in self.__dict__.pop("_views", {}).items() if v[0] != v[1]}  # (`_note_view`)
        mine: dict[str, Any] = {f"{_VIEWS_KEY}{placement.global_rank}": (views, self.__dict__.pop("_paused", []))}
        for rec in self.registry:
            if placement.owner.get(rec.name) == placement.global_rank:
                mine[rec.name] = {f: getattr(rec, f) for f in fields}
                mine[rec.name]["train_losses"] = rec.train_losses[self._train_losses_shared.get(rec.name, 0):]
                self._train_losses_shared[rec.name] = len(rec.train_losses)
        mine[f"{_EXITS_KEY}{placement.global_rank}"] = list(self._exited_since_sync)
        mine[f"{_LOGS_KEY}{placement.global_rank}"] = (step_logs or {}, self._staged_metrics)
        mine[f"{_HELD_KEY}{placement.global_rank}"] = self._registry_digest(placement)
        self._staged_metrics = []
        got = placement.exchange(mine)
        self._check_registries(got, placement)
        self._check_views(got, placement)
        for name, update in got.items():
            if name.startswith((_VIEWS_KEY, _HELD_KEY)):
                continue
            if name.startswith(_EXITS_KEY):
                self._exited_since_sync.extend(update)  # every rank's exits since the last exchange
                continue
            if name.startswith(_LOGS_KEY):
                if name != f"{_LOGS_KEY}{placement.global_rank}":
                    self._take_logs(update, step_logs)
                continue
            if placement.owns(name) or name not in self.registry:
                continue
            rec = self.registry[name]
            was_exited = rec.state.exited
            last = rec.train_losses[-1][0] if rec.train_losses else None
            rec.train_losses.extend(e for e in update.pop("train_losses") if last is None or e[0] > last)
            for f, value in update.items():
                setattr(rec, f, value)
            if rec.state.exited and not was_exited:
                rec.close_span(rec.ended_at_step if rec.ended_at_step is not None else self._run_step())
                self._exited_since_sync.append(name)
            if rec.state.exited and (not was_exited or name in self._exit_texts_pending):
                self._exit_texts_pending.discard(name)
                self._log_exit(rec)
        # The freed slot's batch size guides the next admission: the same exit or pause on every rank (the union of
        # every rank's exits since the last exchange, and the pauses it brought: a pause on its owner alone left the
        # other ranks preferring another batch size, and the ranks started different adapters and hung), the last
        # in registry order.
        paused = {n for key, update in got.items() if key.startswith(_VIEWS_KEY) for n in update[1]}
        freed = set(self._exited_since_sync) | paused
        if freed:
            self._freed_spec = [r.spec for r in self.registry if r.name in freed][-1]
        self._exited_since_sync = []

    def _registry_view(self, placement: Any) -> list[tuple[str, str]]:
        """What every rank's registry must agree on at an exchange: the adapters in their order, and the state of
        each no rank trains (queued, or ended before it started: nothing exchanges those, each rank keeps its own);
        those of them that ended, in any order (never admitted: a resumed sweep's rank 0 took up its trials told
        after the checkpoint after its new ones, the other ranks before)."""
        view, ended = [], []
        for rec in self.registry:
            if rec.name in placement.owner:
                view.append((rec.name, ""))
            else:
                (ended if rec.state.exited else view).append((rec.name, rec.state.value))
        return view + sorted(ended)

    def _registry_digest(self, placement: Any) -> str:
        return hashlib.blake2b(repr(self._registry_view(placement)).encode(), digest_size=16).hexdigest()

    def _check_registries(self, got: dict[str, Any], placement: Any) -> None:
        """An `add_adapter`, or a `remove_adapter` of a queued adapter, made on some ranks and not the others (under
        ``trainer.is_global_zero``, say) left the ranks' registries apart: they admitted different adapters and hung
        in the next collective. A named error on every rank instead (each reads the same digests, then the same
        lists: a second exchange, only then), before the next admission."""
        if len({v for k, v in got.items() if k.startswith(_HELD_KEY)}) <= 1:
            return
        held = placement.exchange({placement.global_rank: self._registry_view(placement)})
        ranks = sorted(held)
        names = {n for r in ranks for n, _ in held[r]}
        said = []
        for name in sorted(names):
            at = {r: dict(held[r]).get(name) for r in ranks}
            if len(set(at.values())) > 1:
                said.append(f"{name!r}: " + ", ".join(
                    f"rank {r} " + ("lacks it" if v is None else f"holds it {v or 'placed'}") for r, v in at.items()))
        if not said:
            said = [f"rank {r}: {[n for n, _ in held[r]]}" for r in ranks]  # (the same adapters in another order)
        raise UsageError(
            "the ranks' adapters differ (" + "; ".join(said) + "): under adapter parallelism `add_adapter`, and "
            "`remove_adapter` of a queued adapter, are called on every rank, as a callback's hooks run (not under "
            "`trainer.is_global_zero`)")

    def _note_view(self, rec: AdapterRecord, before: AdapterState) -> None:
        """Under adapter parallelism: a stop (or resume) of ``rec`` made on this rank, from ``before`` to its state
        now, kept for the next exchange (`_check_views`) where another rank trains it; a pause, made on any rank,
        frees its slot on every rank there (a pause on its owner alone left the others preferring another batch
        size, and the ranks admitted different adapters and hung)."""
        placement = self._placement()
        if placement is None:
            return
        if rec.state == AdapterState.PAUSED:
            self.__dict__.setdefault("_paused", []).append(rec.name)
        if placement.owner.get(rec.name) not in (None, placement.global_rank):
            views = self.__dict__.setdefault("_views", {})
            views[rec.name] = (views.get(rec.name, (before,))[0], rec.state)

    def _check_views(self, got: dict[str, Any], placement: Any) -> None:
        """A `remove_adapter`, `pause_adapter` or `resume_adapter` made on a rank that does not train the adapter,
        and not on its owner (under ``trainer.is_global_zero``, say: the owner's state is still the one it was
        made from), was undone by the owner's record at this exchange, silently (the adapter trained on; a resume
        then failed on that rank alone, and the ranks parted). A named error on every rank (each reads the same
        exchange), before the next step."""
        for key, (views, _) in sorted((k, v) for k, v in got.items() if k.startswith(_VIEWS_KEY)):
            for name, (before, after) in views.items():
                owner = placement.owner.get(name)
                held = got.get(name, {}).get("state") if owner is not None else None
                held = AdapterState(held) if held is not None else None
                if held is None or (held != AdapterState(before) and (held.exited or not AdapterState(after).exited)):
                    continue  # (its owner made it too, or went further: a pause on every rank, then a prune; a
                    # removal the owner did not make, whatever else it did, is refused: it trained on)
                raise UsageError(
                    f"adapter {name!r} is {AdapterState(after).value} on rank {key[len(_VIEWS_KEY):]}, and "
                    f"{held.value} on rank {owner}, which trains it: under adapter parallelism "
                    "`remove_adapter`, `pause_adapter` and `resume_adapter` are called on every rank (as a callback's "
                    "hooks run: not under `trainer.is_global_zero`), or on the adapter's own rank alone "
                    "(`trainer.strategy.owner[name]`)")

    def _take_logs(self, update: tuple[dict, list], step_logs: Optional[dict[str, dict[str, float]]]) -> None:
        """Another rank's logged values from the exchange: its step's per-adapter values into ``step_logs``, and
        those its loggers were given written to this rank's."""
        theirs, staged = update
        if step_logs is not None:
            step_logs.update(theirs)
        for metrics, step in staged:
            self._write_metrics(metrics, step)

    def log_adapter_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Write ``metrics`` (for this rank's adapters) to the trainer's loggers at ``step`` (default: the step
        Lightning writes what is logged now at, `_logged_step`), as ``logger.log_metrics`` does. Under adapter
        parallelism, where Lightning's loggers write on rank 0 alone, rank 0 writes another rank's values at the next
        exchange of the ranks' progress (every step's end, every validation's): a callback logging per-adapter values
        calls this rather than the loggers."""
        trainer = self._trainer_or_none()
        if trainer is None or not metrics:
            return
        step = self._logged_step() if step is None else step
        self._write_metrics(metrics, step)
        if self._placement() is not None:
            self._staged_metrics.append((dict(metrics), step))

    def _logged_step(self) -> int:
        """The step Lightning's loggers put what is logged now at: in a fit, the batches that stepped so far (a
        validation runs before its batch counts: at the global step, its values sat one step to the right of the
        training values and of a user's own ``self.log`` of the same validation); outside one, the global step."""
        trainer = self._trainer_or_none()
        if self._resume_checkpoint is not None and not getattr(self, "_loaded_outside_fit", False):  # (before
            # Lightning restores its loops: what is logged as a resume sets up, at the checkpoint's step)
            loops = self._resume_checkpoint.get("loops") or {}
            state = (loops.get("fit_loop") or {}).get("epoch_loop.state_dict") or {}
            return int(state.get("_batches_that_stepped", self._global_step()))
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        fitting = trainer is not None and trainer.state.fn == "fit" and trainer.state.status == "running"
        return getattr(loop, "_batches_that_stepped", self._global_step()) if fitting else self._global_step()

    def _write_metrics(self, metrics: dict[str, float], step: int) -> None:
        """To the loggers (straight: through ``self.log`` Lightning kept an adapter's last values after it ended and
        wrote them again at every logging step), and those a callback monitors to ``trainer.callback_metrics``."""
        trainer = self._trainer_or_none()
        if trainer is None:
            return
        self._monitor(metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _monitor_step(self, logs: dict[str, dict[str, float]]) -> None:
        """This step's per-adapter values that a callback monitors, in ``callback_metrics`` before the callbacks'
        ``on_train_batch_end``. Under adapter parallelism every rank's at once, where a callback monitors one
        (a ModelCheckpoint on another rank's adapter's ``train_loss`` saw it a step late; its owner entered the
        checkpoint's collective alone and the ranks hung): the same decision on every rank (their callbacks)."""
        trainer = self._trainer_or_none()
        placement = self._placement()
        if placement is not None and trainer is not None and any(
                _monitored_adapter(cb) is not None for cb in trainer.callbacks):
            logs = placement.exchange(dict(logs))
        self._monitor({k: v for values in logs.values() for k, v in values.items()})

    def _monitor(self, metrics: dict[str, float]) -> None:
        """Put the values a callback monitors (``ModelCheckpoint(monitor="adapters/<name>/val_loss")``,
        ``EarlyStopping``...), and every validation's (``adapters/<name>/val_loss``...: a few a validation), in
        ``trainer.callback_metrics``, where Lightning's callbacks and a user's read them (the module writes its values
        to the loggers itself, and ``self.log`` would cost ~0.3 ms a value a step)."""
        trainer = self._trainer_or_none()
        if trainer is None:
            return
        monitored = {getattr(cb, "monitor", None) for cb in trainer.callbacks}
        for key in metrics:  # (every step's values pass here: a suffix test, not a split, a key)
            if key in monitored or key.endswith(_VALIDATION_METRICS):
                trainer.callback_metrics[key] = torch.tensor(float(metrics[key]))

    def _settle_monitors(self) -> None:
        """Before the callbacks' ``on_validation_end``: an ``EarlyStopping`` monitoring one adapter that is not training
        (queued, paused or ended; or started at this step, not yet measured) finds no value and skips the validation
        (an ended adapter's last value, read again and again, stopped the whole run; a queued one's missing key
        failed the fit). `_restore_monitors` puts the values back for a ``ModelCheckpoint``, which runs after every
        other callback."""
        from lightning.pytorch.callbacks import EarlyStopping

        trainer = self._trainer_or_none()
        self._popped_monitors = {}
        for callback in trainer.callbacks if trainer is not None else ():
            name = _monitored_adapter(callback)
            if name is None or not isinstance(callback, EarlyStopping):
                continue
            rec = self.registry[name] if name in self.registry else None
            if rec is not None and rec.state == AdapterState.RUNNING and rec.step > 0:  # (one that started at this
                continue  # step was not measured: `validation_roster`)
            key = callback.monitor
            if key in trainer.callback_metrics:
                self._popped_monitors[key] = trainer.callback_metrics.pop(key)
            callback.strict = False  # (skips a validation without the value: the adapter's, when it runs)
            if rec is not None and rec.state.exited and not getattr(callback, "_multilora_told", False):
                callback._multilora_told = True
                rank_zero_warn(f"EarlyStopping(monitor={key!r}): adapter {name!r} has ended ({rec.state.value}); it "
                               "stops nothing from here (EarlyExit stops each adapter on its own curve)")

    def _restore_monitors(self) -> None:
        """After the other callbacks' ``on_validation_end``, before a ``ModelCheckpoint``'s: the values
        `_settle_monitors` took back (in ``trainer.callback_metrics`` again, whoever monitors them), and for an adapter
        a ``ModelCheckpoint`` monitors without one yet (queued) its ``mode``'s worst, so that it ranks last (Lightning
        fails the fit on a monitored key that is missing)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self._trainer_or_none()
        if trainer is None or trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        popped, self._popped_monitors = getattr(self, "_popped_monitors", {}), {}
        for callback in trainer.callbacks:
            name = _monitored_adapter(callback)
            if not isinstance(callback, ModelCheckpoint) or name is None:
                continue
            if name in self.registry and _unlogged_monitor(callback, spec=self.registry[name].spec) is not None \
                    and self.registry[name].state == AdapterState.RUNNING:  # (a typo of a value its adapter would
                continue  # have logged by now: Lightning's error names the keys logged; a subclass's own waits too)
            key = callback.monitor
            if key not in trainer.callback_metrics:
                trainer.callback_metrics[key] = popped.pop(key, torch.tensor(
                    math.inf if callback.mode == "min" else -math.inf))
        for key, value in popped.items():  # (every value taken back: the EarlyStoppings have run)
            trainer.callback_metrics.setdefault(key, value)

    def align_batches(self, batches: list) -> list:
        """Under adapter parallelism, pad this rank's batches with empty ones to the largest count of any rank:
        every rank then runs as many base forwards (FSDP's all-gathers need them all)."""
        placement = self._placement()
        if placement is None:
            return batches
        most = int(placement.reduce(torch.tensor(len(batches), device=self.device), reduce_op="max").item())
        return batches + [self._datamodule().pack([], []) for _ in range(most - len(batches))]

    def _reference_forward_needed(self, here: bool) -> bool:
        """Whether DPO's reference forward runs this step: where this process has DPO rows; under adapter
        parallelism on every rank when any rank has some (the base's forward is a collective there)."""
        placement = self._placement()
        if placement is None:
            return here
        if not any(r.spec.objective == "dpo" for r in self.registry):  # the same registry on every rank
            return False
        flag = torch.tensor(int(here), device=self.device)
        return bool(placement.reduce(flag, reduce_op="max").item())

    def _idle_forward(self, reference: bool = True) -> None:
        """A rank with nothing to validate: one dummy row through the base, so the collectives match (and a
        second one when another rank runs DPO's reference forward, unless ``reference`` is False)."""
        with torch.no_grad(), self.lora_layers.use(None):
            self.lora_layers.model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=self.device))
        if reference and self._reference_forward_needed(False):
            self._idle_forward(reference=False)

    def _idle_step(self) -> None:
        """A rank with no adapter: run the base forward and backward anyway (FSDP's collectives need every
        rank), on one dummy row, the embeddings' output made to require grad."""
        embed = self.lora_layers.model.get_input_embeddings()
        hook = embed.register_forward_hook(lambda module, args, out: out.detach().requires_grad_(True))
        try:
            ids = torch.zeros(1, 8, dtype=torch.long, device=self.device)
            out = self.lora_layers.model(input_ids=ids).logits
            if self._reference_forward_needed(False):  # another rank's DPO reference forward, before backward
                self._idle_forward(reference=False)
            self.manual_backward(out.float().sum() * 0.0)
        finally:
            hook.remove()

    def _export_root(self) -> Path:
        """Where the adapters' folders go: `export_dir`, else the run's log directory's ``adapters`` (a smoke run's,
        ``fast_dev_run``, a temporary one's, `log_dir_of`, `export_dir` or not)."""
        trainer = self._trainer_or_none()
        if self.export_dir is not None and not (trainer is not None and trainer.fast_dev_run):
            return Path(self.export_dir).expanduser()  # (a YAML's "~/exports" made a folder named "~" here)
        if trainer is not None:
            return Path(log_dir_of(trainer)) / "adapters"
        return Path("adapters").absolute()  # (outside any fit: the record names where, whatever the directory later)

    def _check_hosted(self) -> None:
        """The module was set up for a fit: `init_multilora` called, on a model that is one of its submodules (one
        that is not, the adapters' weights are not the module's parameters: no checkpoint held them, and a resume
        restarted them from fresh weights, silently)."""
        if not isinstance(getattr(self, "lora_layers", None), LoRALayers):
            raise RuntimeError(f"{type(self).__name__} never called `self.init_multilora(model, ...)` (in its "
                               "__init__, after `super().__init__()`): MultiLoRAMixin has no adapters to train")
        model = self.lora_layers.model
        if not any(m is model for m in self.modules()):
            raise RuntimeError(f"the model given to `init_multilora` is not a submodule of {type(self).__name__}: "
                               "assign it to an attribute (`self.model = model`), or its adapters are not among the "
                               "module's parameters: not moved to the device, not saved in checkpoints")

    def _trainer_or_none(self) -> Optional[L.Trainer]:
        return getattr(self, "_trainer", None)

    def _datamodule(self, use: str = ""):
        """The Trainer's MultiLoRADataModule; ``use``: what needs it, said where there is no Trainer (`evaluate`...)."""
        trainer = self._trainer_or_none()
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        if trainer is None and use == "evaluate":  # (`load_from_checkpoint`: `evaluate` was pointed to a fit)
            raise UsageError("the module is attached to no Trainer, whose MultiLoRADataModule `evaluate` reads: "
                             "measure its adapters with `trainer.validate(module, "
                             "datamodule=MultiLoRADataModule(...))` (their losses logged as adapters/<name>/val_loss, "
                             "and returned), or call `evaluate` during a fit (from a callback's hook)")
        if trainer is None:
            raise UsageError(f"the module is attached to no Trainer, whose MultiLoRADataModule {use or 'this'} reads: "
                             "call it during a fit (from a callback's hook)")
        if dm is None or not hasattr(dm, "num_train_examples"):
            given = f"; got {type(dm).__name__}" if dm is not None else (
                "; a DataLoader's batches are not the packed batches it makes (each row an adapter's)" if trainer is not
                None and any(getattr(getattr(loop, "_data_source", None), "instance", None) is not None
                             for loop in (trainer.fit_loop, trainer.validate_loop)) else "")
            raise UsageError("the module needs a MultiLoRADataModule: `trainer.fit(module, datamodule="
                             f"MultiLoRADataModule(...))` (`trainer.validate` likewise){given}")
        return dm

    def _cannot_start(self, rec: AdapterRecord, err: ValueError) -> None:
        """A queued adapter that cannot start fails: before the first step the run stops at once, with the error;
        later (an adapter added, or a trial asked, mid-run) that adapter fails alone, and the others train on:
        nothing they learned is lost to a crash. A run refused so leaves the adapter queued: a fit after the fix (the
        source added, the budget raised) starts it (marked failed, it was skipped there without a word)."""
        if self._global_step() == 0:
            raise err if isinstance(err, UsageError) else UsageError(str(err)) from err
        rec.state, rec.reason = AdapterState.FAILED, str(err)
        rec.ended_at_step = self._run_step()
        warnings.warn(f"adapter {rec.name!r} could not start: {err}")
        self._notify_exit(rec)

    def startable(self, specs: Sequence[AdapterSpec]) -> list[AdapterSpec]:
        """Of ``specs``, in their order, those that could start (or resume) now beside the running adapters and the
        ones before them: within `max_running` and, with an ``admission`` controller, its memory budget (each rank's,
        under adapter parallelism). With no adapter running, the first is always among them."""
        running = [r.spec for r in self.registry.running]
        resident = self._resident([s.name for s in specs])
        chosen: list[AdapterSpec] = []
        for spec in specs:
            if self.max_running is not None and len(running) + len(chosen) >= self.max_running:
                break
            # (beside it, the paused ones asked about and not chosen, which stay held: left out, resuming the kept
            # ones of a warmup selection went over the budget by one held adapter per one still waiting)
            waiting = [PausedSpec(s) for s in specs if s is not spec and s not in chosen and s.name in self.registry
                       and self.registry[s.name].state == AdapterState.PAUSED]
            if self.admission is not None and (running or chosen) and \
                    not self.admitted(resident + chosen + waiting, [spec]):
                continue
            chosen.append(spec)
        return chosen

    def _resident(self, leaving_out: Sequence[str] = ()) -> list[Any]:
        """What the ``admission`` controller weighs candidates beside: the running adapters' specs, and the paused
        ones' as `PausedSpec` (their weights and optimizer states stay in memory; their rows are not in the batch),
        but for ``leaving_out`` (those being resumed)."""
        return [r.spec for r in self.registry.running] + [PausedSpec(r.spec) for r in self.registry.paused
                                                          if r.name not in leaving_out]

    def _warn_paused_fill(self, spec: AdapterSpec) -> None:
        paused = self.registry.paused
        names = ", ".join(repr(r.name) for r in paused[:3]) + (", ..." if len(paused) > 3 else "")
        warnings.warn(f"the {len(paused)} paused adapters ({names}) hold "
                      "weights and optimizer states that leave no room, by the admission controller's memory model, "
                      f"for any queued adapter; {spec.name!r} starts anyway (nothing else would train): end or resume "
                      "paused adapters sooner (WarmupSelection), or raise the controller's capacity_bytes or "
                      "safety_margin if its model over-counts")

    def admitted(self, running: Sequence[AdapterSpec], candidates: Sequence[AdapterSpec],
                 freed: Optional[AdapterSpec] = None) -> list[AdapterSpec]:
        """The ``admission`` controller's choice of ``candidates`` to start beside ``running`` (under adapter
        parallelism each rank's adapters against its memory: `AdapterParallelStrategy.select_admitted`)."""
        placement = self._placement()
        if placement is not None and hasattr(placement, "select_admitted"):
            return placement.select_admitted(self.admission, running, candidates, freed)
        return self.admission.select(running, candidates, freed)

    def _check_memory_model(self) -> None:
        """Warns where the admission controller's analytic memory model (`AnalyticMemoryModel.of_specs`, alone or as
        `fit_predictor`'s ``beyond``) describes another base than this module's: its own defaults are a bf16 base with
        gradient checkpointing, and a float32 or unchecked base then admitted several times what fits."""
        from lightning_multilora.scheduling.admission import size_text
        from lightning_multilora.scheduling.memory import AnalyticMemoryModel

        analytic = getattr(getattr(self.admission, "predict", None), "analytic", None)
        if not isinstance(analytic, AnalyticMemoryModel):
            return
        try:
            actual = AnalyticMemoryModel.of_module(self.lora_layers.model)
        except ValueError:  # (a base without a Llama-style config: nothing to compare with)
            return
        differs = []
        if not 0.9 <= analytic.base_bytes() / actual.base_bytes() <= 1.1:
            differs.append(f"it counts {size_text(analytic.base_bytes())} of base weights, the base holds "
                           f"{size_text(actual.base_bytes())}")
        if analytic.gradient_checkpointing != actual.gradient_checkpointing:
            on = {True: "on", False: "off"}
            differs.append(f"its gradient_checkpointing is {on[analytic.gradient_checkpointing]}, the base's "
                           f"{on[actual.gradient_checkpointing]}")
        precision = str(getattr(self._trainer_or_none(), "precision", ""))
        computes = 2.0 if "16" in precision else actual.activation_bytes
        if analytic.activation_bytes < computes:
            differs.append(f"its activation_bytes is {analytic.activation_bytes:g}, the base computes in {computes:g}"
                           f"-byte values")
        if differs:
            cast = (f" (the Trainer's precision={precision!r} casts the base before this: of a module built before, "
                    "give `base_weight_bytes` of the cast base)" if precision.endswith("-true")
                    and precision not in ("32-true", "64-true") else "")
            rank_zero_warn(f"the admission controller's AnalyticMemoryModel does not describe this module's base: "
                           f"{'; '.join(differs)}. It may admit adapters that do not fit (or fewer than fit): build it "
                           "with AnalyticMemoryModel.of_module(module), its fields' overrides as keyword arguments"
                           + cast)

    def _admit(self) -> None:
        """Start queued adapters while slots are free (and, with an admission controller, while they fit)."""
        queued = list(self.registry.queued)
        placement = self._placement()
        checked: dict[str, Any] = {}  # adapter -> its targets, checked here
        if self._global_step() == 0:  # before the first step, every queued adapter's data and `init_from` folder:
            checked = self._check_agreed([rec.spec for rec in queued])  # one that waits for a slot would otherwise
            for rec in queued:  # fail only when it starts, the run long under way
                if isinstance(checked[rec.name], ValueError):
                    self._cannot_start(rec, checked[rec.name])
        if self.admission is not None and not getattr(self, "_memory_model_checked", False):  # (each fit's first)
            self._memory_model_checked = True
            self._check_memory_model()
        if self.admission is not None and queued:
            for rec in [r for r in queued if not self.admission.fits([r.spec])]:  # it would wait forever
                self._cannot_start(rec, ValueError(
                    f"{self.admission.alone(rec.spec)}, so it can never start (lower its batch_size, or raise the "
                    "AdmissionController's capacity_bytes or safety_margin)"))
                queued.remove(rec)
        while self.admission is not None and queued:
            by_name = {r.name: r for r in queued}
            chosen = self.admitted(self._resident(), [r.spec for r in queued], self._freed_spec)
            if not chosen and not self.registry.running:  # (paused adapters fill the budget: one starts anyway, or
                first = queued[0]  # none ever would)
                self._warn_paused_fill(first.spec)
                chosen = [first.spec]
            # the data and `init_from` folders of those that start now (within `max_running`: one that waits is read
            # at its own start, its folder perhaps written by then), before they take the budget: one that cannot
            # start fails, and the choice is made again without it (it held its share a step, the others waiting)
            starting = chosen if self.max_running is None else \
                chosen[:max(0, self.max_running - len(self.registry.running))]
            unchecked = [spec for spec in starting if spec.name not in checked]
            if unchecked:
                checked.update(self._check_agreed(unchecked))
            failing = [by_name[spec.name] for spec in starting if isinstance(checked[spec.name], ValueError)]
            for rec in failing:
                self._cannot_start(rec, checked[rec.name])
                queued.remove(rec)
            if not failing:
                queued = [by_name[spec.name] for spec in chosen]
                break
        self._freed_spec = None
        for rec in queued:
            if self.max_running is not None and len(self.registry.running) >= self.max_running:
                break
            spec = rec.spec
            try:  # a misspelled `dataset`, an unreadable file, an `init_from` folder that does not fit: here, on
                # every rank, not at a batch or in one rank's weights
                targets = checked[spec.name] if spec.name in checked else self._check_agreed([spec])[spec.name]
                if isinstance(targets, ValueError):
                    raise targets
                if rec.max_steps is None:
                    if spec.max_steps is not None:
                        rec.max_steps = spec.max_steps
                    else:
                        steps_per_epoch = math.ceil(self._datamodule().num_train_examples(spec.dataset) / spec.batch_size)
                        rec.max_steps = steps_of_epochs(spec.max_epochs, steps_per_epoch)
                        if spec.warmup_steps >= rec.max_steps:  # (said of `max_steps` as the spec is made)
                            rank_zero_warn(warmup_past_the_end(spec, rec.max_steps))
            except ValueError as err:
                self._cannot_start(rec, err)
                continue
            rec.state, rec.reason = AdapterState.RUNNING, ""
            rec.started_at_step = self._run_step()
            rec.open_span(rec.started_at_step)
            if placement is not None:
                placement.place([r.spec for r in self.registry.running])
                if not placement.owns(rec.name):
                    continue  # another rank trains it
            self._create_weights(rec, targets=targets)
            optimizer = self._raw_optimizer()
            if optimizer is not None:
                # a placeholder group (a rank that started with no adapter) goes once a real one arrives
                for group in [g for g in optimizer.param_groups if g.get("placeholder")]:
                    for q in group["params"]:
                        optimizer.state.pop(q, None)
                    optimizer.param_groups.remove(group)
                optimizer.add_param_group(self._param_group(spec))
                self._warn_unused_decay(optimizer, [spec])

    def _create_weights(self, rec: AdapterRecord, checkpoint: Optional[dict] = None, targets: Any = None) -> None:
        """Adapter ``rec``'s weights: a fresh initialisation, or its `AdapterSpec.init_from` folder's; with
        ``checkpoint`` (a resume, which loads the weights next) fresh ones in the checkpoint's layers. ``targets``:
        its `_targets_of`, where the caller has them."""
        self._step_graphs.clear()  # a new layout anyway; the graphs' memory is freed now rather than later
        spec = rec.spec
        # (a resume's adapter from an `init_from` folder: the layers the checkpoint holds, the folder not needed)
        if checkpoint is not None and spec.init_from:
            targets = self._checkpoint_layers(checkpoint, spec.name)
        elif targets is None:
            targets = self._targets_of(spec)
        self.lora_layers.add_adapter(spec.name, spec.rank, spec.alpha, spec.dropout, spec.use_rslora, targets,
                                     spec.seed)
        if spec.init_from and checkpoint is None:
            try:
                self.lora_layers.load_peft_state_dict(spec.name, init_from_weights(spec))
            except ValueError as err:
                self.lora_layers.remove_adapter(spec.name)
                raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r}: {err}") from None

    def _check_agreed(self, specs: Sequence[AdapterSpec]) -> dict[str, Any]:
        """`check_startable` of each of ``specs``: its targets, or the ValueError that says why it cannot start. Under
        adapter parallelism every rank checks, and an adapter one rank refuses is refused on every rank with the
        error of the first rank that refused it (naming that rank where others did not), so that ranks agree on
        which adapters start even where a folder or data file changed between their reads: one collective for all
        ``specs``."""
        checked: dict[str, Any] = {}
        placement = self._placement()
        for spec in specs:
            try:
                checked[spec.name] = self.check_startable(spec)
            except ValueError as err:
                checked[spec.name] = err
            except Exception as err:  # a bug's error (the data check names a source's own as a ValueError): in one
                if placement is None or not hasattr(placement, "exchange"):  # process, raised as it is
                    raise
                # (under adapter parallelism every rank must agree: this adapter's, with where it came from)
                frame = traceback.extract_tb(err.__traceback__)[-1]
                checked[spec.name] = ValueError(f"adapter {spec.name!r} cannot start: {type(err).__name__}: {err} "
                                                f"(raised at {frame.filename}:{frame.lineno})")
                checked[spec.name].__cause__ = err
        if placement is not None and hasattr(placement, "exchange") and specs:
            mine = {name: str(v) for name, v in checked.items() if isinstance(v, ValueError)}
            refused = placement.exchange({placement.global_rank: mine})
            for name in {n for part in refused.values() for n in part}:
                by = [rank for rank in sorted(refused) if name in refused[rank]]
                message = refused[by[0]][name] + ("" if len(by) == len(refused) else f" (on rank {by[0]})")
                if str(checked[name]) != message:
                    checked[name] = ValueError(message)
        return checked

    def check_startable(self, spec: AdapterSpec) -> Any:
        """Could ``spec``'s adapter start now? Its data (`MultiLoRADataModule.check`) and its targets and
        `init_from` folder (`check_targets`) are checked; a ValueError says what is wrong. Returns its target
        modules (`_targets_of`)."""
        self._datamodule("`check_startable`").check(spec)
        self._check_kernel_rank(spec)
        return self.check_targets(spec)

    def _check_kernel_rank(self, spec: AdapterSpec) -> None:
        """An adapter of a rank above the Triton kernels' (`kernels.TRITON_MAX_RANK`) where they run (CUDA, by
        default) cannot start: refused naming it (at its first forward the whole fit stopped, "the Triton path
        supports ranks up to 256", every adapter with it)."""
        from lightning_multilora.kernels import TRITON_MAX_RANK, resolve_backend

        if spec.rank <= TRITON_MAX_RANK:
            return
        dtype = next((p.dtype for p in self.lora_layers.model.parameters() if p.is_floating_point()), torch.float32)
        try:
            backend = resolve_backend(torch.empty(0, device=self.device, dtype=dtype))
        except ValueError:  # (a backend that cannot run here at all: the layers' own call says so)
            return
        if backend == "triton":
            raise ValueError(f"adapter {spec.name!r}: rank {spec.rank} is above the Triton kernels' "
                             f"{TRITON_MAX_RANK}; give it a rank <= {TRITON_MAX_RANK}, or run every adapter on the "
                             "reference path, `lightning_multilora.kernels.set_backend('reference')` (slower)")

    def check_targets(self, spec: AdapterSpec) -> Any:
        """``spec``'s target modules (`_targets_of`), checked against the injected layers, and its `init_from`
        folder: a plain LoRA adapter of its rank and alpha, with weights that fit the layers it targets (a
        ValueError says what is wrong). Reads no data."""
        shapes = init_from_shapes(spec) if spec.init_from else None  # (the folder read once)
        targets = self._targets_of(spec, shapes=shapes)
        if spec.init_from:
            try:
                self.lora_layers.check_peft_shapes(spec.name, spec.rank, targets, shapes)
            except ValueError as err:
                raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r}: {err}") from None
        return targets

    def _targets_of(self, spec: AdapterSpec, queued: bool = False, shapes: Optional[dict] = None) -> Any:
        """The target modules of ``spec``'s adapter, checked against the injected layers: its own, or the layers its
        `init_from` folder holds, or the module's default. ``queued``: the adapter is being queued, and its
        `init_from` folder is read at the start of the fit or at its admission instead (`check_startable`): a resume,
        whose checkpoint holds the weights, does not need the folder, which may be gone or hold another adapter.
        ``shapes``: the folder's `init_from_shapes`, where the caller has read them."""
        if spec.init_from and spec.target_modules is None:
            if queued:
                return None  # (the folder's layers, read when it starts)
            layers = init_from_layers(spec, shapes)
            outside = sorted(set(layers) - set(self.lora_layers))
            if outside:
                raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r} holds weights for layers "
                                 f"this module does not wrap {outside[:4]}; give the module `target_modules` that "
                                 f"take them (it wraps {len(self.lora_layers)} layers, e.g. "
                                 f"{list(self.lora_layers)[:2]})")
            return "|".join(re.escape(n) for n in layers)  # (exactly those: a full name matches its suffixes too)
        targets = spec.target_modules or self.default_target_modules
        try:
            chosen = self.lora_layers.layers_for(targets)
        except ValueError as err:  # (which adapter of a grid's or a sweep's; and a PEFT user's `lm_head`: the fix)
            unwrapped = self.lora_layers.unwrapped_matches(targets, heads=True)
            hint = (f"; {unwrapped[:3]} are linear modules the module does not wrap: add them to its "
                    f"`target_modules` ({self.default_target_modules!r} now) for an adapter to take them"
                    if unwrapped else "")
            raise ValueError(f"adapter {spec.name!r}: {err}{hint}") from None
        given = queued and spec.target_modules not in (None, "all-linear")  # ("all-linear": all the module wraps)
        outside = self.lora_layers.unwrapped_matches(targets) if given else []
        if outside:  # (a list naming none of the wrapped modules is an error; a regex, or a name some of whose
            # modules are wrapped (`q_proj` of a module that wraps layer 0's alone), adapts what it finds)
            rank_zero_warn(f"adapter {spec.name!r}: its `target_modules` {targets!r} also match linear modules the "
                           f"module does not wrap ({outside[:3]}...: {len(outside)}), which it cannot adapt; it gets "
                           f"{len(chosen)} layers (an adapter's targets choose among the module's `target_modules`, "
                           f"{self.default_target_modules!r})")
        if spec.init_from and not queued:
            held = init_from_layers(spec, shapes)
            if set(held) != set(chosen):
                raise ValueError(
                    f"adapter {spec.name!r}: `init_from` {spec.init_from!r} holds weights for other layers than its "
                    f"`target_modules` {targets!r} select: only there {sorted(set(held) - set(chosen))[:4]}, only "
                    f"targeted {sorted(set(chosen) - set(held))[:4]} (leave `target_modules` None to take the "
                    "folder's layers)")
        return targets

    def _checkpoint_layers(self, checkpoint: dict, name: str) -> str:
        """The layers a checkpoint holds adapter ``name``'s weights in, as a regex of their names (the layers of an
        `init_from` folder, read when it started: a resume does not need the folder)."""
        full = {m: n for n, m in self.named_modules()}
        saved = checkpoint["state_dict"]
        return "|".join(re.escape(layer) for layer in self.lora_layers
                        if f"{full[self.lora_layers[layer]]}.lora_A.{name}" in saved)

    @staticmethod
    def _warn_unused_decay(optimizer: torch.optim.Optimizer, specs: Sequence[AdapterSpec]) -> None:
        """Said (once: one text) where ``specs`` set a `weight_decay` that ``optimizer`` has none of (Rprop...)."""
        if any(spec.weight_decay for spec in specs) and "weight_decay" not in optimizer.defaults:
            warnings.warn(f"{type(optimizer).__name__} has no `weight_decay`: the adapters' `weight_decay` is not "
                          "applied; choose an optimizer with one (torch.optim.AdamW), or set it to 0", stacklevel=3)

    def _param_group(self, spec: AdapterSpec) -> dict[str, Any]:
        params = self.lora_layers.optimizer_parameters(spec.name, self.optimizer_class in ELEMENTWISE_OPTIMIZERS)
        return {"params": params, "lr": self._next_lr(self.registry[spec.name]), "weight_decay": spec.weight_decay,
                "adapter": spec.name, "name": f"adapters/{spec.name}"}  # (LearningRateMonitor's series: its name)

    @staticmethod
    def _next_lr(rec: AdapterRecord) -> float:
        """The learning rate of adapter ``rec``'s next step (its schedule at ``rec.step``), which its group holds
        between steps: a `LearningRateMonitor` reads the groups as a batch starts."""
        spec = rec.spec
        if rec.max_steps is None:
            return spec.lr
        return spec.lr * lr_factor(spec.lr_schedule, rec.step, rec.max_steps, spec.warmup_steps)

    def _raw_optimizer(self) -> Optional[torch.optim.Optimizer]:
        trainer = self._trainer_or_none()
        if trainer is None or not trainer.optimizers:
            return None
        return trainer.optimizers[0]

    def _exit(self, rec: AdapterRecord, state: AdapterState, reason: str) -> None:
        """Export a running or paused adapter (its best-validation weights when they are kept), then free
        its weights, optimizer state and data position. Under adapter parallelism a rank that does not hold it only
        marks it ended (its owner exports it)."""
        if self._owns(rec.name):
            try:
                self.save_adapter(rec.name, best=self.keep_best_weights)
            except OSError as err:  # (a full disk, a folder made read-only: the adapter is kept as it is, held)
                raise RuntimeError(
                    f"adapter {rec.name!r} ({state.value} at its step {rec.step}: {reason}) could not be exported: "
                    f"{type(err).__name__}: {err}; the fit stops here, its adapters exported as they are where they "
                    "can be: once the export folder can be written, resume from the last checkpoint") from err
            optimizer = self._raw_optimizer()
            if optimizer is not None:
                for i, group in enumerate(optimizer.param_groups):
                    if group.get("adapter") == rec.name:
                        for p in group["params"]:
                            _unlist_paged(optimizer.state.pop(p, None))
                        del optimizer.param_groups[i]
                        break
            self.lora_layers.remove_adapter(rec.name)
            self._step_graphs.clear()  # the graphs that read its weights would otherwise keep them alive
        rec.state, rec.reason, rec.ended_at_step = state, reason, self._run_step()
        rec.close_span(rec.ended_at_step)
        last = rec.val_losses[-1] if rec.val_losses else None
        measured = last is not None and last[0] == rec.step and math.isfinite(last[1])
        if state == AdapterState.FAILED and reason.startswith("non-finite loss") and rec.exported_step == rec.step \
                and not measured:  # (its weights exported gave that loss: not a model to load; those a validation
            rec.exported_val_loss = math.inf  # measured finite at this step, before the failure, keep its loss)
        if rec.export_path is not None and self._owns(rec.name) and Path(rec.export_path).is_dir():
            self._describe_export(Path(rec.export_path), rec, rec.exported_step, rec.exported_val_loss,
                                  rec.exported_val_preference_accuracy)
        self._release(rec.name)
        self._notify_exit(rec)

    def _release(self, name: str) -> None:
        """What an adapter that has left held beside its weights: its kept best weights and its data position."""
        self._best_weights.pop(name, None)
        trainer = self._trainer_or_none()
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        if dm is not None and hasattr(dm, "release"):
            dm.release(name)

    def _replace_with_record(self, rec: AdapterRecord) -> None:
        """An adapter this module holds that ended elsewhere since: a trial the checkpoint this run resumed from holds,
        told after it by the run that wrote it, which concluded and exported it (`OptunaSweep`, before the optimizer
        is built). Its weights are dropped unexported (that run's export stands: the checkpoint's weights, written
        over it, were older than it) and ``rec`` is its record."""
        if rec.name in self.lora_layers.adapter_names:
            self.lora_layers.remove_adapter(rec.name)
            self._step_graphs.clear()
        self._release(rec.name)
        self.registry.replace_record(rec)

    def _drop_rows_of_stopped(self, batch: dict[str, Any]) -> None:
        """The batch is drawn before the callbacks' ``on_train_batch_start``: an adapter paused or removed there still
        had rows in it (a removed one's crashed the step, "no adapter 'a'"; a paused one trained a step more, past
        its ``max_steps`` where that was its last). Their rows are left to the base alone (no loss, no step), and a
        paused adapter's data position goes back to before them: it takes them when it resumes."""
        layout: BatchLayout = batch["layout"]
        running = {n for n in layout.names if n in self.registry and self.registry[n].state == AdapterState.RUNNING}
        if len(running) == len(layout.names):
            return
        trainer = self._trainer_or_none()
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        drawn, streams = getattr(dm, "_drawn_from", {}), getattr(dm, "_streams", {})
        for name in layout.names:
            rec = self.registry[name] if name in self.registry else None
            if rec is not None and rec.state == AdapterState.PAUSED and name in drawn and name in streams:
                streams[name].load_state_dict(drawn[name])
        batch["layout"] = layout.keeping(running)

    def _global_step(self) -> int:
        if self._resume_checkpoint is not None:  # resuming: the trainer's step is restored after the optimizer
            return int(self._resume_checkpoint.get("global_step", 0))
        trainer = self._trainer_or_none()
        return int(trainer.global_step) if trainer is not None else 0

    def _run_step(self) -> int:
        """The run's step, on which adapters' slot spans and start and end steps count: this fit's Trainer step plus
        the steps the run took before this fit's Trainer began (earlier fits of this module, or of the checkpoint it
        was loaded from), one axis across fits (a later fit's spans began at 0 again, over the earlier ones')."""
        if self._resume_checkpoint is not None and not getattr(self, "_loaded_outside_fit", False):  # (a
            # `ckpt_path` resume, before Lightning restores the Trainer's step: the checkpoint's own run step)
            offset = (self._resume_checkpoint.get("multilora") or {}).get("step_offset", 0)
            return int(self._resume_checkpoint.get("global_step", 0)) + int(offset)
        trainer = self._trainer_or_none()
        if trainer is None or self.__dict__.get("_run_steps_of") != id(trainer):  # (outside a fit: after one, or
            # `load_from_checkpoint`, or a `trainer.validate`'s Trainer at step 0: the run's steps so far)
            return self.__dict__.get("_steps_done", 0)
        return self.__dict__.get("_step_offset", 0) + int(trainer.global_step)

    def _begin_run_steps(self, trainer: L.Trainer) -> None:
        """A fit sets up (`ExportOnException.setup`): the run's steps before its Trainer's present step (0 for a new
        Trainer; a Trainer fitted again goes on from its step) are this fit's offset (`_run_step`)."""
        self._step_offset = self.__dict__.get("_steps_done", 0) - int(trainer.global_step)
        self._run_steps_of = id(trainer)

    def _end_run_steps(self, trainer: L.Trainer) -> None:
        """A fit ends or stops: the run's steps so far, which a later fit of this module goes on from (a fit refused
        before its set-up counted none: the last fit's stand)."""
        if self.__dict__.get("_run_steps_of") == id(trainer):
            self._steps_done = self._run_step()

    # -- Lightning hooks ------------------------------------------------------------------------

    def _fill_slots(self) -> None:
        """Let candidate providers (callbacks with ``fill_slots(trainer, module)``, e.g. OptunaSweep) queue
        adapters for the free slots, then admit from the queue."""
        trainer = self._trainer_or_none()
        for callback in (trainer.callbacks if trainer is not None else []):
            fill = getattr(callback, "fill_slots", None)
            if fill is not None:
                fill(trainer, self)
        self._admit()

    def _check_export_root(self) -> None:
        """The export root can take the adapters' folders, checked as the fit starts (an adapter is exported as it
        finishes: a root that cannot hold them would otherwise be found after training). Nothing is made here: the
        root's nearest existing folder must be one that can be written (a run that exports nothing leaves no folder)."""
        root = self._export_root()
        existing = root.absolute()

        def refuse(why: str) -> ValueError:
            return ValueError(f"`export_dir` {str(root)!r} cannot hold the adapters' exports: {why}")

        try:
            while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
                existing = existing.parent
            if existing.is_symlink() and not existing.exists():
                raise refuse(f"{str(existing)!r} is a link to nothing ({os.readlink(existing)!r})")
            if not existing.is_dir():
                raise refuse(f"{str(existing)!r} is a file")
        except OSError as err:  # (a folder on the way that cannot be searched)
            raise refuse(f"{err}") from err
        if not os.access(existing, os.W_OK | os.X_OK):
            raise refuse(f"{str(existing)!r} is not writable")

    @override
    def configure_optimizers(self):
        self._check_export_root()
        self._not_loaded = set()  # (Lightning has loaded a resumed checkpoint's weights by now)
        placement = self._placement()
        self._refuse_loaded_under_placement("fit")
        if placement is not None:  # one run id and line on every rank (each stamps the exports it writes): rank 0's
            self._run_id, self._lineage = placement.decide_on_rank_zero(lambda: (self._run_id, self._lineage))
        owners = getattr(self, "_carried_owners", None)
        if placement is not None and self._resume_checkpoint is None and owners and not placement.owner:
            # another fit of this module under adapter parallelism: each rank holds the weights it trained, so the
            # adapters keep their owners (the new strategy knew none: every rank idled, holding its adapters)
            placement.owner = {n: r for n, r in owners.items() if r < placement.world_size}
        if self._resume_checkpoint is not None and self._placement() is not None:
            # A checkpoint is written by a callback's on_train_batch_end, before the module's: under adapter
            # parallelism the step's exchange and its finished adapters were not settled in it. Settle them now,
            # as the uninterrupted run did after that step.
            self._sync_ranks()
            self._finish_together()
        elif self._placement() is None:  # an adapter at its max_steps still running: its finishing validation (and
            # export) was cut short, by an error or Ctrl+C there; it finishes now, not one step past its length
            self._after_step(list(self.registry.running))
        self._fill_slots()  # after a checkpoint is restored, before the optimizer is built
        self.lora_layers.rebind()  # the flat parameters the groups hold follow any move since their adapters came
        records = [r for r in self.registry.holding_weights if self._owns(r.name)]
        groups = [self._param_group(r.spec) for r in records]
        if not groups and self._placement() is not None and self.registry.running:
            # this rank holds no adapter yet: an empty group keeps the optimizer valid until one arrives
            groups = [{"params": [nn.Parameter(torch.zeros(0, device=self.device))], "lr": 0.0, "adapter": None,
                       "placeholder": True}]
        if not groups and len(self.registry) and all(r.state.exited for r in self.registry):
            ended = ', '.join(f'{r.name}: {r.state.value}' for r in self.registry)
            exports = sorted(r.export_path for r in self.registry if r.export_path)
            raise (RunEnded if self._resume_checkpoint is not None else UsageError)(
                f"nothing to train: every adapter has already ended ({ended}); "
                + (f"their exports: {', '.join(exports)}; " if exports else "") + (
                "resuming a finished run trains nothing (new AdapterSpecs given to the module are queued on resume)"
                if self._resume_checkpoint is not None else
                "add new ones (`module.add_adapter(AdapterSpec(...))`) to train more with this module"))
        if not groups:
            raise UsageError("no adapter to train: add at least one AdapterSpec (all are queued out or exited)")
        on_cuda = any(p.is_cuda for g in groups for p in g["params"])
        if self.optimizer_kwargs.get("differentiable"):  # (torch's error came after a whole forward and backward, "a
            # leaf Variable that requires grad is being used in an in-place operation", as though the user's own)
            raise UsageError("`optimizer_kwargs` differentiable=True: each adapter's weights are leaf parameters the "
                             "step updates in place, which a differentiable step cannot do; leave it unset")
        if self.optimizer_kwargs.get("capturable") and not on_cuda:
            raise UsageError("`optimizer_kwargs` capturable=True needs the adapters on a CUDA device (a step CUDA "
                             "graphs capture); on the CPU leave it unset")
        optimizer_class, kwargs = _optimizer_choice(self.optimizer_class, self.optimizer_kwargs, on_cuda)
        takes = _constructor_arguments(optimizer_class)
        # Each group holds its adapter's lr (its schedule's, 0 at a warmup's start); the constructor gets the first
        # adapter's peak too, so that the optimizer's own checks of it run (Adafactor's relative_step, which ignores
        # every group's rate) and one whose lr has no default (bitsandbytes' SGD8bit) can be built
        peak = next((rec.spec.lr for rec in records), 1e-3)
        if takes is None or "lr" in takes:
            kwargs = {"lr": peak, **kwargs}
        try:
            optimizer = optimizer_class(groups, **kwargs)
        except (TypeError, ValueError, AssertionError, RuntimeError) as err:  # (torch's fused + foreach: Runtime)
            if not self.optimizer_kwargs and isinstance(err, (TypeError, RuntimeError)):  # (not the user's: as it is)
                raise
            given = (f"`optimizer_kwargs` {self.optimizer_kwargs!r} rejected by {optimizer_class.__name__}"
                     if self.optimizer_kwargs else f"`optimizer` {optimizer_class.__name__} refused its settings")
            hint = ("; set optimizer_kwargs={'relative_step': False, 'scale_parameter': False, 'warmup_init': False} "
                    "for each adapter's lr to apply" if "relative_step" in str(err) else "")
            raise UsageError(f"{given}: {err} (with each adapter's `lr` given, the first {peak:g}){hint}") from err
        self._warn_unused_decay(optimizer, [rec.spec for rec in records])
        carried, self._carried_optimizer = getattr(self, "_carried_optimizer", None), None
        if self._resume_checkpoint is not None:
            saved = self._resume_checkpoint.get("multilora", {}).get("optimizer_classes")
            _match_optimizer_state(self._resume_checkpoint, optimizer, self._flat_optimizer_state, saved,
                                   self._per_layer_optimizer_state)
            if self.__dict__.pop("_loaded_outside_fit", False):  # (`load_from_checkpoint`, then a fit without
                # `ckpt_path`: Lightning loads no optimizer state; the module's adapters go on with theirs)
                states = self._resume_checkpoint.get("optimizer_states")
                if states:
                    optimizer.load_state_dict(states[0])
                else:
                    rank_zero_warn("the checkpoint this module was loaded from holds no optimizer state (saved with "
                                   "weights only): its adapters go on with new optimizer states")
            self._resume_checkpoint = None
        elif carried is not None:  # another fit of this module: its adapters go on with their optimizer states
            _match_optimizer_state(carried, optimizer, self._flat_optimizer_state, carried["optimizer_classes"],
                                   self._per_layer_optimizer_state)
            optimizer.load_state_dict(carried["optimizer_states"][0])
        self._optimizer_built = True
        return optimizer

    def _carry_optimizer_state(self) -> None:
        """The fit ends (or stops): its optimizer's state is kept for a later fit of this module, whose adapters
        then go on as a resume from a checkpoint does (a new optimizer restarted every adapter's AdamW moments and
        step counts, silently); so are the states of the callbacks that judge its adapters, where some have not
        ended (`carried_callback_state`)."""
        trainer = self._trainer_or_none()
        if trainer is None or trainer.state.fn != "fit":
            return
        self._memory_model_checked = False  # (the next fit may hold another controller, or run at another precision)
        self._end_run_steps(trainer)
        if self.__dict__.pop("_fit_started", False):  # (a fit refused before its first step keeps the last one's)
            left = any(not rec.state.exited for rec in self.registry)
            self._carried_callbacks = [(type(cb).__qualname__, cb.state_key, copy.deepcopy(cb.state_dict()))
                                       for cb in trainer.callbacks if getattr(cb, "carries_state", False)
                                       ] if left else []
        optimizer, placement = self._raw_optimizer(), self._placement()
        streams = getattr(trainer.datamodule, "state_dict", lambda: {})()
        if isinstance(streams, dict) and isinstance(streams.get("streams"), dict):  # (for a new data module given
            self._carried_positions = dict(streams["streams"])  # to the next fit: its adapters' data go on too)
        if placement is not None:
            self._carried_owners = dict(placement.owner)
        if optimizer is not None and any(g.get("adapter") is not None for g in optimizer.param_groups):
            state = optimizer.state_dict()  # (after an exception, on the GPU still: copied, so as not to pin it there)
            state["state"] = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                              for i, s in state["state"].items()}
            self._carried_optimizer = {"optimizer_states": [state], "optimizer_classes": _optimizer_classes(optimizer)}

    def carried_data_positions(self) -> Optional[dict[str, dict[str, int]]]:
        """The data positions (`MultiLoRADataModule`'s stream states, by adapter) the last fit of this module stopped
        at, or the checkpoint it was loaded from holds: a data module new to the next fit takes them for the adapters
        that go on (it started their data over, some examples seen twice and some never)."""
        return getattr(self, "_carried_positions", None)

    def carried_callback_state(self, callback: L.Callback) -> Optional[dict[str, Any]]:
        """The state ``callback`` (`EarlyExit`, `WarmupSelection`, `OptunaSweep`: ``carries_state``) had as the last
        fit of this module stopped with adapters left (a fit that ends before its first step keeps it for the
        next): its own (by ``state_key``), or its class's where one alone was kept (settings changed). Such a
        callback's ``setup`` loads it, the same object or a new one,
        so that another fit goes on as a resume from a checkpoint does (a checkpoint's state loads after it): a
        warmup selection kept its paused candidates out of the ranking for good, and EarlyExit's averages and
        patience counters started over. None after a fit whose adapters all ended: the next one starts afresh."""
        carried = getattr(self, "_carried_callbacks", [])
        own = [entry for entry in carried if entry[1] == callback.state_key]
        if not own:
            own = [entry for entry in carried if entry[0] == type(callback).__qualname__]
        return copy.deepcopy(own[0][2]) if len(own) == 1 else None

    def _flat_optimizer_state(self, name: str, per_layer: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        """A saved optimizer state of adapter ``name``'s per-layer parameters (a checkpoint written before adapters
        were held flat, or by a per-tensor optimizer) as the state of its flat parameter; None if it does not fit."""
        flat = self.lora_layers.flat_adapter(name)
        params = self.lora_layers.parameters_of(name)
        if flat is None or len(per_layer) != len(params) or any(s is None for s in per_layer):
            return None
        state: dict[str, Any] = {}
        for key in per_layer[0]:
            values = [s.get(key) for s in per_layer]
            if all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params)):
                state[key] = flat.flatten(values)  # moments: laid out as the flat parameter
            elif all(torch.is_tensor(v) and v.numel() == 1 for v in values) or all(not torch.is_tensor(v) for v in values):
                state[key] = values[0]  # the step count: the same for every tensor of an adapter
            else:
                return None
        return state

    def _per_layer_optimizer_state(self, name: str, flat: Optional[dict[str, Any]],
                                   count: int) -> Optional[list[dict[str, Any]]]:
        """A saved optimizer state of adapter ``name``'s flat parameter as the states of its ``count`` per-layer
        parameters (a per-tensor optimizer now, or a model now split over devices); None if it does not fit."""
        params = self.lora_layers.parameters_of(name)
        if flat is None or len(params) != count:
            return None
        states: list[dict[str, Any]] = [{} for _ in params]
        for key, value in flat.items():
            parts = unflatten(value, params) if torch.is_tensor(value) and value.dim() == 1 else None
            if parts is not None:  # moments: one per parameter
                for state, part, param in zip(states, parts, params):
                    state[key] = part.to(param.device)
            elif not torch.is_tensor(value) or value.numel() == 1:
                for state in states:  # the step count: every tensor's
                    state[key] = value.clone() if torch.is_tensor(value) else value
            else:
                return None
        return states

    @override
    def on_train_start(self) -> None:
        self._added_before_start = {}
        self.__dict__.pop("_held_signals", None)  # (an earlier fit's, whose batch ended on another error)
        self._fit_started = True  # (its callbacks' states are carried to the next fit: `_carry_optimizer_state`)
        if self.keep_best_weights:  # (an earlier fit without EarlyExit kept no snapshot of its best: where the best
            for rec in self.registry:  # is the adapter's step, its weights now are the best's)
                if (rec.best_val_step == rec.step >= 0 and rec.name not in self._best_weights
                        and rec.name in self.lora_layers.adapter_names and self._owns(rec.name)):
                    self._keep_best_weights(rec.name)
        self._validate_the_resumed_step()
        if self.trainer.lr_scheduler_configs:  # (a subclass's configure_optimizers returned one)
            raise ValueError("a learning-rate scheduler from `configure_optimizers` would never be stepped (the module "
                             "sets each adapter's rate every step): give each adapter its own schedule, "
                             "`AdapterSpec(lr_schedule='cosine' | 'linear' | 'constant', warmup_steps=...)`")
        placement = self._placement()
        left = [r.name for r in self.registry if not r.state.exited]
        providers = any(callable(getattr(cb, "fill_slots", None)) for cb in self.trainer.callbacks)
        if placement is not None and len(left) < placement.world_size and not providers:
            rank_zero_warn(f"adapter parallelism over {placement.world_size} ranks with {len(left)} adapter"
                           f"{'s' if len(left) != 1 else ''} to train: {placement.world_size - len(left)} rank(s) "
                           "hold none and only join the base's forward and backward; use fewer devices, or more "
                           "adapters (a grid, an OptunaSweep)")
        dropout, keys = _base_dropout(self.lora_layers.model)
        if dropout and (self.max_running is None or self.max_running > 1) and len(self.registry) > 1:
            zeros = {key: 0.0 for key in keys or ["attention_dropout"]}
            rank_zero_warn(
                f"the frozen base applies dropout (or router noise) in training ({dropout}): its masks come from one "
                "random stream that the adapters sharing a step draw from, so each adapter's training depends on "
                "which adapters share its steps (it no longer trains exactly as it would alone). Set the base's "
                f"dropout to 0 for isolated runs (`config_overrides`, e.g. {zeros}, or the model's config), or keep it "
                "for its regularisation" + ("; PhiMoE's router samples whatever its config says (`max_running=1` "
                                            "trains one adapter at a time)" if "PhiMoE" in dropout else ""))

        short = _longrope_limit(getattr(self.lora_layers.model, "config", None))
        longest = getattr(getattr(self.trainer, "datamodule", None), "effective_max_length", None)
        if short is not None and (longest is None or longest > short) and len(self.registry) > 1 \
                and (self.max_running is None or self.max_running > 1):
            rank_zero_warn(f"the base's RoPE is LongRoPE (rope_type 'longrope'): it switches every row of a batch to "
                           f"its long factors once the batch's longest row passes original_max_position_embeddings="
                           f"{short}, so an adapter packed beside longer rows trains (and is validated) on other "
                           "positions' frequencies than alone; for isolated runs keep rows within it "
                           f"(`MultiLoRADataModule(max_length={short})`), or train long-row adapters apart")

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self._stepped = True
        self.__dict__.pop("_resumed_validation", None)  # (`_validate_the_resumed_step`: none was due)
        self._drop_rows_of_stopped(batch)
        self.__dict__["_stops_held"] = {}  # (a removal or pause a hook asks inside the step: once it is taken)
        try:
            total = self._train_step(batch)
        except BaseException:
            self.__dict__["_stops_held"] = None  # (the adapters go as they are: a fit that ends exports them)
            raise
        self._release_stops()
        return total

    def _hold_stop(self, rec: AdapterRecord, kind: str, *args: Any) -> bool:
        """Whether a ``kind`` stop ("remove", "pause": `remove_adapter` / `pause_adapter` with ``args``) of ``rec``,
        asked by a hook inside a training step (before or after its backward, before its optimizer step) or a
        validation (its batches, or a callback's ``on_validation_epoch_end``), waits for it to end: then ``rec``'s
        step is whole (its weights, counts and data position of one step) and its validation measured and recorded.
        Made then, one an adapter: a pause asked again (its state still running meanwhile) is the one asked, a
        removal replaces a pause."""
        held = self.__dict__.get("_stops_held")
        if held is None or rec.state not in (AdapterState.RUNNING, AdapterState.PAUSED):
            return False
        if not (kind == "pause" and rec.name in held):
            held[rec.name] = (kind, args)
        return True

    def _release_stops(self) -> None:
        """The stops `_hold_stop` kept, made (one of an adapter that ended meanwhile, its last step taken: none; a
        pause of one no longer running: none)."""
        held, self.__dict__["_stops_held"] = self.__dict__.get("_stops_held"), None
        for name, (kind, args) in (held or {}).items():
            state = self.registry[name].state
            if state == AdapterState.RUNNING or (kind == "remove" and state == AdapterState.PAUSED):
                getattr(self, f"{kind}_adapter")(*args)

    def _train_step(self, batch: dict[str, Any]) -> Tensor:
        """`training_step`'s work: the packed forward and backward, the adapters' optimizer steps and counts."""
        layout: BatchLayout = batch["layout"]
        if not layout.names:
            # Nothing runs this step: every running adapter exited after the last step's settling (e.g. at a
            # validation), or, under adapter parallelism, this rank has none. The step's end refills the slots,
            # lets the callbacks decide (warmup selection), or stops the run.
            if self._placement() is not None:
                self._idle_step()  # FSDP's collectives need this rank in the base's forward and backward
            # A step with no gradients (a no-op) so that the global step advances (with the other ranks'): the
            # checkpoint and validation decisions that follow it must be the same on every rank.
            self.optimizers().step()
            self._monitor_step({})
            return torch.zeros((), device=self.device)
        records = [self.registry[n] for n in layout.names]
        optimizer = self.optimizers()
        # Once a step, outside any CUDA graph (a replay reads the shadows its capture read), before the step's
        # parameters and graph key are taken (a replaced storage is held flat again here)
        self.lora_layers.refresh_shadows(layout.names)
        params = [self.lora_layers.step_parameters(r.name) for r in records]  # one flat tensor per adapter
        scaler = getattr(self, "_loss_scaler", None)
        self._step_scales = None if scaler is None else self._scales_of(records, scaler, batch["input_ids"].device)
        losses, norms, total = self._run_forward_backward(batch, records, params)
        # A Ctrl+C (or an error) from here until the step is taken leaves it untaken: the dropout masks, fp16 loss
        # scales and states the adapters had before it (the counts move after `optimizer.step()`)
        kept = [(rec, rec.loss_scale, rec.scale_growth, rec.skipped_steps, rec.state, rec.reason) for rec in records]
        try:
            tokens = segment_sum(batch["attention_mask"].sum(dim=1), layout)
            stats = torch.stack([losses.detach().float(), norms.float(), tokens.float()]).tolist()  # one sync
            logs: dict[str, dict[str, float]] = {}  # per adapter
            optim = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
            groups = {g.get("adapter"): g for g in optim.param_groups}
            stepped = []
            for i, rec in enumerate(records):
                loss, norm, n_tok = stats[0][i], stats[1][i], stats[2][i]
                prefix = f"adapters/{rec.name}/"
                scale = rec.loss_scale if scaler is not None else None
                if scale is not None:
                    norm = norm / scale
                    if math.isfinite(loss) and not math.isfinite(norm) and scale > 1.0:
                        # the scaled gradient overflowed: the step is skipped, the adapter's scale backs off
                        self.lora_layers.drop_grads(rec.name)
                        rec.loss_scale, rec.scale_growth = scale * scaler["backoff"], 0
                        rec.skipped_steps += 1
                        logs[rec.name] = {prefix + "loss_scale": rec.loss_scale}
                        continue
                if not (math.isfinite(loss) and math.isfinite(norm)):
                    self.lora_layers.drop_grads(rec.name)
                    what = "loss" if not math.isfinite(loss) else "gradient norm"
                    rec.state = AdapterState.FAILED
                    rec.reason = (f"non-finite {what} ({loss if what == 'loss' else norm}) in step {rec.step + 1} "
                                  f"(its steps done: {rec.step})")
                    if scale is not None and what != "loss":
                        rec.reason += f" at loss scale {scale:g}"
                    continue
                spec = rec.spec
                if scale is not None:  # unscaled (and clipped) in one multiply
                    clip = (spec.grad_clip / (norm + 1e-6) if spec.grad_clip is not None and norm > spec.grad_clip
                            else 1.0)
                    torch._foreach_mul_([p.grad for p in params[i] if p.grad is not None], clip / scale)
                    rec.scale_growth += 1
                    if rec.scale_growth >= scaler["interval"]:
                        rec.loss_scale, rec.scale_growth = scale * scaler["growth"], 0
                elif spec.grad_clip is not None and norm > spec.grad_clip:
                    torch.nn.utils.clip_grads_with_norm_(params[i], spec.grad_clip, norms[i])
                lr = groups[rec.name]["lr"] = self._next_lr(rec)  # (what the group holds already, but for a group
                # restored from a checkpoint that held the rate of the step before it)
                stepped.append((rec, int(n_tok), (layout.ends[i] - layout.starts[i]) * spec.batch_size
                                // spec.rows_per_step, loss))
                logs[rec.name] = {prefix + "train_loss": loss, prefix + "grad_norm": norm, prefix + "lr": lr}
                if scale is not None:
                    logs[rec.name][prefix + "loss_scale"] = rec.loss_scale
                if rec.name in getattr(self, "_preference_rewards", {}):  # (a DPO adapter's)
                    accuracy, chosen, rejected = self._preference_values(rec.name)
                    logs[rec.name].update({prefix + "preference_accuracy": accuracy, prefix + "rewards_chosen": chosen,
                                           prefix + "rewards_rejected": rejected,
                                           prefix + "rewards_margin": chosen - rejected})
        except BaseException:
            self._untake_step(layout, kept)
            raise
        # Each adapter's parameters' versions and its optimizer state's step counts before the optimizer's step, which
        # updates the adapters' groups one after another (torch's optimizers loop over them): an error inside it (out
        # of memory as a new adapter's state is made) may come after some adapters took it (`_moved`). Those are
        # counted as having taken it, the others not (a step taken again from the same batch updated the first ones
        # twice). A Ctrl+C (or SIGTERM, SIGHUP) is held until the step is taken and counted (`stop_signals_deferred`):
        # with any optimizer, it stops the run between steps; in one process, raised to its handler at the end of the
        # batch (`on_train_batch_end`: its exits settled and values logged, and a checkpoint written by a handler
        # resumes to run that step's validation where one is due, as a checkpoint written at a batch's end does);
        # under adapter parallelism, as the step ends, before the step's exchange, which a rank that stopped would
        # leave the others waiting in.
        optim_params = [groups[rec.name]["params"] if rec.name in groups else params[i]
                        for i, rec in enumerate(records)]
        marks = [_step_marks(optim, ps) for ps in optim_params]
        signals_held: list[int] = []  # (signals held through the step: raised as the batch ends, in one process)
        with stop_signals_deferred(signals_held if self._placement() is None else None):
            try:
                optimizer.step()
            except BaseException:
                after = [_step_marks(optim, ps) for ps in optim_params]
                moved = {rec.name for i, rec in enumerate(records) if _moved(marks[i], after[i])}
                self._untake_step(layout, [k for k in kept if k[0].name not in moved], skip=moved)
                taken = [s for s in stepped if s[0].name in moved]
                if taken:
                    self._count_step(taken, logs, groups, [n for n in layout.names if n in moved])
                    counted = sorted(rec.name for i, rec in enumerate(records) if rec.name in moved
                                     and all(a[0] == b[0] for a, b in zip(marks[i], after[i])))
                    warnings.warn(f"the optimizer's step stopped after it updated adapters {sorted(moved)}: they "
                                  f"are counted as having taken step {taken[0][0].step} (the others take it "
                                  "again)" + (f"; {counted}: by their optimizer state's step counts, their weights "
                                              "showing no change (written through their addresses, as bitsandbytes "
                                              "does, or an update cut short inside it)" if counted else ""))
                raise
            self._count_step(stepped, logs, groups, None)
        if signals_held:
            self._held_signals = signals_held
        self._after_step(records)
        self._step_logs = logs  # logged in on_train_batch_end, where it is known whether a logger writes them
        # (monitored now: callbacks' on_train_batch_end, a ModelCheckpoint's among them, run before the module's)
        self._monitor_step(logs)
        return total.clone()  # (a replayed graph's output is overwritten by its next replay)

    def _untake_step(self, layout: BatchLayout, kept: Sequence[tuple], skip: Iterable[str] = ()) -> None:
        """A training step not taken (a Ctrl+C or an error after the backward): the dropout masks, fp16 loss scales
        and states the adapters had before it (``kept``), but for the adapters in ``skip`` (which took it)."""
        skip = set(skip)
        segments = [seg for seg in zip(layout.names, layout.starts, layout.ends) if seg[0] not in skip]
        if segments:
            names, starts, ends = zip(*segments)
            self.lora_layers.rewind_dropout(BatchLayout(names, starts, ends, layout.num_rows, layout.padding_side))
        for rec, scale, growth, skipped, state, reason in kept:
            rec.loss_scale, rec.scale_growth, rec.skipped_steps, rec.state, rec.reason = (scale, growth, skipped,
                                                                                          state, reason)

    def _count_step(self, stepped: Sequence[tuple], logs: dict[str, dict[str, float]], groups: dict[str, Any],
                    names: Optional[list[str]]) -> None:
        """The counts of the adapters of ``stepped`` once their optimizer step is taken (before: a Ctrl+C inside the
        step had its exports and checkpoint say a step their weights had not taken, and the resumed run left it
        out), and their data positions past the batch (``names``: of these adapters alone; None: every adapter's)."""
        for rec, n_tok, samples, loss in stepped:
            rec.step += 1
            rec.tokens_seen += n_tok
            rec.samples_seen += samples
            rec.train_losses.append((rec.step, loss))
            logs[rec.name][f"adapters/{rec.name}/tokens_seen"] = float(rec.tokens_seen)
            groups[rec.name]["lr"] = self._next_lr(rec)  # (what the next step takes, as the monitor reads it)
        trained = getattr(getattr(self._trainer_or_none(), "datamodule", None), "batch_trained", None)
        if trained is not None and names is None:  # (its data positions are past this batch now; before, still
            trained()  # before it)
        elif trained is not None:
            trained(names)

    def _forward_backward(self, batch: dict[str, Any], records: Sequence[AdapterRecord],
                          params: Sequence[Sequence[Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """A training step's device work: the packed forward, the adapters' gradients zeroed, the backward of the
        sum of the finite per-adapter losses, each adapter's gradient norm (over ``params``, its step
        parameters): ``(losses, norms, total)``."""
        with self.lora_layers.use(batch["layout"], refresh=False):  # (`training_step` refreshed the shadows)
            loss_sum, count = self._loss_terms(batch)
            losses = loss_sum / count.clamp(min=1)  # (N,) mean over each adapter's target tokens
            finite = torch.isfinite(losses)
            total = torch.where(finite, losses, torch.zeros_like(losses)).sum()
            scales = getattr(self, "_step_scales", None)  # fp16: each adapter's loss scale (`_take_loss_scaler`)
            if scales is not None:
                keep_alive(scales)  # (a graph being captured reads it at every replay)
            scaled = total if scales is None else torch.where(finite, losses * scales, torch.zeros_like(losses)).sum()
            # Zeroed in place, not dropped: the gradients keep their storage, so the LoRA backward adds into the
            # same tensors every step (no new buffers and device pointer tables per layer per step). Done once the
            # forward is queued: the device runs it meanwhile (before it, the device would wait for this host work).
            self.lora_layers.prepare_grads(*(rec.name for rec in records))
            if scaled.requires_grad:
                self.manual_backward(scaled)
        return losses.detach(), _grad_norms(params, losses), total.detach()

    def _scales_of(self, records: Sequence[AdapterRecord], scaler: dict[str, Any], device: torch.device) -> Tensor:
        """``(N,)`` on ``device``: the adapters' loss scales (an adapter starting at the scaler's initial one), in one
        tensor per adapter set, written in place (a captured step reads the same tensor at every replay)."""
        for rec in records:
            if rec.loss_scale is None:
                rec.loss_scale = scaler["init"]
        buffers = self.__dict__.setdefault("_scale_buffers", {})  # (the 32 most recent sets, the last last)
        key = (tuple(r.name for r in records), str(device))
        buffer, values = buffers.pop(key, (None, None))
        if buffer is None:
            buffer = torch.empty(len(records), dtype=torch.float32, device=device)
            if len(buffers) >= 32:  # (a graph that read an evicted one keys on its address: never replayed again)
                del buffers[next(iter(buffers))]
        scales = [r.loss_scale for r in records]
        if scales != values:  # (copied when they change, seldom: a copy from the host waits for the device)
            buffer.copy_(torch.tensor(scales, dtype=torch.float32))
        buffers[key] = (buffer, scales)
        return buffer

    def _run_forward_backward(self, batch: dict[str, Any], records: Sequence[AdapterRecord],
                              params: Sequence[Sequence[Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """`_forward_backward`, replayed from a CUDA graph where ``cuda_graphs`` is on and the step allows it."""
        key = self._graph_key(batch, records, params)
        if key is None:
            return self._forward_backward(batch, records, params)
        layout = batch["layout"]

        def device_step(input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            # Right-padded rows need no attention mask under a causal mask: every real token comes before the
            # padding. (With a mask, the model reads it on the host to choose its attention path.)
            with one_sequence_per_row():
                return self._forward_backward({"input_ids": input_ids, "attention_mask": None, "labels": labels,
                                               "layout": layout}, records, params)

        with self.lora_layers.refreshed_before_replays():
            return self._step_graphs(key, device_step, batch["input_ids"], batch["labels"])

    def _graph_key(self, batch: dict[str, Any], records: Sequence[AdapterRecord],
                   params: Sequence[Sequence[Tensor]]) -> Optional[tuple]:
        """What a captured step depends on besides the batch's values (None: this step runs eagerly): the layout,
        the adapters' flat parameters and gradients (by address), the mode and the autocast state."""
        graphs = self._step_graphs
        if not graphs.enabled or not batch["input_ids"].is_cuda:  # (a failed capture turned it off)
            return None
        if batch["layout"].padding_side != "right" or any(r.spec.objective != "sft" for r in records):
            return None  # a padding mask read on the host; DPO's reference forward indexes rows on the host
        if routes(self.lora_layers.model):  # (an MoE's router loss reads the padding mask, which a replay has not;
            return None  # and its experts' forward indexes the tokens routed to each on the host)
        placement = self._placement()
        if placement is not None and (getattr(placement, "base_shard_size", None) != 1
                                      or any(r.spec.objective == "dpo" for r in self.registry)):
            return None  # a sharded base's forward is a collective; so is the question of a DPO reference forward
        layout: BatchLayout = batch["layout"]
        if any(p.grad is None for group in params for p in group):
            # the step makes the gradient (a new or resumed adapter's): eagerly, since a replay runs no Python and
            # would never make it (an adapter paused and resumed again and again met its captured step with no
            # gradient, and stopped learning while its steps went on)
            return None
        # (and each one's shadow: a graph captured reading shadows must not replay once they are gone or renewed)
        bound = tuple((p.data_ptr(), p.grad.data_ptr(),
                       0 if (s := shadow_of(p)) is None or not self.lora_layers.shadows else s.tensor.data_ptr())
                      for group in params for p in group)
        device_type = batch["input_ids"].device.type
        autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
        scales = getattr(self, "_step_scales", None)
        scaled = scales.data_ptr() if scales is not None else None
        return layout.names, layout.starts, layout.ends, layout.num_rows, bound, self.training, autocast, scaled

    def _after_step(self, records: Sequence[AdapterRecord]) -> None:
        for rec in records:
            if rec.state == AdapterState.FAILED and rec.name in self.lora_layers.adapter_names:
                reason = rec.reason
                rec.state = AdapterState.RUNNING
                self._exit(rec, AdapterState.FAILED, reason)
            elif rec.state == AdapterState.RUNNING and rec.max_steps is not None and rec.step >= rec.max_steps:
                if self._placement() is not None:
                    continue  # finished together on every rank after the exchange (`_finish_together`)
                if self.validate_on_finish:
                    self.evaluate([rec.spec], record=True)
                self._exit(rec, AdapterState.FINISHED, _length_reached(rec))

    def _finish_together(self) -> None:
        """Under adapter parallelism: the adapters that reached their length are validated by all ranks at once
        (each rank its own), then their owners export and free them."""
        done = [r for r in self.registry.running if r.max_steps is not None and r.step >= r.max_steps]
        if not done:
            return
        if self.validate_on_finish:
            self.evaluate([r.spec for r in done], record=True)
        for rec in done:
            if self._owns(rec.name):
                self._exit(rec, AdapterState.FINISHED, _length_reached(rec))
        self._sync_ranks()  # the owners' exits reach every rank

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not getattr(self, "_stepped", True):  # (the run would never end: no adapter steps, none finishes)
            raise RuntimeError(f"{type(self).__name__}.training_step did not call super().training_step(batch, "
                               "batch_idx), which trains the adapters (forward, backward and their optimizer steps)")
        self._stepped = False
        # Callbacks' on_train_batch_end ran first: adapters they removed, paused or queued are settled here. Every
        # rank gets every adapter's values of the step (each rank computed its own adapters').
        stash, self._step_logs = self._step_logs, {}
        self._sync_ranks(step_logs=stash)
        if self._placement() is not None:
            self._finish_together()
        if not (0 <= self.trainer.max_steps <= self.trainer.global_step or self.trainer.should_stop):
            self._fill_slots()  # (after the last step nothing would train: an adapter admitted then exported untrained)
            if self.registry.paused and not self.registry.running and not self.registry.queued:
                self._fill_slots()  # (a provider may act on what another settled in this pass: a selection now due)
        counts = self.registry.counts()
        if not self.registry.running and not self.registry.queued:
            if self.registry.paused:  # nothing could resume them: the run ends, and `on_train_end` exports them
                warnings.warn(f"adapters {[r.name for r in self.registry.paused]} are paused and nothing is left to "
                              "run: the run stops here and exports them as they are (resume or remove paused "
                              "adapters to go on, at the latest in this step's validation's on_validation_end)")
            if not self.trainer.should_stop:  # (this step's validation may queue or resume one: `on_validation_end`)
                self._stopped_empty = (id(self.trainer), self.trainer.global_step)
            self.trainer.should_stop = True
        # an adapter's values when a logger writes them, and its last ones when it stops (exit, warmup pause)
        writes = self._logger_writes_this_step()
        logs = {k: v for name, values in stash.items()
                if writes or name not in self.registry or self.registry[name].state != AdapterState.RUNNING
                for k, v in values.items()}
        step = self._logged_step()
        if logs and self.trainer.loggers:  # (at the step Lightning writes a value logged here at)
            self._write_metrics(logs, step)
        # (the running adapters' values not written: those of one that stops at this step's validation are written
        # there, `_write_last_values`; an EarlyExit or a pruner's exit never had its last ones)
        self._unwritten = ({} if writes or not self.trainer.loggers else
                           {n: v for n, v in stash.items() if n in self.registry
                            and self.registry[n].state == AdapterState.RUNNING}, step)
        if self.trainer.progress_bar_callback is not None:
            exited = sum(v for k, v in counts.items() if AdapterState(k).exited)
            self.log_dict({"running": float(counts["running"]), "queued": float(counts["queued"]),
                           "paused": float(counts["paused"]), "exited": float(exited)}, prog_bar=True, logger=False,
                          on_step=True, on_epoch=False, batch_size=1)  # (paused: held, as a warmup's candidates are)
        held = self.__dict__.pop("_held_signals", None)
        if held:  # (a Ctrl+C, SIGTERM or SIGHUP held through the step's optimizer step: the batch is settled now)
            raise_signals(held)

    def _logger_writes_this_step(self) -> bool:
        """Whether a logger writes this step's values (every ``log_every_n_steps`` and at the stop). Lightning's
        ``log`` costs about 0.3 ms a value: with 4 values per adapter and 60 adapters, logging steps whose values
        are never written took 80 ms of host time per step."""
        connector = getattr(self.trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True))

    @override
    def on_fit_end(self) -> None:
        trainer = self._trainer_or_none()
        due = self.__dict__.pop("_due_on_resume", False)
        if trainer is None or trainer.state.fn != "fit" or trainer.ckpt_path is None \
                or self.__dict__.get("_fit_started", False):
            return
        # (a resume of a checkpoint at or past the Trainer's end: Lightning skips training, its start and end hooks,
        # and says only "`max_steps=N` reached"; a CLI run's new log folder then held no adapters, unsaid)
        at = f"this fit resumed a checkpoint written at step {trainer.global_step}"
        ends = f"(the Trainer's `max_steps` {trainer.max_steps}, `max_epochs` {trainer.max_epochs})"
        if due:  # (the checkpoint's validation, due, not run: training's start runs it, `_validate_the_resumed_step`)
            rank_zero_warn(f"{at} before that step's validation, and the run was done there {ends}: it trained "
                           "nothing, and that validation did not run (the adapters' validation histories, EarlyExit "
                           "and the sweep's trials lack it); resume with a larger `max_steps` to run it and go on")
        elif any(not rec.state.exited for rec in self.registry):
            folder = Path(str(trainer.ckpt_path)).parent.parent / "adapters"  # (a checkpoint written before the
            # run's end exports: that run's log folder's, where they went by default)
            kept = [f"{rec.name!r} {path}" for rec in self.registry if not rec.state.exited
                    for path in [rec.export_path or (folder / rec.name if (folder / rec.name).is_dir() else None)]
                    if path is not None]
            rank_zero_warn(f"{at}, where the run was done {ends}: it trained nothing and exported nothing (the "
                           f"adapters' exports are those the run wrote as it stopped{': ' if kept else ''}"
                           f"{', '.join(kept)}); resume with a larger `max_steps` (or `max_epochs`) to train on")

    @override
    def on_train_end(self) -> None:
        # Values and exits of the run's last validation or of callbacks' `on_train_end` (after the last step's
        # exchange) reach every rank (rank 0's loggers, its registry) before `on_fit_end`. Nothing trained is lost:
        # adapters still running (or paused) when training stops are exported as they are, before `on_fit_end`, where
        # callbacks (`SweepReport`) list the exports.
        self._sync_ranks()
        self._validate_held()
        failed = None
        try:
            self._export_held()
        except Exception as err:  # noqa: BLE001 - (every rank goes through the exchange below first: none waits)
            failed = err
        # (kept where Ctrl+C interrupts the exports: the exception's re-export holds the weights just measured; an
        # entry is of its adapter's step, so one kept is never taken for a later step's)
        self._end_losses = {}
        self._sync_ranks()  # the exports' paths and losses reach every rank (rank 0's report)
        if failed is not None:
            raise failed
        self._mark_branch_ended()

    def _validate_held(self) -> None:
        """Training stopped (the Trainer's ``max_steps`` or ``max_time``) with adapters held whose exports will hold
        their last weights, and that have stepped since their last validation: those weights are measured (not
        recorded: the run's history stays the one a resumed run goes on from), so that the loss reported for an
        export is its weights' (every rank, under adapter parallelism: a collective, on the registry's view)."""
        self._end_losses = {}
        trainer = self._trainer_or_none()
        if not self.validate_on_finish or trainer is None or trainer.limit_val_batches == 0:
            return
        stale = [r.spec for r in self.registry.holding_weights if r.step > 0
                 and not (self.keep_best_weights and r.best_val_step >= 0)  # (its best weights are exported)
                 and not (r.val_losses and r.val_losses[-1][0] == r.step)]
        if stale:  # (step, loss, DPO preference accuracy)
            self._end_losses = {n: (self.registry[n].step, _mean_loss(v[0], v[1]),
                                    v[2] / v[3] if v[3] > 0 else math.nan)
                                for n, v in self._evaluate_sums(stale).items()}

    def _held(self) -> list[AdapterRecord]:
        """The records of the adapters whose weights the model holds (not those a resume has made but not yet
        loaded from its checkpoint: their weights are new)."""
        return [r for r in self.registry.holding_weights
                if r.name in self.lora_layers.adapter_names and r.name not in self._not_loaded]

    def _export_held(self, untrained: bool = True) -> list[Path]:
        """Export every adapter whose weights the model holds (its best-validation weights where they are kept, the
        live ones left as they are: a checkpoint written after this holds the weights training goes on from),
        without those that have taken no step unless ``untrained``; the directories written."""
        paths, failed, first = [], [], None
        for rec in [r for r in self._held() if untrained or r.step > 0]:
            try:  # one adapter that cannot be written (a full disk, say) costs no other its export
                path = self.save_adapter(rec.name, best=self.keep_best_weights)
                if path is not None:  # (under adapter parallelism, another rank's adapter: its owner writes it)
                    paths.append(path)
            except Exception as err:  # noqa: BLE001 - reported below, after the others are written
                failed.append(f"{rec.name!r} ({type(err).__name__}: {err})")
                first = first or err
        if failed:
            err = RuntimeError(f"exporting {', '.join(failed)} failed; the other adapters were exported to "
                               f"{[str(p) for p in paths]}")
            self._exported_after = (id(err), paths)  # (the exception's export: done, not repeated)
            raise err from first
        return paths

    def export_after_exception(self, exception: BaseException) -> list[Path]:
        """Export the adapters the model holds after fit stopped on ``exception`` (`ExportOnException`, or a callback
        whose ``on_exception`` runs first and lists the exports, as `SweepReport` does), once per exception: the
        directories written. Adapters that have taken no step hold their initial weights and are named in the warning,
        not exported; an export that fails is a warning (the run's own exception is the one raised)."""
        done = getattr(self, "_exported_after", None)
        if done is not None and done[0] == id(exception):
            return done[1]
        trainer = self._trainer_or_none()
        if trainer is not None and trainer.state.fn != "fit":  # (a validate that failed: the fit's exports stand)
            return []
        if not self.__dict__.get("_fit_started", False):  # (stopped before this fit's first step: the weights held
            # are the last fit's or the checkpoint's, whose exports or file stand; written again, they moved the
            # adapters' export paths to a folder of a fit that trained nothing, or copied a checkpoint's weights out)
            self._exported_after = (id(exception), [])
            return []
        untrained = [r.name for r in self._held() if r.step == 0]
        paths: list[Path] = []
        try:
            paths = self._export_held(untrained=False)
        except Exception as err:  # noqa: BLE001 - the run's own exception is the one to raise
            warnings.warn(f"exporting the adapters after {type(exception).__name__} failed: {err}")
        else:
            not_exported = f"; {untrained} had taken no step and are not exported" if untrained else ""
            if paths:
                warnings.warn(f"fit stopped by {type(exception).__name__}: the adapters it held are exported to "
                              f"{[str(p) for p in paths]}{not_exported}")
            elif untrained:
                warnings.warn(f"fit stopped by {type(exception).__name__} before any adapter took a step: nothing "
                              f"to export{not_exported}")
        self._exported_after = (id(exception), paths)
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and self._placement() is not None:  # every rank stopped after the
            self._sync_ranks()  # same step (the strategy shares the signal there): the owners' exports reach them all
        return paths

    def configure_callbacks(self) -> list[L.Callback]:
        self._check_hosted()
        self._refuse_trainer_options()  # (Lightning calls this before it checks the Trainer's options itself)
        if self.trainer.state.fn == "fit":
            self._take_loss_scaler()
            # (Lightning's ModelCheckpoint warns every manual-optimization module that its step checkpoints hold the
            # weights after the step's update, and asks for a copy of them before it: after the update is the state
            # this module resumes from, the step counted done)
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization and "
                                                      "every_n_train_steps, but no pre-optimization state was saved")
        trainer = self._trainer_or_none()
        if getattr(self, "_best_kept_by_callback", False) and trainer is not None and trainer.state.fn == "fit":
            # an earlier fit's EarlyExit turned on best-weight exports: this fit's own callbacks decide (an EarlyExit
            # among them turns it on again in its setup, which runs after this)
            self.keep_best_weights = self._best_kept_by_callback = False
        return [ExportOnException()]

    def _refuse_trainer_options(self, trainer: Optional[L.Trainer] = None, fn: Optional[str] = None) -> None:
        """The Trainer's clipping and accumulation would act on all adapters at once; each adapter has its own. Said
        here, in the module's terms (Lightning's own error says to switch to automatic optimization). ``trainer`` and
        ``fn`` (its entry point): the ones about to run, where they are not yet attached (the CLI's check)."""
        trainer = trainer if trainer is not None else self.trainer
        fn = fn if fn is not None else trainer.state.fn
        if fn in ("test", "predict"):
            raise UsageError(f"`trainer.{getattr(fn, 'value', fn)}` has no step here: measure the adapters the module "
                             "holds with `trainer.validate` (or `module.evaluate(names)` during a fit), and generate "
                             "with `module.generate(adapters, input_ids)` or an adapter's export "
                             "(`PeftModel.from_pretrained(base, export_path)`)")
        if fn != "fit":
            return
        _refuse_strategy(trainer)
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0:
            raise UsageError(f"`Trainer(gradient_clip_val={clip})`: each adapter clips its own gradients, by its "
                             "`AdapterSpec.grad_clip` (a norm > 0, default 1.0, or None for no clipping); leave "
                             "`gradient_clip_val` unset")
        if trainer.accumulate_grad_batches != 1:
            raise UsageError(f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`: each adapter "
                             "takes `AdapterSpec.batch_size` sequences a step; leave `accumulate_grad_batches` at 1")
        if trainer.overfit_batches:
            raise UsageError(f"`Trainer(overfit_batches={trainer.overfit_batches})` would not repeat batches: each "
                             "adapter draws its own from its source every step; to overfit, give the source a few "
                             "examples (`ListSource`, or a source's `limit`)")
        limit = trainer.limit_val_batches
        if trainer.fast_dev_run:  # (Lightning's smoke run sets the limit itself: its losses are of a few batches)
            rank_zero_warn(f"`Trainer(fast_dev_run={trainer.fast_dev_run!r})`: a smoke run of {trainer.max_steps} "
                           f"step(s); its validations see {limit} batch(es) of the adapters' splits, so their losses "
                           "are not the splits' (the exports are written as in any run)")
        elif not (limit == 0 or (isinstance(limit, float) and limit >= 1.0)):  # (an int: batches; 0: none)
            raise UsageError(f"`Trainer(limit_val_batches={limit!r})` would validate part of each adapter's split, "
                             "and an adapter's last validation (as it ends) the whole of it, compared as one loss; "
                             "cap the split instead, `MultiLoRADataModule(max_val_examples=...)` (or "
                             "`limit_val_batches=0` for no validation during the run)")
        from lightning.pytorch.callbacks import (BatchSizeFinder, GradientAccumulationScheduler, LearningRateFinder,
                                                 StochasticWeightAveraging)

        for callback in trainer.callbacks:
            if isinstance(callback, LearningRateFinder):  # (`Tuner.lr_find` too; Lightning's own error asked for an
                # `lr` attribute of the model)
                raise UsageError("`LearningRateFinder` (or `Tuner.lr_find`) tunes one learning rate, and each adapter "
                                 "has its own, `AdapterSpec.lr`: search it with a `SweepGrid` axis or an `OptunaSweep` "
                                 "(with `EarlyExit` and `WarmupSelection` to stop the bad ones early)")
            if isinstance(callback, BatchSizeFinder):
                raise UsageError("`BatchSizeFinder` (or `Tuner.scale_batch_size`) tunes one batch size, and each "
                                 "adapter has its own, `AdapterSpec.batch_size`: the module's admission "
                                 "(`max_running`, `admission`) packs as many adapters as memory holds")
            if isinstance(callback, GradientAccumulationScheduler):
                raise UsageError("`GradientAccumulationScheduler` would accumulate every adapter's gradients at once: "
                                 "each adapter takes `AdapterSpec.batch_size` sequences a step; leave it out")
            if isinstance(callback, StochasticWeightAveraging):
                raise UsageError("`StochasticWeightAveraging` averages one model's weights from an epoch on, and the "
                                 "run is one endless epoch whose adapters come and go; leave it out (`EarlyExit` "
                                 "exports each adapter's best-validation weights)")
        fills = any(callable(getattr(cb, "fill_slots", None)) for cb in trainer.callbacks)
        for callback in trainer.callbacks:
            name = _monitored_adapter(callback)
            unlogged = _unlogged_monitor(callback, counts=trainer.progress_bar_callback is not None,
                                         spec=self.registry[name].spec if name in self.registry else None)
            if unlogged is not None:  # (Lightning fails the fit at the first validation, after its steps; a subclass
                # may log such a key itself: said, not refused)
                rank_zero_warn(f"`{type(callback).__name__}(monitor={callback.monitor!r})`: {unlogged}")
            if name is not None and name not in self.registry and not fills:  # (a sweep adds its trials later)
                rank_zero_warn(f"`{type(callback).__name__}(monitor={callback.monitor!r})` monitors adapter {name!r}, "
                               f"which the module does not have (yet); its adapters are "
                               f"{[r.name for r in self.registry]}")
        # (a time interval, "DD:HH:MM:SS" or a timedelta, leaves Lightning's `val_check_interval` unset: it validates
        # by the clock, also within the endless epoch)
        interval, limit_train = getattr(trainer, "val_check_interval", None), trainer.limit_train_batches
        endless = isinstance(limit_train, float) and limit_train == 1.0  # (an int is a number of batches)
        if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:  # (Lightning took 0: the
            # first step, then "integer modulo by zero")
            raise UsageError(f"`Trainer(val_check_interval={interval})`: give a number of steps >= 1 between "
                             "validations (`Trainer(limit_val_batches=0)` turns validation off)")
        if isinstance(interval, float) and interval != 1.0 and endless and not trainer.fast_dev_run:
            raise UsageError(f"`Trainer(val_check_interval={interval!r})` is a share of an epoch, and the run is one "
                             "endless epoch (the adapters draw their batches as long as they train): give an integer "
                             "number of steps, e.g. val_check_interval=50 with check_val_every_n_epoch=None")
        if isinstance(interval, float) and endless and trainer.check_val_every_n_epoch is not None \
                and not trainer.fast_dev_run and trainer.limit_val_batches != 0:  # (an epoch of `limit_train_batches`
            # ends: its validations run; `limit_val_batches=0` asks for none)
            rank_zero_warn(f"`Trainer(val_check_interval={interval!r})`: the run is one endless epoch, so no "
                           "validation runs during it (each adapter is validated as it ends); give an integer number "
                           "of steps, e.g. val_check_interval=50 with check_val_every_n_epoch=None, for the validation "
                           "losses that EarlyExit, WarmupSelection and OptunaSweep's pruner read")
        every = trainer.check_val_every_n_epoch
        if not isinstance(interval, float) and endless and every not in (None, 1) and not trainer.fast_dev_run \
                and trainer.limit_val_batches != 0:  # (validations in epochs every-1, 2*every-1...: never in epoch 0)
            rank_zero_warn(f"`Trainer(check_val_every_n_epoch={every})` validates once every {every} epochs, and the "
                           "run is one endless epoch: no validation runs during it (each adapter is validated as it "
                           "ends), so EarlyExit, WarmupSelection and OptunaSweep's pruner judge nothing and a "
                           "ModelCheckpoint that saves at validations writes none; give check_val_every_n_epoch=None")
        loop = trainer.fit_loop
        minimum = [f"min_steps={loop.min_steps}"] if loop.min_steps is not None else []  # (any: Lightning then
        # sets min_epochs=1, which the endless epoch never reaches)
        if loop.min_epochs and not (loop.min_epochs == 1 and loop.min_steps is not None):
            minimum.append(f"min_epochs={loop.min_epochs}")
        if minimum:  # (the run stopped once every adapter had ended: Lightning then stepped on with none, for ever)
            raise UsageError(f"`Trainer({', '.join(minimum)})`: the run ends when every adapter has (each after its "
                             "own `AdapterSpec.max_steps` or `max_epochs`); a minimum would keep it stepping with none "
                             "(within one endless epoch, never reached): leave it unset, and lengthen the adapters")
        if endless and loop.max_epochs not in (-1, 1000, None) and not trainer.fast_dev_run:  # (1000: Lightning's
            # default where none is given)
            rank_zero_warn(f"`Trainer(max_epochs={loop.max_epochs})` does not bound the run: it is one endless epoch, "
                           "each adapter drawing batches of its own data as long as it trains; an adapter's length is "
                           "its `AdapterSpec.max_steps` or `max_epochs` (over its own data); set max_epochs=-1")

    def _take_loss_scaler(self) -> None:
        """fp16 mixed precision's loss scaler (Lightning's ``precision="16-mixed"``: one factor for the whole loss,
        and an overflow anywhere skips every adapter's step) taken over by the module: each adapter scales its own
        loss, by a factor of its own that starts at the scaler's ``init_scale``, is multiplied by its
        ``backoff_factor`` where the adapter's gradient overflows (that adapter skips the step) and by its
        ``growth_factor`` after ``growth_interval`` steps without. The rows of a packed batch are each one adapter's,
        so an overflow in one adapter's gradients reaches no other's. The scaler goes back to the plugin when the
        fit ends."""
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        taken = getattr(self, "_taken_scaler", None)
        if scaler is None and taken is not None and taken[0] is plugin:  # (an earlier fit's, never given back)
            scaler = taken[1]
        self._loss_scaler = None
        if scaler is None:
            return
        if scaler.is_enabled():
            self._loss_scaler = {"init": float(scaler.get_scale()), "growth": float(scaler.get_growth_factor()),
                                 "backoff": float(scaler.get_backoff_factor()),
                                 "interval": int(scaler.get_growth_interval())}
        plugin.scaler, self._taken_scaler = None, (plugin, scaler)

    def _give_back_loss_scaler(self) -> None:
        taken, self._taken_scaler = getattr(self, "_taken_scaler", None), None
        if taken is not None:
            taken[0].scaler = taken[1]

    def evaluate(self, specs: Union[Sequence[Union[AdapterSpec, str]], AdapterSpec, str],
                 record: bool = False) -> dict[str, float]:
        """Validation loss of each adapter (specs or names; running or paused: their weights are the model's) over
        its whole validation split, packed, outside the loop. ``record`` adds them to the adapters' histories (and
        best weights) as a regular validation does. Under adapter parallelism, call it on every rank: each measures
        the adapters it holds, and every rank returns them all. The weights measured are those the module holds, the
        adapters' last: under `EarlyExit` an export holds its best validation's, which may be an earlier step's."""
        sums = self._evaluate_sums(specs, record)
        return {n: _mean_loss(v[0], v[1]) for n, v in sums.items()}

    def _evaluate_sums(self, specs: Union[Sequence[Union[AdapterSpec, str]], AdapterSpec, str],
                       record: bool = False) -> dict[str, list[float]]:
        """`evaluate`'s measure: each adapter's sums (`_add_val_terms`: loss sum and count, DPO pairs preferred,
        pairs, and rewards summed over them)."""
        if isinstance(specs, (AdapterSpec, str)):
            specs = [specs]
        elif not isinstance(specs, Iterable) or isinstance(specs, Mapping):
            raise TypeError("evaluate's `specs`: an adapter's name or AdapterSpec, or a list of them, got "
                            f"{type(specs).__name__} {specs!r}")
        specs = [self._held_spec(s, "evaluate", "specs") for s in specs]
        specs = list({s.name: s for s in reversed(specs)}.values())[::-1]  # (a name given twice measured once)
        dm = self._datamodule("evaluate")
        sums = {s.name: [0.0] * 6 for s in specs}
        trainer = self._trainer_or_none()
        # in the validation loop's precision (its autocast under "bf16-mixed"): called where the loop's context is
        # not open (at a step's end, to finish adapters together; after a fit), it measures what a validation would
        precision = trainer.precision_plugin.val_step_context() if trainer is not None else contextlib.nullcontext()
        with torch.no_grad(), _evaluating(self), precision:  # (each submodule's own mode restored after)
            for batch in self.align_batches(list(dm.val_batches([s for s in specs if self._owns(s.name)]))):
                batch = move_data_to_device(batch, self.device)
                if not batch["layout"].names:
                    self._idle_forward()
                    continue
                self._add_val_terms(sums, batch)
        placement = self._placement()
        if placement is not None:  # each rank measured its own adapters: every rank returns them all
            sums.update({n: v for n, v in placement.exchange({n: v for n, v in sums.items()
                                                              if self._owns(n)}).items() if n in sums})
        if record:  # under adapter parallelism a rank measures (and records) its own adapters, `_sync_ranks` the rest
            self._record_val_losses({n: v for n, v in sums.items() if self._owns(n)})
        return sums

    def generate(self, adapters: Sequence[Optional[str]], input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                 **kwargs: Any) -> Tensor:
        """Generate for a batch whose row ``i`` continues with adapter ``adapters[i]`` (None: the frozen base alone),
        every row in one ``generate`` of the base model (greedy unless ``kwargs`` say otherwise, ``do_sample`` or a
        ``generation_config``'s; ``kwargs`` are ``transformers``' ``generate`` arguments): several adapters compared
        on the same prompts in one pass, as if each were loaded alone. Prompts of different lengths are padded on
        the left, with their ``attention_mask``. The adapters are those the module holds (running or paused, as
        `evaluate` takes them). Returns the token ids ``generate`` returns, in the rows' order (``num_return_sequences``
        consecutive rows a prompt, with beam search or sampling). Per-row tensors in ``kwargs`` go with their rows;
        ``generate`` itself runs the rows grouped by adapter (the base's last), and a ``prefix_allowed_tokens_fn``
        (or ``return_dict_in_generate``) takes them so grouped, as a logits processor or stopping criterion sees them.
        The weights are the adapters' last, as `evaluate`'s. One process: under adapter parallelism the base is
        sharded; generate with the exports there (`PeftModel.from_pretrained`)."""
        if isinstance(adapters, str):  # (its letters were taken for names)
            raise ValueError(f"`adapters` names the adapter of each row of `input_ids`: a list, e.g. "
                             f"[{adapters!r}] * {len(input_ids)} for every row, got the string {adapters!r}")
        names = list(adapters)
        if not isinstance(input_ids, Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError("`input_ids` are token ids, an integer tensor (rows, tokens), got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.dim() != 2 or len(names) != input_ids.shape[0]:
            raise ValueError(f"`adapters` names one adapter (or None) a row of `input_ids` (rows, tokens): got "
                             f"{len(names)} for input_ids of shape {tuple(input_ids.shape)}")
        if not names:
            raise ValueError("`input_ids` has no rows: give at least one prompt")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"`attention_mask` is of shape {tuple(attention_mask.shape)}: it masks `input_ids`, of "
                             f"shape {tuple(input_ids.shape)}")
        if self._placement() is not None:
            raise ValueError("`generate` runs in one process; under adapter parallelism load an adapter's export with "
                             "PEFT (`PeftModel.from_pretrained(base, export_path)`) to generate with it")
        for name in dict.fromkeys(n for n in names if n is not None):
            self._held_spec(name, "generate", "adapters")
        first = {n: i for i, n in reversed(list(enumerate(names)))}
        order = sorted(range(len(names)), key=lambda i: (names[i] is None, first[names[i]], i))  # rows per adapter
        runs: list[list[Any]] = []  # [name, start, end] of each adapter's rows, in the sorted order
        for row, i in enumerate(order):
            if names[i] is None:
                break
            if runs and runs[-1][0] == names[i]:
                runs[-1][2] = row + 1
            else:
                runs.append([names[i], row, row + 1])
        layout = BatchLayout(tuple(r[0] for r in runs), tuple(r[1] for r in runs), tuple(r[2] for r in runs),
                             len(order), padding_side="left" if attention_mask is not None else "right")
        index = torch.tensor(order, dtype=torch.long, device=input_ids.device)
        inverse = torch.argsort(index)
        inputs = {"input_ids": input_ids[index].to(self.device)}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[index.to(attention_mask.device)].to(self.device)
        model = self.lora_layers.model
        context = self.lora_layers.context
        config = kwargs.get("generation_config") or model.generation_config
        if order != sorted(order) and kwargs.get("return_dict_in_generate", config.return_dict_in_generate):
            raise ValueError("`generate` with `return_dict_in_generate=True` takes rows grouped by adapter (each "
                             "adapter's rows together, the base's last), as its scores and beam indices follow "
                             f"the rows' order; got adapters {names}")
        if order != sorted(order) and kwargs.get("prefix_allowed_tokens_fn") is not None:
            raise ValueError("`generate` with `prefix_allowed_tokens_fn` takes rows grouped by adapter (each "
                             "adapter's rows together, the base's last), as the rows it is called with are "
                             f"generate's; got adapters {names}")
        if order != sorted(order):  # (another per-row tensor, GPT-2's token_type_ids say, goes with its row)
            kwargs = {k: v[index.to(v.device)] if isinstance(v, Tensor) and v.dim() and v.shape[0] == len(names)
                      else v for k, v in kwargs.items()}

        def rows_per_prompt(_module: nn.Module, args: tuple, model_kwargs: dict) -> None:
            # beam search and num_return_sequences run each prompt's copies as consecutive rows
            ids = model_kwargs.get("input_ids", args[0] if args else None)
            ids = model_kwargs.get("inputs_embeds") if ids is None else ids
            rows = layout.num_rows if ids is None else ids.shape[0]
            context.layout = layout_of(rows // layout.num_rows) if rows % layout.num_rows == 0 else layout

        layouts: dict[int, BatchLayout] = {1: layout}

        def layout_of(copies: int) -> BatchLayout:
            if copies not in layouts:
                layouts[copies] = BatchLayout(layout.names, tuple(s * copies for s in layout.starts),
                                              tuple(e * copies for e in layout.ends), layout.num_rows * copies,
                                              padding_side=layout.padding_side)
            return layouts[copies]

        hook = model.register_forward_pre_hook(rows_per_prompt, with_kwargs=True)
        try:
            with torch.no_grad(), _evaluating(self), self.lora_layers.use(layout):
                # (greedy, the model's own config's sampling aside, unless a config given says: a default `do_sample`
                # given as an argument overrode that of a `generation_config` given, which then decoded greedily)
                greedy = {} if {"do_sample", "generation_config"} & kwargs.keys() else {"do_sample": False}
                out = model.generate(**inputs, **greedy, **kwargs)
        finally:
            hook.remove()
        sequences = getattr(out, "sequences", out)  # (a `return_dict_in_generate` output holds them)
        self._warn_longrope_rows(input_ids, attention_mask, sequences.shape[-1] - input_ids.shape[1])
        if order == sorted(order):  # (rows already grouped by adapter, the base's last: as generate returned them)
            return out
        return out.view(len(names), -1, out.shape[-1])[inverse.to(out.device)].reshape(out.shape)

    def _warn_longrope_rows(self, input_ids: Tensor, attention_mask: Optional[Tensor], generated: int) -> None:
        """`generate` on a LongRoPE base (as the fit warns): every row of a batch takes the long factors once the
        batch's longest row passes ``original_max_position_embeddings`` (transformers reads the largest position of
        each forward), so a shorter row that never passed it alone, or passed it later, generated on other frequencies
        than alone. ``generated``: the new tokens each row got (the last one is never read back)."""
        short = _longrope_limit(getattr(self.lora_layers.model, "config", None))
        if short is None or input_ids.shape[0] < 2 or attention_mask is None:
            return  # (rows unmasked, all of one length: their positions are the same)
        lengths = attention_mask.sum(dim=1).tolist()
        reached = max(lengths) + generated - 1  # (the longest position a forward read, counted from 1)
        if min(lengths) < max(lengths) and min(lengths) <= short < reached:
            warnings.warn(f"generate: the base's RoPE is LongRoPE (rope_type 'longrope'), which switches every row of "
                          f"a batch to its long factors once the batch's longest row passes "
                          f"original_max_position_embeddings={short}: prompts of {min(lengths)} to {max(lengths)} "
                          f"tokens with {generated} new ones, so the shorter rows generated on other frequencies "
                          "than each would alone; generate prompts of one length together (or each alone) to match "
                          "a run of one prompt", stacklevel=3)

    def _add_val_terms(self, sums: dict[str, list[float]], batch: dict[str, Any]) -> None:
        """Adds a validation batch's per-adapter loss sum and count to ``sums`` (name -> [loss sum, count, DPO pairs
        preferred, DPO pairs, chosen and rejected rewards summed over the pairs])."""
        with self.lora_layers.use(batch["layout"]):
            loss_sum, count = self._loss_terms(batch)
        for name, s, c in zip(batch["layout"].names, loss_sum.tolist(), count.tolist()):
            acc = sums.setdefault(name, [0.0] * 6)
            acc[0] += s
            acc[1] += c
            if name in getattr(self, "_preference_accuracy", {}):  # (a DPO adapter's count is its pairs)
                accuracy, chosen, rejected = self._preference_values(name)
                acc[2] += accuracy * c
                acc[3] += c
                acc[4] += chosen * c
                acc[5] += rejected * c

    def _preference_values(self, name: str) -> tuple[float, float, float]:
        """A DPO adapter's share of pairs preferred and its mean chosen and rejected rewards in the last loss
        computed (`adapter_loss_terms`), in one read from the device."""
        rewards = self._preference_rewards[name]
        accuracy, chosen, rejected = torch.cat([self._preference_accuracy[name].reshape(1).to(rewards.dtype),
                                                rewards]).tolist()
        return accuracy, chosen, rejected

    def _held_spec(self, spec: Union[AdapterSpec, str], method: str, argument: str) -> AdapterSpec:
        """``spec`` (or the spec of the adapter so named), checked to have weights here: an adapter that has left
        (or never came) would be measured on the base model alone. ``method`` and its ``argument``: for errors."""
        if not isinstance(spec, (str, AdapterSpec)):
            raise TypeError(f"{method}'s `{argument}`: each is an adapter's name or its AdapterSpec, got "
                            f"{type(spec).__name__} {spec!r}")
        name = spec if isinstance(spec, str) else spec.name
        if name not in self.registry:
            raise ValueError(f"{method}'s `{argument}`: {name!r} is not an adapter of this module; adapters: "
                             f"{[r.name for r in self.registry]}")
        rec = self.registry[name]
        # (judged on the registry every rank shares first: under adapter parallelism every rank raises, none waits)
        if rec.state not in (AdapterState.RUNNING, AdapterState.PAUSED) or (
                self._owns(name) and name not in self.lora_layers.adapter_names):
            where = f"; its weights were exported to {rec.export_path}" if rec.export_path else ""
            if rec.state == AdapterState.QUEUED:
                where = ": it has not started, no weights yet (they are made as it starts, in `fit`)"
            raise ValueError(f"{method}'s `{argument}`: {method} takes adapters whose weights the model holds (running "
                             f"or paused); {name!r} is {rec.state.value}{where}")
        if isinstance(spec, AdapterSpec):  # (its loss is the held adapter's: another objective's rows mismeasured)
            other = [f"{f}={getattr(spec, f)!r}" for f in ("objective", "dpo_beta")
                     if getattr(spec, f) != getattr(rec.spec, f)]
            if other:
                raise ValueError(f"{method}'s `{argument}`: the AdapterSpec given for {name!r} has "
                                 f"{', '.join(other)}, and the adapter was trained with "
                                 f"{', '.join(f'{f}={getattr(rec.spec, f)!r}' for f in ('objective', 'dpo_beta'))}: "
                                 "give its name, or a spec of its own objective")
        return rec.spec if isinstance(spec, str) else spec

    def _refuse_loaded_under_placement(self, fn: str) -> None:
        """A module from `load_from_checkpoint` (no ``ckpt_path`` to this fit or validate) under adapter
        parallelism: its adapters were loaded with no ranks to place them on, so every rank held them all and owned
        none (the run then stepped for ever, training nothing). Refused, naming the way that places them."""
        if getattr(self, "_loaded_outside_fit", False) and self._placement() is not None:
            raise UsageError(f"this module was loaded with `load_from_checkpoint`, which places no adapter on the "
                             f"ranks of strategy='adapter_parallel': give the checkpoint to the {fn} instead, "
                             f"`trainer.{fn}(module, datamodule, ckpt_path=path)` (a file, or an adapter-parallel "
                             "checkpoint's folder; any number of processes)")

    def _validate_the_resumed_step(self) -> None:
        """A resume from a checkpoint written in a step's ``on_train_batch_end``
        (`ModelCheckpoint(every_n_train_steps)`, before that step's validation) at a step the Trainer validates at:
        Lightning takes the validation for done and goes on to train, so the resumed run never measured that step (a
        best weights' step lost, EarlyExit and the pruner not asked, a trial's value of other weights). Its validation
        loop is told it was stopped inside that validation, which it then runs before the next step, as the run that was
        not stopped did (at the logger's step that run validated at: `on_validation_epoch_start`)."""
        due = self.__dict__.pop("_due_on_resume", False)  # (the checkpoint's: `_validation_due`)
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not due or not getattr(loop, "restarted_on_train_batch_end", False):
            return
        from lightning.pytorch.loops.evaluation_loop import RestartStage

        loop.val_loop._restart_stage = RestartStage.RESTARTED_MID_EVALUATION  # (`advance`: "finish running validation")
        loop.val_loop.restarting = False  # (run whole, not from the counters of the checkpoint's last validation)
        self._resumed_validation = loop  # (dropped at the next training step: no validation was due)

    def _validation_due(self) -> bool:
        """Whether the Trainer validates after the training step a checkpoint is written in now (in its
        ``on_train_batch_end``, before that validation: `_validate_the_resumed_step` runs it on resume; at an epoch's
        last batch with none due, none runs)."""
        trainer = self._trainer_or_none()
        fit_loop = getattr(trainer, "fit_loop", None)
        if trainer is None or fit_loop is None or trainer.state.fn != "fit" or not trainer.training:
            return False
        try:
            return bool(fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher))
        except Exception:  # noqa: BLE001 - (Lightning's loop of another version: the resume goes as Lightning's)
            return False

    @override
    def on_validation_epoch_start(self) -> None:
        resumed = self.__dict__.pop("_resumed_validation", None)
        if resumed is not None and self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            resumed._batches_that_stepped -= 1  # (Lightning counted the step as done with its validation)
        if self.trainer.state.fn == "validate":
            self._refuse_loaded_under_placement("validate")
        stopped = self.__dict__.pop("_stopped_empty", None) == (id(self.trainer), self.trainer.global_step)
        if stopped and self.trainer.should_stop and not self.trainer.sanity_checking:  # the module stopped the run as
            # nothing was left to train: this validation's callbacks may queue or resume an adapter (`on_validation_end`
            # stops it again if none)
            self.trainer.should_stop, self._stop_pending = False, True
        self._val_sums = {}
        self.__dict__["_stops_held"] = {}  # (a removal or pause asked while it measures: once it is recorded)
        if self.trainer.state.fn == "validate" and self._resume_checkpoint is not None:
            checkpoint, self._resume_checkpoint = self._resume_checkpoint, None  # (a validate builds no optimizer)
            if self.__dict__.pop("_loaded_outside_fit", False) and checkpoint.get("optimizer_states"):
                # (`load_from_checkpoint`, a validate, then a fit: the fit goes on with the checkpoint's states, as
                # another fit of this module goes on with the last one's)
                self._carried_optimizer = {"optimizer_states": checkpoint["optimizer_states"], "optimizer_classes":
                                           checkpoint.get("multilora", {}).get("optimizer_classes")}
            if self._placement() is not None:  # each rank's registry from its own file: the owners' progress on all
                self._sync_ranks()
        if self.trainer.state.fn == "validate" and not list(self.registry.holding_weights):  # (every rank's; after
            # a `ckpt_path` given has loaded)
            ended = [r.name for r in self.registry if r.state.exited]
            why = (f"the adapters that ended ({ended[:4]}) were exported and released (their losses are in "
                   "`module.registry`; load an export with PEFT to measure it again)" if ended else
                   f"its adapters have not started ({[r.name for r in self.registry][:4]}: they start in `fit`)"
                   if len(self.registry) else "it has no adapter")
            rank_zero_warn("`trainer.validate` measures the adapters the module holds (running or paused), and it "
                           f"holds none: {why}")

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # (the validation's batches were drawn as it began: an adapter removed since, in a callback's
        # `on_validation_start`, is left out)
        batch["layout"] = layout = batch["layout"].keeping(set(self.lora_layers.adapter_names))
        if not layout.names:
            self._idle_forward()
            return
        self._add_val_terms(self._val_sums, batch)

    @override
    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self._release_stops()
            return
        if self.trainer.state.fn == "validate" or self.trainer.fast_dev_run:  # (outside a fit: returned by
            # trainer.validate; a smoke run's, of a few batches: logged), not recorded beside whole splits' losses
            placement = self._placement()  # (every rank returns every rank's adapters, rank 0 among them)
            sums = placement.exchange(dict(self._val_sums)) if placement is not None else self._val_sums
            for name, (loss_sum, count, *preference) in sorted(sums.items()):
                self.log(f"adapters/{name}/val_loss", _mean_loss(loss_sum, count), batch_size=1)
                for key, value in _preference_metrics(*preference).items():
                    self.log(f"adapters/{name}/{key}", value, batch_size=1)
            self._release_stops()
            return
        self._record_val_losses(self._val_sums)
        self._release_stops()  # (exported with the loss just recorded)
        self._sync_ranks()  # every rank learns every adapter's validation
        self._settle_monitors()

    @override
    def on_validation_end(self) -> None:
        # Callbacks' on_validation_end ran first (an exit, a pause, a checkpoint written): the slots they freed are
        # filled here, as a run resumed from that checkpoint fills them before its next step (`configure_optimizers`)
        # — not a step later, at the next step's end, which the resumed run could not repeat.
        trainer = self._trainer_or_none()
        pending = self.__dict__.pop("_stop_pending", False)  # (`on_validation_epoch_start`)
        self._write_last_values(trainer)
        if trainer is None or trainer.sanity_checking or trainer.state.fn != "fit" or trainer.should_stop:
            return  # (stopped, by another than the module in this validation too: an EarlyStopping)
        if not (0 <= trainer.max_steps <= trainer.global_step):  # (the validation after the last step: nothing
            self._sync_ranks()  # would train)
            self._fill_slots()
        if pending and not (self.registry.running or self.registry.queued):
            trainer.should_stop = True  # (nothing was left, and this validation's callbacks queued or resumed none)

    def _write_last_values(self, trainer: Optional[L.Trainer]) -> None:
        """The step's values of the adapters that stopped in its validation (an exit, a pause), which the logger had
        not written (`on_train_batch_end`): an adapter's last values are written as it stops."""
        unwritten, step = self.__dict__.pop("_unwritten", ({}, 0))
        if trainer is None or trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.loggers:
            return
        logs = {k: v for name, values in unwritten.items()
                if name not in self.registry or self.registry[name].state != AdapterState.RUNNING
                for k, v in values.items()}
        if logs:
            self._write_metrics(logs, step)

    def _keep_best_weights(self, name: str) -> None:
        """Adapter ``name``'s weights now, on the CPU, as its best-validation ones (`keep_best_weights`)."""
        self._best_weights[name] = {k: v.to("cpu") for k, v in self.lora_layers.peft_state_dict(name).items()}

    def _record_val_losses(self, sums: dict[str, list[float]]) -> None:
        """Records a validation's sums (`_add_val_terms`) in the adapters' histories, and logs them."""
        logs = {}
        for name, (loss_sum, count, preferred, pairs, chosen, rejected) in sums.items():
            rec = self.registry[name]
            if rec.val_losses and rec.val_losses[-1][0] == rec.step:
                continue  # already measured at this step
            loss = _mean_loss(loss_sum, count)
            rec.val_losses.append((rec.step, loss))
            rec.last_val_loss = loss
            if pairs > 0:
                rec.last_val_preference_accuracy = preferred / pairs
                logs.update({f"adapters/{name}/{k}": v for k, v in _preference_metrics(preferred, pairs, chosen,
                                                                                        rejected).items()})
            if math.isfinite(loss) and loss < rec.best_val_loss:
                rec.best_val_loss, rec.best_val_step = loss, rec.step
                rec.best_val_preference_accuracy = preferred / pairs if pairs > 0 else math.nan
                if self.keep_best_weights and name in self.lora_layers.adapter_names:
                    self._keep_best_weights(name)
                else:  # (an earlier fit's snapshot is no longer the best's: an export of it named this step's loss)
                    self._best_weights.pop(name, None)
            logs[f"adapters/{name}/val_loss"] = loss
        self.log_adapter_metrics(logs)

    # -- checkpoints ----------------------------------------------------------------------------

    def _base_prefix(self) -> str:
        """The frozen base's prefix in this module's state dict ("model.", or "" where the module is the base)."""
        model = self.lora_layers.model
        return next((f"{n}." for n, m in self.named_modules() if m is model), "")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; the adapters a checkpoint's registry made hold their weights after it (a
        `load_from_checkpoint` module's among them), and the frozen base's keys, which no checkpoint holds, are not
        listed as missing (Lightning listed every base weight)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._not_loaded = set()
        prefix = self._base_prefix()
        return type(result)([k for k in result.missing_keys if any(s in k for s in _LORA_KEYS)
                             or not k.startswith(prefix)], result.unexpected_keys)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the frozen base is left out (its weights come from where the module loads them), under whatever name the
        # module reaches it; the adapters, and any other state of a module hosting them (a head of its own), are kept
        model = self.lora_layers.model
        prefix = self._base_prefix()
        base = {_storage_of(t) for t in itertools.chain(model.parameters(), model.buffers())} - {None}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                    if any(s in k for s in _LORA_KEYS)
                                    or not (k.startswith(prefix) or _storage_of(v) in base)}
        checkpoint["multilora"] = {
            "registry": self.registry.state_dict(),
            "best_weights": self._best_weights,
            # what the next admission prefers, and (adapter parallelism) exits not yet shared with the other ranks
            "freed": self._freed_spec.name if self._freed_spec is not None else None,
            "exited_since_sync": list(self._exited_since_sync),
            # each adapter's dropout step (its masks come from its seed and this step)
            "dropout_steps": self.lora_layers.dropout_steps(),
            "run_id": self._run_id,
            "lineage": list(self._lineage),
            "step_offset": self.__dict__.get("_step_offset", 0),  # (the run's steps before its Trainer's: `_run_step`)
            "summary_files": sorted(self.__dict__.get("_summary_files", ())),  # (its own: `SweepReport` writes on)
            "base": self._base_identity(),
            "base_given": bool(self.__dict__.get("_base_given", False)),  # (a model given to MultiLoRAModule)
            "optimizer_classes": _optimizer_classes(self._raw_optimizer()),
            "max_running": self.max_running,
            "validation_due": self._validation_due(),  # (`_validate_the_resumed_step`)
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def _base_identity(self) -> dict[str, Any]:
        """What a checkpoint's adapters need of the frozen base to resume on it: its architecture (a Hugging Face
        config's model type and sizes; else the model's class), and, to warn of another one of the same architecture,
        where it was loaded from, how the module built it (`config_overrides`, a built-in base's `base_seed`) and the
        dtype it is held in."""
        model = self.lora_layers.model
        model = getattr(model, "_orig_mod", model)  # (torch.compile's wrapper: the model it compiled)
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            return {"class": type(model).__name__}
        values = config.to_dict()
        identity = {k: values[k] for k in _BASE_KEYS if k in values}
        # (as the module was given it: its config names a checkpoint folder by its absolute path, for the exports)
        identity["path"] = getattr(self, "_base_named", None) or values.get("_name_or_path") or None
        for key, value in getattr(self, "_base_build", {}).items():  # (how the module built it; text: plain data)
            identity[key] = value if isinstance(value, int) else json.dumps(
                _integral_as_int(value), sort_keys=True, default=str)  # (10000.0 is 10000, as an older checkpoint's)
        quant = values.get("quantization_config") or {}
        dtype = held_dtype(model)
        held = str(dtype).removeprefix("torch.") if dtype is not None else "none"
        if _four_bit(values):  # (its 4-bit type and the dtype it computes in)
            compute = str(quant.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
            identity["weights"] = f"{_four_bit(values)} computing in {compute}"
        elif isinstance(quant, dict) and quant.get("load_in_8bit"):  # (LLM.int8: its linears int8, the rest held)
            identity["weights"] = f"int8 beside {held}"
        else:  # (the dtype the base is held in)
            identity["weights"] = held
        return identity

    def _place_resumed(self, placement: Any) -> None:
        """Under adapter parallelism, on resume: an owner for every adapter holding weights (those of ranks a
        checkpoint of another size had, placed anew), and this rank's best weights only. Moved adapters are
        trained whatever the admission budget says of their new rank (nothing trained is dropped), with a
        warning where a rank's running adapters exceed it."""
        placement.place([rec.spec for rec in self.registry.holding_weights])
        self._best_weights = {n: w for n, w in self._best_weights.items() if placement.owns(n)}
        if self.admission is None or getattr(placement, "resized_from", None) is None:
            return
        running = [rec.spec for rec in self.registry.running]  # (what admission counts)
        for rank in range(placement.world_size):
            mine = [s for s in running if placement.owner.get(s.name) == rank]
            if mine and not self.admission.fits(mine):
                rank_zero_warn(f"resumed on {placement.world_size} ranks, rank {rank} trains {[s.name for s in mine]}: "
                               f"{_over_budget(self.admission, mine)} (the checkpoint was written by "
                               f"{placement.resized_from}); they train anyway")

    def _warn_over_budget(self) -> None:
        """A resume's held adapters over the admission budget (a lower one than the run had): said (they went on
        unsaid); they train on, nothing trained is dropped."""
        resident = self._resident()
        if resident and not self.admission.fits(resident):
            rank_zero_warn(f"resumed with adapters {[r.name for r in self.registry.running]} training (and "
                           f"{len(self.registry.paused)} paused): {_over_budget(self.admission, resident)}; they "
                           "train anyway (nothing trained is dropped), and queued adapters wait until they end")

    def _merge_given_specs(self, given: list[AdapterSpec]) -> None:
        """After the checkpoint's registry replaced this module's: adapters given now but absent from the checkpoint
        are queued (a sweep extended on resume); one still queued there takes the spec given now; one that has
        started keeps the spec it trained with, and a change to it is warned of (it is not applied)."""
        added, kept = [], []
        for spec in given:
            if spec.name not in self.registry:
                self.registry.add(spec)
                added.append(spec.name)
                continue
            rec = self.registry[spec.name]
            if rec.spec == spec:
                continue
            if rec.state == AdapterState.QUEUED:
                rec.spec = spec
            else:
                kept.append(f"{spec.name!r} ({rec.state.value}; {_spec_changes(rec.spec, spec)})")
        trainer = self._trainer_or_none()
        providers = trainer is not None and any(hasattr(cb, "has_pending_candidates") for cb in trainer.callbacks)
        names = {spec.name for spec in given}
        removed = self.__dict__.pop("_removed_before_fit", set())  # (`remove_adapter` before this resume's fit)
        undone = [r.name for r in (*self.registry.queued, *self.registry.running, *self.registry.paused)
                  if r.name in removed]
        if undone and trainer is not None:
            states = ", ".join(f"{n!r} {self.registry[n].state.value}" for n in undone)
            rank_zero_warn(f"adapters removed before this resume are {states} in its checkpoint, and go on (a resume "
                           "keeps the checkpoint's adapters; "
                           "`module.remove_adapter(name)` after the resume starts, say in a callback's "
                           "`on_train_start`, drops one and exports what it trained)")
        names |= set(removed)
        dropped = [r.name for r in self.registry.queued if r.name not in names]
        going_on = [r.name for r in (*self.registry.running, *self.registry.paused) if r.name not in names]
        if given and (dropped or going_on) and not providers and trainer is not None:  # (a provider's candidates
            # are none of the user's; `load_from_checkpoint` gives the run's own adapters, those it was built with)
            said = [f"queued in the checkpoint and not given now still start: {dropped}"] if dropped else []
            said += [f"running or paused in the checkpoint and not given now go on: {going_on}"] if going_on else []
            rank_zero_warn(f"adapters {'; '.join(said)} (a resume keeps the checkpoint's adapters; "
                           "`module.remove_adapter(name)` after the resume starts, say in a callback's "
                           "`on_train_start`, drops one and exports what it trained)")
        running = [r.name for r in self.registry.running]
        saved_cap = getattr(self, "_saved_max_running", self.max_running)  # (a run over its own cap: resume_adapter)
        if self.max_running is not None and len(running) > self.max_running and saved_cap != self.max_running:
            rank_zero_warn(f"the checkpoint has {len(running)} adapters running ({running}), over "
                           f"`max_running`={self.max_running}: they go on (none is stopped to fit the cap); queued "
                           "ones start once fewer than it run")
        if added:
            rank_zero_warn(f"adapters not in the checkpoint are queued: {added}")
        if kept:
            rank_zero_warn("adapters resumed from the checkpoint keep the specs they started with; these changes "
                           f"are not applied: {'; '.join(kept)} (give a changed adapter a new name to train it)")

    def _base_changes(self, saved_base: Mapping[str, Any]) -> tuple[dict, Optional[tuple], Optional[tuple], dict]:
        """How this module's base differs from ``saved_base`` (a checkpoint's `_base_identity`), each as (saved, this
        module's): in its architecture (returned first, a dict), where it was loaded from, how its weights are held and
        how a built-in base was built."""
        base = self._base_identity()
        # entries both sides give (a config that gains one in a newer transformers, head_dim say, is not another base)
        differ = {k: (saved_base[k], base[k]) for k in saved_base.keys() & base.keys()
                  if saved_base[k] is not None and base[k] is not None and saved_base[k] != base[k]}
        loaded, held = differ.pop("path", None), differ.pop("weights", None)
        if held is not None and (held[1].split(" ")[0] == held[0] or held[1] == f"int8 beside {held[0]}"):  # (as a
            held = None  # checkpoint written before they were named so named a 4-bit base, its type, and an 8-bit one)
        built = {k: differ.pop(k) for k in ("base_seed", "config_overrides") if k in differ}
        return differ, loaded, held, built

    def other_base_problem(self, saved_base: Mapping[str, Any]) -> str:
        """Why adapters trained on ``saved_base`` (a checkpoint's ``checkpoint["multilora"]["base"]``) cannot resume
        on this module's base, another architecture or size ("" where they can)."""
        differ = self._base_changes(saved_base)[0]
        if not differ:
            return ""
        return ("this checkpoint's adapters were trained on another base model (checkpoint -> this module: "
                f"{', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in sorted(differ.items()))}); resume with the "
                "`base_model` (and `config_overrides`) it was trained with")

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("multilora")
        if state is None:
            raise ValueError("this checkpoint was not written by a MultiLoRAMixin module (no 'multilora' entry)")
        self.__dict__["_due_on_resume"] = bool(state.get("validation_due"))  # (`_validate_the_resumed_step`)
        if state.get("base_given") and getattr(self, "_base_named", None) is not None:  # (its base a model given,
            # not held: a load without it built the default base, and the adapters ran on its weights, unsaid)
            said = (f"this checkpoint's base was a model given to the module (`base_model=<model>`), which a "
                    f"checkpoint does not hold, and this module built {self._base_named!r}")
            if self._trainer_or_none() is None:
                raise ValueError(f"{said}: give the model again, `MultiLoRAModule.load_from_checkpoint(path, "
                                 "base_model=model)`")
            rank_zero_warn(f"{said}: if it holds other weights than that model, the adapters go on from another "
                           "model's outputs; give the model as `base_model` to go on exactly")
        differ, loaded, held, built = self._base_changes(state.get("base") or {})  # (older checkpoints carry none)
        if built:  # (a built-in base of another seed, a base of other overrides: other weights or numbers)
            rank_zero_warn("this checkpoint's adapters were trained on a base built with "
                           f"{', '.join(f'{k}={a}' for k, (a, b) in built.items())}, and resume on one built with "
                           f"{', '.join(f'{k}={b}' for k, (a, b) in built.items())}: the adapters go on from another "
                           "base's outputs; resume with the settings they were trained with to go on exactly")
        if loaded is not None and not differ:  # (the same architecture from elsewhere: a moved folder, other weights)
            rank_zero_warn(f"this checkpoint's adapters were trained on the base loaded from {loaded[0]!r}, and resume "
                           f"on one loaded from {loaded[1]!r}: if it holds other weights (another model of the same "
                           "architecture), the adapters go on from another model's outputs; resume on the base they "
                           "were trained on to go on exactly")
        if held is not None:  # (the same architecture held otherwise: a choice, said)
            rank_zero_warn(f"this checkpoint's adapters were trained on the base held as {held[0]} and resume on it "
                           f"held as {held[1]} (`quantization` / `dtype`): their losses will move with the base's "
                           "numbers; resume with the settings it was trained with to go on exactly")
        if differ:
            raise ValueError(self.other_base_problem(state.get("base") or {}))
        trainer = self._trainer_or_none()
        if self._placement() is None and checkpoint.get("world_size", 1) > 1:  # (its other ranks' adapters: not in
            # this file; the strategy reads the folder whole)
            reader = "`load_from_checkpoint`" if trainer is None else "a fit without adapter parallelism"
            raise ValueError(f"this is rank {checkpoint.get('rank')}'s file of an adapter-parallel checkpoint of "
                             f"{checkpoint['world_size']} ranks, which {reader} cannot read whole: give its folder "
                             "to a fit as `ckpt_path` under strategy='adapter_parallel' (over any number of processes, "
                             "one included)")
        if trainer is not None and trainer.state.fn == "fit" and "optimizer_states" not in checkpoint:
            raise UsageError("this checkpoint holds weights only (`ModelCheckpoint(save_weights_only=True)`): no "
                             "optimizer or callback states for a fit to resume with `ckpt_path`; load it with "
                             "`MultiLoRAModule.load_from_checkpoint(path)` and fit that module without `ckpt_path`: "
                             "its adapters go on from these weights, with new optimizer states")
        for callback in (trainer.callbacks if trainer is not None else []):  # (before Lightning matches their states)
            getattr(callback, "adopt_checkpoint_state", lambda checkpoint: None)(checkpoint)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and type(datamodule).__qualname__ not in checkpoint:  # (Lightning restores a data
            # module's state under its class's name alone: one of another class, a subclass say, started every
            # adapter's data over, silently) the stream positions saved under another name are this one's
            found = [k for k, v in checkpoint.items() if isinstance(v, dict) and isinstance(v.get("streams"), dict)]
            if len(found) == 1 and isinstance(datamodule.state_dict(), dict) and "streams" in datamodule.state_dict():
                checkpoint[type(datamodule).__qualname__] = checkpoint[found[0]]
        _untake_interrupted_batch(checkpoint)
        # `load_from_checkpoint` (no trainer): a fit without `ckpt_path` goes on as a resume does, as another fit of
        # this module does: its optimizer states, data positions and callbacks' states from the checkpoint (they were
        # lost, the trained adapters' exports then written over by others trained again from fresh optimizers)
        self._loaded_outside_fit = trainer is None
        self._summary_files = (self.__dict__.get("_summary_files", set()) | set(state.get("summary_files", ()))
                               | {str(Path(d) / "sweep_summary.json") for d in state.get("log_dirs", ())})  # (older)
        for pending in ("_views", "_paused"):  # (stops made since an exchange of the states this replaces)
            self.__dict__.pop(pending, None)
        # (a later fit goes on from the checkpoint's run step; a `ckpt_path` resume's Trainer does, its offset the
        # checkpoint's)
        self._steps_done = int(checkpoint.get("global_step", 0)) + int(state.get("step_offset", 0))
        if trainer is not None:
            self._step_offset = int(state.get("step_offset", 0))
        if trainer is None:
            self._carried_positions = next((dict(v["streams"]) for v in checkpoint.values() if isinstance(v, dict)
                                            and isinstance(v.get("streams"), dict)), None)
            self._carried_callbacks = [(key.split("{")[0], key, state) for key, state in
                                       (checkpoint.get("callbacks") or {}).items() if isinstance(state, dict)]
        for name in list(self.lora_layers.adapter_names):
            self.lora_layers.remove_adapter(name)
        self.registry.load_state_dict(state["registry"])
        self._saved_max_running = state.get("max_running", self.max_running)
        self._merge_given_specs(list(self._given.values()))
        added = {n: s for n, s in self.__dict__.pop("_added_before_start", {}).items() if n not in self.registry}
        for spec in added.values():  # (added by a callback as this fit set up: queued, as a given one new to it is)
            self.registry.add(spec)
        self._best_weights = dict(state.get("best_weights", {}))
        self._resume_checkpoint = checkpoint  # its optimizer state is matched to the new groups by adapter name
        freed = state.get("freed")
        self._freed_spec = self.registry[freed].spec if freed is not None and freed in self.registry else None
        self._exited_since_sync = list(state.get("exited_since_sync", []))
        # (every rank sends its adapters' whole curves at the next exchange: receivers keep what they lack)
        self._train_losses_shared, self._staged_metrics, self._exit_texts_pending = {}, [], set()
        # new weights until Lightning loads the checkpoint's into them (after this hook): a resume that fails
        # before then (making them, or loading) exports none of them over the trained adapters' exports (`_held`)
        self._not_loaded = {rec.name for rec in self.registry.holding_weights}
        placement = self._placement()
        if placement is not None:  # (a run of another size than wrote it: its adapters' new owners)
            self._place_resumed(placement)
        elif self.admission is not None and trainer is not None and trainer.state.fn == "fit":
            self._warn_over_budget()
        try:
            for rec in self.registry.holding_weights:
                if self._owns(rec.name):  # under adapter parallelism, this rank's adapters only
                    self._create_weights(rec, checkpoint)
        except UsageError:
            raise
        except ValueError as err:  # (an adapter's own targets not among the module's: a setting of the resume)
            raise UsageError(f"{err}; {_OTHER_TARGETS}") from err
        steps = state.get("dropout_steps")
        if steps is None and any(rec.spec.dropout > 0 for rec in self.registry.holding_weights):
            rank_zero_warn("this checkpoint carries no dropout steps (it was written by an older version): adapters "
                           "with dropout draw their masks from step 0 again")
        self.lora_layers.set_dropout_steps({n: s for n, s in (steps or {}).items()
                                            if n in self.lora_layers.adapter_names})
        saved = set(checkpoint["state_dict"])
        expected = {k for k, _ in self.named_parameters() if any(s in k for s in _LORA_KEYS)}
        missing = expected - saved
        made = set(self.lora_layers.adapter_names)  # (this rank's, under adapter parallelism)
        extra = {k for k in saved - expected if any(s in k for s in _LORA_KEYS) and k.rsplit(".", 1)[-1] in made}
        if missing or extra:
            which = (f"lacks adapter weights {sorted(missing)[:4]}" if missing else
                     f"holds adapter weights for layers this module no longer targets {sorted(extra)[:4]}")
            raise UsageError(f"checkpoint {which}...: the adapters' layers differ from the checkpoint's; "
                             f"{_OTHER_TARGETS}")
        self._run_id = state.get("run_id", self._run_id)
        self._lineage = list(state.get("lineage", [])) + [uuid.uuid4().hex]  # (a branch of its own: `_sibling`)
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])


# a validation's per-adapter values (`_record_val_losses`): in ``trainer.callback_metrics`` for any reader (`_monitor`)
_VALIDATION_METRICS = ("/val_loss", "/val_preference_accuracy", "/val_rewards_chosen", "/val_rewards_rejected",
                       "/val_rewards_margin")
# config keys of dropout that a base applies with `F.dropout` (not a module), attention kernels' as an argument: OPT's
# `dropout` and `activation_dropout` in each layer, Falcon's and Bloom's `hidden_dropout` (`dropout_add`)...
_FUNCTIONAL_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "dropout", "hidden_dropout",
                       "activation_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "ffn_dropout",
                       "residual_dropout", "embedding_dropout")  # (the last two: StarCoder2's, Seed-OSS's)
# config keys of noise an MoE's router adds in training (Mixtral's, PhiMoE's, MiniMax's...): random as dropout is
_ROUTER_NOISE = ("router_jitter_noise", "input_jitter_noise")


def _longrope_limit(config: Any) -> Optional[int]:
    """``original_max_position_embeddings`` of a base whose RoPE is LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini), whose
    frequencies follow the batch's longest row past it; None for any other."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    limit = rope.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    return int(limit) if isinstance(limit, int) else None


def _four_bit(config_values: dict[str, Any]) -> Optional[str]:
    """The 4-bit type (``nf4`` / ``fp4``) of a base whose config (`to_dict`'s values) says it is bitsandbytes 4-bit;
    None for any other."""
    quant = config_values.get("quantization_config") or {}
    return quant.get("bnb_4bit_quant_type", "4-bit") if isinstance(quant, dict) and quant.get("load_in_4bit") else None


def _base_dropout(model: nn.Module) -> tuple[str, list[str]]:
    """The dropout a training forward of ``model`` applies, in words ("" for none): its dropout modules with p > 0
    and the dropout its config sets that its layers apply without a module (`_FUNCTIONAL_DROPOUT`); and those config
    keys."""
    modules: dict[float, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            modules.setdefault(float(module.p), []).append(name.rsplit(".", 1)[-1])
    config = getattr(model, "config", None)
    keys = [key for key in _FUNCTIONAL_DROPOUT + _ROUTER_NOISE if isinstance(getattr(config, key, None), (int, float))
            and not isinstance(getattr(config, key), bool) and getattr(config, key) > 0]
    found = [f"config.{key}={getattr(config, key)}" for key in keys]
    found += [f"{len(names)} dropout modules of p={p} ({', '.join(sorted(set(names))[:3])})"
              for p, names in modules.items()]
    jitter = getattr(getattr(config, "ffn_config", None), "moe_jitter_eps", None)  # (DBRX's)
    if isinstance(jitter, (int, float)) and jitter > 0:
        found.append(f"config.ffn_config.moe_jitter_eps={jitter}")
    if getattr(config, "model_type", None) == "phimoe":  # (sparsemixer: whatever the config says)
        found.append("PhiMoE's router, which samples its experts in training")
    return "; ".join(found), keys


def _logits(out: Any) -> Tensor:
    """A model's logits: a Hugging Face output's ``.logits``, or the tensor a plain module returns."""
    return out if torch.is_tensor(out) else out.logits


def _generates(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model that generates (PEFT's causal-LM wrapper calls its generation
    hooks; a plain module has none)."""
    can = getattr(model, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - a model whose check fails is taken as plain
        return False


def _monitored_adapter(callback: Any) -> Optional[str]:
    """The adapter whose value (``adapters/<name>/<value>``) a callback monitors, or None."""
    key = getattr(callback, "monitor", None)
    if not isinstance(key, str) or not key.startswith("adapters/") or key.count("/") < 2:
        return None
    return key[len("adapters/"):].rsplit("/", 1)[0]


# The values the module logs for each adapter, ``adapters/<name>/<value>`` (DPO's rewards and accuracy for a DPO
# adapter; ``loss_scale`` under fp16)
_DPO_VALUES = ("preference_accuracy", "rewards_chosen", "rewards_rejected", "rewards_margin")
ADAPTER_VALUES = ("train_loss", "grad_norm", "lr", "tokens_seen", "loss_scale", *_DPO_VALUES,
                  *(k.lstrip("/") for k in _VALIDATION_METRICS))


def _unlogged_monitor(callback: Any, counts: bool = True, spec: Optional[AdapterSpec] = None) -> Optional[str]:
    """Why the key a callback monitors is none the module logs, or None: a run-wide name (``val_loss``, as a
    Lightning module logs it) or an adapter's value that is not among `ADAPTER_VALUES` (a typo), or, where ``spec``
    is the monitored adapter's, one its objective does not log (DPO's values of an SFT adapter). Lightning's own
    ``step`` and ``epoch`` are there; the progress bar's adapter counts where ``counts`` (a progress bar shows)."""
    key = getattr(callback, "monitor", None)
    if not isinstance(key, str):
        return None
    name = _monitored_adapter(callback)
    if name is None:
        if key in ("step", "epoch") or (counts and key in ("running", "queued", "paused", "exited")):
            return None
        example = key.rsplit("/", 1)[-1] if key.rsplit("/", 1)[-1] in ADAPTER_VALUES else "val_loss"
        return (f"no run-wide {key!r}: the module logs each adapter's values as 'adapters/<name>/<value>' "
                f"(e.g. 'adapters/<name>/{example}')")
    value = key.rsplit("/", 1)[-1]
    if value in ADAPTER_VALUES:
        if spec is not None and spec.objective != "dpo" and value.removeprefix("val_") in _DPO_VALUES:
            return (f"adapter {name!r} is trained with objective {spec.objective!r}, which logs no {value!r} (an "
                    "adapter with objective 'dpo' logs it)")
        return None
    if value == "train_loss_ema":  # (EarlyExit's)
        return "'train_loss_ema' is EarlyExit's, written to the loggers alone (no callback can monitor it)"
    import difflib

    close = difflib.get_close_matches(value, ADAPTER_VALUES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{value!r} is no value the module logs for an adapter{hint}; it logs {', '.join(ADAPTER_VALUES)}"


# The mixin's hooks that carry its work (the run's end, the validation losses, the exports, the checkpoint's
# adapters...): a subclass's override must call super()'s, or the run silently loses it (`_needs_super`)
HOOKS_NEEDING_SUPER = ("configure_model", "configure_callbacks", "on_train_start", "on_train_batch_end", "on_train_end",
                       "on_validation_epoch_start", "validation_step", "on_validation_epoch_end", "on_validation_end",
                       "on_save_checkpoint", "on_load_checkpoint")


def _marks_super(name: str, hook: Any) -> Any:
    """The mixin's own ``hook``, noting that it ran (for `_needs_super`)."""

    @functools.wraps(hook)
    def marked(self: MultiLoRAMixin, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.setdefault("_supered", set()).add(name)
        return hook(self, *args, **kwargs)

    marked._checks_super = True
    return marked


def _needs_super(name: str, hook: Any) -> Any:
    """A subclass's override of the mixin's hook ``name``, checked to have called ``super().<name>(...)``: without it
    a run never ended (``on_train_batch_end``), exported nothing at a ``max_steps`` stop (``on_train_end``), summed
    every validation's losses into the next (``on_validation_epoch_start``), recorded none (``validation_step``,
    ``on_validation_epoch_end``) or saved the whole base and no adapter state (``on_save_checkpoint``), silently."""

    @functools.wraps(hook)
    def checked(self: MultiLoRAMixin, *args: Any, **kwargs: Any) -> Any:
        done = self.__dict__.setdefault("_supered", set())
        done.discard(name)
        out = hook(self, *args, **kwargs)
        trainer = self.__dict__.get("_trainer")
        # (skipping the sanity check's validation, a common idiom, loses nothing: the mixin does nothing there)
        if name not in done and not getattr(trainer, "sanity_checking", False):
            raise RuntimeError(f"{type(self).__name__}.{name} did not call super().{name}(...): MultiLoRAMixin's "
                               f"{name} does the run's work there (its adapters' validation, exports, checkpoint "
                               "state, the run's end); call it in yours")
        return out

    checked._checks_super = True
    return checked


def _needs_super_optimizer(configure_optimizers: Any) -> Any:
    """A subclass's ``configure_optimizers``, checked to build the adapters' optimizer through the module's: that
    starts the adapters (their weights are made there) and gives each its own param group, whose rate its schedule
    sets every step."""

    @functools.wraps(configure_optimizers)
    def checked(self: MultiLoRAMixin) -> Any:
        self._optimizer_built = False
        why = (f"{type(self).__name__}.configure_optimizers must return (or wrap) super().configure_optimizers(): "
               "it starts the adapters and builds one optimizer with a param group per adapter; choose the optimizer "
               "with the module's `optimizer` and `optimizer_kwargs` (e.g. optimizer='torch.optim.SGD', "
               "optimizer_kwargs={'momentum': 0.9})")
        try:
            out = configure_optimizers(self)
        except ValueError as err:
            if not self._optimizer_built and "empty parameter list" in str(err):
                raise ValueError(why) from err
            raise
        if not self._optimizer_built:
            raise ValueError(why)
        parts = out if isinstance(out, (list, tuple)) else [out]
        optimizers = [o for part in parts for o in (part if isinstance(part, (list, tuple)) else [part])
                      if isinstance(o, torch.optim.Optimizer)]
        if len(optimizers) > 1:  # (the step takes the first: it failed, "'list' object has no attribute ...")
            raise ValueError(f"{type(self).__name__}.configure_optimizers returns {len(optimizers)} optimizers; the "
                             "module steps one, super().configure_optimizers()'s, with a param group per adapter")
        own = [g for o in optimizers for g in o.param_groups if "adapter" not in g]
        if own:  # (the module zeroes, schedules, clips and checkpoints its adapters' groups alone: another group
            # trained on with its gradients summed over the steps, and was dropped as an adapter was added)
            raise ValueError(f"{type(self).__name__}.configure_optimizers adds {len(own)} param group(s) of its own "
                             f"({sum(p.numel() for g in own for p in g['params'])} parameters) to the module's "
                             "optimizer, which trains the adapters alone (a group each, which the module schedules, "
                             "clips and checkpoints); keep other parameters frozen, or train them apart")
        return out

    return checked


def _storage_of(tensor: Any) -> Optional[int]:
    """Where a plain tensor's elements start (a sharded DTensor's, or an empty tensor's: None)."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return None
    return tensor.data_ptr() if tensor.numel() else None


def _spec_changes(old: AdapterSpec, new: AdapterSpec) -> str:
    before, after = old.to_dict(), new.to_dict()
    return ", ".join(f"{k} {before[k]!r} -> {after[k]!r}" for k in after if before.get(k) != after[k])


def _optimizer_classes(optimizer: Optional[torch.optim.Optimizer]) -> Optional[list[str]]:
    """The names (``module:qualname``) of an optimizer's classes, its bases that are optimizers too (GroupedAdamW's:
    AdamW...), whose states are alike: another optimizer's state shares none of them. bitsandbytes' optimizers share
    generic bases whatever their algorithm (Lion8bit's and AdamW8bit's: ``Optimizer8bit``), and name their state by
    algorithm and bits: those bases are left out, and that name is added (PagedAdamW8bit's and AdamW8bit's states
    are alike; bitsandbytes' AdamW and torch's AdamW, or its 32-bit and 8-bit AdamW, are not)."""
    if optimizer is None:
        return None
    names = [f"{c.__module__}:{c.__qualname__}" for c in type(optimizer).__mro__
             if issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
             and not (c.__module__.startswith("bitsandbytes.") and c.__qualname__ in _BNB_GENERIC_BASES)]
    algorithm, args = getattr(optimizer, "optimizer_name", None), getattr(optimizer, "args", None)
    if type(optimizer).__module__.startswith("bitsandbytes.") and algorithm is not None:
        names.append(f"bitsandbytes:{algorithm} {getattr(args, 'optim_bits', 32)}-bit state")
    return names


_BNB_GENERIC_BASES = ("Optimizer1State", "Optimizer2State", "Optimizer8bit")


def _shown(classes: list[str]) -> str:
    """An optimizer's class (`_optimizer_classes`' first) as a message names it: its qualname, with its package where
    two packages have one of that name (bitsandbytes' AdamW, torch's)."""
    module, _, name = classes[0].rpartition(":")
    return f"{module.partition('.')[0]}.{name}" if module.startswith("bitsandbytes") else name


def _states_alike(saved: list[str], now: list[str]) -> bool:
    """Whether a checkpoint's optimizer (`_optimizer_classes`) and this one share a state layout. Modules tell apart
    torch's and bitsandbytes' classes only (their AdamWs); one's own optimizer is matched by its name (its module is
    ``__main__`` in a script, another where imported); so is a checkpoint that named classes without their modules
    (written before they were named so)."""
    def keys(names: list[str], qualified: bool) -> set[str]:
        return {name if qualified and name.startswith(("torch.", "bitsandbytes")) else name.rpartition(":")[2]
                for name in names}

    qualified = any(":" in name for name in saved)
    return bool(keys(saved, qualified) & keys(now, qualified))


def _as_loaded(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """A saved param ``group`` as ``optimizer`` holds it once it has loaded it: its class's ``__setstate__``, which
    `load_state_dict` calls, may set some settings itself (AdamW: ``decoupled_weight_decay``). The group as saved
    where that cannot be told."""
    try:
        probe = object.__new__(type(optimizer))
        type(optimizer).__setstate__(probe, {"defaults": dict(optimizer.defaults), "state": {},
                                             "param_groups": [dict(group)]})
        return probe.param_groups[0]
    except Exception:  # noqa: BLE001 - a class whose state cannot be set apart from its instance
        return group


def _match_optimizer_state(checkpoint: dict[str, Any], optimizer: torch.optim.Optimizer,
                           to_flat: Optional[Any] = None, saved_classes: Optional[list[str]] = None,
                           from_flat: Optional[Any] = None) -> None:
    """Rewrite the checkpoint's optimizer state for ``optimizer``'s groups, matched by adapter name: Lightning
    then loads it by position. The groups can differ from the saved ones: a checkpoint is written before the
    module settles its step (slots refilled after an exit, adapters finished under adapter parallelism), so an
    adapter started since has no saved state (it starts fresh, as it did in the uninterrupted run) and one that
    has left since is dropped. A group saved per layer and now holding one flat parameter gets its state through
    ``to_flat(name, per_layer_states)``, one saved flat and now per layer through ``from_flat(name, flat_state,
    count)``; a group whose state cannot be carried over starts fresh, with a warning."""
    states = checkpoint.get("optimizer_states")
    if not states:
        return
    saved = states[0]
    by_name = {g.get("adapter"): g for g in saved["param_groups"] if g.get("adapter") is not None}
    own = {"params", "adapter", "name", "lr", "initial_lr", "weight_decay", *IMPLEMENTATION_FLAGS}  # (per adapter)
    pairs = [(by_name[g["adapter"]], g) for g in optimizer.param_groups if g.get("adapter") in by_name]
    now = _optimizer_classes(optimizer)
    if saved_classes and not _states_alike(saved_classes, now):  # (a checkpoint written before they were saved:
        # kept)
        rank_zero_warn(f"the checkpoint's optimizer state is {_shown(saved_classes)}'s, and the optimizer now is "
                       f"{_shown(now)}: every adapter's optimizer state starts fresh")
        checkpoint["optimizer_states"] = [optimizer.state_dict(), *states[1:]]
        return
    differ = [(old, new, _as_loaded(optimizer, old)) for old, new in pairs]
    kept = sorted({f"{k}: {old[k]!r} -> {new[k]!r}" for old, new, loaded in differ for k in set(new) - own
                   if k in old and old[k] != new[k] and loaded.get(k) == old[k]})
    forced = sorted({f"{k}: {old[k]!r} -> {new[k]!r}" for old, new, loaded in differ for k in set(new) - own
                     if k in old and old[k] != new[k] and loaded.get(k) != old[k]})
    if kept:
        rank_zero_warn(f"the optimizer's settings differ from the checkpoint's ({'; '.join(kept)}): the adapters "
                       "go on with the checkpoint's, as a resumed optimizer does (`load_state_dict`)")
    if forced:  # (AdamW loading Adam's groups: its decoupled weight decay, whatever the saved groups say)
        rank_zero_warn(f"the optimizer's settings differ from the checkpoint's ({'; '.join(forced)}): the adapters "
                       f"go on with the optimizer's, which {type(optimizer).__name__} sets as it loads a state")
    matched: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for group in optimizer.param_groups:
        ids = list(range(index, index + len(group["params"])))
        index += len(ids)
        name = group.get("adapter")
        old = by_name.get(name)
        flat_state = per_layer = None
        if old is not None and len(old["params"]) != len(ids) and len(ids) == 1 and to_flat is not None:
            flat_state = to_flat(name, [saved["state"].get(i) for i in old["params"]])
        elif old is not None and len(old["params"]) == 1 and len(ids) > 1 and from_flat is not None:
            per_layer = from_flat(name, saved["state"].get(old["params"][0]), len(ids))
        if old is not None:  # what it learns from the checkpoint, how it steps from the optimizer built now
            old = {**old, **{k: group[k] for k in (*IMPLEMENTATION_FLAGS, "name") if k in group}}
        if old is not None and len(old["params"]) == len(ids):
            matched["param_groups"].append({**old, "params": ids})
            for old_id, new_id in zip(old["params"], ids):
                if old_id in saved["state"]:
                    matched["state"][new_id] = saved["state"][old_id]
        elif flat_state is not None:
            matched["param_groups"].append({**old, "params": ids})
            matched["state"][ids[0]] = flat_state
        elif per_layer is not None:
            matched["param_groups"].append({**old, "params": ids})
            matched["state"].update(zip(ids, per_layer))
        else:
            if old is not None:
                warnings.warn(f"the checkpoint's optimizer state of adapter {name!r} ({len(old['params'])} tensors) "
                              f"does not fit its parameters now ({len(ids)}): it starts fresh", stacklevel=2)
            matched["param_groups"].append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    checkpoint["optimizer_states"] = [matched, *states[1:]]


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """``model`` in evaluation mode (dropout off) inside, each of its modules' mode restored after; its ``self.log``
    calls dropped (`MultiLoRAMixin.log`)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    outer = model.__dict__.get("_in_evaluate", False)
    model.__dict__["_in_evaluate"] = True
    try:
        yield
    finally:
        model.__dict__["_in_evaluate"] = outer
        for m, training in modes:
            m.training = training


def _over_budget(admission: Any, specs: Sequence[AdapterSpec]) -> str:
    """Why ``specs`` do not fit ``admission``: its prediction and budget, where it has them (an
    `AdmissionController`'s), else its ``fits``' answer (a controller of the user's needs only fits / select /
    alone: a resume over its budget failed on a missing ``predict``)."""
    from lightning_multilora.scheduling.admission import size_text

    predict, budget = getattr(admission, "predict", None), getattr(admission, "budget", None)
    if callable(predict) and isinstance(budget, (int, float)):
        return f"{size_text(predict(specs))} predicted, over the admission budget of {size_text(budget)}"
    return f"over the budget of the admission controller {type(admission).__name__} (its `fits` says no)"


def _adapter_list(adapters: Any, mappings: bool = True) -> list:
    """``adapters`` as a list; one spec (an `AdapterSpec`, a mapping of its fields) or anything not a sequence of them
    is refused by name (one spec failed with "TypeError: 'AdapterSpec' object is not iterable"). ``mappings``: the
    caller takes mappings of a spec's fields as specs (`MultiLoRAModule`'s, not `init_multilora`'s)."""
    if isinstance(adapters, (AdapterSpec, Mapping, str, bytes)) or not isinstance(adapters, Iterable):
        one = isinstance(adapters, (AdapterSpec, Mapping))
        given = "{...}" if isinstance(adapters, Mapping) and mappings else "AdapterSpec(...)"
        raise ValueError(f"`adapters` is a list of AdapterSpec{' (or of mappings of their fields)' * mappings}, "
                         f"got {'one ' if one else ''}{type(adapters).__name__}"
                         + (f": give it in a list, adapters=[{given}]" if one else ""))
    return list(adapters)


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (what ``torch.load(weights_only=True)`` reads back): None, a bool, number or
    string, or a list, tuple or string-keyed dict of them; not a subclass's (a str enum, numpy's float64: the load
    refuses their classes)."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(map(_plain, value))
    return type(value) in (dict, collections.OrderedDict) and all(type(k) is str and _plain(v)
                                                                  for k, v in value.items())


def _unlist_paged(state: Optional[Mapping[str, Any]]) -> None:
    """An optimizer state dropped (an adapter's that exited): its tensors out of bitsandbytes' global page manager,
    where its paged optimizers list every paged buffer (on a GPU, of 1e5 values or more) for good, which held them
    for the rest of the run."""
    functional = sys.modules.get("bitsandbytes.functional")
    manager = getattr(getattr(functional, "GlobalPageManager", None), "_instance", None)
    paged = getattr(manager, "paged_tensors", None)
    if not state or not paged:
        return
    dropped = {id(t) for t in state.values() if torch.is_tensor(t)}
    paged[:] = [t for t in paged if id(t) not in dropped]


def _integral_as_int(value: Any) -> Any:
    """``value`` with every integral float as an int, in its dicts too: config overrides compared as text."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return {k: _integral_as_int(v) for k, v in value.items()} if isinstance(value, dict) else value


def _import_path(cls: Any) -> Optional[str]:
    """``cls``'s import path where importing it gives it back (not a local class's: None)."""
    path = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"
    try:
        return path if "<locals>" not in path and resolve_optimizer(path) is cls else None
    except Exception:  # noqa: BLE001 - (a path that does not import)
        return None


def _mean_loss(loss_sum: float, count: float) -> float:
    """A validation's mean loss: NaN where no token measured it, +inf where one did and the sum is not finite (an
    fp16 forward that overflowed: NaN or inf, which `EarlyExit` takes as the steepest rise, never as "unmeasured")."""
    if count <= 0:
        return math.nan
    loss = loss_sum / count
    return loss if math.isfinite(loss) else math.inf


def _preference_metrics(preferred: float, pairs: float, chosen: float, rejected: float) -> dict[str, float]:
    """A validation's DPO metrics from its sums over ``pairs`` pairs (none for an adapter without pairs): TRL's
    evaluation accuracy and rewards."""
    if pairs <= 0:
        return {}
    return {"val_preference_accuracy": preferred / pairs, "val_rewards_chosen": chosen / pairs,
            "val_rewards_rejected": rejected / pairs, "val_rewards_margin": (chosen - rejected) / pairs}


def _hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model (its causal mask its own: `adapter_loss_terms` runs right-padded rows
    unmasked); a torch model of one's own may read the mask, and is given it."""
    from transformers import PreTrainedModel

    return isinstance(getattr(model, "_orig_mod", model), PreTrainedModel)


def _row_token_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the summed next-token cross-entropy over completion tokens (in float32 at least: float64 logits,
    a float64 base's, keep their precision), and their number."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    wide = logits if logits.dtype == torch.float64 else logits.float()
    token_loss = F.cross_entropy(wide.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    mask = labels != IGNORE_INDEX
    return torch.where(mask, token_loss, torch.zeros_like(token_loss)).sum(dim=1), mask.sum(dim=1)


def segment_sum(values: Tensor, layout: BatchLayout) -> Tensor:
    """Sum ``values`` (one per row) over each adapter's rows: ``(num_rows,) -> (num_adapters,)``."""
    if len(layout.names) == 0:
        return values.new_zeros(0)
    index = _device_index(("segments", layout.starts, layout.ends, layout.num_rows), values.device,
                          lambda: _segment_index(layout))
    out = values.new_zeros(len(layout.names) + 1)
    return out.index_add(0, index, values)[:-1]


def _segment_index(layout: BatchLayout) -> Tensor:
    index = torch.empty(layout.num_rows, dtype=torch.long)
    index.fill_(len(layout.names))  # rows outside every segment go to a dropped extra bucket
    for i, (s, e) in enumerate(zip(layout.starts, layout.ends)):
        index[s:e] = i
    return index


_DEVICE_INDICES: dict[tuple, Tensor] = {}


def _device_index(key: tuple, device: torch.device, make) -> Tensor:
    """A small index tensor made on the host once per key and device, then reused: a step's device work then
    copies nothing from the host (a copy from pageable memory cannot be captured in a CUDA graph, and costs a
    stream sync). Kept for the 256 most recent keys; made outside inference mode (a `trainer.validate` runs in it:
    an index it made first, an inference tensor, failed a later fit's backward, "Inference tensors cannot be saved
    for backward")."""
    key = (key, str(device))
    index = _DEVICE_INDICES.pop(key, None)
    if index is None:
        with torch.inference_mode(False):
            index = make().to(device)
    _DEVICE_INDICES[key] = index  # (re-inserted: the most recent last)
    if len(_DEVICE_INDICES) > 256:
        del _DEVICE_INDICES[next(iter(_DEVICE_INDICES))]
    return keep_alive(index)  # a graph being captured reads it at every replay, whatever this cache drops


def _grad_norms(groups: Sequence[Sequence[Tensor]], like: Tensor) -> Tensor:
    """``(N,)``: the L2 norm of each group's gradients (zero for a group without any). One multi-tensor norm over
    every gradient of every group, not one norm launch per tensor (60 adapters on 56 layers: 6720 launches)."""
    counts = [sum(p.grad is not None for p in group) for group in groups]
    grads = [p.grad for group in groups for p in group if p.grad is not None]
    if not grads:
        return like.new_zeros(len(groups), dtype=torch.float32)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    per_tensor = torch.stack(torch._foreach_norm(grads, 2, dtype=dtype))
    index = _device_index(("groups", tuple(counts)), per_tensor.device,
                          lambda: torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(counts)))
    squares = per_tensor.new_zeros(len(groups)).index_add_(0, index, per_tensor.square())
    return squares.sqrt()


def _refuse_strategy(trainer: L.Trainer) -> None:
    """A strategy of several processes other than `AdapterParallelStrategy` (or a data-parallel one at all: DDP
    over one process failed in PyTorch's words) is refused in ours."""
    from lightning.pytorch.strategies import ParallelStrategy

    strategy = trainer.strategy
    ours = hasattr(strategy, "owns") and hasattr(strategy, "place")
    if not ours and (trainer.world_size > 1 or isinstance(strategy, ParallelStrategy)):
        raise UsageError(
            f"`strategy`: MultiLoRAModule trains in one process, or over several with strategy='adapter_parallel' "
            f"(AdapterParallelStrategy); got {type(strategy).__name__} over {trainer.world_size} "
            f"process{'es' if trainer.world_size > 1 else ''}: "
            + ("give `Trainer(devices=1)` (Lightning's default, devices='auto', takes every GPU of the machine, a "
               "process on each), or strategy='adapter_parallel' to split the adapters over them. "
               if trainer.world_size > 1 else "leave the strategy out, or give strategy='adapter_parallel'. ")
            + "A data-parallel strategy would give every process every adapter, and adapters start and stop during a "
            "run, so they cannot be registered with it up front.")


for _name in HOOKS_NEEDING_SUPER:
    setattr(MultiLoRAMixin, _name, _marks_super(_name, MultiLoRAMixin.__dict__[_name]))


class ExportOnException(L.Callback):
    """Exports the adapters a `MultiLoRAMixin` module holds when fit stops on an exception, Ctrl+C included (Lightning
    then calls no module hook, only callbacks' ``on_exception``): nothing trained is lost
    (`MultiLoRAMixin.export_after_exception`). Added by the module's ``configure_callbacks``. Its ``setup`` also asks
    ``Trainer.log_dir`` on every rank and remembers it (`log_dir_of`): exports on one rank alone, `SweepReport` and
    `OptunaSweep` on rank 0 take it from there; and has another strategy than adapter parallelism refuse its
    checkpoint folders by name (`guard_folder_checkpoints`). (A callback's ``setup``, not the module's: a subclass
    may override that one without calling ``super()``.)"""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_multilora.strategies.adapter_parallel import guard_folder_checkpoints

        for pending in ("_views", "_paused"):  # (a stop made after a stopped fit's last exchange: not this fit's to
            pl_module.__dict__.pop(pending, None)  # check, its states restored or carried on as they are)
        log_dir_of(trainer)
        pl_module._exported_after = None
        if stage == "fit" and callable(getattr(pl_module, "_begin_run_steps", None)):
            pl_module._begin_run_steps(trainer)
        if stage in ("fit", "validate") and callable(getattr(pl_module, "_datamodule", None)):
            pl_module._datamodule()  # (its batches: a DataLoader's failed at the first, "KeyError: 'layout'")
        guard_folder_checkpoints(trainer.strategy)  # (before a checkpoint loads)
        # Its on_validation_end puts back the monitored values `_settle_monitors` took for EarlyStopping: after every
        # other callback's (a module's own EarlyStopping comes after it in Lightning's order), before the checkpoints'
        from lightning.pytorch.callbacks import Checkpoint

        callbacks = trainer.callbacks
        if self in callbacks:
            callbacks.remove(self)
            first = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
            callbacks.insert(first, self)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        pl_module.__dict__["_stops_held"] = None  # (a stop asked inside a validation cut short: the adapter goes as
        try:  # it is, exported below as the others)
            export = getattr(pl_module, "export_after_exception", None)
            if export is not None:
                export(exception)
        finally:
            getattr(pl_module, "_give_back_loss_scaler", lambda: None)()
            getattr(pl_module, "_carry_optimizer_state", lambda: None)()
            getattr(pl_module, "_release_branch", lambda: None)()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # (a model's callback: after the Trainer's own, EarlyStopping's among them; ModelCheckpoint runs last)
        getattr(pl_module, "_restore_monitors", lambda: None)()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        getattr(pl_module, "_give_back_loss_scaler", lambda: None)()
        getattr(pl_module, "_carry_optimizer_state", lambda: None)()
        getattr(pl_module, "_release_branch", lambda: None)()


class MultiLoRAModule(MultiLoRAMixin, L.LightningModule):
    """The ready-made module: a Hugging Face causal LM and a set of adapters (a list and/or a grid).

    Args:
        base_model: ``"tiny-llama"`` / ``"tiny-qwen2"`` / ``"tiny-mistral"`` (built from a config, random
            weights), or a checkpoint directory or hub name for ``AutoModelForCausalLM.from_pretrained``.
            A ``torch.nn.Module`` is accepted from Python.
        adapters: adapter specs, trained in this order of admission.
        grid: a `SweepGrid` whose adapters are added after ``adapters``.
        target_modules: the projections every adapter may use (PEFT names, "all-linear" or a regex, as PEFT takes
            them); an adapter's own ``target_modules`` picks a subset. Default "all-linear": every linear layer
            (GPT-2's Conv1D too) but the output head, as PEFT's (in a Llama-family model, `LLAMA_TARGETS`).
        optimizer: optimizer class or import path; one param group per adapter.
        optimizer_kwargs: extra arguments of the optimizer (``betas``, ``eps``...).
        max_running: adapters trained at once (None: all); the rest wait in the queue.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        dtype: dtype of the base weights (adapters are float32, float64 on a float64 base, as PEFT's); None:
            float32 for a base the module builds, a module given held as it is.
        config_overrides: fields changed in the base model's config.
        export_dir: where adapters are written (default ``<log_dir>/adapters``).
        validate_on_finish: measure an adapter's validation loss when it finishes.
        admission: an `AdmissionController`: adapters start while its memory model says they fit.
        quantization: ``nf4`` / ``fp4``: a 4-bit bitsandbytes base computing in ``dtype`` (QLoRA).
        cuda_graphs: replay each step's forward and backward from a CUDA graph (see `init_multilora`).
        base_seed: seed of a built-in tiny model's random weights (``"tiny-llama"``...; a checkpoint's are its own).
    """

    @_restricted_classmethod  # (Lightning's: called on an instance, it is an error, not a new module ignored)
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's; an adapter-parallel checkpoint's folder (one ``rank<r>.ckpt`` per process) is a named error
        (the load failed with a bare IsADirectoryError): it resumes as a fit's ``ckpt_path``."""
        path = Path(str(checkpoint_path))
        if isinstance(checkpoint_path, (str, os.PathLike)) and path.is_dir():
            ranks = sorted(p.name for p in path.glob("rank*.ckpt"))
            raise ValueError(f"`checkpoint_path` {str(path)!r} is a folder" + (
                f", an adapter-parallel checkpoint of one file per process ({', '.join(ranks)}), which "
                "`load_from_checkpoint` cannot read whole: give it to a fit as `ckpt_path` under "
                "strategy='adapter_parallel' (over any number of processes, one included)" if ranks else
                ": give a checkpoint file"))
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def __init__(
        self,
        base_model: str = "tiny-llama",
        adapters: Optional[list[AdapterSpec]] = None,
        grid: Optional[SweepGrid] = None,
        target_modules: Union[str, list[str]] = "all-linear",
        optimizer: str = "torch.optim.AdamW",
        optimizer_kwargs: Optional[dict[str, Any]] = None,
        max_running: Optional[int] = None,
        gradient_checkpointing: bool = False,
        dtype: Optional[str] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        export_dir: Optional[str] = None,
        validate_on_finish: bool = True,
        base_seed: int = 0,
        admission: Optional[Any] = None,
        quantization: Optional[str] = None,
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__()
        from lightning_multilora.base_model import TINY_CONFIGS, build_base_model, changed_overrides, resolve_dtype

        # (`MultiLoRAModule.load_from_checkpoint(path)` builds the module from them, its base the run's: it used to
        # take the defaults, another base_seed's weights loaded silently. Plain data alone, which `torch.load` reads
        # with ``weights_only=True``: specs as their fields, the optimizer by its import path; anything else, and a
        # base given as a module, are given again to `load_from_checkpoint`. Not for the loggers: each adapter's
        # hyperparameters are `SweepReport`'s HParams runs)
        adapters = _adapter_list(adapters) if adapters is not None else None
        # (a path object as its str: the hyperparameters keep plain data alone, and lost it)
        base_model, export_dir = (os.fspath(v) if isinstance(v, os.PathLike) else v for v in (base_model, export_dir))
        arguments = {
            "base_model": base_model, "grid": dataclasses.asdict(grid) if isinstance(grid, SweepGrid) else grid,
            "adapters": [s.to_dict() if isinstance(s, AdapterSpec) else s for s in adapters] if adapters else adapters,
            "target_modules": target_modules, "optimizer_kwargs": optimizer_kwargs, "max_running": max_running,
            "optimizer": optimizer if isinstance(optimizer, str) else _import_path(optimizer),
            "gradient_checkpointing": gradient_checkpointing,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "config_overrides": config_overrides, "export_dir": export_dir, "validate_on_finish": validate_on_finish,
            "base_seed": base_seed, "quantization": quantization, "cuda_graphs": cuda_graphs}
        if arguments["optimizer"] is None:  # (a local class: given again to `load_from_checkpoint`)
            del arguments["optimizer"]
        if type(self).__init__ is MultiLoRAModule.__init__:  # (a subclass's own `__init__` takes its own arguments:
            # it saves them itself, as Lightning's `save_hyperparameters` expects; these would clash with its own)
            self.save_hyperparameters({k: v for k, v in arguments.items() if _plain(v)}, logger=False)
        check_bool("MultiLoRAModule", "gradient_checkpointing", gradient_checkpointing)
        if quantization is not None and not isinstance(quantization, str):  # (`build_base_model` takes settings
            # whole, for the exports' loader: a module built so would export them as nf4 or nothing)
            raise ValueError(f"MultiLoRAModule: `quantization` can be {', '.join(QUANTIZATIONS)} or None, got "
                             f"{quantization!r}; for other bitsandbytes settings (double quantization, 8-bit) load "
                             "the model quantized and give it as `base_model` (its exports record its settings)")
        check_int("MultiLoRAModule", "base_seed", base_seed, -2**63, high=2**63 - 1)  # (torch's seeds: 64-bit)
        if isinstance(base_model, nn.Module):
            given = [f"`{n}`" for n, v in (("config_overrides", config_overrides), ("quantization", quantization))
                     if v is not None]
            if given:  # (they build a model: one given is used as it is)
                verb = "apply" if len(given) > 1 else "applies"
                raise ValueError(f"{' and '.join(given)} {verb} to a base the module builds (a built-in name or a "
                                 f"checkpoint path); `base_model` is a module given as it is: build it so instead")
            model, self._base_given = base_model, True  # (not in the hyperparameters: given again to a load)
            build = getattr(model, "_multilora_build", None)  # (a built-in base `build_base_model` made: its seed and
            if isinstance(build, dict) and getattr(getattr(model, "config", None), "name_or_path", None) \
                    in TINY_CONFIGS:  # overrides, which its exports say, as a module that builds it does)
                self._base_build = dict(build)
            if dtype is not None:  # (None leaves a module's dtype be)
                torch_dtype = resolve_dtype(dtype)
                quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None
                if quantized and held_dtype(model) != torch_dtype:
                    raise ValueError(f"`dtype` {dtype!r} casts a base the module is given, and this one is quantized "
                                     "(bitsandbytes: its weights cannot be cast): leave `dtype` unset for a quantized "
                                     "module given as it is (its compute dtype is its quantization config's)")
                if not quantized:
                    model = model.to(torch_dtype)
        else:
            model = build_base_model(base_model, config_overrides, dtype, base_seed, quantization)
            # (a built-in base's weights are its seed's, as it remembers; a checkpoint's its own: `_base_identity`)
            self._base_build = dict(getattr(model, "_multilora_build", None) or {
                "config_overrides": changed_overrides(str(base_model), config_overrides)})
            self._base_named = os.fspath(base_model)  # (as given: a project moved with its relative path is the same)
        if gradient_checkpointing:
            if not any(callable(getattr(model, f"{kind}_checkpointing_enable", None))  # (an AttributeError before)
                       for kind in ("activation", "gradient")):
                raise ValueError(f"MultiLoRAModule: `gradient_checkpointing=True` needs a Hugging Face model (its "
                                 f"`gradient_checkpointing_enable`); {type(model).__name__} has none: checkpoint its "
                                 "blocks yourself (`torch.utils.checkpoint`), or leave it False")
            enable_checkpointing(model)
        self.model = model
        if isinstance(grid, Mapping):  # (the Python API's spelling of a config's grid: SweepGrid's fields)
            unknown = sorted(set(grid) - {f.name for f in dataclasses.fields(SweepGrid)})
            if unknown:
                raise ValueError(f"`grid` takes SweepGrid's fields {[f.name for f in dataclasses.fields(SweepGrid)]}; "
                                 f"got {unknown}")
            grid = SweepGrid(**grid)
        if grid is not None and not isinstance(grid, SweepGrid):
            raise ValueError(f"`grid` must be a SweepGrid (or a mapping of its fields), got {type(grid).__name__}")
        specs = [AdapterSpec.from_dict(a) if isinstance(a, Mapping) else a for a in adapters or []]  # (a mapping:
        specs += grid.specs() if grid is not None else []  # its fields, as `load_from_checkpoint` gives them)
        self.init_multilora(model, specs, target_modules, optimizer, optimizer_kwargs, max_running, export_dir,
                            validate_on_finish, admission, cuda_graphs)

    @property
    def max_sequence_length(self) -> Optional[int]:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> Optional[int]:
        return getattr(self.model.config, "vocab_size", None)

    @override
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, layout: Optional[BatchLayout] = None):
        """Logits of the packed batch; ``layout`` says which adapter each row uses (None: base only). A name that
        is no adapter of this module raises (its rows would get the base's output)."""
        if layout is not None:
            unknown = sorted(set(layout.names) - set(self.lora_layers.adapter_names))
            gone = [n for n in unknown if n in self.registry]
            if gone:  # (an adapter that has exited: its weights are in its export; a queued one has none yet)
                rec = self.registry[gone[0]]
                where = (f"it was exported to {rec.export_path} (load it with PEFT)" if rec.export_path else
                         "it has not started: no weights yet (they are made as it starts, in `fit`)"
                         if rec.state == AdapterState.QUEUED else "it has no export")
                raise KeyError(f"`layout` names {gone[0]!r}, which holds no weights ({rec.state.value}); {where}; "
                               f"adapters holding weights: {self.lora_layers.adapter_names}")
            if unknown:
                raise KeyError(f"`layout` names {unknown}: no adapter of this module; adapters: "
                               f"{self.lora_layers.adapter_names}")
        with self.lora_layers.use(layout):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _length_reached(rec: AdapterRecord) -> str:
    """Why an adapter that trained its length finished: its ``max_steps``, or its ``max_epochs`` and their steps."""
    if rec.spec.max_steps is None and rec.spec.max_epochs is not None:
        return f"reached max_epochs={rec.spec.max_epochs} ({rec.max_steps} steps)"
    return f"reached max_steps={rec.max_steps}"
