"""Tools for multi-turn agent rollouts: parsing the model's calls, running them isolated, their schemas.

    from megarl.tools import ToolCall, ToolResult, ToolSet, ToolError, parser_for

    parser = parser_for(config.rollout.multi_turn.tool_format)
    turn = parser.parse(text)                 # ParsedTurn(calls=[ToolCall, ...], errors=[str, ...])
    with ToolSet(config.rollout.multi_turn) as toolset:
        toolset.wait_ready(); ...; toolset.start_shared()
        results = toolset.run(turn.calls)     # [ToolResult(text, error, latency_s), ...]

Config checks without running anything: `megarl.tools.validation.tool_problems`.
"""

from megarl.tools.calls import ToolCall, ToolError, ToolFailure, ToolResult
from megarl.tools.parser import ParsedTurn, parser_for
from megarl.tools.toolset import ToolSet

__all__ = ["ParsedTurn", "ToolCall", "ToolError", "ToolFailure", "ToolResult", "ToolSet", "parser_for"]
