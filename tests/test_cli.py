"""The `multilora` command and the examples' configs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_multilora.cli import demo_config, main

ROOT = Path(__file__).resolve().parents[1]
LOAD_EXAMPLE = ROOT / "examples" / "load_with_peft.py"


def run_example(script: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python script args`` in ``cwd``, run in this process as its ``__main__`` (a process of its own spent 8 s
    importing torch, transformers and PEFT again): its exit code, its output and its errors, warnings with them."""
    import contextlib
    import io
    import runpy

    out, err, argv, code = io.StringIO(), io.StringIO(), sys.argv, 0
    sys.argv = [str(script), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd), \
                warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exit:  # (a message: printed, exit code 1, as Python does)
                code = 1 if isinstance(exit.code, str) else exit.code or 0
                print(exit.code, file=sys.stderr) if isinstance(exit.code, str) else None
    finally:
        sys.argv = argv
    errors = err.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                                      for w in said)
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code, out.getvalue(), errors)


SMALL_DEMO = """
trainer:
  callbacks:
    - class_path: lightning_multilora.callbacks.OptunaSweep
      init_args:
        sampler: grid
        n_trials: 4
        search_space:
          lr: {type: categorical, choices: [1.0e-3, 4.0e-3]}
          rank: {type: categorical, choices: [2, 4]}
        base: {max_steps: 10, batch_size: 2}
    - class_path: lightning_multilora.callbacks.WarmupSelection
      init_args: {warmup_fraction: 0.2}
    - class_path: lightning_multilora.callbacks.EarlyExit
data:
  sources:
    arithmetic: {class_path: lightning_multilora.data.GeneratedArithmetic, init_args: {num_examples: 200}}
"""


def test_demo_config_runs_a_small_sweep_and_reports(tmp_path, capsys):
    override = tmp_path / "small.yaml"
    override.write_text(SMALL_DEMO)
    main(["demo", "--config", str(override), "--trainer.default_root_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false"])
    out = capsys.readouterr().out
    assert "Adapters ranked by export_loss, the validation loss of the weights their exports hold" in out
    assert "trial-3" in out
    summary = json.loads(next(tmp_path.rglob("sweep_summary.json")).read_text())
    assert len(summary) == 4 and sorted(row["status"] for row in summary) == ["finished", "pruned", "pruned", "pruned"]
    assert all((Path(row["export_path"]) / "adapter_model.safetensors").is_file() for row in summary)
    assert list(tmp_path.rglob("events.out.tfevents.*")) and list(tmp_path.rglob("optuna.db"))


def test_example_yaml_parses_with_the_cli_parser(tmp_path):
    from lightning_multilora.cli import MultiLoRACLI
    from lightning_multilora.data.datamodule import MultiLoRADataModule
    from lightning_multilora.module import MultiLoRAModule

    cli = MultiLoRACLI(MultiLoRAModule, MultiLoRADataModule, run=False,
                       args=["--config", str(ROOT / "examples" / "sweep.yaml"),
                             "--trainer.default_root_dir", str(tmp_path)])
    names = [r.name for r in cli.model.registry]
    assert names[:2] == ["baseline", "attention-only"] and len(names) == 6
    assert cli.model.max_running == 8 and set(cli.datamodule.sources) == {"arith", "mul"}


