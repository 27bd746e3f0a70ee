"""Sources, tokenizers, per-adapter streams and packing."""

from __future__ import annotations

import gzip
import itertools
import json
import warnings

import lightning as L
import numpy as np
import pytest
import torch

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import (
    AdapterStream,
    ByteTokenizer,
    GeneratedArithmetic,
    HFDatasetSource,
    JSONLSource,
    ListSource,
    PreferenceSource,
)
from lightning_multilora.data.datamodule import IGNORE_INDEX


def test_generated_arithmetic_is_seeded_and_correct():
    a, b = GeneratedArithmetic(50, seed=3).examples(), GeneratedArithmetic(50, seed=3).examples()
    assert a == b and a != GeneratedArithmetic(50, seed=4).examples()
    for ex in GeneratedArithmetic(200, seed=0, operations=("add", "sub", "mul")).examples():
        numbers = [int(t.strip("?.")) for t in ex.prompt.split() if t.strip("?.").isdigit()]
        answer = int(ex.completion)
        assert answer in (numbers[0] + numbers[1], numbers[0] - numbers[1], numbers[0] * numbers[1])
    for kwargs, message in (({"operations": ("div",)}, "`operations` must be a non-empty list of add, sub, mul"),
                            ({"operations": "mul"}, "`operations` .*got 'mul'"),  # (a string: its letters were the operations)
                            ({"num_examples": 10.5}, "`num_examples` must be an integer >= 1, got 10.5"),
                            ({"max_operand": 0}, "`max_operand` must be an integer >= 1, got 0"),
                            ({"seed": "a"}, "`seed` must be an integer")):
        with pytest.raises(ValueError, match=rf"GeneratedArithmetic: {message}"):
            GeneratedArithmetic(**kwargs)
    # distinct problems: no validation example is also a training one (6 of the demo's 64 were)
    examples = GeneratedArithmetic(3000).examples()
    assert len({e.prompt for e in examples}) == 3000
    assert len({e.prompt for e in GeneratedArithmetic(240, max_operand=2, operations=("add",)).examples()}) == 320 - 80
    with pytest.raises(ValueError, match=r"`num_examples` 321 is more than the 320 distinct problems of max_operand=2 "
                                         r"and operations \['add'\]; raise `max_operand`"):
        GeneratedArithmetic(321, max_operand=2, operations=("add",))


def test_gsm8k_formatter_on_the_real_training_split(shared_data):
    source = JSONLSource(str(shared_data / "gsm8k" / "train.jsonl"), format="gsm8k")
    examples = source.examples()
    assert len(examples) == 7473
    first = examples[0]
    assert first.prompt.startswith("Question: ") and first.prompt.endswith("\nAnswer:")
    assert "####" in first.completion and first.completion.startswith(" ")


def test_jsonl_gz_and_hf_datasets_sources(tmp_path):
    records = [{"q": f"what is {i}?", "a": str(i)} for i in range(6)]
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    got = JSONLSource(str(path), prompt_field="q", completion_field="a").examples()
    assert [e.completion for e in got] == [str(i) for i in range(6)]
    plain = tmp_path / "qa.json"
    plain.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(4)))
    hf = HFDatasetSource("json", data_files=str(plain), format="question_answer").examples()
    assert hf[2].prompt == "Question: q2\nAnswer:" and hf[2].completion == " a2"
    with pytest.raises(ValueError, match=r"record has no field\(s\) \['prompt', 'completion'\]; it has \['a', 'q'\]; "
                                         r"name "):
        JSONLSource(str(path)).examples()
    pairs = tmp_path / "pairs.jsonl"  # (preference pairs given to an SFT source: where they go, said)
    pairs.write_text(json.dumps({"prompt": "p", "chosen": " a", "rejected": " b"}) + "\n")
    with pytest.raises(ValueError, match=r"it is a preference pair: a DPO adapter reads such records from a "
                                         r"PreferenceSource"):
        JSONLSource(str(pairs)).examples()
    with pytest.raises(ValueError, match="`format` can be"):
        JSONLSource(str(path), format="alpaca")


def test_hf_source_reads_a_save_to_disk_folder(tmp_path):
    """``load_dataset`` refuses a Dataset folder written by ``save_to_disk``: such folders are read with
    ``load_from_disk``, ``split`` taken from a DatasetDict (one it lacks named with those it has); a saved Dataset is
    read whole."""
    datasets = pytest.importorskip("datasets")

    def rows(tag, n):
        return datasets.Dataset.from_list([{"question": f"{tag}{i}", "answer": str(i)} for i in range(n)])

    datasets.DatasetDict({"train": rows("tr", 5), "test": rows("te", 3)}).save_to_disk(tmp_path / "dict")
    rows("one", 4).save_to_disk(tmp_path / "one")
    datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}] * 2, split="test").save_to_disk(tmp_path / "test")
    assert len(HFDatasetSource(str(tmp_path / "one"), format="question_answer").examples()) == 4
    folder = str(tmp_path / "dict")
    train = HFDatasetSource(folder, format="question_answer").examples()
    assert [e.prompt for e in train] == [f"Question: tr{i}\nAnswer:" for i in range(5)]
    test = HFDatasetSource(folder, split="test", format="gsm8k", prompt_field="answer",
                           completion_field="question", limit=2).examples()
    assert [(e.prompt, e.completion, e.source) for e in test] == [
        ("Question: 0\nAnswer:", " te0", f"{folder}[0]"), ("Question: 1\nAnswer:", " te1", f"{folder}[1]")]
    with pytest.raises(ValueError, match=r"HFDatasetSource: `split` 'validation' is not a split of the DatasetDict "
                                         r"saved at .*dict'; its splits are \['test', 'train'\]"):
        HFDatasetSource(folder, split="validation").examples()
    with pytest.raises(ValueError, match=r"its splits are \['test', 'train'\] \(a slice is for `load_dataset`: "
                                         r"`limit` takes the first examples\)"):
        HFDatasetSource(folder, split="train[:2]").examples()
    with pytest.raises(ValueError, match=r"`split` 'test' is not in .*one': it holds one Dataset \(saved without a "
                                         r"split name\), read whole with `split` 'train'$"):
        HFDatasetSource(str(tmp_path / "one"), split="test").examples()
    for split in ("train", "test"):
        assert len(HFDatasetSource(str(tmp_path / "test"), split=split).examples()) == 2
    with pytest.raises(ValueError, match=r"\(saved as split 'test'\), read whole with `split` 'train' or 'test'"):
        HFDatasetSource(str(tmp_path / "test"), split="validation").examples()
    with pytest.raises(ValueError, match=r"written by `save_to_disk`, which takes no `name` or `data_files` "
                                         r"\(got name='main', data_files=None\)"):
        HFDatasetSource(folder, name="main").examples()


def test_prompt_and_completion_fields_are_read_with_every_format(tmp_path):
    """``prompt_field`` / ``completion_field`` were overwritten with question/answer by the ``gsm8k`` and
    ``question_answer`` formats; left out (None) they are the format's own fields, given they are read with any
    format."""
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"q": f" q{i} ", "a": f"a{i}", "question": "Q", "answer": "A"})
                              for i in range(3)))
    for fmt in ("gsm8k", "question_answer"):
        got = JSONLSource(str(path), format=fmt, prompt_field="q", completion_field="a").examples()[1]
        assert (got.prompt, got.completion) == ("Question: q1\nAnswer:", " a1")
        hf = HFDatasetSource("json", data_files=str(path), format=fmt, prompt_field="q", completion_field="a")
        assert hf.examples()[2].completion == " a2"
        assert JSONLSource(str(path), fmt).examples()[0].prompt == "Question: Q\nAnswer:"  # (the format's own)
        mixed = JSONLSource(str(path), fmt, None, "a").examples()[0]  # (positional; one field given)
        assert (mixed.prompt, mixed.completion) == ("Question: Q\nAnswer:", " a0")
    assert JSONLSource(str(path), "prompt_completion", "q", "answer").examples()[0].prompt == " q0 "
    with pytest.raises(ValueError, match=r"record has no field\(s\) \['prompt', 'completion'\]"):
        JSONLSource(str(path)).examples()
    # as a config gives them (LightningCLI builds the data module's sources with jsonargparse)
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MultiLoRADataModule, "data")
    config = parser.parse_string(f"""
data:
  sources:
    qa:
      class_path: lightning_multilora.data.JSONLSource
      init_args: {{path: {path}, format: gsm8k, prompt_field: q, completion_field: a}}
    own: {{class_path: lightning_multilora.data.JSONLSource, init_args: {{path: {path}, format: question_answer}}}}
""")
    sources = parser.instantiate_classes(config).data.sources
    assert sources["qa"].examples()[0].completion == " a0" and sources["own"].examples()[0].completion == " A"


def test_bad_lines_settings_and_tokenizers_are_named(tmp_path):
    """A JSONL line that is not a JSON object (its file and line named), a validation cap below 1, and a tokenizer
    path that does not exist are refused with what is allowed."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{prompt: "x"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON .* each line must be one JSON object"):
        JSONLSource(str(path)).examples()
    path.write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match=rf"{path}:1: each line must be one JSON object, got a list \(a JSON array "
                                         r"or a pretty-printed JSON file is read by `HFDatasetSource\(path\)`\)"):
        JSONLSource(str(path)).examples()
    path.write_text('[\n  {"prompt": "a", "completion": "b"}\n]\n')  # (an Alpaca-style file)
    with pytest.raises(ValueError, match=rf"{path}:1: not valid JSON .* is read by `HFDatasetSource\(path\)`"):
        JSONLSource(str(path)).examples()
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"chosen": "H\\n\\nAssistant: a", "rejected": "H\\n\\nAssistant: b"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"{pairs}:2: not valid JSON"):
        PreferenceSource(str(pairs), format="hh_rlhf").examples()
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=r"`max_val_examples` must be an integer >= 1 or None"):
            MultiLoRADataModule(max_val_examples=bad)
    assert MultiLoRADataModule(max_val_examples=np.int64(3)).max_val_examples == 3  # (any integer type)
    with pytest.raises(ValueError, match=r"`tokenizer` '.*nowhere': no such folder.* give 'byte', a tokenizer folder"):
        MultiLoRADataModule(tokenizer=str(tmp_path / "nowhere")).tokenizer
    with pytest.raises(ValueError, match=r"`sources` must name at least one data source"):  # (fell back to the demo's)
        MultiLoRADataModule(sources={})
    for field, bad, message in (("max_length", 2.5, "an integer >= 2 or None"), ("val_batch_size", 2.5, "an integer >= 1"),
                                ("truncate", "no", "True or False"), ("pad_to_multiple_of", 2.5, "an integer >= 1"),
                                ("val_fraction", 1.0, r"a number in \(0, 1\)"), ("max_length", "64", "an integer")):
        with pytest.raises(ValueError, match=rf"MultiLoRADataModule: `{field}` must be {message}"):
            MultiLoRADataModule(**{field: bad})
    with pytest.raises(ValueError, match=r"`sources` must map names to data sources \(JSONLSource, .*got \{'a': 'x.jsonl'\}"):
        MultiLoRADataModule(sources={"a": "x.jsonl"})


def test_field_values_that_are_not_text_and_limits_below_one_are_named(tmp_path):
    """A null or a list where text belongs was trained as "None" / "['x']"; a number is taken as its digits. A
    ``limit`` of 0 or -1 gave "has 1 examples" without naming it."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": 4}\n{"prompt": true, "completion": null}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: field 'completion' must be text \(a string\), got null: the "
                                         r"record holds null there, or lacks the field"):
        JSONLSource(str(path)).examples()
    ragged = tmp_path / "ragged.jsonl"  # (`datasets` fills the field a record lacks with None)
    ragged.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"json \(.*ragged.jsonl\)\[1\]: field 'completion' must be text \(a "
                                         r"string\), got null: .* \(a `datasets` loader gives a field some records "
                                         r"lack as null"):
        HFDatasetSource("json", data_files=str(ragged)).examples()
    assert JSONLSource(str(path), limit=1).examples()[0].completion == "4"
    made = ListSource([{"prompt": True, "completion": np.int64(3)}]).examples()[0]
    assert (made.prompt, made.completion) == ("True", "3")  # (as they print)
    with pytest.raises(ValueError, match=r"records\[0\]: field\(s\) \['rejected'\] are lists of messages and "
                                         r"\['chosen', 'prompt'\] are not: a preference record is text in all"):
        PreferenceSource(records=[{"prompt": "p", "chosen": "c", "rejected": ["x"]}]).examples()
    with pytest.raises(ValueError, match=r"records\[1\]: an hh_rlhf record has no"):
        PreferenceSource(records=[{"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"},
                                  {"chosen": "x", "rejected": "y"}], format="hh_rlhf").examples()
    for source in (lambda limit: JSONLSource(str(path), limit=limit), lambda limit: HFDatasetSource("x", limit=limit),
                   lambda limit: PreferenceSource(records=[], limit=limit)):
        for bad in (0, -1, 2.5):
            with pytest.raises(ValueError, match=r"Source: `limit` must be an integer >= 1 or None"):
                source(bad)


