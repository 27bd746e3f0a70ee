"""Loading the frozen base: a Hugging Face checkpoint by path, or a model built from a config."""

from __future__ import annotations

import functools
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_multilora.arguments import missing_local_folder

# The byte tokenizer's ends (`data.ByteTokenizer`: <eos> 257, no <bos>): a tiny base's `generate` stops where the
# adapters learned to (Llama's defaults, eos 2 and bos 1, are bytes; Qwen2's has none). Its pad is left unset: a
# config's pad_token_id is the embedding's padding_idx, a zeroed row, which would change a seed's weights.
_BYTE_ENDS = dict(eos_token_id=257, bos_token_id=None)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Built from a config, no download: the demo's and the tests' base. vocab 258 = the byte tokenizer.
    # initializer_range 0.1 (not 0.02): with a frozen random lm_head, 0.02 keeps every logit near 0, so
    # no adapter could move the output distribution far from uniform.
    "tiny-llama": dict(model_type="llama", vocab_size=258, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1, **_BYTE_ENDS),
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=258, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1, **_BYTE_ENDS),
    "tiny-mistral": dict(model_type="mistral", vocab_size=258, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
                         sliding_window=None, **_BYTE_ENDS),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: Any) -> torch.dtype:
    """A base's dtype by name (``"bfloat16"``), or the torch dtype itself (``torch.bfloat16``, as Hugging Face takes
    it)."""
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if name not in DTYPES:
        raise ValueError(f"`dtype` can be {', '.join(DTYPES)} (or the torch dtype), got {name!r}")
    return DTYPES[name]


QUANTIZATIONS = ("nf4", "fp4")


def quantization_config(quantization: Any, compute_dtype: torch.dtype) -> Any:
    """QLoRA's 4-bit base: a `BitsAndBytesConfig` (``nf4`` or ``fp4`` weights, ``compute_dtype`` matmuls); or one
    given whole, as a `BitsAndBytesConfig` or its settings (`to_dict`'s, as an export records a quantized base given to
    the module: double quantization, 8-bit, its own compute dtype), used as they say."""
    from transformers import BitsAndBytesConfig

    if isinstance(quantization, (BitsAndBytesConfig, Mapping)):
        settings = quantization.to_dict() if isinstance(quantization, BitsAndBytesConfig) else dict(quantization)
        if not (settings.get("load_in_4bit") is True or settings.get("load_in_8bit") is True):
            raise ValueError("`quantization` given as bitsandbytes settings must load the base in 4 or 8 bits "
                             f"(`load_in_4bit` or `load_in_8bit` true), got {settings!r}")
        return BitsAndBytesConfig.from_dict({k: v for k, v in settings.items() if k != "quant_method"})
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"`quantization` can be {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization,
                              bnb_4bit_compute_dtype=compute_dtype)


def _without_cpu_repacking(model: nn.Module) -> nn.Module:
    """``model``'s bitsandbytes 4-bit layers kept in their own layout on the CPU. On a CPU with AVX512-BF16,
    bitsandbytes 0.50 repacks a layer's weights in place at its first forward without gradients (a validation,
    `generate`): every backward after it read them wrongly (input gradients 0.997 off, relative; adapters trained
    with validations ended up to 98% from those trained without), and a checkpoint's ``state_dict`` unpacked them
    lossily (the base drifted). CUDA never takes that path."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


_SAID_4BIT_ON_CPU: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # (the bases warned of: once each)


def four_bit_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s bitsandbytes 4-bit linear layers (``Linear4bit``: nf4 / fp4); none where bitsandbytes
    was never imported (no layer of it can then exist)."""
    bnb = sys.modules.get("bitsandbytes")
    linear4bit = getattr(getattr(bnb, "nn", None), "Linear4bit", None)
    if not isinstance(linear4bit, type):
        return []
    return [name for name, module in model.named_modules() if isinstance(module, linear4bit)]


