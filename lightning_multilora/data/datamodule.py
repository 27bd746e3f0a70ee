"""`MultiLoRADataModule`: every running adapter's own micro-batch, packed into one batch per step."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import os
import random
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.types import EVAL_DATALOADERS, TRAIN_DATALOADERS
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_multilora.arguments import UsageError, check_bool, check_int, check_real
from lightning_multilora.data.sources import (ChatExample, ChatPreferenceExample, DataSource, Example,
                                              GeneratedArithmetic, PreferenceExample, checked_examples)
from lightning_multilora.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_object
from lightning_multilora.layout import BatchLayout
from lightning_multilora.registry import merge_by_owner

if TYPE_CHECKING:
    from lightning_multilora.spec import AdapterSpec

IGNORE_INDEX = -100
PADDINGS = ("longest", "max_length")


@dataclass
class TokenizedSplit:
    """Token ids and labels (``-100`` on prompt tokens) of one split of one source. For preference pairs,
    ``input_ids`` / ``labels`` are the chosen rows and ``rejected_ids`` / ``rejected_labels`` the rejected."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    rejected_ids: Optional[list[list[int]]] = None
    rejected_labels: Optional[list[list[int]]] = None
    _digest: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    def digest(self) -> str:
        """A hash of the split's rows in order (each row's length and values): which examples a data position points
        at, saved beside it (`AdapterStream.state_dict`)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            for rows in (self.input_ids, self.labels, self.rejected_ids or [], self.rejected_labels or []):
                lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
                h.update(lengths.tobytes())
                h.update(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                     count=int(lengths.sum())).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def rows(self, idx: Sequence[int], objective: str, where: str) -> tuple[list[list[int]], list[list[int]]]:
        """Rows of examples ``idx``: DPO takes every chosen row, then every rejected row."""
        ids, labels = [self.input_ids[i] for i in idx], [self.labels[i] for i in idx]
        if objective == "dpo":
            if self.rejected_ids is None:
                raise ValueError(f"{where}: objective 'dpo' needs preference pairs (a PreferenceSource)")
            ids += [self.rejected_ids[i] for i in idx]
            labels += [self.rejected_labels[i] for i in idx]
        return ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)


def _right_padded(rows: Sequence[Sequence[int]], length: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as one ``(len(rows), length)`` tensor right-padded with ``fill``, and the mask of real entries.
    One conversion of all the values (a row at a time cost ~0.1 ms, 25 ms for a 60-adapter batch)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    out = torch.full((len(rows), length), fill, dtype=torch.long)
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    out[mask] = torch.from_numpy(values)  # row-major order: each row's values in turn
    return out, mask


class AdapterStream:
    """One adapter's position in its own training set: a fresh seeded permutation every epoch.

    Each call gives the next ``batch_size`` example indices; the last batch of an epoch may be smaller,
    so an epoch is ``ceil(n / batch_size)`` steps.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, digest: Optional[str] = None) -> None:
        self.num_examples, self.batch_size, self.seed, self.digest = num_examples, batch_size, seed, digest
        self.epoch, self.position = 0, 0
        self._perm: Optional[list[int]] = None

    def _permutation(self) -> list[int]:
        if self._perm is None:
            self._perm = list(range(self.num_examples))
            random.Random(f"{self.seed}-{self.epoch}").shuffle(self._perm)
        return self._perm

    def next_indices(self) -> list[int]:
        perm = self._permutation()
        out = perm[self.position:self.position + self.batch_size]
        self.position += len(out)
        if self.position >= self.num_examples:
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        return out

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_examples // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "num_examples": self.num_examples}
        return state if self.digest is None else {**state, "digest": self.digest}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None


class _StepTickets(IterableDataset):
    """An endless stream of step numbers. The packed batch is built from a ticket only when its step
    runs (in ``on_before_batch_transfer``), so the loader's prefetching never draws data for adapters
    that have left, and adapters that join are in the very next step."""

    def __iter__(self) -> Iterator[int]:
        step = 0
        while True:
            yield step
            step += 1


class _ValBatches(IterableDataset):
    def __init__(self, datamodule: "MultiLoRADataModule") -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, Any]]:
        trainer = self.datamodule.trainer
        peek = trainer is not None and bool(trainer.sanity_checking or trainer.fast_dev_run)
        batches = self.datamodule.val_batches(self.datamodule.running_specs(validation=True), peek=peek)
        module = trainer.lightning_module if trainer is not None else None
        align = getattr(module, "align_batches", None)  # adapter parallelism: the same count on every rank
        return iter(align(list(batches))) if align is not None else batches


def _blank(answer: Any) -> bool:
    """An answer with nothing to learn: empty, or white space alone (a Q/A format's empty answer is " ", as is an
    HH-RLHF reply left empty)."""
    return not answer or (isinstance(answer, str) and not answer.strip())


