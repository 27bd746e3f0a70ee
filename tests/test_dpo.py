"""DPO adapters: the loss against the formula written out by hand, one shared reference forward, a mixed
SFT + DPO run, preference data parsing."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.layout import BatchLayout
from lightning_multilora.data import GeneratedArithmetic, PreferenceSource
from lightning_multilora.data.sources import split_hh_rlhf
from lightning_multilora.registry import AdapterState

PAIRS = [{"prompt": f"Q{i}: is {i} even?", "chosen": " yes" if i % 2 == 0 else " no",
          "rejected": " no" if i % 2 == 0 else " yes"} for i in range(40)]
# A preference that generalises to unseen prompts (a fixed style of answer), so that the validation pairs can show
# it learned; the parity of i (PAIRS) is learned from 8 training examples only on some random bases.
STYLE_PAIRS = [{"prompt": f"Q{i}: is {i} even?", "chosen": " Certainly, gladly!", "rejected": " no."} for i in range(40)]
HH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "hh_rlhf_harmless" / "pairs.jsonl.gz"


def setup_module_and_batch():
    specs = [AdapterSpec("p", rank=4, objective="dpo", dpo_beta=0.3, batch_size=3, max_steps=5, seed=1),
             AdapterSpec("s", rank=2, batch_size=2, max_steps=5, seed=2, dataset="arith"),
             AdapterSpec("q", rank=3, objective="dpo", dpo_beta=1.5, batch_size=2, max_steps=5, seed=3)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=PAIRS), "arith": GeneratedArithmetic(40)}, max_length=96)  # the first source is the default
    for rec in module.registry:
        module._create_weights(rec)
        rec.state = AdapterState.RUNNING
        with torch.no_grad():
            for p in module.lora_layers.parameters_of(rec.name):
                p.normal_(0, 0.2)  # B != 0: the policy differs from the reference
    return module, dm, specs


def sequence_logp(model, ids, mask, labels):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    target = labels[:, 1:]
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (target != -100)).sum(-1)


def test_the_dpo_loss_is_the_formula_with_one_reference_forward_for_all_dpo_adapters():
    module, dm, specs = setup_module_and_batch()
    batch = dm.train_batch(specs)
    layout = batch["layout"]
    calls = []
    hook = module.model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape[0]),
                                                  with_kwargs=True)
    with module.lora_layers.use(layout):
        sums, counts = module.adapter_loss_terms(batch)
    hook.remove()
    dpo_rows = sum(layout.ends[i] - layout.starts[i] for i, n in enumerate(layout.names) if n != "s")
    assert calls == [layout.num_rows, dpo_rows]  # the policy forward, then one reference forward
    with torch.no_grad():
        with module.lora_layers.use(layout):
            policy = sequence_logp(module.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        with module.lora_layers.use(None):
            reference = sequence_logp(module.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    losses = sums / counts
    for i, spec in enumerate(specs):
        s, e = layout.starts[i], layout.ends[i]
        if spec.objective == "sft":
            continue
        b = spec.batch_size
        assert e - s == 2 * b  # chosen rows, then rejected rows
        margin = spec.dpo_beta * ((policy[s:s + b] - reference[s:s + b]) - (policy[s + b:e] - reference[s + b:e]))
        expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margin.tolist()) / b  # -log sigmoid, mean
        assert losses[i].item() == pytest.approx(expected, rel=1e-4)
        assert module._preference_accuracy[spec.name].item() == pytest.approx((margin > 0).double().mean().item())
        # TRL's rewards: beta x the log-probability gained over the reference, chosen and rejected
        chosen_reward = spec.dpo_beta * (policy[s:s + b] - reference[s:s + b]).mean()
        rejected_reward = spec.dpo_beta * (policy[s + b:e] - reference[s + b:e]).mean()
        assert module._preference_rewards[spec.name].tolist() == pytest.approx(
            [chosen_reward.item(), rejected_reward.item()], rel=1e-4, abs=1e-6)
    # the SFT adapter's loss is the usual completion cross-entropy
    i = layout.names.index("s")
    s, e = layout.starts[i], layout.ends[i]
    n_tokens = (batch["labels"][s:e, 1:] != -100).sum()
    assert losses[i].item() == pytest.approx((-policy[s:e].sum() / n_tokens).item(), rel=1e-4)


def test_with_router_logits_each_adapter_adds_its_own_rows_router_loss_in_training_dpo_and_sft_alike(tiny_mixtral):
    """A mixture-of-experts base with ``output_router_logits=True``: TRL's DPO loss adds the model's router loss over
    the policy forward's rows (chosen and rejected) to the mean pair loss; SFT adds it to the mean token loss. Each
    packed adapter's is that of its own rows; a validation's loss has none."""
    model = tiny_mixtral()
    specs = [AdapterSpec("p", rank=4, objective="dpo", dpo_beta=0.3, batch_size=3, max_steps=5, seed=1),
             AdapterSpec("s", rank=2, batch_size=2, max_steps=5, seed=2, dataset="arith")]
    module = MultiLoRAModule(model, adapters=specs, target_modules=["q_proj", "v_proj"], validate_on_finish=False)
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=PAIRS), "arith": GeneratedArithmetic(40)})
    for rec in module.registry:
        module._create_weights(rec)
        rec.state = AdapterState.RUNNING
    batch = dm.train_batch(specs)
    layout = batch["layout"]
    losses = {}
    for mode in ("train", "eval"):
        getattr(module, mode)()
        with torch.no_grad(), module.lora_layers.use(layout):
            sums, counts = module.adapter_loss_terms(batch)
        losses[mode] = sums / counts
    for i, name in enumerate(layout.names):
        rows = slice(layout.starts[i], layout.ends[i])
        with torch.no_grad(), module.lora_layers.use(BatchLayout((name,), (0,), (rows.stop - rows.start,),
                                                                 rows.stop - rows.start)):
            alone = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]).aux_loss
        assert alone > 0
        assert (losses["train"][i] - losses["eval"][i]).item() == pytest.approx(0.5 * alone.item(), rel=1e-4), name


def test_sft_and_dpo_adapters_train_together_and_dpo_learns_the_preferences(tmp_path, trainer_kwargs):
    specs = [AdapterSpec("p", rank=8, lr=1e-2, objective="dpo", dpo_beta=0.5, batch_size=4, max_steps=40, seed=1),
             AdapterSpec("s", rank=4, lr=1e-2, batch_size=4, max_steps=40, seed=2, dataset="arith")]
    import csv

    from lightning.pytorch.loggers import CSVLogger

    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir=str(tmp_path))
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=STYLE_PAIRS), "arith": GeneratedArithmetic(60)},
                             max_length=96, max_val_examples=8)
    L.Trainer(**{**trainer_kwargs, "logger": CSVLogger(tmp_path / "csv"), "log_every_n_steps": 1}).fit(module, dm)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("adapters/p/rewards_margin")]
    assert len(logged) == 40 and not any(k.startswith("adapters/s/rewards") and r[k] for r in rows for k in r)
    last = logged[-1]  # (the preference learned: the chosen answers' reward above the rejected ones')
    assert float(last["adapters/p/rewards_margin"]) == pytest.approx(
        float(last["adapters/p/rewards_chosen"]) - float(last["adapters/p/rewards_rejected"]))
    assert float(last["adapters/p/rewards_margin"]) > 0
    validated = [r for r in rows if r.get("adapters/p/val_rewards_margin")]  # (its validation at its finish)
    assert len(validated) == 1 and float(validated[0]["adapters/p/val_rewards_margin"]) > 0
    p, s = module.registry["p"], module.registry["s"]
    assert float(validated[0]["adapters/p/val_preference_accuracy"]) == p.last_val_preference_accuracy
    assert p.state == s.state == AdapterState.FINISHED
    first, last = p.train_losses[0][1], sum(loss for _, loss in p.train_losses[-5:]) / 5
    assert first == pytest.approx(math.log(2), rel=1e-3)  # B = 0 at the start: policy == reference
    assert last < 0.5 * first  # the preference is learned (the last 5 steps: ~0 on 8 random bases)
    assert s.train_losses[-1][1] < s.train_losses[0][1]
    assert p.best_val_loss is not None and p.best_val_loss < math.log(2)
    # its held-out pairs: the learned style preferred over the base's (the validation at its finish)
    assert 0.75 <= p.last_val_preference_accuracy <= 1 and math.isnan(s.last_val_preference_accuracy)
    restored = type(p).from_state_dict(p.state_dict())
    assert restored.last_val_preference_accuracy == p.last_val_preference_accuracy


@pytest.mark.parametrize("keep_best", [True, False])
def test_the_preference_accuracy_reported_is_the_exported_weights(tmp_path, keep_best):
    """The summary's `pref_acc` was the last validation's while its loss and the export were the best one's (or the
    weights measured as training stopped, whose accuracy was not kept): a DPO adapter chosen by it was chosen by
    other weights' accuracy."""
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("d", rank=2, objective="dpo")],
                             export_dir=str(tmp_path))
    module.keep_best_weights = keep_best  # (as EarlyExit sets it)
    rec = module.registry["d"]
    module._create_weights(rec)
    rec.state = AdapterState.RUNNING
    for step, (loss_sum, preferred) in ((10, (1.0, 4)), (20, (2.0, 2))):  # (4 pairs: losses 0.25, 0.5)
        rec.step = step
        module._record_val_losses({"d": [loss_sum, 4.0, float(preferred), 4.0, 0.0, 0.0]})
    assert (rec.best_val_step, rec.best_val_preference_accuracy, rec.last_val_preference_accuracy) == (10, 1.0, 0.5)
    if keep_best:  # the best weights exported, and their accuracy
        module.save_adapter("d", best=True)
        assert (rec.exported_step, rec.exported_val_loss, rec.exported_val_preference_accuracy) == (10, 0.25, 1.0)
    else:  # the last weights, measured as training stopped (`_validate_held`): their accuracy too
        rec.step = 25
        module._end_losses = {"d": (25, 0.4, 0.75)}
        module.save_adapter("d")
        assert (rec.exported_step, rec.exported_val_loss, rec.exported_val_preference_accuracy) == (25, 0.4, 0.75)
    # (the export's own account said neither that its loss is DPO's, of which beta, nor its weights' accuracy)
    info = json.loads((Path(rec.export_path) / "multilora_export.json").read_text())
    assert {k: info[k] for k in ("objective", "dpo_beta", "val_loss", "val_preference_accuracy")} == {
        "objective": "dpo", "dpo_beta": rec.spec.dpo_beta, "val_loss": 0.25 if keep_best else 0.4,
        "val_preference_accuracy": 1.0 if keep_best else 0.75}
    row = module.registry.summary_rows()[0]
    assert row["val_preference_accuracy"] == (1.0 if keep_best else 0.75)
    assert re.search(r"\bpref_acc\b", module.registry.summary_table())
    restored = type(rec).from_state_dict(rec.state_dict())
    assert restored.exported_val_preference_accuracy == rec.exported_val_preference_accuracy


