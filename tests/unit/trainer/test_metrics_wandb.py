"""The W&B sink with the real wandb client in offline mode: the run directory it writes is read back
with W&B's own reader (`tests/wandb_testing.py`) and matches metrics.jsonl; the run's description is
the W&B run's config; a resumed megarl run continues the same W&B run; nothing of W&B outlives the run."""

import pytest
from process_testing import wait_until_gone
from wandb_testing import history, offline_runs, summary, use_offline_wandb, wandb_processes

from megarl.trainer.sinks import METRICS_FILE, LoggerSetupError, MetricsLogger, read_metrics_file

DESCRIPTION = {
    "trainer": {"experiment_name": "exp", "loggers": ["console", "wandb"]},
    "batch_plan": {"samples_per_step": 128, "critic": None},
}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    use_offline_wandb(monkeypatch, tmp_path / "wandb-home")


def _log(run_dir, steps, resumed_step=None):
    """A MetricsLogger with the W&B sink logging `steps`; the W&B processes seen while it ran."""
    with MetricsLogger(
        run_dir,
        ["jsonl", "wandb"],
        total_steps=4,
        project_name="proj",
        experiment_name="exp",
        resumed_step=resumed_step,
        description=DESCRIPTION,
    ) as metrics_logger:
        live = wandb_processes()
        for step in steps:
            metrics_logger.log(step, {"reward/mean": step / 4, "actor/grad_norm": 1.5 * step})
    return live


def test_offline_run_matches_metrics_jsonl_holds_the_description_and_leaves_no_process(offline, tmp_path, capfd):
    run_dir = tmp_path / "run"
    live = _log(run_dir, [1, 2, 3])
    assert live, "the W&B client started no service process: is the sink using the real client?"
    assert all(wait_until_gone(process.pid) for process in live), [p.pid for p in live]
    output = capfd.readouterr()
    # quiet: where the data went and how to sync it, not W&B's banner and run-history table.
    assert "Run history" not in output.err and "Tracking run with wandb" not in output.err, output.err
    [wandb_run] = offline_runs(run_dir)
    jsonl = [(record.pop("step"), record) for record in read_metrics_file(run_dir / METRICS_FILE)]
    assert history(wandb_run) == jsonl and [step for step, _ in jsonl] == [1, 2, 3]
    run = summary(wandb_run)
    assert (run["state"], run["project"], run["name"]) == ("finished", "proj", "exp")
    assert run["run_id"] == (run_dir / "wandb_run_id").read_text()
    assert {name: value for name, value in run["config"].items() if name != "_wandb"} == DESCRIPTION


def test_resumed_run_continues_the_same_wandb_run(offline, tmp_path):
    run_dir = tmp_path / "run"
    _log(run_dir, [1, 2, 3])
    _log(run_dir, [3, 4], resumed_step=2)  # stopped after step 3, resumed from step 2's checkpoint
    first, resumed = offline_runs(run_dir)  # offline, each start writes its own file; `wandb sync` joins them
    assert summary(first)["run_id"] == summary(resumed)["run_id"] == (run_dir / "wandb_run_id").read_text()
    assert [step for step, _ in history(resumed)] == [3, 4]


def test_online_without_an_api_key_is_a_setup_error_naming_the_fixes(tmp_path, monkeypatch):
    """W&B's own refusal (wandb.errors.UsageError, raised before any network call) becomes one clear
    error; W&B's service does not stay behind."""
    use_offline_wandb(monkeypatch, tmp_path / "wandb-home")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    with pytest.raises(
        LoggerSetupError, match=r"No API key configured.*WANDB_API_KEY.*WANDB_MODE=offline.*drop 'wandb'"
    ):
        MetricsLogger(tmp_path / "run", ["wandb"], total_steps=1)
    assert not wandb_processes()
