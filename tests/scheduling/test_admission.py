"""AdmissionController: decreasing batch sizes, same-size backfill, the memory budget; in a real fit."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.registry import AdapterState
from lightning_multilora.scheduling.admission import AdmissionController, choose_gradient_checkpointing, fit_predictor
from lightning_multilora.scheduling.memory import MemoryFit


def rows_times(per_row: float):
    """A memory model: ``per_row`` bytes per batch row (plus nothing else), for readable budgets."""
    return lambda specs: per_row * sum(s.batch_size for s in specs)


def spec(name: str, batch_size: int, **kw) -> AdapterSpec:
    return AdapterSpec(name, rank=2, batch_size=batch_size, **kw)


def test_admission_takes_the_largest_batch_sizes_first_while_they_fit():
    ctrl = AdmissionController(rows_times(100), capacity_bytes=1000, safety_margin=0.7)  # budget 700 = 7 rows
    queue = [spec("a", 1), spec("b", 4), spec("c", 2), spec("d", 4), spec("e", 1)]
    chosen = ctrl.select([], queue)
    assert [s.name for s in chosen] == ["b", "c", "a"]  # b (4), then d (4) would make 8 > 7; c (2); a (1)
    assert [s.name for s in ctrl.plan(queue)] == ["b", "c", "a"]
    # next to running adapters only the space left is used
    assert [s.name for s in ctrl.select([spec("r", 4)], queue)] == ["c", "a"]


def test_a_freed_slot_goes_to_the_same_batch_size_first_then_to_whatever_fits():
    ctrl = AdmissionController(rows_times(1), capacity_bytes=8, safety_margin=1.0)
    running = [spec("r1", 2), spec("r2", 4)]
    queue = [spec("big", 4), spec("one", 1), spec("two", 2)]
    assert [s.name for s in ctrl.select(running, queue, freed=spec("gone", 2))] == ["two"]  # 2+4+2 = 8
    assert [s.name for s in ctrl.select(running[:1], queue, freed=spec("gone", 1))] == ["one", "big"]  # 2+1+4 = 7
    assert [s.name for s in ctrl.select(running[:1], queue, freed=spec("gone", 8))] == ["big", "two"]  # mixed


def test_bad_budgets_and_empty_queues_are_clear_errors():
    with pytest.raises(ValueError, match=r"safety_margin.*\(0, 1\]"):
        AdmissionController(rows_times(1), 10, safety_margin=1.2)
    for capacity in (0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="AdmissionController: `capacity_bytes` must be a finite number of "
                                             "bytes > 0"):
            AdmissionController(rows_times(1), capacity)
    with pytest.raises(ValueError, match=r"`capacity_bytes` must be .*, got '80e9'"):  # (was a bare TypeError)
        AdmissionController(rows_times(1), "80e9")
    ctrl = AdmissionController(rows_times(100), capacity_bytes=150, safety_margin=1.0)
    with pytest.raises(ValueError, match="queue is empty"):
        ctrl.plan([])
    with pytest.raises(ValueError, match="not even one adapter fits: 'b' \\(batch_size=2\\)"):
        ctrl.plan([spec("a", 4), spec("b", 2)])


def test_fit_predictor_and_the_checkpointing_choice():
    fit = MemoryFit(k0=10.0, k1=1.0, k2=0.5)
    predict = fit_predictor(fit, seq_len=4, params_of=lambda s: 2 * s.rank)
    assert predict([spec("a", 2), spec("b", 1)]) == 10 + 1.0 * 3 * 4 + 0.5 * 8
    with_ckpt, without = rows_times(1), rows_times(3)
    assert choose_gradient_checkpointing([spec("a", 2)], with_ckpt, without, budget_bytes=6) is False
    assert choose_gradient_checkpointing([spec("a", 4)], with_ckpt, without, budget_bytes=6) is True
    with pytest.raises(ValueError, match="even with gradient checkpointing .*: admit fewer, or lower their batch"):
        choose_gradient_checkpointing([spec("a", 8)], with_ckpt, without, budget_bytes=6)
    for seq_len in (0, "1024"):  # (text was a bare TypeError)
        with pytest.raises(ValueError, match=f"fit_predictor: `seq_len` must be an integer >= 1, got {seq_len!r}"):
            fit_predictor(fit, seq_len, lambda s: 1)


def test_the_analytic_model_guards_a_fit_through_of_specs():
    """``beyond`` takes a function of specs: the analytic model's `of_specs` (each spec's targets, the default ones
    where it names none); the model itself is refused when the predictor is made, not at some later admission."""
    from lightning_multilora.scheduling.memory import PROJECTIONS, AnalyticMemoryModel, ModelShape

    analytic = AnalyticMemoryModel(ModelShape(num_layers=2, hidden=64, intermediate=128, num_heads=4, num_kv_heads=4,
                                              vocab_size=100))
    with pytest.raises(TypeError, match=r"`beyond` must be a function .* pass `analytic.of_specs\(seq_len, targets\)`"):
        fit_predictor(MemoryFit(0.0, 0.0, 0.0), 4, lambda s: 1, beyond=analytic)
    guard = analytic.of_specs(4, PROJECTIONS)
    specs = [spec("a", 2), AdapterSpec("b", rank=8, batch_size=1, target_modules=["q_proj"])]
    assert guard(specs) == analytic.predict([(2, 2, list(PROJECTIONS)), (8, 1, ["q_proj"])], 4)
    predict = fit_predictor(MemoryFit(0.0, 0.0, 0.0), 4, lambda s: 1, beyond=guard)  # nothing profiled: all beyond
    assert predict(specs) == guard(specs) > 0
    # the controller's own `predict` too (the model, or None, was taken and failed the fit with a bare TypeError)
    for bad, hint in ((analytic, r" \(an AnalyticMemoryModel: pass `analytic.of_specs"), (None, "$")):
        with pytest.raises(TypeError, match=r"AdmissionController: `predict` must be a function of a list of "
                                            rf"AdapterSpecs returning bytes, got {type(bad).__name__}{hint}"):
            AdmissionController(bad, 80e9)
    with pytest.raises(TypeError, match=r"`params_of` must be a function of an AdapterSpec"):
        fit_predictor(MemoryFit(0.0, 0.0, 0.0), 4, 100)
    # targets as the module takes them (its default "all-linear", a name, a regex), checked when the guard is made
    assert analytic.of_specs(4)(specs) == guard(specs)
    named = [AdapterSpec("c", rank=4, batch_size=1, target_modules="all-linear"),
             AdapterSpec("d", rank=4, batch_size=1)]
    # (an adapter's own targets choose among the module's: its "all-linear" is what the module wraps; counted alone
    # it came to 4.6 times the parameters it trains)
    assert analytic.of_specs(4, r".*\.(q|v)_proj")(named) == analytic.predict(
        [(4, 1, ("q_proj", "v_proj")), (4, 1, ("q_proj", "v_proj"))], 4)
    wider = [AdapterSpec("e", rank=4, batch_size=1, target_modules=["q_proj", "down_proj"])]
    assert analytic.of_specs(4, ["q_proj", "v_proj"])(wider) == analytic.predict([(4, 1, ("q_proj",))], 4)
    assert analytic.of_specs(4, ["self_attn.q_proj"])(named[1:]) == analytic.predict([(4, 1, ("q_proj",))], 4)
    assert analytic.of_specs(4, r".*layers\.1[0-9]\.mlp\..*")(named[1:]) == analytic.predict(
        [(4, 1, ("gate_proj", "up_proj", "down_proj"))], 4)  # (a regex of later layers: their projections)
    for targets, message in (("attn", r"`targets` 'attn' matches no projection of a Llama-style layer"),
                             (["a"], r"a target module can be q_proj, .*got \['a'\]")):
        with pytest.raises(ValueError, match=message):
            analytic.of_specs(4, targets)


def test_a_fit_admits_by_memory_and_backfills_same_batch_size(tmp_path, trainer_kwargs):
    from lightning_multilora.data import GeneratedArithmetic

    # budget: 4 rows. b1 and b3 (batch 2) start; b1's slot goes to b4 (its batch size) although b0 and b2
    # came first in the queue; when b3 leaves no batch-2 adapter is queued, so b0 and b2 share its slot.
    specs = [spec("b0", 1, max_steps=4), spec("b1", 2, max_steps=2), spec("b2", 1, max_steps=4),
             spec("b3", 2, max_steps=3), spec("b4", 2, max_steps=2)]
    ctrl = AdmissionController(rows_times(100), capacity_bytes=400, safety_margin=1.0)
    seen: list[frozenset] = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(frozenset(batch["layout"].names))

    module = MultiLoRAModule("tiny-llama", adapters=specs, admission=ctrl, export_dir=str(tmp_path),
                             validate_on_finish=False)
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, max_val_examples=8)
    L.Trainer(**trainer_kwargs, callbacks=[Watch()]).fit(module, dm)
    assert seen[:4] == [{"b1", "b3"}, {"b1", "b3"}, {"b3", "b4"}, {"b4", "b0", "b2"}]
    assert all(sum(module.registry[n].spec.batch_size for n in step) <= 4 for step in seen)
    assert all(r.state == AdapterState.FINISHED for r in module.registry)


def test_an_adapter_that_can_never_fit_fails_instead_of_waiting_forever(tmp_path, trainer_kwargs):
    """An adapter whose batch alone exceeds the budget would stay queued forever (the run stepping with nothing to
    train once the others end): before the first step it is the run's error; added mid-run it fails alone, with
    the numbers, and the run ends when the others have."""
    from lightning_multilora.data import GeneratedArithmetic

    ctrl = AdmissionController(rows_times(100), capacity_bytes=400, safety_margin=1.0)
    dm = lambda: MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, max_val_examples=8)  # noqa: E731
    module = MultiLoRAModule("tiny-llama", adapters=[spec("small", 1, max_steps=3), spec("big", 8, max_steps=3)],
                             admission=ctrl, export_dir=str(tmp_path / "a"), validate_on_finish=False)
    with pytest.raises(ValueError, match=r"'big' \(batch_size=8\) alone needs 0.8 KiB, the budget is 0.4 KiB "
                                         r"\(100% of 0.4 KiB\), so it can never start"):
        L.Trainer(**trainer_kwargs).fit(module, dm())

    class AddBig(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                pl_module.add_adapter(spec("big", 8, max_steps=3))

    module = MultiLoRAModule("tiny-llama", adapters=[spec("small", 1, max_steps=3)], admission=ctrl,
                             export_dir=str(tmp_path / "b"), validate_on_finish=False)
    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 50}, callbacks=[AddBig()])
    with pytest.warns(UserWarning, match="adapter 'big' could not start: .*so it can never start"):
        trainer.fit(module, dm())
    assert module.registry["big"].state == AdapterState.FAILED and "can never start" in module.registry["big"].reason
    assert module.registry["small"].state == AdapterState.FINISHED and trainer.global_step == 3


def sweep_specs(n=40, seed=0):
    import random

    rng = random.Random(seed)
    return [AdapterSpec(f"s{i}", rank=rng.choice([8, 16, 64]), batch_size=rng.choice([1, 2, 4, 8]),
                        max_steps=rng.choice([20, 50, 100])) for i in range(n)]


def test_cpsat_admission_fills_the_budget_at_least_as_well_as_greedy():
    from lightning_multilora.scheduling import CPSATAdmission

    fit = MemoryFit(k0=16e9, k1=3e5, k2=16.0)
    params_of = lambda s: 2_600_000 * s.rank  # noqa: E731 - an 8B-like adapter per rank unit
    greedy = AdmissionController(fit_predictor(fit, 1024, params_of), 141e9, 0.9)
    exact = CPSATAdmission(fit, 1024, params_of, 141e9, 0.9, time_limit_s=30.0)  # (an optimum, found in moments)
    specs = sweep_specs()
    g, c = greedy.select([], specs), exact.select([], specs)
    assert exact.fits(c) and greedy.fits(g)
    assert sum(s.batch_size for s in c) >= sum(s.batch_size for s in g)
    # next to running adapters, and preferring the freed batch size among equals
    running = c[:3]
    rest = [s for s in specs if s not in running]
    chosen = exact.select(running, rest, freed=rest[0])
    assert exact.fits([*running, *chosen])
    assert exact.select(running, []) == []


def test_cpsat_admission_puts_rows_before_the_freed_batch_size_before_priority_and_takes_the_guard():
    from lightning_multilora.scheduling import CPSATAdmission

    fit = MemoryFit(k0=0.0, k1=1.0, k2=0.0)  # a byte a token: room for 22 rows of one token
    small = [AdapterSpec(f"s{i}", batch_size=1) for i in range(21)]
    wide = AdapterSpec("wide", batch_size=22)
    # (the optimum, which CP-SAT proves in moments; within the default 0.5 s it did not on a loaded machine)
    exact = CPSATAdmission(fit, 1, lambda s: 0, 22.0, 1.0, priority=lambda s: 1.0 if s.name != "wide" else -1.0,
                           time_limit_s=30.0)
    assert exact.select([], [*small, wide], freed=small[0]) == [wide]  # 22 rows beat 21 with every bonus
    # the analytic guard past the profiled points (none here: every set is beyond), as AdmissionController's
    guarded = CPSATAdmission(fit, 1, lambda s: 0, 22.0, 1.0, time_limit_s=30.0,
                             beyond=lambda specs: 2.0 * sum(s.batch_size for s in specs))
    assert sum(s.batch_size for s in guarded.select([], small)) == 11
    with pytest.raises(ValueError, match="CPSATAdmission: `time_limit_s` must be a finite number of seconds > 0"):
        CPSATAdmission(fit, 1, lambda s: 0, 22.0, time_limit_s=float("nan"))


def test_cpsat_admission_never_admits_fewer_rows_than_greedy_where_the_guard_refuses_its_choice():
    """The guard (``beyond``) refused the set CP-SAT chose on the fit's costs, and popping its smallest adapters left
    none: 0 rows where the greedy order admits 6."""
    from lightning_multilora.scheduling import CPSATAdmission, MemoryPoint

    fit = MemoryFit(k0=0.0, k1=1.0, k2=0.0, points=[MemoryPoint(1, 1, 1, 0, 1.0)])  # (every set past the point)
    big, small = AdapterSpec("big", rank=64, batch_size=4), [AdapterSpec(f"s{i}", batch_size=2) for i in range(3)]

    def beyond(specs):  # the analytic model: a rank-64 adapter's weights are 50 bytes here
        return sum(s.batch_size for s in specs) + 50.0 * sum(s.rank == 64 for s in specs)

    exact = CPSATAdmission(fit, 1, lambda s: 0, 10.0, 1.0, beyond=beyond, time_limit_s=30.0)
    greedy = AdmissionController(exact.predict, 10.0, 1.0)
    assert [s.name for s in greedy.select([], [big, *small])] == ["s0", "s1", "s2"]
    assert [s.name for s in exact.select([], [big, *small])] == ["s0", "s1", "s2"]


def test_an_analytic_model_of_another_base_than_the_modules_is_warned_of(tmp_path, trainer_kwargs):
    """`AnalyticMemoryModel`'s defaults are a bf16 base with gradient checkpointing; the module's, float32 without:
    admission on them admitted several times what fits (38 adapters where 6 fit, on an 8B shape). `of_module`
    describes the module's base as it was built: its weights measured, its checkpointing, its dtype."""
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.scheduling import AnalyticMemoryModel, ModelShape

    def fit(module):
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40)}, max_val_examples=4)
        L.Trainer(**{**trainer_kwargs, "max_steps": 1}).fit(module, dm)

    specs = [spec("a", 1, max_steps=1)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    base = module.model
    measured = AnalyticMemoryModel.of_module(module)
    assert measured.base_bytes() == sum(p.numel() * 4 for p in base.parameters()) + sum(
        b.numel() * b.element_size() for b in base.buffers())
    assert (measured.activation_bytes, measured.gradient_checkpointing) == (4.0, False)
    assert measured.shape == ModelShape.from_config(base.config)
    checked = AnalyticMemoryModel.of_module(MultiLoRAModule("tiny-llama", dtype="bfloat16",
                                                            gradient_checkpointing=True))
    assert (checked.activation_bytes, checked.gradient_checkpointing) == (2.0, True)
    assert checked.base_bytes() < 0.51 * measured.base_bytes()

    module.admission = AdmissionController(AnalyticMemoryModel(measured.shape).of_specs(32), 2**30)
    with pytest.warns(UserWarning, match=r"the admission controller's AnalyticMemoryModel does not describe this "
                                         r"module's base: it counts 209.* KiB of base weights, the base holds "
                                         r"418.* KiB; its gradient_checkpointing is on, the base's off; its "
                                         r"activation_bytes is 2, the base computes in 4-byte values\. "
                                         r".*AnalyticMemoryModel.of_module"):
        fit(module)
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    fit_of = MemoryFit(k0=0.0, k1=1.0, k2=0.0)  # (as `fit_predictor`'s guard too)
    module.admission = AdmissionController(fit_predictor(fit_of, 32, lambda s: 0, beyond=AnalyticMemoryModel.of_module(
        module).of_specs(32)), 2**30)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*AnalyticMemoryModel does not describe")
        fit(module)
    # each fit checks its own controller (another fit of the module, here with one of a bf16 base)
    module.add_adapter(spec("b", 1, max_steps=1))
    module.admission = AdmissionController(AnalyticMemoryModel(measured.shape, gradient_checkpointing=False,
                                                               activation_bytes=4.0).of_specs(32), 2**30)
    with pytest.warns(UserWarning, match=r"it counts 209.* KiB of base weights, the base holds 418.* KiB\. It may"):
        fit(module)
    module.config = {"not": "a Hugging Face config"}  # (a module's own attribute: its base is measured still)
    assert AnalyticMemoryModel.of_module(module).base_bytes() == measured.base_bytes()


def test_an_analytic_model_of_a_hugging_face_model_counts_its_weights_as_loaded():
    """`of_module` of a Hugging Face model, as one is loaded before the module that will hold it (every parameter
    trainable): it counted the tensors that need no gradient alone, the rotary frequencies (64 bytes of a 418 KiB
    base), and took their float32 for a bf16 base's dtype; admission then left the base out of its budget."""
    import torch

    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.scheduling import AnalyticMemoryModel

    module = AnalyticMemoryModel.of_module(MultiLoRAModule("tiny-llama", dtype="bfloat16"))
    model = build_base_model("tiny-llama").to(torch.bfloat16)
    assert all(p.requires_grad for p in model.parameters())
    loaded = AnalyticMemoryModel.of_module(model)
    assert loaded.base_bytes() == module.base_bytes() > 200_000
    assert loaded.activation_bytes == module.activation_bytes == 2.0
    peft = pytest.importorskip("peft")  # a PEFT model's own adapters are not base weights
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert AnalyticMemoryModel.of_module(wrapped).base_bytes() == module.base_bytes()


def test_the_simulated_sweep_compares_admission_policies():
    from lightning_multilora.scheduling import CPSATAdmission, simulate_sweep

    fit = MemoryFit(k0=16e9, k1=3e5, k2=16.0)
    params_of = lambda s: 2_600_000 * s.rank  # noqa: E731
    step = lambda specs: 0.12 + 0.02 * sum(s.batch_size for s in specs)  # noqa: E731
    specs = sweep_specs(30, seed=3)
    results = {name: simulate_sweep(ctrl, specs, step, 1024) for name, ctrl in (
        ("greedy", AdmissionController(fit_predictor(fit, 1024, params_of), 141e9, 0.9)),
        ("cpsat", CPSATAdmission(fit, 1024, params_of, 141e9, 0.9)))}
    for r in results.values():
        assert r["makespan_s"] > 0 and r["max_running"] >= r["mean_running"] > 1
    tiny = AdmissionController(rows_times(1), 1, safety_margin=1.0)
    with pytest.raises(ValueError, match="never fit the memory budget"):
        simulate_sweep(tiny, specs[:2], step, 1024)


def run_admitted(out, trainer_kwargs, stop_at=None, ckpt=None):
    from lightning_multilora.data import GeneratedArithmetic

    # b4 (batch 2) takes b1's slot at step 2 ahead of b0 and b2: the optimizer's group order differs from the
    # registry's, and a resume must still give every adapter its own optimizer state
    specs = [spec("b0", 1, max_steps=6, lr=1e-2), spec("b1", 2, max_steps=2, lr=1e-2),
             spec("b2", 1, max_steps=6, lr=1e-2), spec("b3", 2, max_steps=3, lr=1e-2),
             spec("b4", 2, max_steps=7, lr=1e-2)]
    ctrl = AdmissionController(rows_times(100), capacity_bytes=400, safety_margin=1.0)
    module = MultiLoRAModule("tiny-llama", adapters=specs, admission=ctrl, export_dir=str(out),
                             validate_on_finish=False)
    kwargs = dict(trainer_kwargs, max_steps=stop_at) if stop_at is not None else dict(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, padding="max_length",
                                            max_length=96, max_val_examples=8), ckpt_path=ckpt)
    return trainer, module


