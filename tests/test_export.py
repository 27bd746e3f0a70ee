"""PEFT export: what we write loads with `PeftModel.from_pretrained` and gives the same logits."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace

import lightning as L
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lightning_multilora import AdapterSpec, BatchLayout, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.arguments import UsageError
from lightning_multilora.base_model import build_base_model
from lightning_multilora.data import GeneratedArithmetic
from lightning_multilora.registry import AdapterState


# Other families, built tiny from their configs: GPT-2's projections are Conv1D (weight (in, out), PEFT's
# fan_in_fan_out), OPT flattens the tokens before fc1 / fc2, GPT-NeoX's output head is `embed_out` (not `lm_head`)
OTHER_FAMILIES = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4),
    "opt": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64),
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4),
}
SUBSETS = {"gpt2": ["c_attn", "c_fc"], "opt": ["q_proj", "fc2"], "gpt_neox": ["query_key_value", "dense_4h_to_h"]}


def _saved_base(base: str, directory) -> None:
    if base in OTHER_FAMILIES:
        from transformers import AutoConfig

        config = AutoConfig.for_model(base, vocab_size=258, **OTHER_FAMILIES[base])
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        build_base_model(base).save_pretrained(directory)


@pytest.mark.parametrize("base", ["tiny-llama", "tiny-qwen2", *OTHER_FAMILIES])
def test_export_round_trip_through_peft_gives_the_same_logits(tmp_path, trainer_kwargs, base):
    # The base goes through the real loading path: save_pretrained into a directory, loaded back by path.
    _saved_base(base, tmp_path / "base")
    specs = [AdapterSpec("plain", rank=4, alpha=8, batch_size=2, max_steps=6, lr=5e-3),
             AdapterSpec("rs", rank=3, alpha=5, use_rslora=True, batch_size=1, max_steps=6, lr=5e-3, seed=1,
                         target_modules=SUBSETS.get(base, ["q_proj", "v_proj", "down_proj"]), dropout=0.1)]
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=specs, export_dir=str(tmp_path / "out"),
                             validate_on_finish=False)
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(100)})
    L.Trainer(**trainer_kwargs).fit(module, dm)
    # Snapshot the trained weights back into a module to compare logits: re-add and load from the export.
    ids = torch.randint(0, 258, (3, 17), generator=torch.Generator().manual_seed(0))
    for spec in specs:
        out_dir = tmp_path / "out" / spec.name
        config = json.loads((out_dir / "adapter_config.json").read_text())
        assert config["r"] == spec.rank and config["lora_alpha"] == spec.alpha
        assert config["use_rslora"] == spec.use_rslora and config["peft_type"] == "LORA"
        assert config["fan_in_fan_out"] == (base == "gpt2")

        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out_dir)
        peft_model.eval()
        ours = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec])
        ours.lora_layers.add_adapter(spec.name, spec.rank, spec.alpha, spec.dropout, spec.use_rslora,
                                     spec.target_modules or ours.default_target_modules, spec.seed)
        from safetensors.torch import load_file

        ours.lora_layers.load_peft_state_dict(spec.name, load_file(str(out_dir / "adapter_model.safetensors")))
        ours.eval()
        with torch.no_grad():
            expected = peft_model(input_ids=ids).logits
            got = ours(ids, layout=BatchLayout.from_sizes([spec.name], [3]))
            base_only = ours(ids)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        if spec.target_modules is None:  # "all-linear" (the default) adapts the layers PEFT's does
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(target_modules="all-linear", fan_in_fan_out=base == "gpt2")
            peft_all = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config)
            peft_layers = [n.removeprefix("base_model.model.").removesuffix(".lora_A")
                           for n, _ in peft_all.named_modules() if n.endswith(".lora_A")]
            assert sorted(ours.lora_layers.target_layers(spec.name)) == sorted(peft_layers)
        assert (got - base_only).abs().max() > 1e-4  # the adapter changes the output
        with pytest.raises(KeyError, match=r"`layout` names \['typo'\]: no adapter of this module; adapters: \["):
            ours(ids, layout=BatchLayout.from_sizes([spec.name, "typo"], [2, 1]))  # not the base's output, silently


def test_peft_target_modules_are_short_names_when_whole_and_full_names_otherwise():
    from lightning_multilora.export import peft_target_modules

    names = ["m.layers.0.q_proj", "m.layers.1.q_proj", "m.layers.0.v_proj", "m.layers.1.v_proj"]
    assert peft_target_modules(["m.layers.0.q_proj", "m.layers.1.q_proj"], names) == ["q_proj"]
    assert peft_target_modules(["m.layers.0.v_proj"], names) == ["m.layers.0.v_proj"]


def test_save_adapter_on_demand_mid_fit(tmp_path, trainer_kwargs):
    from lightning.pytorch.callbacks import Callback

    saved = {}

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                saved["path"] = pl_module.save_adapter("x", tmp_path / "snapshot")

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("x", max_steps=5, batch_size=1)],
                             export_dir=str(tmp_path / "final"), validate_on_finish=False)
    L.Trainer(**trainer_kwargs, callbacks=[SaveAt()]).fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
    assert (saved["path"] / "adapter_model.safetensors").is_file()
    assert (tmp_path / "final" / "x" / "adapter_config.json").is_file()
    assert module.registry["x"].export_path == str(tmp_path / "final" / "x")  # the snapshot is the caller's copy
    ids = torch.randint(0, 258, (1, 5))
    with pytest.raises(KeyError, match=r"`layout` names 'x', which holds no weights \(finished\); it was exported to "
                                       r".*final/x \(load it with PEFT\)"):
        module(ids, layout=BatchLayout.from_sizes(["x"], [1]))
    with pytest.raises(ValueError, match=r"holds no weights \(finished\); its weights were exported to .*final/x"):
        module.save_adapter("x")
    module.add_adapter(AdapterSpec("later", max_steps=5, batch_size=1))
    with pytest.raises(ValueError, match=r"'later' holds no weights \(queued\); it has not started: no weights yet"):
        module.save_adapter("later")
    with pytest.raises(KeyError, match=r"`layout` names 'later', which holds no weights \(queued\); it has not "
                                       r"started: no weights yet \(they are made as it starts, in `fit`\)"):
        module(ids, layout=BatchLayout.from_sizes(["later"], [1]))


def test_save_adapter_keeps_another_adapters_export_a_measured_loss_and_expands_a_home_folder(tmp_path,
                                                                                              trainer_kwargs,
                                                                                              monkeypatch):
    """A ``directory`` holding another adapter's export of the run was written over silently (its only copy once it
    ended; the record still named it); the same weights written again lost their measured loss (NaN); and
    ``export_dir="~/..."`` (a YAML's) made a folder named "~" in the working directory."""
    from pathlib import Path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    specs = [AdapterSpec("a", rank=2, batch_size=1, max_steps=2), AdapterSpec("b", rank=4, batch_size=1, max_steps=9)]
    module = MultiLoRAModule("tiny-llama", adapters=specs, export_dir="~/exports")
    L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(module, MultiLoRADataModule(
        sources={"s": GeneratedArithmetic(40)}, max_val_examples=4))
    a, b = module.registry["a"], module.registry["b"]
    assert a.export_path == str(tmp_path / "home" / "exports" / "a") and not (tmp_path / "~").exists()
    assert (a.state, b.state, b.exported_step) == (AdapterState.FINISHED, AdapterState.RUNNING, 3)
    measured = b.exported_val_loss
    assert measured == measured  # (measured as the fit stopped)
    assert module.save_adapter("b") == Path(b.export_path)  # the same weights again: their loss kept
    assert b.exported_val_loss == measured
    assert json.loads((Path(b.export_path) / "multilora_export.json").read_text())["val_loss"] == measured
    kept = (Path(a.export_path) / "adapter_model.safetensors").read_bytes()
    for folder in (a.export_path, "~/exports/a"):
        with pytest.raises(ValueError, match=r"save_adapter\('b', directory=.*\): that folder holds the export of "
                                             r"adapter 'a' of this run, which this would replace; give each adapter "):
            module.save_adapter("b", folder)
    assert (Path(a.export_path) / "adapter_model.safetensors").read_bytes() == kept
    module.save_adapter("b", "chosen")  # (a subset exported into one folder: the second refused)
    module.add_adapter(AdapterSpec("c", rank=2, batch_size=1, max_steps=5))
    L.Trainer(**{**trainer_kwargs, "max_steps": 4}).fit(module, MultiLoRADataModule(
        sources={"s": GeneratedArithmetic(40)}, max_val_examples=4))
    with pytest.raises(ValueError, match=r"that folder holds the export of adapter 'b' of this run"):
        module.save_adapter("c", "chosen")
    assert module.save_adapter("b", "~/mine") == tmp_path / "home" / "mine"


def test_generate_runs_several_adapters_in_one_batch_as_peft_runs_each(tmp_path, trainer_kwargs):
    """``module.generate``: rows of two adapters and of the base, packed in one ``generate`` (prompts of two lengths,
    padded on the left), give each row the tokens PEFT's model of that adapter (or the base alone) generates."""
    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    specs = [AdapterSpec("a", rank=4, alpha=8, max_steps=8, lr=2e-2), AdapterSpec("b", rank=2, alpha=4, max_steps=8,
                                                                                  lr=2e-2, seed=1)]
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=specs, export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "max_steps": 4}).fit(module,
                                                        MultiLoRADataModule(sources={"a": GeneratedArithmetic(100)}))
    paths = {n: module.save_adapter(n, directory=tmp_path / "now" / n) for n in ("a", "b")}
    prompts = [torch.randint(1, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7, 5, 7)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    rows = ["b", "a", None, "a"]
    out = module.generate(rows, ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert out.shape == (4, width + 6)
    def alone(name, prompt, **kwargs):  # PEFT's model of the adapter (or the base), generating for one prompt
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        model = PeftModel.from_pretrained(base, paths[name]) if name is not None else base
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, pad_token_id=0, **kwargs)
        return [upto_eos(row) for row in out[:, len(prompt):].tolist()]

    def upto_eos(tokens):  # (a row that ended is padded to the batch's longest)
        return tokens[:tokens.index(257) + 1] if 257 in tokens else tokens

    for i, name in enumerate(rows):
        assert [upto_eos(out[i, width:].tolist())] == alone(name, prompts[i], max_new_tokens=6), (i, name)
    assert out[0].tolist() != out[2].tolist()  # one prompt: adapter b changes what the base says
    # a generation_config that samples is taken (a default `do_sample=False` argument overrode it: greedy, unsaid)
    from transformers import GenerationConfig

    def sampled(seed):
        torch.manual_seed(seed)
        return module.generate(rows, ids, attention_mask=mask, pad_token_id=0, generation_config=GenerationConfig(
            do_sample=True, top_k=0, temperature=3.0, max_new_tokens=6))
    assert torch.equal(sampled(0), sampled(0)) and not torch.equal(sampled(0), sampled(1))
    assert not torch.equal(sampled(0), out)
    # beam search: each prompt's beams are rows of its adapter; num_return_sequences rows a prompt, in the rows' order
    beams = module.generate(rows, ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, num_beams=3,
                            num_return_sequences=2)
    assert beams.shape == (8, width + 4)
    for i, name in enumerate(rows):
        assert [upto_eos(row) for row in beams[2 * i:2 * i + 2, width:].tolist()] == alone(
            name, prompts[i], max_new_tokens=4, num_beams=3, num_return_sequences=2), (i, name)
    with pytest.raises(ValueError, match=r"`return_dict_in_generate=True` takes rows grouped by adapter"):
        module.generate(rows, ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
    grouped = module.generate(["a", "a", "b", None], ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                              return_dict_in_generate=True, output_scores=True)
    assert grouped.sequences.shape == (4, width + 2) and len(grouped.scores) == 2
    with pytest.raises(ValueError, match=r"`adapters` names one adapter \(or None\) a row"):
        module.generate(["a"], ids)
    with pytest.raises(ValueError, match=r"a list, e.g. \['a'\] \* 4 for every row, got the string 'a'"):
        module.generate("a", ids)  # (its letters were names: 'a' alone, on a batch of one row, passed)


def test_generates_per_row_arguments_go_with_their_rows(tmp_path, trainer_kwargs):
    """`generate` runs the rows grouped by adapter: a per-row tensor argument (GPT-2's ``token_type_ids``) stayed in
    the caller's order, each row generated with another row's; a ``prefix_allowed_tokens_fn``, called with generate's
    rows, is refused for rows not so grouped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=258, n_embd=32, n_layer=2, n_head=2, n_positions=128, eos_token_id=257,
                               bos_token_id=257)).save_pretrained(tmp_path / "gpt2")
    module = MultiLoRAModule(str(tmp_path / "gpt2"), adapters=[AdapterSpec("a", rank=2, max_steps=8, lr=5e-2)],
                             export_dir=str(tmp_path / "out"))
    L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(module,
                                                        MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
    ids = torch.randint(1, 250, (3, 5), generator=torch.Generator().manual_seed(0))
    types = torch.tensor([[0] * 5, [7] * 5, [0] * 5])
    rows = ["a", None, "a"]
    out = module.generate(rows, ids, token_type_ids=types, max_new_tokens=4, pad_token_id=0)
    for i, name in enumerate(rows):
        alone = module.generate([name], ids[i:i + 1], token_type_ids=types[i:i + 1], max_new_tokens=4, pad_token_id=0)
        assert out[i].tolist() == alone[0].tolist(), (i, name)
    with pytest.raises(ValueError, match=r"`prefix_allowed_tokens_fn` takes rows grouped by adapter"):
        module.generate(rows, ids, max_new_tokens=2, prefix_allowed_tokens_fn=lambda batch_id, ids: [65])
    grouped = module.generate(["a", "a", None], ids, max_new_tokens=2, pad_token_id=0,
                              prefix_allowed_tokens_fn=lambda batch_id, ids: [65 + batch_id])
    assert grouped[:, 5:].tolist() == [[65, 65], [66, 66], [67, 67]]


def _peft_saved_adapter(directory, base_dir, save_kwargs=None, **config) -> dict[str, torch.Tensor]:
    """A PEFT adapter of random weights (B not zero), saved with PEFT's own ``save_pretrained`` (given
    ``save_kwargs``); its saved tensors."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(**config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    peft_model.save_pretrained(directory, **(save_kwargs or {}))
    return load_file(str(directory / "adapter_model.safetensors"))


def test_an_adapter_starts_from_a_peft_folder_and_continues_it(tmp_path, trainer_kwargs):
    """``AdapterSpec(init_from=folder)`` starts an adapter from a PEFT-saved adapter's weights (its layers, where the
    spec names none): trained for a step at a negligible rate it exports the same weights, and the module's outputs
    with it are PEFT's. A spec that differs from the folder is refused at the start of the fit, before any step (not as
    it is queued: a resume, whose checkpoint holds the weights, does not need the folder)."""
    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    saved = _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", r=4, lora_alpha=32, use_rslora=True,
                                target_modules=["q_proj", "v_proj"])
    spec = AdapterSpec("cont", rank=4, alpha=32, use_rslora=True, max_steps=1, lr=1e-20, batch_size=2,
                       init_from=str(tmp_path / "peft"))
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], export_dir=str(tmp_path / "out"),
                             validate_on_finish=False)  # (the module's own targets: all-linear)
    L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "out" / "cont" / "adapter_model.safetensors"))
    assert sorted(exported) == sorted(saved)
    for key, value in saved.items():
        torch.testing.assert_close(exported[key], value, atol=1e-12, rtol=0)
    config = json.loads((tmp_path / "out" / "cont" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["inference_mode"] is True
    ids = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(0))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "peft")
    ours = MultiLoRAModule(str(tmp_path / "base"), adapters=[AdapterSpec("p", rank=4, alpha=32, use_rslora=True,
                                                                         init_from=str(tmp_path / "peft"))])
    ours._create_weights(ours.registry["p"])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids, layout=BatchLayout.from_sizes(["p"], [2])),
                                   peft_model.eval()(input_ids=ids).logits, atol=1e-5, rtol=0)

    for changes, message in [
        (dict(rank=8), r"differs from the spec: rank=4 there, 8 in the spec"),
        (dict(alpha=16.0, use_rslora=False), r"alpha=32 there, 16.0 in the spec; use_rslora=True there, False"),
        (dict(target_modules=["q_proj"]), r"holds weights for other layers than its `target_modules` \['q_proj'\] "
                                          r"select: only there \['model.layers.0.self_attn.v_proj'"),
        (dict(init_from=str(tmp_path / "base")), r"`init_from` '.*base' has no adapter_config.json"),
    ]:
        module = MultiLoRAModule(str(tmp_path / "base"), adapters=[replace(spec, **changes)])
        with pytest.raises(UsageError, match=message):
            L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
        assert module.registry["cont"].state == AdapterState.QUEUED  # (refused with the run: a later fit starts it)
    _peft_saved_adapter(tmp_path / "dora", tmp_path / "base", r=4, lora_alpha=32, use_dora=True)
    with pytest.raises(ValueError, match=r"is not a plain LoRA adapter \(use_dora=True\)"):
        MultiLoRAModule(str(tmp_path / "base"))._targets_of(replace(spec, init_from=str(tmp_path / "dora")))
    # initialisations that rewrite the base (PiSSA...) and other LoRA variants (aLoRA) are refused, naming the field;
    # those that leave the base alone ("orthogonal", "nora") start the adapter
    for name, config, message in [
            ("pissa", dict(init_lora_weights="pissa"), r"\(init_lora_weights='pissa'\): its weights fit the base its "
                                                      r"initialisation rewrote.*path_initial_model_for_weight_conv"),
            ("alora", dict(alora_invocation_tokens=[5]), r"not a plain LoRA adapter \(alora_invocation_tokens=\[5\]\)"),
            ("orthogonal", dict(init_lora_weights="orthogonal"), None),
            ("nora", dict(init_lora_weights="nora"), None)]:  # (A's columns normalised, B zero: the base left alone)
        _peft_saved_adapter(tmp_path / name, tmp_path / "base", r=4, lora_alpha=32, use_rslora=True,
                            target_modules=["q_proj", "v_proj"], **config)
        variant = replace(spec, init_from=str(tmp_path / name))
        if message is None:
            assert MultiLoRAModule(str(tmp_path / "base"))._targets_of(variant)
        else:
            with pytest.raises(ValueError, match=message):
                MultiLoRAModule(str(tmp_path / "base"))._targets_of(variant)
    with pytest.raises(ValueError, match=r"holds weights for layers this module does not wrap \[.*q_proj"):
        MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], target_modules=["k_proj"])._targets_of(spec)


