"""MemoryProfiler's search, grid and fit; the throughput cache."""

from __future__ import annotations

import re

import pytest

from lightning_multilora.scheduling.memory import MemoryFit, MemoryFitCache
from lightning_multilora.scheduling.profiler import MemoryProfiler, ThroughputProfiler

GIB = 2**30
PARAMS = 41_943_040  # one r=16 adapter of Llama-8B on the 7 projections
CAPACITY = 141 * GIB


def h200_like(calls: list):
    """Peaks from a law fitted to the H200 measurements (k0 ~ 16.9 GiB); out of memory above the card."""
    def measure(n: int, b: int):
        calls.append((n, b))
        peak = 16.9 * GIB + 3.1e5 * n * b * 1024 + 16.3 * n * PARAMS
        return None if peak > CAPACITY else peak
    return measure


def test_phase_one_finds_the_largest_batch_within_the_margin_and_phase_two_fits_the_grid():
    calls: list = []
    profiler = MemoryProfiler(h200_like(calls), CAPACITY, seq_len=1024, params_per_adapter=PARAMS, safety_margin=0.9)
    b_max = profiler.find_max_batch()
    budget = 0.9 * CAPACITY
    peak = lambda n, b: 16.9 * GIB + 3.1e5 * n * b * 1024 + 16.3 * n * PARAMS  # noqa: E731
    assert peak(1, b_max) <= budget < peak(1, b_max + 1)
    assert len(calls) <= 11  # a binary search over 1..1024
    grid = profiler.grid(b_max)
    assert (1, 1) in grid and all(n * b <= b_max for n, b in grid)
    assert {b for _, b in grid} == {1, 2, 4, 8, 16, 32}
    fit = profiler.profile({"gpu": "test"})
    assert fit.k1 == pytest.approx(3.1e5, rel=1e-6) and fit.k2 == pytest.approx(16.3, rel=1e-6)
    assert fit.signature == {"gpu": "test"}
    calls.clear()
    MemoryProfiler(h200_like(calls), CAPACITY, seq_len=1024, params_per_adapter=PARAMS).profile()
    assert len(calls) == len(set(calls))  # (phase 2 measured phase 1's points again)


def test_a_device_that_fits_one_adapter_at_batch_one_alone_says_so():
    """(It measured (1, 1) twice and then failed in the fit, "needs >= 3 measured points, got 2".)"""
    profiler = MemoryProfiler(lambda n, b: 100 * GIB if n * b == 1 else None, CAPACITY, 1024, PARAMS)
    with pytest.raises(RuntimeError, match=r"only one adapter at batch 1 fits in 90% of 141.0 GiB: too few "
                                           r"configurations to fit a memory model on"):
        profiler.profile()


def test_out_of_memory_points_are_skipped_and_nothing_fitting_is_an_error():
    profiler = MemoryProfiler(lambda n, b: None, CAPACITY, seq_len=1024, params_per_adapter=PARAMS)
    assert profiler.find_max_batch() == 0
    with pytest.raises(RuntimeError, match="does not fit"):
        profiler.profile()


@pytest.mark.parametrize("margin", [0.0, -0.1, 1.5])
def test_the_safety_margin_must_be_a_fraction(margin):
    with pytest.raises(ValueError, match=r"safety_margin.*\(0, 1\]"):
        MemoryProfiler(lambda n, b: 1.0, CAPACITY, 1024, PARAMS, safety_margin=margin)


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity_bytes=-1), r"`capacity_bytes` must be a finite number of bytes > 0, got -1"),
    (dict(capacity_bytes="80GB"), r"`capacity_bytes` must be a finite number of bytes > 0, got '80GB'"),
    (dict(seq_len=0), r"`seq_len` must be an integer >= 1, got 0"),
    (dict(params_per_adapter=-5), r"`params_per_adapter` must be an integer >= 1, got -5"),
    (dict(max_batch=0), r"`max_batch` must be an integer >= 1, got 0"),
    (dict(batch_sizes=[1, 2.5]), r"`batch_sizes` must be a list of integers >= 1, got \[1, 2.5\]"),
    (dict(measure=12), r"`measure` must be a function \(n_adapters, batch_size\) -> peak bytes or None"),
])
def test_the_profilers_settings_are_checked_before_any_step_is_measured(kwargs, message):
    """(A capacity of -1 said "does not fit in 90% of -0.0 GiB", and a `seq_len` of 0 measured every step first.)"""
    calls = []
    settings = dict(measure=h200_like(calls), capacity_bytes=CAPACITY, seq_len=1024, params_per_adapter=PARAMS)
    with pytest.raises((ValueError, TypeError), match="MemoryProfiler: " + message):
        MemoryProfiler(**{**settings, **kwargs})
    assert calls == []


def test_a_cached_profile_is_not_measured_again(tmp_path):
    calls: list = []
    cache = MemoryFitCache(tmp_path)
    signature = {"model": "llama-8b", "seq_len": 1024, "gpu": "NVIDIA H200"}
    first = MemoryProfiler(h200_like(calls), CAPACITY, 1024, PARAMS).cached_profile(cache, signature)
    n_calls = len(calls)
    again = MemoryProfiler(h200_like(calls), CAPACITY, 1024, PARAMS).cached_profile(cache, signature)
    assert len(calls) == n_calls and isinstance(again, MemoryFit) and again.k1 == first.k1
    MemoryProfiler(h200_like(calls), CAPACITY, 1024, PARAMS).cached_profile(cache, dict(signature, gpu="H100"))
    assert len(calls) > n_calls  # another GPU: profiled