def test_a_float64_base_keeps_its_precision_in_the_dpo_loss():
    """(The logits went through float32 on their way to the loss: a float64 run matched a float64 reference to
    5e-6 only, its DPO margins' differences of near log-probabilities to fewer digits.)"""
    module, dm, specs = setup_module_and_batch()
    module.double()
    batch = dm.train_batch(specs)
    layout = batch["layout"]
    with module.lora_layers.use(layout):
        sums, counts = module.adapter_loss_terms(batch)
    assert sums.dtype == torch.float64
    with torch.no_grad():
        with module.lora_layers.use(layout):
            policy = sequence_logp(module.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        with module.lora_layers.use(None):
            reference = sequence_logp(module.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    i = layout.names.index("p")
    s, e, b, beta = layout.starts[i], layout.ends[i], specs[0].batch_size, specs[0].dpo_beta
    margin = beta * ((policy[s:s + b] - reference[s:s + b]) - (policy[s + b:e] - reference[s + b:e]))
    torch.testing.assert_close(sums[i] / counts[i], -torch.nn.functional.logsigmoid(margin).mean(), rtol=1e-12,
                               atol=0)


def test_the_reference_is_the_frozen_base_without_dropout_and_an_adapter_without_rows_is_left_out():
    """A base with dropout, training: the policy forward keeps it (it is the one forward of every adapter, SFT ones
    too), the reference forward runs without it (the frozen base, deterministic: with it, a new adapter's margins were
    random), and the modules' modes are restored after. A DPO adapter with no rows this step (a custom batch, a data
    position past a shrunk split) is left out of the reference forward instead of failing it."""
    specs = [AdapterSpec("p", rank=4, objective="dpo", batch_size=3, seed=1),
             AdapterSpec("e", rank=4, objective="dpo", batch_size=2, seed=2),
             AdapterSpec("s", rank=2, batch_size=2, seed=3, dataset="arith")]
    module = MultiLoRAModule("tiny-llama", adapters=specs, config_overrides={"attention_dropout": 0.5})
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=PAIRS), "arith": GeneratedArithmetic(40)},
                             max_length=96)
    for rec in module.registry:
        module._create_weights(rec)
        rec.state = AdapterState.RUNNING
    module.train()
    module.model.model.layers[0].mlp.eval()  # (a module kept in evaluation mode stays so)
    batch = dm.train_batch([specs[0], specs[2]])
    batch["layout"] = layout = BatchLayout.from_sizes(["p", "e", "s"], [6, 0, 2])
    attention = module.model.model.layers[1].self_attn
    seen = []
    hook = module.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (kwargs["input_ids"].shape[0], attention.training)), with_kwargs=True)
    with module.lora_layers.use(layout):
        sums, counts = module.adapter_loss_terms(batch)
    hook.remove()
    assert seen == [(8, True), (6, False)]  # the policy forward in training mode, the reference (p's rows) not
    assert attention.training and not module.model.model.layers[0].mlp.training  # (restored)
    with torch.no_grad(), module.lora_layers.use(None):
        module.eval()
        reference = sequence_logp(module.model, batch["input_ids"][:6], batch["attention_mask"][:6],
                                  batch["labels"][:6])
        module.train()
    with torch.no_grad(), module.lora_layers.use(layout):  # B = 0: the policy is the base, here with its dropout
        torch.manual_seed(1)
        policy = sequence_logp(module.model, batch["input_ids"], batch["attention_mask"], batch["labels"])[:6]
        torch.manual_seed(1)
        sums, counts = module.adapter_loss_terms(batch)
    margin = (policy[:3] - reference[:3]) - (policy[3:] - reference[3:])
    expected = sum(-math.log(1 / (1 + math.exp(-0.1 * m))) for m in margin.tolist()) / 3
    assert (sums[0] / counts[0]).item() == pytest.approx(expected, rel=1e-4)
    assert "e" not in module._preference_accuracy and counts[1].item() == 0


