"""AdapterSpec validation and SweepGrid expansion."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from lightning_multilora import AdapterSpec, SweepGrid


@pytest.mark.parametrize("field, value, message", [
    ("rank", 0, "`rank` must be an integer >= 1"),
    ("rank", -3, "`rank` must be an integer >= 1"),
    ("alpha", 0, "`alpha` must be a finite number > 0"),
    ("alpha", -1.0, "`alpha` must be a finite number > 0"),
    ("alpha", math.inf, "`alpha` must be a finite number > 0"),
    ("lr", 0.0, "`lr` must be a number in \\(0, 1e30\\]"),
    ("lr", 1e38, "`lr` must be a number in \\(0, 1e30\\]"),  # (it overflowed in the step, stopping every adapter)
    ("lr", -1e-4, "`lr` must be a number in \\(0, 1e30\\]"),
    ("lr", math.inf, "`lr` must be a number in \\(0, 1e30\\]"),
    ("batch_size", 0, "`batch_size` must be an integer >= 1"),
    ("batch_size", True, "`batch_size` must be an integer >= 1"),
    ("seed", True, "`seed` must be an integer of magnitude below 2\\*\\*42"),
    ("seed", 2**70, "`seed` must be an integer of magnitude below 2\\*\\*42"),  # (overflowed at the fit's start)
    ("use_rslora", "yes", "`use_rslora` must be True or False"),
    ("dataset", 123, "`dataset` must be a data source's name or None"),
    ("dropout", 1.0, "`dropout` must be a number in \\[0, 1\\)"),
    ("weight_decay", -0.1, "`weight_decay` must be a finite number >= 0"),
    ("weight_decay", math.inf, "`weight_decay` must be a finite number >= 0"),
    ("max_steps", 0, "`max_steps` must be an integer >= 1"),
    ("max_epochs", -1.0, "`max_epochs` must be a finite number > 0"),
    ("lr_schedule", "step", "`lr_schedule` must be one of constant, linear, cosine, got 'step'"),
    # (transformers' names for them: answered with the bare list)
    ("lr_schedule", "constant_with_warmup", "one of constant, linear, cosine \\(transformers' constant_with_warmup is "
                                            "our `constant`, which warms up over `warmup_steps`\\), got"),
    ("lr_schedule", "cosine_with_restarts", "cosine \\(transformers' cosine_with_restarts schedule has no "
                                            "counterpart here\\), got 'cosine_with_restarts'"),
    ("objective", "DPO", "`objective` must be one of sft, dpo, got 'DPO'"),
    ("grad_clip", 0.0, "`grad_clip` must be a finite number > 0 or None"),
    ("warmup_steps", -1, "`warmup_steps` must be an integer >= 0"),
    ("target_modules", [], "`target_modules` must be a non-empty list"),
])
def test_bad_values_name_the_field_and_the_allowed_values(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        AdapterSpec("x", **{field: value})
    assert str(err.value).endswith("for adapter 'x'")  # (which adapter of a config's list)


def test_numpy_scalars_are_taken_as_python_numbers():
    np = pytest.importorskip("numpy")
    spec = AdapterSpec("x", rank=np.int64(4), lr=np.float32(1e-3), batch_size=np.int32(2), alpha=np.float64(8))
    assert (spec.rank, spec.batch_size) == (4, 2) and type(spec.rank) is int and type(spec.lr) is float
    assert spec.lr == pytest.approx(1e-3) and spec.to_dict()["alpha"] == 8.0
    with pytest.raises(ValueError, match="`rank` must be an integer >= 1, got 0"):
        AdapterSpec("x", rank=np.int64(0))
    # np.float64 is a float and np.bool_ no Number: Python's too, or YAML and weights-only checkpoint loads refuse them
    spec = AdapterSpec("y", lr=np.float64(2e-3), use_rslora=np.bool_(True), weight_decay=np.float64(0.0))
    assert (type(spec.lr), type(spec.use_rslora), type(spec.weight_decay)) == (float, bool, float)
    import io

    import yaml

    yaml.safe_dump(spec.to_dict())
    buffer = io.BytesIO()
    torch.save(spec.to_dict(), buffer)
    buffer.seek(0)
    assert AdapterSpec.from_dict(torch.load(buffer, weights_only=True)) == spec


@pytest.mark.parametrize("name", ["", "a.b", "a b", "a/b", None, "best\n", "x" * 201])
def test_bad_names(name):
    """Names become export directories: no path characters, no trailing newline, within a file name's length."""
    with pytest.raises(ValueError, match="`name` must be 1 to 200 letters, digits, '_' or '-'"):
        AdapterSpec(name)
    assert AdapterSpec("x" * 200).name == "x" * 200


