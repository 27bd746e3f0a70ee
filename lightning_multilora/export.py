"""Adapters in PEFT's format, ``adapter_config.json`` + ``adapter_model.safetensors``: exported, and read back to
start an adapter from (`AdapterSpec.init_from`)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Collection, Mapping, Optional, Sequence

from torch import Tensor

from lightning_multilora.spec import AdapterSpec


def peft_target_modules(layer_names: Sequence[str], all_module_names: Sequence[str],
                        spelled_out: Collection[str] = ()) -> list[str]:
    """The shortest PEFT ``target_modules`` that select exactly ``layer_names``.

    Last name parts (``q_proj``) when every module of the model with that last part is adapted,
    full module names otherwise, and always for the last parts in ``spelled_out`` (`peft_fused_names`).
    """
    chosen = set(layer_names)
    out: list[str] = []
    for suffix in sorted({n.rsplit(".", 1)[-1] for n in layer_names}):
        same_suffix = [n for n in all_module_names if n == suffix or n.endswith("." + suffix)]
        if suffix not in spelled_out and all(n in chosen for n in same_suffix):
            out.append(suffix)
        else:
            out.extend(sorted(n for n in layer_names if n.rsplit(".", 1)[-1] == suffix))
    return out


def peft_fused_names(model: Any) -> frozenset[str]:
    """The last name parts (``gate_proj``, ``up_proj``, ``down_proj``, the router's ``gate``) that PEFT's loader, from
    0.22 on, reads in an export's ``target_modules`` as a mixture-of-experts base's fused expert parameters as well,
    on the bases whose experts transformers 5 fuses (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, OLMoE...): a bare
    ``gate_proj`` of a dense or shared-expert MLP then also targets the experts' ``gate_up_proj`` (untrained LoRA
    added there), and without ``up_proj`` is refused ("Cannot convert PEFT target(s) gate_proj without also targeting
    up_proj"). Written as full module names, which it keeps as the linear layers they are. Empty where PEFT has no
    such rule (its private tables, read as they are), and before 0.22 (`peft_skipped_layers`)."""
    try:
        import peft
        from packaging.version import Version
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return frozenset()
    if Version(peft.__version__) < Version("0.22.0"):
        return frozenset()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        if pattern is None or not conversion._MOE_FUSED_TARGETS.get(pattern):
            return frozenset()
        return frozenset(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern) or {})
    except (AttributeError, TypeError):  # (another PEFT: its loader's rules unknown here)
        return frozenset()


def peft_skipped_layers(model: Any, layer_names: Sequence[str]) -> list[str]:
    """The layers among ``layer_names`` whose weights PEFT's loader leaves out on ``model``: on a mixture-of-experts
    base whose experts transformers 5 fuses (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-MoE with dense layers...),
    `PeftModel.from_pretrained` reads every target named as an expert's projection (``gate_proj``, ``up_proj``,
    ``down_proj``, the router's ``gate``) as the fused experts' parameters, dense layers and shared experts of those
    names included, whose weights it then does not load, unsaid. Empty where PEFT has no such rule (its private tables,
    read as they are), and from PEFT 0.22 on, which keeps a target whose modules are all linear layers as a module
    target (its #3711 / #3945): it loads those layers."""
    try:
        import peft
        from packaging.version import Version
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return []
    if Version(peft.__version__) >= Version("0.22.0"):
        return []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        if model_type is None or conversion.get_checkpoint_conversion_mapping(model_type) is None:
            return []
        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        renamed = conversion._MOE_TARGET_MODULE_MAPPING.get(pattern) or {}
        if not conversion._MOE_FUSED_TARGETS.get(pattern):
            return []
    except (AttributeError, TypeError):  # (another PEFT: its loader's rules unknown here)
        return []
    return [n for n in layer_names if n.rsplit(".", 1)[-1] in renamed]


def save_peft_adapter(
    directory: str | Path,
    spec: AdapterSpec,
    state_dict: Mapping[str, Tensor],
    target_modules: Sequence[str],
    base_model_name_or_path: Optional[str] = None,
    fan_in_fan_out: bool = False,
    task_type: Optional[str] = "CAUSAL_LM",
) -> Path:
    """Write one adapter so that ``PeftModel.from_pretrained(base, directory)`` loads it (``fan_in_fan_out``: its
    layers hold their weights as (in, out), as GPT-2's Conv1D do; ``task_type`` None for a base that is no Hugging
    Face causal LM, which PEFT then loads as a plain module)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        use_rslora=spec.use_rslora,
        fan_in_fan_out=fan_in_fan_out,
        target_modules=list(target_modules),
        bias="none",
        task_type=task_type,
        base_model_name_or_path=base_model_name_or_path,
        inference_mode=True,  # (as PEFT's own save_pretrained writes it)
    )
    # each file written beside its place and moved there (an interrupt leaves the folder's earlier file, or none)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    partial = directory / f".adapter_model.safetensors.{os.getpid()}.partial"
    try:
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.replace(partial, directory / "adapter_model.safetensors")
    finally:
        partial.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".config-") as scratch:
        config.save_pretrained(scratch)
        os.replace(Path(scratch) / "adapter_config.json", directory / "adapter_config.json")
    return directory


PEFT_PREFIX = "base_model.model."
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def init_from_layers(spec: AdapterSpec, shapes: Optional[Mapping[str, Any]] = None) -> list[str]:
    """The layers (full module names) whose weights ``spec.init_from``'s PEFT folder holds, after checking that the
    folder is a plain LoRA adapter of the spec's ``rank``, ``alpha`` and ``use_rslora`` (a ValueError names what
    differs). Reads the weight file's keys, not its tensors (safetensors); ``shapes``: its `init_from_shapes`,
    where the caller has read them."""
    shapes = init_from_shapes(spec) if shapes is None else shapes
    return sorted({m.group(1) for k in shapes for m in [_LORA_A.fullmatch(k)] if m})


_LORA_A = re.compile(rf"{re.escape(PEFT_PREFIX)}(.+)\.lora_A\.weight")


def init_from_shapes(spec: AdapterSpec) -> dict[str, Optional[tuple[int, ...]]]:
    """The keys of ``spec.init_from``'s weight file and their tensors' shapes (None: not a tensor), after checking
    the folder's config (`init_from_config`) and that it holds LoRA weights under PEFT's saved names. A safetensors
    file's shapes are read from its header, its tensors left on disk."""
    init_from_config(spec)
    path = _weight_file(spec)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as err:  # (safetensors raises its own SafetensorError on a damaged file)
            raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r}: {path.name} cannot be read: "
                             f"{err}") from None
    else:
        shapes = {k: tuple(v.shape) if isinstance(v, Tensor) else None for k, v in _load_bin(path).items()}
    if not any(_LORA_A.fullmatch(k) for k in shapes):
        raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r}: {path.name} holds no LoRA weights "
                         f"under PEFT's saved names ('{PEFT_PREFIX}<module>.lora_A.weight'); its keys begin "
                         f"{sorted(shapes)[:3]}")
    return shapes