def test_the_validation_preference_accuracy_and_rewards_are_over_pairs_not_batches(monkeypatch):
    """A validation of two batches, 3 pairs all preferred then 1 not: 0.75 (a mean of the batches' accuracies would
    say 0.5); an SFT adapter gets none. TRL's evaluation rewards are logged beside it, means over the pairs too
    (they were logged for training steps only)."""
    module, _, _ = setup_module_and_batch()
    terms = iter([(torch.tensor([3.0, 6.0]), torch.tensor([3.0, 12.0]), {"p": torch.tensor(1.0)},
                   {"p": torch.tensor([1.0, -1.0])}),
                  (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]), {"p": torch.tensor(0.0)},
                   {"p": torch.tensor([0.2, 0.6])})])

    def loss_terms(batch):
        sums, counts, module._preference_accuracy, module._preference_rewards = next(terms)
        return sums, counts

    monkeypatch.setattr(module, "adapter_loss_terms", loss_terms)
    logged = {}
    monkeypatch.setattr(module, "log_adapter_metrics", logged.update)
    layout = BatchLayout.from_sizes(["p", "s"], [2, 1])
    sums = {}
    for _ in range(2):
        module._add_val_terms(sums, {"layout": layout})
    module._record_val_losses(sums)
    p, s = module.registry["p"], module.registry["s"]
    assert p.last_val_preference_accuracy == 0.75 and p.last_val_loss == 1.0
    assert math.isnan(s.last_val_preference_accuracy) and s.last_val_loss == 0.5
    assert {k: v for k, v in logged.items() if k.startswith("adapters/p/val_")} == pytest.approx({
        "adapters/p/val_loss": 1.0, "adapters/p/val_preference_accuracy": 0.75,
        "adapters/p/val_rewards_chosen": (3 * 1.0 + 0.2) / 4, "adapters/p/val_rewards_rejected": (3 * -1.0 + 0.6) / 4,
        "adapters/p/val_rewards_margin": (3 * 2.0 - 0.4) / 4})
    assert sorted(k for k in logged if k.startswith("adapters/s/")) == ["adapters/s/val_loss"]


