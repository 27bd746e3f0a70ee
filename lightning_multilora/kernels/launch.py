"""Low-overhead launches of (autotuned) Triton kernels.

A Triton launch through ``kernel[grid](...)`` costs tens of microseconds of Python on the host (the
autotuner's key, argument binding, option handling). A LoRA call makes six launches on small problems, so
that host time, not the GPU, set the pace of a training step. `FastLauncher` sends a variant's first
launch through Triton (autotuning, compiling) and keeps the compiled kernel and the chosen tiles under a
key that covers everything Triton specializes a kernel on (argument dtypes, 16-byte pointer alignment, the
values of the other arguments, the constexpr ones); later launches with the same key call the compiled
kernel's launcher directly.

Under ``TRITON_INTERPRET=1``, or while Triton launch hooks are set (profilers), every launch takes
Triton's own path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import triton


def _specs(args: tuple) -> tuple:
    """The part of a launch's key that its arguments give: each tensor's dtype and 16-byte alignment (what Triton
    specializes a pointer on), every other argument by value (a bool apart from the int of its value). An int's
    value is finer than what Triton specializes it on (1, a multiple of 16, within 32 bits): a new value takes
    Triton's own path once, which finds its compiled kernel. The kernels' int arguments are widths, strides and
    counts fixed per layer shape, and a few per layout (rank chunks, row splits, the tuning buckets of
    `triton_lora._bucket`), so a run meets few values. One comprehension: this runs on every launch."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor) else
                  a if a.__class__ is int else (a.__class__, a) for a in args])


class FastLauncher:
    """``launcher(grid, args, meta)`` launches ``kernel[grid](*args, **meta)``.

    ``args`` are the kernel's leading positional (runtime) arguments, ``meta`` its remaining constexpr
    keyword arguments; ``grid`` is a tuple or a function of the full meta-parameters (tuned tiles included).
    """

    def __init__(self, kernel: Any, interpreted: bool) -> None:
        self.kernel = kernel
        self.interpreted = interpreted
        # (a JITFunction or an Autotuner: both name the kernel's arguments)
        self.arg_names: list[str] = [] if interpreted else list(kernel.arg_names)
        self._variants: dict[tuple, tuple[Any, dict[str, Any], list[Any]]] = {}

    def __call__(self, grid: tuple | Callable[[Mapping[str, Any]], tuple], args: tuple, meta: dict[str, Any],
                 before: Optional[Callable[[Optional[Mapping[str, Any]]], None]] = None) -> None:
        """``before``, if given, runs just before the launch with its full meta-parameters (the tuned tiles
        included), or with None where Triton's own path picks them (a first launch, the interpreter, hooks)."""
        if self.interpreted or _hooks_set():
            if before is not None:
                before(meta if self.interpreted else None)
            self.kernel[grid](*args, **meta)
            return
        device = args[0].get_device()
        key = (device, _specs(args), tuple(meta.items()))
        variant = self._variants.get(key)
        if variant is None:
            if before is not None:
                before(None)
            compiled = self.kernel[grid](*args, **meta)
            best = getattr(self.kernel, "best_config", None)
            tiles = dict(best.kwargs) if best is not None else {}
            full = {**meta, **tiles}
            missing = [n for n in self.arg_names[len(args):] if n not in full]
            if compiled is None or not hasattr(compiled, "run") or missing:
                return  # launched by Triton; this variant keeps Triton's path
            self._variants[key] = (compiled, full, [full[n] for n in self.arg_names[len(args):]])
            return
        compiled, full, tail = variant
        if before is not None:
            before(full)
        shape = grid(full) if callable(grid) else grid
        shape = tuple(shape) + (1,) * (3 - len(shape))
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(shape[0], shape[1], shape[2], stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *tail)


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and (_active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook))


def _active(hook: Any) -> bool:
    """A launch hook that does something: Triton >= 3.5 keeps (possibly empty) hook chains, older ones None."""
    return hook is not None and bool(getattr(hook, "calls", True))
