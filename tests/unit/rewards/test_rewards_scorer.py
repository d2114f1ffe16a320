"""User reward functions run isolated: ok, raising, crashing, hanging (killed), bad results (run stops), no secrets."""

import os
import signal
from pathlib import Path

import psutil
import pytest
from process_testing import wait_until_gone

from megarl.rewards import RewardFunctionError, RewardScorer, resolve_reward_function, worker_environment
from megarl.rewards.gsm8k import gsm8k_reward
from megarl.rewards.math_answer import math_reward


def test_scores_come_back_in_order_across_chunks_and_workers():
    with RewardScorer("rewards_testing:first_letter_matches", timeout_s=30, num_workers=2, chunk_size=2) as scorer:
        result = scorer(["p"] * 5, ["apple", "bee", "cat", "dog", "egg"], answer=["a", "x", "c", "x", "e"])
        assert result.scores == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert result.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/failed_samples": 0.0}
        # The same worker processes serve the next call.
        pids = scorer.worker_pids()
        assert scorer(["p"], ["a"], answer=["a"]).scores == [1.0]
        assert scorer.worker_pids() == pids


def test_an_exception_scores_its_call_zero_and_is_counted():
    with RewardScorer("rewards_testing:raises_on_boom", timeout_s=30, num_workers=1, chunk_size=2) as scorer:
        result = scorer(["p"] * 4, ["ok", "boom", "ok", "ok"])
        assert result.scores == [0.0, 0.0, 1.0, 1.0]
        assert result.metrics["reward/errors"] == 1 and result.metrics["reward/failed_samples"] == 2


def test_a_function_that_kills_its_worker_is_counted_and_the_worker_replaced():
    with RewardScorer("rewards_testing:exits_on_crash", timeout_s=30, num_workers=1, chunk_size=1) as scorer:
        before = scorer.worker_pids()
        result = scorer(["p"] * 3, ["ok", "crash", "ok"])
        assert result.scores == [1.0, 0.0, 1.0] and result.metrics["reward/errors"] == 1
        assert scorer.worker_pids() != before


def test_a_hung_call_is_killed_with_what_it_started_scored_zero_and_counted(tmp_path):
    pid_file = str(tmp_path / "pids")
    with RewardScorer("rewards_testing:hangs_on_hang", timeout_s=2, num_workers=2, chunk_size=1) as scorer:
        result = scorer(["p", "p"], ["fine", "hang"], pid_file=[pid_file, pid_file])
        assert result.scores == [1.0, 0.0]
        assert result.metrics == {"reward/errors": 0.0, "reward/timeouts": 1.0, "reward/failed_samples": 1.0}
        worker_pid, child_pid = map(int, Path(pid_file).read_text().split())
        assert wait_until_gone(worker_pid) and wait_until_gone(child_pid)
        assert worker_pid not in scorer.worker_pids()
        assert scorer(["p", "p"], ["fine", "fine"], pid_file=[pid_file, pid_file]).scores == [1.0, 1.0]


def test_a_worker_that_died_between_calls_is_replaced():
    with RewardScorer("rewards_testing:first_letter_matches", timeout_s=30, num_workers=1) as scorer:
        scorer(["p"], ["a"], answer=["a"])
        (pid,) = scorer.worker_pids()
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        assert wait_until_gone(pid)
        assert scorer(["p"], ["a"], answer=["a"]).scores == [1.0]
        assert scorer.worker_pids() != [pid]


def test_a_module_that_hangs_on_import_stops_the_run_and_is_killed():
    scorer = RewardScorer("rewards_testing_hung_import:score", timeout_s=30, num_workers=1, startup_timeout_s=1)
    (pid,) = scorer.worker_pids()
    with pytest.raises(
        RewardFunctionError,
        match=r"'rewards_testing_hung_import:score': the reward worker did not "
        r"start within 1 s",
    ):
        scorer(["p"], ["a"])
    assert wait_until_gone(pid)
    scorer.close()


