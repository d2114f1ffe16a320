"""The tool worker process: `python -m megarl.tools.worker <fd> <paths as JSON> schemas|no-schemas`.

Started by the `ToolSet`'s pool (`megarl.isolation.IsolatedProcess`: own process group, no
credentials). It imports every tool function once and says so; with `schemas` it also reads each
one's OpenAI-style schema from its type hints and docstring (`transformers.utils.get_json_schema`,
which takes a second to import, so only the first worker of a pool does). Messages:

    ("ready", [{"schema": dict | None, "error": str | None}, ...])   one entry per tool, in order
    request (tool_index, arguments) -> ("ok", text) | ("raised", "Type: message") | ("bad_return", why)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from megarl.isolation import FunctionNotFound, import_function, serve, worker_connection
from megarl.tools.calls import one_line


def load_tools(paths: list[str], read_schemas: bool) -> tuple[list[Callable | None], list[dict]]:
    """The functions (None where one does not resolve) and each one's {"schema", "error"}."""
    functions, reports = [], []
    for path in paths:
        try:
            function, error = import_function(path), None
        except FunctionNotFound as failure:
            function, error = None, str(failure)
        schema = None
        if function is not None and read_schemas:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(function)
            except Exception as failure:  # transformers' DocstringParsingException, TypeHintParsingException
                error = (
                    f"no schema can be read from it ({type(failure).__name__}: {failure}); give it type hints "
                    "and a Google-style docstring: a description, then `Args:` with one line per argument"
                )
        functions.append(function)
        reports.append({"schema": schema, "error": error})
    return functions, reports


def call_tool(functions: list[Callable | None], request: tuple[int, dict]) -> tuple[str, str]:
    index, arguments = request
    try:
        result = functions[index](**arguments)
    except (Exception, SystemExit) as error:  # a tool's bug costs this call, not the worker
        return "raised", one_line(f"{type(error).__name__}: {error}")
    if not isinstance(result, str):
        return "bad_return", f"the tool returned a {type(result).__name__}, not a string"
    return "ok", result


if __name__ == "__main__":
    connection = worker_connection(sys.argv[1])  # before the tools' modules are imported
    tools, ready = load_tools(json.loads(sys.argv[2]), read_schemas=sys.argv[3] == "schemas")
    serve(connection, ready, lambda request: call_tool(tools, request))
