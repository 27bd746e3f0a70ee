"""Data sources: each yields prompt/completion examples; the loss is on the completion only."""

from __future__ import annotations

import gzip
import json
import numbers
import random
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_multilora.arguments import check_int

FORMATS = ("prompt_completion", "question_answer", "gsm8k")


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


@dataclass(frozen=True)
class PreferenceExample:
    """A preference pair: one prompt, a chosen and a rejected completion (DPO adapters train on these;
    SFT adapters on the chosen one)."""

    prompt: str
    chosen: str
    rejected: str


class DataSource:
    """Base class: ``examples()`` returns the full list of examples (the data module splits train/val)."""

    def examples(self) -> list[Example]:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June"]
_ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles"]


class GeneratedArithmetic(DataSource):
    """Arithmetic word problems a tiny model can learn, generated from a seed (the offline default).

    ``"Ada has 12 coins and gets 7 more. How many coins does Ada have?"`` -> ``" 19"``.
    ``operations`` picks among ``add``, ``sub`` and ``mul``; ``max_operand`` bounds the numbers.
    """

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

    def examples(self) -> list[Example]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_examples):
            who, item, op = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(self.operations)
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            if op == "add":
                q, ans = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have?", a + b
            elif op == "sub":
                a, b = max(a, b), min(a, b)
                q, ans = f"{who} has {a} {item} and gives away {b}. How many {item} are left?", a - b
            else:
                q, ans = f"{who} has {a} bags with {b} {item} each. How many {item} in all?", a * b
            out.append(Example(f"Q: {q}\nA:", f" {ans}"))
        return out

    def describe(self) -> str:
        return f"GeneratedArithmetic(n={self.num_examples}, seed={self.seed}, ops={','.join(self.operations)})"


def _jsonl_lines(path: Path, shown: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file, gzipped or not (told by its first bytes, not its name), with their
    numbers; text that is not UTF-8 is named with its line, a damaged gzip stream with its file."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    lineno = 0
    try:
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as fh:
            for lineno, data in enumerate(fh, 1):
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{shown}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start} of the "
                                     "line)") from None
                if line.strip():
                    yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{shown}: a damaged gzip file after line {lineno} ({err})") from None


