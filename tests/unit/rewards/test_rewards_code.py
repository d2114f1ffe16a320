"""The `code` reward (issue 33, item 1: reward functions that execute code) and `run_sandboxed`: programs run
against their test cases in the python tool's sandbox, under each backend (bubblewrap, unshare); hostile
programs score 0, change nothing outside and raise nothing; malformed test cases stop the run naming the
column; without any sandbox the run is refused unless allowed. On a SandboxFusion server:
tests/unit/tools/test_tools_sandbox_fusion.py."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from process_testing import command_line

import megarl.tools.builtin.python as python_tool
from megarl.cli.main import main
from megarl.config.loader import build_config
from megarl.config.sections import RewardConfig, RewardSandboxConfig
from megarl.config.validate import validate
from megarl.rewards import RewardFunctionError, RewardScorer, code_tests
from megarl.rewards.code_tests import code_reward, run_sandboxed

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})


@pytest.fixture
def case_timeout(monkeypatch):
    """The reward's per-case limit as a reward worker gets `reward.sandbox.case_timeout_s` (2 s)."""
    monkeypatch.setenv(code_tests.SETTINGS_ENV, json.dumps({"case_timeout_s": 2.0}))


def score(response: str, cases: object = CASES) -> float:
    [value] = code_reward(["prompt"], [response], answer=[cases])
    return value


@pytest.mark.usefixtures("sandbox_backend")
def test_the_score_is_the_fraction_of_cases_passed():
    assert score(ADD) == 1.0
    assert score(ADD.replace("a + b", "a * b if a == 1 else a + b")) == 0.5  # 1*2 = 2, not 3
    assert score(ADD.replace("a + b", "a - b")) == 0.0
    assert score("```python\nraise SystemExit(1)\n```") == 0.0  # exit status non-zero
    # The last fenced block is the program; without one, the whole response.
    assert score("A first try:\n```python\nprint(0)\n```\nBetter:\n" + ADD) == 1.0
    assert score("a, b = map(int, input().split())\nprint(a + b)") == 1.0
    # Trailing whitespace and empty lines do not matter; anything else printed does; a dict works as a JSON string.
    assert score("```py\nprint(sum(map(int, input().split())), '  ')\nprint()\n```") == 1.0
    assert score("```python\nprint('sum:', sum(map(int, input().split())))\n```") == 0.0
    assert score(ADD, {"inputs": ["2 2"], "outputs": ["4"]}) == 1.0


@pytest.mark.usefixtures("sandbox_backend")
def test_run_sandboxed_gives_users_rewards_the_same_sandbox():
    done = run_sandboxed("import os, sys\nprint(os.getcwd(), sys.stdin.read().upper())", "abc")
    assert (done.stdout, done.failure, done.timed_out) == ("/tmp ABC\n", None, False)
    failed = run_sandboxed("print('partial')\nraise ValueError('bad input')")
    assert (failed.stdout, failed.failure) == ("partial\n", "ValueError: bad input")
    stopped = run_sandboxed("import time\ntime.sleep(60)", timeout_s=1)
    assert stopped.timed_out and stopped.failure == "Error: the program ran longer than 1 s and was stopped"
    long = run_sandboxed("print('x' * 100)", output_chars=10)
    assert (long.stdout, long.stdout_cut) == ("x" * 10, True)


HOLDER_TOKEN = "canary-33-reward"