def test_resume_keeps_each_adapters_optimizer_state_whatever_the_admission_order(tmp_path, trainer_kwargs):
    import torch
    from safetensors.torch import load_file

    _, full = run_admitted(tmp_path / "full", trainer_kwargs)
    trainer, part = run_admitted(tmp_path / "part", trainer_kwargs, stop_at=4)
    groups = [g["adapter"] for g in trainer.optimizers[0].param_groups]
    assert groups != sorted(groups)  # admission order, not registry order
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    _, resumed = run_admitted(tmp_path / "part", trainer_kwargs, ckpt=str(tmp_path / "mid.ckpt"))
    for name in ("b0", "b2", "b4"):
        a = load_file(tmp_path / "full" / name / "adapter_model.safetensors")
        b = load_file(tmp_path / "part" / name / "adapter_model.safetensors")
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_a_never_fitting_adapter_does_not_take_the_freed_slots_preference():
    """The slot an exited adapter freed goes first to its batch size; an adapter failed at the same admission for
    never fitting freed no slot, and must not replace that preference."""
    freed_seen = []

    class Recording(AdmissionController):
        def select(self, running, candidates, freed=None):
            freed_seen.append(None if freed is None else freed.name)
            return super().select(running, candidates, freed)

    module = MultiLoRAModule("tiny-llama", adapters=[spec("run", 1, max_steps=5)],
                             admission=Recording(rows_times(100), 500, safety_margin=1.0))
    from lightning_multilora.data import GeneratedArithmetic

    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(20)})
    module._datamodule = lambda *use: dm  # (no Trainer: the admission alone)
    module._global_step = lambda: 7  # mid-run: the never-fitting adapter fails alone
    module._admit()
    module._freed_spec = spec("exited", 1)
    for name, batch in (("big", 8), ("q2", 2), ("q1", 1)):
        module.add_adapter(spec(name, batch, max_steps=5))
    with pytest.warns(UserWarning, match="'big' could not start"):
        module._admit()
    assert freed_seen[-1] == "exited" and module.registry["big"].state == AdapterState.FAILED