def _assert_peft_logits(module, name: str, base_dir, peft_dir) -> None:
    """The module's logits with adapter ``name`` are PEFT's with the folder ``peft_dir`` on ``base_dir``."""
    ids = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(0))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), peft_dir)
    with torch.no_grad():
        torch.testing.assert_close(module.eval()(ids, layout=BatchLayout.from_sizes([name], [2])),
                                   peft_model.eval()(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_a_compiled_bases_adapters_are_named_as_the_plain_models_both_ways(tmp_path, trainer_kwargs):
    """(A `torch.compile`d base's layers were named `_orig_mod.model.layers...`: its exports PEFT loaded as no adapter,
    warning only of missing keys, or refused a regex's; `init_from` refused a plain model's PEFT folder, and a plain
    module the compiled one's exports.)"""
    from safetensors.torch import load_file

    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj"])
    compiled = torch.compile(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), backend="eager")
    module = MultiLoRAModule(compiled, export_dir=str(tmp_path / "out"), validate_on_finish=False, adapters=[
        AdapterSpec("regex", rank=4, alpha=8, lr=1e-2, max_steps=9, target_modules=r".*layers\.1\..*v_proj"),
        AdapterSpec("peft", rank=4, alpha=8, lr=1e-2, max_steps=9, init_from=str(tmp_path / "peft"))])
    trainer = L.Trainer(**dict(trainer_kwargs, max_steps=2))  # (its adapters held: exported as the fit ends)
    trainer.fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(40)}))
    regex = tmp_path / "out" / "regex"
    assert json.loads((regex / "adapter_config.json").read_text())["target_modules"] == [
        "model.layers.1.self_attn.v_proj"]
    assert list(load_file(str(regex / "adapter_model.safetensors"))) == [
        "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    for name in ("regex", "peft"):
        _assert_peft_logits(module, name, tmp_path / "base", tmp_path / "out" / name)
    plain = MultiLoRAModule(str(tmp_path / "base"), adapters=[AdapterSpec("back", rank=4, alpha=8,
                                                                          init_from=str(regex))])
    plain._create_weights(plain.registry["back"])
    _assert_peft_logits(plain, "back", tmp_path / "base", regex)


def test_a_peft_adapter_of_the_head_with_its_saved_base_weights_starts_an_adapter(tmp_path):
    """PEFT saves a targeted ``lm_head``'s base weights beside its LoRA weights (``save_embedding_layers="auto"``):
    where they are this base's, the folder is plain LoRA and loads (PEFT's outputs); other base weights (a resized
    vocabulary, another base) are refused, naming PEFT's option."""
    from safetensors.torch import load_file, save_file

    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    with pytest.warns(UserWarning, match="save_embedding_layers"):
        saved = _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", r=4, lora_alpha=8,
                                    target_modules=["q_proj", "lm_head"])
    assert "base_model.model.lm_head.base_layer.weight" in saved
    spec = AdapterSpec("head", rank=4, alpha=8, init_from=str(tmp_path / "peft"))
    ours = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], target_modules=["q_proj", "lm_head"])
    ours._create_weights(ours.registry["head"])
    _assert_peft_logits(ours, "head", tmp_path / "base", tmp_path / "peft")
    saved["base_model.model.lm_head.base_layer.weight"] += 1.0
    save_file(saved, str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert load_file(str(tmp_path / "peft" / "adapter_model.safetensors")).keys() == saved.keys()
    other = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"holds base weights other than this base's "
                                         r"\['base_model\.model\.lm_head\.base_layer\.weight'\] \(PEFT's "
                                         r"`save_embedding_layers`"):
        other._create_weights(other.registry["head"])


