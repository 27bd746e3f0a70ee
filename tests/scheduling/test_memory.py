"""Memory models against peaks measured on the H200 (tests/scheduling/fixtures, from packed_step.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lightning_multilora.scheduling.memory import (
    PROJECTIONS,
    AnalyticMemoryModel,
    MemoryFit,
    MemoryFitCache,
    MemoryPoint,
    ModelShape,
)

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "h200_llama8b_peaks.json").read_text())
SHAPE = ModelShape.from_config(FIXTURE["config"])
GIB = 2**30


def measured_points() -> list[MemoryPoint]:
    return [MemoryPoint(p["n_adapters"], p["batch_size"], p["seq_len"],
                        p["n_adapters"] * SHAPE.adapter_params(p["rank"]), p["peak_gib"] * GIB)
            for p in FIXTURE["points"]]


def test_model_shape_counts_llama_8b_parameters():
    assert SHAPE.adapter_params(16) == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)  # q,o / k,v / gate,up,down
    assert SHAPE.adapter_params(16, ["q_proj", "v_proj"]) == 32 * 16 * (8192 + 5120)
    assert abs(SHAPE.base_params / 8.03e9 - 1) < 0.005
    # a tied output head is the input embedding: counted once (Llama-3.2-1B: 1.24e9, not 1.50e9)
    from transformers import LlamaConfig

    tied = ModelShape.from_config(LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                              head_dim=64, tie_word_embeddings=True))
    assert tied.tied_embeddings and abs(tied.base_params / 1.2358e9 - 1) < 0.005
    with pytest.raises(ValueError, match="target module can be q_proj"):
        SHAPE.projection("mlp")
    for value in (0, 2.5, "2"):  # (a string: a bare TypeError; 2.5 was taken)
        with pytest.raises(ValueError, match=rf"ModelShape: `hidden` must be an integer >= 1, got {value!r}"):
            ModelShape(2, value, 8, 2, 2, 10)


def test_the_analytic_model_is_within_12_percent_of_the_measured_peaks():
    model = AnalyticMemoryModel(SHAPE, loss_chunk_tokens=4096)  # the benchmark's chunked loss
    for p in FIXTURE["points"]:
        predicted = model.predict([(p["rank"], p["batch_size"], PROJECTIONS)] * p["n_adapters"], p["seq_len"])
        assert abs(predicted / (p["peak_gib"] * GIB) - 1) < 0.12, p


def test_the_analytic_model_grows_with_adapters_batch_and_rank_and_checkpointing_saves_memory():
    model = AnalyticMemoryModel(SHAPE)
    one = model.predict([(16, 1, PROJECTIONS)], 1024)
    assert model.predict([(16, 1, PROJECTIONS)] * 2, 1024) > one
    assert model.predict([(16, 2, PROJECTIONS)], 1024) > one
    assert model.predict([(64, 1, PROJECTIONS)], 1024) > one
    # (one string of targets was read letter by letter: "got 'a'")
    assert model.predict([(16, 1, "all-linear")], 1024) == one
    assert model.predict([(16, 1, "q_proj")], 1024) == model.predict([(16, 1, ("q_proj",))], 1024) < one
    # (a list was taken as given: "all-linear" and "self_attn.q_proj" in one refused, a name given twice counted
    # twice; `adapter_bytes` and `adapter_params` read one string letter by letter)
    assert model.predict([(16, 1, ["all-linear"])], 1024) == one
    assert model.predict([(16, 1, ["self_attn.q_proj", "q_proj"])], 1024) == model.predict([(16, 1, ["q_proj"])], 1024)
    assert model.adapter_bytes(16, "all-linear") == model.adapter_bytes(16)
    assert SHAPE.adapter_params(16, "q_proj") == SHAPE.adapter_params(16, ["q_proj"])
    for targets in (None, []):
        with pytest.raises(ValueError, match=r"AnalyticMemoryModel.predict: adapter #0's targets"):
            model.predict([(16, 1, targets)], 1024)
    without = AnalyticMemoryModel(SHAPE, gradient_checkpointing=False)
    assert without.predict([(16, 8, PROJECTIONS)], 1024) > model.predict([(16, 8, PROJECTIONS)], 1024)
    # bf16 activations: the kernels' bf16 copy of fp32 adapters; fp32 activations read the adapters as they are
    params = SHAPE.adapter_params(16)
    assert model.adapter_bytes(16) == params * (4 * 4 + 2)
    assert AnalyticMemoryModel(SHAPE, activation_bytes=4.0).adapter_bytes(16) == params * 4 * 4


def test_the_analytic_model_counts_the_low_rank_intermediates_as_the_kernels_keep_them():
    """One S a targeted projection and layer: every token of the batch, as wide as the widest rank there rounded up
    to 16 (a rank-8 adapter beside a rank-100 one keeps 112 columns too; another adapter's tokens are rows of it)."""
    model = AnalyticMemoryModel(SHAPE)
    adapters = [(8, 1, ["q_proj"]), (100, 2, ["q_proj", "v_proj"])]
    tokens = 3 * 10
    expected = (model.base_bytes() + model.adapter_bytes(8, ["q_proj"]) + model.adapter_bytes(100, ["q_proj", "v_proj"])
                + model.activations(tokens, tokens * (112 + 112)))
    assert model.predict(adapters, 10) == pytest.approx(expected)
    rank_2 = model.base_bytes() + model.adapter_bytes(2, ["q_proj"]) + model.activations(10, 10 * 16)
    assert model.predict([(2, 1, ["q_proj"])], 10) == pytest.approx(rank_2)  # (16 columns for a rank of 2)
    # a paused adapter (no rows: `PausedSpec`) holds its weights and optimizer state, and widens no S (it was refused,
    # "`batch_size` must be an integer >= 1, got 0", and stopped every fit where one paused under this model)
    paused = model.predict([(2, 1, ["q_proj"]), (100, 0, ["q_proj"])], 10)
    assert paused == pytest.approx(rank_2 + model.adapter_bytes(100, ["q_proj"]))
    from lightning_multilora import AdapterSpec
    from lightning_multilora.module import PausedSpec

    of_specs = model.of_specs(10, ["q_proj"])
    assert of_specs([AdapterSpec("a", rank=2, batch_size=1), PausedSpec(AdapterSpec("p", rank=100))]) == paused


def test_the_fit_recovers_a_linear_law_and_fits_the_measured_peaks():
    law = lambda tokens, params: 15e9 + 3e5 * tokens + 16 * params  # noqa: E731
    synthetic = [MemoryPoint(n, b, 512, n * 1000, law(n * b * 512, n * 1000)) for n, b in [(1, 1), (2, 4), (8, 1), (4, 2)]]
    fit = MemoryFit.fit(synthetic)
    assert fit.k0 == pytest.approx(15e9) and fit.k1 == pytest.approx(3e5) and fit.k2 == pytest.approx(16)
    real = measured_points()
    fit = MemoryFit.fit(real)
    assert fit.k1 > 0 and fit.k2 > 0  # memory grows with tokens and with adapter parameters
    # These b=1 points mix seq 256 and 1024 (one line cannot hold both exactly): 6.5% RMS, 14.5% worst.
    errors = fit.relative_errors(real)
    assert (sum(e * e for e in errors) / len(errors)) ** 0.5 < 0.07 and max(errors) < 0.16
    with pytest.raises(ValueError, match=">= 3 measured points"):
        MemoryFit.fit(real[:2])


def test_a_fit_with_a_fixed_adapter_set_falls_back_to_altos_line():
    points = [MemoryPoint(4, b, 256, 4000, 1e9 + 100 * b * 1024) for b in (1, 2, 4)]
    with pytest.warns(UserWarning, match="same adapter parameters .P = 4000.: the fit is ALTO's k0 "):
        fit = MemoryFit.fit(points)  # P is the same at every point (rank-deficient): ALTO's k0 + k1*B*L
    assert max(fit.relative_errors(points)) < 1e-9
    # (adapters of batch 1, 1, 2 and 4 at a time: P grows with B*L, k2 unmeasurable; it was dropped silently)
    together = [MemoryPoint(n, 1, 256, 4000 * n, 1e9 + 100 * n * 256 + 50 * 4000 * n) for n in (1, 2, 4)]
    with pytest.warns(UserWarning, match=r"adapter parameters follow its tokens \(B\*L\) on one line, so the fit "
                                         r"cannot tell their costs apart: it is ALTO's k0 \+ k1\*B\*L"):
        fit = MemoryFit.fit(together)
    assert fit.k2 == 0.0 and max(fit.relative_errors(together)) < 1e-9
    same_tokens = [MemoryPoint(1, 2, 256, 4000 * r, 1e9 + 5000 * r) for r in (1, 2, 4)]  # (ranks differ)
    with pytest.raises(ValueError, match=r"points of different tokens \(B\*L\): all 3 have 512"):
        MemoryFit.fit(same_tokens)


def test_the_cache_returns_a_fit_only_for_its_own_signature(tmp_path, caplog):
    cache = MemoryFitCache(tmp_path)
    signature = dict(model="llama-8b", dtype="bfloat16", seq_len=1024, ranks=[16], targets=list(PROJECTIONS),
                     checkpointing=True, gpu="NVIDIA H200")
    assert cache.load(signature) is None
    fit = MemoryFit.fit(measured_points(), signature)
    path = cache.save(fit)
    loaded = cache.load(signature)
    assert loaded is not None and loaded.k1 == fit.k1 and loaded.points == fit.points
    assert cache.load(dict(signature, gpu="NVIDIA H100")) is None  # another GPU: profile again
    # a file that claims another signature is not trusted
    data = json.loads(path.read_text())
    data["signature"]["model"] = "other"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        assert cache.load(signature) is None
    assert "profiling again" in caplog.text
    # a file cut short (a run killed as it wrote, before saves were renamed into place whole): profiled again
    path.write_text(path.read_text()[:40])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert cache.load(signature) is None
    assert "does not read (JSONDecodeError" in caplog.text
    assert cache.save(fit) == path and cache.load(signature).k1 == fit.k1
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # (no partial file left)


GRID = json.loads((Path(__file__).parent / "fixtures" / "h200_llama8b_grid_seq1024.json").read_text())


def grid_points(key: str) -> list[MemoryPoint]:
    entries = GRID[key] if isinstance(GRID[key], list) else [GRID[key]]
    return [MemoryPoint(p["n_adapters"], p["batch_size"], GRID["seq_len"],
                        p["n_adapters"] * SHAPE.adapter_params(GRID["rank"]), p["peak_gib"] * GIB) for p in entries]


def test_the_fit_of_a_real_h200_grid_predicts_held_back_points_and_the_analytic_model_guards_beyond_it():
    from lightning_multilora.scheduling import fit_predictor
    from lightning_multilora.spec import AdapterSpec

    fit = MemoryFit.fit(grid_points("grid"))
    held = grid_points("held_back")
    errors = fit.relative_errors(held)
    assert max(errors) < 0.06 and sum(errors) / len(errors) < 0.025  # measured: 0.7-5.6%, mean 2.2%
    # 122 adapters at seq 1024, three times the largest profiled batch: the line alone under-predicts ...
    run = GRID["admitted_run"]
    measured = run["peak_gib"] * GIB
    specs = [AdapterSpec(f"a{i}", rank=GRID["rank"], batch_size=1) for i in range(run["n_adapters"])]
    params_of = lambda spec: SHAPE.adapter_params(spec.rank)  # noqa: E731
    alone = fit_predictor(fit, GRID["seq_len"], params_of)(specs)
    assert alone < measured
    # ... (and would more with plain least squares) ...
    import numpy as np

    x = np.array([[1.0, p.tokens, p.adapter_params] for p in fit.points])
    plain = MemoryFit(*map(float, np.linalg.lstsq(x, np.array([p.peak_bytes for p in fit.points]), rcond=None)[0]))
    assert plain.relative_errors(grid_points("admitted_run"))[0] > fit.relative_errors(grid_points("admitted_run"))[0]
    # ... and with the analytic model as the guard beyond the profiled points it is not under-predicted.
    analytic = AnalyticMemoryModel(SHAPE, loss_chunk_tokens=4096)
    guard = lambda ss: analytic.predict([(s.rank, s.batch_size, PROJECTIONS) for s in ss], GRID["seq_len"])  # noqa: E731
    guarded = fit_predictor(fit, GRID["seq_len"], params_of, beyond=guard)
    assert guarded(specs) >= measured
    inside = specs[:3]  # inside the profiled range the fit alone decides
    assert guarded(inside) == fit_predictor(fit, GRID["seq_len"], params_of)(inside)


def test_a_fit_refuses_non_positive_peaks():
    points = [MemoryPoint(1, b, 256, 1000, 1e9 * b) for b in (1, 2, 4)]
    with pytest.raises(ValueError, match="positive"):
        MemoryFit.fit(points + [MemoryPoint(2, 1, 256, 2000, 0.0)])
    for peak in (float("nan"), float("inf")):  # (a NaN one gave numpy's LinAlgError)
        with pytest.raises(ValueError, match=r"finite positive byte counts, got peak_bytes=(nan|inf) at n_adapters=2"):
            MemoryFit.fit(points + [MemoryPoint(2, 1, 256, 2000, peak)])


@pytest.mark.gpu
def test_the_modules_loss_takes_the_bytes_per_token_and_vocabulary_entry_the_model_counts():
    """The module's loss over bf16 logits (`_row_token_loss`, forward and backward) at its peak, against what the
    analytic model counts for a loss over all tokens at once: the logits, their fp32 log-softmax and the backward's
    fp32 gradients (it counted 4 bytes, a third of what the loss took)."""
    import torch

    from lightning_multilora.module import _row_token_loss

    rows, length, vocab = 8, 512, 32000
    logits = torch.randn(rows, length, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, length), device="cuda")
    labels[:, : length // 4] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _row_token_loss(logits, labels)[0].sum().backward()
    torch.cuda.synchronize()
    taken = (torch.cuda.max_memory_allocated() - before + logits.numel() * 2) / (rows * length * vocab)
    model = AnalyticMemoryModel(ModelShape(num_layers=1, hidden=64, intermediate=64, num_heads=1, num_kv_heads=1,
                                           vocab_size=vocab))
    counted = model.activations(rows * length) / (rows * length * vocab)  # (the tiny layers' share: 0.06 bytes)
    assert taken == pytest.approx(counted, rel=0.15)



@pytest.mark.parametrize("call, message", [
    (lambda m: m.predict([(16, -4, PROJECTIONS)], 1024), r"adapter #0: `batch_size` must be an integer >= 0, got -4"),
    (lambda m: m.predict([(8, 1, PROJECTIONS), (-8, 1, PROJECTIONS)], 1024),
     r"adapter #1: `rank` must be an integer >= 1, got -8"),
    (lambda m: m.predict([(16, 1, PROJECTIONS)], 0), r"predict: `seq_len` must be an integer >= 1, got 0"),
    (lambda m: m.predict([(16, 1, PROJECTIONS)], -5), r"`seq_len` must be an integer >= 1, got -5"),
    (lambda m: m.predict([(16, 1)], 1024), r"adapter #0 must be \(rank, batch_size, targets\)"),
    (lambda m: m.adapter_bytes(0), r"adapter_bytes: `rank` must be an integer >= 1, got 0"),
])
def test_the_analytic_model_refuses_batches_ranks_and_lengths_below_one(call, message):
    """A batch of 0 predicted the base and the adapter, -4 a smaller peak, a negative rank or length went through."""
    with pytest.raises(ValueError, match=message):
        call(AnalyticMemoryModel(SHAPE))


@pytest.mark.parametrize("field, value, message", [
    ("base_bytes_per_param", -2, r"`base_bytes_per_param` must be a finite number of bytes > 0"),
    ("adapter_bytes_per_param", 0, r"`adapter_bytes_per_param` must be a finite number of bytes > 0"),
    ("activation_bytes", "2", r"`activation_bytes` must be a finite number of bytes > 0"),
    ("optimizer_states", -1, r"`optimizer_states` must be a number of states an adapter parameter's size each >= 0 "
                             r"\(2 for AdamW; 0.5 for an 8-bit AdamW's .*got -1"),
    ("base_weight_bytes", 0, r"`base_weight_bytes` must be a finite number of bytes > 0, or None"),
    ("loss_chunk_tokens", 0, r"`loss_chunk_tokens` must be an integer >= 1 or None, got 0"),
    ("gradient_checkpointing", "yes", r"`gradient_checkpointing` must be True or False"),
    ("shape", {"hidden": 64}, r"`shape` must be a ModelShape"),
])
def test_the_analytic_models_fields_are_checked(field, value, message):
    kwargs = {"shape": SHAPE, field: value}
    with pytest.raises(ValueError, match=r"AnalyticMemoryModel: " + message):
        AnalyticMemoryModel(**kwargs)


def test_a_config_without_a_field_the_shape_needs_is_named():
    """GPT2Config (no ``intermediate_size``) said "`intermediate` must be an integer >= 1, got None"."""
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"the config \(GPT2Config\) has no `intermediate_size`; it reads a "
                                         r"Llama-style decoder's config \(LlamaConfig, Qwen2Config"):
        ModelShape.from_config(GPT2Config())
    with pytest.raises(ValueError, match=r"has no `num_hidden_layers`, `vocab_size`"):
        ModelShape.from_config({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4})


