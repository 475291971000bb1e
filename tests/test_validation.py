"""toast._validation: one message format, every constraint kind."""

import numpy as np
import pytest

from toast._validation import (
    Interval,
    InvalidParameterError,
    Options,
    Predicate,
    check,
    merge_alias,
    validate,
    validate_params,
)


def test_an_accepted_value_is_returned_and_numpy_ints_become_ints():
    value = check("k", np.int64(3), Interval(int, 1, None))
    assert value == 3 and type(value) is int


@pytest.mark.parametrize(
    "value,constraints,message",
    [
        (0, [Interval(int, 1, None)], "k must be an int in [1, inf); got 0"),
        (1.5, [Interval(int, 1, None), None], "k must be an int in [1, inf) or None; got 1.5"),
        (True, [Interval(int, 0, 5)], "k must be an int in [0, 5]; got True"),
        (float("nan"), [Interval(float, 0, 1)], "k must be a number in [0, 1]; got nan"),
        (1.0, [Interval(float, 0, 1, closed="left")], "k must be a number in [0, 1); got 1.0"),
        ("x", [Options(("a", "b"))], "k must be one of 'a', 'b'; got 'x'"),
        (3, [str], "k must be a str; got 3"),
        (-1, [Predicate(lambda v: v > 0, "positive")], "k must be positive; got -1"),
    ],
)
def test_a_refused_value_names_the_parameter_what_is_allowed_and_what_was_given(
    value, constraints, message
):
    with pytest.raises(InvalidParameterError) as info:
        check("k", value, *constraints)
    assert str(info.value) == message


def test_invalid_parameter_error_is_both_a_value_and_a_type_error():
    with pytest.raises(ValueError):
        check("k", "x", int)
    with pytest.raises(TypeError):
        check("k", "x", int)


def test_options_do_not_confuse_booleans_with_integers():
    assert check("k", 1, Options((0, 1))) == 1
    with pytest.raises(InvalidParameterError):
        check("k", True, Options((0, 1)))


def test_options_compare_safely_with_arrays():
    with pytest.raises(InvalidParameterError):
        check("k", np.zeros(3), Options(("a",)))


def test_validate_checks_only_the_named_parameters():
    out = validate({"a": [Interval(int, 0, None)]}, {"a": np.int32(2), "b": object})
    assert out["a"] == 2 and type(out["a"]) is int and out["b"] is object
    with pytest.raises(InvalidParameterError, match="a must be"):
        validate({"a": [Interval(int, 0, None)]}, {"a": -1})


def test_validate_params_checks_every_call_before_the_body_runs():
    calls = []

    @validate_params({"n": [Interval(int, 1, None)]})
    def f(n, other=None):
        calls.append(n)
        return n

    assert f(2) == 2 and f(n=3) == 3
    with pytest.raises(InvalidParameterError, match="n must be an int in"):
        f(0)
    assert calls == [2, 3]


def test_validate_params_refuses_a_table_naming_no_parameter():
    with pytest.raises(TypeError, match="has no parameters"):

        @validate_params({"missing": [int]})
        def f(n):
            return n


def test_a_refused_object_is_named_by_its_type_not_printed_whole():
    with pytest.raises(InvalidParameterError) as info:
        check("model", np.zeros((1000, 1000)), str)
    assert str(info.value) == "model must be a str; got a numpy.ndarray"


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(512, "512 B"), (3584, "3.5 KiB"), (80 * 2**20, "80.0 MiB"), (1.25 * 2**30, "1.25 GiB")],
)
def test_format_size_writes_what_parse_size_reads_back(nbytes, text):
    from toast._validation import format_size, parse_size

    assert format_size(nbytes) == text
    assert parse_size(text.replace(" ", "")) == pytest.approx(nbytes, rel=0.01)


@pytest.mark.parametrize(
    ("value", "given", "expected"), [(3, None, 3), (None, 3, 3), (3, 3, 3), (None, None, None)]
)
def test_merge_alias_takes_whichever_name_was_given(value, given, expected):
    assert merge_alias("num_blocks", value, "budget", given) == expected


def test_merge_alias_refuses_two_different_values_naming_both():
    with pytest.raises(InvalidParameterError, match="num_blocks=2 and budget=3 differ"):
        merge_alias("num_blocks", 2, "budget", 3)