def test_text_fields_that_are_nan_or_infinite_are_named(tmp_path):
    """JSON ``NaN``, ``Infinity`` and a number past a float's range (``1e400``) were trained as the text "nan" /
    "inf"; they are named with their file and line (finite numbers and booleans are still taken as they print)."""
    from decimal import Decimal
    from fractions import Fraction

    path = tmp_path / "d.jsonl"
    for bad, shown in (("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"), ("1e400", "inf"),
                       ("-1e400", "-inf")):
        path.write_text(f'{{"prompt": "a", "completion": 2.5}}\n\n{{"prompt": "b", "completion": {bad}}}\n')
        with pytest.raises(ValueError, match=rf"{path}:3: field 'completion' must be text \(a string\) or a finite "
                                             rf"number, got float {shown}"):
            JSONLSource(str(path)).examples()
        assert JSONLSource(str(path), limit=1).examples()[0].completion == "2.5"
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"prompt": "p", "chosen": 1e308, "rejected": "n"}\n'
                     '{"prompt": NaN, "chosen": "c", "rejected": "n"}\n')
    with pytest.raises(ValueError, match=rf"{pairs}:2: field 'prompt' must be text \(a string\) or a finite number"):
        PreferenceSource(str(pairs)).examples()
    assert PreferenceSource(str(pairs), limit=1).examples()[0].chosen == "1e+308"
    for bad in (float("nan"), np.float32("inf"), Decimal("NaN"), Decimal("-Infinity"), complex(1, float("inf"))):
        with pytest.raises(ValueError, match=r"records\[0\]: field 'prompt' must be text \(a string\) or a finite"):
            ListSource([{"prompt": bad, "completion": "c"}]).examples()
    made = ListSource([{"prompt": 10**400, "completion": Decimal("1e400")}, {"prompt": False, "completion": Fraction(
        10**400, 3)}, {"prompt": np.float64(0.5), "completion": -0.0}]).examples()
    assert [(e.prompt, e.completion[:6]) for e in made] == [("1" + "0" * 400, "1E+400"), ("False", "100000"),
                                                            ("0.5", "-0.0")]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo 12")) == "héllo 12"
    assert max(tok.encode("ÿ")) < tok.pad_token_id < tok.eos_token_id < tok.vocab_size


def test_hf_tokenizer_by_path(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel()
    inner.train_from_iterator([e.prompt + e.completion for e in GeneratedArithmetic(200).examples()],
                              trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<pad>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", pad_token="<pad>").save_pretrained(tmp_path)
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(40)}, tokenizer=str(tmp_path))
    train, val = dm.split("a")
    assert dm.tokenizer.vocab_size <= 200 and len(train) + len(val) == 40
    assert train.labels[0][-1] == dm.tokenizer.eos_token_id
    assert dm.tokenizer.prefix_ids == [] and train.input_ids[0][0] != dm.tokenizer.inner.convert_tokens_to_ids("<s>")
    # a tokenizer that begins every text with BOS (Llama's): rows begin with it too, unlearned
    from tokenizers import processors

    special = ["<unk>", "<pad>", "</s>", "<s>"]
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel()
    inner.train_from_iterator([e.prompt + e.completion for e in GeneratedArithmetic(200).examples()],
                              trainers.BpeTrainer(vocab_size=200, special_tokens=special))
    bos = inner.token_to_id("<s>")
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", pad_token="<pad>",
                            bos_token="<s>").save_pretrained(tmp_path / "bos")
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(40)}, tokenizer=str(tmp_path / "bos"))
    train, _ = dm.split("a")
    assert dm.tokenizer.prefix_ids == [bos]
    assert all(r[0] == bos and r.count(bos) == 1 for r in train.input_ids)
    assert all(labels[0] == IGNORE_INDEX for labels in train.labels)
    dm = MultiLoRADataModule(sources={"p": PreferenceSource(records=[
        {"prompt": "Ada has 12 coins and gets 7 more.", "chosen": " 19", "rejected": " 5"}] * 4)},
        tokenizer=str(tmp_path / "bos"), truncate=True, max_length=8)
    pairs, _ = dm.split("p")  # (a prompt cut to fit keeps the BOS before its end)
    assert all(r[0] == bos and len(r) <= 8 for r in pairs.input_ids + pairs.rejected_ids)


def test_stream_reshuffles_every_epoch_and_resumes():
    stream = AdapterStream(10, 4, seed=1)
    epoch0 = [stream.next_indices() for _ in range(3)]
    assert [len(b) for b in epoch0] == [4, 4, 2] and sorted(sum(epoch0, [])) == list(range(10))
    state = stream.state_dict()
    epoch1 = [stream.next_indices() for _ in range(3)]
    assert epoch1 != epoch0 and sorted(sum(epoch1, [])) == list(range(10))
    again = AdapterStream(10, 4, seed=1)
    again.load_state_dict(state)
    assert [again.next_indices() for _ in range(3)] == epoch1


def test_packing_masks_prompts_and_padding_and_carries_the_layout():
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(60), "b": GeneratedArithmetic(60, seed=9)})
    specs = [AdapterSpec("x", batch_size=2, dataset="a"), AdapterSpec("y", batch_size=3, dataset="b")]
    batch = dm.train_batch(specs)
    assert batch["layout"].names == ("x", "y") and batch["layout"].sizes == (2, 3)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 5
    tok = dm.tokenizer
    for row in range(5):
        n = int(mask[row].sum())
        assert (ids[row, n:] == tok.pad_token_id).all() and (labels[row, n:] == IGNORE_INDEX).all()
        prompt_len = int((labels[row, :n] == IGNORE_INDEX).sum())
        text = tok.decode(ids[row, :prompt_len].tolist())
        assert text.startswith("Q: ") and text.endswith("A:")
        assert labels[row, n - 1] == tok.eos_token_id
    fixed = MultiLoRADataModule(padding="max_length", max_length=128, pad_to_multiple_of=8)
    assert fixed.train_batch([AdapterSpec("z", batch_size=2)])["input_ids"].shape[1] == 128


def test_pack_right_pads_rows_of_any_length_exactly():
    dm = MultiLoRADataModule()
    ids = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    labels = [[IGNORE_INDEX, 6, 7], [8], [IGNORE_INDEX, IGNORE_INDEX, 11, 12, 13]]
    batch = dm.pack(["x", "y"], [(ids[:2], labels[:2]), (ids[2:], labels[2:])])
    width = batch["input_ids"].shape[1]
    assert width >= 5 and batch["layout"].sizes == (2, 1)
    pad = dm.tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [r + [pad] * (width - len(r)) for r in ids]
    assert batch["labels"].tolist() == [r + [IGNORE_INDEX] * (width - len(r)) for r in labels]
    assert batch["attention_mask"].tolist() == [[1] * len(r) + [0] * (width - len(r)) for r in ids]
    assert batch["attention_mask"].dtype == batch["input_ids"].dtype == torch.long


def test_a_length_rounded_up_stops_at_the_longest_a_row_may_be():
    rows = [([[5] * 250], [[5] * 250])]
    dm = MultiLoRADataModule(max_length=256, pad_to_multiple_of=100)
    assert dm.pack(["x"], rows)["input_ids"].shape == (1, 256)  # (was 300: past max_length and the model's 256)
    dm = MultiLoRADataModule(max_length=256, padding="max_length", pad_to_multiple_of=8)
    assert dm.pack(["x"], [([[5] * 10], [[5] * 10])])["input_ids"].shape == (1, 256)
    assert MultiLoRADataModule(pad_to_multiple_of=100).pack(["x"], rows)["input_ids"].shape == (1, 300)  # no limit


def test_text_that_is_not_unicode_is_named_with_its_source_and_record(tmp_path):
    """A codec's error is a ValueError, so an adapter's check passed it on bare ("'utf-8' codec can't decode byte
    0xe9..."), naming neither the source nor the record; a lone surrogate (JSON "\\ud83d", half an emoji) failed at
    tokenization the same way."""
    from lightning_multilora import AdapterSpec

    good = '{"prompt": "a", "completion": "b"}\n' * 4
    (tmp_path / "half.jsonl").write_text(good + '{"prompt": "smile \\ud83d", "completion": "b"}\n')
    with pytest.raises(ValueError, match=r"half.jsonl:5: field 'prompt' holds '\\ud83d' at character 6, half of a "
                                         r"UTF-16 surrogate pair"):
        JSONLSource(str(tmp_path / "half.jsonl")).examples()
    (tmp_path / "chat.jsonl").write_text(  # (in a message: the tokenizer's TypeError, naming neither line nor field)
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "smile \\ud83d"}]}\n')
    with pytest.raises(ValueError, match=r"chat.jsonl:1: message 1 of 'messages': field 'content' holds '\\ud83d' at "
                                         r"character 6, half of a UTF-16 surrogate pair"):
        JSONLSource(str(tmp_path / "chat.jsonl"), format="messages").examples()
    (tmp_path / "latin.jsonl").write_bytes(good.encode() * 60 + b'{"prompt": "caf\xe9", "completion": "b"}\n')
    dm = MultiLoRADataModule(sources={"latin": HFDatasetSource("json", data_files=str(tmp_path / "latin.jsonl"))})
    with pytest.raises(ValueError, match=r"data source 'latin' \(HFDatasetSource.*\) holds text that is not valid "
                                         r"Unicode \(UnicodeDecodeError: 'utf-8' codec"):
        dm.check(AdapterSpec("a", dataset="latin"))


