"""The console sink: the per-step line, the ETA in plain (non-TTY) output, the progress bar on a terminal."""

import io
import re

from megarl.trainer.sinks import ConsoleSink, console_line

SAMPLE = {
    "reward/mean": 0.625,
    "reward/std": 0.25,
    "response_length/mean": 12.5,
    "response_length/clip_ratio": 0.125,
    "actor/kl": 0.0012,
    "actor/entropy": 2.31,
    "actor/pg_clipfrac": 0.02,
    "actor/grad_norm": 0.84,
    "sync/logprob_max_abs_diff": 3.1e-7,
    "perf/tokens_per_s": 850.0,
    "timing/step": 2.41,
    "timing/rollout": 1.2,
    "timing/update_actor": 0.9,
}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _ticks(*values):
    it = iter(values)
    return lambda: next(it)


def test_console_line_shows_the_step_and_each_headline_metric():
    line = console_line(3, 10, SAMPLE)
    assert "\n" not in line
    for part in (
        "step 3/10",
        "reward 0.625",
        "len 12.5",
        "len_clip 0.125",
        "kl 0.0012",
        "ent 2.31",
        "pg_clip 0.02",
        "gnorm 0.84",
        "sync_gap 3.1e-07",
        "tok/s 850",
        "time 2.41s (rollout 1.2 update_actor 0.9)",
    ):
        assert part in line, part


def test_console_line_leaves_out_what_the_step_did_not_log():
    line = console_line(1, 5, {"reward/mean": 1.0})
    assert line == "step 1/5 | reward 1"


def test_plain_output_has_one_line_per_step_with_the_eta():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=5, resumed_step=None, stream=stream, clock=_ticks(100.0, 110.0, 120.0))
    sink.log(1, SAMPLE)  # 10 s per step so far, 4 steps left
    sink.log(2, SAMPLE)
    sink.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1/5 | reward 0.625")
    assert lines[0].endswith("elapsed 0:00:10 eta 0:00:40")
    assert lines[1].endswith("elapsed 0:00:20 eta 0:00:30")
    assert "\r" not in stream.getvalue()


def test_eta_of_a_resumed_run_counts_only_its_own_steps():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=10, resumed_step=3, stream=stream, clock=_ticks(0.0, 6.0))
    sink.log(4, {})
    assert stream.getvalue() == "step 4/10 | elapsed 0:00:06 eta 0:00:36\n"


def test_terminal_gets_a_progress_bar_under_the_lines():
    stream = _Terminal()
    sink = ConsoleSink(total_steps=10, resumed_step=None, stream=stream)
    sink.log(1, SAMPLE)
    sink.log(2, SAMPLE)
    sink.close()
    output = stream.getvalue()
    assert console_line(2, 10, SAMPLE) in output
    bar = output.rsplit(console_line(2, 10, SAMPLE), 1)[1]  # redrawn below the newest line
    assert re.search(r"2/10 \[\d\d:\d\d<\d\d:\d\d", bar)  # steps done, elapsed<remaining
