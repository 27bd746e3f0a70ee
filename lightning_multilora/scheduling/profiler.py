"""ALTO's two-phase memory profiler and a throughput profiler with an on-disk cache.

`MemoryProfiler` takes a ``measure(n_adapters, batch_size) -> peak bytes | None`` function (``None``: out
of memory) so the search and the fit are the same on a GPU (`cuda_step_measure`, one real training
step after a warm-up step) and in tests. Phase 1 binary-searches the largest total batch ``B_max`` one adapter can take
within the safety margin; phase 2 measures the grid ``(N, b)``, ``b`` in ``batch_sizes``,
``N * b <= B_max`` and fits `MemoryFit`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_multilora.arguments import check_int, check_real
from lightning_multilora.scheduling.memory import MemoryFit, MemoryFitCache, MemoryPoint, signature_key

log = logging.getLogger(__name__)

Measure = Callable[[int, int], Optional[float]]


def check_margin(value: Any, where: str = "", name: str = "safety_margin") -> float:
    """``value``, the usable fraction of device memory, as a float: a real number in (0, 1] (not text: ``"0.9"`` is
    refused); an error names the caller's own ``where`` and field ``name`` (`PackingPlanner`'s is ``load_factor``)."""
    check_real(where or "memory budget", name, value, lambda v: 0.0 < v <= 1.0,
               "the usable fraction of device memory, a number in (0, 1]")
    return float(value)


class MemoryProfiler:
    """Find ``B_max``, measure the ``(N, b)`` grid, fit ``M = k0 + k1*B*L + k2*P``.

    Args:
        measure: one training step of ``n`` adapters at batch ``b`` each; returns its peak bytes or None.
        capacity_bytes: the device's memory.
        seq_len: tokens per row of the measured steps.
        params_per_adapter: trainable parameters of one profiled adapter.
        safety_margin: the usable fraction of ``capacity_bytes``, in (0, 1].
        batch_sizes: per-adapter batch sizes of the grid.
        max_batch: upper end of the binary search.
        max_adapters: upper end of ``N`` in the grid.
    """

    def __init__(self, measure: Measure, capacity_bytes: float, seq_len: int, params_per_adapter: int,
                 safety_margin: float = 0.9, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                 max_batch: int = 1024, max_adapters: int = 128) -> None:
        if not callable(measure):
            raise TypeError(f"MemoryProfiler: `measure` must be a function (n_adapters, batch_size) -> peak bytes or "
                            f"None (`cuda_step_measure`), got {type(measure).__name__}")
        check_real("MemoryProfiler", "capacity_bytes", capacity_bytes, lambda v: v > 0, "a finite number of bytes > 0")
        for name, value in (("seq_len", seq_len), ("params_per_adapter", params_per_adapter),
                            ("max_batch", max_batch), ("max_adapters", max_adapters)):
            check_int("MemoryProfiler", name, value, 1)
        self.measure = measure
        self.capacity_bytes = float(capacity_bytes)
        self.seq_len = seq_len
        self.params_per_adapter = params_per_adapter
        self.safety_margin = check_margin(safety_margin, "MemoryProfiler")
        if (isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or not batch_sizes
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes)):
            raise ValueError(f"MemoryProfiler: `batch_sizes` must be a list of integers >= 1, got {batch_sizes!r}")
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = max_batch
        self.max_adapters = max_adapters
        self.points: list[MemoryPoint] = []

    @property
    def budget(self) -> float:
        return self.capacity_bytes * self.safety_margin

    def _point(self, n: int, b: int) -> Optional[MemoryPoint]:
        peak = self.measure(n, b)
        if peak is None:
            return None
        point = MemoryPoint(n, b, self.seq_len, n * self.params_per_adapter, float(peak))
        self.points.append(point)
        return point

    def find_max_batch(self) -> int:
        """Phase 1: the largest total batch one adapter trains at within the margin (0 if none fits)."""
        lo, hi = 0, self.max_batch  # lo fits (or is 0), everything above hi is unknown/too big
        while lo < hi:
            mid = (lo + hi + 1) // 2
            point = self._point(1, mid)
            if point is not None and point.peak_bytes <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grid(self, b_max: int) -> list[tuple[int, int]]:
        """Phase 2's configurations: ``N`` doubling from 1, every ``b`` with ``N * b <= b_max``."""
        configs = []
        for b in self.batch_sizes:
            n = 1
            while n * b <= b_max and n <= self.max_adapters:
                configs.append((n, b))
                n *= 2
        return configs

    def profile(self, signature: Optional[Mapping[str, Any]] = None) -> MemoryFit:
        b_max = self.find_max_batch()
        if b_max < 1:
            raise RuntimeError(f"one adapter at batch 1 does not fit in {self.safety_margin:.0%} of "
                               f"{self.capacity_bytes / 2**30:.1f} GiB")
        measured = {(p.n_adapters, p.batch_size) for p in self.points}
        for n, b in self.grid(b_max):
            if (n, b) not in measured:  # (phase 1 measured one adapter at some batch sizes already)
                self._point(n, b)
        if len({(p.n_adapters, p.batch_size) for p in self.points}) < 3:
            rows = f"{b_max} rows of one adapter fit" if b_max > 1 else "one adapter at batch 1 fits"
            raise RuntimeError(f"only {rows} in {self.safety_margin:.0%} of {self.capacity_bytes / 2**30:.1f} GiB: "
                               "too few configurations to fit a memory model on, and next to nothing to pack")
        fit = MemoryFit.fit(self.points, dict(signature or {}))  # phase 1's points are measurements too
        self.b_max = b_max
        log.info("memory fit: M = %.3g + %.3g*B*L + %.3g*P bytes over %d points (B_max=%d)", fit.k0, fit.k1,
                 fit.k2, len(fit.points), b_max)
        return fit

    def cached_profile(self, cache: MemoryFitCache, signature: Mapping[str, Any]) -> MemoryFit:
        """The cached fit for ``signature``, or a new profile (then cached)."""
        fit = cache.load(signature)
        if fit is None:
            fit = self.profile(signature)
            fit.signature = dict(signature)
            cache.save(fit)
        return fit