def test_examples_with_an_empty_completion_are_said(tmp_path):
    """An SFT row with an empty completion learns the end of text straight after its prompt: said, as an empty
    answer of a preference pair was."""
    from lightning_multilora.data import ListSource

    records = [{"prompt": f"q{i}", "completion": "" if i % 3 == 0 else f"a{i}"} for i in range(12)]
    dm = MultiLoRADataModule(sources={"s": ListSource(records)}, val_fraction=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, val = dm.split("s")
    said = [str(w.message) for w in caught if "empty (or blank) completion" in str(w.message)]
    assert len(said) == 1 and "'s': 4 of 12 examples have an empty (or blank) completion (" in said[0], said
    assert said[0].endswith("each learns the end of text alone (after any white space)")
    assert len(train.input_ids) + len(val.input_ids) == 12  # (said, and trained: not left out)
    # an SFT source with every completion given says nothing of it
    full = MultiLoRADataModule(sources={"f": ListSource([{"prompt": "q", "completion": "a"}] * 4)}, val_fraction=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full.split("f")
    assert not [w for w in caught if "blank) completion" in str(w.message)]
    # a completion of white space alone, and a Q/A record's empty answer (its completion " "), are said too
    blank = MultiLoRADataModule(sources={"w": ListSource([{"prompt": "q", "completion": "  \n"}] * 3 + [
        {"prompt": "q", "completion": "a"}]), "qa": ListSource([{"question": "q", "answer": ""}] * 2, format="gsm8k")})
    for name, count in (("w", "3 of 4"), ("qa", "2 of 2")):
        with pytest.warns(UserWarning, match=rf"'{name}': {count} examples have an empty \(or blank\) completion"):
            blank.split(name)


def test_files_that_are_not_utf8_or_damaged_gzip_are_named_and_gzip_is_told_by_its_bytes(tmp_path):
    good = b'{"prompt": "a", "completion": "b"}\n'
    (tmp_path / "latin.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:3: not UTF-8 text"):
        JSONLSource(str(tmp_path / "latin.jsonl")).examples()
    whole = gzip.compress(good * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut.jsonl.gz: a damaged gzip file after line \d+"):
        JSONLSource(str(tmp_path / "cut.jsonl.gz")).examples()
    (tmp_path / "named_plain.jsonl").write_bytes(gzip.compress(good * 3))  # gzipped, named .jsonl
    assert len(JSONLSource(str(tmp_path / "named_plain.jsonl")).examples()) == 3
    pair = b'{"prompt": "q", "chosen": " y", "rejected": " n"}\n'
    (tmp_path / "pairs.JSONL.GZ").write_bytes(gzip.compress(pair * 2))
    assert len(PreferenceSource(str(tmp_path / "pairs.JSONL.GZ")).examples()) == 2


def test_bzip2_and_xz_files_are_read_and_zstd_and_damaged_ones_are_named(tmp_path):
    """A ``.jsonl.bz2`` or ``.jsonl.xz`` was read as text and refused as "not UTF-8 text" at line 1."""
    import bz2
    import lzma

    good = b'{"prompt": "a", "completion": "b"}\n'
    for name, compress in (("d.jsonl.bz2", bz2.compress), ("d.jsonl.xz", lzma.compress), ("xz_named.jsonl",
                                                                                            lzma.compress)):
        (tmp_path / name).write_bytes(compress(good * 3))
        made = JSONLSource(str(tmp_path / name)).examples()
        assert [(e.prompt, e.completion) for e in made] == [("a", "b")] * 3
    pair = b'{"prompt": "q", "chosen": " y", "rejected": " n"}\n'
    (tmp_path / "pairs.jsonl.xz").write_bytes(lzma.compress(pair * 2))
    assert len(PreferenceSource(str(tmp_path / "pairs.jsonl.xz")).examples()) == 2
    for name, compress, kind in (("cut.jsonl.bz2", bz2.compress, "bzip2"), ("cut.jsonl.xz", lzma.compress, "xz")):
        whole = compress(good * 2000)
        (tmp_path / name).write_bytes(whole[: len(whole) // 2])
        with pytest.raises(ValueError, match=rf"{name}: a damaged {kind} file after line \d+"):
            JSONLSource(str(tmp_path / name)).examples()
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    with pytest.raises(ValueError, match=r"d.jsonl.zst: a zstd-compressed file, which this source does not read: "
                                         r"decompress it \(`zstd -d`\)"):
        JSONLSource(str(tmp_path / "d.jsonl.zst")).examples()


def test_a_source_class_a_missing_tokenizer_a_bom_and_numbers_read_from_text_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"`sources\['a'\]` is the class GeneratedArithmetic, not a source: give an "
                                         r"instance, GeneratedArithmetic\(...\)"):
        MultiLoRADataModule(sources={"a": GeneratedArithmetic})
    with pytest.raises(ValueError, match=r"`tokenizer` must be 'byte' .* a tokenizer's folder or hub name, or a "
                                         r"Hugging Face tokenizer object, got None"):
        MultiLoRADataModule(tokenizer=None)
    from pathlib import Path

    assert MultiLoRADataModule(tokenizer=Path("byte")).tokenizer_name == "byte"  # (a path: as its text)
    bom = tmp_path / "bom.jsonl"  # (as some Windows editors save UTF-8)
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "Q:", "completion": " 1"}\n{"prompt": "R:", "completion": " 2"}\n')
    assert [e.completion for e in JSONLSource(str(bom)).examples()] == [" 1", " 2"]
    csv = tmp_path / "d.csv"  # a completion " 26" that `datasets` reads as the number 26
    csv.write_text("prompt,completion\nQ:, 26\nR:, 3\n")
    with pytest.warns(UserWarning, match=r"HFDatasetSource\(csv\): the loader read text field\(s\) as numbers "
                                         r"\('completion': int64\).*a leading space"):
        assert [e.completion for e in HFDatasetSource("csv", data_files=str(csv)).examples()] == ["26", "3"]


def test_a_fit_starts_new_adapters_data_from_the_beginning_and_goes_on_with_a_modules_own(trainer_kwargs):
    """A data module reused for a second fit (a notebook's next sweep) carried an adapter's position, of a run cut by
    `max_steps`, to the new module's adapter of the same name; a second fit of the same module goes on from it."""
    dm = MultiLoRADataModule(sources={"a": GeneratedArithmetic(100)})
    for _ in range(2):
        module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", rank=2, batch_size=4, max_steps=10)])
        L.Trainer(**{**trainer_kwargs, "max_steps": 3}).fit(module, dm)
        assert dm.state_dict()["streams"]["a"]["position"] == 12
    L.Trainer(**{**trainer_kwargs, "max_steps": 2}).fit(module, dm)
    assert module.registry["a"].step == 5 and dm.state_dict()["streams"]["a"]["position"] == 20


def test_the_byte_tokenizer_on_a_model_of_another_vocabulary_is_warned_of(tmp_path, trainer_kwargs):
    """The default tokenizer ('byte') trained a checkpoint with its own vocabulary on byte ids, silently."""
    from lightning_multilora.base_model import build_base_model

    build_base_model("tiny-llama", config_overrides={"vocab_size": 400}).save_pretrained(tmp_path / "base")
    module = MultiLoRAModule(str(tmp_path / "base"), adapters=[AdapterSpec("a", rank=2, max_steps=1)])
    with pytest.warns(UserWarning, match=r"tokenizer='byte'\): the data is read as bytes .* and the model's "
                                         r"vocabulary has 400 tokens: give the model's own tokenizer"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"a": GeneratedArithmetic(20)}))


def test_a_list_source_is_given_a_list():
    for records in ({"prompt": "a", "completion": "b"}, "abc", 3):
        with pytest.raises(ValueError, match="ListSource: `records` must be a list of mappings"):
            ListSource(records)
    assert len(ListSource(iter([{"prompt": "a", "completion": "b"}])).examples()) == 1
    for bad in (None, "prompt completion", ["a", "b"]):
        with pytest.raises(ValueError, match=r"ListSource: records\[1\] must be a mapping"):
            ListSource([{"prompt": "a", "completion": "b"}, bad]).examples()


def test_empty_dataset_is_a_clear_error():
    dm = MultiLoRADataModule(sources={"empty": ListSource([])})
    with pytest.raises(ValueError, match="data source 'empty' .* has 0 examples"):
        dm.split("empty")
    with pytest.raises(ValueError, match="adapter `dataset` 'nope' is not a data source; sources are: \\['empty'\\]"):
        dm.split("nope")
    with pytest.raises(ValueError, match=r"'empyt' is not a data source; sources are: \['empty'\] \(did you mean "
                                         r"'empty'\?\)"):
        dm.split("empyt")


def test_sequences_longer_than_the_model_maximum_are_errors(tmp_path, trainer_kwargs):
    long = ListSource([{"prompt": "x" * 300, "completion": "y"}, {"prompt": "a", "completion": "b"}])
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", max_steps=1)])  # 256 positions
    with pytest.raises(ValueError, match="example .* is 302 tokens, longer than the maximum sequence length 256"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(sources={"long": long}))
    # a split read before the fit (it knew no model yet) is read again under the model's maximum (it trained on
    # 302-token rows in a 256-position model)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", max_steps=1)])
    early = MultiLoRADataModule(sources={"long": long})
    early.split("long")
    with pytest.raises(ValueError, match="example .* is 302 tokens, longer than the maximum sequence length 256"):
        L.Trainer(**trainer_kwargs).fit(module, early)
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a", max_steps=1)])
    with pytest.raises(ValueError, match="`max_length` 1024 is longer than the model's maximum sequence length 256"):
        L.Trainer(**trainer_kwargs).fit(module, MultiLoRADataModule(max_length=1024))
    three = ListSource(long.records + [{"prompt": "c", "completion": "d" * 80}])
    # the long-prompt example has no completion left after truncation and is dropped (said); the other is cut
    with pytest.warns(UserWarning) as caught:
        train, val = MultiLoRADataModule(sources={"long": three}, truncate=True, max_length=64).split("long")
    assert len(train) + len(val) == 2 and max(len(r) for r in train.input_ids + val.input_ids) == 64
    said = [str(w.message) for w in caught]
    assert any("data source 'long': 1 of 3 examples kept no completion tokens after truncation to 64 tokens" in m
               for m in said)
    assert any("data source 'long': 1 of the 2 examples kept were cut at 64 tokens inside their completion (its end "
               "and EOS are not learned)" in m for m in said)  # (the 80-token answer; the other one fits)
    with pytest.raises(ValueError, match=r"data source 'long': 1 of its 2 examples keep completion tokens after "
                                         r"truncation to 64 tokens \(`max_length`; the prompts fill the rest\), and "
                                         r"it needs at least 2"):
        MultiLoRADataModule(sources={"long": long}, truncate=True, max_length=64).split("long")


def test_the_validation_share_is_of_the_examples_truncation_keeps():
    # 90 examples whose prompt fills the row (dropped by truncation) and 10 that fit: 10% of the 10 kept validate
    records = [{"prompt": "p" * 200, "completion": "x"}] * 90 + [{"prompt": "q", "completion": "y"}] * 10
    with pytest.warns(UserWarning, match="90 of 100 examples kept no completion tokens"):
        train, val = MultiLoRADataModule(sources={"d": ListSource(records)}, truncate=True, max_length=64,
                                         val_fraction=0.1).split("d")
    assert (len(train), len(val)) == (9, 1)


def test_a_data_position_from_a_split_of_another_size_restarts_its_epoch():
    """A checkpoint's stream position in a training split that has since changed size (the data or its settings
    changed) cannot be kept: said, and the adapter starts its epoch anew; an unchanged split resumes where it was."""
    specs = [AdapterSpec("a", batch_size=4, seed=1), AdapterSpec("b", batch_size=4, seed=2)]
    dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40)}, val_fraction=0.25)
    n = dm.num_train_examples(None)
    dm.load_state_dict({"streams": {"a": {"epoch": 2, "position": 8, "num_examples": n + 5},
                                    "b": {"epoch": 2, "position": 8, "num_examples": n}}})
    with pytest.warns(UserWarning, match=rf"adapter 'a': .* has {n} examples now and had {n + 5} .* starts epoch 2"):
        a = dm.stream(specs[0])
    assert (a.epoch, a.position) == (2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = dm.stream(specs[1])
    assert (b.epoch, b.position) == (2, 8) and b.state_dict()["num_examples"] == n
    dm.load_state_dict({"streams": {"a": {"epoch": 0, "position": n + 3}}})  # (an older checkpoint: no size)
    with pytest.warns(UserWarning, match="fewer than its saved position"):
        assert dm.stream(specs[0]).position == 0


def test_a_data_position_in_a_split_of_other_examples_of_the_same_size_is_said():
    """Another `split_seed` (or other data of as many examples) resumed the saved position in other examples,
    unsaid: the adapter drew other batches than the run it resumes. Said now; the same split resumes silently."""
    spec = AdapterSpec("a", batch_size=4, seed=1)

    def saved(**kwargs):
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40)}, val_fraction=0.25, **kwargs)
        dm.stream(spec).next_indices()
        return dm.state_dict()

    state = saved()
    assert state["streams"]["a"]["position"] == 4
    for kwargs, data, other in (({}, 0, False), ({"split_seed": 7}, 0, True), ({}, 1, True)):
        dm = MultiLoRADataModule(sources={"arith": GeneratedArithmetic(40, seed=data)}, val_fraction=0.25, **kwargs)
        dm.load_state_dict(state)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            stream = dm.stream(spec)
        assert (stream.epoch, stream.position) == (0, 4)
        assert any("holds other examples now than when the checkpoint was written, as many (30" in str(w.message)
                   for w in said) == other, [str(w.message) for w in said]
    assert saved()["streams"]["a"]["digest"] == state["streams"]["a"]["digest"] != saved(split_seed=7)[
        "streams"]["a"]["digest"]


