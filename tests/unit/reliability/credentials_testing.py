"""User code of tests/unit/reliability/test_reliability_credentials.py: a reward function and a tool that
search for credentials wherever user code could read them (imported in their isolated workers)."""

import hashlib
import json
import os
from pathlib import Path


def finds_credentials(prompts, responses, digests, report, **columns):
    """Reward function: `search(digests[0], report[0])`; scores 1.0."""
    search(digests[0], report[0])
    return [1.0] * len(responses)


def finds_credentials_tool(digests: str, report: str) -> str:
    """Search for credentials.

    Args:
        digests: sha256 digests of the values to find, comma-separated
        report: where to write what was found
    """
    search(digests.split(","), report)
    return "searched"


def search(digests: list[str], report: str) -> None:
    """Write to `report` where this process finds a value whose sha256 is in `digests`: in every
    environment /proc lets it read (pid and variable), and whether its parent's memory is open to it."""
    found, wanted = [], set(digests)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for name, _, value in (entry.partition(b"=") for entry in entries):
            if hashlib.sha256(value).hexdigest() in wanted:
                found.append([int(pid), name.decode()])
    try:
        open(f"/proc/{os.getppid()}/mem", "rb").close()
        parent_memory = "open"
    except OSError as error:
        parent_memory = type(error).__name__
    Path(report).write_text(json.dumps({"found": found, "parent_memory": parent_memory}))
