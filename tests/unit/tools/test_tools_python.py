"""The python tool runs code in a fresh limited process: stdout back, errors as their last line, CPU and wall
limits, bounded memory and output (what the sandbox keeps out: test_tools_python_sandbox.py), under each
backend of its sandbox."""

import pytest

import megarl.tools.builtin.python as python_tool
from megarl.tools.builtin.python import python

pytestmark = pytest.mark.usefixtures("sandbox_backend")


def test_stdout_comes_back():
    assert python("for i in range(3):\n    print(i * i)") == "0\n1\n4"


def test_an_exception_is_its_last_line_after_what_was_printed():
    assert python("print('before')\nraise ValueError('bad value')") == "before\nValueError: bad value"
    assert python("def f(:\n  pass") == "SyntaxError: invalid syntax"


def test_no_output_says_how_to_get_some():
    assert python("x = 1") == "(no output: print() the values you want to see)"


def test_a_busy_loop_is_stopped_by_the_cpu_limit(monkeypatch):
    monkeypatch.setattr(python_tool, "CPU_S", 1)
    monkeypatch.setattr(python_tool, "WALL_S", 60.0)
    assert python("while True:\n    pass") == "Error: the program used more than 1 s of CPU time and was stopped"


def test_a_sleeping_program_is_stopped_by_the_wall_clock_limit(monkeypatch):
    monkeypatch.setattr(python_tool, "WALL_S", 1.0)
    assert (
        python("print('started', flush=True)\nimport time\ntime.sleep(60)")
        == "started\nError: the program ran longer than 1 s and was stopped"
    )


def test_a_big_allocation_is_refused():
    assert python("block = bytearray(2 * 1024 ** 3)\nprint('allocated')") == "MemoryError"


def test_long_output_is_cut():
    text = python("print('x' * 100000)")
    assert text == "x" * python_tool.OUTPUT_CHARS + f"\n... (output cut at {python_tool.OUTPUT_CHARS} characters)"


def test_the_code_sees_none_of_the_workers_environment(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_PLAIN_SETTING", "x")
    assert python("import os\nprint(sorted(k for k in os.environ if k.startswith('MEGARL')))") == "[]"
