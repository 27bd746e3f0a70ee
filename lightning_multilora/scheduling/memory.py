"""Peak-memory models of a packed multi-LoRA step: PLoRA's analytic formula and ALTO's fitted line.

- `ModelShape` holds what the formulas need of a decoder (layers, widths, heads, vocabulary) and the
  input/output widths of each LoRA target projection.
- `AnalyticMemoryModel` (PLoRA, appendix 8): base weights + per-adapter parameters, gradients and
  optimizer states + activations, with or without gradient checkpointing, as the GPU kernels keep them. Good for
  planning before any profiling, and on the CPU for a float32 base (the CPU's LoRA path keeps a float32 copy of a
  bf16 / fp16 base's inputs to each targeted projection, which it does not count: peaks 1.15-1.37x its
  figure at a tiny Llama's widths; profile there, `MemoryProfiler`).
- `MemoryFit` (ALTO, appendix A.3): ``M = k0 + k1 * B * L + k2 * P`` fitted by least squares on measured
  peaks, ``B`` the total batch (rows), ``L`` the sequence length and ``P`` the adapters' trainable
  parameters. ALTO's ``k0 + k1 * B * L`` is the case of a fixed adapter set; the ``P`` term lets one fit
  cover any number and rank of adapters. `MemoryFitCache` keeps fits on disk keyed by a signature of
  what they depend on (model, dtype, sequence length, ranks, targets, checkpointing, GPU).

Nothing here imports Lightning; sizes are bytes.
"""

from __future__ import annotations

import hashlib
import json
import functools
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_multilora.arguments import check_bool, check_int, check_real, peft_targets

if TYPE_CHECKING:
    from lightning_multilora.spec import AdapterSpec