def test_trainer_validate_returns_a_dpo_adapters_accuracy_and_rewards(tmp_path, trainer_kwargs):
    """``trainer.validate`` on a module holding a DPO adapter returns TRL's evaluation metrics beside its loss:
    the accuracy and the rewards, means over the held-out pairs, as `evaluate` measures them."""
    specs = [AdapterSpec("p", rank=4, lr=1e-2, objective="dpo", dpo_beta=0.5, batch_size=4, max_steps=20, seed=1),
             AdapterSpec("s", rank=2, batch_size=4, max_steps=20, seed=2, dataset="arith")]
    module = MultiLoRAModule("tiny-llama", adapters=specs, validate_on_finish=False)
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=STYLE_PAIRS), "arith": GeneratedArithmetic(40)},
                             max_length=96, max_val_examples=8)
    L.Trainer(**{**trainer_kwargs, "max_steps": 6}).fit(module, dm)
    (results,) = L.Trainer(**trainer_kwargs).validate(module, dm)
    loss, count, preferred, pairs, chosen, rejected = module._evaluate_sums(["p"])["p"]
    assert pairs > 0 and results == pytest.approx({
        "adapters/p/val_loss": loss / count, "adapters/p/val_preference_accuracy": preferred / pairs,
        "adapters/p/val_rewards_chosen": chosen / pairs, "adapters/p/val_rewards_rejected": rejected / pairs,
        "adapters/p/val_rewards_margin": (chosen - rejected) / pairs,
        "adapters/s/val_loss": module.evaluate("s")["s"]}, rel=1e-5)
    assert results["adapters/p/val_rewards_margin"] != 0  # (6 steps from B = 0: the policy has moved)


