"""The tools shipped with megarl, chosen by bare name in `rollout.multi_turn.tools[i].function`.

Each is a plain function with type hints and a Google-style docstring (its schema). `search` is
served by the ToolSet itself (batched to one index); the others run in the isolated tool workers
like any user tool.
"""

BUILTIN_TOOLS = {
    "search": "megarl.tools.builtin.search:search",
    "calculator": "megarl.tools.builtin.calculator:calculator",
    "python": "megarl.tools.builtin.python:python",
}
"""Built-in tool names and the functions they stand for."""


def tool_path(function: str) -> str:
    """`pkg.module:function` for a built-in name or a user path (returned as is)."""
    return BUILTIN_TOOLS.get(function, function)
