"""StepGraphs: eager where it cannot capture; on the GPU, replays that train as the eager steps do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_multilora.graphs import StepGraphs


@pytest.mark.parametrize("field, kwargs", [("warmup", dict(warmup=0)), ("max_graphs", dict(max_graphs=0)),
                                           ("warmup", dict(warmup=1.5))])
def test_bad_arguments_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"`{field}`"):
        StepGraphs(**kwargs)


def test_cpu_inputs_run_every_call_eagerly():
    graphs = StepGraphs(warmup=1)
    calls = []

    def step(x):
        calls.append(x.clone())
        return x * 2

    for i in range(4):
        out = graphs("k", step, torch.full((3,), float(i)))
        assert torch.equal(out, torch.full((3,), 2.0 * i))
    assert len(calls) == 4 and len(graphs) == 0 and graphs.replays == 0


def test_keep_calls_collects_the_forward_calls_of_the_triton_path():
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from lightning_multilora.kernels import LoRAWeights, keep_calls
    from lightning_multilora.kernels.triton_lora import multi_lora_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = (torch.randn(4, 8, device=device, requires_grad=True),)
    b = (torch.zeros(6, 4, device=device, requires_grad=True),)
    w = LoRAWeights(a, b, (2.0,), (0.0,), (0,), (5,))
    x = torch.randn(5, 8, device=device)
    with keep_calls() as calls:
        multi_lora_triton(x, torch.zeros(5, 6, device=device), w, False)
        with keep_calls() as inner:  # the innermost open context collects
            multi_lora_triton(x, torch.zeros(5, 6, device=device), w, False)
    multi_lora_triton(x, torch.zeros(5, 6, device=device), w, False)  # none open: kept by nobody
    assert len(calls) == 1 and len(inner) == 1 and calls[0] is not inner[0]
    assert calls[0].weights is w


def _tiny_llama(seed: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_multilora.kernels.recompute import checkpointing_kwargs
    from lightning_multilora.layer import inject_multilora

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to("cuda", dtype)
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())
    model.train()
    layers = inject_multilora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    for i, name in enumerate(("a", "b")):
        layers.add_adapter(name, rank=8 * (i + 1), alpha=16, seed=i)
        with torch.no_grad():  # B nonzero: every product matters from the first step
            for p in layers.parameters_of(name):
                p.normal_(0.0, 0.05)
    return model, layers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_steps_train_as_the_eager_steps_do(dtype):
    from lightning_multilora.base_model import one_sequence_per_row
    from lightning_multilora.layout import BatchLayout

    torch.manual_seed(0)
    batches = [torch.randint(128, (3, 16), device="cuda") for _ in range(6)]
    layout = BatchLayout.from_sizes(["a", "b"], [1, 2])
    results = []
    for graphed in (False, True):
        model, layers = _tiny_llama(seed=1, dtype=dtype)
        params = [p for n in ("a", "b") for p in layers.optimizer_parameters(n, elementwise=True)]
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
        graphs = StepGraphs(warmup=2, enabled=graphed)

        def step(ids):
            for name in ("a", "b"):
                layers.prepare_grads(name)
            with layers.use(layout), one_sequence_per_row():  # the eager steps' attention path under the capture
                logits = model(input_ids=ids, use_cache=False).logits
                loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
            return loss.detach()

        start = torch.cat([p.detach().flatten() for p in params])
        losses = []
        for ids in batches:
            losses.append(graphs("layout", step, ids).clone())
            optimizer.step()
        update = torch.cat([p.detach().flatten() for p in params]) - start
        results.append((torch.stack(losses), update, graphs))
    (eager_losses, eager_update, _), (graph_losses, graph_update, graphs) = results
    assert graphs.captures == 1 and graphs.replays == 4 and not graphs.failures
    # The same kernels on the same batches: equal up to the order of atomic additions. Each replayed step's loss is
    # nearest the eager loss of its own batch (a replay of a stale batch would be nearest another step's).
    tight = dtype == torch.float32
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-5 if tight else 5e-3, atol=0.0)
    if tight:  # (in bf16, two batches' losses may lie closer together than the noise)
        nearest = (graph_losses[:, None] - eager_losses[None, :]).abs().argmin(dim=1)
        assert nearest.tolist() == list(range(len(batches)))
    assert eager_update.norm() > 0  # (the steps trained)
    # (relative, not elementwise: Adam moves a parameter whose gradient is ~0 by ~lr either way)
    assert (graph_update - eager_update).norm() / eager_update.norm() < (1e-3 if tight else 3e-2)


@pytest.mark.gpu
def test_a_layout_met_again_after_another_is_captured_with_the_tables_of_its_eager_step():
    """The layers keep the kernels' device tables (pointer arrays, dropout streams) of recent layouts: a step whose
    layout last ran before another (an epoch's short last batch, say) is captured with them. (Keeping one layout,
    the capture made a table, failed, and turned the graphs off for the run.)"""
    from lightning_multilora.base_model import one_sequence_per_row
    from lightning_multilora.layout import BatchLayout

    model, layers = _tiny_llama(seed=1, dtype=torch.float32)
    layers.add_adapter("c", rank=8, alpha=16, dropout=0.1, seed=2)  # (a dropout stream's table too)
    graphs = StepGraphs(warmup=1)
    ids = torch.randint(128, (4, 16), device="cuda")
    full, short = BatchLayout.from_sizes(["a", "b", "c"], [1, 2, 1]), BatchLayout.from_sizes(["a", "b", "c"], [1, 1, 1])

    def step(ids, layout):
        for name in ("a", "b", "c"):
            layers.prepare_grads(name)
        with layers.use(layout), one_sequence_per_row():
            logits = model(input_ids=ids[:layout.num_rows], use_cache=False).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                               ids[:layout.num_rows, 1:].flatten())
            loss.backward()
        return loss.detach()

    for layout in (full, short, full, full):  # full: eager, then captured and replayed; short: eager
        graphs((layout.starts, layout.ends), lambda x, layout=layout: step(x, layout), ids)
    assert not graphs.failures and graphs.captures == 1 and graphs.replays == 2


@pytest.mark.gpu
@pytest.mark.parametrize("fails", ["reads a value on the host", "raises"])
def test_a_capture_that_fails_gives_its_memory_back_and_leaves_the_allocator_sound(fails):
    """A step that invalidates the capture (a host read) and one that raises inside it (the capture ends): the
    pool is given back once (given back twice, torch's allocator failed an assert at every later ``empty_cache``,
    Lightning's at the end of the fit included)."""
    graphs = StepGraphs(warmup=1)
    weight = torch.ones(4, device="cuda")

    def step(x):
        y = (x * weight).sum() * x  # (memory from the capture's pool)
        if fails == "raises" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a table to make")
        return y if fails == "raises" or y.sum().item() > 0 else x

    x = torch.ones(4, device="cuda")
    graphs("k", step, x)
    before = torch.cuda.memory_allocated()
    with pytest.warns(UserWarning, match="could not be captured"):
        out = graphs("k", step, x)
    assert torch.equal(out, 4 * x) and "k" in graphs.failures
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() <= before + 4096
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()  # (the allocator's books still add up)


@pytest.mark.gpu
def test_a_capture_that_failed_once_is_retried_after_another_warmup():
    """A capture that failed on something its eager calls make (a table built in the capture, say) is taken again
    after the key's next warmup: the graphs stay on (one such failure turned them off for the run)."""
    graphs = StepGraphs(warmup=1)
    made: list = []

    def step(x):
        if not made:  # a device table made on the first call that finds none (made outside a capture, it is kept)
            table = torch.arange(4, device="cuda", dtype=x.dtype)
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a table made in the capture")
            made.append(table)
        return x * made[0]

    x = torch.ones(4, device="cuda")
    made.append(torch.zeros(4, device="cuda"))  # (the first warmup finds a stale table; the capture drops it)
    graphs("k", step, x)
    made.clear()
    with pytest.warns(UserWarning, match="captured again after 1 more call"):
        out = graphs("k", step, x)  # the capture fails; the eager fallback makes the table
    assert torch.equal(out, torch.arange(4.0, device="cuda")) and graphs.enabled and graphs.captures == 0
    graphs("k", step, x)  # warmup again
    out = graphs("k", step, 2 * x)  # captured and replayed
    assert graphs.captures == 1 and graphs.replays == 1 and graphs.enabled
    assert torch.equal(out, 2 * torch.arange(4.0, device="cuda"))
    assert torch.equal(graphs("k", step, 3 * x), 3 * torch.arange(4.0, device="cuda")) and graphs.replays == 2


@pytest.mark.gpu
def test_a_step_that_reads_a_value_on_the_host_runs_eagerly_with_a_warning():
    graphs = StepGraphs(warmup=1)
    weight = torch.ones(4, device="cuda")

    def step(x):
        total = (x * weight).sum()
        return x * 2 if total.item() > 0 else x  # a host read: not capturable

    x = torch.ones(4, device="cuda")
    graphs("k", step, x)
    before = torch.cuda.memory_allocated()
    with pytest.warns(UserWarning, match=r"could not be captured .*; it runs eagerly and is captured again after 1"):
        out = graphs("k", step, x)
    assert torch.cuda.memory_allocated() <= before + 4096  # the failed capture's pool and input copies given back
    assert torch.equal(out, x * 2) and "k" in graphs.failures and len(graphs) == 0 and graphs.enabled
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the failed capture's stream given back
    assert torch.equal(graphs("k", step, x), x * 2)  # its warmup again, eager
    with pytest.warns(UserWarning, match="could not be captured .*; steps run eagerly from now on"):
        out = graphs("k", step, x)  # the second failure turns the graphs off
    assert torch.equal(out, x * 2) and not graphs.enabled and len(graphs) == 0
    assert torch.equal(graphs("k", step, -x), -x)  # eager from now on: the branch follows the values
    assert torch.equal(graphs("other", lambda v: v + 1, x), x + 1) and graphs.replays == 0
    # torch's CUDA generator is no longer marked as capturing (random draws failed after a failed capture)
    assert torch.randn(64, device="cuda").shape == (64,)


def test_packed_batches_say_they_are_right_padded_and_segment_sums_reuse_their_index():
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.data.datamodule import MultiLoRADataModule
    from lightning_multilora.module import _DEVICE_INDICES, segment_sum

    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(20)})
    batch = dm.pack(["a", "b"], [([[1, 2, 3]], [[1, 2, 3]]), ([[4], [5, 6]], [[4], [5, 6]])])
    assert batch["layout"].padding_side == "right"
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert segment_sum(torch.tensor([1.0, 2.0, 4.0]), batch["layout"]).tolist() == [1.0, 6.0]
    kept = [v for k, v in _DEVICE_INDICES.items() if k[0][0] == "segments" and k[0][1:] == ((0, 1), (1, 3), 3)]
    assert len(kept) == 1  # made once for the layout, on the host, then reused (no copy inside a step)
    segment_sum(torch.tensor([0.0, 1.0, 1.0]), batch["layout"])
    assert [v for k, v in _DEVICE_INDICES.items() if k[0][1:] == ((0, 1), (1, 3), 3)][0] is kept[0]