def hostile_programs(tmp_path: Path, holder_pid: int, port: int) -> dict[str, tuple[str, str]]:
    """name -> (program, the output it prints where its attack succeeds: a broken sandbox scores it 1)."""
    target = tmp_path / "written.txt"
    return {
        "reads the environment of a process outside": (
            f"print(open('/proc/{holder_pid}/environ', 'rb').read().split(b'HF_TOKEN=')[1].split(b'\\0')[0].decode())",
            HOLDER_TOKEN,
        ),
        # (Reading it fails even unsandboxed where megarl runs as root, lacking the holder's capabilities: so also)
        "sees a process outside": (f"import os\nprint(os.path.exists('/proc/{holder_pid}'))", "True"),
        "writes outside its directory": (f"open({str(target)!r}, 'w').write('x')\nprint('written')", "written"),
        "connects to the host": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')",
            "connected",
        ),
        "fork bomb": (
            "import os\nwhile True:\n    if os.fork() == 0:\n        os.execv('/usr/bin/sleep', ['sleep', '602.33'])",
            "",
        ),
        "endless loop": ("while True:\n    pass", ""),
        "endless output": ("while True:\n    print('x' * 1000)", "x" * 1000),
    }


@pytest.mark.usefixtures("sandbox_backend", "case_timeout")
@pytest.mark.parametrize(
    "attack",
    [
        "reads the environment of a process outside",
        "sees a process outside",
        "writes outside its directory",
        "connects to the host",
        "fork bomb",
        "endless loop",
        "endless output",
    ],
)
def test_a_hostile_program_scores_zero_harms_nothing_and_raises_nothing(attack, tmp_path):
    # A process of the host holding a canary token (as the driver holds HF_TOKEN); a port the host listens on.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, "HF_TOKEN": HOLDER_TOKEN}
    )
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            server.setblocking(False)
            program, success = hostile_programs(tmp_path, holder.pid, server.getsockname()[1])[attack]
            assert score(f"```python\n{program}\n```", {"inputs": [""], "outputs": [success]}) == 0.0
            with pytest.raises(BlockingIOError):  # no connection ever reached the host's port
                server.accept()
    finally:
        holder.kill()
        holder.wait()
    assert list(tmp_path.iterdir()) == []
    assert not any(command_line(pid) == b"sleep\x00602.33\x00" for pid in _pids())  # the fork bomb's


def _pids() -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit()]


@pytest.mark.usefixtures("sandbox_backend", "case_timeout")
def test_after_a_case_runs_out_of_time_the_rest_count_as_failed_unrun(monkeypatch):
    runs = []
    run = python_tool.run
    monkeypatch.setattr(python_tool, "run", lambda *args, **kwargs: runs.append(args[2]) or run(*args, **kwargs))
    slow = "```python\nn = int(input())\nwhile n == 2:\n    pass\nprint(n)\n```"
    cases = {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}
    assert score(slow, cases) == pytest.approx(1 / 3)
    assert runs == ["1", "2"]  # the third case was not run


@pytest.mark.parametrize(
    "value, why",
    [
        ("3\n12", "not JSON"),
        ('{"input": ["1"], "output": ["1"]}', 'not an object with "inputs" and "outputs"'),
        ('["1", "1"]', 'not an object with "inputs" and "outputs"'),
        ('{"inputs": ["1", "2"], "outputs": ["1"]}', "lists of the same length"),
        ('{"inputs": [], "outputs": []}', "at least one case"),
        ('{"inputs": [1], "outputs": [1]}', "must be a string"),
        ('{"inputs": ["[1]"], "outputs": ["1"], "fn_name": "solve"}', "call-based test cases (fn_name 'solve')"),
        (None, 'not an object with "inputs" and "outputs"'),
    ],
)
def test_malformed_test_cases_stop_the_run_naming_the_column_and_value(value, why):
    with pytest.raises(RewardFunctionError) as raised:
        code_reward(["p", "p"], [ADD, ADD], answer=[CASES, value])
    message = str(raised.value)
    assert message.startswith(f"reward.function 'code': the answer column (data.answer_key) holds {value!r}: ")
    assert why in message and '{"inputs": [stdin, ...], "outputs": [expected stdout, ...]}' in message