def test_an_example_too_long_is_named_by_where_it_came_from(tmp_path):
    """The "too long" error named an example by its index in its source only; it names its file and line (JSONL,
    preference file), ``records[i]`` or ``path[i]`` too. Where it came from is no part of an example's equality."""
    from lightning_multilora.data import Example, PreferenceExample

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "' + "x" * 100 + '", "completion": "y"}\n'
                    '{"prompt": "c", "completion": "d"}\n')
    assert [e.source for e in JSONLSource(str(path)).examples()] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    dm = MultiLoRADataModule(sources={"file": JSONLSource(str(path))}, max_length=32)
    with pytest.raises(ValueError, match=rf"example 1 \({path}:3\) of data source 'file' is 102 tokens, longer than "
                                         "the maximum sequence length 32"):
        dm.split("file")
    listed = ListSource([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b" * 40}])
    with pytest.raises(ValueError, match=r"example 1 \(records\[1\]\) of data source 'list' is 42 tokens"):
        MultiLoRADataModule(sources={"list": listed}, max_length=32).split("list")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"prompt": "q", "chosen": "y", "rejected": "n"}\n'
                     '{"prompt": "q", "chosen": "y", "rejected": "' + "n" * 40 + '"}\n')
    with pytest.raises(ValueError, match=rf"example 1 \({pairs}:2\) of data source 'pairs' is 42 tokens"):
        MultiLoRADataModule(sources={"pairs": PreferenceSource(str(pairs))}, max_length=32).split("pairs")
    hh = PreferenceSource(records=[{"chosen": "H\n\nAssistant: a", "rejected": "H\n\nAssistant: b"}], format="hh_rlhf")
    assert hh.examples()[0].source == "records[0]"
    assert [e.source for e in GeneratedArithmetic(2).examples()] == ["", ""]  # (named by its index alone)
    # equality, hashing (dedup) and the splits are those of the text alone
    assert Example("p", "c", f"{path}:1") == Example("p", "c")
    assert len({Example("p", "c", "a"), Example("p", "c", "b")}) == 1
    assert PreferenceExample("p", "c", "r", "x:1") == PreferenceExample("p", "c", "r", "y:2")
    assert hash(PreferenceExample("p", "c", "r", "x:1")) == hash(PreferenceExample("p", "c", "r"))
    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in records))
    from_file, from_list = (MultiLoRADataModule(sources={"s": s}).split("s") for s in (JSONLSource(str(path)),
                                                                                       ListSource(records)))
    assert all(a.input_ids == b.input_ids and a.labels == b.labels for a, b in zip(from_file, from_list))


def test_truncated_preference_pairs_keep_their_prompts_end_and_both_answers():
    """A pair whose prompt alone fills ``max_length`` keeps the prompt's end and at least half the length for the
    answers (cutting the row's end left it without answer tokens, and dropped it); both rows share that prompt."""
    from lightning_multilora.data import PreferenceSource
    from lightning_multilora.data.datamodule import IGNORE_INDEX

    records = [{"prompt": "p" * 200 + "END", "chosen": "yes" * 10, "rejected": "no"},
               {"prompt": "short", "chosen": "c" * 100, "rejected": "r"},
               {"prompt": "q", "chosen": "a", "rejected": "b"}]
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(records=records)}, truncate=True, max_length=64,
                             val_fraction=0.34)
    train, val = dm.split("pairs")
    rows = list(zip(train.input_ids + val.input_ids, train.labels + val.labels,
                    train.rejected_ids + val.rejected_ids, train.rejected_labels + val.rejected_labels))
    assert len(rows) == 3  # none dropped
    tok = dm.tokenizer
    for ids, labels, rejected_ids, rejected_labels in rows:
        assert len(ids) <= 64 and len(rejected_ids) <= 64
        prompt = [t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX]
        assert prompt == [t for t, lab in zip(rejected_ids, rejected_labels) if lab == IGNORE_INDEX]  # one prompt
        assert any(lab != IGNORE_INDEX for lab in labels) and any(lab != IGNORE_INDEX for lab in rejected_labels)
    long_prompt = next(r for r in rows if len([x for x in r[1] if x == IGNORE_INDEX]) > 20)
    assert tok.decode([t for t, lab in zip(long_prompt[0], long_prompt[1]) if lab == IGNORE_INDEX]).endswith("END")
    assert len([x for x in long_prompt[1] if x != IGNORE_INDEX]) == 31  # "yes" x10 + EOS: its whole answer


def test_preference_pairs_that_teach_nothing_or_end_at_once_are_named_in_warnings(tmp_path):
    """A pair with one completion for both answers gives DPO no gradient; an empty answer trains toward an immediate
    end of text (4 pairs of the HH-RLHF harmless file have an empty chosen answer). Both are kept and named."""
    from lightning_multilora.data import PreferenceSource

    records = [{"prompt": "q0", "chosen": "a", "rejected": "b"}, {"prompt": "q1", "chosen": "same", "rejected": "same"},
               {"prompt": "q2", "chosen": "", "rejected": "no"}, {"prompt": "q3", "chosen": "c", "rejected": "d"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    dm = MultiLoRADataModule(sources={"pairs": PreferenceSource(path=str(path))})
    with pytest.warns(UserWarning) as caught:
        train, val = dm.split("pairs")
    messages = [str(w.message) for w in caught]
    assert any(f"1 of 4 preference pairs have the same chosen and rejected completion (after truncation; example 1 ({path}:2))"
               in m for m in messages), messages
    assert any(f"1 of 4 preference pairs have an empty (or blank) chosen or rejected completion (example 2 ({path}:3))"
               in m for m in messages), messages
    assert len(train.input_ids) + len(val.input_ids) == 4  # kept
    records[1]["rejected"], records[2]["chosen"] = "other", "yes"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiLoRADataModule(sources={"pairs": PreferenceSource(path=str(path))}).split("pairs")


def test_duplicate_adapter_names_are_rejected():
    module = MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("a")])
    with pytest.raises(ValueError, match="duplicate adapter name 'a'"):
        module.add_adapter(AdapterSpec("a", rank=2))
    with pytest.raises(ValueError, match="duplicate adapter name 'b'"):
        MultiLoRAModule("tiny-llama", adapters=[AdapterSpec("b"), AdapterSpec("b")])


def test_unknown_adapter_target_is_rejected_when_added():
    module = MultiLoRAModule("tiny-llama", target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="not among the injected layers"):
        module.add_adapter(AdapterSpec("a", target_modules=["gate_proj"]))


def test_a_completion_is_tokenized_as_it_follows_its_prompt(tmp_path):
    """A SentencePiece tokenizer (Llama 2's, Mistral's, Gemma's kind) begins a text encoded alone with a word
    boundary: a completion without a leading space, encoded alone, got a space the text does not have. The rows
    hold the joint text's tokens (decoded: the prompt and completion as written); with a leading space they are the
    completion's own tokens, as before."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    inner = SentencePieceBPETokenizer(replacement="▁", add_prefix_space=True)
    inner.train_from_iterator([e.prompt + e.completion for e in GeneratedArithmetic(200).examples()], vocab_size=300,
                              min_frequency=1, special_tokens=["<unk>", "<pad>", "</s>"])
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    records = [{"prompt": f"Q: Gus has {i} cards and gets {i + 3} more. How many?\nA:", "completion": f"{2 * i + 3}"}
               for i in range(8)]
    spaced = [dict(r, completion=" " + r["completion"]) for r in records]
    dm = MultiLoRADataModule(sources={"bare": ListSource(records), "spaced": ListSource(spaced)},
                             tokenizer=str(tmp_path), val_fraction=0.25)
    tok = dm.tokenizer
    for name, given in (("bare", records), ("spaced", spaced)):
        train, _ = dm.split(name)
        texts = {r["prompt"] + r["completion"] for r in given}
        for ids, labels in zip(train.input_ids, train.labels):
            assert tok.decode(ids[:-1]) in texts  # (the end of text last)
            completion = [t for t, label in zip(ids[:-1], labels[:-1]) if label != IGNORE_INDEX]
            text = tok.decode(ids[:-1])
            if name == "spaced":
                assert completion == tok.encode(text[text.index("A:") + 2:])
            else:
                assert tok.decode(completion) == text[text.index("A:") + 2:]
                assert completion != tok.encode(text[text.index("A:") + 2:])  # (alone: with a leading "▁")


CHATML = ("{% for m in messages %}{{ bos_token if loop.first else '' }}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat_tokenizer(directory, bos: bool, template: str = CHATML, eos: str = "<|im_end|>") -> None:
    """A byte-level BPE tokenizer with a ChatML template (Qwen's shape: <|im_end|> is EOS, unless ``eos`` names
    another: Gemma-it's and Qwen2.5 base's, whose turn ends before their EOS), saved as a model's is; with ``bos``,
    every text begins with <s> and the template writes it too (Llama 3's shape), unless ``template`` is one that does
    not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<s>"] + ([eos] if eos != "<|im_end|>" else [])
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator([e.prompt + e.completion for e in GeneratedArithmetic(200).examples()],
                              trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 4)])
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=eos, pad_token="<pad>",
                            bos_token="<s>" if bos else None, chat_template=template).save_pretrained(directory)


