"""Data sources: each yields prompt/completion examples; the loss is on the completion only."""

from __future__ import annotations

import bz2
import cmath
import dataclasses
import gzip
import itertools
import json
import lzma
import numbers
import os
import random
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Union

from lightning_multilora.arguments import check_int

FORMATS = ("prompt_completion", "question_answer", "gsm8k", "messages")
# (the prompt and completion fields a format reads by default; "messages": one field, the conversation)
FORMAT_FIELDS = {"prompt_completion": ("prompt", "completion"), "question_answer": ("question", "answer"),
                 "gsm8k": ("question", "answer"), "messages": ("messages", None)}
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """A prompt and its completion; ``source`` says where it came from (``file:line``, ``records[i]``...), for
    errors only: examples equal in text are equal wherever they came from."""

    prompt: str
    completion: str
    source: str = dataclasses.field(default="", compare=False)


@dataclass(frozen=True)
class ChatExample:
    """A conversation, as TRL's conversational datasets hold it (``[{"role": ..., "content": ...}, ...]``), kept as
    (role, content) pairs: its last message, the assistant's, is the completion to learn, the messages before it the
    prompt. The tokenizer's chat template renders both (`MultiLoRADataModule`); ``source`` as `Example`'s."""

    messages: tuple[tuple[str, str], ...]
    source: str = dataclasses.field(default="", compare=False)


@dataclass(frozen=True)
class PreferenceExample:
    """A preference pair: one prompt, a chosen and a rejected completion (DPO adapters train on these;
    SFT adapters on the chosen one); ``source`` as `Example`'s."""

    prompt: str
    chosen: str
    rejected: str
    source: str = dataclasses.field(default="", compare=False)


@dataclass(frozen=True)
class ChatPreferenceExample:
    """A preference pair of conversations, as TRL's conversational preference datasets hold them: the prompt's
    messages, and the chosen and the rejected answer, one assistant message each, as (role, content) pairs; the
    tokenizer's chat template renders them (`MultiLoRADataModule`); ``source`` as `Example`'s."""

    prompt: tuple[tuple[str, str], ...]
    chosen: tuple[tuple[str, str], ...]
    rejected: tuple[tuple[str, str], ...]
    source: str = dataclasses.field(default="", compare=False)


class DataSource:
    """Base class: ``examples()`` returns the full list of examples (the data module splits train/val).
    ``preference_pairs``: whether they are preference pairs (True), never are (False), or it is not known before
    they are read (None: a source of one's own)."""

    preference_pairs: Optional[bool] = None

    def examples(self) -> list[Example]:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__

    def missing(self) -> Optional[str]:
        """What the source needs and cannot find now (a file that is not there), said before a run starts; None
        where nothing is missing (reading it may still fail)."""
        return None


_KINDS = {Example: ("prompt", "completion"), PreferenceExample: ("prompt", "chosen", "rejected"),
          ChatExample: ("messages",), ChatPreferenceExample: ("prompt", "chosen", "rejected")}


def checked_examples(examples: Any, shown: str) -> list:
    """What a source's ``examples()`` returned (``shown``: the source), checked: a list of `Example`,
    `ChatExample`, `PreferenceExample` or `ChatPreferenceExample`, of one kind (preference pairs or not), their fields
    text (a chat's messages ``(role, content)`` pairs of text); a `ValueError` naming the first item that is not
    (a source of one's own returning dicts or a generator failed with "'dict' object has no attribute 'prompt'")."""
    wanted = "a list of Example, ChatExample, PreferenceExample or ChatPreferenceExample (lightning_multilora.data)"
    if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence):
        raise ValueError(f"{shown}: `examples()` must return {wanted}, got a {type(examples).__name__}")
    examples = list(examples)  # (a tuple, say)
    pairs = None
    for i, example in enumerate(examples):
        kind = next((k for k in _KINDS if isinstance(example, k)), None)  # (a subclass of one: its kind)
        fields = _KINDS.get(kind) if kind is not None else None
        if fields is None:
            raise ValueError(f"{shown}: `examples()` must return {wanted}; item {i} is a {type(example).__name__}: "
                             f"{example!r:.120}")
        chat = kind in (ChatExample, ChatPreferenceExample)
        for field in fields:
            value = getattr(example, field)
            ok = (isinstance(value, (tuple, list)) and all(
                isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(t, str) for t in m) for m in value)
                  if chat else isinstance(value, str))
            if not ok:
                need = "a sequence of (role, content) pairs of text" if chat else "text"
                raise ValueError(f"{shown}: item {i} of `examples()` ({type(example).__name__}): `{field}` must be "
                                 f"{need}, got {value!r:.120}")
        pair = kind in (PreferenceExample, ChatPreferenceExample)
        if pairs is not None and pair != pairs:
            raise ValueError(f"{shown}: `examples()` mixes preference pairs and prompt-completion examples (item "
                             f"{i}: {type(example).__name__}, item 0: {type(examples[0]).__name__}): a source holds "
                             "one kind")
        pairs = pair
    return examples


