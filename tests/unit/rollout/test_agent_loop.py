"""The agent loop's token bookkeeping, with scripted engines and tools (no model).

The engines stand in for the rollout WorkerGroup (`call_each("generate", [(contexts, sampling, caps, seeds)])`,
as `megarl.workers.rollout.rollout_worker.RolloutWorker.generate` takes them): each turn's text is a
function of the context, so every expected token is known. The char tokenizer and its chat template
are the tiny model's (`megarl.models.tiny`), so observations come from a real template. The parser
reads `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes; the real parser is tested in
tests/unit/tools).
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from transformers.utils import get_json_schema

from megarl.config.rollout import MultiTurnConfig
from megarl.data import Prompt
from megarl.models.tiny import build_char_tokenizer
from megarl.rollout import AgentLoop, ObservationEncoder
from megarl.tools import CallError, ParsedTurn, ToolCall, ToolResult, parser_for
from megarl.trainer.metrics import agent_metrics
from megarl.trainer.rollout_batch import policy_batch, token_level_scores
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class Parser:
    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for body in CALL.findall(text):
            try:
                data = json.loads(body)
                calls.append(ToolCall(data["name"], data["arguments"]))
            except (ValueError, KeyError):
                errors.append(CallError("malformed", f"malformed tool call: {body}"))
        return ParsedTurn(calls, errors)


def done(result) -> Future:
    future = Future()
    future.set_result(result)
    return future


@dataclass
class Tools:
    """`add` returns the sum at once; any other name is an unknown tool; every submit is recorded
    (`megarl.tools.ToolSet.submit`: one future per call)."""

    runs: list[list[ToolCall]] = field(default_factory=list)

    def submit(self, calls):
        self.runs.append(list(calls))
        return [self.start(call) for call in calls]

    def start(self, call: ToolCall) -> Future:
        return done(
            ToolResult(str(call.arguments["a"] + call.arguments["b"]), None, 0.01)
            if call.name == "add"
            else ToolResult.failed("unknown_tool", f"unknown tool {call.name}", 0.01)
        )


def call_text(a: int, b: int, name: str = "add") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


class ScriptedEngines:
    """Each engine answers a context by `script(prompt_text, turn)`: the text of that turn, ended by EOS.
    Turn = the number of observations (`tool: ` lines) in the context. A turn's log-probs are
    `-(1 + k) / 100` for its k-th token, so each token's log-prob is known."""

    def __init__(self, world_size: int, script):
        self.world_size = world_size
        self.script = script
        self.requests: list[tuple[list[int], int, int]] = []
        """(context, seed, cap) of every request."""

    def call_each(self, method, args):
        assert method == "generate" and len(args) == self.world_size
        results = []
        for contexts, sampling, caps, seeds in args:
            assert sampling.n == 1
            outputs = []
            for context, cap, seed in zip(contexts, caps, seeds, strict=True):
                self.requests.append((list(context), seed, cap))
                text = TOKENIZER.decode(context)
                ids = TOKENIZER.encode(self.script(text, text.count("\ntool: ")), add_special_tokens=False) + [EOS]
                reason = "length" if len(ids) > cap else "stop"
                ids = ids[:cap]
                log_probs = torch.tensor([-(1 + k) / 100 for k in range(len(ids))])
                outputs.append(RolloutOutput(list(context), [ids], [log_probs], [reason]))
            results.append(outputs)
        return results


def prompts(count: int) -> list[Prompt]:
    rendered = [
        TOKENIZER.apply_chat_template(
            [{"role": "user", "content": f"q{k}"}], tokenize=False, add_generation_prompt=True
        )
        for k in range(count)
    ]
    return [
        Prompt(text, tuple(TOKENIZER.encode(text, add_special_tokens=False)), None, {}, "test") for text in rendered
    ]


def loop(engines, tools=None, **settings) -> AgentLoop:
    config = MultiTurnConfig(enable=True, **{"max_turns": 4, "max_total_tokens": 1000, **settings})
    return AgentLoop(
        engines,
        tools or Tools(),
        Parser(),
        ObservationEncoder(TOKENIZER),
        lambda ids: TOKENIZER.decode(ids, skip_special_tokens=False),
        config,
    )


def three_calls_then_answer(text: str, turn: int) -> str:
    return call_text(turn, 10) if turn < 3 else "the answer"


SAMPLING = SamplingConfig(n=2, max_new_tokens=200, seed=1000, stop_token_ids=(EOS,))


