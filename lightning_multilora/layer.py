"""`MultiLoRALinear`: a frozen linear layer with many LoRA adapters, each on its own rows."""

from __future__ import annotations

import math
import numbers
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
import warnings
import zlib
from operator import is_, itemgetter
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_multilora.arguments import check_bool, check_int, check_real, peft_targets
from lightning_multilora.base_model import guard_4bit_base
from lightning_multilora.flat import FlatAdapter, make_flat
from lightning_multilora.kernels import LoRAWeights, multi_lora, multi_lora_linear, resolve_backend
from lightning_multilora.kernels.weights import STREAM_SEED_MOD, DropoutStreams
from lightning_multilora import shadow as _shadows_module
from lightning_multilora.shadow import Shadow, record_copy
from lightning_multilora.shadow import refresh as _refresh
from lightning_multilora.layout import BatchLayout
from lightning_multilora.spec import check_adapter_name


# Adapters with dropout step counters at once, per model (slots are reused once an adapter is removed)
DROPOUT_SLOTS = 4096
# Layouts whose LoRAWeights (with the device tables made for them: a few small tensors each, the weights' copies
# being the adapter set's) a layer keeps, per set of adapters: enough for the validation layouts that may run
# between a training layout's eager steps and its CUDA graph capture
KEPT_LAYOUTS = 32
_UNSEEN = object()


def _global_module_hooks() -> bool:
    """Whether torch's global module hooks are set (``register_module_forward_hook`` and its kind): every module call
    runs them."""
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks)


class LayoutContext:
    """The batch layout of the current step, shared by every `MultiLoRALinear` of one model.

    It stays set until the backward pass is over, so recomputation under gradient checkpointing
    sees the same layout as the forward.
    """

    def __init__(self) -> None:
        self.layout: Optional[BatchLayout] = None
        # the layout's adapters' shadows (`MultiLoRALinear.shadows`) are fresh: the layers may read them, while no
        # optimizer step has been taken since (`shadow_epoch`, the epoch the `use` opened in)
        self.shadows: bool = False
        self.shadow_epoch = -1
        # per device, the adapters' dropout step counters (`DropoutStreams.steps`), a slot an adapter
        self.dropout_steps: dict[torch.device, Tensor] = {}
        self._dropout_forwards: set[int] = set()  # layers that ran a training forward with dropout in this `use`
        self._warned_repeat = False
        # tokens per row of the last input a layer took as (rows, tokens, d) in this `use`: a layer given the tokens
        # flattened, (rows x tokens, d), as OPT's fc1 / fc2 are, must take that many (a mixture-of-experts layer's
        # share of the tokens is no whole batch, even where its count divides by the rows)
        self.tokens_per_row: Optional[int] = None
        # wrapped layers sit in torch's nn.TransformerEncoderLayer / DecoderLayer, whose inference fast path reads
        # their `weight` and never calls them: it is turned off while a layout is set (`inject_multilora`)
        self.mha_fastpath_off = False

    def move_steps(self, old: torch.device, new: torch.device) -> None:
        """Adapters moved from ``old`` to ``new``: the step table of ``new`` becomes ``old``'s (the one their steps,
        replayed CUDA graphs included, advanced), replacing any older one there (a resume sets the steps before the
        model moves to its device; Lightning moves it back to the CPU at the end of a fit)."""
        table = self.dropout_steps.get(old)
        if table is not None and old != new:
            moved = torch.zeros(DROPOUT_SLOTS, dtype=torch.int64, device=new) if table.is_meta else table.to(new)
            self.dropout_steps[new] = moved

    def saw_dropout_forward(self, layer: nn.Module) -> None:
        """A layer ran a training forward with dropout: a second one inside the same `use` (outside backward's
        recomputation) would repeat its masks, since the dropout steps advance as `LoRALayers.use` opens."""
        if torch._C._current_graph_task_id() != -1:  # a recomputation, inside backward
            return
        if id(layer) not in self._dropout_forwards:
            self._dropout_forwards.add(id(layer))
        elif not self._warned_repeat:
            self._warned_repeat = True
            warnings.warn("a second training forward inside one `LoRALayers.use(layout)` repeats the adapters' dropout "
                          "masks (their dropout steps advance as `use` opens): open `use` once per forward + backward")

    def steps_on(self, device: torch.device) -> Tensor:
        """The dropout step counters on ``device`` (made there from another device's, or zeros)."""
        steps = self.dropout_steps.get(device)
        if steps is None:
            other = next((t for t in self.dropout_steps.values() if not t.is_meta), None)
            steps = (torch.zeros(DROPOUT_SLOTS, dtype=torch.int64) if other is None else other).to(device)
            self.dropout_steps[device] = steps
        return steps

    @contextmanager
    def use(self, layout: Optional[BatchLayout], shadows: bool = False) -> Iterator[None]:
        previous = self.layout, self.shadows, self._dropout_forwards, self.tokens_per_row, self.shadow_epoch
        self.layout, self.shadows, self._dropout_forwards, self.tokens_per_row = layout, shadows, set(), None
        self.shadow_epoch = _shadows_module._epoch
        off = self.mha_fastpath_off and layout is not None
        if off:
            _mha_fastpath_off()
        try:
            yield
        finally:
            self.layout, self.shadows, self._dropout_forwards, self.tokens_per_row, self.shadow_epoch = previous
            if off:
                _mha_fastpath_restore()


_FASTPATH = threading.Lock()
_fastpath_users: list = [0, True]  # contexts that turned torch's MHA fast path off, and the setting before the first


def _mha_fastpath_off() -> None:
    """Turn torch's MHA inference fast path off (a process-wide setting) while any layout context that needs it off
    is open, in any thread; the setting before the first comes back as the last closes (`_mha_fastpath_restore`)."""
    with _FASTPATH:
        if _fastpath_users[0] == 0:
            _fastpath_users[1] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _fastpath_users[0] += 1


def _mha_fastpath_restore() -> None:
    with _FASTPATH:
        _fastpath_users[0] -= 1
        if _fastpath_users[0] == 0:
            torch.backends.mha.set_fastpath_enabled(_fastpath_users[1])


class _Counted(dict):
    """A dict that counts its changes (``changes``): the layer's per-adapter ``scaling`` and ``dropout``, which the
    kernels' cached weights hold by value."""

    changes = 0  # (a class default: pickle and deepcopy set the items before the instance's own count)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.changes += 1

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.changes += 1

    def _changed(name: str):  # noqa: N805 - the mutating methods of dict, counted
        def method(self, *args: Any, **kwargs: Any) -> Any:
            out = getattr(dict, name)(self, *args, **kwargs)
            self.changes += 1
            return out
        method.__name__ = name
        return method

    update, pop, popitem = _changed("update"), _changed("pop"), _changed("popitem")
    clear, setdefault = _changed("clear"), _changed("setdefault")
    del _changed


