"""The `code` reward (`reward.function: code`): the response's program, run against the sample's test cases in
the python tool's sandbox; and `run_sandboxed`, the same sandbox for users' own reward functions.

    from megarl.rewards.code_tests import run_sandboxed
    done = run_sandboxed("print(int(input()) * 2)", stdin="21\\n")   # Completed(stdout="42\\n", failure=None, ...)

**Test cases.** The sample's `answer` column (`data.answer_key`) holds its test cases as verl's `prime_code`
and `sandbox_fusion` rewards read them (APPS / TACO / PRIME's `input_output`): a JSON string, or the
object itself,

    {"inputs": ["1 2\\n", "5 7\\n"], "outputs": ["3\\n", "12\\n"]}

one standard input and its expected standard output per case (strings, as many of each, at least one).
Call-based cases (APPS's `fn_name`) are not supported. A value that is not of this form raises
`RewardFunctionError` naming the column and the value: it stops the run (a data bug, not bad luck).

**Program.** The last ```python (or ```py) fenced block of the response, else the whole response.

**Score.** The fraction of the cases whose run exits 0 and prints the expected output (compared line by
line, each line's trailing whitespace and trailing empty lines ignored), in [0, 1]; 1.0 only if all pass.
Each case runs in a fresh sandbox with `reward.sandbox.case_timeout_s` of wall clock (and as many CPU seconds,
rounded up); after a case that ran out of time the response's remaining cases count as failed, unrun (a
program too slow for one input is slow for the others, and each would cost the whole limit). A program
that fails, hangs, floods its output or attacks the machine scores 0 for its cases; nothing raises.

**Where the programs run.** `run_sandboxed` runs them where `megarl.tools.builtin.python.run` runs the
python tool's code (bubblewrap or util-linux `unshare`), or on the SandboxFusion server of
`reward.sandbox.sandbox_fusion_url`. Where no sandbox can be built it raises RewardFunctionError unless
`reward.sandbox.unsafe_no_sandbox` is true; with `reward.function: code` the run is refused at start-up
instead (`check_sandbox`). The reward workers get the `reward.sandbox` settings in their environment
(`SETTINGS_ENV`, set by `RewardScorer.from_config`); elsewhere the defaults hold.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from megarl.config.sections import RewardSandboxConfig
from megarl.rewards.functions import RewardFunctionError
from megarl.tools.builtin import python as local
from megarl.tools.builtin import sandbox_fusion
from megarl.tools.builtin.python import Completed

logger = logging.getLogger(__name__)

SETTINGS_ENV = "MEGARL_REWARD_SANDBOX"
"""The reward worker's environment variable holding `reward.sandbox` as JSON."""
OUTPUT_CHARS = 1 << 20
"""Characters of a program's output `run_sandboxed` keeps by default."""
PARALLEL_RUNS = 4
"""Programs the `code` reward runs at once (one sandbox each)."""
_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_FORMAT = (
    'each sample\'s test cases must be JSON {"inputs": [stdin, ...], "outputs": [expected stdout, ...]} '
    "(strings, as many of each, at least one)"
)


def code_reward(prompts: list[str], responses: list[str], answer: list, **columns) -> list[float]:
    """Reward-function form (`reward.function: code`): one score per response (module docstring)."""
    cases = [test_cases(value) for value in answer]  # every value checked before any program runs
    with ThreadPoolExecutor(max_workers=PARALLEL_RUNS) as pool:
        return list(pool.map(code_score, responses, cases))


def code_score(response: str, cases: list[tuple[str, str]]) -> float:
    """The fraction of `cases` (stdin, expected stdout) the response's program passes."""
    program = extract_program(response)
    passed = 0
    for stdin, expected in cases:
        done = run_sandboxed(program, stdin, output_chars=len(expected) + 1024)  # room for trailing blanks
        if done.timed_out:
            break
        passed += done.failure is None and not done.stdout_cut and _lines(done.stdout) == _lines(expected)
    return passed / len(cases)