def _json_line(line: str, where: str) -> dict:
    """One line of a JSONL file as its record; a line that is not a JSON object is named (``where``: file:line)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                         "object") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be one JSON object, got a {type(record).__name__}")
    return record


def _text(record: dict, field: str, where: str) -> str:
    """A record's text field: a string (a number or a boolean is taken as it prints: ``4``, ``True``); null, a list
    or a mapping are named."""
    value = record[field]
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Number):
        return str(value)
    raise ValueError(f"{where}: field {field!r} must be text (a string), got {type(value).__name__} {value!r:.60}")


def format_record(record: dict, fmt: str, prompt_field: str, completion_field: str, where: str) -> Example:
    """One raw record as an `Example`, by format (``gsm8k``: question/answer with a Q/A template)."""
    if fmt == "gsm8k":
        prompt_field, completion_field = "question", "answer"
    elif fmt == "question_answer":
        prompt_field, completion_field = "question", "answer"
    elif fmt != "prompt_completion":
        raise ValueError(f"`format` can be {', '.join(FORMATS)}, got {fmt!r}")
    missing = [f for f in (prompt_field, completion_field) if f not in record]
    if missing:
        raise ValueError(f"{where}: record has no field(s) {missing}; it has {sorted(record)}")
    prompt, completion = _text(record, prompt_field, where), _text(record, completion_field, where)
    if fmt in ("gsm8k", "question_answer"):
        return Example(f"Question: {prompt.strip()}\nAnswer:", f" {completion.strip()}")
    return Example(prompt, completion)


class JSONLSource(DataSource):
    """A JSON-lines file (optionally ``.gz``) of records; ``format`` says which fields hold what."""

    def __init__(self, path: str, format: str = "prompt_completion", prompt_field: str = "prompt",
                 completion_field: str = "completion", limit: Optional[int] = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"`format` can be {', '.join(FORMATS)}, got {format!r}")
        check_int("JSONLSource", "limit", limit, 1, optional=True)
        self.path, self.format, self.limit = path, format, limit
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


class HFDatasetSource(DataSource):
    """A Hugging Face ``datasets`` dataset: ``load_dataset(path, name, split=split)`` (local files work)."""

    def __init__(self, path: str, name: Optional[str] = None, split: str = "train",
                 format: str = "prompt_completion", prompt_field: str = "prompt",
                 completion_field: str = "completion", limit: Optional[int] = None,
                 data_files: Optional[str] = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"`format` can be {', '.join(FORMATS)}, got {format!r}")
        check_int("HFDatasetSource", "limit", limit, 1, optional=True)
        self.path, self.name, self.split, self.format, self.limit = path, name, split, format, limit
        self.prompt_field, self.completion_field, self.data_files = prompt_field, completion_field, data_files

    def examples(self) -> list[Example]:
        from datasets import load_dataset

        ds = load_dataset(self.path, self.name, split=self.split, data_files=self.data_files)
        out = []
        for i, record in enumerate(ds):
            out.append(format_record(record, self.format, self.prompt_field, self.completion_field,
                                     f"{self.path}[{i}]"))
            if self.limit is not None and len(out) >= self.limit:
                break
        return out

    def describe(self) -> str:
        return f"HFDatasetSource({self.path}, {self.split}, {self.format})"


class ListSource(DataSource):
    """Examples given in memory (``[{"prompt": ..., "completion": ...}, ...]``)."""

    def __init__(self, records: list[dict]) -> None:
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
            raise ValueError(f"ListSource: `records` must be a list of mappings with prompt and completion, got a "
                             f"{type(records).__name__}")
        self.records = list(records)

    def examples(self) -> list[Example]:
        return [format_record(r, "prompt_completion", "prompt", "completion", f"records[{i}]")
                for i, r in enumerate(self.records)]


PREFERENCE_FORMATS = ("prompt_chosen_rejected", "hh_rlhf")


def split_hh_rlhf(chosen: str, rejected: str) -> PreferenceExample:
    """Anthropic HH-RLHF transcripts: the prompt is everything up to the last ``Assistant:`` turn."""
    cut = chosen.rfind("\n\nAssistant:")
    if cut < 0:
        raise ValueError("an hh_rlhf record has no '\n\nAssistant:' turn")
    cut += len("\n\nAssistant:")
    if rejected[:cut] != chosen[:cut]:
        cut = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    return PreferenceExample(chosen[:cut], chosen[cut:], rejected[cut:])


class PreferenceSource(DataSource):
    """Preference pairs from a JSON-lines file (optionally ``.gz``) or from ``records`` in memory.

    ``format``: ``prompt_chosen_rejected`` (fields ``prompt``, ``chosen``, ``rejected``) or ``hh_rlhf``
    (``chosen`` / ``rejected`` transcripts sharing their prompt).
    """

    def __init__(self, path: Optional[str] = None, format: str = "prompt_chosen_rejected",
                 records: Optional[list[dict]] = None, limit: Optional[int] = None) -> None:
        if format not in PREFERENCE_FORMATS:
            raise ValueError(f"`format` can be {', '.join(PREFERENCE_FORMATS)}, got {format!r}")
        if (path is None) == (records is None):
            raise ValueError("PreferenceSource takes exactly one of `path` and `records`")
        check_int("PreferenceSource", "limit", limit, 1, optional=True)
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
        if not path.is_file():
            raise FileNotFoundError(f"PreferenceSource: no file at `path` {self.path!r}")
        for lineno, line in _jsonl_lines(path, str(self.path)):
            yield f"{self.path}:{lineno}", _json_line(line, f"{self.path}:{lineno}")

    def examples(self) -> list[PreferenceExample]:
        out = []
        for where, record in self._records():  # (up to `limit`: the lines after it are not read)
            need = ("chosen", "rejected") if self.format == "hh_rlhf" else ("prompt", "chosen", "rejected")
            missing = [f for f in need if f not in record]
            if missing:
                raise ValueError(f"{where}: record has no field(s) {missing}; it has {sorted(record)}")
            text = {f: _text(record, f, where) for f in need}
            if self.format == "hh_rlhf":
                try:
                    out.append(split_hh_rlhf(text["chosen"], text["rejected"]))
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from err
            else:
                out.append(PreferenceExample(text["prompt"], text["chosen"], text["rejected"]))
            if self.limit is not None and len(out) >= self.limit:
                break
        return out

    def describe(self) -> str:
        return f"PreferenceSource({self.path or 'records'}, {self.format})"