@pytest.mark.parametrize("name", ["eval", "train", "to", "parameters"])
def test_names_taken_by_torch_modules_are_refused(name):
    with pytest.raises(ValueError, match=f"`name` '{name}' is taken by torch.nn.Module"):
        AdapterSpec(name)


def test_steps_and_epochs_are_exclusive_and_default_to_100_steps():
    with pytest.raises(ValueError, match="exclusive"):
        AdapterSpec("x", max_steps=3, max_epochs=1.0)
    assert AdapterSpec("x").max_steps == 100
    assert AdapterSpec("x", max_epochs=2).max_steps is None


def test_a_copy_by_epochs_of_a_spec_given_neither_length_is_told_to_drop_the_default_steps():
    """A spec given neither length holds max_steps=100; `dataclasses.replace(spec, max_epochs=2)` (what a held spec's
    error advised) was refused for a max_steps=100 the user never gave, with no way out named."""
    import dataclasses

    spec = AdapterSpec("a", lr=1e-3)
    with pytest.raises(ValueError, match=r"exclusive; got max_steps=100, max_epochs=2 for adapter 'b' \(a spec given "
                                         r"neither holds the default max_steps=100: `dataclasses.replace\(spec, "
                                         r"max_steps=None, max_epochs=...\)` trains by epochs\)"):
        dataclasses.replace(spec, name="b", max_epochs=2)
    spec.hold()
    with pytest.raises(AttributeError, match=r"dataclasses.replace\(spec, name=..., max_epochs=..., max_steps=None\)"):
        spec.max_epochs = 2
    copy = dataclasses.replace(spec, name="b", max_epochs=2, max_steps=None)  # (as advised)
    assert (copy.max_steps, copy.max_epochs, copy.lr) == (None, 2, 1e-3)
    copy.hold()
    with pytest.raises(AttributeError, match=r"replace\(spec, name=..., max_steps=..., max_epochs=None\)"):
        copy.max_steps = 5
    with pytest.raises(AttributeError, match=r"replace\(spec, name=..., lr=...\)\)`"):
        spec.lr = 1.0


def test_a_str_enum_value_is_kept_as_its_plain_text():
    """transformers' `SchedulerType.COSINE` (what `TrainingArguments.lr_scheduler_type` holds) was kept as the enum:
    it trained, and the checkpoint it wrote could be neither resumed nor loaded (a weights-only load refuses its
    class)."""
    import io

    transformers = pytest.importorskip("transformers")
    spec = AdapterSpec("x", lr_schedule=transformers.SchedulerType.COSINE)
    assert type(spec.lr_schedule) is str and spec.lr_schedule == "cosine"
    buffer = io.BytesIO()
    torch.save(spec.to_dict(), buffer)
    buffer.seek(0)
    assert AdapterSpec.from_dict(torch.load(buffer, weights_only=True)) == spec
    from lightning_multilora.module import _plain

    assert _plain({"a": ["cosine", 1, 2.0, None, True]}) and not _plain({"a": [transformers.SchedulerType.COSINE]})
    from collections import OrderedDict, defaultdict

    assert _plain(OrderedDict(a=(1, "x"))) and not _plain(defaultdict(int, a=1))  # (as a weights-only load takes)


def test_a_specs_warnings_point_at_the_line_that_made_it():
    """Placed in spec.py, a warning was said once a process, whichever line of the user's made the next spec."""
    with pytest.warns(UserWarning, match="applies to objective='dpo' alone") as caught:
        AdapterSpec("a", dpo_beta=0.3)
    with pytest.warns(UserWarning, match="never reaches") as late:
        AdapterSpec("b", max_steps=2, warmup_steps=3)
    assert {w.filename for w in [*caught, *late]} == {__file__}