@pytest.mark.parametrize("bos", [False, True])
def test_conversations_are_rendered_by_the_chat_template_and_the_last_answer_learned(tmp_path, bos):
    """format='messages' (TRL's conversational records): the tokenizer's chat template renders the conversation; the
    loss is on the assistant's last message and the template's end of turn (EOS here, so none is added); a BOS the
    template writes is not doubled by the row's own."""
    _chat_tokenizer(tmp_path / "tok", bos)
    records = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a} + 2?"},
                             {"role": "assistant", "content": f"{a + 2}"}]} for a in range(6)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = MultiLoRADataModule(sources={"c": JSONLSource(str(path), format="messages")}, tokenizer=str(tmp_path / "tok"),
                             val_fraction=0.2)
    train, val = dm.split("c")
    inner = dm.tokenizer.inner
    for ids, labels in zip(train.input_ids + val.input_ids, train.labels + val.labels):
        text = inner.decode(ids)
        a = int(text.split("<|im_start|>user\n")[1].split(" + 2?")[0])
        assert text == inner.apply_chat_template(records[a]["messages"], tokenize=False)  # as the template renders it
        assert ids.count(inner.convert_tokens_to_ids("<s>")) == (1 if bos else 0)
        learned = inner.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
        assert learned == f"{a + 2}<|im_end|>\n"  # the answer and the end of turn, nothing of the prompt
    # the same from memory, and the refusals, each naming its record
    in_memory = MultiLoRADataModule(sources={"c": ListSource(records, format="messages")},
                                    tokenizer=str(tmp_path / "tok"), val_fraction=0.2)
    assert in_memory.split("c")[0].input_ids == train.input_ids
    with pytest.raises(ValueError, match=r"records\[0\]: field 'messages' must end with the assistant's message"):
        ListSource([{"messages": records[0]["messages"][:2]}], format="messages").examples()
    with pytest.raises(ValueError, match=r"records\[0\]: message 1 of 'messages': `role` can be system, user, "
                                         r"assistant, tool, got 'human'"):
        ListSource([{"messages": [{"role": "user", "content": "a"}, {"role": "human", "content": "b"}]}],
                   format="messages").examples()
    with pytest.raises(ValueError, match=r"records\[\d\]: a conversation \(lists of messages\) is rendered by the "
                                         r"tokenizer's chat template: give `tokenizer` a Hugging Face tokenizer with "
                                         r"one, not 'byte'"):
        MultiLoRADataModule(sources={"c": ListSource(records, format="messages")}).split("c")
    # TRL's conversational prompt-completion records (the default format): the same rows
    split = [{"prompt": r["messages"][:2], "completion": r["messages"][2:]} for r in records]
    conversational = MultiLoRADataModule(sources={"c": ListSource(split)}, tokenizer=str(tmp_path / "tok"),
                                         val_fraction=0.2)
    assert conversational.split("c")[0].input_ids == train.input_ids
    with pytest.raises(ValueError, match=r"records\[0\]: a conversational record's 'prompt' must hold at least one "
                                         r"message and its 'completion' one, the assistant's; got roles \['system'\] "
                                         r"and \['user', 'assistant'\]"):
        ListSource([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in records]).examples()
    with pytest.raises(ValueError, match=r"record has no field 'messages' \(format 'messages'\).*TRL's "
                                         r"conversational prompt-completion: read them with the default format"):
        ListSource(split, format="messages").examples()
    # a table of conversations (``datasets``) gives every message every key any message has: None ones are no keys
    padded = [{"messages": [{**m, "name": None} for m in r["messages"]]} for r in records]
    assert ListSource(padded, format="messages").examples() == ListSource(records, format="messages").examples()
    named = [{"messages": [{**records[0]["messages"][0], "name": "sys"}, *records[0]["messages"][1:]]}]
    with pytest.raises(ValueError, match=r"message 0 of 'messages' holds \['name'\] besides 'role' and 'content'"):
        ListSource(named, format="messages").examples()


def test_conversational_preference_pairs_are_rendered_by_the_chat_template(tmp_path):
    """TRL's conversational preference records (the prompt a list of messages, each answer one assistant message;
    or, without a prompt, two conversations that begin alike) were refused ("field 'prompt' must be text"). Each
    row is the chat template's rendering of the prompt and the answer, the answer and its end of turn learned."""
    _chat_tokenizer(tmp_path / "tok", bos=False)
    prompt = lambda a: [{"role": "system", "content": "Be brief."},  # noqa: E731
                        {"role": "user", "content": f"{a} + 2?"}]
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    explicit = [{"prompt": prompt(a), "chosen": answer(f"{a + 2}"), "rejected": answer(f"{a + 3}")} for a in range(6)]
    implicit = [{"chosen": prompt(a) + answer(f"{a + 2}"), "rejected": prompt(a) + answer(f"{a + 3}")}
                for a in range(6)]
    modules = [MultiLoRADataModule(sources={"p": PreferenceSource(records=records)}, tokenizer=str(tmp_path / "tok"),
                                   val_fraction=0.2) for records in (explicit, implicit)]
    (train, val), (other, _) = (dm.split("p") for dm in modules)
    assert train.input_ids == other.input_ids and train.rejected_ids == other.rejected_ids
    inner = modules[0].tokenizer.inner
    rows = list(zip(train.input_ids + val.input_ids, train.labels + val.labels,
                    train.rejected_ids + val.rejected_ids, train.rejected_labels + val.rejected_labels))
    assert len(rows) == 6
    for ids, labels, rejected_ids, rejected_labels in rows:
        a = int(inner.decode(ids).split("<|im_start|>user\n")[1].split(" + 2?")[0])
        assert inner.decode(ids) == inner.apply_chat_template(explicit[a]["prompt"] + explicit[a]["chosen"],
                                                              tokenize=False)
        assert inner.decode(rejected_ids) == inner.apply_chat_template(
            explicit[a]["prompt"] + explicit[a]["rejected"], tokenize=False)
        learned = [inner.decode([t for t, lab in zip(i, ls) if lab != IGNORE_INDEX])
                   for i, ls in ((ids, labels), (rejected_ids, rejected_labels))]
        assert learned == [f"{a + 2}<|im_end|>\n", f"{a + 3}<|im_end|>\n"]
    bad = [({**explicit[0], "chosen": answer("4") * 2}, r"'chosen' and 'rejected' one each after it, the "
                                                         r"assistant's .* got roles \['system', 'user'\], "
                                                         r"\['assistant', 'assistant'\] and \['assistant'\]"),
           ({"chosen": answer("4"), "rejected": answer("5")}, r"got roles \[\], \['assistant'\] and \['assistant'\]"),
           ({**explicit[0], "prompt": "text"}, r"field\(s\) \['chosen', 'rejected'\] are lists of messages and "
                                               r"\['prompt'\] are not")]
    for record, message in bad:
        with pytest.raises(ValueError, match=r"records\[0\]: .*" + message):
            PreferenceSource(records=[record]).examples()


def _template_ids(inner, messages) -> list[int]:
    """``apply_chat_template(messages, tokenize=True)``'s ids (a list, or a mapping's ``input_ids``, by version)."""
    ids = inner.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _sentencepiece_tokenizer(directory) -> None:
    """A SentencePiece-style BPE tokenizer (Llama 2's shape: ``▁`` before the first word and every word after a
    space, <s> before every text), saved as a model's is."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    inner = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    inner.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    texts = ["Question: Is the sky blue?\nAnswer: the sky is blue, yes, not green; no.", "the sky the sea the sun"] * 20
    inner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(directory)


def test_a_prompt_ending_in_a_space_keeps_the_joint_texts_tokens(tmp_path):
    """A SentencePiece tokenizer encodes a prompt's last space as a token of its own (``▁``), which the joint text
    merges into the completion's first word (``▁the``): the joint tokens do not begin with the prompt's, and the
    completion encoded alone after them doubled the space ("Answer:  the sky"). A row is ``tokenizer(prompt +
    completion)``'s tokens (as TRL trains on), its prompt the beginning they share with the prompt's; a pair's two
    rows share the shorter of their two beginnings, one prompt for both answers."""
    _sentencepiece_tokenizer(tmp_path)
    prompt = "Question: Is the sky blue?\nAnswer: "
    dm = MultiLoRADataModule(sources={
        "sft": ListSource([{"prompt": prompt, "completion": "the sky is blue."}] * 2),
        "pairs": PreferenceSource(records=[{"prompt": prompt, "chosen": " yes", "rejected": "no"}] * 2)},
        tokenizer=str(tmp_path))
    tok, inner = dm.tokenizer, dm.tokenizer.inner
    assert tok.encode(prompt)[-1] == inner.convert_tokens_to_ids("▁")  # (the case: the prompt's space alone)
    train, _ = dm.split("sft")
    ids, labels = train.input_ids[0], train.labels[0]
    assert ids == inner(prompt + "the sky is blue.")["input_ids"] + [tok.eos_token_id]
    assert inner.decode(ids, skip_special_tokens=True) == prompt + "the sky is blue."  # (one space, as written)
    learned = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert inner.convert_ids_to_tokens(learned)[0] == "▁the" and learned == ids[-len(learned):]
    pairs, _ = dm.split("pairs")
    rows = [(pairs.input_ids[0], pairs.labels[0]), (pairs.rejected_ids[0], pairs.rejected_labels[0])]
    for (ids, labels), answer in zip(rows, (" yes", "no")):
        assert ids == inner(prompt + answer)["input_ids"] + [tok.eos_token_id]
    prompts = [[t for t, label in zip(ids, labels) if label == IGNORE_INDEX] for ids, labels in rows]
    assert prompts[0] == prompts[1] == inner(prompt)["input_ids"][:-1]  # (the "▁" the rejected answer merges)
    # an empty answer is still said (its row learns the prompt's "▁" the shared beginning leaves it, and the EOS)
    empty = MultiLoRADataModule(sources={"pairs": PreferenceSource(
        records=[{"prompt": prompt, "chosen": "the sky", "rejected": ""}] * 2)}, tokenizer=str(tmp_path))
    with pytest.warns(UserWarning, match=r"2 of 2 preference pairs have an empty \(or blank\) chosen or rejected "):
        empty.split("pairs")


def test_chat_rows_are_the_templates_tokens_with_no_bos_it_does_not_write(tmp_path):
    """A tokenizer that begins every text with BOS (Llama 2's, Phi-3's) and a chat template that writes none: the
    rows began with a BOS that ``apply_chat_template(tokenize=True)`` (what TRL trains on, what inference is given)
    lacks. A row of a conversation is the template's tokens alone; a BOS the template writes stays first when a
    pair's prompt is cut to fit."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    conversations = [[{"role": "user", "content": f"{a} + 2?"}, {"role": "assistant", "content": f"{a + 2}"}]
                     for a in range(4)]
    no_bos = CHATML.replace("{{ bos_token if loop.first else '' }}", "")
    for name, template in (("plain", no_bos), ("bos", CHATML)):
        _chat_tokenizer(tmp_path / name, bos=True, template=template)
        no = [{"role": "assistant", "content": "no"}]
        dm = MultiLoRADataModule(sources={
            "c": ListSource([{"messages": c} for c in conversations], format="messages"),
            "p": PreferenceSource(records=[{"prompt": c[:1], "chosen": c[1:], "rejected": no} for c in conversations])},
            tokenizer=str(tmp_path / name), val_fraction=0.25)
        inner, bos = dm.tokenizer.inner, dm.tokenizer.inner.convert_tokens_to_ids("<s>")
        assert dm.tokenizer.prefix_ids == [bos]  # (a text's rows begin with it)
        train, val = dm.split("c")
        expected = sorted(_template_ids(inner, c) for c in conversations)
        assert sorted(train.input_ids + val.input_ids) == expected
        assert all(row.count(bos) == (name == "bos") for row in expected)
        pairs, _ = dm.split("p")
        for ids, rejected_ids in zip(pairs.input_ids, pairs.rejected_ids):
            a = int(inner.decode(ids).split("<|im_start|>user\n")[1].split(" + 2?")[0])
            assert ids == _template_ids(inner, conversations[a])
            assert rejected_ids == _template_ids(inner, conversations[a][:1] + no)
    cut = MultiLoRADataModule(sources={"p": PreferenceSource(records=[
        {"prompt": [{"role": "system", "content": "Be brief. " * 20}, *c[:1]], "chosen": c[1:],
         "rejected": [{"role": "assistant", "content": "no"}]} for c in conversations])},
        tokenizer=str(tmp_path / "bos"), truncate=True, max_length=24)
    with pytest.warns(UserWarning, match="4 of the 4 preference pairs kept had their prompt cut to fit 24 tokens"):
        pairs, val = cut.split("p")
    assert all(row[0] == bos and row.count(bos) == 1 and len(row) <= 24
               for row in pairs.input_ids + pairs.rejected_ids + val.input_ids + val.rejected_ids)


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
               "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}<|im_start|>"
               "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_that_refuses_a_conversation_names_the_record(tmp_path):
    """A template's own error (Mistral's and Llama 2's "Conversation roles must alternate", a jinja2 TemplateError)
    named no record, and, being no ValueError, stopped the whole fit where its adapter alone cannot start
    (`MultiLoRADataModule.check`). It is a ValueError naming the record's file and line, the template's error its
    cause; a tokenizer without a template names the record too, and neither speaks of a format not given."""
    jinja2 = pytest.importorskip("jinja2")
    _chat_tokenizer(tmp_path / "tok", bos=False, template=ALTERNATING)
    good = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [good] * 5 + [
        [{"role": "system", "content": "Be brief."}, *good]] + [good] * 2))
    dm = MultiLoRADataModule(sources={"c": JSONLSource(str(path), format="messages")}, tokenizer=str(tmp_path / "tok"))
    message = (rf"{path}:6: the tokenizer's chat template refuses this conversation \(roles \['system', 'user', "
               r"'assistant'\]\): TemplateError: Conversation roles must alternate user/assistant")
    with pytest.raises(ValueError, match=message) as caught:
        dm.check(AdapterSpec("x"))
    assert isinstance(caught.value.__cause__, jinja2.TemplateError)
    # no template at all: said of the record, with no word of format 'messages' (none was given)
    _chat_tokenizer(tmp_path / "none", bos=False, template=None)
    conversational = [{"prompt": good[:1], "completion": good[1:]}] * 2
    for tokenizer, expected in ((str(tmp_path / "none"), r"records\[\d\]: tokenizer .*none' has no chat template "
                                                          r"\(its tokenizer_config.json `chat_template`\), which "
                                                          r"renders conversations \(lists of messages\)"),
                                ("byte", r"records\[\d\]: a conversation \(lists of messages\) is rendered by the "
                                         r"tokenizer's chat template: give `tokenizer` a Hugging Face tokenizer")):
        for source in (ListSource(conversational), PreferenceSource(records=[
                {"prompt": good[:1], "chosen": good[1:], "rejected": good[1:]}] * 2)):
            with pytest.raises(ValueError, match=expected) as caught:
                MultiLoRADataModule(sources={"s": source}, tokenizer=tokenizer).split("s")
            assert "format 'messages'" not in str(caught.value)