def test_a_peft_folder_with_the_embeddings_saved_whole_and_its_dropout_told(tmp_path):
    """``save_pretrained(save_embedding_layers=True)`` of an adapter on q_proj alone saves the embeddings and the head
    whole; where they are this base's the folder is plain LoRA (PEFT loads it so), where it was refused. A folder's
    ``lora_dropout`` other than the spec's ``dropout`` was dropped silently (PEFT continues with it)."""
    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    saved = _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", save_kwargs={"save_embedding_layers": True},
                                r=4, lora_alpha=8, lora_dropout=0.25, target_modules=["q_proj"])
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= saved.keys()
    spec = AdapterSpec("emb", rank=4, alpha=8, init_from=str(tmp_path / "peft"))
    ours = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], target_modules=["q_proj"])
    with pytest.warns(UserWarning, match=r"adapter 'emb': `init_from` '.*peft' was trained with lora_dropout=0\.25; "
                                         r"the spec's dropout=0\.0 continues it.*set `dropout=0\.25`"):
        ours._create_weights(ours.registry["emb"])
    _assert_peft_logits(ours, "emb", tmp_path / "base", tmp_path / "peft")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the folder's own dropout: nothing to tell
        same = MultiLoRAModule(str(tmp_path / "base"), adapters=[replace(spec, dropout=0.25)],
                               target_modules=["q_proj"])
        same._create_weights(same.registry["emb"])
    from safetensors.torch import save_file

    saved["base_model.model.model.embed_tokens.weight"] *= 2  # (a resized or other base's embeddings)
    save_file(saved, str(tmp_path / "peft" / "adapter_model.safetensors"))
    other = MultiLoRAModule(str(tmp_path / "base"), adapters=[replace(spec, dropout=0.25)], target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"holds base weights other than this base's "
                                         r"\['base_model\.model\.model\.embed_tokens\.weight'\]"):
        other._create_weights(other.registry["emb"])


