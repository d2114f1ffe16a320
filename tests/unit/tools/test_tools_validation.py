"""tool_problems reports every mistake of rollout.multi_turn at once, by key, without importing any tool module."""

import sys

from megarl.config.rollout import MultiTurnConfig, SearchConfig, ToolConfig
from megarl.tools.validation import tool_problems


def problems_by_key(multi_turn: MultiTurnConfig, check_files: bool = True) -> dict[str, str]:
    return {problem.key: str(problem) for problem in tool_problems(multi_turn, check_files)}


def test_a_good_section_has_no_problem(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"contents": "a"}\n')
    multi_turn = MultiTurnConfig(
        enable=True,
        tools=(ToolConfig("search"), ToolConfig("calculator"), ToolConfig("python"), ToolConfig("tools_testing:echo")),
        search=SearchConfig(corpus=str(corpus)),
    )
    assert tool_problems(multi_turn) == []
    assert tool_problems(MultiTurnConfig()) == []  # off, no tools


def test_every_problem_is_reported_at_once_by_key():
    multi_turn = MultiTurnConfig(
        enable=True,
        max_turns=0,
        max_total_tokens=0,
        log_freq=-1,
        straggler_wait_s=-1.0,
        max_observation_tokens=0,
        tools=(
            ToolConfig("calculator", timeout_s=0),
            ToolConfig("web_search"),
            ToolConfig("no_such_pkg_xyz.tools:get"),
            ToolConfig("tools_testing:missing"),
            ToolConfig("tools_testing:calculator"),
            ToolConfig("calculator"),
        ),
    )
    found = problems_by_key(multi_turn)
    assert set(found) == {
        "rollout.multi_turn.max_turns",
        "rollout.multi_turn.max_total_tokens",
        "rollout.multi_turn.log_freq",
        "rollout.multi_turn.straggler_wait_s",
        "rollout.multi_turn.max_observation_tokens",
        "rollout.multi_turn.tools[0].timeout_s",
        "rollout.multi_turn.tools[1].function",
        "rollout.multi_turn.tools[2].function",
        "rollout.multi_turn.tools[3].function",
        "rollout.multi_turn.tools[4].function",
        "rollout.multi_turn.tools[5].function",
    }
    assert found["rollout.multi_turn.tools[1].function"] == (
        "rollout.multi_turn.tools[1].function = 'web_search': neither a built-in tool nor `pkg.module:function`; "
        "fix: use one of search, calculator, python or a function path like my_tools.web:fetch_page"
    )
    assert "module no_such_pkg_xyz.tools cannot be imported" in found["rollout.multi_turn.tools[2].function"]
    assert (
        "defines no top-level missing; fix: define `def missing(argument: str, ...) -> str"
        in found["rollout.multi_turn.tools[3].function"]
    )
    assert found["rollout.multi_turn.tools[4].function"].startswith(
        "rollout.multi_turn.tools[4].function = 'tools_testing:calculator': tools[0] ('calculator') is also named "
        "'calculator', and the model calls tools by name"
    )
    assert "tools[0] ('calculator') is also named" in found["rollout.multi_turn.tools[5].function"]


def test_nothing_of_the_tools_is_imported(tmp_path, monkeypatch):
    (tmp_path / "exploding_tools.py").write_text(
        "raise SystemExit('imported')\n\ndef fetch(url: str) -> str:\n    ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tool_problems(MultiTurnConfig(enable=True, tools=(ToolConfig("exploding_tools:fetch"),))) == []
    assert "exploding_tools" not in sys.modules


def test_search_needs_exactly_one_source_and_a_positive_top_k(tmp_path):
    search = (ToolConfig("search"),)
    neither = problems_by_key(MultiTurnConfig(enable=True, tools=search, search=SearchConfig(top_k=0)))
    assert set(neither) == {"rollout.multi_turn.search.corpus", "rollout.multi_turn.search.top_k"}
    assert (
        "exactly one of search.corpus" in neither["rollout.multi_turn.search.corpus"]
        and "neither is set" in neither["rollout.multi_turn.search.corpus"]
    )
    both = problems_by_key(
        MultiTurnConfig(
            enable=True,
            tools=search,
            search=SearchConfig(corpus=str(tmp_path / "missing.jsonl"), retriever_url="http://127.0.0.1:8000/retrieve"),
        )
    )
    assert "both are set" in both["rollout.multi_turn.search.corpus"]
    missing = tool_problems(
        MultiTurnConfig(enable=True, tools=search, search=SearchConfig(corpus=str(tmp_path / "missing.jsonl")))
    )
    assert [(problem.key, problem.why) for problem in missing] == [
        ("rollout.multi_turn.search.corpus", "file does not exist")
    ]
    assert (
        tool_problems(
            MultiTurnConfig(enable=True, tools=search, search=SearchConfig(corpus=str(tmp_path / "missing.jsonl"))),
            check_files=False,
        )
        == []
    )
    url = problems_by_key(
        MultiTurnConfig(enable=True, tools=search, search=SearchConfig(retriever_url="localhost:8000"))
    )
    assert set(url) == {"rollout.multi_turn.search.retriever_url"}


def test_search_settings_are_not_checked_without_the_search_tool():
    assert (
        tool_problems(MultiTurnConfig(enable=True, tools=(ToolConfig("calculator"),), search=SearchConfig(top_k=0)))
        == []
    )


def test_multi_turn_on_without_tools_is_a_problem():
    assert [problem.key for problem in tool_problems(MultiTurnConfig(enable=True))] == ["rollout.multi_turn.tools"]