class MultiLoRALinear(nn.Module):
    """A frozen ``base`` linear plus adapter slots keyed by name.

    Adapter ``name`` has ``lora_A[name]`` ``(r, in_features)`` and ``lora_B[name]`` ``(out_features, r)``
    (PEFT's shapes), scaling ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA) and its own dropout.
    In ``forward`` the context's `BatchLayout` says which rows each adapter owns; rows of adapters
    this layer does not hold, and rows outside every segment, get the base output only.

    ``direct_grads`` (default True): the Triton kernels add adapter gradients straight into ``.grad``
    (see `LoRAWeights`); set it False on a layer to take ``torch.autograd.grad`` w.r.t. its adapters.
    """

    direct_grads: bool = True

    def __init__(self, base: nn.Module, context: Optional[LayoutContext] = None) -> None:
        super().__init__()
        shape = linear_shape(base)
        if shape is None:
            raise TypeError(f"MultiLoRALinear wraps a linear layer (in_features/out_features, or a transformers Conv1D "
                            f"as GPT-2 has), got {type(base)}")
        self.base = base
        self.base.requires_grad_(False)
        self.in_features, self.out_features = shape
        # a Conv1D (GPT-2's) holds its weight as (in, out): PEFT's ``fan_in_fan_out``; the adapters' shapes are the same
        self.fan_in_fan_out: bool = not hasattr(base, "in_features")
        self.context = context if context is not None else LayoutContext()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        # (counted as they change: a value set after a forward, as PEFT's `set_scale` sets `scaling`, reaches the next)
        self.scaling: dict[str, float] = _Counted()
        self.dropout: dict[str, float] = _Counted()
        # per adapter, its A and B in the activation dtype, kept by `LoRALayers` (views of the adapter's `Shadow`):
        # read by the kernels instead of copies of their own while the context says they are fresh
        self.shadows: dict[str, tuple[Tensor, Tensor]] = {}
        # per adapter, its dropout stream: (its seed in this layer, its slot in the context's step counters), set by
        # `LoRALayers`; an adapter without one draws its masks from torch's random state
        self.streams: dict[str, tuple[int, int]] = {}
        # the LoRAWeights of the last `KEPT_LAYOUTS` layouts, the most recent last (each keeps the device tables the
        # kernels made for it: a layout met again, as after an epoch's last short batch, or captured in a CUDA graph
        # after other layouts ran, finds them)
        self._kept: OrderedDict[tuple, Optional[LoRAWeights]] = OrderedDict()
        self._weights: Optional[LoRAWeights] = None
        self._dropout_on = False  # the cached weights have adapters with dropout, and their streams
        # (layout object, tokens per row, direct_grads, shadows fresh)
        self._weights_seen: Optional[tuple] = None
        self.layer_name = ""  # its name in the model (`inject_multilora`), for errors

    @property
    def weight(self) -> Any:
        """The base layer's weight, as PEFT's layers give it: code of the model that reads ``proj.weight`` (its dtype,
        a tied head) keeps working. A product made from it directly bypasses the adapters."""
        return self.base.weight

    @property
    def bias(self) -> Any:
        return getattr(self.base, "bias", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("weight", "bias") and "base" in self._modules:  # (transformers' `tie_weights` on a wrapped head:
            setattr(self._modules["base"], name, value)  # the base's, as PEFT's layers take it)
            return
        super().__setattr__(name, value)

    @property
    def adapter_names(self) -> list[str]:
        return list(self.lora_A.keys())

    def add_adapter(
        self,
        name: str,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        generator: Optional[torch.Generator] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Add an adapter with PEFT's initialisation: A kaiming-uniform (a=sqrt(5)), B zero, drawn in float32 and
        held in ``dtype``. None: float64 on a base computing in float64, float32 otherwise (PEFT's adapters take a
        float64 base's dtype, and stay float32 on a bf16 / fp16 one: its ``autocast_adapter_dtype``)."""
        if dtype is None:
            dtype = torch.float64 if _compute_dtype(self.base) == torch.float64 else torch.float32
        _check_adapter_args("MultiLoRALinear.add_adapter", name, rank, alpha, dropout, use_rslora, dtype)
        if name in self.lora_A:
            raise ValueError(f"adapter {name!r} already exists in this layer; names must be unique")
        device = _weight_device(self.base)
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        a = a.to(dtype)
        b = torch.zeros(self.out_features, rank, dtype=dtype)
        self.lora_A[name] = nn.Parameter(a.to(device))
        self.lora_B[name] = nn.Parameter(b.to(device))
        self.scaling[name] = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.dropout[name] = float(dropout)
        self.forget_weights()

    def remove_adapter(self, name: str) -> None:
        if name not in self.lora_A:
            raise KeyError(f"no adapter {name!r} in this layer; present: {self.adapter_names}")
        del self.lora_A[name]
        del self.lora_B[name]
        del self.scaling[name]
        del self.dropout[name]
        self.shadows.pop(name, None)
        self.streams.pop(name, None)
        self.forget_weights()

    def forget_weights(self) -> None:
        """Drop the cached LoRAWeights of every layout: the adapters, their parameters or their shadows changed (the
        cache would hold removed ones); the next forward builds them anew."""
        self._kept.clear()
        self._weights = self._weights_seen = None

    def _apply(self, fn, *args, **kwargs):
        # moved or cast (``.to``, ``.cuda``, ``.half``): the cached weights' device state is rebuilt at the next forward
        self.forget_weights()
        before = next(iter(self.lora_A.values())).device if len(self.lora_A) else None
        out = super()._apply(fn, *args, **kwargs)
        after = next(iter(self.lora_A.values())).device if len(self.lora_A) else None
        if before is not None and after != before:
            self.context.move_steps(before, after)
        return out

    def forward(self, x: Tensor) -> Tensor:
        layout = self.context.layout
        if layout is None:
            return self.base(x)
        shape = x.shape
        rows, seen = layout.num_rows, self.context.tokens_per_row
        if x.dim() == 2 and rows and (shape[0] in (rows * seen, rows) if seen else shape[0] % rows == 0):
            # (rows x tokens, d_in): flattened, as OPT's fc1 / fc2 take it; or (rows, d_in): one a row, as a head
            # on pooled features takes it
            tokens_per_row = shape[0] // rows
        elif x.dim() > 2 and shape[0] == rows:
            tokens_per_row = self.context.tokens_per_row = math.prod(shape[1:-1])
        else:
            raise RuntimeError(
                f"layer {self.layer_name or type(self.base).__name__!r} got an input of shape {tuple(shape)} but the "
                f"layout describes {rows} rows{f' of {seen} tokens' if seen else ''}: a wrapped layer must see the "
                "whole batch, rows first ((rows, tokens, features), or (rows x tokens, features) flattened); one "
                "called on part of the tokens (mixture-of-experts routing) or sequence first (batch_first=False) "
                "cannot be adapted: leave it out of `target_modules`. Otherwise set the layout of the batch being run"
            )
        weights = self._weights_for(layout, tokens_per_row)
        if weights is None:
            return self.base(x)
        x2d = x.reshape(-1, self.in_features)  # (T, d_in): the kernels see tokens, the layout rows
        base = self._modules["base"]
        if self._dropout_on and self.training and torch.is_grad_enabled():
            self.context.saw_dropout_forward(self)
        if self._plain_frozen_base(base, x2d):
            out = multi_lora_linear(x2d, base.weight, base.bias, weights, self.training)
        else:
            base_out = base(x2d)  # a fresh base output, updated in place; one a hook may hold is copied (a full
            # backward hook's, updated in place, never saw its gradient)
            if base._forward_hooks or base._backward_hooks or _global_module_hooks():
                base_out = base_out.clone()
            out = multi_lora(x2d, base_out, weights, self.training)
        return out.reshape(*shape[:-1], self.out_features)

    @staticmethod
    def _plain_frozen_base(base: nn.Module, x: Tensor) -> bool:
        """The base is a plain frozen ``nn.Linear`` in ``x``'s dtype, without hooks and outside autocast:
        its product can then run inside the LoRA Function (see `multi_lora_linear`). Anything else
        (quantized, trainable, hooked or autocast bases; a forward replaced on it, as accelerate's offload hooks
        do; torch's global module hooks) is called as a module, as PEFT calls it."""
        if (type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks or base._backward_hooks
                or base._backward_pre_hooks or "forward" in base.__dict__ or _global_module_hooks() or x.is_meta):
            return False  # (autocast has no meta device to ask about)
        weight, bias = base.weight, base.bias  # (wrappers such as FSDP1 may set plain tensors in forward)
        return (not weight.requires_grad and weight.dtype == x.dtype and (bias is None or not bias.requires_grad)
                and not torch.is_autocast_enabled(x.device.type))

    def _weights_for(self, layout: BatchLayout, tokens_per_row: int) -> Optional[LoRAWeights]:
        """This layer's adapters of ``layout`` in token units; reused while layout and adapters are the same
        (forward, recomputation and backward of a step, and steps with the same shapes)."""
        seen = self._weights_seen
        # (an optimizer step taken inside the `use`, a loop of one's own: the shadows it did not write are stale, and
        # the calls copy the weights as they are)
        shadows = self.context.shadows and self.context.shadow_epoch == _shadows_module._epoch
        changes = (self.scaling.changes, self.dropout.changes)
        if (seen is not None and seen[0] is layout and seen[1] == tokens_per_row and seen[2] == self.direct_grads
                and seen[3] == shadows and seen[4] == changes):
            return self._weights  # the same layout object (treated as immutable): no key to build and compare
        key = (layout.names, layout.starts, layout.ends, tokens_per_row, self.direct_grads, shadows,
               layout.padding_side, changes)
        weights = self._kept.get(key, _UNSEEN)
        if weights is _UNSEEN:
            # (an adapter without rows here takes no part: the kernels gave it zero gradients, which an optimizer's
            # momentum and weight decay step, where autograd, PEFT alone or the reference gives it none)
            held = [(i, n) for i, n in enumerate(layout.names)
                    if n in self.lora_A and layout.ends[i] > layout.starts[i]]
            weights = None
            copies: tuple[tuple[Tensor, Tensor], ...] = ()
            if shadows and held and all(n in self.shadows for _, n in held):
                copies = tuple(self.shadows[n] for _, n in held)
            streams = None
            if held and all(n in self.streams for _, n in held):
                streams = DropoutStreams(tuple(self.streams[n][0] for _, n in held),
                                         tuple(self.streams[n][1] for _, n in held),
                                         self.context.steps_on(self.lora_A[held[0][1]].device))
            if held:
                weights = LoRAWeights(
                    a=tuple(self.lora_A[n] for _, n in held),
                    b=tuple(self.lora_B[n] for _, n in held),
                    scaling=tuple(self.scaling[n] for _, n in held),
                    dropout=tuple(self.dropout[n] for _, n in held),
                    starts=tuple(layout.starts[i] * tokens_per_row for i, _ in held),
                    ends=tuple(layout.ends[i] * tokens_per_row for i, _ in held),
                    direct_grads=self.direct_grads,
                    a_copies=tuple(a for a, _ in copies),
                    b_copies=tuple(b for _, b in copies),
                    streams=streams,
                    # (the dropout masks' sequence rows: positions of a left-padded row count from its end)
                    row_tokens=-tokens_per_row if layout.padding_side == "left" else tokens_per_row,
                )
            self._kept[key] = weights
            if len(self._kept) > KEPT_LAYOUTS:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        self._weights = weights
        self._dropout_on = (weights is not None and weights.streams is not None
                            and any(p > 0 for p in weights.dropout))
        self._weights_seen = (layout, tokens_per_row, self.direct_grads, shadows, changes)
        return self._weights

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={self.adapter_names}"


def _check_adapter_args(where: str, name: Any, rank: Any, alpha: Any, dropout: Any, use_rslora: Any,
                        dtype: Any) -> None:
    """An adapter's arguments, each error naming the argument, what it may be and what it got (before any layer
    is touched)."""
    check_adapter_name(name, f"{where}: ")
    check_int(where, "rank", rank, 1)
    check_real(where, "alpha", alpha, lambda v: v > 0, "a number > 0")
    check_real(where, "dropout", dropout, lambda v: 0 <= v < 1, "a number in [0, 1)")
    check_bool(where, "use_rslora", use_rslora)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: `dtype` must be a floating torch.dtype (torch.float32, torch.bfloat16, ...), got "
                         f"{dtype!r}")


def _check_target_names(target_modules: Any, otherwise: str) -> None:
    """``target_modules`` that are not a string: module names, or a named error (``otherwise``: what else it takes)."""
    if not isinstance(target_modules, Iterable) or not all(isinstance(t, str) for t in target_modules):
        raise ValueError(f"`target_modules` must be a list of module names, a regex string or {otherwise}, got "
                         f"{target_modules!r}")


def _compute_dtype(base: nn.Module) -> Optional[torch.dtype]:
    """The dtype a base layer computes in: its weight's, or a quantized layer's ``compute_dtype`` (None: unknown)."""
    weight = getattr(base, "weight", None)
    if isinstance(weight, Tensor) and weight.is_floating_point():
        return weight.dtype
    dtype = getattr(base, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _weight_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


LINEAR_TYPES: tuple[type, ...] = (nn.Linear,)


def linear_shape(module: nn.Module) -> Optional[tuple[int, int]]:
    """``(in_features, out_features)`` of a linear layer: an ``nn.Linear`` (bitsandbytes' 4-/8-bit layers subclass
    it), anything else with those attributes and a weight, or a transformers ``Conv1D`` (GPT-2's projections: weight
    ``(in, out)``, PEFT adapts them too); None for anything else."""
    if isinstance(module, LINEAR_TYPES) or (hasattr(module, "in_features") and hasattr(module, "out_features")
                                            and hasattr(module, "weight")):
        return int(module.in_features), int(module.out_features)
    weight = getattr(module, "weight", None)
    if (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf):
        return int(weight.shape[0]), int(module.nf)
    return None


def _is_linear(module: nn.Module) -> bool:
    return linear_shape(module) is not None


def _matches(name: str, targets: Union[str, Sequence[str]]) -> Optional[str]:
    """PEFT's rule: a string is a regex on the full name; a list matches the name or its last parts."""
    if isinstance(targets, str):
        if targets.lower() == "all-linear":  # (the output head, whatever its name, is left out by the callers)
            return targets if not name.endswith("lm_head") else None
        return targets if re.fullmatch(targets, name) else None
    for key in targets:
        if name == key or name.endswith("." + key):
            return key
    return None


class LoRALayers(Mapping):
    """The `MultiLoRALinear` layers injected into one model, by module name, with one shared layout.

    Adds and removes adapters across layers, and yields an adapter's parameters and its PEFT-named
    state dict.

    ``shadows`` (default True): an adapter held flat in fp32 on a CUDA device, in layers whose base computes in
    bf16 or fp16, also keeps its weights in that dtype (a `Shadow`, which `GroupedAdamW` writes at its step). Inside
    `use`, the stale ones are copied again and the layers' kernels read them instead of copying their own weights at
    every call. Set it False (before adapters are added or the model is moved) to copy per call.
    """

    shadows: bool = True

    def __init__(self, model: nn.Module, layers: dict[str, MultiLoRALinear], context: LayoutContext) -> None:
        self.model = model
        self._layers = layers
        self.context = context
        self._targets: dict[str, list[str]] = {}
        self._flat: dict[str, Optional[FlatAdapter]] = {}  # per adapter; None: kept per layer (several devices)
        self._attached: dict[str, Optional[Shadow]] = {}  # per adapter, the shadow its layers' views are of
        self._param_dicts: dict[str, tuple[dict, ...]] = {}  # per adapter, its layers' lora_A/_B parameter dicts
        self._refreshed_before_replays = False
        self._slots: dict[str, int] = {}  # per adapter, its slot in the dropout step counters
        self._advance_index: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()  # (slots, device): (index, ones)

    def __getitem__(self, key: str) -> MultiLoRALinear:
        return self._layers[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    @property
    def adapter_names(self) -> list[str]:
        return list(self._targets)

    def layers_for(self, target_modules: Optional[Union[str, Sequence[str]]]) -> list[str]:
        """Names of the injected layers an adapter with these targets lives in."""
        if target_modules is None:
            return list(self._layers)
        if not isinstance(target_modules, str):
            _check_target_names(target_modules, "None")
            missing = [t for t in target_modules if not any(_matches(n, [t]) for n in self._layers)]
            if missing:
                raise ValueError(
                    f"`target_modules` {missing} are not among the injected layers; injected module names "
                    f"end in: {sorted({n.rsplit('.', 1)[-1] for n in self._layers})} (an adapter's targets are "
                    "names, matched as PEFT matches a list; leave them None for every injected layer)"
                )
        all_linear = isinstance(target_modules, str) and target_modules.lower() == "all-linear"
        head = self._head_name() if all_linear else None
        names = [n for n in self._layers if _matches(n, target_modules) and n != head]
        if not names:
            raise ValueError(f"`target_modules` {target_modules!r} match none of the injected layers; injected "
                             f"module names end in: {sorted({n.rsplit('.', 1)[-1] for n in self._layers})}")
        return names

    def unwrapped_matches(self, target_modules: Union[str, Sequence[str]], heads: bool = False) -> list[str]:
        """The model's linear modules that ``target_modules`` select but that were not injected (an adapter's
        targets choose among the injected layers: these it cannot have); ``heads``: its output head (`lm_head`)
        among them."""
        wrapped = set(self._layers)
        attention = {n for n, m in self.model.named_modules() if isinstance(m, nn.MultiheadAttention)}  # (skipped)
        head = self._head_name()
        return [n for n, m in self.model.named_modules() if n and n not in wrapped and n.rpartition(".")[0] not in
                wrapped | attention and _is_linear(m) and _matches(n, target_modules) and (heads or n != head)]

    def _head_name(self) -> str:
        """The model's output head's module name (PEFT's "all-linear" leaves it out, whatever its name: GPT-NeoX's
        ``embed_out``...); ``lm_head`` where the model names none."""
        head = _output_embeddings(self.model)
        return next((n for n, m in self.model.named_modules() if head is not None and m is head), "lm_head")

    def add_adapter(
        self,
        name: str,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        target_modules: Optional[Union[str, Sequence[str]]] = None,
        seed: int = 0,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Add adapter ``name`` to every layer its ``target_modules`` select (all injected layers if None).

        Initialisation is drawn from a generator seeded by ``seed`` and the layer's name, so an adapter's initial
        weights do not depend on which other adapters exist, nor on which other layers were injected. So are its
        dropout masks (with
        ``dropout > 0``), from ``seed``, the layer and its dropout step (`dropout_steps`): the same whichever adapters
        share its forwards, wherever its rows lie in the batch and however long its neighbours pad the rows (two
        adapters of one seed get the same masks). The adapter's parameters are then
        held flat (see `FlatAdapter`) where they share a device. ``dtype``: as `MultiLoRALinear.add_adapter`'s.
        """
        _check_adapter_args("LoRALayers.add_adapter", name, rank, alpha, dropout, use_rslora,
                            torch.float32 if dtype is None else dtype)
        check_int("LoRALayers.add_adapter", "seed", seed, -(2**42) + 1, high=2**42 - 1)
        if name in self._targets:
            raise ValueError(f"adapter {name!r} already exists; adapter names must be unique")
        layer_names = self.layers_for(target_modules)
        used = set(self._slots.values())
        slot = next((i for i in range(DROPOUT_SLOTS) if i not in used), None)
        if slot is None:
            raise RuntimeError(f"at most {DROPOUT_SLOTS} adapters at once on one model; remove one first")
        try:
            for layer_name in layer_names:
                key = zlib.crc32(layer_name.encode())
                generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + key)
                self._layers[layer_name].add_adapter(name, rank, alpha, dropout, use_rslora, generator, dtype)
                self._layers[layer_name].streams[name] = (_stream_seed(seed, key), slot)
            self._slots[name] = slot
            for steps in self.context.dropout_steps.values():
                steps[slot] = 0
            self._targets[name] = layer_names
            self._flat[name] = make_flat(self.parameters_of(name))
            self._sync_shadow(name)
        except BaseException:  # (out of memory partway: the layers it reached kept it, and its name could not be
            self._forget(name, layer_names)  # added again, "already exists in this layer")
            raise

    def _forget(self, name: str, layer_names: Sequence[str]) -> None:
        """Adapter ``name`` out of every layer of ``layer_names`` that holds it, its shadow dropped, and out of this
        object's tables (`remove_adapter`; an `add_adapter` that failed partway)."""
        for layer_name in layer_names:
            if name in self._layers[layer_name].lora_A:
                self._layers[layer_name].remove_adapter(name)
        flat = self._flat.get(name)
        if flat is not None:
            flat.drop_shadow()
        for table in (self._targets, self._slots, self._flat, self._attached, self._param_dicts):
            table.pop(name, None)

    def remove_adapter(self, name: str) -> None:
        if name not in self._targets:
            raise KeyError(f"no adapter {name!r}; present: {self.adapter_names}")
        self._forget(name, self._targets[name])

    def parameters_of(self, name: str) -> list[nn.Parameter]:
        if name not in self._targets:
            raise KeyError(f"no adapter {name!r}; present: {self.adapter_names}")
        params = []
        for layer_name in self._targets[name]:
            layer = self._layers[layer_name]
            params += [layer.lora_A[name], layer.lora_B[name]]
        return params

    def flat_adapter(self, name: str) -> Optional[FlatAdapter]:
        """Adapter ``name``'s `FlatAdapter` (None where its parameters are kept per layer: several devices)."""
        if name not in self._targets:
            raise KeyError(f"no adapter {name!r}; present: {self.adapter_names}")
        return self._flat.get(name)

    def rebind(self) -> None:
        """After the model was moved or cast: every flat adapter follows its parameters (see `FlatAdapter`). Where
        the layers hold new parameter objects (``to_empty`` from the meta device replaces them), the adapter is
        held flat anew over those, with their values: a new flat parameter, so an optimizer built before must be
        built again. The layers drop the adapter weights they cached (they may hold replaced parameters)."""
        for name, flat in self._flat.items():
            if flat is None:
                continue
            params = self.parameters_of(name)
            if len(params) == len(flat.params) and all(map(is_, params, flat.params)):
                flat.rebind()
            else:
                flat.drop_shadow()
                self._flat[name] = make_flat(params)
            self._sync_shadow(name)
        for layer in self._layers.values():
            layer.forget_weights()

    def _shadow_dtype(self, name: str) -> Optional[torch.dtype]:
        """The dtype adapter ``name``'s shadow should have (None: it should have none)."""
        flat = self._flat.get(name)
        if not self.shadows or flat is None:
            return None
        p = flat.flat
        try:
            backend = resolve_backend(p)
        except ValueError:  # (the 'triton' backend forced, the adapter on the CPU, as a fit's teardown moves it: none
            return None  # until it is on CUDA; asked, it raised in `add_adapter` and at every move)
        if p.dtype != torch.float32 or p.is_inference() or backend != "triton":
            return None  # (the Triton path copies fp32 weights; inference tensors count no versions)
        dtypes = {_compute_dtype(self._layers[n].base) for n in self._targets[name]}
        return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} else None

    def _sync_shadow(self, name: str) -> Optional[Shadow]:
        """Adapter ``name``'s shadow made, renewed or dropped as `_shadow_dtype` says, and its layers' views of it
        (`MultiLoRALinear.shadows`) set."""
        flat = self._flat.get(name)
        dtype = self._shadow_dtype(name)
        shadow = None
        if flat is not None:
            if dtype is None:
                flat.drop_shadow()
            else:
                shadow = flat.keep_shadow(dtype)
        if name in self._attached and self._attached[name] is shadow:
            return shadow
        for i, layer_name in enumerate(self._targets[name]):
            layer = self._layers[layer_name]
            if shadow is None:
                layer.shadows.pop(name, None)
            else:  # (the views are in `parameters_of`'s order: A and B of each layer)
                layer.shadows[name] = (shadow.views[2 * i], shadow.views[2 * i + 1])
            layer.forget_weights()
        self._attached[name] = shadow
        return shadow

    def refresh_shadows(self, names: Sequence[str], check: bool = True) -> bool:
        """Before a forward of adapters ``names``: their parameters checked (`_held_flat`), their stale shadows copied
        again (one launch). Returns whether the layers may read shadows. ``check=False``: the caller has just
        refreshed them; only says whether they may be read.

        During a CUDA graph capture a replay runs no Python, so the graph copies the adapters' weights into their
        shadows itself (one launch, at every replay, as the per-call copies did without shadows), unless the capture
        runs inside `refreshed_before_replays`: its caller refreshes the shadows before every replay
        (`MultiLoRAMixin` does), and the graph reads them as they are."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not self.shadows:
            if check and not capturing:  # (no shadow to copy: the layers' parameters are checked all the same)
                for name in names:
                    self._held_flat(name)
            return False
        if capturing and not self._refreshed_before_replays:
            attached = [s for s in map(self._attached.get, names) if s is not None]
            if attached:
                record_copy(attached)
            return bool(attached)
        if not check or capturing:
            return any(self._attached.get(name) is not None for name in names)
        shadows = []
        for name in names:
            flat = self._held_flat(name)
            if flat is None or flat.shadow is None:
                continue
            shadow = flat.shadow
            if shadow is not None and self._attached.get(name) is not shadow:  # renewed by a rebind
                shadow = self._sync_shadow(name)
            if shadow is not None:
                shadows.append(shadow)
        if shadows:
            _refresh(shadows)
        return bool(shadows)

    def _held_flat(self, name: str) -> Optional[FlatAdapter]:
        """Adapter ``name``'s flat parameter (None where it has none), held flat again first where a storage or a
        parameter was replaced behind its back (``p.data = t``, ``load_state_dict(..., assign=True)``, a deep copy):
        else the layers, the optimizer and the export would read different tensors."""
        flat = self._flat.get(name)
        if flat is None:
            return None
        holds = self._holds(name, flat)
        if not holds or not flat.bound():
            self.rebind()  # (over the layers' parameters as they are now; the layers drop their cached weights)
            flat = self._flat[name]
            if not holds:  # (FSDP2's `fully_shard` too: its sharded parameters are held per layer, `can_hold`)
                how = "it is held flat anew" if flat is not None else "it is held per layer now (sharded parameters)"
                warnings.warn(f"adapter {name!r}: its layers hold other parameter objects than its flat parameter "
                              f"(load_state_dict(..., assign=True)?); {how}, and an optimizer built before steps the "
                              "old parameters: build it again")
        return flat

    def _holds(self, name: str, flat: FlatAdapter) -> bool:
        """The layers' ``lora_A`` / ``lora_B`` of adapter ``name`` are still ``flat``'s parameters (plain dict reads:
        ``parameters_of`` through ``ParameterDict`` costs ~0.7 ms an adapter of 448 tensors)."""
        dicts = self._param_dicts.get(name)
        if dicts is None:
            dicts = self._param_dicts[name] = tuple(
                d for n in self._targets[name] for d in (self._layers[n].lora_A._parameters,
                                                           self._layers[n].lora_B._parameters))
        return all(map(is_, map(itemgetter(name), dicts), flat.params))

    @contextmanager
    def refreshed_before_replays(self) -> Iterator[None]:
        """Captures made inside read the shadows: the caller refreshes them (`refresh_shadows`) before every replay
        of those graphs, and captures nothing while any is stale."""
        previous, self._refreshed_before_replays = self._refreshed_before_replays, True
        try:
            yield
        finally:
            self._refreshed_before_replays = previous

    def step_parameters(self, name: str) -> list[nn.Parameter]:
        """The tensors that hold adapter ``name``'s gradients for a step: its flat parameter (one tensor for every
        layer), or its per-layer parameters where it is not held flat. Norms and clipping work on these. The flat
        parameter's gradient is the one the layers' gradients are views of only after `prepare_grads` (call it
        before each backward: without it the backward fills the per-layer ``.grad`` alone, and an optimizer over
        these tensors finds no gradient)."""
        flat = self.flat_adapter(name)
        return [flat.flat] if flat is not None else self.parameters_of(name)

    def optimizer_parameters(self, name: str, elementwise: bool) -> list[nn.Parameter]:
        """What an optimizer steps for adapter ``name``: the flat parameter for an ``elementwise`` one (Adam, SGD:
        the same update on the concatenation), else the per-layer parameters (their gradients are the same
        views of the flat gradient)."""
        return self.step_parameters(name) if elementwise else self.parameters_of(name)

    def prepare_grads(self, *names: str) -> None:
        """Before a step's backward: the gradients of the adapters ``names`` zeroed (kept, not dropped: the kernels
        add into the same tensors every step), each layer's ``.grad`` a view of its adapter's flat gradient. One
        multi-tensor zeroing for them all. Nothing reads the gradients before the backward, so a step may call
        this after its forward, while the device still runs it (its host time then costs no device time)."""
        stale = []
        for name in names:
            flat = self.flat_adapter(name)
            if flat is None:
                stale += [p.grad for p in self.parameters_of(name) if p.grad is not None]
            else:
                stale.append(flat.prepare_grads(zero=False))  # (a new one made empty: zeroed here with the rest)
        if stale:
            torch._foreach_zero_(stale)

    def drop_grads(self, name: str) -> None:
        """Adapter ``name`` has no gradient this step (an optimizer skips it)."""
        flat = self.flat_adapter(name)
        if flat is not None:
            flat.drop_grads()  # the per-layer gradients too
            return
        for p in self.parameters_of(name):
            p.grad = None

    def target_layers(self, name: str) -> list[str]:
        return list(self._targets[name])

    def peft_state_dict(self, name: str, prefix: str = "base_model.model.") -> dict[str, Tensor]:
        """Adapter ``name``'s weights under PEFT's saved key names (``...q_proj.lora_A.weight``): copies, each with
        its own storage (the parameters are views of one flat tensor, which safetensors would refuse to save)."""
        out = {}
        for layer_name in self._targets[name]:
            layer = self._layers[layer_name]
            out[f"{prefix}{layer_name}.lora_A.weight"] = layer.lora_A[name].detach().clone()
            out[f"{prefix}{layer_name}.lora_B.weight"] = layer.lora_B[name].detach().clone()
        return out

    def load_peft_state_dict(self, name: str, state: Mapping[str, Tensor], prefix: str = "base_model.model.") -> None:
        """Load adapter ``name``'s weights from PEFT's key names (`peft_state_dict`'s): every layer it targets, each
        weight of its own shape (a ValueError names what is missing, of another shape, for layers it does not
        target, not a tensor, or weights a plain LoRA adapter has no place for, such as DoRA's magnitudes, LoRA
        biases, the base biases PEFT saves with ``bias="all"`` or ``"lora_only"`` and ``modules_to_save`` copies;
        nothing is loaded then)."""
        expected = {f"{prefix}{layer_name}.lora_{ab}.weight": getattr(self._layers[layer_name], f"lora_{ab}")[name]
                    for layer_name in self._targets[name] for ab in "AB"}
        copies = self._base_copies(prefix)
        _check_peft_shapes(name, {k: tuple(p.shape) for k, p in expected.items()},
                           {k: tuple(v.shape) if isinstance(v, Tensor) else None for k, v in state.items()},
                           {k: tuple(w.shape) for k, w in copies.items()})
        differ = [k for k, w in copies.items() if k in state and not _same_values(state[k], w)]
        if differ:
            raise ValueError(f"weights for adapter {name!r} do not fit it: its file holds base weights other than "
                             f"this base's {differ} (PEFT's `save_embedding_layers`: a resized vocabulary, or another "
                             "base); these adapters share the frozen base as it is")
        with torch.no_grad():
            for key, p in expected.items():
                p.copy_(state[key])

    def _base_copies(self, prefix: str) -> dict[str, Tensor]:
        """The base weights of the wrapped layers under PEFT's saved names (``<layer>.base_layer.weight``, and its
        ``bias``): PEFT's `save_pretrained` writes them beside the LoRA weights of a targeted ``lm_head`` or embedding
        (``save_embedding_layers="auto"``); an adapter file that holds this base's own is plain LoRA."""
        copies = {}
        for layer_name, layer in self._layers.items():
            for field in ("weight", "bias"):
                value = getattr(layer.base, field, None)
                if isinstance(value, Tensor):
                    copies[f"{prefix}{layer_name}.base_layer.{field}"] = value
        # the embeddings an untargeted `save_embedding_layers=True` saves whole (`<module>.weight`)
        embeddings = {id(m) for m in (_embeddings(self.model, "input"), _output_embeddings(self.model))
                      if m is not None}
        for module_name, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if module_name and id(module) in embeddings and isinstance(weight, Tensor):
                copies[f"{prefix}{module_name}.weight"] = weight
        return copies

    def check_peft_shapes(self, name: str, rank: int, target_modules: Optional[Union[str, Sequence[str]]],
                          shapes: Mapping[str, Optional[tuple[int, ...]]], prefix: str = "base_model.model.") -> None:
        """The check of `load_peft_state_dict`, before adapter ``name`` (of ``rank``, on ``target_modules``) is
        made: would weights of these ``shapes`` (key: shape, None where no tensor) load into it? A ValueError as
        that method gives where not."""
        expected = {}
        for layer_name in self.layers_for(target_modules):
            layer = self._layers[layer_name]
            expected[f"{prefix}{layer_name}.lora_A.weight"] = (rank, layer.in_features)
            expected[f"{prefix}{layer_name}.lora_B.weight"] = (layer.out_features, rank)
        _check_peft_shapes(name, expected, shapes, {k: tuple(w.shape) for k, w in self._base_copies(prefix).items()})

    @contextmanager
    def use(self, layout: Optional[BatchLayout], refresh: bool = True) -> Iterator[None]:
        """Context manager: run the model with this batch layout (its adapters' stale shadows copied on entry;
        ``refresh=False``: the caller has just refreshed them, `refresh_shadows`). With gradients on (a training
        forward: gradients on, the model in training mode), each of the layout's adapters with rows and dropout advances
        its dropout step: open it once per forward + backward (a recomputation inside takes the same masks; a second
        forward is warned of). A forward (or backward) that raises inside takes its advance back: a retried batch
        gets the masks it would have had. A name that is no adapter here is an error (its rows would get the base's
        output, silently), as PEFT's mixed batch says of an adapter it does not have."""
        unknown = [n for n in layout.names if n not in self._targets] if layout is not None else []
        if unknown:
            raise ValueError(f"the layout names {unknown}, which are no adapters of these layers; adapters: "
                             f"{self.adapter_names} (rows of the base alone are left out of every segment)")
        shadows = layout is not None and self.refresh_shadows(layout.names, check=refresh)
        advanced = ()
        if layout is not None and torch.is_grad_enabled() and self.model.training:
            advanced = self._advance_dropout(layout)
        with self.context.use(layout, shadows=shadows):
            try:
                yield
            except BaseException:
                for steps, (index, ones) in advanced:
                    if not (steps.is_cuda and torch.cuda.is_current_stream_capturing()):  # (a failed capture: none)
                        steps.index_add_(0, index, ones, alpha=-1)
                raise

    def _dropout_slots(self, layout: BatchLayout) -> tuple[int, ...]:
        """The dropout-step slots of ``layout``'s adapters with rows and dropout (those a training forward advances)."""
        return tuple(self._slots[n] for n, s, e in zip(layout.names, layout.starts, layout.ends)
                     if e > s and n in self._slots and self._layers[self._targets[n][0]].dropout[n] > 0)

    def rewind_dropout(self, layout: BatchLayout) -> None:
        """Take back the dropout advance of a training forward over ``layout`` that `use` completed, where its step
        was not taken after all (a Ctrl+C after the backward, before the optimizer's step): the step taken again
        draws the same masks, as one that raised inside `use` does."""
        slots = self._dropout_slots(layout)
        for steps in self.context.dropout_steps.values():
            if slots and not steps.is_meta:
                steps.index_add_(0, torch.tensor(slots, device=steps.device),
                                 torch.full((len(slots),), -1, dtype=steps.dtype, device=steps.device))

    def _advance_dropout(self, layout: BatchLayout) -> list[tuple[Tensor, tuple[Tensor, Tensor]]]:
        """A training forward: the dropout step of each of the layout's adapters with rows and dropout advances
        by one (one launch, on the device, so that a CUDA graph of the step advances them at each replay). The
        tables advanced, with the (slots, ones) added."""
        slots = self._dropout_slots(layout)
        advanced = []
        if not slots:
            return advanced
        self.context.steps_on(self._device_of(next(n for n in layout.names if n in self._slots)))
        for device, steps in self.context.dropout_steps.items():
            key = (slots, device)
            index = self._advance_index.get(key)
            if index is None:  # (made by an eager step before any capture of this layout: a capture cannot)
                if len(self._advance_index) >= 64:
                    self._advance_index.popitem(last=False)  # the least recently used
                index = self._advance_index[key] = (torch.tensor(slots, dtype=torch.int64, device=device),
                                                    torch.ones(len(slots), dtype=torch.int64, device=device))
            else:
                self._advance_index.move_to_end(key)
            if steps.is_cuda and torch.cuda.is_current_stream_capturing():
                from lightning_multilora.kernels.triton_lora import keep_alive

                keep_alive(index)  # (held by the graph's step while the cache may drop it)
            steps.index_add_(0, *index)
            advanced.append((steps, index))
        return advanced

    def dropout_steps(self) -> dict[str, int]:
        """Each adapter's dropout step: how many training forwards (`use`, see there) it has had rows in,
        while it had dropout. Its masks at a step depend on its seed, its step and the layer alone."""
        tables: dict[torch.device, list[int]] = {}  # each adapter's from the table on its own device
        steps = {}
        for name, slot in self._slots.items():
            device = self._device_of(name)
            if device.type == "meta":
                steps[name] = 0
                continue
            if device not in tables:
                tables[device] = self.context.steps_on(device).tolist()
            steps[name] = tables[device][slot]
        return steps

    def set_dropout_steps(self, steps: Mapping[str, int]) -> None:
        """Set the dropout steps of the adapters named in ``steps`` (a resumed run's, from `dropout_steps`)."""
        unknown = sorted(set(steps) - set(self._slots))
        if unknown:
            raise KeyError(f"no adapter {unknown}; present: {self.adapter_names}")
        bad = {n: s for n, s in steps.items()
               if not isinstance(s, numbers.Integral) or isinstance(s, bool) or not 0 <= s < 2**62}
        if bad:
            raise ValueError(f"dropout steps must be integers in [0, 2**62), got {bad}")
        for name, step in steps.items():
            self.context.steps_on(self._device_of(name))
            for table in self.context.dropout_steps.values():
                table[self._slots[name]] = int(step)

    def _device_of(self, name: str) -> torch.device:
        return self._layers[self._targets[name][0]].lora_A[name].device


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear modules (what ``target_modules`` can name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _is_linear(m)})


def inject_multilora(
    model: nn.Module, target_modules: Union[str, Sequence[str]] = ("q_proj", "v_proj")
) -> LoRALayers:
    """Wrap the frozen linear layers named by ``target_modules`` in `MultiLoRALinear`, in place.

    ``target_modules`` follows PEFT: a list of names matched against each module's name or its last
    parts (``"q_proj"``, ``"self_attn.q_proj"``), a regex string on the full name, or ``"all-linear"``.
    Every base parameter of ``model`` is frozen. A name that matches no linear module is an error
    listing the model's linear modules. A bitsandbytes 4-bit base is kept from its CPU repacking
    (`guard_4bit_base`, which refuses one already repacked and says a 4-bit base on the CPU).
    """
    target_modules = peft_targets(target_modules)  # ("ALL-LINEAR", a set as `LoraConfig.target_modules` holds)
    # a `torch.compile`d model: its layers wrapped and named in the model it compiled (the wrapper's names begin
    # `_orig_mod.`, which PEFT's adapters of the plain model never hold: exports PEFT loaded as nothing, `init_from`
    # refused), and held as that model; its compiled forward runs them as it runs its own layers
    model = getattr(model, "_orig_mod", model)
    if not isinstance(target_modules, str):
        _check_target_names(target_modules, "'all-linear'")
        target_modules = list(target_modules)
        if not target_modules:
            raise ValueError("`target_modules` must name at least one module")
    injected = next((n for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)), None)
    if injected is not None:  # (else "all-linear" or a regex would wrap the wrapped layers' bases again)
        raise ValueError(f"the model already holds MultiLoRALinear layers ({injected!r}...); inject once per model "
                         "(add adapters to the `LoRALayers` the first injection returned)")
    tuner = next(((n, m) for n, m in model.named_modules() if type(m).__module__.split(".")[0] == "peft"), None)
    if tuner is not None:  # (its LoRA layers look linear: they would be wrapped, or their adapter trained again)
        raise ValueError(
            f"the model holds PEFT modules ({repr(tuner[0]) if tuner[0] else 'the model'} is a "
            f"{type(tuner[1]).__name__}): give the plain base (`peft_model.unload()`: the base without its adapters, "
            "or `merge_and_unload()` to train on top of the merged weights); to continue a saved PEFT adapter, "
            "name its folder in `AdapterSpec(init_from=...)`")
    modules = dict(model.named_modules())
    # the projections nn.MultiheadAttention reads as weights (its forward never calls them): LoRA there would do
    # nothing, and the attention would find no `weight`
    attention = {f"{n}.{c}" if n else c for n, m in modules.items() if isinstance(m, nn.MultiheadAttention)
                 for c, _ in m.named_children()}
    candidates = [n for n, m in model.named_modules() if n and _matches(n, target_modules)]
    if target_modules == "all-linear":  # (PEFT's: every linear layer but the output head, whatever its name)
        head = _output_embeddings(model)
        candidates = [n for n in candidates if _is_linear(modules[n]) and modules[n] is not head
                      and n not in attention]
    # a mixture-of-experts block calling one linear per expert on the tokens routed to it: that layer never sees the
    # whole batch, whose rows the layout describes (transformers 4.x's Mixtral and Qwen2-MoE, DeepSeek's code)
    experts = [n for n in candidates if _EXPERT.search(n) and _is_linear(modules[n])]
    if experts and target_modules == "all-linear":
        warnings.warn(f"'all-linear' leaves out the {len(experts)} linear layers of mixture-of-experts experts "
                      f"({experts[0]!r}...): each is called on the tokens routed to it, not on the whole batch whose "
                      "rows the adapters own, so they cannot be adapted here")
        candidates = [n for n in candidates if n not in experts]
    elif experts:
        raise ValueError(f"`target_modules` selects {experts[0]!r} (and {len(experts) - 1} more), the linear layers "
                         "of mixture-of-experts experts: each is called on the tokens routed to it, not on the whole "
                         "batch whose rows the adapters own, so they cannot be adapted here; leave them out (name the "
                         "attention projections, or a regex such as r'^(?!.*\\.experts\\.).*_proj$')")
    routers = [n for n in candidates if _linear_router(modules[n])]
    if routers and target_modules != "all-linear":
        raise ValueError(f"`target_modules` selects {routers[0]!r} ({type(modules[routers[0]]).__name__}), a "
                         "mixture-of-experts router: a linear layer that returns its routing (scores and experts), "
                         "not an output an adapter adds to; leave it out (name the attention projections, or a regex "
                         "such as r'^(?!.*router).*_proj$')")
    candidates = [n for n in candidates if n not in routers]  # ("all-linear": said below, with the fused ones)
    fused = _fused_moe_modules(modules) + routers if target_modules == "all-linear" else []
    if fused:  # (transformers 5's Mixtral, Qwen2-MoE, GPT-OSS...: no linear layer to wrap, nothing to warn of above)
        shown = ", ".join(f"{n!r} ({type(modules[n]).__name__})" for n in fused[:2]) + "..." * (len(fused) > 2)
        warnings.warn(f"'all-linear' leaves out {len(fused)} mixture-of-experts modules that are not plain linear "
                      f"layers ({shown}): experts held as fused weights, and routers; these adapters wrap linear "
                      "layers only (the attention and any dense or shared MLP layers here), where PEFT's 'all-linear' "
                      "adapts some such modules too (Mixtral's, through `target_parameters`)")
    held = [n for n in candidates if n in attention]
    if held:
        raise ValueError(f"`target_modules` selects {held[0]!r}, a projection of nn.MultiheadAttention, which reads "
                         "its weights itself and never calls it: an adapter there would change nothing; leave it out "
                         "(\"all-linear\" does)")
    available = linear_module_names(model)
    if not isinstance(target_modules, str):
        unknown = [t for t in target_modules if not any(_matches(n, [t]) for n in candidates)]
        if unknown:
            raise ValueError(f"`target_modules` {unknown} match no module of the model; its linear modules are: "
                             f"{available}")
    if not candidates:
        raise ValueError(f"`target_modules` {target_modules!r} match no module; linear modules are: {available} (a "
                         "string is a regex on the full module name, PEFT's rule, or 'all-linear'; a list matches "
                         "names, e.g. ['q_proj'])")
    _warn_tied_head(model, [modules[n] for n in candidates])
    # a bitsandbytes 4-bit base however it came (built, a pre-quantized folder, a model given): never repacked for
    # the CPU, whose backward then read it wrongly; one already repacked refused
    guard_4bit_base(model, stacklevel=3)
    model.requires_grad_(False)
    context = LayoutContext()
    layers: dict[str, MultiLoRALinear] = {}
    for name in candidates:
        module = modules[name]
        if not _is_linear(module):
            raise ValueError(f"`target_modules` selects {name!r}, a {type(module).__name__}, which is not a linear "
                             f"layer; linear modules are: {available}")
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        attention = getattr(parent, "self_attn", parent)  # (torch's layers: sequence first unless batch_first)
        if isinstance(parent, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.MultiheadAttention)) \
                and not getattr(attention, "batch_first", True):
            raise ValueError(f"`target_modules` selects {name!r}, in a {type(parent).__name__} with batch_first=False: "
                             "its inputs are sequence first, (tokens, rows, features), and a batch's rows go to their "
                             "adapters by their first dimension (where the tokens equal the rows, they would go to "
                             "others, unsaid); build it with batch_first=True, or leave it out of `target_modules`")
        wrapped = MultiLoRALinear(module, context)
        wrapped.layer_name = name
        setattr(parent, child, wrapped)
        layers[name] = wrapped
        # (torch's encoder / decoder layers read their linears' weights in their inference fast path)
        if isinstance(parent, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            context.mha_fastpath_off = True
    return LoRALayers(model, layers, context)


_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")  # a layer of one expert of a ModuleList of experts


def _linear_router(module: nn.Module) -> bool:
    """A mixture-of-experts router subclassing ``nn.Linear`` whose forward returns its routing, not the linear output
    (transformers 5's PhiMoE and Llama 4 routers): wrapped, its first step failed adding the LoRA term to a tuple."""
    return isinstance(module, nn.Linear) and type(module) is not nn.Linear and bool(
        re.search(r"router", type(module).__name__, re.IGNORECASE))


def _fused_moe_modules(modules: Mapping[str, nn.Module]) -> list[str]:
    """The names of the mixture-of-experts modules holding weights without being linear layers: transformers 5's
    experts, their weights fused into 3-D parameters (``gate_up_proj``, ``down_proj``), and its top-k routers."""
    return [n for n, m in modules.items() if n and not _is_linear(m) and re.search(r"expert|router", type(m).__name__,
                                                                                 re.IGNORECASE)
            and any(p.dim() >= 2 and p.is_floating_point() for p in m.parameters(recurse=False))]


def _same_values(saved: Any, weight: Tensor) -> bool:
    """Whether a base weight PEFT saved is ``weight``, to the rounding of the coarser of their dtypes (a base loaded
    in bf16 here from a checkpoint PEFT ran in fp16 or float32); a quantized or sharded weight is not compared."""
    if type(weight) not in (Tensor, nn.Parameter) or not weight.is_floating_point() or not isinstance(saved, Tensor) \
            or not saved.is_floating_point():
        return True
    if saved.shape != weight.shape:
        return False
    coarse = [torch.finfo(d) for d in (saved.dtype, weight.dtype)]
    saved, weight = saved.reshape(saved.shape[:1] + (-1,)), weight.reshape(weight.shape[:1] + (-1,))
    rows = max(1, (1 << 24) // max(1, weight.shape[-1]))  # (float32 chunks of ~64 MiB: a large head at once, GiBs)
    with torch.no_grad():
        return all(torch.allclose(s.to(device=w.device, dtype=torch.float32), w.float(),
                                  rtol=max(f.eps for f in coarse), atol=max(f.tiny for f in coarse))
                   for s, w in zip(saved.split(rows), weight.split(rows)))


def _warn_tied_head(model: nn.Module, wrapped: Sequence[nn.Module]) -> None:
    """Warn where an adapted layer is an output head whose weight is the input embeddings' (``tie_word_embeddings``,
    Gemma's and small Llamas'), as PEFT does: the adapter trains as PEFT's would, but a merge of its export
    (``merge_and_unload``) adds its product to that one tensor, and so changes the input embeddings too."""
    head = _output_embeddings(model)
    weight = getattr(_embeddings(model, "input"), "weight", None) if head is not None else None
    if weight is None or getattr(head, "weight", None) is not weight or not any(m is head for m in wrapped):
        return
    name = next(n for n, m in model.named_modules() if m is head)
    warnings.warn(f"`target_modules` selects {name!r}, the output head, whose weight is the input embeddings' (the "
                  "model ties them, `tie_word_embeddings=True`): the adapter trains as PEFT's would, but "
                  "`merge_and_unload()` of its export adds its product to that shared weight and so changes the "
                  "input embeddings too (PEFT warns of the same); leave it out to merge safely", stacklevel=3)


def _embeddings(model: nn.Module, side: str) -> Optional[nn.Module]:
    """A Hugging Face model's input embeddings (``side`` "input") or output head ("output": ``lm_head``, GPT-NeoX's
    ``embed_out``...), or None (a model without them, or whose getter is not implemented)."""
    get = getattr(model, f"get_{side}_embeddings", None)
    try:
        module = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    return module if isinstance(module, nn.Module) else None


def _output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    return _embeddings(model, "output")


def _stream_seed(seed: int, layer_key: int) -> int:
    """An adapter's dropout seed in the layer of ``layer_key`` (the CRC-32 of its name; its initialisation's
    generator takes ``seed * 1_000_003 + layer_key``: mixed otherwise, so that its first masks are not its initial
    weights' draws)."""
    return (int(seed) * 0x2545F491 + layer_key * 0x6C8E9CF5 + 0x1B873593) % STREAM_SEED_MOD


def _check_peft_shapes(name: str, expected: Mapping[str, tuple[int, ...]],
                       found: Mapping[str, Optional[tuple[int, ...]]],
                       base_copies: Mapping[str, tuple[int, ...]]) -> None:
    """`LoRALayers.load_peft_state_dict`'s check: ``found`` (PEFT's key names: a tensor's shape, None for what is no
    tensor) against adapter ``name``'s ``expected`` weights; a ValueError names every difference. ``base_copies``:
    the shapes of the base weights PEFT may save beside them (`LoRALayers._base_copies`), which pass where they fit."""
    missing = sorted(k for k in expected if k not in found)
    others = [k for k in found if k not in expected and not (k in base_copies and found[k] == base_copies[k])]
    extra = sorted(k for k in others if re.search(r"\.lora_[AB]\.weight$", k))
    unsupported = sorted(k for k in others if k not in extra)
    not_tensors = sorted(k for k in expected if k in found and found[k] is None)
    shapes = [f"{k} {found[k]} (adapter {name!r}'s is {shape})"
              for k, shape in expected.items() if k in found and k not in not_tensors and found[k] != shape]
    problems = [what for what, found_any in (
        (f"missing {missing}", missing), (f"not targeted by it {extra}", extra),
        (f"not plain LoRA weights (DoRA magnitudes, LoRA biases, embeddings, the base biases of PEFT's "
         f"bias='all' or 'lora_only', modules_to_save copies: not supported) {unsupported}", unsupported),
        (f"not tensors {not_tensors}", not_tensors),
        (f"other shapes: {', '.join(shapes)}", shapes)) if found_any]
    named = sorted({m.group(1) for k in found for m in [re.search(r"\.lora_[AB]\.([^.]+)\.weight$", k)] if m})
    if problems and named:  # (a live PeftModel's state_dict: its keys carry the adapter's name)
        problems.insert(0, f"its keys carry PEFT adapter names {named} (a live model's `state_dict()`): give "
                           "`peft.get_peft_model_state_dict(model, adapter_name=...)` or the saved "
                           "adapter_model.safetensors, whose keys have none")
    if problems:
        raise ValueError(f"weights for adapter {name!r} do not fit it: {'; '.join(problems)}")
