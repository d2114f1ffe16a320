"""The python tool on a SandboxFusion server (issue 33, item 1: the cluster backend, as verl's): a stand-in
server on 127.0.0.1 that follows SandboxFusion's `POST /run_code` contract (request and response fields as
its README / API reference document them and verl's `verl/utils/reward_score/sandbox_fusion/utils.py` reads
them: top-level status Success / Failed / SandboxError, `run_result` with status Finished /
TimeLimitExceeded, return_code, stdout, stderr). The stand-in runs the program with a plain Python (it is
the test's server, not a sandbox) and records each request."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from megarl.config.loader import build_config
from megarl.config.rollout import MultiTurnConfig, PythonToolConfig, ToolConfig
from megarl.config.sections import RewardConfig, RewardSandboxConfig
from megarl.rewards import RewardFunctionError, RewardScorer, code_tests
from megarl.tools import ToolCall, ToolError, ToolSet
from megarl.tools.builtin import python as local_python
from megarl.tools.builtin.sandbox_fusion import SandboxFusionError, observation, run_code
from megarl.tools.validation import tool_problems


class FakeSandboxFusion(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict]] = []
    mode = "run"
    """run: execute the code; sandbox_error: answer SandboxError; html: answer a non-JSON page."""

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeSandboxFusion.requests.append({"path": self.path, **request})
        if self.mode == "html":
            return self._answer(b"<html>bad gateway</html>")
        if self.mode == "sandbox_error":
            return self._answer(
                json.dumps(
                    {
                        "status": "SandboxError",
                        "message": "no executor available",
                        "compile_result": None,
                        "run_result": None,
                    }
                ).encode()
            )
        try:
            done = subprocess.run(
                [sys.executable, "-c", request["code"]],
                input=request["stdin"],
                capture_output=True,
                text=True,
                timeout=request["run_timeout"],
            )
            run = {
                "status": "Finished",
                "execution_time": 0.1,
                "return_code": done.returncode,
                "stdout": done.stdout,
                "stderr": done.stderr,
            }
        except subprocess.TimeoutExpired as expired:
            run = {
                "status": "TimeLimitExceeded",
                "execution_time": request["run_timeout"],
                "return_code": None,
                "stdout": (expired.stdout or b"").decode(),
                "stderr": "",
            }
        status = "Success" if run["return_code"] == 0 else "Failed"
        self._answer(
            json.dumps(
                {
                    "status": status,
                    "message": "",
                    "compile_result": None,
                    "run_result": run,
                    "executor_pod_name": None,
                    "files": {},
                }
            ).encode()
        )

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(FakeSandboxFusion, "requests", [])
    monkeypatch.setattr(FakeSandboxFusion, "mode", "run")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_program_runs_there_with_the_local_sandboxs_limits(server):
    assert run_code(server, "print(sum(range(10)))") == "45"
    [request] = FakeSandboxFusion.requests
    assert request == {
        "path": "/run_code",
        "code": "print(sum(range(10)))",
        "stdin": "",
        "language": "python",
        "run_timeout": local_python.WALL_S,
        "memory_limit_MB": local_python.MEMORY_BYTES >> 20,
    }


def test_the_programs_failures_read_as_the_local_sandbox_says_them(server):
    assert run_code(server, "print('before')\nraise ValueError('bad')") == "before\nValueError: bad"
    assert run_code(server, "pass") == "(no output: print() the values you want to see)"
    timed_out = {
        "status": "Failed",
        "run_result": {"status": "TimeLimitExceeded", "return_code": None, "stdout": "partial\n", "stderr": ""},
    }
    assert observation(timed_out) == (
        f"partial\nError: the program ran longer than {local_python.WALL_S:g} s and was stopped"
    )
    long = run_code(server, f"print('x' * {local_python.OUTPUT_CHARS + 10})")
    assert long.endswith(f"(output cut at {local_python.OUTPUT_CHARS} characters)")


def test_the_services_failures_are_raised_naming_the_server(server):
    FakeSandboxFusion.mode = "sandbox_error"
    with pytest.raises(SandboxFusionError, match="the sandbox failed: no executor available"):
        run_code(server, "print(1)")
    FakeSandboxFusion.mode = "html"
    with pytest.raises(SandboxFusionError, match=f"{server}/run_code answered something other than JSON"):
        run_code(server, "print(1)")
    with pytest.raises(SandboxFusionError, match="http://127.0.0.1:9/run_code did not answer"):
        run_code("http://127.0.0.1:9", "print(1)")


def test_the_toolset_runs_the_python_tool_there_and_a_dead_server_stops_the_run_at_start(server):
    remote = MultiTurnConfig(
        enable=True, tools=(ToolConfig(function="python"),), python_tool=PythonToolConfig(sandbox_fusion_url=server)
    )
    with ToolSet(remote) as toolset:
        toolset.wait_ready()
        [result] = toolset.run([ToolCall("python", {"code": "import sys\nprint(sys.version_info[0])"})])
    assert result.text == "3"
    assert [r["code"] for r in FakeSandboxFusion.requests] == ["print(6 * 7)", "import sys\nprint(sys.version_info[0])"]
    dead = MultiTurnConfig(
        enable=True,
        tools=(ToolConfig(function="python"),),
        python_tool=PythonToolConfig(sandbox_fusion_url="http://127.0.0.1:9"),
    )
    with pytest.raises(
        ToolError,
        match=r"rollout.multi_turn.python_tool.sandbox_fusion_url = 'http://127.0.0.1:9': "
        r"the server cannot run the python tool's code \(.*did not answer",
    ):
        ToolSet(dead)


def test_a_service_failure_mid_run_is_the_calls_error_and_the_toolset_goes_on(server):
    remote = MultiTurnConfig(
        enable=True, tools=(ToolConfig(function="python"),), python_tool=PythonToolConfig(sandbox_fusion_url=server)
    )
    with ToolSet(remote) as toolset:
        toolset.wait_ready()
        FakeSandboxFusion.mode = "sandbox_error"
        [failed] = toolset.run([ToolCall("python", {"code": "print(1)"})])
        FakeSandboxFusion.mode = "run"
        [ok] = toolset.run([ToolCall("python", {"code": "print(2)"})])
    assert failed.error == "raised" and "SandboxFusionError: the sandbox failed: no executor available" in failed.text
    assert ok.text == "2"


@pytest.mark.parametrize(
    "python_tool, key, words",
    [
        ({"sandbox_fusion_url": "sandbox:8080"}, "python_tool.sandbox_fusion_url", "not an http(s) URL"),
        (
            {"sandbox_fusion_url": "http://sandbox:8080", "unsafe_no_sandbox": True},
            "python_tool.unsafe_no_sandbox",
            "never locally, so nothing reads it",
        ),
    ],
)
def test_validate_names_the_key(python_tool, key, words):
    problems = []
    config = build_config(
        {"rollout": {"multi_turn": {"enable": True, "tools": [{"function": "python"}], "python_tool": python_tool}}},
        problems,
    )
    assert problems == []
    found = [p for p in tool_problems(config.rollout.multi_turn, check_files=False) if p.key.endswith(key)]
    assert len(found) == 1 and words in found[0].why, found


def test_the_code_rewards_cases_run_there_with_their_stdin(server, monkeypatch):
    # A reward worker of a run with reward.sandbox.sandbox_fusion_url set (`code_tests.worker_settings`).
    monkeypatch.setenv(
        *code_tests.worker_settings(RewardSandboxConfig(sandbox_fusion_url=server, case_timeout_s=3)).popitem()
    )
    cases = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "35\n"]}
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_tests.code_reward(["p"], [program], answer=[json.dumps(cases)]) == [0.5]
    assert sorted((r["stdin"], r["run_timeout"]) for r in FakeSandboxFusion.requests) == [("1 2\n", 3), ("5 7\n", 3)]
    with RewardScorer.from_config(
        RewardConfig(function="code", sandbox=RewardSandboxConfig(sandbox_fusion_url=server))
    ):
        assert FakeSandboxFusion.requests[-1]["code"] == "print(6 * 7)"  # tried once at start-up
    dead = RewardConfig(function="code", sandbox=RewardSandboxConfig(sandbox_fusion_url="http://127.0.0.1:9"))
    with pytest.raises(
        RewardFunctionError,
        match=r"reward.sandbox.sandbox_fusion_url = 'http://127.0.0.1:9': the server cannot run the reward's programs",
    ):
        RewardScorer.from_config(dead)