class _Failing(ListSource):
    """A source whose reading raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__([])
        self.error = error

    def examples(self):
        raise self.error


def test_check_names_a_source_whose_reading_fails_with_any_error(tmp_path):
    """`check` tells the module an adapter cannot start by a ValueError (it then fails alone); any other error from
    reading or tokenizing its source (a loader's TypeError, datasets' DatasetGenerationError on a malformed file)
    stopped the whole fit. Each is a ValueError naming the source, the original its cause; an interrupt is not one
    and goes on as it is."""
    for error in (TypeError("expected str, bytes or os.PathLike object, not Dataset"), RuntimeError("boom")):
        dm = MultiLoRADataModule(sources={"own": _Failing(error)})
        with pytest.raises(ValueError, match=rf"data source 'own' \(_Failing\) could not be read: "
                                             rf"{type(error).__name__}: {error}") as caught:
            dm.check(AdapterSpec("x"))
        assert caught.value.__cause__ is error
    with pytest.raises(KeyboardInterrupt):
        MultiLoRADataModule(sources={"own": _Failing(KeyboardInterrupt())}).check(AdapterSpec("x"))
    pytest.importorskip("datasets")
    broken = tmp_path / "broken.json"
    broken.write_text('{"prompt": "a", "completion": "b"}\n{broken\n')
    dm = MultiLoRADataModule(sources={"hf": HFDatasetSource("json", data_files=str(broken))})
    with pytest.raises(ValueError, match=r"data source 'hf' \(HFDatasetSource\(json, train, prompt_completion\)\) "
                                         r"could not be read: DatasetGenerationError: .*\(\w+"):
        dm.check(AdapterSpec("x"))


def test_hf_source_reads_a_dataset_object_and_a_data_file_path(tmp_path):
    """A ``datasets.Dataset`` given as `path` failed ("expected str, bytes or os.PathLike object"), and a local
    ``.jsonl`` path with "Couldn't find any data file", though local files were said to work. A Dataset or
    DatasetDict is read as a saved one is (a dict's `split` picked, a Dataset whole); a data file by the builder its
    suffix names; anything else is refused by name, with what works."""
    datasets = pytest.importorskip("datasets")
    records = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(4)]
    rows = datasets.Dataset.from_list(records)
    got = HFDatasetSource(rows, format="question_answer").examples()
    assert [(e.prompt, e.completion, e.source) for e in got[:1]] == [("Question: q0\nAnswer:", " a0", "Dataset[0]")]
    both = datasets.DatasetDict({"train": rows, "test": rows.select([3])})
    source = HFDatasetSource(both, split="test", format="gsm8k")
    assert [e.completion for e in source.examples()] == [" a3"]
    assert source.describe() == "HFDatasetSource(DatasetDict['test'], gsm8k)"
    with pytest.raises(ValueError, match=r"`split` 'validation' is not a split of the DatasetDict given as `path`; "
                                         r"its splits are \['test', 'train'\]"):
        HFDatasetSource(both, split="validation").examples()
    with pytest.raises(ValueError, match=r"`split` 'test' is not in the Dataset given as `path`: it is one Dataset "
                                         r"\(made without a split name\), read whole with `split` 'train'"):
        HFDatasetSource(rows, split="test").examples()
    with pytest.raises(ValueError, match=r"HFDatasetSource: a Dataset given as `path` takes no `name` or `data_files`"):
        HFDatasetSource(rows, data_files="x.jsonl")
    with pytest.raises(ValueError, match=r"HFDatasetSource: `path` must be a dataset's Hub name, a local data file or "
                                         r"folder, or a `datasets` Dataset or DatasetDict, got a list; records in "
                                         r"memory are a ListSource's"):
        HFDatasetSource(records)
    # data files, by their suffix (compressed too)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "d.jsonl").write_text(lines)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as fh:
        fh.write(lines)
    (tmp_path / "d.csv").write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in records))
    for name in ("d.jsonl", "d.jsonl.gz", "d.csv"):
        got = HFDatasetSource(str(tmp_path / name), format="question_answer", limit=3).examples()
        assert [e.completion for e in got] == [" a0", " a1", " a2"] and got[1].source == f"{tmp_path / name}[1]"
    (tmp_path / "d.yaml").write_text("a: b\n")
    with pytest.raises(ValueError, match=r"`path` '.*d.yaml' is a file, read by the `datasets` builder its suffix "
                                         r"names \(.json, .jsonl, .csv, .parquet, .arrow, .*\), and its suffix '.yaml' "
                                         r"is none of them; give the builder as `path` and the file as `data_files`"):
        HFDatasetSource(str(tmp_path / "d.yaml")).examples()
    with pytest.raises(ValueError, match=r"is a data file, read as it is: it takes no `name` or `data_files`"):
        HFDatasetSource(str(tmp_path / "d.jsonl"), data_files=str(tmp_path / "d.csv")).examples()
    with pytest.raises(ValueError, match=r"`split` 'test' is not in the data file '.*d.jsonl': a data file is one "
                                         r"split, read whole with `split` 'train'"):  # (datasets' bare "Unknown split")
        HFDatasetSource(str(tmp_path / "d.jsonl"), split="test").examples()
    (tmp_path / "empty.jsonl").write_text("")  # (datasets' JSON builder: a bare "StopIteration: ")
    with pytest.raises(ValueError, match=r"HFDatasetSource: the data file '.*empty.jsonl' holds no records"):
        HFDatasetSource(str(tmp_path / "empty.jsonl")).examples()


def test_a_preference_pairs_prompt_cut_to_fit_is_warned():
    """With ``truncate=True`` a pair's prompt is cut from its beginning to fit (its end kept, next to the answers);
    a row's end cut and an example left out were warned of, a prompt cut was not."""
    long = {"prompt": "Human: " + "tell me about numbers " * 10 + "\n\nAssistant:", "chosen": " yes", "rejected": " no"}
    short = {"prompt": "Human: hi\n\nAssistant:", "chosen": " yes", "rejected": " no"}
    dm = MultiLoRADataModule(sources={"p": PreferenceSource(records=[long] * 3 + [short] * 2)}, truncate=True,
                             max_length=64)
    with pytest.warns(UserWarning, match=r"data source 'p': 3 of the 5 preference pairs kept had their prompt cut to "
                                         r"fit 64 tokens \(its beginning left out, its end kept next to the answers\); "
                                         r"raise `max_length`"):
        train, val = dm.split("p")
    assert all(len(row) <= 64 for row in train.input_ids + val.input_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiLoRADataModule(sources={"p": PreferenceSource(records=[short] * 3)}, truncate=True,
                            max_length=64).split("p")


def test_trl_preference_text_with_an_implicit_prompt_is_split_as_trl_does(tmp_path):
    """TRL's standard preference format with an implicit prompt (``chosen`` and ``rejected`` texts sharing their
    beginning, no ``prompt``) was refused ("record has no field(s) ['prompt']"). It is split as TRL's
    ``extract_prompt`` splits it (``{'prompt': 'The sky is', 'chosen': ' blue.', 'rejected': ' green.'}``), as the
    conversational records already were; texts sharing no beginning are named."""
    from lightning_multilora.data import PreferenceExample

    record = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({"chosen": "Yes.", "rejected": "No."}) + "\n")
    assert PreferenceSource(records=[record]).examples() == [PreferenceExample("The sky is", " blue.", " green.")]
    assert PreferenceSource(str(path), limit=1).examples()[0].source == f"{path}:1"
    with pytest.raises(ValueError, match=rf"{path}:2: record has no field 'prompt', and its 'chosen' and 'rejected' "
                                         r"texts share no beginning to take as one \(TRL's implicit prompt\); give "
                                         r"the prompt as 'prompt'"):
        PreferenceSource(str(path)).examples()
    # (a prompt under another name, or shared white space alone: refused, not split at the first letters)
    with pytest.raises(ValueError, match=r"records\[0\]: record has no field\(s\) \['prompt'\]; it has \['chosen', "
                                         r"'question', 'rejected'\]; a prompt is taken from 'chosen' and 'rejected' "
                                         r"\(the beginning they share, as TRL's extract_prompt\) only where they are "
                                         r"the record's only text fields, and \['question'\] may hold it under another "
                                         r"name: name it 'prompt', or drop \['question'\]"):
        PreferenceSource(records=[{"question": "Capital?", "chosen": "It is Paris.", "rejected": "I think Lyon."}]
                         ).examples()
    with pytest.raises(ValueError, match=r"texts share no beginning to take as one"):
        PreferenceSource(records=[{"chosen": "\nA", "rejected": "\nB"}]).examples()
    with pytest.raises(ValueError, match=r"records\[0\]: an hh_rlhf record has no '\n\nAssistant:' turn \(TRL's "
                                         r"preference text with an implicit prompt.* is read by format "
                                         r"'prompt_chosen_rejected'\)"):
        PreferenceSource(records=[record], format="hh_rlhf").examples()
    pairs = [{"chosen": f"{a} + 2 = {a + 2}", "rejected": f"{a} + 2 = {a + 3}"} for a in range(4)]
    train, val = MultiLoRADataModule(sources={"p": PreferenceSource(records=pairs)}).split("p")
    for ids, labels in zip(train.input_ids + val.input_ids, train.labels + val.labels):
        learned = bytes(t for t, label in zip(ids, labels) if label != IGNORE_INDEX and t < 256).decode()
        prompt = bytes(t for t, label in zip(ids, labels) if label == IGNORE_INDEX).decode()
        assert prompt.endswith(" + 2 =") and learned == f" {int(prompt.split()[0]) + 2}"


def test_a_loaded_tokenizer_and_a_folder_under_home_read_as_its_path_does(tmp_path, monkeypatch):
    """A tokenizer object (TRL's ``processing_class`` habit) was refused with its whole repr (30 KB for Llama 3's),
    and a folder given as ``~/...`` (a YAML config's: no shell expands it) was called "not a tokenizer folder"."""
    from transformers import AutoTokenizer

    _chat_tokenizer(tmp_path / "home" / "tok", bos=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = {"a": GeneratedArithmetic(20)}
    by_path = MultiLoRADataModule(sources=source, tokenizer=str(tmp_path / "home" / "tok")).split("a")
    by_home = MultiLoRADataModule(sources=source, tokenizer="~/tok").split("a")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "home" / "tok")
    dm = MultiLoRADataModule(sources=source, tokenizer=loaded)
    assert dm.tokenizer.inner is loaded and dm.tokenizer_name == str(tmp_path / "home" / "tok")
    assert by_home[0].input_ids == by_path[0].input_ids == dm.split("a")[0].input_ids
    assert by_path[0].input_ids[0][0] == loaded.bos_token_id
    with pytest.raises(ValueError, match=r"Hugging Face tokenizer object, got a dict$"):
        MultiLoRADataModule(tokenizer={"vocab": list(range(10_000))})


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_a_models_checkpoint_saved_without_a_tokenizer_is_not_a_tokenizer_folder(tmp_path, family):
    """transformers 5 builds a model's tokenizer class with no vocabulary from a folder holding its config alone: a
    Qwen2's encoded every text to nothing ("no completion tokens to learn"), a Gemma's to its unknown token (every row
    the same two tokens, trained on without a word)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"`tokenizer` .*base': not a tokenizer folder; .*it holds none of a "
                                         r"tokenizer's files \(tokenizer.json"):
        MultiLoRADataModule(tokenizer=str(tmp_path / "base")).split(None)


def test_a_conversations_row_holds_no_eos_its_template_does_not_write(tmp_path):
    """A template whose turn ends before the tokenizer's EOS (Gemma-it's <end_of_turn> and <eos>, Qwen2.5 base's
    <|im_end|> and <|endoftext|>): an SFT row is the template's tokens, as TRL's SFT trains on them (an EOS was
    appended and learned); a conversational pair's answers too, as TRL 1.16's DPO renders them (an EOS was appended
    where the rendered turn held none)."""
    _chat_tokenizer(tmp_path / "tok", bos=False, eos="</s>")
    chats = [{"messages": [{"role": "user", "content": f"{a} + 2?"}, {"role": "assistant", "content": f"{a + 2}"}]}
             for a in range(4)]
    dm = MultiLoRADataModule(sources={"c": ListSource(chats, format="messages")}, tokenizer=str(tmp_path / "tok"))
    train, val = dm.split("c")
    inner = dm.tokenizer.inner
    for ids, labels in zip(train.input_ids + val.input_ids, train.labels + val.labels):
        a = int(inner.decode(ids).split("<|im_start|>user\n")[1].split(" + 2?")[0])
        assert ids == list(inner.apply_chat_template(chats[a]["messages"], tokenize=True, return_dict=True)
                           ["input_ids"])
        assert inner.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == f"{a + 2}<|im_end|>\n"
    pairs = [{"prompt": c["messages"][:1], "chosen": c["messages"][1:],
              "rejected": [{"role": "assistant", "content": "no"}]} for c in chats]
    dm = MultiLoRADataModule(sources={"p": PreferenceSource(records=pairs)}, tokenizer=str(tmp_path / "tok"))
    train, _ = dm.split("p")
    for ids, labels in zip(train.input_ids + train.rejected_ids, train.labels + train.rejected_labels):
        assert inner.eos_token_id not in ids
        assert inner.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]).endswith("<|im_end|>\n")


def test_a_text_completion_ending_with_eos_gets_no_second_one_as_with_trl(tmp_path):
    """TRL's SFT adds EOS to a completion that does not end with it (its ``add_eos``); one ending with it trained on
    two (``</s></s>``). TRL 1.16's DPO adds EOS to an answer likewise (earlier versions, to both whatever they ended
    with, as was done here)."""
    _chat_tokenizer(tmp_path / "tok", bos=False, eos="</s>")
    records = [{"prompt": f"{a} + 2?", "completion": f" {a + 2}" + ("</s>" if a % 2 else "")} for a in range(6)]
    dm = MultiLoRADataModule(sources={"c": ListSource(records)}, tokenizer=str(tmp_path / "tok"))
    train, val = dm.split("c")
    inner = dm.tokenizer.inner
    for ids, labels in zip(train.input_ids + val.input_ids, train.labels + val.labels):
        a = int(inner.decode(ids).split(" + 2?")[0])
        assert ids == inner(f"{a} + 2? {a + 2}</s>")["input_ids"]  # (TRL's row: its text with one EOS)
        assert inner.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == f" {a + 2}</s>"
    pairs = [{"prompt": f"{a} + 2?", "chosen": f" {a + 2}</s>", "rejected": " no"} for a in range(4)]
    train, _ = MultiLoRADataModule(sources={"p": PreferenceSource(records=pairs)},
                                   tokenizer=str(tmp_path / "tok")).split("p")
    eos = inner.eos_token_id
    assert all(row[-1] == eos and row[-2] != eos for row in train.input_ids + train.rejected_ids)


def test_a_held_out_validation_source_validates_and_its_source_trains_whole():
    """`val_sources` (HF Trainer's and TRL's ``eval_dataset``): the validation split was always carved out of the
    training source, a DatasetDict's ``test`` split or a second file unusable."""
    train_records = [{"prompt": f"t{i}", "completion": "x"} for i in range(7)]
    test_records = [{"prompt": f"v{i}", "completion": "y"} for i in range(5)]
    dm = MultiLoRADataModule(sources={"d": ListSource(train_records), "e": GeneratedArithmetic(20)},
                             val_sources={"d": ListSource(test_records)}, max_val_examples=3)
    train, val = dm.split("d")
    tok = dm.tokenizer
    assert sorted(tok.decode(ids) for ids in train.input_ids) == sorted(f"t{i}x" for i in range(7))
    shown = [tok.decode(ids) for ids in val.input_ids]
    assert len(shown) == 3 and {s[:1] for s in shown} == {"v"} and len(set(shown)) == 3
    assert [len(part) for part in dm.split("e")] == [18, 2]  # (a source without one: its share held out, as before)
    alone = MultiLoRADataModule(sources={"d": ListSource(train_records[:1])}, val_sources={"d": ListSource(
        test_records)}).split("d")
    assert [len(part) for part in alone] == [1, 5]  # (one example trains: the validation is the other source's)
    pairs = PreferenceSource(records=[{"prompt": "p", "chosen": "a", "rejected": "b"}] * 2)
    with pytest.raises(ValueError, match=r"`val_sources\['d'\]` \(PreferenceSource\(records, prompt_chosen_rejected"
                                         r"\)\) holds preference pairs and data source .d. .* holds prompt-completion "
                                         r"examples: give a validation source of the same kind"):
        MultiLoRADataModule(sources={"d": ListSource(train_records)}, val_sources={"d": pairs}).split("d")
    with pytest.raises(ValueError, match=r"`val_sources` names \['x'\], which are not data sources; .* one of "
                                         r"\['d'\]"):
        MultiLoRADataModule(sources={"d": ListSource(train_records)}, val_sources={"x": pairs})
    with pytest.raises(ValueError, match=r"validation source 'd' \(ListSource\) has 0 examples; it needs at least 1 "
                                         r"\(its validation split\)"):
        MultiLoRADataModule(sources={"d": ListSource(train_records)}, val_sources={"d": ListSource([])}).split("d")