def test_an_export_of_a_checkpoint_loaded_with_config_overrides_says_how_to_build_its_base(tmp_path):
    """An export names its base's checkpoint, which PEFT loads without the module's `config_overrides` (a
    1-layer cut of a 2-layer checkpoint: PEFT would add fresh weights to the second layer): the first export of
    the module says how to build the base; a built-in base, which PEFT cannot load by name anyway, is not warned."""
    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=[AdapterSpec("a", rank=2)],
                             config_overrides={"num_hidden_layers": 1})
    module._create_weights(module.registry["a"])
    with pytest.warns(UserWarning, match=r"names the base '.*base', which this module loaded with `config_overrides` "
                                         r"\{'num_hidden_layers': 1\}; .*from_pretrained\('.*base', "
                                         r"\*\*\{'num_hidden_layers': 1\}\)"):
        module.save_adapter("a", tmp_path / "one")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.save_adapter("a", tmp_path / "two")  # (once a module)
        tiny = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2)],
                               config_overrides={"num_hidden_layers": 1})
        tiny._create_weights(tiny.registry["a"])
        tiny.save_adapter("a", tmp_path / "three")


def test_a_peft_folder_whose_weights_do_not_fit_fails_before_the_first_step_or_alone(tmp_path, trainer_kwargs):
    """An `init_from` folder whose config matches the spec but whose weights do not fit the base (saved from another
    model) is refused before the first step, also for an adapter waiting for a slot; one added mid-run fails alone,
    with a warning, and the running adapter trains on to its last step."""
    from lightning.pytorch.callbacks import Callback

    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    other = build_base_model("tiny-llama")
    other.config.hidden_size = 32
    AutoModelForCausalLM.from_config(other.config).save_pretrained(tmp_path / "other")
    _peft_saved_adapter(tmp_path / "peft", tmp_path / "other", r=2, lora_alpha=4, target_modules=["v_proj"])
    bad = AdapterSpec("bad", rank=2, alpha=4, max_steps=2, batch_size=2, init_from=str(tmp_path / "peft"))
    dm = lambda: MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)})  # noqa: E731
    first = AdapterSpec("first", max_steps=4, batch_size=2)
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=[first, bad], max_running=1)  # (bad waits)
    with pytest.raises(UsageError, match=r"adapter 'bad': `init_from` '.*peft': weights for adapter 'bad' do not "
                                         r"fit it: other shapes: base_model\.model\.model\.layers\.0\.self_attn\.v_proj"
                                         r"\.lora_A\.weight \(2, 32\) \(adapter 'bad'.s is \(2, 64\)\)"):
        L.Trainer(**trainer_kwargs).fit(module, dm())
    assert module.registry["first"].step == 0

    class AddAtStep2(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                pl_module.add_adapter(bad)

    module = MultiLoRAModule(str(tmp_path / "base"), adapters=[first], export_dir=str(tmp_path / "out"),
                             validate_on_finish=False)
    with pytest.warns(UserWarning, match=r"adapter 'bad' could not start: .*other shapes"):
        L.Trainer(**trainer_kwargs, callbacks=[AddAtStep2()]).fit(module, dm())
    assert module.registry["first"].state == AdapterState.FINISHED and module.registry["first"].step == 4
    assert module.registry["bad"].state == AdapterState.FAILED and "bad" not in module.lora_layers.adapter_names
    assert (tmp_path / "out" / "first" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("folder", ["gone", "replaced"])
@pytest.mark.parametrize("targets", [None, ["v_proj"]])
def test_a_resumed_adapter_keeps_its_peft_folders_layers_without_the_folder(tmp_path, trainer_kwargs, targets,
                                                                           folder):
    """A resume makes the adapter's layers from the checkpoint (which then loads its weights): the `init_from`
    folder, read when it started, may be gone or hold another adapter now, and the same spec (the same config)
    resumes."""
    import shutil

    from lightning.pytorch.callbacks import ModelCheckpoint

    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", r=2, lora_alpha=4, target_modules=["v_proj"])
    spec = AdapterSpec("cont", rank=2, alpha=4, max_steps=4, batch_size=2, init_from=str(tmp_path / "peft"),
                       target_modules=targets)
    dm = lambda: MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)})  # noqa: E731
    kwargs = {**trainer_kwargs, "enable_checkpointing": True}
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    first = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], export_dir=str(tmp_path / "out"),
                            validate_on_finish=False)
    L.Trainer(**{**kwargs, "max_steps": 2}, callbacks=[checkpoint]).fit(first, dm())
    shutil.rmtree(tmp_path / "peft")
    if folder == "replaced":  # (another rank there now: it would not fit the spec)
        _peft_saved_adapter(tmp_path / "peft", tmp_path / "base", r=8, lora_alpha=4, target_modules=["q_proj"])
    again = MultiLoRAModule(str(tmp_path / "base"), adapters=[spec], export_dir=str(tmp_path / "out"),
                            validate_on_finish=False)
    L.Trainer(**kwargs).fit(again, dm(), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=2.ckpt"))
    assert again.registry["cont"].step == 4 and again.registry["cont"].state == AdapterState.FINISHED
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "out" / "cont" / "adapter_model.safetensors"))
    assert sorted(keys) == [f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_{ab}.weight"
                            for i in range(2) for ab in "AB"]
    # a new adapter whose folder is not there (or holds another adapter): named as it would start, before any step
    with pytest.raises(ValueError, match=r"`init_from` '.*peft' is no folder" if folder == "gone" else
                       r"`init_from` '.*peft' differs from the spec: rank=8 there, 2 in the spec"):
        L.Trainer(**trainer_kwargs).fit(MultiLoRAModule(str(tmp_path / "base"), adapters=[replace(spec, name="new")]),
                                        dm())


def test_a_saved_base_weight_is_this_bases_to_the_rounding_of_the_coarser_dtype():
    """PEFT ran in fp16 (the checkpoint's dtype) saves the head's base weight in fp16; the module loads that base
    in bf16: the same weights, refused as other base weights when compared in fp16 against bf16's rounding."""
    from lightning_multilora.layer import _same_values

    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0.02
    for saved_dtype, ours in [(torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16),
                              (torch.bfloat16, torch.float16), (torch.float16, torch.float16)]:
        saved = weight.to(saved_dtype)
        assert _same_values(saved, torch.nn.Parameter(weight.to(ours), requires_grad=False))
        other = saved.clone()
        other[3, 5] += 0.01
        assert not _same_values(other, torch.nn.Parameter(weight.to(ours), requires_grad=False))


def test_an_export_says_what_its_weights_are_and_a_built_in_base_how_it_was_built(tmp_path, trainer_kwargs):
    """The folder held nothing but the live step in `.multilora_run` (an EarlyExit export of step 3's weights said
    step 5), nor the seed and overrides of a built-in base (its name alone rebuilds another: PEFT's logits 1.5 off);
    `save_adapter(best=True)` without kept best weights wrote the live ones silently; a copy to a ``directory`` of
    weights just validated said no loss."""
    from lightning.pytorch.callbacks import Callback

    module = MultiLoRAModule("tiny-llama", base_seed=7, config_overrides={"num_hidden_layers": 1},
                             adapters=[AdapterSpec("a", rank=2, max_steps=6, batch_size=1)],
                             export_dir=str(tmp_path / "out"))
    said = []

    class SaveBest(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:  # (validated at 2)
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    pl_module.save_adapter("a", tmp_path / "copy", best=True)
                said.extend(str(w.message) for w in seen)

        def on_validation_end(self, trainer, pl_module):
            if trainer.global_step == 4:  # (validated at 4, now: the live weights' loss, which its copy says)
                pl_module.save_adapter("a", tmp_path / "now", best=False)
                said.append(pl_module.registry["a"].val_losses[-1])

    L.Trainer(**{**trainer_kwargs, "val_check_interval": 2}, callbacks=[SaveBest()]).fit(
        module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(50)}))
    rec = module.registry["a"]
    assert any("its best-validation weights (step 2, validation loss" in m and "`keep_best_weights` is off, as "
               "without EarlyExit): its weights of step 3 are written" in m for m in said), said
    copy = json.loads((tmp_path / "copy" / "multilora_export.json").read_text())
    assert copy["weights_step"] == 3 and copy["val_loss"] is None  # (not measured at step 3)
    now = json.loads((tmp_path / "now" / "multilora_export.json").read_text())  # (it said null: a directory given)
    assert said[-1][0] == 4 and (now["weights_step"], now["val_loss"]) == (4, pytest.approx(said[-1][1]))
    info = json.loads((tmp_path / "out" / "a" / "multilora_export.json").read_text())
    assert info == {"adapter": "a", "run": module._run_id, "state": "finished", "reason": rec.reason,
                    "weights_step": 6, "steps_trained": 6, "val_loss": pytest.approx(rec.val_losses[-1][1]),
                    "base": {"base_seed": 7, "config_overrides": {"num_hidden_layers": 1}}}
    rebuilt = build_base_model("tiny-llama", info["base"]["config_overrides"], seed=info["base"]["base_seed"])
    theirs = dict(rebuilt.named_parameters())
    ours = {n.replace(".base.", "."): p for n, p in module.model.named_parameters() if "lora_" not in n}
    assert ours.keys() == theirs.keys() and all(torch.equal(p, theirs[n]) for n, p in ours.items())


