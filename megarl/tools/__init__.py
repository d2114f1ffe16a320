"""Tools for multi-turn agent rollouts: parsing the model's calls, running them isolated, their schemas.

    from megarl.tools import ToolCall, ToolResult, ToolSet, ToolError, parser_for

    with ToolSet(config.rollout.multi_turn) as toolset:
        toolset.wait_ready(); ...; toolset.start_shared(SearchActor)   # megarl.orchestration.search_actor
        parser = parser_for(config.rollout.multi_turn.tool_format, toolset.schemas())
        turn = parser.parse(text)             # ParsedTurn(calls=[ToolCall, ...], errors=[CallError, ...])
        results = toolset.run(turn.calls)     # [ToolResult(text, error, latency_s), ...]; or submit: futures

Config checks without running anything: `megarl.tools.validation.tool_problems`.
"""

from megarl.tools.calls import ToolCall, ToolError, ToolFailure, ToolResult
from megarl.tools.parser import CallError, ParsedTurn, parser_for
from megarl.tools.toolset import ToolSet

__all__ = ["CallError", "ParsedTurn", "ToolCall", "ToolError", "ToolFailure", "ToolResult", "ToolSet", "parser_for"]
