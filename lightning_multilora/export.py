"""Export adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

from torch import Tensor

from lightning_multilora.spec import AdapterSpec


def peft_target_modules(layer_names: Sequence[str], all_module_names: Sequence[str]) -> list[str]:
    """The shortest PEFT ``target_modules`` that select exactly ``layer_names``.

    Last name parts (``q_proj``) when every module of the model with that last part is adapted,
    full module names otherwise.
    """
    chosen = set(layer_names)
    out: list[str] = []
    for suffix in sorted({n.rsplit(".", 1)[-1] for n in layer_names}):
        same_suffix = [n for n in all_module_names if n == suffix or n.endswith("." + suffix)]
        if all(n in chosen for n in same_suffix):
            out.append(suffix)
        else:
            out.extend(sorted(n for n in layer_names if n.rsplit(".", 1)[-1] == suffix))
    return out


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
    )
    config.save_pretrained(str(directory))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory
