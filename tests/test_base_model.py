"""Loading the frozen base: built-in configs, local checkpoints, and the errors for names and fields that are typos."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_multilora.base_model import build_base_model


def test_a_near_miss_of_a_built_in_name_is_refused_at_once():
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"`base_model` 'tiny-lama'.*tiny-llama, tiny-qwen2, tiny-mistral.*"
                                         r"did you mean 'tiny-llama'"):
        build_base_model("tiny-lama")
    assert time.monotonic() - started < 5  # (no Hub retries: those took ~45 s)


def test_a_local_checkpoint_loads_even_where_its_name_is_near_a_built_in(tmp_path, monkeypatch):
    built = build_base_model("tiny-llama", {"num_hidden_layers": 1}, seed=3)
    monkeypatch.chdir(tmp_path)
    built.save_pretrained("tiny-lama")
    loaded = build_base_model("tiny-lama")
    assert loaded.config.num_hidden_layers == 1
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, built(ids).logits)


def test_a_name_that_loads_nothing_names_the_built_in_models(tmp_path):
    """A directory without a checkpoint (a quick failure: no Hub call), as any name nothing loads: the error lists the
    built-in models beside the loader's own reason."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises((OSError, ValueError), match=r"`base_model` '.*not-a-model' is no built-in model \(tiny-llama, tiny-qwen2, "
                                      r"tiny-mistral\), no local checkpoint directory, and could not be loaded"):
        build_base_model(str(empty))


def test_config_overrides_take_effect_and_a_misspelled_field_is_refused():
    model = build_base_model("tiny-llama", {"num_hidden_layers": 1, "rope_theta": 5e5})  # (a legacy name converted)
    assert model.config.num_hidden_layers == 1 and model.config.rope_parameters["rope_theta"] == 5e5
    assert build_base_model("tiny-mistral", {"sliding_window": 8}).config.sliding_window == 8
    with pytest.raises(ValueError, match=r"`config_overrides`.*llama.*'hidden_sizee' \(did you mean 'hidden_size'\?\)"):
        build_base_model("tiny-llama", {"hidden_sizee": 32})
    # no field, and near none: set as given, with a warning (Qwen2's modeling code reads `head_dim` if it is there)
    with pytest.warns(UserWarning, match=r"`config_overrides` \['head_dim'\] are no fields of a qwen2 config"):
        model = build_base_model("tiny-qwen2", {"head_dim": 32})
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32


@pytest.mark.parametrize("overrides", [{"num_attention_heads": 5}, {"hidden_size": 100}, {"num_key_value_heads": 3},
                                       {"vocab_size": 0}, {"num_hidden_layers": 0}, {"hidden_size": "big"}])
def test_config_overrides_that_break_the_model_are_named(overrides):
    """Overrides that make a config transformers refuses (heads that do not divide the width, an odd rotary
    dimension), a model that builds but cannot run (key / value heads that do not divide the heads) or one with no
    layer to adapt: the error names `config_overrides` and what they were (transformers' own message named neither,
    and some failed only at the first training step)."""
    with pytest.raises(ValueError, match=r"`config_overrides` \{.*\} make a model that cannot be built or run"):
        build_base_model("tiny-llama", overrides)


@pytest.mark.parametrize("overrides", [{"num_attention_heads": 5}, {"num_hidden_layers": 0},
                                       {"num_key_value_heads": 3}])
def test_config_overrides_that_break_a_checkpoint_are_named(tmp_path, overrides):
    """As for a built-in model: a config refused, no layer to adapt, a model that loads but cannot run one token."""
    build_base_model("tiny-llama", {"num_hidden_layers": 1}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"`config_overrides` \{.*\} make a model"):
        build_base_model(str(tmp_path), overrides)
    assert build_base_model(str(tmp_path), {"rms_norm_eps": 1e-5}).config.rms_norm_eps == 1e-5


def test_a_checkpoints_config_takes_legacy_names_and_keeps_the_rest(tmp_path):
    """``rope_theta`` on a checkpoint (transformers 5 keeps it in ``rope_parameters``) reached the model's
    ``__init__`` and failed; it is now merged into the checkpoint's group, whose scaling type and factor stay."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    build_base_model("tiny-llama", {"num_hidden_layers": 1, "rope_parameters": rope}).save_pretrained(tmp_path)
    model = build_base_model(str(tmp_path), {"rope_theta": 5e5, "max_position_embeddings": 512})
    assert model.config.rope_parameters == {**rope, "rope_theta": 5e5}
    assert model.config.max_position_embeddings == 512 and model.config.num_hidden_layers == 1
    # a value equal to the config class's default is taken too (it was dropped as "unchanged", silently)
    assert build_base_model(str(tmp_path), {"rope_theta": 10000.0}).config.rope_parameters["rope_theta"] == 10000.0
    build_base_model("tiny-llama", {"num_hidden_layers": 1, "rope_parameters": {**rope, "rope_theta": 5e5}}
                     ).save_pretrained(tmp_path / "b")
    assert build_base_model(str(tmp_path / "b"), {"rope_theta": 10000.0}).config.rope_parameters == rope
    with pytest.raises(ValueError, match=r"'hidden_sizee' \(did you mean 'hidden_size'\?\)"):
        build_base_model(str(tmp_path), {"hidden_sizee": 32})


def test_errors_the_overrides_did_not_cause_are_not_blamed_on_them(tmp_path, monkeypatch):
    """A checkpoint without its weights raises transformers' OSError with overrides as without; out of memory while
    building stays out of memory."""
    build_base_model("tiny-llama", {"num_hidden_layers": 1}).save_pretrained(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(OSError) as err:
        build_base_model(str(tmp_path), {"rms_norm_eps": 1e-5})
    assert "config_overrides" not in str(err.value)

    import transformers

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        build_base_model("tiny-llama", {"rms_norm_eps": 1e-5})