def test_throughput_is_measured_once_per_signature_and_gives_durations(tmp_path):
    runs: list[int] = []

    def run(steps: int) -> int:
        runs.append(steps)
        total = 0
        for _ in range(steps):
            total += sum(range(20000)) > 0  # some work per step
        return 8 * steps  # 8 samples per step

    profiler = ThroughputProfiler(tmp_path / "throughput.json", warmup_steps=1, steps=3)
    signature = {"model": "tiny-llama", "ranks": [4, 8], "batch_sizes": [2, 2]}
    d1 = profiler.duration(signature, 800, run)
    assert runs == [1, 3] and d1 > 0
    d2 = ThroughputProfiler(tmp_path / "throughput.json").duration(signature, 1600, run)
    assert runs == [1, 3] and d2 == pytest.approx(2 * d1)  # cached on disk
    with pytest.raises(ValueError, match="total_samples"):
        profiler.duration(signature, -1, run)
    with pytest.raises(RuntimeError, match="processed 0 samples"):
        profiler.measure({"other": 1}, lambda steps: 0)
    with pytest.raises(TypeError, match=r"`run\(steps\)` must return the number of samples it processed, got None"):
        profiler.measure({"other": 1}, lambda steps: None)  # (a TypeError comparing None with 0 before)


@pytest.mark.gpu
def test_cuda_step_measure_reads_real_peaks_of_a_training_step():
    import torch

    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.layer import inject_multilora
    from lightning_multilora.layout import BatchLayout
    from lightning_multilora.scheduling.profiler import cuda_step_measure

    model = build_base_model("tiny-llama").cuda()
    layers = inject_multilora(model, ["q_proj", "v_proj"])

    def step(n: int, b: int) -> None:
        names = [f"p{i}" for i in range(n)]
        for i, name in enumerate(names):
            layers.add_adapter(name, rank=8, alpha=16, seed=i)
        ids = torch.randint(258, (n * b, 256), device="cuda")
        with layers.use(BatchLayout.from_sizes(names, [b] * n)):
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        for name in names:
            layers.remove_adapter(name)

    measure = cuda_step_measure(step)
    small, large = measure(1, 1), measure(8, 4)
    assert 0 < small < large


def test_cuda_step_measure_reads_the_peak_of_the_step_after_its_warmup(monkeypatch):
    import torch

    from lightning_multilora.scheduling.profiler import cuda_step_measure

    peak = {"bytes": 0}
    steps: list[tuple[int, int]] = []

    def step(n: int, b: int) -> None:
        first = (n, b) not in steps
        steps.append((n, b))
        if b > 100:
            raise torch.cuda.OutOfMemoryError("out of memory")
        # a shape's first step also autotunes: a large timing buffer on top of the step's own peak
        peak["bytes"] = max(peak["bytes"], 1000 * n * b + (10**6 if first else 0))

    def reset(device=None) -> None:
        peak["bytes"] = 0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak["bytes"])
    measure = cuda_step_measure(step)
    assert measure(2, 4) == 8000 and steps == [(2, 4), (2, 4)]
    assert measure(1, 101) is None
    assert cuda_step_measure(step, warmup_steps=0)(3, 1) == 10**6 + 3000  # no warm-up: the tuning counts
    with pytest.raises(ValueError, match="warmup_steps"):
        cuda_step_measure(step, warmup_steps=-1)


def test_a_throughput_cache_cut_short_is_measured_again_and_written_whole(tmp_path, caplog, monkeypatch):
    """A cache file cut short (a killed run) raised a bare JSONDecodeError naming no file: it is said, naming the file,
    and measured again, as `MemoryFitCache` does; and a write that fails midway leaves the cache as it was (written
    beside it, then renamed into place), not a half-written file."""
    import json
    import logging
    from pathlib import Path

    path = tmp_path / "throughput.json"
    path.write_text('{"abc": {"samples_per_s": 3')
    runs = []
    profiler = ThroughputProfiler(path, warmup_steps=0, steps=1)
    with caplog.at_level(logging.WARNING, logger="lightning_multilora.scheduling.profiler"):
        assert profiler.duration({"model": "x"}, 10, lambda steps: runs.append(steps) or 5) > 0
    assert runs == [1] and f"throughput cache {path} does not read (JSONDecodeError" in caplog.text
    kept = path.read_text()
    assert len(json.loads(kept)) == 1 and not list(tmp_path.glob("*.partial"))

    def cut_short(self, text, *args, **kwargs):  # (the run killed halfway through writing)
        with open(self, "w") as fh:
            fh.write(text[: len(text) // 2])
        raise OSError("killed")

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(OSError, match="killed"):
        profiler.measure({"model": "y"}, lambda steps: 5)
    monkeypatch.undo()
    assert path.read_text() == kept and ThroughputProfiler(path).cached({"model": "x"}) is not None


@pytest.mark.parametrize("kwargs, said", [({"steps": 2.5}, "`steps` must be an integer >= 1, got 2.5"),
                                          ({"warmup_steps": "2"}, "`warmup_steps` must be an integer >= 0, got '2'"),
                                          ({"steps": 0}, "`steps` must be an integer >= 1, got 0")])
def test_throughput_profiler_steps_are_whole_numbers_named(tmp_path, kwargs, said):
    """``steps=2.5`` was taken, and ``warmup_steps="2"`` failed with a bare TypeError."""
    with pytest.raises(ValueError, match=rf"ThroughputProfiler: {re.escape(said)}"):
        ThroughputProfiler(tmp_path / "t.json", **kwargs)