def _checked_path(where: str, path: Any, optional: bool = False) -> Optional[str]:
    """``path`` as text (a PathLike's), a `ValueError` naming ``where`` for anything but a non-empty one."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if (path is None and optional) or (isinstance(path, str) and path):
        return path if path is None else os.path.expanduser(path)  # (a config's "~/...": no shell expanded it)
    raise ValueError(f"{where}: `path` must be a JSON-lines file's path (text or a PathLike), got {path!r:.120}")


def _missing_file(source: DataSource) -> Optional[str]:
    path = getattr(source, "path", None)
    if path is None or Path(path).is_file():
        return None
    return f"{type(source).__name__}: no file at `path` {path!r}" + (
        " (it is a folder)" if Path(path).is_dir() else "")


_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June"]
_ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles"]


class GeneratedArithmetic(DataSource):
    """Arithmetic word problems a tiny model can learn, generated from a seed (the offline default).

    ``"Ada has 12 coins and gets 7 more. How many coins does Ada have?"`` -> ``" 19"``.
    ``operations`` picks among ``add``, ``sub`` and ``mul``; ``max_operand`` bounds the numbers.
    """

    preference_pairs = False

    OPERATIONS = ("add", "sub", "mul")

    def __init__(self, num_examples: int = 2000, seed: int = 0, max_operand: int = 20,
                 operations: tuple[str, ...] = ("add", "sub")) -> None:
        check_int("GeneratedArithmetic", "num_examples", num_examples, 1)
        check_int("GeneratedArithmetic", "max_operand", max_operand, 1)
        check_int("GeneratedArithmetic", "seed", seed, -2**63)
        if isinstance(operations, str) or not all(isinstance(o, str) for o in operations) or not operations or \
                any(o not in self.OPERATIONS for o in operations):
            raise ValueError(f"GeneratedArithmetic: `operations` must be a non-empty list of "
                             f"{', '.join(self.OPERATIONS)}, got {operations!r}")
        self.num_examples, self.seed, self.max_operand = int(num_examples), int(seed), int(max_operand)
        self.operations = tuple(operations)
        m = self.max_operand
        distinct = len(_NAMES) * len(_ITEMS) * sum(m * (m + 1) // 2 if op == "sub" else m * m
                                                   for op in set(self.operations))
        if self.num_examples > distinct:
            raise ValueError(f"GeneratedArithmetic: `num_examples` {self.num_examples} is more than the {distinct} "
                             f"distinct problems of max_operand={m} and operations {list(self.operations)}; raise "
                             "`max_operand` (or add operations)")

    def examples(self) -> list[Example]:
        """Distinct problems (a problem drawn again is drawn anew: a validation example is never also a training
        one)."""
        rng = random.Random(self.seed)
        out, seen = [], set()
        while len(out) < self.num_examples:
            who, item, op = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(self.operations)
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            if op == "add":
                q, ans = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have?", a + b
            elif op == "sub":
                a, b = max(a, b), min(a, b)
                q, ans = f"{who} has {a} {item} and gives away {b}. How many {item} are left?", a - b
            else:
                q, ans = f"{who} has {a} bags with {b} {item} each. How many {item} in all?", a * b
            if q not in seen:
                seen.add(q)
                out.append(Example(f"Q: {q}\nA:", f" {ans}"))
        return out

    def describe(self) -> str:
        return f"GeneratedArithmetic(n={self.num_examples}, seed={self.seed}, ops={','.join(self.operations)})"


# (a compressed file's first bytes, its name, and the standard library's reader: told by the bytes, not the suffix)
_COMPRESSED = ((b"\x1f\x8b", "gzip", gzip.open), (b"BZh", "bzip2", bz2.open), (b"\xfd7zXZ\x00", "xz", lzma.open))
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _jsonl_lines(path: Path, shown: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file, plain or compressed with gzip, bzip2 or xz (told by its first bytes, not
    its name), with their numbers; text that is not UTF-8 is named with its line, a damaged stream with its file, a
    zstd file (no reader in Python's standard library before 3.14) with what to do."""
    with open(path, "rb") as raw:
        head = raw.read(6)
    if head.startswith(_ZSTD_MAGIC):
        raise ValueError(f"{shown}: a zstd-compressed file, which this source does not read: decompress it "
                         "(`zstd -d`), or compress it with gzip, bzip2 or xz, which it reads")
    kind, opener = next(((k, o) for magic, k, o in _COMPRESSED if head.startswith(magic)), (None, open))
    lineno = 0
    try:
        with opener(path, "rb") as fh:
            for lineno, data in enumerate(fh, 1):
                try:
                    line = data.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a byte-order mark is no text)
                except UnicodeDecodeError as err:
                    raise ValueError(f"{shown}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start} of the "
                                     "line)") from None
                if line.strip():
                    yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError) as err:
        raise ValueError(f"{shown}: a damaged {kind} file after line {lineno} ({err})") from None
    except OSError as err:  # (bz2's damaged stream: "Invalid data stream")
        if kind is None:
            raise
        raise ValueError(f"{shown}: a damaged {kind} file after line {lineno} ({err})") from None