@pytest.mark.parametrize("override, message", [
    (["--model.grid", "{axes: {lr: [1.0e-3]}, base: {max_steps: 0}}"], "`max_steps` must be an integer >= 1, got 0"),
    (["--model.adapters", "[{name: a, rank: -1}]"], "`rank` must be an integer >= 1, got -1 for adapter 'a'"),
    (["--model.adapters", "[{name: a, dropout: 1.5}]"], "`dropout` must be a number in [0, 1), got 1.5"),
    (["--data.max_val_examples", "0"], "`max_val_examples` must be an integer >= 1 or None"),
    (["--model.base_model", "./nonexistent/ckpt"], "`base_model` './nonexistent/ckpt' is no built-in model"),
    # (LightningCLI's own optimizer and scheduler would replace the module's per-adapter ones, silently)
    (["--optimizer", "SGD", "--optimizer.lr", "0.5"], "unrecognized arguments: --optimizer SGD"),
    (["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1"], "unrecognized arguments: --lr_scheduler"),
    # (a callback's own message alone: jsonargparse's forms of a subclass were appended)
    (["--trainer.callbacks", "[{class_path: lightning_multilora.callbacks.EarlyExit, init_args: {window: 1}}]"],
     "error: EarlyExit: `window` must be an integer >= 2, got 1\n"),
    # (jsonargparse told the user to enable subclasses of AdapterSpec, which would not help)
    (["--model.adapters", "[{class_path: peft.LoraConfig, init_args: {r: 8}}]"],
     "`model.adapters`: an adapter is AdapterSpec's fields given directly (name, rank, alpha, dropout, "),
])
def test_bad_config_values_are_clear_errors(tmp_path, capsys, override, message):
    """Refused with the class's own message, as a parse error is (usage, then "error: ..."), not under a traceback."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), *override, "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err
    assert "Traceback" not in err and "Union subtypes" not in err and "Namespace(" not in err


def test_an_adapter_parallel_checkpoint_resumed_in_one_process_is_a_named_error(tmp_path, capsys):
    """Its checkpoint is a folder of one file per process: `multilora fit --ckpt_path` in one process says what it
    needs (the load failed with a bare IsADirectoryError), as a usage error."""
    folder = tmp_path / "epoch=0-step=4.ckpt"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank{rank}.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path),
              "--ckpt_path", str(folder)])
    err = capsys.readouterr().err.replace("\n", " ")
    assert done.value.code == 2 and re.search(
        r"`ckpt_path` .* is an adapter-parallel checkpoint, one file per process \(rank0.ckpt, rank1.ckpt\): it "
        r"resumes with strategy='adapter_parallel' \(over any number of processes", err), err
    # from Python too (the load's bare IsADirectoryError), the strategy's checkpoint IO otherwise unchanged
    import lightning as L

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule

    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, max_steps=1)])
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"`ckpt_path` .* is an adapter-parallel checkpoint, one file per process"):
        trainer.fit(module, MultiLoRADataModule(), ckpt_path=str(folder))
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    assert (tmp_path / "one.ckpt").is_file()


@pytest.mark.parametrize("name", ["config.yaml", "sweep_summary.json", "optuna.db", ".multilora_log"])
def test_a_run_into_another_runs_log_directory_is_refused_unless_it_resumes_it(tmp_path, capsys, name):
    """Without a logger the log directory is the root: a second run there continued the first's study and wrote over
    its config and summary, silently."""
    (tmp_path / name).write_text("")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger",
              "false"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"the log directory {tmp_path} holds another run's {name}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("override, message", [
    (["--ckpt_path", "/nowhere/x.ckpt"], "`ckpt_path` '/nowhere/x.ckpt': no such checkpoint file or folder"),
    # ("best" and "hpc" ended in Lightning's traceback)
    (["--ckpt_path", "best"], "`ckpt_path` 'best' names the best checkpoint of an earlier fit in the same process"),
    (["--ckpt_path", "hpc"], "`ckpt_path` 'hpc': no hpc_ckpt_<n>.ckpt"),
    (["--data.tokenizer", "/nowhere_tokenizer"], "`tokenizer` '/nowhere_tokenizer'"),
    (["--model.adapters", "[{name: a, dataset: nope}]"], "adapter `dataset` 'nope' is not a data source"),
    (["--trainer.gradient_clip_val", "1.0"], "`Trainer(gradient_clip_val=1.0)`: each adapter clips its own"),
    (["--trainer.val_check_interval", "0.5"], "`val_check_interval` should be an integer or a time-based duration"),
    # (0 trained a step, then "integer modulo by zero"; a second EarlyExit: Lightning's traceback)
    (["--trainer.val_check_interval", "0"], "`Trainer(val_check_interval=0)`: give a number of steps >= 1"),
    (["--trainer.callbacks+=lightning_multilora.callbacks.EarlyExit"],
     "Found more than one stateful callback of type `EarlyExit`: the config has one already; set its options with "
     "--trainer.callbacks.init_args.<name>"),
    (["--data.sources", json.dumps({"d": {"class_path": "lightning_multilora.data.JSONLSource",
                                          "init_args": {"path": "/nowhere/train.jsonl"}}})],
     "data source 'd': JSONLSource: no file at `path` '/nowhere/train.jsonl'"),
])
def test_what_the_fit_would_refuse_under_way_is_a_usage_error_first(tmp_path, capsys, override, message):
    """(Each ended in a traceback of 12 to 33 frames, the base loaded and a log version made; a missing data file
    was said after a log version, a report of a failed adapter and its summary.)"""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path), *override])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err, err
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # (no run folder, no summary)


@pytest.mark.parametrize("case", ["bad json", "bad storage"])
def test_what_the_fit_finds_wrong_under_way_ends_as_a_usage_error(tmp_path, capsys, case):
    """A data file that does not read (as its adapter starts) or a study storage that does not open (at the fit's
    start): each was named, under a traceback of some 25 frames."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": " b"}\nnot json\n')
    args = ["fit", "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "2",
            "--trainer.accelerator", "cpu", "--model.base_model", "tiny-llama"]
    if case == "bad json":
        args += ["--model.adapters", "[{name: a, rank: 2, max_steps: 2}]", "--data.sources",
                 json.dumps({"d": {"class_path": "lightning_multilora.data.JSONLSource",
                                   "init_args": {"path": str(data)}}})]
        message = f"{data}:2: not valid JSON"
    else:
        args += ["--trainer.callbacks", json.dumps([{
            "class_path": "lightning_multilora.callbacks.OptunaSweep",
            "init_args": {"storage": "nosuchdb://x/y", "n_trials": 1, "base": {"max_steps": 2},
                          "search_space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-2}}}}])]
        message = "`storage` 'nosuchdb://x/y' could not be opened"
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err, err


def test_a_fit_with_nothing_to_train_says_so_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.default_root_dir", str(tmp_path)])
    assert done.value.code == 2 and "no adapter to train: give `model.adapters`" in capsys.readouterr().err


def test_fit_is_the_one_lightning_subcommand(capsys):
    """(validate ran idle forwards and reported nothing; test and predict ended in a traceback.)"""
    for command in ("validate", "test", "predict"):
        with pytest.raises(SystemExit) as done:
            main([command, "--config", demo_config()])
        assert done.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("targets", ["all-linear", r".*\.self_attn\.(q|v)_proj"])
def test_the_modules_targets_may_be_a_string_as_in_python(targets, capsys):
    """``--model.target_modules all-linear`` (or a regex), as the Python API and PEFT take them; the parser wanted a
    list."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--model.target_modules", targets, "--print_config"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "target_modules: " + targets in out.replace("'", "")


def test_help_lists_demo_and_schedule_and_the_command_line_gives_no_args_warning(monkeypatch, capsys):
    import warnings

    monkeypatch.setattr(sys, "argv", ["multilora", "--help"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as done:
        warnings.simplefilter("always")
        main()
    out = capsys.readouterr().out
    assert done.value.code == 0 and "fit" in out
    assert "demo [--trainer.max_steps 50]" in out and "\n  schedule TASKS.yaml" in out  # (its lines kept)
    assert not [w for w in caught if "args parameter" in str(w.message)]
    for args in ([], ["fitt"]):  # (the parser's own error named fit alone)
        with pytest.raises(SystemExit) as done:
            main(args)
        err = capsys.readouterr().err
        assert done.value.code == 2 and "the commands: fit, demo, schedule (`multilora --help`)" in err, err


def test_the_help_shows_the_fields_docs_this_clis_ckpt_path_and_what_demo_runs(capsys):
    """``--model.adapters.help`` listed the fields' types alone (their attribute docstrings unread); ``--ckpt_path``
    had Lightning's text ("best", refused here); ``demo --help`` was fit's, the demo's settings unmentioned; the
    command's own help said "Lightning Trainer command line tool"."""
    for args, said in ((["--help"], "lightning-multilora: train many LoRA adapters at once on one frozen base model."),
                       (["fit", "--model.adapters.help"], "LoRA rank r >= 1."),
                       (["fit", "--help"], "'last': the newest checkpoint of a run of this same config"),
                       (["demo", "--help"], f"multilora demo is `multilora fit --config {demo_config()}`"),
                       # (its help listed fit's defaults, max_running null and val_check_interval 50, as its own)
                       (["demo", "--help"], "The defaults shown below are `fit`'s, which its config replaces "
                                            "(--model.base_model tiny-llama, --model.max_running 6,")):
        with pytest.raises(SystemExit) as done:
            main(args)
        out = " ".join(capsys.readouterr().out.split())
        assert done.value.code == 0 and said in out, (args, out[:2000])


def test_the_fields_docstrings_are_read_for_a_help_alone(tmp_path, capsys, monkeypatch):
    """Every command read the attribute docstrings of every class its parser takes (the source of the Trainer's and
    the module's classes parsed: 2 of the 2.7 s a parser took to build), which a help alone shows."""
    import docstring_parser

    read = []
    parse = docstring_parser.parse_from_object
    monkeypatch.setattr(docstring_parser, "parse_from_object", lambda *a, **kw: read.append(a[0]) or parse(*a, **kw))
    for args, reads in ((["fit", "--config", demo_config(), "--print_config"], False),
                        (["fit", "--model.adapters", "[{name: a, rank: 0}]", "--trainer.default_root_dir",
                          str(tmp_path)], False),
                        (["fit", "--model.adapters.help"], True), (["demo", "-h"], True)):
        read.clear()
        with pytest.raises(SystemExit):
            main(args)
        capsys.readouterr()
        assert bool(read) is reads, (args, read[:3])


@pytest.mark.slow
def test_python_api_example_and_peft_loading_example(tmp_path):
    run = run_example(ROOT / "examples" / "python_api_sweep.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    best_path = run.stdout.strip().splitlines()[-1].rsplit(" at ", 1)[1]
    load = run_example(LOAD_EXAMPLE, best_path, cwd=tmp_path)
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.startswith("Q: Ada has 7 apples")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_peft_loading_example_loads_the_base_its_export_names(tmp_path, trainer_kwargs, monkeypatch, family):
    """It rebuilt "tiny-llama" whatever the export named: an adapter trained on a checkpoint of the same shapes
    loaded onto other weights without a word, and answered garbage. With no folder it said a bare IndexError. A base
    named by a relative path was named so in the export (from another folder: a Hub name, not found), and the
    checkpoint's `config_overrides` and `dtype` were not applied (another model answered, PEFT warning of keys).
    A checkpoint saved without a tokenizer (trained on bytes) is answered in bytes: transformers 5 builds a Qwen2's
    tokenizer with no vocabulary from such a folder, which encoded the prompt to nothing (a RuntimeError)."""
    import lightning as L
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.data import ByteTokenizer, GeneratedArithmetic

    config = AutoConfig.for_model(family, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    module = MultiLoRAModule("base", export_dir=str(tmp_path / "exp"), validate_on_finish=False, dtype="bfloat16",
                             config_overrides={"num_hidden_layers": 1},
                             adapters=[AdapterSpec("a", rank=2, max_steps=3, lr=3e-2)])
    with pytest.warns(UserWarning, match=r"PEFT loads that base without them"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    config = json.loads((tmp_path / "exp" / "a" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    assert json.loads((tmp_path / "exp" / "a" / "multilora_export.json").read_text())["base"] == {
        "config_overrides": {"num_hidden_layers": 1}, "dtype": "bfloat16"}
    load = run_example(LOAD_EXAMPLE, str(tmp_path / "exp" / "a"))
    assert load.returncode == 0, load.stderr[-3000:]
    prompt = load.stdout.split("\nA:")[0] + "\nA:"
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(prompt)])
    assert "missing adapter keys" not in load.stderr
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", num_hidden_layers=1, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, tmp_path / "exp" / "a")
    with torch.no_grad():  # (the answer's first token: the checkpoint's, through the adapter)
        first = model.eval()(input_ids=ids).logits[0, -1].argmax().item()
    answer = load.stdout[len(prompt):].rstrip("\n")
    # (as printed: a byte that is no UTF-8 character alone reads as U+FFFD)
    assert (answer[:1] == tok.decode([first]) != "") or (first == tok.eos_token_id and answer == ""), (answer, first)
    bare = run_example(LOAD_EXAMPLE)
    assert bare.returncode == 1 and "usage: python" in bare.stderr and "adapter_config.json" in bare.stderr


def test_the_peft_loading_example_rebuilds_a_4bit_base_as_the_run_held_it(tmp_path, trainer_kwargs):
    """A QLoRA run's export said nothing of its 4-bit base: the example built a float32 one, and the adapter answered
    on other weights than it was trained and validated on."""
    pytest.importorskip("bitsandbytes")
    import lightning as L
    import torch
    from peft import PeftModel

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.data import ByteTokenizer, GeneratedArithmetic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a 4-bit base on the CPU)
        module = MultiLoRAModule("tiny-llama", quantization="nf4", export_dir=str(tmp_path / "exp"),
                                 validate_on_finish=False, adapters=[AdapterSpec("a", rank=2, max_steps=3, lr=3e-2)])
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    info = json.loads((tmp_path / "exp" / "a" / "multilora_export.json").read_text())
    assert info["base"] == {"quantization": "nf4"}, info
    load = run_example(LOAD_EXAMPLE, str(tmp_path / "exp" / "a"))
    assert load.returncode == 0, load.stderr[-3000:]
    prompt = load.stdout.split("\nA:")[0] + "\nA:"
    tok = ByteTokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(build_base_model("tiny-llama", quantization="nf4"), tmp_path / "exp" / "a")
        with torch.no_grad():  # (the answer's first token: the 4-bit base's, through the adapter)
            first = model.eval()(input_ids=torch.tensor([tok.encode(prompt)])).logits[0, -1].argmax().item()
    answer = load.stdout[len(prompt):].rstrip("\n")
    assert tok.encode(answer)[:1] == [first] or (first == tok.eos_token_id and answer == ""), (answer, first)


@pytest.mark.parametrize("bits", ["nf4 double-quantized computing in bfloat16", "int8"])
def test_the_peft_loading_example_rebuilds_a_quantized_base_given_to_the_module(tmp_path, trainer_kwargs, bits):
    """A base the user quantized and gave to the module (the way to double quantization and 8-bit): its export said
    nothing of its quantization, and the example loaded the adapter onto the float base its folder holds (logits 0.9
    off), without a word."""
    pytest.importorskip("bitsandbytes")
    import lightning as L
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from lightning_multilora import AdapterSpec, BatchLayout, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.data import ByteTokenizer, GeneratedArithmetic

    build_base_model("tiny-llama").save_pretrained(tmp_path / "base")
    settings = BitsAndBytesConfig(load_in_8bit=True) if bits == "int8" else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a quantized base on the CPU)
        given = build_base_model(str(tmp_path / "base"), quantization=settings)
        module = MultiLoRAModule(given, export_dir=str(tmp_path / "exp"), validate_on_finish=False,
                                 adapters=[AdapterSpec("a", rank=2, max_steps=9, lr=3e-2)])  # (held at the end)
        L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(
            module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    info = json.loads((tmp_path / "exp" / "a" / "multilora_export.json").read_text())["base"]
    assert info["quantization_config"]["load_in_8bit" if bits == "int8" else "bnb_4bit_use_double_quant"] is True
    assert info.get("quantization") == (None if bits == "int8" else "nf4") and "dtype" not in info, info
    load = run_example(LOAD_EXAMPLE, str(tmp_path / "exp" / "a"))
    assert load.returncode == 0, load.stderr[-3000:]
    prompt = load.stdout.split("\nA:")[0] + "\nA:"
    ids = torch.tensor([ByteTokenizer().encode(prompt)])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        live = module.eval()(ids, layout=BatchLayout.from_sizes(["a"], [1]))[0, -1].float()
        quantized = build_base_model(str(tmp_path / "base"), quantization=info["quantization_config"])
        rebuilt = PeftModel.from_pretrained(quantized, tmp_path / "exp" / "a").eval()(input_ids=ids).logits[0, -1]
        float_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        on_float = PeftModel.from_pretrained(float_base, tmp_path / "exp" / "a").eval()(input_ids=ids).logits[0, -1]
    assert torch.equal(rebuilt.float(), live), (rebuilt.float() - live).abs().max()
    assert (on_float.float() - live).abs().max() > 1e-3  # (the float base the folder holds answers otherwise)
    answer = load.stdout[len(prompt):].rstrip("\n")
    first = live.argmax().item()
    assert ByteTokenizer().encode(answer)[:1] == [first] or (first == 257 and answer == ""), (answer, first)


def test_build_base_model_takes_bitsandbytes_settings_whole_and_refuses_ones_that_quantize_nothing(tmp_path):
    """`quantization` as bitsandbytes settings (as an export records a quantized base given to the module) builds the
    base they say (double quantization kept); settings that load neither 4 nor 8 bits are refused, naming the
    field."""
    pytest.importorskip("bitsandbytes")
    from lightning_multilora.base_model import build_base_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_base_model("tiny-llama", quantization={"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
                                                             "bnb_4bit_use_double_quant": True})
    quant = model.config.quantization_config.to_dict()
    assert quant["bnb_4bit_quant_type"] == "fp4" and quant["bnb_4bit_use_double_quant"] is True
    assert model.model.layers[0].self_attn.q_proj.weight.quant_state.nested
    with pytest.raises(ValueError, match=r"`quantization` given as bitsandbytes settings must load the base in 4 or 8"):
        build_base_model("tiny-llama", quantization={"bnb_4bit_quant_type": "nf4"})
    from lightning_multilora import MultiLoRAModule  # (the module's own takes a name: its exports record it)

    with pytest.raises(ValueError, match=r"MultiLoRAModule: `quantization` can be nf4, fp4 or None, got \{'load_in_8bit"
                                         r"': True\}; for other bitsandbytes settings .* give it as `base_model`"):
        MultiLoRAModule("tiny-llama", quantization={"load_in_8bit": True})


def test_a_pre_quantized_checkpoint_says_it_keeps_its_own_dtype_and_exports_the_dtype_held(tmp_path, trainer_kwargs):
    """transformers keeps a pre-quantized checkpoint's dtype whatever `dtype` asks: the module said nothing, and its
    export recorded the dtype asked for, not the one the base ran in."""
    pytest.importorskip("bitsandbytes")
    import lightning as L
    import torch

    from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
    from lightning_multilora.base_model import build_base_model
    from lightning_multilora.data import GeneratedArithmetic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_base_model("tiny-llama", dtype="bfloat16", quantization="nf4").save_pretrained(tmp_path / "bnb-4bit")
    with pytest.warns(UserWarning, match=r"`dtype` 'float16' is not applied to the pre-quantized checkpoint .*"
                                         r"runs in bfloat16 \(give dtype='bfloat16'"):
        module = MultiLoRAModule(str(tmp_path / "bnb-4bit"), dtype="float16", export_dir=str(tmp_path / "exp"),
                                 validate_on_finish=False, adapters=[AdapterSpec("a", rank=2, max_steps=2)])
    assert module.model.model.embed_tokens.weight.dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"arith": GeneratedArithmetic(60)}))
    info = json.loads((tmp_path / "exp" / "a" / "multilora_export.json").read_text())["base"]
    assert info == {"dtype": "bfloat16", "quantization": "nf4"}, info


class TermAtStep2(Callback):
    """Sends this process a SIGTERM at step 2, as a cluster's pre-emption does."""

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def default_sigterm():
    """SIGTERM's default handler for the test (Lightning takes SIGTERM only where no handler is set: an earlier
    test's may be), the one before restored after."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_fit_ended_by_sigterm_exits_with_143_after_exporting(tmp_path, default_sigterm):
    """Lightning's exception for a SIGTERM is a ``SystemExit`` of status 0: a pre-empted run looked done to a
    scheduler (this package's own executor among them)."""
    args = ["fit", "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.accelerator", "cpu",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--model.base_model", "tiny-llama",
            "--model.adapters", "[{name: a, rank: 2, max_steps: 20, batch_size: 2}]",
            "--trainer.callbacks", json.dumps([{"class_path": f"{__name__}.TermAtStep2"}])]
    with pytest.warns(UserWarning, match=r"fit stopped by SIGTERMException: the adapters it held are exported"):
        with pytest.raises(SystemExit) as done:
            main(args)
    assert done.value.code == 143
    assert (tmp_path / "run" / "adapters" / "a" / "adapter_model.safetensors").is_file()


def test_an_adapter_field_spelt_as_peft_spells_it_is_answered_with_ours(tmp_path, capsys):
    """The command line refused ``r`` with "Option 'r' is not accepted" and no word of ``rank``."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--model.adapters", "[{name: a, r: 8, lora_alpha: 16}]",
              "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "AdapterSpec takes no 'r'; it takes name, rank," in err, err
    assert "(PEFT's names: r -> `rank`)" in err, err


@pytest.mark.parametrize("override, message", [
    (["--model.adapters", "[{name: a, rnak: 8}]"],
     "error: `model.adapters`: AdapterSpec takes no 'rnak' (did you mean 'rank'?); it takes name, rank, alpha,"),
    (["--trainer.callbacks", json.dumps([{"class_path": "lightning_multilora.callbacks.OptunaSweep",
                                          "init_args": {"search_space": {}, "n_trails": 3}}])],
     "OptunaSweep takes no 'n_trails' (did you mean 'n_trials'?); it takes search_space, n_trials,"),
    (["--model.max_runing", "2"], "unrecognized arguments: --model.max_runing 2 (did you mean `model.max_running`?)"),
    # (a misspelt field that holds a mapping: refused as 'axis.lr', which fell back to jsonargparse's dump)
    (["--model.grid", "{axis: {lr: [0.001, 0.002]}}"],
     "error: `model.grid`: SweepGrid takes no 'axis' (did you mean 'axes'?); it takes axes, base, alpha_over_rank"),
    (["--trainer.max_stpes", "2"], "(did you mean `trainer.max_steps`?)"),
    # (a value of the wrong type: the union's alternatives and every adapter's dump, the field deep inside)
    (["--model.adapters", "[{name: a, rank: 4}, {name: b, rank: eight}]"],
     "error: `model.adapters`: adapter 'b': `rank` must be an integer, got 'eight'"),
    (["--model.adapters", "[{name: a, lr: fast}]"], "error: `model.adapters`: adapter 'a': `lr` must be a number, "
                                                    "got 'fast'"),
    # (an optional field: its union with None one level deeper, which fell back to jsonargparse's dump)
    (["--model.adapters", "[{name: a, rank: 4}, {name: b, max_steps: 2.5}]"],
     "error: `model.adapters`: adapter 'b': `max_steps` must be an integer, got '2.5'"),
    (["--model.adapters", "[{name: a, grad_clip: abc}]"],
     "error: `model.adapters`: adapter 'a': `grad_clip` must be a number, got 'abc'"),
    # (a union of several types: jsonargparse's account of each alternative)
    (["--model.adapters", "[{name: a, target_modules: 5}]"],
     "error: `model.adapters`: adapter 'a': `target_modules` must be text, a list of text or null, got '5'"),
    # (a source written in a form jsonargparse reads as the base class: it named DataSource and "it takes" nothing)
    (["--data.sources", "{pc: {class_path: JSONLSource, path: pc.jsonl}}"],
     "error: `data.sources`: DataSource takes no 'class_path': the class meant was not read with its fields; give "
     "each as NAME: {class_path: <class>, init_args: {<field>: <value>}} in a config, or on the command line as "
     "--data.sources.NAME <class> --data.sources.NAME.<field> <value>"),
])
def test_a_field_a_config_misspells_is_named_with_the_closest_one_under_a_short_usage(tmp_path, capsys, override,
                                                                                      message):
    """A typo in an adapter's field printed some 80 lines of usage, then jsonargparse's account of the union's
    alternatives, before "Option 'rnak' is not accepted"."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path), *override])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err
    assert len(err.splitlines()) <= 4 and err.startswith("usage: "), err


def test_a_union_fields_wrong_value_names_its_types_in_one_order(tmp_path, capsys, monkeypatch):
    """jsonargparse lists a union's types in an order that depends on what it parsed before in the process: the
    message read "text, a list of text or null" or "a list of text, text or null" from one test run to another."""
    import jsonargparse._typehints as typehints

    said = []
    for turn in ("as it is", "reversed"):
        if turn == "reversed":
            listed = typehints.sort_subtypes_for_union
            monkeypatch.setattr(typehints, "sort_subtypes_for_union", lambda *a: list(reversed(listed(*a))))
        with pytest.raises(SystemExit):
            main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path),
                  "--model.adapters", "[{name: a, target_modules: 5}]"])
        said.append(capsys.readouterr().err.splitlines()[-1])
    assert said == ["error: `model.adapters`: adapter 'a': `target_modules` must be text, a list of text or null, "
                    "got '5'"] * 2


@pytest.mark.parametrize("config, message", [
    ("model:\n  grids:\n    axes: {lr: [1.0e-3, 2.0e-3]}\n",
     "does not accept option 'model.grids.axes.lr' (did you mean `model.grid`?)"),
    ("data:\n  source:\n    arithmetic:\n      class_path: lightning_multilora.data.GeneratedArithmetic\n",
     "(did you mean `data.sources`?)"),
])
def test_a_misspelt_field_holding_a_mapping_in_a_config_file_is_named_with_the_closest_one(tmp_path, capsys, config,
                                                                                           message):
    """(jsonargparse names such a key by its innermost one, `model.grids.axes.lr`: no field was suggested.)"""
    path = tmp_path / "typo.yaml"
    path.write_text(config)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--config", str(path), "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err


@pytest.mark.parametrize("override, message", [
    # (a callback's field with no callback given: the message told of a mapping's NAME syntax, which a list has not)
    (["--trainer.callbacks.init_args.tau_gap", "3"],
     "`trainer.callbacks`: Callback takes no 'tau_gap': the class meant was not read (no class given takes it); give "
     "the class first, then its fields: --trainer.callbacks+=lightning_multilora.EarlyExit "
     "--trainer.callbacks.init_args.tau_gap <value> (a field sets the last class given), or in a config {class_path: "
     "lightning_multilora.EarlyExit, init_args: {tau_gap: <value>}}"),
    (["--trainer.logger.init_args.save_dir", "logs"],  # (jsonargparse's dump of the union and a NestedArg)
     "`trainer.logger`: 'save_dir' is a field of a class, and none is given; give the class first, then its fields: "
     "--trainer.logger lightning.pytorch.loggers.TensorBoardLogger --trainer.logger.init_args.save_dir <value>"),
    # (a misspelt class: the union's alternatives, the reason twice, no suggestion)
    (["--trainer.callbacks+=lightning_multilora.EarlyExitt"],
     "`trainer.callbacks`: no class 'lightning_multilora.EarlyExitt': module 'lightning_multilora' has no attribute "
     "'EarlyExitt' (did you mean 'lightning_multilora.EarlyExit'?)"),
    (["--trainer.callbacks+=WarmupSelecton"],
     "`trainer.callbacks`: no class 'WarmupSelecton': a class is named by its import path (did you mean "
     "'lightning_multilora.WarmupSelection'?)"),
    (["--model.grid", "{axes: {rank: [2, 4], lr: 0.01}}"],  # (jsonargparse named `axes`, not the axis)
     "`model.grid`: `axes['lr']` must be a list of values, got '0.01' (one value for every adapter: give it in `base`, "
     "or as [0.01])"),
    (["--data.sources", "{pc: {class_path: lightning_multilora.data.JSONLSourse, init_args: {path: pc.jsonl}}}"],
     "`data.sources`: no class 'lightning_multilora.data.JSONLSourse': module 'lightning_multilora.data' has no "
     "attribute 'JSONLSourse' (did you mean 'lightning_multilora.data.JSONLSource'?)"),
    # (a class that imports, without an argument it requires: named as no class, with itself as the closest)
    (["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"],
     "`trainer.callbacks`: lightning.pytorch.callbacks.EarlyStopping needs 'monitor': give "
     "--trainer.callbacks.init_args.monitor <value> after it (or init_args: {monitor: <value>} in a config)"),
    (["--trainer.callbacks+=nowhere.Thing"], "`trainer.callbacks`: no class 'nowhere.Thing': No module named 'nowhere' "
                                             "(this package's: lightning_multilora.EarlyExit,"),
])
def test_a_class_or_an_axis_given_wrong_says_how_to_give_it(tmp_path, capsys, override, message):
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(tmp_path, *override))
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err
    assert "no class 'lightning.pytorch" not in err, err
    assert len(err.splitlines()) <= 4 and err.startswith("usage: "), err


def test_an_option_of_a_callback_other_than_the_last_says_how_to_change_it(tmp_path, capsys):
    """``multilora demo --trainer.callbacks.init_args.n_trials 4`` answered that EarlyExit (the last of the demo's
    callbacks, which jsonargparse gives the option to) takes no 'n_trials', and no word of how to change the sweep's."""
    with pytest.raises(SystemExit) as done:
        main(["demo", "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks.init_args.n_trials", "4"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "EarlyExit takes no 'n_trials'" in err, err
    assert ("(--trainer.callbacks.init_args.* sets the last item's: to change another, write the whole config with "
            "--print_config > run.yaml, edit it, then `multilora fit --config run.yaml`)") in err, err
    with pytest.raises(SystemExit):  # (jsonargparse's short form, without init_args)
        main(["demo", "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks.n_trials", "4"])
    assert "sets the last item's: to change another" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (a misspelt field of the callback given here: the typo alone is said)
        main(["demo", "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+=EarlyStopping",
              "--trainer.callbacks.patiance=3"])
    err = capsys.readouterr().err
    assert "takes no 'patiance' (did you mean 'patience'?)" in err and "sets the last item's" not in err, err


@pytest.mark.parametrize("args, said", [
    (["--trainer.callbacks.init_args.patience_div", "two"], "`patience_div` must be an integer, got 'two'"),
    (["--trainer.callbacks.init_args.window", "1.5"], "`window` must be an integer, got '1.5'"),
    (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_top_k", "two"],
     "`save_top_k` must be an integer, got 'two'")])
def test_a_callback_option_of_the_wrong_type_is_said_so_not_called_unknown(tmp_path, capsys, args, said):
    """A value of the wrong type for a callback's field given on the command line was answered "EarlyExit takes no
    'patience_div' (did you mean 'patience_div'?)" (the union's base class, `Callback`, refusing it)."""
    with pytest.raises(SystemExit) as done:
        main(["demo", "--trainer.default_root_dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"error: `trainer.callbacks`: {said}" in err and "takes no" not in err, err


@pytest.mark.parametrize("args, meant", [(["--report.print_tabel", "false"], "report.print_table"),
                                         (["--seed_everthing", "1"], "seed_everything"),
                                         (["--ckpt_pth", "last"], "ckpt_path"),
                                         (["--modle.max_running", "2"], "model.max_running"),
                                         (["--config", "reprot.yaml"], "report.print_table")])
def test_a_misspelt_section_or_top_level_key_gets_the_closest_one(tmp_path, capsys, monkeypatch, args, meant):
    """The module's, data module's and Trainer's fields got a "did you mean"; the report's, the top-level keys and a
    misspelt section got jsonargparse's bare "unrecognized arguments"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reprot.yaml").write_text("reprot: {print_table: false}\n")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"(did you mean `{meant}`?)" in err, err


def test_a_misspelt_source_class_is_said_so_with_the_closest_one(tmp_path, capsys):
    """``--data.sources.x lightning_multilora.data.JSONLSourc``: said to be a field given before any class."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--data.sources.x", "lightning_multilora.data.JSONLSourc", "--print_config"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "no class 'lightning_multilora.data.JSONLSourc'" in err, err
    assert "(did you mean 'lightning_multilora.data.JSONLSource'?)" in err and "field of a class" not in err, err


def test_a_source_class_without_its_required_field_gets_the_spelling_that_works(tmp_path, capsys):
    """``--data.sources.x JSONLSource`` without `path`: the hint, ``--data.sources.init_args.path``, was refused in
    turn (a source's fields follow its name)."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--data.sources.x", "JSONLSource", "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "give --data.sources.NAME.path <value> after it" in err, err
    assert "init_args.path" not in err, err


def test_a_config_before_the_subcommand_is_left_to_the_top_level_parser(tmp_path, capsys):
    """``multilora -c run.yaml fit`` of a config holding `trainer.callbacks` (a printed config): the null put before
    a list that replaces another went before ``fit`` too, and was taken for the subcommand ("invalid choice:
    'null'")."""
    (tmp_path / "run.yaml").write_text("trainer:\n  callbacks: []\nmodel:\n  adapters: [{name: a}]\n")
    with pytest.raises(SystemExit):
        main(["-c", str(tmp_path / "run.yaml"), "fit", "--config", demo_config(), "--print_config"])
    err = capsys.readouterr().err
    assert "invalid choice" not in err, err


@pytest.mark.parametrize("section", ["model", "data", "trainer"])
def test_a_section_file_under_its_own_section_key_is_said_so(tmp_path, capsys, section):
    """``--model m.yaml`` of ``model: {max_running: 3}``: the hint repeated the option it refused ("does not accept
    option 'model.max_running' (did you mean `model.max_running`?)")."""
    field = {"model": "max_running: 3", "data": "max_length: 64", "trainer": "max_steps: 3"}[section]
    (tmp_path / "part.yaml").write_text(f"{section}: {{{field}}}\n")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(tmp_path), f"--{section}",
              str(tmp_path / "part.yaml")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "did you mean" not in err, err
    assert f"a `--{section} FILE` holds the section's own keys: remove its top-level `{section}:`" in err, err


@pytest.mark.parametrize("kind", ["checkpoints folder", "exported adapter", "version folder", "empty folder"])
def test_a_folder_given_as_ckpt_path_is_named_before_the_log_directory_is_taken(tmp_path, capsys, kind):
    """A run's `checkpoints/` folder or an exported adapter's given as `--ckpt_path`: a bare IsADirectoryError after
    the run had taken its log directory (config.yaml, the summary and its claim left there, which then refused the
    corrected command); so too a run's version folder, its checkpoints a level down, or a folder of none. Said as a
    usage error (it was a ValueError's traceback)."""
    folder = tmp_path / "given"
    (folder / "checkpoints").mkdir(parents=True)
    file = {"checkpoints folder": "epoch=0-step=4.ckpt", "exported adapter": "adapter_config.json",
            "version folder": "checkpoints/epoch=0-step=4.ckpt", "empty folder": "config.yaml"}[kind]
    (folder / file).write_text("{}")
    said = {"checkpoints folder": r"is a folder, not a checkpoint file; the checkpoints in it: epoch=0-step=4.ckpt",
            "exported adapter": r"is an exported adapter, not a checkpoint: it starts an adapter from its weights, "
                                r"`AdapterSpec\(init_from=...\)`",
            "version folder": r"is a folder, not a checkpoint file; the checkpoints under it: "
                              r"checkpoints/epoch=0-step=4.ckpt \(`--ckpt_path last` resumes",
            "empty folder": r"is a folder, not a checkpoint file; it holds no checkpoint \(\*.ckpt\)"}[kind]
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", demo_config(), "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
              "--ckpt_path", str(folder)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and re.search(rf"`ckpt_path` '{re.escape(str(folder))}' {said}", err.replace(
        "\n", " ")) and "Traceback" not in err, err
    assert not root.exists() or not [p.name for p in root.iterdir()], list(root.iterdir())


def _tiny_fit(root, *extra, adapters="[{name: a, rank: 2, max_steps: 2, batch_size: 2}]"):
    return ["fit", "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "-1", "--model.base_model", "tiny-llama",
            "--model.adapters", adapters, "--data.max_val_examples", "4", *extra]


def test_a_resume_from_a_checkpoint_file_takes_the_commands_model_settings(tmp_path, capsys):
    """Lightning's CLI put the checkpoint's saved hyperparameters over the command's whole `model` section: a new
    `export_dir` and an adapter added to the resumed run were dropped, unsaid (`--ckpt_path last` took them)."""
    checkpoints = json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(tmp_path / "ck"), "every_n_train_steps": 1}}])
    main(_tiny_fit(tmp_path / "run", "--trainer.max_steps", "1", "--trainer.callbacks", checkpoints,
                   adapters="[{name: a, rank: 2, max_steps: 3, batch_size: 2}]"))
    import torch

    ckpt = str(tmp_path / "legacy.ckpt")  # (torch's older, non-zip format: Lightning reads it; it is not refused)
    torch.save(torch.load(next((tmp_path / "ck").glob("*.ckpt")), weights_only=False), ckpt,
               _use_new_zipfile_serialization=False)
    added = "[{name: a, rank: 2, max_steps: 3, batch_size: 2}, {name: c, rank: 2, max_steps: 2, batch_size: 2}]"
    with pytest.warns(UserWarning, match=r"adapters not in the checkpoint are queued: \['c'\]"):
        main(_tiny_fit(tmp_path / "run", "--ckpt_path", ckpt, "--model.export_dir", str(tmp_path / "moved"),
                       adapters=added))
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == ["a", "c"]


@pytest.mark.parametrize("targets", ["[q_proj]", "[q_proj, v_proj, k_proj, o_proj, gate_proj, up_proj, down_proj, "
                                     "lm_head]"])
def test_a_resume_with_other_target_modules_is_a_usage_error(tmp_path, capsys, targets):
    """The checkpoint's adapter weights in layers the module no longer wraps, or an adapter's layers the checkpoint
    lacks: a traceback as the fit loaded the checkpoint, the run's config and claim left in the version folder it
    took."""
    checkpoints = json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(tmp_path / "ck"), "every_n_train_steps": 1}}])
    main(_tiny_fit(tmp_path / "run", "--trainer.max_steps", "1", "--trainer.callbacks", checkpoints))
    ckpt = str(next((tmp_path / "ck").glob("*.ckpt")))
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(tmp_path / "run", "--ckpt_path", ckpt, "--model.target_modules", targets))
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err, err
    assert re.search(r"checkpoint (holds adapter weights for layers this module no longer targets|lacks adapter "
                     r"weights) .* resume with the `target_modules` \(the module's, and each AdapterSpec's\) the "
                     "checkpoint was trained with", err), err
    left = {p.name for p in (tmp_path / "run" / "lightning_logs" / "version_1").iterdir()}
    assert not left & {"config.yaml", "sweep_summary.json", ".multilora_log"}, left


