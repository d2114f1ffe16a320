"""The soak's short version: 50 steps, checkpoints every 10, phase 1 killed after step 20's checkpoint
and resumed; memory baselines 13 steps into each phase (after phase 1's first checkpoint). Memory and
fd growth within soak.py's bounds, every step logged once, nothing left running.

The long run (200 steps, figures in the final report) is `python tests/e2e/reliability/soak.py`.
"""

import pytest
from soak import check, run_soak


@pytest.mark.slow
def test_short_soak_with_a_forced_resume(workspace, tmp_path):
    report = run_soak(workspace, tmp_path / "soak", steps=50, save_freq=10, resume_at=20, warmup=13, interval_s=0.25)
    assert check(report) == [], report
    assert report["phase1"]["summary"]["roles"].keys() >= {"driver", "policy", "rollout", "reward", "ray"}
    assert report["phase2"]["summary"]["roles"].keys() >= {"driver", "policy", "rollout", "reward", "ray"}