def _json_line(line: str, where: str, whole_json: Optional[str] = None) -> dict:
    """One line of a JSONL file as its record; a line that is not a JSON object is named (``where``: file:line).
    ``whole_json``: how the source's user reads a file of one JSON array instead (`_WHOLE_JSON`'s route)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        whole = (whole_json or _WHOLE_JSON) if line.strip() in ("[", "{") else ""
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                         f"object{whole}") from None
    if not isinstance(record, dict):
        whole = (whole_json or _WHOLE_JSON) if isinstance(record, list) else ""
        raise ValueError(f"{where}: each line must be one JSON object, got a {type(record).__name__}{whole}")
    return record


# (a file of one JSON array, or of pretty-printed JSON, given to JSONLSource)
_WHOLE_JSON = " (a JSON array or a pretty-printed JSON file is read by `HFDatasetSource(path)`)"
# (the same given to PreferenceSource, which reads JSON lines or records: `datasets` reads the file into records)
_WHOLE_JSON_PAIRS = (" (a JSON array or a pretty-printed JSON file: give its records, PreferenceSource(records="
                     "datasets.load_dataset('json', data_files=path)['train']))")


def _finite(value: numbers.Number) -> bool:
    """Whether a number is finite: not NaN, not an infinity (JSON's ``NaN``, ``Infinity``, or ``1e400`` read as one)."""
    if isinstance(value, Decimal):
        return value.is_finite()
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Integral):
        try:
            return cmath.isfinite(complex(value))
        except OverflowError:  # (a Fraction past a float's range is still a finite number)
            return True
    return True


def _text(record: dict, field: str, where: str) -> str:
    """A record's text field: a string (a finite number or a boolean is taken as it prints: ``4``, ``True``); null, a
    list, a mapping, NaN or an infinity are named."""
    value = record[field]
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # (a lone surrogate: JSON's "\ud83d", half an emoji, cut from scraped text)
            raise ValueError(f"{where}: field {field!r} holds {value[err.start:err.end]!r} at character {err.start}, "
                             "half of a UTF-16 surrogate pair (JSON \\uD800-\\uDFFF alone), which is no character: "
                             "remove or repair it") from None
        return value
    if isinstance(value, numbers.Number):
        if not _finite(value):
            raise ValueError(f"{where}: field {field!r} must be text (a string) or a finite number, got "
                             f"{type(value).__name__} {value!r:.60} (JSON NaN, Infinity, or a number past a float's "
                             "range such as 1e400)")
        return str(value)
    if value is None:  # (JSON null, or a field this record lacks, which `datasets` fills with None)
        raise ValueError(f"{where}: field {field!r} must be text (a string), got null: the record holds null there, "
                         "or lacks the field (a `datasets` loader gives a field some records lack as null in them)")
    raise ValueError(f"{where}: field {field!r} must be text (a string), got {type(value).__name__} {value!r:.60}")


