"""User tools the tool tests run in tool workers (imported there as `tools_testing:<name>`)."""

import os
import subprocess
import threading
import time
from pathlib import Path

NOT_CALLABLE = 3


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: Any text.
    """
    return text


def fails(text: str) -> str:
    """Raise an error whose message spans two lines.

    Args:
        text: Put in the message.
    """
    raise ValueError(f"bad input {text}\nsecond line")


def returns_number(value: int) -> str:
    """Return the number itself, not a string (a bug).

    Args:
        value: Any integer.
    """
    return value


def exits(code: int) -> str:
    """End the process at once with `code`.

    Args:
        code: The exit code.
    """
    os._exit(code)


def hangs(pid_file: str) -> str:
    """Start a child process, write this process's pid and the child's, then hang for good.

    Args:
        pid_file: Where the two pids go.
    """
    child = subprocess.Popen(["sleep", "3600"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    threading.Event().wait()
    return "never"


def starts_child(pid_file: str) -> str:
    """Start a child process that keeps running, write its pid, and return at once (a leak unless the
    tool's process group is killed when the tool set closes).

    Args:
        pid_file: Where the child's pid goes.
    """
    child = subprocess.Popen(["sleep", "3600"])
    Path(pid_file).write_text(str(child.pid))
    return "started"


def records_interval(path: str, seconds: float) -> str:
    """Be a slow tool: write the start time, take `seconds`, write the end time.

    Args:
        path: The file the monotonic start and end times go to.
        seconds: How long the call takes.
    """
    start = time.monotonic()
    time.sleep(seconds)
    Path(path).write_text(f"{start} {time.monotonic()}")
    return "done"


def waits_for(fifo: str) -> str:
    """Be a tool that takes as long as the test wants: read a named pipe, which blocks until the test
    writes to it.

    Args:
        fifo: Path of the named pipe.
    """
    return Path(fifo).read_text()


def visible(names: list[str]) -> str:
    """Which of the environment variables `names` this process can see, in any way.

    Args:
        names: Environment variable names.
    """
    initial = Path("/proc/self/environ").read_bytes()
    return ",".join(name for name in names if name in os.environ or name.encode() + b"=" in initial)


def calculator(expression: str) -> str:
    """A user tool that has the name of a built-in one.

    Args:
        expression: Anything.
    """
    return expression


def no_docstring(text: str) -> str:
    return text
