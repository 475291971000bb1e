"""Translators as torch modules: the trained MLP kinds, their JSON specs,
their training, and the block that stands in for a replaced span."""

from toast.translators.block import TranslatorBlock, translator_module
from toast.translators.modules import (
    DiagonalMap,
    MLPTranslator,
    ResMLPTranslator,
    build_translator,
    translator_spec,
)
from toast.translators.training import train_translator

__all__ = [
    "DiagonalMap",
    "MLPTranslator",
    "ResMLPTranslator",
    "TranslatorBlock",
    "build_translator",
    "train_translator",
    "translator_module",
    "translator_spec",
]
