"""The built-in `calculator` tool: arithmetic read with `ast`, never `eval`, with bounds on size."""

from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_CHARS = 1000
"""Longer expressions are refused (bounds the parse and the nesting depth)."""
MAX_INTEGER_BITS = 4096
"""Integer results beyond this size (about 1233 decimal digits) are refused, before they are computed
for powers: `9**9**9` is refused at once instead of taking minutes and gigabytes."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _Refused(ValueError):
    """The expression is not plain arithmetic, or its result would be too large."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2 ** 3".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree.body)
    except SyntaxError:
        return f"Error: not an arithmetic expression: {expression!r}"
    except ZeroDivisionError:
        return "Error: division by zero"
    except OverflowError:
        return "Error: the result is too large"
    except RecursionError:
        return "Error: the expression is nested too deeply"
    except _Refused as error:
        return f"Error: {error}"
    return repr(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative number to a fractional power
            raise _Refused("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
            raise _Refused(f"the result has more than {MAX_INTEGER_BITS} bits")
        return value
    raise _Refused(f"{ast.unparse(node)!r} is not allowed; use numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse an integer power whose result would exceed MAX_INTEGER_BITS (floats overflow by themselves)."""
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and abs(base) > 1
        and exponent > 0
        and (abs(base).bit_length() - 1) * exponent > MAX_INTEGER_BITS
    ):
        raise _Refused(f"the result has more than {MAX_INTEGER_BITS} bits")