def test_a_resume_from_a_checkpoint_file_without_the_runs_config_names_the_runs_base(tmp_path, capsys):
    """With the module the command's config, `--ckpt_path <file>` alone built the default base: a traceback of
    another base model, a version folder left behind."""
    from lightning_multilora.base_model import build_base_model

    build_base_model("tiny-llama", {"num_hidden_layers": 1}).save_pretrained(tmp_path / "base")
    checkpoints = json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(tmp_path / "ck"), "every_n_train_steps": 1}}])
    main(_tiny_fit(tmp_path / "run", "--trainer.max_steps", "1", "--trainer.callbacks", checkpoints,
                   "--model.base_model", str(tmp_path / "base")))
    ckpt = str(next((tmp_path / "ck").glob("*.ckpt")))
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.default_root_dir", str(tmp_path / "again"), "--ckpt_path", ckpt])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"its run was trained on `base_model` '{tmp_path / 'base'}'" in err, err
    assert "give the run's config to resume it, --config" in err and "Traceback" not in err
    assert not (tmp_path / "again").exists()
    # another base given (not the default): a traceback as the fit loaded the checkpoint, a version folder left
    with pytest.raises(SystemExit) as done:
        build_base_model("tiny-llama").save_pretrained(tmp_path / "base2")
        main(_tiny_fit(tmp_path / "other", "--ckpt_path", ckpt, "--model.base_model", str(tmp_path / "base2")))
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"`ckpt_path` '{ckpt}': this checkpoint's adapters were trained on another base " \
        "model (checkpoint -> this module: num_hidden_layers 1 -> 2)" in err and "Traceback" not in err, err
    assert not (tmp_path / "other").exists()
    # a resume that fails before its first step leaves nothing in the version folder it took
    start = json.dumps([{"class_path": f"{__name__}.FailAtStart"}])
    with pytest.raises(RuntimeError, match="node lost"):
        main(_tiny_fit(tmp_path / "run", "--ckpt_path", ckpt, "--model.base_model", str(tmp_path / "base"),
                       "--trainer.callbacks", start))
    left = {p.name for p in (tmp_path / "run" / "lightning_logs" / "version_1").iterdir()}
    assert not left & {"config.yaml", "sweep_summary.json", ".multilora_log"}, left  # (the logger's files stay)
    assert (tmp_path / "run" / "lightning_logs" / "version_0" / "config.yaml").is_file()