def guard_4bit_base(model: nn.Module, stacklevel: int = 2) -> nn.Module:
    """A base holding bitsandbytes 4-bit layers, however it came (quantized by `build_base_model`, a pre-quantized
    checkpoint folder such as the Hub's ``*-bnb-4bit`` models, or a 4-bit model given as a module), made safe to
    train on: its layers never repacked for the CPU (`_without_cpu_repacking`), and, without CUDA, a warning that a
    4-bit base on the CPU runs slowly (once per base). A base whose layers were repacked before it came here (run
    without gradients in eval mode on a CPU with AVX512-BF16: a ``generate`` or an evaluation) is refused: its
    backward reads them wrongly (input gradients about 100% off) and the repacking cannot be undone exactly (its
    scales were rounded to bf16). Any other model is returned as it is."""
    layers = four_bit_layers(model)
    if not layers:
        return model
    modules = dict(model.named_modules())
    packed = [name for name in layers if getattr(getattr(getattr(modules[name], "weight", None), "quant_state", None),
                                                  "packing_format_for_cpu", False)]
    if packed:
        more = f" and {len(packed) - 1} more" if len(packed) > 1 else ""
        raise ValueError(f"the base's 4-bit layers ({packed[0]!r}{more}) were repacked by bitsandbytes for the "
                         "CPU's AVX512-BF16 kernels, as it does at a forward without gradients in eval mode (a "
                         "`generate`, an evaluation) before the base came here: its backward reads them wrongly, and "
                         "the repacking cannot be undone exactly; load the base again and give it before running it "
                         "without gradients (the module keeps it from being repacked from then on)")
    _without_cpu_repacking(model)
    if not torch.cuda.is_available() and model not in _SAID_4BIT_ON_CPU:
        import warnings

        _SAID_4BIT_ON_CPU.add(model)
        warnings.warn("a 4-bit base on the CPU: it runs, slowly; QLoRA is meant for CUDA GPUs",
                      stacklevel=stacklevel + 1)
    return model


