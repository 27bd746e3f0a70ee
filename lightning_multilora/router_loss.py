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

_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]
_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


def router_losses(model: nn.Module, out: Any, layout: BatchLayout, attention_mask: Optional[Tensor]
                  ) -> Optional[Tensor]:
    """Per adapter of ``layout``: ``router_aux_loss_coef`` times the load-balancing loss of the router logits of its
    rows (0 for an adapter without rows), a tensor of ``len(layout.names)``; None where ``out`` carries no router
    logits (a dense model, or ``output_router_logits`` off) or where the model's loss is not one this can split (said
    once, in a warning: the adapters then train on their cross-entropy alone)."""
    logits = getattr(out, "router_logits", None)
    if not logits:
        return None
    base = getattr(model, "_orig_mod", model)
    loss_func = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    values = [getattr(base, a, None) for a in _ATTRIBUTES]
    rows = layout.num_rows if attention_mask is None else attention_mask.shape[0]
    why = None
    if loss_func is None or list(inspect.signature(loss_func).parameters) != _SIGNATURE:
        why = f"{type(base).__name__}'s module has no load_balancing_loss_func({', '.join(_SIGNATURE)})"
    elif any(v is None for v in values):
        why = f"{type(base).__name__} has no {', '.join(a for a, v in zip(_ATTRIBUTES, values) if v is None)}"
    elif not isinstance(logits, tuple) or any(t.dim() != 2 or t.shape[0] % rows for t in logits):
        why = "its router logits are not (rows x positions, experts) per layer"
    if why is not None:
        if not getattr(base, "_multilora_router_warned", False):
            base.__dict__["_multilora_router_warned"] = True
            warnings.warn(f"the model returns router logits (`output_router_logits=True`), but {why}: the adapters "
                          "train on their cross-entropy alone, without its router load-balancing loss (set "
                          "`config.output_router_logits=False` to say so)")
        return None
    num_experts, top_k, coef = values
    per_layer = [t.view(rows, -1, t.shape[-1]) for t in logits]
    terms = []
    for start, end in zip(layout.starts, layout.ends):
        if end <= start:
            terms.append(per_layer[0].new_zeros((), dtype=torch.float32))
            continue
        mask = None if attention_mask is None else attention_mask[start:end]
        own = tuple(t[start:end].reshape(-1, t.shape[-1]) for t in per_layer)
        terms.append(coef * loss_func(own, num_experts, top_k, mask).float())
    return torch.stack(terms)