def test_loss_mask_is_exactly_the_observations_over_three_tool_turns():
    engines = ScriptedEngines(2, three_calls_then_answer)
    samples = loop(engines)(prompts(3), SAMPLING, "1.0")

    assert len(samples) == 6 and samples.index == ["1.0/0", "1.0/0", "1.0/1", "1.0/1", "1.0/2", "1.0/2"]
    for _prompt, ids, mask, log_probs, trajectory in zip(
        samples.prompts, samples.response_ids, samples.loss_masks, samples.rollout_log_probs, samples.trajectories
    ):
        expected_ids, expected_mask, expected_lp = [], [], []
        turn_text = ""
        for turn in range(4):
            turn_ids = TOKENIZER.encode(three_calls_then_answer("", turn), add_special_tokens=False) + [EOS]
            expected_ids += turn_ids
            expected_mask += [True] * len(turn_ids)
            expected_lp += [-(1 + k) / 100 for k in range(len(turn_ids))]
            if turn == 3:
                break
            turn_text = TOKENIZER.decode(turn_ids, skip_special_tokens=False)
            observation = TOKENIZER.encode(f"\ntool: {turn + 10}\nassistant: ", add_special_tokens=False)
            expected_ids += observation
            expected_mask += [False] * len(observation)
            expected_lp += [0.0] * len(observation)
        assert turn_text.endswith("</tool_call></s>")
        assert ids == expected_ids
        assert mask.tolist() == expected_mask
        torch.testing.assert_close(log_probs, torch.tensor(expected_lp), rtol=0, atol=0)
        assert trajectory.turns == 4 and trajectory.tool_calls == 3 and trajectory.ended == "answer"
        assert TOKENIZER.decode(trajectory.final_turn, skip_special_tokens=True) == "the answer"
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["10", "11", "12"]

    # The engines saw exactly prompt + everything so far at every turn: token in, token out.
    final = {tuple(p.token_ids) + tuple(ids) for p, ids in zip(samples.prompts, samples.response_ids)}
    for context, _, _ in engines.requests:
        assert any(full[: len(context)] == tuple(context) for full in final)


def test_the_batch_trains_on_model_tokens_and_scores_the_last_one():
    samples = loop(ScriptedEngines(1, three_calls_then_answer))(prompts(2), SAMPLING, "1.0")
    batch = policy_batch(samples, 1000)
    for row, (ids, mask) in enumerate(zip(samples.response_ids, samples.loss_masks)):
        assert batch.responses[row, : len(ids)].tolist() == ids
        assert batch.response_mask[row].tolist() == mask.tolist() + [False] * (1000 - len(ids))
    scores = token_level_scores(torch.arange(1.0, len(samples) + 1), batch.response_mask)
    for row, ids in enumerate(samples.response_ids):
        # The answer turn is last: the score sits on its EOS, the last response token.
        assert scores[row].nonzero().flatten().tolist() == [len(ids) - 1]


def test_token_level_score_skips_a_trailing_observation():
    mask = torch.tensor([[True, True, False, False, False]])
    assert token_level_scores(torch.tensor([2.0]), mask).tolist() == [[0.0, 2.0, 0.0, 0.0, 0.0]]


def test_seeds_are_unique_per_turn_and_inside_the_reserved_block():
    engines = ScriptedEngines(2, three_calls_then_answer)
    loop(engines)(prompts(3), SAMPLING, "1.0")
    seeds = [seed for _, seed, _ in engines.requests]
    assert len(seeds) == 6 * 4 and len(set(seeds)) == len(seeds)
    assert min(seeds) == 1000 and max(seeds) < 1000 + 6 * 4


def test_a_trajectory_is_cut_at_max_total_tokens_mid_observation():
    first_turn = len(TOKENIZER.encode(call_text(0, 10), add_special_tokens=False)) + 1
    budget = first_turn + 5
    samples = loop(ScriptedEngines(1, three_calls_then_answer), max_total_tokens=budget)(prompts(1), SAMPLING, "1.0")
    for ids, mask, finish, trajectory in zip(
        samples.response_ids, samples.loss_masks, samples.finish_reasons, samples.trajectories
    ):
        assert len(ids) == budget and finish == "length" and trajectory.ended == "max_total_tokens"
        assert mask.tolist() == [True] * first_turn + [False] * 5
        assert trajectory.tool_calls == 1


def test_each_turn_asks_for_no_more_than_the_budget_left():
    engines = ScriptedEngines(1, three_calls_then_answer)
    loop(engines, max_total_tokens=100)(prompts(1), SamplingConfig(n=1, max_new_tokens=80, seed=0), "x")
    (context0, _, cap0), (context1, _, cap1) = engines.requests[:2]
    assert cap0 == 80 and cap1 == 100 - (len(context1) - len(context0))