def build_base_model(
    base_model: Union[str, os.PathLike],
    config_overrides: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
    seed: int = 0,
    quantization: Optional[Union[str, Mapping[str, Any], Any]] = None,
) -> nn.Module:
    """A causal LM: ``"tiny-llama"`` / ``"tiny-qwen2"`` / ``"tiny-mistral"`` (random weights from ``seed``,
    built from a config), or a local Hugging Face checkpoint directory / hub name via ``from_pretrained``.
    ``config_overrides`` changes fields of the built-in configs (or of the checkpoint's config). ``quantization``
    (``nf4`` / ``fp4``): the decoder's linears become bitsandbytes 4-bit layers computing in ``dtype`` (QLoRA), or a
    `BitsAndBytesConfig` (or its settings) used as it is; a built-in model is written to a temporary checkpoint and
    loaded back quantized, the same path a real checkpoint takes; a pre-quantized checkpoint (``*-bnb-4bit``) loads
    4-bit without it. A 4-bit base is kept from bitsandbytes' CPU repacking (`guard_4bit_base`). A checkpoint that is no
    causal LM (an encoder-decoder, or an encoder loaded as one with bidirectional attention) is refused
    (`check_causal_lm`). ``dtype`` None: float32 (a pre-quantized checkpoint's, the dtype it was saved in)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base_model = _checked_form(base_model)
    torch_dtype = resolve_dtype("float32" if dtype is None else dtype)
    _refuse_near_miss(base_model)
    if quantization is not None:
        config = quantization_config(quantization, torch_dtype)  # (a bad value refused before anything is loaded)
        if base_model in TINY_CONFIGS:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                build_base_model(base_model, config_overrides, dtype, seed).save_pretrained(tmp)
                model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=config, dtype=torch_dtype)
            model.config.name_or_path = base_model
            _remember_build(model, base_model, config_overrides, seed)
        else:
            model = _from_pretrained(base_model, config_overrides, quantization_config=config, dtype=torch_dtype)
        return guard_4bit_base(model)
    if base_model in TINY_CONFIGS:
        kwargs = dict(TINY_CONFIGS[base_model])
        kwargs.update(config_overrides or {})
        with _naming_overrides(config_overrides):
            config = AutoConfig.for_model(**kwargs)
        _refuse_unknown_fields(config, config_overrides or {})
        with _naming_overrides(config_overrides), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        _check_runs(model, config_overrides)
        model.config.name_or_path = base_model
        _remember_build(model, base_model, config_overrides, seed)
        return model.to(torch_dtype)
    # (a pre-quantized checkpoint, a `*-bnb-4bit` folder, loads 4-bit layers without `quantization`)
    model = guard_4bit_base(_from_pretrained(base_model, config_overrides, dtype=torch_dtype))
    held = held_dtype(model)
    # (transformers keeps a quantized checkpoint's own dtype whatever `dtype` says: said where one was asked)
    if four_bit_layers(model) and dtype is not None and held is not None and held != torch_dtype:
        import warnings

        name = str(held).removeprefix("torch.")
        warnings.warn(f"`dtype` {dtype!r} is not applied to the pre-quantized checkpoint {base_model!r}: transformers "
                      f"keeps its weights in the {name} they were saved in, and the base runs in {name} (give "
                      f"dtype={name!r} to say so)", stacklevel=2)
    return model


def _remember_build(model: nn.Module, name: str, config_overrides: Optional[dict[str, Any]], seed: int) -> None:
    """A built-in base remembers its seed and the overrides that changed its config (``model._multilora_build``): a
    module given it exports them, as one that builds it does (its name alone rebuilds seed 0's weights)."""
    model._multilora_build = {"config_overrides": changed_overrides(name, config_overrides), "base_seed": seed}


def held_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype ``model`` holds its floating-point weights in (its first's: the embeddings of a base whose linears
    are quantized, bitsandbytes' integer weights); None for a model without any."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def changed_overrides(base_model: str, config_overrides: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The entries of ``config_overrides`` that change the config of ``base_model`` (a built-in name or a local
    checkpoint's): one restating a value the config holds changes nothing (10000.0 restates 10000). As given: the
    export records them, to rebuild the base (an integral float made an int is refused by a float field). A base
    whose config cannot be read here (a Hub name) keeps them all."""
    from transformers import AutoConfig

    overrides = dict(config_overrides or {})
    try:
        if base_model in TINY_CONFIGS:
            config = AutoConfig.for_model(**TINY_CONFIGS[base_model]).to_dict()
        elif os.path.isfile(os.path.join(base_model, "config.json")):
            config = AutoConfig.from_pretrained(base_model).to_dict()
        else:
            return overrides
    except (OSError, ValueError):
        return overrides
    return {k: v for k, v in overrides.items() if k not in config or config[k] != v}


def _checked_form(base_model: Any) -> str:
    """``base_model`` as a str: a path object becomes its str; anything else is refused here, naming the forms taken
    (a config object failed deep inside, as an unhashable key, and named neither)."""
    if isinstance(base_model, os.PathLike):
        base_model = os.fspath(base_model)
    if isinstance(base_model, str):  # (a YAML's "~/llama" was taken for a Hub name, and refused as one)
        return os.path.expanduser(base_model) if base_model.startswith("~") else base_model
    from transformers import PretrainedConfig

    how = (": build its model (`AutoModelForCausalLM.from_config(config)`) and give that, or save it with the "
           "model (`save_pretrained`) and give the directory" if isinstance(base_model, PretrainedConfig) else "")
    raise ValueError(f"`base_model` can be a built-in model's name ({', '.join(TINY_CONFIGS)}), a checkpoint directory "
                     f"or Hugging Face Hub name (a str or a path), or (to MultiLoRAModule) a model already built, an "
                     f"nn.Module; got an object of type {type(base_model).__name__}{how}")


def _from_pretrained(base_model: str, config_overrides: Optional[dict[str, Any]], **load: Any) -> nn.Module:
    """``from_pretrained`` of a local checkpoint directory or a hub name; with ``config_overrides`` and a checkpoint
    there, an error they cause names them and the model must run (`_check_runs`). A local checkpoint that is no
    causal LM is refused from its config, before its weights load (`_checkpoint_config`); a model that loads is
    checked as a module given is (`check_causal_lm`: an encoder loaded as a causal LM, which attends both ways)."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(config_overrides or {})
    if not os.path.isfile(os.path.join(base_model, "config.json")):
        _hub_config(base_model)
        try:
            model = AutoModelForCausalLM.from_pretrained(base_model, **load, **kwargs)
        except (OSError, ValueError) as err:  # (no checkpoint there; the Hub has no such model or cannot be reached)
            kind = OSError if isinstance(err, OSError) else ValueError
            raise kind(f"`base_model` {base_model!r} is no built-in model ({', '.join(TINY_CONFIGS)}), no local "
                       f"checkpoint directory, and could not be loaded from the Hugging Face Hub: {err}") from err
    else:  # (a checkpoint there: with overrides, what they cause names them)
        from safetensors import SafetensorError

        _checkpoint_config(base_model)
        config = {"config": _overridden_config(base_model, kwargs)} if kwargs else {}
        try:
            with _naming_overrides(config_overrides):
                model = AutoModelForCausalLM.from_pretrained(base_model, **config, **load)
        # (its weights missing or unreadable, a file cut short: the directory is no wrong name, nor the overrides')
        except (OSError, SafetensorError) + (() if kwargs else (ValueError,)) as err:
            kind = ValueError if isinstance(err, ValueError) else OSError
            raise kind(f"`base_model` {base_model!r} is a checkpoint directory (its config.json read) whose model "
                       f"could not be loaded: {err}") from err
        _check_runs(model, config_overrides)
    check_causal_lm(model, overridable=True)
    if os.path.isfile(os.path.join(base_model, "config.json")):  # (a checkpoint folder named from anywhere: its
        # exports' `base_model_name_or_path`; a relative path was loaded by PEFT from elsewhere as a Hub name)
        model.config.name_or_path = os.path.abspath(base_model)
    return model


def _checkpoint_config(path: str) -> Any:
    """The config of the checkpoint directory at ``path``, refused where it describes no causal LM: an encoder-decoder
    (T5, BART: its decoder predicts from an encoder's output, which a causal-LM loss over one token sequence never
    gives it; ``AutoModelForCausalLM`` loads BART's decoder alone, silently), or a model type with no causal-LM class
    (an image or audio encoder). The loader's own error for those was reported as "no local checkpoint directory"."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        kind = OSError if isinstance(err, OSError) else ValueError
        raise kind(f"`base_model` {path!r} is a checkpoint directory whose config.json transformers cannot read: "
                   f"{err}") from err
    return _refuse_config(path, config, "a checkpoint")


def _hub_config(name: str) -> None:
    """A Hub model's config, refused as a local checkpoint's is (`_checkpoint_config`) where it can be read: loaded
    by name, an encoder-decoder such as BART gave its decoder alone, silently. One it cannot read (no such model,
    no network) is left to the loading, whose error says so."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except Exception:  # noqa: BLE001 - (the loading that follows reports it)
        return
    _refuse_config(name, config, "a Hub model")


def _refuse_config(path: str, config: Any, kind: str) -> Any:
    """``config`` (of ``kind``, "a checkpoint" or "a Hub model", at ``path``), refused where it is no causal LM's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    what = f"a {config.model_type} model ({', '.join(getattr(config, 'architectures', None) or ['no architectures'])})"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"`base_model` {path!r} is {kind} of {what}, an encoder-decoder: its decoder predicts "
                         f"from an encoder's output, which a causal-LM loss over one token sequence does not give it; "
                         f"the base must be a decoder-only causal language model (Llama, Qwen2, Mistral, GPT-2...)")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and "AutoModelForCausalLM" not in (
            getattr(config, "auto_map", None) or {}):  # (a remote-code model names its own class there)
        raise ValueError(f"`base_model` {path!r} is {kind} of {what}, which is no causal language model: "
                         f"transformers has no causal-LM class for a {config.model_type} config")
    return config


_NOT_LM_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                 "ForMultipleChoice", "ForNextSentencePrediction")


def check_causal_lm(model: nn.Module, field: str = "base_model", overridable: bool = False) -> None:
    """A Hugging Face model is refused unless it is a causal language model: the adapters train on its logits with a
    next-token loss, which an encoder's attention (each position sees the token it is asked to predict) makes
    meaningless, silently, and which an encoder-decoder, a bare backbone or a classification head cannot give (an
    unrelated error later, about a batch size). Refused: ``config.is_encoder_decoder``; a head class other than a
    language model's (``*ForMaskedLM``, ``*ForSequenceClassification``...); a backbone without a head (a ``*Model``
    that is its own base model, with no output embeddings); and a causal-LM class of the BERT family built with
    ``is_decoder=False``, told by transformers' own signals: attention modules whose ``is_causal`` flag (which its
    attention functions read) is False in every one, or a class whose ``__init__`` holds transformers' check ``if not
    config.is_decoder`` (RemBERT, RoFormer, BigBird and Megatron-BERT set no such flag). A module that is not a
    transformers model passes: any torch model can host the adapters. ``field`` names the argument in the error;
    ``overridable``: the model was loaded with ``config_overrides`` at hand, which is then the fix named."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover (transformers is a dependency)
        return
    if not isinstance(model, PreTrainedModel):
        return
    config = model.config
    name = type(model).__name__
    what = f"a {name} (model_type {getattr(config, 'model_type', None)!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"`{field}` is {what}, an encoder-decoder: its decoder predicts from an encoder's output, "
                         f"which a causal-LM loss over one token sequence does not give it; the base must be a "
                         f"decoder-only causal language model (Llama, Qwen2, Mistral, GPT-2...)")
    head = next((suffix for suffix in _NOT_LM_HEADS if name.endswith(suffix)), None)
    if head is not None:
        raise ValueError(f"`{field}` is {what}, a model with a {head[3:]} head: the adapters train on a causal "
                         f"language model's next-token logits; build it with AutoModelForCausalLM (an encoder such as "
                         f"BERT also with `is_decoder=True`)")
    if (name.endswith("Model") and not name.endswith("LMHeadModel") and model.base_model is model
            and model.get_output_embeddings() is None  # (a backbone is its own base model: LlamaModel, BertModel)
            and not isinstance(getattr(model, "lm_head", None), nn.Module)):
        raise ValueError(f"`{field}` is {what}, a backbone without a language-model head (no logits to train on): "
                         f"build it with AutoModelForCausalLM")
    flags = [module.is_causal for module in model.modules() if isinstance(getattr(module, "is_causal", None), bool)]
    # (`is_causal` False everywhere, where the config does not say it decodes: a model that builds its causal mask
    # itself, BigBirdPegasus's decoder, sets no flag)
    decoder = getattr(config, "is_decoder", None)
    if (flags and not any(flags) and decoder is not True) or (decoder is False and _checks_is_decoder(type(model))):
        fix = ("`config_overrides={'is_decoder': True}` loads it as a causal decoder" if overridable else
               "build it with `is_decoder=True` in its config (`AutoModelForCausalLM.from_pretrained(path, "
               "is_decoder=True)`): set on the built model's config, it leaves the attention bidirectional")
        raise ValueError(f"`{field}` is {what} with `is_decoder={getattr(config, 'is_decoder', None)}`: its attention "
                         f"is bidirectional, each position sees the token it is trained to predict, and the causal-LM "
                         f"loss teaches nothing; {fix}")