def test_a_built_in_base_built_and_given_as_a_module_says_how_it_was_built(tmp_path, trainer_kwargs):
    """`build_base_model("tiny-llama", seed=7)` given to the module exported as "tiny-llama" alone: its loader built
    seed 0's weights, another base, unsaid."""
    model = build_base_model("tiny-llama", {"num_hidden_layers": 1}, seed=7)
    module = MultiLoRAModule(model, adapters=[AdapterSpec("a", rank=2, max_steps=1, batch_size=1)],
                             export_dir=str(tmp_path / "out"), validate_on_finish=False)
    L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(20)}))
    info = json.loads((tmp_path / "out" / "a" / "multilora_export.json").read_text())
    assert info["base"] == {"base_seed": 7, "config_overrides": {"num_hidden_layers": 1}}
    rebuilt = build_base_model("tiny-llama", info["base"]["config_overrides"], seed=info["base"]["base_seed"])
    assert all(torch.equal(p, dict(rebuilt.named_parameters())[n]) for n, p in model.named_parameters()
               if "lora_" not in n and ".base." not in n)
    plain = MultiLoRAModule(build_base_model("tiny-llama"), adapters=[AdapterSpec("b", rank=2, max_steps=1)],
                            export_dir=str(tmp_path / "out"), validate_on_finish=False)
    assert plain._export_base() == {}  # (seed 0, the name's own: nothing to say)


