"""Raw text in, batches of model inputs out.

:func:`toast.compress` and friends eat batches (``dict(input_ids=...,
attention_mask=...)``). Users hold text: a ``.txt`` / ``.jsonl`` / ``.json``
file, a list of strings or of rows, a ``datasets.Dataset``. :class:`TextData`
turns any of them into a lazy, re-iterable sequence of batches with one
tokenizer and a few options (:data:`TEXT_OPTIONS`); :func:`as_batches` does it
only when the data is raw (:func:`is_raw`) and passes batches through.

Two layouts:

- ``pack=False``: one text is one sample, truncated to ``max_length`` tokens
  and right-padded per batch (``attention_mask`` marks the real tokens);
- ``pack=True``: every text is tokenized, the texts are joined with the EOS
  token and the stream is cut into sequences of exactly ``max_length`` tokens
  (the remainder dropped): the usual perplexity and calibration protocol of
  causal LMs, with no padding at all.

Chat rows (``{"messages": [{"role": ..., "content": ...}, ...]}``) are
rendered with the tokenizer's chat template and tokenized without adding
special tokens again (the template writes them). Blank texts are skipped, as
blank lines of a ``.txt`` file are.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from array import array
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toast._validation import Interval, Predicate, check, validate

__all__ = ["TEXT_OPTIONS", "TextData", "as_batches", "is_raw"]

#: The keywords that say how raw text becomes batches.
TEXT_OPTIONS: tuple[str, ...] = (
    "tokenizer",
    "max_length",
    "batch_size",
    "num_samples",
    "pack",
    "field",
)

_CONSTRAINTS: dict[str, list[Any]] = {
    "tokenizer": [
        Predicate(
            callable,
            "a tokenizer (e.g. transformers.AutoTokenizer.from_pretrained(path))",
        )
    ],
    "max_length": [Interval(int, 1, None)],
    "batch_size": [Interval(int, 1, None)],
    "num_samples": [Interval(int, 1, None), None],
    "pack": [bool],
    "field": [str],
}
_SOURCES = (
    "a path to a .txt, .jsonl or .json file, a list of texts or of rows "
    "(dicts with a text field or 'messages'), or a datasets.Dataset"
)
# Texts tokenized per call while packing (one call per chunk keeps the fast
# tokenizer busy without holding a second copy of every text).
_PACK_CHUNK = 256


def is_raw(data: Any) -> bool:
    """Whether ``data`` is raw text that needs a tokenizer: a path, a
    list/tuple of strings or of text rows (dicts with a string value or a
    ``"messages"`` list, no tensors), or a datasets-style object (it has
    ``column_names``). Batches (a DataLoader, tensors, dicts of tensors) are
    not."""
    if isinstance(data, (str, os.PathLike)) or hasattr(data, "column_names"):
        return True
    if not isinstance(data, (list, tuple)) or not data:
        return False
    first = data[0]
    if isinstance(first, str):
        return True
    if not isinstance(first, Mapping):
        return False
    values = list(first.values())
    if any(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        return False
    return "messages" in first or any(isinstance(v, str) for v in values)


def as_batches(
    data: Any,
    tokenizer: Any = None,
    *,
    max_length: int | None = None,
    batch_size: int | None = None,
    num_samples: int | None = None,
    pack: bool | None = None,
    field: str | None = None,
) -> Any:
    """``data`` as batches: raw text (:func:`is_raw`) becomes a
    :class:`TextData` with the given options (defaults for those left None);
    anything else is returned unchanged, and then no text option may be
    given, since a tokenizer or a ``max_length`` would silently do nothing."""
    options: dict[str, Any] = {
        "max_length": max_length,
        "batch_size": batch_size,
        "num_samples": num_samples,
        "pack": pack,
        "field": field,
    }
    given = [
        name for name, value in [("tokenizer", tokenizer), *options.items()] if value is not None
    ]
    if not is_raw(data):
        if not given:
            return data
        if isinstance(data, (list, tuple)) and not data:
            raise ValueError("data holds no text: give at least one non-blank text")
        one = len(given) == 1
        raise ValueError(
            f"data ({_kind(data)}) is already batches, so {', '.join(given)} "
            f"do{'es' if one else ''} not apply: leave {'it' if one else 'them'} out, "
            f"or pass raw text ({_SOURCES}) to have it tokenized"
        )
    if tokenizer is None:
        raise ValueError(
            "raw text needs a tokenizer: pass tokenizer=... "
            "(e.g. transformers.AutoTokenizer.from_pretrained(path))"
        )
    return TextData(data, tokenizer, **{k: v for k, v in options.items() if v is not None})


class TextData:
    """Raw text as batches of model inputs: re-iterable (every pass tokenizes
    again, lazily, one batch at a time, so memory holds one batch), with
    ``len()`` = number of batches.

    ``source``: a path to a ``.txt`` file (one text per non-empty line), a
    ``.jsonl`` file (one object per line) or a ``.json`` file (a list); a
    list or tuple of strings or of rows; or a datasets-style dataset (one
    split). A row is a dict with a string ``field`` or a ``"messages"`` chat
    list, rendered by ``tokenizer.apply_chat_template``. The texts are read
    once, here (only the first ``num_samples`` when ``pack=False``); with
    ``pack=True`` they are tokenized here too, and the packed ids kept.

    Each batch is ``dict(input_ids=LongTensor[b, t], attention_mask=LongTensor[b, t])``.
    Padding is on the right, with the tokenizer's pad token, else its EOS
    token; the tokenizer itself is never changed.
    """

    def __init__(
        self,
        source: Any,
        tokenizer: Any,
        *,
        max_length: int = 512,
        batch_size: int = 8,
        num_samples: int | None = None,
        pack: bool = False,
        field: str = "text",
    ) -> None:
        params = {
            "tokenizer": tokenizer,
            "max_length": max_length,
            "batch_size": batch_size,
            "num_samples": num_samples,
            "pack": pack,
            "field": field,
        }
        checked = validate(_CONSTRAINTS, params)
        self._tokenizer = tokenizer
        self._max_length: int = checked["max_length"]
        self._batch_size: int = checked["batch_size"]
        self._pack: bool = pack
        self._pad_id = _pad_id(tokenizer, needed=not pack and self._batch_size > 1)
        name, texts = _name(source), _texts(source, tokenizer, field)
        try:
            if pack:
                self._ids = _packed(
                    texts, tokenizer, name, self._max_length, checked["num_samples"]
                )
                self._count = int(self._ids.shape[0])
            else:
                kept = list(itertools.islice(texts, checked["num_samples"]))
                if not kept:
                    raise ValueError(f"{name} holds no text: give at least one non-blank text")
                self._texts = [text for text, _ in kept]
                self._chat = [chat for _, chat in kept]
                self._count = len(kept)
        finally:
            texts.close()  # a file read only in part is closed now

    @property
    def num_samples(self) -> int:
        """Samples (sequences) actually produced: texts, or packed sequences."""
        return self._count

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the texts are read with (what a task evaluation of
        the same model needs)."""
        return self._tokenizer

    def __len__(self) -> int:
        return -(-self._count // self._batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, self._count, self._batch_size):
            stop = min(start + self._batch_size, self._count)
            if self._pack:
                ids = self._ids[start:stop].clone()
                yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            else:
                rows = _encode(
                    self._tokenizer,
                    self._texts[start:stop],
                    self._chat[start:stop],
                    self._max_length,
                )
                yield _padded(rows, self._pad_id)

    def split(self, heldout: float) -> tuple[TextData, TextData]:
        """``(rest, held out)``: the last ``heldout`` fraction of the samples
        (at least one) held out, the rest kept, with no sample in both; the
        held-out part measures quality on text the calibration never saw."""
        check("heldout", heldout, Interval(float, 0, 1, closed="neither"))
        held = max(1, round(self._count * heldout))
        if held >= self._count:
            raise ValueError(
                f"heldout={heldout} of {self._count} sample(s) leaves none for calibration: "
                "give more text or a smaller fraction"
            )
        return self._part(0, self._count - held), self._part(self._count - held, self._count)

    def by_length(self) -> TextData:
        """A copy whose texts come longest first (by characters, a proxy for
        tokens that needs no tokenizing), so that each batch pads to about
        its own length: for held-out measurement, where per-token sums do
        not depend on the order but padding costs forwards. Packed samples
        are all one length and keep their order."""
        if self._pack:
            return self
        order = sorted(range(self._count), key=lambda k: -len(self._texts[k]))
        ordered = copy.copy(self)
        ordered._texts = [self._texts[k] for k in order]
        ordered._chat = [self._chat[k] for k in order]
        return ordered

    def _part(self, start: int, stop: int) -> TextData:
        part = copy.copy(self)
        part._count = stop - start
        if self._pack:
            part._ids = self._ids[start:stop]
        else:
            part._texts, part._chat = self._texts[start:stop], self._chat[start:stop]
        return part

    def __repr__(self) -> str:
        return (
            f"TextData({self._count} samples in {len(self)} batches of up to "
            f"{self._batch_size}, max_length={self._max_length}, pack={self._pack})"
        )


def _kind(value: Any) -> str:
    cls = type(value)
    return f"a {cls.__module__}.{cls.__qualname__}".replace("builtins.", "")


def _name(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return "the dataset" if hasattr(source, "column_names") else f"the {type(source).__name__}"


def _pad_id(tokenizer: Any, *, needed: bool) -> int | None:
    """The id batches are padded with: the pad token, else the EOS token."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    if needed:
        raise ValueError(
            "the tokenizer has neither a pad token nor an EOS token to pad batches with: "
            "give it one (tokenizer.pad_token = an existing token, e.g. its unk token), "
            "or pass batch_size=1 or pack=True, which never pad"
        )
    return None


def _texts(source: Any, tokenizer: Any, field: str) -> Generator[tuple[str, bool], None, None]:
    """``(text, is_chat)`` of every non-blank row of ``source``, lazily."""
    for where, row in _rows(source, field):
        text, chat = _row_text(row, where, field, tokenizer)
        if text.strip():
            yield text, chat


def _rows(source: Any, field: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of every row of ``source``; ``where`` names the row
    in error messages."""
    if isinstance(source, (str, os.PathLike)):
        yield from _file_rows(Path(source))
    elif hasattr(source, "column_names"):
        yield from _dataset_rows(source, field)
    elif isinstance(source, (list, tuple)):
        for index, row in enumerate(source):
            yield f"row {index}", row
    else:
        raise TypeError(f"source must be {_SOURCES}; got {_kind(source)}")


def _dataset_rows(dataset: Any, field: str) -> Iterator[tuple[str, Any]]:
    columns = dataset.column_names
    if isinstance(dataset, Mapping) or isinstance(columns, Mapping):
        splits = ", ".join(repr(k) for k in (columns if isinstance(columns, Mapping) else dataset))
        raise ValueError(
            f"the dataset holds several splits ({splits}): pass one of them, "
            "e.g. ds['train'] for a datasets.DatasetDict ds"
        )
    if columns is not None and field not in columns and "messages" not in columns:
        raise ValueError(
            f"the dataset has no {field!r} or 'messages' column (its columns: "
            f"{list(columns)}): pass field= the column that holds the text"
        )
    if hasattr(dataset, "__iter__"):  # datasets reads rows faster in order than by index
        rows = iter(dataset)
    else:
        rows = (dataset[index] for index in range(len(dataset)))
    for index, row in enumerate(rows):
        yield f"dataset row {index}", row


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise ValueError(
            f"{path} is not a file: pass a path to a .txt, .jsonl or .json file "
            "(a single text goes in a list: [text])"
        )
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            yield from _json_rows(path)
            return
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                line = line.strip()
                if line and suffix == ".jsonl":
                    yield f"{path}:{number}", _json_line(line, path, number)
                elif line:
                    yield f"{path}:{number}", line
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text ({exc.reason}): toast reads .txt, .jsonl and .json files"
        ) from None


def _json_line(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}:{number}: not valid JSON ({exc.msg}); a .jsonl file holds one JSON "
            "object per line"
        ) from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(rows, list):
        raise ValueError(
            f"{path} holds {_kind(rows)}; a .json file must hold a list of texts or of "
            "objects (for one object per line, use .jsonl)"
        )
    for index, row in enumerate(rows):
        yield f"{path}[{index}]", row