@functools.lru_cache(maxsize=None)
def _checks_is_decoder(cls: type) -> bool:
    """Whether a transformers model class (or a class it derives from) checks ``if not config.is_decoder`` in its
    ``__init__``: transformers' own test, with a logged warning, for the classes that attend causally only as
    decoders."""
    import inspect

    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass.__module__.split(".")[0] != "transformers":
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):  # (no source shipped: the `is_causal` flags decide alone)
            continue
        if "if not config.is_decoder" in source:
            return True
    return False


def _overridden_config(path: str, overrides: dict[str, Any]) -> Any:
    """The config of the checkpoint at ``path`` with ``overrides``, built as a built-in model's is (its class's own
    ``__init__``, which converts legacy names: ``rope_theta`` into ``rope_parameters``). Given to ``from_pretrained``
    as keyword arguments, transformers 5 handed names its config no longer has to the model's ``__init__``. A legacy
    name's share of a parameter group (``rope_parameters``) is merged into the checkpoint's group, which keeps the
    rest (a rope scaling type and its factors). A ``num_hidden_layers`` given resizes the checkpoint's per-layer lists
    (`_per_layer_lists`), which its config class otherwise refuses as of another length."""
    from transformers import AutoConfig

    raw = AutoConfig.from_pretrained(path).to_dict()
    merged = {**raw, **{key: value for key, value in overrides.items() if key in raw},
              **_per_layer_lists(raw, overrides)}
    legacy = {key: value for key, value in overrides.items() if key not in raw}
    if legacy:  # what they change in a default config of the kind: a parameter group's items, or themselves
        with _naming_overrides(overrides):
            plain = AutoConfig.for_model(raw["model_type"]).to_dict()
            changed = AutoConfig.for_model(raw["model_type"], **legacy).to_dict()
        for key, value in changed.items():
            before = plain.get(key)
            if key in legacy:  # (no field: stored as given)
                merged[key] = value
            elif (isinstance(value, dict) and isinstance(raw.get(key), dict)
                  and (value != before or legacy.keys() & value.keys())):  # (a value equal to the default's too)
                merged[key] = {**raw[key], **{k: v for k, v in value.items()
                                              if k in legacy or (before or {}).get(k) != v}}
    with _naming_overrides(overrides):
        config = AutoConfig.for_model(**merged)
    _refuse_unknown_fields(config, overrides)
    return config


