"""A mixture-of-experts model's router load-balancing loss, per adapter of a packed batch.

A Hugging Face MoE causal LM whose config sets ``output_router_logits=True`` (Mixtral, Qwen2-MoE, OLMoE, ...) adds
``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to its loss when it is given labels: what
PEFT trains one adapter on. That term is a statistic over the whole batch's routing, so the packed batch's is not
each adapter's: here it is taken over each adapter's own rows, as the model computes it for a batch of those rows
alone, with the model's own function.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_multilora.layout import BatchLayout

_SIGNATURE = ("gate_logits", "num_experts", "top_k", "attention_mask")
_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")  # (JetMoE's is the second)
_checked: dict[Any, Optional[str]] = {}  # per model class and loss function: why it cannot be split (None: it can)


def routes(model: nn.Module) -> bool:
    """Whether ``model`` returns router logits at every forward (an MoE config's ``output_router_logits``)."""
    return bool(getattr(getattr(getattr(model, "_orig_mod", model), "config", None), "output_router_logits", False))


def router_losses(model: nn.Module, out: Any, layout: BatchLayout, attention_mask: Optional[Tensor]
                  ) -> Optional[Tensor]:
    """Per adapter of ``layout``: ``router_aux_loss_coef`` times the load-balancing loss of the router logits of its
    rows (0 for an adapter without rows), a tensor of ``len(layout.names)``; None where ``out`` carries no router
    logits (a dense model, or ``output_router_logits`` off) or where the model's loss is not one this can split (said
    once, in a warning: the adapters then train on their cross-entropy alone).

    The model's own ``load_balancing_loss_func`` (that of the first class of its MRO whose module defines one: a
    subclass of one's own keeps it) is called once per adapter, over its rows of every layer at once: the loss is a
    mean over the rows of all layers, so one call over them stacked is the model's call over them layer by layer."""
    logits = getattr(out, "router_logits", None)
    if logits is None or len(logits) == 0 or not layout.names:
        return None
    base = getattr(model, "_orig_mod", model)
    loss_func = next((f for c in type(base).__mro__ if callable(f := getattr(
        sys.modules.get(c.__module__), "load_balancing_loss_func", None))), None)
    rows = layout.num_rows if attention_mask is None else attention_mask.shape[0]
    num_experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    coef = next((v for a in _COEFFICIENTS if (v := getattr(base, a, None)) is not None), None)
    why = _why_not(type(base), loss_func, dict(num_experts=num_experts, num_experts_per_tok=top_k,
                                               router_aux_loss_coef=coef))
    if why is None and (not isinstance(logits, (tuple, list)) or any(
            not torch.is_tensor(t) or t.dim() != 2 or t.shape[0] % max(rows, 1) or t.shape != logits[0].shape
            for t in logits)):
        why = "its router logits are not (rows x positions, experts) per layer"
    if why is not None:
        if not getattr(base, "_multilora_router_warned", False):
            base.__dict__["_multilora_router_warned"] = True
            warnings.warn(f"the model returns router logits (`output_router_logits=True`), but {why}: the adapters "
                          "train on their cross-entropy alone, without its router load-balancing loss (set "
                          "`config.output_router_logits=False` to say so)")
        return None
    stacked = torch.stack([t.view(rows, -1, t.shape[-1]) for t in logits])  # (layers, rows, positions, experts)
    terms = []
    for start, end in zip(layout.starts, layout.ends):
        if end <= start:
            terms.append(stacked.new_zeros((), dtype=torch.float32))
            continue
        own = stacked[:, start:end].reshape(-1, stacked.shape[-1])  # (its rows of every layer, layer by layer)
        mask = None if attention_mask is None else attention_mask[start:end].repeat(len(logits), 1)
        terms.append(coef * loss_func((own,), num_experts, top_k, mask).float())
    return torch.stack(terms)


def _why_not(cls: type, loss_func: Any, values: dict[str, Any]) -> Optional[str]:
    """Why a model of class ``cls`` has no router loss to split (None: it has), its answer kept per class."""
    key = (cls, loss_func)
    if key not in _checked:
        if loss_func is None or tuple(inspect.signature(loss_func).parameters) != _SIGNATURE:
            _checked[key] = f"{cls.__name__}'s module has no load_balancing_loss_func({', '.join(_SIGNATURE)})"
        else:
            _checked[key] = None
    missing = [name for name, v in values.items() if v is None]
    return _checked[key] or (f"{cls.__name__} has no {', '.join(missing)}" if missing else None)