def test_an_admission_that_is_not_a_controller_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"`admission` must be an AdmissionController .* got 12 \(no fits, select, "
                                         r"alone\)"):
        MultiLoRAModule("tiny-llama", adapters=[], admission=12)


def test_paused_adapters_count_against_the_budget_and_never_block_every_start(tmp_path, trainer_kwargs):
    """A paused adapter (WarmupSelection's, waiting for the selection) keeps its weights and optimizer state, but the
    controller weighed candidates beside the running adapters alone: as many more started as paused, past the
    budget. They count now (`PausedSpec`: no rows); where they leave room for none, one starts anyway, warned of."""
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.module import PausedSpec

    def fit(per_adapter, specs, pause_at, resume_at):
        # a memory model: `per_adapter` bytes an adapter held (weights, optimizer state), 100 a batch row
        ctrl = AdmissionController(lambda specs: sum(per_adapter + 100 * s.batch_size for s in specs), 400, 1.0)
        seen: list[frozenset] = []

        class PauseA(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append(frozenset(batch["layout"].names))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == pause_at:
                    pl_module.pause_adapter("a")
                if trainer.global_step == resume_at:
                    pl_module.resume_adapter("a")

        module = MultiLoRAModule("tiny-llama", adapters=specs, admission=ctrl, validate_on_finish=False,
                                 export_dir=str(tmp_path / str(per_adapter)))
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, max_val_examples=8)
        L.Trainer(**trainer_kwargs, callbacks=[PauseA()]).fit(module, dm)
        assert all(r.state == AdapterState.FINISHED for r in module.registry)
        return seen

    # a and b (200 each) fill the 400; a paused still holds 100, so c waits for b to end
    seen = fit(100, [spec("a", 1, max_steps=3), spec("b", 1, max_steps=3), spec("c", 1, max_steps=2)], 1, 5)
    assert seen == [{"a", "b"}, {"b"}, {"b"}, {"c"}, {"c"}, {"a"}, {"a"}]
    # a paused (300) leaves no room for c (400) beside it: c starts anyway, nothing else could
    with pytest.warns(UserWarning, match=r"the 1 paused adapters \('a'\) hold weights and optimizer states that "
                                         r"leave no room.*'c' starts anyway"):
        seen = fit(300, [spec("a", 1, max_steps=3), spec("c", 1, max_steps=2)], 1, 3)
    assert seen == [{"a"}, {"c"}, {"c"}, {"a"}, {"a"}]
    paused = PausedSpec(spec("p", 4, max_steps=3))
    assert (paused.rows_per_step, paused.batch_size, paused.rank, paused.name) == (0, 0, 2, "p")
    import copy
    import pickle

    for again in (copy.deepcopy(paused), pickle.loads(pickle.dumps(paused))):  # (a RecursionError)
        assert again.spec == paused.spec and again.rows_per_step == 0