def _row_text(row: Any, where: str, field: str, tokenizer: Any) -> tuple[str, bool]:
    """The text of one row and whether it was rendered from a chat."""
    if isinstance(row, str):
        return row, False
    if isinstance(row, Mapping):
        value = row.get(field)
        if isinstance(value, str):
            return value, False
        messages = row.get("messages")
        if isinstance(messages, list):
            return _render(messages, where, tokenizer), True
        keys = ", ".join(repr(k) for k in list(row)[:8])
        raise ValueError(
            f"{where}: the row has no string {field!r} and no 'messages' list (its keys: "
            f"{keys}): pass field= the key that holds the text"
        )
    raise TypeError(
        f"{where}: expected a text or a dict with a string {field!r} or a 'messages' list; "
        f"got {_kind(row)}"
    )


def _render(messages: list, where: str, tokenizer: Any) -> str:
    """One chat, rendered as text by the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where}: chat rows ('messages') need a tokenizer with a chat template, and "
            "this one has none: give a tokenizer with chat_template set (the instruct "
            "model's, or set tokenizer.chat_template), or plain 'text' rows"
        )
    if not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise ValueError(
            f"{where}: 'messages' must be a list of dicts with 'role' and 'content'; "
            f"got {messages!r:.80}"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"{where}: the chat template gave {_kind(text)}, not a text")
    return text


def _encode(
    tokenizer: Any, texts: Sequence[str], chat: Sequence[bool], max_length: int | None
) -> list[list[int]]:
    """Token ids of each text, in order: plain texts with the tokenizer's
    special tokens, chats without (their template wrote them); cut to
    ``max_length`` when given."""
    ids: list[list[int]] = [[] for _ in texts]
    cut: dict[str, Any] = (
        {} if max_length is None else {"truncation": True, "max_length": max_length}
    )
    for rendered in (False, True):
        picked = [i for i, flag in enumerate(chat) if flag == rendered]
        if not picked:
            continue
        out = tokenizer(
            [texts[i] for i in picked], add_special_tokens=not rendered, verbose=False, **cut
        )["input_ids"]
        for i, row in zip(picked, out, strict=True):
            # truncation keeps the special tokens, even past a tiny max_length
            ids[i] = list(row)[:max_length]
    return ids


def _padded(rows: list[list[int]], pad_id: int | None) -> dict[str, torch.Tensor]:
    """Rows right-padded to the longest: ``input_ids`` and ``attention_mask``."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[index, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _packed(
    texts: Iterable[tuple[str, bool]],
    tokenizer: Any,
    name: str,
    max_length: int,
    num_samples: int | None,
) -> torch.Tensor:
    """Every text's ids joined with EOS (not doubled where a text already
    ends or starts with it), cut into rows of ``max_length``; reading stops
    once ``num_samples`` rows are full."""
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = eos if isinstance(eos, int) else None
    need = None if num_samples is None else num_samples * max_length
    stream = array("q")
    seen = 0
    iterator = iter(texts)
    while need is None or len(stream) < need:
        chunk = list(itertools.islice(iterator, _PACK_CHUNK))
        if not chunk:
            break
        seen += len(chunk)
        rows = _encode(tokenizer, [t for t, _ in chunk], [c for _, c in chunk], None)
        for row in rows:
            if stream and eos is not None and stream[-1] != eos and row[:1] != [eos]:
                stream.append(eos)
            stream.extend(row)
    if not seen:
        raise ValueError(f"{name} holds no text: give at least one non-blank text")
    count = len(stream) // max_length
    if num_samples is not None:
        count = min(count, num_samples)
    if count == 0:
        raise ValueError(
            f"{name} holds {len(stream)} tokens, fewer than max_length={max_length}: "
            "lower max_length, give more text, or pass pack=False"
        )
    flat = np.frombuffer(stream, dtype=np.int64)[: count * max_length]
    return torch.from_numpy(flat.reshape(count, max_length).copy())
