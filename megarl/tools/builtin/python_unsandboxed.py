"""The built-in `python` tool without its sandbox: chosen by the ToolSet instead of
`megarl.tools.builtin.python` only where the machine cannot isolate code and the user set
`rollout.multi_turn.python_tool.unsafe_no_sandbox: true`. The code keeps its resource limits and
time limit, and nothing else: it runs with the user's rights, network and view of the machine."""

from megarl.tools.builtin.python import execute


def python(code: str) -> str:
    """Run a Python program and return what it prints to standard output.

    Args:
        code: The program's source; print() the values you want to see.
    """
    return execute(code, "none")