def prompt_and_answers(tok: Tokenizer, prompt: str,
                       answers: Sequence[str]) -> tuple[list[int], list[list[int]], list[int]]:
    """The tokens of ``prompt`` followed by each of ``answers``, one text each (``tokenizer(prompt + answer)``, the
    tokens TRL trains on), split where each leaves the prompt's own tokens: the prompt is the longest beginning that
    the prompt encoded alone shares with every joint text (for a pair, the shorter of the two, so that both answers
    follow the same prompt ids), each answer the rest of its joint text, learned.
    (A SentencePiece tokenizer begins a text encoded alone with a word boundary, and encodes a prompt's last space as
    a token of its own, ``▁``, that the joint text merges into the next word, ``▁the``: a completion encoded alone
    after the prompt's tokens got a space the text does not have, the row decoding as "Answer:  the".)
    Third: the prompt's own last tokens that are not that beginning (merged into the answers' first tokens)."""
    prompt_ids = tok.encode(prompt)
    joints = [tok.encode(prompt + answer) for answer in answers]
    shared = len(prompt_ids)
    for joint in joints:
        if joint[:shared] == prompt_ids[:shared]:  # (the common case, at C speed)
            shared = min(shared, len(joint))
            continue
        shared = next((k for k, (a, b) in enumerate(zip(prompt_ids[:shared], joint)) if a != b),
                      min(shared, len(joint)))
    return prompt_ids[:shared], [joint[shared:] for joint in joints], prompt_ids[shared:]


def render_chat(tok: Tokenizer, example: ChatExample) -> Example:
    """A conversation as prompt and completion text, by the tokenizer's chat template: the prompt is the messages
    before the last with the template's generation prompt (``<|im_start|>assistant\\n``...), the completion what the
    whole conversation's rendering adds to it (the assistant's message and the template's end of turn). The row is
    the rendered text's tokens alone (a BOS where the template writes one, no `Tokenizer.prefix_ids`), as
    ``apply_chat_template(tokenize=True)`` gives them to TRL and to inference. A template that refuses the
    conversation (a jinja2 ``TemplateError``: "Conversation roles must alternate...") is a `ValueError` naming the
    record, as is a tokenizer without a template."""
    chat_text = getattr(tok, "chat_text", None)
    if chat_text is None:
        raise ValueError(f"{example.source}: a conversation (lists of messages) is rendered by the tokenizer's chat "
                         f"template: give `tokenizer` a Hugging Face tokenizer with one, not "
                         f"{getattr(tok, 'name', type(tok).__name__)!r}")
    messages = [{"role": role, "content": content} for role, content in example.messages]
    try:
        prompt = chat_text(messages[:-1], add_generation_prompt=True)
        whole = chat_text(messages, add_generation_prompt=False)
    except ValueError as err:  # (no template: said of the record that needs one)
        raise ValueError(f"{example.source}: {err}") from err
    except Exception as err:  # noqa: BLE001 - the template's own (jinja2's TemplateError from `raise_exception`)
        raise ValueError(f"{example.source}: the tokenizer's chat template refuses this conversation (roles "
                         f"{[r for r, _ in example.messages]}): {type(err).__name__}: {err}") from err
    if not whole.startswith(prompt):
        raise ValueError(f"{example.source}: the tokenizer's chat template does not render the conversation as its "
                         "prompt (the messages before the last, with the generation prompt) followed by the last "
                         "message, so the completion to learn cannot be told apart; format the examples as prompt "
                         "and completion")
    return Example(prompt, whole[len(prompt):], example.source)


def render_chat_pair(tok: Tokenizer, example: ChatPreferenceExample) -> PreferenceExample:
    """A conversational preference pair as text, by the tokenizer's chat template (`render_chat` of the prompt
    followed by each answer: the prompt renders alike before both)."""
    chosen, rejected = (render_chat(tok, ChatExample(example.prompt + answer, example.source))
                        for answer in (example.chosen, example.rejected))
    return PreferenceExample(chosen.prompt, chosen.completion, rejected.completion, example.source)