class FailAtStart(Callback):
    def on_train_start(self, trainer, *args):
        raise RuntimeError("node lost")


@pytest.mark.parametrize("kind", ["text", "export", "no lightning", "another module"])
def test_a_ckpt_path_that_is_no_checkpoint_of_a_run_is_a_usage_error_leaving_nothing(tmp_path, capsys, kind):
    """A text file or an export's weights ended in Lightning's UnpicklingError; a plain `torch.save` or another
    module's checkpoint in a traceback after the run's config, summary and claim were written, which then refused
    the corrected command as "another run's"."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "files" / "x.ckpt"
    path.parent.mkdir()
    if kind == "text":
        path.write_text("not a checkpoint\n")
    elif kind == "export":
        save_file({"w": torch.zeros(2)}, str(path))
    else:
        torch.save({"state_dict": {}, **({"pytorch-lightning_version": "2.6.0"} if kind == "another module" else {})},
                   path)
    message = {"text": "not a checkpoint (", "export": "not a checkpoint (",
               "no lightning": "not a Lightning checkpoint",
               "another module": "a checkpoint of another LightningModule than a MultiLoRAModule"}[kind]
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(tmp_path / "run", "--trainer.logger", "false", "--ckpt_path", str(path)))
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"`ckpt_path` '{path}': {message}" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() or not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]


def test_runs_started_together_take_their_own_log_versions_and_a_claimed_root_is_refused(tmp_path, capsys):
    """Runs of a schedule sharing `default_root_dir` listed the logger's versions before either wrote one, and took
    the same: one's config and summary replaced the other's, silently. The run that finds its version claimed
    takes the next; without a versioned logger the claimed directory is refused."""
    taken = tmp_path / "lightning_logs" / "version_0"
    taken.mkdir(parents=True)
    (taken / ".multilora_log").write_text("another-run\n")  # (claimed a moment ago, nothing written yet)
    main(_tiny_fit(tmp_path))
    mine = tmp_path / "lightning_logs" / "version_1"
    assert (mine / "sweep_summary.json").is_file() and (mine / "config.yaml").is_file()
    assert sorted(p.name for p in taken.iterdir()) == [".multilora_log"]
    assert (mine / ".multilora_log").read_text().strip() not in ("", "another-run")
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(taken, "--trainer.logger", "false"))
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"the log directory {taken} holds another run's .multilora_log" in err, err
    given = json.dumps({"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": str(tmp_path), "version": 0}})  # (a version given is not moved)
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(tmp_path, "--trainer.logger", given))
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"the log directory {taken} holds another run's .multilora_log" in err, err


def test_a_fit_refused_before_its_first_step_leaves_its_directory_free_and_a_finished_run_says_so(tmp_path,
                                                                                                 capsys, monkeypatch):
    """A data file that does not read (found as its adapter starts) left the run's config and summary in a log
    directory without versions, and the corrected command was refused as "another run's"; resuming a finished run
    ended in a traceback ("nothing to train"), and each attempt left a summary beside the run's."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": " 2"}\nnot json\n')
    sources = json.dumps({"d": {"class_path": "lightning_multilora.data.JSONLSource",
                                "init_args": {"path": str(data)}}})
    args = _tiny_fit(tmp_path / "run", "--trainer.logger", "false", "--data.sources", sources,
                     "--trainer.callbacks", json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                                         "init_args": {"dirpath": str(tmp_path / "ck")}}]))
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"{data}:2: not valid JSON" in err, err
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": f" {i + 1}"}) + "\n" for i in range(20)))
    main(args)
    assert (tmp_path / "run" / "adapters" / "a" / "adapter_model.safetensors").is_file()
    summaries = sorted(p.name for p in (tmp_path / "run").glob("sweep_summary*"))
    with pytest.raises(SystemExit) as done:
        main([*args, "--ckpt_path", str(next((tmp_path / "ck").glob("*.ckpt")))])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "nothing to train: every adapter has already ended (a: finished)" in err, err
    assert "Traceback" not in err and sorted(p.name for p in (tmp_path / "run").glob("sweep_summary*")) == summaries
    # a schedule's task resumed so (its retry, after the run ended but before its process did): done, status 0
    monkeypatch.setenv("MULTILORA_TASK_ID", "t1")
    main([*args, "--ckpt_path", str(next((tmp_path / "ck").glob("*.ckpt")))])
    err = capsys.readouterr().err
    assert "task 't1': its run had ended, nothing to train: every adapter has already ended (a: finished)" in err, err
    monkeypatch.delenv("MULTILORA_TASK_ID")
    # another run's checkpoint resumed into this run's directory (its config would be replaced)
    other = _tiny_fit(tmp_path / "other", "--trainer.logger", "false", "--trainer.callbacks", json.dumps([{
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(tmp_path / "ck2")}}]),
        adapters="[{name: b, rank: 2, max_steps: 2, batch_size: 2}]")
    main(other)
    with pytest.raises(SystemExit) as done:
        main([*args, "--ckpt_path", str(next((tmp_path / "ck2").glob("*.ckpt")))])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "is a checkpoint of another run" in err, err