def test_a_safety_margin_given_as_text_is_refused_naming_the_field():
    """``safety_margin="0.9"`` raised a bare TypeError ('<' not supported between 'float' and 'str')."""
    for margin in ("0.9", None, True, float("nan")):
        with pytest.raises(ValueError, match=r"AdmissionController: `safety_margin` must be the usable fraction of "
                                             r"device memory, a number in \(0, 1\], got "):
            AdmissionController(rows_times(1), 10, safety_margin=margin)


def test_resuming_paused_adapters_counts_the_paused_ones_left_waiting():
    """`startable` (WarmupSelection's resume of its kept adapters) left every paused adapter it was asked about out of
    the count, those it then left paused too: their weights and optimizer states, still held, were over the budget
    by one adapter per one waiting (17 of 16 here)."""
    def held_plus_rows(specs):  # 3 a held adapter (weights, optimizer states), 1 a row (a paused one has none)
        return sum(3 + s.batch_size for s in specs)

    module = MultiLoRAModule("tiny-llama", adapters=[spec("r", 3, max_steps=50)] +
                             [spec(f"p{i}", 1, max_steps=50) for i in (1, 2, 3)],
                             admission=AdmissionController(held_plus_rows, capacity_bytes=100, safety_margin=1.0))
    from lightning_multilora.data import GeneratedArithmetic

    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(20)})
    module._datamodule = lambda *use: dm  # (no Trainer: the admission alone)
    module._global_step = lambda: 7
    module._admit()
    for name in ("p1", "p2", "p3"):
        module.pause_adapter(name, "warmed up")
    module.admission = AdmissionController(held_plus_rows, capacity_bytes=16, safety_margin=1.0)
    assert held_plus_rows(module._resident()) == 15
    chosen = module.startable([module.registry[n].spec for n in ("p1", "p2", "p3")])
    assert [s.name for s in chosen] == ["p1"]
    for s in chosen:
        module.resume_adapter(s.name)
    assert held_plus_rows(module._resident()) == 16