def cuda_step_measure(step: Callable[[int, int], None], device: Any = None, warmup_steps: int = 1) -> Measure:
    """A `Measure` from ``step(n, b)`` (one training step of ``n`` adapters at batch ``b``, adding and
    removing them itself): the step's ``torch.cuda.max_memory_reserved``, None on out-of-memory.

    ``warmup_steps`` steps run first, unmeasured: a shape's first step also autotunes the grouped kernels
    (whose timing buffers, 256 MB and more, would count as the step's peak) and compiles, once per shape,
    so the peak of a training run's steady state is the peak of the step after them."""
    import torch

    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")

    def measure(n: int, b: int) -> Optional[float]:
        try:
            for _ in range(warmup_steps):
                step(n, b)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            step(n, b)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None
        return float(torch.cuda.max_memory_reserved(device))

    return measure


class ThroughputProfiler:
    """Samples per second of a task from a short real run, cached per task signature on disk.

    ``duration(signature, total_samples, run)`` is the scheduler's ``d = total_samples / throughput``;
    ``run(steps) -> samples`` is only called when the signature is not cached.
    """

    def __init__(self, path: str | Path, warmup_steps: int = 2, steps: int = 5) -> None:
        self.path = Path(path)
        check_int("ThroughputProfiler", "warmup_steps", warmup_steps, 0)  # ("2" failed with a bare TypeError, and
        check_int("ThroughputProfiler", "steps", steps, 1)  # 2.5 steps were taken)
        self.warmup_steps, self.steps = int(warmup_steps), int(steps)

    def _table(self) -> dict[str, Any]:
        """The cache's entries; none (logged, then measured again and the file rewritten) where the file does not
        read, as `MemoryFitCache` does (a file cut short by a killed run, say)."""
        if not self.path.exists():
            return {}
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            log.warning("throughput cache %s does not read (%s: %s): measuring again", self.path, type(err).__name__,
                        err)
            return {}
        if not isinstance(table, dict):
            log.warning("throughput cache %s is not a mapping of measurements: measuring again", self.path)
            return {}
        return table

    def cached(self, signature: Mapping[str, Any]) -> Optional[float]:
        entry = self._table().get(signature_key(signature))
        if entry is None:
            return None
        rate = entry.get("samples_per_s") if isinstance(entry, Mapping) else None
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
            log.warning("throughput cache %s: the entry for %s has no rate (%r): measuring again", self.path,
                        dict(signature), entry)
            return None
        return float(rate)

    def measure(self, signature: Mapping[str, Any], run: Callable[[int], int],
                sync: Optional[Callable[[], None]] = None) -> float:
        """Time ``run(steps)`` after ``run(warmup_steps)``; store and return samples/s."""
        if self.warmup_steps:
            run(self.warmup_steps)
        if sync is not None:
            sync()
        start = time.perf_counter()
        samples = run(self.steps)
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - start
        if isinstance(samples, bool) or not isinstance(samples, (int, float)):
            raise TypeError(f"ThroughputProfiler: `run(steps)` must return the number of samples it processed, got "
                            f"{samples!r}")
        if not 0 < samples < float("inf") or elapsed <= 0:
            raise RuntimeError(f"the throughput run processed {samples} samples in {elapsed:.3g} s")
        rate = samples / elapsed
        table = self._table()
        table[signature_key(signature)] = dict(signature=json.loads(json.dumps(dict(signature), default=str)),
                                               samples_per_s=rate)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")  # (renamed whole into place: never half written)
        partial.write_text(json.dumps(table, indent=1))
        partial.replace(self.path)
        return rate

    def duration(self, signature: Mapping[str, Any], total_samples: int, run: Callable[[int], int],
                 sync: Optional[Callable[[], None]] = None) -> float:
        """Seconds to train ``total_samples`` samples (measured once per signature)."""
        if total_samples < 0:
            raise ValueError(f"`total_samples` must be >= 0, got {total_samples}")
        rate = self.cached(signature)
        if rate is None:
            rate = self.measure(signature, run, sync)
        return total_samples / rate