@pytest.fixture
def process_group_ended():
    """The default process group a fit of `strategy="adapter_parallel"` in this process starts, ended after the test
    (Lightning leaves it, as its DDP does: a later test's own ``init_process_group`` was refused, "twice")."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_an_adapter_parallel_checkpoint_is_known_as_its_runs_on_a_resume(tmp_path, capsys, monkeypatch,
                                                                        process_group_ended):
    """An adapter-parallel checkpoint (a folder) was read as of no run: its resume wrote over the run id in the log
    directory's claim (a schedule task's next `--ckpt_path last` then found no checkpoint of the task: a new run on
    one rank, a resume on the other, waiting on each other for good), and another run's checkpoint resumed into a
    run's directory wrote over that run's config and summary."""
    monkeypatch.setenv("MULTILORA_NAMED_CHECKPOINT", "")  # (what `--ckpt_path last` sets: restored at the end)
    ap = ["--trainer.logger", "false", "--trainer.strategy", "adapter_parallel", "--trainer.devices", "1",
          "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null"]
    monkeypatch.setenv("MULTILORA_TASK_ID", "t1")
    main(_tiny_fit(tmp_path / "a", *ap, "--trainer.max_steps", "2", "--ckpt_path", "last",
                   adapters="[{name: a, rank: 2, max_steps: 4, batch_size: 2}]"))
    claim = (tmp_path / "a" / ".multilora_log").read_text()
    assert claim.split("\n")[1] == "task=t1" and len(claim.split("\n")[0]) == 32
    (folder,) = (tmp_path / "a" / "checkpoints").glob("*.ckpt")
    assert folder.is_dir() and (folder / "rank0.ckpt").is_file()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        main(_tiny_fit(tmp_path / "a", *ap, "--ckpt_path", "last", adapters="[{name: a, rank: 2, max_steps: 4, "
                                                                             "batch_size: 2}]"))
    assert not [w for w in said if "a new run starts" in str(w.message)]  # (it resumed)
    assert (tmp_path / "a" / ".multilora_log").read_text() == claim  # (the run's id kept)
    done = json.loads((tmp_path / "a" / "sweep_summary.json").read_text())
    assert [(row["adapter"], row["steps"]) for row in done] == [("a", 4)]
    monkeypatch.delenv("MULTILORA_TASK_ID")
    main(_tiny_fit(tmp_path / "b", *ap, "--trainer.max_steps", "2"))
    config = (tmp_path / "a" / "config.yaml").read_text()
    with pytest.raises(SystemExit) as refused:  # (b's checkpoint resumed into a's directory)
        main(_tiny_fit(tmp_path / "a", *ap, "--ckpt_path", str(next((tmp_path / "b" / "checkpoints").glob("*")))))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "is a checkpoint of another run" in err, err
    assert (tmp_path / "a" / ".multilora_log").read_text() == claim and (tmp_path / "a" / "config.yaml").read_text() \
        == config and json.loads((tmp_path / "a" / "sweep_summary.json").read_text()) == done


def test_the_processes_a_run_launches_take_the_checkpoint_its_first_found_for_last(tmp_path, monkeypatch):
    """`--ckpt_path last` is looked for by process 0, which gives what it found to the processes it launches (each
    looked for itself, after process 0 had begun to write in the log directory); a process another launcher started
    (its parent is not the one that looked) looks for itself."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from lightning_multilora.cli import MultiLoRACLI

    looked = []
    cli = MultiLoRACLI.__new__(MultiLoRACLI)
    monkeypatch.setattr(MultiLoRACLI, "_named_checkpoint", lambda self, name: looked.append(name) or "/ck/found")
    monkeypatch.setenv("MULTILORA_NAMED_CHECKPOINT", "")  # (restored as it was, absent included, at the end)
    monkeypatch.delenv("MULTILORA_NAMED_CHECKPOINT")
    assert cli._launch_named_checkpoint("last") == "/ck/found" and looked == ["last"]
    assert os.environ["MULTILORA_NAMED_CHECKPOINT"] == f"{os.getpid()}/last:/ck/found"
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # (a launched process: its parent, here this one's, looked)
    monkeypatch.setenv("MULTILORA_NAMED_CHECKPOINT", f"{os.getppid()}/last:/ck/process0s")
    assert cli._launch_named_checkpoint("last") == "/ck/process0s" and looked == ["last"]
    # taken once: a script's second fit reuses the processes, their environment as it was when they started
    assert "MULTILORA_NAMED_CHECKPOINT" not in os.environ
    assert cli._launch_named_checkpoint("last") == "/ck/found" and looked == ["last"] * 2
    monkeypatch.setenv("MULTILORA_NAMED_CHECKPOINT", f"{os.getppid()}/last:")  # (process 0 found none: a new run)
    assert cli._launch_named_checkpoint("last") is None and looked == ["last"] * 2
    for other in (f"{os.getppid()}/hpc:/ck/process0s", f"{os.getpid()}/last:/ck/process0s"):  # (another name;
        monkeypatch.setenv("MULTILORA_NAMED_CHECKPOINT", other)  # another process's finding)
        assert cli._launch_named_checkpoint("last") == "/ck/found"
    assert looked == ["last"] * 4


