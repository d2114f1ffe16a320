"""The training batch iterator: deterministic per-epoch shuffling and a checkpointable position."""

import itertools

import pytest

from megarl.config.sections import DataConfig
from megarl.data import DataError, Prompt, PromptLoader, iter_batches, train_loader


def make_prompts(count: int) -> list[Prompt]:
    return [Prompt(text=f"p{i}", token_ids=(i,), answer=str(i), columns={}, source=f"mem:{i}") for i in range(count)]


def texts(batches) -> list[list[str]]:
    return [[prompt.text for prompt in batch] for batch in batches]


def test_same_seed_same_order_and_each_epoch_a_different_permutation():
    prompts = make_prompts(20)
    first, second = (PromptLoader(prompts, 4, shuffle=True, seed=7) for _ in range(2))
    assert texts(itertools.islice(first, 15)) == texts(itertools.islice(second, 15))
    epoch0, epoch1 = first.epoch_order(0), first.epoch_order(1)
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1
    assert PromptLoader(prompts, 4, shuffle=True, seed=8).epoch_order(0) != epoch0


def test_an_epoch_hands_out_distinct_prompts_and_drops_the_partial_batch():
    loader = PromptLoader(make_prompts(10), 3, shuffle=True, seed=0)
    assert loader.steps_per_epoch == 3
    epoch = [prompt.text for batch in itertools.islice(loader, 3) for prompt in batch]
    assert len(set(epoch)) == 9 and loader.epoch == 0
    next(loader)
    assert (loader.epoch, loader.position) == (1, 3)


def test_without_shuffle_batches_follow_file_order_across_epochs():
    loader = PromptLoader(make_prompts(5), 2, shuffle=False, seed=0)
    assert texts(itertools.islice(loader, 3)) == [["p0", "p1"], ["p2", "p3"], ["p0", "p1"]]


def test_state_round_trip_gives_the_same_next_batches_across_an_epoch_boundary():
    prompts = make_prompts(11)
    original = PromptLoader(prompts, 4, shuffle=True, seed=3)
    for _ in range(3):  # into epoch 1 (2 batches per epoch)
        next(original)
    state = original.state_dict()
    assert (state["epoch"], state["position"]) == (1, 4)
    resumed = PromptLoader(prompts, 4, shuffle=True, seed=3)
    resumed.load_state_dict(dict(state))
    assert texts(itertools.islice(resumed, 6)) == texts(itertools.islice(original, 6))


def test_state_from_other_data_or_seed_is_refused():
    state = PromptLoader(make_prompts(8), 4, shuffle=True, seed=0).state_dict()
    with pytest.raises(DataError, match=r"num_prompts 8 → 9, seed 0 → 1"):
        PromptLoader(make_prompts(9), 4, shuffle=True, seed=1).load_state_dict(state)


def test_batch_larger_than_the_dataset_is_an_error():
    with pytest.raises(DataError, match=r"data.train_batch_size 8 is larger than the 5 training prompts"):
        PromptLoader(make_prompts(5), 8, shuffle=True, seed=0)


def test_validation_batches_cover_every_prompt_once_in_order():
    prompts = make_prompts(5)
    assert texts(iter_batches(prompts, 2)) == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert texts(iter_batches(prompts, None)) == [["p0", "p1", "p2", "p3", "p4"]]


def test_train_loader_reads_the_data_section(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)])
    data = DataConfig(train_files=(str(path),), chat_template=False, train_batch_size=3, shuffle=False)
    loader, report = train_loader(data, tokenizer)
    assert report.kept == 6
    assert [prompt.text for prompt in next(loader)] == ["q0", "q1", "q2"]
