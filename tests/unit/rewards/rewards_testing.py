"""User reward functions the scorer tests run in reward workers (imported there by `rewards_testing:<name>`)."""

import os
import subprocess
import threading
from pathlib import Path

NOT_CALLABLE = 3


def first_letter_matches(prompts, responses, answer, **columns):
    return [float(response[:1] == expected) for response, expected in zip(responses, answer)]


def raises_on_boom(prompts, responses, **columns):
    if "boom" in responses:
        raise ValueError("boom in the reward")
    return [1.0] * len(responses)


def exits_on_crash(prompts, responses, **columns):
    if "crash" in responses:
        os._exit(3)
    return [1.0] * len(responses)


def hangs_on_hang(prompts, responses, pid_file, **columns):
    """Hangs for good when a response is "hang", after starting a child process and writing its pid."""
    if "hang" in responses:
        child = subprocess.Popen(["sleep", "3600"])
        Path(pid_file[0]).write_text(f"{os.getpid()} {child.pid}")
        threading.Event().wait()
    return [1.0] * len(responses)


def one_score_too_few(prompts, responses, **columns):
    return [1.0] * (len(responses) - 1)


def strings(prompts, responses, **columns):
    return ["1.0"] * len(responses)


def not_a_number(prompts, responses, **columns):
    return [float("nan")] * len(responses)


def sees_variables(prompts, responses, variable, **columns):
    """1.0 where the environment variable named in `variable` is visible to the function, in any way."""
    initial = Path("/proc/self/environ").read_bytes()
    return [float(name in os.environ or name.encode() + b"=" in initial) for name in variable]