def test_a_preference_files_errors_name_its_line_and_limit_stops_reading(tmp_path):
    good = json.dumps({"prompt": "q", "chosen": " y", "rejected": " n"})
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{good}\n\n\n{json.dumps({'prompt': 'q', 'chosen': ' y', 'rejectd': ' n'})}\n{{broken\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:4: record has no field\(s\) \['rejected'\]"):  # (was [1])
        PreferenceSource(str(path)).examples()
    assert len(PreferenceSource(str(path), limit=1).examples()) == 1  # (the bad lines after it are not read)


def test_preference_sources_parse_and_reject_bad_records():
    example = split_hh_rlhf("\n\nHuman: hi\n\nAssistant: hello!", "\n\nHuman: hi\n\nAssistant: go away")
    assert example.prompt == "\n\nHuman: hi\n\nAssistant:" and example.chosen == " hello!"
    assert example.rejected == " go away"
    with pytest.raises(ValueError, match=r"no field\(s\) \['rejected'\]"):
        PreferenceSource(records=[{"prompt": "a", "chosen": "b"}]).examples()
    with pytest.raises(ValueError, match="`format` can be prompt_chosen_rejected, hh_rlhf"):
        PreferenceSource(records=PAIRS, format="pairs")
    with pytest.raises(ValueError, match="exactly one of `path` and `records`"):
        PreferenceSource()
    with pytest.raises(ValueError, match="dpo_beta"):
        AdapterSpec("x", objective="dpo", dpo_beta=0)
    with pytest.raises(ValueError, match=r"records\[1\]: a record is a mapping, got a str"):
        PreferenceSource(records=[PAIRS[0], "pair"]).examples()
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(20)})
    with pytest.raises(ValueError, match="objective 'dpo' needs preference pairs"):
        dm.train_batch([AdapterSpec("d", objective="dpo")])


@pytest.mark.skipif(not HH.exists(), reason="../shared/data (HH-RLHF pairs) is not beside this checkout")
def test_hh_rlhf_pairs_load_as_preference_pairs():
    examples = PreferenceSource(str(HH), format="hh_rlhf", limit=50).examples()
    assert len(examples) == 50
    assert all(e.prompt.endswith("Assistant:") and e.chosen != e.rejected for e in examples)
