"""The on-disk format of a saved compressed model: file names, the plan's
version and required keys, the name patterns the loader trusts, and the
error a damaged save raises."""

from __future__ import annotations

import re

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MODULE_RE",
    "NAME_RE",
    "PATH_RE",
    "PLAN_KEYS",
    "PLAN_NAME",
    "READ_VERSIONS",
    "WEIGHTS_NAME",
    "CorruptedSaveError",
]

FORMAT = "toast.patched_model"
FORMAT_VERSION = 2
#: Plan versions this toast reads (1: before patches, versions and checksums).
READ_VERSIONS = (1, 2)
PLAN_NAME = "toast_plan.json"
WEIGHTS_NAME = "model.safetensors"

PLAN_KEYS = (
    "model_class",
    "config",
    "dtype",
    "blocks_path",
    "layout",
    "modules",
    "buffer_dtypes",
    "weights",
)
MODULE_RE = re.compile(r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)*")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PATH_RE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


class CorruptedSaveError(ValueError):
    """A saved model cannot be loaded: a file is missing, truncated, not
    valid JSON/safetensors, or does not match the plan. The message names
    the file."""
