"""The rollout's routed experts travel with their tokens: from the engines' samples into the batch's columns,
and from the batch into every micro-batch layout (padded rows, packed rows, THD, rows widened for sequence
parallelism), where each token's experts sit at that token and padding has none (-1)."""

import dataclasses

import pytest
import torch

from megarl.data import Prompt
from megarl.rollout.samples import Samples, flatten_rollouts
from megarl.trainer.generated import GeneratedBatch, decode, encode
from megarl.trainer.rollout_batch import policy_batch
from megarl.workers.micro_batches import PADDING_SEGMENT, cut_micro_batches, pad_sequence, token_counts
from megarl.workers.packing import TokenBudget
from megarl.workers.rollout.base import RolloutOutput
from megarl.workers.thd import cut_thd_micro_batches
from tests.unit.workers.three_samples import three_samples

LAYERS, TOP_K = 3, 2


def code(token_ids: torch.Tensor) -> torch.Tensor:
    """`[..., L, k]` int16: experts that name their token (distinct per token id, layer and slot)."""
    slots = torch.arange(LAYERS * TOP_K).view(LAYERS, TOP_K)
    return (token_ids[..., None, None] * 10 + slots).to(torch.int16)


def routed_three_samples():
    """`three_samples()` with routed experts on each real token up to its last counted one (what an engine
    routes), -1 elsewhere."""
    batch = three_samples()
    counts = token_counts(batch)
    columns = torch.arange(batch.prompt_length + batch.response_length)
    first = batch.prompt_length - counts[:, :1]
    known = (columns >= first) & (columns < batch.prompt_length + counts[:, 1:])
    routed = torch.where(known[..., None, None], code(batch.input_ids), torch.tensor(-1, dtype=torch.int16))
    return dataclasses.replace(batch, routed_experts=routed), known


@pytest.mark.parametrize(
    "layout",
    ["padded", "packed", "packed-fixed", "thd", "thd-fixed", "padded-sp4", "packed-sp4", "thd-sp4"],
)
def test_every_layout_keeps_each_tokens_experts_at_its_token(layout):
    batch, known = routed_three_samples()
    kind, _, multiple = layout.partition("-sp")
    fixed = kind.endswith("-fixed")
    cut = 3 if kind == "padded" else TokenBudget(6, "actor.max_tokens_per_micro_batch")
    cutter = cut_thd_micro_batches if kind.startswith("thd") else cut_micro_batches
    micro_batches = cutter(batch, cut, fixed_shape=fixed)
    if multiple:
        micro_batches = [pad_sequence(m, int(multiple)) for m in micro_batches]
    seen = 0
    for m in micro_batches:
        routed = m.routed_experts
        assert routed.shape == (*m.input_ids.shape, LAYERS, TOP_K) and routed.dtype == torch.int16
        assert (routed[m.segment_ids == PADDING_SEGMENT] == -1).all(), "padding has no experts"
        has = (routed != -1).all(dim=(-1, -2))
        assert torch.equal(routed[has], code(m.input_ids)[has]), "each token's experts sit at that token"
        seen += int(has.sum())
    assert seen == int(known.sum()), "every routed token arrives once"


def test_no_routed_experts_stay_none():
    for m in cut_micro_batches(three_samples(), TokenBudget(6, "actor.max_tokens_per_micro_batch"), fixed_shape=True):
        assert m.routed_experts is None and pad_sequence(m, 4).routed_experts is None


def _samples_with_routing() -> Samples:
    """Two prompts of 2 and 3 tokens, one sample each of 3 and 1 tokens, as an engine returns them."""
    prompts = [Prompt("a", (5, 6), "", {}, "t"), Prompt("b", (7, 8, 9), "", {}, "t")]
    outputs = []
    for prompt, response in zip(prompts, [[40, 41, 42], [50]]):
        fed = torch.tensor([*prompt.token_ids, *response][:-1])  # the last sampled token is never fed back
        outputs.append(
            RolloutOutput(list(prompt.token_ids), [response], [torch.zeros(len(response))], ["stop"], [code(fed)])
        )
    return flatten_rollouts(prompts, outputs, "g")


def test_the_batch_puts_each_samples_routing_at_its_token_columns():
    samples = _samples_with_routing()
    batch = policy_batch(samples, response_length=4)
    assert batch.routed_experts.shape == (2, 3 + 4, LAYERS, TOP_K)
    fed = (batch.routed_experts != -1).all(dim=(-1, -2))
    # Row 0: prompt left-padded by one column, response 3 tokens (its last has no routing); row 1: 3 + 1.
    assert fed.tolist() == [
        [False, True, True, True, True, False, False],
        [True, True, True, False, False, False, False],
    ]
    assert torch.equal(batch.routed_experts[fed], code(batch.input_ids)[fed])
    assert policy_batch(dataclasses.replace(samples, routed_experts=None), 4).routed_experts is None


def test_a_sample_whose_routing_has_the_wrong_length_is_refused():
    samples = _samples_with_routing()
    samples.routed_experts[1] = samples.routed_experts[1][:-1]
    with pytest.raises(ValueError, match="sample 1: the engine routed 2 tokens, expected prompt 3 \\+ response 1 - 1"):
        policy_batch(samples, response_length=4)


def test_samples_keep_their_routing_when_selected_concatenated_and_saved():
    samples = _samples_with_routing()
    assert Samples.concat([samples.select([False, True]), samples.select([True, False])]).routed_experts == [
        samples.routed_experts[1],
        samples.routed_experts[0],
    ]
    assert Samples.empty().routed_experts is None
    with pytest.raises(ValueError, match="some parts carry routed experts"):
        Samples.concat([samples, Samples.empty()])
    generated = GeneratedBatch(samples, torch.zeros(2), {}, None, 0)
    restored = decode(encode(generated, samples.prompts), samples.prompts).samples
    assert all(
        torch.equal(a, b) and b.dtype == torch.int16 for a, b in zip(samples.routed_experts, restored.routed_experts)
    )
