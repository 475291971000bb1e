"""A character-level tokenizer built offline (one token per character of
an alphabet, plus pad/bos/eos/unk), for the tests that need a real
``transformers`` tokenizer and cannot download one."""

from __future__ import annotations

import pytest


def char_tokenizer(chars: str):
    """A fast tokenizer with ids 0-3 for ``<pad> <s> </s> <unk>`` and one id
    per distinct character of ``chars`` (sorted), every other character
    ``<unk>``."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(sorted(set(chars)))})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