def test_a_missing_file_of_a_source_no_adapter_draws_is_not_refused(tmp_path, capsys):
    """Only the sources the adapters (or a sweep) may draw are checked for their files before the run."""
    sources = json.dumps({"a": {"class_path": "lightning_multilora.data.GeneratedArithmetic",
                                "init_args": {"num_examples": 40}},
                          "gone": {"class_path": "lightning_multilora.data.JSONLSource",
                                   "init_args": {"path": "/nowhere/other.jsonl"}}})
    main(_tiny_fit(tmp_path, "--trainer.logger", "false", "--data.sources", sources,
                   adapters="[{name: a, rank: 2, max_steps: 2, batch_size: 2, dataset: a}]"))
    assert (tmp_path / "adapters" / "a" / "adapter_model.safetensors").is_file()
    with pytest.raises(SystemExit) as done:
        main(_tiny_fit(tmp_path / "two", "--trainer.logger", "false", "--data.sources", sources,
                       adapters="[{name: a, rank: 2, max_steps: 2, batch_size: 2, dataset: gone}]"))
    assert done.value.code == 2 and "data source 'gone': JSONLSource: no file at `path`" in capsys.readouterr().err


class CrashAt(Callback):
    """Raises at step ``step``, as a run that dies; records, as each fit starts, its checkpoint and first step."""

    starts: list[tuple[str, int]] = []

    def __init__(self, step: int = 0):
        self.step = step

    def on_train_start(self, trainer, *args):
        CrashAt.starts.append((trainer.ckpt_path, trainer.global_step))

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise RuntimeError("node lost")