def test_an_adapter_that_cannot_start_gives_its_share_of_the_budget_back_at_once(trainer_kwargs):
    """The admission chose before the start checks: an adapter added with a misspelt `dataset` took its share of the
    budget, failed, and the one that would have fitted instead waited a step (the freed slot's preference lost)."""
    from lightning_multilora.data import GeneratedArithmetic

    class Add(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                pl_module.add_adapter(spec("bad", 2, max_steps=3, dataset="nope"))
                pl_module.add_adapter(spec("good", 2, max_steps=3))

    module = MultiLoRAModule("tiny-llama", adapters=[spec("r", 2, max_steps=6)], validate_on_finish=False,
                             admission=AdmissionController(rows_times(100), capacity_bytes=400, safety_margin=1.0))
    with pytest.warns(UserWarning, match=r"adapter 'bad' could not start: adapter `dataset` 'nope' is not a data"):
        L.Trainer(**trainer_kwargs, callbacks=[Add()]).fit(
            module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    assert module.registry["bad"].state == AdapterState.FAILED
    assert (module.registry["good"].started_at_step, module.registry["good"].state) == (1, AdapterState.FINISHED)


def test_a_resume_under_a_lower_budget_than_its_adapters_take_is_said(tmp_path, trainer_kwargs):
    """Resumed with a budget under what its running adapters take, they went on without a word."""
    from lightning_multilora.data import GeneratedArithmetic

    def module_of(capacity: float) -> MultiLoRAModule:
        return MultiLoRAModule("tiny-llama", validate_on_finish=False,
                               adapters=[spec("a", 4, max_steps=4), spec("b", 4, max_steps=4)],
                               admission=AdmissionController(rows_times(100), capacity_bytes=capacity,
                                                             safety_margin=1.0))

    def data() -> MultiLoRADataModule:
        return MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)})

    trainer = L.Trainer(**{**trainer_kwargs, "max_steps": 2})
    trainer.fit(module_of(800), data())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = module_of(600)
    with pytest.warns(UserWarning, match=r"resumed with adapters \['a', 'b'\] training \(and 0 paused\): .* "
                                         r"predicted, over the admission budget of .*; they train anyway"):
        L.Trainer(**trainer_kwargs).fit(resumed, data(), ckpt_path=tmp_path / "two.ckpt")
    assert [resumed.registry[n].step for n in "ab"] == [4, 4]
    with warnings.catch_warnings(record=True) as caught:  # (a validate trains nothing: nothing to say)
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).validate(module_of(600), data(), ckpt_path=tmp_path / "two.ckpt")
    assert not [w for w in caught if "train anyway" in str(w.message)]

    class AtMostOne:  # (a controller of the user's: fits / select / alone, as the module's docstring allows)
        def fits(self, specs):
            return len(specs) <= 1

        def select(self, running, candidates, freed=None):
            return [] if running else list(candidates[:1])

        def alone(self, spec):
            return None

    resumed = MultiLoRAModule("tiny-llama", validate_on_finish=False, admission=AtMostOne(),
                              adapters=[spec("a", 4, max_steps=4), spec("b", 4, max_steps=4)])
    # (it failed: "'AtMostOne' object has no attribute 'predict'")
    with pytest.warns(UserWarning, match=r"resumed with adapters \['a', 'b'\] training \(and 0 paused\): over the "
                                         r"budget of the admission controller AtMostOne \(its `fits` says no\); they "
                                         r"train anyway"):
        L.Trainer(**trainer_kwargs).fit(resumed, data(), ckpt_path=tmp_path / "two.ckpt")
    assert [resumed.registry[n].step for n in "ab"] == [4, 4]


def test_an_adapter_waiting_for_a_slot_is_checked_at_its_own_start(tmp_path, trainer_kwargs):
    """The re-selection checked every adapter the budget chose, those `max_running` kept waiting too: one added to go
    on from another's export (`init_from` a folder written when that one finishes) failed before it could start."""
    from lightning_multilora.data import GeneratedArithmetic

    class Chain(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                pl_module.add_adapter(AdapterSpec("B", rank=2, alpha=4, batch_size=1, max_steps=2,
                                                  init_from=str(tmp_path / "out" / "A")))

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("A", rank=2, alpha=4, batch_size=1, max_steps=4)],
                             max_running=1, export_dir=str(tmp_path / "out"), validate_on_finish=False,
                             admission=AdmissionController(rows_times(1), capacity_bytes=1000, safety_margin=1.0))
    L.Trainer(**trainer_kwargs, callbacks=[Chain()]).fit(
        module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    b = module.registry["B"]
    assert (b.state, b.started_at_step, b.step) == (AdapterState.FINISHED, 4, 2)