log = logging.getLogger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# what `ModelShape.from_config` reads of a Hugging Face config: these, and where given, `OPTIONAL_CONFIG_FIELDS`
CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
OPTIONAL_CONFIG_FIELDS = ("num_key_value_heads", "head_dim", "tie_word_embeddings")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that its memory depends on.

    A mixture-of-experts decoder (Mixtral, Qwen2-MoE...): ``num_experts`` experts a layer, each a gated MLP of
    ``expert_intermediate`` (default ``intermediate``), ``experts_per_token`` of them routed each token, beside a
    shared expert of ``shared_intermediate`` (0: none); ``dense_layers`` of the layers have a dense MLP of
    ``intermediate`` instead (Qwen2-MoE's ``mlp_only_layers``). Every expert's weights count in the base; a token's
    activations, its routed experts'. (LoRA targets are counted as a dense layer's projections: the module adapts no
    fused expert, so on such a base an adapter's count is an upper bound.)"""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: Optional[int] = None
    tied_embeddings: bool = False  # the output head is the input embedding (`tie_word_embeddings`): counted once
    num_experts: int = 0  # 0: a dense MLP in every layer
    experts_per_token: int = 1
    expert_intermediate: Optional[int] = None
    shared_intermediate: int = 0
    dense_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "vocab_size"):
            check_int("ModelShape", name, getattr(self, name), 1)
        check_int("ModelShape", "head_dim", self.head_dim, 1, optional=True)
        check_bool("ModelShape", "tied_embeddings", self.tied_embeddings)  # (a "false" counted as tied)
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ValueError(f"ModelShape: `hidden` ({self.hidden}) is not a multiple of `num_heads` "
                             f"({self.num_heads}): give `head_dim`, the width of a head")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape: `num_kv_heads` must divide `num_heads` ({self.num_heads}): each key/value "
                             f"head serves a group of query heads; got {self.num_kv_heads}")
        check_int("ModelShape", "num_experts", self.num_experts, 0)
        check_int("ModelShape", "experts_per_token", self.experts_per_token, 1, high=max(self.num_experts, 1))
        check_int("ModelShape", "expert_intermediate", self.expert_intermediate, 1, optional=True)
        check_int("ModelShape", "shared_intermediate", self.shared_intermediate, 0)
        check_int("ModelShape", "dense_layers", self.dense_layers, 0, high=self.num_layers)

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a Hugging Face config (``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``...): a Llama-style decoder's
        `CONFIG_FIELDS` (and `OPTIONAL_CONFIG_FIELDS` where given). A config without one of them (``GPT2Config`` has
        no ``intermediate_size``) is refused, naming it: give a `ModelShape` of the model's sizes instead."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        missing = [name for name in CONFIG_FIELDS if get(name) is None]
        if missing:
            raise ValueError(f"ModelShape.from_config: the config ({type(config).__name__}) has no "
                             f"{', '.join(f'`{m}`' for m in missing)}; it reads a Llama-style decoder's config "
                             f"(LlamaConfig, Qwen2Config, MistralConfig...): {', '.join(CONFIG_FIELDS)}, and "
                             f"{', '.join(OPTIONAL_CONFIG_FIELDS)} where given; for another model, give "
                             "ModelShape(num_layers, hidden, intermediate, num_heads, num_kv_heads, vocab_size) of its "
                             "sizes")
        if get("n_routed_experts") or get("kv_lora_rank"):
            raise ValueError(f"ModelShape.from_config: {type(config).__name__} is a DeepSeek-style decoder (latent "
                             "attention, `n_routed_experts`), not a Llama-style one; give a ModelShape of its sizes, "
                             "or measure its peaks (MemoryProfiler)")
        heads, layers = get("num_attention_heads"), get("num_hidden_layers")
        experts = get("num_local_experts") or get("num_experts") or 0
        moe: dict[str, Any] = {}
        if experts:
            step, dense_only = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or ())
            sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
            moe = dict(num_experts=experts, experts_per_token=get("num_experts_per_tok") or 1,
                       expert_intermediate=get("moe_intermediate_size") or None,
                       shared_intermediate=get("shared_expert_intermediate_size") or 0, dense_layers=layers - sparse)
        return cls(num_layers=layers, hidden=get("hidden_size"),
                   intermediate=get("intermediate_size"), num_heads=heads,
                   num_kv_heads=get("num_key_value_heads") or heads, vocab_size=get("vocab_size"),
                   head_dim=get("head_dim"), tied_embeddings=bool(get("tie_word_embeddings", False)), **moe)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    def projection(self, name: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a target projection."""
        q, kv = self.num_heads * self.dim_per_head, self.num_kv_heads * self.dim_per_head
        dims = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}
        if name not in dims:
            raise ValueError(f"target module can be {', '.join(PROJECTIONS)}, got {name!r}")
        return dims[name]

    def adapter_params(self, rank: int, targets: Sequence[str] = PROJECTIONS) -> int:
        """Trainable parameters of one rank-``rank`` adapter on ``targets`` in every layer (read as `projections`
        reads them)."""
        return rank * self._params_per_rank(_canonical(targets, "ModelShape.adapter_params: `targets`"))

    @functools.lru_cache(maxsize=64)
    def _params_per_rank(self, targets: tuple[str, ...]) -> int:
        # admission asks this for every candidate set it weighs: O(sets x adapters) calls per decision
        return self.num_layers * sum(sum(self.projection(t)) for t in targets)

    @property
    def moe_layers(self) -> int:
        """The layers whose MLP is a mixture of experts."""
        return self.num_layers - self.dense_layers if self.num_experts else 0

    @property
    def base_params(self) -> int:
        h = self.hidden
        per_layer = sum(i * o for i, o in (self.projection(t) for t in PROJECTIONS[:4])) + 2 * h
        dense_mlp = 3 * h * self.intermediate
        moe_mlp = (self.num_experts * (3 * h * (self.expert_intermediate or self.intermediate) + h)  # (+ the router)
                   + (3 * h * self.shared_intermediate + h if self.shared_intermediate else 0))  # (+ its gate)
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab_size * h  # (and the output head)
        return (self.num_layers * per_layer + (self.num_layers - self.moe_layers) * dense_mlp
                + self.moe_layers * moe_mlp + embeddings + h)


@dataclass(frozen=True)
class AnalyticMemoryModel:
    """PLoRA's analytic peak: ``M_base_weights + sum_k (param + grad + optimizer) + activations``.

    Activations per token and layer follow Korthikanti et al. (the formula PLoRA's appendix sums per
    module): without checkpointing every layer keeps ``act_per_token_layer`` bytes per token; with it,
    each layer keeps its input and one layer's worth is live during recomputation. LoRA adds, per targeted
    projection and token of the batch, as many values as the widest rank there, rounded up to 16 (the kernels'
    ``S``; PLoRA's ``b * s * r`` per adapter). The loss: where it is computed over all tokens at once (the module's
    own, ``loss_chunk_tokens`` None), the model's logits (``activation_bytes``), their fp32 log-softmax, kept for the
    backward, and in the backward its gradient and the logits' fp32 one, per token and vocabulary entry (the module's
    loss peaked at 14 bytes per token and entry in bf16, its backward included); where it is computed chunk by
    chunk (`benchmarks/packed_step.py`'s, recomputed in the backward), fp32 logits of ``loss_chunk_tokens``.
    """

    shape: ModelShape
    base_bytes_per_param: float = 2.0  # bf16 base
    adapter_bytes_per_param: float = 4.0  # fp32 adapters
    optimizer_states: float = 2  # AdamW: exp_avg, exp_avg_sq (an 8-bit AdamW's two bytes against fp32: 0.5)
    activation_bytes: float = 2.0
    gradient_checkpointing: bool = True
    loss_chunk_tokens: Optional[int] = None
    base_weight_bytes: Optional[float] = None  # the base's weights as measured (`of_module`), in place of the count

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            raise ValueError(f"AnalyticMemoryModel: `shape` must be a ModelShape (ModelShape.from_config(config)), got "
                             f"{type(self.shape).__name__}")
        for name in ("base_bytes_per_param", "adapter_bytes_per_param", "activation_bytes"):
            check_real("AnalyticMemoryModel", name, getattr(self, name), lambda v: v > 0,
                       "a finite number of bytes > 0 (2 for bf16, 4 for fp32)")
        check_real("AnalyticMemoryModel", "optimizer_states", self.optimizer_states, lambda v: v >= 0,
                   "a number of states an adapter parameter's size each >= 0 (2 for AdamW; 0.5 for an 8-bit AdamW's "
                   "two one-byte states beside fp32 adapters)")
        if self.base_weight_bytes is not None:
            check_real("AnalyticMemoryModel", "base_weight_bytes", self.base_weight_bytes, lambda v: v > 0,
                       "a finite number of bytes > 0, or None (the shape's count x base_bytes_per_param)")
        check_bool("AnalyticMemoryModel", "gradient_checkpointing", self.gradient_checkpointing)
        check_int("AnalyticMemoryModel", "loss_chunk_tokens", self.loss_chunk_tokens, 1, optional=True)

    @property
    def act_per_token_layer(self) -> float:
        """Bytes a layer keeps per token for its backward (attention with a fused kernel: no s^2 term); the widest
        layer's, where a mixture of experts makes them differ (a token's routed experts and shared one)."""
        shape = self.shape
        h, i = shape.hidden, shape.intermediate
        widths = [i] if shape.moe_layers < shape.num_layers else []
        if shape.moe_layers:
            widths.append(shape.experts_per_token * (shape.expert_intermediate or i) + shape.shared_intermediate)
        return self.activation_bytes * (10 * h + 4 * max(widths))

    @property
    def act_per_token(self) -> float:
        """Bytes all layers keep per token for the backward, without checkpointing."""
        shape, h = self.shape, self.shape.hidden
        moe = shape.experts_per_token * (shape.expert_intermediate or shape.intermediate) + shape.shared_intermediate
        return self.activation_bytes * (shape.num_layers * 10 * h + 4 * (
            (shape.num_layers - shape.moe_layers) * shape.intermediate + shape.moe_layers * moe))

    @classmethod
    def of_module(cls, module: Any, **fields: Any) -> "AnalyticMemoryModel":
        """The model of a `MultiLoRAModule`'s base as it was built (or of a Hugging Face model): its shape from its
        config, its base's weights measured (their dtype, a 4-bit base's blocks and their quantization state, an 8-bit
        base's row scales, the layers it keeps wide, every expert), its gradient checkpointing, and activations in
        the dtype it computes in (a 4-bit base's ``bnb_4bit_compute_dtype``; any other's, its weights' that are not
        quantized). ``fields`` override any (``activation_bytes=2`` for a float32 base trained under
        ``precision="bf16-mixed"``; ``loss_chunk_tokens``). The defaults of `AnalyticMemoryModel` itself are a bf16
        base with checkpointing, not the module's.

        ``optimizer_states``: of a module stepping a bitsandbytes optimizer (its ``optimizer_class``), that
        optimizer's states (one for Lion, SGD, RMSprop..., two for Adam / AdamW / LAMB, three for AdEMAMix), a
        quarter each where it keeps them in 8 bits (``*8bit``, or ``optimizer_kwargs`` ``optim_bits=8``: one byte
        beside the adapters' four; bitsandbytes keeps a tensor under its ``min_8bit_size``, 4096 elements, in 32
        bits, which this does not count). Of a torch optimizer, the states one step of it keeps with the module's
        ``optimizer_kwargs`` (AdamW's two, three with ``amsgrad``; SGD's none, one with momentum). Of a Hugging Face
        model, or an optimizer that cannot be stepped alone, AdamW's two: pass ``optimizer_states`` for another."""
        import torch

        model = getattr(getattr(module, "lora_layers", None), "model", None)  # (a module's base; a Hugging Face
        if model is None:  # model's own `model` is its decoder alone, without the output head)
            model = module if hasattr(module, "config") else getattr(module, "model", module)
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"AnalyticMemoryModel.of_module: {type(module).__name__} has no Hugging Face `config` "
                             "(a MultiLoRAModule, or its `model`); build AnalyticMemoryModel(ModelShape(...)) instead")
        if getattr(module, "lora_layers", None) is not None:  # a module's base: its frozen tensors (not adapters')
            kept = [t for t in (*model.parameters(), *model.buffers()) if not t.requires_grad]
        else:  # a Hugging Face model as loaded trains every parameter: all of them but a PEFT model's adapters
            kept = [t for name, t in (*model.named_parameters(), *model.named_buffers()) if "lora_" not in name]
        frozen = {id(t): t for t in kept}.values()  # (tied weights once)
        quant = getattr(config, "quantization_config", None)
        setting = quant.get if isinstance(quant, Mapping) else lambda key: getattr(quant, key, None)
        # (a 4-bit base computes in its compute dtype; an 8-bit one's config holds the 4-bit default, float32, too)
        compute = setting("bnb_4bit_compute_dtype") if quant is not None and setting("load_in_4bit") else None
        if isinstance(compute, str):
            compute = getattr(torch, compute.removeprefix("torch."), None)
        floats = [t.dtype for t in frozen if t.is_floating_point() and isinstance(t, torch.nn.Parameter)] or [
            t.dtype for t in frozen if t.is_floating_point()]  # (the weights' dtype, not a float32 buffer's)
        dtype = compute if isinstance(compute, torch.dtype) else max(set(floats), key=floats.count, default=None)
        held = sum(t.numel() * t.element_size() for t in frozen) + sum(
            t.numel() * t.element_size() for t in _quantization_tensors(model, frozen))
        values: dict[str, Any] = dict(shape=ModelShape.from_config(config), base_weight_bytes=float(held),
                                      gradient_checkpointing=_checkpointing(model))
        if dtype is not None:
            values["activation_bytes"] = float(torch.finfo(dtype).bits // 8)
        states = _optimizer_states(getattr(module, "optimizer_class", None), getattr(module, "optimizer_kwargs", None),
                                   fields.get("adapter_bytes_per_param", cls.adapter_bytes_per_param))
        if states is not None:
            values["optimizer_states"] = states
        return cls(**{**values, **fields})

    def base_bytes(self) -> float:
        if self.base_weight_bytes is not None:
            return self.base_weight_bytes
        return self.shape.base_params * self.base_bytes_per_param

    def adapter_bytes(self, rank: int, targets: Sequence[str] = PROJECTIONS) -> float:
        """Parameters, gradients and optimizer states of one adapter, and the GPU kernels' copy of its weights in
        the activation dtype (made when that is narrower than the adapters')."""
        check_int("AnalyticMemoryModel.adapter_bytes", "rank", rank, 1)
        targets = _canonical(targets, "AnalyticMemoryModel.adapter_bytes: `targets`")
        copy = self.activation_bytes if self.activation_bytes < self.adapter_bytes_per_param else 0.0
        per_param = self.adapter_bytes_per_param * (2 + self.optimizer_states) + copy
        return self.shape.adapter_params(rank, targets) * per_param

    def activations(self, tokens: int, lora_rank_tokens: float = 0.0) -> float:
        """Activation bytes of a step over ``tokens`` tokens; ``lora_rank_tokens``: the elements of the low-rank
        intermediates ``S`` one layer keeps for backward (`predict` counts them as the GPU kernels make them)."""
        h = self.shape.hidden
        layers = self.shape.num_layers
        if self.gradient_checkpointing:
            per_token = layers * h * self.activation_bytes + self.act_per_token_layer
        else:
            per_token = self.act_per_token
        # every layer's S stays until backward, with checkpointing too (`kernels.recompute` keeps it for the
        # recomputation)
        lora = lora_rank_tokens * 4.0 * layers
        if self.loss_chunk_tokens is None:
            logits = tokens * self.shape.vocab_size * (self.activation_bytes + 3 * 4.0)
        else:
            logits = min(tokens, self.loss_chunk_tokens) * self.shape.vocab_size * 4.0
        return tokens * per_token + lora + logits

    def predict(self, adapters: Sequence[tuple[int, int, Sequence[str]]], seq_len: int) -> float:
        """Peak bytes for adapters given as ``(rank, batch_size, targets)`` at ``seq_len`` tokens per row (a rank
        >= 1; a batch >= 0: 0 is a paused adapter's, `PausedSpec`, whose weights and optimizer state count and whose
        rows, and rank in the kernels' intermediates, do not; a negative one made a peak below the base's)."""
        check_int("AnalyticMemoryModel.predict", "seq_len", seq_len, 1)
        for i, adapter in enumerate(adapters):
            if not (isinstance(adapter, (tuple, list)) and len(adapter) == 3):
                raise ValueError(f"AnalyticMemoryModel.predict: adapter #{i} must be (rank, batch_size, targets), got "
                                 f"{adapter!r}")
            check_int(f"AnalyticMemoryModel.predict: adapter #{i}", "rank", adapter[0], 1)
            check_int(f"AnalyticMemoryModel.predict: adapter #{i}", "batch_size", adapter[1], 0)
        # (read as the module reads them: one string, "all-linear" say, was taken letter by letter, a list's
        # "self_attn.q_proj" refused and a name given twice counted twice)
        adapters = [(r, b, _canonical(t, f"AnalyticMemoryModel.predict: adapter #{i}'s targets"))
                    for i, (r, b, t) in enumerate(adapters)]
        tokens = sum(b for _, b, _ in adapters) * seq_len
        widest: dict[str, int] = {}
        for rank, rows, targets in adapters:
            for target in targets if rows else ():  # (an adapter without rows has no S in the kernels)
                widest[target] = max(widest.get(target, 0), rank)
        # The kernels keep one S a targeted projection and layer: a row for every token of the batch (any adapter's),
        # as wide as the projection's widest rank rounded up to 16 (PLoRA counts rank x tokens for each adapter: at
        # ranks 8..128 that was half of it, at r=2 an eighth)
        lora_tokens = tokens * sum(16 * -(-rank // 16) for rank in widest.values())
        return (self.base_bytes() + sum(self.adapter_bytes(r, t) for r, _, t in adapters)
                + self.activations(tokens, lora_tokens))

    def of_specs(self, seq_len: int, targets: Sequence[str] | str = "all-linear") -> Callable[
            [Sequence[AdapterSpec]], float]:
        """`predict` as a function of `AdapterSpec`s (what `AdmissionController` and `fit_predictor`'s ``beyond``
        take): each spec's rank, ``rows_per_step`` and ``target_modules`` (among ``targets``, as the module's
        adapters choose among its own: counted alone, an adapter's "all-linear" beside a module's q and v projections
        came to 4.6 times the parameters it trains), ``targets`` where it names none. Targets are read as the module
        reads them (`projections`): names, ``"all-linear"`` or a regex."""
        check_int("AnalyticMemoryModel.of_specs", "seq_len", seq_len, 1)
        default = projections(targets, "`targets`")

        def own(spec: AdapterSpec) -> list[str]:
            chosen = projections(spec.target_modules, f"adapter {spec.name!r}'s `target_modules`")
            return [t for t in chosen if t in default] or chosen

        def predict(specs: Sequence[AdapterSpec]) -> float:
            return self.predict([(s.rank, s.rows_per_step, own(s) if s.target_modules else default) for s in specs],
                                seq_len)

        predict.analytic = self  # type: ignore[attr-defined]  # (the module checks it against its base: `_admit`)
        return predict


def _quantization_tensors(model: Any, counted: Any) -> list[Any]:
    """The tensors a bitsandbytes base holds beside its parameters and buffers (``counted``): a 4-bit weight's
    quantization state (``quant_state``: its blocks' ``absmax``, its ``code`` and, double-quantized, the nested state's
    own ``absmax`` and ``code`` and its ``offset``), and an 8-bit weight's row scales (``SCB``, on the weight or, after
    the layer's first forward, on its ``state``): each once."""
    import torch

    seen = {id(t) for t in counted}
    found: list[Any] = []

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)

    def add_state(state: Any, depth: int = 0) -> None:
        if state is None or depth > 2 or not hasattr(state, "__dict__"):
            return
        for value in vars(state).values():
            add(value)
        add_state(getattr(state, "state2", None), depth + 1)

    for tensor in counted:
        add_state(getattr(tensor, "quant_state", None))
        add(getattr(tensor, "SCB", None))
    for layer in model.modules():
        add(getattr(getattr(layer, "state", None), "SCB", None))  # (bitsandbytes' `MatmulLtState`)
    return found


def _optimizer_states(optimizer_class: Any, kwargs: Any, adapter_bytes: float) -> Optional[float]:
    """A bitsandbytes optimizer class's states, in adapter parameters' sizes (``adapter_bytes`` each): one state
    (`Optimizer1State`: Lion, SGD, RMSprop, Adagrad, LARS), two (`Optimizer2State`: Adam, AdamW, LAMB) or three
    (AdEMAMix: two first moments), each of one byte where it keeps them in 8 bits (a ``*8bit`` class, or
    ``optim_bits=8`` among ``kwargs``), else of four. Of another `torch.optim.Optimizer`, what one step of it keeps
    (`_probed_states`). None where that cannot be told (AdamW's default stands)."""
    if not isinstance(optimizer_class, type):
        return None
    names = [klass.__name__ for klass in optimizer_class.__mro__ if klass.__module__.split(".")[0] == "bitsandbytes"]
    if "Optimizer1State" in names:
        count = 1
    elif "Optimizer2State" in names:
        count = 3 if "AdEMAMix" in names else 2  # (its first state a double buffer; AdEMAMix32bit allocates two)
    else:
        return _probed_states(optimizer_class, kwargs, adapter_bytes)
    if isinstance(adapter_bytes, bool) or not isinstance(adapter_bytes, (int, float)) or not adapter_bytes > 0:
        return None  # (a wrong `adapter_bytes_per_param`: refused by the model's own checks)
    eight = optimizer_class.__name__.endswith("8bit") or (isinstance(kwargs, Mapping) and kwargs.get("optim_bits") == 8)
    return count * (1.0 if eight else 4.0) / adapter_bytes


def _checkpointing(model: Any) -> bool:
    """Whether a Hugging Face model recomputes its activations (transformers 5.25's name for it, or the earlier one)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


# the full module names a target is matched against: a Llama-style model's 128 first layers (a regex may name some)
_LAYER_NAMES = {p: tuple(f"model.layers.{i}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}" for i in range(128))
                for p in PROJECTIONS}


@functools.lru_cache(maxsize=256)
def _matched(targets: str | tuple[str, ...]) -> tuple[str, ...]:
    """The projections ``targets`` matches in some layer, by the module's own rule (`layer._matches`: PEFT's). Cached:
    admission asks for every candidate set it weighs."""
    from lightning_multilora.layer import _matches

    if isinstance(targets, tuple) and "all-linear" in targets:  # (an AdapterSpec's list may hold it)
        return PROJECTIONS
    return tuple(p for p in PROJECTIONS if any(_matches(n, targets) for n in _LAYER_NAMES[p]))


def projections(targets: Sequence[str] | str, what: str = "`targets`") -> tuple[str, ...]:
    """The projections of a Llama-style layer that ``targets`` names, as the module and PEFT read it: a list of
    names (or their last parts, ``self_attn.q_proj``), ``"all-linear"`` (all seven), or a regex matched against the
    layers' full module names (``model.layers.0.self_attn.q_proj``; a projection it matches in any layer counts in
    all)."""
    import re

    targets = peft_targets(targets)
    key = targets if isinstance(targets, str) else tuple(targets)
    try:
        found = _matched(key) if key else ()
        if isinstance(key, str) and not found:  # (one name, as an AdapterSpec reads a string without a regex's signs)
            found = _matched((key,))
    except re.error as err:
        raise ValueError(f"{what} {targets!r} is no projection name, 'all-linear' or regex ({err})") from None
    if isinstance(key, tuple):
        unknown = [t for t in key if not _matched((t,))]
        if unknown or not key:
            raise ValueError(f"{what}: a target module can be {', '.join(PROJECTIONS)} (or 'all-linear'), got "
                             f"{unknown or list(key)}")
    elif not found:
        raise ValueError(f"{what} {targets!r} matches no projection of a Llama-style layer: give some of "
                         f"{', '.join(PROJECTIONS)}, 'all-linear', or a regex matching e.g. "
                         f"{_LAYER_NAMES['q_proj'][0]!r}")
    return found


def _probed_states(optimizer_class: type, kwargs: Any, adapter_bytes: float) -> Optional[float]:
    """The states a `torch.optim.Optimizer` class keeps per parameter, in adapter parameters' sizes: counted after one
    step of it, with ``kwargs``, on a float32 probe parameter (AdamW's two, three with ``amsgrad``; SGD's none, one
    with momentum; RMSprop's one to three). None where the class is no torch optimizer or the step fails."""
    import torch

    if not issubclass(optimizer_class, torch.optim.Optimizer) or not (
            isinstance(adapter_bytes, (int, float)) and not isinstance(adapter_bytes, bool) and adapter_bytes > 0):
        return None
    probe = torch.nn.Parameter(torch.zeros(64))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = optimizer_class([probe], **{"lr": 1e-3, **(kwargs if isinstance(kwargs, Mapping) else {})})
            probe.grad = torch.zeros_like(probe)
            optimizer.step()
    except Exception:  # noqa: BLE001 - (one that needs more than a parameter list: the default stands)
        return None
    state = optimizer.state.get(probe, {})
    held = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.numel() == 64)
    return held / 64 / adapter_bytes