def test_an_export_of_one_of_a_fused_pair_on_a_moe_base_loads_in_peft(tmp_path, trainer_kwargs):
    """PEFT 0.22 reads a bare `gate_proj` in `target_modules` on a mixture-of-experts base as the fused experts'
    `gate_up_proj` too: an export of the dense / shared-expert `gate_proj` without `up_proj` was refused ("Cannot
    convert PEFT target(s) gate_proj without also targeting up_proj"), unsaid as it was written. Written by full name,
    it loads, and answers as the module does."""
    import peft
    from packaging.version import Version
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig

    if Version(peft.__version__) < Version("0.22.0"):
        pytest.skip("PEFT before 0.22 leaves such layers out, and the export says so (the test below)")
    config = AutoConfig.for_model("qwen2_moe", vocab_size=258, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    spec = AdapterSpec("a", rank=2, alpha=4, lr=1e-2, max_steps=10, target_modules=["q_proj", "gate_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("all-linear" leaves the fused experts and the router: said)
        module = MultiLoRAModule(str(tmp_path / "base"), export_dir=str(tmp_path / "e"), validate_on_finish=False,
                                 adapters=[spec])  # (held at the Trainer's stop: its weights are the export's)
        data = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40)})
        L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(module, data)
    written = json.loads((tmp_path / "e" / "a" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == ["model.layers.0.mlp.shared_expert.gate_proj",
                               "model.layers.1.mlp.shared_expert.gate_proj", "q_proj"], written
    _assert_peft_logits(module, "a", tmp_path / "base", tmp_path / "e" / "a")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "e" / "a")
    assert not [k for k in get_peft_model_state_dict(loaded) if "experts." in k]  # (no untrained LoRA on them)


def test_an_export_whose_layers_peft_takes_for_fused_experts_is_warned_of(tmp_path, trainer_kwargs):
    """On a DeepSeek-V3 base (V2, GLM-4-MoE, Qwen3-Next... alike) PEFT's loader reads targets named as the experts'
    projections as the fused experts' parameters: the dense layer's and the shared experts' trained `gate_proj` /
    `up_proj` / `down_proj`, plain linears, were not loaded, and the loaded adapter answered otherwise than the
    module's, unsaid."""
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v3", vocab_size=300, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("all-linear" leaves the fused experts and the router: said)
        module = MultiLoRAModule(str(tmp_path / "base"), export_dir=str(tmp_path / "e"), validate_on_finish=False,
                                 adapters=[AdapterSpec("a", rank=2, max_steps=1)])
    import peft
    from packaging.version import Version

    fixed = Version(peft.__version__) >= Version("0.22.0")  # (PEFT's #3711 / #3945: linear targets stay modules)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40)}))
    said = [str(w.message) for w in seen if "PEFT's `PeftModel.from_pretrained` takes its layers" in str(w.message)]
    assert len(said) == (0 if fixed else 1)
    assert all(re.search(r"adapter 'a': PEFT's `PeftModel.from_pretrained` takes its layers named as a deepseek_v3 "
                         r"base's expert projections \(\['model.layers.0.mlp.", s) for s in said)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        loaded = PeftModel.from_pretrained(base, tmp_path / "e" / "a")
    held = get_peft_model_state_dict(loaded)
    # (as the warning says: PEFT before 0.22 left them out; from 0.22 on it loads them, and nothing is said)
    assert any("layers.0.mlp.gate_proj" in k for k in held) == fixed
    assert any("kv_b_proj" in k for k in held)
