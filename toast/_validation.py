"""Declarative parameter checks with one message format.

A parameter's constraints are a list; the value must satisfy at least one.
A constraint is an :class:`Interval` (a real or integer range), an
:class:`Options` (a closed set of values), a type (``str``, ``bool``,
``np.ndarray``...), ``None`` (the value may be None) or a
:class:`Predicate`. A value that satisfies none raises
:class:`InvalidParameterError` with the message

    ``{name} must be {constraint} or {constraint}; got {value!r}``

so every check in the package reads the same. Use :func:`check` for one
value, :func:`validate` for a mapping of them (a config's fields) and
:func:`validate_params` to decorate a function. :func:`parse_size` reads a
size (``8GiB``) given as text.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = [
    "Interval",
    "InvalidParameterError",
    "Options",
    "Predicate",
    "check",
    "format_size",
    "merge_alias",
    "parse_size",
    "validate",
    "validate_params",
]

F = TypeVar("F", bound=Callable[..., Any])

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int) -> int:
    """``"8GiB"``, ``"512M"``, ``"1000000"`` or an int → bytes (powers of 1024)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 8GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_size(nbytes: float) -> str:
    """Bytes for a person, in the units :func:`parse_size` reads: ``512 B``,
    ``3.5 KiB``, ``80.0 MiB``, ``1.25 GiB``."""
    if nbytes < 2**10:
        return f"{nbytes:.0f} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if nbytes < 1024 * scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2**30:,.2f} GiB"


class InvalidParameterError(ValueError, TypeError):
    """A parameter has a value none of its constraints allow.

    A subclass of both ``ValueError`` and ``TypeError``: an out-of-range
    number and a value of the wrong type are the same mistake here.
    """


@dataclass(frozen=True)
class Interval:
    """Numbers in a range: ``Interval(int, 1, None)`` is an int >= 1.

    ``kind`` is ``int`` (integers only, bools refused) or ``float`` (any real,
    NaN refused); ``closed`` says which ends belong to the range.
    """

    kind: type
    left: float | None = None
    right: float | None = None
    closed: Literal["both", "left", "right", "neither"] = "both"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.kind is int and not isinstance(value, numbers.Integral):
            return False
        number = float(value)
        if math.isnan(number):
            return False
        left_ok = self.left is None or (
            number >= self.left if self.closed in ("both", "left") else number > self.left
        )
        right_ok = self.right is None or (
            number <= self.right if self.closed in ("both", "right") else number < self.right
        )
        return left_ok and right_ok

    def __str__(self) -> str:
        noun = "an int" if self.kind is int else "a number"
        if self.left is None and self.right is None:
            return noun if self.kind is int else "a finite number"
        lo = "-inf" if self.left is None else _short(self.left)
        hi = "inf" if self.right is None else _short(self.right)
        opening = "[" if self.closed in ("both", "left") and self.left is not None else "("
        closing = "]" if self.closed in ("both", "right") and self.right is not None else ")"
        return f"{noun} in {opening}{lo}, {hi}{closing}"


@dataclass(frozen=True)
class Options:
    """One of a closed set of values (compared with ``==``)."""

    values: tuple[Any, ...]

    def __init__(self, values: Iterable[Any]) -> None:
        object.__setattr__(self, "values", tuple(values))

    def accepts(self, value: Any) -> bool:
        try:
            return any(_same_kind(value, v) and value == v for v in self.values)
        except (TypeError, ValueError):  # e.g. an array compared with a string
            return False

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)


@dataclass(frozen=True)
class Predicate:
    """Any value ``test`` accepts, described by ``text`` in messages."""

    test: Callable[[Any], bool]
    text: str

    def accepts(self, value: Any) -> bool:
        return bool(self.test(value))

    def __str__(self) -> str:
        return self.text


Constraint = Interval | Options | Predicate | type | None