def _canonical(targets: Any, what: str) -> tuple[str, ...]:
    """``targets`` as the projections they name (`projections`), at once where they are those names already (the
    admission asks for every candidate set it weighs); None or another type refused, naming ``what``."""
    if isinstance(targets, (list, tuple)) and all(t in PROJECTIONS for t in targets) and len(
            set(targets)) == len(targets) and targets:
        return tuple(targets)
    if not isinstance(targets, (str, list, tuple)):
        raise ValueError(f"{what} can be a list of {', '.join(PROJECTIONS)}, 'all-linear' or a regex, got "
                         f"{targets!r}")
    return projections(targets, what)


@dataclass(frozen=True)
class MemoryPoint:
    """One measured step: ``n_adapters`` adapters at ``batch_size`` rows each, ``seq_len`` tokens a row,
    ``adapter_params`` trainable parameters in all, ``peak_bytes`` the step's peak."""

    n_adapters: int
    batch_size: int
    seq_len: int
    adapter_params: int
    peak_bytes: float

    @property
    def tokens(self) -> int:
        return self.n_adapters * self.batch_size * self.seq_len


@dataclass
class MemoryFit:
    """``M(tokens, params) = k0 + k1 * tokens + k2 * params`` (tokens = B * L), least squares on points.

    The squares are of *relative* errors (each point weighted by ``1 / peak``): the goal is a relative
    error, and the measured peaks span several times each other, so plain least squares would spend the
    fit on the largest points and miss the small ones (H200 grids of `benchmarks/memory_model.py`: worst
    held-back error 8.7% -> 6.7% on one, 122 adapters extrapolated at 11.7% -> 8.5% on another).
    """

    k0: float
    k1: float
    k2: float
    signature: dict[str, Any] = field(default_factory=dict)
    points: list[MemoryPoint] = field(default_factory=list)

    @classmethod
    def fit(cls, points: Sequence[MemoryPoint], signature: Optional[Mapping[str, Any]] = None) -> "MemoryFit":
        import numpy as np

        if len(points) < 3:
            raise ValueError(f"fitting M = k0 + k1*B*L + k2*P needs >= 3 measured points, got {len(points)}")
        bad = [p for p in points if not 0 < p.peak_bytes < float("inf")]  # (NaN too: LinAlgError otherwise)
        if bad:
            raise ValueError(f"measured peaks must be finite positive byte counts, got peak_bytes="
                             f"{bad[0].peak_bytes!r} at n_adapters={bad[0].n_adapters}, batch_size={bad[0].batch_size}")
        w = np.array([1.0 / p.peak_bytes for p in points])
        x = np.array([[1.0, p.tokens, p.adapter_params] for p in points]) * w[:, None]
        y = np.array([p.peak_bytes for p in points]) * w
        if np.linalg.matrix_rank(x) < 3:
            tokens = np.array([p.tokens for p in points], dtype=float)
            params = np.array([p.adapter_params for p in points], dtype=float)
            if np.ptp(tokens) == 0:
                raise ValueError(f"fitting M = k0 + k1*B*L + k2*P needs points of different tokens (B*L): all "
                                 f"{len(points)} have {int(tokens[0])} (profile other batch sizes)")
            if np.ptp(params) == 0:
                warnings.warn(f"every memory point has the same adapter parameters (P = {int(params[0])}): the fit is "
                              "ALTO's k0 + k1*B*L, for that adapter set; it costs other adapters' parameters nothing "
                              "(profile different numbers of adapters to measure k2)")
            else:  # (adapters of batch 1 profiled 1, 2, 4 at a time: the parameters grow with the tokens)
                warnings.warn("every memory point's adapter parameters follow its tokens (B*L) on one line, so the "
                              "fit cannot tell their costs apart: it is ALTO's k0 + k1*B*L, its k1 counting the "
                              "parameters' bytes per token too, which misjudges adapter sets of other batch sizes or "
                              "ranks (profile batch sizes apart from adapter counts to measure k2)")
            # every point has the same tokens-to-parameters ratio: fall back to ALTO's k0 + k1*B*L
            k01, *_ = np.linalg.lstsq(x[:, :2], y, rcond=None)
            k = (k01[0], k01[1], 0.0)
        else:
            k, *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(float(k[0]), float(k[1]), float(k[2]), dict(signature or {}), list(points))

    def predict(self, tokens: float, adapter_params: float) -> float:
        return self.k0 + self.k1 * tokens + self.k2 * adapter_params

    def relative_errors(self, points: Sequence[MemoryPoint]) -> list[float]:
        return [abs(self.predict(p.tokens, p.adapter_params) - p.peak_bytes) / p.peak_bytes for p in points]

    def to_dict(self) -> dict[str, Any]:
        return dict(k0=self.k0, k1=self.k1, k2=self.k2, signature=self.signature,
                    points=[asdict(p) for p in self.points])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MemoryFit":
        return cls(data["k0"], data["k1"], data["k2"], dict(data.get("signature", {})),
                   [MemoryPoint(**p) for p in data.get("points", [])])


