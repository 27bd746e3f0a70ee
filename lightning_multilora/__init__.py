"""lightning-multilora: train many LoRA adapters at once on one frozen base model, in Lightning.

Top-level names are imported lazily, so ``import lightning_multilora`` stays fast.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _not_the_hub_kernel_warning(record: logging.LogRecord) -> bool:
    """bitsandbytes (which PEFT imports, for every export) tries, on a CPU with AVX-512 BF16, to fetch a 4-bit kernel
    from the Hugging Face Hub and warns at each import where it cannot; it then runs its own, the one a 4-bit base
    here runs anyway, so every fit on such a CPU began with a warning about nothing it used. That warning alone is
    dropped; any other of that logger's shows."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_hub_kernel_warning)

_EXPORTS = {
    "AdapterSpec": "lightning_multilora.spec",
    "SweepGrid": "lightning_multilora.spec",
    "BatchLayout": "lightning_multilora.layout",
    "MultiLoRALinear": "lightning_multilora.layer",
    "inject_multilora": "lightning_multilora.layer",
    "LoRALayers": "lightning_multilora.layer",
    "AdapterRegistry": "lightning_multilora.registry",
    "AdapterState": "lightning_multilora.registry",
    "MultiLoRAMixin": "lightning_multilora.module",
    "MultiLoRAModule": "lightning_multilora.module",
    "MultiLoRADataModule": "lightning_multilora.data.datamodule",
    "SweepReport": "lightning_multilora.callbacks.report",
    "EarlyExit": "lightning_multilora.callbacks.early_exit",
    "WarmupSelection": "lightning_multilora.callbacks.warmup",
    "OptunaSweep": "lightning_multilora.callbacks.optuna_sweep",
    "AdapterParallelStrategy": "lightning_multilora.strategies.adapter_parallel",
    "checkpointing_kwargs": "lightning_multilora.kernels.recompute",
    "GroupedAdamW": "lightning_multilora.optim",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lightning_multilora.strategies.adapter_parallel import AdapterParallelStrategy
    from lightning_multilora.callbacks.early_exit import EarlyExit
    from lightning_multilora.callbacks.optuna_sweep import OptunaSweep
    from lightning_multilora.callbacks.report import SweepReport
    from lightning_multilora.callbacks.warmup import WarmupSelection
    from lightning_multilora.data.datamodule import MultiLoRADataModule
    from lightning_multilora.kernels.recompute import checkpointing_kwargs
    from lightning_multilora.layer import LoRALayers, MultiLoRALinear, inject_multilora
    from lightning_multilora.layout import BatchLayout
    from lightning_multilora.module import MultiLoRAMixin, MultiLoRAModule
    from lightning_multilora.optim import GroupedAdamW
    from lightning_multilora.registry import AdapterRegistry, AdapterState
    from lightning_multilora.spec import AdapterSpec, SweepGrid


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_multilora' has no attribute {name!r}")