def test_a_checkpoint_folder_is_as_new_as_its_newest_rank_file(tmp_path):
    """(An adapter-parallel checkpoint is a folder whose rank files are rewritten in place: its own time is when it
    was made, and an older `last.ckpt` beside it was taken for the newest.)"""
    import os

    from lightning_multilora.cli import _written_at

    folder = tmp_path / "step=8"
    folder.mkdir()
    (folder / "rank0.ckpt").write_text("")
    (tmp_path / "last.ckpt").write_text("")
    os.utime(folder, (100, 100))
    os.utime(tmp_path / "last.ckpt", (200, 200))
    os.utime(folder / "rank0.ckpt", (300, 300))
    assert (_written_at(folder), _written_at(tmp_path / "last.ckpt")) == (300, 200)


@pytest.mark.parametrize("save_last", [True, False])
def test_ckpt_path_last_resumes_the_checkpoint_an_earlier_run_of_the_root_left(tmp_path, monkeypatch, save_last,
                                                                                capsys):
    """Lightning looks for "last" in the checkpoint folder of the run's own log version, and a resume takes the
    logger's next one: it found none there, warned, and a new run started from step 0 (the interrupted run's trials
    left RUNNING). "last" is the newest checkpoint of the root's versions."""
    monkeypatch.setattr(CrashAt, "starts", [])
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": save_last}}]
    args = _tiny_fit(tmp_path, "--trainer.val_check_interval", "2",
                     adapters="[{name: a, rank: 2, max_steps: 5, batch_size: 2}]")
    with pytest.raises(RuntimeError, match="node lost"):
        main([*args, "--trainer.callbacks", json.dumps([*callbacks, {"class_path": f"{__name__}.CrashAt",
                                                                     "init_args": {"step": 3}}])])
    saved = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / ("last.ckpt" if save_last else
                                                                         "epoch=0-step=2.ckpt")
    assert saved.is_file()
    main([*args, "--ckpt_path", "last", "--trainer.callbacks", json.dumps([*callbacks, {
        "class_path": f"{__name__}.CrashAt"}])])
    assert CrashAt.starts == [(None, 0), (str(saved), 2)]
    summary = json.loads((tmp_path / "lightning_logs" / "version_1" / "sweep_summary.json").read_text())
    assert [(row["adapter"], row["status"], row["steps"]) for row in summary] == [("a", "finished", 5)]
    if save_last:  # the same command once the run has ended (a requeue): done, status 0 (it was a usage error, 2)
        capsys.readouterr()
        main([*args, "--ckpt_path", "last", "--trainer.callbacks", json.dumps(callbacks)])
        err = capsys.readouterr().err
        assert "`--ckpt_path last`: its run had ended, nothing to train: every adapter has already ended (a: " \
               "finished)" in err
        # (its exports named, as the docs say; adding adapters under `last` made another config, a fresh run)
        assert f"their exports: {tmp_path / 'lightning_logs' / 'version_1' / 'adapters' / 'a'}" in err, err
        assert "to train new adapters on from this run, give its checkpoint's path as `--ckpt_path`" in err, err


def test_ckpt_path_last_of_a_schedule_task_resumes_its_own_runs_and_starts_one_where_there_is_none(tmp_path,
                                                                                                   monkeypatch):
    """A schedule's tasks share a root, each in its own log versions: "last" took the newest checkpoint of any, and a
    task's retry resumed another task's run (its adapters trained as the retried task's). Under `multilora schedule`
    (``MULTILORA_TASK_ID``) "last" is the newest of the task's own runs; none there (a first attempt) starts a new
    run with a warning, as Lightning does for "last", so one command serves a task's first attempt and its retries."""
    monkeypatch.setattr(CrashAt, "starts", [])
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}]
    crash = lambda step: json.dumps([*callbacks, {"class_path": f"{__name__}.CrashAt",  # noqa: E731
                                                  "init_args": {"step": step}}])
    task_a = _tiny_fit(tmp_path, "--trainer.val_check_interval", "2", "--ckpt_path", "last",
                       adapters="[{name: a, rank: 2, max_steps: 5, batch_size: 2}]")
    task_b = _tiny_fit(tmp_path, "--trainer.val_check_interval", "2", "--ckpt_path", "last",
                       adapters="[{name: b, rank: 2, max_steps: 3, batch_size: 2}]")
    monkeypatch.setenv("MULTILORA_TASK_ID", "A")
    with pytest.warns(UserWarning, match=r"`ckpt_path` 'last': no checkpoint of task 'A''s runs in .*: a new run"):
        with pytest.raises(RuntimeError, match="node lost"):
            main([*task_a, "--trainer.callbacks", crash(3)])
    saved = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert saved.is_file()
    monkeypatch.setenv("MULTILORA_TASK_ID", "B")  # another task's first attempt: not task A's checkpoint
    with pytest.warns(UserWarning, match=r"no checkpoint of task 'B''s runs"):
        main([*task_b, "--trainer.callbacks", crash(0)])
    monkeypatch.setenv("MULTILORA_TASK_ID", "A")  # task A's retry: its own run, resumed
    main([*task_a, "--trainer.callbacks", crash(0)])
    assert CrashAt.starts == [(None, 0), (None, 0), (str(saved), 2)]
    rows = {v: [(r["adapter"], r["status"], r["steps"]) for r in json.loads(
        (tmp_path / "lightning_logs" / v / "sweep_summary.json").read_text())] for v in ("version_1", "version_2")}
    assert rows == {"version_1": [("b", "finished", 3)], "version_2": [("a", "finished", 5)]}
    claims = [(tmp_path / "lightning_logs" / v / ".multilora_log").read_text().split("\n")[1] for v in (
        "version_0", "version_1", "version_2")]
    assert claims == ["task=A", "task=B", "task=A"]