def test_a_warmup_as_long_as_the_run_is_warned_of():
    with pytest.warns(UserWarning, match=r"adapter 'a': warmup_steps=10 >= max_steps=10.*never reaches lr=0.001 "
                                         r"\(it ends at 0.9 x lr\)") as caught:
        spec = AdapterSpec("a", lr=1e-3, max_steps=10, warmup_steps=10)
    assert len(caught) == 1 and spec.warmup_steps == 10  # (a warning, not an error: the spec is made)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        AdapterSpec("b", max_steps=10, warmup_steps=9)
        AdapterSpec("c", max_epochs=1, warmup_steps=500)  # (steps of an epoch: unknown here)
    assert [str(w.message) for w in quiet] == []


def test_scaling_is_alpha_over_r_or_rslora():
    assert AdapterSpec("x", rank=8, alpha=16).scaling == 2.0
    assert AdapterSpec("x", rank=16, alpha=8, use_rslora=True).scaling == 2.0


def test_round_trip_through_a_dict():
    spec = AdapterSpec("x", rank=3, lr=1e-3, target_modules=["q_proj"], dataset="d", seed=5)
    assert AdapterSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown AdapterSpec fields"):
        AdapterSpec.from_dict({"name": "x", "rnak": 3})
    with pytest.raises(ValueError, match=r"\['lora_alpha'\].*allowed: .*'alpha'.*PEFT's names: lora_alpha -> `alpha`"):
        AdapterSpec.from_dict({"name": "x", "lora_alpha": 3})


def test_peft_spellings_are_named_with_this_packages_field():
    """A PEFT user's ``LoraConfig`` keywords gave the dataclass's bare "unexpected keyword argument"."""
    with pytest.raises(TypeError, match=r"unknown fields \['lora_alpha', 'r', 'use_dora'\]; allowed: \[.*'rank'.*\] "
                                        r"\(PEFT's names: lora_alpha -> `alpha`; r -> `rank`; use_dora: not supported"):
        AdapterSpec("x", r=8, lora_alpha=16, use_dora=True)
    # (an optimizer's settings and accumulation: the bare list of fields said nowhere where they go)
    with pytest.raises(TypeError, match=r"betas -> the module's `optimizer` and `optimizer_kwargs` \(one optimizer, "
                                        r"every adapter's.*gradient_accumulation_steps -> `batch_size`"):
        AdapterSpec("x", betas=(0.9, 0.95), gradient_accumulation_steps=4)
    with pytest.raises(TypeError, match=r"unknown fields \['rnak'\]; allowed: .*'init_from'.*'weight_decay'\]$"):
        AdapterSpec("x", rnak=3)
    # (TRL's DPOConfig spellings: "unknown fields ['beta']" and the list alone)
    with pytest.raises(TypeError, match=r"\(TRL's names: beta -> `dpo_beta` \(with objective='dpo'\); loss_type: not "
                                        r"supported: the sigmoid DPO loss alone"):
        AdapterSpec("x", objective="dpo", beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match=r"max_prompt_length -> MultiLoRADataModule's `max_length` and `truncate`"):
        AdapterSpec.from_dict({"name": "x", "max_prompt_length": 128})
    assert AdapterSpec("x", 4).rank == 4  # positional fields as before
    assert AdapterSpec("x", init_from=Path("runs") / "a").init_from == str(Path("runs") / "a")
    for bad in ("", 3):
        with pytest.raises(ValueError, match=r"`init_from` must be a PEFT adapter folder's path or None"):
            AdapterSpec("x", init_from=bad)