@pytest.mark.gpu
@pytest.mark.parametrize("rank_b", [16, 40])
@pytest.mark.parametrize("dtype, rtol, delta_tol", [("float32", 1e-4, 1e-2), ("bfloat16", 3e-2, 5e-2)])
def test_a_module_with_cuda_graphs_trains_as_the_eager_module(tmp_path, monkeypatch, dtype, rtol, delta_tol, rank_b):
    """In bf16 the adapters' shadows are read (no weight copy is launched, eagerly or in the graph): the module
    refreshes them before each replay. "b"'s dropout masks are the eager run's: a replay advances its dropout step.
    ``rank_b`` 16: dB adds dS (the fused launch); 40: dS and dB from one launch (`DS_DB_ONE_LAUNCH`), which a
    problem this small takes only with its dB row split left out."""
    import lightning as L

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.data import GeneratedArithmetic
    from lightning_multilora.kernels import triton_lora

    launches = []
    copy_launch = triton_lora._copy_weights
    monkeypatch.setattr(triton_lora, "_copy_weights", lambda *a, **k: launches.append(1) or copy_launch(*a, **k))
    one_launches = []
    if rank_b > triton_lora.FUSED_DS_MAX_TILE:
        one = triton_lora._ds_db_launch
        monkeypatch.setattr(triton_lora, "_grad_split", lambda *a: 1)
        monkeypatch.setattr(triton_lora, "_ds_db_launch", lambda *a: one_launches.append(1) or one(*a))
    results = []
    for graphed in (False, True):
        specs = [AdapterSpec("a", lr=1e-3, batch_size=2, max_steps=8),
                 AdapterSpec("b", lr=3e-3, rank=rank_b, batch_size=3, max_steps=8, seed=1, dropout=0.1)]
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(200)}, max_length=96, truncate=True,
                                 padding="max_length", max_val_examples=8)
        module = MultiLoRAModule("tiny-llama", adapters=specs, dtype=dtype, gradient_checkpointing=True,
                                 cuda_graphs=graphed, export_dir=str(tmp_path / str(graphed)), validate_on_finish=False)
        start = {}

        class Start(L.Callback):  # the adapters' weights as training starts (they are made at the optimizer's set-up)
            def on_train_start(self, trainer, pl_module):
                start.update({n: pl_module.lora_layers.peft_state_dict(n) for n in ("a", "b")})

        L.Trainer(accelerator="gpu", devices=1, max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, logger=False, default_root_dir=str(tmp_path),
                  val_check_interval=10_000, check_val_every_n_epoch=None, callbacks=[Start()]).fit(module, dm)
        from safetensors.torch import load_file

        deltas = torch.cat([(load_file(f"{module.registry[n].export_path}/adapter_model.safetensors")[k].cuda()
                             - start[n][k].cuda()).flatten().float() for n in ("a", "b") for k in sorted(start[n])])
        losses = torch.tensor([[loss for _, loss in module.registry[n].train_losses] for n in ("a", "b")],
                              dtype=torch.float64)
        results.append((deltas, losses, module._step_graphs))
    (eager_deltas, eager_losses, _), (graph_deltas, graph_losses, graphs) = results
    # steps 1 (no gradients yet: another key) and 2-3 eager, the capture at step 4 replayed, then 5-8 replays
    assert graphs.captures == 1 and graphs.replays == 5 and not graphs.failures
    # The eager module passes the attention mask, the graphed one none (another SDPA kernel): in fp32, equal to
    # ~1e-6. Each replayed step's loss is nearest the eager loss of its own batch (not a stale batch's).
    torch.testing.assert_close(graph_losses, eager_losses, rtol=rtol, atol=0.0)
    for g, e in zip(graph_losses, eager_losses):
        assert (g[:, None] - e[None, :]).abs().argmin(dim=1).tolist() == list(range(len(e)))
    assert eager_deltas.norm() > 0 and (graph_deltas - eager_deltas).norm() / eager_deltas.norm() < delta_tol
    if dtype == "bfloat16":
        assert not launches
    assert bool(one_launches) == (rank_b > triton_lora.FUSED_DS_MAX_TILE)


