"""The rule rewards on hand-written responses: GSM8K `#### N` and MATH `\\boxed{}` with math-verify."""

import pytest

from megarl.rewards.boxed import last_boxed
from megarl.rewards.gsm8k import extract_final_answer, gsm8k_reward, gsm8k_score
from megarl.rewards.math_answer import math_reward, math_score


@pytest.mark.parametrize(
    "response, answer, score",
    [
        ("3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("Total: 1,000 dollars\n#### 1,000", "1000", 1.0),  # thousands separator
        ("#### $18", "18", 1.0),  # currency sign
        ("#### 72.0", "Natalia sold 48/2 = 24 clips.\n48+24 = 72\n#### 72", 1.0),  # full solution as reference
        ("first #### 5, corrected: #### 6", "6", 1.0),  # the last one counts
        ("#### -3", "-3", 1.0),
        ("#### 8", "7", 0.0),  # wrong
        ("The answer is 7.", "7", 0.0),  # no #### format
        ("#### seven", "7", 0.0),  # malformed
        ("#### 1.2.3", "1", 0.0),  # not a number
    ],
)
def test_gsm8k_score(response, answer, score):
    assert gsm8k_score(response, answer) == score


def test_gsm8k_extraction_and_batch_form():
    assert extract_final_answer("so #### 1,234.") == "1234"
    assert extract_final_answer("no answer here") is None
    assert gsm8k_reward(["q", "q"], ["#### 4", "#### 5"], answer=["4", 4]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "response, answer, score",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),  # equivalent forms
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{\sqrt2}{2}}", r"\sqrt{2}/2", 1.0),
        (r"\boxed{1+x^2}", r"x^2+1", 1.0),
        (r"\boxed{3}", r"Hence the total is \boxed{3}.", 1.0),  # full solution as reference
        (r"\boxed{2} then \boxed{3}", "3", 1.0),  # the last box counts
        (r"\boxed 5", "5", 1.0),
        (r"\boxed{\text{Monday}}", r"\text{Monday}", 1.0),  # text answers compare as text
        (r"\boxed{4}", "3", 0.0),  # wrong
        ("the answer is 0.5", "0.5", 0.0),  # no box
        (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # cut off inside the box
    ],
)
def test_math_score(response, answer, score):
    assert math_score(response, answer) == score


def test_boxed_extraction_and_batch_form():
    assert last_boxed(r"\boxed{\frac{a}{b}} and \fbox{x}") == "x"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed("nothing") is None
    assert math_reward(["q", "q"], [r"\boxed{2}", r"\boxed{3}"], answer=["2", "2"]) == [1.0, 0.0]