def test_the_scorer_runs_the_code_reward_in_its_workers_and_stops_on_malformed_cases():
    config = RewardConfig(function="code", timeout_s=10.0, sandbox=RewardSandboxConfig(case_timeout_s=3.0))
    with RewardScorer.from_config(config) as scorer:
        slow = "```python\nimport time\ntime.sleep(60)\n```"
        result = scorer(["p", "p"], [ADD, slow], answer=[CASES, CASES])
        # The sleeper ran out of its case's 3 s (the worker's setting), not out of the reward's 10 s.
        assert result.scores == [1.0, 0.0] and result.metrics["reward/failed_samples"] == 0
        with pytest.raises(RewardFunctionError, match=r"answer column \(data.answer_key\) holds 'oops'"):
            scorer(["p"], [ADD], answer=["oops"])


@pytest.fixture
def no_sandbox(tmp_path, monkeypatch):
    """A machine with neither `bwrap` nor `unshare` (an empty PATH), the backends' probes forgotten."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", str(directory))
    python_tool.backend.cache_clear()
    python_tool.backend_problem.cache_clear()
    yield
    python_tool.backend.cache_clear()
    python_tool.backend_problem.cache_clear()


@pytest.mark.usefixtures("no_sandbox")
def test_without_a_sandbox_the_code_reward_is_refused_unless_allowed(tmp_path):
    refusal = (
        r"reward.function runs programs, but this machine cannot sandbox them \(bubblewrap: no `bwrap` on PATH; "
        r"unshare: no `unshare` on PATH\).*reward.sandbox.sandbox_fusion_url.*reward.sandbox.unsafe_no_sandbox: true"
    )
    with pytest.raises(RewardFunctionError, match=refusal):
        RewardScorer.from_config(RewardConfig(function="code"))
    with pytest.raises(RewardFunctionError, match=refusal):  # a user's reward calling run_sandboxed
        run_sandboxed("print(1)")
    allowed = RewardConfig(function="code", sandbox=RewardSandboxConfig(unsafe_no_sandbox=True))
    with RewardScorer.from_config(allowed) as scorer:
        sees_host = f"```python\nimport os\nprint(os.path.exists({str(tmp_path)!r}))\n```"
        cases = {"inputs": [""], "outputs": ["True"]}
        assert scorer(["p"], [sees_host], answer=[json.dumps(cases)]).scores == [1.0]  # ran unsandboxed


@pytest.mark.parametrize(
    "reward, key, words",
    [
        ({"sandbox": {"case_timeout_s": 0}}, "reward.sandbox.case_timeout_s", "must be > 0 seconds"),
        (
            {"function": "code", "timeout_s": 5, "sandbox": {"case_timeout_s": 5}},
            "reward.sandbox.case_timeout_s",
            "must be below reward.timeout_s (5 s)",
        ),
        (
            {"sandbox": {"sandbox_fusion_url": "sandbox:8080"}},
            "reward.sandbox.sandbox_fusion_url",
            "not an http(s) URL",
        ),
        (
            {"sandbox": {"sandbox_fusion_url": "http://sandbox:8080", "unsafe_no_sandbox": True}},
            "reward.sandbox.unsafe_no_sandbox",
            "never locally, so nothing reads it",
        ),
    ],
)
def test_validate_names_the_key(reward, key, words):
    problems = []
    config = build_config({"model": {"path": "m"}, "reward": reward}, problems)
    assert problems == []
    found = [p for p in validate(config, check_files=False) if p.key.startswith("reward.")]
    assert len(found) == 1 and found[0].key == key and words in found[0].why, found


def test_validate_warns_when_the_rewards_sandbox_may_be_skipped(capsys):
    recipe = str(Path(__file__).parents[3] / "configs" / "quickstart.yaml")
    assert main(["validate", "--no-file-checks", recipe, "reward.sandbox.unsafe_no_sandbox=true"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: reward.")] == [
        "warning: reward.sandbox.unsafe_no_sandbox is true: where this machine cannot sandbox the reward's "
        "programs, model-written code runs with your rights (your files, other processes' secrets, the network)"
    ]