def test_a_value_refused_as_the_fit_starts_is_a_usage_error_and_leaves_nothing_that_refuses_the_next_run(
        tmp_path, capsys):
    """An optimizer argument the optimizer does not take is found as the fit starts (`configure_optimizers`): it
    ended in a traceback, and the run's claim, config and summary stayed in a log directory of its own, which then
    refused the corrected command ("holds another run's config.yaml...")."""
    args = _tiny_fit(tmp_path, "--trainer.logger", "false")
    with pytest.raises(SystemExit) as done:
        main([*args, "--model.optimizer_kwargs", "{betass: [0.9, 0.99]}"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "betass" in err and "Traceback" not in err, err
    assert not [p.name for p in tmp_path.iterdir() if p.is_file()]
    main(args)
    assert json.loads((tmp_path / "sweep_summary.json").read_text())[0]["status"] == "finished"


def test_ckpt_path_last_resumes_a_run_of_the_same_config_not_the_newest_of_another(tmp_path, monkeypatch):
    """Two commands sharing a root (the CLI's default `runs`), each interrupted: "last" for the first took the
    second's newer checkpoint, trained its adapters under the first's config and started the first's own from step 0
    (a warning said only that they were queued). Runs of another `model` or `data` config are left out, named
    where nothing else is found; the trainer's settings may change on a resume."""
    monkeypatch.setattr(CrashAt, "starts", [])
    checkpoints = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}
    crash = lambda step: ["--trainer.callbacks", json.dumps([checkpoints, {  # noqa: E731
        "class_path": f"{__name__}.CrashAt", "init_args": {"step": step}}])]
    first = _tiny_fit(tmp_path, "--trainer.val_check_interval", "2",
                      adapters="[{name: a, rank: 2, max_steps: 5, batch_size: 2}]")
    second = _tiny_fit(tmp_path, "--trainer.val_check_interval", "2",
                       adapters="[{name: z, rank: 2, max_steps: 5, batch_size: 2}]")
    for args in (first, second):
        with pytest.raises(RuntimeError, match="node lost"):
            main([*args, *crash(3)])
    own, newer = (tmp_path / "lightning_logs" / v / "checkpoints" / "last.ckpt" for v in ("version_0", "version_1"))
    assert own.is_file() and newer.is_file()
    main([*first, "--ckpt_path", "last", "--trainer.log_every_n_steps", "1", *crash(0)])
    assert CrashAt.starts[-1] == (str(own), 2)
    summary = json.loads((tmp_path / "lightning_logs" / "version_2" / "sweep_summary.json").read_text())
    assert [(row["adapter"], row["status"], row["steps"]) for row in summary] == [("a", "finished", 5)]
    other = _tiny_fit(tmp_path / "x", adapters="[{name: c, rank: 3, max_steps: 2, batch_size: 2}]")
    other[other.index("--trainer.default_root_dir") + 1] = str(tmp_path)
    with pytest.warns(UserWarning, match=r"no checkpoint in .* \(the checkpoints there are of runs of another config "
                                         r"\(`model`, `data` or a sweep's callback: .*version_0/checkpoints/last.ckpt"
                                         r".*version_1/checkpoints/last.ckpt.*give one's path to resume it\)\): a new"):
        main([*other, "--ckpt_path", "last", *crash(0)])
    assert CrashAt.starts[-1] == (None, 0)  # (a new run)


def test_a_list_of_adapters_given_later_replaces_the_earlier_one(tmp_path, capsys):
    """jsonargparse merges a list of the same length item by item into the list given before it: the new adapters
    took the fields their predecessors at those places had (another adapter's `lr`, `dataset`, `max_epochs`, which
    then clashed with the `max_steps` given). A list given later, on the command line or in a later config, replaces
    the earlier one; `+=` appends."""
    import yaml

    first = tmp_path / "first.yaml"
    first.write_text(yaml.safe_dump({"model": {"base_model": "tiny-llama", "adapters": [
        {"name": "a", "rank": 2, "lr": 0.01, "max_epochs": 0.5}, {"name": "b", "rank": 2, "dataset": "mul"}]}}))
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({"model": {"adapters": [{"name": "c", "rank": 4}, {"name": "d", "rank": 8}]}}))

    def adapters(*extra):
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(first), *extra, "--print_config"])
        return [{k: v for k, v in a.items() if k in ("name", "lr", "max_epochs", "max_steps", "dataset")}
                for a in yaml.safe_load(capsys.readouterr().out)["model"]["adapters"]]

    fresh = {"lr": 2e-4, "max_epochs": None, "dataset": None}
    assert adapters("--model.adapters", "[{name: x, rank: 4}, {name: y, rank: 8, max_steps: 50}]") == [
        {"name": "x", **fresh, "max_steps": None}, {"name": "y", **fresh, "max_steps": 50}]
    replaced = [{"name": "c", **fresh, "max_steps": None}, {"name": "d", **fresh, "max_steps": None}]
    assert adapters("--config", str(second)) == adapters("-c", str(second)) == replaced
    assert adapters("--config", second.read_text()) == replaced  # (a config given inline)
    many = yaml.safe_dump({"model": {"adapters": [{"name": f"adapter_{i}", "rank": 4} for i in range(12)]}})
    assert len(many) > 255 and [a["lr"] for a in adapters("--config", many)] == [2e-4] * 12  # (no file name)
    assert [a["name"] for a in adapters("--model.adapters+={name: e}")] == ["a", "b", "e"]


def test_a_list_of_callbacks_given_later_replaces_the_earlier_one(tmp_path, capsys):
    """The demo's three callbacks and a config's three: merged item by item, the config's OptunaSweep kept the demo's
    grid sampler and base (then refused its float space: "sampler 'grid' needs categorical parameters", a sampler
    the user never set) and its WarmupSelection the demo's warmup fraction. A later list replaces the earlier one."""
    import yaml

    later = tmp_path / "sweep3.yaml"
    later.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning_multilora.callbacks.OptunaSweep",
         "init_args": {"search_space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
                       "n_trials": 4}},
        {"class_path": "lightning_multilora.callbacks.WarmupSelection"},
        {"class_path": "lightning_multilora.callbacks.EarlyExit"}]}}))

    def callbacks(*given):
        with pytest.raises(SystemExit):
            main(["demo", *given, "--print_config"])
        return {c["class_path"].rsplit(".", 1)[1]: c.get("init_args", {})
                for c in yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]}

    demo = callbacks()
    assert demo["OptunaSweep"]["sampler"] == "grid" and len(demo) == 3  # (the demo's own, to be replaced)
    for given in (["--config", str(later)], ["--trainer.callbacks", json.dumps(yaml.safe_load(later.read_text())[
            "trainer"]["callbacks"])]):
        got = callbacks(*given)
        assert got["OptunaSweep"]["sampler"] == "tpe" and got["OptunaSweep"].get("base") in (None, {}), given
        assert got["WarmupSelection"]["warmup_fraction"] == 0.05


def test_what_makes_a_run_for_last_is_its_model_data_and_sweep_on_the_fields_both_configs_have():
    """"last" resumes a run of the same config: two sweeps of one model and data but other search spaces are other
    runs (a sweep's `last` resumed the other's trials); a field one version of the package saves and another does
    not is no difference (a resume after an upgrade started a new run); the trainer's settings may change."""
    from lightning_multilora.cli import MultiLoRACLI, _agree

    def sections(space, n_trials=4, **extra):
        import yaml

        return MultiLoRACLI._config_sections(yaml.safe_dump({
            "model": {"base_model": "tiny-llama", "max_running": 2, **extra}, "data": {"max_val_examples": 4},
            "trainer": {"max_steps": 10, "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
                {"class_path": "lightning_multilora.callbacks.OptunaSweep",
                 "init_args": {"search_space": space, "n_trials": n_trials}}]}}))

    lr = {"lr": {"type": "float", "low": 1e-4, "high": 1e-2}}
    rank = {"rank": {"type": "categorical", "choices": [2, 4]}}
    assert _agree(sections(lr), sections(lr)) and not _agree(sections(lr), sections(rank))
    assert _agree(sections(lr, n_trials=6), sections(lr))  # (a sweep's budget may change on a resume)
    assert _agree(sections(lr, cuda_graphs=False), sections(lr))  # (a field an older version did not save)
    # (how the run goes, not what it trains: more adapters at once on a larger GPU started a new run)
    assert _agree(sections(lr, max_running=3, export_dir="elsewhere", validate_on_finish=False), sections(lr))
    assert not _agree(sections(lr, dtype="bfloat16"), sections(lr))
    assert not _agree(sections(lr, config_overrides={"num_hidden_layers": 1}), sections(lr, config_overrides={}))
    assert not _agree({"adapters": [{"name": "a"}]}, {"adapters": [{"name": "a"}, {"name": "b"}]})


def test_a_smoke_run_without_a_logger_takes_no_log_directory(tmp_path, tmp_path_factory, monkeypatch):
    """`fast_dev_run` writes its exports and summary to a temporary folder; without a logger its claim stayed in the
    root, and the next smoke run and the next real run there were refused ("holds another run's .multilora_log")."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path_factory.mktemp("smoke")))  # (not left in /tmp)
    args = _tiny_fit(tmp_path, "--trainer.logger", "false")
    for _ in range(2):
        with pytest.warns(UserWarning, match="the smoke run writes its adapters and summary to"):
            main([*args, "--trainer.fast_dev_run", "true"])
    assert not (tmp_path / ".multilora_log").exists() and not (tmp_path / "adapters").exists()
    main(args)
    assert json.loads((tmp_path / "sweep_summary.json").read_text())[0]["status"] == "finished"


def test_a_csv_logger_does_not_warn_that_a_new_runs_folder_holds_earlier_logs(tmp_path):
    """The run's claim, made in its logger's folder as it starts, made a CSVLogger say on every new run that the folder
    "exists and is not empty. Previous log files in this directory will be deleted"."""
    logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        main(_tiny_fit(tmp_path, "--trainer.logger", logger))
    assert not [w for w in seen if "exists and is not empty" in str(w.message)]
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").is_file()


def test_python_dash_m_runs_the_multilora_command(capsys, monkeypatch):
    """``python -m lightning_multilora fit ...`` (a user without the `multilora` script on PATH) failed: "No module
    named lightning_multilora.__main__"."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["lightning_multilora", "fit", "--help"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("lightning_multilora", run_name="__main__", alter_sys=True)
    assert exit.value.code == 0
    assert "--model.adapters" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["command line", "config"])
def test_one_adapter_given_where_the_list_goes_is_said_so(tmp_path, capsys, given):
    """An adapter mapping given as `model.adapters` (a config's item without its '- ', or ``--model.adapters
    '{name: a}'``) got jsonargparse's "Does not validate against any of the Union subtypes ... Expected a <class
    'list'>"; it says what the list looks like in both places."""
    config = tmp_path / "one.yaml"
    config.write_text("model:\n  adapters:\n    name: a\n    rank: 4\n")
    args = ["--config", str(config)] if given == "config" else ["--model.adapters", "{name: a, rank: 4}"]
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.default_root_dir", str(tmp_path), *args, "--print_config"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and ("error: `model.adapters` is a list of adapters, got one mapping ({'name': 'a', "
                                     "'rank': 4}): in a config, begin each adapter with '- '") in err, err
    assert "--model.adapters '[{name: a, rank: 4}]'" in err and "Union subtypes" not in err, err