def test_a_mixture_of_experts_base_counts_every_expert():
    """Mixtral's and Qwen2-MoE's configs were read as one dense MLP a layer: Mixtral-8x7B counted 7.2e9 parameters of
    its 46.7e9, and admission on that shape admitted sets tens of GiB past the card."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=100, hidden_size=32, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
    configs = [MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
               Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                              shared_expert_intermediate_size=64, mlp_only_layers=[1])]
    for config in configs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.bias"))  # (Qwen2's q/k/v)
        shape = ModelShape.from_config(config)
        assert shape.base_params + biases == sum(p.numel() for p in model.parameters()), type(config).__name__
    mixtral, qwen = (ModelShape.from_config(c) for c in configs)
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.moe_layers) == (4, 2, 3)
    assert (qwen.expert_intermediate, qwen.shared_intermediate, qwen.dense_layers) == (40, 64, 1)
    # a token's activations: its routed experts' (and the shared one's), not every expert's
    dense = AnalyticMemoryModel(ModelShape(3, 32, 96, 4, 2, 100))
    assert AnalyticMemoryModel(mixtral).act_per_token == pytest.approx(
        dense.act_per_token + 3 * dense.activation_bytes * 4 * 96)  # (two experts of 96 where one MLP of 96)
    big = ModelShape.from_config(MixtralConfig())  # Mixtral-8x7B
    assert abs(big.base_params / 46.7e9 - 1) < 0.005
    with pytest.raises(ValueError, match=r"DeepseekV3Config is a DeepSeek-style decoder"):
        from transformers import DeepseekV3Config

        ModelShape.from_config(DeepseekV3Config())


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden=100, num_heads=3), r"`hidden` \(100\) is not a multiple of `num_heads` \(3\): give `head_dim`"),
    (dict(num_kv_heads=3), r"`num_kv_heads` must divide `num_heads` \(4\): .*got 3"),
    (dict(num_kv_heads=8), r"`num_kv_heads` must divide `num_heads` \(4\): .*got 8"),
    (dict(num_experts=4, experts_per_token=5), r"`experts_per_token` must be an integer from 1 to 4, got 5"),
    (dict(dense_layers=3), r"`dense_layers` must be an integer from 0 to 2, got 3"),
    (dict(tied_embeddings="false"), r"`tied_embeddings` must be True or False, got 'false'"),  # (counted as tied)
])
def test_a_shape_whose_heads_or_experts_do_not_add_up_is_refused(kwargs, message):
    """(hidden 100 over 3 heads made a q_proj 99 wide; more key/value heads than query heads went through.)"""
    with pytest.raises(ValueError, match="ModelShape: " + message):
        ModelShape(**{**dict(num_layers=2, hidden=64, intermediate=128, num_heads=4, num_kv_heads=2,
                             vocab_size=10), **kwargs})


def test_an_eight_bit_optimizers_states_are_a_fraction_of_the_adapters_bytes():
    """(`optimizer_states=0.5`, a PagedAdamW8bit's two one-byte states beside fp32 adapters, was refused; 0 was the
    only value it took, and it counted none.)"""
    model = AnalyticMemoryModel(SHAPE, optimizer_states=0.5, activation_bytes=4.0)
    assert model.adapter_bytes(16) == SHAPE.adapter_params(16) * 4.0 * 2.5
