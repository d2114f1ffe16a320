"""The calculator reads arithmetic with ast (never eval), refuses huge results at once, and answers errors as text."""

import time

import pytest

from megarl.tools.builtin.calculator import MAX_INTEGER_BITS, calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),
        ("--3", "3"),
        ("+1.5e3 - 0.5", "1499.5"),
        ("2 ** -1", "0.5"),
        (" 10 ** 300 // 10 ** 299 ", "10"),
    ],
)
def test_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "Error: division by zero"),
        ("5 % 0", "Error: division by zero"),
        ("2 +", "Error: not an arithmetic expression: '2 +'"),
        ("__import__('os').system('true')", "Error: \"__import__('os').system('true')\" is not allowed; use numbers"),
        ("abs(-1)", "Error: 'abs(-1)' is not allowed"),
        ("x + 1", "Error: 'x' is not allowed"),
        ("'a' * 3", "Error: \"'a'\" is not allowed"),
        ("True + 1", "Error: 'True' is not allowed"),
        ("(-8) ** 0.5", "Error: the result is not a real number"),
        ("10.0 ** 400", "Error: the result is too large"),
        ("1" * 1001, "Error: the expression is longer than 1000 characters"),
    ],
)
def test_what_is_not_arithmetic_or_fails_is_a_clear_message(expression, message):
    assert calculator(expression).startswith(message)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "2 ** 5000", "(10 ** 1000) ** 5", "2 ** 4000 * 2 ** 4000"])
def test_huge_integers_are_refused_without_being_computed(expression):
    start = time.process_time()
    assert calculator(expression) == f"Error: the result has more than {MAX_INTEGER_BITS} bits"
    assert time.process_time() - start < 1.0


def test_the_largest_allowed_power_is_computed():
    assert calculator(f"2 ** {MAX_INTEGER_BITS - 1}") == str(2 ** (MAX_INTEGER_BITS - 1))