def test_rows_of_one_sequence_keep_the_causal_attention_path_under_a_capture(monkeypatch):
    # transformers counts a CUDA graph capture as tracing: without an attention mask it then builds a full
    # (rows, 1, T, T) mask from the position ids (packed sequences) instead of SDPA's is_causal. Simulated here.
    from transformers import LlamaConfig, LlamaForCausalLM, masking_utils
    from transformers.models.llama import modeling_llama

    from lightning_multilora.base_model import one_sequence_per_row

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    masks = []
    build = modeling_llama.create_causal_mask
    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda *a, **k: masks.append(build(*a, **k)))
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
    ids = torch.randint(64, (3, 12))
    with torch.no_grad():  # (no cache, as in training: transformers looks for packed rows only then)
        model(input_ids=ids, use_cache=False)
        with one_sequence_per_row():
            model(input_ids=ids, use_cache=False)
        model(input_ids=ids, use_cache=False)
    assert masks[0] is not None and tuple(masks[0].shape) == (3, 1, 12, 12)
    assert masks[1] is None  # is_causal
    assert masks[2] is not None  # the context restored what it replaced


def test_one_sequence_per_row_nests_and_restores_transformers_functions():
    import threading

    from transformers import masking_utils

    from lightning_multilora.base_model import one_sequence_per_row

    originals = (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa)
    entered, release = threading.Event(), threading.Event()

    def other_thread():  # enters while the main thread holds the context, leaves after it (the backward's thread)
        with one_sequence_per_row():
            entered.set()
            release.wait(10)

    with one_sequence_per_row():
        patched = masking_utils.find_packed_sequence_indices
        assert patched is not originals[0] and patched(torch.arange(4)[None]) is None
        # the mask-free square case skips the mask; any other case gets transformers' own answer
        assert masking_utils._ignore_causal_mask_sdpa(None, 8, 8, 0, 0) is True
        assert masking_utils._ignore_causal_mask_sdpa(torch.ones(1, 8, dtype=torch.bool), 8, 8, 0, 0) is True
        assert masking_utils._ignore_causal_mask_sdpa(torch.tensor([[True] * 7 + [False]]), 8, 8, 0, 0) is False
        thread = threading.Thread(target=other_thread)
        thread.start()
        entered.wait(10)
        with one_sequence_per_row():
            assert masking_utils.find_packed_sequence_indices is patched
    assert masking_utils.find_packed_sequence_indices is patched  # the other thread is still inside
    release.set()
    thread.join(10)
    assert (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa) == originals


def test_a_step_whose_adapter_has_no_gradient_yet_runs_eagerly():
    """A replay runs no Python, so a captured step never makes a gradient: a step where an adapter has none (new, or
    resumed after a pause, which drops it) must run eagerly. Keyed with a 0 for it, the step of an adapter paused and
    resumed again and again was captured, then replayed with no gradient: the adapter stopped learning."""
    from types import SimpleNamespace

    from lightning_multilora import AdapterSpec, MultiLoRAModule
    from lightning_multilora.layout import BatchLayout

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2), AdapterSpec("b", rank=2)],
                             cuda_graphs=True)
    records = list(module.registry)
    for rec in records:
        module._create_weights(rec)
    params = [module.lora_layers.step_parameters(r.name) for r in records]
    batch = {"input_ids": SimpleNamespace(is_cuda=True, device=torch.device("cuda")),  # (the key, not a step)
             "layout": BatchLayout.from_sizes(["a", "b"], [1, 1], padding_side="right")}
    for group in params:
        for p in group:
            p.grad = torch.zeros_like(p)
    assert module._graph_key(batch, records, params) is not None
    params[1][0].grad = None  # b paused and resumed
    assert module._graph_key(batch, records, params) is None