def format_record(record: dict, fmt: str, prompt_field: Optional[str], completion_field: Optional[str],
                  where: str) -> Example:
    """One raw record as an `Example` from ``where``, by format (``question_answer`` and ``gsm8k``: a Q/A template).
    A field left None is the format's own (`FORMAT_FIELDS`: prompt/completion, or question/answer)."""
    if fmt not in FORMATS:
        raise ValueError(f"`format` can be {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "messages":
        if completion_field is not None:
            raise ValueError(f"{where}: format 'messages' reads one field, the conversation (`prompt_field`, default "
                             f"'messages'; its last message is the completion): leave `completion_field` None, got "
                             f"{completion_field!r}")
        return _chat_record(record, prompt_field or FORMAT_FIELDS[fmt][0], where)
    prompt_field = FORMAT_FIELDS[fmt][0] if prompt_field is None else prompt_field
    completion_field = FORMAT_FIELDS[fmt][1] if completion_field is None else completion_field
    missing = [f for f in (prompt_field, completion_field) if f not in record]
    if missing:
        if {"chosen", "rejected"} <= set(record):
            hint = ("; it is a preference pair: a DPO adapter reads such records from a PreferenceSource (`path` of a "
                    "JSONL file, or `records=` any sequence of records, a datasets.Dataset too)")
        elif {"question", "answer"} <= set(record) and fmt == "prompt_completion":
            hint = "; `format='gsm8k'` (or 'question_answer') reads question/answer records"
        else:
            hint = (f"; name the fields that hold them (`prompt_field=`, `completion_field=`), or give a `format` (one "
                    f"of {', '.join(FORMATS)})")
        raise ValueError(f"{where}: record has no field(s) {missing}; it has {sorted(record)}{hint}")
    if fmt == "prompt_completion" and isinstance(record[prompt_field], list):
        if not isinstance(record[completion_field], list):
            raise ValueError(f"{where}: field {prompt_field!r} is a list of messages and {completion_field!r} is "
                             f"not: a conversational record has a list of messages in both")
        return _conversational(record, prompt_field, completion_field, where)
    prompt, completion = _text(record, prompt_field, where), _text(record, completion_field, where)
    if fmt in ("gsm8k", "question_answer"):
        return Example(f"Question: {prompt.strip()}\nAnswer:", f" {completion.strip()}", where)
    return Example(prompt, completion, where)


def _chat_record(record: dict, field: str, where: str) -> ChatExample:
    """A record's conversation (field ``field``): a list of messages, each a mapping of a ``role`` (`ROLES`) and a
    text ``content``, at least one before the last, which is the assistant's."""
    if field not in record:
        hint = ""
        if all(isinstance(record.get(f), list) for f in FORMAT_FIELDS["prompt_completion"]):
            hint = (" (its prompt and completion are lists of messages, TRL's conversational prompt-completion: "
                    "read them with the default format, 'prompt_completion')")
        raise ValueError(f"{where}: record has no field {field!r} (format 'messages'); it has {sorted(record)}{hint}")
    messages = _messages(record[field], field, where)
    if len(messages) < 2 or messages[-1][0] != "assistant":
        raise ValueError(f"{where}: field {field!r} must end with the assistant's message (the completion to learn) "
                         f"after at least one other; got roles {[r for r, _ in messages]}")
    return ChatExample(tuple(messages), where)


def _messages(value: Any, field: str, where: str) -> list[tuple[str, str]]:
    """A field's list of messages as (role, content) pairs. A key other than ``role`` and ``content`` is refused
    unless it is None (a table of conversations, as ``datasets`` reads one, gives every message every key that any
    message of the data has: ``name``, ``tool_calls``...)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{where}: field {field!r} must be a list of messages ({{'role': ..., 'content': ...}}), got "
                         f"{type(value).__name__} {value!r:.60}")
    messages = []
    for k, message in enumerate(value):
        at = f"{where}: message {k} of {field!r}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} must be a mapping with 'role' and 'content', got {type(message).__name__}")
        if not {"role", "content"} <= set(message):
            raise ValueError(f"{at} must hold 'role' and 'content' (text), got keys {sorted(message)}")
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise ValueError(f"{at} holds {extra} besides 'role' and 'content': a message is read as its role and "
                             "text only (tool calls and names are not rendered); leave those keys out (or None)")
        if message["role"] not in ROLES:
            raise ValueError(f"{at}: `role` can be {', '.join(ROLES)}, got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise ValueError(f"{at}: `content` must be text (a string), got {type(message['content']).__name__} "
                             f"{message['content']!r:.60}")
        messages.append((message["role"], _text(message, "content", at)))  # (half an emoji: the tokenizer's TypeError)
    return messages


def _conversational(record: dict, prompt_field: str, completion_field: str, where: str) -> ChatExample:
    """TRL's conversational prompt-completion record: the prompt a list of messages, the completion a list of one,
    the assistant's (learned, after the prompt rendered by the chat template)."""
    prompt = _messages(record[prompt_field], prompt_field, where)
    completion = _messages(record[completion_field], completion_field, where)
    if not prompt or len(completion) != 1 or completion[0][0] != "assistant":
        raise ValueError(f"{where}: a conversational record's {prompt_field!r} must hold at least one message and "
                         f"its {completion_field!r} one, the assistant's; got roles {[r for r, _ in prompt]} and "
                         f"{[r for r, _ in completion]}")
    return ChatExample(tuple(prompt + completion), where)


class JSONLSource(DataSource):
    """A JSON-lines file (plain, or ``.gz``, ``.bz2``, ``.xz``) of records; ``format`` says how they read
    (``question_answer`` and ``gsm8k``: a Q/A template; ``messages``: a conversation, rendered by the tokenizer's chat template, whose last
    message, the assistant's, is learned; ``prompt_completion`` with lists of messages in both fields is TRL's
    conversational prompt-completion, rendered so too), ``prompt_field`` / ``completion_field`` which fields hold the
    text (None: the format's own, ``prompt`` / ``completion``, ``question`` / ``answer``, or ``messages`` alone)."""

    preference_pairs = False

    def __init__(self, path: str, format: str = "prompt_completion", prompt_field: Optional[str] = None,
                 completion_field: Optional[str] = None, limit: Optional[int] = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"JSONLSource: `format` can be {', '.join(FORMATS)}, got {format!r}")
        check_int("JSONLSource", "limit", limit, 1, optional=True)
        self.path, self.format, self.limit = _checked_path("JSONLSource", path), format, limit
        self.prompt_field, self.completion_field = prompt_field, completion_field

    def examples(self) -> list[Example]:
        path = Path(self.path)
        if not path.is_file():
            raise FileNotFoundError(f"JSONLSource: no file at `path` {self.path!r}")
        out = []
        for lineno, line in _jsonl_lines(path, str(self.path)):
            out.append(format_record(_json_line(line, f"{self.path}:{lineno}"), self.format, self.prompt_field,
                                     self.completion_field, f"{self.path}:{lineno}"))
            if self.limit is not None and len(out) >= self.limit:
                break
        return out

    def describe(self) -> str:
        return f"JSONLSource({self.path}, {self.format})"

    def missing(self) -> Optional[str]:
        return _missing_file(self)


def _saved_to_disk(path: str) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk`` (a Dataset's or a DatasetDict's)."""
    folder = Path(path)
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


# (a data file's suffix, and the `datasets` builder that reads it; a compressed file, `.jsonl.gz`, by the suffix
# before its compression's)
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def _data_suffix(path: str) -> Optional[str]:
    """A path's data-file suffix, before a compression's (``.jsonl`` of ``train.jsonl.gz``); None without one."""
    suffixes = [x.lower() for x in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return suffixes[-1] if suffixes else None


def _data_file_builder(path: str) -> str:
    """The ``datasets`` builder of a data file, by its suffix (`DATA_FILE_BUILDERS`); another suffix is named."""
    suffix = _data_suffix(path)
    if suffix in DATA_FILE_BUILDERS:
        return DATA_FILE_BUILDERS[suffix]
    raise ValueError(f"HFDatasetSource: `path` {path!r} is a file, read by the `datasets` builder its suffix names "
                     f"({', '.join(DATA_FILE_BUILDERS)}, optionally compressed: {', '.join(COMPRESSIONS)}), and "
                     f"{f'its suffix {suffix!r} is none of them' if suffix else 'it has no suffix'}; give the "
                     f"builder as `path` and the file as `data_files` (HFDatasetSource('json', data_files=...))")


def _dataset_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """``datasets``' dataset classes and dataset-dict classes (none where it is not installed)."""
    try:
        from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    except ImportError:
        return (), ()
    return (Dataset, IterableDataset), (DatasetDict, IterableDatasetDict)


class HFDatasetSource(DataSource):
    """A Hugging Face ``datasets`` dataset: ``load_dataset(path, name, split=split)``; a local data file (``.jsonl``,
    ``.json``, ``.csv``, ``.parquet``, ``.arrow``, or one of them compressed: read by the builder its suffix names,
    ``load_dataset("json", data_files=path)``); a folder written by ``save_to_disk`` (read with ``load_from_disk``);
    or a ``datasets.Dataset`` / ``DatasetDict`` already in memory. ``format``, ``prompt_field`` and
    ``completion_field`` as `JSONLSource`'s.

    From a DatasetDict, saved or given, ``split`` picks the split; a Dataset is read whole (as ``load_from_disk``
    gives it), and a ``split`` other than the default ``"train"`` must be the one it was made as (``Dataset.split``).
    Slices (``train[:100]``) are ``load_dataset``'s only; ``limit`` takes the first examples of any.
    """

    preference_pairs = False

    def __init__(self, path: str, name: Optional[str] = None, split: str = "train",
                 format: str = "prompt_completion", prompt_field: Optional[str] = None,
                 completion_field: Optional[str] = None, limit: Optional[int] = None,
                 data_files: Optional[str] = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"HFDatasetSource: `format` can be {', '.join(FORMATS)}, got {format!r}")
        check_int("HFDatasetSource", "limit", limit, 1, optional=True)
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        path = os.path.expanduser(path) if isinstance(path, str) else path  # (a Hub name has no "~")
        datasets, dicts = _dataset_classes() if not isinstance(path, str) else ((), ())
        if not isinstance(path, (str, *datasets, *dicts)):
            raise ValueError(f"HFDatasetSource: `path` must be a dataset's Hub name, a local data file or folder, or "
                             f"a `datasets` Dataset or DatasetDict, got a {type(path).__name__}; records in memory "
                             f"are a ListSource's (or a PreferenceSource's)")
        if not isinstance(path, str) and (name is not None or data_files is not None):
            raise ValueError(f"HFDatasetSource: a {type(path).__name__} given as `path` takes no `name` or "
                             f"`data_files` (got name={name!r}, data_files={data_files!r})")
        self.path, self.name, self.split, self.format, self.limit = path, name, split, format, limit
        self.prompt_field, self.completion_field, self.data_files = prompt_field, completion_field, data_files

    @property
    def shown(self) -> str:
        """``path`` as errors show it: a dataset object by its class (and the split a dict's examples come from)."""
        if isinstance(self.path, str):
            return self.path
        return type(self.path).__name__ + (f"[{self.split!r}]" if isinstance(self.path, _dataset_classes()[1])
                                           else "")

    def _load(self) -> Iterable[Mapping]:
        """The dataset: the one given, ``load_from_disk`` for a ``save_to_disk`` folder (``split`` taken from a
        DatasetDict), the builder its suffix names for a data file, ``load_dataset`` otherwise."""
        from datasets import load_dataset, load_from_disk

        problem = self.missing()  # (a local file's name mistyped: taken for a Hub name, retried offline for long)
        if problem:
            raise FileNotFoundError(problem)
        if isinstance(self.path, str) and Path(self.path).is_file():
            if self.name is not None or self.data_files is not None:
                raise ValueError(f"HFDatasetSource: `path` {self.path!r} is a data file, read as it is: it takes no "
                                 f"`name` or `data_files` (got name={self.name!r}, data_files={self.data_files!r})")
            if self.split != "train":  # (datasets' own "Unknown split" named neither the file nor the fix)
                raise ValueError(f"HFDatasetSource: `split` {self.split!r} is not in the data file {self.path!r}: a "
                                 "data file is one split, read whole with `split` 'train' (for another split, give "
                                 "its own file)")
            try:
                return load_dataset(_data_file_builder(self.path), split=self.split, data_files=self.path)
            except StopIteration:  # (datasets' JSON builder on a file of no records: "StopIteration: ", nothing more)
                raise ValueError(f"HFDatasetSource: the data file {self.path!r} holds no records") from None
        if isinstance(self.path, str) and not _saved_to_disk(self.path):
            return load_dataset(self.path, self.name, split=self.split, data_files=self.data_files)
        if isinstance(self.path, str):
            if self.name is not None or self.data_files is not None:
                raise ValueError(f"HFDatasetSource: {self.path!r} is a folder written by `save_to_disk`, which takes "
                                 f"no `name` or `data_files` (got name={self.name!r}, data_files={self.data_files!r})")
            ds, where = load_from_disk(self.path), f"saved at {self.path!r}"
        else:
            ds, where = self.path, "given as `path`"
        sliced = " (a slice is for `load_dataset`: `limit` takes the first examples)" if "[" in str(self.split) else ""
        if isinstance(ds, _dataset_classes()[1]):
            if self.split not in ds:
                raise ValueError(f"HFDatasetSource: `split` {self.split!r} is not a split of the DatasetDict {where}; "
                                 f"its splits are {sorted(ds)}{sliced}")
            return ds[self.split]
        saved = None if ds.split is None else str(ds.split)
        if self.split not in ("train", saved):
            allowed = "'train'" + (f" or {saved!r}" if saved else "")
            held, verb = ((f"in {self.path!r}: it holds", "saved") if isinstance(self.path, str) else
                          ("in the Dataset given as `path`: it is", "made"))
            raise ValueError(f"HFDatasetSource: `split` {self.split!r} is not {held} one Dataset "
                             f"({f'{verb} as split {saved!r}' if saved else f'{verb} without a split name'}), read "
                             f"whole with `split` {allowed}{sliced}")
        return ds

    def examples(self) -> list[Example]:
        ds = self._load()
        features = getattr(ds, "features", None) or {}
        fields = ((self.prompt_field or FORMAT_FIELDS[self.format][0],) if self.format == "messages" else
                  (self.prompt_field or FORMAT_FIELDS[self.format][0],
                   self.completion_field or FORMAT_FIELDS[self.format][1]))
        numeric = {f: features[f].dtype for f in fields
                   if f in features and str(getattr(features[f], "dtype", "string")).startswith(
                       ("int", "uint", "float", "bool"))}
        if numeric:
            warnings.warn(f"HFDatasetSource({self.shown}): the loader read text field(s) as numbers "
                          f"({', '.join(f'{f!r}: {t}' for f, t in numeric.items())}): their values are taken as they "
                          "print ('26'), and what the file held around them (a leading space, leading zeros) is "
                          "lost; give the fields as text (a JSONL file of strings, read by JSONLSource)",
                          stacklevel=2)
        out, shown = [], self.shown if self.data_files is None else f"{self.shown} ({self.data_files})"
        for i, record in enumerate(ds):  # (a record named by its index in the dataset, from 0)
            out.append(format_record(record, self.format, self.prompt_field, self.completion_field, f"{shown}[{i}]"))
            if self.limit is not None and len(out) >= self.limit:
                break
        return out

    def missing(self) -> Optional[str]:
        """A `path` named as a local data file (its suffix one of `DATA_FILE_BUILDERS`') or as a local folder (``./``,
        ``../``, ``/`` or ``~`` first, which no Hub name has) that is not there: else it is taken for a Hub name, and
        its error is the Hub's (a misspelt ``./saved_dataset`` was refused as a repo id, or not reached offline)."""
        if not isinstance(self.path, str) or Path(self.path).expanduser().exists():
            return None
        if _data_suffix(self.path) in DATA_FILE_BUILDERS:
            return f"HFDatasetSource: no file at `path` {self.path!r}"
        if self.path.startswith(("./", "../", "/", "~", ".\\", "..\\")):
            return f"HFDatasetSource: no data file or `save_to_disk` folder at `path` {self.path!r}"
        return None

    def describe(self) -> str:
        split = "" if f"[{self.split!r}]" in self.shown else f", {self.split}"  # (a DatasetDict's shown with it)
        return f"HFDatasetSource({self.shown}{split}, {self.format})"


class ListSource(DataSource):
    """Examples given in memory (``[{"prompt": ..., "completion": ...}, ...]``, or with ``format="messages"``
    conversations: ``[{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}, ...]``).
    ``format``, ``prompt_field`` and ``completion_field`` as `JSONLSource`'s."""

    preference_pairs = False

    def __init__(self, records: list[dict], format: str = "prompt_completion", prompt_field: Optional[str] = None,
                 completion_field: Optional[str] = None) -> None:
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
            raise ValueError(f"ListSource: `records` must be a list of mappings with prompt and completion, got a "
                             f"{type(records).__name__}")
        if format not in FORMATS:
            raise ValueError(f"ListSource: `format` can be {', '.join(FORMATS)}, got {format!r}")
        self.records, self.format = list(records), format
        self.prompt_field, self.completion_field = prompt_field, completion_field

    def examples(self) -> list[Example]:
        for i, r in enumerate(self.records):
            if not isinstance(r, Mapping):
                raise ValueError(f"ListSource: records[{i}] must be a mapping with prompt and completion, got a "
                                 f"{type(r).__name__}")
        return [format_record(r, self.format, self.prompt_field, self.completion_field, f"records[{i}]")
                for i, r in enumerate(self.records)]


PREFERENCE_FORMATS = ("prompt_chosen_rejected", "hh_rlhf")


def _chat_pair(record: Mapping, where: str) -> ChatPreferenceExample:
    """TRL's conversational preference record: ``prompt`` a list of messages, ``chosen`` and ``rejected`` one
    message each, the assistant's; or, without ``prompt`` (TRL's implicit prompt), two conversations whose common
    beginning is the prompt."""
    missing = [f for f in ("chosen", "rejected") if f not in record]
    if missing:
        raise ValueError(f"{where}: record has no field(s) {missing}; it has {sorted(record)}")
    fields = [f for f in ("prompt", "chosen", "rejected") if f in record]
    lists = [f for f in fields if isinstance(record[f], list)]
    if lists != fields:
        raise ValueError(f"{where}: field(s) {lists} are lists of messages and {sorted(set(fields) - set(lists))} "
                         f"are not: a preference record is text in all its fields, or conversational (lists of "
                         f"messages, TRL's) in all")
    chosen, rejected = (_messages(record[f], f, where) for f in ("chosen", "rejected"))
    if "prompt" in record:
        prompt = _messages(record["prompt"], "prompt", where)
    else:  # the messages both conversations begin with, leaving each an answer
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    answers = [(f, a) for f, a in (("chosen", chosen), ("rejected", rejected))
               if len(a) != 1 or a[0][0] != "assistant"]
    if not prompt or answers:
        raise ValueError(f"{where}: a conversational preference record's prompt must hold at least one message, and "
                         f"'chosen' and 'rejected' one each after it, the assistant's (or, without 'prompt', two "
                         f"conversations that begin alike and end in one assistant message each); got roles "
                         f"{[r for r, _ in prompt]}, {[r for r, _ in chosen]} and {[r for r, _ in rejected]}")
    return ChatPreferenceExample(tuple(prompt), tuple(chosen), tuple(rejected), where)


def split_implicit_prompt(chosen: str, rejected: str, where: str) -> PreferenceExample:
    """TRL's preference text with an implicit prompt (``{"chosen": "The sky is blue.", "rejected": "The sky is
    green."}``), split as TRL's ``extract_prompt`` splits it: the prompt is the beginning both texts share, less a
    space that ends it (``"The sky is"``, ``" blue."``, ``" green."``). Texts that share no beginning but white
    space are named (a record whose `prompt` field was left out, more likely than a pair without one)."""
    cut = next((k for k, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    if cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    if not chosen[:cut].strip():
        raise ValueError(f"{where}: record has no field 'prompt', and its 'chosen' and 'rejected' texts share no "
                         f"beginning to take as one (TRL's implicit prompt); give the prompt as 'prompt'")
    return PreferenceExample(chosen[:cut], chosen[cut:], rejected[cut:], where)


def split_hh_rlhf(chosen: str, rejected: str) -> PreferenceExample:
    """Anthropic HH-RLHF transcripts: the prompt is everything up to the last ``Assistant:`` turn."""
    cut = chosen.rfind("\n\nAssistant:")
    if cut < 0:
        raise ValueError("an hh_rlhf record has no '\n\nAssistant:' turn (TRL's preference text with an implicit "
                         "prompt, the beginning 'chosen' and 'rejected' share, is read by format "
                         "'prompt_chosen_rejected')")
    cut += len("\n\nAssistant:")
    if rejected[:cut] != chosen[:cut]:
        cut = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    return PreferenceExample(chosen[:cut], chosen[cut:], rejected[cut:])


class PreferenceSource(DataSource):
    """Preference pairs from a JSON-lines file (plain, or ``.gz``, ``.bz2``, ``.xz``) or from ``records`` in memory.

    ``format``: ``prompt_chosen_rejected`` (fields ``prompt``, ``chosen``, ``rejected``: text, or TRL's
    conversational records, lists of messages rendered by the tokenizer's chat template, `ChatPreferenceExample`;
    either with the prompt explicit or implicit, the beginning ``chosen`` and ``rejected`` share, as TRL reads them:
    `split_implicit_prompt`) or ``hh_rlhf`` (``chosen`` / ``rejected`` transcripts sharing their prompt).
    """

    preference_pairs = True

    def __init__(self, path: Optional[str] = None, format: str = "prompt_chosen_rejected",
                 records: Optional[list[dict]] = None, limit: Optional[int] = None) -> None:
        if format not in PREFERENCE_FORMATS:
            raise ValueError(f"PreferenceSource: `format` can be {', '.join(PREFERENCE_FORMATS)}, got {format!r}")
        if (path is None) == (records is None):
            raise ValueError("PreferenceSource takes exactly one of `path` and `records`")
        check_int("PreferenceSource", "limit", limit, 1, optional=True)
        if records is not None:
            if isinstance(records, _dataset_classes()[1]):  # (a Mapping of splits: no record)
                raise ValueError(f"PreferenceSource: `records` is a {type(records).__name__}: give one of its splits, "
                                 f"records=dataset[split] (its splits: {sorted(records)})")
            if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
                raise ValueError(f"PreferenceSource: `records` must be a list of mappings (prompt, chosen, rejected) "
                                 f"or a `datasets` Dataset, got a {type(records).__name__}"
                                 + (" (one record: put it in a list)" if isinstance(records, Mapping) else ""))
            if not isinstance(records, (Sequence, *_dataset_classes()[0])):  # (an iterator is read once, and a fit
                records = list(itertools.islice(records, limit))  # reads its source again; an endless one, to limit)
        path = _checked_path("PreferenceSource", path, optional=True)
        self.path, self.format, self.records, self.limit = path, format, records, limit

    def _records(self) -> Iterator[tuple[str, dict]]:
        """Each record with where it is (``path:line``, or ``records[i]``), read as they are asked for."""
        if self.records is not None:
            for i, record in enumerate(self.records):
                if not isinstance(record, Mapping):
                    raise ValueError(f"records[{i}]: a record is a mapping, got a {type(record).__name__}")
                yield f"records[{i}]", record
            return
        path = Path(self.path)
        if path.is_dir():
            route = "give the JSON-lines file in it"
            if _saved_to_disk(self.path):  # (a DatasetDict's folder holds its splits' names; a Dataset's is one)
                split = "['train']" if (path / "dataset_dict.json").is_file() else ""
                route = f"a `save_to_disk` folder: give its records, records=datasets.load_from_disk(path){split}"
            raise ValueError(f"PreferenceSource: `path` {self.path!r} is a folder; it reads a JSON-lines file "
                             f"({route})")
        if not path.is_file():
            raise FileNotFoundError(f"PreferenceSource: no file at `path` {self.path!r}")
        builder = DATA_FILE_BUILDERS.get(_data_suffix(self.path))
        if builder not in (None, "json"):  # (a parquet file read as text: "not UTF-8 text at byte 98")
            raise ValueError(f"PreferenceSource: `path` {self.path!r} is a {builder} file; it reads JSON lines (give "
                             f"its records, records=datasets.load_dataset({builder!r}, data_files=path)['train'])")
        for lineno, line in _jsonl_lines(path, str(self.path)):
            yield f"{self.path}:{lineno}", _json_line(line, f"{self.path}:{lineno}", _WHOLE_JSON_PAIRS)

    def examples(self) -> list[Union[PreferenceExample, ChatPreferenceExample]]:
        out: list[Union[PreferenceExample, ChatPreferenceExample]] = []
        for where, record in self._records():  # (up to `limit`: the lines after it are not read)
            if self.format == "prompt_chosen_rejected" and any(
                    isinstance(record.get(f), list) for f in ("prompt", "chosen", "rejected")):
                out.append(_chat_pair(record, where))  # (TRL's conversational records)
                if self.limit is not None and len(out) >= self.limit:
                    break
                continue
            need = ("chosen", "rejected") if self.format == "hh_rlhf" else ("prompt", "chosen", "rejected")
            missing = [f for f in need if f not in record]
            others = sorted(f for f, v in record.items() if f not in need and isinstance(v, str))
            if missing and (missing != ["prompt"] or others):  # (no prompt alone, and no other text that may hold
                # it under another name: TRL's implicit prompt)
                implicit = (f"; a prompt is taken from 'chosen' and 'rejected' (the beginning they share, as TRL's "
                            f"extract_prompt) only where they are the record's only text fields, and {others} may "
                            f"hold it under another name: name it 'prompt', or drop {others}"
                            if missing == ["prompt"] else "")
                raise ValueError(f"{where}: record has no field(s) {missing}; it has {sorted(record)}{implicit}")
            text = {f: _text(record, f, where) for f in need if f in record}
            if self.format == "hh_rlhf":
                try:
                    out.append(dataclasses.replace(split_hh_rlhf(text["chosen"], text["rejected"]), source=where))
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from err
            elif missing:
                out.append(split_implicit_prompt(text["chosen"], text["rejected"], where))
            else:
                out.append(PreferenceExample(text["prompt"], text["chosen"], text["rejected"], where))
            if self.limit is not None and len(out) >= self.limit:
                break
        return out

    def describe(self) -> str:
        return f"PreferenceSource({self.path or 'records'}, {self.format})"

    def missing(self) -> Optional[str]:
        return _missing_file(self)
