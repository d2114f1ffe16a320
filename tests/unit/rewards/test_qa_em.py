"""Search-R1's exact-match QA reward: the last <answer> tag, SQuAD normalisation, a list of references."""

from megarl.rewards.functions import resolve_reward_function
from megarl.rewards.qa_em import normalize_answer, qa_em_score


def test_normalisation_drops_case_punctuation_articles_and_spacing():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"


def test_the_last_answer_tag_counts_against_any_reference():
    assert qa_em_score("<answer>Paris</answer>", ["paris", "Paris, France"]) == 1.0
    assert qa_em_score("<answer>London</answer> no, <answer>the Paris</answer>", "Paris") == 1.0
    assert qa_em_score("<answer>Paris</answer> then <answer>Rome</answer>", "Paris") == 0.0
    assert qa_em_score("Paris", "Paris") == 0.0  # no tag
    assert qa_em_score("<answer>Paris city</answer>", "Paris") == 0.0


def test_it_resolves_as_a_builtin():
    reward = resolve_reward_function("qa_em")
    assert reward(["q", "q"], ["<answer>1969</answer>", "<answer>1970</answer>"], answer=[["1969"], "1969"]) == [
        1.0,
        0.0,
    ]
