"""Tokenizers: an offline byte-level default, or any Hugging Face tokenizer by path."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional, Protocol

from lightning_multilora.arguments import missing_local_folder


class Tokenizer(Protocol):
    vocab_size: int
    pad_token_id: int
    eos_token_id: int
    prefix_ids: list[int]  # what begins every row of text: the BOS token where the tokenizer puts one before a text

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then ``<pad>`` 256 and ``<eos>`` 257. Needs no download."""

    vocab_size = 258
    pad_token_id = 256
    eos_token_id = 257
    prefix_ids: list[int] = []
    bos_token_id = None
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# What a tokenizer's folder holds (as `save_pretrained` writes one, or a model's repository): one of these at least
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "special_tokens_map.json", "tekken.json")


def holds_tokenizer(folder: Any) -> bool:
    """Whether local folder ``folder`` holds a tokenizer's files (`TOKENIZER_FILES`, or a ``*.tiktoken``). A model's
    checkpoint saved without its tokenizer does not: transformers 5 then builds its class's tokenizer with no
    vocabulary (Qwen2's, GPT-2's: every text encoded to nothing; Gemma's: to its unknown token), where 4 raised."""
    folder = Path(folder).expanduser()
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer.from_pretrained(path)``, or one already loaded) behind the same
    small interface."""

    def __init__(self, name_or_path: Any) -> None:
        if not isinstance(name_or_path, str):  # (a tokenizer object: `tokenizer_object` says which are)
            self.inner = name_or_path
            self.name = getattr(name_or_path, "name_or_path", "") or type(name_or_path).__name__
        else:
            from transformers import AutoTokenizer

            self.name = name_or_path
            if missing_local_folder(name_or_path):
                raise ValueError(f"`tokenizer` {name_or_path!r}: no such folder, and no Hugging Face Hub name "
                                 "(`org/name`); give 'byte', a tokenizer folder (as save_pretrained writes one), or a "
                                 "Hub name reachable from here")
            try:
                if Path(name_or_path).expanduser().is_dir() and not holds_tokenizer(name_or_path):
                    raise OSError(f"it holds none of a tokenizer's files ({', '.join(TOKENIZER_FILES[:4])}...)")
                self.inner = AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path))
            except (OSError, ValueError) as err:  # (a missing folder reads as a malformed Hub repo id)
                what = ("not a tokenizer folder" if Path(name_or_path).expanduser().exists() else
                        "no such folder, nor a Hub tokenizer that could be loaded")
                detail = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise ValueError(f"`tokenizer` {name_or_path!r}: {what}; give 'byte', a tokenizer folder (as "
                                 f"save_pretrained writes one), or a Hub name reachable from here ({detail})") from err
        if self.inner.eos_token_id is None:
            raise ValueError(f"tokenizer {self.name!r} has no eos token; completions need one to end")
        self.eos_token_id = int(self.inner.eos_token_id)
        pad = self.inner.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size = len(self.inner)
        # A row begins as ``tokenizer(text)`` begins one: with the BOS token where the tokenizer adds it (Llama's
        # do, Qwen's have none); the prompt and the completion are then encoded without special tokens. (A row a
        # chat template renders is its text's tokens alone, as ``apply_chat_template(tokenize=True)`` gives them:
        # the BOS where the template writes it, and no other)
        bos = self.inner.bos_token_id
        self.bos_token_id = int(bos) if bos is not None else None
        first = self.inner.encode("a", add_special_tokens=True)[:1]
        self.prefix_ids = [int(bos)] if bos is not None and first == [bos] else []

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """``messages`` rendered by the tokenizer's chat template, as text (a `ValueError` where it has none; the
        template's own errors, a jinja2 ``TemplateError`` such as "roles must alternate", as it raises them)."""
        if not getattr(self.inner, "chat_template", None):
            raise ValueError(f"tokenizer {self.name!r} has no chat template (its tokenizer_config.json "
                             "`chat_template`), which renders conversations (lists of messages); give an instruct "
                             "model's tokenizer, or give the examples as prompt and completion text")
        return self.inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenizer_object(obj: Any) -> Optional[Tokenizer]:
    """``obj`` as a `Tokenizer` where it is one: this package's own (`ByteTokenizer`, `HFTokenizer`), or a Hugging
    Face tokenizer already loaded (a ``transformers`` ``PreTrainedTokenizerBase``); None for anything else."""
    if isinstance(obj, (ByteTokenizer, HFTokenizer)):
        return obj
    transformers = sys.modules.get("transformers")  # (a tokenizer object means transformers is imported)
    if transformers is not None and isinstance(obj, transformers.PreTrainedTokenizerBase):
        return HFTokenizer(obj)
    return None


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """``"byte"`` for the built-in byte tokenizer, else a Hugging Face tokenizer directory or name."""
    if name_or_path == "byte":
        return ByteTokenizer()
    return HFTokenizer(name_or_path)
