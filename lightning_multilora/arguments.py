"""Checks of constructor arguments: each error names the argument, what it may be and what it got."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional


class UsageError(ValueError):
    """A setting or an input the run found wrong once under way (a data file that does not read, a storage URL that
    does not open, an adapter that cannot start before the first step): the ``multilora`` command ends with its
    message, as with a parse error, instead of a traceback. From Python it is a `ValueError` like the others."""


class RunEnded(UsageError):
    """A resume of a run whose adapters have all ended: nothing to train. A `multilora schedule` task's resume (its
    retry, or the schedule's ``--resume``, after the run ended but before its process did) ends with status 0."""


def check_int(where: str, name: str, value: Any, low: int, optional: bool = False,
              high: Optional[int] = None) -> None:
    """``value`` is an integer (Python's or numpy's, not a bool) >= ``low`` (and <= ``high``, where given), or None
    where ``optional``."""
    if optional and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
            or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{where}: `{name}` must be an integer {bound}{' or None' if optional else ''}, got "
                         f"{value!r}")


def check_real(where: str, name: str, value: Any, ok: Callable[[float], bool], allowed: str,
               infinite: bool = False) -> None:
    """``value`` is a real number (Python's or numpy's, not a bool), not NaN, finite unless ``infinite``, for which
    ``ok`` holds; ``allowed`` says which, in words."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value)
            or (not infinite and math.isinf(value)) or not ok(value)):
        raise ValueError(f"{where}: `{name}` must be {allowed}, got {value!r}")


def check_bool(where: str, name: str, value: Any, optional: bool = False) -> Optional[bool]:
    """``value`` is True or False (or None where ``optional``)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ValueError(f"{where}: `{name}` must be True or False{' or None' if optional else ''}, got {value!r}")
    return value


def peft_targets(value: Any) -> Any:
    """``target_modules`` as PEFT reads them: ``"all-linear"`` in any case, a set of names (`LoraConfig`'s) in one
    order; anything else as it is (checked where it is used)."""
    if isinstance(value, str) and value.lower() == "all-linear":
        return "all-linear"
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return value


def missing_local_folder(name: str) -> bool:
    """Whether ``name``, not there, reads as a local folder rather than a Hugging Face Hub name (``org/name``): more
    than one ``/``, or its first part a folder here that holds saved models or tokenizers (``runs/tok_typo``, beside
    ``runs/tok``; a folder of another kind named as a Hub org is left to the Hub). ``from_pretrained`` retried the
    Hub with it for ~45 s before its error."""
    import os
    from pathlib import Path

    path = os.path.expanduser(name)
    if os.path.exists(path):
        return False
    parts = path.split("/")
    if len(parts) != 2 or not os.path.isdir(parts[0]):
        return len(parts) > 2
    saved = ("config.json", "tokenizer_config.json", "adapter_config.json")
    try:
        return any(child.is_dir() and any((child / f).is_file() for f in saved) for child in Path(parts[0]).iterdir())
    except OSError:
        return False