def init_from_weights(spec: AdapterSpec) -> dict[str, Tensor]:
    """The tensors of ``spec.init_from``'s weight file, under PEFT's saved names."""
    path = _weight_file(spec)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return _load_bin(path)


# `adapter_config.json` fields a plain LoRA adapter may set (checked on their own where they matter: `r`,
# `lora_alpha`, `use_rslora`, `peft_type`, `init_lora_weights`); any other field set (not null, false, empty or
# "none") is a variant this module does not train: DoRA, biases, rank / alpha patterns, modules_to_save, aLoRA...
_FREE_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out", "use_rslora",
    "layers_to_transform", "layers_pattern", "init_lora_weights", "eva_config", "loftq_config", "megatron_core",
    "runtime_config", "qalora_group_size", "ensure_weight_tying"})
# initialisations that leave the base as it is (their weights train as any LoRA's afterwards)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "nora")


def init_from_config(spec: AdapterSpec) -> dict[str, Any]:
    """``spec.init_from``'s ``adapter_config.json``, after checking that it is a plain LoRA adapter of the spec's
    ``rank``, ``alpha`` and ``use_rslora`` (a ValueError names what differs)."""
    folder = Path(spec.init_from)
    where = f"adapter {spec.name!r}: `init_from` {spec.init_from!r}"
    if not folder.is_dir():
        raise ValueError(f"{where} is no folder (a PEFT adapter folder, as `save_pretrained` or an export writes it)")
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{where} has no adapter_config.json (a PEFT adapter folder holds one)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: its adapter_config.json cannot be read: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: its adapter_config.json holds no JSON object")
    differ = [f"{ours}={theirs_value!r} there, {getattr(spec, ours)!r} in the spec" for ours, theirs_value in (
        ("rank", config.get("r")), ("alpha", config.get("lora_alpha")),
        ("use_rslora", config.get("use_rslora", False))) if theirs_value != getattr(spec, ours)]
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:  # (PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ change the base their weights go with)
        raise ValueError(f"{where} is not a plain LoRA adapter (init_lora_weights={init!r}): its weights fit the base "
                         "its initialisation rewrote, not the base these adapters share; PEFT converts such an "
                         "adapter to plain LoRA (`save_pretrained(..., path_initial_model_for_weight_conversion=...)`"
                         f"), which loads here. Plain initialisations: {list(_PLAIN_INITS)}")
    unsupported = [f"{key}={value!r}" for key, value in config.items()
                   if key not in _FREE_FIELDS and value not in (None, False, [], {}, "none")]
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.insert(0, f"peft_type={config['peft_type']!r}")
    if unsupported:
        raise ValueError(f"{where} is not a plain LoRA adapter ({', '.join(unsupported)}): these adapters are plain "
                         "LoRA (no DoRA, biases, per-layer ranks, saved modules or other LoRA variants)")
    if differ:
        raise ValueError(f"{where} differs from the spec: {'; '.join(differ)} (the spec's `rank`, `alpha` and "
                         "`use_rslora` must be the folder's `r`, `lora_alpha` and `use_rslora`)")
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, (int, float)) and dropout != spec.dropout:  # (PeftModel.from_pretrained trains on with it)
        warnings.warn(f"{where} was trained with lora_dropout={dropout!r}; the spec's dropout={spec.dropout!r} "
                      f"continues it, and its export says so (set `dropout={dropout!r}` to continue as PEFT would)",
                      stacklevel=2)
    return config


def _weight_file(spec: AdapterSpec) -> Path:
    folder = Path(spec.init_from)
    for name in _WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"adapter {spec.name!r}: `init_from` {spec.init_from!r} holds neither "
                     f"{' nor '.join(_WEIGHT_FILES)}")


def _load_bin(path: Path) -> dict[str, Tensor]:
    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # (pickle's and torch's own errors on a damaged or foreign file)
        raise ValueError(f"{path} cannot be read as a PEFT weight file: {err}") from None
