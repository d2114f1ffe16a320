"""No credential of the driver reaches user code (`megarl.credentials`): a driver started with a canary in
every credential variable megarl knows of withholds them, as `megarl train` does before Ray starts; then a
process it starts (as Ray's are), a reward function and a tool (each in its isolated worker) search every
environment on the machine for the canaries, and the reward function and the tool try the driver's memory."""

import hashlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

from megarl.credentials import KNOWN, SECRET_NAME

HERE = Path(__file__).parent

DRIVER = textwrap.dedent("""
    import json, subprocess, sys
    from megarl import credentials
    from megarl.config.rollout import MultiTurnConfig, ToolConfig
    from megarl.rewards import RewardScorer
    from megarl.tools import ToolCall, ToolSet

    withheld = credentials.withhold()
    digests, reward_report, tool_report = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    # Started after the withholding, as Ray's processes are: it must hold none either.
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        with RewardScorer("credentials_testing:finds_credentials", timeout_s=60, num_workers=1) as scorer:
            scorer(["p"], ["r"], digests=[digests], report=[reward_report])
        tools = (ToolConfig(function="credentials_testing:finds_credentials_tool"),)
        with ToolSet(MultiTurnConfig(enable=True, tools=tools)) as toolset:
            toolset.wait_ready()
            arguments = {"digests": ",".join(digests), "report": tool_report}
            [result] = toolset.run([ToolCall("finds_credentials_tool", arguments)])
            assert result.text == "searched", result
    finally:
        bystander.kill()
    kept = {name: credentials.credential(name) for name in withheld}
    print(json.dumps({"withheld": withheld, "kept": kept}))
""")


def test_no_credential_of_the_driver_is_readable_by_user_code(tmp_path):
    # Values unique to this test: another run on the machine cannot hold them.
    canaries = {name: f"canary-{secrets.token_hex(8)}" for name in (*KNOWN, "MY_DB_PASSWORD")}
    assert all(SECRET_NAME.search(name) for name in canaries)
    digests = [hashlib.sha256(value.encode()).hexdigest() for value in canaries.values()]
    reports = [tmp_path / "reward.json", tmp_path / "tool.json"]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(digests), *map(str, reports)],
        env={**os.environ, **canaries, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    driver = json.loads(done.stdout.splitlines()[-1])
    assert set(canaries) <= set(driver["withheld"])
    assert {name: driver["kept"][name] for name in canaries} == canaries  # megarl still has them (W&B's key)
    for report in reports:
        # Not in the driver's /proc/<pid>/environ, nor the bystander's, nor the worker's, nor anywhere else;
        # and the driver's memory, where megarl keeps them, is closed.
        assert json.loads(report.read_text()) == {"found": [], "parent_memory": "PermissionError"}, report.name
