"""The built-in `python` tool on a SandboxFusion server (`rollout.multi_turn.python_tool.sandbox_fusion_url`):
the cluster's alternative to the local sandbox (`megarl.tools.builtin.python`), as verl's
`sandbox_fusion` tool, for nodes where user namespaces are not allowed or code must run elsewhere.

The contract (SandboxFusion's `POST /run_code`, documented in its README and API reference; the fields
verl's `verl/utils/reward_score/sandbox_fusion/utils.py` sends and reads):

    request   {"code": str, "stdin": str, "language": "python", "run_timeout": s, "memory_limit_MB": MB}
    response  {"status": "Success" | "Failed" | "SandboxError", "message": str,
               "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                              "return_code": int | null, "stdout": str, "stderr": str, ...} | null, ...}

"Failed" is the program's failure (a non-zero exit, a time limit), which the model reads as the local
sandbox's observation would say it; "SandboxError" and an unreachable or malformed server are the
service's failure, raised (the call's observation names it; the run goes on). The tool worker gets the
URL in its environment (`URL_ENV`), set by the `ToolSet`; the limits are the local sandbox's. The code
rewards' test cases run there too where `reward.sandbox.sandbox_fusion_url` is set (`run`, with `stdin`).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from megarl.tools.builtin import python as local
from megarl.tools.builtin.python import Completed

URL_ENV = "MEGARL_SANDBOX_FUSION_URL"
"""The tool worker's environment variable holding the server's base URL."""
HTTP_MARGIN_S = 10.0
"""How much longer than the program's own limit a request may take (queueing, start-up on the server)."""


class SandboxFusionError(RuntimeError):
    """The SandboxFusion server failed or could not be reached (not the program)."""


def python(code: str) -> str:
    """Run a Python program and return what it prints to standard output.

    Args:
        code: The program's source; print() the values you want to see. No network; only /tmp is writable.
    """
    return run_code(os.environ[URL_ENV], code)


def run_code(url: str, code: str) -> str:
    """The observation of running `code` on the server at `url` (module docstring)."""
    return local.observation(run(url, code))


def run(
    url: str, code: str, stdin: str = "", *, wall_s: float | None = None, output_chars: int | None = None
) -> Completed:
    """Run `code` with `stdin` as its standard input on the server at `url`, as `local.run` runs it in the
    local sandbox (same defaults; the memory limit is the local one, the CPU limit the server's own)."""
    wall_s = local.WALL_S if wall_s is None else wall_s
    request = {
        "code": code,
        "stdin": stdin,
        "language": "python",
        "run_timeout": wall_s,
        "memory_limit_MB": local.MEMORY_BYTES >> 20,
    }
    return completed(post(url, request, wall_s), wall_s, output_chars)


def post(url: str, request: dict, wall_s: float) -> dict:
    """`request` to `<url>/run_code`; the decoded answer, or SandboxFusionError saying what went wrong."""
    endpoint = url.rstrip("/") + "/run_code"
    data = json.dumps(request).encode()
    http = urllib.request.Request(endpoint, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=wall_s + HTTP_MARGIN_S) as answer:
            body = answer.read()
    except urllib.error.HTTPError as error:
        raise SandboxFusionError(f"{endpoint} answered HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise SandboxFusionError(f"{endpoint} did not answer ({getattr(error, 'reason', error)})") from None
    try:
        response = json.loads(body)
    except ValueError:
        raise SandboxFusionError(f"{endpoint} answered something other than JSON: {body[:200]!r}") from None
    if not isinstance(response, dict) or "status" not in response:
        raise SandboxFusionError(f"{endpoint} answered JSON without a status: {str(response)[:200]}")
    return response


def completed(response: dict, wall_s: float | None = None, output_chars: int | None = None) -> Completed:
    """A `/run_code` answer in the local sandbox's terms (`wall_s`: the limit the request gave)."""
    status, run = response["status"], response.get("run_result") or {}
    if status == "SandboxError" or not run:
        raise SandboxFusionError(f"the sandbox failed: {response.get('message') or status}")
    wall_s = local.WALL_S if wall_s is None else wall_s
    chars = local.OUTPUT_CHARS if output_chars is None else output_chars
    stdout = run.get("stdout") or ""
    if status == "Success" and run.get("return_code") == 0:
        failure = None
    elif run.get("status") == "TimeLimitExceeded":
        failure = f"Error: the program ran longer than {wall_s:g} s and was stopped"
    else:
        lines = [line for line in (run.get("stderr") or "").splitlines() if line.strip()]
        failure = lines[-1] if lines else f"Error: the program exited with code {run.get('return_code')}"
    return Completed(stdout[:chars], len(stdout) > chars, failure, run.get("status") == "TimeLimitExceeded")


def observation(response: dict) -> str:
    """What the model reads of a `/run_code` answer, in the local sandbox's words."""
    return local.observation(completed(response))


def server_problem(url: str) -> str | None:
    """Why the server at `url` cannot run code (one tiny program is run there), or None."""
    try:
        answer = run_code(url, "print(6 * 7)")
    except SandboxFusionError as error:
        return str(error)
    return None if answer == "42" else f"print(6 * 7) gave {answer!r} there"
