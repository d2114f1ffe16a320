"""The ToolSet runs user tools isolated: results in order, failures as results, hung calls killed, concurrency,
no secrets, schemas read from docstrings in the worker, and tools that do not resolve stop the run at start."""

import os
from pathlib import Path

import psutil
import pytest
from process_testing import wait_until_gone

from megarl.config.rollout import MultiTurnConfig, ToolConfig
from megarl.tools import ToolCall, ToolError, ToolResult, ToolSet


def tool_set(*functions: str, timeout_s: float = 30.0, **kwargs) -> ToolSet:
    tools = tuple(ToolConfig(function=function, timeout_s=timeout_s) for function in functions)
    return ToolSet(MultiTurnConfig(enable=True, tools=tools), **kwargs)


@pytest.fixture(scope="module")
def tools():
    """One ToolSet for the tests that need no special start (each start reads the schemas: ~1 s)."""
    functions = [
        "tools_testing:echo",
        "tools_testing:fails",
        "tools_testing:returns_number",
        "calculator",
        "python",
        "tools_testing:exits",
        "tools_testing:records_interval",
        "tools_testing:waits_for",
    ]
    configs = [ToolConfig(function=function) for function in functions] + [ToolConfig("tools_testing:hangs", 1.0)]
    with ToolSet(MultiTurnConfig(enable=True, tools=tuple(configs))) as started:
        started.wait_ready()
        yield started


def test_results_come_back_in_order_with_each_failure_named_and_the_workers_stay(tools):
    results = tools.run(
        [
            ToolCall("echo", {"text": "hello"}),
            ToolCall("fails", {"text": "x"}),
            ToolCall("returns_number", {"value": 7}),
            ToolCall("no_such_tool", {}),
            ToolCall("calculator", {"expression": "(1 + 2) * 4"}),
            ToolCall("python", {"code": "print(sum(range(5)))"}),
            ToolCall("echo", {"wrong": "argument"}),
        ]
    )
    assert [result.error for result in results] == [None, "raised", "bad_return", "unknown_tool", None, None, "raised"]
    assert results[0].text == "hello" and results[4].text == "12" and results[5].text == "10"
    assert results[1].text == "Error: ValueError: bad input x second line"  # one line, no traceback
    assert results[2].text == "Error: the tool returned a int, not a string"
    assert results[3].text == (
        "Error: there is no tool 'no_such_tool'; the tools are: echo, fails, "
        "returns_number, calculator, python, exits, records_interval, waits_for, hangs"
    )
    assert "unexpected keyword argument 'wrong'" in results[6].text
    assert all(result.latency_s >= 0 for result in results)
    pids = tools.worker_pids()
    assert [result.text for result in tools.run([ToolCall("echo", {"text": "again"})] * 2)] == ["again"] * 2
    assert tools.worker_pids() == pids


def test_a_hung_call_is_killed_with_what_it_started_and_the_tools_still_work(tools, tmp_path):
    pid_file = str(tmp_path / "pids")
    hung, fine = tools.run([ToolCall("hangs", {"pid_file": pid_file}), ToolCall("echo", {"text": "ok"})])
    assert hung.error == "timeout" and hung.text == "Error: the tool ran longer than 1 s and was stopped"
    assert hung.latency_s >= 1.0
    assert fine == ToolResult("ok", None, fine.latency_s)
    worker_pid, child_pid = map(int, Path(pid_file).read_text().split())
    assert wait_until_gone(worker_pid) and wait_until_gone(child_pid)
    assert worker_pid not in tools.worker_pids()
    assert [
        result.text for result in tools.run([ToolCall("echo", {"text": "a"}), ToolCall("echo", {"text": "b"})])
    ] == ["a", "b"]


def test_a_tool_that_kills_its_worker_is_a_raised_result_and_the_worker_is_replaced(tools):
    before = tools.worker_pids()
    (crashed,) = tools.run([ToolCall("exits", {"code": 3})])
    assert crashed.error == "raised" and crashed.text == "Error: the tool's process exited with code 3"
    assert tools.worker_pids() != before
    assert tools.run([ToolCall("echo", {"text": "still here"})])[0].text == "still here"


def test_the_calls_of_one_run_run_at_the_same_time(tools, tmp_path):
    files = [tmp_path / "first", tmp_path / "second"]
    tools.run([ToolCall("echo", {"text": "warm"})] * 2)  # two started workers: no import time inside the intervals
    results = tools.run([ToolCall("records_interval", {"path": str(file), "seconds": 1.0}) for file in files])
    assert [result.text for result in results] == ["done", "done"]
    (start_a, end_a), (start_b, end_b) = (map(float, file.read_text().split()) for file in files)
    assert start_a < end_b and start_b < end_a, "the two calls ran one after the other"