def test_preference_records_read_twice_and_bad_records_or_paths_are_named(tmp_path):
    """A generator given as `records` was read once: a fit reads its source again (once the model's maximum length
    is known) and found 0 examples. A single record, a number or a missing path were taken and failed later, the
    first as "a record is a mapping, got a str"."""
    records = ({"prompt": f"{a} + 2 =", "chosen": f" {a + 2}", "rejected": f" {a + 3}"} for a in range(6))
    dm = MultiLoRADataModule(sources={"p": PreferenceSource(records=records)})
    first = dm.split("p")[0].input_ids
    dm._splits.clear()  # (as `setup` does once the model's maximum length is known)
    assert dm.split("p")[0].input_ids == first and len(first) == 5
    with pytest.raises(ValueError, match=r"`records` must be a list of mappings .* got a dict \(one record: put it "
                                         r"in a list\)"):
        PreferenceSource(records={"prompt": "p", "chosen": "a", "rejected": "b"})
    with pytest.raises(ValueError, match=r"`records` must be a list .* got a int"):
        PreferenceSource(records=5)
    for make in (lambda: JSONLSource(None), lambda: PreferenceSource(path=3)):
        with pytest.raises(ValueError, match=r"`path` must be a JSON-lines file's path \(text or a PathLike\), got"):
            make()
    assert JSONLSource(tmp_path / "a.jsonl").path == str(tmp_path / "a.jsonl")
    # a "~/..." path (a config's: no shell expands it) is the home folder's, as the tokenizer's is; an endless
    # generator is read up to `limit`
    import os

    assert JSONLSource("~/a.jsonl").path == HFDatasetSource("~/a.jsonl").path == os.path.expanduser("~/a.jsonl")
    endless = ({"prompt": "p", "chosen": f"{a}", "rejected": "x"} for a in itertools.count())
    assert len(PreferenceSource(records=endless, limit=3).examples()) == 3
    # a local data file that is not there is said so (before: the Hub's "Couldn't reach 'data/train.jsonl'")
    assert HFDatasetSource(str(tmp_path / "data" / "train.jsonl.gz")).missing() == (
        f"HFDatasetSource: no file at `path` {str(tmp_path / 'data' / 'train.jsonl.gz')!r}")
    assert HFDatasetSource("openai/gsm8k").missing() is None
    # a local folder (`save_to_disk`'s) misspelt: the Hub's "Repo id must use alphanumeric chars", or offline its
    # "Couldn't reach './my_saved' on the Hub"
    for folder in ("./my_saved", "../my_saved", str(tmp_path / "my_saved")):
        assert HFDatasetSource(folder).missing() == (
            f"HFDatasetSource: no data file or `save_to_disk` folder at `path` {folder!r}")
    assert HFDatasetSource(str(tmp_path)).missing() is None  # (there: read, and refused as what it is)
    # ... and read so (a fit's check looked a mistyped relative path up on the Hub: retried offline, then its error)
    with pytest.raises(FileNotFoundError, match=r"^HFDatasetSource: no file at `path` 'gsm8k/trian.jsonl'$"):
        HFDatasetSource("gsm8k/trian.jsonl").examples()
    # what PreferenceSource cannot read names its route (a JSON array's hint named HFDatasetSource, whose rows a DPO
    # adapter refuses; a DatasetDict was "one record: put it in a list"; a parquet file "not UTF-8 text")
    (tmp_path / "array.json").write_text('[\n  {"prompt": "p", "chosen": "a", "rejected": "b"}\n]\n')
    with pytest.raises(ValueError, match=r"array.json:1: not valid JSON .* give its records, PreferenceSource\(records="
                                         r"datasets.load_dataset\('json', data_files=path\)\['train'\]\)"):
        PreferenceSource(str(tmp_path / "array.json")).examples()
    datasets = pytest.importorskip("datasets")
    pairs = datasets.Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    with pytest.raises(ValueError, match=r"`records` is a DatasetDict: give one of its splits, "
                                         r"records=dataset\[split\] \(its splits: \['train'\]\)"):
        PreferenceSource(records=datasets.DatasetDict({"train": pairs}))
    pairs.to_parquet(str(tmp_path / "pairs.parquet"))
    with pytest.raises(ValueError, match=r"pairs.parquet' is a parquet file; it reads JSON lines \(give its records, "
                                         r"records=datasets.load_dataset\('parquet', data_files=path\)\['train'\]\)"):
        PreferenceSource(str(tmp_path / "pairs.parquet")).examples()
    pairs.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"saved' is a folder; it reads a JSON-lines file \(a `save_to_disk` folder: "
                                         r"give its records, records=datasets.load_from_disk\(path\)\)"):
        PreferenceSource(str(tmp_path / "saved")).examples()
    datasets.DatasetDict({"train": pairs}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"records=datasets.load_from_disk\(path\)\['train'\]\)"):
        PreferenceSource(str(tmp_path / "splits")).examples()
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"plain' is a folder; it reads a JSON-lines file \(give the JSON-lines file "
                                         r"in it\)"):
        PreferenceSource(str(tmp_path / "plain")).examples()


