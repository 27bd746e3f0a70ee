"""`StepGraphs`: a repeated training step's device work, captured once per key in a CUDA graph and replayed.

Why: with small per-adapter batches a LoRA step is bound by the host, not the GPU. A Llama or Qwen layer with
seven adapted projections costs milliseconds of Python per step (the model's own modules, the checkpoint's
hooks, the LoRA autograd Functions and their launches), and a 64-layer model at four adapters of 256 tokens
spends more time issuing its work than the H200 spends running it. A replay issues the whole step at once.

What may be captured: device work only. The step function runs once, at capture; its Python side effects
happen then and never again. It must not read a device value on the host (``.item()``, ``.tolist()``, a
tensor's truth value), copy from pageable host memory, or launch a collective. The Triton LoRA calls, the
frozen base, a non-reentrant gradient-checkpointed backward and fused optimizers (``capturable=True``) can be.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Hashable
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import Tensor


class StepGraphs:
    """Runs ``fn(*inputs)`` eagerly for its first ``warmup`` calls of each key, then captures it in a CUDA graph
    and replays that graph for every later call of the key, after copying ``inputs`` into the graph's own input
    buffers.

    - ``key``: everything the step's Python depends on besides the tensors' values: the batch layout, the
      shapes, the adapters held and the addresses of their parameters and gradients. Calls of one key must
      issue the same device work on the same tensors. `clear` drops every graph (adapters added or removed).
    - ``inputs``: tensors whose values change from call to call (the batch); their shapes, dtypes and devices
      belong to the key. Everything else the step reads (parameters, gradients, optimizer state) must stay
      at the addresses it had at capture.
    - The result is the graph's own output tensors: overwritten by the next replay of the same key, so read
      or copy them before. Eager calls return ``fn``'s result.
    - ``warmup``: eager calls before the capture (at least 1): they fill the caches the step's Python reads
      (kernel tuning, device tables), which the capture must find full. ``max_graphs``: graphs kept, the least
      recently replayed dropped first (each holds the memory of its step's intermediates).
    - Not on CUDA, or ``enabled=False``: every call is eager. A capture that fails (a host sync, an operation
      that cannot be captured, a cache the warmup left empty) warns with the reason, and its key starts over: its
      next ``warmup`` calls run eagerly (filling what the capture missed), then it is captured again. A second
      failed capture turns the graphs off: every call runs eagerly from then on (``enabled`` turns False).
      `failures` keeps the reasons.
    - Gradient checkpointing under a capture needs torch >= 2.10 (its RNG state is read and restored).
    """

    def __init__(self, warmup: int = 2, max_graphs: int = 4, enabled: bool = True) -> None:
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"`warmup` must be an integer >= 1 (eager calls before a capture), got {warmup!r}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"`max_graphs` must be an integer >= 1, got {max_graphs!r}")
        self.warmup, self.max_graphs, self.enabled = warmup, max_graphs, enabled
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._calls: dict[Hashable, int] = {}
        self._failed: dict[Hashable, str] = {}
        self._retried = False  # (one failed capture is retried after another warmup; a second turns the graphs off)
        self.replays = 0  # calls answered by a replay
        self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def failures(self) -> dict[Hashable, str]:
        """The keys whose capture failed, with the reasons."""
        return dict(self._failed)

    def clear(self) -> None:
        """Drop every graph and call count (the adapters or the tensors a step reads have changed)."""
        self._graphs.clear()
        self._calls.clear()

    def __call__(self, key: Hashable, fn: Callable[..., Any], *inputs: Tensor) -> Any:
        if not self.enabled or not inputs or not all(t.is_cuda for t in inputs):
            return fn(*inputs)
        key = (key, tuple((t.shape, t.dtype, t.device) for t in inputs))
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            for static, value in zip(captured.inputs, inputs):
                static.copy_(value)
            captured.graph.replay()
            self.replays += 1
            return captured.outputs
        seen = self._calls.pop(key, 0)
        if seen < self.warmup:
            self._calls[key] = seen + 1  # (the most recent last: keys seen long ago are forgotten first)
            if len(self._calls) > 64:
                del self._calls[next(iter(self._calls))]
            return fn(*inputs)
        return self._capture(key, fn, inputs)

    def _capture(self, key: Hashable, fn: Callable[..., Any], inputs: tuple[Tensor, ...]) -> Any:
        from lightning_multilora.kernels import keep_calls

        statics = tuple(t.clone() for t in inputs)
        graph = _Graph()
        pool = torch.cuda.graph_pool_handle()  # (named: a failed capture's memory is released by it)
        # A stream of its own (from torch's pool of streams), not the default capture stream all graphs share
        stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
        # Autocast's cache of cast weights would hand the capture tensors that outlive it: off while capturing
        autocast = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                    if torch.is_autocast_enabled("cuda") else nullcontext())
        reason = None
        calls: list = []
        try:
            # thread_local: another thread's CUDA calls (a data loader's pinning) do not invalidate the capture
            with keep_calls() as calls, torch.cuda.graph(graph, pool=pool, stream=stream,
                                                         capture_error_mode="thread_local"), autocast:
                outputs = fn(*statics)
        except Exception as err:  # noqa: BLE001 (any failure of the capture: every step then runs eagerly)
            # A capture the step invalidated makes the capture's end fail too, before it gives the stream back
            torch.cuda.set_stream(current)
            while err.__context__ is not None:  # the first error, not the capture's end it made fail too
                err = err.__context__
            reason = f"{type(err).__name__}: {err}".splitlines()[0]
        if reason is not None:  # (out of the except block: its traceback held the failed step's tensors)
            ended = graph.ended  # (the capture ended, and the step raised: the graph gives its pool back itself)
            del graph, statics, calls
            _release_pool(pool, ended)
            _end_rng_capture()
            self._failed[key[0]] = reason
            if self._retried:
                self.enabled = False
                self.clear()
                then = "steps run eagerly from now on"
            else:  # (its eager calls fill what the capture found missing: a table made in it, say)
                self._retried = True
                then = f"it runs eagerly and is captured again after {self.warmup} more call(s)"
            warnings.warn(f"a CUDA graph of this step could not be captured ({reason}); {then}", stacklevel=3)
            return fn(*inputs)
        self._graphs[key] = _Captured(graph, statics, outputs, calls, stream)
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        graph.replay()  # the capture ran nothing: this call's step is the first replay
        self.replays += 1
        return outputs


def _release_pool(pool: Any, ended: bool) -> None:
    """Give back the memory a failed capture took. Where the capture ended (the step raised, say on a table it
    would have made), the deleted graph has released its pool, and torch frees it here. Where its end failed (the
    step invalidated the capture), the pool stays open for allocations, and held: released here, best effort with
    torch's own calls where it has them. (Released twice, torch's allocator fails an internal assert at every later
    ``empty_cache``, Lightning's at the end of the fit included: seen on the H200, torch 2.11.)"""
    gc.collect()
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    for name in () if ended else ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        release = getattr(torch._C, name, None)
        if release is not None:
            try:
                release(device, pool)
            except (RuntimeError, TypeError):  # already closed by the capture's end; another torch
                pass
    torch.cuda.empty_cache()


def _end_rng_capture() -> None:
    """A capture whose end failed leaves torch's CUDA generator marked as capturing (torch ends the generator's
    capture after the stream's, which raised): every later random draw on the device then fails with "Offset
    increment outside graph capture encountered unexpectedly". Seen on the H200 (torch 2.11): after the failed
    capture of `tests/test_graphs.py`, a ``torch.randn(64, device="cuda")`` in the same process. An empty capture
    begins and ends the generator's capture again. Best effort: where it fails too, said."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (an empty graph)
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                pass
    except Exception as err:  # noqa: BLE001 - the step still runs eagerly; random draws may fail
        warnings.warn(f"after the failed capture, torch's CUDA random generator could not be reset ({err}); random "
                      "draws on the device may fail in this process")


class _Graph(torch.cuda.CUDAGraph):
    """A CUDA graph that says whether its capture ended."""

    ended = False

    def capture_end(self) -> None:
        super().capture_end()
        self.ended = True


class _Captured:
    __slots__ = ("graph", "inputs", "outputs", "keep", "stream")

    def __init__(self, graph: Any, inputs: tuple[Tensor, ...], outputs: Any, keep: Optional[list],
                 stream: Any) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.keep = keep  # the LoRA calls (and tables) whose device state the graph reads
        self.stream = stream