def test_close_leaves_no_worker_process():
    scorer = RewardScorer("rewards_testing:first_letter_matches", timeout_s=30, num_workers=2)
    scorer(["p"], ["a"], answer=["a"])
    pids = scorer.worker_pids()
    scorer.close()
    assert all(wait_until_gone(pid) for pid in pids)


@pytest.mark.parametrize(
    "function, message",
    [
        ("one_score_too_few", r"'rewards_testing:one_score_too_few' returned 2 scores for 3 responses"),
        ("strings", r"'rewards_testing:strings' returned '1.0' \(str\) as score 0"),
        (
            "not_a_number",
            r"'rewards_testing:not_a_number' returned nan \(float\) as score 0; every score must be a finite",
        ),
    ],
)
def test_a_bad_result_stops_the_run_naming_the_function(function, message):
    with RewardScorer(f"rewards_testing:{function}", timeout_s=30, num_workers=1) as scorer:
        with pytest.raises(RewardFunctionError, match=message):
            scorer(["p"] * 3, ["a", "b", "c"])


def test_an_unresolvable_function_stops_the_run_at_its_first_call():
    with RewardScorer("rewards_testing:no_such_function", timeout_s=30, num_workers=1) as scorer:
        with pytest.raises(RewardFunctionError, match=r"has no attribute 'no_such_function'"):
            scorer(["p"], ["a"])


def test_secrets_of_the_driver_do_not_reach_the_reward_process(monkeypatch):
    secrets = ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "MY_DB_PASSWORD"]
    for name in secrets:
        monkeypatch.setenv(name, "do-not-leak")
    monkeypatch.setenv("MEGARL_TEST_PLAIN_SETTING", "visible")
    names = secrets + ["MEGARL_TEST_PLAIN_SETTING"]
    with RewardScorer("rewards_testing:sees_variables", timeout_s=30, num_workers=1) as scorer:
        assert scorer(["p"] * 5, ["r"] * 5, variable=names).scores == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_worker_environment_drops_credential_names_and_sets_the_import_path():
    environment = worker_environment(
        {
            "HF_TOKEN": "x",
            "GITHUB_TOKEN": "x",
            "OPENAI_API_KEY": "x",
            "db_password": "x",
            "GOOGLE_APPLICATION_CREDENTIALS": "x",
            "PATH": "/bin",
        }
    )
    assert set(environment) == {"PATH", "PYTHONPATH"}


def test_resolve_names_the_spec_and_the_problem():
    assert resolve_reward_function("gsm8k") is gsm8k_reward
    assert resolve_reward_function("math") is math_reward
    with pytest.raises(
        RewardFunctionError,
        match=r"'no_such_pkg_xyz.rewards:score': module no_such_pkg_xyz.rewards "
        r"cannot be imported \(ModuleNotFoundError",
    ):
        resolve_reward_function("no_such_pkg_xyz.rewards:score")
    with pytest.raises(RewardFunctionError, match=r"rewards_testing.NOT_CALLABLE is a int, not a function"):
        resolve_reward_function("rewards_testing:NOT_CALLABLE")
    with pytest.raises(
        RewardFunctionError, match=r"'bleu': neither a built-in \(gsm8k, math, qa_em, code\) nor a function path"
    ):
        resolve_reward_function("bleu")


def test_closing_the_scorer_kills_what_a_reward_function_started(tmp_path, monkeypatch):
    """A reward function that leaves a child process running: the child dies when the scorer closes."""
    (tmp_path / "leaky_reward.py").write_text(
        "import os, subprocess\n\n"
        "def score(prompts, responses, **columns):\n"
        "    child = subprocess.Popen(['sleep', '3600'])\n"
        f"    open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "    return [1.0] * len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardScorer("leaky_reward:score", timeout_s=10, num_workers=1) as scorer:
        assert scorer(["p"], ["r"]).scores == [1.0]
        child = int((tmp_path / "child.pid").read_text())
        assert psutil.pid_exists(child)
    assert wait_until_gone(child)  # killed with the worker's group