def test_target_modules_take_what_the_modules_take():
    """A string was always one name: "all-linear" and a regex (PEFT's forms, which the module takes) were refused as
    no injected layer's; a number failed with a bare TypeError."""
    assert AdapterSpec("x", target_modules="all-linear").target_modules == "all-linear"
    assert AdapterSpec("x", target_modules=r".*\.(q|v)_proj").target_modules == r".*\.(q|v)_proj"
    assert AdapterSpec("x", target_modules="self_attn.q_proj").target_modules == ["self_attn.q_proj"]  # a name
    for value in (3, "", [], ["q_proj", 3]):
        with pytest.raises(ValueError, match=r"`target_modules` must be a non-empty list of module names, one name, "
                                             r"'all-linear' or a regex"):
            AdapterSpec("x", target_modules=value)
    spec = AdapterSpec("x", target_modules="all-linear")
    assert AdapterSpec.from_dict(spec.to_dict()) == spec
    # PEFT's `LoraConfig` holds its targets as a set and matches "all-linear" in any case: both were refused
    assert AdapterSpec("x", target_modules={"v_proj", "q_proj"}).target_modules == ["q_proj", "v_proj"]
    assert AdapterSpec("x", target_modules=frozenset({"o_proj"})).target_modules == ["o_proj"]
    assert AdapterSpec("x", target_modules="ALL-LINEAR").target_modules == "all-linear"


def test_grid_is_the_cartesian_product_with_readable_unique_names():
    grid = SweepGrid(axes={"lr": [1e-5, 2.5e-4], "rank": [16, 32], "batch_size": [1, 8]}, base={"max_steps": 7},
                     alpha_over_rank=2)
    specs = grid.specs()
    assert len(specs) == 8 and len({s.name for s in specs}) == 8
    assert specs[0].name == "lr1e-5-rank16-bs1"
    assert specs[-1].name == "lr2p5e-4-rank32-bs8"
    assert all(s.alpha == 2 * s.rank and s.max_steps == 7 for s in specs)
    with pytest.raises(ValueError, match="not an AdapterSpec field"):
        SweepGrid(axes={"learning_rate": [1e-4]}).specs()
    # an alpha given beside alpha_over_rank would be replaced (the names would still say the given one)
    for axes, base, where in [({"alpha": [8, 32], "rank": [8]}, {}, "axes"), ({"rank": [8]}, {"alpha": 64}, "base")]:
        with pytest.raises(ValueError, match=rf"`alpha_over_rank` \(2\) and `alpha` \(in {where}\) both set"):
            SweepGrid(axes=axes, base=base, alpha_over_rank=2).specs()
    assert [s.alpha for s in SweepGrid(axes={"alpha": [8, 32]}).specs()] == [8, 32]
    # a field in both axes and base: the axis' values replaced the base's without a word (`--model.grid.base.lr`)
    with pytest.raises(ValueError, match=r"SweepGrid: \['lr'\] in both `axes` and `base`: an axis sets each "
                                         r"adapter's value, so the base's would change nothing"):
        SweepGrid(axes={"lr": [1e-3, 4e-3]}, base={"lr": 5e-4, "max_steps": 7}).specs()
    # values that make one name: named, not left to the module's duplicate-name error
    with pytest.raises(ValueError, match=r"the axes' values \{'lr': 0.0001\} and \{'lr': 0.00010001\} make one "
                                         r"adapter name, 'lr1e-4' \(a name keeps a float's 4 significant digits below "
                                         r"0.01, 6 from there"):
        SweepGrid(axes={"lr": [1e-4, 1.0001e-4]}).specs()
    with pytest.raises(ValueError, match=r"make one adapter name, 'lr0p0200001'"):
        SweepGrid(axes={"lr": [0.02000011, 0.0200001]}).specs()
    # a name in `base` was "not an AdapterSpec field"
    with pytest.raises(ValueError, match=r"SweepGrid sets `name`: each adapter's name is made for it \(a grid's from "
                                         r"its `prefix` and axes' values"):
        SweepGrid(axes={"rank": [8]}, base={"name": "mine"}).specs()
    # an empty grid, and a ratio that is not a number (a string of one multiplied the name: alpha 2222.0)
    with pytest.raises(ValueError, match=r"SweepGrid `axes` must be a non-empty mapping .* got \{\}"):
        SweepGrid(axes={}).specs()
    for ratio in ("2", 0, True):
        with pytest.raises(ValueError, match=r"SweepGrid `alpha_over_rank` must be a number > 0 or None"):
            SweepGrid(axes={"rank": [8]}, alpha_over_rank=ratio).specs()
    with pytest.raises(ValueError, match=r"SweepGrid `base` must be a mapping of AdapterSpec field -> value, got None"):
        SweepGrid(axes={"rank": [8]}, base=None).specs()
    for prefix in (3, "a/b"):  # (a number failed in a string concatenation; a "/" was blamed on `name`)
        with pytest.raises(ValueError, match=r"SweepGrid `prefix` must be a string of letters, digits, '_' and '-'"):
            SweepGrid(axes={"rank": [8]}, prefix=prefix).specs()
    assert SweepGrid(axes={"rank": [8]}, prefix="run1-").specs()[0].name == "run1-rank8"


