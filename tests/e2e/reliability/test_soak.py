"""The soak's short version: 50 steps, checkpoints every 10, phase 1 killed after step 20's checkpoint
and resumed; memory baselines 13 steps into each phase (after phase 1's first checkpoint). Memory and
fd growth within soak.py's bounds, every step logged once, nothing left running.

Phase 1's end is also the killed-rank fault (once tests/e2e/reliability/test_process_faults.py's whole
job of its own): a policy rank killed inside the actor update ends the job promptly (soak.KILL_TO_EXIT_S),
exit 1, one line naming the role, rank, process, node, step and phase (the update, or a phase right after
it when the update ended before the signal landed: the hand-over's offload, or the weight sync, where an
engine's broken receive is what the driver hears first; the dead policy rank must be the one named either
way), its records ending at the step before, and its newest checkpoint intact: the one `checkpoint.resume=auto` continues from in phase 2.

The long run (200 steps, figures in the final report) is `python tests/e2e/reliability/soak.py`.
"""

import re

import pytest
from soak import check, run_soak

SAVE_FREQ = 10


@pytest.mark.slow
def test_short_soak_with_a_forced_resume(workspace, tmp_path):
    report = run_soak(
        workspace, tmp_path / "soak", steps=50, save_freq=SAVE_FREQ, resume_at=20, warmup=13, interval_s=0.25
    )
    assert check(report) == [], report
    assert report["phase1"]["summary"]["roles"].keys() >= {"driver", "policy", "rollout", "reward", "ray"}
    assert report["phase2"]["summary"]["roles"].keys() >= {"driver", "policy", "rollout", "reward", "ray"}

    phase1 = report["phase1"]
    assert phase1["exit_code"] == 1
    [failure] = phase1["failure"]
    found = re.fullmatch(
        rf"megarl train: failed during step (\d+) \((update_actor|offload|sync)\): WorkerFailure: policy rank [01] failed:\n"
        rf"\(process {phase1['killed_pid']} on node [\d.]+\).*",
        failure,
    )
    assert found, failure
    failed_step = int(found.group(1))
    assert phase1["last_step"] == failed_step - 1
    assert report["resumed_from"] == failed_step - 1 - (failed_step - 1) % SAVE_FREQ