def test_a_sources_examples_of_another_kind_are_named():
    """A source of one's own whose ``examples()`` returned dicts, a generator or a number as a completion failed
    deep inside ("'dict' object has no attribute 'prompt'", "object of type 'generator' has no len()")."""
    from lightning_multilora.data import DataSource, Example, PreferenceExample

    class Own(DataSource):
        def __init__(self, made):
            self.made = made

        def examples(self):
            return self.made()

    cases = [
        (lambda: [{"prompt": "a", "completion": "b"}] * 4, r"`examples\(\)` must return a list of Example, "
         r"ChatExample, PreferenceExample or ChatPreferenceExample .*; item 0 is a dict"),
        (lambda: (Example("a", "b") for _ in range(4)), r"`examples\(\)` must return a list .*, got a generator"),
        (lambda: [Example("a", "b")] * 3 + [Example("a", 5)], r"item 3 of `examples\(\)` \(Example\): `completion` "
         r"must be text, got 5"),
        (lambda: [Example("a", "b"), PreferenceExample("a", "b", "c")] * 2, r"`examples\(\)` mixes preference pairs "
         r"and prompt-completion examples \(item 1: PreferenceExample, item 0: Example\): a source holds one kind"),
    ]
    for made, message in cases:
        dm = MultiLoRADataModule(sources={"own": Own(made)})
        with pytest.raises(ValueError, match=r"data source 'own' \(Own\): " + message):
            dm.split("own")

    class Tagged(Example):  # (a subclass of Example, in a tuple: taken as it was)
        pass

    train, _ = MultiLoRADataModule(sources={"own": Own(lambda: tuple(Tagged(f"q{i}", " a") for i in range(4)))}
                                   ).split("own")
    assert len(train.input_ids) == 3


def test_a_prompt_whose_last_text_the_tokenizer_merges_into_the_completion_is_warned(tmp_path):
    """A tokenizer with no word boundaries merges the prompt's last letters with the completion's first: the row's
    tokens are the joint text's (as TRL trains on), so that text is learned as the completion's; it was not said."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz :?")}}
    vocab["ab"] = len(vocab)
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp_path)
    dm = MultiLoRADataModule(sources={"s": ListSource([{"prompt": "q: ca", "completion": "bc"}] * 3
                                                      + [{"prompt": "q: c", "completion": "bc"}])},
                             tokenizer=str(tmp_path))
    with pytest.warns(UserWarning, match=r"data source 's': in 3 of 4 examples the tokenizer merges the prompt's last "
                                         r"text with the completion's first \(example \d \(records\[\d\]\): 'a', .*\): "
                                         r"that text is learned as part of the completion"):
        train, val = dm.split("s")
    rows = [(ids, labels) for ids, labels in zip(train.input_ids + val.input_ids, train.labels + val.labels)]
    ab = vocab["ab"]
    assert sum(labels[ids.index(ab)] == ab for ids, labels in rows if ab in ids) == 3  # (learned, as warned)


def test_a_validation_batch_holds_no_more_rows_than_a_training_step_of_its_adapters():
    """A validation batch held ``val_batch_size`` examples of every adapter: 16 adapters of batch 1 validated 128 rows
    at once (5x a training step's peak memory on the CPU; out of memory on a GPU that training fit). It is split at
    the adapters' rows of a step (or one adapter's ``val_batch_size`` examples, where more; or ``val_max_rows``),
    and every adapter still sees each of its validation examples once, in order."""
    from lightning_multilora.data import ListSource, PreferenceSource

    records = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(40)]
    pairs = [{"prompt": f"p{i}", "chosen": " yes", "rejected": " no"} for i in range(40)]
    dm = MultiLoRADataModule(sources={"s": ListSource(records), "p": PreferenceSource(records=pairs)},
                             val_fraction=0.25, val_batch_size=4)
    specs = [AdapterSpec(f"a{i}", dataset="s", batch_size=1) for i in range(5)]
    specs.append(AdapterSpec("d", dataset="p", objective="dpo", batch_size=1))
    whole = {s.name: dm.split(s.dataset)[1].rows(range(10), s.objective, s.name) for s in specs}

    def seen(batches):
        rows = {}
        for batch in batches:
            layout = batch["layout"]
            for name, lo, hi in zip(layout.names, layout.starts, layout.ends):
                rows.setdefault(name, []).extend(batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist()
                                                 for r in range(lo, hi))
        return rows

    for cap, expected in ((None, 8), (3, 3), (100, 100)):  # 5 rows + a pair's 2 a step; one DPO adapter's 4 pairs
        dm.val_max_rows = cap
        assert dm.val_rows_cap(specs) == expected
        batches = list(dm.val_batches(specs))
        assert max(b["layout"].num_rows for b in batches) == min(expected, 5 * 4 + 4 * 2)  # (k-th examples: 28 rows)
        got = seen(batches)
        for spec in specs:  # (an SFT adapter's in order; a DPO batch holds its pairs' chosen rows, then rejected)
            order = sorted if spec.objective == "dpo" else list
            assert order(got[spec.name]) == order(whole[spec.name][0]), spec.name
        if cap == 3:  # (a pair is never split: one that does not fit starts the next batch)
            assert all(b["layout"].num_rows == 2 for b in batches if b["layout"].names == ("d",))
    with pytest.raises(ValueError, match="val_max_rows"):
        MultiLoRADataModule(val_max_rows=0)
    # a sanity check's or smoke run's few batches (`peek`) hold examples of every adapter, within the cap
    dm.val_max_rows = None
    first = next(iter(dm.val_batches(specs, peek=True)))["layout"]
    assert first.names == tuple(s.name for s in specs) and first.num_rows == 7  # (one example each: 5 + a pair)
    peeked = seen(dm.val_batches(specs, peek=True))
    for spec in specs:
        order = sorted if spec.objective == "dpo" else list
        assert order(peeked[spec.name]) == order(whole[spec.name][0]), spec.name


def test_a_record_of_other_fields_is_told_which_format_or_fields_read_it(tmp_path):
    """GSM8K's records read with the default format named neither `format='gsm8k'` nor the field arguments; and a
    ListSource had no field arguments (records of other fields were renamed by hand)."""
    from lightning_multilora.data import JSONLSource, ListSource

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"record has no field\(s\) \['prompt', 'completion'\]; it has \['answer', "
                                         r"'question'\]; `format='gsm8k'` \(or 'question_answer'\) reads"):
        JSONLSource(str(path)).examples()
    records = [{"instruction": "say hi", "response": " hi"}]
    with pytest.raises(ValueError, match=r"name the fields that hold them \(`prompt_field=`, `completion_field=`\), or "
                                         r"give a `format` \(one of prompt_completion, question_answer, gsm8k, "):
        ListSource(records).examples()
    (example,) = ListSource(records, prompt_field="instruction", completion_field="response").examples()
    assert (example.prompt, example.completion) == ("say hi", " hi")


def test_a_missing_local_folder_is_refused_at_once_not_looked_for_on_the_hub(tmp_path, monkeypatch):
    """``runs/tok_typo`` (``runs`` a folder here) was taken for a Hub name: ~45 s of retries offline, then the Hub's
    error. Refused at once, as a tokenizer and as a base model; a Hub-shaped name still goes to the Hub."""
    import lightning_multilora.base_model as base_model
    from lightning_multilora.arguments import missing_local_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tok").mkdir(parents=True)
    (tmp_path / "runs" / "tok" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "openai-community").mkdir()  # (a folder named as a Hub org, of no saved model: the Hub's name goes on)
    assert missing_local_folder("runs/tok_typo") and missing_local_folder("a/b/c")
    assert not missing_local_folder("org/model") and not missing_local_folder("gpt2")
    assert not missing_local_folder("runs") and not missing_local_folder("openai-community/gpt2")
    with pytest.raises(ValueError, match=r"`tokenizer` 'runs/tok_typo': no such folder, and no Hugging Face Hub "):
        MultiLoRADataModule(tokenizer="runs/tok_typo").tokenizer
    with pytest.raises(OSError, match=r"`base_model` 'runs/ckpt_typo' is no built-in model .*, no such folder \(a "):
        base_model.build_base_model("runs/ckpt_typo")