_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types")  # (those `PreTrainedConfig.validate_layer_type` checks)


def _per_layer_lists(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's per-layer lists (``layer_types``: Qwen2's, Qwen3's, Gemma2's) for the ``num_hidden_layers`` of
    ``overrides``, where those do not set the list themselves: cut to the first layers, as transformers'
    ``from_pretrained(path, num_hidden_layers=n)`` builds them (each kept layer keeps its kind), or, for more layers
    than the checkpoint has (that ``from_pretrained`` fails on an index), dropped: the config class then makes it
    anew by its own rule (Qwen2's ``max_window_layers``, Gemma2's alternation)."""
    layers = overrides.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:  # (a wrong one: its config refuses it)
        return {}
    return {key: raw[key][:layers] if layers <= len(raw[key]) else None for key in _PER_LAYER_LISTS
            if key not in overrides and isinstance(raw.get(key), list) and len(raw[key]) != layers}


@contextmanager
def _naming_overrides(config_overrides: Optional[dict[str, Any]]):
    """An error while a config changed by ``config_overrides`` is built, or its model built or run once, names them
    (transformers' own message, about a rotary dimension or a head count, does not)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, MemoryError, torch.OutOfMemoryError, ImportError, SafetensorError):  # (a file missing or cut
        # short, no room, a package that does not import, a `kernels.py` of one's own hiding Hugging Face's: not the
        # overrides' doing)
        raise
    except Exception as err:  # (transformers' validation errors are no ValueError)
        if not config_overrides:
            raise
        raise ValueError(f"`config_overrides` {dict(config_overrides)!r} make a model that cannot be built or run: "
                         f"{type(err).__name__}: {err}") from err


def _check_runs(model: nn.Module, config_overrides: Optional[dict[str, Any]]) -> None:
    """A model built with ``config_overrides`` has a layer to adapt and runs one token (one that builds may still
    not run: key / value heads that do not divide); what fails names them."""
    if not config_overrides:
        return
    _without_cpu_repacking(model)  # (a 4-bit base run without gradients here was repacked, its backward then wrong)
    with _naming_overrides(config_overrides):
        layers = getattr(model.config, "num_hidden_layers", 1)
        if layers < 1:  # (builds and runs, with no layer to adapt)
            raise ValueError(f"num_hidden_layers must be at least 1, got {layers}")
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=model.device))


def _refuse_near_miss(base_model: str) -> None:
    """A name one typo away from a built-in model (``tiny-lama``), or a local folder that is not there
    (`missing_local_folder`), is refused at once: ``from_pretrained`` would spend ~45 s retrying the Hugging Face Hub
    before its network error, and name no built-in."""
    import difflib

    if missing_local_folder(base_model):
        raise OSError(f"`base_model` {base_model!r} is no built-in model ({', '.join(TINY_CONFIGS)}), no such folder "
                      "(a checkpoint directory), and no Hugging Face Hub name (`org/name`)")
    if base_model in TINY_CONFIGS or os.path.exists(base_model) or "/" in base_model:
        return
    close = difflib.get_close_matches(base_model, TINY_CONFIGS, n=1, cutoff=0.75)
    if close:
        raise ValueError(f"`base_model` {base_model!r} is no built-in model ({', '.join(TINY_CONFIGS)}) and no local "
                         f"checkpoint directory: did you mean {close[0]!r}?")


def _refuse_unknown_fields(config: Any, overrides: dict[str, Any]) -> None:
    """``config_overrides`` keys that the config stored as they came (no field of its own): one close to a field
    (``hidden_sizee``) is a typo and refused; another is warned of (a model may still read it: Qwen2 takes
    ``head_dim`` with ``getattr``). Legacy names the config converts (``rope_theta`` into ``rope_parameters``) pass."""
    import difflib
    import warnings

    fields = type(config)().to_dict()
    stored = config.to_dict()
    unknown = [key for key in overrides if key in stored and key not in fields]
    typos = {key: close[0] for key in unknown for close in [difflib.get_close_matches(key, fields, n=1, cutoff=0.8)]
             if close}
    if typos:
        raise ValueError(f"`config_overrides` names fields a {config.model_type} config does not have: "
                         f"{', '.join(f'{k!r} (did you mean {v!r}?)' for k, v in typos.items())}. Its fields: "
                         f"{', '.join(sorted(k for k in fields if k[0] != '_'))}")
    if unknown:
        near = {key: close[0] for key in unknown for close in [difflib.get_close_matches(key, fields, n=1, cutoff=0.6)]
                if close}
        hint = f" (did you mean {', '.join(f'{v!r} for {k!r}' for k, v in near.items())}?)" if near else ""
        warnings.warn(f"`config_overrides` {unknown} are no fields of a {config.model_type} config{hint}: they are set "
                      "on it as given, and the model uses them only if its code reads them", stacklevel=3)


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_PATCH_SAVED: dict[str, Any] = {}


@contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """Tells Hugging Face's mask builder that every row of the batch holds one sequence (positions 0, 1, ...,
    then right padding), so that a causal model run without an attention mask and without a cache takes SDPA's
    ``is_causal`` path.

    transformers counts a CUDA graph capture as tracing, and while tracing it neither skips the causal mask
    (it cannot tell whether a traced graph will see padding) nor rules out several sequences packed into one
    row of position ids (a check read on the host). Under a capture it would then build a full (rows, 1, T, T)
    mask: a slower attention than the eager steps', and different kernels. Inside this context neither
    question is asked for the mask-free, cache-free, offset-free case (the rows `MultiLoRADataModule` packs);
    any other case gets transformers' own answer. Reentrant and shared by threads (the backward's recomputation
    runs on autograd's thread); versions without these functions are left as they are."""
    global _PATCH_DEPTH
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover (transformers is a dependency)
        yield
        return
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            for name, replacement in (("find_packed_sequence_indices", _no_packed_sequences),
                                      ("_ignore_causal_mask_sdpa", _causal_when_unmasked)):
                original = getattr(masking_utils, name, None)
                if original is not None:
                    _PATCH_SAVED[name] = original
                    setattr(masking_utils, name, replacement)
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for name, original in _PATCH_SAVED.items():
                    setattr(masking_utils, name, original)
                _PATCH_SAVED.clear()


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    return None


def _causal_when_unmasked(padding_mask: Optional[torch.Tensor], q_length: int, kv_length: int, q_offset: Any,
                          kv_offset: Any, local_attention_size: Optional[int] = None) -> bool:
    """transformers' ``_ignore_causal_mask_sdpa``, answered without it where the answer cannot depend on a value:
    no padding mask, a square causal mask from position 0, no sliding window over it, nothing being compiled."""
    if (padding_mask is None and q_length == kv_length and type(q_offset) is int and q_offset == 0
            and type(kv_offset) is int and kv_offset == 0
            and (local_attention_size is None or kv_length < local_attention_size)
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()):
        return True
    return _PATCH_SAVED["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                    local_attention_size)