def test_a_submitted_call_is_back_while_a_slow_one_still_runs(tools, tmp_path):
    """`submit` returns at once; each call's future is set when that call ends, not when the slowest does."""
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    slow, fast = tools.submit([ToolCall("waits_for", {"fifo": str(fifo)}), ToolCall("echo", {"text": "quick"})])
    assert fast.result().text == "quick"
    assert not slow.done()
    fifo.write_text("released")  # blocks until the tool opened the pipe: it is running
    assert slow.result() == ToolResult("released", None, slow.result().latency_s)
    assert [result.text for result in tools.run([ToolCall("echo", {"text": "a"})])] == ["a"]


def test_secrets_of_the_driver_do_not_reach_the_tools(monkeypatch):
    secrets = ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "MY_DB_PASSWORD"]
    for name in secrets:
        monkeypatch.setenv(name, "do-not-leak")
    monkeypatch.setenv("MEGARL_TEST_PLAIN_SETTING", "visible")
    with tool_set("tools_testing:visible") as tools:
        (result,) = tools.run([ToolCall("visible", {"names": secrets + ["MEGARL_TEST_PLAIN_SETTING"]})])
        assert result.text == "MEGARL_TEST_PLAIN_SETTING"


def test_schemas_are_read_from_type_hints_and_docstrings_in_config_order(tools):
    names = [schema["function"]["name"] for schema in tools.schemas()]
    assert names == [
        "echo",
        "fails",
        "returns_number",
        "calculator",
        "python",
        "exits",
        "records_interval",
        "waits_for",
        "hangs",
    ]
    calculator, interval = tools.schemas()[3], tools.schemas()[6]
    assert interval == {
        "type": "function",
        "function": {
            "name": "records_interval",
            "description": "Be a slow tool: write the start time, take `seconds`, write the end time.",
            "parameters": {
                "type": "object",
                "required": ["path", "seconds"],
                "properties": {
                    "path": {"type": "string", "description": "The file the monotonic start and end times go to."},
                    "seconds": {"type": "number", "description": "How long the call takes."},
                },
            },
            "return": {"type": "string"},
        },
    }
    assert calculator["function"]["name"] == "calculator"
    assert list(calculator["function"]["parameters"]["properties"]) == ["expression"]


def test_every_tool_that_does_not_resolve_is_named_at_start():
    with tool_set(
        "tools_testing:echo",
        "no_such_pkg_xyz.tools:fetch",
        "tools_testing:missing",
        "tools_testing:NOT_CALLABLE",
        "tools_testing:no_docstring",
    ) as tools:
        with pytest.raises(ToolError) as raised:
            tools.wait_ready()
    lines = str(raised.value).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        "rollout.multi_turn.tools[1].function = 'no_such_pkg_xyz.tools:fetch': module "
        "no_such_pkg_xyz.tools cannot be imported (ModuleNotFoundError"
    )
    assert lines[1].startswith("rollout.multi_turn.tools[2].function = 'tools_testing:missing': module tools_testing")
    assert "has no attribute 'missing'; correct the name after the colon" in lines[1]
    assert lines[2] == (
        "rollout.multi_turn.tools[3].function = 'tools_testing:NOT_CALLABLE': "
        "tools_testing.NOT_CALLABLE is a int, not a function"
    )
    assert lines[3].startswith(
        "rollout.multi_turn.tools[4].function = 'tools_testing:no_docstring': no schema can "
        "be read from it (DocstringParsingException"
    )


def test_two_tools_of_one_name_and_a_malformed_function_are_refused():
    with tool_set("calculator", "tools_testing:calculator") as tools:
        with pytest.raises(
            ToolError,
            match=r"tools\[1\].function = 'tools_testing:calculator': its name 'calculator' "
            r"is also the name of tools\[0\] \('calculator'\)",
        ):
            tools.wait_ready()
    with pytest.raises(
        ToolError,
        match=r"tools\[0\].function = 'web_fetch': neither a built-in tool \(search, "
        r"calculator, python\) nor `pkg.module:function`",
    ):
        tool_set("web_fetch")


def test_close_leaves_no_worker_process():
    tools = tool_set("tools_testing:records_interval", max_workers=3)
    tools.run([ToolCall("records_interval", {"path": "/dev/null", "seconds": 0.0})] * 3)
    pids = tools.worker_pids()
    assert len(pids) == 3
    tools.close()
    assert all(wait_until_gone(pid) for pid in pids)


def test_a_failed_result_for_the_agent_loop():
    assert ToolResult.failed("malformed", "tool call 1: invalid JSON") == ToolResult(
        "tool call 1: invalid JSON", "malformed", 0.0
    )


def test_closing_the_tool_set_kills_what_a_tool_started(tmp_path):
    """A tool that returns normally but leaves a child running: the child dies with the tool set's
    close (the worker's whole process group is killed on every close, not only on a timeout)."""
    pid_file = tmp_path / "child.pid"
    with tool_set("tools_testing:starts_child") as tools:
        tools.wait_ready()
        (result,) = tools.run([ToolCall("starts_child", {"pid_file": str(pid_file)})])
        assert result == ToolResult("started", None, result.latency_s)
        child = int(pid_file.read_text())
        assert psutil.pid_exists(child)
    assert wait_until_gone(child)