def test_turn_length_max_turns_and_tool_errors_end_or_count():
    # A turn cut by rollout.max_new_tokens ends the trajectory.
    cut = loop(ScriptedEngines(1, three_calls_then_answer))(
        prompts(1), SamplingConfig(n=1, max_new_tokens=5, seed=0), "x"
    )
    assert cut.trajectories[0].ended == "turn_length" and cut.trajectories[0].tool_calls == 0
    # Always calling: ends after max_turns, the last turn's calls not run.
    tools = Tools()
    always = loop(ScriptedEngines(1, lambda text, turn: call_text(1, 2)), tools, max_turns=3)(prompts(1), SAMPLING, "x")
    assert [t.ended for t in always.trajectories] == ["max_turns"] * 2
    assert len(tools.runs) == 2 and all(t.tool_calls == 2 for t in always.trajectories)
    # An unknown tool and a malformed call become observations, counted by kind; the loop goes on.
    script = lambda text, turn: (call_text(1, 2, "nope") + "<tool_call>{oops</tool_call>") if turn == 0 else "done"  # noqa: E731
    errors = loop(ScriptedEngines(1, script))(prompts(1), SAMPLING, "x")
    trajectory = errors.trajectories[0]
    assert trajectory.tool_errors == {"unknown_tool": 1, "malformed": 1} and trajectory.tool_calls == 2
    assert trajectory.ended == "answer" and trajectory.turns == 2
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert observations == ["unknown tool nope", "malformed tool call: {oops"]


class HugeTools(Tools):
    """`add` answers 1 MB of text (issue 33: one such result per call took a step from ~2 s to 135 s)."""

    def start(self, call: ToolCall) -> Future:
        return done(ToolResult("7" * 1_000_000, None, 0.01))


