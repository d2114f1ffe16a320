"""`agent/*` metrics of multi-turn steps: per-sample means, error kinds, endings, masked share."""

import torch

from megarl.rollout import Trajectory
from megarl.trainer.metrics import AGENT_METRICS, agent_metrics, undocumented


def test_agent_metrics_count_turns_calls_errors_endings_and_masked_tokens():
    calling = Trajectory(
        messages=[{"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}],
        ended="answer",
        tool_calls=1,
        tool_errors={"timeout": 1},
        tool_latency_s=[2.0],
        observations_truncated=1,
    )
    plain = Trajectory(messages=[{"role": "assistant"}], ended="turn_length")
    masks = [torch.tensor([True, False, False, True]), torch.tensor([True, True, True, True])]
    metrics = agent_metrics([calling, plain], masks)
    assert metrics["agent/turns/mean"] == 1.5
    assert metrics["agent/tool_calls/mean"] == 0.5 and metrics["agent/tool_call_rate"] == 0.5
    assert metrics["agent/tool_errors/mean"] == 0.5 and metrics["agent/tool_errors/timeout"] == 0.5
    assert metrics["agent/tool_errors/raised"] == 0.0
    assert metrics["agent/tool_latency_s/mean"] == 2.0 == metrics["agent/tool_latency_s/max"]
    assert metrics["agent/masked_token_fraction"] == 2 / 8
    assert metrics["agent/observations_truncated/mean"] == 0.5
    assert metrics["agent/ended/answer"] == 0.5 == metrics["agent/ended/turn_length"]
    assert metrics["agent/ended/max_turns"] == 0.0
    # Every name is documented, and every documented name is logged (stable keys for dashboards).
    assert set(metrics) == set(AGENT_METRICS) and undocumented(metrics) == []