@pytest.mark.parametrize("value", ["cosine", 1e-3, []])
def test_a_grid_axis_must_be_a_list_of_values(value):
    with pytest.raises(ValueError, match="SweepGrid `axes\\['lr'\\]` must be a non-empty list of values"):
        SweepGrid(axes={"lr": value}).specs()


def test_a_dpo_beta_on_an_sft_adapter_is_warned_of():
    """`dpo_beta` without `objective="dpo"` trained plain SFT, silently (the report then showed no beta)."""
    with pytest.warns(UserWarning, match=r"`dpo_beta` applies to objective='dpo' alone; an SFT adapter ignores it"):
        AdapterSpec("x", dpo_beta=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdapterSpec("y", objective="dpo", dpo_beta=0.5)
        AdapterSpec("z")
    # a grid over objectives with one beta: its SFT cells take no beta, unwarned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = SweepGrid(axes={"objective": ["sft", "dpo"]}, base={"dpo_beta": 0.5}).specs()
    assert [(s.objective, s.dpo_beta) for s in specs] == [("sft", 0.1), ("dpo", 0.5)]
    # and a beta axis: one SFT cell, named without it (each beta made an SFT adapter of its own, named for a beta it
    # trained without)
    specs = SweepGrid(axes={"objective": ["sft", "dpo"], "dpo_beta": [0.1, 0.5], "rank": [2, 4]}).specs()
    assert [(s.name, s.dpo_beta) for s in specs] == [
        ("objectivesft-rank2", 0.1), ("objectivesft-rank4", 0.1), ("objectivedpo-dpo_beta0p1-rank2", 0.1),
        ("objectivedpo-dpo_beta0p1-rank4", 0.1), ("objectivedpo-dpo_beta0p5-rank2", 0.5),
        ("objectivedpo-dpo_beta0p5-rank4", 0.5)]
    # a beta axis on a grid with no DPO adapter: its values vanished without a word (2 x 2 made 2 adapters), and
    # alone it made an adapter with no name ("`name` must be 1 to 200 letters ..., got ''")
    for axes, base in [({"lr": [1e-3, 2e-3], "dpo_beta": [0.1, 0.5]}, {}), ({"dpo_beta": [0.1, 0.5]}, {}),
                       ({"dpo_beta": [0.1], "objective": ["sft"]}, {"rank": 2})]:
        with pytest.raises(ValueError, match=r"SweepGrid `axes\['dpo_beta'\]` applies to objective='dpo' alone, and "
                                             r"no adapter of the grid has it \(objective 'sft'\)"):
            SweepGrid(axes=axes, base=base).specs()
    specs = SweepGrid(axes={"dpo_beta": [0.2, 0.5]}, base={"objective": "dpo"}).specs()
    assert [s.dpo_beta for s in specs] == [0.2, 0.5]


def test_a_grids_bad_rank_beside_alpha_over_rank_is_the_ranks_own_error():
    """With `alpha_over_rank`, a rank that is no integer raised Python's TypeError (or, "8" x 2, made alpha 88.0)
    before the spec's check named `rank`."""
    for rank in ("8", None, [8], 0):
        with pytest.raises(ValueError, match=r"`rank` must be an integer >= 1, got "):
            SweepGrid(axes={"rank": [rank]}, alpha_over_rank=2).specs()
    with pytest.raises(ValueError, match=r"SweepGrid `alpha_over_rank` 1e\+308 x rank 8 makes alpha inf; alpha must "
                                         r"be finite"):
        SweepGrid(axes={"rank": [8]}, alpha_over_rank=1e308).specs()
    assert [s.alpha for s in SweepGrid(axes={"rank": [3, 8]}, alpha_over_rank=0.5).specs()] == [1.5, 4.0]