def _same_kind(value: Any, option: Any) -> bool:
    # True == 1 in Python; an option list of ints must not take a bool.
    if isinstance(value, bool) != isinstance(option, bool):
        return False
    return isinstance(value, type(option)) or isinstance(option, type(value))


def _short(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


_PLAIN = (str, bytes, numbers.Number, type(None))


def _shown(value: Any) -> str:
    # Plain values are shown as written; anything else (a model, an array)
    # by its type, so that a message never prints a whole object.
    plain = isinstance(value, _PLAIN) or (
        isinstance(value, (tuple, list))
        and len(value) <= 8
        and all(isinstance(v, _PLAIN) for v in value)
    )
    if plain:
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def _describe(constraint: Constraint) -> str:
    if constraint is None:
        return "None"
    if isinstance(constraint, type):
        return f"a {constraint.__name__}"
    return str(constraint)


def _accepts(constraint: Constraint, value: Any) -> bool:
    if constraint is None:
        return value is None
    if isinstance(constraint, type):
        if constraint is int:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if constraint is float:
            return isinstance(value, numbers.Real) and not isinstance(value, bool)
        return isinstance(value, constraint)
    return constraint.accepts(value)


def check(name: str, value: Any, *constraints: Constraint) -> Any:
    """``value`` if it satisfies one of ``constraints``; else raises
    :class:`InvalidParameterError` naming ``name``, what is allowed, and
    what was given. Integral values of an int constraint come back as
    ``int`` (a NumPy integer becomes a Python one)."""
    for constraint in constraints:
        if _accepts(constraint, value):
            if isinstance(constraint, Interval) and constraint.kind is int:
                return int(value)
            return value
    allowed = " or ".join(_describe(c) for c in constraints)
    raise InvalidParameterError(f"{name} must be {allowed}; got {_shown(value)}")


def validate(
    constraints: Mapping[str, Sequence[Constraint]], params: Mapping[str, Any]
) -> dict[str, Any]:
    """Checks every parameter of ``params`` named in ``constraints``;
    returns the checked values (ints normalised as :func:`check` does)."""
    return {
        name: check(name, value, *constraints[name]) if name in constraints else value
        for name, value in params.items()
    }


def merge_alias(name: str, value: Any, alias: str, given: Any) -> Any:
    """The value of parameter ``name``, which is also accepted as ``alias``
    (another name for it, such as a paper's): ``given`` when only the alias
    was given (None: not given), else ``value``. Both given with different
    values raise :class:`InvalidParameterError` naming both."""
    if given is None:
        return value
    if value is not None and value != given:
        raise InvalidParameterError(
            f"{name}={_shown(value)} and {alias}={_shown(given)} differ: {alias} is another "
            f"name for {name}; give one of them"
        )
    return given


def validate_fields(
    obj: Any,
    constraints: Mapping[str, Sequence[Constraint]],
    aliases: Mapping[str, Any] | None = None,
) -> None:
    """Checks every field of the frozen dataclass ``obj`` named in
    ``constraints`` and stores the checked values: the first step of every
    config's ``__post_init__``. ``aliases`` are the values given under
    another name of a field (init-only arguments; the config's ``ALIASES``
    maps each to its field): each is checked under the name it was given by
    its field's constraints and stored in the field (:func:`merge_alias`)."""
    for alias, given in (aliases or {}).items():
        name = type(obj).ALIASES[alias]
        given = check(alias, given, *constraints[name])
        object.__setattr__(obj, name, merge_alias(name, getattr(obj, name), alias, given))
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    for name, value in validate(constraints, fields).items():
        object.__setattr__(obj, name, value)


def validate_params(constraints: Mapping[str, Sequence[Constraint]]) -> Callable[[F], F]:
    """Decorator: checks the named arguments of every call against
    ``constraints`` before the function runs."""

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        unknown = set(constraints) - set(signature.parameters)
        if unknown:  # a typo in the table would silently check nothing
            raise TypeError(f"{func.__qualname__} has no parameters {sorted(unknown)}")

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                if name in constraints:
                    check(name, value, *constraints[name])
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
