"""Data: sources of prompt/completion examples, tokenizers, and the packing data module."""

from lightning_multilora.data.datamodule import AdapterStream, MultiLoRADataModule, TokenizedSplit
from lightning_multilora.data.sources import (
    ChatExample,
    ChatPreferenceExample,
    DataSource,
    Example,
    GeneratedArithmetic,
    HFDatasetSource,
    JSONLSource,
    ListSource,
    PreferenceExample,
    PreferenceSource,
)
from lightning_multilora.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "AdapterStream", "ByteTokenizer", "ChatExample", "ChatPreferenceExample", "DataSource", "Example",
    "GeneratedArithmetic",
    "HFDatasetSource", "HFTokenizer", "JSONLSource", "ListSource", "PreferenceExample", "PreferenceSource",
    "MultiLoRADataModule", "TokenizedSplit", "load_tokenizer",
]