def extract_program(response: str) -> str:
    """The last ```python / ```py fenced block of `response`, else the whole response."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def test_cases(value: object) -> list[tuple[str, str]]:
    """The (stdin, expected stdout) pairs of one `answer` value (module docstring); RewardFunctionError
    naming the column and the value where it is not of that form."""
    data = value
    if isinstance(value, (str, bytes)):
        try:
            data = json.loads(value)
        except ValueError as error:
            raise _malformed(value, f"not JSON ({error})") from None
    if not isinstance(data, Mapping) or not {"inputs", "outputs"} <= set(data):
        raise _malformed(value, 'not an object with "inputs" and "outputs"')
    if data.get("fn_name"):
        raise _malformed(value, f"call-based test cases (fn_name {data['fn_name']!r}) are not supported")
    inputs, outputs = data["inputs"], data["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise _malformed(value, '"inputs" and "outputs" must be lists of the same length, at least one case')
    if not all(isinstance(text, str) for text in inputs + outputs):
        raise _malformed(value, 'every entry of "inputs" and "outputs" must be a string')
    return list(zip(inputs, outputs))


def run_sandboxed(
    code: str, stdin: str = "", timeout_s: float | None = None, *, output_chars: int = OUTPUT_CHARS
) -> Completed:
    """Run the Python program `code` with `stdin` as its standard input in a fresh sandbox (the python tool's,
    or the SandboxFusion server of `reward.sandbox.sandbox_fusion_url`), stopped after `timeout_s` seconds of
    wall clock or CPU time (default `reward.sandbox.case_timeout_s`). Returns `Completed`: `stdout` (its
    first `output_chars` characters; `stdout_cut` if there was more), `failure` (None where it exited 0, else
    one line why it stopped), `timed_out`. The program's failures never raise; RewardFunctionError where no
    sandbox can be built and `reward.sandbox.unsafe_no_sandbox` is not set, SandboxFusionError where the
    server fails (the call's samples then score 0)."""
    settings = sandbox_settings()
    wall_s = settings.case_timeout_s if timeout_s is None else timeout_s
    if settings.sandbox_fusion_url:
        return sandbox_fusion.run(settings.sandbox_fusion_url, code, stdin, wall_s=wall_s, output_chars=output_chars)
    isolation = local.backend()
    if isolation is None:
        if not settings.unsafe_no_sandbox:
            raise RewardFunctionError(_refusal(local.sandbox_problem()))
        isolation = "none"
    return local.run(code, isolation, stdin, wall_s=wall_s, cpu_s=math.ceil(wall_s), output_chars=output_chars)


def sandbox_settings() -> RewardSandboxConfig:
    """`reward.sandbox` as the scorer handed it to this reward worker; the defaults elsewhere."""
    encoded = os.environ.get(SETTINGS_ENV)
    return RewardSandboxConfig(**json.loads(encoded)) if encoded else RewardSandboxConfig()


def worker_settings(sandbox: RewardSandboxConfig) -> dict[str, str]:
    """The environment that hands `sandbox` (`reward.sandbox`) to the reward workers."""
    settings = {
        "case_timeout_s": sandbox.case_timeout_s,
        "unsafe_no_sandbox": sandbox.unsafe_no_sandbox,
        "sandbox_fusion_url": sandbox.sandbox_fusion_url,
    }
    return {SETTINGS_ENV: json.dumps(settings)}


def check_sandbox(sandbox: RewardSandboxConfig) -> None:
    """At start-up of a run whose reward runs programs: RewardFunctionError naming the key where they
    cannot run (the SandboxFusion server fails a tiny program; no local sandbox and no
    `unsafe_no_sandbox`); a log line saying where they run."""
    url = sandbox.sandbox_fusion_url
    if url:
        problem = sandbox_fusion.server_problem(url)
        if problem is not None:
            raise RewardFunctionError(
                f"reward.sandbox.sandbox_fusion_url = {url!r}: the server cannot run the reward's programs "
                f"({problem}); start it, correct the URL, or empty it to run them in the local sandbox"
            )
        logger.info("the reward runs programs on the SandboxFusion server %s", url)
        return
    problem = local.sandbox_problem()
    if problem is None:
        logger.info("the reward runs programs in a sandbox built by %s", local.backend())
    elif not sandbox.unsafe_no_sandbox:
        raise RewardFunctionError(_refusal(problem))
    else:
        logger.warning(
            "the reward runs programs WITHOUT a sandbox (%s), with your rights: reward.sandbox.unsafe_no_sandbox "
            "is true",
            problem,
        )


def _refusal(problem: str | None) -> str:
    return (
        f"reward.function runs programs, but this machine cannot sandbox them ({problem}); run where "
        "unprivileged user namespaces are allowed (sysctl kernel.unprivileged_userns_clone=1 / "
        "user.max_user_namespaces > 0; on Ubuntu 24.04 and later kernel.apparmor_restrict_unprivileged_userns=0; "
        "bubblewrap's `bwrap` or util-linux `unshare` on PATH), or run them on a SandboxFusion server "
        "(reward.sandbox.sandbox_fusion_url), or set reward.sandbox.unsafe_no_sandbox: true to run them with your rights"
    )


def _malformed(value: object, why: str) -> RewardFunctionError:
    text = repr(value)
    return RewardFunctionError(
        f"reward.function 'code': the answer column (data.answer_key) holds "
        f"{text if len(text) <= 200 else text[:200] + '...'}: {why}; {_FORMAT}"
    )


def _lines(text: str) -> list[str]:
    """`text`'s lines, each without its trailing whitespace, without the trailing empty lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
