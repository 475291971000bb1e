"""Command-line options built from the configs they fill.

A subcommand names the fields of a method's config dataclass it exposes;
:func:`add_config_arguments` turns each into ``--field-name`` with the
field's default, a type from that default (or its annotation) and, for a
field constrained to a set of values, argparse ``choices`` taken from the
config's declarative constraints. :func:`config_values` reads them back.
The calibration options are one shared group (:func:`add_calibration_arguments`).
The help text, defaults and allowed values thus live with the config and
cannot drift from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from toast._validation import Options
from toast.hf.calibration import Calibration

__all__ = [
    "HELDOUT_HELP",
    "heldout_value",
    "add_calibration_arguments",
    "add_config_arguments",
    "calibration_from_args",
    "config_values",
]


HELDOUT_HELP = (
    "held-out data, read like --data, or a fraction such as 0.1 of --data's texts held "
    "out (the last ones; calibration uses the rest): the report states measured quality "
    "of the original model, plain removal of the same blocks and the compressed model"
)


def heldout_value(value: str) -> str | float:
    """``--heldout``: a fraction in (0, 1) of the calibration texts, or a path."""
    try:
        fraction = float(value)
    except ValueError:
        return value
    if 0 < fraction < 1 and not Path(value).exists():
        return fraction
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(field: dataclasses.Field, default: Any) -> Any:
    if isinstance(default, bool):
        return None
    if isinstance(default, (int, float, str)):
        return type(default)
    annotation = str(field.type)
    if "float" in annotation:
        return float
    if "int" in annotation:
        return int
    return str


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config: type,
    names: list[str],
    helps: dict[str, str] | None = None,
) -> None:
    """Adds ``--name`` options for the named fields of ``config``."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    constraints = getattr(config, "_parameter_constraints", {})
    for name in names:
        field = fields[name]
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = (helps or {}).get(name, name.replace("_", " "))
        if isinstance(default, bool):
            parser.add_argument(_flag(name), action="store_true", help=help_text)
            continue
        choices = next(
            (list(c.values) for c in constraints.get(name, []) if isinstance(c, Options)), None
        )
        shown = f" (default {default})" if default is not None else ""
        parser.add_argument(
            _flag(name),
            dest=name,
            type=_value_type(field, default),
            default=default,
            choices=choices,
            help=help_text + shown,
        )


def config_values(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The named options' values, as config keyword arguments."""
    return {name: getattr(args, name) for name in names}


def add_calibration_arguments(parser: argparse.ArgumentParser, max_samples: int | None) -> None:
    """The calibration options every data-reading subcommand shares."""
    group = parser.add_argument_group("calibration")
    shown = "all" if max_samples is None else str(max_samples)
    group.add_argument(
        "--max-samples", type=int, default=max_samples, help=f"calibration samples ({shown})"
    )
    group.add_argument("--max-batches", type=int, default=None, help="calibration batches (all)")
    group.add_argument("--seed", type=int, default=0, help="seed of every sampled draw (0)")
    group.add_argument(
        "--block-list",
        dest="blocks",
        default=None,
        help="dotted path of the block list, when discovery is ambiguous (found)",
    )
    group.add_argument("--no-progress", action="store_true", help="hide progress bars")


def calibration_from_args(args: argparse.Namespace) -> Calibration:
    """The :class:`Calibration` the shared options describe."""
    return Calibration(
        max_samples=args.max_samples,
        max_batches=args.max_batches,
        seed=args.seed,
        blocks=args.blocks,
        progress=not args.no_progress,
    )
