"""Checks of `rollout.multi_turn` that run nothing: no tool module is imported, no process started.

`tool_problems(config.rollout.multi_turn)` is what `megarl validate` (and the trainer, before
anything starts) reports for this section. Whether each tool really resolves and has a schema is
only known by importing it, which `ToolSet.wait_ready` does in an isolated worker.
"""

from __future__ import annotations

import os

from megarl.config.problems import Problem, non_ascii_note
from megarl.config.resources import function_problem, local_path, unusable_path
from megarl.config.rollout import MultiTurnConfig
from megarl.tools.builtin import BUILTIN_TOOLS

KEY = "rollout.multi_turn"


def tool_problems(multi_turn: MultiTurnConfig, check_files: bool = True) -> list[Problem]:
    """Every problem of the `rollout.multi_turn` section. check_files: whether the search corpus
    must exist on this machine (off for `validate --no-file-checks`)."""
    problems: list[Problem] = []

    def need(ok: bool, key: str, value, why: str, fix: str) -> None:
        if not ok:
            problems.append(Problem(f"{KEY}.{key}", value, why, fix))

    need(multi_turn.max_turns >= 1, "max_turns", multi_turn.max_turns, "must be >= 1", "e.g. 4")
    need(multi_turn.max_total_tokens >= 1, "max_total_tokens", multi_turn.max_total_tokens, "must be >= 1", "e.g. 1024")
    need(
        multi_turn.max_observation_tokens >= 1,
        "max_observation_tokens",
        multi_turn.max_observation_tokens,
        "must be >= 1",
        "e.g. 1024",
    )
    need(
        multi_turn.straggler_wait_s >= 0,
        "straggler_wait_s",
        multi_turn.straggler_wait_s,
        "must be >= 0 seconds",
        "e.g. 1.0",
    )
    need(multi_turn.log_freq >= 0, "log_freq", multi_turn.log_freq, "must be >= 0 (0: never)", "e.g. 1")
    need(
        not multi_turn.enable or bool(multi_turn.tools),
        "tools",
        [],
        "multi-turn rollouts need at least one tool",
        "list tools, e.g. `tools: [{function: calculator}]`, or set rollout.multi_turn.enable: false",
    )
    named: dict[str, int] = {}
    for index, tool in enumerate(multi_turn.tools):
        key = f"tools[{index}]"
        if tool.function in BUILTIN_TOOLS:
            name = tool.function
        elif ":" in tool.function:
            problem = function_problem(
                f"{KEY}.{key}.function",
                tool.function,
                "tool",
                "(argument: str, ...) -> str  (with a Google-style docstring)",
                "my_tools.web:fetch_page",
            )
            if problem is not None:
                problems.append(problem)
            name = tool.function.partition(":")[2]
        else:
            need(
                False,
                f"{key}.function",
                tool.function,
                f"neither a built-in tool nor `pkg.module:function`{non_ascii_note(tool.function)}",
                f"use one of {', '.join(BUILTIN_TOOLS)} or a function path like my_tools.web:fetch_page",
            )
            name = None
        if name is not None and name in named:
            need(
                False,
                f"{key}.function",
                tool.function,
                f"tools[{named[name]}] ({multi_turn.tools[named[name]].function!r}) is also named {name!r}, and the "
                "model calls tools by name",
                "remove one of them or rename one function",
            )
        elif name is not None:
            named[name] = index
        need(tool.timeout_s > 0, f"{key}.timeout_s", tool.timeout_s, "must be > 0 seconds", "e.g. 10")
    if "search" in named:
        _check_search(multi_turn, check_files, need)
    _check_python_tool(multi_turn, need)
    return problems


def _check_python_tool(multi_turn: MultiTurnConfig, need) -> None:
    python_tool = multi_turn.python_tool
    if not python_tool.sandbox_fusion_url:
        return
    need(
        python_tool.sandbox_fusion_url.startswith(("http://", "https://")),
        "python_tool.sandbox_fusion_url",
        python_tool.sandbox_fusion_url,
        "not an http(s) URL",
        "write the SandboxFusion server's base URL, e.g. http://127.0.0.1:8080",
    )
    need(
        not python_tool.unsafe_no_sandbox,
        "python_tool.unsafe_no_sandbox",
        True,
        "the code runs on the SandboxFusion server (python_tool.sandbox_fusion_url), never locally, so nothing "
        "reads it",
        "remove it, or empty python_tool.sandbox_fusion_url to run the code locally",
    )


def _check_search(multi_turn: MultiTurnConfig, check_files: bool, need) -> None:
    search = multi_turn.search
    need(
        bool(search.corpus) != bool(search.retriever_url),
        "search.corpus",
        search.corpus,
        "the built-in search needs exactly one of search.corpus (a local JSONL file) and search.retriever_url "
        f"(a retrieval server){'; both are set' if search.corpus else '; neither is set'}",
        "set one of them and leave the other empty",
    )
    if search.corpus and not search.retriever_url and check_files:
        corpus = local_path(search.corpus)
        why = "is a directory, not a JSONL file" if os.path.isdir(corpus) else unusable_path(search.corpus)
        need(
            os.path.isfile(corpus),
            "search.corpus",
            search.corpus,
            why or "file does not exist",
            'give a JSONL file with one {"contents": ...} object per line (relative paths start at the '
            "working directory), or validate with --no-file-checks for a recipe meant for another machine",
        )
    if search.retriever_url:
        need(
            search.retriever_url.startswith(("http://", "https://")),
            "search.retriever_url",
            search.retriever_url,
            "not an http(s) URL",
            "write the retrieval server's endpoint, e.g. http://127.0.0.1:8000/retrieve",
        )
    need(search.top_k >= 1, "search.top_k", search.top_k, "must be >= 1", "e.g. 3")