def signature_key(signature: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()[:16]


class MemoryFitCache:
    """Fits on disk, one JSON file per signature (model, dtype, sequence length, ranks, targets,
    checkpointing, GPU name...)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path(self, signature: Mapping[str, Any]) -> Path:
        return self.directory / f"memory_fit_{signature_key(signature)}.json"

    def load(self, signature: Mapping[str, Any]) -> Optional[MemoryFit]:
        """The fit for exactly this signature, or None (logged) when there is none or it was made for
        something else (another GPU or model): the caller then profiles again."""
        path = self.path(signature)
        if not path.exists():
            log.info("no memory profile for %s: profiling", dict(signature))
            return None
        try:
            fit = MemoryFit.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as err:  # (a file cut short by a killed run, say)
            log.warning("memory profile %s does not read (%s: %s): profiling again", path, type(err).__name__, err)
            return None
        if fit.signature != json.loads(json.dumps(dict(signature), default=str)):
            log.warning("memory profile %s was made for %s, not %s: profiling again", path, fit.signature,
                        dict(signature))
            return None
        return fit

    def save(self, fit: MemoryFit) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(fit.signature)
        fit.signature = json.loads(json.dumps(fit.signature, default=str))
        partial = path.with_name(path.name + ".partial")  # (renamed whole into place: never read half written)
        partial.write_text(json.dumps(fit.to_dict(), indent=1))
        partial.replace(path)
        return path