class RecordingTokenizer:
    """The char tokenizer, recording the longest text it was asked to encode."""

    def __init__(self):
        self.longest = 0

    def encode(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return TOKENIZER.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(TOKENIZER, name)


def test_a_1_mb_tool_result_is_cut_to_max_observation_tokens_and_counted():
    tokenizer = RecordingTokenizer()
    script = lambda text, turn: call_text(1, 2) + call_text(3, 4) if turn == 0 else "done"  # noqa: E731
    agent = AgentLoop(
        ScriptedEngines(1, script),
        HugeTools(),
        Parser(),
        ObservationEncoder(tokenizer),
        lambda ids: TOKENIZER.decode(ids, skip_special_tokens=False),
        MultiTurnConfig(enable=True, max_turns=4, max_total_tokens=1000, max_observation_tokens=50),
    )
    samples = agent(prompts(1), SamplingConfig(n=1, max_new_tokens=200, seed=0), "x")
    trajectory = samples.trajectories[0]
    note = "\n[truncated: the first 50 tokens of 1000000 characters]"
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["7" * 50 + note] * 2
    assert trajectory.observations_truncated == 2 and trajectory.ended == "answer"
    assert agent_metrics(samples.trajectories, samples.loss_masks)["agent/observations_truncated/mean"] == 2
    observation = (~samples.loss_masks[0]).sum().item()  # the two capped results inside the template's turn
    assert 2 * (50 + len(note)) <= observation < 2 * (50 + len(note)) + 40
    assert tokenizer.longest < 10_000  # the megabyte itself was never tokenized


def add(a: int, b: int) -> str:
    """Add two integers (the `add` of `Tools`, for its schema).

    Args:
        a: A number.
        b: Another.
    """
    return str(a + b)


def test_a_call_that_does_not_fit_its_schema_is_answered_without_running_and_counted():
    """With the real parser given the tools' schemas: a call missing an argument never reaches the tools
    (`Tools.add` would raise a KeyError), its observation says what is wrong, it counts as bad_arguments."""
    tools = Tools()
    script = lambda text, turn: call_text(1, 2).replace(', "b": 2', "") if turn == 0 else "done"  # noqa: E731
    agent = AgentLoop(
        ScriptedEngines(1, script),
        tools,
        parser_for("hermes", [get_json_schema(add)]),
        ObservationEncoder(TOKENIZER),
        lambda ids: TOKENIZER.decode(ids, skip_special_tokens=False),
        MultiTurnConfig(enable=True, max_turns=4, max_total_tokens=1000),
    )
    trajectory = agent(prompts(1), SamplingConfig(n=1, max_new_tokens=200, seed=0), "x").trajectories[0]
    assert tools.runs == []
    assert trajectory.tool_errors == {"bad_arguments": 1} and trajectory.tool_calls == 1 and trajectory.turns == 2
    assert trajectory.messages[1] == {
        "role": "tool",
        "name": "add",
        "content": "tool call 1 (add): missing required "
        "argument 'b'; add takes a (integer, required), b (integer, required)",
    }


@dataclass
class BlockingTools(Tools):
    """`add` as in `Tools`; `slow` answers only once `release` is set (from its own thread, as a tool
    worker would), or "never released" after a minute: a safety net so that a loop that waits for every
    call fails the test instead of hanging it."""

    release: threading.Event = field(default_factory=threading.Event)

    def start(self, call: ToolCall) -> Future:
        if call.name != "slow":
            return super().start(call)
        future = Future()
        threading.Thread(target=self._answer, args=(future,), daemon=True).start()
        return future

    def _answer(self, future: Future) -> None:
        future.set_result(ToolResult("42" if self.release.wait(timeout=60) else "never released", None, 0.01))


def test_a_slow_tool_holds_back_only_its_own_trajectory():
    """Prompt q0's samples call `slow`, which answers only once another trajectory asks for its fourth
    turn: the others generate turns 1..3 in waves of their own while the call runs, then q0's join."""
    tools = BlockingTools()

    def script(text: str, turn: int) -> str:
        if "q0" in text:
            return call_text(0, 0, "slow") if turn == 0 else "the answer"
        if turn == 3:
            tools.release.set()
        return three_calls_then_answer(text, turn)

    engines = ScriptedEngines(2, script)
    samples = loop(engines, tools, straggler_wait_s=0.0)(prompts(3), SAMPLING, "1.0")

    slow_rows, fast_rows = samples.trajectories[:2], samples.trajectories[2:]
    assert [m["content"] for t in slow_rows for m in t.messages if m["role"] == "tool"] == ["42", "42"]
    assert all(t.turns == 2 and t.ended == "answer" for t in slow_rows)
    assert all(t.turns == 4 and t.ended == "answer" for t in fast_rows)
    # Prompt order whatever the timing; each row is its prompt's.
    assert samples.index == ["1.0/0", "1.0/0", "1.0/1", "1.0/1", "1.0/2", "1.0/2"]
    assert [p.text for p in samples.prompts] == [p.text for p in prompts(3) for _ in range(2)]
    # q0's second turn was generated after the others' fourth: they did not wait for its tool.
    turns = [
        (TOKENIZER.decode(context).count("\ntool: "), "q0" in TOKENIZER.decode(context))
        for context, _, _ in engines.requests
    ]
    assert turns.index((1, True)) > max(k for k, (turn, slow) in enumerate(turns) if turn == 3 and not slow)
    # The same requests (context and seed) as with every tool answering at once: seeds follow the
    # trajectory and its turn, not the wave it was generated in.
    instant, answering = ScriptedEngines(2, script), BlockingTools()
    answering.release.set()
    loop(instant, answering, straggler_wait_s=0.0)(prompts(3), SAMPLING, "1.0")
    assert sorted(engines.requests) == sorted(instant.requests) and len(engines.requests) == 2 * 2 + 4 * 4


@pytest.mark.parametrize("engines", [1, 3])
def test_single_turn_answers_match_the_plain_rollout(engines):
    """Without tool calls the loop is one turn: the same ids, seeds and masks as `single_turn`."""
    from megarl.rollout import single_turn

    scripted = ScriptedEngines(engines, lambda text, turn: "plain")

    class TwoArgEngines(ScriptedEngines):
        def call_each(self, method, args):
            return super().call_each(
                method, [(c, s, [s.max_new_tokens] * len(c), [s.seed + i for i in range(len(c))]) for c, s in args]
            )

    agent = loop(scripted)(prompts(4), SAMPLING, "s")
    plain = single_turn(TwoArgEngines(engines, lambda text, turn: "plain"), prompts(4), replace_n1(SAMPLING), "s")
    assert agent.response_ids == [ids for ids in plain.response_ids for _ in range(2)]
    assert all(m.all() for m in agent.loss_masks)


def replace_n1(sampling):
    from dataclasses import replace

    return replace(sampling, n=1)


def test_dapo_dynamic_sampling_runs_on_top_of_the_agent_loop_and_the_reward_sees_trajectories():
    """The trainer's rollout phase with `algorithm.dynamic_sampling` over the agent loop: groups whose
    trajectories all score alike are dropped and more rounds run; the reward function gets each sample's
    last turn as the response and its messages as the `trajectory` column."""
    from pathlib import Path

    from megarl.cluster.timing import PhaseTimer
    from megarl.config.loader import load_config
    from megarl.rewards.scorer import RewardResult
    from megarl.trainer.rollout import RolloutPhase

    config = load_config(
        Path(__file__).resolve().parents[3] / "configs" / "agent_quickstart.yaml",
        [
            "algorithm.dynamic_sampling.enable=true",
            "algorithm.dynamic_sampling.max_rounds=4",
            "data.train_batch_size=2",
        ],
    )
    seen = []

    def scorer(prompts, responses, **columns):
        seen.append((responses, columns["trajectory"]))
        # Prompt q0 and q2 groups vary (the tool answered 10 for the first sample only), q1 does not.
        return RewardResult(
            [
                1.0 if r == "the answer" and "q1" not in p and i % 2 == 0 else 0.0
                for i, (p, r) in enumerate(zip(prompts, responses))
            ],
            {"reward/failed_samples": 0.0},
        )

    batches = iter([prompts(2), [prompts(3)[2], prompts(2)[1]], prompts(3)[1:]])
    phase = RolloutPhase(
        config,
        loop(ScriptedEngines(1, three_calls_then_answer)),
        scorer,
        lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
        lambda: next(batches),
        PhaseTimer(),
    )
    samples, scores, metrics = phase(SamplingConfig(n=2, max_new_tokens=200, seed=0, stop_token_ids=(EOS,)), step=1)

    assert metrics["dapo/rounds"] == 2.0 and len(samples) == 4  # q0 kept in round 0, q2 in round 1; q1 dropped
    assert {s.text for s in samples.prompts} == {prompts(3)[0].text, prompts(3)[2].text}
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    responses, trajectories = seen[0]
    assert responses == ["the answer"] * 4  # the last turn, not the whole response
    assert [m["role"] for m in trajectories[0]] == ["assistant", "tool"] * 3 + ["assistant"]


class RoutingEngines(ScriptedEngines):
    """`ScriptedEngines` that also return routing, as an engine asked for routed experts does: for every token a
    request fed (its context, then its tokens but the last), `[request number, position]` (one layer, k = 2)."""

    def __init__(self, world_size: int, script):
        super().__init__(world_size, script)
        self.fed: list[tuple[list[int], int]] = []
        """(context, tokens fed) of every request, in request order."""

    def call_each(self, method, args):
        results = super().call_each(method, args)
        for output in (output for outputs in results for output in outputs):
            fed = len(output.prompt_token_ids) + len(output.response_token_ids[0]) - 1
            positions = torch.arange(fed, dtype=torch.int16)
            number = torch.full((fed,), len(self.fed), dtype=torch.int16)
            output.routed_experts = [torch.stack([number, positions], dim=-1)[:, None]]
            self.fed.append((output.prompt_token_ids, fed))
        return results


def first_feeders(engines: RoutingEngines, tokens: list[int]) -> list[int]:
    """Per position of `tokens` (prompt + response) but the last: the first request that fed it, -1 if none."""
    mine = [(number, fed) for number, (context, fed) in enumerate(engines.fed) if tokens[: len(context)] == context]
    return [next((number for number, fed in mine if position < fed), -1) for position in range(len(tokens) - 1)]


@pytest.mark.parametrize("cut", [False, True], ids=["answered", "cut-in-an-observation"])
def test_each_token_keeps_the_routing_of_the_call_that_fed_it_first(cut):
    """Routing replay over several turns: each turn's call routes the whole context again, and a token keeps
    the routing of the call that fed it first (the one it was sampled under: the turn that generated it, the
    next turn for a turn's last token and for an observation); a closing observation no call fed gets -1."""
    first_turn = len(TOKENIZER.encode(call_text(0, 10), add_special_tokens=False)) + 1
    engines = RoutingEngines(2, three_calls_then_answer)
    samples = loop(engines, max_total_tokens=first_turn + 5 if cut else 1000)(
        prompts(3), SamplingConfig(n=1, max_new_tokens=200, seed=0), "x"
    )
    batch = policy_batch(samples, 1000)  # the batch takes them: one row per token fed, at its columns
    assert batch.routed_experts is not None
    for prompt, ids, routed, trajectory in zip(
        samples.prompts, samples.response_ids, samples.routed_experts, samples.trajectories, strict=True
    ):
        tokens = list(prompt.token_ids) + ids
        feeders = first_feeders(engines, tokens)
        assert routed[:, 0, 0].tolist() == feeders
        assert [p for p, f in enumerate(feeders) if f >= 0] == routed[:, 0, 1][routed[:, 0, 1] >= 0].tolist()
        assert len(set(feeders) - {-1}) == trajectory.turns  # every turn's call fed some of them first
        assert (-1 in feeders) == (trajectory.ended == "max_total_tokens")
