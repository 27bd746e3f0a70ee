"""Sources, tokenizers, per-adapter streams and packing."""

from __future__ import annotations

import gzip
import json

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
    with pytest.raises(ValueError, match=r"record has no field\(s\) \['prompt', 'completion'\]; it has \['a', 'q'\]"):
        JSONLSource(str(path)).examples()
    with pytest.raises(ValueError, match="`format` can be"):
        JSONLSource(str(path), format="alpaca")


def test_bad_lines_settings_and_tokenizers_are_named(tmp_path):
    """A JSONL line that is not a JSON object (its file and line named), a validation cap below 1, and a tokenizer
    path that does not exist are refused with what is allowed."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{prompt: "x"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON .* each line must be one JSON object"):
        JSONLSource(str(path)).examples()
    path.write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match=rf"{path}:1: each line must be one JSON object, got a list"):
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
    with pytest.raises(ValueError, match=rf"{path}:2: field 'completion' must be text \(a string\), got NoneType None"):
        JSONLSource(str(path)).examples()
    assert JSONLSource(str(path), limit=1).examples()[0].completion == "4"
    made = ListSource([{"prompt": True, "completion": np.int64(3)}]).examples()[0]
    assert (made.prompt, made.completion) == ("True", "3")  # (as they print)
    with pytest.raises(ValueError, match=r"records\[0\]: field 'rejected' must be text \(a string\), got list"):
        PreferenceSource(records=[{"prompt": "p", "chosen": "c", "rejected": ["x"]}]).examples()
    with pytest.raises(ValueError, match=r"records\[1\]: an hh_rlhf record has no"):
        PreferenceSource(records=[{"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"},
                                  {"chosen": "x", "rejected": "y"}], format="hh_rlhf").examples()
    for source in (lambda limit: JSONLSource(str(path), limit=limit), lambda limit: HFDatasetSource("x", limit=limit),
                   lambda limit: PreferenceSource(records=[], limit=limit)):
        for bad in (0, -1, 2.5):
            with pytest.raises(ValueError, match=r"Source: `limit` must be an integer >= 1 or None"):
                source(bad)


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


def test_a_list_source_is_given_a_list():
    for records in ({"prompt": "a", "completion": "b"}, "abc", 3):
        with pytest.raises(ValueError, match="ListSource: `records` must be a list of mappings"):
            ListSource(records)
    assert len(ListSource(iter([{"prompt": "a", "completion": "b"}])).examples()) == 1


def test_empty_dataset_is_a_clear_error():
    dm = MultiLoRADataModule(sources={"empty": ListSource([])})
    with pytest.raises(ValueError, match="data source 'empty' .* has 0 examples"):
        dm.split("empty")
    with pytest.raises(ValueError, match="adapter `dataset` 'nope' is not a data source; sources are: \\['empty'\\]"):
        dm.split("nope")


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
    with pytest.warns(UserWarning, match="data source 'long': 1 of 3 examples kept no completion tokens after "
                                         "truncation to 64 tokens"):
        train, val = MultiLoRADataModule(sources={"long": three}, truncate=True, max_length=64).split("long")
    assert len(train) + len(val) == 2 and max(len(r) for r in train.input_ids + val.input_ids) == 64


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
