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
import sys
from pathlib import Path
from typing import Any

from toast._validation import Options
from toast.hf.data.calibration import COMPUTE_DTYPES, Calibration

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_STATUSES",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "HELDOUT_HELP",
    "add_output_arguments",
    "quiet_libraries",
    "report_warnings",
    "heldout_value",
    "add_calibration_arguments",
    "add_config_arguments",
    "add_memory_arguments",
    "calibration_from_args",
    "config_fields",
    "config_values",
    "forced_path",
]


EXIT_USAGE = 2  # a bad command line, path, option or input: nothing was loaded or written
EXIT_FAILED = 1  # the run itself failed (the model's forward, a missing optional package)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15, after the same clean-up as Ctrl-C
EXIT_STATUSES = (
    "Exit status: 0 done; 1 the run failed (the message says why); 2 a bad command line, "
    "path, option or input (checked before anything loads); 130 interrupted by Ctrl-C; "
    "143 stopped by SIGTERM. On any failure no output folder and no temporary file is left "
    "behind."
)

HELDOUT_HELP = (
    "held-out data, read like --data, or a fraction such as 0.1 of --data's texts held "
    "out (the last ones; calibration uses the rest): the report states measured quality "
    "(for LLMs perplexity, KL to the original and top-1 agreement) of the original model, "
    "plain removal of the same blocks and the compressed model"
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


_SCALARS = {"int": int, "float": float, "str": str}


def _value_type(field: dataclasses.Field) -> Any:
    """The type a command line gives ``field``: ``bool`` for a flag, ``int``,
    ``float`` or ``str`` from its default or (for a None default) the first
    member of its annotation; None for a field no command line can give (a
    list, a mapping, a callable, a nested config)."""
    default = field.default
    if default is dataclasses.MISSING:  # a default factory: a nested config, a list
        return None
    if isinstance(default, (bool, int, float, str)):
        return type(default)
    if default is not None:
        return None
    first = str(field.type).split("|")[0].strip()
    if first.startswith("Literal["):
        return str
    return _SCALARS.get(first)


def config_fields(config: type) -> list[str]:
    """The fields of ``config`` a command line can give (see :func:`_value_type`),
    then the other names of those fields (the config's ``ALIASES``)."""
    names = [f.name for f in dataclasses.fields(config) if _value_type(f) is not None]
    aliases = getattr(config, "ALIASES", {})
    return names + [alias for alias, name in aliases.items() if name in names]


def _size(text: str) -> int:
    """A byte count from ``"8GiB"``, ``"512M"`` or ``"1000000"`` (or ``"auto"``)."""
    from toast.hf.capture.budget import parse_size

    if text == "auto":
        return text  # type: ignore[return-value]  # the field's own default rule
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_config_arguments(
    parser: argparse._ActionsContainer,
    config: type,
    names: list[str],
    helps: dict[str, str] | None = None,
) -> None:
    """Adds ``--name`` options for the named fields of ``config`` (a field
    named ``*_bytes`` takes a size such as ``8GiB``), and for the named other
    names of its fields (its ``ALIASES``): an option of its own, unset by
    default, that the config merges into its field (both given with
    different values is the config's error). Each option's help is
    ``helps[name]``, by default the config's own ``HELP`` (a name without
    one shows its name, default and allowed values)."""
    helps = getattr(config, "HELP", {}) if helps is None else helps
    fields = {f.name: f for f in dataclasses.fields(config)}
    aliases = getattr(config, "ALIASES", {})
    constraints = getattr(config, "_parameter_constraints", {})
    for name in names:
        if name in aliases:
            field = fields[aliases[name]]
            help_text = helps.get(name, f"same as {_flag(aliases[name])}")
            parser.add_argument(
                _flag(name), dest=name, type=_value_type(field), default=None, help=help_text
            )
            continue
        field = fields[name]
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = helps.get(name, name.replace("_", " "))
        if isinstance(default, bool):
            # a field that is on by default is turned off by --no-NAME
            flag = _flag(("no_" if default else "") + name)
            parser.add_argument(
                flag, dest=name, action="store_false" if default else "store_true", help=help_text
            )
            continue
        shown = f" (default {default})" if default is not None else ""
        if name.endswith("_bytes"):
            # a size or its word ("auto"): _size checks both, where choices
            # would refuse every size
            parser.add_argument(
                _flag(name), dest=name, type=_size, default=default, metavar="SIZE",
                help=help_text + shown,
            )  # fmt: skip
            continue
        choices = next(
            (list(c.values) for c in constraints.get(name, []) if isinstance(c, Options)), None
        )
        parser.add_argument(
            _flag(name),
            dest=name,
            type=_value_type(field),
            default=default,
            choices=choices,
            help=help_text + shown,
        )


def config_values(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The named options' values, as config keyword arguments."""
    return {name: getattr(args, name) for name in names}


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--overwrite`` and ``--quiet``: one policy for every command."""
    parser.add_argument(
        "--out", required=True, help="output folder: new, empty, or with --overwrite replaced"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out that a toast command wrote (never other folders)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print only the result: no progress, no warnings"
    )


def add_memory_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--max-memory`` and ``--path``: whether a model folder is loaded or
    calibrated block by block from disk (:func:`toast.compress` on a folder)."""
    parser.add_argument(
        "--max-memory",
        default=None,
        help="memory budget (e.g. 64GiB; default: what the machine has available): a model "
        f"folder that does not fit with its run (statistics, a batch's forward and logits) "
        f"is calibrated block by block from disk and {what} "
        "without loading it",
    )
    parser.add_argument(
        "--path",
        dest="memory_path",
        default="auto",
        choices=["auto", "memory", "disk"],
        help="force the in-memory or the block-by-block path (auto: by --max-memory)",
    )


def forced_path(args: argparse.Namespace) -> bool | None:
    """``--path`` as :func:`toast.compress`'s ``sequential``: None lets the budget decide."""
    return {"auto": None, "memory": False, "disk": True}[args.memory_path]


def add_calibration_arguments(
    parser: argparse.ArgumentParser, max_samples: int | None, blocks_flag: bool = False
) -> None:
    """The calibration options every data-reading subcommand shares (``blocks_flag``:
    ``--blocks`` is also a name of ``--block-list``, where it names nothing else)."""
    group = parser.add_argument_group("calibration")
    shown = "all" if max_samples is None else str(max_samples)
    group.add_argument(
        "--max-samples", type=int, default=max_samples, help=f"calibration samples ({shown})"
    )
    group.add_argument("--max-batches", type=int, default=None, help="calibration batches (all)")
    group.add_argument("--seed", type=int, default=0, help="seed of every sampled draw (0)")
    names = ["--block-list", "--blocks"] if blocks_flag else ["--block-list"]
    group.add_argument(
        *names,
        dest="blocks",
        default=None,
        help="dotted path of the block list, when discovery is ambiguous (found)",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="hide progress bars, transformers' included"
    )
    group.add_argument(
        "--compute-dtype",
        choices=COMPUTE_DTYPES,
        default="auto",
        help="what the forwards compute in (auto: a 16-bit checkpoint's own dtype where this "
        "machine's matmuls in it are faster than float32's, else float32; bfloat16: also a "
        "float32 model's forwards, under autocast; statistics stay float64)",
    )


def calibration_from_args(args: argparse.Namespace) -> Calibration:
    """The :class:`Calibration` the shared options describe."""
    return Calibration(
        max_samples=args.max_samples,
        max_batches=args.max_batches,
        seed=args.seed,
        blocks=args.blocks,
        progress=not args.no_progress,
        compute_dtype=args.compute_dtype,
    )


def quiet_libraries(progress: bool, quiet: bool = False) -> None:
    """Silences transformers' (and the Hub's) loading bars without ``progress``
    or when stderr is not a terminal (a log file or a pipe would get their
    carriage-return frames; toast's own progress prints plain lines there),
    and its log messages too when ``quiet``."""
    import os
    import sys

    if progress and not quiet and sys.stderr.isatty():
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if quiet:
        transformers.utils.logging.set_verbosity_error()


def report_warnings(caught: list, quiet: bool) -> None:
    """Each distinct warning of a run once on stderr (none when ``quiet``)."""

    if quiet:
        return
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"warning: {message}", file=sys.stderr)