class MultiLoRADataModule(L.LightningDataModule):
    """Packs each running adapter's micro-batch (its own source, its own batch size) into one batch.

    Args:
        sources: data sources by name; an adapter's ``dataset`` names one (None: the first).
            Default: ``{"arithmetic": GeneratedArithmetic()}``.
        tokenizer: ``"byte"`` (offline byte-level), a Hugging Face tokenizer's folder or Hub name, or a tokenizer
            already loaded (``AutoTokenizer.from_pretrained(...)``, as TRL's ``processing_class``). A row is its BOS
            token where the tokenizer begins a text with one (as ``tokenizer(text)`` does), the prompt, the
            completion and EOS (a completion's own where it ends with it, a DPO answer's too); a conversation's row
            (a conversational pair's answer too) is its chat template's tokens alone.
        max_length: longest tokenized example (default: the model's maximum positions).
        truncate: cut examples longer than ``max_length`` instead of raising: a row's end; a preference pair's
            prompt from its start (keeping its end, next to the answers), then the answers' ends.
        val_fraction: share of each source held out for validation, in (0, 1).
        val_batch_size: examples per adapter in each packed validation batch: rows, or pairs for a DPO adapter
            (two rows each, and their reference forward besides).
        val_max_rows: most rows in one validation forward (a DPO pair two); a packed validation batch of more is
            split. None: the validated adapters' rows of a training step together (what admission found room for),
            or one adapter's ``val_batch_size`` examples where that is more (64 adapters of batch 1 validated 512
            rows at once, 8 times a training step's, and ran out of memory where training did not). A sanity check's
            or a smoke run's batches (`fast_dev_run`) hold one example of every adapter at least, past this cap where
            it is smaller than the adapters' rows (no more than a training step's).
        max_val_examples: cap on each source's validation split (None: no cap); the examples past it go back into
            training (GSM8K's 7473 hold out 256, not ``val_fraction``'s 747).
        val_sources: a held-out validation source for some of ``sources``, by the same name (a DatasetDict's
            ``test`` split, a second file: as HF Trainer's and TRL's ``eval_dataset``): that source trains on all
            its examples and validates on this one's, in the split seed's order, up to ``max_val_examples``.
        split_seed: seed of the train/validation split.
        padding: ``"longest"`` pads each packed batch to its longest row; ``"max_length"`` pads every batch
            to ``max_length``, so a row's arithmetic never depends on which other rows share its batch.
        pad_to_multiple_of: round the padded length up to a multiple of this (8 suits tensor cores), but not past
            ``max_length`` (or the model's maximum).

    The batch is a dict with ``input_ids``, ``attention_mask``, ``labels`` (``(B, T)``, right-padded as
    ``padding`` says) and ``layout`` (a `BatchLayout` in rows, adapters in roster order, ``padding_side="right"``).
    """

    def __init__(
        self,
        sources: Optional[dict[str, DataSource]] = None,
        tokenizer: Union[str, Any] = "byte",
        max_length: Optional[int] = None,
        truncate: bool = False,
        val_fraction: float = 0.1,
        val_batch_size: int = 8,
        max_val_examples: Optional[int] = 256,
        split_seed: int = 1234,
        padding: str = "longest",
        pad_to_multiple_of: int = 1,
        val_sources: Optional[dict[str, DataSource]] = None,
        val_max_rows: Optional[int] = None,
    ) -> None:
        super().__init__()
        if sources is not None and not sources:  # (None: the generated default; an empty mapping is a mistake)
            raise ValueError("`sources` must name at least one data source (or be left out for the generated "
                             "arithmetic default)")
        classes = [k for k, v in sources.items() if isinstance(v, type)] if isinstance(sources, Mapping) else []
        if classes:
            cls = sources[classes[0]]
            raise ValueError(f"`sources[{classes[0]!r}]` is the class {cls.__name__}, not a source: give an instance, "
                             f"{cls.__name__}(...)")
        if sources is not None and (not isinstance(sources, Mapping) or not all(
                isinstance(k, str) and callable(getattr(v, "examples", None)) for k, v in sources.items())):
            raise ValueError(f"`sources` must map names to data sources (JSONLSource, HFDatasetSource, "
                             f"PreferenceSource, ListSource, GeneratedArithmetic...), got {sources!r:.120}")
        self.sources: dict[str, DataSource] = dict(sources) if sources else {"arithmetic": GeneratedArithmetic()}
        where = "MultiLoRADataModule"
        check_real(where, "val_fraction", val_fraction, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")
        check_int(where, "val_batch_size", val_batch_size, 1)
        check_int(where, "val_max_rows", val_max_rows, 1, optional=True)
        check_int(where, "max_length", max_length, 2, optional=True)
        check_bool(where, "truncate", truncate)
        check_int(where, "split_seed", split_seed, -2**63)
        if padding not in PADDINGS:
            raise ValueError(f"`padding` can be {', '.join(PADDINGS)}, got {padding!r}")
        if padding == "max_length" and max_length is None:
            raise ValueError("`padding='max_length'` needs `max_length`")
        check_int(where, "pad_to_multiple_of", pad_to_multiple_of, 1)
        tokenizer = os.fspath(tokenizer) if isinstance(tokenizer, os.PathLike) else tokenizer
        loaded = None if isinstance(tokenizer, str) else tokenizer_object(tokenizer)
        if loaded is None and (not isinstance(tokenizer, str) or not tokenizer):
            got = (f"{tokenizer!r:.80}" if isinstance(tokenizer, (str, int, float, type(None))) else
                   f"a {type(tokenizer).__name__}")
            raise ValueError(f"MultiLoRADataModule: `tokenizer` must be 'byte' (bytes, the built-in tiny models' "
                             f"vocabulary), a tokenizer's folder or hub name, or a Hugging Face tokenizer object, got "
                             f"{got}")
        if val_sources is not None and (not isinstance(val_sources, Mapping) or not all(
                isinstance(k, str) and callable(getattr(v, "examples", None)) for k, v in val_sources.items())):
            raise ValueError(f"`val_sources` must map names of `sources` to data sources (JSONLSource, "
                             f"HFDatasetSource, PreferenceSource, ListSource...), got {val_sources!r:.120}")
        unknown = sorted(set(val_sources or ()) - set(self.sources))
        if unknown:
            raise ValueError(f"`val_sources` names {unknown}, which are not data sources; a validation source takes "
                             f"the name of the source it holds out for, one of {list(self.sources)}")
        self.val_sources: dict[str, DataSource] = dict(val_sources or {})
        check_int(where, "max_val_examples", max_val_examples, 1, optional=True)
        self.padding, self.pad_to_multiple_of = padding, pad_to_multiple_of
        self.tokenizer_name = tokenizer if loaded is None else loaded.name
        self.max_length = max_length
        self.truncate = truncate
        self.val_fraction = val_fraction
        self.val_batch_size, self.val_max_rows = val_batch_size, val_max_rows
        self.max_val_examples = max_val_examples
        self.split_seed = split_seed
        self._tokenizer: Optional[Tokenizer] = loaded
        self._splits: dict[str, tuple[TokenizedSplit, TokenizedSplit]] = {}
        self._streams: dict[str, AdapterStream] = {}
        self._pending_stream_state: dict[str, dict[str, int]] = {}
        # the drawn streams' states before the training batch in flight was drawn, until the module says its step
        # was taken (`batch_trained`): a checkpoint or another fit after a Ctrl+C inside the step draws it again
        self._drawn_from: dict[str, dict[str, int]] = {}
        self.model_max_length: Optional[int] = None

    # -- tokenizer and splits -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def source_name(self, dataset: Optional[str]) -> str:
        if dataset is None:
            return next(iter(self.sources))
        if dataset not in self.sources:
            close = difflib.get_close_matches(str(dataset), list(self.sources), n=1)
            raise ValueError(f"adapter `dataset` {dataset!r} is not a data source; sources are: {list(self.sources)}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        return dataset

    @property
    def effective_max_length(self) -> Optional[int]:
        if self.max_length is not None and self.model_max_length is not None and self.max_length > self.model_max_length:
            raise UsageError(
                f"`max_length` {self.max_length} is longer than the model's maximum sequence length "
                f"{self.model_max_length}"
            )
        return self.max_length if self.max_length is not None else self.model_max_length

    def split(self, dataset: Optional[str]) -> tuple[TokenizedSplit, TokenizedSplit]:
        """(train, validation) of a source, tokenized once."""
        name = self.source_name(dataset)
        if name not in self._splits:
            self._splits[name] = self._tokenize_source(name)
        return self._splits[name]

    def _tokenize_source(self, name: str) -> tuple[TokenizedSplit, TokenizedSplit]:
        """(train, validation) of source ``name``: a share of its examples held out (`val_fraction`, up to
        `max_val_examples`), or, where `val_sources` names it, all of them and the validation source's."""
        held_out = self.val_sources.get(name)
        chosen, rejected = self._tokenize_rows(name, self.sources[name], 1 if held_out is not None else 2)
        pairs = rejected[0] is not None
        if held_out is None:  # the validation share of the examples kept (those truncation left out count in neither)
            n_val = min(max(1, round(len(chosen) * self.val_fraction)), len(chosen) - 1)
            if self.max_val_examples is not None:
                n_val = min(n_val, self.max_val_examples)
            val_rows, val_rejected = chosen[:n_val], rejected[:n_val]
            chosen, rejected = chosen[n_val:], rejected[n_val:]
        else:
            val_rows, val_rejected = self._tokenize_rows(name, held_out, 1, "validation source")
            if (val_rejected[0] is not None) != pairs:
                kinds = ("preference pairs", "prompt-completion examples")
                raise ValueError(f"`val_sources[{name!r}]` ({held_out.describe()}) holds {kinds[pairs]} and data "
                                 f"source {name!r} ({self.sources[name].describe()}) holds {kinds[not pairs]}: give "
                                 "a validation source of the same kind")
            n_val = len(val_rows) if self.max_val_examples is None else min(len(val_rows), self.max_val_examples)
            val_rows, val_rejected = val_rows[:n_val], val_rejected[:n_val]

        def split(rows: list, rej: list) -> TokenizedSplit:
            return TokenizedSplit([r[0] for r in rows], [r[1] for r in rows], [r[0] for r in rej] if pairs else None,
                                  [r[1] for r in rej] if pairs else None)

        return split(chosen, rejected), split(val_rows, val_rejected)

    def _tokenize_rows(self, name: str, source: DataSource, need: int,
                       role: str = "data source") -> tuple[list[tuple[list[int], list[int]]], list]:
        """The rows (ids, labels) of ``source``'s examples kept, in the split seed's order, with their rejected
        answer's rows (None each where they are no preference pairs); ``need`` kept at least."""
        examples = checked_examples(source.examples(), f"{role} {name!r} ({source.describe()})")
        needed = "one for training, one for validation" if need == 2 else (
            "its validation split" if role != "data source" else "for training; `val_sources` holds its validation")
        if len(examples) < need:
            raise ValueError(f"{role} {name!r} ({source.describe()}) has {len(examples)} examples; it needs at least "
                             f"{need} ({needed})")
        order = list(range(len(examples)))
        random.Random(self.split_seed).shuffle(order)
        tok, limit = self.tokenizer, self.effective_max_length
        pairs = isinstance(examples[0], (PreferenceExample, ChatPreferenceExample))

        def named(i: int) -> str:
            """Example ``i`` with where it came from (``file:line``...), where its source says."""
            where = getattr(examples[i], "source", "")
            return f"example {i} ({where})" if where else f"example {i}"

        def encode(i: int, prompt: list[int], completion: list[int],
                   chat: bool = False) -> Optional[tuple[list[int], list[int]]]:
            # EOS ends a text row where its completion (an answer of a pair) does not end with it, as TRL's SFT and
            # DPO add it (1.16's `add_eos`); a conversation's row, a pair's answers too, is the template's tokens
            # alone, its end of turn as rendered (TRL adds nothing to it)
            eos = tok.eos_token_id
            if not chat and completion[-1:] != [eos]:
                completion = completion + [eos]
            ids = prompt + completion
            labels = [IGNORE_INDEX] * len(prompt) + completion
            if limit is not None and len(ids) > limit:
                if not self.truncate:
                    raise ValueError(
                        f"{named(i)} of {role} {name!r} is {len(ids)} tokens, longer than the maximum "
                        f"sequence length {limit}; {longer}, or set `truncate=True`"
                    )
                ids, labels = ids[:limit], labels[:limit]
                cut.add(i)
            if all(x == IGNORE_INDEX for x in labels[1:]):
                if self.truncate:
                    return None
                raise ValueError(f"{named(i)} of {role} {name!r} has no completion tokens to learn")
            return ids, labels

        chosen, rejected = [], []
        same, empty = [], []  # pairs with one completion for both answers / an empty answer
        cut: set[int] = set()  # examples whose row (a pair's either) was cut at the limit
        kept: list[int] = []
        model_max = self.model_max_length
        longer = ("raise `max_length` (up to the model's maximum)" if model_max is None or limit is None
                  or limit < model_max else f"{limit} tokens is the model's maximum: shorten the examples")
        text_prefix = list(getattr(tok, "prefix_ids", ()))  # (BOS, where the tokenizer begins a text with it)
        bos = getattr(tok, "bos_token_id", None)
        prompt_cut: set[int] = set()  # preference pairs whose prompt was cut to fit
        merged: dict[int, str] = {}  # examples whose prompt's last text the tokenizer merges into the completion's
        for i in order:
            example = examples[i]
            chat = isinstance(example, (ChatExample, ChatPreferenceExample))
            if chat:
                example = (render_chat if isinstance(example, ChatExample) else render_chat_pair)(tok, example)
            prompt, answers, dropped = prompt_and_answers(
                tok, example.prompt, (example.chosen, example.rejected) if pairs else (example.completion,))
            if dropped and tok.decode(dropped).strip():  # (a SentencePiece prompt's last space, `▁`: not said)
                merged.setdefault(i, tok.decode(dropped))
            prefix = text_prefix
            if chat:  # (the template's tokens alone: the BOS it writes, kept first when a prompt is cut, and no other)
                prefix = prompt[:1] if bos is not None and prompt[:1] == [bos] else []
                prompt = prompt[len(prefix):]
            if pairs and self.truncate and limit is not None:
                # Preference pairs keep their prompt's end (as TRL's DPO did with `max_prompt_length`; 1.16 keeps a
                # row's start and drops the pairs whose prompt fills it), leaving the answers at least half the
                # length: cutting the row's end would leave long-prompt pairs without answer tokens
                room = max(limit - len(prefix) - min(max(map(len, answers)) + 1, limit // 2), 0)
                if len(prompt) > room:
                    prompt = prompt[len(prompt) - room:]
                    prompt_cut.add(i)
            first = encode(i, prefix + prompt, answers[0], chat)
            second = encode(i, prefix + prompt, answers[1], chat) if pairs else None
            if first is None or (pairs and second is None):
                continue
            chosen.append(first)
            rejected.append(second)
            kept.append(i)
            if pairs and first[1] == second[1]:
                same.append(i)
            elif pairs and (_blank(example.chosen) or _blank(example.rejected)):  # (the texts: a token list may
                empty.append(i)  # hold the prompt's last token, which the shared beginning left to the answers)
            elif not pairs and not chat and _blank(example.completion):  # (an SFT row that learns EOS alone)
                empty.append(i)
        if len(chosen) < need:
            raise ValueError(f"{role} {name!r}: {len(chosen)} of its {len(examples)} examples keep completion "
                             f"tokens after truncation to {limit} tokens (`max_length`; the prompts fill the rest), "
                             f"and it needs at least {need} ({needed}); {longer}")
        if len(chosen) < len(examples):
            warnings.warn(f"{role} {name!r}: {len(examples) - len(chosen)} of {len(examples)} examples kept no "
                          f"completion tokens after truncation to {limit} tokens (the prompt filled them) and are "
                          f"left out; {longer} to keep them")
        kept_prompt_cut = len(prompt_cut.intersection(kept))
        if kept_prompt_cut:
            warnings.warn(f"{role} {name!r}: {kept_prompt_cut} of the {len(chosen)} preference pairs kept had "
                          f"their prompt cut to fit {limit} tokens (its beginning left out, its end kept next to the "
                          f"answers); {longer}", stacklevel=2)
        kept_cut = len(cut.intersection(kept))
        if kept_cut:
            warnings.warn(f"{role} {name!r}: {kept_cut} of the {len(chosen)} examples kept were cut at {limit} "
                          f"tokens inside their completion (its end and EOS are not learned); {longer}", stacklevel=2)
        merged = {i: merged[i] for i in set(merged).intersection(kept)}
        if merged:
            shown = ", ".join(f"{named(i)}: {merged[i]!r}" for i in sorted(merged)[:3])
            warnings.warn(f"{role} {name!r}: in {len(merged)} of {len(chosen)} examples the tokenizer merges the "
                          f"prompt's last text with the completion's first ({shown}{', ...' if len(merged) > 3 else ''}"
                          "): that text is learned as part of the completion (the row holds the tokens of prompt + "
                          "completion, as TRL trains on); a prompt ending where the tokenizer splits (a space or a "
                          "newline, as the tokenizer has it) keeps it to the prompt", stacklevel=2)
        if same:
            warnings.warn(f"{role} {name!r}: {len(same)} of {len(chosen)} preference pairs have the same chosen "
                          f"and rejected completion (after truncation; {', '.join(named(i) for i in sorted(same)[:3])}"
                          f"{', ...' if len(same) > 3 else ''}); DPO learns nothing from them")
        if empty:
            which = (("preference pairs have an empty (or blank) chosen or rejected completion", "that answer is")
                     if pairs else ("examples have an empty (or blank) completion", "each learns"))
            warnings.warn(f"{role} {name!r}: {len(empty)} of {len(chosen)} {which[0]} "
                          f"({', '.join(named(i) for i in sorted(empty)[:3])}{', ...' if len(empty) > 3 else ''}); "
                          f"{which[1]} the end of text alone (after any white space)")
        return chosen, rejected

    def num_train_examples(self, dataset: Optional[str]) -> int:
        return len(self.split(dataset)[0])

    def check_source(self, spec: "AdapterSpec") -> str:
        """``spec``'s data source name, checked without reading the source: it is one of `sources`, and one that says
        it holds no preference pairs is not given to a DPO adapter (a `ValueError` naming them otherwise)."""
        name = self.source_name(spec.dataset)
        if spec.objective == "dpo" and getattr(self.sources[name], "preference_pairs", None) is False:
            raise ValueError(f"adapter {spec.name!r}: objective 'dpo' needs preference pairs, and data source "
                             f"{name!r} ({self.sources[name].describe()}) has none (a PreferenceSource has them)")
        return name

    def check(self, spec: "AdapterSpec") -> None:
        """That ``spec`` can train here: its source exists and reads, and holds what its objective needs (a
        `ValueError` naming them otherwise; the module checks an adapter as it starts, so that one that cannot
        fails alone instead of failing the run at its first batch). Whatever else reading or tokenizing the source
        raises (an OSError, a loader's own: ``datasets``' DatasetGenerationError, a TypeError...) is a `ValueError`
        naming the source too, the original its ``__cause__``: anything but a ValueError would stop the whole fit."""
        name = self.check_source(spec)
        try:
            train, _ = self.split(name)
        except UnicodeError as err:  # (a ValueError, but a codec's message alone, naming neither source nor record)
            raise ValueError(f"data source {name!r} ({self.sources[name].describe()}) holds text that is not valid "
                             f"Unicode ({type(err).__name__}: {err}); repair or re-encode the file as UTF-8") from err
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - (KeyboardInterrupt and the like are no Exception: they go on)
            # (datasets' DatasetGenerationError says what failed only in the error it was raised from)
            cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
            detail = f"{type(err).__name__}: {err}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
            raise ValueError(f"data source {name!r} ({self.sources[name].describe()}) could not be read: "
                             f"{detail}") from err
        if spec.objective == "dpo" and train.rejected_ids is None:
            raise ValueError(f"objective 'dpo' needs preference pairs, and data source {name!r} "
                             f"({self.sources[name].describe()}) has none (a PreferenceSource has them)")

    # -- per-adapter streams --------------------------------------------------------------------

    def stream(self, spec: "AdapterSpec") -> AdapterStream:
        if spec.name not in self._streams:
            train = self.split(spec.dataset)[0]
            stream = AdapterStream(len(train), spec.batch_size, spec.seed, train.digest())
            if spec.name in self._pending_stream_state:
                state = self._pending_stream_state.pop(spec.name)
                saved = state.get("num_examples")  # (absent from older checkpoints, as is "digest")
                if ((saved is not None and saved != stream.num_examples)
                        or int(state["position"]) >= stream.num_examples):
                    warnings.warn(
                        f"adapter {spec.name!r}: its training split of data source "
                        f"{self.source_name(spec.dataset)!r} has {stream.num_examples} examples now and had "
                        f"{saved if saved is not None else 'fewer than its saved position'} when the checkpoint was "
                        f"written (the data, `limit`, `max_length`, `truncate` or `val_fraction` changed): its data "
                        f"position cannot be kept, so it starts epoch {state['epoch']} from its beginning")
                    state = dict(state, position=0)
                elif state.get("digest") not in (None, stream.digest):
                    warnings.warn(
                        f"adapter {spec.name!r}: its training split of data source "
                        f"{self.source_name(spec.dataset)!r} holds other examples now than when the checkpoint was "
                        f"written, as many ({stream.num_examples}; the data, its order `split_seed`, the tokenizer, "
                        "`max_length` or `truncate` changed): it goes on from its position in epoch "
                        f"{state['epoch']}, over other examples than the run it resumes would have drawn")
                stream.load_state_dict(state)
            self._streams[spec.name] = stream
        return self._streams[spec.name]

    def release(self, name: str) -> None:
        """Forget an adapter's data position (it has left the run)."""
        self._streams.pop(name, None)

    # -- packing --------------------------------------------------------------------------------

    def pack(self, names: Sequence[str], rows: Sequence[tuple[list[list[int]], list[list[int]]]]) -> dict[str, Any]:
        """Concatenate each adapter's rows in order, right-pad to the longest, and attach the layout.
        No rows (a rank whose adapters have all left, under adapter parallelism) is an empty batch."""
        sizes = [len(ids) for ids, _ in rows]
        flat_ids = [r for ids, _ in rows for r in ids]
        flat_labels = [r for _, labels in rows for r in labels]
        if not flat_ids:
            empty = torch.zeros((0, 1), dtype=torch.long)
            return {"input_ids": empty, "attention_mask": empty, "labels": empty.clone(),
                    "layout": BatchLayout((), (), (), 0)}
        longest = max(len(r) for r in flat_ids)
        length = self.max_length if self.padding == "max_length" else longest
        length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if self.effective_max_length is not None:  # (rounded up, never past the longest a row may be)
            length = min(length, max(self.effective_max_length, longest))
        input_ids, mask = _right_padded(flat_ids, length, self.tokenizer.pad_token_id)
        labels, _ = _right_padded(flat_labels, length, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels,
                "layout": BatchLayout.from_sizes(list(names), sizes, padding_side="right")}

    def train_batch(self, specs: Sequence["AdapterSpec"]) -> dict[str, Any]:
        """The next packed training batch: each adapter's next micro-batch from its own stream. Until
        `batch_trained`, the positions saved (`state_dict`) and kept for another fit are those before it."""
        self._drawn_from = {spec.name: self.stream(spec).state_dict() for spec in specs}
        rows = []
        for spec in specs:
            train, _ = self.split(spec.dataset)
            idx = self.stream(spec).next_indices()
            rows.append(train.rows(idx, spec.objective, f"adapter {spec.name!r}"))
        return self.pack([s.name for s in specs], rows)

    def batch_trained(self, names: Optional[Sequence[str]] = None) -> None:
        """The module took the step of the training batch last drawn: its streams' positions are past it (``names``:
        those adapters' alone, where an optimizer's step stopped after it updated them; the others take it again)."""
        self._drawn_from = {} if names is None else {n: s for n, s in self._drawn_from.items() if n not in names}

    def _stream_states(self) -> dict[str, dict[str, int]]:
        """Every adapter's stream position to save: before the batch in flight, where one is."""
        positions = dict(self._pending_stream_state)
        positions.update({name: s.state_dict() for name, s in self._streams.items()})
        positions.update({name: s for name, s in self._drawn_from.items() if name in positions})
        return positions

    def val_batches(self, specs: Sequence["AdapterSpec"], peek: bool = False) -> Iterator[dict[str, Any]]:
        """Packed validation batches over every adapter's whole validation split: the ``k``-th ``val_batch_size``
        examples of each adapter, split into batches of at most ``val_max_rows`` rows (`val_rows_cap`). ``peek`` (a
        sanity check's or a smoke run's few batches): each batch holds examples of every adapter, as many of each as
        the cap leaves room for (one at least; the first batches held the first adapters alone)."""
        splits = [self.split(s.dataset)[1] for s in specs]
        cap = self.val_rows_cap(specs)
        size = self.val_batch_size
        if peek:
            rows = sum(2 if s.objective == "dpo" else 1 for s in specs)
            size = min(size, max(1, cap // max(rows, 1)))
            cap = max(cap, size * rows)
        steps = max((-(-len(v) // size) for v in splits), default=0)
        for k in range(steps):
            lo, hi = k * size, (k + 1) * size
            names, rows, held = [], [], 0
            for spec, val in zip(specs, splits):
                start, end, per = lo, min(hi, len(val)), 2 if spec.objective == "dpo" else 1
                while start < end:
                    take = min(end - start, (cap - held) // per)
                    if take <= 0 and names:  # (full: an adapter's examples go on in the next batch)
                        yield self.pack(names, rows)
                        names, rows, held = [], [], 0
                        continue
                    take = max(take, 1)  # (a DPO pair under a cap of one row)
                    names.append(spec.name)
                    rows.append(val.rows(range(start, start + take), spec.objective, f"adapter {spec.name!r}"))
                    held, start = held + take * per, start + take
            if names:
                yield self.pack(names, rows)

    def val_rows_cap(self, specs: Sequence["AdapterSpec"]) -> int:
        """Most rows in one validation batch of ``specs``: ``val_max_rows``, or their rows of a training step
        together, or one adapter's ``val_batch_size`` examples where that is more."""
        if self.val_max_rows is not None:
            return self.val_max_rows
        one = max((self.val_batch_size * (2 if s.objective == "dpo" else 1) for s in specs), default=1)
        return max(sum(s.rows_per_step for s in specs), one)

    # -- Lightning hooks ------------------------------------------------------------------------

    def running_specs(self, validation: bool = False) -> list["AdapterSpec"]:
        """The module's adapters of the next packed batch (`packing_roster`), or (``validation``) of the next
        validation (`validation_roster`, where the module has one)."""
        if self.trainer is None:
            raise RuntimeError("MultiLoRADataModule needs a Trainer with a MultiLoRA module attached")
        module = self.trainer.lightning_module
        if not hasattr(module, "packing_roster"):
            raise TypeError(f"{type(module).__name__} is not a MultiLoRAMixin module (no `packing_roster`)")
        roster = getattr(module, "validation_roster", None) if validation else None
        return roster() if roster is not None else module.packing_roster()

    @override
    def setup(self, stage: str) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        limit = getattr(module, "max_sequence_length", None)
        if limit is not None:
            before = self.max_length if self.max_length is not None else self.model_max_length
            self.model_max_length = int(limit)
            if self.effective_max_length != before:  # (validates max_length against the model too)
                self._splits.clear()  # splits read before (`split`) were not held to the model's maximum
        if stage == "fit":
            self._keep_streams_of(module)
        vocab = getattr(module, "vocab_size", None)
        if vocab is not None and self.tokenizer.vocab_size > vocab:
            raise UsageError(
                f"tokenizer {self.tokenizer_name!r} has {self.tokenizer.vocab_size} tokens but the model's "
                f"vocabulary has {vocab}; use a model with vocab_size >= {self.tokenizer.vocab_size}"
            )
        if vocab is not None and self.tokenizer_name == "byte" and vocab != self.tokenizer.vocab_size:
            warnings.warn(f"MultiLoRADataModule(tokenizer='byte'): the data is read as bytes (the default, the "
                          f"built-in tiny models' {self.tokenizer.vocab_size}-token vocabulary), and the model's "
                          f"vocabulary has {vocab} tokens: give the model's own tokenizer (`tokenizer=` its checkpoint "
                          "folder or hub name)", stacklevel=2)

    def _keep_streams_of(self, module: Any) -> None:
        """A fit starts: data positions are kept for the adapters the module goes on training (those that have taken
        steps and not ended: a second fit of the same module), rebuilt on the current splits; any other adapter of the
        same name (a new module's) starts its data from the beginning. The module's own record of them
        (`carried_data_positions`: its last fit's, or those of the checkpoint it was loaded from) goes first: this data
        module may be new to it. A checkpoint's positions load after this."""
        registry = getattr(module, "registry", None)
        going_on = {r.name for r in registry if r.step > 0 and not r.state.exited} if registry is not None else set()
        carried = getattr(module, "carried_data_positions", lambda: None)() or {}
        pending = {n: s for n, s in {**self._stream_states(), **carried}.items() if n in going_on}
        self._streams.clear()
        self._drawn_from = {}
        self._pending_stream_state = pending

    @override
    def train_dataloader(self) -> TRAIN_DATALOADERS:
        # A private generator: a loader's iterator otherwise draws its seed from the global generator,
        # which would shift every adapter's dropout masks whenever a loader is (re)created.
        return DataLoader(_StepTickets(), batch_size=None, generator=torch.Generator())

    @override
    def val_dataloader(self) -> EVAL_DATALOADERS:
        return DataLoader(_ValBatches(self), batch_size=None, generator=torch.Generator())

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, int):  # a training step ticket: draw the data now
            return self.train_batch(self.running_specs())
        return batch

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._stream_states()}

    @staticmethod
    def merge_rank_states(states: list[dict[str, Any]], owners: dict[str, int]) -> dict[str, Any]:
        """One state from an adapter-parallel checkpoint's ranks (a run resumed on another number of them): each
        adapter's stream position from the rank that trained it."""
        return {"streams": merge_by_owner([s.get("streams", {}) for s in states], owners)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._streams.clear()
        self._drawn_from = {}
        self._pending_stream_state = dict(state_dict.get("streams", {}))
